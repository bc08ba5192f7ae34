"""What a hostile worker reports moves no one else's lease or instance: the real scheduler and
the real scaler (tests/scaler/test_scenarios.py's world: SaladCloud double, scripted honest
workers that prove their machine ids), with scripted hostile streams beside them.

* Streams under made-up machine ids, announcing the honest node's GPU and claiming a pace a
  thousand times its own (with checkpoints whose bytes the store verified, even with ids the
  supervisor vouched for), are nobody's peers: they are not live instances of the fleet.
* A stream that says Hello under a provider instance's machine id before its worker connects
  and fails its qualification is not that instance: the scaler leaves the instance alone.
* And the other way round: a slow node claiming speed is still judged on what the scheduler
  observed of it.
* Streams under made-up machine ids that take every queued job are on no instance of the fleet:
  their leases are neither demand nor a reason to hold scale-in.
* Verified, live machines of one holder that commit tiny checkpoints faster than any GPU trains
  are below the plausibility floor: nobody's peers.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.scaler.policy import Action, PolicyConfig
from tests.scaler.fleet_sim import FleetSim, Lease, SimWorker, finish, hold
from tests.scaler.test_scenarios import COLD_START_S, World, applied
from tests.support.fleet import WORKER_TOKEN
from tests.support.workers import connect_worker, local_identity

pytestmark = pytest.mark.timeout(120)


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


@pytest.mark.parametrize("vouched", [False, True], ids=["unverified", "verified-ids"])
async def test_streams_claiming_speed_get_no_honest_node_dropped(
    world: World, vouched: bool
) -> None:
    # The defaults but a warm-up the scripted run passes: four peers would be enough to judge.
    policy = PolicyConfig(max_replicas=1, slow_warmup_steps=10, cooldown_s=300)
    scaler = world.scaler(policy)
    await scaler.acquire()
    sim = world.sim(lambda _m: hold(1.0))  # honest: says 1 s a step, and holds its job
    await world.submit(1, max_train_steps=1000)
    await scaler.tick()
    world.advance(COLD_START_S)
    await sim.sync()
    (victim,) = sim.workers.values()
    async with asyncio.timeout(30):
        await victim.settled.wait()
    assert victim.lease is not None
    victim_job = victim.lease.job_id
    (instance,) = world.double.instances.values()

    # Four streams under fresh machine ids, the victim's GPU model, each on a job of the same
    # shape: Ready, two heartbeats (step 0 -> 500 at 1 ms a step), two verified checkpoints
    # 499 steps apart in milliseconds, then Draining.
    await world.submit(4, max_train_steps=1000)
    for k in range(4):
        machine = f"hostile-{k}"
        identity = local_identity(world.scheduler.identity_secret, machine) if vouched else None
        async with connect_worker(
            world.channel, WORKER_TOKEN, machine, identity=identity, gpu_model="NVIDIA H200"
        ) as w:
            granted = await w.ready_for_lease()
            await w.heartbeat(granted.lease, 0, seconds_per_step=0.001)
            await w.heartbeat(granted.lease, 500, seconds_per_step=0.001)
            await w.store_checkpoint(granted.lease, 1)
            await w.store_checkpoint(granted.lease, 500)
            await w.send(draining=fpb.Draining(lease=w.ref(granted.lease), reason="done"))
    await world.watch.until(
        lambda: _eq(
            world.watch.value("SELECT count(*) FROM leases WHERE end_reason = 'drained'"), 4
        ),
        "the four hostile leases ended",
    )

    outcomes = await scaler.tick()
    assert not applied(outcomes, Action.DROP_LEASE), [o.decision.reason for o in outcomes]
    assert not applied(outcomes, Action.REALLOCATE)
    # The honest worker's lease, ban list and instance are untouched.
    assert await world.watch.value(
        "SELECT machine_id FROM jobs WHERE job_id = $1::uuid AND state = 'RUNNING'", victim_job
    ) == (victim.machine_id)
    assert (
        await world.watch.value(
            "SELECT count(*) FROM bans WHERE machine_id = $1", victim.machine_id
        )
        == 0
    )
    assert not [a for a in world.double.actions if a[0] == "reallocate"]
    assert world.double.instances[instance.id].machine_id == victim.machine_id


async def test_a_squatter_failing_qualification_moves_no_instance(world: World) -> None:
    policy = PolicyConfig(max_replicas=1)
    scaler = world.scaler(policy)
    await scaler.acquire()
    sim = world.sim(lambda _m: finish)
    await world.submit(1)
    await scaler.tick()
    world.advance(COLD_START_S)
    (instance,) = world.double.instances.values()

    # Before the instance's worker connects, a stream says Hello under its machine id (no
    # provider's proof) and reports a failed qualification probe.
    async with connect_worker(
        world.channel, WORKER_TOKEN, instance.machine_id, qualified=False, session_token=""
    ):
        outcomes = await scaler.tick()
    assert not applied(outcomes, Action.REALLOCATE)
    (held,) = [o for o in outcomes if o.decision.action is Action.HOLD]
    assert held.decision.target == instance.id and "no provider vouched" in held.decision.reason
    assert not [a for a in world.double.actions if a[0] == "reallocate"]

    # The instance's own worker, with its provider's proof, then runs the job there.
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 1), "the job ran")
    assert await world.watch.value(
        "SELECT machine_id FROM leases WHERE end_reason = 'succeeded'"
    ) == (instance.machine_id)


async def test_a_slow_node_lying_fast_is_dropped_on_what_the_scheduler_observed(
    world: World,
) -> None:
    """The other side: a node cannot hide its slowness by claiming speed. Its two verified
    checkpoints are 10 steps apart and span the peers' whole runs of 10,000 steps, so on the
    ledger's clock it is at least a thousand times slower per step, whatever it says."""
    # Scripted peers' paces differ by timing noise alone: "slow" is a hundred times the median.
    # They run ten thousand steps in milliseconds: no plausibility floor here (see below).
    policy = PolicyConfig(
        max_replicas=4,
        slow_warmup_steps=10,
        slow_min_excess=100.0,
        cooldown_s=300,
        min_plausible_seconds_per_step=1e-9,
        reference_paces={"NVIDIA H200": 1e-9},  # the peers decide here
    )
    scaler = world.scaler(policy)
    await scaler.acquire()
    go, peers_done = asyncio.Event(), asyncio.Event()

    async def sprint(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        assert w.worker is not None
        await go.wait()
        await w.worker.heartbeat(lease.granted.lease, 1, seconds_per_step=1e-6)
        await w.store_checkpoint(lease, 1)
        await w.store_checkpoint(lease, 10_001)
        w.settled.set()
        await w.release.wait()

    async def crawl(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        assert w.worker is not None
        await w.worker.heartbeat(lease.granted.lease, 1, seconds_per_step=1e-6)
        await w.store_checkpoint(lease, 1)
        await peers_done.wait()
        await w.worker.heartbeat(lease.granted.lease, 11, seconds_per_step=1e-6)
        await w.store_checkpoint(lease, 11)
        w.settled.set()
        await w.release.wait()

    slow: list[str] = []
    sim = world.sim(lambda m: crawl if m in slow else sprint)
    await world.submit(4, max_train_steps=20_000)
    await scaler.tick()
    world.advance(COLD_START_S)
    slow.append(sorted(i.machine_id for i in world.double.instances.values())[0])
    await sim.sync()
    checkpoints = "SELECT count(*) FROM checkpoints"
    await world.watch.until(lambda: _eq(world.watch.value(checkpoints), 1), "its first one")
    go.set()
    await world.watch.until(lambda: _eq(world.watch.value(checkpoints), 7), "the peers' runs")
    peers_done.set()
    await world.watch.until(lambda: _eq(world.watch.value(checkpoints), 8), "its second one")
    slow_worker = sim.workers[slow[0]]
    assert slow_worker.lease is not None
    slow_job = slow_worker.lease.job_id

    outcomes = await scaler.tick()
    (dropped,) = applied(outcomes, Action.DROP_LEASE)
    assert (dropped.decision.target, dropped.decision.job_id) == (slow[0], slow_job)
    figures = dropped.decision.figures
    assert figures["pace_source"] == "verified checkpoints" and figures["observed_steps"] == 10
    assert figures["reported_s_per_step"] == pytest.approx(1e-6)
    assert figures["peer_machines"] == 3
    (moved,) = applied(outcomes, Action.REALLOCATE)
    assert moved.decision.figures["peer_observations"] == figures["peer_observations"]
    # The row in the ledger carries the peer observations that justified it.
    (row,) = [r for r in await world.ledger.list_scaler_decisions(20) if r.action == "drop_lease"]
    assert row.applied and len(str(row.figures["peer_observations"]).split()) == 3
    for w in sim.workers.values():
        w.release.set()


async def test_rogue_streams_holding_every_job_do_not_pin_the_fleet_at_max(world: World) -> None:
    policy = PolicyConfig(max_replicas=4, idle_grace_s=0, cooldown_s=60)
    scaler = world.scaler(policy)
    await scaler.acquire()
    sim = world.sim(lambda _m: hold(1.0))
    (honest_job,) = await world.submit(1)
    await scaler.tick()
    world.advance(COLD_START_S)
    await sim.sync()
    (honest,) = sim.workers.values()
    async with asyncio.timeout(30):
        await honest.settled.wait()
    assert world.double.replicas == 1

    # Four streams under made-up machine ids (no provider's proof) take every job queued next,
    # and heartbeat at step 0.
    await world.submit(4)
    async with contextlib.AsyncExitStack() as stack:
        for k in range(4):
            rogue = await stack.enter_async_context(
                connect_worker(world.channel, WORKER_TOKEN, f"rogue-{k}")
            )
            granted = await rogue.ready_for_lease()
            await rogue.heartbeat(granted.lease, 0)
        assert await world.states() == {"RUNNING": 5}

        # Demand: the one honest lease, not five (before, the group went to max).
        world.advance(120)
        outcomes = await scaler.tick()
        assert not applied(outcomes, Action.SCALE), [o.decision.reason for o in outcomes]
        assert world.double.replicas == 1

        # Scale-in: once the honest job is done the group shrinks to zero, rogue leases or not
        # (before, they held it: "running jobs on no instance the provider lists").
        honest.release.set()
        await world.watch.until(
            lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 1), "the honest job finished"
        )
        world.advance(120)
        outcomes = await scaler.tick()
        (scaled,) = applied(outcomes, Action.SCALE)
        assert scaled.decision.replicas == 0, scaled.decision.reason
        assert scaled.decision.figures["unplaced_leases"] == 4
    # The honest node ran its job to the end: no ban, no drop, no move.
    assert await world.watch.value(
        "SELECT machine_id FROM leases WHERE end_reason = 'succeeded' AND job_id = $1::uuid",
        honest_job,
    ) == (honest.machine_id)
    assert (
        await world.watch.value(
            "SELECT count(*) FROM bans WHERE machine_id = $1", honest.machine_id
        )
        == 0
    )
    assert not [a for a in world.double.actions if a[0] == "reallocate"]


async def test_verified_machines_committing_implausibly_fast_are_nobodys_peers(
    world: World,
) -> None:
    """Three provider-verified instances of the fleet (one holder's) commit checkpoints ten
    thousand steps apart in milliseconds; the honest node trains at 0.1 s a step, a plausible
    pace. Their observations are below the floor (0.05 s per 1024x1024 image step), so the
    honest node has no peers to be judged against, and keeps its lease and instance."""
    policy = PolicyConfig(max_replicas=4, slow_warmup_steps=10, cooldown_s=300)
    scaler = world.scaler(policy)
    await scaler.acquire()
    go, peers_done = asyncio.Event(), asyncio.Event()

    async def sprint(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        await go.wait()
        await w.store_checkpoint(lease, 1)
        await w.store_checkpoint(lease, 10_001)
        w.settled.set()
        await w.release.wait()

    async def train(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        await w.store_checkpoint(lease, 1)
        await peers_done.wait()
        await asyncio.sleep(1.0)  # ten steps of training at 0.1 s a step
        await w.store_checkpoint(lease, 11)
        w.settled.set()
        await w.release.wait()

    honest: list[str] = []
    sim = world.sim(lambda m: train if m in honest else sprint)
    await world.submit(4, max_train_steps=20_000)
    await scaler.tick()
    world.advance(COLD_START_S)
    honest.append(sorted(i.machine_id for i in world.double.instances.values())[0])
    await sim.sync()
    checkpoints = "SELECT count(*) FROM checkpoints"
    await world.watch.until(lambda: _eq(world.watch.value(checkpoints), 1), "its first one")
    go.set()
    await world.watch.until(lambda: _eq(world.watch.value(checkpoints), 7), "the fast ones")
    peers_done.set()
    await world.watch.until(lambda: _eq(world.watch.value(checkpoints), 8), "its second one")
    worker = sim.workers[honest[0]]
    assert worker.lease is not None

    outcomes = await scaler.tick()
    assert not applied(outcomes, Action.DROP_LEASE), [o.decision.reason for o in outcomes]
    assert not applied(outcomes, Action.REALLOCATE)
    assert await world.watch.value(
        "SELECT machine_id FROM jobs WHERE job_id = $1::uuid AND state = 'RUNNING'",
        worker.lease.job_id,
    ) == (worker.machine_id)
    assert not [a for a in world.double.actions if a[0] == "reallocate"]
    for w in sim.workers.values():
        w.release.set()
