"""One lease, from grant to result: inputs, resume, training in a thread, uploads, the outcome.

`LeaseRunner.run()` is one coroutine per lease, driven by the agent:

1. Inputs (`lease_inputs.LeaseInputs`): the instance images and captions and any class images
   are downloaded in parallel into memory; then the newest committed checkpoint that verifies
   is the one to resume from.
2. Train: `Trainer.run` blocks, so it runs on the agent's training thread (`TrainingThread`)
   and talks back only through hooks that return at once: progress goes into a
   latest-value-wins slot the agent's heartbeat reads, snapshots and generated images are
   handed to the event loop.
3. Uploads (`uploads.LeaseUploads`): checkpoints in the background while training continues,
   generated class images before any checkpoint trained with them, the result at URLs asked
   for when it is ready.
4. The end: the LoRA stored, `JobSucceeded` follows; a failure sends `JobFailed` with the
   trainer's class (input, node, internal). A revocation or rejection (`cancel`) stops the run
   at its next step boundary and sends nothing more; a drain stops it there with a snapshot,
   which is uploaded and committed before `run()` returns. `run()` returns once the run has
   left the training thread: the agent says Ready when it is free.

The runner reaches the scheduler only through a `LeaseLink`, which the agent implements on top
of its current stream and which waits while the agent reconnects. What the runner shares with
the sample runner (the link, progress, how a lease ended) is in `lease`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lorafleet.core.model import result_formats
from lorafleet.core.serde import FAILURE_CLASSES, spec_from_proto
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker import metrics
from lorafleet.worker.auto_interval import AutoInterval
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease import (
    LeaseLink,
    LeaseLost,
    LeaseResult,
    ProgressReport,
    ProgressSlot,
    TrainerFactory,
    TrainerLike,
    failure_message,
    training_config_for,
)
from lorafleet.worker.lease_inputs import LeaseInputs
from lorafleet.worker.setup_watch import SetupWatch
from lorafleet.worker.training import (
    CorruptCheckpoint,
    Finished,
    RunTimings,
    Stopped,
    StopReason,
    Trainer,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
    classify_exception,
)
from lorafleet.worker.training_thread import TrainingThread
from lorafleet.worker.transfer import TransferClient
from lorafleet.worker.uploads import CheckpointPipeline, LeaseUploads

# Re-exported: what the agent, the sample runner and the tests import from here.
__all__ = [
    "CheckpointPipeline",
    "LeaseLink",
    "LeaseLost",
    "LeaseResult",
    "LeaseRunner",
    "ProgressReport",
    "ProgressSlot",
    "TrainerFactory",
    "TrainerLike",
    "failure_message",
    "training_config_for",
]

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.worker")

_MIB = 1024 * 1024


class _Phase(enum.Enum):
    PREPARING = "preparing"  # downloads, resume: nothing worth keeping yet
    TRAINING = "training"  # the thread runs: stops go through should_stop
    FINISHING = "finishing"  # the outcome is being stored and reported


class _Mode(enum.Enum):
    TRAINING = "training"
    # Stop at the next step boundary with a snapshot, then commit it.
    DRAINING = "draining"
    # Stop at once; the lease is gone (revoked, rejected, lost): send nothing more about it.
    CANCELLED = "cancelled"
    # Stop at once; the lease is still ours (the worker is going away without a checkpoint).
    ABORTED = "aborted"


def _gpu_memory_mb() -> int:
    """Peak accelerator memory of this process, when CUDA is in use."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return int(torch.cuda.max_memory_reserved()) // _MIB
    except Exception:  # progress reporting must never break training
        return 0
    return 0


