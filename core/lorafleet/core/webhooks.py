"""Webhook signatures in the Standard Webhooks format (https://www.standardwebhooks.com), so a
receiver can use a ready verifier in any language (`standardwebhooks` in Python):

    webhook-id: lfd_<delivery id>     (the same on every retry: deduplicate on it)
    webhook-timestamp: <unix seconds>
    webhook-signature: v1,<base64 HMAC-SHA256(key, "<webhook-id>.<webhook-timestamp>.<body>")>
    Lorafleet-Event: job.succeeded | job.failed | job.canceled | job.checkpoint

The key is the API key's webhook secret, printed by `lorafleet keys create` as
`whsec_<base64 of the key>` (the Standard Webhooks form). Secrets printed before this format
(64 hex characters) name the same key: `verify` and `standard_secret` accept both. A receiver
should refuse timestamps older than a few minutes, so a captured request cannot be replayed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Mapping

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
EVENT_HEADER = "Lorafleet-Event"
# What a receiver deduplicates on: the Standard Webhooks message id.
DELIVERY_HEADER = ID_HEADER
SECRET_PREFIX = "whsec_"
_HEX_SECRET = re.compile(r"[0-9a-f]{64}")


class InvalidSignature(Exception):
    """The request was not signed by lorafleet with this secret, or is too old."""


def secret_key(secret: str) -> bytes:
    """The HMAC key a webhook secret names: `whsec_<base64>`, or the 64 hex characters the
    ledger stores (and older `keys create` printed)."""
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret.removeprefix(SECRET_PREFIX) + "==")
        except binascii.Error:
            raise InvalidSignature("the secret is not whsec_<base64>") from None
    if _HEX_SECRET.fullmatch(secret):
        return bytes.fromhex(secret)
    return secret.encode()


def standard_secret(secret: str) -> str:
    """The secret as Standard Webhooks verifiers take it: `whsec_<base64 of the key>`."""
    return SECRET_PREFIX + base64.b64encode(secret_key(secret)).decode()


MESSAGE_ID_PREFIX = "lfd_"


def message_id(delivery_id: int) -> str:
    """The webhook-id of a delivery (the same on every retry)."""
    return f"{MESSAGE_ID_PREFIX}{delivery_id}"


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 signature>` of one message."""
    mac = hmac.new(secret_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signed_headers(
    secret: str, body: bytes, *, event: str, delivery_id: int, now: float | None = None
) -> dict[str, str]:
    timestamp = int(time.time() if now is None else now)
    msg_id = message_id(delivery_id)
    return {
        "Content-Type": "application/json",
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, msg_id, timestamp, body),
        EVENT_HEADER: f"job.{event}",
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = 300.0,
    now: float | None = None,
) -> None:
    """Raises InvalidSignature unless the request is lorafleet's, signed within tolerance_s.
    `secret` is either form (`whsec_...` or the hex one)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id = lowered[ID_HEADER]
        timestamp = int(lowered[TIMESTAMP_HEADER])
        signatures = lowered[SIGNATURE_HEADER].split()
    except (KeyError, ValueError):
        raise InvalidSignature("missing or malformed signature headers") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise InvalidSignature("timestamp outside the tolerance (replayed or clock skew)")
    expected = sign(secret, msg_id, timestamp, body)
    # Several space-separated signatures may be sent (e.g. during a key rotation): one must match.
    if not any(hmac.compare_digest(s, expected) for s in signatures if s.startswith("v1,")):
        raise InvalidSignature("signature does not match")
