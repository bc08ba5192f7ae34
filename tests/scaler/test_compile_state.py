"""The slow-node comparison keys paces by the one job shape (`JobSpec.shape.key`) and the GPU
class, with the node's compile state beside them (docs/DESIGN.md, "Job shape"): a fresh node
running its step eager beside warm compiled peers (2 to 2.5x their pace) is not called slow.
The compile state is the worker's word (Heartbeat.step_compiled), so it only chooses what that
node's own pace is held to."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scaler.policy import Action, NodeView, PolicyConfig, Snapshot, decide
from tests.scaler.test_policy import CFG, PEER_INSTANCES, busy, inst, node, seen, snap
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker, local_identity

# Warm compiled peers on an H200 (0.36 s a step) and a fresh node beside them.
COMPILED_PEERS = [
    node(f"p{k}", observations=(seen(f"old{k}", s, compiled=True),))
    for k, s in enumerate([0.36, 0.37, 0.35])
]


def fresh(
    s_per_step: float, *, compiled: bool | None, peers: list[NodeView] | None = None
) -> Snapshot:
    peers = COMPILED_PEERS if peers is None else peers
    return snap(
        instances=[inst("fresh"), *PEER_INSTANCES],
        nodes=[
            busy("fresh", "j1", observations=(seen("j1", s_per_step, compiled=compiled),)),
            *peers,
        ],
        running_jobs=1,
        queued_jobs=3,
    )


def drops(
    config: PolicyConfig,
    s_per_step: float,
    *,
    compiled: bool | None,
    peers: list[NodeView] | None = None,
) -> bool:
    decisions = decide(fresh(s_per_step, compiled=compiled, peers=peers), config)
    return any(d.action is Action.DROP_LEASE for d in decisions)


@pytest.mark.parametrize("compiled", [False, None], ids=["says-eager", "says-nothing"])
def test_a_fresh_eager_node_beside_compiled_peers_is_not_called_slow(
    compiled: bool | None,
) -> None:
    """0.85 s a step eager, 2.4x the compiled peers' median: within the eager allowance. Before,
    the comparison knew no compile state and dropped it (limit 0.45 s)."""
    assert not drops(CFG, 0.85, compiled=compiled)
    # Really slow eager (10x) is still slow.
    assert drops(CFG, 3.6, compiled=compiled)


def test_a_node_saying_it_runs_compiled_is_held_to_its_compiled_peers() -> None:
    """The word only ever spares its speaker: one that says it runs compiled at the same pace
    is dropped; peers that say they run eager (at a compiled pace) move nothing for it."""
    assert drops(CFG, 0.85, compiled=True)
    eager_peers = [
        node(f"p{k}", observations=(seen(f"old{k}", s, compiled=False),))
        for k, s in enumerate([0.36, 0.37, 0.35])
    ]
    assert drops(CFG, 0.85, compiled=True, peers=eager_peers)
    # With no allowance configured, the old comparison: an eager node is judged as compiled.
    assert drops(replace(CFG, slow_eager_allowance=1.0), 0.85, compiled=False)


def test_peers_of_another_job_shape_key_are_not_peers() -> None:
    """Peers that ran the same resolution and batch but with gradient checkpointing (another
    `JobSpec.shape.key`) are not compared with: no verdict without peers of the same shape."""
    other = replace(seen("x", 0.36).shape, gradient_checkpointing=True)
    peers = [node(f"p{k}", observations=(seen(f"old{k}", 0.36, shape=other),)) for k in range(3)]
    assert not drops(CFG, 12.0, compiled=True, peers=peers)


async def test_the_ledger_gives_the_scaler_the_shape_and_the_workers_word(fleet: Fleet) -> None:
    """A verified worker's heartbeats say its step runs eager, then compiled: the scaler's
    observation of the lease carries the latest word and the job's `JobSpec.shape`."""
    job = await fleet.alice.submit(gradient_checkpointing=True, max_train_steps=100)
    identity = local_identity(fleet.scheduler.identity_secret, "m1")
    async with connect_worker(fleet.channel, fleet.token, "m1", identity=identity) as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 1, step_compiled=False)
        await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 1)
        (first,) = await fleet.scheduler.ledger.pace_observations(3600.0, 10)
        assert first.step_compiled is False
        await worker.heartbeat(granted.lease, 2, step_compiled=True)
        await worker.heartbeat(granted.lease, 3)  # saying nothing keeps the last word
        # The stream's messages are handled in order, and a notice is on the timeline (the
        # heartbeats' events are rate-limited): once it is there, so are they.
        await worker.send(notice=fpb.Notice(lease=worker.ref(granted.lease), message="sync"))
        await fleet.alice.wait_event(
            job.job_id, pb.JOB_EVENT_KIND_NOTICE, lambda e: e.message == "sync"
        )
        (record,) = await fleet.scheduler.ledger.pace_observations(3600.0, 10)
    stored = await fleet.scheduler.ledger.get_job_any_owner(job.job_id)
    assert stored is not None
    assert record.step_compiled is True
    assert record.shape == stored.spec.shape and record.shape.gradient_checkpointing
    assert record.shape.key == JobSpec.from_dict(stored.spec.to_dict()).shape.key
    assert (await fleet.alice.get(job.job_id)).state == pb.JOB_STATE_RUNNING
