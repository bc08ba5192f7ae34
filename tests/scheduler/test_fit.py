"""What a node can hold (docs/DESIGN.md): a job's memory need (its min_vram_mb or its family's
estimate, the larger) and its family decide which nodes may be granted it; a job that no node
of the fleet can hold is refused at submit, naming the field that would make it fit; an
out-of-memory on a granted job is the scheduler's mistake, not the node's."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from lorafleet.core.fit import vram_need_mb
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
# FLUX.1-dev as the QLoRA recipe trains it: ~11 GiB by the estimate.
FLUX_QLORA: dict[str, Any] = dict(
    base_model=FLUX_DEV,
    base_quantization=pb.BASE_QUANTIZATION_NF4,
    gradient_checkpointing=True,
    mixed_precision=pb.MIXED_PRECISION_BF16,
)


def need_mb(**spec: Any) -> int:
    values = dict(instance_prompt="x", instance_data_prefix="d/", max_train_steps=1) | spec
    return vram_need_mb(JobSpec(**values))


async def test_a_job_no_node_of_the_fleet_can_hold_is_refused_naming_the_field(
    fleet: Fleet,
) -> None:
    """FLUX.1-dev in bf16 without checkpointing needs ~41 GiB; the fleet's largest node class
    is the default 24 GiB. No node is connected (a fleet at zero): the refusal comes from the
    configured class, and names base_quantization with what nf4 would need."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(base_model=FLUX_DEV, mixed_precision=pb.MIXED_PRECISION_BF16)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("spec.base_quantization:"), details
    assert "~41 GiB" in details and "base_quantization nf4" in details, details
    assert "LORAFLEET_FLEET_MAX_VRAM_MB" in details, details
    # What it says fits is accepted, and a min_vram_mb beyond every node is named as such.
    assert (await fleet.alice.submit(**FLUX_QLORA)).state == pb.JOB_STATE_QUEUED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(min_vram_mb=40_000)
    assert (err.value.details() or "").startswith("spec.min_vram_mb:")


@pytest.mark.parametrize("scheduler_overrides", [{"fleet_max_vram_mb": 0}])
async def test_no_fleet_size_no_refusal(fleet: Fleet) -> None:
    """0 turns the check off: such a job waits for a node that can hold it."""
    job = await fleet.alice.submit(base_model=FLUX_DEV)
    assert job.state == pb.JOB_STATE_QUEUED


async def test_a_job_too_big_for_a_small_node_goes_to_a_big_one(fleet: Fleet) -> None:
    """The estimate (~11 GiB) is the job's need though its spec asks for no memory: a 10 GiB
    node that is idle first is passed over, a 24 GiB one is granted it."""
    need = need_mb(base_model=FLUX_DEV, base_quantization="nf4", gradient_checkpointing=True,
                   mixed_precision="bf16")  # fmt: skip
    assert 10_240 < need <= 24_576
    job = await fleet.alice.submit(**FLUX_QLORA)
    async with (
        connect_worker(fleet.channel, fleet.token, "small", vram_mb=10_240) as small,
        connect_worker(fleet.channel, fleet.token, "big", vram_mb=24_576) as big,
    ):
        await small.send(ready=fpb.Ready())
        granted = await big.ready_for_lease()
        assert granted.lease.job_id == job.job_id
    assert not [m for m in small.received if m.WhichOneof("message") == "lease_granted"]


async def test_a_worker_that_does_not_serve_a_family_never_gets_its_jobs(fleet: Fleet) -> None:
    """The flux job is older, but a worker serving sdxl only (or from before families: it names
    none) is given the sdxl job behind it; one serving flux gets the flux job."""
    flux = await fleet.alice.submit(**FLUX_QLORA)
    sdxl = await fleet.alice.submit()
    older_sdxl = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "sdxl-only", families=["sdxl"]) as w:
        assert (await w.ready_for_lease()).lease.job_id == sdxl.job_id
    async with connect_worker(fleet.channel, fleet.token, "old-worker", families=[]) as w:
        assert (await w.ready_for_lease()).lease.job_id == older_sdxl.job_id
    async with connect_worker(
        fleet.channel, fleet.token, "flux-node", families=["flux", "a-newer-family"]
    ) as w:
        assert (await w.ready_for_lease()).lease.job_id == flux.job_id
