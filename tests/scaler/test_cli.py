"""`lorafleet nodes`, `lorafleet scaler-log` and `lorafleet scaler --once --dry-run` against a real
ledger (and the SaladCloud double), as an operator runs them; and the ledger reads behind them."""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path

import asyncpg
import pytest

from lorafleet.app.main import build_parser
from lorafleet.app.services import run_keys, run_nodes, run_scaler, run_scaler_log
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.model import Checkpoint, Machine, Qualification
from lorafleet.core.spec import JobSpec
from lorafleet.ledger.ledger import Ledger, NewJob
from lorafleet.scaler.policy import PolicyConfig
from lorafleet.scaler.salad import SaladConfig, SaladProvider
from lorafleet.scaler.service import Scaler
from tests.scaler.salad_double import SaladDouble

pytestmark = pytest.mark.timeout(60)


def _job(**spec: object) -> NewJob:
    return NewJob(
        job_id=str(uuid.uuid4()),
        spec=JobSpec(
            instance_prompt="a photo of sks dog",
            instance_data_prefix="dogs/rex",
            max_train_steps=100,
            **spec,  # type: ignore[arg-type]
        ),
        idempotency_key="",
        traceparent="",
    )


async def _machine(ledger: Ledger, machine_id: str, *, qualified: bool = True) -> None:
    assert await ledger.claim_machine_session(
        machine_id, presented_sha256=None, new_sha256=bytes(32), silent_s=30
    )
    await ledger.upsert_machine(
        Machine(
            machine_id=machine_id,
            provider_instance_id=f"i-{machine_id}",
            gpu_model="NVIDIA L4",
            vram_mb=24_576,
            qualified=qualified,
            version="1.0",
        ),
        Qualification(
            passed=qualified,
            detail="ok" if qualified else "matmul 2 TFLOPS, below 10",
            tflops=30.0,
            free_memory_mb=20_000,
            free_disk_mb=50_000,
            versions={},
        ),
    )


def _salad_scaler_args(double: SaladDouble, database_url: str, *extra: str) -> argparse.Namespace:
    """`lorafleet scaler --once` against the SaladCloud double."""
    return build_parser(with_services=True).parse_args(
        [
            "scaler",
            "--once",
            *extra,
            "--provider",
            "salad",
            "--salad-organization",
            double.org,
            "--salad-project",
            double.project,
            "--salad-group",
            double.group,
            "--salad-base-url",
            double.base_url,
            "--database-url",
            database_url,
        ]
    )


@pytest.fixture
async def populated(ledger: Ledger, database_url: str) -> dict[str, str]:
    """m1 runs a 512 px job observed at 1.5 s/step (verified checkpoints 30 steps and 45 s of the
    ledger's clock apart) while it says 0.01; m2 failed its probe; two decisions."""
    await _machine(ledger, "m1")
    await _machine(ledger, "m2", qualified=False)
    (job,) = await ledger.insert_jobs("alice", [_job(resolution=512)])
    leased = await ledger.claim_job("m1", 24_576, 30, secret_sha256=bytes(32))
    assert leased is not None and leased.lease_id is not None
    for step in (5, 25):
        assert await ledger.heartbeat(
            leased.lease_id,
            leased.epoch,
            30,
            step=step,
            loss=0.1,
            learning_rate=1e-4,
            seconds_per_step=0.01,
        )
    for step in (5, 35):
        assert await ledger.commit_checkpoint(
            leased.lease_id,
            leased.epoch,
            Checkpoint(step=step, epoch=leased.epoch, key=f"k{step}", size_bytes=1, sha256="0"),
        )
    conn = await asyncpg.connect(database_url)
    try:  # the first checkpoint was committed 45 s before the second
        await conn.execute(
            "UPDATE checkpoints SET committed_at ="
            " (SELECT committed_at FROM checkpoints WHERE step = 35) - interval '45 s'"
            " WHERE step = 5"
        )
    finally:
        await conn.close()
    fold_into = None
    for _ in range(2):
        fold_into, _folded = await ledger.record_scaler_decision(
            at=1_000.0,
            scaler_id="s1",
            action="hold",
            target="fleet",
            job_id=None,
            reason="no work for 12 s of the 600 s idle grace",
            figures={"idle_s": 12},
            fold_key="hold:no work for # s",
            fold_into=fold_into,
        )
    decision_id, folded = await ledger.record_scaler_decision(
        at=1_010.0,
        scaler_id="s1",
        action="reallocate",
        target="i-m2",
        job_id=None,
        reason="node m2 failed its qualification probe",
        figures={"machine_id": "m2"},
    )
    assert not folded
    await ledger.finish_scaler_decision(decision_id, applied=False, error="refused: HTTP 404")
    return {"job": job.job_id}


