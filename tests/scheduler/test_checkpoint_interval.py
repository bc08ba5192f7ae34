"""`checkpointing_steps: auto`: each lease's interval from Young-Daly, sqrt(2 x C x M), with C
the checkpoint cost its worker reports (else the prior) and M the ledger's mean time between
interruptions of the worker's GPU class (verified machines only), in steps at the fleet's pace."""

from __future__ import annotations

import math
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import grpc
import pytest

from lorafleet.core.spec import CHECKPOINTING_AUTO
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.checkpoint_interval import RecentFigures, young_daly_steps
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.job_handler import PRIOR_S_PER_STEP
from tests.support.fleet import Fleet
from tests.support.workers import ScriptedWorker, connect_worker, local_identity

GPU = "NVIDIA GeForce RTX 4090"
DEFAULTS = SchedulerConfig.model_fields
COST_PRIOR_S = DEFAULTS["checkpoint_cost_prior_s"].default
MTBI_PRIOR_S = DEFAULTS["interruption_prior_s"].default
# The scripted jobs' shape (1024 px, batch 1) has no verified completions: the prior pace.
S_PER_STEP = PRIOR_S_PER_STEP


def expected_steps(*, cost_s: float, interruptions: int, lease_s: float, max_steps: int) -> int:
    mtbi_s = (lease_s + MTBI_PRIOR_S) / (interruptions + 1)
    steps = round(math.sqrt(2 * cost_s * mtbi_s) / S_PER_STEP)
    return min(max(steps, 10), max_steps)


