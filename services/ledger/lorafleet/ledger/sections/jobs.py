"""Jobs as their owners see them: submitting, reading, listing and canceling."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.fit import vram_need_mb
from lorafleet.core.model import Job, JobState
from lorafleet.core.spec import JobSpec
from lorafleet.ledger.base import QUERIES, LedgerBase
from lorafleet.ledger.records import NewJob, job_from_row


class JobQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Jobs" section."""

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
            for j in jobs:
                earlier = by_key.get(j.idempotency_key) if j.job_id not in by_id else None
                if earlier is not None and earlier.spec != j.spec:
                    # A retry repeats its request; another job under the same key is a mistake
                    # that returning the first job would hide (the transaction rolls back).
                    raise InvalidArgument(
                        "idempotency_key",
                        f"{j.idempotency_key!r} was used for job {earlier.job_id} with another"
                        " spec; a retry sends the same spec, a new job needs a new key",
                    )
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
        q = self.quarantine
        row = await self._fetchrow(
            "get_job", uuid.UUID(job_id), owner, q.threshold, q.window_s, q.empty_lease_limit
        )
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
        q = self.quarantine
        rows = await self._fetch(
            "list_jobs",
            owner,
            [s.value for s in states],
            dict(labels),
            after[0] if after else None,
            uuid.UUID(after[1]) if after else None,
            limit,
            q.threshold,
            q.window_s,
            q.empty_lease_limit,
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
