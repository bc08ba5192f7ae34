"""Workers are strangers' machines: a hostile worker holding the worker token can touch only the
lease it holds (docs/DESIGN.md, "Trust"). Each test is an attack found by an audit from outside,
scripted over a real stream against a real scheduler and Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import asyncpg
import grpc
import pytest

from lorafleet.core.model import upload_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.server import Scheduler
from lorafleet.scheduler.sessions import WorkerSession
from tests.support.artifacts import lora_blob
from tests.support.fleet import WORKER_TOKEN, Fleet, scheduler_config
from tests.support.jobs import WAIT_S, JobClient
from tests.support.workers import (
    LEASE_SECRETS,
    SESSION_TOKENS,
    ScriptedWorker,
    connect_worker,
    http_put,
)

CHECKPOINT_SLOT = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=1)


async def _lease_row(database_url: str, job_id: str) -> asyncpg.Record:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT state, lease_id, lease_expires_at, progress_step, failures,"
            " (SELECT count(*) FROM bans b WHERE b.job_id = j.job_id) AS bans"
            " FROM jobs j WHERE job_id = $1",
            uuid.UUID(job_id),
        )
    finally:
        await conn.close()
    assert row is not None
    return row


async def test_forged_messages_on_another_workers_lease_are_refused(
    fleet: Fleet, database_url: str
) -> None:
    job = await fleet.alice.submit()
    async with (
        connect_worker(fleet.channel, fleet.token, "victim") as victim,
        connect_worker(fleet.channel, fleet.token, "mallory") as mallory,
    ):
        granted = await victim.ready_for_lease()
        await victim.heartbeat(granted.lease, 7)
        await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 7)
        before = await _lease_row(database_url, job.job_id)
        ref = victim.ref(granted.lease)  # lease ids are not secret: owners see them in events
        await mallory.send(heartbeat=fpb.Heartbeat(lease=ref, step=99))
        assert (await mallory.expect("rejected")).lease.lease_id == ref.lease_id
        await mallory.send(draining=fpb.Draining(lease=ref, reason="forged"))
        await mallory.expect("rejected")
        for failure_class in (pb.FAILURE_CLASS_NODE, pb.FAILURE_CLASS_INPUT):
            await mallory.send(
                job_failed=fpb.JobFailed(lease=ref, failure_class=failure_class, message="forged")
            )
            await mallory.expect("rejected")
        after = await _lease_row(database_url, job.job_id)
        assert after["state"] == "RUNNING" and str(after["lease_id"]) == ref.lease_id
        assert after["progress_step"] == 7 and after["failures"] == 0 and after["bans"] == 0
        assert after["lease_expires_at"] == before["lease_expires_at"], "not extended"
        # The real holder is untouched and goes on.
        await victim.heartbeat(granted.lease, 8)
    # Once the streams have ended every message sent has taken effect. (Waited for inside, the
    # watch could miss it: a heartbeat within half an interval of the last one makes no
    # timeline event, so nothing woke the watch if it had read the job just before.)
    await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 8)


async def test_a_machine_id_cannot_be_taken_over_while_its_stream_lives(fleet: Fleet) -> None:
    await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "victim") as victim:
        granted = await victim.ready_for_lease()
        ref = victim.ref(granted.lease)
        for attempt in ({}, {"held": ref}, {"held": ref, "held_secret": "guess"}):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async with connect_worker(
                    fleet.channel, fleet.token, "victim", session_token="", **attempt
                ):
                    pass
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "hello.machine_id" in (refused.value.details() or "")
        # The victim's stream was neither closed nor robbed of its lease.
        await victim.heartbeat(granted.lease, 3)
        await victim.send(
            urls_requested=fpb.UrlsRequested(
                lease=ref, slots=[fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=3)]
            )
        )
        assert (await victim.expect("urls_renewed")).lease.lease_id == ref.lease_id


async def test_resuming_a_lease_takes_the_secret_only_its_grant_carried(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        assert len(granted.lease_secret) >= 32
    held = worker.ref(granted.lease)
    # The same machine (its session token), but not the lease's secret: no resume.
    async with connect_worker(
        fleet.channel, fleet.token, "m1", held=held, held_secret="not-the-secret"
    ) as wrong:
        assert wrong.welcome is not None and not wrong.welcome.resumed_lease.lease_id
    async with connect_worker(fleet.channel, fleet.token, "m1", held=held) as back:
        assert back.welcome is not None
        assert back.welcome.resumed_lease.lease_id == granted.lease.lease_id
        await back.heartbeat(granted.lease, 4)
        await fleet.alice.wait_for(job.job_id, lambda j: j.progress.step == 4)
    # The secret is never shown to the job's owner.
    events = await fleet.alice.events(job.job_id)
    assert all(granted.lease_secret not in str(e) for e in events)
    assert granted.lease_secret not in str(await fleet.alice.get(job.job_id))


async def test_a_heartbeat_after_expiry_does_not_revive_an_unswept_lease(
    fleet: Fleet, database_url: str
) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        conn = await asyncpg.connect(database_url)
        try:
            # Lapsed, and no sweep has run yet (the sweeper would re-queue it).
            await conn.execute(
                "UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = $1",
                uuid.UUID(job.job_id),
            )
        finally:
            await conn.close()
        await worker.heartbeat(granted.lease, 5)
        await worker.expect("rejected")
    row = await _lease_row(database_url, job.job_id)
    assert row["progress_step"] == 0


def _resuming_hello(machine_id: str, held: fpb.LeaseRef) -> fpb.ConnectRequest:
    """What the machine's real worker says when it reconnects holding `held`."""
    return fpb.ConnectRequest(
        hello=fpb.Hello(
            machine_id=machine_id,
            qualification=fpb.Qualification(passed=True),
            held_lease=held,
            held_lease_secret=LEASE_SECRETS[held.lease_id],
            session_token=SESSION_TOKENS[machine_id],
        )
    )


