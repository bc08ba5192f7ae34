"""Helpers for the trainer tests: the test device, training images, specs, a hook recorder."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training import (
    Finished,
    StopReason,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
)
from tests.support.images import RESOLUTION, image_bytes

# The device the trainer tests train on: the CPU unless a GPU run of the suite asks for CUDA
# (`LORAFLEET_TEST_DEVICE=cuda`, README "On a GPU"). Never "auto": a developer's GPU box would
# otherwise test other paths than CI does without saying so.
TEST_DEVICE = os.environ.get("LORAFLEET_TEST_DEVICE", "cpu")

# diffusers' Euler/DPM schedulers call np.array() on a torch tensor, which under NumPy 2 with this
# torch build warns that __array__ lacks the `copy` keyword. Only tests that sample images
# (class images, validation images, pipeline inference) hit it.
SAMPLING_WARNING = (
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def instance_images(
    count: int = 3, size: tuple[int, int] = (RESOLUTION, RESOLUTION)
) -> list[TrainingImage]:
    return [TrainingImage(f"img{i}.png", image_bytes(i, size)) for i in range(count)]


def tiny_spec(**overrides: Any) -> JobSpec:
    values: dict[str, Any] = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "instance",
        "max_train_steps": 2,
        "resolution": RESOLUTION,
        "checkpointing_steps": 100,
        "seed": 7,
        # A large rate so that a few steps move the weights visibly.
        "learning_rate": 1e-2,
    }
    if overrides.get("model_family") != "flux2":
        # klein's text encoder never trains: its spec refuses an encoder rate.
        values["text_encoder_learning_rate"] = 5e-3
    values.update(overrides)
    return JobSpec(**values)


@dataclass
class Recorder:
    """Collects every hook call of a run."""

    progress: list[tuple[int, float, float, float]] = field(default_factory=list)
    snapshots: list[TrainingSnapshot] = field(default_factory=list)
    class_images: list[tuple[int, bytes]] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    stop_at: int | None = None
    stop_reason: StopReason = "drain"

    def hooks(self) -> TrainingHooks:
        return TrainingHooks(
            on_progress=lambda *values: self.progress.append(values),
            should_stop=self._should_stop,
            on_checkpoint=self.snapshots.append,
            on_class_images=self.class_images.extend,
            on_notice=self.notices.append,
        )

    def _should_stop(self) -> StopReason | None:
        done = self.progress[-1][0] if self.progress else 0
        if self.stop_at is not None and done >= self.stop_at:
            return self.stop_reason
        return None


def make_config(model_dir: Path, spec: JobSpec, **overrides: Any) -> TrainingConfig:
    values: dict[str, Any] = {
        "spec": spec,
        "model_path": str(model_dir),
        "local_files_only": True,
        "device": TEST_DEVICE,
        "sample_steps": 2,
        "sample_batch_size": 2,
    }
    values.update(overrides)
    return TrainingConfig(**values)


TrainFn = Callable[..., tuple[TrainingOutcome, Recorder]]


def lora_tensors(outcome: TrainingOutcome) -> dict[str, torch.Tensor]:
    assert isinstance(outcome, Finished), outcome
    return safetensors.torch.load(outcome.lora_weights)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
