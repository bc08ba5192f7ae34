"""The job timeline: leases rebuilt from events, and the picture drawn from real job histories.

`live_history` drives a real scheduler with scripted workers through the lives the picture has
to tell apart (expired and resumed elsewhere, drained twice, failed, succeeded at once,
canceled while queued); the report tests use the same histories.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from lorafleet.cli.timeline import (
    LeaseOutcome,
    SampleOutcome,
    format_duration,
    layout_timeline,
    leases_from_events,
    render_timeline_html,
    render_timeline_svg,
    sample_spans_from_events,
    timeline_command,
    write_timeline,
)
from lorafleet.client import AsyncClient
from lorafleet.core.errors import FailedPrecondition, InvalidArgument
from lorafleet.core.model import EventKind, Job, JobEvent, JobState, Progress
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.fleet import Fleet
from tests.support.workers import ScriptedWorker, connect_worker, local_identity

SHA = "c" * 64
# Short enough that an abandoned lease expires within the test's bounded waits.
# A short TTL for the expiries, and every heartbeat on the timeline (the scheduler keeps one
# per half heartbeat interval; these scripted workers heartbeat faster than that).
SHORT_TTL = pytest.mark.parametrize(
    "scheduler_overrides", [{"lease_ttl_s": 2.0, "heartbeat_interval_s": 0.01}]
)

# ---------------------------------------------------------------------------------------------
# Real histories on a live scheduler.


@dataclass(frozen=True)
class History:
    """Job ids of the scripted lives, all labelled batch=report unless said otherwise."""

    expired_then_resumed: str  # spot-a: heartbeat, checkpoint 10, expires; spot-b finishes
    drained_twice: str  # drained on spot-c and spot-d, succeeds on spot-e
    failed: str  # an input fault on spot-f, an operator-run machine: failed at once
    succeeded_first_time: str  # spot-a, one lease
    canceled_in_queue: str  # never leased
    other_label: str  # batch=other, canceled in queue


async def _checkpoint(worker: ScriptedWorker, lease: fpb.Lease, step: int) -> None:
    await worker.store_checkpoint(lease, step)


async def _succeed(worker: ScriptedWorker, granted: fpb.LeaseGranted, step: int) -> None:
    await worker.store_result(granted, step)


async def live_history(fleet: Fleet) -> History:
    """Plays every life in turn. Only one job is ever queued while a worker asks for work, and
    a worker whose lease ended never says Ready again, so no job lands on an unplanned machine.
    Every wait is on an event (a message or a watched state), bounded by the harness's WAIT_S.
    """
    alice = fleet.alice
    labels = {"batch": "report"}

    def finished(job: pb.Job) -> bool:
        return job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED)

    job = await alice.submit(max_train_steps=40, labels=labels)
    async with connect_worker(fleet.channel, fleet.token, "spot-a") as a:
        first = await a.ready_for_lease()
        await a.heartbeat(first.lease, 5, seconds_per_step=0.5)
        await _checkpoint(a, first.lease, 10)
        # Silence: the sweeper expires the lease (lease_ttl_s=2) and tells the holder.
        await a.expect("lease_revoked")
    async with connect_worker(fleet.channel, fleet.token, "spot-b") as b:
        second = await b.ready_for_lease()
        assert second.lease.job_id == job.job_id and second.lease.epoch == 2
        await b.heartbeat(second.lease, 15, seconds_per_step=0.25)
        await _checkpoint(b, second.lease, 20)
        await b.heartbeat(second.lease, 25, seconds_per_step=0.75)
        await _succeed(b, second, 40)
        await alice.wait_for(job.job_id, finished)
    # Finishing deletes the checkpoints in the background; once more here makes it certain.
    await fleet.scheduler.sweeper.prune_checkpoints(job.job_id)
    expired = job.job_id

    job = await alice.submit(max_train_steps=30, labels=labels)
    for machine in ("spot-c", "spot-d"):
        async with connect_worker(fleet.channel, fleet.token, machine) as worker:
            granted = await worker.ready_for_lease()
            assert granted.lease.job_id == job.job_id
            await worker.heartbeat(granted.lease, 3, seconds_per_step=1.0)
            await worker.send(
                draining=fpb.Draining(lease=worker.ref(granted.lease), reason="spot notice")
            )
            epoch = granted.lease.epoch

            def requeued(j: pb.Job, epoch: int = epoch) -> bool:
                return j.state == pb.JOB_STATE_QUEUED and j.epoch == epoch

            await alice.wait_for(job.job_id, requeued)
    async with connect_worker(fleet.channel, fleet.token, "spot-e") as e:
        granted = await e.ready_for_lease()
        await _succeed(e, granted, 30)
        await alice.wait_for(job.job_id, finished)
    drained = job.job_id

    job = await alice.submit(max_train_steps=50, max_failures=1, labels=labels)
    # A node fault is not the job's fault (it would wait for another machine): an input fault
    # on a machine the operator runs fails it at once.
    identity = local_identity(fleet.scheduler.identity_secret, "spot-f")
    async with connect_worker(fleet.channel, fleet.token, "spot-f", identity=identity) as f:
        granted = await f.ready_for_lease()
        await f.send(
            job_failed=fpb.JobFailed(
                lease=f.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_INPUT,
                message="1.png: not an image",
            )
        )
        await alice.wait_for(job.job_id, finished)
    failed = job.job_id

    job = await alice.submit(max_train_steps=20, labels=labels)
    async with connect_worker(fleet.channel, fleet.token, "spot-a") as a:
        granted = await a.ready_for_lease()
        await a.heartbeat(granted.lease, 10, seconds_per_step=2.0)
        await _succeed(a, granted, 20)
        await alice.wait_for(job.job_id, finished)
    succeeded = job.job_id

    canceled = (await alice.submit(max_train_steps=10, labels=labels)).job_id
    await alice.cancel(canceled)
    other = (await alice.submit(max_train_steps=10, labels={"batch": "other"})).job_id
    await alice.cancel(other)
    return History(
        expired_then_resumed=expired,
        drained_twice=drained,
        failed=failed,
        succeeded_first_time=succeeded,
        canceled_in_queue=canceled,
        other_label=other,
    )


def sdk(fleet: Fleet) -> AsyncClient:
    return AsyncClient(f"127.0.0.1:{fleet.scheduler.port}", api_key=fleet.alice.api_key)


def by_class(svg: str, name: str) -> list[ET.Element]:
    """Elements whose class is exactly `name` (the SVG is parsed, so it must be well formed)."""
    return [el for el in ET.fromstring(svg).iter() if el.get("class") == name]


def tooltip(element: ET.Element) -> str:
    title = element.find("{http://www.w3.org/2000/svg}title")
    assert title is not None and title.text is not None
    return title.text


def texts(svg: str, name: str) -> list[str]:
    return [el.text or "" for el in by_class(svg, name)]


@SHORT_TTL
async def test_timeline_of_real_jobs(fleet: Fleet, tmp_path: Path) -> None:
    history = await live_history(fleet)
    async with sdk(fleet) as client:
        job = await client.get(history.expired_then_resumed)
        events = await client.events(history.expired_then_resumed)
        svg = render_timeline_svg(job, events)
        # One lane per machine, in order of first lease.
        assert [tooltip(lane) for lane in by_class(svg, "lane")] == ["spot-a", "spot-b"]
        assert len(by_class(svg, "lease expired")) == 1
        assert len(by_class(svg, "lease succeeded")) == 1
        # The expired lease's silence before the sweeper noticed is drawn, but apart.
        assert len(by_class(svg, "silent")) == 1
        # Both checkpoints, deleted once the job finished, with their steps.
        assert len(by_class(svg, "checkpoint deleted")) == 2
        assert texts(svg, "checkpoint-step") == ["10", "20"]
        assert len(by_class(svg, "heartbeat")) == 3
        # The second holder resumed from checkpoint 10, not from the last heartbeat's step 5.
        assert [lease.start_step for lease in leases_from_events(events)] == [0, 10]
        # One interruption: a cross of two strokes where the first lease expired.
        assert len(by_class(svg, "interruption")) == 2
        (title,) = texts(svg, "title")
        assert title == f"job {job.job_id} · SUCCEEDED"
        (subtitle,) = texts(svg, "subtitle")
        assert "step 40/40" in subtitle and "2 leases on 2 machines" in subtitle
        assert "1 interruption" in subtitle
        # GPU-seconds are the server's figure for the job, as reported, not recomputed here.
        assert job.gpu_seconds is not None and job.gpu_seconds > 0
        gpu = job.gpu_seconds
        assert (f"{gpu:,.0f} GPU-s" if gpu >= 10 else f"{gpu:.2f} GPU-s") in subtitle

        drained = render_timeline_svg(
            await client.get(history.drained_twice), await client.events(history.drained_twice)
        )
        assert [tooltip(lane) for lane in by_class(drained, "lane")] == [
            "spot-c",
            "spot-d",
            "spot-e",
        ]
        assert len(by_class(drained, "lease drained")) == 2
        assert len(by_class(drained, "interruption")) == 4
        assert "spot notice" in tooltip(by_class(drained, "lease drained")[0])

        failed = render_timeline_svg(
            await client.get(history.failed), await client.events(history.failed)
        )
        assert len(by_class(failed, "lease failed")) == 1
        assert texts(failed, "error") == ["1.png: not an image"]

        queued_only = render_timeline_svg(
            await client.get(history.canceled_in_queue),
            await client.events(history.canceled_in_queue),
        )
        assert by_class(queued_only, "lane") == [] and len(by_class(queued_only, "state queued"))

        # The CLI entry: the format follows the suffix.
        png = await timeline_command(client, history.expired_then_resumed, tmp_path / "j.png")
        page = await timeline_command(client, history.drained_twice, tmp_path / "j.html")

    image_module = pytest.importorskip("PIL.Image")
    with image_module.open(png) as image:
        image.load()
        drawing = layout_timeline(job, events)
        assert image.format == "PNG"
        assert image.size == (drawing.width * 2, drawing.height * 2)
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html
    # Self-contained: no scripts and nothing fetched from elsewhere.
    assert "<script" not in html and "http://" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    assert "https://" not in html and "spot notice" in html


# ---------------------------------------------------------------------------------------------
# Constructed histories: exact checks without a scheduler.

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_job(**overrides: Any) -> Job:
    values: dict[str, Any] = dict(
        job_id="job-1",
        owner="alice",
        spec=JobSpec(
            instance_prompt="a photo of sks dog", instance_data_prefix="d", max_train_steps=100
        ),
        state=JobState.RUNNING,
        epoch=1,
        failures=0,
        progress=Progress(
            step=0,
            max_steps=100,
            loss=None,
            learning_rate=None,
            seconds_per_step=None,
            machine_id=None,
            updated_at=None,
        ),
        latest_checkpoint=None,
        result=None,
        error=None,
        failure_class=None,
        machine_id=None,
        lease_id=None,
        created_at=T0,
        updated_at=T0,
        finished_at=None,
        gpu_seconds=None,
    )
    values.update(overrides)
    return Job(**values)


class Events:
    """Builds one job's events with increasing ids."""

    def __init__(self, job_id: str = "job-1") -> None:
        self.job_id = job_id
        self.items: list[JobEvent] = []

    def add(self, kind: EventKind, seconds: float, **fields: Any) -> Events:
        self.items.append(
            JobEvent(
                event_id=len(self.items) + 1,
                job_id=self.job_id,
                kind=kind,
                at=at(seconds),
                **fields,
            )
        )
        return self


