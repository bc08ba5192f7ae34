"""One lease, from grant to result: inputs, resume, training in a thread, uploads, the outcome.

`LeaseRunner.run()` is one coroutine per lease, driven by the agent:

1. Download the instance images (and their `.txt` captions) and any class images in parallel
   into memory through the grant's signed URLs.
2. Resume: the grant lists committed checkpoints newest first. Each is downloaded into memory,
   its sha256 checked against the ledger's and its blob verified; a bad one is reported with a
   `Notice` and the next older one tried. No usable checkpoint: start from step 0.
3. Train: `Trainer.run` blocks, so it runs on the agent's training thread (`TrainingThread`)
   and talks back only through hooks that return at once: progress goes into a
   latest-value-wins slot the agent's heartbeat reads, snapshots and generated images are
   handed to the event loop.
4. Checkpoints: the training thread only takes a host-memory snapshot. Serialising it (in a
   thread), asking the scheduler for the PUT URL, uploading and `CheckpointCommitted` run in the
   background while training continues: one upload at a time and one snapshot waiting; a newer
   snapshot replaces the waiting one. No checkpoint byte touches local disk.
5. The end: the LoRA goes to `urls.result_upload` and `JobSucceeded` follows; a failure sends
   `JobFailed` with the trainer's class (input, node, internal). A revocation or rejection
   (`cancel`) stops the run at its next step boundary and sends nothing more; a drain stops
   it there with a snapshot, which is uploaded and committed before `run()` returns. `run()`
   returns once the run has left the training thread: the agent says Ready when it is free.

The runner reaches the scheduler only through a `LeaseLink`, which the agent implements on top
of its current stream and which waits while the agent reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lorafleet.core.errors import StorageError
from lorafleet.core.model import result_formats
from lorafleet.core.serde import FAILURE_CLASSES, spec_from_proto
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as jpb
from lorafleet.worker import metrics
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.training import (
    CorruptCheckpoint,
    Finished,
    Stopped,
    StopReason,
    Trainer,
    TrainingConfig,
    TrainingFailure,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
    checkpoint_sha256,
    classify_exception,
    images_from_files,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training_thread import TrainingThread
from lorafleet.worker.transfer import TransferClient, content_md5

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.worker")

_MIB = 1024 * 1024
# Attempts at getting an upload URL before giving up on that upload.
_URL_REQUEST_ATTEMPTS = 3
# What JobFailed.message may carry (the scheduler keeps 4000 characters).
_MAX_MESSAGE_CHARS = 4000

SlotKey = tuple[int, int, int]


class LeaseLost(Exception):
    """The lease is no longer this worker's (revoked, rejected, not resumed): stop acting on it."""


class LeaseLink(Protocol):
    """What a runner needs from the connection; the agent implements it."""

    async def send(self, message: fpb.ConnectRequest) -> None:
        """Queues a message about this lease on the stream, waiting while the agent reconnects.

        Raises `LeaseLost` once the lease is gone.
        """
        ...


class TrainerLike(Protocol):
    """`lorafleet.worker.training.Trainer`'s blocking entry point."""

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome: ...


TrainerFactory = Callable[[TrainingConfig], TrainerLike]


def training_config_for(config: WorkerConfig, spec: JobSpec) -> TrainingConfig:
    """A run of `spec` on this worker, as its settings say (a training lease or a sample task)."""
    return TrainingConfig(
        spec=spec,
        model_path=config.model_path,
        vae_path=config.vae_path,
        cache_dir=config.model_cache_dir,
        local_files_only=config.local_files_only,
        device=config.device,
        sample_steps=config.sample_steps,
        sample_batch_size=config.sample_batch_size,
        compile_model=config.compile_model,
        progress_interval_s=config.progress_interval_s,
    )


class LeaseResult(enum.Enum):
    """How `LeaseRunner.run()` ended."""

    SUCCEEDED = "succeeded"  # result uploaded, JobSucceeded sent
    FAILED = "failed"  # JobFailed sent
    DRAINED = "drained"  # stopped for a drain; its snapshot committed when there was one
    STOPPED = "stopped"  # canceled, revoked, rejected or aborted: nothing more to send


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


