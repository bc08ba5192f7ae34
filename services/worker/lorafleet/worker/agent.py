"""The worker agent: one explicit connection state machine around the scheduler stream.

States and transitions (`State`, `TRANSITIONS`; any other transition is a bug and raises)::

    from         on                                        to
    QUALIFYING   probe done                                CONNECTING
    CONNECTING   Welcome, no live lease                    IDLE        (then Ready)
    CONNECTING   Welcome resumed our lease                 LEASED
    CONNECTING   attempt failed                            CONNECTING  (after backoff)
    IDLE         LeaseGranted                              LEASED
    LEASED       lease over: succeeded, failed,            IDLE        (Ready once the training
                 revoked, rejected                                      thread has stopped)
    IDLE/LEASED  stream lost                               CONNECTING  (the lease trains on)
    CONNECTING/  SIGTERM, SIGINT, Shutdown                 DRAINING
    IDLE/LEASED
    DRAINING     drained, or the grace period is over      STOPPED
    any          shutdown(), or a drain while QUALIFYING   STOPPED

* CONNECTING: opens a stream and waits for its Welcome (stream.py). Failed attempts back off by
  the shared rule (`lorafleet.core.retry.backoff_delay`: exponential, full jitter), bounded by
  `reconnect_max_backoff_s`. A lease keeps training meanwhile; only its messages wait.
* Liveness: heartbeats, and pings where the scheduler answers them, within a silence bound of
  at most a third of the lease TTL (stream.py). A stream that brought nothing for the whole
  bound is lost, and the agent reconnects long before the lease could expire. A reconnect is
  routine: one INFO line ("reconnected", with why and how long it took).
* IDLE: says Ready once it is free (a revoked lease's thread has stopped), then waits: work is
  pushed. Heartbeats with an empty lease keep the machine seen.
* LEASED: a `LeaseRunner` runs the lease; heartbeats carry its latest progress only. When it ends
  (success, failure, revocation, rejection) the agent goes back to IDLE and says Ready.
* DRAINING: stop after the current step, snapshot, upload, CheckpointCommitted, then
  `Draining(lease)` so the job is re-queued at once; everything within `drain_grace_s`. A
  stream lost meanwhile is reconnected (the lease is resumed) so the drain can finish.
* STOPPED: the stream is closed and `run()` returns.

The lease itself (`_runner`) is data next to the state, not a state: it survives CONNECTING and
DRAINING.

Beside the connection, the agent acts on what the provider's metadata service says
(metadata_services.py): an EC2 spot interruption notice drains it, exactly as SIGTERM does; on
SaladCloud, a failed qualification probe asks for another node. Both stop with the agent.

Lifecycle: `async with Agent(config) as agent: await agent.run()`; `drain(reason)` asks for a
graceful stop (signal handlers call it); `shutdown()` stops at once and is idempotent.

The agent owns the thread its leases train on (`TrainingThread`): started with the agent, shut
down when `run()` ends. A run still inside a step when the grace period is over is left to
finish alone (the thread is a daemon, see training_thread.py), so the process exits promptly.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import random
from collections.abc import Callable

import structlog

from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.core.retry import backoff_delay
from lorafleet.core.serde import MAX_CHECKPOINT_COST_S
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker import metrics
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease_runner import (
    LeaseLost,
    LeaseResult,
    LeaseRunner,
    TrainerFactory,
)
from lorafleet.worker.metadata_services import MetadataServices
from lorafleet.worker.qualify import QualificationResult, probe
from lorafleet.worker.sample_runner import SampleRunner
from lorafleet.worker.stream import AgentError as AgentError  # `run()` raises it; import it here
from lorafleet.worker.stream import SchedulerStream, Session, StreamFailed, Terminal
from lorafleet.worker.training import Trainer
from lorafleet.worker.training.resident import ResidentModel
from lorafleet.worker.training.samples import SamplePipelines
from lorafleet.worker.training_thread import TrainingThread
from lorafleet.worker.transfer import TransferClient

log = structlog.get_logger(__name__)

# Reserve of the drain grace kept for saying Draining after the checkpoint phase.
_DRAIN_REPLY_RESERVE_S = 5.0
# How long stopping an idle training thread may take (it only has to leave its queue).
_IDLE_THREAD_STOP_S = 5.0


class State(enum.Enum):
    QUALIFYING = "qualifying"
    CONNECTING = "connecting"
    IDLE = "idle"
    LEASED = "leased"
    DRAINING = "draining"
    STOPPED = "stopped"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.QUALIFYING: frozenset({State.CONNECTING, State.STOPPED}),
    State.CONNECTING: frozenset({State.IDLE, State.LEASED, State.DRAINING, State.STOPPED}),
    State.IDLE: frozenset({State.LEASED, State.CONNECTING, State.DRAINING, State.STOPPED}),
    State.LEASED: frozenset({State.IDLE, State.CONNECTING, State.DRAINING, State.STOPPED}),
    State.DRAINING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


def same_lease(a: fpb.LeaseRef, lease_id: str, epoch: int) -> bool:
    return bool(a.lease_id) and a.lease_id == lease_id and a.epoch == epoch


class _Link:
    """The `LeaseLink` one runner uses: sends through whatever stream is current."""

    def __init__(self, agent: Agent, runner_ref: fpb.LeaseRef) -> None:
        self._agent = agent
        self._ref = runner_ref

    async def send(self, message: fpb.ConnectRequest) -> None:
        await self._agent._send_for_lease(self._ref, message)


class Agent(SchedulerStream, MetadataServices, AsyncLifecycle):
    """The worker process's one long-lived component; see the module docstring."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        trainer_factory: TrainerFactory | None = None,
        qualification: QualificationResult | None = None,
        on_state_change: Callable[[State], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`trainer_factory` replaces `Trainer` (tests observe runs through it);
        `qualification` skips the probe; `on_state_change` sees every new state (metrics)."""
        self.config = config
        self._on_state_change = on_state_change
        self._trainer_factory = trainer_factory
        self.qualification = qualification
        self._rng = rng or random.Random()
        self._state = State.QUALIFYING
        self._changed = asyncio.Event()
        self._session: Session | None = None
        self._runner: LeaseRunner | SampleRunner | None = None
        # The base model kept loaded between leases, shared by training runs and sample tasks
        # (used on the training thread only).
        self.resident = ResidentModel()
        self.sample_pipelines = SamplePipelines(self.resident)
        self._runner_task: asyncio.Task[LeaseResult] | None = None
        self._terminal: Terminal | None = None
        # What this worker was given that proves it is itself after a reconnect: the session
        # token of its last stream, and the secret of each lease it may still hold.
        self._session_token = ""
        # The scheduler's Welcome says how long a silent lease lives; reconnects stay below it.
        self._announced_lease_ttl_s: float | None = None
        # Set when a welcomed stream ends (loop time, why): the next Welcome logs the reconnect.
        self._lost_at: tuple[float, str] | None = None
        # The replica of the current (or last) stream, as its Welcome named it.
        self.scheduler_id = ""
        self._ping_nonce = 0
        self._lease_secrets: dict[str, str] = {}
        self._transfer = TransferClient(config.transfer)
        self._training = TrainingThread(name=f"lorafleet-training-{config.machine_id}")
        self._finished = asyncio.Event()
        self._stopped = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        # When a drain's grace period ends (loop time), once one has started.
        self._drain_deadline: float | None = None
        # The lease a drain still has to report in `Draining`, once its runner has ended.
        self._draining_lease: fpb.LeaseRef | None = None
        # Helpers beside the connection: the spot-notice watcher, a reallocation request.
        self._side_tasks: set[asyncio.Task[None]] = set()
        # Whether SaladCloud accepted a reallocation request (None: none was made).
        self.reallocation_requested: bool | None = None
        self._running = False
        self._ran = False
        self._shutdown_started = False
        self._log = log.bind(machine_id=config.machine_id)
        # The last few leases' runners, newest last: what they committed, noticed, ended with.
        self.recent_leases: collections.deque[LeaseRunner | SampleRunner] = collections.deque(
            maxlen=8
        )

    # Lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Opens the transfer pool and starts the training thread; idempotent."""
        await self._transfer.start()
        self._training.start()

    async def close(self) -> None:
        """Leaving `async with`: `shutdown()`."""
        await self.shutdown()

    @property
    def state(self) -> State:
        return self._state

    @property
    def busy(self) -> bool:
        """True while a lease's work (its coroutine, maybe its training thread) is running."""
        return self._runner is not None

    @property
    def runner(self) -> LeaseRunner | SampleRunner | None:
        """The current lease's runner, if any (for observation)."""
        return self._runner

    async def wait_until(self, predicate: Callable[[Agent], bool]) -> None:
        """Returns once `predicate(self)` holds; re-checked at every state or lease change.
        Callers bound it with a timeout."""
        while not predicate(self):
            await self._changed.wait()

    async def wait_for_state(self, *states: State) -> State:
        """Returns once the agent is in one of `states`."""
        await self.wait_until(lambda agent: agent.state in states)
        return self._state

    async def run(self) -> None:
        """Qualifies, then connects and serves until drained or shut down.

        Raises `AgentError` when the scheduler refuses this worker's credentials.
        """
        if self._running:
            raise RuntimeError("Agent.run() is already running")
        self._running = True
        self._ran = True
        await self.start()
        try:
            if self.config.spot_notice == "ec2":
                self._side_task(self._watch_spot_notice())
            if self.qualification is None:
                self.qualification = await asyncio.to_thread(probe, self.config)
            if self._finished.is_set():
                return
            if not self.qualification.passed and self.config.salad_reallocate_enabled:
                self._side_task(self._reallocate(self.qualification.detail))
            self._set_state(State.CONNECTING)
            await self._connection_loop()
        finally:
            await self._teardown()

    def drain(self, reason: str) -> None:
        """Graceful stop: finish the step, checkpoint, tell the scheduler, exit. Idempotent."""
        if self._drain_task is not None or self._finished.is_set():
            return
        if self._state in (State.QUALIFYING, State.STOPPED):
            self._finished.set()
            return
        self._log.info("draining", reason=reason)
        self._drain_deadline = asyncio.get_running_loop().time() + self.config.drain_grace_s
        # The state and the stop request change now, not when the task first runs: the
        # training thread sees the drain at its very next step boundary.
        self._set_state(State.DRAINING)
        if self._runner is not None:
            self._runner.drain()
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(reason))

    async def shutdown(self) -> None:
        """Stops now (no checkpoint, no Draining) and waits for `run()` to return. Idempotent."""
        if not self._shutdown_started:
            self._shutdown_started = True
            self._finished.set()
            if self._runner is not None:
                self._runner.abort("worker shutting down")
        if self._running:
            await self._stopped.wait()
        if not self._ran:
            await self._stop_training_thread()  # run() does it when it ends
        await self._transfer.close()

    async def _teardown(self) -> None:
        self._finished.set()
        for side in list(self._side_tasks):
            side.cancel()
        await asyncio.gather(*self._side_tasks, return_exceptions=True)
        drain = self._drain_task
        if drain is not None and not drain.done():
            drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
        task = self._runner_task
        if task is not None and not task.done():
            if self._runner is not None:
                self._runner.abort("worker stopping")
            # The runner waits for its thread to see the stop: one training step, unless the
            # thread is still loading a model. It gets the grace period (what is left of it
            # after a drain); past it, it is left behind (`busy` says so).
            grace_s = self.config.drain_grace_s
            if self._drain_deadline is not None:
                grace_s = max(0.0, self._drain_deadline - asyncio.get_running_loop().time())
            done, _ = await asyncio.wait([task], timeout=grace_s)
            if not done:
                self._log.warning("the lease did not stop in time")
        await self._stop_training_thread()
        session = self._session
        if session is not None:
            await session.close()
            self._session = None
        if self._state is not State.STOPPED:
            self._set_state(State.STOPPED)
        # An agent runs once: nothing uploads after this.
        await self._transfer.close()
        self._running = False
        self._stopped.set()
        self._log.info("worker stopped")

    async def _stop_training_thread(self) -> None:
        # An idle thread stops at once. One still inside a step after the grace period is not
        # waited for: it is a daemon and does not keep the process alive (training_thread.py).
        gone = await self._training.shutdown(0.0 if self.busy else _IDLE_THREAD_STOP_S)
        if not gone:
            self._log.warning(
                "the training thread is still inside a step; leaving without it",
                job_id=self._runner.job_id if self._runner else None,
            )

    # State ------------------------------------------------------------------------------------

    def _set_state(self, new: State) -> None:
        old = self._state
        if new is old:
            return
        if new not in TRANSITIONS[old]:
            raise RuntimeError(f"illegal worker state transition {old.value} -> {new.value}")
        self._state = new
        metrics.STATE.state(new.value)
        runner = self._runner
        self._log.info(
            "worker state",
            state=new.value,
            previous=old.value,
            job_id=runner.job_id if runner else None,
        )
        if self._on_state_change is not None:
            self._on_state_change(new)
        self._notify()

    def _notify(self) -> None:
        # Wakes every waiter once: each captured the event before waiting on it.
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    # Connecting -------------------------------------------------------------------------------

    async def _connection_loop(self) -> None:
        attempt = 0
        while not self._finished.is_set():
            if self._state is State.DRAINING and not self._drain_needs_stream():
                # Nothing left to tell the scheduler: the drain task finishes on its own.
                await self._finished.wait()
                return
            try:
                session = await self._open_session()
            except StreamFailed as exc:
                delay = backoff_delay(
                    attempt,
                    initial_s=self.config.reconnect_initial_backoff_s,
                    max_s=self.reconnect_max_backoff_s,
                    rng=self._rng,
                )
                attempt += 1
                metrics.RECONNECTS.inc()
                self._log.warning(
                    "connection attempt failed",
                    error=str(exc),
                    attempt=attempt,
                    retry_in_s=round(delay, 3),
                )
                finished = asyncio.ensure_future(self._finished.wait())
                try:
                    await asyncio.wait([finished], timeout=delay)
                finally:
                    finished.cancel()
                continue
            attempt = 0
            await self._serve(session)
            if not self._finished.is_set() and self._state in (State.IDLE, State.LEASED):
                self._set_state(State.CONNECTING)

    def _drain_needs_stream(self) -> bool:
        """While draining, a stream is only worth (re)opening to report on a lease."""
        runner = self._runner
        return (runner is not None and runner.holds_lease) or self._draining_lease is not None

    # Messages from the scheduler --------------------------------------------------------------

    def _dispatch(self, session: Session, message: fpb.ConnectResponse) -> None:
        kind = message.WhichOneof("message")
        if kind == "lease_granted":
            self._on_grant(session, message.lease_granted)
        elif kind == "sample_task_granted":
            self._on_grant(session, message.sample_task_granted)
        elif kind == "lease_revoked":
            revoked = message.lease_revoked
            reason = fpb.RevokeReason.Name(revoked.reason)
            if revoked.reason == fpb.REVOKE_REASON_CANCELED:
                self._report_final_step(session, revoked.lease)
            self._lease_gone(revoked.lease, f"revoked: {reason}")
        elif kind == "rejected":
            self._lease_gone(message.rejected.lease, f"rejected: {message.rejected.reason}")
        elif kind == "urls_renewed":
            runner = self._runner
            ref = message.urls_renewed.lease
            if runner is not None and same_lease(ref, runner.ref.lease_id, runner.ref.epoch):
                runner.urls_renewed(message.urls_renewed.urls)
                self._notify()
        elif kind == "shutdown":
            self.drain(f"scheduler shutdown: {message.shutdown.reason}")
        elif kind == "pong":
            pass  # `last_heard` moved: that is all a Pong is for
        else:
            self._log.warning("unexpected message from the scheduler", kind=kind)

    def _on_welcome(self, session: Session, welcome: fpb.Welcome) -> None:
        self._session_token = welcome.session_token
        self.scheduler_id = welcome.scheduler_id
        resumed = welcome.resumed_lease
        runner = self._runner
        terminal = self._unconfirmed()
        # Whatever it was, this Welcome settles it: re-sent below, or the scheduler has it.
        self._terminal = None
        lease_ids: dict[str, object] = {}
        if runner is not None and runner.holds_lease:
            lease_ids = dict(
                job_id=runner.job_id, lease_id=runner.ref.lease_id, epoch=runner.ref.epoch
            )
        if self._lost_at is None:
            self._log.info(
                "connected",
                scheduler_id=welcome.scheduler_id,
                heartbeat_interval_s=session.heartbeat_interval_s,
                resumed_lease=resumed.lease_id or None,
                **lease_ids,
            )
        else:
            lost_at, why = self._lost_at
            self._lost_at = None
            self._log.info(
                "reconnected",
                scheduler_id=welcome.scheduler_id,
                after=why,
                down_s=round(asyncio.get_running_loop().time() - lost_at, 3),
                resumed=bool(resumed.lease_id),
                **lease_ids,
            )
        if runner is not None and runner.holds_lease:
            if same_lease(runner.ref, resumed.lease_id, resumed.epoch):
                runner.reconnected()  # what it asked on the old stream, it asks again now
                if self._state is not State.DRAINING:
                    self._set_state(State.LEASED)
                return
            # The lease expired (or was re-granted) while we were away: drop the work.
            runner.cancel("the lease was not resumed after reconnecting")
        if runner is not None and runner.terminal_message is not None:
            runner.terminal_confirmed = True  # settled here, not again when its task ends
        if terminal is not None and same_lease(terminal.ref, resumed.lease_id, resumed.epoch):
            # The job is still RUNNING under our lease: the result never arrived. Say it again.
            self._log.info(
                "re-sending the lease's final message after reconnecting",
                lease_id=terminal.ref.lease_id,
                epoch=terminal.ref.epoch,
            )
            session.send(terminal.message)
        if self._state is not State.DRAINING:
            self._enter_idle()

    def _on_grant(self, session: Session, grant: fpb.LeaseGranted | fpb.SampleTaskGranted) -> None:
        """A training lease or a sample task (a lease of its own kind)."""
        ref = fpb.LeaseRef(lease_id=grant.lease.lease_id, epoch=grant.lease.epoch)
        if self._state is State.DRAINING:
            # Granted before our Draining arrived: hand it back so it is re-queued at once.
            session.send(
                fpb.ConnectRequest(draining=fpb.Draining(lease=ref, reason="worker is draining"))
            )
            return
        if self._state is not State.IDLE or self._runner is not None:
            self._log.error(
                "lease granted while busy; it will expire",
                job_id=grant.lease.job_id,
                lease_id=grant.lease.lease_id,
                epoch=grant.lease.epoch,
            )
            return
        self._terminal = None
        # Kept for a reconnect (Hello.held_lease_secret); only the newest few can be held.
        self._lease_secrets[grant.lease.lease_id] = grant.lease_secret
        while len(self._lease_secrets) > 4:
            del self._lease_secrets[next(iter(self._lease_secrets))]
        runner: LeaseRunner | SampleRunner
        if isinstance(grant, fpb.SampleTaskGranted):
            runner = SampleRunner(
                grant=grant,
                link=_Link(self, ref),
                transfer=self._transfer,
                training=self._training,
                config=self.config,
                pipelines=self.sample_pipelines,
            )
        else:
            runner = LeaseRunner(
                grant=grant,
                link=_Link(self, ref),
                transfer=self._transfer,
                training=self._training,
                config=self.config,
                trainer_factory=self._trainer_factory
                or functools.partial(
                    Trainer, resident=self.resident if self.config.keep_base_model else None
                ),
            )
        self._runner = runner
        self.recent_leases.append(runner)
        self._set_state(State.LEASED)
        self._runner_task = asyncio.get_running_loop().create_task(self._run_lease(runner))

    def _report_final_step(self, session: Session, ref: fpb.LeaseRef) -> None:
        """Its job was canceled: one last heartbeat says the step this lease reached, which
        the scheduler records as the canceled job's progress (the last periodic heartbeat
        may be an interval behind). Sent before the run stops, so it is the step the cancel
        found; the scheduler takes it once, from this stream only."""
        runner = self._runner
        if (
            isinstance(runner, LeaseRunner)
            and runner.holds_lease
            and same_lease(ref, runner.ref.lease_id, runner.ref.epoch)
        ):
            session.send(fpb.ConnectRequest(heartbeat=self._heartbeat()))

    def _lease_gone(self, ref: fpb.LeaseRef, reason: str) -> None:
        """LeaseRevoked or Rejected: stop acting on that lease at once."""
        runner = self._runner
        if runner is not None and same_lease(ref, runner.ref.lease_id, runner.ref.epoch):
            runner.cancel(reason)
            if self._state is State.LEASED:
                self._enter_idle()  # Ready follows once the training thread has stopped
        elif self._terminal is not None and same_lease(
            ref, self._terminal.ref.lease_id, self._terminal.ref.epoch
        ):
            self._terminal = None
        else:
            self._log.info("message about another lease ignored", lease_id=ref.lease_id, why=reason)

    def warm_state(self) -> fpb.WarmState:
        """What the resident model holds now (the dispatcher prefers jobs that match)."""
        if not self.config.keep_base_model:
            return fpb.WarmState()
        return fpb.WarmState(
            resident=self.resident.key or "",
            compiled_shapes=self.resident.compiled_shapes,
            adapter_shapes=self.resident.adapter_shapes,
        )

    def _enter_idle(self) -> None:
        self._set_state(State.IDLE)
        self._ready_if_free()

    def _ready_if_free(self) -> None:
        session = self._session
        qualified = self.qualification is not None and self.qualification.passed
        if self._state is State.IDLE and self._runner is None and session is not None:
            if qualified:
                ready = fpb.Ready(
                    warm=self.warm_state(), checkpoint_cost_s=self._checkpoint_cost_s()
                )
                session.send(fpb.ConnectRequest(ready=ready))
            else:
                self._log.warning(
                    "not qualified: staying connected without work",
                    detail=self.qualification.detail if self.qualification else "",
                )

    def _checkpoint_cost_s(self) -> float:
        """What this worker's latest checkpoint cost (0: none yet), for the scheduler's
        automatic checkpoint interval of its next lease."""
        for runner in reversed(self.recent_leases):
            if isinstance(runner, LeaseRunner) and runner.checkpoint_cost_s is not None:
                return min(runner.checkpoint_cost_s, MAX_CHECKPOINT_COST_S)
        return 0.0

    async def _run_lease(self, runner: LeaseRunner | SampleRunner) -> LeaseResult:
        try:
            return await runner.run()
        finally:
            if self._runner is runner:
                self._runner = None
            if runner.terminal_message is not None and not runner.terminal_confirmed:
                self._terminal = Terminal(ref=runner.ref, message=runner.terminal_message)
            if self._state is State.LEASED:
                self._set_state(State.IDLE)
            self._notify()
            self._ready_if_free()

    async def _send_for_lease(self, ref: fpb.LeaseRef, message: fpb.ConnectRequest) -> None:
        """`LeaseLink.send`: queue on the current stream once it serves this lease."""
        while True:
            runner = self._runner
            if (
                runner is None
                or not same_lease(ref, runner.ref.lease_id, runner.ref.epoch)
                or not runner.holds_lease
            ):
                raise LeaseLost("the lease is no longer this worker's")
            session = self._session
            serving = self._state in (State.LEASED, State.DRAINING)
            if session is not None and session.writable and serving:
                session.send(message)
                return
            await self._wait_changed()

    # Draining ---------------------------------------------------------------------------------

    async def _drain(self, reason: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_grace_s
        runner, task = self._runner, self._runner_task
        try:
            if runner is not None and task is not None:
                reserve = min(_DRAIN_REPLY_RESERVE_S, self.config.drain_grace_s / 5)
                try:
                    async with asyncio.timeout_at(deadline - reserve):
                        await asyncio.shield(task)
                except TimeoutError:
                    self._log.warning(
                        "drain checkpoint not done within the grace period",
                        job_id=runner.job_id,
                        lease_id=runner.ref.lease_id,
                        epoch=runner.ref.epoch,
                    )
                    runner.abort("drain grace period over")
            async with asyncio.timeout_at(deadline):
                await self._say_draining(runner, reason)
        except TimeoutError:
            self._log.warning("could not tell the scheduler about the drain in time")
        finally:
            self._finished.set()

    async def _say_draining(self, runner: LeaseRunner | SampleRunner | None, reason: str) -> None:
        """Sends Draining (with the lease when we still hold it) and waits until the scheduler
        has read everything (it ends the stream after our half-close)."""
        drained = fpb.Draining(reason=reason[:500])
        if runner is not None and runner.holds_lease:
            drained.lease.CopyFrom(runner.ref)
            self._draining_lease = runner.ref
            self._notify()  # the connection loop reconnects for it if the stream is down
        while True:
            session = self._session
            if session is not None and session.writable:
                break
            if self._draining_lease is None:
                return  # no lease and no stream: nothing to tell
            await self._wait_changed()
        session.send(fpb.ConnectRequest(draining=drained))
        self._draining_lease = None
        session.finish_writing()
        await session.closed.wait()
        self._log.info("drained", lease_id=drained.lease.lease_id or None)

    # Helpers for observers ------------------------------------------------------------------

    def describe(self) -> dict[str, object]:
        """A snapshot of the agent for logs and debugging."""
        runner = self._runner
        return {
            "state": self._state.value,
            "machine_id": self.config.machine_id,
            "job_id": runner.job_id if runner else None,
            "step": runner.progress.latest().step if runner else None,
        }
