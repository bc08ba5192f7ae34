"""What a lease's parts share: the link to the scheduler, the trainer's entry point, how a lease
ended, the progress slot the heartbeat reads, and what JobFailed says.

`lease_runner.LeaseRunner` (a training lease) and `sample_runner.SampleRunner` (a sample task)
both build on these; `lease_inputs` downloads a lease's inputs and `uploads` stores what it makes.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.training import (
    TrainingConfig,
    TrainingFailure,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
)

# What JobFailed.message may carry (the scheduler keeps 4000 characters).
_MAX_MESSAGE_CHARS = 4000


class LeaseLost(Exception):
    """The lease is no longer this worker's (revoked, rejected, not resumed): stop acting on it."""


class LeaseLink(Protocol):
    """What a runner needs from the connection; the agent implements it."""

    async def send(self, message: fpb.ConnectRequest) -> None:
        """Queues a message about this lease on the stream, waiting while the agent reconnects.

        Raises `LeaseLost` once the lease is gone.
        """
        ...


class TrainerLike(Protocol):
    """`lorafleet.worker.training.Trainer`'s blocking entry point."""

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome: ...


TrainerFactory = Callable[[TrainingConfig], TrainerLike]


def training_config_for(config: WorkerConfig, spec: JobSpec) -> TrainingConfig:
    """A run of `spec` on this worker, as its settings say (a training lease or a sample task)."""
    return TrainingConfig(
        spec=spec,
        model_path=config.model_path,
        vae_path=config.vae_path,
        cache_dir=config.model_cache_dir,
        local_files_only=config.local_files_only,
        device=config.device,
        sample_steps=config.sample_steps,
        sample_batch_size=config.sample_batch_size,
        compile_model=config.compile_model,
        compile_cache_dir=str(config.compile_cache_path),
        progress_interval_s=config.progress_interval_s,
    )


class LeaseResult(enum.Enum):
    """How `LeaseRunner.run()` ended."""

    SUCCEEDED = "succeeded"  # result uploaded, JobSucceeded sent
    FAILED = "failed"  # JobFailed sent
    DRAINED = "drained"  # stopped for a drain; its snapshot committed when there was one
    STOPPED = "stopped"  # canceled, revoked, rejected or aborted: nothing more to send


@dataclass(frozen=True, kw_only=True)
class ProgressReport:
    """The newest training progress, as a heartbeat carries it (NaN: not known yet)."""

    step: int
    loss: float = math.nan
    learning_rate: float = math.nan
    seconds_per_step: float = math.nan
    gpu_memory_mb: int = 0


class ProgressSlot:
    """Latest value wins: the training thread publishes, the heartbeat loop reads.

    Older values are simply overwritten; nothing queues up however slow the reader is.
    """

    def __init__(self, initial: ProgressReport) -> None:
        # A lock rather than relying on atomic attribute stores, so the slot stays correct on a
        # free-threaded interpreter too; it is held for one assignment.
        self._lock = threading.Lock()
        self._value = initial

    def publish(self, report: ProgressReport) -> None:
        with self._lock:
            self._value = report

    def latest(self) -> ProgressReport:
        with self._lock:
            return self._value


def failure_message(exc: BaseException) -> str:
    """What JobFailed says: a `TrainingFailure`'s own (user-facing) message, else the
    exception's type and text."""
    text = str(exc) if isinstance(exc, TrainingFailure) else f"{type(exc).__name__}: {exc}"
    return text.replace("\x00", "")[:_MAX_MESSAGE_CHARS] or type(exc).__name__
