"""What checkpoints and results must look like before the ledger records them.

The store's checksum says the bytes are what a worker announced; it says nothing of what they
are. A holder could announce garbage (or a tiny file) as a checkpoint or a result, and the
fleet would record it, hand it to the next holder, deliver it to the owner and time its pace
by it. So the scheduler reads each announced object's safetensors header with ranged reads
(never the tensors) and refuses what is not one:

* a result (diffusers or kohya LoRA file) is a safetensors file: an 8-byte little-endian header
  length, a JSON header of at most `MAX_HEADER_BYTES`, then the data, every byte of which the
  header's tensors cover exactly once (the object's size must match); its tensors are LoRA
  adapters of the job's rank, in the file's layout (`check_lora_file`: diffusers' `lora_A` /
  `lora_B` pairs, kohya's `lora_down` / `lora_up` / `alpha` triples), and a diffusers file
  holds exactly the adapters the job's checkpoints trained, shape for shape. A file of other
  tensors, or of one made-up tensor, is no LoRA of the job; made-up values of the right shapes
  are what the form cannot tell (docs/THREAT_MODEL.md);
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


# An adapter's two tensors, as each layout names them: a diffusers file's are peft's (FLUX.1,
# FLUX.2) or, for SDXL, what diffusers' convert_state_dict_to_diffusers makes of them (the
# UNet's `lora.down`, the CLIP encoders' `lora_linear_layer.down`); a kohya file's are
# `lora_down` / `lora_up`, with a scalar `alpha` beside them.
DIFFUSERS_PAIRS = (
    (".lora_A.weight", ".lora_B.weight"),
    (".lora.down.weight", ".lora.up.weight"),
    (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
)
KOHYA_PAIRS = ((".lora_down.weight", ".lora_up.weight"),)


async def check_lora_file(
    storage: ObjectStore,
    key: str,
    *,
    size_bytes: int,
    file_format: str,
    rank: int,
    checkpoint: Layout | None = None,
) -> None:
    """A result file of the job: a safetensors file of LoRA adapters of rank `rank` in the
    layout of `file_format` (diffusers or kohya); a diffusers file also holds exactly the
    adapters of the job's `checkpoint` layout, if it has one. `BadFormat` otherwise."""
    layout = await safetensors_layout(storage, key, size_bytes=size_bytes)
    if not layout:
        raise BadFormat("a LoRA file without tensors")
    kohya = file_format == "kohya"
    adapters = _check_adapters(layout, KOHYA_PAIRS if kohya else DIFFUSERS_PAIRS, rank, kohya)
    if kohya:
        return
    trained = sorted(
        shape
        for name, shape in (checkpoint or {}).items()
        if name.startswith("lora/") and (".lora_A." in name or ".lora_B." in name)
    )
    if trained and sorted(adapters) != trained:
        raise BadFormat(
            f"its {len(adapters)} adapter tensors are not the {len(trained)} the job's"
            " checkpoints trained (names and shapes)"
        )


def _check_adapters(
    layout: Layout, pairs: tuple[tuple[str, str], ...], rank: int, kohya: bool
) -> list[tuple[int, ...]]:
    """Every tensor is one of an adapter's pair (`<module><down>` of shape (r, in) and
    `<module><up>` of shape (out, r), r the rank; in a kohya file a multiple of it, as its
    fused q/k/v adapters are, with the adapter's scalar `<module>.alpha`) or a DoRA magnitude;
    returns the pairs' shapes."""
    shapes: list[tuple[int, ...]] = []
    for name, shape in layout.items():
        for down, up in pairs:
            if name.endswith(down):
                module = name.removesuffix(down)
                other = layout.get(module + up)
                if other is None:
                    raise BadFormat(f"tensor {name[:200]!r} has no {up[1:]!r} beside it")
                inner = shape[0] if len(shape) == 2 else 0
                fits = inner == rank or (kohya and inner > 0 and inner % rank == 0)
                if len(other) != 2 or other[1] != inner or not fits:
                    raise BadFormat(
                        f"adapter {module[:200]!r}: shapes {list(shape)} and {list(other)} are"
                        f" no LoRA of rank {rank}"
                    )
                if kohya and layout.get(module + ".alpha") != ():
                    raise BadFormat(f"adapter {module[:200]!r} has no scalar alpha beside it")
                shapes += [shape, other]
                break
            if name.endswith(up):
                if name.removesuffix(up) + down not in layout:
                    raise BadFormat(f"tensor {name[:200]!r} has no {down[1:]!r} beside it")
                break
        else:
            alpha = kohya and name.endswith(".alpha")
            if alpha and not any(name.removesuffix(".alpha") + d in layout for d, _ in pairs):
                raise BadFormat(f"tensor {name[:200]!r} is no adapter's alpha")
            if not alpha and "lora_magnitude_vector" not in name:
                raise BadFormat(f"not a LoRA file: tensor {name[:200]!r}")
    if not shapes:
        raise BadFormat("a LoRA file without adapters")
    return shapes


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
