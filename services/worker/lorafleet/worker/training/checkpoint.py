"""Checkpoints that never touch the disk: a host-memory snapshot, and one in-memory blob.

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

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError

from lorafleet.core.model import CHECKPOINT_DIGEST_BYTES, CHECKPOINT_MAGIC
from lorafleet.worker.training.failures import CorruptCheckpoint
from lorafleet.worker.training.serialization import safetensors_header, safetensors_metadata

MAGIC = CHECKPOINT_MAGIC
_DIGEST_BYTES = CHECKPOINT_DIGEST_BYTES
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


# Per flat buffer: (key, shape, element offset) of each tensor packed into it, in order.
Layout = list[tuple[str, torch.Size, int]]


class HostTensors(Mapping[str, torch.Tensor]):
    """A snapshot's tensors, packed per dtype into flat host buffers, possibly still arriving
    from the GPU.

    `to_host` queues the device-to-host copies and returns at once; the first read (by the
    thread that serialises the checkpoint, normally) waits for them, so the training thread
    never waits for the GPU at a checkpoint (with fp16, reading the grad scaler's state is a
    sync, as every fp16 step already has one). `serialize_checkpoint` writes the flat buffers as
    they are: a few large copies instead of Python work per tensor, which held the GIL long
    enough to slow the training thread's next step by half a second on a full-size model.
    """

    def __init__(self, packs: list[tuple[torch.Tensor, Layout]], copied: list[Any]) -> None:
        self._packs = packs
        self._copied = copied  # CUDA events recorded after the copies
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] | None = None
        self._keys = [key for _, layout in packs for key, _, _ in layout]
        self._key_set = frozenset(self._keys)

    @property
    def nbytes(self) -> int:
        """The tensor payload, known without waiting for the copies."""
        return sum(buffer.numel() * buffer.element_size() for buffer, _ in self._packs)

    def packs(self) -> list[tuple[torch.Tensor, Layout]]:
        """The flat host buffers and their layouts, once the copies have arrived."""
        with self._lock:
            for event in self._copied:
                event.synchronize()
            self._copied = []
        return self._packs

    def _unpacked(self) -> dict[str, torch.Tensor]:
        # Tensors of their own, not views into the packs: some consumers ignore a view's
        # storage offset (torch's CPU generator's set_state read the wrong bytes).
        packs = self.packs()
        with self._lock:
            if self._tensors is None:
                self._tensors = {
                    key: buffer[offset : offset + shape.numel()].view(shape).clone()
                    for buffer, layout in packs
                    for key, shape, offset in layout
                }
            return self._tensors

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._unpacked()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


_copy_streams: dict[torch.device, Any] = {}


def copy_stream(device: torch.device) -> Any:
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def _to_pinned(packed: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Queues the copy of a device buffer into new pinned host memory on the device's side
    stream, after the work queued so far on the current stream; returns the host buffer and an
    event recorded after the copy. No host sync: the copy overlaps the next step."""
    stream = copy_stream(packed.device)
    stream.wait_stream(torch.cuda.current_stream(packed.device))
    with torch.cuda.stream(stream):
        host = torch.empty(packed.numel(), dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
    # Blocking: the serialising thread sleeps while it waits instead of spinning.
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(stream)
    return host, event


def _layout(items: list[tuple[str, torch.Tensor]]) -> Layout:
    layout: Layout = []
    offset = 0
    for key, value in items:
        layout.append((key, value.shape, offset))
        offset += value.numel()
    return layout


def _groups(
    tensors: Mapping[str, torch.Tensor],
) -> list[tuple[torch.device, list[tuple[str, torch.Tensor]]]]:
    """The tensors grouped per device and dtype, in the checkpoint's canonical order (widest
    dtype first, then by key, as `serialize_checkpoint` writes them): then a pack's tensors lie
    in the file as they lie in the pack, and the writer copies whole packs."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        groups.setdefault((tensor.device, tensor.dtype), []).append((key, tensor.detach()))
    ordered = sorted(groups.items(), key=lambda group: -group[0][1].itemsize)
    return [(device, sorted(items, key=lambda item: item[0])) for (device, _), items in ordered]


def to_host(tensors: Mapping[str, torch.Tensor]) -> HostTensors:
    """Host copies that the run never writes again, packed per device and dtype.

    Each group is packed into one new buffer (`torch.cat`: one kernel, ordered after the step
    that wrote the tensors). On the CPU that buffer is the copy. From a GPU it is copied into
    pinned host memory on a side stream: no host sync, and the copy overlaps the next step,
    which cannot write the packed buffer. One transfer per dtype instead of one per tensor: a
    full-size LoRA's optimizer state is thousands of tensors, and copying them one by one into
    newly pinned memory stalled training for 0.2 s (docs/BENCHMARKS.md, "On a GPU").
    `DeviceSnapshotter` does the same for a run's device tensors with the work per tensor
    done once.
    """
    packs: list[tuple[torch.Tensor, Layout]] = []
    copied: list[Any] = []
    for device, items in _groups(tensors):
        packed = torch.cat([value.reshape(-1) for _, value in items])
        if device.type != "cpu":
            host, event = _to_pinned(packed)
            # The training stream may reuse `packed`'s memory only after the copy has read it.
            packed.record_stream(copy_stream(device))
            copied.append(event)
            packed = host
        packs.append((packed, _layout(items)))
    return HostTensors(packs, copied)


class DeviceSnapshotter:
    """Host copies of one fixed set of device tensors (a run's LoRA weights and optimizer
    state, updated in place), taken again and again with the Python work per tensor done once.

    Built from the tensors of a run's first checkpoint: per device and dtype a staging buffer
    on the device and a view of it for each tensor. A snapshot is one `torch._foreach_copy_`
    of the live tensors into those views (a few multi-tensor kernels on the training stream,
    ordered after the step that wrote them), then one copy per staging buffer into new pinned
    host memory on a side stream, as `to_host`. Before the training stream writes a staging
    buffer again it waits (on the GPU, not the host) for the previous snapshot's copy out of
    it, so a snapshot whose copy is still queued is never overwritten. The per-tensor
    `detach`, `reshape` and `cat` arguments of `to_host` cost a full-size run's training
    thread 45 ms at every checkpoint (docs/BENCHMARKS.md, "On a GPU").
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._groups: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], Layout]]
        self._groups = []
        for device, items in _groups(tensors):
            if device.type == "cpu":
                raise ValueError(f"{items[0][0]} is not on a GPU")
            layout = _layout(items)
            total = sum(value.numel() for _, value in items)
            staging = torch.empty(total, dtype=items[0][1].dtype, device=device)
            views = [staging[o : o + shape.numel()].view(shape) for _, shape, o in layout]
            self._groups.append((staging, views, [v for _, v in items], layout))
        # Per staging buffer, the event after the newest copy out of it.
        self._copied: list[Any] = [None] * len(self._groups)

    def packs(self) -> tuple[list[tuple[torch.Tensor, Layout]], list[Any]]:
        """Queues the copies; returns the host buffers with their layouts, and the events
        recorded after the copies (for `HostTensors`)."""
        packs: list[tuple[torch.Tensor, Layout]] = []
        events: list[Any] = []
        for index, (staging, views, sources, layout) in enumerate(self._groups):
            previous = self._copied[index]
            if previous is not None:
                torch.cuda.current_stream(staging.device).wait_event(previous)
            with torch.no_grad():
                torch._foreach_copy_(views, sources)
            host, event = _to_pinned(staging)
            self._copied[index] = event
            events.append(event)
            packs.append((host, layout))
        return packs, events

    def snapshot(self, extra: Mapping[str, torch.Tensor]) -> HostTensors:
        """The tensors' host copies plus `extra` (host tensors, copied with `to_host`)."""
        packs, events = self.packs()
        rest = to_host(extra)
        return HostTensors([*packs, *rest.packs()], events)


def serialize_checkpoint(snapshot: TrainingSnapshot) -> memoryview:
    """The checkpoint blob, a read-only byte view. Thread-safe: reads only the snapshot.

    The safetensors payload is written from the packed buffers (`to_host`), tensors in
    one canonical order (widest dtype first, so each stays aligned, then by key), whatever the
    order they came in: equal snapshots give equal bytes, a loaded checkpoint serialises to
    its own bytes again, and `safetensors.torch.load` reads the result like any safetensors
    file. The data section is slices of a few large buffers copied once into the blob, and
    both the hashing and the copy release the GIL, so a training thread beside it keeps
    running: a `bytes` join of memoryviews (as before) holds the GIL through the whole copy
    (a 90 MB SDXL checkpoint kept the training thread waiting ~50 ms on the 2-core VM), and so
    would a zero-filled `bytearray`; with numpy's copy into uninitialised memory the longest
    wait is ~8 ms (bench/bench_checkpoint_gil.py).
    """
    parts = checkpoint_parts(snapshot)
    blob = np.empty(sum(len(part) for part in parts), dtype=np.uint8)
    position = 0
    for part in parts:
        end = position + len(part)
        blob[position:end] = np.frombuffer(part, dtype=np.uint8)  # releases the GIL
        position = end
    return blob.data.toreadonly()


