"""What the fleet knows of each model family without loading a model: names, the pipelines that
mark them, the public variants it can size, and a conservative memory estimate per job shape.

The trainer's behaviour per family (loading, prompt encoding, objective, LoRA targets, outputs)
lives with the worker (`lorafleet.worker.training.families`); this module holds only the facts
the scheduler and the clients need too, so that neither imports torch (docs/DESIGN.md,
"Model families").

A family is read from the model itself: the `_class_name` of its `model_index.json` names its
pipeline, and `PIPELINES` maps pipelines to families. The scheduler never sees a model, so a
spec's `model_family` (or, with `auto`, the public variant its `base_model` names) is what it
sizes and keys figures by; the worker checks that against the model's own `model_index.json`
and fails the job as an input fault, naming `base_model`, when they disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FamilyName = Literal["sdxl", "flux", "flux2"]
FAMILIES: tuple[FamilyName, ...] = ("sdxl", "flux", "flux2")
# The family a spec with `model_family: auto` and a base model no variant below names is sized
# and keyed as: the fleet's first family, which every spec written before families existed is.
DEFAULT_FAMILY: FamilyName = "sdxl"

# model_index.json `_class_name` -> family. A pipeline absent here is no family lorafleet trains.
PIPELINES: dict[str, FamilyName] = {
    "StableDiffusionXLPipeline": "sdxl",
    "FluxPipeline": "flux",
    "Flux2KleinPipeline": "flux2",
}
# Pipelines of a known kind that lorafleet refuses, with the reason a user reads.
REFUSED_PIPELINES: dict[str, str] = {
    "Flux2Pipeline": (
        "FLUX.2 [dev] needs a 24 B Mistral text encoder that no 24 GB node can hold beside its"
        " 32 B transformer; train FLUX.2 [klein] (4 B or 9 B) instead"
    ),
}

QuantizationName = Literal["none", "nf4", "fp8"]
# Bytes a frozen weight takes per parameter, by base quantization (NF4 with its double-quantised
# absmax blocks is ~0.53 bytes; fp8 one byte; none: the mixed-precision dtype, 2 bytes).
_WEIGHT_BYTES = {"nf4": 0.56, "fp8": 1.0, "none": 2.0}


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A public base model the scheduler can size: parameter counts in billions, activation
    memory in GB per megapixel of one image (docs/BENCHMARKS.md, "Model families on a GPU")."""

    family: FamilyName
    hub_ids: tuple[str, ...]
    denoiser_b: float
    text_encoders_b: float
    vae_b: float
    # LoRA parameters per unit of rank with the family's default targets, in millions.
    lora_m_per_rank: float
    # Activations (and what the steps hold beside the weights) per megapixel, with and without
    # gradient checkpointing.
    activations_gb_per_mp: tuple[float, float]


# Activations: measured on an H100 at 1024 px, rank 16 (FLUX.1-dev NF4 with checkpointing 4.9,
# klein 4B 1.9 with and 15.5 without), each rounded up by about 10%; the others are scaled from
# those by the transformer's blocks (a double block counted twice) and width, and marked so
# until measured; SDXL's are published figures.
VARIANTS: tuple[Variant, ...] = (
    Variant(
        family="sdxl",
        hub_ids=("stabilityai/stable-diffusion-xl-base-1.0",),
        denoiser_b=2.57,
        text_encoders_b=0.82,
        vae_b=0.084,
        lora_m_per_rank=0.73,
        activations_gb_per_mp=(1.0, 8.0),
    ),
    Variant(
        family="flux",
        hub_ids=("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell"),
        denoiser_b=11.9,
        text_encoders_b=4.88,
        vae_b=0.084,
        lora_m_per_rank=1.17,
        # Without checkpointing: klein 4B's 15.5 x 76/30 block-equivalents (scaled).
        activations_gb_per_mp=(5.5, 40.0),
    ),
    Variant(
        family="flux2",
        hub_ids=("black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-base-4B"),
        denoiser_b=3.9,
        text_encoders_b=4.0,
        vae_b=0.084,
        lora_m_per_rank=0.6,
        activations_gb_per_mp=(2.2, 17.0),
    ),
    Variant(
        family="flux2",
        hub_ids=("black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-klein-base-9B"),
        denoiser_b=9.1,
        text_encoders_b=8.2,
        vae_b=0.084,
        lora_m_per_rank=1.0,
        # klein 4B's x 40/30 block-equivalents x 4096/3072 width (scaled).
        activations_gb_per_mp=(3.8, 30.0),
    ),
)
_BY_HUB_ID = {hub_id.lower(): v for v in VARIANTS for hub_id in v.hub_ids}
# Hub ids of pipelines lorafleet refuses (REFUSED_PIPELINES), so that submit refuses them too.
REFUSED_HUB_IDS: dict[str, str] = {
    "black-forest-labs/flux.2-dev": REFUSED_PIPELINES["Flux2Pipeline"],
}

# CUDA context, allocator slack and workspace.
_OVERHEAD_GIB = 1.5


def variant_for(base_model: str) -> Variant | None:
    """The public variant `base_model` names, if the fleet knows it."""
    return _BY_HUB_ID.get(base_model.strip().lower())


def family_for(model_family: str, base_model: str) -> FamilyName:
    """The family a spec trains: the one it names, else its known variant's, else
    DEFAULT_FAMILY (the worker checks it against the model)."""
    if model_family in FAMILIES:
        return model_family
    variant = variant_for(base_model)
    return variant.family if variant is not None else DEFAULT_FAMILY


def estimate_vram_mb(
    *,
    base_model: str,
    resolution: int,
    batch_size: int,
    lora_rank: int,
    quantization: str,
    gradient_checkpointing: bool,
    train_text_encoder: bool,
    mixed_precision: str,
) -> int | None:
    """A conservative peak of accelerator memory for a job, in MiB; None for a base model the
    fleet cannot size (a local folder, an unknown hub id: then only `min_vram_mb` filters).

    The peak is the larger of two phases: encoding the prompts (the denoiser, text encoders and
    VAE resident: a worker keeps its denoiser on the device between jobs, and the measured peak
    of the FLUX families' default jobs is this phase), and training (frozen denoiser at its
    quantization, VAE, LoRA weights with their gradient and two AdamW moments in fp32,
    activations per megapixel, text encoders only when trained, or always for SDXL, whose
    encoders stay on the device)."""
    variant = variant_for(base_model)
    if variant is None:
        return None
    dense = 4.0 if mixed_precision == "no" else 2.0
    per_weight = dense if quantization == "none" else _WEIGHT_BYTES[quantization]
    denoiser = variant.denoiser_b * per_weight
    encoders = variant.text_encoders_b * dense
    vae = variant.vae_b * dense
    lora = variant.lora_m_per_rank * lora_rank * 16 / 1000  # GB: fp32 weight, grad, 2 moments
    with_gc, without_gc = variant.activations_gb_per_mp
    megapixels = batch_size * resolution * resolution / 1_000_000
    activations = megapixels * (with_gc if gradient_checkpointing else without_gc)
    keeps_encoders = train_text_encoder or variant.family == "sdxl"
    training = denoiser + vae + lora + activations + (encoders if keeps_encoders else 0.0)
    encoding = denoiser + encoders + vae
    gib = max(training, encoding) * 1e9 / 2**30 + _OVERHEAD_GIB
    return int(gib * 1024 + 0.5)
