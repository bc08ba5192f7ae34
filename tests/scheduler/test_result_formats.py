"""Output_format: a job that asks for both formats stores two result files, each
at its own per-epoch key, write-once, bound to the lease, verified before the ledger records
it; both are listed by GetJobArtifacts and survive the sweep of a finished job's storage."""

from __future__ import annotations

import hashlib

import aiohttp
import grpc
import pytest

from lorafleet.core.model import result_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.artifacts import kohya_blob, lora_blob
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


async def _put(url: str, data: bytes) -> int:
    async with aiohttp.ClientSession() as http, http.put(url, data=data) as response:
        return response.status


async def _get(url: str) -> bytes:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.read()


def _file(key: str, data: bytes) -> pb.JobResult:
    return pb.JobResult(key=key, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


async def test_both_formats_are_stored_fenced_recorded_and_listed(fleet: Fleet) -> None:
    job = await fleet.alice.submit(output_format=pb.OUTPUT_FORMAT_BOTH)
    assert job.spec.output_format == pb.OUTPUT_FORMAT_BOTH
    store = fleet.scheduler.storage
    diffusers, kohya = lora_blob(1), kohya_blob(2)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        urls = granted.urls
        assert urls.result_upload.key == result_key(job.job_id, 1)
        assert urls.kohya_result_upload.key == result_key(job.job_id, 1, "kohya")
        assert urls.kohya_result_upload.key.endswith("/e1/pytorch_lora_weights_kohya.safetensors")
        assert await _put(urls.result_upload.url, diffusers) in (200, 201, 204)
        assert await _put(urls.kohya_result_upload.url, kohya) in (200, 201, 204)
        # Write-once: the kohya key cannot be replaced through its own URL.
        assert await _put(urls.kohya_result_upload.url, b"other") == 412
        ref = worker.ref(granted.lease)
        main = _file(urls.result_upload.key, diffusers)
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=ref,
                key=main.key,
                size_bytes=main.size_bytes,
                sha256=main.sha256,
                step=100,
                kohya=_file(urls.kohya_result_upload.key, kohya),
            )
        )
        done = await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    assert done.result.sha256 == main.sha256
    assert done.result.kohya.key == urls.kohya_result_upload.key
    assert done.result.kohya.sha256 == hashlib.sha256(kohya).hexdigest()
    # The lease ended: its kohya URL no longer writes.
    assert await _put(urls.kohya_result_upload.url, b"late") in (403, 412)
    artifacts = await fleet.alice.stub.GetJobArtifacts(
        pb.GetJobArtifactsRequest(job_id=job.job_id), metadata=fleet.alice.metadata
    )
    assert set(artifacts.results_by_format) == {"diffusers", "kohya"}
    assert await _get(artifacts.result.url) == diffusers
    assert await _get(artifacts.results_by_format["diffusers"].url) == diffusers
    assert await _get(artifacts.results_by_format["kohya"].url) == kohya
    # The sweep of a finished job (keys from the ledger) keeps both recorded files and deletes
    # what no announcement recorded.
    stray = f"jobs/{job.job_id}/result/e1/stray.safetensors"
    await store.put_bytes(stray, b"x")
    recorded = await fleet.scheduler.ledger.get_job_any_owner(job.job_id)
    assert recorded is not None and recorded.result is not None
    keys = {f.key for f in recorded.result.files.values()}
    await fleet.scheduler.sweeper.sweep_job_storage(job.job_id, keys)
    assert await store.get_bytes(main.key) == diffusers
    assert await store.get_bytes(done.result.kohya.key) == kohya
    assert [o.key for o in await store.list(f"jobs/{job.job_id}/result/")] == sorted(
        [main.key, done.result.kohya.key]
    )


