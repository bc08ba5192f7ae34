"""The scaler service: one active scaler reads the ledger and the provider, decides, records, acts.

* **One active scaler**: a Postgres session-level advisory lock, held on a dedicated
  connection. A second replica waits on the lock inside the server (no polling) and takes over
  the moment the first one's session ends (a crash, a lost connection, a terminated backend).
  The active scaler checks that its session is alive before each tick and before each action,
  so one that lost its lock stops acting (`NotActive`) and goes back to waiting.
* **When it acts**: on a tick (`tick_interval_s`) and whenever the ledger says the work
  changed: the same connection LISTENs on the channels the jobs trigger NOTIFYs (a job became
  claimable, a lease ended). Tests drive `tick()` themselves.
* **A tick**: a `Snapshot` from the provider (instances, replicas) and the ledger (the listed
  instances' nodes, their faults, who vouched for them and their pace observations, the work,
  the banned queued jobs, the scaler's own recent actions), then `policy.decide`, then each
  decision is recorded as a ledger row (a HOLD this scaler repeats from its previous tick
  folds into that tick's row) and carried out: on the provider (`actions.apply`) or, for
  DROP_LEASE, in the ledger. The row then says whether it was applied, or why not, and an
  applied action's time becomes the time it took effect (what cooldowns count from). A
  scale-in is not tried in a tick where a busy node's deletion cost could not be raised.
* **`--once`** (`run_once`) waits for the lock at most `lock_wait_s`, then raises `LockHeld`
  naming the holder (its lock session's application_name is `lorafleet-scaler:<id>`).
* **A failing provider** never crashes the loop and never stands in for an empty fleet: if the
  snapshot cannot be read, nothing is decided; the failure is recorded and the next tick tries
  again. If an action fails because the provider is unavailable, the tick's remaining provider
  actions are recorded as not tried (each call would only wait out its own deadline).
* **Dry run** (`dry_run=True`): reads and decides, and reports what it would do; it takes no
  lock and writes nothing, so it can watch beside an active scaler.
* **The clock** is injectable (`clock`, epoch seconds): recorded decisions carry its time, and
  the cooldowns, hold-offs and grace periods of the policy are measured on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import socket
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import asyncpg
import structlog

from lorafleet.core.errors import LorafleetError, is_retryable
from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.core.settings import ConfigError
from lorafleet.ledger.ledger import Ledger
from lorafleet.scaler import metrics
from lorafleet.scaler.actions import apply
from lorafleet.scaler.config import ScalerSettings
from lorafleet.scaler.policy import (
    Action,
    Decision,
    NodeView,
    PaceObservation,
    PastAction,
    PolicyConfig,
    QueuedJob,
    Reference,
    Snapshot,
    decide,
    learn_references,
)
from lorafleet.scaler.provider import ActionWithdrawn, Provider, ProviderError, SlowCall

log = structlog.get_logger(__name__)

# Any fixed 64-bit number ("lfscaler"); the same for every scaler of a ledger.
SCALER_LOCK = 0x6C667363616C6572
# The channels the jobs trigger NOTIFYs on (scheduler sql: lorafleet_notify_work).
WORK_CHANNEL = "lorafleet_work"
LEASE_ENDED_CHANNEL = "lorafleet_lease_ended"
# The target of a failed provider read (its row is kept apart from the fleet's HOLDs).
PROVIDER = "provider"

# The newest leases whose pace the scaler reads per tick (a week of a large fleet's leases).
_MAX_OBSERVATIONS = 20_000
_MAX_BANNED_JOBS = 1_000


class NotActive(LorafleetError):
    """This scaler does not hold the lock (never took it, or lost its session): it must not act."""

    retryable = True


class LockHeld(LorafleetError):
    """Another scaler held the lock for the whole bounded wait (`--once` beside an active one)."""

    retryable = True

    def __init__(self, message: str, *, holder: str | None) -> None:
        super().__init__(message)
        # The holding scaler's id as its session names it (None: not a lorafleet scaler's).
        self.holder = holder


# The lock session's application_name: who holds the lock can be read from pg_stat_activity.
_APP_PREFIX = "lorafleet-scaler:"


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What became of one decision."""

    decision: Decision
    applied: bool
    error: str | None = None
    # The ledger row (None in a dry run); folded: a repeated HOLD counted on its first row.
    decision_id: int | None = None
    folded: bool = False
    dry_run: bool = False
    # The provider failed it (unreachable or refused), as opposed to a race that made it moot
    # (`error` says which): `lorafleet scaler --once` exits 1 on these.
    provider_failed: bool = False


