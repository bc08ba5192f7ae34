"""What the scaler needs from a place that runs workers.

The verbs follow SaladCloud's container-group API (list instances, reallocate one to another
node, recreate, stop) because it is the most constrained provider lorafleet targets; a spot-VM
or local provider maps them onto its own calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class InstanceState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    # Exited on its own (crash, node loss); the provider may restart it.
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class Instance:
    instance_id: str
    # What the worker reports as its machine id (bans attach to it).
    machine_id: str
    state: InstanceState
    restarts: int = 0


class Provider(Protocol):
    async def list_instances(self) -> list[Instance]: ...

    async def scale_to(self, replicas: int) -> None:
        """Desired number of worker instances (0 when idle)."""
        ...

    async def reallocate(self, instance_id: str) -> None:
        """Move this instance to another node (a bad node); locally: restart the worker."""
        ...

    async def stop(self, *, timeout_s: float) -> None:
        """Stop every instance gracefully (SIGTERM: workers checkpoint and drain)."""
        ...
