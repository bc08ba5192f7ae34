# syntax=docker/dockerfile:1
#
# lorafleet control plane: the scheduler (and the `lorafleet` admin commands) without the
# training stack. No torch, no diffusers: `pip install .` without the worker extra.
# Build from the repository root:
#
#   docker build -f docker/services.Dockerfile -t lorafleet-services .
#
# Production (docs/DEPLOYING.md): the ledger in Postgres by URL, objects in S3/R2/MinIO:
#
#   docker run -p 50051:50051 \
#     -e DATABASE_URL=postgresql://lorafleet:...@db:5432/lorafleet \
#     -e LORAFLEET_S3_BUCKET=lorafleet -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#     -e LORAFLEET_WORKER_TOKEN=... lorafleet-services
#
#   docker run --rm -e DATABASE_URL=... lorafleet-services keys create alice   # an API key
#
# Trying it alone (embedded Postgres and the local object store under /data):
#
#   docker run -p 50051:50051 -p 8081:8081 -v lorafleet-data:/data \
#     -e LORAFLEET_STORAGE_PUBLIC_URL=http://localhost:8081 lorafleet-services
FROM python:3.11-slim-bookworm

# LORAFLEET_LISTEN and LORAFLEET_STORAGE_HOST bind every interface (the code's defaults are
# 127.0.0.1, which nothing outside the container can reach). With the local object store that
# also means LORAFLEET_STORAGE_PUBLIC_URL must be set: the scheduler refuses to hand out URLs
# naming 0.0.0.0. LORAFLEET_DATA_DIR holds the embedded Postgres, local objects and generated
# secrets; with DATABASE_URL and S3 set, nothing durable is written there.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    LORAFLEET_LISTEN=0.0.0.0:50051 \
    LORAFLEET_DATA_DIR=/data \
    LORAFLEET_STORAGE_HOST=0.0.0.0 \
    LORAFLEET_STORAGE_PORT=8081 \
    LORAFLEET_LOG_FORMAT=json

# A fixed non-root user: Postgres (the embedded one) refuses to run as root.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin lorafleet \
 && mkdir -p /data \
 && chown lorafleet:lorafleet /data

# Only what the wheel is built from (see [tool.hatch.build] in pyproject.toml).
WORKDIR /tmp/lorafleet-src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY core ./core
COPY clients ./clients
COPY services ./services
RUN pip install . \
 && python -c "import lorafleet.scheduler.server, lorafleet.app.main" \
 && cd / && rm -rf /tmp/lorafleet-src

USER lorafleet
WORKDIR /data

# gRPC (JobService, WorkerService, grpc.health.v1.Health, reflection) and the local object
# store's HTTP port (unused when LORAFLEET_S3_BUCKET is set).
EXPOSE 50051 8081

# SIGTERM: the scheduler tells its connected workers to drain, stops serving (5 s grace) and
# closes the ledger. Leases it handed out live in Postgres, not in the process.
STOPSIGNAL SIGTERM

ENTRYPOINT ["lorafleet"]
CMD ["scheduler"]
