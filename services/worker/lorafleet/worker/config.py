"""Worker configuration: one frozen value built once from flags and the environment.

Environment variables (flags of `lorafleet worker` override them, see `main.py`):

========================================  =====================================================
`LORAFLEET_SCHEDULER`                     scheduler address `host:port` (default 127.0.0.1:50051)
`LORAFLEET_WORKER_TOKEN`                  shared worker token, sent as `authorization: Bearer`
`LORAFLEET_SCHEDULER_TLS`                 1: connect with TLS (system roots, or the CA below)
`LORAFLEET_SCHEDULER_CA`                  PEM file of the CA that signed the scheduler's cert
`SALAD_MACHINE_ID`, `LORAFLEET_MACHINE_ID`  machine id (bans attach to it); default: hostname
`SALAD_CONTAINER_GROUP_INSTANCE_ID`,      provider instance id (what the scaler reallocates)
`SALAD_INSTANCE_ID`,
`LORAFLEET_PROVIDER_INSTANCE_ID`
`LORAFLEET_ALLOW_CPU`                     1: a machine without CUDA passes qualification
`LORAFLEET_GPU_MODEL`, `LORAFLEET_VRAM_MB`  override what the probe reports
`LORAFLEET_DEVICE`                        auto | cpu | cuda (default auto)
`LORAFLEET_MODEL_PATH`, `LORAFLEET_VAE_PATH`  local diffusers directories replacing the spec's
                                          `base_model` / `vae_model`
`LORAFLEET_MODEL_CACHE_DIR`               hub download cache (`from_pretrained(cache_dir=)`)
`LORAFLEET_LOCAL_FILES_ONLY`              1: never download model files
`LORAFLEET_DRAIN_GRACE_S`                 seconds a SIGTERM drain may take (default 25)
`LORAFLEET_MIN_FREE_DISK_MB`,             qualification floors
`LORAFLEET_MIN_FREE_MEMORY_MB`,
`LORAFLEET_MIN_TFLOPS`
========================================  =====================================================
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from lorafleet.worker.transfer import TransferConfig

DeviceChoice = Literal["auto", "cpu", "cuda"]

DEFAULT_SCHEDULER = "127.0.0.1:50051"
# The scheduler's own rule for machine ids (fleet.machine_from_hello).
_MACHINE_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_TRUE = frozenset({"1", "true", "yes", "on"})


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


def _first(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""


def default_machine_id() -> str:
    """The hostname, cut to the characters the scheduler accepts."""
    cleaned = re.sub(r"[^A-Za-z0-9_.:@-]", "-", socket.gethostname())[:128]
    return cleaned or "worker"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything one worker process needs; built once, never mutated.

    Connection: `scheduler_address`, `worker_token`, `tls`, `tls_ca_file`, the reconnect
    backoff bounds and `welcome_timeout_s`. Identity: `machine_id`, `provider_instance_id`,
    and `gpu_model` / `vram_mb` overrides (None: what the probe measures). Qualification:
    `allow_cpu` and the floors. Training: where the model comes from and how images are
    sampled (`TrainingConfig`'s machine-side fields). Behaviour: `drain_grace_s` bounds a
    graceful stop. (Checkpoint memory is bounded by design: one snapshot uploading, one
    waiting; see `lease_runner.CheckpointPipeline`.)
    """

    worker_token: str
    scheduler_address: str = DEFAULT_SCHEDULER
    tls: bool = False
    tls_ca_file: Path | None = None
    machine_id: str = field(default_factory=default_machine_id)
    provider_instance_id: str = ""

    # Qualification.
    allow_cpu: bool = False
    gpu_model: str | None = None
    vram_mb: int | None = None
    min_vram_mb: int = 0
    min_free_memory_mb: int = 512
    min_free_disk_mb: int = 1024
    min_tflops: float = 0.0

    # Training (passed to the trainer's TrainingConfig).
    device: DeviceChoice = "auto"
    model_path: str | None = None
    vae_path: str | None = None
    model_cache_dir: str | None = None
    local_files_only: bool = False
    sample_steps: int = 30
    sample_batch_size: int = 4
    num_validation_images: int = 4

    # Connection behaviour.
    reconnect_initial_backoff_s: float = 0.5
    reconnect_max_backoff_s: float = 30.0
    # How long Hello may wait for Welcome before the attempt counts as failed.
    welcome_timeout_s: float = 30.0
    # Used only until the scheduler's Welcome says otherwise.
    default_heartbeat_interval_s: float = 10.0
    # How long to wait for the scheduler to answer an UrlsRequested before asking again.
    url_request_timeout_s: float = 30.0

    # Lease behaviour.
    # SIGTERM/Shutdown: the whole drain (stop, snapshot, upload, commit, Draining) within this.
    drain_grace_s: float = 25.0
    download_concurrency: int = 8
    # Class and validation image uploads running at once.
    artifact_upload_concurrency: int = 4
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        if not self.worker_token:
            raise ValueError("worker_token: required (--token or LORAFLEET_WORKER_TOKEN)")
        if not self.scheduler_address or "/" in self.scheduler_address:
            raise ValueError(
                f"scheduler_address: expected host:port, got {self.scheduler_address!r}"
            )
        if not _MACHINE_ID.fullmatch(self.machine_id):
            raise ValueError(
                f"machine_id: must match [A-Za-z0-9_.:@-]{{1,128}}, got {self.machine_id!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: expected auto, cpu or cuda, got {self.device!r}")
        if not 0 < self.reconnect_initial_backoff_s <= self.reconnect_max_backoff_s:
            raise ValueError("reconnect backoff: need 0 < initial <= max")
        for name in (
            "welcome_timeout_s",
            "default_heartbeat_interval_s",
            "url_request_timeout_s",
            "drain_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive")
        for name in (
            "download_concurrency",
            "artifact_upload_concurrency",
            "sample_steps",
            "sample_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.vram_mb is not None and self.vram_mb < 0:
            raise ValueError("vram_mb: must not be negative")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> WorkerConfig:
        """Reads the variables in the module docstring; keyword overrides win (None = unset)."""
        e = os.environ if env is None else env
        values: dict[str, object] = {
            "worker_token": e.get("LORAFLEET_WORKER_TOKEN", ""),
            "scheduler_address": e.get("LORAFLEET_SCHEDULER", "") or DEFAULT_SCHEDULER,
            "tls": _flag(e.get("LORAFLEET_SCHEDULER_TLS")),
            "allow_cpu": _flag(e.get("LORAFLEET_ALLOW_CPU")),
            "local_files_only": _flag(e.get("LORAFLEET_LOCAL_FILES_ONLY")),
            "provider_instance_id": _first(
                e,
                "SALAD_CONTAINER_GROUP_INSTANCE_ID",
                "SALAD_INSTANCE_ID",
                "LORAFLEET_PROVIDER_INSTANCE_ID",
            ),
        }
        machine_id = _first(e, "SALAD_MACHINE_ID", "LORAFLEET_MACHINE_ID")
        if machine_id:
            values["machine_id"] = machine_id
        if ca := e.get("LORAFLEET_SCHEDULER_CA"):
            values["tls_ca_file"] = Path(ca)
        for name, variable in (
            ("gpu_model", "LORAFLEET_GPU_MODEL"),
            ("device", "LORAFLEET_DEVICE"),
            ("model_path", "LORAFLEET_MODEL_PATH"),
            ("vae_path", "LORAFLEET_VAE_PATH"),
            ("model_cache_dir", "LORAFLEET_MODEL_CACHE_DIR"),
        ):
            if value := e.get(variable):
                values[name] = value
        for name, variable, kind in (
            ("vram_mb", "LORAFLEET_VRAM_MB", int),
            ("min_free_disk_mb", "LORAFLEET_MIN_FREE_DISK_MB", int),
            ("min_free_memory_mb", "LORAFLEET_MIN_FREE_MEMORY_MB", int),
            ("min_tflops", "LORAFLEET_MIN_TFLOPS", float),
            ("drain_grace_s", "LORAFLEET_DRAIN_GRACE_S", float),
        ):
            if raw := e.get(variable):
                try:
                    values[name] = kind(raw)
                except ValueError:
                    raise ValueError(f"{variable}: not a number: {raw!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    def with_changes(self, **changes: object) -> WorkerConfig:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]
