"""The checkpoint blob: contents, verification, and serialising off the training thread."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from lorafleet.worker.training import (
    CorruptCheckpoint,
    Finished,
    Trainer,
    TrainingHooks,
    TrainingSnapshot,
    checkpoint_sha256,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.checkpoint import (
    MAGIC,
    checkpoint_parts,
    join_tensors,
    split_tensors,
)
from lorafleet.worker.training.serialization import (
    safetensors_bytes,
    safetensors_header,
    safetensors_metadata,
)
from tests.support.training import Recorder, TrainFn, instance_images, make_config, tiny_spec


@pytest.fixture(scope="module")
def snapshot(tiny_model_dir: Path) -> TrainingSnapshot:
    """One snapshot shared by the read-only tests of this module."""
    recorder = Recorder()
    spec = tiny_spec(max_train_steps=3, checkpointing_steps=2, train_text_encoder=True)
    Trainer(make_config(tiny_model_dir, spec)).run(
        instance_images=instance_images(), hooks=recorder.hooks()
    )
    [taken] = recorder.snapshots
    return taken


def test_snapshot_holds_the_complete_state(snapshot: TrainingSnapshot) -> None:
    assert snapshot.step == 2
    keys = set(snapshot.tensors)
    for prefix in ("lora/unet/", "lora/text_encoder/", "lora/text_encoder_2/", "optimizer/"):
        assert any(key.startswith(prefix) for key in keys), prefix
    assert {"rng/torch", "rng/data", "rng/noise"} <= keys
    assert any(key.endswith("/exp_avg_sq") for key in keys)
    assert all(t.device.type == "cpu" for t in snapshot.tensors.values())
    state = snapshot.state
    # The run's own generators only: the process-wide Python and NumPy states are not the
    # run's to store or to restore.
    assert set(state["rng"]) == {"noise_device"}
    assert state["data_order"]["position"] == 2
    assert state["lr_scheduler"]["last_epoch"] == 2
    assert len(state["optimizer"]["param_groups"]) == 2
    assert snapshot.size_bytes > 0


def test_round_trip_is_exact(snapshot: TrainingSnapshot) -> None:
    blob = serialize_checkpoint(snapshot)
    loaded = load_checkpoint(blob)
    assert loaded.step == snapshot.step
    assert loaded.tensors.keys() == snapshot.tensors.keys()
    assert all(torch.equal(loaded.tensors[k], v) for k, v in snapshot.tensors.items())
    assert dict(loaded.state, step=None) == dict(json.loads(json.dumps(snapshot.state)), step=None)
    assert serialize_checkpoint(loaded) == blob
    assert checkpoint_sha256(blob) == hashlib.sha256(blob).hexdigest()


def test_blob_layout_is_magic_digest_safetensors(snapshot: TrainingSnapshot) -> None:
    blob = bytes(serialize_checkpoint(snapshot))
    assert blob[:8] == MAGIC
    payload = blob[40:]
    assert blob[8:40] == hashlib.sha256(payload).digest()
    # Plain safetensors with JSON metadata: readable without lorafleet, nothing pickled.
    assert safetensors.torch.load(payload).keys() == snapshot.tensors.keys()
    state = json.loads(safetensors_metadata(payload)["lorafleet.state"])
    assert state["step"] == 2


def test_the_blob_is_a_read_only_view_that_loads(snapshot: TrainingSnapshot) -> None:
    """Built without a bytes copy (which would hold the GIL), and immutable: the uploader
    hashes it once and sends it as it was hashed."""
    blob = serialize_checkpoint(snapshot)
    assert blob.readonly and blob.ndim == 1 and blob.itemsize == 1
    with pytest.raises(TypeError):
        blob[0] = 0
    assert blob == b"".join(checkpoint_parts(snapshot))
    assert load_checkpoint(blob).step == snapshot.step


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:-10], "digest mismatch"),
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "digest mismatch"),
        (lambda b: b"NOTACKPT" + b[8:], "bad magic"),
        (lambda b: b[:7] + b"\x09" + b[8:], "format version 9"),
        (lambda b: b"", "bad magic"),
        (
            lambda b: MAGIC + hashlib.sha256(b"garbage").digest() + b"garbage",
            "malformed checkpoint",
        ),
    ],
    ids=["truncated", "bit-flip", "magic", "version", "empty", "garbage-with-valid-digest"],
)
def test_corruption_is_detected(snapshot: TrainingSnapshot, mutate: object, reason: str) -> None:
    assert callable(mutate)
    blob = mutate(bytes(serialize_checkpoint(snapshot)))  # as downloaded
    with pytest.raises(CorruptCheckpoint, match=reason):
        load_checkpoint(blob)


@dataclass
class UploadingRecorder(Recorder):
    """Serialises each snapshot on its own thread, as the agent's uploader does."""

    blobs: dict[int, bytes] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def hooks(self) -> TrainingHooks:
        return dataclasses.replace(super().hooks(), on_checkpoint=self.upload)

    def upload(self, snapshot: TrainingSnapshot) -> None:
        self.snapshots.append(snapshot)

        def work() -> None:
            self.blobs[snapshot.step] = bytes(serialize_checkpoint(snapshot))

        thread = threading.Thread(target=work)
        thread.start()
        self.threads.append(thread)


