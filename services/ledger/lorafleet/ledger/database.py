"""Where the ledger lives: a Postgres server by URL, or an embedded one (pgserver) on disk.

Migrations are plain ordered SQL files applied once each, under an advisory lock so that two
replicas starting together do not race. `sql/schema.sql` is the schema they produce, written out
in one file; `catalog()` describes a database's schema as text lines, so that two databases (one
migrated, one built from schema.sql) can be compared: `python -m lorafleet.ledger.database
catalog URL` prints it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import structlog

log = structlog.get_logger(__name__)

_SQL = importlib.resources.files("lorafleet.ledger") / "sql"
_MIGRATIONS = _SQL / "migrations"
# The migration log: bookkeeping of migrate(), not part of the schema.
MIGRATION_LOG = "schema_migrations"
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


def schema_sql() -> str:
    """The current schema as one script (sql/schema.sql): equal to applying every migration."""
    return (_SQL / "schema.sql").read_text()


# Each query yields (sort key, description) rows; `catalog` joins them into sorted lines.
_CATALOG_QUERIES = (
    # Tables, views and other relations (the log excluded), with their kind.
    """
    SELECT 'relation ' || c.relname,
           'relation ' || c.relname || ' kind=' || c.relkind::text
               || CASE WHEN c.relrowsecurity THEN ' row-security' ELSE '' END
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND c.relname <> $1
    """,
    # Columns: position among the live ones, type with modifiers, nullability, default,
    # identity and generation.
    """
    SELECT 'column ' || c.relname || '.' || to_char(
               row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum), 'FM000'),
           'column ' || c.relname || '.' || a.attname || ' #'
               || row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum)
               || ' ' || format_type(a.atttypid, a.atttypmod)
               || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE ' NULL' END
               || coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '')
               || CASE WHEN a.attidentity <> '' THEN ' IDENTITY ' || a.attidentity::text ELSE '' END
               || CASE WHEN a.attgenerated <> '' THEN ' GENERATED ' || a.attgenerated::text
                       ELSE '' END
               || CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
                       THEN ' COLLATE ' || a.attcollation::regcollation::text ELSE '' END
    FROM pg_attribute a
    JOIN pg_class c ON c.oid = a.attrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    JOIN pg_type t ON t.oid = a.atttypid
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND c.relname <> $1 AND a.attnum > 0 AND NOT a.attisdropped
    """,
    # Constraints of tables and domains: name, kind and definition.
    """
    SELECT 'constraint ' || coalesce(c.relname, ty.typname) || '.' || k.conname,
           'constraint ' || coalesce(c.relname, ty.typname) || '.' || k.conname
               || ' ' || pg_get_constraintdef(k.oid)
               || CASE WHEN k.condeferrable THEN ' DEFERRABLE' ELSE '' END
               || CASE WHEN k.condeferred THEN ' INITIALLY DEFERRED' ELSE '' END
               || CASE WHEN NOT k.convalidated THEN ' NOT VALID' ELSE '' END
    FROM pg_constraint k
    JOIN pg_namespace n ON n.oid = k.connamespace
    LEFT JOIN pg_class c ON c.oid = k.conrelid
    LEFT JOIN pg_type ty ON ty.oid = k.contypid
    WHERE n.nspname = 'public' AND coalesce(c.relname, '') <> $1
    """,
    # Indexes, as CREATE INDEX statements (the constraint-backing ones too).
    """
    SELECT 'index ' || i.indexname, 'index ' || i.indexname || ': ' || i.indexdef
    FROM pg_indexes i WHERE i.schemaname = 'public' AND i.tablename <> $1
    """,
    # Functions and procedures, whole: signature, language, volatility and body.
    """
    SELECT 'function ' || p.oid::regprocedure::text,
           'function ' || p.oid::regprocedure::text || E':\n' || pg_get_functiondef(p.oid)
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = 'public' AND p.prokind IN ('f', 'p', 'w')
    """,
    # Triggers (not the internal ones behind foreign keys), with their enabled state.
    """
    SELECT 'trigger ' || c.relname || '.' || t.tgname,
           'trigger ' || c.relname || '.' || t.tgname || ' enabled=' || t.tgenabled::text || ': '
               || pg_get_triggerdef(t.oid)
    FROM pg_trigger t
    JOIN pg_class c ON c.oid = t.tgrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND NOT t.tgisinternal
    """,
    # Sequences: type, bounds, step, cycling, and the column that owns them.
    """
    SELECT 'sequence ' || s.sequencename,
           'sequence ' || s.sequencename || ' ' || s.data_type::text
               || ' start=' || s.start_value || ' min=' || s.min_value
               || ' max=' || s.max_value || ' increment=' || s.increment_by
               || ' cache=' || s.cache_size || CASE WHEN s.cycle THEN ' cycle' ELSE '' END
               || coalesce(' owned by ' || (
                   SELECT oc.relname || '.' || oa.attname
                   FROM pg_depend d
                   JOIN pg_class oc ON oc.oid = d.refobjid
                   JOIN pg_attribute oa ON oa.attrelid = d.refobjid AND oa.attnum = d.refobjsubid
                   WHERE d.objid = (quote_ident(s.schemaname) || '.'
                                    || quote_ident(s.sequencename))::regclass
                     AND d.classid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
               ), '')
    FROM pg_sequences s WHERE s.schemaname = 'public'
    """,
    # Views' queries.
    """
    SELECT 'view ' || v.viewname, 'view ' || v.viewname || ': ' || v.definition
    FROM pg_views v WHERE v.schemaname = 'public'
    """,
    # Types of our own (enums with their labels, domains, composites, ranges).
    """
    SELECT 'type ' || t.typname,
           'type ' || t.typname || ' kind=' || t.typtype::text
               || coalesce(' base=' || nullif(format_type(t.typbasetype, t.typtypmod), '-'), '')
               || coalesce(' labels=' || (
                   SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                   FROM pg_enum e WHERE e.enumtypid = t.oid), '')
    FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
    WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd', 'r', 'm')
       OR (n.nspname = 'public' AND t.typtype = 'c' AND EXISTS (
           SELECT 1 FROM pg_class c WHERE c.oid = t.typrelid AND c.relkind = 'c'))
    """,
    # Extensions the schema relies on.
    """
    SELECT 'extension ' || e.extname, 'extension ' || e.extname
    FROM pg_extension e WHERE e.extname <> 'plpgsql'
    """,
)


async def catalog(conn: asyncpg.Connection) -> list[str]:
    """The schema of the connection's database (`public`), one description per object, sorted.

    Covers relations, columns (type, nullability, default, position), constraints, indexes,
    functions with their bodies, triggers, sequences, views, types and extensions: everything
    a migration can change that queries depend on. The migration log is left out. Two databases
    have the same schema when their catalogs are equal; a function body spans several lines.
    """
    rows: list[tuple[str, str]] = []
    for query in _CATALOG_QUERIES:
        rows.extend((r[0], r[1]) for r in await conn.fetch(query, *_log_arg(query)))
    lines: list[str] = []
    for _key, description in sorted(rows):
        lines.extend(description.rstrip("\n").split("\n"))
    return lines


def _log_arg(query: str) -> tuple[str, ...]:
    return (MIGRATION_LOG,) if "$1" in query else ()


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Applies the pending migrations; returns the versions applied."""
    applied: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
    try:
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {MIGRATION_LOG} ("
            " version integer PRIMARY KEY, name text NOT NULL, sha256 text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {
            r["version"]: r["sha256"] for r in await conn.fetch(f"SELECT * FROM {MIGRATION_LOG}")
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
                    f"INSERT INTO {MIGRATION_LOG} (version, name, sha256) VALUES ($1, $2, $3)",
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


async def _print_catalog(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for line in await catalog(conn):
            print(line)
    finally:
        await conn.close()


def main(argv: list[str]) -> int:
    """`python -m lorafleet.ledger.database catalog URL`: prints the database's catalog."""
    if len(argv) != 2 or argv[0] != "catalog":
        print("usage: python -m lorafleet.ledger.database catalog POSTGRES_URL", file=sys.stderr)
        return 2
    asyncio.run(_print_catalog(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
