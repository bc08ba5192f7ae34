"""The EC2 spot provider against a moto server on loopback (real HTTP, boto3 as in production)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from lorafleet.scaler.ec2 import FLEET_TAG, Ec2Config, Ec2SpotProvider
from lorafleet.scaler.provider import InstanceState, ProviderError, ProviderRejected

# moto's EC2 backend takes seconds a call: slow, not in the fast lane (README, Development).
# moto's server starts in a subprocess: beside another suite that took over 60 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REGION = "us-east-1"


@pytest.fixture(scope="module")
def moto_ec2() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def client(endpoint: str) -> Any:
    return boto3.client(
        "ec2",
        region_name=REGION,
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture
def ec2(moto_ec2: str) -> Any:
    return client(moto_ec2)


@pytest.fixture
def template(ec2: Any) -> str:
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    created = ec2.create_launch_template(
        LaunchTemplateName=f"lorafleet-{uuid.uuid4().hex[:8]}",
        LaunchTemplateData={"ImageId": image, "InstanceType": "g5.xlarge"},
    )
    return str(created["LaunchTemplate"]["LaunchTemplateId"])


def provider(endpoint: str, template: str, fleet: str, **kw: Any) -> Ec2SpotProvider:
    return Ec2SpotProvider(
        Ec2Config(
            region=REGION,
            launch_template_id=template,
            fleet=fleet,
            endpoint_url=endpoint,
            access_key_id="testing",
            secret_access_key="testing",
            max_attempts=1,
            **kw,
        )
    )


def fleet_name() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def bystanders(ec2: Any, template: str) -> list[str]:
    """An untagged instance and one of another fleet: the provider must never touch them."""
    plain = ec2.run_instances(LaunchTemplate={"LaunchTemplateId": template}, MinCount=1, MaxCount=1)
    other = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": template},
        MinCount=1,
        MaxCount=1,
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": FLEET_TAG, "Value": "someone-else"}]}
        ],
    )
    return [plain["Instances"][0]["InstanceId"], other["Instances"][0]["InstanceId"]]


def state_of(ec2: Any, ids: list[str]) -> list[str]:
    found = ec2.describe_instances(InstanceIds=ids)
    by_id = {
        i["InstanceId"]: i["State"]["Name"] for r in found["Reservations"] for i in r["Instances"]
    }
    return [by_id[i] for i in ids]


async def test_launches_tagged_spot_instances_and_counts_them(
    moto_ec2: str, ec2: Any, template: str
) -> None:
    others = bystanders(ec2, template)
    fleet = fleet_name()
    p = provider(moto_ec2, template, fleet)
    assert await p.replicas() == 0
    await p.scale_to(3)
    listed = await p.list_instances()
    assert len(listed) == 3 and await p.replicas() == 3
    assert all(i.state in (InstanceState.STARTING, InstanceState.RUNNING) for i in listed)
    assert all(i.machine_id == i.instance_id and i.deletion_cost is None for i in listed)
    described = ec2.describe_instances(InstanceIds=[i.instance_id for i in listed])
    for reservation in described["Reservations"]:
        for inst in reservation["Instances"]:
            assert {"Key": FLEET_TAG, "Value": fleet} in inst["Tags"]
            assert inst.get("InstanceLifecycle") == "spot"
    assert not {i.instance_id for i in listed} & set(others)
    await p.scale_to(3)  # already there
    assert await p.replicas() == 3


async def test_terminates_only_the_named_instances(moto_ec2: str, ec2: Any, template: str) -> None:
    others = bystanders(ec2, template)
    p = provider(moto_ec2, template, fleet_name())
    await p.scale_to(3)
    a, b, c = (i.instance_id for i in await p.list_instances())
    await p.scale_to(1, remove=[a, c])
    assert [
        i.instance_id for i in await p.list_instances() if i.state is not InstanceState.STOPPING
    ] == [b]
    assert state_of(ec2, [a, c]) in (["shutting-down"] * 2, ["terminated"] * 2)
    assert state_of(ec2, others) == ["running", "running"]
    # Shrinking without naming victims picks none.
    await p.scale_to(0)
    assert state_of(ec2, [b]) == ["running"]


async def test_never_touches_instances_it_did_not_launch(
    moto_ec2: str, ec2: Any, template: str
) -> None:
    others = bystanders(ec2, template)
    p = provider(moto_ec2, template, fleet_name())
    await p.scale_to(1)
    for victim in others:
        with pytest.raises(ProviderError, match="not this fleet"):
            await p.scale_to(0, remove=[victim])
        with pytest.raises(ProviderError, match="not this fleet"):
            await p.reallocate(victim)
    await p.stop(timeout_s=1)
    assert state_of(ec2, others) == ["running", "running"]
    assert await p.replicas() == 0


async def test_reallocate_replaces_the_instance(moto_ec2: str, ec2: Any, template: str) -> None:
    p = provider(moto_ec2, template, fleet_name())
    await p.scale_to(2)
    first = [i.instance_id for i in await p.list_instances()]
    await p.reallocate(first[0])
    await p.restart(first[1])
    live = [
        i.instance_id for i in await p.list_instances() if i.state is not InstanceState.STOPPING
    ]
    assert len(live) == 2 and first[0] not in live and first[1] in live


async def test_a_missing_subnet_is_a_clear_error(moto_ec2: str, template: str) -> None:
    p = provider(moto_ec2, template, fleet_name(), subnet_id="subnet-0123456789abcdef0")
    with pytest.raises(ProviderRejected, match="InvalidSubnetID") as caught:
        await p.scale_to(1)
    assert not caught.value.retryable
    assert "launch template" in str(caught.value)
