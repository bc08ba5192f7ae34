"""A FLUX.1 and a FLUX.2 [klein] job through the whole product on `lorafleet up`, as a user runs
it: real `up` processes (embedded Postgres, local store, the scaler's worker processes) training
the family's tiny model; the CLI and the SDK against them.

One test per family, because what breaks for one family (the sample task's pipeline, the result
a pipeline loads, the shape keys of estimates and reports) does not break for the other."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from PIL import Image

from lorafleet.app.main import main
from lorafleet.client import AsyncClient
from lorafleet.core.model import EventKind, JobState
from tests.clients.test_local import fleet_up

# Real worker processes training and sampling the tiny models: slow (README, Development).
pytestmark = [
    pytest.mark.slow,
    # diffusers' schedulers hand torch tensors to numpy without numpy 2's `copy` keyword.
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
]

PIPELINES = {"flux": "FluxPipeline", "flux2": "Flux2KleinPipeline"}
# Steps between checkpoints, and the step of the one sample task before the result's: with one
# worker, sample tasks run once training is done, so two tasks keep the test short.
CHECKPOINT_EVERY = 5
VALIDATION_STEP = 40
# Enough steps after the first checkpoint that Ctrl-C lands before the job ends, on a loaded
# machine too (the drain came 5 steps after the checkpoint the test saw there).
STEPS = 80


@pytest.fixture
def tmp_path(public_tmp_path: Path) -> Path:
    """`up`'s data directory holds an embedded Postgres (tests/clients/test_local.py says why)."""
    return public_tmp_path


