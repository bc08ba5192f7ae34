"""WorkerService logic on domain values: the servicer decodes each worker message (serde) and
calls one method here, which acts through the ledger and answers on the worker's session.

Every message about a lease is fenced twice: by the stream (`WorkerSession.holds`: lease ids
are not secret, and only the stream a lease was granted on may speak for it) and by the ledger
(the lease and epoch must still be the job's). A message that fails either is refused with
`Rejected`, and the worker drops the lease. Objects a worker announces (checkpoints, results,
images) are recorded only once the store holds exactly what was announced, and checkpoints and
results only in their format (`formats.py`: safetensors headers read with ranged reads).
"""

from __future__ import annotations

import secrets
import time

import structlog
from opentelemetry import trace

from lorafleet.core.errors import AlreadyExists, InvalidArgument, StaleLease, Unauthenticated
from lorafleet.core.model import Checkpoint, FailureClass, Job, JobResult, JobState, LeaseRef
from lorafleet.core.serde import (
    CheckpointReport,
    ClassImagesReport,
    DrainingReport,
    FailureReport,
    HeartbeatReport,
    NoticeReport,
    ReadyReport,
    SamplesReport,
    SuccessReport,
    UrlsRequest,
    WorkerHello,
    check_checkpoint_key,
    check_class_image_keys,
    check_result_keys,
    check_stored_images,
    lease_ref_to_proto,
)
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.ledger.ledger import Ledger, ResumedLease
from lorafleet.scheduler import metrics
from lorafleet.scheduler.background import BackgroundTasks
from lorafleet.scheduler.dispatcher import (
    Dispatcher,
    digest,
    lease_attributes,
    lease_proto,
    trace_context,
)
from lorafleet.scheduler.formats import (
    BadFormat,
    Layout,
    check_lora_file,
    checkpoint_layout,
    layout_difference,
)
from lorafleet.scheduler.identity import IdentityVerifiers
from lorafleet.scheduler.sessions import (
    SampleLease,
    SessionState,
    TrainingLease,
    WorkerSession,
    WorkerSessions,
)
from lorafleet.scheduler.signing import UrlSigner
from lorafleet.scheduler.storage import ObjectStore
from lorafleet.scheduler.sweeper import Sweeper

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.scheduler")


