"""Warm dispatch: a worker is offered the queued job it says it holds warm (compiled shape, else
parked adapter shape, else base model), within the strict queue order's classes (re-queued
first, then priority) and the fairness bound; what it says is unverified and changes only which
claimable job it gets."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import grpc
import pytest

from lorafleet.core.serde import MAX_WARM_KEY_CHARS, MAX_WARM_SHAPES, spec_from_proto
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.ledger.ledger import Ledger, NewJob
from tests.support.fleet import Fleet
from tests.support.jobs import spec
from tests.support.workers import ScriptedWorker, connect_worker

# Two job shapes on the default base model, and a third job on another base model.
SHAPE_A: dict[str, Any] = dict(resolution=512)
SHAPE_B: dict[str, Any] = dict(resolution=768, lora_rank=8)
OTHER_MODEL: dict[str, Any] = dict(base_model="org/other-sdxl")


def keys(**overrides: Any) -> tuple[str, str]:
    """(resident_key, compiled_shape_key) of the spec the scheduler stores for these fields."""
    job_spec = spec_from_proto(spec(**overrides))
    return job_spec.resident_key, job_spec.compiled_shape_key


def adapter_key(**overrides: Any) -> str:
    """The adapter_shape_key of the spec the scheduler stores for these fields."""
    return spec_from_proto(spec(**overrides)).adapter_shape_key


def warm(
    *, resident: str = "", shapes: tuple[str, ...] = (), adapters: tuple[str, ...] = ()
) -> fpb.Ready:
    return fpb.Ready(
        warm=fpb.WarmState(
            resident=resident, compiled_shapes=list(shapes), adapter_shapes=list(adapters)
        )
    )


async def granted_job(worker: ScriptedWorker, ready: fpb.Ready) -> str:
    await worker.send(ready=ready)
    granted: fpb.LeaseGranted = await worker.expect("lease_granted")
    return granted.lease.job_id


async def granted_before(
    fleet: Fleet, database_url: str, machine_id: str, *shapes: dict[str, Any]
) -> None:
    """The scheduler handed `machine_id` a job of each shape earlier (a finished job and its
    lease in the ledger): warm dispatch believes a worker's warm state only for keys of jobs
    the scheduler itself granted that machine."""
    ledger = fleet.scheduler.ledger
    for overrides in shapes:
        (job,) = await ledger.insert_jobs(
            "someone-earlier",
            [
                NewJob(
                    job_id=str(uuid.uuid4()),
                    spec=spec_from_proto(spec(**overrides)),
                    idempotency_key="",
                    traceparent="",
                )
            ],
        )
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(
                "UPDATE jobs SET state = 'SUCCEEDED', epoch = 1, finished_at = now(),"
                " created_at = created_at - interval '1 day' WHERE job_id = $1::uuid",
                job.job_id,
            )
            await conn.execute(
                "INSERT INTO leases (lease_id, job_id, epoch, machine_id, granted_at, ended_at,"
                " end_reason) VALUES ($1, $2::uuid, 1, $3, now() - interval '1 hour', now(),"
                " 'succeeded')",
                uuid.uuid4(),
                job.job_id,
                machine_id,
            )
        finally:
            await conn.close()


async def backdate(database_url: str, job_id: str, seconds: float) -> None:
    """The job was submitted `seconds` ago: how a test stands in for waiting in the queue."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE jobs SET created_at = created_at - make_interval(secs => $2),"
            " queued_at = queued_at - make_interval(secs => $2)"
            " WHERE job_id = $1::uuid",
            job_id,
            seconds,
        )
    finally:
        await conn.close()


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 600.0}])
async def test_a_worker_warm_for_shape_b_gets_the_b_jobs_first(
    fleet: Fleet, database_url: str
) -> None:
    await granted_before(fleet, database_url, "warm-b1", SHAPE_B)
    await granted_before(fleet, database_url, "warm-b2", SHAPE_B)
    a1 = await fleet.alice.submit(**SHAPE_A)
    b1 = await fleet.alice.submit(**SHAPE_B)
    a2 = await fleet.alice.submit(**SHAPE_A)
    b2 = await fleet.alice.submit(**SHAPE_B)
    resident, shape_b = keys(**SHAPE_B)
    async with (
        connect_worker(fleet.channel, fleet.token, "warm-b1") as warm_b1,
        connect_worker(fleet.channel, fleet.token, "warm-b2") as warm_b2,
        connect_worker(fleet.channel, fleet.token, "cold") as cold,
    ):
        assert await granted_job(warm_b1, warm(resident=resident, shapes=(shape_b,))) == b1.job_id
        assert await granted_job(warm_b2, warm(resident=resident, shapes=(shape_b,))) == b2.job_id
        # A cold worker (or one holding only the base model every job shares) takes the
        # oldest job, as strict order does.
        assert await granted_job(cold, warm(resident=resident)) == a1.job_id
    remaining = await fleet.scheduler.ledger.get_job_any_owner(a2.job_id)
    assert remaining is not None and remaining.epoch == 0


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 600.0}])
async def test_the_compiled_shape_wins_over_the_base_model_which_wins_over_age(
    fleet: Fleet, database_url: str
) -> None:
    await granted_before(fleet, database_url, "m1", OTHER_MODEL, SHAPE_B)
    await granted_before(fleet, database_url, "m2", OTHER_MODEL)
    a1 = await fleet.alice.submit(**SHAPE_A)
    other = await fleet.alice.submit(**OTHER_MODEL)
    b1 = await fleet.alice.submit(**SHAPE_B)
    other_resident, _ = keys(**OTHER_MODEL)
    _, shape_b = keys(**SHAPE_B)
    async with (
        connect_worker(fleet.channel, fleet.token, "m1") as m1,
        connect_worker(fleet.channel, fleet.token, "m2") as m2,
        connect_worker(fleet.channel, fleet.token, "m3") as m3,
    ):
        # Holds the other base model resident and shape B compiled: the compiled shape first.
        ready = warm(resident=other_resident, shapes=(shape_b,))
        assert await granted_job(m1, ready) == b1.job_id
        assert await granted_job(m2, warm(resident=other_resident)) == other.job_id
        assert await granted_job(m3, warm()) == a1.job_id


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 600.0}])
async def test_a_parked_adapter_shape_comes_after_the_compiled_shape_before_the_base_model(
    fleet: Fleet, database_url: str
) -> None:
    """Shape C differs from A only in its adapters (rank 8): a worker whose resident model
    holds rank-8 adapters parked is offered C before the older A; one that also holds A's
    step compiled is offered A."""
    shape_c: dict[str, Any] = dict(SHAPE_A, lora_rank=8)
    await granted_before(fleet, database_url, "m1", shape_c)
    await granted_before(fleet, database_url, "m2", SHAPE_A, shape_c)
    await granted_before(fleet, database_url, "m3", SHAPE_A)
    a1 = await fleet.alice.submit(**SHAPE_A)
    c1 = await fleet.alice.submit(**shape_c)
    a2 = await fleet.alice.submit(**SHAPE_A)
    resident, compiled_a = keys(**SHAPE_A)
    assert adapter_key(**shape_c) != adapter_key(**SHAPE_A)
    async with (
        connect_worker(fleet.channel, fleet.token, "m1") as m1,
        connect_worker(fleet.channel, fleet.token, "m2") as m2,
        connect_worker(fleet.channel, fleet.token, "m3") as m3,
    ):
        parked_c = warm(resident=resident, adapters=(adapter_key(**shape_c),))
        assert await granted_job(m1, parked_c) == c1.job_id
        both = warm(resident=resident, shapes=(compiled_a,), adapters=(adapter_key(**shape_c),))
        assert await granted_job(m2, both) == a1.job_id
        assert await granted_job(m3, warm(resident=resident)) == a2.job_id


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 5.0}])
async def test_a_job_queued_longer_than_the_bound_goes_in_strict_order(
    fleet: Fleet, database_url: str
) -> None:
    for machine in ("m1", "m2", "m3"):
        await granted_before(fleet, database_url, machine, SHAPE_B)
    a1 = await fleet.alice.submit(**SHAPE_A)
    a2 = await fleet.alice.submit(**SHAPE_A)
    await fleet.alice.submit(**SHAPE_A)
    b1 = await fleet.alice.submit(**SHAPE_B)
    await backdate(database_url, a1.job_id, 10.0)
    await backdate(database_url, a2.job_id, 6.0)
    _, shape_b = keys(**SHAPE_B)
    async with (
        connect_worker(fleet.channel, fleet.token, "m1") as m1,
        connect_worker(fleet.channel, fleet.token, "m2") as m2,
        connect_worker(fleet.channel, fleet.token, "m3") as m3,
    ):
        # a1 and a2 have waited past the bound: oldest first, whatever the worker holds; then
        # the warm preference again among jobs still within it (b1 before the older a3).
        assert await granted_job(m1, warm(shapes=(shape_b,))) == a1.job_id
        assert await granted_job(m2, warm(shapes=(shape_b,))) == a2.job_id
        assert await granted_job(m3, warm(shapes=(shape_b,))) == b1.job_id


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 0.0}])
async def test_a_bound_of_zero_is_strict_queue_order(fleet: Fleet) -> None:
    a1 = await fleet.alice.submit(**SHAPE_A)
    await fleet.alice.submit(**SHAPE_B)
    _, shape_b = keys(**SHAPE_B)
    async with connect_worker(fleet.channel, fleet.token, "m1") as m1:
        assert await granted_job(m1, warm(shapes=(shape_b,))) == a1.job_id


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 600.0}])
async def test_priority_wins_over_warmth(fleet: Fleet) -> None:
    await fleet.alice.submit(**SHAPE_B)
    urgent = await fleet.alice.submit(**SHAPE_A, priority=5)
    _, shape_b = keys(**SHAPE_B)
    async with connect_worker(fleet.channel, fleet.token, "m1") as m1:
        assert await granted_job(m1, warm(shapes=(shape_b,))) == urgent.job_id


