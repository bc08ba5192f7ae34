"""The sessions of the workers connected to this replica: the registry, and what one stream may
cost (bounds, rates, its send queue).

A session remembers; it decides nothing and never touches the ledger. The worker handler
(`worker_handler.py`) acts on what a worker says, the dispatcher (`dispatcher.py`) on what the
ledger says; both deliver through `WorkerSession.send`.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import structlog

from lorafleet.core.model import LeaseRef, Machine, SampleTask
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.scheduler import metrics

log = structlog.get_logger(__name__)


class SessionState(enum.Enum):
    CONNECTED = "connected"  # said Hello, not Ready yet
    IDLE = "idle"  # Ready: waiting for work
    LEASED = "leased"
    DRAINING = "draining"  # stopping: gets no more work
    UNQUALIFIED = "unqualified"  # failed its probe: never gets work
    CLOSED = "closed"


@dataclass(kw_only=True)
class ActiveLease:
    job_id: str
    lease_id: str
    epoch: int
    owner: str
    urls_expire_at: float
    # Checkpoint steps announced on this stream: a repeat is ignored, never verified (hashed)
    # or recorded again.
    announced_steps: set[int] = field(default_factory=set)
    # Class image indices recorded from this stream, likewise never verified again.
    announced_class_images: set[int] = field(default_factory=set)
    # Set for a sample task's lease; None for a training lease.
    task: SampleTask | None = None
    # The lease's place in the job's trace (the grant span; after a resume, the submit span):
    # what the scheduler does for this lease joins the job's trace under it.
    traceparent: str = ""
    # The job's output_format: which result files its JobSucceeded must announce.
    output_format: str = "diffusers"


@dataclass(kw_only=True)
class TokenBucket:
    """`rate_per_s` on average, `burst` at once; `take()` says whether one more may pass."""

    rate_per_s: float
    burst: float
    tokens: float = -1.0
    at: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate_per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(frozen=True, kw_only=True)
class StreamBounds:
    """What one worker stream may cost this replica (DESIGN.md, "Trust": bounded buffers and
    rates on every stream)."""

    # Replies waiting for a worker that does not read them; past this it is disconnected.
    outbox_limit: int = 64
    # Messages a worker may send: on average, and at once.
    messages_per_s: float = 20.0
    message_burst: int = 100
    # Notices written to the log (the rest are counted, and the count logged with the next).
    notices_per_minute: float = 6.0


@dataclass(eq=False, kw_only=True)
class WorkerSession:
    machine: Machine
    # sha256 of this stream's session token (Welcome.session_token).
    session_sha256: bytes
    bounds: StreamBounds
    state: SessionState = SessionState.CONNECTED
    lease: ActiveLease | None = None
    # Unbounded as a queue so the closing sentinel always fits; `send` enforces the limit.
    outbox: asyncio.Queue[fpb.ConnectResponse | None] = field(default_factory=asyncio.Queue)
    claiming: bool = False
    last_seen_touch: float = 0.0
    last_timeline_heartbeat: float = 0.0
    # Set when the worker stopped reading its replies (the stream is then closed).
    overflowed: bool = False
    overflowing: asyncio.Event = field(default_factory=asyncio.Event)
    messages: TokenBucket = field(init=False)
    notices: TokenBucket = field(init=False)
    notices_suppressed: int = 0

    def __post_init__(self) -> None:
        self.messages = TokenBucket(
            rate_per_s=self.bounds.messages_per_s, burst=self.bounds.message_burst
        )
        self.notices = TokenBucket(
            rate_per_s=self.bounds.notices_per_minute / 60.0, burst=self.bounds.notices_per_minute
        )

    def send(self, message: fpb.ConnectResponse) -> None:
        if self.state is SessionState.CLOSED or self.overflowed:
            return
        if self.outbox.qsize() >= self.bounds.outbox_limit:
            # A worker that does not read its stream must not grow this replica's memory: the
            # servicer ends the stream (see WorkerServicer.Connect).
            self.overflowed = True
            self.overflowing.set()
            return
        self.outbox.put_nowait(message)

    def holds(self, lease: LeaseRef) -> bool:
        return (
            self.lease is not None
            and self.lease.lease_id == lease.lease_id
            and self.lease.epoch == lease.epoch
        )


class WorkerSessions:
    """The sessions of the workers connected to this replica, one per machine id."""

    def __init__(self, *, bounds: StreamBounds | None = None) -> None:
        self.bounds = bounds or StreamBounds()
        self._sessions: dict[str, WorkerSession] = {}

    @property
    def by_machine(self) -> dict[str, WorkerSession]:
        return self._sessions

    def all(self) -> list[WorkerSession]:
        return list(self._sessions.values())

    def get(self, machine_id: str) -> WorkerSession | None:
        return self._sessions.get(machine_id)

    def add(self, session: WorkerSession) -> None:
        """Registers a session opened by a Hello; a previous one of its machine is closed first
        (see `WorkerHandler.connect`)."""
        self._sessions[session.machine.machine_id] = session
        metrics.OPEN_STREAMS.inc()

    def close_session(self, session: WorkerSession) -> None:
        """The stream ended (or is ending): its servicer's writer stops at the closing sentinel.
        A held lease stays in the ledger until its TTL: the worker may come back."""
        if session.state is SessionState.CLOSED:
            return
        session.state = SessionState.CLOSED
        session.outbox.put_nowait(None)
        if self._sessions.get(session.machine.machine_id) is session:
            del self._sessions[session.machine.machine_id]
            metrics.OPEN_STREAMS.dec()
        log.info("worker disconnected", machine_id=session.machine.machine_id)

    def idle(self) -> list[WorkerSession]:
        """Sessions waiting for work with no claim in flight."""
        return [
            s for s in self._sessions.values() if s.state is SessionState.IDLE and not s.claiming
        ]

    def count_idle(self) -> int:
        return sum(1 for s in self._sessions.values() if s.state is SessionState.IDLE)

    def sampling(self) -> list[WorkerSession]:
        """Sessions busy with a sample task."""
        return [
            s
            for s in self._sessions.values()
            if s.state is SessionState.LEASED and s.lease is not None and s.lease.task is not None
        ]

    def stop_worker(self, machine_id: str, reason: str) -> bool:
        """Tells one connected worker to drain and exit (scale-down, a bad node); False if it is
        not connected to this replica."""
        session = self._sessions.get(machine_id)
        if session is None:
            return False
        session.state = SessionState.DRAINING
        session.send(fpb.ConnectResponse(shutdown=fpb.Shutdown(reason=reason)))
        return True
