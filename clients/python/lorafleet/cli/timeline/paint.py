"""The painters: a laid-out drawing as SVG (hand-written, no plotting dependency), as a
self-contained HTML page (the SVG inline, a table of the leases, the validation images) and
as PNG (Pillow, imported only when a PNG is asked for, since it lives in the `worker` extra).

Apart from the layout so that each painter only translates shapes and decides nothing about
where they go.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from lorafleet.cli.timeline.layout import (
    Circle,
    Drawing,
    Line,
    Polygon,
    Polyline,
    Rect,
    Shape,
    Text,
    _end_of_axis,
    layout_timeline,
)
from lorafleet.cli.timeline.spans import format_duration, leases_from_events
from lorafleet.core.errors import FailedPrecondition
from lorafleet.core.model import Job, JobEvent

if TYPE_CHECKING:
    # Only for annotations: painting needs no gRPC.
    from lorafleet.client.api import SampleImageInfo


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
    """The timeline as an SVG document (see the package docstring for what it shows)."""
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
