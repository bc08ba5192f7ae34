"""`lorafleet`: run the services and administer the fleet.

lorafleet scheduler            serve JobService + WorkerService (embedded Postgres by default)
lorafleet worker ...           run a GPU worker (needs the `worker` extra)
lorafleet keys create OWNER    make an API key (printed once)
lorafleet keys list | revoke KEY_ID
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from lorafleet.cli.jobs import add_job_commands, run_job_command
from lorafleet.cli.local import add_local_commands, run_demo, run_up
from lorafleet.errors import LorafleetError

JOB_COMMANDS = (
    "submit",
    "watch",
    "list",
    "get",
    "cancel",
    "events",
    "timeline",
    "report",
    "download",
    "webhooks",
)


def _scheduler_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler (gRPC JobService and WorkerService)")
    p.add_argument("--listen", help="host:port to serve gRPC on (LORAFLEET_LISTEN)")
    p.add_argument("--data-dir", type=Path, help="embedded Postgres, local objects, secrets")
    p.add_argument("--database-url", help="Postgres URL (DATABASE_URL); default: embedded")
    p.add_argument("--lease-ttl-s", type=float, help="seconds without heartbeat before re-queue")


async def _run_scheduler(args: argparse.Namespace) -> int:
    from lorafleet.scheduler.config import SchedulerConfig
    from lorafleet.scheduler.server import Scheduler
    from lorafleet.telemetry import configure_tracing

    configure_tracing("lorafleet-scheduler")
    overrides: dict[str, object] = {}
    if args.listen:
        overrides["listen"] = args.listen
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.database_url:
        overrides["database_url"] = args.database_url
    if args.lease_ttl_s:
        overrides["lease_ttl_s"] = args.lease_ttl_s
    config = SchedulerConfig.from_env(**overrides)
    async with Scheduler(config) as scheduler:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(scheduler.shutdown()))
        print(
            f"scheduler listening on port {scheduler.port}; worker token in"
            f" {config.data_dir / 'worker-token'}",
            file=sys.stderr,
        )
        await scheduler.wait()
    return 0


def _keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="administer API keys (talks to the ledger directly)")
    p.add_argument("--data-dir", type=Path, help="the scheduler's data dir (embedded Postgres)")
    p.add_argument("--database-url", help="Postgres URL (DATABASE_URL)")
    keys = p.add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key for OWNER and print it once")
    create.add_argument("owner")
    create.add_argument("--webhook-url", help="default webhook for jobs submitted with this key")
    create.add_argument(
        "--webhook-event",
        action="append",
        default=[],
        choices=["checkpoint", "succeeded", "failed", "canceled"],
        help="events to send (default: all)",
    )
    keys.add_parser("list", help="list keys (ids and owners, never secrets)")
    revoke = keys.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")


async def _run_keys(args: argparse.Namespace) -> int:
    import asyncpg

    from lorafleet.scheduler.auth import create_api_key
    from lorafleet.scheduler.config import SchedulerConfig
    from lorafleet.scheduler.database import EmbeddedPostgres, migrate
    from lorafleet.scheduler.ledger import Ledger

    overrides: dict[str, object] = {}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.database_url:
        overrides["database_url"] = args.database_url
    config = SchedulerConfig.from_env(**overrides)
    embedded = None
    url = config.database_url
    if not url:
        embedded = EmbeddedPostgres(config.data_dir / "postgres")
        url = embedded.start()
    try:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        ledger = await Ledger.connect(url, min_size=1, max_size=2)
        try:
            if args.keys_command == "create":
                created = await create_api_key(
                    ledger,
                    args.owner,
                    webhook_url=args.webhook_url,
                    webhook_events=args.webhook_event,
                )
                print(created.key)
                print(f"webhook secret: {created.webhook_secret}", file=sys.stderr)
            elif args.keys_command == "list":
                for row in await ledger.list_api_keys():
                    revoked = f" revoked {row['revoked_at']:%Y-%m-%d}" if row["revoked_at"] else ""
                    print(f"{row['key_id']}  {row['owner']}  {row['created_at']:%Y-%m-%d}{revoked}")
            elif not await ledger.revoke_api_key(args.key_id):
                print(f"error: no active key {args.key_id}", file=sys.stderr)
                return 1
        finally:
            await ledger.close()
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _scheduler_parser(sub)
    _keys_parser(sub)
    add_job_commands(sub)
    add_local_commands(sub)
    sub.add_parser("worker", help="run a worker (see `lorafleet worker --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from lorafleet.telemetry import configure_logging

    if argv[:1] and argv[0] in ("scheduler", "keys", "worker", "up"):
        # Services log JSON lines; user commands print only their own output.
        configure_logging()
    elif argv[:1] == ["demo"]:
        # The demo shows a progress bar; its embedded fleet speaks up only about problems.
        configure_logging(level=os.environ.get("LORAFLEET_LOG_LEVEL", "WARNING"), fmt="console")
    if argv[:1] == ["worker"]:
        from lorafleet.worker.main import main as worker_main

        code: int = worker_main(argv[1:])
        return code
    args = build_parser().parse_args(argv)
    runners: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "scheduler": _run_scheduler,
        "keys": _run_keys,
    }
    for name in JOB_COMMANDS:
        runners[name] = run_job_command
    runners["up"] = run_up
    runners["demo"] = run_demo
    try:
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(runners[args.command](args))
        return 130
    except LorafleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
