"""What the scaler needs from a place that runs workers: one interface for every provider.

The verbs follow SaladCloud's container-group API (a desired replica count, instances with
machine ids, reallocate / restart one, a deletion cost that steers scale-in) because it is the
most constrained provider lorafleet targets; EC2 spot (`ec2.py`) and local processes
(`local.py`) map them onto their own calls:

* `replicas()`: Salad, the group's `replicas` (0 when stopped); EC2, tagged pending + running
  instances; local, the slots.
* `scale_to(n, remove=...)`: Salad lowers the named instances' deletion cost, then sets the
  group's replicas (and starts a stopped group); EC2 terminates the named instances, then
  launches up to n; local stops the named slots, then adds slots up to n.
* `reallocate(id)`: Salad reallocates the instance to another node; EC2 terminates it and
  launches a replacement; local kills the process and starts a fresh slot.
* `restart(id)`: Salad restarts the container on its node; EC2 reboots; local restarts the
  process in its slot.
* `set_deletion_cost(id, cost)`: Salad PATCHes the instance; EC2 and local have no such notion
  (their instances report `deletion_cost=None`, so the policy never asks).

Every method is async; providers whose client library blocks run it in a thread. Errors are
`ProviderError`s: `retryable` says whether the next tick may succeed (an outage), or whether
an operator must fix something first (a wrong key, a group that does not exist).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lorafleet.core.errors import LorafleetError


class InstanceState(enum.StrEnum):
    # Asked for, not yet running a worker (Salad: allocating, downloading, creating; EC2: pending).
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    # Exited on its own (crash, node loss); the provider may restart it.
    FAILED = "failed"


LIVE_STATES = frozenset({InstanceState.STARTING, InstanceState.RUNNING})
# What a provider still counts against its replicas and may pick for a scale-in: a stopping
# instance (reallocated, restarted, being removed) is one of them until it is gone.
COUNTED_STATES = LIVE_STATES | {InstanceState.STOPPING}


@dataclass(frozen=True, kw_only=True)
class Instance:
    instance_id: str
    # What the worker reports as its machine id (bans attach to it); "" while not yet placed.
    machine_id: str
    state: InstanceState
    restarts: int = 0
    # SaladCloud's scale-in order (lowest first); None where the provider has no such notion.
    deletion_cost: int | None = None


class ProviderError(LorafleetError):
    """A provider call failed; `retryable` says whether trying again later can help."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class ProviderRejected(ProviderError):
    """The provider refused the request itself (bad key, unknown group, invalid value):
    retrying cannot help until an operator changes the configuration."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message, retryable=False)
        # The HTTP status where the provider answered with one.
        self.status = status


class ProviderUnavailable(ProviderError):
    """The provider kept failing transiently (429, 5xx, timeouts) until the call's deadline."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class ActionWithdrawn(ProviderError):
    """An action given up between two retries because its reason had gone."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


@dataclass(frozen=True, kw_only=True)
class SlowCall:
    """A provider call that needed retries: how long it took in all, and why it retried."""

    what: str
    seconds: float
    attempts: int
    error: str
    deadline_s: float  # the call's own bound


# Asked before each retry of an action: None to go on, else why the action is no longer wanted.
StillWanted = Callable[[], Awaitable[str | None]]


class Provider(Protocol):
    async def list_instances(self) -> list[Instance]:
        """Every instance the provider holds for this fleet, in any state."""
        ...

    async def replicas(self) -> int:
        """The desired instance count the provider holds now (0 for a stopped group)."""
        ...

    async def scale_to(
        self, replicas: int, *, remove: Sequence[str] = (), still_wanted: StillWanted | None = None
    ) -> None:
        """Desired number of worker instances (0 when idle). When shrinking, `remove` names
        the instances to go (idle ones, chosen by the policy); a provider never removes a
        named instance while growing, and never picks a busy one by itself if it can help it.
        A provider that retries asks `still_wanted()` before each retry and raises
        `ActionWithdrawn` when it says no: a change retried for long must not outlive its
        reason (a replica added for a job cancelled meanwhile is a cold start for nothing)."""
        ...

    async def reallocate(self, instance_id: str) -> None:
        """Move this instance onto another node (a bad or slow node): the worker gets SIGTERM,
        drains, and a fresh node takes its place."""
        ...

    async def restart(self, instance_id: str) -> None:
        """Restart the worker on the same node."""
        ...

    async def set_deletion_cost(self, instance_id: str, cost: int) -> None:
        """Where scale-in picks its victims (SaladCloud): lowest cost goes first."""
        ...

    async def stop(self, *, timeout_s: float) -> None:
        """Stop every instance gracefully (SIGTERM: workers checkpoint and drain)."""
        ...
