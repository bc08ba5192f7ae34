"""The base model a worker keeps loaded between runs, and the compiled steps made for it.

Loading a base model's frozen components takes seconds to minutes a lease, and compiling the step
minutes more; a worker pays both once and keeps them (`ResidentModel`, one per worker, used
on its training thread by training runs and sample tasks alike). What it keeps is only what no
job changes: the frozen denoiser, VAE, text encoders and tokenizers of one base model in one
precision (`JobSpec.resident_key`), and the compiled step of each shape it ran compiled
(`JobSpec.compiled_shape_key`). A compiled step that works by changing the resident modules
(compiled_step.py's compiled blocks, which the denoiser's blocks call in place of their eager
forward) is installed on them for the run that uses it and uninstalled when the run hands them
back, so eager runs and sample tasks compute on the modules exactly as loaded. Everything of a
job lives on its run and goes with it:

* a run attaches adapters to the resident modules, initialised as on a freshly loaded model,
  and `release_run` parks them (zeroed, gradients dropped, frozen and disabled: the modules
  compute exactly the base model again) with gradient checkpointing turned off and eval mode
  back on. The next run of the same adapter shape re-initialises the parked adapters in place,
  drawing exactly what a fresh injection draws (lora.py); one of another shape takes them off
  and keeps them aside (one set), putting back the set kept aside when it has its shape, else
  injecting its own. They are never merged: the base weights stay bit-identical to freshly
  loaded ones;
* each run gets its own noise scheduler, built from the base model's scheduler config;
* optimizer, generators, cached embeddings and latents, images: the run's own objects.

So a job trains the same bits on a worker that trained other jobs before as on a fresh one, and
is refused the same: the key says nothing of the job's family or settings, so every run, warm or
cold, checks its family against the model's model_index.json (`detect_family`) and its settings
against the resident modules (`Family.check`: guidance, resolution, VAE), none reloaded.
A run that cannot put the modules back as they were drops the whole set (the next run loads it
again), and a run of another base model or precision drops it before loading its own: a worker
never holds two base models, whatever its memory.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import diffusers as _diffusers
import torch

from lorafleet.core.spec import adapter_shape_key
from lorafleet.worker.training.base_model import detect_family, load_components
from lorafleet.worker.training.config import Runtime, TrainingConfig
from lorafleet.worker.training.families.base import Components
from lorafleet.worker.training.lora import park_lora, parked_shapes

diffusers: Any = _diffusers


@runtime_checkable
class InstalledStep(Protocol):
    """A compiled step that lives on the resident modules while a run uses it."""

    def install(self) -> None: ...

    def uninstall(self) -> None: ...


@dataclass
class _Held:
    key: str
    components: Components
    # The compiled step of each shape compiled on these modules.
    compiled: dict[str, Callable[..., Any]]
    # The shape whose InstalledStep is on the modules now (a compiled run is using it).
    installed: str | None = None


class ResidentModel:
    """One worker's resident base model (see the module docstring). Not thread-safe: used
    from the worker's one training thread. `key` and `compiled_shapes` may be read from any
    thread (what the worker announces in Ready)."""

    def __init__(self) -> None:
        self._held: _Held | None = None
        # Base-model loads so far (tests and metrics: a warm run adds none).
        self.loads = 0
        self._adapter_shapes: tuple[str, ...] = ()

    @property
    def key(self) -> str | None:
        """The resident base model's `JobSpec.resident_key`; None when none is loaded."""
        held = self._held
        return held.key if held is not None else None

    @property
    def compiled_shapes(self) -> tuple[str, ...]:
        held = self._held
        return tuple(sorted(held.compiled)) if held is not None else ()

    @property
    def adapter_shapes(self) -> tuple[str, ...]:
        """The `JobSpec.adapter_shape_key`s the parked adapters serve, as of the last run's end
        (what the worker announces in Ready)."""
        return self._adapter_shapes

    def components_for(self, config: TrainingConfig, runtime: Runtime) -> Components:
        """The frozen components for `config`'s base model and precision, loaded now unless
        they are resident, once the job's family and settings are checked against them (input
        faults; a refused job leaves the resident set as it was). The noise scheduler is the
        run's own (a fresh one each call)."""
        # Before loading: a job of the wrong family is refused at once, and drops nothing.
        family = detect_family(config)
        key = config.spec.resident_key
        if self._held is None or self._held.key != key:
            self.release()
            self._held = _Held(
                key=key, components=load_components(config, runtime, family), compiled={}
            )
            self.loads += 1
        components = self._held.components
        family.check(config, components)
        # A family whose frozen encoders wait in host memory between prompt encodings (base.py)
        # gets them back on the device for this run's encoding (or sampling).
        for encoder in components.text_encoders.values():
            if encoder.device != runtime.device:
                encoder.to(runtime.device)
        scheduler = components.noise_scheduler
        return dataclasses.replace(
            components, noise_scheduler=type(scheduler).from_config(scheduler.config)
        )

    def compiled(
        self, shape_key: str, build: Callable[[], Callable[..., Any]]
    ) -> Callable[..., Any]:
        """The compiled step kept for `shape_key`, made by `build()` the first time; an
        `InstalledStep` is installed on the modules until `release_run`."""
        held = self._held
        assert held is not None, "components_for comes first"
        step = held.compiled.get(shape_key)
        if step is None:
            step = held.compiled[shape_key] = build()
        if isinstance(step, InstalledStep) and held.installed != shape_key:
            self._uninstall()
            step.install()
            held.installed = shape_key
        return step

    def is_compiled(self, shape_key: str) -> bool:
        return self._held is not None and shape_key in self._held.compiled

    def forget_compiled(self, shape_key: str) -> None:
        """A compiled step that misbehaved is not kept (nor announced), nor left installed."""
        if self._held is not None:
            if self._held.installed == shape_key:
                self._uninstall()
            self._held.compiled.pop(shape_key, None)

    def _uninstall(self) -> None:
        held = self._held
        if held is not None and held.installed is not None:
            step = held.compiled[held.installed]
            assert isinstance(step, InstalledStep)
            step.uninstall()
            held.installed = None

    def release_run(self, components: Components) -> None:
        """Puts the resident modules back to computing what they computed as loaded, after a
        run or a sample task: adapters parked (`park_lora`), gradient checkpointing off, eval
        mode, the compiled step uninstalled. Drops the whole set if that fails."""
        if self._held is None or components.denoiser is not self._held.components.denoiser:
            return
        try:
            self._uninstall()
            # Checkpointing first: turning it off on an encoder that still has its adapter also
            # removes the input-grad hook transformers added for it.
            if components.denoiser.is_gradient_checkpointing:
                components.denoiser.disable_gradient_checkpointing()
            for encoder in components.text_encoders.values():
                if getattr(encoder, "is_activation_checkpointing", False):
                    encoder.activation_checkpointing_disable()
            park_lora(components)
            for module in (*components.modules.values(), components.vae):
                module.eval()
            key = self._held.key
            self._adapter_shapes = tuple(
                adapter_shape_key(
                    key, rank=rank, alpha=alpha, train_text_encoder=te, use_dora=dora, dropout=p
                )
                for rank, alpha, te, dora, p in parked_shapes(components)
            )
        except Exception:
            self.release()
            raise

    def release(self) -> None:
        """Drops the resident set and its compiled steps, and gives their memory back."""
        if self._held is None:
            return
        self._uninstall()
        self._held = None
        self._adapter_shapes = ()
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()
