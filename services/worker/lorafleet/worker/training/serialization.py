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
from collections.abc import Mapping
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


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """`safetensors.torch.save` with a deterministic header."""
    raw = safetensors.torch.save(dict(tensors), metadata=dict(metadata))
    header, data = _split(raw)
    ordered: dict[str, Any] = {"__metadata__": dict(sorted(header.pop("__metadata__", {}).items()))}
    ordered.update(header)
    text = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text + bytes(data)


def safetensors_metadata(buffer: bytes | memoryview) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer, without decoding any tensor."""
    header, _ = _split(buffer)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise ValueError("no metadata in the safetensors header")
    return metadata
