"""What the scaler reads of the fleet (nodes, paces, work) and the decisions it records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lorafleet.core.model import Job
from lorafleet.core.spec import JobShape, JobSpec
from lorafleet.ledger.base import LedgerBase, _uuid_or_nil
from lorafleet.ledger.records import (
    BannedQueuedJob,
    NodeRecord,
    PaceRecord,
    PaceReference,
    ScalerAction,
    ScalerDecisionRecord,
    ScalerWork,
    job_from_row,
)
from lorafleet.ledger.rows import record


class ScalerQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "The scaler" section."""

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
