"""The SaladCloud provider against a double that takes its time as the platform does: instances
stop for a while before they leave or move, the platform reallocates on its own, and the double
answers as the published description says (reading an instance: 202; errors: ProblemDetails)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import requests

from lorafleet.scaler.provider import InstanceState
from lorafleet.scaler.salad import SaladConfig, SaladProvider
from tests.scaler.salad_double import PREFIX, SaladDouble

pytestmark = pytest.mark.timeout(60)

STOP_S = 45.0
STOPPING, STARTING, RUNNING = InstanceState.STOPPING, InstanceState.STARTING, InstanceState.RUNNING


@pytest.fixture
async def double() -> AsyncIterator[SaladDouble]:
    d = SaladDouble(cold_start_s=60.0, stop_s=STOP_S)
    await d.start()
    yield d
    await d.close()


def provider(double: SaladDouble, base_url: str | None = None) -> SaladProvider:
    return SaladProvider(
        SaladConfig(
            organization=double.org,
            project=double.project,
            group=double.group,
            api_key=double.api_key,
            base_url=base_url or double.base_url,
            request_timeout_s=0.5,
            deadline_s=2.0,
            initial_backoff_s=0.01,
            max_backoff_s=0.05,
        )
    )


async def test_a_base_url_with_a_trailing_slash_names_the_same_group(double: SaladDouble) -> None:
    p = provider(double, double.base_url + "/")
    await p.scale_to(1)
    assert await p.replicas() == 1 and len(await p.list_instances()) == 1


async def test_scale_in_passes_through_stopping_and_leaves_later(double: SaladDouble) -> None:
    p = provider(double)
    await p.scale_to(3)
    double.advance(60)
    a, b, c = await p.list_instances()
    for i in (a, b, c):
        await p.set_deletion_cost(i.instance_id, 1)
    await p.scale_to(1, remove=[a.instance_id, c.instance_id])
    # Still listed and counted while they stop: the group has 1 replica and 3 instances.
    states = {i.instance_id: i.state for i in await p.list_instances()}
    assert states == {a.instance_id: STOPPING, b.instance_id: RUNNING, c.instance_id: STOPPING}
    assert await p.replicas() == 1
    double.advance(STOP_S - 1)
    assert len(await p.list_instances()) == 3
    double.advance(1)
    assert [i.instance_id for i in await p.list_instances()] == [b.instance_id]
    assert ("removed", a.instance_id) in double.actions


async def test_a_reallocation_stops_then_comes_back_on_another_machine(
    double: SaladDouble,
) -> None:
    p = provider(double)
    await p.scale_to(2)
    double.advance(60)
    a, b = await p.list_instances()
    await p.reallocate(a.instance_id)  # the scaler's
    double.platform_reallocate(b.instance_id)  # the platform's own
    listed = {i.instance_id: i for i in await p.list_instances()}
    assert {i.state for i in listed.values()} == {STOPPING}
    assert listed[a.instance_id].machine_id == a.machine_id  # still on its old node
    assert listed[b.instance_id].deletion_cost == b.deletion_cost
    double.advance(STOP_S)
    back = {i.instance_id: i for i in await p.list_instances()}
    assert {i.state for i in back.values()} == {STARTING}
    assert back[a.instance_id].machine_id != a.machine_id
    assert back[b.instance_id].machine_id != b.machine_id
    assert double.actions.count(("reallocate", a.instance_id)) == 1  # sent once


async def test_a_scale_in_picks_among_stopping_instances_too(double: SaladDouble) -> None:
    """The platform's own choice, which the policy must never leave to it: a tie in deletion
    cost between a busy node and a stopping one goes to the older listed one."""
    p = provider(double)
    await p.scale_to(2)
    double.advance(60)
    a, b = await p.list_instances()
    for i in (a, b):
        await p.set_deletion_cost(i.instance_id, 100_000)
    double.platform_reallocate(b.instance_id)
    await p.scale_to(1)  # nothing named
    states = {i.instance_id: i.state for i in await p.list_instances()}
    assert states == {a.instance_id: STOPPING, b.instance_id: STOPPING}
    double.advance(STOP_S)
    assert [i.instance_id for i in await p.list_instances()] == [b.instance_id]


def _get(double: SaladDouble, path: str, key: str | None = None) -> requests.Response:
    base = double.base_url.removesuffix("/api/public")
    headers = {"Salad-Api-Key": key or double.api_key}
    return requests.get(base + path, headers=headers, timeout=5)


async def test_the_double_answers_as_the_published_description(double: SaladDouble) -> None:
    p = provider(double)
    await p.scale_to(1)
    (inst,) = await p.list_instances()
    group = PREFIX.format(org=double.org, project=double.project, group=double.group)
    read = await asyncio.to_thread(_get, double, f"{group}/instances/{inst.instance_id}")
    assert read.status_code == 202 and read.json()["id"] == inst.instance_id
    for path, key, status in [
        (f"{group}/instances/00000000-0000-4000-8000-000000000000", None, 404),
        (PREFIX.format(org=double.org, project=double.project, group="nope"), None, 404),
        (group, "wrong", 401),
    ]:
        answer = await asyncio.to_thread(_get, double, path, key)
        assert answer.status_code == status
        assert answer.headers["Content-Type"].startswith("application/json")
        problem = answer.json()
        assert problem["status"] == status and problem["title"] and problem["detail"]
