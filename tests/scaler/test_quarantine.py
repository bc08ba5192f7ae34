"""Quarantine where claims are decided: a machine with `threshold` node faults within the window
is granted nothing (no job, no sample task) until the window passes or the scaler replaces it,
so a bad node costs at most `threshold` failed attempts in total."""

from __future__ import annotations

import pytest

from lorafleet.core.model import FailureClass
from lorafleet.ledger.ledger import Ledger, Quarantine
from tests.scaler.test_cli import _job

pytestmark = pytest.mark.timeout(60)

VRAM = 24_576


async def _fail_on(ledger: Ledger, machine_id: str) -> str | None:
    """Claims a job on the machine and fails it with a node fault; the job's id, or None when
    the machine is granted nothing."""
    job = await ledger.claim_job(machine_id, VRAM, 30, secret_sha256=bytes(32))
    if job is None:
        return None
    assert job.lease_id is not None
    await ledger.fail_attempt(job.lease_id, job.epoch, FailureClass.NODE, "CUDA error")
    return job.job_id


async def test_a_machine_past_the_threshold_is_granted_nothing(database_url: str) -> None:
    ledger = await Ledger.connect(database_url, quarantine=Quarantine(threshold=3, window_s=600))
    try:
        await ledger.insert_jobs("alice", [_job(max_failures=2) for _ in range(9)])
        failed = [await _fail_on(ledger, "bad") for _ in range(9)]
        # Three node faults, then nothing: six jobs were never touched by the bad node.
        assert [f is not None for f in failed] == [True] * 3 + [False] * 6
        assert await ledger.claim_job("bad", VRAM, 30, secret_sha256=bytes(32)) is None
        # Another machine is not affected, and no job failed.
        good = await ledger.claim_job("good", VRAM, 30, secret_sha256=bytes(32))
        assert good is not None
        counts = await ledger.count_jobs_by_state(100)
        assert counts.get("FAILED", 0) == 0

        # The window passes: the machine may try again.
        async with ledger._conn() as conn:
            await conn.execute(
                "UPDATE leases SET ended_at = ended_at - interval '601 seconds'"
                " WHERE machine_id = 'bad'"
            )
        assert await ledger.claim_job("bad", VRAM, 30, secret_sha256=bytes(32)) is not None
    finally:
        await ledger.close()


async def test_the_default_quarantine_is_three_faults_an_hour(ledger: Ledger) -> None:
    assert ledger.quarantine == Quarantine(threshold=3, window_s=3600.0)
    await ledger.insert_jobs("alice", [_job() for _ in range(5)])
    assert [await _fail_on(ledger, "bad") is not None for _ in range(5)] == [True] * 3 + [False] * 2
