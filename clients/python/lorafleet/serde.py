"""The one place that converts protos to domain values and back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from lorafleet.errors import InvalidArgument
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.model import (
    Checkpoint,
    EventKind,
    FailureClass,
    Job,
    JobEvent,
    JobResult,
    JobState,
    Progress,
)
from lorafleet.spec import (
    DEFAULT_BASE_MODEL,
    CaptionModeName,
    JobSpec,
    LrSchedulerName,
    MixedPrecisionName,
    WebhookEventName,
)

_K = TypeVar("_K")
_V = TypeVar("_V")

LR_SCHEDULERS: dict[int, LrSchedulerName] = {
    pb.LR_SCHEDULER_UNSPECIFIED: "constant",
    pb.LR_SCHEDULER_CONSTANT: "constant",
    pb.LR_SCHEDULER_CONSTANT_WITH_WARMUP: "constant_with_warmup",
    pb.LR_SCHEDULER_LINEAR: "linear",
    pb.LR_SCHEDULER_COSINE: "cosine",
    pb.LR_SCHEDULER_COSINE_WITH_RESTARTS: "cosine_with_restarts",
    pb.LR_SCHEDULER_POLYNOMIAL: "polynomial",
}
MIXED_PRECISIONS: dict[int, MixedPrecisionName] = {
    pb.MIXED_PRECISION_UNSPECIFIED: "no",
    pb.MIXED_PRECISION_NO: "no",
    pb.MIXED_PRECISION_FP16: "fp16",
    pb.MIXED_PRECISION_BF16: "bf16",
}
CAPTION_MODES: dict[int, CaptionModeName] = {
    pb.CAPTION_MODE_UNSPECIFIED: "file_else_prompt",
    pb.CAPTION_MODE_FILE_ELSE_PROMPT: "file_else_prompt",
    pb.CAPTION_MODE_INSTANCE_PROMPT: "instance_prompt",
}
WEBHOOK_EVENTS: dict[int, WebhookEventName] = {
    pb.WEBHOOK_EVENT_CHECKPOINT: "checkpoint",
    pb.WEBHOOK_EVENT_SUCCEEDED: "succeeded",
    pb.WEBHOOK_EVENT_FAILED: "failed",
    pb.WEBHOOK_EVENT_CANCELED: "canceled",
}


def _lookup(table: dict[int, _V], value: int, field: str) -> _V:
    try:
        return table[value]
    except KeyError:
        raise InvalidArgument(field, f"unknown enum value {value}") from None


def _inverse(table: dict[int, _V]) -> dict[_V, int]:
    # The UNSPECIFIED alias (0) maps to the same name as the explicit value; keep the explicit one.
    out: dict[_V, int] = {}
    for number, name in sorted(table.items()):
        out[name] = number
    return out


def _or_default(value: _K, default: _K) -> _K:
    return value if value else default


def spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    """Fills defaults for zero values and validates; raises InvalidArgument naming the field."""
    rank = _or_default(msg.lora_rank, 4)
    fields: dict[str, Any] = dict(
        instance_prompt=msg.instance_prompt,
        instance_data_prefix=msg.instance_data_prefix,
        max_train_steps=msg.max_train_steps,
        class_prompt=msg.class_prompt,
        class_data_prefix=msg.class_data_prefix,
        with_prior_preservation=msg.with_prior_preservation,
        prior_loss_weight=_or_default(msg.prior_loss_weight, 1.0),
        num_class_images=_or_default(msg.num_class_images, 100),
        learning_rate=_or_default(msg.learning_rate, 1e-4),
        train_text_encoder=msg.train_text_encoder,
        text_encoder_learning_rate=_or_default(msg.text_encoder_learning_rate, 5e-6),
        lr_scheduler=_lookup(LR_SCHEDULERS, msg.lr_scheduler, "lr_scheduler"),
        lr_warmup_steps=msg.lr_warmup_steps,
        lr_num_cycles=_or_default(msg.lr_num_cycles, 1),
        lr_power=_or_default(msg.lr_power, 1.0),
        train_batch_size=_or_default(msg.train_batch_size, 1),
        gradient_accumulation_steps=_or_default(msg.gradient_accumulation_steps, 1),
        gradient_checkpointing=msg.gradient_checkpointing,
        use_8bit_adam=msg.use_8bit_adam,
        mixed_precision=_lookup(MIXED_PRECISIONS, msg.mixed_precision, "mixed_precision"),
        resolution=_or_default(msg.resolution, 1024),
        center_crop=msg.center_crop,
        random_flip=msg.random_flip,
        lora_rank=rank,
        lora_alpha=_or_default(msg.lora_alpha, float(rank)),
        snr_gamma=msg.snr_gamma,
        noise_offset=msg.noise_offset,
        caption_mode=_lookup(CAPTION_MODES, msg.caption_mode, "caption_mode"),
        checkpointing_steps=_or_default(msg.checkpointing_steps, 100),
        validation_prompt=msg.validation_prompt,
        validation_steps=msg.validation_steps,
        seed=msg.seed,
        base_model=_or_default(msg.base_model, DEFAULT_BASE_MODEL),
        vae_model=msg.vae_model,
        min_vram_mb=msg.min_vram_mb,
        priority=msg.priority,
        max_failures=_or_default(msg.max_failures, 3),
        labels=dict(msg.labels),
        webhook_url=msg.webhook.url,
        webhook_events=tuple(
            _lookup(WEBHOOK_EVENTS, e, "webhook.events") for e in msg.webhook.events
        ),
        adam_beta1=_or_default(msg.adam_beta1, 0.9),
        adam_beta2=_or_default(msg.adam_beta2, 0.999),
        adam_weight_decay=_or_default(msg.adam_weight_decay, 1e-2),
        adam_epsilon=_or_default(msg.adam_epsilon, 1e-8),
        max_grad_norm=_or_default(msg.max_grad_norm, 1.0),
    )
    return JobSpec(**fields)


def spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    data = spec.to_dict()
    webhook_url = data.pop("webhook_url")
    webhook_events = data.pop("webhook_events")
    labels = data.pop("labels")
    data["lr_scheduler"] = _inverse(LR_SCHEDULERS)[spec.lr_scheduler]
    data["mixed_precision"] = _inverse(MIXED_PRECISIONS)[spec.mixed_precision]
    data["caption_mode"] = _inverse(CAPTION_MODES)[spec.caption_mode]
    msg = pb.JobSpec(**data, labels=labels)
    if webhook_url:
        inverse = _inverse(WEBHOOK_EVENTS)
        msg.webhook.url = webhook_url
        msg.webhook.events.extend(pb.WebhookEvent.ValueType(inverse[e]) for e in webhook_events)
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
    )
    if job.latest_checkpoint is not None:
        msg.latest_checkpoint.CopyFrom(checkpoint_to_proto(job.latest_checkpoint))
    if job.result is not None:
        msg.result.CopyFrom(
            pb.JobResult(
                key=job.result.key, size_bytes=job.result.size_bytes, sha256=job.result.sha256
            )
        )
    if job.failure_class is not None:
        msg.failure_class = FAILURE_CLASSES[job.failure_class]
    return msg


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
        progress=Progress(
            step=p.step,
            max_steps=p.max_steps,
            loss=p.loss if p.updated_at.seconds else None,
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
        result=(
            JobResult(
                key=msg.result.key, size_bytes=msg.result.size_bytes, sha256=msg.result.sha256
            )
            if msg.HasField("result")
            else None
        ),
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
