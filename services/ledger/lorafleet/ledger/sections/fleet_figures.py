"""Fleet figures read when a job is submitted or a lease's interval is chosen: a shape's
measured pace, a GPU model's interruptions."""

from __future__ import annotations

from lorafleet.ledger.base import LedgerBase
from lorafleet.ledger.records import Interruptions, ShapePace
from lorafleet.ledger.rows import record


class FleetFigureQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Fleet figures: paces and interruptions" section."""

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
