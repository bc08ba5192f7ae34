"""The agent's parts on their own: configuration, the probe, reconnect backoff, the training
thread, the progress slot, the checkpoint pipeline and the state table."""

from __future__ import annotations

import asyncio
import contextvars
import random
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from lorafleet.core.errors import StorageError
from lorafleet.core.model import FailureClass
from lorafleet.core.settings import ConfigError, env_names, load
from lorafleet.worker import agent as agent_module
from lorafleet.worker.agent import TRANSITIONS, Agent, State
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease_runner import (
    CheckpointPipeline,
    ProgressReport,
    ProgressSlot,
    failure_message,
)
from lorafleet.worker.main import build_parser, config_from_args, main
from lorafleet.worker.qualify import QualificationResult, probe, total_host_memory_mb
from lorafleet.worker.training import TrainingFailure, TrainingSnapshot
from lorafleet.worker.training_thread import TrainingThread


def test_config_reads_salad_identity_and_flags_win() -> None:
    env = {
        "LORAFLEET_WORKER_TOKEN": "t0k",
        "LORAFLEET_SCHEDULER": "sched.internal:443",
        "LORAFLEET_SCHEDULER_TLS": "1",
        "LORAFLEET_SCHEDULER_CA": "/etc/ca.pem",
        "SALAD_MACHINE_ID": "salad-machine-1",
        "LORAFLEET_MACHINE_ID": "ignored",
        "SALAD_CONTAINER_GROUP_INSTANCE_ID": "cg-instance-9",
        "LORAFLEET_ALLOW_CPU": "1",
        "LORAFLEET_VRAM_MB": "24576",
        "LORAFLEET_DRAIN_GRACE_S": "12.5",
    }
    config = WorkerConfig.from_env(env)
    assert config.worker_token == "t0k" and config.scheduler_address == "sched.internal:443"
    assert config.tls and config.tls_ca_file == Path("/etc/ca.pem")
    assert config.machine_id == "salad-machine-1"
    assert config.provider_instance_id == "cg-instance-9"
    assert config.allow_cpu and config.vram_mb == 24576 and config.drain_grace_s == 12.5

    args = build_parser().parse_args(
        ["--machine-id", "flag-machine", "--drain-grace-s", "3", "--no-tls"]
    )
    flagged = config_from_args(args, env)
    assert flagged.machine_id == "flag-machine" and flagged.drain_grace_s == 3.0
    assert not flagged.tls
    assert flagged.provider_instance_id == "cg-instance-9"  # untouched by flags

    fallback = WorkerConfig.from_env({"LORAFLEET_WORKER_TOKEN": "x", "SALAD_INSTANCE_ID": "vm-7"})
    assert fallback.provider_instance_id == "vm-7" and not fallback.allow_cpu
    assert fallback.machine_id  # the hostname
    assert fallback.scheduler_address == "127.0.0.1:50051"

    # The probe needs no token.
    probe_args = build_parser().parse_args(["--probe-only"])
    assert config_from_args(probe_args, {}).worker_token == "unused-by-the-probe"
    assert config_from_args(probe_args, env).worker_token == "t0k"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "--worker-token / LORAFLEET_WORKER_TOKEN: Field required"),
        ({"SALAD_MACHINE_ID": "has space"}, "--machine-id / SALAD_MACHINE_ID"),
        ({"LORAFLEET_VRAM_MB": "lots"}, "--vram-mb / LORAFLEET_VRAM_MB: Input should be a valid"),
        ({"LORAFLEET_VRAM_MB": "-1"}, "LORAFLEET_VRAM_MB: Input should be greater than or equal"),
        ({"LORAFLEET_DEVICE": "tpu"}, "--device / LORAFLEET_DEVICE"),
        ({"LORAFLEET_ALLOW_CPU": "maybe"}, "--allow-cpu / LORAFLEET_ALLOW_CPU"),
        ({"LORAFLEET_DRAIN_GRACE_S": "0"}, "LORAFLEET_DRAIN_GRACE_S: Input should be greater"),
        ({"LORAFLEET_SCHEDULER": "http://x/y"}, "--scheduler-address / LORAFLEET_SCHEDULER"),
        (
            {"LORAFLEET_RECONNECT_INITIAL_BACKOFF_S": "60"},
            "reconnect_initial_backoff_s must not exceed reconnect_max_backoff_s",
        ),
    ],
)
def test_config_refuses_bad_values_naming_them(env: dict[str, str], message: str) -> None:
    if env:
        env = {"LORAFLEET_WORKER_TOKEN": "x", **env}
    with pytest.raises(ConfigError, match=re.escape(message)):
        WorkerConfig.from_env(env)


