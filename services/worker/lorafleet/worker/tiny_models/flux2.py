"""A randomly initialised FLUX.2 [klein]-architecture model, saved as a `Flux2KleinPipeline`.

The parts are klein's: a `Flux2Transformer2DModel` without guidance embedding, fed 2x2-patchified
latents of an `AutoencoderKLFlux2` (whose BatchNorm `bn` over the patchified latents normalises
them for the transformer), a Qwen3 causal LM whose hidden states after layers 9, 18 and 27 are
concatenated into the transformer's `encoder_hidden_states` (so its `joint_attention_dim` is 3x
the Qwen3 width), a Qwen2 tokenizer with Qwen3's chat template, and FLUX.2's flow-matching
scheduler config.

Presets:

* `"tiny"`: 4 latent channels (the transformer's input is 4 x 2 x 2 = 16 wide, as klein's 128 is
  32 x 2 x 2) and a 16-wide Qwen3 as deep as the real ones, 36 layers: `hidden_states[27]` is
  then a raw layer output as in Qwen3-4B (with 27 layers it would be transformers' final-normed
  last entry), and a trainer reading other layers (diffusers' klein script defaults to 10, 20,
  30) runs and differs instead of failing on a missing layer.
* `"klein-4b"`, `"klein-9b"`: the full-size FLUX.2 [klein] 4B and 9B shapes (the transformer,
  Qwen3-4B or Qwen3-8B, the 32-channel FLUX.2 VAE) with random weights, for GPU measurements.

The pipeline is saved as the undistilled [klein] Base (`is_distilled` false): the variant one
fine-tunes, and the one whose pipeline applies classifier-free guidance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lorafleet.worker.tiny_models.common import WeightsDtype, cast_to_bf16
from lorafleet.worker.tiny_models.tokenizers import qwen_tokenizer

Flux2Preset = Literal["tiny", "klein-4b", "klein-9b"]

# Flux2KleinPipeline.encode_prompt's default `text_encoder_out_layers` (diffusers' klein trainer
# at 58eb52c0 defaults to FLUX.2 [dev]'s 10, 20, 30 instead: diffusers issue #13445).
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)


@dataclass(frozen=True, kw_only=True)
class Flux2Shape:
    """Every dimension a FLUX.2 [klein] preset fixes. A `None` vocabulary size means "the
    generated tokenizer's length"; the full-size presets keep Qwen3's 151936-token tables."""

    num_layers: int
    num_single_layers: int
    attention_head_dim: int
    num_attention_heads: int
    axes_dims_rope: tuple[int, int, int, int]
    qwen_hidden_size: int
    qwen_intermediate_size: int
    qwen_layers: int
    qwen_heads: int
    qwen_kv_heads: int
    qwen_head_dim: int
    qwen_vocab_size: int | None
    qwen_tie_embeddings: bool
    qwen_max_positions: int
    vae_block_out_channels: tuple[int, ...]
    vae_layers_per_block: int
    vae_norm_num_groups: int
    latent_channels: int
    sample_size: int

    @property
    def in_channels(self) -> int:
        """The transformer sees 2x2 patches of latents packed into channels."""
        return self.latent_channels * 4

    @property
    def joint_attention_dim(self) -> int:
        """One Qwen3 hidden state per layer of `TEXT_ENCODER_OUT_LAYERS`, concatenated."""
        return len(TEXT_ENCODER_OUT_LAYERS) * self.qwen_hidden_size


# The full-size numbers: the transformers from diffusers' scripts/convert_flux2_to_diffusers.py
# (`get_flux2_transformer_config`, at 58eb52c0: klein-4b 5 double + 20 single blocks, 24 heads
# of 128, joint_attention_dim 7680; klein-9b 8 + 24 blocks, 32 heads, 12288; both patch_size 1,
# in_channels 128, mlp_ratio 3, axes_dims_rope (32, 32, 32, 32), rope_theta 2000, no guidance
# embeds); the text encoders from the published text_encoder/config.json, Qwen/Qwen3-4B's for
# FLUX.2-klein-4B (2560 wide, 36 layers, 32 query and 8 key/value heads of 128, MLP 9728, tied
# embeddings) and Qwen/Qwen3-8B's for klein 9B (4096 wide, 36 layers, 32/8 heads of 128, MLP
# 12288, untied), 151936 tokens, 40960 positions; the VAE is `AutoencoderKLFlux2()`'s defaults,
# which the conversion script loads the released FLUX.2 VAE into (128/256/512/512, 2 layers a
# block, 32 latent channels).
PRESETS: dict[Flux2Preset, Flux2Shape] = {
    "tiny": Flux2Shape(
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        axes_dims_rope=(4, 4, 4, 4),  # (time, height, width, sequence), as klein's (32,)*4
        qwen_hidden_size=16,
        qwen_intermediate_size=32,
        qwen_layers=36,
        qwen_heads=2,
        qwen_kv_heads=1,  # grouped-query attention, as Qwen3's 32/8
        qwen_head_dim=8,
        qwen_vocab_size=None,
        qwen_tie_embeddings=True,
        qwen_max_positions=1024,  # klein pads prompts to 512 tokens
        vae_block_out_channels=(32, 64),
        vae_layers_per_block=1,
        vae_norm_num_groups=32,
        latent_channels=4,
        sample_size=64,
    ),
    "klein-4b": Flux2Shape(
        num_layers=5,
        num_single_layers=20,
        attention_head_dim=128,
        num_attention_heads=24,
        axes_dims_rope=(32, 32, 32, 32),
        qwen_hidden_size=2560,
        qwen_intermediate_size=9728,
        qwen_layers=36,
        qwen_heads=32,
        qwen_kv_heads=8,
        qwen_head_dim=128,
        qwen_vocab_size=151936,
        qwen_tie_embeddings=True,
        qwen_max_positions=40960,
        vae_block_out_channels=(128, 256, 512, 512),
        vae_layers_per_block=2,
        vae_norm_num_groups=32,
        latent_channels=32,
        sample_size=1024,
    ),
    "klein-9b": Flux2Shape(
        num_layers=8,
        num_single_layers=24,
        attention_head_dim=128,
        num_attention_heads=32,
        axes_dims_rope=(32, 32, 32, 32),
        qwen_hidden_size=4096,
        qwen_intermediate_size=12288,
        qwen_layers=36,
        qwen_heads=32,
        qwen_kv_heads=8,
        qwen_head_dim=128,
        qwen_vocab_size=151936,
        qwen_tie_embeddings=False,
        qwen_max_positions=40960,
        vae_block_out_channels=(128, 256, 512, 512),
        vae_layers_per_block=2,
        vae_norm_num_groups=32,
        latent_channels=32,
        sample_size=1024,
    ),
}
PRESETS_BY_NAME: dict[str, Flux2Preset] = {name: name for name in PRESETS}


def scheduler_config() -> dict[str, Any]:
    """FLUX.2's scheduler/scheduler_config.json (as published with FLUX.2-dev and the klein
    checkpoints): dynamic shifting with exponential time shift. Flux2KleinPipeline passes its
    own empirical `mu` and sigmas at inference; trainers read the rest."""
    return {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "time_shift_type": "exponential",
    }


def transformer_config(shape: Flux2Shape) -> dict[str, Any]:
    return {
        "patch_size": 1,
        "in_channels": shape.in_channels,
        "num_layers": shape.num_layers,
        "num_single_layers": shape.num_single_layers,
        "attention_head_dim": shape.attention_head_dim,
        "num_attention_heads": shape.num_attention_heads,
        "joint_attention_dim": shape.joint_attention_dim,
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": shape.axes_dims_rope,
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": False,
    }


def vae_config(shape: Flux2Shape) -> dict[str, Any]:
    blocks = len(shape.vae_block_out_channels)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * blocks,
        "up_block_types": ("UpDecoderBlock2D",) * blocks,
        "block_out_channels": shape.vae_block_out_channels,
        "layers_per_block": shape.vae_layers_per_block,
        "latent_channels": shape.latent_channels,
        "norm_num_groups": shape.vae_norm_num_groups,
        "sample_size": shape.sample_size,
        "use_quant_conv": True,
        "use_post_quant_conv": True,
        "batch_norm_eps": 1e-4,
        "batch_norm_momentum": 0.1,
        "patch_size": (2, 2),
    }


def qwen_config(shape: Flux2Shape, *, vocab_size: int, pad: int, eos: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.qwen_hidden_size,
        intermediate_size=shape.qwen_intermediate_size,
        num_hidden_layers=shape.qwen_layers,
        num_attention_heads=shape.qwen_heads,
        num_key_value_heads=shape.qwen_kv_heads,
        head_dim=shape.qwen_head_dim,
        max_position_embeddings=shape.qwen_max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=shape.qwen_tie_embeddings,
        pad_token_id=pad,
        eos_token_id=eos,
    )


def build_flux2(
    directory: str | Path,
    *,
    preset: Flux2Preset = "tiny",
    seed: int = 0,
    weights_dtype: WeightsDtype = "fp32",
) -> Path:
    """Builds a random FLUX.2 [klein]-architecture model and saves it as a `Flux2KleinPipeline`
    at `directory`; `Flux2KleinPipeline.from_pretrained(directory)` loads it. Returns the path.

    The VAE's BatchNorm running statistics are drawn too (a fresh BatchNorm has mean 0 and
    variance 1, which would make the latent normalisation an identity that no test could tell
    from a missing one).
    """
    import diffusers as _diffusers
    import torch
    from transformers import Qwen3ForCausalLM

    diffusers: Any = _diffusers  # untyped constructors

    shape = PRESETS[preset]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_tokenizer()

    torch.manual_seed(seed)
    transformer = diffusers.Flux2Transformer2DModel(**transformer_config(shape))
    cast_to_bf16(weights_dtype, transformer)  # before the next part is drawn: one fp32 at a time
    vae = diffusers.AutoencoderKLFlux2(**vae_config(shape))
    with torch.no_grad():
        channels = vae.bn.running_mean.shape[0]
        vae.bn.running_mean.copy_(0.1 * torch.randn(channels))
        vae.bn.running_var.copy_(0.5 + torch.rand(channels))
    text_encoder = Qwen3ForCausalLM(
        qwen_config(
            shape,
            vocab_size=shape.qwen_vocab_size or len(tokenizer),
            pad=tokenizer.pad_token_id,
            eos=tokenizer.eos_token_id,
        )
    )
    cast_to_bf16(weights_dtype, text_encoder)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**scheduler_config())
    pipeline = diffusers.Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )
    pipeline.save_pretrained(root)
    return root
