"""A run's compiled step: whether this run compiles (the choice, said on the job's timeline),
and the compiled callable it trains with.

compiling.py holds the policy (`decide`: is compiling worth it for this many steps, from the
node's measured costs) and the cache directory; this module applies it to one run and builds
what is compiled, taken from the resident model (resident.py) when a run of the same shape
compiled it before: the denoiser's repeated blocks (`CompiledBlocks`), or with trained text
encoders the whole loss as one graph (`compiled_loss` says why). Noise, timesteps and latents
are drawn outside the compiled code, LoRA dropout masks inside, all from the run's generators;
the modules stay the same objects, so LoRA weights, checkpoints and the result are unchanged.
The compiled code takes the modules as inputs (dynamo guards their types, not their identity),
so fresh adapters on the resident model reuse it, and one block's compiled forward serves every
block of its class. What is compiled is what measured fastest (docs/BENCHMARKS.md, "Trainer"
and "Regional compilation"). Falling back to eager when a compiled run turns non-finite is the
run's (loop.py).
"""

from __future__ import annotations

import functools
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
    model). Not regional, though its compile takes longer (1.5x for FLUX.1, 6x for SDXL on the
    tiny models' CPU): the encoders' layers carry transformers' output-capturing hooks (the
    hidden states the families read), which a compiled block forward would skip, and with the
    encoders eager beside the denoiser's compiled blocks the tiny models' step was 1.1x (SDXL)
    to 1.5x (FLUX.1) longer (docs/BENCHMARKS.md, "Regional compilation"; not the default job,
    whose encoders are frozen). `loss_from_token_ids` is the run's unbound method: the result
    takes the run first."""
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
    """With the prompt embeddings cached: the denoiser's repeated blocks compiled, the rest of
    it eager (`CompiledBlocks`; for SDXL the whole loss as one graph was 15% slower a step)."""
    _use_cache_dir(config)
    return resident.compiled(
        config.spec.compiled_shape_key, lambda: CompiledBlocks(components.denoiser)
    )


# Graphs kept per block class: the job shapes a worker serves compiled, times up to four.
RECOMPILE_LIMIT = 64


class CompiledBlocks:
    """Regional compilation: one compiled forward per class of the blocks the denoiser repeats
    (diffusers names them in `_repeated_blocks`: SDXL's transformer blocks, FLUX's double- and
    single-stream blocks), shared by every block of the class, instead of one graph of the
    whole denoiser. Dynamo traces and inductor compiles each distinct block once, not dozens
    of times inlined, while the step runs the same kernels inside the blocks
    (docs/BENCHMARKS.md, "Regional compilation").

    A resident step (resident.py's `InstalledStep`): while installed, each block's `__call__`
    runs the compiled forward (torch's own slot for a compiled module, `_compiled_call_impl`,
    which `nn.Module.compile` sets for good); installed for the whole run, because gradient
    checkpointing calls the blocks again during the backward. Shapes are static
    (`dynamic=False`): a block seen at a second shape (SDXL's blocks at two widths) gets a
    graph of its own, as a whole-model compile has, rather than one with symbolic sizes.
    """

    def __init__(self, denoiser: torch.nn.Module) -> None:
        # Dynamo keeps at most `recompile_limit` graphs of one code object (8 by default), then
        # runs it eager for any new shape: a block class gets up to four graphs a job shape
        # (SDXL's two widths, each with a first block whose input needs no gradient), and a
        # worker keeps every shape it ran. Raised for the process, whose one compile this is.
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        repeated = set(getattr(denoiser, "_repeated_blocks", ()))
        forwards: dict[type[torch.nn.Module], Callable[..., Any]] = {}
        self._denoiser = denoiser
        self._blocks: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
        for module in denoiser.modules():
            kind = type(module)
            if kind.__name__ not in repeated:
                continue
            if kind not in forwards:
                forwards[kind] = torch.compile(kind.forward, dynamic=False)
            self._blocks.append((module, functools.partial(forwards[kind], module)))
        if not self._blocks:
            raise ValueError(f"{type(denoiser).__name__} names no repeated blocks to compile")

    def install(self) -> None:
        for block, forward in self._blocks:
            # The compiled forward bypasses the module's call (its hooks): none may be there.
            if block._forward_hooks or block._forward_pre_hooks or block._backward_hooks:
                raise RuntimeError(f"{type(block).__name__} has hooks a compiled forward skips")
            block._compiled_call_impl = forward

    def uninstall(self) -> None:
        for block, _ in self._blocks:
            block._compiled_call_impl = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._denoiser(*args, **kwargs)


def _use_cache_dir(config: TrainingConfig) -> None:
    if config.compile_cache_dir is not None:
        use_cache_dir(Path(config.compile_cache_dir))
