"""`lorafleet worker` / `python -m lorafleet.worker`: run one worker until it is told to stop.

Every option of `WorkerConfig` (config.py) is a flag and an environment variable; a flag wins
(`--help` lists them with their variables and defaults). The first SIGTERM or SIGINT
drains: the current step finishes, a checkpoint is committed, the job is re-queued, and the
process exits 0. A second signal stops at once. With `--spot-notice ec2`, EC2's spot
interruption notice drains the same way (metadata_services.py), and a worker given no machine
id takes its instance id from the metadata service first (spot_notice.py).

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
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from lorafleet.core.errors import InvalidArgument, OneLineErrorParser
from lorafleet.core.settings import ConfigError, add_flags, env_names, load
from lorafleet.core.spec import JobSpec
from lorafleet.core.telemetry import MetricsServer, configure_logging, configure_tracing
from lorafleet.worker.agent import Agent, AgentError, State
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.qualify import probe
from lorafleet.worker.simulated import SimulatedTrainer, simulated_trainer_factory
from lorafleet.worker.spot_notice import with_ec2_identity
from lorafleet.worker.training import TrainingConfig
from lorafleet.worker.training.base_model import detect_family
from lorafleet.worker.training.compiling import bake_compile_artifacts, load_compile_artifacts
from lorafleet.worker.training.failures import TrainingFailure

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="lorafleet worker",
        description="Connect to a lorafleet scheduler and train the jobs it leases. Every"
        " option also reads the environment variable named in its help; a flag wins.",
    )
    add_flags(parser, WorkerConfig)
    # The process's own flags, not part of the worker's configuration.
    add = parser.add_argument
    add("--log-level", help="log level [LORAFLEET_LOG_LEVEL; default INFO]")
    add(
        "--log-format",
        choices=("json", "console"),
        help="log format [LORAFLEET_LOG_FORMAT; default json]",
    )
    add(
        "--probe-only",
        action="store_true",
        help="run the qualification probe, print it as JSON and exit (0 passed, 1 failed)",
    )
    add(
        "--bake-compile-artifacts",
        metavar="FILE",
        type=Path,
        help="compile one step of each job of --bake-spec on --model-path, write torch's compile"
        " artifacts to FILE (for the image's LORAFLEET_COMPILE_ARTIFACTS_PATH) and exit; run it"
        " on the GPU model and image the workers use (docs/DEPLOYING.md)",
    )
    add(
        "--bake-spec",
        metavar="FILE",
        type=Path,
        help="with --bake-compile-artifacts: a JSON list of the jobs' spec fields whose shapes to"
        " bake (resolution, lora_rank, gradient_checkpointing, ...); default: one job of the"
        " model's family with the spec's defaults",
    )
    return parser


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> WorkerConfig:
    """The environment, the flags on top; raises `ConfigError`."""
    token: str | None = None
    if (args.probe_only or args.bake_compile_artifacts) and args.worker_token is None:
        variables = env_names("worker_token", WorkerConfig.model_fields["worker_token"])
        if not any(env.get(name, "").strip() for name in variables):
            token = "unused-by-the-probe"  # the probe and the bake talk to no scheduler
    return load(WorkerConfig, args, env=env, worker_token=token)


def bake_specs(config: WorkerConfig, spec_file: Path | None) -> list[JobSpec]:
    """The jobs `--bake-compile-artifacts` compiles: `spec_file`'s (a JSON list of spec
    fields), else one job of the model's family with the spec's defaults; each on
    `--model-path`. Raises `ConfigError` naming what is wrong."""
    if config.model_path is None:
        raise ConfigError("--bake-compile-artifacts needs --model-path (the model to compile)")
    probe_spec = JobSpec(instance_prompt="x", instance_data_prefix="x", max_train_steps=1)
    try:
        family = detect_family(
            TrainingConfig(spec=probe_spec, model_path=config.model_path, local_files_only=True)
        ).name
    except (OSError, TrainingFailure) as exc:
        raise ConfigError(f"--model-path {config.model_path}: {exc}") from None
    documents: Any = [{}]
    if spec_file is not None:
        try:
            documents = json.loads(spec_file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--bake-spec {spec_file}: {exc}") from None
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise ConfigError(f"--bake-spec {spec_file}: must hold a list of spec mappings")
    specs = []
    for i, fields in enumerate(documents):
        try:
            specs.append(
                JobSpec(
                    **{
                        "instance_prompt": "a photo of sks dog",
                        "instance_data_prefix": "bake",
                        "max_train_steps": 1,  # one compiled step is what a bake runs
                        "model_family": family,
                        **fields,
                    }
                )
            )
        except (InvalidArgument, TypeError) as exc:
            raise ConfigError(f"--bake-spec {spec_file}[{i}]: {exc}") from None
    return specs


def simulated_factory(
    config: WorkerConfig,
) -> Callable[[TrainingConfig], SimulatedTrainer] | None:
    """The simulated trainer when `--simulate-step-s` is set; None: the real one."""
    if config.simulate_step_s is None:
        return None
    log.warning("simulated trainer: jobs are not really trained", step_s=config.simulate_step_s)
    return simulated_trainer_factory(
        step_s=config.simulate_step_s,
        checkpoint_bytes=config.simulate_checkpoint_bytes,
        checkpoint_stall_s=config.simulate_checkpoint_stall_s,
        node_fault=config.simulate_node_fault,
    )


async def serve(config: WorkerConfig) -> int:
    """Runs an agent with signal handling until it stops; the exit code."""
    loop = asyncio.get_running_loop()
    try:
        config = await with_ec2_identity(config)
    except ConfigError as exc:
        log.error("worker cannot run", error=str(exc))
        return 2
    simulated = simulated_factory(config)
    # The Agent's own default trainer unless simulating (None is not passed: it would replace
    # a default given by whoever made `Agent` callable here, e.g. a test's partial).
    agent = Agent(config) if simulated is None else Agent(config, trainer_factory=simulated)
    signals_seen = 0
    shutdowns: set[asyncio.Task[None]] = set()

    def on_signal(name: str) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            # The reason goes on the job's timeline with its drain.
            agent.drain("SIGINT (interrupted, e.g. Ctrl-C)" if name == "SIGINT" else name)
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
    endpoint: MetricsServer | None = None
    try:
        if config.metrics_port is not None:
            endpoint = MetricsServer(port=config.metrics_port, health=lambda: liveness(agent))
            try:
                await endpoint.start()
            except OSError as exc:
                log.error("worker cannot run", error=str(exc))
                return 2
            log.info("metrics and /healthz served", port=endpoint.port)
        async with agent:
            await agent.run()
        return 0
    except AgentError as exc:
        log.error("worker cannot run", error=str(exc))
        return 2
    finally:
        if endpoint is not None:
            await endpoint.close()
        for sig in installed:
            loop.remove_signal_handler(sig)


def liveness(agent: Agent) -> tuple[bool, dict[str, object]]:
    """`/healthz`: alive while the agent has not stopped. The answer comes from the worker's
    event loop, so a wedged loop (no heartbeats either) fails the probe by timing out."""
    return agent.state is not State.STOPPED, agent.describe()


# Set by a parent that supervises the worker (the local provider of `lorafleet up`): its pid.
PARENT_PID_ENV = "LORAFLEET_PARENT_PID"


def stop_with_parent(environ: Mapping[str, str]) -> None:
    """A supervised worker gets SIGTERM (and drains) when its parent dies, however it dies: a
    `lorafleet up` killed with -9 leaves no orphan worker training on (Linux only)."""
    parent = environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):  # the parent died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def bound_hub_requests(timeout_s: float) -> None:
    """Every request this process makes to the Hugging Face hub waits at most `timeout_s` for
    an answer. huggingface_hub reads its timeouts from the environment once, at import (set
    here for a hub imported later), and retries a failed metadata request five times with a
    fixed 60 s timeout of its own (`file_download._ETAG_RETRY_TIMEOUT`, set here where this
    version has it): a hub that does not answer (issue 32: a machine without network) held a
    lease some six minutes per file. With the bound, a download that cannot succeed fails in
    about 6 x `timeout_s` plus its backoff, as a node fault (`base_model.
    raise_if_missing_repo`), while the setup watch's notices say it is loading the model."""
    seconds = max(1, round(timeout_s))
    os.environ["HF_HUB_ETAG_TIMEOUT"] = str(seconds)  # for a process started from this one
    os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = str(seconds)
    from huggingface_hub import constants, file_download

    constants.HF_HUB_ETAG_TIMEOUT = seconds
    constants.HF_HUB_DOWNLOAD_TIMEOUT = seconds
    if hasattr(file_download, "_ETAG_RETRY_TIMEOUT"):
        setattr(file_download, "_ETAG_RETRY_TIMEOUT", seconds)  # noqa: B010 (private)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `lorafleet worker` and `python -m lorafleet.worker`; returns the exit
    code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"lorafleet worker: error: {exc}\nsee `lorafleet worker --help`", file=sys.stderr)
        return 2
    # Process-wide setup, only once the configuration is known to be good.
    stop_with_parent(os.environ)
    bound_hub_requests(config.hub_timeout_s)
    configure_logging(level=args.log_level, fmt=args.log_format)
    configure_tracing("lorafleet-worker")
    if args.probe_only:
        result = probe(config)
        print(json.dumps(asdict(result), default=dict, indent=2))
        return 0 if result.passed else 1
    if args.bake_compile_artifacts is not None:
        try:
            specs = bake_specs(config, args.bake_spec)
        except ConfigError as exc:
            print(f"lorafleet worker: error: {exc}", file=sys.stderr)
            return 2
        assert config.model_path is not None  # bake_specs refused it otherwise
        written = bake_compile_artifacts(
            Path(config.model_path), specs, args.bake_compile_artifacts, device=config.device
        )
        print(
            f"{written} bytes of compile artifacts for {len(specs)} job shape(s) written to"
            f" {args.bake_compile_artifacts}"
        )
        return 0
    if config.compile_artifacts_path is not None:
        # The operator's baked file, before any lease compiles: a missing or unreadable one
        # fails the start (it was named on purpose).
        try:
            load_compile_artifacts(config.compile_artifacts_path, config.compile_cache_path)
        except (OSError, ValueError) as exc:
            print(f"lorafleet worker: error: compile_artifacts_path: {exc}", file=sys.stderr)
            return 2
    # A training thread still inside a step when the grace period ran out does not hold the
    # exit: the agent's training thread is a daemon (training_thread.py).
    return asyncio.run(serve(config))
