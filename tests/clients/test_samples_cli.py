"""`lorafleet samples`: the grid picture and the spec flags for validation images."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from PIL import Image

from lorafleet.cli.commands import JOB_COMMANDS
from lorafleet.cli.samples import render_grid, sample_path
from lorafleet.cli.spec_flags import add_spec_flags, spec_from_args
from lorafleet.cli.timeline.paint import _samples_html
from lorafleet.client.api import SampleImageInfo, build_spec
from lorafleet.jobs.v1 import jobs_pb2 as pb


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(out, format="PNG")
    return out.getvalue()


def _info(step: int, prompt_index: int, image_index: int) -> SampleImageInfo:
    return SampleImageInfo(
        step=step,
        prompt_index=prompt_index,
        prompt=["a photo of sks dog", "sks dog on a beach"][prompt_index],
        image_index=image_index,
        url="",
        sha256="",
    )


def test_grid_puts_prompts_in_rows_and_steps_in_columns() -> None:
    colors = {10: (255, 0, 0), 20: (0, 0, 255)}
    images = [
        (_info(step, p, i), _png(colors[step])) for step in (20, 10) for p in (0, 1) for i in (0,)
    ]
    with Image.open(io.BytesIO(render_grid(images))) as grid:
        assert grid.size == (220 + 2 * 166 + 6, 28 + 2 * 166 + 6)
        rgb = grid.convert("RGB")
        # Column of step 10 first (red), then step 20 (blue), in both rows.
        for row in range(2):
            y = 28 + 6 + row * 166 + 80
            assert rgb.getpixel((220 + 6 + 80, y)) == (255, 0, 0)
            assert rgb.getpixel((220 + 6 + 166 + 80, y)) == (0, 0, 255)
    assert sample_path(Path("out"), _info(20, 1, 0)).as_posix() == ("out/step-000020/p1-i0.png")
    page = _samples_html(images)
    assert page.count('<img class="sample"') == 4 and "step 10" in page


def test_validation_prompts_flag_repeats() -> None:
    parser = argparse.ArgumentParser()
    add_spec_flags(parser)
    args = parser.parse_args(
        [
            "--instance-prompt",
            "a photo of sks dog",
            "--instance-data-prefix",
            "dogs",
            "--max-train-steps",
            "10",
            "--validation-prompt",
            "a photo of sks dog",
            "--validation-prompts",
            "sks dog on a beach",
            "--validation-prompts",
            "sks dog in the snow",
            "--num-validation-images",
            "2",
            "--webhook-url",
            "https://example.com/hook",
            "--webhook-event",
            "samples",
        ]
    )
    spec = build_spec(spec_from_args(args, None))
    assert list(spec.validation_prompts) == ["sks dog on a beach", "sks dog in the snow"]
    assert spec.num_validation_images == 2
    assert list(spec.webhook.events) == [pb.WEBHOOK_EVENT_SAMPLES]


def test_samples_is_a_job_command_of_the_lorafleet_entry_point() -> None:
    assert "samples" in JOB_COMMANDS
