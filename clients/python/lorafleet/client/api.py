"""The Python SDK: `AsyncClient` (asyncio) and `Client` (blocking), on the generated stubs.

    from lorafleet.client import Client
    with Client("localhost:50051", api_key="lf_...") as client:
        client.upload_dir("photos/rex", prefix="dogs/rex")
        job = client.submit(instance_prompt="a photo of sks dog", instance_data_prefix="dogs/rex",
                            max_train_steps=500)
        for update in client.watch(job.job_id):
            print(update.job.state, update.job.progress.step)
        client.download_result(job.job_id, "rex.safetensors")

Results are lorafleet's domain values (`lorafleet.core.model.Job`, `JobEvent`, ...); errors are
`LorafleetError`s (`InvalidArgument` naming the field, `NotFound`, `Unauthenticated`, ...).
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp
import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from lorafleet.client.dataset import (
    TrainingFile,
    fetch_zip,
    read_folder,
    read_zip,
)
from lorafleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    LorafleetError,
    NotFound,
    ResourceExhausted,
    StorageError,
    Unauthenticated,
)
from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.core.model import Checkpoint, Estimate, Job, JobEvent, JobState, result_format
from lorafleet.core.model_refs import check_model_ref_shape
from lorafleet.core.serde import (
    JOB_STATES,
    checkpoint_from_proto,
    enum_prefix,
    event_from_proto,
    job_from_proto,
    spec_from_proto,
    spec_to_proto,
)
from lorafleet.core.spec import SPEC_FIELD, JobSpec, spec_value
from lorafleet.core.spec_checks import SAMPLE_REQUEST_FIELDS, check_field
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc

# WatchJob reopening after the scheduler was unreachable: the first wait, doubling up to the last.
_RECONNECT_FIRST_DELAY_S = 0.25
_RECONNECT_MAX_DELAY_S = 5.0
# Calls that may be sent again when an attempt got no answer: reads, cancel (a second cancel
# answers the same), and SubmitJob with its idempotency key (the client fills one in).
_IDEMPOTENT = frozenset(
    {
        "GetJob",
        "ListJobs",
        "ListJobEvents",
        "CancelJob",
        "EstimateJob",
        "GetJobArtifacts",
        "ListWebhookDeliveries",
        "CreateUploadUrls",
        "SubmitJob",
    }
)
# The client's channel: its own connection (a fresh channel after a replica went silent must be
# a new TCP connection, or a load balancer never picks again), and reconnect backoff bounded so
# a scheduler that is back is found within a couple of seconds.
_CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)

T = TypeVar("T")
DEFAULT_TARGET = "localhost:50051"


@dataclass(frozen=True, kw_only=True)
class WatchUpdate:
    job: Job
    # None for the first update (the job as it stands when the watch starts).
    event: JobEvent | None


@dataclass(frozen=True, kw_only=True)
class SampleImageInfo:
    """A stored validation image."""

    step: int
    prompt_index: int
    prompt: str
    image_index: int
    url: str
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Artifacts:
    result_url: str | None
    checkpoints: list[tuple[Checkpoint, str]]
    # Every result file's URL by format ("diffusers", "kohya"); result_url is one of them.
    result_urls: dict[str, str] = field(default_factory=dict)
    samples: list[SampleImageInfo] = field(default_factory=list)


def _unreachable(details: str) -> bool:
    lowered = details.lower()
    return any(
        s in lowered
        for s in ("failed to connect", "connection refused", "connect failed", "dns resolution")
    )


def _error(err: grpc.aio.AioRpcError, target: str | None = None) -> LorafleetError:
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
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details)
    if code == grpc.StatusCode.UNAVAILABLE and target is not None and _unreachable(details):
        error = LorafleetError(
            f"no scheduler answers at {target} ({details.splitlines()[0][:200]}); start one with"
            " `lorafleet up` (or `lorafleet scheduler`), or point LORAFLEET_TARGET / --target at"
            " yours"
        )
        error.retryable = True
        return error
    error = LorafleetError(f"{code.name.lower()}: {details}")
    error.retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return error


def build_spec(spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any) -> pb.JobSpec:
    """A spec from a JobSpec, a mapping (e.g. a YAML file) or keyword fields; checked locally."""
    if isinstance(spec, JobSpec):
        return spec_to_proto(spec)
    merged = {**(dict(spec) if spec else {}), **fields}
    webhook = merged.pop("webhook", None)
    # The JobSpec's own names (the README's options table, `lorafleet submit`'s flags) as well
    # as the wire's nested `webhook: {url, events}`: a --spec file may say either.
    if "webhook_url" in merged or "webhook_events" in merged:
        if webhook:
            raise InvalidArgument(
                "webhook_url", "give webhook_url/webhook_events or webhook, not both"
            )
        webhook = {
            "url": merged.pop("webhook_url", ""),
            "events": merged.pop("webhook_events", ()),
        }
    msg = pb.JobSpec()
    for name, value in merged.items():
        if name not in pb.JobSpec.DESCRIPTOR.fields_by_name:
            raise InvalidArgument(name, "not a job spec field")
        # Each value in its field's own type, or refused naming the field (core/spec.py): the
        # proto's setters would take true as 1.0 and say "'str' object cannot be interpreted".
        value = spec_value(name, value)
        field = pb.JobSpec.DESCRIPTOR.fields_by_name[name]
        if name == "labels":
            msg.labels.update(value)
        elif field.enum_type:
            number = _enum_number(field.enum_type, value)
            if number is None:
                raise InvalidArgument(name, f"unknown value {value!r}")
            setattr(msg, name, number)
        elif field.is_repeated:
            getattr(msg, name).extend(value)
        else:
            try:
                setattr(msg, name, value)
            except ValueError:  # past the wire's integer: "Value out of range"
                raise InvalidArgument(name, f"{value} is out of range") from None
    if webhook:
        if not isinstance(webhook, Mapping):
            raise InvalidArgument("webhook", "expected a mapping of url and events")
        msg.webhook.url = spec_value("webhook_url", webhook.get("url", ""))
        for event in spec_value("webhook_events", webhook.get("events", ())):
            number = _enum_number(pb.WebhookEvent.DESCRIPTOR, event)
            if number is None:
                raise InvalidArgument("webhook.events", f"unknown event {event!r}")
            msg.webhook.events.append(pb.WebhookEvent.ValueType(number))
    spec_from_proto(msg)  # the same checks the scheduler runs, before a round trip
    for name in ("base_model", "vae_model"):  # and its refusal of a relative local path
        check_model_ref_shape(name, getattr(msg, name))
    return msg


def _sample_value(name: str, value: Any) -> Any:
    """A RequestSamples value in the type and bounds of the job spec field it stands in for
    (core/spec.py's, as the scheduler checks it), or InvalidArgument naming the request's field
    (a proto setter past the wire's integer says only "Value out of range"). Zero, the job's
    own setting, passes."""
    spec_name = SAMPLE_REQUEST_FIELDS[name]
    try:
        typed = spec_value(spec_name, value)
        if typed:
            check_field(SPEC_FIELD[spec_name], typed, name=name)
    except InvalidArgument as exc:
        raise InvalidArgument(name, exc.reason) from None
    return typed


def _enum_number(enum: Any, value: str) -> int | None:
    wanted = f"{enum_prefix(enum)}{value}".upper()
    for v in enum.values:
        if v.name == wanted and v.number != 0:
            return int(v.number)
    return None


class AsyncClient(AsyncLifecycle):
    """JobService over one channel; `async with` it, or call `close()`."""

    def __init__(
        self,
        target: str | None = None,
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout_s: float = 60.0,
        attempt_timeout_s: float = 10.0,
        ready_wait_s: float = 10.0,
        watch_silence_s: float = 45.0,
    ) -> None:
        """`timeout_s` bounds each call as a whole. Within it, a call waits up to
        `ready_wait_s` for a scheduler to be reachable (one restarting is waited for, not
        reported), and a call that may be repeated (reads, cancel, submit) gives one attempt
        `attempt_timeout_s` before it takes the replica behind its connection as hung and tries
        again on a new connection (a load balancer then picks again). A watch that hears
        nothing for `watch_silence_s` (the scheduler sends the job every 15 s while nothing
        happens) is opened again likewise."""
        self.target = target or os.environ.get("LORAFLEET_TARGET", DEFAULT_TARGET)
        key = api_key or os.environ.get("LORAFLEET_API_KEY", "")
        self._metadata = (("authorization", f"Bearer {key}"),)
        self._timeout_s = timeout_s
        self._attempt_timeout_s = attempt_timeout_s
        self._ready_wait_s = ready_wait_s
        self._watch_silence_s = watch_silence_s
        self._tls = tls
        self._root_certificates = root_certificates
        self._channel = self._new_channel()
        self._old_channels: set[asyncio.Task[None]] = set()

    def _new_channel(self) -> grpc.aio.Channel:
        # A client span per call, and its trace context sent along (the scheduler's spans join
        # the caller's trace, e.g. the CLI command's).
        interceptors = aio_client_interceptors()
        if self._tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            return grpc.aio.secure_channel(
                self.target, creds, options=_CHANNEL_OPTIONS, interceptors=interceptors
            )
        return grpc.aio.insecure_channel(
            self.target, options=_CHANNEL_OPTIONS, interceptors=interceptors
        )

    @property
    def _stub(self) -> pbgrpc.JobServiceStub:
        return pbgrpc.JobServiceStub(self._channel)

    def _reconnect(self, channel: grpc.aio.Channel) -> None:
        """Drops `channel` (if still the current one) for a new connection. Closing it (which
        cancels its calls) runs in the background; `close()` waits for that."""
        if channel is not self._channel:
            return
        self._channel = self._new_channel()
        task = asyncio.get_running_loop().create_task(channel.close())
        self._old_channels.add(task)
        task.add_done_callback(self._old_channels.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._old_channels, return_exceptions=True)
        await self._channel.close()

    @staticmethod
    async def _ready(channel: grpc.aio.Channel, wait_s: float) -> bool:
        """Whether `channel` connected within `wait_s`."""
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                await channel.channel_ready()
        except TimeoutError:
            return False
        return True

    async def _unary(self, name: str, request: Any) -> Any:
        """One JobService call, bounded by `timeout_s`: waits (up to `ready_wait_s`) for a
        reachable scheduler, and repeats a call that may be repeated on a new connection
        when an attempt got no answer (a frozen replica behind a load balancer)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        repeatable = name in _IDEMPOTENT
        while True:
            channel = self._channel
            left = deadline - loop.time()
            if not await self._ready(channel, min(left, self._ready_wait_s)):
                state = channel.get_state(try_to_connect=False)
                if state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE and (
                    deadline - loop.time() > 0
                ):
                    # Connecting all along: a listener that never completes the handshake (a
                    # frozen process). A new connection may reach another replica.
                    self._reconnect(channel)
                    continue
                # Nothing listens, or the time is spent: the call below fails at once with
                # the channel's own reason ("connection refused", ...).
            left = deadline - loop.time()
            attempt_s = min(left, self._attempt_timeout_s) if repeatable else left
            method = getattr(pbgrpc.JobServiceStub(channel), name)
            try:
                return await method(request, metadata=self._metadata, timeout=max(attempt_s, 0.001))
            except grpc.aio.AioRpcError as err:
                answered = err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED
                if not repeatable or answered or deadline - loop.time() <= 0:
                    raise _error(err, self.target) from None
                self._reconnect(channel)

    async def submit(
        self,
        spec: JobSpec | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str = "",
        **fields: Any,
    ) -> Job:
        request = pb.SubmitJobRequest(
            spec=build_spec(spec, **fields),
            # Always one: a submit that got no answer is sent again (`_unary`), and the key
            # makes the second one return the job the first one queued.
            idempotency_key=idempotency_key or f"sdk-{uuid.uuid4().hex}",
        )
        response: pb.SubmitJobResponse = await self._unary("SubmitJob", request)
        return job_from_proto(response.job)

    async def estimate(
        self, spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any
    ) -> Estimate:
        """Expected seconds and dollars of a job before submitting it (EstimateJob)."""
        request = pb.EstimateJobRequest(spec=build_spec(spec, **fields))
        r: pb.EstimateJobResponse = await self._unary("EstimateJob", request)
        return Estimate(
            seconds_per_step=r.seconds_per_step,
            samples=r.samples,
            seconds=r.seconds,
            price_per_gpu_hour=r.price_per_gpu_hour,
            dollars=r.dollars,
            spend_limit_dollars=r.spend_limit_dollars,
            spent_dollars=r.spent_dollars,
        )

    async def submit_batch(self, specs: Sequence[JobSpec | Mapping[str, Any]]) -> list[Job]:
        """All or nothing: either every job is queued or none is."""
        request = pb.SubmitJobsRequest(
            jobs=[pb.SubmitJobRequest(spec=build_spec(s)) for s in specs]
        )
        response: pb.SubmitJobsResponse = await self._unary("SubmitJobs", request)
        return [job_from_proto(j) for j in response.jobs]

    async def get(self, job_id: str) -> Job:
        response: pb.GetJobResponse = await self._unary("GetJob", pb.GetJobRequest(job_id=job_id))
        return job_from_proto(response.job)

    async def cancel(self, job_id: str) -> Job:
        response: pb.CancelJobResponse = await self._unary(
            "CancelJob", pb.CancelJobRequest(job_id=job_id)
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
            response: pb.ListJobsResponse = await self._unary("ListJobs", request)
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
            response: pb.ListJobEventsResponse = await self._unary("ListJobEvents", request)
            out.extend(event_from_proto(e) for e in response.events)
            after = response.next_after_event_id
            if not after:
                return out

    async def watch(
        self,
        job_id: str,
        *,
        after_event_id: int = 0,
        reconnect_s: float = 300.0,
        on_waiting: Callable[[str], None] | None = None,
        waiting_notice_s: float = 3.0,
    ) -> AsyncIterator[WatchUpdate]:
        """The job now, then every event until it is final.

        A stream that breaks before the job is final (the scheduler restarted, the network
        dropped) or goes silent for `watch_silence_s` (a frozen replica) is opened again, on
        a new connection, after the last event seen, so no event is lost or repeated; each
        reopening starts with the job as it is then. Once no stream has stayed up for
        `waiting_notice_s`, `on_waiting` is called (once per outage) with what the watch is
        waiting for, and with "" once a stream answers again. After `reconnect_s` seconds
        without a stream that stays up, the last error is raised (`LorafleetError`,
        `retryable`)."""
        last_event_id = after_event_id
        delay_s = _RECONNECT_FIRST_DELAY_S
        unreachable_since: float | None = None
        noticed = False
        loop = asyncio.get_running_loop()
        while True:
            channel = self._channel
            if (
                not await self._ready(channel, min(self._ready_wait_s, waiting_notice_s))
                and channel.get_state(try_to_connect=False)
                is not grpc.ChannelConnectivity.TRANSIENT_FAILURE
            ):
                self._reconnect(channel)  # a handshake that never completes: a frozen replica
                channel = self._channel
            call = pbgrpc.JobServiceStub(channel).WatchJob(
                pb.WatchJobRequest(job_id=job_id, after_event_id=last_event_id),
                metadata=self._metadata,
            )
            opened_at = loop.time()
            progressed = final = False
            silent = False
            try:
                while True:
                    try:
                        # The scheduler sends the job at least every 15 s (watch_keepalive_s):
                        # a longer silence is a replica or a path that stopped answering.
                        async with asyncio.timeout(self._watch_silence_s):
                            response = await call.read()
                    except TimeoutError:
                        silent = True
                        self._reconnect(channel)
                        break
                    if response is grpc.aio.EOF:
                        break
                    update = WatchUpdate(
                        job=job_from_proto(response.job),
                        event=(
                            event_from_proto(response.event) if response.HasField("event") else None
                        ),
                    )
                    if update.event is not None:
                        last_event_id = update.event.event_id
                        progressed = True
                    final = update.job.state.terminal
                    if noticed and on_waiting is not None:
                        on_waiting("")  # answered again: the wait is over
                    noticed = False
                    yield update
                if final:
                    return
                # Ended before the job was final: a scheduler going down ends its streams.
                error: grpc.aio.AioRpcError | None = None
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise _error(err, self.target) from None
                error = err
            finally:
                call.cancel()
            now = loop.time()
            if silent:
                # Silent for watch_silence_s: an outage that began when it went quiet.
                unreachable_since = unreachable_since or now - self._watch_silence_s
                progressed = False
            if progressed or (not silent and now - opened_at >= _RECONNECT_MAX_DELAY_S):
                # The stream did work: this is a new outage, not more of the last one. (A
                # scheduler that answers with the job and then fails at once does not count,
                # so a flapping one still runs out the clock.)
                unreachable_since, delay_s = now, _RECONNECT_FIRST_DELAY_S
            elif unreachable_since is None:
                unreachable_since = now
            if (
                on_waiting is not None
                and not noticed
                and now - unreachable_since >= min(waiting_notice_s, reconnect_s)
            ):
                noticed = True
                if silent:
                    why = f"no answer for {self._watch_silence_s:g} s"
                elif error is not None:
                    why = (error.details() or error.code().name).splitlines()[0][:200]
                else:
                    why = "its stream keeps ending"
                on_waiting(
                    f"waiting for the scheduler at {self.target} to watch job {job_id} ({why});"
                    f" trying again for up to {reconnect_s:g} s"
                )
            if now - unreachable_since >= reconnect_s:
                if error is not None:
                    raise _error(error, self.target) from None
                gave_up = LorafleetError(
                    f"{self.target}: the watch of job {job_id} kept ending before it was final"
                )
                gave_up.retryable = True
                raise gave_up
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _RECONNECT_MAX_DELAY_S)

    async def upload_dir(self, directory: str | Path, *, prefix: str) -> builtins.list[str]:
        """Uploads the images (and `.txt` captions beside them) of a local folder under `prefix`.
        Every image is decoded first: a folder that is missing or holds no image, or an image
        file (by its suffix) that does not decode, is refused (`InvalidArgument` naming it)
        before anything is uploaded. Other files (a `notes.pdf`) are skipped, never uploaded:
        `read_folder(directory, skipped=names)` says which, as `lorafleet submit` prints."""
        files = await asyncio.to_thread(read_folder, directory)
        return await self.upload_files(files, prefix=prefix)

    async def upload_zip(self, path: str | Path, *, prefix: str) -> builtins.list[str]:
        """Uploads the images and `name.txt` captions inside a zip file under `prefix` (checked
        first: safe names, bounded sizes, every image decodes)."""
        files = await asyncio.to_thread(read_zip, path)
        return await self.upload_files(files, prefix=prefix)

    async def upload_url(
        self, url: str, *, prefix: str, allow_http_loopback: bool = False
    ) -> builtins.list[str]:
        """Downloads a zip from an https:// URL (bounded) and uploads what it holds, as
        `upload_zip`. `allow_http_loopback` admits plain http to a loopback address (tests)."""
        data = await fetch_zip(
            url, timeout_s=self._timeout_s * 10, allow_http_loopback=allow_http_loopback
        )
        files = await asyncio.to_thread(read_zip, data, field="images_url", name=url)
        return await self.upload_files(files, prefix=prefix)

    async def upload_files(
        self, files: Sequence[TrainingFile], *, prefix: str
    ) -> builtins.list[str]:
        """Uploads checked files (from `read_folder`, `read_zip`) under `prefix`."""
        if not files:
            raise InvalidArgument("images", "no files to upload")
        request = pb.CreateUploadUrlsRequest(prefix=prefix, file_names=[f.name for f in files])
        response: pb.CreateUploadUrlsResponse = await self._unary("CreateUploadUrls", request)
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout_s)
        ) as http:

            async def put(file: TrainingFile, url: str) -> None:
                async with http.put(url, data=file.data) as r:
                    if r.status >= 300:
                        raise StorageError(
                            f"upload of {file.name} failed: {r.status}", retryable=r.status >= 500
                        )

            await asyncio.gather(
                *(put(f, u.url) for f, u in zip(files, response.urls, strict=True))
            )
        return [u.key for u in response.urls]

    async def webhook_deliveries(self, job_id: str) -> builtins.list[pb.WebhookDelivery]:
        """The job's webhook delivery log (attempts, last status and error, delivered/gave up)."""
        response: pb.ListWebhookDeliveriesResponse = await self._unary(
            "ListWebhookDeliveries", pb.ListWebhookDeliveriesRequest(job_id=job_id)
        )
        return list(response.deliveries)

    async def artifacts(self, job_id: str) -> Artifacts:
        response: pb.GetJobArtifactsResponse = await self._unary(
            "GetJobArtifacts", pb.GetJobArtifactsRequest(job_id=job_id)
        )
        return Artifacts(
            result_url=response.result.url or None,
            result_urls={fmt: u.url for fmt, u in response.results_by_format.items()},
            checkpoints=[
                (checkpoint_from_proto(record), url.url)
                for record, url in zip(
                    response.checkpoint_records, response.checkpoints, strict=True
                )
            ],
            samples=[
                SampleImageInfo(
                    step=s.step,
                    prompt_index=s.prompt_index,
                    prompt=s.prompt,
                    image_index=s.image_index,
                    url=s.url.url,
                    sha256=s.sha256,
                )
                for s in response.samples
            ],
        )

    async def download_samples(self, job_id: str) -> builtins.list[tuple[SampleImageInfo, bytes]]:
        """Every stored validation image of the job with its bytes (sha256 checked)."""
        artifacts = await self.artifacts(job_id)

        async def fetch(info: SampleImageInfo) -> tuple[SampleImageInfo, bytes]:
            data = await self._fetch(info.url)
            if hashlib.sha256(data).hexdigest() != info.sha256:
                raise StorageError(
                    "a downloaded validation image does not match its sha256", retryable=True
                )
            return info, data

        return list(await asyncio.gather(*(fetch(i) for i in artifacts.samples)))

    async def request_samples(
        self,
        job_id: str,
        *,
        prompts: Sequence[str] = (),
        steps: Sequence[int] = (),
        negative_prompt: str = "",
        guidance_scale: float = 0.0,
        inference_steps: int = 0,
        num_images: int = 0,
        seed: int = 0,
    ) -> builtins.list[int]:
        """Queues sample tasks for a finished job (its result or kept checkpoints); zero values
        take the job's validation settings. Returns the steps queued."""
        response: pb.RequestSamplesResponse = await self._unary(
            "RequestSamples",
            pb.RequestSamplesRequest(
                job_id=job_id,
                prompts=list(prompts),
                steps=[_sample_value("steps", s) for s in steps],
                negative_prompt=_sample_value("negative_prompt", negative_prompt),
                guidance_scale=_sample_value("guidance_scale", guidance_scale),
                inference_steps=_sample_value("inference_steps", inference_steps),
                num_images=_sample_value("num_images", num_images),
                seed=_sample_value("seed", seed),
            ),
        )
        return list(response.steps)

    async def download_result(
        self, job_id: str, destination: str | Path, *, fmt: str | None = None
    ) -> Path:
        """Writes the final LoRA and checks its sha256: the file of format `fmt` ("diffusers":
        pytorch_lora_weights.safetensors, "kohya": pytorch_lora_weights_kohya.safetensors),
        or the job's main file (the diffusers one unless its output_format is kohya)."""
        job = await self.get(job_id)
        artifacts = await self.artifacts(job_id)
        if artifacts.result_url is None or job.result is None:
            raise FailedPrecondition(f"job {job_id} has no result (state {job.state.value})")
        files = job.result.files
        chosen = fmt or result_format(job.result.key)
        url = artifacts.result_urls.get(chosen) if fmt else artifacts.result_url
        if chosen not in files or url is None:
            raise FailedPrecondition(
                f"job {job_id} has no {chosen} result (output_format"
                f" {job.spec.output_format}; it has {', '.join(sorted(files))})"
            )
        data = await self._fetch(url)
        if hashlib.sha256(data).hexdigest() != files[chosen].sha256:
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
        if not chosen and artifacts.result_url is not None:
            raise FailedPrecondition(
                f"job {job_id} has finished and its checkpoints were deleted; its result is"
                f" the final LoRA: `lorafleet download {job_id}`"
            )
        if not chosen:
            kept = ", ".join(str(c.step) for c, _ in artifacts.checkpoints)
            raise NotFound(
                f"job {job_id} has no retained checkpoint"
                + (f" at step {step} (retained: {kept})" if step is not None else "")
            )
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

    def estimate(self, spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any) -> Estimate:
        return self._run(self._async.estimate(spec, **fields))

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

    def watch(
        self, job_id: str, *, after_event_id: int = 0, reconnect_s: float = 300.0
    ) -> Iterator[WatchUpdate]:
        return self._iterate(
            self._async.watch(job_id, after_event_id=after_event_id, reconnect_s=reconnect_s)
        )

    def upload_dir(self, directory: str | Path, *, prefix: str) -> builtins.list[str]:
        return self._run(self._async.upload_dir(directory, prefix=prefix))

    def upload_zip(self, path: str | Path, *, prefix: str) -> builtins.list[str]:
        return self._run(self._async.upload_zip(path, prefix=prefix))

    def upload_files(self, files: Sequence[TrainingFile], *, prefix: str) -> builtins.list[str]:
        return self._run(self._async.upload_files(files, prefix=prefix))

    def upload_url(
        self, url: str, *, prefix: str, allow_http_loopback: bool = False
    ) -> builtins.list[str]:
        return self._run(
            self._async.upload_url(url, prefix=prefix, allow_http_loopback=allow_http_loopback)
        )

    def artifacts(self, job_id: str) -> Artifacts:
        return self._run(self._async.artifacts(job_id))

    def webhook_deliveries(self, job_id: str) -> builtins.list[pb.WebhookDelivery]:
        return self._run(self._async.webhook_deliveries(job_id))

    def download_result(
        self, job_id: str, destination: str | Path, *, fmt: str | None = None
    ) -> Path:
        return self._run(self._async.download_result(job_id, destination, fmt=fmt))

    def download_checkpoint(self, job_id: str, step: int | None, destination: str | Path) -> Path:
        return self._run(self._async.download_checkpoint(job_id, step, destination))

    def download_samples(self, job_id: str) -> builtins.list[tuple[SampleImageInfo, bytes]]:
        return self._run(self._async.download_samples(job_id))

    def request_samples(
        self,
        job_id: str,
        *,
        prompts: Sequence[str] = (),
        steps: Sequence[int] = (),
        negative_prompt: str = "",
        guidance_scale: float = 0.0,
        inference_steps: int = 0,
        num_images: int = 0,
        seed: int = 0,
    ) -> builtins.list[int]:
        return self._run(
            self._async.request_samples(
                job_id,
                prompts=prompts,
                steps=steps,
                negative_prompt=negative_prompt,
                guidance_scale=guidance_scale,
                inference_steps=inference_steps,
                num_images=num_images,
                seed=seed,
            )
        )
