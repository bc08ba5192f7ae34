"""What an outside attack on `lorafleet` found of its parser and `samples`: a bad flag value
buried under a page of usage, choices taken in one case only, and `samples` of a job that
asked for no validation images promising them "yet"."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import pytest

from lorafleet.app.main import build_parser, main
from lorafleet.cli.samples import samples_command
from lorafleet.core.model import JobState
from tests.clients.test_timeline import make_job


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["submit", "--model-family", "FLUX9"], "argument --model-family: invalid choice"),
        (["submit", "--lr-scheduler", "cosine-ish"], "argument --lr-scheduler: invalid choice"),
        (["submit", "--guidance-scale", "abc"], "argument --guidance-scale: invalid float"),
        (["list", "--limit", "many"], "argument --limit: invalid int value"),
        (["download"], "the following arguments are required: job_id"),
        (["no-such-command"], "argument command: invalid choice"),
    ],
)
def test_a_bad_flag_is_one_line_and_a_hint_not_a_page_of_usage(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model-family FLUX9` printed 54 lines of usage before the error."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    command = "lorafleet" if argv[0] == "no-such-command" else f"lorafleet {argv[0]}"
    assert err.splitlines() == [
        f"{command}: error: {err.splitlines()[0].split(': error: ', 1)[1]}",
        f"see `{command} --help`",
    ], err
    assert said in err, err


def test_service_subcommands_use_the_one_line_error_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The nested parsers (`keys create`) are built from the same class."""
    parser = build_parser(with_services=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["keys", "create"])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 2 and "usage:" not in err, err


def test_spec_choice_flags_take_any_case() -> None:
    """Spec files and the SDK read `FLUX` as flux; the flags refused it."""
    args = build_parser(with_services=False).parse_args(
        [
            "submit",
            "--model-family",
            "FLUX",
            "--lr-scheduler",
            "Cosine",
            "--webhook-event",
            "FAILED",
        ]
    )
    assert args.spec_model_family == "flux" and args.spec_lr_scheduler == "cosine"
    assert args.webhook_event == ["failed"]


class _Client:
    def __init__(self, **spec: Any) -> None:
        base = make_job(state=JobState.SUCCEEDED)
        self.job = replace(base, spec=replace(base.spec, **spec))

    async def download_samples(self, job_id: str) -> list[Any]:
        return []

    async def get(self, job_id: str) -> Any:
        return self.job


def _samples_args(job_id: str) -> argparse.Namespace:
    return build_parser(with_services=False).parse_args(["samples", job_id])


async def test_samples_of_a_job_without_validation_prompts_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "no validation images yet" of a finished job that will never have any."""
    code = await samples_command(_Client(), _samples_args("job-1"))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert code == 1
    assert "job-1 has no validation prompts" in out, out
    assert "lorafleet samples job-1 --prompt P --step N" in out, out

    asked = _Client(validation_prompt="sks dog on a beach")
    code = await samples_command(asked, _samples_args("job-1"))  # type: ignore[arg-type]
    assert code == 1 and "no validation images yet" in capsys.readouterr().out
