"""Image decoding and validation, captions, crops, flips, micro-conditioning and data order."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from lorafleet.core.model import FailureClass
from lorafleet.worker.training import TrainingFailure, TrainingImage, images_from_files
from lorafleet.worker.training.data import (
    DataOrder,
    TrainingData,
    min_image_side,
    natural_key,
    prepare_images,
)
from tests.support.images import image_bytes
from tests.support.training import TrainFn, tiny_spec


def _data(images: list[TrainingImage], **options: bool) -> TrainingData:
    prepared = prepare_images(images, resolution=64, kind="instance")
    return TrainingData.build(
        instance=prepared,
        class_images=[],
        instance_prompt="a photo of sks dog",
        class_prompt="",
        use_captions=True,
        resolution=64,
        center_crop=options.get("center_crop", False),
        random_flip=options.get("random_flip", False),
    )


def test_min_image_side_rule() -> None:
    assert min_image_side(64) == 64
    assert min_image_side(512) == 128
    assert min_image_side(1024) == 256


def test_every_bad_file_is_named_in_one_input_fault() -> None:
    png = image_bytes(0)
    images = [
        TrainingImage("good.png", png),
        TrainingImage("notes.png", b"this is not an image"),
        TrainingImage("truncated.png", png[: len(png) // 2]),
        TrainingImage("tiny.png", image_bytes(1, (40, 80))),
        TrainingImage("anim.gif", image_bytes(2, fmt="GIF")),
    ]
    with pytest.raises(TrainingFailure) as info:
        prepare_images(images, resolution=64, kind="instance")
    failure = info.value
    assert failure.failure_class is FailureClass.INPUT
    message = str(failure)
    assert message.startswith("4 of 5 instance images cannot be used")
    assert "notes.png: unreadable" in message
    assert "truncated.png: unreadable" in message
    assert "tiny.png: too small (40x80 px; the shorter side must be at least 64 px" in message
    assert "anim.gif: unsupported format GIF" in message
    assert "good.png" not in message


def test_too_small_depends_on_resolution() -> None:
    image = TrainingImage("small.png", image_bytes(0, (200, 200)))
    assert prepare_images([image], resolution=512, kind="class")
    with pytest.raises(TrainingFailure, match=r"small.png: too small \(200x200 px.*256 px"):
        prepare_images([image], resolution=1024, kind="class")


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(TrainingFailure, match=r"a\.png: duplicate name"):
        prepare_images(
            [TrainingImage("a.png", image_bytes(0)), TrainingImage("a.png", image_bytes(1))],
            resolution=64,
            kind="instance",
        )


def test_trainer_reports_bad_images_before_loading_anything(train: TrainFn) -> None:
    images = [TrainingImage("a.png", image_bytes(0)), TrainingImage("b.jpg", b"\xff\xd8junk")]
    with pytest.raises(TrainingFailure, match=r"1 of 2 instance images cannot be used: b\.jpg"):
        train(tiny_spec(), images)
    with pytest.raises(TrainingFailure, match="no instance images") as info:
        train(tiny_spec(), [])
    assert info.value.failure_class is FailureClass.INPUT


def test_decoding_resizes_shorter_side_and_keeps_original_size() -> None:
    [prepared] = prepare_images(
        [TrainingImage("wide.jpg", image_bytes(0, (300, 150), "JPEG"))],
        resolution=64,
        kind="instance",
    )
    assert prepared.pixels.dtype == torch.uint8
    assert tuple(prepared.pixels.shape) == (3, 64, 128)
    assert prepared.original_size == (150, 300)


def test_transparency_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    buffer = io.BytesIO()
    rgba.save(buffer, format="PNG")
    [prepared] = prepare_images(
        [TrainingImage("clear.png", buffer.getvalue())], resolution=64, kind="instance"
    )
    assert bool((prepared.pixels == 255).all())


def test_exif_orientation_is_applied() -> None:
    image = Image.fromarray(np.zeros((64, 128, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise for display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    [prepared] = prepare_images(
        [TrainingImage("rotated.jpg", buffer.getvalue())], resolution=64, kind="instance"
    )
    assert prepared.original_size == (128, 64)


def test_images_from_files_pairs_captions_and_sorts_naturally() -> None:
    files = {
        "img10.png": image_bytes(10),
        "img2.png": image_bytes(2),
        "img2.txt": b"  a photo of sks dog on a beach \n",
        "orphan.txt": b"no image",
    }
    images = images_from_files(files)
    assert [i.name for i in images] == ["img2.png", "img10.png"]
    assert images[0].caption == "a photo of sks dog on a beach"
    assert images[1].caption is None
    with pytest.raises(TrainingFailure, match=r"bad\.txt: caption is not UTF-8"):
        images_from_files({"bad.png": image_bytes(0), "bad.txt": b"\xff\xfe\xfa"})


def test_natural_key() -> None:
    assert sorted(["b10", "b2", "a", "b1"], key=natural_key) == ["a", "b1", "b2", "b10"]


def test_captions_become_prompts() -> None:
    data = _data(
        [
            TrainingImage("a.png", image_bytes(0), caption="sks dog running"),
            TrainingImage("b.png", image_bytes(1), caption=""),
            TrainingImage("c.png", image_bytes(2)),
        ]
    )
    assert data.prompts == ["sks dog running", "a photo of sks dog"]
    assert data.prompt_of == [0, 1, 1]


def test_augmentation_decides_whether_latents_can_be_cached() -> None:
    square = [TrainingImage("a.png", image_bytes(0))]
    wide = [TrainingImage("a.png", image_bytes(0, (96, 64)))]
    assert _data(square).deterministic
    assert not _data(square, random_flip=True).deterministic
    assert not _data(wide).deterministic  # a random crop has room to move
    assert _data(wide, center_crop=True).deterministic


def test_crops_flips_and_time_ids() -> None:
    data = _data([TrainingImage("wide.png", image_bytes(0, (96, 64)))], random_flip=True)
    generator = torch.Generator().manual_seed(0)
    samples = [data.next_batch(1, generator)[0] for _ in range(40)]
    assert {s.top for s in samples} == {0}
    assert len({s.left for s in samples}) > 5
    assert all(0 <= s.left <= 32 for s in samples)
    assert {s.flip for s in samples} == {True, False}
    sample = samples[0]
    pixels = data.pixels([sample])
    assert tuple(pixels.shape) == (1, 3, 64, 64)
    assert float(pixels.min()) >= -1.0
    assert float(pixels.max()) <= 1.0
    source = data.images[0].pixels[:, :, sample.left : sample.left + 64].float() / 127.5 - 1
    expected = source.flip(-1) if sample.flip else source
    assert torch.equal(pixels[0], expected)
    time_ids = data.time_ids([sample])
    assert time_ids.tolist() == [[64.0, 96.0, 0.0, float(sample.left), 64.0, 64.0]]


def test_center_crop_is_centred() -> None:
    data = _data([TrainingImage("wide.png", image_bytes(0, (96, 64)))], center_crop=True)
    [sample] = data.next_batch(1, torch.Generator().manual_seed(0))
    assert (sample.top, sample.left, sample.flip) == (0, 16, False)


def test_data_order_walks_permutations_and_round_trips() -> None:
    generator = torch.Generator().manual_seed(3)
    order = DataOrder(size=5)
    batches = [order.next_indices(2, generator) for _ in range(3)]
    assert [len(b) for b in batches] == [2, 2, 1]
    assert sorted(i for batch in batches for i in batch) == [0, 1, 2, 3, 4]
    copy = DataOrder.from_state(order.state())
    generator_copy = torch.Generator()
    generator_copy.set_state(generator.get_state())
    assert order.next_indices(2, generator) == copy.next_indices(2, generator_copy)
    assert order.epoch == 2


def test_prior_preservation_pairs_instance_and_class_samples() -> None:
    instance = prepare_images(
        [TrainingImage("i.png", image_bytes(0))], resolution=64, kind="instance"
    )
    classes = prepare_images(
        [TrainingImage(f"c{i}.png", image_bytes(10 + i)) for i in range(3)],
        resolution=64,
        kind="class",
    )
    data = TrainingData.build(
        instance=instance,
        class_images=classes,
        instance_prompt="sks dog",
        class_prompt="dog",
        use_captions=False,
        resolution=64,
        center_crop=False,
        random_flip=False,
    )
    assert data.order.size == 3  # as long as the larger set
    batch = data.next_batch(2, torch.Generator().manual_seed(0))
    assert [s.image for s in batch[:2]] == [0, 0]
    assert all(s.image >= 1 for s in batch[2:])
    assert data.prompts == ["sks dog", "dog"]
