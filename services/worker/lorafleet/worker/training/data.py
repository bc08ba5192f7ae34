"""Training images: decoding and validation, captions, crops and flips, and the data order.

Inputs arrive as bytes the agent already downloaded (`TrainingImage`). They are decoded once, up
front, and every bad file is reported in one input-fault message, so a user fixes them all at
once. An image is refused when it is:

* unreadable: not an image, truncated or corrupt;
* unsupported: a format other than PNG, JPEG, WEBP, BMP or TIFF (GIF, PSD, EPS, ... are
  refused before any pixel is decoded);
* too small: its shorter side is under `min_image_side(resolution)` =
  max(64, resolution // 4) pixels (e.g. 256 px for 1024 px training), since upscaling further
  teaches the model blur;
* too large: more than 64 megapixels.

Accepted images are EXIF-rotated, made RGB (transparency composited on white), and resized once
(Lanczos) so their shorter side equals the resolution. Each training step then only crops a
`resolution`-square (centred, or at a random offset) and optionally mirrors it.

Order is deterministic and resumable: images are sorted by natural name order ("2.png" before
"10.png"), and `DataOrder` walks a seeded permutation per epoch whose state is checkpointed.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from lorafleet.worker.training.failures import input_fault

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF")
MIN_IMAGE_SIDE_PX = 64
MAX_IMAGE_PIXELS = 64_000_000
CAPTION_SUFFIX = ".txt"
ImageKind = Literal["instance", "class"]


@dataclass(frozen=True)
class TrainingImage:
    """One input image as bytes, with its caption (from a `.txt` beside it) when it has one."""

    name: str
    data: bytes = field(repr=False)
    caption: str | None = None


@dataclass(frozen=True, kw_only=True)
class PreparedImage:
    """A decoded image resized so that its shorter side equals the training resolution."""

    name: str
    # uint8, (3, H, W), min(H, W) == resolution.
    pixels: torch.Tensor = field(repr=False)
    # (height, width) before resizing: SDXL's "original size" micro-conditioning.
    original_size: tuple[int, int]
    caption: str | None
    sha256: str


def min_image_side(resolution: int) -> int:
    return max(MIN_IMAGE_SIDE_PX, resolution // 4)


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting "img2.png" before "img10.png"."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def images_from_files(files: Mapping[str, bytes]) -> list[TrainingImage]:
    """Pairs downloaded files into images: `x.txt` is the caption of `x.<ext>`.

    Every file that is not a `.txt` is treated as an image (decoding later refuses what is
    not). Captions must be UTF-8; a `.txt` with no image beside it is ignored.
    """
    captions: dict[str, str] = {}
    bad: list[str] = []
    for name, data in files.items():
        if name.lower().endswith(CAPTION_SUFFIX):
            try:
                captions[name[: -len(CAPTION_SUFFIX)]] = data.decode("utf-8").strip()
            except UnicodeDecodeError:
                bad.append(f"{name}: caption is not UTF-8 text")
    if bad:
        raise input_fault(f"{len(bad)} caption files cannot be used: " + "; ".join(bad))
    images = [
        TrainingImage(name, data, captions.get(name.rsplit(".", 1)[0]))
        for name, data in files.items()
        if not name.lower().endswith(CAPTION_SUFFIX)
    ]
    return sorted(images, key=lambda image: natural_key(image.name))


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _decode(image: TrainingImage, resolution: int) -> PreparedImage | str:
    """The prepared image, or the reason it cannot be used."""
    try:
        opened = Image.open(io.BytesIO(image.data))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        return f"unreadable ({_short(exc)})"
    except Image.DecompressionBombError:
        return f"too large (more than {MAX_IMAGE_PIXELS // 1_000_000} megapixels)"
    with opened:
        # Checked before any pixel is decoded: some plugins (EPS) run external programs on load.
        if opened.format not in SUPPORTED_FORMATS:
            return f"unsupported format {opened.format} (use {', '.join(SUPPORTED_FORMATS)})"
        width, height = opened.size
        if width * height > MAX_IMAGE_PIXELS:
            return f"too large ({width}x{height} px; at most {MAX_IMAGE_PIXELS:,} pixels)"
        try:
            opened.load()
            upright = ImageOps.exif_transpose(opened)
            rgb = _to_rgb(upright)
        except (OSError, ValueError, SyntaxError) as exc:
            return f"unreadable ({_short(exc)})"
    width, height = rgb.size
    smallest = min_image_side(resolution)
    if min(width, height) < smallest:
        return (
            f"too small ({width}x{height} px; the shorter side must be at least {smallest} px"
            f" to train at {resolution} px)"
        )
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    resized = rgb.resize(size, Image.Resampling.LANCZOS) if size != rgb.size else rgb
    pixels = torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    return PreparedImage(
        name=image.name,
        pixels=pixels,
        original_size=(height, width),
        caption=image.caption,
        sha256=hashlib.sha256(image.data).hexdigest(),
    )


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def prepare_images(
    images: Sequence[TrainingImage], *, resolution: int, kind: ImageKind
) -> list[PreparedImage]:
    """Decodes and resizes every image, in natural name order.

    Raises one input fault naming each unusable file and why, or saying there are none.
    """
    problems: list[str] = []
    prepared: list[PreparedImage] = []
    seen: set[str] = set()
    for image in sorted(images, key=lambda i: natural_key(i.name)):
        if image.name in seen:
            problems.append(f"{image.name}: duplicate name")
            continue
        seen.add(image.name)
        result = _decode(image, resolution)
        if isinstance(result, str):
            problems.append(f"{image.name}: {result}")
        else:
            prepared.append(result)
    if problems:
        raise input_fault(
            f"{len(problems)} of {len(images)} {kind} images cannot be used: " + "; ".join(problems)
        )
    return prepared


@dataclass(frozen=True)
class Sample:
    """One image of a batch, with its crop offset in the resized image and its flip."""

    image: int
    top: int
    left: int
    flip: bool


@dataclass
class DataOrder:
    """Which dataset index comes next: one seeded permutation per epoch and a position in it.

    Batches never straddle epochs (the last batch of an epoch may be smaller), as with a
    shuffling DataLoader. The whole state is three plain values, checkpointed as JSON.
    """

    size: int
    epoch: int = 0
    permutation: list[int] = field(default_factory=list)
    position: int = 0

    def next_indices(self, count: int, generator: torch.Generator) -> list[int]:
        if self.position >= len(self.permutation):
            self.permutation = torch.randperm(self.size, generator=generator).tolist()
            self.epoch += 1
            self.position = 0
        taken = self.permutation[self.position : self.position + count]
        self.position += len(taken)
        return taken

    def state(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "epoch": self.epoch,
            "permutation": list(self.permutation),
            "position": self.position,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataOrder:
        return cls(
            size=int(state["size"]),
            epoch=int(state["epoch"]),
            permutation=[int(i) for i in state["permutation"]],
            position=int(state["position"]),
        )


@dataclass(kw_only=True)
class TrainingData:
    """Instance images (and class images, for prior preservation) with their prompts.

    `images` holds the instance images first, then the class images. With prior preservation a
    batch is B instance samples followed by B class samples, paired by dataset index as in
    DreamBooth; the dataset is as long as the larger of the two sets.
    """

    images: list[PreparedImage]
    num_instance: int
    prompts: list[str]
    # Index into `prompts` per image.
    prompt_of: list[int]
    resolution: int
    center_crop: bool
    random_flip: bool
    order: DataOrder

    @classmethod
    def build(
        cls,
        *,
        instance: Sequence[PreparedImage],
        class_images: Sequence[PreparedImage],
        instance_prompt: str,
        class_prompt: str,
        use_captions: bool,
        resolution: int,
        center_crop: bool,
        random_flip: bool,
    ) -> TrainingData:
        prompts: list[str] = []
        prompt_of: list[int] = []
        for image in instance:
            text = image.caption.strip() if use_captions and image.caption else ""
            prompt_of.append(_intern(prompts, text or instance_prompt))
        for _ in class_images:
            prompt_of.append(_intern(prompts, class_prompt))
        size = max(len(instance), len(class_images))
        return cls(
            images=[*instance, *class_images],
            num_instance=len(instance),
            prompts=prompts,
            prompt_of=prompt_of,
            resolution=resolution,
            center_crop=center_crop,
            random_flip=random_flip,
            order=DataOrder(size=size),
        )

    @property
    def num_class(self) -> int:
        return len(self.images) - self.num_instance

    @property
    def deterministic(self) -> bool:
        """True when every sample of an image is the same tensor: no flip, no free crop.

        Then VAE latents can be computed once up front. A random crop of an image whose
        resized form is already square has nothing to choose.
        """
        if self.random_flip:
            return False
        return self.center_crop or all(
            tuple(image.pixels.shape[1:]) == (self.resolution, self.resolution)
            for image in self.images
        )

    def fixed_sample(self, image: int) -> Sample:
        """The only sample of `image` when `deterministic`."""
        top, left = self._centre(image)
        return Sample(image, top, left, False)

    def _centre(self, image: int) -> tuple[int, int]:
        height, width = self.images[image].pixels.shape[1:]
        return (height - self.resolution) // 2, (width - self.resolution) // 2

    def _draw(self, image: int, generator: torch.Generator) -> Sample:
        height, width = self.images[image].pixels.shape[1:]
        if self.center_crop:
            top, left = self._centre(image)
        else:
            # Only images with room to move draw offsets, so square inputs consume no randomness.
            top = _randint(height - self.resolution, generator)
            left = _randint(width - self.resolution, generator)
        flip = bool(torch.rand((), generator=generator) < 0.5) if self.random_flip else False
        return Sample(image, top, left, flip)

    def next_batch(self, batch_size: int, generator: torch.Generator) -> list[Sample]:
        indices = self.order.next_indices(batch_size, generator)
        samples = [self._draw(i % self.num_instance, generator) for i in indices]
        if self.num_class:
            samples += [
                self._draw(self.num_instance + i % self.num_class, generator) for i in indices
            ]
        return samples

    def pixels(self, samples: Iterable[Sample]) -> torch.Tensor:
        """Float batch in [-1, 1], (B, 3, R, R), on the host."""
        size = self.resolution
        crops = []
        for sample in samples:
            crop = self.images[sample.image].pixels[
                :, sample.top : sample.top + size, sample.left : sample.left + size
            ]
            crops.append(crop.flip(-1) if sample.flip else crop)
        return torch.stack(crops).float().div_(127.5).sub_(1.0)

    def time_ids(self, samples: Iterable[Sample]) -> torch.Tensor:
        """SDXL micro-conditioning per sample: original (h, w), crop (top, left), target (h, w)."""
        rows = [
            [*self.images[s.image].original_size, s.top, s.left, self.resolution, self.resolution]
            for s in samples
        ]
        return torch.tensor(rows, dtype=torch.float32)

    def prompt_indices(self, samples: Iterable[Sample]) -> torch.Tensor:
        return torch.tensor([self.prompt_of[s.image] for s in samples], dtype=torch.long)


def _intern(values: list[str], value: str) -> int:
    if value not in values:
        values.append(value)
    return values.index(value)


def _randint(high_inclusive: int, generator: torch.Generator) -> int:
    if high_inclusive <= 0:
        return 0
    return int(torch.randint(high_inclusive + 1, (), generator=generator))
