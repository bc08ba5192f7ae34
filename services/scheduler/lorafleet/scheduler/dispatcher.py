"""The dispatcher: what the scheduler tells workers unprompted. Grants of training leases and
sample tasks, the sample tasks that give way to training, and revocations.

The ledger decides (claims with `FOR UPDATE SKIP LOCKED`, fencing); the dispatcher delivers.
Work is pushed, never polled: a worker that says Ready is offered a job at once
(`WorkerHandler.ready` → `Dispatcher.offer`), and `run()` offers again to every idle session
whenever the ledger NOTIFYs that a job became claimable (and every `dispatch_interval_s`).
When the ledger ends a lease (cancel, expiry, a newer epoch) it NOTIFYs too, and the session
delivering it sends `LeaseRevoked` (`_on_lease_ended` → `revoke`).

Warm dispatch: a worker's Ready says what it holds from earlier leases (its resident base model,
its compiled step shapes; `WorkerSession.ready`), and `claim_job` prefers a queued job that
matches, after re-queued jobs and priority, unless a job has waited `warm_dispatch_bound_s`: then
strict queue order. The claim is unverified and moves only which claimable job that worker gets.

Sample tasks (a job's validation images, made on the fleet and never inside a training run) are
leases of their own kind on the same stream:

* Granted only to a worker that found no training job to claim (`offer` tries `claim_job`
  first), as `SampleTaskGranted` carrying the task's lease (its own lease id and epoch), the
  GET URL of the weights and one write-once PUT URL per image, bound to the task's lease.
* The worker's messages about it are the training lease's, handled by `WorkerHandler`:
  `Heartbeat` extends it, `JobFailed` fails or re-queues the task with the same failure classes
  (NODE/INTERNAL ban the machine from the task and count toward its `max_failures`; INPUT fails
  it at once), `Draining` re-queues it; `SamplesStored` ends it once every image is stored as
  announced. Each is accepted only from the stream the task was granted on, under its live
  lease (fencing). Checkpoint, result and URL messages under a sample task's lease are
  refused. No message about a sample task ever touches its job.
* Training is never delayed by samples: a dispatch round that finds a training job that a
  session busy with a sample task could claim takes the task back (re-queued, no failure) with
  `LeaseRevoked` (`_preempt_samples`); the worker stops within one denoising step and says
  Ready.
* Under the training lease's rules: the grant carries the worker's view of the spec only
  (`JobSpec.for_worker`: no webhook, no labels); a machine holds one live lease of any kind
  (`claim_job` and `claim_sample_task` skip a machine holding either); Ready while holding a
  task gives it back and bans the machine from it (`WorkerHandler.ready`), so one stream
  cannot hoard tasks or collect their weights URLs.
* Expiry is the sweeper's (`expire_sample_tasks`); a reconnecting worker does not resume a
  sample task: its new stream gives back what the machine held at once
  (`release_machine_sample_tasks`), so the task is re-run and the worker offered work again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lorafleet.core.errors import is_retryable
from lorafleet.core.model import Job, JobState
from lorafleet.core.serde import sample_settings_to_proto, spec_to_proto, timestamp
from lorafleet.core.spec import CHECKPOINTING_AUTO, JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler import metrics
from lorafleet.scheduler.background import BackgroundTasks
from lorafleet.scheduler.checkpoint_interval import CheckpointInterval, CheckpointIntervals
from lorafleet.scheduler.notifications import LEASE_ENDED, WORK, Notifications
from lorafleet.scheduler.sessions import (
    ActiveLease,
    SampleLease,
    SessionState,
    TrainingLease,
    WorkerSession,
    WorkerSessions,
)
from lorafleet.scheduler.signing import UrlSigner

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.scheduler")
_propagator = TraceContextTextMapPropagator()

# How many claims one dispatch round runs at once (each is one short transaction).
_CLAIM_CONCURRENCY = 16


def trace_context(traceparent: str | None) -> Any:
    """The OpenTelemetry context a W3C traceparent names (empty: a new trace)."""
    return _propagator.extract({"traceparent": traceparent} if traceparent else {})


def traceparent_of(span: trace.Span) -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def digest(secret: str) -> bytes:
    """What the ledger keeps of a secret (a lease's, a session's): its sha256."""
    return hashlib.sha256(secret.encode()).digest()


def lease_proto(job: Job, lease_ttl_s: float) -> fpb.Lease:
    """The lease a grant (or a resume) names, expiring a TTL from now."""
    expires = datetime.now(UTC) + timedelta(seconds=lease_ttl_s)
    return fpb.Lease(
        lease_id=job.lease_id or "",
        job_id=job.job_id,
        epoch=job.epoch,
        machine_id=job.machine_id or "",
        expires_at=timestamp(expires),
    )


def lease_attributes(
    lease: ActiveLease, session: WorkerSession, **extra: int
) -> dict[str, str | int]:
    """A lease's span attributes: what the scheduler does for it joins the job's trace."""
    attributes: dict[str, str | int] = {
        "lorafleet.job_id": lease.job_id,
        "lorafleet.lease_id": lease.lease_id,
        "lorafleet.epoch": lease.epoch,
        "lorafleet.machine_id": session.machine.machine_id,
    }
    attributes.update({f"lorafleet.{k}": v for k, v in extra.items()})
    return attributes


class Dispatcher:
    """Offers queued work to this replica's idle sessions, and revokes what the ledger ended."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        signer: UrlSigner,
        sessions: WorkerSessions,
        background: BackgroundTasks,
        notifications: Notifications,
        lease_ttl_s: float,
        dispatch_interval_s: float,
        warm_dispatch_bound_s: float = 0.0,
        checkpoint_intervals: CheckpointIntervals | None = None,
    ) -> None:
        self._ledger = ledger
        self._warm_dispatch_bound_s = warm_dispatch_bound_s
        self._intervals = checkpoint_intervals
        self._signer = signer
        self._sessions = sessions
        self._background = background
        self._lease_ttl_s = lease_ttl_s
        self._url_ttl_s = signer.lease_urls_ttl_s
        self._dispatch_interval_s = dispatch_interval_s
        self._wake = asyncio.Event()
        notifications.subscribe(WORK, lambda _payload: self._wake.set())
        notifications.subscribe(LEASE_ENDED, self._on_lease_ended)

    # The loop and its rounds -----------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Offers queued work to idle workers whenever the ledger says some became claimable.

        Outlives an unavailable ledger or store (the next round tries again); any other error,
        here or in a session's background task, ends it and so reaches Scheduler.wait()."""
        while True:
            woken: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait(
                    [woken, self._background.failed],
                    timeout=self._dispatch_interval_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                woken.cancel()
            if self._background.failed.done():
                self._background.failed.result()  # raises the background task's error
            self._wake.clear()
            try:
                await self._dispatch_round()
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                log.warning(
                    "dispatch round failed; the ledger or store is unavailable", error=str(exc)
                )

    async def _dispatch_round(self) -> None:
        await self._preempt_samples()
        idle = self._sessions.idle()
        if not idle:
            return
        queued = await self._ledger.count_queued(len(idle))
        granted = 0
        position = 0
        while position < len(idle) and granted < queued:
            # No more claims in flight than jobs left: extra ones would only find nothing.
            width = min(_CLAIM_CONCURRENCY, queued - granted)
            batch = idle[position : position + width]
            position += width
            results = await asyncio.gather(*(self.offer(s) for s in batch))
            granted += sum(results)
        # Sessions left idle once every training job is offered: sample tasks, if any.
        rest = idle[position:]
        for start in range(0, len(rest), _CLAIM_CONCURRENCY):
            results = await asyncio.gather(
                *(self.offer(s) for s in rest[start : start + _CLAIM_CONCURRENCY])
            )
            if not any(results):
                break

    async def offer(self, session: WorkerSession) -> bool:
        """Claims one job for an idle session and sends the grant; True if it got one."""
        if session.state is not SessionState.IDLE or session.claiming:
            return False
        session.claiming = True
        started = time.monotonic()
        started_ns = time.time_ns()
        try:
            lease_secret = secrets.token_urlsafe(32)
            job = await self._ledger.claim_job(
                session.machine.machine_id,
                session.machine.vram_mb,
                self._lease_ttl_s,
                secret_sha256=digest(lease_secret),
                warm=session.ready.warm,
                warm_bound_s=self._warm_dispatch_bound_s,
                families=session.machine.families,
            )
            if job is None or job.lease_id is None:
                return await self._offer_sample_task(session, lease_secret)
            if session.state is not SessionState.IDLE:
                # The stream closed (or the worker drained) while the claim ran: give it back.
                await self._ledger.drain_lease(job.lease_id, job.epoch, "worker left during grant")
                return False
            # The grant joins the job's trace under its submit span; the worker's lease span is
            # the grant's child (LeaseGranted.traceparent).
            span = tracer.start_span(
                "scheduler.grant", context=trace_context(job.traceparent), start_time=started_ns
            )
            lease = TrainingLease.from_job(job, traceparent=traceparent_of(span))
            session.grant(lease)
            span.set_attributes(lease_attributes(lease, session))
            with trace.use_span(span, end_on_exit=True):
                try:
                    urls = await self._signer.lease_urls(job)
                except Exception:
                    log.exception("could not sign the job's URLs; re-queueing", job_id=job.job_id)
                    self._grant_abandoned(session, lease)
                    await self._ledger.drain_lease(job.lease_id, job.epoch, "storage unavailable")
                    return False
                try:
                    # Recorded before the grant is sent: a worker resuming the lease after a
                    # reconnect, on any replica, gets the scheduler's spans under this grant.
                    await self._ledger.set_lease_traceparent(
                        job.lease_id, job.epoch, lease.traceparent
                    )
                    worker_spec, interval = await self._worker_spec(job, session)
                except Exception:
                    log.exception(
                        "could not record the grant's trace context or checkpoint interval",
                        job_id=job.job_id,
                    )
                    self._grant_abandoned(session, lease)
                    await self._ledger.drain_lease(job.lease_id, job.epoch, "ledger unavailable")
                    return False
                if not session.granted(lease):  # it left, drained or lost the lease meanwhile
                    span.set_attribute("lorafleet.refused", True)
                    if self._grant_abandoned(session, lease):
                        await self._ledger.drain_lease(
                            job.lease_id, job.epoch, "worker left during grant"
                        )
                    self.wake()  # the job, or this worker, may be offered again at once
                    return False
                lease.urls_expire_at = time.monotonic() + self._url_ttl_s
                session.send(
                    fpb.ConnectResponse(
                        lease_granted=fpb.LeaseGranted(
                            lease=lease_proto(job, self._lease_ttl_s),
                            spec=spec_to_proto(worker_spec),
                            urls=urls,
                            traceparent=lease.traceparent,
                            lease_secret=lease_secret,
                            checkpoint_interval_s=interval.seconds if interval else 0.0,
                            checkpoint_min_steps=interval.min_steps if interval else 0,
                        )
                    )
                )
                metrics.GRANTS.inc()
                metrics.GRANT_LATENCY.observe(time.monotonic() - started)
                log.info(
                    "lease granted",
                    job_id=job.job_id,
                    lease_id=job.lease_id,
                    epoch=job.epoch,
                    machine_id=session.machine.machine_id,
                )
            return True
        finally:
            session.claiming = False

    async def _worker_spec(
        self, job: Job, session: WorkerSession
    ) -> tuple[JobSpec, CheckpointInterval | None]:
        """The spec the grant carries: the worker's view (`JobSpec.for_worker`), with an
        automatic checkpoint interval chosen for this lease and put on the job's timeline (and
        the interval, which the grant carries in seconds too; None when the job fixes it)."""
        spec = job.spec.for_worker()
        if spec.checkpointing_steps != CHECKPOINTING_AUTO or self._intervals is None:
            return spec, None
        assert job.lease_id is not None
        interval = await self._intervals.choose(
            spec,
            gpu_model=session.machine.gpu_model,
            reported_cost_s=session.ready.checkpoint_cost_s,
        )
        await self._ledger.set_lease_interval(
            job.lease_id, job.epoch, interval.steps, interval.describe(session.machine.gpu_model)
        )
        return dataclasses.replace(spec, checkpointing_steps=interval.steps), interval

    def _grant_abandoned(self, session: WorkerSession, lease: ActiveLease) -> bool:
        """A grant being prepared for `session` will not be sent. True when the lease is still
        live and the caller must end it in the ledger; False when something else already ended
        it while the grant's URLs were signed (a cancel or a newer epoch: `revoke` told the
        worker about a lease it never saw, which it ignores).

        A worker still on its stream never saw the lease and still waits for an answer to its
        Ready, so its session goes back to idle (the next dispatch round offers it work); one
        that drained or closed meanwhile only loses the lease."""
        still_live = session.lease is lease
        if still_live and session.state is SessionState.LEASED:
            session.withdraw(lease)
        elif still_live:
            session.end_lease(lease)  # draining or closed: it stays so
        elif session.state is SessionState.CONNECTED and session.lease is None:
            # Revoked (`revoke` ended the lease, leaving it CONNECTED).
            session.withdraw(None)
        return still_live

    # Sample tasks ------------------------------------------------------------------------------

    async def _offer_sample_task(self, session: WorkerSession, lease_secret: str) -> bool:
        """Called by `offer` (claiming) when no training job was claimable for the session."""
        task = await self._ledger.claim_sample_task(
            session.machine.machine_id,
            session.machine.vram_mb,
            self._lease_ttl_s,
            secret_sha256=digest(lease_secret),
            families=session.machine.families,
        )
        if task is None or task.lease_id is None or task.spec is None:
            return False
        if session.state is not SessionState.IDLE:
            await self._ledger.drain_sample_task(task.lease_id, task.epoch)
            return False
        span = tracer.start_span(
            "scheduler.grant_sample_task", context=trace_context(task.traceparent)
        )
        lease = SampleLease.from_task(task, traceparent=traceparent_of(span))
        session.grant(lease)
        span.set_attributes(lease_attributes(lease, session, step=task.step))
        with trace.use_span(span, end_on_exit=True):
            try:
                weights, uploads = await self._signer.sample_task_urls(task)
            except Exception:
                log.exception(
                    "could not sign a sample task's URLs; re-queueing", task_id=task.task_id
                )
                self._grant_abandoned(session, lease)
                await self._ledger.drain_sample_task(task.lease_id, task.epoch)
                return False
            if not session.granted(lease):  # it left, drained or lost the lease meanwhile
                span.set_attribute("lorafleet.refused", True)
                if self._grant_abandoned(session, lease):
                    await self._ledger.drain_sample_task(task.lease_id, task.epoch)
                self.wake()
                return False
            expires = datetime.now(UTC) + timedelta(seconds=self._lease_ttl_s)
            session.send(
                fpb.ConnectResponse(
                    sample_task_granted=fpb.SampleTaskGranted(
                        lease=fpb.Lease(
                            lease_id=task.lease_id,
                            job_id=task.job_id,
                            epoch=task.epoch,
                            machine_id=session.machine.machine_id,
                            expires_at=timestamp(expires),
                        ),
                        task_id=task.task_id,
                        step=task.step,
                        # The worker's view only: never the owner's webhook or labels.
                        spec=spec_to_proto(task.spec.for_worker()),
                        settings=sample_settings_to_proto(task.settings),
                        weights=weights,
                        weights_sha256=task.weights_sha256,
                        weights_is_checkpoint=task.weights_is_checkpoint,
                        uploads=uploads,
                        lease_secret=lease_secret,
                        traceparent=lease.traceparent,
                    )
                )
            )
        metrics.SAMPLE_TASKS.labels("granted").inc()
        log.info(
            "sample task granted",
            job_id=task.job_id,
            task_id=task.task_id,
            step=task.step,
            lease_id=task.lease_id,
            epoch=task.epoch,
            machine_id=session.machine.machine_id,
        )
        return True

    async def _preempt_samples(self) -> None:
        """Training is never delayed by samples: a session busy with a sample task gives it back
        when it could claim a queued training job (as many as there are such jobs beyond the idle
        sessions; re-queued at once, no failure counted)."""
        sampling = self._sessions.sampling()
        if not sampling:
            return
        idle = self._sessions.count_idle()
        queued = await self._ledger.count_queued(idle + len(sampling))
        for session in sampling[: max(0, queued - idle)]:
            lease = session.sample_lease()
            if lease is None:
                continue
            if not await self._ledger.training_claimable(
                session.machine.machine_id, session.machine.vram_mb, session.machine.families
            ):
                continue
            if session.lease is not lease:
                continue
            await self._ledger.drain_sample_task(lease.lease_id, lease.epoch)
            # The ledger's NOTIFY revokes it too; revoking here first is the same (idempotent).
            self.revoke(session, canceled=False)
            metrics.SAMPLE_TASKS.labels("preempted").inc()
            log.info(
                "sample task gave way to training",
                task_id=lease.task.task_id,
                machine_id=session.machine.machine_id,
            )

    # Revocation: the ledger ended a lease this replica delivers --------------------------------

    def _on_lease_ended(self, payload: str | None) -> None:
        if payload is None:
            # Notifications were lost: re-check every lease this replica delivers.
            for session in self._sessions.all():
                if session.lease is not None:
                    self._background.spawn(self._recheck_lease(session), "recheck lease")
            return
        lease_id, _, state = payload.partition(" ")
        for session in self._sessions.all():
            if session.lease is not None and session.lease.lease_id == lease_id:
                self.revoke(session, canceled=state == JobState.CANCELED.value)

    async def _recheck_lease(self, session: WorkerSession) -> None:
        lease = session.lease
        if isinstance(lease, SampleLease):
            if not await self._ledger.lease_is_live(lease.lease_id):
                self.revoke(session, canceled=False)
            return
        if lease is None:
            return
        job = await self._ledger.get_job_any_owner(lease.job_id)
        if job is None or job.lease_id != lease.lease_id:
            self.revoke(session, canceled=job is not None and job.state is JobState.CANCELED)

    def revoke(self, session: WorkerSession, *, canceled: bool) -> None:
        lease = session.lease
        if lease is None:
            return
        session.end_lease(lease)
        if canceled and isinstance(lease, TrainingLease):
            session.canceled_lease = lease  # its holder may say the step it reached
        reason = fpb.REVOKE_REASON_CANCELED if canceled else fpb.REVOKE_REASON_SUPERSEDED
        session.send(
            fpb.ConnectResponse(
                lease_revoked=fpb.LeaseRevoked(
                    lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch),
                    reason=reason,
                )
            )
        )
        log.info(
            "lease revoked",
            job_id=lease.job_id,
            lease_id=lease.lease_id,
            machine_id=session.machine.machine_id,
            canceled=canceled,
        )
