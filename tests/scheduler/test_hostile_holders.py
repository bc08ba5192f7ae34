"""A holder of the worker token against the sample-task path and the stream's bounds: scripted
hostile workers over real gRPC against a real scheduler and Postgres, each test checking the
honest worker's lease, bans and session are untouched."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.scheduler.test_sample_tasks import VALIDATION, settled, store_samples
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


async def _tasks(database_url: str, job_id: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return list(
            await conn.fetch(
                "SELECT step, state, machine_id, failures, banned_machines,"
                " lease_expires_at > now() AS live"
                " FROM sample_tasks WHERE job_id = $1 ORDER BY step",
                uuid.UUID(job_id),
            )
        )
    finally:
        await conn.close()


async def _bans(database_url: str, machine_id: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM bans WHERE machine_id = $1", machine_id
        )
        return count
    finally:
        await conn.close()


async def test_a_sample_task_grant_carries_the_workers_view_of_the_spec_only(
    fleet: Fleet,
) -> None:
    job = await fleet.alice.submit(
        max_train_steps=25,
        webhook=pb.Webhook(url="https://hooks.example.com/services/T0SECRET/B0/xyz"),
        labels={"customer": "acme"},
        **VALIDATION,
    )
    async with (
        connect_worker(fleet.channel, fleet.token, "trainer") as trainer,
        connect_worker(fleet.channel, fleet.token, "idle") as idle,
    ):
        granted = await trainer.ready_for_lease()
        await idle.send(ready=fpb.Ready())
        await trainer.store_checkpoint(granted.lease, 10)
        task = await idle.expect("sample_task_granted")
        assert task.lease.job_id == job.job_id
        assert not task.spec.webhook.url and not task.spec.labels
        # What sampling needs is all there.
        assert task.spec.base_model == granted.spec.base_model and task.spec.instance_prompt


async def test_ready_while_holding_a_sample_task_ends_it_and_bans_the_machine(
    fleet: Fleet, database_url: str
) -> None:
    """One stream cannot hoard sample tasks: Ready while holding one gives it back at once (no
    failure counted) and bans the machine from it; the ledger never shows the machine holding
    two; the honest worker gets the tasks the hoarder gave back."""
    job = await fleet.alice.submit(max_train_steps=40, **VALIDATION)
    async with connect_worker(fleet.channel, fleet.token, "trainer") as trainer:
        granted = await trainer.ready_for_lease()
        for step in (10, 20, 30):
            await trainer.store_checkpoint(granted.lease, step)
        # A reply to a later message: every checkpoint is recorded (replies come in order).
        await trainer.send(heartbeat=fpb.Heartbeat(lease=fpb.LeaseRef(lease_id="x", epoch=1)))
        await trainer.expect("rejected")
        held = []
        async with connect_worker(fleet.channel, fleet.token, "hoarder") as hoarder:
            for _ in range(4):
                await hoarder.send(ready=fpb.Ready())
                try:
                    task = await hoarder.expect("sample_task_granted", timeout=3.0)
                except TimeoutError:
                    break
                held.append(task.step)
                rows = await _tasks(database_url, job.job_id)
                running = [
                    r for r in rows if r["machine_id"] == "hoarder" and r["state"] == "RUNNING"
                ]
                assert len(running) == 1, rows
            # Each Ready gave the held task back: the fourth finds nothing left for it.
            assert held == [10, 20, 30]
            rows = await _tasks(database_url, job.job_id)
            assert [r["state"] for r in rows] == ["QUEUED"] * 3
            assert all(r["failures"] == 0 for r in rows)
            assert [list(r["banned_machines"]) for r in rows] == [["hoarder"]] * 3
            # The honest idle worker gets every task given back, at once.
            async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
                steps = []
                for _ in range(3):
                    await honest.send(ready=fpb.Ready())
                    task = await honest.expect("sample_task_granted")
                    steps.append(task.step)
                    await store_samples(honest, task)
                await settled(honest, task)
                assert sorted(steps) == [10, 20, 30]
        # The training lease was never touched.
        assert (await fleet.alice.get(job.job_id)).state == pb.JOB_STATE_RUNNING
        await trainer.store_result(granted, 40)
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
    assert await _bans(database_url, "trainer") == 0
    assert await _bans(database_url, "honest") == 0


async def test_one_live_lease_of_any_kind_per_machine(fleet: Fleet, database_url: str) -> None:
    """A machine whose stream came back without resuming its training lease (still live) gets
    no sample task meanwhile; a machine coming back from a sample task (never resumed) gives it
    back at once, so an honest worker's reconnect delays nothing."""
    sampled = await fleet.alice.submit(max_train_steps=25, **VALIDATION)
    async with connect_worker(fleet.channel, fleet.token, "trainer") as trainer:
        granted = await trainer.ready_for_lease()
        await trainer.store_checkpoint(granted.lease, 10)
        await trainer.store_result(granted, 25)
        await fleet.alice.wait_for(sampled.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        # Two sample tasks queued; "holder" takes a training job, then comes back without it.
        training = await fleet.alice.submit()
        async with connect_worker(fleet.channel, fleet.token, "holder") as holder:
            lease = await holder.ready_for_lease()
            assert lease.lease.job_id == training.job_id
        async with connect_worker(fleet.channel, fleet.token, "holder") as back:
            await back.send(ready=fpb.Ready())
            with pytest.raises(TimeoutError):
                await back.expect("sample_task_granted", timeout=1.5)
        rows = await _tasks(database_url, sampled.job_id)
        assert [r["state"] for r in rows] == ["QUEUED", "QUEUED"]
        # A sampler that drops its stream mid-task and comes back: the task is queued again at
        # once (a sample task is never resumed), and the sampler is offered work again.
        async with connect_worker(fleet.channel, fleet.token, "sampler") as sampler:
            await sampler.send(ready=fpb.Ready())
            task = await sampler.expect("sample_task_granted")
        async with connect_worker(fleet.channel, fleet.token, "sampler") as sampler:
            rows = await _tasks(database_url, sampled.job_id)
            assert not [r for r in rows if r["state"] == "RUNNING"], rows
            await sampler.send(ready=fpb.Ready())
            again = await sampler.expect("sample_task_granted")
            assert again.task_id == task.task_id and again.lease.epoch == task.lease.epoch + 1
            await store_samples(sampler, again)
            await settled(sampler, again)
    assert await _bans(database_url, "sampler") == 0
    assert await _bans(database_url, "trainer") == 0
