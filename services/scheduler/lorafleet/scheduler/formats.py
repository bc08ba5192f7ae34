"""What checkpoints and results must look like before the ledger records them.

The store's checksum says the bytes are what a worker announced; it says nothing of what they
are. A holder could announce garbage (or a tiny file) as a checkpoint or a result, and the
fleet would record it, hand it to the next holder, deliver it to the owner and time its pace
by it. So the scheduler reads each announced object's safetensors header with ranged reads
(never the tensors) and refuses what is not one:

* a result (diffusers or kohya LoRA file) is a safetensors file: an 8-byte little-endian header
  length, a JSON header of at most `MAX_HEADER_BYTES`, then the data, every byte of which the
  header's tensors cover exactly once (the object's size must match); every tensor is a LoRA
  tensor (its name says "lora");
* a checkpoint is the worker's bundle (`lorafleet.worker.training.checkpoint`, format 1): the
  magic `LFCKPT\\x00\\x01`, a 32-byte digest, then a safetensors file as above holding the LoRA
  weights, the optimizer state and the RNG states; its tensors' names and shapes must equal
  those of the job's earlier verified checkpoints (a resumed run continues the same tensors).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

from lorafleet.core.model import CHECKPOINT_DIGEST_BYTES, CHECKPOINT_MAGIC
from lorafleet.scheduler.storage import ObjectNotFound, ObjectStore

# The worker's checkpoint bundle (format version 1): magic, then the sha256 of the payload.
CHECKPOINT_PREFIX_BYTES = len(CHECKPOINT_MAGIC) + CHECKPOINT_DIGEST_BYTES
# An SDXL LoRA checkpoint with its optimizer state names a few thousand tensors (~1 MB of
# header); far above that is no checkpoint, and the scheduler reads no more.
MAX_HEADER_BYTES = 16 * 1024 * 1024

_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# Tensor name -> shape.
Layout = Mapping[str, tuple[int, ...]]


class BadFormat(Exception):
    """The object is not what its announcement says it is (the reason says why)."""


async def safetensors_layout(
    storage: ObjectStore, key: str, *, size_bytes: int, offset: int = 0
) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) of the safetensors file stored at `key` from byte `offset`
    to its end (`size_bytes`, the verified size); raises `BadFormat` unless the header is
    well-formed, bounded, and covers the data exactly."""
    prefix = await _read(storage, key, offset, 8)
    if len(prefix) < 8:
        raise BadFormat("too short for a safetensors file")
    (header_bytes,) = struct.unpack("<Q", prefix)
    data_bytes = size_bytes - offset - 8 - header_bytes
    if header_bytes > MAX_HEADER_BYTES or data_bytes < 0:
        raise BadFormat(f"a safetensors header of {header_bytes} bytes does not fit the object")
    raw = await _read(storage, key, offset + 8, header_bytes)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than the parser's stack (no safetensors header is).
        raise BadFormat("the safetensors header is not JSON") from exc
    if not isinstance(header, dict):
        raise BadFormat("the safetensors header is not an object")
    layout: dict[str, tuple[int, ...]] = {}
    spans: list[tuple[int, int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape, span = _tensor(name, entry)
        layout[name] = shape
        spans.append(span)
    # Every byte of the data is one tensor's, in order, with nothing left over: the object's
    # size is what the header says.
    position = 0
    for start, end in sorted(spans):
        if start != position:
            raise BadFormat("the safetensors header does not cover the data exactly")
        position = end
    if position != data_bytes:
        raise BadFormat(
            f"the safetensors header covers {position} bytes of data, the object {data_bytes}"
        )
    return layout


async def checkpoint_layout(
    storage: ObjectStore, key: str, *, size_bytes: int
) -> dict[str, tuple[int, ...]]:
    """The tensors of a checkpoint bundle; `BadFormat` unless it is one."""
    if await _read(storage, key, 0, len(CHECKPOINT_MAGIC)) != CHECKPOINT_MAGIC:
        raise BadFormat("not a lorafleet checkpoint (bad magic)")
    layout = await safetensors_layout(
        storage, key, size_bytes=size_bytes, offset=CHECKPOINT_PREFIX_BYTES
    )
    if not layout:
        raise BadFormat("a checkpoint without tensors")
    return layout


async def check_lora_file(storage: ObjectStore, key: str, *, size_bytes: int) -> None:
    """A result file: a safetensors file of LoRA tensors only; `BadFormat` otherwise."""
    layout = await safetensors_layout(storage, key, size_bytes=size_bytes)
    if not layout:
        raise BadFormat("a LoRA file without tensors")
    strangers = [name for name in layout if "lora" not in name.lower()]
    if strangers:
        raise BadFormat(f"not a LoRA file: tensor {strangers[0][:200]!r}")


def layout_difference(announced: Layout, earlier: Layout) -> str | None:
    """Why a checkpoint's tensors differ from an earlier verified checkpoint's, or None."""
    missing = sorted(earlier.keys() - announced.keys())
    if missing:
        return f"tensor {missing[0][:200]!r} of the earlier checkpoints is missing"
    extra = sorted(announced.keys() - earlier.keys())
    if extra:
        return f"tensor {extra[0][:200]!r} is not in the earlier checkpoints"
    for name, shape in sorted(announced.items()):
        if earlier[name] != shape:
            return f"tensor {name[:200]!r} has shape {list(shape)}, earlier {list(earlier[name])}"
    return None


def _tensor(name: str, entry: object) -> tuple[tuple[int, ...], tuple[int, int]]:
    if not isinstance(entry, dict):
        raise BadFormat(f"tensor {name[:200]!r}: not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise BadFormat(f"tensor {name[:200]!r}: unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise BadFormat(f"tensor {name[:200]!r}: bad shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise BadFormat(f"tensor {name[:200]!r}: bad data_offsets")
    if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[str(dtype)]:
        raise BadFormat(f"tensor {name[:200]!r}: its bytes do not match its shape and dtype")
    return tuple(shape), (offsets[0], offsets[1])


async def _read(storage: ObjectStore, key: str, start: int, length: int) -> bytes:
    try:
        return await storage.read_range(key, start, length)
    except ObjectNotFound as exc:
        raise BadFormat("no object stored") from exc