@pytest.mark.parametrize(
    "scheduler_overrides", [{"warm_dispatch_bound_s": 600.0, "fleet_max_vram_mb": 204_800}]
)
async def test_a_worker_lying_about_its_warm_state_only_changes_which_job_it_gets(
    fleet: Fleet, database_url: str
) -> None:
    """It was granted shape B once, and claims B and keys no job has: it still gets one
    claimable job (none it may not hold, no second lease), overdue jobs still go first, and the
    next worker is served as strict order serves it."""
    await granted_before(fleet, database_url, "liar", SHAPE_B)
    a1 = await fleet.alice.submit(**SHAPE_A)
    big_b = await fleet.alice.submit(**SHAPE_B, min_vram_mb=100_000)
    b1 = await fleet.alice.submit(**SHAPE_B)
    b2 = await fleet.alice.submit(**SHAPE_B)
    _, shape_b = keys(**SHAPE_B)
    lie = warm(resident="anything", shapes=(shape_b, "x" * MAX_WARM_KEY_CHARS))
    async with (
        connect_worker(fleet.channel, fleet.token, "liar", vram_mb=24_000) as liar,
        connect_worker(fleet.channel, fleet.token, "honest") as honest,
    ):
        # B jobs rank first for it, but the big one needs more memory than it has.
        assert await granted_job(liar, lie) == b1.job_id
        # Saying Ready again gives its lease up (and bans it from that job): no hoarding.
        assert await granted_job(liar, lie) == b2.job_id
        dropped = await fleet.scheduler.ledger.get_job_any_owner(b1.job_id)
        assert dropped is not None and dropped.state.value == "QUEUED"
        # The honest, cold worker: the re-queued job first (it has progress), as strict order.
        assert await granted_job(honest, warm()) == b1.job_id
    await backdate(database_url, a1.job_id, 3600.0)
    await granted_before(fleet, database_url, "liar2", SHAPE_B)
    async with connect_worker(fleet.channel, fleet.token, "liar2", vram_mb=200_000) as liar2:
        # An overdue job is not passed over for what a worker says it holds.
        assert await granted_job(liar2, warm(shapes=(shape_b,))) == a1.job_id
    still = await fleet.scheduler.ledger.get_job_any_owner(big_b.job_id)
    assert still is not None and still.epoch == 0


