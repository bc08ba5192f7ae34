"""JobService logic on domain values: the servicer validates protos and calls these."""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lorafleet.errors import FailedPrecondition, InvalidArgument, NotFound
from lorafleet.model import Checkpoint, Job, JobEvent, JobState, upload_key
from lorafleet.scheduler.ledger import Ledger, NewJob
from lorafleet.scheduler.notifications import Notifications
from lorafleet.scheduler.storage import ObjectStore, SignedUrl
from lorafleet.spec import JobSpec, check_path

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.scheduler")

MAX_BATCH = 1000
MAX_PAGE = 1000
MAX_EVENTS_PAGE = 10_000
MAX_UPLOAD_FILES = 1000


@dataclass(frozen=True, kw_only=True)
class Submission:
    spec: JobSpec
    idempotency_key: str


@dataclass(frozen=True, kw_only=True)
class Artifacts:
    result: SignedUrl | None
    checkpoints: list[tuple[Checkpoint, SignedUrl]]


def _check_job_id(job_id: str, field: str = "job_id") -> str:
    try:
        return str(uuid.UUID(job_id))
    except ValueError:
        raise InvalidArgument(field, f"must be a job id (a UUID), got {job_id[:64]!r}") from None


def encode_page_token(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), job.job_id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_page_token(token: str) -> tuple[datetime, str]:
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return datetime.fromisoformat(created), str(uuid.UUID(job_id))
    except (ValueError, TypeError):
        raise InvalidArgument("page_token", "not a token from a previous ListJobs") from None