Report = Callable[[Outcome], None]


def fold_key(decision: Decision) -> str:
    """A HOLD's reason with its figures blanked: the same hold, tick after tick."""
    return decision.action.value + ":" + re.sub(r"\d+(?:\.\d+)?", "#", decision.reason)


def provider_fold_key(exc: ProviderError) -> str:
    """A failed provider read, the same failure tick after tick: its kind and message with
    counts blanked but HTTP statuses kept (a 401 and a later 404 are two incidents)."""
    text = re.sub(r"(?<!HTTP )\b\d+(?:\.\d+)?", "#", str(exc))
    return f"provider-failed:{type(exc).__name__}:{text}"[:2000]


def describe(outcome: Outcome) -> str:
    """One line for an operator's terminal, e.g. "dry run: would scale fleet to 3 replicas: ...",
    "done: reallocate local-1: ...", "hold (provider): the provider failed ..."."""
    d = outcome.decision
    if d.action is Action.HOLD:
        return f"hold ({d.target}): {d.reason}"
    if d.action is Action.SCALE and d.replicas is not None:
        what = f"scale {d.target} to {d.replicas} replicas"
    else:
        what = f"{d.action.value.replace('_', ' ')} {d.target}"
    if outcome.dry_run:
        status = "dry run: would"
    elif outcome.applied:
        status = "done:"
    else:
        status = f"failed ({outcome.error}):"
    return f"{status} {what}: {d.reason}"


