"""One job shape (`JobSpec.shape`, docs/DESIGN.md "Job shape"): every figure the fleet keys by
shape uses its key, so jobs that differ in what decides a step's time (gradient checkpointing,
the model family, ...) never share a pace, an estimate or a prior."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from lorafleet.core.model import shape_prior_seconds
from lorafleet.core.spec import JobSpec
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker, local_identity

# A folder on the workers: no memory estimate, and any family may name it.
LOCAL_MODEL = "/models/base"


@pytest.fixture
def scheduler_overrides() -> dict[str, object]:
    return {"price_per_gpu_hour": 3.6}


async def measured(fleet: Fleet, seconds_per_step: float, **spec: Any) -> None:
    """Three provider-verified machines finish one job of `spec` each, every lease taking
    `seconds_per_step` per step on the ledger's clock from grant to its verified result."""
    steps = 40
    for machine in ("m1", "m2", "m3"):
        job = await fleet.alice.submit(max_train_steps=steps, **spec)
        identity = local_identity(fleet.scheduler.identity_secret, machine)
        async with connect_worker(fleet.channel, fleet.token, machine, identity=identity) as w:
            granted = await w.ready_for_lease()
            assert granted.lease.job_id == job.job_id
            await w.store_result(granted, steps)
            await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        conn = await asyncpg.connect(fleet.scheduler.database_url)
        try:
            await conn.execute(
                "UPDATE leases SET granted_at = ended_at - make_interval(secs => $2)"
                " WHERE job_id = $1::uuid",
                job.job_id,
                seconds_per_step * steps,
            )
        finally:
            await conn.close()


async def estimate(fleet: Fleet, **spec: Any) -> pb.EstimateJobResponse:
    response: pb.EstimateJobResponse = await fleet.alice.stub.EstimateJob(
        pb.EstimateJobRequest(
            spec=pb.JobSpec(**{**fleet.alice.defaults, "max_train_steps": 100, **spec})
        ),
        metadata=fleet.alice.metadata,
        timeout=30,
    )
    return response


async def test_specs_differing_only_in_gradient_checkpointing_or_family_have_their_own_pace(
    fleet: Fleet,
) -> None:
    """Three verified machines measured SDXL jobs without gradient checkpointing at 0.5 s a
    step. The same spec with checkpointing (a slower step), or naming the flux family, has no
    measured pace: before, resolution, batch, accumulation and text-encoder training alone
    keyed the figure, and both borrowed SDXL's 0.5 s."""
    await measured(fleet, 0.5, base_model=LOCAL_MODEL)
    same = await estimate(fleet, base_model=LOCAL_MODEL)
    assert same.samples == 3 and same.seconds_per_step == pytest.approx(0.5)
    checkpointed = await estimate(fleet, base_model=LOCAL_MODEL, gradient_checkpointing=True)
    assert checkpointed.samples == 0 and checkpointed.seconds_per_step == 0
    flux = await estimate(fleet, base_model=LOCAL_MODEL, model_family=pb.MODEL_FAMILY_FLUX)
    assert flux.samples == 0 and flux.seconds_per_step == 0


def spec(**fields: Any) -> JobSpec:
    values: dict[str, Any] = dict(instance_prompt="x", instance_data_prefix="d/")
    return JobSpec(**values, max_train_steps=1, base_model=LOCAL_MODEL, **fields)


def test_priors_know_the_family_and_gradient_checkpointing() -> None:
    """With nothing measured a shape is priced at the prior: a flux step, and a step with
    gradient checkpointing, are slower than an SDXL step of the same pixels; an SDXL spec of
    the defaults is priced as before families (1.5 s per 1024x1024 image)."""
    sdxl = shape_prior_seconds(1.5, spec().shape)
    assert sdxl == pytest.approx(1.5)
    assert shape_prior_seconds(1.5, spec(model_family="flux").shape) > 2 * sdxl
    assert shape_prior_seconds(1.5, spec(model_family="flux2").shape) > sdxl
    assert shape_prior_seconds(1.5, spec(gradient_checkpointing=True).shape) > 1.4 * sdxl
    assert shape_prior_seconds(1.5, spec(resolution=512).shape) == pytest.approx(sdxl / 4)
