"""The one backoff rule: exponential growth, capped, with full jitter.

Every retry loop in lorafleet (stream reconnects, transfers, webhooks, provider calls, restarts
of local workers) waits `backoff_delay(attempt, ...)` between attempts, so that many clients
recovering at once spread out instead of arriving together (AWS's "full jitter").
"""

from __future__ import annotations

import random


def backoff_delay(
    attempt: int, *, initial_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Uniform in [0, min(max_s, initial_s * 2**attempt)]; attempt counts from 0."""
    ceiling = min(max_s, initial_s * 2.0 ** min(max(attempt, 0), 30))
    return (rng or random).uniform(0.0, ceiling)
