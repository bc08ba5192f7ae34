"""A cost estimate before submitting (EstimateJob, `submit --estimate`) from the fleet's
measured seconds per step on jobs of the same shape, and a per-key spend limit. The pace is what
the scheduler observed (verified completions on its own clock, one figure per provider-verified
machine, at least three machines), never what a worker says: another tenant's workers cannot
move anyone's estimate or spend limit by what they report."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from lorafleet.app.main import main
from lorafleet.client import AsyncClient
from lorafleet.core.errors import FailedPrecondition
from lorafleet.core.model import Estimate
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.auth import create_api_key
from tests.clients.test_cli import lorafleet
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker, local_identity

ESTIMATE = (
    "submit",
    "--estimate",
    "--instance-prompt",
    "a photo of sks dog",
    "--instance-data-prefix",
    "dogs/rex",
    "--json",
)


@pytest.fixture
def scheduler_overrides() -> dict[str, object]:
    # A tenth of a cent per GPU-second; the operator pins the prior near what the fleet runs
    # (0.6 s per 1024x1024 image step): the fleet's figure counts within 2x of it.
    return {"price_per_gpu_hour": 3.6, "estimate_prior_s_per_step": 0.6}


async def _sql(fleet: Fleet, query: str, *args: object) -> None:
    conn = await asyncpg.connect(fleet.scheduler.database_url)
    try:
        await conn.execute(query, *args)
    finally:
        await conn.close()


async def _measured_jobs(
    fleet: Fleet, durations_s: dict[str, float] | None = None, *, steps: int = 40
) -> list[str]:
    """One finished job (resolution 1024, batch 1) per verified machine, each lease taking the
    given seconds of the ledger's clock from grant to its verified result (by default three
    machines at 0.5, 0.5 and 0.6 s/step: a median of 0.5). The workers report nothing of their
    pace but one heartbeat each claiming 1000 s/step, which must count for nothing."""
    durations = durations_s or {"m1": 20.0, "m2": 20.0, "m3": 24.0}
    job_ids = []
    for machine, seconds in durations.items():
        job = await fleet.alice.submit(max_train_steps=steps)
        identity = local_identity(fleet.scheduler.identity_secret, machine)
        async with connect_worker(fleet.channel, fleet.token, machine, identity=identity) as w:
            granted = await w.ready_for_lease()
            await w.heartbeat(granted.lease, steps // 2, loss=0.3, seconds_per_step=1000.0)
            await w.store_result(granted, steps)
            await fleet.alice.wait_for(job.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED)
        # The lease took `seconds` on the ledger's clock (a test does not wait for them).
        await _sql(
            fleet,
            "UPDATE leases SET granted_at = ended_at - make_interval(secs => $2)"
            " WHERE job_id = $1::uuid",
            job.job_id,
            seconds,
        )
        job_ids.append(job.job_id)
    return job_ids


async def test_estimate_uses_the_measured_pace_of_the_same_shape(
    fleet: Fleet,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, *ESTIMATE, "--max-train-steps", "1000"
    )
    assert code == 0, err
    (before,) = json.loads(out)
    assert before["samples"] == 0 and before["seconds"] is None  # nothing measured yet

    job_ids = await _measured_jobs(fleet)
    code, out, err = await lorafleet(
        capsys, monkeypatch, fleet, *ESTIMATE, "--max-train-steps", "1000"
    )
    assert code == 0, err
    (estimate,) = json.loads(out)
    assert estimate["samples"] == 3 and estimate["seconds_per_step"] == pytest.approx(0.5)
    assert estimate["seconds"] == pytest.approx(500.0)
    assert estimate["price_per_gpu_hour"] == pytest.approx(3.6)
    assert estimate["dollars"] == pytest.approx(0.5)

    # Another shape has no measurement; the human form says so.
    code, out, _ = await lorafleet(
        capsys, monkeypatch, fleet, *ESTIMATE[:-1], "--max-train-steps", "10", "--resolution", "512"
    )
    assert code == 0 and "no estimate" in out
    # --estimate submitted nothing.
    code, out, _ = await lorafleet(capsys, monkeypatch, fleet, "list", "--json")
    assert sorted(j["job_id"] for j in json.loads(out)) == sorted(job_ids)
    job_id = job_ids[0]

    # download --checkpoint latest of the finished job: a clear message, not "no ... yet".
    code, _, err = await lorafleet(
        capsys, monkeypatch, fleet, "download", job_id, "--checkpoint", "latest"
    )
    assert code == 1 and "checkpoints were deleted" in err and f"lorafleet download {job_id}" in err


async def test_a_submit_past_the_keys_spend_limit_is_refused(fleet: Fleet) -> None:
    await _measured_jobs(fleet)
    limited = await create_api_key(fleet.scheduler.ledger, "alice", spend_limit_dollars=0.3)
    target = f"127.0.0.1:{fleet.scheduler.port}"
    async with AsyncClient(target, api_key=limited.key) as client:
        spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert isinstance(estimate, Estimate) and estimate.known  # typed, as every result
        assert estimate.dollars == pytest.approx(0.5)
        assert estimate.spend_limit_dollars == pytest.approx(0.3)
        with pytest.raises(
            FailedPrecondition, match=r"spend limit.*\$0\.30.*this submit at \$0\.50"
        ):
            await client.submit(spec, max_train_steps=1000)
        job = await client.submit(spec, max_train_steps=400)  # $0.20: within the limit
        assert job.spec.max_train_steps == 400
        with pytest.raises(FailedPrecondition, match="spend limit"):
            # Nothing billed yet, but the queued 400 steps ($0.20) count: + 3 x $0.05 > $0.30.
            await client.submit_batch([{**spec, "max_train_steps": 100}] * 3)
        await client.submit_batch([{**spec, "max_train_steps": 100}] * 2)  # $0.30: just within


async def test_a_missing_api_key_and_a_scheduler_that_is_down_say_so(
    fleet: Fleet,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAFLEET_TARGET", f"127.0.0.1:{fleet.scheduler.port}")
    monkeypatch.delenv("LORAFLEET_API_KEY", raising=False)
    code = await asyncio.to_thread(main, ["list"])
    err = capsys.readouterr().err
    assert code == 1 and "no API key given" in err and "malformed" not in err

    monkeypatch.setenv("LORAFLEET_API_KEY", fleet.alice.api_key)
    monkeypatch.setenv("LORAFLEET_TARGET", "127.0.0.1:1")  # nothing listens on port 1
    code = await asyncio.to_thread(main, ["list"])
    err = capsys.readouterr().err
    assert code == 1 and "lorafleet up" in err and "127.0.0.1:1" in err


@contextlib.asynccontextmanager
async def _claiming_leases(fleet: Fleet, seconds_per_step: float, tag: str, count: int = 6) -> Any:
    """`count` leases on bob's jobs, on machines the provider vouched for, each heartbeating
    500 steps at `seconds_per_step`: what another tenant's workers may say of their speed."""
    for _ in range(count):
        await fleet.bob.submit(max_train_steps=1000)
    async with contextlib.AsyncExitStack() as stack:
        for k in range(count):
            machine = f"liar-{tag}-{k}"
            w = await stack.enter_async_context(
                connect_worker(
                    fleet.channel,
                    fleet.token,
                    machine,
                    identity=local_identity(fleet.scheduler.identity_secret, machine),
                )
            )
            granted = await w.ready_for_lease()
            await w.heartbeat(granted.lease, 0, seconds_per_step=seconds_per_step)
            await w.heartbeat(granted.lease, 500, seconds_per_step=seconds_per_step)
            # A round-trip after them: the stream's messages are handled in order, so the
            # claims are in the ledger once the answer comes.
            slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=500)
            await w.send(urls_requested=fpb.UrlsRequested(lease=w.ref(granted.lease), slots=[slot]))
            await w.expect("urls_renewed")
        yield


