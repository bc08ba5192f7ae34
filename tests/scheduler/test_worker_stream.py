"""The worker stream contract (docs/DESIGN.md, "The job and its lease") driven by scripted
workers over real gRPC."""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid

import aiohttp
import grpc
import pytest

from lorafleet.core.model import Job, checkpoint_key, result_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.signing import UrlSigner
from tests.scheduler.test_ledger import in_good_standing
from tests.support.artifacts import checkpoint_blob, lora_blob
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker, local_identity

SHA = "a" * 64


async def _put(url: str, data: bytes) -> None:
    async with aiohttp.ClientSession() as http, http.put(url, data=data) as response:
        assert response.status in (200, 201, 204), await response.text()


async def _get(url: str) -> bytes:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.read()


async def test_grant_carries_spec_urls_and_heartbeat_extends(fleet: Fleet) -> None:
    job = await fleet.alice.submit(learning_rate=2e-4, labels={"batch": "x"})
    assert job.state == pb.JOB_STATE_QUEUED
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        assert worker.welcome is not None and worker.welcome.lease_ttl_s == 30.0
        granted = await worker.ready_for_lease()
        assert granted.lease.job_id == job.job_id and granted.lease.epoch == 1
        assert granted.spec.learning_rate == pytest.approx(2e-4)
        assert granted.spec.resolution == 1024  # defaults are explicit on the wire
        assert [f.name for f in granted.urls.instance_files] == ["1.png"]
        assert await _get(granted.urls.instance_files[0].url) == b"png"
        assert granted.urls.result_upload.key == result_key(job.job_id, 1)
        before = await fleet.scheduler.ledger.get_job_any_owner(job.job_id)
        await worker.heartbeat(granted.lease, 7, loss=0.25, seconds_per_step=0.5)
        # The next message round-trip orders the heartbeat before our read.
        await worker.send(
            urls_requested=fpb.UrlsRequested(
                lease=worker.ref(granted.lease),
                slots=[fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=10)],
            )
        )
        await worker.expect("urls_renewed")
        after = await fleet.scheduler.ledger.get_job_any_owner(job.job_id)
        assert before is not None and after is not None
        assert after.progress.step == 7 and after.progress.loss == pytest.approx(0.25)
        current = await fleet.alice.get(job.job_id)
        assert current.state == pb.JOB_STATE_RUNNING and current.machine_id == "m1"
        assert current.progress.eta_seconds == pytest.approx((100 - 7) * 0.5)
        kinds = [e.kind for e in await fleet.alice.events(job.job_id)]
        assert kinds == [
            pb.JOB_EVENT_KIND_SUBMITTED,
            pb.JOB_EVENT_KIND_LEASE_GRANTED,
            pb.JOB_EVENT_KIND_HEARTBEAT,
        ]


async def test_checkpoints_retention_and_success(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    store = fleet.scheduler.storage
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        ref = worker.ref(granted.lease)
        for step in (10, 20, 30):
            await worker.send(
                urls_requested=fpb.UrlsRequested(
                    lease=ref, slots=[fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=step)]
                )
            )
            renewed = await worker.expect("urls_renewed")
            (upload,) = renewed.urls.uploads
            assert upload.key == checkpoint_key(job.job_id, step, 1)
            data = checkpoint_blob(step)
            await _put(upload.url, data)
            await worker.send(
                checkpoint_committed=fpb.CheckpointCommitted(
                    lease=ref,
                    step=step,
                    key=upload.key,
                    size_bytes=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                )
            )
        # Retention (K=2) deletes the oldest; wait for its event rather than sleeping.
        async for response in fleet.alice.stub.WatchJob(
            pb.WatchJobRequest(job_id=job.job_id), metadata=fleet.alice.metadata, timeout=15
        ):
            if response.event.kind == pb.JOB_EVENT_KIND_CHECKPOINT_DELETED:
                assert response.event.step == 10
                break
        keys = sorted(o.key for o in await store.list(f"jobs/{job.job_id}/checkpoints/"))
        assert keys == [checkpoint_key(job.job_id, s, 1) for s in (20, 30)]
        current = await fleet.alice.get(job.job_id)
        assert current.latest_checkpoint.step == 30

        lora = lora_blob()
        await _put(granted.urls.result_upload.url, lora)
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=ref,
                key=granted.urls.result_upload.key,
                size_bytes=len(lora),
                sha256=hashlib.sha256(lora).hexdigest(),
                step=100,
                loss=0.1,
            )
        )
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        # Finishing deletes every checkpoint (a background task and the sweeper both do it;
        # running it once more here is idempotent and makes the check deterministic).
        await fleet.scheduler.sweeper.prune_checkpoints(job.job_id)
        assert await store.list(f"jobs/{job.job_id}/checkpoints/") == []
        done = await fleet.alice.get(job.job_id)
        assert done.state == pb.JOB_STATE_SUCCEEDED
        assert done.result.sha256 == hashlib.sha256(lora).hexdigest()
        artifacts = await fleet.alice.stub.GetJobArtifacts(
            pb.GetJobArtifactsRequest(job_id=job.job_id), metadata=fleet.alice.metadata
        )
        assert await _get(artifacts.result.url) == lora


