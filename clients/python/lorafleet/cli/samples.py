"""`lorafleet samples JOB`: a job's validation images, downloaded by step, drawn as one
grid picture (prompts by row, steps by column), or queued on request for a finished job.

The grid needs Pillow (the `worker` extra ships it), like the timeline's PNG output.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path

from lorafleet.client.api import AsyncClient, SampleImageInfo
from lorafleet.core.errors import FailedPrecondition

# Every cell is at least this many pixels wide (tiny models make 64 px images).
MIN_CELL_PX = 160
LABEL_PX = 220
HEADER_PX = 28
PAD_PX = 6


def sample_path(directory: Path, image: SampleImageInfo) -> Path:
    return directory / f"step-{image.step:06d}" / f"p{image.prompt_index}-i{image.image_index}.png"


def render_grid(images: Sequence[tuple[SampleImageInfo, bytes]]) -> bytes:
    """One PNG: a row per (prompt, image index), a column per step, labelled both ways."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise FailedPrecondition(
            "--grid needs Pillow: `pip install pillow` (or lorafleet[worker])"
        ) from None
    if not images:
        raise FailedPrecondition("the job has no validation images yet")
    steps = sorted({info.step for info, _ in images})
    rows = sorted({(info.prompt_index, info.image_index) for info, _ in images})
    prompts = {info.prompt_index: info.prompt for info, _ in images}
    decoded = {
        (info.step, info.prompt_index, info.image_index): Image.open(io.BytesIO(data)).convert(
            "RGB"
        )
        for info, data in images
    }
    first = next(iter(decoded.values()))
    cell = max(MIN_CELL_PX, first.width)
    height = round(cell * first.height / first.width)
    width_px = LABEL_PX + len(steps) * (cell + PAD_PX) + PAD_PX
    height_px = HEADER_PX + len(rows) * (height + PAD_PX) + PAD_PX
    canvas = Image.new("RGB", (width_px, height_px), "#ffffff")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=14)
    for column, step in enumerate(steps):
        x = LABEL_PX + PAD_PX + column * (cell + PAD_PX)
        draw.text((x + 4, 6), f"step {step}", fill="#111111", font=font)
    for row, (prompt_index, image_index) in enumerate(rows):
        y = HEADER_PX + PAD_PX + row * (height + PAD_PX)
        label = textwrap.wrap(prompts.get(prompt_index, ""), width=26)[:6]
        label.append(f"image {image_index}")
        draw.multiline_text((6, y + 2), "\n".join(label), fill="#111111", font=font, spacing=3)
        for column, step in enumerate(steps):
            x = LABEL_PX + PAD_PX + column * (cell + PAD_PX)
            picture = decoded.get((step, prompt_index, image_index))
            if picture is None:
                draw.rectangle((x, y, x + cell - 1, y + height - 1), outline="#cccccc")
                continue
            canvas.paste(picture.resize((cell, height), Image.Resampling.NEAREST), (x, y))
    out = io.BytesIO()
    canvas.save(out, format="PNG")
    return out.getvalue()


async def samples_command(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.prompt or args.step:
        steps = await client.request_samples(
            args.job_id,
            prompts=args.prompt,
            steps=args.step,
            negative_prompt=args.negative_prompt or "",
            num_images=args.images or 0,
            inference_steps=args.inference_steps or 0,
            guidance_scale=args.guidance_scale or 0.0,
            seed=args.seed or 0,
        )
        print(f"queued sample tasks for step(s) {', '.join(map(str, steps))}")
        return 0
    downloaded = await client.download_samples(args.job_id)
    if not downloaded:
        job = await client.get(args.job_id)
        if job.spec.sample_prompts:
            print("no validation images yet")
        else:
            # "yet" promised images that a job without validation prompts never makes.
            print(
                f"{args.job_id} has no validation prompts; ask for images of a finished job with"
                f" `lorafleet samples {args.job_id} --prompt P --step N`"
            )
        return 1
    directory = Path(args.output or f"{args.job_id}-samples")
    for info, data in downloaded:
        path = sample_path(directory, info)
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(path.write_bytes, data)
    print(f"wrote {len(downloaded)} images under {directory}")
    if args.grid:
        grid = await asyncio.to_thread(render_grid, downloaded)
        await asyncio.to_thread(Path(args.grid).write_bytes, grid)
        print(f"wrote {args.grid}")
    return 0


SAMPLES_HELP = "download a job's validation images (--grid FILE: one picture), or queue new ones"


def add_samples_arguments(p: argparse.ArgumentParser) -> None:
    """The `samples` command's own arguments; commands.py adds the parser and connection flags
    (so this module never imports commands.py, which imports it)."""
    p.add_argument("job_id")
    p.add_argument("-o", "--output", help="directory for the images (default JOB-samples)")
    p.add_argument("--grid", help="also write one PNG: prompts by row, steps by column")
    p.add_argument(
        "--prompt", action="append", default=[], help="queue new samples with this prompt"
    )
    p.add_argument(
        "--step",
        action="append",
        type=int,
        default=[],
        help="queue new samples at this step (a kept checkpoint's, or the result's)",
    )
    p.add_argument("--negative-prompt")
    p.add_argument("--images", type=int, help="images per prompt (default: the job's)")
    p.add_argument("--inference-steps", type=int)
    p.add_argument("--guidance-scale", type=float)
    p.add_argument("--seed", type=int)
