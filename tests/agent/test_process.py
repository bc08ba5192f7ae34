"""The worker as its own process (`python -m lorafleet.worker`), as a provider runs it: signals,
SIGKILL at random steps, resumes on other machines, and bit-identical results."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.worker.training import (
    Finished,
    Trainer,
    TrainingConfig,
    images_from_files,
    load_checkpoint,
)
from tests.support.fleet import NUM_IMAGES, WORKER_TOKEN, Fleet
from tests.support.images import png
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S
from tests.support.jobs import kinds

# Real workers training the tiny model (in this process or as processes): slow, not in
# the fast lane (README, Development).
pytestmark = pytest.mark.slow

KIND = pb.JobEventKind
# The seed that picks the kill steps; change it to explore other interleavings.
KILL_SEED = 20_251_123


@dataclass
class WorkerProcess:
    machine_id: str
    process: asyncio.subprocess.Process
    log_path: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclass
class Workers:
    """Starts worker processes against the test scheduler and reaps every one at the end."""

    fleet: Fleet
    log_dir: Path
    started: list[WorkerProcess] = field(default_factory=list)

    async def start(
        self,
        machine_id: str,
        *,
        script: str | None = None,
        env_overrides: dict[str, str] | None = None,
        pipe_stdout: bool = False,
    ) -> WorkerProcess:
        """`python -m lorafleet.worker`, or `python -c script`; its output goes to a log file
        (with `pipe_stdout`, only stderr: stdout is `process.stdout`)."""
        env = {
            **os.environ,
            "LORAFLEET_SCHEDULER": self.fleet.address,
            "LORAFLEET_WORKER_TOKEN": WORKER_TOKEN,
            "LORAFLEET_ALLOW_CPU": "1",
            "LORAFLEET_COMPILE_MODEL": "off",  # auto compiles a long job: minutes here
            "SALAD_MACHINE_ID": machine_id,
            "SALAD_CONTAINER_GROUP_INSTANCE_ID": f"instance-{machine_id}",
            "LORAFLEET_MODEL_PATH": str(self.fleet.tiny_model),
            "LORAFLEET_LOCAL_FILES_ONLY": "1",
            "LORAFLEET_DEVICE": "cpu",
            "LORAFLEET_MIN_FREE_DISK_MB": "0",
            "LORAFLEET_MIN_FREE_MEMORY_MB": "0",
            "LORAFLEET_LOG_FORMAT": "json",
            # As the in-process reference runs (conftest.one_intra_op_thread).
            "OMP_NUM_THREADS": "1",
            **(env_overrides or {}),
        }
        log_path = self.log_dir / f"worker-{machine_id}.log"
        command = ["-m", "lorafleet.worker"] if script is None else ["-c", script]
        with log_path.open("wb") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if pipe_stdout else log_file,
                stderr=log_file if pipe_stdout else asyncio.subprocess.STDOUT,
                env=env,
            )
        worker = WorkerProcess(machine_id=machine_id, process=process, log_path=log_path)
        self.started.append(worker)
        return worker

    def by_machine(self, machine_id: str) -> WorkerProcess:
        return next(w for w in self.started if w.machine_id == machine_id)

    async def reap(self) -> None:
        for worker in self.started:
            if worker.process.returncode is None:
                worker.process.kill()
            await worker.process.wait()


@pytest.fixture
async def workers(fleet: Fleet, tmp_path: Path) -> AsyncIterator[Workers]:
    pool = Workers(fleet=fleet, log_dir=tmp_path)
    try:
        yield pool
    finally:
        await pool.reap()


def uninterrupted_lora(fleet: Fleet, spec: object) -> bytes:
    files = {f"{i}.png": png(i) for i in range(NUM_IMAGES)}
    config = TrainingConfig(
        spec=spec,  # type: ignore[arg-type]
        model_path=str(fleet.tiny_model),
        local_files_only=True,
        device="cpu",
    )
    outcome = Trainer(config).run(instance_images=images_from_files(files))
    assert isinstance(outcome, Finished)
    return outcome.lora_weights


async def test_sigterm_drains_with_a_checkpoint_and_exits_zero(
    fleet: Fleet, workers: Workers
) -> None:
    job = await fleet.client.submit(max_train_steps=100_000, checkpointing_steps=100_000)
    worker = await workers.start("m-term")
    await fleet.client.wait_event(job.job_id, KIND.JOB_EVENT_KIND_HEARTBEAT, lambda e: e.step >= 2)
    worker.process.send_signal(signal.SIGTERM)
    code = await asyncio.wait_for(worker.process.wait(), WAIT_S)
    assert code == 0, worker.tail()

    # Back in the queue the moment the process is gone, without waiting for the lease TTL.
    current = await fleet.client.get(job.job_id)
    assert current.state == pb.JOB_STATE_QUEUED, worker.tail()
    events = await fleet.client.events(job.job_id)
    commits = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED]
    drained = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_DRAINED]
    assert len(commits) == 1 and len(drained) == 1, kinds(events)
    step = commits[0].step
    assert step >= 2 and commits[0].epoch == 1 and drained[0].event_id > commits[0].event_id
    beats = [e.step for e in events if e.kind == KIND.JOB_EVENT_KIND_HEARTBEAT]
    # The drain checkpoint is the step the worker was on: never behind its last report (how
    # far ahead depends on how many steps ran between the last heartbeat and the signal).
    assert max(beats) <= step
    assert current.latest_checkpoint.step == step
    blob = await fleet.scheduler.storage.get_bytes(commits[0].checkpoint.key)
    assert hashlib.sha256(blob).hexdigest() == commits[0].checkpoint.sha256
    assert load_checkpoint(blob).step == step


# The real `lorafleet worker` entry point, with a trainer whose step never ends and never looks
# at its stop request (a hung CUDA kernel, a model load that does not return).
STUCK_WORKER = """
import functools, sys, threading
from lorafleet.worker import main as worker_main
from lorafleet.worker.agent import Agent

