"""The one configuration object a run is built from: the job spec plus this machine's settings."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from lorafleet.spec import JobSpec
from lorafleet.worker.training.failures import TrainingFailure, input_fault

DeviceChoice = Literal["auto", "cpu", "cuda"]
FrozenDtypeChoice = Literal["auto", "fp32"]


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Everything a run needs besides its input bytes.

    `spec` is the job (every default filled in). The rest is how this worker runs it:

    * `model_path` / `vae_path`: a local diffusers directory replacing `spec.base_model` /
      `spec.vae_model` (a worker that bakes SDXL into its image, or the tiny test model).
      Without them the spec's references are loaded with `from_pretrained`, from the hub into
      `cache_dir` unless `local_files_only`.
    * `device`: "auto" picks CUDA when available, else the CPU.
    * `frozen_dtype`: "auto" keeps the frozen UNet and text encoders in the mixed-precision dtype
      on CUDA (half the memory, faster), fp32 on the CPU; "fp32" always fp32. LoRA parameters
      and optimizer state are fp32 either way.
    * `sample_steps`, `sample_batch_size`, `guidance_scale`, `num_validation_images`: how class
      images (prior preservation) and validation images are generated.
    * `progress_interval_steps`: `on_progress` runs every this many optimizer steps; each call
      costs one device-to-host sync (reading the loss).
    """

    spec: JobSpec
    model_path: str | None = None
    vae_path: str | None = None
    cache_dir: str | None = None
    local_files_only: bool = False
    device: DeviceChoice = "auto"
    frozen_dtype: FrozenDtypeChoice = "auto"
    sample_steps: int = 30
    sample_batch_size: int = 4
    guidance_scale: float = 5.0
    num_validation_images: int = 4
    progress_interval_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("sample_steps", "sample_batch_size", "progress_interval_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.num_validation_images < 0:
            raise ValueError("num_validation_images must not be negative")

    @property
    def model_ref(self) -> str:
        return self.model_path or self.spec.base_model

    @property
    def vae_ref(self) -> str | None:
        return self.vae_path or self.spec.vae_model or None


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Device and dtypes resolved for this machine."""

    device: torch.device
    mixed_precision: Literal["no", "fp16", "bf16"]
    # Dtype of the frozen UNet and text-encoder weights.
    frozen_dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_runtime(config: TrainingConfig) -> Runtime:
    """Picks the device and dtypes; refuses, as input faults, options this machine cannot run."""
    spec = config.spec
    if config.device == "cuda" and not torch.cuda.is_available():
        # The worker was deployed for a GPU that its driver or container does not expose.
        raise TrainingFailure("node", "device 'cuda' was configured but CUDA is not available")
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    precision = spec.mixed_precision
    if precision == "fp16" and not use_cuda:
        # accelerate silently trains fp16 jobs in fp32 on a CPU; say so instead of pretending.
        raise input_fault(
            "mixed_precision: fp16 needs a CUDA GPU and this worker trains on the CPU;"
            " use bf16 or no"
        )
    if precision == "bf16" and use_cuda and not torch.cuda.is_bf16_supported():
        raise input_fault("mixed_precision: bf16 is not supported by this GPU; use fp16 or no")
    if spec.use_8bit_adam:
        if not use_cuda:
            raise input_fault(
                "use_8bit_adam: 8-bit Adam (bitsandbytes) needs a CUDA GPU and this worker"
                " trains on the CPU; set use_8bit_adam to false"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise input_fault(
                "use_8bit_adam: bitsandbytes is not installed on this worker;"
                " set use_8bit_adam to false"
            )
    frozen = torch.float32
    if use_cuda and config.frozen_dtype == "auto":
        frozen = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return Runtime(device=device, mixed_precision=precision, frozen_dtype=frozen)
