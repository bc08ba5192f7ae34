"""Exact resume: a run interrupted at checkpoints and resumed from the serialized bytes trains
bit-identical LoRA weights to an uninterrupted run (CPU); trainers share no process state."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest

from lorafleet.worker.training import (
    CorruptCheckpoint,
    Finished,
    Stopped,
    StopReason,
    Trainer,
    TrainingImage,
    TrainingSnapshot,
    load_checkpoint,
    serialize_checkpoint,
)
from tests.support.images import image_bytes
from tests.support.training import (
    SAMPLING_WARNING,
    Recorder,
    TrainFn,
    instance_images,
    lora_tensors,
    make_config,
    same_tensors,
    tiny_spec,
)

# Several training runs of the tiny model per test: slow, not in the fast lane (README,
# Development).
pytestmark = pytest.mark.slow

STEPS = 6


def _resume_in_legs(
    train: TrainFn,
    spec_kwargs: dict[str, Any],
    stops: list[int],
    images: list[TrainingImage],
    class_images: list[TrainingImage],
) -> Finished:
    """Trains, stopping (drain) after each step in `stops`, each time resuming a new Trainer
    from the serialized snapshot bytes, until the end."""
    resume: TrainingSnapshot | None = None
    for stop in [*stops, None]:
        outcome, _ = train(
            tiny_spec(**spec_kwargs),
            images,
            class_images=class_images,
            resume=resume,
            recorder=Recorder(stop_at=stop),
        )
        if stop is None:
            assert isinstance(outcome, Finished)
            return outcome
        assert isinstance(outcome, Stopped)
        assert outcome.step == stop
        assert outcome.snapshot is not None
        resume = load_checkpoint(serialize_checkpoint(outcome.snapshot))
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("spec_kwargs", "stops", "size"),
    [
        pytest.param({}, [2], (64, 64), id="plain-cached-latents"),
        pytest.param(
            {
                "random_flip": True,
                "gradient_accumulation_steps": 2,
                "train_batch_size": 2,
                "train_text_encoder": True,
                "lr_scheduler": "cosine",
                "lr_warmup_steps": 2,
            },
            [1, 4],
            (80, 64),
            id="flip-random-crop-accumulation-text-encoder",
        ),
        pytest.param(
            {
                "with_prior_preservation": True,
                "class_prompt": "a photo of a dog",
                "num_class_images": 2,
                "snr_gamma": 5.0,
                "noise_offset": 0.1,
                "mixed_precision": "bf16",
            },
            [3],
            (64, 64),
            id="prior-preservation-snr-offset-bf16",
            marks=pytest.mark.filterwarnings(SAMPLING_WARNING),
        ),
        pytest.param(
            {
                "optimizer": "prodigy",
                "learning_rate": 1.0,
                "use_dora": True,
                # Dropout under gradient checkpointing: the recomputed forward must draw the
                # same masks from the run's stream.
                "lora_dropout": 0.3,
                "gradient_checkpointing": True,
                "train_text_encoder": True,
                "repeats": 2,
                "random_flip": True,
            },
            [2, 3],
            (64, 64),
            id="prodigy-dora-dropout-checkpointing-repeats",
        ),
    ],
)
def test_resumed_run_is_bit_identical(
    train: TrainFn, spec_kwargs: dict[str, Any], stops: list[int], size: tuple[int, int]
) -> None:
    # Three images with batch 2 leave a partial batch: epochs and data order really matter.
    images = instance_images(3, size)
    full, recorder = train(tiny_spec(max_train_steps=STEPS, **spec_kwargs), images)
    # Prior preservation: the resumed legs get the class images the first run generated, as
    # the worker would pass them back from storage.
    class_images = [TrainingImage(f"{i}.png", png) for i, png in recorder.class_images]
    resumed = _resume_in_legs(
        train, {"max_train_steps": STEPS, **spec_kwargs}, stops, images, class_images
    )
    assert isinstance(full, Finished)
    assert resumed.step == full.step == STEPS
    assert same_tensors(lora_tensors(full), lora_tensors(resumed))
    assert (
        hashlib.sha256(full.lora_weights).digest() == hashlib.sha256(resumed.lora_weights).digest()
    )
    assert resumed.loss == full.loss


def test_periodic_checkpoint_resumes_identically(train: TrainFn) -> None:
    """The on_checkpoint snapshots, serialized on another thread's schedule, resume exactly."""
    spec = tiny_spec(max_train_steps=4, checkpointing_steps=2, random_flip=True)
    full, recorder = train(spec)
    assert [s.step for s in recorder.snapshots] == [2]  # not at the final step
    blob = serialize_checkpoint(recorder.snapshots[0])
    resumed, again = train(spec, resume=load_checkpoint(blob))
    assert [p[0] for p in again.progress] == [3, 4]
    assert same_tensors(lora_tensors(full), lora_tensors(resumed))