def test_leases_from_events_follows_every_ending() -> None:
    events = (
        Events()
        .add(EventKind.SUBMITTED, 0, state=JobState.QUEUED)
        .add(EventKind.LEASE_GRANTED, 2, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.HEARTBEAT, 4, machine_id="m1", lease_id="l1", epoch=1, step=5)
        .add(EventKind.CHECKPOINT_COMMITTED, 5, machine_id="m1", lease_id="l1", epoch=1, step=10)
        .add(EventKind.HEARTBEAT, 6, machine_id="m1", lease_id="l1", epoch=1, step=12)
        .add(EventKind.LEASE_EXPIRED, 40, machine_id="m1", lease_id="l1", epoch=1)
        # The ledger records the last reported step at a grant; work resumes from checkpoint 10.
        .add(EventKind.LEASE_GRANTED, 41, machine_id="m2", lease_id="l2", epoch=2, step=12)
        .add(EventKind.LEASE_RESUMED, 43, machine_id="m2", lease_id="l2", epoch=2, step=10)
        .add(EventKind.HEARTBEAT, 44, machine_id="m2", lease_id="l2", epoch=2, step=20)
        .add(EventKind.CHECKPOINT_DELETED, 45, epoch=1, step=10)
        .items
    )
    first, second = leases_from_events(reversed(events))  # order comes from the event ids
    assert (first.machine_id, first.outcome, first.start_step, first.end_step) == (
        "m1",
        LeaseOutcome.EXPIRED,
        0,
        12,
    )
    assert [(c.step, c.deleted) for c in first.checkpoints] == [(10, True)]
    # An expired lease went silent at its last heartbeat; it was held until the expiry.
    assert first.silent_since == at(6)
    assert first.held_seconds(at(100)) == 38.0
    assert first.outcome.interruption
    assert (second.outcome, second.start_step, second.ended_at) == (LeaseOutcome.RUNNING, 10, None)
    assert second.resumed_at == (at(43),)
    # A lease still held counts up to now, and is not silent.
    assert second.held_seconds(at(50)) == 9.0 and second.silent_since is None
    assert not second.outcome.interruption


