"""A picture of one job's life: who held it, for how long, how each lease ended, what it saved.

One horizontal lane per machine (in order of first lease), one bar per lease from grant to its
end, coloured by how it ended (and below them a lane per machine that drew validation images,
one bar per sample task attempt); heartbeat ticks, checkpoint diamonds with their steps,
interruption crosses where a lease ended without a result, the step curve, and a time axis in
seconds or minutes from submit. The title carries the job id, state, steps, wall time and
GPU-seconds: the ledger's own figure (`Job.gpu_seconds`, reported by the server), never a sum
recomputed here, so the picture and the bill cannot disagree.

Entry points (the CLI calls `timeline_command`; the rest are pure functions of domain values):

    leases_from_events(events) -> list[LeaseSpan]
    sample_spans_from_events(events) -> list[SampleSpan]
    layout_timeline(job, events, *, now=None) -> Drawing
    render_timeline_svg(job, events, *, now=None) -> str
    render_timeline_html(job, events, *, now=None) -> str
    render_timeline_png(job, events, *, now=None, scale=2) -> bytes
    write_timeline(job, events, path, *, now=None) -> Path      # format from the suffix
    async timeline_command(client, job_id, path) -> Path

The drawing is laid out once as a list of plain shapes; SVG (hand-written, no plotting
dependency) and PNG (Pillow, imported only when a PNG is asked for, since it lives in the
`worker` extra) both paint that same list, so the two formats never drift apart.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import html
import io
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lorafleet.core.errors import FailedPrecondition, InvalidArgument
from lorafleet.core.model import EventKind, Job, JobEvent, JobState

if TYPE_CHECKING:
    # Only for annotations: the rendering half of this module needs no gRPC.
    from lorafleet.client import AsyncClient
    from lorafleet.client.api import SampleImageInfo

__all__ = [
    "CheckpointMark",
    "Drawing",
    "Heartbeat",
    "LeaseOutcome",
    "LeaseSpan",
    "SampleOutcome",
    "SampleSpan",
    "drawing_to_png",
    "drawing_to_svg",
    "format_duration",
    "layout_timeline",
    "leases_from_events",
    "render_timeline_html",
    "render_timeline_png",
    "render_timeline_svg",
    "sample_spans_from_events",
    "timeline_command",
    "write_timeline",
]

# ---------------------------------------------------------------------------------------------
# The job's life as leases, rebuilt from its events.


class LeaseOutcome(enum.StrEnum):
    """How a lease ended; RUNNING while it is still held."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    EXPIRED = "expired"
    DRAINED = "drained"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def interruption(self) -> bool:
        """The lease ended without a result for a reason that was not the owner's choice."""
        return self in (LeaseOutcome.EXPIRED, LeaseOutcome.DRAINED, LeaseOutcome.FAILED)


_ENDINGS = {
    EventKind.LEASE_EXPIRED: LeaseOutcome.EXPIRED,
    EventKind.DRAINED: LeaseOutcome.DRAINED,
    EventKind.ATTEMPT_FAILED: LeaseOutcome.FAILED,
    EventKind.SUCCEEDED: LeaseOutcome.SUCCEEDED,
    EventKind.CANCELED: LeaseOutcome.CANCELED,
}


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    at: datetime
    step: int | None
    seconds_per_step: float | None


@dataclass(frozen=True, kw_only=True)
class CheckpointMark:
    step: int
    epoch: int | None
    at: datetime
    # Retention (or the job finishing) removed it from storage later on.
    deleted: bool


@dataclass(frozen=True, kw_only=True)
class LeaseSpan:
    """One lease as the events tell it."""

    lease_id: str | None
    epoch: int | None
    machine_id: str
    granted_at: datetime
    ended_at: datetime | None  # None while it is held
    outcome: LeaseOutcome
    start_step: int  # the newest checkpoint committed before the grant (0 when fresh)
    end_step: int | None  # the last step reported under it (a heartbeat or the result)
    detail: str | None  # the drain reason or the failure message
    heartbeats: tuple[Heartbeat, ...]
    checkpoints: tuple[CheckpointMark, ...]
    resumed_at: tuple[datetime, ...]  # the worker's stream reconnected and kept the lease
    notices: tuple[tuple[datetime, str], ...] = ()  # problems the holder reported (NOTICE)

    @property
    def last_heartbeat_at(self) -> datetime | None:
        return self.heartbeats[-1].at if self.heartbeats else None

    @property
    def silent_since(self) -> datetime | None:
        """For an expired lease, its holder's last sign of life (the last heartbeat, else the
        grant): from there until the sweeper noticed, the lease was held but nothing was heard.
        None for every other lease."""
        if self.outcome is not LeaseOutcome.EXPIRED:
            return None
        return self.last_heartbeat_at or self.granted_at

    def held_seconds(self, now: datetime) -> float:
        """Grant to end, or to `now` while it is held."""
        return max(0.0, ((self.ended_at or now) - self.granted_at).total_seconds())


@dataclass(kw_only=True)
class _Draft:
    """A lease while its events are being read; frozen into a LeaseSpan at the end."""

    lease_id: str | None
    epoch: int | None
    machine_id: str
    granted_at: datetime
    start_step: int
    ended_at: datetime | None = None
    outcome: LeaseOutcome = LeaseOutcome.RUNNING
    end_step: int | None = None
    detail: str | None = None
    heartbeats: list[Heartbeat] = field(default_factory=list)
    checkpoints: list[tuple[int, int | None, datetime]] = field(default_factory=list)
    resumed_at: list[datetime] = field(default_factory=list)
    notices: list[tuple[datetime, str]] = field(default_factory=list)

    def freeze(self, deleted: set[tuple[int, int | None]]) -> LeaseSpan:
        return LeaseSpan(
            lease_id=self.lease_id,
            epoch=self.epoch,
            machine_id=self.machine_id,
            granted_at=self.granted_at,
            ended_at=self.ended_at,
            outcome=self.outcome,
            start_step=self.start_step,
            end_step=self.end_step,
            detail=self.detail,
            heartbeats=tuple(self.heartbeats),
            checkpoints=tuple(
                CheckpointMark(step=s, epoch=e, at=at, deleted=(s, e) in deleted)
                for s, e, at in self.checkpoints
            ),
            resumed_at=tuple(self.resumed_at),
            notices=tuple(self.notices),
        )


