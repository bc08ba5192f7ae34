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
    kohya_blob,
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
    await check_lora_file(store, key, size_bytes=size, file_format="diffusers", rank=4)
    key, size = await _stored(store, kohya_blob(), "jobs/j/kohya")
    await check_lora_file(store, key, size_bytes=size, file_format="kohya", rank=4)


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
    # What an outside attack delivered as a FLUX.2 job's result: it loaded as a silent no-op.
    "one made-up lora tensor": safetensors_bytes({"lora.weights": ("F32", (4,))}),
    # Deeper than the JSON parser's stack: a bad format, not an error of the scheduler's.
    "deep nesting": struct.pack("<Q", 400_000) + b"[" * 200_000 + b"]" * 200_000,
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
async def test_malformed_results_are_refused(store: ObjectStore, name: str) -> None:
    key, size = await _stored(store, BAD_FILES[name])
    with pytest.raises(BadFormat):
        await check_lora_file(store, key, size_bytes=size, file_format="diffusers", rank=4)


A, B = (
    "transformer.blocks.0.attn.to_q.lora_A.weight",
    "transformer.blocks.0.attn.to_q.lora_B.weight",
)
DOWN, UP = "lora_unet_blocks_0_to_q.lora_down.weight", "lora_unet_blocks_0_to_q.lora_up.weight"
NOT_THE_JOBS_LORA: dict[str, tuple[str, dict[str, tuple[str, tuple[int, ...]]]]] = {
    "rank 8 for a job of rank 4": ("diffusers", {A: ("F32", (8, 16)), B: ("F32", (16, 8))}),
    "ranks that disagree": ("diffusers", {A: ("F32", (4, 16)), B: ("F32", (16, 2))}),
    "an A without its B": ("diffusers", {A: ("F32", (4, 16))}),
    "a B without its A": ("diffusers", {B: ("F32", (16, 4))}),
    "a kohya file as the diffusers one": (
        "diffusers",
        {DOWN: ("F32", (4, 16)), UP: ("F32", (16, 4))},
    ),
    "a diffusers file as the kohya one": ("kohya", {A: ("F32", (4, 16)), B: ("F32", (16, 4))}),
    "a kohya alpha with no adapter": (
        "kohya",
        {
            DOWN: ("F32", (4, 16)),
            UP: ("F32", (16, 4)),
            "lora_unet_x.alpha": ("F32", ()),
        },
    ),
    "a kohya alpha that is no scalar": (
        "kohya",
        {
            DOWN: ("F32", (4, 16)),
            UP: ("F32", (16, 4)),
            DOWN.replace(".lora_down.weight", ".alpha"): ("F32", (4,)),
        },
    ),
    "a kohya rank that is no multiple": ("kohya", {DOWN: ("F32", (6, 16)), UP: ("F32", (16, 6))}),
}


@pytest.mark.parametrize("name", sorted(NOT_THE_JOBS_LORA))
async def test_a_result_must_be_adapters_of_the_jobs_rank_in_its_layout(
    store: ObjectStore, name: str
) -> None:
    file_format, tensors = NOT_THE_JOBS_LORA[name]
    key, size = await _stored(store, safetensors_bytes(tensors))
    with pytest.raises(BadFormat):
        await check_lora_file(store, key, size_bytes=size, file_format=file_format, rank=4)


async def test_a_kohya_file_may_fuse_adapters_of_the_rank(store: ObjectStore) -> None:
    """FLUX.2's kohya layout stacks a block's q, k and v adapters into one of rank 3r."""
    fused = {
        DOWN: ("F32", (12, 16)),
        UP: ("F32", (48, 12)),
        "lora_unet_blocks_0_to_q.alpha": ("F32", ()),
    }
    key, size = await _stored(store, safetensors_bytes(fused))
    await check_lora_file(store, key, size_bytes=size, file_format="kohya", rank=4)


async def test_a_diffusers_result_holds_the_adapters_the_checkpoints_trained(
    store: ObjectStore,
) -> None:
    """The job's verified checkpoints name its adapters (`lora/<module>/<path>`): a result
    must hold the same ones, shape for shape, not a well-formed LoRA of other modules."""
    checkpoint = {
        "lora/transformer/blocks.0.attn.to_q.lora_A.default.weight": (4, 16),
        "lora/transformer/blocks.0.attn.to_q.lora_B.default.weight": (16, 4),
        "optimizer/state/0/exp_avg": (4, 16),
    }
    right = {A: ("F32", (4, 16)), B: ("F32", (16, 4))}
    key, size = await _stored(store, safetensors_bytes(right))
    await check_lora_file(
        store, key, size_bytes=size, file_format="diffusers", rank=4, checkpoint=checkpoint
    )
    other_module = {A: ("F32", (4, 32)), B: ("F32", (32, 4))}
    extra_adapter = {
        **right,
        A.replace("to_q", "to_k"): ("F32", (4, 16)),
        B.replace("to_q", "to_k"): ("F32", (16, 4)),
    }
    for tensors in (other_module, extra_adapter):
        key, size = await _stored(store, safetensors_bytes(tensors))
        with pytest.raises(BadFormat, match="the job's checkpoints trained"):
            await check_lora_file(
                store, key, size_bytes=size, file_format="diffusers", rank=4, checkpoint=checkpoint
            )


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
