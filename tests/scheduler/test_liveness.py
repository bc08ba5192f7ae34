"""Leases that outlive the scheduler's bad moments (issue 31), against real scheduler processes.

Two replicas over one Postgres and one objects directory behind a round-robin TCP balancer (a
TCP health check keeps a frozen replica in the pool: its kernel still accepts connections).
Workers are real agents (in this process) with the simulated trainer: everything about a
lease is real but the arithmetic.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from lorafleet.core.model import upload_key
from lorafleet.core.settings import load
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.storage import LocalObjectStore, LocalStoreConfig
from lorafleet.worker.agent import Agent, State
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.qualify import QualificationResult
from lorafleet.worker.simulated import simulated_trainer_factory
from lorafleet.worker.transfer import TransferConfig
from tests.support.fleet import Fleet, running
from tests.support.images import png
from tests.support.jobs import PREFIX, JobClient
from tests.support.replicas import (
    SHARED_STORAGE_SECRET,
    PostgresGate,
    SchedulerProcess,
    TcpBalancer,
    scheduler_process,
    shared_data_dir,
)
from tests.support.workers import connect_worker

TOKEN = "liveness-test-token"
TTL_S = 12.0
SILENCE_S = 3.0
# SchedulerConfig.outage_after_s with the default 1 s attend interval: how long the ledger must
# hear from no replica for live leases to get a TTL back.
OUTAGE_AFTER_S = 3.0
# Long jobs, no checkpoint while the test looks: the simulated trainer paces 20 steps a second.
LONG_JOB = dict(max_train_steps=50_000, checkpointing_steps=25_000)


async def training(client: JobClient, job_id: str) -> None:
    """Until the job's holder reports a step: its inputs are downloaded (from the replica's own
    local store, which the faults below take away with the replica) and it trains."""
    await client.wait_for(job_id, lambda job: job.progress.step > 0, timeout=60)


def worker_config(machine_id: str, address: str, data_dir: Path, **overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = dict(
        worker_token=TOKEN,
        scheduler_address=address,
        machine_id=machine_id,
        provider_instance_id=f"instance-{machine_id}",
        allow_cpu=True,
        device="cpu",
        min_free_disk_mb=0,
        min_free_memory_mb=0,
        reconnect_initial_backoff_s=0.05,
        reconnect_max_backoff_s=0.5,
        scheduler_silence_s=SILENCE_S,
        compile_cache_dir=data_dir / "compile-cache" / machine_id,
        compile_model="off",
        transfer=TransferConfig(
            max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=30.0
        ),
    )
    values.update(overrides)
    return load(WorkerConfig, env={}, **values)


@asynccontextmanager
async def two_replicas(
    database_url: str, tmp_path: Path, **env: str
) -> AsyncIterator[tuple[SchedulerProcess, SchedulerProcess, TcpBalancer, JobClient]]:
    data_dir = shared_data_dir(tmp_path / "shared")
    store = LocalObjectStore(
        LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SHARED_STORAGE_SECRET.encode())
    )
    await store.put_bytes(upload_key("alice", PREFIX, "1.png"), png(1))
    ledger = await Ledger.connect(database_url, max_size=2)
    try:
        key = (await create_api_key(ledger, "alice")).key
    finally:
        await ledger.close()
    base = dict(
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LEASE_TTL_S=str(TTL_S),
        LORAFLEET_HEARTBEAT_INTERVAL_S="1",
        LORAFLEET_SWEEP_INTERVAL_S="0.5",
        **env,
    )
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            scheduler_process(database_url, data_dir, {**base, "LORAFLEET_SCHEDULER_ID": "a"})
        )
        b = await stack.enter_async_context(
            scheduler_process(database_url, data_dir, {**base, "LORAFLEET_SCHEDULER_ID": "b"})
        )
        # The token came from the environment: no file in the data directory is named.
        assert "worker token from LORAFLEET_WORKER_TOKEN" in a.log, a.log
        assert str(data_dir / "worker-token") not in a.log, a.log
        balancer = TcpBalancer([a.port, b.port])
        await balancer.start()
        stack.push_async_callback(balancer.close)
        # The test's own calls go straight to replica b, which is never frozen.
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{b.port}"))
        yield a, b, balancer, JobClient(pbgrpc.JobServiceStub(channel), key)


async def job_events(database_url: str, job_id: str) -> list[tuple[str, int | None]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT kind, epoch FROM job_events WHERE job_id = $1 ORDER BY event_id", job_id
        )
    finally:
        await conn.close()
    return [(str(r["kind"]), r["epoch"]) for r in rows]


@pytest.mark.slow
async def test_a_frozen_replica_is_left_within_the_bound_and_no_lease_expires(
    database_url: str,
    tmp_path: Path,
    cpu_qualification: QualificationResult,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    loop = asyncio.get_running_loop()
    async with two_replicas(database_url, tmp_path) as (a, _b, balancer, client):
        agents = [
            Agent(
                worker_config(f"w{n}", balancer.address, tmp_path),
                trainer_factory=simulated_trainer_factory(step_s=0.05, checkpoint_bytes=4096),
                qualification=cpu_qualification,
            )
            for n in range(2)
        ]
        async with AsyncExitStack() as stack:
            for agent in agents:
                # Both on replica a: the one the test freezes.
                balancer.route_next_to(0)
                await stack.enter_async_context(running(agent))
                async with asyncio.timeout(60):
                    await agent.wait_for_state(State.IDLE)
                assert agent.scheduler_id == "a"
            jobs = [await client.submit(**LONG_JOB) for _ in agents]
            async with asyncio.timeout(60):
                for agent in agents:
                    await agent.wait_for_state(State.LEASED)
            for job in jobs:
                await training(client, job.job_id)
            leases = {agent.runner.ref.lease_id for agent in agents if agent.runner}
            assert len(leases) == 2

            a.freeze()
            frozen_at = loop.time()
            # Each worker notices within the silence bound (plus a ping interval), and a try or
            # two through the balancer (one may land on the frozen replica again) finds b.
            moved_after: list[float] = []
            async with asyncio.timeout(TTL_S):
                for agent in agents:
                    await agent.wait_until(
                        lambda x: x.scheduler_id == "b" and x.state is State.LEASED
                    )
                    moved_after.append(loop.time() - frozen_at)
            assert max(moved_after) < 3 * SILENCE_S, moved_after
            # The same leases, still training.
            assert {agent.runner.ref.lease_id for agent in agents if agent.runner} == leases

            # Replica a stays frozen past a whole TTL: b's sweeper would expire any lease its
            # holder had not brought over.
            await asyncio.sleep(max(0.0, frozen_at + TTL_S + 3.0 - loop.time()))
            for job in jobs:
                got = await client.get(job.job_id)
                assert got.state == pb.JOB_STATE_RUNNING, got
                events = await job_events(database_url, job.job_id)
                kinds = [kind for kind, _ in events]
                assert "LEASE_EXPIRED" not in kinds, events
                assert {epoch for kind, epoch in events if kind == "LEASE_GRANTED"} == {1}
            for agent in agents:
                assert agent.runner is not None and agent.runner.holds_lease
                assert agent.runner.ref.lease_id in leases
            a.thaw()
        gc.collect()  # a stream dropped without being closed would complain now
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


async def lease_of(database_url: str, job_id: str) -> tuple[str, str | None, int]:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT state, lease_id::text, epoch FROM jobs WHERE job_id = $1", job_id
        )
    finally:
        await conn.close()
    assert row is not None
    return str(row["state"]), row["lease_id"], int(row["epoch"])


@pytest.mark.slow
async def test_a_restart_longer_than_the_silence_it_may_lapse_in_keeps_the_lease(
    database_url: str, tmp_path: Path, cpu_qualification: QualificationResult
) -> None:
    """Finding 2: the one replica is killed and started again after more than the outage bound;
    its worker gets through only after a TTL since the kill, and at least 4 s after the new
    process is up. The lease's last
    heartbeat is then more than a TTL old, but a TTL had not passed with a scheduler there to
    hear it: the lease must be resumed."""
    ttl_s = 10.0
    data_dir = shared_data_dir(tmp_path / "shared")
    store = LocalObjectStore(
        LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SHARED_STORAGE_SECRET.encode())
    )
    await store.put_bytes(upload_key("alice", PREFIX, "1.png"), png(1))
    ledger = await Ledger.connect(database_url, max_size=2)
    try:
        key = (await create_api_key(ledger, "alice")).key
    finally:
        await ledger.close()
    # The default sweep interval (5 s): a restart is not noticed by a sweep gone quiet.
    env = dict(
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LEASE_TTL_S=str(ttl_s),
        LORAFLEET_HEARTBEAT_INTERVAL_S="1",
    )
    balancer = TcpBalancer([])
    await balancer.start()
    loop = asyncio.get_running_loop()
    agent = Agent(
        worker_config("w0", balancer.address, tmp_path),
        trainer_factory=simulated_trainer_factory(step_s=0.05, checkpoint_bytes=4096),
        qualification=cpu_qualification,
    )
    try:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(scheduler_process(database_url, data_dir, env))
            balancer.retarget([first.port])
            await stack.enter_async_context(running(agent))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
                client = JobClient(pbgrpc.JobServiceStub(channel), key)
                job = await client.submit(**LONG_JOB)
                async with asyncio.timeout(60):
                    await agent.wait_for_state(State.LEASED)
                await training(client, job.job_id)
            _, lease_id, epoch = await lease_of(database_url, job.job_id)
            balancer.retarget([])  # the worker cannot get through until the test says so
            first.proc.kill()
            await first.proc.wait()
            killed_at = loop.time()
            # A restart longer than the ledger's outage bound (config.outage_after_s: 3 s with
            # a 1 s attend interval), as the finding had it: the lease's TTL then counts from
            # the new replica's first attend. A restart quicker than that is no outage, and the
            # lease lapses a TTL after its last heartbeat, as it should; a fast machine started
            # the scheduler that quickly now and then, and the test failed (issue 32).
            await asyncio.sleep(OUTAGE_AFTER_S + 1.5)
            second = await stack.enter_async_context(scheduler_process(database_url, data_dir, env))
            up_at = loop.time()
            # The worker comes back just past a TTL of its lease's last heartbeat (before the
            # kill), and at least 4 s after the new process is up: within a TTL of that. A
            # fixed 8 s after the start left 2 s for the reconnect and resume, which a machine
            # running another test suite beside this one did not always give (issue 32); a
            # slow start now leaves more, a fast one 1.5 s.
            await asyncio.sleep(max(killed_at + ttl_s + 0.5, up_at + 4.0) - loop.time())
            balancer.retarget([second.port])
            back_after = loop.time() - killed_at
            async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
                client = JobClient(pbgrpc.JobServiceStub(channel), key)
                await client.wait_event(job.job_id, pb.JOB_EVENT_KIND_LEASE_RESUMED, timeout=ttl_s)
            assert await lease_of(database_url, job.job_id) == ("RUNNING", lease_id, epoch)
            assert agent.runner is not None and agent.runner.ref.lease_id == lease_id
            kinds = [kind for kind, _ in await job_events(database_url, job.job_id)]
            assert back_after > ttl_s and "LEASE_EXPIRED" not in kinds, (back_after, kinds)
            assert "LEASE_RESUMED" in kinds, kinds
    finally:
        await balancer.close()


@pytest.mark.slow
async def test_a_postgres_outage_longer_than_the_ttl_costs_no_lease(
    database_url: str, tmp_path: Path, cpu_qualification: QualificationResult
) -> None:
    """Finding 3: Postgres is unreachable for longer than the TTL. No replica could hear a
    heartbeat meanwhile, so no lease lapses; the worker keeps training and, once the ledger is
    back, commits its next checkpoint under the same lease."""
    ttl_s = 6.0
    gate = PostgresGate(database_url)
    await gate.start()
    data_dir = shared_data_dir(tmp_path / "shared")
    store = LocalObjectStore(
        LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SHARED_STORAGE_SECRET.encode())
    )
    await store.put_bytes(upload_key("alice", PREFIX, "1.png"), png(1))
    ledger = await Ledger.connect(database_url, max_size=2)
    try:
        key = (await create_api_key(ledger, "alice")).key
    finally:
        await ledger.close()
    env = dict(
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LEASE_TTL_S=str(ttl_s),
        LORAFLEET_HEARTBEAT_INTERVAL_S="1",
        LORAFLEET_SWEEP_INTERVAL_S="0.5",
    )
    try:
        async with AsyncExitStack() as stack:
            scheduler = await stack.enter_async_context(scheduler_process(gate.url, data_dir, env))
            agent = Agent(
                worker_config("w0", f"127.0.0.1:{scheduler.port}", tmp_path),
                trainer_factory=simulated_trainer_factory(step_s=0.02, checkpoint_bytes=4096),
                qualification=cpu_qualification,
            )
            await stack.enter_async_context(running(agent))
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")
            )
            client = JobClient(pbgrpc.JobServiceStub(channel), key)
            job = await client.submit(max_train_steps=50_000, checkpointing_steps=50)
            first = await client.wait_event(
                job.job_id, pb.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, timeout=60
            )
            _, lease_id, epoch = await lease_of(database_url, job.job_id)
            gate.down()
            await asyncio.sleep(ttl_s + 4.0)  # the outage: longer than the TTL
            gate.up()
            # Committed after the outage, under the same lease: nothing was lost.
            before = (await client.get(job.job_id)).latest_checkpoint.step
            assert before >= first.step
            await client.wait_event(
                job.job_id,
                pb.JOB_EVENT_KIND_CHECKPOINT_COMMITTED,
                where=lambda e: e.step > before and e.epoch == epoch,
                timeout=30,
            )
            assert await lease_of(database_url, job.job_id) == ("RUNNING", lease_id, epoch)
            kinds = [kind for kind, _ in await job_events(database_url, job.job_id)]
            assert "LEASE_EXPIRED" not in kinds, kinds
            assert agent.runner is not None and agent.runner.ref.lease_id == lease_id
    finally:
        await gate.close()


@pytest.mark.slow
async def test_a_rolling_restart_is_a_routine_reconnect(
    database_url: str,
    tmp_path: Path,
    cpu_qualification: QualificationResult,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Finding 4: replica a stops (SIGTERM, as a rolling restart does) while its worker holds a
    lease; the worker resumes it on b. A reconnect is routine: one INFO line naming the lease,
    no ERROR from the stream it dropped (no task destroyed while pending, no async generator
    closed while running)."""
    caplog.set_level(logging.INFO)
    async with two_replicas(database_url, tmp_path) as (a, _b, balancer, client):
        agent = Agent(
            worker_config("w0", balancer.address, tmp_path),
            trainer_factory=simulated_trainer_factory(step_s=0.05, checkpoint_bytes=4096),
            qualification=cpu_qualification,
        )
        balancer.route_next_to(0)
        async with running(agent):
            async with asyncio.timeout(60):
                await agent.wait_for_state(State.IDLE)
            assert agent.scheduler_id == "a"
            job = await client.submit(**LONG_JOB)
            async with asyncio.timeout(60):
                await agent.wait_for_state(State.LEASED)
            await training(client, job.job_id)
            assert agent.runner is not None
            lease_id = agent.runner.ref.lease_id
            a.proc.terminate()
            async with asyncio.timeout(TTL_S):
                await agent.wait_until(lambda x: x.scheduler_id == "b" and x.state is State.LEASED)
            assert agent.runner is not None and agent.runner.ref.lease_id == lease_id
            await client.cancel(job.job_id)
            async with asyncio.timeout(30):
                await agent.wait_for_state(State.IDLE)
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)  # finalizers scheduled by the collection run now
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    # The agent's own lines (structlog, rendered to stderr): one for the reconnect, at INFO,
    # naming the lease; nothing at ERROR.
    lines = capsys.readouterr().err.splitlines()
    reconnects = [line for line in lines if " reconnected " in line]
    assert len(reconnects) == 1, reconnects
    assert "[info" in reconnects[0] and f"lease_id={lease_id}" in reconnects[0], reconnects
    assert not [line for line in lines if "[error" in line], lines


