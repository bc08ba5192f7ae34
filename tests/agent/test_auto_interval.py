"""`checkpointing_steps: auto` on the worker: once a lease has measured its own pace, its interval
in steps is derived again from the grant's interval in seconds (a CPU node against a GPU prior
checkpointed once per job before)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from lorafleet.core.serde import spec_to_proto
from lorafleet.core.settings import load
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker.auto_interval import WARMUP_STEPS, AutoInterval
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease_runner import LeaseResult, LeaseRunner
from lorafleet.worker.training import (
    Finished,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
)
from lorafleet.worker.training_thread import TrainingThread
from tests.agent.test_class_image_runner import JOB_ID, Link, Transfer
from tests.support.jobs import WAIT_S


def test_the_interval_follows_the_measured_pace_within_its_bounds() -> None:
    # The grant: 30 s between checkpoints, 2000 steps at the 0.015 s/step it assumed.
    auto = AutoInterval(steps=2000, interval_s=30.0, min_steps=10, max_steps=5000, start_step=0)
    assert auto.observe(1, 0.09) is None  # the first steps are not the pace yet
    assert auto.observe(WARMUP_STEPS, 0.09) == 333  # 30 s at this node's 0.09 s/step
    assert auto.current() == 333
    assert auto.observe(10, 0.1) is None  # within the drift: no flapping
    assert auto.observe(20, 3.0) == 10  # never below the floor
    assert auto.observe(30, 0.0001) == 5000  # never beyond the job
    assert auto.observe(40, math.nan) is None


def test_a_fixed_interval_is_kept() -> None:
    fixed = AutoInterval(steps=100, interval_s=0.0, min_steps=10, max_steps=500, start_step=0)
    assert not fixed.follows_pace
    assert fixed.observe(50, 10.0) is None and fixed.current() == 100


@pytest.mark.parametrize("resumed_at", [0, 400])
def test_warmup_counts_from_where_the_run_started(resumed_at: int) -> None:
    auto = AutoInterval(
        steps=2000, interval_s=30.0, min_steps=10, max_steps=5000, start_step=resumed_at
    )
    assert auto.observe(resumed_at + 1, 0.09) is None
    assert auto.observe(resumed_at + WARMUP_STEPS, 0.09) == 333


@dataclass
class SlowNode:
    """Trains at 0.09 s/step (as reported), then waits for the test."""

    release: threading.Event = field(default_factory=threading.Event)
    reported: threading.Event = field(default_factory=threading.Event)

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        assert hooks is not None and hooks.on_progress is not None
        for step in range(1, 6):
            hooks.on_progress(step, 0.5, 1e-4, 0.09)
        self.reported.set()
        assert self.release.wait(WAIT_S)
        return Finished(step=5, loss=0.5, lora_weights=b"lora")


async def test_a_lease_on_a_slow_node_checkpoints_at_its_own_pace() -> None:
    spec = JobSpec(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="dog",
        max_train_steps=5000,
        checkpointing_steps=2000,  # what the scheduler chose at the grant
    )
    grant = fpb.LeaseGranted(
        lease=fpb.Lease(lease_id="lease-1", job_id=JOB_ID, epoch=1, machine_id="m1"),
        spec=spec_to_proto(spec),
        urls=fpb.JobUrls(instance_files=[fpb.FileUrl(name="0.png", key="k", url="get://0")]),
        checkpoint_interval_s=30.0,
        checkpoint_min_steps=10,
    )
    config = load(
        WorkerConfig,
        env={},
        worker_token="t",
        scheduler_address="127.0.0.1:1",
        machine_id="m1",
        allow_cpu=True,
        device="cpu",
    )
    trainer = SlowNode()
    link = Link()
    training = TrainingThread()
    training.start()

    def factory(_: TrainingConfig) -> SlowNode:
        return trainer

    runner = LeaseRunner(
        grant=grant,
        link=link,
        transfer=Transfer({"get://0": b"image", "put://result": b""}),  # type: ignore[arg-type]
        training=training,
        config=config,
        trainer_factory=factory,
    )
    link.runner = runner
    try:
        run = asyncio.ensure_future(runner.run())
        assert await asyncio.to_thread(trainer.reported.wait, WAIT_S)
        # 30 s at this node's own 0.09 s/step, not the 2000 steps the grant assumed.
        assert runner.checkpoint_every == 333
        trainer.release.set()
        assert await asyncio.wait_for(run, WAIT_S) is LeaseResult.SUCCEEDED
    finally:
        trainer.release.set()
        await training.shutdown(WAIT_S)
    said = [
        m.notice.message for m in link.of("notice") if "checkpointing every" in m.notice.message
    ]
    assert said and "every 333 steps" in said[0] and "0.09 s/step" in said[0], said
