"""The resident base model: runs on a worker that trained other jobs before train the same bits
as on a fresh one, leave the base weights as loaded, and another base model or precision
replaces the resident set."""

from __future__ import annotations

import gc
import hashlib
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training import Finished, StopReason, Trainer, TrainingHooks
from lorafleet.worker.training.base_model import detect_family, load_components
from lorafleet.worker.training.config import resolve_runtime
from lorafleet.worker.training.families import Components
from lorafleet.worker.training.lora import add_lora, park_lora, parked_shapes
from lorafleet.worker.training.resident import ResidentModel
from tests.support.training import Recorder, instance_images, make_config, tiny_spec

pytestmark = pytest.mark.slow


def base_digest(components: Components) -> str:
    """Every frozen tensor of the model, names (as loaded: without peft's wrapping) and bytes."""
    digest = hashlib.sha256()
    for name, module in {**components.modules, "vae": components.vae}.items():
        for key, tensor in sorted(module.state_dict().items()):
            if "lora_" in key:
                continue
            digest.update(f"{name}.{key.replace('.base_layer', '')}".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def outputs(components: Components) -> list[torch.Tensor]:
    """What the UNet and the text encoders compute on fixed inputs."""
    inputs = torch.Generator().manual_seed(0)
    unet = components.denoiser
    config = unet.config
    size = config.sample_size
    latents = torch.randn(1, config.in_channels, size, size, generator=inputs)
    embeds = torch.randn(1, 77, config.cross_attention_dim, generator=inputs)
    pooled_dim = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    pooled = torch.randn(1, pooled_dim, generator=inputs)
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])
    with torch.no_grad():
        out = [
            unet(
                latents,
                torch.tensor([500]),
                embeds,
                added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids},
            ).sample
        ]
        tokens = torch.arange(1, 9).unsqueeze(0)
        for encoder in components.text_encoders.values():
            out.append(encoder(tokens, output_hidden_states=True).hidden_states[-2])
    return out


def lora_of(
    tiny_model_dir: Path,
    spec: JobSpec,
    resident: ResidentModel | None,
    hooks: TrainingHooks | None = None,
) -> bytes | None:
    outcome = Trainer(make_config(tiny_model_dir, spec), resident).run(
        instance_images=instance_images(), hooks=hooks or Recorder().hooks()
    )
    return outcome.lora_weights if isinstance(outcome, Finished) else None


def adapter_layers(components: Components) -> list[object]:
    return [
        m
        for module in (components.denoiser, *components.text_encoders.values())
        for m in module.modules()
        if isinstance(m, BaseTunerLayer)
    ]


def cancelled_mid_step() -> TrainingHooks:
    """Cancels between the two micro-batches of the second step: the first one's gradients
    are left on the adapters (polls once training is set up: entering the last setup phase,
    before each step and between its micro-batches)."""
    polls = 0
    prepared = False

    def on_phase(name: str) -> None:
        nonlocal prepared
        prepared = prepared or name == "optimizer"

    def should_stop() -> StopReason | None:
        nonlocal polls
        polls += prepared
        return "cancel" if polls == 5 else None

    return TrainingHooks(should_stop=should_stop, on_phase=on_phase)


def test_a_warm_run_trains_the_same_bits_and_leaves_the_base_model_as_loaded(
    tiny_model_dir: Path,
) -> None:
    job = tiny_spec(max_train_steps=3, seed=11, lora_dropout=0.1)
    # Another shape: trained, checkpointed text encoders with DoRA at another rank.
    encoders = dict(
        lora_rank=8, train_text_encoder=True, gradient_checkpointing=True, use_dora=True
    )
    encoders_job = tiny_spec(max_train_steps=2, seed=13, **encoders)
    cold = lora_of(tiny_model_dir, job, None)
    cold_encoders = lora_of(tiny_model_dir, encoders_job, None)

    resident = ResidentModel()
    config = make_config(tiny_model_dir, job)
    loaded = resident.components_for(config, resolve_runtime(config))
    before = base_digest(loaded)
    computed = outputs(loaded)
    # Other owners' jobs first: of the job's shape (another seed, cancelled with its
    # gradients half accumulated), then the job; then the other shape twice (seeds differ),
    # then the job (its adapters were kept aside), DoRA, and the job again (injected afresh:
    # what was kept aside was the other shape's).
    same_shape = tiny_spec(
        max_train_steps=3, seed=12, lora_dropout=0.1, gradient_accumulation_steps=2
    )
    assert lora_of(tiny_model_dir, same_shape, resident, cancelled_mid_step()) is None
    parked = adapter_layers(loaded)
    assert parked  # the cancelled run's adapters stay on, parked
    assert lora_of(tiny_model_dir, job, resident) == cold
    assert adapter_layers(loaded) == parked  # the same modules: re-initialised in place
    lora_of(tiny_model_dir, tiny_spec(max_train_steps=2, seed=3, **encoders), resident)
    assert lora_of(tiny_model_dir, encoders_job, resident) == cold_encoders
    assert not set(adapter_layers(loaded)) & set(parked)
    assert lora_of(tiny_model_dir, job, resident) == cold
    assert adapter_layers(loaded) == parked
    lora_of(tiny_model_dir, tiny_spec(max_train_steps=2, seed=5, use_dora=True), resident)
    assert lora_of(tiny_model_dir, job, resident) == cold
    assert resident.loads == 1  # nothing was loaded again

    # The modules are the ones loaded and compute what they computed as loaded: the adapters
    # left on are zero, disabled and frozen; nothing trainable, no gradient, no
    # checkpointing, eval mode, the same base bytes.
    assert base_digest(loaded) == before
    assert all(torch.equal(a, b) for a, b in zip(outputs(loaded), computed, strict=True))
    for module in (loaded.denoiser, *loaded.text_encoders.values()):
        for layer in module.modules():
            if isinstance(layer, BaseTunerLayer):
                assert layer.disable_adapters
        for name, param in module.named_parameters():
            assert not param.requires_grad and param.grad is None
            if "lora_" in name:
                assert not param.any(), name
        assert not module.training
    assert not loaded.denoiser.is_gradient_checkpointing
    assert not any(e.is_activation_checkpointing for e in loaded.text_encoders.values())


