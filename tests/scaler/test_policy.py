"""The policy, table-tested: each row is a snapshot, a config, and the decisions it must yield."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lorafleet.core.spec import JobShape
from lorafleet.scaler.policy import (
    FLEET,
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
from lorafleet.scaler.provider import Instance, InstanceState

NOW = 100_000.0
CFG = PolicyConfig(
    min_replicas=0,
    max_replicas=10,
    idle_grace_s=600,
    cooldown_s=300,
    max_step=10,
    fault_threshold=3,
    fault_window_s=3600,
    slow_warmup_steps=20,
    slow_stddevs=2.0,
    slow_min_peers=3,
    slow_min_excess=0.25,
    # Pinned far below every pace here: these tests are about the peers' side of the verdict
    # (test_a_reference_* below are about the reference's).
    reference_paces={"rtx4090": 1e-9, "rtx3090": 1e-9},
    reallocate_share=0.1,
    reallocate_window_s=3600,
    reallocate_min_per_window=1,
    reallocate_holdoff_s=900,
)
SHAPE = JobShape(
    family="sdxl",
    resolution=1024,
    batch_size=1,
    accumulation=1,
    rank=4,
    precision="no",
    quantization="none",
    gradient_checkpointing=False,
    train_text_encoder=False,
)


def inst(
    name: str,
    state: InstanceState = InstanceState.RUNNING,
    *,
    machine: str | None = None,
    cost: int | None = None,
) -> Instance:
    return Instance(
        instance_id=name,
        machine_id=f"m-{name}" if machine is None else machine,
        state=state,
        deletion_cost=cost,
    )


def node(name: str, **kw: Any) -> NodeView:
    kw.setdefault("verified", True)
    return NodeView(machine_id=f"m-{name}", instance_id=name, gpu_class="rtx4090", **kw)


def seen(
    job: str,
    s_per_step: float,
    steps: int = 100,
    shape: JobShape = SHAPE,
    *,
    live: bool = True,
    gpu: str = "rtx4090",
    compiled: bool | None = True,
) -> PaceObservation:
    """A pace the scheduler observed (verified checkpoints over its clock), on a node that
    says its step runs compiled unless `compiled` says otherwise."""
    return PaceObservation(
        job_id=job,
        shape=shape,
        gpu_class=gpu,
        step_compiled=compiled,
        live=live,
        observed_seconds_per_step=s_per_step,
        observed_steps=steps,
    )


def said(job: str, s_per_step: float, steps: int = 100) -> PaceObservation:
    """A pace only the worker claims (heartbeats), nothing observed."""
    return PaceObservation(
        job_id=job,
        shape=SHAPE,
        gpu_class="rtx4090",
        step_compiled=True,
        reported_seconds_per_step=s_per_step,
        reported_steps=steps,
    )


def past(ago_s: float, action: Action, target: str, job: str | None = None) -> PastAction:
    return PastAction(at=NOW - ago_s, action=action, target=target, job_id=job)


def snap(**kw: Any) -> Snapshot:
    if "replicas" not in kw:
        kw["replicas"] = sum(
            1
            for i in kw.get("instances", ())
            if i.state in (InstanceState.STARTING, InstanceState.RUNNING)
        )
    for name in ("instances", "nodes", "banned_queued", "recent_actions"):
        kw[name] = tuple(kw.get(name, ()))
    return Snapshot(now=NOW, **kw)


def summary(decisions: list[Decision]) -> list[tuple[Any, ...]]:
    """The essential fields of each decision, for comparison with a table row."""
    out: list[tuple[Any, ...]] = []
    for d in decisions:
        assert d.reason, d
        if d.action is Action.SCALE:
            out.append(("scale", d.replicas, d.remove))
        elif d.action is Action.DROP_LEASE:
            out.append(("drop", d.target, d.job_id))
        elif d.action is Action.SET_DELETION_COST:
            out.append(("cost", d.target, d.deletion_cost))
        else:
            out.append((d.action.value, d.target))
    return out


def busy(name: str, job: str = "j-run", **kw: Any) -> NodeView:
    return node(name, lease_job_id=job, **kw)


# -- replicas follow the work ----------------------------------------------------------------

SCALE_CASES = [
    pytest.param(snap(), CFG, [], id="zero nodes, no work: nothing"),
    pytest.param(snap(queued_jobs=3), CFG, [("scale", 3, ())], id="zero nodes, 3 queued: 3"),
    pytest.param(
        snap(queued_jobs=30), replace(CFG, max_step=4), [("scale", 4, ())], id="step bound"
    ),
    pytest.param(
        snap(
            queued_jobs=30,
            instances=[inst(f"i{k}") for k in range(8)],
            nodes=[busy(f"i{k}", f"j{k}") for k in range(8)],
            running_jobs=8,
        ),
        CFG,
        [("scale", 10, ())],
        id="clamped to max",
    ),
    pytest.param(snap(), replace(CFG, min_replicas=2), [("scale", 2, ())], id="min floor, no work"),
    pytest.param(
        snap(queued_jobs=3, instances=[inst(f"i{k}", InstanceState.STARTING) for k in range(3)]),
        CFG,
        [],
        id="instances still starting count",
    ),
    pytest.param(
        snap(queued_jobs=3, replicas=3, instances=[inst("i0", InstanceState.STARTING)]),
        CFG,
        [],
        id="replicas asked for but not yet listed count",
    ),
    pytest.param(
        snap(
            instances=[inst("i0"), inst("i1")], nodes=[node("i0"), node("i1")], idle_since=NOW - 100
        ),
        CFG,
        [("hold", FLEET)],
        id="idle grace not over: keep",
    ),
    pytest.param(
        snap(
            instances=[inst("i0"), inst("i1")], nodes=[node("i0"), node("i1")], idle_since=NOW - 601
        ),
        CFG,
        [("scale", 0, ("i0", "i1"))],
        id="idle grace over: scale to zero",
    ),
    pytest.param(
        snap(
            instances=[inst(f"i{k}") for k in range(3)],
            nodes=[node(f"i{k}") for k in range(3)],
            idle_since=NOW - 601,
        ),
        replace(CFG, min_replicas=1),
        [("scale", 1, ("i0", "i1"))],
        id="scale in stops at min",
    ),
    pytest.param(
        snap(
            instances=[inst(f"i{k:02}") for k in range(10)],
            nodes=[node(f"i{k:02}") for k in range(10)],
            idle_since=NOW - 601,
        ),
        replace(CFG, max_step=3),
        [("scale", 7, ("i00", "i01", "i02"))],
        id="scale in step bound",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b"), inst("c")],
            nodes=[busy("a", "j1"), node("b"), busy("c", "j2")],
            running_jobs=2,
        ),
        CFG,
        [("scale", 2, ("b",))],
        id="scale in removes the idle node, never a busy one",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b")],
            nodes=[busy("a", "j1"), busy("b", "j2")],
            running_jobs=1,
        ),
        CFG,
        [("hold", FLEET)],
        id="surplus but every instance busy: hold",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b"), inst("c")],
            nodes=[node("a"), node("b"), node("c")],
            running_jobs=1,
            recent_actions=[past(60, Action.SCALE, FLEET)],
        ),
        CFG,
        [("hold", FLEET)],
        id="cooldown after a scale: no flapping",
    ),
    pytest.param(
        snap(
            queued_jobs=2,
            instances=[inst("a")],
            nodes=[busy("a", "j1")],
            running_jobs=1,
            recent_actions=[past(60, Action.SCALE, FLEET)],
        ),
        CFG,
        [("scale", 3, ())],
        id="growth is not held by the cooldown",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("s", InstanceState.STARTING, machine=""), inst("b")],
            nodes=[node("a"), node("b")],
            idle_since=NOW - 601,
        ),
        replace(CFG, min_replicas=2),
        [("scale", 2, ("s",))],
        id="starting instances go before ready idle ones",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b"), inst("x", InstanceState.STOPPING)],
            nodes=[node("a"), node("b")],
            replicas=2,
            idle_since=NOW - 601,
        ),
        CFG,
        # The provider still counts the stopping one: it is named too (first, it is leaving).
        [("scale", 0, ("x", "a", "b"))],
        id="stopping instances are counted and named",
    ),
]


@pytest.mark.parametrize(("snapshot", "config", "expected"), SCALE_CASES)
def test_replicas(
    snapshot: Snapshot, config: PolicyConfig, expected: list[tuple[Any, ...]]
) -> None:
    assert summary(decide(snapshot, config)) == expected


def test_flapping_work_does_not_flap_the_fleet() -> None:
    """Work that comes and goes within the grace and the cooldown never shrinks the fleet."""
    instances = [inst("a"), inst("b")]
    nodes = [node("a"), node("b")]
    recent = [past(30, Action.SCALE, FLEET)]
    for work, idle_since in [(2, None), (0, NOW - 10), (1, None), (0, NOW - 5)]:
        snapshot = snap(
            instances=instances,
            nodes=nodes,
            queued_jobs=work,
            idle_since=idle_since,
            recent_actions=recent,
        )
        actions = {d.action for d in decide(snapshot, CFG)}
        assert Action.SCALE not in actions, (work, idle_since)


# -- bad nodes -------------------------------------------------------------------------------

FAULTS = (NOW - 10, NOW - 20, NOW - 30)

BAD_CASES = [
    pytest.param(
        snap(instances=[inst("a")], nodes=[busy("a", fault_times=FAULTS)], running_jobs=1),
        CFG,
        [("reallocate", "a")],
        id="faults past threshold: reallocate",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[busy("a", fault_times=(NOW - 10, NOW - 20, NOW - 4000))],
            running_jobs=1,
        ),
        CFG,
        [],
        id="old faults fall out of the window",
    ),
    pytest.param(
        snap(instances=[inst("a")], nodes=[node("a", qualified=False)], queued_jobs=1),
        CFG,
        [("reallocate", "a")],
        id="failed qualification: reallocate",
    ),
    pytest.param(
        snap(instances=[inst("a")], nodes=[node("a", qualified=None)], queued_jobs=1),
        CFG,
        [],
        id="not yet qualified is not bad",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[busy("a", fault_times=FAULTS)],
            running_jobs=1,
            recent_actions=[past(100, Action.REALLOCATE, "a")],
        ),
        CFG,
        [],
        id="reallocated moments ago: hold-off, no flapping",
    ),
    pytest.param(
        snap(
            instances=[inst("a", InstanceState.STOPPING)],
            nodes=[busy("a", fault_times=FAULTS)],
            replicas=0,
            running_jobs=1,
        ),
        CFG,
        [("scale", 1, ())],
        id="a bad node already stopping is left alone",
    ),
    pytest.param(
        snap(
            instances=[inst(f"i{k}") for k in range(10)],
            nodes=[busy(f"i{k}", f"j{k}", fault_times=FAULTS if k < 3 else ()) for k in range(10)],
            running_jobs=10,
        ),
        CFG,
        [("reallocate", "i0"), ("hold", "i1"), ("hold", "i2")],
        id="rate limit: 10% of 10 nodes per window",
    ),
    pytest.param(
        snap(
            instances=[inst(f"i{k}") for k in range(20)],
            nodes=[busy(f"i{k}", f"j{k}", fault_times=FAULTS if k < 3 else ()) for k in range(20)],
            running_jobs=20,
            recent_actions=[past(1000, Action.REALLOCATE, "old")],
        ),
        replace(CFG, max_replicas=20),
        [("reallocate", "i0"), ("hold", "i1"), ("hold", "i2")],
        id="rate limit counts the window's past reallocations",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[busy("a", fault_times=FAULTS)],
            running_jobs=1,
            recent_actions=[past(3000, Action.REALLOCATE, "old")],
        ),
        CFG,
        [("hold", "a")],
        id="rate limit hit in a fleet of one",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[busy("a", fault_times=FAULTS)],
            running_jobs=1,
            recent_actions=[past(4000, Action.REALLOCATE, "old")],
        ),
        CFG,
        [("reallocate", "a")],
        id="a fleet of one can still heal (never below min allowance)",
    ),
    pytest.param(
        snap(
            instances=[inst("a", machine="m-new")],
            nodes=[busy("a", fault_times=FAULTS)],
            queued_jobs=1,
        ),
        CFG,
        [],
        id="a reallocated instance on a new machine does not inherit old faults",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[node("a", qualified=False, verified=False)],
            queued_jobs=1,
        ),
        CFG,
        [("hold", "a")],
        id="an unverified id's failed probe: the instance is not touched, a hold says why",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[busy("a", fault_times=FAULTS, verified=False)],
            running_jobs=1,
        ),
        CFG,
        [("hold", "a")],
        id="an unverified id's node faults: the instance is not touched",
    ),
]


@pytest.mark.parametrize(("snapshot", "config", "expected"), BAD_CASES)
def test_bad_nodes(
    snapshot: Snapshot, config: PolicyConfig, expected: list[tuple[Any, ...]]
) -> None:
    assert summary(decide(snapshot, config)) == expected


# -- slow nodes ------------------------------------------------------------------------------

PEERS = [node(f"p{k}", observations=(seen(f"old{k}", s),)) for k, s in enumerate([1.0, 1.1, 0.9])]
PEER_INSTANCES = [inst(f"p{k}") for k in range(3)]


def slow_snap(
    s_per_step: float, *, steps: int = 100, peers: list[NodeView] = PEERS, **kw: Any
) -> Snapshot:
    return snap(
        instances=[inst("slow"), *PEER_INSTANCES],
        nodes=[busy("slow", "j1", observations=(seen("j1", s_per_step, steps),)), *peers],
        running_jobs=1,
        queued_jobs=3,
        **kw,
    )


SLOW_CASES = [
    pytest.param(
        slow_snap(12.0),
        CFG,
        [("drop", "m-slow", "j1"), ("reallocate", "slow")],
        id="12x slower: drop the lease and reallocate",
    ),
    pytest.param(slow_snap(1.15), CFG, [], id="within two standard deviations"),
    pytest.param(slow_snap(12.0, steps=10), CFG, [], id="still warming up"),
    pytest.param(slow_snap(12.0, peers=PEERS[:2]), CFG, [], id="too few peer machines"),
    pytest.param(
        slow_snap(
            12.0,
            peers=[
                node(f"p{k}", observations=(seen(f"o{k}", 1.0, gpu="rtx3090"),)) for k in range(3)
            ],
        ),
        CFG,
        [],
        id="peers of another shape do not count",
    ),
    pytest.param(
        slow_snap(
            12.0,
            peers=[node(f"p{k}", observations=(seen(f"o{k}", 1.0, steps=5),)) for k in range(3)],
        ),
        CFG,
        [],
        id="peers still warming up do not count",
    ),
    pytest.param(
        slow_snap(1.1, peers=[node(f"p{k}", observations=(seen(f"o{k}", 1.0),)) for k in range(3)]),
        CFG,
        [],
        id="identical peers: 10% slower is not slow",
    ),
    pytest.param(
        slow_snap(1.5, peers=[node(f"p{k}", observations=(seen(f"o{k}", 1.0),)) for k in range(3)]),
        CFG,
        [("drop", "m-slow", "j1"), ("reallocate", "slow")],
        id="identical peers: 50% slower is slow",
    ),
    pytest.param(
        slow_snap(12.0, recent_actions=[past(30, Action.DROP_LEASE, "m-slow", "j1")]),
        CFG,
        [],
        id="lease drop already asked: not again",
    ),
    pytest.param(
        slow_snap(12.0, recent_actions=[past(30, Action.REALLOCATE, "other")]),
        CFG,
        [("drop", "m-slow", "j1"), ("hold", "slow")],
        id="rate limit hit: the lease is dropped, the reallocation held",
    ),
    pytest.param(
        slow_snap(12.0, recent_actions=[past(600, Action.DROP_LEASE, "m-other", "j9")]),
        CFG,
        [("hold", "m-slow")],
        id="drop rate limit hit: neither drop nor reallocation, a hold says why",
    ),
    pytest.param(
        slow_snap(12.0, peers=[replace(p, verified=False) for p in PEERS]),
        CFG,
        [],
        id="unverified peers are nobody's peers",
    ),
    pytest.param(
        snap(
            instances=[inst("slow"), *PEER_INSTANCES[:2]],
            nodes=[busy("slow", "j1", observations=(seen("j1", 12.0),)), *PEERS],
            running_jobs=1,
            queued_jobs=2,
        ),
        CFG,
        [],
        id="a peer whose instance is gone counts no more",
    ),
    pytest.param(
        slow_snap(
            12.0,
            peers=[
                *PEERS[:2],
                node("p2", observations=tuple(seen(f"f{k}", 0.1) for k in range(50))),
            ],
        ),
        CFG,
        [("drop", "m-slow", "j1"), ("reallocate", "slow")],
        id="one machine's many leases are one observation",
    ),
    pytest.param(
        slow_snap(1.05, peers=[*PEERS[:2], node("p2", observations=(seen("f", 1e-6),))]),
        CFG,
        [],
        id="one liar among the peers moves the median little",
    ),
    pytest.param(
        slow_snap(
            12.0, peers=[node(f"p{k}", observations=(said(f"o{k}", 1.0),)) for k in range(3)]
        ),
        CFG,
        [],
        id="what peers say of themselves is no observation",
    ),
    pytest.param(
        snap(
            instances=[inst("slow"), *PEER_INSTANCES],
            nodes=[busy("slow", "j1", observations=(said("j1", 12.0),)), *PEERS],
            running_jobs=1,
            queued_jobs=3,
        ),
        CFG,
        [("drop", "m-slow", "j1"), ("reallocate", "slow")],
        id="a node's own claim convicts itself",
    ),
    pytest.param(
        snap(
            instances=[inst("slow"), *PEER_INSTANCES],
            nodes=[
                busy(
                    "slow",
                    "j1",
                    observations=(
                        replace(seen("j1", 12.0), reported_seconds_per_step=0.5, reported_steps=99),
                    ),
                ),
                *PEERS,
            ],
            running_jobs=1,
            queued_jobs=3,
        ),
        CFG,
        [("drop", "m-slow", "j1"), ("reallocate", "slow")],
        id="a node's fast claim does not hide what was observed",
    ),
    pytest.param(
        snap(
            instances=[inst("slow"), *PEER_INSTANCES],
            nodes=[
                busy("slow", "j1", observations=(seen("j1", 12.0),), verified=False),
                *PEERS,
            ],
            running_jobs=1,
            queued_jobs=3,
        ),
        CFG,
        [],
        id="an unverified node's instance is never touched",
    ),
]


@pytest.mark.parametrize(("snapshot", "config", "expected"), SLOW_CASES)
def test_slow_nodes(
    snapshot: Snapshot, config: PolicyConfig, expected: list[tuple[Any, ...]]
) -> None:
    assert summary(decide(snapshot, config)) == expected


def test_slow_decision_carries_its_figures() -> None:
    drop = decide(slow_snap(12.0), CFG)[0]
    assert drop.figures["seconds_per_step"] == 12.0
    assert drop.figures["peer_machines"] == 3
    assert drop.figures["peer_median_s"] == pytest.approx(1.0)
    assert drop.figures["pace_source"] == "verified checkpoints"
    # The observations behind the verdict are on the record.
    assert drop.figures["peer_observations"] == "m-p0=1 m-p1=1.1 m-p2=0.9"
    assert drop.figures["drops_in_window"] == 1 and drop.figures["drops_allowed"] == 1
    assert "12 s/step" in drop.reason and "re-queued" in drop.reason


# -- the reference pace ----------------------------------------------------------------------

UNPINNED = replace(CFG, reference_paces={})
HOURS = 3600.0


def test_a_reference_is_needed_besides_the_peers() -> None:
    """Live peers alone convict nobody: with no reference for the class, a node 12x its
    peers' median keeps its lease; past a learned reference too (1 s per image step, x 1.5),
    it is dropped; within it (the peers colluding fast), it is not."""
    assert decide(slow_snap(12.0), UNPINNED) == []
    learned = {"rtx4090": Reference(seconds_per_step=1.0, updated_at=NOW)}
    assert summary(decide(slow_snap(12.0, references=learned), UNPINNED))[:1] == [
        ("drop", "m-slow", "j1")
    ]
    fast_peers = [node(f"p{i}", observations=(seen(f"jp{i}", 0.067),)) for i in range(len(PEERS))]
    assert decide(slow_snap(1.0, peers=fast_peers, references=learned), UNPINNED) == []
    drop = decide(slow_snap(12.0, references=learned), UNPINNED)[0]
    assert drop.figures["reference_source"] == "learned"
    assert drop.figures["reference_s_per_image_step"] == 1.0


def test_a_reference_is_learned_from_long_lived_machines_at_a_bounded_rate() -> None:
    old = [node(f"o{i}", age_s=7 * HOURS, observations=(seen(f"jo{i}", 1.0),)) for i in range(3)]
    young = [node(f"y{i}", age_s=HOURS, observations=(seen(f"jy{i}", 0.067),)) for i in range(5)]
    instances = [inst(n.instance_id or "") for n in [*old, *young]]
    # Only machines seen for six hours teach it; five young ones reporting 0.067 do not.
    learned = learn_references(snap(instances=instances, nodes=[*old, *young]), UNPINNED)
    assert learned["rtx4090"].seconds_per_step == pytest.approx(1.0)
    assert learned["rtx4090"].machines == 3
    # Three colluding machines kept for seven hours, against a reference of 1.0 set an hour
    # ago: it moves by at most 1.25x per hour, not to their 0.067.
    colluding = [
        node(f"c{i}", age_s=7 * HOURS, observations=(seen(f"jc{i}", 0.067),)) for i in range(3)
    ]
    kept = {"rtx4090": Reference(seconds_per_step=1.0, updated_at=NOW - HOURS)}
    moved = learn_references(
        snap(
            instances=[inst(n.instance_id or "") for n in colluding],
            nodes=colluding,
            references=kept,
        ),
        UNPINNED,
    )
    assert moved["rtx4090"].seconds_per_step == pytest.approx(1.0 / 1.25)
    # A reference left unmoved for twelve hours (the class had no long-lived machines: a fleet
    # at zero overnight) moves one hour's step when they come back, not 1.25 ** 12 (14.6x):
    # before, the first machines back, one holder's, took it to 0.069 in one tick.
    idle = {"rtx4090": Reference(seconds_per_step=1.0, updated_at=NOW - 12 * HOURS)}
    after_idle = learn_references(
        snap(
            instances=[inst(n.instance_id or "") for n in colluding],
            nodes=colluding,
            references=idle,
        ),
        UNPINNED,
    )
    assert after_idle["rtx4090"].seconds_per_step == pytest.approx(1.0 / 1.25)
    # Too few long-lived machines, or a pinned class: nothing learned.
    assert learn_references(snap(instances=instances[:2], nodes=old[:2]), UNPINNED) == {}
    assert learn_references(snap(instances=instances, nodes=[*old, *young]), CFG) == {}


# -- no stranded job -------------------------------------------------------------------------

BANNED_A = QueuedJob(job_id="jq", banned_machines=frozenset({"m-a"}))
BANNED_AB = QueuedJob(job_id="jq", banned_machines=frozenset({"m-a", "m-b"}))

STRANDED_CASES = [
    pytest.param(
        snap(instances=[inst("a")], nodes=[node("a")], queued_jobs=1, banned_queued=[BANNED_A]),
        replace(CFG, min_replicas=1, max_replicas=1),
        [("reallocate", "a")],
        id="one-node deadlock: the idle banned node is reallocated",
    ),
    pytest.param(
        snap(instances=[inst("a")], nodes=[node("a")], queued_jobs=1, banned_queued=[BANNED_A]),
        CFG,
        [("reallocate", "a")],
        id="below max too, an idle banned node moves",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[busy("a")],
            queued_jobs=1,
            running_jobs=1,
            banned_queued=[BANNED_A],
        ),
        CFG,
        [("scale", 2, ())],
        id="growth already brings a fresh node",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b")],
            nodes=[busy("a", "j1"), busy("b", "j2")],
            queued_jobs=1,
            running_jobs=1,
            banned_queued=[BANNED_AB],
        ),
        CFG,
        [("scale", 3, ())],
        id="all banned nodes busy: add a replica",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b")],
            nodes=[busy("a", "j1"), busy("b", "j2")],
            queued_jobs=1,
            running_jobs=1,
            banned_queued=[BANNED_AB],
        ),
        replace(CFG, max_replicas=2),
        [("hold", "jq")],
        id="at max and all busy: wait",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b")],
            nodes=[node("a"), busy("b")],
            queued_jobs=1,
            running_jobs=1,
            banned_queued=[BANNED_A],
        ),
        CFG,
        [],
        id="a live node not banned: not stranded",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("s", InstanceState.STARTING, machine="")],
            nodes=[node("a")],
            queued_jobs=1,
            banned_queued=[BANNED_A],
            replicas=2,
            recent_actions=[past(10, Action.SCALE, FLEET)],
        ),
        CFG,
        [("hold", FLEET)],
        id="a starting instance may serve it: not stranded",
    ),
    pytest.param(
        snap(queued_jobs=1, banned_queued=[BANNED_A]),
        CFG,
        [("scale", 1, ())],
        id="zero nodes: the replica rule starts one",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[node("a")],
            queued_jobs=1,
            banned_queued=[BANNED_A],
            recent_actions=[past(60, Action.REALLOCATE, "x")],
        ),
        CFG,
        [("scale", 2, ())],
        id="reallocations used up: add a replica instead",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[node("a")],
            queued_jobs=1,
            banned_queued=[BANNED_A],
            recent_actions=[past(60, Action.REALLOCATE, "x")],
        ),
        replace(CFG, max_replicas=1),
        [("hold", "jq")],
        id="rate-limited at max: wait",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b")],
            nodes=[node("a", qualified=False), node("b")],
            queued_jobs=1,
            banned_queued=[BANNED_AB],
        ),
        CFG,
        [("reallocate", "a"), ("scale", 1, ("b",))],
        id="a bad node moving this tick already un-strands it",
    ),
    pytest.param(
        snap(
            instances=[inst("a"), inst("b"), inst("c")],
            nodes=[node("a"), node("b"), busy("c")],
            queued_jobs=1,
            running_jobs=1,
            banned_queued=[BANNED_A],
            recent_actions=[past(400, Action.SCALE, FLEET)],
        ),
        CFG,
        [("scale", 2, ("a",))],
        id="scale in removes the node banned from all queued work",
    ),
    pytest.param(
        snap(
            instances=[inst("a")],
            nodes=[node("a", verified=False)],
            queued_jobs=1,
            banned_queued=[BANNED_A],
        ),
        CFG,
        [("scale", 2, ())],
        id="bans under an unverified id move no instance: a replica is added",
    ),
]


@pytest.mark.parametrize(("snapshot", "config", "expected"), STRANDED_CASES)
def test_stranded_jobs(
    snapshot: Snapshot, config: PolicyConfig, expected: list[tuple[Any, ...]]
) -> None:
    assert summary(decide(snapshot, config)) == expected


# -- deletion cost ---------------------------------------------------------------------------

COST_CASES = [
    pytest.param(
        snap(instances=[inst("a", cost=1)], nodes=[busy("a")], running_jobs=1),
        [("cost", "a", 100_000)],
        id="leased: high",
    ),
    pytest.param(
        snap(instances=[inst("a", cost=100_000)], nodes=[node("a")], queued_jobs=1),
        [("cost", "a", 1)],
        id="idle again: low",
    ),
    pytest.param(
        snap(instances=[inst("a", InstanceState.STARTING, cost=0)], queued_jobs=1),
        [("cost", "a", 1)],
        id="starting: idle cost",
    ),
    pytest.param(
        snap(instances=[inst("a", cost=100_000)], nodes=[busy("a")], running_jobs=1),
        [],
        id="already right: nothing",
    ),
    pytest.param(
        snap(instances=[inst("a")], nodes=[busy("a")], running_jobs=1),
        [],
        id="provider without deletion cost: nothing",
    ),
]


@pytest.mark.parametrize(("snapshot", "expected"), COST_CASES)
def test_deletion_costs(snapshot: Snapshot, expected: list[tuple[Any, ...]]) -> None:
    assert summary(decide(snapshot, CFG)) == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"min_replicas": 3, "max_replicas": 2},
        {"max_step": 0},
        {"slow_min_peers": 1},
        {"reallocate_share": 1.5},
        {"idle_deletion_cost": 100_000},
    ],
)
def test_config_rejects_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"need|>=|in"):
        replace(CFG, **bad)
