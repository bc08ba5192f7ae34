"""Every JobSpec option trains on the tiny model at 64 px and does what it says."""

from __future__ import annotations

import functools
import io
import json
import math
from typing import Any

import pytest
import torch
import transformers.modeling_utils
from diffusers.optimization import get_scheduler
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from PIL import Image

from lorafleet.core.model import FailureClass
from lorafleet.worker.training import Finished, TrainingFailure, TrainingImage, loop, lora
from lorafleet.worker.training.serialization import safetensors_metadata
from tests.support.images import image_bytes
from tests.support.training import (
    SAMPLING_WARNING,
    Recorder,
    TrainFn,
    instance_images,
    lora_tensors,
    same_tensors,
    tiny_spec,
)

# Several training runs of the tiny model per test: slow, not in the fast lane (README,
# Development).
pytestmark = pytest.mark.slow


def _lrs(recorder: Recorder) -> list[float]:
    return [p[2] for p in recorder.progress]


def test_default_run_reports_progress_and_returns_lora(train: TrainFn) -> None:
    outcome, recorder = train(tiny_spec(max_train_steps=3))
    assert isinstance(outcome, Finished)
    assert outcome.step == 3
    assert [p[0] for p in recorder.progress] == [1, 2, 3]
    assert all(math.isfinite(p[1]) and p[3] > 0 for p in recorder.progress)
    assert outcome.loss == recorder.progress[-1][1]
    tensors = lora_tensors(outcome)
    assert tensors
    assert all(key.startswith("unet.") for key in tensors)
    # lora_B starts at zero: after training the adapters are no longer a no-op.
    assert any(key.endswith("lora.up.weight") and tensors[key].abs().sum() > 0 for key in tensors)


def test_seed_changes_the_result(train: TrainFn) -> None:
    """Guards the equality checks below and in test_resume: results are seed-sensitive."""
    a, _ = train(tiny_spec(seed=1))
    b, _ = train(tiny_spec(seed=2))
    assert not same_tensors(lora_tensors(a), lora_tensors(b))


def test_rank_and_alpha_land_in_the_lora_file(train: TrainFn) -> None:
    outcome, _ = train(tiny_spec(lora_rank=3, lora_alpha=6.0, max_train_steps=1))
    assert isinstance(outcome, Finished)
    tensors = lora_tensors(outcome)
    downs = [t for k, t in tensors.items() if k.endswith("lora.down.weight")]
    assert downs
    assert all(t.shape[0] == 3 for t in downs)
    config = json.loads(safetensors_metadata(outcome.lora_weights)["lora_adapter_metadata"])
    assert config["unet.r"] == 3
    assert config["unet.lora_alpha"] == 6.0
    assert sorted(config["unet.target_modules"]) == ["to_k", "to_out.0", "to_q", "to_v"]


@pytest.mark.parametrize(
    "name",
    ["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"],
)
def test_lr_schedulers_with_warmup(train: TrainFn, name: str) -> None:
    steps, warmup, base = 5, 2, 1e-2
    spec = tiny_spec(
        max_train_steps=steps,
        lr_scheduler=name,
        lr_warmup_steps=warmup,
        lr_num_cycles=2,
        lr_power=2.0,
        learning_rate=base,
    )
    _, recorder = train(spec)
    reference_param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([reference_param], lr=base)
    reference = get_scheduler(
        name,
        optimizer=optimizer,
        num_warmup_steps=warmup,
        num_training_steps=steps,
        num_cycles=2,
        power=2.0,
    )
    expected = []
    for _ in range(steps):
        optimizer.step()
        reference.step()
        expected.append(reference.get_last_lr()[0])
    assert _lrs(recorder) == pytest.approx(expected)
    if name != "constant":
        # The warmup is really applied: the first step runs at half the rate.
        assert _lrs(recorder)[0] == pytest.approx(base / 2)


