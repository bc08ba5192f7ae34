"""What a node can hold (docs/DESIGN.md): a job's memory need (its min_vram_mb or its family's
estimate, the larger) and its family decide which nodes may be granted it; a job that no node
of the fleet can hold is refused at submit, naming the field that would make it fit; an
out-of-memory on a granted job is the scheduler's mistake, not the node's."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import grpc
import pytest

from lorafleet.core.fit import vram_need_mb
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
KLEIN_4B = "black-forest-labs/FLUX.2-klein-4B"
# A folder on the workers: no estimate, so any node may take it (the default SDXL hub id in
# fp32 needs ~22 GiB).
LOCAL_MODEL = "/models/sdxl"
# FLUX.1-dev as the QLoRA recipe trains it: ~17.0 GiB by the estimate (15.4 GiB measured on an
# H100, docs/BENCHMARKS.md "Model families on a GPU").
FLUX_QLORA: dict[str, Any] = dict(
    base_model=FLUX_DEV,
    base_quantization=pb.BASE_QUANTIZATION_NF4,
    gradient_checkpointing=True,
    mixed_precision=pb.MIXED_PRECISION_BF16,
)


def need_mb(**spec: Any) -> int:
    values: dict[str, Any] = dict(instance_prompt="x", instance_data_prefix="d/")
    return vram_need_mb(JobSpec(**values, max_train_steps=1, **spec))


async def test_a_job_no_node_of_the_fleet_can_hold_is_refused_naming_the_field(
    fleet: Fleet,
) -> None:
    """FLUX.1-dev in bf16 without checkpointing needs ~63 GiB; the fleet's largest node class
    is the default 24 GiB. No node is connected (a fleet at zero): the refusal comes from the
    configured class. Neither checkpointing (~32.9 GiB) nor nf4 (~47 GiB) is enough alone: it
    names the first of the two, with what both need. FLUX.2 [klein] 4B in bf16 needs only
    checkpointing, which changes no bit of the LoRA: named before nf4, which would fit too."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(base_model=FLUX_DEV, mixed_precision=pb.MIXED_PRECISION_BF16)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("spec.gradient_checkpointing:"), details
    assert "~63.0 GiB" in details and "24.0 GiB" in details, details
    assert "with gradient_checkpointing on, base_quantization nf4 ~17.0 GiB" in details, details
    assert "LORAFLEET_FLEET_MAX_VRAM_MB" in details, details
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(base_model=KLEIN_4B, mixed_precision=pb.MIXED_PRECISION_BF16)
    details = err.value.details() or ""
    assert details.startswith("spec.gradient_checkpointing:"), details
    assert "gradient_checkpointing on needs ~16.4 GiB" in details, details
    # What it says fits is accepted, and a min_vram_mb beyond every node is named as such.
    assert (await fleet.alice.submit(**FLUX_QLORA)).state == pb.JOB_STATE_QUEUED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(min_vram_mb=40_000)
    assert (err.value.details() or "").startswith("spec.min_vram_mb:")


async def test_an_estimate_refuses_what_submit_refuses_for_this_fleet(fleet: Fleet) -> None:
    """EstimateJob runs SubmitJob's checks (its proto says so): before, `lorafleet submit
    --estimate` priced a job no node of the fleet could hold, which submit then refused."""

    async def estimate(**spec: Any) -> pb.EstimateJobResponse:
        request = pb.EstimateJobRequest(spec=pb.JobSpec(**{**fleet.alice.defaults, **spec}))
        response: pb.EstimateJobResponse = await fleet.alice.stub.EstimateJob(
            request, metadata=fleet.alice.metadata, timeout=30
        )
        return response

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await estimate(base_model=KLEIN_4B, mixed_precision=pb.MIXED_PRECISION_BF16)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("spec.gradient_checkpointing:"), err.value
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await estimate(base_model="./my-model")
    assert (err.value.details() or "").startswith("spec.base_model:"), err.value
    await estimate(**FLUX_QLORA)  # what fits is estimated


@pytest.mark.parametrize("scheduler_overrides", [{"fleet_max_vram_mb": 0}])
async def test_no_fleet_size_no_refusal(fleet: Fleet) -> None:
    """0 turns the check off: such a job waits for a node that can hold it."""
    job = await fleet.alice.submit(base_model=FLUX_DEV)
    assert job.state == pb.JOB_STATE_QUEUED


