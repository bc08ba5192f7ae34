"""Aspect-ratio bucketing: the buckets, each image in the one nearest its aspect,
batches within one bucket, SDXL's micro-conditioning with the true values, and an exact resume
through the checkpointed batch layout."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.serde import spec_from_proto, spec_to_proto
from lorafleet.worker.training import (
    Finished,
    Stopped,
    TrainingImage,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.data import (
    DataOrder,
    TrainingData,
    aspect_buckets,
    nearest_bucket,
    prepare_images,
)
from tests.support.images import image_bytes
from tests.support.training import Recorder, TrainFn, lora_tensors, same_tensors, tiny_spec

# Several training runs of the tiny model per test: slow, not in the fast lane (README,
# Development).
pytestmark = pytest.mark.slow

RESOLUTION = 128
# (width, height): landscape 2:1, square, portrait 1:2, wide 4:1, a second landscape.
SIZES = [(256, 128), (128, 128), (128, 256), (256, 64), (200, 100)]


def _images(sizes: list[tuple[int, int]] = SIZES) -> list[TrainingImage]:
    return [TrainingImage(f"img{i}.png", image_bytes(i, size)) for i, size in enumerate(sizes)]


def _data(
    images: list[TrainingImage], *, class_images: Sequence[TrainingImage] = (), **options: Any
) -> TrainingData:
    prepared = prepare_images(images, resolution=RESOLUTION, kind="instance", bucketing=True)
    classes = prepare_images(
        list(class_images), resolution=RESOLUTION, kind="class", bucketing=True
    )
    return TrainingData.build(
        instance=prepared,
        class_images=classes,
        instance_prompt="a photo of sks dog",
        class_prompt="a photo of a dog",
        use_captions=False,
        resolution=RESOLUTION,
        center_crop=options.get("center_crop", False),
        random_flip=options.get("random_flip", False),
        bucketing=True,
    )


def test_sdxl_buckets_at_1024() -> None:
    buckets = aspect_buckets(1024)
    for height, width in buckets:
        assert height % 64 == 0 and width % 64 == 0
        assert height * width <= 1024 * 1024
        assert max(height, width) / min(height, width) <= 4
        assert (width, height) in buckets  # portrait and landscape alike
    for bucket in [(1024, 1024), (896, 1152), (832, 1216), (768, 1344), (640, 1536)]:
        assert bucket in buckets
    # Nearest aspect: a 3:2 photo goes to 832x1216 (1.46), a 16:9 one to 768x1344 (1.75).
    assert nearest_bucket(4000, 6000, buckets) == (832, 1216)
    assert nearest_bucket(1080, 1920, buckets) == (768, 1344)
    assert nearest_bucket(1920, 1080, buckets) == (1344, 768)
    assert nearest_bucket(500, 500, buckets) == (1024, 1024)


def test_each_image_is_resized_to_cover_its_nearest_bucket() -> None:
    prepared = prepare_images(_images(), resolution=RESOLUTION, kind="instance", bucketing=True)
    buckets = aspect_buckets(RESOLUTION)
    for image, (width, height) in zip(prepared, SIZES, strict=True):
        target = image.target_size
        assert target == nearest_bucket(height, width, buckets)
        assert image.original_size == (height, width)
        h, w = image.pixels.shape[1:]
        # Covers the bucket with the aspect kept: one side equal, the other at least as large.
        assert h >= target[0] and w >= target[1] and (h == target[0] or w == target[1])
        assert math.isclose(w / h, width / height, rel_tol=0.05)
    assert prepared[1].target_size == (128, 128)
    assert prepared[2].target_size[0] > prepared[2].target_size[1]  # portrait stays portrait
    # Off: every image trains at the resolution square, as before.
    square = prepare_images(_images(), resolution=RESOLUTION, kind="instance")
    assert {image.target_size for image in square} == {(RESOLUTION, RESOLUTION)}


def test_batches_hold_one_bucket_and_cover_the_epoch() -> None:
    data = _data(_images(), random_flip=True)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        seen: list[int] = []
        while True:
            samples = data.next_batch(2, generator)
            sizes = {data.size_of(s) for s in samples}
            assert len(sizes) == 1
            pixels = data.pixels(samples)
            (height, width) = sizes.pop()
            assert pixels.shape == (len(samples), 3, height, width)
            ids = data.time_ids(samples)
            for sample, row in zip(samples, ids.tolist(), strict=True):
                image = data.images[sample.image]
                # SDXL's conditioning: true original size, crop offset, bucket size.
                assert row == [*image.original_size, sample.top, sample.left, height, width]
            seen += [s.image for s in samples]
            if data.order.position >= len(data.order.permutation):
                break
        assert sorted(seen) == list(range(len(SIZES)))


def test_the_batch_layout_round_trips_through_the_checkpoint_state() -> None:
    data = _data(_images())
    generator = torch.Generator().manual_seed(5)
    data.next_batch(2, generator)
    state = data.order.state()
    assert state["buckets"] == data.order.buckets and state["batch_ends"]
    restored = DataOrder.from_state(state)
    copy = torch.Generator().manual_seed(0)
    copy.set_state(generator.get_state())
    for _ in range(7):
        assert data.order.next_indices(2, generator) == restored.next_indices(2, copy)


def test_class_images_are_cropped_to_the_instance_bucket() -> None:
    data = _data(_images(), class_images=_images([(128, 128), (128, 128)]))
    generator = torch.Generator().manual_seed(1)
    assert not data.deterministic
    for _ in range(6):
        samples = data.next_batch(1, generator)
        assert len(samples) == 2
        instance, paired = samples
        assert data.size_of(paired) == data.size_of(instance)
        assert data.pixels(samples).shape[2:] == data.size_of(instance)


def test_the_field_is_in_the_proto_and_validated_by_name() -> None:
    spec = tiny_spec(aspect_ratio_bucketing=True)
    assert spec_from_proto(spec_to_proto(spec)).aspect_ratio_bucketing is True
    with pytest.raises(InvalidArgument) as caught:
        tiny_spec(aspect_ratio_bucketing=True, output_format="pdf")
    assert caught.value.field == "output_format"


def test_bucketed_training_resumes_bit_identically(train: TrainFn) -> None:
    spec = tiny_spec(
        resolution=RESOLUTION,
        aspect_ratio_bucketing=True,
        train_batch_size=2,
        random_flip=True,
        max_train_steps=5,
    )
    images = _images()
    full, _ = train(spec, images)
    assert isinstance(full, Finished)
    first, _ = train(spec, images, recorder=Recorder(stop_at=2))
    assert isinstance(first, Stopped) and first.snapshot is not None
    order = first.snapshot.state["data_order"]
    assert order["buckets"] and order["batch_ends"]
    resumed, _ = train(spec, images, resume=load_checkpoint(serialize_checkpoint(first.snapshot)))
    assert same_tensors(lora_tensors(full), lora_tensors(resumed))
    # Bucketing changes what is trained (the square crop sees other pixels).
    square, _ = train(tiny_spec(**{**spec.to_dict(), "aspect_ratio_bucketing": False}), images)
    assert not same_tensors(lora_tensors(full), lora_tensors(square))


def test_bucketed_latents_are_cached_per_image_and_train_like_uncached(
    train: TrainFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No flip and centred crops: each image has one sample, encoded once up front at its own
    bucket's size (sizes differ, so one by one); the result is that of encoding every step."""
    spec = tiny_spec(
        resolution=RESOLUTION, aspect_ratio_bucketing=True, center_crop=True, max_train_steps=3
    )
    cached, _ = train(spec, _images())
    monkeypatch.setattr(TrainingData, "deterministic", property(lambda self: False))
    uncached, _ = train(spec, _images())
    a, b = lora_tensors(cached), lora_tensors(uncached)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
