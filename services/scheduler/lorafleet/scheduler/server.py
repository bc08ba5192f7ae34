"""The scheduler process: ledger, storage, LISTEN hub, gRPC services and sweepers in one lifecycle.

async with Scheduler(config) as scheduler:   # started; scheduler.port is bound
    await scheduler.wait()                   # until close() or a component fails
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import socket
import uuid
from pathlib import Path

import asyncpg
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from prometheus_client import REGISTRY

from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.core.settings import ConfigError
from lorafleet.core.telemetry import MetricsServer
from lorafleet.fleet.v1 import fleet_pb2, fleet_pb2_grpc
from lorafleet.jobs.v1 import jobs_pb2, jobs_pb2_grpc
from lorafleet.ledger.database import EmbeddedPostgres, migrate
from lorafleet.ledger.ledger import Ledger, Quarantine
from lorafleet.scheduler.auth import ApiKeyAuthenticator
from lorafleet.scheduler.background import BackgroundTasks
from lorafleet.scheduler.checkpoint_interval import CheckpointIntervals, CheckpointIntervalSettings
from lorafleet.scheduler.config import LocalStorage, SchedulerConfig
from lorafleet.scheduler.dispatcher import Dispatcher
from lorafleet.scheduler.identity import build_verifiers
from lorafleet.scheduler.job_handler import JobHandler
from lorafleet.scheduler.metrics import LEDGER_UP, JobStateCollector
from lorafleet.scheduler.notifications import Notifications
from lorafleet.scheduler.servicers import JobServicer, WorkerServicer
from lorafleet.scheduler.sessions import GateBounds, StreamBounds, StreamGate, WorkerSessions
from lorafleet.scheduler.signing import UrlSigner
from lorafleet.scheduler.storage import (
    LocalObjectStore,
    LocalStoreConfig,
    ObjectStore,
    S3ObjectStore,
)
from lorafleet.scheduler.sweeper import Sweeper
from lorafleet.scheduler.webhooks import AddressPolicy, WebhookSender
from lorafleet.scheduler.worker_handler import WorkerHandler

log = structlog.get_logger(__name__)

SERVICE_NAMES = (
    jobs_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
    fleet_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
)


def tune_gc() -> None:
    """For a scheduler process holding thousands of streams (docs/BENCHMARKS.md, the 5000-stream
    p99): CPython's full collections walk every tracked object, and with 5000 sessions they
    took 0.3-0.56 s each, 12 times in three minutes, stalling every grant in flight. Startup's
    objects (modules, descriptors) are frozen out of the collector's walks, and full collections
    are made rare: one after 100 middle ones instead of 10 (and, as always, only once a quarter
    more objects survived than at the last one), young ones every 10 000 net allocations (at
    50 000 a young collection itself took up to 0.1 s). Called once, by the process's entry
    point, after start-up."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)


