"""The training run: `Trainer.run`, its hooks and its two outcomes.

A run is a sequence of small steps over one `TrainingConfig`: resolve the runtime, decode the
inputs, load the model, generate missing class images, add LoRA, precompute what does not
change (text embeddings when the encoders are frozen, VAE latents when no augmentation is
random), build the optimizer and LR schedule, restore a checkpoint if given, then train.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers.optimization import get_scheduler
from opentelemetry import trace

from lorafleet.core.model import FailureClass
from lorafleet.core.spec import JobSpec
from lorafleet.worker.training.base_model import install_output_hooks
from lorafleet.worker.training.checkpoint import (
    DeviceSnapshotter,
    HostTensors,
    TrainingSnapshot,
    join_tensors,
    split_tensors,
    to_host,
)
from lorafleet.worker.training.compiling import CompileCosts, decide, use_cache_dir
from lorafleet.worker.training.config import TrainingConfig, resolve_runtime
from lorafleet.worker.training.data import (
    DataOrder,
    Example,
    PreparedImage,
    TrainingData,
    TrainingImage,
    prepare_images,
)
from lorafleet.worker.training.failures import (
    CorruptCheckpoint,
    TrainingFailure,
    as_training_failure,
    input_fault,
)
from lorafleet.worker.training.lora import (
    add_lora,
    kohya_weights_bytes,
    lora_parameters,
    lora_weights_bytes,
    skip_input_casts,
)
from lorafleet.worker.training.resident import ResidentModel
from lorafleet.worker.training.rng import TorchRngStream
from lorafleet.worker.training.sampling import generate_class_images

_tracer = trace.get_tracer("lorafleet.worker.training")
log = logging.getLogger(__name__)

StopReason = Literal["cancel", "drain"]
ProgressHook = Callable[[int, float, float, float], None]

# Latents are encoded up front in chunks of this many images.
_ENCODE_CHUNK = 4
# Runs in one process take turns. Trainers share no state, but diffusers and transformers patch
# torch process-wide while they build a model (accelerate's init_empty_weights, the default
# dtype), and a run swaps its own stream into torch's default generator while it initialises
# LoRA and steps (rng.py): two runs at once would corrupt each other's modules or numbers.
_ONE_RUN_AT_A_TIME = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class TrainingHooks:
    """Callbacks from the training thread. Each must return quickly (hand work to another
    thread); an exception raised by one ends the run.

    * `on_progress(step, loss, learning_rate, seconds_per_step)`: after an optimizer step,
      at most every `progress_interval_s`, and after the last (seconds_per_step is the mean
      since the previous report). Latest value wins.
    * `should_stop()`: polled before every optimizer step and between accumulation micro-steps
      (and between class-image batches). Return "cancel" to stop at once (no snapshot) or
      "drain" to stop at the next step boundary with a snapshot; None to go on.
    * `on_checkpoint(snapshot)`: at every multiple of `checkpointing_steps` below
      `max_train_steps` (the result supersedes a final checkpoint). Serialise and upload it
      elsewhere; the snapshot is already independent of the run.
    * `on_class_images([(index, png), ...])`: prior-preservation images generated because fewer
      than `num_class_images` were supplied, per batch as they are made. Store them before any
      checkpoint is committed and pass them back as `class_images` when resuming: a checkpoint
      is only valid with the class images it was trained with.
    * `on_notice(message)`: something the job's owner should read on its timeline (whether
      the step was compiled and why, a compiled run falling back to eager).
    * `on_phase(name)`: the run enters a setup phase before its first step (`decode_images`,
      `load_model`, `class_images`, `adapters`, `compile_choice`, `precompute`, `optimizer`,
      `restore`). `should_stop` is polled at each: a cancel or a drain asked for while the run
      prepares ends it there (no snapshot: nothing was trained).
    * `checkpoint_every()`: the checkpoint interval in steps, read after each optimizer step
      (the worker re-derives an automatic interval from the node's own pace); None: the spec's
      `checkpointing_steps`.

    Validation images are not made here: the training thread never stops for them. They are
    sample tasks on the fleet (`lorafleet.worker.training.samples`), made from the
    checkpoints and the result.
    """

    on_progress: ProgressHook | None = None
    should_stop: Callable[[], StopReason | None] | None = None
    on_checkpoint: Callable[[TrainingSnapshot], None] | None = None
    on_class_images: Callable[[list[tuple[int, bytes]]], None] | None = None
    on_notice: Callable[[str], None] | None = None
    on_phase: Callable[[str], None] | None = None
    checkpoint_every: Callable[[], int] | None = None


@dataclass(frozen=True, kw_only=True)
class Finished:
    """All `max_train_steps` done. `lora_weights` is `pytorch_lora_weights.safetensors`;
    `kohya_weights` is `pytorch_lora_weights_kohya.safetensors` when the job's output_format
    asks for it (kohya or both), else None."""

    step: int
    loss: float
    lora_weights: bytes = field(repr=False)
    kohya_weights: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, kw_only=True)
class Stopped:
    """`should_stop` asked to stop after `step` optimizer steps.

    `snapshot` is the state at `step` for a drain when this run made progress (at least one
    optimizer step since it started or resumed), else None.
    """

    step: int
    reason: StopReason
    snapshot: TrainingSnapshot | None


TrainingOutcome = Finished | Stopped


@dataclass
class RunTimings:
    """Wall-clock seconds per optimizer step and per checkpoint snapshot, for metrics; the
    run's setup before its first step by phase; and when its first step ended (Unix time)."""

    step_seconds: list[float] = field(default_factory=list)
    snapshot_seconds: list[float] = field(default_factory=list)
    setup_seconds: dict[str, float] = field(default_factory=dict)
    first_step_done_at: float | None = None

    @contextlib.contextmanager
    def setup_phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.setup_seconds[name] = self.setup_seconds.get(name, 0.0) + elapsed


class NonFinite(TrainingFailure):
    """The loss or the LoRA weights became NaN or Inf (a node fault)."""


class _Cancelled(Exception):
    """Unwinds a run from inside a step when `should_stop` says "cancel"."""


class Trainer:
    """Trains one job in the calling thread. Single-use: one `run` per instance.

    A run keeps its state on its instance (no process-wide singletons: precision, loss
    scaling and accumulation are the run's own), so any number of Trainers may exist in one
    process, with any settings. Their runs take turns: a `run` called while another is
    running waits for it to end (see `_ONE_RUN_AT_A_TIME`).

    `resident` is the worker's resident base model (resident.py): the run takes the frozen
    components (and a compiled step) from it and hands them back as they were. Without one
    the run loads its own and drops them at its end.
    """

    def __init__(self, config: TrainingConfig, resident: ResidentModel | None = None) -> None:
        self.config = config
        self.timings = RunTimings()
        self._ran = False
        self._resident = resident
        # Whether the run compiled its step, and whether it fell back to eager.
        self.compiled = False
        self.fell_back_to_eager = False

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        """Blocks until the job finishes or is stopped. Every error leaves as a
        `TrainingFailure` (with the original as its cause) whose class the ledger acts on."""
        if self._ran:
            raise RuntimeError("a Trainer runs once; make a new one for another run")
        if self.config.spec.checkpointing_steps < 1:
            # 0 is "auto", which the scheduler resolves into the grant's spec.
            raise ValueError("checkpointing_steps auto reached the trainer unresolved")
        self._ran = True
        resident = self._resident or ResidentModel()
        run = _Run(self.config, hooks or TrainingHooks(), self.timings, resident)
        with _ONE_RUN_AT_A_TIME:
            try:
                return run.execute(instance_images, class_images, resume)
            except TrainingFailure:
                raise
            except Exception as exc:
                raise as_training_failure(exc) from exc
            finally:
                self.compiled = run.compiled
                self.fell_back_to_eager = run.fell_back_to_eager
                run.hand_back()
                if self._resident is None:
                    resident.release()


def job_fingerprint(
    spec: JobSpec, instance: Sequence[PreparedImage], class_images: Sequence[PreparedImage]
) -> str:
    """Identifies what a checkpoint was trained on: weight-relevant spec fields and data."""
    data = {
        # The fields that train, as declared in core/spec.py (a pinned test guards the set).
        "spec": spec.fingerprint_values(),
        "instance": [[i.name, i.sha256, i.caption] for i in instance],
        "class": [i.sha256 for i in class_images],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


_AUTOCAST_DTYPES = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _enable_activation_checkpointing(encoder: Any) -> None:
    # Non-reentrant checkpointing works with frozen inputs (only LoRA weights need grads).
    kwargs = {"use_reentrant": False}
    if hasattr(encoder, "activation_checkpointing_enable"):  # transformers >= 5.x
        encoder.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class _Run:
    """The mutable state of one run. Methods are the named steps of training."""

    def __init__(
        self,
        config: TrainingConfig,
        hooks: TrainingHooks,
        timings: RunTimings,
        resident: ResidentModel,
    ) -> None:
        self.config = config
        self.spec = config.spec
        self.hooks = hooks
        self.timings = timings
        self.resident = resident
        self.compiled = False
        self.compiled_cold = False
        self.fell_back_to_eager = False
        # The newest state known finite: where a compiled run that turns non-finite goes on
        # from, eager.
        self.last_good: TrainingSnapshot | None = None
        self.snapshot_plan: _SnapshotPlan | None = None
        self.pending_stop: StopReason | None = None
        self.step = 0
        self.start_step = 0
        self.last_loss = float("nan")

    # Orchestration -----------------------------------------------------------------------

    def execute(
        self,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage],
        resume: TrainingSnapshot | None,
    ) -> TrainingOutcome:
        try:
            return self.prepare_and_train(instance_images, class_images, resume)
        except _Cancelled:
            return self.stopped()

    @contextlib.contextmanager
    def setup_phase(self, name: str) -> Iterator[None]:
        """A setup phase: named to the caller, a stop asked for before it honoured (unwinding
        to `execute`), timed."""
        if self.hooks.on_phase is not None:
            self.hooks.on_phase(name)
        self.poll()
        if self.pending_stop is not None:
            raise _Cancelled
        with self.timings.setup_phase(name):
            yield

    def prepare_and_train(
        self,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage],
        resume: TrainingSnapshot | None,
    ) -> TrainingOutcome:
        spec = self.spec
        phase = self.setup_phase
        self.step = self.start_step = resume.step if resume is not None else 0
        self.runtime = resolve_runtime(self.config)
        bucketing = spec.aspect_ratio_bucketing
        with phase("decode_images"):
            instance = prepare_images(
                instance_images, resolution=spec.resolution, kind="instance", bucketing=bucketing
            )
            if not instance:
                raise input_fault(
                    "no instance images: upload at least one under instance_data_prefix"
                )
            supplied_class = (
                prepare_images(
                    class_images, resolution=spec.resolution, kind="class", bucketing=bucketing
                )
                if spec.with_prior_preservation
                else []
            )
        with (
            _tracer.start_as_current_span(
                "training.load_model", attributes={"lorafleet.core.model": self.config.model_ref}
            ),
            phase("load_model"),
        ):
            self.components = self.resident.components_for(self.config, self.runtime)
        with _tracer.start_as_current_span("training.class_images"), phase("class_images"):
            prepared_class = self.class_images(supplied_class)
        if prepared_class is None:
            return self.stopped()
        if resume is not None and resume.state.get("fingerprint") != job_fingerprint(
            spec, instance, prepared_class
        ):
            raise CorruptCheckpoint(
                f"checkpoint at step {resume.step} was trained with other settings or data"
            )
        self.fingerprint = job_fingerprint(spec, instance, prepared_class)
        self.data = TrainingData.build(
            instance=instance,
            class_images=prepared_class,
            instance_prompt=spec.instance_prompt,
            class_prompt=spec.class_prompt,
            use_captions=spec.caption_mode == "file_else_prompt",
            resolution=spec.resolution,
            center_crop=spec.center_crop,
            random_flip=spec.random_flip,
            repeats=spec.repeats,
            bucketing=bucketing,
        )
        # Torch ops that take no generator (LoRA initialisation, dropout) draw from the run's
        # own stream, never from the process's generators (rng.py).
        self.torch_rng = TorchRngStream(spec.seed, self.runtime.device)
        with self.torch_rng.active(), phase("adapters"):
            self.trained = add_lora(
                self.components,
                rank=spec.lora_rank,
                alpha=spec.lora_alpha,
                train_text_encoder=spec.train_text_encoder,
                use_dora=spec.use_dora,
                dropout=spec.lora_dropout,
            )
            self.enable_training_mode()
        self.family = self.components.family
        self.forward_loss: Callable[..., torch.Tensor] = (
            self._loss_from_token_ids if spec.train_text_encoder else self._forward_loss
        )
        self.eager_forward_loss = self.forward_loss
        self.denoiser_forward: Callable[..., Any] = self.components.denoiser
        with phase("compile_choice"):
            if self.should_compile(resume):
                self.compile_step()
        with _tracer.start_as_current_span("training.precompute") as span, phase("precompute"):
            self.precompute_conditioning()
            self.precompute_latents()
            span.set_attribute(
                "lorafleet.latents_cached",
                self.latent_moments is not None or self.latent_list is not None,
            )
            span.set_attribute("lorafleet.embeddings_cached", self.prompt_embeds is not None)
        with phase("optimizer"):
            self.build_optimization()
        if resume is not None:
            with (
                _tracer.start_as_current_span(
                    "training.restore", attributes={"lorafleet.step": resume.step}
                ),
                phase("restore"),
            ):
                self.restore(resume)
        self.start_step = self.step
        with _tracer.start_as_current_span(
            "training.steps", attributes={"lorafleet.start_step": self.start_step}
        ) as span:
            try:
                outcome: TrainingOutcome = self.train()
            except _Cancelled:
                outcome = self.stopped()
            span.set_attribute("lorafleet.end_step", self.step)
            return outcome

    def hand_back(self) -> None:
        """The resident modules go back as they were loaded; the run's measurements are kept."""
        components = getattr(self, "components", None)
        if components is None:
            return
        try:
            self.resident.release_run(components)
        except Exception:
            log.exception("the base model could not be restored after a run; dropped")
        steps = self.timings.step_seconds
        if self.config.compile_cache_dir is not None and not self.fell_back_to_eager:
            CompileCosts(Path(self.config.compile_cache_dir)).record_run(
                self.spec.compiled_shape_key, steps, compiled=self.compiled, cold=self.compiled_cold
            )

    def notice(self, message: str) -> None:
        if self.hooks.on_notice is not None:
            self.hooks.on_notice(message)

    # Compiling ------------------------------------------------------------------------------------

    def should_compile(self, resume: TrainingSnapshot | None) -> bool:
        """The run's choice (compiling.py), said on the job's timeline unless it is fixed."""
        choice = self.config.compile_choice
        if choice == "off":
            return False
        shape = self.spec.compiled_shape_key
        cache = self.config.compile_cache_dir
        costs = CompileCosts(Path(cache) if cache is not None else None).get(shape)
        start = resume.step if resume is not None else 0
        decision = decide(
            choice,
            costs,
            remaining_steps=self.spec.max_train_steps - start,
            warm=self.resident.is_compiled(shape),
        )
        if choice == "auto":
            self.notice(decision.reason)
        return decision.compile

    def compile_step(self) -> None:
        """Compiled on the first step (the warm-up: `timings.step_seconds[0]`), or taken from the
        resident model when a run of this shape compiled it before. Noise, timesteps and
        latents are drawn outside, LoRA dropout masks inside, all from the run's generators;
        the modules stay the same objects: LoRA weights, checkpoints and the result are
        unchanged. The compiled code takes the modules as inputs (dynamo guards their types,
        not their identity), so fresh adapters on the resident model reuse it. What is
        compiled is what measured fastest (docs/BENCHMARKS.md, "Trainer")."""
        if self.config.compile_cache_dir is not None:
            use_cache_dir(Path(self.config.compile_cache_dir))
        shape = self.spec.compiled_shape_key
        self.compiled_cold = not self.resident.is_compiled(shape)
        self.compiled = True
        if self.spec.train_text_encoder:
            # One graph from the prompt's token ids to the loss, so one backward graph through
            # the encoders and the UNet (-10% a step against compiling each model);
            install_output_hooks(list(self.components.text_encoders.values()))
            # dynamo checks its guards on the models' thousands of module attributes by one
            # dict-version tag per unchanged module, not one by one, every step (set while
            # compiling, when the guards are built; not process-wide).
            step = self.resident.compiled(
                shape,
                lambda: torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True)(
                    torch.compile(_Run._loss_from_token_ids)
                ),
            )
            self.forward_loss = functools.partial(step, self)
        else:
            # with the embeddings cached, the denoiser alone (for SDXL the whole loss as one
            # graph was 15% slower a step).
            self.denoiser_forward = self.resident.compiled(
                shape, lambda: torch.compile(self.components.denoiser)
            )

    def fall_back_to_eager(self, failure: TrainingFailure) -> None:
        """A compiled run turned non-finite: the rest of the lease runs eager from the last
        finite state, and the compiled step is not kept. Once: a non-finite eager run is the
        node's fault."""
        assert self.last_good is not None
        self.resident.forget_compiled(self.spec.compiled_shape_key)
        self.forward_loss = self.eager_forward_loss
        self.denoiser_forward = self.components.denoiser
        self.compiled = False
        self.fell_back_to_eager = True
        self.restore(self.last_good)
        self.notice(
            f"{failure}; the compiled step is dropped on this node and training goes on eager"
            f" from step {self.last_good.step}"
        )

    def stopped(self) -> Stopped:
        reason = self.pending_stop or "cancel"
        snapshot = self.snapshot() if reason == "drain" and self.step > self.start_step else None
        return Stopped(step=self.step, reason=reason, snapshot=snapshot)

    def poll(self) -> None:
        """Asks the caller whether to stop; a cancel unwinds at once, a drain is remembered."""
        if self.hooks.should_stop is None or self.pending_stop == "cancel":
            return
        reason = self.hooks.should_stop()
        if reason is None:
            return
        if reason not in ("cancel", "drain"):
            raise ValueError(f"should_stop returned {reason!r}; expected 'cancel', 'drain' or None")
        if reason == "cancel":
            self.pending_stop = "cancel"
            raise _Cancelled
        self.pending_stop = self.pending_stop or reason

    def _cancel_requested(self) -> bool:
        try:
            self.poll()
        except _Cancelled:
            return True
        return self.pending_stop is not None

    # Setup ----------------------------------------------------------------------------------

    def class_images(self, supplied: list[PreparedImage]) -> list[PreparedImage] | None:
        """The class images to train with: the supplied ones, topped up to `num_class_images`
        by sampling the base model. Ordered by content digest, so the order does not depend
        on names (supplied ones and generated ones coming back under storage names)."""
        spec = self.spec
        if not spec.with_prior_preservation:
            return []
        usable = supplied[: spec.num_class_images]
        missing = list(range(len(usable), spec.num_class_images))
        generated: list[tuple[int, bytes]] = []
        if missing:
            for batch in generate_class_images(
                self.components,
                prompt=spec.class_prompt,
                indices=missing,
                seed=spec.seed,
                resolution=spec.resolution,
                steps=self.config.sample_steps,
                guidance_scale=self.config.guidance_scale,
                batch_size=self.config.sample_batch_size,
                device=self.runtime.device,
                cancelled=self._cancel_requested,
            ):
                generated.extend(batch)
                if self.hooks.on_class_images is not None:
                    self.hooks.on_class_images(batch)
            if len(generated) < len(missing):
                return None
        # Decoded from the PNG bytes handed out, exactly as a resumed run will see them.
        made = prepare_images(
            [TrainingImage(f"{index}.png", png) for index, png in generated],
            resolution=spec.resolution,
            kind="class",
            bucketing=spec.aspect_ratio_bucketing,
        )
        return sorted([*usable, *made], key=lambda image: image.sha256)

    def enable_training_mode(self) -> None:
        components = self.components
        for module in self.trained.values():
            module.train()
        if self.runtime.mixed_precision != "no" and not self.spec.use_dora:
            # peft casts each LoRA layer's input to its fp32 weights, and autocast casts it
            # straight back for the matmul: a lossless round trip, two copy kernels and their
            # backward per layer, a sixth of a full-size step's launches. Skipped under
            # autocast (the result is bit-identical; DoRA's own arithmetic would see another
            # dtype, so it keeps the cast); park_lora turns the cast on again.
            skip_input_casts(self.trained.values())
        if self.spec.gradient_checkpointing:
            components.denoiser.enable_gradient_checkpointing()
            for name in components.text_encoders:
                if name in self.trained:
                    _enable_activation_checkpointing(self.trained[name])

    def precompute_conditioning(self) -> None:
        """Frozen encoders: embed every distinct prompt once (then a family whose encoders are
        large sends them to host memory until the next run needs them). Trained encoders:
        tokenize once."""
        components = self.components
        ids = self.family.tokenize(components, self.data.prompts, self.spec)
        device = self.runtime.device
        self.token_ids: tuple[torch.Tensor, ...] | None = None
        self.prompt_embeds: tuple[torch.Tensor, ...] | None = None
        if self.spec.train_text_encoder:
            self.token_ids = tuple(t.to(device) for t in ids)
            return
        with torch.no_grad():
            self.prompt_embeds = self.family.encode(components, ids)
        if self.runtime.is_cuda and not self.family.encoders_stay_on_device:
            for encoder in components.text_encoders.values():
                encoder.to("cpu")

    def precompute_latents(self) -> None:
        """Encode every image once when each has a single possible crop and no flip."""
        self.latent_moments: torch.Tensor | None = None
        self.latent_list: list[torch.Tensor] | None = None
        if not self.data.deterministic:
            return
        chunks = []
        images = range(len(self.data.images))
        if len({self.data.target(i) for i in images}) > 1:
            # Aspect-ratio buckets: one image at a time, kept per image (sizes differ).
            self.latent_list = [self.encode_moments([self.data.fixed_example(i)]) for i in images]
            return
        for start in range(0, len(images), _ENCODE_CHUNK):
            examples = [self.data.fixed_example(i) for i in images[start : start + _ENCODE_CHUNK]]
            chunks.append(self.encode_moments(examples))
        self.latent_moments = torch.cat(chunks)

    def build_optimization(self) -> None:
        spec = self.spec
        runtime = self.runtime
        self.params: list[torch.nn.Parameter] = []
        groups: list[dict[str, Any]] = []
        learning_rate = spec.learning_rate
        if spec.scale_lr:
            # As diffusers' --scale_lr: the rate per image seen, for one process.
            learning_rate *= spec.train_batch_size * spec.gradient_accumulation_steps
        for name, module in self.trained.items():
            params = [p for _, p in lora_parameters(module)]
            self.params.extend(params)
            lr = (
                learning_rate
                if name == self.family.denoiser_name
                else spec.text_encoder_learning_rate
            )
            if spec.optimizer == "prodigy":
                # Prodigy learns one step size for all groups and refuses differing rates; as in
                # diffusers' script, the text encoders train at learning_rate then.
                lr = learning_rate
            if len(groups) == 2:
                # Every text encoder trains in one group (the second joins the first's).
                groups[-1]["params"].extend(params)
            else:
                groups.append({"params": params, "lr": lr})
        optimizer_kwargs: dict[str, Any] = {
            # Also the default group rate, which the polynomial schedule decays from.
            "lr": learning_rate,
            "betas": (spec.adam_beta1, spec.adam_beta2),
            "weight_decay": spec.adam_weight_decay,
            "eps": spec.adam_epsilon,
        }
        optimizer_name = "adamw_8bit" if spec.use_8bit_adam else spec.optimizer
        optimizer: Any
        if optimizer_name == "adamw_8bit":
            import bitsandbytes

            optimizer = bitsandbytes.optim.AdamW8bit(groups, **optimizer_kwargs)
        elif optimizer_name == "prodigy":
            optimizer = _prodigy(groups, spec, optimizer_kwargs)
        else:
            # Fused AdamW (CUDA and CPU): one kernel over every tensor instead of torch's CPU
            # default, a Python loop over hundreds of small LoRA tensors (docs/BENCHMARKS.md).
            optimizer = torch.optim.AdamW(groups, fused=True, **optimizer_kwargs)
        lr_scheduler = get_scheduler(
            spec.lr_scheduler,
            optimizer=optimizer,
            num_warmup_steps=spec.lr_warmup_steps,
            num_training_steps=spec.max_train_steps,
            num_cycles=spec.lr_num_cycles,
            power=spec.lr_power,
        )
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        # Mixed precision is autocast around the forward pass (torch.amp). fp16 also needs loss
        # scaling against underflowing gradients; bf16 has fp32's range and needs none. (fp16
        # runs only on CUDA: resolve_runtime refuses it on the CPU.) Everything is already on
        # its device, and gradient accumulation is counted in optimizer_step.
        self.autocast_dtype = _AUTOCAST_DTYPES[runtime.mixed_precision]
        self.scaler = (
            torch.amp.GradScaler(runtime.device.type) if runtime.mixed_precision == "fp16" else None
        )
        device = runtime.device
        self.data_generator = torch.Generator("cpu").manual_seed(spec.seed)
        self.noise_generator = torch.Generator(device).manual_seed(spec.seed + 1)

    # Training ---------------------------------------------------------------------------------

    def train(self) -> TrainingOutcome:
        """Trains to the end or a stop. A compiled run that turns non-finite goes on eager
        from the last finite state, once (`fall_back_to_eager`)."""
        if self.compiled:
            self.last_good = self.snapshot()
        while True:
            try:
                return self.train_steps()
            except NonFinite as failure:
                if not self.compiled:
                    raise
                self.fall_back_to_eager(failure)

    def train_steps(self) -> TrainingOutcome:
        spec = self.spec
        hooks = self.hooks
        last_report = time.perf_counter()
        steps_since_report = 0
        loss = torch.tensor(self.last_loss)
        # Whether a step's loss was NaN or Inf, gathered on the device (no host sync a step) and
        # read where the run would hand weights out: at a checkpoint and at the end. With fp16's
        # loss scaling a non-finite step is skipped, not applied, so only the weights count then.
        nonfinite = torch.zeros((), dtype=torch.bool, device=self.runtime.device)
        while self.step < spec.max_train_steps:
            self.poll()
            if self.pending_stop is not None:
                return self.stopped()
            started = time.perf_counter()
            with self.torch_rng.active():
                loss = self.optimizer_step()
            if self.scaler is None:
                nonfinite |= ~torch.isfinite(loss)
            self.timings.step_seconds.append(time.perf_counter() - started)
            if self.timings.first_step_done_at is None:
                self.timings.first_step_done_at = time.time()
            steps_since_report += 1
            final = self.step == spec.max_train_steps
            now = time.perf_counter()
            if final or now - last_report >= self.config.progress_interval_s:
                # The one host sync progress needs.
                self.last_loss = float(loss.item())
                if hooks.on_progress is not None:
                    hooks.on_progress(
                        self.step,
                        self.last_loss,
                        float(self.lr_scheduler.get_last_lr()[0]),
                        (now - last_report) / steps_since_report,
                    )
                last_report = now
                steps_since_report = 0
            interval = (
                hooks.checkpoint_every()
                if hooks.checkpoint_every is not None
                else spec.checkpointing_steps
            )
            due = not final and self.step % max(1, interval) == 0
            if hooks.on_checkpoint is not None and due:
                self.check_finite(nonfinite)
                started = time.perf_counter()
                with _tracer.start_as_current_span(
                    "training.snapshot", attributes={"lorafleet.step": self.step}
                ):
                    snapshot = self.snapshot()
                self.timings.snapshot_seconds.append(time.perf_counter() - started)
                if self.compiled:
                    self.last_good = snapshot
                hooks.on_checkpoint(snapshot)
        if self.step > self.start_step:
            self.last_loss = float(loss.item())
        self.check_finite(nonfinite)
        kohya = None
        if self.spec.output_format in ("kohya", "both"):
            kohya = kohya_weights_bytes(self.family, self.trained)
        return Finished(
            step=self.step,
            loss=self.last_loss,
            lora_weights=lora_weights_bytes(self.family, self.trained),
            kohya_weights=kohya,
        )

    def check_finite(self, nonfinite_loss: torch.Tensor) -> None:
        """A NaN or Inf never becomes a checkpoint or a result: the lease ends as a node fault
        (on a sound spec it is the machine's arithmetic; a job that diverges everywhere runs
        out of `max_failures`)."""
        weights_finite = torch.stack([torch.isfinite(p).all() for p in self.params]).all()
        if bool(nonfinite_loss) or not bool(weights_finite):
            raise NonFinite(
                FailureClass.NODE,
                f"the {'loss' if bool(nonfinite_loss) else 'LoRA weights'} became non-finite"
                f" (NaN or Inf) by step {self.step}; nothing of it was kept",
            )

    def optimizer_step(self) -> torch.Tensor:
        """`gradient_accumulation_steps` micro-batches, then one optimizer step. Returns the
        mean loss as a device tensor (reading it would sync)."""
        accumulation = self.spec.gradient_accumulation_steps
        total: torch.Tensor | None = None
        for micro in range(accumulation):
            if micro:
                self.poll()
            examples = self.data.next_batch(self.spec.train_batch_size, self.data_generator)
            loss = self.micro_step(examples)
            total = loss if total is None else total + loss
        self.apply_gradients()
        self.step += 1
        assert total is not None
        return total / accumulation

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.runtime.device.type, dtype=self.autocast_dtype)

    def micro_step(self, examples: list[Example]) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients add up until apply_gradients.
        Returns the micro-batch's loss, detached."""
        latents = self.latents(examples)
        draws = self.family.draw(latents, self.noise_generator, examples, self)
        loss = self.forward_loss(latents, draws, *self.conditioning_inputs(examples))
        # The accumulated gradient is that of the mean loss over the micro-batches.
        scaled = loss / self.spec.gradient_accumulation_steps
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        torch.autograd.backward(scaled)
        return loss.detach()

    def _loss_from_token_ids(
        self,
        latents: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
        token_ids: tuple[torch.Tensor, ...],
        rows: torch.Tensor,
    ) -> torch.Tensor:
        with self.autocast():
            embeddings = self.family.encode(self.components, token_ids)
        return self._forward_loss(latents, draws, embeddings, rows)

    def _forward_loss(
        self,
        latents: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
        conditioning: tuple[torch.Tensor, ...],
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """The micro-batch's loss from its draws and prompt embeddings (with `compile_model`
        and trained encoders, compiled as one graph with the prompt encoding before it)."""
        return self.family.loss(
            self, latents, draws, tuple(c.index_select(0, rows) for c in conditioning)
        )

    @property
    def num_class(self) -> int:
        return self.data.num_class

    def apply_gradients(self) -> None:
        """Clip, step the optimizer and the LR schedule, clear the gradients."""
        scaler = self.scaler
        if scaler is None:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm, foreach=True)
            self.optimizer.step()
            stepped = True
        else:
            scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm, foreach=True)
            scale = scaler.get_scale()
            scaler.step(self.optimizer)  # skipped when the gradients hold an inf or NaN
            scaler.update()
            # update() lowers the scale exactly when it skipped the step.
            stepped = scaler.get_scale() >= scale
        if stepped:
            # The schedule counts applied updates: a skipped fp16 step does not advance it.
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def encode_moments(self, examples: list[Example]) -> torch.Tensor:
        """VAE posterior (mean, std) stacked on the channel axis."""
        vae = self.components.vae
        pixels = self.data.pixels(examples).to(self.runtime.device, vae.dtype, non_blocking=True)
        with torch.no_grad():
            posterior = vae.encode(pixels).latent_dist
        return torch.cat([posterior.mean, posterior.std], dim=1)

    def latents(self, examples: list[Example]) -> torch.Tensor:
        """Scaled latents sampled from the VAE posterior with the run's noise generator."""
        if self.latent_moments is not None:
            index = self.indices([s.image for s in examples])
            moments = self.latent_moments.index_select(0, index)
        elif self.latent_list is not None:
            moments = torch.cat([self.latent_list[s.image] for s in examples])
        else:
            moments = self.encode_moments(examples)
        return self.family.latents(moments, self.noise_generator, self.components)

    def conditioning_inputs(
        self, examples: list[Example]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """What `_forward_loss` conditions on, and the row of it for each example: the cached
        (prompt embeddings, pooled embeddings) with frozen encoders; with trained ones the token
        ids of each distinct prompt of the batch, encoded once (picked on the host: no sync)."""
        rows = [self.data.prompt_of[s.image] for s in examples]
        if self.prompt_embeds is not None:
            return self.prompt_embeds, self.indices(rows)
        assert self.token_ids is not None
        distinct = sorted(set(rows))
        picked = self.indices(distinct)
        ids = tuple(t[picked] for t in self.token_ids)
        return ids, self.indices([distinct.index(r) for r in rows])

    def indices(self, values: list[int]) -> torch.Tensor:
        """A step's few indices as a device tensor, without a host sync: from a GPU's view,
        a copy out of pageable memory waits for the stream to drain (two such copies a step
        kept the host from queueing ahead of the GPU), one out of pinned memory does not."""
        return self.to_device(torch.tensor(values, dtype=torch.long))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.runtime.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.runtime.device, non_blocking=True)

    # Checkpoints --------------------------------------------------------------------------------

    @functools.cached_property
    def _live_lora(self) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters by checkpoint key. Found once: walking a full-size UNet's
        modules at every checkpoint took most of the training thread's snapshot time."""
        return {
            f"lora/{module_name}/{name}": param
            for module_name, module in self.trained.items()
            for name, param in lora_parameters(module)
        }

    def snapshot(self) -> TrainingSnapshot:
        """Host copies of everything the run needs to continue exactly after `self.step`."""
        optimizer_state = self.optimizer.state_dict()
        plan = self.snapshot_plan
        if plan is None or not plan.holds(optimizer_state["state"]):
            plan = self.snapshot_plan = _SnapshotPlan(self._live_lora, optimizer_state["state"])
        extra: dict[str, torch.Tensor] = {
            "rng/data": self.data_generator.get_state(),
            "rng/noise": self.noise_generator.get_state(),
            "rng/torch": self.torch_rng.cpu_state,
        }
        device_key = self.torch_rng.device_key
        if device_key is not None:
            assert self.torch_rng.device_state is not None
            extra[device_key] = self.torch_rng.device_state
        tensors = plan.host_tensors(extra)
        scaler = self.scaler
        state = {
            "fingerprint": self.fingerprint,
            "loss": self.last_loss,
            "data_order": self.data.order.state(),
            "optimizer": {"param_groups": optimizer_state["param_groups"]},
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "rng": {"noise_device": self.runtime.device.type},
        }
        # A JSON round trip both deep-copies (nothing shared with the live run) and proves the
        # state is plain JSON before it leaves the training thread. The optimizer's per-tensor
        # references are the plan's, already plain JSON, and never written by anyone.
        state = json.loads(json.dumps(state))
        state["optimizer"]["state"] = plan.optimizer_references
        return TrainingSnapshot(step=self.step, tensors=tensors, state=state)

    def restore(self, snapshot: TrainingSnapshot) -> None:
        try:
            self._restore(snapshot)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            # The blob verified, so this is a checkpoint of another lorafleet version or model.
            raise CorruptCheckpoint(
                f"checkpoint at step {snapshot.step} cannot be restored:"
                f" {type(exc).__name__}: {exc}"
            ) from exc

    def _restore(self, snapshot: TrainingSnapshot) -> None:
        tensors = snapshot.tensors
        state = snapshot.state
        live = self._live_lora
        stored = {key for key in tensors if key.startswith("lora/")}
        if stored != set(live):
            raise CorruptCheckpoint(
                f"checkpoint at step {snapshot.step} holds other LoRA parameters than this model"
            )
        with torch.no_grad():
            for key, param in live.items():
                if tensors[key].shape != param.shape:
                    raise CorruptCheckpoint(f"checkpoint tensor {key} has the wrong shape")
                param.copy_(tensors[key])
        optimizer_state = {
            int(index): join_tensors(values, tensors)
            for index, values in state["optimizer"]["state"].items()
        }
        self.optimizer.load_state_dict(
            {"state": optimizer_state, "param_groups": state["optimizer"]["param_groups"]}
        )
        self.lr_scheduler.load_state_dict(dict(state["lr_scheduler"]))
        if self.scaler is not None and state["grad_scaler"] is not None:
            self.scaler.load_state_dict(state["grad_scaler"])
        order = DataOrder.from_state(state["data_order"])
        if order.size != self.data.order.size:
            raise CorruptCheckpoint("checkpoint data order is for a different dataset size")
        if order.buckets != self.data.order.buckets:
            raise CorruptCheckpoint("checkpoint data order is for other aspect-ratio buckets")
        self.data.order = order
        self.data_generator.set_state(tensors["rng/data"])
        same_device = state["rng"]["noise_device"] == self.runtime.device.type
        if same_device:
            self.noise_generator.set_state(tensors["rng/noise"])
        else:
            # CPU and CUDA generators are different algorithms: a checkpoint moved between the
            # two continues with a fresh, still deterministic, stream.
            self.noise_generator.manual_seed(self.spec.seed + 1 + snapshot.step)
        # The run's own torch stream; the process's generators are never touched. (Checkpoints
        # before it existed stored torch's global state here, which was then the same stream.)
        self.torch_rng.cpu_state = tensors["rng/torch"].clone()
        device_key = self.torch_rng.device_key
        if device_key is not None and device_key in tensors and same_device:
            self.torch_rng.device_state = tensors[device_key].clone()
        self.step = snapshot.step
        self.last_loss = float(state["loss"])


