"""The training run: `Trainer.run`, the run's orchestration and its steps.

A run is a sequence of small steps over one `TrainingConfig`: resolve the runtime, decode the
inputs, load the model, generate missing class images, add LoRA, precompute what does not
change (text embeddings when the encoders are frozen, VAE latents when no augmentation is
random), build the optimizer and LR schedule, restore a checkpoint if given, then train.
`_Run` holds one run's state and names those steps; the roles it calls on live beside it:
the hooks, outcomes and timings a caller sees (interface.py), whether and what to compile
(compiled_step.py), the optimizer (optimization.py), and snapshot/restore (snapshots.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace

from lorafleet.core.model import FailureClass
from lorafleet.worker.training.checkpoint import TrainingSnapshot
from lorafleet.worker.training.class_images import generate_class_images
from lorafleet.worker.training.compiled_step import (
    compiled_denoiser,
    compiled_loss,
    should_compile,
)
from lorafleet.worker.training.compiling import CompileCosts
from lorafleet.worker.training.config import TrainingConfig, resolve_runtime
from lorafleet.worker.training.data import (
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
from lorafleet.worker.training.interface import (
    Finished,
    RunTimings,
    Stopped,
    StopReason,
    TrainingHooks,
    TrainingOutcome,
)
from lorafleet.worker.training.lora import (
    add_lora,
    kohya_weights_bytes,
    lora_weights_bytes,
    skip_input_casts,
)
from lorafleet.worker.training.optimization import build_optimization
from lorafleet.worker.training.resident import ResidentModel
from lorafleet.worker.training.rng import TorchRngStream
from lorafleet.worker.training.snapshots import RunSnapshots, job_fingerprint

# job_fingerprint is snapshots.py's; importable from here as before.
__all__ = ["Trainer", "job_fingerprint"]

_tracer = trace.get_tracer("lorafleet.worker.training")
log = logging.getLogger(__name__)


# Latents are encoded up front in chunks of this many images.
_ENCODE_CHUNK = 4
# Runs in one process take turns. Trainers share no state, but diffusers and transformers patch
# torch process-wide while they build a model (accelerate's init_empty_weights, the default
# dtype), and a run swaps its own stream into torch's default generator while it initialises
# LoRA and steps (rng.py): two runs at once would corrupt each other's modules or numbers.
_ONE_RUN_AT_A_TIME = threading.Lock()


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
        self.snapshots = RunSnapshots(self)
        self.family = self.components.family
        self.forward_loss: Callable[..., torch.Tensor] = (
            self._loss_from_token_ids if spec.train_text_encoder else self._forward_loss
        )
        self.eager_forward_loss = self.forward_loss
        self.denoiser_forward: Callable[..., Any] = self.components.denoiser
        with phase("compile_choice"):
            if should_compile(self.config, self.resident, resume, self.notice):
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
                self.snapshots.restore(resume)
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

    # Compiling (compiled_step.py) ---------------------------------------------------------------

    def compile_step(self) -> None:
        """Compiled on the first step (the warm-up: `timings.step_seconds[0]`), or taken from the
        resident model when a run of this shape compiled it before (compiled_step.py)."""
        self.compiled_cold = not self.resident.is_compiled(self.spec.compiled_shape_key)
        self.compiled = True
        if self.spec.train_text_encoder:
            step = compiled_loss(
                self.config, self.resident, self.components, _Run._loss_from_token_ids
            )
            self.forward_loss = functools.partial(step, self)
        else:
            self.denoiser_forward = compiled_denoiser(self.config, self.resident, self.components)

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
        self.snapshots.restore(self.last_good)
        self.notice(
            f"{failure}; the compiled step is dropped on this node and training goes on eager"
            f" from step {self.last_good.step}"
        )

    def stopped(self) -> Stopped:
        reason = self.pending_stop or "cancel"
        snapshot = (
            self.snapshots.take() if reason == "drain" and self.step > self.start_step else None
        )
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
        """Embed every distinct prompt once with the encoders that are not trained (all of them
        unless `train_text_encoder`; then a family whose encoders are large sends the frozen
        ones to host memory until the next run needs them). Trained encoders: tokenize once,
        encode each step."""
        components = self.components
        ids = self.family.tokenize(components, self.data.prompts, self.spec)
        self.token_ids: tuple[torch.Tensor, ...] | None = None
        self.prompt_embeds: tuple[torch.Tensor, ...] | None = None
        with torch.no_grad():
            self.frozen_embeds = self.family.encode_frozen(components, ids)
            if not self.spec.train_text_encoder:
                self.prompt_embeds = self.family.encode(components, ids, self.frozen_embeds)
        if self.spec.train_text_encoder:
            self.token_ids = tuple(t.to(self.runtime.device) for t in ids)
        if self.runtime.is_cuda and not self.family.encoders_stay_on_device:
            for name, encoder in components.text_encoders.items():
                if name not in self.trained:
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
        """The optimizer and LR schedule (optimization.py), and the run's data and noise
        generators."""
        spec = self.spec
        self.optimization = build_optimization(
            spec, self.runtime, self.trained, self.family.denoiser_name
        )
        self.data_generator = torch.Generator("cpu").manual_seed(spec.seed)
        self.noise_generator = torch.Generator(self.runtime.device).manual_seed(spec.seed + 1)

    # Training ---------------------------------------------------------------------------------

    def train(self) -> TrainingOutcome:
        """Trains to the end or a stop. A compiled run that turns non-finite goes on eager
        from the last finite state, once (`fall_back_to_eager`)."""
        if self.compiled:
            self.last_good = self.snapshots.take()
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
            if self.optimization.scaler is None:
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
                        float(self.optimization.lr_scheduler.get_last_lr()[0]),
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
                    snapshot = self.snapshots.take()
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
        params = self.optimization.params
        weights_finite = torch.stack([torch.isfinite(p).all() for p in params]).all()
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
        self.optimization.apply_gradients(self.spec.max_grad_norm)
        self.step += 1
        assert total is not None
        return total / accumulation

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.optimization.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.runtime.device.type, dtype=dtype)

    def micro_step(self, examples: list[Example]) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients add up until the optimizer step.
        Returns the micro-batch's loss, detached."""
        latents = self.latents(examples)
        draws = self.family.draw(latents, self.noise_generator, examples, self)
        loss = self.forward_loss(latents, draws, *self.conditioning_inputs(examples))
        # The accumulated gradient is that of the mean loss over the micro-batches.
        scaled = loss / self.spec.gradient_accumulation_steps
        scaler = self.optimization.scaler
        if scaler is not None:
            scaled = scaler.scale(scaled)
        torch.autograd.backward(scaled)
        return loss.detach()

    def _loss_from_token_ids(
        self,
        latents: torch.Tensor,
        draws: tuple[torch.Tensor, ...],
        token_ids: tuple[torch.Tensor, ...],
        frozen: tuple[torch.Tensor, ...],
        rows: torch.Tensor,
    ) -> torch.Tensor:
        with self.autocast():
            embeddings = self.family.encode(self.components, token_ids, frozen)
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

    def conditioning_inputs(self, examples: list[Example]) -> tuple[Any, ...]:
        """`forward_loss`'s arguments after the draws: with frozen encoders the cached
        conditioning and the row of it for each example; with trained ones the token ids and
        frozen encoders' rows of each distinct prompt of the batch (encoded once), and the row
        of those for each example (picked on the host: no sync)."""
        rows = [self.data.prompt_of[s.image] for s in examples]
        if self.prompt_embeds is not None:
            return self.prompt_embeds, self.indices(rows)
        assert self.token_ids is not None
        distinct = sorted(set(rows))
        picked = self.indices(distinct)
        ids = tuple(t[picked] for t in self.token_ids)
        frozen = tuple(e.index_select(0, picked) for e in self.frozen_embeds)
        return ids, frozen, self.indices([distinct.index(r) for r in rows])

    def indices(self, values: list[int]) -> torch.Tensor:
        """A step's few indices as a device tensor, without a host sync: from a GPU's view,
        a copy out of pageable memory waits for the stream to drain (two such copies a step
        kept the host from queueing ahead of the GPU), one out of pinned memory does not."""
        return self.to_device(torch.tensor(values, dtype=torch.long))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.runtime.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.runtime.device, non_blocking=True)