@pytest.mark.parametrize("scheduler_overrides", [{"lease_ttl_s": 2.0}])
async def test_ttl_expiry_requeues_first_and_fences_the_old_holder(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "slow") as slow:
        first = await slow.ready_for_lease()
        # No heartbeat: the sweeper expires the lease and the scheduler tells the holder.
        revoked = await slow.expect("lease_revoked")
        assert revoked.reason == fpb.REVOKE_REASON_SUPERSEDED
        newer = await fleet.alice.submit(priority=100)
        async with connect_worker(fleet.channel, fleet.token, "fast") as fast:
            second = await fast.ready_for_lease()
            # The re-queued job (it has progress) goes before a fresh higher-priority one.
            assert second.lease.job_id == job.job_id and second.lease.epoch == 2
            await slow.heartbeat(first.lease, 50)
            rejected = await slow.expect("rejected")
            assert rejected.lease.lease_id == first.lease.lease_id
            await slow.send(
                checkpoint_committed=fpb.CheckpointCommitted(
                    lease=slow.ref(first.lease),
                    step=50,
                    key=checkpoint_key(job.job_id, 50, 1),
                    size_bytes=1,
                    sha256=SHA,
                )
            )
            await slow.expect("rejected")
            await fast.heartbeat(second.lease, 3)
            await fast.send(
                draining=fpb.Draining(lease=fast.ref(second.lease), reason="spot notice")
            )
            # Drain re-queues at once (no TTL wait): the other worker is handed it.
            await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
            again = await slow.ready_for_lease()
            assert again.lease.job_id == job.job_id and again.lease.epoch == 3
        assert (await fleet.alice.get(newer.job_id)).state == pb.JOB_STATE_QUEUED
    kinds = [e.kind for e in await fleet.alice.events(job.job_id)]
    assert pb.JOB_EVENT_KIND_LEASE_EXPIRED in kinds and pb.JOB_EVENT_KIND_DRAINED in kinds
    audit = await fleet.scheduler.ledger.job_leases(job.job_id)
    assert [(lease.epoch, lease.machine_id, lease.end_reason) for lease in audit] == [
        (1, "slow", "expired"),
        (2, "fast", "drained"),
        (3, "slow", None),
    ]