async def record_history(
    database_url: str, job_id: str, machine_id: str, *, verified: bool, ends: list[str]
) -> float:
    """Leases of `job_id` on `machine_id` (a GPU-class machine), one hour each, ended as `ends`
    say ('' : still running); returns the lease-seconds they add."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO machines (machine_id, gpu_model, identity_provider) VALUES ($1, $2, $3)",
            machine_id,
            GPU,
            "local" if verified else "",
        )
        for end in ends:
            await conn.execute(
                "INSERT INTO leases (lease_id, job_id, epoch, machine_id, granted_at, ended_at,"
                " end_reason)"
                " VALUES ($1, $2::uuid, (SELECT coalesce(max(epoch), 0) + 1 FROM leases"
                " WHERE job_id = $2::uuid), $3, now() - interval '2 hours',"
                " CASE WHEN $4 = '' THEN NULL ELSE now() - interval '1 hour' END,"
                " NULLIF($4, ''))",
                uuid.uuid4(),
                job_id,
                machine_id,
                end,
            )
        # The job these leases were of is over: nothing claims it again.
        await conn.execute(
            "UPDATE jobs SET state = 'CANCELED', finished_at = now(),"
            " epoch = (SELECT max(epoch) FROM leases WHERE job_id = $1::uuid)"
            " WHERE job_id = $1::uuid",
            job_id,
        )
        lease_s = await conn.fetchval(
            "SELECT sum(extract(epoch FROM coalesce(ended_at, now()) - granted_at))::float8"
            " FROM leases WHERE machine_id = $1",
            machine_id,
        )
    finally:
        await conn.close()
    return float(lease_s or 0.0)


async def grant(worker: ScriptedWorker, cost_s: float = 0.0) -> fpb.LeaseGranted:
    await worker.send(ready=fpb.Ready(checkpoint_cost_s=cost_s))
    granted: fpb.LeaseGranted = await worker.expect("lease_granted")
    return granted


async def notices(fleet: Fleet, job_id: str) -> list[str]:
    return [
        e.message
        for e in await fleet.alice.events(job_id)
        if e.kind == pb.JOB_EVENT_KIND_NOTICE and "Young-Daly" in e.message
    ]


def test_new_jobs_default_to_auto() -> None:
    assert DEFAULTS["checkpoint_min_steps"].default == 10
    from lorafleet.core.serde import spec_from_proto

    assert (
        spec_from_proto(
            pb.JobSpec(instance_prompt="p", instance_data_prefix="a/b", max_train_steps=5)
        ).checkpointing_steps
        == CHECKPOINTING_AUTO
    )


@pytest.mark.parametrize(
    ("cost_s", "mtbi_s", "s_per_step", "max_steps", "steps"),
    [
        (20.0, 14_400.0, 1.0, 10_000, 759),  # sqrt(2 * 20 * 14400) = 758.9
        (0.01, 60.0, 1.0, 10_000, 10),  # at least 10 steps
        (3600.0, 1e7, 0.1, 1_400, 1_400),  # at most max_train_steps
        (0.01, 60.0, 1.0, 4, 4),  # a job shorter than the floor: its length
    ],
)
def test_young_daly_steps_is_bounded(
    cost_s: float, mtbi_s: float, s_per_step: float, max_steps: int, steps: int
) -> None:
    assert (
        young_daly_steps(
            cost_s=cost_s,
            mtbi_s=mtbi_s,
            seconds_per_step=s_per_step,
            min_steps=10,
            max_steps=max_steps,
        )
        == steps
    )


async def test_the_interval_follows_young_daly_from_the_ledger(
    fleet: Fleet, database_url: str
) -> None:
    history = await fleet.alice.submit(checkpointing_steps=10)
    # v1's two interruptions count as one: a machine counts at most one in the window.
    lease_s = await record_history(
        database_url, history.job_id, "v1", verified=True, ends=["expired", "drained", "succeeded"]
    )
    lease_s += await record_history(
        database_url, history.job_id, "v2", verified=True, ends=["drained", "canceled", ""]
    )
    # An unverified machine of the same class interrupting all the time counts for nothing.
    await record_history(
        database_url, history.job_id, "self-declared", verified=False, ends=["expired"] * 20
    )
    job = await fleet.alice.submit(max_train_steps=5_000, checkpointing_steps=0)
    async with connect_worker(fleet.channel, fleet.token, "m1", gpu_model=GPU) as worker:
        granted = await grant(worker, cost_s=12.5)
    assert granted.lease.job_id == job.job_id
    steps = expected_steps(cost_s=12.5, interruptions=2, lease_s=lease_s, max_steps=5_000)
    assert granted.spec.checkpointing_steps == steps
    (notice,) = await notices(fleet, job.job_id)
    assert f"every {steps} steps" in notice and "2 interruptions" in notice
    assert "reported by the worker" in notice
    # The job keeps asking for auto: a later lease chooses again.
    stored = await fleet.scheduler.ledger.get_job_any_owner(job.job_id)
    assert stored is not None and stored.spec.checkpointing_steps == CHECKPOINTING_AUTO


async def test_a_liars_reported_cost_moves_only_its_own_leases_interval(fleet: Fleet) -> None:
    first = await fleet.alice.submit(max_train_steps=50_000, checkpointing_steps=0)
    second = await fleet.alice.submit(max_train_steps=50_000, checkpointing_steps=0)
    async with (
        connect_worker(fleet.channel, fleet.token, "liar", gpu_model=GPU) as liar,
        connect_worker(fleet.channel, fleet.token, "honest", gpu_model=GPU) as honest,
    ):
        lied = await grant(liar, cost_s=3600.0)
        told = await grant(honest)
    assert lied.lease.job_id == first.job_id and told.lease.job_id == second.job_id
    assert lied.spec.checkpointing_steps == expected_steps(
        cost_s=3600.0, interruptions=0, lease_s=0.0, max_steps=50_000
    )
    # The honest worker (no cost measured yet) gets the prior's interval, as with no liar.
    assert told.spec.checkpointing_steps == expected_steps(
        cost_s=COST_PRIOR_S, interruptions=0, lease_s=0.0, max_steps=50_000
    )
    (notice,) = await notices(fleet, second.job_id)
    assert "(prior)" in notice


@pytest.mark.parametrize(
    "scheduler_overrides",
    # Figures read at every grant, and a Hello budget that is not what stops the attack.
    [{"interruption_figures_ttl_s": 0.0, "worker_hello_burst_per_verified_machine": 100}],
)
async def test_one_machine_draining_in_a_loop_moves_others_intervals_at_most_1_5x(
    fleet: Fleet, database_url: str
) -> None:
    """A provider-verified machine naming the honest nodes' GPU repeats Ready, one tiny
    checkpoint, Draining, reconnect twelve times in seconds. Counted per machine with a cap,
    its twelve drains weigh one interruption: an honest node's next automatic interval moves by
    at most sqrt(2), within the 1.5x asked.
    Before, the class's mean time between interruptions fell twelvefold (interval 3.6x
    shorter), and kept falling with every loop."""
    history = await fleet.alice.submit(checkpointing_steps=10)
    await record_history(
        database_url, history.job_id, "old-4090", verified=True, ends=["succeeded"] * 5
    )
    jobs = [await fleet.alice.submit(max_train_steps=50_000, checkpointing_steps=0) for _ in "ab"]
    async with connect_worker(fleet.channel, fleet.token, "honest-1", gpu_model=GPU) as honest:
        before = (await grant(honest)).spec.checkpointing_steps
    identity = local_identity(fleet.scheduler.identity_secret, "drainer")
    for i in range(12):
        async with connect_worker(
            fleet.channel, fleet.token, "drainer", identity=identity, gpu_model=GPU
        ) as drainer:
            granted = await drainer.ready_for_lease()
            # One tiny checkpoint a lease: no lease of it "ended empty" (that quarantines).
            await drainer.store_checkpoint(granted.lease, 10 * (i + 1))
            await drainer.send(draining=fpb.Draining(lease=drainer.ref(granted.lease), reason="x"))
    conn = await asyncpg.connect(database_url)
    try:
        drained = await conn.fetchval(
            "SELECT count(*) FROM leases WHERE machine_id = 'drainer' AND end_reason = 'drained'"
        )
    finally:
        await conn.close()
    assert drained == 12
    async with connect_worker(fleet.channel, fleet.token, "honest-2", gpu_model=GPU) as honest:
        granted = await grant(honest)
    after = granted.spec.checkpointing_steps
    assert granted.lease.job_id in {j.job_id for j in jobs}
    assert before / 1.5 <= after <= before, (before, after)


async def test_an_explicit_interval_is_kept(fleet: Fleet) -> None:
    job = await fleet.alice.submit(checkpointing_steps=7)
    async with connect_worker(fleet.channel, fleet.token, "m1", gpu_model=GPU) as worker:
        granted = await grant(worker, cost_s=1.0)
    assert granted.spec.checkpointing_steps == 7
    assert await notices(fleet, job.job_id) == []


async def test_an_automatic_grant_carries_its_interval_in_seconds(fleet: Fleet) -> None:
    """The grant says what the steps were computed from, sqrt(2 C M) seconds, so that the worker
    can re-derive them at its own pace; a job's own fixed interval carries none."""
    await fleet.alice.submit(checkpointing_steps=0, max_train_steps=100_000)
    async with connect_worker(fleet.channel, fleet.token, "m1", gpu_model=GPU) as worker:
        granted = await grant(worker, cost_s=2.0)
    seconds = math.sqrt(2 * 2.0 * MTBI_PRIOR_S)
    assert granted.checkpoint_interval_s == pytest.approx(seconds)
    assert granted.checkpoint_min_steps == 10
    assert granted.spec.checkpointing_steps == round(seconds / S_PER_STEP)

    await fleet.alice.submit(checkpointing_steps=7)
    async with connect_worker(fleet.channel, fleet.token, "m2", gpu_model=GPU) as worker:
        fixed = await grant(worker, cost_s=2.0)
    assert fixed.spec.checkpointing_steps == 7 and fixed.checkpoint_interval_s == 0


