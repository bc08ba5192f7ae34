"""Sample tasks with real worker processes, a real scheduler, Postgres and storage,
on the tiny model: validation images appear for every checkpoint while the job trains, are the
same images whichever worker makes them, a worker killed while sampling loses only that task
(re-run elsewhere), and a queued training job never waits for samples."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from lorafleet.cli.samples import samples_command
from lorafleet.cli.timeline import timeline_command
from lorafleet.client import AsyncClient
from lorafleet.core.model import SampleSettings
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.worker.agent import Agent
from lorafleet.worker.qualify import QualificationResult
from lorafleet.worker.training import TrainingConfig
from lorafleet.worker.training.samples import SamplePipelines
from tests.agent.test_agent import Observer
from tests.agent.test_process import Workers
from tests.support.fleet import Fleet, running
from tests.support.jobs import kinds

KIND = pb.JobEventKind
SAMPLING_WARNING = (
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
# Real workers training the tiny model (in this process or as processes): slow, not in
# the fast lane (README, Development).
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(SAMPLING_WARNING)]

VALIDATION: dict[str, Any] = dict(
    validation_prompt="a photo of sks dog",
    validation_prompts=["sks dog in the snow"],
    validation_negative_prompt="blurry",
    validation_inference_steps=2,
    num_validation_images=2,
)
# A worker whose first sample task makes no image until the task is stopped (revoked, or the
# worker drained), as if each image took forever: the test acts while the worker is surely
# inside it, however slow or fast the machine. The tests made it so with 40 denoising steps an
# image, and the worker that made the images afterwards then needed minutes on a loaded machine.
HELD_SAMPLER = """
import sys
from lorafleet.worker import main as worker_main
from lorafleet.worker.training.samples import SamplePipelines

make = SamplePipelines.make
held = []

def make_once_stopped(self, *args, should_stop, **kwargs):
    if not held:
        held.append(True)
        print("inside a sample task", flush=True)
        should_stop.__self__.wait()  # the task's stop event (threading.Event.is_set)
    return make(self, *args, should_stop=should_stop, **kwargs)

