"""`lorafleet submit`'s spec flags reach the JobSpec, the trainer options among them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from lorafleet.cli.spec_flags import add_spec_flags, spec_from_args
from lorafleet.client.api import build_spec
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.serde import spec_from_proto


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet submit")
    add_spec_flags(parser)
    return parser


def test_trainer_option_flags_build_the_spec() -> None:
    args = _parser().parse_args(
        [
            "--instance-prompt=a photo of sks dog",
            "--instance-data-prefix=rex",
            "--max-train-steps=10",
            "--optimizer=prodigy",
            "--learning-rate=1.0",
            "--prodigy-d-coef=0.5",
            "--no-prodigy-safeguard-warmup",
            "--lora-dropout=0.1",
            "--repeats=3",
            "--aspect-ratio-bucketing",
            "--output-format=both",
        ]
    )
    spec = spec_from_proto(build_spec(spec_from_args(args, None)))
    assert spec.optimizer == "prodigy"
    assert spec.prodigy_d_coef == 0.5
    assert spec.prodigy_safeguard_warmup is False
    assert spec.prodigy_use_bias_correction is True  # not given: the default
    assert (spec.lora_dropout, spec.repeats) == (0.1, 3)
    assert spec.aspect_ratio_bucketing is True
    assert spec.output_format == "both"


def test_trainer_option_flags_have_help() -> None:
    text = _parser().format_help()
    for flag in (
        "--optimizer {adamw,adamw_8bit,prodigy}",
        "--prodigy-d-coef",
        "--prodigy-safeguard-warmup",
        "--use-dora",
        "--lora-dropout",
        "--repeats",
        "--aspect-ratio-bucketing",
        "--output-format {diffusers,kohya,both}",
    ):
        assert flag in text
    assert "learns its own step size" in text
    assert "weight-decomposed" in text
    assert "nearest" in text and "ComfyUI" in text


def test_every_spec_flag_has_help_and_its_default() -> None:
    """`submit --help` listed 40 spec flags with no help text and no defaults."""
    from lorafleet.jobs.v1 import jobs_pb2 as pb

    parser = _parser()
    actions = {a.dest: a for a in parser._actions}
    required = ("instance_prompt", "instance_data_prefix", "max_train_steps")
    for field in pb.JobSpec.DESCRIPTOR.fields:
        if field.name in ("labels", "webhook"):
            continue
        action = actions[f"spec_{field.name}"]
        assert action.help, f"--{field.name} has no help"
        if field.name not in (*required, "lora_alpha", "validation_prompts"):
            assert "(default: " in action.help, f"--{field.name} does not say its default"
    text = " ".join(parser.format_help().split()).replace("- ", "-")  # argparse wraps at "-"
    assert "default: 0.0001" in text or "default: 1e-04" in text  # learning rate
    assert "diffusers' DreamBooth-LoRA script's default 1e-4" in text  # weight decay


def test_checkpointing_steps_takes_auto_or_a_number() -> None:
    base = [
        "--instance-prompt=a photo of sks dog",
        "--instance-data-prefix=rex",
        "--max-train-steps=50",
    ]
    parser = _parser()
    for given, expected in (("auto", 0), ("25", 25)):
        args = parser.parse_args([*base, f"--checkpointing-steps={given}"])
        assert spec_from_proto(build_spec(spec_from_args(args, None))).checkpointing_steps == (
            expected
        )
    assert "--checkpointing-steps N|auto" in parser.format_help()
    assert "(default: auto)" in " ".join(parser.format_help().split())


def test_a_spec_file_says_auto_as_the_flag_does() -> None:
    """`checkpointing_steps: auto` in a --spec or --batch file (a mapping) is the flag's 0,
    not "'str' object cannot be interpreted as an integer"; another word is still refused."""
    document = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "rex",
        "max_train_steps": 50,
        "checkpointing_steps": "auto",
    }
    assert spec_from_proto(build_spec(document)).checkpointing_steps == 0
    parser = _parser()
    args = parser.parse_args(["--max-train-steps=60"])
    merged = spec_from_args(args, document)  # --spec FILE with a flag over it
    assert spec_from_proto(build_spec(merged)).checkpointing_steps == 0
    try:
        build_spec({**document, "checkpointing_steps": "often"})
    except InvalidArgument as exc:
        assert exc.field == "checkpointing_steps"
    else:
        raise AssertionError("a word other than auto was taken")


def test_a_spec_file_names_the_webhook_as_the_options_table_does() -> None:
    """`webhook_url` and `webhook_events` (the README's options, the JobSpec's fields) are keys
    of a --spec file, as the wire's nested `webhook:` is; they were refused as "not a job spec
    field". A --webhook-url flag over the file replaces the file's webhook."""
    document = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "rex",
        "max_train_steps": 50,
        "webhook_url": "https://hooks.example/a",
        "webhook_events": ["succeeded", "samples"],
    }
    spec = spec_from_proto(build_spec(document))
    assert spec.webhook_url == "https://hooks.example/a"
    assert spec.webhook_events == ("succeeded", "samples")
    nested = {**document, "webhook": {"url": "https://hooks.example/b"}}
    try:
        build_spec(nested)
    except InvalidArgument as exc:
        assert exc.field == "webhook_url"
    else:
        raise AssertionError("two webhooks were taken")
    args = _parser().parse_args(["--webhook-url=https://hooks.example/c"])
    merged = spec_from_proto(build_spec(spec_from_args(args, document)))
    assert merged.webhook_url == "https://hooks.example/c" and merged.webhook_events == ()


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("guidance_scale", True, "guidance_scale: expected a number, got true"),
        ("resolution", "512", "resolution: expected an integer, got '512'"),
        ("train_text_encoder", 1, "train_text_encoder: expected true or false, got 1"),
        ("labels", {"version": 2}, "labels['version']: expected text, got 2"),
        ("validation_prompts", ["a dog", 3], "validation_prompts[1]: expected text, got 3"),
        ("webhook", "https://hooks.example/a", "webhook: expected a mapping of url and events"),
        ("seed", 10**30, f"seed: {10**30} is out of range"),  # was a bare ValueError
    ],
)
def test_a_spec_file_value_of_the_wrong_type_is_refused_naming_it(
    key: str, value: Any, said: str
) -> None:
    """A --spec file's value is taken in its field's type or refused naming the field: before,
    the proto's setters took `guidance_scale: true` as 1.0 and said "'str' object cannot be
    interpreted as an integer" for `resolution: "512"`. A choice in any case is its name."""
    document = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "rex",
        "max_train_steps": 50,
    }
    with pytest.raises(InvalidArgument) as refused:
        build_spec({**document, key: value})
    assert str(refused.value) == said
    flux = build_spec(
        {**document, "model_family": "FLUX", "base_model": "black-forest-labs/FLUX.1-dev"}
    )
    assert spec_from_proto(flux).model_family == "flux"


