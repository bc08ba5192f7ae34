"""The one place that converts protos to domain values and back."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.families import DEFAULT_FAMILY, FAMILIES
from lorafleet.core.model import (
    Checkpoint,
    ClassImage,
    EventKind,
    FailureClass,
    IdentityProof,
    Job,
    JobEvent,
    JobResult,
    JobState,
    LeaseRef,
    Machine,
    Progress,
    Qualification,
    SampleSettings,
    SampleTask,
    StoredImage,
    WarmState,
    checkpoint_key,
    class_image_key,
    result_formats,
    result_key,
    sample_image_key,
)
from lorafleet.core.spec import SPEC_FIELD, SPEC_FIELDS, JobSpec, SpecField
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb

# The job spec ---------------------------------------------------------------------------------
# Fields convert by their declaration (core/spec.py) and the proto's descriptor: an enum value
# by the naming rule (`lr_scheduler` "cosine" <-> LrScheduler.LR_SCHEDULER_COSINE; the zero,
# UNSPECIFIED, is the field's default), a field with explicit presence (proto3 `optional`) takes
# JobSpec's default when unset and is taken as given when set (a zero is honoured where it means
# something, else refused by the spec's checks; never replaced by the default). The exceptions
# are the labels map, the webhook message and an unset lora_alpha.

_SPEC_PROTO = pb.JobSpec.DESCRIPTOR.fields_by_name
# The spec fields the proto holds in its `webhook` message.
_WEBHOOK_FIELDS = ("webhook_url", "webhook_events")


def enum_prefix(enum: Any) -> str:
    """An enum's value prefix by buf's naming rule: LrScheduler -> LR_SCHEDULER_."""
    name = enum.name
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper() + "_"


def _enum_of(f: SpecField) -> Any:
    if f.name == "webhook_events":
        return pb.WebhookEvent.DESCRIPTOR
    return _SPEC_PROTO[f.name].enum_type


def enum_numbers(f: SpecField) -> dict[str, int]:
    """A choice field's names and their proto enum numbers (the UNSPECIFIED zero left out)."""
    enum = _enum_of(f)
    prefix = enum_prefix(enum)
    return {name: enum.values_by_name[prefix + name.upper()].number for name in f.choices}


def _enum_name(f: SpecField, number: int, field: str) -> Any:
    if number == 0 and f.kind == "choice":
        return f.default
    for name, value in enum_numbers(f).items():
        if value == number:
            return name
    raise InvalidArgument(field, f"unknown enum value {number}")


def spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    """Fills defaults for unset fields and validates; raises InvalidArgument naming the field."""
    fields: dict[str, Any] = {}
    for f in SPEC_FIELDS:
        if f.name == "labels":
            fields[f.name] = dict(msg.labels)
        elif f.name == "webhook_url":
            fields[f.name] = msg.webhook.url
        elif f.name == "webhook_events":
            fields[f.name] = tuple(_enum_name(f, e, "webhook.events") for e in msg.webhook.events)
        elif f.kind == "choice":
            fields[f.name] = _enum_name(f, getattr(msg, f.name), f.name)
        elif f.kind == "texts":
            fields[f.name] = tuple(getattr(msg, f.name))
        elif _SPEC_PROTO[f.name].has_presence and not msg.HasField(f.name):  # type: ignore[arg-type]
            if f.name == "lora_alpha":
                continue  # filled below
            fields[f.name] = f.default
        else:
            fields[f.name] = getattr(msg, f.name)
    # Unset alpha follows the rank (alpha = rank: a LoRA scale of 1).
    if "lora_alpha" not in fields:
        fields["lora_alpha"] = float(fields["lora_rank"])
    return JobSpec(**fields)


def spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    msg = pb.JobSpec()
    for f in SPEC_FIELDS:
        value = getattr(spec, f.name)
        if f.name == "labels":
            msg.labels.update(value)
        elif f.name in _WEBHOOK_FIELDS:
            continue
        elif f.kind == "choice":
            setattr(msg, f.name, enum_numbers(f)[value])
        elif f.kind == "texts":
            getattr(msg, f.name).extend(value)
        else:
            setattr(msg, f.name, value)
    if spec.webhook_url:
        numbers = enum_numbers(SPEC_FIELD["webhook_events"])
        msg.webhook.url = spec.webhook_url
        msg.webhook.events.extend(
            pb.WebhookEvent.ValueType(numbers[e]) for e in spec.webhook_events
        )
    return msg