def test_linear_schedule_values(train: TrainFn) -> None:
    """Absolute check of one schedule: warmup 2 then linear decay to 0 at step 6."""
    _, recorder = train(
        tiny_spec(max_train_steps=6, lr_scheduler="linear", lr_warmup_steps=2, learning_rate=1e-2)
    )
    assert _lrs(recorder) == pytest.approx([5e-3, 1e-2, 7.5e-3, 5e-3, 2.5e-3, 0.0])


def test_batch_size_and_accumulation_consume_data_per_step(train: TrainFn) -> None:
    images = instance_images(5)
    recorder = Recorder()
    train(
        tiny_spec(
            max_train_steps=3,
            train_batch_size=2,
            gradient_accumulation_steps=2,
            checkpointing_steps=1,
        ),
        images,
        recorder=recorder,
    )
    # One optimizer step = 2 micro-batches of 2 images; 5 images give batches [2, 2, 1] per
    # epoch. Step 1 takes 2 + 2; step 2 takes the epoch's last 1, then 2 of the next epoch.
    orders = [s.state["data_order"] for s in recorder.snapshots]
    assert [(o["epoch"], o["position"]) for o in orders] == [(1, 4), (2, 2)]
    assert sorted(orders[0]["permutation"]) == [0, 1, 2, 3, 4]
    assert orders[0]["permutation"] != orders[1]["permutation"]
    # The LR schedule advances once per optimizer step, not per micro-batch.
    assert [s.state["lr_scheduler"]["last_epoch"] for s in recorder.snapshots] == [1, 2]


def test_accumulation_changes_the_update(train: TrainFn) -> None:
    plain, _ = train(tiny_spec(max_train_steps=1))
    accumulated, _ = train(tiny_spec(max_train_steps=1, gradient_accumulation_steps=2))
    assert not same_tensors(lora_tensors(plain), lora_tensors(accumulated))


