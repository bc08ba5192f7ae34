"""`lorafleet up` and `lorafleet demo`: a whole fleet on one machine.

`up` runs the scheduler (embedded Postgres and a local object store in the data directory) and
the scaler with the local provider: it starts with no worker, grows to one worker process per
GPU (or one CPU worker; `--workers` caps it) when work arrives, and goes back to zero after the
idle grace (`LORAFLEET_IDLE_GRACE_S`, as for `lorafleet scaler`). Ctrl-C stops the scaler, drains
the workers (they checkpoint) and stops everything. Running `up` again picks queued and
interrupted jobs up where their last checkpoint left them.

`demo` builds a tiny SDXL-architecture model and a few sample images when no real base model is
given, starts such a fleet (or uses a running one with --target), trains a LoRA with a live
progress bar, writes it, and prints how to load it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from lorafleet.cli.commands import watch
from lorafleet.client import AsyncClient
from lorafleet.core.families import DEFAULT_FAMILY, FAMILIES, PIPELINES, FamilyName
from lorafleet.core.settings import load
from lorafleet.ledger.ledger import Ledger
from lorafleet.scaler.config import ScalerSettings
from lorafleet.scaler.local import LocalProcessProvider, detect_gpus
from lorafleet.scaler.service import Scaler
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler
from lorafleet.worker.qualify import total_host_memory_mb

API_KEY_FILE = "api-key"
LOCAL_OWNER = "local"


@dataclass(frozen=True, kw_only=True)
class LocalFleet:
    target: str
    api_key: str
    data_dir: Path
    # Tells the workers, when the fleet stops, that the operator interrupted it (Ctrl-C).
    interrupted: Callable[[], None] = lambda: None


async def ensure_local_api_key(ledger: Ledger, data_dir: Path) -> str:
    """The key `up` keeps in <data dir>/api-key (0600) so local commands need no setup."""
    path = data_dir / API_KEY_FILE
    if path.exists():
        return path.read_text().strip()
    created = await create_api_key(ledger, LOCAL_OWNER)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(created.key + "\n")
    return created.key


def worker_bounds(gpus: int, *, max_workers: int | None, min_workers: int) -> tuple[int, int]:
    """(min, max) local workers: at most one per GPU (the provider pins one to each), or the
    asked number of CPU workers (default 1); the minimum never above the maximum."""
    most = max_workers if max_workers is not None else max(1, gpus)
    if gpus:
        most = min(most, gpus)
    most = max(most, 1)
    return min(max(min_workers, 0), most), most


def local_node_memory_mb(gpus: int) -> int:
    """The memory this machine's local workers announce (the largest GPU's, asked of
    `nvidia-smi`; without a GPU the host's, as a CPU worker says), in MiB; 0 if unknown.

    It is the largest node `lorafleet up` runs: a job needing more is refused at submit, and a
    job that ran out of memory here is not sent to look for a larger node that never comes."""
    if not gpus:
        return total_host_memory_mb()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    sizes = [int(line) for line in listed.stdout.split() if line.strip().isdigit()]
    return max(sizes) if listed.returncode == 0 and sizes else 0


@asynccontextmanager
async def local_fleet(
    data_dir: Path,
    *,
    listen: str,
    max_workers: int | None,
    worker_env: dict[str, str],
    min_workers: int = 0,
) -> AsyncIterator[LocalFleet]:
    """The scheduler, and a scaler growing local workers between `min_workers` and
    `max_workers` (default one per GPU, or one CPU worker) as work comes and goes."""
    # One machine: its user is the operator, and a webhook receiver beside the fleet listens on
    # loopback. A LORAFLEET_WEBHOOK_ALLOWED_NETWORKS the user set still wins.
    gpus = detect_gpus()
    config = load(
        SchedulerConfig,
        data_dir=data_dir,
        listen=listen,
        webhook_allowed_networks=os.environ.get("LORAFLEET_WEBHOOK_ALLOWED_NETWORKS")
        or "127.0.0.0/8,::1/128",
        # The fleet's largest node is this machine (a LORAFLEET_FLEET_MAX_VRAM_MB set wins).
        fleet_max_vram_mb=None
        if "LORAFLEET_FLEET_MAX_VRAM_MB" in os.environ
        else local_node_memory_mb(gpus),
        # Without a GPU the local workers are CPU workers (a LORAFLEET_FLEET_ACCELERATOR set wins).
        fleet_accelerator=None
        if "LORAFLEET_FLEET_ACCELERATOR" in os.environ
        else ("cuda" if gpus else "cpu"),
    )
    async with Scheduler(config) as scheduler:
        api_key = await ensure_local_api_key(scheduler.ledger, data_dir)
        provider = LocalProcessProvider(
            scheduler_address=f"127.0.0.1:{scheduler.port}",
            worker_token=scheduler.worker_token,
            identity_secret=scheduler.identity_secret,
            log_dir=data_dir / "logs",
            gpus=gpus,
            extra_env=worker_env,
        )
        least, most = worker_bounds(gpus, max_workers=max_workers, min_workers=min_workers)
        settings = load(
            ScalerSettings,
            provider="local",
            data_dir=data_dir,
            min_replicas=least,
            max_replicas=most,
        )
        scaler = Scaler(
            ledger=scheduler.ledger,
            database_url=scheduler.database_url,
            provider=provider,
            policy=settings.policy_config(),
            tick_interval_s=settings.tick_interval_s,
            scaler_id=settings.scaler_id or f"up-{os.uname().nodename}",
        )
        running = asyncio.create_task(scaler.run(), name="scaler")
        try:
            yield LocalFleet(
                target=f"127.0.0.1:{scheduler.port}",
                api_key=api_key,
                data_dir=data_dir,
                interrupted=provider.interrupted,
            )
        finally:
            # The scaler first (it must not start workers again), then the workers: they
            # checkpoint and drain while the scheduler still listens.
            await scaler.close()
            if running.done() and not running.cancelled() and (error := running.exception()):
                print(f"the scaler had stopped: {error}", file=sys.stderr)
            await provider.stop(timeout_s=60)


def add_local_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run a whole fleet here: scheduler, Postgres, storage, workers")
    p.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("LORAFLEET_DATA_DIR", ".lorafleet"))
    )
    p.add_argument("--listen", default=os.environ.get("LORAFLEET_LISTEN", "127.0.0.1:50051"))
    p.add_argument(
        "--workers",
        type=int,
        help="most local worker processes (default: one per GPU, or 1); they start when work"
        " arrives and stop after the idle grace",
    )
    p.add_argument(
        "--min-workers", type=int, default=0, help="workers kept even when idle (default 0)"
    )
    p.add_argument("--model-path", help="a local diffusers directory the workers use as base model")

    p = sub.add_parser("demo", help="train a demo LoRA end to end (tiny model unless --base-model)")
    p.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("LORAFLEET_DATA_DIR", ".lorafleet"))
    )
    p.add_argument("--listen", default="127.0.0.1:0", help="where the demo fleet serves gRPC")
    p.add_argument("--target", help="use this running fleet instead of starting one")
    p.add_argument("--api-key", help="API key for --target (LORAFLEET_API_KEY)")
    p.add_argument(
        "--family",
        choices=FAMILIES,
        help="the model family: sdxl (default), flux (FLUX.1) or flux2 (FLUX.2 [klein]); the"
        " tiny demo model is built with that family's architecture, and the job names it",
    )
    p.add_argument(
        "--base-model", help="a diffusers directory or hub id (default: a tiny demo model)"
    )
    p.add_argument("--images", type=Path, help="your images (default: generated samples)")
    p.add_argument("--instance-prompt", default="a photo of sks dog")
    p.add_argument("--steps", type=int, help="max train steps (default 30 tiny, 500 real)")
    p.add_argument("--output", type=Path, default=Path("lorafleet-demo"), help="LoRA output folder")


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    return {"LORAFLEET_MODEL_PATH": str(Path(args.model_path).resolve())} if args.model_path else {}


async def run_up(args: argparse.Namespace) -> int:
    env = _worker_env(args)
    stop = asyncio.Event()
    stopped_by: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        stopped_by.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    async with local_fleet(
        args.data_dir,
        listen=args.listen,
        max_workers=args.workers,
        min_workers=args.min_workers,
        worker_env=env,
    ) as fleet:
        key_file = fleet.data_dir / API_KEY_FILE
        print(
            f"lorafleet is up on {fleet.target} (data in {fleet.data_dir}; worker logs in"
            f" {fleet.data_dir / 'logs'}; workers start when work arrives).\n"
            f"  export LORAFLEET_TARGET={fleet.target} LORAFLEET_API_KEY=$(cat {key_file})\n"
            "  lorafleet submit --images ./photos --instance-prompt 'a photo of sks dog'"
            " --max-train-steps 500 --watch\n"
            "Ctrl-C stops it; jobs in flight checkpoint and resume on the next `lorafleet up`.",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
        if stopped_by[:1] == [signal.SIGINT]:
            # The workers' drains then say SIGINT on the jobs' timelines, not SIGTERM.
            fleet.interrupted()
        print("stopping: draining workers...", file=sys.stderr, flush=True)
    return 0


def _sample_images(directory: Path, resolution: int) -> Path:
    """A few distinct pictures (a dog-ish blob on varied backgrounds) with captions."""
    from PIL import Image, ImageDraw

    directory.mkdir(parents=True, exist_ok=True)
    colours = [(200, 120, 60), (90, 160, 220), (120, 200, 120), (230, 200, 80)]
    for i, background in enumerate(colours):
        image = Image.new("RGB", (resolution, resolution), background)
        draw = ImageDraw.Draw(image)
        r = resolution
        draw.ellipse((r * 0.25, r * 0.35, r * 0.75, r * 0.8), fill=(60, 40, 30))
        draw.ellipse(
            (r * (0.5 + 0.05 * i), r * 0.2, r * (0.8 + 0.05 * i), r * 0.5), fill=(70, 45, 35)
        )
        image.save(directory / f"{i}.png")
        (directory / f"{i}.txt").write_text("a photo of sks dog")
    return directory


def _build_quietly(build: Callable[..., object], family: FamilyName, model_dir: Path) -> None:
    """Builds the demo model without transformers' own chatter in the demo's output (a note
    that torchvision is missing and a PIL image processor is used instead, a progress bar per
    saved shard): none of it is about the demo, and a new user took it for a problem."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    build(model_dir, family=family)


