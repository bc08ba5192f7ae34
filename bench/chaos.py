"""The chaos benchmark: many simulated DreamBooth jobs through a faulty fleet, then audits.

    python -m bench.chaos                 # 1000 jobs x 1400 steps, up to 40 workers
    python -m bench.chaos --ci            # 100 jobs, up to 12 workers: a few minutes
    python -m bench.chaos --jobs 300 --steps 1400 --workers 24 --seed 7 --json out.json
    python -m bench.chaos --ci --compare-intervals   # checkpointing auto against a fixed 100

Everything is real except the arithmetic: its own Postgres cluster (pgserver's binaries),
two scheduler replicas (`python -m lorafleet.app.main scheduler`) over it, their local object
store over HTTP, worker processes (`lorafleet worker --simulate-step-s`, the simulated trainer)
started and stopped by the scaler (`lorafleet.scaler.service.Scaler`) on the local provider,
webhooks to a receiver on loopback. Workers reach storage through a fault-injecting HTTP proxy
and the schedulers through a TCP proxy that cuts streams (bench/chaos_proxies.py).

The seeded fault plan (FaultPlan): SIGKILLs of the workers holding chosen jobs (about 12% of
jobs once, 3% three times), some of them SIGTERM drains instead; stream cuts; one bad node
(its machine fails every job as a node fault until the scaler reallocates it); one scheduler
replica SIGKILLed and restarted; Postgres restarted (immediate stop) once; 5xx, resets and slow
responses from storage.

With `--mtbi-s M` the worker kills are memoryless instead (all SIGKILLs): each lease is killed
after an exponentially distributed time of mean M seconds from when it is first seen running,
drawn per (job's place in the queue, kills done to it) from the seed, so in two runs of a seed a
job's k-th kill comes the same time into its lease. That is the interruption model the
Young-Daly rule assumes.

`--compare-intervals` runs the fleet twice in one invocation, the same seed and memoryless
kills, checkpointing every 100 steps and then `auto`, at a time scale where the two differ as on
real nodes (about 1.4 s steps, checkpoints costing ~10 s of training, hours between
interruptions), scaled down 70 times: 20 ms steps, a 0.14 s stall per checkpoint (the simulated
trainer's `--simulate-checkpoint-stall-s`), a kill every 192 s of lease time on average, and
the scheduler's priors for the auto interval (interruption rate, checkpoint cost, pace) set to
those. It prints the two terms the rule trades (training time lost to interruptions, and
training time spent checkpointing) for both, and their ratio.

Then it reports in the terms of the system lorafleet replaces and audits (bench/chaos_audit.py),
exiting 1 when any audit fails. Requests go to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import structlog
from aiohttp import web

from bench.chaos_audit import Expected, audit_and_report
from bench.chaos_proxies import CuttingTcpProxy, FaultyHttpProxy, HttpFaults
from lorafleet.core.model import upload_key
from lorafleet.core.webhooks import DELIVERY_HEADER, MESSAGE_ID_PREFIX
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.ledger.database import migrate
from lorafleet.ledger.ledger import Ledger
from lorafleet.scaler.local import LocalProcessProvider
from lorafleet.scaler.policy import PolicyConfig
from lorafleet.scaler.service import Scaler
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.storage import LocalObjectStore, LocalStoreConfig

log = structlog.get_logger("bench.chaos")

ROOT = Path(__file__).resolve().parent.parent
OWNER = "bench"
PREFIX = "chaos/subject"
TOKEN = "chaos-bench-worker-token-0123456789"
SECRET = b"chaos-bench-shared-storage-secret-0123456789"
RESOLUTION = 512
# An SDXL LoRA step on the fleet's GPUs, seconds: what --compare-intervals scales down.
REAL_STEP_S = 1.4
IMAGES = {
    "1.png": b"\x89PNG simulated image one",
    "2.png": b"\x89PNG simulated image two",
    "1.txt": b"a photo of sks subject",
}


@dataclass(frozen=True, kw_only=True)
class Settings:
    jobs: int
    steps: int
    interval: int  # 0: auto, chosen by the scheduler per lease
    workers: int
    seed: int
    step_s: float
    checkpoint_bytes: int
    # Training time each checkpoint stalls (the simulated trainer's snapshot on a slow node).
    checkpoint_stall_s: float
    # Mean lease-seconds between memoryless worker kills; 0: the planned kills.
    mtbi_s: float
    lease_ttl_s: float
    heartbeat_s: float
    retention: int
    price_per_gpu_hour: float
    timeout_s: float
    workdir: Path | None
    keep: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- Postgres, its own cluster ---------------------------------------------------------------


class Postgres:
    """pgserver's cluster in `data_dir`; `restart()` stops it immediately and starts it again."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.server: Any = None
        self.url = ""

    def start(self) -> str:
        import logging
        import warnings

        logging.getLogger("pgserver").setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pgserver.postgres_server import get_server

            self.server = get_server(self.data_dir, cleanup_mode="stop")
        self.url = str(self.server.get_uri())
        return self.url

    def restart(self) -> None:
        from pgserver import _commands

        pg_ctl = vars(_commands)["pg_ctl"]

        server = self.server
        pg_ctl(
            ["-m", "immediate", "-w", "stop"],
            pgdata=self.data_dir,
            user=server.system_user,
            timeout=30,
        )
        server._postmaster_info = None
        server.ensure_postgres_running()

    def stop(self) -> None:
        if self.server is not None:
            self.server.cleanup()
            self.server = None


