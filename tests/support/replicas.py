"""Scheduler replicas as real processes, and a TCP load balancer in front of them.

`scheduler_process` runs `python -m lorafleet.app.main scheduler` over a shared Postgres and a
shared data directory (one objects directory and storage secret: shared storage), and keeps
its log. `TcpBalancer` forwards each new connection to the next replica in turn, as a load
balancer in TCP mode with a TCP-connect health check does: a replica frozen with SIGSTOP still
accepts connections (its kernel does), so it stays in the rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SHARED_STORAGE_SECRET = "shared-secret-for-both-replicas-0123456789"


@dataclass
class SchedulerProcess:
    proc: asyncio.subprocess.Process
    port: int
    # Every line it wrote to stderr so far (its log).
    lines: list[str] = field(default_factory=list)

    def freeze(self) -> None:
        """SIGSTOP: the process stops; its kernel still accepts connections and ACKs data."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    @property
    def log(self) -> str:
        return "".join(self.lines)


def shared_data_dir(path: Path) -> Path:
    """A data directory two replicas can share: one objects directory, one storage secret."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "storage-secret").write_text(SHARED_STORAGE_SECRET + "\n")
    return path


@asynccontextmanager
async def scheduler_process(
    database_url: str, data_dir: Path, env: Mapping[str, str]
) -> AsyncIterator[SchedulerProcess]:
    """A scheduler process on a free loopback port; on exit SIGTERM (SIGCONT first, in case
    the test left it frozen) and a bounded wait."""
    full_env = dict(
        os.environ,
        DATABASE_URL=database_url,
        LORAFLEET_DATABASE_POOL_SIZE="6",
        **env,
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
        env=full_env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    stderr = proc.stderr
    lines: list[str] = []
    port = 0
    drain: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(90):
            while not port:
                line = (await stderr.readline()).decode(errors="replace")
                assert line, "scheduler exited before listening:\n" + "".join(lines)[-3000:]
                lines.append(line)
                if match := re.search(r"listening on port (\d+)", line):
                    port = int(match.group(1))

        async def keep_reading() -> None:
            while line := await stderr.readline():
                lines.append(line.decode(errors="replace"))

        drain = asyncio.create_task(keep_reading())
        yield SchedulerProcess(proc=proc, port=port, lines=lines)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if drain is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await drain


@dataclass
class TcpBalancer:
    """Round-robin TCP forwarding to `targets` (ports on loopback). `routed` counts the
    connections each target got."""

    targets: Sequence[int]
    port: int = 0
    routed: list[int] = field(default_factory=list)
    _next: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> None:
        self.routed = [0] * len(self.targets)
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.targets:
            writer.transport.abort()
            return
        index = self._next % len(self.targets)
        self._next += 1
        self.routed[index] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.targets[index])
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def retarget(self, targets: Sequence[int]) -> None:
        """New connections go to `targets` from now on (empty: each is closed at once, as a
        load balancer with no healthy backend does); open ones are left alone."""
        self.targets = list(targets)
        self.routed = [0] * len(self.targets)
        self._next = 0

    def route_next_to(self, index: int) -> None:
        """The next new connection goes to `targets[index]` (then round-robin from there)."""
        self._next = index

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class PostgresGate:
    """A loopback TCP front for a Postgres (TCP host and port, or a unix socket directory as
    the embedded server's `?host=` URLs name it). `down()` is an outage: every connection is
    reset and new ones are closed at once; `up()` ends it. `url` is `database_url` through it."""

    database_url: str
    port: int = 0
    is_down: bool = False
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def _target(self) -> tuple[str, int] | str:
        parts = urlsplit(self.database_url)
        host = dict(parse_qsl(parts.query)).get("host") or parts.hostname or "127.0.0.1"
        port = parts.port or 5432
        if host.startswith("/"):
            return f"{host}/.s.PGSQL.{port}"
        return (host, port)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        parts = urlsplit(self.database_url)
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in ("host", "port")])
        user = f"{parts.username}@" if parts.username else ""
        if parts.password:
            user = f"{parts.username}:{parts.password}@"
        return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}", query=query))

    def down(self) -> None:
        self.is_down = True
        for writer in list(self._writers):
            writer.transport.abort()

    def up(self) -> None:
        self.is_down = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            writer.transport.abort()
            return
        target = self._target()
        try:
            if isinstance(target, str):
                up_reader, up_writer = await asyncio.open_unix_connection(target)
            else:
                up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.ensure_future(TcpBalancer._pump(reader, up_writer)),
            asyncio.ensure_future(TcpBalancer._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self.down()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