def test_help_lists_every_option_with_its_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps (and splits words) to the terminal
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    options = set(WorkerConfig.model_fields) - WorkerConfig.not_flags
    assert options >= {"worker_token", "scheduler_address", "machine_id", "drain_grace_s"}
    for name in options:
        info = WorkerConfig.model_fields[name]
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert info.description and " ".join(info.description.split()) in text, name
        for variable in env_names(name, info):
            assert variable in text, (name, variable)
    for process_flag in ("--probe-only", "--log-level", "--log-format"):
        assert process_flag in text


def test_main_exits_2_on_bad_configuration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each refusal is one line and where to read more, not the 60 lines of usage before it."""
    monkeypatch.delenv("LORAFLEET_WORKER_TOKEN", raising=False)
    assert main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1] == "see `lorafleet worker --help`", err
    assert "--worker-token / LORAFLEET_WORKER_TOKEN: Field required" in err[0]
    monkeypatch.setenv("LORAFLEET_WORKER_TOKEN", "x")
    assert main(["--drain-grace-s", "0"]) == 2
    assert "LORAFLEET_DRAIN_GRACE_S: Input should be greater than 0" in capsys.readouterr().err
    for argv, said in (
        (["--device", "tpu"], "argument --device: invalid choice"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ):
        with pytest.raises(SystemExit) as exited:  # argparse's own refusal, also 2
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"lorafleet worker: error: {err[0].split(': error: ', 1)[1]}",
            "see `lorafleet worker --help`",
        ], err
        assert said in err[0], err


def test_probe_passes_on_cpu_only_when_allowed(tmp_path: Path) -> None:
    base = load(
        WorkerConfig,
        env={},
        worker_token="x",
        min_free_disk_mb=0,
        min_free_memory_mb=0,
        model_cache_dir=str(tmp_path),
    )
    allowed = probe(base.with_changes(allow_cpu=True))
    assert allowed.passed, allowed.detail
    # On a CPU a job's memory is the host's: that is what it announces.
    assert allowed.gpu_model == "cpu" and allowed.tflops > 0
    assert allowed.vram_mb == total_host_memory_mb() > 0
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


async def test_reconnects_back_off_by_the_shared_rule(
    monkeypatch: pytest.MonkeyPatch, cpu_qualification: QualificationResult
) -> None:
    attempts: list[tuple[int, float, float]] = []
    three = asyncio.Event()

    def recording_backoff(
        attempt: int, *, initial_s: float, max_s: float, rng: random.Random | None = None
    ) -> float:
        attempts.append((attempt, initial_s, max_s))
        if len(attempts) == 3:
            three.set()
        return 0.0

    monkeypatch.setattr(agent_module, "backoff_delay", recording_backoff)
    # Nothing listens on port 1: every attempt fails at once.
    config = load(
        WorkerConfig,
        env={},
        worker_token="x",
        scheduler_address="127.0.0.1:1",
        reconnect_initial_backoff_s=0.2,
        reconnect_max_backoff_s=3.0,
    )
    agent = Agent(config, qualification=cpu_qualification)
    async with agent:
        # The agent's own training thread lives as long as it does.
        assert _training_threads(config.machine_id) == 1
        task = asyncio.get_running_loop().create_task(agent.run())
        await asyncio.wait_for(three.wait(), 30)
        assert agent.state is State.CONNECTING
        await agent.shutdown()
        await asyncio.wait_for(task, 30)
        assert _training_threads(config.machine_id) == 0
    assert attempts[:3] == [(0, 0.2, 3.0), (1, 0.2, 3.0), (2, 0.2, 3.0)]


def _training_threads(machine_id: str) -> int:
    name = f"lorafleet-training-{machine_id}"
    return sum(thread.name == name and thread.is_alive() for thread in threading.enumerate())


async def test_training_thread_runs_calls_in_order_in_the_callers_context() -> None:
    training = TrainingThread(name="test-training")
    lease = contextvars.ContextVar[str]("lease")
    lease.set("lease-1")
    seen: list[tuple[str, bool, str]] = []

    def work(n: int) -> int:
        current = threading.current_thread()
        seen.append((current.name, current.daemon, lease.get()))
        if n == 2:
            raise ValueError("boom")
        return n * 10

    futures = [training.submit(work, n) for n in (1, 2, 3)]
    assert await asyncio.wrap_future(futures[0]) == 10
    with pytest.raises(ValueError, match="boom"):
        await asyncio.wrap_future(futures[1])
    assert await asyncio.wrap_future(futures[2]) == 30
    assert seen == [("test-training", True, "lease-1")] * 3
    assert training.alive
    assert await training.shutdown(5.0) is True
    assert not training.alive
    assert await training.shutdown(5.0) is True  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        training.submit(work, 1)


async def test_training_thread_shutdown_waits_no_longer_than_asked() -> None:
    """A call that does not return (a step that outlives the drain grace) does not hold the
    shutdown; the thread stops after the call, and it is a daemon meanwhile."""
    training = TrainingThread(name="test-stuck")
    entered = threading.Event()
    release = threading.Event()

    def step() -> str:
        entered.set()
        release.wait(30)
        return "done"

    running = training.submit(step)
    assert await asyncio.to_thread(entered.wait, 10)
    assert await training.shutdown(0.05) is False
    assert training.alive
    assert [t.daemon for t in threading.enumerate() if t.name == "test-stuck"] == [True]
    release.set()
    assert await asyncio.wrap_future(running) == "done"
    assert await training.shutdown(5.0) is True
    assert not training.alive


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

    async def failed(step: int, error: str) -> None:
        raise AssertionError(f"no upload fails here (step {step}: {error})")

    pipeline = CheckpointPipeline(upload, failed)
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


async def test_checkpoint_pipeline_survives_a_failed_upload_and_reports_it() -> None:
    done = asyncio.Event()
    first = asyncio.Event()
    calls: list[int] = []
    reported: list[tuple[int, str]] = []

    async def failed(step: int, error: str) -> None:
        reported.append((step, error))

    async def upload(snapshot: TrainingSnapshot) -> None:
        calls.append(snapshot.step)
        if snapshot.step == 1:
            first.set()
            raise StorageError("PUT http://store/x: HTTP 503", retryable=True)
        done.set()

    pipeline = CheckpointPipeline(upload, failed)
    pipeline.offer(_snapshot(1))
    await asyncio.wait_for(first.wait(), 5)
    pipeline.offer(_snapshot(2))
    await asyncio.wait_for(done.wait(), 5)
    await pipeline.close()
    assert calls == [1, 2]
    assert reported == [(1, "PUT http://store/x: HTTP 503")] and pipeline.failures == 1


def test_every_state_can_stop_and_illegal_transitions_raise() -> None:
    for state in State:
        if state is not State.STOPPED:
            assert State.STOPPED in TRANSITIONS[state], state
    assert TRANSITIONS[State.STOPPED] == frozenset()
    # Leased work only ever comes from IDLE (a grant) or CONNECTING (a resumed lease).
    assert {s for s in State if State.LEASED in TRANSITIONS[s]} == {State.IDLE, State.CONNECTING}
    agent = Agent(load(WorkerConfig, env={}, worker_token="x"))
    with pytest.raises(RuntimeError, match="qualifying -> leased"):
        agent._set_state(State.LEASED)


def test_failure_messages_keep_the_trainers_words() -> None:
    assert failure_message(TrainingFailure(FailureClass.INPUT, "2 of 3 images are too small")) == (
        "2 of 3 images are too small"
    )
    assert failure_message(RuntimeError("boom")) == "RuntimeError: boom"
    assert len(failure_message(ValueError("x" * 10_000))) == 4000


def test_a_worker_that_cannot_load_its_model_fails_its_probe(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Not its jobs: a broken model path used to fail three attempts of a job in 150 ms."""
    base = load(
        WorkerConfig,
        env={},
        worker_token="x",
        allow_cpu=True,
        min_free_disk_mb=0,
        min_free_memory_mb=0,
        model_cache_dir=str(tmp_path),
    )
    assert probe(base.with_changes(model_path=str(tiny_model))).passed
    missing = probe(base.with_changes(model_path=str(tmp_path / "nowhere")))
    assert not missing.passed and "model_path:" in missing.detail
    assert "is not a directory" in missing.detail
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model, pickled)
    for weights in (pickled / "unet").glob("*.safetensors"):
        weights.unlink()
    broken = probe(base.with_changes(model_path=str(pickled)))
    assert not broken.passed and "unet holds no safetensors weights" in broken.detail


