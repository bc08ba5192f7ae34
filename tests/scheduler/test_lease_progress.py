"""A holder of the worker token that takes work and does none: scripted hostile workers over real
gRPC against a real scheduler and Postgres, each test checking that the honest worker's lease and
bans are untouched.

* A lease that heartbeats at step 0 for ever (or announces checkpoints one step apart) makes no
  verified progress: the sweeper revokes it as a node fault and re-queues the job from its last
  verified checkpoint.
* A stream that takes lease after lease by saying Ready (collecting each job's image URLs)
  keeps no URL past its lease, and is granted nothing once it has dropped a few without work.
* A heartbeat past the job's max_train_steps is a bad field.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import asyncpg
import grpc
import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.artifacts import checkpoint_blob
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


async def _row(database_url: str, query: str, *args: Any) -> asyncpg.Record:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(query, *args)
        assert row is not None
        return row
    finally:
        await conn.close()


STALL = {"lease_progress_timeout_s": 3.0, "quarantine_fault_threshold": 1}


@pytest.mark.parametrize("scheduler_overrides", [STALL])
async def test_a_lease_without_verified_progress_is_revoked_as_a_node_fault(
    fleet: Fleet, database_url: str
) -> None:
    # SCRIPTED_SPEC checkpoints every 10 of 100 steps: the bound is the timeout itself.
    stalled = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "first") as first:
        granted = await first.ready_for_lease()
        await first.store_checkpoint(granted.lease, 10)
        await first.send(draining=fpb.Draining(lease=first.ref(granted.lease), reason="spot"))
    await fleet.alice.wait_for(stalled.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    async with connect_worker(fleet.channel, fleet.token, "staller") as staller:
        taken = await staller.ready_for_lease()
        assert taken.lease.job_id == stalled.job_id
        # The lease's first checkpoint is progress; one a step past it is verified but not past
        # the next multiple of the checkpoint interval, so no progress.
        await staller.store_checkpoint(taken.lease, 11)
        await staller.store_checkpoint(taken.lease, 12)
        honest_job = await fleet.alice.submit()
        async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
            mine = await honest.ready_for_lease()
            assert mine.lease.job_id == honest_job.job_id

            async def train() -> None:
                # The honest worker checkpoints every interval well within the bound.
                for step in range(10, 100, 10):
                    await honest.heartbeat(mine.lease, step)
                    await honest.store_checkpoint(mine.lease, step)
                    await asyncio.sleep(0.5)

            stop_stalling = asyncio.Event()

            async def stall() -> None:
                # Heartbeats are no progress. Stopped between writes, never cancelled: a
                # cancel landing inside a stream write cancels the whole call.
                while not stop_stalling.is_set():
                    await staller.heartbeat(taken.lease, 0)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop_stalling.wait(), 0.3)

            staller_task = asyncio.create_task(stall())
            try:
                async with asyncio.timeout(8):
                    trainer = asyncio.create_task(train())
                    revoked = await staller.expect("lease_revoked")
                    assert revoked.lease.lease_id == taken.lease.lease_id
            finally:
                stop_stalling.set()
                await staller_task
            await trainer

            lease = await _row(
                database_url,
                "SELECT end_reason, ended_at - granted_at AS held FROM leases WHERE lease_id = $1",
                uuid.UUID(taken.lease.lease_id),
            )
            assert lease["end_reason"] == "failed: node"
            assert lease["held"].total_seconds() >= 3.0
            job = await fleet.alice.get(stalled.job_id)
            # Back in the queue with its last verified checkpoint: a node fault, not a failure.
            assert job.state == pb.JOB_STATE_QUEUED and (job.failures, job.node_faults) == (0, 1)
            assert job.latest_checkpoint.step == 12
            bans = await _row(
                database_url,
                "SELECT count(*) AS n FROM bans WHERE machine_id = 'staller' AND job_id = $1",
                uuid.UUID(stalled.job_id),
            )
            assert bans["n"] == 1
            # A node fault like any other: with a threshold of one it is quarantined.
            await fleet.alice.submit()
            await staller.send(ready=fpb.Ready())
            with pytest.raises(TimeoutError):
                await staller.expect("lease_granted", timeout=1.5)
            # The honest lease, after ten seconds of honest checkpoints, is untouched.
            still = await fleet.alice.get(honest_job.job_id)
            assert still.state == pb.JOB_STATE_RUNNING and still.epoch == 1
            honest_bans = await _row(
                database_url, "SELECT count(*) AS n FROM bans WHERE machine_id = 'honest'"
            )
            assert honest_bans["n"] == 0


async def _get_status(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status


@pytest.mark.parametrize("scheduler_overrides", [{"quarantine_empty_leases": 3}])
async def test_ready_cycling_keeps_no_urls_and_is_quarantined(
    fleet: Fleet, database_url: str
) -> None:
    for _ in range(4):
        await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "cycler") as cycler:
        granted = await cycler.ready_for_lease()
        (image,) = granted.urls.instance_files
        # A lease's read URLs are short-lived (lease_get_ttl_s), bound to the lease...
        expires = int(parse_qs(urlsplit(image.url).query)["X-Lf-Expires"][0])
        assert expires - time.time() <= 300 + 5
        assert await _get_status(image.url) == 200
        for _ in range(2):
            # ... and die with it: Ready gives the lease up, and its URLs with it.
            again = await cycler.ready_for_lease()
            assert await _get_status(image.url) == 403
            (image,) = again.urls.instance_files
            assert await _get_status(image.url) == 200
        # Three leases taken and dropped without a checkpoint: nothing more for a window.
        await cycler.send(ready=fpb.Ready())
        with pytest.raises(TimeoutError):
            await cycler.expect("lease_granted", timeout=1.5)
        assert await _get_status(image.url) == 403
        async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
            mine = await honest.ready_for_lease()
            await honest.store_checkpoint(mine.lease, 10)
            assert await _get_status(mine.urls.instance_files[0].url) == 200
    quarantined = await _row(
        database_url,
        "SELECT count(*) AS n FROM leases WHERE machine_id = 'cycler' AND end_reason = 'dropped'",
    )
    assert quarantined["n"] == 3


async def test_a_heartbeat_past_max_train_steps_is_refused(fleet: Fleet) -> None:
    job = await fleet.alice.submit()  # 100 steps
    async with connect_worker(fleet.channel, fleet.token, "liar") as liar:
        granted = await liar.ready_for_lease()
        await liar.heartbeat(granted.lease, 100)
        await liar.heartbeat(granted.lease, 101, seconds_per_step=0.001)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await liar.expect("welcome")
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "heartbeat.step" in (ended.value.details() or "")
    current = await fleet.alice.get(job.job_id)
    assert current.progress.step == 100


@pytest.mark.parametrize("scheduler_overrides", [STALL])
async def test_what_a_liar_left_in_a_job_does_not_count_against_the_next_holder(
    fleet: Fleet, database_url: str
) -> None:
    """A holder commits a well-formed checkpoint with a layout of its own at a high step, then
    drains. The next, honest holder's checkpoints (another layout, lower steps: it resumed from
    an earlier one) are recorded, each past an interval is progress, and it is neither refused,
    revoked nor banned."""
    job = await fleet.alice.submit()  # 100 steps, a checkpoint every 10
    async with connect_worker(fleet.channel, fleet.token, "liar") as liar:
        granted = await liar.ready_for_lease()
        bogus = checkpoint_blob(90, {"evil": ("F32", (3,))})
        await liar.store_checkpoint(granted.lease, 90, bogus)
        await liar.send(draining=fpb.Draining(lease=liar.ref(granted.lease), reason="spot"))
    await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_QUEUED)
    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        mine = await honest.ready_for_lease()
        assert mine.lease.job_id == job.job_id
        # Five checkpoints 1 s apart: 5 s in all, past the 3 s bound unless each is progress.
        for step in range(10, 60, 10):
            await honest.store_checkpoint(mine.lease, step)
            await asyncio.sleep(1.0)
        await honest.heartbeat(mine.lease, 50)
        with pytest.raises(TimeoutError):
            await honest.expect("lease_revoked", timeout=0.5)
        current = await fleet.alice.get(job.job_id)
        assert current.state == pb.JOB_STATE_RUNNING and current.machine_id == "honest"
    recorded = await _row(
        database_url,
        "SELECT count(*) AS n FROM checkpoints WHERE job_id = $1 AND epoch = 2",
        uuid.UUID(job.job_id),
    )
    assert recorded["n"] == 5
    bans = await _row(database_url, "SELECT count(*) AS n FROM bans WHERE machine_id = 'honest'")
    assert bans["n"] == 0


@pytest.mark.parametrize("scheduler_overrides", [{"quarantine_empty_leases": 3}])
async def test_failing_leases_instead_of_saying_ready_is_quarantined_too(fleet: Fleet) -> None:
    """Ending each lease with JobFailed (input) instead of Ready gets no more leases than Ready
    cycling: a lease that ended failed without a checkpoint is empty as well."""
    for _ in range(5):
        await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "cycler") as cycler:
        for _ in range(3):
            granted = await cycler.ready_for_lease()
            await cycler.send(
                job_failed=fpb.JobFailed(
                    lease=cycler.ref(granted.lease),
                    failure_class=pb.FAILURE_CLASS_INPUT,
                    message="unreadable images",
                )
            )
        await cycler.send(ready=fpb.Ready())
        with pytest.raises(TimeoutError):
            await cycler.expect("lease_granted", timeout=1.5)


async def test_a_negative_pace_is_a_bad_field(fleet: Fleet) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "liar") as liar:
        granted = await liar.ready_for_lease()
        await liar.heartbeat(granted.lease, 5, seconds_per_step=-1.0)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await liar.expect("welcome")
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "heartbeat.seconds_per_step" in (ended.value.details() or "")
    current = await fleet.alice.get(job.job_id)
    assert current.progress.seconds_per_step >= 0
