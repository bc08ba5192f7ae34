"""Validation images from a sample task on the tiny model: the same images from a
checkpoint and from the result of the same step, on every call (seeded), a base model loaded
once for many tasks, and weights that do not fit refused as an input fault."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from lorafleet.core.model import FailureClass, SampleSettings
from lorafleet.worker.training import Finished, TrainingFailure, serialize_checkpoint
from lorafleet.worker.training.samples import SamplePipelines, SamplesStopped
from tests.support.training import SAMPLING_WARNING, TrainFn, make_config, tiny_spec

# Several training runs of the tiny model per test: slow, not in the fast lane (README,
# Development).
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SAMPLING_WARNING)]

SETTINGS = SampleSettings(
    prompts=("a photo of sks dog", "sks dog on a beach"),
    negative_prompt="blurry",
    guidance_scale=5.0,
    inference_steps=2,
    seed=3,
    resolution=64,
    images_per_prompt=2,
)


def test_checkpoint_and_result_of_a_step_make_the_same_images(
    train: TrainFn, tiny_model_dir: Path
) -> None:
    # A run of 2 steps (its result), and a longer one that checkpointed at step 2: the same
    # LoRA at step 2 (seeded, constant learning rate), stored in the two formats.
    spec = tiny_spec(max_train_steps=2)
    outcome, _ = train(spec)
    _, recorded = train(tiny_spec(max_train_steps=3, checkpointing_steps=2))
    assert isinstance(outcome, Finished) and [s.step for s in recorded.snapshots] == [2]
    checkpoint = bytes(serialize_checkpoint(recorded.snapshots[0]))  # as downloaded
    pipelines = SamplePipelines()
    config = make_config(tiny_model_dir, spec)
    from_checkpoint = pipelines.make(
        config, settings=SETTINGS, weights=checkpoint, weights_is_checkpoint=True
    )
    from_result = pipelines.make(
        config, settings=SETTINGS, weights=outcome.lora_weights, weights_is_checkpoint=False
    )
    again = SamplePipelines().make(
        config, settings=SETTINGS, weights=checkpoint, weights_is_checkpoint=True
    )
    assert pipelines.loads == 1  # the base pipeline stayed loaded between the two tasks
    assert [(p, i) for p, i, _ in from_checkpoint] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert from_checkpoint == from_result == again
    for _, _, png in from_checkpoint:
        assert Image.open(io.BytesIO(png)).size == (64, 64)
    # Different seeds per image index, and the prompt matters.
    assert len({png for _, _, png in from_checkpoint}) == 4
    # The LoRA matters: the base model alone (an untrained adapter) draws other pictures.
    untrained = tiny_spec(max_train_steps=2, learning_rate=1e-9)
    base_outcome, _ = train(untrained)
    assert isinstance(base_outcome, Finished)
    base = pipelines.make(
        config, settings=SETTINGS, weights=base_outcome.lora_weights, weights_is_checkpoint=False
    )
    assert base != from_result
    # Released for a training lease, loaded again by the next task.
    pipelines.release()
    pipelines.make(config, settings=SETTINGS, weights=checkpoint, weights_is_checkpoint=True)
    assert pipelines.loads == 2


def test_weights_that_do_not_fit_are_an_input_fault_and_stop_is_honoured(
    train: TrainFn, tiny_model_dir: Path
) -> None:
    spec = tiny_spec(max_train_steps=1)
    outcome, _ = train(spec)
    assert isinstance(outcome, Finished)
    pipelines = SamplePipelines()
    other_shape = make_config(tiny_model_dir, tiny_spec(max_train_steps=1, lora_rank=8))
    with pytest.raises(TrainingFailure) as raised:
        pipelines.make(
            other_shape,
            settings=SETTINGS,
            weights=outcome.lora_weights,
            weights_is_checkpoint=False,
        )
    assert raised.value.failure_class is FailureClass.INPUT
    with pytest.raises(TrainingFailure):
        pipelines.make(
            other_shape, settings=SETTINGS, weights=b"garbage", weights_is_checkpoint=True
        )
    with pytest.raises(SamplesStopped):
        pipelines.make(
            make_config(tiny_model_dir, spec),
            settings=SETTINGS,
            weights=outcome.lora_weights,
            weights_is_checkpoint=False,
            should_stop=lambda: True,
        )
