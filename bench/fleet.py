"""The fleet benchmark: a job's fixed cost on a cold fleet against a warm one.

    .venv/bin/python bench/fleet.py                       # 2 workers, 30 jobs of 300 steps
    .venv/bin/python bench/fleet.py --jobs 6 --steps 50   # the small size

A real scheduler (Postgres, the local object store) and real worker processes
(`python -m lorafleet.worker`, `OMP_NUM_THREADS=1`) train the tiny SDXL-architecture model at
64 px: `--jobs` jobs of `--steps` steps, two job shapes interleaved (LoRA rank 4 and 8; seed per
job), submitted at once, run twice in one invocation on fresh ledgers:

* `cold`: as before the warm fleet: workers started with `--cold-env` (default: compile off,
  base model not kept between leases) and the scheduler with warm dispatch off (bound 0).
* `warm`: workers with `--warm-env` (default: the worker's own defaults) and warm dispatch on.

The worker settings are environment variables, so each mode is one flag; a worker that does not
know a variable ignores it (then both modes run the same worker, and only dispatch differs).

Reported per mode: grant to first step (median, p95: from the ledger's LEASE_GRANTED event to
the end of the lease's first optimizer step as its worker timed it, from the worker's "lease
ended" log line; one clock, since everything runs on this machine), with the median of each
phase of it (the grant's way to the worker, downloads, the trainer's setup phases, the first
step), and the median over the leases whose worker ran a job of the same shape before (a warm
worker re-initialises its adapters in place for those); worker-seconds per job (its
leases' durations), result time per job (submit to SUCCEEDED), jobs per hour (jobs over first
submit to last result); and whether every job's result sha256 equals its cold run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
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

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler
from lorafleet.worker.tiny_model import build_tiny_model

RANKS = (4, 8)  # the two job shapes, alternating in the queue
COLD_ENV = "LORAFLEET_COMPILE_MODEL=off,LORAFLEET_KEEP_BASE_MODEL=0"
WARM_ENV = ""


def parse_env(text: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in text.split(",") if item.strip())
    return {key.strip(): value.strip() for key, _, value in pairs}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def leases_logged(logs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """The workers' "lease ended" log lines that timed a first step, by lease id."""
    out: dict[str, dict[str, Any]] = {}
    for path in logs:
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "lease ended" and "first_step_done_at" in record:
                out[record["lease_id"]] = record
    return out


async def first_steps(
    conn: asyncpg.Connection, logged: dict[str, dict[str, Any]]
) -> tuple[dict[str, float], dict[str, list[float]], set[str]]:
    """Per lease: seconds from its LEASE_GRANTED event to the end of its first step as its
    worker timed it (one clock: scheduler, Postgres and workers share the machine); the
    worker's own phases of that time, per phase; and the leases whose worker ran a job of the
    same shape (rank) before (a warm worker keeps the adapters of two shapes: it re-initialises
    them in place then)."""
    rows = await conn.fetch(
        "SELECT e.lease_id::text, extract(epoch FROM e.at)::float8 AS at,"
        " EXISTS (SELECT 1 FROM leases p JOIN jobs q ON q.job_id = p.job_id"
        "  WHERE p.machine_id = l.machine_id AND p.granted_at < l.granted_at"
        "  AND q.spec ->> 'lora_rank' = j.spec ->> 'lora_rank') AS same_shape"
        " FROM job_events e JOIN leases l USING (lease_id) JOIN jobs j ON j.job_id = l.job_id"
        " WHERE e.kind = 'LEASE_GRANTED'"
    )
    granted = {r["lease_id"]: r["at"] for r in rows}
    same_shape = {r["lease_id"] for r in rows if r["same_shape"]}
    missing = set(granted) - set(logged)
    if missing:
        raise RuntimeError(f"{len(missing)} leases logged no first step: {sorted(missing)[:3]}")
    seconds = {lease: logged[lease]["first_step_done_at"] - at for lease, at in granted.items()}
    phases: dict[str, list[float]] = {"grant_to_worker": [], "unaccounted": []}
    for lease, at in granted.items():
        record = logged[lease]
        # The grant's way to the worker: recorded, sent, read, a runner made.
        arrived = record["first_step_done_at"] - record["grant_to_first_step_s"]
        phases["grant_to_worker"].append(arrived - at)
        for name, value in record["setup_s"].items():
            phases.setdefault(name, []).append(value)
        # Between the phases: handing the run to the training thread, resolving the runtime.
        timed = sum(record["setup_s"].values())
        phases["unaccounted"].append(record["grant_to_first_step_s"] - timed)
    return seconds, phases, same_shape


async def submit_and_wait(
    scheduler: Scheduler,
    metadata: tuple[tuple[str, str], ...],
    args: argparse.Namespace,
    mode: str,
) -> float:
    """Submits the jobs at once, two shapes interleaved; seconds until the last succeeded."""
    specs = [
        pb.JobSpec(
            instance_prompt="a photo of sks dog",
            instance_data_prefix=PREFIX,
            max_train_steps=args.steps,
            checkpointing_steps=args.checkpointing_steps,
            resolution=64,
            lora_rank=RANKS[i % len(RANKS)],
            seed=1000 + i,
            learning_rate=1e-2,
            labels={"n": str(i)},
        )
        for i in range(args.jobs)
    ]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        stub = pbgrpc.JobServiceStub(channel)
        started = time.monotonic()
        request = pb.SubmitJobsRequest(jobs=[pb.SubmitJobRequest(spec=spec) for spec in specs])
        jobs = (await stub.SubmitJobs(request, metadata=metadata, timeout=60)).jobs
        for job in jobs:
            call = stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id), metadata=metadata)
            async for update in call:
                if update.job.state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELED):
                    raise RuntimeError(f"{mode}: job {job.job_id} {update.job.error}")
                if update.job.state == pb.JOB_STATE_SUCCEEDED:
                    call.cancel()
                    break
        return time.monotonic() - started


