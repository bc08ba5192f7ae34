"""The trainer options on the tiny model (DoRA, LoRA dropout, Prodigy, repeats),
and a run's randomness kept in its own generators."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import safetensors.torch
import torch

from lorafleet.core.model import FailureClass
from lorafleet.worker.training import (
    KOHYA_WEIGHT_NAME,
    LORA_WEIGHT_NAME,
    Finished,
    Stopped,
    Trainer,
    TrainingFailure,
    TrainingHooks,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.compiling import CompileCosts
from lorafleet.worker.training.config import resolve_runtime
from lorafleet.worker.training.resident import ResidentModel
from tests.support.training import (
    SAMPLING_WARNING,
    TEST_DEVICE,
    Recorder,
    TrainFn,
    instance_images,
    lora_tensors,
    make_config,
    same_tensors,
    tiny_spec,
)

# Several training runs of the tiny model per test: slow, not in the fast lane (README,
# Development).
pytestmark = pytest.mark.slow

# Eager against compiled LoRA weights after 4 steps on CUDA, relative per tensor: a bound
# above the first GPU run's 0.094 (an H100; Adam turns rounding into full-size updates).
CUDA_DRIFT = 0.2

# Untyped in diffusers.
_Pipeline: Any = diffusers.StableDiffusionXLPipeline


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


def _global_states() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state()


def _same_global_states(a: tuple[Any, Any, torch.Tensor], b: tuple[Any, Any, torch.Tensor]) -> bool:
    np_a, np_b = a[1], b[1]
    return (
        a[0] == b[0]
        and all(np.array_equal(x, y) for x, y in zip(np_a, np_b, strict=True))
        and torch.equal(a[2], b[2])
    )


_ISOLATED = "LORAFLEET_TEST_ISOLATED"


def test_a_run_never_seeds_or_draws_from_the_process_generators(train: TrainFn) -> None:
    """Python's `random` (OpenTelemetry's span ids), NumPy's and torch's global generators are
    exactly as the run found them, after a fresh run and after a resumed one; so two jobs with
    the same seed leave different numbers to draw, and the results do not depend on them.

    In a process of its own: threads other tests leave behind (an OpenTelemetry exporter, a
    worker's gRPC loop) draw from these same generators while the run steps."""
    if os.environ.get(_ISOLATED) != "1":
        test_id = f"{__file__}::test_a_run_never_seeds_or_draws_from_the_process_generators"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
            env={**os.environ, _ISOLATED: "1"},
            capture_output=True,
            text=True,
            timeout=250,
            check=False,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return
    spec = tiny_spec(max_train_steps=3, lora_dropout=0.2, random_flip=True)
    random.seed(1234)
    before = _global_states()
    first, _ = train(spec, recorder=Recorder(stop_at=1))
    assert isinstance(first, Stopped) and first.snapshot is not None
    assert _same_global_states(before, _global_states())
    span_id_after_first = random.getrandbits(64)

    # Other global states, same job: the same result, and the globals still untouched.
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    before = _global_states()
    resumed, _ = train(spec, resume=load_checkpoint(serialize_checkpoint(first.snapshot)))
    assert _same_global_states(before, _global_states())
    assert random.getrandbits(64) != span_id_after_first
    full, _ = train(spec)
    assert same_tensors(lora_tensors(full), lora_tensors(resumed))


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_dora_adapters_train_load_and_change_the_images(
    train: TrainFn, tiny_model_dir: Path, tmp_path: Path
) -> None:
    outcome, _ = train(tiny_spec(max_train_steps=2, use_dora=True, train_text_encoder=True))
    assert isinstance(outcome, Finished)
    tensors = lora_tensors(outcome)
    magnitudes = [k for k in tensors if "lora_magnitude_vector" in k]
    assert {k.split(".", 1)[0] for k in magnitudes} == {"unet", "text_encoder", "text_encoder_2"}
    plain, _ = train(tiny_spec(max_train_steps=2, train_text_encoder=True))
    assert not any("magnitude" in k for k in lora_tensors(plain))

    (tmp_path / LORA_WEIGHT_NAME).write_bytes(outcome.lora_weights)
    pipe = _Pipeline.from_pretrained(tiny_model_dir)
    pipe.set_progress_bar_config(disable=True)
    before = _generate(pipe)
    pipe.load_lora_weights(tmp_path, weight_name=LORA_WEIGHT_NAME)
    after = _generate(pipe)
    assert next(iter(pipe.unet.peft_config.values())).use_dora
    assert np.isfinite(after).all()
    assert not np.array_equal(before, after)


def test_lora_dropout_changes_training_and_stays_reproducible(train: TrainFn) -> None:
    plain, _ = train(tiny_spec(max_train_steps=3))
    dropped, _ = train(tiny_spec(max_train_steps=3, lora_dropout=0.5))
    again, _ = train(tiny_spec(max_train_steps=3, lora_dropout=0.5))
    assert not same_tensors(lora_tensors(plain), lora_tensors(dropped))
    assert same_tensors(lora_tensors(dropped), lora_tensors(again))


def test_prodigy_learns_its_step_size_and_checkpoints_its_state(train: TrainFn) -> None:
    spec = tiny_spec(
        max_train_steps=4,
        checkpointing_steps=2,
        optimizer="prodigy",
        learning_rate=1.0,
        prodigy_d_coef=2.0,
    )
    outcome, recorder = train(spec)
    assert isinstance(outcome, Finished)
    [snapshot] = recorder.snapshots
    group = snapshot.state["optimizer"]["param_groups"][0]
    # Prodigy's own settings and its step-size estimate (its state beside the moments) are in
    # the checkpoint.
    assert group["d_coef"] == 2.0
    assert group["safeguard_warmup"] is True
    assert group["use_bias_correction"] is True
    assert group["k"] == 2
    assert group["d_numerator"] > 0
    assert any(key.endswith("/p0") for key in snapshot.tensors)
    adamw, _ = train(tiny_spec(max_train_steps=4, learning_rate=1.0))
    assert not same_tensors(lora_tensors(outcome), lora_tensors(adamw))


def test_repeats_lengthen_the_epoch(tiny_model_dir: Path) -> None:
    def epochs_after(steps: int, repeats: int) -> int:
        recorder = Recorder(stop_at=steps)
        spec = tiny_spec(max_train_steps=20, repeats=repeats)
        outcome = Trainer(make_config(tiny_model_dir, spec)).run(
            instance_images=instance_images(3), hooks=recorder.hooks()
        )
        assert isinstance(outcome, Stopped) and outcome.snapshot is not None
        order: dict[str, Any] = outcome.snapshot.state["data_order"]
        assert order["size"] == 3 * repeats
        # Each image appears `repeats` times in an epoch's permutation.
        assert sorted(i % 3 for i in order["permutation"]) == sorted([0, 1, 2] * repeats)
        return int(order["epoch"])

    assert epochs_after(4, repeats=1) == 2
    assert epochs_after(4, repeats=2) == 1


def test_prodigy_missing_is_a_node_fault(train: TrainFn, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name)
    )
    with pytest.raises(TrainingFailure, match="optimizer: prodigy") as caught:
        train(tiny_spec(optimizer="prodigy", learning_rate=1.0))
    assert caught.value.failure_class is FailureClass.NODE