def test_cancel_ends_only_a_held_lease() -> None:
    queued = Events().add(EventKind.CANCELED, 3, state=JobState.CANCELED).items
    assert leases_from_events(queued) == []
    held = (
        Events()
        .add(EventKind.LEASE_GRANTED, 1, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.CANCELED, 3, machine_id="m1", lease_id="l1", epoch=1)
        .items
    )
    (lease,) = leases_from_events(held)
    assert lease.outcome is LeaseOutcome.CANCELED and not lease.outcome.interruption
    assert lease.held_seconds(at(99)) == 2.0 and lease.silent_since is None


def test_a_notice_is_drawn_on_its_lease() -> None:
    events = (
        Events()
        .add(EventKind.LEASE_GRANTED, 1, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.NOTICE, 2, machine_id="m1", lease_id="l1", epoch=1, message="no upload")
        .items
    )
    (lease,) = leases_from_events(events)
    assert lease.notices == ((at(2), "no upload"),)
    svg = render_timeline_svg(make_job(), events)
    (mark,) = by_class(svg, "notice")
    assert tooltip(mark) == "notice: no upload"


def test_gpu_seconds_are_the_servers_figure_never_recomputed() -> None:
    """One billing rule, the ledger's: the title shows `Job.gpu_seconds` whatever the events
    would add up to (here a 30 s lease, billed 1,234 s by the server's say)."""
    events = (
        Events()
        .add(EventKind.SUBMITTED, 0, state=JobState.QUEUED)
        .add(EventKind.LEASE_GRANTED, 10, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.SUCCEEDED, 40, machine_id="m1", lease_id="l1", epoch=1, step=100)
        .items
    )
    done = {"state": JobState.SUCCEEDED, "finished_at": at(40), "updated_at": at(40)}
    svg = render_timeline_svg(make_job(gpu_seconds=1234.0, **done), events)
    (subtitle,) = texts(svg, "subtitle")
    assert "1,234 GPU-s" in subtitle and "30 GPU-s" not in subtitle
    unreported = render_timeline_svg(make_job(gpu_seconds=None, **done), events)
    (subtitle,) = texts(unreported, "subtitle")
    assert "GPU-s not reported" in subtitle
    # The page's lease table shows how long each lease was held, and no billing of its own.
    page = render_timeline_html(make_job(gpu_seconds=1234.0, **done), events)
    assert "<th>held</th>" in page and "GPU-s</th>" not in page


