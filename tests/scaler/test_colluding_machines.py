"""Several provider-verified machines of one holder (a SaladCloud community host runs its own
PCs) against the real scheduler and scaler (tests/scaler/test_scenarios.py's world): what they
do decides their own fate, never another machine's, another job's or another tenant's.

* Machines that fail every attempt they are handed (broken, or hostile) are quarantined and
  moved, and spend no job's failure budget: node faults are not the job's fault.
* Machines that commit tiny valid checkpoints fast (above the plausibility floor) set their
  live peers' median, but a node is judged slow only past its GPU class's reference pace too
  (pinned, or learned slowly from long-lived machines): the honest node keeps its lease.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as jpb
from lorafleet.scaler.policy import Action, PolicyConfig
from tests.scaler.fleet_sim import FleetSim, Lease, SimWorker, fail_node, finish
from tests.scaler.test_scenarios import COLD_START_S, World, applied

pytestmark = pytest.mark.timeout(120)


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def fail_internal(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
    assert w.worker is not None
    await w.worker.send(
        job_failed=fpb.JobFailed(
            lease=lease.ref, failure_class=jpb.FAILURE_CLASS_INTERNAL, message="it broke"
        )
    )


@pytest.mark.parametrize("script", [fail_node, fail_internal], ids=["node", "internal"])
async def test_three_machines_failing_every_attempt_fail_no_job(world: World, script: Any) -> None:
    """Three verified machines arrive together and fail every attempt (the default max_failures,
    3). Each fails each job once (then it is banned from it): 9 failed attempts on 3 jobs. The
    machines are quarantined and reallocated; the jobs wait, and all three succeed on the
    honest machines that come back. Before, node faults counted toward max_failures and the
    three jobs ended FAILED though they did nothing wrong."""
    policy = PolicyConfig(max_replicas=3, fault_threshold=3, cooldown_s=300, reallocate_share=1.0)
    scaler = world.scaler(policy)
    await scaler.acquire()
    bad: set[str] = set()
    go = asyncio.Event()

    async def once_a_stranger(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        await go.wait()
        await script(sim, w, lease)

    sim = world.sim(lambda m: once_a_stranger if m in bad else finish)
    jobs = await world.submit(3)
    await scaler.tick()
    world.advance(COLD_START_S)
    bad.update(i.machine_id for i in world.double.instances.values())
    assert len(bad) == 3
    await sim.sync()
    # The scripted workers prove their ids with the local supervisor's token: an operator-run
    # machine, whose internal errors are believed. These are a stranger's SaladCloud machines.
    await world.watch.conn.execute(
        "UPDATE machines SET identity_provider = 'salad' WHERE machine_id = ANY($1::text[])",
        sorted(bad),
    )
    go.set()
    reason = "failed: node" if script is fail_node else "failed: internal"
    await world.watch.until(
        lambda: _eq(
            world.watch.value("SELECT count(*) FROM leases WHERE end_reason = $1", reason), 9
        ),
        "nine failed attempts",
    )
    assert await world.states() == {"QUEUED": 3}
    for job_id in jobs:
        job = await world.ledger.get_job_any_owner(job_id)
        assert job is not None
        assert (job.failures, job.node_faults, job.max_node_faults) == (0, 3, 10)
    if script is fail_node:
        # Node faults quarantine the machines: the scaler moves all three.
        outcomes = await scaler.tick()
        assert len(applied(outcomes, Action.REALLOCATE)) == 3
        world.settle()
    else:
        # Internal errors are no node faults: the machines are banned from every queued job,
        # and the scaler moves them as it does for a stranded job.
        for _ in range(3):
            await scaler.tick()
            world.settle()
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 3), "all done")
    assert await world.states() == {"SUCCEEDED": 3}
    succeeded_on = await world.watch.value(
        "SELECT array_agg(machine_id) FROM leases WHERE end_reason = 'succeeded'"
    )
    assert not bad & set(succeeded_on)


@pytest.mark.parametrize(
    "failure_class",
    [jpb.FAILURE_CLASS_INTERNAL, jpb.FAILURE_CLASS_INPUT],
    ids=["internal", "input"],
)
async def test_fresh_machines_with_results_of_their_own_fail_no_job(
    world: World, failure_class: jpb.FailureClass.ValueType
) -> None:
    """Three SaladCloud-verified machines of one holder arrive together, and each first
    delivers one result fast (a tiny valid LoRA file: the store checks its form, not its
    values). Before, that one result put each in good standing: then their internal errors on
    the jobs they were handed next spent those jobs' max_failures (3) and the jobs ended
    FAILED, and two of them calling a job's input bad confirmed each other and failed it at
    once. Now a machine's word counts against a job only if its standing predates the job by
    standing_min_age_s (6 h): their failures are node faults, and every job succeeds on the
    honest machines that replace them."""
    policy = PolicyConfig(max_replicas=3, fault_threshold=3, cooldown_s=300, reallocate_share=1.0)
    scaler = world.scaler(policy)
    await scaler.acquire()
    bad: set[str] = set()
    delivered: set[str] = set()
    go = asyncio.Event()

    async def collude(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        await go.wait()
        if w.machine_id not in delivered:
            delivered.add(w.machine_id)
            await finish(sim, w, lease)
            return
        assert w.worker is not None
        await w.worker.send(
            job_failed=fpb.JobFailed(lease=lease.ref, failure_class=failure_class, message="no")
        )

    sim = world.sim(lambda m: collude if m in bad else finish)
    baits = await world.submit(3)
    victims = await world.submit(3)
    await scaler.tick()
    world.advance(COLD_START_S)
    bad.update(i.machine_id for i in world.double.instances.values())
    assert len(bad) == 3
    await sim.sync()
    # The scripted workers prove their ids with the local supervisor's token (an operator-run
    # machine, whose input fault is believed at once); these are a stranger's SaladCloud
    # machines, verified (their token's own tests: tests/scheduler/test_identity.py).
    await world.watch.conn.execute(
        "UPDATE machines SET identity_provider = 'salad' WHERE machine_id = ANY($1::text[])",
        sorted(bad),
    )
    go.set()
    # Each victim has failed on all three machines (each is banned from a job it failed), or
    # has ended FAILED before that (as it did before this fix).
    settled = (
        "SELECT count(*) FROM jobs j WHERE j.job_id = ANY($1::uuid[]) AND (j.state = 'FAILED'"
        " OR (SELECT count(*) FROM leases l WHERE l.job_id = j.job_id"
        "     AND l.end_reason LIKE 'failed: %') = 3)"
    )
    await world.watch.until(
        lambda: _eq(world.watch.value(settled, victims), 3), "every victim tried on all three"
    )
    assert await world.states() == {"SUCCEEDED": 3, "QUEUED": 3}
    for job_id in victims:
        job = await world.ledger.get_job_any_owner(job_id)
        assert job is not None
        assert (job.failures, job.node_faults) == (0, 3)
    # Banned from every queued job, the machines are moved as for a stranded job.
    for _ in range(3):
        await scaler.tick()
        world.settle()
    world.advance(COLD_START_S)
    await sim.sync()
    await world.watch.until(lambda: _eq(world.watch.count_jobs("SUCCEEDED"), 6), "all done")
    succeeded_on = await world.watch.value(
        "SELECT array_agg(machine_id) FROM leases WHERE end_reason = 'succeeded'"
        " AND job_id = ANY($1::uuid[])",
        victims,
    )
    assert len(succeeded_on) == 3 and not bad & set(succeeded_on)
    succeeded = await world.watch.value(
        "SELECT array_agg(job_id::text) FROM jobs WHERE state = 'SUCCEEDED'"
    )
    assert set(succeeded) == set(baits) | set(victims)


async def _set_paces(world: World, paces: dict[str, float]) -> None:
    """Each machine's checkpoints under its leases committed `pace` seconds per step apart on
    the ledger's clock (a test does not wait out real training)."""
    for machine, pace in paces.items():
        await world.watch.value(
            "WITH lease_steps AS ("
            "  SELECT c.job_id, c.epoch, min(c.step) AS first FROM checkpoints c"
            "  JOIN leases l ON l.job_id = c.job_id AND l.epoch = c.epoch"
            "  WHERE l.machine_id = $1 GROUP BY c.job_id, c.epoch)"
            " UPDATE checkpoints c"
            " SET committed_at = now() - interval '1 hour'"
            "     + make_interval(secs => (c.step - s.first) * $2::float8)"
            " FROM lease_steps s WHERE c.job_id = s.job_id AND c.epoch = s.epoch"
            " RETURNING 1",
            machine,
            pace,
        )


