"""A revoked API key is refused by the very next call, on every replica."""

from __future__ import annotations

import grpc
import pytest

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.server import Scheduler
from tests.support.fleet import Fleet, scheduler_config
from tests.support.jobs import WAIT_S, JobClient


async def _list(client: JobClient) -> pb.ListJobsResponse:
    response: pb.ListJobsResponse = await client.stub.ListJobs(
        pb.ListJobsRequest(), metadata=client.metadata, timeout=WAIT_S
    )
    return response


async def test_revoked_key_is_refused_at_once_on_another_replica(
    fleet: Fleet, database_url: str
) -> None:
    created = await create_api_key(fleet.scheduler.ledger, "carol")
    key_id = created.key.split("_")[1]
    config = scheduler_config(database_url, fleet.scheduler.config.data_dir)
    async with (
        Scheduler(config) as other,
        grpc.aio.insecure_channel(f"127.0.0.1:{other.port}") as channel,
    ):
        here = JobClient(fleet.alice.stub, created.key)
        there = JobClient(pbgrpc.JobServiceStub(channel), created.key)
        # Both replicas have accepted the key (a replica that remembers good keys would now).
        for client in (here, there, here, there):
            await _list(client)
        assert await fleet.scheduler.ledger.revoke_api_key(key_id)
        for client in (there, here):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await _list(client)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "revoked" in (raised.value.details() or "")
        # The owner's other keys are untouched.
        await _list(JobClient(pbgrpc.JobServiceStub(channel), fleet.alice.api_key))
