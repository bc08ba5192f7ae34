"""The trainer's CUDA-only paths: fp16 with loss scaling, 8-bit AdamW, frozen weights in the
mixed-precision dtype, and the device-to-host snapshot, each trained on the tiny model and
resumed. Run with `LORAFLEET_TEST_DEVICE=cuda` on a GPU (README, "On a GPU"); elsewhere these
tests are deselected, not skipped (tests/worker/conftest.py), and the rest of the trainer suite
runs on the GPU too then."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lorafleet.worker.training import (
    Finished,
    Stopped,
    TrainingSnapshot,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.base_model import detect_family, load_components
from lorafleet.worker.training.checkpoint import (
    DeviceSnapshotter,
    HostTensors,
    copy_stream,
    to_host,
)
from lorafleet.worker.training.config import resolve_runtime
from tests.support.training import (
    Recorder,
    TrainFn,
    instance_images,
    lora_tensors,
    make_config,
    same_tensors,
    tiny_spec,
)

pytestmark = pytest.mark.cuda


def _resume_from(train: TrainFn, spec: Any, snapshot: TrainingSnapshot) -> Finished:
    resumed, _ = train(spec, resume=load_checkpoint(serialize_checkpoint(snapshot)))
    assert isinstance(resumed, Finished)
    return resumed


def test_fp16_scales_the_loss_trains_fp32_lora_and_resumes_exactly(train: TrainFn) -> None:
    spec = tiny_spec(max_train_steps=4, checkpointing_steps=2, mixed_precision="fp16")
    full, recorder = train(spec)
    tensors = lora_tensors(full)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())
    fp32, _ = train(tiny_spec(max_train_steps=4))
    assert not same_tensors(lora_tensors(fp32), tensors)
    # The grad scaler's state travels with the checkpoint (its scale grows or backs off).
    scaler_state = recorder.snapshots[0].state["grad_scaler"]
    assert scaler_state is not None and scaler_state["scale"] > 1
    assert same_tensors(tensors, lora_tensors(_resume_from(train, spec, recorder.snapshots[0])))


def test_8bit_adam_quantizes_its_state_and_resumes_exactly(
    train: TrainFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bitsandbytes

    # bitsandbytes keeps 32-bit state for tensors under 4096 elements, which is every one of
    # the tiny model's LoRA tensors: quantize them all, so that the 8-bit state (codes, absmax,
    # quantization map) is what the checkpoint must carry.
    monkeypatch.setattr(
        bitsandbytes.optim,
        "AdamW8bit",
        functools.partial(bitsandbytes.optim.AdamW8bit, min_8bit_size=1),
    )
    spec = tiny_spec(max_train_steps=4, checkpointing_steps=2, optimizer="adamw_8bit")
    full, recorder = train(spec)
    snapshot = recorder.snapshots[0]
    assert any(t.dtype == torch.uint8 for t in snapshot.tensors.values())
    assert all(t.device.type == "cpu" for t in snapshot.tensors.values())
    adamw, _ = train(tiny_spec(max_train_steps=4))
    assert not same_tensors(lora_tensors(adamw), lora_tensors(full))
    assert same_tensors(lora_tensors(full), lora_tensors(_resume_from(train, spec, snapshot)))


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_frozen_weights_take_the_mixed_precision_dtype(
    train: TrainFn, tiny_model_dir: Path, precision: str, dtype: torch.dtype
) -> None:
    """frozen_dtype auto keeps the frozen UNet and text encoders in bf16/fp16 on CUDA (half
    the memory of fp32); the LoRA is still trained and saved in fp32."""
    spec = tiny_spec(max_train_steps=2, mixed_precision=precision, train_text_encoder=True)
    config = make_config(tiny_model_dir, spec)
    half = load_components(config, resolve_runtime(config), detect_family(config))
    assert half.denoiser.dtype == dtype
    assert all(encoder.dtype == dtype for encoder in half.text_encoders.values())
    config = make_config(tiny_model_dir, spec, frozen_dtype="fp32")
    assert (
        load_components(config, resolve_runtime(config), detect_family(config)).denoiser.dtype
        == torch.float32
    )
    outcome, _ = train(spec)
    assert all(t.dtype == torch.float32 for t in lora_tensors(outcome).values())


def test_gradient_checkpointing_recomputes_to_the_same_lora(train: TrainFn) -> None:
    spec: dict[str, Any] = {"max_train_steps": 2, "train_text_encoder": True, "lora_dropout": 0.3}
    plain, _ = train(tiny_spec(**spec))
    checkpointed, _ = train(tiny_spec(gradient_checkpointing=True, **spec))
    a, b = lora_tensors(plain), lora_tensors(checkpointed)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def test_a_drain_snapshot_is_a_host_copy_and_resumes_exactly(train: TrainFn) -> None:
    spec = tiny_spec(max_train_steps=4, mixed_precision="bf16", train_text_encoder=True)
    full, _ = train(spec)
    stopped, _ = train(spec, recorder=Recorder(stop_at=2))
    assert isinstance(stopped, Stopped) and stopped.snapshot is not None
    assert all(t.device.type == "cpu" for t in stopped.snapshot.tensors.values())
    resumed = _resume_from(train, spec, stopped.snapshot)
    assert same_tensors(lora_tensors(full), lora_tensors(resumed))


def _live_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device).manual_seed(0)
    # Large enough that a copy takes a while; two dtypes, so two staging buffers.
    tensors = {
        f"weight/{i}": torch.randn(1 << 22, device=device, generator=generator) for i in range(4)
    }
    tensors["half"] = torch.randn(4096, device=device, generator=generator).bfloat16()
    return tensors


def _hold(stream: Any) -> None:
    """Keeps `stream` busy for tens of milliseconds: work queued on it after this waits."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("reused", [True, False], ids=["snapshotter", "to_host"])
