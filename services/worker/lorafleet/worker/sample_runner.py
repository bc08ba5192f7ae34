"""One sample task, from grant to `SamplesStored`: the agent runs it like a lease.

A sample task is a lease of its own kind (the scheduler's dispatcher.py): the agent drives a
`SampleRunner` through the same surface as a `LeaseRunner` (`run`, `cancel`, `abort`, `drain`,
`holds_lease`, `progress`, `terminal_message`), so heartbeats, revocation, rejection, drains and
reconnects treat it the same way.

1. Download the weights (a checkpoint or the result) into memory through the grant's GET URL;
   check the ledger's sha256.
2. Make the images on the agent's training thread (`SamplePipelines`, which keeps the base
   model loaded for the next task of the same model). A revoked task (the scheduler took it back
   for training, or the lease is gone) or a drain stops between two images.
3. Upload every PNG to its write-once PUT URL (bound to the task's lease) and send
   `SamplesStored`. A failure sends `JobFailed` with the trainer's failure class; it fails or
   re-queues the task only, never its job.
"""

from __future__ import annotations

import asyncio
import enum
import threading

import structlog

from lorafleet.core.serde import FAILURE_CLASSES, sample_settings_from_proto, spec_from_proto
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease import (
    LeaseLink,
    LeaseLost,
    LeaseResult,
    ProgressReport,
    ProgressSlot,
    failure_message,
    training_config_for,
)
from lorafleet.worker.training import checkpoint_sha256, classify_exception
from lorafleet.worker.training.failures import input_fault
from lorafleet.worker.training.samples import SamplePipelines, SamplesStopped
from lorafleet.worker.training_thread import TrainingThread
from lorafleet.worker.transfer import TransferClient, content_md5

log = structlog.get_logger(__name__)