async def test_node_failures_ban_and_count_apart(fleet: Fleet) -> None:
    """Node faults ban the machine and count in the job's node_faults, not its failures: a
    job is not to blame for the machines it was handed (max_failures 2 here, and two node
    faults leave it queued for a third machine)."""
    job = await fleet.alice.submit(max_failures=2)
    async with (
        connect_worker(fleet.channel, fleet.token, "a") as a,
        connect_worker(fleet.channel, fleet.token, "b") as b,
        connect_worker(fleet.channel, fleet.token, "c") as c,
    ):
        granted = await a.ready_for_lease()
        await a.send(
            job_failed=fpb.JobFailed(
                lease=a.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_NODE,
                message="CUDA error: illegal address",
            )
        )
        # Banned on a: b gets it, a gets nothing even though it is idle first.
        await a.send(ready=fpb.Ready())
        regranted = await b.ready_for_lease()
        assert regranted.lease.job_id == job.job_id and regranted.lease.epoch == 2
        await b.send(
            job_failed=fpb.JobFailed(
                lease=b.ref(regranted.lease),
                failure_class=pb.FAILURE_CLASS_NODE,
                message="CUDA out of memory",
            )
        )
        third = await c.ready_for_lease()
        assert third.lease.job_id == job.job_id and third.lease.epoch == 3
    now = await fleet.alice.get(job.job_id)
    assert (now.failures, now.node_faults, now.max_node_faults) == (0, 2, 10)
    assert [
        e.machine_id
        for e in await fleet.alice.events(job.job_id)
        if e.kind == pb.JOB_EVENT_KIND_LEASE_GRANTED
    ] == ["a", "b", "c"]


async def test_an_input_failure_fails_the_job_once_a_second_machine_confirms_it(
    fleet: Fleet,
) -> None:
    """One machine alone cannot fail a job by calling its inputs bad (workers are strangers'
    machines): its report bans it from the job and re-queues it, counting no failure; a second
    machine's input fault fails the job with no failure counted against any node. Both are
    provider-verified machines whose standing predates the job (a verified result of their own
    more than standing_min_age_s before it was submitted): fresh machines' word is a node fault
    (tests/scaler/test_colluding_machines.py)."""
    job = await fleet.alice.submit(max_failures=5)
    for machine_id in ("a", "b"):
        async with connect_worker(fleet.channel, fleet.token, machine_id) as worker:
            await in_good_standing(fleet.scheduler.database_url, machine_id)
            granted = await worker.ready_for_lease()
            await worker.send(
                job_failed=fpb.JobFailed(
                    lease=worker.ref(granted.lease),
                    failure_class=pb.FAILURE_CLASS_INPUT,
                    message=f"x.png: unreadable (on {machine_id})",
                )
            )
            # Wait for the report's effect before closing the stream: a stream cancelled
            # straight after a send may lose that message (a real worker says it again).
            if machine_id == "a":
                requeued = await fleet.alice.wait_for(
                    job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED
                )
                assert requeued.failures == 0 and not requeued.error
            else:
                failed = await fleet.alice.wait_for(
                    job.job_id, lambda j: j.state == pb.JOB_STATE_FAILED
                )
    assert failed.failures == 0 and failed.failure_class == pb.FAILURE_CLASS_INPUT
    assert failed.error == "x.png: unreadable (on b)"
    for machine_id in ("a", "b", "c"):
        assert (
            await fleet.scheduler.ledger.claim_job(machine_id, 0, 30, secret_sha256=bytes(32))
            is None
        )


async def test_an_input_fault_from_the_operators_own_machine_fails_the_job_at_once(
    fleet: Fleet,
) -> None:
    """A machine `lorafleet up` (or EC2 in the operator's account) vouches for is not a
    stranger's: its input fault fails the job at once with the worker's message, so the job
    does not sit QUEUED, banned from the only worker, while the scaler fetches a node to
    confirm what cannot succeed anywhere."""
    job = await fleet.alice.submit(max_failures=5, base_model="/no/such/model")
    message = "base_model: '/no/such/model' is not a model on this worker"
    identity = local_identity(fleet.scheduler.identity_secret, "local-0")
    async with connect_worker(fleet.channel, fleet.token, "local-0", identity=identity) as worker:
        granted = await worker.ready_for_lease()
        await worker.send(
            job_failed=fpb.JobFailed(
                lease=worker.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_INPUT,
                message=message,
            )
        )
        failed = await fleet.alice.wait_for(
            job.job_id, lambda j: j.state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_QUEUED)
        )
    assert failed.state == pb.JOB_STATE_FAILED, failed
    assert failed.failure_class == pb.FAILURE_CLASS_INPUT and failed.failures == 0
    assert failed.error == message
    assert await fleet.scheduler.ledger.count_queued(10) == 0


