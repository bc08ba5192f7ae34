"""Validation images of a job's LoRA at one step, made by a sample task.

A sample task brings the job's spec (base model, VAE, LoRA shape), the weights at one step (a
lorafleet checkpoint or the result safetensors) and explicit settings (prompts, negative prompt,
guidance, denoising steps, seed, size, images per prompt). `SamplePipelines` makes them on the
worker's resident base model, shared with its training runs: a task only attaches the job's
adapters, so a worker pays the load once per base model, not once per task or lease.

Images are seeded per image index (`seed + image_index`, CPU generators, independent of the
device and of the prompt), so the images of step N are the same whichever worker makes them,
and a column of the same index across steps differs only by the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import safetensors.torch
import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from lorafleet.core.model import SampleSettings
from lorafleet.worker.training.checkpoint import load_checkpoint
from lorafleet.worker.training.class_images import png_bytes
from lorafleet.worker.training.config import Runtime, TrainingConfig, resolve_runtime
from lorafleet.worker.training.failures import CorruptCheckpoint, input_fault
from lorafleet.worker.training.families.base import Components
from lorafleet.worker.training.lora import add_lora
from lorafleet.worker.training.resident import ResidentModel


class SamplesStopped(Exception):
    """`should_stop` said so between two images (the task was revoked or the worker drains)."""


class SamplePipelines:
    """Sample tasks on the worker's resident base model (resident.py), one at a time (they run
    on the worker's training thread): each attaches the job's adapters, makes its images and
    takes them off again, so a task for a resident base model loads nothing. `loads` counts
    base-model loads."""

    def __init__(self, resident: ResidentModel | None = None) -> None:
        self._resident = resident if resident is not None else ResidentModel()
        self._lock = threading.Lock()

    @property
    def loads(self) -> int:
        return self._resident.loads

    def make(
        self,
        config: TrainingConfig,
        *,
        settings: SampleSettings,
        weights: bytes,
        weights_is_checkpoint: bool,
        should_stop: Callable[[], bool] = lambda: False,
        on_image: Callable[[int, int, bytes], None] | None = None,
    ) -> list[tuple[int, int, bytes]]:
        """(prompt index, image index, PNG) of every image the settings ask for, prompts first.

        Raises `SamplesStopped` when `should_stop()` says so between images, and an input fault
        when the weights do not fit the job's LoRA shape."""
        spec = config.spec
        with self._lock:
            runtime = resolve_runtime(config)
            components = self._resident.components_for(config, runtime)
            try:
                # The adapters' initial values are overwritten by the weights: drawn from a
                # forked stream, never the process's.
                with torch.random.fork_rng(devices=[], device_type="cpu"):
                    trained = add_lora(
                        components,
                        rank=spec.lora_rank,
                        alpha=spec.lora_alpha,
                        train_text_encoder=spec.train_text_encoder,
                        use_dora=spec.use_dora,
                    )
                for module in trained.values():
                    module.requires_grad_(False)
                _set_weights(components, trained, weights, weights_is_checkpoint)
                return _images(
                    components, runtime, settings, should_stop=should_stop, on_image=on_image
                )
            finally:
                self._resident.release_run(components)

    def release(self) -> None:
        """Drops the resident model (tests)."""
        with self._lock:
            self._resident.release()


def _images(
    components: Components,
    runtime: Runtime,
    settings: SampleSettings,
    *,
    should_stop: Callable[[], bool],
    on_image: Callable[[int, int, bytes], None] | None,
) -> list[tuple[int, int, bytes]]:
    family = components.family
    pipeline = family.sampling_pipeline(components)
    arguments = family.sample_arguments(
        negative_prompt=settings.negative_prompt, guidance_scale=settings.guidance_scale
    )
    out: list[tuple[int, int, bytes]] = []
    for module in components.modules.values():
        module.eval()
    # Validation images mid-run: a family's frozen encoders may wait in host memory (loop.py's
    # precompute); the pipeline runs every module on one device. They go back afterwards.
    parked = {
        name: encoder.device
        for name, encoder in components.text_encoders.items()
        if encoder.device != runtime.device
    }
    for name in parked:
        components.text_encoders[name].to(runtime.device)
    try:
        _each_image(pipeline, arguments, runtime, settings, should_stop, on_image, out)
    finally:
        for name, device in parked.items():
            components.text_encoders[name].to(device)
    return out


def _each_image(
    pipeline: Any,
    arguments: dict[str, Any],
    runtime: Runtime,
    settings: SampleSettings,
    should_stop: Callable[[], bool],
    on_image: Callable[[int, int, bytes], None] | None,
    out: list[tuple[int, int, bytes]],
) -> None:
    devices = [runtime.device.index or 0] if runtime.is_cuda else []
    with torch.random.fork_rng(devices=devices, device_type=runtime.device.type):
        for prompt_index, prompt in enumerate(settings.prompts):
            for image_index in range(settings.images_per_prompt):
                if should_stop():
                    raise SamplesStopped("stopped between images")
                generator = torch.Generator("cpu").manual_seed(settings.seed + image_index)
                with torch.no_grad():
                    image = pipeline(
                        prompt=prompt,
                        height=settings.resolution,
                        width=settings.resolution,
                        num_inference_steps=settings.inference_steps,
                        generator=generator,
                        **arguments,
                    ).images[0]
                data = png_bytes(image)
                out.append((prompt_index, image_index, data))
                if on_image is not None:
                    on_image(prompt_index, image_index, data)


def _set_weights(
    components: Components, trained: Mapping[str, Any], weights: bytes, is_checkpoint: bool
) -> None:
    if is_checkpoint:
        try:
            tensors = load_checkpoint(weights).tensors
        except CorruptCheckpoint as exc:
            raise input_fault(f"weights: {exc}") from exc
        for name, module in trained.items():
            for param_name, param in _adapter_parameters(module):
                tensor = tensors.get(f"lora/{name}/{param_name}")
                if tensor is None or tensor.shape != param.shape:
                    raise input_fault(
                        f"weights: the checkpoint does not fit the job's LoRA ({name}/{param_name})"
                    )
                with torch.no_grad():
                    param.copy_(tensor.to(param.device, param.dtype))
        return
    try:
        state = safetensors.torch.load(weights)
    except Exception as exc:
        raise input_fault(f"weights: not a safetensors file: {exc}") from exc
    for name, module in trained.items():
        prefix = f"{name}."
        ours = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        # What each peft key becomes in the result (the family's layout, applied to tagged
        # placeholders), read backwards.
        current = get_peft_model_state_dict(module, save_embedding_layers=False)
        peft_keys = list(current)
        tagged = {k: torch.tensor([i]) for i, k in enumerate(peft_keys)}
        by_diffusers = {
            key.removeprefix(prefix): peft_keys[int(tag[0])]
            for key, tag in components.family.diffusers_state_dict({name: tagged}).items()
        }
        if set(ours) != set(by_diffusers) or any(
            v.shape != current[by_diffusers[k]].shape for k, v in ours.items()
        ):
            raise input_fault(f"weights: the result does not fit the job's LoRA ({name})")
        set_peft_model_state_dict(module, {by_diffusers[k]: v for k, v in ours.items()})


def _adapter_parameters(module: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters by the names a checkpoint stores them under (the trainer's
    `lora_parameters`, taken while they were trainable: LoRA A/B and DoRA magnitudes)."""
    names = ("lora_A", "lora_B", "lora_magnitude_vector")
    return [(n, p) for n, p in module.named_parameters() if any(f".{x}." in n for x in names)]
