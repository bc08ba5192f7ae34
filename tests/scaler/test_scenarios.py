"""The scaler end to end: a real scheduler and Postgres, the SaladCloud double over HTTP as the
provider, and one scripted worker per running instance (tests/scaler/fleet_sim.py). Time is the
test's: the scaler's clock and the double's cold starts move when the test says; ticks are
driven with `await scaler.tick()`; waits are on ledger notifications, bounded. Every scenario
runs twice: with instances that leave at once, and with instances that stay `stopping` for
`STOP_S` (removed, reallocated) until the test lets the platform catch up (`World.settle`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from lorafleet.core.model import upload_key
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.ledger.ledger import Ledger
from lorafleet.scaler.policy import Action, PolicyConfig
from lorafleet.scaler.provider import Instance
from lorafleet.scaler.salad import SaladConfig, SaladProvider
from lorafleet.scaler.service import SCALER_LOCK, NotActive, Outcome, Scaler
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.server import Scheduler
from tests.scaler.fleet_sim import (
    WAIT_S,
    FleetSim,
    LedgerWatch,
    Script,
    SimClock,
    fail_node,
    finish,
    hold,
)
from tests.scaler.salad_double import SaladDouble
from tests.support.fleet import WORKER_TOKEN, scheduler_config
from tests.support.jobs import JobClient

pytestmark = pytest.mark.timeout(120)

COLD_START_S = 60.0
STOP_S = 5.0


@dataclass
class World:
    scheduler: Scheduler
    ledger: Ledger
    database_url: str
    alice: JobClient
    double: SaladDouble
    clock: SimClock
    watch: LedgerWatch
    channel: grpc.aio.Channel
    sims: list[FleetSim]
    scalers: list[Scaler]

    def salad_config(self) -> SaladConfig:
        d = self.double
        return SaladConfig(
            organization=d.org,
            project=d.project,
            group=d.group,
            api_key=d.api_key,
            base_url=d.base_url,
            # A slow answer is not a failure: on a loaded machine the double (in this
            # process) can take a second to answer, and a tick whose look at the provider
            # failed decides nothing and waits for the next wake-up, which in a scenario
            # may never come. No scenario injects slowness; outages are 500s, answered
            # at once, so the short deadline still ends their retries quickly.
            request_timeout_s=10.0,
            deadline_s=0.3,
            initial_backoff_s=0.01,
            max_backoff_s=0.05,
        )

    def provider(self) -> SaladProvider:
        return SaladProvider(self.salad_config())

    def scaler(self, policy: PolicyConfig, **overrides: Any) -> Scaler:
        values: dict[str, Any] = dict(
            ledger=self.ledger,
            database_url=self.database_url,
            provider=self.provider(),
            policy=policy,
            clock=self.clock,
            tick_interval_s=3600.0,
            min_tick_gap_s=0.0,
            reconnect_delay_s=0.05,
        )
        values.update(overrides)
        scaler = Scaler(**values)
        self.scalers.append(scaler)
        return scaler

    def sim(self, scripts: Callable[[str], Script]) -> FleetSim:
        sim = FleetSim(
            channel=self.channel,
            token=WORKER_TOKEN,
            double=self.double,
            scripts=scripts,
            identity_secret=self.scheduler.identity_secret,
        )
        self.sims.append(sim)
        return sim

    def advance(self, seconds: float) -> None:
        """Time passes for the scaler and for the double's cold starts alike."""
        self.clock.advance(seconds)
        self.double.clock.advance(seconds)

    def settle(self) -> None:
        """The platform finishes what is stopping (removals leave, reallocations move)."""
        self.double.advance(self.double.stop_s)

    async def submit(self, count: int, **spec: Any) -> list[str]:
        return [(await self.alice.submit(**spec)).job_id for _ in range(count)]

    async def states(self) -> dict[str, int]:
        rows = await self.watch.conn.fetch("SELECT state, count(*) FROM jobs GROUP BY state")
        return {r["state"]: r["count"] for r in rows}


