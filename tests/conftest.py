"""Shared fixtures: a real Postgres per test, cloned from a migrated template (fast, isolated).

The server is `LORAFLEET_TEST_DATABASE_URL`, else the local one on 127.0.0.1:5432, else an
embedded pgserver started for the session (a fresh machine with no Postgres still runs the tests).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from filelock import FileLock

from lorafleet.core.telemetry import configure_logging
from lorafleet.ledger.database import EmbeddedPostgres, migrate
from lorafleet.ledger.ledger import Ledger
from tests.support.paths import public_tmp_dir

DEFAULT_TEST_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"

# The shared fixtures: the fleet, the tiny model (tests/support).
pytest_plugins = ("tests.support.fixtures",)


# In-process services log to stderr, so a command's stdout stays its own output.
configure_logging(fmt="console")


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    url = os.environ.get("LORAFLEET_TEST_DATABASE_URL")
    if url:
        yield url
        return
    import asyncio

    async def reachable() -> bool:
        try:
            conn = await asyncpg.connect(DEFAULT_TEST_SERVER, timeout=3)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return False
        await conn.close()
        return True

    if asyncio.run(reachable()):
        yield DEFAULT_TEST_SERVER
        return
    # One embedded server for every test process of this user: xdist workers and runs side by
    # side share it (pgserver counts its users and the last one stops it; each test has its own
    # database), and the lock keeps two of them from initialising it at once. Not under
    # pytest's temporary tree: run as root, pgserver runs Postgres as its own user, and every
    # pytest that starts makes that tree private again (0700), locking the server out.
    data_dir = public_tmp_dir() / f"lorafleet-test-pg-{os.getuid()}"
    embedded = EmbeddedPostgres(data_dir)
    with FileLock(f"{data_dir}.lock", timeout=300):
        url = embedded.start()
    yield url
    embedded.stop()


@pytest.fixture(scope="session")
async def template_database(pg_server_url: str) -> AsyncIterator[str]:
    # One per test process: under xdist each worker migrates its own (a second or so), so no
    # worker ever clones a template another one is still building or dropping.
    name = f"lorafleet_tpl_{os.getpid()}"
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(with_database(pg_server_url, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()
        yield name
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def database_url(pg_server_url: str, template_database: str) -> AsyncIterator[str]:
    name = f"lorafleet_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
        yield with_database(pg_server_url, name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def ledger(database_url: str) -> AsyncIterator[Ledger]:
    ledger = await Ledger.connect(database_url)
    yield ledger
    await ledger.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def span_exporter() -> object:
    """Every span of the session, in memory (the global tracer provider can be set only once)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter
