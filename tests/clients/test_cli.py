"""The `lorafleet` command against a live scheduler: every job command, human and --json."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from lorafleet.app.main import main
from lorafleet.core.model import RESULT_FILE_NAMES
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as jpb
from tests.scheduler.test_ledger import in_good_standing
from tests.support.artifacts import kohya_blob, lora_blob
from tests.support.fleet import Fleet
from tests.support.images import jpeg
from tests.support.workers import connect_worker


async def lorafleet(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fleet: Fleet, *argv: str
) -> tuple[int, str, str]:
    monkeypatch.setenv("LORAFLEET_TARGET", f"127.0.0.1:{fleet.scheduler.port}")
    monkeypatch.setenv("LORAFLEET_API_KEY", fleet.alice.api_key)
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_cli_job_commands(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    photos = tmp_path / "rex"
    photos.mkdir()
    for i in range(2):
        (photos / f"{i}.jpg").write_bytes(jpeg(i))
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        yaml.safe_dump({"max_train_steps": 40, "lr_scheduler": "cosine", "labels": {"team": "a"}})
    )

    code, out, _ = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--images",
        str(photos),
        "--spec",
        str(spec_file),
        "--instance-prompt",
        "a photo of sks dog",
        "--learning-rate",
        "2e-4",
        "--random-flip",
        "--label",
        "batch=b1",
        "--json",
    )
    assert code == 0
    (job,) = json.loads(out)
    assert job["state"] == "QUEUED" and job["spec"]["learning_rate"] == 2e-4
    assert job["spec"]["random_flip"] is True and job["spec"]["lr_scheduler"] == "cosine"
    assert job["spec"]["labels"] == {"team": "a", "batch": "b1"}
    job_id = job["job_id"]

    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "list", "--label", "team=a")
    assert code == 0 and job_id in out and "QUEUED" in out
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "get", job_id)
    assert code == 0 and "step 0/40" in out
    # Billed node time, named as `report` names it: a CPU worker's seconds are no GPU's.
    assert "node time  0 s (billed)" in out and "gpu " not in out

    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 20, loss=0.3, seconds_per_step=0.5)
        lora = lora_blob()
        async with (
            aiohttp.ClientSession() as http,
            http.put(granted.urls.result_upload.url, data=lora),
        ):
            pass
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=worker.ref(granted.lease),
                key=granted.urls.result_upload.key,
                size_bytes=len(lora),
                sha256=hashlib.sha256(lora).hexdigest(),
                step=40,
            )
        )
        code, out, err = await lorafleet(capsys, monkeypatch, fleet, "watch", job_id)
    assert code == 0 and "succeeded" in err and "LEASE_GRANTED" in err

    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "events", job_id, "--json")
    kinds = [e["kind"] for e in json.loads(out)]
    assert kinds[0] == "SUBMITTED" and "HEARTBEAT" in kinds and kinds[-1] == "SUCCEEDED"
    target = tmp_path / "out" / "rex.safetensors"
    target.parent.mkdir()
    code, out, _ = await lorafleet(
        capsys, monkeypatch, fleet, "download", job_id, "-o", str(target)
    )
    assert code == 0 and target.read_bytes() == lora

    picture = tmp_path / "timeline.html"
    code, out, _ = await lorafleet(
        capsys, monkeypatch, fleet, "timeline", job_id, "-o", str(picture)
    )
    assert code == 0 and "<svg" in picture.read_text() and "m1" in picture.read_text()
    code, out, _ = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "report",
        "--label",
        "team=a",
        "--price-per-gpu-hour",
        "1.5",
        "--json",
    )
    assert code == 0 and job_id in out


async def test_cli_batch_cancel_and_errors(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = tmp_path / "batch.json"
    batch.write_text(
        json.dumps(
            [
                {
                    "instance_prompt": f"a photo of sks dog {i}",
                    "instance_data_prefix": "dogs/rex",
                    "max_train_steps": 10,
                }
                for i in range(3)
            ]
        )
    )
    code, out, _ = await lorafleet(
        capsys, monkeypatch, fleet, "submit", "--batch", str(batch), "--json"
    )
    assert code == 0
    ids = [j["job_id"] for j in json.loads(out)]
    assert len(ids) == 3
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "cancel", ids[0])
    assert code == 0 and "canceled" in out
    code, _, err = await lorafleet(capsys, monkeypatch, fleet, "watch", ids[0])
    assert code == 1 and "canceled" in err

    # Errors are one clear line and a non-zero exit; an invalid batch writes nothing.
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            [
                {
                    "instance_prompt": "ok",
                    "instance_data_prefix": "dogs/rex",
                    "max_train_steps": 10,
                },
                {
                    "instance_prompt": "bad",
                    "instance_data_prefix": "dogs/rex",
                    "max_train_steps": 10,
                    "resolution": 100,
                },
            ]
        )
    )
    code, _, err = await lorafleet(capsys, monkeypatch, fleet, "submit", "--batch", str(bad))
    assert code == 1 and any(
        line.startswith("error: batch[1].resolution") for line in err.splitlines()
    )
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "list", "--json")
    assert len(json.loads(out)) == 3
    code, _, err = await lorafleet(capsys, monkeypatch, fleet, "get", "not-a-job")
    assert code == 1 and "job_id" in err
    code, _, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--instance-prompt",
        "x",
        "--instance-data-prefix",
        "dogs/rex",
    )
    assert code == 1 and "max_train_steps" in err


async def test_cli_keys_admin(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = fleet.scheduler.database_url
    code, out, err = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "keys",
        "--database-url",
        url,
        "create",
        "carol",
        "--webhook-url",
        "https://example.test/hook",
    )
    assert code == 0 and out.startswith("lf_") and "webhook secret:" in err
    carol_key = out.strip()
    key_id = carol_key.split("_")[1]
    code, out, _ = await lorafleet(
        capsys, monkeypatch, fleet, "keys", "--database-url", url, "list"
    )
    assert code == 0 and f"{key_id}  carol" in out
    monkeypatch.setenv("LORAFLEET_API_KEY", carol_key)
    code = await asyncio.to_thread(main, ["list"])
    assert code == 0
    code, _, _ = await lorafleet(
        capsys, monkeypatch, fleet, "keys", "--database-url", url, "revoke", key_id
    )
    assert code == 0
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "keys", "--database-url", url, "create", "Bad Owner"
    )
    assert code == 1 and err.startswith("error: owner")


async def test_the_webhooks_command_shows_the_delivery_log(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is in the README's CLI table; it used to answer "invalid choice"."""
    job = await fleet.alice.submit(webhook={"url": "https://hooks.example/lorafleet"})
    code, out, err = await lorafleet(capsys, monkeypatch, fleet, "webhooks", job.job_id)
    assert code == 0, err
    code, out, err = await lorafleet(capsys, monkeypatch, fleet, "webhooks", "--json", job.job_id)
    assert code == 0, err
    assert isinstance(json.loads(out), list)


