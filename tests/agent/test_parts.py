"""The agent's parts on their own: configuration, the probe, backoff, the progress slot, the
checkpoint pipeline and the state table."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from lorafleet.errors import StorageError
from lorafleet.worker.agent import TRANSITIONS, Agent, State, backoff_delay
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease_runner import (
    CheckpointPipeline,
    ProgressReport,
    ProgressSlot,
    failure_message,
)
from lorafleet.worker.main import build_parser, config_from_args, main
from lorafleet.worker.qualify import probe
from lorafleet.worker.training import TrainingFailure, TrainingSnapshot


def test_config_reads_salad_identity_and_flags_win() -> None:
    env = {
        "LORAFLEET_WORKER_TOKEN": "t0k",
        "LORAFLEET_SCHEDULER": "sched.internal:443",
        "SALAD_MACHINE_ID": "salad-machine-1",
        "LORAFLEET_MACHINE_ID": "ignored",
        "SALAD_CONTAINER_GROUP_INSTANCE_ID": "cg-instance-9",
        "LORAFLEET_ALLOW_CPU": "1",
        "LORAFLEET_VRAM_MB": "24576",
        "LORAFLEET_DRAIN_GRACE_S": "12.5",
    }
    config = WorkerConfig.from_env(env)
    assert config.worker_token == "t0k" and config.scheduler_address == "sched.internal:443"
    assert config.machine_id == "salad-machine-1"
    assert config.provider_instance_id == "cg-instance-9"
    assert config.allow_cpu and config.vram_mb == 24576 and config.drain_grace_s == 12.5

    args = build_parser().parse_args(["--machine-id", "flag-machine", "--drain-grace-s", "3"])
    flagged = config_from_args(args, env)
    assert flagged.machine_id == "flag-machine" and flagged.drain_grace_s == 3.0
    assert flagged.provider_instance_id == "cg-instance-9"  # untouched by flags

    fallback = WorkerConfig.from_env({"LORAFLEET_WORKER_TOKEN": "x", "SALAD_INSTANCE_ID": "vm-7"})
    assert fallback.provider_instance_id == "vm-7" and not fallback.allow_cpu


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "worker_token"),
        ({"LORAFLEET_WORKER_TOKEN": "x", "SALAD_MACHINE_ID": "has space"}, "machine_id"),
        ({"LORAFLEET_WORKER_TOKEN": "x", "LORAFLEET_VRAM_MB": "lots"}, "LORAFLEET_VRAM_MB"),
        ({"LORAFLEET_WORKER_TOKEN": "x", "LORAFLEET_DEVICE": "tpu"}, "device"),
    ],
)
def test_config_refuses_bad_values_naming_them(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig.from_env(env)


def test_main_exits_2_on_bad_configuration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LORAFLEET_WORKER_TOKEN", raising=False)
    assert main([]) == 2
    assert "worker_token: required" in capsys.readouterr().err


def test_probe_passes_on_cpu_only_when_allowed(tmp_path: Path) -> None:
    base = WorkerConfig(
        worker_token="x", min_free_disk_mb=0, min_free_memory_mb=0, model_cache_dir=str(tmp_path)
    )
    allowed = probe(base.with_changes(allow_cpu=True))
    assert allowed.passed, allowed.detail
    assert allowed.gpu_model == "cpu" and allowed.vram_mb == 0 and allowed.tflops > 0
    assert allowed.versions["torch"] == torch.__version__
    assert {"diffusers", "transformers", "peft", "accelerate", "cuda"} <= set(allowed.versions)
    assert allowed.free_disk_mb > 0 and allowed.free_memory_mb > 0
    proto = allowed.to_proto()
    assert proto.passed and proto.versions["torch"] == torch.__version__

    refused = probe(base)
    assert not refused.passed and "--allow-cpu" in refused.detail

    too_slow = probe(base.with_changes(allow_cpu=True, min_tflops=1e9))
    assert not too_slow.passed and "TFLOPS" in too_slow.detail

    overridden = probe(base.with_changes(allow_cpu=True, gpu_model="NVIDIA L4", vram_mb=23034))
    assert overridden.gpu_model == "NVIDIA L4" and overridden.vram_mb == 23034


def test_backoff_is_jittered_and_bounded() -> None:
    import random

    rng = random.Random(1)
    for attempt in range(60):
        ceiling = min(5.0, 0.1 * 2**attempt)
        delays = [backoff_delay(attempt, initial_s=0.1, max_s=5.0, rng=rng) for _ in range(50)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1  # jitter: retrying workers do not stampede together


def test_progress_slot_keeps_only_the_latest_value() -> None:
    slot = ProgressSlot(ProgressReport(step=0))

    def train() -> None:
        for step in range(1, 10_001):
            slot.publish(ProgressReport(step=step, loss=1.0 / step))

    writer = threading.Thread(target=train)
    writer.start()
    seen = [slot.latest().step]
    writer.join()
    seen.append(slot.latest().step)
    assert seen[-1] == 10_000 and seen == sorted(seen)


def _snapshot(step: int) -> TrainingSnapshot:
    return TrainingSnapshot(step=step, tensors={}, state={})


async def test_checkpoint_pipeline_uploads_one_at_a_time_keeping_the_newest() -> None:
    started: list[int] = []
    finished: list[int] = []
    gates = {step: asyncio.Event() for step in range(1, 6)}
    running = asyncio.Event()
    four_done = asyncio.Event()

    async def upload(snapshot: TrainingSnapshot) -> None:
        started.append(snapshot.step)
        running.set()
        await gates[snapshot.step].wait()
        finished.append(snapshot.step)
        if snapshot.step == 4:
            four_done.set()

    pipeline = CheckpointPipeline(upload)
    pipeline.offer(_snapshot(1))
    await asyncio.wait_for(running.wait(), 5)
    # Step 1 is uploading; 2, 3 and 4 arrive meanwhile: only the newest waits.
    for step in (2, 3, 4):
        pipeline.offer(_snapshot(step))
    assert pipeline.dropped_steps == [2, 3]
    running.clear()
    gates[1].set()
    await asyncio.wait_for(running.wait(), 5)
    assert started == [1, 4]
    gates[4].set()
    await asyncio.wait_for(four_done.wait(), 5)
    assert finished == [1, 4]
    await pipeline.close()
    pipeline.offer(_snapshot(5))  # closed: ignored
    assert started == [1, 4]


async def test_checkpoint_pipeline_survives_a_failed_upload() -> None:
    done = asyncio.Event()
    first = asyncio.Event()
    calls: list[int] = []

    async def upload(snapshot: TrainingSnapshot) -> None:
        calls.append(snapshot.step)
        if snapshot.step == 1:
            first.set()
            raise StorageError("PUT http://store/x: HTTP 503", retryable=True)
        done.set()

    pipeline = CheckpointPipeline(upload)
    pipeline.offer(_snapshot(1))
    await asyncio.wait_for(first.wait(), 5)
    pipeline.offer(_snapshot(2))
    await asyncio.wait_for(done.wait(), 5)
    await pipeline.close()
    assert calls == [1, 2]


def test_every_state_can_stop_and_illegal_transitions_raise() -> None:
    for state in State:
        if state is not State.STOPPED:
            assert State.STOPPED in TRANSITIONS[state], state
    assert TRANSITIONS[State.STOPPED] == frozenset()
    # Leased work only ever comes from IDLE (a grant) or CONNECTING (a resumed lease).
    assert {s for s in State if State.LEASED in TRANSITIONS[s]} == {State.IDLE, State.CONNECTING}
    agent = Agent(WorkerConfig(worker_token="x"))
    with pytest.raises(RuntimeError, match="qualifying -> leased"):
        agent._set_state(State.LEASED)


def test_failure_messages_keep_the_trainers_words() -> None:
    assert failure_message(TrainingFailure("input", "2 of 3 images are too small")) == (
        "2 of 3 images are too small"
    )
    assert failure_message(RuntimeError("boom")) == "RuntimeError: boom"
    assert len(failure_message(ValueError("x" * 10_000))) == 4000