@pytest.mark.parametrize("pinned", [False, True], ids=["no-reference-yet", "pinned-reference"])
async def test_colluding_fast_peers_get_no_honest_node_dropped(world: World, pinned: bool) -> None:
    """Three verified machines of one holder commit valid checkpoints 500 steps apart at 0.067
    s/step (just above the floor, 0.05); the honest node's own verified checkpoints are 20
    steps apart at 1 s/step, 15 times their median. Before, it was dropped from its lease,
    banned from its job and its instance reallocated on the next tick. Now live peers alone
    convict nobody: with no reference for the class yet, no verdict; with the operator's pinned
    reference (1 s per 1024x1024 image step) the honest node is within it."""
    policy = PolicyConfig(
        max_replicas=4,
        slow_warmup_steps=10,
        cooldown_s=300,
        reference_paces={"NVIDIA H200": 1.0} if pinned else {},
    )
    scaler = world.scaler(policy)
    await scaler.acquire()
    go, peers_done = asyncio.Event(), asyncio.Event()

    async def collude(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        await go.wait()
        await w.store_checkpoint(lease, 10)
        await w.store_checkpoint(lease, 510)
        w.settled.set()
        await w.release.wait()

    async def train(sim: FleetSim, w: SimWorker, lease: Lease) -> None:
        await w.store_checkpoint(lease, 10)
        await peers_done.wait()
        await w.store_checkpoint(lease, 30)
        w.settled.set()
        await w.release.wait()

    honest: list[str] = []
    sim = world.sim(lambda m: train if m in honest else collude)
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
    colluders = sorted(set(sim.workers) - set(honest))
    await _set_paces(world, {**{m: 0.067 for m in colluders}, honest[0]: 1.0})
    worker = sim.workers[honest[0]]
    assert worker.lease is not None

    outcomes = await scaler.tick()
    assert not applied(outcomes, Action.DROP_LEASE), [o.decision.reason for o in outcomes]
    assert not applied(outcomes, Action.REALLOCATE)
    assert await world.watch.value(
        "SELECT machine_id FROM jobs WHERE job_id = $1::uuid AND state = 'RUNNING'",
        worker.lease.job_id,
    ) == (worker.machine_id)
    assert await world.watch.value("SELECT count(*) FROM bans") == 0
    assert not [a for a in world.double.actions if a[0] == "reallocate"]
    for w in sim.workers.values():
        w.release.set()
