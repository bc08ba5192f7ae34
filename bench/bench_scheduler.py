"""Scheduler under many worker streams: grant latency, CPU per 1000 messages, memory.

    .venv/bin/python bench/bench_scheduler.py --workers 1000 5000 --replicas 1 2 --procs 4

For each (N, R): a fresh database and R scheduler *processes* (so their CPU and RSS are their
own); N simulated workers spread over `--procs` client processes (so the client is not the
bottleneck), each holding one Connect stream (Hello, Ready) to replica `i % R` with its own
machine id. Then jobs are submitted one at a time and the time from submit to the LeaseGranted
arriving at a worker (any process; CLOCK_MONOTONIC is shared) is the grant latency; then a burst
of jobs for every other worker. Then every leased worker heartbeats for a while; the schedulers'
CPU time over that window per 1000 messages is reported, and their RSS per stream. The baseline
row is a bare Postgres round trip (`SELECT 1`) from this process.

`--gc-report` prints each scheduler's garbage-collector pauses (count and longest per
generation) at exit: the profile that found the 5000-stream p99 outlier (docs/BENCHMARKS.md).
`--default-gc-baseline` runs each case first with CPython's default GC thresholds (the
scheduler's `tune_gc` skipped), then as shipped: the paired figures for that fix.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc

from lorafleet.core.model import upload_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.ledger.database import migrate
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.auth import create_api_key
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
    def __init__(self, n: int, channel: grpc.aio.Channel) -> None:
        self.machine_id = f"bench-{n:05d}"
        self.channel = channel
        self.call: Any = None
        self.granted: fpb.LeaseGranted | None = None

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

    async def listen(self, report: Callable[[float], None]) -> None:
        while True:
            message = await self.call.read()
            if message is grpc.aio.EOF:
                return
            if message.WhichOneof("message") == "lease_granted" and self.granted is None:
                self.granted = message.lease_granted
                report(time.perf_counter())

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


def client_process(
    ports: list[int], first: int, count: int, commands: Connection, events: Any
) -> None:
    """One client process: `count` workers (global ids from `first`), each on replica
    `id % len(ports)`; reports ("ready", ...), ("grant", t), ("beats", n) on `events`, obeys
    ("heartbeat", window_s, heartbeat_s) and ("stop",) from `commands`."""
    asyncio.run(_client(ports, first, count, commands, events))


async def _client(
    ports: list[int], first: int, count: int, commands: Connection, events: Any
) -> None:
    loop = asyncio.get_running_loop()
    channels: dict[tuple[int, int], grpc.aio.Channel] = {}

    def channel_for(n: int) -> grpc.aio.Channel:
        port = ports[n % len(ports)]
        key = (port, n // (STREAMS_PER_CHANNEL * len(ports)))
        if key not in channels:
            channels[key] = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return channels[key]

    workers = [Worker(n, channel_for(n)) for n in range(first, first + count)]
    t0 = time.perf_counter()
    for start in range(0, count, 200):
        await asyncio.gather(*(w.connect() for w in workers[start : start + 200]))
    events.put(("ready", time.perf_counter() - t0))
    listeners = [asyncio.create_task(w.listen(lambda t: events.put(("grant", t)))) for w in workers]
    while True:
        command = await loop.run_in_executor(None, commands.recv)
        if command[0] == "stop":
            break
        _, window_s, heartbeat_s = command
        leased = [w for w in workers if w.granted is not None]
        messages = 0
        step = 0
        window_start = time.perf_counter()
        while time.perf_counter() - window_start < window_s:
            step += 1
            tick = time.perf_counter()
            slices = 10
            for s in range(slices):
                for w in leased[s::slices]:
                    await w.heartbeat(step)
                    messages += 1
                await asyncio.sleep(
                    max(0.0, tick + heartbeat_s * (s + 1) / slices - time.perf_counter())
                )
        events.put(("beats", messages))
    for t in listeners:
        t.cancel()
    for w in workers:
        w.call.cancel()
    for c in channels.values():
        await c.close()


GC_REPORT = """
import atexit, gc, signal, sys, time
pauses = {0: [], 1: [], 2: []}
started = {}
def callback(phase, info):
    if phase == "start":
        started["t"] = time.perf_counter()
    else:
        pauses[info["generation"]].append((time.perf_counter() - started["t"]) * 1000)
