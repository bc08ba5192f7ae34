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
(Lanczos) so that they cover their training size: a `resolution`-square, or with aspect-ratio
bucketing the bucket nearest their aspect ratio (`aspect_buckets`: sides multiples of 64, area
within resolution x resolution). Each training step then only crops the training size (centred,
or at a random offset) and optionally mirrors it. SDXL's micro-conditioning gets the true
original size, the crop's offset in the resized image and the training size.

Order is deterministic and resumable: images are sorted by natural name order ("2.png" before
"10.png"), and `DataOrder` walks a seeded permutation per epoch whose state is checkpointed;
with buckets an epoch is laid out batch by batch, each batch within one bucket, and that layout
is part of the checkpointed state.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import math
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
# Aspect-ratio buckets: sides are multiples of this; no bucket is more elongated than 4:1.
BUCKET_STEP_PX = 64
MAX_BUCKET_ASPECT = 4.0
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
    # (height, width) it is trained at: the resolution square, or its aspect-ratio bucket.
    # `pixels` covers it (both sides at least as large, one equal).
    target_size: tuple[int, int] = (0, 0)


def min_image_side(resolution: int) -> int:
    return max(MIN_IMAGE_SIDE_PX, resolution // 4)


def aspect_buckets(resolution: int) -> list[tuple[int, int]]:
    """The aspect-ratio buckets of a resolution, as (height, width), widest last.

    For every side length s (a multiple of 64), the largest bucket of that width and the largest
    of that height whose area is within resolution x resolution; none more elongated than 4:1.
    At 1024 px this gives SDXL's usual buckets (1024x1024, 1152x896, 1216x832, 1344x768, ...).
    """
    budget = resolution * resolution
    step = BUCKET_STEP_PX
    found: set[tuple[int, int]] = set()
    for side in range(step, budget // step + 1, step):
        other = budget // side // step * step
        if other < step:
            break
        if max(side, other) / min(side, other) <= MAX_BUCKET_ASPECT:
            found.update({(side, other), (other, side)})
    if not found:  # a resolution under 64 px is refused by the spec; keep the type total
        found.add((step, step))
    return sorted(found, key=lambda hw: (hw[1] / hw[0], hw[1]))


def nearest_bucket(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the image's (in log ratio); among equals, the
    first (the narrowest)."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda hw: abs(math.log(hw[1] / hw[0]) - aspect))


def covering_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of the image scaled to cover `target` (height, width), aspect kept."""
    scale = max(target[0] / height, target[1] / width)
    return max(target[1], round(width * scale)), max(target[0], round(height * scale))


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


def _decode(
    image: TrainingImage, resolution: int, buckets: Sequence[tuple[int, int]] | None
) -> PreparedImage | str:
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
    target = nearest_bucket(height, width, buckets) if buckets else (resolution, resolution)
    # Without buckets: the shorter side becomes the resolution.
    size = covering_size(height, width, target)
    resized = rgb.resize(size, Image.Resampling.LANCZOS) if size != rgb.size else rgb
    return PreparedImage(
        name=image.name,
        pixels=_tensor(resized),
        original_size=(height, width),
        caption=image.caption,
        sha256=hashlib.sha256(image.data).hexdigest(),
        target_size=target,
    )


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def prepare_images(
    images: Sequence[TrainingImage],
    *,
    resolution: int,
    kind: ImageKind,
    bucketing: bool = False,
) -> list[PreparedImage]:
    """Decodes and resizes every image, in natural name order; with `bucketing` each into the
    aspect-ratio bucket nearest its own aspect.

    Raises one input fault naming each unusable file and why, or saying there are none.
    """
    problems: list[str] = []
    prepared: list[PreparedImage] = []
    seen: set[str] = set()
    buckets = aspect_buckets(resolution) if bucketing else None
    for image in sorted(images, key=lambda i: natural_key(i.name)):
        if image.name in seen:
            problems.append(f"{image.name}: duplicate name")
            continue
        seen.add(image.name)
        result = _decode(image, resolution, buckets)
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
class Example:
    """One image of a batch, with its crop offset in the resized image and its flip.

    `size` is the (height, width) crop when it is not the image's own `target_size`: a class
    image paired with instance images of another bucket is trained at theirs."""

    image: int
    top: int
    left: int
    flip: bool
    size: tuple[int, int] | None = None


@dataclass
class DataOrder:
    """Which dataset index comes next: one seeded permutation per epoch and a position in it.

    Batches never straddle epochs (the last batch of an epoch may be smaller), as with a
    shuffling DataLoader. With aspect-ratio bucketing (`buckets`: the bucket of each dataset
    index) an epoch's permutation is split by bucket, each bucket's indices cut into batches,
    and the batches shuffled; the epoch is that layout, `batch_ends` marking where each batch
    ends (the last batch of each bucket may be smaller). The whole state is plain values,
    checkpointed as JSON.
    """

    size: int
    epoch: int = 0
    permutation: list[int] = field(default_factory=list)
    position: int = 0
    buckets: list[int] | None = None
    batch_ends: list[int] = field(default_factory=list)

    def next_indices(self, count: int, generator: torch.Generator) -> list[int]:
        if self.position >= len(self.permutation):
            self.permutation = torch.randperm(self.size, generator=generator).tolist()
            if self.buckets is not None:
                self._lay_out_batches(count, generator)
            self.epoch += 1
            self.position = 0
        end = self.position + count
        if self.buckets is not None:
            end = self.batch_ends[bisect.bisect_right(self.batch_ends, self.position)]
        taken = self.permutation[self.position : end]
        self.position += len(taken)
        return taken

    def _lay_out_batches(self, count: int, generator: torch.Generator) -> None:
        assert self.buckets is not None
        by_bucket: dict[int, list[int]] = {}
        for index in self.permutation:
            by_bucket.setdefault(self.buckets[index], []).append(index)
        batches = [
            indices[start : start + count]
            for _, indices in sorted(by_bucket.items())
            for start in range(0, len(indices), count)
        ]
        order = torch.randperm(len(batches), generator=generator).tolist()
        self.permutation, self.batch_ends = [], []
        for i in order:
            self.permutation += batches[i]
            self.batch_ends.append(len(self.permutation))

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "size": self.size,
            "epoch": self.epoch,
            "permutation": list(self.permutation),
            "position": self.position,
        }
        if self.buckets is not None:
            out["buckets"] = list(self.buckets)
            out["batch_ends"] = list(self.batch_ends)
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataOrder:
        buckets = state.get("buckets")
        return cls(
            size=int(state["size"]),
            epoch=int(state["epoch"]),
            permutation=[int(i) for i in state["permutation"]],
            position=int(state["position"]),
            buckets=None if buckets is None else [int(b) for b in buckets],
            batch_ends=[int(i) for i in state.get("batch_ends", [])],
        )


@dataclass(kw_only=True)
class TrainingData:
    """Instance images (and class images, for prior preservation) with their prompts.

    `images` holds the instance images first, then the class images. With prior preservation a
    batch is B instance samples followed by B class samples, paired by dataset index as in
    DreamBooth; the dataset is as long as the larger of the two sets (the instance images
    counted `repeats` times).

    With aspect-ratio bucketing (`bucketing`) each image is trained at its own `target_size`
    and a batch holds the instance images of one bucket; the class images paired with them are
    cropped to that bucket too (resized to cover it once, then kept).
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
    bucketing: bool = False
    # Class images resized to cover another bucket than their own, by (image, size).
    _covering: dict[tuple[int, tuple[int, int]], torch.Tensor] = field(
        default_factory=dict, repr=False
    )

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
        repeats: int = 1,
        bucketing: bool = False,
    ) -> TrainingData:
        prompts: list[str] = []
        prompt_of: list[int] = []
        for image in instance:
            text = image.caption.strip() if use_captions and image.caption else ""
            prompt_of.append(_intern(prompts, text or instance_prompt))
        for _ in class_images:
            prompt_of.append(_intern(prompts, class_prompt))
        # `repeats` lengthens the epoch by showing each instance image that many times (as
        # diffusers' script does); class images pair with dataset indices as before.
        size = max(len(instance) * repeats, len(class_images))
        order = DataOrder(size=size)
        if bucketing:
            # A batch is drawn within the bucket of its instance images.
            sizes = sorted({image.target_size for image in instance})
            order.buckets = [
                sizes.index(instance[i % len(instance)].target_size) for i in range(size)
            ]
        return cls(
            images=[*instance, *class_images],
            num_instance=len(instance),
            prompts=prompts,
            prompt_of=prompt_of,
            resolution=resolution,
            center_crop=center_crop,
            random_flip=random_flip,
            order=order,
            bucketing=bucketing,
        )

    @property
    def num_class(self) -> int:
        return len(self.images) - self.num_instance

    @property
    def deterministic(self) -> bool:
        """True when every example of an image is the same tensor: no flip, no free crop.

        Then VAE latents can be computed once up front. A random crop of an image whose
        resized form is already square has nothing to choose.
        """
        if self.random_flip:
            return False
        if self.num_class and len({image.target_size for image in self.images}) > 1:
            # Class images are cropped to the bucket of whichever instance images they pair.
            return False
        return self.center_crop or all(
            tuple(image.pixels.shape[1:]) == self.target(i) for i, image in enumerate(self.images)
        )

    def target(self, image: int) -> tuple[int, int]:
        """(height, width) the image is trained at by itself."""
        size = self.images[image].target_size
        return size if size != (0, 0) else (self.resolution, self.resolution)

    def fixed_example(self, image: int) -> Example:
        """The only example of `image` when `deterministic`."""
        top, left = self._centre(self.images[image].pixels, self.target(image))
        return Example(image, top, left, False)

    @staticmethod
    def _centre(pixels: torch.Tensor, size: tuple[int, int]) -> tuple[int, int]:
        height, width = pixels.shape[1:]
        return (height - size[0]) // 2, (width - size[1]) // 2

    def source(self, image: int, size: tuple[int, int]) -> torch.Tensor:
        """The image's pixels covering `size`: its own, or (a class image in another bucket)
        resized once to cover it."""
        if size == self.target(image):
            return self.images[image].pixels
        key = (image, size)
        if key not in self._covering:
            own = self.images[image].pixels
            picture = Image.fromarray(own.permute(1, 2, 0).numpy(), "RGB")
            cover = covering_size(own.shape[1], own.shape[2], size)
            self._covering[key] = _tensor(picture.resize(cover, Image.Resampling.LANCZOS))
        return self._covering[key]

    def _draw(
        self, image: int, generator: torch.Generator, size: tuple[int, int] | None = None
    ) -> Example:
        crop = size or self.target(image)
        pixels = self.source(image, crop)
        height, width = pixels.shape[1:]
        if self.center_crop:
            top, left = self._centre(pixels, crop)
        else:
            # Only images with room to move draw offsets, so square inputs consume no randomness.
            top = _randint(height - crop[0], generator)
            left = _randint(width - crop[1], generator)
        flip = bool(torch.rand((), generator=generator) < 0.5) if self.random_flip else False
        return Example(image, top, left, flip, None if crop == self.target(image) else crop)

    def next_batch(self, batch_size: int, generator: torch.Generator) -> list[Example]:
        indices = self.order.next_indices(batch_size, generator)
        examples = [self._draw(i % self.num_instance, generator) for i in indices]
        if self.num_class:
            # Class images are cropped to the instance images' size (one bucket a batch).
            size = self.target(examples[0].image)
            examples += [
                self._draw(self.num_instance + i % self.num_class, generator, size) for i in indices
            ]
        return examples

    def size_of(self, example: Example) -> tuple[int, int]:
        return example.size or self.target(example.image)

    def pixels(self, examples: Iterable[Example]) -> torch.Tensor:
        """Float batch in [-1, 1], (B, 3, H, W), on the host (one size a batch)."""
        crops = []
        for example in examples:
            height, width = self.size_of(example)
            crop = self.source(example.image, (height, width))[
                :, example.top : example.top + height, example.left : example.left + width
            ]
            crops.append(crop.flip(-1) if example.flip else crop)
        return torch.stack(crops).float().div_(127.5).sub_(1.0)

    def time_ids(self, examples: Iterable[Example]) -> torch.Tensor:
        """SDXL micro-conditioning per example: original (h, w), crop (top, left) in the resized
        image, target (h, w): the size it is trained at (its bucket with bucketing)."""
        rows = [
            [*self.images[s.image].original_size, s.top, s.left, *self.size_of(s)] for s in examples
        ]
        return torch.tensor(rows, dtype=torch.float32)

    def prompt_indices(self, examples: Iterable[Example]) -> torch.Tensor:
        return torch.tensor([self.prompt_of[s.image] for s in examples], dtype=torch.long)


def _intern(values: list[str], value: str) -> int:
    if value not in values:
        values.append(value)
    return values.index(value)


def _randint(high_inclusive: int, generator: torch.Generator) -> int:
    if high_inclusive <= 0:
        return 0
    return int(torch.randint(high_inclusive + 1, (), generator=generator))
