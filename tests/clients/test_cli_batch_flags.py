"""`lorafleet submit --batch FILE` beside a job's flags: an outside attack found them silently
dropped (the jobs took only the file's fields, no image was uploaded, exit 0). Each is refused
in one line naming the flags, before anything is read or sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafleet.app.main import build_parser
from lorafleet.cli.commands import refuse_flags_beside_batch
from tests.clients.test_cli_submit_checks import DOCUMENT, _submit
from tests.support.images import jpeg


@pytest.fixture
def batch(tmp_path: Path) -> Path:
    path = tmp_path / "batch.json"
    path.write_text(json.dumps([DOCUMENT]))
    return path


def test_job_flags_beside_batch_are_refused_naming_them(
    batch: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photos = tmp_path / "rex"
    photos.mkdir()
    (photos / "0.jpg").write_bytes(jpeg(0))
    spec = tmp_path / "job.yaml"
    spec.write_text("resolution: 512\n")
    line = _submit(
        capsys,
        monkeypatch,
        "--batch",
        str(batch),
        "--images",
        str(photos),
        "--spec",
        str(spec),
        "--label",
        "x=y",
        "--max-train-steps",
        "7",
        "--no-train-text-encoder",
        "--webhook-event",
        "samples",
    )
    assert line.startswith("error: batch: --batch takes each job's fields from its file"), line
    for flag in (
        "--images",
        "--spec",
        "--label",
        "--max-train-steps",
        "--train-text-encoder",
        "--webhook-event",
    ):
        assert flag in line, line
    for flag, value in (("--images-zip", "a.zip"), ("--prefix", "p"), ("--seed", "3")):
        line = _submit(capsys, monkeypatch, "--batch", str(batch), flag, value)
        assert line.startswith("error: batch: ") and flag in line, line
    # SubmitJobs takes no idempotency key: it was dropped as silently.
    line = _submit(capsys, monkeypatch, "--batch", str(batch), "--idempotency-key", "k")
    assert line.startswith("error: batch: ") and "--idempotency-key" in line, line


def test_watch_beside_a_batch_of_several_jobs_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--watch followed the job of a one-job batch and silently nothing for more."""
    two = tmp_path / "two.json"
    two.write_text(json.dumps([DOCUMENT, DOCUMENT]))
    line = _submit(capsys, monkeypatch, "--batch", str(two), "--watch")
    assert line == "error: batch: --watch follows one job; the file holds 2", line


def test_the_flags_that_are_no_job_fields_stay_allowed_beside_batch() -> None:
    args = build_parser(with_services=False).parse_args(
        [
            "submit",
            "--batch",
            "b.yaml",
            "--json",
            "--estimate",
            "--watch",
            "--target",
            "localhost:1",
            "--api-key",
            "k",
            "--tls",
        ]
    )
    refuse_flags_beside_batch(args)
