"""A lease's uploads: checkpoints in the background, generated class images, the result, and
the URL round trips each needs.

The scheduler signs every PUT URL. A lease asks for the ones it needs (`UrlsRequested`) and
waits for the answer (`UrlsRenewed`), asking again after a reconnect (the answer may have been
lost with the old stream) and after `url_request_timeout_s`. Checkpoints go through a
`CheckpointPipeline`: the training thread only takes a host-memory snapshot; serialising it (in a
thread), the URL, the upload and `CheckpointCommitted` run while training continues, one upload
at a time and one snapshot waiting (a newer one replaces it). No checkpoint byte touches local
disk. Class images the run generates are stored at this lease's keys and announced
(`ClassImagesCommitted`, with their sha256) before any checkpoint trained with them is. The
result goes to URLs asked for when it is ready, never ones that expired during a long run.

`LeaseUploads` talks to the scheduler through the `send` and `notice` callables the runner gives
it; both raise `LeaseLost` once the lease is gone, which ends an upload quietly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import trace

from lorafleet.core.errors import StorageError
from lorafleet.core.serde import MAX_CLASS_IMAGES_PER_MESSAGE
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as jpb
from lorafleet.worker import metrics
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease import LeaseLost
from lorafleet.worker.training import (
    Finished,
    TrainingSnapshot,
    checkpoint_sha256,
    serialize_checkpoint,
)
from lorafleet.worker.transfer import TransferClient, content_md5

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.worker")

# Attempts at getting an upload URL before giving up on that upload.
_URL_REQUEST_ATTEMPTS = 3

SlotKey = tuple[int, int, int]

Send = Callable[[fpb.ConnectRequest], Awaitable[None]]
Notice = Callable[[str], Awaitable[None]]


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
class Blob:
    """Bytes to store, with the two digests their upload needs, computed once."""

    # A checkpoint's is a read-only view over a numpy buffer: not hashable, not picklable.
    data: bytes | memoryview = field(repr=False, compare=False)
    sha256: str  # hex: announced to the scheduler, recorded by the ledger
    md5: str  # base64: the store checks the body against it (Content-MD5)


def blob_of(data: bytes | memoryview) -> Blob:
    """Both digests in one call; it reads all of `data`, so run it off the event loop."""
    return Blob(data=data, sha256=checkpoint_sha256(data), md5=content_md5(data))


def _serialize(snapshot: TrainingSnapshot) -> Blob:
    return blob_of(serialize_checkpoint(snapshot))


class LeaseUploads:
    """Everything one lease stores, and the URL round trips it takes (event loop only).

    `committed_steps` and `checkpoint_cost_s` (the latest checkpoint's snapshot stall plus its
    upload: the next Ready reports it for checkpointing_steps auto) are read by the runner and
    the agent.
    """

    def __init__(
        self,
        *,
        ref: fpb.LeaseRef,
        send: Send,
        notice: Notice,
        transfer: TransferClient,
        config: WorkerConfig,
        log: Any,
    ) -> None:
        self._ref = ref
        self._send = send
        self._notice = notice
        self._transfer = transfer
        self._config = config
        self._log = log
        self._url_waiters: dict[SlotKey, list[asyncio.Future[fpb.UploadUrl]]] = {}
        # Replaced (and the old one set) by `stream_changed()`.
        self._stream_changed = asyncio.Event()
        self.pipeline = CheckpointPipeline(self.upload_checkpoint, self._checkpoint_failed)
        self._tasks: set[asyncio.Task[bool]] = set()
        self._class_uploads: list[asyncio.Task[bool]] = []
        # Class images this lease stored and announced: announced again after a reconnect, in
        # case the announcement was lost with the old stream (the scheduler ignores repeats).
        self._announced_class_images: list[fpb.ClassImage] = []
        self._gate = asyncio.Semaphore(config.artifact_upload_concurrency)
        self.committed_steps: list[int] = []
        self.checkpoint_cost_s: float | None = None
        # The trainer's snapshot stalls (RunTimings.snapshot_seconds), once a run started.
        self.snapshot_seconds: list[float] = []

    # The stream -----------------------------------------------------------------------------

    def answered(self, uploads: Any) -> None:
        """The UploadUrls of an UrlsRenewed: answers to the requests waiting for them."""
        for upload in uploads:
            for waiter in self._url_waiters.pop(slot_key(upload.slot), []):
                if not waiter.done():
                    waiter.set_result(upload)

    def stream_changed(self, *, reannounce: bool) -> None:
        """The stream was replaced: requests sent on the old one may have been lost with it, so
        the ones still waiting are asked again now (not after `url_request_timeout_s`, while
        every checkpoint would be skipped); announced class images are announced again."""
        changed, self._stream_changed = self._stream_changed, asyncio.Event()
        changed.set()
        if self._announced_class_images and reannounce:
            self.spawn(self._reannounce_class_images(list(self._announced_class_images)))

    def lease_gone(self) -> None:
        """Uploads waiting for a URL will never get one."""
        for waiters in self._url_waiters.values():
            for waiter in waiters:
                waiter.cancel()

    def offer_checkpoint(self, snapshot: TrainingSnapshot) -> None:
        """A periodic snapshot: stored in the background (see `CheckpointPipeline`)."""
        self.pipeline.offer(snapshot)

    def store_class_images(self, batch: list[tuple[int, bytes]]) -> None:
        self._class_uploads.append(self.spawn(self._stored_class_images(batch)))

    async def _stored_class_images(self, batch: list[tuple[int, bytes]]) -> bool:
        """Stores a batch of generated class images at this lease's keys, then announces them
        with their sha256: only then does the ledger record them for the job's later holders.
        True once announced."""
        try:
            slots = [
                fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CLASS_IMAGE, index=index)
                for index, _ in batch
            ]
            urls = await self.upload_urls(slots)
            blobs = await asyncio.to_thread(lambda: [blob_of(png) for _, png in batch])

            async def put(url: fpb.UploadUrl, blob: Blob) -> None:
                async with self._gate:
                    await self._transfer.upload(url.url, blob.data, md5=blob.md5)

            await asyncio.gather(*(put(url, blob) for url, blob in zip(urls, blobs, strict=True)))
            images = [
                fpb.ClassImage(
                    index=url.slot.index, key=url.key, size_bytes=len(blob.data), sha256=blob.sha256
                )
                for url, blob in zip(urls, blobs, strict=True)
            ]
            await self._announce_class_images(images)
            self._announced_class_images.extend(images)
            return True
        except LeaseLost:
            return False
        except Exception:
            self._log.exception("class image upload failed", count=len(batch))
            return False

    async def _announce_class_images(self, images: list[fpb.ClassImage]) -> None:
        for start in range(0, len(images), MAX_CLASS_IMAGES_PER_MESSAGE):
            chunk = images[start : start + MAX_CLASS_IMAGES_PER_MESSAGE]
            await self._send(
                fpb.ConnectRequest(
                    class_images_committed=fpb.ClassImagesCommitted(lease=self._ref, images=chunk)
                )
            )

    async def _reannounce_class_images(self, images: list[fpb.ClassImage]) -> bool:
        await self._announce_class_images(images)
        return True

    def spawn(self, work: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        """A background upload of this lease (cancelled when the lease's work ends); its task
        says whether it succeeded."""

        async def guarded() -> bool:
            try:
                return await work
            except LeaseLost:
                return False
            except Exception:
                self._log.exception("background upload failed")
                return False

        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def class_images_stored(self) -> bool:
        """Waits for every generated class image so far to be stored and announced; a
        checkpoint is only valid with them (the trainer's fingerprint covers them), so none is
        committed before the ledger can have recorded them (the stream keeps order)."""
        if not self._class_uploads:
            return True
        results = await asyncio.gather(*self._class_uploads, return_exceptions=True)
        return all(result is True for result in results)

    async def upload_checkpoint(self, snapshot: TrainingSnapshot) -> None:
        """Serialise (off the loop), get the URL, PUT, announce. Raises on failure."""
        started = time.monotonic()
        with tracer.start_as_current_span(
            "worker.checkpoint", attributes={"lorafleet.step": snapshot.step}
        ) as span:
            blob = await asyncio.to_thread(_serialize, snapshot)
            span.set_attribute("lorafleet.size_bytes", len(blob.data))
            if not await self.class_images_stored():
                self._log.warning(
                    "checkpoint not committed: generated class images could not be stored",
                    step=snapshot.step,
                )
                return
            slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=snapshot.step)
            (url,) = await self.upload_urls([slot])
            await self._transfer.upload(url.url, blob.data, md5=blob.md5)
            await self._send(
                fpb.ConnectRequest(
                    checkpoint_committed=fpb.CheckpointCommitted(
                        lease=self._ref,
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
        stall = self.snapshot_seconds[-1] if self.snapshot_seconds else 0.0
        self.checkpoint_cost_s = stall + time.monotonic() - started
        self._log.info(
            "checkpoint committed", step=snapshot.step, key=url.key, bytes=len(blob.data)
        )

    async def upload_urls(self, slots: list[fpb.UploadSlot]) -> list[fpb.UploadUrl]:
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
                        urls_requested=fpb.UrlsRequested(lease=self._ref, slots=slots)
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

    async def _checkpoint_failed(self, step: int, error: str) -> None:
        metrics.CHECKPOINT_FAILURES.inc()
        await self._notice(f"checkpoint at step {step} could not be stored: {error[:300]}")

    async def close(self) -> None:
        """Drops pending checkpoints and cancels every upload still running."""
        await self.pipeline.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self) -> None:
        """Waits for the background uploads still running (class images belong to the job: they
        are stored before the lease ends, their URLs need a live lease). Each is bounded by the
        transfer deadline."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def upload_result(
        self, outcome: Finished, formats: list[str]
    ) -> tuple[jpb.JobResult, jpb.JobResult | None]:
        """Stores the LoRA file(s) `formats` names (the main one at result slot 0, with
        output_format both the kohya file at slot 1) at fresh PUT URLs, asked for now: the
        grant's may have expired during a long run. Returns (main, kohya)."""
        await self.pipeline.close()  # the result supersedes any checkpoint still pending
        await self.settle()
        main, *others = formats
        files = {"diffusers": outcome.lora_weights, "kohya": outcome.kohya_weights}
        main_data = files[main]
        if main_data is None or (others and outcome.kohya_weights is None):
            raise RuntimeError(f"the trainer wrote no {main} file for output_format")
        blob = await asyncio.to_thread(blob_of, main_data)
        slots = [
            fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_RESULT, index=i) for i in range(1 + len(others))
        ]
        target, *kohya_targets = await self.upload_urls(slots)
        kohya = None
        if kohya_targets:
            assert outcome.kohya_weights is not None
            kohya_blob = await asyncio.to_thread(blob_of, outcome.kohya_weights)
            (kohya_target,) = kohya_targets
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
        main_result = jpb.JobResult(key=target.key, size_bytes=len(blob.data), sha256=blob.sha256)
        return main_result, kohya
