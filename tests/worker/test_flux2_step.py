"""FLUX.2 [klein]'s step computes less than diffusers' code, never something else
(families/flux2.py). The last single block computes its attention and MLP for the image tokens
only (`ImageRowsAttention`): the transformer's output is the default processor's, bit for bit,
and the LoRA gradients are the same up to float rounding (sums over fewer zero rows), with and
without gradient checkpointing, for any prompt length and batch; a loaded klein model carries
it. The prediction is unpacked by a reshape, bit for bit the pipeline's scatter by ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorafleet.worker.training.base_model import diffusers
from lorafleet.worker.training.families import flux2
from lorafleet.worker.training.lora import LoraConfig
from tests.support.training import make_config, tiny_spec


def _transformer(model: Path, *, image_rows: bool) -> Any:
    """The tiny klein transformer with LoRA on the family's targets, every B non-zero (a
    zero B would hide a wrong input to the adapters)."""
    transformer = diffusers.Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer")
    transformer.requires_grad_(False)
    targets = flux2.Flux2().denoiser_targets(transformer)
    generator = torch.Generator().manual_seed(0)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(targets)))
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    if image_rows:
        flux2.ImageRowsAttention.install(transformer)
    return transformer


@pytest.mark.parametrize(
    ("batch", "text_tokens", "checkpointing"), [(1, 512, False), (2, 40, False), (1, 64, True)]
)
def test_the_image_rows_are_the_default_processors(
    tiny_flux2_dir: Path, batch: int, text_tokens: int, checkpointing: bool
) -> None:
    default = _transformer(tiny_flux2_dir, image_rows=False)
    ours = _transformer(tiny_flux2_dir, image_rows=True)
    last = ours.single_transformer_blocks[-1].attn.processor
    assert isinstance(last, flux2.ImageRowsAttention)
    generator = torch.Generator().manual_seed(1)
    config = default.config
    latents = torch.randn((batch, config.in_channels, 6, 4), generator=generator)
    prompt = torch.randn((batch, text_tokens, config.joint_attention_dim), generator=generator)
    pipeline = diffusers.Flux2KleinPipeline
    inputs = {
        "hidden_states": pipeline._pack_latents(latents),
        "timestep": torch.rand((batch,), generator=generator),
        "guidance": None,
        "encoder_hidden_states": prompt,
        "txt_ids": pipeline._prepare_text_ids(prompt),
        "img_ids": pipeline._prepare_latent_ids(latents),
        "return_dict": False,
    }
    results = []
    for transformer in (default, ours):
        if checkpointing:
            transformer.enable_gradient_checkpointing()
            transformer.train()
        out = transformer(**inputs)[0]
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads = {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}
        results.append((out.detach(), grads))
    (expected, expected_grads), (got, got_grads) = results
    assert last.text_tokens == text_tokens  # the block's rows really were cut
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert expected_grads.keys() == got_grads.keys()
    for name, grad in expected_grads.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs)[0], default(**inputs)[0], rtol=0, atol=0)


def test_a_loaded_klein_model_computes_its_last_blocks_image_rows_only(
    tiny_flux2_dir: Path,
) -> None:
    from lorafleet.worker.training.base_model import detect_family, load_components
    from lorafleet.worker.training.config import resolve_runtime

    spec = tiny_spec(model_family="flux2", base_model=str(tiny_flux2_dir))
    config = make_config(tiny_flux2_dir, spec)
    components = load_components(config, resolve_runtime(config), detect_family(config))
    blocks = components.denoiser.single_transformer_blocks
    assert isinstance(blocks[-1].attn.processor, flux2.ImageRowsAttention)
    assert not any(isinstance(b.attn.processor, flux2.ImageRowsAttention) for b in blocks[:-1])


def test_unpack_is_the_pipelines_unpacking_by_ids() -> None:
    pipeline = diffusers.Flux2KleinPipeline
    latents = torch.randn((2, 8, 6, 4), generator=torch.Generator().manual_seed(2))
    tokens = pipeline._pack_latents(latents) * 3  # any tokens in the packed layout
    ids = pipeline._prepare_latent_ids(latents)
    expected = pipeline._unpack_latents_with_ids(tokens, ids, 6, 4)
    torch.testing.assert_close(flux2.unpack(tokens, latents.shape), expected, rtol=0, atol=0)