async def run_mode(
    mode: str, args: argparse.Namespace, model: Path, root: Path
) -> tuple[dict[str, Any], dict[int, str]]:
    processes: list[asyncio.subprocess.Process] = []
    async with scratch_database(args.database_url, "bench_fleet") as url:
        config = SchedulerConfig(
            listen="127.0.0.1:0",
            database_url=url,
            data_dir=root / f"scheduler-{mode}",
            worker_token=TOKEN,
            lease_ttl_s=60.0,
            heartbeat_interval_s=0.1,
            sweep_interval_s=1.0,
            dispatch_interval_s=1.0,
            warm_dispatch_bound_s=args.bound if mode == "warm" else 0.0,
        )
        try:
            async with Scheduler(config) as scheduler:
                metadata = await owner_with_images(scheduler)
                env = worker_env(
                    scheduler,
                    model,
                    LORAFLEET_PROGRESS_INTERVAL_S="0",
                    LORAFLEET_COMPILE_CACHE_DIR=str(root / f"compile-{mode}"),
                    LORAFLEET_LOG_FORMAT="json",
                    **parse_env(args.cold_env if mode == "cold" else args.warm_env),
                )
                logs = [root / f"worker-{mode}-{n}.log" for n in range(args.workers)]
                machines = [f"bench-{mode}-{n}" for n in range(args.workers)]
                processes = await start_workers(env, machines, logs=logs)
                wall = await submit_and_wait(scheduler, metadata, args, mode)
                # A worker logs a lease's timings as the lease ends, just after its result: all
                # of them are written once the workers have drained and exited.
                await stop_workers(processes)
                conn = await asyncpg.connect(url)
                try:
                    by_lease, phases, same_shape = await first_steps(conn, leases_logged(logs))
                    rows = await conn.fetch(
                        "SELECT job_id, labels ->> 'n' AS n, result_sha256,"
                        " extract(epoch FROM finished_at - created_at)::float8 AS result_s,"
                        " (SELECT sum(extract(epoch FROM l.ended_at - l.granted_at))::float8"
                        "  FROM leases l WHERE l.job_id = j.job_id) AS worker_s"
                        " FROM jobs j"
                    )
                finally:
                    await conn.close()
        finally:
            await stop_workers(processes)
    grant_to_step = list(by_lease.values())
    same = [seconds for lease, seconds in by_lease.items() if lease in same_shape]
    results = {int(r["n"]): r["result_sha256"] for r in rows}
    worker_s = [r["worker_s"] for r in rows]
    result_s = [r["result_s"] for r in rows]
    summary = {
        "mode": mode,
        "jobs": args.jobs,
        "steps": args.steps,
        "workers": args.workers,
        "grant_to_first_step_median_s": round(statistics.median(grant_to_step), 3),
        "grant_to_first_step_p95_s": round(percentile(grant_to_step, 0.95), 3),
        "leases": len(grant_to_step),
        "leases_of_a_shape_run_before": len(same),
        "grant_to_first_step_shape_run_before_median_s": (
            round(statistics.median(same), 3) if same else None
        ),
        "worker_s_per_job_median": round(statistics.median(worker_s), 2),
        "worker_s_per_job_mean": round(statistics.mean(worker_s), 2),
        "result_s_median": round(statistics.median(result_s), 1),
        "result_s_p95": round(percentile(result_s, 0.95), 1),
        "jobs_per_hour": round(args.jobs / wall * 3600, 1),
        "wall_s": round(wall, 1),
        "first_step_phases_median_s": {
            name: round(statistics.median(values), 4) for name, values in phases.items()
        },
    }
    return summary, results


async def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--checkpointing-steps", type=int, default=100, help="the jobs' interval (0: auto)"
    )
    parser.add_argument("--bound", type=float, default=5.0, help="warm_dispatch_bound_s (warm)")
    parser.add_argument("--cold-env", default=COLD_ENV, help="worker variables, cold mode")
    parser.add_argument("--warm-env", default=WARM_ENV, help="worker variables, warm mode")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        cold, cold_results = await run_mode("cold", args, model, root)
        print(json.dumps(cold), flush=True)
        warm, warm_results = await run_mode("warm", args, model, root)
        print(json.dumps(warm), flush=True)
    same = sum(warm_results[n] == cold_results[n] for n in cold_results)
    print()
    print(
        "| mode | grant to 1st step median / p95 s | worker-s per job median (mean) |"
        " result s median / p95 | jobs per hour |"
    )
    print("|---|---|---|---|---|")
    for r in (cold, warm):
        print(
            f"| {r['mode']} | {r['grant_to_first_step_median_s']} /"
            f" {r['grant_to_first_step_p95_s']} | {r['worker_s_per_job_median']}"
            f" ({r['worker_s_per_job_mean']}) | {r['result_s_median']} / {r['result_s_p95']} |"
            f" {r['jobs_per_hour']} |"
        )
    print(
        f"\nwarm leases of a shape their worker ran before:"
        f" {warm['leases_of_a_shape_run_before']} of {warm['leases']}, grant to first step"
        f" median {warm['grant_to_first_step_shape_run_before_median_s']} s"
    )
    ratio = warm["worker_s_per_job_mean"] / cold["worker_s_per_job_mean"]
    print(f"\nworker-seconds per job, warm / cold: {ratio:.2f}")
    print(f"results equal to their cold run's: {same} of {len(cold_results)}")
    return 0 if same == len(cold_results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
