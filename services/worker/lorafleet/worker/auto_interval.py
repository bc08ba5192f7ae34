"""`checkpointing_steps: auto` on the worker: the lease's interval follows this node's own pace.

The scheduler chooses the interval at the grant as sqrt(2 x checkpoint cost x mean time between
interruptions) seconds, in steps at the pace it assumed (the fleet's on the job's shape, else a
prior). A node much slower than that pace (a CPU node against a GPU prior) would checkpoint far
too seldom (once per job), a much faster one too often. The grant carries the interval in
seconds (`LeaseGranted.checkpoint_interval_s`); once the run has measured its own seconds per
step, the steps are derived again from it, within the same bounds (`checkpoint_min_steps` ..
max_train_steps), and again whenever the measured pace moves by more than `_DRIFT` from the one
in use. The trainer reads `current()` through its `checkpoint_every` hook.
"""

from __future__ import annotations

import math

# Reports before this many steps of the run are not its pace yet (the first step compiles,
# warms caches, allocates).
WARMUP_STEPS = 3
# The measured pace must differ from the one in use by more than this factor to change the
# interval: noise between reports never makes it flap.
_DRIFT = 1.5


class AutoInterval:
    """The interval of one lease (its training thread only calls `observe` and `current`)."""

    def __init__(
        self, *, steps: int, interval_s: float, min_steps: int, max_steps: int, start_step: int
    ) -> None:
        self._steps = steps
        self._interval_s = interval_s
        self._min_steps = min(max(min_steps, 1), max_steps)
        self._max_steps = max_steps
        self._start_step = start_step
        # The pace the interval in use assumes (the scheduler's, as the grant implies it).
        self.pace_s = interval_s / steps if interval_s > 0 and steps > 0 else math.nan

    @property
    def follows_pace(self) -> bool:
        """False for a job's own fixed interval (the grant carries no seconds)."""
        return self._interval_s > 0 and self._steps > 0

    def current(self) -> int:
        return self._steps

    def observe(self, step: int, seconds_per_step: float) -> int | None:
        """A progress report: the new interval in steps when this pace changes it, else None."""
        if not self.follows_pace or step - self._start_step < WARMUP_STEPS:
            return None
        if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
            return None
        ratio = seconds_per_step / self.pace_s
        if 1 / _DRIFT <= ratio <= _DRIFT:
            return None
        self.pace_s = seconds_per_step
        steps = max(
            self._min_steps, min(round(self._interval_s / seconds_per_step), self._max_steps)
        )
        if steps == self._steps:
            return None
        self._steps = steps
        return steps
