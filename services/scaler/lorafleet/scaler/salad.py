"""SaladCloud container groups as a `Provider`, through the official `salad-cloud-sdk`.

One container group is the fleet: its `replicas` is the desired worker count, its instances
(with the machine id each worker reports) are the nodes, and an instance's `deletion_cost`
steers which instances a scale-in removes (lowest first).

The SDK is synchronous (requests), so every call runs in a thread (`asyncio.to_thread`). It is
fit for the job, with one part replaced: its request chain. The SDK's own `RetryHandler`
retries 5xx and timeouts three times with its own blocking sleeps, retries the POST actions
(reallocate, restart) blindly after a timeout, does not retry 429 and ignores `Retry-After`.
`_ContainerGroups` keeps the SDK's hook and HTTP handlers (its models, paths, timeout and
error types) and drops that one handler, so that this module's rule applies alone:

* every call is retried on 429, 408/timeouts, 5xx and connection errors, waiting
  `Retry-After` when the server gives one and `core.retry.backoff_delay` otherwise, until the
  call's deadline (`deadline_s`; a single attempt is bounded by `request_timeout_s`); past it,
  `ProviderUnavailable` (retryable: the next tick tries again);
* 401, 403, 404 of the group and any other 4xx raise `ProviderRejected` at once, naming the
  organization, project and group, and saying what to check; the service reports it instead
  of crash-looping;
* the instance actions (reallocate, restart, recreate) are not idempotent: after a failure
  that may have happened anyway (a timeout, a 5xx), the instance is read again, and a changed
  machine id or state time means the action took effect: it is not sent a second time.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import requests
import structlog

# The SDK ships no type information (no py.typed).
from salad_cloud_sdk.models import (
    ContainerGroupInstancePatch,
    ContainerGroupPatch,
)
from salad_cloud_sdk.net.request_chain.handlers.hook_handler import (
    HookHandler,
)
from salad_cloud_sdk.net.request_chain.handlers.http_handler import (
    HttpHandler,
)
from salad_cloud_sdk.net.request_chain.request_chain import (
    RequestChain,
)
from salad_cloud_sdk.net.transport.api_error import ApiError
from salad_cloud_sdk.services.container_groups import (
    ContainerGroupsService,
)

from lorafleet.core.retry import backoff_delay
from lorafleet.scaler.provider import (
    ActionWithdrawn,
    Instance,
    InstanceState,
    ProviderError,
    ProviderRejected,
    ProviderUnavailable,
    SlowCall,
    StillWanted,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_BASE_URL = "https://api.salad.com/api/public"

_STATES = {
    "allocating": InstanceState.STARTING,
    "downloading": InstanceState.STARTING,
    "creating": InstanceState.STARTING,
    "running": InstanceState.RUNNING,
    "stopping": InstanceState.STOPPING,
}
_STOPPED_GROUP = frozenset({"stopped", "failed", "succeeded"})


class _ContainerGroups(ContainerGroupsService):  # type: ignore[misc]
    """The SDK's container-group service without its built-in retries (see the module doc)."""

    def _get_request_handler(self) -> Any:
        return RequestChain().add_handler(HookHandler()).add_handler(HttpHandler(self._timeout))


@dataclass(frozen=True, kw_only=True)
class SaladConfig:
    organization: str
    project: str
    group: str
    api_key: str = field(repr=False)
    base_url: str = DEFAULT_BASE_URL
    request_timeout_s: float = 10.0
    deadline_s: float = 60.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0


