"""The trainer's public types: what a run's caller hands in and gets back.

`TrainingHooks` (the callbacks from the training thread and what each may do), the two
outcomes of `Trainer.run` (`Finished`, `Stopped`; `TrainingOutcome`), `StopReason`, and
`RunTimings` (per-step, per-snapshot and setup wall times, for metrics). No behaviour beyond
timing a setup phase: the run itself is loop.py. Re-exported by the package.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from lorafleet.worker.training.checkpoint import TrainingSnapshot

StopReason = Literal["cancel", "drain"]
ProgressHook = Callable[[int, float, float, float], None]


@dataclass(frozen=True, kw_only=True)
class TrainingHooks:
    """Callbacks from the training thread. Each must return quickly (hand work to another
    thread); an exception raised by one ends the run.

    * `on_progress(step, loss, learning_rate, seconds_per_step)`: after an optimizer step,
      at most every `progress_interval_s`, and after the last (seconds_per_step is the mean
      since the previous report). Latest value wins.
    * `should_stop()`: polled before every optimizer step and between accumulation micro-steps
      (and between class-image batches). Return "cancel" to stop at once (no snapshot) or
      "drain" to stop at the next step boundary with a snapshot; None to go on.
    * `on_checkpoint(snapshot)`: at every multiple of `checkpointing_steps` below
      `max_train_steps` (the result supersedes a final checkpoint). Serialise and upload it
      elsewhere; the snapshot is already independent of the run.
    * `on_class_images([(index, png), ...])`: prior-preservation images generated because fewer
      than `num_class_images` were supplied, per batch as they are made. Store them before any
      checkpoint is committed and pass them back as `class_images` when resuming: a checkpoint
      is only valid with the class images it was trained with.
    * `on_notice(message)`: something the job's owner should read on its timeline (whether
      the step was compiled and why, a compiled run falling back to eager).
    * `on_phase(name)`: the run enters a setup phase before its first step (`decode_images`,
      `load_model`, `class_images`, `adapters`, `compile_choice`, `precompute`, `optimizer`,
      `restore`). `should_stop` is polled at each: a cancel or a drain asked for while the run
      prepares ends it there (no snapshot: nothing was trained).
    * `checkpoint_every()`: the checkpoint interval in steps, read after each optimizer step
      (the worker re-derives an automatic interval from the node's own pace); None: the spec's
      `checkpointing_steps`.

    Validation images are not made here: the training thread never stops for them. They are
    sample tasks on the fleet (`lorafleet.worker.training.samples`), made from the
    checkpoints and the result.
    """

    on_progress: ProgressHook | None = None
    should_stop: Callable[[], StopReason | None] | None = None
    on_checkpoint: Callable[[TrainingSnapshot], None] | None = None
    on_class_images: Callable[[list[tuple[int, bytes]]], None] | None = None
    on_notice: Callable[[str], None] | None = None
    on_phase: Callable[[str], None] | None = None
    checkpoint_every: Callable[[], int] | None = None


@dataclass(frozen=True, kw_only=True)
class Finished:
    """All `max_train_steps` done. `lora_weights` is `pytorch_lora_weights.safetensors`;
    `kohya_weights` is `pytorch_lora_weights_kohya.safetensors` when the job's output_format
    asks for it (kohya or both), else None."""

    step: int
    loss: float
    lora_weights: bytes = field(repr=False)
    kohya_weights: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, kw_only=True)
class Stopped:
    """`should_stop` asked to stop after `step` optimizer steps.

    `snapshot` is the state at `step` for a drain when this run made progress (at least one
    optimizer step since it started or resumed), else None.
    """

    step: int
    reason: StopReason
    snapshot: TrainingSnapshot | None


TrainingOutcome = Finished | Stopped


@dataclass
class RunTimings:
    """Wall-clock seconds per optimizer step and per checkpoint snapshot, for metrics; the
    run's setup before its first step by phase; and when its first step ended (Unix time)."""

    step_seconds: list[float] = field(default_factory=list)
    snapshot_seconds: list[float] = field(default_factory=list)
    setup_seconds: dict[str, float] = field(default_factory=dict)
    first_step_done_at: float | None = None

    @contextlib.contextmanager
    def setup_phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.setup_seconds[name] = self.setup_seconds.get(name, 0.0) + elapsed
