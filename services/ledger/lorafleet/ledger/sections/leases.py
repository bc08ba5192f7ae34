"""Leases, as the worker stream drives them: a claim, heartbeats, checkpoints and class images
committed under the lease's epoch (fencing), its end (success, failure, drain, expiry, stall)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from lorafleet.core.families import FAMILIES
from lorafleet.core.model import (
    Checkpoint,
    ClassImage,
    FailureClass,
    Job,
    JobResult,
    JobState,
    WarmState,
)
from lorafleet.ledger.base import QUERIES, LedgerBase, _uuid_or_nil
from lorafleet.ledger.records import (
    OPERATOR_RUN_PROVIDERS,
    ExpiredLease,
    ResumedLease,
    StalledLease,
    job_from_row,
)
from lorafleet.ledger.rows import record


class LeaseQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Leases (the worker stream)" section."""

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
    ) -> ResumedLease | None:
        row = await self._fetchrow(
            "resume_lease", _uuid_or_nil(lease_id), epoch, machine_id, lease_ttl_s, secret_sha256
        )
        if row is None:
            return None
        return ResumedLease(job=job_from_row(row), traceparent=row["lease_traceparent"] or "")

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

    async def set_lease_traceparent(self, lease_id: str, epoch: int, traceparent: str) -> None:
        """Records the lease's grant span (its W3C traceparent), for `resume_lease`."""
        async with self._conn() as conn:
            await conn.execute(
                QUERIES["set_lease_traceparent"], _uuid_or_nil(lease_id), epoch, traceparent
            )

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
