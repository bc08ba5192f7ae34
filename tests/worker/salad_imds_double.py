"""A SaladCloud instance metadata service (IMDS) double over HTTP on loopback.

It holds requests to what SaladCloud's IMDS description says: every operation requires the
header `Metadata: true` (refused with 400 otherwise), and `POST /v1/reallocate` takes a
`ReallocatePrototype` body, parsed here with the SDK's own model (a missing or out-of-bounds
`reason` is a 400). Accepted calls answer 204 and are recorded; `status` makes it answer
something else (403 off SaladCloud, 500 to exercise the SDK's retries).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web
from salad_cloud_imds_sdk.models import ReallocatePrototype


@dataclass
class SaladImdsDouble:
    # The status to answer with instead of 204 (None: accept).
    status: int | None = None
    reallocations: list[ReallocatePrototype] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    # What GET /v1/token answers (the instance's identity token).
    jwt: str = "header.payload.signature"
    # Set on every request, accepted or not, so a test can wait for the call.
    called: asyncio.Event = field(default_factory=asyncio.Event)
    base_url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/reallocate", self._reallocate)
        app.router.add_get("/v1/token", self._token)
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

    def _error(self, status: int, detail: str) -> web.Response:
        self.refused.append(detail)
        body = {"code": "invalid-request", "detail": detail, "status": status}
        return web.json_response(body, status=status)

    async def _reallocate(self, request: web.Request) -> web.Response:
        try:
            if request.headers.get("Metadata") != "true":
                return self._error(400, "the Metadata: true header is required")
            if request.content_type != "application/json":
                return self._error(400, f"content type {request.content_type!r}")
            try:
                body = ReallocatePrototype._unmap(json.loads(await request.read()))
            except (ValueError, TypeError) as exc:
                return self._error(400, f"body: {exc}")
            if self.status is not None:
                return self._error(self.status, "refused by the test")
            self.reallocations.append(body)
            return web.Response(status=204)
        finally:
            self.called.set()

    async def _token(self, request: web.Request) -> web.Response:
        try:
            if request.headers.get("Metadata") != "true":
                return self._error(400, "the Metadata: true header is required")
            if self.status is not None:
                return self._error(self.status, "refused by the test")
            return web.json_response({"jwt": self.jwt})
        finally:
            self.called.set()