def leases_from_events(events: Iterable[JobEvent]) -> list[LeaseSpan]:
    """Every lease of one job, in grant order, with what happened under each.

    Events are matched to leases by lease id; an event without one falls back to the newest
    open lease (on its machine if it names one), so a timeline still draws from older ledgers.
    Events of a lease whose grant is not among `events` are ignored.
    """
    drafts: list[_Draft] = []
    by_id: dict[str, _Draft] = {}
    deleted: set[tuple[int, int | None]] = set()
    # A new holder resumes from the newest checkpoint, not from the last heartbeat's step
    # (which LEASE_GRANTED records), so that is where its work starts.
    newest_checkpoint = 0

    def holder(event: JobEvent) -> _Draft | None:
        if event.lease_id is not None and event.lease_id in by_id:
            return by_id[event.lease_id]
        open_ = [d for d in drafts if d.ended_at is None]
        mine = [d for d in open_ if d.machine_id == event.machine_id]
        candidates = mine or open_
        return candidates[-1] if candidates else None

    for event in sorted(events, key=lambda e: e.event_id):
        kind = event.kind
        if kind is EventKind.LEASE_GRANTED:
            draft = _Draft(
                lease_id=event.lease_id,
                epoch=event.epoch,
                machine_id=event.machine_id or "?",
                granted_at=event.at,
                start_step=newest_checkpoint,
            )
            drafts.append(draft)
            if event.lease_id is not None:
                by_id[event.lease_id] = draft
        elif kind is EventKind.CHECKPOINT_DELETED:
            if event.step is not None:
                deleted.add((event.step, event.epoch))
        elif kind in (EventKind.HEARTBEAT, EventKind.CHECKPOINT_COMMITTED, EventKind.LEASE_RESUMED):
            draft_or_none = holder(event)
            if draft_or_none is None:
                continue
            draft = draft_or_none
            if kind is EventKind.HEARTBEAT:
                draft.heartbeats.append(
                    Heartbeat(at=event.at, step=event.step, seconds_per_step=event.seconds_per_step)
                )
                if event.step is not None:
                    draft.end_step = event.step
            elif kind is EventKind.CHECKPOINT_COMMITTED:
                step = event.step if event.step is not None else _checkpoint_step(event)
                if step is not None:
                    draft.checkpoints.append((step, event.epoch or draft.epoch, event.at))
                    newest_checkpoint = max(newest_checkpoint, step)
            else:
                draft.resumed_at.append(event.at)
        elif kind is EventKind.NOTICE:
            noticed = holder(event)
            if noticed is not None:
                noticed.notices.append((event.at, event.message or ""))
        elif kind in _ENDINGS:
            draft_or_none = holder(event)
            # A cancel while queued ends no lease; only a held one is closed here.
            if draft_or_none is None or draft_or_none.ended_at is not None:
                continue
            draft = draft_or_none
            draft.ended_at = event.at
            draft.outcome = _ENDINGS[kind]
            draft.detail = event.message
            if kind is EventKind.SUCCEEDED and event.step is not None:
                draft.end_step = event.step
            elif kind is EventKind.LEASE_EXPIRED and event.step is not None:
                # The holder's last report, which the timeline's (rate-limited) heartbeats
                # may not have carried.
                draft.end_step = max(draft.end_step or 0, event.step)
    return [d.freeze(deleted) for d in drafts]


def _checkpoint_step(event: JobEvent) -> int | None:
    return event.checkpoint.step if event.checkpoint is not None else None


class SampleOutcome(enum.StrEnum):
    """How one attempt at a step's validation images ended; RUNNING while it is held."""

    RUNNING = "running"
    STORED = "stored"
    FAILED = "failed"
    # Ended without a word (its machine drained, reconnected or gave way to training): the
    # next SAMPLES_STARTED of the same task is a new attempt.
    RETRIED = "retried"


@dataclass(frozen=True, kw_only=True)
class SampleSpan:
    """One sample task attempt (a worker drawing a step's validation images), as the events
    tell it: from SAMPLES_STARTED to its SAMPLES, SAMPLES_FAILED or the task's next start."""

    task: str  # the task id SAMPLES_STARTED names, else "step N"
    step: int | None
    machine_id: str
    started_at: datetime
    ended_at: datetime | None
    outcome: SampleOutcome
    detail: str | None  # how many images, or why it failed


_SAMPLE_TASK = re.compile(r"sample task (\S+)")


@dataclass(kw_only=True)
class _SampleDraft:
    task: str
    step: int | None
    machine_id: str
    started_at: datetime
    ended_at: datetime | None = None
    outcome: SampleOutcome = SampleOutcome.RUNNING
    detail: str | None = None


def sample_spans_from_events(events: Iterable[JobEvent]) -> list[SampleSpan]:
    """Every sample task attempt of one job, in start order. The ledger's sample events carry
    no lease id: an ending is matched to the open attempt of its step on its machine, else of
    its step anywhere; an ending with no open attempt (its start is not among `events`) is
    left out."""
    drafts: list[_SampleDraft] = []
    for event in sorted(events, key=lambda e: e.event_id):
        if event.kind is EventKind.SAMPLES_STARTED:
            found = _SAMPLE_TASK.search(event.message or "")
            task = found.group(1) if found else f"step {event.step}"
            for earlier in drafts:
                if earlier.task == task and earlier.ended_at is None:
                    earlier.ended_at, earlier.outcome = event.at, SampleOutcome.RETRIED
            drafts.append(
                _SampleDraft(
                    task=task,
                    step=event.step,
                    machine_id=event.machine_id or "?",
                    started_at=event.at,
                )
            )
        elif event.kind in (EventKind.SAMPLES, EventKind.SAMPLES_FAILED):
            open_ = [d for d in drafts if d.ended_at is None and d.step == event.step]
            mine = [d for d in open_ if d.machine_id == event.machine_id]
            if not (candidates := mine or open_):
                continue
            draft = candidates[0]
            draft.ended_at, draft.detail = event.at, event.message
            draft.outcome = (
                SampleOutcome.STORED if event.kind is EventKind.SAMPLES else SampleOutcome.FAILED
            )
    return [
        SampleSpan(
            task=d.task,
            step=d.step,
            machine_id=d.machine_id,
            started_at=d.started_at,
            ended_at=d.ended_at,
            outcome=d.outcome,
            detail=d.detail,
        )
        for d in drafts
    ]


