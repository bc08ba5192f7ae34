"""The job ledger: one async method per named query in sql/queries.sql.

The ledger is the truth; the worker streams only deliver. Driver errors are translated here into
lorafleet's error tree, and rows into domain values, so nothing above this module sees asyncpg:

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
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from lorafleet.core.errors import LedgerUnavailable, LorafleetError
from lorafleet.core.families import FAMILIES
from lorafleet.core.fit import vram_need_mb
from lorafleet.core.model import (
    Checkpoint,
    ClassImage,
    EventKind,
    FailureClass,
    Job,
    JobEvent,
    JobResult,
    JobState,
    Machine,
    Progress,
    Qualification,
    SampleSettings,
    SampleTask,
    StoredImage,
    WarmState,
)
from lorafleet.core.spec import JobShape, JobSpec
from lorafleet.ledger.rows import record


def load_queries() -> dict[str, str]:
    text = (importlib.resources.files("lorafleet.ledger") / "sql" / "queries.sql").read_text()
    sections = re.split(r"^-- name: (\w+)\s*$", text, flags=re.MULTILINE)
    return {name: body.strip() for name, body in zip(sections[1::2], sections[2::2], strict=True)}


QUERIES = load_queries()

# Identity providers whose machines the operator itself runs: `lorafleet up`'s local supervisor
# and EC2 (instances in the operator's own accounts). An input fault one of them reports fails
# the job at once; a stranger's machine (SaladCloud, or unverified) needs a second to agree.
OPERATOR_RUN_PROVIDERS = ("local", "ec2")


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
    # The last step its holder reported (None: none), the job's newest checkpoint (where the
    # next lease resumes) and the difference: the steps lost, at least.
    last_step: int | None = None
    resume_step: int = 0
    steps_lost: int = 0


@dataclass(frozen=True, kw_only=True)
class StalledLease:
    """A lease revoked for making no verified progress (`stall_leases`)."""

    job_id: str
    lease_id: str
    machine_id: str
    epoch: int
    job_state: JobState
    silent_s: int


@dataclass(frozen=True, kw_only=True)
class ApiKeyRecord:
    key_id: str
    owner: str
    secret_sha256: bytes


@dataclass(frozen=True, kw_only=True)
class KeySpending:
    """A key's spend limit (None: none) and the GPU-seconds billed to its jobs so far."""

    spend_limit_dollars: float | None
    gpu_seconds: float


@dataclass(frozen=True, kw_only=True)
class ShapeWork:
    """Steps still to run of a key's unfinished jobs of one shape."""

    shape: JobShape
    steps: int


@dataclass(frozen=True, kw_only=True)
class ShapePace:
    """The fleet's pace on jobs of one shape from verified completions: the median over
    `machines` provider-verified machines (one figure each); 0 s/step when there are none."""

    machines: int
    seconds_per_step: float


@dataclass(frozen=True, kw_only=True)
class ApiKeyInfo:
    """An API key as an operator lists it (never its secret)."""

    key_id: str
    owner: str
    created_at: datetime
    revoked_at: datetime | None
    webhook_url: str | None


@dataclass(frozen=True, kw_only=True)
class LeaseRecord:
    """One lease ever granted (the audit trail that billing sums over)."""

    lease_id: str
    job_id: str
    epoch: int
    machine_id: str
    granted_at: datetime
    last_heartbeat_at: datetime
    ended_at: datetime | None
    end_reason: str | None


@dataclass(frozen=True, kw_only=True)
class WebhookDeliveryRecord:
    """One outbox row as its owner sees it: where it went, how often, how it ended."""

    delivery_id: int
    event: str
    url: str
    attempts: int
    last_status: int | None
    last_error: str | None
    delivered_at: datetime | None
    gave_up_at: datetime | None
    created_at: datetime
    next_attempt_at: datetime


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    """One machine of the node registry, with what its leases say about it."""

    machine_id: str
    provider_instance_id: str
    # Who vouched for the machine's id on its current stream ("": unverified, a claim).
    identity_provider: str
    gpu_model: str
    vram_mb: int
    # None until the worker's Hello (with its qualification probe) is recorded.
    qualified: bool | None
    qualification_detail: str | None
    version: str
    first_seen_at: datetime
    last_seen_at: datetime
    lease_job_id: str | None
    node_faults: int
    # When its node faults within the asked window happened (epoch seconds, newest first).
    recent_fault_times: tuple[float, ...]
    jobs_finished: int