def test_8bit_adam_by_name_is_refused_on_the_cpu(train: TrainFn) -> None:
    with pytest.raises(TrainingFailure, match="optimizer: 8-bit Adam") as caught:
        train(tiny_spec(optimizer="adamw_8bit"), device="cpu")
    assert caught.value.failure_class is FailureClass.INPUT


def test_dropout_masks_survive_gradient_checkpointing(train: TrainFn) -> None:
    """Recomputing a checkpointed forward pass draws the same dropout masks (torch's checkpoint
    restores the default generator, which inside a step is the run's own stream): the
    gradients, and so the weights, are those of the run without checkpointing."""
    spec: dict[str, Any] = {"max_train_steps": 2, "lora_dropout": 0.5, "train_text_encoder": True}
    plain, _ = train(tiny_spec(**spec))
    checkpointed, _ = train(tiny_spec(gradient_checkpointing=True, **spec))
    a, b = lora_tensors(plain), lora_tensors(checkpointed)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor |a - b| / |a|. A tensor that is zero in `a` must be zero in `b`:
    four LoRA tensors never train (the last layer of the first text encoder, whose output SDXL
    does not use), and their 0/0 made `max` return NaN whenever one of them came first, which
    happens in 4 of 160 runs (safetensors loads keys in a random order per process)."""
    worst = 0.0
    for key, tensor in a.items():
        reference = float(tensor.norm())
        if reference == 0.0:
            assert float(b[key].norm()) == 0.0, key
            continue
        worst = max(worst, float((tensor - b[key]).norm()) / reference)
    return worst


@pytest.mark.slow
@pytest.mark.timeout(900)
# Raised inside torch's own compile stack while it imports.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
# Raised by dynamo itself while it inspects the text encoders' parameters (not by our code).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_model_trains_the_same_weights_and_resumes_exactly(
    train: TrainFn, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compile_model` (with trained text encoders, torch.compile of the forward from the
    prompt's token ids to the loss) changes how the step runs, not what it trains: the result
    is that of the eager run up to float rounding, and a compiled run interrupted and resumed
    is bit-identical to an uninterrupted compiled one. The step is compiled once per resident
    model, into the node's own cache directory, and reused by the next runs of its shape; a
    compiled run that turns non-finite goes on eager from its last finite state."""
    # The node's cache outlives the test run, as a node's outlives its leases: a cold compile
    # takes minutes on 2 cores, a warm one seconds (inductor writes its caches atomically, so
    # two runs at once may share it). Whatever inductor writes elsewhere goes there too.
    cache = Path(tempfile.gettempdir()) / f"lorafleet-test-compile-cache-{torch.__version__}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "default"))
    spec = tiny_spec(max_train_steps=4, random_flip=True, train_text_encoder=True)
    shape = spec.compiled_shape_key
    eager, eager_steps = train(spec)
    resident = ResidentModel()
    compiled_run = {"compile_model": True, "compile_cache_dir": str(cache), "resident": resident}
    compiled, compiled_steps = train(spec, **compiled_run)
    # The first step's loss is computed from identical weights: the same up to rounding.
    # (Later ones drift apart: Adam turns rounding-sized gradients into full-size updates.)
    assert compiled_steps.progress[0][1] == pytest.approx(eager_steps.progress[0][1], rel=1e-5)
    a, b = lora_tensors(eager), lora_tensors(compiled)
    assert a.keys() == b.keys()
    # Measured after 4 steps: at most 2.5e-4 relative difference per tensor on the CPU; on
    # CUDA, where inductor's Triton kernels round differently from the eager ones, CUDA_DRIFT.
    worst = relative_difference(a, b)
    assert worst <= (CUDA_DRIFT if TEST_DEVICE == "cuda" else 1e-3), worst

    # Compiled into the node's cache, its cost measured, the step kept with the model.
    assert any((cache / "inductor").rglob("*.py"))
    assert resident.compiled_shapes == (shape,)
    costs = CompileCosts(cache).get(shape)
    assert costs.compile_s is not None and costs.compiled_step_s is not None

    # Interrupted and resumed on the warm model: nothing compiled again, the same bits.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first, _ = train(spec, recorder=Recorder(stop_at=2), **compiled_run)
    assert isinstance(first, Stopped) and first.snapshot is not None
    resumed, _ = train(
        spec, resume=load_checkpoint(serialize_checkpoint(first.snapshot)), **compiled_run
    )
    assert same_tensors(lora_tensors(compiled), lora_tensors(resumed))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert resident.loads == 1

    # A compiled run whose weights turn NaN after its first step goes on eager from the last
    # finite state (its start): exactly the eager run.
    config = make_config(tiny_model_dir, spec)
    runtime = resolve_runtime(config)

    class Poisoned(Recorder):
        def hooks(self) -> TrainingHooks:
            hooks = super().hooks()
            assert hooks.on_progress is not None
            on_progress = hooks.on_progress

            def progress(step: int, *values: float) -> None:
                on_progress(step, *values)
                if step == 1 and not self.notices:
                    unet = resident.components_for(config, runtime).denoiser
                    with torch.no_grad():
                        next(p for p in unet.parameters() if p.requires_grad).fill_(float("nan"))

            return dataclasses.replace(hooks, on_progress=progress)

    poisoned = Poisoned()
    fallen, _ = train(spec, recorder=poisoned, **compiled_run)
    assert lora_tensors(fallen).keys() == a.keys()
    assert same_tensors(lora_tensors(fallen), a)
    (notice,) = poisoned.notices
    assert "non-finite" in notice and "eager from step 0" in notice
    assert not resident.compiled_shapes  # not kept, not announced


