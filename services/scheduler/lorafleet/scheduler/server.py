"""The scheduler process: ledger, storage, LISTEN hub, gRPC services and sweepers in one lifecycle.

async with Scheduler(config) as scheduler:   # started; scheduler.port is bound
    await scheduler.wait()                   # until shutdown() or a component fails
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import uuid
from pathlib import Path
from types import TracebackType
from typing import Self

import asyncpg
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lorafleet.fleet.v1 import fleet_pb2, fleet_pb2_grpc
from lorafleet.jobs.v1 import jobs_pb2, jobs_pb2_grpc
from lorafleet.scheduler.auth import ApiKeyAuthenticator
from lorafleet.scheduler.config import LocalStorage, SchedulerConfig
from lorafleet.scheduler.database import EmbeddedPostgres, migrate
from lorafleet.scheduler.fleet import Fleet
from lorafleet.scheduler.jobs import JobHandler
from lorafleet.scheduler.ledger import Ledger
from lorafleet.scheduler.notifications import Notifications
from lorafleet.scheduler.servicers import JobServicer, WorkerServicer
from lorafleet.scheduler.storage import (
    LocalObjectStore,
    LocalStoreConfig,
    ObjectStore,
    S3ObjectStore,
)
from lorafleet.scheduler.webhooks import WebhookSender

log = structlog.get_logger(__name__)

SERVICE_NAMES = (
    jobs_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
    fleet_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
)


def read_or_create_secret(path: Path, nbytes: int = 32) -> str:
    """A secret kept in the data directory (mode 0600) so restarts keep URLs and tokens valid."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.port = 0
        self.database_url = config.database_url
        self.worker_token = config.worker_token
        self._embedded: EmbeddedPostgres | None = None
        self._ledger: Ledger | None = None
        self._storage: ObjectStore | None = None
        self._notifications: Notifications | None = None
        self._fleet: Fleet | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._shutdown_started = False

    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None, "start() first"
        return self._ledger

    @property
    def storage(self) -> ObjectStore:
        assert self._storage is not None, "start() first"
        return self._storage

    @property
    def fleet(self) -> Fleet:
        assert self._fleet is not None, "start() first"
        return self._fleet

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    async def start(self) -> None:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.database_url:
            self._embedded = EmbeddedPostgres(cfg.data_dir / "postgres")
            self.database_url = await asyncio.to_thread(self._embedded.start)
        conn = await asyncpg.connect(self.database_url)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        if not self.worker_token:
            self.worker_token = read_or_create_secret(cfg.data_dir / "worker-token")
        self._ledger = await Ledger.connect(self.database_url)
        self._storage = self._make_storage()
        await self._storage.start()
        self._notifications = Notifications(self.database_url)
        self._tasks.append(asyncio.create_task(self._notifications.run(), name="listen"))
        await asyncio.wait_for(self._notifications.wait_connected(), timeout=30)
        self._fleet = Fleet(
            ledger=self._ledger,
            storage=self._storage,
            notifications=self._notifications,
            scheduler_id=self.scheduler_id,
            lease_ttl_s=cfg.lease_ttl_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            url_ttl_s=cfg.url_ttl_s,
            checkpoint_retention=cfg.checkpoint_retention,
            dispatch_interval_s=cfg.dispatch_interval_s,
        )
        handler = JobHandler(
            ledger=self._ledger,
            storage=self._storage,
            notifications=self._notifications,
            url_ttl_s=cfg.url_ttl_s,
        )
        server = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ]
        )
        jobs_pb2_grpc.add_JobServiceServicer_to_server(
            JobServicer(handler, ApiKeyAuthenticator(self._ledger)), server
        )
        fleet_pb2_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(
                self._fleet, worker_token=self.worker_token, hello_timeout_s=cfg.hello_timeout_s
            ),
            server,
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        if cfg.tls_cert_file and cfg.tls_key_file:
            credentials = grpc.ssl_server_credentials(
                [(cfg.tls_key_file.read_bytes(), cfg.tls_cert_file.read_bytes())]
            )
            self.port = server.add_secure_port(cfg.listen, credentials)
        else:
            self.port = server.add_insecure_port(cfg.listen)
        await server.start()
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._fleet.run(), name="dispatch"))
        self._tasks.append(
            asyncio.create_task(self._fleet.run_sweeper(cfg.sweep_interval_s), name="sweeper")
        )
        webhooks = WebhookSender(
            ledger=self._ledger,
            notifications=self._notifications,
            max_attempts=cfg.webhook_max_attempts,
            backoff_s=cfg.webhook_backoff_s,
            timeout_s=cfg.webhook_timeout_s,
        )
        self._tasks.append(asyncio.create_task(webhooks.run(), name="webhooks"))
        log.info(
            "scheduler started",
            scheduler_id=self.scheduler_id,
            port=self.port,
            storage=type(self._storage).__name__,
        )

    def _make_storage(self) -> ObjectStore:
        cfg = self.config
        if isinstance(cfg.storage, LocalStorage):
            secret = read_or_create_secret(cfg.data_dir / "storage-secret")
            return LocalObjectStore(
                LocalStoreConfig(
                    root_dir=cfg.data_dir / "objects",
                    secret_key=secret.encode(),
                    host=cfg.storage.host,
                    port=cfg.storage.port,
                    public_base_url=cfg.storage.public_base_url,
                )
            )
        return S3ObjectStore(cfg.storage)

    async def wait(self) -> None:
        """Returns after shutdown(); raises if a component task failed."""
        stopped = asyncio.create_task(self._stopped.wait())
        try:
            done, _ = await asyncio.wait(
                [stopped, *self._tasks], return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopped.cancel()
        for task in done:
            if task is not stopped and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Idempotent: ends the worker streams, stops serving, then closes every component."""
        if self._shutdown_started:
            return
        self._shutdown_started = True
        if self._fleet is not None:
            await self._fleet.shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._notifications is not None:
            await self._notifications.close()
        if self._storage is not None:
            with contextlib.suppress(Exception):
                await self._storage.close()
        if self._ledger is not None:
            await self._ledger.close()
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)
        self._stopped.set()
        log.info("scheduler stopped", scheduler_id=self.scheduler_id)
