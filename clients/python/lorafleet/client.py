"""The Python SDK: `AsyncClient` (asyncio) and `Client` (blocking), on the generated stubs.

    import lorafleet
    with lorafleet.Client("localhost:50051", api_key="lf_...") as client:
        client.upload_dir("photos/rex", prefix="dogs/rex")
        job = client.submit(instance_prompt="a photo of sks dog", instance_data_prefix="dogs/rex",
                            max_train_steps=500)
        for update in client.watch(job.job_id):
            print(update.job.state, update.job.progress.step)
        client.download_result(job.job_id, "rex.safetensors")

Results are lorafleet's domain values (`lorafleet.model.Job`, `JobEvent`, ...); errors are
`LorafleetError`s (`InvalidArgument` naming the field, `NotFound`, `Unauthenticated`, ...).
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp
import grpc

from lorafleet.errors import (
    FailedPrecondition,
    InvalidArgument,
    LorafleetError,
    NotFound,
    StorageError,
    Unauthenticated,
)
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.model import Checkpoint, Job, JobEvent, JobState
from lorafleet.serde import (
    JOB_STATES,
    checkpoint_from_proto,
    event_from_proto,
    job_from_proto,
    spec_from_proto,
    spec_to_proto,
)
from lorafleet.spec import JobSpec

T = TypeVar("T")
DEFAULT_TARGET = "localhost:50051"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True, kw_only=True)
class WatchUpdate:
    job: Job
    # None for the first update (the job as it stands when the watch starts).
    event: JobEvent | None


@dataclass(frozen=True, kw_only=True)
class Artifacts:
    result_url: str | None
    checkpoints: list[tuple[Checkpoint, str]]


def _error(err: grpc.aio.AioRpcError) -> LorafleetError:
    details = err.details() or str(err.code())
    code = err.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, reason = details.partition(": ")
        return InvalidArgument(field, reason or details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(details)
    error = LorafleetError(f"{code.name.lower()}: {details}")
    error.retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return error


def build_spec(spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any) -> pb.JobSpec:
    """A spec from a JobSpec, a mapping (e.g. a YAML file) or keyword fields; checked locally."""
    if isinstance(spec, JobSpec):
        return spec_to_proto(spec)
    merged = {**(dict(spec) if spec else {}), **fields}
    webhook = merged.pop("webhook", None)
    msg = pb.JobSpec()
    for name, value in merged.items():
        if name not in pb.JobSpec.DESCRIPTOR.fields_by_name:
            raise InvalidArgument(name, "not a job spec field")
        if name == "labels":
            msg.labels.update({str(k): str(v) for k, v in value.items()})
        elif isinstance(value, str) and name in ("lr_scheduler", "mixed_precision", "caption_mode"):
            # Enums by their lower-case names, as in YAML files and CLI flags ("cosine", "bf16").
            number = _enum_number(pb.JobSpec.DESCRIPTOR.fields_by_name[name].enum_type, value)
            if number is None:
                raise InvalidArgument(name, f"unknown value {value!r}")
            setattr(msg, name, number)
        else:
            try:
                setattr(msg, name, value)
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(name, str(exc)) from None
    if webhook:
        msg.webhook.url = webhook.get("url", "")
        for event in webhook.get("events", ()):
            number = _enum_number(pb.WebhookEvent.DESCRIPTOR, event)
            if number is None:
                raise InvalidArgument("webhook.events", f"unknown event {event!r}")
            msg.webhook.events.append(pb.WebhookEvent.ValueType(number))
    spec_from_proto(msg)  # the same checks the scheduler runs, before a round trip
    return msg


def _camel_to_upper(name: str) -> str:
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).upper()


def _enum_number(enum: Any, value: str) -> int | None:
    wanted = f"{_camel_to_upper(enum.name)}_{value}".upper()
    for v in enum.values:
        if v.name == wanted and v.number != 0:
            return int(v.number)
    return None


def _training_files(root: Path) -> builtins.list[Path]:
    return sorted(
        p for p in root.iterdir() if p.is_file() and p.suffix.lower() in (*IMAGE_SUFFIXES, ".txt")
    )


class AsyncClient:
    """JobService over one channel; `async with` it, or call `close()`."""

    def __init__(
        self,
        target: str | None = None,
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.target = target or os.environ.get("LORAFLEET_TARGET", DEFAULT_TARGET)
        key = api_key or os.environ.get("LORAFLEET_API_KEY", "")
        self._metadata = (("authorization", f"Bearer {key}"),)
        self._timeout_s = timeout_s
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.aio.secure_channel(self.target, creds)
        else:
            self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = pbgrpc.JobServiceStub(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _error(err) from None

    async def submit(
        self,
        spec: JobSpec | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str = "",
        **fields: Any,
    ) -> Job:
        request = pb.SubmitJobRequest(
            spec=build_spec(spec, **fields), idempotency_key=idempotency_key
        )
        response: pb.SubmitJobResponse = await self._unary(self._stub.SubmitJob, request)
        return job_from_proto(response.job)

    async def submit_batch(self, specs: Sequence[JobSpec | Mapping[str, Any]]) -> list[Job]:
        """All or nothing: either every job is queued or none is."""
        request = pb.SubmitJobsRequest(
            jobs=[pb.SubmitJobRequest(spec=build_spec(s)) for s in specs]
        )
        response: pb.SubmitJobsResponse = await self._unary(self._stub.SubmitJobs, request)
        return [job_from_proto(j) for j in response.jobs]

    async def get(self, job_id: str) -> Job:
        response: pb.GetJobResponse = await self._unary(
            self._stub.GetJob, pb.GetJobRequest(job_id=job_id)
        )
        return job_from_proto(response.job)

    async def cancel(self, job_id: str) -> Job:
        response: pb.CancelJobResponse = await self._unary(
            self._stub.CancelJob, pb.CancelJobRequest(job_id=job_id)
        )
        return job_from_proto(response.job)

    async def list(
        self,
        *,
        states: Sequence[JobState] = (),
        labels: Mapping[str, str] | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[Job]:
        """Every matching job, newest first, fetching pages as needed."""
        token = ""
        while True:
            request = pb.ListJobsRequest(
                states=[JOB_STATES[s] for s in states],
                labels=dict(labels or {}),
                page_size=page_size,
                page_token=token,
            )
            response: pb.ListJobsResponse = await self._unary(self._stub.ListJobs, request)
            for job in response.jobs:
                yield job_from_proto(job)
            token = response.next_page_token
            if not token:
                return

    async def events(self, job_id: str) -> builtins.list[JobEvent]:
        """The whole timeline, oldest first."""
        out: builtins.list[JobEvent] = []
        after = 0
        while True:
            request = pb.ListJobEventsRequest(job_id=job_id, after_event_id=after, page_size=10_000)
            response: pb.ListJobEventsResponse = await self._unary(
                self._stub.ListJobEvents, request
            )
            out.extend(event_from_proto(e) for e in response.events)
            after = response.next_after_event_id
            if not after:
                return out

    async def watch(self, job_id: str, *, after_event_id: int = 0) -> AsyncIterator[WatchUpdate]:
        """The job now, then every event until it is final."""
        call = self._stub.WatchJob(
            pb.WatchJobRequest(job_id=job_id, after_event_id=after_event_id),
            metadata=self._metadata,
        )
        try:
            async for response in call:
                yield WatchUpdate(
                    job=job_from_proto(response.job),
                    event=event_from_proto(response.event) if response.HasField("event") else None,
                )
        except grpc.aio.AioRpcError as err:
            raise _error(err) from None
        finally:
            call.cancel()

    async def upload_dir(self, directory: str | Path, *, prefix: str) -> builtins.list[str]:
        """Uploads the images (and `.txt` captions beside them) of a local folder under `prefix`."""
        root = Path(directory)
        files = await asyncio.to_thread(_training_files, root)
        if not files:
            raise InvalidArgument("directory", f"no images in {root}")
        request = pb.CreateUploadUrlsRequest(prefix=prefix, file_names=[p.name for p in files])
        response: pb.CreateUploadUrlsResponse = await self._unary(
            self._stub.CreateUploadUrls, request
        )
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout_s)
        ) as http:

            async def put(path: Path, url: str) -> None:
                data = await asyncio.to_thread(path.read_bytes)
                async with http.put(url, data=data) as r:
                    if r.status >= 300:
                        raise StorageError(
                            f"upload of {path.name} failed: {r.status}", retryable=r.status >= 500
                        )

            await asyncio.gather(
                *(put(p, u.url) for p, u in zip(files, response.urls, strict=True))
            )
        return [u.key for u in response.urls]

    async def webhook_deliveries(self, job_id: str) -> builtins.list[pb.WebhookDelivery]:
        """The job's webhook delivery log (attempts, last status and error, delivered/gave up)."""
        response: pb.ListWebhookDeliveriesResponse = await self._unary(
            self._stub.ListWebhookDeliveries, pb.ListWebhookDeliveriesRequest(job_id=job_id)
        )
        return list(response.deliveries)

    async def artifacts(self, job_id: str) -> Artifacts:
        response: pb.GetJobArtifactsResponse = await self._unary(
            self._stub.GetJobArtifacts, pb.GetJobArtifactsRequest(job_id=job_id)
        )
        return Artifacts(
            result_url=response.result.url or None,
            checkpoints=[
                (checkpoint_from_proto(record), url.url)
                for record, url in zip(
                    response.checkpoint_records, response.checkpoints, strict=True
                )
            ],
        )

    async def download_result(self, job_id: str, destination: str | Path) -> Path:
        """Writes the final LoRA (pytorch_lora_weights.safetensors) and checks its sha256."""
        job = await self.get(job_id)
        artifacts = await self.artifacts(job_id)
        if artifacts.result_url is None or job.result is None:
            raise FailedPrecondition(f"job {job_id} has no result (state {job.state.value})")
        data = await self._fetch(artifacts.result_url)
        if hashlib.sha256(data).hexdigest() != job.result.sha256:
            raise StorageError(
                "the downloaded LoRA does not match its recorded sha256", retryable=True
            )
        path = Path(destination)
        await asyncio.to_thread(path.write_bytes, data)
        return path

    async def download_checkpoint(
        self, job_id: str, step: int | None, destination: str | Path
    ) -> Path:
        """Writes a retained checkpoint (the newest when step is None) after checking its sha256."""
        artifacts = await self.artifacts(job_id)
        chosen = [(c, u) for c, u in artifacts.checkpoints if step is None or c.step == step]
        if not chosen:
            raise NotFound(f"job {job_id} has no retained checkpoint at step {step}")
        checkpoint, url = chosen[0]
        data = await self._fetch(url)
        if hashlib.sha256(data).hexdigest() != checkpoint.sha256:
            raise StorageError(
                "the downloaded checkpoint does not match its sha256", retryable=True
            )
        path = Path(destination)
        await asyncio.to_thread(path.write_bytes, data)
        return path

    async def _fetch(self, url: str) -> bytes:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s)) as http,
            http.get(url) as r,
        ):
            if r.status != 200:
                raise StorageError(
                    f"download failed: {r.status} {await r.text()}", retryable=r.status >= 500
                )
            return await r.read()


