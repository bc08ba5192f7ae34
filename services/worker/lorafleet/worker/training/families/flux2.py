"""FLUX.2 [klein] (4 B and 9 B): `Flux2Transformer2DModel` over 2x2-patchified latents of
`AutoencoderKLFlux2` normalised by the VAE's batch-norm statistics, conditioned on chosen hidden
layers of a `Qwen3ForCausalLM` prompt encoder (chat-templated), rectified flow, as diffusers'
`train_dreambooth_lora_flux2_klein.py` trains it. The Qwen3 encoder stays frozen and leaves the
accelerator once the prompts are encoded.

Every constant comes from `Flux2KleinPipeline` itself (the hidden layers, 9, 18 and 27; the
sequence length; the prompt template), read from the pipeline, never copied: diffusers' klein
script defaults its layers to 10, 20, 30 (FLUX.2 [dev]'s; diffusers issue #13445), which feeds
the transformer embeddings it was never trained on. A test compares our prompt embeddings with
the pipeline's `encode_prompt`.

The transformer's last single block computes its attention and MLP for the image tokens only
(`ImageRowsAttention`): the transformer drops the text tokens' rows right after that block, so
the default processor computes them for nothing (with 512 prompt tokens, most of that block).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from diffusers.models import attention_dispatch as _attention_dispatch
from diffusers.models import embeddings as _embeddings
from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttnProcessor

from lorafleet.worker.training.base_model import (
    SAFE,
    diffusers,
    load_denoiser,
    load_kwargs,
    load_schedulers,
    load_vae,
    raise_if_missing_repo,
    transformers,
    weights,
)
from lorafleet.worker.training.families.base import Components, StepContext
from lorafleet.worker.training.families.flow import FlowMatching, guidance_for, noised

if TYPE_CHECKING:
    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.training.config import Runtime, TrainingConfig


# Typed for diffusers' own callers (apply_rotary_emb's (cos, sin) pair is typed as a 1-tuple).
dispatch_attention_fn: Any = _attention_dispatch.dispatch_attention_fn
apply_rotary_emb: Any = _embeddings.apply_rotary_emb


# Read once: a signature costs microseconds, and the loss asks for it every step.
@functools.cache
def pipeline_default(name: str, method: str = "encode_prompt") -> Any:
    """A `Flux2KleinPipeline` default: of `encode_prompt` (text_encoder_out_layers,
    max_sequence_length) or `__call__` (guidance_scale)."""
    signature = inspect.signature(getattr(diffusers.Flux2KleinPipeline, method))
    return signature.parameters[name].default


def unpack(tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`Flux2KleinPipeline._pack_latents` undone: (batch, height * width, channels) tokens back
    to (batch, channels, height, width) latents. The latent ids are in that row-major order, so
    this is what the pipeline's `_unpack_latents_with_ids` scatters, without a scatter (and its
    backward's gather) per image."""
    return tokens.transpose(1, 2).reshape(shape)