async def _final_status(
    channel: grpc.aio.Channel,
    requests: list[fpb.ConnectRequest],
    *,
    read_after: asyncio.Event | None = None,
) -> grpc.aio.AioRpcError:
    """Sends `requests` on one stream and returns how the scheduler ended it. The replies are
    read as they come, or, with `read_after`, only once that event is set."""

    async def produce() -> AsyncIterator[fpb.ConnectRequest]:
        for request in requests:
            yield request
        await asyncio.Event().wait()  # keep the stream open: the scheduler must end it

    call = fgrpc.WorkerServiceStub(channel).Connect(
        produce(), metadata=(("authorization", f"Bearer {WORKER_TOKEN}"),)
    )
    async with asyncio.timeout(WAIT_S):
        if read_after is not None:
            await read_after.wait()
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass
        code = await call.code()
        return grpc.aio.AioRpcError(code, None, None, details=await call.details())


@pytest.mark.parametrize(
    "scheduler_overrides", [{"worker_outbox_limit": 4, "worker_message_burst": 1000}]
)
async def test_a_worker_that_does_not_read_is_disconnected(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as reader:
        granted = await reader.ready_for_lease()
    held = reader.ref(granted.lease)
    # Big replies (64 URLs each) fill the transport's window (64 KiB without BDP probing);
    # then the outbox fills, and the scheduler gives up on the stream.
    slots = [fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=i) for i in range(1, 65)]
    hello = _resuming_hello("m1", held)
    # Enough to fill the window and the outbox, no more: a client still writing when the
    # scheduler ends the stream sees gRPC's own INTERNAL instead of the scheduler's status.
    asks = [fpb.ConnectRequest(urls_requested=fpb.UrlsRequested(lease=held, slots=slots))] * 24
    sessions = fleet.scheduler.sessions
    gave_up = asyncio.Event()
    close_session = sessions.close_session

    def close_and_tell(session: WorkerSession) -> None:
        close_session(session)
        if session.overflowed:
            gave_up.set()

    monkeypatch.setattr(sessions, "close_session", close_and_tell)
    address = f"127.0.0.1:{fleet.scheduler.port}"
    async with grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as deaf:
        # Not a single reply read until the scheduler has given up on the stream.
        ended = await _final_status(deaf, [hello, *asks], read_after=gave_up)
    assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "unread" in (ended.details() or "")
    assert "m1" not in fleet.scheduler.sessions.by_machine
    # Others are still served.
    async with connect_worker(fleet.channel, fleet.token, "m2") as other:
        await other.send(heartbeat=fpb.Heartbeat())
        await fleet.alice.submit()
        await other.ready_for_lease()


