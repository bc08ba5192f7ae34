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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

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


# Read once: a signature costs microseconds, and the loss asks for it every step.
@functools.cache
def pipeline_default(name: str, method: str = "encode_prompt") -> Any:
    """A `Flux2KleinPipeline` default: of `encode_prompt` (text_encoder_out_layers,
    max_sequence_length) or `__call__` (guidance_scale)."""
    signature = inspect.signature(getattr(diffusers.Flux2KleinPipeline, method))
    return signature.parameters[name].default


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
        prediction = prediction[:, : packed.size(1)]
        height, width = latents.shape[2:]
        prediction = pipeline._unpack_latents_with_ids(prediction, latent_ids, height, width)
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
