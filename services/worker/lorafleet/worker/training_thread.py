"""The thread a worker trains on: one per agent, created and shut down by it.

`Trainer.run` blocks for minutes to hours and cannot be interrupted; it only looks at its stop
request between steps. Running it in asyncio's default executor tied the process's exit to it:
that executor's threads are joined when the event loop closes and again at interpreter exit,
so a worker whose drain grace ran out while a step (or a model load) was still going could
only leave through `os._exit`. Here the agent owns the thread instead:

* one thread, so runs never overlap and queue behind one another (the agent never gives it
  two at once anyway);
* `submit()` hands it a call and returns a `concurrent.futures.Future` (await it with
  `asyncio.wrap_future`); the call runs in a copy of the caller's context, so the trainer's
  spans are children of the lease's;
* `shutdown(timeout_s)` lets the current call finish, stops the thread and joins it, waiting
  at most `timeout_s`; it says whether the thread is gone.

The thread is a daemon. Nothing else can guarantee a prompt exit: a step cannot be
interrupted from outside, and a non-daemon thread is joined at interpreter exit, however long
its step takes. The agent only gives up on it after asking it to stop and waiting out the drain
grace, when the lease is re-queued by the scheduler anyway (its last checkpoint is committed or
never will be); the process may then exit under it without losing anything. The daemon flag
changes nothing for a thread that stopped in time: it has been joined.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# A call, or a future to complete when the thread stops.
_Item = tuple[concurrent.futures.Future[Any], Callable[[], Any]] | concurrent.futures.Future[None]


class TrainingThread:
    """One daemon thread that runs blocking calls, one at a time, in submission order."""

    def __init__(self, name: str = "lorafleet-training") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        """True while the thread runs (started and not yet stopped)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Starts the thread; idempotent. Refused after `shutdown()`."""
        with self._lock:
            if self._stopped is not None:
                raise RuntimeError("the training thread was shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Queues `fn(*args, **kwargs)` (run in a copy of the current context)."""
        self.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        self._queue.put((future, call))
        return future

    async def shutdown(self, timeout_s: float) -> bool:
        """Stops the thread once the call it runs (and any queued) has returned, waiting at most
        `timeout_s`. True when the thread is gone; False when it is still inside a call (it
        stops after it, and being a daemon, it does not hold the process). Idempotent."""
        with self._lock:
            if self._stopped is None:
                self._stopped = concurrent.futures.Future()
                if self._thread is not None:
                    self._queue.put(self._stopped)
                else:
                    self._stopped.set_result(None)
            stopped = self._stopped
        if not stopped.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(asyncio.wrap_future(stopped))
            except TimeoutError:
                return False
        if self._thread is not None:
            # It has left its loop: only its last bytecodes remain.
            self._thread.join()
        return True

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, concurrent.futures.Future):
                item.set_result(None)
                return
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
