"""The resident base model: runs on a worker that trained other jobs before train the same bits
as on a fresh one, leave the base weights as loaded, and another base model or precision
replaces the resident set."""

from __future__ import annotations

import gc
import hashlib
import weakref
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training import Finished, Trainer
from lorafleet.worker.training.base_model import Components
from lorafleet.worker.training.config import resolve_runtime
from lorafleet.worker.training.resident import ResidentModel
from tests.support.training import Recorder, instance_images, make_config, tiny_spec

pytestmark = pytest.mark.slow


def base_digest(components: Components) -> str:
    """Every frozen tensor of the model, names and bytes."""
    digest = hashlib.sha256()
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        module = getattr(components, name)
        for key, tensor in sorted(module.state_dict().items()):
            digest.update(f"{name}.{key}".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def lora_of(tiny_model_dir: Path, spec: JobSpec, resident: ResidentModel | None) -> bytes:
    outcome = Trainer(make_config(tiny_model_dir, spec), resident).run(
        instance_images=instance_images(), hooks=Recorder().hooks()
    )
    assert isinstance(outcome, Finished)
    return outcome.lora_weights


def test_a_warm_run_trains_the_same_bits_and_leaves_the_base_model_as_loaded(
    tiny_model_dir: Path,
) -> None:
    job = tiny_spec(max_train_steps=3, seed=11, lora_dropout=0.1)
    cold = lora_of(tiny_model_dir, job, None)

    resident = ResidentModel()
    config = make_config(tiny_model_dir, job)
    loaded = resident.components_for(config, resolve_runtime(config))
    before = base_digest(loaded)
    # Other jobs first: another rank and seed with trained, checkpointed text encoders, and
    # DoRA; then the job itself twice.
    other = tiny_spec(
        max_train_steps=2,
        seed=3,
        lora_rank=8,
        train_text_encoder=True,
        gradient_checkpointing=True,
    )
    lora_of(tiny_model_dir, other, resident)
    lora_of(tiny_model_dir, tiny_spec(max_train_steps=2, seed=5, use_dora=True), resident)
    warm = lora_of(tiny_model_dir, job, resident)
    assert resident.loads == 1  # nothing was loaded again
    assert warm == cold

    # The modules are the ones loaded, as loaded: no adapter, nothing trainable, no
    # checkpointing, eval mode, the same bytes.
    assert base_digest(loaded) == before
    for module in (loaded.unet, *loaded.text_encoders):
        assert not any(isinstance(m, BaseTunerLayer) for m in module.modules())
        assert not any(p.requires_grad for p in module.parameters())
        assert not hasattr(module, "peft_config")
        assert not module.training
    assert not loaded.unet.is_gradient_checkpointing
    assert not any(e.is_activation_checkpointing for e in loaded.text_encoders)


def test_another_base_model_or_precision_replaces_the_resident_set(tiny_model_dir: Path) -> None:
    resident = ResidentModel()
    fp32 = tiny_spec(max_train_steps=1)
    lora_of(tiny_model_dir, fp32, resident)
    assert resident.key == fp32.resident_key
    config = make_config(tiny_model_dir, fp32)
    first = weakref.ref(resident.components_for(config, resolve_runtime(config)).unet)

    bf16 = tiny_spec(max_train_steps=1, mixed_precision="bf16")
    lora_of(tiny_model_dir, bf16, resident)
    assert resident.key == bf16.resident_key != fp32.resident_key
    assert resident.loads == 2
    gc.collect()
    assert first() is None  # the old set was dropped, not kept beside the new one
