"""The scheduler's worker session as a state machine (sessions.py, `TRANSITIONS`): every named
transition from every state is tried; exactly the table's are allowed and land where it says,
every other one is refused with `IllegalTransition` and changes nothing. docs/DESIGN.md, "The
worker session" carries the same table, which is read here and compared with the code."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from lorafleet.core.model import LeaseRef, Machine, SampleSettings, SampleTask
from lorafleet.scheduler.sessions import (
    TRANSITIONS,
    ActiveLease,
    IllegalTransition,
    SampleLease,
    SessionState,
    StreamGate,
    TrainingLease,
    WorkerSession,
    WorkerSessions,
)

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"

# States a session holds a lease in (a draining or closed one may still hold one).
_MAY_HOLD = {SessionState.LEASED, SessionState.DRAINING, SessionState.CLOSED}


def _session() -> WorkerSession:
    sessions = WorkerSessions()
    return WorkerSession(
        machine=Machine(
            machine_id="m1",
            provider_instance_id="",
            gpu_model="cpu",
            vram_mb=0,
            qualified=True,
            version="test",
        ),
        session_sha256=b"\0" * 32,
        bounds=sessions.bounds,
        log=StreamGate().log("test"),
    )


def _training(lease_id: str = "l1") -> TrainingLease:
    return TrainingLease(job_id="j1", lease_id=lease_id, epoch=1, owner="alice")


def _sample() -> SampleLease:
    task = SampleTask(
        task_id="t1",
        job_id="j1",
        owner="alice",
        step=10,
        weights_key="k",
        weights_sha256="0" * 64,
        weights_is_checkpoint=True,
        settings=SampleSettings(
            prompts=("a photo of sks dog",),
            negative_prompt="",
            guidance_scale=5.0,
            inference_steps=4,
            seed=0,
            resolution=64,
            images_per_prompt=1,
        ),
        state="RUNNING",
        epoch=2,
        lease_id="s1",
        machine_id="m1",
    )
    return SampleLease.from_task(task, traceparent="")


def _in_state(state: SessionState, lease: ActiveLease | None) -> WorkerSession:
    """A session put in `state` directly (the only place that may: it tests the transitions)."""
    session = _session()
    session.state = state
    session.lease = lease
    return session


# Each transition with the lease a session in a given state would hold when it is called.
_CALLS: dict[str, Callable[[WorkerSession, ActiveLease | None], object]] = {
    "disqualify": lambda s, _lease: s.disqualify(),
    "resume": lambda s, _lease: s.resume(_training("l2")),
    "grant": lambda s, _lease: s.grant(_training("l2")),
    "idle": lambda s, _lease: s.idle(),
    "withdraw": lambda s, lease: s.withdraw(lease),
    "end_lease": lambda s, lease: s.end_lease(lease if lease is not None else _training()),
    "drain": lambda s, _lease: s.drain(),
    "close": lambda s, _lease: s.close(),
}


def _lease_for(transition: str, state: SessionState) -> ActiveLease | None:
    if transition in ("resume", "grant"):
        return None  # they take a new lease: the session must hold none
    if transition == "withdraw" and state is SessionState.CONNECTED:
        return None  # a grant a revocation already ended
    if transition in ("withdraw", "end_lease"):
        return _training()  # they end the lease held, whatever the state
    return _training() if state in _MAY_HOLD else None


def test_every_transition_is_tried() -> None:
    assert set(_CALLS) == set(TRANSITIONS)


@pytest.mark.parametrize("transition", sorted(TRANSITIONS))
@pytest.mark.parametrize("state", list(SessionState), ids=lambda s: s.value)
def test_only_the_tables_transitions_are_allowed(transition: str, state: SessionState) -> None:
    lease = _lease_for(transition, state)
    session = _in_state(state, lease)
    target = TRANSITIONS[transition].get(state)
    assert session.may(transition) is (target is not None)
    if target is None:
        with pytest.raises(IllegalTransition, match=transition):
            _CALLS[transition](session, lease)
        assert session.state is state  # refused: nothing changed
        assert session.lease is lease
        return
    _CALLS[transition](session, lease)
    assert session.state is target
    if transition in ("resume", "grant"):
        assert isinstance(session.lease, TrainingLease) and session.lease.lease_id == "l2"
    elif transition in ("idle", "withdraw", "end_lease"):
        assert session.lease is None
    else:
        assert session.lease is lease  # drain and close keep a held lease


def test_a_session_takes_no_second_lease() -> None:
    session = _in_state(SessionState.IDLE, None)
    session.grant(_training())
    session.state = SessionState.IDLE  # as if the table were broken: the lease still refuses
    with pytest.raises(IllegalTransition, match="while holding"):
        session.grant(_training("l2"))


def test_ending_a_lease_the_session_no_longer_holds_changes_nothing() -> None:
    """A revocation that ended the lease first: the handler's later end is a no-op."""
    session = _in_state(SessionState.LEASED, _training())
    revoked = session.lease
    assert revoked is not None and session.end_lease(revoked)
    assert session.state is SessionState.CONNECTED
    assert not session.end_lease(revoked)
    assert session.state is SessionState.CONNECTED


def test_idle_gives_back_the_lease_it_abandons() -> None:
    lease = _sample()
    session = _in_state(SessionState.LEASED, lease)
    assert session.idle() is lease
    assert (session.state, session.lease) == (SessionState.IDLE, None)


def test_the_lease_kinds_answer_only_for_themselves() -> None:
    training, sample = _training(), _sample()
    session = _in_state(SessionState.LEASED, training)
    assert session.training_lease(LeaseRef(lease_id="l1", epoch=1)) is training
    assert session.training_lease(LeaseRef(lease_id="l1", epoch=2)) is None  # another epoch
    assert session.sample_lease() is None
    session = _in_state(SessionState.LEASED, sample)
    assert session.sample_lease(LeaseRef(lease_id="s1", epoch=2)) is sample
    assert session.training_lease(LeaseRef(lease_id="s1", epoch=2)) is None


def _documented_table() -> dict[str, dict[SessionState, SessionState]]:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## The worker session", 1)[1].split("\n## ", 1)[0]
    table: dict[str, dict[SessionState, SessionState]] = {}
    for row in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", section, re.MULTILINE):
        moves: dict[SessionState, SessionState] = {}
        for part in row.group(2).split(";"):
            sources, _, target = part.partition("→")
            to = SessionState[target.strip().strip("`")]
            for source in sources.split(","):
                moves[SessionState[source.strip().strip("`")]] = to
        table[row.group(1)] = moves
    return table


def test_the_design_document_has_the_same_table() -> None:
    assert _documented_table() == {name: dict(moves) for name, moves in TRANSITIONS.items()}
