"""Scenarios against a SaladCloud that takes its time: instances stop for `STOP_S` before they
leave or move (tests/scaler/salad_double.py), the platform reallocates on its own, and the
scaler must still never remove a busy node."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from lorafleet.scaler.policy import Action, PolicyConfig
from tests.scaler.fleet_sim import FleetSim, Lease, Script, SimWorker, fail_node, finish, pace
from tests.scaler.salad_double import PREFIX
from tests.scaler.test_scenarios import COLD_START_S, World, _eq, applied

pytestmark = pytest.mark.timeout(120)

STOP_S = 45.0


def held_per_job() -> tuple[defaultdict[str, asyncio.Event], Script]:
    """A script that runs a job past its warm-up, then holds it until its job's event is set
    (per job, not per worker: a worker may take up another job meanwhile)."""
    releases: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def script(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        assert w.worker is not None
        step = await pace(w, lease, s_per_step=1.0)
        w.settled.set()
        await releases[lease.job_id].wait()
        if w.lease is lease:
            await w.worker.store_result(lease.granted, step + 1)

    return releases, script


@pytest.mark.parametrize("world", [STOP_S], indirect=True)
async def test_scale_in_beside_a_stopping_instance_keeps_the_busy_node(world: World) -> None:
    policy = PolicyConfig(max_replicas=2, idle_grace_s=0, cooldown_s=0)
    scaler = world.scaler(policy)
    await scaler.acquire()
    releases, script = held_per_job()
    sim = world.sim(lambda _m: script)
    j1, j2 = await world.submit(2)
    await scaler.tick()
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("RUNNING"), 2), "both running")
    await scaler.tick()  # both leased: both get the busy deletion cost
    by_job = {w.lease.job_id: w for w in sim.workers.values() if w.lease is not None}
    machine_of = {i.machine_id: i.id for i in world.double.instances.values()}
    a = machine_of[by_job[j1].machine_id]
    x = machine_of[by_job[j2].machine_id]
    assert {i.deletion_cost for i in world.double.instances.values()} == {100_000}

    # SaladCloud reallocates J2's instance; it stays `stopping`. Its worker drains, J2 is
    # queued again, and when J1 finishes, J1's node takes J2.
    world.double.platform_reallocate(x)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("QUEUED"), 1), "J2 drained")
    releases[j1].set()
    a_machine = world.double.instances[a].machine_id
    await world.watch.until(
        lambda: _eq(
            world.watch.value("SELECT machine_id FROM jobs WHERE job_id = $1::uuid", j2),
            a_machine,
        ),
        "J1 done, J2 on A",
    )
    assert world.double.states() == {a: "running", x: "stopping"}

    # 0 queued + 1 running: 2 -> 1, naming the stopping instance; never the busy one.
    outcomes = await scaler.tick()
    (scale,) = applied(outcomes, Action.SCALE)
    assert (scale.decision.replicas, scale.decision.remove) == (1, (x,))
    assert world.double.instances[x].deletion_cost == 0  # not set back after the PATCH
    world.double.advance(STOP_S)
    await sim.sync()
    assert list(world.double.instances) == [a]
    assert ("removed", a) not in world.double.actions
    assert ("stopping", a) not in world.double.actions
    worker = sim.workers[world.double.instances[a].machine_id]
    assert worker.lease is not None and worker.lease.job_id == j2
    releases[j2].set()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 2), "J2 done")


@pytest.mark.parametrize("world", [5.0], indirect=True)
async def test_two_bad_nodes_cost_at_most_the_threshold_each(world: World) -> None:
    """Both nodes fail everything; the rate limit lets the scaler move only one of them. The
    scheduler's quarantine (3 node faults an hour, its default) stops each after 3 failed
    attempts, before any scaler tick: 6 in all, no job failed, and a fresh node runs them all."""
    policy = PolicyConfig(max_replicas=2, fault_threshold=3, cooldown_s=300, idle_grace_s=600)
    scaler = world.scaler(policy)
    await scaler.acquire()
    bad: set[str] = set()
    sim = world.sim(lambda m: fail_node if m in bad else finish)
    jobs = await world.submit(9, max_failures=3)
    await scaler.tick()
    world.advance(COLD_START_S)
    bad.update(i.machine_id for i in world.double.instances.values())
    assert len(bad) == 2
    await sim.sync()
    faults = "SELECT count(*) FROM leases WHERE end_reason = 'failed: node'"
    await world.watch.until(lambda: _eq(world.watch.value(faults), 6), "six node faults")

    outcomes = await scaler.tick()
    (moved,) = applied(outcomes, Action.REALLOCATE)
    assert "3 node faults" in moved.decision.reason
    held = [
        o
        for o in outcomes
        if o.decision.action is Action.HOLD and "rate limit" in o.decision.reason
    ]
    assert len(held) == 1  # the other bad node waits for the reallocation budget
    world.double.advance(5.0)  # the moved instance stops, then starts on a fresh machine
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 9), "all done")
    assert await world.watch.value(faults) == 6
    for job_id in jobs:
        job = await world.ledger.get_job_any_owner(job_id)
        assert job is not None and job.failures < job.spec.max_failures


@pytest.mark.parametrize("world", [STOP_S], indirect=True)
async def test_no_scale_in_when_a_busy_nodes_cost_could_not_be_raised(world: World) -> None:
    """New instances start at deletion cost 0, as do the victims a scale-in names: if raising
    a busy one's cost is refused, lowering the count could hit it, so it is not tried."""
    policy = PolicyConfig(max_replicas=2, idle_grace_s=0, cooldown_s=0)
    scaler = world.scaler(policy)
    await scaler.acquire()
    releases, script = held_per_job()
    sim = world.sim(lambda _m: script)
    j1, j2 = await world.submit(2)
    await scaler.tick()
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("RUNNING"), 2), "both running")
    releases[j1].set()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 1), "J1 done")
    machine = await world.watch.value("SELECT machine_id FROM jobs WHERE job_id = $1::uuid", j2)
    (busy,) = [i.id for i in world.double.instances.values() if i.machine_id == machine]
    assert {i.deletion_cost for i in world.double.instances.values()} == {0}
    d = world.double
    group = PREFIX.format(org=d.org, project=d.project, group=d.group)
    d.inject("400", count=1_000, match=f"PATCH {group}/instances/{busy}")

    outcomes = await scaler.tick()
    assert not applied(outcomes, Action.SCALE) and world.double.replicas == 2
    (scale,) = [o for o in outcomes if o.decision.action is Action.SCALE]
    assert scale.error is not None and "could not be raised" in scale.error
    assert ("stopping", busy) not in world.double.actions

    world.double.faults.clear()
    (scale,) = applied(await scaler.tick(), Action.SCALE)
    assert scale.decision.replicas == 1 and busy not in scale.decision.remove
    world.settle()
    assert list(world.double.instances) == [busy]
    releases[j2].set()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 2), "J2 done")
