"""The simulated trainer: deterministic, resumable bit for bit, and a wrong resume shows."""

from __future__ import annotations

import dataclasses
import time

import pytest

from lorafleet.core.model import FailureClass
from lorafleet.core.spec import JobSpec
from lorafleet.worker.simulated import (
    SimulatedTrainer,
    result_sha256,
    run_simulated,
    simulated_trainer_factory,
)
from lorafleet.worker.training import (
    CorruptCheckpoint,
    Finished,
    Stopped,
    StopReason,
    TrainingConfig,
    TrainingFailure,
    TrainingHooks,
    TrainingImage,
    TrainingSnapshot,
    load_checkpoint,
    serialize_checkpoint,
)

STEPS = 1400
INTERVAL = 100
SIZE = 64 * 1024
IMAGES = [TrainingImage("a.png", b"first image"), TrainingImage("b.png", b"second image")]


def spec(**overrides: object) -> JobSpec:
    values: dict[str, object] = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "dogs/rex",
        "max_train_steps": STEPS,
        "checkpointing_steps": INTERVAL,
        "seed": 11,
    }
    values.update(overrides)
    return JobSpec(**values)  # type: ignore[arg-type]


def run_with_checkpoints(
    job: JobSpec, resume: TrainingSnapshot | None = None
) -> tuple[str, dict[int, TrainingSnapshot]]:
    snapshots: dict[int, TrainingSnapshot] = {}
    outcome = run_simulated(
        job,
        IMAGES,
        checkpoint_bytes=SIZE,
        resume=resume,
        hooks=TrainingHooks(on_checkpoint=lambda s: snapshots.__setitem__(s.step, s)),
    )
    return result_sha256(outcome), snapshots


def round_trip(snapshot: TrainingSnapshot) -> TrainingSnapshot:
    return load_checkpoint(serialize_checkpoint(snapshot))


def test_deterministic_per_seed() -> None:
    first, snapshots = run_with_checkpoints(spec())
    again, _ = run_with_checkpoints(spec())
    other, _ = run_with_checkpoints(spec(seed=12))
    assert first == again
    assert other != first
    # A checkpoint at every interval below the last step, each a real blob of about SIZE.
    assert sorted(snapshots) == list(range(INTERVAL, STEPS, INTERVAL))
    blob = serialize_checkpoint(snapshots[700])
    assert SIZE * 0.9 < len(blob) < SIZE * 1.1
    assert serialize_checkpoint(round_trip(snapshots[700])) == blob


def test_resume_from_a_middle_checkpoint_gives_the_same_result() -> None:
    expected, snapshots = run_with_checkpoints(spec())
    for step in (100, 700, 1300):
        resumed, later = run_with_checkpoints(spec(), resume=round_trip(snapshots[step]))
        assert resumed == expected, step
        # It goes on from the checkpoint: the next one is one interval later.
        assert min(later, default=STEPS) == min(step + INTERVAL, STEPS)


def test_a_wrong_resume_changes_the_result() -> None:
    expected, snapshots = run_with_checkpoints(spec())
    good = round_trip(snapshots[700])
    # Off by one either way: a step skipped, a step repeated.
    for wrong_step in (699, 701):
        wrong = dataclasses.replace(good, step=wrong_step)
        assert run_with_checkpoints(spec(), resume=wrong)[0] != expected, wrong_step
    # A stale RNG: the data generator of an older checkpoint.
    stale = dict(good.tensors)
    stale["rng/data"] = snapshots[600].tensors["rng/data"]
    assert run_with_checkpoints(spec(), resume=dataclasses.replace(good, tensors=stale))[0] != (
        expected
    )
    # A stale Python RNG in the JSON state.
    state = dict(good.state)
    state["rng"] = {**good.state["rng"], "python": snapshots[600].state["rng"]["python"]}
    assert run_with_checkpoints(spec(), resume=dataclasses.replace(good, state=state))[0] != (
        expected
    )


