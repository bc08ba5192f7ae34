"""Two scheduler processes over one database, 50 concurrent workers: never a job granted twice.

Workers connect to either replica at random, finish most leases, drop some streams mid-lease
(their leases expire and are re-granted), drain some, and the test cancels some running jobs
through the *other* replica. Then the ledger is audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import asyncpg
import grpc
import pytest

from lorafleet.core.model import upload_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.storage import LocalObjectStore, LocalStoreConfig
from tests.support.artifacts import lora_blob
from tests.support.jobs import JobClient, spec
from tests.support.workers import connect_worker

TOKEN = "replica-test-token"
WORKERS = 50
JOBS = 200
CANCELS = 10


@asynccontextmanager
async def replica(database_url: str, data_dir: Path) -> AsyncIterator[int]:
    env = dict(
        os.environ,
        DATABASE_URL=database_url,
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LEASE_TTL_S="2",
        # Two replicas and the test's own pool share the test Postgres with the rest of the
        # suite (and on a busy machine another suite): the default 20 each took it to its
        # 100-connection limit.
        LORAFLEET_DATABASE_POOL_SIZE="8",
        LORAFLEET_LOG_LEVEL="WARNING",
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    drain: asyncio.Task[bytes] | None = None
    try:
        port = 0
        async with asyncio.timeout(60):
            while not port:
                line = (await proc.stderr.readline()).decode()
                assert line, "scheduler exited before listening"
                if match := re.search(r"listening on port (\d+)", line):
                    port = int(match.group(1))
        drain = asyncio.create_task(proc.stderr.read())
        yield port
    finally:
        # Also when the body failed: a replica that died explains the failure, so its exit
        # status and log are raised here (the body's error stays attached as the context).
        died_early = proc.returncode is not None
        if not died_early:
            proc.terminate()
        async with asyncio.timeout(30):
            await proc.wait()
        output = (await drain).decode(errors="replace") if drain else ""
        assert proc.returncode == 0 and not died_early, (
            f"replica exited with {proc.returncode}"
            f" ({'on its own' if died_early else 'after SIGTERM'}): {output[-3000:]}"
        )


async def run_worker(
    n: int,
    ports: list[int],
    rng: random.Random,
    grants: list[tuple[str, int, str]],
    done: asyncio.Event,
    stats: Counter[str],
) -> None:
    machine = f"w{n:02d}"
    async with aiohttp.ClientSession() as http:
        while not done.is_set():
            port = rng.choice(ports)
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
                connect_worker(channel, TOKEN, machine) as worker,
            ):
                while not done.is_set():
                    await worker.send(ready=fpb.Ready())
                    message = None
                    while message is None or message.WhichOneof("message") != "lease_granted":
                        read = asyncio.ensure_future(worker.call.read())
                        stop = asyncio.ensure_future(done.wait())
                        await asyncio.wait([read, stop], return_when=asyncio.FIRST_COMPLETED)
                        if done.is_set():
                            read.cancel()
                            stop.cancel()
                            return
                        stop.cancel()
                        message = read.result()
                        assert message is not grpc.aio.EOF
                    granted = message.lease_granted
                    grants.append((granted.lease.job_id, granted.lease.epoch, machine))
                    ref = worker.ref(granted.lease)
                    await worker.heartbeat(granted.lease, 1, loss=0.5, seconds_per_step=0.01)
                    roll = rng.random()
                    if roll < 0.1:
                        stats["dropped"] += 1
                        break  # drop the stream holding the lease: it must expire
                    if roll < 0.2:
                        stats["drained"] += 1
                        await worker.send(draining=fpb.Draining(lease=ref, reason="spot"))
                        break
                    lora = lora_blob(granted.lease.epoch)
                    async with http.put(granted.urls.result_upload.url, data=lora) as r:
                        assert r.status in (200, 201, 204)
                    await worker.send(
                        job_succeeded=fpb.JobSucceeded(
                            lease=ref,
                            key=granted.urls.result_upload.key,
                            size_bytes=len(lora),
                            sha256=hashlib.sha256(lora).hexdigest(),
                            step=10,
                        )
                    )
                    stats["succeeded"] += 1


@pytest.mark.slow
async def test_two_replicas_fifty_workers_never_grant_twice(
    database_url: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "shared"
    ledger = await Ledger.connect(database_url, max_size=4)  # the test's own reads
    # Both replicas serve the one objects directory with the one secret: shared storage.
    data_dir.mkdir()
    (data_dir / "storage-secret").write_text("shared-secret-for-both-replicas-0123456789\n")
    store = LocalObjectStore(
        LocalStoreConfig(
            root_dir=data_dir / "objects", secret_key=b"shared-secret-for-both-replicas-0123456789"
        )
    )
    await store.put_bytes(upload_key("alice", "dogs/rex", "1.png"), b"png")
    key = (await create_api_key(ledger, "alice")).key
    rng = random.Random(1234)
    async with replica(database_url, data_dir) as port_a, replica(database_url, data_dir) as port_b:
        ports = [port_a, port_b]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        clients = [JobClient(pbgrpc.JobServiceStub(c), key) for c in channels]
        grants: list[tuple[str, int, str]] = []
        stats: Counter[str] = Counter()
        done = asyncio.Event()
        workers = [
            asyncio.create_task(run_worker(n, ports, random.Random(n), grants, done, stats))
            for n in range(WORKERS)
        ]
        job_ids: list[str] = []
        for start in range(0, JOBS, 50):
            batch = pb.SubmitJobsRequest(jobs=[pb.SubmitJobRequest(spec=spec()) for _ in range(50)])
            response = await clients[start // 50 % 2].stub.SubmitJobs(
                batch, metadata=clients[0].metadata
            )
            job_ids.extend(j.job_id for j in response.jobs)
        canceled = set(rng.sample(job_ids, CANCELS))
        for i, job_id in enumerate(canceled):
            await clients[i % 2].cancel(job_id)
        # Event-driven wait: every job event anywhere wakes the check (bounded overall).
        listener = await asyncpg.connect(database_url)
        woke = asyncio.Event()
        await listener.add_listener("lorafleet_job_event", lambda *_: woke.set())
        try:
            async with asyncio.timeout(180):
                while True:
                    woke.clear()
                    listed = await clients[0].stub.ListJobs(
                        pb.ListJobsRequest(page_size=1000), metadata=clients[0].metadata
                    )
                    states = Counter(j.state for j in listed.jobs)
                    if states[pb.JOB_STATE_QUEUED] == states[pb.JOB_STATE_RUNNING] == 0:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woke.wait(), 5)
        finally:
            await listener.close()
            done.set()
            await asyncio.gather(*workers, return_exceptions=True)
            for c in channels:
                await c.close()

    # The audit. Every grant a worker saw is unique and is in the ledger.
    seen = Counter((job, epoch) for job, epoch, _ in grants)
    assert max(seen.values()) == 1, "a (job, epoch) was granted twice"
    conn = await asyncpg.connect(database_url)
    try:
        leases = await conn.fetch("SELECT * FROM leases ORDER BY job_id, epoch")
        jobs = {str(r["job_id"]): r for r in await conn.fetch("SELECT * FROM jobs")}
        granted_events = await conn.fetch(
            "SELECT job_id, epoch, count(*) FROM job_events WHERE kind = 'LEASE_GRANTED'"
            " GROUP BY job_id, epoch HAVING count(*) > 1"
        )
        succeeded_events = Counter(
            str(r["job_id"])
            for r in await conn.fetch("SELECT job_id FROM job_events WHERE kind = 'SUCCEEDED'")
        )
    finally:
        await conn.close()
    assert granted_events == []
    assert {(job, epoch) for job, epoch, _ in grants} <= {
        (str(r["job_id"]), r["epoch"]) for r in leases
    }
    by_job: dict[str, list[asyncpg.Record]] = defaultdict(list)
    for lease in leases:
        by_job[str(lease["job_id"])].append(lease)
    for job_leases in by_job.values():
        assert [lease["epoch"] for lease in job_leases] == list(range(1, len(job_leases) + 1))
        for earlier, later in itertools.pairwise(job_leases):
            # A lease is only granted after the previous one ended: never two live at once.
            assert earlier["ended_at"] is not None and earlier["ended_at"] <= later["granted_at"], (
                f"lease {earlier['epoch']} on {earlier['machine_id']} ended"
                f" ({earlier['end_reason']}) at {earlier['ended_at']}, lease {later['epoch']}"
                f" on {later['machine_id']} granted at {later['granted_at']}"
            )
    for job_id in job_ids:
        row = jobs[job_id]
        if job_id in canceled and row["state"] == "CANCELED":
            assert succeeded_events[job_id] == 0
            continue
        assert row["state"] == "SUCCEEDED", (job_id, row["state"])
        assert succeeded_events[job_id] == 1
        assert row["result_key"].endswith(f"/e{row['epoch']}/pytorch_lora_weights.safetensors")
    assert stats["dropped"] > 0 and stats["drained"] > 0
    await ledger.close()
    await store.close()
