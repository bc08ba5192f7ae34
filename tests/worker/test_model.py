"""Loading through from_pretrained, LoRA placement, SDPA, and work done once instead of per step."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch
import transformers

from lorafleet.core.model import FailureClass
from lorafleet.worker.training.base_model import check_model_ref, detect_family, load_components
from lorafleet.worker.training.config import resolve_runtime
from lorafleet.worker.training.failures import TrainingFailure
from lorafleet.worker.training.lora import add_lora, lora_parameters
from tests.support.training import TrainFn, instance_images, make_config, tiny_spec


def test_components_load_frozen_with_sdpa(tiny_model_dir: Path) -> None:
    config = make_config(tiny_model_dir, tiny_spec(train_text_encoder=True))
    components = load_components(config, resolve_runtime(config), detect_family(config))
    assert type(components.noise_scheduler).__name__ == "DDPMScheduler"
    # The base model's own inference scheduler is kept for sampling.
    assert components.sampler_config["_class_name"] == "EulerDiscreteScheduler"
    modules = [components.denoiser, components.vae, *components.text_encoders.values()]
    assert not any(p.requires_grad for m in modules for p in m.parameters())
    assert {type(p).__name__ for p in components.denoiser.attn_processors.values()} == {
        "AttnProcessor2_0"
    }
    for encoder in components.text_encoders.values():
        assert encoder.config._attn_implementation == "sdpa"

    family = components.family
    ids = family.tokenize(components, ["a photo of sks dog", "a dog"], config.spec)
    embeds, pooled = family.encode(components, ids)
    assert tuple(embeds.shape) == (2, 77, components.denoiser.config.cross_attention_dim)
    assert tuple(pooled.shape) == (
        2,
        components.text_encoders["text_encoder_2"].config.projection_dim,
    )

    trained = add_lora(components, rank=4, alpha=4.0, train_text_encoder=True)
    assert list(trained) == ["unet", "text_encoder", "text_encoder_2"]
    unet_names = [name for name, _ in lora_parameters(components.denoiser)]
    assert unet_names
    assert all(".lora_A." in n or ".lora_B." in n for n in unet_names)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in unet_names}
    assert targets == {"to_q", "to_k", "to_v", "0"}  # to_out.0
    te_targets = {
        n.split(".lora_")[0].rsplit(".", 1)[-1]
        for n, _ in lora_parameters(components.text_encoders["text_encoder"])
    }
    assert te_targets == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert all(p.dtype == torch.float32 for m in trained.values() for _, p in lora_parameters(m))


class _Calls:
    def __init__(self) -> None:
        self.vae_encode = 0
        self.text_forward = 0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    counts = _Calls()
    encode = diffusers.AutoencoderKL.encode
    forward = transformers.CLIPTextModelWithProjection.forward

    def counting_encode(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts.vae_encode += 1
        return encode(self, *args, **kwargs)

    def counting_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts.text_forward += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.AutoencoderKL, "encode", counting_encode)
    monkeypatch.setattr(transformers.CLIPTextModelWithProjection, "forward", counting_forward)
    return counts


def test_latents_and_embeddings_computed_once_when_nothing_varies(
    train: TrainFn, calls: _Calls
) -> None:
    train(tiny_spec(max_train_steps=5), instance_images(3))
    assert calls.vae_encode == 1  # one chunk of 3 images, up front
    assert calls.text_forward == 1  # one distinct prompt, up front


def test_random_flip_encodes_per_step(train: TrainFn, calls: _Calls) -> None:
    train(tiny_spec(max_train_steps=5, random_flip=True), instance_images(3))
    assert calls.vae_encode == 5
    assert calls.text_forward == 1  # embeddings are still cached


def test_text_encoder_training_encodes_per_step(train: TrainFn, calls: _Calls) -> None:
    train(tiny_spec(max_train_steps=5, train_text_encoder=True), instance_images(3))
    assert calls.text_forward == 5
    assert calls.vae_encode == 1


@pytest.mark.parametrize("component", ["unet", "text_encoder", "vae"])
def test_a_pickled_model_is_refused_as_an_input_fault(
    tiny_model_dir: Path, tmp_path: Path, component: str
) -> None:
    """Loading a pickle can run code: a base model with only .bin weights is the job's fault,
    named, and never loaded."""
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, pickled)
    folder = pickled / component
    loader: Any = {
        "unet": diffusers.UNet2DConditionModel,
        "text_encoder": transformers.CLIPTextModel,
        "vae": diffusers.AutoencoderKL,
    }[component]
    model = loader.from_pretrained(tiny_model_dir, subfolder=component)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    # The same weights as a pickle, under the name each library would look for.
    name = "pytorch_model.bin" if component == "text_encoder" else "diffusion_pytorch_model.bin"
    torch.save(model.state_dict(), folder / name)
    config = make_config(pickled, tiny_spec())
    with pytest.raises(TrainingFailure) as refused:
        load_components(config, resolve_runtime(config), detect_family(config))
    assert refused.value.failure_class is FailureClass.INPUT
    assert "base_model" in str(refused.value) and "safetensors" in str(refused.value)
    assert component in str(refused.value)


@pytest.mark.parametrize(
    ("field", "ref"),
    [
        ("base_model", "/nonexistent/models/sdxl"),
        ("base_model", "./models/sdxl"),
        ("base_model", "not a repo id"),
        ("vae_model", "/nonexistent/vae"),
    ],
)
def test_a_missing_model_path_is_an_input_fault_naming_it(
    tiny_model_dir: Path, field: str, ref: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a hub repo-id message after three attempts, but the job's fault at once."""

    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub must not be asked about a local path")

    monkeypatch.setattr(transformers.CLIPTokenizer, "from_pretrained", no_hub)
    config = make_config(tiny_model_dir, tiny_spec(**{field: ref}))
    if field == "base_model":
        config = dataclasses.replace(config, model_path=None)
    with pytest.raises(TrainingFailure) as refused:
        load_components(config, resolve_runtime(config), detect_family(config))
    assert refused.value.failure_class is FailureClass.INPUT
    assert field in str(refused.value) and ref in str(refused.value)