def test_cancel_stops_without_snapshot_and_drain_with_one(train: TrainFn) -> None:
    cancelled, recorder = train(
        tiny_spec(max_train_steps=5), recorder=Recorder(stop_at=2, stop_reason="cancel")
    )
    assert isinstance(cancelled, Stopped)
    assert (cancelled.step, cancelled.reason, cancelled.snapshot) == (2, "cancel", None)
    assert [p[0] for p in recorder.progress] == [1, 2]
    drained, _ = train(tiny_spec(max_train_steps=5), recorder=Recorder(stop_at=2))
    assert isinstance(drained, Stopped)
    assert drained.reason == "drain"
    assert drained.snapshot is not None
    assert drained.snapshot.step == 2


def test_cancel_interrupts_gradient_accumulation(train: TrainFn) -> None:
    """A cancel is honoured between accumulation micro-steps, not only between steps."""
    calls = 0

    class CountingRecorder(Recorder):
        def _should_stop(self) -> Any:
            nonlocal calls
            calls += 1
            # Polls: before step 1, then between its 3 micro-steps.
            return "cancel" if calls == 3 else None

    outcome, recorder = train(
        tiny_spec(max_train_steps=3, gradient_accumulation_steps=3), recorder=CountingRecorder()
    )
    assert isinstance(outcome, Stopped)
    assert outcome.step == 0
    assert recorder.progress == []


def test_drain_right_after_resume_has_nothing_new_to_snapshot(train: TrainFn) -> None:
    _, recorder = train(tiny_spec(max_train_steps=4, checkpointing_steps=2))
    outcome, _ = train(
        tiny_spec(max_train_steps=4, checkpointing_steps=2),
        resume=recorder.snapshots[0],
        recorder=Recorder(stop_at=0),
    )
    assert isinstance(outcome, Stopped)
    assert (outcome.step, outcome.snapshot) == (2, None)


def test_checkpoint_of_another_job_is_refused(train: TrainFn) -> None:
    _, recorder = train(tiny_spec(max_train_steps=3, checkpointing_steps=1))
    snapshot = recorder.snapshots[0]
    with pytest.raises(CorruptCheckpoint, match="other settings or data"):
        train(tiny_spec(max_train_steps=3, lora_rank=8), resume=snapshot)
    other_images = [TrainingImage("x.png", image_bytes(99))]
    with pytest.raises(CorruptCheckpoint, match="other settings or data"):
        train(tiny_spec(max_train_steps=3), other_images, resume=snapshot)


def test_several_trainers_live_in_one_process(tiny_model_dir: Path) -> None:
    """Nothing of a run is process-wide: trainers with different precision and accumulation
    run one after another, and a run's result does not depend on the runs before it. Runs
    started at once take turns and give the same results."""
    bf16 = tiny_spec(mixed_precision="bf16")
    fp32 = tiny_spec(gradient_accumulation_steps=2)

    def run(trainer: Trainer) -> Finished:
        outcome = trainer.run(instance_images=instance_images())
        assert isinstance(outcome, Finished) and outcome.step == trainer.config.spec.max_train_steps
        return outcome

    trainers = [Trainer(make_config(tiny_model_dir, spec)) for spec in (bf16, fp32, bf16)]
    first, other, again = (run(trainer) for trainer in trainers)
    assert same_tensors(lora_tensors(first), lora_tensors(again))
    assert not same_tensors(lora_tensors(first), lora_tensors(other))

    at_once = [Trainer(make_config(tiny_model_dir, spec)) for spec in (fp32, bf16)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, trainer) for trainer in at_once]
        done = [future.result(timeout=120) for future in futures]
    assert same_tensors(lora_tensors(done[0]), lora_tensors(other))
    assert same_tensors(lora_tensors(done[1]), lora_tensors(first))


@pytest.mark.parametrize("reason", ["cancel", "drain"])
def test_a_stop_while_the_run_prepares_ends_it_at_that_phase(
    tiny_model_dir: Path, reason: StopReason
) -> None:
    """Cancel and drain reach every phase before the first step (a model download, class
    images, precompute, compiling): the run ends at the next phase with nothing trained."""
    phases: list[str] = []
    stop_at = "precompute"

    def on_phase(name: str) -> None:
        phases.append(name)

    def should_stop() -> StopReason | None:
        return reason if stop_at in phases else None

    recorder = Recorder()
    hooks = dataclasses.replace(recorder.hooks(), on_phase=on_phase, should_stop=should_stop)
    trainer = Trainer(make_config(tiny_model_dir, tiny_spec(max_train_steps=5)))
    outcome = trainer.run(instance_images=instance_images(), hooks=hooks)
    assert isinstance(outcome, Stopped)
    assert (outcome.step, outcome.reason, outcome.snapshot) == (0, reason, None)
    assert phases[:3] == ["decode_images", "load_model", "class_images"]
    assert phases[-1] == stop_at and recorder.progress == []