@pytest.mark.parametrize("scheduler_overrides", [{"warm_dispatch_bound_s": 600.0}])
async def test_a_worker_cannot_pick_a_tenant_by_naming_its_model(
    fleet: Fleet, database_url: str
) -> None:
    """Bob trains on a model of his own; a worker (even one that ran other jobs before) says
    it holds Bob's model resident and his step compiled. The scheduler never handed it a job of
    Bob's, so it is served in strict order: Alice's older job, not Bob's. Before, it was handed
    Bob's job ahead of older ones: it could pick whose images it got."""
    bobs: dict[str, Any] = dict(base_model="bob/private-sdxl")
    await granted_before(fleet, database_url, "picker", SHAPE_A)
    older = await fleet.alice.submit(**SHAPE_B)
    bob_job = await fleet.bob.submit(**bobs)
    bob_resident, bob_shape = keys(**bobs)
    claim = warm(resident=bob_resident, shapes=(bob_shape,), adapters=(adapter_key(**bobs),))
    async with connect_worker(fleet.channel, fleet.token, "picker") as picker:
        assert await granted_job(picker, claim) == older.job_id
    queued = await fleet.scheduler.ledger.get_job_any_owner(bob_job.job_id)
    assert queued is not None and queued.epoch == 0


@pytest.mark.parametrize(
    ("ready", "field"),
    [
        (warm(shapes=tuple(f"s{i}" for i in range(MAX_WARM_SHAPES + 1))), "compiled_shapes"),
        (warm(shapes=("ok", "y" * (MAX_WARM_KEY_CHARS + 1))), "compiled_shapes[1]"),
        (warm(resident="r" * (MAX_WARM_KEY_CHARS + 1)), "ready.warm.resident"),
        (warm(resident="a\x00b"), "ready.warm.resident"),
        (warm(adapters=tuple(f"a{i}" for i in range(MAX_WARM_SHAPES + 1))), "adapter_shapes"),
        (warm(adapters=("z" * (MAX_WARM_KEY_CHARS + 1),)), "ready.warm.adapter_shapes[0]"),
    ],
)
async def test_an_oversized_warm_state_is_refused_naming_the_field(
    fleet: Fleet, ready: fpb.Ready, field: str
) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        await worker.send(ready=ready)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.expect("lease_granted")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (refused.value.details() or "")
    assert (await fleet.alice.get(job.job_id)).state == pb.JOB_STATE_QUEUED


