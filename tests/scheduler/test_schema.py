"""The schema: migrations equal sql/schema.sql (by catalog), and every named query prepares.

`schema_database` is built from schema.sql alone; `database_url` is a clone of the session's
template, built by `migrate()`. Both live on the same server, so their catalogs compare as text.
"""

from __future__ import annotations

import ast
import difflib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from lorafleet.ledger import ledger as ledger_module
from lorafleet.ledger.database import MIGRATION_LOG, catalog, migrate, migrations, schema_sql
from lorafleet.ledger.ledger import QUERIES
from tests.conftest import with_database


@pytest.fixture(scope="session")
async def schema_database(pg_server_url: str) -> AsyncIterator[str]:
    """A database built by running sql/schema.sql, and nothing else."""
    name = f"lorafleet_schema_{os.getpid()}"
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(with_database(pg_server_url, name))
        try:
            await conn.execute(schema_sql())
        finally:
            await conn.close()
        yield with_database(pg_server_url, name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _catalog(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        return await catalog(conn)
    finally:
        await conn.close()


def _diff(migrated: list[str], from_schema: list[str]) -> str:
    return "\n".join(
        difflib.unified_diff(
            migrated, from_schema, "migrations/*.sql", "schema.sql", lineterm="", n=2
        )
    )


async def test_schema_sql_equals_what_the_migrations_build(
    database_url: str, schema_database: str
) -> None:
    migrated = await _catalog(database_url)
    from_schema = await _catalog(schema_database)
    # The comparison covers every kind of object the ledger has.
    kinds = {line.split(" ", 1)[0] for line in migrated if not line.startswith(" ")}
    assert {"relation", "column", "constraint", "index", "function", "trigger", "sequence"} <= kinds
    assert not any(MIGRATION_LOG in line for line in migrated)
    diff = _diff(migrated, from_schema)
    assert not diff, (
        "sql/schema.sql no longer equals the migrations; make the same change in schema.sql"
        f" (lines from the migrations -, from schema.sql +):\n{diff}"
    )


async def test_the_catalog_sees_every_kind_of_schema_change(
    database_url: str, schema_database: str
) -> None:
    """Each change below, made to the migrated database, shows up in the diff."""
    changes = {
        "ALTER TABLE jobs ALTER COLUMN error SET DEFAULT 'none'": "column jobs.error",
        "ALTER TABLE machines ALTER COLUMN version DROP NOT NULL": "column machines.version",
        "ALTER TABLE bans ALTER COLUMN reason TYPE varchar(200)": "column bans.reason",
        "ALTER TABLE jobs DROP CONSTRAINT jobs_check1": "constraint jobs.jobs_check1",
        "CREATE INDEX extra_idx ON leases (ended_at)": "index extra_idx",
        "DROP TRIGGER job_events_notify ON job_events": "trigger job_events.job_events_notify",
        "CREATE SEQUENCE extra_seq": "sequence extra_seq",
        # Only the body differs: a changed rule, the same signature.
        "CREATE OR REPLACE FUNCTION lorafleet_gpu_seconds(job uuid) RETURNS double precision"
        " LANGUAGE sql STABLE AS $$ SELECT 0::double precision $$": "SELECT 0::double precision",
    }
    conn = await asyncpg.connect(database_url)
    try:
        for statement in changes:
            await conn.execute(statement)
    finally:
        await conn.close()
    diff = _diff(await _catalog(database_url), await _catalog(schema_database))
    for statement, seen in changes.items():
        assert seen in diff, f"{statement!r} is not in the diff:\n{diff}"


async def test_migrating_again_changes_nothing(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        before = await catalog(conn)
        assert await migrate(conn) == []
        versions = [r[0] for r in await conn.fetch(f"SELECT version FROM {MIGRATION_LOG}")]
        assert sorted(versions) == [m.version for m in migrations()]
        assert await catalog(conn) == before
    finally:
        await conn.close()


async def test_an_edited_applied_migration_is_refused(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"UPDATE {MIGRATION_LOG} SET sha256 = 'edited' WHERE version = 1")
        with pytest.raises(RuntimeError, match="changed after it was applied"):
            await migrate(conn)
    finally:
        await conn.close()


@pytest.mark.parametrize("name", sorted(QUERIES))
async def test_every_named_query_prepares_against_the_schema(
    name: str, schema_database: str
) -> None:
    """Parses and plans each query: a typo or a dropped column fails here, not in production."""
    conn = await asyncpg.connect(schema_database)
    try:
        statement = await conn.prepare(QUERIES[name])
        assert statement.get_query() == QUERIES[name]
    finally:
        await conn.close()


async def test_a_query_naming_a_dropped_column_fails_to_prepare(schema_database: str) -> None:
    """The check above has teeth: `prepare` reaches the server, which refuses a bad column."""
    conn = await asyncpg.connect(schema_database)
    try:
        with pytest.raises(asyncpg.UndefinedColumnError):
            await conn.prepare(QUERIES["get_api_key"].replace("secret_sha256", "secret"))
    finally:
        await conn.close()


def test_every_named_query_has_a_ledger_method_and_no_method_names_a_missing_one() -> None:
    """One method per query (conventions 5): no dead SQL, no method reading a missing name."""
    package = Path(ledger_module.__file__).parent
    used: set[str] = set()
    trees = [ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("_fetch", "_fetchrow")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            used.add(str(node.args[0].value))
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "QUERIES"
            and isinstance(node.slice, ast.Constant)
        ):
            used.add(str(node.slice.value))
    assert used - set(QUERIES) == set(), "methods name queries that queries.sql lacks"
    assert set(QUERIES) - used == set(), "queries.sql has sections no Ledger method runs"


async def test_a_lease_without_an_interval_is_judged_by_the_reference_interval(
    database_url: str,
) -> None:
    """`lorafleet_lease_interval`: the lease's chosen interval, else the spec's, else the named
    `lorafleet_reference_interval()` (the stall bound's unit), never a number of its own."""
    conn = await asyncpg.connect(database_url)
    try:
        reference = await conn.fetchval("SELECT lorafleet_reference_interval()")
        assert reference == 100

        async def interval(spec: str, lease_steps: int | None) -> int:
            value = await conn.fetchval(
                "SELECT lorafleet_lease_interval($1::jsonb, $2)", spec, lease_steps
            )
            assert isinstance(value, int)
            return value

        assert await interval('{"checkpointing_steps": 0}', 40) == 40
        assert await interval('{"checkpointing_steps": 250}', None) == 250
        assert await interval('{"checkpointing_steps": 0}', None) == reference
        assert await interval("{}", None) == reference
    finally:
        await conn.close()
