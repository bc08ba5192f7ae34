"""The job spec as a domain value: every default filled in, every field checked.

The scheduler stores `JobSpec.to_dict()` in the ledger and hands workers the same explicit spec,
so a worker never guesses a default. Field names equal the `lorafleet.jobs.v1.JobSpec` proto's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from lorafleet.core.errors import InvalidArgument

LrSchedulerName = Literal[
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
]
MixedPrecisionName = Literal["no", "fp16", "bf16"]
CaptionModeName = Literal["file_else_prompt", "instance_prompt"]
WebhookEventName = Literal["checkpoint", "succeeded", "failed", "canceled", "samples"]
OptimizerName = Literal["adamw", "adamw_8bit", "prodigy"]
OutputFormatName = Literal["diffusers", "kohya", "both"]

DEFAULT_BASE_MODEL = "stabilityai/stable-diffusion-xl-base-1.0"
MAX_TRAIN_STEPS = 100_000
MAX_LABELS = 32
MAX_PROMPT_CHARS = 2_000
MAX_PREFIX_CHARS = 512
MAX_MODEL_REF_CHARS = 512
# Validation images: prompts per job (or request) and images per prompt and step.
MAX_SAMPLE_PROMPTS = 16
MAX_SAMPLE_IMAGES = 16
_LABEL_KEY = re.compile(r"[a-z0-9_.\-]{1,63}")
# Storage prefixes and file names: plain relative paths, no "." or ".." segments.
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]{1,255}")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    instance_prompt: str
    instance_data_prefix: str
    max_train_steps: int
    class_prompt: str = ""
    class_data_prefix: str = ""
    with_prior_preservation: bool = False
    prior_loss_weight: float = 1.0
    num_class_images: int = 100
    learning_rate: float = 1e-4
    train_text_encoder: bool = False
    text_encoder_learning_rate: float = 5e-6
    lr_scheduler: LrSchedulerName = "constant"
    lr_warmup_steps: int = 0
    lr_num_cycles: int = 1
    lr_power: float = 1.0
    train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    use_8bit_adam: bool = False
    mixed_precision: MixedPrecisionName = "no"
    resolution: int = 1024
    center_crop: bool = False
    random_flip: bool = False
    lora_rank: int = 4
    lora_alpha: float = 4.0
    snr_gamma: float = 0.0
    noise_offset: float = 0.0
    caption_mode: CaptionModeName = "file_else_prompt"
    checkpointing_steps: int = 100
    validation_prompt: str = ""
    validation_steps: int = 0
    seed: int = 0
    base_model: str = DEFAULT_BASE_MODEL
    vae_model: str = ""
    min_vram_mb: int = 0
    priority: int = 0
    max_failures: int = 3
    labels: Mapping[str, str] = field(default_factory=dict)
    webhook_url: str = ""
    webhook_events: tuple[WebhookEventName, ...] = ()
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optimizer: OptimizerName = "adamw"
    prodigy_d_coef: float = 1.0
    prodigy_safeguard_warmup: bool = True
    prodigy_use_bias_correction: bool = True
    use_dora: bool = False
    lora_dropout: float = 0.0
    repeats: int = 1
    aspect_ratio_bucketing: bool = False
    output_format: OutputFormatName = "diffusers"
    validation_prompts: tuple[str, ...] = ()
    validation_negative_prompt: str = ""
    validation_guidance_scale: float = 5.0
    validation_inference_steps: int = 30
    num_validation_images: int = 4

    def __post_init__(self) -> None:
        check_spec(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form stored in the ledger."""
        out = dataclasses.asdict(self)
        out["labels"] = dict(self.labels)
        out["webhook_events"] = list(self.webhook_events)
        out["validation_prompts"] = list(self.validation_prompts)
        return out

    def for_worker(self) -> JobSpec:
        """What a worker is told: the spec without the owner's webhook (for many receivers the
        URL is itself the credential) and labels, which training never reads. Workers are
        strangers' machines (DESIGN.md, "Trust")."""
        return dataclasses.replace(self, labels={}, webhook_url="", webhook_events=())

    @property
    def sample_prompts(self) -> tuple[str, ...]:
        """The prompts of the job's validation images: `validation_prompt` (when set) first."""
        head = (self.validation_prompt,) if self.validation_prompt else ()
        return head + tuple(self.validation_prompts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Inverse of `to_dict`; unknown keys (from a newer version) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if "webhook_events" in kwargs:
            kwargs["webhook_events"] = tuple(kwargs["webhook_events"])
        if "validation_prompts" in kwargs:
            kwargs["validation_prompts"] = tuple(kwargs["validation_prompts"])
        return cls(**kwargs)


def check_path(field_name: str, value: str, *, max_chars: int = MAX_PREFIX_CHARS) -> None:
    """A storage prefix or relative file name: `a/b/c`, no empty, "." or ".." segments."""
    if not value:
        raise InvalidArgument(field_name, "must not be empty")
    if len(value) > max_chars:
        raise InvalidArgument(field_name, f"must be at most {max_chars} characters")
    for segment in value.strip("/").split("/") if value.endswith("/") else value.split("/"):
        if segment in (".", "..") or not _PATH_SEGMENT.fullmatch(segment):
            raise InvalidArgument(
                field_name,
                "must be a relative path of segments made of letters, digits, '_', '.', '-'"
                f" (got {value!r})",
            )


def _check_text(field_name: str, value: str, *, max_chars: int, required: bool = False) -> None:
    if required and not value.strip():
        raise InvalidArgument(field_name, "is required")
    if len(value) > max_chars:
        raise InvalidArgument(field_name, f"must be at most {max_chars} characters")
    if "\x00" in value:
        raise InvalidArgument(field_name, "must not contain NUL characters")


def _check_range(field_name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(field_name, "must be a finite number")
    if not low <= value <= high:
        raise InvalidArgument(field_name, f"must be between {low:g} and {high:g} (got {value:g})")


def _check_positive(field_name: str, value: float, high: float) -> None:
    if not math.isfinite(value) or value <= 0 or value > high:
        raise InvalidArgument(field_name, f"must be greater than 0 and at most {high:g}")


def check_spec(spec: JobSpec) -> None:
    """Raises InvalidArgument naming the first bad field. Pure: touches no storage."""
    _check_text("instance_prompt", spec.instance_prompt, max_chars=MAX_PROMPT_CHARS, required=True)
    check_path("instance_data_prefix", spec.instance_data_prefix)
    _check_text("class_prompt", spec.class_prompt, max_chars=MAX_PROMPT_CHARS)
    if spec.class_data_prefix:
        check_path("class_data_prefix", spec.class_data_prefix)
    if spec.with_prior_preservation and not spec.class_prompt.strip():
        raise InvalidArgument("class_prompt", "is required with prior preservation")
    _check_positive("prior_loss_weight", spec.prior_loss_weight, 100.0)
    _check_range("num_class_images", spec.num_class_images, 1, 10_000)
    _check_range("max_train_steps", spec.max_train_steps, 1, MAX_TRAIN_STEPS)
    _check_positive("learning_rate", spec.learning_rate, 1.0)
    _check_positive("text_encoder_learning_rate", spec.text_encoder_learning_rate, 1.0)
    if spec.lr_scheduler not in get_args(LrSchedulerName):
        raise InvalidArgument("lr_scheduler", f"unknown scheduler {spec.lr_scheduler!r}")
    _check_range("lr_warmup_steps", spec.lr_warmup_steps, 0, spec.max_train_steps)
    _check_range("lr_num_cycles", spec.lr_num_cycles, 1, 1_000)
    _check_positive("lr_power", spec.lr_power, 100.0)
    _check_range("train_batch_size", spec.train_batch_size, 1, 64)
    _check_range("gradient_accumulation_steps", spec.gradient_accumulation_steps, 1, 1_024)
    if spec.mixed_precision not in get_args(MixedPrecisionName):
        raise InvalidArgument("mixed_precision", f"unknown precision {spec.mixed_precision!r}")
    _check_range("resolution", spec.resolution, 64, 2_048)
    if spec.resolution % 8:
        raise InvalidArgument("resolution", "must be a multiple of 8")
    _check_range("lora_rank", spec.lora_rank, 1, 256)
    _check_positive("lora_alpha", spec.lora_alpha, 4_096.0)
    _check_range("snr_gamma", spec.snr_gamma, 0.0, 100.0)
    _check_range("noise_offset", spec.noise_offset, 0.0, 1.0)
    if spec.caption_mode not in get_args(CaptionModeName):
        raise InvalidArgument("caption_mode", f"unknown caption mode {spec.caption_mode!r}")
    _check_range("checkpointing_steps", spec.checkpointing_steps, 1, MAX_TRAIN_STEPS)
    _check_text("validation_prompt", spec.validation_prompt, max_chars=MAX_PROMPT_CHARS)
    _check_range("validation_steps", spec.validation_steps, 0, MAX_TRAIN_STEPS)
    _check_range("seed", spec.seed, 0, 2**32 - 1)
    _check_text("base_model", spec.base_model, max_chars=MAX_MODEL_REF_CHARS, required=True)
    _check_text("vae_model", spec.vae_model, max_chars=MAX_MODEL_REF_CHARS)
    _check_range("min_vram_mb", spec.min_vram_mb, 0, 1_048_576)
    _check_range("priority", spec.priority, -100, 100)
    _check_range("max_failures", spec.max_failures, 1, 100)
    if len(spec.labels) > MAX_LABELS:
        raise InvalidArgument("labels", f"at most {MAX_LABELS} labels")
    for key, value in spec.labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise InvalidArgument(f"labels[{key!r}]", "key must match [a-z0-9_.-]{1,63}")
        _check_text(f"labels[{key!r}]", value, max_chars=255)
    if spec.webhook_url:
        _check_text("webhook.url", spec.webhook_url, max_chars=2_048)
        if not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", spec.webhook_url):
            raise InvalidArgument("webhook.url", "must be an http:// or https:// URL")
    elif spec.webhook_events:
        raise InvalidArgument("webhook.events", "needs webhook.url")
    for event in spec.webhook_events:
        if event not in get_args(WebhookEventName):
            raise InvalidArgument("webhook.events", f"unknown event {event!r}")
    _check_range("adam_beta1", spec.adam_beta1, 0.0, 0.999_999)
    _check_range("adam_beta2", spec.adam_beta2, 0.0, 0.999_999_9)
    _check_range("adam_weight_decay", spec.adam_weight_decay, 0.0, 10.0)
    _check_positive("adam_epsilon", spec.adam_epsilon, 1.0)
    _check_positive("max_grad_norm", spec.max_grad_norm, 1e6)
    if spec.optimizer not in get_args(OptimizerName):
        raise InvalidArgument(
            "optimizer",
            f"unknown optimizer {spec.optimizer!r} (use {', '.join(get_args(OptimizerName))})",
        )
    if spec.use_8bit_adam and spec.optimizer == "prodigy":
        raise InvalidArgument(
            "use_8bit_adam", "is an AdamW option; it cannot be combined with optimizer prodigy"
        )
    _check_positive("prodigy_d_coef", spec.prodigy_d_coef, 1_000.0)
    _check_range("lora_dropout", spec.lora_dropout, 0.0, 0.9)
    _check_range("repeats", spec.repeats, 1, 1_000)
    if spec.output_format not in get_args(OutputFormatName):
        raise InvalidArgument(
            "output_format",
            f"unknown output format {spec.output_format!r}"
            f" (use {', '.join(get_args(OutputFormatName))})",
        )
    if spec.output_format != "diffusers" and spec.use_dora:
        raise InvalidArgument(
            "output_format", "the kohya format holds no DoRA adapters; use diffusers with use_dora"
        )
    check_sample_settings(
        prompts=spec.validation_prompts,
        negative_prompt=spec.validation_negative_prompt,
        guidance_scale=spec.validation_guidance_scale,
        inference_steps=spec.validation_inference_steps,
        num_images=spec.num_validation_images,
        prefix="validation_",
    )
    if len(spec.sample_prompts) > MAX_SAMPLE_PROMPTS:
        raise InvalidArgument(
            "validation_prompts", f"at most {MAX_SAMPLE_PROMPTS} prompts with validation_prompt"
        )


def check_sample_settings(
    *,
    prompts: tuple[str, ...],
    negative_prompt: str,
    guidance_scale: float,
    inference_steps: int,
    num_images: int,
    prefix: str,
) -> None:
    """Validation images' settings, in a job spec (`prefix` "validation_") or a request."""
    if len(prompts) > MAX_SAMPLE_PROMPTS:
        raise InvalidArgument(f"{prefix}prompts", f"at most {MAX_SAMPLE_PROMPTS} prompts")
    for i, prompt in enumerate(prompts):
        _check_text(f"{prefix}prompts[{i}]", prompt, max_chars=MAX_PROMPT_CHARS, required=True)
    _check_text(f"{prefix}negative_prompt", negative_prompt, max_chars=MAX_PROMPT_CHARS)
    _check_range(f"{prefix}guidance_scale", guidance_scale, 0.0, 50.0)
    _check_range(f"{prefix}inference_steps", inference_steps, 1, 200)
    name = "num_validation_images" if prefix == "validation_" else f"{prefix}num_images"
    _check_range(name, num_images, 1, MAX_SAMPLE_IMAGES)