class WorkerHandler:
    def __init__(
        self,
        *,
        ledger: Ledger,
        storage: ObjectStore,
        signer: UrlSigner,
        sweeper: Sweeper,
        sessions: WorkerSessions,
        dispatcher: Dispatcher,
        background: BackgroundTasks,
        scheduler_id: str,
        lease_ttl_s: float,
        heartbeat_interval_s: float,
        identities: IdentityVerifiers,
    ) -> None:
        self._ledger = ledger
        self._storage = storage
        self._signer = signer
        self._sweeper = sweeper
        self._sessions = sessions
        self._dispatcher = dispatcher
        self._background = background
        self._scheduler_id = scheduler_id
        self._lease_ttl_s = lease_ttl_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._identities = identities
        self._url_ttl_s = signer.lease_urls_ttl_s

    # The stream opens and ends ----------------------------------------------------------------

    def admit_stream(self, source: str) -> None:
        """A stream opened from `source` (`sessions.peer_source`): refused with
        ResourceExhausted past the source's rate, before anything else is done for it."""
        self._sessions.gate.admit_stream(source)

    def refused(self, source: str, reason: str) -> None:
        """A stream from `source` was refused before its session began (logged per source)."""
        self._sessions.gate.log(source).info("worker stream refused", reason=reason)

    async def connect(
        self, hello: WorkerHello, *, worker_token: str, source: str = ""
    ) -> WorkerSession:
        """A worker said Hello from `source` under a valid `worker_token`: its session, with
        its lease if it resumes one."""
        machine = hello.machine
        source_log = self._sessions.gate.log(source)
        token_key = digest(worker_token).hex()
        # The provider's word for the machine id, where the Hello carries it (identity.py). A
        # proof that does not verify is refused even where none is required: it is a
        # misconfigured worker or a forgery, never something to carry on without. Verifying
        # first is cheap and bounded per peer (one proof per stream, streams per peer address
        # admitted before the token is even checked), and lets a verified machine's Hellos be
        # charged to its own budget: a flood of unverified ones cannot keep it out.
        provider = ""
        if hello.identity.present or self._identities.required:
            try:
                verified = await self._identities.verify(machine.machine_id, hello.identity)
            except Unauthenticated:
                self._sessions.gate.spend_hello(token_key)
                raise
            provider = verified.provider
        # Before the ledger is touched: Hellos per verified machine, or per worker token (one
        # token serves a whole fleet) for the rest.
        self._sessions.gate.admit_hello(
            token_key, verified_machine=f"{provider}:{machine.machine_id}" if provider else ""
        )
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
            identity_provider=provider,
        ):
            raise AlreadyExists(
                f"hello.machine_id: machine {machine.machine_id!r} is held by another live"
                " stream (or a provider-verified one); reconnect with its session_token, or"
                f" after {self._lease_ttl_s:g} s of its silence"
            )
        previous = self._sessions.get(machine.machine_id)
        if previous is not None:
            # The same machine reconnected before its old stream was noticed dead.
            self.disconnected(previous)
        await self._ledger.upsert_machine(machine, hello.qualification)
        # A sample task is never resumed: what this machine held goes back to the queue now,
        # rather than keeping the task (and, one live lease per machine, the worker) waiting
        # out its lease.
        for task_id in await self._ledger.release_machine_sample_tasks(machine.machine_id):
            source_log.info(
                "sample task re-queued: its machine reconnected",
                task_id=task_id,
                machine_id=machine.machine_id,
            )
        session = WorkerSession(
            machine=machine,
            session_sha256=session_sha256,
            bounds=self._sessions.bounds,
            log=source_log,
        )
        if not machine.qualified:
            session.disqualify()
            session.log.warning(
                "worker failed qualification; it gets no work",
                machine_id=machine.machine_id,
                detail=hello.qualification.detail,
            )
        self._sessions.add(session)
        welcome = fpb.Welcome(
            scheduler_id=self._scheduler_id,
            heartbeat_interval_s=self._heartbeat_interval_s,
            lease_ttl_s=self._lease_ttl_s,
            session_token=token,
            # servicers.WorkerServicer answers Ping on every stream (issue 31).
            answers_ping=True,
        )
        resumed: ResumedLease | None = None
        if hello.held_lease is not None and session.may("resume"):
            # Only the stream the lease was granted on was given its secret. An unqualified
            # machine resumes nothing: it gets no work, and the lease runs out its TTL.
            resumed = await self._ledger.resume_lease(
                hello.held_lease.lease_id,
                hello.held_lease.epoch,
                machine.machine_id,
                self._lease_ttl_s,
                secret_sha256=digest(hello.held_lease_secret),
            )
        if resumed is not None and resumed.job.lease_id is not None:
            # Under its grant span again, as the worker's own spans for the lease still are.
            session.resume(TrainingLease.from_job(resumed.job, traceparent=resumed.traceparent))
            welcome.resumed_lease.CopyFrom(lease_proto(resumed.job, self._lease_ttl_s))
            log.info("lease resumed", machine_id=machine.machine_id, job_id=resumed.job.job_id)
        session.send(fpb.ConnectResponse(welcome=welcome))
        if session.lease is not None:
            await self._renew_urls(session)
        session.log.info(
            "worker connected",
            machine_id=machine.machine_id,
            vram_mb=machine.vram_mb,
            identity=provider or "unverified",
        )
        return session

    def disconnected(self, session: WorkerSession) -> None:
        """The stream ended. A held lease stays until its TTL: the worker may come back."""
        if session.state is SessionState.CLOSED:
            return
        if session.state is SessionState.DRAINING and session.lease is None:
            # The worker said it is leaving and holds nothing: its machine id is free at once
            # (a restarted `lorafleet up` waits no TTL for its own workers' ids).
            self._background.spawn(
                self._ledger.release_machine_session(
                    session.machine.machine_id, session.session_sha256
                ),
                "release machine id",
            )
        self._sessions.close_session(session)

    async def shutdown(self) -> None:
        """This replica is stopping: its streams end, and workers reconnect (to another replica,
        or to this one restarted) keeping their leases; they are not told to stop."""
        for session in self._sessions.all():
            self.disconnected(session)
        await self._background.cancel_all()

    # What a worker says -----------------------------------------------------------------------

    async def ready(self, session: WorkerSession, report: ReadyReport) -> None:
        """The worker waits for work: it is offered some at once, preferring what it says it
        holds (`report`)."""
        if not session.may("idle"):
            return  # draining, unqualified or closed: no work
        session.ready = report
        if (abandoned := session.idle()) is not None:
            # Ended at once in the ledger, and the machine banned from the job (or the sample
            # task): a stream holds one live lease of any kind at most, and cannot hoard jobs
            # or tasks (or their URLs) by saying Ready again and again. Meanwhile a claim for
            # this session finds nothing: the ledger skips a machine holding a live lease.
            log.info(
                "worker abandoned its lease by saying Ready",
                machine_id=session.machine.machine_id,
                job_id=abandoned.job_id,
                task_id=abandoned.task.task_id if isinstance(abandoned, SampleLease) else "",
            )
            match abandoned:
                case SampleLease():
                    await self._ledger.abandon_sample_task(
                        abandoned.lease_id, abandoned.epoch, session.machine.machine_id
                    )
                case TrainingLease():
                    await self._ledger.drop_lease(
                        session.machine.machine_id,
                        abandoned.job_id,
                        "the worker abandoned the lease (said Ready while holding it)",
                    )
        self._background.spawn(self._dispatcher.offer(session), "offer")

    async def notice(self, session: WorkerSession, notice: NoticeReport) -> None:
        """Logged, and put on the job's timeline when it is about the lease this stream holds;
        both rate-limited per stream (a flood costs neither log nor ledger)."""
        if not session.notices.take():
            session.notices_suppressed += 1
            return
        # At INFO: a notice is the holder's note on the job's timeline (the interval it chose, a
        # compile decision, a checkpoint it could not store), not this replica's problem; at
        # WARNING it also showed as a raw log line inside `lorafleet demo`'s progress output.
        session.log.info(
            "worker notice",
            machine_id=session.machine.machine_id,
            lease_id=notice.lease.lease_id if notice.lease is not None else "",
            message=notice.message,
            suppressed_before=session.notices_suppressed,
        )
        session.notices_suppressed = 0
        ref = notice.lease
        if ref is not None and session.training_lease(ref) is not None:
            await self._ledger.record_notice(ref.lease_id, ref.epoch, notice.message)

    async def heartbeat(self, session: WorkerSession, hb: HeartbeatReport) -> None:
        now = time.monotonic()
        if now - session.last_seen_touch > self._heartbeat_interval_s:
            # Keeps the machine id this stream's (see connect), leased or idle.
            session.last_seen_touch = now
            await self._ledger.touch_machine(session.machine.machine_id, session.session_sha256)
        if hb.lease is None:
            return
        if not session.holds(hb.lease):
            if (canceled := session.take_canceled(hb.lease)) is not None:
                await self._final_progress(session, canceled, hb)
                return
            # Fenced by the stream, not only by (lease, epoch): lease ids are not secret.
            self._reject(session, hb.lease, "not this stream's lease")
            return
        if session.sample_lease(hb.lease) is not None:
            if not await self._ledger.heartbeat_sample_task(
                hb.lease.lease_id, hb.lease.epoch, self._lease_ttl_s
            ):
                self._reject(session, hb.lease, "the sample task's lease is no longer live")
            return
        training = session.training_lease(hb.lease)
        if training is not None and training.max_train_steps and hb.step > training.max_train_steps:
            # Progress no run of this job can report: refused like any other bad field (it
            # would show on the owner's timeline and in the holder's own pace).
            raise InvalidArgument(
                "heartbeat.step", f"past the job's max_train_steps ({training.max_train_steps})"
            )
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
            step_compiled=hb.step_compiled,
        )
        if not alive:
            self._reject(session, hb.lease, "the lease is no longer the job's")
            return
        lease = session.training_lease(hb.lease)
        # Renew URLs once a third of their life is left, so uploads never meet an expired one.
        if lease is not None and lease.urls_expire_at - now < self._url_ttl_s / 3:
            await self._renew_urls(session)

    async def _final_progress(
        self, session: WorkerSession, lease: TrainingLease, hb: HeartbeatReport
    ) -> None:
        """The holder of a lease revoked for a cancel says the step it reached (its heartbeat
        in answer to the revocation): the canceled job shows it, not its last heartbeat's,
        which may be an interval behind. Only this stream, once (`take_canceled`), and only
        forward; the ledger checks the lease was this machine's and ended by the cancel."""
        if lease.max_train_steps and hb.step > lease.max_train_steps:
            raise InvalidArgument(
                "heartbeat.step", f"past the job's max_train_steps ({lease.max_train_steps})"
            )
        recorded = await self._ledger.record_canceled_progress(
            lease.lease_id,
            lease.epoch,
            session.machine.machine_id,
            step=hb.step,
            loss=hb.loss,
            learning_rate=hb.learning_rate,
            seconds_per_step=hb.seconds_per_step,
        )
        session.log.info(
            "canceled lease's final progress",
            job_id=lease.job_id,
            machine_id=session.machine.machine_id,
            step=hb.step,
            recorded=recorded,
        )

    async def urls_requested(self, session: WorkerSession, req: UrlsRequest) -> None:
        try:
            job = await self._live_lease(session, req.lease)
        except StaleLease as exc:
            self._reject(session, req.lease, str(exc))
            return
        urls = await self._signer.slot_urls(job, req.slots)
        session.send(
            fpb.ConnectResponse(
                urls_renewed=fpb.UrlsRenewed(lease=lease_ref_to_proto(req.lease), urls=urls)
            )
        )

    async def checkpoint_committed(self, session: WorkerSession, msg: CheckpointReport) -> None:
        """A checkpoint stored under this stream's training lease: verified, then recorded.

        `CheckpointCommitted` means the worker's upload committed, not that anything is
        recorded: the ledger's `commit_checkpoint` below is the commit that counts, and only
        after the store verified the bytes. The wire name stays for compatibility."""
        ref, checkpoint = msg.lease, msg.checkpoint
        lease = session.training_lease(ref)  # a sample task's lease commits no checkpoint
        if lease is None:
            self._reject(session, ref, "not this stream's lease")
            return
        check_checkpoint_key(checkpoint, lease.job_id)
        if checkpoint.step in lease.announced_steps:
            return
        lease.announced_steps.add(checkpoint.step)
        with tracer.start_as_current_span(
            "scheduler.commit_checkpoint",
            context=trace_context(lease.traceparent),
            attributes=lease_attributes(lease, session, step=checkpoint.step),
        ) as span:
            if not await self._stored_as_announced(
                session, ref, checkpoint.key, checkpoint.size_bytes, checkpoint.sha256
            ) or not await self._checkpoint_in_format(session, ref, lease, checkpoint):
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
        self._background.spawn(self._sweeper.prune_checkpoints(lease.job_id), "prune checkpoints")

    async def class_images_committed(self, session: WorkerSession, msg: ClassImagesReport) -> None:
        """Generated class images stored under this stream's training lease: each verified in
        the store, then all recorded at once. Only recorded ones reach a later holder."""
        ref = msg.lease
        try:
            job = await self._live_lease(session, ref)
        except StaleLease as exc:
            self._reject(session, ref, str(exc))
            return
        check_class_image_keys(msg.images, job.job_id, job.spec)
        lease = session.training_lease(ref)
        if lease is None:  # revoked while the job was read
            self._reject(session, ref, "not this stream's lease")
            return
        # A repeat (a worker re-announcing after a reconnect) is not hashed again.
        images = [i for i in msg.images if i.index not in lease.announced_class_images]
        if not images:
            return
        for image in images:
            if not await self._stored_as_announced(
                session, ref, image.key, image.size_bytes, image.sha256
            ):
                return
        if not await self._ledger.commit_class_images(ref.lease_id, ref.epoch, images):
            self._reject(session, ref, "the lease is no longer the job's")
            return
        lease.announced_class_images.update(image.index for image in images)
        log.info(
            "class images recorded",
            job_id=job.job_id,
            lease_id=ref.lease_id,
            machine_id=session.machine.machine_id,
            indices=[image.index for image in images],
        )

    async def job_succeeded(self, session: WorkerSession, msg: SuccessReport) -> None:
        ref, result = msg.lease, msg.result
        lease = session.training_lease(ref)  # a sample task's lease stores no result
        if lease is None:
            self._reject(session, ref, "not this stream's lease")
            return
        check_result_keys(result, lease.job_id, ref.epoch, lease.output_format)
        with tracer.start_as_current_span(
            "scheduler.job_succeeded",
            context=trace_context(lease.traceparent),
            attributes=lease_attributes(lease, session, step=msg.step),
        ) as span:
            for file_format, stored in result.files.items():
                if not await self._stored_as_announced(
                    session, ref, stored.key, stored.size_bytes, stored.sha256
                ) or not await self._result_in_format(session, lease, ref, file_format, stored):
                    span.set_attribute("lorafleet.refused", True)
                    return
            # Ended before the ledger call: its NOTIFY must not revoke what the worker just
            # finished. (A revocation while the files were verified ended it already, and the
            # ledger refuses the result below.)
            session.end_lease(lease)
            job = await self._ledger.succeed_job(
                ref.lease_id, ref.epoch, result, step=msg.step, loss=msg.loss
            )
            if job is None:
                span.set_attribute("lorafleet.refused", True)
                self._reject(session, ref, "the lease is no longer the job's")
                return
        metrics.SUCCEEDED.inc()
        log.info("job succeeded", job_id=job.job_id, machine_id=session.machine.machine_id)
        self._background.spawn(self._sweeper.prune_checkpoints(job.job_id), "delete checkpoints")

    async def job_failed(self, session: WorkerSession, msg: FailureReport) -> None:
        ref = msg.lease
        if (task_lease := session.sample_lease(ref)) is not None:
            await self._sample_task_failed(session, task_lease, msg.failure_class, msg.message)
            return
        if (lease := session.training_lease(ref)) is None:
            self._reject(session, ref, "not this stream's lease")
            return
        session.end_lease(lease)
        job = await self._ledger.fail_attempt(
            ref.lease_id, ref.epoch, msg.failure_class, msg.message
        )
        if job is None:
            self._reject(session, ref, "the lease is no longer the job's")
            return
        metrics.ATTEMPT_FAILURES.labels(msg.failure_class.value).inc()
        if job.state is JobState.QUEUED:
            metrics.REQUEUES.labels("failed_attempt").inc()
        log.warning(
            "attempt failed",
            job_id=job.job_id,
            machine_id=session.machine.machine_id,
            failure_class=msg.failure_class.value,
            job_state=job.state.value,
            error=msg.message,
        )
        if job.state is JobState.FAILED:
            self._background.spawn(
                self._sweeper.prune_checkpoints(job.job_id), "delete checkpoints"
            )

    async def draining(self, session: WorkerSession, msg: DrainingReport) -> None:
        """The worker is leaving: it gets no more work, and its lease goes back to the queue at
        once (without waiting out the TTL). A session already closed (its machine reconnected on
        another stream, which took over its lease) has nothing left to drain."""
        if not session.may("drain"):
            return
        session.drain()
        metrics.DRAINS.inc()
        ref = msg.lease
        if ref is None:
            return
        if (task_lease := session.sample_lease(ref)) is not None:
            session.end_lease(task_lease)
            if not await self._ledger.drain_sample_task(ref.lease_id, ref.epoch):
                self._reject(session, ref, "the sample task's lease is no longer live")
            return
        if (lease := session.training_lease(ref)) is None:
            self._reject(session, ref, "not this stream's lease")
            return
        session.end_lease(lease)
        job = await self._ledger.drain_lease(ref.lease_id, ref.epoch, msg.reason)
        if job is None:
            self._reject(session, ref, "the lease is no longer the job's")
            return
        metrics.REQUEUES.labels("drained").inc()
        log.info(
            "lease drained; job re-queued", job_id=job.job_id, machine_id=session.machine.machine_id
        )

    async def samples_stored(self, session: WorkerSession, msg: SamplesReport) -> None:
        """A sample task's images, each verified in the store, end the task."""
        ref, images = msg.lease, msg.images
        lease = session.sample_lease(ref)
        if lease is None:
            self._reject(session, ref, "not this stream's sample task")
            return
        check_stored_images(images, lease.task)
        for image in images:
            if not await self._stored_as_announced(
                session, ref, image.key, image.size_bytes, image.sha256
            ):
                return
        session.end_lease(lease)  # a revocation meanwhile ended it already: the ledger refuses
        done = await self._ledger.complete_sample_task(ref.lease_id, ref.epoch, list(images))
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
        self._background.spawn(self._sweeper.prune_checkpoints(done.job_id), "prune checkpoints")

    # Helpers ----------------------------------------------------------------------------------

    def _reject(self, session: WorkerSession, ref: LeaseRef, reason: str) -> None:
        metrics.STALE_REJECTIONS.inc()
        session.log.info(
            "stale worker message refused",
            machine_id=session.machine.machine_id,
            lease_id=ref.lease_id,
            epoch=ref.epoch,
            reason=reason,
        )
        if session.holds(ref) and session.lease is not None:
            session.end_lease(session.lease)
        session.send(
            fpb.ConnectResponse(rejected=fpb.Rejected(lease=lease_ref_to_proto(ref), reason=reason))
        )

    async def _live_lease(self, session: WorkerSession, ref: LeaseRef) -> Job:
        """The job, if `ref` is its live lease; else refuse the message (fencing)."""
        lease = session.training_lease(ref)
        job_id = lease.job_id if lease is not None else None
        job = await self._ledger.get_job_any_owner(job_id) if job_id else None
        if job is None or job.lease_id != ref.lease_id or job.epoch != ref.epoch:
            raise StaleLease(f"lease {ref.lease_id} epoch {ref.epoch} is not live")
        return job

    async def _stored_as_announced(
        self, session: WorkerSession, ref: LeaseRef, key: str, size_bytes: int, sha256: str
    ) -> bool:
        """The ledger records an object only once the store holds exactly what was announced
        (docs/DESIGN.md, "URLs and stored objects"); else the message is refused."""
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

    async def _checkpoint_in_format(
        self, session: WorkerSession, ref: LeaseRef, lease: TrainingLease, checkpoint: Checkpoint
    ) -> bool:
        """A checkpoint the store verified is recorded only if it is a checkpoint bundle whose
        tensors (names and shapes) are those of this lease's earlier checkpoints. Only this
        lease's: a layout pinned by an earlier holder would let a liar's one checkpoint get every
        honest holder after it refused (and revoked). A bad checkpoint an earlier holder left is
        the resuming worker's to skip: it resumes from the newest one that verifies."""
        try:
            layout = await checkpoint_layout(
                self._storage, checkpoint.key, size_bytes=checkpoint.size_bytes
            )
            earlier = await self._checkpoint_layout(lease)
            if earlier is not None and (difference := layout_difference(layout, earlier)):
                raise BadFormat(difference)
        except BadFormat as exc:
            self._refuse_format(session, ref, checkpoint.key, str(exc))
            return False
        lease.checkpoint_layout = earlier if earlier is not None else layout
        return True

    async def _checkpoint_layout(self, lease: TrainingLease) -> Layout | None:
        """The tensors of the lease's verified checkpoints: learnt at its first on this
        stream, else read from its newest one still stored (from before a reconnect)."""
        if lease.checkpoint_layout is None:
            for recorded in await self._ledger.live_checkpoints(lease.job_id):
                if recorded.epoch != lease.epoch:
                    continue
                try:
                    lease.checkpoint_layout = await checkpoint_layout(
                        self._storage, recorded.key, size_bytes=recorded.size_bytes
                    )
                    break
                except BadFormat:
                    continue  # deleted meanwhile (retention): an older one will do
        return lease.checkpoint_layout

    async def _result_in_format(
        self,
        session: WorkerSession,
        lease: TrainingLease,
        ref: LeaseRef,
        file_format: str,
        stored: JobResult,
    ) -> bool:
        """A result file the store verified is recorded only if it is a LoRA file of the job
        (formats.py, `check_lora_file`)."""
        try:
            await check_lora_file(
                self._storage,
                stored.key,
                size_bytes=stored.size_bytes,
                file_format=file_format,
                rank=lease.lora_rank,
                checkpoint=await self._checkpoint_layout(lease),
            )
        except BadFormat as exc:
            self._refuse_format(session, ref, stored.key, str(exc))
            return False
        return True

    def _refuse_format(self, session: WorkerSession, ref: LeaseRef, key: str, why: str) -> None:
        log.warning(
            "announced object is not in its format; refused",
            machine_id=session.machine.machine_id,
            lease_id=ref.lease_id,
            key=key,
            reason=why,
        )
        self._reject(session, ref, f"the stored object {key} is refused: {why}")

    async def _sample_task_failed(
        self, session: WorkerSession, lease: SampleLease, failure_class: FailureClass, message: str
    ) -> None:
        ref = lease.ref()
        session.end_lease(lease)
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
            self._background.spawn(
                self._sweeper.prune_checkpoints(task.job_id), "prune checkpoints"
            )

    async def _renew_urls(self, session: WorkerSession) -> None:
        """Fresh URLs for a training lease (after a resume, or a third of their life left)."""
        lease = session.training_lease()
        if lease is None:
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