@pytest.fixture(params=[0.0, STOP_S], ids=["instant-stop", "slow-stop"])
async def world(
    request: pytest.FixtureRequest, database_url: str, tmp_path: Path
) -> AsyncIterator[World]:
    # Scripted workers finish a job in milliseconds (one may run 20 jobs, 100+ messages, in a
    # second), far above any real worker's pace; the per-stream rate limit has its own tests
    # (tests/scheduler/test_worker_trust.py) and is not what these scenarios are about.
    config = scheduler_config(database_url, tmp_path / "data", worker_message_burst=10_000)
    double = SaladDouble(cold_start_s=COLD_START_S, stop_s=request.param)
    await double.start()
    async with Scheduler(config) as scheduler:
        await scheduler.storage.put_bytes(upload_key("alice", "dogs/rex", "1.png"), b"png")
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel,
            LedgerWatch.open(database_url) as watch,
        ):
            stub = pbgrpc.JobServiceStub(channel)
            key = (await create_api_key(scheduler.ledger, "alice")).key
            w = World(
                scheduler=scheduler,
                ledger=scheduler.ledger,
                database_url=database_url,
                alice=JobClient(stub, key),
                double=double,
                clock=SimClock(),
                watch=watch,
                channel=channel,
                sims=[],
                scalers=[],
            )
            try:
                yield w
            finally:
                for scaler in w.scalers:
                    await scaler.close()
                for sim in w.sims:
                    await sim.close()
    await double.close()


def actions(outcomes: list[Outcome]) -> list[tuple[str, str]]:
    return [(o.decision.action.value, o.decision.target) for o in outcomes]


def applied(outcomes: list[Outcome], action: Action) -> list[Outcome]:
    return [o for o in outcomes if o.decision.action is action and o.applied]


async def instances(world: World) -> list[Instance]:
    return await world.provider().list_instances()


async def test_a_burst_scales_out_to_max_and_back_to_zero_when_idle(world: World) -> None:
    policy = PolicyConfig(max_replicas=5, idle_grace_s=600, cooldown_s=300)
    scaler = world.scaler(policy)
    await scaler.acquire()
    sim = world.sim(lambda _m: finish)

    assert await scaler.tick() == []  # no work, no fleet: nothing to say
    await world.submit(100, max_train_steps=10)
    outcomes = await scaler.tick()
    (scale,) = applied(outcomes, Action.SCALE)
    assert scale.decision.replicas == 5  # clamped to max
    assert world.double.replicas == 5
    world.advance(COLD_START_S)
    await sim.sync()
    assert len(sim.workers) == 5

    # While they work, the fleet stays at max; leased instances get a high deletion cost.
    again = await scaler.tick()
    assert not applied(again, Action.SCALE)
    # 100 jobs through five workers over real gRPC and Postgres: on a loaded 2-core machine
    # this took over 30 s (WAIT_S), a bound meant for one event.
    await world.watch.until(
        lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 100),
        "all 100 jobs succeeded",
        timeout_s=3 * WAIT_S,
    )
    # Every worker took part.
    assert all(w.grants for w in sim.workers.values())

    # Idle, but within the grace period: the fleet is kept, and the HOLD is one row.
    world.advance(60)
    first = await scaler.tick()
    second = await scaler.tick()
    # The first idle look also lowers the idle instances' deletion cost (once).
    assert ("hold", "fleet") in actions(first)
    assert {i.deletion_cost for i in await instances(world)} == {policy.idle_deletion_cost}
    assert actions(second) == [("hold", "fleet")]
    assert second[0].folded and second[0].decision_id == first[0].decision_id
    assert world.double.replicas == 5

    world.advance(policy.idle_grace_s)
    outcomes = await scaler.tick()
    (scale,) = applied(outcomes, Action.SCALE)
    assert scale.decision.replicas == 0 and len(scale.decision.remove) == 5
    world.settle()
    assert world.double.replicas == 0 and world.double.instances == {}
    await sim.sync()
    assert sim.workers == {} and sim.killed_while_leased == []

    log = await world.ledger.list_scaler_decisions(50)
    scales = [r for r in log if r.action == "scale"]
    assert [r.figures["replicas"] for r in scales] == [5, 0]  # newest first: from 5, from 0
    assert all(r.applied for r in scales)
    hold_row = next(r for r in log if r.action == "hold")
    assert hold_row.repeats == 2 and "idle grace" in hold_row.reason


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_scale_in_never_removes_a_leased_worker(world: World) -> None:
    policy = PolicyConfig(max_replicas=3, idle_grace_s=0, cooldown_s=300)
    scaler = world.scaler(policy)
    await scaler.acquire()
    holders = world.sim(lambda _m: hold(1.0))
    await world.submit(3)
    await scaler.tick()
    world.advance(COLD_START_S)
    await holders.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("RUNNING"), 3), "3 running")
    for w in holders.workers.values():
        async with asyncio.timeout(30):
            await w.settled.wait()

    # Two of the three finish; one keeps its lease.
    keeper, *done = sorted(holders.workers.values(), key=lambda w: w.machine_id)
    for w in done:
        w.release.set()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 2), "2 finished")

    # Within the cooldown after the scale-out: held, nothing removed.
    outcomes = await scaler.tick()
    assert not applied(outcomes, Action.SCALE) and world.double.replicas == 3
    assert any("cooldown" in o.decision.reason for o in outcomes)
    world.advance(policy.cooldown_s)
    outcomes = await scaler.tick()
    (scale,) = applied(outcomes, Action.SCALE)
    assert scale.decision.replicas == 1
    world.settle()
    left = await instances(world)
    assert [i.machine_id for i in left] == [keeper.machine_id]
    await holders.sync()
    assert holders.killed_while_leased == []
    assert keeper.lease is not None and keeper.machine_id in holders.workers
    keeper_job = keeper.lease.job_id
    assert await world.watch.value(
        "SELECT state FROM jobs WHERE job_id = $1::uuid", keeper_job
    ) == ("RUNNING")
    # Once it finishes, the last one goes too (idle grace 0, cooldown past).
    keeper.release.set()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 3), "all done")
    world.advance(policy.cooldown_s)
    (scale,) = applied(await scaler.tick(), Action.SCALE)
    world.settle()
    assert scale.decision.replicas == 0 and world.double.instances == {}
    await holders.sync()
    assert holders.killed_while_leased == []


