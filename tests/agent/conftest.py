"""The agent against the real thing: a scheduler on loopback over a per-test Postgres database,
its local object store over HTTP, and the tiny SDXL-architecture model trained on the CPU."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from lorafleet.core.model import upload_key
from lorafleet.core.settings import load
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler
from lorafleet.worker.agent import Agent
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.qualify import QualificationResult, probe
from lorafleet.worker.tiny_model import build_tiny_model
from lorafleet.worker.transfer import TransferConfig
from tests.agent.support import JobClient, png

WORKER_TOKEN = "agent-test-worker-token"
OWNER = "alice"
PREFIX = "dogs/rex"
NUM_IMAGES = 3


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """The tiny model gains nothing from intra-op threads, and on a shared two-core machine
    OpenMP threads spinning against the worker processes slow every step. Worker processes get
    OMP_NUM_THREADS=1 likewise, so in-process reference runs and workers compute the same way
    (a different thread count may sum in a different order). Restored after each module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SDXL-architecture model, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("agent-tiny-sdxl"))


@dataclass
class Fleet:
    scheduler: Scheduler
    client: JobClient
    tiny_model: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    def worker_config(self, machine_id: str, **overrides: Any) -> WorkerConfig:
        values: dict[str, Any] = dict(
            worker_token=WORKER_TOKEN,
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
            transfer=TransferConfig(
                max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=30.0
            ),
        )
        values.update(overrides)
        return load(WorkerConfig, env={}, **values)


def scheduler_config(database_url: str, data_dir: Path, **overrides: Any) -> SchedulerConfig:
    values: dict[str, Any] = dict(
        listen="127.0.0.1:0",
        database_url=database_url,
        data_dir=data_dir,
        worker_token=WORKER_TOKEN,
        lease_ttl_s=30.0,
        heartbeat_interval_s=0.3,
        sweep_interval_s=0.2,
        dispatch_interval_s=1.0,
        checkpoint_retention=2,
    )
    values.update(overrides)
    return SchedulerConfig(**values)


@pytest.fixture
def scheduler_overrides() -> dict[str, Any]:
    return {}


@pytest.fixture
async def fleet(
    database_url: str,
    tmp_path: Path,
    tiny_model: Path,
    scheduler_overrides: dict[str, Any],
) -> AsyncIterator[Fleet]:
    config = scheduler_config(database_url, tmp_path / "scheduler", **scheduler_overrides)
    async with Scheduler(config) as scheduler:
        for i in range(NUM_IMAGES):
            await scheduler.storage.put_bytes(upload_key(OWNER, PREFIX, f"{i}.png"), png(i))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            created = await create_api_key(scheduler.ledger, OWNER)
            client = JobClient(pbgrpc.JobServiceStub(channel), created.key)
            yield Fleet(scheduler=scheduler, client=client, tiny_model=tiny_model)


@pytest.fixture(scope="session")
def cpu_qualification() -> QualificationResult:
    """One real probe result reused by tests that are not about qualification."""
    return probe(
        load(
            WorkerConfig,
            env={},
            worker_token="x",
            allow_cpu=True,
            min_free_disk_mb=0,
            min_free_memory_mb=0,
        )
    )


RunAgent = Callable[..., Any]


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
