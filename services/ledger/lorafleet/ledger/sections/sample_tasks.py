"""Sample tasks: validation images of a committed checkpoint, leased to a machine like a job
but fenced and retried on their own."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from lorafleet.core.families import FAMILIES
from lorafleet.core.model import FailureClass, SampleSettings, SampleTask, StoredImage
from lorafleet.ledger.base import LedgerBase, _uuid_or_nil
from lorafleet.ledger.records import OPERATOR_RUN_PROVIDERS, sample_task_from_row


class SampleTaskQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Sample tasks" section."""

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
