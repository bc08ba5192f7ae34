"""The qualification probe a worker runs once, before its first lease.

It answers "can this node train?" with measurements rather than trust: the accelerator and its
memory (torch.cuda), a dense matmul whose speed is measured and whose result is checked against
a float64 reference (a node with a broken GPU or driver computes garbage fast), free device and
host memory, free disk where models are cached, and the library versions that decide whether a
run is reproducible. The outcome travels in `Hello.qualification`; the scheduler gives no work
to a node that failed, and the scaler reads the ledger to replace it.

On a machine without CUDA the probe passes only when the configuration allows the CPU
(`--allow-cpu`, for tests and the local demo).

`probe()` blocks for up to a few seconds (imports torch, runs the matmul): call it from a
thread.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker.config import WorkerConfig

log = structlog.get_logger(__name__)

_MIB = 1024 * 1024
_LIBRARIES = ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors")
# Square matmul sizes: big enough to time reliably, small enough to take well under a second.
_GPU_MATMUL_N = 4096
_CPU_MATMUL_N = 384
_TIMED_ITERATIONS = 5
# The corner of the product checked against float64: the reference costs O(n * _CHECK_N**2).
_CHECK_N = 128
# Largest relative error accepted for the checked corner, per dtype: fp16/bf16 round the output
# to 11/8 significant bits; fp32 accumulation over n terms stays far below 1e-4.
_TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-4}


@dataclass(frozen=True, kw_only=True)
class QualificationResult:
    """What the probe found; `passed` and `detail` decide, the rest is reported."""

    passed: bool
    detail: str
    gpu_model: str
    vram_mb: int
    tflops: float
    # Free memory where training happens: the GPU's when there is one, else the host's.
    free_memory_mb: int
    free_host_memory_mb: int
    free_disk_mb: int
    versions: Mapping[str, str] = field(default_factory=dict)

    def to_proto(self) -> fpb.Qualification:
        return fpb.Qualification(
            passed=self.passed,
            detail=self.detail[:1000],
            tflops=self.tflops,
            free_memory_mb=self.free_memory_mb,
            free_disk_mb=self.free_disk_mb,
            versions=dict(self.versions),
        )


@dataclass(frozen=True, kw_only=True)
class _Compute:
    tflops: float
    max_relative_error: float
    dtype: str
    finite: bool


def library_versions() -> dict[str, str]:
    """Installed versions of the training stack, CUDA's and Python's."""
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    try:
        import torch

        versions["cuda"] = torch.version.cuda or "none"
        if torch.cuda.is_available():
            versions["cudnn"] = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
    except ImportError:
        versions["cuda"] = "unknown"
    return versions


def total_host_memory_mb() -> int:
    """MemTotal from /proc/meminfo (Linux), else physical pages: a CPU worker's model and
    activations live in host memory, so this is the memory it announces for jobs (Hello.vram_mb)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // _MIB
    except (ValueError, OSError, AttributeError):
        return 0


def free_host_memory_mb() -> int:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // _MIB
    except (ValueError, OSError, AttributeError):
        return 0


def free_disk_mb(path: Path) -> int:
    """Free space on the filesystem holding `path` (or its nearest existing parent)."""
    probe_path = path.resolve()
    while not probe_path.exists() and probe_path != probe_path.parent:
        probe_path = probe_path.parent
    return shutil.disk_usage(probe_path).free // _MIB


