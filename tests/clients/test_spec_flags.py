"""`lorafleet submit`'s spec flags reach the JobSpec, the trainer options among them."""

from __future__ import annotations

import argparse

from lorafleet.cli.commands import add_spec_flags, spec_from_args
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