async def test_jobs_from_before_warm_dispatch_get_their_keys_from_the_spec(
    ledger: Ledger, database_url: str
) -> None:
    """Jobs submitted before the ledger had warm keys are filled in from the same definition
    (JobSpec) a submit uses; finished ones are left alone."""
    jobs = await ledger.insert_jobs(
        "alice",
        [
            NewJob(
                job_id=str(uuid.uuid4()),
                spec=spec_from_proto(spec(**s)),
                idempotency_key="",
                traceparent="",
            )
            for s in (SHAPE_A, OTHER_MODEL, SHAPE_B)
        ],
    )
    conn = await asyncpg.connect(database_url)
    try:
        # The first two jobs as submitted before 0016, the second as before 0019 too.
        await conn.execute(
            "UPDATE jobs SET resident_key = NULL, compiled_shape_key = NULL,"
            " adapter_shape_key = NULL WHERE job_id = $1::uuid",
            jobs[0].job_id,
        )
        await conn.execute("UPDATE jobs SET adapter_shape_key = NULL")
        await conn.execute(
            "UPDATE jobs SET state = 'CANCELED', finished_at = now() WHERE job_id = $1::uuid",
            jobs[2].job_id,
        )
        assert await ledger.fill_warm_keys(batch=1) == 2
        rows = {
            str(r["job_id"]): (r["resident_key"], r["compiled_shape_key"], r["adapter_shape_key"])
            for r in await conn.fetch(
                "SELECT job_id, resident_key, compiled_shape_key, adapter_shape_key FROM jobs"
            )
        }
    finally:
        await conn.close()
    assert rows == {
        jobs[0].job_id: (*keys(**SHAPE_A), adapter_key(**SHAPE_A)),
        jobs[1].job_id: (*keys(**OTHER_MODEL), adapter_key(**OTHER_MODEL)),
        jobs[2].job_id: (*keys(**SHAPE_B), None),
    }


async def test_a_jobs_wait_counts_from_its_last_re_queue(fleet: Fleet, database_url: str) -> None:
    """queued_at (the fairness bound's clock) is set at submit and again whenever any statement
    puts the job back in the queue (a trigger), and not by other updates."""
    job = await fleet.alice.submit()

    async def queued_at() -> Any:
        conn = await asyncpg.connect(database_url)
        try:
            return await conn.fetchval(
                "SELECT queued_at FROM jobs WHERE job_id = $1::uuid", job.job_id
            )
        finally:
            await conn.close()

    submitted = await queued_at()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 5)
        await worker.store_checkpoint(granted.lease, 10)
        assert await queued_at() == submitted  # a grant and progress leave it
        await worker.send(draining=fpb.Draining(lease=worker.ref(granted.lease), reason="spot"))
    await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    assert await queued_at() > submitted
