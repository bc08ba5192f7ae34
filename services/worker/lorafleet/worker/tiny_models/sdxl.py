"""A randomly initialised SDXL-architecture model, saved in the diffusers pipeline layout.

The stand-in has the *architecture* of SDXL (a UNet with `addition_embed_type="text_time"`
micro-conditioning, two CLIP text encoders whose hidden sizes add up to the UNet's
cross-attention width, the second one with a projection feeding the pooled embedding, an
AutoencoderKL, a scheduler config) and is saved with `StableDiffusionXLPipeline.save_pretrained`.

Two presets:

* `"tiny"`: a few hundred thousand parameters; trains at 64 px on a CPU in well under a second
  per step. Used by the tests, `lorafleet demo` and the CPU benchmark.
* `"sdxl"`: the full-size SDXL UNet, VAE and text-encoder shapes (2.6 B UNet parameters) with
  random weights, for measuring step time on a real accelerator at 1024 px.

The CLIP tokenizers are real byte-level BPE tokenizers loaded from a `vocab.json` and
`merges.txt` generated here (byte alphabet plus merges learnt from a small fixed word list).
The tests pin results trained on the tiny preset: the same seed must keep writing the same
files, so the order in which weights are drawn here must not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lorafleet.worker.tiny_models.common import WeightsDtype
from lorafleet.worker.tiny_models.tokenizers import write_clip_tokenizer

SdxlPreset = Literal["tiny", "sdxl"]

# SDXL micro-conditioning feeds six time ids (original h/w, crop top/left, target h/w) through a
# sinusoidal embedding of `addition_time_embed_dim` each, concatenated with the pooled text
# embedding of the second encoder: that sum is the UNet's projection input width.
_TIME_IDS = 6


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Every dimension a preset fixes."""

    unet_block_out_channels: tuple[int, ...]
    unet_layers_per_block: int
    unet_attention_head_dim: tuple[int, ...]
    unet_transformer_layers_per_block: tuple[int, ...]
    unet_down_block_types: tuple[str, ...]
    unet_up_block_types: tuple[str, ...]
    unet_norm_num_groups: int
    addition_time_embed_dim: int
    text_hidden_sizes: tuple[int, int]
    text_intermediate_sizes: tuple[int, int]
    text_heads: tuple[int, int]
    text_layers: tuple[int, int]
    projection_dim: int
    vae_block_out_channels: tuple[int, ...]
    vae_layers_per_block: int
    vae_norm_num_groups: int
    sample_size: int
    max_tokens: int

    @property
    def cross_attention_dim(self) -> int:
        return sum(self.text_hidden_sizes)

    @property
    def projection_class_embeddings_input_dim(self) -> int:
        return _TIME_IDS * self.addition_time_embed_dim + self.projection_dim


PRESETS: dict[SdxlPreset, ModelShape] = {
    "tiny": ModelShape(
        unet_block_out_channels=(32, 64),
        unet_layers_per_block=1,
        unet_attention_head_dim=(2, 4),
        unet_transformer_layers_per_block=(1, 2),
        unet_down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        unet_up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        unet_norm_num_groups=32,
        addition_time_embed_dim=8,
        text_hidden_sizes=(32, 32),
        text_intermediate_sizes=(37, 37),
        text_heads=(4, 4),
        text_layers=(2, 2),
        projection_dim=32,
        vae_block_out_channels=(32, 64),
        vae_layers_per_block=1,
        vae_norm_num_groups=32,
        sample_size=64,
        max_tokens=77,
    ),
    # stabilityai/stable-diffusion-xl-base-1.0's shapes (CLIP ViT-L and OpenCLIP bigG encoders).
    "sdxl": ModelShape(
        unet_block_out_channels=(320, 640, 1280),
        unet_layers_per_block=2,
        unet_attention_head_dim=(5, 10, 20),
        unet_transformer_layers_per_block=(1, 2, 10),
        unet_down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        unet_up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        unet_norm_num_groups=32,
        addition_time_embed_dim=256,
        text_hidden_sizes=(768, 1280),
        text_intermediate_sizes=(3072, 5120),
        text_heads=(12, 20),
        text_layers=(12, 32),
        projection_dim=1280,
        vae_block_out_channels=(128, 256, 512, 512),
        vae_layers_per_block=2,
        vae_norm_num_groups=32,
        sample_size=1024,
        max_tokens=77,
    ),
}
PRESETS_BY_NAME: dict[str, SdxlPreset] = {name: name for name in PRESETS}