async def run_demo(args: argparse.Namespace) -> int:
    data_dir: Path = args.data_dir
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    tiny = not args.base_model
    resolution = 64 if tiny else 1024
    family: FamilyName = args.family or DEFAULT_FAMILY
    if tiny:
        from lorafleet.worker.tiny_model import build_tiny_model

        # One folder per family: a data directory holds each family's tiny model side by side.
        model_dir = data_dir / f"demo-model-{family}"
        if not (model_dir / "model_index.json").exists():
            print(
                f"building a tiny {family}-architecture demo model...", file=sys.stderr, flush=True
            )
            await asyncio.to_thread(_build_quietly, build_tiny_model, family, model_dir)
        base_model = str(model_dir.resolve())
    else:
        base_model = args.base_model
    images = args.images or await asyncio.to_thread(
        _sample_images, data_dir / "demo-images", resolution
    )
    spec = {
        "instance_prompt": args.instance_prompt,
        "max_train_steps": args.steps or (30 if tiny else 500),
        "checkpointing_steps": 10 if tiny else 100,
        "resolution": resolution,
        "base_model": base_model,
        # Named, not left to auto: a local folder names no public variant (the worker checks
        # the name against the model's model_index.json).
        "model_family": args.family or "auto",
        "learning_rate": 1e-3 if tiny else 1e-4,
        "labels": {"demo": "true"},
    }
    async with contextlib.AsyncExitStack() as stack:
        if args.target:
            target, api_key = args.target, args.api_key or os.environ.get("LORAFLEET_API_KEY", "")
        else:
            fleet = await stack.enter_async_context(
                # One worker, started at once: the demo's job comes right away.
                local_fleet(
                    data_dir, listen=args.listen, max_workers=1, min_workers=1, worker_env={}
                )
            )
            target, api_key = fleet.target, fleet.api_key
        client = await stack.enter_async_context(AsyncClient(target, api_key=api_key))
        prefix = f"demo-{os.getpid()}"
        await client.upload_dir(images, prefix=prefix)
        job = await client.submit(spec, instance_data_prefix=prefix)
        print(f"submitted {job.job_id}", file=sys.stderr, flush=True)
        if await watch(client, job.job_id, as_json=False) != 0:
            return 1
        args.output.mkdir(parents=True, exist_ok=True)
        out = await client.download_result(
            job.job_id, args.output / "pytorch_lora_weights.safetensors"
        )
    pipeline = next(name for name, of in PIPELINES.items() if of == family)
    print(
        f"\nwrote {out}\nload it in diffusers:\n"
        f"  from diffusers import {pipeline}\n"
        f"  pipe = {pipeline}.from_pretrained({base_model!r})\n"
        f"  pipe.load_lora_weights({str(args.output)!r})\n"
        f"  image = pipe({args.instance_prompt!r}).images[0]"
    )
    return 0