async def test_a_node_failing_every_job_is_reallocated_before_any_job_fails(
    world: World,
) -> None:
    policy = PolicyConfig(max_replicas=1, fault_threshold=2, cooldown_s=300)
    scaler = world.scaler(policy)
    await scaler.acquire()
    bad: set[str] = set()
    sim = world.sim(lambda m: fail_node if m in bad else finish)
    jobs = await world.submit(3, max_failures=2)
    await scaler.tick()
    world.advance(COLD_START_S)
    bad.update(world.double.instances[i].machine_id for i in world.double.instances)
    (bad_machine,) = bad
    await sim.sync()
    # The bad node fails each job once (then it is banned from it): 3 node faults.
    await world.watch.until(
        lambda: _eq(
            world.watch.value("SELECT count(*) FROM leases WHERE end_reason = 'failed: node'"),
            3,
        ),
        "three node faults",
    )
    outcomes = await scaler.tick()
    (moved,) = applied(outcomes, Action.REALLOCATE)
    assert "node faults" in moved.decision.reason
    assert moved.decision.figures["faults_in_window"] == 3
    assert ("reallocate", moved.decision.target) in world.double.actions
    # The instance comes back on another machine, which finishes every job.
    world.settle()
    world.advance(COLD_START_S)
    await sim.sync()
    assert bad_machine not in sim.workers and len(sim.workers) == 1
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 3), "all done")
    for job_id in jobs:
        job = await world.ledger.get_job_any_owner(job_id)
        assert job is not None and (job.failures, job.node_faults) == (0, 1)
    # The next tick does not reallocate again (hold-off; the bad machine is gone anyway).
    assert not applied(await scaler.tick(), Action.REALLOCATE)


