"""Worker configuration: one frozen value, each option declared once.

Every option is a field of `WorkerConfig` below: its type, default, constraints, help text and
environment variables (`LORAFLEET_<FIELD>` unless the field names others). `lorafleet worker
--help` lists them all with their variables and defaults (`lorafleet.core.settings.add_flags`);
`load(WorkerConfig, args, env=...)` reads the environment, lays the flags on top and validates,
raising `ConfigError` that names each bad option as the user wrote it.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator

from lorafleet.core.settings import ConfigError, ServiceSettings, describe, load
from lorafleet.worker.transfer import TransferConfig

DeviceChoice = Literal["auto", "cpu", "cuda"]

DEFAULT_SCHEDULER = "127.0.0.1:50051"
# The scheduler's own rule for machine ids (serde.machine_from_hello).
MACHINE_ID_PATTERN = r"^[A-Za-z0-9_.:@-]{1,128}$"
# Of EC2's two-minute spot notice, what the poll interval and the drain may use together.
SPOT_NOTICE_BUDGET_S = 100.0
# What `compile_model` also accepts for on and off (it was a boolean option).
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def default_machine_id() -> str:
    """The hostname, cut to the characters the scheduler accepts."""
    cleaned = re.sub(r"[^A-Za-z0-9_.:@-]", "-", socket.gethostname())[:128]
    return cleaned or "worker"


class WorkerConfig(ServiceSettings):
    """Everything one worker process needs; built once, never mutated.

    (Checkpoint memory is bounded by design: one snapshot uploading, one waiting; see
    `uploads.CheckpointPipeline`.)
    """

    # The retry policy of uploads and downloads: tuned by tests, not an operator's option.
    not_flags: ClassVar[frozenset[str]] = frozenset(
        {"transfer", "salad_container_group_id", "identity_token"}
    )

    # Connection.
    worker_token: str = Field(
        min_length=1,
        description="the fleet's shared worker token, sent as `authorization: Bearer` (prefer"
        " the variable: a flag shows in the process list)",
    )
    scheduler_address: str = Field(
        DEFAULT_SCHEDULER,
        pattern=r"^[^/\s]+$",
        description="the scheduler's address, host:port",
        validation_alias=AliasChoices("LORAFLEET_SCHEDULER"),
    )
    tls: bool = Field(
        False,
        description="connect with TLS (the system's roots, or --tls-ca-file)",
        validation_alias=AliasChoices("LORAFLEET_SCHEDULER_TLS"),
    )
    tls_ca_file: Path | None = Field(
        None,
        description="PEM file of the CA that signed the scheduler's certificate",
        validation_alias=AliasChoices("LORAFLEET_SCHEDULER_CA"),
    )
    reconnect_initial_backoff_s: float = Field(
        0.5, gt=0, description="first reconnect backoff bound, seconds (full jitter)"
    )
    reconnect_max_backoff_s: float = Field(
        30.0, gt=0, description="largest reconnect backoff bound, seconds"
    )
    welcome_timeout_s: float = Field(
        30.0, gt=0, description="how long Hello may wait for Welcome before the attempt fails"
    )
    scheduler_silence_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="seconds a stream may go without any answer from the scheduler (it answers"
        " the worker's pings) before the worker takes the replica or the path as gone and"
        " reconnects; never more than a third of the lease TTL. Also bounds the wait for"
        " Welcome on a reconnect",
    )
    default_heartbeat_interval_s: float = Field(
        10.0, gt=0, description="heartbeat interval until the scheduler's Welcome names one"
    )
    url_request_timeout_s: float = Field(
        30.0, gt=0, description="how long to wait for upload URLs before asking again"
    )
    setup_notice_interval_s: float = Field(
        30.0,
        gt=0,
        description="while a lease prepares (model load, class images, precompute, compile)"
        " and has not trained a step, a notice on the job's timeline this often says what it is"
        " doing",
    )
    hub_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="how long one request to the Hugging Face hub may wait for an answer, its"
        " retries included (huggingface_hub waits 60 s on each retry of a metadata request"
        " otherwise: a hub that does not answer held a lease 6 minutes per file)",
    )
    setup_stall_timeout_s: float = Field(
        900.0,
        gt=0,
        description="a lease whose preparation shows no progress for this long (no new phase, no"
        " class images, no step: e.g. a hub download that cannot succeed) fails as a node fault",
    )

    # Identity.
    machine_id: str = Field(
        "",
        pattern=MACHINE_ID_PATTERN,
        description="this machine's id, which bans attach to (empty: the hostname)",
        validation_alias=AliasChoices("SALAD_MACHINE_ID", "LORAFLEET_MACHINE_ID"),
    )
    provider_instance_id: str = Field(
        "",
        description="the provider's instance id, what the scaler reallocates",
        validation_alias=AliasChoices(
            "SALAD_CONTAINER_GROUP_INSTANCE_ID",
            "SALAD_INSTANCE_ID",
            "LORAFLEET_PROVIDER_INSTANCE_ID",
        ),
    )

    # Qualification.
    allow_cpu: bool = Field(
        False, description="a machine without CUDA passes qualification (tests, the demo)"
    )
    gpu_model: str | None = Field(None, description="report this GPU model, not the probed one")
    vram_mb: int | None = Field(None, ge=0, description="report this VRAM, not the probed")
    min_vram_mb: int = Field(0, ge=0, description="qualification floor: accelerator memory")
    min_free_memory_mb: int = Field(512, ge=0, description="qualification floor: free memory")
    min_free_disk_mb: int = Field(
        1024, ge=0, description="qualification floor: free disk where models are cached"
    )
    min_tflops: float = Field(0.0, ge=0, description="qualification floor: measured TFLOPS")

    # Training (passed to the trainer's TrainingConfig).
    device: DeviceChoice = Field("auto", description="where to train (auto: CUDA if present)")
    model_path: str | None = Field(
        None, description="local diffusers directory replacing the spec's base_model"
    )
    vae_path: str | None = Field(
        None, description="local diffusers directory replacing the spec's vae_model"
    )
    model_cache_dir: str | None = Field(
        None, description="hub download cache (from_pretrained's cache_dir)"
    )
    local_files_only: bool = Field(False, description="never download model files")
    sample_steps: int = Field(30, ge=1, description="inference steps of class/validation images")
    sample_batch_size: int = Field(4, ge=1, description="images sampled at once")
    progress_interval_s: float = Field(
        1.0,
        ge=0,
        description="read the training loss (a device sync) at most this often for progress",
    )
    compile_model: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the training step (the denoiser's repeated blocks; with trained"
        " text encoders the"
        " forward from the prompt to the loss): on, off, or auto: when the job's remaining steps"
        " pay for the compile, by this node's own measurements per job shape (true/false: on/off)",
    )
    keep_base_model: bool = Field(
        True,
        description="keep the base model loaded between leases (a lease on the same base model"
        " and precision then only attaches fresh adapters); off: every lease loads it again",
    )
    compile_cache_dir: Path | None = Field(
        None,
        description="this node's compile cache (inductor's caches, measured compile costs), kept"
        " across leases and restarts, never shared with other workers; bake one into an image"
        " here (unset: $XDG_CACHE_HOME or ~/.cache, then lorafleet/compile-<machine id>)",
    )
    compile_artifacts_path: Path | None = Field(
        None,
        description="a file of torch compile artifacts the operator baked into this image for its"
        " GPU and torch version, loaded into compile_cache_dir at start so that the default jobs"
        " compile in seconds; a local file only, never one from another worker",
    )

    # The simulated trainer (simulated.py): benchmarks and tests only, never the default.
    simulate_step_s: float | None = Field(
        None,
        ge=0,
        description="train with the simulated trainer at this many seconds per step instead of"
        " SDXL (everything else stays real); unset: real training",
    )
    simulate_checkpoint_bytes: int = Field(
        256 * 1024, ge=1024, description="simulated trainer: size of a checkpoint, bytes"
    )
    simulate_checkpoint_stall_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="simulated trainer: seconds each checkpoint holds training (a slow node's"
        " snapshot), counted in the checkpoint cost the worker reports",
    )
    simulate_node_fault: bool = Field(
        False, description="simulated trainer: fail every job as a node fault (a bad node)"
    )

    # Lease behaviour.
    drain_grace_s: float = Field(
        25.0,
        gt=0,
        description="bound on a graceful stop (SIGTERM, Shutdown): step, checkpoint, upload,"
        " commit and Draining all within it",
    )
    download_concurrency: int = Field(8, ge=1, description="input downloads running at once")
    artifact_upload_concurrency: int = Field(
        4, ge=1, description="class and validation image uploads running at once"
    )
    transfer: TransferConfig = Field(default_factory=TransferConfig)

    # The provider's metadata service (docs/DEPLOYING.md, "Worker options for the providers").
    spot_notice: Literal["off", "ec2"] = Field(
        "off",
        description="watch for a spot interruption notice and drain when one comes: ec2 polls"
        " the instance metadata (IMDSv2) and, with no machine id set, takes the instance id as"
        " machine id",
    )
    spot_notice_interval_s: float = Field(
        5.0, gt=0, le=30, description="how often to look for a spot interruption notice, seconds"
    )
    ec2_metadata_url: str = Field(
        "http://169.254.169.254",
        pattern=r"^https?://[^/\s]+$",
        description="the EC2 instance metadata service (tests point it elsewhere)",
    )
    provider_identity: Literal["auto", "none", "salad", "ec2", "local"] = Field(
        "auto",
        description="the provider's proof of this machine's id, sent in every Hello (salad: the"
        " instance's identity token; ec2: the signed instance identity document; local: the"
        " token `lorafleet up` gives its workers); auto: by where the worker runs",
    )
    identity_token: str = Field(
        "",
        description="the local supervisor's identity token for this machine id (set by"
        " `lorafleet up` for the workers it starts; not an option)",
    )
    salad_reallocate: bool | None = Field(
        None,
        description="when the qualification probe fails, ask SaladCloud's instance metadata"
        " service to move this container to another node (unset: on when running on SaladCloud,"
        " i.e. SALAD_CONTAINER_GROUP_ID is set)",
    )
    salad_imds_url: str = Field(
        "http://169.254.169.254",
        pattern=r"^https?://[^/\s]+$",
        description="SaladCloud's instance metadata service (tests point it elsewhere)",
    )
    # Set by SaladCloud in every container: its presence says the worker runs on SaladCloud.
    salad_container_group_id: str = Field(
        "",
        description="SaladCloud's container group id, set by SaladCloud (not an option)",
        validation_alias=AliasChoices("SALAD_CONTAINER_GROUP_ID"),
    )

    # Observability.
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        # Its own name per service: one environment (a host running a scheduler and a worker,
        # `lorafleet up`'s children) must not make two processes claim one port.
        validation_alias=AliasChoices("LORAFLEET_WORKER_METRICS_PORT"),
        description="serve Prometheus metrics (/metrics) and a liveness probe (/healthz) on this"
        " port, all interfaces (0: any free port); unset: neither",
    )

    @field_validator("compile_model", mode="before")
    @classmethod
    def _bools_are_on_and_off(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return "on" if value.strip().lower() in _TRUE else "off"
        return value

    @field_validator("machine_id", mode="before")
    @classmethod
    def _hostname_by_default(cls, value: Any) -> Any:
        return value or default_machine_id()

    @model_validator(mode="after")
    def _backoff_bounds_in_order(self) -> Self:
        if self.reconnect_initial_backoff_s > self.reconnect_max_backoff_s:
            raise ValueError("reconnect_initial_backoff_s must not exceed reconnect_max_backoff_s")
        return self

    @model_validator(mode="after")
    def _drain_fits_the_spot_notice(self) -> Self:
        # The notice comes about 120 s ahead, seen up to one interval late; the drain must end
        # before EC2 acts, with a margin for the process to exit.
        if self.spot_notice == "ec2":
            used = self.spot_notice_interval_s + self.drain_grace_s
            if used > SPOT_NOTICE_BUDGET_S:
                raise ValueError(
                    f"with spot_notice ec2, spot_notice_interval_s + drain_grace_s ({used:g} s)"
                    f" must fit in {SPOT_NOTICE_BUDGET_S:g} s of EC2's two-minute notice"
                )
        return self

    @property
    def compile_cache_path(self) -> Path:
        """`compile_cache_dir`, or this machine's own directory in the user's cache."""
        if self.compile_cache_dir is not None:
            return self.compile_cache_dir
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "lorafleet" / f"compile-{self.machine_id}"

    @property
    def machine_id_configured(self) -> bool:
        """Whether the machine id was given (flag, variable, argument) rather than defaulted
        to the hostname. A copy made by `with_changes` counts as given."""
        return "machine_id" in self.model_fields_set

    @property
    def salad_reallocate_enabled(self) -> bool:
        """`salad_reallocate`, or when unset, whether the worker runs on SaladCloud (which sets
        SALAD_CONTAINER_GROUP_ID, with SALAD_MACHINE_ID, in every container)."""
        if self.salad_reallocate is not None:
            return self.salad_reallocate
        return bool(self.salad_container_group_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> WorkerConfig:
        """The environment (`os.environ` by default) alone, then `overrides` (None = unset).

        Raises `ConfigError` naming each bad variable."""
        return load(cls, env=os.environ if env is None else env, **overrides)

    def with_changes(self, **changes: Any) -> WorkerConfig:
        """A copy with some fields replaced, validated again (`ConfigError` if bad)."""
        try:
            return self.model_validate({**dict(self), **changes})
        except ValidationError as exc:
            raise ConfigError(describe(type(self), exc)) from None
