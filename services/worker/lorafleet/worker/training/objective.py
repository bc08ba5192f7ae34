"""The diffusion training objective, as pure tensor functions.

Every random draw takes the run's explicit generator, so the whole stream is checkpointed with
it (`TrainingSnapshot` stores the generator state) and a resumed run draws the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def sample_latents(
    moments: torch.Tensor, generator: torch.Generator, vae_config: Any
) -> torch.Tensor:
    """Scaled latents drawn from a VAE posterior given as (mean, std) stacked on channels.

    The draw is DiagonalGaussianDistribution.sample's, but from our generator. Scaling follows
    the VAE config: `latents_mean`/`latents_std` when it has them, else `scaling_factor` alone
    (SDXL).
    """
    mean, std = moments.float().chunk(2, dim=1)
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    latents = mean + std * eps
    factor = float(vae_config.scaling_factor)
    shift = getattr(vae_config, "latents_mean", None)
    spread = getattr(vae_config, "latents_std", None)
    if shift is not None and spread is not None:
        shift_t = torch.tensor(shift, device=latents.device).view(1, -1, 1, 1)
        spread_t = torch.tensor(spread, device=latents.device).view(1, -1, 1, 1)
        return (latents - shift_t) * factor / spread_t
    return latents * factor


def draw_noise(
    latents: torch.Tensor,
    generator: torch.Generator,
    *,
    noise_offset: float,
    num_train_timesteps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian noise (plus a per-channel offset when `noise_offset` > 0) and timesteps."""
    device = latents.device
    noise = torch.randn(latents.shape, generator=generator, device=device)
    if noise_offset:
        # A constant shift per image and channel lets the model learn overall brightness,
        # which zero-mean noise never teaches (Guttenberg 2023, "diffusion with offset noise").
        batch, channels = latents.shape[:2]
        offset = torch.randn((batch, channels, 1, 1), generator=generator, device=device)
        noise = noise + noise_offset * offset
    timesteps = torch.randint(
        0, num_train_timesteps, (latents.shape[0],), generator=generator, device=device
    )
    return noise, timesteps


def prediction_target(
    prediction_type: str,
    noise_scheduler: Any,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
) -> torch.Tensor:
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        velocity: torch.Tensor = noise_scheduler.get_velocity(latents, noise, timesteps)
        return velocity
    if prediction_type == "sample":
        return latents
    raise ValueError(f"unknown prediction type {prediction_type!r}")


def snr_per_timestep(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) of every training timestep."""
    alphas = alphas_cumprod.float()
    return alphas / (1.0 - alphas)


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023, https://arxiv.org/abs/2303.09556).

    The paper's weight for x0 prediction is min(SNR, gamma); predicting noise divides it by
    SNR, predicting velocity by SNR + 1 (which stays finite where SNR ~ 0).
    """
    clipped = snr.clamp(max=gamma)
    if prediction_type == "epsilon":
        return clipped / snr
    if prediction_type == "v_prediction":
        return clipped / (snr + 1.0)
    return clipped


def dreambooth_loss(
    prediction: torch.Tensor,
    target: torch.Tensor,
    *,
    with_prior: bool,
    prior_loss_weight: float,
    snr_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Mean squared error in fp32. With prior preservation the batch's second half is class
    images, whose plain MSE is added with `prior_loss_weight`. `snr_weights` (one per instance
    sample) weigh the instance half."""
    prediction = prediction.float()
    target = target.float()
    count = len(prediction) // 2 if with_prior else len(prediction)
    per_sample = ((prediction[:count] - target[:count]) ** 2).mean(dim=(1, 2, 3))
    if snr_weights is not None:
        per_sample = per_sample * snr_weights
    loss = per_sample.mean()
    if with_prior:
        loss = loss + prior_loss_weight * F.mse_loss(prediction[count:], target[count:])
    return loss