@pytest.mark.parametrize(
    "scheduler_overrides",
    # A slow refill (one message per 2 s): a busy machine processing the flood slowly still
    # sees it cut off within the 40.
    [{"worker_messages_per_s": 0.5, "worker_message_burst": 20, "heartbeat_interval_s": 30.0}],
)
async def test_a_message_flood_is_cut_off_and_the_timeline_stays_small(
    fleet: Fleet, database_url: str
) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
    held = worker.ref(granted.lease)
    hello = _resuming_hello("m1", held)
    # Twice the burst: the 21st is cut off (more would still be in flight when it ends).
    beats = [
        fpb.ConnectRequest(heartbeat=fpb.Heartbeat(lease=held, step=step)) for step in range(1, 41)
    ]
    ended = await _final_status(fleet.channel, [hello, *beats])
    assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "messages per second" in (ended.details() or "")
    conn = await asyncpg.connect(database_url)
    try:
        heartbeats = await conn.fetchval(
            "SELECT count(*) FROM job_events WHERE job_id = $1 AND kind = 'HEARTBEAT'",
            uuid.UUID(job.job_id),
        )
    finally:
        await conn.close()
    # 20 heartbeats were accepted within far less than half an interval (15 s): one row.
    assert heartbeats == 1, "at most one timeline row per half heartbeat interval"


async def test_notice_floods_are_logged_within_a_bound(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        for i in range(60):
            await worker.send(notice=fpb.Notice(message=f"spam {i} " + "x" * 5_000))
        await worker.send(heartbeat=fpb.Heartbeat())
        # The stream answers in order: a reply to a later message means every notice was read.
        await worker.send(
            urls_requested=fpb.UrlsRequested(
                lease=fpb.LeaseRef(lease_id="x", epoch=1),
                slots=[fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=1)],
            )
        )
        await worker.expect("rejected")
    logged = capsys.readouterr().err.count("worker notice")
    assert 1 <= logged <= 6


