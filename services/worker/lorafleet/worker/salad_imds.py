"""SaladCloud's instance metadata service (IMDS), where the worker itself must act, through the
official `salad-cloud-imds-sdk`.

Every IMDS call carries the header `Metadata: true` (the SDK adds it from `Metadata.TRUE`).
The one the worker makes: `POST /v1/reallocate` with `{"reason": ...}` (1 to 1000 characters,
reported to SaladCloud support), which moves this container instance to another node. The agent
asks for it when the qualification probe fails (`salad_reallocate`), instead of idling on a node
that will never get work. SaladCloud then stops the container (SIGTERM: the worker drains, with
no lease to report) and starts it on another node.

The SDK blocks (requests) and retries a 5xx or a timeout itself (three times, backoff from
0.15 s); the call runs in a thread, bounded by `timeout_s` per attempt.
"""

from __future__ import annotations

import structlog
from salad_cloud_imds_sdk import SaladCloudImdsSdkAsync
from salad_cloud_imds_sdk.models import Metadata, ReallocatePrototype

log = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "http://169.254.169.254"
# ReallocatePrototype.reason's bounds (the IMDS description).
MAX_REASON_CHARS = 1000


async def request_reallocation(
    reason: str, *, base_url: str = DEFAULT_BASE_URL, timeout_s: float = 10.0
) -> bool:
    """Asks SaladCloud to move this container to another node; True once the IMDS accepted.

    Never raises: a refusal (not on SaladCloud, 403/404) or an unreachable service is logged,
    and the worker carries on (the scaler still sees the failed qualification in the ledger)."""
    body = ReallocatePrototype(reason=(reason.strip() or "unspecified")[:MAX_REASON_CHARS])
    sdk = SaladCloudImdsSdkAsync(base_url=base_url, timeout=max(1, int(timeout_s * 1000)))
    try:
        await sdk.metadata.reallocate(body, Metadata.TRUE)
    except Exception as exc:  # the SDK's ApiError, requests' errors: all mean "did not happen"
        status = getattr(exc, "status", None)
        log.error(
            "SaladCloud reallocation request failed",
            status=status,
            error=f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"[:300],
        )
        return False
    log.warning("asked SaladCloud to reallocate this container", reason=body.reason)
    return True
