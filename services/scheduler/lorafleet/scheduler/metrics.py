"""The scheduler's Prometheus metrics, defined once; the code that drives each one increments it.

Served on `/metrics` when `metrics_port` is set (`lorafleet.core.telemetry.MetricsServer`).
Counters are per replica: sum them over replicas in queries. Jobs by state are read from the
ledger when scraped (`JobStateCollector`), so every replica reports the fleet's one truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import structlog
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)

JOB_STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELED")

GRANTS = Counter("lorafleet_grants", "Leases granted to workers")
GRANT_LATENCY = Histogram(
    "lorafleet_grant_latency_seconds",
    "From a worker being offered work (Ready, or a dispatch round) to its LeaseGranted queued",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
LEASE_EXPIRIES = Counter("lorafleet_lease_expiries", "Leases expired by this replica's sweeper")
STEPS_LOST_TO_EXPIRY = Counter(
    "lorafleet_steps_lost_to_expiry",
    "Training steps lost to leases this replica's sweeper expired: each lease's last reported"
    " step less the checkpoint its job resumes from (a lower bound)",
)
REQUEUES = Counter(
    "lorafleet_requeues",
    "Jobs put back in the queue, by why (expired, stalled, drained, failed attempt)",
    ["reason"],
)
SAMPLE_TASKS = Counter(
    "lorafleet_sample_tasks",
    "Sample task transitions on this replica's streams",
    ["outcome"],  # granted, succeeded, failed, requeued, preempted
)
DRAINS = Counter("lorafleet_drains", "Draining messages from workers (with or without a lease)")
STALE_REJECTIONS = Counter(
    "lorafleet_stale_rejections", "Worker messages refused for a lease (epoch) no longer live"
)
OPEN_STREAMS = Gauge("lorafleet_worker_streams", "Worker streams open on this replica")
ATTEMPT_FAILURES = Counter(
    "lorafleet_attempt_failures",
    "Attempts workers reported failed, by failure class (NODE faults are the machine's)",
    ["failure_class"],
)
CHECKPOINTS = Counter("lorafleet_checkpoints_committed", "Checkpoints recorded in the ledger")
CHECKPOINT_BYTES = Counter(
    "lorafleet_checkpoint_bytes_committed", "Bytes of the checkpoints recorded in the ledger"
)
SUCCEEDED = Counter("lorafleet_jobs_succeeded", "Jobs that succeeded on this replica's streams")
WEBHOOK_DELIVERIES = Counter(
    "lorafleet_webhook_deliveries", "Webhook deliveries the receiver accepted (2xx)"
)
WEBHOOK_FAILURES = Counter(
    "lorafleet_webhook_failures",
    "Failed webhook attempts, by outcome (retry: tried again later; given_up)",
    ["outcome"],
)
LEDGER_UP = Gauge("lorafleet_ledger_up", "1 while this replica reaches the ledger, 0 otherwise")


class JobStateCollector(Collector):
    """`lorafleet_jobs{state}`: read from the ledger on each scrape, each count capped at `cap`
    and the read bounded by `timeout_s` (a scrape never waits on a slow ledger for long).

    Collectors run in the exposition thread (MetricsServer); the count runs on the scheduler's
    loop."""

    def __init__(
        self,
        count: Callable[[int], Awaitable[dict[str, int]]],
        loop: asyncio.AbstractEventLoop,
        *,
        cap: int = 100_000,
        timeout_s: float = 5.0,
    ) -> None:
        self._count = count
        self._loop = loop
        self._cap = cap
        self._timeout_s = timeout_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "lorafleet_jobs",
            f"Jobs by state in the ledger (each capped at {self._cap})",
            labels=["state"],
        )
        try:
            future = asyncio.run_coroutine_threadsafe(self._read(), self._loop)
            counts = future.result(timeout=self._timeout_s + 1)
        except Exception as exc:  # the ledger is down or slow: no sample, the scrape still works
            log.warning("jobs by state not read for metrics", error=str(exc))
            return
        for state in JOB_STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family

    async def _read(self) -> dict[str, int]:
        async with asyncio.timeout(self._timeout_s):
            return await self._count(self._cap)
