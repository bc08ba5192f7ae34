"""The worker stream's background work: offers, checkpoint pruning, lease re-checks, releases.

Each runs as a task of its own so that no worker's message waits on another's. An unavailable
ledger or store is logged and forgotten (the next message, round or sweep tries again); any
other failure is kept in `failed`, which the dispatcher's `run()` raises, so that it reaches
`Scheduler.wait()`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable

import structlog

from lorafleet.core.errors import is_retryable

log = structlog.get_logger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def spawn(self, coro: Awaitable[object], what: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except Exception as exc:
                if not is_retryable(exc):
                    log.exception("background task failed", task=what)
                    if not self.failed.done():
                        self.failed.set_exception(exc)
                    return
                log.warning(
                    "background task failed; the ledger or store is unavailable",
                    task=what,
                    error=str(exc),
                )

        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # Cancelled before it ran (the scheduler stopping): close the coroutine, which was never
        # awaited, instead of leaving Python to warn about it (a no-op once it has run).
        if inspect.iscoroutine(coro):
            task.add_done_callback(lambda t: coro.close() if t.cancelled() else None)

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
