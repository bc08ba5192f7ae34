"""Webhook signatures: how lorafleet signs a delivery, and how a receiver checks it.

Each POST carries

    Lorafleet-Timestamp: <unix seconds>
    Lorafleet-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>
    Lorafleet-Event: job.succeeded | job.failed | job.canceled | job.checkpoint
    Lorafleet-Delivery: <delivery id>   (the same on every retry: deduplicate on it)

The secret is the API key's webhook secret, printed by `lorafleet keys create`. A receiver
should refuse timestamps older than a few minutes, so a captured request cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

TIMESTAMP_HEADER = "Lorafleet-Timestamp"
SIGNATURE_HEADER = "Lorafleet-Signature"
EVENT_HEADER = "Lorafleet-Event"
DELIVERY_HEADER = "Lorafleet-Delivery"


class InvalidSignature(Exception):
    """The request was not signed by lorafleet with this secret, or is too old."""


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def signed_headers(
    secret: str, body: bytes, *, event: str, delivery_id: int, now: float | None = None
) -> dict[str, str]:
    timestamp = int(time.time() if now is None else now)
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, timestamp, body),
        EVENT_HEADER: f"job.{event}",
        DELIVERY_HEADER: str(delivery_id),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = 300.0,
    now: float | None = None,
) -> None:
    """Raises InvalidSignature unless the request is lorafleet's, signed within tolerance_s."""
    lowered = {k.lower(): v for k, v in headers.items()}
    try:
        timestamp = int(lowered[TIMESTAMP_HEADER.lower()])
        signature = lowered[SIGNATURE_HEADER.lower()]
    except (KeyError, ValueError):
        raise InvalidSignature("missing or malformed signature headers") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise InvalidSignature("timestamp outside the tolerance (replayed or clock skew)")
    if not hmac.compare_digest(signature, sign(secret, timestamp, body)):
        raise InvalidSignature("signature does not match")
