"""Stable Diffusion XL: a UNet with text-time micro-conditioning, two CLIP encoders, the DDPM
objective (epsilon or v-prediction, min-SNR weighting, offset noise), as diffusers'
`train_dreambooth_lora_sdxl.py` trains it.

Components come through their real `from_pretrained`: two CLIP tokenizers, `CLIPTextModel` and
`CLIPTextModelWithProjection`, the `UNet2DConditionModel`, the `AutoencoderKL` (optionally a
separate VAE such as an fp16-safe one), and a `DDPMScheduler` read from the base model's
scheduler config. Attention runs through PyTorch SDPA in the UNet and the encoders.
"""

from __future__ import annotations

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
from lorafleet.worker.training.families.base import (
    Components,
    Family,
    StepContext,
    clip_kohya_path,
)
from lorafleet.worker.training.objective import (
    draw_noise,
    dreambooth_loss,
    min_snr_weights,
    prediction_target,
    sample_latents,
    snr_per_timestep,
)

if TYPE_CHECKING:
    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.training.config import Runtime, TrainingConfig
    from lorafleet.worker.training.data import Example

UNET_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
_KOHYA_PREFIXES = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}


class Sdxl(Family):
    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"
    denoiser_name = "unet"
    trainable_encoders = ("text_encoder", "text_encoder_2")

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
        tokenizer_2 = transformers.CLIPTokenizer.from_pretrained(
            ref, subfolder="tokenizer_2", **common
        )
        frozen = runtime.frozen_dtype
        text_kwargs = {"dtype": frozen, "attn_implementation": "sdpa", **SAFE, **common}
        text_encoder = weights(
            lambda: transformers.CLIPTextModel.from_pretrained(
                ref, subfolder="text_encoder", **text_kwargs
            ),
            ref,
            "text_encoder",
        )
        text_encoder_2 = weights(
            lambda: transformers.CLIPTextModelWithProjection.from_pretrained(
                ref, subfolder="text_encoder_2", **text_kwargs
            ),
            ref,
            "text_encoder_2",
        )
        unet = load_denoiser(config, runtime, diffusers.UNet2DConditionModel, "unet")
        vae = load_vae(config, frozen, diffusers.AutoencoderKL)
        noise_scheduler, sampler_config = load_schedulers(config, diffusers.DDPMScheduler)
        return Components(
            family=self,
            denoiser=unet,
            vae=vae,
            text_encoders={"text_encoder": text_encoder, "text_encoder_2": text_encoder_2},
            tokenizers={"tokenizer": tokenizer, "tokenizer_2": tokenizer_2},
            noise_scheduler=noise_scheduler,
            sampler_config=sampler_config,
        )

    def check(self, config: TrainingConfig, components: Components) -> None:
        """The VAE's latent channels are the UNet's input (a FLUX.1 VAE has 16, SDXL's 4)."""
        channels = components.vae.config.latent_channels
        if channels != components.denoiser.config.in_channels:
            raise input_fault(
                f"{config.vae_field}: the VAE's {channels} latent channels do not fit the UNet's"
                f" {components.denoiser.config.in_channels} inputs: a VAE of another model"
            )

    def denoiser_targets(self, denoiser: Any) -> tuple[str, ...]:
        return UNET_TARGET_MODULES

    def tokenize(
        self, components: Components, prompts: list[str], spec: JobSpec
    ) -> tuple[torch.Tensor, ...]:
        """Token ids for both encoders, padded to each tokenizer's full length as SDXL was
        trained."""
        return tuple(
            tokenizer(
                prompts,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            for tokenizer in components.tokenizers.values()
        )

    def encode(
        self,
        components: Components,
        tokens: Sequence[torch.Tensor],
        frozen: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Penultimate hidden states of both encoders side by side, and the second encoder's
        projected pooled output. Both encoders are trainable: nothing is `encode_frozen`'s."""
        hidden = []
        pooled = None
        for encoder, token_ids in zip(components.text_encoders.values(), tokens, strict=True):
            out = encoder(token_ids.to(encoder.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            # Only the encoder with a projection has `text_embeds`: SDXL's pooled input.
            pooled = getattr(out, "text_embeds", None)
        assert pooled is not None
        return torch.cat(hidden, dim=-1), pooled

    def latents(
        self, moments: torch.Tensor, generator: torch.Generator, components: Components
    ) -> torch.Tensor:
        return sample_latents(moments, generator, components.vae.config)

    def draw(
        self,
        latents: torch.Tensor,
        generator: torch.Generator,
        examples: list[Example],
        run: Any,
    ) -> tuple[torch.Tensor, ...]:
        scheduler_config = run.components.noise_scheduler.config
        noise, timesteps = draw_noise(
            latents,
            generator,
            noise_offset=run.spec.noise_offset,
            num_train_timesteps=int(scheduler_config.num_train_timesteps),
        )
        time_ids = run.to_device(run.data.time_ids(examples))
        return noise, timesteps, time_ids

    def loss(
        self,
        run: StepContext,
        latents: torch.Tensor,
        draws: Sequence[torch.Tensor],
        conditioning: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        noise, timesteps, time_ids = draws
        scheduler = run.components.noise_scheduler
        noisy = scheduler.add_noise(latents, noise, timesteps)
        prompt_embeds, pooled = conditioning
        with run.autocast():
            prediction = run.denoiser_forward(
                noisy,
                timesteps,
                prompt_embeds,
                added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids},
                return_dict=False,
            )[0]
        prediction_type = str(scheduler.config.prediction_type)
        target = prediction_target(prediction_type, scheduler, latents, noise, timesteps)
        spec = run.spec
        weights_ = None
        if spec.snr_gamma > 0:
            count = len(timesteps) // 2 if run.num_class else len(timesteps)
            snr = snr_per_timestep(scheduler.alphas_cumprod.to(timesteps.device))
            weights_ = min_snr_weights(snr[timesteps[:count]], spec.snr_gamma, prediction_type)
        return dreambooth_loss(
            prediction,
            target,
            with_prior=run.num_class > 0,
            prior_loss_weight=spec.prior_loss_weight,
            snr_weights=weights_,
        )

    def diffusers_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        # As StableDiffusionXLPipeline.save_lora_weights writes it: diffusers-format keys.
        from lorafleet.worker.training.lora import convert_state_dict_to_diffusers

        return {
            f"{prefix}.{key}": tensor
            for prefix, state in peft_states.items()
            for key, tensor in convert_state_dict_to_diffusers(state).items()
        }

    def kohya_state_dict(
        self, peft_states: Mapping[str, dict[str, torch.Tensor]], alphas: Mapping[str, float]
    ) -> dict[str, torch.Tensor]:
        """kohya sd-scripts' keys (`lora_unet_...`, `lora_te1_...`, `lora_te2_...`, with
        `lora_down`/`lora_up` and an `.alpha` per layer), as diffusers' SDXL script writes them
        with `--output_kohya_format`. Each `.alpha` is the adapter's `lora_alpha` (diffusers'
        converter writes the rank there, which would change the scale)."""
        from lorafleet.worker.training.lora import convert_state_dict_to_kohya

        flat = {
            f"{prefix}.{key if prefix == 'unet' else clip_kohya_path(key)}": tensor
            for prefix, state in peft_states.items()
            for key, tensor in state.items()
        }
        out: dict[str, torch.Tensor] = {}
        for key, tensor in convert_state_dict_to_kohya(flat).items():
            if key.endswith(".alpha"):
                module = next(m for m, p in _KOHYA_PREFIXES.items() if key.startswith(p + "_"))
                out[key] = torch.tensor(alphas[module], dtype=torch.float32)
            else:
                out[key] = tensor
        return out

    def sampling_pipeline(self, components: Components) -> Any:
        """A StableDiffusionXLPipeline with the base model's own inference scheduler."""
        scheduler_class = getattr(
            diffusers, str(components.sampler_config.get("_class_name")), None
        )
        if not (isinstance(scheduler_class, type) and hasattr(scheduler_class, "from_config")):
            scheduler_class = diffusers.EulerDiscreteScheduler
        pipeline = diffusers.StableDiffusionXLPipeline(
            vae=components.vae,
            unet=components.denoiser,
            scheduler=scheduler_class.from_config(components.sampler_config),
            add_watermarker=False,
            **components.text_encoders,
            **components.tokenizers,
        )
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def sample_arguments(self, *, negative_prompt: str, guidance_scale: float) -> dict[str, Any]:
        return {"negative_prompt": negative_prompt or None, "guidance_scale": guidance_scale}