def test_running_job_is_drawn_up_to_now() -> None:
    events = (
        Events()
        .add(EventKind.SUBMITTED, 0, state=JobState.QUEUED)
        .add(EventKind.LEASE_GRANTED, 60, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.HEARTBEAT, 90, machine_id="m1", lease_id="l1", epoch=1, step=30)
        .items
    )
    job = make_job(updated_at=at(90))
    svg = render_timeline_svg(job, events, now=at(600))
    (bar,) = by_class(svg, "lease running")
    # Granted at 60 s of a 600 s axis; held until now (the right edge of the plot).
    x, width = float(bar.get("x", "0")), float(bar.get("width", "0"))
    left, right = 180.0, 1200.0 - 40.0
    assert x == pytest.approx(left + (right - left) * 60 / 600, abs=0.1)
    assert x + width == pytest.approx(right, abs=0.1)
    assert "wall 10m so far" in texts(svg, "subtitle")[0]
    assert by_class(svg, "interruption") == []


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.04, "0.04s"),
        (0.5, "0.5s"),
        (2, "2s"),
        (2.34, "2.3s"),
        (12.4, "12s"),
        (185, "3m05s"),
        (600, "10m"),
        (7800, "2h10m"),
        (7200, "2h"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_files_by_suffix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = (
        Events()
        .add(EventKind.LEASE_GRANTED, 1, machine_id="m<1>", lease_id="l1", epoch=1)
        .add(EventKind.SUCCEEDED, 9, machine_id="m<1>", lease_id="l1", epoch=1, step=100)
        .items
    )
    job = make_job(state=JobState.SUCCEEDED, finished_at=at(9), updated_at=at(9))
    svg = write_timeline(job, events, tmp_path / "t.svg").read_text(encoding="utf-8")
    assert svg.startswith("<svg") and "m&lt;1&gt;" in svg  # machine ids are escaped
    assert write_timeline(job, events, tmp_path / "t.HTML").read_text(encoding="utf-8") == (
        render_timeline_html(job, events)
    )
    with pytest.raises(InvalidArgument) as bad:
        write_timeline(job, events, tmp_path / "t.pdf")
    assert bad.value.field == "path" and ".png" in bad.value.reason
    # Without Pillow (the `worker` extra), PNG says what to do instead; HTML still works.
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(FailedPrecondition, match=r"pip install pillow.*\.html"):
        write_timeline(job, events, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_the_legend_shows_what_is_drawn_as_it_is_drawn() -> None:
    """The legend listed heartbeats in the running colour and marks the picture did
    not have; it now lists only what is drawn, in the drawing's colours."""
    from lorafleet.cli.timeline import layout as tl

    events = (
        Events()
        .add(EventKind.LEASE_GRANTED, 1, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.HEARTBEAT, 4, machine_id="m1", lease_id="l1", epoch=1, step=5)
        .add(EventKind.SUCCEEDED, 40, machine_id="m1", lease_id="l1", epoch=1, step=100)
        .items
    )
    leases = leases_from_events(events)
    shapes, _ = tl._legend(leases, 0.0, {JobState.QUEUED, JobState.RUNNING})
    labels = [s.text for s in shapes if isinstance(s, tl.Text)]
    assert labels == ["lease succeeded", "heartbeats", "job queued", "job running"]
    fills = [s.fill for s in shapes if isinstance(s, tl.Rect)]
    succeeded = tl.OUTCOME_COLORS[LeaseOutcome.SUCCEEDED]
    # The heartbeat swatch is the lease it was drawn on, not the running colour.
    assert fills == [succeeded, succeeded, tl._QUEUED, tl._RUNNING_STRIP]
    assert tl.OUTCOME_COLORS[LeaseOutcome.RUNNING] not in fills


def test_sample_tasks_get_lanes_of_their_own() -> None:
    """Issue 32: the wall time in the title ran to the last sample task, but no lane showed
    them. Each machine that drew validation images gets a lane below the training lanes, a bar
    per attempt, ended by its SAMPLES or SAMPLES_FAILED (matched by step and machine, as the
    ledger records them without a lease id) or by its task's next start."""
    events = (
        Events()
        .add(EventKind.SUBMITTED, 0, state=JobState.QUEUED)
        .add(EventKind.LEASE_GRANTED, 1, machine_id="m1", lease_id="l1", epoch=1)
        .add(EventKind.CHECKPOINT_COMMITTED, 5, machine_id="m1", lease_id="l1", epoch=1, step=50)
        # The messages are the ledger's: 'sample task <id> attempt <epoch>'.
        .add(
            EventKind.SAMPLES_STARTED,
            6,
            machine_id="m2",
            step=50,
            message="sample task t1 attempt 1",
        )
        # m2 went away without a word; the task started again on m3.
        .add(
            EventKind.SAMPLES_STARTED,
            9,
            machine_id="m3",
            step=50,
            message="sample task t1 attempt 2",
        )
        .add(EventKind.SAMPLES, 12, machine_id="m3", step=50, message="4 validation images stored")
        .add(EventKind.SUCCEEDED, 20, machine_id="m1", lease_id="l1", epoch=1, step=100)
        .add(
            EventKind.SAMPLES_STARTED,
            21,
            machine_id="m3",
            step=100,
            message="sample task t2 attempt 1",
        )
        .add(
            EventKind.SAMPLES_STARTED,
            22,
            machine_id="m1",
            step=100,
            message="sample task t3 attempt 1",
        )
        .add(EventKind.SAMPLES_FAILED, 30, machine_id="m1", step=100, message="out of memory")
        .items
    )
    spans = sample_spans_from_events(reversed(events))
    assert [(s.task, s.machine_id, s.outcome, s.ended_at) for s in spans] == [
        ("t1", "m2", SampleOutcome.RETRIED, at(9)),
        ("t1", "m3", SampleOutcome.STORED, at(12)),
        ("t2", "m3", SampleOutcome.RUNNING, None),
        ("t3", "m1", SampleOutcome.FAILED, at(30)),
    ]
    job = make_job(state=JobState.SUCCEEDED, finished_at=at(20))
    svg = render_timeline_svg(job, events, now=at(40))
    # Training's lane, then one per machine that sampled, in order of first start.
    assert [tooltip(lane) for lane in by_class(svg, "lane")] == ["m1"]
    assert [tooltip(lane) for lane in by_class(svg, "lane samples")] == [
        "sample tasks on m2",
        "sample tasks on m3",
        "sample tasks on m1",
    ]
    (stored,) = by_class(svg, "sample stored")
    assert tooltip(stored) == (
        "validation images of step 50 on m3: 3s, stored (4 validation images stored)"
    )
    (failed,) = by_class(svg, "sample failed")
    assert "failed (out of memory)" in tooltip(failed)
    assert len(by_class(svg, "sample retried")) == 1
    assert len(by_class(svg, "sample running")) == 1
    legend = " ".join(el.text or "" for el in ET.fromstring(svg).iter() if el.text)
    for outcome in SampleOutcome:
        assert f"sample task {outcome.value}" in legend
    # A job without sample tasks draws no sample lane and no such legend entry.
    plain = render_timeline_svg(job, [e for e in events if "SAMPLES" not in e.kind.value])
    assert by_class(plain, "lane samples") == [] and "sample task" not in plain
