"""The run's optimizer: parameter groups, the optimizer and LR schedule a spec names, mixed
precision's autocast dtype and fp16 loss scaling, and applying one step's gradients.

`build_optimization` is called once per run, after the adapters are added (the LoRA parameters
are what it optimizes) and before a checkpoint is restored into it; `Optimization` holds what it
built and `apply_gradients` steps it. A snapshot stores the optimizer's and the schedule's state
(snapshots.py); the steps that produce gradients are loop.py's.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.optimization import get_scheduler
from torch.optim.lr_scheduler import LambdaLR

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training.config import Runtime
from lorafleet.worker.training.lora import lora_parameters

_AUTOCAST_DTYPES = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class Optimization:
    """What a run optimizes with. `params` are the LoRA parameters in group order (clipped
    together); `scaler` is fp16's loss scaler, else None; `autocast_dtype` the dtype the forward
    pass runs under autocast in, None without mixed precision."""

    params: list[torch.nn.Parameter]
    optimizer: Any
    lr_scheduler: LambdaLR
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None

    def apply_gradients(self, max_grad_norm: float) -> None:
        """Clip, step the optimizer and the LR schedule, clear the gradients."""
        scaler = self.scaler
        if scaler is None:
            torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm, foreach=True)
            self.optimizer.step()
            stepped = True
        else:
            scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm, foreach=True)
            scale = scaler.get_scale()
            scaler.step(self.optimizer)  # skipped when the gradients hold an inf or NaN
            scaler.update()
            # update() lowers the scale exactly when it skipped the step.
            stepped = scaler.get_scale() >= scale
        if stepped:
            # The schedule counts applied updates: a skipped fp16 step does not advance it.
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def build_optimization(
    spec: JobSpec, runtime: Runtime, trained: Mapping[str, Any], denoiser_name: str
) -> Optimization:
    """The optimizer over the LoRA parameters of `trained` (the trained modules by pipeline
    name, denoiser first): the denoiser in one group at the (scaled) learning rate, every text
    encoder in a second at `text_encoder_learning_rate`."""
    params: list[torch.nn.Parameter] = []
    groups: list[dict[str, Any]] = []
    learning_rate = spec.learning_rate
    if spec.scale_lr:
        # As diffusers' --scale_lr: the rate per image seen, for one process.
        learning_rate *= spec.train_batch_size * spec.gradient_accumulation_steps
    for name, module in trained.items():
        module_params = [p for _, p in lora_parameters(module)]
        params.extend(module_params)
        lr = learning_rate if name == denoiser_name else spec.text_encoder_learning_rate
        if spec.optimizer == "prodigy":
            # Prodigy learns one step size for all groups and refuses differing rates; as in
            # diffusers' script, the text encoders train at learning_rate then.
            lr = learning_rate
        if len(groups) == 2:
            # Every text encoder trains in one group (the second joins the first's).
            groups[-1]["params"].extend(module_params)
        else:
            groups.append({"params": module_params, "lr": lr})
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
    # Mixed precision is autocast around the forward pass (torch.amp). fp16 also needs loss
    # scaling against underflowing gradients; bf16 has fp32's range and needs none. (fp16
    # runs only on CUDA: resolve_runtime refuses it on the CPU.) Everything is already on
    # its device, and gradient accumulation is counted in the run's optimizer_step.
    return Optimization(
        params=params,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        scaler=(
            torch.amp.GradScaler(runtime.device.type) if runtime.mixed_precision == "fp16" else None
        ),
        autocast_dtype=_AUTOCAST_DTYPES[runtime.mixed_precision],
    )


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
