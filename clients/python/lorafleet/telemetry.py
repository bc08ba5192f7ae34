"""Logs and traces, set up once per process.

Logs: structlog, JSON lines by default (`LORAFLEET_LOG_FORMAT=console` for humans), with job,
lease and machine ids bound by the code that knows them. Traces: OpenTelemetry; spans are
exported over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (e.g. Jaeger's
http://localhost:4317), and dropped otherwise.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _Stderr:
    """Writes to whatever sys.stderr is at the time (it is replaced under test capture)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(*, level: str | None = None, fmt: str | None = None) -> None:
    level_name = (level or os.environ.get("LORAFLEET_LOG_LEVEL", "INFO")).upper()
    fmt = fmt or os.environ.get("LORAFLEET_LOG_FORMAT", "json")
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    )
    logging.basicConfig(level=level_name, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def configure_tracing(service_name: str) -> None:
    """Installs a tracer provider exporting over OTLP/gRPC when an endpoint is configured."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
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