def test_a_snapshot_survives_the_training_stream_overwriting_its_source(reused: bool) -> None:
    """The adversary is the training stream itself: right after each snapshot it overwrites
    the snapshotted tensors, takes the next snapshot into the same staging buffers (reused)
    or allocates over the packed buffer it freed (to_host), while the copy stream is held
    back, so every device-to-host copy is still queued when its source is written again. Each
    snapshot must hold the values of the moment it was taken."""
    device = torch.device("cuda")
    live = _live_tensors(device)
    snapshotter = DeviceSnapshotter(live)
    stream = copy_stream(device)
    expected: list[dict[str, torch.Tensor]] = []
    snapshots: list[HostTensors] = []
    for _ in range(3):
        expected.append({key: value.cpu() for key, value in live.items()})
        _hold(stream)
        snapshots.append(snapshotter.snapshot({}) if reused else to_host(live))
        for value in live.values():
            value.mul_(-1.5).add_(1.0)
        # Fresh allocations that could take over freed device memory, then written.
        scratch = [torch.empty_like(value).fill_(float("nan")) for value in live.values()]
        del scratch
    for taken, values in zip(snapshots, expected, strict=True):
        assert set(taken) == set(values)
        for key, value in values.items():
            assert torch.equal(taken[key], value), key


@pytest.mark.parametrize("quantization", ["nf4", "fp8"])
@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_a_quantized_base_trains_fp32_lora_and_resumes_exactly(
    family: str,
    quantization: str,
    tiny_flux_dir: Path,
    tiny_flux2_dir: Path,
) -> None:
    """The QLoRA recipe on each flow family: the frozen transformer's linear layers in 4-bit
    NF4 (bitsandbytes) or float8 (torchao), the adapters and AdamW's state in fp32, and a run
    stopped at step 2 resumes to the same bits on the same kind of device."""
    from lorafleet.worker.training import Trainer

    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.fail("fp8 needs compute capability 8.9 (Ada, Hopper): run on an H100/H200")
    model = tiny_flux_dir if family == "flux" else tiny_flux2_dir
    spec = tiny_spec(
        max_train_steps=4,
        model_family=family,
        base_model=str(model),
        base_quantization=quantization,
        mixed_precision="bf16",
        gradient_checkpointing=True,
    )

    def run(**kwargs: Any) -> Any:
        recorder = kwargs.pop("recorder", Recorder())
        trainer = Trainer(make_config(model, spec))
        outcome = trainer.run(instance_images=instance_images(), hooks=recorder.hooks(), **kwargs)
        return outcome, recorder

    full, _ = run()
    tensors = lora_tensors(full)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())
    stopped, _ = run(recorder=Recorder(stop_at=2))
    assert isinstance(stopped, Stopped) and stopped.snapshot is not None
    resumed, _ = run(resume=load_checkpoint(serialize_checkpoint(stopped.snapshot)))
    assert same_tensors(tensors, lora_tensors(resumed))
    config = make_config(model, spec)
    components = load_components(config, resolve_runtime(config), detect_family(config))
    assert getattr(components.denoiser, "is_quantized", False)
