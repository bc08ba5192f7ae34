"""A NaN or Inf never becomes a checkpoint or a result: the lease ends as a node fault."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lorafleet.core.model import FailureClass
from lorafleet.worker.training.failures import TrainingFailure
from lorafleet.worker.training.families import sdxl
from lorafleet.worker.training.objective import dreambooth_loss
from tests.support.training import Recorder, TrainFn, tiny_spec


def test_a_nan_loss_stops_the_run_before_any_checkpoint_holds_it(
    train: TrainFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    real = dreambooth_loss

    def nan_from_the_third_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        value = real(*args, **kwargs)
        return value * float("nan") if calls >= 3 else value

    monkeypatch.setattr(sdxl, "dreambooth_loss", nan_from_the_third_step)
    recorder = Recorder()
    with pytest.raises(TrainingFailure) as stopped:
        train(tiny_spec(max_train_steps=6, checkpointing_steps=2), recorder=recorder)
    assert stopped.value.failure_class is FailureClass.NODE
    assert "non-finite" in str(stopped.value) and "by step 4" in str(stopped.value)
    # The checkpoint before the NaN was taken; none after it.
    assert [s.step for s in recorder.snapshots] == [2]


def test_finite_runs_are_untouched(train: TrainFn) -> None:
    outcome, recorder = train(tiny_spec(max_train_steps=4, checkpointing_steps=2))
    assert [s.step for s in recorder.snapshots] == [2]
    assert outcome.step == 4
