"""The worker side of the scheduler: one session per connected worker, and the dispatcher.

The ledger decides (claims, fencing); sessions only deliver. Work is pushed: a worker that says
Ready is offered a job at once, and every replica re-offers when the ledger NOTIFYs that a job
became claimable, so no worker ever polls.

Sample tasks (issue 13: a job's validation images, made on the fleet and never inside a
training run) are leases of their own kind on the same stream:

* Granted only to a worker that found no training job to claim (`_offer` tries `claim_job`
  first), as `SampleTaskGranted` carrying the task's lease (its own lease id and epoch), the
  GET URL of the weights and one write-once PUT URL per image, bound to the task's lease.
* The worker's messages about it are the training lease's: `Heartbeat` extends it, `JobFailed`
  fails or re-queues the task with the same failure classes (NODE/INTERNAL ban the machine from
  the task and count toward its `max_failures`; INPUT fails it at once), `Draining` re-queues
  it; `SamplesStored` ends it once every image is stored as announced. Each is accepted only
  from the stream the task was granted on, under its live lease (fencing). Checkpoint, result
  and URL messages under a sample task's lease are refused. No message about a sample task
  ever touches its job.
* Training is never delayed by samples: a dispatch round that finds a training job that a
  session busy with a sample task could claim takes the task back (re-queued, no failure) with
  `LeaseRevoked`; the worker stops within one denoising step and says Ready.
* Expiry is the sweeper's (`expire_sample_tasks`); a reconnecting worker does not resume a
  sample task (it is re-run when its lease lapses: a task is short and has no progress).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import inspect
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lorafleet.core.errors import (
    AlreadyExists,
    InvalidArgument,
    ResourceExhausted,
    StaleLease,
    is_retryable,
)
from lorafleet.core.model import FailureClass, Job, JobState, LeaseRef, Machine, SampleTask
from lorafleet.core.serde import (
    checkpoint_from_commit,
    failure_class_from_proto,
    finite_or_none,
    heartbeat_from_proto,
    lease_ref_from_proto,
    lease_ref_to_proto,
    machine_from_hello,
    qualification_from_hello,
    result_from_success,
    sample_settings_to_proto,
    spec_to_proto,
    stored_images_from_proto,
    timestamp,
    worker_text,
)
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler import metrics
from lorafleet.scheduler.notifications import LEASE_ENDED, WORK, Notifications
from lorafleet.scheduler.signing import UrlSigner
from lorafleet.scheduler.storage import ObjectStore
from lorafleet.scheduler.sweeper import Sweeper

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.scheduler")
_propagator = TraceContextTextMapPropagator()


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


# Upload URLs one UrlsRequested may ask for (a batch of images, or one checkpoint).
MAX_SLOTS_PER_REQUEST = 64
# How many claims one dispatch round runs at once (each is one short transaction).
_CLAIM_CONCURRENCY = 16


class SessionState(enum.Enum):
    CONNECTED = "connected"  # said Hello, not Ready yet
    IDLE = "idle"  # Ready: waiting for work
    LEASED = "leased"
    DRAINING = "draining"  # stopping: gets no more work
    UNQUALIFIED = "unqualified"  # failed its probe: never gets work
    CLOSED = "closed"


@dataclass(kw_only=True)
class ActiveLease:
    job_id: str
    lease_id: str
    epoch: int
    owner: str
    urls_expire_at: float
    # Checkpoint steps announced on this stream: a repeat is ignored, never verified (hashed)
    # or recorded again.
    announced_steps: set[int] = field(default_factory=set)
    # Set for a sample task's lease (issue 13); None for a training lease.
    task: SampleTask | None = None
    # The lease's place in the job's trace (the grant span; after a resume, the submit span):
    # what the scheduler does for this lease joins the job's trace under it.
    traceparent: str = ""
    # The job's output_format: which result files its JobSucceeded must announce.
    output_format: str = "diffusers"


@dataclass(kw_only=True)
class TokenBucket:
    """`rate_per_s` on average, `burst` at once; `take()` says whether one more may pass."""

    rate_per_s: float
    burst: float
    tokens: float = -1.0
    at: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate_per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(frozen=True, kw_only=True)
class StreamBounds:
    """What one worker stream may cost this replica (DESIGN.md, "Trust": bounded buffers and
    rates on every stream)."""

    # Replies waiting for a worker that does not read them; past this it is disconnected.
    outbox_limit: int = 64
    # Messages a worker may send: on average, and at once.
    messages_per_s: float = 20.0
    message_burst: int = 100
    # Notices written to the log (the rest are counted, and the count logged with the next).
    notices_per_minute: float = 6.0


@dataclass(eq=False, kw_only=True)
class WorkerSession:
    machine: Machine
    # sha256 of this stream's session token (Welcome.session_token).
    session_sha256: bytes
    bounds: StreamBounds
    state: SessionState = SessionState.CONNECTED
    lease: ActiveLease | None = None
    # Unbounded as a queue so the closing sentinel always fits; `send` enforces the limit.
    outbox: asyncio.Queue[fpb.ConnectResponse | None] = field(default_factory=asyncio.Queue)
    claiming: bool = False
    last_seen_touch: float = 0.0
    last_timeline_heartbeat: float = 0.0
    # Set when the worker stopped reading its replies (the stream is then closed).
    overflowed: bool = False
    overflowing: asyncio.Event = field(default_factory=asyncio.Event)
    messages: TokenBucket = field(init=False)
    notices: TokenBucket = field(init=False)
    notices_suppressed: int = 0

    def __post_init__(self) -> None:
        self.messages = TokenBucket(
            rate_per_s=self.bounds.messages_per_s, burst=self.bounds.message_burst
        )
        self.notices = TokenBucket(
            rate_per_s=self.bounds.notices_per_minute / 60.0, burst=self.bounds.notices_per_minute
        )

    def send(self, message: fpb.ConnectResponse) -> None:
        if self.state is SessionState.CLOSED or self.overflowed:
            return
        if self.outbox.qsize() >= self.bounds.outbox_limit:
            # A worker that does not read its stream must not grow this replica's memory: the
            # servicer ends the stream (see WorkerServicer.Connect).
            self.overflowed = True
            self.overflowing.set()
            return
        self.outbox.put_nowait(message)

    def holds(self, lease: LeaseRef) -> bool:
        return (
            self.lease is not None
            and self.lease.lease_id == lease.lease_id
            and self.lease.epoch == lease.epoch
        )


class WorkerSessions:
    """Sessions of the workers connected to this replica, and the dispatch loop."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        storage: ObjectStore,
        signer: UrlSigner,
        sweeper: Sweeper,
        notifications: Notifications,
        scheduler_id: str,
        lease_ttl_s: float,
        heartbeat_interval_s: float,
        dispatch_interval_s: float,
        bounds: StreamBounds | None = None,
    ) -> None:
        self._ledger = ledger
        self._storage = storage
        self._bounds = bounds or StreamBounds()
        self._signer = signer
        self._sweeper = sweeper
        self._scheduler_id = scheduler_id
        self._lease_ttl_s = lease_ttl_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._url_ttl_s = signer.lease_urls_ttl_s
        self._dispatch_interval_s = dispatch_interval_s
        self._sessions: dict[str, WorkerSession] = {}
        self._wake = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        # Set by a background task that failed for a reason other than an unavailable ledger or
        # store: run() raises it, so the failure reaches Scheduler.wait().
        self._fatal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        notifications.subscribe(WORK, lambda _payload: self._wake.set())
        notifications.subscribe(LEASE_ENDED, self._on_lease_ended)

    @property
    def by_machine(self) -> dict[str, WorkerSession]:
        return self._sessions

    def _spawn(self, coro: Awaitable[object], what: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except Exception as exc:
                if not is_retryable(exc):
                    log.exception("background task failed", task=what)
                    if not self._fatal.done():
                        self._fatal.set_exception(exc)
                    return
                log.warning(
                    "background task failed; the ledger or store is unavailable",
                    task=what,
                    error=str(exc),
                )

        task = asyncio.get_running_loop().create_task(guarded())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # Cancelled before it ran (the scheduler stopping): close the coroutine, which was never
        # awaited, instead of leaving Python to warn about it (a no-op once it has run).
        if inspect.iscoroutine(coro):
            task.add_done_callback(lambda t: coro.close() if t.cancelled() else None)

    # Sessions ---------------------------------------------------------------------------------

    async def open_session(self, hello: fpb.Hello) -> WorkerSession:
        machine = machine_from_hello(hello)
        qualification = qualification_from_hello(hello)
        token = secrets.token_urlsafe(32)
        session_sha256 = digest(token)
        # The machine id is this stream's only if no other live stream holds it: a worker
        # reconnecting presents its previous token; a stranger must wait out a lease TTL of
        # the machine's silence (and so can never close a live worker's stream).
        if not await self._ledger.claim_machine_session(
            machine.machine_id,
            presented_sha256=digest(hello.session_token) if hello.session_token else None,
            new_sha256=session_sha256,
            silent_s=self._lease_ttl_s,
        ):
            raise AlreadyExists(
                f"hello.machine_id: machine {machine.machine_id!r} is held by another live"
                " stream; reconnect with its session_token, or after"
                f" {self._lease_ttl_s:g} s of its silence"
            )
        previous = self._sessions.get(machine.machine_id)
        if previous is not None:
            # The same machine reconnected before its old stream was noticed dead.
            self.close_session(previous)
        await self._ledger.upsert_machine(machine, qualification)
        session = WorkerSession(machine=machine, session_sha256=session_sha256, bounds=self._bounds)
        if not machine.qualified:
            session.state = SessionState.UNQUALIFIED
            log.warning(
                "worker failed qualification; it gets no work",
                machine_id=machine.machine_id,
                detail=hello.qualification.detail,
            )
        self._sessions[machine.machine_id] = session
        metrics.OPEN_STREAMS.inc()
        welcome = fpb.Welcome(
            scheduler_id=self._scheduler_id,
            heartbeat_interval_s=self._heartbeat_interval_s,
            lease_ttl_s=self._lease_ttl_s,
            session_token=token,
        )
        resumed: Job | None = None
        if hello.held_lease.lease_id:
            held = lease_ref_from_proto(hello.held_lease, "hello.held_lease")
            # Only the stream the lease was granted on was given its secret.
            resumed = await self._ledger.resume_lease(
                held.lease_id,
                held.epoch,
                machine.machine_id,
                self._lease_ttl_s,
                secret_sha256=digest(hello.held_lease_secret),
            )
        if resumed is not None and resumed.lease_id is not None:
            session.state = SessionState.LEASED
            session.lease = ActiveLease(
                job_id=resumed.job_id,
                lease_id=resumed.lease_id,
                epoch=resumed.epoch,
                owner=resumed.owner,
                urls_expire_at=0.0,
                traceparent=resumed.traceparent or "",
                output_format=resumed.spec.output_format,
            )
            welcome.resumed_lease.CopyFrom(self._lease_proto(resumed))
            log.info("lease resumed", machine_id=machine.machine_id, job_id=resumed.job_id)
        session.send(fpb.ConnectResponse(welcome=welcome))
        if session.lease is not None:
            await self._renew_urls(session)
        log.info("worker connected", machine_id=machine.machine_id, vram_mb=machine.vram_mb)
        return session

    def close_session(self, session: WorkerSession) -> None:
        """The stream ended. A held lease stays until its TTL: the worker may come back."""
        if session.state is SessionState.CLOSED:
            return
        if session.state is SessionState.DRAINING and session.lease is None:
            # The worker said it is leaving and holds nothing: its machine id is free at once
            # (a restarted `lorafleet up` waits no TTL for its own workers' ids).
            self._spawn(
                self._ledger.release_machine_session(
                    session.machine.machine_id, session.session_sha256
                ),
                "release machine id",
            )
        session.state = SessionState.CLOSED
        session.outbox.put_nowait(None)
        if self._sessions.get(session.machine.machine_id) is session:
            del self._sessions[session.machine.machine_id]
            metrics.OPEN_STREAMS.dec()
        log.info("worker disconnected", machine_id=session.machine.machine_id)

    async def handle(self, session: WorkerSession, request: fpb.ConnectRequest) -> None:
        """One worker message; raises InvalidArgument for a malformed one, ResourceExhausted
        past the stream's message rate."""
        if not session.messages.take():
            raise ResourceExhausted(
                f"message: more than {session.bounds.messages_per_s:g} messages per second"
            )
        kind = request.WhichOneof("message")
        if kind == "ready":
            if session.state in (SessionState.CONNECTED, SessionState.IDLE, SessionState.LEASED):
                if (abandoned := session.lease) is not None:
                    # Ended at once in the ledger, and the machine banned from the job: a stream
                    # holds one live lease at most, and cannot hoard jobs (or their image URLs)
                    # by saying Ready again and again.
                    session.lease = None
                    log.info(
                        "worker abandoned its lease by saying Ready",
                        machine_id=session.machine.machine_id,
                        job_id=abandoned.job_id,
                    )
                    await self._ledger.drop_lease(
                        session.machine.machine_id,
                        abandoned.job_id,
                        "the worker abandoned the lease (said Ready while holding it)",
                    )
                session.state = SessionState.IDLE
                self._spawn(self._offer(session), "offer")
        elif kind == "heartbeat":
            await self._heartbeat(session, request.heartbeat)
        elif kind == "urls_requested":
            await self._urls_requested(session, request.urls_requested)
        elif kind == "checkpoint_committed":
            await self._checkpoint_committed(session, request.checkpoint_committed)
        elif kind == "job_succeeded":
            await self._job_succeeded(session, request.job_succeeded)
        elif kind == "job_failed":
            await self._job_failed(session, request.job_failed)
        elif kind == "draining":
            await self._draining(session, request.draining)
        elif kind == "notice":
            await self._notice(session, request.notice)
        elif kind == "samples_stored":
            await self._samples_stored(session, request.samples_stored)
        elif kind == "hello":
            raise InvalidArgument("hello", "sent twice on one stream")
        else:
            raise InvalidArgument("message", "empty or unknown message")

    async def _notice(self, session: WorkerSession, notice: fpb.Notice) -> None:
        """Logged, and put on the job's timeline when it is about the lease this stream holds;
        both rate-limited per stream (a flood costs neither log nor ledger)."""
        if not session.notices.take():
            session.notices_suppressed += 1
            return
        message = worker_text(notice.message, 2000)
        log.warning(
            "worker notice",
            machine_id=session.machine.machine_id,
            lease_id=worker_text(notice.lease.lease_id, 64),
            message=message,
            suppressed_before=session.notices_suppressed,
        )
        session.notices_suppressed = 0
        if notice.lease.lease_id:
            ref = lease_ref_from_proto(notice.lease, "notice.lease")
            if session.holds(ref) and session.lease is not None and session.lease.task is None:
                await self._ledger.record_notice(ref.lease_id, ref.epoch, message)

    def _reject(self, session: WorkerSession, ref: LeaseRef, reason: str) -> None:
        metrics.STALE_REJECTIONS.inc()
        log.info(
            "stale worker message refused",
            machine_id=session.machine.machine_id,
            lease_id=ref.lease_id,
            epoch=ref.epoch,
            reason=reason,
        )
        if session.holds(ref):
            session.lease = None
            if session.state is SessionState.LEASED:
                session.state = SessionState.CONNECTED
        session.send(
            fpb.ConnectResponse(rejected=fpb.Rejected(lease=lease_ref_to_proto(ref), reason=reason))
        )

    async def _heartbeat(self, session: WorkerSession, msg: fpb.Heartbeat) -> None:
        hb = heartbeat_from_proto(msg)
        now = time.monotonic()
        if now - session.last_seen_touch > self._heartbeat_interval_s:
            # Keeps the machine id this stream's (see open_session), leased or idle.
            session.last_seen_touch = now
            await self._ledger.touch_machine(session.machine.machine_id, session.session_sha256)
        if hb.lease is None:
            return
        if not session.holds(hb.lease):
            # Fenced by the stream, not only by (lease, epoch): lease ids are not secret.
            self._reject(session, hb.lease, "not this stream's lease")
            return
        if session.lease is not None and session.lease.task is not None:
            if not await self._ledger.heartbeat_sample_task(
                hb.lease.lease_id, hb.lease.epoch, self._lease_ttl_s
            ):
                self._reject(session, hb.lease, "the sample task's lease is no longer live")
            return
        # The timeline gets at most one HEARTBEAT per half interval, however fast they come.
        on_timeline = now - session.last_timeline_heartbeat >= self._heartbeat_interval_s / 2
        if on_timeline:
            session.last_timeline_heartbeat = now
        alive = await self._ledger.heartbeat(
            hb.lease.lease_id,
            hb.lease.epoch,
            self._lease_ttl_s,
            step=hb.step,
            loss=hb.loss,
            learning_rate=hb.learning_rate,
            seconds_per_step=hb.seconds_per_step,
            on_timeline=on_timeline,
        )
        if not alive:
            self._reject(session, hb.lease, "the lease is no longer the job's")
            return
        lease = session.lease
        # Renew URLs once a third of their life is left, so uploads never meet an expired one.
        renew = lease is not None and lease.urls_expire_at - now < self._url_ttl_s / 3
        if renew and session.holds(hb.lease):
            await self._renew_urls(session)

    async def _live_lease(self, session: WorkerSession, ref: LeaseRef) -> Job:
        """The job, if `ref` is its live lease; else refuse the message (fencing)."""
        training = session.lease is not None and session.lease.task is None
        job_id = session.lease.job_id if session.holds(ref) and session.lease and training else None
        job = await self._ledger.get_job_any_owner(job_id) if job_id else None
        if job is None or job.lease_id != ref.lease_id or job.epoch != ref.epoch:
            raise StaleLease(f"lease {ref.lease_id} epoch {ref.epoch} is not live")
        return job

    async def _urls_requested(self, session: WorkerSession, req: fpb.UrlsRequested) -> None:
        ref = lease_ref_from_proto(req.lease, "urls_requested.lease")
        if not 1 <= len(req.slots) <= MAX_SLOTS_PER_REQUEST:
            raise InvalidArgument(
                "urls_requested.slots", f"must hold 1 to {MAX_SLOTS_PER_REQUEST} slots"
            )
        try:
            job = await self._live_lease(session, ref)
        except StaleLease as exc:
            self._reject(session, ref, str(exc))
            return
        urls = await self._signer.slot_urls(job, req.slots)
        session.send(fpb.ConnectResponse(urls_renewed=fpb.UrlsRenewed(lease=req.lease, urls=urls)))

    async def _checkpoint_committed(
        self, session: WorkerSession, msg: fpb.CheckpointCommitted
    ) -> None:
        ref = lease_ref_from_proto(msg.lease, "checkpoint_committed.lease")
        lease = session.lease if session.holds(ref) else None
        if lease is not None and lease.task is not None:
            lease = None  # a sample task's lease commits no checkpoint
        checkpoint = checkpoint_from_commit(msg, lease.job_id if lease else None)
        if lease is None:
            self._reject(session, ref, "not this stream's lease")
            return
        if checkpoint.step in lease.announced_steps:
            return
        lease.announced_steps.add(checkpoint.step)
        with tracer.start_as_current_span(
            "scheduler.commit_checkpoint",
            context=trace_context(lease.traceparent),
            attributes=_lease_attributes(lease, session, step=checkpoint.step),
        ) as span:
            if not await self._stored_as_announced(
                session, ref, checkpoint.key, checkpoint.size_bytes, checkpoint.sha256
            ):
                span.set_attribute("lorafleet.refused", True)
                return
            if not await self._ledger.commit_checkpoint(ref.lease_id, ref.epoch, checkpoint):
                span.set_attribute("lorafleet.refused", True)
                self._reject(session, ref, "the lease is no longer the job's")
                return
        metrics.CHECKPOINTS.inc()
        metrics.CHECKPOINT_BYTES.inc(checkpoint.size_bytes)
        log.info(
            "checkpoint committed",
            job_id=lease.job_id,
            lease_id=lease.lease_id,
            machine_id=session.machine.machine_id,
            step=checkpoint.step,
        )
        self._spawn(self._sweeper.prune_checkpoints(lease.job_id), "prune checkpoints")

    async def _stored_as_announced(
        self, session: WorkerSession, ref: LeaseRef, key: str, size_bytes: int, sha256: str
    ) -> bool:
        """The ledger records an object only once the store holds exactly what was announced
        (DESIGN.md: "Stored bytes are write-once"); else the message is refused."""
        if await self._storage.verify(key, size_bytes=size_bytes, sha256=sha256):
            return True
        log.warning(
            "announced object does not match what is stored; refused",
            machine_id=session.machine.machine_id,
            lease_id=ref.lease_id,
            key=key,
        )
        self._reject(session, ref, f"the stored object {key} does not match its size and sha256")
        return False

    async def _job_succeeded(self, session: WorkerSession, msg: fpb.JobSucceeded) -> None:
        ref = lease_ref_from_proto(msg.lease, "job_succeeded.lease")
        lease = session.lease if session.holds(ref) else None
        if lease is not None and lease.task is not None:
            lease = None  # a sample task's lease stores no result
        result = result_from_success(
            msg, lease.job_id if lease else None, lease.output_format if lease else "diffusers"
        )
        if lease is None:
            self._reject(session, ref, "not this stream's lease")
            return
        with tracer.start_as_current_span(
            "scheduler.job_succeeded",
            context=trace_context(lease.traceparent),
            attributes=_lease_attributes(lease, session, step=msg.step),
        ) as span:
            for stored in result.files.values():
                if not await self._stored_as_announced(
                    session, ref, stored.key, stored.size_bytes, stored.sha256
                ):
                    span.set_attribute("lorafleet.refused", True)
                    return
            # Cleared before the ledger call: its NOTIFY must not revoke what the worker just
            # finished.
            session.lease = None
            session.state = SessionState.CONNECTED
            job = await self._ledger.succeed_job(
                ref.lease_id,
                ref.epoch,
                result,
                step=msg.step,
                loss=finite_or_none(msg.loss),
            )
            if job is None:
                span.set_attribute("lorafleet.refused", True)
                self._reject(session, ref, "the lease is no longer the job's")
                return
        metrics.SUCCEEDED.inc()
        log.info("job succeeded", job_id=job.job_id, machine_id=session.machine.machine_id)
        self._spawn(self._sweeper.prune_checkpoints(job.job_id), "delete checkpoints")

    async def _job_failed(self, session: WorkerSession, msg: fpb.JobFailed) -> None:
        ref = lease_ref_from_proto(msg.lease, "job_failed.lease")
        failure_class = failure_class_from_proto(msg.failure_class, "job_failed.failure_class")
        message = worker_text(msg.message, 4000) or "no message"
        if not session.holds(ref):
            self._reject(session, ref, "not this stream's lease")
            return
        if session.lease is not None and session.lease.task is not None:
            await self._sample_task_failed(session, ref, failure_class, message)
            return
        session.lease = None
        session.state = SessionState.CONNECTED
        job = await self._ledger.fail_attempt(ref.lease_id, ref.epoch, failure_class, message)
        if job is None:
            self._reject(session, ref, "the lease is no longer the job's")
            return
        metrics.ATTEMPT_FAILURES.labels(failure_class.value).inc()
        if job.state is JobState.QUEUED:
            metrics.REQUEUES.labels("failed_attempt").inc()
        log.warning(
            "attempt failed",
            job_id=job.job_id,
            machine_id=session.machine.machine_id,
            failure_class=failure_class.value,
            job_state=job.state.value,
            error=message,
        )
        if job.state is JobState.FAILED:
            self._spawn(self._sweeper.prune_checkpoints(job.job_id), "delete checkpoints")

    async def _draining(self, session: WorkerSession, msg: fpb.Draining) -> None:
        session.state = SessionState.DRAINING
        metrics.DRAINS.inc()
        if not msg.lease.lease_id:
            return
        ref = lease_ref_from_proto(msg.lease, "draining.lease")
        if not session.holds(ref):
            self._reject(session, ref, "not this stream's lease")
            return
        if session.lease is not None and session.lease.task is not None:
            session.lease = None
            if not await self._ledger.drain_sample_task(ref.lease_id, ref.epoch):
                self._reject(session, ref, "the sample task's lease is no longer live")
            return
        session.lease = None
        job = await self._ledger.drain_lease(ref.lease_id, ref.epoch, worker_text(msg.reason, 500))
        if job is None:
            self._reject(session, ref, "the lease is no longer the job's")
            return
        metrics.REQUEUES.labels("drained").inc()
        log.info(
            "lease drained; job re-queued", job_id=job.job_id, machine_id=session.machine.machine_id
        )

    def _on_lease_ended(self, payload: str | None) -> None:
        if payload is None:
            # Notifications were lost: re-check every lease this replica delivers.
            for session in list(self._sessions.values()):
                if session.lease is not None:
                    self._spawn(self._recheck_lease(session), "recheck lease")
            return
        lease_id, _, state = payload.partition(" ")
        for session in self._sessions.values():
            if session.lease is not None and session.lease.lease_id == lease_id:
                self._revoke(session, canceled=state == JobState.CANCELED.value)

    async def _recheck_lease(self, session: WorkerSession) -> None:
        lease = session.lease
        if lease is None:
            return
        if lease.task is not None:
            if not await self._ledger.lease_is_live(lease.lease_id):
                self._revoke(session, canceled=False)
            return
        job = await self._ledger.get_job_any_owner(lease.job_id)
        if job is None or job.lease_id != lease.lease_id:
            self._revoke(session, canceled=job is not None and job.state is JobState.CANCELED)

    def _revoke(self, session: WorkerSession, *, canceled: bool) -> None:
        lease = session.lease
        if lease is None:
            return
        session.lease = None
        if session.state is SessionState.LEASED:
            session.state = SessionState.CONNECTED
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

    # Dispatch ---------------------------------------------------------------------------------

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
                    [woken, self._fatal],
                    timeout=self._dispatch_interval_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                woken.cancel()
            if self._fatal.done():
                self._fatal.result()  # raises the background task's error
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
        idle = [
            s for s in self._sessions.values() if s.state is SessionState.IDLE and not s.claiming
        ]
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
            results = await asyncio.gather(*(self._offer(s) for s in batch))
            granted += sum(results)
        # Sessions left idle once every training job is offered: sample tasks, if any.
        rest = idle[position:]
        for start in range(0, len(rest), _CLAIM_CONCURRENCY):
            results = await asyncio.gather(
                *(self._offer(s) for s in rest[start : start + _CLAIM_CONCURRENCY])
            )
            if not any(results):
                break

    async def _offer(self, session: WorkerSession) -> bool:
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
            session.state = SessionState.LEASED
            session.lease = ActiveLease(
                job_id=job.job_id,
                lease_id=job.lease_id,
                epoch=job.epoch,
                owner=job.owner,
                urls_expire_at=0.0,
                traceparent=traceparent_of(span),
                output_format=job.spec.output_format,
            )
            lease = session.lease
            span.set_attributes(_lease_attributes(lease, session))
            with trace.use_span(span, end_on_exit=True):
                try:
                    urls = await self._signer.lease_urls(job)
                except Exception:
                    log.exception("could not sign the job's URLs; re-queueing", job_id=job.job_id)
                    self._grant_abandoned(session, lease)
                    await self._ledger.drain_lease(job.lease_id, job.epoch, "storage unavailable")
                    return False
                if session.lease is not lease or session.state is not SessionState.LEASED:
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
                            lease=self._lease_proto(job),
                            spec=spec_to_proto(job.spec.for_worker()),
                            urls=urls,
                            traceparent=lease.traceparent,
                            lease_secret=lease_secret,
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

    def _grant_abandoned(self, session: WorkerSession, lease: ActiveLease) -> bool:
        """A grant being prepared for `session` will not be sent. True when the lease is still
        live and the caller must end it in the ledger; False when something else already ended
        it while the grant's URLs were signed (a cancel or a newer epoch: `_revoke` told the
        worker about a lease it never saw, which it ignores).

        A worker still on its stream never saw the lease and still waits for an answer to its
        Ready, so its session goes back to idle (the next dispatch round offers it work)."""
        still_live = session.lease is lease
        if still_live:
            session.lease = None
            if session.state is SessionState.LEASED:
                session.state = SessionState.IDLE
        elif session.state is SessionState.CONNECTED:
            # Revoked (`_revoke` left it CONNECTED). LEASED with no lease is a Ready in
            # `handle` still ending the lease in the ledger: that path sets the state itself.
            session.state = SessionState.IDLE
        return still_live

    # Sample tasks (issue 13; see the module docstring) ---------------------------------------

    async def _offer_sample_task(self, session: WorkerSession, lease_secret: str) -> bool:
        """Called by `_offer` (claiming) when no training job was claimable for the session."""
        task = await self._ledger.claim_sample_task(
            session.machine.machine_id,
            session.machine.vram_mb,
            self._lease_ttl_s,
            secret_sha256=digest(lease_secret),
        )
        if task is None or task.lease_id is None or task.spec is None:
            return False
        if session.state is not SessionState.IDLE:
            await self._ledger.drain_sample_task(task.lease_id, task.epoch)
            return False
        span = tracer.start_span(
            "scheduler.grant_sample_task", context=trace_context(task.traceparent)
        )
        session.state = SessionState.LEASED
        session.lease = ActiveLease(
            job_id=task.job_id,
            lease_id=task.lease_id,
            epoch=task.epoch,
            owner=task.owner,
            urls_expire_at=0.0,
            traceparent=traceparent_of(span),
            task=task,
        )
        lease = session.lease
        span.set_attributes(_lease_attributes(lease, session, step=task.step))
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
            if session.lease is not lease or session.state is not SessionState.LEASED:
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
                        spec=spec_to_proto(task.spec),
                        settings=sample_settings_to_proto(task.settings),
                        weights=weights,
                        weights_sha256=task.weights_sha256,
                        weights_is_checkpoint=task.weights_is_checkpoint,
                        uploads=uploads,
                        lease_secret=lease_secret,
                        traceparent=session.lease.traceparent,
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

    async def _samples_stored(self, session: WorkerSession, msg: fpb.SamplesStored) -> None:
        ref = lease_ref_from_proto(msg.lease, "samples_stored.lease")
        lease = session.lease if session.holds(ref) else None
        task = lease.task if lease is not None else None
        images = stored_images_from_proto(msg, task)
        if lease is None or task is None:
            self._reject(session, ref, "not this stream's sample task")
            return
        for image in images:
            if not await self._stored_as_announced(
                session, ref, image.key, image.size_bytes, image.sha256
            ):
                return
        session.lease = None
        session.state = SessionState.CONNECTED
        done = await self._ledger.complete_sample_task(ref.lease_id, ref.epoch, images)
        if done is None:
            self._reject(session, ref, "the sample task's lease is no longer live")
            return
        metrics.SAMPLE_TASKS.labels("succeeded").inc()
        log.info(
            "validation images stored",
            job_id=done.job_id,
            task_id=done.task_id,
            step=done.step,
            images=len(images),
            machine_id=session.machine.machine_id,
        )
        # A checkpoint held back for this task may go now.
        self._spawn(self._sweeper.prune_checkpoints(done.job_id), "prune checkpoints")

    async def _sample_task_failed(
        self, session: WorkerSession, ref: LeaseRef, failure_class: FailureClass, message: str
    ) -> None:
        session.lease = None
        session.state = SessionState.CONNECTED
        task = await self._ledger.fail_sample_task(ref.lease_id, ref.epoch, failure_class, message)
        if task is None:
            self._reject(session, ref, "the sample task's lease is no longer live")
            return
        metrics.SAMPLE_TASKS.labels("failed" if task.state == "FAILED" else "requeued").inc()
        log.warning(
            "sample task attempt failed; its job is not affected",
            job_id=task.job_id,
            task_id=task.task_id,
            machine_id=session.machine.machine_id,
            failure_class=failure_class.value,
            task_state=task.state,
            error=message,
        )
        if task.state == "FAILED":
            self._spawn(self._sweeper.prune_checkpoints(task.job_id), "prune checkpoints")

    async def _preempt_samples(self) -> None:
        """Training is never delayed by samples: a session busy with a sample task gives it back
        when it could claim a queued training job (as many as there are such jobs beyond the idle
        sessions; re-queued at once, no failure counted)."""
        sampling = [
            s
            for s in self._sessions.values()
            if s.state is SessionState.LEASED and s.lease is not None and s.lease.task is not None
        ]
        if not sampling:
            return
        idle = sum(1 for s in self._sessions.values() if s.state is SessionState.IDLE)
        queued = await self._ledger.count_queued(idle + len(sampling))
        for session in sampling[: max(0, queued - idle)]:
            lease = session.lease
            if lease is None or lease.task is None:
                continue
            if not await self._ledger.training_claimable(
                session.machine.machine_id, session.machine.vram_mb
            ):
                continue
            if session.lease is not lease:
                continue
            await self._ledger.drain_sample_task(lease.lease_id, lease.epoch)
            # The ledger's NOTIFY revokes it too; revoking here first is the same (idempotent).
            self._revoke(session, canceled=False)
            metrics.SAMPLE_TASKS.labels("preempted").inc()
            log.info(
                "sample task gave way to training",
                task_id=lease.task.task_id,
                machine_id=session.machine.machine_id,
            )

    def _lease_proto(self, job: Job) -> fpb.Lease:
        expires = datetime.now(UTC) + timedelta(seconds=self._lease_ttl_s)
        return fpb.Lease(
            lease_id=job.lease_id or "",
            job_id=job.job_id,
            epoch=job.epoch,
            machine_id=job.machine_id or "",
            expires_at=timestamp(expires),
        )

    async def _renew_urls(self, session: WorkerSession) -> None:
        lease = session.lease
        if lease is None or lease.task is not None:
            return
        job = await self._ledger.get_job_any_owner(lease.job_id)
        if job is None or job.lease_id != lease.lease_id:
            return
        urls = await self._signer.lease_urls(job)
        lease.urls_expire_at = time.monotonic() + self._url_ttl_s
        session.send(
            fpb.ConnectResponse(
                urls_renewed=fpb.UrlsRenewed(
                    lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch), urls=urls
                )
            )
        )

    def stop_worker(self, machine_id: str, reason: str) -> bool:
        """Tells one connected worker to drain and exit (scale-down, a bad node); False if it is
        not connected to this replica."""
        session = self._sessions.get(machine_id)
        if session is None:
            return False
        session.state = SessionState.DRAINING
        session.send(fpb.ConnectResponse(shutdown=fpb.Shutdown(reason=reason)))
        return True

    async def shutdown(self) -> None:
        """This replica is stopping: its streams end, and workers reconnect (to another replica,
        or to this one restarted) keeping their leases; they are not told to stop."""
        for session in list(self._sessions.values()):
            self.close_session(session)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def _lease_attributes(
    lease: ActiveLease, session: WorkerSession, **extra: int
) -> dict[str, str | int]:
    attributes: dict[str, str | int] = {
        "lorafleet.job_id": lease.job_id,
        "lorafleet.lease_id": lease.lease_id,
        "lorafleet.epoch": lease.epoch,
        "lorafleet.machine_id": session.machine.machine_id,
    }
    attributes.update({f"lorafleet.{k}": v for k, v in extra.items()})
    return attributes
