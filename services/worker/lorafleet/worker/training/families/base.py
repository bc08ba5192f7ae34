"""The model-family seam: what a family is to the trainer, and the components it loads.

The trainer core (loop.py, lora.py, resident.py, samples) never names a family: it asks the
job's `Family` for everything that differs between model architectures. A family declares its
facts as class attributes (its pipeline, the name of its denoiser, which text encoders LoRA may
train, the prefixes of its kohya keys) and its behaviour as a handful of methods: load the
frozen components, tokenize and encode prompts, turn VAE moments into model input, compute a
micro-batch's loss, build its sampling pipeline, and lay out its LoRA files. Adding a family is
one module beside sdxl.py, flux.py and flux2.py, its entry in `families/__init__.py`, a tiny
builder (worker/tiny_model.py) and its tests (docs/DESIGN.md, "Model families").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from lorafleet.core.families import FamilyName

if TYPE_CHECKING:
    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.training.config import Runtime, TrainingConfig
    from lorafleet.worker.training.data import Example


@dataclass(kw_only=True)
class Components:
    """The loaded model. Modules are mutable torch objects; the dataclass only groups them.

    `text_encoders` and `tokenizers` are keyed by their pipeline attribute names, in the
    pipeline's order; `denoiser` is the UNet or transformer."""

    family: Family
    denoiser: Any
    vae: Any
    text_encoders: dict[str, Any]
    tokenizers: dict[str, Any]
    noise_scheduler: Any
    # The base model's own inference scheduler config, for class and validation images.
    sampler_config: dict[str, Any]

    @property
    def modules(self) -> dict[str, Any]:
        """Every module that may carry adapters, by pipeline name: the denoiser first."""
        return {self.family.denoiser_name: self.denoiser, **self.text_encoders}


class StepContext(Protocol):
    """What a family's loss reads of the run: its modules, its settings, and the denoiser's
    forward (the compiled one when the run compiles)."""

    components: Components
    spec: JobSpec
    denoiser_forward: Callable[..., Any]

    @property
    def num_class(self) -> int:
        """Class images in the batch (prior preservation): its second half."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...


class Family:
    """One model family (see the module docstring). Stateless: one shared instance each."""

    name: ClassVar[FamilyName]
    # model_index.json's `_class_name` of the family's pipeline.
    pipeline_class: ClassVar[str]
    # The pipeline attribute of the trained denoiser ("unet", "transformer").
    denoiser_name: ClassVar[str]
    # The text encoders `train_text_encoder` adds adapters to, in pipeline order.
    trainable_encoders: ClassVar[tuple[str, ...]]
    # Whether the text encoders stay on the accelerator while the denoiser trains; a family whose
    # frozen encoders are large sends them to host memory once the prompts are cached.
    encoders_stay_on_device: ClassVar[bool] = True

    # Loading ---------------------------------------------------------------------------------

    def load(self, config: TrainingConfig, runtime: Runtime) -> Components:
        raise NotImplementedError

    def denoiser_targets(self, denoiser: Any) -> tuple[str, ...]:
        """The peft `target_modules` of the denoiser's adapters."""
        raise NotImplementedError

    def encoder_targets(self, name: str) -> tuple[str, ...]:
        return ("q_proj", "k_proj", "v_proj", "out_proj")

    def check(self, config: TrainingConfig, components: Components) -> None:
        """Refuses (as input faults) what this model cannot train; called after loading."""

    # Prompts -----------------------------------------------------------------------------------

    def tokenize(
        self, components: Components, prompts: list[str], spec: JobSpec
    ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def encode_frozen(
        self, components: Components, tokens: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """What the encoders outside `trainable_encoders` make of each prompt (one row per
        prompt). They never change, so a run computes this once per prompt, without gradients,
        and feeds the rows to `encode` each step even while `train_text_encoder` trains the
        others (FLUX.1's T5-XXL: most of the prompt's cost)."""
        return ()

    def encode(
        self,
        components: Components,
        tokens: Sequence[torch.Tensor],
        frozen: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The conditioning tensors of each prompt (one row per prompt in each), from the token
        ids and `encode_frozen`'s rows of the same prompts (computed here when None); gradients
        flow into encoders that carry adapters."""
        raise NotImplementedError

    # The objective -------------------------------------------------------------------------------

    def latents(
        self, moments: torch.Tensor, generator: torch.Generator, components: Components
    ) -> torch.Tensor:
        """Model input from the VAE posterior's (mean, std) stacked on the channel axis."""
        raise NotImplementedError

    def draw(
        self,
        latents: torch.Tensor,
        generator: torch.Generator,
        examples: list[Example],
        run: Any,
    ) -> tuple[torch.Tensor, ...]:
        """A micro-batch's random draws (noise, timesteps, ...) and per-example inputs, from the
        run's generator (checkpointed with it)."""
        raise NotImplementedError

    def loss(
        self,
        run: StepContext,
        latents: torch.Tensor,
        draws: Sequence[torch.Tensor],
        conditioning: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """The micro-batch's loss from its latents, draws and conditioning rows."""
        raise NotImplementedError

    # Outputs -----------------------------------------------------------------------------

    def diffusers_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The result file's tensors as the family's pipeline `load_lora_weights` takes them,
        from each trained module's peft state by pipeline name."""
        raise NotImplementedError

    def kohya_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]], alphas: Mapping[str, float]
    ) -> dict[str, torch.Tensor]:
        """The result in the key layout ComfyUI's LoRA loader (and diffusers') reads."""
        raise NotImplementedError

    def sampling_pipeline(self, components: Components) -> Any:
        """The family's inference pipeline over the loaded modules (no copy, LoRA included)."""
        raise NotImplementedError

    def sample_arguments(self, *, negative_prompt: str, guidance_scale: float) -> dict[str, Any]:
        """Pipeline keyword arguments for one image besides prompt, size, steps, generator."""
        return {"guidance_scale": guidance_scale}


def clip_kohya_path(path: str) -> str:
    """A CLIP text encoder's module path as kohya sd-scripts and ComfyUI name it
    (`lora_te1_text_model_encoder_layers_0_...`): under `text_model`, a level that transformers
    5's `CLIPTextModel` dropped (`CLIPTextModelWithProjection` keeps it). Without it ComfyUI
    leaves the text encoder's half of the LoRA unloaded."""
    return path if path.startswith("text_model.") else f"text_model.{path}"
