"""The ledger's records: the values its methods return or take, and the mapping of a row to
a domain value (`lorafleet.core.model`) where a row needs more than `rows.record`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from lorafleet.core.model import (
    Checkpoint,
    EventKind,
    FailureClass,
    Job,
    JobEvent,
    JobResult,
    JobState,
    Progress,
    SampleSettings,
    SampleTask,
    StoredImage,
)
from lorafleet.core.spec import JobShape, JobSpec
from lorafleet.ledger.rows import record

# Identity providers whose machines the operator itself runs: `lorafleet up`'s local supervisor
# and EC2 (instances in the operator's own accounts). An input fault one of them reports fails
# the job at once; a stranger's machine (SaladCloud, or unverified) needs a second to agree.
OPERATOR_RUN_PROVIDERS = ("local", "ec2")


@dataclass(frozen=True, kw_only=True)
class NewJob:
    job_id: str
    spec: JobSpec
    idempotency_key: str
    traceparent: str


@dataclass(frozen=True, kw_only=True)
class ResumedLease:
    """A lease its holder kept across a reconnect (`resume_lease`): the job as it stands, and
    the W3C traceparent the scheduler's spans for the lease go under (its grant span's)."""

    job: Job
    traceparent: str


@dataclass(frozen=True, kw_only=True)
class ExpiredLease:
    job_id: str
    lease_id: str
    machine_id: str
    epoch: int
    # The last step its holder reported (None: none), the job's newest checkpoint (where the
    # next lease resumes) and the difference: the steps lost, at least.
    last_step: int | None = None
    resume_step: int = 0
    steps_lost: int = 0


@dataclass(frozen=True, kw_only=True)
class StalledLease:
    """A lease revoked for making no verified progress (`stall_leases`)."""

    job_id: str
    lease_id: str
    machine_id: str
    epoch: int
    job_state: JobState
    silent_s: int


@dataclass(frozen=True, kw_only=True)
class ApiKeyRecord:
    key_id: str
    owner: str
    secret_sha256: bytes


@dataclass(frozen=True, kw_only=True)
class KeySpending:
    """A key's spend limit (None: none) and the GPU-seconds billed to its jobs so far."""

    spend_limit_dollars: float | None
    gpu_seconds: float


@dataclass(frozen=True, kw_only=True)
class ShapeWork:
    """Steps still to run of a key's unfinished jobs of one shape."""

    shape: JobShape
    steps: int


@dataclass(frozen=True, kw_only=True)
class ShapePace:
    """The fleet's pace on jobs of one shape from verified completions: the median over
    `machines` provider-verified machines (one figure each); 0 s/step when there are none."""

    machines: int
    seconds_per_step: float


@dataclass(frozen=True, kw_only=True)
class ApiKeyInfo:
    """An API key as an operator lists it (never its secret)."""

    key_id: str
    owner: str
    created_at: datetime
    revoked_at: datetime | None
    webhook_url: str | None


@dataclass(frozen=True, kw_only=True)
class LeaseRecord:
    """One lease ever granted (the audit trail that billing sums over)."""

    lease_id: str
    job_id: str
    epoch: int
    machine_id: str
    granted_at: datetime
    last_heartbeat_at: datetime
    ended_at: datetime | None
    end_reason: str | None


@dataclass(frozen=True, kw_only=True)
class WebhookDeliveryRecord:
    """One outbox row as its owner sees it: where it went, how often, how it ended."""

    delivery_id: int
    event: str
    url: str
    attempts: int
    last_status: int | None
    last_error: str | None
    delivered_at: datetime | None
    gave_up_at: datetime | None
    created_at: datetime
    next_attempt_at: datetime


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    """One machine of the node registry, with what its leases say about it."""

    machine_id: str
    provider_instance_id: str
    # Who vouched for the machine's id on its current stream ("": unverified, a claim).
    identity_provider: str
    gpu_model: str
    vram_mb: int
    # None until the worker's Hello (with its qualification probe) is recorded.
    qualified: bool | None
    qualification_detail: str | None
    version: str
    first_seen_at: datetime
    last_seen_at: datetime
    lease_job_id: str | None
    node_faults: int
    # When its node faults within the asked window happened (epoch seconds, newest first).
    recent_fault_times: tuple[float, ...]
    jobs_finished: int


@dataclass(frozen=True, kw_only=True)
class Interruptions:
    """Leases of one node class ended by expiry or drain over a window, and the lease-seconds
    held (provider-verified machines only). `interruptions` counts at most one per machine
    (queries.sql, interruptions_for_gpu)."""

    interruptions: float
    lease_seconds: float


@dataclass(frozen=True, kw_only=True)
class PaceRecord:
    """One lease's pace as the scheduler observed it (steps between the first and the last
    verified checkpoint over the ledger's clock; None with fewer than two), beside what its
    holder reported (a claim, believed only against the holder itself), with the job's shape."""

    machine_id: str
    job_id: str
    epoch: int
    live: bool
    observed_steps: int | None
    observed_seconds: float | None
    # A lease that ended with a verified result: the steps it had to run, grant to end (the
    # model's loading included; None otherwise).
    completed_steps: int | None
    completed_seconds: float | None
    reported_seconds_per_step: float | None
    reported_steps: int
    # The job's shape (JobSpec.shape) and whether the holder said its step ran compiled.
    shape: JobShape
    step_compiled: bool | None
    gpu_class: str
    # Who vouched for the machine's id ("": nobody; its reports touch no one else).
    identity_provider: str


