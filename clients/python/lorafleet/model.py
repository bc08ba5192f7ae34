"""Domain values shared by the scheduler, the SDK and the CLI (frozen, keyword-only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from lorafleet.spec import JobSpec


class JobState(enum.StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED)


class FailureClass(enum.StrEnum):
    NODE = "NODE"
    INPUT = "INPUT"
    INTERNAL = "INTERNAL"


class EventKind(enum.StrEnum):
    SUBMITTED = "SUBMITTED"
    LEASE_GRANTED = "LEASE_GRANTED"
    HEARTBEAT = "HEARTBEAT"
    CHECKPOINT_COMMITTED = "CHECKPOINT_COMMITTED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    DRAINED = "DRAINED"
    ATTEMPT_FAILED = "ATTEMPT_FAILED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"
    LEASE_RESUMED = "LEASE_RESUMED"
    CHECKPOINT_DELETED = "CHECKPOINT_DELETED"


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int
    max_steps: int
    loss: float | None
    learning_rate: float | None
    seconds_per_step: float | None
    machine_id: str | None
    updated_at: datetime | None

    @property
    def eta_seconds(self) -> float | None:
        if self.seconds_per_step is None:
            return None
        return max(0, self.max_steps - self.step) * self.seconds_per_step


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    step: int
    epoch: int
    key: str
    size_bytes: int
    sha256: str
    committed_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class JobResult:
    key: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Job:
    job_id: str
    owner: str
    spec: JobSpec
    state: JobState
    epoch: int
    failures: int
    progress: Progress
    latest_checkpoint: Checkpoint | None
    result: JobResult | None
    error: str | None
    failure_class: FailureClass | None
    machine_id: str | None
    lease_id: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    traceparent: str | None = None
    # Billable accelerator seconds over every lease; known on reads (get, list), else None.
    gpu_seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Lease:
    lease_id: str
    job_id: str
    epoch: int
    machine_id: str
    expires_at: datetime


@dataclass(frozen=True, kw_only=True)
class JobEvent:
    event_id: int
    job_id: str
    kind: EventKind
    at: datetime
    machine_id: str | None = None
    lease_id: str | None = None
    epoch: int | None = None
    step: int | None = None
    loss: float | None = None
    seconds_per_step: float | None = None
    message: str | None = None
    failure_class: FailureClass | None = None
    state: JobState | None = None
    checkpoint: Checkpoint | None = None


@dataclass(frozen=True, kw_only=True)
class Machine:
    machine_id: str
    provider_instance_id: str
    gpu_model: str
    vram_mb: int
    qualified: bool
    version: str


def checkpoint_key(job_id: str, step: int, epoch: int) -> str:
    """DESIGN.md: `jobs/<job_id>/checkpoints/<step>-e<epoch>`: two epochs never collide."""
    return f"jobs/{job_id}/checkpoints/{step}-e{epoch}"


def result_key(job_id: str, epoch: int) -> str:
    # Per epoch, so a fenced-off stale holder can never overwrite the recorded result.
    return f"jobs/{job_id}/result/e{epoch}/pytorch_lora_weights.safetensors"


def validation_image_key(job_id: str, step: int, epoch: int, index: int) -> str:
    return f"jobs/{job_id}/validation/{step}-e{epoch}-{index}.png"


def class_image_key(job_id: str, index: int) -> str:
    return f"jobs/{job_id}/class_images/{index:05d}.png"


def upload_key(owner: str, prefix: str, name: str = "") -> str:
    """Where an owner's uploaded training data lives; specs name prefixes relative to it."""
    base = f"uploads/{owner}/{prefix.strip('/')}"
    return f"{base}/{name}" if name else f"{base}/"
