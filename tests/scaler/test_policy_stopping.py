"""The policy with instances the provider still counts while they stop (reallocated, restarted,
being removed): every counted instance is seen, scale-in names each instance it removes, and
no busy node is ever the provider's cheapest choice."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lorafleet.scaler.policy import Action, QueuedJob, decide
from lorafleet.scaler.provider import InstanceState
from tests.scaler.test_policy import CFG, NOW, busy, inst, node, past, snap, summary

STOPPING = InstanceState.STOPPING
BUSY, IDLE = CFG.busy_deletion_cost, CFG.idle_deletion_cost

CASES = [
    pytest.param(
        # Both jobs ran; the platform reallocated x (stopping, its job re-queued) and a took
        # that job: one job, two counted instances. Lowering to 1 without naming x left the
        # provider a tie between x and the busy a.
        snap(
            instances=[inst("a", cost=BUSY), inst("x", STOPPING, cost=BUSY)],
            nodes=[busy("a", "j2"), node("x")],
            replicas=2,
            running_jobs=1,
        ),
        [("scale", 1, ("x",))],
        id="a stopping idle instance is named as the victim",
    ),
    pytest.param(
        snap(
            instances=[inst("a", cost=IDLE), inst("x", STOPPING, cost=BUSY)],
            nodes=[node("a"), busy("x", "j1")],
            replicas=2,
            running_jobs=1,
        ),
        [("scale", 1, ("a",))],
        id="a stopping busy one is counted, never named",
    ),
    pytest.param(
        snap(
            instances=[inst("a", cost=BUSY), inst("x", STOPPING, cost=BUSY)],
            nodes=[busy("a", "j1"), busy("x", "j2")],
            replicas=2,
            running_jobs=1,
        ),
        [("hold", "fleet")],
        id="no idle counted instance: no scale-in",
    ),
    pytest.param(
        # a took a lease since the last tick: its cost goes up before the count comes down.
        snap(
            instances=[inst("a", cost=IDLE), inst("b", cost=IDLE)],
            nodes=[busy("a", "j1"), node("b")],
            replicas=2,
            running_jobs=1,
        ),
        [("cost", "a", BUSY), ("scale", 1, ("b",))],
        id="a newly busy node is raised before the scale-in",
    ),
    pytest.param(
        # b was busy at the last tick: named now, its cost is not set back after the PATCH.
        snap(
            instances=[inst("a", cost=BUSY), inst("b", cost=BUSY)],
            nodes=[busy("a", "j1"), node("b")],
            replicas=2,
            running_jobs=1,
        ),
        [("scale", 1, ("b",))],
        id="the named victim keeps the 0 the scale-in gives it",
    ),
    pytest.param(
        snap(
            instances=[inst("a", cost=BUSY), inst("x", STOPPING, cost=0)],
            nodes=[busy("a", "j1"), node("x")],
            replicas=1,
            running_jobs=1,
        ),
        [],
        id="a stopping victim at 0 is left at 0",
    ),
    pytest.param(
        snap(
            instances=[inst("a", cost=BUSY), inst("x", STOPPING, cost=BUSY)],
            nodes=[busy("a", "j1"), node("x")],
            replicas=1,
            running_jobs=1,
        ),
        [("cost", "x", IDLE)],
        id="a stopping idle instance gets the idle cost",
    ),
    pytest.param(
        snap(
            instances=[inst("a", cost=IDLE), inst("x", STOPPING, cost=IDLE)],
            nodes=[node("a"), busy("x", "j1")],
            replicas=1,
            running_jobs=1,
        ),
        [("cost", "x", BUSY)],
        id="a stopping busy instance gets the busy cost",
    ),
    pytest.param(
        # Two jobs run, one on a machine no listed instance joins (its worker's machine id is
        # not the provider's): b or c may be that node, so the count stays.
        snap(
            instances=[inst("a", cost=BUSY), inst("b", cost=IDLE), inst("c", cost=IDLE)],
            nodes=[busy("a", "j1"), node("c")],
            replicas=3,
            running_jobs=2,
        ),
        [("hold", "fleet")],
        id="a busy node it cannot see: no scale-in",
    ),
]


@pytest.mark.parametrize(("snapshot", "expected"), CASES)
def test_counted_instances(snapshot: Any, expected: list[tuple[Any, ...]]) -> None:
    assert summary(decide(snapshot, CFG)) == expected


def test_a_bad_node_held_by_the_rate_limit_serves_no_stranded_job() -> None:
    """The scheduler quarantines a bad node's machine: a job banned from every other node is
    stranded even though the bad one is not banned from it, and gets a fresh replica."""
    snapshot = snap(
        instances=[inst("bad"), inst("b")],
        nodes=[node("bad", fault_times=(NOW - 5, NOW - 4, NOW - 3)), node("b")],
        queued_jobs=1,
        banned_queued=[QueuedJob(job_id="j1", banned_machines=frozenset({"m-b"}))],
        recent_actions=[past(60, Action.REALLOCATE, "other")],
    )
    got = summary(decide(snapshot, replace(CFG, idle_grace_s=0)))
    assert got == [("hold", "bad"), ("scale", 3, ())]


def test_a_bad_node_held_by_the_rate_limit_is_no_capacity_while_jobs_queue() -> None:
    bad_node = node("bad", fault_times=(NOW - 5, NOW - 4, NOW - 3))
    held = [past(60, Action.REALLOCATE, "other")]
    snapshot = snap(
        instances=[inst("bad"), inst("b")],
        nodes=[bad_node, busy("b", "j1")],
        queued_jobs=1,
        running_jobs=1,
        recent_actions=held,
    )
    got = summary(decide(snapshot, CFG))
    assert got == [("hold", "bad"), ("scale", 3, ())]
    # Without queued work it is only the first to go.
    idle = snap(
        instances=[inst("bad"), inst("b")],
        nodes=[bad_node, busy("b", "j1")],
        running_jobs=1,
        recent_actions=held,
    )
    assert summary(decide(idle, CFG)) == [("hold", "bad"), ("scale", 1, ("bad",))]
