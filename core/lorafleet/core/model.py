"""Domain values shared by the scheduler, the SDK and the CLI (frozen, keyword-only)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lorafleet.core.spec import JobShape, JobSpec


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
    NOTICE = "NOTICE"
    SAMPLES = "SAMPLES"
    SAMPLES_FAILED = "SAMPLES_FAILED"
    SAMPLES_STARTED = "SAMPLES_STARTED"


# Text-encoder training costs about half a step more.
_TEXT_ENCODER_FACTOR = 1.5
# The fastest pace a verified observation may show, in seconds per 1024x1024 image step: about
# five times faster than an H100 trains an SDXL LoRA (~0.25 s). An observation faster than this,
# scaled to its shape, is a holder committing tiny checkpoints or garbage results, not training.
MIN_PLAUSIBLE_S_PER_STEP = 0.05


def shape_seconds_per_step(
    base: float,
    *,
    resolution: int,
    batch_size: int,
    gradient_accumulation_steps: int = 1,
    train_text_encoder: bool = False,
) -> float:
    """`base` seconds per 1024x1024 image step, scaled to a job shape: by pixels and images per
    optimizer step, and 1.5 with text-encoder training (priors and plausibility floors)."""
    images = batch_size * max(gradient_accumulation_steps, 1)
    factor = _TEXT_ENCODER_FACTOR if train_text_encoder else 1.0
    return base * (resolution / 1024) ** 2 * images * factor


# A step's time beside an SDXL step of the same pixels and images, per model family, and what
# gradient checkpointing and a quantized frozen base add. Estimates, not lorafleet's own
# measurements: FLUX.1-dev's QLoRA recipe (nf4, checkpointing, 1024 px) runs 3.5 s a step on an
# RTX 4090 where SDXL runs 0.7 to 1 s, which is ~2.4x once checkpointing and nf4 are taken out;
# FLUX.2 [klein] (4 B and 9 B transformers) is put between the two. Gradient checkpointing:
# 0.51 s eager without it, 0.75 to 0.92 s with it, measured for SDXL on an H200.
# Dequantizing an nf4 base costs about a third more. Each errs slow, as the base prior does
# (a prior that is too fast lets a spend limit be overrun). Used only where the fleet has
# measured nothing (priors) and to scale the plausibility floor; precision is left out (every
# figure above is mixed precision, and the default fp32 jobs were priced at the base before).
FAMILY_STEP_FACTOR: Mapping[str, float] = {"sdxl": 1.0, "flux": 2.5, "flux2": 2.0}
GRADIENT_CHECKPOINTING_STEP_FACTOR = 1.8
QUANTIZED_BASE_STEP_FACTOR: Mapping[str, float] = {"none": 1.0, "nf4": 1.35, "fp8": 1.0}


def shape_prior_seconds(base: float, shape: JobShape) -> float:
    """`base` seconds per 1024x1024 SDXL image step, scaled to a job shape (`JobSpec.shape`):
    pixels, images per optimizer step and text-encoder training (`shape_seconds_per_step`),
    then the family, gradient checkpointing and the base's quantization (the factors above).
    The one rule for priors and plausibility floors."""
    factor = FAMILY_STEP_FACTOR.get(shape.family, max(FAMILY_STEP_FACTOR.values()))
    if shape.gradient_checkpointing:
        factor *= GRADIENT_CHECKPOINTING_STEP_FACTOR
    factor *= QUANTIZED_BASE_STEP_FACTOR.get(shape.quantization, 1.0)
    return factor * shape_seconds_per_step(
        base,
        resolution=shape.resolution,
        batch_size=shape.batch_size,
        gradient_accumulation_steps=shape.accumulation,
        train_text_encoder=shape.train_text_encoder,
    )


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """EstimateJob's answer: what a job would take on this fleet, from verified completions of
    jobs of its shape. 0 means unknown or none, as on the wire: `seconds_per_step`, `seconds`
    and `dollars` while fewer than the operator's minimum of machines finished one (`samples`),
    `price_per_gpu_hour` and `dollars` with no price configured, `spend_limit_dollars` for a
    key without a limit."""

    seconds_per_step: float
    samples: int
    seconds: float
    price_per_gpu_hour: float
    dollars: float
    spend_limit_dollars: float
    spent_dollars: float

    @property
    def known(self) -> bool:
        return self.samples > 0


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
class ClassImage:
    """A generated prior-preservation class image a lease stored and announced: recorded by
    the ledger once the store held exactly these bytes, and given to the job's later holders."""

    index: int
    epoch: int
    key: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class JobResult:
    """The stored LoRA: the diffusers file, or the kohya one when the job's output_format is
    kohya; with output_format both, `kohya` is the kohya file stored beside the diffusers one."""

    key: str
    size_bytes: int
    sha256: str
    kohya: JobResult | None = None

    @property
    def files(self) -> dict[str, JobResult]:
        """Every result file by its format ("diffusers", "kohya")."""
        out = {result_format(self.key): dataclasses.replace(self, kohya=None)}
        if self.kohya is not None:
            out["kohya"] = self.kohya
        return out


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
    # Failed attempts the job is not blamed for (node faults, stalls, errors from machines not
    # in good standing), and the bound on them; `failures` counts only what it is blamed for.
    node_faults: int = 0
    max_node_faults: int = 0
    # Why a QUEUED job waits after an attempt ended (its newest attempt failed, drained or
    # expired, and what that means: another machine, or a second machine's confirmation of an
    # input fault); None while it runs, once it is final, and before its first attempt. Known on
    # reads (get, list, watch), derived from the job's events, so nothing has to clear it.
    waiting_reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class LeaseRef:
    """What a worker names a lease by: the fencing token (lease id, epoch)."""

    lease_id: str
    epoch: int


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
class Qualification:
    """What a worker reported about its node at Hello (stored with the machine as JSON)."""

    passed: bool
    detail: str
    tflops: float
    free_memory_mb: int
    free_disk_mb: int
    versions: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "detail": self.detail,
            "tflops": self.tflops,
            "free_memory_mb": self.free_memory_mb,
            "free_disk_mb": self.free_disk_mb,
            "versions": dict(self.versions),
        }


