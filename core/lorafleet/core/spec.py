"""The job spec's declaration, as a domain value: every default filled in, every field checked.

The scheduler stores `JobSpec.to_dict()` in the ledger and hands workers the same explicit spec,
so a worker never guesses a default. Field names equal the `lorafleet.jobs.v1.JobSpec` proto's.

Each field is declared once, below, with `spec_field`: its default, its help, its bounds, whether
it changes what is trained and the spec revision it appeared in (`SpecField`; `SPEC_FIELDS` holds
them all, `SPEC_FIELD` by name). Everything else reads that declaration:

- the conversion of a given value to the field's type (core/spec_values.py, `typed_value`;
  `spec_value` here by the field's name), which JobSpec runs on every value;
- the checks of the values (core/spec_checks.py, `check_spec`), which JobSpec runs next;
- proto conversion (`serde.spec_from_proto` and `spec_to_proto`), the CLI's flags and help, the
  resume fingerprint's fields (`JobSpec.fingerprint_values`) and the README's table (a test
  compares them).

Here too: what a spec's values make of it (`JobSpec.family`, its `shape` as a `JobShape`, the
keys a worker's warm state is matched by). Adding a plain field takes the proto field, its line
here and the code that uses it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal, TypeVar, dataclass_transform, get_args, get_origin, overload

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.families import FamilyName, family_for
from lorafleet.core.spec_values import typed_value

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
ModelFamilyChoice = Literal["auto", "sdxl", "flux", "flux2"]
WeightingSchemeName = Literal["none", "sigma_sqrt", "logit_normal", "mode", "cosmap"]
BaseQuantizationName = Literal["none", "nf4", "fp8"]

DEFAULT_BASE_MODEL = "stabilityai/stable-diffusion-xl-base-1.0"
MAX_TRAIN_STEPS = 100_000
MAX_PROMPT_CHARS = 2_000
MAX_MODEL_REF_CHARS = 512
# Validation images per prompt and step (prompts per job: spec_checks.MAX_SAMPLE_PROMPTS).
MAX_SAMPLE_IMAGES = 16

# checkpointing_steps 0: the scheduler chooses each lease's interval (scheduler's
# checkpoint_interval.py) and the grant carries it; a worker never trains with 0.
CHECKPOINTING_AUTO = 0

# Revisions of the spec's field set, a field's `since`. 1: the fields of the first checkpoint
# format. 2: the optimizer choice and Prodigy, DoRA, LoRA dropout, repeats, aspect-ratio
# bucketing, output formats and the sample tasks' validation settings. 3: scale_lr. 4: the
# model families (model_family, guidance_scale, weighting_scheme and its parameters,
# max_sequence_length, base_quantization).
# A field that trains and came after revision 1 enters the resume fingerprint only when set
# away from its default, so that a checkpoint written before it existed still resumes.
SPEC_REVISION = 4

FieldKind = Literal["bool", "int", "float", "text", "choice", "texts", "choices", "map"]
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class SpecField:
    """One JobSpec field as declared with `spec_field`; `SPEC_FIELDS` holds them all.

    Bounds: `low`..`high` inclusive (`high` may name another field, e.g. max_train_steps), or
    with `positive` greater than 0 and at most `high`; text: at most `max_chars`, or a storage
    path with `path`; `required` refuses an empty text. `spec_checks.check_field` checks them;
    `spec_values.typed_value` converts a value to the field's `kind`.
    """

    help: str
    # Changes the trained weights: a checkpoint trained with another value does not resume.
    trains: bool
    since: int = 1
    low: float | None = None
    high: float | str | None = None
    positive: bool = False
    multiple_of: int | None = None
    max_chars: int | None = None
    path: bool = False
    required: bool = False
    # False where the help itself says the default (lora_alpha: the rank when unset).
    show_default: bool = True
    # The word for an int field's 0 where 0 means a choice made later (checkpointing_steps:
    # "auto"): the CLI takes it, help and docs show it.
    zero: str = ""
    # The CLI flag, where it is not the field's name (labels and webhooks have flags of their
    # own; the CLI builds those by hand).
    flag: str = ""
    # Filled in from the class by `_describe`.
    name: str = ""
    kind: FieldKind = "text"
    choices: tuple[str, ...] = ()
    has_default: bool = False
    default: Any = None

    @property
    def shown_default(self) -> str | None:
        """The default as help and docs show it; None where they show none."""
        if not self.has_default or not self.show_default:
            return None
        value = self.default
        if isinstance(value, bool):
            return "on" if value else "off"
        if value == "":
            return "empty"
        if isinstance(value, float):
            return f"{value:g}"
        if value == 0 and self.zero:
            return self.zero
        if isinstance(value, (tuple, dict)):
            return "none" if not value else str(value)
        return str(value)


@overload
def spec_field(*, default: _T, help: str, trains: bool, **checks: Any) -> _T: ...
@overload
def spec_field(
    *, default_factory: Callable[[], _T], help: str, trains: bool, **checks: Any
) -> _T: ...
@overload
def spec_field(*, help: str, trains: bool, **checks: Any) -> Any: ...
def spec_field(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    help: str,
    trains: bool,
    **checks: Any,
) -> Any:
    """A JobSpec field: its default and its `SpecField` declaration (help, bounds, ...)."""
    info = SpecField(help=help, trains=trains, **checks)
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"spec": info}
    )


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(spec_field,))
def _spec_class(cls: type[_T]) -> type[_T]:
    return dataclass(frozen=True, kw_only=True)(cls)


@_spec_class
class JobSpec:
    instance_prompt: str = spec_field(
        help="the prompt with the rare token, e.g. 'a photo of sks dog' (required)",
        trains=True,
        max_chars=MAX_PROMPT_CHARS,
        required=True,
    )
    instance_data_prefix: str = spec_field(
        help="storage prefix holding the images (set by --images/--images-zip/--images-url)",
        trains=False,
        path=True,
        required=True,
    )
    class_prompt: str = spec_field(
        default="",
        help="e.g. 'a photo of a dog'; required with --with-prior-preservation",
        trains=True,
        max_chars=MAX_PROMPT_CHARS,
    )
    class_data_prefix: str = spec_field(
        default="",
        help="storage prefix of class images; empty: generate them with the base model",
        trains=False,
        path=True,
    )
    with_prior_preservation: bool = spec_field(
        default=False, help="train on class images too, against language drift", trains=True
    )
    prior_loss_weight: float = spec_field(
        default=1.0,
        help="weight of the prior-preservation loss",
        trains=True,
        positive=True,
        high=100.0,
    )
    num_class_images: int = spec_field(
        default=100,
        help="class images to use (generated when missing)",
        trains=True,
        low=1,
        high=10_000,
    )
    max_train_steps: int = spec_field(
        help="optimizer steps, 1..100000 (required)", trains=True, low=1, high=MAX_TRAIN_STEPS
    )
    learning_rate: float = spec_field(
        default=1e-4,
        help="UNet LoRA learning rate (> 0; with prodigy use 1.0)",
        trains=True,
        positive=True,
        high=1.0,
    )
    train_text_encoder: bool = spec_field(
        default=False, help="train LoRAs on both text encoders too", trains=True
    )
    text_encoder_learning_rate: float = spec_field(
        default=5e-6,
        help="text encoders' learning rate (> 0)",
        trains=True,
        positive=True,
        high=1.0,
    )
    lr_scheduler: LrSchedulerName = spec_field(
        default="constant", help="learning-rate schedule", trains=True
    )
    lr_warmup_steps: int = spec_field(
        default=0,
        help="warmup steps, 0..max-train-steps",
        trains=True,
        low=0,
        high="max_train_steps",
    )
    lr_num_cycles: int = spec_field(
        default=1, help="cycles of cosine_with_restarts", trains=True, low=1, high=1_000
    )
    lr_power: float = spec_field(
        default=1.0,
        help="power of the polynomial schedule",
        trains=True,
        positive=True,
        high=100.0,
    )
    train_batch_size: int = spec_field(
        default=1, help="images per step, 1..64", trains=True, low=1, high=64
    )
    gradient_accumulation_steps: int = spec_field(
        default=1,
        help="micro-batches per optimizer step, 1..1024",
        trains=True,
        low=1,
        high=1_024,
    )
    gradient_checkpointing: bool = spec_field(
        default=False, help="recompute activations to save memory (slower)", trains=True
    )
    use_8bit_adam: bool = spec_field(
        default=False,
        help="bitsandbytes AdamW8bit (CUDA only); same as --optimizer adamw_8bit",
        trains=True,
    )
    mixed_precision: MixedPrecisionName = spec_field(
        default="no", help="no, fp16 or bf16", trains=True
    )
    resolution: int = spec_field(
        default=1024,
        help="square training resolution in pixels, a multiple of 8 (16 for flux and flux2),"
        " 64..2048",
        trains=True,
        low=64,
        high=2_048,
        multiple_of=8,
    )
    center_crop: bool = spec_field(
        default=False, help="center-crop instead of a random crop", trains=True
    )
    random_flip: bool = spec_field(
        default=False, help="flip images horizontally at random", trains=True
    )
    lora_rank: int = spec_field(default=4, help="LoRA rank, 1..256", trains=True, low=1, high=256)
    # An unset proto lora_alpha follows the rank (serde); 4.0 is the default rank's.
    lora_alpha: float = spec_field(
        default=4.0,
        help="LoRA alpha (> 0; default: equal to the rank)",
        trains=True,
        positive=True,
        high=4_096.0,
        show_default=False,
    )
    snr_gamma: float = spec_field(
        default=0.0,
        help="min-SNR weighting gamma (5.0 is the usual value); 0 turns it off",
        trains=True,
        low=0.0,
        high=100.0,
    )
    noise_offset: float = spec_field(
        default=0.0, help="noise offset, 0..1; 0 turns it off", trains=True, low=0.0, high=1.0
    )
    caption_mode: CaptionModeName = spec_field(
        default="file_else_prompt",
        help="file_else_prompt: name.txt beside an image, else the instance prompt;"
        " instance_prompt: always the prompt",
        trains=True,
    )
    checkpointing_steps: int = spec_field(
        default=CHECKPOINTING_AUTO,
        help="steps between checkpoints; auto (0): chosen per lease from the node's checkpoint"
        " cost and its GPU class's interruption rate (Young-Daly)",
        trains=False,
        zero="auto",
        low=0,
        high=MAX_TRAIN_STEPS,
    )
    validation_prompt: str = spec_field(
        default="",
        help="prompt for validation images (made by sample tasks on the fleet, never inside the"
        " training run)",
        trains=False,
        max_chars=MAX_PROMPT_CHARS,
    )
    validation_steps: int = spec_field(
        default=0,
        help="a sample task every this many steps: at the first checkpoint at or after each"
        " multiple of it; 0: only for the result (with a prompt)",
        trains=False,
        low=0,
        high=MAX_TRAIN_STEPS,
    )
    seed: int = spec_field(
        default=0, help="random seed, 0..2^32-1", trains=True, low=0, high=2**32 - 1
    )
    base_model: str = spec_field(
        default=DEFAULT_BASE_MODEL,
        help="base model: a hub id, or a local diffusers folder on the workers (an absolute"
        " path; the demo's tiny CPU model is .lorafleet/demo-model-sdxl)",
        trains=True,
        max_chars=MAX_MODEL_REF_CHARS,
        required=True,
    )
    vae_model: str = spec_field(
        default="",
        help="a separate VAE (folder or hub id); empty: the base model's",
        trains=True,
        max_chars=MAX_MODEL_REF_CHARS,
    )
    min_vram_mb: int = spec_field(
        default=0,
        help="only machines with at least this much accelerator memory",
        trains=False,
        low=0,
        high=1_048_576,
    )
    priority: int = spec_field(
        default=0, help="-100..100, higher first", trains=False, low=-100, high=100
    )
    max_failures: int = spec_field(
        default=3,
        help="failures the job is blamed for (input faults a second machine confirms, internal"
        " errors from machines in good standing) tolerated before it fails, 1..100; node faults"
        " count apart, up to max(10, 3 x this)",
        trains=False,
        low=1,
        high=100,
    )
    # Checked in spec_checks.check_spec (keys and values); the proto's `labels` map.
    labels: Mapping[str, str] = spec_field(
        default_factory=dict,
        help="a label (repeatable)",
        trains=False,
        show_default=False,
        flag="--label",
    )
    # The proto's `webhook` message: url and events.
    webhook_url: str = spec_field(
        default="",
        help="POST signed notifications here (default: the API key's, if any)",
        trains=False,
        show_default=False,
    )
    webhook_events: tuple[WebhookEventName, ...] = spec_field(
        default=(),
        help="an event to notify (repeatable; default: all)",
        trains=False,
        show_default=False,
        flag="--webhook-event",
    )
    adam_beta1: float = spec_field(
        default=0.9, help="AdamW beta1, 0..0.999999", trains=True, low=0.0, high=0.999_999
    )
    adam_beta2: float = spec_field(
        default=0.999, help="AdamW beta2, 0..0.9999999", trains=True, low=0.0, high=0.999_999_9
    )
    adam_weight_decay: float = spec_field(
        default=1e-4,
        help="decoupled weight decay, 0..10 (diffusers' DreamBooth-LoRA script's default 1e-4;"
        " torch's AdamW default is 1e-2)",
        trains=True,
        low=0.0,
        high=10.0,
    )
    adam_epsilon: float = spec_field(
        default=1e-8, help="AdamW epsilon (> 0)", trains=True, positive=True, high=1.0
    )
    max_grad_norm: float = spec_field(
        default=1.0, help="gradient clipping norm (> 0)", trains=True, positive=True, high=1e6
    )
    optimizer: OptimizerName = spec_field(
        default="adamw",
        help="adamw, adamw_8bit (CUDA, bitsandbytes) or prodigy (prodigyopt; learns its own step"
        " size: use --learning-rate 1.0)",
        trains=True,
        since=2,
    )
    prodigy_d_coef: float = spec_field(
        default=1.0,
        help="Prodigy: scales the learned step size (0.5 is gentler)",
        trains=True,
        since=2,
        positive=True,
        high=1_000.0,
    )
    prodigy_safeguard_warmup: bool = spec_field(
        default=True,
        help="Prodigy: keep the step size from growing during LR warmup",
        trains=True,
        since=2,
    )
    prodigy_use_bias_correction: bool = spec_field(
        default=True, help="Prodigy: Adam-style bias correction", trains=True, since=2
    )
    use_dora: bool = spec_field(
        default=False,
        help="train weight-decomposed LoRA (DoRA) adapters instead of plain LoRA",
        trains=True,
        since=2,
    )
    lora_dropout: float = spec_field(
        default=0.0,
        help="dropout probability on the LoRA adapters' input, 0..0.9",
        trains=True,
        since=2,
        low=0.0,
        high=0.9,
    )
    repeats: int = spec_field(
        default=1,
        help="times each instance image appears per epoch",
        trains=True,
        since=2,
        low=1,
        high=1_000,
    )
    aspect_ratio_bucketing: bool = spec_field(
        default=False,
        help="keep each image's aspect ratio: train it in the bucket nearest its aspect (sides"
        " multiples of 64, at most resolution x resolution pixels), one bucket a batch; off crops"
        " every image to a resolution square",
        trains=True,
        since=2,
    )
    # Which files the result is written as, not what is trained.
    output_format: OutputFormatName = spec_field(
        default="diffusers",
        help="diffusers (pytorch_lora_weights.safetensors), kohya"
        " (pytorch_lora_weights_kohya.safetensors, for ComfyUI/A1111/kohya) or both;"
        " `lorafleet download --format` picks one",
        trains=False,
        since=2,
    )
    scale_lr: bool = spec_field(
        default=False,
        help="multiply --learning-rate by train-batch-size x gradient-accumulation-steps"
        " (diffusers' --scale_lr; the text encoders' rate is not scaled)",
        trains=True,
        since=3,
    )
    model_family: ModelFamilyChoice = spec_field(
        default="auto",
        help="sdxl, flux (FLUX.1 dev/schnell) or flux2 (FLUX.2 [klein] 4B/9B); auto: the family"
        " of the public base model named, else sdxl. The worker checks it against the model's"
        " model_index.json",
        trains=False,
        since=4,
    )
    guidance_scale: float = spec_field(
        default=0.0,
        help="guidance the transformer is trained with where the model embeds it (FLUX.1 dev:"
        " 3.5, the pipeline's default, when 0); flux and flux2 only",
        trains=True,
        since=4,
        low=0.0,
        high=50.0,
    )
    weighting_scheme: WeightingSchemeName = spec_field(
        default="none",
        help="flow matching's timestep sampling and loss weighting (diffusers' SD3 schemes):"
        " none (uniform), sigma_sqrt, logit_normal, mode or cosmap; flux and flux2 only",
        trains=True,
        since=4,
    )
    logit_mean: float = spec_field(
        default=0.0,
        help="logit_normal: mean of the timestep logits",
        trains=True,
        since=4,
        low=-10.0,
        high=10.0,
    )
    logit_std: float = spec_field(
        default=1.0,
        help="logit_normal: standard deviation of the timestep logits",
        trains=True,
        since=4,
        positive=True,
        high=10.0,
    )
    mode_scale: float = spec_field(
        default=1.29,
        help="mode: the scale of the mode weighting",
        trains=True,
        since=4,
        low=0.0,
        high=10.0,
    )
    max_sequence_length: int = spec_field(
        default=0,
        help="prompt tokens the language-model encoder reads (T5 or Qwen3), 1..512; 0: the"
        " pipeline's 512; flux and flux2 only",
        trains=True,
        since=4,
        low=0,
        high=512,
    )
    base_quantization: BaseQuantizationName = spec_field(
        default="none",
        help="the frozen base's weights: none (the mixed-precision dtype), nf4 (bitsandbytes"
        " 4-bit, as QLoRA) or fp8 (torchao); quantized bases need a CUDA GPU",
        trains=True,
        since=4,
    )
    # Checked in spec_checks.check_spec, with validation_prompt (at most MAX_SAMPLE_PROMPTS in all).
    validation_prompts: tuple[str, ...] = spec_field(
        default=(),
        help="more validation prompts (repeatable; after --validation-prompt)",
        trains=False,
        since=2,
        show_default=False,
    )
    validation_negative_prompt: str = spec_field(
        default="",
        help="negative prompt of validation images",
        trains=False,
        since=2,
        max_chars=MAX_PROMPT_CHARS,
    )
    validation_guidance_scale: float = spec_field(
        default=5.0,
        help="classifier-free guidance of validation images, 0..50",
        trains=False,
        since=2,
        low=0.0,
        high=50.0,
    )
    validation_inference_steps: int = spec_field(
        default=30,
        help="denoising steps of validation images, 1..200",
        trains=False,
        since=2,
        low=1,
        high=200,
    )
    num_validation_images: int = spec_field(
        default=4,
        help="validation images per prompt and step, 1..16",
        trains=False,
        since=2,
        low=1,
        high=MAX_SAMPLE_IMAGES,
    )

    def __post_init__(self) -> None:
        # Every way a spec is made (the proto, a stored spec, the SDK's keywords) takes each
        # value through the same conversion: a wrong type fails here, naming its field.
        for f in SPEC_FIELDS:
            object.__setattr__(self, f.name, typed_value(f, getattr(self, f.name)))
        # Imported here, not at the top: the checks read this module's SPEC_FIELDS as they are
        # imported, so spec_checks imports spec and spec can only import it once both exist.
        from lorafleet.core.spec_checks import check_spec

        check_spec(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form stored in the ledger."""
        out = dataclasses.asdict(self)
        for name, value in out.items():
            if isinstance(value, tuple):
                out[name] = list(value)
            elif isinstance(value, Mapping):
                out[name] = dict(value)
        return out

    def for_worker(self) -> JobSpec:
        """What a worker is told: the spec without the owner's webhook (for many receivers the
        URL is itself the credential) and labels, which training never reads. Workers are
        strangers' machines (docs/DESIGN.md, "Trust")."""
        return dataclasses.replace(self, labels={}, webhook_url="", webhook_events=())

    @property
    def sample_prompts(self) -> tuple[str, ...]:
        """The prompts of the job's validation images: `validation_prompt` (when set) first."""
        head = (self.validation_prompt,) if self.validation_prompt else ()
        return head + tuple(self.validation_prompts)

    @property
    def family(self) -> FamilyName:
        """The model family the job trains (core/families.py: named, or its known variant's)."""
        return family_for(self.model_family, self.base_model)

    @property
    def shape(self) -> JobShape:
        """What a step's time and memory depend on (docs/DESIGN.md, "Job shape")."""
        return JobShape(
            family=self.family,
            resolution=self.resolution,
            batch_size=self.train_batch_size,
            accumulation=self.gradient_accumulation_steps,
            rank=self.lora_rank,
            precision=self.mixed_precision,
            quantization=self.base_quantization,
            gradient_checkpointing=self.gradient_checkpointing,
            train_text_encoder=self.train_text_encoder,
        )

    @property
    def resident_key(self) -> str:
        """What a worker keeps loaded between leases (the frozen base model's components in
        their precision and quantization): a lease with the same key only attaches fresh
        adapters. Workers name it in Ready (WarmState.resident) and the dispatcher matches it.
        The family is the model's own, so the base model names it; a quantized base is another
        set of weights (unquantized keys keep their earlier form)."""
        key = f"{self.base_model}|{self.vae_model}|{self.mixed_precision}"
        if self.base_quantization != "none":
            key += f"|{self.base_quantization}"
        return key

    @property
    def compiled_shape_key(self) -> str:
        """The shape a compiled training step is specialised to: a lease of the same shape on
        a node that compiled it reuses the compiled step (WarmState.compiled_shapes)."""
        shape = (
            self.resolution,
            self.train_batch_size,
            self.lora_rank,
            int(self.train_text_encoder),
            int(self.gradient_checkpointing),
            int(self.use_dora),
            int(self.aspect_ratio_bucketing),
        )
        return f"{self.resident_key}|" + "x".join(str(v) for v in shape)

    @property
    def adapter_shape_key(self) -> str:
        """The adapters a lease of this spec attaches: a worker whose resident model holds
        parked adapters of this shape re-initialises them in place instead of injecting new
        ones (WarmState.adapter_shapes)."""
        return adapter_shape_key(
            self.resident_key,
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            train_text_encoder=self.train_text_encoder,
            use_dora=self.use_dora,
            dropout=self.lora_dropout,
        )

    def fingerprint_values(self, first_revision: int = 1) -> dict[str, Any]:
        """The values a checkpoint's resume fingerprint covers: the fields that train, those
        added after `first_revision` (the revision the fingerprint's format began with) only
        when set away from their default, so checkpoints older than a field keep resuming."""
        values = self.to_dict()
        return {
            f.name: values[f.name]
            for f in SPEC_FIELDS
            if f.trains and (f.since <= first_revision or getattr(self, f.name) != f.default)
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """Inverse of `to_dict`; unknown keys (from a newer version) are ignored."""
        return cls(**{k: v for k, v in data.items() if k in SPEC_FIELD})


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """A job's shape: what its step time and memory depend on, defined once. Every figure the
    fleet keys by shape (paces, estimates, slow-node comparisons, the automatic checkpoint
    interval) uses `key`; where two nodes' speeds are compared, the node's compile state is
    compared beside it (docs/DESIGN.md, "Job shape")."""

    family: FamilyName
    resolution: int
    batch_size: int
    accumulation: int
    rank: int
    precision: str
    quantization: str
    gradient_checkpointing: bool
    train_text_encoder: bool

    @property
    def key(self) -> str:
        return "|".join(
            (
                self.family,
                f"{self.resolution}px",
                f"b{self.batch_size}",
                f"a{self.accumulation}",
                f"r{self.rank}",
                self.precision,
                self.quantization,
                "gc" if self.gradient_checkpointing else "nogc",
                "te" if self.train_text_encoder else "note",
            )
        )


_KINDS: dict[Any, FieldKind] = {bool: "bool", int: "int", float: "float", str: "text"}


def _describe(cls: type[JobSpec]) -> tuple[SpecField, ...]:
    """Each field's declaration, completed with its name, kind, choices and default."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        origin, args = get_origin(hint), get_args(hint)
        kind: FieldKind
        choices: tuple[str, ...] = ()
        if origin is Literal:
            kind, choices = "choice", args
        elif origin is tuple:
            item = args[0]
            if get_origin(item) is Literal:
                kind, choices = "choices", get_args(item)
            else:
                kind = "texts"
        elif origin is Mapping:
            kind = "map"
        else:
            kind = _KINDS[hint]
        default: Any = None
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append(
            dataclasses.replace(
                f.metadata["spec"],
                name=f.name,
                kind=kind,
                choices=choices,
                has_default=(f.default, f.default_factory) != (MISSING, MISSING),
                default=default,
                flag=f.metadata["spec"].flag or "--" + f.name.replace("_", "-"),
            )
        )
    return tuple(out)


SPEC_FIELDS = _describe(JobSpec)
SPEC_FIELD = {f.name: f for f in SPEC_FIELDS}


def spec_value(name: str, value: Any) -> Any:
    """A JobSpec field's value, named by the field's name, in the field's own type
    (`spec_values.typed_value`, the one conversion every spec's values take), or InvalidArgument
    naming the field; a name that is no field is refused. The value's bounds are the checks'
    (`spec_checks.check_spec`)."""
    declared = SPEC_FIELD.get(name)
    if declared is None:
        raise InvalidArgument(name, "not a job spec field")
    return typed_value(declared, value)


def adapter_shape_key(
    resident_key: str,
    *,
    rank: int,
    alpha: float,
    train_text_encoder: bool,
    use_dora: bool,
    dropout: float,
) -> str:
    """One adapter shape as a key: the job's (`JobSpec.adapter_shape_key`) and, by the same
    rule, what a worker's resident model holds parked (worker/training/lora.py)."""
    shape = (rank, float(alpha), int(train_text_encoder), int(use_dora), float(dropout))
    return f"{resident_key}|lora:" + "x".join(repr(v) for v in shape)