@pytest.mark.parametrize(
    ("qualification", "field", "vram_mb"),
    [
        (fpb.Qualification(passed=True, detail="x" * 3_000_000), "hello.qualification.detail", 0),
        (
            fpb.Qualification(passed=True, versions={f"p{i}": "1" for i in range(2_000)}),
            "hello.qualification.versions",
            0,
        ),
        # More memory than any card has: it would make the machine eligible for every job.
        (fpb.Qualification(passed=True), "hello.vram_mb", 2**62),
    ],
)
async def test_oversized_hello_fields_are_refused(
    fleet: Fleet, qualification: fpb.Qualification, field: str, vram_mb: int
) -> None:
    call = (
        __import__("lorafleet.fleet.v1.fleet_pb2_grpc", fromlist=["x"])
        .WorkerServiceStub(fleet.channel)
        .Connect(metadata=(("authorization", f"Bearer {fleet.token}"),))
    )
    worker = ScriptedWorker(machine_id="big", call=call)
    await worker.send(
        hello=fpb.Hello(machine_id="big", qualification=qualification, vram_mb=vram_mb)
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await worker.expect("welcome")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (refused.value.details() or "")


@pytest.mark.parametrize(
    ("lease_ttl_s", "sweep_interval_s", "outage_s"),
    [
        (5.0, 0.2, 120),
        # An outage longer than the TTL but shorter than three sweep intervals: the replicas'
        # silence alone (three sweeps) did not count it as one, and every lease expired.
        (6.0, 5.0, 10),
    ],
)
async def test_leases_survive_an_outage_of_every_scheduler_longer_than_the_ttl(
    database_url: str,
    tmp_path: Path,
    lease_ttl_s: float,
    sweep_interval_s: float,
    outage_s: int,
) -> None:
    config = scheduler_config(
        database_url,
        tmp_path / "data",
        lease_ttl_s=lease_ttl_s,
        sweep_interval_s=sweep_interval_s,
    )
    async with (
        Scheduler(config) as first,
        grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel,
    ):
        await first.storage.put_bytes(upload_key("alice", "dogs/rex", "1.png"), b"png")
        key = (await create_api_key(first.ledger, "alice")).key
        job = await JobClient(pbgrpc.JobServiceStub(channel), key).submit()
        async with connect_worker(channel, WORKER_TOKEN, "m1") as worker:
            granted = await worker.ready_for_lease()
    # Every replica was down for longer than the TTL: the lease lapsed meanwhile.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE jobs SET lease_expires_at = now() - make_interval(secs => $1::float8)",
            outage_s - lease_ttl_s,
        )
        for table in ("scheduler_replicas", "machines"):
            await conn.execute(
                f"UPDATE {table} SET last_seen_at = now() - make_interval(secs => $1::float8)",
                outage_s,
            )
    finally:
        await conn.close()
    held = worker.ref(granted.lease)
    async with Scheduler(config) as second:
        await second.sweeper.sweep_once()  # what the first sweep at start does
        async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            # A stranger first, claiming the machine id: its silence was the scheduler's.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async with connect_worker(channel, WORKER_TOKEN, "m1", session_token=""):
                    pass
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
            async with connect_worker(channel, WORKER_TOKEN, "m1", held=held) as back:
                assert back.welcome is not None
                assert back.welcome.resumed_lease.lease_id == granted.lease.lease_id
    row = await _lease_row(database_url, job.job_id)
    assert row["state"] == "RUNNING" and str(row["lease_id"]) == granted.lease.lease_id


async def test_the_ledger_records_only_what_the_store_holds(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        ref = worker.ref(granted.lease)
        slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=10)
        await worker.send(urls_requested=fpb.UrlsRequested(lease=ref, slots=[slot]))
        (upload,) = (await worker.expect("urls_renewed")).urls.uploads
        await http_put(upload.url, b"what was stored")
        # Announced with another digest than the stored bytes have: refused, nothing recorded.
        await worker.send(
            checkpoint_committed=fpb.CheckpointCommitted(
                lease=ref, step=10, key=upload.key, size_bytes=15, sha256="b" * 64
            )
        )
        rejected = await worker.expect("rejected")
        assert "does not match" in rejected.reason
        assert not (await fleet.alice.get(job.job_id)).HasField("latest_checkpoint")


async def test_upload_urls_die_with_their_lease_and_stored_bytes_are_write_once(
    fleet: Fleet,
) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.store_checkpoint(granted.lease, 10)
        await fleet.alice.wait_for(job.job_id, lambda j: j.latest_checkpoint.step == 10)
        ref = worker.ref(granted.lease)
        slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=10)
        await worker.send(urls_requested=fpb.UrlsRequested(lease=ref, slots=[slot]))
        (again,) = (await worker.expect("urls_renewed")).urls.uploads
        # A committed checkpoint cannot be replaced, even through a fresh URL of its lease.
        async with aiohttp.ClientSession() as http, http.put(again.url, data=b"other") as r:
            assert r.status == 412
        later = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=30)
        await worker.send(urls_requested=fpb.UrlsRequested(lease=ref, slots=[later]))
        (unused,) = (await worker.expect("urls_renewed")).urls.uploads
        await worker.store_result(granted, 20, lora_blob(7))
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    # The lease ended: its result URL no longer works, and the result is as it was stored.
    async with aiohttp.ClientSession() as http:
        async with http.put(granted.urls.result_upload.url, data=b"forged") as r:
            assert r.status in (403, 412)
        result_key = granted.urls.result_upload.key
    assert await fleet.scheduler.storage.get_bytes(result_key) == lora_blob(7)
    # Nor does a URL of the ended lease that was never used, though it has not expired.
    async with aiohttp.ClientSession() as http, http.put(unused.url, data=b"late") as r:
        assert r.status == 403 and "has ended" in await r.text()


