"""The one live fleet of the suite: a real scheduler on loopback (port 0) over a per-test
Postgres database, its local object store, and two owners' API keys.

One `Fleet` serves the scheduler, client and agent tests alike; what differs is its profile (a
fixture a directory overrides): scripted workers need nothing trained and wait seconds; real
workers (tests/agent) train the tiny model on real pictures, heartbeat faster, and wait longer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from lorafleet.core.model import upload_key
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler
from tests.support.images import png
from tests.support.jobs import (
    OWNER,
    PREFIX,
    SCRIPTED_SPEC,
    TRAINING_SPEC,
    TRAINING_WAIT_S,
    WAIT_S,
    JobClient,
)

if TYPE_CHECKING:
    from lorafleet.worker.agent import Agent
    from lorafleet.worker.config import WorkerConfig

WORKER_TOKEN = "test-worker-token"
# The pictures of a training fleet: OWNER's PREFIX holds NUM_IMAGES of them.
NUM_IMAGES = 3


def scheduler_config(database_url: str, data_dir: Path, **overrides: Any) -> SchedulerConfig:
    values: dict[str, Any] = dict(
        listen="127.0.0.1:0",
        database_url=database_url,
        data_dir=data_dir,
        worker_token=WORKER_TOKEN,
        lease_ttl_s=30.0,
        heartbeat_interval_s=1.0,
        sweep_interval_s=0.2,
        dispatch_interval_s=1.0,
        checkpoint_retention=2,
    )
    values.update(overrides)
    return SchedulerConfig(**values)


@dataclass(frozen=True, kw_only=True)
class FleetProfile:
    """What a directory's tests need of the fleet."""

    # SchedulerConfig overrides under the test's own `scheduler_overrides`.
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    # (owner, name under PREFIX) -> bytes, stored before the test starts.
    uploads: Mapping[tuple[str, str], bytes] = field(default_factory=dict)
    # What `submit()` fills in, and how long a wait on a job may take.
    spec: Mapping[str, Any] = field(default_factory=lambda: dict(SCRIPTED_SPEC))
    wait_s: float = WAIT_S


# Scripted workers: nothing is ever decoded or trained, so one placeholder per owner will do.
SCRIPTED = FleetProfile(uploads={("alice", "1.png"): b"png", ("bob", "1.png"): b"png"})


def training_profile() -> FleetProfile:
    """Real workers: real pictures, a heartbeat every 0.3 s, tiny jobs, CPU-sized waits."""
    return FleetProfile(
        scheduler={"heartbeat_interval_s": 0.3},
        uploads={(OWNER, f"{i}.png"): png(i) for i in range(NUM_IMAGES)},
        spec=TRAINING_SPEC,
        wait_s=TRAINING_WAIT_S,
    )


@dataclass
class Fleet:
    scheduler: Scheduler
    channel: grpc.aio.Channel
    alice: JobClient
    bob: JobClient
    token: str = WORKER_TOKEN
    # Set for fleets of real workers (tests/agent): the model they load.
    tiny_model: Path | None = None

    @property
    def client(self) -> JobClient:
        """The owner whose pictures the fleet holds."""
        return self.alice

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    def worker_config(self, machine_id: str, **overrides: Any) -> WorkerConfig:
        """An in-process worker's configuration: this fleet, the tiny model on the CPU."""
        from lorafleet.core.settings import load
        from lorafleet.worker.config import WorkerConfig
        from lorafleet.worker.transfer import TransferConfig

        assert self.tiny_model is not None, "a training fleet (tests/agent) has the tiny model"
        values: dict[str, Any] = dict(
            worker_token=self.token,
            scheduler_address=self.address,
            machine_id=machine_id,
            provider_instance_id=f"instance-{machine_id}",
            allow_cpu=True,
            device="cpu",
            model_path=str(self.tiny_model),
            local_files_only=True,
            sample_steps=2,
            sample_batch_size=2,
            # A report after every step: tests hold the trainer inside a given step's report.
            progress_interval_s=0.0,
            min_free_disk_mb=0,
            min_free_memory_mb=0,
            reconnect_initial_backoff_s=0.05,
            reconnect_max_backoff_s=0.5,
            welcome_timeout_s=10.0,
            url_request_timeout_s=10.0,
            drain_grace_s=60.0,
            # Each worker its own compile cache in the test's directory, never the user's.
            compile_cache_dir=self.scheduler.config.data_dir / "compile-cache" / machine_id,
            # Eager unless a test asks (auto compiles a long job: minutes on 2 cores).
            compile_model="off",
            transfer=TransferConfig(
                max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=30.0
            ),
        )
        values.update(overrides)
        return load(WorkerConfig, env={}, **values)


@asynccontextmanager
async def start_fleet(
    database_url: str,
    data_dir: Path,
    profile: FleetProfile,
    *,
    tiny_model: Path | None = None,
    **scheduler_overrides: Any,
) -> AsyncIterator[Fleet]:
    config = scheduler_config(
        database_url, data_dir, **{**profile.scheduler, **scheduler_overrides}
    )
    async with Scheduler(config) as scheduler:
        for (owner, name), data in profile.uploads.items():
            await scheduler.storage.put_bytes(upload_key(owner, PREFIX, name), data)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            stub = pbgrpc.JobServiceStub(channel)

            async def client(owner: str) -> JobClient:
                key = (await create_api_key(scheduler.ledger, owner)).key
                return JobClient(stub, key, defaults=dict(profile.spec), wait_s=profile.wait_s)

            yield Fleet(
                scheduler=scheduler,
                channel=channel,
                alice=await client("alice"),
                bob=await client("bob"),
                tiny_model=tiny_model,
            )


@asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[asyncio.Task[None]]:
    """Runs `agent` in the background; on exit shuts it down and surfaces its errors."""
    async with agent:
        task = asyncio.get_running_loop().create_task(agent.run())
        try:
            yield task
        finally:
            await agent.shutdown()
            await asyncio.wait_for(task, 60)
