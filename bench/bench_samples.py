"""Validation images the old way (inside the training run) against sample tasks on the fleet.

    .venv/bin/python bench/bench_samples.py --steps 24 --every 4

The same job (the tiny SDXL-architecture model, 64 px, checkpoints and validation every K steps,
two prompts, two images each) runs through a real scheduler, Postgres and storage with real
worker processes (`python -m lorafleet.worker`, `OMP_NUM_THREADS=1`), three ways:

* `in-run` (the old way, kept only here): one worker whose trainer stops at every checkpoint,
  makes the validation images on the training thread from that checkpoint (exactly the images a
  sample task makes), and goes on; the result's images likewise before the result is stored.
  The job's spec asks for no validation images, so no sample task is queued.
* `fleet, 1 worker`: the job asks for validation images; they are sample tasks, made by the same
  worker once it has nothing to train (after the result).
* `fleet, 2 workers`: the same with a second worker, which makes each checkpoint's images while
  the first trains.

Reported per way: wall time from submit to the result (SUCCEEDED), wall time until the last
validation image is stored, and worker-seconds: the sum of the job's lease durations plus every
sample task's busy seconds (what a provider bills, idle workers aside).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from local_fleet import (  # type: ignore[import-not-found]
    DEFAULT_DATABASE_URL,
    PREFIX,
    TOKEN,
    owner_with_images,
    scratch_database,
    start_workers,
    stop_workers,
    worker_env,
)

from lorafleet.core.model import SampleSettings
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler
from lorafleet.worker.tiny_model import build_tiny_model
from lorafleet.worker.training import (
    Finished,
    Trainer,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
    serialize_checkpoint,
)
from lorafleet.worker.training.samples import SamplePipelines

PROMPTS = ("a photo of sks dog", "sks dog on a beach")


def settings_of(spec: Any) -> SampleSettings:
    return SampleSettings(
        prompts=PROMPTS,
        negative_prompt="blurry",
        guidance_scale=5.0,
        inference_steps=int(os.environ["BENCH_INFERENCE_STEPS"]),
        seed=spec.seed,
        resolution=spec.resolution,
        images_per_prompt=int(os.environ["BENCH_IMAGES"]),
    )


class InRunTrainer:
    """The old in-run path: the training thread stops at every validation step and samples."""

    def __init__(self, config: TrainingConfig) -> None:
        self._config = config
        self._trainer = Trainer(config)
        self._pipelines = SamplePipelines()
        self._every = int(os.environ["BENCH_EVERY"])

    def _sample(self, weights: bytes, is_checkpoint: bool) -> None:
        self._pipelines.make(
            self._config,
            settings=settings_of(self._config.spec),
            weights=weights,
            weights_is_checkpoint=is_checkpoint,
        )

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        hooks = hooks or TrainingHooks()
        forward = hooks.on_checkpoint

        def on_checkpoint(snapshot: TrainingSnapshot) -> None:
            if forward is not None:
                forward(snapshot)
            if snapshot.step % self._every == 0:
                self._sample(bytes(serialize_checkpoint(snapshot)), True)  # blocks training

        outcome = self._trainer.run(
            instance_images=instance_images,
            class_images=class_images,
            resume=resume,
            hooks=TrainingHooks(
                on_progress=hooks.on_progress,
                should_stop=hooks.should_stop,
                on_checkpoint=on_checkpoint,
                on_class_images=hooks.on_class_images,
            ),
        )
        if isinstance(outcome, Finished):
            self._sample(outcome.lora_weights, False)
        return outcome


IN_RUN_WORKER = """
import functools, sys
sys.path.insert(0, {bench_dir!r})
from bench_samples import InRunTrainer
from lorafleet.worker import main as worker_main
from lorafleet.worker.agent import Agent
worker_main.Agent = functools.partial(Agent, trainer_factory=InRunTrainer)
sys.exit(worker_main.main([]))
"""


async def run_way(
    way: str, workers: int, args: argparse.Namespace, model: Path, root: Path
) -> dict[str, Any]:
    processes: list[asyncio.subprocess.Process] = []
    async with scratch_database(args.database_url, "bench_samples") as url:
        config = SchedulerConfig(
            listen="127.0.0.1:0",
            database_url=url,
            data_dir=root / f"scheduler-{way}-{workers}",
            worker_token=TOKEN,
            lease_ttl_s=30.0,
            heartbeat_interval_s=1.0,
            sweep_interval_s=0.5,
            dispatch_interval_s=1.0,
            checkpoint_retention=100,
        )
        try:
            async with Scheduler(config) as scheduler:
                metadata = await owner_with_images(scheduler)
                env = worker_env(
                    scheduler,
                    model,
                    BENCH_EVERY=str(args.every),
                    BENCH_IMAGES=str(args.images),
                    BENCH_INFERENCE_STEPS=str(args.inference_steps),
                )
                script = IN_RUN_WORKER.format(bench_dir=str(Path(__file__).parent))
                argv = ("-c", script) if way == "in-run" else ("-m", "lorafleet.worker")
                machines = [f"bench-{n}" for n in range(workers)]
                processes = await start_workers(env, machines, argv=argv)
                return await run_job(scheduler, metadata, way, workers, args)
        finally:
            await stop_workers(processes)


async def run_job(
    scheduler: Scheduler,
    metadata: tuple[tuple[str, str], ...],
    way: str,
    workers: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    spec = pb.JobSpec(
        instance_prompt="a photo of sks dog",
        instance_data_prefix=PREFIX,
        max_train_steps=args.steps,
        checkpointing_steps=args.every,
        resolution=64,
        seed=7,
        learning_rate=1e-2,
    )
    if way != "in-run":
        spec.validation_prompt = PROMPTS[0]
        spec.validation_prompts.extend(PROMPTS[1:])
        spec.validation_negative_prompt = "blurry"
        spec.validation_steps = args.every
        spec.validation_inference_steps = args.inference_steps
        spec.num_validation_images = args.images
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        stub = pbgrpc.JobServiceStub(channel)
        started = time.monotonic()
        job = (await stub.SubmitJob(pb.SubmitJobRequest(spec=spec), metadata=metadata)).job
        to_result = to_samples = None
        call = stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), metadata=metadata)
        async for update in call:
            if to_result is None and update.job.state == pb.JOB_STATE_SUCCEEDED:
                to_result = time.monotonic() - started
        to_samples = time.monotonic() - started  # WatchJob ends when samples are done
    leases = await scheduler.ledger.job_leases(job.job_id)
    lease_s = sum(
        ((lease.ended_at or lease.granted_at) - lease.granted_at).total_seconds()
        for lease in leases
    )
    tasks = await scheduler.ledger.sample_tasks_of_job(job.job_id)
    sample_s = sum(t.busy_seconds for t in tasks)
    return {
        "way": way,
        "workers": workers,
        "to_result_s": round(to_result or 0.0, 1),
        "to_last_image_s": round(to_samples, 1),
        "training_lease_s": round(lease_s, 1),
        "sample_task_s": round(sample_s, 1),
        "worker_s": round(lease_s + sample_s, 1),
        "sample_tasks": len(tasks),
        "images": sum(len(t.images) for t in tasks),
    }


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="checkpoint and validation interval")
    parser.add_argument("--images", type=int, default=2, help="images per prompt")
    parser.add_argument("--inference-steps", type=int, default=8)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        results = []
        for way, workers in (("in-run", 1), ("fleet", 1), ("fleet", 2)):
            result = await run_way(way, workers, args, model, root)
            print(json.dumps(result), flush=True)
            results.append(result)
    print()
    print("| way | workers | to result s | to last image s | worker-s (leases + sample tasks) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['way']} | {r['workers']} | {r['to_result_s']} | {r['to_last_image_s']} |"
            f" {r['worker_s']} ({r['training_lease_s']} + {r['sample_task_s']}) |"
        )


if __name__ == "__main__":
    asyncio.run(main())