async def test_the_ledger_reads_behind_the_snapshot(
    ledger: Ledger, populated: dict[str, str]
) -> None:
    nodes = {n.machine_id: n for n in await ledger.list_nodes(None, fault_window_s=60, limit=10)}
    assert nodes["m1"].lease_job_id == populated["job"] and nodes["m1"].qualified is True
    assert nodes["m2"].qualified is False and nodes["m2"].lease_job_id is None
    assert [n.machine_id for n in await ledger.list_nodes(["m2"], fault_window_s=60, limit=5)] == [
        "m2"
    ]
    (pace,) = await ledger.pace_observations(3600, 100)
    assert (pace.machine_id, pace.observed_steps, pace.live) == ("m1", 30, True)
    assert pace.observed_seconds == pytest.approx(45.0)
    assert pace.reported_seconds_per_step == pytest.approx(0.01) and pace.reported_steps == 20
    assert (pace.shape.resolution, pace.shape.batch_size, pace.shape.train_text_encoder) == (
        512,
        1,
        False,
    )
    assert pace.shape.key == "sdxl|512px|b1|a1|r4|no|none|nogc|note"
    assert pace.gpu_class == "NVIDIA L4" and pace.identity_provider == ""
    work = await ledger.scaler_work(["m1"])
    assert (work.queued, work.running, work.unplaced) == (0, 1, 0)
    # m1 is on no listed instance and no provider vouched for it: its lease is no node's work.
    work = await ledger.scaler_work([])
    assert (work.queued, work.running, work.unplaced) == (0, 0, 1)
    # Only carried-out actions count for cooldowns and rate limits: neither HOLD nor a failure.
    assert await ledger.recent_scaler_actions(0.0) == []

    # Dropping the lease: queued again with no failure counted, the machine banned for it.
    dropped = await ledger.drop_lease("m1", populated["job"], "slow")
    assert dropped is not None and dropped.state.value == "QUEUED" and dropped.failures == 0
    assert await ledger.drop_lease("m1", populated["job"], "slow") is None
    (banned,) = await ledger.banned_queued_jobs(10)
    assert banned.banned_machines == ("m1",)
    assert await ledger.claim_job("m1", 24_576, 30, secret_sha256=bytes(32)) is None