def test_bake_and_artifacts_refusals_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    """The bake needs a model and a readable spec list; a named artifacts file must exist.
    (The bake itself, and the load's cache hits: tests/worker/test_compile_cache.py.)"""
    out = str(tmp_path / "artifacts.bin")
    spec = tmp_path / "jobs.json"
    for argv, said in (
        (["--bake-compile-artifacts", out], "needs --model-path"),
        (
            ["--bake-compile-artifacts", out, "--model-path", str(tmp_path)],
            f"--model-path {tmp_path}",
        ),
        (
            [
                "--bake-compile-artifacts",
                out,
                "--model-path",
                str(tiny_model_dir),
                "--bake-spec",
                str(spec),
            ],
            f"--bake-spec {spec}",
        ),
    ):
        assert main([*argv, "--allow-cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    spec.write_text('[{"resolution": "big"}]')
    assert (
        main(
            [
                "--bake-compile-artifacts",
                out,
                "--model-path",
                str(tiny_model_dir),
                "--bake-spec",
                str(spec),
                "--allow-cpu",
            ]
        )
        == 2
    )
    said = capsys.readouterr().err
    assert "resolution" in said and "[0]" in said, said
    missing = tmp_path / "none.bin"
    assert (
        main(["--worker-token", "x", "--compile-artifacts-path", str(missing), "--allow-cpu"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compile_artifacts_path" in err[0] and str(missing) in err[0], err
    assert not (tmp_path / "artifacts.bin").exists()
