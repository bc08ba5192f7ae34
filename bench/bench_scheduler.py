"""Scheduler under many worker streams: grant latency, CPU per 1000 messages, memory.

    .venv/bin/python bench/bench_scheduler.py --workers 100 1000 5000

For each N: a fresh database and a scheduler *process* (so its CPU and RSS are its own); N
simulated workers each hold one Connect stream (Hello, Ready), then a burst of jobs is submitted
and the time from submit to each LeaseGranted arriving at a worker is the grant latency. Then
every leased worker heartbeats for a while; the scheduler's CPU time over that window per 1000
messages is reported. The baseline row is a bare Postgres round trip (`SELECT 1`) from this
process: the grant's ratio to it is what the stream and the claim cost on top of the database.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.model import upload_key
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.database import migrate
from lorafleet.scheduler.ledger import Ledger
from lorafleet.scheduler.storage import LocalObjectStore, LocalStoreConfig

TOKEN = "bench-token"
STREAMS_PER_CHANNEL = 100
SECRET = b"bench-secret-bench-secret-bench-secret"


def proc_stats(pid: int) -> tuple[float, int]:
    """(user+system CPU seconds, RSS bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Worker:
    # Set by whichever worker receives a grant: one event, so waiting costs O(1) not O(N).
    any_grant = asyncio.Event()
    last_grant_at = 0.0

    def __init__(self, n: int, channel: grpc.aio.Channel) -> None:
        self.machine_id = f"bench-{n:05d}"
        self.channel = channel
        self.call: Any = None
        self.granted: fpb.LeaseGranted | None = None
        self.granted_at = 0.0
        self.got_grant = asyncio.Event()

    async def connect(self) -> None:
        # Opened here, not in __init__: the scheduler wants Hello within seconds of the open.
        self.call = fgrpc.WorkerServiceStub(self.channel).Connect(
            metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        await self.call.write(
            fpb.ConnectRequest(
                hello=fpb.Hello(
                    machine_id=self.machine_id,
                    gpu_model="bench",
                    vram_mb=81920,
                    qualification=fpb.Qualification(passed=True),
                    version="bench",
                )
            )
        )
        welcome = await self.call.read()
        assert welcome.WhichOneof("message") == "welcome", welcome
        await self.call.write(fpb.ConnectRequest(ready=fpb.Ready()))

    async def listen(self) -> None:
        while True:
            message = await self.call.read()
            if message is grpc.aio.EOF:
                return
            if message.WhichOneof("message") == "lease_granted" and self.granted is None:
                self.granted = message.lease_granted
                self.granted_at = time.perf_counter()
                self.got_grant.set()
                Worker.last_grant_at = self.granted_at
                Worker.any_grant.set()

    async def heartbeat(self, step: int) -> None:
        assert self.granted is not None
        lease = self.granted.lease
        await self.call.write(
            fpb.ConnectRequest(
                heartbeat=fpb.Heartbeat(
                    lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch),
                    step=step,
                    loss=0.1,
                    seconds_per_step=1.0,
                )
            )
        )


def start_scheduler(database_url: str, data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    env = dict(
        os.environ,
        DATABASE_URL=database_url,
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LOG_LEVEL="WARNING",
        LORAFLEET_LEASE_TTL_S="300",
    )
    (data_dir / "storage-secret").write_text(SECRET.decode() + "\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lorafleet.cli.main",
            "scheduler",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(data_dir),
        ],
        env=env,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline().decode()
        if match := re.search(r"listening on port (\d+)", line):
            return proc, int(match.group(1))
        if not line and proc.poll() is not None:
            break
    raise RuntimeError("scheduler did not start")


async def bench_one(
    server_url: str, n_workers: int, heartbeat_s: float, window_s: float
) -> dict[str, float]:
    name = f"lorafleet_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
    try:
        conn = await asyncpg.connect(url)
        await migrate(conn)
        await conn.close()
        ledger = await Ledger.connect(url, min_size=1, max_size=2)
        key = (await create_api_key(ledger, "bench")).key
        with tempfile.TemporaryDirectory() as tmp:
            data_dir = Path(tmp)
            store = LocalObjectStore(
                LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SECRET)
            )
            await store.put_bytes(upload_key("bench", "imgs", "1.png"), b"png")
            proc, port = await asyncio.to_thread(start_scheduler, url, data_dir)
            try:
                return await drive(port, key, n_workers, heartbeat_s, window_s, proc.pid)
            finally:
                proc.terminate()
                proc.wait(30)
                await ledger.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def drive(
    port: int, key: str, n_workers: int, heartbeat_s: float, window_s: float, pid: int
) -> dict[str, float]:
    target = f"127.0.0.1:{port}"
    channels = [
        grpc.aio.insecure_channel(target)
        for _ in range((n_workers + STREAMS_PER_CHANNEL - 1) // STREAMS_PER_CHANNEL)
    ]
    workers = [Worker(i, channels[i // STREAMS_PER_CHANNEL]) for i in range(n_workers)]
    t0 = time.perf_counter()
    for start in range(0, n_workers, 200):
        await asyncio.gather(*(w.connect() for w in workers[start : start + 200]))
    connect_s = time.perf_counter() - t0
    listeners = [asyncio.create_task(w.listen()) for w in workers]
    _, rss_idle = proc_stats(pid)

    jobs = pbgrpc.JobServiceStub(channels[0])
    metadata = (("authorization", f"Bearer {key}"),)
    spec = pb.JobSpec(
        instance_prompt="a photo of sks dog", instance_data_prefix="imgs", max_train_steps=100
    )

    async def submit(count: int) -> None:
        await jobs.SubmitJobs(
            pb.SubmitJobsRequest(jobs=[pb.SubmitJobRequest(spec=spec) for _ in range(count)]),
            metadata=metadata,
            timeout=120,
        )

    # Latency: one job at a time into a fleet of idle workers, submit to LeaseGranted.
    samples = min(100, n_workers // 2)
    latencies = []
    for _ in range(samples):
        Worker.any_grant.clear()
        sent = time.perf_counter()
        await submit(1)
        await asyncio.wait_for(Worker.any_grant.wait(), timeout=60)
        latencies.append((Worker.last_grant_at - sent) * 1000)
    # Throughput: a burst of jobs for every remaining idle worker.
    remaining = n_workers - samples
    burst_start = time.perf_counter()
    while remaining:
        count = min(remaining, 1000)
        await submit(count)
        remaining -= count
    await asyncio.wait_for(asyncio.gather(*(w.got_grant.wait() for w in workers)), timeout=600)
    burst_s = max(w.granted_at for w in workers) - burst_start
    assert len({w.granted.lease.job_id for w in workers if w.granted}) == n_workers

    # Heartbeat window: every worker beats every heartbeat_s, spread evenly.
    cpu0, _ = proc_stats(pid)
    messages = 0
    step = 0
    window_start = time.perf_counter()
    while time.perf_counter() - window_start < window_s:
        step += 1
        tick = time.perf_counter()
        slices = 10
        for s in range(slices):
            for w in workers[s::slices]:
                await w.heartbeat(step)
                messages += 1
            await asyncio.sleep(
                max(0.0, tick + heartbeat_s * (s + 1) / slices - time.perf_counter())
            )
    # A last round trip so the scheduler has processed what was sent before we read its CPU.
    await asyncio.sleep(1.0)
    cpu1, rss = proc_stats(pid)
    for t in listeners:
        t.cancel()
    for w in workers:
        w.call.cancel()
    for c in channels:
        await c.close()
    return {
        "workers": n_workers,
        "connect_s": connect_s,
        "grant_p50_ms": statistics.median(latencies),
        "grant_p99_ms": percentile(latencies, 0.99),
        "burst_grants_per_s": (n_workers - samples) / burst_s,
        "heartbeats": messages,
        "cpu_ms_per_1000_msgs": (cpu1 - cpu0) * 1000 / messages * 1000,
        "rss_idle_mb": rss_idle / 2**20,
        "rss_mb": rss / 2**20,
    }


async def baseline(server_url: str) -> float:
    conn = await asyncpg.connect(server_url)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        await conn.fetchval("SELECT 1")
        times.append((time.perf_counter() - t) * 1000)
    await conn.close()
    return statistics.median(times)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "LORAFLEET_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    args = parser.parse_args()
    base_ms = await baseline(args.database_url)
    print(f"baseline: Postgres SELECT 1 round trip p50 {base_ms:.3f} ms")
    print(
        "| workers | connect s | grant p50 ms | grant p99 ms | p99 / SELECT 1 | burst grants/s"
        " | heartbeats | CPU ms per 1000 msgs | RSS idle MiB | RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.workers:
        r = await bench_one(args.database_url, n, args.heartbeat_s, args.window_s)
        print(
            f"| {n} | {r['connect_s']:.1f} | {r['grant_p50_ms']:.1f} | {r['grant_p99_ms']:.1f} |"
            f" {r['grant_p99_ms'] / base_ms:.0f}x | {r['burst_grants_per_s']:.0f} |"
            f" {r['heartbeats']:.0f} |"
            f" {r['cpu_ms_per_1000_msgs']:.0f} | {r['rss_idle_mb']:.0f} | {r['rss_mb']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