def read_or_create_secret(path: Path, nbytes: int = 32) -> str:
    """A secret kept in the data directory (mode 0600) so restarts keep URLs and tokens valid.

    Created whole or not at all (written beside it, then linked into place), so replicas
    starting together on one data directory all read the same complete secret."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(nbytes)
    draft = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        try:
            os.link(draft, path)
        except FileExistsError:
            return path.read_text().strip()  # another replica's, complete
    finally:
        draft.unlink()
    return value


class Scheduler(AsyncLifecycle):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler_id = config.scheduler_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.port = 0
        self.database_url = config.database_url
        self.worker_token = config.worker_token
        self.identity_secret = ""
        self._embedded: EmbeddedPostgres | None = None
        self._ledger: Ledger | None = None
        self._storage: ObjectStore | None = None
        self._notifications: Notifications | None = None
        self._sessions: WorkerSessions | None = None
        self._dispatcher: Dispatcher | None = None
        self._worker_handler: WorkerHandler | None = None
        self._sweeper: Sweeper | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics: MetricsServer | None = None
        self._job_states: JobStateCollector | None = None
        self.metrics_port = 0
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
    def sessions(self) -> WorkerSessions:
        """The workers connected to this replica."""
        assert self._sessions is not None, "start() first"
        return self._sessions

    @property
    def sweeper(self) -> Sweeper:
        assert self._sweeper is not None, "start() first"
        return self._sweeper

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
        # Only this scheduler and the local supervisor (`lorafleet up`) hold it; workers get a
        # token for their own machine id (identity.py).
        self.identity_secret = read_or_create_secret(cfg.data_dir / "identity-secret")
        self._ledger = await Ledger.connect(
            self.database_url,
            max_size=cfg.database_pool_size,
            quarantine=Quarantine(
                threshold=cfg.quarantine_fault_threshold,
                window_s=cfg.quarantine_window_s,
                empty_lease_limit=cfg.quarantine_empty_leases,
            ),
            fleet_max_vram_mb=cfg.fleet_max_vram_mb,
            standing_min_age_s=cfg.standing_min_age_s,
        )
        if filled := await self._ledger.fill_warm_keys():
            log.info("warm keys computed for jobs submitted before warm dispatch", jobs=filled)
        self._storage = self._make_storage()
        await self._storage.start()
        self._notifications = Notifications(self.database_url)
        self._tasks.append(asyncio.create_task(self._notifications.run(), name="listen"))
        async with asyncio.timeout(30):
            await self._notifications.wait_connected()
        signer = UrlSigner(
            storage=self._storage,
            ledger=self._ledger,
            url_ttl_s=cfg.url_ttl_s,
            lease_put_ttl_s=cfg.lease_put_ttl_s,
            lease_get_ttl_s=cfg.lease_get_ttl_s,
        )
        self._sweeper = Sweeper(
            ledger=self._ledger,
            storage=self._storage,
            checkpoint_retention=cfg.checkpoint_retention,
            replica_id=self.scheduler_id,
            upload_url_ttl_s=cfg.lease_put_ttl_s,
            machine_retention_s=cfg.machine_retention_s,
            lease_progress_timeout_s=cfg.lease_progress_timeout_s,
            lease_ttl_s=cfg.lease_ttl_s,
            outage_after_s=cfg.outage_after_s,
        )
        # Before anything can expire a lease: if every replica was down, the workers get a TTL
        # from now to reconnect in (the outage was not theirs).
        extended = await self._ledger.start_replica(
            self.scheduler_id, cfg.lease_ttl_s, down_after_s=cfg.outage_after_s
        )
        if extended:
            log.warning(
                "every replica was down; running leases get a lease TTL to reconnect",
                leases=extended,
                lease_ttl_s=cfg.lease_ttl_s,
            )
        # The worker stream: the sessions remember, the dispatcher grants and revokes, the
        # handler acts on each worker message (see the package docstring).
        self._sessions = WorkerSessions(
            bounds=StreamBounds(
                outbox_limit=cfg.worker_outbox_limit,
                messages_per_s=cfg.worker_messages_per_s,
                message_burst=cfg.worker_message_burst,
            ),
            gate=StreamGate(
                GateBounds(
                    streams_per_peer_per_min=cfg.worker_streams_per_peer_per_min,
                    stream_burst_per_peer=cfg.worker_stream_burst_per_peer,
                    hellos_per_token_per_s=cfg.worker_hellos_per_s,
                    hello_burst_per_token=cfg.worker_hello_burst,
                    hellos_per_verified_machine_per_min=cfg.worker_hellos_per_verified_machine_per_min,
                    hello_burst_per_verified_machine=cfg.worker_hello_burst_per_verified_machine,
                    log_lines_per_peer_per_min=cfg.worker_log_lines_per_peer_per_min,
                    log_burst_per_peer=max(1, round(2 * cfg.worker_log_lines_per_peer_per_min)),
                )
            ),
        )
        webhook_policy = AddressPolicy.from_text(cfg.webhook_allowed_networks)
        handler = JobHandler(
            ledger=self._ledger,
            storage=self._storage,
            signer=signer,
            notifications=self._notifications,
            webhook_policy=webhook_policy,
            price_per_gpu_hour=cfg.price_per_gpu_hour,
            estimate_window_s=cfg.estimate_window_s,
            estimate_min_machines=cfg.estimate_min_machines,
            estimate_prior_s_per_step=cfg.estimate_prior_s_per_step,
            min_plausible_s_per_step=cfg.min_plausible_seconds_per_step,
            fleet_max_vram_mb=cfg.fleet_max_vram_mb,
            fleet_cpu_only=cfg.fleet_accelerator == "cpu",
            watch_keepalive_s=cfg.watch_keepalive_s,
        )
        background = BackgroundTasks()
        self._dispatcher = Dispatcher(
            ledger=self._ledger,
            signer=signer,
            sessions=self._sessions,
            background=background,
            notifications=self._notifications,
            lease_ttl_s=cfg.lease_ttl_s,
            dispatch_interval_s=cfg.dispatch_interval_s,
            warm_dispatch_bound_s=cfg.warm_dispatch_bound_s,
            checkpoint_intervals=CheckpointIntervals(
                ledger=self._ledger,
                pace=handler.spec_pace,
                settings=CheckpointIntervalSettings(
                    cost_prior_s=cfg.checkpoint_cost_prior_s,
                    interruption_prior_s=cfg.interruption_prior_s,
                    interruption_window_s=cfg.interruption_window_s,
                    min_steps=cfg.checkpoint_min_steps,
                    figures_ttl_s=cfg.interruption_figures_ttl_s,
                ),
            ),
        )
        self._worker_handler = WorkerHandler(
            ledger=self._ledger,
            storage=self._storage,
            signer=signer,
            sweeper=self._sweeper,
            sessions=self._sessions,
            dispatcher=self._dispatcher,
            background=background,
            scheduler_id=self.scheduler_id,
            lease_ttl_s=cfg.lease_ttl_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            identities=build_verifiers(
                local_secret=self.identity_secret,
                required=cfg.require_provider_identity,
                salad_container_group_ids=cfg.salad_container_group_ids,
                salad_jwks_url=cfg.salad_jwks_url,
                ec2_certificates_pem=None
                if cfg.ec2_identity_certificate_file is None
                else cfg.ec2_identity_certificate_file.read_bytes(),
                ec2_account_ids=cfg.ec2_account_ids,
            ),
        )
        server = grpc.aio.server(
            # A span per JobService call, continuing the caller's trace (the CLI's). Not for
            # the worker stream, health or reflection: the interceptor handles only
            # generator-style streaming handlers, and a worker stream's work is traced per lease
            # (grant, checkpoint, success) in the job's trace.
            interceptors=[aio_server_interceptor(filter_=filters.service_name(SERVICE_NAMES[0]))],
            options=[
                # gRPC binds with SO_REUSEPORT by default: a second scheduler on the same
                # LORAFLEET_LISTEN would share the port silently. Off: it fails to bind.
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        jobs_pb2_grpc.add_JobServiceServicer_to_server(
            JobServicer(handler, ApiKeyAuthenticator(self._ledger)), server
        )
        fleet_pb2_grpc.add_WorkerServiceServicer_to_server(
            WorkerServicer(
                self._worker_handler,
                worker_token=self.worker_token,
                hello_timeout_s=cfg.hello_timeout_s,
            ),
            server,
        )
        health_servicer = health.aio.HealthServicer()
        self._health = health_servicer
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            if cfg.tls_cert_file and cfg.tls_key_file:
                credentials = grpc.ssl_server_credentials(
                    [(cfg.tls_key_file.read_bytes(), cfg.tls_cert_file.read_bytes())]
                )
                self.port = server.add_secure_port(cfg.listen, credentials)
            else:
                self.port = server.add_insecure_port(cfg.listen)
        except RuntimeError:  # grpcio raises "Failed to bind"; older ones return 0
            self.port = 0
        if self.port == 0:
            raise ConfigError(
                f"--listen / LORAFLEET_LISTEN: cannot serve gRPC on {cfg.listen}: the address"
                " is in use (another scheduler?) or not available on this machine"
            )
        await server.start()
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._dispatcher.run(), name="dispatch"))
        self._tasks.append(
            asyncio.create_task(self._sweeper.run(cfg.sweep_interval_s), name="sweeper")
        )
        self._tasks.append(
            asyncio.create_task(self._sweeper.attend(cfg.attend_interval_s), name="attend")
        )
        webhooks = WebhookSender(
            ledger=self._ledger,
            notifications=self._notifications,
            policy=webhook_policy,
            max_attempts=cfg.webhook_max_attempts,
            backoff_s=cfg.webhook_backoff_s,
            timeout_s=cfg.webhook_timeout_s,
        )
        self._tasks.append(asyncio.create_task(webhooks.run(), name="webhooks"))
        self._tasks.append(
            asyncio.create_task(self._watch_ledger(cfg.sweep_interval_s), name="ledger health")
        )
        if cfg.metrics_port is not None:
            self._job_states = JobStateCollector(
                self._ledger.count_jobs_by_state, asyncio.get_running_loop()
            )
            REGISTRY.register(self._job_states)
            self._metrics = MetricsServer(port=cfg.metrics_port)
            await self._metrics.start()
            self.metrics_port = self._metrics.port
        log.info(
            "scheduler started",
            scheduler_id=self.scheduler_id,
            port=self.port,
            storage=type(self._storage).__name__,
            metrics_port=self.metrics_port or None,
        )

    async def _watch_ledger(self, interval_s: float) -> None:
        """The health service says NOT_SERVING while the ledger cannot be reached (a load
        balancer or a client's health check then goes elsewhere), and SERVING once it can."""
        serving = True
        while True:
            try:
                async with asyncio.timeout(max(interval_s, 2.0)):
                    await self.ledger.count_queued(1)
                reachable = True
            except Exception as exc:
                reachable = False
                error = str(exc) or type(exc).__name__
            LEDGER_UP.set(1 if reachable else 0)
            if reachable != serving and self._health is not None:
                serving = reachable
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if serving
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in ("", *SERVICE_NAMES):
                    await self._health.set(name, status)
                if serving:
                    log.info("ledger reachable again; health is SERVING")
                else:
                    log.warning("ledger unreachable; health is NOT_SERVING", error=error)
            await asyncio.sleep(interval_s)

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
                ),
                # A lease's upload URLs die with it (docs/DESIGN.md, "URLs and stored objects").
                lease_is_live=self.ledger.lease_is_live,
            )
        return S3ObjectStore(cfg.storage)

    async def wait(self) -> None:
        """Returns after close(); raises if a component task failed."""
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

    async def close(self, grace_s: float = 5.0) -> None:
        """Idempotent: ends the worker streams, stops serving, then closes every component."""
        if self._shutdown_started:
            return
        self._shutdown_started = True
        if self._worker_handler is not None:
            await self._worker_handler.shutdown()
        if self._metrics is not None:
            await self._metrics.close()
        if self._job_states is not None:
            REGISTRY.unregister(self._job_states)
            self._job_states = None
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
