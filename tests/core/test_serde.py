"""The spec's defaults live in JobSpec alone; serde fills unset proto fields from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.serde import enum_numbers, enum_prefix, spec_from_proto, spec_to_proto
from lorafleet.core.spec import SPEC_FIELD, SPEC_FIELDS, JobSpec, SpecField
from lorafleet.jobs.v1 import jobs_pb2 as pb

PROMPT = "a photo of sks dog"
PREFIX = "rex"


def test_unset_proto_fields_take_the_specs_own_defaults() -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    assert spec_from_proto(msg) == JobSpec(
        instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5
    )


def test_every_field_survives_a_round_trip() -> None:
    # Every field away from its default, so a field serde forgot cannot pass unnoticed.
    spec = JobSpec(
        instance_prompt=PROMPT,
        instance_data_prefix=PREFIX,
        max_train_steps=50,
        class_prompt="a dog",
        class_data_prefix="dogs",
        with_prior_preservation=True,
        prior_loss_weight=0.5,
        num_class_images=7,
        learning_rate=3e-4,
        train_text_encoder=True,
        text_encoder_learning_rate=1e-5,
        lr_scheduler="cosine",
        lr_warmup_steps=3,
        lr_num_cycles=2,
        lr_power=2.0,
        train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        use_8bit_adam=True,
        mixed_precision="bf16",
        resolution=512,
        center_crop=True,
        random_flip=True,
        lora_rank=8,
        lora_alpha=16.0,
        snr_gamma=5.0,
        noise_offset=0.1,
        caption_mode="instance_prompt",
        checkpointing_steps=10,
        validation_prompt="a dog on the moon",
        validation_steps=10,
        seed=7,
        base_model="some/model",
        vae_model="some/vae",
        min_vram_mb=1024,
        priority=3,
        max_failures=5,
        labels={"team": "pets"},
        webhook_url="https://example.com/hook",
        webhook_events=("succeeded",),
        adam_beta1=0.8,
        adam_beta2=0.99,
        adam_weight_decay=0.0,
        adam_epsilon=1e-7,
        max_grad_norm=2.0,
        optimizer="adamw_8bit",
        prodigy_d_coef=0.5,
        prodigy_safeguard_warmup=False,
        prodigy_use_bias_correction=False,
        use_dora=True,
        lora_dropout=0.1,
        repeats=3,
        aspect_ratio_bucketing=True,
        scale_lr=True,
        validation_prompts=("a dog in the snow", "a dog at night"),
        validation_negative_prompt="blurry",
        validation_guidance_scale=7.5,
        validation_inference_steps=20,
        num_validation_images=2,
    )
    defaults = JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=1)
    same = [
        f.name
        for f in dataclasses.fields(JobSpec)
        if getattr(spec, f.name) == getattr(defaults, f.name)
    ]
    # output_format other than diffusers excludes DoRA: its values in specs of their own below;
    # the flow-matching families' fields mean nothing for sdxl: in a flux spec below.
    flow = ["model_family", *_FLOW_FIELDS]
    assert same == ["instance_prompt", "instance_data_prefix", "output_format", *flow], (
        "the round trip must cover all"
    )
    assert spec_from_proto(spec_to_proto(spec)) == spec
    # Prodigy excludes 8-bit Adam: the other enum value in a spec of its own.
    prodigy = dataclasses.replace(spec, use_8bit_adam=False, optimizer="prodigy")
    assert spec_from_proto(spec_to_proto(prodigy)) == prodigy
    for fmt in ("kohya", "both"):
        other = dataclasses.replace(spec, use_dora=False, output_format=fmt)
        assert spec_from_proto(spec_to_proto(other)) == other
    flux = dataclasses.replace(
        spec,
        snr_gamma=0.0,
        noise_offset=0.0,
        model_family="flux",
        guidance_scale=3.5,
        weighting_scheme="logit_normal",
        logit_mean=0.5,
        logit_std=1.5,
        max_sequence_length=256,
        base_quantization="nf4",
    )
    assert spec_from_proto(spec_to_proto(flux)) == flux
    moded = dataclasses.replace(
        flux,
        weighting_scheme="mode",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.0,
        model_family="flux2",
        train_text_encoder=False,
        # klein's Qwen3 never trains; its pipeline takes no negative prompt; its transformer
        # embeds no guidance.
        text_encoder_learning_rate=SPEC_FIELD["text_encoder_learning_rate"].default,
        validation_negative_prompt="",
        guidance_scale=SPEC_FIELD["guidance_scale"].default,
    )
    assert spec_from_proto(spec_to_proto(moded)) == moded


_FLOW_FIELDS = [
    "guidance_scale",
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "max_sequence_length",
    "base_quantization",
]


def test_unset_optional_booleans_default_to_true_and_false_survives() -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    spec = spec_from_proto(msg)
    assert spec.prodigy_safeguard_warmup is True
    assert spec.prodigy_use_bias_correction is True
    msg.prodigy_safeguard_warmup = False
    assert spec_from_proto(msg).prodigy_safeguard_warmup is False
    assert spec_from_proto(msg).prodigy_use_bias_correction is True


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"optimizer": "sgd"}, "optimizer"),
        ({"optimizer": "prodigy", "use_8bit_adam": True}, "use_8bit_adam"),
        ({"prodigy_d_coef": 0.0}, "prodigy_d_coef"),
        ({"lora_dropout": 0.95}, "lora_dropout"),
        ({"lora_dropout": -0.1}, "lora_dropout"),
        ({"repeats": 0}, "repeats"),
        ({"output_format": "onnx"}, "output_format"),
        ({"output_format": "kohya", "use_dora": True}, "output_format"),
        ({"output_format": "both", "use_dora": True}, "output_format"),
    ],
)
def test_new_training_options_are_validated(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=1, **changes)
    assert caught.value.field == field


# A zero in a field with a default is never read as "unset".
_REFUSED_ZEROS = (
    "prior_loss_weight",
    "num_class_images",
    "learning_rate",
    "text_encoder_learning_rate",
    "lr_num_cycles",
    "lr_power",
    "train_batch_size",
    "gradient_accumulation_steps",
    "resolution",
    "lora_rank",
    "lora_alpha",
    "max_failures",
    "adam_epsilon",
    "max_grad_norm",
    "prodigy_d_coef",
    "repeats",
)


@pytest.mark.parametrize("name", _REFUSED_ZEROS)
def test_a_zero_where_zero_is_invalid_is_refused_not_defaulted(name: str) -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    setattr(msg, name, 0)
    with pytest.raises(InvalidArgument) as caught:
        spec_from_proto(msg)
    assert caught.value.field == name


def test_an_empty_base_model_is_refused_not_defaulted() -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    msg.base_model = ""
    with pytest.raises(InvalidArgument) as caught:
        spec_from_proto(msg)
    assert caught.value.field == "base_model"


@pytest.mark.parametrize("name", ["adam_beta1", "adam_beta2", "adam_weight_decay"])
def test_a_meaningful_zero_is_honoured(name: str) -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    assert getattr(spec_from_proto(msg), name) != 0
    setattr(msg, name, 0.0)
    assert getattr(spec_from_proto(msg), name) == 0.0


def test_every_field_whose_zero_is_not_the_default_has_presence() -> None:
    # A field without presence whose JobSpec default is not its zero would turn an explicit
    # zero into the default: every such field must be `optional` in the proto.
    defaults = JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=1)
    for field in pb.JobSpec.DESCRIPTOR.fields:
        required = ("instance_prompt", "instance_data_prefix", "max_train_steps")
        if field.name in ("labels", "webhook", *required):
            continue
        # Enums have their own UNSPECIFIED zero; a repeated field's empty list is its default.
        if field.enum_type is not None or field.is_repeated:
            continue
        default = getattr(defaults, field.name)
        zero: Any = {field.TYPE_STRING: "", field.TYPE_BOOL: False}.get(field.type, 0)
        if default != zero:
            assert field.has_presence, f"{field.name} needs `optional` (default {default!r})"


def test_the_default_weight_decay_is_the_diffusers_scripts() -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    assert spec_from_proto(msg).adam_weight_decay == 1e-4


# The declarations in core/spec.py and the proto must agree: every test below would catch a
# field or an enum value added to one and not the other.


def test_the_spec_fields_are_the_protos_in_the_same_order() -> None:
    proto = [f.name for f in pb.JobSpec.DESCRIPTOR.fields]
    declared = [f.name for f in SPEC_FIELDS]
    # The webhook message holds two spec fields.
    declared = [n for n in declared if n != "webhook_events"]
    assert declared == [n if n != "webhook" else "webhook_url" for n in proto]


def test_every_choice_has_its_proto_enum_value_and_back() -> None:
    for f in SPEC_FIELDS:
        if f.kind not in ("choice", "choices"):
            continue
        numbers = enum_numbers(f)  # raises KeyError for a name the proto lacks
        enum = (
            pb.WebhookEvent.DESCRIPTOR
            if f.name == "webhook_events"
            else pb.JobSpec.DESCRIPTOR.fields_by_name[f.name].enum_type
        )
        assert enum is not None, f.name
        proto_names = {v.name for v in enum.values if v.number != 0}
        assert {enum_prefix(enum) + n.upper() for n in numbers} == proto_names, f.name
        assert 0 not in numbers.values(), f.name


def test_an_unset_enum_takes_the_declared_default_and_an_unknown_one_is_refused() -> None:
    msg = pb.JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, max_train_steps=5)
    spec = spec_from_proto(msg)
    for f in SPEC_FIELDS:
        if f.kind == "choice":
            assert getattr(spec, f.name) == f.default
    msg.optimizer = 99  # type: ignore[assignment]
    with pytest.raises(InvalidArgument) as caught:
        spec_from_proto(msg)
    assert caught.value.field == "optimizer"


def _valid(**changes: Any) -> JobSpec:
    values: dict[str, Any] = {"max_train_steps": 100, **changes}
    return JobSpec(instance_prompt=PROMPT, instance_data_prefix=PREFIX, **values)


@pytest.mark.parametrize(
    "field", [f for f in SPEC_FIELDS if f.high is not None], ids=lambda f: f.name
)
def test_each_declared_bound_is_checked(field: SpecField) -> None:
    """Each numeric field takes its bounds and refuses a step beyond either, naming itself."""
    # The flow-matching families' fields are refused for sdxl: checked on a flux spec, with the
    # weighting scheme their parameters belong to.
    context: dict[str, Any] = {}
    if field.name in _FLOW_FIELDS:
        scheme = {"mode_scale": "mode", "logit_mean": "logit_normal", "logit_std": "logit_normal"}
        context = {
            "model_family": "flux",
            "base_model": "/models/flux",
            "weighting_scheme": scheme.get(field.name, "none"),
        }
    high = 100 if field.high == "max_train_steps" else field.high
    assert isinstance(high, (int, float))
    step = 1 if field.kind == "int" else max(abs(high) * 1e-3, 1e-9)
    low = 0.0 if field.positive else field.low
    assert low is not None
    value_type = int if field.kind == "int" else float
    for ok in (high, low + step if field.positive else low):
        if field.multiple_of and ok % field.multiple_of:
            continue
        _valid(**context, **{field.name: value_type(ok)})
    for bad in (high + step, low if field.positive else low - step):
        with pytest.raises(InvalidArgument) as caught:
            _valid(**context, **{field.name: value_type(bad)})
        assert caught.value.field == field.name


def test_a_flux2_job_refuses_a_validation_negative_prompt() -> None:
    """Flux2KleinPipeline takes no negative prompt: refused at submit, naming the field, never a
    sample task that fails on the fleet (INTERNAL, re-queued, its machines banned)."""
    flux2 = {"model_family": "flux2", "base_model": "/models/klein"}
    with pytest.raises(InvalidArgument) as caught:
        _valid(**flux2, validation_prompt="a dog", validation_negative_prompt="blurry")
    assert caught.value.field == "validation_negative_prompt"
    _valid(**flux2, validation_prompt="a dog")
    _valid(model_family="flux", base_model="/models/flux", validation_negative_prompt="blurry")
