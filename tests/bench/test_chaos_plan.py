"""The chaos benchmark's fault plan: the memoryless kills `--compare-intervals` pairs two runs
on must be the same kills in both runs, and memoryless at the configured rate."""

from __future__ import annotations

import dataclasses
import signal
import statistics
import uuid
from pathlib import Path

from bench.chaos import FaultPlan, parse


def ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def test_memoryless_kills_are_the_same_in_every_run_of_a_seed() -> None:
    settings, _, compare = parse(["--ci", "--compare-intervals"])
    assert compare and settings.mtbi_s == 192.0 and settings.step_s == 0.02
    first, second = ids(100), ids(100)  # another run's jobs: other ids, the same queue places
    a, b = FaultPlan(settings, first), FaultPlan(settings, second)
    draws = [a.kill_after_s(job, 1, hits) for job in first for hits in (0, 1, 2)]
    assert draws == [b.kill_after_s(job, 1, hits) for job in second for hits in (0, 1, 2)]
    # A job's next kill is a draw of its own, and other interruptions (epochs) change nothing.
    assert a.kill_after_s(first[0], 1, 0) != a.kill_after_s(first[0], 2, 1)
    assert a.kill_after_s(first[0], 5, 1) == b.kill_after_s(second[0], 2, 1)
    # Another seed, other kills.
    other = FaultPlan(dataclasses.replace(settings, seed=2), first)
    assert other.kill_after_s(first[0], 1, 0) != draws[0]
    # Exponential with the configured mean (300 draws: within 25% of it), all SIGKILLs.
    assert abs(statistics.mean(d for d in draws if d is not None) / 192.0 - 1) < 0.25
    assert {a.kill_signal() for _ in range(20)} == {signal.SIGKILL}


def test_planned_kills_stay_the_default() -> None:
    settings, _, compare = parse(["--ci", "--workdir", str(Path("unused"))])
    assert not compare and settings.mtbi_s == 0 and settings.checkpoint_stall_s == 0
    jobs = ids(100)
    plan = FaultPlan(settings, jobs)
    planned = dict(plan.interruptions)
    assert planned, "the CI plan interrupts some jobs"
    job, steps = next(iter(planned.items()))
    assert plan.kill_after_s(job, 1, 0) == steps[0] * settings.step_s
    assert plan.kill_after_s(job, 9, len(steps)) is None  # its planned kills are done
    untouched = next(j for j in jobs if j not in planned)
    assert plan.kill_after_s(untouched, 1, 0) is None
