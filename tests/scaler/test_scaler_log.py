"""Decisions as the ledger records them, against the SaladCloud double: an action's time is
when it took effect (cooldowns count from there), and a `scaler-log` row stands for identical
consecutive decisions of one scaler, never for two incidents or two scalers."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

import pytest

from lorafleet.scaler.policy import Action, PolicyConfig
from lorafleet.scaler.provider import StillWanted
from lorafleet.scaler.salad import SaladConfig, SaladProvider
from tests.scaler.test_scenarios import World, applied
from tests.support.jobs import WAIT_S

SLOW_CALL_S = 45.0


class SlowScale(SaladProvider):
    """A PATCH that took its time (retries until it went through): the clock moves meanwhile."""

    def __init__(self, config: SaladConfig, advance: Callable[[float], None]) -> None:
        super().__init__(config)
        self._advance = advance

    async def scale_to(
        self, replicas: int, *, remove: Sequence[str] = (), still_wanted: StillWanted | None = None
    ) -> None:
        self._advance(SLOW_CALL_S)
        await super().scale_to(replicas, remove=remove, still_wanted=still_wanted)


@pytest.mark.parametrize("world", [0.0], indirect=True)
async def test_the_cooldown_counts_from_when_the_scale_took_effect(world: World) -> None:
    policy = PolicyConfig(max_replicas=4, idle_grace_s=0, cooldown_s=15)
    scaler = world.scaler(policy, provider=SlowScale(world.salad_config(), world.advance))
    await scaler.acquire()
    jobs = await world.submit(2)
    started = world.clock()
    (scale,) = applied(await scaler.tick(), Action.SCALE)
    assert scale.decision.replicas == 2 and world.double.replicas == 2
    [row] = [r for r in await world.ledger.list_scaler_decisions(5) if r.action == "scale"]
    # The row says when the replicas changed, not when the tick began.
    assert abs(row.at.timestamp() - (started + SLOW_CALL_S)) < 1.0

    # One job goes away 5 s after the PATCH: within the cooldown, the fleet is kept.
    await world.alice.cancel(jobs[0])
    world.advance(5)
    outcomes = await scaler.tick()
    assert not applied(outcomes, Action.SCALE), [o.decision.reason for o in outcomes]
    assert world.double.replicas == 2
    hold = next(o for o in outcomes if o.decision.action is Action.HOLD)
    assert "cooldown" in hold.decision.reason

    world.advance(policy.cooldown_s)
    (scale,) = applied(await scaler.tick(), Action.SCALE)
    assert scale.decision.replicas == 1


@pytest.mark.parametrize("world", [0.0], indirect=True)
async def test_a_401_and_a_later_404_are_two_rows(world: World) -> None:
    scaler = world.scaler(PolicyConfig(max_replicas=2))
    await scaler.acquire()
    key = world.double.api_key
    world.double.api_key = "rotated"
    for _ in range(2):
        (held,) = await scaler.tick()
        assert held.provider_failed and "401" in (held.error or "")
    world.double.api_key, group = key, world.double.group
    world.double.group = "renamed"
    (held,) = await scaler.tick()
    assert held.provider_failed and "404" in (held.error or "") and not held.folded
    world.double.group = group
    rows = [r for r in await world.ledger.list_scaler_decisions(10) if r.target == "provider"]
    assert [(r.repeats, "404" in (r.error or ""), "401" in (r.error or "")) for r in rows] == [
        (1, True, False),
        (2, False, True),
    ]


@pytest.mark.parametrize("world", [0.0], indirect=True)
async def test_outages_with_healthy_ticks_between_are_two_rows_of_their_scalers(
    world: World,
) -> None:
    policy = PolicyConfig(max_replicas=2)
    first = world.scaler(policy, scaler_id="first")
    await first.acquire()
    world.double.inject("500", count=1_000_000)
    for _ in range(2):
        (held,) = await first.tick()
        assert held.provider_failed
    world.double.faults.clear()
    assert await first.tick() == []  # healthy, nothing to do
    world.double.inject("500", count=1_000_000)
    (again,) = await first.tick()
    assert again.provider_failed and not again.folded

    # Another scaler takes over during the same outage: its holds are its own rows.
    await first.close()
    second = world.scaler(policy, scaler_id="second")
    await second.acquire()
    (taken,) = await second.tick()
    assert not taken.folded
    world.double.faults.clear()

    rows = [r for r in await world.ledger.list_scaler_decisions(10) if r.target == "provider"]
    assert [(r.scaler_id, r.repeats) for r in rows] == [("second", 1), ("first", 1), ("first", 2)]


class Patient(SaladProvider):
    """The world's provider with a deadline long enough to retry several times; `scaling` is
    set when a scale begins."""

    def __init__(self, world: World, *, deadline_s: float) -> None:
        config = dataclasses.replace(
            world.salad_config(), deadline_s=deadline_s, initial_backoff_s=0.05, max_backoff_s=0.1
        )
        super().__init__(config)
        self.scaling = asyncio.Event()

    async def scale_to(
        self, replicas: int, *, remove: Sequence[str] = (), still_wanted: StillWanted | None = None
    ) -> None:
        self.scaling.set()
        await super().scale_to(replicas, remove=remove, still_wanted=still_wanted)


@pytest.mark.parametrize("world", [0.0], indirect=True)
async def test_a_scale_up_retried_past_its_reason_is_withdrawn(world: World) -> None:
    """The PATCH keeps failing (429/500); the job is cancelled meanwhile. Before its next try
    the scaler reads the work again, finds nothing queued and gives the scale-up up: no replica
    is added (a cold start and a cooldown for nothing) and its row says why."""
    provider = Patient(world, deadline_s=30.0)
    scaler = world.scaler(PolicyConfig(max_replicas=2, idle_grace_s=0), provider=provider)
    await scaler.acquire()
    (job,) = await world.submit(1)
    world.double.inject("500", count=1_000_000, match="PATCH")
    ticking = asyncio.ensure_future(scaler.tick())
    await asyncio.wait_for(provider.scaling.wait(), WAIT_S)
    await world.alice.cancel(job)
    outcomes = await asyncio.wait_for(ticking, WAIT_S)
    (scale,) = [o for o in outcomes if o.decision.action is Action.SCALE]
    assert not scale.applied and (scale.error or "").startswith("withdrawn:"), scale.error
    assert "no job is queued" in (scale.error or "")
    assert world.double.replicas == 0
    [row] = [r for r in await world.ledger.list_scaler_decisions(5) if r.action == "scale"]
    assert not row.applied and "withdrawn" in (row.error or "")


@pytest.mark.parametrize("world", [0.0], indirect=True)
async def test_a_tick_that_spent_most_of_its_deadline_retrying_leaves_a_row(world: World) -> None:
    """The provider answered, but only after retries that took most of a call's deadline: the
    tick leaves a `scaler-log` row on the provider saying so (before, a long hang that ended
    well left no row at all)."""
    scaler = world.scaler(PolicyConfig(max_replicas=2), provider=Patient(world, deadline_s=1.0))
    await scaler.acquire()
    world.double.inject("429", count=4, retry_after="0.15", match="GET")
    outcomes = await scaler.tick()
    (slow,) = [o for o in outcomes if o.decision.target == "provider"]
    assert not slow.provider_failed and not slow.applied
    assert "retrying" in slow.decision.reason and "5 attempts" in slow.decision.reason
    rows = [r for r in await world.ledger.list_scaler_decisions(5) if r.target == "provider"]
    assert len(rows) == 1 and "retrying" in rows[0].reason
    assert await scaler.tick() == []  # a quick tick adds nothing