async def test_what_workers_say_of_their_speed_moves_no_estimate_and_no_spend_limit(
    fleet: Fleet,
) -> None:
    await _measured_jobs(fleet)
    spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
    target = f"127.0.0.1:{fleet.scheduler.port}"
    five = await create_api_key(fleet.scheduler.ledger, "alice", spend_limit_dollars=5.0)
    thirty_cents = await create_api_key(fleet.scheduler.ledger, "alice", spend_limit_dollars=0.3)

    # Six leases claiming a million seconds a step: the estimate stays at 0.5 s/step, and a $5
    # key may still submit a $0.50 job (the claims made it $277,777 and refused it).
    async with (
        _claiming_leases(fleet, 1e6, "slow"),
        AsyncClient(target, api_key=five.key) as client,
    ):
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.seconds_per_step == pytest.approx(0.5) and estimate.samples == 3
        assert estimate.dollars == pytest.approx(0.5)
        job = await client.submit(spec, max_train_steps=1000)
        assert job.spec.max_train_steps == 1000

    # Six more claiming a millisecond a step: a $0.30 key still may not submit the $0.50 job
    # (the claims let it run past its limit).
    async with (
        _claiming_leases(fleet, 0.001, "fast"),
        AsyncClient(target, api_key=thirty_cents.key) as client,
    ):
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.seconds_per_step == pytest.approx(0.5)
        with pytest.raises(FailedPrecondition, match="spend limit"):
            await client.submit(spec, max_train_steps=1000)


