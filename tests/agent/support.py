"""Helpers for the agent tests: a JobService client, test images, a cuttable TCP proxy."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc

RESOLUTION = 64
# Every wait in these tests is bounded by this (CPU training on two shared cores is slow).
WAIT_S = 120.0


def png(seed: int, size: int = RESOLUTION) -> bytes:
    """A smooth random picture, so training sees real gradients."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32)
    channels = [
        127.5 + 127.5 * np.sin(rng.uniform(0.02, 0.2) * xs + rng.uniform(0.02, 0.2) * ys + p)
        for p in rng.uniform(0, 6.28, 3)
    ]
    array = np.stack(channels, axis=-1).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def job_spec(**overrides: Any) -> pb.JobSpec:
    """A tiny, fast job on the 64 px test images."""
    fields: dict[str, Any] = dict(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="dogs/rex",
        max_train_steps=4,
        checkpointing_steps=2,
        resolution=RESOLUTION,
        seed=7,
        learning_rate=1e-2,
    )
    fields.update(overrides)
    return pb.JobSpec(**fields)


@dataclass
class JobClient:
    """JobService calls as one owner over a real channel."""

    stub: pbgrpc.JobServiceStub
    api_key: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    async def submit(self, **overrides: Any) -> pb.Job:
        response: pb.SubmitJobResponse = await self.stub.SubmitJob(
            pb.SubmitJobRequest(spec=job_spec(**overrides)), metadata=self.metadata, timeout=30
        )
        return response.job

    async def get(self, job_id: str) -> pb.Job:
        response: pb.GetJobResponse = await self.stub.GetJob(
            pb.GetJobRequest(job_id=job_id), metadata=self.metadata, timeout=30
        )
        return response.job

    async def cancel(self, job_id: str) -> pb.Job:
        response: pb.CancelJobResponse = await self.stub.CancelJob(
            pb.CancelJobRequest(job_id=job_id), metadata=self.metadata, timeout=30
        )
        return response.job

    async def events(self, job_id: str) -> list[pb.JobEvent]:
        response: pb.ListJobEventsResponse = await self.stub.ListJobEvents(
            pb.ListJobEventsRequest(job_id=job_id), metadata=self.metadata, timeout=30
        )
        return list(response.events)

    async def watch(self, job_id: str) -> AsyncIterator[tuple[pb.Job, pb.JobEvent | None]]:
        """The job, then every event of its timeline (replayed from the start) as it happens."""
        call = self.stub.WatchJob(
            pb.WatchJobRequest(job_id=job_id, after_event_id=0), metadata=self.metadata
        )
        try:
            async for response in call:
                yield response.job, (response.event if response.HasField("event") else None)
        finally:
            call.cancel()

    async def wait_for(
        self,
        job_id: str,
        until: Callable[[pb.Job, pb.JobEvent | None], bool],
        timeout: float = WAIT_S,  # noqa: ASYNC109
    ) -> tuple[pb.Job, pb.JobEvent | None]:
        """The first (job, event) of the timeline for which `until` holds."""

        async def scan() -> tuple[pb.Job, pb.JobEvent | None]:
            async for job, event in self.watch(job_id):
                if until(job, event):
                    return job, event
            raise AssertionError(f"job {job_id} ended without the expected event")

        return await asyncio.wait_for(scan(), timeout)

    async def wait_event(
        self,
        job_id: str,
        kind: pb.JobEventKind.ValueType,
        where: Callable[[pb.JobEvent], bool] = lambda _e: True,
        timeout: float = WAIT_S,  # noqa: ASYNC109
    ) -> pb.JobEvent:
        _, event = await self.wait_for(
            job_id, lambda _j, e: e is not None and e.kind == kind and where(e), timeout
        )
        assert event is not None
        return event

    async def wait_state(
        self,
        job_id: str,
        state: pb.JobState.ValueType,
        timeout: float = WAIT_S,  # noqa: ASYNC109
    ) -> pb.Job:
        job, _ = await self.wait_for(job_id, lambda j, _e: j.state == state, timeout)
        return job


def kinds(events: list[pb.JobEvent]) -> list[str]:
    return [pb.JobEventKind.Name(e.kind).removeprefix("JOB_EVENT_KIND_") for e in events]


@dataclass
class TcpProxy:
    """Forwards loopback TCP to `target_port`; `cut()` drops every open connection at once,
    as a network failure would, while new connections keep working."""

    target_port: int
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    connections: int = 0
    # While set, bytes from clients are swallowed: what a client writes is lost on the way.
    blackhole: bool = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, upstream=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, upstream=False)),
        ]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if upstream and self.blackhole:
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def cut(self) -> None:
        """Resets every forwarded connection (both sides see the connection die)."""
        for writer in list(self._writers):
            writer.transport.abort()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self.cut()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