@dataclass(frozen=True, kw_only=True)
class WarmState:
    """What a worker holds from earlier leases, as it says (unverified): the resident base
    model (`JobSpec.resident_key`; "" for none), the compiled step shapes
    (`JobSpec.compiled_shape_key`) and the parked adapter shapes (`JobSpec.adapter_shape_key`)."""

    resident: str = ""
    compiled_shapes: tuple[str, ...] = ()
    adapter_shapes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Machine:
    machine_id: str
    provider_instance_id: str
    gpu_model: str
    # Memory a job can use, MiB (the GPU's; a CPU worker's host memory): claims filter by it.
    vram_mb: int
    qualified: bool
    version: str
    # The model families its trainer serves (Hello.families; an older worker: sdxl only).
    families: tuple[str, ...] = ("sdxl",)


@dataclass(frozen=True, kw_only=True)
class IdentityProof:
    """A Hello's proof of which machine the worker runs on: at most one kind is set (none: the
    machine is unverified). The scheduler's identity module checks it."""

    salad_jwt: str = ""
    ec2_document: bytes = b""
    ec2_signature: bytes = b""
    local_token: str = ""

    @property
    def present(self) -> bool:
        return bool(self.salad_jwt or self.ec2_document or self.local_token)


# A checkpoint object's first bytes: this magic (its last byte the format version), then the
# sha256 of the rest, then a safetensors file. Written by the worker (training/checkpoint.py),
# checked by the scheduler before it records one (scheduler/formats.py).
CHECKPOINT_MAGIC = b"LFCKPT\x00\x01"
CHECKPOINT_DIGEST_BYTES = 32


def checkpoint_key(job_id: str, step: int, epoch: int) -> str:
    """`jobs/<job_id>/checkpoints/<step>-e<epoch>`: two epochs never collide (docs/DESIGN.md,
    "Checkpoints")."""
    return f"jobs/{job_id}/checkpoints/{step}-e{epoch}"


