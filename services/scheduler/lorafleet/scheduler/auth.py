"""API keys for users and the shared token for workers.

A key reads `lf_<key_id>_<secret>`. The ledger stores only sha256(secret): the secret is 32 random
bytes, so a fast hash is as strong as a slow one and costs nothing per request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.errors import InvalidArgument, Unauthenticated
from lorafleet.scheduler.ledger import Ledger

_KEY = re.compile(r"lf_([a-z0-9]{12})_([A-Za-z0-9_-]{43})")
OWNER_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True, kw_only=True)
class NewApiKey:
    key: str
    webhook_secret: str


@dataclass(frozen=True, kw_only=True)
class Principal:
    owner: str
    key_id: str


async def create_api_key(
    ledger: Ledger,
    owner: str,
    *,
    webhook_url: str | None = None,
    webhook_events: Sequence[str] = (),
) -> NewApiKey:
    """The key and its webhook secret: shown once, neither recoverable from the ledger."""
    if not OWNER_PATTERN.fullmatch(owner):
        raise InvalidArgument("owner", "must match [a-z0-9][a-z0-9_.-]{0,62}")
    if webhook_url and not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", webhook_url):
        raise InvalidArgument("webhook_url", "must be an http:// or https:// URL")
    for event in webhook_events:
        if event not in ("checkpoint", "succeeded", "failed", "canceled"):
            raise InvalidArgument("webhook_events", f"unknown event {event!r}")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    webhook_secret = await ledger.insert_api_key(
        key_id,
        owner,
        _digest(secret),
        webhook_url=webhook_url or None,
        webhook_events=webhook_events,
    )
    return NewApiKey(key=f"lf_{key_id}_{secret}", webhook_secret=webhook_secret)


def bearer(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ").strip()
    raise Unauthenticated("authorization: expected 'Bearer <api key>' metadata")


class ApiKeyAuthenticator:
    """Maps a presented key to its owner; remembers good keys briefly (revocation lag: cache_s)."""

    def __init__(self, ledger: Ledger, *, cache_s: float = 30.0) -> None:
        self._ledger = ledger
        self._cache_s = cache_s
        self._cache: dict[str, tuple[Principal, float]] = {}

    async def principal(self, metadata: Sequence[tuple[str, str | bytes]]) -> Principal:
        key = bearer(metadata)
        cached = self._cache.get(key)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        match = _KEY.fullmatch(key)
        if match is None:
            raise Unauthenticated("authorization: malformed API key")
        record = await self._ledger.get_api_key(match.group(1))
        if record is None or not hmac.compare_digest(record.secret_sha256, _digest(match.group(2))):
            raise Unauthenticated("authorization: unknown or revoked API key")
        if len(self._cache) > 10_000:
            self._cache.clear()
        principal = Principal(owner=record.owner, key_id=record.key_id)
        self._cache[key] = (principal, now + self._cache_s)
        return principal


def check_worker_token(metadata: Sequence[tuple[str, str | bytes]], expected: str) -> None:
    presented = bearer(metadata)
    if not expected or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthenticated("authorization: unknown worker token")
