"""The webhook outbox: deliveries claimed, delivered or retried later."""

from __future__ import annotations

import uuid

from lorafleet.ledger.base import LedgerBase
from lorafleet.ledger.records import WebhookDelivery, WebhookDeliveryRecord
from lorafleet.ledger.rows import record


class WebhookQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "Webhook outbox" section."""

    # Webhook outbox ------------------------------------------------------------------------------

    async def claim_webhook_deliveries(self, limit: int, claim_s: float) -> list[WebhookDelivery]:
        rows = await self._fetch("claim_webhook_deliveries", limit, claim_s)
        return [record(WebhookDelivery, r, secret=r["webhook_secret"]) for r in rows]

    async def webhook_delivered(self, delivery_id: int, status: int) -> None:
        await self._fetch("webhook_delivered", delivery_id, status)

    async def webhook_failed(
        self, delivery_id: int, status: int | None, error: str, retry_in_s: float | None
    ) -> None:
        """Records a failed attempt; `retry_in_s` None gives up on the delivery."""
        await self._fetch("webhook_failed", delivery_id, status, error[:2000], retry_in_s)

    async def next_webhook_due(self) -> float | None:
        row = await self._fetchrow("next_webhook_due")
        return None if row is None or row[0] is None else float(row[0])

    async def list_webhook_deliveries(self, job_id: str) -> list[WebhookDeliveryRecord]:
        return [
            record(WebhookDeliveryRecord, r)
            for r in await self._fetch("list_webhook_deliveries", uuid.UUID(job_id))
        ]