async def test_a_queued_job_says_why_it_waits_until_it_runs_again(fleet: Fleet) -> None:
    """Issue 32: a job whose input fault one machine reported waits QUEUED for a second
    machine's word with no error (it has not failed), and `get` showed no reason. Its
    waiting_reason says what ended its newest attempt and what it waits for; it is gone once
    a machine runs the job, and comes back with the next ending (a drain), in list as in get."""
    job = await fleet.alice.submit(max_failures=5)
    # No attempt, no machine; the need is the default model's estimate.
    no_machine = re.compile(
        r"no connected machine can run it \(qualified, serving the sdxl family, with \d+ MiB of"
        r" GPU memory, not banned from it\); waiting for one to connect"
    )
    assert no_machine.fullmatch((await fleet.alice.get(job.job_id)).waiting_reason)
    async with connect_worker(fleet.channel, fleet.token, "a") as worker:
        await in_good_standing(fleet.scheduler.database_url, "a")
        granted = await worker.ready_for_lease()
        await worker.send(
            job_failed=fpb.JobFailed(
                lease=worker.ref(granted.lease),
                failure_class=pb.FAILURE_CLASS_INPUT,
                message="x.png: unreadable",
            )
        )
        queued = await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    assert queued.error == "" and queued.failures == 0
    first, machines = queued.waiting_reason.split("; no connected", 1)
    assert first == (
        "attempt 1 failed (input fault: x.png: unreadable); waiting for a second machine to"
        " confirm it before the job fails"
    )
    assert no_machine.fullmatch("no connected" + machines)  # a is banned from it
    async with connect_worker(fleet.channel, fleet.token, "b") as worker:
        granted = await worker.ready_for_lease()
        running = await fleet.alice.get(job.job_id)
        assert running.state == pb.JOB_STATE_RUNNING and running.waiting_reason == ""
        await worker.send(draining=fpb.Draining(lease=worker.ref(granted.lease), reason="SIGTERM"))
        drained = await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    assert drained.waiting_reason == (
        "attempt 2 drained (SIGTERM); waiting for a machine to resume it"
    )
    (listed,) = await fleet.scheduler.ledger.list_jobs(
        "alice", states=[], labels={}, after=None, limit=10
    )
    # b has gone since (its session is released a moment after the stream ends): the same
    # attempt, then, once released, that no connected machine could resume it.
    assert listed.waiting_reason is not None
    assert listed.waiting_reason.startswith(drained.waiting_reason)
    canceled = await fleet.alice.cancel(job.job_id)
    assert canceled.state == pb.JOB_STATE_CANCELED
    assert (await fleet.alice.get(job.job_id)).waiting_reason == ""  # final: waits for nothing


