"""The worker's SaladCloud IMDS calls, through the official SDK, against an IMDS double on
loopback that checks the `Metadata: true` header and parses bodies with the SDK's models.

The agent asking for reallocation when its probe fails is in tests/agent/test_metadata_services.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from lorafleet.core.settings import load
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.salad_imds import request_reallocation
from tests.worker.salad_imds_double import SaladImdsDouble

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def imds() -> AsyncIterator[SaladImdsDouble]:
    double = SaladImdsDouble()
    await double.start()
    yield double
    await double.close()


async def test_reallocation_is_asked_with_the_reason(imds: SaladImdsDouble) -> None:
    assert await request_reallocation("GPU computes garbage", base_url=imds.base_url)
    assert [r.reason for r in imds.reallocations] == ["GPU computes garbage"]
    assert imds.refused == []


async def test_a_long_reason_is_cut_to_what_the_service_accepts(imds: SaladImdsDouble) -> None:
    assert await request_reallocation("x" * 5000, base_url=imds.base_url)
    assert imds.reallocations[0].reason == "x" * 1000


async def test_a_refusal_is_reported_not_raised(imds: SaladImdsDouble) -> None:
    imds.status = 403
    assert not await request_reallocation("bad node", base_url=imds.base_url)
    assert imds.reallocations == [] and imds.refused == ["refused by the test"]


async def test_a_server_error_is_retried_by_the_sdk(imds: SaladImdsDouble) -> None:
    imds.status = 500
    assert not await request_reallocation("bad node", base_url=imds.base_url, timeout_s=2)
    assert len(imds.refused) == 4  # the call and the SDK's three retries


async def test_the_double_holds_the_sdk_to_the_description(imds: SaladImdsDouble) -> None:
    """What the double refuses, so that its acceptance above means something."""
    import aiohttp

    url = imds.base_url + "/v1/reallocate"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"reason": "r"}) as response:
            assert response.status == 400  # no Metadata header
        headers = {"Metadata": "true"}
        async with session.post(url, json={"reason": ""}, headers=headers) as response:
            assert response.status == 400  # reason below its minimum length
        async with session.post(url, json={}, headers=headers) as response:
            assert response.status == 400  # reason missing
    assert len(imds.refused) == 3 and imds.reallocations == []


def test_salad_reallocation_is_on_where_saladcloud_runs_the_worker() -> None:
    def config(**env: str) -> WorkerConfig:
        return load(WorkerConfig, env={"LORAFLEET_WORKER_TOKEN": "t", **env})

    on_salad = {"SALAD_CONTAINER_GROUP_ID": "6f5c0d1e", "SALAD_MACHINE_ID": "node-1"}
    assert config(**on_salad).salad_reallocate_enabled
    assert not config().salad_reallocate_enabled
    assert not config(**on_salad, LORAFLEET_SALAD_REALLOCATE="0").salad_reallocate_enabled
    assert config(LORAFLEET_SALAD_REALLOCATE="1").salad_reallocate_enabled
