"""The job ledger: one async method per named query in sql/queries.sql.

The ledger is the truth; the worker streams only deliver. Driver errors are translated here into
lorafleet's error tree, and rows into domain values, so nothing above this module sees asyncpg.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from lorafleet.errors import LedgerUnavailable
from lorafleet.model import (
    Checkpoint,
    EventKind,
    FailureClass,
    Job,
    JobEvent,
    JobResult,
    JobState,
    Machine,
    Progress,
)
from lorafleet.spec import JobSpec


def load_queries() -> dict[str, str]:
    text = (importlib.resources.files("lorafleet.scheduler") / "sql" / "queries.sql").read_text()
    sections = re.split(r"^-- name: (\w+)\s*$", text, flags=re.MULTILINE)
    return {name: body.strip() for name, body in zip(sections[1::2], sections[2::2], strict=True)}


QUERIES = load_queries()


@dataclass(frozen=True, kw_only=True)
class NewJob:
    job_id: str
    spec: JobSpec
    idempotency_key: str
    traceparent: str


@dataclass(frozen=True, kw_only=True)
class ExpiredLease:
    job_id: str
    lease_id: str
    machine_id: str
    epoch: int


@dataclass(frozen=True, kw_only=True)
class ApiKeyRecord:
    key_id: str
    owner: str
    secret_sha256: bytes


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def job_from_row(row: asyncpg.Record) -> Job:
    spec = JobSpec.from_dict(row["spec"])
    checkpoint = None
    if row["checkpoint_key"] is not None:
        checkpoint = Checkpoint(
            step=row["checkpoint_step"],
            epoch=row["checkpoint_epoch"],
            key=row["checkpoint_key"],
            size_bytes=row["checkpoint_bytes"],
            sha256=row["checkpoint_sha256"],
            committed_at=row["checkpoint_at"],
        )
    result = None
    if row["result_key"] is not None:
        result = JobResult(
            key=row["result_key"], size_bytes=row["result_bytes"], sha256=row["result_sha256"]
        )
    return Job(
        job_id=str(row["job_id"]),
        owner=row["owner"],
        spec=spec,
        state=JobState(row["state"]),
        epoch=row["epoch"],
        failures=row["failures"],
        progress=Progress(
            step=row["progress_step"],
            max_steps=row["max_train_steps"],
            loss=row["progress_loss"],
            learning_rate=row["progress_lr"],
            seconds_per_step=row["progress_s_per_step"],
            machine_id=row["progress_machine_id"],
            updated_at=row["progress_at"],
        ),
        latest_checkpoint=checkpoint,
        result=result,
        error=row["error"],
        failure_class=FailureClass(row["failure_class"]) if row["failure_class"] else None,
        machine_id=row["machine_id"],
        lease_id=_opt_str(row["lease_id"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        traceparent=row["traceparent"],
        gpu_seconds=float(row["gpu_seconds"] or 0) if "gpu_seconds" in row else None,
    )


def event_from_row(row: asyncpg.Record) -> JobEvent:
    checkpoint = None
    if row["checkpoint_key"] is not None:
        checkpoint = Checkpoint(
            step=row["step"] or 0,
            epoch=row["epoch"] or 0,
            key=row["checkpoint_key"],
            size_bytes=row["checkpoint_bytes"] or 0,
            sha256=row["checkpoint_sha256"] or "",
        )
    return JobEvent(
        event_id=row["event_id"],
        job_id=str(row["job_id"]),
        kind=EventKind(row["kind"]),
        at=row["at"],
        machine_id=row["machine_id"],
        lease_id=_opt_str(row["lease_id"]),
        epoch=row["epoch"],
        step=row["step"],
        loss=row["loss"],
        seconds_per_step=row["seconds_per_step"],
        message=row["message"],
        failure_class=FailureClass(row["failure_class"]) if row["failure_class"] else None,
        state=JobState(row["state"]) if row["state"] else None,
        checkpoint=checkpoint,
    )


def checkpoint_from_row(row: asyncpg.Record) -> Checkpoint:
    return Checkpoint(
        step=row["step"],
        epoch=row["epoch"],
        key=row["key"],
        size_bytes=row["size_bytes"],
        sha256=row["sha256"],
        committed_at=row["committed_at"],
    )


class Ledger:
    """All reads and writes of the job ledger. Create with `await Ledger.connect(url)`."""

    def __init__(self, pool: asyncpg.Pool, dsn: str) -> None:
        self._pool = pool
        self._dsn = dsn

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 2, max_size: int = 20) -> Ledger:
        try:
            pool = await asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size, init=_init_connection
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise LedgerUnavailable(f"cannot reach the ledger database: {exc}") from exc
        assert pool is not None
        return cls(pool, dsn)

    async def close(self) -> None:
        await self._pool.close()

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        try:
            async with self._pool.acquire() as conn:
                yield conn
        except (OSError, asyncpg.exceptions.ConnectionDoesNotExistError) as exc:
            raise LedgerUnavailable(f"ledger connection failed: {exc}") from exc

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self._conn() as conn:
            rows: list[asyncpg.Record] = await conn.fetch(QUERIES[query], *args)
            return rows

    async def _fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        async with self._conn() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(QUERIES[query], *args)
            return row

    async def listen(self, channel: str, callback: Callable[[str], None]) -> asyncpg.Connection:
        """A dedicated connection delivering `channel`'s payloads; close it to stop."""
        conn: asyncpg.Connection = await asyncpg.connect(self._dsn)
        await conn.add_listener(channel, lambda _c, _pid, _ch, payload: callback(payload))
        return conn

    # API keys ---------------------------------------------------------------------------------

    async def insert_api_key(
        self,
        key_id: str,
        owner: str,
        secret_sha256: bytes,
        *,
        webhook_url: str | None = None,
        webhook_events: Sequence[str] = (),
    ) -> str:
        """Stores the key; returns its webhook signing secret."""
        row = await self._fetchrow(
            "insert_api_key", key_id, owner, secret_sha256, webhook_url, list(webhook_events)
        )
        assert row is not None
        secret: str = row["webhook_secret"]
        return secret

    async def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        row = await self._fetchrow("get_api_key", key_id)
        if row is None:
            return None
        return ApiKeyRecord(
            key_id=row["key_id"], owner=row["owner"], secret_sha256=bytes(row["secret_sha256"])
        )

    async def revoke_api_key(self, key_id: str) -> bool:
        return await self._fetchrow("revoke_api_key", key_id) is not None

    async def list_api_keys(self) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._fetch("list_api_keys")]

    # Jobs -------------------------------------------------------------------------------------

    async def insert_jobs(
        self, owner: str, jobs: Sequence[NewJob], *, api_key_id: str | None = None
    ) -> list[Job]:
        """All or nothing; returns the jobs in input order (earlier ones for reused keys)."""
        async with self._conn() as conn, conn.transaction():
            rows = await conn.fetch(
                QUERIES["insert_jobs"],
                owner,
                [uuid.UUID(j.job_id) for j in jobs],
                [j.idempotency_key for j in jobs],
                [j.spec.to_dict() for j in jobs],
                [j.spec.priority for j in jobs],
                [j.spec.min_vram_mb for j in jobs],
                [j.spec.max_failures for j in jobs],
                [j.spec.max_train_steps for j in jobs],
                [dict(j.spec.labels) for j in jobs],
                [j.traceparent for j in jobs],
                api_key_id,
            )
            by_id = {str(r["job_id"]): job_from_row(r) for r in rows}
            by_key: dict[str, Job] = {}
            reused = [
                j.idempotency_key for j in jobs if j.idempotency_key and j.job_id not in by_id
            ]
            if reused:
                for r in await conn.fetch(QUERIES["get_jobs_by_idempotency_key"], owner, reused):
                    by_key[r["idempotency_key"]] = job_from_row(r)
        return [by_id.get(j.job_id) or by_key[j.idempotency_key] for j in jobs]

    async def get_job(self, job_id: str, owner: str) -> Job | None:
        row = await self._fetchrow("get_job", uuid.UUID(job_id), owner)
        return None if row is None else job_from_row(row)

    async def get_job_any_owner(self, job_id: str) -> Job | None:
        row = await self._fetchrow("get_job_any_owner", uuid.UUID(job_id))
        return None if row is None else job_from_row(row)

    async def list_jobs(
        self,
        owner: str,
        *,
        states: Sequence[JobState],
        labels: Mapping[str, str],
        after: tuple[datetime, str] | None,
        limit: int,
    ) -> list[Job]:
        rows = await self._fetch(
            "list_jobs",
            owner,
            [s.value for s in states],
            dict(labels),
            after[0] if after else None,
            uuid.UUID(after[1]) if after else None,
            limit,
        )
        return [job_from_row(r) for r in rows]

    async def cancel_job(self, job_id: str, owner: str) -> Job | None:
        """Cancels a queued or running job; None when it was not cancelable (or not found)."""
        row = await self._fetchrow("cancel_job", uuid.UUID(job_id), owner)
        return None if row is None else job_from_row(row)

    # Leases (the worker stream) ---------------------------------------------------------------

    async def claim_job(self, machine_id: str, vram_mb: int, lease_ttl_s: float) -> Job | None:
        row = await self._fetchrow("claim_job", machine_id, vram_mb, uuid.uuid4(), lease_ttl_s)
        return None if row is None else job_from_row(row)

    async def resume_lease(
        self, lease_id: str, epoch: int, machine_id: str, lease_ttl_s: float
    ) -> Job | None:
        row = await self._fetchrow(
            "resume_lease", _uuid_or_nil(lease_id), epoch, machine_id, lease_ttl_s
        )
        return None if row is None else job_from_row(row)

    async def heartbeat(
        self,
        lease_id: str,
        epoch: int,
        lease_ttl_s: float,
        *,
        step: int,
        loss: float | None,
        learning_rate: float | None,
        seconds_per_step: float | None,
    ) -> bool:
        """Extends the lease; False when it is no longer the job's (the sender is fenced off)."""
        row = await self._fetchrow(
            "heartbeat",
            _uuid_or_nil(lease_id),
            epoch,
            lease_ttl_s,
            step,
            loss,
            learning_rate,
            seconds_per_step,
        )
        return row is not None

    async def expire_leases(self) -> list[ExpiredLease]:
        rows = await self._fetch("expire_leases")
        return [
            ExpiredLease(
                job_id=str(r["job_id"]),
                lease_id=str(r["lease_id"]),
                machine_id=r["machine_id"],
                epoch=r["epoch"],
            )
            for r in rows
        ]

    async def drain_lease(self, lease_id: str, epoch: int, reason: str) -> Job | None:
        row = await self._fetchrow("drain_lease", _uuid_or_nil(lease_id), epoch, reason)
        return None if row is None else job_from_row(row)

    async def fail_attempt(
        self, lease_id: str, epoch: int, failure_class: FailureClass, message: str
    ) -> Job | None:
        row = await self._fetchrow(
            "fail_attempt", _uuid_or_nil(lease_id), epoch, failure_class.value, message
        )
        return None if row is None else job_from_row(row)

    async def commit_checkpoint(self, lease_id: str, epoch: int, checkpoint: Checkpoint) -> bool:
        row = await self._fetchrow(
            "commit_checkpoint",
            _uuid_or_nil(lease_id),
            epoch,
            checkpoint.step,
            checkpoint.key,
            checkpoint.size_bytes,
            checkpoint.sha256,
        )
        return row is not None

    async def succeed_job(
        self, lease_id: str, epoch: int, result: JobResult, *, step: int, loss: float | None
    ) -> Job | None:
        row = await self._fetchrow(
            "succeed_job",
            _uuid_or_nil(lease_id),
            epoch,
            result.key,
            result.size_bytes,
            result.sha256,
            step,
            loss,
        )
        return None if row is None else job_from_row(row)

    # Checkpoint retention ---------------------------------------------------------------------

    async def live_checkpoints(self, job_id: str) -> list[Checkpoint]:
        return [
            checkpoint_from_row(r) for r in await self._fetch("live_checkpoints", uuid.UUID(job_id))
        ]

    async def checkpoints_to_delete(self, job_id: str, keep: int) -> list[str]:
        rows = await self._fetch("checkpoints_to_delete", uuid.UUID(job_id), keep)
        return [r["key"] for r in rows]

    async def finished_jobs_with_checkpoints(self, limit: int) -> list[str]:
        return [
            str(r["job_id"]) for r in await self._fetch("finished_jobs_with_checkpoints", limit)
        ]

    async def mark_checkpoints_deleted(self, job_id: str, keys: Sequence[str]) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["mark_checkpoints_deleted"], uuid.UUID(job_id), list(keys))

    # Machines and events ----------------------------------------------------------------------

    async def upsert_machine(self, machine: Machine, qualification: Mapping[str, Any]) -> None:
        async with self._conn() as conn:
            await conn.execute(
                QUERIES["upsert_machine"],
                machine.machine_id,
                machine.provider_instance_id,
                machine.gpu_model,
                machine.vram_mb,
                machine.qualified,
                dict(qualification),
                machine.version,
            )

    async def touch_machine(self, machine_id: str) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["touch_machine"], machine_id)

    async def list_events(self, job_id: str, after_event_id: int, limit: int) -> list[JobEvent]:
        rows = await self._fetch("list_events", uuid.UUID(job_id), after_event_id, limit)
        return [event_from_row(r) for r in rows]

    async def count_queued(self, limit: int) -> int:
        row = await self._fetchrow("count_queued", limit)
        assert row is not None
        count: int = row[0]
        return count

    # Webhook outbox -------------------------------------------------------------------------

    async def claim_webhook_deliveries(self, limit: int, claim_s: float) -> list[WebhookDelivery]:
        rows = await self._fetch("claim_webhook_deliveries", limit, claim_s)
        return [
            WebhookDelivery(
                delivery_id=r["delivery_id"],
                job_id=str(r["job_id"]),
                event=r["event"],
                url=r["url"],
                payload=r["payload"],
                attempts=r["attempts"],
                secret=r["webhook_secret"],
            )
            for r in rows
        ]

    async def webhook_delivered(self, delivery_id: int, status: int) -> None:
        await self._fetch("webhook_delivered", delivery_id, status)

    async def webhook_failed(
        self, delivery_id: int, status: int | None, error: str, retry_in_s: float | None
    ) -> None:
        """Records a failed attempt; `retry_in_s` None gives up on the delivery."""
        await self._fetch("webhook_failed", delivery_id, status, error[:2000], retry_in_s)

    async def next_webhook_due(self) -> float | None:
        row = await self._fetchrow("next_webhook_due")
        return None if row is None or row[0] is None else float(row[0])

    async def list_webhook_deliveries(self, job_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._fetch("list_webhook_deliveries", uuid.UUID(job_id))]

    async def job_leases(self, job_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._fetch("job_leases", uuid.UUID(job_id))]


@dataclass(frozen=True, kw_only=True)
class WebhookDelivery:
    delivery_id: int
    job_id: str
    event: str
    url: str
    payload: dict[str, Any]
    attempts: int
    secret: str


def _uuid_or_nil(value: str) -> uuid.UUID:
    """A malformed lease id matches no lease (the caller then refuses the message as stale)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        return uuid.UUID(int=0)
