"""Believed failures and the empty-lease quarantine, against a real Postgres.

A lease that ended in an input fault the fleet accepted as the job's (the job failed as INPUT:
an operator-run machine's word, or two machines in good standing) is the user's fault and no
empty lease toward its machine's quarantine: ten bad specs on `lorafleet up` quarantined its
only worker for an hour. Likewise an INTERNAL error the fleet counted against the job (an
operator-run machine's, or one in good standing's): ten lorafleet bugs must not quarantine it.
A fault the fleet did not believe still counts: a hostile machine must not get around the
quarantine by calling every input bad, or every job a bug.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from lorafleet.core.model import FailureClass, Job, JobState
from lorafleet.ledger.ledger import Ledger, Quarantine
from tests.scheduler.test_ledger import SECRET, TTL_S, in_good_standing, new_job

pytestmark = pytest.mark.timeout(60)


async def _operator_run(ledger: Ledger, machine_id: str) -> None:
    """The machine's id was vouched for by `lorafleet up`'s local supervisor."""
    async with ledger._conn() as conn:
        await conn.execute(
            "INSERT INTO machines (machine_id, identity_provider) VALUES ($1, 'local')",
            machine_id,
        )


async def _fail_input(
    ledger: Ledger, machine_id: str, failure: FailureClass = FailureClass.INPUT
) -> Job | None:
    """Claims a job on the machine and reports a failure of the class on it (an input fault
    unless said); the job after, or None when the machine is granted nothing."""
    granted = await ledger.claim_job(machine_id, 10**7, TTL_S, secret_sha256=SECRET)
    if granted is None:
        return None
    assert granted.lease_id is not None
    after = await ledger.fail_attempt(
        granted.lease_id, granted.epoch, failure, f"{failure.name.lower()}: it failed"
    )
    assert after is not None
    return after


@pytest.fixture
async def strict(database_url: str) -> AsyncIterator[Ledger]:
    """A ledger whose machines are quarantined after two empty leases in an hour."""
    ledger = await Ledger.connect(database_url, quarantine=Quarantine(empty_lease_limit=2))
    yield ledger
    await ledger.close()


async def test_input_faults_an_operator_run_machine_reported_do_not_quarantine_it(
    ledger: Ledger,
) -> None:
    """`lorafleet up`'s one worker fails ten jobs on their own inputs within the hour (the
    default limit is ten empty leases): each job fails as INPUT at once, and the worker is
    still granted the next job."""
    assert ledger.quarantine.empty_lease_limit == 10
    await _operator_run(ledger, "vm-local-0")
    await ledger.insert_jobs("alice", [new_job() for _ in range(11)])
    for _ in range(10):
        after = await _fail_input(ledger, "vm-local-0")
        assert after is not None and after.state is JobState.FAILED
        assert after.failure_class is FailureClass.INPUT
    assert await ledger.claim_job("vm-local-0", 10**7, TTL_S, secret_sha256=SECRET) is not None


async def test_internal_errors_an_operator_run_machine_reported_do_not_quarantine_it(
    ledger: Ledger,
) -> None:
    """`lorafleet up`'s one worker hits ten lorafleet bugs within the hour: each counts against
    its job (a failure of the job's budget, no node fault), and the worker is still granted
    the next job."""
    await _operator_run(ledger, "vm-local-0")
    await ledger.insert_jobs("alice", [new_job() for _ in range(11)])
    for _ in range(10):
        after = await _fail_input(ledger, "vm-local-0", FailureClass.INTERNAL)
        assert after is not None and after.state is JobState.QUEUED
        assert (after.failures, after.node_faults) == (1, 0)
    assert await ledger.claim_job("vm-local-0", 10**7, TTL_S, secret_sha256=SECRET) is not None


async def test_internal_errors_the_fleet_did_not_believe_still_quarantine(strict: Ledger) -> None:
    """A fresh machine's INTERNAL errors are node faults on the jobs: its leases ended empty,
    and past the limit it is granted nothing more."""
    await strict.insert_jobs("alice", [new_job() for _ in range(6)])
    for _ in range(2):
        after = await _fail_input(strict, "fresh", FailureClass.INTERNAL)
        assert after is not None and (after.failures, after.node_faults) == (0, 1)
    assert await _fail_input(strict, "fresh", FailureClass.INTERNAL) is None


async def test_internal_errors_are_believed_only_while_a_machine_keeps_its_standing(
    strict: Ledger, database_url: str
) -> None:
    """A machine in good standing's INTERNAL error counts in its job's failures and leaves no
    empty lease; once half of its last attempts failed it has lost its standing, its next
    claims are node faults and empty leases, and it is quarantined at the limit: saying
    INTERNAL about every job buys a machine a few leases at most."""
    await strict.insert_jobs("alice", [new_job() for _ in range(5)])
    await in_good_standing(database_url, "steady")  # one success
    for _ in range(2):  # one success and at most one failure before each: believed
        after = await _fail_input(strict, "steady", FailureClass.INTERNAL)
        assert after is not None and (after.failures, after.node_faults) == (1, 0)
    for _ in range(2):
        after = await _fail_input(strict, "steady", FailureClass.INTERNAL)
        assert after is not None and (after.failures, after.node_faults) == (0, 1)
    assert await strict.claim_job("steady", 10**7, TTL_S, secret_sha256=SECRET) is None


async def test_input_faults_the_fleet_did_not_accept_still_quarantine(strict: Ledger) -> None:
    """A fresh, unverified machine's input faults re-queue the jobs (node faults on them): its
    leases ended empty, and past the limit it is granted nothing more."""
    await strict.insert_jobs("alice", [new_job() for _ in range(3)])
    for _ in range(2):
        after = await _fail_input(strict, "fresh")
        assert after is not None and after.state is JobState.QUEUED
        assert after.node_faults == 1
    assert await _fail_input(strict, "fresh") is None
    # The jobs wait for honest machines: another machine is granted one.
    assert await strict.claim_job("other", 10**7, TTL_S, secret_sha256=SECRET) is not None


async def test_a_confirmation_frees_the_first_reporter_too(
    strict: Ledger, database_url: str
) -> None:
    """Two machines in good standing report the same job's input fault: until the second
    confirms it, the first one's lease is empty (one machine's word); once the job failed as
    INPUT, neither lease counts."""
    bad = (await strict.insert_jobs("alice", [new_job(priority=1)]))[0]
    await strict.insert_jobs("alice", [new_job() for _ in range(2)])
    await in_good_standing(database_url, "a", "b")
    after = await _fail_input(strict, "a")
    assert after is not None and after.job_id == bad.job_id and after.state is JobState.QUEUED
    # A second empty lease (a job given up unworked) reaches the limit: a is quarantined.
    taken = await strict.claim_job("a", 10**7, TTL_S, secret_sha256=SECRET)
    assert taken is not None and taken.lease_id is not None
    await strict.drain_lease(taken.lease_id, taken.epoch, "spot")
    assert await strict.claim_job("a", 10**7, TTL_S, secret_sha256=SECRET) is None
    after = await _fail_input(strict, "b")
    assert after is not None and after.job_id == bad.job_id
    assert after.state is JobState.FAILED and after.failure_class is FailureClass.INPUT
    # The fault is the job's now: a's report of it no longer counts against a.
    assert await strict.claim_job("a", 10**7, TTL_S, secret_sha256=SECRET) is not None


async def test_a_job_failed_at_max_node_faults_is_not_an_accepted_input_fault(
    strict: Ledger,
) -> None:
    """Ten fresh machines each calling one job's inputs bad fail it at max_node_faults (its
    class the last report's, INPUT), but the fleet never accepted the fault: their leases are
    still empty ones, so a group cannot fail jobs this way and escape the quarantine."""
    bad = (await strict.insert_jobs("alice", [new_job(priority=1)]))[0]
    await strict.insert_jobs("alice", [new_job()])
    machines = [f"fresh-{n}" for n in range(bad.max_node_faults)]
    for machine in machines:
        after = await _fail_input(strict, machine)
        assert after is not None and after.job_id == bad.job_id
    assert after is not None
    assert after.state is JobState.FAILED and after.failure_class is FailureClass.INPUT
    # One more empty lease (given up unworked) reaches the limit of two for the last of them.
    last = machines[-1]
    taken = await strict.claim_job(last, 10**7, TTL_S, secret_sha256=SECRET)
    assert taken is not None and taken.lease_id is not None
    await strict.drain_lease(taken.lease_id, taken.epoch, "spot")
    assert await strict.claim_job(last, 10**7, TTL_S, secret_sha256=SECRET) is None


async def _connected(
    ledger: Ledger, machine_id: str, families: tuple[str, ...] = ("sdxl",)
) -> None:
    """The machine holds a stream's session, qualified, with plenty of memory, serving the
    families."""
    async with ledger._conn() as conn:
        await conn.execute(
            "INSERT INTO machines (machine_id, session_token_sha256, qualified, vram_mb, families)"
            " VALUES ($1, $2, true, $3, $4)",
            machine_id,
            SECRET,
            10**7,
            list(families),
        )


async def test_a_job_waiting_on_quarantined_machines_says_so(strict: Ledger) -> None:
    """While every connected machine that could run a queued job is quarantined, its waiting
    reason says so (before, it said nothing: `get` showed no reason and `nodes` an idle
    qualified machine); once another machine is connected, it no longer does."""
    await strict.insert_jobs("alice", [new_job(priority=1) for _ in range(2)])
    untouched = (await strict.insert_jobs("alice", [new_job()]))[0]
    await _connected(strict, "only")
    first = await _fail_input(strict, "only")
    assert first is not None
    job = await strict.get_job(untouched.job_id, "alice")
    assert job is not None and job.state is JobState.QUEUED
    assert job.waiting_reason == (
        "waiting for one of the 1 connected machines that can run it to be free (jobs of"
        " higher priority, or submitted earlier, go first)"
    )
    assert await _fail_input(strict, "only") is not None
    job = await strict.get_job(untouched.job_id, "alice")
    assert job is not None and job.waiting_reason is not None
    assert "every connected machine that could run it is quarantined" in job.waiting_reason
    (listed,) = [
        j
        for j in await strict.list_jobs(
            "alice", states=[JobState.QUEUED], labels={}, after=None, limit=10
        )
        if j.job_id == untouched.job_id
    ]
    assert listed.waiting_reason == job.waiting_reason
    # The machine is banned from the job it failed: no connected machine could run that one.
    failed = await strict.get_job(first.job_id, "alice")
    assert failed is not None and failed.waiting_reason is not None
    assert "quarantined" not in failed.waiting_reason
    # A machine of another family could not run it: the job still waits on the quarantine.
    await _connected(strict, "flux-only", families=("flux", "flux2"))
    job = await strict.get_job(untouched.job_id, "alice")
    assert job is not None and job.waiting_reason is not None
    assert "quarantined" in job.waiting_reason
    await _connected(strict, "fresh")
    job = await strict.get_job(untouched.job_id, "alice")
    assert job is not None and job.waiting_reason is not None
    assert "quarantined" not in job.waiting_reason
    assert "one of the 1 connected machines that can run it" in job.waiting_reason


async def test_a_job_no_connected_machine_can_run_says_so(strict: Ledger) -> None:
    """A job that never started said nothing (an outside attack: `get` showed QUEUED and no
    reason): with no machine connected, or none of its family or memory, it says what it
    waits for."""
    job = (await strict.insert_jobs("alice", [new_job(min_vram_mb=20_000)]))[0]
    said = await strict.get_job(job.job_id, "alice")
    assert said is not None and said.waiting_reason == (
        "no connected machine can run it (qualified, serving the sdxl family, with 20000 MiB"
        " of GPU memory, not banned from it); waiting for one to connect"
    )
    await _connected(strict, "flux-only", families=("flux",))
    said = await strict.get_job(job.job_id, "alice")
    assert said is not None and said.waiting_reason is not None
    assert said.waiting_reason.startswith("no connected machine can run it")
    await _connected(strict, "sdxl")
    said = await strict.get_job(job.job_id, "alice")
    assert said is not None and said.waiting_reason is not None
    assert said.waiting_reason.startswith("waiting for one of the 1 connected machines")
    granted = await strict.claim_job("sdxl", 10**7, TTL_S, secret_sha256=SECRET)
    assert granted is not None and granted.job_id == job.job_id
    running = await strict.get_job(job.job_id, "alice")
    assert running is not None and running.waiting_reason is None