async def test_one_machine_counts_once_and_too_few_machines_give_no_estimate(
    fleet: Fleet,
) -> None:
    spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
    target = f"127.0.0.1:{fleet.scheduler.port}"
    async with AsyncClient(target, api_key=fleet.alice.api_key) as client:
        # Two machines are not enough to rest a figure on.
        await _measured_jobs(fleet, {"m1": 20.0, "m2": 20.0})
        assert (await client.estimate(spec, max_train_steps=1000)).samples == 0
        # A third machine: 0.5 s/step. Then one machine finishing three jobs in a blink (a
        # worker can upload any bytes as a result) is still one machine of four: the median
        # moves from 0.5 to 0.5, not to its pace.
        await _measured_jobs(fleet, {"m3": 24.0})
        assert (await client.estimate(spec, max_train_steps=1000)).seconds_per_step == (
            pytest.approx(0.5)
        )
        for _ in range(3):
            await _measured_jobs(fleet, {"quick": 4.0})  # 0.1 s/step: fast, but plausible
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.samples == 4 and estimate.seconds_per_step == pytest.approx(0.5)
        # Faster than any GPU trains (below the plausibility floor, 0.05 s per 1024x1024 image
        # step): no training, and no figure at all, however many machines report it.
        for machine in ("blink-1", "blink-2", "blink-3"):
            await _measured_jobs(fleet, {machine: 0.04})
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.samples == 4 and estimate.seconds_per_step == pytest.approx(0.5)


@pytest.mark.parametrize("scheduler_overrides", [{"price_per_gpu_hour": 3.6}])
async def test_a_shape_never_measured_is_priced_at_the_prior(fleet: Fleet) -> None:
    """No measurement is not "free": a spend limit prices the job at the prior (1.5 s per
    1024x1024 image step), while the estimate says there is none."""
    spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
    target = f"127.0.0.1:{fleet.scheduler.port}"
    limited = await create_api_key(fleet.scheduler.ledger, "alice", spend_limit_dollars=1.0)
    async with AsyncClient(target, api_key=limited.key) as client:
        assert (await client.estimate(spec, max_train_steps=1000)).samples == 0
        # 1000 steps x 1.5 s x $3.6/h = $1.50 > $1: refused, and the message says why.
        with pytest.raises(FailedPrecondition, match=r"this submit at \$1\.50.*prior"):
            await client.submit(spec, max_train_steps=1000)
        # 512 px is a quarter of the pixels: 1000 steps for $0.375.
        job = await client.submit({**spec, "resolution": 512}, max_train_steps=1000)
        assert job.spec.resolution == 512
        # Then the queued one counts at the prior too: $0.375 + $0.75 > $1.
        with pytest.raises(FailedPrecondition, match=r"unfinished jobs are estimated at \$0\.38"):
            await client.submit(spec, max_train_steps=500)


