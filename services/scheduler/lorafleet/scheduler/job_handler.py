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

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lorafleet.core.errors import FailedPrecondition, InvalidArgument, NotFound
from lorafleet.core.fit import check_fits_fleet
from lorafleet.core.model import (
    MIN_PLAUSIBLE_S_PER_STEP,
    Job,
    JobEvent,
    JobState,
    SampleSettings,
    shape_prior_seconds,
    upload_key,
)
from lorafleet.core.model_refs import check_model_ref_shape
from lorafleet.core.spec import JobShape, JobSpec
from lorafleet.core.spec_checks import (
    FLUX2_NEGATIVE_PROMPT,
    check_path,
    check_sample_settings,
)
from lorafleet.ledger.ledger import Ledger, NewJob, ShapePace, WebhookDeliveryRecord
from lorafleet.scheduler.notifications import Notifications
from lorafleet.scheduler.paces import Pace
from lorafleet.scheduler.signing import Artifacts, UrlSigner
from lorafleet.scheduler.storage import ObjectStore, SignedUrl
from lorafleet.scheduler.webhooks import AddressPolicy

log = structlog.get_logger(__name__)
tracer = trace.get_tracer("lorafleet.scheduler")

MAX_BATCH = 1000
MAX_PAGE = 1000
MAX_EVENTS_PAGE = 10_000
MAX_UPLOAD_FILES = 1000


