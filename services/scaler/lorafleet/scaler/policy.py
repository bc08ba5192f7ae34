"""The scaler's policy: pure functions from a snapshot of the fleet to a list of decisions.

Nothing here talks to a provider, the ledger or the clock: `decide(snapshot, config)` reads a
frozen `Snapshot` (instances from the provider, node facts and job counts from the ledger, the
scaler's own recent actions) and returns `Decision`s, each with its action, its target, a
sentence for an operator and the figures behind it. The service loop applies them (or prints
them, with `--dry-run`) and records them in the ledger, where the next snapshot finds them as
`recent_actions`: that is how cooldowns, hold-offs and the reallocation rate limit see the past.

The rules, in the order they claim the reallocation budget:

Every rule that touches a provider instance acts only for a machine whose id a provider
vouched for (`NodeView.verified`: a SaladCloud instance token, an EC2 identity document, the
local supervisor's token): an unverified stream may have said Hello under another machine's id,
and its reports must never move that machine's instance.

1. **Bad node**: node faults at or past `fault_threshold` within `fault_window_s`, or a failed
   qualification probe: the node's instance is reallocated (Salad) / replaced (EC2) /
   restarted in a fresh slot (local). An unverified one is left alone with a `HOLD` saying so
   (the scheduler's quarantine still stops its grants).
2. **No stranded job**: a queued job that every live instance's machine is banned from gets a
   node: an idle banned (verified) instance is reallocated (it comes back on another machine),
   else a replica is added (below `max_replicas`), else the job waits for a busy node to finish.
3. **Slow node**: a verified node whose pace on its leased job exceeds its peers' median (same
   job shape, `JobSpec.shape.key`, and GPU class) by more than `slow_stddevs`
   robust standard deviations (1.4826 x the median absolute deviation), and by at least
   `slow_min_excess` of the median (identical peers have no spread; a 1% difference is not
   "slow"): its lease is dropped (the job is re-queued from its checkpoint, the machine banned
   for it) and its instance reallocated. What counts, so that a worker can make only itself
   look slow:
   * a pace *observation* is what the scheduler saw: the steps between the first and the last
     checkpoint the store verified under one lease, over the ledger's clock between their
     commits, once it spans `slow_warmup_steps` (for a lease with fewer checkpoints that ended
     with a verified result: its steps over the time from grant to end);
   * the peers are the other live (listed by the provider now) and verified machines, each
     counted once per job shape (the median of its observations), and there must be at least
     `slow_min_peers` of them: a stream that made up a machine id, or a machine that left,
     moves nobody's statistic;
   * the judged node's own pace is the slower of its observation and what it reports of
     itself (past the warm-up): a worker's claim can convict only that worker;
   * and it must also be past a **reference** that a group of machines cannot move quickly:
     the GPU class's reference pace (seconds per 1024x1024 image step, scaled to the shape)
     times 1 + `slow_reference_excess`. The operator may pin it per class
     (`reference_paces`); else it is learned (`learn_references`, kept in the ledger) only
     from verified machines seen for `reference_min_age_s` or longer, and moves by at most
     `reference_rate_per_hour` per hour. A class with no reference yet drops no one: live peers
     alone (three colluding machines committing valid checkpoints fast) convict nobody;
   * the node's compile state stands beside its shape: a node that does not say its step runs
     compiled (Heartbeat.step_compiled; a fresh node runs eager, 2 to 2.5x a warm compiled
     step) is held to both limits times `slow_eager_allowance`. Its own word: it can only
     spare itself, and what peers say of their compile state moves nothing.
   Drops are rate-limited like reallocations (their own count, the same allowance per
   `reallocate_window_s`); each DROP_LEASE row carries the observations behind it.
4. **Replicas follow the work**: queued + running jobs (running: leases held by machines on a
   listed instance or vouched for by a provider; a lease under a made-up machine id is no
   node's work, and does not hold scale-in either) (plus, while jobs queue, one for each
   bad node the rate limit keeps in place: the scheduler quarantines it), clamped to
   [min, max], against the provider's replica count (instances still starting count).
   Growth is immediate, by at most `max_step` per tick. Shrinking waits `cooldown_s` after
   any scale action, and, when there is no work at all, `idle_grace_s` after the work ended;
   it removes idle instances only (those already stopping first, then bad ones, then those
   banned from every queued job, then those still starting, then ready idle ones) and never a
   node holding a lease. The provider removes every instance it counts (starting, running and
   stopping) beyond the new replica count: each of them is named as a victim, or the count is
   not lowered that far.
5. **Deletion cost** (SaladCloud): `busy_deletion_cost` while a node holds a lease,
   `idle_deletion_cost` otherwise, on every counted instance (stopping ones included), so that
   a scale-in the provider carries out by itself still removes idle nodes first. They come
   before a scale-in of the same tick; the victims it names are left at the 0 it gives them.

Reallocations (and, counted apart, slow-node drops) are rate-limited: at most
max(`reallocate_min_per_window`,
floor(`reallocate_share` x fleet)) per `reallocate_window_s`, so that a wave of faults cannot
drain the fleet, while a fleet of one can still heal; and one instance is not reallocated
again within `reallocate_holdoff_s` (its old node's facts linger while it moves). A rule that
wants to act but is held back says so with a `HOLD` decision (no provider call), so that an
operator sees why nothing happened.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lorafleet.core.model import MIN_PLAUSIBLE_S_PER_STEP, shape_prior_seconds
from lorafleet.core.spec import JobShape
from lorafleet.scaler.provider import COUNTED_STATES, LIVE_STATES, Instance, InstanceState

FLEET = "fleet"

Figure = int | float | str


class Action(enum.StrEnum):
    SCALE = "scale"
    REALLOCATE = "reallocate"
    RESTART = "restart"
    DROP_LEASE = "drop_lease"
    SET_DELETION_COST = "set_deletion_cost"
    # A rule wanted to act and a limit held it back: nothing is done, the reason is recorded.
    HOLD = "hold"


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    min_replicas: int = 0
    max_replicas: int = 10
    idle_grace_s: float = 600.0
    cooldown_s: float = 300.0
    max_step: int = 10
    fault_threshold: int = 3
    fault_window_s: float = 3600.0
    slow_warmup_steps: int = 20
    # Robust standard deviations (1.4826 x MAD) past the peers' median.
    slow_stddevs: float = 2.0
    # Distinct peer machines (one observation each per job shape) needed to judge a pace.
    slow_min_peers: int = 3
    slow_min_excess: float = 0.25
    # The fastest plausible pace, in seconds per 1024x1024 image step (scaled per shape): a
    # peer observation faster than that is a holder committing tiny checkpoints, not training.
    min_plausible_seconds_per_step: float = MIN_PLAUSIBLE_S_PER_STEP
    # The reference a slow node must also exceed (see "Slow node"): pinned per GPU class, in
    # seconds per 1024x1024 image step, else learned from machines seen this long, moving by at
    # most this factor per hour.
    reference_paces: Mapping[str, float] = field(default_factory=dict)
    reference_min_age_s: float = 6 * 3600.0
    reference_rate_per_hour: float = 1.25
    slow_reference_excess: float = 0.5
    # A node that does not say its step runs compiled (Heartbeat.step_compiled) is held to this
    # many times the limits: a fresh eager step is 2 to 2.5x a warm compiled one (an H200).
    slow_eager_allowance: float = 2.5
    reallocate_share: float = 0.1
    reallocate_window_s: float = 3600.0
    reallocate_min_per_window: int = 1
    reallocate_holdoff_s: float = 900.0
    busy_deletion_cost: int = 100_000
    idle_deletion_cost: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if self.max_step < 1 or self.fault_threshold < 1 or self.slow_min_peers < 2:
            raise ValueError("max_step, fault_threshold >= 1 and slow_min_peers >= 2")
        if not 0.0 <= self.reallocate_share <= 1.0 or self.reallocate_min_per_window < 0:
            raise ValueError("reallocate_share in [0, 1], reallocate_min_per_window >= 0")
        if not 0 <= self.idle_deletion_cost < self.busy_deletion_cost <= 100_000:
            raise ValueError("need 0 <= idle_deletion_cost < busy_deletion_cost <= 100000")


@dataclass(frozen=True, kw_only=True)
class PaceObservation:
    """One node's pace on one lease: what the scheduler observed (steps between verified
    checkpoints over the ledger's clock), and beside it what the node reported of itself.
    Two observations are comparable when their job shapes (`JobSpec.shape.key`) and GPU classes
    are the same."""

    job_id: str
    shape: JobShape
    gpu_class: str = ""
    # Whether the holder says its step ran compiled (None: it did not say): its word, so it
    # only ever chooses what this node's own pace is held to (`slow_eager_allowance`).
    step_compiled: bool | None = None
    # Whether the lease is still the job's (the judged pace is the live lease's).
    live: bool = True
    # None until two verified checkpoints of the lease are `observed_steps` apart (or, with fewer,
    # until the lease ended with a verified result: its steps from grant to end).
    observed_seconds_per_step: float | None = None
    observed_steps: int = 0
    # The worker's own claim: it may only ever count against this node.
    reported_seconds_per_step: float | None = None
    reported_steps: int = 0


@dataclass(frozen=True, kw_only=True)
class NodeView:
    machine_id: str
    # As the worker reported it (shown to operators); instances are joined by machine id.
    instance_id: str | None = None
    gpu_class: str = ""
    # The qualification probe's result; None until the node has run it.
    qualified: bool | None = None
    # The job this node holds a lease on; None when idle.
    lease_job_id: str | None = None
    fault_times: tuple[float, ...] = ()
    observations: tuple[PaceObservation, ...] = ()
    # A provider vouched for the machine id (NodeRecord.identity_provider != ""): only then may
    # its facts move its instance, or count among another node's peers.
    verified: bool = False
    # Seconds between the ledger's first and last sight of the machine: only long-lived
    # machines teach the reference pace.
    age_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Reference:
    """A GPU class's learned reference pace, seconds per 1024x1024 image step, as kept in the
    ledger, and when it last moved (the scaler's clock)."""

    seconds_per_step: float
    updated_at: float
    machines: int = 0


@dataclass(frozen=True, kw_only=True)
class QueuedJob:
    job_id: str
    banned_machines: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class PastAction:
    at: float
    action: Action
    target: str
    job_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    now: float
    # The desired count the provider holds (`Provider.replicas()`).
    replicas: int
    instances: tuple[Instance, ...] = ()
    nodes: tuple[NodeView, ...] = ()
    queued_jobs: int = 0
    # The queued jobs that have at least one banned machine (the others fit any node).
    banned_queued: tuple[QueuedJob, ...] = ()
    running_jobs: int = 0
    # Leases left out of running_jobs: held by machine ids on no listed instance that no
    # provider vouched for (made-up ids). Neither demand nor a reason to hold scale-in.
    unplaced_leases: int = 0
    # When queued + running last became 0; None while there is work.
    idle_since: float | None = None
    recent_actions: tuple[PastAction, ...] = ()
    # Learned reference paces per GPU class (the ledger's pace_references).
    references: Mapping[str, Reference] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    # FLEET for SCALE; an instance id; a machine id for DROP_LEASE.
    target: str
    reason: str
    figures: Mapping[str, Figure] = field(default_factory=dict)
    replicas: int | None = None
    remove: tuple[str, ...] = ()
    job_id: str | None = None
    deletion_cost: int | None = None


# -- the rules ---------------------------------------------------------------------------------


def decide(snapshot: Snapshot, config: PolicyConfig) -> list[Decision]:
    """Every decision for this tick, in the order they should be applied."""
    fleet = _Fleet(snapshot, config)
    decisions: list[Decision] = []
    decisions += _bad_nodes(fleet)
    stranded_extra, stranded = _stranded_jobs(fleet)
    decisions += stranded
    decisions += _slow_nodes(fleet)
    scale = _scale(fleet, stranded_extra)
    costs = _deletion_costs(fleet)
    if any(d.replicas is not None and d.replicas < fleet.s.replicas for d in scale):
        # A node that became busy since the last tick is raised before a lowered replica
        # count lets the provider choose.
        return decisions + costs + scale
    return decisions + scale + costs


class _Fleet:
    """The snapshot with its joins done once: instance <-> node, live set, the budget."""

    def __init__(self, snapshot: Snapshot, config: PolicyConfig) -> None:
        self.s = snapshot
        self.c = config
        self.live = [i for i in snapshot.instances if i.state in LIVE_STATES]
        # Live ones and those still stopping: the provider counts them all, and a scale-in
        # it carries out may pick any of them.
        self.counted = [i for i in snapshot.instances if i.state in COUNTED_STATES]
        # Joined by machine id, never by instance id: a reallocated SaladCloud instance keeps
        # its id on a new machine, and the old machine's facts must not follow it there.
        by_machine = {n.machine_id: n for n in snapshot.nodes}
        self.node_of: dict[str, NodeView] = {}
        for inst in snapshot.instances:
            node = by_machine.get(inst.machine_id) if inst.machine_id else None
            if node is not None:
                self.node_of[inst.instance_id] = node
        self.instance_of = {n.machine_id: i for i, n in self.node_of.items()}
        # Instances this tick sends elsewhere (they come back on a fresh machine).
        self.moving: set[str] = set()
        self.bad: set[str] = set()
        # The instances this tick's scale-in names (their deletion cost goes to 0 with it).
        self.victims: set[str] = set()
        window_start = snapshot.now - config.reallocate_window_s
        self.reallocations_used = sum(
            1
            for a in snapshot.recent_actions
            if a.action is Action.REALLOCATE and a.at >= window_start
        )
        size = max(len(self.live), snapshot.replicas)
        self.reallocations_allowed = max(
            config.reallocate_min_per_window, math.floor(config.reallocate_share * size)
        )
        # Slow-node drops have the same allowance, counted apart: a wave of "slow" verdicts
        # (a statistic gone wrong) cannot empty the fleet's leases either.
        self.drops_used = sum(
            1
            for a in snapshot.recent_actions
            if a.action is Action.DROP_LEASE and a.at >= window_start
        )
        self.drops_allowed = self.reallocations_allowed

    def machine(self, inst: Instance) -> str:
        node = self.node_of.get(inst.instance_id)
        return node.machine_id if node else inst.machine_id

    def busy(self, inst: Instance) -> bool:
        node = self.node_of.get(inst.instance_id)
        return node is not None and node.lease_job_id is not None

    def last(self, action: Action, target: str, job_id: str | None = None) -> float | None:
        times = [
            a.at
            for a in self.s.recent_actions
            if a.action is action and a.target == target and (job_id is None or a.job_id == job_id)
        ]
        return max(times) if times else None

    def held_off(self, instance_id: str) -> bool:
        """Reallocated within the hold-off: it is still moving; its old facts linger."""
        at = self.last(Action.REALLOCATE, instance_id)
        return at is not None and self.s.now - at < self.c.reallocate_holdoff_s

    def budget_figures(self) -> dict[str, Figure]:
        return {
            "reallocations_in_window": self.reallocations_used,
            "reallocations_allowed": self.reallocations_allowed,
            "window_s": self.c.reallocate_window_s,
        }

    def reallocate(self, inst: Instance, reason: str, figures: dict[str, Figure]) -> Decision:
        """A REALLOCATE if the budget allows, else a HOLD saying so."""
        if self.reallocations_used >= self.reallocations_allowed:
            return Decision(
                action=Action.HOLD,
                target=inst.instance_id,
                reason=f"{reason}; reallocation deferred: rate limit reached",
                figures={**figures, **self.budget_figures()},
            )
        self.reallocations_used += 1
        self.moving.add(inst.instance_id)
        return Decision(
            action=Action.REALLOCATE,
            target=inst.instance_id,
            reason=reason,
            figures={**figures, **self.budget_figures()},
        )

    def live_with_nodes(self) -> Iterable[tuple[Instance, NodeView]]:
        for inst in sorted(self.live, key=lambda i: i.instance_id):
            node = self.node_of.get(inst.instance_id)
            if node is not None:
                yield inst, node


def _bad_nodes(fleet: _Fleet) -> list[Decision]:
    out = []
    s, c = fleet.s, fleet.c
    for inst, node in fleet.live_with_nodes():
        recent = [t for t in node.fault_times if s.now - t <= c.fault_window_s]
        if node.qualified is False:
            reason = f"node {node.machine_id} failed its qualification probe"
        elif len(recent) >= c.fault_threshold:
            reason = (
                f"node {node.machine_id} had {len(recent)} node faults in"
                f" {c.fault_window_s:g} s (threshold {c.fault_threshold})"
            )
        else:
            continue
        if not node.verified:
            # Anyone may say Hello under this machine's id; only a provider's word moves the
            # instance. The scheduler's quarantine still keeps work off the stream.
            out.append(
                Decision(
                    action=Action.HOLD,
                    target=inst.instance_id,
                    reason=f"{reason}, but no provider vouched for that machine id: its"
                    " instance is not touched",
                    figures={"machine_id": node.machine_id, "verified": "no"},
                )
            )
            continue
        fleet.bad.add(inst.instance_id)
        if fleet.held_off(inst.instance_id):
            continue
        figures: dict[str, Figure] = {
            "machine_id": node.machine_id,
            "faults_in_window": len(recent),
            "fault_threshold": c.fault_threshold,
            "fault_window_s": c.fault_window_s,
            "qualified": "no" if node.qualified is False else "yes",
        }
        out.append(fleet.reallocate(inst, reason, figures))
    return out


def _stranded_jobs(fleet: _Fleet) -> tuple[int, list[Decision]]:
    """(replicas to add, decisions) for queued jobs every live machine is banned from."""
    s = fleet.s
    if not fleet.live:
        return 0, []  # nothing runs: the replica rule starts fresh machines
    for job in sorted(s.banned_queued, key=lambda j: j.job_id):
        # A moving instance, or one not yet placed on a machine, may serve the job; a bad
        # one left in place (rate limit) may not: the scheduler quarantines its machine.
        if any(
            i.instance_id in fleet.moving
            or fleet.held_off(i.instance_id)
            or not fleet.machine(i)
            or (i.instance_id not in fleet.bad and fleet.machine(i) not in job.banned_machines)
            for i in fleet.live
        ):
            continue
        figures: dict[str, Figure] = {
            "job_id": job.job_id,
            "live_instances": len(fleet.live),
            "banned_machines": len(job.banned_machines),
        }
        reason = f"job {job.job_id} is banned from every live node"
        # Only a verified machine's bans move its instance (an unverified stream may have
        # collected them under another machine's id); otherwise a replica is added.
        idle = sorted(
            (
                i
                for i in fleet.live
                if i.state is InstanceState.RUNNING
                and not fleet.busy(i)
                and (node := fleet.node_of.get(i.instance_id)) is not None
                and node.verified
            ),
            key=lambda i: i.instance_id,
        )
        if idle and fleet.reallocations_used < fleet.reallocations_allowed:
            return 0, [fleet.reallocate(idle[0], f"{reason}: moving an idle one", figures)]
        if s.replicas < fleet.c.max_replicas:
            return 1, []  # the replica rule adds one and names the job
        return 0, [
            Decision(
                action=Action.HOLD,
                target=job.job_id,
                reason=f"{reason}; at max replicas and none idle (or reallocations"
                " rate-limited): it waits for a node to finish",
                figures={**figures, "max_replicas": fleet.c.max_replicas},
            )
        ]
    return 0, []


def _peer_paces(fleet: _Fleet) -> dict[tuple[str, str], dict[str, float]]:
    """Per job shape, one observed pace per live, verified machine: the median of its
    observations that span the warm-up and are not faster than the plausibility floor.
    Departed machines and unverified streams count for nothing, and a machine with many leases
    counts no more than one with a single lease."""
    c = fleet.c
    # Keyed by (JobSpec.shape.key, GPU class): the one definition of a job's shape.
    paces: dict[tuple[str, str], dict[str, list[float]]] = {}
    for _inst, node in fleet.live_with_nodes():
        if not node.verified:
            continue
        for o in node.observations:
            if o.observed_seconds_per_step is None or o.observed_steps < c.slow_warmup_steps:
                continue
            floor = shape_prior_seconds(c.min_plausible_seconds_per_step, o.shape)
            if o.observed_seconds_per_step < floor:
                continue  # implausibly fast: checkpoints committed, no training done
            comparable = paces.setdefault((o.shape.key, o.gpu_class), {})
            comparable.setdefault(node.machine_id, []).append(o.observed_seconds_per_step)
    return {
        shape: {m: statistics.median(xs) for m, xs in machines.items()}
        for shape, machines in paces.items()
    }


def _shape_factor(shape: JobShape) -> float:
    """A shape's seconds per step for one second per 1024x1024 SDXL image step (the rule
    priors use: `core.model.shape_prior_seconds`)."""
    return shape_prior_seconds(1.0, shape)


def reference_pace(snapshot: Snapshot, config: PolicyConfig, gpu_class: str) -> tuple[float, str]:
    """The GPU class's reference (seconds per 1024x1024 image step) and where it came from;
    (0, "none") while it has none."""
    pinned = config.reference_paces.get(gpu_class)
    if pinned:
        return pinned, "pinned"
    learned = snapshot.references.get(gpu_class)
    if learned is not None:
        return learned.seconds_per_step, "learned"
    return 0.0, "none"


def learn_references(snapshot: Snapshot, config: PolicyConfig) -> dict[str, Reference]:
    """The reference paces to keep, per GPU class not pinned: the median over long-lived
    (seen for `reference_min_age_s`), verified, live machines of each one's median
    observation (normalised to a 1024x1024 image step, past the warm-up, not below the
    plausibility floor), at least `slow_min_peers` machines; moved from the kept one by at
    most `reference_rate_per_hour` per hour since it last moved. Machines that arrived together
    an hour ago teach it nothing, and a holder keeping machines for hours moves it slowly."""
    c = config
    per_class: dict[str, dict[str, list[float]]] = {}
    live = {i.machine_id for i in snapshot.instances if i.state in LIVE_STATES and i.machine_id}
    for node in snapshot.nodes:
        if not node.verified or node.machine_id not in live or node.age_s < c.reference_min_age_s:
            continue
        for o in node.observations:
            if o.observed_seconds_per_step is None or o.observed_steps < c.slow_warmup_steps:
                continue
            normalised = o.observed_seconds_per_step / _shape_factor(o.shape)
            if normalised < c.min_plausible_seconds_per_step:
                continue
            per_class.setdefault(o.gpu_class, {}).setdefault(node.machine_id, []).append(normalised)
    out: dict[str, Reference] = {}
    for gpu_class, machines in per_class.items():
        if gpu_class in c.reference_paces or len(machines) < c.slow_min_peers:
            continue
        candidate = statistics.median(statistics.median(xs) for xs in machines.values())
        kept = snapshot.references.get(gpu_class)
        if kept is not None:
            # At most one hour's step at once: a reference left unmoved while the class had
            # too few long-lived machines (a fleet at zero overnight) must not bank the rate
            # for the first machines back, which may be one holder's, to spend in one tick.
            hours = min(max(snapshot.now - kept.updated_at, 0.0) / 3600.0, 1.0)
            step = c.reference_rate_per_hour**hours
            candidate = min(
                max(candidate, kept.seconds_per_step / step), kept.seconds_per_step * step
            )
        out[gpu_class] = Reference(
            seconds_per_step=candidate, updated_at=snapshot.now, machines=len(machines)
        )
    return out


def _own_pace(
    node: NodeView, job_id: str, warmup: int
) -> tuple[PaceObservation, float, str] | None:
    """The node's pace on its live lease: the slower of what was observed and what it said of
    itself (its claim can only make it look slow), with where the figure came from."""
    for o in node.observations:
        if o.job_id != job_id or not o.live:
            continue
        candidates: list[tuple[float, str]] = []
        if o.observed_seconds_per_step is not None and o.observed_steps >= warmup:
            candidates.append((o.observed_seconds_per_step, "verified checkpoints"))
        if o.reported_seconds_per_step is not None and o.reported_steps >= warmup:
            candidates.append((o.reported_seconds_per_step, "its own report"))
        if candidates:
            pace, source = max(candidates)
            return o, pace, source
    return None


def _slow_nodes(fleet: _Fleet) -> list[Decision]:
    s, c = fleet.s, fleet.c
    peer_paces = _peer_paces(fleet)
    out: list[Decision] = []
    for inst, node in fleet.live_with_nodes():
        job_id = node.lease_job_id
        if job_id is None or inst.instance_id in fleet.moving or not node.verified:
            continue
        own = _own_pace(node, job_id, c.slow_warmup_steps)
        if own is None:
            continue
        observation, pace, source = own
        peers = {
            m: x
            for m, x in peer_paces.get((observation.shape.key, observation.gpu_class), {}).items()
            if m != node.machine_id
        }
        if len(peers) < c.slow_min_peers:
            continue
        median = statistics.median(peers.values())
        spread = _MAD_TO_SIGMA * statistics.median(abs(x - median) for x in peers.values())
        limit = max(median + c.slow_stddevs * spread, median * (1.0 + c.slow_min_excess))
        # The node's compile state beside its shape: one that does not say it runs compiled
        # (a fresh node, eager) is not held to warm compiled peers. Its own word, so it moves
        # only its own verdict; what peers say of themselves changes nothing here.
        allowance = 1.0 if observation.step_compiled else c.slow_eager_allowance
        limit *= allowance
        if pace <= limit:
            continue
        # Never from live peers alone: past the class's reference too (pinned, or learned
        # slowly from long-lived machines). None yet: no verdict.
        reference, reference_source = reference_pace(s, c, observation.gpu_class)
        if reference <= 0:
            continue
        reference_limit = (
            reference
            * _shape_factor(observation.shape)
            * (1.0 + c.slow_reference_excess)
            * allowance
        )
        if pace <= reference_limit:
            continue
        limit = max(limit, reference_limit)
        dropped = fleet.last(Action.DROP_LEASE, node.machine_id, job_id)
        if dropped is not None and s.now - dropped < c.cooldown_s:
            continue  # already asked; the ledger has not caught up yet
        shown = sorted(peers.items())[:_PEERS_SHOWN]
        figures: dict[str, Figure] = {
            "machine_id": node.machine_id,
            "job_id": job_id,
            "seconds_per_step": round(pace, 4),
            "pace_source": source,
            "observed_s_per_step": _rounded(observation.observed_seconds_per_step),
            "observed_steps": observation.observed_steps,
            "reported_s_per_step": _rounded(observation.reported_seconds_per_step),
            "reported_steps": observation.reported_steps,
            "peer_median_s": round(median, 4),
            "peer_spread_s": round(spread, 4),
            "limit_s": round(limit, 4),
            "reference_s_per_image_step": round(reference, 4),
            "reference_source": reference_source,
            "peer_machines": len(peers),
            "peer_observations": " ".join(f"{m}={x:.4g}" for m, x in shown)
            + (" ..." if len(peers) > len(shown) else ""),
        }
        reason = (
            f"node {node.machine_id} takes {pace:.3g} s/step ({source}) on job {job_id}, past"
            f" {limit:.3g} s (peers: median {median:.3g} s, spread {spread:.3g} s over"
            f" {len(peers)} verified machines; {reference_source} reference {reference:.3g} s"
            " per 1024x1024 image step)"
        )
        if fleet.drops_used >= fleet.drops_allowed:
            out.append(
                Decision(
                    action=Action.HOLD,
                    target=node.machine_id,
                    job_id=job_id,
                    reason=f"{reason}; drop deferred: rate limit reached",
                    figures={
                        **figures,
                        "drops_in_window": fleet.drops_used,
                        "drops_allowed": fleet.drops_allowed,
                        "window_s": c.reallocate_window_s,
                    },
                )
            )
            continue
        fleet.drops_used += 1
        out.append(
            Decision(
                action=Action.DROP_LEASE,
                target=node.machine_id,
                job_id=job_id,
                reason=f"{reason}: the job is re-queued from its checkpoint, this machine"
                " banned for it",
                figures={
                    **figures,
                    "drops_in_window": fleet.drops_used,
                    "drops_allowed": fleet.drops_allowed,
                },
            )
        )
        if not fleet.held_off(inst.instance_id):
            out.append(fleet.reallocate(inst, reason, figures))
    return out


# A normal distribution's standard deviation is 1.4826 times its median absolute deviation.
_MAD_TO_SIGMA = 1.4826
_PEERS_SHOWN = 20


def _rounded(value: float | None) -> Figure:
    return "" if value is None else round(value, 6)


def _victims(fleet: _Fleet, count: int) -> list[str]:
    """Up to `count` idle counted instances, least useful first (those already stopping, then
    bad, banned, starting, ready ones); never one holding a lease."""
    s = fleet.s
    all_banned = s.queued_jobs > 0 and len(s.banned_queued) == s.queued_jobs

    def rank(inst: Instance) -> tuple[int, str]:
        if inst.state is InstanceState.STOPPING:
            return -1, inst.instance_id
        if inst.instance_id in fleet.bad:
            return 0, inst.instance_id
        machine = fleet.machine(inst)
        if all_banned and machine and all(machine in j.banned_machines for j in s.banned_queued):
            return 1, inst.instance_id
        if inst.state is InstanceState.STARTING:
            return 2, inst.instance_id
        return 3, inst.instance_id

    idle = [i for i in fleet.counted if not fleet.busy(i) and i.instance_id not in fleet.moving]
    return [i.instance_id for i in sorted(idle, key=rank)[: max(count, 0)]]


def _scale(fleet: _Fleet, stranded_extra: int) -> list[Decision]:
    s, c = fleet.s, fleet.c
    current = s.replicas
    work = s.queued_jobs + s.running_jobs
    # A bad node left in place (the reallocation rate limit) is quarantined by the scheduler
    # and serves nothing: while jobs queue, it does not count as capacity.
    quarantined = sum(
        1
        for i in fleet.live
        if i.instance_id in fleet.bad - fleet.moving and not fleet.held_off(i.instance_id)
    )
    extra = quarantined if s.queued_jobs > 0 else 0
    desired = min(max(work, c.min_replicas) + extra, c.max_replicas)
    starting = sum(1 for i in fleet.live if i.state is InstanceState.STARTING)
    stopping = len(fleet.counted) - len(fleet.live)
    busy_seen = sum(1 for i in fleet.counted if fleet.busy(i))
    figures: dict[str, Figure] = {
        "queued": s.queued_jobs,
        "running": s.running_jobs,
        "replicas": current,
        "live_instances": len(fleet.live),
        "starting": starting,
        "stopping": stopping,
        "bad_held": quarantined,
        "busy_instances": busy_seen,
        "unplaced_leases": s.unplaced_leases,
        "min": c.min_replicas,
        "max": c.max_replicas,
    }
    why = f"{s.queued_jobs} queued + {s.running_jobs} running jobs" + (
        f" + {extra} bad node(s) held in place" if extra else ""
    )
    if stranded_extra and desired <= current:
        desired = min(current + stranded_extra, c.max_replicas)
        why += ", and a queued job banned from every live node"
    if desired > current:
        target = min(desired, current + c.max_step)
        return [
            Decision(
                action=Action.SCALE,
                target=FLEET,
                replicas=target,
                reason=f"{why}: {current} -> {target} replicas"
                + (f" (step limit {c.max_step})" if target < desired else ""),
                figures={**figures, "desired": desired, "max_step": c.max_step},
            )
        ]
    if desired == current:
        return []
    # Shrinking: never fast, never a busy node.
    if work == 0 and s.idle_since is not None and s.now - s.idle_since < c.idle_grace_s:
        return [
            Decision(
                action=Action.HOLD,
                target=FLEET,
                reason=f"no work for {s.now - s.idle_since:.0f} s of the"
                f" {c.idle_grace_s:g} s idle grace: keeping {current} replicas",
                figures={**figures, "idle_s": round(s.now - s.idle_since, 1)},
            )
        ]
    last_scale = max((a.at for a in s.recent_actions if a.action is Action.SCALE), default=None)
    if last_scale is not None and s.now - last_scale < c.cooldown_s:
        return [
            Decision(
                action=Action.HOLD,
                target=FLEET,
                reason=f"{why} wants {desired} replicas; last scale"
                f" {s.now - last_scale:.0f} s ago, cooldown {c.cooldown_s:g} s",
                figures={**figures, "desired": desired},
            )
        ]
    if s.running_jobs > busy_seen:
        # A lease on a machine no listed instance joins (its machine id is not the provider's,
        # or its instance is gone and the lease not yet expired): any instance might be it.
        return [
            Decision(
                action=Action.HOLD,
                target=FLEET,
                reason=f"{why} wants {desired} replicas, but {s.running_jobs - busy_seen} running"
                " job(s) are on no instance the provider lists (machine ids that do not join, or"
                " a node gone whose lease has not expired): no scale-in until every busy node is"
                " seen",
                figures={**figures, "desired": desired, "unseen_busy": s.running_jobs - busy_seen},
            )
        ]
    target = max(desired, current - c.max_step)
    # The provider removes (counted - replicas) instances, lowest deletion cost first: every
    # one of them is named here, so that none is the provider's own pick among equals. Too few
    # idle ones: the count falls only as far as the named ones reach, or not at all.
    need = max(0, len(fleet.counted) - target)
    remove = _victims(fleet, need)
    if len(remove) < need:
        target = len(fleet.counted) - len(remove)
    if target >= current:
        return [
            Decision(
                action=Action.HOLD,
                target=FLEET,
                reason=f"{why} wants {desired} replicas, but every surplus instance is busy",
                figures={**figures, "desired": desired},
            )
        ]
    fleet.victims.update(remove)
    return [
        Decision(
            action=Action.SCALE,
            target=FLEET,
            replicas=target,
            remove=tuple(remove),
            reason=f"{why}: {current} -> {target} replicas, removing idle instances only"
            + (f" ({', '.join(remove)})" if remove else ""),
            figures={**figures, "desired": desired, "removed": len(remove)},
        )
    ]


def _deletion_costs(fleet: _Fleet) -> list[Decision]:
    out = []
    for inst in sorted(fleet.counted, key=lambda i: i.instance_id):
        if inst.deletion_cost is None or inst.instance_id in fleet.moving | fleet.victims:
            continue
        busy = fleet.busy(inst)
        want = fleet.c.busy_deletion_cost if busy else fleet.c.idle_deletion_cost
        if inst.deletion_cost == want:
            continue
        if not busy and inst.state is InstanceState.STOPPING and inst.deletion_cost < want:
            continue  # leaving anyway (a named victim at 0): the cheapest it may stay
        out.append(
            Decision(
                action=Action.SET_DELETION_COST,
                target=inst.instance_id,
                deletion_cost=want,
                reason=f"instance {inst.instance_id} is {'leased' if busy else 'idle'}:"
                f" deletion cost {inst.deletion_cost} -> {want}",
                figures={"from": inst.deletion_cost, "to": want},
            )
        )
    return out