async def test_a_job_too_big_for_a_small_node_goes_to_a_big_one(fleet: Fleet) -> None:
    """The estimate (~17 GiB) is the job's need though its spec asks for no memory: a 10 GiB
    node that is idle first is passed over, a 24 GiB one is granted it."""
    need = need_mb(
        base_model=FLUX_DEV,
        base_quantization="nf4",
        gradient_checkpointing=True,
        mixed_precision="bf16",
    )
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


async def test_out_of_memory_on_a_granted_job_moves_it_to_larger_nodes(
    fleet: Fleet, database_url: str
) -> None:
    """A 20 GiB node runs out of memory on a job the estimate said fits (INTERNAL): the job
    counts no failure and no node fault, the node is not banned from it (nor is its lease an
    empty one toward quarantine), and the job now needs more than 20 GiB: the node is given
    the next job instead, and a 24 GiB node gets this one."""
    job = await fleet.alice.submit(**FLUX_QLORA, max_failures=1)
    async with connect_worker(fleet.channel, fleet.token, "mid", vram_mb=20_480) as mid:
        granted = await mid.ready_for_lease()
        assert granted.lease.job_id == job.job_id
        await mid.send(
            job_failed=fpb.JobFailed(
                lease=mid.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_INTERNAL,
                message="out of memory: CUDA out of memory. Tried to allocate 2.00 GiB",
            )
        )
        queued = await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
        assert queued.failures == 0
        other = await fleet.alice.submit(base_model=LOCAL_MODEL)
        # Not the re-queued job (re-queued jobs go first): it no longer fits this node.
        assert (await mid.ready_for_lease()).lease.job_id == other.job_id
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT min_vram_mb, node_faults, failures,"
            " (SELECT count(*) FROM bans b WHERE b.job_id = j.job_id) AS bans,"
            " (SELECT array_agg(end_reason) FROM leases l WHERE l.job_id = j.job_id) AS ends"
            " FROM jobs j WHERE job_id = $1",
            uuid.UUID(job.job_id),
        )
    finally:
        await conn.close()
    assert row is not None
    assert row["min_vram_mb"] == 20_481 and row["bans"] == 0, dict(row)
    assert row["failures"] == 0 and row["node_faults"] == 0, dict(row)
    assert row["ends"] == ["outgrown"], dict(row)
    async with connect_worker(fleet.channel, fleet.token, "big", vram_mb=24_576) as big:
        assert (await big.ready_for_lease()).lease.job_id == job.job_id
    failed = [
        e
        for e in await fleet.alice.events(job.job_id)
        if e.kind == pb.JOB_EVENT_KIND_ATTEMPT_FAILED
    ]
    assert "more than this node's 20480 MiB" in failed[0].message


async def test_out_of_memory_on_the_largest_node_class_is_an_internal_error(
    fleet: Fleet,
) -> None:
    """On a node of the largest class there is no larger one to move to: an INTERNAL error
    like any other (that machine is not handed the job again), and the job's need is not
    raised past every node (another 24 GiB node is granted it)."""
    job = await fleet.alice.submit(**FLUX_QLORA)
    async with connect_worker(fleet.channel, fleet.token, "big", vram_mb=24_576) as big:
        granted = await big.ready_for_lease()
        await big.send(
            job_failed=fpb.JobFailed(
                lease=big.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_INTERNAL,
                message="CUDA out of memory",
            )
        )
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
        other = await fleet.alice.submit(base_model=LOCAL_MODEL)
        assert (await big.ready_for_lease()).lease.job_id == other.job_id
    async with connect_worker(fleet.channel, fleet.token, "big-2", vram_mb=24_576) as big_2:
        assert (await big_2.ready_for_lease()).lease.job_id == job.job_id


