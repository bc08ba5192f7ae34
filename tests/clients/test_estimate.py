"""A cost estimate before submitting (EstimateJob, `submit --estimate`) from the fleet's
measured seconds per step on jobs of the same shape, and a per-key spend limit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from lorafleet.app.main import main
from lorafleet.client import AsyncClient
from lorafleet.core.errors import FailedPrecondition
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.auth import create_api_key
from tests.clients.test_cli import lorafleet
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker

ESTIMATE = (
    "submit",
    "--estimate",
    "--instance-prompt",
    "a photo of sks dog",
    "--instance-data-prefix",
    "dogs/rex",
    "--json",
)


@pytest.fixture
def scheduler_overrides() -> dict[str, object]:
    return {"price_per_gpu_hour": 3.6}  # a tenth of a cent per GPU-second


async def _measured_job(fleet: Fleet) -> str:
    """One finished job (resolution 1024, batch 1) whose lease ran at 0.5 s/step."""
    job = await fleet.alice.submit(max_train_steps=40)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 20, loss=0.3, seconds_per_step=0.5)
        await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 20)
        await worker.store_result(granted, 40)
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    return job.job_id


async def test_estimate_uses_the_measured_pace_of_the_same_shape(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, *ESTIMATE, "--max-train-steps", "1000"
    )
    assert code == 0, err
    (before,) = json.loads(out)
    assert before["samples"] == 0 and before["seconds"] is None  # nothing measured yet

    job_id = await _measured_job(fleet)
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, *ESTIMATE, "--max-train-steps", "1000"
    )
    assert code == 0, err
    (estimate,) = json.loads(out)
    assert estimate["samples"] == 1 and estimate["seconds_per_step"] == pytest.approx(0.5)
    assert estimate["seconds"] == pytest.approx(500.0)
    assert estimate["price_per_gpu_hour"] == pytest.approx(3.6)
    assert estimate["dollars"] == pytest.approx(0.5)

    # Another shape has no measurement; the human form says so.
    code, out, _ = await lorafleet(
        capsys, monkeypatch, fleet, *ESTIMATE[:-1], "--max-train-steps", "10", "--resolution", "512"
    )
    assert code == 0 and "no estimate" in out
    # --estimate submitted nothing.
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "list", "--json")
    assert [j["job_id"] for j in json.loads(out)] == [job_id]

    # download --checkpoint latest of the finished job: a clear message, not "no ... yet".
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "download", job_id, "--checkpoint", "latest"
    )
    assert code == 1 and "checkpoints were deleted" in err and f"lorafleet download {job_id}" in err


async def test_a_submit_past_the_keys_spend_limit_is_refused(fleet: Fleet) -> None:
    await _measured_job(fleet)
    limited = await create_api_key(fleet.scheduler.ledger, "alice", spend_limit_dollars=0.3)
    target = f"127.0.0.1:{fleet.scheduler.port}"
    async with AsyncClient(target, api_key=limited.key) as client:
        spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.dollars == pytest.approx(0.5)
        assert estimate.spend_limit_dollars == pytest.approx(0.3)
        with pytest.raises(
            FailedPrecondition, match=r"spend limit.*\$0\.30.*this submit at \$0\.50"
        ):
            await client.submit(spec, max_train_steps=1000)
        job = await client.submit(spec, max_train_steps=400)  # $0.20: within the limit
        assert job.spec.max_train_steps == 400
        with pytest.raises(FailedPrecondition, match="spend limit"):
            # Nothing billed yet, but the queued 400 steps ($0.20) count: + 3 x $0.05 > $0.30.
            await client.submit_batch([{**spec, "max_train_steps": 100}] * 3)
        await client.submit_batch([{**spec, "max_train_steps": 100}] * 2)  # $0.30: just within


async def test_a_missing_api_key_and_a_scheduler_that_is_down_say_so(
    fleet: Fleet,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAFLEET_TARGET", f"127.0.0.1:{fleet.scheduler.port}")
    monkeypatch.delenv("LORAFLEET_API_KEY", raising=False)
    code = await asyncio.to_thread(main, ["list"])
    err = capsys.readouterr().err
    assert code == 1 and "no API key given" in err and "malformed" not in err

    monkeypatch.setenv("LORAFLEET_API_KEY", fleet.alice.api_key)
    monkeypatch.setenv("LORAFLEET_TARGET", "127.0.0.1:1")  # nothing listens on port 1
    code = await asyncio.to_thread(main, ["list"])
    err = capsys.readouterr().err
    assert code == 1 and "lorafleet up" in err and "127.0.0.1:1" in err
