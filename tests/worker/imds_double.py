"""An EC2 instance metadata double (IMDSv2) over HTTP on loopback: session tokens, the spot
interruption notice (404 until a test posts one), and the instance id."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class ImdsDouble:
    notice: dict[str, str] | None = None
    instance_id: str = "i-0123456789abcdef0"
    instance_id_reads: int = 0
    # The signed instance identity document (IMDS /latest/dynamic/instance-identity/...).
    identity_document: bytes = b""
    identity_signature: bytes = b""
    tokens: set[str] = field(default_factory=set)
    token_puts: int = 0
    polls: int = 0
    # Set on every notice request, so a test can wait for the watcher to look.
    polled: asyncio.Event = field(default_factory=asyncio.Event)
    base_url: str = ""
    _runner: web.AppRunner | None = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def start(self) -> str:
        app = web.Application()
        app.router.add_put("/latest/api/token", self._token)
        app.router.add_get("/latest/meta-data/spot/instance-action", self._notice)
        app.router.add_get("/latest/meta-data/instance-id", self._instance_id)
        app.router.add_get("/latest/dynamic/instance-identity/document", self._document)
        app.router.add_get("/latest/dynamic/instance-identity/signature", self._signature)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def expire_tokens(self) -> None:
        self.tokens.clear()

    async def _token(self, request: web.Request) -> web.Response:
        ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return web.Response(status=400)
        self.token_puts += 1
        token = f"token-{next(self._ids)}"
        self.tokens.add(token)
        return web.Response(text=token)

    async def _notice(self, request: web.Request) -> web.Response:
        self.polls += 1
        self.polled.set()
        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        if self.notice is None:
            return web.Response(status=404)
        return web.json_response(self.notice)

    async def _instance_id(self, request: web.Request) -> web.Response:
        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        self.instance_id_reads += 1
        return web.Response(text=self.instance_id)

    async def _document(self, request: web.Request) -> web.Response:
        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        return web.Response(body=self.identity_document, content_type="text/plain")

    async def _signature(self, request: web.Request) -> web.Response:
        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)
        # EC2 serves the base64 text wrapped over several lines.
        text = self.identity_signature
        return web.Response(body=b"\n".join(text[i : i + 64] for i in range(0, len(text), 64)))