def _matmul_check(torch: Any, device: Any, n: int, dtype: Any) -> _Compute:
    """Times `n`x`n` matmuls and checks one corner of the product against float64."""
    generator = torch.Generator("cpu").manual_seed(1234)
    a_host = torch.randn(n, n, generator=generator).to(dtype)
    b_host = torch.randn(n, n, generator=generator).to(dtype)
    a = a_host.to(device)
    b = b_host.to(device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    product = a @ b  # warm-up: kernel selection, lazy initialisation
    sync()
    started = time.perf_counter()
    for _ in range(_TIMED_ITERATIONS):
        product = a @ b
    sync()
    elapsed = max(time.perf_counter() - started, 1e-9)
    tflops = 2 * n**3 * _TIMED_ITERATIONS / elapsed / 1e12
    corner = product[:_CHECK_N, :_CHECK_N].to("cpu", torch.float64)
    # The reference uses the same (rounded) inputs, so only the arithmetic is judged.
    reference = a_host[:_CHECK_N].double() @ b_host[:, :_CHECK_N].double()
    finite = bool(torch.isfinite(product).all().item())
    scale = float(reference.abs().max().item()) or 1.0
    error = float((corner - reference).abs().max().item()) / scale
    return _Compute(
        tflops=tflops,
        max_relative_error=error,
        dtype=str(dtype).removeprefix("torch."),
        finite=finite,
    )


def model_dir_problem(path: str, *, vae: bool) -> str | None:
    """Why a local model directory cannot be what the worker trains from (None: it can).

    Cheap checks only (the probe runs before every connection): the directory, its index, and
    safetensors weights for each component the trainer loads.
    """
    root = Path(path)
    if not root.is_dir():
        return f"{path} is not a directory"
    if vae:
        folders = [root]
    else:
        if not (root / "model_index.json").is_file():
            return f"{path} has no model_index.json (not a diffusers model directory)"
        folders = [root / name for name in ("unet", "vae", "text_encoder", "text_encoder_2")]
    for folder in folders:
        if not any(folder.glob("*.safetensors")):
            return f"{folder} holds no safetensors weights"
    return None


def probe(config: WorkerConfig) -> QualificationResult:
    """Runs every check; never raises (a crash in the probe is itself a failed probe)."""
    versions = library_versions()
    host_memory = free_host_memory_mb()
    disk_path = Path(config.model_cache_dir or config.model_path or os.getcwd())
    disk = free_disk_mb(disk_path)
    problems: list[str] = []
    gpu_model = "cpu"
    vram_mb = 0
    free_memory = host_memory
    compute: _Compute | None = None
    try:
        import torch

        use_cuda = config.device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            properties = torch.cuda.get_device_properties(device)
            gpu_model = torch.cuda.get_device_name(device)
            vram_mb = int(properties.total_memory) // _MIB
            free_bytes, _total = torch.cuda.mem_get_info(device)
            free_memory = int(free_bytes) // _MIB
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            compute = _matmul_check(torch, device, _GPU_MATMUL_N, dtype)
        else:
            if config.device == "cuda":
                problems.append(
                    "device 'cuda' is configured but torch.cuda.is_available() is False"
                )
            elif not config.allow_cpu:
                problems.append(
                    "no CUDA accelerator visible (torch.cuda.is_available() is False); "
                    "pass --allow-cpu (LORAFLEET_ALLOW_CPU=1) to train on the CPU"
                )
            compute = _matmul_check(torch, torch.device("cpu"), _CPU_MATMUL_N, torch.float32)
            # On a CPU the job's memory is the host's: announcing 0 would make the worker
            # eligible only for jobs that need nothing, however much memory it has.
            vram_mb = total_host_memory_mb()
    except Exception as exc:  # a broken driver or install is exactly what the probe is for
        problems.append(f"compute check crashed: {type(exc).__name__}: {exc}"[:500])

    if config.gpu_model:
        gpu_model = config.gpu_model
    if config.vram_mb is not None:
        vram_mb = config.vram_mb
    if compute is not None:
        if not compute.finite:
            problems.append("matmul produced non-finite values")
        elif compute.max_relative_error > _TOLERANCE.get(compute.dtype, 1e-4):
            problems.append(
                f"matmul result is wrong (relative error {compute.max_relative_error:.2e}"
                f" in {compute.dtype})"
            )
        if compute.tflops < config.min_tflops:
            problems.append(
                f"matmul throughput {compute.tflops:.2f} TFLOPS is below {config.min_tflops:g}"
            )
    if vram_mb < config.min_vram_mb:
        problems.append(f"{vram_mb} MB of accelerator memory is below {config.min_vram_mb} MB")
    if free_memory < config.min_free_memory_mb:
        problems.append(f"{free_memory} MB free memory is below {config.min_free_memory_mb} MB")
    if disk < config.min_free_disk_mb:
        problems.append(f"{disk} MB free disk at {disk_path} is below {config.min_free_disk_mb} MB")
    missing = [name for name in _LIBRARIES if versions.get(name) == "missing"]
    if missing:
        problems.append("missing libraries: " + ", ".join(missing))
    for option, path in (("model_path", config.model_path), ("vae_path", config.vae_path)):
        if path is not None and (problem := model_dir_problem(path, vae=option == "vae_path")):
            # A worker that cannot load its own model fails here, never its jobs.
            problems.append(f"{option}: {problem}")

    tflops = compute.tflops if compute is not None else 0.0
    if problems:
        detail = "; ".join(problems)
    else:
        detail = (
            f"{gpu_model}: {tflops:.2f} TFLOPS {compute.dtype if compute else ''},"
            f" {free_memory} MB free memory ({host_memory} MB host), {disk} MB free disk"
        )
    result = QualificationResult(
        passed=not problems,
        detail=detail,
        gpu_model=gpu_model,
        vram_mb=vram_mb,
        tflops=tflops,
        free_memory_mb=free_memory,
        free_host_memory_mb=host_memory,
        free_disk_mb=disk,
        versions=versions,
    )
    log.info(
        "qualification probe",
        machine_id=config.machine_id,
        passed=result.passed,
        detail=result.detail,
        tflops=round(tflops, 3),
    )
    return result
