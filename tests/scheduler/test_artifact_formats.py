"""A holder that stores something else than a checkpoint or a LoRA file (with the right checksum)
gets it refused: the scheduler reads the object's safetensors header (ranged reads) before the
ledger records it. Scripted hostile workers over real gRPC, a real scheduler and its local store
(the S3 path of the same reads: tests/storage/test_formats.py)."""

from __future__ import annotations

from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.artifacts import CHECKPOINT_TENSORS, checkpoint_blob, safetensors_bytes
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


async def test_checkpoints_and_results_not_in_their_format_are_refused(fleet: Fleet) -> None:
    for _ in range(3):
        await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "holder") as holder:
        granted = await holder.ready_for_lease()
        await holder.store_checkpoint(granted.lease, 10)
        # Bytes with a correct sha256 that are no checkpoint: refused, nothing recorded.
        await holder.store_checkpoint(granted.lease, 20, b"garbage with a correct sha256")
        rejected = await holder.expect("rejected")
        assert "not a lorafleet checkpoint" in rejected.reason
        assert (await fleet.alice.get(granted.lease.job_id)).latest_checkpoint.step == 10
    # Back on its lease (still live in the ledger): a well-formed checkpoint whose tensors
    # differ from the job's earlier verified one is refused too.
    reshaped = {**CHECKPOINT_TENSORS, "lora.unet.down.weight": ("F32", (8, 8))}
    async with connect_worker(
        fleet.channel, fleet.token, "holder", held=holder.ref(granted.lease)
    ) as holder:
        assert holder.welcome is not None and holder.welcome.HasField("resumed_lease")
        await holder.expect("urls_renewed")  # the resumed lease's URL set
        await holder.store_checkpoint(granted.lease, 30, checkpoint_blob(30, reshaped))
        rejected = await holder.expect("rejected")
        assert "shape" in rejected.reason
        assert (await fleet.alice.get(granted.lease.job_id)).latest_checkpoint.step == 10

    async with connect_worker(fleet.channel, fleet.token, "faker") as faker:
        faked = await faker.ready_for_lease()
        await faker.store_result(faked, 100, safetensors_bytes({"model.w": ("F32", (2,))}))
        rejected = await faker.expect("rejected")
        assert "not a LoRA file" in rejected.reason
        job = await fleet.alice.get(faked.lease.job_id)
        assert job.state == pb.JOB_STATE_RUNNING and not job.HasField("result")

    # An honest holder's checkpoint and LoRA file are recorded.
    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        mine = await honest.ready_for_lease()
        await honest.store_checkpoint(mine.lease, 10)
        await honest.store_result(mine, 100)
        await fleet.alice.wait_for(mine.lease.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
