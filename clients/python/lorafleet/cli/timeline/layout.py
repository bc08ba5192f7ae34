"""The picture laid out as plain shapes (rectangles, lines, text...), with its colours and
legend. Coordinates are SVG user units (pixels at scale 1).

Apart from the painters so that every format paints this one list of shapes and none can
drift from another; apart from the spans so that the layout only reads what they rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from lorafleet.cli.timeline.spans import (
    LeaseOutcome,
    LeaseSpan,
    SampleOutcome,
    SampleSpan,
    _state_segments,
    format_duration,
    leases_from_events,
    sample_spans_from_events,
)
from lorafleet.core.model import EventKind, Job, JobEvent, JobState

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
