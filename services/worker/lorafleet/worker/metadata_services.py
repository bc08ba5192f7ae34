"""What the agent does with the provider's metadata service (config `spot_notice`,
`salad_reallocate`), beside its connection and its leases (agent.py).

* With `spot_notice` `ec2`, a watcher polls EC2's spot interruption notice from the start
  (spot_notice.py) and calls `drain()` when one appears, exactly as SIGTERM does.
* On SaladCloud, a failed qualification probe asks the node's IMDS to reallocate this container
  (salad_imds.py) while the agent connects as usual (the scheduler records the failed probe;
  SaladCloud's SIGTERM follows).

Each runs as a side task (`_side_task`) that the agent cancels when it stops. These are the
`MetadataServices` methods `Agent` inherits; they read and set the agent's fields declared below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from structlog.typing import FilteringBoundLogger

from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.salad_imds import request_reallocation
from lorafleet.worker.spot_notice import watch_spot_notice


class MetadataServices:
    """The `Agent` methods that act on the provider's metadata service (module docstring)."""

    # The agent's fields these methods use; `Agent.__init__` sets them and says what each is.
    config: WorkerConfig
    reallocation_requested: bool | None
    _side_tasks: set[asyncio.Task[None]]
    _finished: asyncio.Event
    _log: FilteringBoundLogger

    # What the agent does, which these methods call (agent.py).

    def drain(self, reason: str) -> None:
        raise NotImplementedError

    def _notify(self) -> None:
        raise NotImplementedError

    # The provider's metadata service ----------------------------------------------------------

    def _side_task(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _watch_spot_notice(self) -> None:
        """EC2's interruption notice drains the worker, exactly as SIGTERM does."""
        notice = await watch_spot_notice(
            base_url=self.config.ec2_metadata_url,
            interval_s=self.config.spot_notice_interval_s,
            stop=self._finished,
        )
        if notice is not None:
            self._log.warning("spot interruption notice", action=notice.action, at=notice.time)
            self.drain(f"spot interruption notice: {notice.action} at {notice.time}")

    async def _reallocate(self, detail: str) -> None:
        """A node that failed qualification will never get work: ask SaladCloud for another."""
        self.reallocation_requested = await request_reallocation(
            f"lorafleet qualification failed: {detail}", base_url=self.config.salad_imds_url
        )
        self._notify()
