"""safetensors in memory, byte-for-byte reproducible.

`safetensors.torch.save` keeps the header's `__metadata__` in a Rust HashMap, so with two or
more metadata entries their order (and the file's bytes and sha256) changes from call to call.
Equal tensors must give equal bytes here (result digests, exact-resume checks), so the header
is rewritten once with the metadata keys sorted. The layout stays valid safetensors: an 8-byte
little-endian header length, the JSON header padded with spaces to an 8-byte boundary, then the
unchanged data buffer (offsets in the header are relative to it).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import safetensors.torch
import torch

_LENGTH = struct.Struct("<Q")


def _split(buffer: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    view = memoryview(buffer)
    if len(view) < _LENGTH.size:
        raise ValueError("safetensors buffer is shorter than its length prefix")
    (size,) = _LENGTH.unpack(view[: _LENGTH.size])
    if size > len(view) - _LENGTH.size:
        raise ValueError("safetensors header runs past the end")
    header = json.loads(bytes(view[_LENGTH.size : _LENGTH.size + size]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    return header, view[_LENGTH.size + size :]


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _framed(header: Mapping[str, Any]) -> bytes:
    """The length prefix and the JSON header, padded with spaces to an 8-byte boundary."""
    return _frame(f"{_ENCODE(key)}:{_ENCODE(value)}" for key, value in header.items())


def _frame(entries: Iterable[str]) -> bytes:
    """`_framed` from the header's entries, each `"key":value` as `json.dumps` with compact
    separators writes it. Built entry by entry on purpose: a thread beside it (training) gets
    the GIL between entries, where one `json.dumps` of a full-size checkpoint's 6720 entries
    held it for ~20 ms."""
    text = ("{" + ",".join(entries) + "}").encode("utf-8")
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """`safetensors.torch.save` with a deterministic header."""
    raw = safetensors.torch.save(dict(tensors), metadata=dict(metadata))
    header, data = _split(raw)
    ordered: dict[str, Any] = {"__metadata__": dict(sorted(header.pop("__metadata__", {}).items()))}
    ordered.update(header)
    return _framed(ordered) + bytes(data)


# safetensors' names for torch's dtypes.
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}


def safetensors_header(
    tensors: Iterable[tuple[str, torch.dtype, Sequence[int], int]],
    metadata: Mapping[str, str],
) -> bytes:
    """The framed header of a safetensors file whose tensors (key, dtype, shape, size in bytes)
    follow it in the order given (which the caller makes canonical and aligned), for a writer
    that already holds their bytes: the header, then those bytes, are the file.

    The same bytes as `_framed` of the header as a dict, written as text per tensor: a
    full-size checkpoint has 6720 tensors, and encoding each entry's dict took 30 ms of the
    GIL that the training thread beside the writer wants."""
    entries = [f"{_ENCODE('__metadata__')}:{_ENCODE(dict(sorted(metadata.items())))}"]
    start = 0
    for key, dtype, shape, size in tensors:
        name = _DTYPE_NAMES.get(dtype)
        if key == "__metadata__":
            raise ValueError("a tensor cannot be named __metadata__ in safetensors")
        if name is None:
            raise TypeError(f"safetensors cannot hold {dtype} tensors")
        dims = ",".join(str(int(dim)) for dim in shape)
        end = start + size
        entries.append(
            f'{_ENCODE(key)}:{{"dtype":"{name}","shape":[{dims}],"data_offsets":[{start},{end}]}}'
        )
        start = end
    return _frame(entries)


def safetensors_metadata(buffer: bytes | memoryview) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer, without decoding any tensor."""
    header, _ = _split(buffer)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise ValueError("no metadata in the safetensors header")
    return metadata
