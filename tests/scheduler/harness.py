"""A scripted worker and an authenticated client, driving a real scheduler over loopback gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc

WAIT_S = 15.0


def spec(**overrides: Any) -> pb.JobSpec:
    fields: dict[str, Any] = dict(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="dogs/rex",
        max_train_steps=100,
        checkpointing_steps=10,
    )
    fields.update(overrides)
    return pb.JobSpec(**fields)


@dataclass
class UserClient:
    """JobService calls as one owner."""

    stub: pbgrpc.JobServiceStub
    api_key: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    async def submit(self, **overrides: Any) -> pb.Job:
        response: pb.SubmitJobResponse = await self.stub.SubmitJob(
            pb.SubmitJobRequest(spec=spec(**overrides)), metadata=self.metadata, timeout=WAIT_S
        )
        return response.job

    async def get(self, job_id: str) -> pb.Job:
        response: pb.GetJobResponse = await self.stub.GetJob(
            pb.GetJobRequest(job_id=job_id), metadata=self.metadata, timeout=WAIT_S
        )
        return response.job

    async def cancel(self, job_id: str) -> pb.Job:
        response: pb.CancelJobResponse = await self.stub.CancelJob(
            pb.CancelJobRequest(job_id=job_id), metadata=self.metadata, timeout=WAIT_S
        )
        return response.job

    async def wait_for(self, job_id: str, predicate: Callable[[pb.Job], bool]) -> pb.Job:
        """Watches the job until `predicate` holds (event-driven, bounded by WAIT_S)."""
        stream = self.stub.WatchJob(
            pb.WatchJobRequest(job_id=job_id), metadata=self.metadata, timeout=WAIT_S
        )
        async for response in stream:
            if predicate(response.job):
                stream.cancel()
                job: pb.Job = response.job
                return job
        raise AssertionError(f"job {job_id} ended without meeting the condition")

    async def events(self, job_id: str) -> list[pb.JobEvent]:
        response: pb.ListJobEventsResponse = await self.stub.ListJobEvents(
            pb.ListJobEventsRequest(job_id=job_id), metadata=self.metadata, timeout=WAIT_S
        )
        return list(response.events)


@dataclass
class ScriptedWorker:
    """One worker stream whose every message the test writes by hand."""

    machine_id: str
    call: Any
    received: list[fpb.ConnectResponse] = field(default_factory=list)
    welcome: fpb.Welcome | None = None

    async def send(self, **message: Any) -> None:
        await self.call.write(fpb.ConnectRequest(**message))

    async def expect(self, kind: str, timeout: float = WAIT_S) -> Any:  # noqa: ASYNC109
        """Reads until a message of `kind` arrives; others are kept in `received`."""

        async def read() -> Any:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    raise AssertionError(f"stream ended while waiting for {kind}")
                self.received.append(message)
                if message.WhichOneof("message") == kind:
                    return getattr(message, kind)

        return await asyncio.wait_for(read(), timeout)

    async def ready_for_lease(self) -> fpb.LeaseGranted:
        await self.send(ready=fpb.Ready())
        granted: fpb.LeaseGranted = await self.expect("lease_granted")
        return granted

    async def heartbeat(self, lease: fpb.Lease, step: int, **extra: Any) -> None:
        await self.send(
            heartbeat=fpb.Heartbeat(
                lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch), step=step, **extra
            )
        )

    def ref(self, lease: fpb.Lease) -> fpb.LeaseRef:
        return fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch)


@asynccontextmanager
async def connect_worker(
    channel: grpc.aio.Channel,
    token: str,
    machine_id: str,
    *,
    vram_mb: int = 81_920,
    held: fpb.LeaseRef | None = None,
    qualified: bool = True,
) -> AsyncIterator[ScriptedWorker]:
    stub = fgrpc.WorkerServiceStub(channel)
    call = stub.Connect(metadata=(("authorization", f"Bearer {token}"),))
    worker = ScriptedWorker(machine_id=machine_id, call=call)
    hello = fpb.Hello(
        machine_id=machine_id,
        provider_instance_id=f"instance-{machine_id}",
        gpu_model="NVIDIA H200",
        vram_mb=vram_mb,
        qualification=fpb.Qualification(passed=qualified, detail="scripted"),
        version="test",
    )
    if held is not None:
        hello.held_lease.CopyFrom(held)
    await worker.send(hello=hello)
    worker.welcome = await worker.expect("welcome")
    try:
        yield worker
    finally:
        call.cancel()
