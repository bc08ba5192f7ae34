"""The tiny models: saved in the diffusers layout and loadable by their family's pipeline
(SDXL, FLUX.1, FLUX.2 [klein]); the full-size presets' shapes are the published ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import safetensors.torch
import torch

from lorafleet.worker.tiny_model import PRESETS, bpe_vocab_and_merges
from tests.support.training import SAMPLING_WARNING


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path) -> Any:
    loader: Any = diffusers.StableDiffusionXLPipeline  # untyped in diffusers
    pipe = loader.from_pretrained(tiny_model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_directory_layout(tiny_model_dir: Path) -> None:
    index = json.loads((tiny_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    for sub in ("tokenizer", "tokenizer_2"):
        assert (tiny_model_dir / sub / "vocab.json").is_file()
        assert (tiny_model_dir / sub / "merges.txt").is_file()
    for sub in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert list((tiny_model_dir / sub).glob("*.safetensors"))
    assert (tiny_model_dir / "scheduler" / "scheduler_config.json").is_file()


def test_sdxl_architecture_is_consistent(pipeline: Any) -> None:
    unet = pipeline.unet.config
    hidden = pipeline.text_encoder.config.hidden_size + pipeline.text_encoder_2.config.hidden_size
    assert unet.addition_embed_type == "text_time"
    assert unet.cross_attention_dim == hidden
    assert unet.projection_class_embeddings_input_dim == (
        6 * unet.addition_time_embed_dim + pipeline.text_encoder_2.config.projection_dim
    )
    shape = PRESETS["tiny"]
    assert tuple(unet.block_out_channels) == shape.unet_block_out_channels
    assert sum(p.numel() for p in pipeline.unet.parameters()) < 2_000_000


def test_tokenizer_is_a_working_clip_bpe(pipeline: Any) -> None:
    tokenizer = pipeline.tokenizer
    ids = tokenizer("a photo of sks dog").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.eos_token_id
    # Corpus words were merged into single tokens.
    assert len(ids) == 2 + 5
    assert tokenizer.model_max_length == 77
    assert pipeline.text_encoder.config.eos_token_id == tokenizer.eos_token_id


def test_vocabulary_is_deterministic() -> None:
    assert bpe_vocab_and_merges() == bpe_vocab_and_merges()


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_pipeline_generates_an_image(pipeline: Any) -> None:
    image = pipeline(
        "a photo of sks dog",
        num_inference_steps=2,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (64, 64)
    assert np.asarray(image).std() > 0


def test_build_is_deterministic_per_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    from lorafleet.worker.tiny_model import build_tiny_model

    rebuilt = build_tiny_model(tmp_path / "again")
    for sub in ("unet", "text_encoder"):
        [a] = (tiny_model_dir / sub).glob("*.safetensors")
        [b] = (rebuilt / sub).glob("*.safetensors")
        left, right = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left)


# --- The builder's entry point ----------------------------------------------------------------

_MODULE = (sys.executable, "-m", "lorafleet.worker.tiny_model")


def test_unknown_family_or_preset_is_refused(tmp_path: Path) -> None:
    from lorafleet.worker.tiny_model import build_tiny_model

    with pytest.raises(ValueError, match="family must be one of"):
        build_tiny_model(tmp_path, family="sd3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preset of family 'flux' must be one of"):
        build_tiny_model(tmp_path, family="flux", preset="klein-4b")
    assert not any(tmp_path.iterdir())


def test_command_line_builds_a_flux_model(tmp_path: Path, tiny_flux_dir: Path) -> None:
    """`python -m lorafleet.worker.tiny_model DIR --family flux --preset tiny`, as a user runs it,
    writes the same files as the build in this process (hash seeds differ between processes,
    and the T5 Unigram trainer's output order followed them)."""
    target = tmp_path / "flux"
    done = subprocess.run(
        [*_MODULE, str(target), "--family", "flux", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(target)
    assert _files(target) == _files(tiny_flux_dir)


def test_command_line_names_the_family_presets(tmp_path: Path) -> None:
    done = subprocess.run(
        [*_MODULE, str(tmp_path / "x"), "--family", "flux2", "--preset", "flux-dev"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 2
    assert "--preset of --family flux2 must be one of tiny, klein-4b, klein-9b" in done.stderr


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def test_full_size_presets_have_the_published_parameter_counts() -> None:
    """The full-size shapes, built on the meta device (no memory), have the parameter counts of
    the released checkpoints: FLUX.1-dev's transformer 11,901,408,320, its VAE 83,819,683, CLIP
    ViT-L/14's text tower 123,060,480, T5 v1.1 XXL's encoder 4,762,310,656, Qwen3-4B
    4,022,468,096 and Qwen3-8B 8,190,735,360; klein's transformers 3.88 B and 9.08 B ("4B", "9B")
    from diffusers' conversion script's configs."""
    from transformers import CLIPTextModel, Qwen3ForCausalLM, T5EncoderModel

    from lorafleet.worker.tiny_models import flux, flux2

    loose: Any = diffusers
    dev = flux.PRESETS["flux-dev"]
    with torch.device("meta"):
        assert (
            _count(loose.FluxTransformer2DModel(**flux.transformer_config(dev))) == 11_901_408_320
        )
        assert _count(loose.AutoencoderKL(**flux.vae_config(dev))) == 83_819_683
        clip = CLIPTextModel(flux.clip_config(dev, vocab_size=49408, bos=49406, eos=49407))
        assert _count(clip) == 123_060_480
        assert _count(T5EncoderModel(flux.t5_config(dev, vocab_size=32128))) == 4_762_310_656
        counts = {}
        for name in ("klein-4b", "klein-9b"):
            shape = flux2.PRESETS[name]
            transformer = loose.Flux2Transformer2DModel(**flux2.transformer_config(shape))
            qwen = Qwen3ForCausalLM(flux2.qwen_config(shape, vocab_size=151936, pad=0, eos=1))
            counts[name] = (_count(transformer), _count(qwen))
            assert transformer.config.joint_attention_dim == 3 * qwen.config.hidden_size
    assert counts == {
        "klein-4b": (3_875_544_576, 4_022_468_096),
        "klein-9b": (9_078_581_248, 8_190_735_360),
    }


# --- FLUX.1 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_pipeline(tiny_flux_dir: Path) -> Any:
    loader: Any = diffusers.FluxPipeline  # untyped in diffusers
    pipe = loader.from_pretrained(tiny_flux_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux_directory_layout(tiny_flux_dir: Path) -> None:
    index = json.loads((tiny_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert (tiny_flux_dir / "tokenizer_2" / "tokenizer.json").is_file()
    for sub in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert list((tiny_flux_dir / sub).glob("*.safetensors"))


def test_flux_architecture_is_consistent(flux_pipeline: Any) -> None:
    transformer = flux_pipeline.transformer.config
    vae = flux_pipeline.vae.config
    assert transformer.guidance_embeds is True  # FLUX.1 [dev] is guidance-distilled
    assert transformer.in_channels == 4 * vae.latent_channels  # 2x2 packed latents
    assert transformer.joint_attention_dim == flux_pipeline.text_encoder_2.config.d_model
    assert transformer.pooled_projection_dim == flux_pipeline.text_encoder.config.hidden_size
    assert sum(transformer.axes_dims_rope) == transformer.attention_head_dim
    assert (vae.shift_factor, vae.scaling_factor) == (0.1159, 0.3611)
    assert not vae.use_quant_conv and not vae.use_post_quant_conv
    scheduler = flux_pipeline.scheduler.config
    assert (scheduler.shift, scheduler.use_dynamic_shifting) == (3.0, True)
    assert (scheduler.base_shift, scheduler.max_shift) == (0.5, 1.15)
    assert (scheduler.base_image_seq_len, scheduler.max_image_seq_len) == (256, 4096)
    assert _count(flux_pipeline.transformer) < 1_000_000


def test_flux_t5_tokenizer_is_a_working_unigram(flux_pipeline: Any) -> None:
    tokenizer = flux_pipeline.tokenizer_2
    assert type(tokenizer).__name__ == "T5Tokenizer"  # transformers 5's T5TokenizerFast
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("a photo of sks dog").input_ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a photo of sks dog"
    # Characters the training sentences lack are pieces too, not <unk>.
    assert tokenizer.unk_token_id not in tokenizer("QUIZ 42!").input_ids
    assert len(tokenizer.convert_tokens_to_ids(["<extra_id_0>"])) == 1
    padded = tokenizer("a dog", padding="max_length", max_length=512).input_ids
    assert len(padded) == 512 and padded[-1] == tokenizer.pad_token_id
    assert tokenizer.model_max_length == 512
    assert flux_pipeline.text_encoder_2.config.vocab_size == len(tokenizer)


def test_t5_vocabulary_is_deterministic() -> None:
    """The Unigram trainer orders equal scores by hash and sums in parallel; the builder must
    still write the same vocabulary every time (checked across processes by the rebuild test)."""
    from lorafleet.worker.tiny_models.tokenizers import t5_unigram_pieces

    assert t5_unigram_pieces() == t5_unigram_pieces()


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_flux_pipeline_generates_an_image(flux_pipeline: Any) -> None:
    images = flux_pipeline(
        "a photo of sks dog",
        num_inference_steps=2,
        height=32,
        width=32,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 32, 32, 3)
    assert np.isfinite(images).all() and images.std() > 0


def test_flux_build_is_deterministic_per_seed(tmp_path: Path, tiny_flux_dir: Path) -> None:
    from lorafleet.worker.tiny_model import build_tiny_model

    rebuilt = build_tiny_model(tmp_path / "again", family="flux")
    assert _files(rebuilt) == _files(tiny_flux_dir)
    other = build_tiny_model(tmp_path / "other", family="flux", seed=1)
    assert (
        _files(other)["transformer/diffusion_pytorch_model.safetensors"]
        != (_files(tiny_flux_dir)["transformer/diffusion_pytorch_model.safetensors"])
    )


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


# --- FLUX.2 [klein] ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux2_pipeline(tiny_flux2_dir: Path) -> Any:
    loader: Any = diffusers.Flux2KleinPipeline  # untyped in diffusers
    pipe = loader.from_pretrained(tiny_flux2_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux2_directory_layout(tiny_flux2_dir: Path) -> None:
    index = json.loads((tiny_flux2_dir / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline"
    assert index["is_distilled"] is False  # [klein] Base, the variant one fine-tunes
    assert index["transformer"] == ["diffusers", "Flux2Transformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLFlux2"]
    assert index["text_encoder"] == ["transformers", "Qwen3ForCausalLM"]
    assert (tiny_flux2_dir / "tokenizer" / "chat_template.jinja").is_file()
    for sub in ("transformer", "vae", "text_encoder"):
        assert list((tiny_flux2_dir / sub).glob("*.safetensors"))


def test_flux2_architecture_is_consistent(flux2_pipeline: Any) -> None:
    transformer = flux2_pipeline.transformer.config
    qwen = flux2_pipeline.text_encoder.config
    vae = flux2_pipeline.vae
    assert transformer.guidance_embeds is False
    assert transformer.in_channels == 4 * vae.config.latent_channels
    assert transformer.joint_attention_dim == 3 * qwen.hidden_size
    assert sum(transformer.axes_dims_rope) == transformer.attention_head_dim
    # As deep as Qwen3-4B and -8B: hidden_states[27] is a raw layer output, and layer 30 exists.
    assert qwen.num_hidden_layers == 36
    assert vae.bn.num_features == transformer.in_channels
    # Drawn running statistics: the latent normalisation is not an identity.
    assert not torch.allclose(vae.bn.running_var, torch.ones_like(vae.bn.running_var))
    assert not torch.allclose(vae.bn.running_mean, torch.zeros_like(vae.bn.running_mean))
    scheduler = flux2_pipeline.scheduler.config
    assert (scheduler.shift, scheduler.use_dynamic_shifting) == (3.0, True)
    assert scheduler.time_shift_type == "exponential"
    assert _count(flux2_pipeline.transformer) < 1_000_000


def test_flux2_tokenizer_renders_qwen3_chat(flux2_pipeline: Any) -> None:
    tokenizer = flux2_pipeline.tokenizer
    messages = [{"role": "user", "content": "a photo of sks dog"}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    # What Qwen3's own template renders for one user turn without thinking.
    assert text == (
        "<|im_start|>user\na photo of sks dog<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert special in tokens
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, *messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert with_system == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\na photo of sks dog<|im_end|>\n<|im_start|>assistant\n"
    )
    assert flux2_pipeline.text_encoder.config.vocab_size == len(tokenizer)


def test_flux2_encode_prompt_reads_qwen3_layers_9_18_27(flux2_pipeline: Any) -> None:
    """`encode_prompt` with its default `text_encoder_out_layers` works and is the concatenation
    of the hidden states after layers 9, 18 and 27 of the chat-templated, padded prompt."""
    with torch.no_grad():
        embeds, text_ids = flux2_pipeline.encode_prompt("a photo of sks dog")
        tokenizer = flux2_pipeline.tokenizer
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "a photo of sks dog"}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        inputs = tokenizer(text, return_tensors="pt", padding="max_length", max_length=512)
        hidden = flux2_pipeline.text_encoder(
            **inputs, output_hidden_states=True, use_cache=False
        ).hidden_states
    width = flux2_pipeline.text_encoder.config.hidden_size
    assert embeds.shape == (1, 512, 3 * width)
    assert text_ids.shape == (1, 512, 4)
    for slot, layer in enumerate((9, 18, 27)):
        assert torch.equal(embeds[..., slot * width : (slot + 1) * width], hidden[layer])
    assert not torch.allclose(hidden[27], hidden[-1])
    # FLUX.2 [dev]'s layers (the default of diffusers' klein trainer) run, and differ.
    with torch.no_grad():
        dev_layers, _ = flux2_pipeline.encode_prompt(
            "a photo of sks dog", text_encoder_out_layers=(10, 20, 30)
        )
    assert dev_layers.shape == embeds.shape and not torch.allclose(dev_layers, embeds)


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_flux2_pipeline_generates_an_image(flux2_pipeline: Any) -> None:
    images = flux2_pipeline(
        prompt="a photo of sks dog",
        num_inference_steps=2,
        height=32,
        width=32,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 3, 32, 32)
    assert torch.isfinite(images).all() and images.std() > 0


def test_flux2_build_is_deterministic_per_seed(tmp_path: Path, tiny_flux2_dir: Path) -> None:
    from lorafleet.worker.tiny_model import build_tiny_model

    rebuilt = build_tiny_model(tmp_path / "again", family="flux2")
    assert _files(rebuilt) == _files(tiny_flux2_dir)
