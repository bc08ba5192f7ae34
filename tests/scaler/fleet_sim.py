"""A fleet for the scaler's scenarios: a real scheduler, the SaladCloud double, scripted workers.

Each instance the double reports running gets one scripted worker (tests/scheduler/harness.py)
that connects as the instance's machine id, as SALAD_MACHINE_ID makes a real worker do; an
instance that vanishes, is removed or moves to another machine takes its worker with it (a
worker holding a lease drains first, as SIGTERM makes a real one do, and the removal is
written down: scale-in must never hit one). What a worker does with a lease is its machine's
`Script`. The test moves time (`SimClock`) and calls `sync()` after each change to the double.

`LedgerWatch.until(predicate)` waits for a condition on the ledger, re-checked whenever the
ledger NOTIFYs (a job event, a lease end, new work), within a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as jpb
from tests.scaler.salad_double import SaladDouble
from tests.support.artifacts import checkpoint_blob
from tests.support.workers import (
    LEASE_SECRETS,
    ScriptedWorker,
    connect_worker,
    http_put,
    local_identity,
)

WAIT_S = 30.0


class SimClock:
    """The scaler's clock: wall time plus what the test advanced (no real waiting)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@dataclass
class Lease:
    granted: fpb.LeaseGranted

    @property
    def ref(self) -> fpb.LeaseRef:
        return fpb.LeaseRef(lease_id=self.granted.lease.lease_id, epoch=self.granted.lease.epoch)

    @property
    def job_id(self) -> str:
        return self.granted.lease.job_id

    @property
    def resumed_from(self) -> int | None:
        steps = [c.checkpoint.step for c in self.granted.urls.checkpoints]
        return max(steps) if steps else None