class _SnapshotPlan:
    """What a run's snapshot copies, worked out once (at its first checkpoint) and reused while
    the optimizer keeps the same state tensors, which it updates in place: the checkpoint
    keys of the LoRA weights and optimizer state, the optimizer state's JSON skeleton (tensor
    references by key), and on a GPU the `DeviceSnapshotter` of those tensors. Walking
    thousands of state tensors and round-tripping their references through JSON at every
    checkpoint was most of a full-size run's snapshot time. State that is not all tensors
    (an optimizer keeping Python numbers) gets a new plan at every snapshot."""

    def __init__(
        self, lora: Mapping[str, torch.Tensor], state: Mapping[int, Mapping[str, Any]]
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(lora)
        references = {
            str(index): split_tensors(values, f"optimizer/{index}", self.tensors)
            for index, values in state.items()
        }
        self.optimizer_references: dict[str, Any] = json.loads(json.dumps(references))
        self._state = _flat_state(state)
        on_device = {k: v for k, v in self.tensors.items() if v.device.type != "cpu"}
        self._on_host = {k: v for k, v in self.tensors.items() if v.device.type == "cpu"}
        self._device = (
            DeviceSnapshotter(on_device) if on_device and self._state is not None else None
        )

    def holds(self, state: Mapping[int, Mapping[str, Any]]) -> bool:
        """Whether the optimizer state is still the tensors this plan was made from."""
        if self._state is None:
            return False
        flat = _flat_state(state)
        return (
            flat is not None
            and len(flat) == len(self._state)
            and all(
                a is b if isinstance(a, torch.Tensor) else a == b
                for a, b in zip(flat, self._state, strict=True)
            )
        )

    def host_tensors(self, extra: Mapping[str, torch.Tensor]) -> HostTensors:
        if self._device is None:
            return to_host({**self.tensors, **extra})
        return self._device.snapshot({**self._on_host, **extra})


def _flat_state(state: Mapping[int, Mapping[str, Any]]) -> list[Any] | None:
    """The optimizer state as one list (index, name, tensor, ...), or None when a value is not
    a tensor (it could change without the state's objects changing)."""
    flat: list[Any] = []
    for index, values in state.items():
        flat.append(index)
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                return None
            flat.extend((name, value))
    return flat


def _prodigy(groups: list[dict[str, Any]], spec: JobSpec, kwargs: dict[str, Any]) -> Any:
    """Prodigy (prodigyopt) with the spec's settings; the Adam betas, epsilon and (decoupled)
    weight decay are the spec's `adam_*` values, as in diffusers' script."""
    # prodigyopt ships no type information.
    prodigyopt: Any = importlib.import_module("prodigyopt")
    optimizer = prodigyopt.Prodigy(
        groups,
        lr=kwargs["lr"],
        betas=kwargs["betas"],
        eps=kwargs["eps"],
        # Set below: the constructor prints a line to stdout when weight decay is on, which
        # would break the worker's one-JSON-object-per-line logs.
        weight_decay=0.0,
        decouple=True,
        use_bias_correction=spec.prodigy_use_bias_correction,
        safeguard_warmup=spec.prodigy_safeguard_warmup,
        d_coef=spec.prodigy_d_coef,
    )
    optimizer.defaults["weight_decay"] = kwargs["weight_decay"]
    for group in optimizer.param_groups:
        group["weight_decay"] = kwargs["weight_decay"]
    return optimizer
