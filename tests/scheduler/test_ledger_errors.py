"""Driver errors translated at the ledger's edge: retryable ones to LedgerUnavailable, the rest
to LedgerError; nothing above the ledger sees asyncpg.

Errors are forced on a real server: a closed port, a closed pool, a backend that terminates
itself mid-statement, a statement timeout, a held row lock, a duplicate key, bad SQL. Error codes
that are awkward to cause for real (a deadlock, "too many connections", "the database system is
starting up") are raised by the server itself from a trigger, so they still travel the real
protocol and the real driver.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import asyncpg
import grpc
import pytest

from lorafleet.core.errors import LedgerUnavailable, LorafleetError
from lorafleet.ledger import ledger as ledger_module
from lorafleet.ledger.ledger import Ledger, LedgerError, translate_error
from tests.conftest import with_database
from tests.scheduler.test_ledger import new_job
from tests.support.fleet import Fleet


@asynccontextmanager
async def admin(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn: asyncpg.Connection = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def fail_job_inserts_with(database_url: str, body: str) -> None:
    """Every INSERT into jobs runs `body` (PL/pgSQL) first, in the inserting backend."""
    async with admin(database_url) as conn:
        await conn.execute(
            "CREATE FUNCTION test_force_failure() RETURNS trigger LANGUAGE plpgsql AS $$"
            f" BEGIN {body}; RETURN NEW; END $$;"
            " CREATE TRIGGER test_force_failure BEFORE INSERT ON jobs"
            " FOR EACH ROW EXECUTE FUNCTION test_force_failure();"
        )


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


RETRYABLE_STATES = {
    "40001": "serialization_failure",
    "40P01": "deadlock_detected",
    "53300": "too_many_connections",
    "57P03": "cannot_connect_now",
    "57P01": "admin_shutdown",
    "57014": "query_canceled",
    "08006": "connection_failure",
    "55P03": "lock_not_available",
    "25006": "read_only_sql_transaction",
}
BUG_STATES = {
    "23505": "unique_violation",
    "23514": "check_violation",
    "42601": "syntax_error",
    "42703": "undefined_column",
    "22P02": "invalid_text_representation",
    "40002": "transaction_integrity_constraint_violation",
}


@pytest.mark.parametrize("sqlstate", sorted(RETRYABLE_STATES))
async def test_server_errors_a_retry_can_outlive_are_unavailable(
    ledger: Ledger, database_url: str, sqlstate: str
) -> None:
    await fail_job_inserts_with(
        database_url, f"RAISE EXCEPTION 'forced' USING ERRCODE = '{sqlstate}'"
    )
    with pytest.raises(LedgerUnavailable) as caught:
        await ledger.insert_jobs("alice", [new_job()])
    assert caught.value.retryable is True
    assert isinstance(caught.value.__cause__, asyncpg.PostgresError)
    assert caught.value.__cause__.sqlstate == sqlstate
    # The pool is still usable: the next call does not inherit the failure.
    assert await ledger.count_queued(10) == 0


@pytest.mark.parametrize("sqlstate", sorted(BUG_STATES))
async def test_server_errors_a_retry_would_repeat_are_ledger_errors(
    ledger: Ledger, database_url: str, sqlstate: str
) -> None:
    await fail_job_inserts_with(
        database_url, f"RAISE EXCEPTION 'forced' USING ERRCODE = '{sqlstate}'"
    )
    with pytest.raises(LedgerError) as caught:
        await ledger.insert_jobs("alice", [new_job()])
    assert caught.value.retryable is False and caught.value.sqlstate == sqlstate
    assert not isinstance(caught.value, LedgerUnavailable)


async def test_a_backend_terminated_mid_statement_is_unavailable(
    ledger: Ledger, database_url: str
) -> None:
    await fail_job_inserts_with(database_url, "PERFORM pg_terminate_backend(pg_backend_pid())")
    with pytest.raises(LedgerUnavailable) as caught:
        await ledger.insert_jobs("alice", [new_job()])
    assert isinstance(caught.value.__cause__, (asyncpg.PostgresError, asyncpg.InterfaceError))
    # The pool replaces the dead connection.
    assert await ledger.count_queued(10) == 0


async def test_a_statement_timeout_is_unavailable(ledger: Ledger, database_url: str) -> None:
    async with admin(database_url) as conn:
        db = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE \"{db}\" SET statement_timeout = '200ms'")
    await fail_job_inserts_with(database_url, "PERFORM pg_sleep(30)")
    # The setting applies to new sessions: a fresh ledger.
    fresh = await Ledger.connect(database_url, min_size=1, max_size=1)
    try:
        with pytest.raises(LedgerUnavailable) as caught:
            await fresh.insert_jobs("alice", [new_job()])
        assert isinstance(caught.value.__cause__, asyncpg.QueryCanceledError)
    finally:
        await fresh.close()


async def test_a_lock_timeout_behind_another_transaction_is_unavailable(
    ledger: Ledger, database_url: str
) -> None:
    (job,) = await ledger.insert_jobs("alice", [new_job()])
    async with admin(database_url) as conn:
        db = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE \"{db}\" SET lock_timeout = '100ms'")
        fresh = await Ledger.connect(database_url, min_size=1, max_size=1)
        try:
            async with conn.transaction():
                await conn.execute(
                    "SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE", uuid.UUID(job.job_id)
                )
                with pytest.raises(LedgerUnavailable) as caught:
                    await fresh.cancel_job(job.job_id, "alice")
            assert isinstance(caught.value.__cause__, asyncpg.LockNotAvailableError)
            # Once the lock is gone the same call succeeds: retrying was right.
            canceled = await fresh.cancel_job(job.job_id, "alice")
            assert canceled is not None
        finally:
            await fresh.close()


async def test_connecting_to_a_closed_port_is_unavailable(closed_port: int) -> None:
    with pytest.raises(LedgerUnavailable) as caught:
        await Ledger.connect(f"postgresql://postgres@127.0.0.1:{closed_port}/postgres")
    assert isinstance(caught.value.__cause__, OSError)


async def test_connecting_to_a_missing_database_is_not_retryable(database_url: str) -> None:
    # The database name swapped through the URL's path only: the embedded server's URL names
    # its socket folder in the query (`?host=/tmp/...`), which a split on "/" would cut.
    missing = with_database(database_url, f"no_such_db_{uuid.uuid4().hex[:8]}")
    with pytest.raises(LedgerError) as caught:
        await Ledger.connect(missing, min_size=1, max_size=1)
    assert caught.value.sqlstate == "3D000"


async def test_a_closed_pool_is_unavailable(database_url: str) -> None:
    closed = await Ledger.connect(database_url, min_size=1, max_size=1)
    await closed.close()
    with pytest.raises(LedgerUnavailable) as caught:
        await closed.count_queued(10)
    assert isinstance(caught.value.__cause__, asyncpg.InterfaceError)


async def test_a_duplicate_key_is_a_ledger_error(ledger: Ledger) -> None:
    await ledger.insert_api_key("k1", "alice", b"x" * 32)
    with pytest.raises(LedgerError) as caught:
        await ledger.insert_api_key("k1", "bob", b"y" * 32)
    assert caught.value.sqlstate == "23505"
    assert isinstance(caught.value.__cause__, asyncpg.UniqueViolationError)


async def test_bad_sql_is_a_ledger_error(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ledger_module.QUERIES, "count_queued", "SELEC count(*) FROM jobs")
    with pytest.raises(LedgerError) as caught:
        await ledger.count_queued(10)
    assert caught.value.sqlstate == "42601"


async def test_an_argument_of_the_wrong_type_is_a_ledger_error(ledger: Ledger) -> None:
    with pytest.raises(LedgerError):
        await ledger.count_queued("ten")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionRefusedError(111, "refused"), LedgerUnavailable),
        (TimeoutError(), LedgerUnavailable),
        (asyncpg.InterfaceError("connection is closed"), LedgerUnavailable),
        (asyncpg.exceptions.ConnectionDoesNotExistError("gone"), LedgerUnavailable),
        (asyncpg.exceptions.OutdatedSchemaCacheError("changed"), LedgerUnavailable),
        (asyncpg.exceptions.InvalidCachedStatementError("changed"), LedgerUnavailable),
        (asyncpg.exceptions.ClientConfigurationError("bad option"), LedgerError),
        (asyncpg.exceptions.InvalidPasswordError("no"), LedgerError),
        (asyncpg.exceptions.InternalClientError("bug"), LedgerError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_translation_of_client_side_errors(exc: Exception, expected: type[Exception]) -> None:
    translated = translate_error(exc)
    assert type(translated) is expected
    assert isinstance(translated, LorafleetError)
    assert translated.retryable is (expected is LedgerUnavailable)


def test_errors_that_are_not_the_drivers_are_left_alone() -> None:
    assert translate_error(ValueError("a bug of ours")) is None
    assert translate_error(KeyError("x")) is None


async def test_the_servicer_answers_unavailable_then_internal(
    fleet: Fleet, database_url: str
) -> None:
    """End to end: a retryable ledger failure is UNAVAILABLE; a bug is INTERNAL, its SQL hidden."""
    job = await fleet.alice.submit()
    async with admin(database_url) as conn:
        # GetJob reads the job with its billing; make billing fail in the server.
        await conn.execute(
            "CREATE OR REPLACE FUNCTION lorafleet_gpu_seconds(job uuid)"
            " RETURNS double precision LANGUAGE plpgsql STABLE AS"
            " $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40001'; END $$"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await fleet.alice.get(job.job_id)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        # With gRPC's retry hint, so clients with a retry policy come back on their own.
        assert "retry" in (caught.value.details() or "")
        assert ("grpc-retry-pushback-ms", "1000") in tuple(caught.value.trailing_metadata() or ())
        await conn.execute(
            "CREATE OR REPLACE FUNCTION lorafleet_gpu_seconds(job uuid)"
            " RETURNS double precision LANGUAGE plpgsql STABLE AS"
            " $$ BEGIN RAISE EXCEPTION 'secret detail' USING ERRCODE = '42703'; END $$"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await fleet.alice.get(job.job_id)
        assert caught.value.code() is grpc.StatusCode.INTERNAL
        assert "secret detail" not in (caught.value.details() or "")