def test_serialising_on_another_thread_while_training_continues(train: TrainFn) -> None:
    recorder = UploadingRecorder()
    outcome, _ = train(tiny_spec(max_train_steps=5, checkpointing_steps=2), recorder=recorder)
    for thread in recorder.threads:
        thread.join()
    assert isinstance(outcome, Finished)
    assert sorted(recorder.blobs) == [2, 4]
    for snapshot in recorder.snapshots:
        # What the thread wrote equals the snapshot as it is now: training never touched it.
        assert recorder.blobs[snapshot.step] == serialize_checkpoint(snapshot)
        assert load_checkpoint(recorder.blobs[snapshot.step]).step == snapshot.step
    first, second = (s.tensors for s in recorder.snapshots)
    up = [k for k in first if k.startswith("lora/unet/") and ".lora_B." in k]
    assert up
    # The step-2 snapshot kept its values while the live weights moved on.
    assert not all(torch.equal(first[k], second[k]) for k in up)


def test_nested_optimizer_state_round_trips() -> None:
    """bitsandbytes nests its quantization tensors in a sub-dict; torch keeps them flat."""
    qmap = torch.linspace(-1, 1, 5)
    state: dict[str, Any] = {
        "step": 3,
        "state1": torch.arange(4, dtype=torch.uint8),
        "wrapped": {"qmap1": qmap, "absmax1": torch.ones(2)},
        "history": [torch.zeros(1), 0.5],
    }
    tensors: dict[str, torch.Tensor] = {}
    json_part = split_tensors(state, "optimizer/0", tensors)
    assert set(tensors) == {
        "optimizer/0/state1",
        "optimizer/0/wrapped/qmap1",
        "optimizer/0/wrapped/absmax1",
        "optimizer/0/history/0",
    }
    snapshot = TrainingSnapshot(step=1, tensors=tensors, state={"optimizer": json_part})
    loaded = load_checkpoint(serialize_checkpoint(snapshot))
    back = join_tensors(loaded.state["optimizer"], loaded.tensors)
    assert back["step"] == 3
    assert torch.equal(back["state1"], state["state1"])
    assert torch.equal(back["wrapped"]["qmap1"], qmap)
    assert torch.equal(back["history"][0], torch.zeros(1))
    assert back["history"][1] == 0.5


# Every dtype and shape a checkpoint writer must place correctly (2026-11-24: the writer packs
# tensors per dtype and writes the safetensors payload itself).
_ODD_TENSORS: dict[str, torch.Tensor] = {
    "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "f64": torch.tensor([0.25, -1.0], dtype=torch.float64),
    "bf16": torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16),
    "f16": torch.tensor([0.5], dtype=torch.float16),
    "i64": torch.tensor([1, -2, 3]),
    "u8": torch.tensor([1, 2, 255], dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.0),
    "empty": torch.zeros(0, 4),
    "transposed": torch.arange(6.0).reshape(2, 3).t(),
}


def test_the_payload_is_safetensors_in_one_order_whatever_the_input_order() -> None:
    forward = TrainingSnapshot(step=1, tensors=dict(_ODD_TENSORS), state={"a": 1})
    backward = TrainingSnapshot(
        step=1, tensors=dict(reversed(list(_ODD_TENSORS.items()))), state={"a": 1}
    )
    blob = bytes(serialize_checkpoint(forward))
    assert serialize_checkpoint(backward) == blob
    payload = blob[len(MAGIC) + 32 :]
    loaded = safetensors.torch.load(payload)
    assert loaded.keys() == _ODD_TENSORS.keys()
    for key, tensor in _ODD_TENSORS.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    # Each tensor starts aligned to its own element size (readers may map it in place).
    size = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + size])
    for key, tensor in _ODD_TENSORS.items():
        assert header[key]["data_offsets"][0] % tensor.element_size() == 0, key
    assert serialize_checkpoint(load_checkpoint(blob)) == blob


def test_a_checkpoint_of_the_previous_writer_still_loads() -> None:
    """Blobs written before the packed writer (safetensors.torch.save with its header sorted)
    are still in storage for jobs that were interrupted: they resume."""
    state = {"step": 4, "loss": 0.5}
    payload = safetensors_bytes(
        {key: value.contiguous() for key, value in _ODD_TENSORS.items()},
        {"lorafleet.state": json.dumps(state, separators=(",", ":"), sort_keys=True)},
    )
    loaded = load_checkpoint(MAGIC + hashlib.sha256(payload).digest() + payload)
    assert loaded.step == 4 and loaded.state["loss"] == 0.5
    assert all(torch.equal(loaded.tensors[k], v) for k, v in _ODD_TENSORS.items())


def test_a_dtype_safetensors_cannot_hold_is_refused_by_name() -> None:
    snapshot = TrainingSnapshot(
        step=1, tensors={"c": torch.zeros(2, dtype=torch.complex128)}, state={}
    )
    with pytest.raises(TypeError, match=r"cannot hold torch\.complex128"):
        serialize_checkpoint(snapshot)


def test_the_header_is_the_json_one_dumps_writes() -> None:
    """The header is written as text per tensor (it holds the GIL for less); it must be the
    bytes `json.dumps` gives the same header, whatever the keys, shapes and metadata."""
    tensors = [
        ('unet.down."quoted"\\é.lora_A', torch.float32, torch.Size([4, 320]), 5120),
        ("scalar", torch.bfloat16, torch.Size([]), 2),
        ("empty", torch.uint8, torch.Size([0, 3]), 0),
        ("\u4e2d\u6587", torch.int64, torch.Size([2]), 16),
    ]
    metadata = {"z": 'é\n"{}"', "a": ""}
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    start = 0
    for key, dtype, shape, size in tensors:
        name = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}.get(dtype, "I64")
        header[key] = {"dtype": name, "shape": list(shape), "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    assert safetensors_header(tensors, metadata) == len(text).to_bytes(8, "little") + text
