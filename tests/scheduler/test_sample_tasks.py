"""Sample tasks on the worker stream, driven by scripted workers over real gRPC:
queued by the ledger when a checkpoint commits and when the result is stored, granted only to a
worker with no training job to claim, fenced to the stream they were granted on, failing
without touching their job, and giving way to training."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import pytest

from lorafleet.core.model import FailureClass, sample_image_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.auth import create_api_key
from tests.scheduler.test_ledger import in_good_standing
from tests.scheduler.test_webhooks import LOOPBACK_ALLOWED, Receiver, receiver  # noqa: F401
from tests.support.fleet import Fleet
from tests.support.jobs import WAIT_S, JobClient
from tests.support.workers import ScriptedWorker, connect_worker, http_put

VALIDATION: dict[str, Any] = dict(
    validation_prompt="a photo of sks dog",
    validation_prompts=["sks dog on the beach"],
    validation_negative_prompt="blurry",
    validation_steps=10,
    validation_inference_steps=2,
    num_validation_images=2,
)


async def _put_status(url: str, data: bytes) -> int:
    async with aiohttp.ClientSession() as http, http.put(url, data=data) as response:
        return response.status


def png(task: fpb.SampleTaskGranted, upload: fpb.SampleUpload) -> bytes:
    return f"png {task.task_id} {upload.prompt_index} {upload.image_index}".encode()


async def store_samples(
    worker: ScriptedWorker,
    task: fpb.SampleTaskGranted,
    before_announcing: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """PUTs the task's images, then announces them (SamplesStored), which ends the task's
    lease; `before_announcing` runs in between, while its URLs still work."""
    images = []
    for upload in task.uploads:
        data = png(task, upload)
        await http_put(upload.url, data)
        images.append(
            fpb.StoredImage(
                prompt_index=upload.prompt_index,
                image_index=upload.image_index,
                key=upload.key,
                size_bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    if before_announcing is not None:
        await before_announcing()
    await worker.send(samples_stored=fpb.SamplesStored(lease=worker.ref(task.lease), images=images))


async def settled(worker: ScriptedWorker, task: fpb.SampleTaskGranted) -> None:
    """A heartbeat for the finished task is refused: its reply orders everything this stream
    sent before it (the scheduler handles a stream's messages in order)."""
    await worker.heartbeat(task.lease, 0)
    rejected = await worker.expect("rejected")
    assert rejected.lease.lease_id == task.lease.lease_id


async def artifacts(fleet: Fleet, job_id: str) -> pb.GetJobArtifactsResponse:
    response: pb.GetJobArtifactsResponse = await fleet.alice.stub.GetJobArtifacts(
        pb.GetJobArtifactsRequest(job_id=job_id), metadata=fleet.alice.metadata, timeout=WAIT_S
    )
    return response


async def test_each_validation_window_samples_its_first_checkpoint(fleet: Fleet) -> None:
    """An interval that does not divide validation_steps (as `checkpointing_steps: auto` picks
    from the node's pace): the first checkpoint at or after each multiple of 10 gets images,
    the rest of its window none. Before, only steps that were multiples of 10 did: none here."""
    job = await fleet.alice.submit(max_train_steps=40, **VALIDATION)
    async with (
        connect_worker(fleet.channel, fleet.token, "trainer") as trainer,
        connect_worker(fleet.channel, fleet.token, "sampler") as sampler,
    ):
        granted = await trainer.ready_for_lease()
        for step in (7, 14, 18, 21, 28):
            await trainer.store_checkpoint(granted.lease, step)
        await trainer.store_result(granted, 40)
        steps = []
        for _ in range(3):
            await sampler.send(ready=fpb.Ready())
            task = await sampler.expect("sample_task_granted")
            steps.append(task.step)
            await store_samples(sampler, task)
        assert steps == [14, 21, 40]
        await settled(sampler, task)
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        events = await fleet.alice.events(job.job_id)
        assert [e.step for e in events if e.kind == pb.JOB_EVENT_KIND_SAMPLES] == [14, 21, 40]


async def test_checkpoint_and_result_queue_sample_tasks_made_by_an_idle_worker(
    fleet: Fleet,
) -> None:
    job = await fleet.alice.submit(max_train_steps=25, **VALIDATION)
    async with (
        connect_worker(fleet.channel, fleet.token, "trainer") as trainer,
        connect_worker(fleet.channel, fleet.token, "sampler") as sampler,
    ):
        granted = await trainer.ready_for_lease()
        await sampler.send(ready=fpb.Ready())
        await trainer.store_checkpoint(granted.lease, 10)
        task = await sampler.expect("sample_task_granted")
        assert task.lease.job_id == job.job_id and task.step == 10 and task.lease.epoch == 1
        assert task.weights_is_checkpoint and task.weights.key.endswith("/checkpoints/10-e1")
        assert list(task.settings.prompts) == ["a photo of sks dog", "sks dog on the beach"]
        assert task.settings.negative_prompt == "blurry"
        assert task.settings.images_per_prompt == 2 and task.settings.inference_steps == 2
        assert task.spec.base_model == granted.spec.base_model
        assert [u.key for u in task.uploads] == [
            sample_image_key(job.job_id, 10, task.task_id, 1, p, i)
            for p in range(2)
            for i in range(2)
        ]
        # Training never waits for it: the training lease goes on meanwhile.
        await trainer.store_checkpoint(granted.lease, 20)
        await store_samples(sampler, task)
        await sampler.send(ready=fpb.Ready())
        second = await sampler.expect("sample_task_granted")
        assert second.step == 20

        async def put_again() -> None:
            # Stored images are write-once. (Checked while the task's lease is live: once the
            # images are announced it ends, and its URLs are refused outright, 403.)
            assert await _put_status(second.uploads[0].url, b"again") == 412

        await store_samples(sampler, second, before_announcing=put_again)
        await trainer.store_result(granted, 25)
        await sampler.send(ready=fpb.Ready())
        final = await sampler.expect("sample_task_granted")
        assert final.step == 25 and not final.weights_is_checkpoint
        await store_samples(sampler, final)
        await settled(sampler, final)
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        events = await fleet.alice.events(job.job_id)
        assert [e.step for e in events if e.kind == pb.JOB_EVENT_KIND_SAMPLES] == [10, 20, 25]
    listed = await artifacts(fleet, job.job_id)
    assert [(s.step, s.prompt_index, s.image_index) for s in listed.samples] == [
        (step, p, i) for step in (10, 20, 25) for p in range(2) for i in range(2)
    ]
    assert listed.samples[2].prompt == "sks dog on the beach"
    async with aiohttp.ClientSession() as http, http.get(listed.samples[0].url.url) as got:
        assert got.status == 200 and (await got.read()).startswith(b"png ")


async def test_training_goes_first_and_a_sample_task_gives_way(fleet: Fleet) -> None:
    job = await fleet.alice.submit(max_train_steps=25, **VALIDATION)
    async with connect_worker(fleet.channel, fleet.token, "m1") as m1:
        granted = await m1.ready_for_lease()
        await m1.store_checkpoint(granted.lease, 10)
        await m1.store_result(granted, 25)
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        # Two sample tasks and one training job queued: the training job is granted first.
        other = await fleet.alice.submit(max_train_steps=30)
        training = await m1.ready_for_lease()
        assert training.lease.job_id == other.job_id
        await m1.store_result(training, 30)
        await m1.send(ready=fpb.Ready())
        task = await m1.expect("sample_task_granted")
        assert task.step == 10
        # A training job queued while m1 samples: the task gives way at once.
        third = await fleet.alice.submit(max_train_steps=30)
        revoked = await m1.expect("lease_revoked")
        assert revoked.lease.lease_id == task.lease.lease_id
        # Its upload URLs died with its lease.
        assert await _put_status(task.uploads[0].url, b"late") == 403
        training = await m1.ready_for_lease()
        assert training.lease.job_id == third.job_id
        # The task went back to the queue with no failure counted, its images not made.
        tasks = await fleet.scheduler.ledger.sample_tasks_of_job(job.job_id)
        assert [(t.step, t.state, t.epoch) for t in tasks] == [
            (10, "QUEUED", 1),
            (25, "QUEUED", 0),
        ]
        assert all(t.failures == 0 and t.error is None for t in tasks)


async def test_sample_task_failures_are_the_tasks_alone_and_fenced(fleet: Fleet) -> None:
    job = await fleet.alice.submit(max_train_steps=25, **VALIDATION)
    ledger = fleet.scheduler.ledger
    async with connect_worker(fleet.channel, fleet.token, "m1") as m1:
        granted = await m1.ready_for_lease()
        async with connect_worker(fleet.channel, fleet.token, "m2") as m2:
            await m2.send(ready=fpb.Ready())
            await m1.store_checkpoint(granted.lease, 10)
            task = await m2.expect("sample_task_granted")
            # Another stream cannot speak for m2's task.
            await m1.send(
                samples_stored=fpb.SamplesStored(
                    lease=m1.ref(task.lease),
                    images=[
                        fpb.StoredImage(key=task.uploads[0].key, size_bytes=1, sha256="a" * 64)
                    ],
                )
            )
            rejected = await m1.expect("rejected")
            assert rejected.lease.lease_id == task.lease.lease_id
            # Nor can the holder announce keys other than its task's.
            stray = fpb.StoredImage(key=f"jobs/{job.job_id}/x.png", size_bytes=1, sha256="a" * 64)
            await m2.send(
                samples_stored=fpb.SamplesStored(lease=m2.ref(task.lease), images=[stray])
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await m2.expect("rejected")
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        # m2 reports a node fault as its own last word (the ledger statement its JobFailed
        # runs): banned from the task, the task re-queued, the job untouched.
        failed = await ledger.fail_sample_task(
            task.lease.lease_id, task.lease.epoch, FailureClass.NODE, "CUDA error: out of memory"
        )
        assert failed is not None and failed.state == "QUEUED" and failed.failures == 1
        assert (await fleet.alice.get(job.job_id)).state == pb.JOB_STATE_RUNNING
        async with connect_worker(fleet.channel, fleet.token, "m2") as m2:
            await m2.send(ready=fpb.Ready())  # banned from the task: nothing for it
            async with connect_worker(fleet.channel, fleet.token, "m3") as m3:
                await in_good_standing(fleet.scheduler.database_url, "m3")
                await m3.send(ready=fpb.Ready())
                again = await m3.expect("sample_task_granted")
                assert again.task_id == task.task_id and again.lease.epoch == 2
                # The INPUT failure of a holder in good standing for the job (verified, a
                # result of its own 6 h before the job) fails the task for good, never the job.
                await m3.send(
                    job_failed=fpb.JobFailed(
                        lease=m3.ref(again.lease),
                        failure_class=pb.FAILURE_CLASS_INPUT,
                        message="weights unreadable",
                    )
                )
                await m1.store_result(granted, 25)
                result_task = await m2.expect("sample_task_granted")
                assert result_task.step == 25
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    events = await fleet.alice.events(job.job_id)
    failed_events = [e for e in events if e.kind == pb.JOB_EVENT_KIND_SAMPLES_FAILED]
    assert [(e.step, e.message) for e in failed_events] == [(10, "weights unreadable")]
    assert not [e for e in events if e.kind == pb.JOB_EVENT_KIND_ATTEMPT_FAILED]


async def test_a_fresh_machines_input_fault_fails_no_sample_task_for_good(fleet: Fleet) -> None:
    """One machine with no standing for the job (here unverified; a fresh verified one alike)
    calling a sample task's input bad is a failure like a node fault: banned from the task,
    which is re-queued for another machine. Before, its word alone failed the task for good:
    one stranger's machine could leave every job it sampled without validation images."""
    job = await fleet.alice.submit(max_train_steps=25, **VALIDATION)
    ledger = fleet.scheduler.ledger
    async with connect_worker(fleet.channel, fleet.token, "m1") as m1:
        granted = await m1.ready_for_lease()
        async with connect_worker(fleet.channel, fleet.token, "liar") as liar:
            await liar.send(ready=fpb.Ready())
            await m1.store_checkpoint(granted.lease, 10)
            task = await liar.expect("sample_task_granted")
        failed = await ledger.fail_sample_task(
            task.lease.lease_id, task.lease.epoch, FailureClass.INPUT, "weights unreadable"
        )
        assert failed is not None and (failed.state, failed.failures) == ("QUEUED", 1)
        async with connect_worker(fleet.channel, fleet.token, "liar") as liar:
            await liar.send(ready=fpb.Ready())  # banned from the task: nothing for it
            async with connect_worker(fleet.channel, fleet.token, "m2") as m2:
                await m2.send(ready=fpb.Ready())
                again = await m2.expect("sample_task_granted")
                assert again.task_id == task.task_id and again.lease.epoch == 2
    assert (await fleet.alice.get(job.job_id)).state == pb.JOB_STATE_RUNNING


@pytest.mark.parametrize("scheduler_overrides", [LOOPBACK_ALLOWED])
async def test_samples_webhook_and_samples_on_request(
    fleet: Fleet,
    receiver: Receiver,  # noqa: F811  (the fixture imported from test_webhooks)
) -> None:
    created = await create_api_key(
        fleet.scheduler.ledger,
        "alice",
        webhook_url=f"{receiver.url}/hook",
        webhook_events=["samples"],
    )
    client = JobClient(fleet.alice.stub, created.key)
    # validation_steps 0: images of the result only.
    job = await client.submit(max_train_steps=25, **{**VALIDATION, "validation_steps": 0})
    async with (
        connect_worker(fleet.channel, fleet.token, "trainer") as trainer,
        connect_worker(fleet.channel, fleet.token, "sampler") as sampler,
    ):
        granted = await trainer.ready_for_lease()
        await trainer.store_checkpoint(granted.lease, 10)
        await trainer.store_result(granted, 25)
        await sampler.send(ready=fpb.Ready())
        task = await sampler.expect("sample_task_granted")
        assert task.step == 25 and not task.weights_is_checkpoint
        await store_samples(sampler, task)
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        ((_, _, body),) = receiver.requests
        payload = json.loads(body)
        assert payload["event"] == "job.samples" and payload["step"] == 25
        assert payload["message"] == "4 validation images stored"
        # On request: new prompts against the result, with the job's other settings.
        response = await client.stub.RequestSamples(
            pb.RequestSamplesRequest(
                job_id=job.job_id, prompts=["sks dog as a statue"], steps=[25], num_images=1
            ),
            metadata=client.metadata,
            timeout=WAIT_S,
        )
        assert list(response.steps) == [25]
        await sampler.send(ready=fpb.Ready())
        again = await sampler.expect("sample_task_granted")
        assert list(again.settings.prompts) == ["sks dog as a statue"]
        assert again.settings.images_per_prompt == 1 and again.settings.inference_steps == 2
        await store_samples(sampler, again)
        await settled(sampler, again)
        # A step with no kept checkpoint or result: nothing is queued.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.stub.RequestSamples(
                pb.RequestSamplesRequest(job_id=job.job_id, steps=[25, 7]),
                metadata=client.metadata,
                timeout=WAIT_S,
            )
        assert raised.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        # Another owner's job is not found.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await fleet.bob.stub.RequestSamples(
                pb.RequestSamplesRequest(job_id=job.job_id), metadata=fleet.bob.metadata
            )
        assert raised.value.code() is grpc.StatusCode.NOT_FOUND
    listed = await artifacts(fleet, job.job_id)
    assert [(s.step, s.prompt) for s in listed.samples][-1] == (25, "sks dog as a statue")
    assert len(listed.samples) == 5
