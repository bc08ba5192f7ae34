"""RequestSamples' values have the bounds of the job spec's fields they stand in for: an outside
attack found a seed of -1 or 99999999999 queued (the spec allows 0..2**32-1)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.scheduler.test_sample_tasks import VALIDATION
from tests.support.fleet import Fleet
from tests.support.jobs import WAIT_S
from tests.support.workers import connect_worker


async def test_out_of_range_values_are_refused_naming_their_field(fleet: Fleet) -> None:
    client = fleet.alice
    job = await client.submit(max_train_steps=25, **{**VALIDATION, "validation_steps": 0})

    async def request(**values: Any) -> pb.RequestSamplesResponse:
        response: pb.RequestSamplesResponse = await client.stub.RequestSamples(
            pb.RequestSamplesRequest(job_id=job.job_id, **values),
            metadata=client.metadata,
            timeout=WAIT_S,
        )
        return response

    refused = (
        ("seed", -1),
        ("seed", 2**32),
        ("seed", 99_999_999_999),
        ("num_images", -1),
        ("num_images", 17),
        ("inference_steps", 201),
        ("guidance_scale", -1.0),
        ("steps", [-1]),
        ("steps", [10**12]),
    )

    async def all_refused() -> None:
        for name, value in refused:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await request(**{name: value})
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (name, value)
            assert (raised.value.details() or "").startswith(f"{name}: "), raised.value.details()

    # Refused as such in any state of the job, not "has no result yet".
    await all_refused()
    async with connect_worker(fleet.channel, fleet.token, "trainer") as trainer:
        granted = await trainer.ready_for_lease()
        await trainer.store_result(granted, 25)
    await all_refused()
    # The bounds themselves are allowed.
    response = await request(seed=2**32 - 1, num_images=16, steps=[25])
    assert list(response.steps) == [25]