class JobHandler:
    def __init__(
        self,
        *,
        ledger: Ledger,
        storage: ObjectStore,
        notifications: Notifications,
        url_ttl_s: int,
    ) -> None:
        self._ledger = ledger
        self._storage = storage
        self._notifications = notifications
        self._url_ttl_s = url_ttl_s

    async def submit(
        self, owner: str, submissions: Sequence[Submission], *, api_key_id: str | None = None
    ) -> list[Job]:
        """All or nothing: every spec is checked (and its data found) before any row is written."""
        if not 1 <= len(submissions) <= MAX_BATCH:
            raise InvalidArgument("jobs", f"must hold 1 to {MAX_BATCH} jobs")
        # A batch usually shares its data prefixes: list each distinct one once.
        has_files: dict[str, bool] = {}
        for i, sub in enumerate(submissions):
            prefix = "spec" if len(submissions) == 1 else f"jobs[{i}].spec"
            if len(sub.idempotency_key) > 200 or "\x00" in sub.idempotency_key:
                raise InvalidArgument(
                    prefix.replace("spec", "idempotency_key"), "at most 200 characters, no NUL"
                )
            await self._check_data(owner, sub.spec, prefix, has_files)
        with tracer.start_as_current_span("lorafleet.submit", attributes={"owner": owner}) as span:
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier)
            new = [
                NewJob(
                    job_id=str(uuid.uuid4()),
                    spec=sub.spec,
                    idempotency_key=sub.idempotency_key,
                    traceparent=carrier.get("traceparent", ""),
                )
                for sub in submissions
            ]
            jobs = await self._ledger.insert_jobs(owner, new, api_key_id=api_key_id)
            span.set_attribute("lorafleet.job_ids", [j.job_id for j in jobs])
        for job in jobs:
            log.info("job submitted", job_id=job.job_id, owner=owner)
        return jobs

    async def _check_data(
        self, owner: str, spec: JobSpec, prefix: str, has_files: dict[str, bool]
    ) -> None:
        async def exists(data_prefix: str) -> bool:
            if data_prefix not in has_files:
                listed = await self._storage.list(upload_key(owner, data_prefix))
                has_files[data_prefix] = bool(listed)
            return has_files[data_prefix]

        if not await exists(spec.instance_data_prefix):
            raise InvalidArgument(
                f"{prefix}.instance_data_prefix",
                f"no files under {spec.instance_data_prefix!r}: upload the images first",
            )
        if spec.class_data_prefix and not await exists(spec.class_data_prefix):
            raise InvalidArgument(
                f"{prefix}.class_data_prefix", f"no files under {spec.class_data_prefix!r}"
            )

    async def get(self, owner: str, job_id: str) -> Job:
        job = await self._ledger.get_job(_check_job_id(job_id), owner)
        if job is None:
            raise NotFound(f"job {job_id} not found")
        return job

    async def list_jobs(
        self,
        owner: str,
        *,
        states: Sequence[JobState],
        labels: Mapping[str, str],
        page_size: int,
        page_token: str,
    ) -> tuple[list[Job], str]:
        if page_size < 0 or page_size > MAX_PAGE:
            raise InvalidArgument("page_size", f"must be between 1 and {MAX_PAGE}")
        limit = page_size or 100
        after = decode_page_token(page_token) if page_token else None
        for key, value in labels.items():
            if "\x00" in key or "\x00" in value:
                raise InvalidArgument("labels", "must not contain NUL characters")
        jobs = await self._ledger.list_jobs(
            owner, states=states, labels=labels, after=after, limit=limit + 1
        )
        next_token = encode_page_token(jobs[limit - 1]) if len(jobs) > limit else ""
        return jobs[:limit], next_token

    async def cancel(self, owner: str, job_id: str) -> Job:
        canceled = await self._ledger.cancel_job(_check_job_id(job_id), owner)
        if canceled is not None:
            log.info("job canceled", job_id=job_id, owner=owner)
            return canceled
        return await self.get(owner, job_id)  # already final (idempotent), or NotFound

    async def events(
        self, owner: str, job_id: str, *, after_event_id: int, page_size: int
    ) -> tuple[builtins.list[JobEvent], int]:
        if page_size < 0 or page_size > MAX_EVENTS_PAGE:
            raise InvalidArgument("page_size", f"must be between 1 and {MAX_EVENTS_PAGE}")
        if after_event_id < 0:
            raise InvalidArgument("after_event_id", "must not be negative")
        await self.get(owner, job_id)
        limit = page_size or 1000
        events = await self._ledger.list_events(job_id, after_event_id, limit)
        return events, (events[-1].event_id if len(events) == limit else 0)

    async def watch(
        self, owner: str, job_id: str, *, after_event_id: int
    ) -> AsyncIterator[tuple[Job, JobEvent | None]]:
        """The job now, then each new event with the job as it stands; ends when it is final."""
        if after_event_id < 0:
            raise InvalidArgument("after_event_id", "must not be negative")
        job = await self.get(owner, job_id)
        # Subscribe before reading, so an event committed in between still wakes us.
        changed = self._notifications.watch_job(job.job_id)
        try:
            yield job, None
            last = after_event_id
            while True:
                changed.clear()
                events = await self._ledger.list_events(job.job_id, last, 500)
                if events:
                    job = await self.get(owner, job_id)
                    for event in events:
                        yield job, event
                    last = events[-1].event_id
                    continue
                if job.state.terminal:
                    return
                await changed.wait()
        finally:
            self._notifications.unwatch_job(job.job_id, changed)

    async def upload_urls(
        self, owner: str, prefix: str, file_names: Sequence[str]
    ) -> builtins.list[SignedUrl]:
        check_path("prefix", prefix)
        if not 1 <= len(file_names) <= MAX_UPLOAD_FILES:
            raise InvalidArgument("file_names", f"must hold 1 to {MAX_UPLOAD_FILES} names")
        for i, name in enumerate(file_names):
            check_path(f"file_names[{i}]", name)
        return await asyncio.gather(
            *(
                self._storage.presign_put(upload_key(owner, prefix, name), ttl_s=self._url_ttl_s)
                for name in file_names
            )
        )

    async def webhook_deliveries(self, owner: str, job_id: str) -> builtins.list[dict[str, Any]]:
        job = await self.get(owner, job_id)
        return await self._ledger.list_webhook_deliveries(job.job_id)

    async def artifacts(self, owner: str, job_id: str) -> Artifacts:
        job = await self.get(owner, job_id)
        checkpoints = await self._ledger.live_checkpoints(job.job_id)
        if job.result is None and not checkpoints:
            raise FailedPrecondition(f"job {job_id} has no result or checkpoint yet")
        result = (
            await self._storage.presign_get(job.result.key, ttl_s=self._url_ttl_s)
            if job.result is not None
            else None
        )
        urls = await asyncio.gather(
            *(self._storage.presign_get(c.key, ttl_s=self._url_ttl_s) for c in checkpoints)
        )
        return Artifacts(result=result, checkpoints=list(zip(checkpoints, urls, strict=True)))
