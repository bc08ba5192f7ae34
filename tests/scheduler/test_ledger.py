"""The ledger's transitions against a real Postgres: claims, fencing, failures, retention."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import asyncpg
import pytest

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.model import (
    Checkpoint,
    FailureClass,
    Job,
    JobResult,
    JobState,
    Machine,
    Qualification,
    checkpoint_key,
)
from lorafleet.core.spec import JobSpec
from lorafleet.ledger.ledger import (
    QUERIES,
    ApiKeyInfo,
    LeaseRecord,
    Ledger,
    NewJob,
    WebhookDeliveryRecord,
)

TTL_S = 30.0
# The digest of a lease secret; these tests drive the ledger directly, without a stream.
SECRET = bytes(32)


def new_job(
    *, priority: int = 0, min_vram_mb: int = 0, max_failures: int = 3, key: str = ""
) -> NewJob:
    spec = JobSpec(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="dogs/rex",
        # A folder on the workers: no memory estimate, so a claim naming no memory may take it
        # (the default hub model's estimate, ~22 GiB, would be the job's need; tests/scheduler/
        # test_fit.py is about that).
        base_model="/models/sdxl",
        max_train_steps=100,
        priority=priority,
        min_vram_mb=min_vram_mb,
        max_failures=max_failures,
        labels={"team": "a"},
    )
    return NewJob(job_id=str(uuid.uuid4()), spec=spec, idempotency_key=key, traceparent="")


async def test_submit_is_idempotent_per_owner(ledger: Ledger) -> None:
    first = (await ledger.insert_jobs("alice", [new_job(key="k1")]))[0]
    again = (await ledger.insert_jobs("alice", [new_job(key="k1")]))[0]
    other = (await ledger.insert_jobs("bob", [new_job(key="k1")]))[0]
    assert again.job_id == first.job_id
    assert other.job_id != first.job_id
    assert await ledger.get_job(first.job_id, "bob") is None


async def test_a_reused_idempotency_key_with_another_spec_is_refused(ledger: Ledger) -> None:
    """A retry sends the same spec; the same key with another (6 steps after 5) silently
    returned the first job (an outside attack), which hid the second job's loss. Refused, and
    nothing of the batch is written."""
    first = (await ledger.insert_jobs("alice", [new_job(key="k2")]))[0]
    with pytest.raises(InvalidArgument) as refused:
        await ledger.insert_jobs("alice", [new_job(key="k3"), new_job(key="k2", priority=3)])
    assert refused.value.field == "idempotency_key" and first.job_id in str(refused.value)
    queued = await ledger.list_jobs("alice", states=[], labels={}, after=None, limit=10)
    assert [j.job_id for j in queued] == [first.job_id]


async def test_claim_order_requeued_then_priority_then_age(ledger: Ledger) -> None:
    old_low, high, requeued = await ledger.insert_jobs(
        "alice", [new_job(priority=0), new_job(priority=5), new_job(priority=-5)]
    )
    # Give the low-priority job progress: claim it first by making it the only candidate.
    claimed = []
    for i in range(3):  # one live lease per machine: three machines
        job = await ledger.claim_job(f"m0-{i}", 80_000, TTL_S, secret_sha256=SECRET)
        assert job is not None
        claimed.append(job.job_id)
    assert claimed == [high.job_id, old_low.job_id, requeued.job_id]
    drained = await ledger.drain_lease(
        _lease(await ledger.get_job(requeued.job_id, "alice")), 1, "bye"
    )
    assert drained is not None and drained.state is JobState.QUEUED
    fresh = (await ledger.insert_jobs("alice", [new_job(priority=100)]))[0]
    nxt = await ledger.claim_job("m1", 80_000, TTL_S, secret_sha256=SECRET)
    assert nxt is not None and nxt.job_id == requeued.job_id and nxt.epoch == 2
    assert (
        await ledger.claim_job("m2", 80_000, TTL_S, secret_sha256=SECRET)
    ).job_id == fresh.job_id  # type: ignore[union-attr]


def _lease(job: object) -> str:
    lease_id = getattr(job, "lease_id", None)
    assert isinstance(lease_id, str)
    return lease_id


async def test_vram_filter_and_node_ban(ledger: Ledger) -> None:
    job = (await ledger.insert_jobs("alice", [new_job(min_vram_mb=24_000)]))[0]
    assert await ledger.claim_job("small", 16_000, TTL_S, secret_sha256=SECRET) is None
    granted = await ledger.claim_job("big", 24_000, TTL_S, secret_sha256=SECRET)
    assert granted is not None and granted.job_id == job.job_id
    failed = await ledger.fail_attempt(
        _lease(granted), granted.epoch, FailureClass.NODE, "CUDA error"
    )
    # A node fault is not the job's: no failure, one node fault.
    assert failed is not None and failed.state is JobState.QUEUED
    assert (failed.failures, failed.node_faults) == (0, 1)
    assert (
        await ledger.claim_job("big", 24_000, TTL_S, secret_sha256=SECRET) is None
    )  # banned there
    assert (await ledger.claim_job("big2", 24_000, TTL_S, secret_sha256=SECRET)) is not None


@pytest.mark.parametrize("failure_class", [FailureClass.NODE, FailureClass.INTERNAL])
async def test_a_machine_a_job_failed_on_never_gets_it_again(
    ledger: Ledger, failure_class: FailureClass
) -> None:
    """A broken worker (its model missing: INTERNAL) must not use up a job's max_failures by
    itself: the job goes to other machines, never back to it."""
    job = (await ledger.insert_jobs("alice", [new_job(max_failures=3)]))[0]
    granted = await ledger.claim_job("broken", 0, TTL_S, secret_sha256=SECRET)
    assert granted is not None and granted.job_id == job.job_id
    after = await ledger.fail_attempt(_lease(granted), granted.epoch, failure_class, "boom")
    # Neither is blamed on the job from a machine not in good standing (no provider's word,
    # no result of its own): it counts as a node fault.
    assert after is not None and after.state is JobState.QUEUED
    assert (after.failures, after.node_faults) == (0, 1)
    assert await ledger.claim_job("broken", 0, TTL_S, secret_sha256=SECRET) is None
    assert await ledger.claim_job("healthy", 0, TTL_S, secret_sha256=SECRET) is not None


async def in_good_standing(database_url: str, *machines: str, age_h: float = 7.0) -> None:
    """Each machine is provider-verified and delivered a verified result of its own (a job
    finished `age_h` hours ago, by default more than standing_min_age_s, 6 h, before any job a
    test submits now): its internal errors are blamed on the jobs it reports them for."""
    conn = await asyncpg.connect(database_url)
    try:
        for machine in machines:
            await conn.execute(
                "INSERT INTO machines (machine_id, identity_provider) VALUES ($1, 'salad')"
                " ON CONFLICT (machine_id) DO UPDATE SET identity_provider = 'salad'",
                machine,
            )
            job_id = await conn.fetchval(
                "INSERT INTO jobs (job_id, owner, spec, state, priority, min_vram_mb,"
                " max_failures, max_train_steps, epoch, finished_at)"
                " SELECT gen_random_uuid(), 'earlier', spec, 'SUCCEEDED', 0, 0, 3,"
                " max_train_steps, 1, now() FROM jobs LIMIT 1 RETURNING job_id"
            )
            await conn.execute(
                "INSERT INTO leases (lease_id, job_id, epoch, machine_id, granted_at, ended_at,"
                " end_reason) VALUES (gen_random_uuid(), $1, 1, $2,"
                " now() - make_interval(secs => $3 * 3600 + 3600),"
                " now() - make_interval(secs => $3 * 3600), 'succeeded')",
                job_id,
                machine,
                age_h,
            )
    finally:
        await conn.close()


async def test_an_internal_error_stops_counting_once_its_machine_goes_bad(
    ledger: Ledger, database_url: str
) -> None:
    """A job's budget is recounted at each failure over the machines still in good standing: an
    internal error from a machine that has had a node fault since (no verified result after it)
    no longer counts, so a machine that goes bad cannot leave its errors on other jobs' budgets.
    Claims name a large node: these tests are about failures, not memory."""
    job = (await ledger.insert_jobs("alice", [new_job(max_failures=2)]))[0]
    await in_good_standing(database_url, "a", "b", "c")
    granted = await ledger.claim_job("a", 10**7, TTL_S, secret_sha256=SECRET)
    assert granted is not None and granted.job_id == job.job_id
    after = await ledger.fail_attempt(_lease(granted), granted.epoch, FailureClass.INTERNAL, "x")
    assert after is not None and (after.state, after.failures) == (JobState.QUEUED, 1)
    # Machine a has a node fault elsewhere, with no verified result since: out of good standing.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO leases (lease_id, job_id, epoch, machine_id, granted_at, ended_at,"
            " end_reason) SELECT gen_random_uuid(), job_id, 99, 'a', now(), now(),"
            " 'failed: node' FROM jobs WHERE owner = 'earlier' LIMIT 1"
        )
    finally:
        await conn.close()
    granted = await ledger.claim_job("b", 10**7, TTL_S, secret_sha256=SECRET)
    assert granted is not None and granted.job_id == job.job_id
    after = await ledger.fail_attempt(_lease(granted), granted.epoch, FailureClass.INTERNAL, "x")
    # b's error counts, a's no longer: one failure, not two (which would have failed the job).
    assert after is not None and (after.state, after.failures) == (JobState.QUEUED, 1)
    granted = await ledger.claim_job("c", 10**7, TTL_S, secret_sha256=SECRET)
    assert granted is not None
    after = await ledger.fail_attempt(_lease(granted), granted.epoch, FailureClass.INTERNAL, "x")
    assert after is not None and (after.state, after.failures) == (JobState.FAILED, 2)
    assert after.failure_class is FailureClass.INTERNAL


async def test_max_failures_and_input_fault(ledger: Ledger, database_url: str) -> None:
    job = (await ledger.insert_jobs("alice", [new_job(max_failures=2)]))[0]
    await in_good_standing(database_url, "a", "b")
    for machine, expected in (("a", JobState.QUEUED), ("b", JobState.FAILED)):
        granted = await ledger.claim_job(machine, 0, TTL_S, secret_sha256=SECRET)
        assert granted is not None
        after = await ledger.fail_attempt(
            _lease(granted), granted.epoch, FailureClass.INTERNAL, "bug"
        )
        assert after is not None and after.state is expected
    final = await ledger.get_job(job.job_id, "alice")
    assert (
        final is not None and final.failures == 2 and final.failure_class is FailureClass.INTERNAL
    )

    await in_good_standing(database_url, "c", "d")
    bad = (await ledger.insert_jobs("alice", [new_job(max_failures=5)]))[0]
    granted = await ledger.claim_job("c", 0, TTL_S, secret_sha256=SECRET)
    assert granted is not None and granted.job_id == bad.job_id
    after = await ledger.fail_attempt(
        _lease(granted), granted.epoch, FailureClass.INPUT, "x.png: unreadable"
    )
    # One machine's word is not enough: banned, re-queued, no failure counted.
    assert after is not None and after.state is JobState.QUEUED and after.failures == 0
    assert await ledger.claim_job("c", 0, TTL_S, secret_sha256=SECRET) is None
    again = await ledger.claim_job("d", 0, TTL_S, secret_sha256=SECRET)
    assert again is not None and again.job_id == bad.job_id
    after = await ledger.fail_attempt(
        _lease(again), again.epoch, FailureClass.INPUT, "x.png: unreadable"
    )
    assert after is not None and after.state is JobState.FAILED and after.failures == 0
    assert await ledger.claim_job("e", 0, TTL_S, secret_sha256=SECRET) is None


async def _fail_with(ledger: Ledger, machine: str, failure_class: FailureClass) -> Job:
    granted = await ledger.claim_job(machine, 10**7, TTL_S, secret_sha256=SECRET)
    assert granted is not None
    after = await ledger.fail_attempt(_lease(granted), granted.epoch, failure_class, "x")
    assert after is not None
    return after


@pytest.mark.parametrize("failure_class", [FailureClass.INTERNAL, FailureClass.INPUT])
async def test_machines_whose_standing_is_younger_than_the_job_cannot_fail_it(
    ledger: Ledger, database_url: str, failure_class: FailureClass
) -> None:
    """Verified machines whose first verified result is an hour old (less than
    standing_min_age_s, 6 h, before the job was submitted) have no say over it: their internal
    errors and their input faults count as node faults, never toward max_failures, and do not
    fail the job. Before, one verified result made a machine's errors the job's: two such
    machines failed it (max_failures 2, or an input fault confirmed)."""
    job = (await ledger.insert_jobs("alice", [new_job(max_failures=2)]))[0]
    await in_good_standing(database_url, "a", "b", age_h=1.0)
    for machine, node_faults in (("a", 1), ("b", 2)):
        after = await _fail_with(ledger, machine, failure_class)
        assert after.job_id == job.job_id
        assert (after.state, after.failures, after.node_faults) == (
            JobState.QUEUED,
            0,
            node_faults,
        )


async def test_a_machine_failing_most_of_its_recent_attempts_loses_its_standing(
    ledger: Ledger, database_url: str
) -> None:
    """A machine whose standing is old enough but which failed most of its last attempts is
    broken, whatever it did before: its internal error counts as a node fault."""
    job = (await ledger.insert_jobs("alice", [new_job(max_failures=1)]))[0]
    await in_good_standing(database_url, "a", "b")
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO leases (lease_id, job_id, epoch, machine_id, granted_at, ended_at,"
            " end_reason) SELECT gen_random_uuid(), job_id, 100 + n, 'a', now(), now(),"
            " 'failed: internal' FROM jobs, generate_series(1, 2) n WHERE owner = 'earlier'"
            " AND job_id = (SELECT job_id FROM leases WHERE machine_id = 'a' LIMIT 1)"
        )
    finally:
        await conn.close()
    after = await _fail_with(ledger, "a", FailureClass.INTERNAL)
    assert after.job_id == job.job_id
    assert (after.state, after.failures, after.node_faults) == (JobState.QUEUED, 0, 1)
    # b's record is its own: one success, no failures. Its error is the job's (max_failures 1).
    after = await _fail_with(ledger, "b", FailureClass.INTERNAL)
    assert (after.state, after.failures, after.node_faults) == (JobState.FAILED, 1, 1)


async def test_stale_epoch_is_fenced_off(ledger: Ledger) -> None:
    await ledger.insert_jobs("alice", [new_job()])
    first = await ledger.claim_job("a", 0, 0.0, secret_sha256=SECRET)  # expires at once
    assert first is not None
    expired = await ledger.expire_leases()
    assert [e.job_id for e in expired] == [first.job_id]
    second = await ledger.claim_job("b", 0, TTL_S, secret_sha256=SECRET)
    assert second is not None and second.epoch == first.epoch + 1
    stale = _lease(first)
    ckpt = Checkpoint(
        step=10,
        epoch=first.epoch,
        key=checkpoint_key(first.job_id, 10, first.epoch),
        size_bytes=1,
        sha256="0" * 64,
    )
    assert not await ledger.heartbeat(
        stale, first.epoch, TTL_S, step=5, loss=0.1, learning_rate=1e-4, seconds_per_step=1.0
    )
    assert not await ledger.commit_checkpoint(stale, first.epoch, ckpt)
    assert (
        await ledger.succeed_job(
            stale, first.epoch, JobResult(key="k", size_bytes=1, sha256="0"), step=1, loss=None
        )
        is None
    )
    assert await ledger.fail_attempt(stale, first.epoch, FailureClass.NODE, "x") is None
    # The right lease id with a wrong epoch is refused too.
    assert not await ledger.heartbeat(
        _lease(second),
        first.epoch,
        TTL_S,
        step=5,
        loss=None,
        learning_rate=None,
        seconds_per_step=None,
    )
    assert await ledger.heartbeat(
        _lease(second),
        second.epoch,
        TTL_S,
        step=5,
        loss=None,
        learning_rate=None,
        seconds_per_step=None,
    )
    assert await ledger.live_checkpoints(first.job_id) == []


async def test_checkpoint_retention_and_cleanup_on_finish(ledger: Ledger) -> None:
    job = (await ledger.insert_jobs("alice", [new_job()]))[0]
    granted = await ledger.claim_job("a", 0, TTL_S, secret_sha256=SECRET)
    assert granted is not None
    lease = _lease(granted)
    for step in (10, 20, 30, 40):
        key = checkpoint_key(job.job_id, step, granted.epoch)
        ok = await ledger.commit_checkpoint(
            lease,
            granted.epoch,
            Checkpoint(step=step, epoch=granted.epoch, key=key, size_bytes=step, sha256="a" * 64),
        )
        assert ok
    doomed = await ledger.checkpoints_to_delete(job.job_id, keep=2)
    assert sorted(doomed) == sorted(checkpoint_key(job.job_id, s, granted.epoch) for s in (10, 20))
    await ledger.mark_checkpoints_deleted(job.job_id, doomed)
    assert [c.step for c in await ledger.live_checkpoints(job.job_id)] == [40, 30]
    current = await ledger.get_job(job.job_id, "alice")
    assert (
        current is not None
        and current.latest_checkpoint is not None
        and current.latest_checkpoint.step == 40
    )
    done = await ledger.succeed_job(
        lease, granted.epoch, JobResult(key="r", size_bytes=3, sha256="b" * 64), step=100, loss=0.05
    )
    assert done is not None and done.state is JobState.SUCCEEDED
    assert len(await ledger.checkpoints_to_delete(job.job_id, keep=2)) == 2
    assert await ledger.finished_jobs_with_checkpoints(10) == [job.job_id]


async def test_cancel_and_events_timeline(ledger: Ledger) -> None:
    job = (await ledger.insert_jobs("alice", [new_job()]))[0]
    granted = await ledger.claim_job("a", 0, TTL_S, secret_sha256=SECRET)
    assert granted is not None
    assert await ledger.cancel_job(job.job_id, "bob") is None
    canceled = await ledger.cancel_job(job.job_id, "alice")
    assert (
        canceled is not None and canceled.state is JobState.CANCELED and canceled.lease_id is None
    )
    assert await ledger.cancel_job(job.job_id, "alice") is None  # already final
    kinds = [e.kind.value for e in await ledger.list_events(job.job_id, 0, 100)]
    assert kinds == ["SUBMITTED", "LEASE_GRANTED", "CANCELED"]


async def test_a_cancel_that_waited_for_a_claim_ends_the_lease_it_granted(
    ledger: Ledger, database_url: str
) -> None:
    """The claim holds the job's row when the cancel arrives; the cancel waits, then must end
    the lease that claim created (one statement would not see its row: billed for ever)."""
    (job,) = await ledger.insert_jobs("alice", [new_job()])
    claimer = await asyncpg.connect(database_url)
    watcher = await asyncpg.connect(database_url)
    try:
        claim = claimer.transaction()
        await claim.start()
        granted = await claimer.fetchrow(
            QUERIES["claim_job"],
            "m1",
            0,
            uuid.uuid4(),
            TTL_S,
            SECRET,
            3,
            3600.0,
            10,
            "",
            [],
            0.0,
            [],
            ["sdxl"],
        )
        assert granted is not None
        cancel = asyncio.create_task(ledger.cancel_job(job.job_id, "alice"))
        # Until the cancel is waiting for the claim's row lock (bounded). Postgres announces
        # no lock wait, so its activity view is polled.
        async with asyncio.timeout(30):
            while not await watcher.fetchval(  # noqa: ASYNC110
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ):
                await asyncio.sleep(0.01)
        await claim.commit()
        canceled = await asyncio.wait_for(cancel, 30)
    finally:
        await claimer.close()
        await watcher.close()
    assert canceled is not None and canceled.state is JobState.CANCELED
    (lease,) = await ledger.job_leases(job.job_id)
    assert lease.lease_id == str(granted["lease_id"])
    assert lease.ended_at is not None and lease.end_reason == "canceled"


async def test_concurrent_claims_never_grant_twice(ledger: Ledger) -> None:
    jobs = await ledger.insert_jobs("alice", [new_job() for _ in range(40)])
    results = await asyncio.gather(
        *(ledger.claim_job(f"m{i}", 0, TTL_S, secret_sha256=SECRET) for i in range(60))
    )
    granted = [r.job_id for r in results if r is not None]
    assert len(granted) == len(set(granted)) == 40
    assert set(granted) == {j.job_id for j in jobs}


async def test_gpu_seconds_bill_leases_to_their_end_or_last_heartbeat(
    ledger: Ledger, database_url: str
) -> None:
    job = (await ledger.insert_jobs("alice", [new_job()]))[0]
    first = await ledger.claim_job("a", 0, 0.0, secret_sha256=SECRET)
    assert first is not None
    await ledger.expire_leases()  # vanished node: billed up to its last heartbeat
    second = await ledger.claim_job("b", 0, TTL_S, secret_sha256=SECRET)
    assert second is not None
    await ledger.succeed_job(
        _lease(second),
        second.epoch,
        JobResult(key="r", size_bytes=1, sha256="c" * 64),
        step=100,
        loss=None,
    )
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE leases SET granted_at = ended_at - interval '100 s',"
            " last_heartbeat_at = ended_at - interval '40 s' WHERE epoch = 1"
        )
        await conn.execute(
            "UPDATE leases SET granted_at = ended_at - interval '30 s',"
            " last_heartbeat_at = ended_at - interval '5 s' WHERE epoch = 2"
        )
    finally:
        await conn.close()
    billed = await ledger.get_job(job.job_id, "alice")
    assert billed is not None and billed.gpu_seconds == pytest.approx(60 + 30)


async def test_api_keys_list_as_domain_values(ledger: Ledger) -> None:
    await ledger.insert_api_key("k1", "alice", b"a" * 32, webhook_url="https://example.com/h")
    await ledger.insert_api_key("k2", "bob", b"b" * 32)
    assert await ledger.revoke_api_key("k2")
    first, second = await ledger.list_api_keys()
    assert isinstance(first, ApiKeyInfo)
    assert (first.key_id, first.owner, first.webhook_url, first.revoked_at) == (
        "k1",
        "alice",
        "https://example.com/h",
        None,
    )
    assert second.key_id == "k2" and second.revoked_at is not None
    assert second.revoked_at >= second.created_at
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.owner = "mallory"  # type: ignore[misc]


async def test_job_leases_are_the_audit_trail_as_domain_values(ledger: Ledger) -> None:
    job = (await ledger.insert_jobs("alice", [new_job()]))[0]
    first = await ledger.claim_job("a", 0, 0.0, secret_sha256=SECRET)
    assert first is not None
    await ledger.expire_leases()
    second = await ledger.claim_job("b", 0, TTL_S, secret_sha256=SECRET)
    assert second is not None
    expired, live = await ledger.job_leases(job.job_id)
    assert isinstance(expired, LeaseRecord)
    assert (expired.lease_id, expired.job_id, expired.epoch, expired.machine_id) == (
        first.lease_id,
        job.job_id,
        1,
        "a",
    )
    assert expired.end_reason == "expired" and expired.ended_at is not None
    assert (live.lease_id, live.epoch, live.ended_at, live.end_reason) == (
        second.lease_id,
        2,
        None,
        None,
    )
    assert live.granted_at <= live.last_heartbeat_at


async def test_webhook_deliveries_list_as_domain_values(ledger: Ledger) -> None:
    await ledger.insert_api_key(
        "k1", "alice", b"a" * 32, webhook_url="https://example.com/h", webhook_events=["canceled"]
    )
    job = (await ledger.insert_jobs("alice", [new_job()], api_key_id="k1"))[0]
    assert await ledger.cancel_job(job.job_id, "alice") is not None
    (claimed,) = await ledger.claim_webhook_deliveries(10, 30.0)
    await ledger.webhook_failed(claimed.delivery_id, 503, "HTTP 503", None)
    (delivery,) = await ledger.list_webhook_deliveries(job.job_id)
    assert isinstance(delivery, WebhookDeliveryRecord)
    assert (delivery.delivery_id, delivery.event, delivery.url, delivery.attempts) == (
        claimed.delivery_id,
        "canceled",
        "https://example.com/h",
        1,
    )
    assert (delivery.last_status, delivery.last_error, delivery.delivered_at) == (
        503,
        "HTTP 503",
        None,
    )
    assert delivery.gave_up_at is not None and delivery.created_at <= delivery.gave_up_at


async def test_machine_qualification_is_stored_from_a_domain_value(
    ledger: Ledger, database_url: str
) -> None:
    machine = Machine(
        machine_id="m1",
        provider_instance_id="i-1",
        gpu_model="L4",
        vram_mb=24_000,
        qualified=True,
        version="1.0",
    )
    qualification = Qualification(
        passed=True,
        detail="ok",
        tflops=30.5,
        free_memory_mb=20_000,
        free_disk_mb=50_000,
        versions={"torch": "2.5"},
    )
    await ledger.upsert_machine(machine, qualification)
    conn = await asyncpg.connect(database_url)
    try:
        stored = await conn.fetchval(
            "SELECT qualification::text FROM machines WHERE machine_id = 'm1'"
        )
    finally:
        await conn.close()
    assert json.loads(stored) == {
        "passed": True,
        "detail": "ok",
        "tflops": 30.5,
        "free_memory_mb": 20_000,
        "free_disk_mb": 50_000,
        "versions": {"torch": "2.5"},
    }
