"""An expired lease's lost work is on the record (issue 31): the expiry event, the sweeper's
log line and a metric carry the holder's last reported step and the steps past the checkpoint
the job resumes from, so a loss shows in a figure even where the timeline's (rate-limited)
heartbeats stopped short of the holder's last report."""

from __future__ import annotations

import uuid
from pathlib import Path

import asyncpg
import pytest
import structlog
from structlog.testing import capture_logs

from lorafleet.cli.timeline import LeaseOutcome, leases_from_events
from lorafleet.core.model import Checkpoint, EventKind, checkpoint_key
from lorafleet.core.spec import JobSpec
from lorafleet.ledger.ledger import Ledger, NewJob
from lorafleet.scheduler import metrics
from lorafleet.scheduler import sweeper as sweeper_module
from lorafleet.scheduler.storage import LocalObjectStore, LocalStoreConfig
from lorafleet.scheduler.sweeper import Sweeper

TTL_S = 30.0
SECRET = bytes(32)


def new_job() -> NewJob:
    spec = JobSpec(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="dogs/rex",
        base_model="/models/sdxl",
        max_train_steps=200,
        checkpointing_steps=50,
    )
    return NewJob(job_id=str(uuid.uuid4()), spec=spec, idempotency_key="", traceparent="")


async def test_expiry_records_the_steps_lost_from_the_last_report(
    ledger: Ledger, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ledger.insert_jobs("alice", [new_job()])
    job = await ledger.claim_job("m1", 0, TTL_S, secret_sha256=SECRET)
    assert job is not None and job.lease_id is not None
    lease_id, epoch = job.lease_id, job.epoch
    checkpoint = Checkpoint(
        step=50,
        epoch=epoch,
        key=checkpoint_key(job.job_id, 50, epoch),
        size_bytes=1,
        sha256="0" * 64,
    )
    assert await ledger.commit_checkpoint(lease_id, epoch, checkpoint)
    assert await ledger.heartbeat(
        lease_id, epoch, TTL_S, step=60, loss=None, learning_rate=None, seconds_per_step=1.0
    )
    # The last report is off the timeline, as most heartbeats are when they come often.
    assert await ledger.heartbeat(
        lease_id,
        epoch,
        TTL_S,
        step=88,
        loss=None,
        learning_rate=None,
        seconds_per_step=1.0,
        on_timeline=False,
    )
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = $1",
            uuid.UUID(job.job_id),
        )
    finally:
        await conn.close()

    sweeper = Sweeper(
        ledger=ledger,
        storage=LocalObjectStore(LocalStoreConfig(root_dir=tmp_path, secret_key=b"k" * 32)),
        checkpoint_retention=2,
        replica_id="r1",
        upload_url_ttl_s=60.0,
    )
    lost_before = metrics.STEPS_LOST_TO_EXPIRY._value.get()
    with capture_logs() as logs:
        # A fresh logger: the module's own is cached on first use (cache_logger_on_first_use)
        # with the processor list of the configuration then; capture_logs edits the current
        # list, which is another one once a later test configured logging again.
        monkeypatch.setattr(sweeper_module, "log", structlog.get_logger(sweeper_module.__name__))
        await sweeper.sweep_once()
    expired = [e for e in logs if e["event"] == "lease expired; job re-queued"]
    assert len(expired) == 1, logs
    assert (expired[0]["last_step"], expired[0]["resume_step"], expired[0]["steps_lost"]) == (
        88,
        50,
        38,
    )
    assert metrics.STEPS_LOST_TO_EXPIRY._value.get() - lost_before == 38

    events = await ledger.list_events(job.job_id, 0, 100)
    expiry = [e for e in events if e.kind is EventKind.LEASE_EXPIRED]
    assert len(expiry) == 1
    assert expiry[0].step == 88
    assert (
        expiry[0].message == "last reported step 88; resumes from step 50: at least 38 steps lost"
    )
    # The timeline's lease ends at the last report, not at the last heartbeat it drew (60).
    (lease,) = leases_from_events(events)
    assert lease.outcome is LeaseOutcome.EXPIRED
    assert (lease.start_step, lease.end_step) == (0, 88)


async def test_expiry_of_a_lease_that_never_reported(ledger: Ledger, database_url: str) -> None:
    await ledger.insert_jobs("alice", [new_job()])
    job = await ledger.claim_job("m1", 0, 0.0, secret_sha256=SECRET)  # expires at once
    assert job is not None
    (expired,) = await ledger.expire_leases()
    assert (expired.last_step, expired.resume_step, expired.steps_lost) == (None, 0, 0)
    events = await ledger.list_events(job.job_id, 0, 100)
    (expiry,) = [e for e in events if e.kind is EventKind.LEASE_EXPIRED]
    assert expiry.step is None
    assert expiry.message == "no step reported; resumes from step 0"
