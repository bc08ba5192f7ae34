"""The worker's proof of its machine, read from each provider's metadata service double."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.identity import fetch_identity, identity_kind
from tests.worker.imds_double import ImdsDouble
from tests.worker.salad_imds_double import SaladImdsDouble


def _config(**values: Any) -> WorkerConfig:
    return WorkerConfig(worker_token="t", machine_id="m1", **values)


@pytest.fixture
async def salad() -> AsyncIterator[SaladImdsDouble]:
    double = SaladImdsDouble(jwt="eyJ.a-salad.token")
    await double.start()
    try:
        yield double
    finally:
        await double.close()


@pytest.fixture
async def ec2() -> AsyncIterator[ImdsDouble]:
    double = ImdsDouble(identity_document=b'{"instanceId": "i-1"}', identity_signature=b"A" * 344)
    await double.start()
    try:
        yield double
    finally:
        await double.close()


def test_auto_picks_the_provider_the_worker_runs_on() -> None:
    assert identity_kind(_config()) == "none"
    assert identity_kind(_config(identity_token="x")) == "local"
    assert identity_kind(_config(salad_container_group_id="g")) == "salad"
    assert identity_kind(_config(spot_notice="ec2")) == "ec2"
    assert identity_kind(_config(spot_notice="ec2", provider_identity="none")) == "none"


async def test_a_salad_worker_sends_its_instance_token(salad: SaladImdsDouble) -> None:
    proof = await fetch_identity(
        _config(salad_container_group_id="g", salad_imds_url=salad.base_url)
    )
    assert proof.salad_jwt == "eyJ.a-salad.token"
    assert not salad.refused  # the SDK sent Metadata: true


async def test_an_ec2_worker_sends_its_signed_document(ec2: ImdsDouble) -> None:
    proof = await fetch_identity(_config(spot_notice="ec2", ec2_metadata_url=ec2.base_url))
    assert proof.ec2.document == b'{"instanceId": "i-1"}'
    # Wrapped over lines as EC2 serves it; the scheduler joins the lines.
    assert b"".join(proof.ec2.signature.split()) == b"A" * 344


async def test_a_local_worker_sends_its_supervisors_token() -> None:
    assert (await fetch_identity(_config(identity_token="abc"))).local_token == "abc"


async def test_an_unreadable_proof_is_sent_as_none(salad: SaladImdsDouble) -> None:
    salad.status = 403  # not on SaladCloud after all
    proof = await fetch_identity(
        _config(salad_container_group_id="g", salad_imds_url=salad.base_url), timeout_s=2
    )
    assert not proof.HasField("proof")