async def test_nodes_as_a_table_and_as_json(
    database_url: str, populated: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser(with_services=True)
    assert await run_nodes(parser.parse_args(["nodes", "--database-url", database_url])) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["MACHINE", "INSTANCE", "GPU"]
    m1 = next(line for line in table if line.startswith("m1 "))
    assert populated["job"] in m1 and "|512px|b1|" in m1 and ": 1.5" in m1 and "24 GiB" in m1
    m2 = next(line for line in table if line.startswith("m2 "))
    assert "NO (matmul 2 TFLOPS" in m2 and "idle" in m2

    args = parser.parse_args(["nodes", "--json", "--database-url", database_url])
    assert await run_nodes(args) == 0
    rows = {r["machine_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["m1"]["seconds_per_step_by_shape"] == {"sdxl|512px|b1|a1|r4|no|none|nogc|note": 1.5}
    assert rows["m1"]["lease_job_id"] == populated["job"] and rows["m2"]["qualified"] is False
    assert rows["m1"]["node_faults"] == 0 and rows["m1"]["jobs_finished"] == 0


async def test_scaler_log_shows_decisions_with_reasons_and_outcomes(
    database_url: str, populated: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser(with_services=True)
    args = parser.parse_args(["scaler-log", "--json", "--database-url", database_url])
    assert await run_scaler_log(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["action"], r["repeats"], r["applied"]) for r in rows] == [
        ("reallocate", 1, False),
        ("hold", 2, False),
    ]
    assert rows[0]["error"] == "refused: HTTP 404" and rows[0]["figures"] == {"machine_id": "m2"}

    # The same through `nodes --log`, as a table.
    args = parser.parse_args(["nodes", "--log", "--database-url", database_url])
    assert await run_nodes(args) == 0
    out = capsys.readouterr().out
    assert "NOT APPLIED: refused: HTTP 404" in out and "held x2" in out
    assert "[machine_id=m2]" in out


async def test_scaler_once_dry_run_prints_and_changes_nothing(
    database_url: str,
    ledger: Ledger,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    double = SaladDouble()
    await double.start()
    try:
        await ledger.insert_jobs("alice", [_job(), _job()])
        monkeypatch.setenv("SALAD_API_KEY", double.api_key)
        args = _salad_scaler_args(double, database_url, "--dry-run")
        assert await run_scaler(args) == 0
    finally:
        await double.close()
    out = capsys.readouterr().out
    assert (
        "dry run: would scale fleet to 2 replicas: 2 queued + 0 running jobs: 0 -> 2 replicas"
        in out
    )
    assert double.actions == [] and double.replicas == 0
    assert await ledger.list_scaler_decisions(10) == []


# Waits out the SaladCloud client's default retry deadline (a minute): slow.
@pytest.mark.slow
async def test_scaler_once_exits_non_zero_when_the_provider_fails(
    database_url: str,
    ledger: Ledger,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    double = SaladDouble()
    await double.start()
    try:
        await ledger.insert_jobs("alice", [_job()])
        double.inject("500", count=1_000)
        monkeypatch.setenv("SALAD_API_KEY", double.api_key)
        args = _salad_scaler_args(double, database_url, "--salad-deadline-s", "2")
        assert await run_scaler(args) == 1
    finally:
        await double.close()
    assert "the provider failed" in capsys.readouterr().out
    (hold,) = await ledger.list_scaler_decisions(10)
    assert (hold.action, hold.target, hold.applied) == ("hold", "provider", False)


@pytest.mark.parametrize(
    ("gpus", "max_workers", "min_workers", "bounds"),
    [
        (0, None, 0, (0, 1)),  # `up` on a CPU machine: one CPU worker when there is work
        (4, None, 0, (0, 4)),  # one per GPU
        (4, 2, 0, (0, 2)),  # --workers caps it
        (2, 8, 0, (0, 2)),  # never more than the GPUs (each worker is pinned to one)
        (0, 3, 0, (0, 3)),  # CPU workers as asked
        (0, 1, 1, (1, 1)),  # the demo: one worker at once
        (2, None, 5, (2, 2)),  # the minimum never above the maximum
    ],
)
def test_up_maps_workers_onto_the_scalers_bounds(
    gpus: int, max_workers: int | None, min_workers: int, bounds: tuple[int, int]
) -> None:
    from lorafleet.app.local import worker_bounds

    assert worker_bounds(gpus, max_workers=max_workers, min_workers=min_workers) == bounds


async def test_scaler_once_beside_an_active_scaler_exits_naming_it(
    database_url: str,
    ledger: Ledger,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    double = SaladDouble()
    await double.start()
    active = Scaler(
        ledger=ledger,
        database_url=database_url,
        provider=SaladProvider(
            SaladConfig(
                organization=double.org,
                project=double.project,
                group=double.group,
                api_key=double.api_key,
                base_url=double.base_url,
            )
        ),
        policy=PolicyConfig(),
        scaler_id="scaler-on-host-a",
    )
    try:
        await active.acquire()
        await ledger.insert_jobs("alice", [_job()])
        monkeypatch.setenv("SALAD_API_KEY", double.api_key)
        args = _salad_scaler_args(double, database_url, "--lock-wait-s", "0.5")
        async with asyncio.timeout(20):
            assert await run_scaler(args) == 1
    finally:
        await active.close()
        await double.close()
    err = capsys.readouterr().err
    assert "waited 0.5 s for the scaler lock" in err and "'scaler-on-host-a'" in err
    assert double.actions == [] and await ledger.list_scaler_decisions(10) == []


@pytest.mark.parametrize(
    "argv",
    [["nodes"], ["scaler-log"], ["nodes", "--log"], ["keys", "list"], ["keys", "revoke", "k1"]],
)
async def test_reading_a_fleet_from_elsewhere_makes_no_empty_one(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from another directory than `lorafleet up`'s, these commands made and migrated a new
    empty embedded Postgres there and showed its empty fleet as if it were the one running:
    now they refuse, naming where they looked and how to point them at the fleet."""
    monkeypatch.delenv("LORAFLEET_DATABASE_URL", raising=False)
    data_dir = tmp_path / "elsewhere"
    parser = build_parser(with_services=True)
    args = parser.parse_args([*argv[:1], "--data-dir", str(data_dir), *argv[1:]])
    runner = {"nodes": run_nodes, "scaler-log": run_scaler_log, "keys": run_keys}[argv[0]]
    with pytest.raises(InvalidArgument) as refused:
        await runner(args)
    assert refused.value.field == "data_dir"
    assert "lorafleet up" in str(refused.value) and "--database-url" in str(refused.value)
    assert not (data_dir / "postgres").exists()
