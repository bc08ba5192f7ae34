"""The batch report: exact arithmetic on constructed jobs, then the same figures from a live
scheduler where the ledger supplies GPU-seconds and the timestamps."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from lorafleet.cli.report import (
    NodeCounts,
    Summary,
    build_report,
    format_report,
    report_command,
    report_to_json,
)
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.model import EventKind, Job, JobEvent, JobState, Progress
from lorafleet.core.spec import JobSpec
from tests.clients.test_timeline import SHORT_TTL, T0, Events, at, live_history, make_job, sdk
from tests.support.fleet import Fleet


def figures(summary: Summary | None) -> tuple[float, ...] | None:
    """count, mean, median, min, max: compared with pytest.approx where floats are divided."""
    if summary is None:
        return None
    return (summary.count, summary.mean, summary.median, summary.min, summary.max)


def job_with(
    job_id: str,
    state: JobState,
    *,
    created_s: float,
    finished_s: float | None,
    gpu_seconds: float,
    max_train_steps: int,
    step: int = 0,
    labels: dict[str, str] | None = None,
) -> Job:
    return make_job(
        job_id=job_id,
        state=state,
        spec=JobSpec(
            instance_prompt="a photo of sks dog",
            instance_data_prefix="d",
            max_train_steps=max_train_steps,
            labels=labels if labels is not None else {"batch": "b1"},
        ),
        progress=Progress(
            step=step,
            max_steps=max_train_steps,
            loss=None,
            learning_rate=None,
            seconds_per_step=None,
            machine_id=None,
            updated_at=None,
        ),
        created_at=at(created_s),
        updated_at=at(finished_s if finished_s is not None else created_s),
        finished_at=at(finished_s) if finished_s is not None else None,
        gpu_seconds=gpu_seconds,
    )


def constructed() -> tuple[list[Job], dict[str, list[JobEvent]]]:
    """Four jobs of batch b1 (and one of another batch) with round numbers to check by hand."""
    jobs = [
        # Interrupted once, finished on a second machine; heartbeats say 1, 2 and 4 s/step.
        job_with(
            "a",
            JobState.SUCCEEDED,
            created_s=0,
            finished_s=100,
            gpu_seconds=3600,
            max_train_steps=1000,
            step=1000,
        ),
        # One machine, no heartbeats: seconds per step falls back to 1800 GPU-s / 500 steps.
        job_with(
            "b",
            JobState.SUCCEEDED,
            created_s=10,
            finished_s=60,
            gpu_seconds=1800,
            max_train_steps=500,
            step=500,
        ),
        # Failed on three machines before doing a step.
        job_with(
            "c", JobState.FAILED, created_s=20, finished_s=30, gpu_seconds=900, max_train_steps=800
        ),
        # Still waiting for a machine.
        job_with(
            "d", JobState.QUEUED, created_s=40, finished_s=None, gpu_seconds=0, max_train_steps=100
        ),
        job_with(
            "other",
            JobState.SUCCEEDED,
            created_s=5,
            finished_s=50,
            gpu_seconds=7200,
            max_train_steps=100,
            labels={"batch": "b2"},
        ),
    ]
    a = (
        Events("a")
        .add(EventKind.LEASE_GRANTED, 5, machine_id="m1", lease_id="a1", epoch=1)
        .add(EventKind.HEARTBEAT, 6, lease_id="a1", step=10, seconds_per_step=1.0)
        .add(EventKind.HEARTBEAT, 7, lease_id="a1", step=20, seconds_per_step=4.0)
        .add(EventKind.LEASE_EXPIRED, 40, lease_id="a1", machine_id="m1")
        .add(EventKind.LEASE_GRANTED, 41, machine_id="m2", lease_id="a2", epoch=2)
        .add(EventKind.HEARTBEAT, 50, lease_id="a2", step=500, seconds_per_step=2.0)
        .add(EventKind.SUCCEEDED, 100, lease_id="a2", machine_id="m2", step=1000)
    )
    b = (
        Events("b")
        .add(EventKind.LEASE_GRANTED, 11, machine_id="m1", lease_id="b1", epoch=1)
        .add(EventKind.SUCCEEDED, 60, lease_id="b1", machine_id="m1", step=500)
    )
    c = Events("c")
    for epoch, machine in enumerate(("m1", "m2", "m3"), start=1):
        c.add(EventKind.LEASE_GRANTED, 20 + epoch, machine_id=machine, lease_id=f"c{epoch}")
        c.add(EventKind.ATTEMPT_FAILED, 20.5 + epoch, machine_id=machine, lease_id=f"c{epoch}")
    return jobs, {"a": a.items, "b": b.items, "c": c.items}


def test_build_report_arithmetic() -> None:
    jobs, events = constructed()
    report = build_report(jobs, events, 2.0, labels={"batch": "b1"})
    assert [line.job_id for line in report.jobs] == ["a", "b", "c", "d"]
    assert (report.succeeded, report.failed, report.states[JobState.QUEUED]) == (2, 1, 1)
    assert report.states[JobState.CANCELED] == 0 and report.interrupted_jobs == 2
    # Wall time over finished jobs only: 100, 50 and 10 s.
    assert figures(report.wall_s) == pytest.approx((3, 160 / 3, 50, 10, 100))
    # Submit to first lease: 5, 1 and 1 s; the queued job has none yet.
    assert figures(report.queue_s) == pytest.approx((3, 7 / 3, 1, 1, 5))
    # a: the median of 1, 4, 2 s/step; b: 1800 GPU-s over 500 steps; c did no step.
    assert figures(report.seconds_per_step) == pytest.approx((2, 2.8, 2.8, 2.0, 3.6))
    assert report.nodes == NodeCounts(none=1, one=1, two=1, three_plus=1)
    by_id = {line.job_id: line for line in report.jobs}
    assert (by_id["a"].nodes, by_id["a"].leases, by_id["a"].interruptions) == (2, 2, 1)
    assert (by_id["c"].nodes, by_id["c"].interruptions) == (3, 3)
    # 6300 GPU-s at $2/GPU-h is $3.50: per job over all four, per LoRA over the two delivered,
    # per step over their 1500 steps.
    assert report.gpu_seconds == 6300
    assert report.cost == pytest.approx(3.5)
    assert by_id["a"].cost == pytest.approx(2.0) and by_id["c"].cost == pytest.approx(0.5)
    assert report.cost_per_job == pytest.approx(0.875)
    assert report.cost_per_succeeded_job == pytest.approx(1.75)
    assert report.succeeded_steps == 1500
    assert report.cost_per_step == pytest.approx(3.5 / 1500)


def test_time_range_and_empty_report() -> None:
    jobs, events = constructed()
    # [10 s, 40 s) after T0: b and c of batch b1; naive times count as UTC.
    since = at(10).replace(tzinfo=None)
    report = build_report(jobs, events, 1.0, labels={"batch": "b1"}, since=since, until=at(40))
    assert [line.job_id for line in report.jobs] == ["b", "c"]
    assert report.since == at(10)
    everything = build_report(jobs, events, 1.0)
    assert len(everything.jobs) == 5 and everything.gpu_seconds == 13_500

    empty = build_report([], {}, 3.0)
    assert empty.wall_s is None and empty.seconds_per_step is None
    assert (empty.cost, empty.cost_per_job, empty.cost_per_step) == (0, None, None)
    assert "Jobs: 0 (all)" in format_report(empty)
    with pytest.raises(InvalidArgument) as bad:
        build_report(jobs, events, -1.0)
    assert bad.value.field == "price_per_gpu_hour"


def test_format_and_json() -> None:
    jobs, events = constructed()
    report = build_report(jobs, events, 2.0, labels={"batch": "b1"}, until=T0 + timedelta(hours=1))
    text = format_report(report, per_job=True)
    assert "Jobs: 4 (batch=b1; created the start .. 2025-03-01T13:00:00+00:00)" in text
    assert "queued 1, succeeded 2, failed 1" in text
    assert "Nodes needed: 1: 1   2: 1   3+: 1   (never leased: 1)" in text
    # Billed node time, not "GPU time": a CPU worker is billed the same way.
    assert "Node time (billed): 6,300.0 node-s (1.750 node-h) at $2.00/h = $3.50" in text
    assert "GPU" not in text
    assert "per job $0.88 · per succeeded job $1.75 · per step $0.00233 (1,500 steps)" in text
    wall = next(line for line in text.splitlines() if line.startswith("wall time"))
    assert wall.split() == ["wall", "time", "(finished)", "3", "53s", "50s", "10s", "1m40s"]
    assert sum(line.startswith(("a ", "b ", "c ", "d ")) for line in text.splitlines()) == 4

    data = report_to_json(report)
    assert json.loads(json.dumps(data)) == data  # plain JSON values only
    assert data["nodes"] == {"0": 1, "1": 1, "2": 1, "3+": 1}
    assert data["states"]["succeeded"] == 2 and data["cost"] == pytest.approx(3.5)
    assert data["seconds_per_step"]["median"] == pytest.approx(2.8)
    assert data["filter"] == {"labels": {"batch": "b1"}, "since": None,
                              "until": "2025-03-01T13:00:00+00:00"}  # fmt: skip
    assert [j["job_id"] for j in data["per_job"]] == ["a", "b", "c", "d"]


@SHORT_TTL
async def test_report_of_real_jobs(fleet: Fleet) -> None:
    history = await live_history(fleet)
    price = 3.6  # $/GPU-h: one GPU-second costs a tenth of a cent
    async with sdk(fleet) as client:
        report = await report_command(client, labels={"batch": "report"}, price_per_gpu_hour=price)
        ids = [
            history.expired_then_resumed,
            history.drained_twice,
            history.failed,
            history.succeeded_first_time,
            history.canceled_in_queue,
        ]
        assert [line.job_id for line in report.jobs] == ids  # oldest first, other batch left out
        assert (report.succeeded, report.failed, report.states[JobState.CANCELED]) == (3, 1, 1)
        assert report.interrupted_jobs == 3
        assert report.nodes == NodeCounts(none=1, one=2, two=1, three_plus=1)
        by_id = {line.job_id: line for line in report.jobs}
        assert by_id[history.drained_twice].interruptions == 2
        # Seconds per step: medians of the heartbeats (0.5, 0.25, 0.75 -> 0.5; 1.0, 1.0; 2.0);
        # the failed job reported none and did no step.
        assert figures(report.seconds_per_step) == pytest.approx((3, 3.5 / 3, 1.0, 0.5, 2.0))
        # GPU-seconds are the ledger's, job by job; cost is their arithmetic.
        jobs = {job_id: await client.get(job_id) for job_id in ids}
        expected_gpu = {job_id: job.gpu_seconds or 0.0 for job_id, job in jobs.items()}
        assert all(expected_gpu[i] > 0 for i in ids[:4]) and expected_gpu[ids[4]] == 0
        for job_id, line in by_id.items():
            assert line.gpu_seconds == pytest.approx(expected_gpu[job_id])
            assert line.cost == pytest.approx(expected_gpu[job_id] / 1000)
        assert report.gpu_seconds == pytest.approx(sum(expected_gpu.values()))
        assert report.cost == pytest.approx(report.gpu_seconds / 1000)
        assert report.succeeded_steps == 40 + 30 + 20
        assert report.cost_per_step == pytest.approx(report.cost / 90)
        assert report.cost_per_succeeded_job == pytest.approx(report.cost / 3)
        # Wall times of all five finished jobs, from the ledger's own timestamps.
        walls = [
            (job.finished_at - job.created_at).total_seconds()
            for job in jobs.values()
            if job.finished_at is not None
        ]
        assert report.wall_s is not None and report.wall_s.count == 5
        assert (report.wall_s.min, report.wall_s.max) == (min(walls), max(walls))
        assert report.queue_s is not None and report.queue_s.count == 4

        # A time range: from the drained job's submission up to (not including) the last one's.
        since = jobs[history.drained_twice].created_at
        until = jobs[history.succeeded_first_time].created_at
        ranged = await report_command(client, since=since, until=until, price_per_gpu_hour=price)
        assert [line.job_id for line in ranged.jobs] == [history.drained_twice, history.failed]
        assert "Jobs: 2" in format_report(ranged)
