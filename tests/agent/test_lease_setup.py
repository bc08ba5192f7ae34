"""A lease before its first training step (model load, class images, precompute, compile), on
the lease runner's side: a scripted link, transfer and trainer, no scheduler, no model.

The trainer here stands for one stuck in a hub download that cannot succeed: it polls
`should_stop` (as the real trainer does between its setup phases and download attempts) and
never trains a step. The runner must say on the job's timeline what it is doing while that
lasts, let a cancel or a drain end it, and fail it as this node's fault once it has shown no
progress for the stall bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from lorafleet.core.serde import spec_to_proto
from lorafleet.core.settings import load
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease_runner import LeaseResult, LeaseRunner
from lorafleet.worker.training import (
    Stopped,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
)
from lorafleet.worker.training_thread import TrainingThread
from tests.agent.test_class_image_runner import JOB_ID, Link, Transfer
from tests.support.jobs import WAIT_S


@dataclass
class StuckInModelLoad:
    """Never gets past loading the model; leaves when `should_stop` says so."""

    entered: threading.Event = field(default_factory=threading.Event)
    stopped_with: list[str] = field(default_factory=list)
    left: threading.Event = field(default_factory=threading.Event)

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        assert hooks is not None and hooks.should_stop is not None
        on_phase = getattr(hooks, "on_phase", None)
        if on_phase is not None:
            on_phase("load_model")
        self.entered.set()
        try:
            # A download retrying: between attempts the trainer asks whether to go on.
            for _ in range(int(WAIT_S * 100)):
                reason = hooks.should_stop()
                if reason is not None:
                    self.stopped_with.append(reason)
                    return Stopped(step=0, reason=reason, snapshot=None)
                threading.Event().wait(0.01)
            raise AssertionError("never told to stop")
        finally:
            self.left.set()


@asynccontextmanager
async def stuck_lease(
    **settings: Any,
) -> AsyncIterator[tuple[LeaseRunner, Link, StuckInModelLoad]]:
    spec = JobSpec(
        instance_prompt="a photo of sks dog", instance_data_prefix="dog", max_train_steps=5
    )
    grant = fpb.LeaseGranted(
        lease=fpb.Lease(lease_id="lease-1", job_id=JOB_ID, epoch=1, machine_id="m1"),
        spec=spec_to_proto(spec),
        urls=fpb.JobUrls(instance_files=[fpb.FileUrl(name="0.png", key="k", url="get://0")]),
    )
    config = load(
        WorkerConfig,
        env={},
        worker_token="t",
        scheduler_address="127.0.0.1:1",
        machine_id="m1",
        allow_cpu=True,
        device="cpu",
        **settings,
    )
    trainer = StuckInModelLoad()
    link = Link()
    training = TrainingThread()
    training.start()

    def factory(_: TrainingConfig) -> StuckInModelLoad:
        return trainer

    runner = LeaseRunner(
        grant=grant,
        link=link,
        transfer=Transfer({"get://0": b"image"}),  # type: ignore[arg-type]
        training=training,
        config=config,
        trainer_factory=factory,
    )
    link.runner = runner
    try:
        yield runner, link, trainer
    finally:
        await training.shutdown(WAIT_S)


async def _notice(link: Link, containing: str) -> str:
    """The first notice sent that contains `containing` (polled on the loop's own turns)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            for message in link.of("notice"):
                if containing in message.notice.message:
                    return message.notice.message
            await asyncio.sleep(0.01)


async def test_a_lease_stuck_before_its_first_step_says_so_and_cancel_frees_it() -> None:
    async with stuck_lease(setup_notice_interval_s=0.2) as (runner, link, trainer):
        run = asyncio.ensure_future(runner.run())
        notice = await _notice(link, "preparing:")
        assert "no training step yet" in notice, notice
        runner.cancel("the job was canceled")
        assert await asyncio.wait_for(run, WAIT_S) is LeaseResult.STOPPED
        assert trainer.left.is_set() and trainer.stopped_with == ["cancel"]
        assert not link.of("job_failed") and not link.of("checkpoint_committed")


async def test_a_drain_during_the_model_load_ends_the_lease_without_a_checkpoint() -> None:
    async with stuck_lease() as (runner, link, trainer):
        run = asyncio.ensure_future(runner.run())
        await asyncio.to_thread(trainer.entered.wait, WAIT_S)
        runner.drain()
        assert await asyncio.wait_for(run, WAIT_S) is LeaseResult.DRAINED
        assert trainer.stopped_with == ["drain"]
        assert not link.of("checkpoint_committed") and not link.of("job_failed")


async def test_a_preparation_without_progress_fails_as_a_node_fault_in_bounded_time() -> None:
    """A hub download that cannot succeed ends as a clear failure: JobFailed (NODE: the job
    goes to another machine) naming the phase and the bound, and the run is told to stop."""
    async with stuck_lease(setup_notice_interval_s=0.2, setup_stall_timeout_s=0.6) as (
        runner,
        link,
        trainer,
    ):
        result = await asyncio.wait_for(runner.run(), WAIT_S)
        assert result is LeaseResult.FAILED
        (failed,) = link.of("job_failed")
        assert failed.job_failed.failure_class == pb.FAILURE_CLASS_NODE
        message = failed.job_failed.message
        assert "no progress for" in message and "setup_stall_timeout_s" in message, message
        assert trainer.left.is_set() and trainer.stopped_with == ["cancel"]
