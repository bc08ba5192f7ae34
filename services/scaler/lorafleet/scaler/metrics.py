"""The scaler's Prometheus metrics, defined once; the service increments them as it decides.

Served on `metrics_port` when it is set (`lorafleet.core.telemetry.MetricsServer`, started by
`lorafleet scaler`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

DECISIONS = Counter(
    "lorafleet_scaler_decisions",
    "Decisions by action and outcome (applied, failed, not_applied: a HOLD or a dry run)",
    ["action", "outcome"],
)
TICKS = Counter("lorafleet_scaler_ticks", "Ticks run by the active scaler")
PROVIDER_FAILURES = Counter(
    "lorafleet_scaler_provider_failures", "Ticks that decided nothing: the provider failed"
)
ACTIVE = Gauge("lorafleet_scaler_active", "1 while this scaler holds the lock and acts")
