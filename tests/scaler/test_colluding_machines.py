"""Several provider-verified machines of one holder (a SaladCloud community host runs its own
PCs) against the real scheduler and scaler (tests/scaler/test_scenarios.py's world): what they
do decides their own fate, never another machine's, another job's or another tenant's.

* Machines that fail every attempt they are handed (broken, or hostile) are quarantined and
  moved, and spend no job's failure budget: node faults are not the job's fault.
"""

from __future__ import annotations

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
    sim = world.sim(lambda m: script if m in bad else finish)
    jobs = await world.submit(3)
    await scaler.tick()
    world.advance(COLD_START_S)
    bad.update(i.machine_id for i in world.double.instances.values())
    assert len(bad) == 3
    await sim.sync()
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
