"""The worker's Prometheus metrics, defined once; the code that drives each one increments it.

Served with `/healthz` on `metrics_port` when it is set (`lorafleet.core.telemetry.MetricsServer`).
"""

from __future__ import annotations

from prometheus_client import Counter, Enum, Histogram

STATE = Enum(
    "lorafleet_worker_state",
    "The worker's connection state",
    states=["qualifying", "connecting", "idle", "leased", "draining", "stopped"],
)
LEASES = Counter("lorafleet_worker_leases", "Leases this worker ran, by how they ended", ["result"])
STEP_SECONDS = Histogram(
    "lorafleet_worker_step_seconds",
    "Seconds per training step as the trainer reports them",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0),
)
CHECKPOINT_SECONDS = Histogram(
    "lorafleet_worker_checkpoint_seconds",
    "Seconds to store one checkpoint: serialise, get its URL, upload, announce",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
CHECKPOINT_BYTES = Counter("lorafleet_worker_checkpoint_bytes", "Bytes of checkpoints uploaded")
CHECKPOINTS = Counter("lorafleet_worker_checkpoints", "Checkpoints committed")
CHECKPOINT_FAILURES = Counter(
    "lorafleet_worker_checkpoint_failures", "Checkpoints that could not be stored"
)
TRANSFER_RETRIES = Counter(
    "lorafleet_worker_transfer_retries", "Transfer attempts retried, by method", ["method"]
)
TRANSFER_FAILURES = Counter(
    "lorafleet_worker_transfer_failures",
    "Transfers given up after their retries (upload failures are PUT), by method",
    ["method"],
)
ATTEMPT_FAILURES = Counter(
    "lorafleet_worker_attempt_failures",
    "Job attempts this worker failed, by failure class (node faults are NODE)",
    ["failure_class"],
)
RECONNECTS = Counter("lorafleet_worker_connection_failures", "Failed connection attempts")
