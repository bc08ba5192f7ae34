"""Delivers the webhook outbox: claim due rows, POST signed JSON, retry with backoff, give up.

Rows are written by the ledger in the same transaction as the job event they announce (see
migration 0002), so a notification is never lost and never sent for a rolled-back change. Each
replica runs this loop; claims use SKIP LOCKED and a claim timeout, so a delivery is attempted by
one replica at a time and a crashed replica's claims come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import aiohttp
import structlog

from lorafleet.scheduler.ledger import Ledger, WebhookDelivery
from lorafleet.scheduler.notifications import WEBHOOK, Notifications
from lorafleet.webhooks import signed_headers

log = structlog.get_logger(__name__)


class WebhookSender:
    def __init__(
        self,
        *,
        ledger: Ledger,
        notifications: Notifications,
        max_attempts: int = 8,
        backoff_s: float = 2.0,
        max_backoff_s: float = 600.0,
        timeout_s: float = 10.0,
        poll_s: float = 5.0,
    ) -> None:
        self._ledger = ledger
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._wake = asyncio.Event()
        notifications.subscribe(WEBHOOK, lambda _payload: self._wake.set())

    def retry_delay(self, attempts: int) -> float | None:
        """Seconds before the next try after `attempts` failures, or None to give up."""
        if attempts >= self._max_attempts:
            return None
        delay = min(self._max_backoff_s, self._backoff_s * 2.0 ** (attempts - 1))
        return delay * random.uniform(0.8, 1.2)  # jitter: receivers recovering see a spread

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                wait_s = self._poll_s
                try:
                    while await self.deliver_due(http):
                        pass
                    due = await self._ledger.next_webhook_due()
                    if due is not None:
                        # Sleep until the next retry is due (a NOTIFY for new work cuts it short).
                        wait_s = min(self._poll_s, max(0.0, due))
                except Exception:
                    log.exception("webhook delivery round failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                self._wake.clear()

    async def deliver_due(self, http: aiohttp.ClientSession) -> int:
        """One batch of due deliveries; returns how many were attempted."""
        batch = await self._ledger.claim_webhook_deliveries(20, self._timeout_s * 3)
        await asyncio.gather(*(self._deliver(http, d) for d in batch))
        return len(batch)

    async def _deliver(self, http: aiohttp.ClientSession, delivery: WebhookDelivery) -> None:
        body = json.dumps(
            {"delivery_id": delivery.delivery_id, **delivery.payload}, sort_keys=True
        ).encode()
        headers = signed_headers(
            delivery.secret, body, event=delivery.event, delivery_id=delivery.delivery_id
        )
        status: int | None = None
        try:
            async with http.post(delivery.url, data=body, headers=headers) as response:
                status = response.status
                if 200 <= status < 300:
                    await self._ledger.webhook_delivered(delivery.delivery_id, status)
                    log.info(
                        "webhook delivered", job_id=delivery.job_id, webhook_event=delivery.event
                    )
                    return
                error = f"HTTP {status}: {(await response.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        retry_in = self.retry_delay(delivery.attempts)
        await self._ledger.webhook_failed(delivery.delivery_id, status, error, retry_in)
        log.warning(
            "webhook attempt failed" if retry_in is not None else "webhook given up",
            job_id=delivery.job_id,
            webhook_event=delivery.event,
            attempts=delivery.attempts,
            error=error,
        )
