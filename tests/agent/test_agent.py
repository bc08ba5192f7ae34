"""The agent in-process against a real scheduler: the lease lifecycle and its interruptions.

The scheduler, its Postgres ledger and its object store are real; so is the trainer (the tiny
model on the CPU). Where a test must observe or hold the training thread, it wraps the real
`Trainer` (never replaces the scheduler). Every wait is on a pushed signal (WatchJob events, the
agent's state) and bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest
import safetensors.torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lorafleet.core.identity import local_identity_token
from lorafleet.core.model import RESULT_FILE_NAMES, class_image_key, upload_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.sessions import SessionState
from lorafleet.worker.agent import Agent, AgentError, State
from lorafleet.worker.lease_runner import LeaseResult, LeaseRunner
from lorafleet.worker.qualify import QualificationResult
from lorafleet.worker.training import (
    Finished,
    Stopped,
    Trainer,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
    images_from_files,
)
from tests.support.fleet import NUM_IMAGES, Fleet, running
from tests.support.images import png
from tests.support.jobs import OWNER, kinds
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S
from tests.support.workers import connect_worker, http_put

# Real workers training the tiny model (in this process or as processes): slow, not in
# the fast lane (README, Development).
pytestmark = pytest.mark.slow

KIND = pb.JobEventKind


@dataclass
class ObservedTrainer:
    """The real Trainer with its hooks observed; optionally holds the thread after `hold_at`."""

    trainer: Trainer
    hold_at: int | None = None
    steps: list[int] = field(default_factory=list)
    stop_answers: list[str] = field(default_factory=list)
    class_inputs: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    outcome: TrainingOutcome | None = None
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        assert hooks is not None and hooks.on_progress and hooks.should_stop
        on_progress, should_stop = hooks.on_progress, hooks.should_stop

        def progress(step: int, loss: float, lr: float, sps: float) -> None:
            self.steps.append(step)
            on_progress(step, loss, lr, sps)
            if step == self.hold_at:
                self.reached.set()
                assert self.release.wait(WAIT_S), "the test never released the training thread"

        def stop() -> Any:
            answer = should_stop()
            if answer is not None:
                self.stop_answers.append(answer)
            return answer

        on_class_images = hooks.on_class_images
        assert on_class_images is not None

        def generated(batch: list[tuple[int, bytes]]) -> None:
            self.generated.extend(index for index, _ in batch)
            on_class_images(batch)

        self.class_inputs = [image.name for image in class_images]
        observed = TrainingHooks(
            on_progress=progress,
            should_stop=stop,
            on_checkpoint=hooks.on_checkpoint,
            on_class_images=generated,
        )
        try:
            self.outcome = self.trainer.run(
                instance_images=instance_images,
                class_images=class_images,
                resume=resume,
                hooks=observed,
            )
            return self.outcome
        finally:
            self.done.set()


@dataclass
class Observer:
    """A trainer factory recording every run it makes."""

    hold_at: int | None = None
    runs: list[ObservedTrainer] = field(default_factory=list)
    _made: threading.Condition = field(default_factory=threading.Condition)

    def __call__(self, config: TrainingConfig) -> ObservedTrainer:
        run = ObservedTrainer(Trainer(config), hold_at=self.hold_at)
        with self._made:
            self.runs.append(run)
            self._made.notify_all()
        return run

    async def run(self, index: int) -> ObservedTrainer:
        """The `index`-th run, once the agent has made it."""

        def wait() -> bool:
            with self._made:
                return self._made.wait_for(lambda: len(self.runs) > index, WAIT_S)

        assert await asyncio.to_thread(wait), f"no training run #{index}"
        return self.runs[index]


def _lease_runner(agent: Agent) -> LeaseRunner:
    """The agent's last lease, a training one."""
    runner = agent.recent_leases[-1]
    assert isinstance(runner, LeaseRunner)
    return runner


