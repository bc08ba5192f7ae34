"""The SaladCloud provider against the API double over real HTTP on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import requests

from lorafleet.scaler.provider import InstanceState, ProviderRejected, ProviderUnavailable
from lorafleet.scaler.salad import SaladConfig, SaladProvider, retry_after_s
from tests.scaler.salad_double import SaladDouble

pytestmark = pytest.mark.timeout(60)

GROUP_PATH = "/containers/workers"


@pytest.fixture
async def double() -> AsyncIterator[SaladDouble]:
    d = SaladDouble(cold_start_s=600.0)
    await d.start()
    yield d
    await d.close()


Make = Callable[..., SaladProvider]


@pytest.fixture
def make(double: SaladDouble) -> Make:
    def build(**overrides: Any) -> SaladProvider:
        values: dict[str, Any] = dict(
            organization=double.org,
            project=double.project,
            group=double.group,
            api_key=double.api_key,
            base_url=double.base_url,
            request_timeout_s=0.5,
            deadline_s=5.0,
            initial_backoff_s=0.01,
            max_backoff_s=0.05,
        )
        values.update(overrides)
        return SaladProvider(SaladConfig(**values))

    return build


def count(double: SaladDouble, fragment: str) -> int:
    return sum(1 for r in double.requests if fragment in r)


async def test_scale_up_counts_cold_starts_then_running(double: SaladDouble, make: Make) -> None:
    provider = make()
    assert await provider.replicas() == 0
    await provider.scale_to(3)
    assert await provider.replicas() == 3
    listed = await provider.list_instances()
    assert [i.state for i in listed] == [InstanceState.STARTING] * 3
    assert all(i.machine_id and i.deletion_cost == 0 for i in listed)
    double.clock.advance(600)
    assert {i.state for i in await provider.list_instances()} == {InstanceState.RUNNING}
    await provider.scale_to(3)  # already there: no second PATCH
    assert double.actions == [("replicas", "3")]


async def test_scale_in_removes_the_named_idle_instances(double: SaladDouble, make: Make) -> None:
    provider = make()
    await provider.scale_to(3)
    a, b, c = (i.instance_id for i in await provider.list_instances())
    for iid in (a, b, c):
        await provider.set_deletion_cost(iid, 1)
    await provider.set_deletion_cost(b, 100_000)  # leased
    await provider.scale_to(1, remove=[a, c])
    assert [i.instance_id for i in await provider.list_instances()] == [b]
    assert ("removed", a) in double.actions and ("removed", c) in double.actions
    assert (await provider.list_instances())[0].deletion_cost == 100_000


async def test_reallocate_moves_the_instance_to_another_machine(
    double: SaladDouble, make: Make
) -> None:
    provider = make()
    await provider.scale_to(1)
    [before] = await provider.list_instances()
    await provider.reallocate(before.instance_id)
    [after] = await provider.list_instances()
    assert after.instance_id == before.instance_id and after.machine_id != before.machine_id
    await provider.restart(after.instance_id)
    assert [a for a, _ in double.actions] == ["replicas", "reallocate", "restart"]


async def test_a_vanished_node_is_replaced_and_acting_on_it_is_a_no_op(
    double: SaladDouble, make: Make
) -> None:
    provider = make()
    await provider.scale_to(1)
    [gone] = await provider.list_instances()
    double.vanish(gone.instance_id)
    [fresh] = await provider.list_instances()
    assert fresh.instance_id != gone.instance_id
    await provider.reallocate(gone.instance_id)
    await provider.set_deletion_cost(gone.instance_id, 5)
    assert not any(a in ("reallocate", "deletion_cost") for a, _ in double.actions)


async def test_a_stopped_group_counts_zero_and_is_started(double: SaladDouble, make: Make) -> None:
    double.status, double.replicas = "stopped", 2
    provider = make()
    assert await provider.replicas() == 0
    await provider.scale_to(2)
    assert double.status == "running" and ("start", "workers") in double.actions
    assert len(await provider.list_instances()) == 2
    await provider.stop(timeout_s=1)
    assert double.status == "stopped"


async def test_429_waits_for_retry_after(double: SaladDouble, make: Make) -> None:
    provider = make()
    double.inject("429", retry_after="0.3", match="GET")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await provider.replicas() == 0
    # Backoff alone would have waited at most 0.05 s.
    assert loop.time() - started >= 0.3
    assert count(double, "GET") == 2


def test_retry_after_as_seconds_or_http_date() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    assert retry_after_s("7", now=now) == 7.0
    assert retry_after_s(format_datetime(now + timedelta(seconds=30), usegmt=True), now=now) == 30
    assert retry_after_s("soon", now=now) is None
    assert retry_after_s(None) is None


async def test_500_is_retried_and_the_change_made_once(double: SaladDouble, make: Make) -> None:
    provider = make()
    double.inject("500", 2, match="PATCH")
    await provider.scale_to(2)
    assert count(double, "PATCH") == 3
    assert double.actions == [("replicas", "2")]


async def test_a_timeout_is_retried(double: SaladDouble, make: Make) -> None:
    provider = make(request_timeout_s=0.3)
    double.inject("slow", delay_s=1.0, match="GET")
    assert await provider.replicas() == 0
    assert count(double, "GET") == 2


async def test_a_reallocate_whose_answer_is_lost_is_not_sent_twice(
    double: SaladDouble, make: Make
) -> None:
    provider = make(request_timeout_s=0.3)
    await provider.scale_to(1)
    [inst] = await provider.list_instances()
    double.inject("slow", delay_s=1.0, match="/reallocate")
    await provider.reallocate(inst.instance_id)
    assert [a for a, _ in double.actions].count("reallocate") == 1


async def test_a_reallocate_refused_with_500_is_sent_again(double: SaladDouble, make: Make) -> None:
    provider = make()
    await provider.scale_to(1)
    [inst] = await provider.list_instances()
    double.inject("500", 2, match="/reallocate")
    await provider.reallocate(inst.instance_id)
    assert count(double, "/reallocate") == 3
    assert [a for a, _ in double.actions].count("reallocate") == 1


async def test_unknown_group_is_a_clear_error_at_once(double: SaladDouble, make: Make) -> None:
    provider = make(group="nope")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProviderRejected) as caught:
        await provider.scale_to(1)
    assert loop.time() - started < 1.0
    assert caught.value.status == 404 and not caught.value.retryable
    message = str(caught.value)
    assert "'acme'" in message and "'fleet'" in message and "'nope'" in message
    assert "no such container group" in message
    assert len(double.requests) == 1 and not double.actions


async def test_a_refused_key_is_a_clear_error_at_once(double: SaladDouble, make: Make) -> None:
    provider = make(api_key="wrong")
    with pytest.raises(ProviderRejected, match="SALAD_API_KEY") as caught:
        await provider.list_instances()
    assert caught.value.status == 401
    assert len(double.requests) == 1


async def test_an_outage_ends_at_the_deadline_and_changes_nothing(
    double: SaladDouble, make: Make
) -> None:
    provider = make(deadline_s=0.5)
    await provider.scale_to(1)
    [inst] = await provider.list_instances()
    before = list(double.actions)
    double.inject("500", 10_000)
    loop = asyncio.get_running_loop()
    for call in (
        provider.scale_to(4),
        provider.reallocate(inst.instance_id),
        provider.set_deletion_cost(inst.instance_id, 9),
    ):
        started = loop.time()
        with pytest.raises(ProviderUnavailable) as caught:
            await call
        # The deadline, plus at most one request's timeout.
        assert loop.time() - started < 0.5 + 0.5 + 0.2
        assert caught.value.retryable
    assert double.actions == before and double.replicas == 1
    double.faults.clear()
    await provider.scale_to(2)
    assert double.replicas == 2


async def test_an_outage_shorter_than_the_deadline_is_ridden_out(
    double: SaladDouble, make: Make
) -> None:
    provider = make(deadline_s=5.0)
    double.inject("500", 3)
    double.inject("429", 2, retry_after="0.05")
    await provider.scale_to(2)
    assert double.actions == [("replicas", "2")]


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        ({"replicas": 2}, "application/merge-patch+json", 200),
        ({"replicas": "two"}, "application/merge-patch+json", 400),
        ({"replicas": 501}, "application/merge-patch+json", 400),
        ({"replicas": True}, "application/merge-patch+json", 400),
        ({"replicaz": 2}, "application/merge-patch+json", 400),
        ({"replicas": 2}, "application/json", 415),
    ],
)
async def test_the_double_parses_bodies_with_the_sdk_models(
    double: SaladDouble, body: dict[str, Any], content_type: str, status: int
) -> None:
    url = f"{double.base_url}/organizations/acme/projects/fleet/containers/workers"

    def patch() -> int:
        headers = {"Salad-Api-Key": double.api_key, "Content-Type": content_type}
        return requests.patch(url, json=body, headers=headers, timeout=5).status_code

    assert await asyncio.to_thread(patch) == status


async def test_policy_decisions_carried_out_on_salad(double: SaladDouble, make: Make) -> None:
    """One tick end to end: snapshot from the provider, decide, apply."""
    from lorafleet.scaler.actions import apply
    from lorafleet.scaler.policy import NodeView, PolicyConfig, Snapshot, decide

    provider = make()
    await provider.scale_to(2)
    double.clock.advance(600)
    a, b = await provider.list_instances()
    snapshot = Snapshot(
        now=0.0,
        replicas=await provider.replicas(),
        instances=(a, b),
        nodes=(
            NodeView(machine_id=a.machine_id, lease_job_id="j1", verified=True),
            NodeView(machine_id=b.machine_id, qualified=False, verified=True),
        ),
        running_jobs=1,
    )
    decisions = decide(snapshot, PolicyConfig())
    for decision in decisions:
        await apply(provider, decision)
    assert [(d.action.value, d.target) for d in decisions] == [
        ("reallocate", b.instance_id),
        ("hold", "fleet"),  # one job, two instances: but the surplus one is moving
        ("set_deletion_cost", a.instance_id),
    ]
    assert ("reallocate", b.instance_id) in double.actions
    costs = {i.instance_id: i.deletion_cost for i in await provider.list_instances()}
    assert costs[a.instance_id] == 100_000