async def test_a_slow_node_is_dropped_and_its_job_finishes_elsewhere_from_its_checkpoint(
    world: World,
) -> None:
    # Scripted workers run 20 steps between two checkpoints in milliseconds: their observed
    # paces differ by timing noise alone, so "slow" here means a hundred times the median, and
    # no pace is too fast to be plausible.
    policy = PolicyConfig(
        max_replicas=4,
        slow_warmup_steps=10,
        slow_min_peers=3,
        slow_min_excess=100.0,
        cooldown_s=300,
        min_plausible_seconds_per_step=1e-9,
        reference_paces={"NVIDIA H200": 1e-9},  # the peers decide here
    )
    scaler = world.scaler(policy)
    await scaler.acquire()
    paces: dict[str, float] = {}
    sim = world.sim(lambda m: hold(paces.get(m, 1.0)))
    await world.submit(4, max_train_steps=100)
    await scaler.tick()
    world.advance(COLD_START_S)
    machines = sorted(i.machine_id for i in world.double.instances.values())
    slow = machines[0]
    # The peers say what they run at (as fast as observed, or faster); the slow one says 12 s a
    # step: a claim that convicts only itself.
    paces.update({machines[1]: 1e-5, machines[2]: 1.1e-5, machines[3]: 0.9e-5, slow: 12.0})
    await sim.sync()
    for w in sim.workers.values():
        async with asyncio.timeout(30):
            await w.settled.wait()
    slow_worker = sim.workers[slow]
    assert slow_worker.lease is not None
    slow_job = slow_worker.lease.job_id

    # Each worker's second checkpoint is recorded (its commit is not acknowledged on the stream).
    await world.watch.until(
        lambda: _eq(world.watch.value("SELECT count(*) FROM checkpoints"), 8),
        "two verified checkpoints a lease",
    )
    outcomes = await scaler.tick()
    (dropped,) = applied(outcomes, Action.DROP_LEASE)
    assert (dropped.decision.target, dropped.decision.job_id) == (slow, slow_job)
    assert dropped.decision.figures["seconds_per_step"] == 12.0
    (moved,) = applied(outcomes, Action.REALLOCATE)
    world.settle()
    assert world.double.instances[moved.decision.target].machine_id != slow

    # The job is queued again, not failed, and its machine banned for it.
    job = await world.ledger.get_job_any_owner(slow_job)
    assert job is not None and job.failures == 0
    assert job.latest_checkpoint is not None and job.latest_checkpoint.step == 21
    assert (
        await world.watch.value(
            "SELECT count(*) FROM bans WHERE job_id = $1::uuid AND machine_id = $2", slow_job, slow
        )
        == 1
    )
    # The peers finish theirs, then one of them (or the moved instance) takes it up.
    for w in sim.workers.values():
        w.release.set()
    world.advance(COLD_START_S)
    await sim.sync()
    for w in sim.workers.values():
        w.release.set()
    await world.watch.until(
        lambda: _eq(
            world.watch.value("SELECT state FROM jobs WHERE job_id = $1::uuid", slow_job),
            "SUCCEEDED",
        ),
        "the slow node's job succeeded elsewhere",
    )
    resumed = [g for w in sim.history for g in w.grants if g.job_id == slow_job]
    assert [g.resumed_from for g in resumed] == [None, 21]
    finisher = await world.watch.value(
        "SELECT machine_id FROM leases WHERE job_id = $1::uuid AND end_reason = 'succeeded'",
        slow_job,
    )
    assert finisher != slow
    ended = await world.ledger.job_leases(slow_job)
    assert [lease.end_reason for lease in ended] == ["dropped", "succeeded"]


async def test_the_one_node_banned_job_deadlock_resolves_by_itself(world: World) -> None:
    policy = PolicyConfig(max_replicas=1, cooldown_s=300)
    scaler = world.scaler(policy)
    await scaler.acquire()
    first: set[str] = set()
    sim = world.sim(lambda m: fail_node if m in first else finish)
    (job_id,) = await world.submit(1, max_failures=3)
    await scaler.tick()
    world.advance(COLD_START_S)
    first.update(i.machine_id for i in world.double.instances.values())
    await sim.sync()
    await world.watch.until(
        lambda: _eq(world.watch.value("SELECT count(*) FROM bans"), 1), "the job is banned"
    )
    # The only node is banned from the only job: without the scaler it would wait forever.
    assert await world.watch.count_jobs("QUEUED") == 1
    outcomes = await scaler.tick()
    (moved,) = applied(outcomes, Action.REALLOCATE)
    assert "banned from every live node" in moved.decision.reason
    world.settle()
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 1), "it ran")
    job = await world.ledger.get_job_any_owner(job_id)
    assert job is not None and (job.failures, job.node_faults) == (0, 1)


