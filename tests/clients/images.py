"""Small real images for client tests (the client decodes every image before uploading)."""

from __future__ import annotations

import io


def png_bytes(seed: int, size: int = 8) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (size, size), (seed * 40 % 256, 80, 160))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def jpeg_bytes(seed: int, size: int = 8) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (size, size), (seed * 40 % 256, 80, 160))
    out = io.BytesIO()
    image.save(out, format="JPEG")
    return out.getvalue()