@pytest.mark.filterwarnings(SAMPLING_WARNING)
@pytest.mark.parametrize("train_text_encoder", [False, True], ids=["unet", "text-encoders"])
def test_both_output_formats_load_and_change_the_images(
    train: TrainFn, tiny_model_dir: Path, tmp_path: Path, train_text_encoder: bool
) -> None:
    """output_format both: the diffusers file loads with load_lora_weights, the kohya file
    (lora_unet_/lora_te1_/lora_te2_ keys, lora_down/lora_up, .alpha = lora_alpha) with
    diffusers' own kohya-format loader; each changes the pipeline's images, and the two the
    same way."""
    options: dict[str, Any] = {
        "max_train_steps": 2,
        "lora_alpha": 8.0,
        "train_text_encoder": train_text_encoder,
    }
    outcome, _ = train(tiny_spec(output_format="both", **options))
    assert isinstance(outcome, Finished) and outcome.kohya_weights is not None
    kohya = safetensors.torch.load(outcome.kohya_weights)
    prefixes = {"lora_unet", "lora_te1", "lora_te2"} if train_text_encoder else {"lora_unet"}
    assert {"_".join(k.split("_", 2)[:2]) for k in kohya} == prefixes
    alphas = [v for k, v in kohya.items() if k.endswith(".alpha")]
    assert alphas and all(float(a) == 8.0 for a in alphas)
    assert any(k.endswith(".lora_down.weight") for k in kohya)
    # What is trained does not depend on the format: the diffusers file is the default run's.
    plain, _ = train(tiny_spec(**options))
    assert isinstance(plain, Finished) and plain.kohya_weights is None
    assert same_tensors(lora_tensors(plain), lora_tensors(outcome))

    (tmp_path / LORA_WEIGHT_NAME).write_bytes(outcome.lora_weights)
    (tmp_path / KOHYA_WEIGHT_NAME).write_bytes(outcome.kohya_weights)
    pipe = _Pipeline.from_pretrained(tiny_model_dir)
    pipe.set_progress_bar_config(disable=True)
    before = _generate(pipe)
    pipe.load_lora_weights(tmp_path, weight_name=LORA_WEIGHT_NAME, adapter_name="diffusers")
    with_diffusers = _generate(pipe)
    pipe.unload_lora_weights()
    assert np.array_equal(_generate(pipe), before)
    pipe.load_lora_weights(tmp_path, weight_name=KOHYA_WEIGHT_NAME, adapter_name="kohya")
    with_kohya = _generate(pipe)
    assert not np.array_equal(before, with_diffusers)
    assert not np.array_equal(before, with_kohya)
    np.testing.assert_allclose(with_kohya, with_diffusers, atol=1e-4)


def test_kohya_only_output_writes_the_kohya_file(train: TrainFn) -> None:
    outcome, _ = train(tiny_spec(max_train_steps=1, output_format="kohya"))
    assert isinstance(outcome, Finished) and outcome.kohya_weights is not None
    assert all(k.startswith("lora_unet_") for k in safetensors.torch.load(outcome.kohya_weights))


def test_a_resumed_run_writes_the_same_kohya_file(train: TrainFn) -> None:
    spec = tiny_spec(max_train_steps=3, output_format="both", random_flip=True)
    full, _ = train(spec)
    first, _ = train(spec, recorder=Recorder(stop_at=1))
    assert isinstance(first, Stopped) and first.snapshot is not None
    resumed, _ = train(spec, resume=load_checkpoint(serialize_checkpoint(first.snapshot)))
    assert isinstance(full, Finished) and isinstance(resumed, Finished)
    assert full.kohya_weights is not None and resumed.kohya_weights == full.kohya_weights
    assert resumed.lora_weights == full.lora_weights