@dataclass(frozen=True, kw_only=True)
class Interruptions:
    """Leases of one node class ended by expiry or drain over a window, and the lease-seconds
    held (provider-verified machines only). `interruptions` counts at most one per machine
    (queries.sql, interruptions_for_gpu)."""

    interruptions: float
    lease_seconds: float


@dataclass(frozen=True, kw_only=True)
class PaceRecord:
    """One lease's pace as the scheduler observed it (steps between the first and the last
    verified checkpoint over the ledger's clock; None with fewer than two), beside what its
    holder reported (a claim, believed only against the holder itself), with the job's shape."""

    machine_id: str
    job_id: str
    epoch: int
    live: bool
    observed_steps: int | None
    observed_seconds: float | None
    # A lease that ended with a verified result: the steps it had to run, grant to end (the
    # model's loading included; None otherwise).
    completed_steps: int | None
    completed_seconds: float | None
    reported_seconds_per_step: float | None
    reported_steps: int
    # The job's shape (JobSpec.shape) and whether the holder said its step ran compiled.
    shape: JobShape
    step_compiled: bool | None
    gpu_class: str
    # Who vouched for the machine's id ("": nobody; its reports touch no one else).
    identity_provider: str


@dataclass(frozen=True, kw_only=True)
class PaceReference:
    """The scaler's learned reference pace of a GPU class (seconds per 1024x1024 image step)
    and when it last moved (epoch s, the scaler's clock)."""

    gpu_class: str
    seconds_per_step: float
    machines: int
    updated_at: float


@dataclass(frozen=True, kw_only=True)
class ScalerWork:
    queued: int
    # Leases held by listed or provider-verified machines; `unplaced`: the others.
    running: int
    unplaced: int
    last_finished_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class BannedQueuedJob:
    job_id: str
    banned_machines: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ScalerAction:
    """A decision the scaler carried out (epoch seconds on the scaler's clock)."""

    at: float
    action: str
    target: str
    job_id: str | None