class _Mode(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # stop; the agent sends Draining(lease): re-queued at once
    CANCELLED = "cancelled"  # the lease is gone: send nothing more
    ABORTED = "aborted"  # stop; the lease is still ours


class SampleRunner:
    """Runs one granted sample task; see the module docstring."""

    def __init__(
        self,
        *,
        grant: fpb.SampleTaskGranted,
        link: LeaseLink,
        transfer: TransferClient,
        training: TrainingThread,
        config: WorkerConfig,
        pipelines: SamplePipelines,
    ) -> None:
        self.grant = grant
        self.ref = fpb.LeaseRef(lease_id=grant.lease.lease_id, epoch=grant.lease.epoch)
        self.job_id = grant.lease.job_id
        self.task_id = grant.task_id
        self._link = link
        self._transfer = transfer
        self._training = training
        self._config = config
        self._pipelines = pipelines
        self._mode = _Mode.RUNNING
        self._stop = threading.Event()
        self._work: asyncio.Task[LeaseResult] | None = None
        self._running: asyncio.Future[object] | None = None
        self.progress = ProgressSlot(ProgressReport(step=grant.step))
        self.terminal_message: fpb.ConnectRequest | None = None
        self.terminal_confirmed = False
        self.result: LeaseResult | None = None
        self.notices: list[str] = []
        self.images_stored = 0
        self._log = log.bind(
            job_id=self.job_id,
            task_id=self.task_id,
            lease_id=self.ref.lease_id,
            epoch=self.ref.epoch,
            step=grant.step,
            machine_id=config.machine_id,
        )

    # Control from the agent (the LeaseRunner surface) -----------------------------------------

    @property
    def holds_lease(self) -> bool:
        return self._mode is not _Mode.CANCELLED and self.terminal_message is None

    def cancel(self, reason: str) -> None:
        self._request_stop(_Mode.CANCELLED, reason)

    def abort(self, reason: str) -> None:
        if self._mode is not _Mode.CANCELLED:
            self._request_stop(_Mode.ABORTED, reason)

    def drain(self) -> None:
        if self._mode is _Mode.RUNNING:
            self._request_stop(_Mode.DRAINING, "drain")

    def reconnected(self) -> None:
        """Nothing is waiting on the stream while images are made."""

    def urls_renewed(self, urls: fpb.JobUrls) -> None:
        """A sample task's URLs come with its grant; there is nothing to renew."""

    def _request_stop(self, mode: _Mode, reason: str) -> None:
        self._mode = mode
        self._stop.set()
        self._log.info("stopping the sample task", mode=mode.value, reason=reason)
        if self._work is not None and mode is _Mode.CANCELLED:
            self._work.cancel()

    # The task -----------------------------------------------------------------------------------

    async def run(self) -> LeaseResult:
        self._work = asyncio.get_running_loop().create_task(self._run())
        try:
            result = await self._work
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            result = LeaseResult.DRAINED if self._mode is _Mode.DRAINING else LeaseResult.STOPPED
        running = self._running
        if running is not None and not running.done():
            # The thread sees the stop between two images; the agent says Ready after that.
            await asyncio.wait([running])
        self.result = result
        self._log.info("sample task ended", result=result.value, images=self.images_stored)
        return result

    def _stopped_result(self) -> LeaseResult:
        return LeaseResult.DRAINED if self._mode is _Mode.DRAINING else LeaseResult.STOPPED

    async def _run(self) -> LeaseResult:
        try:
            images = await self._make_images()
            if self._mode is not _Mode.RUNNING:
                return self._stopped_result()
            await self._store(images)
            return LeaseResult.SUCCEEDED
        except (SamplesStopped, LeaseLost):
            return self._stopped_result()
        except Exception as exc:
            if self._mode is not _Mode.RUNNING:
                return self._stopped_result()
            return await self._fail(exc)

    async def _make_images(self) -> list[tuple[int, int, bytes]]:
        grant = self.grant
        # A StorageError here is classed internal (re-run, elsewhere): the ledger keeps the
        # weights while a task needs them, so this node could not read them.
        weights = await self._transfer.download(grant.weights.url)
        actual = await asyncio.to_thread(checkpoint_sha256, weights)
        if actual != grant.weights_sha256:
            raise input_fault(f"weights: sha256 {actual[:12]}... does not match the ledger's")
        config = training_config_for(self._config, spec_from_proto(grant.spec))
        settings = sample_settings_from_proto(grant.settings)
        running = asyncio.wrap_future(
            self._training.submit(
                self._pipelines.make,
                config,
                settings=settings,
                weights=weights,
                weights_is_checkpoint=grant.weights_is_checkpoint,
                should_stop=self._stop.is_set,
            )
        )
        self._running = running  # type: ignore[assignment]
        return await asyncio.shield(running)

    async def _store(self, images: list[tuple[int, int, bytes]]) -> None:
        uploads = {(u.prompt_index, u.image_index): u for u in self.grant.uploads}
        stored: list[fpb.StoredImage] = []
        gate = asyncio.Semaphore(self._config.artifact_upload_concurrency)

        async def put(prompt_index: int, image_index: int, data: bytes) -> None:
            upload = uploads[(prompt_index, image_index)]
            async with gate:
                await self._transfer.upload(upload.url, data, md5=content_md5(data))
            stored.append(
                fpb.StoredImage(
                    prompt_index=prompt_index,
                    image_index=image_index,
                    key=upload.key,
                    size_bytes=len(data),
                    sha256=checkpoint_sha256(data),
                )
            )

        await asyncio.gather(*(put(p, i, data) for p, i, data in images))
        self.images_stored = len(stored)
        stored.sort(key=lambda s: (s.prompt_index, s.image_index))
        message = fpb.ConnectRequest(
            samples_stored=fpb.SamplesStored(lease=self.ref, images=stored)
        )
        await self._link.send(message)
        self.terminal_message = message

    async def _fail(self, exc: Exception) -> LeaseResult:
        failure_class = classify_exception(exc)
        text = failure_message(exc)
        self._log.warning(
            "sample task failed", failure_class=failure_class, error=text, exc_info=exc
        )
        message = fpb.ConnectRequest(
            job_failed=fpb.JobFailed(
                lease=self.ref, failure_class=FAILURE_CLASSES[failure_class], message=text
            )
        )
        try:
            await self._link.send(message)
        except LeaseLost:
            return LeaseResult.STOPPED
        self.terminal_message = message
        return LeaseResult.FAILED
