"""The scheduler reads announced checkpoints' and results' safetensors headers with ranged reads
(scheduler/formats.py), on S3 (boto3, moto's server) and the local store alike; the tensors
themselves are never read."""

from __future__ import annotations

import json
import struct

import pytest

from lorafleet.scheduler.formats import (
    MAX_HEADER_BYTES,
    BadFormat,
    check_lora_file,
    checkpoint_layout,
    layout_difference,
    safetensors_layout,
)
from lorafleet.scheduler.storage import ObjectStore
from tests.support.artifacts import (
    CHECKPOINT_TENSORS,
    checkpoint_blob,
    lora_blob,
    safetensors_bytes,
)


async def _stored(store: ObjectStore, data: bytes, key: str = "jobs/j/x") -> tuple[str, int]:
    await store.put_bytes(key, data)
    return key, len(data)


async def test_ranged_reads_stop_at_the_object_end(store: ObjectStore) -> None:
    key, _ = await _stored(store, b"0123456789")
    assert await store.read_range(key, 2, 3) == b"234"
    assert await store.read_range(key, 8, 10) == b"89"
    assert await store.read_range(key, 20, 4) == b""


async def test_well_formed_files_give_their_tensors(store: ObjectStore) -> None:
    key, size = await _stored(store, checkpoint_blob(10))
    layout = await checkpoint_layout(store, key, size_bytes=size)
    assert layout == {name: shape for name, (_, shape) in CHECKPOINT_TENSORS.items()}
    key, size = await _stored(store, lora_blob(), "jobs/j/result")
    await check_lora_file(store, key, size_bytes=size)


def _header(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


BAD_FILES = {
    "garbage": b"not a safetensors file at all",
    "short": b"\x01\x02",
    "header past the end": struct.pack("<Q", 10_000) + b"{}",
    "header over the bound": struct.pack("<Q", MAX_HEADER_BYTES + 1) + b" " * 64,
    "not json": struct.pack("<Q", 4) + b"{{{{",
    "trailing bytes": lora_blob() + b"\x00",
    "truncated data": lora_blob()[:-1],
    "a hole": _header(
        {"a.lora": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\x00" * 8
    ),
    "bytes unlike the shape": _header(
        {"a.lora": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 4
    ),
    "unknown dtype": _header(
        {"a.lora": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"
    ),
    "no tensors": _header({}),
    "not lora tensors": safetensors_bytes({"model.conv.weight": ("F32", (2, 2))}),
    # Deeper than the JSON parser's stack: a bad format, not an error of the scheduler's.
    "deep nesting": struct.pack("<Q", 400_000) + b"[" * 200_000 + b"]" * 200_000,
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
async def test_malformed_results_are_refused(store: ObjectStore, name: str) -> None:
    key, size = await _stored(store, BAD_FILES[name])
    with pytest.raises(BadFormat):
        await check_lora_file(store, key, size_bytes=size)


async def test_a_checkpoint_must_be_the_bundle(store: ObjectStore) -> None:
    # A bare safetensors file, and a bundle whose payload is malformed.
    for data in (lora_blob(), checkpoint_blob(10)[:-3]):
        key, size = await _stored(store, data)
        with pytest.raises(BadFormat):
            await checkpoint_layout(store, key, size_bytes=size)


def test_layouts_must_match_name_for_name_and_shape_for_shape() -> None:
    earlier = {"a": (4, 8), "b": (8,)}
    assert layout_difference(dict(earlier), earlier) is None
    assert "missing" in str(layout_difference({"a": (4, 8)}, earlier))
    assert "not in the earlier" in str(layout_difference({**earlier, "c": (1,)}, earlier))
    assert "shape" in str(layout_difference({"a": (4, 9), "b": (8,)}, earlier))


async def test_a_missing_object_is_a_bad_format(store: ObjectStore) -> None:
    with pytest.raises(BadFormat):
        await safetensors_layout(store, "jobs/j/none", size_bytes=100)
