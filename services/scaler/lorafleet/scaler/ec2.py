"""EC2 spot instances as a `Provider`, through boto3.

Workers are launched from a launch template (the AMI, instance type, IAM profile, user data
that starts `python -m lorafleet.worker` are the operator's, in the template) as one-time spot
instances, each tagged `lorafleet:fleet=<fleet>`. Every read filters on that tag and every
terminate or reboot first checks it, so the scaler never touches an instance it did not launch.

There is no deletion cost on EC2: the policy names the idle instances a scale-in removes
(`scale_to(n, remove=...)`) and this provider terminates exactly those; it never picks victims
itself. A reallocation is a terminate plus a fresh launch (a new spot instance is a new node).
Workers report their EC2 instance id as their machine id, so instances and nodes join on it.

boto3 blocks, so each call runs in a thread. Throttling and 5xx are retried by botocore's
"standard" retry mode (exponential backoff with jitter, like `core.retry`, as the S3 store
does); what is still failing afterwards, and a lack of spot capacity, is `ProviderUnavailable`
(the next tick tries again); a refused credential, a missing launch template or another
invalid request is `ProviderRejected`.

IAM permissions the scaler needs: ec2:RunInstances, ec2:CreateTags (on launch),
ec2:DescribeInstances, ec2:TerminateInstances, ec2:RebootInstances, and iam:PassRole for the
template's instance profile (conditions on the `lorafleet:fleet` tag can scope the last three).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import boto3
import structlog
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from lorafleet.scaler.provider import (
    LIVE_STATES,
    Instance,
    InstanceState,
    ProviderError,
    ProviderRejected,
    ProviderUnavailable,
    StillWanted,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

FLEET_TAG = "lorafleet:fleet"

_STATES = {
    "pending": InstanceState.STARTING,
    "running": InstanceState.RUNNING,
    "stopping": InstanceState.STOPPING,
    "shutting-down": InstanceState.STOPPING,
    "stopped": InstanceState.STOPPED,
}
# Errors that say "not now" rather than "not like this".
_CAPACITY = frozenset(
    {
        "InsufficientInstanceCapacity",
        "SpotMaxPriceTooLow",
        "MaxSpotInstanceCountExceeded",
        "InsufficientFreeAddressesInSubnet",
        "RequestLimitExceeded",
        "Unavailable",
        "InternalError",
        "ServiceUnavailable",
    }
)


@dataclass(frozen=True, kw_only=True)
class Ec2Config:
    region: str
    launch_template_id: str
    fleet: str
    launch_template_version: str = "$Latest"
    subnet_id: str | None = None
    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    max_attempts: int = 5
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0


class Ec2SpotProvider:
    def __init__(self, config: Ec2Config) -> None:
        self._config = config
        # Typed loosely: the project installs boto3's stubs for S3 only.
        self._client: Any = boto3.client(
            "ec2",
            region_name=config.region,
            endpoint_url=config.endpoint_url,
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            config=Config(
                retries={"mode": "standard", "max_attempts": config.max_attempts},
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
            ),
        )

    @property
    def where(self) -> str:
        c = self._config
        return f"fleet {c.fleet!r} in {c.region}, launch template {c.launch_template_id!r}"

    async def _call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(fn, **kwargs)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            message = f"EC2 {what} ({self.where}): {code}: {error.get('Message', '')}"
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _CAPACITY or (isinstance(status, int) and status >= 500):
                raise ProviderUnavailable(message) from None
            raise ProviderRejected(message, status=status) from None
        except BotoCoreError as exc:
            raise ProviderUnavailable(f"EC2 {what} ({self.where}): {exc}") from None

    async def _described(self, instance_ids: Sequence[str] = ()) -> list[dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "Filters": [
                {"Name": f"tag:{FLEET_TAG}", "Values": [self._config.fleet]},
                {"Name": "instance-state-name", "Values": list(_STATES)},
            ]
        }
        if instance_ids:
            kwargs["InstanceIds"] = list(instance_ids)
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = await self._call(
                "describe instances",
                self._client.describe_instances,
                **kwargs,
                **({"NextToken": token} if token else {}),
            )
            for reservation in page.get("Reservations", []):
                out.extend(reservation.get("Instances", []))
            token = page.get("NextToken")
            if not token:
                return out

    async def _ours(self, instance_ids: Sequence[str]) -> list[str]:
        """The given ids, after checking each carries this fleet's tag (else nothing is done)."""
        if not instance_ids:
            return []
        found = {i["InstanceId"] for i in await self._described()}
        foreign = sorted(set(instance_ids) - found)
        if foreign:
            raise ProviderError(
                f"EC2 ({self.where}): not this fleet's instances (or gone): {foreign};"
                " refusing to touch them",
                retryable=False,
            )
        return list(instance_ids)

    async def list_instances(self) -> list[Instance]:
        return [
            Instance(
                instance_id=i["InstanceId"],
                machine_id=i["InstanceId"],
                state=_STATES[i["State"]["Name"]],
            )
            for i in sorted(await self._described(), key=lambda i: str(i["InstanceId"]))
        ]

    async def replicas(self) -> int:
        return sum(1 for i in await self.list_instances() if i.state in LIVE_STATES)

    async def scale_to(
        self, replicas: int, *, remove: Sequence[str] = (), still_wanted: StillWanted | None = None
    ) -> None:
        if replicas < 0:
            raise ValueError("replicas: must be >= 0")
        await self._terminate(remove)
        live = await self.replicas()
        if replicas > live:
            await self._launch(replicas - live)
        elif replicas < live:
            log.warning(
                "ec2 scale-in needs the instances to remove named; leaving the rest",
                replicas=replicas,
                live=live,
            )

    async def reallocate(self, instance_id: str) -> None:
        await self._terminate([instance_id])
        await self._launch(1)

    async def restart(self, instance_id: str) -> None:
        ids = await self._ours([instance_id])
        await self._call("reboot", self._client.reboot_instances, InstanceIds=ids)

    async def set_deletion_cost(self, instance_id: str, cost: int) -> None:
        """EC2 has no deletion cost: the policy names scale-in victims instead."""

    async def stop(self, *, timeout_s: float) -> None:
        """Terminate every instance of this fleet (the worker gets SIGTERM on shutdown)."""
        del timeout_s
        ids = [i.instance_id for i in await self.list_instances() if i.state in LIVE_STATES]
        if ids:
            await self._call("terminate", self._client.terminate_instances, InstanceIds=ids)

    async def _terminate(self, instance_ids: Sequence[str]) -> None:
        ids = await self._ours(instance_ids)
        if ids:
            await self._call("terminate", self._client.terminate_instances, InstanceIds=ids)
            log.info("ec2 instances terminated", instance_ids=ids)

    async def _launch(self, count: int) -> None:
        c = self._config
        kwargs: dict[str, Any] = {
            "LaunchTemplate": {
                "LaunchTemplateId": c.launch_template_id,
                "Version": c.launch_template_version,
            },
            "MinCount": count,
            "MaxCount": count,
            "InstanceMarketOptions": {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            },
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": [{"Key": FLEET_TAG, "Value": c.fleet}]}
            ],
        }
        if c.subnet_id:
            kwargs["SubnetId"] = c.subnet_id
        try:
            result = await self._call("launch spot instances", self._client.run_instances, **kwargs)
        except ProviderUnavailable:
            if count == 1:
                raise
            # Not enough spot capacity for all of them: take what there is (EC2 launches up
            # to MaxCount with MinCount=1; asking for all first keeps the common case exact).
            kwargs["MinCount"] = 1
            result = await self._call("launch spot instances", self._client.run_instances, **kwargs)
        launched = [i["InstanceId"] for i in result.get("Instances", [])]
        log.info("ec2 spot instances launched", asked=count, instance_ids=launched)