async def test_kohya_only_job_stores_its_kohya_file_as_the_result(fleet: Fleet) -> None:
    job = await fleet.alice.submit(output_format=pb.OUTPUT_FORMAT_KOHYA)
    kohya = kohya_blob(2)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        assert granted.urls.result_upload.key == result_key(job.job_id, 1, "kohya")
        assert not granted.urls.HasField("kohya_result_upload")
        await _put(granted.urls.result_upload.url, kohya)
        main = _file(granted.urls.result_upload.key, kohya)
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=worker.ref(granted.lease),
                key=main.key,
                size_bytes=main.size_bytes,
                sha256=main.sha256,
                step=100,
            )
        )
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    artifacts = await fleet.alice.stub.GetJobArtifacts(
        pb.GetJobArtifactsRequest(job_id=job.job_id), metadata=fleet.alice.metadata
    )
    assert set(artifacts.results_by_format) == {"kohya"}
    assert await _get(artifacts.result.url) == kohya


@pytest.mark.parametrize(
    ("output_format", "with_kohya", "field"),
    [
        # A diffusers job's holder cannot announce (or have recorded) a second file.
        (pb.OUTPUT_FORMAT_DIFFUSERS, True, "job_succeeded.kohya"),
        # A job that asked for both cannot succeed without its kohya file.
        (pb.OUTPUT_FORMAT_BOTH, False, "job_succeeded.kohya"),
    ],
)
async def test_a_success_without_the_files_its_format_asks_for_is_refused(
    fleet: Fleet, output_format: int, with_kohya: bool, field: str
) -> None:
    job = await fleet.alice.submit(output_format=output_format)
    data = lora_blob()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await _put(granted.urls.result_upload.url, data)
        main = _file(granted.urls.result_upload.key, data)
        kohya = _file(result_key(job.job_id, 1, "kohya"), data) if with_kohya else None
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=worker.ref(granted.lease),
                key=main.key,
                size_bytes=main.size_bytes,
                sha256=main.sha256,
                step=100,
                kohya=kohya,
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.expect("welcome")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (refused.value.details() or "")
    assert (await fleet.alice.get(job.job_id)).state != pb.JOB_STATE_SUCCEEDED


async def test_a_kohya_file_announced_unlike_what_is_stored_is_refused(fleet: Fleet) -> None:
    job = await fleet.alice.submit(output_format=pb.OUTPUT_FORMAT_BOTH)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        urls = granted.urls
        await _put(urls.result_upload.url, lora_blob(1))
        await _put(urls.kohya_result_upload.url, kohya_blob(2))
        main = _file(urls.result_upload.key, lora_blob(1))
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=worker.ref(granted.lease),
                key=main.key,
                size_bytes=main.size_bytes,
                sha256=main.sha256,
                step=100,
                kohya=_file(urls.kohya_result_upload.key, b"forged"),
            )
        )
        rejected = await worker.expect("rejected")
        assert "does not match" in rejected.reason
    current = await fleet.alice.get(job.job_id)
    assert current.state != pb.JOB_STATE_SUCCEEDED and not current.HasField("result")


async def test_result_urls_asked_for_at_the_end_write_the_leases_result_keys(fleet: Fleet) -> None:
    """A worker asks for its result URLs right before the upload (ARTIFACT_KIND_RESULT): fresh,
    at this epoch's keys for each of output_format's files, write-once; no other index."""
    job = await fleet.alice.submit(output_format=pb.OUTPUT_FORMAT_BOTH)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        ref = worker.ref(granted.lease)
        slots = [fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_RESULT, index=i) for i in (0, 1)]
        await worker.send(urls_requested=fpb.UrlsRequested(lease=ref, slots=slots))
        main, kohya = (await worker.expect("urls_renewed")).urls.uploads
        assert main.key == result_key(job.job_id, 1)
        assert kohya.key == result_key(job.job_id, 1, "kohya")
        assert await _put(main.url, b"diffusers lora") in (200, 201, 204)
        assert await _put(main.url, b"other") == 412
        beyond = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_RESULT, index=2)
        await worker.send(urls_requested=fpb.UrlsRequested(lease=ref, slots=[beyond]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.expect("welcome")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "urls_requested.slots[0].index" in (refused.value.details() or "")
