"""Where the ledger lives: a Postgres server by URL, or an embedded one (pgserver) on disk.

Migrations are plain ordered SQL files applied once each, under an advisory lock so that two
replicas starting together do not race.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import structlog

log = structlog.get_logger(__name__)

_MIGRATIONS = importlib.resources.files("lorafleet.scheduler") / "sql" / "migrations"
# Any fixed 64-bit number; it only has to be the same for every lorafleet replica.
_MIGRATION_LOCK = 0x6C6F7261666C6565


@dataclass(frozen=True, kw_only=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    found = []
    for entry in _MIGRATIONS.iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append(Migration(version=version, name=entry.name, sql=entry.read_text()))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps: {found}")
    return found


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Applies the pending migrations; returns the versions applied."""
    applied: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, sha256 text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {
            r["version"]: r["sha256"] for r in await conn.fetch("SELECT * FROM schema_migrations")
        }
        for m in migrations():
            digest = hashlib.sha256(m.sql.encode()).hexdigest()
            if m.version in done:
                if done[m.version] != digest:
                    # An applied migration was edited: the schema would silently diverge.
                    raise RuntimeError(f"migration {m.name} changed after it was applied")
                continue
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, sha256) VALUES ($1, $2, $3)",
                    m.version,
                    m.name,
                    digest,
                )
            applied.append(m.version)
            log.info("migration applied", migration=m.name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    return applied


class EmbeddedPostgres:
    """A Postgres server in `data_dir`, started on first use and kept for later runs."""

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = data_dir
        self._server: Any = None

    def start(self) -> str:
        self._data_dir.mkdir(parents=True, exist_ok=True)
        # pgserver logs every pg_ctl call at INFO; its failures still surface as exceptions.
        logging.getLogger("pgserver").setLevel(logging.WARNING)
        with warnings.catch_warnings():
            # platformdirs warns about XDG_RUNTIME_DIR on headless hosts when pgserver imports.
            warnings.simplefilter("ignore")
            # pgserver ships the Postgres binaries as a wheel: no system install needed.
            from pgserver.postgres_server import get_server

            self._server = get_server(self._data_dir, cleanup_mode="stop")
        uri: str = self._server.get_uri()
        return uri

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
