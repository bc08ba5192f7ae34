"""Thin gRPC servicers: decode the request, call one handler, map domain errors to status codes.

JobService → `job_handler.JobHandler`; WorkerService.Connect → `worker_handler.WorkerHandler`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc
import structlog

from lorafleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    LedgerUnavailable,
    LorafleetError,
    NotFound,
    ResourceExhausted,
    StorageError,
    Unauthenticated,
)
from lorafleet.core.serde import (
    checkpoint_report_from_proto,
    checkpoint_to_proto,
    class_images_report_from_proto,
    draining_report_from_proto,
    event_to_proto,
    failure_report_from_proto,
    heartbeat_from_proto,
    hello_from_proto,
    job_state_from_proto,
    job_to_proto,
    notice_report_from_proto,
    ready_from_proto,
    samples_report_from_proto,
    spec_from_proto,
    success_report_from_proto,
    timestamp,
    urls_request_from_proto,
)
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.ledger.ledger import LedgerError
from lorafleet.scheduler.auth import ApiKeyAuthenticator, Principal, bearer, check_worker_token
from lorafleet.scheduler.job_handler import JobHandler, Submission
from lorafleet.scheduler.sessions import WorkerSession, peer_source
from lorafleet.scheduler.worker_handler import WorkerHandler

log = structlog.get_logger(__name__)
T = TypeVar("T")


# gRPC's own retry hint (honoured by clients with a retry policy): try again after a second.
RETRY_HINT = (("grpc-retry-pushback-ms", "1000"),)


async def abort_for(context: grpc.aio.ServicerContext[object, object], exc: Exception) -> NoReturn:
    """Maps lorafleet's error tree onto status codes; anything else is an internal error."""
    if isinstance(exc, InvalidArgument):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, NotFound):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, Unauthenticated):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
    if isinstance(exc, FailedPrecondition):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, AlreadyExists):
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    if isinstance(exc, ResourceExhausted):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), RETRY_HINT)
    if isinstance(exc, (LedgerUnavailable, StorageError)) and exc.retryable:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, f"{exc}; retry in a few seconds", RETRY_HINT
        )
    if isinstance(exc, LedgerError):
        # A bug or a misconfiguration behind the ledger: its SQL details are for the log only.
        log.error("ledger error", exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the scheduler log")
    if isinstance(exc, LorafleetError):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    log.error("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the scheduler log")
    raise AssertionError("context.abort returned")  # it always raises


def _spec(msg: pb.JobSpec, prefix: str) -> JobSpec:
    try:
        return spec_from_proto(msg)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{prefix}.{exc.field}", exc.reason) from None


class JobServicer(pbgrpc.JobServiceServicer):
    def __init__(self, handler: JobHandler, auth: ApiKeyAuthenticator) -> None:
        self._handler = handler
        self._auth = auth

    async def _call(
        self,
        context: grpc.aio.ServicerContext[object, object],
        fn: Callable[[Principal], Awaitable[T]],
    ) -> T:
        try:
            principal = await self._auth.principal(context.invocation_metadata() or ())
            return await fn(principal)
        except Exception as exc:  # every error is mapped to a status
            await abort_for(context, exc)

    async def SubmitJob(
        self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.SubmitJobResponse:
        async def run(caller: Principal) -> pb.SubmitJobResponse:
            sub = Submission(
                spec=_spec(request.spec, "spec"), idempotency_key=request.idempotency_key
            )
            (job,) = await self._handler.submit(caller.owner, [sub], api_key_id=caller.key_id)
            return pb.SubmitJobResponse(job=job_to_proto(job))

        return await self._call(context, run)

    async def SubmitJobs(
        self, request: pb.SubmitJobsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.SubmitJobsResponse:
        async def run(caller: Principal) -> pb.SubmitJobsResponse:
            subs = [
                Submission(spec=_spec(r.spec, f"jobs[{i}].spec"), idempotency_key=r.idempotency_key)
                for i, r in enumerate(request.jobs)
            ]
            jobs = await self._handler.submit(
                caller.owner, subs, api_key_id=caller.key_id, batch=True
            )
            return pb.SubmitJobsResponse(jobs=[job_to_proto(j) for j in jobs])

        return await self._call(context, run)

    async def EstimateJob(
        self, request: pb.EstimateJobRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.EstimateJobResponse:
        async def run(caller: Principal) -> pb.EstimateJobResponse:
            e = await self._handler.estimate(_spec(request.spec, "spec"), api_key_id=caller.key_id)
            return pb.EstimateJobResponse(
                seconds_per_step=e.seconds_per_step,
                samples=e.samples,
                seconds=e.seconds,
                price_per_gpu_hour=e.price_per_gpu_hour,
                dollars=e.dollars,
                spend_limit_dollars=e.spend_limit_dollars or 0.0,
                spent_dollars=e.spent_dollars,
            )

        return await self._call(context, run)

    async def GetJob(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetJobResponse:
        async def run(caller: Principal) -> pb.GetJobResponse:
            return pb.GetJobResponse(
                job=job_to_proto(await self._handler.get(caller.owner, request.job_id))
            )

        return await self._call(context, run)

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ListJobsResponse:
        async def run(caller: Principal) -> pb.ListJobsResponse:
            states = [job_state_from_proto(s, f"states[{i}]") for i, s in enumerate(request.states)]
            jobs, token = await self._handler.list_jobs(
                caller.owner,
                states=states,
                labels=dict(request.labels),
                page_size=request.page_size,
                page_token=request.page_token,
            )
            return pb.ListJobsResponse(jobs=[job_to_proto(j) for j in jobs], next_page_token=token)

        return await self._call(context, run)

    async def CancelJob(
        self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.CancelJobResponse:
        async def run(caller: Principal) -> pb.CancelJobResponse:
            job = await self._handler.cancel(caller.owner, request.job_id)
            return pb.CancelJobResponse(job=job_to_proto(job))

        return await self._call(context, run)

    async def WatchJob(
        self, request: pb.WatchJobRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[pb.WatchJobResponse]:
        try:
            caller = await self._auth.principal(context.invocation_metadata() or ())
            stream = self._handler.watch(
                caller.owner, request.job_id, after_event_id=request.after_event_id
            )
            async for job, event in stream:
                response = pb.WatchJobResponse(job=job_to_proto(job))
                if event is not None:
                    response.event.CopyFrom(event_to_proto(event))
                yield response
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await abort_for(context, exc)

    async def ListJobEvents(
        self, request: pb.ListJobEventsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ListJobEventsResponse:
        async def run(caller: Principal) -> pb.ListJobEventsResponse:
            events, after = await self._handler.events(
                caller.owner,
                request.job_id,
                after_event_id=request.after_event_id,
                page_size=request.page_size,
            )
            return pb.ListJobEventsResponse(
                events=[event_to_proto(e) for e in events], next_after_event_id=after
            )

        return await self._call(context, run)

    async def CreateUploadUrls(
        self, request: pb.CreateUploadUrlsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.CreateUploadUrlsResponse:
        async def run(caller: Principal) -> pb.CreateUploadUrlsResponse:
            urls = await self._handler.upload_urls(
                caller.owner, request.prefix, list(request.file_names)
            )
            return pb.CreateUploadUrlsResponse(
                urls=[
                    pb.SignedUrl(
                        key=u.key, url=u.url, method=u.method, expires_at=timestamp(u.expires_at)
                    )
                    for u in urls
                ]
            )

        return await self._call(context, run)

    async def GetJobArtifacts(
        self, request: pb.GetJobArtifactsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetJobArtifactsResponse:
        async def run(caller: Principal) -> pb.GetJobArtifactsResponse:

            artifacts = await self._handler.artifacts(caller.owner, request.job_id)
            response = pb.GetJobArtifactsResponse()
            if artifacts.result is not None:
                r = artifacts.result
                response.result.CopyFrom(
                    pb.SignedUrl(
                        key=r.key, url=r.url, method=r.method, expires_at=timestamp(r.expires_at)
                    )
                )
            for fmt, u in artifacts.results_by_format.items():
                response.results_by_format[fmt].CopyFrom(
                    pb.SignedUrl(
                        key=u.key, url=u.url, method=u.method, expires_at=timestamp(u.expires_at)
                    )
                )
            for checkpoint, url in artifacts.checkpoints:
                response.checkpoints.append(
                    pb.SignedUrl(
                        key=url.key,
                        url=url.url,
                        method=url.method,
                        expires_at=timestamp(url.expires_at),
                    )
                )
                response.checkpoint_records.append(checkpoint_to_proto(checkpoint))
            for step, prompt, image, url in artifacts.samples:
                response.samples.append(
                    pb.SampleImage(
                        step=step,
                        prompt_index=image.prompt_index,
                        prompt=prompt,
                        image_index=image.image_index,
                        url=pb.SignedUrl(
                            key=url.key,
                            url=url.url,
                            method=url.method,
                            expires_at=timestamp(url.expires_at),
                        ),
                        size_bytes=image.size_bytes,
                        sha256=image.sha256,
                    )
                )
            return response

        return await self._call(context, run)

    async def ListWebhookDeliveries(
        self,
        request: pb.ListWebhookDeliveriesRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> pb.ListWebhookDeliveriesResponse:
        async def run(caller: Principal) -> pb.ListWebhookDeliveriesResponse:
            rows = await self._handler.webhook_deliveries(caller.owner, request.job_id)
            return pb.ListWebhookDeliveriesResponse(
                deliveries=[
                    pb.WebhookDelivery(
                        delivery_id=r.delivery_id,
                        event=r.event,
                        url=r.url,
                        attempts=r.attempts,
                        last_status=r.last_status or 0,
                        last_error=r.last_error or "",
                        delivered_at=timestamp(r.delivered_at),
                        gave_up_at=timestamp(r.gave_up_at),
                        created_at=timestamp(r.created_at),
                        next_attempt_at=timestamp(r.next_attempt_at),
                    )
                    for r in rows
                ]
            )

        return await self._call(context, run)

    async def RequestSamples(
        self, request: pb.RequestSamplesRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.RequestSamplesResponse:
        async def run(caller: Principal) -> pb.RequestSamplesResponse:
            steps = await self._handler.request_samples(
                caller.owner,
                request.job_id,
                prompts=list(request.prompts),
                steps=list(request.steps),
                negative_prompt=request.negative_prompt,
                guidance_scale=request.guidance_scale,
                inference_steps=request.inference_steps,
                num_images=request.num_images,
                seed=request.seed,
            )
            return pb.RequestSamplesResponse(steps=steps)

        return await self._call(context, run)


def _heard(future: asyncio.Future[object]) -> None:
    """Retrieves a finished write's exception, if any, so that asyncio never reports it as
    unretrieved (see `WorkerServicer.Connect`)."""
    if not future.cancelled():
        future.exception()


class WorkerServicer(fgrpc.WorkerServiceServicer):
    """The worker stream: checks the token and the Hello, then decodes each message (serde) and
    calls one `WorkerHandler` method on domain values; replies queued on the session's outbox
    are written back here."""

    def __init__(
        self, handler: WorkerHandler, *, worker_token: str, hello_timeout_s: float
    ) -> None:
        self._handler = handler
        self._worker_token = worker_token
        self._hello_timeout_s = hello_timeout_s

    async def _receive(self, session: WorkerSession, request: fpb.ConnectRequest) -> None:
        """One worker message; raises InvalidArgument for a malformed one, ResourceExhausted
        past the stream's message rate."""
        if not session.messages.take():
            raise ResourceExhausted(
                f"message: more than {session.bounds.messages_per_s:g} messages per second"
            )
        handler = self._handler
        kind = request.WhichOneof("message")
        if kind == "ping":
            # Answered here, in the stream's order: a Pong says this replica is reading and
            # acting on this worker's messages, which a frozen process or a silent path cannot
            # fake (TCP and HTTP/2 keepalive can be answered by a kernel or a middlebox).
            session.send(fpb.ConnectResponse(pong=fpb.Pong(nonce=request.ping.nonce)))
        elif kind == "ready":
            await handler.ready(session, ready_from_proto(request.ready))
        elif kind == "heartbeat":
            await handler.heartbeat(session, heartbeat_from_proto(request.heartbeat))
        elif kind == "urls_requested":
            await handler.urls_requested(session, urls_request_from_proto(request.urls_requested))
        elif kind == "checkpoint_committed":
            report = checkpoint_report_from_proto(request.checkpoint_committed)
            await handler.checkpoint_committed(session, report)
        elif kind == "class_images_committed":
            class_images = class_images_report_from_proto(request.class_images_committed)
            await handler.class_images_committed(session, class_images)
        elif kind == "job_succeeded":
            await handler.job_succeeded(session, success_report_from_proto(request.job_succeeded))
        elif kind == "job_failed":
            await handler.job_failed(session, failure_report_from_proto(request.job_failed))
        elif kind == "draining":
            await handler.draining(session, draining_report_from_proto(request.draining))
        elif kind == "notice":
            await handler.notice(session, notice_report_from_proto(request.notice))
        elif kind == "samples_stored":
            await handler.samples_stored(session, samples_report_from_proto(request.samples_stored))
        elif kind == "hello":
            raise InvalidArgument("hello", "sent twice on one stream")
        else:
            raise InvalidArgument("message", "empty or unknown message")

    async def Connect(  # type: ignore[override]  # writes with context.write, see below
        self,
        request_iterator: AsyncIterator[fpb.ConnectRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> None:
        # Bounds per token holder, not only per stream: a reconnect loop opens a new stream
        # each time (streams per source address, Hellos per worker token, log lines per source).
        source = peer_source(context.peer())
        try:
            self._handler.admit_stream(source)
            metadata = context.invocation_metadata() or ()
            check_worker_token(metadata, self._worker_token)
            async with asyncio.timeout(self._hello_timeout_s):
                first = await anext(request_iterator)
            if first.WhichOneof("message") != "hello":
                raise InvalidArgument("hello", "the first message on the stream must be Hello")
            hello = hello_from_proto(first.hello)
            session = await self._handler.connect(
                hello, worker_token=bearer(metadata), source=source
            )
        except (TimeoutError, StopAsyncIteration):
            self._handler.refused(source, "hello: not received in time")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "hello: not received in time")
        except LorafleetError as exc:
            self._handler.refused(source, str(exc)[:200])
            await abort_for(context, exc)
        except Exception as exc:
            await abort_for(context, exc)

        failure: list[Exception] = []

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await self._receive(session, request)
            except Exception as exc:  # reported on the stream below
                failure.append(exc)
            finally:
                self._handler.disconnected(session)

        reader = asyncio.create_task(read())
        try:
            while (message := await session.outbox.get()) is not None:
                # A write waits for the worker to read (flow control). A worker that never reads
                # fills the bounded outbox meanwhile; then the write is given up and the stream
                # ends, so no unread reply is kept anywhere.
                write = asyncio.ensure_future(context.write(message))
                # A stream that ends mid-write (its connection gone: a dropped path, a thawed
                # replica whose workers left) cancels this handler with the write still
                # pending; it fails later with nobody awaiting it, which asyncio would log at
                # ERROR. Its outcome is heard here; `write.result()` below still raises.
                write.add_done_callback(_heard)
                overflow = asyncio.ensure_future(session.overflowing.wait())
                try:
                    await asyncio.wait([write, overflow], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    overflow.cancel()
                if not write.done():
                    write.cancel()
                    await asyncio.gather(write, return_exceptions=True)
                    break
                write.result()
        finally:
            self._handler.disconnected(session)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if session.overflowed:
            failure.insert(
                0,
                ResourceExhausted(
                    f"the worker left {session.bounds.outbox_limit} replies unread; disconnected"
                ),
            )
        if failure:
            await abort_for(context, failure[0])