async def reference_lora(fleet: Fleet, spec: Any) -> bytes:
    """The uninterrupted run of `spec` on the test images, in this process (sampling settings
    as the test workers have them), in a thread of its own: a thread of asyncio's pool keeps
    the intra-op thread count torch had when it first ran a parallel op there (an earlier test
    module's, not this module's one thread), and another count sums in another order: the
    reference came out different bits under some test orders."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as fresh:
        return await asyncio.get_running_loop().run_in_executor(fresh, _reference_lora, fleet, spec)


def _reference_lora(fleet: Fleet, spec: Any) -> bytes:
    files = {f"{i}.png": png(i) for i in range(NUM_IMAGES)}
    worker = fleet.worker_config("reference")
    config = TrainingConfig(
        spec=spec,
        model_path=str(fleet.tiny_model),
        local_files_only=True,
        device="cpu",
        sample_steps=worker.sample_steps,
        sample_batch_size=worker.sample_batch_size,
    )
    outcome = Trainer(config).run(instance_images=images_from_files(files))
    assert isinstance(outcome, Finished)
    return outcome.lora_weights


async def test_connect_qualify_lease_succeed_ready_again(fleet: Fleet) -> None:
    states: list[State] = []
    agent = Agent(fleet.worker_config("m1"), on_state_change=states.append)
    async with running(agent):
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)
        assert agent.qualification is not None and agent.qualification.passed
        job = await fleet.client.submit(max_train_steps=4, checkpointing_steps=2)
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)

        # The result object exists and its digest is the ledger's.
        data = await fleet.scheduler.storage.get_bytes(done.result.key)
        assert hashlib.sha256(data).hexdigest() == done.result.sha256
        assert len(data) == done.result.size_bytes
        assert done.result.key.endswith("/result/e1/pytorch_lora_weights.safetensors")
        assert any(key.startswith("unet.") for key in safetensors.torch.load(data))

        events = await fleet.client.events(job.job_id)
        timeline = kinds(events)
        assert timeline[:2] == ["SUBMITTED", "LEASE_GRANTED"]
        assert "SUCCEEDED" in timeline
        commits = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED]
        assert [(c.step, c.epoch) for c in commits] == [(2, 1)]
        beats = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_HEARTBEAT]
        assert beats and all(b.machine_id == "m1" and b.epoch == 1 for b in beats)
        assert done.progress.step == 4

        # Ready again: the next job is pushed to the same worker.
        second = await fleet.client.submit(max_train_steps=1000, checkpointing_steps=1000)
        granted = await fleet.client.wait_event(second.job_id, KIND.JOB_EVENT_KIND_LEASE_GRANTED)
        assert granted.machine_id == "m1"
        await fleet.client.cancel(second.job_id)
        await fleet.client.wait_state(second.job_id, pb.JOB_STATE_CANCELED)
        async with asyncio.timeout(WAIT_S):
            await agent.wait_until(lambda a: a.state is State.IDLE and not a.busy)
    assert states[:4] == [State.CONNECTING, State.IDLE, State.LEASED, State.IDLE]
    assert states[-1] is State.STOPPED

    # The probe's measurements reached the ledger.
    conn = await asyncpg.connect(fleet.scheduler.database_url)
    try:
        row = await conn.fetchrow(
            "SELECT qualified, gpu_model, qualification FROM machines WHERE machine_id = 'm1'"
        )
    finally:
        await conn.close()
    assert row is not None and row["qualified"] is True and row["gpu_model"] == "cpu"
    assert '"torch"' in row["qualification"]


async def test_cancel_stops_training_within_one_step(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    observer = Observer(hold_at=2)
    agent = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(agent):
        job = await fleet.client.submit(max_train_steps=1000, checkpointing_steps=1000)
        run = await observer.run(0)
        assert await asyncio.to_thread(run.reached.wait, WAIT_S)
        # The training thread is inside step 2's progress hook: cancel now.
        await fleet.client.cancel(job.job_id)
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)  # the revocation arrived
        run.release.set()
        assert await asyncio.to_thread(run.done.wait, WAIT_S)
        # Not one more step after the worker learned of the cancel.
        assert run.steps[-1] == 2
        assert isinstance(run.outcome, Stopped) and run.outcome.reason == "cancel"
        assert run.stop_answers == ["cancel"]
        # Ready followed: the next job goes to this worker.
        observer.hold_at = None
        second = await fleet.client.submit(max_train_steps=2, checkpointing_steps=1000)
        finished = await fleet.client.wait_state(second.job_id, pb.JOB_STATE_SUCCEEDED)
        assert finished.result.sha256
    job_now = await fleet.client.get(job.job_id)
    assert job_now.state == pb.JOB_STATE_CANCELED
    events = await fleet.client.events(job.job_id)
    assert "CHECKPOINT_COMMITTED" not in kinds(events)


# Heartbeats far apart: none is sent while the test runs, so the only report of the step the
# worker reached is its answer to the cancel.
@pytest.mark.parametrize(
    "scheduler_overrides", [{"heartbeat_interval_s": 20.0, "lease_ttl_s": 60.0}]
)
async def test_a_canceled_job_shows_the_step_its_worker_reached(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    """Issue 32: a canceled job showed its last heartbeat's step (1346) though its worker had
    reached 1395. The worker answers the revocation with the step it reached."""
    observer = Observer(hold_at=3)
    agent = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(agent):
        job = await fleet.client.submit(max_train_steps=1000, checkpointing_steps=1000)
        run = await observer.run(0)
        assert await asyncio.to_thread(run.reached.wait, WAIT_S)
        await fleet.client.cancel(job.job_id)
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)  # the revocation arrived
        run.release.set()
        assert await asyncio.to_thread(run.done.wait, WAIT_S)
        # Ready follows the final report on the same stream: once the next job is granted to
        # this worker, the scheduler has handled the report.
        observer.hold_at = None
        second = await fleet.client.submit(max_train_steps=1, checkpointing_steps=1000)
        await fleet.client.wait_state(second.job_id, pb.JOB_STATE_SUCCEEDED)
    canceled = await fleet.client.get(job.job_id)
    assert canceled.state == pb.JOB_STATE_CANCELED
    assert canceled.progress.step == 3 and canceled.progress.machine_id == "m1"
    assert run.steps[-1] == 3


async def test_superseded_lease_stops_then_the_regrant_resumes(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    observer = Observer(hold_at=3)
    agent = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(agent):
        job = await fleet.client.submit(max_train_steps=6, checkpointing_steps=2)
        commit = await fleet.client.wait_event(
            job.job_id, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, lambda e: e.step == 2
        )
        first = await observer.run(0)
        observer.hold_at = None  # the re-grant's run goes through
        assert await asyncio.to_thread(first.reached.wait, WAIT_S)
        # The lease ends behind this worker's back (as when another replica re-queues it).
        drained = await fleet.scheduler.ledger.drain_lease(commit.lease_id, 1, "test: superseded")
        assert drained is not None
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)  # LeaseRevoked (or Rejected) arrived
        first.release.set()
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    assert first.steps[-1] == 3 and isinstance(first.outcome, Stopped)
    second = observer.runs[1]
    # The re-grant resumed from the committed checkpoint, not from scratch.
    assert second.steps[0] == 3 and second.steps[-1] == 6
    assert done.epoch == 2 and done.result.key.endswith(
        "/result/e2/pytorch_lora_weights.safetensors"
    )
    events = await fleet.client.events(job.job_id)
    drained_at = next(e.event_id for e in events if e.kind == KIND.JOB_EVENT_KIND_DRAINED)
    late = [
        e
        for e in events
        if e.event_id > drained_at
        and e.lease_id == commit.lease_id
        and e.kind in (KIND.JOB_EVENT_KIND_HEARTBEAT, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED)
    ]
    assert late == [], f"epoch-1 messages after the lease ended: {kinds(late)}"
    spec = (await fleet.scheduler.ledger.get_job_any_owner(job.job_id)).spec  # type: ignore[union-attr]
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    reference = await reference_lora(fleet, spec)
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(reference).hexdigest()


async def test_rejected_lease_stops_work_at_once(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    observer = Observer()
    agent = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(agent):
        job = await fleet.client.submit(max_train_steps=100_000, checkpointing_steps=100_000)
        await fleet.client.wait_event(
            job.job_id, KIND.JOB_EVENT_KIND_HEARTBEAT, lambda e: e.step >= 1
        )
        conn = await asyncpg.connect(fleet.scheduler.database_url)
        try:
            # Another replica re-granted the job and its NOTIFY was lost: the only way this
            # worker learns is that its next message is refused (Rejected).
            await conn.execute("ALTER TABLE jobs DISABLE TRIGGER jobs_notify")
            await conn.execute(
                "UPDATE jobs SET lease_id = gen_random_uuid(), epoch = epoch + 1,"
                " machine_id = 'elsewhere' WHERE job_id = $1",
                job.job_id,
            )
        finally:
            await conn.close()
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)
        run = observer.runs[0]
        assert await asyncio.to_thread(run.done.wait, WAIT_S)
        assert isinstance(run.outcome, Stopped) and run.outcome.reason == "cancel"
    current = await fleet.client.get(job.job_id)
    assert current.state == pb.JOB_STATE_RUNNING and current.machine_id == "elsewhere"
    assert "SUCCEEDED" not in kinds(await fleet.client.events(job.job_id))


async def test_stream_cut_reconnects_and_keeps_the_lease(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    from tests.support.proxy import TcpProxy

    proxy = TcpProxy(target_port=fleet.scheduler.port)
    await proxy.start()
    states: list[State] = []
    observer = Observer(hold_at=3)
    config = fleet.worker_config("m1", scheduler_address=f"127.0.0.1:{proxy.port}")
    agent = Agent(
        config,
        trainer_factory=observer,
        qualification=cpu_qualification,
        on_state_change=states.append,
    )
    try:
        async with running(agent):
            job = await fleet.client.submit(max_train_steps=6, checkpointing_steps=2)
            run = await observer.run(0)
            assert await asyncio.to_thread(run.reached.wait, WAIT_S)
            proxy.cut()  # the network drops while the lease is training
            async with asyncio.timeout(WAIT_S):
                await agent.wait_for_state(State.CONNECTING)
                await agent.wait_for_state(State.LEASED)
            run.release.set()
            done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    finally:
        await proxy.close()
    assert states[:4] == [State.CONNECTING, State.IDLE, State.LEASED, State.CONNECTING]
    assert states[4] is State.LEASED
    assert len(observer.runs) == 1 and run.steps == [1, 2, 3, 4, 5, 6]
    assert done.epoch == 1
    timeline = kinds(await fleet.client.events(job.job_id))
    assert timeline.count("LEASE_GRANTED") == 1 and "LEASE_RESUMED" in timeline
    assert proxy.connections >= 2


async def test_unusable_images_fail_the_job_as_input_naming_each_file(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    store = fleet.scheduler.storage
    await store.put_bytes(upload_key(OWNER, "mixed", "good.png"), png(1))
    await store.put_bytes(upload_key(OWNER, "mixed", "small.png"), png(2, size=16))
    await store.put_bytes(upload_key(OWNER, "mixed", "notes.png"), b"this is not an image")
    # A machine the operator runs: its input fault fails the job at once (a stranger's must be
    # confirmed by a second machine whose standing predates the job: test_worker_stream.py).
    config = fleet.worker_config(
        "local-0",
        provider_identity="local",
        identity_token=local_identity_token(fleet.scheduler.identity_secret, "local-0"),
    )
    async with running(Agent(config, qualification=cpu_qualification)):
        job = await fleet.client.submit(instance_data_prefix="mixed")
        failed = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_FAILED)
    assert failed.failure_class == pb.FAILURE_CLASS_INPUT and failed.failures == 0
    assert "small.png" in failed.error and "too small" in failed.error
    assert "notes.png" in failed.error and "unreadable" in failed.error
    assert "good.png" not in failed.error


class _NodeFault:
    def __init__(self, config: TrainingConfig) -> None:
        self.config = config

    def run(self, **_kwargs: Any) -> TrainingOutcome:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_node_fault_fails_the_attempt_and_bans_the_machine(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    agent = Agent(
        fleet.worker_config("m1"), trainer_factory=_NodeFault, qualification=cpu_qualification
    )
    async with running(agent):
        job = await fleet.client.submit(max_failures=3)
        event = await fleet.client.wait_event(job.job_id, KIND.JOB_EVENT_KIND_ATTEMPT_FAILED)
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)
    assert event.failure_class == pb.FAILURE_CLASS_NODE
    assert "illegal memory access" in event.message
    current = await fleet.client.get(job.job_id)
    # Re-queued for another machine; this one is banned from it. A node fault is not the
    # job's: it counts apart from max_failures.
    assert current.state == pb.JOB_STATE_QUEUED
    assert (current.failures, current.node_faults) == (0, 1)


async def test_drain_then_resume_skips_a_corrupt_checkpoint(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    observer = Observer(hold_at=5)
    first = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(first) as task:
        job = await fleet.client.submit(max_train_steps=8, checkpointing_steps=2)
        run = await observer.run(0)
        await fleet.client.wait_event(
            job.job_id, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, lambda e: e.step == 4
        )
        assert await asyncio.to_thread(run.reached.wait, WAIT_S)
        first.drain("test drain")  # while step 5 is being reported
        run.release.set()
        async with asyncio.timeout(WAIT_S):
            await task
        assert first.state is State.STOPPED
    events = await fleet.client.events(job.job_id)
    commits = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED]
    assert [c.step for c in commits] == [2, 4, 5]  # 5: the drain's own checkpoint
    drained = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_DRAINED]
    assert len(drained) == 1 and drained[0].event_id > commits[-1].event_id
    assert (await fleet.client.get(job.job_id)).state == pb.JOB_STATE_QUEUED

    # The newest checkpoint is damaged in storage: the next worker says so and uses the older.
    newest = commits[-1].checkpoint
    await fleet.scheduler.storage.put_bytes(newest.key, b"\x00" * newest.size_bytes)
    resumed = Observer()
    second = Agent(
        fleet.worker_config("m2"), trainer_factory=resumed, qualification=cpu_qualification
    )
    async with running(second):
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    assert resumed.runs[0].steps[0] == 5  # continued at 4 + 1
    (notice,) = second.recent_leases[-1].notices
    assert "step 5" in notice and "sha256" in notice
    spec = (await fleet.scheduler.ledger.get_job_any_owner(job.job_id)).spec  # type: ignore[union-attr]
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    reference = await reference_lora(fleet, spec)
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(reference).hexdigest()


async def test_unqualified_worker_stays_connected_without_work(fleet: Fleet) -> None:
    agent = Agent(fleet.worker_config("m1", allow_cpu=False))
    async with running(agent):
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)
        assert agent.qualification is not None and not agent.qualification.passed
        assert "--allow-cpu" in agent.qualification.detail
        session = fleet.scheduler.sessions.by_machine["m1"]
        assert session.state is SessionState.UNQUALIFIED


async def test_shutdown_message_stops_an_idle_worker(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    agent = Agent(fleet.worker_config("m1"), qualification=cpu_qualification)
    async with running(agent) as task:
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)
        assert fleet.scheduler.sessions.stop_worker("m1", "scale down")  # sends Shutdown
        async with asyncio.timeout(WAIT_S):
            await task
    assert agent.state is State.STOPPED


@pytest.mark.parametrize("scheduler_overrides", [{"url_ttl_s": 2}])
async def test_renewed_urls_replace_expired_ones(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    observer = Observer(hold_at=1)
    agent = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(agent):
        job = await fleet.client.submit(max_train_steps=2, checkpointing_steps=1000)
        run = await observer.run(0)
        assert await asyncio.to_thread(run.reached.wait, WAIT_S)
        runner = agent.runner
        assert isinstance(runner, LeaseRunner)
        # The scheduler renews a lease's URLs when a third of their life is left; after two
        # renewals the grant's 2-second result URL has expired.
        async with asyncio.timeout(WAIT_S):
            await agent.wait_until(lambda _a: runner.url_renewals >= 2)
        run.release.set()
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    assert hashlib.sha256(data).hexdigest() == done.result.sha256


async def test_training_spans_join_the_jobs_trace(
    fleet: Fleet, cpu_qualification: QualificationResult, span_exporter: InMemorySpanExporter
) -> None:
    # The exporter is the session's: forget earlier tests' spans so every span below is ours.
    span_exporter.clear()
    agent = Agent(fleet.worker_config("m1"), qualification=cpu_qualification)
    async with running(agent):
        job = await fleet.client.submit(max_train_steps=2, checkpointing_steps=1)
        await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
        async with asyncio.timeout(WAIT_S):
            await agent.wait_until(lambda a: not a.busy)
    spans = span_exporter.get_finished_spans()
    (submit,) = [
        s
        for s in spans
        if s.name == "lorafleet.submit"
        and s.attributes
        and s.attributes.get("lorafleet.job_ids") == (job.job_id,)
    ]
    (lease,) = [
        s
        for s in spans
        if s.name == "worker.lease"
        and s.attributes
        and s.attributes.get("lorafleet.job_id") == job.job_id
    ]
    (grant,) = [
        s
        for s in spans
        if s.name == "scheduler.grant"
        and s.attributes
        and s.attributes.get("lorafleet.job_id") == job.job_id
    ]
    assert submit.context is not None and lease.context is not None and lease.parent is not None
    assert grant.context is not None and grant.parent is not None
    assert lease.context.trace_id == submit.context.trace_id
    # submit -> the scheduler's grant -> the worker's lease
    assert grant.parent.span_id == submit.context.span_id
    assert lease.parent.span_id == grant.context.span_id
    children = {s.name for s in spans if s.parent and s.parent.span_id == lease.context.span_id}
    assert {"worker.download_inputs", "worker.train", "worker.upload_result"} <= children
    checkpoint = [s for s in spans if s.name == "worker.checkpoint"]
    assert checkpoint and all(s.context.trace_id == submit.context.trace_id for s in checkpoint)


# Sampling (class and validation images) converts through numpy, which warns about the CPU torch
# build's __array__; the warning is not ours and must not fail the run under `error`.
@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
async def test_generated_class_images_are_stored_and_reused_on_resume(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    prior = {
        "with_prior_preservation": True,
        "class_prompt": "a photo of a dog",
        "num_class_images": 3,
        "max_train_steps": 6,
        "checkpointing_steps": 2,
    }
    observer = Observer(hold_at=3)
    first = Agent(
        fleet.worker_config("m1"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(first) as task:
        job = await fleet.client.submit(**prior)
        run = await observer.run(0)
        await fleet.client.wait_event(
            job.job_id, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, lambda e: e.step == 2
        )
        assert await asyncio.to_thread(run.reached.wait, WAIT_S)
        first.drain("test drain")
        run.release.set()
        async with asyncio.timeout(WAIT_S):
            await task
    assert run.class_inputs == [] and sorted(run.generated) == [0, 1, 2]
    stored = {
        o.key.rsplit("/", 2)[-2] + "/" + o.key.rsplit("/", 1)[-1]
        for o in await fleet.scheduler.storage.list(f"jobs/{job.job_id}/")
    }
    # Keyed per lease (epoch 1 here), like checkpoints.
    assert {
        "class_images/00000-e1.png",
        "class_images/00001-e1.png",
        "class_images/00002-e1.png",
    } <= stored

    resumed = Observer()
    second = Agent(
        fleet.worker_config("m2"), trainer_factory=resumed, qualification=cpu_qualification
    )
    async with running(second):
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    again = resumed.runs[0]
    # The resumed attempt got the first one's class images back and generated none.
    assert sorted(again.class_inputs) == ["00000.png", "00001.png", "00002.png"]
    assert again.generated == [] and again.steps[0] == 4
    # Each came from the ledger's record with its checksum, and verified.
    assert _lease_runner(second).reused_class_images == [0, 1, 2]
    assert _lease_runner(second).notices == []
    spec = (await fleet.scheduler.ledger.get_job_any_owner(job.job_id)).spec  # type: ignore[union-attr]
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    reference = await reference_lora(fleet, spec)
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(reference).hexdigest()


@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
async def test_a_resuming_worker_trains_only_on_class_images_the_ledger_recorded(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    """A hostile holder leaves bad class images at its slots without announcing them: the next
    (real) worker is not given them and generates its own. A recorded image whose stored bytes
    no longer match the ledger's sha256 is generated again by the holder after that, which
    reuses the others and still trains the LoRA an uninterrupted run trains."""
    prior = {
        "with_prior_preservation": True,
        "class_prompt": "a photo of a dog",
        "num_class_images": 3,
        "max_train_steps": 4,
        "checkpointing_steps": 2,
    }
    job = await fleet.client.submit(**prior)
    async with connect_worker(fleet.channel, fleet.token, "mallory") as mallory:
        first = await mallory.ready_for_lease()
        slots = [fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CLASS_IMAGE, index=i) for i in range(3)]
        await mallory.send(
            urls_requested=fpb.UrlsRequested(lease=mallory.ref(first.lease), slots=slots)
        )
        for upload in (await mallory.expect("urls_renewed")).urls.uploads:
            await http_put(upload.url, png(1000 + upload.slot.index))
        await mallory.send(draining=fpb.Draining(lease=mallory.ref(first.lease), reason="bye"))

    observer = Observer(hold_at=3)
    honest = Agent(
        fleet.worker_config("m2"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(honest) as task:
        run = await observer.run(0)
        await fleet.client.wait_event(
            job.job_id, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, lambda e: e.step == 2
        )
        assert await asyncio.to_thread(run.reached.wait, WAIT_S)
        honest.drain("test drain")
        run.release.set()
        async with asyncio.timeout(WAIT_S):
            await task
    # Given nothing mallory stored: it generated all three itself, at its own keys.
    assert run.class_inputs == [] and sorted(run.generated) == [0, 1, 2]
    assert _lease_runner(honest).reused_class_images == []

    # The store no longer holds what the ledger recorded for image 2.
    await fleet.scheduler.storage.put_bytes(class_image_key(job.job_id, 2, 2), png(99))
    resumed = Observer()
    third = Agent(
        fleet.worker_config("m3"), trainer_factory=resumed, qualification=cpu_qualification
    )
    async with running(third):
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    again = resumed.runs[0]
    assert sorted(again.class_inputs) == ["00000.png", "00001.png"] and again.generated == [2]
    assert _lease_runner(third).reused_class_images == [0, 1]
    (notice,) = _lease_runner(third).notices
    assert "class image 2" in notice and "sha256" in notice
    # Image 2 made again from its seed is the image the checkpoints were trained with: the run
    # resumes from the drain's checkpoint (step 3).
    assert again.steps[0] == 4
    spec = (await fleet.scheduler.ledger.get_job_any_owner(job.job_id)).spec  # type: ignore[union-attr]
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    reference = await reference_lora(fleet, spec)
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(reference).hexdigest()


async def test_a_result_lost_with_the_stream_is_sent_again_after_reconnecting(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    from tests.support.proxy import TcpProxy

    proxy = TcpProxy(target_port=fleet.scheduler.port)
    await proxy.start()
    observer = Observer(hold_at=2)
    config = fleet.worker_config("m1", scheduler_address=f"127.0.0.1:{proxy.port}")
    agent = Agent(config, trainer_factory=observer, qualification=cpu_qualification)
    try:
        async with running(agent):
            job = await fleet.client.submit(max_train_steps=2, checkpointing_steps=1000)
            run = await observer.run(0)
            observer.hold_at = None
            assert await asyncio.to_thread(run.reached.wait, WAIT_S)
            # Once the result's upload starts (its URL came over the stream), nothing the worker
            # writes arrives: JobSucceeded is lost in transit. The upload itself goes to the
            # store directly, not through the proxy.
            upload = agent._transfer.upload

            async def blackholed_after(
                url: str, data: bytes | memoryview, *, md5: str | None = None
            ) -> None:
                if "/result/" in url:
                    proxy.blackhole = True
                await upload(url, data, md5=md5)

            agent._transfer.upload = blackholed_after  # type: ignore[method-assign]
            run.release.set()
            async with asyncio.timeout(WAIT_S):
                await agent.wait_until(
                    lambda a: not a.busy and a.recent_leases[-1].result is LeaseResult.SUCCEEDED
                )
            assert (await fleet.client.get(job.job_id)).state == pb.JOB_STATE_RUNNING
            proxy.blackhole = False
            proxy.cut()
            # Hello names the finished lease; the scheduler still holds it live, so the worker
            # says JobSucceeded again.
            done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    finally:
        await proxy.close()
    timeline = kinds(await fleet.client.events(job.job_id))
    assert "LEASE_RESUMED" in timeline and timeline.count("LEASE_GRANTED") == 1
    data = await fleet.scheduler.storage.get_bytes(done.result.key)
    assert hashlib.sha256(data).hexdigest() == done.result.sha256


async def test_a_refused_token_stops_the_worker_with_an_error(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    agent = Agent(
        fleet.worker_config("m1", worker_token="not-the-token"), qualification=cpu_qualification
    )
    async with agent:
        with pytest.raises(AgentError, match="refused this worker"):
            await asyncio.wait_for(agent.run(), WAIT_S)
    assert agent.state is State.STOPPED


async def test_urls_asked_for_on_a_broken_stream_are_asked_again_on_reconnect(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    """A UrlsRequested lost with its stream is asked again as soon as the lease is resumed, not
    after url_request_timeout_s (meanwhile every checkpoint would be skipped)."""
    from tests.support.proxy import TcpProxy

    proxy = TcpProxy(target_port=fleet.scheduler.port)
    await proxy.start()
    observer = Observer(hold_at=1)
    config = fleet.worker_config(
        "m1", scheduler_address=f"127.0.0.1:{proxy.port}", url_request_timeout_s=300.0
    )
    agent = Agent(config, trainer_factory=observer, qualification=cpu_qualification)
    try:
        async with running(agent):
            job = await fleet.client.submit(max_train_steps=3, checkpointing_steps=1)
            run = await observer.run(0)
            assert await asyncio.to_thread(run.reached.wait, WAIT_S)
            # Step 1 is held. Next, hold at step 2, and lose what the worker writes meanwhile:
            # step 1's UrlsRequested.
            step_1 = run.release
            run.reached, run.release, run.hold_at = threading.Event(), threading.Event(), 2
            proxy.blackhole = True
            step_1.set()
            assert await asyncio.to_thread(run.reached.wait, WAIT_S)
            proxy.blackhole = False
            proxy.cut()
            event = await fleet.client.wait_event(
                job.job_id, pb.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, timeout=WAIT_S
            )
            assert event.step == 1
            run.release.set()
            await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    finally:
        await proxy.close()
    assert "LEASE_RESUMED" in kinds(await fleet.client.events(job.job_id))


@pytest.mark.parametrize("scheduler_overrides", [{"lease_ttl_s": 6.0}])
async def test_reconnect_backoff_stays_well_below_the_announced_lease_ttl(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    config = fleet.worker_config("m1", reconnect_max_backoff_s=30.0)
    agent = Agent(config, qualification=cpu_qualification)
    assert agent.reconnect_max_backoff_s == 30.0  # nothing announced yet
    async with running(agent):
        async with asyncio.timeout(WAIT_S):
            await agent.wait_for_state(State.IDLE)
        # The scheduler's Welcome said 6 s: a silent lease dies then, so reconnects wait <= 2 s.
        assert agent.reconnect_max_backoff_s == pytest.approx(2.0)


async def test_output_format_both_stores_and_records_both_files(fleet: Fleet) -> None:
    """A real worker run with output_format both: the diffusers file at the result key, the
    kohya file at its own key, each stored as the ledger records it."""
    agent = Agent(fleet.worker_config("m1"))
    async with running(agent):
        job = await fleet.client.submit(
            max_train_steps=2, checkpointing_steps=100, output_format=pb.OUTPUT_FORMAT_BOTH
        )
        done = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
    for record, fmt in ((done.result, "diffusers"), (done.result.kohya, "kohya")):
        data = await fleet.scheduler.storage.get_bytes(record.key)
        assert hashlib.sha256(data).hexdigest() == record.sha256
        assert record.key.endswith("/result/e1/" + RESULT_FILE_NAMES[fmt])
        prefix = "unet." if fmt == "diffusers" else "lora_unet_"
        assert all(k.startswith(prefix) for k in safetensors.torch.load(data))


async def test_the_worker_reports_its_checkpoint_cost_for_its_next_automatic_interval(
    fleet: Fleet,
) -> None:
    """A real worker measures its checkpoint (stall plus upload) and says so in its next
    Ready: the automatic interval of its next lease rests on that figure, not the prior."""
    agent = Agent(fleet.worker_config("m1"))
    async with running(agent):
        first = await fleet.client.submit(max_train_steps=4, checkpointing_steps=0)
        await fleet.client.wait_state(first.job_id, pb.JOB_STATE_SUCCEEDED)
        (fresh,) = [
            e.message for e in await fleet.client.events(first.job_id) if "auto" in e.message
        ]
        assert "(prior)" in fresh and "every 4 steps" in fresh  # bounded by max_train_steps
        checkpointed = await fleet.client.submit(max_train_steps=4, checkpointing_steps=2)
        await fleet.client.wait_state(checkpointed.job_id, pb.JOB_STATE_SUCCEEDED)
        runner = agent.recent_leases[-1]
        assert isinstance(runner, LeaseRunner) and runner.checkpoint_cost_s is not None
        after = await fleet.client.submit(max_train_steps=4, checkpointing_steps=0)
        await fleet.client.wait_state(after.job_id, pb.JOB_STATE_SUCCEEDED)
    (measured,) = [
        e.message for e in await fleet.client.events(after.job_id) if "auto" in e.message
    ]
    assert "reported by the worker" in measured
    assert f"checkpoint cost {runner.checkpoint_cost_s:.3g} s" in measured
