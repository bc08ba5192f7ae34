"""The sessions of the workers connected to this replica: the registry, what one stream may
cost (bounds, rates, its send queue), and what one token holder may cost across its streams
(`StreamGate`: streams per peer address, Hellos per worker token, log lines per source).

A session remembers; it decides nothing and never touches the ledger. The worker handler
(`worker_handler.py`) acts on what a worker says, the dispatcher (`dispatcher.py`) on what the
ledger says; both deliver through `WorkerSession.send`, and both change a session only through
its named transitions (`TRANSITIONS`: grant, idle, end_lease, drain, close, ...), which refuse
whatever the table does not allow. The lease a session holds is a `TrainingLease` or a
`SampleLease`; handlers ask for the kind they accept (`training_lease`, `sample_lease`).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import structlog

from lorafleet.core.errors import ResourceExhausted
from lorafleet.core.model import Job, LeaseRef, Machine, SampleTask, WarmState
from lorafleet.core.serde import ReadyReport
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.scheduler import metrics

log = structlog.get_logger(__name__)


class SessionState(enum.Enum):
    CONNECTED = "connected"  # said Hello, not Ready yet (or its lease just ended)
    IDLE = "idle"  # Ready: waiting for work
    LEASED = "leased"  # holds a training lease or a sample task
    DRAINING = "draining"  # stopping: gets no more work (may still hold its lease)
    UNQUALIFIED = "unqualified"  # failed its probe: never gets work
    CLOSED = "closed"  # the stream ended; a held lease lives on in the ledger until its TTL


class IllegalTransition(RuntimeError):
    """A session change its table does not allow: a bug in the scheduler, never a worker's
    doing (the handlers check what a worker's message allows before they change a session)."""


_OPEN = frozenset(SessionState) - {SessionState.CLOSED}

# What may follow what: each named transition, from the states it may start in to where it
# leads. Every change of a session's state goes through one of them (`WorkerSession._move`);
# docs/DESIGN.md, "The worker session" has the same table with who calls each.
TRANSITIONS: Mapping[str, Mapping[SessionState, SessionState]] = {
    # Hello from a machine that failed its qualification probe.
    "disqualify": {SessionState.CONNECTED: SessionState.UNQUALIFIED},
    # Hello resuming a lease the worker held, with its secret.
    "resume": {SessionState.CONNECTED: SessionState.LEASED},
    # Ready: waits for work; a lease still held is given up.
    "idle": {
        SessionState.CONNECTED: SessionState.IDLE,
        SessionState.IDLE: SessionState.IDLE,
        SessionState.LEASED: SessionState.IDLE,
    },
    # A training lease or a sample task claimed for it.
    "grant": {SessionState.IDLE: SessionState.LEASED},
    # A grant being prepared will not be sent (its URLs could not be signed, or it was revoked
    # meanwhile): the worker never saw it and still waits for work.
    "withdraw": {SessionState.LEASED: SessionState.IDLE, SessionState.CONNECTED: SessionState.IDLE},
    # The lease ended (result, failure, samples stored, refused, revoked). A draining session
    # stays draining; a closed one stays closed (a message was in flight when its stream ended).
    "end_lease": {
        SessionState.LEASED: SessionState.CONNECTED,
        SessionState.DRAINING: SessionState.DRAINING,
        SessionState.CLOSED: SessionState.CLOSED,
    },
    # Draining, or the scaler's Shutdown: no more work; a held lease is kept until it ends.
    "drain": dict.fromkeys(_OPEN, SessionState.DRAINING),
    # The stream ended.
    "close": dict.fromkeys(_OPEN, SessionState.CLOSED),
}


@dataclass(kw_only=True)
class _Lease:
    """What every lease on a stream is named and traced by."""

    job_id: str
    lease_id: str
    epoch: int
    owner: str
    # The lease's place in the job's trace, its grant span (the ledger keeps it for a resume,
    # `set_lease_traceparent`): what the scheduler does for this lease joins the trace under it.
    traceparent: str = ""

    def ref(self) -> LeaseRef:
        return LeaseRef(lease_id=self.lease_id, epoch=self.epoch)


@dataclass(kw_only=True)
class TrainingLease(_Lease):
    """A job's training lease, as this stream holds it (`from_job`, at a grant or a resume)."""

    # When its URLs need renewing (monotonic s; 0: at the next heartbeat).
    urls_expire_at: float = 0.0
    # Checkpoint steps announced on this stream: a repeat is ignored, never verified (hashed)
    # or recorded again.
    announced_steps: set[int] = field(default_factory=set)
    # Class image indices recorded from this stream, likewise never verified again.
    announced_class_images: set[int] = field(default_factory=set)
    # The job's output_format: which result files its JobSucceeded must announce.
    output_format: str = "diffusers"
    # The job's max_train_steps: no heartbeat of a training lease reports a later step.
    max_train_steps: int = 0
    # The job's lora_rank: its result files hold adapters of that rank (formats.py).
    lora_rank: int = 0
    # The tensors (name -> shape) every checkpoint of the job must have: the earlier verified
    # checkpoints', learnt at this lease's first (formats.py).
    checkpoint_layout: Mapping[str, tuple[int, ...]] | None = None

    @classmethod
    def from_job(cls, job: Job, *, traceparent: str) -> TrainingLease:
        """The lease `job` names now (the ledger's claim or resume returned it)."""
        if job.lease_id is None:
            raise ValueError(f"job {job.job_id} has no live lease")
        return cls(
            job_id=job.job_id,
            lease_id=job.lease_id,
            epoch=job.epoch,
            owner=job.owner,
            traceparent=traceparent,
            output_format=job.spec.output_format,
            max_train_steps=job.spec.max_train_steps,
            lora_rank=job.spec.lora_rank,
        )


@dataclass(kw_only=True)
class SampleLease(_Lease):
    """A sample task's lease (`from_task`): it trains nothing, commits no checkpoint or result,
    and its messages never touch its job."""

    task: SampleTask

    @classmethod
    def from_task(cls, task: SampleTask, *, traceparent: str) -> SampleLease:
        if task.lease_id is None:
            raise ValueError(f"sample task {task.task_id} has no live lease")
        return cls(
            job_id=task.job_id,
            lease_id=task.lease_id,
            epoch=task.epoch,
            owner=task.owner,
            traceparent=traceparent,
            task=task,
        )


ActiveLease = TrainingLease | SampleLease


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


class KeyedBuckets:
    """One `TokenBucket` per key (a peer address, a worker token), at most `max_keys` of them
    remembered: the least recently used is forgotten first, so memory stays bounded whatever
    the keys; a forgotten key comes back with a full bucket, which gains only a holder of more
    than `max_keys` addresses that each stay quiet meanwhile."""

    def __init__(self, *, rate_per_s: float, burst: float, max_keys: int = 10_000) -> None:
        self._rate_per_s = rate_per_s
        self._burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(rate_per_s=self._rate_per_s, burst=self._burst)
            self._buckets[key] = bucket
            if len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take()


def peer_source(peer: str) -> str:
    """The source a gRPC peer string names, for per-source bounds: its IPv4 address, or its
    IPv6 /64 (one host commonly holds a whole /64 and may pick any address in it); without the
    port, which a reconnect loop changes every time."""
    kind, _, rest = unquote(peer).partition(":")  # gRPC may percent-encode the brackets
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]") if rest.startswith("[") else rest
        try:
            address = ipaddress.IPv6Address(host.partition("%")[0])
        except ValueError:
            return host
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return peer


@dataclass(frozen=True, kw_only=True)
class GateBounds:
    """What one token holder may cost this replica across all its streams (docs/DESIGN.md, "Trust"):
    the stream bounds below hold per stream, and a reconnect loop opens a new stream each time.
    0 for a rate: no bound."""

    # Streams one source (peer address) may open: on average, and at once.
    streams_per_peer_per_min: float = 60.0
    stream_burst_per_peer: int = 30
    # Hellos accepted per worker token. One token serves a whole fleet, so this is a fleet-wide
    # bound: the burst lets every worker of a large fleet reconnect at once after a restart.
    hellos_per_token_per_s: float = 20.0
    hello_burst_per_token: int = 2000
    # Hellos of one provider-verified machine: their own budget, so that a flood of unverified
    # Hellos (from any number of addresses) spending the token's cannot keep real machines out.
    hellos_per_verified_machine_per_min: float = 12.0
    hello_burst_per_verified_machine: int = 6
    # Log lines about one source's streams (connects, disconnects, refusals, notices).
    log_lines_per_peer_per_min: float = 60.0
    log_burst_per_peer: int = 120


class SourceLog:
    """The log of one source's streams, rate-limited per source (`StreamGate.log`): a line
    past the bound is dropped and counted, the count going out with the next line let through."""

    def __init__(self, gate: StreamGate, source: str) -> None:
        self._gate = gate
        self.source = source

    def info(self, event: str, **fields: Any) -> None:
        self._emit(log.info, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(log.warning, event, fields)

    def _emit(self, method: Any, event: str, fields: dict[str, Any]) -> None:
        suppressed = self._gate.take_log_line(self.source)
        if suppressed is None:
            return
        if suppressed:
            fields["log_lines_suppressed"] = suppressed
        method(event, peer=self.source, **fields)


class StreamGate:
    """Per-holder bounds on this replica's worker streams: streams per source address, Hellos
    per worker token, log lines per source. In memory, per replica: two replicas admit twice
    as much, which the bounds' purpose (no loop from one holder costs a replica more than a
    set rate) allows."""

    def __init__(self, bounds: GateBounds | None = None) -> None:
        self.bounds = b = bounds or GateBounds()
        self._streams = KeyedBuckets(
            rate_per_s=b.streams_per_peer_per_min / 60.0, burst=b.stream_burst_per_peer
        )
        self._hellos = KeyedBuckets(
            rate_per_s=b.hellos_per_token_per_s, burst=b.hello_burst_per_token, max_keys=100
        )
        self._verified_hellos = KeyedBuckets(
            rate_per_s=b.hellos_per_verified_machine_per_min / 60.0,
            burst=b.hello_burst_per_verified_machine,
        )
        self._lines = KeyedBuckets(
            rate_per_s=b.log_lines_per_peer_per_min / 60.0, burst=b.log_burst_per_peer
        )
        self._suppressed: OrderedDict[str, int] = OrderedDict()

    def admit_stream(self, source: str) -> None:
        """A stream opened from `source`; raises ResourceExhausted past its rate."""
        if self.bounds.streams_per_peer_per_min and not self._streams.take(source):
            raise ResourceExhausted(
                f"connect: more than {self.bounds.stream_burst_per_peer} streams at once or"
                f" {self.bounds.streams_per_peer_per_min:g} per minute from {source}"
            )

    def admit_hello(self, token_key: str, *, verified_machine: str = "") -> None:
        """A Hello under the worker token `token_key` (a digest, never the token); raises
        ResourceExhausted past its budget. A Hello whose machine id a provider vouched for
        (`verified_machine`: the provider and the id) is charged to that machine's own budget;
        any other to the token's, which every unverified stream shares."""
        b = self.bounds
        if verified_machine:
            rate = b.hellos_per_verified_machine_per_min
            if rate and not self._verified_hellos.take(verified_machine):
                raise ResourceExhausted(
                    f"hello: more than {b.hello_burst_per_verified_machine} Hellos at once or"
                    f" {rate:g} per minute from this machine"
                )
            return
        if b.hellos_per_token_per_s and not self._hellos.take(token_key):
            raise ResourceExhausted(
                f"hello: more than {b.hellos_per_token_per_s:g} Hellos per second"
                " under this worker token"
            )

    def spend_hello(self, token_key: str) -> None:
        """A Hello refused for its proof of identity costs the token's budget all the same:
        forgeries cost what unverified Hellos cost, never a verified machine's budget."""
        if self.bounds.hellos_per_token_per_s:
            self._hellos.take(token_key)

    def log(self, source: str) -> SourceLog:
        return SourceLog(self, source)

    def take_log_line(self, source: str) -> int | None:
        """None: drop this line; else how many were dropped since the last one let through."""
        if not self.bounds.log_lines_per_peer_per_min:
            return 0
        if not self._lines.take(source):
            self._suppressed[source] = self._suppressed.pop(source, 0) + 1
            if len(self._suppressed) > 10_000:
                self._suppressed.popitem(last=False)
            return None
        return self._suppressed.pop(source, 0)


@dataclass(frozen=True, kw_only=True)
class StreamBounds:
    """What one worker stream may cost this replica (docs/DESIGN.md, "Trust": bounded buffers and
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
    """One worker stream on this replica. `state` and `lease` change only through the named
    transitions below (`TRANSITIONS`); read them freely."""

    machine: Machine
    # sha256 of this stream's session token (Welcome.session_token).
    session_sha256: bytes
    bounds: StreamBounds
    # This stream's lines in the log, rate-limited per source address across its streams.
    log: SourceLog
    state: SessionState = SessionState.CONNECTED
    lease: ActiveLease | None = None
    # What its latest Ready said it holds and what its checkpoints cost: the claim prefers jobs
    # it is warm for, and sizes its automatic checkpoint interval (dispatcher.py). Its own
    # claims, used for its own grants only.
    ready: ReadyReport = field(
        default_factory=lambda: ReadyReport(warm=WarmState(), checkpoint_cost_s=None)
    )
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
    # The training lease revoked because its job was canceled: its holder may still say, once,
    # the step it reached (`take_canceled`), so a canceled job shows where it stopped rather
    # than its last heartbeat's step (issue 32).
    canceled_lease: TrainingLease | None = None

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

    def granted(self, lease: ActiveLease) -> bool:
        """Whether the session is still LEASED with `lease` (a grant in preparation may go)."""
        return self.lease is lease and self.state is SessionState.LEASED

    def training_lease(self, ref: LeaseRef | None = None) -> TrainingLease | None:
        """This stream's training lease (only if it is the one `ref` names, when given)."""
        lease = self.lease
        if isinstance(lease, TrainingLease) and (ref is None or self.holds(ref)):
            return lease
        return None

    def take_canceled(self, ref: LeaseRef) -> TrainingLease | None:
        """The lease `ref` names if it is the one revoked from this stream for a cancel; it is
        forgotten, so its holder reports its final step once at most."""
        lease = self.canceled_lease
        if lease is None or lease.lease_id != ref.lease_id or lease.epoch != ref.epoch:
            return None
        self.canceled_lease = None
        return lease

    def sample_lease(self, ref: LeaseRef | None = None) -> SampleLease | None:
        """This stream's sample task lease (only if it is the one `ref` names, when given)."""
        lease = self.lease
        if isinstance(lease, SampleLease) and (ref is None or self.holds(ref)):
            return lease
        return None

    # Transitions ------------------------------------------------------------------------------

    def may(self, transition: str) -> bool:
        """Whether `transition` may start from this session's state."""
        return self.state in TRANSITIONS[transition]

    def _move(self, transition: str) -> None:
        to = TRANSITIONS[transition].get(self.state)
        if to is None:
            raise IllegalTransition(
                f"{transition} from {self.state.value} (machine {self.machine.machine_id})"
            )
        self.state = to

    def disqualify(self) -> None:
        self._move("disqualify")

    def resume(self, lease: TrainingLease) -> None:
        self._take(lease, "resume")

    def grant(self, lease: ActiveLease) -> None:
        self._take(lease, "grant")

    def _take(self, lease: ActiveLease, transition: str) -> None:
        if self.lease is not None:
            raise IllegalTransition(f"{transition} while holding lease {self.lease.lease_id}")
        self._move(transition)
        self.lease = lease

    def idle(self) -> ActiveLease | None:
        """The worker said Ready: it waits for work. Returns the lease it still held, which it
        has given up (the caller ends it in the ledger)."""
        self._move("idle")
        abandoned, self.lease = self.lease, None
        return abandoned

    def withdraw(self, lease: ActiveLease | None) -> None:
        """The grant of `lease` will not be sent; None: it was revoked already."""
        if self.lease is not lease:
            raise IllegalTransition(f"withdraw of a lease this session does not hold ({lease})")
        self._move("withdraw")
        self.lease = None

    def end_lease(self, lease: ActiveLease) -> bool:
        """`lease` ended. False (and nothing changes) when it is no longer this session's: a
        revocation or a Ready ended it first."""
        if self.lease is not lease:
            return False
        self._move("end_lease")
        self.lease = None
        return True

    def drain(self) -> None:
        """The worker is leaving (its Draining, or a Shutdown sent to it): no more work. A held
        lease stays until its own message ends it."""
        self._move("drain")

    def close(self) -> None:
        """The stream ended. A held lease stays: it lives on in the ledger until its TTL, and a
        message about it may still be in flight."""
        self._move("close")


class WorkerSessions:
    """The sessions of the workers connected to this replica, one per machine id."""

    def __init__(
        self, *, bounds: StreamBounds | None = None, gate: StreamGate | None = None
    ) -> None:
        self.bounds = bounds or StreamBounds()
        self.gate = gate or StreamGate()
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
        session.close()
        session.outbox.put_nowait(None)
        if self._sessions.get(session.machine.machine_id) is session:
            del self._sessions[session.machine.machine_id]
            metrics.OPEN_STREAMS.dec()
        session.log.info("worker disconnected", machine_id=session.machine.machine_id)

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
            if s.state is SessionState.LEASED and s.sample_lease() is not None
        ]

    def stop_worker(self, machine_id: str, reason: str) -> bool:
        """Tells one connected worker to drain and exit (scale-down, a bad node); False if it is
        not connected to this replica."""
        session = self._sessions.get(machine_id)
        if session is None:
            return False
        session.drain()
        session.send(fpb.ConnectResponse(shutdown=fpb.Shutdown(reason=reason)))
        return True