RESULT_FILE_NAMES = {
    "diffusers": "pytorch_lora_weights.safetensors",
    "kohya": "pytorch_lora_weights_kohya.safetensors",
}


def result_key(job_id: str, epoch: int, fmt: str = "diffusers") -> str:
    # Per epoch, so a fenced-off stale holder can never overwrite the recorded result.
    return f"jobs/{job_id}/result/e{epoch}/{RESULT_FILE_NAMES[fmt]}"


def result_format(key: str) -> str:
    """ "kohya" for a kohya-format result key, else "diffusers"."""
    return "kohya" if key.endswith("/" + RESULT_FILE_NAMES["kohya"]) else "diffusers"


def result_formats(output_format: str) -> tuple[str, ...]:
    """The files a job's output_format asks for, the main one (JobUrls.result_upload) first."""
    return {"diffusers": ("diffusers",), "kohya": ("kohya",)}.get(
        output_format, ("diffusers", "kohya")
    )


def validation_image_key(job_id: str, step: int, epoch: int, index: int) -> str:
    return f"jobs/{job_id}/validation/{step}-e{epoch}-{index}.png"


def sample_image_key(
    job_id: str, step: int, task_id: str, epoch: int, prompt_index: int, image_index: int
) -> str:
    """A validation image made by a sample task: by step, then by the task's lease
    epoch, so a fenced-off holder can never overwrite what the recorded one stored."""
    return f"jobs/{job_id}/samples/{step}/{task_id}-e{epoch}/p{prompt_index}-i{image_index}.png"


@dataclass(frozen=True, kw_only=True)
class SampleSettings:
    """Everything a validation image depends on besides the LoRA weights: any worker given
    the same settings and weights makes the same images (seeded CPU generators)."""

    prompts: tuple[str, ...]
    negative_prompt: str
    guidance_scale: float
    inference_steps: int
    seed: int
    resolution: int
    images_per_prompt: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": list(self.prompts),
            "negative_prompt": self.negative_prompt,
            "guidance_scale": self.guidance_scale,
            "inference_steps": self.inference_steps,
            "seed": self.seed,
            "resolution": self.resolution,
            "images_per_prompt": self.images_per_prompt,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SampleSettings:
        return cls(
            prompts=tuple(str(p) for p in data["prompts"]),
            negative_prompt=str(data.get("negative_prompt", "")),
            guidance_scale=float(data["guidance_scale"]),
            inference_steps=int(data["inference_steps"]),
            seed=int(data["seed"]),
            resolution=int(data["resolution"]),
            images_per_prompt=int(data["images_per_prompt"]),
        )


@dataclass(frozen=True, kw_only=True)
class StoredImage:
    prompt_index: int
    image_index: int
    key: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class SampleTask:
    """A job's validation images at one step, leased to a worker like a job."""

    task_id: str
    job_id: str
    owner: str
    step: int
    weights_key: str
    weights_sha256: str
    weights_is_checkpoint: bool
    settings: SampleSettings
    state: str
    epoch: int
    lease_id: str | None
    machine_id: str | None
    failures: int = 0
    images: tuple[StoredImage, ...] = ()
    error: str | None = None
    busy_seconds: float = 0.0
    spec: JobSpec | None = None
    traceparent: str | None = None


def class_image_key(job_id: str, index: int, epoch: int) -> str:
    """Keyed per lease like checkpoints (`<index>-e<epoch>`): a holder writes only its own
    epoch's keys, so nothing it stores is read by a later holder unless the ledger recorded it."""
    return f"jobs/{job_id}/class_images/{index:05d}-e{epoch}.png"


def upload_key(owner: str, prefix: str, name: str = "") -> str:
    """Where an owner's uploaded training data lives; specs name prefixes relative to it."""
    base = f"uploads/{owner}/{prefix.strip('/')}"
    return f"{base}/{name}" if name else f"{base}/"