class Flux2(FlowMatching):
    name = "flux2"
    pipeline_class = "Flux2KleinPipeline"
    denoiser_name = "transformer"
    trainable_encoders = ()

    def load(self, config: TrainingConfig, runtime: Runtime) -> Components:
        ref = config.model_ref
        common = load_kwargs(config)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                ref, subfolder="tokenizer", **common
            )
        except Exception as exc:
            raise_if_missing_repo(exc, "base_model", ref)
            raise
        frozen = runtime.frozen_dtype
        text_encoder = weights(
            lambda: transformers.Qwen3ForCausalLM.from_pretrained(
                ref, subfolder="text_encoder", dtype=frozen, **SAFE, **common
            ),
            ref,
            "text_encoder",
        )
        transformer = load_denoiser(
            config, runtime, diffusers.Flux2Transformer2DModel, "transformer"
        )
        ImageRowsAttention.install(transformer)
        # The batch-norm statistics below are fp32 reads of the VAE: it stays fp32 unless the
        # mixed precision asks otherwise (FLUX.2's VAE is stable in bf16).
        vae = load_vae(config, frozen, diffusers.AutoencoderKLFlux2)
        noise_scheduler, sampler_config = load_schedulers(
            config, diffusers.FlowMatchEulerDiscreteScheduler
        )
        return Components(
            family=self,
            denoiser=transformer,
            vae=vae,
            text_encoders={"text_encoder": text_encoder},
            tokenizers={"tokenizer": tokenizer},
            noise_scheduler=noise_scheduler,
            sampler_config=sampler_config,
        )

    def denoiser_targets(self, denoiser: Any) -> tuple[str, ...]:
        """The script's: the double blocks' image attention, and each single block's fused
        QKV-MLP input and its output projection (named per block: `to_out` alone would match
        the double blocks' ModuleList)."""
        singles = len(denoiser.single_transformer_blocks)
        return (
            "to_k",
            "to_q",
            "to_v",
            "to_out.0",
            "to_qkv_mlp_proj",
            *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(singles)),
        )

    def tokenize(
        self, components: Components, prompts: list[str], spec: JobSpec
    ) -> tuple[torch.Tensor, ...]:
        """Each prompt in the chat template, as the pipeline wraps it; ids and attention mask."""
        tokenizer = components.tokenizers["tokenizer"]
        length = spec.max_sequence_length or pipeline_default("max_sequence_length")
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for prompt in prompts
        ]
        batch = tokenizer(
            texts,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=length,
        )
        return batch["input_ids"], batch["attention_mask"]

    def encode_frozen(
        self, components: Components, tokens: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """The chosen hidden layers side by side per token (the pipeline's layers)."""
        encoder = components.text_encoders["text_encoder"]
        ids, mask = tokens
        out = encoder(
            input_ids=ids.to(encoder.device),
            attention_mask=mask.to(encoder.device),
            output_hidden_states=True,
            use_cache=False,
        )
        layers = pipeline_default("text_encoder_out_layers")
        stacked = torch.stack([out.hidden_states[k] for k in layers], dim=1)
        batch, count, length, width = stacked.shape
        embeds: torch.Tensor = stacked.permute(0, 2, 1, 3).reshape(batch, length, count * width)
        return (embeds,)

    def encode(
        self,
        components: Components,
        tokens: Sequence[torch.Tensor],
        frozen: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The Qwen3 encoder is never trained: the prompt embedding is `encode_frozen`'s."""
        return tuple(frozen) if frozen is not None else self.encode_frozen(components, tokens)

    def latents(
        self, moments: torch.Tensor, generator: torch.Generator, components: Components
    ) -> torch.Tensor:
        """The posterior's mean, 2x2-patchified and normalised by the VAE's batch norm."""
        mean, _ = moments.float().chunk(2, dim=1)
        patched = diffusers.Flux2KleinPipeline._patchify_latents(mean)
        bn = components.vae.bn
        shift = bn.running_mean.float().view(1, -1, 1, 1)
        spread = torch.sqrt(
            bn.running_var.float().view(1, -1, 1, 1) + components.vae.config.batch_norm_eps
        )
        normalised: torch.Tensor = (patched - shift.to(patched.device)) / spread.to(patched.device)
        return normalised

    def loss(
        self,
        run: StepContext,
        latents: torch.Tensor,
        draws: Sequence[torch.Tensor],
        conditioning: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        noise, timesteps, sigmas = draws
        spec = run.spec
        pipeline = diffusers.Flux2KleinPipeline
        latent_ids = pipeline._prepare_latent_ids(latents).to(latents.device)
        packed = pipeline._pack_latents(noised(latents, noise, sigmas))
        (prompt_embeds,) = conditioning
        text_ids = pipeline._prepare_text_ids(prompt_embeds).to(latents.device)
        transformer = run.components.denoiser
        # klein is not guidance-distilled (no guidance embedding): None unless the model has one.
        default = pipeline_default("guidance_scale", "__call__")
        guidance = guidance_for(transformer, spec, default, latents.shape[0])
        with run.autocast():
            prediction = run.denoiser_forward(
                hidden_states=packed,
                timestep=timesteps / 1000,
                guidance=guidance,
                encoder_hidden_states=prompt_embeds,
                txt_ids=text_ids,
                img_ids=latent_ids,
                return_dict=False,
            )[0]
        prediction = unpack(prediction[:, : packed.size(1)], latents.shape)
        return self.velocity_loss(run, prediction, latents, draws)

    def kohya_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]], alphas: Mapping[str, float]
    ) -> dict[str, torch.Tensor]:
        """Black Forest Labs' module names in kohya's layout, as ComfyUI's FLUX.2 model names
        its layers and diffusers' FLUX.2 kohya converter reads them: a double block's image
        q, k and v adapters become one `img_attn_qkv` adapter (their down projections stacked,
        their up projections block-diagonal, so it computes exactly the three), its output
        `img_attn_proj`; a single block's fused input `linear1`, its output `linear2`."""
        state = peft_states["transformer"]
        alpha = alphas["transformer"]
        out: dict[str, torch.Tensor] = {}

        def put(name: str, down: torch.Tensor, up: torch.Tensor, scale_alpha: float) -> None:
            base = f"lora_unet_{name}"
            out[f"{base}.lora_down.weight"] = down
            out[f"{base}.lora_up.weight"] = up
            out[f"{base}.alpha"] = torch.tensor(scale_alpha, dtype=torch.float32)

        def pair(path: str) -> tuple[torch.Tensor, torch.Tensor]:
            return state.pop(f"{path}.lora_A.weight"), state.pop(f"{path}.lora_B.weight")

        state = dict(state)
        blocks = sorted(
            {int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")}
        )
        for i in blocks:
            prefix = f"transformer_blocks.{i}.attn"
            parts = [pair(f"{prefix}.to_{x}") for x in ("q", "k", "v")]
            down = torch.cat([a for a, _ in parts])
            up = torch.block_diag(*(b for _, b in parts))  # type: ignore[no-untyped-call]
            # Three adapters side by side: rank and alpha both triple, the scale stays.
            put(f"double_blocks_{i}_img_attn_qkv", down, up, 3 * alpha)
            put(f"double_blocks_{i}_img_attn_proj", *pair(f"{prefix}.to_out.0"), alpha)
        singles = sorted(
            {int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")}
        )
        for i in singles:
            prefix = f"single_transformer_blocks.{i}.attn"
            put(f"single_blocks_{i}_linear1", *pair(f"{prefix}.to_qkv_mlp_proj"), alpha)
            put(f"single_blocks_{i}_linear2", *pair(f"{prefix}.to_out"), alpha)
        if state:
            # A target outside the default ones has no agreed kohya name: refuse, never drop.
            raise ValueError(f"no kohya name for FLUX.2 LoRA layers {sorted(state)[:3]}")
        return out

    def sampling_pipeline(self, components: Components) -> Any:
        pipeline = diffusers.Flux2KleinPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(
                components.sampler_config
            ),
            vae=components.vae,
            transformer=components.denoiser,
            **components.text_encoders,
            **components.tokenizers,
        )
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def sample_arguments(self, *, negative_prompt: str, guidance_scale: float) -> dict[str, Any]:
        arguments: dict[str, Any] = {"guidance_scale": guidance_scale}
        if negative_prompt:
            arguments["negative_prompt"] = negative_prompt
        return arguments


class ImageRowsAttention:
    """The attention processor of the transformer's last single block: every token's keys and
    values, but the queries, attention and MLP of the image tokens only. The transformer drops
    the text tokens' rows after that block (`hidden_states[:, num_txt_tokens:]`), so their
    outputs are never used: here they are zeros, and the image rows are what the default
    processor (`Flux2ParallelSelfAttnProcessor`) computes, each row's arithmetic unchanged.
    With klein's 512 prompt tokens that is most of the block's attention and MLP, forward and
    backward: a tenth of the tiny model's training step at 64 px (4 blocks, 256 image tokens),
    well under 1% of klein 4B's at 1024 px (25 blocks, 4096 image tokens).

    The transformer's forward pre-hook tells it each call's text length (the prompt embedding's
    tokens): no call, training or sampling, can see another call's. Without one (another
    caller, a KV-cache mode, an attention mask, context parallelism) it runs the default
    processor. A test compares the output and the LoRA gradients with the default processor's.
    """

    # Set by diffusers' `set_attention_backend` and context parallelism on every processor.
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __init__(self, default: Any) -> None:
        self.default = default
        self.text_tokens = 0

    @classmethod
    def install(cls, transformer: Any) -> None:
        """On the last single block, if it has diffusers' default processor (another one is
        someone's choice, kept)."""
        blocks = getattr(transformer, "single_transformer_blocks", None)
        if not blocks:
            return
        attention = blocks[-1].attn
        if type(attention.processor) is not Flux2ParallelSelfAttnProcessor:
            return
        processor = cls(attention.processor)
        attention.set_processor(processor)

        def count_text_tokens(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            text: Any = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            plain = text is not None and kwargs.get("kv_cache_mode") is None
            processor.text_tokens = int(text.shape[1]) if plain else 0

        transformer.register_forward_pre_hook(count_text_tokens, with_kwargs=True)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        text = self.text_tokens
        if not text or attention_mask is not None or self._parallel_config is not None:
            return self.default(attn, hidden_states, attention_mask, image_rotary_emb)  # type: ignore[no-any-return]
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_width = 3 * attn.inner_dim
        qkv, mlp = projected.split([qkv_width, projected.shape[-1] - qkv_width], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        query = attn.norm_q(query[:, text:])
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query = apply_rotary_emb(query, (cos[text:], sin[text:]), sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        attended = dispatch_attention_fn(query, key, value, backend=self._attention_backend)
        attended = attended.flatten(2, 3).to(query.dtype)
        image_rows = attn.to_out(torch.cat([attended, attn.mlp_act_fn(mlp[:, text:])], dim=-1))
        # (batch, tokens, width): the text tokens' rows first, zero.
        return torch.nn.functional.pad(image_rows, (0, 0, text, 0))
