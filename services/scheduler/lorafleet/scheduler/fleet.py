"""The worker side of the scheduler: one session per connected worker, and the dispatcher.

The ledger decides (claims, fencing); sessions only deliver. Work is pushed: a worker that says
Ready is offered a job at once, and every replica re-offers when the ledger NOTIFYs that a job
became claimable, so no worker ever polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import structlog

from lorafleet.errors import InvalidArgument, StaleLease
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.model import (
    Checkpoint,
    Job,
    JobResult,
    JobState,
    Machine,
    checkpoint_key,
    class_image_key,
    result_key,
    upload_key,
    validation_image_key,
)
from lorafleet.scheduler.ledger import Ledger
from lorafleet.scheduler.notifications import LEASE_ENDED, WORK, Notifications
from lorafleet.scheduler.storage import ObjectStore
from lorafleet.serde import checkpoint_to_proto, failure_class_from_proto, spec_to_proto, timestamp

log = structlog.get_logger(__name__)

_MACHINE_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
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


@dataclass(eq=False, kw_only=True)
class WorkerSession:
    machine: Machine
    state: SessionState = SessionState.CONNECTED
    lease: ActiveLease | None = None
    outbox: asyncio.Queue[fpb.ConnectResponse | None] = field(default_factory=asyncio.Queue)
    claiming: bool = False
    last_seen_touch: float = 0.0

    def send(self, message: fpb.ConnectResponse) -> None:
        if self.state is not SessionState.CLOSED:
            self.outbox.put_nowait(message)

    def holds(self, lease: fpb.LeaseRef) -> bool:
        return (
            self.lease is not None
            and self.lease.lease_id == lease.lease_id
            and self.lease.epoch == lease.epoch
        )


def _require_lease(ref: fpb.LeaseRef, field_name: str) -> None:
    if not ref.lease_id:
        raise InvalidArgument(f"{field_name}.lease_id", "is required")
    if ref.epoch <= 0:
        raise InvalidArgument(f"{field_name}.epoch", "must be positive")


def machine_from_hello(hello: fpb.Hello) -> Machine:
    if not _MACHINE_ID.fullmatch(hello.machine_id):
        raise InvalidArgument("hello.machine_id", "must match [A-Za-z0-9_.:@-]{1,128}")
    if hello.vram_mb < 0:
        raise InvalidArgument("hello.vram_mb", "must not be negative")
    for name, value in (
        ("provider_instance_id", hello.provider_instance_id),
        ("gpu_model", hello.gpu_model),
        ("version", hello.version),
    ):
        if len(value) > 256 or "\x00" in value:
            raise InvalidArgument(f"hello.{name}", "at most 256 characters, no NUL")
    return Machine(
        machine_id=hello.machine_id,
        provider_instance_id=hello.provider_instance_id,
        gpu_model=hello.gpu_model,
        vram_mb=hello.vram_mb,
        qualified=hello.qualification.passed,
        version=hello.version,
    )


class Fleet:
    """Sessions of the workers connected to this replica, and the dispatch loop."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        storage: ObjectStore,
        notifications: Notifications,
        scheduler_id: str,
        lease_ttl_s: float,
        heartbeat_interval_s: float,
        url_ttl_s: int,
        checkpoint_retention: int,
        dispatch_interval_s: float,
    ) -> None:
        self._ledger = ledger
        self._storage = storage
        self._scheduler_id = scheduler_id
        self._lease_ttl_s = lease_ttl_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._url_ttl_s = url_ttl_s
        self._retention = checkpoint_retention
        self._dispatch_interval_s = dispatch_interval_s
        self._sessions: dict[str, WorkerSession] = {}
        self._wake = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        notifications.subscribe(WORK, lambda _payload: self._wake.set())
        notifications.subscribe(LEASE_ENDED, self._on_lease_ended)

    @property
    def sessions(self) -> dict[str, WorkerSession]:
        return self._sessions

    def _spawn(self, coro: Awaitable[None], what: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except Exception:
                log.exception("background task failed", task=what)

        task = asyncio.get_running_loop().create_task(guarded())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # Sessions ---------------------------------------------------------------------------------

    async def open_session(self, hello: fpb.Hello) -> WorkerSession:
        machine = machine_from_hello(hello)
        previous = self._sessions.get(machine.machine_id)
        if previous is not None:
            # The same machine reconnected before its old stream was noticed dead.
            self.close_session(previous)
        qualification = {
            "passed": hello.qualification.passed,
            "detail": hello.qualification.detail,
            "tflops": hello.qualification.tflops,
            "free_memory_mb": hello.qualification.free_memory_mb,
            "free_disk_mb": hello.qualification.free_disk_mb,
            "versions": dict(hello.qualification.versions),
        }
        await self._ledger.upsert_machine(machine, qualification)
        session = WorkerSession(machine=machine)
        if not machine.qualified:
            session.state = SessionState.UNQUALIFIED
            log.warning(
                "worker failed qualification; it gets no work",
                machine_id=machine.machine_id,
                detail=hello.qualification.detail,
            )
        self._sessions[machine.machine_id] = session
        welcome = fpb.Welcome(
            scheduler_id=self._scheduler_id,
            heartbeat_interval_s=self._heartbeat_interval_s,
            lease_ttl_s=self._lease_ttl_s,
        )
        resumed: Job | None = None
        if hello.held_lease.lease_id:
            resumed = await self._ledger.resume_lease(
                hello.held_lease.lease_id,
                hello.held_lease.epoch,
                machine.machine_id,
                self._lease_ttl_s,
            )
        if resumed is not None and resumed.lease_id is not None:
            session.state = SessionState.LEASED
            session.lease = ActiveLease(
                job_id=resumed.job_id,
                lease_id=resumed.lease_id,
                epoch=resumed.epoch,
                owner=resumed.owner,
                urls_expire_at=0.0,
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
        session.state = SessionState.CLOSED
        session.outbox.put_nowait(None)
        if self._sessions.get(session.machine.machine_id) is session:
            del self._sessions[session.machine.machine_id]
        log.info("worker disconnected", machine_id=session.machine.machine_id)

    async def handle(self, session: WorkerSession, request: fpb.ConnectRequest) -> None:
        """One worker message; raises InvalidArgument for a malformed one."""
        kind = request.WhichOneof("message")
        if kind == "ready":
            if session.state in (SessionState.CONNECTED, SessionState.IDLE, SessionState.LEASED):
                if session.lease is not None:
                    log.info(
                        "worker abandoned its lease by saying Ready",
                        machine_id=session.machine.machine_id,
                        job_id=session.lease.job_id,
                    )
                session.lease = None
                session.state = SessionState.IDLE
                self._spawn(self._offer_once(session), "offer")
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
            log.warning(
                "worker notice",
                machine_id=session.machine.machine_id,
                lease_id=request.notice.lease.lease_id,
                message=request.notice.message[:2000],
            )
        elif kind == "hello":
            raise InvalidArgument("hello", "sent twice on one stream")
        else:
            raise InvalidArgument("message", "empty or unknown message")

    def _reject(self, session: WorkerSession, ref: fpb.LeaseRef, reason: str) -> None:
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
        session.send(fpb.ConnectResponse(rejected=fpb.Rejected(lease=ref, reason=reason)))

    async def _heartbeat(self, session: WorkerSession, hb: fpb.Heartbeat) -> None:
        now = time.monotonic()
        if not hb.lease.lease_id:
            if now - session.last_seen_touch > self._heartbeat_interval_s:
                session.last_seen_touch = now
                await self._ledger.touch_machine(session.machine.machine_id)
            return
        _require_lease(hb.lease, "heartbeat.lease")
        if hb.step < 0:
            raise InvalidArgument("heartbeat.step", "must not be negative")
        alive = await self._ledger.heartbeat(
            hb.lease.lease_id,
            hb.lease.epoch,
            self._lease_ttl_s,
            step=hb.step,
            loss=hb.loss if _finite(hb.loss) else None,
            learning_rate=hb.learning_rate if _finite(hb.learning_rate) else None,
            seconds_per_step=hb.seconds_per_step if _finite(hb.seconds_per_step) else None,
        )
        if not alive:
            self._reject(session, hb.lease, "the lease is no longer the job's")
            return
        lease = session.lease
        # Renew URLs once a third of their life is left, so uploads never meet an expired one.
        renew = lease is not None and lease.urls_expire_at - now < self._url_ttl_s / 3
        if renew and session.holds(hb.lease):
            await self._renew_urls(session)

    async def _live_lease(self, session: WorkerSession, ref: fpb.LeaseRef) -> Job:
        """The job, if `ref` is its live lease; else refuse the message (fencing)."""
        job_id = session.lease.job_id if session.holds(ref) and session.lease else None
        job = await self._ledger.get_job_any_owner(job_id) if job_id else None
        if job is None or job.lease_id != ref.lease_id or job.epoch != ref.epoch:
            raise StaleLease(f"lease {ref.lease_id} epoch {ref.epoch} is not live")
        return job

    async def _urls_requested(self, session: WorkerSession, req: fpb.UrlsRequested) -> None:
        _require_lease(req.lease, "urls_requested.lease")
        if not 1 <= len(req.slots) <= 1000:
            raise InvalidArgument("urls_requested.slots", "must hold 1 to 1000 slots")
        try:
            job = await self._live_lease(session, req.lease)
        except StaleLease as exc:
            self._reject(session, req.lease, str(exc))
            return
        uploads = []
        for i, slot in enumerate(req.slots):
            if slot.step < 0 or slot.index < 0:
                raise InvalidArgument(f"urls_requested.slots[{i}]", "step and index >= 0")
            if slot.kind == fpb.ARTIFACT_KIND_CHECKPOINT:
                key = checkpoint_key(job.job_id, slot.step, job.epoch)
            elif slot.kind == fpb.ARTIFACT_KIND_VALIDATION_IMAGE:
                key = validation_image_key(job.job_id, slot.step, job.epoch, slot.index)
            elif slot.kind == fpb.ARTIFACT_KIND_CLASS_IMAGE:
                key = class_image_key(job.job_id, slot.index)
            else:
                raise InvalidArgument(f"urls_requested.slots[{i}].kind", "unknown artifact kind")
            signed = await self._storage.presign_put(key, ttl_s=self._url_ttl_s)
            uploads.append(fpb.UploadUrl(slot=slot, key=key, url=signed.url))
        urls = fpb.JobUrls(uploads=uploads)
        session.send(fpb.ConnectResponse(urls_renewed=fpb.UrlsRenewed(lease=req.lease, urls=urls)))

    async def _checkpoint_committed(
        self, session: WorkerSession, msg: fpb.CheckpointCommitted
    ) -> None:
        _require_lease(msg.lease, "checkpoint_committed.lease")
        if msg.step <= 0:
            raise InvalidArgument("checkpoint_committed.step", "must be positive")
        if msg.size_bytes <= 0:
            raise InvalidArgument("checkpoint_committed.size_bytes", "must be positive")
        if not _SHA256.fullmatch(msg.sha256):
            raise InvalidArgument("checkpoint_committed.sha256", "must be 64 lowercase hex digits")
        lease = session.lease
        if lease is None or not session.holds(msg.lease):
            self._reject(session, msg.lease, "not this stream's lease")
            return
        expected = checkpoint_key(lease.job_id, msg.step, msg.lease.epoch)
        if msg.key != expected:
            raise InvalidArgument("checkpoint_committed.key", f"must be {expected!r}")
        checkpoint = Checkpoint(
            step=msg.step,
            epoch=msg.lease.epoch,
            key=msg.key,
            size_bytes=msg.size_bytes,
            sha256=msg.sha256,
        )
        if not await self._ledger.commit_checkpoint(
            msg.lease.lease_id, msg.lease.epoch, checkpoint
        ):
            self._reject(session, msg.lease, "the lease is no longer the job's")
            return
        log.info(
            "checkpoint committed",
            job_id=lease.job_id,
            lease_id=lease.lease_id,
            machine_id=session.machine.machine_id,
            step=msg.step,
        )
        self._spawn(self.prune_checkpoints(lease.job_id), "prune checkpoints")

    async def _job_succeeded(self, session: WorkerSession, msg: fpb.JobSucceeded) -> None:
        _require_lease(msg.lease, "job_succeeded.lease")
        if msg.size_bytes <= 0:
            raise InvalidArgument("job_succeeded.size_bytes", "must be positive")
        if not _SHA256.fullmatch(msg.sha256):
            raise InvalidArgument("job_succeeded.sha256", "must be 64 lowercase hex digits")
        lease = session.lease
        if lease is None or not session.holds(msg.lease):
            self._reject(session, msg.lease, "not this stream's lease")
            return
        expected = result_key(lease.job_id, msg.lease.epoch)
        if msg.key != expected:
            raise InvalidArgument("job_succeeded.key", f"must be {expected!r}")
        # Cleared before the ledger call: its NOTIFY must not revoke what the worker just finished.
        session.lease = None
        session.state = SessionState.CONNECTED
        job = await self._ledger.succeed_job(
            msg.lease.lease_id,
            msg.lease.epoch,
            JobResult(key=msg.key, size_bytes=msg.size_bytes, sha256=msg.sha256),
            step=msg.step,
            loss=msg.loss if _finite(msg.loss) else None,
        )
        if job is None:
            self._reject(session, msg.lease, "the lease is no longer the job's")
            return
        log.info("job succeeded", job_id=job.job_id, machine_id=session.machine.machine_id)
        self._spawn(self.prune_checkpoints(job.job_id), "delete checkpoints")

    async def _job_failed(self, session: WorkerSession, msg: fpb.JobFailed) -> None:
        _require_lease(msg.lease, "job_failed.lease")
        failure_class = failure_class_from_proto(msg.failure_class, "job_failed.failure_class")
        message = msg.message.replace("\x00", "")[:4000] or "no message"
        if session.holds(msg.lease):
            session.lease = None
            session.state = SessionState.CONNECTED
        job = await self._ledger.fail_attempt(
            msg.lease.lease_id, msg.lease.epoch, failure_class, message
        )
        if job is None:
            self._reject(session, msg.lease, "the lease is no longer the job's")
            return
        log.warning(
            "attempt failed",
            job_id=job.job_id,
            machine_id=session.machine.machine_id,
            failure_class=failure_class.value,
            job_state=job.state.value,
            error=message,
        )
        if job.state is JobState.FAILED:
            self._spawn(self.prune_checkpoints(job.job_id), "delete checkpoints")

    async def _draining(self, session: WorkerSession, msg: fpb.Draining) -> None:
        session.state = SessionState.DRAINING
        if not msg.lease.lease_id:
            return
        _require_lease(msg.lease, "draining.lease")
        session.lease = None
        job = await self._ledger.drain_lease(
            msg.lease.lease_id, msg.lease.epoch, msg.reason[:500].replace("\x00", "")
        )
        if job is None:
            self._reject(session, msg.lease, "the lease is no longer the job's")
            return
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
                    lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch), reason=reason
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
        """Offers queued work to idle workers whenever the ledger says some became claimable."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._dispatch_interval_s)
            self._wake.clear()
            try:
                await self._dispatch_round()
            except Exception:
                log.exception("dispatch round failed")

    async def _dispatch_round(self) -> None:
        idle = [
            s for s in self._sessions.values() if s.state is SessionState.IDLE and not s.claiming
        ]
        if not idle:
            return
        queued = await self._ledger.count_queued(len(idle))
        if queued == 0:
            return
        granted = 0
        position = 0
        while position < len(idle) and granted < queued:
            # No more claims in flight than jobs left: extra ones would only find nothing.
            width = min(_CLAIM_CONCURRENCY, queued - granted)
            batch = idle[position : position + width]
            position += width
            results = await asyncio.gather(*(self._offer(s) for s in batch))
            granted += sum(results)

    async def _offer_once(self, session: WorkerSession) -> None:
        await self._offer(session)

    async def _offer(self, session: WorkerSession) -> bool:
        """Claims one job for an idle session and sends the grant; True if it got one."""
        if session.state is not SessionState.IDLE or session.claiming:
            return False
        session.claiming = True
        try:
            job = await self._ledger.claim_job(
                session.machine.machine_id, session.machine.vram_mb, self._lease_ttl_s
            )
            if job is None or job.lease_id is None:
                return False
            if session.state is not SessionState.IDLE:
                # The stream closed (or the worker drained) while the claim ran: give it back.
                await self._ledger.drain_lease(job.lease_id, job.epoch, "worker left during grant")
                return False
            session.state = SessionState.LEASED
            session.lease = ActiveLease(
                job_id=job.job_id,
                lease_id=job.lease_id,
                epoch=job.epoch,
                owner=job.owner,
                urls_expire_at=0.0,
            )
            try:
                urls = await self._job_urls(job)
            except Exception:
                log.exception("could not sign the job's URLs; re-queueing", job_id=job.job_id)
                session.lease = None
                session.state = SessionState.IDLE
                await self._ledger.drain_lease(job.lease_id, job.epoch, "storage unavailable")
                return False
            session.lease.urls_expire_at = time.monotonic() + self._url_ttl_s
            session.send(
                fpb.ConnectResponse(
                    lease_granted=fpb.LeaseGranted(
                        lease=self._lease_proto(job),
                        spec=spec_to_proto(job.spec),
                        urls=urls,
                        traceparent=job.traceparent or "",
                    )
                )
            )
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

    def _lease_proto(self, job: Job) -> fpb.Lease:
        expires = datetime.now(UTC) + timedelta(seconds=self._lease_ttl_s)
        return fpb.Lease(
            lease_id=job.lease_id or "",
            job_id=job.job_id,
            epoch=job.epoch,
            machine_id=job.machine_id or "",
            expires_at=timestamp(expires),
        )

    async def _job_urls(self, job: Job) -> fpb.JobUrls:
        ttl = self._url_ttl_s
        spec = job.spec

        async def listed(prefix: str) -> list[fpb.FileUrl]:
            base = upload_key(job.owner, prefix)
            objects = await self._storage.list(base)
            signed = await asyncio.gather(
                *(self._storage.presign_get(o.key, ttl_s=ttl) for o in objects)
            )
            return [
                fpb.FileUrl(name=o.key.removeprefix(base), key=o.key, url=s.url)
                for o, s in zip(objects, signed, strict=True)
            ]

        urls = fpb.JobUrls(instance_files=await listed(spec.instance_data_prefix))
        if spec.class_data_prefix:
            urls.class_files.extend(await listed(spec.class_data_prefix))
        elif spec.with_prior_preservation:
            # Class images generated by an earlier attempt: reuse them on resume.
            prefix = class_image_key(job.job_id, 0).rsplit("/", 1)[0] + "/"
            for obj in await self._storage.list(prefix):
                signed = await self._storage.presign_get(obj.key, ttl_s=ttl)
                urls.class_files.append(
                    fpb.FileUrl(name=obj.key.removeprefix(prefix), key=obj.key, url=signed.url)
                )
        for checkpoint in await self._ledger.live_checkpoints(job.job_id):
            signed = await self._storage.presign_get(checkpoint.key, ttl_s=ttl)
            urls.checkpoints.append(
                fpb.CheckpointDownload(checkpoint=checkpoint_to_proto(checkpoint), url=signed.url)
            )
        key = result_key(job.job_id, job.epoch)
        put = await self._storage.presign_put(key, ttl_s=ttl)
        urls.result_upload.CopyFrom(fpb.UploadUrl(key=key, url=put.url))
        urls.expires_at.FromDatetime(put.expires_at)
        return urls

    async def _renew_urls(self, session: WorkerSession) -> None:
        lease = session.lease
        if lease is None:
            return
        job = await self._ledger.get_job_any_owner(lease.job_id)
        if job is None or job.lease_id != lease.lease_id:
            return
        urls = await self._job_urls(job)
        lease.urls_expire_at = time.monotonic() + self._url_ttl_s
        session.send(
            fpb.ConnectResponse(
                urls_renewed=fpb.UrlsRenewed(
                    lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch), urls=urls
                )
            )
        )

    # Sweepers (safe on every replica) ---------------------------------------------------------

    async def sweep_once(self) -> None:
        for expired in await self._ledger.expire_leases():
            log.warning(
                "lease expired; job re-queued",
                job_id=expired.job_id,
                lease_id=expired.lease_id,
                machine_id=expired.machine_id,
                epoch=expired.epoch,
            )
        for job_id in await self._ledger.finished_jobs_with_checkpoints(100):
            await self.prune_checkpoints(job_id)

    async def prune_checkpoints(self, job_id: str) -> None:
        """Keeps the newest K of a running job; deletes all of a finished one's."""
        keys = await self._ledger.checkpoints_to_delete(job_id, self._retention)
        if keys:
            await self._storage.delete(keys)
            await self._ledger.mark_checkpoints_deleted(job_id, keys)

    async def run_sweeper(
        self, interval_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    ) -> None:
        while True:
            try:
                await self.sweep_once()
            except Exception:
                log.exception("sweep failed")
            await sleep(interval_s)

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


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")
