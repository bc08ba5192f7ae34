"""A scheduler's background loops outlive an unavailable ledger, and nothing else: a component
that fails for another reason ends `Scheduler.wait()` with its error."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.core.errors import LedgerUnavailable
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


class Boom(Exception):
    pass


async def test_a_sweeper_that_fails_for_good_reaches_wait(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    retried = asyncio.Event()

    async def expire_leases() -> list[object]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise LedgerUnavailable("the ledger is restarting")
        retried.set()
        raise Boom("a bug")

    monkeypatch.setattr(fleet.scheduler.ledger, "expire_leases", expire_leases)
    async with asyncio.timeout(30):
        with pytest.raises(Boom):
            await fleet.scheduler.wait()
    assert retried.is_set(), "an unavailable ledger is retried, not fatal"


async def test_a_failing_dispatch_task_reaches_wait(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    await fleet.alice.submit()

    async def claim_job(*_: object, **__: object) -> None:
        raise Boom("claim exploded")

    monkeypatch.setattr(fleet.scheduler.ledger, "claim_job", claim_job)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        await worker.send(ready=fpb.Ready())
        async with asyncio.timeout(30):
            with pytest.raises(Boom):
                await fleet.scheduler.wait()
