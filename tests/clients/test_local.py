"""`lorafleet demo` and `lorafleet up` as a user runs them: real processes, embedded Postgres."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from lorafleet.client import AsyncClient
from lorafleet.core.model import EventKind, JobState

pytestmark = pytest.mark.slow


@pytest.fixture
def tmp_path(public_tmp_path: Path) -> Path:
    """These tests' data directories hold an embedded Postgres: outside pytest's private tree
    (tests/support/fixtures.py, public_tmp_path, says why)."""
    return public_tmp_path


def _env(data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)  # the embedded default, as on a fresh machine
    env.pop("LORAFLEET_API_KEY", None)
    env["LORAFLEET_DATA_DIR"] = str(data_dir)
    return env


# diffusers' scheduler hands torch tensors to numpy without the `copy` keyword numpy 2 asks for.
@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
async def test_demo_trains_a_lora_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "lora"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "demo",
        "--data-dir",
        str(tmp_path / "data"),
        "--output",
        str(out),
        "--steps",
        "12",
        env=_env(tmp_path / "data"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 600)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    assert "load_lora_weights" in stdout.decode()
    # Issue 32: the demo's output is its own (progress, the job's events), not a log line of
    # its embedded scheduler (a worker's notice was one) nor transformers' chatter while the
    # tiny model is built (a torchvision fallback note, a progress bar per saved shard).
    said = stderr.decode()
    for noise in ("[warning", "worker notice", "requires torchvision", "Writing model shards"):
        assert noise not in said, said[-3000:]
    weights = out / "pytorch_lora_weights.safetensors"
    assert weights.stat().st_size > 0

    def load() -> int:
        import importlib

        import torch

        # diffusers is untyped: one Any-typed handle keeps the rest of the test checked.
        diffusers: Any = importlib.import_module("diffusers")
        pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(
            tmp_path / "data" / "demo-model-sdxl"
        )
        pipe.load_lora_weights(str(out))
        adapters = pipe.get_list_adapters()
        image = pipe(
            "a photo of sks dog",
            num_inference_steps=2,
            height=64,
            width=64,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images[0]
        assert image.shape == (64, 64, 3)
        return sum(len(v) for v in adapters.values())

    assert await asyncio.to_thread(load) > 0


@asynccontextmanager
async def fleet_up(data_dir: Path) -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "up",
        "--data-dir",
        str(data_dir),
        "--listen",
        "127.0.0.1:0",
        env=_env(data_dir),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    target = ""
    said: list[str] = []
    async with asyncio.timeout(120):
        while not target:
            line = (await proc.stderr.readline()).decode()
            assert line, "up exited early:\n" + "".join(said[-40:])
            said.append(line)
            if match := re.search(r"lorafleet is up on (\S+)", line):
                target = match.group(1)
    drain = asyncio.create_task(proc.stderr.read())
    try:
        yield target
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        async with asyncio.timeout(180):
            code = await proc.wait()
        log = (await drain).decode()
        assert code == 0, log[-3000:]


async def test_up_restarted_mid_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    from lorafleet.app.local import _sample_images
    from lorafleet.worker.tiny_model import build_tiny_model

    data_dir = tmp_path / "data"
    model = await asyncio.to_thread(build_tiny_model, tmp_path / "model")
    images = await asyncio.to_thread(_sample_images, tmp_path / "images", 64)
    spec = {
        "instance_prompt": "a photo of sks dog",
        "instance_data_prefix": "rex",
        "max_train_steps": 150,
        "checkpointing_steps": 5,
        "resolution": 64,
        "base_model": str(model),
        "learning_rate": 1e-3,
    }
    async with fleet_up(data_dir) as target:
        api_key = (data_dir / "api-key").read_text().strip()
        async with AsyncClient(target, api_key=api_key) as client:
            await client.upload_dir(images, prefix="rex")
            job = await client.submit(spec)
            async for update in client.watch(job.job_id):
                if update.event and update.event.kind is EventKind.CHECKPOINT_COMMITTED:
                    break
    # Ctrl-C drained the worker: its job is queued again with a checkpoint, not lost.
    async with (
        fleet_up(data_dir) as target,
        AsyncClient(target, api_key=api_key) as client,
    ):
        interrupted = await client.get(job.job_id)
        assert interrupted.latest_checkpoint is not None
        resumed_from = interrupted.latest_checkpoint.step
        final = None
        async for update in client.watch(job.job_id):
            final = update.job
        assert final is not None and final.state is JobState.SUCCEEDED, final
        timeline = await client.events(job.job_id)
    kinds = [e.kind for e in timeline]
    assert EventKind.DRAINED in kinds
    grants = [e for e in timeline if e.kind is EventKind.LEASE_GRANTED]
    assert [g.epoch for g in grants] == [1, 2]
    second_attempt_checkpoints = [
        e.step
        for e in timeline
        if e.kind is EventKind.CHECKPOINT_COMMITTED and e.epoch == 2 and e.step
    ]
    # The second attempt continued from the checkpoint: one that had started over would have
    # committed step 5 again first.
    assert second_attempt_checkpoints and min(second_attempt_checkpoints) > resumed_from
