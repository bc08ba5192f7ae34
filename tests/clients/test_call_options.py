"""The SDK's call options (issues 31 and 32): calls wait for a scheduler that is restarting,
move on from a replica that froze behind a load balancer, and a watch says what it waits for."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from lorafleet.client import AsyncClient
from lorafleet.core.model import JobState, upload_key
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.server import Scheduler
from lorafleet.scheduler.storage import LocalObjectStore, LocalStoreConfig
from tests.support.fleet import scheduler_config
from tests.support.jobs import PREFIX, SCRIPTED_SPEC, WAIT_S
from tests.support.replicas import (
    SHARED_STORAGE_SECRET,
    TcpBalancer,
    scheduler_process,
    shared_data_dir,
)


async def test_a_call_made_while_the_scheduler_restarts_waits_for_it(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 32, item 8: `cancel` (any unary call) while the scheduler is down and coming
    back waits for it (bounded by ready_wait_s) instead of failing at once."""
    config = scheduler_config(database_url, tmp_path / "data")
    async with Scheduler(config) as first:
        port = first.port
        await first.storage.put_bytes(upload_key("alice", PREFIX, "1.png"), b"png")
        api_key = (await create_api_key(first.ledger, "alice")).key
        client = AsyncClient(f"127.0.0.1:{port}", api_key=api_key, ready_wait_s=30.0)
        job = await client.submit(**SCRIPTED_SPEC)
    try:
        # Made while nothing listens on the port; the scheduler comes back meanwhile.
        cancel = asyncio.create_task(client.cancel(job.job_id))
        async with Scheduler(
            scheduler_config(database_url, tmp_path / "data", listen=f"127.0.0.1:{port}")
        ):
            canceled = await asyncio.wait_for(cancel, 60)
            assert canceled.state is JobState.CANCELED
    finally:
        await client.close()


@pytest.mark.slow
async def test_calls_through_a_load_balancer_move_on_from_a_frozen_replica(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 31: get, list, cancel and watch through a load balancer whose first pick is a
    frozen replica (its kernel accepts the connection; nothing answers) all go through, each
    within a few attempt timeouts; a watch that was on the replica when it froze moves on."""
    data_dir = shared_data_dir(tmp_path / "shared")
    store = LocalObjectStore(
        LocalStoreConfig(root_dir=data_dir / "objects", secret_key=SHARED_STORAGE_SECRET.encode())
    )
    await store.put_bytes(upload_key("alice", PREFIX, "1.png"), b"png")
    ledger = await Ledger.connect(database_url, max_size=2)
    try:
        key = (await create_api_key(ledger, "alice")).key
    finally:
        await ledger.close()
    env = dict(LORAFLEET_WORKER_TOKEN="t", LORAFLEET_WATCH_KEEPALIVE_S="1")
    async with (
        scheduler_process(database_url, data_dir, env) as a,
        scheduler_process(database_url, data_dir, env) as b,
    ):
        balancer = TcpBalancer([a.port, b.port])
        await balancer.start()
        options = dict(api_key=key, attempt_timeout_s=2.0, ready_wait_s=2.0, watch_silence_s=3.0)
        direct = AsyncClient(f"127.0.0.1:{b.port}", api_key=key)
        watcher = AsyncClient(balancer.address, **options)  # type: ignore[arg-type]
        try:
            job = await direct.submit(**SCRIPTED_SPEC)
            other = await direct.submit(**SCRIPTED_SPEC)
            # A watch on replica a, which then freezes.
            balancer.route_next_to(0)
            updates: asyncio.Queue[JobState] = asyncio.Queue()

            async def watch() -> None:
                async for update in watcher.watch(job.job_id):
                    updates.put_nowait(update.job.state)

            watching = asyncio.create_task(watch())
            assert await asyncio.wait_for(updates.get(), WAIT_S) is JobState.QUEUED
            a.freeze()
            loop = asyncio.get_running_loop()
            for call in ("get", "list", "cancel"):
                balancer.route_next_to(0)  # every call's first connection: the frozen one
                client = AsyncClient(balancer.address, **options)  # type: ignore[arg-type]
                started = loop.time()
                try:
                    if call == "get":
                        assert (await client.get(other.job_id)).job_id == other.job_id
                    elif call == "list":
                        assert other.job_id in [j.job_id async for j in client.list()]
                    else:
                        assert (await client.cancel(other.job_id)).state is JobState.CANCELED
                finally:
                    await client.close()
                assert loop.time() - started < 15.0, call
            # The watch hears of a cancel made through replica b within its silence bound.
            await direct.cancel(job.job_id)
            async with asyncio.timeout(30):
                while (state := await updates.get()) is not JobState.CANCELED:
                    assert state is JobState.QUEUED
            await asyncio.wait_for(watching, WAIT_S)
            a.thaw()
        finally:
            await watcher.close()
            await direct.close()
            await balancer.close()


async def test_watch_says_what_it_waits_for_while_no_scheduler_answers(tmp_path: Path) -> None:
    """Issue 32, item 5: `lorafleet watch JOB` with the scheduler down says, on stderr and
    within a few seconds, that it is waiting and for what."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "watch",
        "0b3c8a52-2c1e-4f6e-9d57-1d4f3c0b9a10",
        env=dict(os.environ, LORAFLEET_TARGET=f"127.0.0.1:{port}", LORAFLEET_API_KEY="k"),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen = ""
    try:
        async with asyncio.timeout(30):
            while "waiting for the scheduler" not in seen:
                line = await proc.stderr.readline()
                assert line, f"watch exited without saying it waits: {seen}"
                seen += line.decode(errors="replace")
    finally:
        proc.kill()
        await proc.wait()
    assert f"127.0.0.1:{port}" in seen, seen