def test_a_path_that_is_not_a_model_answers_the_same_whatever_is_there(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A tenant cannot probe a worker's disk: a missing path, a file and a folder that is not a
    model all answer one message (only the path the tenant sent differs)."""

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    answers = set()
    for ref in (str(weights), str(tmp_path), "/etc", str(tmp_path / "missing")):
        with pytest.raises(TrainingFailure) as refused:
            check_model_ref("base_model", ref)
        assert refused.value.failure_class is FailureClass.INPUT
        answers.add(str(refused.value).replace(repr(ref), "REF"))
    assert len(answers) == 1, answers
    check_model_ref("base_model", "stabilityai/stable-diffusion-xl-base-1.0")  # a hub id: fine
    check_model_ref("base_model", str(tiny_model_dir))  # a model folder: fine


def test_a_pipeline_folder_named_as_a_vae_is_told_to_name_its_vae_subfolder(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A whole pipeline is a model, just not a lone VAE: the answer names its vae/ subfolder,
    which then loads. A folder with neither stays 'not a model'."""
    config = make_config(tiny_model_dir, tiny_spec(vae_model=str(tiny_model_dir)))
    runtime = resolve_runtime(config)
    with pytest.raises(TrainingFailure) as refused:
        load_components(config, runtime, detect_family(config))
    assert refused.value.failure_class is FailureClass.INPUT
    assert str(refused.value) == (
        f"vae_model: {str(tiny_model_dir)!r} is a pipeline folder, not a lone vae; name its"
        f" vae/ subfolder ({str(tiny_model_dir / 'vae')!r})"
    )
    config = make_config(tiny_model_dir, tiny_spec(vae_model=str(tiny_model_dir / "vae")))
    assert load_components(config, runtime, detect_family(config)).vae is not None
    (tmp_path / "model_index.json").write_text("{}")  # a pipeline without a VAE
    with pytest.raises(TrainingFailure, match="is not a model on this worker"):
        check_model_ref("vae_model", str(tmp_path), component="vae")


@pytest.mark.parametrize("shard", ["diffusion_pytorch_model.bin", "../elsewhere.safetensors"])
def test_a_shard_index_naming_a_pickle_is_refused_before_loading(
    tmp_path: Path, tiny_model_dir: Path, shard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """use_safetensors does not stop a loader from opening the shards an index names."""
    crafted = tmp_path / "crafted"
    shutil.copytree(tiny_model_dir, crafted)
    (crafted / "unet" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"conv_in.weight": shard}})
    )

    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load must not be reached")

    monkeypatch.setattr(torch, "load", no_unpickling)
    config = make_config(crafted, tiny_spec(base_model=str(crafted)), model_path=None)
    with pytest.raises(TrainingFailure) as refused:
        load_components(config, resolve_runtime(config), detect_family(config))
    assert refused.value.failure_class is FailureClass.INPUT
    assert "safetensors only" in str(refused.value)
    assert shard in str(refused.value)


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")
def test_a_hub_model_this_machine_cannot_download_is_the_nodes_fault(tmp_path: Path) -> None:
    """No connection to the hub and nothing cached: the node's fault, said in a sentence (the
    job goes on elsewhere), never a bare internal error and never the job's."""
    from lorafleet.worker.training.base_model import detect_family
    from lorafleet.worker.training.config import TrainingConfig

    spec = tiny_spec(base_model="someone/not-cached-here")
    config = TrainingConfig(spec=spec, cache_dir=str(tmp_path), local_files_only=True)
    with pytest.raises(TrainingFailure) as failed:
        detect_family(config)
    assert failed.value.failure_class is FailureClass.NODE
    assert "could not download 'someone/not-cached-here' on this machine" in str(failed.value)