class LeaseRunner:
    """Runs one granted lease; see the module docstring for the sequence.

    Event-loop methods: `run()`, `cancel()`, `drain()`, `abort()`, `urls_renewed()`.
    `progress` is the latest-value-wins slot the heartbeat reads.
    """

    def __init__(
        self,
        *,
        grant: fpb.LeaseGranted,
        link: LeaseLink,
        transfer: TransferClient,
        training: TrainingThread,
        config: WorkerConfig,
        trainer_factory: TrainerFactory = Trainer,
    ) -> None:
        """`training` is the agent's training thread, which runs the lease's `Trainer.run`."""
        self.grant = grant
        # The agent makes a runner as the grant arrives: a lease's time starts here.
        self._granted_at = time.time()
        self._download_s: float | None = None
        self._run_timings: RunTimings | None = None
        self.ref = fpb.LeaseRef(lease_id=grant.lease.lease_id, epoch=grant.lease.epoch)
        self.job_id = grant.lease.job_id
        self._link = link
        self._transfer = transfer
        self._training = training
        # The run submitted to the training thread, once there is one.
        self._running_training: asyncio.Future[TrainingOutcome] | None = None
        self._config = config
        self._trainer_factory = trainer_factory
        self._urls = fpb.JobUrls()
        self._urls.CopyFrom(grant.urls)
        self._mode = _Mode.TRAINING
        # Until the first progress: the newest committed checkpoint's step, which is where a
        # resumed run starts, so heartbeats never report the job going backwards.
        newest = grant.urls.checkpoints[0].checkpoint.step if grant.urls.checkpoints else 0
        self.progress = ProgressSlot(ProgressReport(step=newest))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work: asyncio.Task[LeaseResult] | None = None
        self._phase = _Phase.PREPARING
        # JobSucceeded or JobFailed once sent: the agent re-sends it if the stream broke before
        # the scheduler could have read it.
        self.terminal_message: fpb.ConnectRequest | None = None
        # Set by the agent once a reconnect has settled whether the scheduler got it.
        self.terminal_confirmed = False
        # Notices sent about this lease (e.g. a corrupt checkpoint skipped on resume).
        self.notices: list[str] = []
        # Full URL renewals received (the scheduler's periodic ones, or after a resume).
        self.url_renewals = 0
        self.result: LeaseResult | None = None
        self.stop_requested_at_step: int | None = None
        self._log = log.bind(
            job_id=self.job_id,
            lease_id=self.ref.lease_id,
            epoch=self.ref.epoch,
            machine_id=config.machine_id,
        )
        # What the run does before its first step (setup_watch.py).
        self._setup = SetupWatch()
        self._setup_stalled = False
        # The run's checkpoint interval with checkpointing_steps auto (set when the run starts).
        self._auto_interval = AutoInterval(
            steps=0, interval_s=0.0, min_steps=1, max_steps=1, start_step=0
        )
        self._inputs = LeaseInputs(
            transfer=transfer, config=config, notice=self._notice, log=self._log
        )
        self._uploads = LeaseUploads(
            ref=self.ref,
            send=self._send,
            notice=self._notice,
            transfer=transfer,
            config=config,
            log=self._log,
        )

    # What the agent reads --------------------------------------------------------------------

    @property
    def committed_steps(self) -> list[int]:
        return self._uploads.committed_steps

    @property
    def checkpoint_cost_s(self) -> float | None:
        """What this lease's latest checkpoint cost: the training thread's stall to snapshot it
        plus its upload; the next Ready reports it (checkpointing_steps auto)."""
        return self._uploads.checkpoint_cost_s

    @property
    def checkpoint_every(self) -> int:
        """The interval in steps the run checkpoints at now (auto: follows this node's pace)."""
        return self._auto_interval.current()

    @property
    def reused_class_images(self) -> list[int]:
        """Indices of the generated class images this lease reuses from earlier leases."""
        return self._inputs.reused_class_images

    # Control from the agent (event loop) ------------------------------------------------------

    @functools.cached_property
    def compiled_shape_key(self) -> str:
        """The compiled-step shape of the lease's job (`JobSpec.compiled_shape_key`): the agent
        says in its heartbeats whether the resident model holds it compiled."""
        return spec_from_proto(self.grant.spec).compiled_shape_key

    @property
    def holds_lease(self) -> bool:
        """True while the lease is still ours to report on (not revoked, not finished)."""
        return self._mode is not _Mode.CANCELLED and self.terminal_message is None

    def cancel(self, reason: str) -> None:
        """The lease is gone: stop training within one step, discard everything, send nothing."""
        if self._mode is _Mode.CANCELLED:
            return
        self._request_stop(_Mode.CANCELLED, reason)

    def abort(self, reason: str) -> None:
        """Stop within one step without a snapshot; the lease stays ours (the agent may still
        send `Draining` for it)."""
        if self._mode in (_Mode.CANCELLED, _Mode.ABORTED):
            return
        self._request_stop(_Mode.ABORTED, reason)

    def drain(self) -> None:
        """Stop at the next step boundary with a snapshot; `run()` commits it and returns
        DRAINED. Before training has started there is nothing to keep: stop at once."""
        if self._mode is not _Mode.TRAINING:
            return
        self._request_stop(_Mode.DRAINING, "drain")
        if self._phase is _Phase.PREPARING and self._work is not None:
            self._work.cancel()

    def _request_stop(self, mode: _Mode, reason: str) -> None:
        self._mode = mode
        self.stop_requested_at_step = self.progress.latest().step
        self._log.info(
            "stopping the lease", mode=mode.value, reason=reason, step=self.stop_requested_at_step
        )
        if mode in (_Mode.CANCELLED, _Mode.ABORTED) and self._work is not None:
            # Interrupts downloads and uploads now; the training thread (if running) is told
            # through should_stop, and run() waits for it to leave.
            self._work.cancel()
        if mode is _Mode.CANCELLED:
            self._uploads.lease_gone()

    def reconnected(self) -> None:
        """The stream was replaced and the lease resumed: requests sent on the old stream may
        have been lost with it, so the ones still waiting are asked again now (not after
        `url_request_timeout_s`, while every checkpoint would be skipped)."""
        working = self._work is not None and not self._work.done()
        self._uploads.stream_changed(reannounce=working and self._mode is not _Mode.CANCELLED)

    def urls_renewed(self, urls: fpb.JobUrls) -> None:
        """An UrlsRenewed for this lease: answers to our requests, or a full renewal."""
        self._uploads.answered(urls.uploads)
        if urls.result_upload.url:
            self.url_renewals += 1
            # A full renewal (the scheduler's periodic one, or after a resume): every URL the
            # lease may use, replacing the old set wholesale.
            self._urls = fpb.JobUrls()
            self._urls.CopyFrom(urls)
            self._urls.ClearField("uploads")

    # The lease ----------------------------------------------------------------------------------

    async def run(self) -> LeaseResult:
        """Runs the lease to its end; never raises for a failure of the job (that is reported
        with JobFailed), only when the caller cancels this coroutine."""
        self._loop = asyncio.get_running_loop()
        context = TraceContextTextMapPropagator().extract({"traceparent": self.grant.traceparent})
        attributes: dict[str, str | int] = {
            "lorafleet.job_id": self.job_id,
            "lorafleet.lease_id": self.ref.lease_id,
            "lorafleet.epoch": self.ref.epoch,
            "lorafleet.machine_id": self._config.machine_id,
        }
        with (
            structlog.contextvars.bound_contextvars(
                job_id=self.job_id,
                lease_id=self.ref.lease_id,
                epoch=self.ref.epoch,
                machine_id=self._config.machine_id,
            ),
            tracer.start_as_current_span(
                "worker.lease", context=context, attributes=attributes
            ) as span,
        ):
            self._work = asyncio.get_running_loop().create_task(self._run())
            try:
                result = await self._work
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the agent itself is being cancelled
                # cancel(), abort() or an early drain() interrupted the work.
                drained = self._mode is _Mode.DRAINING
                result = LeaseResult.DRAINED if drained else LeaseResult.STOPPED
            finally:
                await self._uploads.close()
            # The lease is over once its run has left the training thread (a stopped run sees
            # its stop request at its next step boundary); the agent says Ready after that.
            await self._training_stopped()
            self.result = result
            metrics.LEASES.labels(result.value).inc()
            span.set_attribute("lorafleet.lease_result", result.value)
            self._log.info(
                "lease ended",
                result=result.value,
                step=self.progress.latest().step,
                **self.first_step_timings(),
            )
            return result

    def first_step_timings(self) -> dict[str, object]:
        """What the lease spent before its first step, for the log (bench/fleet.py reads it):
        when that step ended (Unix time; the ledger's LEASE_GRANTED time is on the same clock
        where the scheduler runs on the same machine), seconds from the grant's arrival, and
        the phases: downloads here, the trainer's setup, the first step itself."""
        timings = self._run_timings
        if timings is None or timings.first_step_done_at is None:
            return {}
        phases = {"download_inputs": self._download_s or 0.0, **timings.setup_seconds}
        phases["first_step"] = timings.step_seconds[0]
        return {
            "first_step_done_at": round(timings.first_step_done_at, 4),
            "grant_to_first_step_s": round(timings.first_step_done_at - self._granted_at, 4),
            "setup_s": {name: round(seconds, 4) for name, seconds in phases.items()},
        }

    async def _run(self) -> LeaseResult:
        try:
            try:
                outcome = await self._prepare_and_train()
            except LeaseLost:
                raise
            except Exception as exc:
                if self._mode in (_Mode.CANCELLED, _Mode.ABORTED):
                    return LeaseResult.STOPPED  # errors of a run being torn down are not the job's
                return await self._fail(exc)
            self._phase = _Phase.FINISHING
            try:
                if isinstance(outcome, Stopped):
                    return await self._stopped(outcome)
                return await self._succeed(outcome)
            except LeaseLost:
                raise
            except Exception as exc:
                if self._mode is not _Mode.TRAINING:
                    return LeaseResult.STOPPED
                # The result could not be stored: the attempt fails (retryable, class internal);
                # the next one resumes from the newest checkpoint.
                return await self._fail(exc)
        except LeaseLost:
            return LeaseResult.STOPPED

    async def _prepare_and_train(self) -> TrainingOutcome:
        spec = spec_from_proto(self.grant.spec)
        training_config = training_config_for(self._config, spec)
        started = time.perf_counter()
        instance, class_images = await self._inputs.download(spec, self._urls)
        self._download_s = time.perf_counter() - started
        candidates = list(self._urls.checkpoints)
        while True:
            resume, candidates = await self._inputs.resume_from(candidates)
            if resume is not None:
                self.progress.publish(
                    ProgressReport(step=resume.step, loss=float(resume.state.get("loss", math.nan)))
                )
            try:
                return await self._train(training_config, instance, class_images, resume)
            except CorruptCheckpoint as exc:
                if resume is None:
                    raise
                self._phase = _Phase.PREPARING
                # The blob verified but does not fit this job (other data or settings).
                await self._notice(
                    f"checkpoint at step {resume.step} was skipped: {exc}; trying an older one"
                )

    async def _train(
        self,
        training_config: TrainingConfig,
        instance: list[TrainingImage],
        class_images: list[TrainingImage],
        resume: TrainingSnapshot | None,
    ) -> TrainingOutcome:
        trainer = self._trainer_factory(training_config)
        # The real trainer times its snapshots (RunTimings); a stand-in may not.
        timings = getattr(trainer, "timings", None)
        self._uploads.snapshot_seconds = getattr(timings, "snapshot_seconds", [])
        self._run_timings = timings if isinstance(timings, RunTimings) else None
        start = resume.step if resume is not None else 0
        self._auto_interval = AutoInterval(
            steps=training_config.spec.checkpointing_steps,
            interval_s=self.grant.checkpoint_interval_s,
            min_steps=self.grant.checkpoint_min_steps,
            max_steps=training_config.spec.max_train_steps,
            start_step=start,
        )
        # `on_phase(name)`: the trainer names each setup phase as it enters it (and polls
        # `should_stop` there). `checkpoint_every()`: the interval in steps the run checkpoints
        # at, read after each step (auto_interval.py).
        hooks = TrainingHooks(
            on_progress=self._on_progress,
            should_stop=self._should_stop,
            on_checkpoint=self._on_checkpoint,
            on_class_images=self._on_class_images,
            on_notice=self._on_notice,
            on_phase=self._on_phase,
            checkpoint_every=self._auto_interval.current,
        )
        with tracer.start_as_current_span(
            "worker.train", attributes={"lorafleet.start_step": start}
        ):
            self._phase = _Phase.TRAINING
            # The agent's training thread runs it in a copy of this context: spans the trainer
            # opens are children of this one.
            running = asyncio.wrap_future(
                self._training.submit(
                    trainer.run,
                    instance_images=instance,
                    class_images=class_images,
                    resume=resume,
                    hooks=hooks,
                )
            )
            self._running_training = running
            watching = asyncio.ensure_future(
                self._setup.watch(
                    notice=lambda message: self._notice(message, progress=True),
                    notice_interval_s=self._config.setup_notice_interval_s,
                    stall_timeout_s=self._config.setup_stall_timeout_s,
                )
            )
            try:
                # Neither is cancelled by a cancel of this task (asyncio.wait does not).
                either: list[asyncio.Future[Any]] = [running, watching]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                stalled = watching.exception() if watching.done() else None
                if not running.done() and stalled is not None:
                    # Stalled before its first step: the run is told to stop (should_stop says
                    # "cancel" at its next poll) and the attempt fails as this node's.
                    self._setup_stalled = True
                    raise stalled
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                if self._mode in (_Mode.TRAINING, _Mode.DRAINING):
                    self._mode = _Mode.ABORTED
                # A thread cannot be interrupted: it sees should_stop() at its next step
                # boundary (and, in the trainer's setup, at each phase); run() waits for that
                # before the lease ends.
                raise
            finally:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)

    async def _training_stopped(self) -> None:
        """Waits until this lease's run has left the training thread. Not shielded: if the
        agent itself is cancelled (the process is exiting), it stops waiting."""
        running = self._running_training
        if running is None:
            return
        if not running.done():
            await asyncio.wait([running])
        if (
            not running.cancelled()
            and running.exception() is not None
            and self._mode
            in (
                _Mode.CANCELLED,
                _Mode.ABORTED,
            )
        ):
            # A run failing while being stopped is not the job's failure: logged as what it is.
            self._log.info(
                "training ended with an error while stopping",
                error=str(running.exception())[:500],
            )

    # Hooks: called on the training thread, each returns at once ------------------------------

    def _on_phase(self, name: str) -> None:
        self._setup.phase(name)

    def _on_progress(self, step: int, loss: float, lr: float, seconds_per_step: float) -> None:
        self._setup.stepped()
        assumed = self._auto_interval.pace_s
        changed = self._auto_interval.observe(step, seconds_per_step)
        if changed is not None:
            self._to_loop(
                self._send_progress_notice,
                f"checkpointing every {changed} steps from step {step} (auto): this node's own"
                f" pace is {seconds_per_step:.3g} s/step, the grant's interval assumed"
                f" {assumed:.3g} s/step",
            )
        if seconds_per_step > 0 and math.isfinite(seconds_per_step):
            metrics.STEP_SECONDS.observe(seconds_per_step)
        self.progress.publish(
            ProgressReport(
                step=step,
                loss=loss,
                learning_rate=lr,
                seconds_per_step=seconds_per_step,
                gpu_memory_mb=_gpu_memory_mb(),
            )
        )

    def _should_stop(self) -> StopReason | None:
        if self._setup_stalled:
            return "cancel"  # the attempt failed already (SetupStalled)
        mode = self._mode
        if mode is _Mode.DRAINING:
            return "drain"
        if mode in (_Mode.CANCELLED, _Mode.ABORTED):
            return "cancel"
        return None

    def _to_loop(self, callback: Callable[..., object], *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the loop closed in between; the worker is exiting anyway.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, *args)

    def _on_checkpoint(self, snapshot: TrainingSnapshot) -> None:
        self._to_loop(self._offer_checkpoint, snapshot)

    def _on_class_images(self, batch: list[tuple[int, bytes]]) -> None:
        self._setup.sign()
        self._to_loop(self._store_class_images, batch)

    def _on_notice(self, message: str) -> None:
        self._setup.sign()
        self._to_loop(self._send_notice, message)

    def _send_notice(self, message: str, *, progress: bool = False) -> None:
        async def send() -> bool:
            await self._notice(message, progress=progress)
            return True

        self._uploads.spawn(send())

    def _send_progress_notice(self, message: str) -> None:
        self._send_notice(message, progress=True)

    # Uploads (event loop) -------------------------------------------------------------------------

    def _offer_checkpoint(self, snapshot: TrainingSnapshot) -> None:
        if self._mode is _Mode.TRAINING:
            self._uploads.offer_checkpoint(snapshot)

    def _store_class_images(self, batch: list[tuple[int, bytes]]) -> None:
        self._uploads.store_class_images(batch)

    async def _send(self, message: fpb.ConnectRequest) -> None:
        if self._mode is _Mode.CANCELLED:
            raise LeaseLost("the lease was revoked")
        await self._link.send(message)

    async def _notice(self, message: str, *, progress: bool = False) -> None:
        """A notice on the job's timeline. `progress`: an informational one (what the lease is
        doing, the interval it follows), logged at info and kept out of `notices`, which lists
        what went wrong or was skipped."""
        if progress:
            self._log.info("notice", message=message)
        else:
            self._log.warning("notice", message=message)
            self.notices.append(message)
        await self._send(fpb.ConnectRequest(notice=fpb.Notice(lease=self.ref, message=message)))

    # Endings --------------------------------------------------------------------------------------

    async def _stopped(self, outcome: Stopped) -> LeaseResult:
        if self._mode is not _Mode.DRAINING or outcome.reason != "drain":
            return LeaseResult.STOPPED
        # The drain snapshot is newer than anything waiting or uploading: it supersedes them.
        await self._uploads.pipeline.close()
        # A drain right after a periodic checkpoint snapshots the same step: committed already.
        if outcome.snapshot is not None and outcome.snapshot.step not in self.committed_steps:
            try:
                await self._uploads.upload_checkpoint(outcome.snapshot)
            except LeaseLost:
                raise
            except Exception:
                # The job is re-queued from its last committed checkpoint all the same.
                self._log.exception("drain checkpoint not stored", step=outcome.snapshot.step)
        # Class images still uploading belong to the job too (small; each is
        # bounded by the transfer deadline, the whole drain by its grace period).
        await self._uploads.settle()
        return LeaseResult.DRAINED

    async def _succeed(self, outcome: Finished) -> LeaseResult:
        formats = result_formats(spec_from_proto(self.grant.spec).output_format)
        result, kohya = await self._uploads.upload_result(outcome, list(formats))
        message = fpb.ConnectRequest(
            job_succeeded=fpb.JobSucceeded(
                lease=self.ref,
                key=result.key,
                size_bytes=result.size_bytes,
                sha256=result.sha256,
                step=outcome.step,
                loss=outcome.loss,
                kohya=kohya,
            )
        )
        await self._send(message)
        self.terminal_message = message
        self._log.info("job succeeded", step=outcome.step, key=result.key, sha256=result.sha256)
        return LeaseResult.SUCCEEDED

    async def _fail(self, exc: Exception) -> LeaseResult:
        failure_class = classify_exception(exc)
        metrics.ATTEMPT_FAILURES.labels(str(failure_class)).inc()
        text = failure_message(exc)
        self._log.warning(
            "job attempt failed", failure_class=failure_class, error=text, exc_info=exc
        )
        trace.get_current_span().record_exception(exc)
        message = fpb.ConnectRequest(
            job_failed=fpb.JobFailed(
                lease=self.ref, failure_class=FAILURE_CLASSES[failure_class], message=text
            )
        )
        await self._send(message)
        self.terminal_message = message
        return LeaseResult.FAILED