async def test_a_closed_pipe_ends_the_command_quietly(fleet: Fleet, tmp_path: Path) -> None:
    """`lorafleet list | head`: no BrokenPipeError traceback when the reader has gone."""
    for _ in range(3):
        await fleet.alice.submit()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    env = dict(
        os.environ,
        LORAFLEET_TARGET=f"127.0.0.1:{fleet.scheduler.port}",
        LORAFLEET_API_KEY=fleet.alice.api_key,
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "list",
        stdout=write_end,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    os.close(write_end)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert "Traceback" not in err.decode() and "BrokenPipeError" not in err.decode(), err
    assert proc.returncode == 141


async def test_cli_downloads_either_result_file_of_a_both_formats_job(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, _ = await lorafleet(
        capsys,
        monkeypatch,
        fleet,
        "submit",
        "--instance-prompt=a photo of sks dog",
        "--instance-data-prefix=dogs/rex",
        "--max-train-steps=10",
        "--output-format=both",
        "--json",
    )
    assert code == 0
    (job,) = json.loads(out)
    assert job["spec"]["output_format"] == "both"
    files = {"diffusers": lora_blob(1), "kohya": kohya_blob(2)}
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        urls = granted.urls
        async with aiohttp.ClientSession() as http:
            for url, data in (
                (urls.result_upload.url, files["diffusers"]),
                (urls.kohya_result_upload.url, files["kohya"]),
            ):
                async with http.put(url, data=data) as response:
                    assert response.status in (200, 201, 204)
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=worker.ref(granted.lease),
                key=urls.result_upload.key,
                size_bytes=len(files["diffusers"]),
                sha256=hashlib.sha256(files["diffusers"]).hexdigest(),
                step=10,
                kohya=jpb.JobResult(
                    key=urls.kohya_result_upload.key,
                    size_bytes=len(files["kohya"]),
                    sha256=hashlib.sha256(files["kohya"]).hexdigest(),
                ),
            )
        )
        code, _, _ = await lorafleet(capsys, monkeypatch, fleet, "watch", job["job_id"])
    assert code == 0
    monkeypatch.chdir(tmp_path)
    for fmt, data in files.items():
        code, out, _ = await lorafleet(
            capsys, monkeypatch, fleet, "download", job["job_id"], "--format", fmt
        )
        assert code == 0
        path = Path(out.strip().splitlines()[-1])
        assert path.name == RESULT_FILE_NAMES[fmt]
        assert await asyncio.to_thread(path.read_bytes) == data
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "get", job["job_id"], "--json")
    assert json.loads(out)["result"]["kohya"]["key"] == urls.kohya_result_upload.key


