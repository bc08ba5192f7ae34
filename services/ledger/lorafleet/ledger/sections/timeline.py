"""A job's timeline (its events and leases) and the counts that bound admission."""

from __future__ import annotations

import uuid

from lorafleet.core.model import JobEvent
from lorafleet.ledger.base import LedgerBase
from lorafleet.ledger.records import LeaseRecord, event_from_row
from lorafleet.ledger.rows import record


class TimelineQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "The timeline and counts" section."""

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
