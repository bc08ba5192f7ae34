"""The loss pieces: min-SNR weights, the prior-preservation split, noise and latent draws."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet.worker.training.objective import (
    draw_noise,
    dreambooth_loss,
    min_snr_weights,
    sample_latents,
    snr_per_timestep,
)


def test_min_snr_weights_per_prediction_type() -> None:
    snr = torch.tensor([0.5, 5.0, 20.0])
    eps = min_snr_weights(snr, 5.0, "epsilon")
    assert eps.tolist() == pytest.approx([1.0, 1.0, 0.25])
    v = min_snr_weights(snr, 5.0, "v_prediction")
    assert v.tolist() == pytest.approx([0.5 / 1.5, 5.0 / 6.0, 5.0 / 21.0])
    x0 = min_snr_weights(snr, 5.0, "sample")
    assert x0.tolist() == pytest.approx([0.5, 5.0, 5.0])


def test_snr_per_timestep() -> None:
    snr = snr_per_timestep(torch.tensor([0.8, 0.5, 0.2]))
    assert snr.tolist() == pytest.approx([4.0, 1.0, 0.25])


def test_prior_preservation_splits_the_batch() -> None:
    target = torch.zeros(4, 1, 2, 2)
    prediction = torch.cat([torch.full((2, 1, 2, 2), 1.0), torch.full((2, 1, 2, 2), 2.0)])
    plain = dreambooth_loss(
        prediction, target, with_prior=False, prior_loss_weight=1.0, snr_weights=None
    )
    assert float(plain) == pytest.approx((1.0 + 4.0) / 2)
    prior = dreambooth_loss(
        prediction, target, with_prior=True, prior_loss_weight=0.5, snr_weights=None
    )
    assert float(prior) == pytest.approx(1.0 + 0.5 * 4.0)
    weighted = dreambooth_loss(
        prediction,
        target,
        with_prior=True,
        prior_loss_weight=0.5,
        snr_weights=torch.tensor([0.0, 2.0]),
    )
    # Only the instance half is weighted.
    assert float(weighted) == pytest.approx((0.0 + 2.0) / 2 + 0.5 * 4.0)


def test_draws_follow_the_generator() -> None:
    latents = torch.zeros(2, 4, 8, 8)
    a = draw_noise(
        latents, torch.Generator().manual_seed(1), noise_offset=0.0, num_train_timesteps=1000
    )
    b = draw_noise(
        latents, torch.Generator().manual_seed(1), noise_offset=0.0, num_train_timesteps=1000
    )
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[1].min() >= 0
    assert a[1].max() < 1000
    offset = draw_noise(
        latents, torch.Generator().manual_seed(1), noise_offset=0.5, num_train_timesteps=1000
    )
    # The offset is constant over each image's pixels within a channel.
    difference = offset[0] - a[0]
    assert torch.allclose(difference, difference[:, :, :1, :1].expand_as(difference))
    assert difference.abs().sum() > 0


def test_sample_latents_scales() -> None:
    moments = torch.cat([torch.full((1, 4, 2, 2), 2.0), torch.zeros(1, 4, 2, 2)], dim=1)
    config = SimpleNamespace(scaling_factor=0.5)
    latents = sample_latents(moments, torch.Generator().manual_seed(0), config)
    assert torch.equal(latents, torch.full((1, 4, 2, 2), 1.0))  # std 0: the mean, scaled
    normalised = SimpleNamespace(scaling_factor=1.0, latents_mean=[1.0] * 4, latents_std=[0.5] * 4)
    latents = sample_latents(moments, torch.Generator().manual_seed(0), normalised)
    assert torch.equal(latents, torch.full((1, 4, 2, 2), 2.0))