class StuckTrainer:
    def __init__(self, config):
        pass

    def run(self, **kwargs):
        print("inside a step", flush=True)
        threading.Event().wait()

worker_main.Agent = functools.partial(Agent, trainer_factory=StuckTrainer)
sys.exit(worker_main.main([]))
"""


async def test_a_drain_whose_grace_runs_out_still_exits_promptly(
    fleet: Fleet, workers: Workers
) -> None:
    grace_s = 2.0
    job = await fleet.client.submit(max_train_steps=100, checkpointing_steps=100)
    worker = await workers.start(
        "m-stuck",
        script=STUCK_WORKER,
        env_overrides={"LORAFLEET_DRAIN_GRACE_S": str(grace_s)},
        pipe_stdout=True,
    )
    assert worker.process.stdout is not None
    line = await asyncio.wait_for(worker.process.stdout.readline(), WAIT_S)
    assert line == b"inside a step\n", worker.tail()
    loop = asyncio.get_running_loop()
    signalled = loop.time()
    worker.process.send_signal(signal.SIGTERM)
    code = await asyncio.wait_for(worker.process.wait(), WAIT_S)
    took_s = loop.time() - signalled
    assert code == 0, worker.tail()
    # The grace period, then the interpreter's exit: never the step, which never ends, so
    # exiting at all (within the bounded wait above) is the proof; how long the exit takes
    # after the grace depends on the machine's load, not on the worker.
    assert took_s >= grace_s - 0.5, (took_s, worker.tail())
    assert "leaving without it" in worker.tail(), worker.tail()
    # The lease was handed back on the way out: the job is queued again at once.
    current = await fleet.client.get(job.job_id)
    assert current.state == pb.JOB_STATE_QUEUED, worker.tail()
    assert "DRAINED" in kinds(await fleet.client.events(job.job_id))


@pytest.mark.parametrize("scheduler_overrides", [{"lease_ttl_s": 2.0}])
async def test_killed_twice_and_resumed_elsewhere_is_bit_identical(
    fleet: Fleet, workers: Workers
) -> None:
    """The issue's capstone: SIGKILL the worker twice at random steps after it committed a
    checkpoint; other machines resume; the final LoRA equals an uninterrupted run's, bit for bit.
    """
    rng = random.Random(KILL_SEED)
    job = await fleet.client.submit(max_train_steps=12, checkpointing_steps=2)
    spec = (await fleet.scheduler.ledger.get_job_any_owner(job.job_id)).spec  # type: ignore[union-attr]
    # The uninterrupted reference trains meanwhile, in this process, from the same spec.
    reference = asyncio.ensure_future(asyncio.to_thread(uninterrupted_lora, fleet, spec))

    machines = iter(["m-a", "m-b", "m-c"])
    await workers.start(next(machines))
    holder: str | None = None
    epoch = 0
    kill_at: int | None = None
    kills: list[tuple[str, int, int]] = []  # (machine, epoch, step seen when killed)
    spare_started = False

    async def choreograph() -> pb.Job:
        nonlocal holder, epoch, kill_at, spare_started
        async for current, event in fleet.client.watch(job.job_id):
            if current.state == pb.JOB_STATE_SUCCEEDED:
                return current
            assert current.state in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING), current
            if event is None or event.epoch in {killed for _, killed, _ in kills}:
                continue  # events a killed attempt wrote before it died change nothing
            if event.kind == KIND.JOB_EVENT_KIND_LEASE_GRANTED:
                holder, epoch, kill_at = event.machine_id, event.epoch, None
                if len(kills) < 2 and not spare_started:
                    # The next machine boots while this one trains, and waits idle for work.
                    await workers.start(next(machines))
                    spare_started = True
            elif event.epoch != epoch or len(kills) == 2:
                continue
            elif event.kind == KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED and kill_at is None:
                # Kill at this attempt's first commit or the step after (seeded choice).
                kill_at = event.step + rng.randint(0, 1)
            if (
                kill_at is not None
                and event.kind
                in (KIND.JOB_EVENT_KIND_HEARTBEAT, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED)
                and event.step >= kill_at
            ):
                assert holder is not None
                workers.by_machine(holder).process.kill()
                kills.append((holder, epoch, event.step))
                kill_at, spare_started = None, False
        raise AssertionError("the watch ended before the job succeeded")

    done = await asyncio.wait_for(choreograph(), WAIT_S * 2)
    expected = await asyncio.wait_for(reference, WAIT_S)

    assert [machine for machine, _, _ in kills] == ["m-a", "m-b"], kills
    events = await fleet.client.events(job.job_id)
    grants = [
        (e.machine_id, e.epoch) for e in events if e.kind == KIND.JOB_EVENT_KIND_LEASE_GRANTED
    ]
    assert grants == [("m-a", 1), ("m-b", 2), ("m-c", 3)], kinds(events)
    assert kinds(events).count("LEASE_EXPIRED") == 2
    # Each resumed attempt started from a committed checkpoint of the one before.
    for _machine, killed_epoch, _step in kills:
        assert any(
            e.kind == KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED and e.epoch == killed_epoch
            for e in events
        )
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    assert hashlib.sha256(data).hexdigest() == done.result.sha256
    assert done.result.key.endswith("/result/e3/pytorch_lora_weights.safetensors")
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(expected).hexdigest(), (
        f"kills at {kills}"
    )
    final = workers.by_machine("m-c")
    final.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(final.process.wait(), WAIT_S) == 0, final.tail()