@dataclass(frozen=True, kw_only=True)
class ProgressReport:
    """The newest training progress, as a heartbeat carries it (NaN: not known yet)."""

    step: int
    loss: float = math.nan
    learning_rate: float = math.nan
    seconds_per_step: float = math.nan
    gpu_memory_mb: int = 0


class ProgressSlot:
    """Latest value wins: the training thread publishes, the heartbeat loop reads.

    Older values are simply overwritten; nothing queues up however slow the reader is.
    """

    def __init__(self, initial: ProgressReport) -> None:
        # A lock rather than relying on atomic attribute stores, so the slot stays correct on a
        # free-threaded interpreter too; it is held for one assignment.
        self._lock = threading.Lock()
        self._value = initial

    def publish(self, report: ProgressReport) -> None:
        with self._lock:
            self._value = report

    def latest(self) -> ProgressReport:
        with self._lock:
            return self._value


class CheckpointPipeline:
    """Background checkpoint uploads: one running, at most one snapshot waiting.

    `offer()` (event loop only) never blocks: when an upload is still running, the offered
    snapshot waits and replaces any older waiting one, so memory holds at most two snapshots
    and the newest state is always the next one stored. Uploads run one at a time, so commits
    reach the ledger in step order.
    """

    def __init__(
        self,
        upload: Callable[[TrainingSnapshot], Awaitable[None]],
        on_failure: Callable[[int, str], Awaitable[None]],
    ) -> None:
        self._upload = upload
        # Told of every checkpoint that could not be stored: a worker that cannot checkpoint
        # says so (a Notice on the job's timeline), it never trains on in silence.
        self._on_failure = on_failure
        self.failures = 0
        self._waiting: TrainingSnapshot | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.dropped_steps: list[int] = []

    def offer(self, snapshot: TrainingSnapshot) -> None:
        if self._closed:
            return
        if self._waiting is not None:
            self.dropped_steps.append(self._waiting.step)
            log.info(
                "checkpoint skipped: the previous upload is still running and a newer snapshot"
                " replaces it",
                step=self._waiting.step,
                newer_step=snapshot.step,
            )
        self._waiting = snapshot
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._consume())
        self._wake.set()

    async def _consume(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (snapshot := self._waiting) is not None:
                self._waiting = None
                try:
                    await self._upload(snapshot)
                except LeaseLost:
                    self._closed = True
                    return
                except StorageError as exc:
                    # One lost checkpoint costs one interval of work; the next one may succeed.
                    log.warning("checkpoint upload failed", step=snapshot.step, error=str(exc))
                    await self._failed(snapshot.step, str(exc))
                except Exception as exc:
                    log.exception("checkpoint upload failed", step=snapshot.step)
                    await self._failed(snapshot.step, f"{type(exc).__name__}: {exc}")

    async def _failed(self, step: int, error: str) -> None:
        self.failures += 1
        try:
            await self._on_failure(step, error)
        except LeaseLost:
            self._closed = True
        except Exception:
            log.exception("could not report a failed checkpoint", step=step)

    async def close(self) -> None:
        """Drops the waiting snapshot and cancels a running upload; idempotent."""
        self._closed = True
        self._waiting = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def slot_key(slot: fpb.UploadSlot) -> SlotKey:
    return (int(slot.kind), int(slot.step), int(slot.index))


@dataclass(frozen=True, kw_only=True)
class _Blob:
    """Bytes to store, with the two digests their upload needs, computed once."""

    data: bytes = field(repr=False)
    sha256: str  # hex: announced to the scheduler, recorded by the ledger
    md5: str  # base64: the store checks the body against it (Content-MD5)


def _blob(data: bytes) -> _Blob:
    """Both digests in one call; it reads all of `data`, so run it off the event loop."""
    return _Blob(data=data, sha256=checkpoint_sha256(data), md5=content_md5(data))


def _serialize(snapshot: TrainingSnapshot) -> _Blob:
    return _blob(serialize_checkpoint(snapshot))


def _verified_snapshot(data: bytes, expected_sha256: str) -> TrainingSnapshot:
    """Checks the ledger's digest, then parses (which checks the blob's own digest)."""
    actual = checkpoint_sha256(data)
    if actual != expected_sha256:
        raise CorruptCheckpoint(f"sha256 {actual[:12]}... does not match the ledger's")
    return load_checkpoint(data)


def _gpu_memory_mb() -> int:
    """Peak accelerator memory of this process, when CUDA is in use."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return int(torch.cuda.max_memory_reserved()) // _MIB
    except Exception:  # progress reporting must never break training
        return 0
    return 0


def failure_message(exc: BaseException) -> str:
    """What JobFailed says: a `TrainingFailure`'s own (user-facing) message, else the
    exception's type and text."""
    text = str(exc) if isinstance(exc, TrainingFailure) else f"{type(exc).__name__}: {exc}"
    return text.replace("\x00", "")[:_MAX_MESSAGE_CHARS] or type(exc).__name__


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
        self._url_waiters: dict[SlotKey, list[asyncio.Future[fpb.UploadUrl]]] = {}
        # Replaced (and the old one set) by `reconnected()`.
        self._stream_changed = asyncio.Event()
        self._pipeline = CheckpointPipeline(self._upload_checkpoint, self._checkpoint_failed)
        self._artifact_tasks: set[asyncio.Task[bool]] = set()
        self._class_uploads: list[asyncio.Task[bool]] = []
        self._artifact_gate = asyncio.Semaphore(config.artifact_upload_concurrency)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work: asyncio.Task[LeaseResult] | None = None
        self._phase = _Phase.PREPARING
        # JobSucceeded or JobFailed once sent: the agent re-sends it if the stream broke before
        # the scheduler could have read it.
        self.terminal_message: fpb.ConnectRequest | None = None
        # Set by the agent once a reconnect has settled whether the scheduler got it.
        self.terminal_confirmed = False
        self.committed_steps: list[int] = []
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

    # Control from the agent (event loop) ------------------------------------------------------

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
            # Background uploads waiting for a URL will never get one.
            for waiters in self._url_waiters.values():
                for waiter in waiters:
                    waiter.cancel()

    def reconnected(self) -> None:
        """The stream was replaced and the lease resumed: requests sent on the old stream may
        have been lost with it, so the ones still waiting are asked again now (not after
        `url_request_timeout_s`, while every checkpoint would be skipped)."""
        changed, self._stream_changed = self._stream_changed, asyncio.Event()
        changed.set()

    def urls_renewed(self, urls: fpb.JobUrls) -> None:
        """An UrlsRenewed for this lease: answers to our requests, or a full renewal."""
        for upload in urls.uploads:
            for waiter in self._url_waiters.pop(slot_key(upload.slot), []):
                if not waiter.done():
                    waiter.set_result(upload)
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
                await self._close_background()
            # The lease is over once its run has left the training thread (a stopped run sees
            # its stop request at its next step boundary); the agent says Ready after that.
            await self._training_stopped()
            self.result = result
            metrics.LEASES.labels(result.value).inc()
            span.set_attribute("lorafleet.lease_result", result.value)
            self._log.info("lease ended", result=result.value, step=self.progress.latest().step)
            return result

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
        instance, class_images = await self._download_inputs(spec.with_prior_preservation)
        candidates = list(self._urls.checkpoints)
        while True:
            resume, candidates = await self._load_resume(candidates)
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

    async def _download_inputs(
        self, with_prior_preservation: bool
    ) -> tuple[list[TrainingImage], list[TrainingImage]]:
        urls = self._urls
        with tracer.start_as_current_span("worker.download_inputs") as span:
            instance_files = await self._transfer.download_many(
                [(f.name, f.url) for f in urls.instance_files],
                concurrency=self._config.download_concurrency,
            )
            class_files: Mapping[str, bytes] = {}
            if with_prior_preservation and urls.class_files:
                class_files = await self._transfer.download_many(
                    [(f.name, f.url) for f in urls.class_files],
                    concurrency=self._config.download_concurrency,
                )
            span.set_attribute("lorafleet.instance_files", len(instance_files))
            span.set_attribute("lorafleet.class_files", len(class_files))
        self._log.info(
            "inputs downloaded",
            instance_files=len(instance_files),
            class_files=len(class_files),
            bytes=sum(map(len, instance_files.values())) + sum(map(len, class_files.values())),
        )
        return images_from_files(instance_files), images_from_files(class_files)

    async def _load_resume(
        self, candidates: list[fpb.CheckpointDownload]
    ) -> tuple[TrainingSnapshot | None, list[fpb.CheckpointDownload]]:
        """The newest checkpoint that downloads and verifies, and the older ones left."""
        for index, candidate in enumerate(candidates):
            checkpoint = candidate.checkpoint
            with tracer.start_as_current_span(
                "worker.load_checkpoint", attributes={"lorafleet.step": checkpoint.step}
            ):
                try:
                    data = await self._transfer.download(candidate.url)
                    snapshot = await asyncio.to_thread(_verified_snapshot, data, checkpoint.sha256)
                except (CorruptCheckpoint, StorageError) as exc:
                    await self._notice(
                        f"checkpoint at step {checkpoint.step} ({checkpoint.key}) was skipped:"
                        f" {exc}"
                    )
                    continue
            if snapshot.step != checkpoint.step:
                await self._notice(
                    f"checkpoint {checkpoint.key} holds step {snapshot.step}, not"
                    f" {checkpoint.step}; skipped"
                )
                continue
            self._log.info("resuming", step=snapshot.step, key=checkpoint.key)
            self.progress.publish(
                ProgressReport(step=snapshot.step, loss=float(snapshot.state.get("loss", math.nan)))
            )
            return snapshot, candidates[index + 1 :]
        return None, []

    async def _train(
        self,
        training_config: TrainingConfig,
        instance: list[TrainingImage],
        class_images: list[TrainingImage],
        resume: TrainingSnapshot | None,
    ) -> TrainingOutcome:
        trainer = self._trainer_factory(training_config)
        hooks = TrainingHooks(
            on_progress=self._on_progress,
            should_stop=self._should_stop,
            on_checkpoint=self._on_checkpoint,
            on_class_images=self._on_class_images,
        )
        start = resume.step if resume is not None else 0
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
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                if self._mode in (_Mode.TRAINING, _Mode.DRAINING):
                    self._mode = _Mode.ABORTED
                # A thread cannot be interrupted: it sees should_stop() at its next step
                # boundary; run() waits for that before the lease ends.
                raise

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

    def _on_progress(self, step: int, loss: float, lr: float, seconds_per_step: float) -> None:
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
        self._to_loop(self._store_class_images, batch)

    # Uploads (event loop) -------------------------------------------------------------------------

    def _offer_checkpoint(self, snapshot: TrainingSnapshot) -> None:
        if self._mode is _Mode.TRAINING:
            self._pipeline.offer(snapshot)

    def _store_class_images(self, batch: list[tuple[int, bytes]]) -> None:
        slots = [
            (fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CLASS_IMAGE, index=index), png)
            for index, png in batch
        ]
        self._class_uploads.append(self._spawn_artifacts(slots, "class images"))

    def _spawn_artifacts(
        self, items: list[tuple[fpb.UploadSlot, bytes]], what: str
    ) -> asyncio.Task[bool]:
        async def store() -> bool:
            try:
                urls = await self._upload_urls([slot for slot, _ in items])

                async def put(url: fpb.UploadUrl, data: bytes) -> None:
                    async with self._artifact_gate:
                        await self._transfer.upload(url.url, data)

                await asyncio.gather(
                    *(put(url, data) for url, (_, data) in zip(urls, items, strict=True))
                )
                return True
            except LeaseLost:
                return False
            except Exception:
                self._log.exception("artifact upload failed", what=what, count=len(items))
                return False

        task = asyncio.get_running_loop().create_task(store())
        self._artifact_tasks.add(task)
        task.add_done_callback(self._artifact_tasks.discard)
        return task

    async def _class_images_stored(self) -> bool:
        """Waits for every generated class image so far; a checkpoint is only valid with them
        (the trainer's fingerprint covers them), so none is committed before they are stored."""
        if not self._class_uploads:
            return True
        results = await asyncio.gather(*self._class_uploads, return_exceptions=True)
        return all(result is True for result in results)

    async def _upload_checkpoint(self, snapshot: TrainingSnapshot) -> None:
        """Serialise (off the loop), get the URL, PUT, announce. Raises on failure."""
        started = time.monotonic()
        with tracer.start_as_current_span(
            "worker.checkpoint", attributes={"lorafleet.step": snapshot.step}
        ) as span:
            blob = await asyncio.to_thread(_serialize, snapshot)
            span.set_attribute("lorafleet.size_bytes", len(blob.data))
            if not await self._class_images_stored():
                self._log.warning(
                    "checkpoint not committed: generated class images could not be stored",
                    step=snapshot.step,
                )
                return
            slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=snapshot.step)
            (url,) = await self._upload_urls([slot])
            await self._transfer.upload(url.url, blob.data, md5=blob.md5)
            await self._send(
                fpb.ConnectRequest(
                    checkpoint_committed=fpb.CheckpointCommitted(
                        lease=self.ref,
                        step=snapshot.step,
                        key=url.key,
                        size_bytes=len(blob.data),
                        sha256=blob.sha256,
                    )
                )
            )
        self.committed_steps.append(snapshot.step)
        metrics.CHECKPOINTS.inc()
        metrics.CHECKPOINT_BYTES.inc(len(blob.data))
        metrics.CHECKPOINT_SECONDS.observe(time.monotonic() - started)
        self._log.info(
            "checkpoint committed", step=snapshot.step, key=url.key, bytes=len(blob.data)
        )

    async def _upload_urls(self, slots: list[fpb.UploadSlot]) -> list[fpb.UploadUrl]:
        """Asks the scheduler for PUT URLs (UrlsRequested) and waits for its UrlsRenewed.

        Asked again at once after a reconnect (the answer may have been lost with the old
        stream), and after `url_request_timeout_s` without an answer.
        """
        loop = asyncio.get_running_loop()
        keys = [slot_key(slot) for slot in slots]
        for attempt in range(1, _URL_REQUEST_ATTEMPTS + 1):
            waiters = {key: loop.create_future() for key in keys}
            for key, waiter in waiters.items():
                self._url_waiters.setdefault(key, []).append(waiter)
            changed: asyncio.Future[Any] = asyncio.ensure_future(self._stream_changed.wait())
            answers: asyncio.Future[Any] = asyncio.gather(*(waiters[key] for key in keys))
            try:
                await self._send(
                    fpb.ConnectRequest(
                        urls_requested=fpb.UrlsRequested(lease=self.ref, slots=slots)
                    )
                )
                done, _ = await asyncio.wait(
                    [answers, changed],
                    timeout=self._config.url_request_timeout_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if answers in done:
                    return list(answers.result())
                if changed in done:
                    self._log.info("asking again for URLs after a reconnect", attempt=attempt)
                else:
                    self._log.warning("no answer to UrlsRequested; asking again", attempt=attempt)
            finally:
                changed.cancel()
                for key, waiter in waiters.items():
                    pending = self._url_waiters.get(key, [])
                    if waiter in pending:
                        pending.remove(waiter)
                    if not pending:
                        self._url_waiters.pop(key, None)
                    if not waiter.done():
                        waiter.cancel()
                # Collects the cancellation (or the answers) so none is left unretrieved.
                await asyncio.gather(answers, return_exceptions=True)
        raise StorageError("the scheduler did not answer UrlsRequested", retryable=True)

    async def _send(self, message: fpb.ConnectRequest) -> None:
        if self._mode is _Mode.CANCELLED:
            raise LeaseLost("the lease was revoked")
        await self._link.send(message)

    async def _checkpoint_failed(self, step: int, error: str) -> None:
        metrics.CHECKPOINT_FAILURES.inc()
        await self._notice(f"checkpoint at step {step} could not be stored: {error[:300]}")

    async def _notice(self, message: str) -> None:
        self._log.warning("notice", message=message)
        self.notices.append(message)
        await self._send(fpb.ConnectRequest(notice=fpb.Notice(lease=self.ref, message=message)))

    async def _close_background(self) -> None:
        await self._pipeline.close()
        tasks = list(self._artifact_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Endings --------------------------------------------------------------------------------------

    async def _stopped(self, outcome: Stopped) -> LeaseResult:
        if self._mode is not _Mode.DRAINING or outcome.reason != "drain":
            return LeaseResult.STOPPED
        # The drain snapshot is newer than anything waiting or uploading: it supersedes them.
        await self._pipeline.close()
        # A drain right after a periodic checkpoint snapshots the same step: committed already.
        if outcome.snapshot is not None and outcome.snapshot.step not in self.committed_steps:
            try:
                await self._upload_checkpoint(outcome.snapshot)
            except LeaseLost:
                raise
            except Exception:
                # The job is re-queued from its last committed checkpoint all the same.
                self._log.exception("drain checkpoint not stored", step=outcome.snapshot.step)
        # Class images still uploading belong to the job too (small; each is
        # bounded by the transfer deadline, the whole drain by its grace period).
        await asyncio.gather(*list(self._artifact_tasks), return_exceptions=True)
        return LeaseResult.DRAINED

    async def _succeed(self, outcome: Finished) -> LeaseResult:
        await self._pipeline.close()  # the result supersedes any checkpoint still pending
        # Class images still uploading belong to the job: store them before the lease ends
        # (their URLs need a live lease). Each upload is bounded by the transfer deadline.
        await asyncio.gather(*list(self._artifact_tasks), return_exceptions=True)
        # The main file (the diffusers one unless output_format is kohya) at result_upload;
        # with output_format both the kohya file at kohya_result_upload.
        main, *others = result_formats(spec_from_proto(self.grant.spec).output_format)
        files = {"diffusers": outcome.lora_weights, "kohya": outcome.kohya_weights}
        main_data = files[main]
        if main_data is None or (others and outcome.kohya_weights is None):
            raise RuntimeError(f"the trainer wrote no {main} file for output_format")
        blob = await asyncio.to_thread(_blob, main_data)
        target = self._urls.result_upload
        kohya = None
        if others:
            assert outcome.kohya_weights is not None
            kohya_blob = await asyncio.to_thread(_blob, outcome.kohya_weights)
            kohya_target = self._urls.kohya_result_upload
            with tracer.start_as_current_span(
                "worker.upload_result",
                attributes={
                    "lorafleet.size_bytes": len(kohya_blob.data),
                    "lorafleet.format": "kohya",
                },
            ):
                await self._transfer.upload(kohya_target.url, kohya_blob.data, md5=kohya_blob.md5)
            kohya = jpb.JobResult(
                key=kohya_target.key, size_bytes=len(kohya_blob.data), sha256=kohya_blob.sha256
            )
        with tracer.start_as_current_span(
            "worker.upload_result", attributes={"lorafleet.size_bytes": len(blob.data)}
        ):
            await self._transfer.upload(target.url, blob.data, md5=blob.md5)
        message = fpb.ConnectRequest(
            job_succeeded=fpb.JobSucceeded(
                lease=self.ref,
                key=target.key,
                size_bytes=len(blob.data),
                sha256=blob.sha256,
                step=outcome.step,
                loss=outcome.loss,
                kohya=kohya,
            )
        )
        await self._send(message)
        self.terminal_message = message
        self._log.info("job succeeded", step=outcome.step, key=target.key, sha256=blob.sha256)
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
