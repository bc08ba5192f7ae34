"""API keys for users and the shared token for workers.

A key reads `lf_<key_id>_<secret>`. The ledger stores only sha256(secret): the secret is 32 random
bytes, so a fast hash is as strong as a slow one and costs nothing per request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.core.errors import InvalidArgument, Unauthenticated
from lorafleet.ledger.ledger import Ledger

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
    spend_limit_dollars: float | None = None,
) -> NewApiKey:
    """The key and its webhook secret: shown once, neither recoverable from the ledger."""
    if not OWNER_PATTERN.fullmatch(owner):
        raise InvalidArgument("owner", "must match [a-z0-9][a-z0-9_.-]{0,62}")
    if webhook_url and not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", webhook_url):
        raise InvalidArgument("webhook_url", "must be an http:// or https:// URL")
    for event in webhook_events:
        if event not in ("checkpoint", "succeeded", "failed", "canceled", "samples"):
            raise InvalidArgument("webhook_events", f"unknown event {event!r}")
    if spend_limit_dollars is not None and not 0 <= spend_limit_dollars < 1e12:
        raise InvalidArgument("spend_limit_dollars", "must be 0 or more")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    webhook_secret = await ledger.insert_api_key(
        key_id,
        owner,
        _digest(secret),
        webhook_url=webhook_url or None,
        webhook_events=webhook_events,
        spend_limit_dollars=spend_limit_dollars,
    )
    return NewApiKey(key=f"lf_{key_id}_{secret}", webhook_secret=webhook_secret)


def bearer(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ").strip()
        if key == "authorization" and isinstance(value, str) and value.strip() == "Bearer":
            return ""  # "Bearer " with nothing after it (gRPC strips the trailing space)
    raise Unauthenticated("authorization: expected 'Bearer <api key>' metadata")


class ApiKeyAuthenticator:
    """Maps a presented key to its owner, asking the ledger every time.

    No cache: a revoked key is refused by the very next call on every replica. A cache evicted by
    a NOTIFY would still leave a window (the notification reaches other replicas after the
    revoking commit, not with it), and the lookup is one primary-key read on the pool.
    """

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    async def principal(self, metadata: Sequence[tuple[str, str | bytes]]) -> Principal:
        presented = bearer(metadata)
        if not presented:
            raise Unauthenticated(
                "authorization: no API key given (set LORAFLEET_API_KEY or pass --api-key;"
                " `lorafleet keys create NAME` makes one, `lorafleet up` writes"
                " .lorafleet/api-key)"
            )
        match = _KEY.fullmatch(presented)
        if match is None:
            raise Unauthenticated("authorization: malformed API key")
        record = await self._ledger.get_api_key(match.group(1))
        if record is None or not hmac.compare_digest(record.secret_sha256, _digest(match.group(2))):
            raise Unauthenticated("authorization: unknown or revoked API key")
        return Principal(owner=record.owner, key_id=record.key_id)


def check_worker_token(metadata: Sequence[tuple[str, str | bytes]], expected: str) -> None:
    presented = bearer(metadata)
    if not expected or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthenticated("authorization: unknown worker token")