# -- scheduler replicas ----------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    grpc_port: int
    storage_port: int
    data_dir: Path
    log_path: Path
    env: dict[str, str]
    storage_public_url: str
    process: asyncio.subprocess.Process | None = None
    starts: int = 0

    async def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "ab") as out:  # noqa: ASYNC230
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "lorafleet.app.main",
                "scheduler",
                "--listen",
                f"127.0.0.1:{self.grpc_port}",
                "--data-dir",
                str(self.data_dir),
                "--storage-port",
                str(self.storage_port),
                "--storage-public-url",
                self.storage_public_url,
                "--scheduler-id",
                f"{self.name}-{self.starts}",
                env=self.env,
                stdout=out,
                stderr=out,
                cwd=ROOT,
            )
        # Ready once both ports accept.
        async with asyncio.timeout(90):
            for port in (self.grpc_port, self.storage_port):
                while True:
                    assert self.process.returncode is None, f"replica {self.name} exited"
                    try:
                        _, writer = await asyncio.open_connection("127.0.0.1", port)
                        writer.close()
                        break
                    except OSError:
                        await asyncio.sleep(0.2)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    async def stop(self) -> int | None:
        process = self.process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        process.terminate()
        try:
            async with asyncio.timeout(30):
                return await process.wait()
        except TimeoutError:
            process.kill()
            return await process.wait()


# -- webhooks --------------------------------------------------------------------------------


@dataclass
class WebhookReceiver:
    seed: int
    # (delivery id, event, job id, event id) per request received.
    received: list[tuple[str, str, str, int]] = field(default_factory=list)
    refused: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        rng = random.Random(self.seed)

        async def hook(request: web.Request) -> web.Response:
            body = await request.json()
            if rng.random() < 0.05:  # the receiver has outages too: the scheduler retries
                self.refused += 1
                return web.Response(status=503)
            self.received.append(
                (
                    request.headers.get(DELIVERY_HEADER, "").removeprefix(MESSAGE_ID_PREFIX),
                    str(body.get("event")),
                    str(body.get("job_id")),
                    int(body.get("event_id") or 0),
                )
            )
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/hook", hook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


# -- the fault plan --------------------------------------------------------------------------


@dataclass
class FaultLog:
    kills: list[dict[str, Any]] = field(default_factory=list)
    cuts: int = 0
    replica_killed_at: float | None = None
    replica_back_at: float | None = None
    postgres_restarted_at: float | None = None
    postgres_back_at: float | None = None
    bad_machine: str = ""
    scaler_error: str = ""


