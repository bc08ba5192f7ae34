"""Scheduler configuration: one frozen value built once from flags and the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.scheduler.storage import S3Config

DEFAULT_DATA_DIR = Path(".lorafleet")


@dataclass(frozen=True, kw_only=True)
class LocalStorage:
    """The embedded default: objects under data_dir/objects, served over HTTP by the scheduler."""

    host: str = "127.0.0.1"
    port: int = 0
    # What workers use to reach it (e.g. http://scheduler.lan:8081); default http://host:port.
    public_base_url: str | None = None


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    listen: str = "127.0.0.1:50051"
    # Empty: an embedded Postgres in data_dir/postgres.
    database_url: str = ""
    data_dir: Path = DEFAULT_DATA_DIR
    # Workers present it as `authorization: Bearer <token>`; empty: one is generated and kept in
    # data_dir/worker-token.
    worker_token: str = ""
    lease_ttl_s: float = 60.0
    heartbeat_interval_s: float = 10.0
    # How often each replica looks for expired leases and leftover checkpoints.
    sweep_interval_s: float = 5.0
    # A safety net under LISTEN/NOTIFY: idle workers are also offered work this often.
    dispatch_interval_s: float = 5.0
    checkpoint_retention: int = 3
    url_ttl_s: int = 3600
    storage: S3Config | LocalStorage = field(default_factory=LocalStorage)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    scheduler_id: str = ""
    # Seconds a worker has to send Hello after connecting.
    hello_timeout_s: float = 10.0
    # Webhook retries: backoff doubles from webhook_backoff_s (capped at 10 min), with jitter.
    webhook_max_attempts: int = 8
    webhook_backoff_s: float = 2.0
    webhook_timeout_s: float = 10.0

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, /, **overrides: object
    ) -> SchedulerConfig:
        """`LORAFLEET_*` and `DATABASE_URL` (README, "Configuration"); keyword overrides win."""
        e = os.environ if env is None else env
        storage: S3Config | LocalStorage
        if e.get("LORAFLEET_S3_BUCKET"):
            storage = S3Config(
                bucket=e["LORAFLEET_S3_BUCKET"],
                endpoint_url=e.get("LORAFLEET_S3_ENDPOINT_URL") or None,
                region=e.get("LORAFLEET_S3_REGION", "us-east-1"),
                addressing_style="path" if e.get("LORAFLEET_S3_ENDPOINT_URL") else "auto",
                create_bucket=e.get("LORAFLEET_S3_CREATE_BUCKET", "") in ("1", "true", "yes"),
            )
        else:
            storage = LocalStorage(
                host=e.get("LORAFLEET_STORAGE_HOST", "127.0.0.1"),
                port=int(e.get("LORAFLEET_STORAGE_PORT", "0")),
                public_base_url=e.get("LORAFLEET_STORAGE_PUBLIC_URL") or None,
            )
        values: dict[str, object] = dict(
            listen=e.get("LORAFLEET_LISTEN", "127.0.0.1:50051"),
            database_url=e.get("DATABASE_URL", ""),
            data_dir=Path(e.get("LORAFLEET_DATA_DIR", str(DEFAULT_DATA_DIR))),
            worker_token=e.get("LORAFLEET_WORKER_TOKEN", ""),
            lease_ttl_s=float(e.get("LORAFLEET_LEASE_TTL_S", "60")),
            heartbeat_interval_s=float(e.get("LORAFLEET_HEARTBEAT_INTERVAL_S", "10")),
            checkpoint_retention=int(e.get("LORAFLEET_CHECKPOINT_RETENTION", "3")),
            url_ttl_s=int(e.get("LORAFLEET_URL_TTL_S", "3600")),
            storage=storage,
            tls_cert_file=Path(e["LORAFLEET_TLS_CERT"]) if e.get("LORAFLEET_TLS_CERT") else None,
            tls_key_file=Path(e["LORAFLEET_TLS_KEY"]) if e.get("LORAFLEET_TLS_KEY") else None,
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