def _text_config(shape: ModelShape, index: int, vocab_size: int) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=shape.text_hidden_sizes[index],
        intermediate_size=shape.text_intermediate_sizes[index],
        num_attention_heads=shape.text_heads[index],
        num_hidden_layers=shape.text_layers[index],
        max_position_embeddings=shape.max_tokens,
        projection_dim=shape.projection_dim,
        hidden_act="gelu" if index else "quick_gelu",
        # The pooled output is taken at the first end-of-text token (transformers' modern rule).
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )


def build_sdxl(
    directory: str | Path,
    *,
    preset: SdxlPreset = "tiny",
    seed: int = 0,
    weights_dtype: WeightsDtype = "fp32",
) -> Path:
    """Builds a random SDXL-architecture model and saves it as a diffusers pipeline at `directory`.

    `StableDiffusionXLPipeline.from_pretrained(directory)` loads the result. Returns the path.
    `weights_dtype` "bf16" halves the files of the full-size preset (5 GB instead of 10 GB for
    the UNet); the VAE stays fp32, as SDXL's is published.
    """
    import diffusers as _diffusers
    import torch
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    # diffusers' constructors are untyped: one Any-typed handle keeps this function checked.
    diffusers: Any = _diffusers

    shape = PRESETS[preset]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    write_clip_tokenizer(root / "tokenizer", shape.max_tokens)
    write_clip_tokenizer(root / "tokenizer_2", shape.max_tokens)
    tokenizer = CLIPTokenizer.from_pretrained(root / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(root / "tokenizer_2")
    vocab_size = len(tokenizer)

    latent_scale = 2 ** (len(shape.vae_block_out_channels) - 1)
    torch.manual_seed(seed)
    unet = diffusers.UNet2DConditionModel(
        sample_size=shape.sample_size // latent_scale,
        in_channels=4,
        out_channels=4,
        block_out_channels=shape.unet_block_out_channels,
        layers_per_block=shape.unet_layers_per_block,
        down_block_types=shape.unet_down_block_types,
        up_block_types=shape.unet_up_block_types,
        attention_head_dim=shape.unet_attention_head_dim,
        transformer_layers_per_block=shape.unet_transformer_layers_per_block,
        cross_attention_dim=shape.cross_attention_dim,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=shape.addition_time_embed_dim,
        projection_class_embeddings_input_dim=shape.projection_class_embeddings_input_dim,
        norm_num_groups=shape.unet_norm_num_groups,
    )
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(shape.vae_block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(shape.vae_block_out_channels),
        block_out_channels=shape.vae_block_out_channels,
        layers_per_block=shape.vae_layers_per_block,
        latent_channels=4,
        norm_num_groups=shape.vae_norm_num_groups,
        sample_size=shape.sample_size,
        scaling_factor=0.13025,
        force_upcast=True,
    )
    text_encoder = CLIPTextModel(_text_config(shape, 0, vocab_size))
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(shape, 1, vocab_size))
    # SDXL base's scheduler config; the trainer reads it into a DDPMScheduler.
    scheduler = diffusers.EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipeline = diffusers.StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    if weights_dtype == "bf16":
        frozen: list[Any] = [unet, text_encoder, text_encoder_2]
        for module in frozen:
            module.to(torch.bfloat16)
    pipeline.save_pretrained(root)
    return root
