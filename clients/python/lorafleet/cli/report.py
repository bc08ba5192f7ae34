"""What a batch of jobs took: outcomes, wall time, speed, nodes needed, GPU time and cost.

For the jobs matching some labels and/or created in a time range:

* jobs by state, and how many were interrupted (a lease expired, drained or failed);
* wall time (submit to finish, finished jobs), queue time (submit to first lease) and seconds
  per step: count, mean, median, min, max;
* nodes needed: how many jobs held leases on 1, 2 or 3+ distinct machines (and how many never
  got one);
* billable GPU-seconds (`Job.gpu_seconds`, the ledger's own sum over leases) and their cost at a
  price per GPU-hour: in all, per job, per succeeded job and per step, where the steps are the
  `max_train_steps` of the jobs that succeeded (so the wasted work of failed and interrupted
  attempts is charged to the results it was spent on).

Entry points (the CLI calls `report_command`, then `format_report` or `report_to_json`):

    build_report(jobs, events_by_job, price_per_gpu_hour, *, labels=None, since=None,
                 until=None) -> Report
    format_report(report, *, per_job=False) -> str
    report_to_json(report) -> dict[str, Any]
    async report_command(client, *, labels=None, since=None, until=None,
                         price_per_gpu_hour) -> Report
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from lorafleet.cli.timeline import format_duration, leases_from_events
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.model import EventKind, Job, JobEvent, JobState

if TYPE_CHECKING:
    from lorafleet.client import AsyncClient

__all__ = [
    "JobLine",
    "NodeCounts",
    "Report",
    "Summary",
    "build_report",
    "format_report",
    "report_command",
    "report_to_json",
]

# Events are read for this many jobs at once: enough to hide round trips, few enough not to
# crowd the scheduler.
_EVENT_FETCH_CONCURRENCY = 8


@dataclass(frozen=True, kw_only=True)
class Summary:
    """count, mean, median, min and max of one measure over the jobs that have it."""

    count: int
    mean: float
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Summary | None:
        """None when no job has the measure (a table of zeros would read as a measurement)."""
        sample = [v for v in values if v is not None]
        if not sample:
            return None
        return cls(
            count=len(sample),
            mean=statistics.fmean(sample),
            median=statistics.median(sample),
            min=min(sample),
            max=max(sample),
        )


@dataclass(frozen=True, kw_only=True)
class JobLine:
    """One job's figures."""

    job_id: str
    state: JobState
    created_at: datetime
    finished_at: datetime | None
    steps: int  # max_train_steps
    wall_s: float | None  # submit to finish; None until it finishes
    queue_s: float | None  # submit to first lease; None if it never got one
    seconds_per_step: float | None
    nodes: int  # distinct machines that held a lease
    leases: int
    interruptions: int  # leases that expired, drained or failed
    gpu_seconds: float
    cost: float


@dataclass(frozen=True, kw_only=True)
class NodeCounts:
    """How many jobs held leases on this many distinct machines."""

    none: int  # never leased (canceled or still queued)
    one: int
    two: int
    three_plus: int


@dataclass(frozen=True, kw_only=True)
class Report:
    price_per_gpu_hour: float
    labels: Mapping[str, str]
    since: datetime | None
    until: datetime | None
    jobs: tuple[JobLine, ...]  # oldest first
    states: Mapping[JobState, int]  # every state, zeros included
    interrupted_jobs: int
    wall_s: Summary | None  # finished jobs
    queue_s: Summary | None
    seconds_per_step: Summary | None
    nodes: NodeCounts
    gpu_seconds: float
    cost: float
    succeeded_steps: int  # max_train_steps summed over succeeded jobs

    @property
    def succeeded(self) -> int:
        return self.states[JobState.SUCCEEDED]

    @property
    def failed(self) -> int:
        return self.states[JobState.FAILED]

    @property
    def cost_per_job(self) -> float | None:
        return self.cost / len(self.jobs) if self.jobs else None

    @property
    def cost_per_succeeded_job(self) -> float | None:
        """Everything spent, failures included, per LoRA delivered."""
        return self.cost / self.succeeded if self.succeeded else None

    @property
    def cost_per_step(self) -> float | None:
        return self.cost / self.succeeded_steps if self.succeeded_steps else None


