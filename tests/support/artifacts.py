"""Checkpoints and results in their real formats, for scripted workers: the scheduler reads each
announced object's safetensors header (scheduler/formats.py), so garbage bytes are refused.
Built by hand (no torch): a safetensors file is an 8-byte little-endian header length, a JSON
header, then the tensors' bytes."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping

_DTYPE_BYTES = {"F32": 4, "F16": 2, "I64": 8, "U8": 1}

# What a worker's checkpoint holds (LoRA weights, optimizer state, RNG state), in miniature.
CHECKPOINT_TENSORS: dict[str, tuple[str, tuple[int, ...]]] = {
    "lora.unet.down.weight": ("F32", (4, 8)),
    "lora.unet.up.weight": ("F32", (8, 4)),
    "optimizer.state.0.exp_avg": ("F32", (4, 8)),
    "rng.torch": ("U8", (16,)),
}
# A diffusers LoRA file, in miniature (rank 4, the spec's default).
LORA_TENSORS: dict[str, tuple[str, tuple[int, ...]]] = {
    "unet.down_blocks.0.attn.to_k.lora_A.weight": ("F32", (4, 8)),
    "unet.down_blocks.0.attn.to_k.lora_B.weight": ("F32", (8, 4)),
}
# The same LoRA in kohya's layout.
KOHYA_TENSORS: dict[str, tuple[str, tuple[int, ...]]] = {
    "lora_unet_down_blocks_0_attn_to_k.lora_down.weight": ("F32", (4, 8)),
    "lora_unet_down_blocks_0_attn_to_k.lora_up.weight": ("F32", (8, 4)),
    "lora_unet_down_blocks_0_attn_to_k.alpha": ("F32", ()),
}


def safetensors_bytes(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
    fill: int = 0,
) -> bytes:
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * _DTYPE_BYTES[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes([fill % 256]) * offset


def checkpoint_blob(
    step: int, tensors: Mapping[str, tuple[str, tuple[int, ...]]] = CHECKPOINT_TENSORS
) -> bytes:
    """A checkpoint bundle (format 1) of `step`: magic, the payload's sha256, the payload."""
    payload = safetensors_bytes(tensors, {"lorafleet.state": json.dumps({"step": step})})
    return b"LFCKPT\x00\x01" + hashlib.sha256(payload).digest() + payload


def lora_blob(fill: int = 0) -> bytes:
    """A LoRA result file (`fill` varies its bytes)."""
    return safetensors_bytes(LORA_TENSORS, fill=fill)


def kohya_blob(fill: int = 0) -> bytes:
    """A kohya-layout LoRA result file (`fill` varies its bytes)."""
    return safetensors_bytes(KOHYA_TENSORS, fill=fill)
