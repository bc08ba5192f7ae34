"""What the job commands print: jobs, events and estimates as JSON or as terminal text, the
`watch` progress bar's columns, and the hint on how a downloaded result loads.

Apart from the commands so that the output's shape (the `--json` documents scripts read, the
lines people read) is in one place, not spread through the gRPC calls that fetch it.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lorafleet.core.families import PIPELINES
from lorafleet.core.model import Estimate, Job, JobEvent, JobState
from lorafleet.core.spec import JobSpec


def format_age(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    seconds = (datetime.now(UTC) - moment).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def job_json(job: Job) -> dict[str, Any]:
    p = job.progress
    return {
        "job_id": job.job_id,
        "state": job.state.value,
        "epoch": job.epoch,
        "failures": job.failures,
        "node_faults": job.node_faults,
        "max_node_faults": job.max_node_faults,
        "step": p.step,
        "max_steps": p.max_steps,
        "loss": p.loss,
        "seconds_per_step": p.seconds_per_step,
        "eta_seconds": p.eta_seconds,
        "machine_id": job.machine_id,
        "error": job.error,
        "waiting_reason": job.waiting_reason,
        "failure_class": job.failure_class.value if job.failure_class else None,
        "result": dataclasses.asdict(job.result) if job.result else None,
        "latest_checkpoint_step": job.latest_checkpoint.step if job.latest_checkpoint else None,
        "gpu_seconds": job.gpu_seconds,
        "created_at": job.created_at.isoformat(),
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "spec": job.spec.to_dict(),
    }


def event_json(event: JobEvent) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "kind": event.kind.value,
        "at": event.at.isoformat(),
        "machine_id": event.machine_id,
        "epoch": event.epoch,
        "step": event.step,
        "loss": event.loss,
        "seconds_per_step": event.seconds_per_step,
        "message": event.message,
        "state": event.state.value if event.state else None,
        "checkpoint_key": event.checkpoint.key if event.checkpoint else None,
    }


def estimate_json(e: Estimate) -> dict[str, Any]:
    return {
        "seconds_per_step": e.seconds_per_step or None,
        "samples": e.samples,
        "seconds": e.seconds if e.samples else None,
        "price_per_gpu_hour": e.price_per_gpu_hour or None,
        "dollars": e.dollars if e.samples and e.price_per_gpu_hour else None,
        "spend_limit_dollars": e.spend_limit_dollars or None,
        "spent_dollars": e.spent_dollars,
    }


def describe_estimate(e: Estimate) -> str:
    if not e.samples:
        return (
            "no estimate: too few of this fleet's machines have finished a job of this shape"
            " (its model family, resolution, batch size, gradient accumulation, rank, precision,"
            " base quantization, gradient checkpointing, text-encoder training) lately"
        )
    text = (
        f"estimate   {e.seconds:.0f} s ({e.seconds / 3600:.2f} GPU-hours) at"
        f" {e.seconds_per_step:.3f} s/step, the median of {e.samples} machines' finished jobs"
        " of this shape"
    )
    if e.price_per_gpu_hour:
        text += f"\ncost       ${e.dollars:.2f} at ${e.price_per_gpu_hour:.2f}/GPU-hour"
    if e.spend_limit_dollars:
        text += f"\nlimit      ${e.spent_dollars:.2f} spent of ${e.spend_limit_dollars:.2f}"
    return text


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def describe_job(job: Job) -> str:
    p = job.progress
    lines = [
        f"job        {job.job_id}",
        f"state      {job.state.value}" + (f" ({job.error})" if job.error else ""),
        # A queued job that has had an attempt says why it waits (issue 32: an input fault
        # one SaladCloud machine reported waits for a second machine's word, with no error).
        *([f"waiting    {job.waiting_reason}"] if job.waiting_reason else []),
        f"progress   step {p.step}/{p.max_steps}"
        + (f", loss {p.loss:.4f}" if p.loss is not None else "")
        + (f", {p.seconds_per_step:.2f} s/step" if p.seconds_per_step else "")
        + (f", ETA {p.eta_seconds:.0f} s" if p.eta_seconds and not job.state.terminal else ""),
        f"attempts   {job.epoch} (failures {job.failures} of {job.spec.max_failures};"
        f" not the job's fault {job.node_faults} of {job.max_node_faults})",
        f"machine    {job.machine_id or '-'}",
        f"checkpoint {job.latest_checkpoint.step if job.latest_checkpoint else '-'}",
        f"result     {job.result.key if job.result else '-'}"
        + (f"\n           {job.result.kohya.key}" if job.result and job.result.kohya else ""),
        # Billed node time, as `report` says it: a CPU worker's seconds are not GPU time.
        f"node time  {job.gpu_seconds or 0:.0f} s (billed)",
        f"prompt     {job.spec.instance_prompt!r} on {job.spec.instance_data_prefix}",
        # The family the fleet trains it as (auto resolved): a user of several families sees
        # which one a job is, and which pipeline its result loads in.
        f"model      {job.spec.family} {job.spec.base_model}",
        f"created    {job.created_at:%Y-%m-%d %H:%M:%S} ({format_age(job.created_at)})",
    ]
    if job.spec.labels:
        lines.append("labels     " + ", ".join(f"{k}={v}" for k, v in job.spec.labels.items()))
    return "\n".join(lines)


def describe_event(event: JobEvent) -> str:
    parts = [f"{event.at:%H:%M:%S}", f"{event.kind.value:<21}"]
    if event.machine_id:
        parts.append(f"machine={event.machine_id}")
    if event.epoch:
        parts.append(f"epoch={event.epoch}")
    if event.step:
        parts.append(f"step={event.step}")
    if event.loss:
        parts.append(f"loss={event.loss:.4f}")
    if event.message:
        parts.append(event.message)
    return "  ".join(parts)


def watch_columns() -> tuple[Any, ...]:
    """The watch bar. The ETA is the job's own (`progress.eta_seconds`, from the worker's
    measured s/step), not rich's guess from how fast the bar moved on this screen."""
    from rich.progress import BarColumn, TextColumn

    return (
        TextColumn("[bold]{task.fields[state]}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[sps]} s/step"),
        TextColumn("ETA {task.fields[eta]}"),
    )


def format_eta(job: Job) -> str:
    eta = job.progress.eta_seconds
    if job.state.terminal or job.state is not JobState.RUNNING or not eta:
        return "-"
    seconds = round(eta)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def load_hint(job_id: str, spec: JobSpec, out: Path, fmt: str) -> str:
    """How the downloaded result loads, in the job's family's own pipeline. diffusers reads
    FLUX.1's kohya layout only for some layers (lorafleet.worker.training.families.flux): that
    file is for ComfyUI, and the hint says so rather than show a call that fails."""
    family = spec.family
    pipeline = next(name for name, of in PIPELINES.items() if of == family)
    if family == "flux" and fmt == "kohya":
        return "it is for ComfyUI's LoRA loader" + (
            f" (in diffusers, load its diffusers file: lorafleet download {job_id}"
            " --format diffusers)"
            if spec.output_format == "both"
            else " (in diffusers, load a job's diffusers file: output_format diffusers or both)"
        )
    return (
        f"load it with:\n  pipe = {pipeline}.from_pretrained({spec.base_model!r})\n"
        f"  pipe.load_lora_weights({str(out.parent)!r}, weight_name={out.name!r})"
    )
