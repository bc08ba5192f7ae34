"""What the fleet benchmarks (fleet.py, bench_samples.py) share: a database of their own on
the Postgres server, the tiny model's inputs, and real worker processes on this machine."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg

from lorafleet.core.model import upload_key
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.server import Scheduler

TOKEN = "bench-worker-token"
OWNER = "bench"
PREFIX = "dogs"
DEFAULT_DATABASE_URL = os.environ.get(
    "LORAFLEET_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def png(seed: int) -> bytes:
    """A 64 px RGB image of seeded noise: an instance image for the tiny model."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    array = rng.integers(0, 255, size=(64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array, "RGB").save(out, format="PNG")
    return out.getvalue()


@asynccontextmanager
async def scratch_database(server_url: str, prefix: str) -> AsyncIterator[str]:
    """A fresh database on the server of `server_url` (its URL), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield server_url.rsplit("/", 1)[0] + f"/{name}"
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def owner_with_images(scheduler: Scheduler, count: int = 3) -> tuple[tuple[str, str], ...]:
    """Stores `count` instance images under the bench owner's `dogs` prefix and makes the
    owner a key: the call metadata its client sends."""
    for i in range(count):
        await scheduler.storage.put_bytes(upload_key(OWNER, PREFIX, f"{i}.png"), png(i))
    key = (await create_api_key(scheduler.ledger, OWNER)).key
    return (("authorization", f"Bearer {key}"),)


def worker_env(scheduler: Scheduler, model: Path, **extra: str) -> dict[str, str]:
    """The environment of a CPU worker on the tiny model at `model`, one thread."""
    return {
        **os.environ,
        "LORAFLEET_SCHEDULER": f"127.0.0.1:{scheduler.port}",
        "LORAFLEET_WORKER_TOKEN": TOKEN,
        "LORAFLEET_ALLOW_CPU": "1",
        "LORAFLEET_MODEL_PATH": str(model),
        "LORAFLEET_LOCAL_FILES_ONLY": "1",
        "LORAFLEET_DEVICE": "cpu",
        "LORAFLEET_MIN_FREE_DISK_MB": "0",
        "LORAFLEET_MIN_FREE_MEMORY_MB": "0",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


async def start_workers(
    env: dict[str, str],
    machine_ids: Sequence[str],
    *,
    argv: Sequence[str] = ("-m", "lorafleet.worker"),
    logs: Sequence[Path] | None = None,
) -> list[asyncio.subprocess.Process]:
    """One worker process per machine id (`python <argv>`), stderr to its log or nowhere."""
    processes: list[asyncio.subprocess.Process] = []
    try:
        for n, machine_id in enumerate(machine_ids):
            stderr: int | io.BufferedWriter = asyncio.subprocess.DEVNULL
            if logs is not None:
                stderr = logs[n].open("wb")
            try:
                processes.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        *argv,
                        env={**env, "SALAD_MACHINE_ID": machine_id},
                        stdout=asyncio.subprocess.DEVNULL,
                        stderr=stderr,
                    )
                )
            finally:
                if not isinstance(stderr, int):
                    stderr.close()  # the child holds its own copy
    except BaseException:
        await stop_workers(processes)
        raise
    return processes


async def stop_workers(
    processes: Sequence[asyncio.subprocess.Process], timeout_s: float = 120.0
) -> None:
    """SIGTERM (a worker drains: it ends its lease and logs it), then waits for each."""
    for process in processes:
        if process.returncode is None:
            process.terminate()
    for process in processes:
        await asyncio.wait_for(process.wait(), timeout=timeout_s)