class Client:
    """The blocking twin of `AsyncClient`: the same calls, run on a private event loop."""

    def __init__(self, target: str | None = None, **options: Any) -> None:
        self._runner = asyncio.Runner()
        self._async: AsyncClient = self._runner.run(self._make(target, options))

    @staticmethod
    async def _make(target: str | None, options: dict[str, Any]) -> AsyncClient:
        return AsyncClient(target, **options)  # the channel binds to the runner's loop

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._async.close())
        self._runner.close()

    def _run(self, awaitable: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await awaitable

        return self._runner.run(wrapped())

    def _iterate(self, iterator: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self._run(anext(iterator))
            except StopAsyncIteration:
                return

    def submit(
        self,
        spec: JobSpec | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str = "",
        **fields: Any,
    ) -> Job:
        return self._run(self._async.submit(spec, idempotency_key=idempotency_key, **fields))

    def submit_batch(self, specs: Sequence[JobSpec | Mapping[str, Any]]) -> builtins.list[Job]:
        return self._run(self._async.submit_batch(specs))

    def get(self, job_id: str) -> Job:
        return self._run(self._async.get(job_id))

    def cancel(self, job_id: str) -> Job:
        return self._run(self._async.cancel(job_id))

    def list(
        self,
        *,
        states: Sequence[JobState] = (),
        labels: Mapping[str, str] | None = None,
        page_size: int = 100,
    ) -> Iterator[Job]:
        return self._iterate(self._async.list(states=states, labels=labels, page_size=page_size))

    def events(self, job_id: str) -> builtins.list[JobEvent]:
        return self._run(self._async.events(job_id))

    def watch(self, job_id: str, *, after_event_id: int = 0) -> Iterator[WatchUpdate]:
        return self._iterate(self._async.watch(job_id, after_event_id=after_event_id))

    def upload_dir(self, directory: str | Path, *, prefix: str) -> builtins.list[str]:
        return self._run(self._async.upload_dir(directory, prefix=prefix))

    def artifacts(self, job_id: str) -> Artifacts:
        return self._run(self._async.artifacts(job_id))

    def webhook_deliveries(self, job_id: str) -> builtins.list[pb.WebhookDelivery]:
        return self._run(self._async.webhook_deliveries(job_id))

    def download_result(self, job_id: str, destination: str | Path) -> Path:
        return self._run(self._async.download_result(job_id, destination))

    def download_checkpoint(self, job_id: str, step: int | None, destination: str | Path) -> Path:
        return self._run(self._async.download_checkpoint(job_id, step, destination))