class Scaler(AsyncLifecycle):
    def __init__(
        self,
        *,
        ledger: Ledger,
        database_url: str,
        provider: Provider,
        policy: PolicyConfig,
        tick_interval_s: float = 30.0,
        dry_run: bool = False,
        scaler_id: str = "",
        clock: Callable[[], float] = time.time,
        report: Report | None = None,
        min_tick_gap_s: float = 1.0,
        reconnect_delay_s: float = 1.0,
        observation_window_s: float = 7 * 24 * 3600.0,
    ) -> None:
        self._ledger = ledger
        self._dsn = database_url
        self._provider = provider
        self._policy = policy
        self._tick_interval_s = tick_interval_s
        self.dry_run = dry_run
        self.scaler_id = scaler_id or socket.gethostname()
        self._clock = clock
        self._report = report
        self._min_tick_gap_s = min_tick_gap_s
        self._reconnect_delay_s = reconnect_delay_s
        self._observation_window_s = observation_window_s
        self._started_at = clock()
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._active = asyncio.Event()
        self._wake = asyncio.Event()
        self._tick_lock = asyncio.Lock()
        # The machine ids on the provider's instances at the last snapshot (a retried
        # scale-up reads the work for them again).
        self._listed_machines: list[str] = []
        self._run_task: asyncio.Task[None] | None = None
        self.ticks = 0
        # The HOLD rows this scaler wrote on its previous tick, by (target, fold key): a HOLD
        # folds into one of them, never into a row of another scaler or an older incident.
        self._held_before: dict[tuple[str, str], int] = {}
        self._held_now: dict[tuple[str, str], int] = {}

    # -- the lock ------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether this scaler holds the lock, as far as it knows (a tick checks for sure)."""
        return self._conn is not None and not self._conn.is_closed() and not self._lost.is_set()

    async def wait_active(self) -> None:
        await self._active.wait()

    async def acquire(self, *, timeout_s: float | None = None) -> None:
        """Blocks until this scaler is the active one (waits inside Postgres for the lock); with
        `timeout_s`, at most that long for the lock itself, then `LockHeld` names its holder."""
        while self._conn is None:
            try:
                conn = await asyncpg.connect(
                    self._dsn,
                    server_settings={"application_name": (_APP_PREFIX + self.scaler_id)[:63]},
                )
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("scaler lock connection failed; retrying", error=str(exc))
                await asyncio.sleep(self._reconnect_delay_s)
                continue
            lost = asyncio.Event()
            try:
                conn.add_termination_listener(functools.partial(self._on_lost_conn, lost))
                await conn.add_listener(WORK_CHANNEL, self._notified)
                await conn.add_listener(LEASE_ENDED_CHANNEL, self._notified)
                log.info("scaler waiting for the lock", scaler_id=self.scaler_id)
                if timeout_s is not None:
                    # Postgres bounds the wait itself (lock_timeout applies to advisory locks).
                    await conn.execute(f"SET lock_timeout = {max(1, round(timeout_s * 1000))}")
                await conn.execute("SELECT pg_advisory_lock($1)", SCALER_LOCK)
                if timeout_s is not None:
                    await conn.execute("RESET lock_timeout")
            except asyncpg.LockNotAvailableError:
                holder = await _lock_holder(conn)
                await _close_quietly(conn)
                raise LockHeld(
                    f"scaler {self.scaler_id} waited {timeout_s:g} s for the scaler lock;"
                    f" it is held by {holder.describe()}",
                    holder=holder.scaler_id,
                ) from None
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("scaler lock connection lost while waiting", error=str(exc))
                await _close_quietly(conn)
                await asyncio.sleep(self._reconnect_delay_s)
                continue
            except BaseException:
                await _close_quietly(conn)
                raise
            if lost.is_set():
                await _close_quietly(conn)
                continue
            self._conn, self._lost = conn, lost
            self._held_before = {}
            self._active.set()
            metrics.ACTIVE.set(1)
            self._wake.set()  # look at the fleet at once
            log.info("scaler is the active one", scaler_id=self.scaler_id)

    def _on_lost_conn(self, lost: asyncio.Event, _conn: object) -> None:
        self._on_lost(lost)

    def _on_lost(self, lost: asyncio.Event) -> None:
        lost.set()
        if lost is self._lost:  # the held session, not an earlier one closing late
            self._active.clear()
            metrics.ACTIVE.set(0)
            self._wake.set()

    def _notified(self, *_args: object) -> None:
        self._wake.set()

    async def _release(self) -> None:
        conn, self._conn = self._conn, None
        self._active.clear()
        metrics.ACTIVE.set(0)
        if conn is not None:
            await _close_quietly(conn)  # ends the session: the lock goes with it

    async def _ensure_active(self) -> None:
        """Raises NotActive unless this scaler's lock session is alive right now."""
        if self.dry_run:
            return
        conn = self._conn
        if conn is None or conn.is_closed() or self._lost.is_set():
            raise NotActive(f"scaler {self.scaler_id} does not hold the scaler lock")
        try:
            await conn.fetchval("SELECT 1")
        except Exception as exc:  # whatever the driver says, the session is not provably alive
            self._on_lost(self._lost)
            raise NotActive(f"scaler {self.scaler_id} lost its lock session: {exc}") from None

    # -- the loop ------------------------------------------------------------------------------

    async def run_once(self, *, lock_wait_s: float | None = None) -> list[Outcome]:
        """One tick (after the lock, unless a dry run): `lorafleet scaler --once`. With
        `lock_wait_s`, `LockHeld` when another scaler keeps the lock that long."""
        self._run_task = asyncio.current_task()
        if not self.dry_run:
            await self.acquire(timeout_s=lock_wait_s)
        return await self.tick()

    async def run(self) -> None:
        """Acquire, then tick on every wake-up and every `tick_interval_s`, until cancelled;
        after losing the lock, wait for it again."""
        self._run_task = asyncio.current_task()
        while True:
            if not self.dry_run:
                await self.acquire()
            try:
                await self._serve()
            except NotActive as exc:
                log.warning("scaler lost the lock; waiting for it again", error=str(exc))
                await self._release()

    async def _serve(self) -> None:
        last = -float("inf")
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._tick_interval_s):
                    await self._wake.wait()
            gap = last + self._min_tick_gap_s - loop.time()
            if gap > 0:
                # Notifications come in bursts: at most one provider round per gap.
                await asyncio.sleep(gap)
            self._wake.clear()
            last = loop.time()
            try:
                await self.tick()
            except NotActive:
                raise
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                log.warning("scaler tick failed; trying again next tick", error=str(exc))

    async def close(self) -> None:
        task = self._run_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._release()

    # -- one tick ------------------------------------------------------------------------------

    async def snapshot(self, now: float) -> Snapshot:
        """The fleet as the provider and the ledger see it now (provider errors propagate)."""
        instances = tuple(await self._provider.list_instances())
        replicas = await self._provider.replicas()
        c = self._policy
        # The machines the provider lists now, and no others: one that left is nobody's peer,
        # and a lease under a machine id on no instance (unless a provider vouched for it) is
        # no node's work.
        ids = sorted({i.machine_id for i in instances if i.machine_id})
        self._listed_machines = ids
        work = await self._ledger.scaler_work(ids)
        paces = await self._ledger.pace_observations(self._observation_window_s, _MAX_OBSERVATIONS)
        by_machine: dict[str, list[PaceObservation]] = defaultdict(list)
        for p in paces:
            # Between verified checkpoints; else, for a lease that ended with a verified result,
            # grant to end (its loading included: it can only make the peers look slower).
            observed, steps = None, 0
            if p.observed_steps and p.observed_seconds is not None:
                observed, steps = p.observed_seconds / p.observed_steps, p.observed_steps
            elif p.completed_steps and p.completed_seconds is not None:
                observed, steps = p.completed_seconds / p.completed_steps, p.completed_steps
            by_machine[p.machine_id].append(
                PaceObservation(
                    job_id=p.job_id,
                    shape=p.shape,
                    gpu_class=p.gpu_class,
                    step_compiled=p.step_compiled,
                    live=p.live,
                    observed_seconds_per_step=observed,
                    observed_steps=steps,
                    reported_seconds_per_step=p.reported_seconds_per_step,
                    reported_steps=p.reported_steps,
                )
            )
        records = (
            await self._ledger.list_nodes(ids, fault_window_s=c.fault_window_s, limit=len(ids))
            if ids
            else []
        )
        nodes = tuple(
            NodeView(
                machine_id=r.machine_id,
                instance_id=r.provider_instance_id or None,
                gpu_class=r.gpu_model,
                qualified=r.qualified,
                lease_job_id=r.lease_job_id,
                fault_times=r.recent_fault_times,
                observations=tuple(by_machine.get(r.machine_id, ())),
                verified=r.identity_provider != "",
                age_s=(r.last_seen_at - r.first_seen_at).total_seconds(),
            )
            for r in records
        )
        references = {
            r.gpu_class: Reference(
                seconds_per_step=r.seconds_per_step, updated_at=r.updated_at, machines=r.machines
            )
            for r in await self._ledger.pace_references()
        }
        banned = await self._ledger.banned_queued_jobs(_MAX_BANNED_JOBS) if work.queued > 0 else []
        horizon = max(c.reallocate_window_s, c.cooldown_s, c.reallocate_holdoff_s)
        recent = await self._ledger.recent_scaler_actions(now - horizon)
        idle_since = None
        if work.queued + work.running == 0:
            idle_since = (
                work.last_finished_at.timestamp()
                if work.last_finished_at is not None
                else self._started_at
            )
        return Snapshot(
            now=now,
            replicas=replicas,
            instances=instances,
            nodes=nodes,
            queued_jobs=work.queued,
            banned_queued=tuple(
                QueuedJob(job_id=b.job_id, banned_machines=frozenset(b.banned_machines))
                for b in banned
            ),
            running_jobs=work.running,
            unplaced_leases=work.unplaced,
            idle_since=idle_since,
            recent_actions=tuple(
                PastAction(at=a.at, action=Action(a.action), target=a.target, job_id=a.job_id)
                for a in recent
            ),
            references=references,
        )

    async def tick(self) -> list[Outcome]:
        """Look, decide, record, act: once. Raises NotActive if this scaler must not act. When
        the provider cannot be read, the one outcome is an unapplied HOLD with its error."""
        async with self._tick_lock:
            await self._ensure_active()
            self.ticks += 1
            metrics.TICKS.inc()
            self._held_now = {}
            try:
                outcomes = await self._tick()
                slow = await self._record_slow_calls()
                return outcomes if slow is None else [*outcomes, slow]
            finally:
                self._held_before, self._held_now = self._held_now, {}

    async def _tick(self) -> list[Outcome]:
        now = self._clock()
        try:
            snapshot = await self.snapshot(now)
        except ProviderError as exc:
            log.warning("provider unavailable; nothing decided this tick", error=str(exc))
            metrics.PROVIDER_FAILURES.inc()
            return [await self._record_provider_failure(exc)]
        # The reference paces learned from long-lived machines, moved at a bounded rate.
        for gpu_class, ref in learn_references(snapshot, self._policy).items():
            await self._ledger.set_pace_reference(
                gpu_class, ref.seconds_per_step, ref.machines, ref.updated_at
            )
        outcomes: list[Outcome] = []
        provider_down: str | None = None
        # A busy node whose deletion cost could not be raised may tie with the named victims:
        # no scale-in this tick then.
        unprotected: str | None = None
        for decision in decide(snapshot, self._policy):
            skip = provider_down
            if (
                skip is None
                and unprotected is not None
                and decision.action is Action.SCALE
                and decision.replicas is not None
                and decision.replicas < snapshot.replicas
            ):
                skip = f"busy instance {unprotected}'s deletion cost could not be raised"
            outcome = await self._carry_out(decision, skip)
            result = "applied" if outcome.applied else "failed" if outcome.error else "not_applied"
            metrics.DECISIONS.labels(decision.action.value, result).inc()
            if outcome.error and outcome.error.startswith(_UNAVAILABLE):
                provider_down = outcome.error
            if (
                decision.action is Action.SET_DELETION_COST
                and decision.deletion_cost == self._policy.busy_deletion_cost
                and outcome.error is not None
            ):
                unprotected = decision.target
            outcomes.append(outcome)
            if self._report is not None:
                self._report(outcome)
        return outcomes

    async def _record_slow_calls(self) -> Outcome | None:
        """A `scaler-log` row for a tick whose provider calls spent at least half of a call's
        deadline retrying: an action that went through late (or a read that did) is otherwise
        invisible there, although the fleet waited for it."""
        # Providers that retry say which calls did (SaladProvider.take_slow_calls).
        take = getattr(self._provider, "take_slow_calls", None)
        if take is None:
            return None
        calls: list[SlowCall] = take()
        slow = [c for c in calls if c.seconds >= 0.5 * c.deadline_s]
        if not slow:
            return None
        spent = sum(c.seconds for c in slow)
        deadline_s = max(c.deadline_s for c in slow)
        named = "; ".join(
            f"{c.what}: {c.seconds:.0f} s, {c.attempts} attempts ({c.error})" for c in slow[:5]
        )
        hold = Decision(
            action=Action.HOLD,
            target=PROVIDER,
            reason=f"the provider kept this tick retrying for {spent:.0f} s of a"
            f" {deadline_s:g} s call deadline: {named}",
            figures={
                "retry_s": round(spent, 1),
                "calls": len(slow),
                "deadline_s": round(deadline_s, 1),
            },
        )
        if self.dry_run:
            return Outcome(decision=hold, applied=False, dry_run=True)
        decision_id, folded = await self._record(hold, "slow-provider")
        outcome = Outcome(decision=hold, applied=False, decision_id=decision_id, folded=folded)
        if self._report is not None:
            self._report(outcome)
        return outcome

    async def _record(self, d: Decision, key: str, error: str | None = None) -> tuple[int, bool]:
        """The decision's ledger row, at the time it is written (a HOLD repeated from this
        scaler's previous tick folds into that tick's row)."""
        fold = (d.target, key) if d.action is Action.HOLD else None
        decision_id, folded = await self._ledger.record_scaler_decision(
            at=self._clock(),
            scaler_id=self.scaler_id,
            action=d.action.value,
            target=d.target,
            job_id=d.job_id,
            reason=d.reason,
            figures=d.figures,
            fold_key=key,
            error=error,
            fold_into=None if fold is None else self._held_before.get(fold),
        )
        if fold is not None:
            self._held_now[fold] = decision_id
        return decision_id, folded

    async def _record_provider_failure(self, exc: ProviderError) -> Outcome:
        hold = Decision(
            action=Action.HOLD,
            target=PROVIDER,
            reason=f"the provider failed; nothing decided, trying again next tick: {exc}",
            figures={"retryable": "yes" if exc.retryable else "no"},
        )
        outcome = Outcome(
            decision=hold,
            applied=False,
            error=str(exc),
            dry_run=self.dry_run,
            provider_failed=True,
        )
        if not self.dry_run:
            decision_id, folded = await self._record(
                hold, provider_fold_key(exc), error=str(exc)[:4000]
            )
            outcome = Outcome(
                decision=hold,
                applied=False,
                error=str(exc),
                decision_id=decision_id,
                folded=folded,
                provider_failed=True,
            )
        if self._report is not None:
            self._report(outcome)
        return outcome

    async def _carry_out(self, d: Decision, skip: str | None) -> Outcome:
        """Records the decision and carries it out, unless `skip` says why it is not tried (the
        provider is down, or a scale-in would be unsafe)."""
        if self.dry_run:
            return Outcome(decision=d, applied=False, dry_run=True)
        decision_id, folded = await self._record(d, fold_key(d) if d.action is Action.HOLD else "")
        if d.action is Action.HOLD:
            return Outcome(decision=d, applied=False, decision_id=decision_id, folded=folded)
        applied, error, provider_failed = False, None, False
        if skip is not None and d.action is not Action.DROP_LEASE:
            error, provider_failed = f"not tried: {skip}", True
        else:
            try:
                await self._ensure_active()
            except NotActive:
                await self._ledger.finish_scaler_decision(
                    decision_id, applied=False, error="not tried: this scaler lost its lock"
                )
                raise
            try:
                applied, error = await self._act(d)
            except ActionWithdrawn as exc:
                error = f"withdrawn: {exc}"
                log.info("scaler action withdrawn", action=d.action.value, reason=str(exc))
            except ProviderError as exc:
                prefix = _UNAVAILABLE if exc.retryable else "refused"
                error, provider_failed = f"{prefix}: {exc}", True
                log.warning("scaler action failed", action=d.action.value, error=str(exc))
        # An action's time is when it took effect (a call may retry for its whole deadline):
        # cooldowns and hold-offs count from there, and `scaler-log` shows it.
        await self._ledger.finish_scaler_decision(
            decision_id,
            applied=applied,
            error=None if error is None else error[:4000],
            at=self._clock() if applied else None,
        )
        if applied:
            log.info(
                "scaler acted",
                action=d.action.value,
                target=d.target,
                job_id=d.job_id,
                reason=d.reason,
            )
        return Outcome(
            decision=d,
            applied=applied,
            error=error,
            decision_id=decision_id,
            provider_failed=provider_failed,
        )

    async def _act(self, d: Decision) -> tuple[bool, str | None]:
        if d.action is Action.DROP_LEASE:
            assert d.job_id is not None
            job = await self._ledger.drop_lease(
                d.target, d.job_id, f"dropped by the scaler: {d.reason}"[:2000]
            )
            if job is None:
                return False, "the machine no longer holds this job's lease"
            return True, None
        if d.action is Action.SCALE and d.remove:
            taken = await self._victims_now_leased(d.remove)
            if taken:
                self._wake.set()
                return False, (
                    f"not tried: {', '.join(taken)} took a lease since the snapshot; deciding again"
                )
        grows = d.action is Action.SCALE and not d.remove and (d.replicas or 0) > 0
        await apply(self._provider, d, still_wanted=self._scale_up_wanted(d) if grows else None)
        return True, None

    def _scale_up_wanted(self, d: Decision) -> Callable[[], Awaitable[str | None]]:
        """Asked before each retry of a scale-up: the work read again from the ledger. A
        scale-up serves queued jobs (or the replica floor); once none is queued, a replica it
        adds would only cold-start and then be held for the cooldown, so it is withdrawn."""
        target = d.replicas or 0

        async def wanted() -> str | None:
            if target <= self._policy.min_replicas:
                return None
            work = await self._ledger.scaler_work(self._listed_machines)
            if work.queued > 0:
                return None
            return (
                f"no job is queued any more ({work.running} running): the scale-up to"
                f" {target} replicas lost its reason while it was retried"
            )

        return wanted

    async def _victims_now_leased(self, remove: Sequence[str]) -> list[str]:
        """The instances chosen for scale-in whose machine holds a lease now (a job was
        granted between the snapshot and the action): scale-in never removes a busy node."""
        instances = {i.instance_id: i for i in await self._provider.list_instances()}
        machines = [instances[i].machine_id for i in remove if i in instances]
        machines = [m for m in machines if m]
        if not machines:
            return []
        nodes = await self._ledger.list_nodes(machines, fault_window_s=1.0, limit=len(machines))
        busy = {n.machine_id for n in nodes if n.lease_job_id is not None}
        return [i for i in remove if i in instances and instances[i].machine_id in busy]


