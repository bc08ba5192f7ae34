"""`lorafleet worker` / `python -m lorafleet.worker`: run one worker until it is told to stop.

Flags override the environment (`config.py` lists the variables). The first SIGTERM or SIGINT
drains: the current step finishes, a checkpoint is committed, the job is re-queued, and the
process exits 0. A second signal stops at once.

Exit codes: 0 stopped or drained; 1 the qualification probe failed (`--probe-only`);
2 bad configuration or credentials the scheduler refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import structlog

from lorafleet.telemetry import configure_logging, configure_tracing
from lorafleet.worker.agent import Agent, AgentError
from lorafleet.worker.config import DEFAULT_SCHEDULER, WorkerConfig
from lorafleet.worker.qualify import probe

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafleet worker",
        description="Connect to a lorafleet scheduler and train the jobs it leases.",
    )
    add = parser.add_argument
    add("--scheduler", help=f"host:port [LORAFLEET_SCHEDULER, default {DEFAULT_SCHEDULER}]")
    add("--token", help="worker token [LORAFLEET_WORKER_TOKEN; prefer the variable]")
    add("--tls", action="store_true", default=None, help="TLS [LORAFLEET_SCHEDULER_TLS]")
    add("--tls-ca-file", help="CA bundle (PEM) for the scheduler [LORAFLEET_SCHEDULER_CA]")
    add("--machine-id", help="[SALAD_MACHINE_ID, LORAFLEET_MACHINE_ID, default hostname]")
    add("--provider-instance-id", help="[SALAD_CONTAINER_GROUP_INSTANCE_ID, SALAD_INSTANCE_ID]")
    add(
        "--allow-cpu",
        action="store_true",
        default=None,
        help="qualify without CUDA (tests, demo) [LORAFLEET_ALLOW_CPU=1]",
    )
    add("--device", choices=("auto", "cpu", "cuda"), help="[LORAFLEET_DEVICE, default auto]")
    add("--model-path", help="local diffusers model replacing the spec's base_model")
    add("--vae-path", help="local VAE replacing the spec's vae_model")
    add("--model-cache-dir", help="hub download cache [LORAFLEET_MODEL_CACHE_DIR]")
    add(
        "--local-files-only",
        action="store_true",
        default=None,
        help="never download models [LORAFLEET_LOCAL_FILES_ONLY=1]",
    )
    add("--gpu-model", help="report this GPU model instead of the probed one")
    add("--vram-mb", type=int, help="report this much VRAM instead of the probed amount")
    add("--min-free-disk-mb", type=int, help="qualification floor (default 1024)")
    add("--min-free-memory-mb", type=int, help="qualification floor (default 512)")
    add("--min-tflops", type=float, help="qualification floor (default 0)")
    add("--sample-steps", type=int, help="inference steps for class/validation images")
    add("--drain-grace-s", type=float, help="bound on a graceful stop (default 25)")
    add("--log-level", help="[LORAFLEET_LOG_LEVEL, default INFO]")
    add("--log-format", choices=("json", "console"), help="[LORAFLEET_LOG_FORMAT, default json]")
    add(
        "--probe-only",
        action="store_true",
        help="run the qualification probe, print it as JSON and exit (0 passed, 1 failed)",
    )
    return parser


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> WorkerConfig:
    """Environment first, flags on top."""
    overrides: dict[str, object] = {
        "scheduler_address": args.scheduler,
        "worker_token": args.token,
        "tls": args.tls,
        "tls_ca_file": Path(args.tls_ca_file) if args.tls_ca_file else None,
        "machine_id": args.machine_id,
        "provider_instance_id": args.provider_instance_id,
        "allow_cpu": args.allow_cpu,
        "device": args.device,
        "model_path": args.model_path,
        "vae_path": args.vae_path,
        "model_cache_dir": args.model_cache_dir,
        "local_files_only": args.local_files_only,
        "gpu_model": args.gpu_model,
        "vram_mb": args.vram_mb,
        "min_free_disk_mb": args.min_free_disk_mb,
        "min_free_memory_mb": args.min_free_memory_mb,
        "min_tflops": args.min_tflops,
        "sample_steps": args.sample_steps,
        "drain_grace_s": args.drain_grace_s,
    }
    if args.probe_only and not (args.token or env.get("LORAFLEET_WORKER_TOKEN")):
        overrides["worker_token"] = "unused-by-the-probe"
    return WorkerConfig.from_env(env, **overrides)


async def serve(config: WorkerConfig) -> tuple[int, Agent]:
    """Runs an agent with signal handling until it stops; (exit code, the agent)."""
    loop = asyncio.get_running_loop()
    agent = Agent(config)
    signals_seen = 0
    shutdowns: set[asyncio.Task[None]] = set()

    def on_signal(name: str) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            agent.drain(name)
        else:
            log.warning("second signal: stopping now", signal=name)
            task = loop.create_task(agent.shutdown())
            shutdowns.add(task)
            task.add_done_callback(shutdowns.discard)

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            pass
    try:
        async with agent:
            await agent.run()
        return 0, agent
    except AgentError as exc:
        log.error("worker cannot run", error=str(exc))
        return 2, agent
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `lorafleet worker` and `python -m lorafleet.worker`; returns the exit
    code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, os.environ)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"lorafleet worker: error: {exc}", file=sys.stderr)
        return 2
    # Process-wide setup, only once the configuration is known to be good.
    configure_logging(level=args.log_level, fmt=args.log_format)
    configure_tracing("lorafleet-worker")
    if args.probe_only:
        result = probe(config)
        print(json.dumps(asdict(result), default=dict, indent=2))
        return 0 if result.passed else 1
    with asyncio.Runner() as runner:
        code, agent = runner.run(serve(config))
        if agent.busy:
            # A training thread cannot be interrupted and is still inside a step (the drain's
            # grace ran out, or a model is still loading); closing the loop would wait for it.
            # The lease is re-queued by the scheduler either way, so leave now.
            log.warning("exiting with the training thread still running")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code
