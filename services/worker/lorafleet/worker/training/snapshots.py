"""A run's state as a `TrainingSnapshot`, and back: what a checkpoint of a run holds.

`RunSnapshots.take` copies to host memory everything a run needs to continue exactly after its
current step (LoRA weights, optimizer and LR-schedule state, loss scaling, data order, the
run's random streams); `RunSnapshots.restore` puts a snapshot back into a freshly prepared run
(a resume, or a compiled run falling back to eager) and refuses, as `CorruptCheckpoint`, one
taken for another model, dataset or lorafleet version. Which tensors a snapshot copies is
worked out once and reused (`SnapshotPlan`). `job_fingerprint` names what a checkpoint was
trained on (a snapshot stores it; a resumed run compares it before restoring). The blob format
a snapshot becomes, and the host copies themselves, are checkpoint.py's; when a run snapshots
is loop.py's.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training.checkpoint import (
    DeviceSnapshotter,
    HostTensors,
    TrainingSnapshot,
    join_tensors,
    split_tensors,
    to_host,
)
from lorafleet.worker.training.config import Runtime
from lorafleet.worker.training.data import DataOrder, PreparedImage, TrainingData
from lorafleet.worker.training.failures import CorruptCheckpoint
from lorafleet.worker.training.lora import lora_parameters
from lorafleet.worker.training.optimization import Optimization
from lorafleet.worker.training.rng import TorchRngStream


def job_fingerprint(
    spec: JobSpec, instance: Sequence[PreparedImage], class_images: Sequence[PreparedImage]
) -> str:
    """Identifies what a checkpoint was trained on: weight-relevant spec fields and data."""
    data = {
        # The fields that train, as declared in core/spec.py (a pinned test guards the set).
        "spec": spec.fingerprint_values(),
        "instance": [[i.name, i.sha256, i.caption] for i in instance],
        "class": [i.sha256 for i in class_images],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class RunState(Protocol):
    """What a snapshot holds of a run (loop.py's `_Run`), and what a restore sets: its step and
    last loss, and (in place) its weights, optimizer, data order and random streams."""

    step: int
    last_loss: float

    @property
    def spec(self) -> JobSpec: ...

    @property
    def runtime(self) -> Runtime: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def trained(self) -> dict[str, Any]: ...

    @property
    def data(self) -> TrainingData: ...

    @property
    def optimization(self) -> Optimization: ...

    @property
    def data_generator(self) -> torch.Generator: ...

    @property
    def noise_generator(self) -> torch.Generator: ...

    @property
    def torch_rng(self) -> TorchRngStream: ...


class RunSnapshots:
    """Takes and restores the snapshots of one run; made once the run has its adapters."""

    def __init__(self, run: RunState) -> None:
        self.run = run
        self.plan: SnapshotPlan | None = None

    @functools.cached_property
    def live_lora(self) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters by checkpoint key. Found once: walking a full-size UNet's
        modules at every checkpoint took most of the training thread's snapshot time."""
        return {
            f"lora/{module_name}/{name}": param
            for module_name, module in self.run.trained.items()
            for name, param in lora_parameters(module)
        }

    def take(self) -> TrainingSnapshot:
        """Host copies of everything the run needs to continue exactly after its step."""
        run = self.run
        optimizer_state = run.optimization.optimizer.state_dict()
        plan = self.plan
        if plan is None or not plan.holds(optimizer_state["state"]):
            plan = self.plan = SnapshotPlan(self.live_lora, optimizer_state["state"])
        extra: dict[str, torch.Tensor] = {
            "rng/data": run.data_generator.get_state(),
            "rng/noise": run.noise_generator.get_state(),
            "rng/torch": run.torch_rng.cpu_state,
        }
        device_key = run.torch_rng.device_key
        if device_key is not None:
            assert run.torch_rng.device_state is not None
            extra[device_key] = run.torch_rng.device_state
        tensors = plan.host_tensors(extra)
        scaler = run.optimization.scaler
        state = {
            "fingerprint": run.fingerprint,
            "loss": run.last_loss,
            "data_order": run.data.order.state(),
            "optimizer": {"param_groups": optimizer_state["param_groups"]},
            "lr_scheduler": run.optimization.lr_scheduler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "rng": {"noise_device": run.runtime.device.type},
        }
        # A JSON round trip both deep-copies (nothing shared with the live run) and proves the
        # state is plain JSON before it leaves the training thread. The optimizer's per-tensor
        # references are the plan's, already plain JSON, and never written by anyone.
        state = json.loads(json.dumps(state))
        state["optimizer"]["state"] = plan.optimizer_references
        return TrainingSnapshot(step=run.step, tensors=tensors, state=state)

    def restore(self, snapshot: TrainingSnapshot) -> None:
        """Sets the run to `snapshot`'s state; `CorruptCheckpoint` when it does not fit."""
        try:
            self._restore(snapshot)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            # The blob verified, so this is a checkpoint of another lorafleet version or model.
            raise CorruptCheckpoint(
                f"checkpoint at step {snapshot.step} cannot be restored:"
                f" {type(exc).__name__}: {exc}"
            ) from exc

    def _restore(self, snapshot: TrainingSnapshot) -> None:
        run = self.run
        tensors = snapshot.tensors
        state = snapshot.state
        live = self.live_lora
        stored = {key for key in tensors if key.startswith("lora/")}
        if stored != set(live):
            raise CorruptCheckpoint(
                f"checkpoint at step {snapshot.step} holds other LoRA parameters than this model"
            )
        with torch.no_grad():
            for key, param in live.items():
                if tensors[key].shape != param.shape:
                    raise CorruptCheckpoint(f"checkpoint tensor {key} has the wrong shape")
                param.copy_(tensors[key])
        optimizer_state = {
            int(index): join_tensors(values, tensors)
            for index, values in state["optimizer"]["state"].items()
        }
        run.optimization.optimizer.load_state_dict(
            {"state": optimizer_state, "param_groups": state["optimizer"]["param_groups"]}
        )
        run.optimization.lr_scheduler.load_state_dict(dict(state["lr_scheduler"]))
        if run.optimization.scaler is not None and state["grad_scaler"] is not None:
            run.optimization.scaler.load_state_dict(state["grad_scaler"])
        order = DataOrder.from_state(state["data_order"])
        if order.size != run.data.order.size:
            raise CorruptCheckpoint("checkpoint data order is for a different dataset size")
        if order.buckets != run.data.order.buckets:
            raise CorruptCheckpoint("checkpoint data order is for other aspect-ratio buckets")
        run.data.order = order
        run.data_generator.set_state(tensors["rng/data"])
        same_device = state["rng"]["noise_device"] == run.runtime.device.type
        if same_device:
            run.noise_generator.set_state(tensors["rng/noise"])
        else:
            # CPU and CUDA generators are different algorithms: a checkpoint moved between the
            # two continues with a fresh, still deterministic, stream.
            run.noise_generator.manual_seed(run.spec.seed + 1 + snapshot.step)
        # The run's own torch stream; the process's generators are never touched. (Checkpoints
        # before it existed stored torch's global state here, which was then the same stream.)
        run.torch_rng.cpu_state = tensors["rng/torch"].clone()
        device_key = run.torch_rng.device_key
        if device_key is not None and device_key in tensors and same_device:
            run.torch_rng.device_state = tensors[device_key].clone()
        run.step = snapshot.step
        run.last_loss = float(state["loss"])


class SnapshotPlan:
    """What a run's snapshot copies, worked out once (at its first checkpoint) and reused while
    the optimizer keeps the same state tensors, which it updates in place: the checkpoint
    keys of the LoRA weights and optimizer state, the optimizer state's JSON skeleton (tensor
    references by key), and on a GPU the `DeviceSnapshotter` of those tensors. Walking
    thousands of state tensors and round-tripping their references through JSON at every
    checkpoint was most of a full-size run's snapshot time. State that is not all tensors
    (an optimizer keeping Python numbers) gets a new plan at every snapshot."""

    def __init__(
        self, lora: Mapping[str, torch.Tensor], state: Mapping[int, Mapping[str, Any]]
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(lora)
        references = {
            str(index): split_tensors(values, f"optimizer/{index}", self.tensors)
            for index, values in state.items()
        }
        self.optimizer_references: dict[str, Any] = json.loads(json.dumps(references))
        self._state = _flat_state(state)
        on_device = {k: v for k, v in self.tensors.items() if v.device.type != "cpu"}
        self._on_host = {k: v for k, v in self.tensors.items() if v.device.type == "cpu"}
        self._device = (
            DeviceSnapshotter(on_device) if on_device and self._state is not None else None
        )

    def holds(self, state: Mapping[int, Mapping[str, Any]]) -> bool:
        """Whether the optimizer state is still the tensors this plan was made from."""
        if self._state is None:
            return False
        flat = _flat_state(state)
        return (
            flat is not None
            and len(flat) == len(self._state)
            and all(
                a is b if isinstance(a, torch.Tensor) else a == b
                for a, b in zip(flat, self._state, strict=True)
            )
        )

    def host_tensors(self, extra: Mapping[str, torch.Tensor]) -> HostTensors:
        if self._device is None:
            return to_host({**self.tensors, **extra})
        return self._device.snapshot({**self._on_host, **extra})


def _flat_state(state: Mapping[int, Mapping[str, Any]]) -> list[Any] | None:
    """The optimizer state as one list (index, name, tensor, ...), or None when a value is not
    a tensor (it could change without the state's objects changing)."""
    flat: list[Any] = []
    for index, values in state.items():
        flat.append(index)
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                return None
            flat.extend((name, value))
    return flat