async def test_machines_holding_a_tenants_own_jobs_slowly_refuse_none_of_its_submits(
    fleet: Fleet,
) -> None:
    """Three verified machines of one holder run a tenant's own 1-step jobs and hold each for
    25 s: the tenant's own figure for that shape is 25 s/step. Before, its next ordinary
    1000-step submit was priced at it ($25) and refused by its $5 spend limit: a holder's
    machines chose whose submits were refused. Admission now prices a key's remaining work at
    most at the prior (0.6 s/step here: $0.60); the estimate still shows the key's own figure."""
    await _measured_jobs(fleet, {"h1": 25.0, "h2": 25.0, "h3": 25.0}, steps=1)
    await _sql(
        fleet,
        "UPDATE api_keys SET spend_limit_dollars = 5"
        " WHERE key_id = (SELECT api_key_id FROM jobs LIMIT 1)",
    )
    spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
    target = f"127.0.0.1:{fleet.scheduler.port}"
    async with AsyncClient(target, api_key=fleet.alice.api_key) as client:
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.samples == 3 and estimate.seconds_per_step == pytest.approx(25.0)
        assert estimate.spend_limit_dollars == pytest.approx(5.0)
        job = await client.submit(spec, max_train_steps=1000)  # $0.60 at the prior, not $25
        assert job.spec.max_train_steps == 1000


@pytest.mark.parametrize("scheduler_overrides", [{"price_per_gpu_hour": 3.6}])
async def test_colluding_machines_move_another_tenants_figures_at_most_2x(fleet: Fleet) -> None:
    """Three verified machines of one holder. (1) They succeed 100-step jobs 6.6 s after the
    grant with tiny valid LoRA files (0.066 s/step, above the plausibility floor): another
    tenant's estimate, from the fleet's figure, stays within 2x of the prior (1.5 s/step), where
    it fell 23x. (2) The holder's own key submits 1-step jobs its machines hold for 25 s: that
    shape's fleet figure is 25 s/step, and another tenant's ordinary $1.50 submit under a $5
    limit was refused ($25); now another tenant's numbers never refuse a submit. The holder's
    own key is priced by its own jobs."""
    spec = {"instance_prompt": "a dog", "instance_data_prefix": "dogs/rex"}
    target = f"127.0.0.1:{fleet.scheduler.port}"
    other = await create_api_key(fleet.scheduler.ledger, "bob", spend_limit_dollars=5.0)
    await _measured_jobs(fleet, {"h1": 6.6, "h2": 6.6, "h3": 6.6}, steps=100)
    async with AsyncClient(target, api_key=other.key) as client:
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert estimate.samples == 3
        assert 1.5 / 2 <= estimate.seconds_per_step <= 1.5 * 2, estimate

    # The same three machines hold the holder's own 1-step jobs of another shape for 25 s.
    await _measured_jobs(fleet, {"h1": 25.0, "h2": 25.0, "h3": 25.0}, steps=1)
    # (1-step jobs at resolution 1024: the same shape; 25 s/step is now h1-h3's median there,
    # and the holder's own figure, 6.6 s per 100 steps and 25 s per step, is its business.)
    async with AsyncClient(target, api_key=other.key) as client:
        estimate = await client.estimate(spec, max_train_steps=1000)
        assert 1.5 / 2 <= estimate.seconds_per_step <= 1.5 * 2, estimate
        job = await client.submit(spec, max_train_steps=1000)  # $1.50 at the prior, not $25
        assert job.spec.max_train_steps == 1000