def test_another_base_model_or_precision_replaces_the_resident_set(tiny_model_dir: Path) -> None:
    resident = ResidentModel()
    fp32 = tiny_spec(max_train_steps=1)
    lora_of(tiny_model_dir, fp32, resident)
    assert resident.key == fp32.resident_key
    config = make_config(tiny_model_dir, fp32)
    first = weakref.ref(resident.components_for(config, resolve_runtime(config)).denoiser)

    bf16 = tiny_spec(max_train_steps=1, mixed_precision="bf16")
    lora_of(tiny_model_dir, bf16, resident)
    assert resident.key == bf16.resident_key != fp32.resident_key
    assert resident.loads == 2
    gc.collect()
    assert first() is None  # the old set was dropped, not kept beside the new one


def adapter_tensors(trained: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.{name}": param.detach().clone()
        for prefix, module in trained.items()
        for name, param in module.named_parameters()
        if param.requires_grad
    }


@pytest.mark.parametrize(
    "shape",
    [
        dict(rank=4, alpha=4.0, train_text_encoder=False),
        dict(rank=8, alpha=16.0, train_text_encoder=True, use_dora=True, dropout=0.1),
    ],
    ids=["unet", "encoders-dora"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("between", [False, True], ids=["next", "kept-aside"])
def test_parked_adapters_get_what_a_fresh_injection_draws(
    tiny_model_dir: Path, shape: dict[str, Any], dtype: torch.dtype, between: bool
) -> None:
    """Re-initialised in place, a run's adapters hold the bits a fresh injection at its seed
    gives them and leave torch's generator where it leaves it, whatever they held before
    (bf16: frozen weights in half precision, as on a GPU); also when a run of another shape
    came between (its adapters replaced them, which were kept aside)."""
    config = make_config(tiny_model_dir, tiny_spec())
    runtime = resolve_runtime(config)

    def loaded() -> Components:
        components = load_components(config, runtime, detect_family(config))
        for module in (components.denoiser, *components.text_encoders.values()):
            module.to(dtype)
        return components

    def inject(components: Components, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            trained = add_lora(components, **shape)
            return adapter_tensors(trained), torch.get_rng_state()

    fresh, fresh_rng = inject(loaded(), seed=11)

    warm = loaded()
    inject(warm, seed=3)
    # The earlier run trained: other weights, gradients left.
    for module in (warm.denoiser, *warm.text_encoders.values()):
        for param in module.parameters():
            if param.requires_grad:
                param.grad = torch.ones_like(param)
                with torch.no_grad():
                    param.add_(1.0)
    park_lora(warm)
    layers = adapter_layers(warm)
    if between:
        with torch.random.fork_rng(devices=[]):
            add_lora(warm, rank=2, alpha=2.0, train_text_encoder=not shape["train_text_encoder"])
        assert not set(adapter_layers(warm)) & set(layers)
        park_lora(warm)
    reused, reused_rng = inject(warm, seed=11)

    assert adapter_layers(warm) == layers  # re-initialised in place, not injected again
    assert reused.keys() == fresh.keys()
    assert all(torch.equal(reused[k], fresh[k]) for k in fresh)
    assert all(t.dtype == torch.float32 for t in reused.values())
    assert torch.equal(reused_rng, fresh_rng)
    for module in (warm.denoiser, *warm.text_encoders.values()):
        assert all(p.grad is None for p in module.parameters())


def test_parked_shapes_name_what_the_next_run_takes_warm(tiny_model_dir: Path) -> None:
    """What a worker announces (WarmState.adapter_shapes) is what `add_lora` would re-initialise
    or put back: the UNet's parked shapes, attached or kept aside, each with text-encoder
    training too where both encoders hold that shape."""
    config = make_config(tiny_model_dir, tiny_spec())
    components = load_components(config, resolve_runtime(config), detect_family(config))
    assert parked_shapes(components) == []
    with torch.random.fork_rng(devices=[]):
        add_lora(components, rank=4, alpha=4.0, train_text_encoder=True)
    park_lora(components)
    assert parked_shapes(components) == [(4, 4.0, False, False, 0.0), (4, 4.0, True, False, 0.0)]
    with torch.random.fork_rng(devices=[]):
        add_lora(components, rank=2, alpha=2.0, train_text_encoder=False, dropout=0.1)
    park_lora(components)
    assert parked_shapes(components) == [
        (2, 2.0, False, False, 0.1),
        (4, 4.0, False, False, 0.0),
        (4, 4.0, True, False, 0.0),
    ]