async def test_a_node_just_under_the_largest_class_strands_no_job(fleet: Fleet) -> None:
    """Cards report less memory than their class's nominal size: torch sees a 24 GB RTX 4090
    as 24_564 MiB, below fleet_max_vram_mb (24_576 by default). Before, an out of memory on a
    node just under the fleet's largest class (an honest 4090, or a hostile verified machine
    announcing 24_575 MiB to strand the jobs it is handed) raised the job's need past every
    real 4090: it waited QUEUED for ever. A node within 10% of fleet_max_vram_mb is of the
    largest class: its INTERNAL error is an error like any other, and a 4090 gets the job."""
    job = await fleet.alice.submit(**FLUX_QLORA)
    async with connect_worker(fleet.channel, fleet.token, "liar", vram_mb=24_575) as liar:
        granted = await liar.ready_for_lease()
        assert granted.lease.job_id == job.job_id
        await liar.send(
            job_failed=fpb.JobFailed(
                lease=liar.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_INTERNAL,
                message="out of memory: CUDA out of memory. Tried to allocate 2.00 GiB",
            )
        )
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    async with connect_worker(fleet.channel, fleet.token, "rtx-4090", vram_mb=24_564) as honest:
        assert (await honest.ready_for_lease()).lease.job_id == job.job_id


async def test_a_hello_naming_too_many_families_is_refused(fleet: Fleet) -> None:
    """The list is bounded (each name is matched in every claim): past 32 names the Hello is
    INVALID_ARGUMENT naming hello.families."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with connect_worker(
            fleet.channel, fleet.token, "many", families=[f"f{i}" for i in range(33)]
        ):
            pass
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.families" in (refused.value.details() or "")


async def test_a_sample_task_goes_to_a_worker_serving_its_jobs_family(fleet: Fleet) -> None:
    """A flux job's validation images run the flux pipeline: a worker serving sdxl only is not
    given its sample task, one serving flux is (claimed from the ledger itself, so that no
    dispatch round decides the order)."""
    job = await fleet.alice.submit(
        **FLUX_QLORA, max_train_steps=25, validation_prompt="a dog", validation_steps=10
    )
    ledger = fleet.scheduler.ledger
    async with connect_worker(fleet.channel, fleet.token, "trainer") as trainer:
        granted = await trainer.ready_for_lease()
        assert granted.lease.job_id == job.job_id
        await trainer.store_checkpoint(granted.lease, 10)
        await fleet.alice.wait_event(job.job_id, pb.JOB_EVENT_KIND_CHECKPOINT_COMMITTED)
        secret = bytes(32)
        passed_over = await ledger.claim_sample_task(
            "sdxl-only", 81_920, 30, secret_sha256=secret, families=["sdxl"]
        )
        assert passed_over is None
        task = await ledger.claim_sample_task(
            "flux-node", 81_920, 30, secret_sha256=secret, families=["flux"]
        )
    assert task is not None and task.job_id == job.job_id and task.step == 10


@pytest.mark.parametrize(
    "scheduler_overrides", [{"fleet_accelerator": "cpu", "fleet_max_vram_mb": 24_576}]
)
async def test_a_cpu_fleet_refuses_a_quantized_base_at_submit(fleet: Fleet) -> None:
    """`lorafleet up` without a GPU: its workers could only refuse nf4, fp16 or 8-bit AdamW once
    a node was spent on the job, so submit refuses them; and a job too big for the fleet is never
    told to quantize."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(**FLUX_QLORA)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("spec.base_quantization:"), details
    assert "CUDA" in details and "LORAFLEET_FLEET_ACCELERATOR" in details, details
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(base_model=FLUX_DEV, mixed_precision=pb.MIXED_PRECISION_BF16)
    details = err.value.details() or ""
    # FLUX.1-dev does not fit 24 GiB unquantized whatever else changes: a smaller variant.
    assert details.startswith("spec.base_model:"), details
    assert "nf4" not in details and "smaller variant" in details, details
    # Every lever already pulled: no empty "with :" clause (an outside attack saw one).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.submit(
            base_model=FLUX_DEV,
            mixed_precision=pb.MIXED_PRECISION_BF16,
            gradient_checkpointing=True,
            resolution=512,
        )
    details = err.value.details() or ""
    assert details.startswith("spec.base_model:"), details
    assert "no option of the job lowers it" in details and "with :" not in details, details
    # What else only a CUDA GPU does is refused at submit too, not a lease later.
    for spec, field in (
        (dict(mixed_precision=pb.MIXED_PRECISION_FP16), "mixed_precision"),
        (dict(use_8bit_adam=True), "use_8bit_adam"),
        (dict(optimizer=pb.OPTIMIZER_ADAMW_8BIT), "optimizer"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fleet.alice.submit(base_model=LOCAL_MODEL, **spec)
        details = err.value.details() or ""
        assert details.startswith(f"spec.{field}:") and "CUDA" in details, details
