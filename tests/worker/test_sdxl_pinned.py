"""SDXL's results pinned to the bits they had before the trainer grew model families.

The family seam (worker/training/families) moved SDXL's loading, prompt encoding, objective and
LoRA files behind one interface; these runs must train exactly what they trained before it,
byte for byte, on this test machine's CPU (one intra-op thread). The digests were recorded
before the move, by the same runs (after the result file stopped carrying the worker's model
folder in its adapter metadata, which made the same job's file differ between nodes). A change
meant to alter SDXL's numbers re-pins them and says why in its commit."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from lorafleet.worker.training import Finished
from tests.support.training import SAMPLING_WARNING, TrainFn, tiny_spec

PINNED: dict[str, tuple[dict[str, Any], str, str | None]] = {
    "plain": (
        {"max_train_steps": 3},
        "b1b9d97f51e5d497d5c3952581b33cb96dddcbfc82003dd0bf4b9b6f552f6953",
        None,
    ),
    "text_encoders_snr_offset_accumulation_kohya": (
        {
            "max_train_steps": 3,
            "train_text_encoder": True,
            "snr_gamma": 5.0,
            "noise_offset": 0.1,
            "output_format": "both",
            "gradient_accumulation_steps": 2,
        },
        "054c07ff1fb75b421c19db0f95e9acf37a73841b02e103d1d1d0b554099a95ad",
        "594ccfe11ea76b4cab55c00c7664e02c62d404f2d4f8988fdf3c8be121e1d14c",
    ),
    "prior_preservation_dora_dropout_flip": (
        {
            "max_train_steps": 2,
            "with_prior_preservation": True,
            "class_prompt": "a photo of dog",
            "num_class_images": 2,
            "use_dora": True,
            "lora_dropout": 0.1,
            "random_flip": True,
        },
        "861980eda82dc64798af722c6891ee7d2adea8b631dffa4b6ddf87603e49d3f8",
        None,
    ),
}


@pytest.mark.filterwarnings(SAMPLING_WARNING)
@pytest.mark.parametrize("case", sorted(PINNED))
def test_sdxl_trains_the_bits_it_trained_before_families(train: TrainFn, case: str) -> None:
    overrides, lora_digest, kohya_digest = PINNED[case]
    outcome, _ = train(tiny_spec(**overrides))
    assert isinstance(outcome, Finished)
    assert hashlib.sha256(outcome.lora_weights).hexdigest() == lora_digest
    kohya = outcome.kohya_weights
    assert (hashlib.sha256(kohya).hexdigest() if kohya is not None else None) == kohya_digest
