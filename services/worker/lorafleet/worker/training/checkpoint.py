"""Checkpoints that never touch the disk: a host-memory snapshot, and one bytes blob.

At a checkpoint step the training thread only takes a `TrainingSnapshot`: detached host copies
of the tensors (LoRA weights, optimizer state, the run's own RNG states; from a GPU they arrive
asynchronously, and the first reader waits for them) plus a JSON-ready dict (step, data order,
LR-scheduler and grad-scaler state). It shares nothing with the live run, so
`serialize_checkpoint` may run on any thread while training continues.

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
import threading
from collections.abc import Iterator, Mapping
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
        if isinstance(self.tensors, HostTensors):
            return self.tensors.nbytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class HostTensors(Mapping[str, torch.Tensor]):
    """A snapshot's tensors in host memory, some of them still arriving from the GPU.

    `to_host` queues the device-to-host copies and returns at once; the first read of the
    mapping (by the thread that serialises the checkpoint, normally) waits for them. The
    training thread therefore never waits for the GPU at a checkpoint.
    """

    def __init__(
        self,
        ready: dict[str, torch.Tensor],
        arriving: list[tuple[torch.Tensor, list[tuple[str, torch.Size, int]]]],
        copied: list[torch.cuda.Event],
    ) -> None:
        self._tensors = ready
        # Per flat pinned host buffer: (key, shape, offset) of each tensor packed into it.
        self._arriving = arriving
        self._copied = copied
        self._lock = threading.Lock()
        self._keys = [*ready, *(key for _, layout in arriving for key, _, _ in layout)]
        self._nbytes = sum(t.numel() * t.element_size() for t in ready.values()) + sum(
            buffer.numel() * buffer.element_size() for buffer, _ in arriving
        )

    @property
    def nbytes(self) -> int:
        """The tensor payload, known without waiting for the copies."""
        return self._nbytes

    def _arrived(self) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._arriving:
                for event in self._copied:
                    event.synchronize()
                for buffer, layout in self._arriving:
                    for key, shape, offset in layout:
                        self._tensors[key] = buffer[offset : offset + shape.numel()].view(shape)
                self._arriving = []
            return self._tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._arrived()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def to_host(tensors: Mapping[str, torch.Tensor]) -> HostTensors:
    """Host copies that the run never writes again.

    CPU tensors are cloned. Device tensors are packed, per dtype, into one new device buffer
    (one kernel, ordered after the step that wrote them, on the training stream) and that
    buffer is copied into pinned host memory on a side stream: no host sync, and the copy
    overlaps the next step, which cannot write the packed buffer. One transfer per dtype
    instead of one per tensor: a full-size LoRA's optimizer state is thousands of tensors, and
    copying them one by one into freshly pinned memory stalled training for 0.2 s
    (docs/BENCHMARKS.md, "On a GPU").
    """
    ready: dict[str, torch.Tensor] = {}
    on_device: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        value = tensor.detach()
        if value.device.type == "cpu":
            ready[key] = value.clone()
        else:
            on_device.setdefault((value.device, value.dtype), []).append((key, value))
    if not on_device:
        return HostTensors(ready, [], [])
    arriving: list[tuple[torch.Tensor, list[tuple[str, torch.Size, int]]]] = []
    copied: list[torch.cuda.Event] = []
    for (device, dtype), items in on_device.items():
        packed = torch.cat([value.reshape(-1) for _, value in items])
        stream = _copy_streams.get(device)
        if stream is None:
            stream = _copy_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host = torch.empty(packed.numel(), dtype=dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
        # The training stream may reuse `packed`'s memory only after the copy has read it.
        packed.record_stream(stream)
        layout, offset = [], 0
        for key, value in items:
            layout.append((key, value.shape, offset))
            offset += value.numel()
        arriving.append((host, layout))
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        copied.append(event)
    return HostTensors(ready, arriving, copied)


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