def _state_segments(
    job: Job, events: Sequence[JobEvent], end: datetime
) -> list[tuple[JobState, datetime, datetime]]:
    """The job's own state over time (queued / running / final), from the events that set it."""
    segments: list[tuple[JobState, datetime, datetime]] = []
    state, since = JobState.QUEUED, job.created_at
    for event in events:
        if event.state is None or event.state is state:
            continue
        segments.append((state, since, event.at))
        state, since = event.state, event.at
    if not state.terminal:
        segments.append((state, since, end))
    return segments


def format_duration(seconds: float) -> str:
    """Compact and readable at every scale: 0.04s, 2.5s, 12s, 3m05s, 2h10m."""
    if seconds < 1:
        return f"{seconds:.2g}s"  # two significant digits: a short lease is not "0s"
    if seconds < 10:
        return f"{seconds:.1f}".removesuffix(".0") + "s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes}m{secs:02d}s" if secs else f"{minutes}m"
    hours, rest = divmod(whole, 3600)
    return f"{hours}h{rest // 60:02d}m" if rest // 60 else f"{hours}h"


# ---------------------------------------------------------------------------------------------
# Shapes: the drawing both painters share. Coordinates are SVG user units (pixels at scale 1).

Anchor = Literal["start", "middle", "end"]


