"""One LISTEN connection per replica, fanned out to in-process subscribers.

The ledger's triggers NOTIFY on every transition (see the migration), so any replica's change
wakes every replica. If the connection drops, notifications may be lost: on reconnect every
subscriber is called with `None` ("anything may have changed") and re-reads the ledger.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

import asyncpg
import structlog

log = structlog.get_logger(__name__)

WORK = "lorafleet_work"
LEASE_ENDED = "lorafleet_lease_ended"
JOB_EVENT = "lorafleet_job_event"
WEBHOOK = "lorafleet_webhook"
CHANNELS = (WORK, LEASE_ENDED, JOB_EVENT, WEBHOOK)

Callback = Callable[[str | None], None]


class Notifications:
    def __init__(self, dsn: str, *, reconnect_delay_s: float = 1.0) -> None:
        self._dsn = dsn
        self._reconnect_delay_s = reconnect_delay_s
        self._subscribers: dict[str, list[Callback]] = defaultdict(list)
        self._job_watchers: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._connected = asyncio.Event()

    def subscribe(self, channel: str, callback: Callback) -> None:
        self._subscribers[channel].append(callback)

    def watch_job(self, job_id: str) -> asyncio.Event:
        """An event set whenever the job's timeline may have grown; pair with `unwatch_job`."""
        event = asyncio.Event()
        self._job_watchers[job_id].add(event)
        return event

    def unwatch_job(self, job_id: str, event: asyncio.Event) -> None:
        watchers = self._job_watchers.get(job_id)
        if watchers is not None:
            watchers.discard(event)
            if not watchers:
                del self._job_watchers[job_id]

    async def wait_connected(self) -> None:
        await self._connected.wait()

    def _deliver(self, channel: str, payload: str | None) -> None:
        if channel == JOB_EVENT:
            targets = (
                self._job_watchers.values()
                if payload is None
                else [self._job_watchers.get(payload, set())]
            )
            for events in targets:
                for event in events:
                    event.set()
        for callback in self._subscribers[channel]:
            try:
                callback(payload)
            except Exception:
                log.exception("notification subscriber failed", channel=channel)

    async def run(self) -> None:
        first = True
        while True:
            try:
                conn = await asyncpg.connect(self._dsn)
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning("listen connection failed; retrying", error=str(exc))
                await asyncio.sleep(self._reconnect_delay_s)
                continue
            self._conn = conn
            self._lost.clear()
            conn.add_termination_listener(lambda _c: self._lost.set())
            try:
                for channel in CHANNELS:
                    await conn.add_listener(
                        channel, lambda _c, _pid, ch, payload: self._deliver(ch, payload)
                    )
                self._connected.set()
                if not first:
                    for channel in CHANNELS:
                        self._deliver(channel, None)
                first = False
                await self._lost.wait()
                log.warning("listen connection lost; reconnecting")
            finally:
                self._connected.clear()
                self._conn = None
                if not conn.is_closed():
                    await conn.close(timeout=5)

    async def close(self) -> None:
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close(timeout=5)
