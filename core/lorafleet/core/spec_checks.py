"""The checks of a job spec's values, once each is in its field's type: every JobSpec runs
`check_spec` as it is made, so a spec that exists is a valid one. Pure: touches no storage.

- `check_field`: one value against its field's declaration in core/spec.py (`spec_field`'s
  bounds: a range, greater than 0, a multiple, a text's length, a storage path);
- `check_spec`: each field's declared checks, then what spans fields or items: labels, the
  webhook, the optimizer, what means nothing for the model family (`_check_family`) and the
  validation prompts;
- `check_path` and `check_sample_settings`: the same rules for what a request carries beside a
  spec (an upload's prefix and file names, a sample request's settings).

Each raises InvalidArgument naming the first bad field. The checks read the declaration
(`SPEC_FIELDS`), so core/spec.py imports this module only where a JobSpec is made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.families import REFUSED_HUB_IDS, VARIANTS, variant_for
from lorafleet.core.spec import (
    DEFAULT_BASE_MODEL,
    MAX_PROMPT_CHARS,
    SPEC_FIELD,
    SPEC_FIELDS,
    JobSpec,
    SpecField,
)

MAX_LABELS = 32
MAX_PREFIX_CHARS = 512
# Validation prompts per job (or request); images per prompt and step are the declaration's.
MAX_SAMPLE_PROMPTS = 16
_LABEL_KEY = re.compile(r"[a-z0-9_.\-]{1,63}")
# Storage prefixes and file names: plain relative paths, no "." or ".." segments.
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]{1,255}")


def check_field(
    declared: SpecField, value: Any, spec: JobSpec | None = None, *, name: str = ""
) -> None:
    """One value against its field's declaration (`spec_field`'s bounds); `name` reports it
    under another field name, and `spec` gives a bound that names a field (lr_warmup_steps's
    `high="max_train_steps"`)."""
    name = name or declared.name
    if declared.kind == "text":
        if declared.path:
            if value or declared.required:
                check_path(name, value)
        elif declared.max_chars is not None:
            _check_text(name, value, max_chars=declared.max_chars, required=declared.required)
    if declared.kind in ("int", "float") and declared.high is not None:
        high = float(
            getattr(spec, declared.high) if isinstance(declared.high, str) else declared.high
        )
        if declared.positive:
            _check_positive(name, value, high)
        else:
            assert declared.low is not None
            _check_range(name, value, declared.low, high)
        if declared.multiple_of and value % declared.multiple_of:
            raise InvalidArgument(name, f"must be a multiple of {declared.multiple_of}")


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
    """Raises InvalidArgument naming the first bad field. Pure: touches no storage.

    Each field's declared checks in turn, then what spans fields or items."""
    for f in SPEC_FIELDS:
        check_field(f, getattr(spec, f.name), spec)
    if spec.with_prior_preservation and not spec.class_prompt.strip():
        raise InvalidArgument("class_prompt", "is required with prior preservation")
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
    if spec.use_8bit_adam and spec.optimizer == "prodigy":
        raise InvalidArgument(
            "use_8bit_adam", "is an AdamW option; it cannot be combined with optimizer prodigy"
        )
    _check_family(spec)
    if spec.output_format != "diffusers" and spec.use_dora:
        raise InvalidArgument(
            "output_format", "the kohya format holds no DoRA adapters; use diffusers with use_dora"
        )
    _check_prompts("validation_prompts", spec.validation_prompts)
    if len(spec.sample_prompts) > MAX_SAMPLE_PROMPTS:
        raise InvalidArgument(
            "validation_prompts", f"at most {MAX_SAMPLE_PROMPTS} prompts with validation_prompt"
        )


# The flow-matching families' image side: their VAEs' latents (1/8 of the side) are packed in
# 2x2 patches, so diffusers' FluxPipeline and Flux2KleinPipeline need a multiple of
# vae_scale_factor * 2. Refused at submit, not once a worker has loaded the model (the worker
# checks it again against the model's own VAE).
_FLOW_RESOLUTION_MULTIPLE = 16

# Fields of the flow-matching families that mean nothing for SDXL's DDPM objective.
_FLOW_ONLY = (
    "guidance_scale",
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "max_sequence_length",
)