SamplePipelines.make = make_once_stopped
sys.exit(worker_main.main([]))
"""


@pytest.fixture
async def workers(fleet: Fleet, tmp_path: Path) -> AsyncIterator[Workers]:
    pool = Workers(fleet=fleet, log_dir=tmp_path)
    try:
        yield pool
    finally:
        await pool.reap()


async def samples_of(fleet: Fleet, job_id: str, step: int, *, after: int = 0) -> pb.JobEvent:
    """Waits for the SAMPLES event of `step` (event-driven, bounded)."""
    return await fleet.client.wait_event(
        job_id,
        KIND.JOB_EVENT_KIND_SAMPLES,
        lambda e: e.step == step and e.event_id > after,
        timeout=120,
    )


def reference_images(fleet: Fleet, spec: pb.JobSpec, weights: bytes, step_task: Any) -> list[bytes]:
    """What any worker must make for this task: the same code in this process."""
    from lorafleet.core.serde import spec_from_proto

    config = TrainingConfig(
        spec=spec_from_proto(spec),
        model_path=str(fleet.tiny_model),
        local_files_only=True,
        device="cpu",
    )
    settings: SampleSettings = step_task.settings
    made = SamplePipelines().make(
        config,
        settings=settings,
        weights=weights,
        weights_is_checkpoint=step_task.weights_is_checkpoint,
    )
    return [png for _, _, png in made]


async def test_samples_appear_for_every_checkpoint_while_the_job_trains(
    fleet: Fleet, workers: Workers, tmp_path: Path, cpu_qualification: QualificationResult
) -> None:
    # The trainer: an agent in this process whose run the test can hold (after step 4, once
    # the checkpoint of step 3 is committed); the sampler: a worker process started once the
    # trainer holds the job, so the job can only be its.
    observer = Observer(hold_at=4)
    trainer = Agent(
        fleet.worker_config("m-train"), trainer_factory=observer, qualification=cpu_qualification
    )
    async with running(trainer):
        job = await fleet.client.submit(
            max_train_steps=12, checkpointing_steps=3, validation_steps=3, **VALIDATION
        )
        run = await observer.run(0)
        await workers.start("m-sample")
        # The job is still training (held at step 4) when step 3's images are stored.
        made = await samples_of(fleet, job.job_id, 3)
        assert made.machine_id == "m-sample"
        assert (await fleet.client.get(job.job_id)).state == pb.JOB_STATE_RUNNING
        run.release.set()
        await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED, timeout=120)
    ledger = fleet.scheduler.ledger
    for step in (3, 6, 9, 12):
        await samples_of(fleet, job.job_id, step)
    events = await fleet.client.events(job.job_id)
    samples = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_SAMPLES]
    # Every checkpoint (3, 6, 9; the trainer stores none at its last step) and the result.
    assert sorted(e.step for e in samples) == [3, 6, 9, 12], kinds(events)
    succeeded = next(e for e in events if e.kind == KIND.JOB_EVENT_KIND_SUCCEEDED)
    assert samples[0].event_id < succeeded.event_id, kinds(events)
    tasks = await ledger.sample_tasks_of_job(job.job_id)
    assert [len(t.images) for t in tasks] == [4, 4, 4, 4]
    # The images of the result's step are what this process makes from the result: the same
    # images whichever worker makes them.
    final = tasks[-1]
    weights = await fleet.scheduler.storage.get_bytes(final.weights_key)
    expected = reference_images(fleet, job.spec, weights, final)
    stored = [
        await fleet.scheduler.storage.get_bytes(i.key)
        for i in sorted(final.images, key=lambda i: (i.prompt_index, i.image_index))
    ]
    assert stored == expected
    # The job lost nothing to its samples: no failure, no re-queue.
    assert not [e for e in events if e.kind == KIND.JOB_EVENT_KIND_ATTEMPT_FAILED]
    # `lorafleet samples JOB --grid FILE`: every image by step, and one readable picture.
    out = tmp_path / "samples"
    grid_path = tmp_path / "grid.png"
    args = argparse.Namespace(
        job_id=job.job_id, output=str(out), grid=str(grid_path), prompt=[], step=[]
    )
    async with AsyncClient(fleet.address, api_key=fleet.client.api_key) as client:
        assert await samples_command(client, args) == 0
        # The timeline page shows them at their steps.
        page = await timeline_command(client, job.job_id, tmp_path / "timeline.html")
    html = await asyncio.to_thread(page.read_text)
    assert html.count('<img class="sample"') == 16 and "<th>step 12</th>" in html
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert written == [
        f"step-{step:06d}/p{p}-i{i}.png"
        for step in (3, 6, 9, 12)
        for p in range(2)
        for i in range(2)
    ]
    with Image.open(grid_path) as grid:
        size = grid.size
    assert size == (220 + 4 * (160 + 6) + 6, 28 + 4 * (160 + 6) + 6)
    if os.environ.get("LORAFLEET_KEEP_GRID"):
        await asyncio.to_thread(shutil.copyfile, grid_path, os.environ["LORAFLEET_KEEP_GRID"])


# The killed worker's task goes back once its lease expires, while the heir starts (itself
# seconds); a shorter lease expired the heir's own under heavy load, its heartbeats late while
# the sample pipeline loaded.
@pytest.mark.parametrize("scheduler_overrides", [{"lease_ttl_s": 10.0}])
async def test_a_worker_killed_during_a_sample_task_loses_only_that_task(
    fleet: Fleet, workers: Workers
) -> None:
    job = await fleet.client.submit(max_train_steps=2, **VALIDATION)
    doomed = await workers.start("m-doomed", script=HELD_SAMPLER, pipe_stdout=True)
    await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED, timeout=120)
    ledger = fleet.scheduler.ledger
    await fleet.client.wait_event(
        job.job_id, KIND.JOB_EVENT_KIND_SAMPLES_STARTED, lambda e: e.machine_id == "m-doomed"
    )
    assert doomed.process.stdout is not None
    line = await asyncio.wait_for(doomed.process.stdout.readline(), 120)
    assert line == b"inside a sample task\n", doomed.tail()
    doomed.process.send_signal(signal.SIGKILL)
    await doomed.process.wait()
    await workers.start("m-heir")
    await samples_of(fleet, job.job_id, 2)
    (task,) = await ledger.sample_tasks_of_job(job.job_id)
    assert task.epoch == 2 and task.machine_id == "m-heir" and task.failures == 0
    assert len(task.images) == 2 * 2  # (validation_prompt + 1 prompt) x 2 images
    current = await fleet.client.get(job.job_id)
    assert current.state == pb.JOB_STATE_SUCCEEDED  # the job never noticed
    events = await fleet.client.events(job.job_id)
    assert [e.step for e in events if e.kind == KIND.JOB_EVENT_KIND_SAMPLES] == [2]


async def test_sample_tasks_never_delay_a_queued_training_job(
    fleet: Fleet, workers: Workers
) -> None:
    first = await fleet.client.submit(max_train_steps=2, **VALIDATION)
    await workers.start("m-only", script=HELD_SAMPLER)
    await fleet.client.wait_state(first.job_id, pb.JOB_STATE_SUCCEEDED, timeout=120)
    ledger = fleet.scheduler.ledger
    await fleet.client.wait_event(first.job_id, KIND.JOB_EVENT_KIND_SAMPLES_STARTED)
    # The only worker is sampling; a training job arrives and is granted at once.
    second = await fleet.client.submit(max_train_steps=2)
    granted = await fleet.client.wait_event(second.job_id, KIND.JOB_EVENT_KIND_LEASE_GRANTED)
    assert granted.machine_id == "m-only"
    (task,) = await ledger.sample_tasks_of_job(first.job_id)
    assert task.state in ("QUEUED", "RUNNING") and task.failures == 0 and not task.images
    # Afterwards the worker, idle again, makes the samples after all.
    await fleet.client.wait_state(second.job_id, pb.JOB_STATE_SUCCEEDED, timeout=120)
    await samples_of(fleet, first.job_id, 2)
    (task,) = await ledger.sample_tasks_of_job(first.job_id)
    assert task.epoch == 2 and task.failures == 0