def checkpoint_parts(snapshot: TrainingSnapshot) -> list[bytes | memoryview]:
    """The blob's pieces in order: magic, digest, safetensors header, then the data section as
    views of the packed host buffers (no copy yet). Hashes the data: call it off the loop."""
    state = dict(snapshot.state)
    state["step"] = snapshot.step
    tensors = snapshot.tensors
    host = tensors if isinstance(tensors, HostTensors) else to_host(tensors)
    raws = [
        memoryview(buffer.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]
        for buffer, _ in host.packs()
    ]
    # (-width, key, dtype, shape, pack, first byte, bytes) per tensor, in the canonical order.
    entries = []
    for pack, (buffer, layout) in enumerate(host.packs()):
        width = buffer.element_size()
        for key, shape, offset in layout:
            size = shape.numel() * width
            entries.append((-width, key, buffer.dtype, shape, pack, offset * width, size))
    entries.sort(key=lambda entry: (entry[0], entry[1]))
    header = safetensors_header(
        [(key, dtype, shape, size) for _, key, dtype, shape, _, _, size in entries],
        {_STATE_KEY: json.dumps(state, separators=(",", ":"), sort_keys=True)},
    )
    # Tensors that lie next to each other in a pack are written as one slice: with packs in
    # the canonical order (`_groups`) that is one slice per pack, so hashing drops and takes
    # back the GIL a few times instead of once per tensor (which slowed the training thread).
    slices: list[list[int]] = []
    for _, _, _, _, pack, start, size in entries:
        if slices and slices[-1][0] == pack and slices[-1][2] == start:
            slices[-1][2] = start + size
        else:
            slices.append([pack, start, start + size])
    parts: list[bytes | memoryview] = [header]
    parts.extend(raws[pack][start:end] for pack, start, end in slices)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)  # releases the GIL for large parts
    return [MAGIC, digest.digest(), *parts]


def checkpoint_sha256(data: bytes | memoryview) -> str:
    """Hex sha256 of a whole stored blob, as the ledger records it: a checkpoint's
    (`CheckpointCommitted`, checked again before resuming) and, by the same rule, the final
    LoRA's (`JobSucceeded`). Reads all of `data`: call it off the event loop."""
    return hashlib.sha256(data).hexdigest()


def load_checkpoint(data: bytes | memoryview) -> TrainingSnapshot:
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
