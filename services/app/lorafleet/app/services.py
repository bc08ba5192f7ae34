"""The service commands of `lorafleet`: `scheduler`, `keys`, `scaler`, `nodes` and `scaler-log`
(the worker has its own parser, `lorafleet.worker.main`). Their flags are derived from the
services' settings models, so each option is declared once, in the service. `keys`, `nodes` and
`scaler-log` talk to the ledger directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.settings import add_flags, load
from lorafleet.core.telemetry import MetricsServer, configure_tracing
from lorafleet.core.webhooks import standard_secret
from lorafleet.ledger.database import EmbeddedPostgres, migrate
from lorafleet.ledger.ledger import Ledger
from lorafleet.scaler.config import ScalerSettings
from lorafleet.scaler.service import LockHeld, Scaler, describe, provider_from_settings
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.server import Scheduler, tune_gc


def add_service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler (gRPC JobService and WorkerService)")
    add_flags(p, SchedulerConfig)
    _keys_parser(sub)
    _scaler_parsers(sub)


async def run_scheduler(args: argparse.Namespace) -> int:
    config = load(SchedulerConfig, args)
    configure_tracing("lorafleet-scheduler")
    async with Scheduler(config) as scheduler:
        tune_gc()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(scheduler.close()))
        # The token was given (LORAFLEET_WORKER_TOKEN or --worker-token), or generated and
        # kept in the data directory: say which, never pointing at a file that does not exist.
        token_from = (
            "worker token from LORAFLEET_WORKER_TOKEN / --worker-token"
            if config.worker_token
            else f"worker token in {config.data_dir / 'worker-token'}"
        )
        print(f"scheduler listening on port {scheduler.port}; {token_from}", file=sys.stderr)
        await scheduler.wait()
    return 0


def _keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="administer API keys (talks to the ledger directly)")
    add_flags(p, SchedulerConfig, only=("data_dir", "database_url"))
    keys = p.add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key for OWNER and print it once")
    create.add_argument("owner")
    create.add_argument("--webhook-url", help="default webhook for jobs submitted with this key")
    create.add_argument(
        "--webhook-event",
        action="append",
        default=[],
        choices=["checkpoint", "succeeded", "failed", "canceled", "samples"],
        help="events to send (default: all)",
    )
    create.add_argument(
        "--spend-limit-dollars",
        type=float,
        help="refuse a submit whose estimated cost would take this key's jobs past it (at the"
        " scheduler's --price-per-gpu-hour); default: no limit",
    )
    keys.add_parser("list", help="list keys (ids and owners, never secrets)")
    revoke = keys.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")


@asynccontextmanager
async def open_ledger(
    database_url: str, data_dir: Path, *, existing: bool = False
) -> AsyncIterator[tuple[Ledger, str]]:
    """The ledger at `database_url` (else the embedded one in `data_dir`), migrated; and its URL.
    `existing`: a command that only reads a fleet's ledger (`nodes`, `scaler-log`, `keys list`)
    refuses an embedded one that was never made, instead of making an empty one there: run from
    another directory than `lorafleet up`'s, it would show an empty fleet as if it were the one
    running."""
    embedded = None
    url = database_url
    if not url:
        cluster = data_dir / "postgres"
        if existing and not (cluster / "PG_VERSION").exists():
            raise InvalidArgument(
                "data_dir",
                f"no fleet's ledger in {cluster}: run this where `lorafleet up` runs (its"
                " .lorafleet folder), or pass --data-dir or --database-url",
            )
        embedded = EmbeddedPostgres(cluster)
        url = await asyncio.to_thread(embedded.start)
    try:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        ledger = await Ledger.connect(url, min_size=1, max_size=4)
        try:
            yield ledger, url
        finally:
            await ledger.close()
    finally:
        if embedded is not None:
            embedded.stop()


async def run_keys(args: argparse.Namespace) -> int:
    config = load(SchedulerConfig, args)
    # A key may be made before the fleet's first start; listing or revoking needs its ledger.
    existing = args.keys_command != "create"
    async with open_ledger(config.database_url, config.data_dir, existing=existing) as (
        ledger,
        _url,
    ):
        if args.keys_command == "create":
            created = await create_api_key(
                ledger,
                args.owner,
                webhook_url=args.webhook_url,
                webhook_events=args.webhook_event,
                spend_limit_dollars=args.spend_limit_dollars,
            )
            print(created.key)
            print(
                f"webhook secret: {standard_secret(created.webhook_secret)}"
                " (Standard Webhooks; verify with lorafleet.core.webhooks.verify or any"
                " standardwebhooks library)",
                file=sys.stderr,
            )
        elif args.keys_command == "list":
            for key in await ledger.list_api_keys():
                revoked = f" revoked {key.revoked_at:%Y-%m-%d}" if key.revoked_at else ""
                print(f"{key.key_id}  {key.owner}  {key.created_at:%Y-%m-%d}{revoked}")
        elif not await ledger.revoke_api_key(args.key_id):
            print(f"error: no active key {args.key_id}", file=sys.stderr)
            return 1
    return 0


# -- the scaler ----------------------------------------------------------------------------


def _scaler_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "scaler", help="size and heal the worker fleet through the provider (one active at a time)"
    )
    add_flags(p, ScalerSettings)
    p.add_argument("--once", action="store_true", help="one look at the fleet, then exit")

    where = ("data_dir", "database_url")
    p = sub.add_parser("nodes", help="the node registry: every machine seen (reads the ledger)")
    add_flags(p, ScalerSettings, only=where)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--limit", type=int, default=500, help="most machines, newest first")
    p.add_argument("--log", action="store_true", help="the scaler's decisions (as scaler-log)")

    p = sub.add_parser("scaler-log", help="the scaler's decisions, newest first (reads the ledger)")
    add_flags(p, ScalerSettings, only=where)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--limit", type=int, default=50, help="most decisions")


async def run_scaler(args: argparse.Namespace) -> int:
    settings = load(ScalerSettings, args)
    configure_tracing("lorafleet-scaler")
    provider = provider_from_settings(settings)
    async with open_ledger(settings.database_url, settings.data_dir) as (ledger, url):
        scaler = Scaler(
            ledger=ledger,
            database_url=url,
            provider=provider,
            policy=settings.policy_config(),
            tick_interval_s=settings.tick_interval_s,
            dry_run=settings.dry_run,
            scaler_id=settings.scaler_id,
            report=lambda outcome: print(describe(outcome), flush=True),
        )
        endpoint: MetricsServer | None = None
        try:
            if settings.metrics_port is not None:
                endpoint = MetricsServer(port=settings.metrics_port)
                await endpoint.start()
            async with scaler:
                if args.once:
                    # Non-zero when the provider could not be read or failed an action (not
                    # for a decision a race made moot), so a cron job or a deploy check sees it.
                    # The wait for the lock is bounded: beside an active scaler, exit 1 and
                    # say which one holds it instead of waiting for its session to end.
                    try:
                        outcomes = await scaler.run_once(lock_wait_s=settings.lock_wait_s)
                    except LockHeld as exc:
                        print(f"lorafleet scaler --once: {exc}", file=sys.stderr, flush=True)
                        return 1
                    return 1 if any(o.provider_failed for o in outcomes) else 0
                task = asyncio.create_task(scaler.run())
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, task.cancel)
                print(
                    f"scaler {scaler.scaler_id} ({settings.provider}"
                    f"{', dry run' if settings.dry_run else ''}) started",
                    file=sys.stderr,
                    flush=True,
                )
                with suppress(asyncio.CancelledError):
                    await task
        finally:
            if endpoint is not None:
                await endpoint.close()
            if settings.provider == "local":
                # Local workers are this process's children; cloud fleets outlive the scaler.
                await provider.stop(timeout_s=60)
    return 0


def _when(value: datetime | None) -> str:
    return "-" if value is None else f"{value.astimezone():%Y-%m-%d %H:%M:%S}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


async def run_nodes(args: argparse.Namespace) -> int:
    if args.log:
        return await run_scaler_log(args)
    settings = load(ScalerSettings, args)
    async with open_ledger(settings.database_url, settings.data_dir, existing=True) as (
        ledger,
        _url,
    ):
        nodes = await ledger.list_nodes(None, fault_window_s=3600.0, limit=args.limit)
        observations = await ledger.pace_observations(30 * 24 * 3600.0, 100_000)
    # Seconds per step by job shape (JobSpec.shape.key), averaged over its leases: as the
    # scheduler observed it (verified checkpoints over its clock), not as workers say.
    paces: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for o in observations:
        if not o.observed_steps or o.observed_seconds is None:
            continue
        paces[o.machine_id][o.shape.key].append(o.observed_seconds / o.observed_steps)
    by_shape = {
        m: {shape: round(sum(v) / len(v), 3) for shape, v in sorted(shapes.items())}
        for m, shapes in paces.items()
    }
    if args.json:
        for n in nodes:
            record = {k: _jsonable(v) for k, v in vars(n).items() if k != "recent_fault_times"}
            record["seconds_per_step_by_shape"] = by_shape.get(n.machine_id, {})
            print(json.dumps(record))
        return 0
    if not nodes:
        print("no machines seen yet", file=sys.stderr)
        return 0
    # GPU, VRAM and the probe are what the worker says; IDENTITY, the provider that vouched
    # for its machine id (docs/DESIGN.md, Identities), says whether anything backs that.
    rows = [
        [
            "MACHINE",
            "INSTANCE",
            "GPU",
            "VRAM",
            "IDENTITY",
            "QUALIFIED",
            "FIRST SEEN",
            "LAST SEEN",
            "LEASE",
            "FAULTS",
            "FINISHED",
            "S/STEP BY SHAPE",
        ]
    ]
    for n in nodes:
        qualified = {True: "yes", False: "NO", None: "-"}[n.qualified]
        if n.qualified is False and n.qualification_detail:
            qualified += f" ({n.qualification_detail[:40]})"
        rows.append(
            [
                n.machine_id,
                n.provider_instance_id or "-",
                n.gpu_model or "-",
                f"{n.vram_mb // 1024} GiB" if n.vram_mb else "-",
                n.identity_provider or "unverified",
                qualified,
                _when(n.first_seen_at),
                _when(n.last_seen_at),
                n.lease_job_id or "idle",
                str(n.node_faults),
                str(n.jobs_finished),
                ", ".join(f"{k}: {v:g}" for k, v in by_shape.get(n.machine_id, {}).items()) or "-",
            ]
        )
    print(_table(rows))
    return 0


async def run_scaler_log(args: argparse.Namespace) -> int:
    settings = load(ScalerSettings, args)
    async with open_ledger(settings.database_url, settings.data_dir, existing=True) as (
        ledger,
        _url,
    ):
        decisions = await ledger.list_scaler_decisions(args.limit)
    if args.json:
        for d in decisions:
            print(json.dumps({k: _jsonable(v) for k, v in vars(d).items()}))
        return 0
    if not decisions:
        print("no scaler decisions yet", file=sys.stderr)
        return 0
    rows = [["AT", "SCALER", "ACTION", "TARGET", "OUTCOME", "REASON"]]
    for d in decisions:
        if d.action == "hold":
            outcome = "held" + (f" x{d.repeats} until {_when(d.last_at)}" if d.repeats > 1 else "")
        else:
            outcome = "applied" if d.applied else f"NOT APPLIED: {d.error or 'not tried'}"
        figures = ", ".join(f"{k}={v}" for k, v in d.figures.items())
        rows.append(
            [
                _when(d.at),
                d.scaler_id,
                d.action,
                d.target,
                outcome,
                d.reason + (f" [{figures}]" if figures else ""),
            ]
        )
    print(_table(rows))
    return 0
