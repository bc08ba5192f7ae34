"""The trainer tests: the test device, one intra-op thread, and `train` on the tiny model
(tests/support/fixtures.py builds it once per run)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training import Trainer, TrainingImage, TrainingOutcome, TrainingSnapshot
from lorafleet.worker.training.resident import ResidentModel
from tests.support.training import TEST_DEVICE, Recorder, TrainFn, instance_images, make_config

if TEST_DEVICE == "cuda":
    # Bit-identical resume on the GPU needs deterministic kernels: cuBLAS's fixed workspace
    # (read when its handle is created) and torch's deterministic algorithms. Where torch has
    # none (the UNet's upsampling backward), warn_only runs the nondeterministic one, so the
    # tests that compare bits show whether that one is deterministic in practice.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a GPU and run in a `LORAFLEET_TEST_DEVICE=cuda` run of the
    suite; elsewhere they are deselected (reported as such), never skipped."""
    if TEST_DEVICE == "cuda":
        return
    selected = [item for item in items if item.get_closest_marker("cuda") is None]
    if len(selected) != len(items):
        config.hook.pytest_deselected(
            items=[item for item in items if item.get_closest_marker("cuda") is not None]
        )
        items[:] = selected


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_intra_op_thread: None) -> None:
    """Every trainer test trains: one intra-op thread (tests/support/fixtures.py says why)."""


@pytest.fixture
def train(tiny_model_dir: Path) -> TrainFn:
    """Runs one training job on the tiny model and returns (outcome, recorded hooks)."""

    def run(
        spec: JobSpec,
        images: Sequence[TrainingImage] | None = None,
        *,
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        recorder: Recorder | None = None,
        resident: ResidentModel | None = None,
        **config: Any,
    ) -> tuple[TrainingOutcome, Recorder]:
        recorder = recorder or Recorder()
        trainer = Trainer(make_config(tiny_model_dir, spec, **config), resident)
        outcome = trainer.run(
            instance_images=instance_images() if images is None else images,
            class_images=class_images,
            resume=resume,
            hooks=recorder.hooks(),
        )
        return outcome, recorder

    return run
