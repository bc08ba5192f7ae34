"""The job's life rebuilt from its events: leases, sample task attempts, the job's states.

Pure functions of domain values, with no notion of a picture: `lorafleet report` reads the
leases too (`leases_from_events`, `format_duration`), and what the events mean can be
tested without laying anything out.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from lorafleet.core.model import EventKind, Job, JobEvent, JobState


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