gc.callbacks.append(callback)
def report():
    for gen, times in pauses.items():
        if times:
            print(f"gc gen{gen}: {len(times)} collections, longest {max(times):.1f} ms,"
                  f" total {sum(times):.0f} ms", file=sys.stderr, flush=True)
atexit.register(report)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
import os
if os.environ.get("BENCH_DEFAULT_GC") == "1":  # the baseline: CPython's default thresholds
    import lorafleet.app.services
    lorafleet.app.services.tune_gc = lambda: None
from lorafleet.app.main import main
sys.exit(main(sys.argv[1:]))
"""


def start_scheduler(
    database_url: str, data_dir: Path, replica: int, gc_report: bool, default_gc: bool = False
) -> tuple[subprocess.Popen[bytes], int]:
    env = dict(
        os.environ,
        BENCH_DEFAULT_GC="1" if default_gc else "0",
        DATABASE_URL=database_url,
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LOG_LEVEL="WARNING",
        LORAFLEET_LEASE_TTL_S="300",
        LORAFLEET_SCHEDULER_ID=f"bench-{replica}",
        # Thousands of simulated workers from one host, connecting at once: no per-holder
        # bounds on streams (that is what this measures).
        LORAFLEET_WORKER_STREAMS_PER_PEER_PER_MIN="0",
        LORAFLEET_WORKER_HELLOS_PER_S="0",
    )
    (data_dir / "storage-secret").write_text(SECRET.decode() + "\n")
    entry = ["-c", GC_REPORT] if gc_report or default_gc else ["-m", "lorafleet.app.main"]
    proc = subprocess.Popen(
        [
            sys.executable,
            *entry,
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


def stop_scheduler(proc: subprocess.Popen[bytes]) -> str:
    """Stops it; what it wrote to stderr since start-up (the GC report, errors)."""
    proc.terminate()
    assert proc.stderr is not None
    rest = proc.stderr.read().decode(errors="replace")
    proc.wait(30)
    return rest


async def bench_one(
    server_url: str,
    n_workers: int,
    replicas: int,
    procs: int,
    heartbeat_s: float,
    window_s: float,
    gc_report: bool,
    default_gc: bool,
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
            schedulers = []
            try:
                for r in range(replicas):
                    data_dir = Path(tmp) / f"replica-{r}"
                    store = LocalObjectStore(
                        LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SECRET)
                    )
                    await store.put_bytes(upload_key("bench", "imgs", "1.png"), b"png")
                    schedulers.append(
                        await asyncio.to_thread(
                            start_scheduler, url, data_dir, r, gc_report, default_gc
                        )
                    )
                return await drive(
                    [port for _, port in schedulers],
                    key,
                    n_workers,
                    procs,
                    heartbeat_s,
                    window_s,
                    [proc.pid for proc, _ in schedulers],
                )
            finally:
                for r, (proc, _) in enumerate(schedulers):
                    report = await asyncio.to_thread(stop_scheduler, proc)
                    if gc_report:
                        for line in report.splitlines():
                            if line.startswith("gc "):
                                print(f"  replica {r}: {line}", flush=True)
                await ledger.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def drive(
    ports: list[int],
    key: str,
    n_workers: int,
    procs: int,
    heartbeat_s: float,
    window_s: float,
    pids: list[int],
) -> dict[str, float]:
    # The schedulers with no stream yet: what each stream adds is measured from here.
    rss_start = sum(proc_stats(pid)[1] for pid in pids)
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    links: list[Connection] = []
    clients = []
    per = (n_workers + procs - 1) // procs
    for p in range(procs):
        first, count = p * per, min(per, n_workers - p * per)
        if count <= 0:
            break
        ours, theirs = context.Pipe()
        process = context.Process(
            target=client_process, args=(ports, first, count, theirs, events), daemon=True
        )
        process.start()
        links.append(ours)
        clients.append(process)

    async def next_event(wait_s: float = 120.0) -> tuple[Any, ...]:
        event: tuple[Any, ...] = await asyncio.to_thread(events.get, True, wait_s)
        return event

    try:
        t0 = time.perf_counter()
        for _ in clients:
            kind, *_ = await next_event(600)
            assert kind == "ready", kind
        connect_s = time.perf_counter() - t0
        rss_idle = sum(proc_stats(pid)[1] for pid in pids)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
            jobs = pbgrpc.JobServiceStub(channel)
            metadata = (("authorization", f"Bearer {key}"),)
            spec = pb.JobSpec(
                instance_prompt="a photo of sks dog",
                instance_data_prefix="imgs",
                max_train_steps=100,
            )

            async def submit(count: int) -> None:
                await jobs.SubmitJobs(
                    pb.SubmitJobsRequest(
                        jobs=[pb.SubmitJobRequest(spec=spec) for _ in range(count)]
                    ),
                    metadata=metadata,
                    timeout=120,
                )

            # Latency: one job at a time into a fleet of idle workers, submit to LeaseGranted.
            samples = min(100, n_workers // 2)
            latencies = []
            for _ in range(samples):
                sent = time.perf_counter()
                await submit(1)
                kind, granted_at = await next_event(60)
                assert kind == "grant", kind
                latencies.append((granted_at - sent) * 1000)
            # Throughput: a burst of jobs for every remaining idle worker.
            remaining = n_workers - samples
            burst_start = time.perf_counter()
            while remaining:
                count = min(remaining, 1000)
                await submit(count)
                remaining -= count
            last = burst_start
            for _ in range(n_workers - samples):
                kind, granted_at = await next_event(600)
                assert kind == "grant", kind
                last = max(last, granted_at)
            burst_s = last - burst_start

        # Heartbeat window: every worker beats every heartbeat_s, spread evenly.
        cpu0 = sum(proc_stats(pid)[0] for pid in pids)
        for link in links:
            link.send(("heartbeat", window_s, heartbeat_s))
        messages = 0
        for _ in clients:
            kind, beats = await next_event(window_s + 120)
            assert kind == "beats", kind
            messages += beats
        # Let the schedulers finish what was sent before reading their CPU.
        await asyncio.sleep(1.0)
        stats = [proc_stats(pid) for pid in pids]
        cpu1 = sum(cpu for cpu, _ in stats)
        rss = sum(r for _, r in stats)
    finally:
        for link in links:
            link.send(("stop",))
        for process in clients:
            await asyncio.to_thread(process.join, 30)
            if process.is_alive():
                process.kill()
    return {
        "workers": n_workers,
        "connect_s": connect_s,
        "grant_p50_ms": statistics.median(latencies),
        "grant_p99_ms": percentile(latencies, 0.99),
        "burst_grants_per_s": (n_workers - samples) / burst_s,
        "heartbeats": messages,
        "cpu_ms_per_1000_msgs": (cpu1 - cpu0) * 1000 / messages * 1000,
        "rss_start_mb": rss_start / 2**20,
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
    parser.add_argument("--workers", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1], help="scheduler processes, e.g. 1 2"
    )
    parser.add_argument("--procs", type=int, default=4, help="client processes for the workers")
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "LORAFLEET_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--gc-report", action="store_true", help="print schedulers' GC pauses")
    parser.add_argument(
        "--default-gc-baseline",
        action="store_true",
        help="before each tuned run, the same run with CPython's default GC thresholds",
    )
    args = parser.parse_args()
    base_ms = await baseline(args.database_url)
    print(f"baseline: Postgres SELECT 1 round trip p50 {base_ms:.3f} ms")
    print(
        "| workers | replicas | gc | connect s | grant p50 ms | grant p99 ms | p99 / SELECT 1"
        " | burst grants/s | heartbeats | CPU ms per 1000 msgs | RSS start MiB | RSS idle MiB"
        " | RSS MiB | KiB per stream |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.workers:
        for replicas, default_gc in itertools.product(
            args.replicas, (True, False) if args.default_gc_baseline else (False,)
        ):
            r = await bench_one(
                args.database_url,
                n,
                replicas,
                args.procs,
                args.heartbeat_s,
                args.window_s,
                args.gc_report,
                default_gc,
            )
            print(
                f"| {n} | {replicas} | {'default' if default_gc else 'tuned'} |"
                f" {r['connect_s']:.1f} | {r['grant_p50_ms']:.1f} |"
                f" {r['grant_p99_ms']:.1f} | {r['grant_p99_ms'] / base_ms:.0f}x |"
                f" {r['burst_grants_per_s']:.0f} | {r['heartbeats']:.0f} |"
                f" {r['cpu_ms_per_1000_msgs']:.0f} | {r['rss_start_mb']:.0f} |"
                f" {r['rss_idle_mb']:.0f} | {r['rss_mb']:.0f} |"
                f" {(r['rss_idle_mb'] - r['rss_start_mb']) * 1024 / n:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    asyncio.run(main())
