"""A simulated trainer: everything about a lease stays real except the arithmetic.

`SimulatedTrainer` implements the trainer protocol `LeaseRunner` drives (`run(instance_images,
class_images, resume, hooks)` returning `Finished` or `Stopped`, hooks polled and called on the
training thread exactly as `Trainer` does), so a worker started with `--simulate-step-s` keeps
its agent, stream, leases, checkpoint pipeline, transfers and storage, and only swaps SDXL for
a cheap deterministic step. It exists for the chaos benchmark (`bench/chaos.py`) and tests: it
is never the default.

The "model" is one float32 tensor sized so that a checkpoint blob is about
`checkpoint_bytes`. Each step draws from the same RNG machinery the real trainer checkpoints:
two `torch.Generator`s (data order and noise, stored as the `rng/data` and `rng/noise` tensors),
a Python `random.Random` and a NumPy `RandomState` (stored in the JSON state in the layout
`capture_global_rng` uses). They are the run's own instances, never the process-wide ones, so
nothing else in the worker (reconnect jitter, say) can perturb a run. A step updates a few
weights from those draws and extends a sha256 chain over (step, draws); the chain and the
weights go into every checkpoint and into the result, so the result's sha256 depends on every
step taken: a skipped or repeated step, or a resume with a stale RNG, changes it.

Checkpoints are real blobs (`serialize_checkpoint`), taken at every multiple of
`checkpointing_steps` below `max_train_steps` like the real trainer's, and a resume checks the
checkpoint's fingerprint (weight-relevant spec fields and instance images) and raises
`CorruptCheckpoint` for another job's. The step time is paced against a deadline
(`step_s` per step), so a slow machine does not drift.

`checkpoint_stall_s` holds the training thread that long at each checkpoint before the snapshot
goes to the worker (a slow node's device-to-host copy), outside the step pacing, so a checkpoint
costs training time as on a real node; the stalls are in `timings.snapshot_seconds`, which the
worker reads as the real trainer's and adds to the checkpoint cost it reports in Ready (what
`checkpointing_steps: auto` weighs).

`node_fault=True` makes every run fail at once with a NODE-class `TrainingFailure`: a bad node
for chaos runs (the ban and the scaler's reallocation must deal with it).

`run_simulated(spec, ...)` runs one job to the end in-process without a lease: the expected
result digest of a fault-free run.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lorafleet.core.model import FailureClass
from lorafleet.core.spec import JobSpec
from lorafleet.worker.training import (
    CorruptCheckpoint,
    Finished,
    Stopped,
    StopReason,
    TrainingConfig,
    TrainingFailure,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
)
from lorafleet.worker.training.serialization import safetensors_bytes

# Weights a step touches.
_TOUCHED = 8
# What the blob carries besides the weights (generator states, header, JSON): roughly.
_OVERHEAD_BYTES = 24 * 1024
_MIN_WEIGHTS = 64
_LEARNING_RATE = 1e-3
_FORMAT = "lorafleet-simulated/1"


def _weights_count(checkpoint_bytes: int) -> int:
    return max(_MIN_WEIGHTS, (checkpoint_bytes - _OVERHEAD_BYTES) // 4)


def simulated_fingerprint(spec: JobSpec, instance_images: Sequence[TrainingImage]) -> str:
    """What a checkpoint was trained on: weight-relevant spec fields and the instance images."""
    # This format began at spec revision 2: the fields of revision 2 always count, later
    # ones only away from their default (core/spec.py's `since`).
    fields = spec.fingerprint_values(first_revision=2)
    images = sorted(
        [image.name, hashlib.sha256(image.data).hexdigest(), image.caption or ""]
        for image in instance_images
    )
    data = {"format": _FORMAT, "spec": fields, "instance": images}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _python_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_python_state(rng: random.Random, state: Sequence[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((int(version), tuple(int(i) for i in internal), gauss))


def _numpy_state(rng: np.random.RandomState) -> list[Any]:
    kind, keys, pos, has_gauss, cached = rng.get_state(legacy=True)
    return [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def _set_numpy_state(rng: np.random.RandomState, state: Sequence[Any]) -> None:
    kind, keys, pos, has_gauss, cached = state
    rng.set_state((str(kind), np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


@dataclass
class _State:
    """The mutable state of one simulated run."""

    step: int
    weights: torch.Tensor
    chain: bytes
    loss: float
    data_generator: torch.Generator
    noise_generator: torch.Generator
    python_rng: random.Random
    numpy_rng: np.random.RandomState


@dataclass
class SimulatedTimings:
    """What the worker reads off a trainer's `timings` (the real one's `RunTimings`)."""

    # Seconds the training thread spent on each checkpoint's snapshot, stall included.
    snapshot_seconds: list[float] = field(default_factory=list)


class SimulatedTrainer:
    """The `Trainer` protocol with a cheap deterministic step. Single-use, like `Trainer`."""

    def __init__(
        self,
        config: TrainingConfig,
        *,
        step_s: float = 0.002,
        checkpoint_bytes: int = 256 * 1024,
        checkpoint_stall_s: float = 0.0,
        node_fault: bool = False,
    ) -> None:
        if step_s < 0 or checkpoint_stall_s < 0:
            raise ValueError("step_s and checkpoint_stall_s must not be negative")
        self.config = config
        self.spec = config.spec
        self.step_s = step_s
        self.checkpoint_bytes = checkpoint_bytes
        self.checkpoint_stall_s = checkpoint_stall_s
        self.node_fault = node_fault
        self.timings = SimulatedTimings()
        self._ran = False
        self._fingerprint = ""

    # The protocol ---------------------------------------------------------------------------

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        if self._ran:
            raise RuntimeError("a Trainer runs once; make a new one for another run")
        self._ran = True
        hooks = hooks or TrainingHooks()
        if self.node_fault:
            raise TrainingFailure(
                FailureClass.NODE, "simulated node fault: this node fails every job it is given"
            )
        self._fingerprint = simulated_fingerprint(self.spec, instance_images)
        state = self._fresh() if resume is None else self._restore(resume)
        return self._train(state, hooks)

    # Setup ----------------------------------------------------------------------------------

    def _fresh(self) -> _State:
        seed = self.spec.seed
        init = torch.Generator("cpu").manual_seed(seed)
        weights = torch.randn(_weights_count(self.checkpoint_bytes), generator=init)
        return _State(
            step=0,
            weights=weights,
            chain=bytes.fromhex(self._fingerprint),
            loss=float("nan"),
            data_generator=torch.Generator("cpu").manual_seed(seed),
            noise_generator=torch.Generator("cpu").manual_seed(seed + 1),
            python_rng=random.Random(seed + 2),
            numpy_rng=np.random.RandomState(seed + 3),
        )

    def _restore(self, snapshot: TrainingSnapshot) -> _State:
        if snapshot.state.get("fingerprint") != self._fingerprint:
            raise CorruptCheckpoint(
                f"checkpoint at step {snapshot.step} was taken for other settings or data"
            )
        try:
            tensors = snapshot.tensors
            stored = snapshot.state
            weights = tensors["weights"].clone()
            if weights.shape != (_weights_count(self.checkpoint_bytes),):
                raise CorruptCheckpoint("checkpoint weights have the wrong shape")
            state = self._fresh()
            state.step = snapshot.step
            state.weights = weights
            state.chain = bytes.fromhex(str(stored["chain"]))
            state.loss = float(stored["loss"])
            state.data_generator.set_state(tensors["rng/data"])
            state.noise_generator.set_state(tensors["rng/noise"])
            _set_python_state(state.python_rng, stored["rng"]["python"])
            _set_numpy_state(state.numpy_rng, stored["rng"]["numpy"])
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise CorruptCheckpoint(
                f"checkpoint at step {snapshot.step} cannot be restored:"
                f" {type(exc).__name__}: {exc}"
            ) from exc
        return state

    # Training -------------------------------------------------------------------------------

    def _train(self, state: _State, hooks: TrainingHooks) -> TrainingOutcome:
        spec = self.spec
        start_step = state.step
        started = time.monotonic()
        last_report = time.perf_counter()
        reported_step = state.step
        while state.step < spec.max_train_steps:
            reason = self._poll(hooks)
            if reason is not None:
                snapshot = (
                    self._snapshot(state) if reason == "drain" and state.step > start_step else None
                )
                return Stopped(step=state.step, reason=reason, snapshot=snapshot)
            self._step(state)
            # Paced against a deadline: the step time holds on average whatever the overhead.
            wait = started + (state.step - start_step) * self.step_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            final = state.step == spec.max_train_steps
            now = time.perf_counter()
            if hooks.on_progress is not None and (
                final or now - last_report >= self.config.progress_interval_s
            ):
                seconds_per_step = (now - last_report) / (state.step - reported_step)
                hooks.on_progress(state.step, state.loss, _LEARNING_RATE, seconds_per_step)
                last_report, reported_step = now, state.step
            due = not final and state.step % spec.checkpointing_steps == 0
            if hooks.on_checkpoint is not None and due:
                stall_started = time.monotonic()
                if self.checkpoint_stall_s:
                    time.sleep(self.checkpoint_stall_s)
                snapshot = self._snapshot(state)
                stalled = time.monotonic() - stall_started
                self.timings.snapshot_seconds.append(stalled)
                # Outside the pacing: the steps after it are not hurried to make up for it.
                started += stalled
                hooks.on_checkpoint(snapshot)
        kohya = None
        if spec.output_format in ("kohya", "both"):
            kohya = self._result(state, spec.lora_rank, kohya=True)
        return Finished(
            step=state.step,
            loss=state.loss,
            lora_weights=self._result(state, spec.lora_rank),
            kohya_weights=kohya,
        )

    @staticmethod
    def _poll(hooks: TrainingHooks) -> StopReason | None:
        if hooks.should_stop is None:
            return None
        reason = hooks.should_stop()
        if reason not in (None, "cancel", "drain"):
            raise ValueError(f"should_stop returned {reason!r}; expected 'cancel', 'drain' or None")
        return reason

    @staticmethod
    def _step(state: _State) -> None:
        """One optimizer step: draws from every RNG, updates a few weights, extends the chain."""
        size = state.weights.numel()
        index = torch.randint(0, size, (_TOUCHED,), generator=state.data_generator)
        noise = torch.randn(_TOUCHED, generator=state.noise_generator)
        jitter = state.python_rng.random()
        scale = float(state.numpy_rng.random_sample())
        touched = state.weights[index]
        update = touched * (1.0 - _LEARNING_RATE) + noise * (_LEARNING_RATE * (1.0 + scale))
        state.weights[index] = update
        state.step += 1
        state.loss = float((noise * noise).mean()) * (0.5 + jitter)
        digest = hashlib.sha256(state.chain)
        digest.update(struct.pack("<qdd", state.step, jitter, scale))
        digest.update(index.numpy().tobytes())
        digest.update(update.numpy().tobytes())
        state.chain = digest.digest()

    def _snapshot(self, state: _State) -> TrainingSnapshot:
        tensors = {
            "weights": state.weights.clone(),
            "rng/data": state.data_generator.get_state(),
            "rng/noise": state.noise_generator.get_state(),
        }
        stored = {
            "format": _FORMAT,
            "fingerprint": self._fingerprint,
            "chain": state.chain.hex(),
            "loss": state.loss,
            "rng": {
                "python": _python_state(state.python_rng),
                "numpy": _numpy_state(state.numpy_rng),
            },
        }
        return TrainingSnapshot(
            step=state.step, tensors=tensors, state=json.loads(json.dumps(stored))
        )

    @staticmethod
    def _result(state: _State, rank: int, *, kohya: bool = False) -> bytes:
        """The "LoRA": the weights as one adapter of the job's rank in the file's layout (the
        scheduler records only LoRA files of the job: formats.py), zero-padded to fill its two
        matrices, with the step and the chain in the metadata."""
        metadata = {"lorafleet.step": str(state.step), "lorafleet.chain": state.chain.hex()}
        width = max(1, -(-state.weights.numel() // (2 * rank)))
        flat = torch.zeros(2 * rank * width, dtype=state.weights.dtype)
        flat[: state.weights.numel()] = state.weights
        down = flat[: rank * width].reshape(rank, width)
        up = flat[rank * width :].reshape(width, rank)
        if kohya:
            metadata["lorafleet.format"] = "kohya"
            tensors = {
                "lora_unet_simulated.lora_down.weight": down,
                "lora_unet_simulated.lora_up.weight": up,
                "lora_unet_simulated.alpha": torch.tensor(float(rank)),
            }
        else:
            tensors = {"simulated.lora_A.weight": down, "simulated.lora_B.weight": up}
        return safetensors_bytes(tensors, metadata)


def simulated_trainer_factory(
    *,
    step_s: float,
    checkpoint_bytes: int,
    checkpoint_stall_s: float = 0.0,
    node_fault: bool = False,
) -> Callable[[TrainingConfig], SimulatedTrainer]:
    """A `TrainerFactory` for `LeaseRunner` (and `Agent(trainer_factory=...)`)."""

    def factory(config: TrainingConfig) -> SimulatedTrainer:
        return SimulatedTrainer(
            config,
            step_s=step_s,
            checkpoint_bytes=checkpoint_bytes,
            checkpoint_stall_s=checkpoint_stall_s,
            node_fault=node_fault,
        )

    return factory


def run_simulated(
    spec: JobSpec,
    instance_images: Sequence[TrainingImage],
    *,
    checkpoint_bytes: int,
    resume: TrainingSnapshot | None = None,
    hooks: TrainingHooks | None = None,
) -> TrainingOutcome:
    """One run in the calling thread at full speed (no pacing): what a fault-free lease
    produces."""
    trainer = SimulatedTrainer(
        TrainingConfig(spec=spec, device="cpu"), step_s=0.0, checkpoint_bytes=checkpoint_bytes
    )
    return trainer.run(instance_images=instance_images, resume=resume, hooks=hooks)


def result_sha256(outcome: TrainingOutcome) -> str:
    """The sha256 the ledger records for a finished run's result."""
    if not isinstance(outcome, Finished):
        raise ValueError(f"the run did not finish: {outcome!r}")
    return hashlib.sha256(outcome.lora_weights).hexdigest()
