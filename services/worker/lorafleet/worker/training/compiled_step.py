"""A run's compiled step: whether this run compiles (the choice, said on the job's timeline),
and the compiled callable it trains with.

compiling.py holds the policy (`decide`: is compiling worth it for this many steps, from the
node's measured costs) and the cache directory; this module applies it to one run and builds
what is compiled, taken from the resident model (resident.py) when a run of the same shape
compiled it before. Noise, timesteps and latents are drawn outside the compiled code, LoRA
dropout masks inside, all from the run's generators; the modules stay the same objects, so LoRA
weights, checkpoints and the result are unchanged. The compiled code takes the modules as
inputs (dynamo guards their types, not their identity), so fresh adapters on the resident model
reuse it. What is compiled is what measured fastest (docs/BENCHMARKS.md, "Trainer"). Falling
back to eager when a compiled run turns non-finite is the run's (loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lorafleet.worker.training.base_model import install_output_hooks
from lorafleet.worker.training.checkpoint import TrainingSnapshot
from lorafleet.worker.training.compiling import CompileCosts, decide, use_cache_dir
from lorafleet.worker.training.config import TrainingConfig
from lorafleet.worker.training.families.base import Components
from lorafleet.worker.training.resident import ResidentModel


def should_compile(
    config: TrainingConfig,
    resident: ResidentModel,
    resume: TrainingSnapshot | None,
    notice: Callable[[str], None],
) -> bool:
    """The run's choice (compiling.py), said on the job's timeline unless it is fixed."""
    choice = config.compile_choice
    if choice == "off":
        return False
    spec = config.spec
    shape = spec.compiled_shape_key
    cache = config.compile_cache_dir
    costs = CompileCosts(Path(cache) if cache is not None else None).get(shape)
    start = resume.step if resume is not None else 0
    decision = decide(
        choice,
        costs,
        remaining_steps=spec.max_train_steps - start,
        warm=resident.is_compiled(shape),
    )
    if choice == "auto":
        notice(decision.reason)
    return decision.compile


def compiled_loss(
    config: TrainingConfig,
    resident: ResidentModel,
    components: Components,
    loss_from_token_ids: Callable[..., torch.Tensor],
) -> Callable[..., Any]:
    """With trained text encoders: one graph from the prompt's token ids to the loss, so one
    backward graph through the encoders and the denoiser (-10% a step against compiling each
    model). `loss_from_token_ids` is the run's unbound method: the result takes the run first."""
    _use_cache_dir(config)
    install_output_hooks(list(components.text_encoders.values()))
    # dynamo checks its guards on the models' thousands of module attributes by one
    # dict-version tag per unchanged module, not one by one, every step (set while
    # compiling, when the guards are built; not process-wide).
    return resident.compiled(
        config.spec.compiled_shape_key,
        lambda: torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True)(
            torch.compile(loss_from_token_ids)
        ),
    )


def compiled_denoiser(
    config: TrainingConfig, resident: ResidentModel, components: Components
) -> Callable[..., Any]:
    """With the prompt embeddings cached: the denoiser alone (for SDXL the whole loss as one
    graph was 15% slower a step)."""
    _use_cache_dir(config)
    return resident.compiled(
        config.spec.compiled_shape_key, lambda: torch.compile(components.denoiser)
    )


def _use_cache_dir(config: TrainingConfig) -> None:
    if config.compile_cache_dir is not None:
        use_cache_dir(Path(config.compile_cache_dir))
