"""What `lorafleet submit` refuses on this machine before it talks to a scheduler (a spec file
it cannot parse, a local model it cannot train, a family without its base model), each as one
line naming the field; and `lorafleet get` of a job that never trained."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lorafleet.app.main import main
from lorafleet.cli.local_inputs import family_from_local_model
from lorafleet.cli.render import describe_job, job_json
from lorafleet.client.api import build_spec
from lorafleet.core.model import JobState, Progress
from lorafleet.core.serde import job_from_proto, job_to_proto, spec_from_proto
from tests.clients.test_timeline import make_job

REQUIRED = (
    "--instance-prompt=a photo of sks dog",
    "--instance-data-prefix=rex",
    "--max-train-steps=10",
)
DOCUMENT = {
    "instance_prompt": "a photo of sks dog",
    "instance_data_prefix": "rex",
    "max_train_steps": 10,
}


def _submit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    """`lorafleet submit ARGV` refused before any call (nothing listens on port 1): its one
    error line."""
    monkeypatch.setenv("LORAFLEET_TARGET", "127.0.0.1:1")
    monkeypatch.setenv("LORAFLEET_API_KEY", "not-used")
    code = main(["submit", *argv])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("error: "), err
    return line


def _model(folder: Path, index: dict[str, Any] | str) -> str:
    folder.mkdir()
    text = index if isinstance(index, str) else json.dumps(index)
    (folder / "model_index.json").write_text(text)
    return str(folder)


def test_a_spec_file_that_does_not_parse_is_one_line_naming_it_and_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A malformed --spec or --batch file printed the YAML or JSON parser's traceback."""
    bad_yaml = tmp_path / "job.yaml"
    bad_yaml.write_text("max_train_steps: [10, 20\nresolution: 512\n")
    line = _submit(capsys, monkeypatch, "--spec", str(bad_yaml))
    assert line.startswith("error: spec: ") and str(bad_yaml) in line, line
    assert "YAML at line 2, column" in line, line

    bad_json = tmp_path / "job.json"
    bad_json.write_text('{"max_train_steps": 10,,}')
    line = _submit(capsys, monkeypatch, "--spec", str(bad_json))
    assert str(bad_json) in line and "JSON at line 1, column 24" in line, line

    line = _submit(capsys, monkeypatch, "--batch", str(bad_yaml))
    assert line.startswith("error: batch: ") and "line 2" in line, line


def test_a_spec_file_that_is_no_mapping_or_cannot_be_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- max_train_steps: 10\n")
    line = _submit(capsys, monkeypatch, "--spec", str(listed))
    assert str(listed) in line and "mapping of spec fields" in line and "a list" in line, line

    binary = tmp_path / "photo.yaml"
    binary.write_bytes(b"\xff\xd8\xff\xe0 a jpeg, not a spec")
    line = _submit(capsys, monkeypatch, "--spec", str(binary))
    assert line.startswith("error: spec: cannot read") and str(binary) in line, line

    line = _submit(capsys, monkeypatch, "--spec", str(tmp_path))  # a folder
    assert line.startswith("error: spec: cannot read") and str(tmp_path) in line, line


def test_a_local_models_family_is_compared_in_any_case(tmp_path: Path) -> None:
    """`model_family: FLUX` is flux to the server; the local-folder check refused it as a
    contradiction of the folder's FluxPipeline."""
    flux = _model(tmp_path / "flux", {"_class_name": "FluxPipeline"})
    for named in ("FLUX", "Flux"):
        spec = {**DOCUMENT, "base_model": flux, "model_family": named}
        assert family_from_local_model(spec) is None
        assert spec_from_proto(build_spec(spec)).family == "flux"
    spec = {**DOCUMENT, "base_model": flux, "model_family": "AUTO"}
    assert family_from_local_model(spec) is not None and spec["model_family"] == "flux"


def test_a_local_model_of_a_pipeline_lorafleet_does_not_train_is_refused_at_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the worker refused these, after the job had queued and leased a node."""
    for name, index, said in (
        ("sd15", {"_class_name": "StableDiffusionPipeline"}, "StableDiffusionPipeline"),
        ("bare", {"weights": "x"}, "model without a pipeline class"),
        ("listed", "[1, 2]", "model without a pipeline class"),
        ("broken", "{not json", "unreadable model_index.json"),
    ):
        model = _model(tmp_path / name, index)
        line = _submit(capsys, monkeypatch, *REQUIRED, "--base-model", model)
        assert line.startswith("error: base_model: ") and model in line and said in line, line
        if "unreadable" not in said:
            assert "FluxPipeline" in line and "Flux2KleinPipeline" in line, line
    dev = _model(tmp_path / "dev", {"_class_name": "Flux2Pipeline"})
    line = _submit(capsys, monkeypatch, *REQUIRED, "--base-model", dev)
    assert line.startswith("error: base_model: ") and dev in line and "FLUX.2 [dev]" in line


def test_a_family_without_its_base_model_says_so_not_the_sdxl_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model-family flux` alone blamed stabilityai/stable-diffusion-xl-base-1.0, a model the
    user never named."""
    line = _submit(capsys, monkeypatch, *REQUIRED, "--model-family", "flux")
    assert line.startswith("error: base_model: model_family flux needs a base model"), line
    assert "black-forest-labs/FLUX.1-dev" in line and "stable-diffusion-xl" not in line, line

    batch = tmp_path / "batch.yaml"
    batch.write_text(json.dumps([DOCUMENT, {**DOCUMENT, "model_family": "FLUX2"}]))
    line = _submit(capsys, monkeypatch, "--batch", str(batch))
    assert line.startswith("error: batch[1].base_model: model_family flux2"), line
    assert "black-forest-labs/FLUX.2-klein-4B" in line, line


def test_get_shows_no_loss_for_a_job_that_never_trained() -> None:
    """A job leased and failed before its first step read "loss 0.0000": the wire's progress
    has no unset loss, so 0.0 came back as if reported."""
    now = datetime.now(UTC)

    def got(step: int, loss: float | None) -> Any:
        progress = Progress(
            step=step,
            max_steps=100,
            loss=loss,
            learning_rate=None,
            seconds_per_step=None,
            machine_id="m1",
            updated_at=now,
        )
        job = make_job(progress=progress, state=JobState.FAILED, error="no GPU")
        return job_from_proto(job_to_proto(job))  # what `lorafleet get` reads

    never = got(0, None)
    assert "loss" not in describe_job(never) and job_json(never)["loss"] is None
    trained = got(3, 0.25)
    assert "step 3/100, loss 0.2500" in describe_job(trained)
    assert job_json(trained)["loss"] == 0.25
