"""What a job needs of a node's memory, and whether any node of the fleet can hold it.

A job's memory need is the larger of what its spec asks (`min_vram_mb`) and the family's
conservative estimate for its shape (`families.estimate_vram_mb`; None for a base model the
fleet cannot size, a local folder or an unknown hub id). The ledger stores it on the job at
submit (`jobs.min_vram_mb`) and `claim_job` grants a job only to a node that announced at
least that much (Hello.vram_mb): the scheduler never grants a job that cannot fit the node.

A job that no node of the fleet can hold is refused at submit (`check_fits_fleet`), judged
from the largest node class the operator runs (`fleet_max_vram_mb`, the scheduler's
LORAFLEET_FLEET_MAX_VRAM_MB), not from the nodes connected now: a fleet scaled to zero has
none to ask. The refusal names the field whose change would make the job fit. A fleet whose
nodes are CPUs (`lorafleet up` on a machine without a GPU, or the scheduler's
LORAFLEET_FLEET_ACCELERATOR cpu) refuses a quantized base, fp16 and 8-bit AdamW at submit: a
worker could only refuse them after a node was spent on the job.
"""

from __future__ import annotations

from typing import Any

from lorafleet.core.errors import InvalidArgument
from lorafleet.core.families import estimate_vram_mb
from lorafleet.core.spec import JobSpec

# Single changes tried, in this order, when a job does not fit the fleet: gradient
# checkpointing first (the same LoRA, bit for bit, only slower), then the QLoRA recipe's 4-bit
# frozen base, then what shrinks the activations, then fp32 weights to the mixed-precision
# dtype. Where no one change is enough, their cumulative combination (in the same order) is
# offered.
_LEVERS: tuple[tuple[str, str, Any], ...] = (
    ("gradient_checkpointing", "gradient_checkpointing", True),
    ("base_quantization", "quantization", "nf4"),
    ("train_text_encoder", "train_text_encoder", False),
    ("train_batch_size", "batch_size", 1),
    ("mixed_precision", "mixed_precision", "bf16"),
    ("resolution", "resolution", 768),
    ("resolution", "resolution", 512),
)


def _estimate_args(spec: JobSpec) -> dict[str, Any]:
    return {
        "base_model": spec.base_model,
        "resolution": spec.resolution,
        "batch_size": spec.train_batch_size,
        "lora_rank": spec.lora_rank,
        "quantization": spec.base_quantization,
        "gradient_checkpointing": spec.gradient_checkpointing,
        "train_text_encoder": spec.train_text_encoder,
        "mixed_precision": spec.mixed_precision,
    }


def estimated_vram_mb(spec: JobSpec) -> int | None:
    """The family's memory estimate for the spec's shape, MiB; None where it cannot be sized."""
    return estimate_vram_mb(**_estimate_args(spec))


def vram_need_mb(spec: JobSpec) -> int:
    """The accelerator memory a node must announce to be granted the job, MiB."""
    estimate = estimated_vram_mb(spec)
    return spec.min_vram_mb if estimate is None else max(spec.min_vram_mb, estimate)


def _gib(mb: int) -> str:
    # One decimal always: 24105 and 24840 MiB both read "24 GiB" rounded to whole GiB, though
    # one fits a 24 GiB node and the other does not.
    return f"{mb / 1024:.1f} GiB"


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_fits_fleet(
    spec: JobSpec, fleet_max_vram_mb: int, *, cpu_only: bool = False, prefix: str = "spec"
) -> None:
    """Raises InvalidArgument, naming the field that would fix it, when the job's memory need
    exceeds the largest node the fleet runs (`fleet_max_vram_mb`; 0: no check), or when it
    asks for what only a CUDA GPU does (a quantized base, fp16, 8-bit AdamW) and the fleet's
    nodes are CPUs (`cpu_only`)."""
    if cpu_only:
        _check_cpu_fleet(spec, prefix)
    if fleet_max_vram_mb <= 0:
        return
    need = vram_need_mb(spec)
    if need <= fleet_max_vram_mb:
        return
    largest = (
        f"the largest node this fleet runs has {_gib(fleet_max_vram_mb)}"
        " (the scheduler's LORAFLEET_FLEET_MAX_VRAM_MB)"
    )
    if spec.min_vram_mb > fleet_max_vram_mb:
        raise InvalidArgument(
            f"{prefix}.min_vram_mb",
            f"asks for {spec.min_vram_mb} MiB; {largest}, so no node could take the job",
        )
    args = _estimate_args(spec)
    # The levers not already at the value they would be changed to.
    levers = [
        (field, arg, value)
        for field, arg, value in _LEVERS
        if args[arg] != value and not (cpu_only and field == "base_quantization")
    ]
    current = dict.fromkeys(f"{field} {_word(args[arg])}" for field, arg, _ in levers)
    said = f"needs ~{_gib(need)} (estimated)"
    if current:
        said += f" with {', '.join(current)}"
    said += f"; {largest}"

    def estimate(changes: dict[str, Any]) -> int:
        value = estimate_vram_mb(**(args | changes))
        assert value is not None  # sized above, and no lever changes the base model
        return max(spec.min_vram_mb, value)

    for field, arg, value in levers:
        fits = estimate({arg: value})
        if fits <= fleet_max_vram_mb:
            raise InvalidArgument(
                f"{prefix}.{field}", f"{said}; {field} {_word(value)} needs ~{_gib(fits)}"
            )
    # No one change is enough: each lever that lowers the need, in order, until it fits.
    changes: dict[str, Any] = {}
    named: dict[str, str] = {}
    lowest = need
    for field, arg, value in levers:
        fits = estimate(changes | {arg: value})
        if fits >= lowest:
            continue
        changes[arg], named[field], lowest = value, f"{field} {_word(value)}", fits
        if fits <= fleet_max_vram_mb:
            first = next(iter(named))
            raise InvalidArgument(
                f"{prefix}.{first}", f"{said}; with {', '.join(named.values())} ~{_gib(fits)}"
            )
    # Every lever already pulled, or none lowers the need (the prompt encoding's peak holds
    # whatever the steps take).
    still = (
        f"still ~{_gib(lowest)} with {', '.join(named.values())}"
        if named
        else "no option of the job lowers it"
    )
    raise InvalidArgument(
        f"{prefix}.base_model",
        f"{said}, and {still}: train a smaller variant of the family, or run larger nodes",
    )


# What a CPU node cannot do, refused at submit rather than by the worker a lease later (a
# failure there also spends the node's lease): field, the value it has, why.
def _check_cpu_fleet(spec: JobSpec, prefix: str) -> None:
    fleet = "this fleet's nodes are CPUs (the scheduler's LORAFLEET_FLEET_ACCELERATOR cpu)"
    if spec.base_quantization != "none":
        raise InvalidArgument(
            f"{prefix}.base_quantization",
            f"{spec.base_quantization} quantizes the frozen base on a CUDA GPU (bitsandbytes,"
            f" torchao) and {fleet}: use none",
        )
    if spec.mixed_precision == "fp16":
        raise InvalidArgument(
            f"{prefix}.mixed_precision",
            f"fp16 training (loss scaling) needs a CUDA GPU and {fleet}: use bf16 or no",
        )
    for field, on in (
        ("use_8bit_adam", spec.use_8bit_adam),
        ("optimizer", spec.optimizer == "adamw_8bit"),
    ):
        if on:
            raise InvalidArgument(
                f"{prefix}.{field}",
                f"bitsandbytes' 8-bit AdamW needs a CUDA GPU and {fleet}: use adamw",
            )