async def test_the_scheduler_answers_a_ping_with_its_nonce(fleet: Fleet) -> None:
    """The worker's liveness check rests on this: Welcome says pings are answered, and each
    Ping comes back as a Pong with the same nonce, in the stream's order."""
    async with connect_worker(fleet.channel, fleet.token, "pinger") as worker:
        assert worker.welcome is not None and worker.welcome.answers_ping
        for nonce in (1, 2**63 + 5):
            await worker.send(ping=fpb.Ping(nonce=nonce))
            pong = await worker.expect("pong")
            assert pong.nonce == nonce


@pytest.mark.slow
async def test_a_replica_cut_off_from_postgres_loses_its_workers_not_their_leases(
    database_url: str, tmp_path: Path, cpu_qualification: QualificationResult
) -> None:
    """A partition between one replica and Postgres (the other reaches it): the cut-off
    replica's worker moves to the other one within the TTL and keeps its lease."""
    gate = PostgresGate(database_url)
    await gate.start()
    data_dir = shared_data_dir(tmp_path / "shared")
    store = LocalObjectStore(
        LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SHARED_STORAGE_SECRET.encode())
    )
    await store.put_bytes(upload_key("alice", PREFIX, "1.png"), png(1))
    ledger = await Ledger.connect(database_url, max_size=2)
    try:
        key = (await create_api_key(ledger, "alice")).key
    finally:
        await ledger.close()
    env = dict(
        LORAFLEET_WORKER_TOKEN=TOKEN,
        LORAFLEET_LEASE_TTL_S=str(TTL_S),
        LORAFLEET_HEARTBEAT_INTERVAL_S="1",
        LORAFLEET_SWEEP_INTERVAL_S="0.5",
    )
    try:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(
                scheduler_process(gate.url, data_dir, {**env, "LORAFLEET_SCHEDULER_ID": "a"})
            )
            b = await stack.enter_async_context(
                scheduler_process(database_url, data_dir, {**env, "LORAFLEET_SCHEDULER_ID": "b"})
            )
            balancer = TcpBalancer([a.port, b.port])
            await balancer.start()
            stack.push_async_callback(balancer.close)
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(f"127.0.0.1:{b.port}")
            )
            client = JobClient(pbgrpc.JobServiceStub(channel), key)
            agent = Agent(
                worker_config("w0", balancer.address, tmp_path),
                trainer_factory=simulated_trainer_factory(step_s=0.05, checkpoint_bytes=4096),
                qualification=cpu_qualification,
            )
            balancer.route_next_to(0)
            await stack.enter_async_context(running(agent))
            async with asyncio.timeout(60):
                await agent.wait_for_state(State.IDLE)
            assert agent.scheduler_id == "a"
            job = await client.submit(**LONG_JOB)
            async with asyncio.timeout(60):
                await agent.wait_for_state(State.LEASED)
            await training(client, job.job_id)
            _, lease_id, epoch = await lease_of(database_url, job.job_id)
            gate.down()
            async with asyncio.timeout(TTL_S):
                await agent.wait_until(lambda x: x.scheduler_id == "b" and x.state is State.LEASED)
            await asyncio.sleep(TTL_S)  # past a TTL with a cut off: b's sweeper sees every lease
            assert await lease_of(database_url, job.job_id) == ("RUNNING", lease_id, epoch)
            kinds = [kind for kind, _ in await job_events(database_url, job.job_id)]
            assert "LEASE_EXPIRED" not in kinds, kinds
    finally:
        await gate.close()
