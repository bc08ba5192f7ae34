"""The scaler's options, declared once (`core.settings`): `--flag`, `LORAFLEET_*` variable, help.

The SaladCloud API key is read from the environment only (`SALAD_API_KEY`, or
`LORAFLEET_SALAD_API_KEY`), never from a flag: a flag would show in `ps`.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Literal, Self

from pydantic import AliasChoices, Field, SecretStr, model_validator

from lorafleet.core.model import MIN_PLAUSIBLE_S_PER_STEP
from lorafleet.core.settings import ServiceSettings
from lorafleet.scaler.ec2 import Ec2Config
from lorafleet.scaler.policy import PolicyConfig
from lorafleet.scaler.salad import DEFAULT_BASE_URL, SaladConfig

SALAD_NAME = r"^[a-z][a-z0-9-]{0,61}[a-z0-9]$"
SALAD_MAX_REPLICAS = 500


class ScalerSettings(ServiceSettings):
    provider: Literal["local", "salad", "ec2"] = Field(
        "local", description="where workers run: local processes, SaladCloud, or EC2 spot"
    )
    tick_interval_s: float = Field(
        30.0, gt=0, le=3600, description="seconds between two looks at the fleet"
    )
    dry_run: bool = Field(False, description="print the decisions without acting on them")
    scaler_id: str = Field("", description="this scaler's name in its decisions; default hostname")
    lock_wait_s: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="--once: seconds to wait for the scaler lock; then exit 1 naming its holder",
    )

    # -- the ledger (the scheduler's Postgres) -------------------------------------------------
    database_url: str = Field(
        "",
        validation_alias=AliasChoices("DATABASE_URL", "LORAFLEET_DATABASE_URL"),
        description="the scheduler's Postgres URL; empty: the embedded one in the data directory",
    )
    data_dir: Path = Field(
        Path(".lorafleet"), description="the scheduler's data directory (embedded Postgres)"
    )

    # -- local worker processes ----------------------------------------------------------------
    scheduler_address: str = Field(
        "127.0.0.1:50051", description="where local workers connect (the local provider)"
    )
    worker_token: str = Field(
        "",
        description="the workers' token for the local provider (prefer the variable); empty:"
        " <data dir>/worker-token",
    )

    # -- SaladCloud ----------------------------------------------------------------------------
    salad_organization: str | None = Field(
        None, pattern=SALAD_NAME, description="SaladCloud organization name"
    )
    salad_project: str | None = Field(
        None, pattern=SALAD_NAME, description="SaladCloud project name"
    )
    salad_group: str | None = Field(
        None, pattern=SALAD_NAME, description="SaladCloud container group running the workers"
    )
    salad_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("LORAFLEET_SALAD_API_KEY", "SALAD_API_KEY"),
        description="SaladCloud API key (environment only)",
    )
    salad_base_url: str = Field(DEFAULT_BASE_URL, description="SaladCloud API base URL")
    salad_request_timeout_s: float = Field(
        10.0, gt=0, le=120, description="timeout of one SaladCloud API request"
    )
    salad_deadline_s: float = Field(
        60.0, gt=0, le=600, description="how long one SaladCloud call keeps retrying"
    )

    # -- EC2 spot ------------------------------------------------------------------------------
    ec2_region: str | None = Field(None, min_length=1, description="AWS region of the fleet")
    ec2_launch_template_id: str | None = Field(
        None, pattern=r"^lt-[0-9a-f]+$", description="launch template of the worker instances"
    )
    ec2_launch_template_version: str = Field(
        "$Latest", min_length=1, description="launch template version ($Latest, $Default, N)"
    )
    ec2_fleet: str = Field(
        "lorafleet",
        pattern=r"^[A-Za-z0-9._:/=+@-]{1,128}$",
        description="value of the lorafleet:fleet tag marking this fleet's instances",
    )
    ec2_subnet_id: str | None = Field(
        None, pattern=r"^subnet-[0-9a-f]+$", description="subnet to launch into (else template's)"
    )
    ec2_endpoint_url: str | None = Field(None, description="EC2 endpoint (tests, private links)")

    # -- the policy ----------------------------------------------------------------------------
    min_replicas: int = Field(0, ge=0, le=10_000, description="fewest workers, even when idle")
    max_replicas: int = Field(10, ge=0, le=10_000, description="most workers")
    idle_grace_s: float = Field(
        600.0, ge=0, description="seconds without work before scaling down to min"
    )
    cooldown_s: float = Field(
        300.0, ge=0, description="seconds after a scale action before a scale-in"
    )
    max_step: int = Field(10, ge=1, description="most replicas added or removed per tick")
    fault_threshold: int = Field(
        3, ge=1, description="node faults within the window that make a node bad"
    )
    fault_window_s: float = Field(3600.0, gt=0, description="window for counting node faults")
    slow_warmup_steps: int = Field(
        20,
        ge=0,
        description="steps a pace must span before it is judged (between verified checkpoints,"
        " or of a node's own report)",
    )
    slow_stddevs: float = Field(
        2.0,
        gt=0,
        description="robust standard deviations (1.4826 x MAD) past its peers' median that make"
        " a node slow",
    )
    slow_min_peers: int = Field(
        3,
        ge=2,
        # The old name (when peers were "samples") keeps working.
        validation_alias=AliasChoices("LORAFLEET_SLOW_MIN_PEERS", "LORAFLEET_SLOW_MIN_SAMPLES"),
        description="live, provider-verified peer machines (one pace observation each) of the"
        " same job shape needed to judge a pace",
    )
    slow_min_excess: float = Field(
        0.25, ge=0, description="and at least this share slower than the peers' median"
    )
    min_plausible_seconds_per_step: float = Field(
        MIN_PLAUSIBLE_S_PER_STEP,
        gt=0,
        description="the fastest pace a peer observation may show, in seconds per 1024x1024"
        " image step (scaled by resolution and batch); faster ones (tiny checkpoints committed"
        " fast) are nobody's peer. Default: about five times an H100's SDXL LoRA step",
    )
    reference_paces: dict[str, float] = Field(
        default_factory=dict,
        description='pinned reference paces per GPU class (JSON, e.g. {"NVIDIA GeForce RTX'
        ' 4090": 0.8}), in seconds per 1024x1024 image step: a slow node must also be past its'
        " class's reference; classes not pinned learn it from long-lived machines",
    )
    reference_min_age_s: float = Field(
        6 * 3600.0,
        ge=0,
        description="a machine teaches its class's reference pace only once the ledger has seen"
        " it for this long",
    )
    reference_rate_per_hour: float = Field(
        1.25,
        gt=1,
        le=100,
        description="a learned reference pace moves by at most this factor per hour",
    )
    slow_reference_excess: float = Field(
        0.5,
        ge=0,
        description="a slow node must also be this share past its class's reference pace",
    )
    slow_eager_allowance: float = Field(
        2.5,
        ge=1,
        le=100,
        description="a node that does not say its step runs compiled (a fresh node runs eager:"
        " 2 to 2.5x a warm compiled step on an H200) is held to this many times the slow-node"
        " limits; its own word, so it can only spare itself",
    )
    reallocate_share: float = Field(
        0.1, ge=0, le=1, description="most reallocations per window, as a share of the fleet"
    )
    reallocate_window_s: float = Field(
        3600.0, gt=0, description="window of the reallocation rate limit"
    )
    reallocate_min_per_window: int = Field(
        1, ge=0, description="reallocations always allowed per window (a small fleet heals)"
    )
    reallocate_holdoff_s: float = Field(
        900.0, ge=0, description="seconds before the same instance may be reallocated again"
    )
    busy_deletion_cost: int = Field(
        100_000, ge=1, le=100_000, description="SaladCloud deletion cost of a leased instance"
    )
    idle_deletion_cost: int = Field(
        1, ge=0, le=99_999, description="SaladCloud deletion cost of an idle instance"
    )

    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        # Its own name per service: one environment (a host running a scheduler and a worker,
        # `lorafleet up`'s children) must not make two processes claim one port.
        validation_alias=AliasChoices("LORAFLEET_SCALER_METRICS_PORT"),
        description="serve Prometheus metrics on this port (/metrics, all interfaces; 0: any"
        " free port); unset: no metrics endpoint",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        if self.idle_deletion_cost >= self.busy_deletion_cost:
            raise ValueError("idle_deletion_cost must be below busy_deletion_cost")
        if self.provider == "salad":
            missing = [
                f"--{name.replace('_', '-')}"
                for name in ("salad_organization", "salad_project", "salad_group")
                if getattr(self, name) is None
            ]
            if self.salad_api_key is None:
                missing.append("SALAD_API_KEY")
            if missing:
                raise ValueError(f"the salad provider needs {', '.join(missing)}")
            if self.max_replicas > SALAD_MAX_REPLICAS:
                raise ValueError(f"max_replicas: SaladCloud allows at most {SALAD_MAX_REPLICAS}")
        if self.provider == "ec2":
            missing = [
                f"--{name.replace('_', '-')}"
                for name in ("ec2_region", "ec2_launch_template_id")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"the ec2 provider needs {', '.join(missing)}")
        return self

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(**{f.name: getattr(self, f.name) for f in fields(PolicyConfig)})

    def salad_config(self) -> SaladConfig:
        assert self.salad_organization and self.salad_project and self.salad_group
        assert self.salad_api_key is not None
        return SaladConfig(
            organization=self.salad_organization,
            project=self.salad_project,
            group=self.salad_group,
            api_key=self.salad_api_key.get_secret_value(),
            base_url=self.salad_base_url,
            request_timeout_s=self.salad_request_timeout_s,
            deadline_s=self.salad_deadline_s,
        )

    def ec2_config(self) -> Ec2Config:
        assert self.ec2_region and self.ec2_launch_template_id
        return Ec2Config(
            region=self.ec2_region,
            launch_template_id=self.ec2_launch_template_id,
            launch_template_version=self.ec2_launch_template_version,
            fleet=self.ec2_fleet,
            subnet_id=self.ec2_subnet_id,
            endpoint_url=self.ec2_endpoint_url,
        )