def test_download_says_how_a_result_loads_in_its_family_pipeline() -> None:
    """`lorafleet download` once printed `pipe.load_lora_weights(...)` for every file; a FLUX.1
    job's kohya file does not load that way (diffusers converts that layout for some layers
    only), and a user of several families needs the pipeline's name."""
    from lorafleet.cli.render import load_hint
    from lorafleet.core.spec import JobSpec

    def spec(**fields: Any) -> JobSpec:
        return spec_from_proto(
            build_spec(
                instance_prompt="a photo of sks dog",
                instance_data_prefix="rex",
                max_train_steps=10,
                **fields,
            )
        )

    flux = spec(model_family="flux", base_model="/models/flux", output_format="both")
    out = Path("/tmp/lora/pytorch_lora_weights.safetensors")
    hint = load_hint("j1", flux, out, "diffusers")
    assert "FluxPipeline.from_pretrained('/models/flux')" in hint
    assert "load_lora_weights('/tmp/lora', weight_name='pytorch_lora_weights.safetensors')" in hint
    kohya = load_hint("j1", flux, out.with_name("k.safetensors"), "kohya")
    assert "ComfyUI" in kohya and "load_lora_weights" not in kohya
    assert "lorafleet download j1 --format diffusers" in kohya
    klein = spec(model_family="flux2", base_model="/models/klein", output_format="both")
    assert "Flux2KleinPipeline.from_pretrained" in load_hint("j2", klein, out, "kohya")
    assert "StableDiffusionXLPipeline" in load_hint("j3", spec(), out, "diffusers")


def test_submit_takes_a_local_model_family_from_its_model_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lorafleet submit --base-model $PWD/flux-model` without --model-family was taken for
    sdxl and failed on the worker after queueing; a folder on the submitting machine (as on
    `lorafleet up`) now names its family, and a contradiction or FLUX.2 [dev] is refused before
    anything is uploaded, naming base_model."""
    from lorafleet.cli.local_inputs import family_from_local_model

    def model(name: str, pipeline: str) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(f'{{"_class_name": "{pipeline}"}}')
        return str(tmp_path / name)

    flux, sdxl = model("flux", "FluxPipeline"), model("sdxl", "StableDiffusionXLPipeline")
    document = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "rex",
        "max_train_steps": 10,
    }
    spec = {**document, "base_model": flux}
    assert family_from_local_model(spec) is not None
    assert spec_from_proto(build_spec(spec)).model_family == "flux"
    named = {**document, "base_model": flux, "model_family": "flux2"}
    for case, where in (
        (named, ""),
        ({**document, "base_model": model("dev", "Flux2Pipeline")}, "batch[1]."),
    ):
        try:
            family_from_local_model(case, where=where)
        except InvalidArgument as exc:
            assert exc.field == f"{where}base_model", exc
        else:
            raise AssertionError(f"{case} was taken")
    # A folder here named by a relative path (taken for a hub id once) gets its absolute one.
    monkeypatch.chdir(tmp_path)
    try:
        family_from_local_model({**document, "base_model": "flux"})
    except InvalidArgument as exc:
        assert exc.field == "base_model" and exc.reason.endswith(flux), exc
    else:
        raise AssertionError("a relative folder was taken")
    unchanged = [
        {**document, "base_model": sdxl},  # auto is sdxl already
        {**document, "base_model": flux, "model_family": "flux"},
        {**document, "base_model": "black-forest-labs/FLUX.1-dev"},  # a hub id
        {**document, "base_model": str(tmp_path / "elsewhere")},  # only the workers have it
    ]
    for case in unchanged:
        before = dict(case)
        assert family_from_local_model(case) is None and case == before
