"""The agent's stream to the scheduler: how one Connect stream is opened, served and lost.

agent.py holds what the worker does: its states, what each message from the scheduler does,
its leases, the drain, the loop that connects again after a stream is lost. This module holds
the transport under it, one stream at a time: `Session` and the `SchedulerStream` methods
`Agent` inherits (they read and set the agent's fields, declared below).

* `Session`: one Connect call on its channel. Writes go through one writer task in order, so
  `send` never blocks; `finish_writing` half-closes after what is queued.
* Opening (`_open_session`): a fresh channel per attempt (`_channel`: a connection of its own,
  never a shared gRPC subchannel) with `authorization: Bearer`, then Hello (`_hello`:
  `held_lease` set while a lease is live, or its final message unconfirmed) and the wait for
  Welcome. The scheduler refusing this worker's credentials is fatal (`AgentError`); any other
  failure is `StreamFailed`, after which the agent backs off and tries again.
* Serving (`_serve`): reads, handing each message to the agent's `_dispatch`; heartbeats at the
  interval the Welcome named (`_heartbeat`: the lease's latest progress, or empty while idle).
* Liveness: where the Welcome says the scheduler answers pings (`answers_ping`), the agent
  pings every quarter of its silence bound (`scheduler_silence_s`, at most a third of the lease
  TTL) and takes a stream that brought no message for the whole bound as lost: a frozen replica
  (its kernel still accepts connections and answers HTTP/2 keepalive) or a path a middlebox
  keeps open. It reconnects, through the load balancer, long before the lease could expire.
* `Terminal`: a lease's final message, until a Welcome shows the scheduler has read it
  (`_unconfirmed`); the next Hello names its lease so that the agent can say it again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog

from lorafleet.core import __version__
from lorafleet.core.errors import LorafleetError
from lorafleet.core.families import FAMILIES
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.identity import fetch_identity
from lorafleet.worker.lease_runner import LeaseRunner
from lorafleet.worker.qualify import QualificationResult
from lorafleet.worker.sample_runner import SampleRunner
from lorafleet.worker.training.resident import ResidentModel

log = structlog.get_logger(__name__)

# gRPC codes after which trying again with the same configuration cannot help.
_FATAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class AgentError(LorafleetError):
    """The worker cannot run with this configuration (e.g. the scheduler refuses its token)."""


class StreamFailed(Exception):
    """A connection attempt or an open stream failed; the agent reconnects."""


class Session:
    """One Connect stream. Writes go through one writer task in order; `send` never blocks."""

    def __init__(self, channel: grpc.aio.Channel, call: grpc.aio.StreamStreamCall) -> None:
        self.channel = channel
        self.call = call
        self._outbox: asyncio.Queue[fpb.ConnectRequest | None] = asyncio.Queue()
        self.writable = True
        # Set when the read side ended (EOF after our half-close, or an error).
        self.closed = asyncio.Event()
        self.heartbeat_interval_s = 10.0
        # Loop time of the last message read from the scheduler (the liveness check).
        self.last_heard = asyncio.get_running_loop().time()
        self.answers_ping = False
        # Why the stream ended, for the "reconnected" line.
        self.lost_because = ""
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    def send(self, message: fpb.ConnectRequest) -> None:
        if self.writable:
            self._outbox.put_nowait(message)

    def finish_writing(self) -> None:
        """Half-close after what is queued: the scheduler handles it all, then ends the stream."""
        if self.writable:
            self.writable = False
            self._outbox.put_nowait(None)

    async def _write_loop(self) -> None:
        try:
            while (message := await self._outbox.get()) is not None:
                await self.call.write(message)
            await self.call.done_writing()
        except Exception as exc:
            # The call failed or was cancelled; the read side sees it and ends the session.
            log.info("stream write failed", error=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            self.writable = False

    async def close(self) -> None:
        """Cancels the call and closes the channel; idempotent."""
        self.writable = False
        self.call.cancel()
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)
        await self.channel.close()


@dataclass(frozen=True, kw_only=True)
class Terminal:
    """JobSucceeded/JobFailed sent on a stream that may have broken before the scheduler read
    it: checked (Hello.held_lease) and re-sent on the next connection."""

    ref: fpb.LeaseRef
    message: fpb.ConnectRequest


class SchedulerStream:
    """The `Agent` methods that open and serve one stream (see the module docstring)."""

    # The agent's fields these methods use; `Agent.__init__` sets them and says what each is.
    config: WorkerConfig
    qualification: QualificationResult | None
    resident: ResidentModel
    _runner: LeaseRunner | SampleRunner | None
    _terminal: Terminal | None
    _finished: asyncio.Event
    _session: Session | None
    _session_token: str
    _lease_secrets: dict[str, str]
    _announced_lease_ttl_s: float | None
    _lost_at: tuple[float, str] | None
    _ping_nonce: int

    # What the agent does with the stream, which these methods call (agent.py).

    def _on_welcome(self, session: Session, welcome: fpb.Welcome) -> None:
        raise NotImplementedError

    def _dispatch(self, session: Session, message: fpb.ConnectResponse) -> None:
        raise NotImplementedError

    def _notify(self) -> None:
        raise NotImplementedError

    # Bounds from the announced lease TTL ------------------------------------------------------

    @property
    def reconnect_max_backoff_s(self) -> float:
        """The configured bound, and never more than a third of the lease TTL the scheduler
        announced: a worker holding a lease must get back several times before it expires."""
        bound = self.config.reconnect_max_backoff_s
        if self._announced_lease_ttl_s is not None:
            bound = min(bound, self._announced_lease_ttl_s / 3)
        return max(bound, self.config.reconnect_initial_backoff_s)

    @property
    def silence_bound_s(self) -> float:
        """How long a stream may bring nothing before it is taken as lost: the configured
        bound, and never more than a third of the announced lease TTL, so the worker notices,
        reconnects and resumes its lease (several tries) before the lease could expire."""
        bound = self.config.scheduler_silence_s
        if self._announced_lease_ttl_s is not None:
            bound = min(bound, self._announced_lease_ttl_s / 3)
        return bound

    # Opening a stream -------------------------------------------------------------------------

    def _channel(self) -> grpc.aio.Channel:
        options = [
            # Each channel its own connection. gRPC otherwise shares one subchannel (one TCP
            # connection) among channels with the same target and options, so a "fresh"
            # channel after a frozen replica went quiet would reuse the very connection that
            # went quiet, and a load balancer would never get to pick another replica.
            ("grpc.use_local_subchannel_pool", 1),
            # HTTP/2 keepalive finds a dead path that no one answers; a frozen replica's kernel
            # or a middlebox may answer it, hence the Ping/Pong check (`_liveness_loop`).
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        address = self.config.scheduler_address
        # No client interceptor (the OpenTelemetry one) on this channel: an intercepted
        # stream-stream call feeds its writes through an async generator consumed by a task of
        # gRPC's own, which a dropped stream leaves pending; it was destroyed at the next garbage
        # collection with "Task was destroyed but it is pending!" and "aclose(): asynchronous
        # generator is already running", an ERROR pair per reconnect. The scheduler traces no
        # worker stream either; a lease's spans join its job's trace through the grant's
        # traceparent (lease_runner.py).
        if self.config.tls:
            ca = self.config.tls_ca_file.read_bytes() if self.config.tls_ca_file else None
            credentials = grpc.ssl_channel_credentials(root_certificates=ca)
            return grpc.aio.secure_channel(address, credentials, options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def _hello(self) -> fpb.Hello:
        qualification = self.qualification
        assert qualification is not None
        hello = fpb.Hello(
            machine_id=self.config.machine_id,
            provider_instance_id=self.config.provider_instance_id,
            gpu_model=qualification.gpu_model,
            vram_mb=qualification.vram_mb,
            qualification=qualification.to_proto(),
            version=__version__,
            # Every family its trainer knows: it is offered jobs of these only.
            families=list(FAMILIES),
        )
        # The previous stream's token: this machine id stays ours across the reconnect.
        hello.session_token = self._session_token
        runner = self._runner
        unconfirmed = self._unconfirmed()
        held = None
        if runner is not None and runner.holds_lease:
            held = runner.ref
        elif unconfirmed is not None:
            held = unconfirmed.ref
        if held is not None:
            hello.held_lease.CopyFrom(held)
            # Only the stream the lease was granted on was given its secret: it proves ours.
            hello.held_lease_secret = self._lease_secrets.get(held.lease_id, "")
        return hello

    def _unconfirmed(self) -> Terminal | None:
        """The last lease's final message, until the scheduler is known to have read it."""
        runner = self._runner
        if runner is not None and runner.terminal_message is not None:
            # Sent, but the runner is still closing down (its task has not ended yet).
            return Terminal(ref=runner.ref, message=runner.terminal_message)
        return self._terminal

    async def _open_session(self) -> Session:
        """A stream that has been welcomed, or `StreamFailed`."""
        # A fresh channel per attempt: no hidden channel-level backoff, DNS resolved anew.
        channel = self._channel()
        call = fgrpc.WorkerServiceStub(channel).Connect(
            metadata=(("authorization", f"Bearer {self.config.worker_token}"),)
        )
        session = Session(channel, call)
        hello = self._hello()
        hello.identity.CopyFrom(await fetch_identity(self.config))
        session.send(fpb.ConnectRequest(hello=hello))
        welcome_timeout_s = self.config.welcome_timeout_s
        if self._lost_at is not None:
            # A reconnect: the replica the load balancer chose may be the frozen one again;
            # try another after the silence bound rather than the first connection's patience.
            welcome_timeout_s = min(welcome_timeout_s, self.silence_bound_s)
        try:
            async with asyncio.timeout(welcome_timeout_s):
                first = await call.read()
        except grpc.aio.AioRpcError as exc:
            await session.close()
            if exc.code() in _FATAL_CODES:
                raise AgentError(f"the scheduler refused this worker: {exc.details()}") from exc
            raise StreamFailed(f"{exc.code().name}: {exc.details()}") from exc
        except TimeoutError as exc:
            await session.close()
            raise StreamFailed("no Welcome in time") from exc
        except BaseException:
            await session.close()
            raise
        if first is grpc.aio.EOF or first.WhichOneof("message") != "welcome":
            await session.close()
            raise StreamFailed("the stream did not start with Welcome")
        session.heartbeat_interval_s = (
            first.welcome.heartbeat_interval_s or self.config.default_heartbeat_interval_s
        )
        if first.welcome.lease_ttl_s > 0:
            self._announced_lease_ttl_s = float(first.welcome.lease_ttl_s)
        session.answers_ping = first.welcome.answers_ping
        session.last_heard = asyncio.get_running_loop().time()
        self._session = session
        self._on_welcome(session, first.welcome)
        return session

    # Serving one stream -----------------------------------------------------------------------

    async def _serve(self, session: Session) -> None:
        """Reads until the stream ends or the agent finishes; heartbeats meanwhile."""
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_loop(session))
        heartbeat = loop.create_task(self._heartbeat_loop(session))
        finished = loop.create_task(self._finished.wait())
        liveness = loop.create_task(self._liveness_loop(session))
        tasks = (heartbeat, finished, liveness, reader)
        try:
            await asyncio.wait([reader, finished, liveness], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not self._finished.is_set():
                self._lost_at = (loop.time(), session.lost_because or "the stream ended")
            await session.close()
            if self._session is session:
                self._session = None
            self._notify()

    async def _read_loop(self, session: Session) -> None:
        try:
            while True:
                message = await session.call.read()
                if message is grpc.aio.EOF:
                    session.lost_because = "the scheduler ended the stream"
                    return
                session.last_heard = asyncio.get_running_loop().time()
                self._dispatch(session, message)
        except grpc.aio.AioRpcError as exc:
            # Said once, at INFO, in the "reconnected" line: a replica restarting or a load
            # balancer moving streams is routine.
            session.lost_because = f"{exc.code().name}: {exc.details()}"[:200]
        finally:
            session.closed.set()

    async def _liveness_loop(self, session: Session) -> None:
        """Returns (ending the stream) once the scheduler has said nothing for the silence
        bound, though pinged every quarter of it. Runs only where the Welcome said the
        scheduler answers pings."""
        if not session.answers_ping:
            await asyncio.Event().wait()  # an older scheduler: the stream and keepalive alone
        loop = asyncio.get_running_loop()
        while True:
            bound = self.silence_bound_s
            silent_s = loop.time() - session.last_heard
            if silent_s >= bound:
                session.lost_because = (
                    f"no answer from the scheduler for {silent_s:.1f} s (bound {bound:g} s)"
                )
                return
            self._ping_nonce += 1
            session.send(fpb.ConnectRequest(ping=fpb.Ping(nonce=self._ping_nonce)))
            await asyncio.sleep(min(bound / 4, bound - silent_s))

    async def _heartbeat_loop(self, session: Session) -> None:
        while True:
            await asyncio.sleep(session.heartbeat_interval_s)
            session.send(fpb.ConnectRequest(heartbeat=self._heartbeat()))

    def _heartbeat(self) -> fpb.Heartbeat:
        runner = self._runner
        if runner is None or not runner.holds_lease:
            return fpb.Heartbeat()  # idle: keeps the machine seen
        progress = runner.progress.latest()
        heartbeat = fpb.Heartbeat(
            lease=runner.ref,
            step=progress.step,
            loss=progress.loss,
            learning_rate=progress.learning_rate,
            seconds_per_step=progress.seconds_per_step,
            gpu_memory_mb=progress.gpu_memory_mb,
        )
        if isinstance(runner, LeaseRunner) and self.config.keep_base_model:
            # The run compiles its step on the resident model, which then holds that shape
            # (and forgets it if the run falls back to eager): a membership test, safe to read
            # while the training thread runs. Without a resident model it says nothing.
            heartbeat.step_compiled = self.resident.is_compiled(runner.compiled_shape_key)
        return heartbeat