def _check_family(spec: JobSpec) -> None:
    """Refuses, naming the field, what means nothing for the job's family (never ignored)."""
    refused = REFUSED_HUB_IDS.get(spec.base_model.strip().lower())
    if refused is not None:
        raise InvalidArgument("base_model", refused)
    family = spec.family
    variant = variant_for(spec.base_model)
    if variant is not None and variant.family != family:
        if spec.base_model == DEFAULT_BASE_MODEL:
            # Not named: the default is SDXL's, which the user never chose.
            examples = ", ".join(h for v in VARIANTS if v.family == family for h in v.hub_ids)
            raise InvalidArgument(
                "base_model",
                f"model_family {family} needs a base model of that family (a hub id, or the"
                f" absolute path of a diffusers folder on the workers), e.g. {examples}",
            )
        raise InvalidArgument(
            "base_model",
            f"{spec.base_model!r} is a model of family {variant.family}; model_family says"
            f" {family}",
        )
    if family == "sdxl":
        for name in _FLOW_ONLY:
            if getattr(spec, name) != SPEC_FIELD[name].default:
                raise InvalidArgument(
                    name, "applies to the flow-matching families (flux, flux2), not sdxl"
                )
        return
    if spec.resolution % _FLOW_RESOLUTION_MULTIPLE:
        raise InvalidArgument(
            "resolution",
            f"the {family} family needs a multiple of {_FLOW_RESOLUTION_MULTIPLE} pixels"
            f" (got {spec.resolution})",
        )
    for name, reason in (
        ("snr_gamma", "min-SNR weighting is for DDPM objectives; use weighting_scheme"),
        ("noise_offset", "offset noise is for DDPM objectives"),
    ):
        if getattr(spec, name) != SPEC_FIELD[name].default:
            raise InvalidArgument(name, f"means nothing for the {family} family: {reason}")
    if family == "flux2":
        if spec.guidance_scale != SPEC_FIELD["guidance_scale"].default:
            # Every flux2 model lorafleet trains is a klein (FLUX.2 [dev], which embeds guidance,
            # is refused): refused here, not on the worker once it loaded the model.
            raise InvalidArgument(
                "guidance_scale",
                "FLUX.2 [klein]'s transformer has no guidance embedding: leave it 0",
            )
        for name in ("train_text_encoder", "text_encoder_learning_rate"):
            if getattr(spec, name) != SPEC_FIELD[name].default:
                raise InvalidArgument(
                    name,
                    "FLUX.2 [klein]'s text encoder is a Qwen3 language model that stays frozen;"
                    " lorafleet trains the transformer only",
                )
    if family == "flux2" and spec.validation_negative_prompt:
        raise InvalidArgument("validation_negative_prompt", FLUX2_NEGATIVE_PROMPT)
    for name, scheme in (
        ("logit_mean", "logit_normal"),
        ("logit_std", "logit_normal"),
        ("mode_scale", "mode"),
    ):
        if getattr(spec, name) != SPEC_FIELD[name].default and spec.weighting_scheme != scheme:
            raise InvalidArgument(name, f"applies to weighting_scheme {scheme} only")


# Flux2KleinPipeline takes no negative prompt text (only precomputed embeddings).
FLUX2_NEGATIVE_PROMPT = "FLUX.2 [klein]'s pipeline takes no negative prompt; leave it empty"


def _check_prompts(field_name: str, prompts: tuple[str, ...]) -> None:
    if len(prompts) > MAX_SAMPLE_PROMPTS:
        raise InvalidArgument(field_name, f"at most {MAX_SAMPLE_PROMPTS} prompts")
    for i, prompt in enumerate(prompts):
        _check_text(f"{field_name}[{i}]", prompt, max_chars=MAX_PROMPT_CHARS, required=True)


# A sample request's fields (RequestSamples) and the job spec fields whose types and bounds
# each takes; zero or empty means the job's own setting.
SAMPLE_REQUEST_FIELDS = {
    "negative_prompt": "validation_negative_prompt",
    "guidance_scale": "validation_guidance_scale",
    "inference_steps": "validation_inference_steps",
    "num_images": "num_validation_images",
    "seed": "seed",
    "steps": "max_train_steps",
}


def check_sample_settings(
    *,
    prompts: tuple[str, ...],
    negative_prompt: str,
    guidance_scale: float,
    inference_steps: int,
    num_images: int,
    seed: int,
    steps: Sequence[int],
    prefix: str,
) -> None:
    """A sample request's settings (`prefix` names its fields), each with the bounds of the job
    spec field it stands in for (`SAMPLE_REQUEST_FIELDS`)."""
    _check_prompts(f"{prefix}prompts", prompts)
    for name, value in (
        ("negative_prompt", negative_prompt),
        ("guidance_scale", guidance_scale),
        ("inference_steps", inference_steps),
        ("num_images", num_images),
        ("seed", seed),
    ):
        check_field(SPEC_FIELD[SAMPLE_REQUEST_FIELDS[name]], value, name=f"{prefix}{name}")
    if len(steps) > 64:
        raise InvalidArgument(f"{prefix}steps", "at most 64 steps")
    for step in steps:
        check_field(SPEC_FIELD[SAMPLE_REQUEST_FIELDS["steps"]], step, name=f"{prefix}steps")
