"""The result loads into StableDiffusionXLPipeline with load_lora_weights and changes images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from diffusers.utils import state_dict_utils
from peft.utils import get_peft_model_state_dict

from lorafleet.worker.training import LORA_WEIGHT_NAME, Finished
from tests.support.training import SAMPLING_WARNING, TrainFn, lora_tensors, tiny_spec

# Untyped in diffusers.
_Pipeline: Any = diffusers.StableDiffusionXLPipeline
_to_diffusers: Any = state_dict_utils.convert_state_dict_to_diffusers


def _generate(pipe: Any) -> np.ndarray[Any, Any]:
    image = pipe(
        "a photo of sks dog",
        num_inference_steps=2,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    return np.asarray(image)


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_lora_loads_into_the_sdxl_pipeline_and_generates(
    train: TrainFn, tiny_model_dir: Path, tmp_path: Path
) -> None:
    outcome, _ = train(
        tiny_spec(max_train_steps=3, train_text_encoder=True, lora_rank=4, lora_alpha=8.0)
    )
    assert isinstance(outcome, Finished)
    trained = lora_tensors(outcome)
    assert {key.split(".", 1)[0] for key in trained} == {"unet", "text_encoder", "text_encoder_2"}
    # Only the test writes the bytes to disk, to use diffusers' own file loader.
    (tmp_path / LORA_WEIGHT_NAME).write_bytes(outcome.lora_weights)

    pipe = _Pipeline.from_pretrained(tiny_model_dir)
    pipe.set_progress_bar_config(disable=True)
    before = _generate(pipe)
    pipe.load_lora_weights(tmp_path, weight_name=LORA_WEIGHT_NAME)
    after = _generate(pipe)
    assert after.shape == (64, 64, 3)
    assert np.isfinite(after).all()
    assert not np.array_equal(before, after)

    # Every tensor arrived unchanged, in every component.
    for prefix, module in (
        ("unet", pipe.unet),
        ("text_encoder", pipe.text_encoder),
        ("text_encoder_2", pipe.text_encoder_2),
    ):
        adapter = next(iter(module.peft_config))
        loaded = _to_diffusers(
            get_peft_model_state_dict(module, adapter_name=adapter, save_embedding_layers=False)
        )
        ours = {k.split(".", 1)[1]: v for k, v in trained.items() if k.startswith(prefix + ".")}
        assert loaded.keys() == ours.keys(), prefix
        assert all(torch.equal(loaded[k].float(), ours[k]) for k in ours), prefix
        # lora_alpha survived through the file's adapter metadata: scale = alpha / rank.
        config = module.peft_config[adapter]
        assert (config.r, config.lora_alpha) == (4, 8.0), prefix
