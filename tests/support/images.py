"""The one picture generator of the suite: smooth random pictures (gradients), so training sees
real gradients and crops and flips change pixels; any size, format and mode."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

RESOLUTION = 64


def image_bytes(
    seed: int, size: tuple[int, int] = (RESOLUTION, RESOLUTION), fmt: str = "PNG", mode: str = "RGB"
) -> bytes:
    """A smooth random picture of `size` (width, height), encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    width, height = size
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.02, 0.2), rng.uniform(0.02, 0.2), rng.uniform(0, 6.28)
        channels.append(127.5 + 127.5 * np.sin(fx * xs + fy * ys + phase))
    array = np.stack(channels, axis=-1).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(array, "RGB")
    if mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def png(seed: int, size: int = RESOLUTION) -> bytes:
    """A square PNG picture."""
    return image_bytes(seed, (size, size))


def jpeg(seed: int, size: int = RESOLUTION) -> bytes:
    """A square JPEG picture."""
    return image_bytes(seed, (size, size), fmt="JPEG")