def retry_after_s(value: str | None, *, now: datetime | None = None) -> float | None:
    """`Retry-After` as seconds (a number or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


@dataclass(frozen=True, kw_only=True)
class _Failure:
    retryable: bool
    status: int | None
    retry_after_s: float | None
    text: str


def _classify(exc: BaseException) -> _Failure:
    if isinstance(exc, ApiError):
        status = getattr(exc, "status", None)
        response = getattr(exc, "response", None)
        headers = getattr(response, "headers", None) or {}
        detail = getattr(exc, "detail", None) or getattr(exc, "title", None) or ""
        text = f"HTTP {status}" + (f": {detail}" if detail else "")
        if status == 408:
            text = "timed out"
        retryable = status is not None and (status in (408, 429) or status >= 500)
        return _Failure(
            retryable=retryable,
            status=status,
            retry_after_s=retry_after_s(headers.get("Retry-After")),
            text=text,
        )
    if isinstance(exc, requests.RequestException):
        return _Failure(retryable=True, status=None, retry_after_s=None, text=repr(exc))
    return _Failure(retryable=False, status=None, retry_after_s=None, text=repr(exc))


class SaladProvider:
    def __init__(self, config: SaladConfig, *, rng: random.Random | None = None) -> None:
        self._config = config
        self._rng = rng
        # The SDK joins base URL and path as strings: "…/public/" + "/organizations" would
        # name no container group at all.
        self._service = _ContainerGroups(base_url=config.base_url.rstrip("/"))
        self._service.set_api_key(config.api_key)
        self._service.set_timeout(max(1, int(config.request_timeout_s * 1000)))
        self._slow_calls: list[SlowCall] = []

    @property
    def where(self) -> str:
        c = self._config
        return f"organization {c.organization!r}, project {c.project!r}, group {c.group!r}"

    def _rejected(self, what: str, failure: _Failure) -> ProviderError:
        hint = {
            401: "the API key was refused: check SALAD_API_KEY",
            403: "the API key may not do this: check its organization and role",
            404: "no such container group: check the organization, project and group names",
        }.get(failure.status or 0, "SaladCloud refused the request")
        if failure.status is None:
            hint = "the request could not be made or its answer not read"
        message = f"SaladCloud {what} ({self.where}): {failure.text}; {hint}"
        if failure.status is None:
            return ProviderError(message, retryable=False)
        return ProviderRejected(message, status=failure.status)

    async def _call(
        self,
        what: str,
        fn: Callable[..., T],
        *args: Any,
        deadline: float | None = None,
        still_wanted: StillWanted | None = None,
    ) -> T:
        """`fn(*args)` in a thread, retried on transient failures until the deadline; before
        each retry `still_wanted()` (when given) may withdraw the call (`ActionWithdrawn`)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if deadline is None:
            deadline = started + self._config.deadline_s
        attempt = 0
        last_error = ""
        answered = False
        try:
            while True:
                try:
                    result = await asyncio.to_thread(fn, *args)
                    answered = True
                    return result
                except Exception as exc:
                    failure = _classify(exc)
                    last_error = failure.text
                    if not failure.retryable:
                        raise self._rejected(what, failure) from None
                    delay = self._delay(attempt, failure)
                    if loop.time() + delay > deadline:
                        raise ProviderUnavailable(
                            f"SaladCloud {what} ({self.where}): still failing after"
                            f" {attempt + 1} attempts: {failure.text}"
                        ) from None
                    log.warning(
                        "salad call failed; retrying",
                        call=what,
                        error=failure.text,
                        attempt=attempt + 1,
                        retry_in_s=round(delay, 3),
                    )
                    await asyncio.sleep(delay)
                    attempt += 1
                    why_not = await still_wanted() if still_wanted is not None else None
                    if why_not is not None:
                        raise ActionWithdrawn(
                            f"SaladCloud {what}: withdrawn after {attempt} failed attempts"
                            f" ({loop.time() - started:.0f} s): {why_not}"
                        ) from None
        finally:
            # A call that went through after retries (one that failed has its own row).
            if answered and attempt > 0:
                self._slow_calls.append(
                    SlowCall(
                        what=what,
                        seconds=loop.time() - started,
                        attempts=attempt + 1,
                        error=last_error[:300],
                        deadline_s=deadline - started,
                    )
                )

    def take_slow_calls(self) -> list[SlowCall]:
        """The calls that needed retries since the last take (the service reads them after each
        tick: one that spent much of its deadline retrying gets a `scaler-log` row)."""
        calls, self._slow_calls = self._slow_calls, []
        return calls

    def _delay(self, attempt: int, failure: _Failure) -> float:
        if failure.retry_after_s is not None:
            return failure.retry_after_s
        c = self._config
        return backoff_delay(
            attempt, initial_s=c.initial_backoff_s, max_s=c.max_backoff_s, rng=self._rng
        )

    def _path(self) -> tuple[str, str, str]:
        c = self._config
        return c.organization, c.project, c.group

    async def _group(self) -> Any:
        return await self._call(
            "get container group", self._service.get_container_group, *self._path()
        )

    async def replicas(self) -> int:
        group = await self._group()
        if _text(group.current_state.status) in _STOPPED_GROUP:
            return 0
        return int(group.replicas)

    async def list_instances(self) -> list[Instance]:
        listed = await self._call(
            "list instances", self._service.list_container_group_instances, *self._path()
        )
        return [_instance(i) for i in listed.instances]

    async def scale_to(
        self, replicas: int, *, remove: Sequence[str] = (), still_wanted: StillWanted | None = None
    ) -> None:
        if not 0 <= replicas <= 500:
            raise ValueError("replicas: SaladCloud allows 0 to 500")
        group = await self._group()
        # Scale-in removes the lowest deletion cost first: the chosen ones go to the bottom.
        for instance_id in remove:
            await self.set_deletion_cost(instance_id, 0)
        if int(group.replicas) != replicas:
            await self._call(
                f"set replicas to {replicas}",
                self._service.update_container_group,
                ContainerGroupPatch(replicas=replicas),
                *self._path(),
                still_wanted=still_wanted,
            )
        if replicas > 0 and _text(group.current_state.status) in _STOPPED_GROUP:
            await self._call("start group", self._service.start_container_group, *self._path())

    async def set_deletion_cost(self, instance_id: str, cost: int) -> None:
        try:
            await self._call(
                f"set deletion cost of {instance_id}",
                self._service.update_container_group_instance,
                ContainerGroupInstancePatch(deletion_cost=cost),
                *self._path(),
                instance_id,
            )
        except ProviderRejected:
            if await self._instance(instance_id) is None:
                log.info("instance gone; no deletion cost to set", instance_id=instance_id)
                return
            raise

    async def reallocate(self, instance_id: str) -> None:
        await self._instance_action(
            "reallocate", self._service.reallocate_container_group_instance, instance_id
        )

    async def restart(self, instance_id: str) -> None:
        await self._instance_action(
            "restart", self._service.restart_container_group_instance, instance_id
        )

    async def recreate(self, instance_id: str) -> None:
        """Recreate the container on its node (SaladCloud only: a fresh container filesystem)."""
        await self._instance_action(
            "recreate", self._service.recreate_container_group_instance, instance_id
        )

    async def stop(self, *, timeout_s: float) -> None:
        """Stop the whole group (SaladCloud sends every instance SIGTERM)."""
        del timeout_s  # the platform's own grace period applies
        await self._call("stop group", self._service.stop_container_group, *self._path())

    async def _instance(self, instance_id: str, *, deadline: float | None = None) -> Any | None:
        """The instance, or None when it is gone (a 404 while its group exists)."""
        try:
            return await self._call(
                f"get instance {instance_id}",
                self._service.get_container_group_instance,
                *self._path(),
                instance_id,
                deadline=deadline,
            )
        except ProviderRejected as exc:
            if exc.status != 404:
                raise
        await self._group()  # a missing group raises its own clear error
        return None

    async def _instance_action(self, verb: str, fn: Callable[..., Any], instance_id: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.deadline_s
        before = await self._instance(instance_id, deadline=deadline)
        if before is None:
            log.info(f"instance gone; nothing to {verb}", instance_id=instance_id)
            return
        attempt = 0
        while True:
            try:
                await asyncio.to_thread(fn, *self._path(), instance_id)
                log.info(f"salad instance {verb}", instance_id=instance_id)
                return
            except Exception as exc:
                failure = _classify(exc)
                if not failure.retryable:
                    if failure.status == 404 and await self._instance(instance_id) is None:
                        return
                    raise self._rejected(f"{verb} {instance_id}", failure) from None
            if failure.status != 429:
                # The request may have been carried out before the failure: look first.
                after = await self._instance(instance_id, deadline=deadline)
                if after is None or _moved(before, after):
                    log.info(
                        f"salad instance {verb} took effect despite an error",
                        instance_id=instance_id,
                        error=failure.text,
                    )
                    return
            delay = self._delay(attempt, failure)
            if loop.time() + delay > deadline:
                raise ProviderUnavailable(
                    f"SaladCloud {verb} {instance_id} ({self.where}): still failing after"
                    f" {attempt + 1} attempts: {failure.text}"
                )
            await asyncio.sleep(delay)
            attempt += 1


def _moved(before: Any, after: Any) -> bool:
    return bool(
        after.machine_id != before.machine_id
        or after.update_time != before.update_time
        or _text(after.state) != _text(before.state)
    )


def _text(value: Any) -> str:
    """An SDK enum field's value: the models keep either the enum or the raw string."""
    return str(getattr(value, "value", value))


def _instance(raw: Any) -> Instance:
    state = _text(raw.state)
    return Instance(
        instance_id=str(raw.id_),
        machine_id=str(raw.machine_id or ""),
        state=_STATES.get(state, InstanceState.FAILED),
        deletion_cost=int(getattr(raw, "deletion_cost", 0) or 0),
    )