@dataclass(frozen=True, kw_only=True)
class PaceReference:
    """The scaler's learned reference pace of a GPU class (seconds per 1024x1024 image step)
    and when it last moved (epoch s, the scaler's clock)."""

    gpu_class: str
    seconds_per_step: float
    machines: int
    updated_at: float


@dataclass(frozen=True, kw_only=True)
class ScalerWork:
    queued: int
    # Leases held by listed or provider-verified machines; `unplaced`: the others.
    running: int
    unplaced: int
    last_finished_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class BannedQueuedJob:
    job_id: str
    banned_machines: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ScalerAction:
    """A decision the scaler carried out (epoch seconds on the scaler's clock)."""

    at: float
    action: str
    target: str
    job_id: str | None


@dataclass(frozen=True, kw_only=True)
class ScalerDecisionRecord:
    decision_id: int
    at: datetime
    last_at: datetime
    repeats: int
    scaler_id: str
    action: str
    target: str
    job_id: str | None
    reason: str
    figures: dict[str, Any]
    applied: bool
    error: str | None


def job_from_row(row: asyncpg.Record) -> Job:
    spec = JobSpec.from_dict(row["spec"])
    checkpoint = None
    if row["checkpoint_key"] is not None:
        checkpoint = Checkpoint(
            step=row["checkpoint_step"],
            epoch=row["checkpoint_epoch"],
            key=row["checkpoint_key"],
            size_bytes=row["checkpoint_bytes"],
            sha256=row["checkpoint_sha256"],
            committed_at=row["checkpoint_at"],
        )
    result = None
    if row["result_key"] is not None:
        kohya = None
        if row["result_kohya_key"] is not None:
            kohya = JobResult(
                key=row["result_kohya_key"],
                size_bytes=row["result_kohya_bytes"],
                sha256=row["result_kohya_sha256"],
            )
        result = JobResult(
            key=row["result_key"],
            size_bytes=row["result_bytes"],
            sha256=row["result_sha256"],
            kohya=kohya,
        )
    return record(
        Job,
        row,
        spec=spec,
        state=JobState(row["state"]),
        progress=Progress(
            step=row["progress_step"],
            max_steps=row["max_train_steps"],
            loss=row["progress_loss"],
            learning_rate=row["progress_lr"],
            seconds_per_step=row["progress_s_per_step"],
            machine_id=row["progress_machine_id"],
            updated_at=row["progress_at"],
        ),
        latest_checkpoint=checkpoint,
        result=result,
        failure_class=FailureClass(row["failure_class"]) if row["failure_class"] else None,
        gpu_seconds=float(row["gpu_seconds"] or 0) if "gpu_seconds" in row else None,
    )


def event_from_row(row: asyncpg.Record) -> JobEvent:
    checkpoint = None
    if row["checkpoint_key"] is not None:
        checkpoint = Checkpoint(
            step=row["step"] or 0,
            epoch=row["epoch"] or 0,
            key=row["checkpoint_key"],
            size_bytes=row["checkpoint_bytes"] or 0,
            sha256=row["checkpoint_sha256"] or "",
        )
    return record(
        JobEvent,
        row,
        kind=EventKind(row["kind"]),
        failure_class=FailureClass(row["failure_class"]) if row["failure_class"] else None,
        state=JobState(row["state"]) if row["state"] else None,
        checkpoint=checkpoint,
    )


def checkpoint_from_row(row: asyncpg.Record) -> Checkpoint:
    return record(Checkpoint, row)


@dataclass(frozen=True, kw_only=True)
class Quarantine:
    """A machine with `threshold` node faults in the last `window_s` seconds is granted
    nothing (no job, no sample task) until the window passes or the scaler replaces it; so is
    one with `empty_lease_limit` leases in the window that ended (dropped by a Ready, drained,
    expired) without a checkpoint: taking and dropping leases collects their URLs and
    delays their jobs, and an honest node rarely does it."""

    threshold: int = 3
    window_s: float = 3600.0
    empty_lease_limit: int = 10


# A machine's word against a job (an internal error toward max_failures, an input fault's
# confirmation) counts only if it delivered a verified result this long before the job was
# submitted (lorafleet_good_standing): machines arriving together have no say for 6 hours.
STANDING_MIN_AGE_S = 6 * 3600.0


@dataclass(frozen=True, kw_only=True)
class WebhookDelivery:
    delivery_id: int
    job_id: str
    event: str
    url: str
    payload: dict[str, Any]
    attempts: int
    secret: str


def sample_task_from_row(row: asyncpg.Record) -> SampleTask:
    keys = set(row.keys())
    return record(
        SampleTask,
        row,
        owner=row["owner"] if "owner" in keys else "",
        settings=SampleSettings.from_dict(row["settings"]),
        images=tuple(
            StoredImage(
                prompt_index=int(i["prompt_index"]),
                image_index=int(i["image_index"]),
                key=str(i["key"]),
                size_bytes=int(i["size_bytes"]),
                sha256=str(i["sha256"]),
            )
            for i in row["images"]
        ),
        spec=JobSpec.from_dict(row["spec"]) if "spec" in keys else None,
        traceparent=row["traceparent"] if "traceparent" in keys else None,
    )