@dataclass(frozen=True, kw_only=True)
class ScalerDecisionRecord:
    decision_id: int
    at: datetime
    last_at: datetime
    repeats: int
    scaler_id: str
    action: str
    target: str
    job_id: str | None
    reason: str
    figures: dict[str, Any]
    applied: bool
    error: str | None


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


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
        kohya = None
        if row["result_kohya_key"] is not None:
            kohya = JobResult(
                key=row["result_kohya_key"],
                size_bytes=row["result_kohya_bytes"],
                sha256=row["result_kohya_sha256"],
            )
        result = JobResult(
            key=row["result_key"],
            size_bytes=row["result_bytes"],
            sha256=row["result_sha256"],
            kohya=kohya,
        )
    return record(
        Job,
        row,
        spec=spec,
        state=JobState(row["state"]),
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
        failure_class=FailureClass(row["failure_class"]) if row["failure_class"] else None,
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
    return record(
        JobEvent,
        row,
        kind=EventKind(row["kind"]),
        failure_class=FailureClass(row["failure_class"]) if row["failure_class"] else None,
        state=JobState(row["state"]) if row["state"] else None,
        checkpoint=checkpoint,
    )


def checkpoint_from_row(row: asyncpg.Record) -> Checkpoint:
    return record(Checkpoint, row)


@dataclass(frozen=True, kw_only=True)
class Quarantine:
    """A machine with `threshold` node faults in the last `window_s` seconds is granted
    nothing (no job, no sample task) until the window passes or the scaler replaces it; so is
    one with `empty_lease_limit` leases in the window that ended (dropped by a Ready, drained,
    expired) without a checkpoint: taking and dropping leases collects their URLs and
    delays their jobs, and an honest node rarely does it."""

    threshold: int = 3
    window_s: float = 3600.0
    empty_lease_limit: int = 10


# A machine's word against a job (an internal error toward max_failures, an input fault's
# confirmation) counts only if it delivered a verified result this long before the job was
# submitted (lorafleet_good_standing): machines arriving together have no say for 6 hours.
STANDING_MIN_AGE_S = 6 * 3600.0


class Ledger:
    """All reads and writes of the job ledger. Create with `await Ledger.connect(url)`."""

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
    ) -> Ledger:
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

    # API keys ------------------------------------------------------------------------------------

    async def insert_api_key(
        self,
        key_id: str,
        owner: str,
        secret_sha256: bytes,
        *,
        webhook_url: str | None = None,
        webhook_events: Sequence[str] = (),
        spend_limit_dollars: float | None = None,
    ) -> str:
        """Stores the key; returns its webhook signing secret."""
        row = await self._fetchrow(
            "insert_api_key",
            key_id,
            owner,
            secret_sha256,
            webhook_url,
            list(webhook_events),
            spend_limit_dollars,
        )
        assert row is not None
        secret: str = row["webhook_secret"]
        return secret

    async def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        row = await self._fetchrow("get_api_key", key_id)
        if row is None:
            return None
        return record(ApiKeyRecord, row)

    async def key_spending(self, key_id: str) -> KeySpending:
        row = await self._fetchrow("key_spending", key_id)
        if row is None:
            return KeySpending(spend_limit_dollars=None, gpu_seconds=0.0)
        return record(KeySpending, row)

    async def key_unfinished_work(self, key_id: str) -> list[ShapeWork]:
        return [
            ShapeWork(shape=JobSpec.from_dict(r["spec"]).shape, steps=r["steps"])
            for r in await self._fetch("key_unfinished_work", key_id)
        ]

    async def revoke_api_key(self, key_id: str) -> bool:
        return await self._fetchrow("revoke_api_key", key_id) is not None

    async def list_api_keys(self) -> list[ApiKeyInfo]:
        return [record(ApiKeyInfo, r) for r in await self._fetch("list_api_keys")]

    # Fleet figures: paces and interruptions ------------------------------------------------------

    async def pace_for_shape(
        self,
        *,
        window_s: float,
        shape_key: str,
        min_seconds_per_step: float,
        api_key_id: str | None = None,
    ) -> ShapePace:
        """The pace on jobs whose shape key (`JobSpec.shape.key`) is `shape_key`.
        `api_key_id`: only that key's jobs (a tenant's own figure); None: every job."""
        row = await self._fetchrow(
            "pace_for_shape", window_s, shape_key, min_seconds_per_step, api_key_id or ""
        )
        assert row is not None
        return record(ShapePace, row)

    async def interruptions_for_gpu(self, gpu_model: str, *, window_s: float) -> Interruptions:
        row = await self._fetchrow("interruptions_for_gpu", window_s, gpu_model)
        assert row is not None
        return record(Interruptions, row)

    # Jobs ----------------------------------------------------------------------------------------

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
                # The job's memory need, which claims filter by: the spec's or the estimate.
                [vram_need_mb(j.spec) for j in jobs],
                [j.spec.max_failures for j in jobs],
                [j.spec.max_train_steps for j in jobs],
                [dict(j.spec.labels) for j in jobs],
                [j.traceparent for j in jobs],
                api_key_id,
                [j.spec.resident_key for j in jobs],
                [j.spec.compiled_shape_key for j in jobs],
                [j.spec.adapter_shape_key for j in jobs],
                [j.spec.family for j in jobs],
                [j.spec.shape.key for j in jobs],
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

    async def fill_warm_keys(self, batch: int = 1000) -> int:
        """Computes the warm keys of unfinished jobs submitted before the ledger had them
        (0016, 0019), and the shape key of every job from before 0020, from the one definition
        (JobSpec); returns how many it filled."""
        filled = 0
        while rows := await self._fetch("jobs_without_warm_keys", batch):
            specs = [(r["job_id"], JobSpec.from_dict(r["spec"])) for r in rows]
            await self._fetch(
                "set_warm_keys",
                [job_id for job_id, _ in specs],
                [spec.resident_key for _, spec in specs],
                [spec.compiled_shape_key for _, spec in specs],
                [spec.adapter_shape_key for _, spec in specs],
                [spec.shape.key for _, spec in specs],
            )
            filled += len(rows)
        return filled

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
        async with self._conn() as conn, conn.transaction():
            # Two statements: the second one's snapshot sees a lease granted while the first
            # waited for the row (READ COMMITTED takes a snapshot per statement).
            await conn.execute(QUERIES["lock_job"], uuid.UUID(job_id))
            row = await conn.fetchrow(QUERIES["cancel_job"], uuid.UUID(job_id), owner)
        return None if row is None else job_from_row(row)

    # Leases (the worker stream) ------------------------------------------------------------------

    async def claim_job(
        self,
        machine_id: str,
        vram_mb: int,
        lease_ttl_s: float,
        *,
        secret_sha256: bytes,
        warm: WarmState | None = None,
        warm_bound_s: float = 0.0,
        families: Sequence[str] = FAMILIES,
    ) -> Job | None:
        """Grants the best claimable job a new lease whose secret has this digest; nothing to
        a quarantined machine (`self.quarantine`). Only a job whose memory need fits `vram_mb`
        and whose family is one of `families` (the worker's Hello). Prefers a job the worker is
        `warm` for, unless a job has waited `warm_bound_s` (0: strict queue order)."""
        q = self.quarantine
        warm = warm or WarmState()
        row = await self._fetchrow(
            "claim_job",
            machine_id,
            vram_mb,
            uuid.uuid4(),
            lease_ttl_s,
            secret_sha256,
            q.threshold,
            q.window_s,
            q.empty_lease_limit,
            warm.resident,
            list(warm.compiled_shapes),
            warm_bound_s,
            list(warm.adapter_shapes),
            list(families),
        )
        return None if row is None else job_from_row(row)

    async def resume_lease(
        self,
        lease_id: str,
        epoch: int,
        machine_id: str,
        lease_ttl_s: float,
        *,
        secret_sha256: bytes,
    ) -> Job | None:
        row = await self._fetchrow(
            "resume_lease", _uuid_or_nil(lease_id), epoch, machine_id, lease_ttl_s, secret_sha256
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
        on_timeline: bool = True,
        step_compiled: bool | None = None,
    ) -> bool:
        """Extends the lease; False when it is no longer the job's (the sender is fenced off).
        `on_timeline`: also record a HEARTBEAT event (callers rate-limit those).
        `step_compiled`: whether the holder says its step runs compiled (None: not said)."""
        row = await self._fetchrow(
            "heartbeat",
            _uuid_or_nil(lease_id),
            epoch,
            lease_ttl_s,
            step,
            loss,
            learning_rate,
            seconds_per_step,
            on_timeline,
            step_compiled,
        )
        return row is not None

    async def record_canceled_progress(
        self,
        lease_id: str,
        epoch: int,
        machine_id: str,
        *,
        step: int,
        loss: float | None,
        learning_rate: float | None,
        seconds_per_step: float | None,
    ) -> bool:
        """The step `machine_id` reached on a lease its job's cancel ended: shown as the
        canceled job's progress. False: not that lease's holder, not ended by a cancel, or not
        past the progress recorded."""
        row = await self._fetchrow(
            "record_canceled_progress",
            _uuid_or_nil(lease_id),
            epoch,
            machine_id,
            step,
            loss,
            learning_rate,
            seconds_per_step,
        )
        return row is not None

    async def expire_leases(self) -> list[ExpiredLease]:
        rows = await self._fetch("expire_leases")
        return [record(ExpiredLease, r) for r in rows]

    async def stall_leases(self, progress_timeout_s: float) -> list[StalledLease]:
        rows = await self._fetch("stall_leases", progress_timeout_s)
        return [record(StalledLease, r, job_state=JobState(r["new_state"])) for r in rows]

    async def drain_lease(self, lease_id: str, epoch: int, reason: str) -> Job | None:
        row = await self._fetchrow("drain_lease", _uuid_or_nil(lease_id), epoch, reason)
        return None if row is None else job_from_row(row)

    async def fail_attempt(
        self, lease_id: str, epoch: int, failure_class: FailureClass, message: str
    ) -> Job | None:
        row = await self._fetchrow(
            "fail_attempt",
            _uuid_or_nil(lease_id),
            epoch,
            failure_class.value,
            message,
            list(OPERATOR_RUN_PROVIDERS),
            self.fleet_max_vram_mb,
            self.standing_min_age_s,
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

    async def commit_class_images(
        self, lease_id: str, epoch: int, images: Sequence[ClassImage]
    ) -> bool:
        """Records generated class images the store verified, under the live lease only (one
        statement: all of them or none). False: the lease is no longer the job's."""
        row = await self._fetchrow(
            "commit_class_images",
            _uuid_or_nil(lease_id),
            epoch,
            [image.index for image in images],
            [image.key for image in images],
            [image.size_bytes for image in images],
            [image.sha256 for image in images],
        )
        return row is not None

    async def recorded_class_images(self, job_id: str, epoch: int) -> list[ClassImage]:
        """The class images leases before `epoch` recorded, the newest per index, by index."""
        rows = await self._fetch("recorded_class_images", uuid.UUID(job_id), epoch)
        return [record(ClassImage, r, index=r["image_index"]) for r in rows]

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
            result.kohya.key if result.kohya else None,
            result.kohya.size_bytes if result.kohya else None,
            result.kohya.sha256 if result.kohya else None,
        )
        return None if row is None else job_from_row(row)

    async def set_lease_interval(self, lease_id: str, epoch: int, steps: int, notice: str) -> bool:
        """Records the checkpoint interval chosen for a live lease (checkpointing_steps auto):
        the stall bound and its progress rule follow what the holder was told; `notice` (what
        it was chosen from) goes on the job's timeline with it."""
        row = await self._fetchrow(
            "set_lease_interval", _uuid_or_nil(lease_id), epoch, steps, notice
        )
        return row is not None

    async def record_notice(self, lease_id: str, epoch: int, message: str) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["record_notice"], _uuid_or_nil(lease_id), epoch, message)

    async def lease_is_live(self, lease_id: str) -> bool:
        row = await self._fetchrow("lease_is_live", _uuid_or_nil(lease_id))
        return bool(row is not None and row[0])

    # Checkpoint retention ------------------------------------------------------------------------

    async def live_checkpoints(self, job_id: str) -> list[Checkpoint]:
        return [
            checkpoint_from_row(r) for r in await self._fetch("live_checkpoints", uuid.UUID(job_id))
        ]

    async def checkpoints_to_delete(self, job_id: str, keep: int) -> list[str]:
        rows = await self._fetch("checkpoints_to_delete", uuid.UUID(job_id), keep)
        return [r["key"] for r in rows]

    async def jobs_to_sweep(self, limit: int, url_ttl_s: float) -> list[tuple[str, set[str]]]:
        """(job id, recorded result keys) of finished jobs whose storage is due a sweep."""
        rows = await self._fetch("jobs_to_sweep", limit, url_ttl_s)
        return [
            (str(r["job_id"]), {k for k in (r["result_key"], r["result_kohya_key"]) if k})
            for r in rows
        ]

    async def mark_storage_swept(self, job_id: str) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["mark_storage_swept"], uuid.UUID(job_id))

    async def finished_jobs_with_checkpoints(self, limit: int) -> list[str]:
        return [
            str(r["job_id"]) for r in await self._fetch("finished_jobs_with_checkpoints", limit)
        ]

    async def mark_checkpoints_deleted(self, job_id: str, keys: Sequence[str]) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["mark_checkpoints_deleted"], uuid.UUID(job_id), list(keys))

    # Machines and replicas -----------------------------------------------------------------------

    async def upsert_machine(self, machine: Machine, qualification: Qualification) -> None:
        async with self._conn() as conn:
            await conn.execute(
                QUERIES["upsert_machine"],
                machine.machine_id,
                machine.provider_instance_id,
                machine.gpu_model,
                machine.vram_mb,
                machine.qualified,
                qualification.to_json(),
                machine.version,
            )

    async def touch_machine(self, machine_id: str, session_sha256: bytes | None) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["touch_machine"], machine_id, session_sha256)

    async def expire_machines(self, silent_s: float) -> list[str]:
        """Deletes never-verified machines silent for `silent_s` that nothing names (see the
        query); returns their ids."""
        return [str(r["machine_id"]) for r in await self._fetch("expire_machines", silent_s)]

    async def claim_machine_session(
        self,
        machine_id: str,
        *,
        presented_sha256: bytes | None,
        new_sha256: bytes,
        silent_s: float,
        identity_provider: str = "",
    ) -> bool:
        """True if this stream now holds the machine id (see the query for the rule);
        `identity_provider` names who vouched for the stream's id ("": nobody)."""
        row = await self._fetchrow(
            "claim_machine_session",
            machine_id,
            presented_sha256,
            new_sha256,
            silent_s,
            identity_provider,
        )
        return row is not None

    async def release_machine_session(self, machine_id: str, session_sha256: bytes) -> None:
        """The stream holding `session_sha256` left after draining: the id is free at once."""
        await self._fetch("release_machine_session", machine_id, session_sha256)

    async def start_replica(self, replica_id: str, lease_ttl_s: float, down_after_s: float) -> int:
        """Registers a starting replica. If none was seen for `down_after_s`, every running
        lease gets at least a TTL from now. Returns how many leases were extended."""
        row = await self._fetchrow("start_replica", replica_id, lease_ttl_s, down_after_s)
        assert row is not None
        extended: int = row[0]
        return extended

    async def touch_replica(self, replica_id: str) -> None:
        async with self._conn() as conn:
            await conn.execute(QUERIES["touch_replica"], replica_id)

    async def attend_replica(self, replica_id: str, lease_ttl_s: float, down_after_s: float) -> int:
        """Replica `replica_id` reaches the ledger. If no replica had for `down_after_s` (the
        ledger's clock), every lease live when one last had gets at least a TTL from now: a
        lease's TTL counts only time in which its holder could have been heard. Returns how
        many job leases were extended."""
        row = await self._fetchrow("attend_replica", replica_id, lease_ttl_s, down_after_s)
        assert row is not None
        extended: int = row[0]
        return extended

    # The timeline and counts ---------------------------------------------------------------------

    async def list_events(self, job_id: str, after_event_id: int, limit: int) -> list[JobEvent]:
        rows = await self._fetch("list_events", uuid.UUID(job_id), after_event_id, limit)
        return [event_from_row(r) for r in rows]

    async def count_queued(self, limit: int) -> int:
        row = await self._fetchrow("count_queued", limit)
        assert row is not None
        count: int = row[0]
        return count

    async def count_jobs_by_state(self, cap: int) -> dict[str, int]:
        rows = await self._fetch("count_jobs_by_state", cap)
        return {str(r[0]): int(r[1]) for r in rows}

    async def job_leases(self, job_id: str) -> list[LeaseRecord]:
        """Every lease the job was ever granted, oldest first."""
        return [record(LeaseRecord, r) for r in await self._fetch("job_leases", uuid.UUID(job_id))]

    # Webhook outbox ------------------------------------------------------------------------------

    async def claim_webhook_deliveries(self, limit: int, claim_s: float) -> list[WebhookDelivery]:
        rows = await self._fetch("claim_webhook_deliveries", limit, claim_s)
        return [record(WebhookDelivery, r, secret=r["webhook_secret"]) for r in rows]

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

    async def list_webhook_deliveries(self, job_id: str) -> list[WebhookDeliveryRecord]:
        return [
            record(WebhookDeliveryRecord, r)
            for r in await self._fetch("list_webhook_deliveries", uuid.UUID(job_id))
        ]

    # The scaler ----------------------------------------------------------------------------------

    async def drop_lease(self, machine_id: str, job_id: str, reason: str) -> Job | None:
        """Ends machine's lease on the job, re-queues it from its checkpoint (no failure
        counted) and bans the machine for it; None when the machine holds no such lease."""
        row = await self._fetchrow("drop_lease", machine_id, _uuid_or_nil(job_id), reason)
        return None if row is None else job_from_row(row)

    async def list_nodes(
        self, machine_ids: Sequence[str] | None, *, fault_window_s: float, limit: int
    ) -> list[NodeRecord]:
        """These machines (None: every one, most recently seen first)."""
        rows = await self._fetch(
            "list_nodes",
            None if machine_ids is None else list(machine_ids),
            fault_window_s,
            limit,
        )
        return [record(NodeRecord, r) for r in rows]

    async def pace_observations(self, window_s: float, limit: int) -> list[PaceRecord]:
        rows = await self._fetch("pace_observations", window_s, limit)
        # One spec read per distinct shape key, not per lease (a tick reads thousands).
        shapes: dict[str, JobShape] = {}
        for r in rows:
            if r["shape_key"] not in shapes:
                shapes[r["shape_key"]] = JobSpec.from_dict(r["spec"]).shape
        return [record(PaceRecord, r, shape=shapes[r["shape_key"]]) for r in rows]

    async def pace_references(self) -> list[PaceReference]:
        rows = await self._fetch("pace_references")
        return [record(PaceReference, r) for r in rows]

    async def set_pace_reference(
        self, gpu_class: str, seconds_per_step: float, machines: int, at: float
    ) -> None:
        await self._fetch("set_pace_reference", gpu_class, seconds_per_step, machines, at)

    async def scaler_work(self, listed_machines: Sequence[str]) -> ScalerWork:
        """Work for the fleet; `listed_machines`: the machine ids of the provider's instances."""
        row = await self._fetchrow("scaler_work", list(listed_machines))
        assert row is not None
        return record(ScalerWork, row)

    async def banned_queued_jobs(self, limit: int) -> list[BannedQueuedJob]:
        return [record(BannedQueuedJob, r) for r in await self._fetch("banned_queued_jobs", limit)]

    async def record_scaler_decision(
        self,
        *,
        at: float,
        scaler_id: str,
        action: str,
        target: str,
        job_id: str | None,
        reason: str,
        figures: Mapping[str, Any],
        fold_key: str = "",
        error: str | None = None,
        fold_into: int | None = None,
    ) -> tuple[int, bool]:
        """(row id, whether it folded into row `fold_into`: the same HOLD of the same scaler,
        repeated from its previous tick, when that row is still the target's newest)."""
        row = await self._fetchrow(
            "record_scaler_decision",
            at,
            scaler_id,
            action,
            target,
            None if job_id is None else _uuid_or_nil(job_id),
            reason,
            dict(figures),
            fold_key,
            error,
            fold_into,
        )
        assert row is not None
        return int(row["decision_id"]), bool(row["folded"])

    async def finish_scaler_decision(
        self, decision_id: int, *, applied: bool, error: str | None, at: float | None = None
    ) -> None:
        """Records the outcome; `at` (epoch s): when an applied action took effect."""
        await self._fetch("finish_scaler_decision", decision_id, applied, error, at)

    async def recent_scaler_actions(self, since: float) -> list[ScalerAction]:
        """What the scaler carried out since `since` (epoch seconds), oldest first."""
        return [record(ScalerAction, r) for r in await self._fetch("recent_scaler_actions", since)]

    async def list_scaler_decisions(self, limit: int) -> list[ScalerDecisionRecord]:
        """The newest decisions, newest first."""
        return [
            record(ScalerDecisionRecord, r)
            for r in await self._fetch("list_scaler_decisions", limit)
        ]

    # Sample tasks --------------------------------------------------------------------------------

    async def claim_sample_task(
        self,
        machine_id: str,
        vram_mb: int,
        lease_ttl_s: float,
        *,
        secret_sha256: bytes,
        families: Sequence[str] = FAMILIES,
    ) -> SampleTask | None:
        q = self.quarantine
        row = await self._fetchrow(
            "claim_sample_task",
            machine_id,
            vram_mb,
            uuid.uuid4(),
            lease_ttl_s,
            secret_sha256,
            q.threshold,
            q.window_s,
            q.empty_lease_limit,
            list(families),
        )
        return None if row is None else sample_task_from_row(row)

    async def training_claimable(
        self, machine_id: str, vram_mb: int, families: Sequence[str] = FAMILIES
    ) -> bool:
        row = await self._fetchrow("training_claimable", machine_id, vram_mb, list(families))
        return bool(row is not None and row[0])

    async def heartbeat_sample_task(self, lease_id: str, epoch: int, lease_ttl_s: float) -> bool:
        row = await self._fetchrow(
            "heartbeat_sample_task", _uuid_or_nil(lease_id), epoch, lease_ttl_s
        )
        return row is not None

    async def complete_sample_task(
        self, lease_id: str, epoch: int, images: Sequence[StoredImage]
    ) -> SampleTask | None:
        stored = [
            {
                "prompt_index": i.prompt_index,
                "image_index": i.image_index,
                "key": i.key,
                "size_bytes": i.size_bytes,
                "sha256": i.sha256,
            }
            for i in images
        ]
        row = await self._fetchrow("complete_sample_task", _uuid_or_nil(lease_id), epoch, stored)
        return None if row is None else sample_task_from_row(row)

    async def fail_sample_task(
        self, lease_id: str, epoch: int, failure_class: FailureClass, message: str
    ) -> SampleTask | None:
        row = await self._fetchrow(
            "fail_sample_task",
            _uuid_or_nil(lease_id),
            epoch,
            failure_class.value,
            message,
            list(OPERATOR_RUN_PROVIDERS),
            self.standing_min_age_s,
        )
        return None if row is None else sample_task_from_row(row)

    async def drain_sample_task(self, lease_id: str, epoch: int) -> bool:
        row = await self._fetchrow("drain_sample_task", _uuid_or_nil(lease_id), epoch)
        return row is not None

    async def abandon_sample_task(self, lease_id: str, epoch: int, machine_id: str) -> bool:
        """Ends the machine's live task lease, re-queues the task (no failure) and bans the
        machine from it; False when that lease is no longer live."""
        row = await self._fetchrow("abandon_sample_task", _uuid_or_nil(lease_id), epoch, machine_id)
        return row is not None

    async def release_machine_sample_tasks(self, machine_id: str) -> list[str]:
        """Re-queues every task the machine still holds (its new stream resumes none)."""
        return [
            str(r["task_id"]) for r in await self._fetch("release_machine_sample_tasks", machine_id)
        ]

    async def expire_sample_tasks(self) -> list[str]:
        return [str(r["task_id"]) for r in await self._fetch("expire_sample_tasks")]

    async def samples_pending(self, job_id: str) -> bool:
        row = await self._fetchrow("samples_pending", uuid.UUID(job_id))
        return bool(row is not None and row[0])

    async def sample_tasks_of_job(self, job_id: str) -> list[SampleTask]:
        rows = await self._fetch("sample_tasks_of_job", uuid.UUID(job_id))
        return [sample_task_from_row(r) for r in rows]

    async def request_samples(
        self, job_id: str, owner: str, steps: Sequence[int], settings: SampleSettings
    ) -> list[int]:
        rows = await self._fetch(
            "request_samples", uuid.UUID(job_id), owner, list(steps), settings.to_dict()
        )
        return sorted(int(r["step"]) for r in rows)


@dataclass(frozen=True, kw_only=True)
class WebhookDelivery:
    delivery_id: int
    job_id: str
    event: str
    url: str
    payload: dict[str, Any]
    attempts: int
    secret: str


def sample_task_from_row(row: asyncpg.Record) -> SampleTask:
    keys = set(row.keys())
    return record(
        SampleTask,
        row,
        owner=row["owner"] if "owner" in keys else "",
        settings=SampleSettings.from_dict(row["settings"]),
        images=tuple(
            StoredImage(
                prompt_index=int(i["prompt_index"]),
                image_index=int(i["image_index"]),
                key=str(i["key"]),
                size_bytes=int(i["size_bytes"]),
                sha256=str(i["sha256"]),
            )
            for i in row["images"]
        ),
        spec=JobSpec.from_dict(row["spec"]) if "spec" in keys else None,
        traceparent=row["traceparent"] if "traceparent" in keys else None,
    )


def _uuid_or_nil(value: str) -> uuid.UUID:
    """A malformed lease id matches no lease (the caller then refuses the message as stale)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        return uuid.UUID(int=0)
