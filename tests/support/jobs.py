"""The one JobService client of the suite: calls as one owner over a real channel, and
event-driven, bounded waits on a job's timeline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from tests.support.images import RESOLUTION

# Waits on a scheduler driven by scripted workers: everything happens in milliseconds.
WAIT_S = 15.0
# Waits on real training (CPU, two shared cores): a few steps of the tiny model can take a while.
TRAINING_WAIT_S = 120.0

OWNER = "alice"
PREFIX = "dogs/rex"

# What scripted workers are handed: never trained, so any size will do.
SCRIPTED_SPEC: dict[str, Any] = dict(
    instance_prompt="a photo of sks dog",
    instance_data_prefix=PREFIX,
    max_train_steps=100,
    checkpointing_steps=10,
)
# A tiny, fast job on the 64 px test pictures, for real workers.
TRAINING_SPEC: dict[str, Any] = dict(
    instance_prompt="a photo of sks dog",
    instance_data_prefix=PREFIX,
    max_train_steps=4,
    checkpointing_steps=2,
    resolution=RESOLUTION,
    seed=7,
    learning_rate=1e-2,
)


def spec(**overrides: Any) -> pb.JobSpec:
    """A job spec for scripted workers."""
    return pb.JobSpec(**{**SCRIPTED_SPEC, **overrides})


def job_spec(**overrides: Any) -> pb.JobSpec:
    """A job spec for real workers: tiny and fast."""
    return pb.JobSpec(**{**TRAINING_SPEC, **overrides})


@dataclass
class JobClient:
    """JobService calls as one owner. `submit` fills in `defaults`; waits are bounded by
    `wait_s` unless a call says otherwise."""

    stub: pbgrpc.JobServiceStub
    api_key: str
    defaults: dict[str, Any] = field(default_factory=lambda: dict(SCRIPTED_SPEC))
    wait_s: float = WAIT_S

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    async def submit(self, **overrides: Any) -> pb.Job:
        response: pb.SubmitJobResponse = await self.stub.SubmitJob(
            pb.SubmitJobRequest(spec=pb.JobSpec(**{**self.defaults, **overrides})),
            metadata=self.metadata,
            timeout=30,
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

    async def wait_until(
        self,
        job_id: str,
        until: Callable[[pb.Job, pb.JobEvent | None], bool],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> tuple[pb.Job, pb.JobEvent | None]:
        """The first (job, event) of the timeline for which `until` holds."""

        async def scan() -> tuple[pb.Job, pb.JobEvent | None]:
            async for job, event in self.watch(job_id):
                if until(job, event):
                    return job, event
            raise AssertionError(f"job {job_id} ended without the expected event")

        return await asyncio.wait_for(scan(), self.wait_s if timeout is None else timeout)

    async def wait_for(
        self,
        job_id: str,
        predicate: Callable[[pb.Job], bool],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> pb.Job:
        """The job once `predicate` holds for it."""
        job, _ = await self.wait_until(job_id, lambda j, _e: predicate(j), timeout)
        return job

    async def wait_event(
        self,
        job_id: str,
        kind: pb.JobEventKind.ValueType,
        where: Callable[[pb.JobEvent], bool] = lambda _e: True,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> pb.JobEvent:
        _, event = await self.wait_until(
            job_id, lambda _j, e: e is not None and e.kind == kind and where(e), timeout
        )
        assert event is not None
        return event

    async def wait_state(
        self,
        job_id: str,
        state: pb.JobState.ValueType,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> pb.Job:
        return await self.wait_for(job_id, lambda j: j.state == state, timeout)


def kinds(events: list[pb.JobEvent]) -> list[str]:
    return [pb.JobEventKind.Name(e.kind).removeprefix("JOB_EVENT_KIND_") for e in events]
