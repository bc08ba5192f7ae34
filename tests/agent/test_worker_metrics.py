"""A worker process's metrics endpoint and liveness probe, scraped over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.fleet import WORKER_TOKEN, Fleet
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S

# Real workers training the tiny model (in this process or as processes): slow, not in
# the fast lane (README, Development).
pytestmark = pytest.mark.slow


class WorkerLog:
    """The worker's JSON log lines as they come; `wait_for` returns the first matching one."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[dict[str, object]] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            async with self._changed:
                self.lines.append(record)
                self._changed.notify_all()

    async def wait_for(self, event: str) -> dict[str, object]:
        def found() -> dict[str, object] | None:
            return next((r for r in self.lines if r.get("event") == event), None)

        async with asyncio.timeout(WAIT_S), self._changed:
            await self._changed.wait_for(lambda: found() is not None)
        record = found()
        assert record is not None
        return record

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http,
        http.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("scheduler_overrides", [{"heartbeat_interval_s": 0.3}])
async def test_worker_metrics_move_with_its_work_and_healthz_answers(fleet: Fleet) -> None:
    env = {
        **os.environ,
        "LORAFLEET_SCHEDULER": fleet.address,
        "LORAFLEET_WORKER_TOKEN": WORKER_TOKEN,
        "LORAFLEET_ALLOW_CPU": "1",
        "SALAD_MACHINE_ID": "metrics-w1",
        "LORAFLEET_SIMULATE_STEP_S": "0.05",
        # Stands for a GPU node: the jobs' memory estimates are not held to this host's memory.
        "LORAFLEET_VRAM_MB": "81920",
        "LORAFLEET_SIMULATE_CHECKPOINT_BYTES": "4096",
        "LORAFLEET_MIN_FREE_DISK_MB": "0",
        "LORAFLEET_MIN_FREE_MEMORY_MB": "0",
        "LORAFLEET_LOG_FORMAT": "json",
        "LORAFLEET_WORKER_METRICS_PORT": "0",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.worker",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert process.stderr is not None
    log = WorkerLog(process.stderr)
    try:
        served = await log.wait_for("metrics and /healthz served")
        port = int(served["port"])  # type: ignore[call-overload]
        status, body = await get(port, "/healthz")
        assert status == 200 and json.loads(body)["ok"] is True
        before = samples((await get(port, "/metrics"))[1])
        assert before[("lorafleet_worker_checkpoints_total", ())] == 0

        # Three seconds of steps after the first checkpoint: its upload finishes before the
        # result supersedes what is still pending, even on a busy machine.
        job = await fleet.client.submit(max_train_steps=60, checkpointing_steps=5)
        await fleet.client.wait_state(job.job_id, pb.JOB_STATE_SUCCEEDED)
        await log.wait_for("lease ended")
        after = samples((await get(port, "/metrics"))[1])
        assert after[("lorafleet_worker_leases_total", (("result", "succeeded"),))] == 1
        committed = after[("lorafleet_worker_checkpoints_total", ())]
        recorded = [
            e
            for e in await fleet.client.events(job.job_id)
            if e.kind == pb.JOB_EVENT_KIND_CHECKPOINT_COMMITTED
        ]
        assert committed == len(recorded) >= 1  # what the scheduler recorded, no more
        assert after[("lorafleet_worker_checkpoint_seconds_count", ())] == committed
        assert after[("lorafleet_worker_checkpoint_bytes_total", ())] >= committed * 4096
        assert after[("lorafleet_worker_step_seconds_count", ())] >= 1
        status, body = await get(port, "/healthz")
        assert status == 200 and json.loads(body)["machine_id"] == "metrics-w1"

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await log.close()
