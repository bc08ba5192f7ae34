"""The scaler's metrics endpoint: decisions by action move with the scaler's ticks."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.core.telemetry import MetricsServer
from lorafleet.scaler.policy import Action, PolicyConfig
from tests.scaler import test_scenarios
from tests.scaler.test_scenarios import World, applied
from tests.support.jobs import WAIT_S

pytestmark = pytest.mark.timeout(120)
# The scenario tests' world: a real scheduler, the Salad double, a simulated clock.
world = test_scenarios.world


@pytest.fixture
async def endpoint() -> AsyncIterator[MetricsServer]:
    # As `lorafleet scaler` starts it with --metrics-port (app/services.py).
    server = MetricsServer(host="127.0.0.1", port=0)
    await server.start()
    yield server
    await server.close()


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_decisions_by_action_are_counted(world: World, endpoint: MetricsServer) -> None:
    scale = ("lorafleet_scaler_decisions_total", (("action", "scale"), ("outcome", "applied")))
    ticks = ("lorafleet_scaler_ticks_total", ())
    before = await scrape(endpoint.port)
    scaler = world.scaler(PolicyConfig(max_replicas=3, idle_grace_s=600, cooldown_s=300))
    await scaler.acquire()
    assert (await scrape(endpoint.port))[("lorafleet_scaler_active", ())] == 1
    await world.submit(5, max_train_steps=10)
    outcomes = await scaler.tick()
    assert len(applied(outcomes, Action.SCALE)) == 1
    after = await scrape(endpoint.port)
    assert after[scale] - before.get(scale, 0) == 1
    assert after[ticks] - before.get(ticks, 0) == 1