@dataclass
class SimWorker:
    machine_id: str
    worker: ScriptedWorker | None = None
    lease: Lease | None = None
    task: asyncio.Task[None] | None = None
    grants: list[Lease] = field(default_factory=list)
    # Set when the worker's script is done with a lease (finished, failed, or holding it).
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    # Holding scripts wait on this to finish their job.
    release: asyncio.Event = field(default_factory=asyncio.Event)
    # URL renewals, read by the stream's one reader and handed to the script.
    urls: asyncio.Queue[fpb.UrlsRenewed] = field(default_factory=asyncio.Queue)

    async def store_checkpoint(self, lease: Lease, step: int, data: bytes | None = None) -> None:
        """As the harness's, with the stream read by FleetSim's reader (one reader a stream)."""
        assert self.worker is not None
        data = checkpoint_blob(step) if data is None else data
        slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=step)
        await self.worker.send(urls_requested=fpb.UrlsRequested(lease=lease.ref, slots=[slot]))
        async with asyncio.timeout(WAIT_S):
            renewed = await self.urls.get()
        (upload,) = renewed.urls.uploads
        await http_put(upload.url, data)
        await self.worker.send(
            checkpoint_committed=fpb.CheckpointCommitted(
                lease=lease.ref,
                step=step,
                key=upload.key,
                size_bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )


# What a worker does with a grant; returns when it has finished or failed the job, or is
# holding it (then `sim.hold(w)` until released or revoked).
Script = Callable[["FleetSim", SimWorker, Lease], Awaitable[None]]


async def pace(w: SimWorker, lease: Lease, *, s_per_step: float, steps: int = 20) -> int:
    """Heartbeats from the resume point over `steps` steps at this pace (what the worker says),
    with a checkpoint at the first and the last (what the scheduler observes: `steps` steps in
    the milliseconds between them, far faster than any claimed pace); returns the last step.
    Acknowledged: the checkpoint's URL round-trip means the scheduler has processed the
    heartbeats before it."""
    assert w.worker is not None
    start = (lease.resumed_from or 0) + 1
    await w.worker.heartbeat(lease.granted.lease, start, seconds_per_step=s_per_step)
    await w.store_checkpoint(lease, start)
    end = start + steps
    await w.worker.heartbeat(lease.granted.lease, end, seconds_per_step=s_per_step)
    await w.store_checkpoint(lease, end)
    return end


async def finish(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
    assert w.worker is not None
    step = await pace(w, lease, s_per_step=1.0, steps=2)
    await w.worker.store_result(lease.granted, step + 1)


async def fail_node(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
    assert w.worker is not None
    await w.worker.send(
        job_failed=fpb.JobFailed(
            lease=lease.ref,
            failure_class=jpb.FAILURE_CLASS_NODE,
            message="CUDA error: an illegal memory access was encountered",
        )
    )


def hold(s_per_step: float) -> Script:
    """Runs at this pace past the warm-up, then holds the job until released (then finishes)
    or revoked."""

    async def script(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        assert w.worker is not None
        step = await pace(w, lease, s_per_step=s_per_step)
        w.settled.set()
        await w.release.wait()
        if w.lease is lease:
            await w.worker.store_result(lease.granted, step + 1)

    return script


class FleetSim:
    def __init__(
        self,
        *,
        channel: grpc.aio.Channel,
        token: str,
        double: SaladDouble,
        scripts: Callable[[str], Script],
        identity_secret: str = "",
    ) -> None:
        # With the scheduler's identity secret, every worker proves its machine id (the local
        # supervisor's token standing in for SaladCloud's): the scaler acts only on those.
        self.identity_secret = identity_secret
        self.channel = channel
        self.token = token
        self.double = double
        self.scripts = scripts
        self.workers: dict[str, SimWorker] = {}
        # Machines whose worker was taken away while it held a lease (scale-in must not).
        self.killed_while_leased: list[str] = []
        self.history: list[SimWorker] = []
        self._scripts: set[asyncio.Task[None]] = set()

    def running_machines(self) -> set[str]:
        states = self.double.states()
        return {i.machine_id for i in self.double.instances.values() if states[i.id] == "running"}

    async def sync(self) -> None:
        """One worker per running instance: start the new ones, stop the gone ones."""
        running = self.running_machines()
        for machine_id in [m for m in self.workers if m not in running]:
            await self._stop(self.workers.pop(machine_id))
        for machine_id in sorted(running - set(self.workers)):
            w = SimWorker(machine_id=machine_id)
            self.workers[machine_id] = w
            self.history.append(w)
            connected = asyncio.Event()
            w.task = asyncio.create_task(self._run(w, connected))
            async with asyncio.timeout(WAIT_S):
                await connected.wait()

    async def _stop(self, w: SimWorker) -> None:
        if w.lease is not None and w.worker is not None:
            self.killed_while_leased.append(w.machine_id)
            # SIGTERM: a real worker checkpoints, drains and closes its stream; the stream is
            # cut only once the scheduler has ended it (or after a bounded wait), so that the
            # Draining is read, as a real worker's is, and not lost with a cancelled call.
            with contextlib.suppress(Exception):
                await w.worker.send(draining=fpb.Draining(lease=w.lease.ref, reason="SIGTERM"))
                await w.worker.call.done_writing()
            if w.task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(w.task), timeout=5.0)
        if w.task is not None:
            w.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w.task

    async def _run(self, w: SimWorker, connected: asyncio.Event) -> None:
        identity = (
            local_identity(self.identity_secret, w.machine_id) if self.identity_secret else None
        )
        async with connect_worker(
            self.channel, self.token, w.machine_id, identity=identity
        ) as worker:
            w.worker = worker
            connected.set()
            await worker.send(ready=fpb.Ready())
            while True:
                message = await worker.call.read()
                if message is grpc.aio.EOF:
                    return
                kind = message.WhichOneof("message")
                if kind == "lease_granted":
                    granted = message.lease_granted
                    LEASE_SECRETS[granted.lease.lease_id] = granted.lease_secret
                    lease = Lease(granted)
                    w.lease = lease
                    w.grants.append(lease)
                    w.settled.clear()
                    # The script runs beside the reader, which must see a revocation meanwhile.
                    task = asyncio.create_task(self._script(w, lease))
                    self._scripts.add(task)
                    task.add_done_callback(self._scripts.discard)
                elif kind == "urls_renewed":
                    w.urls.put_nowait(message.urls_renewed)
                elif kind == "lease_revoked" and _holds(w, message.lease_revoked.lease):
                    w.lease = None
                    w.release.set()
                    await worker.send(ready=fpb.Ready())

    async def _script(self, w: SimWorker, lease: Lease) -> None:
        await self.scripts(w.machine_id)(self, w, lease)
        assert w.worker is not None
        if w.lease is lease:
            w.lease = None
            await w.worker.send(ready=fpb.Ready())
        w.settled.set()

    async def close(self) -> None:
        for task in list(self._scripts):
            task.cancel()
        for w in list(self.workers.values()):
            if w.task is not None:
                w.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w.task
        self.workers.clear()


def _holds(w: SimWorker, ref: fpb.LeaseRef) -> bool:
    return w.lease is not None and w.lease.granted.lease.lease_id == ref.lease_id


class LedgerWatch:
    """Waits for conditions on the ledger, woken by its NOTIFYs (never by a timer)."""

    CHANNELS = ("lorafleet_job_event", "lorafleet_work", "lorafleet_lease_ended")

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.changed = asyncio.Event()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, dsn: str) -> AsyncIterator[LedgerWatch]:
        conn = await asyncpg.connect(dsn)
        watch = cls(conn)
        try:
            for channel in cls.CHANNELS:
                await conn.add_listener(channel, lambda *_a: watch.changed.set())
            yield watch
        finally:
            await conn.close()

    async def until(
        self, predicate: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
    ) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    self.changed.clear()
                    if await predicate():
                        return
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"timed out waiting until {what}") from None

    async def value(self, sql: str, *args: Any) -> Any:
        return await self.conn.fetchval(sql, *args)

    async def count_jobs(self, state: str) -> int:
        count: int = await self.conn.fetchval("SELECT count(*) FROM jobs WHERE state = $1", state)
        return count
