"""The fleet's pace on a job shape, as both sides of the scheduler use it: the job side prices
and estimates with it (`job_handler.JobHandler.spec_pace`), the worker-stream side sizes
automatic checkpoint intervals with it (`checkpoint_interval.py`). Here, so that neither side
imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Pace:
    """Seconds per step of a job shape: measured (verified completions on `machines`
    provider-verified machines, at least the configured minimum), or else the prior."""

    seconds_per_step: float
    machines: int
    measured: bool
