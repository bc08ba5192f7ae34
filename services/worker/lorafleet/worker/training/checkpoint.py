"""Checkpoints that never touch the disk: a host-memory snapshot, and one bytes blob.

At a checkpoint step the training thread only takes a `TrainingSnapshot`: detached host copies
of the tensors (LoRA weights, optimizer state, the run's own RNG states) plus a JSON-ready dict
(step, data order, LR-scheduler and grad-scaler state). It shares nothing with
the live run, so `serialize_checkpoint` may run on any thread while training continues.

The blob (format version 1)::

    bytes 0..7    magic  b"LFCKPT" 0x00 0x01   (the last byte is the format version)
    bytes 8..39   SHA-256 of bytes 40..end
    bytes 40..    a safetensors file: every tensor, and in its header's `__metadata__` the key
                  "lorafleet.state" whose value is the JSON state.

Tensors are safetensors and the rest is JSON: nothing is pickled, so loading a checkpoint
cannot run code. `load_checkpoint` verifies the magic, the digest and the structure and raises
`CorruptCheckpoint` otherwise. (The ledger's sha256 is of the whole blob, see
`checkpoint_sha256`; the inner digest lets a blob be verified on its own.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from lorafleet.worker.training.failures import CorruptCheckpoint
from lorafleet.worker.training.serialization import safetensors_bytes, safetensors_metadata

MAGIC = b"LFCKPT\x00\x01"
_DIGEST_BYTES = 32
_HEADER_BYTES = len(MAGIC) + _DIGEST_BYTES
_STATE_KEY = "lorafleet.state"
FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TrainingSnapshot:
    """The complete training state after optimizer step `step`, in host memory.

    `tensors` are CPU tensors owned by the snapshot (never written by the run again); `state`
    is plain JSON data. `load_checkpoint` returns the same type, which `Trainer.run(resume=...)`
    accepts.
    """

    step: int
    tensors: Mapping[str, torch.Tensor] = field(repr=False)
    state: Mapping[str, Any] = field(repr=False)

    @property
    def size_bytes(self) -> int:
        """Roughly the serialized size: the tensor payload."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies. Device tensors are copied asynchronously (into pinned memory) and
    waited for once, so the training thread stalls for one transfer, not one per tensor."""
    out: dict[str, torch.Tensor] = {}
    on_device = False
    for key, tensor in tensors.items():
        value = tensor.detach()
        if value.device.type == "cpu":
            out[key] = value.clone()
        else:
            out[key] = value.to("cpu", non_blocking=True)
            on_device = True
    if on_device:
        torch.cuda.synchronize()
    return out


def serialize_checkpoint(snapshot: TrainingSnapshot) -> bytes:
    """The checkpoint blob. Thread-safe: reads only the snapshot."""
    state = dict(snapshot.state)
    state["step"] = snapshot.step
    metadata = {_STATE_KEY: json.dumps(state, separators=(",", ":"), sort_keys=True)}
    tensors = {key: value.contiguous() for key, value in snapshot.tensors.items()}
    payload = safetensors_bytes(tensors, metadata)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def checkpoint_sha256(data: bytes) -> str:
    """Hex sha256 of a whole stored blob, as the ledger records it: a checkpoint's
    (`CheckpointCommitted`, checked again before resuming) and, by the same rule, the final
    LoRA's (`JobSucceeded`). Reads all of `data`: call it off the event loop."""
    return hashlib.sha256(data).hexdigest()


def load_checkpoint(data: bytes) -> TrainingSnapshot:
    """Parses and verifies a blob. Raises `CorruptCheckpoint` saying what is wrong."""
    if len(data) < _HEADER_BYTES or data[: len(MAGIC) - 1] != MAGIC[:-1]:
        raise CorruptCheckpoint("not a lorafleet checkpoint (bad magic)")
    if data[len(MAGIC) - 1] != FORMAT_VERSION:
        raise CorruptCheckpoint(f"unsupported checkpoint format version {data[len(MAGIC) - 1]}")
    payload = memoryview(data)[_HEADER_BYTES:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) : _HEADER_BYTES]:
        raise CorruptCheckpoint("checkpoint digest mismatch (truncated or corrupted)")
    try:
        state = json.loads(safetensors_metadata(payload)[_STATE_KEY])
        tensors = safetensors.torch.load(bytes(payload))
        step = int(state["step"])
    except (KeyError, ValueError, TypeError, UnicodeDecodeError, SafetensorError) as exc:
        raise CorruptCheckpoint(f"malformed checkpoint: {exc}") from exc
    if not isinstance(state, dict):
        raise CorruptCheckpoint("malformed checkpoint: state is not an object")
    return TrainingSnapshot(step=step, tensors=tensors, state=state)


_TENSOR_REF = "__tensor__"


def split_tensors(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-ready copy of a (nested) state value: each tensor moves to `tensors` under a path
    key and is replaced by a reference. Optimizers nest state differently (torch: flat per
    parameter; bitsandbytes: quantization state in a sub-dict), so the structure is kept."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {_TENSOR_REF: key}
    if isinstance(value, dict):
        return {str(k): split_tensors(v, f"{key}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [split_tensors(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
    return value


def join_tensors(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `split_tensors`."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [join_tensors(v, tensors) for v in value]
    return value
