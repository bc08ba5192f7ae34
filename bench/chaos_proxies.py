"""Fault-injecting proxies for the chaos benchmark, on 127.0.0.1 only.

* `FaultyHttpProxy` (aiohttp): workers reach object storage through it. It forwards each
  request to the first upstream that answers (the two scheduler replicas serve the one local
  store) and, by a seeded draw per request, answers 503 instead, resets the connection, or
  delays the response.
* `CuttingTcpProxy` (asyncio streams): workers reach the schedulers' gRPC port through it. It
  forwards each connection to the first upstream that accepts (so a killed replica's workers
  land on the other) and cuts live connections on demand: the worker's stream breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web

# Hop-by-hop headers a proxy must not forward.
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection", "host"}
)


@dataclass(frozen=True, kw_only=True)
class HttpFaults:
    """Per-request probabilities."""

    error_5xx: float = 0.02
    reset: float = 0.01
    slow: float = 0.03
    slow_s: float = 1.5


class FaultyHttpProxy:
    def __init__(self, upstreams: Sequence[str], faults: HttpFaults, seed: int) -> None:
        self._upstreams = list(upstreams)
        self._faults = faults
        self._rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.enabled = True
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=60), auto_decompress=False
        )
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _draw(self) -> str:
        if not self.enabled:
            return "pass"
        roll = self._rng.random()
        f = self._faults
        if roll < f.error_5xx:
            return "5xx"
        if roll < f.error_5xx + f.reset:
            return "reset"
        if roll < f.error_5xx + f.reset + f.slow:
            return "slow"
        return "pass"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._draw()
        self.counts[fault] += 1
        body = await request.read()
        if fault == "5xx":
            return web.Response(status=503, text="injected fault", headers={"Retry-After": "0"})
        if fault == "reset":
            transport = request.transport
            if transport is not None:
                transport.abort()
            return web.Response(status=500)  # written nowhere: the connection is gone
        if fault == "slow":
            await asyncio.sleep(self._faults.slow_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert self._session is not None
        last: Exception | None = None
        for upstream in self._upstreams:
            try:
                async with self._session.request(
                    request.method,
                    upstream + request.path_qs,
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                ) as answer:
                    data = await answer.read()
                    out = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
                    out.pop("Content-Length", None)
                    return web.Response(status=answer.status, body=data, headers=out)
            except aiohttp.ClientConnectionError as exc:
                last = exc
        self.counts["no_upstream"] += 1
        return web.Response(status=502, text=f"no upstream answered: {last}")


class CuttingTcpProxy:
    def __init__(self, upstreams: Sequence[tuple[str, int]], seed: int) -> None:
        self._upstreams = list(upstreams)
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._live: set[asyncio.Task[None]] = set()
        self._pairs: dict[
            asyncio.Task[None], tuple[asyncio.StreamWriter, asyncio.StreamWriter]
        ] = {}
        self.cuts = 0
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._live):
            task.cancel()
        await asyncio.gather(*self._live, return_exceptions=True)

    def cut(self, count: int) -> int:
        """Cuts up to `count` live connections picked at random; returns how many."""
        tasks = [t for t in self._pairs if not t.done()]
        victims = self._rng.sample(tasks, min(count, len(tasks)))
        for task in victims:
            for writer in self._pairs[task]:
                transport = writer.transport
                transport.abort()
        self.cuts += len(victims)
        return len(victims)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        start = self._rng.randrange(len(self._upstreams))
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        for i in range(len(self._upstreams)):
            host, port = self._upstreams[(start + i) % len(self._upstreams)]
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
                break
            except (OSError, TimeoutError):
                continue
        if upstream is None:
            writer.transport.abort()
            return
        up_reader, up_writer = upstream
        self._live.add(task)
        self._pairs[task] = (writer, up_writer)
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self._live.discard(task)
            self._pairs.pop(task, None)
            for w in (writer, up_writer):
                w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
