"""A spec's values: each in its field's type or refused naming the field, and what a family's
pipeline cannot take refused at submit rather than on a worker once the model is loaded."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.serde import spec_from_proto, spec_to_proto
from lorafleet.core.spec import SPEC_FIELDS, JobSpec, SpecField, spec_value

REQUIRED: dict[str, Any] = {
    "instance_prompt": "a photo of sks dog",
    "instance_data_prefix": "rex",
    "max_train_steps": 100,
}
FLUX = {"model_family": "flux", "base_model": "/models/flux"}
FLUX2 = {"model_family": "flux2", "base_model": "/models/klein"}


def _spec(**changes: Any) -> JobSpec:
    return JobSpec(**{**REQUIRED, **changes})


def _refused(**changes: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        _spec(**changes)
    return caught.value


@pytest.mark.parametrize("family", [FLUX, FLUX2], ids=["flux", "flux2"])
def test_a_flow_family_refuses_a_resolution_its_2x2_patches_do_not_divide(
    family: dict[str, str],
) -> None:
    # 1032 = 129 x 8: the VAE takes it, the 2x2 latent patches do not.
    error = _refused(**family, resolution=1032)
    assert error.field == "resolution"
    assert family["model_family"] in error.reason and "16" in error.reason
    msg = spec_to_proto(_spec(**family))
    msg.resolution = 1032
    with pytest.raises(InvalidArgument) as caught:
        spec_from_proto(msg)  # what the scheduler runs on a submission
    assert caught.value.field == "resolution"
    assert _spec(**family, resolution=1040).resolution == 1040


def test_sdxl_keeps_taking_a_multiple_of_8() -> None:
    assert _spec(resolution=1032).resolution == 1032
    assert _refused(resolution=1028).field == "resolution"


def test_a_bool_for_a_number_is_refused_naming_the_field_and_type() -> None:
    """`guidance_scale: true` was trained as 1.0 (a bool is an int in Python)."""
    error = _refused(**FLUX, guidance_scale=True)
    assert str(error) == "guidance_scale: expected a number, got true"
    assert str(_refused(lora_rank=True)) == "lora_rank: expected an integer, got true"


def test_a_number_in_text_is_refused_as_the_protos_typed_fields_refuse_it() -> None:
    """Python's `'str' object cannot be interpreted as an integer` reached the user."""
    assert str(_refused(resolution="512")) == "resolution: expected an integer, got '512'"
    assert str(_refused(learning_rate="1e-4")) == "learning_rate: expected a number, got '1e-4'"


def test_a_number_for_a_bool_is_refused() -> None:
    assert str(_refused(center_crop=1)) == "center_crop: expected true or false, got 1"


# Values of a wrong type for each kind of field: every one is refused.
_WRONG: dict[str, tuple[Any, ...]] = {
    "bool": (1, "true", None),
    "int": (True, "5", 5.0, None),
    "float": (True, "0.5", None),
    "text": (5, True, None, ["a"]),
    "choice": (True, 1, None),
    "texts": ("a photo", [1], None),
    "choices": ("samples", [1], None),
    "map": (["a=b"], {"a": 1}, None),
}


@pytest.mark.parametrize("field", SPEC_FIELDS, ids=lambda f: f.name)
def test_every_field_refuses_a_value_of_another_type(field: SpecField) -> None:
    for wrong in _WRONG[field.kind]:
        with pytest.raises(InvalidArgument) as caught:
            spec_value(field.name, wrong)
        assert caught.value.field.startswith(field.name), (field.name, wrong)
        assert caught.value.reason.startswith("expected "), (field.name, wrong, caught.value)
        # JobSpec itself runs the same conversion: no way around it from the SDK or a ledger row.
        with pytest.raises(InvalidArgument) as made:
            JobSpec.from_dict({**REQUIRED, field.name: wrong})
        assert made.value.field == caught.value.field


def test_an_int_for_a_float_is_a_float() -> None:
    spec = _spec(**FLUX, guidance_scale=3)
    assert type(spec.guidance_scale) is float and spec.to_dict()["guidance_scale"] == 3.0


def test_choice_names_are_taken_in_any_case() -> None:
    assert spec_value("model_family", "FLUX") == "flux"
    assert spec_value("webhook_events", ["Samples"]) == ("samples",)
    spec = _spec(model_family="FLUX", base_model="/models/flux", optimizer="AdamW")
    assert (spec.model_family, spec.family, spec.optimizer) == ("flux", "flux", "adamw")
    error = _refused(model_family="flx")
    assert error.field == "model_family" and "flux2" in error.reason


def test_an_int_fields_zero_word_is_its_zero() -> None:
    assert spec_value("checkpointing_steps", "auto") == 0
    assert _spec(checkpointing_steps="auto").checkpointing_steps == 0
    error = _refused(checkpointing_steps="often")
    assert str(error) == "checkpointing_steps: expected an integer or auto, got 'often'"


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(InvalidArgument) as caught:
        spec_value("resolutoin", 512)
    assert caught.value.field == "resolutoin"


def test_lists_and_a_stored_spec_come_back_as_the_spec() -> None:
    spec = _spec(
        validation_prompts=["a dog", "a cat"],
        webhook_url="https://hooks.example/x",
        webhook_events=["succeeded"],
        labels={"team": "a"},
    )
    assert spec.validation_prompts == ("a dog", "a cat")
    assert spec.webhook_events == ("succeeded",)
    assert JobSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("family", "example"),
    [("flux", "black-forest-labs/FLUX.1-dev"), ("flux2", "black-forest-labs/FLUX.2-klein-4B")],
)
def test_a_flow_family_without_a_base_model_asks_for_one(family: str, example: str) -> None:
    """model_family flux with the base model left at its default blamed that default ("'stabilityai
    /stable-diffusion-xl-base-1.0' is a model of family sdxl"), which the user never chose: it
    asks for a base model of the family and names its public variants."""
    with pytest.raises(InvalidArgument) as refused:
        _spec(model_family=family)
    assert refused.value.field == "base_model"
    assert f"model_family {family} needs a base model of that family" in str(refused.value)
    assert example in str(refused.value) and "stable-diffusion-xl" not in str(refused.value)


def test_flux2_refuses_a_text_encoder_learning_rate() -> None:
    """klein's Qwen3 never trains: its learning rate was silently accepted (an outside attack),
    where train_text_encoder is refused; both name the field now."""
    refused = _refused(**FLUX2, text_encoder_learning_rate=1e-4)
    assert refused.field == "text_encoder_learning_rate" and "Qwen3" in str(refused)
    _spec(**FLUX, text_encoder_learning_rate=1e-4)  # FLUX.1 may train CLIP


def test_flux2_refuses_a_guidance_scale_at_submit() -> None:
    """klein embeds no guidance: a guidance_scale was refused only by the worker, once the job
    was uploaded and the model loaded (an outside attack); every flux2 model lorafleet trains
    is a klein, so submit refuses it. FLUX.1 takes one."""
    refused = _refused(**FLUX2, guidance_scale=3.5)
    assert refused.field == "guidance_scale" and "no guidance embedding" in str(refused)
    _spec(**FLUX, guidance_scale=3.5)