async def test_get_and_watch_say_why_a_queued_job_waits(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: a job one SaladCloud machine called bad input waits QUEUED for a second
    machine's word, with no error; `get` and `watch` now say so."""
    job = await fleet.alice.submit(max_failures=5)
    async with connect_worker(fleet.channel, fleet.token, "a") as worker:
        await in_good_standing(fleet.scheduler.database_url, "a")
        granted = await worker.ready_for_lease()
        await worker.send(
            job_failed=fpb.JobFailed(
                lease=worker.ref(granted.lease),
                failure_class=jpb.FAILURE_CLASS_INPUT,
                message="x.png: unreadable",
            )
        )
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == jpb.JOB_STATE_QUEUED)
    reason = (
        "attempt 1 failed (input fault: x.png: unreadable); waiting for a second machine to"
        " confirm it before the job fails"
    )
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "get", job.job_id)
    assert code == 0 and f"waiting    {reason}" in out
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "get", job.job_id, "--json")
    # Then what machines it waits for: a, banned from it, has gone.
    said = json.loads(out)["waiting_reason"]
    assert code == 0 and said.startswith(reason + "; no connected machine can run it"), said

    # The watch has read the queued job once the scheduler starts following it for the watch
    # (observed, not replaced): only then is the job canceled, so the watch sees it queued.
    notifications = fleet.scheduler._notifications
    assert notifications is not None
    following = asyncio.Event()
    follow = notifications.watch_job

    def observed(job_id: str) -> asyncio.Event:
        following.set()
        return follow(job_id)

    monkeypatch.setattr(notifications, "watch_job", observed)
    watching = asyncio.create_task(lorafleet(capsys, monkeypatch, fleet, "watch", job.job_id))
    async with asyncio.timeout(30):
        await following.wait()
    await fleet.alice.cancel(job.job_id)
    async with asyncio.timeout(30):
        code, _, err = await watching
    assert code == 1 and f"queued: {reason}" in " ".join(err.split())