class FaultPlan:
    """Seeded: which jobs are interrupted how often and at which steps, when the replica and
    Postgres go down, how often streams are cut."""

    def __init__(self, settings: Settings, job_ids: list[str]) -> None:
        rng = random.Random(settings.seed * 7919 + 1)
        self.rng = rng
        self.seed = settings.seed
        self.step_s = settings.step_s
        self.mtbi_s = settings.mtbi_s
        self.place = {job_id: i for i, job_id in enumerate(job_ids)}
        n = len(job_ids)
        shuffled = rng.sample(job_ids, n)
        # Planned above the 1% floor: a kill is missed when its job finishes first.
        thrice = max(3, math.ceil(0.03 * n))
        once = max(2, math.ceil(0.12 * n))
        # Per job, how many steps into each of its leases its holder is stopped, in order.
        self.interruptions: dict[str, list[int]] = {}
        # Small enough that a job has room for three: three leases of at most two intervals
        # each leave most of the job still to run, so no planned kill is missed because its job
        # finished first. (Counted in time at the simulated step rate from when the lease was
        # first seen running, not from heartbeats: a heartbeat every second is hundreds of
        # simulated steps.)
        # With --interval auto, the plan of the default fixed 100: the same faults, so the two
        # runs compare.
        planned = settings.interval or 100
        low, high = planned // 2 + 20, 2 * planned
        for job_id in shuffled[:thrice]:
            self.interruptions[job_id] = [rng.randint(low, high) for _ in range(3)]
        for job_id in shuffled[thrice : thrice + once]:
            self.interruptions[job_id] = [rng.randint(low, high)]
        # Of all interruptions, this share is a SIGTERM (a drain) rather than a SIGKILL.
        self.term_share = 0.15
        self.replica_kill_at = 0.3  # share of jobs finished
        self.postgres_restart_at = 0.55
        self.cut_every_s = 2.0

    def kill_after_s(self, job_id: str, epoch: int, done_hits: int) -> float | None:
        """Seconds after a lease is first seen running that its worker is stopped; None: never.
        Memoryless kills draw per (place in the queue, kills done to the job so far): a job's
        k-th kill comes as long after its lease starts in every run of a seed, whatever else
        ended its leases (job ids differ between runs; epochs count other interruptions too)."""
        if self.mtbi_s:
            draw = random.Random(f"{self.seed}:{self.place.get(job_id, -1)}:{done_hits}")
            return draw.expovariate(1.0 / self.mtbi_s)
        planned = self.interruptions.get(job_id, [])
        return planned[done_hits] * self.step_s if done_hits < len(planned) else None

    def kill_signal(self) -> signal.Signals:
        if self.mtbi_s:
            return signal.SIGKILL  # a node that vanishes: the case checkpoints are for
        return signal.SIGTERM if self.rng.random() < self.term_share else signal.SIGKILL