def _as_utc(value: datetime | None) -> datetime | None:
    """Naive times are taken as UTC (the ledger's zone) rather than the machine's local zone."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def _matches(
    job: Job, labels: Mapping[str, str], since: datetime | None, until: datetime | None
) -> bool:
    if any(job.spec.labels.get(k) != v for k, v in labels.items()):
        return False
    if since is not None and job.created_at < since:
        return False
    return until is None or job.created_at < until


def _job_line(job: Job, events: Sequence[JobEvent], price_per_gpu_hour: float) -> JobLine:
    leases = leases_from_events(events)
    first_grant = next((e.at for e in events if e.kind is EventKind.LEASE_GRANTED), None)
    # The median of what the trainer reported is robust to warm-up and to a slow last step;
    # without heartbeats, billed time over steps done is the next best estimate.
    reported = [
        e.seconds_per_step
        for e in events
        if e.kind is EventKind.HEARTBEAT and e.seconds_per_step is not None
    ]
    gpu_seconds = job.gpu_seconds or 0.0
    if reported:
        seconds_per_step: float | None = statistics.median(reported)
    elif job.progress.step > 0 and gpu_seconds > 0:
        seconds_per_step = gpu_seconds / job.progress.step
    else:
        seconds_per_step = None
    return JobLine(
        job_id=job.job_id,
        state=job.state,
        created_at=job.created_at,
        finished_at=job.finished_at,
        steps=job.spec.max_train_steps,
        wall_s=(
            (job.finished_at - job.created_at).total_seconds()
            if job.finished_at is not None
            else None
        ),
        queue_s=(first_grant - job.created_at).total_seconds() if first_grant else None,
        seconds_per_step=seconds_per_step,
        nodes=len({lease.machine_id for lease in leases}),
        leases=len(leases),
        interruptions=sum(lease.outcome.interruption for lease in leases),
        gpu_seconds=gpu_seconds,
        cost=gpu_seconds / 3600 * price_per_gpu_hour,
    )


def build_report(
    jobs: Iterable[Job],
    events_by_job: Mapping[str, Sequence[JobEvent]],
    price_per_gpu_hour: float,
    *,
    labels: Mapping[str, str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Report:
    """The report over `jobs` that carry every one of `labels` and were created in
    [since, until); a job missing from `events_by_job` counts as having no events.

    `Job.gpu_seconds` is taken as known (jobs from `get` or `list` carry it); None counts as 0.
    """
    if price_per_gpu_hour < 0:
        raise InvalidArgument("price_per_gpu_hour", "must not be negative")
    since, until = _as_utc(since), _as_utc(until)
    wanted = dict(labels or {})
    chosen = sorted(
        (j for j in jobs if _matches(j, wanted, since, until)),
        key=lambda j: (j.created_at, j.job_id),
    )
    lines = tuple(
        _job_line(
            job,
            sorted(events_by_job.get(job.job_id, ()), key=lambda e: e.event_id),
            price_per_gpu_hour,
        )
        for job in chosen
    )
    gpu_seconds = sum(line.gpu_seconds for line in lines)
    return Report(
        price_per_gpu_hour=price_per_gpu_hour,
        labels=wanted,
        since=since,
        until=until,
        jobs=lines,
        states={state: sum(line.state is state for line in lines) for state in JobState},
        interrupted_jobs=sum(line.interruptions > 0 for line in lines),
        wall_s=Summary.of(line.wall_s for line in lines),
        queue_s=Summary.of(line.queue_s for line in lines),
        seconds_per_step=Summary.of(line.seconds_per_step for line in lines),
        nodes=NodeCounts(
            none=sum(line.nodes == 0 for line in lines),
            one=sum(line.nodes == 1 for line in lines),
            two=sum(line.nodes == 2 for line in lines),
            three_plus=sum(line.nodes >= 3 for line in lines),
        ),
        gpu_seconds=gpu_seconds,
        cost=gpu_seconds / 3600 * price_per_gpu_hour,
        succeeded_steps=sum(line.steps for line in lines if line.state is JobState.SUCCEEDED),
    )


# ---------------------------------------------------------------------------------------------
# Output.


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or abs(value) >= 0.01:
        return f"${value:,.2f}"
    return f"${value:.3g}"  # per-step costs are fractions of a cent: keep three digits


def _seconds(value: float | None) -> str:
    return "-" if value is None else format_duration(value)


def _per_step(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}s"


def _table(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def format_report(report: Report, *, per_job: bool = False) -> str:
    """A plain-text report for a terminal; `per_job` adds one line per job."""
    scope = [f"{k}={v}" for k, v in sorted(report.labels.items())]
    if report.since or report.until:
        since = report.since.isoformat() if report.since else "the start"
        until = report.until.isoformat() if report.until else "now"
        scope.append(f"created {since} .. {until}")
    states = ", ".join(f"{s.value.lower()} {n}" for s, n in report.states.items() if n)
    lines = [
        f"Jobs: {len(report.jobs)}" + (f" ({'; '.join(scope)})" if scope else " (all)"),
        f"  {states or 'none'}",
        f"  interrupted at least once: {report.interrupted_jobs}",
        "",
    ]
    measures = [
        ("wall time (finished)", report.wall_s, _seconds),
        ("queue to first lease", report.queue_s, _seconds),
        ("seconds per step", report.seconds_per_step, _per_step),
    ]
    rows: list[list[str]] = [["", "jobs", "mean", "median", "min", "max"]]
    for name, summary, fmt in measures:
        if summary is None:
            rows.append([name, "0", "-", "-", "-", "-"])
        else:
            rows.append(
                [
                    name,
                    str(summary.count),
                    fmt(summary.mean),
                    fmt(summary.median),
                    fmt(summary.min),
                    fmt(summary.max),
                ]
            )
    lines += _table(rows, right={1, 2, 3, 4, 5})
    nodes = report.nodes
    lines += [
        "",
        f"Nodes needed: 1: {nodes.one}   2: {nodes.two}   3+: {nodes.three_plus}"
        f"   (never leased: {nodes.none})",
        # Billed per node-second, whatever the node trains on: a CPU worker's time is billed
        # the same way, so "GPU time" would misname it.
        f"Node time (billed): {report.gpu_seconds:,.1f} node-s"
        f" ({report.gpu_seconds / 3600:,.3f} node-h) at {_money(report.price_per_gpu_hour)}/h"
        f" = {_money(report.cost)}",
        f"Cost: per job {_money(report.cost_per_job)}"
        f" · per succeeded job {_money(report.cost_per_succeeded_job)}"
        f" · per step {_money(report.cost_per_step)} ({report.succeeded_steps:,} steps)",
    ]
    if per_job and report.jobs:
        header = [
            "job",
            "state",
            "steps",
            "wall",
            "queue",
            "s/step",
            "nodes",
            "interruptions",
            "node-s",
        ]
        job_rows = [[*header, "cost"]]
        for line in report.jobs:
            job_rows.append(
                [
                    line.job_id,
                    line.state.value.lower(),
                    str(line.steps),
                    _seconds(line.wall_s),
                    _seconds(line.queue_s),
                    _per_step(line.seconds_per_step),
                    str(line.nodes),
                    str(line.interruptions),
                    f"{line.gpu_seconds:,.1f}",
                    _money(line.cost),
                ]
            )
        lines += ["", *_table(job_rows, right={2, 3, 4, 5, 6, 7, 8, 9})]
    return "\n".join(lines) + "\n"


def _summary_json(summary: Summary | None) -> dict[str, float] | None:
    if summary is None:
        return None
    return {
        "count": summary.count,
        "mean": summary.mean,
        "median": summary.median,
        "min": summary.min,
        "max": summary.max,
    }


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def report_to_json(report: Report) -> dict[str, Any]:
    """The report as JSON-ready values (times in ISO 8601, money in the price's currency)."""
    return {
        "filter": {
            "labels": dict(report.labels),
            "since": _time(report.since),
            "until": _time(report.until),
        },
        "price_per_gpu_hour": report.price_per_gpu_hour,
        "jobs": len(report.jobs),
        "states": {s.value.lower(): n for s, n in report.states.items()},
        "interrupted_jobs": report.interrupted_jobs,
        "wall_s": _summary_json(report.wall_s),
        "queue_s": _summary_json(report.queue_s),
        "seconds_per_step": _summary_json(report.seconds_per_step),
        "nodes": {
            "0": report.nodes.none,
            "1": report.nodes.one,
            "2": report.nodes.two,
            "3+": report.nodes.three_plus,
        },
        "gpu_seconds": report.gpu_seconds,
        "cost": report.cost,
        "cost_per_job": report.cost_per_job,
        "cost_per_succeeded_job": report.cost_per_succeeded_job,
        "cost_per_step": report.cost_per_step,
        "succeeded_steps": report.succeeded_steps,
        "per_job": [
            {
                "job_id": line.job_id,
                "state": line.state.value.lower(),
                "created_at": _time(line.created_at),
                "finished_at": _time(line.finished_at),
                "steps": line.steps,
                "wall_s": line.wall_s,
                "queue_s": line.queue_s,
                "seconds_per_step": line.seconds_per_step,
                "nodes": line.nodes,
                "leases": line.leases,
                "interruptions": line.interruptions,
                "gpu_seconds": line.gpu_seconds,
                "cost": line.cost,
            }
            for line in report.jobs
        ],
    }


# ---------------------------------------------------------------------------------------------
# The CLI entry.


async def report_command(
    client: AsyncClient,
    *,
    labels: Mapping[str, str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    price_per_gpu_hour: float,
) -> Report:
    """`lorafleet report`: lists the caller's jobs (labels filtered by the scheduler), keeps
    those created in [since, until) (naive times are UTC), reads their events, builds the
    report."""
    if price_per_gpu_hour < 0:
        raise InvalidArgument("price_per_gpu_hour", "must not be negative")
    since, until = _as_utc(since), _as_utc(until)
    jobs: list[Job] = []
    listing = client.list(labels=labels)
    try:
        async for job in listing:
            if since is not None and job.created_at < since:
                break  # the list is newest first: every job after this one is older still
            if until is None or job.created_at < until:
                jobs.append(job)
    finally:
        # Stopping early leaves the page generator suspended; close it here, not at GC.
        if isinstance(listing, AsyncGenerator):
            await listing.aclose()
    gate = asyncio.Semaphore(_EVENT_FETCH_CONCURRENCY)

    async def events(job_id: str) -> list[JobEvent]:
        async with gate:
            return await client.events(job_id)

    fetched = await asyncio.gather(*(events(job.job_id) for job in jobs))
    return build_report(
        jobs,
        {job.job_id: found for job, found in zip(jobs, fetched, strict=True)},
        price_per_gpu_hour,
        labels=labels,
        since=since,
        until=until,
    )