@pytest.mark.parametrize(
    ("slot", "field"),
    [
        (fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=101), "slots[0].step"),
        (fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=0), "slots[0].step"),
        (
            fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_VALIDATION_IMAGE, step=5, index=0),
            "slots[0].kind",
        ),
        (fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CLASS_IMAGE, index=0), "slots[0].kind"),
    ],
)
async def test_a_holder_gets_urls_only_for_keys_its_job_can_produce(
    fleet: Fleet, slot: fpb.UploadSlot, field: str
) -> None:
    """Steps past max_train_steps (100 here), a checkpoint at step 0, validation images (sample
    tasks store those), class images of a job without prior preservation: refused, naming the field,
    so a holder cannot fill its job's prefix with keys of its choosing."""
    await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.send(
            urls_requested=fpb.UrlsRequested(lease=worker.ref(granted.lease), slots=[slot])
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.expect("urls_renewed")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"urls_requested.{field}" in (refused.value.details() or "")


async def test_a_stream_holds_one_lease_and_cannot_hoard_jobs(
    fleet: Fleet, database_url: str
) -> None:
    """Saying Ready while leased ends that lease in the ledger at once (the job re-queued, the
    machine banned from it); a machine whose stream reconnected without resuming its lease gets
    no second one while the first is live. One stream never holds two jobs."""
    first_job = await fleet.alice.submit()
    second_job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "hoarder") as hoarder:
        first = await hoarder.ready_for_lease()
        second = await hoarder.ready_for_lease()
    assert first.lease.job_id == first_job.job_id and second.lease.job_id == second_job.job_id
    row = await _lease_row(database_url, first_job.job_id)
    assert row["state"] == "QUEUED" and row["failures"] == 0 and row["bans"] == 1
    # Back without resuming the second lease (still live): nothing more until it ends.
    third_job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "hoarder") as back:
        await back.send(ready=fpb.Ready())
        with pytest.raises(TimeoutError):
            await back.expect("lease_granted", timeout=1.0)
        async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
            taken = {(await honest.ready_for_lease()).lease.job_id}
    assert taken <= {first_job.job_id, third_job.job_id}
    assert (await _lease_row(database_url, second_job.job_id))["state"] == "RUNNING"


async def test_a_worker_is_not_told_the_owners_webhook_or_labels(fleet: Fleet) -> None:
    await fleet.alice.submit(
        webhook=pb.Webhook(url="https://hooks.example.com/services/T0SECRET/B0/xyz"),
        labels={"customer": "acme"},
    )
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
    assert not granted.spec.webhook.url and not granted.spec.labels
    assert granted.spec.instance_prompt


async def test_a_drained_workers_machine_id_is_free_at_once(fleet: Fleet) -> None:
    """A worker that drained and left (a Ctrl-C'd `lorafleet up`) frees its id: a restarted
    worker with no session token takes it at once. One that merely vanished keeps it held."""
    async with connect_worker(fleet.channel, fleet.token, "vanisher"):
        pass
    released = asyncio.Event()
    ledger = fleet.scheduler.ledger
    release = ledger.release_machine_session

    async def observed(machine_id: str, session_sha256: bytes) -> None:
        await release(machine_id, session_sha256)
        released.set()

    ledger.release_machine_session = observed  # type: ignore[method-assign]
    async with connect_worker(fleet.channel, fleet.token, "leaver2") as leaver2:
        await leaver2.send(draining=fpb.Draining(reason="stopping"))
    async with asyncio.timeout(10):
        await released.wait()
    async with connect_worker(fleet.channel, fleet.token, "leaver2", session_token="") as back:
        assert back.welcome is not None
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with connect_worker(fleet.channel, fleet.token, "vanisher", session_token=""):
            pass
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
