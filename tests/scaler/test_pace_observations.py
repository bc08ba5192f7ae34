"""The ledger's pace observations: what the scheduler saw of a lease (verified checkpoints and
verified results on its own clock), never what the holder says, which is kept apart."""

from __future__ import annotations

import asyncpg
import pytest

from lorafleet.core.model import Checkpoint, JobResult
from lorafleet.ledger.ledger import Ledger
from tests.scaler.test_cli import _job, _machine

pytestmark = pytest.mark.timeout(60)


async def _backdate_grant(database_url: str, lease_id: str, seconds: float) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE leases SET granted_at = ended_at - make_interval(secs => $2)"
            " WHERE lease_id = $1::uuid",
            lease_id,
            seconds,
        )
    finally:
        await conn.close()


async def test_a_completed_lease_is_observed_from_its_resume_point_to_its_result(
    ledger: Ledger, database_url: str
) -> None:
    await _machine(ledger, "m1")
    await _machine(ledger, "m2")
    await ledger.insert_jobs("alice", [_job()])  # 100 steps
    first = await ledger.claim_job("m1", 24_576, 30, secret_sha256=bytes(32))
    assert first is not None and first.lease_id is not None
    # One checkpoint (no interval to observe), a claim of 1 ms a step, then the holder drains.
    checkpoint = Checkpoint(step=40, epoch=first.epoch, key="k40", size_bytes=1, sha256="0")
    assert await ledger.commit_checkpoint(first.lease_id, first.epoch, checkpoint)
    assert await ledger.heartbeat(
        first.lease_id,
        first.epoch,
        30,
        step=45,
        loss=None,
        learning_rate=None,
        seconds_per_step=0.001,
    )
    assert await ledger.drain_lease(first.lease_id, first.epoch, "SIGTERM") is not None

    second = await ledger.claim_job("m2", 24_576, 30, secret_sha256=bytes(32))
    assert second is not None and second.lease_id is not None
    result = JobResult(key="result", size_bytes=1, sha256="0")
    assert await ledger.succeed_job(second.lease_id, second.epoch, result, step=100, loss=None)
    await _backdate_grant(database_url, second.lease_id, 30.0)

    by_machine = {p.machine_id: p for p in await ledger.pace_observations(3600, 100)}
    drained, finished = by_machine["m1"], by_machine["m2"]
    # The drained lease: nothing observed, its claim kept apart as a claim.
    assert drained.observed_steps is None and drained.completed_steps is None
    assert drained.reported_seconds_per_step == pytest.approx(0.001)
    assert not drained.live
    # The finished one resumed from step 40: 60 steps in 30 s of the ledger's clock.
    assert finished.completed_steps == 60
    assert finished.completed_seconds == pytest.approx(30.0, abs=1.0)
    assert finished.reported_seconds_per_step is None
