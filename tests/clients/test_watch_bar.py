"""The watch bar's ETA is the job's own (`progress.eta_seconds`), not rich's guess."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import Progress as Bar
from rich.progress import TimeRemainingColumn

from lorafleet.cli.render import format_eta, watch_columns
from lorafleet.core.model import Job, JobState, Progress
from tests.clients.test_timeline import make_job


def _job(state: JobState = JobState.RUNNING) -> Job:
    progress = Progress(
        step=75,
        max_steps=100,
        loss=0.2,
        learning_rate=None,
        seconds_per_step=5.0,
        machine_id="m1",
        updated_at=None,
    )
    return make_job(progress=progress, state=state)


def test_the_bar_shows_the_jobs_own_eta() -> None:
    job = _job()
    assert job.progress.eta_seconds == 125.0
    assert format_eta(job) == "0:02:05"
    assert not any(isinstance(c, TimeRemainingColumn) for c in watch_columns())
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    with Bar(*watch_columns(), console=console, auto_refresh=False) as bar:
        bar.add_task(
            "t",
            total=100,
            completed=75,
            state="running",
            loss="0.2",
            sps="5.00",
            eta=format_eta(job),
        )
        bar.refresh()
    assert "ETA 0:02:05" in out.getvalue()


def test_no_eta_once_the_job_is_not_running() -> None:
    assert format_eta(_job(JobState.SUCCEEDED)) == "-"
    assert format_eta(_job(JobState.QUEUED)) == "-"
