"""scale_lr multiplies the UNet's learning rate by the images per optimizer step."""

from __future__ import annotations

import pytest

from lorafleet.worker.training import Finished
from tests.support.training import TrainFn, lora_tensors, same_tensors, tiny_spec


def test_scale_lr_multiplies_the_learning_rate_by_batch_and_accumulation(train: TrainFn) -> None:
    shape = {"max_train_steps": 1, "train_batch_size": 2, "gradient_accumulation_steps": 3}
    plain, plain_run = train(tiny_spec(**shape))
    scaled, scaled_run = train(tiny_spec(**shape, scale_lr=True))
    assert isinstance(plain, Finished) and isinstance(scaled, Finished)
    # The rate the run reports (the UNet group's) is the spec's, times 2 x 3 when scaled.
    assert plain_run.progress[-1][2] == pytest.approx(1e-2)
    assert scaled_run.progress[-1][2] == pytest.approx(6e-2)
    assert not same_tensors(lora_tensors(plain), lora_tensors(scaled))
