"""What `lorafleet submit` refuses on this machine before it talks to a scheduler (a spec file
it cannot parse), each as one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.app.main import main


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
