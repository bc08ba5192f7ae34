"""The one configuration object a run is built from: the job spec plus this machine's settings."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from lorafleet.core.model import FailureClass
from lorafleet.core.spec import JobSpec
from lorafleet.worker.training.compiling import CompileChoice
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
    * `sample_steps`, `sample_batch_size`, `guidance_scale`: how class images (prior
      preservation) are generated. Validation images are sample tasks, with the job's own
      settings (`validation_*` in the spec).
    * `progress_interval_s`: `on_progress` runs after the first optimizer step that ends at
      least this many seconds after the previous report (0: after every step), and after the
      last. Each report reads the loss, a device-to-host sync that stops the host from queueing
      the next step's kernels ahead, so a worker reports about once a second, not every step.
    * `compile_model`: `on` compiles the step's forward with `torch.compile` (inductor): the
      UNet when the text embeddings are cached, one graph from the prompt's token ids to the
      loss when the text encoders are trained. The first step pays the compilation (nothing
      when the worker's resident model has that shape compiled, seconds with a warm kernel
      cache, minutes cold); it wins on long jobs. `auto` compiles when the run's remaining
      steps make it pay, by this node's measurements (compiling.py); `off` never. True and
      False mean on and off. The worker defaults to auto; a bare TrainingConfig to off.
    * `compile_cache_dir`: this node's own compile cache (inductor's caches and the measured
      compile costs), kept across runs and restarts; None: inductor's default, nothing kept.
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
    progress_interval_s: float = 0.0
    compile_model: CompileChoice | bool = "off"
    compile_cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("sample_steps", "sample_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not self.progress_interval_s >= 0:
            raise ValueError("progress_interval_s must be at least 0")
        if isinstance(self.compile_model, bool):
            object.__setattr__(self, "compile_model", "on" if self.compile_model else "off")
        if self.compile_model not in ("auto", "on", "off"):
            raise ValueError("compile_model must be auto, on or off")

    @property
    def compile_choice(self) -> CompileChoice:
        assert not isinstance(self.compile_model, bool)
        return self.compile_model

    @property
    def model_ref(self) -> str:
        return self.model_path or self.spec.base_model

    @property
    def vae_ref(self) -> str | None:
        return self.vae_path or self.spec.vae_model or None

    @property
    def vae_field(self) -> str:
        """The spec field a fault of the VAE names: its own, or the base model it came with."""
        return "base_model" if self.vae_ref is None else "vae_model"


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

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype a quantized layer computes in: the mixed-precision dtype, else fp32."""
        return {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            self.mixed_precision
        ]


def resolve_runtime(config: TrainingConfig) -> Runtime:
    """Picks the device and dtypes; refuses, as input faults, options this machine cannot run."""
    spec = config.spec
    if config.device == "cuda" and not torch.cuda.is_available():
        # The worker was deployed for a GPU that its driver or container does not expose.
        raise TrainingFailure(
            FailureClass.NODE, "device 'cuda' was configured but CUDA is not available"
        )
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    precision = spec.mixed_precision
    if precision == "fp16" and not use_cuda:
        # fp16 training (autocast with loss scaling) is a GPU feature; refuse it rather than
        # train the job in another precision than it asked for.
        raise input_fault(
            "mixed_precision: fp16 needs a CUDA GPU and this worker trains on the CPU;"
            " use bf16 or no"
        )
    if precision == "bf16" and use_cuda and not torch.cuda.is_bf16_supported():
        raise input_fault("mixed_precision: bf16 is not supported by this GPU; use fp16 or no")
    if spec.use_8bit_adam or spec.optimizer == "adamw_8bit":
        field = "use_8bit_adam" if spec.use_8bit_adam else "optimizer"
        if not use_cuda:
            raise input_fault(
                f"{field}: 8-bit Adam (bitsandbytes) needs a CUDA GPU and this worker"
                " trains on the CPU; use optimizer adamw or prodigy"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise input_fault(
                f"{field}: bitsandbytes is not installed on this worker;"
                " use optimizer adamw or prodigy"
            )
    quantization = spec.base_quantization
    if quantization != "none":
        if not use_cuda:
            raise input_fault(
                f"base_quantization: {quantization} needs a CUDA GPU and this worker trains on"
                " the CPU; use none"
            )
        library = {"nf4": "bitsandbytes", "fp8": "torchao"}[quantization]
        if importlib.util.find_spec(library) is None:
            # A dependency of the worker itself (the gpu extra): this installation is broken.
            raise TrainingFailure(
                FailureClass.NODE,
                f"base_quantization: {quantization} needs the {library} package, missing here",
            )
        if quantization == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
            # Another node may hold it: the grant's mistake, not the job's nor this node's.
            raise TrainingFailure(
                FailureClass.INTERNAL,
                "base_quantization: fp8 needs a GPU of compute capability 8.9 or newer (Ada,"
                " Hopper); this node's is older",
            )
    if spec.optimizer == "prodigy" and importlib.util.find_spec("prodigyopt") is None:
        # A dependency of the worker itself: this installation is broken, not the job.
        raise TrainingFailure(
            FailureClass.NODE, "optimizer: prodigy needs the prodigyopt package, missing here"
        )
    frozen = torch.float32
    if use_cuda and config.frozen_dtype == "auto":
        frozen = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return Runtime(device=device, mixed_precision=precision, frozen_dtype=frozen)
