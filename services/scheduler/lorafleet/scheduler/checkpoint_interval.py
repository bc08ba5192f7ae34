"""`checkpointing_steps: auto` (0): the interval of each lease, chosen at its grant.

Young-Daly: checkpointing every sqrt(2 x C x M) seconds minimises the work lost to
interruptions plus the time spent checkpointing, where C is what one checkpoint costs and M the
mean time between interruptions. Here:

* C: the cost the worker says its latest checkpoint had (training stalled plus upload;
  `Ready.checkpoint_cost_s`), else `checkpoint_cost_prior_s`. A claim, used for that worker's
  own lease only: a worker that misstates it changes its own interval and no one else's.
* M: the ledger's, for the node class (`gpu_model`): leases ended by expiry or drain per
  lease-second held over `interruption_window_s`, provider-verified machines only, smoothed
  by a prior of one interruption per `interruption_prior_s` (`mean_time_between_interruptions`):
  the prior with no data, the fleet's own figure once it has many hours. Each machine counts at
  most one interruption in the window: one machine that drains and reconnects in a loop moves
  every other machine's interval by at most sqrt(2), about 1.41x.
* Steps: the interval over the fleet's pace on the job's shape (`JobHandler.spec_pace`: verified
  completions, else the prior), bounded to `checkpoint_min_steps`..max_train_steps.

Both ledger figures are reused for `figures_ttl_s` (30 s) per GPU class and per job shape: over
a window of days they move by nothing in that time, and a grant then costs the ledger one round
trip for its interval (the interval and its NOTICE in one statement) instead of four.

The interval travels in the grant's spec (`checkpointing_steps`, which trains nothing: the
resume fingerprint is unchanged) and goes on the job's timeline as a NOTICE with its inputs.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from lorafleet.core.spec import JobSpec
from lorafleet.ledger.ledger import Interruptions, Ledger
from lorafleet.scheduler.paces import Pace

# Distinct GPU classes and shapes remembered at once: the GPU class is the worker's word, so a
# worker inventing names must not grow the scheduler's memory.
FIGURES_KEPT = 256

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentFigures(Generic[K, V]):
    """Values loaded from the ledger, reused for `ttl_s`; at most `kept` keys (the least
    recently used goes first)."""

    def __init__(self, *, ttl_s: float, kept: int = FIGURES_KEPT) -> None:
        self._ttl_s = ttl_s
        self._kept = kept
        self._values: OrderedDict[K, tuple[float, V]] = OrderedDict()

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        now = time.monotonic()
        held = self._values.get(key)
        if held is not None and now - held[0] < self._ttl_s:
            self._values.move_to_end(key)
            return held[1]
        value = await load()
        self._values.pop(key, None)
        self._values[key] = (now, value)
        while len(self._values) > self._kept:
            self._values.popitem(last=False)
        return value


@dataclass(frozen=True, kw_only=True)
class CheckpointIntervalSettings:
    cost_prior_s: float = 20.0
    interruption_prior_s: float = 4 * 3600.0
    interruption_window_s: float = 7 * 86400.0
    min_steps: int = 10
    figures_ttl_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
class CheckpointInterval:
    """An automatic interval and what it was computed from (for the job's timeline)."""

    steps: int
    cost_s: float
    cost_measured: bool
    mtbi_s: float
    interruptions: Interruptions
    seconds_per_step: float
    pace_measured: bool
    min_steps: int

    @property
    def seconds(self) -> float:
        """sqrt(2 C M): the interval in time, before it became steps at the assumed pace. The
        grant carries it so that the worker can re-derive the steps from its own pace."""
        return math.sqrt(2.0 * self.cost_s * self.mtbi_s)

    def describe(self, gpu_model: str) -> str:
        cost = "reported by the worker" if self.cost_measured else "prior"
        pace = "fleet median" if self.pace_measured else "prior"
        return (
            f"checkpointing every {self.steps} steps (auto, Young-Daly): checkpoint cost"
            f" {self.cost_s:.3g} s ({cost}), mean time between interruptions"
            f" {self.mtbi_s / 3600:.3g} h ({self.interruptions.interruptions:.3g} interruptions in"
            f" {self.interruptions.lease_seconds / 3600:.3g} lease-hours on"
            f" {gpu_model or 'unnamed GPUs'}), {self.seconds_per_step:.3g} s/step ({pace})"
        )


def mean_time_between_interruptions(observed: Interruptions, prior_s: float) -> float:
    """Lease-seconds per interruption, counting the prior as one more interruption after
    `prior_s` more lease-seconds: the prior alone with no data, finite with no interruption yet
    (a reliable class earns long intervals as its hours grow), the fleet's figure in the limit."""
    return (observed.lease_seconds + prior_s) / (observed.interruptions + 1)


def young_daly_steps(
    *, cost_s: float, mtbi_s: float, seconds_per_step: float, min_steps: int, max_steps: int
) -> int:
    """sqrt(2 C M) seconds in steps, at least `min_steps` and at most `max_steps`."""
    steps = round(math.sqrt(2.0 * cost_s * mtbi_s) / seconds_per_step)
    return max(min(steps, max_steps), min(min_steps, max_steps), 1)


class CheckpointIntervals:
    """Chooses each automatic lease's interval from the ledger and the worker's own report."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        pace: Callable[[JobSpec], Awaitable[Pace]],
        settings: CheckpointIntervalSettings,
    ) -> None:
        self._ledger = ledger
        self._pace = pace
        self._settings = settings
        ttl_s = settings.figures_ttl_s
        self._interruptions: RecentFigures[str, Interruptions] = RecentFigures(ttl_s=ttl_s)
        # Keyed by JobSpec.shape.key, as the pace figures themselves are.
        self._paces: RecentFigures[str, Pace] = RecentFigures(ttl_s=ttl_s)

    async def choose(
        self, spec: JobSpec, *, gpu_model: str, reported_cost_s: float | None
    ) -> CheckpointInterval:
        s = self._settings
        observed = await self._interruptions.get(
            gpu_model,
            lambda: self._ledger.interruptions_for_gpu(gpu_model, window_s=s.interruption_window_s),
        )
        mtbi_s = mean_time_between_interruptions(observed, s.interruption_prior_s)
        pace = await self._paces.get(spec.shape.key, lambda: self._pace(spec))
        cost_s = reported_cost_s if reported_cost_s else s.cost_prior_s
        return CheckpointInterval(
            steps=young_daly_steps(
                cost_s=cost_s,
                mtbi_s=mtbi_s,
                seconds_per_step=pace.seconds_per_step,
                min_steps=s.min_steps,
                max_steps=spec.max_train_steps,
            ),
            cost_s=cost_s,
            cost_measured=bool(reported_cost_s),
            mtbi_s=mtbi_s,
            interruptions=observed,
            seconds_per_step=pace.seconds_per_step,
            pace_measured=pace.measured,
            min_steps=s.min_steps,
        )