# Jobs and events ------------------------------------------------------------------------------

JOB_STATES: dict[JobState, pb.JobState.ValueType] = {
    JobState.QUEUED: pb.JOB_STATE_QUEUED,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELED: pb.JOB_STATE_CANCELED,
}
FAILURE_CLASSES: dict[FailureClass, pb.FailureClass.ValueType] = {
    FailureClass.NODE: pb.FAILURE_CLASS_NODE,
    FailureClass.INPUT: pb.FAILURE_CLASS_INPUT,
    FailureClass.INTERNAL: pb.FAILURE_CLASS_INTERNAL,
}
EVENT_KINDS: dict[EventKind, pb.JobEventKind.ValueType] = {
    kind: pb.JobEventKind.Value(f"JOB_EVENT_KIND_{kind.value}") for kind in EventKind
}


def timestamp(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def from_timestamp(ts: Timestamp) -> datetime | None:
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return ts.ToDatetime(tzinfo=UTC)


def job_state_from_proto(value: int, field: str) -> JobState:
    for state, number in JOB_STATES.items():
        if number == value:
            return state
    raise InvalidArgument(field, f"unknown job state {value}")


def failure_class_from_proto(value: int, field: str) -> FailureClass:
    for cls, number in FAILURE_CLASSES.items():
        if number == value:
            return cls
    raise InvalidArgument(field, f"must be NODE, INPUT or INTERNAL (got {value})")


def checkpoint_to_proto(checkpoint: Checkpoint) -> pb.Checkpoint:
    return pb.Checkpoint(
        step=checkpoint.step,
        epoch=checkpoint.epoch,
        key=checkpoint.key,
        size_bytes=checkpoint.size_bytes,
        sha256=checkpoint.sha256,
        committed_at=timestamp(checkpoint.committed_at),
    )


def job_to_proto(job: Job) -> pb.Job:
    progress = job.progress
    msg = pb.Job(
        job_id=job.job_id,
        spec=spec_to_proto(job.spec),
        state=JOB_STATES[job.state],
        epoch=job.epoch,
        failures=job.failures,
        node_faults=job.node_faults,
        max_node_faults=job.max_node_faults,
        progress=pb.Progress(
            step=progress.step,
            max_steps=progress.max_steps,
            loss=progress.loss or 0.0,
            learning_rate=progress.learning_rate or 0.0,
            seconds_per_step=progress.seconds_per_step or 0.0,
            eta_seconds=progress.eta_seconds or 0.0,
            machine_id=progress.machine_id or "",
            updated_at=timestamp(progress.updated_at),
        ),
        error=job.error or "",
        created_at=timestamp(job.created_at),
        updated_at=timestamp(job.updated_at),
        finished_at=timestamp(job.finished_at),
        machine_id=job.machine_id or "",
        gpu_seconds=job.gpu_seconds or 0.0,
        waiting_reason=job.waiting_reason or "",
    )
    if job.latest_checkpoint is not None:
        msg.latest_checkpoint.CopyFrom(checkpoint_to_proto(job.latest_checkpoint))
    if job.result is not None:
        msg.result.CopyFrom(result_to_proto(job.result))
    if job.failure_class is not None:
        msg.failure_class = FAILURE_CLASSES[job.failure_class]
    return msg


def result_to_proto(result: JobResult) -> pb.JobResult:
    msg = pb.JobResult(key=result.key, size_bytes=result.size_bytes, sha256=result.sha256)
    if result.kohya is not None:
        msg.kohya.CopyFrom(result_to_proto(result.kohya))
    return msg


def result_from_proto(msg: pb.JobResult) -> JobResult:
    return JobResult(
        key=msg.key,
        size_bytes=msg.size_bytes,
        sha256=msg.sha256,
        kohya=result_from_proto(msg.kohya) if msg.HasField("kohya") else None,
    )


def event_to_proto(event: JobEvent) -> pb.JobEvent:
    msg = pb.JobEvent(
        event_id=event.event_id,
        job_id=event.job_id,
        kind=EVENT_KINDS[event.kind],
        at=timestamp(event.at),
        machine_id=event.machine_id or "",
        lease_id=event.lease_id or "",
        epoch=event.epoch or 0,
        step=event.step or 0,
        loss=event.loss or 0.0,
        seconds_per_step=event.seconds_per_step or 0.0,
        message=event.message or "",
    )
    if event.failure_class is not None:
        msg.failure_class = FAILURE_CLASSES[event.failure_class]
    if event.state is not None:
        msg.state = JOB_STATES[event.state]
    if event.checkpoint is not None:
        msg.checkpoint.CopyFrom(checkpoint_to_proto(event.checkpoint))
    return msg


def _state_from(value: int) -> JobState | None:
    return next((s for s, n in JOB_STATES.items() if n == value), None)


def _failure_from(value: int) -> FailureClass | None:
    return next((c for c, n in FAILURE_CLASSES.items() if n == value), None)


def checkpoint_from_proto(msg: pb.Checkpoint) -> Checkpoint:
    return Checkpoint(
        step=msg.step,
        epoch=msg.epoch,
        key=msg.key,
        size_bytes=msg.size_bytes,
        sha256=msg.sha256,
        committed_at=from_timestamp(msg.committed_at),
    )


def job_from_proto(msg: pb.Job) -> Job:
    """The client side of `job_to_proto` (the owner is implied by the caller's key)."""
    state = _state_from(msg.state)
    if state is None:
        raise ValueError(f"unknown job state {msg.state}")
    created = from_timestamp(msg.created_at)
    updated = from_timestamp(msg.updated_at)
    assert created is not None and updated is not None
    p = msg.progress
    return Job(
        job_id=msg.job_id,
        owner="",
        spec=spec_from_proto(msg.spec),
        state=state,
        epoch=msg.epoch,
        failures=msg.failures,
        node_faults=msg.node_faults,
        max_node_faults=msg.max_node_faults,
        waiting_reason=msg.waiting_reason or None,
        progress=Progress(
            step=p.step,
            max_steps=p.max_steps,
            # The wire has no unset loss: before a first step (a job leased, then failed or
            # canceled) its 0.0 is no loss at all, for the SDK and the CLI alike.
            loss=p.loss if p.updated_at.seconds and p.step else None,
            learning_rate=p.learning_rate if p.updated_at.seconds else None,
            seconds_per_step=p.seconds_per_step if p.updated_at.seconds else None,
            machine_id=p.machine_id or None,
            updated_at=from_timestamp(p.updated_at),
        ),
        latest_checkpoint=(
            checkpoint_from_proto(msg.latest_checkpoint)
            if msg.HasField("latest_checkpoint")
            else None
        ),
        result=result_from_proto(msg.result) if msg.HasField("result") else None,
        error=msg.error or None,
        failure_class=_failure_from(msg.failure_class),
        machine_id=msg.machine_id or None,
        lease_id=None,
        created_at=created,
        updated_at=updated,
        finished_at=from_timestamp(msg.finished_at),
        gpu_seconds=msg.gpu_seconds,
    )


def event_from_proto(msg: pb.JobEvent) -> JobEvent:
    kind = next(k for k, n in EVENT_KINDS.items() if n == msg.kind)
    at = from_timestamp(msg.at)
    assert at is not None
    return JobEvent(
        event_id=msg.event_id,
        job_id=msg.job_id,
        kind=kind,
        at=at,
        machine_id=msg.machine_id or None,
        lease_id=msg.lease_id or None,
        epoch=msg.epoch or None,
        step=msg.step or None,
        loss=msg.loss or None,
        seconds_per_step=msg.seconds_per_step or None,
        message=msg.message or None,
        failure_class=_failure_from(msg.failure_class),
        state=_state_from(msg.state),
        checkpoint=checkpoint_from_proto(msg.checkpoint) if msg.HasField("checkpoint") else None,
    )


# Worker messages (WorkerService.Connect) ------------------------------------------------------
# Every check of a worker's message that needs no lease lives here; the checks against the
# sender's lease (its keys) are the `check_*` functions, which the worker handler calls. The
# handler acts only on values that passed.

# What a machine id may be: the Hello's, and a provider proof's claim (scheduler/identity.py).
MACHINE_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_LEASE_ID_CHARS = 64
MAX_WORKER_TEXT_CHARS = 256


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def lease_ref_from_proto(ref: fpb.LeaseRef, field: str) -> LeaseRef:
    if not ref.lease_id:
        raise InvalidArgument(f"{field}.lease_id", "is required")
    if len(ref.lease_id) > MAX_LEASE_ID_CHARS:
        raise InvalidArgument(f"{field}.lease_id", f"at most {MAX_LEASE_ID_CHARS} characters")
    if ref.epoch <= 0:
        raise InvalidArgument(f"{field}.epoch", "must be positive")
    return LeaseRef(lease_id=ref.lease_id, epoch=ref.epoch)


def lease_ref_to_proto(ref: LeaseRef) -> fpb.LeaseRef:
    return fpb.LeaseRef(lease_id=ref.lease_id, epoch=ref.epoch)


# More memory than any accelerator has (16 TiB): a larger figure is a lie that would make the
# machine eligible for every min_vram_mb.
MAX_VRAM_MB = 16 * 1024 * 1024
MAX_FAMILIES = 32


def machine_from_hello(hello: fpb.Hello) -> Machine:
    if not MACHINE_ID.fullmatch(hello.machine_id):
        raise InvalidArgument("hello.machine_id", "must match [A-Za-z0-9_.:@-]{1,128}")
    if not 0 <= hello.vram_mb <= MAX_VRAM_MB:
        raise InvalidArgument("hello.vram_mb", f"must be 0..{MAX_VRAM_MB}")
    for name, value in (
        ("provider_instance_id", hello.provider_instance_id),
        ("gpu_model", hello.gpu_model),
        ("version", hello.version),
    ):
        if len(value) > MAX_WORKER_TEXT_CHARS or "\x00" in value:
            raise InvalidArgument(
                f"hello.{name}", f"at most {MAX_WORKER_TEXT_CHARS} characters, no NUL"
            )
    if len(hello.families) > MAX_FAMILIES:
        raise InvalidArgument("hello.families", f"at most {MAX_FAMILIES} families")
    # A family this scheduler does not know (a newer worker's) is no job it could be offered;
    # none named is a worker from before families, which trains sdxl only.
    families = tuple(f for f in dict.fromkeys(hello.families) if f in FAMILIES)
    return Machine(
        machine_id=hello.machine_id,
        provider_instance_id=hello.provider_instance_id,
        gpu_model=hello.gpu_model,
        vram_mb=hello.vram_mb,
        qualified=hello.qualification.passed,
        version=hello.version,
        families=families if hello.families else (DEFAULT_FAMILY,),
    )


def identity_proof_from_hello(hello: fpb.Hello) -> IdentityProof:
    """Sizes are bounded by the identity module, which also says what a bad proof is."""
    proof = hello.identity
    return IdentityProof(
        salad_jwt=proof.salad_jwt,
        ec2_document=proof.ec2.document,
        ec2_signature=proof.ec2.signature,
        local_token=proof.local_token,
    )


MAX_QUALIFICATION_DETAIL_CHARS = 2_000
MAX_VERSIONS = 32
MAX_SECRET_CHARS = 128


def qualification_from_hello(hello: fpb.Hello) -> Qualification:
    q = hello.qualification
    if len(q.detail) > MAX_QUALIFICATION_DETAIL_CHARS:
        raise InvalidArgument(
            "hello.qualification.detail", f"at most {MAX_QUALIFICATION_DETAIL_CHARS} characters"
        )
    if len(q.versions) > MAX_VERSIONS:
        raise InvalidArgument("hello.qualification.versions", f"at most {MAX_VERSIONS} entries")
    for name, version in q.versions.items():
        if len(name) > 64 or len(version) > 128:
            raise InvalidArgument(
                f"hello.qualification.versions[{name[:64]!r}]",
                "names at most 64 characters, versions at most 128",
            )
    for field, value in (
        ("held_lease_secret", hello.held_lease_secret),
        ("session_token", hello.session_token),
    ):
        if len(value) > MAX_SECRET_CHARS:
            raise InvalidArgument(f"hello.{field}", f"at most {MAX_SECRET_CHARS} characters")
    return Qualification(
        passed=q.passed,
        detail=q.detail.replace("\x00", ""),
        tflops=q.tflops if math.isfinite(q.tflops) else 0.0,
        free_memory_mb=q.free_memory_mb,
        free_disk_mb=q.free_disk_mb,
        versions=dict(q.versions),
    )


@dataclass(frozen=True, kw_only=True)
class HeartbeatReport:
    lease: LeaseRef | None  # None: an idle worker saying it is alive
    step: int
    loss: float | None
    learning_rate: float | None
    seconds_per_step: float | None
    # The worker's word on its step running compiled (None: it did not say).
    step_compiled: bool | None = None


def heartbeat_from_proto(hb: fpb.Heartbeat) -> HeartbeatReport:
    lease = lease_ref_from_proto(hb.lease, "heartbeat.lease") if hb.lease.lease_id else None
    if hb.step < 0:
        raise InvalidArgument("heartbeat.step", "must not be negative")
    if hb.seconds_per_step < 0:  # shown to the owner as the job's pace and its ETA
        raise InvalidArgument("heartbeat.seconds_per_step", "must not be negative")
    return HeartbeatReport(
        lease=lease,
        step=hb.step,
        loss=finite_or_none(hb.loss),
        learning_rate=finite_or_none(hb.learning_rate),
        seconds_per_step=finite_or_none(hb.seconds_per_step),
        step_compiled=hb.step_compiled if hb.HasField("step_compiled") else None,
    )


# What a worker may say it holds (Ready.warm): enough for a node that compiled each shape its
# jobs train, small enough that matching it stays a cheap array test in the claim.
MAX_WARM_SHAPES = 16
MAX_WARM_KEY_CHARS = 512
# A checkpoint that takes longer than an hour to stall and upload is no figure to plan by.
MAX_CHECKPOINT_COST_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class ReadyReport:
    warm: WarmState
    checkpoint_cost_s: float | None  # None: not measured yet


def _warm_key(value: str, field: str) -> str:
    if len(value) > MAX_WARM_KEY_CHARS:
        raise InvalidArgument(field, f"at most {MAX_WARM_KEY_CHARS} characters")
    if "\x00" in value:
        raise InvalidArgument(field, "must not contain NUL characters")
    return value


def _warm_keys(values: Sequence[str], field: str) -> tuple[str, ...]:
    if len(values) > MAX_WARM_SHAPES:
        raise InvalidArgument(field, f"at most {MAX_WARM_SHAPES} shapes")
    return tuple(dict.fromkeys(_warm_key(v, f"{field}[{i}]") for i, v in enumerate(values)))


def ready_from_proto(msg: fpb.Ready) -> ReadyReport:
    cost = msg.checkpoint_cost_s
    if not math.isfinite(cost) or not 0 <= cost <= MAX_CHECKPOINT_COST_S:
        raise InvalidArgument(
            "ready.checkpoint_cost_s", f"must be between 0 and {MAX_CHECKPOINT_COST_S:g} seconds"
        )
    return ReadyReport(
        warm=WarmState(
            resident=_warm_key(msg.warm.resident, "ready.warm.resident"),
            compiled_shapes=_warm_keys(msg.warm.compiled_shapes, "ready.warm.compiled_shapes"),
            adapter_shapes=_warm_keys(msg.warm.adapter_shapes, "ready.warm.adapter_shapes"),
        ),
        checkpoint_cost_s=cost or None,
    )


@dataclass(frozen=True, kw_only=True)
class WorkerHello:
    """A Hello, checked: the machine, its qualification, and what it asks to resume."""

    machine: Machine
    qualification: Qualification
    session_token: str  # the previous stream's, when reconnecting; else ""
    held_lease: LeaseRef | None
    held_lease_secret: str
    identity: IdentityProof


def hello_from_proto(hello: fpb.Hello) -> WorkerHello:
    machine = machine_from_hello(hello)
    qualification = qualification_from_hello(hello)
    held = None
    if hello.held_lease.lease_id:
        held = lease_ref_from_proto(hello.held_lease, "hello.held_lease")
    return WorkerHello(
        machine=machine,
        qualification=qualification,
        session_token=hello.session_token,
        held_lease=held,
        held_lease_secret=hello.held_lease_secret,
        identity=identity_proof_from_hello(hello),
    )


# Upload URLs one UrlsRequested may ask for (a batch of images, or one checkpoint).
MAX_SLOTS_PER_REQUEST = 64


@dataclass(frozen=True, kw_only=True)
class UrlsRequest:
    lease: LeaseRef
    # Kept as sent: the reply names each slot beside its URL, and each is checked against the
    # job (upload_slot_key) when its URL is signed.
    slots: tuple[fpb.UploadSlot, ...]


def urls_request_from_proto(req: fpb.UrlsRequested) -> UrlsRequest:
    ref = lease_ref_from_proto(req.lease, "urls_requested.lease")
    if not 1 <= len(req.slots) <= MAX_SLOTS_PER_REQUEST:
        raise InvalidArgument(
            "urls_requested.slots", f"must hold 1 to {MAX_SLOTS_PER_REQUEST} slots"
        )
    return UrlsRequest(lease=ref, slots=tuple(req.slots))


@dataclass(frozen=True, kw_only=True)
class CheckpointReport:
    lease: LeaseRef
    checkpoint: Checkpoint


def checkpoint_report_from_proto(msg: fpb.CheckpointCommitted) -> CheckpointReport:
    ref = lease_ref_from_proto(msg.lease, "checkpoint_committed.lease")
    return CheckpointReport(lease=ref, checkpoint=checkpoint_from_commit(msg))


@dataclass(frozen=True, kw_only=True)
class SuccessReport:
    lease: LeaseRef
    result: JobResult
    step: int
    loss: float | None


def success_report_from_proto(msg: fpb.JobSucceeded) -> SuccessReport:
    ref = lease_ref_from_proto(msg.lease, "job_succeeded.lease")
    return SuccessReport(
        lease=ref, result=result_from_success(msg), step=msg.step, loss=finite_or_none(msg.loss)
    )


@dataclass(frozen=True, kw_only=True)
class FailureReport:
    lease: LeaseRef
    failure_class: FailureClass
    message: str


def failure_report_from_proto(msg: fpb.JobFailed) -> FailureReport:
    ref = lease_ref_from_proto(msg.lease, "job_failed.lease")
    failure_class = failure_class_from_proto(msg.failure_class, "job_failed.failure_class")
    message = worker_text(msg.message, 4000) or "no message"
    return FailureReport(lease=ref, failure_class=failure_class, message=message)


@dataclass(frozen=True, kw_only=True)
class DrainingReport:
    lease: LeaseRef | None  # None: an idle worker leaving
    reason: str


def draining_report_from_proto(msg: fpb.Draining) -> DrainingReport:
    ref = lease_ref_from_proto(msg.lease, "draining.lease") if msg.lease.lease_id else None
    return DrainingReport(lease=ref, reason=worker_text(msg.reason, 500))


@dataclass(frozen=True, kw_only=True)
class NoticeReport:
    lease: LeaseRef | None  # None: about no lease
    message: str


def notice_report_from_proto(msg: fpb.Notice) -> NoticeReport:
    ref = lease_ref_from_proto(msg.lease, "notice.lease") if msg.lease.lease_id else None
    return NoticeReport(lease=ref, message=worker_text(msg.message, 2000))


@dataclass(frozen=True, kw_only=True)
class SamplesReport:
    lease: LeaseRef
    images: tuple[StoredImage, ...]


def samples_report_from_proto(msg: fpb.SamplesStored) -> SamplesReport:
    ref = lease_ref_from_proto(msg.lease, "samples_stored.lease")
    return SamplesReport(lease=ref, images=tuple(stored_images_from_proto(msg)))


def upload_slot_key(
    slot: fpb.UploadSlot, job_id: str, epoch: int, spec: JobSpec, field: str
) -> str:
    """The one key a slot of this lease may write (the worker names no keys itself), within
    what the job can produce: steps up to max_train_steps, class images up to
    num_class_images (with prior preservation only)."""
    if not 0 <= slot.step <= spec.max_train_steps:
        raise InvalidArgument(
            f"{field}.step", f"must be 0 to max_train_steps ({spec.max_train_steps})"
        )
    if slot.index < 0:
        raise InvalidArgument(f"{field}.index", "must not be negative")
    if slot.kind == fpb.ARTIFACT_KIND_CHECKPOINT:
        if slot.step == 0:
            raise InvalidArgument(f"{field}.step", "a checkpoint's step must be positive")
        return checkpoint_key(job_id, slot.step, epoch)
    if slot.kind == fpb.ARTIFACT_KIND_VALIDATION_IMAGE:
        # Validation images are made by sample tasks, each writing only its own keys: a
        # training lease stores none (nor could it fill the job's prefix with them).
        raise InvalidArgument(
            f"{field}.kind", "validation images are stored by sample tasks, not training leases"
        )
    if slot.kind == fpb.ARTIFACT_KIND_CLASS_IMAGE:
        if not spec.with_prior_preservation:
            raise InvalidArgument(f"{field}.kind", "the job trains without prior preservation")
        if slot.index >= spec.num_class_images:
            raise InvalidArgument(
                f"{field}.index", f"must be below num_class_images ({spec.num_class_images})"
            )
        return class_image_key(job_id, slot.index, epoch)
    if slot.kind == fpb.ARTIFACT_KIND_RESULT:
        formats = result_formats(spec.output_format)
        if slot.index >= len(formats):
            raise InvalidArgument(
                f"{field}.index",
                f"must be below {len(formats)} (output_format {spec.output_format})",
            )
        return result_key(job_id, epoch, formats[slot.index])
    raise InvalidArgument(f"{field}.kind", "unknown artifact kind")


def _check_object(field: str, size_bytes: int, sha256: str) -> None:
    if size_bytes <= 0:
        raise InvalidArgument(f"{field}.size_bytes", "must be positive")
    if not _SHA256.fullmatch(sha256):
        raise InvalidArgument(f"{field}.sha256", "must be 64 lowercase hex digits")


def checkpoint_from_commit(msg: fpb.CheckpointCommitted) -> Checkpoint:
    """The checkpoint a CheckpointCommitted announces, its fields checked; its key is checked
    against the sender's lease by `check_checkpoint_key` (only a lease holder's is)."""
    if msg.step <= 0:
        raise InvalidArgument("checkpoint_committed.step", "must be positive")
    _check_object("checkpoint_committed", msg.size_bytes, msg.sha256)
    return Checkpoint(
        step=msg.step,
        epoch=msg.lease.epoch,
        key=msg.key,
        size_bytes=msg.size_bytes,
        sha256=msg.sha256,
    )


def check_checkpoint_key(checkpoint: Checkpoint, job_id: str) -> None:
    """A lease writes its checkpoint only at the one key of its job, step and epoch."""
    expected = checkpoint_key(job_id, checkpoint.step, checkpoint.epoch)
    if checkpoint.key != expected:
        raise InvalidArgument("checkpoint_committed.key", f"must be {expected!r}")


# Class images one ClassImagesCommitted may name: a worker announces them per generated batch.
MAX_CLASS_IMAGES_PER_MESSAGE = 64


@dataclass(frozen=True, kw_only=True)
class ClassImagesReport:
    lease: LeaseRef
    images: tuple[ClassImage, ...]


def class_images_report_from_proto(msg: fpb.ClassImagesCommitted) -> ClassImagesReport:
    """The class images a ClassImagesCommitted announces, their fields checked, no index named
    twice; their keys are checked against the sender's lease by `check_class_image_keys`."""
    ref = lease_ref_from_proto(msg.lease, "class_images_committed.lease")
    if not msg.images:
        raise InvalidArgument("class_images_committed.images", "must name at least one image")
    if len(msg.images) > MAX_CLASS_IMAGES_PER_MESSAGE:
        raise InvalidArgument(
            "class_images_committed.images", f"at most {MAX_CLASS_IMAGES_PER_MESSAGE} at once"
        )
    images: list[ClassImage] = []
    seen: set[int] = set()
    for n, image in enumerate(msg.images):
        field = f"class_images_committed.images[{n}]"
        _check_object(field, image.size_bytes, image.sha256)
        if image.index in seen:
            raise InvalidArgument(f"{field}.index", "names an image twice")
        seen.add(image.index)
        images.append(
            ClassImage(
                index=image.index,
                epoch=ref.epoch,
                key=image.key,
                size_bytes=image.size_bytes,
                sha256=image.sha256,
            )
        )
    return ClassImagesReport(lease=ref, images=tuple(images))


def check_class_image_keys(images: Sequence[ClassImage], job_id: str, spec: JobSpec) -> None:
    """A lease announces class images only where it could store them (prior preservation,
    indices below num_class_images), each at the one key of its job, index and epoch."""
    for n, image in enumerate(images):
        field = f"class_images_committed.images[{n}]"
        if not spec.with_prior_preservation:
            raise InvalidArgument(field, "the job trains without prior preservation")
        if not 0 <= image.index < spec.num_class_images:
            raise InvalidArgument(
                f"{field}.index", f"must be 0 to num_class_images - 1 ({spec.num_class_images - 1})"
            )
        expected = class_image_key(job_id, image.index, image.epoch)
        if image.key != expected:
            raise InvalidArgument(f"{field}.key", f"must be {expected!r}")


def class_image_to_proto(image: ClassImage) -> fpb.ClassImage:
    return fpb.ClassImage(
        index=image.index, key=image.key, size_bytes=image.size_bytes, sha256=image.sha256
    )


def result_from_success(msg: fpb.JobSucceeded) -> JobResult:
    """The result a JobSucceeded announces, its fields checked: the file of the job's main
    format and, with output_format both, the kohya file beside it. Its keys are checked against
    the sender's lease by `check_result_keys`."""
    _check_object("job_succeeded", msg.size_bytes, msg.sha256)
    kohya = None
    if msg.HasField("kohya"):
        _check_object("job_succeeded.kohya", msg.kohya.size_bytes, msg.kohya.sha256)
        if msg.kohya.HasField("kohya"):
            raise InvalidArgument("job_succeeded.kohya.kohya", "must be empty")
        kohya = JobResult(
            key=msg.kohya.key, size_bytes=msg.kohya.size_bytes, sha256=msg.kohya.sha256
        )
    return JobResult(key=msg.key, size_bytes=msg.size_bytes, sha256=msg.sha256, kohya=kohya)


def check_result_keys(result: JobResult, job_id: str, epoch: int, output_format: str) -> None:
    """Each result file at its own key of the job and epoch, and exactly the files the job's
    output_format asks for (a kohya file it did not ask for is refused)."""
    main, *others = result_formats(output_format)
    expected = result_key(job_id, epoch, main)
    if result.key != expected:
        raise InvalidArgument("job_succeeded.key", f"must be {expected!r}")
    if result.kohya is not None:
        if "kohya" not in others:
            raise InvalidArgument(
                "job_succeeded.kohya", f"the job's output_format is {output_format}"
            )
        expected = result_key(job_id, epoch, "kohya")
        if result.kohya.key != expected:
            raise InvalidArgument("job_succeeded.kohya.key", f"must be {expected!r}")
    elif others:
        raise InvalidArgument("job_succeeded.kohya", "is required by output_format both")


def worker_text(value: str, max_chars: int) -> str:
    """Free text from a worker (a reason, an error), cut and without NULs, fit for the ledger."""
    return value.replace("\x00", "")[:max_chars]


# Sample tasks ----------------------------------------------------------------------


def sample_settings_to_proto(settings: SampleSettings) -> fpb.SampleSettings:
    return fpb.SampleSettings(
        prompts=list(settings.prompts),
        negative_prompt=settings.negative_prompt,
        guidance_scale=settings.guidance_scale,
        inference_steps=settings.inference_steps,
        seed=settings.seed,
        resolution=settings.resolution,
        images_per_prompt=settings.images_per_prompt,
    )


def sample_settings_from_proto(msg: fpb.SampleSettings) -> SampleSettings:
    return SampleSettings(
        prompts=tuple(msg.prompts),
        negative_prompt=msg.negative_prompt,
        guidance_scale=msg.guidance_scale,
        inference_steps=msg.inference_steps,
        seed=msg.seed,
        resolution=msg.resolution,
        images_per_prompt=msg.images_per_prompt,
    )


def sample_slots(settings: SampleSettings) -> list[tuple[int, int]]:
    """(prompt index, image index) of every image a task makes, prompts first."""
    return [(p, i) for p in range(len(settings.prompts)) for i in range(settings.images_per_prompt)]


def stored_images_from_proto(msg: fpb.SamplesStored) -> list[StoredImage]:
    """The images a SamplesStored announces, their fields checked, none named twice; their keys
    are checked against the sender's task by `check_stored_images`."""
    images: list[StoredImage] = []
    seen: set[tuple[int, int]] = set()
    for n, image in enumerate(msg.images):
        field = f"samples_stored.images[{n}]"
        _check_object(field, image.size_bytes, image.sha256)
        slot = (image.prompt_index, image.image_index)
        if slot in seen:
            raise InvalidArgument(f"{field}", "names an image twice")
        seen.add(slot)
        images.append(
            StoredImage(
                prompt_index=image.prompt_index,
                image_index=image.image_index,
                key=image.key,
                size_bytes=image.size_bytes,
                sha256=image.sha256,
            )
        )
    return images


def check_stored_images(images: Sequence[StoredImage], task: SampleTask) -> None:
    """Every image of the task, each at its own key, and no other."""
    expected = {
        (p, i): sample_image_key(task.job_id, task.step, task.task_id, task.epoch, p, i)
        for p, i in sample_slots(task.settings)
    }
    for n, image in enumerate(images):
        if expected.get((image.prompt_index, image.image_index)) != image.key:
            raise InvalidArgument(
                f"samples_stored.images[{n}].key", "is not one of the task's image keys"
            )
    if {(image.prompt_index, image.image_index) for image in images} != set(expected):
        raise InvalidArgument("samples_stored.images", f"must name all {len(expected)} images")