@dataclass(frozen=True, kw_only=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str | None = None
    role: str | None = None  # an SVG class, so tests and stylesheets can find it
    title: str | None = None  # a tooltip in the SVG


@dataclass(frozen=True, kw_only=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str
    width: float = 1.0
    role: str | None = None


@dataclass(frozen=True, kw_only=True)
class Polyline:
    points: tuple[tuple[float, float], ...]
    stroke: str
    width: float = 1.5
    role: str | None = None


@dataclass(frozen=True, kw_only=True)
class Polygon:
    points: tuple[tuple[float, float], ...]
    fill: str
    stroke: str | None = None
    role: str | None = None
    title: str | None = None


@dataclass(frozen=True, kw_only=True)
class Circle:
    cx: float
    cy: float
    r: float
    fill: str
    stroke: str | None = None
    role: str | None = None
    title: str | None = None


@dataclass(frozen=True, kw_only=True)
class Text:
    x: float
    y: float  # the baseline
    text: str
    size: float = 12.0
    fill: str = "#222222"
    anchor: Anchor = "start"
    bold: bool = False
    role: str | None = None


Shape = Rect | Line | Polyline | Polygon | Circle | Text
_XOf = Callable[[datetime], float]


@dataclass(frozen=True, kw_only=True)
class Drawing:
    width: int
    height: int
    title: str
    shapes: tuple[Shape, ...]


OUTCOME_COLORS = {
    LeaseOutcome.RUNNING: "#3b7dd8",
    LeaseOutcome.SUCCEEDED: "#2f9e5a",
    LeaseOutcome.EXPIRED: "#ee8a1c",
    LeaseOutcome.DRAINED: "#9467c9",
    LeaseOutcome.FAILED: "#d43f3f",
    LeaseOutcome.CANCELED: "#8a8a8a",
}
# Sample tasks in tones of their own, apart from the leases' (a stored one is not a result).
SAMPLE_COLORS = {
    SampleOutcome.RUNNING: "#7fb2e5",
    SampleOutcome.STORED: "#2a9d8f",
    SampleOutcome.FAILED: "#e07a7a",
    SampleOutcome.RETRIED: "#c9a227",
}
_INK = "#222222"
_MUTED = "#6b6b6b"
_GRID = "#e4e4e4"
_CHECKPOINT = "#1d3557"
_NOTICE = "#f4a261"
_INTERRUPTION = "#b00020"
_QUEUED = "#d6d6d6"
_RUNNING_STRIP = "#c9dcf3"

_WIDTH = 1200
_LEFT = 180  # lane labels
_RIGHT = 40
_LANE_H = 64
_BAR_H = 20
_STEP_PANEL_H = 110
_TICK_STEPS_S = (
    0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
    21600, 43200, 86400,
)  # fmt: skip


def _blend(color: str, amount: float) -> str:
    """`color` faded towards white: what opacity would show, as a solid colour both painters
    can use (Pillow draws on RGB without alpha compositing)."""
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    faded = [round(255 - (255 - c) * amount) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in faded)


def _text_width(text: str, size: float) -> float:
    # An estimate shared by both painters, so label-collision choices are identical in each.
    return len(text) * size * 0.58


def _diamond(x: float, y: float, r: float) -> tuple[tuple[float, float], ...]:
    return ((x, y - r), (x + r, y), (x, y + r), (x - r, y))


def _end_of_axis(job: Job, events: Sequence[JobEvent], now: datetime | None) -> datetime:
    """The right edge: when the job finished, else `now` (or its newest news).

    Checkpoint deletions are left out: they are drawn on their checkpoints, not at their own
    time, and the sweeper may run them long after the job finished.
    """
    drawn = [e.at for e in events if e.kind is not EventKind.CHECKPOINT_DELETED]
    if job.state.terminal and job.finished_at is not None:
        return max([job.finished_at, *drawn])
    latest = max([job.updated_at, *drawn])
    return max(now, latest) if now is not None else latest


def _gpu_seconds(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2f}"


def _title_lines(job: Job, leases: Sequence[LeaseSpan], end: datetime) -> tuple[str, str]:
    wall = (end - job.created_at).total_seconds()
    # The server's figure (the ledger's billing rule); a Job built without one shows none.
    gpu = job.gpu_seconds
    machines = len({lease.machine_id for lease in leases})
    interruptions = sum(lease.outcome.interruption for lease in leases)
    gpu_text = "GPU-s not reported" if gpu is None else f"{_gpu_seconds(gpu)} GPU-s"
    if gpu is not None and gpu >= 3600:
        gpu_text += f" ({gpu / 3600:.2f} GPU-h)"
    parts = [
        f"step {job.progress.step}/{job.spec.max_train_steps}",
        f"wall {format_duration(wall)}" + ("" if job.state.terminal else " so far"),
        gpu_text,
        f"{len(leases)} lease{'s' * (len(leases) != 1)} on {machines}"
        f" machine{'s' * (machines != 1)}",
        f"{interruptions} interruption{'s' * (interruptions != 1)}",
    ]
    return f"job {job.job_id} · {job.state.value}", " · ".join(parts)


def layout_timeline(
    job: Job, events: Sequence[JobEvent], *, now: datetime | None = None
) -> Drawing:
    """Lays the picture out as shapes; `now` is the right edge for a job still in flight."""
    events = sorted(events, key=lambda e: e.event_id)
    leases = leases_from_events(events)
    start = job.created_at
    end = _end_of_axis(job, events, now)
    span_s = max((end - start).total_seconds(), 1e-3)
    plot_w = _WIDTH - _LEFT - _RIGHT

    def x_of(at: datetime) -> float:
        return _LEFT + (at - start).total_seconds() / span_s * plot_w

    shapes: list[Shape] = []
    title, subtitle = _title_lines(job, leases, end)
    shapes.append(Text(x=24, y=32, text=title, size=18, bold=True, role="title"))
    shapes.append(Text(x=24, y=54, text=subtitle, size=13, fill=_MUTED, role="subtitle"))
    y = 72.0
    if job.error:
        error = job.error if len(job.error) <= 140 else job.error[:139] + "…"
        shapes.append(Text(x=24, y=y, text=error, size=12, fill=_INTERRUPTION, role="error"))
        y += 16

    machines = list(dict.fromkeys(lease.machine_id for lease in leases))
    # Sample tasks (validation images) run after or beside training, often on other machines:
    # one lane per machine that drew them, below the training lanes. The wall time in the
    # title runs to the last of them, so the picture must show where that time went.
    samples = sample_spans_from_events(events)
    sampling = list(dict.fromkeys(span.machine_id for span in samples))
    show_steps = any(lease.heartbeats or lease.checkpoints for lease in leases)
    strip_y = y + 14
    lanes_y = strip_y + 24
    panel_y = lanes_y + (len(machines) + len(sampling)) * _LANE_H + 24
    axis_y = panel_y + (_STEP_PANEL_H + 14 if show_steps else 0)

    # Backgrounds, then the grid, then the marks: later shapes paint over earlier ones.
    lane_titles = [*machines, *(f"sample tasks on {machine}" for machine in sampling)]
    for index, lane_title in enumerate(lane_titles):
        shapes.append(
            Rect(
                x=_LEFT,
                y=lanes_y + index * _LANE_H,
                w=plot_w,
                h=_LANE_H,
                fill="#f4f5f7" if index % 2 == 0 else "#ffffff",
                role="lane" if index < len(machines) else "lane samples",
                title=lane_title,
            )
        )
    tick_s = next((t for t in _TICK_STEPS_S if span_s / t <= 10), _TICK_STEPS_S[-1])
    ticks = [i * tick_s for i in range(int(span_s / tick_s + 1e-9) + 1)]
    for t in ticks:
        x = _LEFT + t / span_s * plot_w
        shapes.append(Line(x1=x, y1=strip_y, x2=x, y2=axis_y, stroke=_GRID, role="grid"))

    # The job's own state: the queued stretches are the waits for a machine.
    shapes.append(Text(x=_LEFT - 12, y=strip_y + 10, text="job", size=12, anchor="end"))
    drawn_states: set[JobState] = set()
    for state, seg_start, seg_end in _state_segments(job, events, end):
        drawn_states.add(JobState.QUEUED if state is JobState.QUEUED else JobState.RUNNING)
        x0, x1 = x_of(seg_start), x_of(seg_end)
        held = format_duration((seg_end - seg_start).total_seconds())
        shapes.append(
            Rect(
                x=x0,
                y=strip_y,
                w=max(x1 - x0, 1.0),
                h=12,
                fill=_QUEUED if state is JobState.QUEUED else _RUNNING_STRIP,
                role=f"state {state.value.lower()}",
                title=f"{state.value.lower()} {held}",
            )
        )

    for index, machine in enumerate(machines):
        bar_y = lanes_y + index * _LANE_H + 26
        mine = [lease for lease in leases if lease.machine_id == machine]
        label = machine if len(machine) <= 22 else machine[:21] + "…"
        shapes.append(Text(x=_LEFT - 12, y=bar_y + 11, text=label, size=13, anchor="end"))
        held_s = sum(lease.held_seconds(end) for lease in mine)
        shapes.append(
            Text(
                x=_LEFT - 12,
                y=bar_y + 27,
                text=f"{len(mine)} lease{'s' * (len(mine) != 1)} · {format_duration(held_s)}",
                size=10,
                fill=_MUTED,
                anchor="end",
            )
        )
        for lease in mine:
            shapes.extend(_lease_shapes(lease, bar_y, x_of, end))
    for index, machine in enumerate(sampling, start=len(machines)):
        bar_y = lanes_y + index * _LANE_H + 26
        tasks = [span for span in samples if span.machine_id == machine]
        label = machine if len(machine) <= 22 else machine[:21] + "…"
        shapes.append(Text(x=_LEFT - 12, y=bar_y + 11, text=label, size=13, anchor="end"))
        held_s = sum(((t.ended_at or end) - t.started_at).total_seconds() for t in tasks)
        shapes.append(
            Text(
                x=_LEFT - 12,
                y=bar_y + 27,
                text=f"{len(tasks)} sample task{'s' * (len(tasks) != 1)}"
                f" · {format_duration(held_s)}",
                size=10,
                fill=_MUTED,
                anchor="end",
            )
        )
        for task in tasks:
            shapes.extend(_sample_shapes(task, bar_y, x_of, end))

    if show_steps:
        shapes.extend(_step_panel(job, leases, panel_y, x_of))

    # The time axis.
    shapes.append(Line(x1=_LEFT, y1=axis_y, x2=_LEFT + plot_w, y2=axis_y, stroke=_INK))
    for t in ticks:
        x = _LEFT + t / span_s * plot_w
        shapes.append(Line(x1=x, y1=axis_y, x2=x, y2=axis_y + 5, stroke=_INK))
        shapes.append(Text(x=x, y=axis_y + 19, text=format_duration(t), size=11, anchor="middle"))
    shapes.append(
        Text(
            x=_LEFT + plot_w,
            y=axis_y + 36,
            text="time since submit",
            size=11,
            fill=_MUTED,
            anchor="end",
        )
    )
    legend, legend_h = _legend(leases, axis_y + 50, drawn_states, samples)
    shapes.extend(legend)
    return Drawing(
        width=_WIDTH,
        height=int(axis_y + 50 + legend_h + 12),
        title=f"{title} · {subtitle}",
        shapes=tuple(shapes),
    )


def _lease_shapes(lease: LeaseSpan, bar_y: float, x_of: _XOf, end: datetime) -> list[Shape]:
    color = OUTCOME_COLORS[lease.outcome]
    ended = lease.ended_at or end
    x0, x1 = x_of(lease.granted_at), x_of(ended)
    silent_x = x_of(min(lease.silent_since or ended, ended))
    steps = f"steps {lease.start_step}→{lease.end_step if lease.end_step is not None else '?'}"
    held = format_duration((ended - lease.granted_at).total_seconds())
    how = lease.outcome.value + (f" ({lease.detail})" if lease.detail else "")
    shapes: list[Shape] = [
        Rect(
            x=x0,
            y=bar_y,
            w=max(silent_x - x0, 1.5),
            h=_BAR_H,
            fill=color,
            role=f"lease {lease.outcome.value}",
            title=f"epoch {lease.epoch} on {lease.machine_id}: held {held}, {how}, {steps}",
        )
    ]
    if x1 - silent_x > 0.5:
        # An expired lease's silent tail: held, but nothing heard and no work done.
        shapes.append(
            Rect(
                x=silent_x,
                y=bar_y,
                w=x1 - silent_x,
                h=_BAR_H,
                fill=_blend(color, 0.35),
                role="silent",
                title="no heartbeat until the lease expired",
            )
        )
    if lease.epoch is not None and x1 - x0 > 30:
        shapes.append(Text(x=x0 + 4, y=bar_y + 14, text=f"e{lease.epoch}", size=10, fill="#ffffff"))
    # Heartbeat ticks along the bar's foot; one per pixel column is all the eye can see.
    seen: set[int] = set()
    for hb in lease.heartbeats:
        x = x_of(hb.at)
        if round(x) in seen:
            continue
        seen.add(round(x))
        shapes.append(
            Line(
                x1=x,
                y1=bar_y + _BAR_H - 6,
                x2=x,
                y2=bar_y + _BAR_H,
                stroke="#ffffff",
                width=1.0,
                role="heartbeat",
            )
        )
    for at in lease.resumed_at:
        shapes.append(
            Circle(
                cx=x_of(at),
                cy=bar_y + _BAR_H / 2,
                r=4,
                fill="#ffffff",
                stroke=_INK,
                role="resumed",
                title="the worker reconnected and kept its lease",
            )
        )
    for at, message in lease.notices:
        x = x_of(at)
        shapes.append(
            Polygon(
                points=_warning(x, bar_y - 1),
                fill=_NOTICE,
                stroke=_INK,
                role="notice",
                title=f"notice: {message}",
            )
        )
    label_right = float("-inf")  # skip step labels that would overlap the previous one
    for mark in lease.checkpoints:
        x = x_of(mark.at)
        shapes.append(
            Polygon(
                points=_diamond(x, bar_y + _BAR_H / 2, 6),
                fill="#ffffff" if mark.deleted else _CHECKPOINT,
                stroke=_CHECKPOINT,
                role="checkpoint deleted" if mark.deleted else "checkpoint",
                title=f"checkpoint at step {mark.step}"
                + (" (since deleted)" if mark.deleted else ""),
            )
        )
        text = str(mark.step)
        width = _text_width(text, 10)
        if x - width / 2 > label_right + 2:
            shapes.append(
                Text(
                    x=x,
                    y=bar_y - 5,
                    text=text,
                    size=10,
                    fill=_CHECKPOINT,
                    anchor="middle",
                    role="checkpoint-step",
                )
            )
            label_right = x + width / 2
    if lease.outcome.interruption:
        cy, r = bar_y + _BAR_H / 2, 6.0
        for dx in (-r, r):
            shapes.append(
                Line(
                    x1=x1 - r,
                    y1=cy - dx,
                    x2=x1 + r,
                    y2=cy + dx,
                    stroke=_INTERRUPTION,
                    width=2.5,
                    role="interruption",
                )
            )
        shapes.append(
            Text(
                x=x1,
                y=bar_y + _BAR_H + 14,
                text=lease.outcome.value,
                size=10,
                fill=_INTERRUPTION,
                anchor="end" if x1 > _WIDTH - _RIGHT - 40 else "middle",
            )
        )
    return shapes


def _sample_shapes(task: SampleSpan, bar_y: float, x_of: _XOf, end: datetime) -> list[Shape]:
    ended = task.ended_at or end
    x0, x1 = x_of(task.started_at), x_of(ended)
    held = format_duration((ended - task.started_at).total_seconds())
    how = task.outcome.value + (f" ({task.detail})" if task.detail else "")
    shapes: list[Shape] = [
        Rect(
            x=x0,
            y=bar_y,
            w=max(x1 - x0, 1.5),
            h=_BAR_H,
            fill=SAMPLE_COLORS[task.outcome],
            role=f"sample {task.outcome.value}",
            title=f"validation images of step {task.step} on {task.machine_id}: {held}, {how}",
        )
    ]
    if task.step is not None and x1 - x0 > 30:
        shapes.append(Text(x=x0 + 4, y=bar_y + 14, text=f"s{task.step}", size=10, fill="#ffffff"))
    return shapes


def _step_panel(job: Job, leases: Sequence[LeaseSpan], top: float, x_of: _XOf) -> list[Shape]:
    """Step against time, one line per lease: a drop between leases is work redone after an
    interruption (the new holder resumes from the newest checkpoint, not the last heartbeat)."""
    observed = [hb.step or 0 for lease in leases for hb in lease.heartbeats]
    observed += [mark.step for lease in leases for mark in lease.checkpoints]
    top_step = max([job.spec.max_train_steps, *observed])
    bottom = top + _STEP_PANEL_H

    def y_of(step: int) -> float:
        return bottom - step / max(top_step, 1) * _STEP_PANEL_H

    goal_y = y_of(job.spec.max_train_steps)
    shapes: list[Shape] = [
        Line(x1=_LEFT, y1=top, x2=_LEFT, y2=bottom, stroke=_MUTED),
        Line(x1=_LEFT, y1=goal_y, x2=_WIDTH - _RIGHT, y2=goal_y, stroke=_GRID),
        Text(x=_LEFT - 12, y=top + _STEP_PANEL_H / 2 + 4, text="step", size=12, anchor="end"),
        Text(x=_LEFT - 6, y=y_of(top_step) + 4, text=str(top_step), size=10, anchor="end"),
        Text(x=_LEFT - 6, y=bottom + 4, text="0", size=10, anchor="end"),
    ]
    for lease in leases:
        points: list[tuple[datetime, int]] = [(lease.granted_at, lease.start_step)]
        points += [(hb.at, hb.step) for hb in lease.heartbeats if hb.step is not None]
        if lease.outcome is LeaseOutcome.SUCCEEDED and lease.ended_at and lease.end_step:
            points.append((lease.ended_at, lease.end_step))
        by_pixel: dict[int, tuple[float, float]] = {}
        for at, step in points:
            x = x_of(at)
            by_pixel[round(x)] = (x, y_of(step))  # the newest point in a pixel column wins
        line = tuple(by_pixel.values())
        color = OUTCOME_COLORS[lease.outcome]
        if len(line) > 1:
            shapes.append(Polyline(points=line, stroke=color, width=1.75, role="steps"))
        else:
            shapes.append(Circle(cx=line[0][0], cy=line[0][1], r=2, fill=color, role="steps"))
        for mark in lease.checkpoints:
            shapes.append(
                Polygon(
                    points=_diamond(x_of(mark.at), y_of(mark.step), 4),
                    fill="#ffffff" if mark.deleted else _CHECKPOINT,
                    stroke=_CHECKPOINT,
                )
            )
    return shapes


def _warning(x: float, base_y: float) -> tuple[tuple[float, float], ...]:
    """A small warning triangle standing on `base_y`."""
    return ((x - 5, base_y), (x + 5, base_y), (x, base_y - 9))


def _legend(
    leases: Sequence[LeaseSpan],
    top: float,
    states: set[JobState] | None = None,
    samples: Sequence[SampleSpan] = (),
) -> tuple[list[Shape], float]:
    """A swatch for each thing the picture draws (and nothing it does not), drawn as the
    picture draws it; wraps onto further rows."""
    items: list[tuple[str, str]] = [
        (f"lease {o.value}", f"lease {o.value}")
        for o in LeaseOutcome
        if any(lease.outcome is o for lease in leases)
    ]
    marks = [mark for lease in leases for mark in lease.checkpoints]
    if any(not mark.deleted for mark in marks):
        items.append(("checkpoint", "checkpoint"))
    if any(mark.deleted for mark in marks):
        items.append(("checkpoint deleted", "deleted checkpoint"))
    if any(lease.outcome.interruption for lease in leases):
        items.append(("interruption", "interruption"))
    with_beats = [lease for lease in leases if lease.heartbeats]
    if with_beats:
        # Ticks at the foot of a lease bar in that lease's own colour, as drawn.
        items.append((f"heartbeat {with_beats[0].outcome.value}", "heartbeats"))
    if any(lease.resumed_at for lease in leases):
        items.append(("resumed", "reconnected"))
    if any(lease.notices for lease in leases):
        items.append(
            (
                "notice",
                "notice (a note: the interval chosen, a checkpoint skipped...)",
            )
        )
    if any(
        lease.outcome is LeaseOutcome.EXPIRED
        and (lease.silent_since or lease.ended_at) != lease.ended_at
        for lease in leases
    ):
        items.append(("silent", "silent (no heartbeat)"))
    items += [
        (f"sample {o.value}", f"sample task {o.value}")
        for o in SampleOutcome
        if any(span.outcome is o for span in samples)
    ]
    for state in (JobState.QUEUED, JobState.RUNNING):
        if states is None or state in states:
            items.append((f"job {state.value.lower()}", f"job {state.value.lower()}"))

    shapes: list[Shape] = []
    x, y = float(_LEFT), top
    for key, label in items:
        width = 22 + _text_width(label, 11) + 18
        if x + width > _WIDTH - _RIGHT:
            x, y = float(_LEFT), y + 22
        cy = y + 8
        shapes.extend(_swatch(key, x + 8, cy))
        shapes.append(Text(x=x + 22, y=cy + 4, text=label, size=11, fill=_INK))
        x += width
    return shapes, y - top + 20


def _swatch(key: str, x: float, cy: float) -> list[Shape]:
    if key.startswith("lease "):
        color = OUTCOME_COLORS[LeaseOutcome(key.removeprefix("lease "))]
        return [Rect(x=x - 8, y=cy - 6, w=16, h=12, fill=color)]
    if key.startswith("sample "):
        color = SAMPLE_COLORS[SampleOutcome(key.removeprefix("sample "))]
        return [Rect(x=x - 8, y=cy - 6, w=16, h=12, fill=color)]
    if key == "checkpoint":
        return [Polygon(points=_diamond(x, cy, 6), fill=_CHECKPOINT, stroke=_CHECKPOINT)]
    if key == "checkpoint deleted":
        return [Polygon(points=_diamond(x, cy, 6), fill="#ffffff", stroke=_CHECKPOINT)]
    if key == "interruption":
        return [
            Line(x1=x - 5, y1=cy - 5, x2=x + 5, y2=cy + 5, stroke=_INTERRUPTION, width=2.5),
            Line(x1=x - 5, y1=cy + 5, x2=x + 5, y2=cy - 5, stroke=_INTERRUPTION, width=2.5),
        ]
    if key.startswith("heartbeat "):
        color = OUTCOME_COLORS[LeaseOutcome(key.removeprefix("heartbeat "))]
        # The bar's foot at the bar's proportions: ticks 6 px of a 20 px bar.
        tick = 12 * 6 / _BAR_H
        return [
            Rect(x=x - 8, y=cy - 6, w=16, h=12, fill=color),
            Line(x1=x - 3, y1=cy + 6 - tick, x2=x - 3, y2=cy + 6, stroke="#ffffff"),
            Line(x1=x + 3, y1=cy + 6 - tick, x2=x + 3, y2=cy + 6, stroke="#ffffff"),
        ]
    if key == "resumed":
        return [Circle(cx=x, cy=cy, r=4, fill="#ffffff", stroke=_INK)]
    if key == "notice":
        return [Polygon(points=_warning(x, cy + 5), fill=_NOTICE, stroke=_INK)]
    if key == "silent":
        return [
            Rect(
                x=x - 8,
                y=cy - 6,
                w=16,
                h=12,
                fill=_blend(OUTCOME_COLORS[LeaseOutcome.EXPIRED], 0.35),
            )
        ]
    # The job's state strip, 12 px high as drawn.
    fill = _QUEUED if key == "job queued" else _RUNNING_STRIP
    return [Rect(x=x - 8, y=cy - 6, w=16, h=12, fill=fill)]


# ---------------------------------------------------------------------------------------------
# Painters.


def _num(value: float) -> str:
    return f"{value:.1f}".removesuffix(".0")


def _attrs(**values: str | None) -> str:
    return "".join(
        f' {name.rstrip("_").replace("_", "-")}="{html.escape(value)}"'
        for name, value in values.items()
        if value is not None
    )


def _svg_shape(shape: Shape) -> str:
    match shape:
        case Rect():
            tag = "rect"
            attrs = _attrs(
                class_=shape.role,
                x=_num(shape.x),
                y=_num(shape.y),
                width=_num(shape.w),
                height=_num(shape.h),
                fill=shape.fill,
                stroke=shape.stroke,
            )
            title = shape.title
        case Line():
            tag, title = "line", None
            attrs = _attrs(
                class_=shape.role,
                x1=_num(shape.x1),
                y1=_num(shape.y1),
                x2=_num(shape.x2),
                y2=_num(shape.y2),
                stroke=shape.stroke,
                stroke_width=_num(shape.width),
            )
        case Polyline():
            tag, title = "polyline", None
            attrs = _attrs(
                class_=shape.role,
                points=" ".join(f"{_num(x)},{_num(y)}" for x, y in shape.points),
                fill="none",
                stroke=shape.stroke,
                stroke_width=_num(shape.width),
                stroke_linejoin="round",
            )
        case Polygon():
            tag, title = "polygon", shape.title
            attrs = _attrs(
                class_=shape.role,
                points=" ".join(f"{_num(x)},{_num(y)}" for x, y in shape.points),
                fill=shape.fill,
                stroke=shape.stroke,
            )
        case Circle():
            tag, title = "circle", shape.title
            attrs = _attrs(
                class_=shape.role,
                cx=_num(shape.cx),
                cy=_num(shape.cy),
                r=_num(shape.r),
                fill=shape.fill,
                stroke=shape.stroke,
            )
        case Text():
            attrs = _attrs(
                class_=shape.role,
                x=_num(shape.x),
                y=_num(shape.y),
                font_size=_num(shape.size),
                fill=shape.fill,
                text_anchor=shape.anchor if shape.anchor != "start" else None,
                font_weight="bold" if shape.bold else None,
            )
            return f"<text{attrs}>{html.escape(shape.text)}</text>"
    if title is None:
        return f"<{tag}{attrs}/>"
    return f"<{tag}{attrs}><title>{html.escape(title)}</title></{tag}>"


def drawing_to_svg(drawing: Drawing) -> str:
    """A standalone SVG document; tooltips (`<title>`) work in browsers without any script."""
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{drawing.width}"'
        f' height="{drawing.height}" viewBox="0 0 {drawing.width} {drawing.height}"'
        ' font-family="DejaVu Sans, Helvetica, Arial, sans-serif" role="img"'
        f' aria-label="{html.escape(drawing.title)}">'
    )
    body = [f"<title>{html.escape(drawing.title)}</title>"]
    body.append(f'<rect width="{drawing.width}" height="{drawing.height}" fill="#ffffff"/>')
    body.extend(_svg_shape(shape) for shape in drawing.shapes)
    return "\n".join([head, *body, "</svg>"]) + "\n"


def render_timeline_svg(
    job: Job, events: Sequence[JobEvent], *, now: datetime | None = None
) -> str:
    """The timeline as an SVG document (see the module docstring for what it shows)."""
    return drawing_to_svg(layout_timeline(job, events, now=now))


def _samples_html(samples: Sequence[tuple[SampleImageInfo, bytes]]) -> str:
    """The validation images at their steps: a row per prompt and image, a column
    per step, each picture inline (a data: URI)."""
    if not samples:
        return ""
    steps = sorted({info.step for info, _ in samples})
    rows = sorted({(info.prompt_index, info.image_index) for info, _ in samples})
    prompts = {info.prompt_index: info.prompt for info, _ in samples}
    cells = {(i.step, i.prompt_index, i.image_index): data for i, data in samples}
    head = "".join(f"<th>step {step}</th>" for step in steps)
    body = []
    for prompt_index, image_index in rows:
        label = f"{prompts.get(prompt_index, '')} (image {image_index})"
        tds = []
        for step in steps:
            data = cells.get((step, prompt_index, image_index))
            if data is None:
                tds.append("<td></td>")
                continue
            uri = "data:image/png;base64," + base64.b64encode(data).decode()
            tds.append(f'<td><img class="sample" src="{uri}" alt="step {step}"></td>')
        body.append(f"<tr><th>{html.escape(label)}</th>{''.join(tds)}</tr>")
    return (
        '<h2>Validation images</h2>\n<table class="samples">\n'
        f"<thead><tr><th>prompt</th>{head}</tr></thead>\n<tbody>\n"
        + "\n".join(body)
        + "\n</tbody>\n</table>"
    )


def render_timeline_html(
    job: Job,
    events: Sequence[JobEvent],
    *,
    now: datetime | None = None,
    samples: Sequence[tuple[SampleImageInfo, bytes]] = (),
) -> str:
    """A self-contained page: the SVG inline, a table of the leases and the validation images
    at their steps; no scripts, no links."""
    drawing = layout_timeline(job, events, now=now)
    end = _end_of_axis(job, events, now)
    rows = []
    for lease in leases_from_events(events):
        ended = lease.ended_at or end

        def rel(at: datetime) -> str:
            return "+" + format_duration((at - job.created_at).total_seconds())

        cells = [
            str(lease.epoch or ""),
            lease.machine_id,
            rel(lease.granted_at),
            rel(ended) if lease.ended_at else "",
            format_duration(lease.held_seconds(end)),
            lease.outcome.value,
            f"{lease.start_step} → {lease.end_step if lease.end_step is not None else '?'}",
            ", ".join(str(c.step) for c in lease.checkpoints),
            lease.detail or "",
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    headers = [
        "epoch",
        "machine",
        "granted",
        "ended",
        "held",
        "outcome",
        "steps",
        "checkpoints",
        "note",
    ]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(drawing.title)}</title>
<style>
body {{ font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin-top: 16px; font-size: 13px; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; }}
th {{ color: #555; font-weight: 600; }}
svg {{ max-width: 100%; height: auto; }}
img.sample {{ width: 128px; height: 128px; image-rendering: pixelated; }}
h2 {{ font-size: 16px; margin-top: 24px; }}
</style>
</head>
<body>
{drawing_to_svg(drawing)}
<table>
<thead><tr>{"".join(f"<th>{h}</th>" for h in headers)}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody>
</table>
{_samples_html(samples)}
</body>
</html>
"""


_PIL_ANCHORS = {"start": "ls", "middle": "ms", "end": "rs"}


def render_timeline_png(
    job: Job, events: Sequence[JobEvent], *, now: datetime | None = None, scale: int = 2
) -> bytes:
    """The same drawing as a PNG, `scale` times the SVG's size (2: crisp on high-DPI screens).

    Needs Pillow, which ships with the `worker` extra rather than the core install.
    """
    return drawing_to_png(layout_timeline(job, events, now=now), scale=scale)


def drawing_to_png(drawing: Drawing, *, scale: int = 2) -> bytes:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise FailedPrecondition(
            "PNG output needs Pillow: `pip install pillow` (or lorafleet[worker]),"
            " or write the timeline to a .html or .svg file instead"
        ) from None

    image = Image.new("RGB", (drawing.width * scale, drawing.height * scale), "#ffffff")
    draw = ImageDraw.Draw(image)
    fonts: dict[float, ImageFont.FreeTypeFont | ImageFont.ImageFont] = {}

    def font(size: float) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
        if size not in fonts:
            fonts[size] = ImageFont.load_default(size=size * scale)
        return fonts[size]

    def pts(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(x * scale, y * scale) for x, y in points]

    for shape in drawing.shapes:
        match shape:
            case Rect():
                if shape.fill == "none" and shape.stroke is None:
                    continue
                box = pts([(shape.x, shape.y), (shape.x + shape.w, shape.y + shape.h)])
                draw.rectangle(
                    box,
                    fill=None if shape.fill == "none" else shape.fill,
                    outline=shape.stroke,
                    width=scale,
                )
            case Line():
                draw.line(
                    pts([(shape.x1, shape.y1), (shape.x2, shape.y2)]),
                    fill=shape.stroke,
                    width=max(1, round(shape.width * scale)),
                )
            case Polyline():
                draw.line(
                    pts(shape.points),
                    fill=shape.stroke,
                    width=max(1, round(shape.width * scale)),
                    joint="curve",
                )
            case Polygon():
                draw.polygon(pts(shape.points), fill=shape.fill, outline=shape.stroke, width=scale)
            case Circle():
                box = pts(
                    [
                        (shape.cx - shape.r, shape.cy - shape.r),
                        (shape.cx + shape.r, shape.cy + shape.r),
                    ]
                )
                draw.ellipse(box, fill=shape.fill, outline=shape.stroke, width=scale)
            case Text():
                draw.text(
                    (shape.x * scale, shape.y * scale),
                    shape.text,
                    fill=shape.fill,
                    font=font(shape.size),
                    anchor=_PIL_ANCHORS[shape.anchor],
                    # The bundled font has no bold face; a thin outline in the same ink reads
                    # as one.
                    stroke_width=1 if shape.bold else 0,
                    stroke_fill=shape.fill,
                )
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------
# Files and the CLI entry.

_FORMATS = {".html": "html", ".htm": "html", ".svg": "svg", ".png": "png"}


def write_timeline(
    job: Job,
    events: Sequence[JobEvent],
    path: str | Path,
    *,
    now: datetime | None = None,
    samples: Sequence[tuple[SampleImageInfo, bytes]] = (),
) -> Path:
    """Writes the timeline in the format the suffix names: .html (or .htm), .svg or .png."""
    target = Path(path)
    kind = _FORMATS.get(target.suffix.lower())
    if kind is None:
        raise InvalidArgument(
            "path", f"{target.name}: use a .html, .svg or .png file name (got {target.suffix!r})"
        )
    if kind == "png":
        target.write_bytes(render_timeline_png(job, events, now=now))
    elif kind == "svg":
        target.write_text(render_timeline_svg(job, events, now=now), encoding="utf-8")
    else:
        target.write_text(
            render_timeline_html(job, events, now=now, samples=samples), encoding="utf-8"
        )
    return target


async def timeline_command(client: AsyncClient, job_id: str, path: str | Path) -> Path:
    """`lorafleet timeline JOB_ID PATH`: fetches the job and its events, writes the picture.

    A job still in flight is drawn up to now. Rendering (Pillow for PNG) runs in a thread so
    the event loop stays free.
    """
    # Events first: a job read afterwards is at least as new, so its state covers every event.
    events = await client.events(job_id)
    job = await client.get(job_id)
    samples: list[tuple[SampleImageInfo, bytes]] = []
    if _FORMATS.get(Path(path).suffix.lower()) == "html" and any(
        e.kind is EventKind.SAMPLES for e in events
    ):
        samples = await client.download_samples(job_id)
    return await asyncio.to_thread(
        write_timeline, job, events, path, now=datetime.now(UTC), samples=samples
    )
