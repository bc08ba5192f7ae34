"""A warm worker: the base model stays loaded between leases, and a job trains the same bits on
a worker that trained other owners' jobs before as on a fresh one (real agents, the real
scheduler, the tiny model on the CPU)."""

from __future__ import annotations

import asyncio
from datetime import UTC

import pytest
from peft.tuners.tuners_utils import BaseTunerLayer

from lorafleet.core.model import upload_key
from lorafleet.core.serde import spec_from_proto
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.worker.agent import Agent, State
from lorafleet.worker.lease_runner import LeaseRunner, training_config_for
from lorafleet.worker.qualify import QualificationResult
from lorafleet.worker.training.config import resolve_runtime
from tests.support.fleet import NUM_IMAGES, Fleet, running
from tests.support.images import png
from tests.support.jobs import PREFIX
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S

pytestmark = pytest.mark.slow

SUCCEEDED = pb.JOB_STATE_SUCCEEDED


def resident_adapters(agent: Agent, job: pb.Job) -> list[object]:
    """The LoRA layers on the idle agent's resident UNet (resident for `job`)."""
    config = training_config_for(agent.config, spec_from_proto(job.spec))
    assert config.spec.resident_key == agent.resident.key
    unet = agent.resident.components_for(config, resolve_runtime(config)).denoiser
    return [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]


# The job compared: its result must not depend on what its worker did before.
JOB_A = dict(max_train_steps=3, checkpointing_steps=2, seed=21, lora_dropout=0.1)


async def test_a_job_trains_the_same_bits_on_a_fresh_worker_and_a_warm_one(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    for i in range(NUM_IMAGES):
        await fleet.scheduler.storage.put_bytes(upload_key("bob", PREFIX, f"{i}.png"), png(i))

    fresh = Agent(
        fleet.worker_config("fresh", compile_model="auto"), qualification=cpu_qualification
    )
    async with running(fresh):
        cold = await fleet.alice.submit(**JOB_A)
        cold_done = await fleet.alice.wait_state(cold.job_id, SUCCEEDED)

    warm = Agent(fleet.worker_config("warm", compile_model="auto"), qualification=cpu_qualification)
    async with running(warm):
        # Another owner's job of another rank and seed, training its text encoders with
        # gradient checkpointing; then another of alice's; then the job.
        other = await fleet.bob.submit(
            lora_rank=8,
            seed=3,
            max_train_steps=2,
            train_text_encoder=True,
            gradient_checkpointing=True,
        )
        await fleet.bob.wait_state(other.job_id, SUCCEEDED)
        second = await fleet.alice.submit(seed=5, max_train_steps=2, use_dora=True)
        await fleet.alice.wait_state(second.job_id, SUCCEEDED)
        # Then bob's job of the job's adapter shape (another seed): the job re-initialises its
        # adapters in place.
        same_shape = await fleet.bob.submit(**{**JOB_A, "seed": 22})
        await fleet.bob.wait_state(same_shape.job_id, SUCCEEDED)
        async with asyncio.timeout(WAIT_S):
            await warm.wait_until(lambda a: a.state is State.IDLE and not a.busy)
        parked = resident_adapters(warm, same_shape)
        assert parked
        again = await fleet.alice.submit(**JOB_A)
        warm_done = await fleet.alice.wait_state(again.job_id, SUCCEEDED)
        async with asyncio.timeout(WAIT_S):
            await warm.wait_until(lambda a: a.state is State.IDLE and not a.busy)
        assert resident_adapters(warm, again) == parked  # the same modules
        runner = warm.recent_leases[-1]
        assert isinstance(runner, LeaseRunner) and runner.job_id == again.job_id
        timings = runner.first_step_timings()
        assert warm.resident.loads == 1  # four leases, one load
        announced = warm.warm_state()
        assert announced.resident == spec_from_proto(again.spec).resident_key
        assert list(announced.compiled_shapes) == []  # nothing compiled: short jobs run eager
        # Parked: the job's adapters on the UNet, and the DoRA job's kept aside (the encoders
        # hold only bob's rank-8 ones, of no other shape announced).
        assert list(announced.adapter_shapes) == [
            spec_from_proto(again.spec).adapter_shape_key,
            spec_from_proto(second.spec).adapter_shape_key,
        ]

    assert warm_done.result.sha256 == cold_done.result.sha256
    # The lease timed its way from the grant to its first step, phase by phase: the phases
    # lie within it, and its first step ended after the ledger recorded the grant.
    phases = timings["setup_s"]
    assert isinstance(phases, dict)
    assert {"download_inputs", "load_model", "adapters", "precompute", "first_step"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    total = timings["grant_to_first_step_s"]
    assert isinstance(total, float) and sum(phases.values()) <= total + 1e-3
    granted = next(
        e.at.ToDatetime(tzinfo=UTC).timestamp()
        for e in await fleet.alice.events(again.job_id)
        if e.kind == pb.JOB_EVENT_KIND_LEASE_GRANTED
    )
    done_at = timings["first_step_done_at"]
    # The grant is recorded before it is sent: the worker's part is the later part (one clock).
    assert isinstance(done_at, float) and done_at - granted >= total - 0.01
    # The runs said on their timelines why they did not compile.
    notices = [e.message for e in await fleet.alice.events(again.job_id) if e.message]
    assert any("compile_model auto: eager" in n and "prior" in n for n in notices), notices
