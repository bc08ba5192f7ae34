"""Rectified-flow training maths shared by the flow-matching families (FLUX.1, FLUX.2), as pure
tensor functions over the run's explicit generator.

A training sample is x_t = (1 - sigma) x_0 + sigma * noise and the transformer predicts the
velocity noise - x_0. The timestep is drawn by `weighting_scheme` (Esser et al. 2024, "Scaling
Rectified Flow Transformers", section 3.1: uniform, logit-normal, mode with heavy tails, CosMap)
and the loss is weighted as diffusers' `compute_loss_weighting_for_sd3` does (sigma_sqrt:
sigma^-2, cosmap: 2 / (pi (1 - 2 sigma + 2 sigma^2)), else 1). The draws use the run's
generator, which the checkpoint stores, so a resumed run draws the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lorafleet.worker.training.failures import input_fault
from lorafleet.worker.training.families.base import Components, Family, StepContext

if TYPE_CHECKING:
    from lorafleet.worker.training.config import TrainingConfig
    from lorafleet.worker.training.data import Example


def timestep_density(
    scheme: str,
    batch_size: int,
    generator: torch.Generator,
    *,
    logit_mean: float,
    logit_std: float,
    mode_scale: float,
    device: torch.device,
) -> torch.Tensor:
    """u in [0, 1) per sample, distributed by the scheme."""
    if scheme == "logit_normal":
        normal = torch.randn((batch_size,), generator=generator, device=device)
        return torch.sigmoid(normal * logit_std + logit_mean)
    u = torch.rand((batch_size,), generator=generator, device=device)
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    if scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


def draw_flow(
    latents: torch.Tensor, generator: torch.Generator, scheduler: Any, spec: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise, timesteps (the scheduler's training timesteps) and their sigmas for a batch.

    The index into the scheduler's schedule is floor(u * num_train_timesteps), as diffusers'
    scripts take it; the sigma is the schedule's at that index (the scripts look it up by the
    timestep's value, which names the same entry)."""
    device = latents.device
    noise = torch.randn(latents.shape, generator=generator, device=device)
    u = timestep_density(
        spec.weighting_scheme,
        latents.shape[0],
        generator,
        logit_mean=spec.logit_mean,
        logit_std=spec.logit_std,
        mode_scale=spec.mode_scale,
        device=device,
    )
    indices = (
        (u * scheduler.config.num_train_timesteps).long().clamp(max=len(scheduler.timesteps) - 1)
    )
    timesteps = scheduler.timesteps.to(device)[indices]
    sigmas = scheduler.sigmas.to(device)[indices]
    return noise, timesteps, sigmas


def noised(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    sigma = sigmas.view(-1, *([1] * (latents.ndim - 1)))
    return (1.0 - sigma) * latents + sigma * noise


def flow_loss(
    prediction: torch.Tensor,
    latents: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    scheme: str,
    with_prior: bool,
    prior_loss_weight: float,
) -> torch.Tensor:
    """Weighted MSE against the velocity target in fp32. With prior preservation the batch's
    second half is class images, weighed by `prior_loss_weight`."""
    target = (noise - latents).float()
    weighting = loss_weighting(scheme, sigmas.float()).view(-1, *([1] * (latents.ndim - 1)))
    per_sample = (weighting * (prediction.float() - target) ** 2).reshape(len(target), -1)
    per_sample = per_sample.mean(dim=1)
    if not with_prior:
        return per_sample.mean()
    count = len(per_sample) // 2
    return per_sample[:count].mean() + prior_loss_weight * per_sample[count:].mean()


def guidance_for(transformer: Any, spec: Any, default: float, batch: int) -> torch.Tensor | None:
    """The guidance a guidance-distilled transformer is trained with (`guidance_scale`, or the
    pipeline's default when 0); None for a transformer without a guidance embedding."""
    if not transformer.config.guidance_embeds:
        return None
    scale = spec.guidance_scale or default
    return torch.full((batch,), float(scale), device=transformer.device)


class FlowMatching(Family):
    """What the rectified-flow families share: their draws, their loss over the transformer's
    unpacked prediction, their 2x2-patched resolution rule, frozen encoders that leave the
    device once the prompts are cached, and a diffusers file of the peft keys prefixed by
    pipeline name (as their pipelines' `save_lora_weights` writes diffusers' scripts' layers)."""

    encoders_stay_on_device = False

    def check(self, config: TrainingConfig, components: Components) -> None:
        """The latents are packed in 2x2 patches: the image side must divide into them, and the
        VAE's channels into the transformer's input. A guidance scale needs a transformer with a
        guidance embedding (FLUX.1 dev's; not schnell's nor klein's): never silently unused."""
        spec = config.spec
        multiple = vae_scale_factor(components) * 2
        if spec.resolution % multiple:
            raise input_fault(
                f"resolution: {self.name} needs a multiple of {multiple} pixels"
                f" (got {spec.resolution})"
            )
        channels = components.vae.config.latent_channels * 4
        if channels != components.denoiser.config.in_channels:
            raise input_fault(
                f"{config.vae_field}: the VAE's {channels // 4} latent channels do not fit the"
                f" transformer's {components.denoiser.config.in_channels} inputs (2x2 patches):"
                " a VAE of another model"
            )
        if spec.guidance_scale and not components.denoiser.config.guidance_embeds:
            raise input_fault(
                "guidance_scale: this model's transformer has no guidance embedding (it is not"
                " guidance-distilled), so the scale would change nothing; leave it 0"
            )

    def draw(
        self,
        latents: torch.Tensor,
        generator: torch.Generator,
        examples: list[Example],
        run: Any,
    ) -> tuple[torch.Tensor, ...]:
        return draw_flow(latents, generator, run.components.noise_scheduler, run.spec)

    def velocity_loss(
        self,
        run: StepContext,
        prediction: torch.Tensor,
        latents: torch.Tensor,
        draws: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        noise, _, sigmas = draws
        return flow_loss(
            prediction,
            latents,
            noise,
            sigmas,
            scheme=run.spec.weighting_scheme,
            with_prior=run.num_class > 0,
            prior_loss_weight=run.spec.prior_loss_weight,
        )

    def diffusers_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.{key}": tensor
            for prefix, state in peft_states.items()
            for key, tensor in state.items()
        }


def vae_scale_factor(components: Components) -> int:
    return int(2 ** (len(components.vae.config.block_out_channels) - 1))