def test_checkpoints_of_another_job_are_refused() -> None:
    _, snapshots = run_with_checkpoints(spec())
    with pytest.raises(CorruptCheckpoint, match="other settings or data"):
        run_with_checkpoints(spec(learning_rate=1e-3), resume=snapshots[700])
    # Spec fields that do not change the weights keep checkpoints valid (as for Trainer).
    expected, _ = run_with_checkpoints(spec(priority=5))
    assert run_with_checkpoints(spec(priority=5), resume=snapshots[700])[0] == expected


def stop_at(step: int, reason: StopReason) -> tuple[TrainingHooks, list[int]]:
    seen: list[int] = []
    hooks = TrainingHooks(
        on_progress=lambda s, *_: seen.append(s),
        should_stop=lambda: reason if seen and seen[-1] >= step else None,
    )
    return hooks, seen


def test_drain_stops_with_a_snapshot_that_resumes_exactly() -> None:
    expected, _ = run_with_checkpoints(spec())
    hooks, seen = stop_at(555, "drain")
    trainer = SimulatedTrainer(TrainingConfig(spec=spec()), step_s=0.0, checkpoint_bytes=SIZE)
    outcome = trainer.run(instance_images=IMAGES, hooks=hooks)
    assert isinstance(outcome, Stopped)
    assert outcome.reason == "drain" and outcome.step == 555 and seen[-1] == 555
    assert outcome.snapshot is not None and outcome.snapshot.step == 555
    assert run_with_checkpoints(spec(), resume=round_trip(outcome.snapshot))[0] == expected


def test_cancel_stops_between_steps_without_a_snapshot() -> None:
    hooks, _ = stop_at(3, "cancel")
    trainer = SimulatedTrainer(TrainingConfig(spec=spec()), step_s=0.0, checkpoint_bytes=SIZE)
    outcome = trainer.run(instance_images=IMAGES, hooks=hooks)
    assert outcome == Stopped(step=3, reason="cancel", snapshot=None)


def test_step_time_is_paced() -> None:
    job = spec(max_train_steps=50)
    trainer = simulated_trainer_factory(step_s=0.002, checkpoint_bytes=SIZE)(
        TrainingConfig(spec=job)
    )
    times: list[float] = []
    outcome = trainer.run(
        instance_images=IMAGES, hooks=TrainingHooks(on_progress=lambda *a: times.append(a[3]))
    )
    assert isinstance(outcome, Finished) and outcome.step == 50
    # Paced against a deadline: the 50 steps took at least 50 x 2 ms in all.
    assert sum(times) >= 0.1
    # The pace does not change the numbers.
    assert result_sha256(outcome) == result_sha256(
        run_simulated(job, IMAGES, checkpoint_bytes=SIZE)
    )


def test_a_checkpoint_stall_costs_training_time_and_is_timed() -> None:
    """The stall is outside the pacing (the steps after it are not hurried), the worker reads
    it off `timings` as the real trainer's, and it changes no number."""
    job = spec(max_train_steps=50, checkpointing_steps=10)
    trainer = simulated_trainer_factory(
        step_s=0.002, checkpoint_bytes=SIZE, checkpoint_stall_s=0.03
    )(TrainingConfig(spec=job))
    taken: list[int] = []
    started = time.monotonic()
    outcome = trainer.run(
        instance_images=IMAGES,
        hooks=TrainingHooks(on_checkpoint=lambda snapshot: taken.append(snapshot.step)),
    )
    elapsed = time.monotonic() - started
    assert isinstance(outcome, Finished)
    assert taken == [10, 20, 30, 40]
    assert len(trainer.timings.snapshot_seconds) == 4
    assert min(trainer.timings.snapshot_seconds) >= 0.03
    # 50 paced steps plus four stalls; absorbed by the pacing it would be about 0.1 s.
    assert elapsed >= 50 * 0.002 + 4 * 0.03
    assert result_sha256(outcome) == result_sha256(
        run_simulated(job, IMAGES, checkpoint_bytes=SIZE)
    )


def test_a_bad_node_fails_every_job_as_a_node_fault() -> None:
    trainer = simulated_trainer_factory(step_s=0.0, checkpoint_bytes=SIZE, node_fault=True)(
        TrainingConfig(spec=spec())
    )
    with pytest.raises(TrainingFailure) as raised:
        trainer.run(instance_images=IMAGES)
    assert raised.value.failure_class is FailureClass.NODE
