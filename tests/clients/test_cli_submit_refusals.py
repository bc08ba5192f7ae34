"""What an outside attack on `lorafleet submit` found it let through to the fleet: a spec the
scheduler refuses that uploaded its images first, a YAML 1.2 float (`1e-3`) read as a string, a
local model folder that is no diffusers pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lorafleet.cli.spec_flags import load_document
from lorafleet.client.api import build_spec
from lorafleet.core.serde import spec_from_proto
from tests.clients.test_cli import lorafleet
from tests.clients.test_cli_submit_checks import DOCUMENT, REQUIRED, _submit
from tests.support.fleet import Fleet
from tests.support.images import jpeg


async def _uploaded(fleet: Fleet) -> list[str]:
    return sorted(o.key for o in await fleet.scheduler.storage.list("uploads/alice/"))


async def test_a_spec_the_scheduler_refuses_uploads_nothing(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job no node of the fleet can hold (min_vram_mb beyond its largest node class) passed
    the CLI's own checks, uploaded its images, and only then was refused by SubmitJob."""
    photos = tmp_path / "rex"
    photos.mkdir()
    for i in range(3):
        (photos / f"{i}.jpg").write_bytes(jpeg(i))
    before = await _uploaded(fleet)
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        "--instance-prompt",
        "a photo of sks dog",
        "--max-train-steps",
        "10",
        "--min-vram-mb",
        "40000",
    )
    assert code == 1 and "error: spec.min_vram_mb: " in err, err
    assert await _uploaded(fleet) == before

    batch = tmp_path / "batch.yaml"
    batch.write_text(
        json.dumps(
            [
                {**DOCUMENT, "images": str(photos)},
                {**DOCUMENT, "images": str(photos), "min_vram_mb": 40000},
            ]
        )
    )
    code, _, err = await lorafleet(capsys, monkeypatch, fleet, "submit", "--batch", str(batch))
    assert code == 1 and "error: batch[1].min_vram_mb: " in err, err
    assert await _uploaded(fleet) == before

    # What the fleet can hold is uploaded and queued as before.
    code, out, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        "--instance-prompt",
        "a photo of sks dog",
        "--max-train-steps",
        "10",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)[0]["state"] == "QUEUED"
    assert len(await _uploaded(fleet)) == len(before) + 3


def test_a_yaml_spec_reads_yaml_1_2_floats_as_numbers(tmp_path: Path) -> None:
    """PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string: `learning_rate: 1e-3`, the
    README's own value, was refused as "expected a number"."""
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        "learning_rate: 1e-3\nadam_epsilon: 5E-5\nsnr_gamma: .5\nprior_loss_weight: 1E0\n"
        "max_train_steps: 10\ninstance_prompt: '1e-3'\ninstance_data_prefix: rex\n"
    )
    document = load_document(spec_file, "spec")
    assert document["learning_rate"] == 1e-3 and document["adam_epsilon"] == 5e-5
    assert document["snr_gamma"] == 0.5 and document["prior_loss_weight"] == 1.0
    assert document["max_train_steps"] == 10 and isinstance(document["max_train_steps"], int)
    assert document["instance_prompt"] == "1e-3"  # quoted: still a string
    assert spec_from_proto(build_spec(document)).learning_rate == 1e-3
    # Other YAML documents read as before: the global SafeLoader is left alone.
    assert yaml.safe_load("x: 1e-3") == {"x": "1e-3"}


def test_a_local_base_model_that_is_no_pipeline_folder_is_refused_at_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder here without model_index.json (or that file itself) passed, was uploaded as a
    job and failed on the worker."""
    empty = tmp_path / "weights"
    empty.mkdir()
    (empty / "unet.safetensors").write_bytes(b"x")
    line = _submit(capsys, monkeypatch, *REQUIRED, "--base-model", str(empty))
    assert line.startswith("error: base_model: ") and str(empty) in line, line
    assert "holds no model_index.json" in line and "diffusers pipeline folder" in line, line

    index = tmp_path / "sdxl" / "model_index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    line = _submit(capsys, monkeypatch, *REQUIRED, "--base-model", str(index))
    assert line.startswith("error: base_model: ") and str(index) in line, line
    assert "is a file" in line and str(index.parent) in line, line
