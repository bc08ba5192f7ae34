"""Scheduler configuration: every option declared once (type, default, variable, help).

`lorafleet scheduler --help` lists them as flags; each also reads `LORAFLEET_<NAME>` (or the
variables its `validation_alias` names). Bad values stop the scheduler at start with a message
naming the flag and the variable (`lorafleet.core.settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, Field, model_validator

from lorafleet.core.model import MIN_PLAUSIBLE_S_PER_STEP
from lorafleet.core.settings import ServiceSettings
from lorafleet.ledger.ledger import STANDING_MIN_AGE_S
from lorafleet.scheduler.identity import SALAD_JWKS_URL
from lorafleet.scheduler.job_handler import PRIOR_S_PER_STEP
from lorafleet.scheduler.storage import S3Config
from lorafleet.scheduler.webhooks import canonical_networks

DEFAULT_DATA_DIR = Path(".lorafleet")


@dataclass(frozen=True, kw_only=True)
class LocalStorage:
    """The embedded default: objects under data_dir/objects, served over HTTP by the scheduler."""

    host: str
    port: int
    # What workers use to reach it (e.g. http://scheduler.lan:8081); None: http://host:port.
    public_base_url: str | None


class SchedulerConfig(ServiceSettings):
    listen: str = Field("127.0.0.1:50051", description="host:port to serve gRPC on")
    database_url: str = Field(
        "",
        validation_alias=AliasChoices("DATABASE_URL", "LORAFLEET_DATABASE_URL"),
        description="Postgres URL; empty: an embedded Postgres in the data directory",
    )
    database_pool_size: int = Field(
        20,
        ge=2,
        le=1000,
        description="most connections this scheduler holds to Postgres (each replica its own:"
        " keep replicas x this under the server's max_connections)",
    )
    data_dir: Path = Field(
        DEFAULT_DATA_DIR, description="embedded Postgres, local objects and generated secrets"
    )
    worker_token: str = Field(
        "",
        description="the token workers present (prefer the variable); empty: one is generated"
        " and kept in <data dir>/worker-token",
    )
    scheduler_id: str = Field("", description="this replica's name; default hostname-random")
    lease_ttl_s: float = Field(
        60.0, gt=0, le=3600, description="seconds without a heartbeat before a job is re-queued"
    )
    heartbeat_interval_s: float = Field(
        10.0, gt=0, le=600, description="how often workers are told to heartbeat"
    )
    sweep_interval_s: float = Field(
        5.0, gt=0, le=600, description="how often each replica expires leases and prunes"
    )
    watch_keepalive_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="how often a job watch with nothing new sends the job as it is, so a client"
        " can tell a quiet job from a replica or a path gone silent",
    )
    dispatch_interval_s: float = Field(
        5.0, gt=0, le=600, description="safety net under LISTEN/NOTIFY: re-offer work this often"
    )
    hello_timeout_s: float = Field(
        10.0, gt=0, le=600, description="seconds a worker has to send Hello after connecting"
    )
    worker_outbox_limit: int = Field(
        64, ge=4, le=10_000, description="replies a worker may leave unread before it is dropped"
    )
    worker_messages_per_s: float = Field(
        20.0, gt=0, le=10_000, description="messages per second one worker stream may send"
    )
    worker_message_burst: int = Field(
        100, ge=1, le=100_000, description="messages one worker stream may send at once"
    )
    # Bounds per token holder (sessions.StreamGate): the ones above hold per stream, and a
    # reconnect loop opens a new stream each time.
    worker_streams_per_peer_per_min: float = Field(
        60.0,
        ge=0,
        le=1_000_000,
        description="worker streams one peer address (an IPv6 /64) may open per minute on"
        " average, past --worker-stream-burst-per-peer; stops a reconnect loop from one host."
        " Behind a proxy every worker shares the proxy's address: raise it, or 0 for no bound",
    )
    worker_stream_burst_per_peer: int = Field(
        30,
        ge=1,
        le=1_000_000,
        description="worker streams one peer address may open at once (several workers on one"
        " host, e.g. `lorafleet up` with one per GPU, start together)",
    )
    worker_hellos_per_s: float = Field(
        20.0,
        ge=0,
        le=1_000_000,
        description="Hellos per second accepted per worker token on average, past"
        " --worker-hello-burst, from machines no provider vouched for (and Hellos whose proof"
        " failed). Every worker of a fleet shares one token, so this bounds the whole fleet's"
        " unverified connection rate (per replica); an honest fleet reconnects once per"
        " restart or network blip; 0: no bound",
    )
    worker_hello_burst: int = Field(
        2000,
        ge=1,
        le=1_000_000,
        description="Hellos per worker token at once: keep it above the fleet's size, so every"
        " worker can reconnect at once after a scheduler restart",
    )
    worker_hellos_per_verified_machine_per_min: float = Field(
        12.0,
        ge=0,
        le=1_000_000,
        description="Hellos per minute of one provider-verified machine on average, past"
        " --worker-hello-burst-per-verified-machine. Verified Hellos are charged here and not to"
        " the worker token's budget, so a flood of unverified streams cannot delay them; 0: no"
        " bound",
    )
    worker_hello_burst_per_verified_machine: int = Field(
        6,
        ge=1,
        le=1_000_000,
        description="Hellos of one provider-verified machine at once",
    )
    worker_log_lines_per_peer_per_min: float = Field(
        60.0,
        ge=0,
        le=1_000_000,
        description="log lines about one peer address's streams (connects, refusals, notices)"
        " per minute, after a burst of twice as many; the rest are counted in the next line;"
        " 0: no bound",
    )
    machine_retention_s: float = Field(
        3600.0,
        gt=0,
        le=365 * 86400.0,
        description="seconds after which a machine seen last that long ago, never verified by a"
        " provider and named by no lease, ban or sample task, is deleted from the node registry"
        " (the rows of a reconnect loop's made-up machine ids); at least --lease-ttl-s",
    )
    lease_progress_timeout_s: float = Field(
        1800.0,
        ge=1,
        le=7 * 86400.0,
        description="seconds a lease may hold a job without verified progress (its grant, then a"
        " checkpoint the store verified past the next multiple of the job's checkpointing_steps)"
        " before it is revoked as a node fault; heartbeats are not progress. This is the bound"
        " for a job checkpointing every 100 steps (the ledger's reference interval,"
        " lorafleet_reference_interval()): model load plus one interval"
        " on the slowest node; longer intervals scale it, and each 100 class images to generate"
        " adds as much again",
    )
    quarantine_fault_threshold: int = Field(
        3,
        ge=1,
        le=1000,
        description="node faults within the quarantine window after which a machine is granted"
        " nothing (keep it equal to the scaler's --fault-threshold)",
    )
    quarantine_window_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86400.0,
        description="seconds a node fault counts toward quarantine (the scaler's --fault-window-s)",
    )
    standing_min_age_s: float = Field(
        STANDING_MIN_AGE_S,
        ge=0,
        le=30 * 86400.0,
        description="a machine's internal error counts toward a job's max_failures, and its"
        " input fault confirms another's, only if it delivered a verified result this many"
        " seconds before the job was submitted (no node fault since, most of its recent"
        " attempts succeeded): machines arriving together cannot fail a job; their failures"
        " count as node faults",
    )
    warm_dispatch_bound_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="a worker is offered a queued job it holds warm (the same compiled shape,"
        " else the same base model) before older ones, but no job waits more than this many"
        " seconds longer than strict queue order would make it; 0: strict queue order",
    )
    # checkpointing_steps auto (checkpoint_interval.py): Young-Daly, sqrt(2 x cost x mean time
    # between interruptions), in steps at the fleet's pace on the job's shape.
    checkpoint_cost_prior_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        description="checkpoint cost (training stall plus upload, seconds) assumed for a worker"
        " that has measured none yet (workers report their own in Ready)",
    )
    interruption_prior_s: float = Field(
        4 * 3600.0,
        gt=0,
        le=365 * 86400.0,
        description="mean lease-seconds between interruptions (expiry, drain) assumed for a GPU"
        " class with little history; weighs as one interruption beside the ledger's counts",
    )
    interruption_window_s: float = Field(
        7 * 86400.0,
        gt=0,
        le=365 * 86400.0,
        description="how far back the ledger's interruptions and lease-hours per GPU class count",
    )
    checkpoint_min_steps: int = Field(
        10,
        ge=1,
        le=100_000,
        description="the shortest automatic checkpoint interval, in steps (the longest is the"
        " job's max_train_steps)",
    )
    interruption_figures_ttl_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="how long a GPU class's interruption count and a job shape's pace are reused"
        " between automatic intervals (0: read at every grant)",
    )
    quarantine_empty_leases: int = Field(
        10,
        ge=1,
        le=100_000,
        description="leases within the quarantine window that ended without a checkpoint"
        " (given up by saying Ready, drained, expired) after which a machine is granted nothing"
        " until the window passes: taking and dropping leases collects their input URLs",
    )
    checkpoint_retention: int = Field(
        3, ge=1, le=1000, description="checkpoints kept per running job (newest first)"
    )
    url_ttl_s: int = Field(
        3600,
        ge=1,
        le=7 * 86400,
        description="lifetime of presigned URLs users get",
    )
    lease_put_ttl_s: int = Field(
        300,
        ge=1,
        le=86400,
        description="lifetime of a lease's upload URLs (renewed on heartbeats while it lives)",
    )
    lease_get_ttl_s: int = Field(
        300,
        ge=1,
        le=86400,
        description="lifetime of a lease's read URLs (instance and class images, checkpoints),"
        " renewed on heartbeats while it lives; the local store also refuses them once the"
        " lease ends, S3 at this TTL",
    )
    # Object storage: S3 when a bucket is named, else the embedded local store.
    s3_bucket: str = Field("", description="S3 bucket; empty: the embedded local store")
    s3_endpoint_url: str = Field("", description="S3-compatible endpoint (MinIO, R2); empty: AWS")
    s3_region: str = Field("us-east-1", description="S3 region")
    s3_create_bucket: bool = Field(False, description="create the bucket when it is missing")
    storage_host: str = Field("127.0.0.1", description="where the local store serves HTTP")
    storage_port: int = Field(0, ge=0, le=65535, description="local store port; 0: any free")
    storage_public_url: str = Field(
        "",
        description="base URL workers use to reach the local store (default http://host:port)",
    )
    tls_cert_file: Path | None = Field(
        None,
        validation_alias=AliasChoices("LORAFLEET_TLS_CERT", "LORAFLEET_TLS_CERT_FILE"),
        description="PEM certificate: serve gRPC over TLS (with --tls-key-file)",
    )
    tls_key_file: Path | None = Field(
        None,
        validation_alias=AliasChoices("LORAFLEET_TLS_KEY", "LORAFLEET_TLS_KEY_FILE"),
        description="PEM private key for --tls-cert-file",
    )
    fleet_max_vram_mb: int = Field(
        24_576,
        ge=0,
        le=16 * 1024 * 1024,
        description="accelerator memory of the largest node class the fleet runs, in MiB: a job"
        " whose memory need (its min_vram_mb, or the family's estimate for its shape, the larger)"
        " exceeds it is refused at submit, naming the field that would make it fit (judged from"
        " this, not the nodes connected: a fleet scaled to zero has none). Default: the 24 GB"
        " RTX 3090/4090 class; 0: no check (jobs no node can hold wait in the queue)",
    )
    fleet_accelerator: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="what the fleet's nodes train on: cuda (GPU nodes), or cpu (`lorafleet up` on"
        " a machine without a GPU sets it): a CPU fleet refuses a quantized base"
        " (base_quantization nf4 or fp8) at submit, naming the field",
    )
    price_per_gpu_hour: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="dollars per GPU-hour, for EstimateJob and API keys' spend limits;"
        " 0: no prices (estimates give seconds only, spend limits never bite)",
    )
    estimate_window_s: float = Field(
        7 * 86400.0,
        gt=0,
        le=365 * 86400.0,
        description="how far back EstimateJob and spend limits look for verified completions of"
        " the same job shape",
    )
    estimate_min_machines: int = Field(
        3,
        ge=1,
        le=1000,
        description="provider-verified machines (one figure each) that must have finished jobs of"
        " a shape before EstimateJob gives a figure and spend limits use it",
    )
    estimate_prior_s_per_step: float = Field(
        PRIOR_S_PER_STEP,
        gt=0,
        le=3600,
        description="what spend limits assume per step of a shape not measured yet: seconds per"
        " 1024x1024 image (scaled by resolution, batch, accumulation; x1.5 with text-encoder"
        " training)",
    )
    min_plausible_seconds_per_step: float = Field(
        MIN_PLAUSIBLE_S_PER_STEP,
        gt=0,
        le=3600,
        description="the fastest pace a verified completion may show, in seconds per 1024x1024"
        " image step (scaled to each job shape like the prior); faster ones are garbage stored"
        " fast, not training, and count for no estimate or spend limit. Default: about five"
        " times an H100's SDXL LoRA step",
    )
    webhook_max_attempts: int = Field(8, ge=1, le=100, description="webhook delivery attempts")
    webhook_backoff_s: float = Field(
        2.0, gt=0, le=3600, description="first webhook retry delay (doubles, with jitter)"
    )
    webhook_timeout_s: float = Field(10.0, gt=0, le=300, description="webhook request timeout")
    webhook_allowed_networks: Annotated[str, AfterValidator(canonical_networks)] = Field(
        "",
        description="comma-separated CIDRs webhooks may reach besides public addresses"
        " (e.g. 127.0.0.0/8 when receivers run beside the scheduler); empty: public only",
    )
    # Provider identities (identity.py): where a worker's machine id comes from.
    require_provider_identity: bool = Field(
        False,
        description="refuse a worker whose Hello carries no valid provider identity (SaladCloud"
        " instance token, EC2 identity document, or `lorafleet up`'s local token)",
    )
    salad_container_group_ids: str = Field(
        "",
        description="comma-separated SaladCloud container group ids whose instance tokens"
        " identify workers; empty: SaladCloud tokens are refused",
    )
    salad_jwks_url: str = Field(
        SALAD_JWKS_URL,
        pattern=r"^https?://\S+$",
        description="SaladCloud's workload JWKS, which signs instance tokens",
    )
    ec2_identity_certificate_file: Path | None = Field(
        None,
        description="PEM file of the AWS public certificates (one per region) that sign EC2"
        " instance identity documents; unset: EC2 documents are refused",
    )
    ec2_account_ids: str = Field(
        "",
        description="comma-separated AWS account ids whose instances may join (with"
        " --ec2-identity-certificate-file)",
    )

    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        # Its own name per service: one environment (a host running a scheduler and a worker,
        # `lorafleet up`'s children) must not make two processes claim one port.
        validation_alias=AliasChoices("LORAFLEET_SCHEDULER_METRICS_PORT"),
        description="serve Prometheus metrics on this port (/metrics, all interfaces; 0: any"
        " free port); unset: no metrics endpoint",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SchedulerConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if (self.ec2_identity_certificate_file is None) != (not self.ec2_account_ids):
            raise ValueError("ec2_identity_certificate_file and ec2_account_ids go together")
        if self.machine_retention_s < self.lease_ttl_s:
            # A machine id is held for its stream until a TTL of silence; its row must outlive
            # that, or a stranger could take the id sooner than the rule allows.
            raise ValueError("machine_retention_s must be at least lease_ttl_s")
        if self.heartbeat_interval_s * 3 > min(
            self.lease_put_ttl_s, self.lease_get_ttl_s, self.url_ttl_s
        ):
            # A lease's URLs are renewed on a heartbeat once a third of their life is left.
            raise ValueError(
                "heartbeat_interval_s must be at most a third of lease_put_ttl_s,"
                " lease_get_ttl_s and url_ttl_s"
            )
        return self

    @property
    def attend_interval_s(self) -> float:
        """How often each replica tells the ledger it reaches it (sweeper.Sweeper.attend)."""
        return min(1.0, self.sweep_interval_s)

    @property
    def outage_after_s(self) -> float:
        """How long the ledger must have heard from no replica for that to count as an outage
        (of Postgres, or of every replica) that gives live leases a TTL back: three attend
        intervals and at least 2 s (a replica's event loop may stall that long on a busy
        machine), but never more than a TTL, or an outage between the two would expire every
        lease."""
        return min(max(3 * self.attend_interval_s, 2.0), self.lease_ttl_s)

    @property
    def storage(self) -> S3Config | LocalStorage:
        if self.s3_bucket:
            return S3Config(
                bucket=self.s3_bucket,
                endpoint_url=self.s3_endpoint_url or None,
                region=self.s3_region,
                addressing_style="path" if self.s3_endpoint_url else "auto",
                create_bucket=self.s3_create_bucket,
            )
        return LocalStorage(
            host=self.storage_host,
            port=self.storage_port,
            public_base_url=self.storage_public_url or None,
        )