def test_gradient_checkpointing_trains_the_same_lora(
    train: TrainFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recomputing activations changes memory, not results (bit-identical on the CPU)."""
    spec = {"max_train_steps": 2, "train_text_encoder": True}
    plain, _ = train(tiny_spec(**spec))
    checkpointed_modules: set[str] = set()
    original = torch.utils.checkpoint.checkpoint

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        # diffusers passes a bound module method, transformers partial(forward, module).
        if isinstance(function, functools.partial):
            owner = function.args[0] if function.args else None
        else:
            owner = getattr(function, "__self__", None)
        checkpointed_modules.add(type(owner).__name__ if owner is not None else "?")
        return original(function, *args, **kwargs)

    # diffusers looks the function up on torch.utils.checkpoint; transformers imported it by name.
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counting)
    checkpointed, _ = train(tiny_spec(gradient_checkpointing=True, **spec))
    # Both the UNet's transformer blocks and the text encoders' layers were recomputed.
    assert "BasicTransformerBlock" in checkpointed_modules
    assert "CLIPEncoderLayer" in checkpointed_modules
    assert same_tensors(lora_tensors(plain), lora_tensors(checkpointed))


def test_text_encoder_training_saves_both_encoders_with_their_lr(train: TrainFn) -> None:
    recorder = Recorder()
    outcome, _ = train(
        tiny_spec(
            train_text_encoder=True,
            text_encoder_learning_rate=1e-3,
            checkpointing_steps=1,
        ),
        recorder=recorder,
    )
    prefixes = {key.split(".", 1)[0] for key in lora_tensors(outcome)}
    assert prefixes == {"unet", "text_encoder", "text_encoder_2"}
    groups = recorder.snapshots[0].state["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [1e-2, 1e-3]
    te_keys = [k for k in lora_tensors(outcome) if k.startswith("text_encoder.")]
    assert any(".q_proj.lora" in k for k in te_keys)
    assert any(".out_proj.lora" in k for k in te_keys)


def test_bf16_mixed_precision_trains_fp32_lora(train: TrainFn) -> None:
    fp32, _ = train(tiny_spec())
    bf16, _ = train(tiny_spec(mixed_precision="bf16"))
    tensors = lora_tensors(bf16)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())
    assert not same_tensors(lora_tensors(fp32), tensors)


def test_skipping_peft_input_casts_under_autocast_trains_the_same_bits(
    train: TrainFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under autocast the trainer turns off peft's cast of each LoRA layer's input to the fp32
    adapter weights (autocast casts it straight back): fewer kernels, the same bits."""
    spec = tiny_spec(mixed_precision="bf16", train_text_encoder=True, max_train_steps=3)
    calls: list[int] = []
    real = lora.skip_input_casts

    def recorded(modules: Any) -> None:
        calls.append(len(list(modules)))
        real(modules)

    monkeypatch.setattr(loop, "skip_input_casts", recorded)
    skipped, _ = train(spec)
    assert calls == [3]  # once, on the UNet and both text encoders
    monkeypatch.setattr(loop, "skip_input_casts", lambda modules: None)
    cast, _ = train(spec)
    assert same_tensors(lora_tensors(skipped), lora_tensors(cast))


def test_fp16_on_cpu_is_an_input_fault(train: TrainFn) -> None:
    with pytest.raises(TrainingFailure, match="mixed_precision: fp16 needs a CUDA GPU") as info:
        train(tiny_spec(mixed_precision="fp16"), device="cpu")
    assert info.value.failure_class is FailureClass.INPUT


def test_8bit_adam_on_cpu_is_an_input_fault(train: TrainFn) -> None:
    with pytest.raises(TrainingFailure, match=r"use_8bit_adam: .*needs a CUDA GPU") as info:
        train(tiny_spec(use_8bit_adam=True), device="cpu")
    assert info.value.failure_class is FailureClass.INPUT
    assert info.value.retryable is False


@pytest.mark.parametrize(
    # A gamma under every timestep's SNR (SDXL's least is about 0.005) reweights whatever
    # timestep the device's generator draws: 5.0 changed nothing for CUDA's first draw.
    "option",
    [{"snr_gamma": 1e-3}, {"noise_offset": 0.1}],
    ids=["min-snr", "noise-offset"],
)
def test_loss_options_change_the_loss(train: TrainFn, option: dict[str, float]) -> None:
    _, plain = train(tiny_spec(max_train_steps=1))
    _, changed = train(tiny_spec(max_train_steps=1, **option))
    assert math.isfinite(changed.progress[0][1])
    assert changed.progress[0][1] != plain.progress[0][1]


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_prior_preservation_generates_and_hands_back_class_images(train: TrainFn) -> None:
    spec = tiny_spec(
        with_prior_preservation=True, class_prompt="a photo of a dog", num_class_images=3
    )
    outcome, recorder = train(spec)
    assert isinstance(outcome, Finished)
    assert [index for index, _ in recorder.class_images] == [0, 1, 2]
    for _, png in recorder.class_images:
        with Image.open(io.BytesIO(png)) as image:
            assert (image.format, image.size) == ("PNG", (64, 64))
    # Handing them back (as on resume) skips generation and trains the same LoRA.
    again, second = train(
        spec, class_images=[TrainingImage(f"{i}.png", png) for i, png in recorder.class_images]
    )
    assert second.class_images == []
    assert same_tensors(lora_tensors(outcome), lora_tensors(again))


def test_prior_preservation_with_supplied_class_images(train: TrainFn) -> None:
    supplied = [TrainingImage(f"class{i}.png", image_bytes(50 + i)) for i in range(2)]
    spec = tiny_spec(with_prior_preservation=True, class_prompt="a dog", num_class_images=2)
    prior, recorder = train(spec, class_images=supplied)
    assert recorder.class_images == []
    weighted, _ = train(
        tiny_spec(
            with_prior_preservation=True,
            class_prompt="a dog",
            num_class_images=2,
            prior_loss_weight=5.0,
        ),
        class_images=supplied,
    )
    plain, _ = train(tiny_spec())
    assert not same_tensors(lora_tensors(prior), lora_tensors(plain))
    assert not same_tensors(lora_tensors(prior), lora_tensors(weighted))


def test_captions_from_files_or_the_instance_prompt(train: TrainFn) -> None:
    captioned = [
        TrainingImage(f"img{i}.png", image_bytes(i), caption=f"a photo of sks dog, view {i}")
        for i in range(3)
    ]
    from_files, _ = train(tiny_spec(), captioned)
    prompt_only, _ = train(tiny_spec(caption_mode="instance_prompt"), captioned)
    uncaptioned, _ = train(tiny_spec(), instance_images(3))
    assert not same_tensors(lora_tensors(from_files), lora_tensors(prompt_only))
    # caption_mode=instance_prompt ignores the captions entirely.
    assert same_tensors(lora_tensors(prompt_only), lora_tensors(uncaptioned))


def test_higher_resolution_with_non_square_images(train: TrainFn) -> None:
    images = [TrainingImage(f"wide{i}.jpg", image_bytes(i, (200, 128), "JPEG")) for i in range(2)]
    outcome, _ = train(tiny_spec(resolution=128), images)
    assert isinstance(outcome, Finished)


def test_center_crop_and_random_crop_differ_on_non_square_images(train: TrainFn) -> None:
    images = instance_images(2, (96, 64))
    centre, _ = train(tiny_spec(center_crop=True, max_train_steps=3), images)
    random_a, _ = train(tiny_spec(max_train_steps=3), images)
    random_b, _ = train(tiny_spec(max_train_steps=3), images)
    assert same_tensors(lora_tensors(random_a), lora_tensors(random_b))
    assert not same_tensors(lora_tensors(centre), lora_tensors(random_a))


def test_random_flip_changes_training(train: TrainFn) -> None:
    plain, _ = train(tiny_spec(max_train_steps=3))
    flipped, _ = train(tiny_spec(max_train_steps=3, random_flip=True))
    assert not same_tensors(lora_tensors(plain), lora_tensors(flipped))


def test_a_validation_prompt_never_stops_training(train: TrainFn) -> None:
    """Validation images are sample tasks: a spec asking for them trains the same
    LoRA, and its run generates nothing and asks for no image upload."""
    spec = {"max_train_steps": 4, "random_flip": True}
    validated, recorder = train(
        tiny_spec(validation_prompt="a photo of sks dog", validation_steps=2, **spec)
    )
    plain, _ = train(tiny_spec(**spec))
    assert same_tensors(lora_tensors(validated), lora_tensors(plain))
    assert recorder.class_images == []


def test_progress_interval_limits_reports(train: TrainFn) -> None:
    """Reports (each a loss read, a device sync) at most every progress_interval_s, and the
    last step always; by default every step."""
    _, every = train(tiny_spec(max_train_steps=5))
    assert [p[0] for p in every.progress] == [1, 2, 3, 4, 5]
    _, sparse = train(tiny_spec(max_train_steps=5), progress_interval_s=3600.0)
    assert [p[0] for p in sparse.progress] == [5]


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_training_phases_are_traced(train: TrainFn, monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(loop, "_tracer", provider.get_tracer("test"))
    train(
        tiny_spec(
            max_train_steps=2,
            checkpointing_steps=1,
            validation_prompt="a photo of sks dog",
            validation_steps=2,
        )
    )
    # No "training.validation": validation images are sample tasks, never part of the run.
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {
        "training.load_model",
        "training.class_images",
        "training.precompute",
        "training.snapshot",
        "training.steps",
    }
    assert spans["training.precompute"].attributes == {
        "lorafleet.latents_cached": True,
        "lorafleet.embeddings_cached": True,
    }
    assert spans["training.steps"].attributes == {
        "lorafleet.start_step": 0,
        "lorafleet.end_step": 2,
    }
