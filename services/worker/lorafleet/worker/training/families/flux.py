"""FLUX.1 (dev and schnell): `FluxTransformer2DModel` over 2x2-packed 16-channel latents, a
CLIP-L pooled embedding plus T5-XXL token embeddings, rectified flow with the guidance
embedding of the guidance-distilled dev model, as diffusers' `train_dreambooth_lora_flux.py`
trains it. `train_text_encoder` trains CLIP-L (T5 stays frozen, as in that script).

The constants come from `FluxPipeline` (its packing and position ids, its default guidance
3.5 and sequence length 512), never copied numbers: a test checks them against the pipeline.
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
from lorafleet.worker.training.failures import input_fault
from lorafleet.worker.training.families.base import Components, StepContext, clip_kohya_path
from lorafleet.worker.training.families.flow import (
    FlowMatching,
    guidance_for,
    noised,
    vae_scale_factor,
)

if TYPE_CHECKING:
    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.training.config import Runtime, TrainingConfig

# diffusers' script's default targets: the double blocks' image and text attention and
# feed-forwards; the single blocks' attention projections match the to_q/to_k/to_v suffixes.
TRANSFORMER_TARGET_MODULES = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


# Read once: a signature costs microseconds, and the loss asks for it every step.
@functools.cache
def pipeline_default(name: str) -> Any:
    """A `FluxPipeline.__call__` default (guidance_scale, max_sequence_length)."""
    return inspect.signature(diffusers.FluxPipeline.__call__).parameters[name].default


class Flux(FlowMatching):
    name = "flux"
    pipeline_class = "FluxPipeline"
    denoiser_name = "transformer"
    trainable_encoders = ("text_encoder",)

    def load(self, config: TrainingConfig, runtime: Runtime) -> Components:
        ref = config.model_ref
        common = load_kwargs(config)
        try:
            tokenizer = transformers.CLIPTokenizer.from_pretrained(
                ref, subfolder="tokenizer", **common
            )
        except Exception as exc:
            raise_if_missing_repo(exc, "base_model", ref)
            raise
        tokenizer_2 = transformers.T5TokenizerFast.from_pretrained(
            ref, subfolder="tokenizer_2", **common
        )
        frozen = runtime.frozen_dtype
        text_kwargs = {"dtype": frozen, **SAFE, **common}
        text_encoder = weights(
            lambda: transformers.CLIPTextModel.from_pretrained(
                ref, subfolder="text_encoder", attn_implementation="sdpa", **text_kwargs
            ),
            ref,
            "text_encoder",
        )
        text_encoder_2 = weights(
            lambda: transformers.T5EncoderModel.from_pretrained(
                ref, subfolder="text_encoder_2", **text_kwargs
            ),
            ref,
            "text_encoder_2",
        )
        transformer = load_denoiser(
            config, runtime, diffusers.FluxTransformer2DModel, "transformer"
        )
        vae = load_vae(config, frozen, diffusers.AutoencoderKL)
        noise_scheduler, sampler_config = load_schedulers(
            config, diffusers.FlowMatchEulerDiscreteScheduler
        )
        return Components(
            family=self,
            denoiser=transformer,
            vae=vae,
            text_encoders={"text_encoder": text_encoder, "text_encoder_2": text_encoder_2},
            tokenizers={"tokenizer": tokenizer, "tokenizer_2": tokenizer_2},
            noise_scheduler=noise_scheduler,
            sampler_config=sampler_config,
        )

    def check(self, config: TrainingConfig, components: Components) -> None:
        """Besides the flow families' rules: FLUX.1's latents are shifted by the VAE's
        shift_factor, which SDXL's VAE (the same class) lacks."""
        super().check(config, components)
        if components.vae.config.get("shift_factor") is None:
            raise input_fault(f"{config.vae_field}: the VAE has no shift_factor: not a FLUX.1 VAE")

    def denoiser_targets(self, denoiser: Any) -> tuple[str, ...]:
        return TRANSFORMER_TARGET_MODULES

    def tokenize(
        self, components: Components, prompts: list[str], spec: JobSpec
    ) -> tuple[torch.Tensor, ...]:
        """CLIP's 77 tokens and T5's `max_sequence_length` (the pipeline's 512 when 0)."""
        clip, t5 = components.tokenizers.values()
        length = spec.max_sequence_length or pipeline_default("max_sequence_length")
        out = []
        for tokenizer, max_length in ((clip, 77), (t5, length)):
            out.append(
                tokenizer(
                    prompts,
                    padding="max_length",
                    max_length=max_length,
                    truncation=True,
                    return_tensors="pt",
                ).input_ids
            )
        return tuple(out)

    def encode_frozen(
        self, components: Components, tokens: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """T5's last hidden states (the token embeddings): T5 is never trained."""
        t5 = components.text_encoders["text_encoder_2"]
        return (t5(tokens[1].to(t5.device))[0],)

    def encode(
        self,
        components: Components,
        tokens: Sequence[torch.Tensor],
        frozen: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """T5's token embeddings and CLIP's pooled output, as `FluxPipeline.encode_prompt`
        computes them."""
        (prompt_embeds,) = frozen if frozen is not None else self.encode_frozen(components, tokens)
        clip = components.text_encoders["text_encoder"]
        pooled = clip(tokens[0].to(clip.device), output_hidden_states=False).pooler_output
        return prompt_embeds, pooled

    def latents(
        self, moments: torch.Tensor, generator: torch.Generator, components: Components
    ) -> torch.Tensor:
        """A draw from the posterior (the script's `latent_dist.sample()`), shifted and scaled
        by the VAE config's shift_factor and scaling_factor."""
        mean, std = moments.float().chunk(2, dim=1)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        config = components.vae.config
        return (mean + std * eps - float(config.shift_factor)) * float(config.scaling_factor)

    def loss(
        self,
        run: StepContext,
        latents: torch.Tensor,
        draws: Sequence[torch.Tensor],
        conditioning: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        noise, timesteps, sigmas = draws
        spec = run.spec
        batch, channels, height, width = latents.shape
        pipeline = diffusers.FluxPipeline
        packed = pipeline._pack_latents(
            noised(latents, noise, sigmas), batch, channels, height, width
        )
        image_ids = pipeline._prepare_latent_image_ids(
            batch, height // 2, width // 2, latents.device, latents.dtype
        )
        prompt_embeds, pooled = conditioning
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device)
        transformer = run.components.denoiser
        guidance = guidance_for(transformer, spec, pipeline_default("guidance_scale"), batch)
        with run.autocast():
            prediction = run.denoiser_forward(
                hidden_states=packed,
                # The transformer scales its timestep input by 1000 itself.
                timestep=timesteps / 1000,
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=prompt_embeds,
                txt_ids=text_ids,
                img_ids=image_ids,
                return_dict=False,
            )[0]
        scale = vae_scale_factor(run.components)
        prediction = pipeline._unpack_latents(
            prediction, height=height * scale, width=width * scale, vae_scale_factor=scale
        )
        return self.velocity_loss(run, prediction, latents, draws)

    def kohya_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]], alphas: Mapping[str, float]
    ) -> dict[str, torch.Tensor]:
        """`lora_transformer_<module path with _>` and `lora_te1_...` keys with lora_down /
        lora_up and an `.alpha` (OneTrainer's layout for FLUX.1), which ComfyUI maps onto every
        linear layer of its Flux model. (diffusers' converter of this layout covers attention
        layers only; its kohya sd-scripts converter only FLUX.1-dev's full size: use the
        diffusers file there.)"""
        states = dict(peft_states)
        if "text_encoder" in states:
            states["text_encoder"] = {
                clip_kohya_path(key): tensor for key, tensor in states["text_encoder"].items()
            }
        return kohya_layout(
            states, alphas, {"transformer": "lora_transformer", "text_encoder": "lora_te1"}
        )

    def sampling_pipeline(self, components: Components) -> Any:
        pipeline = diffusers.FluxPipeline(
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
        # FLUX.1 dev is guidance-distilled: guidance_scale is the embedded guidance; a negative
        # prompt takes true classifier-free guidance (true_cfg_scale > 1) at twice the cost.
        arguments: dict[str, Any] = {"guidance_scale": guidance_scale}
        if negative_prompt:
            arguments |= {"negative_prompt": negative_prompt, "true_cfg_scale": 2.0}
        return arguments


def kohya_layout(
    peft_states: Mapping[str, dict[str, torch.Tensor]],
    alphas: Mapping[str, float],
    prefixes: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """peft `<path>.lora_A.weight` / `lora_B.weight` keys as `<prefix>_<path with _>.lora_down
    .weight` / `.lora_up.weight` and `.alpha` (the adapter's lora_alpha)."""
    out: dict[str, torch.Tensor] = {}
    for name, state in peft_states.items():
        for key, tensor in state.items():
            path, kind = key.rsplit(".lora_", 1)
            base = f"{prefixes[name]}_{path.replace('.', '_')}"
            part = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[kind]
            out[f"{base}.{part}"] = tensor
            out[f"{base}.alpha"] = torch.tensor(alphas[name], dtype=torch.float32)
    return out