@pytest.fixture
async def hooks() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A webhook receiver on loopback (`up` lets webhooks reach loopback): its URL and the JSON
    bodies it got."""
    bodies: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        bodies.append(json.loads(await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/hook", bodies
    await runner.cleanup()


async def cli(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    data_dir: Path,
    target: str,
    *argv: str,
) -> str:
    """One `lorafleet` command as a user types it after `up` printed where it is (in this
    process: a fresh interpreter's imports cost seconds a command); its stdout, and it must
    succeed."""
    monkeypatch.setenv("LORAFLEET_TARGET", target)
    monkeypatch.setenv("LORAFLEET_API_KEY", (data_dir / "api-key").read_text().strip())
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    assert code == 0, (argv, err[-2000:])
    return out


@pytest.mark.parametrize("family", ["flux", "flux2"])
@pytest.mark.timeout(600)
async def test_a_family_job_goes_through_up(
    family: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    hooks: tuple[str, list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`lorafleet submit --images --spec` -> a checkpoint -> Ctrl-C drains -> the next `up`
    resumes -> validation images of a checkpoint and of the result (`lorafleet samples`) ->
    the result in both formats (`lorafleet download --format`), which the family's pipeline
    loads -> webhooks -> `lorafleet report` and the estimate of the family's shape."""
    from lorafleet.app.local import _sample_images

    model: Path = request.getfixturevalue(f"tiny_{family}_dir")
    hook_url, bodies = hooks
    data_dir = tmp_path / "data"
    images = await asyncio.to_thread(_sample_images, tmp_path / "images", 64)
    spec: dict[str, Any] = {
        "instance_prompt": "a photo of sks dog",
        "model_family": family,
        "base_model": str(model),
        "resolution": 64,
        "max_train_steps": STEPS,
        "checkpointing_steps": CHECKPOINT_EVERY,
        "learning_rate": 1e-3,
        "output_format": "both",
        "validation_prompt": "a photo of sks dog on a beach",
        "validation_steps": VALIDATION_STEP,
        "validation_inference_steps": 2,
        "num_validation_images": 1,
        # As the options table names it (a --spec file refused it once).
        "webhook_url": hook_url,
        "labels": {"family": family},
    }
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    run = functools.partial(cli, capsys, monkeypatch, data_dir)
    async with fleet_up(data_dir) as target:
        api_key = (data_dir / "api-key").read_text().strip()
        submitted = await run(
            target, "submit", "--images", str(images), "--spec", str(spec_file), "--json"
        )
        job_id = json.loads(submitted)[0]["job_id"]
        async with AsyncClient(target, api_key=api_key) as client:
            assert (await client.get(job_id)).spec.model_family == family
            async for update in client.watch(job_id):
                if update.event and update.event.kind is EventKind.CHECKPOINT_COMMITTED:
                    break
    # Leaving the block sent `up` a SIGINT, as Ctrl-C does: its worker checkpointed and drained.
    async with fleet_up(data_dir) as target:
        async with AsyncClient(target, api_key=api_key) as client:
            interrupted = await client.get(job_id)
            assert interrupted.latest_checkpoint is not None
            final = None
            # The watch ends once the job and its sample tasks are done (README).
            async for update in client.watch(job_id):
                final = update.job
            assert final is not None and final.state is JobState.SUCCEEDED, final
            timeline = await client.events(job_id)
            estimate = await client.estimate({**spec, "instance_data_prefix": "rex"})
        out = tmp_path / "out"
        await run(target, "samples", job_id, "-o", str(out / "samples"))
        for fmt in ("diffusers", "kohya"):
            await run(
                target, "download", job_id, "--format", fmt, "-o", str(out / f"{fmt}.safetensors")
            )
        report = json.loads(await run(target, "report", "--label", f"family={family}", "--json"))

    kinds = [e.kind for e in timeline]
    assert EventKind.DRAINED in kinds
    assert [e.epoch for e in timeline if e.kind is EventKind.LEASE_GRANTED] == [1, 2]
    # The validation images of the first checkpoint committed at or after VALIDATION_STEP (40,
    # unless a loaded machine's drain checkpointed at 41 while 40's upload was replaced; none
    # where every upload from 40 on was replaced by the next, as two suites side by side on two
    # cores once made it) and of the result, made by the family's own pipeline on the fleet:
    # PNGs of the training resolution.
    committed = [e.step for e in timeline if e.kind is EventKind.CHECKPOINT_COMMITTED]
    sampled = sorted(s for s in committed if s is not None and VALIDATION_STEP <= s < STEPS)[:1]
    steps = sorted(out.joinpath("samples").iterdir())
    expected = [f"step-{step:06d}" for step in (*sampled, STEPS)]
    assert [d.name for d in steps] == expected, committed
    for step in steps:
        [png] = step.iterdir()
        with Image.open(png) as image:
            assert image.size == (64, 64)
    # Webhooks: every kind of event the job had reached the receiver.
    delivered = {body["event"] for body in bodies if body.get("job_id") == job_id}
    assert {"job.checkpoint", "job.succeeded", "job.samples"} <= delivered, delivered
    # The report counts the job under its label, interrupted once; the estimate answers for the
    # family's shape (unknown: one local machine is fewer than the fleet's minimum).
    assert report["jobs"] == 1 and report["states"]["succeeded"] == 1
    assert report["interrupted_jobs"] == 1
    assert estimate.samples < 3

    def load(fmt: str) -> int:
        """Loads one downloaded file into the family's pipeline; the layers it adapted."""
        import importlib

        diffusers: Any = importlib.import_module("diffusers")
        pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(model)
        pipe.load_lora_weights(str(out), weight_name=f"{fmt}.safetensors")
        return sum(1 for n, _ in pipe.transformer.named_parameters() if "lora_A" in n)

    assert await asyncio.to_thread(load, "diffusers") > 0
    if family == "flux2":
        assert await asyncio.to_thread(load, "kohya") > 0
    else:
        # diffusers reads FLUX.1's kohya layout only at FLUX.1-dev's full size; the trainer's
        # tests check the tiny FLUX.1 kohya file by ComfyUI's rule (tests/worker/test_families.py).
        assert (out / "kohya.safetensors").stat().st_size > 0
