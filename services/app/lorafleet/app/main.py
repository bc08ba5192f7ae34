"""`lorafleet`: the one command. The app package is where the services are started and wired.

Client commands (submit, watch, list, ...) come from `lorafleet.cli` and only talk gRPC. The
service commands start a service in this process:

lorafleet scheduler            serve JobService + WorkerService (embedded Postgres by default)
lorafleet worker ...           run a GPU worker (needs the `worker` extra)
lorafleet keys create OWNER    make an API key (printed once); keys list | revoke KEY_ID
lorafleet scaler               size and heal the worker fleet (SaladCloud, EC2 spot, local)
lorafleet nodes / scaler-log   the node registry / the scaler's decisions (read the ledger)
lorafleet up / demo            a whole fleet on this machine / an end-to-end demo
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from lorafleet.cli.commands import JOB_COMMANDS, add_job_commands, run_job_command
from lorafleet.core.errors import LorafleetError, OneLineErrorParser
from lorafleet.core.telemetry import configure_logging, configure_tracing

# Imported only when one of them runs: a client command should not pay for the scheduler's
# (asyncpg, boto3) or the worker's (torch) imports.
SERVICE_COMMANDS = ("scheduler", "keys", "scaler", "nodes", "scaler-log", "up", "demo")


def build_parser(*, with_services: bool) -> argparse.ArgumentParser:
    # Its subparsers are of its class (argparse's default): one-line errors for all of them.
    parser: argparse.ArgumentParser = OneLineErrorParser(
        prog="lorafleet",
        description="DreamBooth-LoRA fine-tuning (SDXL, FLUX.1, FLUX.2 [klein]) on"
        " interruptible GPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_job_commands(sub)
    if with_services:
        from lorafleet.app.local import add_local_commands
        from lorafleet.app.services import add_service_commands

        add_service_commands(sub)
        add_local_commands(sub)
    else:
        for name, text in (
            ("scheduler", "run the scheduler (gRPC JobService and WorkerService)"),
            ("keys", "administer API keys (talks to the ledger directly)"),
            ("scaler", "size and heal the worker fleet through the provider"),
            ("nodes", "the node registry: every machine seen (reads the ledger)"),
            ("scaler-log", "the scaler's decisions, newest first (reads the ledger)"),
            ("up", "run a whole fleet here: scheduler, Postgres, storage, workers"),
            ("demo", "train a demo LoRA end to end (tiny model unless --base-model)"),
        ):
            sub.add_parser(name, help=text, add_help=False)
    sub.add_parser("worker", help="run a worker (see `lorafleet worker --help`)", add_help=False)
    return parser


def _runners() -> dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]]:
    from lorafleet.app.local import run_demo, run_up
    from lorafleet.app.services import (
        run_keys,
        run_nodes,
        run_scaler,
        run_scaler_log,
        run_scheduler,
    )

    return {
        "scheduler": run_scheduler,
        "keys": run_keys,
        "scaler": run_scaler,
        "nodes": run_nodes,
        "scaler-log": run_scaler_log,
        "up": run_up,
        "demo": run_demo,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    if command in ("scheduler", "keys", "worker", "up", "scaler", "nodes", "scaler-log"):
        # Services log JSON lines on stderr; stdout stays the command's own output.
        configure_logging()
    elif command == "demo":
        # The demo shows a progress bar; its embedded fleet speaks up only about problems.
        configure_logging(level=os.environ.get("LORAFLEET_LOG_LEVEL", "WARNING"), fmt="console")
    if command == "worker":
        from lorafleet.worker.main import main as worker_main

        code: int = worker_main(argv[1:])
        return code
    services = command in SERVICE_COMMANDS
    args = build_parser(with_services=services).parse_args(argv)
    runners = _runners() if services else {}
    for name in JOB_COMMANDS:
        runners[name] = run_job_command
    span: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if args.command in JOB_COMMANDS:
        # A client command is one trace: its span, then the gRPC calls under it (the SDK's
        # channel sends the context on), then the scheduler's and the workers' spans.
        configure_tracing("lorafleet-cli")
        from opentelemetry import trace

        span = trace.get_tracer("lorafleet.cli").start_as_current_span(
            f"lorafleet {args.command}", attributes={"lorafleet.command": args.command}
        )
    try:
        with span, contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(runners[args.command](args))
        return 130
    except LorafleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`lorafleet list | head`): stop quietly, as Unix tools do. Later
        # writes (the interpreter's flush at exit) go nowhere instead of raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe
    except OSError as exc:
        # A file the command was pointed at (--spec, --batch, -o) cannot be read or written:
        # one line, as for every other error the user can fix.
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
