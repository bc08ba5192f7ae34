"""A holder of the worker token against the sample-task path and the stream's bounds: scripted
hostile workers over real gRPC against a real scheduler and Postgres, each test checking the
honest worker's lease, bans and session are untouched."""

from __future__ import annotations

import asyncio
import re
import uuid

import asyncpg
import grpc
import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.sessions import peer_source
from tests.scheduler.test_sample_tasks import VALIDATION, settled, store_samples
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker, local_identity


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


async def _stream_outcome(fleet: Fleet, machine_id: str, token: str | None = None) -> str:
    """Opens one stream as `machine_id` and closes it: "welcome", or the status code's name."""
    try:
        async with connect_worker(fleet.channel, token or fleet.token, machine_id):
            return "welcome"
    except grpc.aio.AioRpcError as exc:
        name: str = exc.code().name
        return name
    except AssertionError:  # the stream ended before its Welcome
        return "ended"


LOOP_BOUNDS = {
    "worker_stream_burst_per_peer": 5,
    "worker_streams_per_peer_per_min": 6.0,
    "worker_log_lines_per_peer_per_min": 6.0,
}


@pytest.mark.parametrize("scheduler_overrides", [LOOP_BOUNDS])
async def test_a_reconnect_loop_from_one_host_is_cut_off(
    fleet: Fleet, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streams per peer address: a loop opening stream after stream under made-up machine ids
    gets a burst's worth, then RESOURCE_EXHAUSTED with nothing written to the ledger, and its
    log lines are bounded too. A worker already connected keeps its stream and lease."""
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        granted = await honest.ready_for_lease()
        capsys.readouterr()
        outcomes = [await _stream_outcome(fleet, f"loop-{i}") for i in range(30)]
        # The burst (5, one of them the honest worker's), and at most one more refilled.
        assert 3 <= outcomes.count("welcome") <= 5, outcomes
        assert outcomes.count("RESOURCE_EXHAUSTED") >= 25, outcomes
        logged = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().err)
        # Console (peer=127.0.0.1) or JSON ("peer": "127.0.0.1") lines alike.
        lines = [line for line in logged.splitlines() if re.search(r"peer\W+127\.0\.0\.1", line)]
        # A burst of twice the per-minute rate (12), one more line at most refilled meanwhile.
        assert 10 <= len(lines) <= 13, logged
        assert "log_lines_suppressed" not in logged  # told with the next line let through
        # The honest worker's stream and lease are untouched.
        await honest.heartbeat(granted.lease, 5)
        await honest.store_checkpoint(granted.lease, 5)
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM machines WHERE machine_id LIKE 'loop-%'")
    finally:
        await conn.close()
    assert rows == outcomes.count("welcome")
    row = await fleet.alice.get(job.job_id)
    assert row.state == pb.JOB_STATE_RUNNING and row.epoch == 1
    assert await _bans(database_url, "honest") == 0


@pytest.mark.parametrize(
    "scheduler_overrides", [{"worker_hello_burst": 3, "worker_hellos_per_s": 0.01}]
)
async def test_hellos_are_bounded_per_worker_token(fleet: Fleet) -> None:
    """Hellos per worker token: one token serves the whole fleet, so this bounds the fleet's
    connection rate (its default burst lets a large fleet reconnect at once after a restart).
    A stream with a wrong token costs the fleet's bound nothing."""
    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        assert await _stream_outcome(fleet, "stranger", token="wrong") == "UNAUTHENTICATED"
        assert [await _stream_outcome(fleet, f"loop-{i}") for i in range(3)] == [
            "welcome",
            "welcome",
            "RESOURCE_EXHAUSTED",
        ]
        # The connected worker is still served.
        await fleet.alice.submit()
        await honest.ready_for_lease()


async def _verified_outcome(fleet: Fleet, machine_id: str, secret: str | None = None) -> str:
    """As `_stream_outcome`, with the supervisor's proof of `machine_id` (signed with
    `secret`; by default the scheduler's own)."""
    identity = local_identity(secret or fleet.scheduler.identity_secret, machine_id)
    try:
        async with connect_worker(fleet.channel, fleet.token, machine_id, identity=identity):
            return "welcome"
    except grpc.aio.AioRpcError as exc:
        name: str = exc.code().name
        return name


@pytest.mark.parametrize(
    "scheduler_overrides",
    [
        {
            "worker_hello_burst": 3,
            "worker_hellos_per_s": 0.01,
            "worker_hello_burst_per_verified_machine": 2,
            "worker_hellos_per_verified_machine_per_min": 0.01,
        }
    ],
)
async def test_verified_hellos_have_their_own_budget(fleet: Fleet) -> None:
    """A flood of unverified Hellos (from any number of addresses) spends the worker token's
    budget, and forged proofs spend it too; a machine whose id a provider vouched for is charged
    to its own budget and still gets in. Its own reconnect loop is bounded per machine."""
    assert [await _stream_outcome(fleet, f"flood-{i}") for i in range(3)] == ["welcome"] * 3
    assert await _stream_outcome(fleet, "flood-3") == "RESOURCE_EXHAUSTED"
    # A forged proof is refused, and costs no verified machine's budget.
    assert await _verified_outcome(fleet, "real-1", secret="forged") == "UNAUTHENTICATED"
    assert [await _verified_outcome(fleet, "real-1") for _ in range(3)] == [
        "welcome",
        "welcome",
        "RESOURCE_EXHAUSTED",
    ]
    assert await _verified_outcome(fleet, "real-2") == "welcome"
    # Unverified Hellos are still refused: the token's budget is spent.
    assert await _stream_outcome(fleet, "flood-4") == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize("scheduler_overrides", [{"machine_retention_s": 30.0}])
async def test_silent_unverified_machines_that_nothing_names_expire(
    fleet: Fleet, database_url: str
) -> None:
    """A reconnect loop's made-up machine ids cost rows for a bounded time: the sweeper deletes
    never-verified machines silent past the retention and named by no lease, ban or sample
    task. A machine with a lease, a ban or a verified identity stays."""
    job = await fleet.alice.submit()
    ledger = fleet.scheduler.ledger
    expire = ledger.expire_machines
    forgotten: set[str] = set()
    swept = asyncio.Event()

    async def observed(silent_s: float) -> list[str]:
        expired = await expire(silent_s)
        forgotten.update(expired)
        swept.set()
        return expired

    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        granted = await honest.ready_for_lease()
        for name in ("banned", "verified", "loop-1", "loop-2"):
            async with connect_worker(fleet.channel, fleet.token, name):
                pass
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(
                "INSERT INTO bans (job_id, machine_id, reason) VALUES ($1, 'banned', 'test')",
                uuid.UUID(job.job_id),
            )
            await conn.execute(
                "UPDATE machines SET identity_provider = 'local' WHERE machine_id = 'verified'"
            )
            await conn.execute("UPDATE machines SET last_seen_at = now() - interval '1 hour'")
            ledger.expire_machines = observed  # type: ignore[method-assign]
            # The next expiry pass (every tenth of the retention) runs on the new rows.
            async with asyncio.timeout(15):
                while not forgotten:
                    swept.clear()
                    await swept.wait()
            left = {r[0] for r in await conn.fetch("SELECT machine_id FROM machines")}
        finally:
            await conn.close()
        assert forgotten == {"loop-1", "loop-2"}
        assert left == {"honest", "banned", "verified"}
        # The honest worker is still served under its id.
        # The honest worker is still served under its lease.
        await honest.store_checkpoint(granted.lease, 1)


@pytest.mark.parametrize(
    ("peer", "source"),
    [
        ("ipv4:203.0.113.7:50123", "203.0.113.7"),
        ("ipv6:[2001:db8:1:2:3:4:5:6]:443", "2001:db8:1:2::/64"),
        ("ipv6:%5B2001:db8:1:2:ffff::1%5D:443", "2001:db8:1:2::/64"),
        ("ipv6:[::ffff:203.0.113.7]:80", "203.0.113.7"),
        ("unix:/run/lorafleet.sock", "unix:/run/lorafleet.sock"),
    ],
)
def test_a_source_is_an_address_without_its_port_or_an_ipv6_64(peer: str, source: str) -> None:
    """A reconnect loop picks a new port each time, and an IPv6 host any address of its /64."""
    assert peer_source(peer) == source


def test_a_machine_row_outlives_the_hold_on_its_id() -> None:
    """A machine id is its last stream's until a lease TTL of silence: its row may not expire
    sooner, or a stranger could take the id early."""
    with pytest.raises(ValueError, match="machine_retention_s"):
        SchedulerConfig(lease_ttl_s=600.0, machine_retention_s=300.0)
    assert SchedulerConfig(lease_ttl_s=600.0, machine_retention_s=600.0).machine_retention_s
