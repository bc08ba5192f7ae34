"""The tiny SDXL-architecture model: saved in the diffusers layout and loadable as SDXL."""

from __future__ import annotations

import json
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
