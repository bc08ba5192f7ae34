"""The sweeper: expires lapsed leases, revokes stalled ones (no verified progress) and applies
checkpoint retention. Safe on every replica.

Beside it, every replica attends the ledger about once a second (`attend`): a lease's TTL
counts only time in which some replica reached the ledger, on the ledger's clock (queries.sql,
attend_replica). A restart of every replica, or a Postgres outage, of any length therefore
costs no lease whose holder reconnects within a TTL of the scheduler being back. Each sweep
attends first, so no replica expires a lease before the silence it lapsed in is accounted for.

Every step is one ledger statement that locks what it changes (`FOR UPDATE SKIP LOCKED`), so
replicas sweeping at once never do a thing twice. A sweep that meets an unavailable ledger or
store is logged and tried again next interval; any other error ends `run()` and so reaches
`Scheduler.wait()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection

import structlog

from lorafleet.core.errors import is_retryable
from lorafleet.core.model import JobState
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler import metrics
from lorafleet.scheduler.storage import ObjectStore

log = structlog.get_logger(__name__)


class Sweeper:
    def __init__(
        self,
        *,
        ledger: Ledger,
        storage: ObjectStore,
        checkpoint_retention: int,
        replica_id: str,
        upload_url_ttl_s: float,
        machine_retention_s: float = 3600.0,
        lease_progress_timeout_s: float = 1800.0,
        lease_ttl_s: float | None = None,
        outage_after_s: float = 3.0,
    ) -> None:
        """`lease_ttl_s` set: each sweep (and `attend`) gives leases their TTL back after
        `outage_after_s` of the ledger hearing from no replica; None: it only says alive."""
        self._ledger = ledger
        self._storage = storage
        self._retention = checkpoint_retention
        self._replica_id = replica_id
        # A finished job is swept again once its leases' last upload URL has expired.
        self._upload_url_ttl_s = upload_url_ttl_s
        # Never-verified machines that nothing names are forgotten after this much silence,
        # checked every tenth of it (at most a minute): a reconnect loop's made-up machine ids
        # cost rows for a bounded time.
        self._machine_retention_s = machine_retention_s
        self._machines_every_s = min(60.0, machine_retention_s / 10)
        self._machines_next = 0.0
        # A lease that holds a job without verified progress (heartbeats alone) for this long
        # (scaled per job by the ledger: `stall_leases`) is revoked as a node fault.
        self._lease_progress_timeout_s = lease_progress_timeout_s
        self._lease_ttl_s = lease_ttl_s
        self._outage_after_s = outage_after_s

    async def attend_once(self) -> None:
        """This replica reaches the ledger: a replica starting later knows the fleet was not
        all down, and leases lapsed while nobody reached it get their TTL back."""
        if self._lease_ttl_s is None:
            await self._ledger.touch_replica(self._replica_id)
            return
        extended = await self._ledger.attend_replica(
            self._replica_id, self._lease_ttl_s, self._outage_after_s
        )
        if extended:
            log.warning(
                "no replica reached the ledger for a while (an outage of Postgres or of every"
                " replica); live leases get a TTL to report in",
                leases=extended,
                lease_ttl_s=self._lease_ttl_s,
            )

    async def attend(self, interval_s: float) -> None:
        """`attend_once` every `interval_s`, apart from the sweep (a slow sweep must not look
        like an outage); an unreachable ledger is tried again next interval."""
        while True:
            try:
                await self.attend_once()
            except Exception as exc:
                if not is_retryable(exc):
                    raise
            await asyncio.sleep(interval_s)

    async def sweep_once(self) -> None:
        await self.attend_once()
        for expired in await self._ledger.expire_leases():
            metrics.LEASE_EXPIRIES.inc()
            metrics.REQUEUES.labels("expired").inc()
            metrics.STEPS_LOST_TO_EXPIRY.inc(expired.steps_lost)
            # What the expiry costs, from the holder's last report: at least steps_lost (it
            # may have trained on unheard), so that lost work shows in a figure.
            log.warning(
                "lease expired; job re-queued",
                job_id=expired.job_id,
                lease_id=expired.lease_id,
                machine_id=expired.machine_id,
                epoch=expired.epoch,
                last_step=expired.last_step,
                resume_step=expired.resume_step,
                steps_lost=expired.steps_lost,
            )
        for stalled in await self._ledger.stall_leases(self._lease_progress_timeout_s):
            metrics.ATTEMPT_FAILURES.labels("NODE").inc()
            if stalled.job_state is JobState.QUEUED:
                metrics.REQUEUES.labels("stalled").inc()
            log.warning(
                "lease made no verified progress; revoked as a node fault",
                job_id=stalled.job_id,
                lease_id=stalled.lease_id,
                machine_id=stalled.machine_id,
                epoch=stalled.epoch,
                silent_s=stalled.silent_s,
                job_state=stalled.job_state.value,
            )
        for task_id in await self._ledger.expire_sample_tasks():
            log.warning("sample task lease expired; task re-queued", task_id=task_id)
        if time.monotonic() >= self._machines_next:
            await self.expire_machines()
        for job_id in await self._ledger.finished_jobs_with_checkpoints(100):
            await self.prune_checkpoints(job_id)
        for job_id, result_keys in await self._ledger.jobs_to_sweep(100, self._upload_url_ttl_s):
            await self.sweep_job_storage(job_id, result_keys)

    async def expire_machines(self) -> None:
        self._machines_next = time.monotonic() + self._machines_every_s
        expired = await self._ledger.expire_machines(self._machine_retention_s)
        if expired:
            log.info(
                "silent unverified machines forgotten",
                count=len(expired),
                first=expired[0],
                retention_s=self._machine_retention_s,
            )

    async def sweep_job_storage(self, job_id: str, result_keys: Collection[str]) -> None:
        """Deletes what a finished job no longer needs: checkpoints and results the ledger
        never recorded (a lease ended between its upload and its announcement) and generated
        class images; keeps the recorded result and the validation images."""
        prefixes = (
            f"jobs/{job_id}/checkpoints/",
            f"jobs/{job_id}/result/",
            # Generated for prior preservation while it trained; nothing needs them after.
            f"jobs/{job_id}/class_images/",
        )
        stray = [
            o.key
            for prefix in prefixes
            for o in await self._storage.list(prefix)
            if o.key not in result_keys
        ]
        if stray:
            await self._storage.delete(stray)
            log.info(
                "unrecorded objects of a finished job deleted", job_id=job_id, count=len(stray)
            )
        await self._ledger.mark_storage_swept(job_id)

    async def prune_checkpoints(self, job_id: str) -> None:
        """Keeps the newest K of a running job; deletes all of a finished one's."""
        keys = await self._ledger.checkpoints_to_delete(job_id, self._retention)
        if keys:
            await self._storage.delete(keys)
            await self._ledger.mark_checkpoints_deleted(job_id, keys)

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.sweep_once()
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                log.warning("sweep failed; trying again next interval", error=str(exc))
            await asyncio.sleep(interval_s)
