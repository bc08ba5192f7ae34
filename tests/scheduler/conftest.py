"""A real scheduler on loopback (port 0) over a per-test database, with two owners' API keys."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lorafleet.core.model import upload_key
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler
from tests.scheduler.harness import UserClient

WORKER_TOKEN = "test-worker-token"


@dataclass
class Fleet:
    scheduler: Scheduler
    channel: grpc.aio.Channel
    alice: UserClient
    bob: UserClient
    token: str = WORKER_TOKEN


def scheduler_config(database_url: str, data_dir: Path, **overrides: object) -> SchedulerConfig:
    values: dict[str, object] = dict(
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
    return SchedulerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def scheduler_overrides() -> dict[str, object]:
    return {}


@pytest.fixture
async def fleet(
    database_url: str, tmp_path: Path, scheduler_overrides: dict[str, object]
) -> AsyncIterator[Fleet]:
    config = scheduler_config(database_url, tmp_path / "data", **scheduler_overrides)
    async with Scheduler(config) as scheduler:
        for owner in ("alice", "bob"):
            await scheduler.storage.put_bytes(upload_key(owner, "dogs/rex", "1.png"), b"png")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            stub = pbgrpc.JobServiceStub(channel)
            yield Fleet(
                scheduler=scheduler,
                channel=channel,
                alice=UserClient(stub, (await create_api_key(scheduler.ledger, "alice")).key),
                bob=UserClient(stub, (await create_api_key(scheduler.ledger, "bob")).key),
            )
