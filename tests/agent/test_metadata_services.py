"""The agent and its provider's metadata service, against a real scheduler and real training:
EC2's spot interruption notice drains it like SIGTERM; on SaladCloud, a failed qualification
probe makes it ask its node's metadata service to be reallocated.

Both metadata services are doubles over HTTP on loopback (tests/worker). Every wait is on a
pushed signal (WatchJob events, the doubles' request events, the agent's state) and bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.sessions import SessionState
from lorafleet.worker.agent import Agent, State
from lorafleet.worker.qualify import QualificationResult
from tests.support.fleet import Fleet, running
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S
from tests.worker.imds_double import ImdsDouble
from tests.worker.salad_imds_double import SaladImdsDouble

# Real workers training the tiny model (in this process or as processes): slow, not in
# the fast lane (README, Development).
pytestmark = pytest.mark.slow

KIND = pb.JobEventKind
NOTICE = {"action": "terminate", "time": "2025-01-01T00:02:00Z"}


@pytest.fixture
async def ec2_imds() -> AsyncIterator[ImdsDouble]:
    double = ImdsDouble()
    await double.start()
    yield double
    await double.close()


@pytest.fixture
async def salad_imds() -> AsyncIterator[SaladImdsDouble]:
    double = SaladImdsDouble()
    await double.start()
    yield double
    await double.close()


async def test_a_spot_notice_drains_the_lease_with_a_final_checkpoint(
    fleet: Fleet, ec2_imds: ImdsDouble, cpu_qualification: QualificationResult
) -> None:
    config = fleet.worker_config(
        "i-0123456789abcdef0",
        spot_notice="ec2",
        spot_notice_interval_s=0.05,
        ec2_metadata_url=ec2_imds.base_url,
    )
    agent = Agent(config, qualification=cpu_qualification)
    async with running(agent) as task:
        job = await fleet.client.submit(max_train_steps=200, checkpointing_steps=2)
        await fleet.client.wait_event(
            job.job_id, KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED, lambda e: e.step == 2
        )
        # The watcher has been looking all along, and found nothing.
        ec2_imds.polled.clear()
        await asyncio.wait_for(ec2_imds.polled.wait(), WAIT_S)
        assert agent.state is State.LEASED
        runner = agent.runner
        assert runner is not None
        step_at_notice = runner.progress.latest().step
        loop = asyncio.get_running_loop()
        noticed_at = loop.time()
        ec2_imds.notice = NOTICE
        async with asyncio.timeout(WAIT_S):
            await task  # run() returns once drained
        drain_s = loop.time() - noticed_at
        assert agent.state in (State.STOPPED,)
    # Well inside EC2's two minutes: a poll interval plus the drain's own bound.
    assert drain_s < config.spot_notice_interval_s + config.drain_grace_s
    events = await fleet.client.events(job.job_id)
    commits = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_CHECKPOINT_COMMITTED]
    drained = [e for e in events if e.kind == KIND.JOB_EVENT_KIND_DRAINED]
    assert len(drained) == 1, [pb.JobEventKind.Name(e.kind) for e in events]
    assert "spot interruption notice: terminate" in drained[0].message
    # The drain's own checkpoint: committed before the job was handed back, at least as far
    # as training had come when the notice appeared.
    assert commits[-1].event_id < drained[0].event_id
    assert commits[-1].step >= max(step_at_notice, 3)
    assert commits[-1].step < 200
    current = await fleet.client.get(job.job_id)
    assert current.state == pb.JOB_STATE_QUEUED


async def test_a_failed_probe_asks_saladcloud_for_another_node(
    fleet: Fleet, salad_imds: SaladImdsDouble
) -> None:
    config = fleet.worker_config(
        "salad-node-1",
        allow_cpu=False,  # the real probe fails on this CPU-only machine
        salad_reallocate=True,
        salad_imds_url=salad_imds.base_url,
    )
    agent = Agent(config)
    async with running(agent):
        async with asyncio.timeout(WAIT_S):
            await agent.wait_until(lambda a: a.reallocation_requested is not None)
            await agent.wait_for_state(State.IDLE)
        assert agent.reallocation_requested is True
        assert salad_imds.refused == []
        (request,) = salad_imds.reallocations
        assert request.reason.startswith("lorafleet qualification failed: ")
        assert "--allow-cpu" in request.reason
        # Until SaladCloud moves it, the worker stays connected (the scaler sees why).
        session = fleet.scheduler.sessions.by_machine["salad-node-1"]
        assert session.state is SessionState.UNQUALIFIED


async def test_a_refused_reallocation_leaves_the_worker_connected(
    fleet: Fleet, salad_imds: SaladImdsDouble
) -> None:
    salad_imds.status = 404
    config = fleet.worker_config(
        "salad-node-2",
        allow_cpu=False,
        salad_reallocate=True,
        salad_imds_url=salad_imds.base_url,
    )
    agent = Agent(config)
    async with running(agent):
        async with asyncio.timeout(WAIT_S):
            await agent.wait_until(lambda a: a.reallocation_requested is not None)
            await agent.wait_for_state(State.IDLE)
        assert agent.reallocation_requested is False
        assert salad_imds.reallocations == [] and salad_imds.refused
        assert agent.state is State.IDLE