async def test_a_relative_model_path_is_refused_at_submit_naming_the_field(fleet: Fleet) -> None:
    """A relative path is resolved on each worker against its own folder: it can never name
    what the submitter sees, so it is refused before a job exists. Absolute paths and hub ids
    are the workers' to check."""
    for field, ref in (
        ("base_model", "./no-such-model"),
        ("base_model", ".lorafleet/demo-model"),
        ("base_model", "~/models/sdxl"),
        ("base_model", "a/b/c"),
        ("vae_model", "../vae"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fleet.alice.submit(**{field: ref})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ref
        assert f"spec.{field}" in (refused.value.details() or ""), refused.value.details()
    for ref in ("/models/sdxl", "stabilityai/stable-diffusion-xl-base-1.0", "sdxl-base"):
        assert (await fleet.alice.submit(base_model=ref)).state == pb.JOB_STATE_QUEUED


async def test_cancel_is_pushed_to_the_holder(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 3)
        await worker.send(ping=fpb.Ping(nonce=1))
        await worker.expect("pong")  # answered in the stream's order: the heartbeat was handled
        canceled = await fleet.alice.cancel(job.job_id)
        assert canceled.state == pb.JOB_STATE_CANCELED
        assert canceled.progress.step == 3
        revoked = await worker.expect("lease_revoked")
        assert revoked.reason == fpb.REVOKE_REASON_CANCELED
        assert revoked.lease.lease_id == granted.lease.lease_id
        # The holder's answer says the step it reached (issue 32: a canceled job showed its
        # last heartbeat's step, 1346, though the worker had reached 1395): taken once.
        await worker.heartbeat(granted.lease, 7, loss=0.25)
        await worker.heartbeat(granted.lease, 9)
        await worker.expect("rejected")  # the second is a stale holder's, as before
    shown = await fleet.alice.get(job.job_id)
    assert shown.state == pb.JOB_STATE_CANCELED
    assert shown.progress.step == 7 and shown.progress.loss == pytest.approx(0.25)
    assert (await fleet.alice.cancel(job.job_id)).state == pb.JOB_STATE_CANCELED  # idempotent


async def test_only_the_canceled_holder_reports_its_final_step(fleet: Fleet) -> None:
    """The final step of a canceled lease is taken from the stream the lease was revoked on
    only: another stream naming the lease (lease ids are not secret), or its own stream naming
    another epoch, is refused as any stale holder is, and the job's progress stays."""
    job = await fleet.alice.submit()
    async with (
        connect_worker(fleet.channel, fleet.token, "m1") as holder,
        connect_worker(fleet.channel, fleet.token, "m2") as other,
    ):
        granted = await holder.ready_for_lease()
        await holder.heartbeat(granted.lease, 3)
        await holder.send(ping=fpb.Ping(nonce=1))
        await holder.expect("pong")  # answered in the stream's order: the heartbeat was handled
        await fleet.alice.cancel(job.job_id)
        await holder.expect("lease_revoked")
        await other.heartbeat(granted.lease, 8)
        await other.expect("rejected")
        stale = fpb.Lease(lease_id=granted.lease.lease_id, epoch=granted.lease.epoch + 1)
        await holder.heartbeat(stale, 8)
        await holder.expect("rejected")
    assert (await fleet.alice.get(job.job_id)).progress.step == 3


async def test_a_job_canceled_while_its_grant_is_signed_is_never_granted(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands between the claim and the grant (found by the two-replica test, where
    it killed the scheduler): the worker is never granted the canceled job, and its Ready is
    still answered, with the next job."""
    signing, release = asyncio.Event(), asyncio.Event()
    sign = UrlSigner.lease_urls

    async def held_first(self: UrlSigner, job: Job) -> fpb.JobUrls:
        if not signing.is_set():
            signing.set()
            await release.wait()
        return await sign(self, job)

    monkeypatch.setattr(UrlSigner, "lease_urls", held_first)
    first = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        await worker.send(ready=fpb.Ready())
        await asyncio.wait_for(signing.wait(), 10)
        await fleet.alice.cancel(first.job_id)
        # The revoke reaches the worker before any grant could: the claim is already ended.
        await worker.expect("lease_revoked")
        second = await fleet.alice.submit()
        release.set()
        granted = await worker.expect("lease_granted")
    assert granted.lease.job_id == second.job_id
    assert [m for m in worker.received if m.WhichOneof("message") == "lease_granted"] == [
        worker.received[-1]
    ]
    assert (await fleet.alice.get(first.job_id)).state == pb.JOB_STATE_CANCELED


async def test_reconnect_within_ttl_keeps_the_lease(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
    # The stream dropped; the lease is still the job's.
    held = fpb.LeaseRef(lease_id=granted.lease.lease_id, epoch=granted.lease.epoch)
    async with connect_worker(fleet.channel, fleet.token, "m1", held=held) as back:
        assert back.welcome is not None
        assert back.welcome.resumed_lease.lease_id == granted.lease.lease_id
        renewed = await back.expect("urls_renewed")
        assert renewed.urls.instance_files[0].name == "1.png"
        await back.heartbeat(granted.lease, 12)
        await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 12)
    # Another machine cannot take over a lease by naming it.
    async with connect_worker(fleet.channel, fleet.token, "thief", held=held) as thief:
        assert thief.welcome is not None and not thief.welcome.resumed_lease.lease_id


async def test_worker_auth_and_hello_are_checked(fleet: Fleet) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        async with connect_worker(fleet.channel, "wrong", "m1"):
            pass
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        async with connect_worker(fleet.channel, fleet.token, "bad id with spaces"):
            pass
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.machine_id" in (bad.value.details() or "")


async def test_unqualified_worker_gets_no_work(fleet: Fleet) -> None:
    await fleet.alice.submit()
    async with (
        connect_worker(fleet.channel, fleet.token, "broken", qualified=False) as broken,
        connect_worker(fleet.channel, fleet.token, "good") as good,
    ):
        await broken.send(ready=fpb.Ready())
        await good.ready_for_lease()


# A fleet that runs 80 GB nodes: a job asking for 40 GB is one it can hold (core/fit.py).
@pytest.mark.parametrize("scheduler_overrides", [{"fleet_max_vram_mb": 81_920}])
async def test_vram_requirement(fleet: Fleet) -> None:
    job = await fleet.alice.submit(min_vram_mb=40_000)
    async with (
        connect_worker(fleet.channel, fleet.token, "small", vram_mb=24_000) as small,
        connect_worker(fleet.channel, fleet.token, "big", vram_mb=80_000) as big,
    ):
        await small.send(ready=fpb.Ready())
        granted = await big.ready_for_lease()
        assert granted.lease.job_id == job.job_id


async def test_owners_are_isolated(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    for call in (fleet.bob.get, fleet.bob.cancel, fleet.bob.events):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(job.job_id)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await fleet.bob.stub.ListJobs(pb.ListJobsRequest(), metadata=fleet.bob.metadata)
    assert list(listed.jobs) == []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in fleet.bob.stub.WatchJob(
            pb.WatchJobRequest(job_id=job.job_id), metadata=fleet.bob.metadata, timeout=10
        ):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fleet.alice.stub.GetJob(pb.GetJobRequest(job_id=str(uuid.uuid4())), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_watch_streams_progress_until_final(fleet: Fleet) -> None:
    job = await fleet.alice.submit(max_train_steps=10)
    stream = fleet.alice.stub.WatchJob(
        pb.WatchJobRequest(job_id=job.job_id), metadata=fleet.alice.metadata, timeout=20
    )
    first = await stream.read()
    assert first.job.state == pb.JOB_STATE_QUEUED and not first.HasField("event")
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 5, loss=0.5, seconds_per_step=2.0)
        lora = lora_blob()
        await _put(granted.urls.result_upload.url, lora)
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=worker.ref(granted.lease),
                key=granted.urls.result_upload.key,
                size_bytes=len(lora),
                sha256=hashlib.sha256(lora).hexdigest(),
                step=10,
            )
        )
        seen = []
        while (response := await stream.read()) is not grpc.aio.EOF:
            seen.append(response.event.kind)
            last = response
        assert seen[-1] == pb.JOB_EVENT_KIND_SUCCEEDED
        assert pb.JOB_EVENT_KIND_HEARTBEAT in seen
        assert last.job.state == pb.JOB_STATE_SUCCEEDED


async def test_list_jobs_filters_and_pages(fleet: Fleet) -> None:
    ids = [
        (await fleet.alice.submit(labels={"batch": "b1" if i % 2 else "b2"})).job_id
        for i in range(5)
    ]
    pages, token = [], ""
    while True:
        response = await fleet.alice.stub.ListJobs(
            pb.ListJobsRequest(page_size=2, page_token=token, labels={"batch": "b2"}),
            metadata=fleet.alice.metadata,
        )
        pages.append([j.job_id for j in response.jobs])
        token = response.next_page_token
        if not token:
            break
    assert [len(p) for p in pages] == [2, 1]
    assert sorted(j for page in pages for j in page) == sorted(ids[0::2])
    queued = await fleet.alice.stub.ListJobs(
        pb.ListJobsRequest(states=[pb.JOB_STATE_RUNNING]), metadata=fleet.alice.metadata
    )
    assert list(queued.jobs) == []


async def test_scheduler_stop_ends_streams_without_telling_workers_to_stop(fleet: Fleet) -> None:
    """A replica restart must not drain the fleet: workers reconnect and keep their leases."""
    await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await fleet.scheduler.close()
        rest = []
        while (message := await worker.call.read()) is not grpc.aio.EOF:
            rest.append(message.WhichOneof("message"))
        assert "shutdown" not in rest
    ledger = await Ledger.connect(fleet.scheduler.database_url, min_size=1, max_size=1)
    try:
        job = await ledger.get_job_any_owner(granted.lease.job_id)
    finally:
        await ledger.close()
    assert job is not None and job.lease_id == granted.lease.lease_id  # still its lease


async def test_a_holders_notice_goes_on_the_timeline_and_a_strangers_does_not(
    fleet: Fleet,
) -> None:
    job = await fleet.alice.submit()
    async with (
        connect_worker(fleet.channel, fleet.token, "m1") as holder,
        connect_worker(fleet.channel, fleet.token, "m2") as stranger,
    ):
        granted = await holder.ready_for_lease()
        ref = holder.ref(granted.lease)
        await stranger.send(notice=fpb.Notice(lease=ref, message="forged"))
        await holder.send(
            notice=fpb.Notice(lease=ref, message="checkpoint at step 10 could not be stored")
        )
        await holder.heartbeat(granted.lease, 11)
        await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 11)
    notices = [
        e.message
        for e in await fleet.alice.events(job.job_id)
        if e.kind == pb.JOB_EVENT_KIND_NOTICE
    ]
    assert notices == ["checkpoint at step 10 could not be stored"]


async def test_a_resumed_job_is_granted_from_its_checkpoint_and_forgets_deleted_ones(
    fleet: Fleet,
) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as first:
        granted = await first.ready_for_lease()
        await first.store_checkpoint(granted.lease, 10)
        await first.heartbeat(granted.lease, 17)
        await first.send(draining=fpb.Draining(lease=first.ref(granted.lease), reason="stop"))
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    async with connect_worker(fleet.channel, fleet.token, "m2") as second:
        again = await second.ready_for_lease()
        grants = [
            e
            for e in await fleet.alice.events(job.job_id)
            if e.kind == pb.JOB_EVENT_KIND_LEASE_GRANTED
        ]
        # The second lease starts from the checkpoint (10), not the first holder's last step.
        assert [g.step for g in grants] == [0, 10]
        await fleet.alice.cancel(job.job_id)
        await second.expect("lease_revoked")
        assert again.lease.epoch == 2
    # Cancel deletes the job's checkpoints; the job no longer shows one.
    await fleet.scheduler.sweeper.prune_checkpoints(job.job_id)
    assert not (await fleet.alice.get(job.job_id)).HasField("latest_checkpoint")


async def test_a_drained_job_shows_the_step_of_its_last_checkpoint(fleet: Fleet) -> None:
    """Walking the README: Ctrl-C on `lorafleet up` drained a job with a checkpoint at step 240,
    and the re-queued job showed step 191, its last heartbeat's. A checkpoint says the step its
    holder reached."""
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.heartbeat(granted.lease, 3)
        await worker.store_checkpoint(granted.lease, 10)
        await worker.send(draining=fpb.Draining(lease=worker.ref(granted.lease), reason="SIGINT"))
        drained = await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    assert drained.latest_checkpoint.step == 10
    assert drained.progress.step == 10


async def test_a_finished_jobs_unrecorded_objects_are_swept_from_storage(fleet: Fleet) -> None:
    """A lease that ends between an upload and its announcement leaves an object the ledger
    never recorded; retention deletes only recorded ones, so the finished job's sweep does."""
    job = await fleet.alice.submit()
    store = fleet.scheduler.storage
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        ref = worker.ref(granted.lease)
        slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=30)
        await worker.send(urls_requested=fpb.UrlsRequested(lease=ref, slots=[slot]))
        (upload,) = (await worker.expect("urls_renewed")).urls.uploads
        await _put(upload.url, b"stored, never announced")
        await worker.store_checkpoint(granted.lease, 10)
        await worker.store_result(granted, 40, lora_blob(7))
        done = await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    await fleet.scheduler.sweeper.sweep_once()
    left = [o.key for o in await store.list(f"jobs/{job.job_id}/")]
    assert left == [done.result.key]
    assert await store.get_bytes(done.result.key) == lora_blob(7)
