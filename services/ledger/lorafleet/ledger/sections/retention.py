"""Checkpoint retention: which stored objects a finished or advancing job no longer needs."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from lorafleet.core.model import Checkpoint
from lorafleet.ledger.base import QUERIES, LedgerBase
from lorafleet.ledger.records import checkpoint_from_row


class RetentionQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Checkpoint retention" section."""

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
