"""The ledger's plumbing: the pool, the named queries and the translation of driver errors.

The ledger is the truth; the worker streams only deliver. Driver errors are translated here into
lorafleet's error tree (and rows into domain values by `records` and the sections), so nothing
above the ledger package sees asyncpg:

* `LedgerUnavailable` (retryable): the database could not serve the statement now and the same
  call may succeed later: no connection, a connection lost or terminated, the server starting,
  shutting down or out of connections, a serialization failure or deadlock, a canceled or timed
  out statement, a read-only standby after a failover.
* `LedgerError` (not retryable): anything else the database refuses, which a retry repeats: a
  bug in a query or in its caller (bad SQL, a violated constraint, a malformed argument) or a
  misconfiguration (bad credentials, a missing database).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Self

import asyncpg

from lorafleet.core.errors import LedgerUnavailable, LorafleetError
from lorafleet.ledger.records import STANDING_MIN_AGE_S, Quarantine


def load_queries() -> dict[str, str]:
    text = (importlib.resources.files("lorafleet.ledger") / "sql" / "queries.sql").read_text()
    sections = re.split(r"^-- name: (\w+)\s*$", text, flags=re.MULTILINE)
    return {name: body.strip() for name, body in zip(sections[1::2], sections[2::2], strict=True)}


QUERIES = load_queries()


class LedgerError(LorafleetError):
    """The database refused a statement and retrying it cannot help (see the module docstring).

    `sqlstate` is the Postgres error code when the server sent one (e.g. `23505`, `42703`).
    """

    retryable = False

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


# Whole SQLSTATE classes after which the same statement may succeed later: 08 connection
# exception, 40 transaction rollback (serialization failure, deadlock), 53 insufficient
# resources (too many connections, disk full, out of memory), 57 operator intervention (query
# canceled or timed out, admin or crash shutdown, cannot connect now, idle session timeout),
# 58 system error (I/O).
_RETRYABLE_CLASSES = frozenset({"08", "40", "53", "57", "58"})


_RETRYABLE_STATES = frozenset(
    {
        "25006",  # read_only_sql_transaction: a failover left us on a standby
        "25P03",  # idle_in_transaction_session_timeout: the server closed the session
        "55P03",  # lock_not_available: lock_timeout elapsed
        "0A000",  # asyncpg's InvalidCachedStatementError: the schema changed under a statement
    }
)


# In a retryable class, but a retry repeats them.
_BUG_STATES = frozenset({"40002"})  # transaction_integrity_constraint_violation (at commit)


def translate_error(exc: BaseException) -> LorafleetError | None:
    """The lorafleet error for a driver or network error; None for anything else."""
    if isinstance(exc, asyncpg.PostgresError):
        state: str | None = getattr(exc, "sqlstate", None)
        message = f"{type(exc).__name__}: {exc}"
        if state in _RETRYABLE_STATES or (
            state is not None and state[:2] in _RETRYABLE_CLASSES and state not in _BUG_STATES
        ):
            return LedgerUnavailable(f"ledger unavailable: {message}")
        return LedgerError(f"ledger statement failed: {message}", sqlstate=state)
    if isinstance(exc, asyncpg.exceptions.ClientConfigurationError):
        return LedgerError(f"ledger client misconfigured: {exc}")
    if isinstance(exc, (OSError, TimeoutError, asyncpg.InterfaceError)):
        # Refused or dropped connections, a closed pool or connection, a connect timeout.
        return LedgerUnavailable(f"ledger unavailable: {type(exc).__name__}: {exc}")
    if isinstance(exc, asyncpg.exceptions.OutdatedSchemaCacheError):
        return LedgerUnavailable(f"ledger unavailable: {type(exc).__name__}: {exc}")
    if isinstance(exc, asyncpg.exceptions.InternalClientError):
        return LedgerError(f"ledger client failed: {type(exc).__name__}: {exc}")
    return None


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


class LedgerBase:
    """The pool and the query plumbing every section of `Ledger` runs its queries through."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        quarantine: Quarantine | None = None,
        fleet_max_vram_mb: int = 0,
        standing_min_age_s: float = STANDING_MIN_AGE_S,
    ) -> None:
        self._pool = pool
        self.quarantine = quarantine or Quarantine()
        # The largest node class the fleet runs (MiB; 0: not configured; fail_attempt's $6):
        # what a node smaller than it cannot hold, a larger one may.
        self.fleet_max_vram_mb = fleet_max_vram_mb
        # How long before a job's submission a machine must have delivered a verified result
        # for its word (an internal error, an input fault) to count against that job
        # (fail_attempt's $7, lorafleet_good_standing): what fresh machines cannot earn fast.
        self.standing_min_age_s = standing_min_age_s

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 20,
        quarantine: Quarantine | None = None,
        fleet_max_vram_mb: int = 0,
        standing_min_age_s: float = STANDING_MIN_AGE_S,
    ) -> Self:
        try:
            pool = await asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size, init=_init_connection
            )
        except Exception as exc:
            translated = translate_error(exc)
            if translated is None:
                raise
            raise translated from exc
        assert pool is not None
        return cls(
            pool,
            quarantine=quarantine,
            fleet_max_vram_mb=fleet_max_vram_mb,
            standing_min_age_s=standing_min_age_s,
        )

    async def close(self) -> None:
        await self._pool.close()

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        """A pooled connection; every driver error raised while it is held is translated."""
        try:
            async with self._pool.acquire() as conn:
                yield conn
        except Exception as exc:
            translated = translate_error(exc)
            if translated is None:
                raise
            raise translated from exc

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self._conn() as conn:
            rows: list[asyncpg.Record] = await conn.fetch(QUERIES[query], *args)
            return rows

    async def _fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        async with self._conn() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(QUERIES[query], *args)
            return row


def _uuid_or_nil(value: str) -> uuid.UUID:
    """A malformed lease id matches no lease (the caller then refuses the message as stale)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        return uuid.UUID(int=0)
