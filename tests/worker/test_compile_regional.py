"""Regional compilation (compiled_step.py's `CompiledBlocks`): with the prompt embeddings cached,
a compiled run compiles the denoiser's repeated blocks. The compiled blocks are on the resident
denoiser only while a compiled run uses them: an eager run after it on the same resident model
compiles nothing and trains the bits a fresh worker trains; a compiled run of the same shape
reuses them (no new graph) and, interrupted and resumed, trains the bits of an uninterrupted one;
compiled trains what eager trains up to float rounding; a compiled run that turns non-finite goes
on eager with the blocks taken off."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from lorafleet.worker.training import (
    Finished,
    Stopped,
    Trainer,
    TrainingHooks,
    TrainingOutcome,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.resident import ResidentModel
from tests.support.training import (
    TEST_DEVICE,
    Recorder,
    instance_images,
    lora_tensors,
    make_config,
    same_tensors,
    tiny_spec,
)
from tests.worker.test_trainer_options import CUDA_DRIFT, relative_difference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    # Raised inside torch's own compile stack while it imports.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # Raised by dynamo itself while it inspects a block's input, the output of the layers
    # before it (not by our code).
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
    ),
]


def _blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(denoiser, "_repeated_blocks", ()))
    return [m for m in denoiser.modules() if type(m).__name__ in names]


def _compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class _WatchBlocks(Recorder):
    """Records, at each step, whether every repeated block of the denoiser runs compiled."""

    def __init__(self, denoiser: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = _blocks(denoiser)
        self.installed: list[bool] = []

    def hooks(self) -> TrainingHooks:
        hooks = super().hooks()
        assert hooks.on_progress is not None
        on_progress = hooks.on_progress

        def progress(step: int, *values: float) -> None:
            self.installed.append(all(b._compiled_call_impl is not None for b in self.blocks))
            on_progress(step, *values)

        return dataclasses.replace(hooks, on_progress=progress)


# With gradient checkpointing the backward calls the blocks again: compiled too.
class _Poisoned(Recorder):
    """Fills a LoRA weight of the denoiser with NaN after the first step, once."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        super().__init__()
        self.denoiser = denoiser

    def hooks(self) -> TrainingHooks:
        hooks = super().hooks()
        assert hooks.on_progress is not None
        on_progress = hooks.on_progress

        def progress(step: int, *values: float) -> None:
            on_progress(step, *values)
            if step == 1 and not self.notices:
                weight = next(p for p in self.denoiser.parameters() if p.requires_grad)
                with torch.no_grad():
                    weight.fill_(float("nan"))

        return dataclasses.replace(hooks, on_progress=progress)


@pytest.mark.parametrize(("family", "checkpointing"), [("sdxl", False), ("flux2", True)])
def test_compiled_blocks_serve_compiled_runs_only_and_change_no_bits(
    family: str,
    checkpointing: bool,
    tiny_model_dir: Path,
    tiny_flux2_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = {"sdxl": tiny_model_dir, "flux2": tiny_flux2_dir}[family]
    # The node's cache outlives the test run, as a node's outlives its leases (a cold compile
    # takes a minute on 2 cores, a warm one seconds).
    cache = Path(tempfile.gettempdir()) / f"lorafleet-test-compile-cache-{torch.__version__}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "default"))
    overrides = {} if family == "sdxl" else {"model_family": family, "base_model": str(model)}
    spec = tiny_spec(
        max_train_steps=4, random_flip=True, gradient_checkpointing=checkpointing, **overrides
    )
    resident = ResidentModel()

    def train(
        recorder: Recorder | None = None,
        *,
        compiled: bool,
        on: ResidentModel | None = resident,
        **kw: Any,
    ) -> TrainingOutcome:
        config = make_config(
            model, spec, compile_model=compiled, compile_cache_dir=str(cache) if compiled else None
        )
        return Trainer(config, on).run(
            instance_images=instance_images(), hooks=(recorder or Recorder()).hooks(), **kw
        )

    eager = train(compiled=False, on=None)
    train(compiled=False)  # loads the resident model
    held = resident._held
    assert held is not None
    denoiser = held.components.denoiser
    watch = _WatchBlocks(denoiser)
    graphs = _compiled_graphs()
    compiled = train(watch, compiled=True)
    assert _compiled_graphs() > graphs  # the blocks' graphs (from the cache or made here)
    assert watch.installed == [True] * 4 and watch.blocks
    assert not any(b._compiled_call_impl is not None for b in watch.blocks)
    worst = relative_difference(lora_tensors(eager), lora_tensors(compiled))
    assert worst <= (CUDA_DRIFT if TEST_DEVICE == "cuda" else 1e-3), worst
    assert resident.compiled_shapes == (spec.compiled_shape_key,)

    # Eager on the same resident model after the compiled run: nothing compiled, the bits of a
    # fresh worker's eager run.
    graphs = _compiled_graphs()
    assert same_tensors(lora_tensors(train(compiled=False)), lora_tensors(eager))
    assert _compiled_graphs() == graphs

    # Compiled again, interrupted and resumed: the kept blocks, nothing compiled again, the bits
    # of the uninterrupted compiled run.
    first = train(Recorder(stop_at=2), compiled=True)
    assert isinstance(first, Stopped) and first.snapshot is not None
    resumed = train(compiled=True, resume=load_checkpoint(serialize_checkpoint(first.snapshot)))
    assert isinstance(resumed, Finished) and isinstance(compiled, Finished)
    assert resumed.lora_weights == compiled.lora_weights
    assert _compiled_graphs() == graphs
    assert resident.loads == 1

    # A compiled run whose LoRA weights turn NaN after its first step goes on eager from its
    # start with the blocks taken off: exactly the eager run.
    poisoned = _Poisoned(denoiser)
    fallen = train(poisoned, compiled=True)
    assert same_tensors(lora_tensors(fallen), lora_tensors(eager))
    (notice,) = poisoned.notices
    assert "non-finite" in notice and "eager from step 0" in notice
    assert not resident.compiled_shapes
    assert not any(b._compiled_call_impl is not None for b in watch.blocks)
