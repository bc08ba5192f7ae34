"""SDXL's results pinned to what they were before the trainer grew model families.

The family seam (worker/training/families) moved SDXL's loading, prompt encoding, objective and
LoRA files behind one interface; these runs must still train what they trained before it. The
move itself was checked byte for byte (the sha256 of each result file, recorded before the move
and matched after it on the same machine). Bytes are not portable between CPUs, though: torch
picks its vectorised kernels by the CPU (AVX-512, AVX2, none), their float rounding differs,
and AdamW's first update (lr * sign(g)) turns a rounding-level gradient into a full step. So the
pins are what survives another CPU and still catches a change of the maths:

* the file's layout exactly (every key, shape and dtype: what diffusers and ComfyUI load);
* the final loss within 1e-3 (relative);
* four fixed random projections of all LoRA tensors within 1% of their norm.

Measured on one machine between its AVX2 kernels and `ATEN_CPU_CAPABILITY=default`: the losses
agreed to 2e-4, the projections to 0.5% of their norm (the DoRA run, whose first AdamW steps
are the most sign-sensitive) and 2e-5 (the others); a changed seed, timestep draw or loss term
moves them by tens of percent. LoRA dropout is left out: its masks come from
`torch.bernoulli`, whose draws from the same generator differ between those kernels. A change
meant to alter SDXL's numbers re-pins them and says why in its commit."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import safetensors.torch
import torch

from lorafleet.worker.training import Finished
from tests.support.training import SAMPLING_WARNING, TrainFn, tiny_spec

# A result file's pins: the sha256 of its layout, its four projections.
FilePin = tuple[str, tuple[float, float, float, float]]

PINNED: dict[str, tuple[dict[str, Any], float, FilePin, FilePin | None]] = {
    "plain": (
        {"max_train_steps": 3},
        1.084488,
        (
            "1b95624d8c270afc8635ada0b970af059e5f02314ed543048ee9d00e9437939f",
            (33.107747, -44.924282, -4.080234, 45.889431),
        ),
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
        0.963949,
        (
            "d05a92c462e8bd04e2c3a38c891c435e30fc08908bf4296016a33177073f3d1c",
            (3.574271, 46.230411, 8.792816, 9.310747),
        ),
        (
            "99d8b07183c35b370fcd9a98f9b406cee25f6587281e103ef0f5745c36ae455d",
            (42.257911, 12.582824, 10.13972, -25.665449),
        ),
    ),
    "prior_preservation_dora_flip": (
        {
            "max_train_steps": 2,
            "with_prior_preservation": True,
            "class_prompt": "a photo of dog",
            "num_class_images": 2,
            "use_dora": True,
            "random_flip": True,
        },
        2.195587,
        (
            "e7ec69222abd8c971afe141f106768973b242dcb80bc2c82cee2a18ada3d348d",
            (26.530342, -14.937365, 25.866154, -27.980955),
        ),
        None,
    ),
}


def file_pin(data: bytes) -> FilePin:
    """The layout's sha256 and the sums of all tensors times four fixed N(0, 1) vectors."""
    tensors = safetensors.torch.load(data)
    layout = repr([(n, tuple(tensors[n].shape), str(tensors[n].dtype)) for n in sorted(tensors)])
    generator = torch.Generator().manual_seed(0)
    projections = [0.0] * 4
    for name in sorted(tensors):
        values = tensors[name].double().flatten()
        for i in range(4):
            direction = torch.randn(values.numel(), generator=generator, dtype=torch.float64)
            projections[i] += float(values @ direction)
    p0, p1, p2, p3 = projections
    return hashlib.sha256(layout.encode()).hexdigest(), (p0, p1, p2, p3)


def assert_pinned(data: bytes, pinned: FilePin) -> None:
    layout, projections = file_pin(data)
    assert layout == pinned[0]
    expected = torch.tensor(pinned[1], dtype=torch.float64)
    torch.testing.assert_close(
        torch.tensor(projections, dtype=torch.float64),
        expected,
        rtol=0,
        atol=0.01 * float(expected.norm()),
    )


@pytest.mark.filterwarnings(SAMPLING_WARNING)
@pytest.mark.parametrize("case", sorted(PINNED))
def test_sdxl_trains_what_it_trained_before_families(train: TrainFn, case: str) -> None:
    overrides, loss, lora_pin, kohya_pin = PINNED[case]
    outcome, _ = train(tiny_spec(**overrides))
    assert isinstance(outcome, Finished)
    assert outcome.loss == pytest.approx(loss, rel=1e-3)
    assert_pinned(outcome.lora_weights, lora_pin)
    assert (outcome.kohya_weights is None) == (kohya_pin is None)
    if outcome.kohya_weights is not None and kohya_pin is not None:
        assert_pinned(outcome.kohya_weights, kohya_pin)
        # ComfyUI and kohya name both CLIP encoders' layers under `text_model`.
        text = [k for k in safetensors.torch.load(outcome.kohya_weights) if k.startswith("lora_te")]
        assert text and all(
            k.startswith(("lora_te1_text_model_", "lora_te2_text_model_")) for k in text
        )