_UNAVAILABLE = "provider unavailable"


@dataclass(frozen=True, kw_only=True)
class _Holder:
    scaler_id: str | None
    application_name: str
    client: str
    pid: int | None
    since: str

    def describe(self) -> str:
        if self.pid is None:
            return "another session (gone by the time it was looked up)"
        who = (
            f"scaler {self.scaler_id!r}"
            if self.scaler_id is not None
            else f"a session named {self.application_name!r}"
        )
        return f"{who} (backend pid {self.pid}, from {self.client}, connected {self.since})"


async def _lock_holder(conn: asyncpg.Connection) -> _Holder:
    """Who holds the scaler lock, from the server's own view of its sessions (fields another
    role's session hides, or a failed look-up, read as unknown)."""
    unknown = _Holder(scaler_id=None, application_name="", client="", pid=None, since="")
    try:
        row = await conn.fetchrow(
            "SELECT a.pid, coalesce(a.application_name, '') AS app,"
            " coalesce(host(a.client_addr), 'a local socket') AS client,"
            " coalesce(to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')"
            " || ' UTC', 'at an unknown time') AS since"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted"
            # Advisory locks are per database: another deployment's scaler on the same server
            # holds a lock of the same key in its own.
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND ((l.classid::bigint << 32) | l.objid::bigint) = $1 LIMIT 1",
            SCALER_LOCK,
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        log.warning("could not look up the scaler lock's holder", error=str(exc))
        return unknown
    if row is None:
        return unknown
    app = str(row["app"])
    return _Holder(
        scaler_id=app[len(_APP_PREFIX) :] if app.startswith(_APP_PREFIX) else None,
        application_name=app,
        client=str(row["client"]),
        pid=int(row["pid"]),
        since=str(row["since"]),
    )


async def _close_quietly(conn: asyncpg.Connection) -> None:
    with contextlib.suppress(Exception):
        await conn.close(timeout=5)


def provider_from_settings(settings: ScalerSettings) -> Provider:
    """The provider the settings name. The local one runs worker processes on this machine
    for the scheduler at `scheduler_address` (its token: the setting, else the scheduler's
    generated `<data dir>/worker-token`)."""
    if settings.provider == "salad":
        from lorafleet.scaler.salad import SaladProvider

        return SaladProvider(settings.salad_config())
    if settings.provider == "ec2":
        from lorafleet.scaler.ec2 import Ec2SpotProvider

        return Ec2SpotProvider(settings.ec2_config())
    from lorafleet.scaler.local import LocalProcessProvider, detect_gpus

    token = settings.worker_token
    token_file = settings.data_dir / "worker-token"
    if not token and token_file.exists():
        token = token_file.read_text().strip()
    if not token:
        raise ConfigError(
            f"--worker-token / LORAFLEET_WORKER_TOKEN: the local provider needs the workers'"
            f" token (or the scheduler's {token_file})"
        )
    return LocalProcessProvider(
        scheduler_address=settings.scheduler_address,
        worker_token=token,
        log_dir=settings.data_dir / "logs",
        gpus=detect_gpus(),
    )
