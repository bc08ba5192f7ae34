"""API keys: a key's secret digest, its spending against its budget, its revocation."""

from __future__ import annotations

from collections.abc import Sequence

from lorafleet.core.spec import JobSpec
from lorafleet.ledger.base import LedgerBase
from lorafleet.ledger.records import ApiKeyInfo, ApiKeyRecord, KeySpending, ShapeWork
from lorafleet.ledger.rows import record


class ApiKeyQueries(LedgerBase):
    """The `Ledger` methods of queries.sql's "API keys" section."""

    # API keys ------------------------------------------------------------------------------------

    async def insert_api_key(
        self,
        key_id: str,
        owner: str,
        secret_sha256: bytes,
        *,
        webhook_url: str | None = None,
        webhook_events: Sequence[str] = (),
        spend_limit_dollars: float | None = None,
    ) -> str:
        """Stores the key; returns its webhook signing secret."""
        row = await self._fetchrow(
            "insert_api_key",
            key_id,
            owner,
            secret_sha256,
            webhook_url,
            list(webhook_events),
            spend_limit_dollars,
        )
        assert row is not None
        secret: str = row["webhook_secret"]
        return secret

    async def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        row = await self._fetchrow("get_api_key", key_id)
        if row is None:
            return None
        return record(ApiKeyRecord, row)

    async def key_spending(self, key_id: str) -> KeySpending:
        row = await self._fetchrow("key_spending", key_id)
        if row is None:
            return KeySpending(spend_limit_dollars=None, gpu_seconds=0.0)
        return record(KeySpending, row)

    async def key_unfinished_work(self, key_id: str) -> list[ShapeWork]:
        return [
            ShapeWork(shape=JobSpec.from_dict(r["spec"]).shape, steps=r["steps"])
            for r in await self._fetch("key_unfinished_work", key_id)
        ]

    async def revoke_api_key(self, key_id: str) -> bool:
        return await self._fetchrow("revoke_api_key", key_id) is not None

    async def list_api_keys(self) -> list[ApiKeyInfo]:
        return [record(ApiKeyInfo, r) for r in await self._fetch("list_api_keys")]
