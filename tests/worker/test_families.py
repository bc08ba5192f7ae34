"""Every model family through the same checks, on its tiny model (tests/support/models.py):
trains a few steps, its LoRA loads in its own pipeline in both output formats, resumes
bit-identically after three interruptions, trains the same bits warm as cold, never keeps a
non-finite loss; and one flow-matching step equals the published formulas computed here."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from lorafleet.core.model import FailureClass
from lorafleet.worker.training import (
    Finished,
    Stopped,
    Trainer,
    TrainingFailure,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.families import flow, flux2, sdxl
from lorafleet.worker.training.resident import ResidentModel
from tests.support.training import (
    SAMPLING_WARNING,
    TEST_DEVICE,
    Recorder,
    instance_images,
    lora_tensors,
    make_config,
    same_tensors,
    tiny_spec,
)

FAMILIES = ("sdxl", "flux", "flux2")
Train = Callable[..., tuple[TrainingOutcome, Recorder]]


@pytest.fixture
def models(tiny_model_dir: Path, tiny_flux_dir: Path, tiny_flux2_dir: Path) -> dict[str, Path]:
    return {"sdxl": tiny_model_dir, "flux": tiny_flux_dir, "flux2": tiny_flux2_dir}


def family_spec(family: str, model: Path, **overrides: Any) -> Any:
    return tiny_spec(**{"model_family": family, "base_model": str(model)} | overrides)


def run(
    model: Path,
    spec: Any,
    images: Sequence[TrainingImage] | None = None,
    *,
    resume: TrainingSnapshot | None = None,
    recorder: Recorder | None = None,
    resident: ResidentModel | None = None,
) -> tuple[TrainingOutcome, Recorder]:
    recorder = recorder or Recorder()
    outcome = Trainer(make_config(model, spec), resident).run(
        instance_images=instance_images() if images is None else images,
        resume=resume,
        hooks=recorder.hooks(),
    )
    return outcome, recorder


@pytest.mark.filterwarnings(SAMPLING_WARNING)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_and_both_files_load_in_its_pipeline(
    family: str, models: dict[str, Path]
) -> None:
    """The fast lane's guard against a change that breaks one family: a few steps, then the
    diffusers file and the kohya (ComfyUI) file load into the family's own pipeline with every
    key taken, and the two give the same adapted denoiser, which differs from the base one."""
    from lorafleet.worker.training.base_model import diffusers

    model = models[family]
    outcome, _ = run(model, family_spec(family, model, max_train_steps=2, output_format="both"))
    assert isinstance(outcome, Finished) and outcome.kohya_weights is not None
    pipeline_class = getattr(
        diffusers,
        {
            "sdxl": "StableDiffusionXLPipeline",
            "flux": "FluxPipeline",
            "flux2": "Flux2KleinPipeline",
        }[family],
    )
    files = [("diffusers", outcome.lora_weights), ("kohya", outcome.kohya_weights)]
    if family == "flux":
        # diffusers converts FLUX.1's kohya layouts only at the full size of FLUX.1-dev (19 and
        # 38 blocks hard-coded) and OneTrainer's only for attention: the tiny model's file is
        # checked by ComfyUI's rule instead (each `lora_transformer_<path>` names a Linear of the
        # transformer by its path with "_" for ".") and by the weights it adds.
        _check_comfyui_flux_keys(model, outcome.lora_weights, outcome.kohya_weights)
        files = files[:1]
    outputs = {}
    for name, data in files:
        pipe = pipeline_class.from_pretrained(model)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "lora.safetensors"
            path.write_bytes(data)
            pipe.load_lora_weights(str(path))
        denoiser = pipe.unet if family == "sdxl" else pipe.transformer
        adapted = [n for n, _ in denoiser.named_parameters() if "lora_" in n]
        trained = len(
            {
                k.split(".lora")[0]
                for k in safetensors.torch.load(outcome.lora_weights)
                if k.startswith(("unet.", "transformer."))
            }
        )
        assert len({n.split(".lora")[0] for n in adapted}) == trained, name
        outputs[name] = _denoiser_output(family, denoiser)
        denoiser.disable_lora()
        outputs[f"{name}-base"] = _denoiser_output(family, denoiser)
    if "kohya" in outputs:
        torch.testing.assert_close(outputs["diffusers"], outputs["kohya"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(outputs["diffusers"], outputs["diffusers-base"])


def _check_comfyui_flux_keys(model: Path, diffusers_file: bytes, kohya_file: bytes) -> None:
    import diffusers as _diffusers

    diffusers: Any = _diffusers
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(model, subfolder="transformer")
    linear = {
        name.replace(".", "_"): name
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    ours = safetensors.torch.load(diffusers_file)
    kohya = safetensors.torch.load(kohya_file)
    layers = {k.rsplit(".", 2)[0] if k.endswith("weight") else k.rsplit(".", 1)[0] for k in kohya}
    for layer in layers:
        path = linear[layer.removeprefix("lora_transformer_")]
        down, up = kohya[f"{layer}.lora_down.weight"], kohya[f"{layer}.lora_up.weight"]
        delta = up @ down * float(kohya[f"{layer}.alpha"]) / down.shape[0]
        a, b = ours[f"transformer.{path}.lora_A.weight"], ours[f"transformer.{path}.lora_B.weight"]
        torch.testing.assert_close(delta, b @ a * 1.0, rtol=0, atol=0)
    assert len(layers) == len([k for k in ours if k.endswith(".lora_A.weight")])


def _denoiser_output(family: str, denoiser: Any) -> Any:
    generator = torch.Generator().manual_seed(0)
    config = denoiser.config
    with torch.no_grad():
        if family == "sdxl":
            sample = torch.randn(1, 4, 8, 8, generator=generator)
            width = config.cross_attention_dim
            pooled = (
                config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            )
            out = denoiser(
                sample,
                torch.tensor([500]),
                torch.randn(1, 77, width, generator=generator),
                added_cond_kwargs={
                    "text_embeds": torch.randn(1, pooled, generator=generator),
                    "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]]),
                },
            ).sample
            return out
        tokens = 16
        hidden = torch.randn(1, tokens, config.in_channels, generator=generator)
        text = torch.randn(1, 8, config.joint_attention_dim, generator=generator)
        if family == "flux":
            return denoiser(
                hidden_states=hidden,
                timestep=torch.tensor([0.5]),
                guidance=torch.tensor([3.5]) if config.guidance_embeds else None,
                pooled_projections=torch.randn(
                    1, config.pooled_projection_dim, generator=generator
                ),
                encoder_hidden_states=text,
                txt_ids=torch.zeros(8, 3),
                img_ids=torch.zeros(tokens, 3),
            ).sample
        return denoiser(
            hidden_states=hidden,
            timestep=torch.tensor([0.5]),
            guidance=torch.tensor([4.0]) if config.guidance_embeds else None,
            encoder_hidden_states=text,
            txt_ids=torch.zeros(1, 8, 4),
            img_ids=torch.zeros(1, tokens, 4),
        ).sample


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "train_text_encoder"), [("flux", False), ("flux", True), ("flux2", False)]
)
def test_a_run_interrupted_three_times_trains_the_same_bits(
    family: str, train_text_encoder: bool, models: dict[str, Path]
) -> None:
    model = models[family]
    settings = {
        "max_train_steps": 6,
        "train_batch_size": 2,
        "weighting_scheme": "logit_normal",
        "train_text_encoder": train_text_encoder,
    }
    images = instance_images(3)
    full, _ = run(model, family_spec(family, model, **settings), images)
    resume: TrainingSnapshot | None = None
    for stop in (1, 3, 4, None):
        outcome, _ = run(
            model,
            family_spec(family, model, **settings),
            images,
            resume=resume,
            recorder=Recorder(stop_at=stop),
        )
        if stop is None:
            break
        assert isinstance(outcome, Stopped) and outcome.snapshot is not None
        resume = load_checkpoint(serialize_checkpoint(outcome.snapshot))
    assert isinstance(full, Finished) and isinstance(outcome, Finished)
    assert same_tensors(lora_tensors(full), lora_tensors(outcome))
    assert full.lora_weights == outcome.lora_weights
    assert full.loss == outcome.loss


@pytest.mark.slow
@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_a_warm_worker_trains_each_family_as_a_cold_one(models: dict[str, Path]) -> None:
    """One resident model across jobs of other families, owners, ranks and seeds: each result
    equals the same job's on a fresh worker."""
    jobs = [
        ("flux2", {"lora_rank": 8, "seed": 3}),
        ("flux", {"lora_rank": 4, "seed": 5, "train_text_encoder": True}),
        ("sdxl", {"lora_rank": 2, "seed": 9}),
        ("flux", {"lora_rank": 4, "seed": 5, "train_text_encoder": True}),
        ("flux2", {"lora_rank": 4, "seed": 1}),
    ]
    resident = ResidentModel()
    for family, overrides in jobs:
        spec = family_spec(family, models[family], max_train_steps=2, **overrides)
        warm, _ = run(models[family], spec, resident=resident)
        cold, _ = run(models[family], spec)
        assert same_tensors(lora_tensors(warm), lora_tensors(cold)), (family, overrides)


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_a_non_finite_loss_never_becomes_a_checkpoint(
    family: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = flow.flow_loss
    calls = 0

    def nan_from_the_third_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        value: torch.Tensor = real(*args, **kwargs)
        return value * float("nan") if calls >= 3 else value

    monkeypatch.setattr(flow, "flow_loss", nan_from_the_third_step)
    recorder = Recorder()
    model = models[family]
    with pytest.raises(TrainingFailure) as stopped:
        run(
            model,
            family_spec(family, model, max_train_steps=6, checkpointing_steps=2),
            recorder=recorder,
        )
    assert stopped.value.failure_class is FailureClass.NODE
    assert [s.step for s in recorder.snapshots] == [2]


def test_flux_encodes_each_prompt_with_t5_once_while_clip_trains(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5-XXL is never trained: with `train_text_encoder` its embeddings are computed once per
    run for every prompt, and each step runs only CLIP (whose adapters get gradients)."""
    from transformers import CLIPTextModel, T5EncoderModel

    calls = {"t5": 0, "clip": 0}
    for name, cls in (("t5", T5EncoderModel), ("clip", CLIPTextModel)):

        def counted(self: Any, *args: Any, _f: Any = cls.forward, _n: str = name, **kw: Any) -> Any:
            calls[_n] += 1
            return _f(self, *args, **kw)

        monkeypatch.setattr(cls, "forward", counted)
    model = models["flux"]
    outcome, _ = run(
        model,
        family_spec(
            "flux", model, max_train_steps=3, train_text_encoder=True, output_format="both"
        ),
    )
    assert isinstance(outcome, Finished) and outcome.kohya_weights is not None
    assert calls == {"t5": 1, "clip": 3}
    # ComfyUI names CLIP-L's layers as kohya does, under `text_model`.
    text = [k for k in safetensors.torch.load(outcome.kohya_weights) if k.startswith("lora_te1_")]
    assert text and all(k.startswith("lora_te1_text_model_encoder_layers_") for k in text)
    tensors = safetensors.torch.load(outcome.lora_weights)
    assert any(k.startswith("text_encoder.") for k in tensors)
    assert not any(k.startswith("text_encoder_2.") for k in tensors)


def test_a_model_of_another_family_fails_as_the_jobs_input_naming_base_model(
    models: dict[str, Path],
) -> None:
    for family, model, named in (
        ("flux", models["flux"], "sdxl"),
        ("flux2", models["flux2"], "flux"),
        ("sdxl", models["sdxl"], "flux2"),
    ):
        with pytest.raises(TrainingFailure) as refused:
            run(model, family_spec(named, model, max_train_steps=1))
        assert refused.value.failure_class is FailureClass.INPUT
        message = str(refused.value)
        assert message.startswith("base_model:") and f"is a model of family {family}" in message
        assert f"model_family {family}" in message


def test_a_vae_or_guidance_the_model_cannot_use_fails_as_the_jobs_input(
    models: dict[str, Path],
) -> None:
    """Named before any step: another family's VAE (`vae_model`). (A guidance scale for klein,
    whose transformer has no guidance embedding, is refused at submit now:
    tests/core/test_spec_values.py.)"""
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("flux", {"vae_model": str(models["flux2"] / "vae")}, "vae_model:"),
        ("flux", {"vae_model": str(models["sdxl"] / "vae")}, "vae_model:"),
        ("sdxl", {"vae_model": str(models["flux2"] / "vae")}, "vae_model:"),
    ]
    for family, overrides, named in cases:
        model = models[family]
        with pytest.raises(TrainingFailure) as refused:
            run(model, family_spec(family, model, max_train_steps=1, **overrides))
        assert refused.value.failure_class is FailureClass.INPUT, (family, overrides)
        assert str(refused.value).startswith(named), str(refused.value)


@pytest.mark.parametrize(
    ("family", "overrides", "named"),
    [
        ("flux", {"model_family": "flux2"}, "base_model:"),
        # auto takes a local folder for sdxl, and snr_gamma is an sdxl field.
        ("flux", {"model_family": "auto", "snr_gamma": 5.0}, "base_model:"),
    ],
)
def test_a_warm_worker_refuses_what_a_cold_one_refuses(
    family: str, overrides: dict[str, Any], named: str, models: dict[str, Path]
) -> None:
    """The resident model is keyed by base model, VAE and precision only: a job of the same key
    but another family, or settings its modules cannot use, is refused on a worker that holds
    the model with the cold worker's message, and leaves the resident model as it was."""
    model = models[family]
    resident = ResidentModel()
    first, _ = run(model, family_spec(family, model, max_train_steps=1), resident=resident)
    assert isinstance(first, Finished)
    key = resident.key
    spec = family_spec(family, model, max_train_steps=1, **overrides)
    assert spec.resident_key == key  # the refused job would run warm
    answers = []
    for worker in (resident, None):  # warm, then cold
        with pytest.raises(TrainingFailure) as refused:
            run(model, spec, resident=worker)
        assert refused.value.failure_class is FailureClass.INPUT
        answers.append(str(refused.value))
    warm, cold = answers
    assert warm == cold and warm.startswith(named), answers
    assert resident.key == key and resident.loads == 1
    again, _ = run(model, family_spec(family, model, max_train_steps=1), resident=resident)
    assert isinstance(again, Finished) and resident.loads == 1


def test_flux2_prompts_are_encoded_as_its_pipeline_encodes_them(
    models: dict[str, Path],
) -> None:
    """The hidden layers and the template come from Flux2KleinPipeline (9, 18, 27 today;
    diffusers' klein script's default 10, 20, 30 is FLUX.2 [dev]'s)."""
    from lorafleet.worker.training.base_model import detect_family, diffusers, load_components
    from lorafleet.worker.training.config import resolve_runtime

    assert flux2.pipeline_default("text_encoder_out_layers") == (9, 18, 27)
    model = models["flux2"]
    config = make_config(model, family_spec("flux2", model))
    components = load_components(config, resolve_runtime(config), detect_family(config))
    family = components.family
    prompts = ["a photo of sks dog", "a dog in the snow"]
    (ours,) = family.encode(components, family.tokenize(components, prompts, config.spec))
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(model)
    theirs, _ = pipe.encode_prompt(prompts)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert isinstance(components.family, flux2.Flux2)
    assert sdxl.Sdxl.trainable_encoders == ("text_encoder", "text_encoder_2")


# One flow-matching step, computed here from the published formulas --------------------------


def _pack(x: torch.Tensor) -> torch.Tensor:
    """FLUX.1's 2x2 packing: (B, C, H, W) -> (B, H/2 * W/2, 4C), patch-major."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * 4)


def _unpack(x: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
    b = x.shape[0]
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


@pytest.mark.filterwarnings(SAMPLING_WARNING)
@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_one_step_is_the_published_flow_matching_step(family: str, models: dict[str, Path]) -> None:
    """Rectified flow (Esser et al. 2024): x_t = (1 - s) x_0 + s e, target e - x_0, loss the
    mean squared error; FLUX.1's x_0 = (z - shift) * scale from a posterior draw, FLUX.2's the
    batch-norm-normalised 2x2 patches of the posterior mean. Computed with the pipeline's own
    prompt encoding and the same draws (the run's generator: seed + 1, the posterior draw
    first, then the noise, then u), compared with the run's first loss, and the sign of its
    first AdamW update (lr * sign(g) on the first step) with the gradient computed here."""
    from lorafleet.worker.training.base_model import diffusers

    model = models[family]
    lr = 1e-3
    spec = family_spec(
        family, model, max_train_steps=1, learning_rate=lr, adam_weight_decay=0.0, seed=11
    )
    images = instance_images(1)
    outcome, recorder = run(model, spec, images)
    assert isinstance(outcome, Finished)
    trained = safetensors.torch.load(outcome.lora_weights)

    pipeline_class = diffusers.FluxPipeline if family == "flux" else diffusers.Flux2KleinPipeline
    pipe = pipeline_class.from_pretrained(model)
    transformer, vae, scheduler = pipe.transformer, pipe.vae, pipe.scheduler
    import io

    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(images[0].data)).convert("RGB"), dtype=np.float32)
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None] / 127.5 - 1.0
    generator = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
        if family == "flux":
            eps = torch.randn(posterior.mean.shape, generator=generator)
            z = posterior.mean + posterior.std * eps
            x0 = (z - vae.config.shift_factor) * vae.config.scaling_factor
        else:
            m = posterior.mean
            b, c, h, w = m.shape
            patches = m.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
            patches = patches.reshape(b, c * 4, h // 2, w // 2)
            mean = vae.bn.running_mean.view(1, -1, 1, 1)
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
            x0 = (patches - mean) / std
    e = torch.randn(x0.shape, generator=generator)
    u = torch.rand((1,), generator=generator)
    index = int(u.item() * scheduler.config.num_train_timesteps)
    sigma = float(scheduler.sigmas[index])
    timestep = scheduler.timesteps[index : index + 1]
    xt = (1 - sigma) * x0 + sigma * e

    # The run's LoRA before its one update: A as trained minus nothing (B was zero, so A's
    # gradient was zero and AdamW left it); B zero. So the step ran the base transformer.
    b, c, h, w = x0.shape
    with torch.no_grad():
        if family == "flux":
            embeds, pooled, text_ids = pipe.encode_prompt(spec.instance_prompt, prompt_2=None)
    hidden = None
    if family == "flux":
        packed = _pack(xt)
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] = torch.arange(h // 2)[:, None]
        ids[..., 2] = torch.arange(w // 2)[None, :]
        hidden = packed.requires_grad_(False)
        kwargs = {
            "pooled_projections": pooled,
            "guidance": torch.tensor([3.5]) if transformer.config.guidance_embeds else None,
            "txt_ids": text_ids,
            "img_ids": ids.reshape(-1, 3),
        }
    else:
        with torch.no_grad():
            embeds, text_ids = pipe.encode_prompt(spec.instance_prompt)
        hidden = xt.reshape(b, c, h * w).permute(0, 2, 1)
        ids = torch.cartesian_prod(
            torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)
        )[None]
        kwargs = {"guidance": None, "txt_ids": text_ids, "img_ids": ids}
    # The gradient of the loss with respect to each LoRA B is that of the output of the layer's
    # base Linear, taken through x -> B(A x) * alpha / r: computed with hooks on the base layers.
    captured: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []
    lora_a = {
        k.removeprefix("transformer.").removesuffix(".lora_A.weight"): v
        for k, v in trained.items()
        if k.endswith(".lora_A.weight")
    }
    modules = dict(transformer.named_modules())
    for name in lora_a:

        def keep(module: Any, args: Any, out: torch.Tensor, name: str = name) -> None:
            captured[name] = args[0].detach()
            out.register_hook(  # type: ignore[no-untyped-call]
                lambda g, name=name: grads.__setitem__(name, g.detach())
            )

        handles.append(modules[name].register_forward_hook(keep))
    prediction = transformer(
        hidden_states=hidden,
        timestep=timestep / 1000,
        encoder_hidden_states=embeds,
        return_dict=False,
        **kwargs,
    )[0]
    if family == "flux":
        prediction = _unpack(prediction, c, h, w)
    else:
        prediction = prediction[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)
    loss = ((prediction.float() - (e - x0)) ** 2).mean()
    loss.backward()
    for handle in handles:
        handle.remove()
    assert math.isclose(recorder.progress[0][1], float(loss.detach()), rel_tol=1e-4), family

    # dL/dB = alpha/r * sum over tokens of g (A x)^T; its sign is AdamW's first update's.
    scale = spec.lora_alpha / spec.lora_rank
    checked = 0
    for name, a in lora_a.items():
        if name not in grads:
            continue
        g = grads[name].reshape(-1, grads[name].shape[-1])
        ax = captured[name].reshape(-1, captured[name].shape[-1]) @ a.T
        grad_b = scale * g.T @ ax
        update = trained[f"transformer.{name}.lora_B.weight"]
        big = grad_b.abs() > 1e-6 * grad_b.abs().max()
        assert torch.equal(torch.sign(update[big]), -torch.sign(grad_b[big])), name
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("quantization", ["nf4", "fp8"])
def test_a_quantized_base_on_a_cpu_worker_is_refused_naming_the_field(
    quantization: str, models: dict[str, Path]
) -> None:
    if TEST_DEVICE != "cpu":
        return  # on a GPU run test_cuda.py trains it
    model = models["flux"]
    with pytest.raises(TrainingFailure) as refused:
        run(model, family_spec("flux", model, base_quantization=quantization))
    assert refused.value.failure_class is FailureClass.INPUT
    assert str(refused.value).startswith(f"base_quantization: {quantization} needs a CUDA GPU")