@pytest.mark.parametrize("cost_s", [-1.0, math.inf, math.nan, 3601.0])
async def test_a_bad_checkpoint_cost_is_refused_naming_the_field(
    fleet: Fleet, cost_s: float
) -> None:
    await fleet.alice.submit(checkpointing_steps=0)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        await worker.send(ready=fpb.Ready(checkpoint_cost_s=cost_s))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.expect("lease_granted")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ready.checkpoint_cost_s" in (refused.value.details() or "")


async def test_ledger_figures_are_reused_for_a_while_and_bounded() -> None:
    loads: list[str] = []

    def loader(key: str) -> Callable[[], Awaitable[str]]:
        async def load() -> str:
            loads.append(key)
            return key.upper()

        return load

    recent: RecentFigures[str, str] = RecentFigures(ttl_s=3600.0, kept=2)
    assert await recent.get("a", loader("a")) == "A"
    assert await recent.get("a", loader("a")) == "A"
    assert loads == ["a"]  # reused within its time
    # A worker inventing GPU classes: only `kept` stay, the least recently used goes first.
    await recent.get("b", loader("b"))
    await recent.get("a", loader("a"))  # used again: now b is the least recent
    await recent.get("c", loader("c"))  # b goes
    await recent.get("a", loader("a"))
    await recent.get("b", loader("b"))
    assert loads == ["a", "b", "c", "b"]
    stale: RecentFigures[str, str] = RecentFigures(ttl_s=0.0)
    await stale.get("x", loader("x"))
    await stale.get("x", loader("x"))
    assert loads[-2:] == ["x", "x"]  # past its time: loaded again