# With no measured pace, spend limits price a step at this many seconds per 1024x1024 image of
# batch, times 1.5 with text-encoder training (override: `estimate_prior_s_per_step`). About
# an SDXL LoRA step at 1024 px, batch 1, on the consumer 24 GB cards interruptible fleets are
# made of (an RTX 4090 runs 0.7 to 1 s, a 3090 1.3 to 1.5 s), erring slow: a prior that is too
# high refuses a submit a measurement would admit, one that is too low lets a key overrun.
PRIOR_S_PER_STEP = 1.5


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Expected time and cost of a job from the fleet's measured pace on jobs of its shape
    (0 s/step and 0 machines while too few machines have finished one: "no estimate")."""

    seconds_per_step: float
    # The provider-verified machines the figure rests on (one verified completion each, or more).
    samples: int
    seconds: float
    price_per_gpu_hour: float
    dollars: float
    spend_limit_dollars: float | None
    spent_dollars: float


@dataclass(frozen=True, kw_only=True)
class Submission:
    spec: JobSpec
    idempotency_key: str


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
        signer: UrlSigner,
        notifications: Notifications,
        webhook_policy: AddressPolicy | None = None,
        price_per_gpu_hour: float = 0.0,
        estimate_window_s: float = 7 * 86400.0,
        estimate_min_machines: int = 3,
        estimate_prior_s_per_step: float = PRIOR_S_PER_STEP,
        min_plausible_s_per_step: float = MIN_PLAUSIBLE_S_PER_STEP,
        fleet_max_vram_mb: int = 0,
        fleet_cpu_only: bool = False,
        watch_keepalive_s: float = 15.0,
    ) -> None:
        self._price_per_gpu_hour = price_per_gpu_hour
        # A watch with nothing new says so this often (the job as it is): a client tells a
        # quiet job from a replica or a path gone silent (AsyncClient watch_silence_s).
        self._watch_keepalive_s = watch_keepalive_s
        self._fleet_max_vram_mb = fleet_max_vram_mb
        self._fleet_cpu_only = fleet_cpu_only
        self._estimate_window_s = estimate_window_s
        self._estimate_min_machines = estimate_min_machines
        self._estimate_prior_s_per_step = estimate_prior_s_per_step
        self._min_plausible_s_per_step = min_plausible_s_per_step
        self._ledger = ledger
        self._storage = storage
        self._signer = signer
        self._notifications = notifications
        self._webhook_policy = webhook_policy or AddressPolicy()

    async def submit(
        self,
        owner: str,
        submissions: Sequence[Submission],
        *,
        api_key_id: str | None = None,
        batch: bool = False,
    ) -> list[Job]:
        """All or nothing: every spec is checked (and its data found) before any row is written.
        `batch`: the submissions came as SubmitJobs' `jobs`, so a field is named `jobs[i].spec...`
        even for a batch of one (as SubmitJobs' own checks name it)."""
        if not 1 <= len(submissions) <= MAX_BATCH:
            raise InvalidArgument("jobs", f"must hold 1 to {MAX_BATCH} jobs")
        # A batch usually shares its data prefixes: list each distinct one once.
        has_files: dict[str, bool] = {}
        for i, sub in enumerate(submissions):
            prefix = f"jobs[{i}].spec" if batch or len(submissions) > 1 else "spec"
            if len(sub.idempotency_key) > 200 or "\x00" in sub.idempotency_key:
                raise InvalidArgument(
                    prefix.replace("spec", "idempotency_key"), "at most 200 characters, no NUL"
                )
            self._check_for_this_fleet(sub.spec, prefix)
            await self._check_data(owner, sub.spec, prefix, has_files)
        if api_key_id is not None:
            await self._check_spend_limit(api_key_id, [s.spec for s in submissions])
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

    async def pace(
        self, shape: JobShape, *, api_key_id: str | None = None, admission: bool = False
    ) -> Pace:
        """Seconds per step of a job shape (`JobSpec.shape`: the figures of jobs with the same
        `shape.key`), from verified completions only (the ledger's clock
        from grant to a result the store verified, one figure per provider-verified machine,
        their median, at least `estimate_min_machines`): what a worker says of its own speed
        never prices anyone's job, and a completion faster than the plausibility floor
        (`min_plausible_s_per_step` scaled to the shape) is no training.

        Whose numbers: a tenant's own jobs (`api_key_id`'s) price its own estimates and
        submits. Without a figure of its own, the fleet's, bounded to within 2x of the prior
        (`estimate_prior_s_per_step`, which the operator pins for the fleet they run): a few
        machines of one holder, completing their own or anyone's jobs fast or slow, move
        another tenant's figure by at most 2x. For `admission` (spend limits) neither figure is
        above the prior: another tenant's numbers never refuse a submit, and nor do the
        machines that ran a tenant's own jobs (a holder's, holding them slowly, set its own
        figure). With no figure at all, the prior. The prior and the floor are scaled to the
        shape by one rule (`core.model.shape_prior_seconds`: pixels, images, text encoders, the
        model family, gradient checkpointing, a quantized base)."""
        prior = shape_prior_seconds(self._estimate_prior_s_per_step, shape)
        floor = shape_prior_seconds(self._min_plausible_s_per_step, shape)

        async def measure(key: str | None) -> ShapePace:
            return await self._ledger.pace_for_shape(
                window_s=self._estimate_window_s,
                shape_key=shape.key,
                min_seconds_per_step=floor,
                api_key_id=key,
            )

        def enough(m: ShapePace) -> bool:
            return m.machines >= self._estimate_min_machines and m.seconds_per_step > 0

        if api_key_id:
            own = await measure(api_key_id)
            if enough(own):
                seconds = min(own.seconds_per_step, prior) if admission else own.seconds_per_step
                return Pace(seconds_per_step=seconds, machines=own.machines, measured=True)
        fleet = await measure(None)
        if enough(fleet):
            high = prior if admission else 2.0 * prior
            bounded = min(max(fleet.seconds_per_step, prior / 2.0), high)
            return Pace(seconds_per_step=bounded, machines=fleet.machines, measured=True)
        return Pace(seconds_per_step=prior, machines=fleet.machines, measured=False)

    async def spec_pace(
        self, spec: JobSpec, *, api_key_id: str | None = None, admission: bool = False
    ) -> Pace:
        """`pace` of the spec's shape (`JobSpec.shape`)."""
        return await self.pace(spec.shape, api_key_id=api_key_id, admission=admission)

    def _check_for_this_fleet(self, spec: JobSpec, prefix: str) -> None:
        """What submit refuses of a spec beyond its own checks, from this fleet's settings;
        an estimate refuses the same, so that it never prices a job submit would refuse."""
        if spec.webhook_url:
            self._webhook_policy.check_url(spec.webhook_url, f"{prefix}.webhook.url")
        # A job no node of the fleet can hold would wait in the queue for ever.
        check_fits_fleet(
            spec, self._fleet_max_vram_mb, cpu_only=self._fleet_cpu_only, prefix=prefix
        )
        # A relative local path can never name the same folder on a worker: refused here,
        # before it becomes a job that could only fail on the fleet.
        for field in ("base_model", "vae_model"):
            check_model_ref_shape(f"{prefix}.{field}", getattr(spec, field))

    async def estimate(self, spec: JobSpec, *, api_key_id: str | None) -> Estimate:
        """max_train_steps x the measured pace on jobs of the same shape (the key's own, else
        the fleet's within 2x of the prior: `pace`), priced; no estimate (0) while too few
        machines have measured it. A spec submit would refuse for this fleet is refused here
        too (its data and spend limit aside: an estimate comes before both)."""
        self._check_for_this_fleet(spec, "spec")
        pace = await self.spec_pace(spec, api_key_id=api_key_id)
        seconds_per_step = pace.seconds_per_step if pace.measured else 0.0
        seconds = spec.max_train_steps * seconds_per_step
        price = self._price_per_gpu_hour
        spending = await self._ledger.key_spending(api_key_id) if api_key_id else None
        return Estimate(
            seconds_per_step=seconds_per_step,
            samples=pace.machines if pace.measured else 0,
            seconds=seconds,
            price_per_gpu_hour=price,
            dollars=seconds * price / 3600,
            spend_limit_dollars=spending.spend_limit_dollars if spending else None,
            spent_dollars=(spending.gpu_seconds * price / 3600) if spending else 0.0,
        )

    async def _check_spend_limit(self, api_key_id: str, specs: Sequence[JobSpec]) -> None:
        """Billed so far, plus the estimated rest of the key's unfinished jobs, plus this submit
        must stay within the key's limit (so many quick submits cannot outrun the billing).
        Priced by the key's own figures, else the fleet's no higher than the prior (`pace`,
        admission): another tenant's numbers never refuse a submit. Unmeasured shapes are
        priced at the prior, never at nothing."""
        spending = await self._ledger.key_spending(api_key_id)
        limit = spending.spend_limit_dollars
        if limit is None:
            return
        price = self._price_per_gpu_hour
        spent = spending.gpu_seconds * price / 3600
        pending_s = 0.0
        priced_by_prior = False
        for work in await self._ledger.key_unfinished_work(api_key_id):
            pace = await self.pace(work.shape, api_key_id=api_key_id, admission=True)
            pending_s += work.steps * pace.seconds_per_step
            priced_by_prior |= not pace.measured
        pending = pending_s * price / 3600
        expected_s = 0.0
        for spec in specs:
            pace = await self.spec_pace(spec, api_key_id=api_key_id, admission=True)
            expected_s += spec.max_train_steps * pace.seconds_per_step
            priced_by_prior |= not pace.measured
        expected = expected_s * price / 3600
        if spent + pending + expected > limit + 1e-9:  # a cent-exact fit is within
            prior = (
                f" (a job shape this fleet has not measured yet is priced at the prior,"
                f" {self._estimate_prior_s_per_step:g} s per 1024x1024 image step)"
                if priced_by_prior
                else ""
            )
            raise FailedPrecondition(
                f"spend limit: this API key's limit is ${limit:.2f}; its jobs have used"
                f" ${spent:.2f}, its unfinished jobs are estimated at ${pending:.2f} more, and"
                f" this submit at ${expected:.2f}{prior} (wait for jobs to finish, cancel some,"
                " or ask for a key with a higher limit)"
            )

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
        """The job now, then each new event with the job as it stands; ends when it is final and
        none of its sample tasks (validation images) is still to run."""
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
                if job.state.terminal and not await self._ledger.samples_pending(job.job_id):
                    return
                try:
                    async with asyncio.timeout(self._watch_keepalive_s):
                        await changed.wait()
                except TimeoutError:
                    job = await self.get(owner, job_id)
                    yield job, None
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
        return await self._signer.data_upload_urls(owner, prefix, file_names)

    async def webhook_deliveries(
        self, owner: str, job_id: str
    ) -> builtins.list[WebhookDeliveryRecord]:
        job = await self.get(owner, job_id)
        return await self._ledger.list_webhook_deliveries(job.job_id)

    async def artifacts(self, owner: str, job_id: str) -> Artifacts:
        job = await self.get(owner, job_id)
        checkpoints = await self._ledger.live_checkpoints(job.job_id)
        sample_tasks = await self._ledger.sample_tasks_of_job(job.job_id)
        if job.result is None and not checkpoints and not sample_tasks:
            if job.state.terminal:
                raise FailedPrecondition(
                    f"job {job_id} is {job.state.value.lower()} without a result; its"
                    " checkpoints were deleted when it finished"
                )
            raise FailedPrecondition(f"job {job_id} has no result or checkpoint yet")
        return await self._signer.artifacts(job, checkpoints, sample_tasks)

    async def request_samples(
        self,
        owner: str,
        job_id: str,
        *,
        prompts: Sequence[str],
        steps: Sequence[int],
        negative_prompt: str,
        guidance_scale: float,
        inference_steps: int,
        num_images: int,
        seed: int,
    ) -> builtins.list[int]:
        """Sample tasks on request for a finished job: against its result or a kept
        checkpoint. Zero values take the job's validation settings; each value has the bounds
        of its job spec field (a step those of max_train_steps), checked in any job state."""
        job = await self.get(owner, job_id)
        spec = job.spec
        if negative_prompt and spec.family == "flux2":
            raise InvalidArgument("negative_prompt", FLUX2_NEGATIVE_PROMPT)
        settings = SampleSettings(
            prompts=tuple(prompts) or spec.sample_prompts,
            negative_prompt=negative_prompt or spec.validation_negative_prompt,
            guidance_scale=guidance_scale or spec.validation_guidance_scale,
            inference_steps=inference_steps or spec.validation_inference_steps,
            seed=seed or spec.seed,
            resolution=spec.resolution,
            images_per_prompt=num_images or spec.num_validation_images,
        )
        if not settings.prompts:
            raise InvalidArgument("prompts", "is required (the job has no validation prompt)")
        check_sample_settings(
            prompts=settings.prompts,
            negative_prompt=settings.negative_prompt,
            guidance_scale=settings.guidance_scale,
            inference_steps=settings.inference_steps,
            num_images=settings.images_per_prompt,
            seed=settings.seed,
            steps=steps,
            prefix="",
        )
        if job.state is not JobState.SUCCEEDED or job.result is None:
            raise FailedPrecondition(f"job {job_id} has no result yet (state {job.state.value})")
        wanted = sorted(set(steps)) or [job.progress.step]
        queued = await self._ledger.request_samples(job.job_id, owner, wanted, settings)
        missing = sorted(set(wanted) - set(queued))
        if missing:
            raise FailedPrecondition(
                f"steps: no kept checkpoint or result at step {missing[0]} (the result's step is"
                f" {job.progress.step})"
            )
        return queued
