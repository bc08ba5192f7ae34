"""The local supervisor's machine identities (`lorafleet up`): the scheduler checks, the local
scaler gives each worker process it starts its token. Both hold the identity secret; workers
hold only their own token, so one worker cannot speak for another machine id."""

from __future__ import annotations

import hashlib
import hmac


def local_identity_token(secret: str, machine_id: str) -> str:
    """What the local supervisor gives the worker process it starts as `machine_id`."""
    return hmac.new(secret.encode(), machine_id.encode(), hashlib.sha256).hexdigest()
