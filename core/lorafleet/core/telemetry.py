"""Logs and traces, set up once per process.

Logs: structlog, JSON lines by default (`LORAFLEET_LOG_FORMAT=console` for humans), with job,
lease, epoch and machine ids bound by the code that knows them, and the current span's trace id.
Traces: OpenTelemetry, configured by the standard `OTEL_*` environment; spans are exported over
OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set
(e.g. Jaeger's http://localhost:4317), and dropped otherwise. Metrics: Prometheus text on
`/metrics` of a small HTTP endpoint (`MetricsServer`), off unless a service's `metrics_port` is
set; the same endpoint answers `/healthz` for a container platform's liveness probe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog
from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


class _Stderr:
    """Writes to whatever sys.stderr is at the time (it is replaced under test capture)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_HANDLER_NAME = "lorafleet"


def add_trace_context(
    _logger: object, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Puts the current span's trace and span ids on the line (log and trace meet in Jaeger)."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event


def configure_logging(*, level: str | None = None, fmt: str | None = None) -> None:
    level_name = (level or os.environ.get("LORAFLEET_LOG_LEVEL", "INFO")).upper()
    # JSON lines for machines; a person's terminal gets readable lines unless told otherwise.
    fmt = (
        fmt
        or os.environ.get("LORAFLEET_LOG_FORMAT")
        or ("console" if sys.stderr.isatty() else "json")
    )
    # Colours only on a terminal: the console format also goes to files and pipes (the demo's
    # output, a worker's log under `lorafleet up`), where escape codes are noise.
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        add_trace_context,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Libraries log through the standard library (asyncpg's pool retries, grpc, aiohttp): their
    # records get the same processors and renderer, so every line stays one JSON object.
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    # Replaces only its own handler from an earlier call (a test runner's stay).
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _HANDLER_NAME]
    root.addHandler(handler)
    root.setLevel(level_name)
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def configure_tracing(service_name: str) -> bool:
    """Installs a tracer provider exporting over OTLP/gRPC when an endpoint is configured; True
    if it did. The exporter reads the rest of the standard environment itself
    (`OTEL_EXPORTER_OTLP_HEADERS`, `..._INSECURE`, `OTEL_BSP_*`, `OTEL_RESOURCE_ATTRIBUTES`)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, names the service (e.g. one name per scheduler replica).
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


class MetricsServer:
    """`/metrics` (Prometheus text of `registry`) and `/healthz` over HTTP on the service's loop.

    `/healthz` answers 200 with `health()`'s details while it returns (True, details), 503
    otherwise; it is answered by the service's own event loop, so a wedged loop fails the probe
    too. The exposition runs in a thread: collectors may read the ledger through the loop
    (`run_on_loop`) without blocking it.
    """

    def __init__(
        self,
        *,
        port: int,
        host: str = "0.0.0.0",
        registry: CollectorRegistry = REGISTRY,
        health: Callable[[], tuple[bool, dict[str, object]]] | None = None,
    ) -> None:
        self._requested = (host, port)
        self._registry = registry
        self._health = health
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, port = self._requested
        site = web.TCPSite(runner, host, port, reuse_port=False)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(exc.errno, f"metrics endpoint {host}:{port}: {exc.strerror}") from exc
        self._runner = runner
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request: web.Request) -> web.Response:
        ok, details = self._health() if self._health is not None else (True, {})
        return web.Response(
            status=200 if ok else 503,
            text=json.dumps({"ok": ok, **details}, default=str),
            content_type="application/json",
        )