class Chaos:
    def __init__(
        self,
        settings: Settings,
        plan: FaultPlan,
        pg: Postgres,
        replicas: list[Replica],
        tcp: CuttingTcpProxy,
        pid_dir: Path,
        faults: FaultLog,
    ) -> None:
        self.s = settings
        self.plan = plan
        self.pg = pg
        self.replicas = replicas
        self.tcp = tcp
        self.pid_dir = pid_dir
        self.faults = faults
        self.hit: dict[str, int] = Counter()  # interruptions done per job
        self.hit_epochs: set[tuple[str, int]] = set()
        # When a lease was first seen running (monotonic seconds).
        self.first_seen: dict[tuple[str, int], float] = {}
        self.finished_share = 0.0
        self.outages: list[asyncio.Task[None]] = []

    def _pid_of(self, machine_id: str) -> int | None:
        for path in self.pid_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                pid, machine = path.read_text().split()
                if machine == machine_id:
                    return int(pid)
        return None

    async def run(self, stop: asyncio.Event) -> None:
        last_cut = time.monotonic()
        while not stop.is_set():
            try:
                await self._tick()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.info("chaos tick failed", error=str(exc))
            if time.monotonic() - last_cut > self.plan.cut_every_s:
                last_cut = time.monotonic()
                self.faults.cuts += self.tcp.cut(1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        await asyncio.gather(*self.outages)

    async def _tick(self) -> None:
        conn = await asyncpg.connect(self.pg.url, timeout=5)
        try:
            rows = await conn.fetch(
                "SELECT job_id::text AS job_id, machine_id, epoch, progress_step, state"
                " FROM jobs WHERE state = 'RUNNING'"
            )
            done = await conn.fetchval(
                "SELECT count(*) FROM jobs WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELED')"
            )
        finally:
            await conn.close()
        self.finished_share = done / self.s.jobs
        for row in rows:
            job_id = row["job_id"]
            key = (job_id, int(row["epoch"]))
            after_s = self.plan.kill_after_s(job_id, key[1], self.hit[job_id])
            if after_s is None or key in self.hit_epochs:
                continue
            seen_at = self.first_seen.setdefault(key, time.monotonic())
            if time.monotonic() < seen_at + after_s:
                continue
            pid = self._pid_of(row["machine_id"])
            if pid is None:
                continue
            sig = self.plan.kill_signal()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                self.hit[job_id] += 1
                self.hit_epochs.add(key)
                self.faults.kills.append(
                    {
                        "job_id": job_id,
                        "epoch": key[1],
                        "signal": sig.name,
                        "machine_id": row["machine_id"],
                        "step": row["progress_step"],
                        "at": time.time(),
                    }
                )
        # The outages run beside the ticks: a tick waiting for a replica or Postgres to come
        # back would miss the kills planned meanwhile.
        if (
            self.faults.replica_killed_at is None
            and self.finished_share >= self.plan.replica_kill_at
        ):
            self.faults.replica_killed_at = time.time()
            self.outages.append(asyncio.create_task(self._replica_outage()))
        if (
            self.faults.postgres_restarted_at is None
            and self.finished_share >= self.plan.postgres_restart_at
        ):
            self.faults.postgres_restarted_at = time.time()
            self.outages.append(asyncio.create_task(self._postgres_outage()))

    async def _replica_outage(self) -> None:
        self.replicas[0].kill()
        await self.replicas[0].process.wait()  # type: ignore[union-attr]
        await asyncio.sleep(2.0)  # the replica is down for a while before it comes back
        await self.replicas[0].start()
        self.faults.replica_back_at = time.time()

    async def _postgres_outage(self) -> None:
        await asyncio.to_thread(self.pg.restart)
        self.faults.postgres_back_at = time.time()


# -- the run ---------------------------------------------------------------------------------


async def submit(port: int, key: str, settings: Settings, webhook_url: str) -> list[str]:
    ids: list[str] = []
    metadata = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pbgrpc.JobServiceStub(channel)
        for start in range(0, settings.jobs, 50):
            batch = [
                pb.SubmitJobRequest(
                    spec=pb.JobSpec(
                        instance_prompt="a photo of sks subject",
                        instance_data_prefix=PREFIX,
                        max_train_steps=settings.steps,
                        checkpointing_steps=settings.interval,
                        seed=settings.seed * 100_000 + i,
                        resolution=RESOLUTION,
                        labels={"bench": "chaos", "n": str(i)},
                    )
                )
                for i in range(start, min(start + 50, settings.jobs))
            ]
            response = await stub.SubmitJobs(
                pb.SubmitJobsRequest(jobs=batch), metadata=metadata, timeout=60
            )
            ids.extend(job.job_id for job in response.jobs)
    return ids


async def wait_all_finished(url: str, total: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn = await asyncpg.connect(url, timeout=5)
            try:
                done = await conn.fetchval(
                    "SELECT count(*) FROM jobs WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELED')"
                )
            finally:
                await conn.close()
            if done >= total:
                return True
        await asyncio.sleep(1.0)
    return False


async def wait_settled(url: str, timeout_s: float) -> None:
    """Webhooks delivered, finished jobs' checkpoints deleted and their storage swept once
    (the sweeper's pass over what the ledger never recorded), or the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn = await asyncpg.connect(url, timeout=5)
            try:
                pending = await conn.fetchval(
                    "SELECT count(*) FROM webhook_deliveries"
                    " WHERE delivered_at IS NULL AND gave_up_at IS NULL"
                )
                kept = await conn.fetchval(
                    "SELECT count(*) FROM checkpoints c JOIN jobs j USING (job_id)"
                    " WHERE c.deleted_at IS NULL AND j.state <> 'RUNNING'"
                )
                kept += await conn.fetchval(
                    "SELECT count(*) FROM jobs WHERE storage_swept_at IS NULL"
                    " AND state IN ('SUCCEEDED', 'FAILED', 'CANCELED')"
                )
            finally:
                await conn.close()
            if pending == 0 and kept == 0:
                return
        await asyncio.sleep(1.0)


async def scaler_decisions(url: str) -> list[tuple[float, str, str, str]]:
    """What the scaler decided and carried out, from its ledger rows."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT extract(epoch FROM at)::float8 AS at, action, target, reason"
            " FROM scaler_decisions WHERE applied ORDER BY decision_id"
        )
    finally:
        await conn.close()
    return [(r["at"], r["action"], r["target"], r["reason"]) for r in rows]


def expected_results(settings: Settings) -> Expected:
    """Every job's result digest from a fault-free in-process run of the simulated trainer."""
    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.simulated import result_sha256, run_simulated
    from lorafleet.worker.training import images_from_files

    images = images_from_files(IMAGES)
    out: dict[int, str] = {}
    for i in range(settings.jobs):
        spec = JobSpec(
            instance_prompt="a photo of sks subject",
            instance_data_prefix=PREFIX,
            max_train_steps=settings.steps,
            # The interval trains nothing (it is outside the resume fingerprint): with auto,
            # whatever the leases chose, the fault-free run may checkpoint at any interval.
            checkpointing_steps=settings.interval or settings.steps,
            seed=settings.seed * 100_000 + i,
            resolution=512,
            labels={"bench": "chaos", "n": str(i)},
        )
        out[i] = result_sha256(
            run_simulated(spec, images, checkpoint_bytes=settings.checkpoint_bytes)
        )
    return Expected(by_index=out)


async def run(settings: Settings) -> tuple[int, dict[str, Any]]:
    """One fleet run, audited: the exit code (1: an audit failed) and the report."""
    started = time.time()
    work = settings.workdir or Path(tempfile.mkdtemp(prefix="lorafleet-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"chaos: working in {work}", flush=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    pid_dir = work / "pids"
    pid_dir.mkdir(exist_ok=True)
    shared = work / "scheduler"
    shared.mkdir(exist_ok=True)
    (shared / "storage-secret").write_bytes(SECRET + b"\n")
    faults = FaultLog()
    pg = Postgres(work / "pg")
    url = await asyncio.to_thread(pg.start)
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    ledger = await Ledger.connect(url, min_size=1, max_size=2)
    receiver = WebhookReceiver(seed=settings.seed)
    await receiver.start()
    webhook_url = f"http://127.0.0.1:{receiver.port}/hook"
    key = (
        await create_api_key(
            ledger, OWNER, webhook_url=webhook_url, webhook_events=["succeeded", "failed"]
        )
    ).key
    await ledger.close()
    store = LocalObjectStore(LocalStoreConfig(root_dir=shared / "objects", secret_key=SECRET))
    for name, data in IMAGES.items():
        await store.put_bytes(upload_key(OWNER, PREFIX, name), data)
    await store.close()

    storage_ports = [free_port(), free_port()]
    grpc_ports = [free_port(), free_port()]
    http = FaultyHttpProxy(
        [f"http://127.0.0.1:{p}" for p in storage_ports], HttpFaults(), seed=settings.seed
    )
    await http.start()
    tcp = CuttingTcpProxy([("127.0.0.1", p) for p in grpc_ports], seed=settings.seed)
    await tcp.start()
    env = dict(
        os.environ,
        DATABASE_URL=url,
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LEASE_TTL_S=str(settings.lease_ttl_s),
        LORAFLEET_HEARTBEAT_INTERVAL_S=str(settings.heartbeat_s),
        LORAFLEET_SWEEP_INTERVAL_S="1",
        LORAFLEET_DISPATCH_INTERVAL_S="2",
        LORAFLEET_CHECKPOINT_RETENTION=str(settings.retention),
        LORAFLEET_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
        LORAFLEET_WEBHOOK_BACKOFF_S="0.5",
        LORAFLEET_WEBHOOK_MAX_ATTEMPTS="20",
        LORAFLEET_LOG_LEVEL="WARNING",
        # Every worker reaches the replicas through one proxy (one peer address) that cuts
        # streams on purpose: no per-address bound, as for any fleet behind a proxy.
        LORAFLEET_WORKER_STREAMS_PER_PEER_PER_MIN="0",
    )
    if settings.mtbi_s:
        # The auto interval's priors at the bench's time scale (an operator sets them for the
        # fleet's hardware): the kills' true rate, the stall, the simulated pace (the prior is
        # per 1024x1024 image step; the jobs are 512 px).
        env.update(
            LORAFLEET_INTERRUPTION_PRIOR_S=str(settings.mtbi_s),
            LORAFLEET_CHECKPOINT_COST_PRIOR_S=str(settings.checkpoint_stall_s or 0.05),
            LORAFLEET_ESTIMATE_PRIOR_S_PER_STEP=str(settings.step_s * (1024 / RESOLUTION) ** 2),
            # The 30 s for which the ledger's figures are reused, at the same time scale.
            LORAFLEET_INTERRUPTION_FIGURES_TTL_S=str(30.0 * settings.step_s / REAL_STEP_S),
        )
    replicas = [
        Replica(
            name=name,
            grpc_port=g,
            storage_port=s,
            data_dir=shared,
            log_path=logs / f"scheduler-{name}.log",
            env=env,
            storage_public_url=f"http://127.0.0.1:{http.port}",
        )
        for name, g, s in zip("ab", grpc_ports, storage_ports, strict=True)
    ]
    await asyncio.gather(*(r.start() for r in replicas))

    forkserver_sock = work / "forkserver.sock"
    with open(logs / "forkserver.log", "ab") as forkserver_log:  # noqa: ASYNC230
        forkserver = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.chaos_forkserver",
            str(forkserver_sock),
            stdout=subprocess.PIPE,
            stderr=forkserver_log,
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
    assert forkserver.stdout is not None
    async with asyncio.timeout(120):
        line = await forkserver.stdout.readline()
    assert b"ready" in line, "the fork server did not start"

    bad_machine = f"{os.uname().nodename}-local-1"
    faults.bad_machine = bad_machine
    provider = LocalProcessProvider(
        scheduler_address=f"127.0.0.1:{tcp.port}",
        worker_token=TOKEN,
        # The replicas' own (shared data directory): each worker proves its machine id, so the
        # scaler may act on its instance.
        identity_secret=(shared / "identity-secret").read_text().strip(),
        log_dir=logs,
        gpus=0,
        extra_env={
            "BENCH_FORKSERVER": str(forkserver_sock),
            "BENCH_PID_DIR": str(pid_dir),
            "BENCH_BAD_MACHINE": bad_machine,
            "LORAFLEET_SIMULATE_STEP_S": str(settings.step_s),
            # A simulated node stands for a GPU node: the memory it announces, which the jobs'
            # estimates are held to, is not this machine's (a CPU worker's is the host's).
            "LORAFLEET_VRAM_MB": "81920",
            "LORAFLEET_SIMULATE_CHECKPOINT_BYTES": str(settings.checkpoint_bytes),
            "LORAFLEET_SIMULATE_CHECKPOINT_STALL_S": str(settings.checkpoint_stall_s),
            "LORAFLEET_DRAIN_GRACE_S": "10",
            "LORAFLEET_RECONNECT_MAX_BACKOFF_S": "2",
            "LORAFLEET_RECONNECT_INITIAL_BACKOFF_S": "0.2",
            "LORAFLEET_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "1",
        },
        restart_backoff_s=0.5,
        max_restart_backoff_s=5.0,
        worker_argv=(sys.executable, "-m", "bench.chaos_spawn"),
    )
    scaler_ledger = await Ledger.connect(url, min_size=1, max_size=4)
    scaler = Scaler(
        ledger=scaler_ledger,
        database_url=url,
        provider=provider,
        tick_interval_s=1.0,
        scaler_id="chaos-scaler",
        policy=PolicyConfig(
            min_replicas=0,
            max_replicas=settings.workers,
            idle_grace_s=5.0,
            cooldown_s=5.0,
            max_step=10,
            fault_threshold=2,
            fault_window_s=3600.0,
            reallocate_share=0.2,
            reallocate_window_s=60.0,
            reallocate_min_per_window=2,
            reallocate_holdoff_s=20.0,
        ),
    )
    stop = asyncio.Event()
    submitted_at = time.time()
    job_ids = await submit(grpc_ports[1], key, settings, webhook_url)
    plan = FaultPlan(settings, job_ids)
    chaos = Chaos(settings, plan, pg, replicas, tcp, pid_dir, faults)
    scaler_task = asyncio.create_task(scaler.run())
    tasks = [asyncio.create_task(chaos.run(stop))]
    finished = await wait_all_finished(url, settings.jobs, settings.timeout_s)
    finished_at = time.time()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    scaler_died = scaler_task.done()
    scaler_task.cancel()
    await asyncio.gather(scaler_task, return_exceptions=True)
    if scaler_died and not scaler_task.cancelled() and scaler_task.exception() is not None:
        faults.scaler_error = repr(scaler_task.exception())
    await scaler.close()
    await scaler_ledger.close()
    http.enabled = False
    await wait_settled(url, 60)
    await provider.scale_to(0)
    await provider.stop(timeout_s=30)
    exit_codes = [await r.stop() for r in replicas]
    forkserver.kill()
    await forkserver.wait()
    await tcp.close()
    await http.close()
    await receiver.close()

    expected = await asyncio.to_thread(expected_results, settings)
    report, failures = await audit_and_report(
        url=url,
        settings=asdict(settings),
        job_ids=job_ids,
        expected=expected,
        objects_root=shared / "objects",
        webhooks=receiver.received,
        webhooks_refused=receiver.refused,
        faults=asdict(faults),
        http_faults=dict(http.counts),
        scaler_actions=await scaler_decisions(url),
        all_finished=finished,
        run_seconds=finished_at - submitted_at,
        replica_exit_codes=exit_codes,
    )
    pg.stop()
    if settings.mtbi_s:
        report["kills_done (memoryless)"] = sum(chaos.hit.values())
    else:
        planned = sum(len(steps) for steps in plan.interruptions.values())
        report["kills_planned_done"] = f"{sum(chaos.hit.values())} of {planned}"
        report["kills_missed"] = {
            job_id: f"{chaos.hit[job_id]} of {len(steps)}"
            for job_id, steps in plan.interruptions.items()
            if chaos.hit[job_id] < len(steps)
        }
    report["wall_seconds_total"] = round(time.time() - started, 1)
    report["workdir"] = str(work)
    print(json.dumps(report, indent=2, default=str))
    if settings_json := os.environ.get("BENCH_CHAOS_JSON"):
        await asyncio.to_thread(
            Path(settings_json).write_text, json.dumps(report, indent=2, default=str)
        )
    if failures:
        print("\nCHAOS AUDIT FAILED:", file=sys.stderr)
        for failure in failures:
            print(f"  - {failure}", file=sys.stderr)
        print(f"logs kept in {work}", file=sys.stderr)
        return 1, report
    print("\nchaos: every audit passed", flush=True)
    if not settings.keep and settings.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0, report


# What --compare-intervals reports of each run (chaos_audit's report keys).
COMPARED = (
    ("interval per lease, steps", "intervals_chosen (auto, per lease)"),
    ("interruptions; steps lost per interruption", "steps_lost_per_interruption"),
    ("steps lost in all", "steps_lost_total"),
    ("checkpoints taken (each a stall)", "checkpoint_snapshots_taken"),
    ("checkpoints committed", "checkpoints_committed"),
    ("training s lost to interruptions", "training_s_lost"),
    ("training s spent checkpointing", "training_s_checkpointing"),
    ("the two together, s", "training_s_lost_plus_checkpointing"),
    ("GPU-seconds", "gpu_seconds"),
    ("run, submit to last result, s", "run_seconds"),
)


def compare(fixed: dict[str, Any], auto: dict[str, Any]) -> str:
    """The two runs side by side, with auto's ratio to the fixed interval where it is one."""

    def shown(value: Any) -> str:
        if isinstance(value, dict):
            if "median" in value:
                count = f"{value['count']}, " if "count" in value else ""
                return f"{count}median {value['median']:g}, mean {value['mean']:g}"
            return "-"
        return f"{value:g}" if isinstance(value, float) else str(value)

    lines = ["| figure | fixed 100 | auto | auto / fixed |", "|---|---|---|---|"]
    for label, key in COMPARED:
        a, b = fixed.get(key), auto.get(key)
        if key == "intervals_chosen (auto, per lease)":
            a = fixed["checkpoint_interval"]  # chosen by no one: the spec's
        numbers = isinstance(a, int | float) and isinstance(b, int | float) and a
        ratio = f"{b / a:.2f}" if numbers else ""  # type: ignore[operator]
        lines.append(f"| {label} | {shown(a)} | {shown(b)} | {ratio} |")
    return "\n".join(lines)


async def compare_intervals(settings: Settings) -> int:
    """A fixed 100 then auto, the same seed and kills; the comparison printed last."""
    codes: list[int] = []
    reports: list[dict[str, Any]] = []
    json_path = os.environ.pop("BENCH_CHAOS_JSON", None)
    for interval in (100, 0):
        name = f"interval-{interval or 'auto'}"
        print(f"chaos: checkpointing {interval or 'auto'}", flush=True)
        workdir = settings.workdir / name if settings.workdir else None
        code, report = await run(replace(settings, interval=interval, workdir=workdir))
        codes.append(code)
        reports.append(report)
    if json_path:
        both = {"fixed_100": reports[0], "auto": reports[1]}
        await asyncio.to_thread(Path(json_path).write_text, json.dumps(both, indent=2, default=str))
    print(
        "\ncheckpointing_steps auto against a fixed 100 (memoryless kills, mean"
        f" {settings.mtbi_s:g} s of lease time; {settings.step_s:g} s steps;"
        f" {settings.checkpoint_stall_s:g} s stall a checkpoint):"
    )
    print(compare(*reports), flush=True)
    return max(codes)


def _interval(text: str) -> int:
    """A checkpoint interval in steps; `auto` is the spec's 0."""
    if text == "auto":
        return 0
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("the interval is a positive number of steps, or auto")
    return value


def parse(argv: list[str] | None) -> tuple[Settings, str | None, bool]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ci", action="store_true", help="the CI size: 100 jobs, 12 workers")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument(
        "--interval",
        type=_interval,
        default=100,
        help="checkpoint every N steps, or auto: the scheduler's choice per lease (Young-Daly)",
    )
    parser.add_argument("--workers", type=int)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--compare-intervals",
        action="store_true",
        help="run a fixed 100 and auto in turn, memoryless kills, at the scaled real time scale"
        " (defaults: --step-s 0.02 --checkpoint-stall-s 0.14 --mtbi-s 192 --heartbeat-s 0.2)",
    )
    parser.add_argument("--step-s", type=float, help="simulated step (default 0.002)")
    parser.add_argument("--checkpoint-bytes", type=int, default=256 * 1024)
    parser.add_argument(
        "--checkpoint-stall-s", type=float, help="training stall a checkpoint (default 0)"
    )
    parser.add_argument(
        "--mtbi-s",
        type=float,
        help="memoryless worker kills, one per this many lease-seconds on average"
        " (default: the planned kills)",
    )
    parser.add_argument("--lease-ttl-s", type=float, default=8.0)
    parser.add_argument("--heartbeat-s", type=float, help="worker heartbeat (default 1)")
    parser.add_argument("--retention", type=int, default=2)
    parser.add_argument("--price-per-gpu-hour", type=float, default=0.25)
    parser.add_argument("--timeout-s", type=float)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    compare = args.compare_intervals

    def given(value: float | None, default: float, compared: float) -> float:
        return value if value is not None else (compared if compare else default)

    if compare and args.mtbi_s == 0:
        parser.error("--compare-intervals runs memoryless kills: --mtbi-s must be positive")
    settings = Settings(
        jobs=args.jobs or (100 if args.ci else 1000),
        steps=args.steps,
        interval=args.interval,
        workers=args.workers or (12 if args.ci else 40),
        seed=args.seed,
        step_s=given(args.step_s, 0.002, 0.02),
        checkpoint_bytes=args.checkpoint_bytes,
        checkpoint_stall_s=given(args.checkpoint_stall_s, 0.0, 0.14),
        mtbi_s=given(args.mtbi_s, 0.0, 192.0),
        lease_ttl_s=args.lease_ttl_s,
        heartbeat_s=given(args.heartbeat_s, 1.0, 0.2),
        retention=args.retention,
        price_per_gpu_hour=args.price_per_gpu_hour,
        timeout_s=args.timeout_s or ((900.0 if compare else 240.0) if args.ci else 1500.0),
        workdir=args.workdir,
        keep=args.keep,
    )
    return settings, args.json, compare


def main(argv: list[str] | None = None) -> int:
    settings, json_path, compare = parse(argv)
    if json_path:
        os.environ["BENCH_CHAOS_JSON"] = json_path
    from lorafleet.core.telemetry import configure_logging

    configure_logging(level="WARNING", fmt="console")
    if compare:
        return asyncio.run(compare_intervals(settings))
    return asyncio.run(run(settings))[0]


if __name__ == "__main__":
    sys.exit(main())