async def test_a_provider_outage_neither_crashes_nor_misleads_the_scaler(world: World) -> None:
    policy = PolicyConfig(max_replicas=4, idle_grace_s=0, cooldown_s=0)
    scaler = world.scaler(policy)
    await scaler.acquire()
    sim = world.sim(lambda _m: hold(1.0))
    await world.submit(2)
    await scaler.tick()
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("RUNNING"), 2), "2 running")
    before = list(world.double.actions)

    # A minute of outage: every call fails; meanwhile the work changes (2 more jobs queued).
    world.double.inject("500", count=1_000_000)
    await world.submit(2)
    for _ in range(4):
        world.advance(15)
        (held,) = await scaler.tick()
        assert held.decision.action is Action.HOLD and not held.applied and held.provider_failed
    assert world.double.actions == before  # nothing was done on a blind view
    log = await world.ledger.list_scaler_decisions(10)
    outage = log[0]
    assert (outage.action, outage.target, outage.repeats) == ("hold", "provider", 4)
    assert outage.error and "still failing" in outage.error

    # Back: the next tick sees the fleet as it is and grows it for the queued work.
    world.double.faults.clear()
    outcomes = await scaler.tick()
    (scale,) = applied(outcomes, Action.SCALE)
    assert scale.decision.replicas == 4
    assert not applied(outcomes, Action.REALLOCATE) and not applied(outcomes, Action.DROP_LEASE)

    # An outage in the middle of a tick: the failed action is recorded, the rest not tried,
    # and the next tick carries them out.
    world.advance(COLD_START_S)
    for w in sim.workers.values():
        w.release.set()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 2), "2 done")
    world.double.inject("500", count=1_000_000, match="PATCH")
    outcomes = await scaler.tick()
    failed = [o for o in outcomes if o.error]
    assert failed and all(not o.applied and o.provider_failed for o in failed)
    assert failed[0].error is not None and failed[0].error.startswith("provider unavailable")
    world.double.faults.clear()
    outcomes = await scaler.tick()
    assert not [o for o in outcomes if o.error]


async def test_of_two_scalers_only_one_acts_and_the_other_takes_over(world: World) -> None:
    policy = PolicyConfig(max_replicas=3, cooldown_s=0, idle_grace_s=3600)
    reports: asyncio.Queue[Outcome] = asyncio.Queue()
    first_acts: list[Outcome] = []
    first = world.scaler(policy, scaler_id="first", report=lambda o: first_acts.append(o))
    second = world.scaler(policy, scaler_id="second", report=reports.put_nowait)
    await first.acquire()
    standby = asyncio.create_task(second.run())
    await world.submit(1)
    (scale,) = applied(await first.tick(), Action.SCALE)
    assert scale.decision.replicas == 1
    # The second one waits for the lock: it may not act, and has not.
    assert not second.active
    with pytest.raises(NotActive):
        await second.tick()
    assert reports.empty() and not standby.done()

    # The first one's session dies (its host crashed, its connection was cut).
    admin = await asyncpg.connect(world.database_url)
    try:
        pid = await admin.fetchval(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND ((classid::bigint << 32) | objid::bigint) = $1"
            # pg_locks shows every database's locks: the scaler tests of another run (or of
            # another xdist worker) hold the same key in theirs, and ending one of theirs left
            # this test's first scaler active until the test timed out.
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            SCALER_LOCK,
        )
        assert pid is not None
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()
    async with asyncio.timeout(30):
        await second.wait_active()
    acted_before = len(first_acts)
    with pytest.raises(NotActive):
        await first.tick()
    assert len(first_acts) == acted_before  # the deposed one did nothing

    # The second acts on new work by itself (woken by the ledger's notification).
    await world.submit(2)
    async with asyncio.timeout(30):
        while True:
            outcome = await reports.get()
            if outcome.decision.action is Action.SCALE and outcome.decision.replicas == 3:
                break
    assert outcome.applied and world.double.replicas == 3
    rows = await world.ledger.list_scaler_decisions(10)
    assert {r.scaler_id for r in rows if r.action == "scale"} == {"first", "second"}
    standby.cancel()
