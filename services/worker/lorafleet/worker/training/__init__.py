"""SDXL DreamBooth-LoRA training, in the caller's process, with checkpoints that stay in memory.

Built from diffusers components (UNet2DConditionModel, AutoencoderKL, CLIPTextModel +
CLIPTextModelWithProjection with their CLIPTokenizers, a DDPMScheduler from the base model's
scheduler config), peft LoRA, and torch.amp for mixed precision (autocast, and loss scaling for
fp16). No subprocess, no script, no process-wide training state.

The interface the worker agent uses::

    from lorafleet.worker.training import (
        Trainer, TrainingConfig, TrainingHooks, TrainingImage, Finished, Stopped,
        TrainingFailure, classify_exception, serialize_checkpoint, load_checkpoint,
    )

    config = TrainingConfig(spec=job_spec, model_path="/models/sdxl-base")  # + device, dtypes
    trainer = Trainer(config)
    outcome = await asyncio.to_thread(
        trainer.run,
        instance_images=[TrainingImage(name, data, caption), ...],  # images_from_files() pairs
        class_images=[...],                # supplied or previously generated; may be empty
        resume=load_checkpoint(blob),      # or None; raises CorruptCheckpoint if bad
        hooks=TrainingHooks(
            on_progress=lambda step, loss, lr, s_per_step: ...,   # latest value wins
            should_stop=lambda: None | "cancel" | "drain",       # polled between steps
            on_checkpoint=lambda snapshot: ...,    # serialize_checkpoint(snapshot) elsewhere
            on_class_images=lambda [(index, png)]: ...,
        ),
    )
    # Finished(step, loss, lora_weights: bytes of pytorch_lora_weights.safetensors)
    # Stopped(step, reason, snapshot: TrainingSnapshot | None)  -- snapshot for a drain

* `TrainingConfig` (config.py): frozen, keyword-only; the `JobSpec` plus this machine's
  settings (model directory or hub `cache_dir`, device, frozen-weight dtype, sampling options).
* `TrainingImage(name, data, caption)` (data.py): input bytes. Every unusable image (unreadable,
  unsupported format, shorter side under max(64, resolution // 4) px, over 64 MP) is named in
  one input-fault `TrainingFailure`.
* `Trainer.run` (loop.py) blocks; call it from a worker thread. Hook semantics are documented
  on `TrainingHooks` (interface.py). Every error leaves as `TrainingFailure` with a
  `failure_class` (the core's `FailureClass`: NODE, INPUT or INTERNAL; failures.py;
  `classify_exception` classifies any exception).
* Checkpoints (checkpoint.py): at each `checkpointing_steps` multiple the training thread only
  copies tensors to host memory (`TrainingSnapshot`); `serialize_checkpoint` turns a snapshot
  into one verified blob (safetensors + JSON, nothing pickled) on any thread, and
  `load_checkpoint` reverses it. Resuming continues at step + 1 and, on the same kind of
  device, produces bit-identical LoRA weights to an uninterrupted run.
* A resumed run checks the checkpoint's fingerprint (weight-relevant spec fields, instance
  images and captions, class-image digests) and raises `CorruptCheckpoint` when it was taken
  for other settings or data, so the caller can fall back to an older one. Class images are
  ordered by content digest: pass back the generated ones under any names.
* `Trainer.timings` (`RunTimings`) holds per-step and per-snapshot wall times; the phases are
  OpenTelemetry spans (`training.load_model`, `.class_images`, `.precompute`, `.restore`,
  `.steps`, `.snapshot`) under the caller's current span.
* Nothing is written to local disk by a run (model files are only read; a hub id is downloaded
  into `cache_dir` by `from_pretrained` when no local directory is configured).

The modules, one role each:

* The run: `loop.py` (`Trainer`; `_Run`, one run's state, its setup phases and its steps),
  `interface.py` (what the caller hands in and gets back: hooks, outcomes, timings),
  `config.py` (`TrainingConfig`, the runtime it resolves to), `failures.py` (failure classes).
* What a run calls on: `compiled_step.py` (whether this run compiles and the compiled step),
  `compiling.py` (the compile policy from the node's measured costs; the compile cache),
  `optimization.py` (optimizer, LR schedule, loss scaling, applying gradients),
  `objective.py` (the diffusion objective as tensor functions), `rng.py` (the run's own
  torch stream), `data.py` (decoded images, crops and flips, the data order).
* The model: `base_model.py` (loading a base model), `families/` (what differs between
  architectures), `lora.py` (adapters and the result files), `resident.py` (the base model and
  compiled steps a worker keeps between runs).
* Checkpoints: `snapshots.py` (a run's state as a `TrainingSnapshot` and back; the job
  fingerprint), `checkpoint.py` (host copies and the one-blob format), `serialization.py`
  (reproducible in-memory safetensors).
* Images made by the base model: `class_images.py` (prior-preservation class images, during a run),
  `samples.py` (validation images, made by sample tasks from checkpoints and results).
"""

from lorafleet.worker.training.checkpoint import (
    TrainingSnapshot,
    checkpoint_sha256,
    load_checkpoint,
    serialize_checkpoint,
)
from lorafleet.worker.training.config import TrainingConfig
from lorafleet.worker.training.data import TrainingImage, images_from_files, min_image_side
from lorafleet.worker.training.failures import (
    CorruptCheckpoint,
    TrainingFailure,
    classify_exception,
)
from lorafleet.worker.training.interface import (
    Finished,
    RunTimings,
    Stopped,
    StopReason,
    TrainingHooks,
    TrainingOutcome,
)
from lorafleet.worker.training.loop import Trainer
from lorafleet.worker.training.lora import KOHYA_WEIGHT_NAME, LORA_WEIGHT_NAME

__all__ = [
    "KOHYA_WEIGHT_NAME",
    "LORA_WEIGHT_NAME",
    "CorruptCheckpoint",
    "Finished",
    "RunTimings",
    "StopReason",
    "Stopped",
    "Trainer",
    "TrainingConfig",
    "TrainingFailure",
    "TrainingHooks",
    "TrainingImage",
    "TrainingOutcome",
    "TrainingSnapshot",
    "checkpoint_sha256",
    "classify_exception",
    "images_from_files",
    "load_checkpoint",
    "min_image_side",
    "serialize_checkpoint",
]
