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

One module per role: `spans` rebuilds the job's life from its events, `layout` turns it into
shapes, `paint` turns shapes into SVG, HTML or PNG; this package holds the file and CLI
entry (`write_timeline`, `timeline_command`) and re-exports the entry points above.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.cli.timeline.layout import Drawing, layout_timeline
from lorafleet.cli.timeline.paint import (
    drawing_to_png,
    drawing_to_svg,
    render_timeline_html,
    render_timeline_png,
    render_timeline_svg,
)
from lorafleet.cli.timeline.spans import (
    CheckpointMark,
    Heartbeat,
    LeaseOutcome,
    LeaseSpan,
    SampleOutcome,
    SampleSpan,
    format_duration,
    leases_from_events,
    sample_spans_from_events,
)
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.model import EventKind, Job, JobEvent

if TYPE_CHECKING:
    # Only for annotations: drawing and writing a timeline need no gRPC.
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
