"""`lorafleet samples J --prompt P --step N` with a value out of its job spec field's bounds: an
outside attack found `--seed -1` and `--seed 99999999999` sent (the spec allows 0..2**32-1) and
`--seed 99999999999999999999999` or `--images 99999999999` printing a traceback (the proto's
"Value out of range"). The SDK refuses each before building the request, naming the field."""

from __future__ import annotations

import pytest

from lorafleet.app.main import main


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (("--seed", "-1"), "seed"),
        (("--seed", "99999999999"), "seed"),
        (("--seed", "99999999999999999999999"), "seed"),
        (("--images", "99999999999"), "num_images"),
        (("--images", "-2"), "num_images"),
        (("--inference-steps", "99999999999"), "inference_steps"),
        (("--guidance-scale", "nan"), "guidance_scale"),
        (("--step", "99999999999999999999999"), "steps"),
    ],
)
def test_an_out_of_range_value_is_one_line_naming_its_field(
    flags: tuple[str, str],
    field: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing listens on port 1: the refusal comes before any call.
    monkeypatch.setenv("LORAFLEET_TARGET", "127.0.0.1:1")
    monkeypatch.setenv("LORAFLEET_API_KEY", "not-used")
    code = main(["samples", "J", "--prompt", "x", "--step", "30", *flags])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(f"error: {field}: "), line
