"""The user-facing job commands: submit, watch, list, get, cancel, events, download.

Every JobSpec field is a flag (`--learning-rate 2e-4`, `--train-text-encoder`,
`--label team=a`), built from its declaration in core/spec.py (type, choices, help, default) so
that no option can be forgotten; a YAML or JSON file (`--spec job.yaml`) gives the same fields,
and flags override it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from lorafleet.cli.report import format_report, report_command, report_to_json
from lorafleet.cli.samples import SAMPLES_HELP, add_samples_arguments, samples_command
from lorafleet.cli.timeline import timeline_command
from lorafleet.client import AsyncClient
from lorafleet.client.api import build_spec
from lorafleet.client.dataset import (
    IMAGE_SUFFIXES,
    TrainingFile,
    fetch_zip,
    read_folder,
    read_zip,
)
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.families import DEFAULT_FAMILY, PIPELINES, REFUSED_PIPELINES
from lorafleet.core.model import (
    RESULT_FILE_NAMES,
    Estimate,
    Job,
    JobEvent,
    JobState,
    result_format,
)
from lorafleet.core.spec import SPEC_FIELD, SPEC_FIELDS, JobSpec, SpecField


def _spec_help(f: SpecField) -> str:
    """A flag's help: the field's declared help and its default."""
    shown = f.shown_default
    text = f.help if shown is None else f"{f.help} (default: {shown})"
    return text.replace("%", "%%")


# The client commands: each talks to a scheduler over gRPC and imports no service.
JOB_COMMANDS = (
    "submit",
    "watch",
    "list",
    "get",
    "cancel",
    "events",
    "timeline",
    "report",
    "download",
    "webhooks",
    "samples",
)


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="scheduler host:port (LORAFLEET_TARGET, localhost:50051)")
    parser.add_argument("--api-key", help="API key (LORAFLEET_API_KEY)")
    parser.add_argument("--tls", action="store_true", help="connect over TLS")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _int_or(zero: str) -> Callable[[str], int]:
    """An int flag's parser; `zero` (e.g. "auto") stands for 0."""

    def parse(text: str) -> int:
        return 0 if zero and text == zero else int(text)

    parse.__name__ = "int"  # argparse names the type in its error: "invalid int value"
    return parse


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per JobSpec field, from its declaration in core/spec.py: type, choices, help."""
    group = parser.add_argument_group("job spec (any field of lorafleet.jobs.v1.JobSpec)")
    for f in SPEC_FIELDS:
        if f.name in ("labels", "webhook_url", "webhook_events"):
            continue  # their own flags, after the loop
        flag, dest, help_text = f.flag, f"spec_{f.name}", _spec_help(f)
        if f.kind == "choice":
            group.add_argument(flag, dest=dest, choices=f.choices, help=help_text)
        elif f.kind == "texts":
            # e.g. --validation-prompts "..." --validation-prompts "...": once per value.
            group.add_argument(flag, dest=dest, action="append", metavar="TEXT", help=help_text)
        elif f.kind == "bool":
            group.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif f.kind == "int":
            metavar = f"N|{f.zero}" if f.zero else "N"
            group.add_argument(
                flag, dest=dest, type=_int_or(f.zero), metavar=metavar, help=help_text
            )
        elif f.kind == "float":
            group.add_argument(flag, dest=dest, type=float, metavar="X", help=help_text)
        else:
            group.add_argument(flag, dest=dest, metavar="TEXT", help=help_text)
    labels, url, events = (SPEC_FIELD[n] for n in ("labels", "webhook_url", "webhook_events"))
    group.add_argument(
        labels.flag, action="append", default=[], metavar="KEY=VALUE", help=_spec_help(labels)
    )
    group.add_argument(url.flag, help=_spec_help(url))
    group.add_argument(
        events.flag,
        action="append",
        default=[],
        choices=events.choices,
        help=_spec_help(events),
    )


def parse_labels(pairs: list[str], field: str = "label") -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidArgument(field, f"expected KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


def load_document(path: Path) -> Any:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def spec_from_args(args: argparse.Namespace, base: Mapping[str, Any] | None) -> dict[str, Any]:
    spec = dict(base or {})
    for key, value in vars(args).items():
        if key.startswith("spec_") and value is not None:
            spec[key.removeprefix("spec_")] = value
    if args.label:
        spec["labels"] = {**spec.get("labels", {}), **parse_labels(args.label)}
    if args.webhook_url or args.webhook_event:
        # The flags replace a file's webhook, whichever way the file says it.
        spec.pop("webhook_url", None)
        spec.pop("webhook_events", None)
        spec["webhook"] = {"url": args.webhook_url or "", "events": args.webhook_event}
    return spec


def _age(moment: datetime | None) -> str:
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
        f"created    {job.created_at:%Y-%m-%d %H:%M:%S} ({_age(job.created_at)})",
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


async def _read_images(
    client: AsyncClient, *, folder: str | None, zip_file: str | None, url: str | None
) -> list[TrainingFile]:
    """The checked files of whichever of --images, --images-zip, --images-url was given."""
    skipped: list[str] = []
    if folder:
        files = await asyncio.to_thread(read_folder, folder, skipped=skipped)
        _say_skipped(folder, skipped)
        return files
    if zip_file:
        files = await asyncio.to_thread(read_zip, zip_file, skipped=skipped)
        _say_skipped(zip_file, skipped)
        return files
    assert url
    data = await fetch_zip(url, allow_http_loopback=_allow_http_loopback())
    files = await asyncio.to_thread(read_zip, data, field="images_url", name=url, skipped=skipped)
    _say_skipped(url, skipped)
    return files


def _say_skipped(source: str, skipped: list[str]) -> None:
    """One line on stderr naming the files left out (neither an image nor a caption), so a
    `notes.pdf` among the photos is never dropped in silence; stdout stays the command's
    output (`--json`)."""
    if not skipped:
        return
    names = ", ".join(skipped[:10]) + (
        f" (and {len(skipped) - 10} more)" if len(skipped) > 10 else ""
    )
    kinds = ", ".join(IMAGE_SUFFIXES)
    print(
        f"note: skipped {len(skipped)} file(s) in {source} that are neither images ({kinds})"
        f" nor .txt captions: {names}",
        file=sys.stderr,
    )


def _allow_http_loopback() -> bool:
    # Testing only: lets --images-url fetch plain http from a loopback address.
    return os.environ.get("LORAFLEET_ALLOW_HTTP_LOOPBACK_URLS", "") == "1"


def family_from_local_model(spec: dict[str, Any], *, where: str = "") -> str | None:
    """With `model_family` auto, a `base_model` folder that is on this machine (as on `lorafleet
    up`, where the workers read the same folder) names its own family in its model_index.json:
    the spec takes it. Otherwise the scheduler would take an unknown local model for sdxl and
    the worker fail the job once it loaded it. A family named that the folder contradicts, or a
    pipeline lorafleet refuses, is refused here, naming base_model, before anything is uploaded.
    Returns a note for the user when it filled the family in."""
    base_model = str(spec.get("base_model") or "")
    index = Path(base_model) / "model_index.json"
    if base_model and not os.path.isabs(base_model) and index.is_file():
        # `--base-model flux` beside a folder `flux` was taken for a hub id and failed on the
        # worker: a model folder here is meant, and it needs its absolute path.
        raise InvalidArgument(
            f"{where}base_model",
            f"{base_model!r} is a model folder here, but the workers need its absolute path"
            f" (a relative one reads as a hub id): {Path(base_model).resolve()}",
        )
    if not os.path.isabs(base_model) or not index.is_file():
        return None  # a hub id, or a folder only the workers have: the worker checks it
    try:
        pipeline = str(json.loads(index.read_text()).get("_class_name", ""))
    except (OSError, ValueError, AttributeError):
        return None  # the worker names what is wrong with it
    if pipeline in REFUSED_PIPELINES:
        raise InvalidArgument(f"{where}base_model", REFUSED_PIPELINES[pipeline])
    family = PIPELINES.get(pipeline)
    if family is None:
        return None
    named = str(spec.get("model_family") or "auto")
    if named == "auto" and family == DEFAULT_FAMILY:
        return None  # what auto takes it for already
    if named == "auto":
        spec["model_family"] = family
        return (
            f"note: {base_model} is a model of family {family} ({pipeline}): model_family {family}"
        )
    if named != family:
        raise InvalidArgument(
            f"{where}base_model",
            f"{base_model!r} is a model of family {family} ({pipeline}) but model_family says"
            f" {named};"
            f" submit it with model_family {family}",
        )
    return None


def _image_source(
    folder: str | None, zip_file: str | None, url: str | None, *, where: str = ""
) -> str | None:
    """The name the upload prefix is derived from; refuses more than one source."""
    given = [s for s in (folder, zip_file, url) if s]
    if len(given) > 1:
        raise InvalidArgument(
            f"{where}images", "give only one of --images, --images-zip, --images-url"
        )
    if not given:
        return None
    name = given[0].rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
    return name.removesuffix(".zip") or "images"


async def submit(client: AsyncClient, args: argparse.Namespace) -> int:
    """Checks everything it can (spec, folders, zips, every image decodes) before uploading
    anything, then uploads, then submits."""
    uploads: list[tuple[str, list[TrainingFile]]] = []
    if args.batch:
        documents = load_document(Path(args.batch))
        if not isinstance(documents, list):
            raise InvalidArgument("batch", "the file must hold a list of job specs")
        specs = []
        for i, document in enumerate(documents):
            if not isinstance(document, dict):
                raise InvalidArgument(f"batch[{i}]", "must be a mapping of spec fields")
            document = dict(document)
            folder = document.pop("images", None)
            zip_file = document.pop("images_zip", None)
            url = document.pop("images_url", None)
            source = _image_source(folder, zip_file, url, where=f"batch[{i}].")
            if note := family_from_local_model(document, where=f"batch[{i}]."):
                print(f"batch[{i}]: {note}", file=sys.stderr)
            if source:
                document.setdefault("instance_data_prefix", _upload_prefix(source))
            try:
                build_spec(document)
            except InvalidArgument as exc:
                raise InvalidArgument(f"batch[{i}].{exc.field}", exc.reason) from None
            if source:
                files = await _read_images(client, folder=folder, zip_file=zip_file, url=url)
                uploads.append((document["instance_data_prefix"], files))
            specs.append(document)
    else:
        base = load_document(Path(args.spec)) if args.spec else {}
        spec = spec_from_args(args, base)
        if note := family_from_local_model(spec):
            print(note, file=sys.stderr)
        source = _image_source(args.images, args.images_zip, args.images_url)
        if source:
            spec.setdefault("instance_data_prefix", args.prefix or _upload_prefix(source))
        if args.class_images:
            spec.setdefault("class_data_prefix", _upload_prefix(Path(args.class_images).name))
        build_spec(spec)  # the scheduler's own checks, before anything is uploaded
        if source:
            files = await _read_images(
                client, folder=args.images, zip_file=args.images_zip, url=args.images_url
            )
            uploads.append((spec["instance_data_prefix"], files))
        if args.class_images:
            skipped: list[str] = []
            class_files = await asyncio.to_thread(
                read_folder, args.class_images, field="class_images", skipped=skipped
            )
            _say_skipped(args.class_images, skipped)
            uploads.append((spec["class_data_prefix"], class_files))
        specs = [spec]
    if args.estimate:
        estimates = [await client.estimate(s) for s in specs]
        if args.json:
            print_json([estimate_json(e) for e in estimates])
        else:
            for e in estimates:
                print(describe_estimate(e))
        return 0
    for prefix, files in uploads:
        await client.upload_files(files, prefix=prefix)
    if args.batch:
        jobs = await client.submit_batch(specs)
    else:
        jobs = [await client.submit(specs[0], idempotency_key=args.idempotency_key or "")]
    if args.json:
        print_json([job_json(j) for j in jobs])
    else:
        for job in jobs:
            print(f"submitted {job.job_id} ({job.state.value.lower()})")
    if args.watch and len(jobs) == 1:
        return await watch(client, jobs[0].job_id, as_json=args.json)
    return 0


def _upload_prefix(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return f"{safe.strip('.') or 'images'}-{uuid.uuid4().hex[:8]}"


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


async def watch(client: AsyncClient, job_id: str, *, as_json: bool) -> int:
    """Follows the job to its end; exit code 0 only if it succeeded."""
    from rich.console import Console
    from rich.progress import Progress

    final: Job | None = None
    console = Console(stderr=True)

    def waiting(message: str) -> None:
        # The scheduler is down or silent: say what the watch waits for (on stderr), then
        # that it is back, rather than nothing for minutes.
        console.print(message or "the scheduler answers again", style="yellow")

    if as_json:
        async for update in client.watch(job_id, on_waiting=waiting):
            final = update.job
            if update.event is not None:
                print(json.dumps(event_json(update.event)), flush=True)
        return 0 if final is not None and final.state is JobState.SUCCEEDED else 1
    with Progress(*watch_columns(), console=console, transient=False) as progress:
        task = None
        said_waiting: str | None = None
        async for update in client.watch(job_id, on_waiting=waiting):
            job = final = update.job
            if job.waiting_reason and job.waiting_reason != said_waiting:
                progress.console.print(f"queued: {job.waiting_reason}", style="yellow")
            said_waiting = job.waiting_reason
            p = job.progress
            state = job.state.value.lower()
            loss = f"{p.loss:.4f}" if p.loss is not None else "-"
            sps = f"{p.seconds_per_step:.2f}" if p.seconds_per_step else "-"
            eta = format_eta(job)
            if task is None:
                task = progress.add_task(
                    "train",
                    total=p.max_steps,
                    completed=p.step,
                    state=state,
                    loss=loss,
                    sps=sps,
                    eta=eta,
                )
            progress.update(task, completed=p.step, state=state, loss=loss, sps=sps, eta=eta)
            event = update.event
            if event is not None and event.kind.value not in ("HEARTBEAT", "SUBMITTED"):
                progress.console.print(describe_event(event))
    assert final is not None
    if final.state is JobState.SUCCEEDED:
        console.print(f"succeeded: download with `lorafleet download {job_id}`")
        return 0
    console.print(f"{final.state.value.lower()}: {final.error or ''}")
    return 1


async def list_jobs(client: AsyncClient, args: argparse.Namespace) -> int:
    states = [JobState(s.upper()) for s in args.state]
    jobs = []
    async for job in client.list(states=states, labels=parse_labels(args.label)):
        jobs.append(job)
        if len(jobs) >= args.limit:
            break
    if args.json:
        print_json([job_json(j) for j in jobs])
        return 0
    print(f"{'JOB':36}  {'STATE':9}  {'STEP':>11}  {'CREATED':>9}  LABELS")
    for job in jobs:
        step = f"{job.progress.step}/{job.progress.max_steps}"
        labels = ",".join(f"{k}={v}" for k, v in job.spec.labels.items())
        print(
            f"{job.job_id:36}  {job.state.value:9}  {step:>11}  {_age(job.created_at):>9}  {labels}"
        )
    return 0


async def get(client: AsyncClient, args: argparse.Namespace) -> int:
    job = await client.get(args.job_id)
    print_json(job_json(job)) if args.json else print(describe_job(job))
    return 0


async def cancel(client: AsyncClient, args: argparse.Namespace) -> int:
    job = await client.cancel(args.job_id)
    print_json(job_json(job)) if args.json else print(f"{job.job_id} {job.state.value.lower()}")
    return 0


async def events(client: AsyncClient, args: argparse.Namespace) -> int:
    timeline = await client.events(args.job_id)
    if args.json:
        print_json([event_json(e) for e in timeline])
    else:
        for event in timeline:
            print(describe_event(event))
    return 0


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


async def download(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        step = None if args.checkpoint == "latest" else int(args.checkpoint)
        out = Path(args.output or f"{args.job_id}-checkpoint.bin")
        await client.download_checkpoint(args.job_id, step, out)
    else:
        fmt = args.format
        if fmt is None and args.output is None:
            # Named after the job's main file (the kohya one when its output_format is kohya).
            job = await client.get(args.job_id)
            fmt = result_format(job.result.key) if job.result is not None else "diffusers"
        out = Path(args.output or RESULT_FILE_NAMES[fmt or "diffusers"])
        await client.download_result(args.job_id, out, fmt=args.format)
        job = await client.get(args.job_id)
        chosen = args.format or (result_format(job.result.key) if job.result else "diffusers")
        print(f"wrote {out}; {load_hint(job.job_id, job.spec, out, chosen)}", file=sys.stderr)
    if args.json:
        print_json({"path": str(out)})
    else:
        print(out)
    return 0


async def webhooks(client: AsyncClient, args: argparse.Namespace) -> int:
    deliveries = await client.webhook_deliveries(args.job_id)
    rows: list[dict[str, Any]] = []
    for d in deliveries:
        if d.HasField("delivered_at"):
            outcome = f"delivered {d.delivered_at.ToDatetime():%H:%M:%S}"
        elif d.HasField("gave_up_at"):
            outcome = f"gave up {d.gave_up_at.ToDatetime():%H:%M:%S}"
        else:
            outcome = f"retrying at {d.next_attempt_at.ToDatetime():%H:%M:%S}"
        rows.append(
            {
                "delivery_id": d.delivery_id,
                "event": d.event,
                "url": d.url,
                "attempts": d.attempts,
                "last_status": d.last_status or None,
                "last_error": d.last_error or None,
                "outcome": outcome,
            }
        )
    if args.json:
        print_json(rows)
        return 0
    for r in rows:
        failed = r["last_error"] and not str(r["outcome"]).startswith("delivered")
        error = f"  ({r['last_error']})" if failed else ""
        print(
            f"{r['delivery_id']:>6}  {r['event']:<10}  {r['attempts']} attempt(s)"
            f"  {r['outcome']}{error}"
        )
    return 0


def add_job_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", help="submit a job (or --batch FILE of jobs)")
    add_connection_flags(p)
    p.add_argument(
        "--images",
        help="a local folder of images (+ name.txt captions) to upload; other files are skipped"
        " and named on stderr, an image that does not decode refuses the submit",
    )
    p.add_argument(
        "--images-zip", help="a zip file of images (+ name.txt captions beside them) to upload"
    )
    p.add_argument(
        "--images-url",
        help="an https:// URL of such a zip: downloaded here (up to 1 GiB), then uploaded",
    )
    p.add_argument("--class-images", help="a local folder of class images to upload")
    p.add_argument("--prefix", help="storage prefix for --images (default: folder name + id)")
    p.add_argument("--spec", help="YAML or JSON file of spec fields (flags override it)")
    p.add_argument("--batch", help="YAML or JSON list of specs, submitted all or nothing")
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the first job")
    p.add_argument("--watch", action="store_true", help="follow the job until it ends")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="print the expected time and cost (from the fleet's measured s/step for jobs of"
        " this shape) instead of submitting; uploads nothing",
    )
    add_spec_flags(p)

    p = sub.add_parser("watch", help="follow a job with a live progress bar")
    add_connection_flags(p)
    p.add_argument("job_id")

    p = sub.add_parser("list", help="list your jobs, newest first")
    add_connection_flags(p)
    p.add_argument(
        "--state", action="append", default=[], choices=[s.value.lower() for s in JobState]
    )
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--limit", type=int, default=100)

    for name, text in (
        ("get", "show one job"),
        ("cancel", "cancel a job"),
        ("events", "a job's timeline"),
        ("webhooks", "a job's webhook delivery log"),
    ):
        p = sub.add_parser(name, help=text)
        add_connection_flags(p)
        p.add_argument("job_id")

    p = sub.add_parser(
        "timeline", help="a picture of a job's life: leases per machine, checkpoints"
    )
    add_connection_flags(p)
    p.add_argument("job_id")
    p.add_argument("-o", "--output", required=True, help="file.html, file.svg or file.png")

    p = sub.add_parser("report", help="jobs, wall time, s/step, nodes needed, GPU-seconds, cost")
    add_connection_flags(p)
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--since", type=datetime.fromisoformat, help="created at or after (ISO time)")
    p.add_argument("--until", type=datetime.fromisoformat, help="created before (ISO time)")
    p.add_argument("--price-per-gpu-hour", type=float, default=0.0, help="for the cost figures")
    p.add_argument("--per-job", action="store_true", help="a line per job too")

    p = sub.add_parser("samples", help=SAMPLES_HELP)
    add_connection_flags(p)
    add_samples_arguments(p)

    p = sub.add_parser("download", help="download the final LoRA (or a checkpoint)")
    add_connection_flags(p)
    p.add_argument("job_id")
    p.add_argument("-o", "--output", help="file to write")
    p.add_argument("--checkpoint", metavar="STEP|latest", help="a retained checkpoint instead")
    p.add_argument(
        "--format",
        choices=["diffusers", "kohya"],
        help="which result file: diffusers (pytorch_lora_weights.safetensors) or kohya"
        " (pytorch_lora_weights_kohya.safetensors; the job needs output_format kohya or both);"
        " default the job's main file",
    )


async def run_job_command(args: argparse.Namespace) -> int:
    async with AsyncClient(args.target, api_key=args.api_key, tls=args.tls) as client:
        if args.command == "submit":
            return await submit(client, args)
        if args.command == "watch":
            return await watch(client, args.job_id, as_json=args.json)
        if args.command == "samples":
            return await samples_command(client, args)
        if args.command == "timeline":
            path = await timeline_command(client, args.job_id, args.output)
            print_json({"path": str(path)}) if args.json else print(path)
            return 0
        if args.command == "report":
            report = await report_command(
                client,
                labels=parse_labels(args.label),
                since=args.since,
                until=args.until,
                price_per_gpu_hour=args.price_per_gpu_hour,
            )
            if args.json:
                print_json(report_to_json(report))
            else:
                print(format_report(report, per_job=args.per_job))
            return 0
        commands = {
            "list": list_jobs,
            "get": get,
            "cancel": cancel,
            "events": events,
            "download": download,
            "webhooks": webhooks,
        }
        return await commands[args.command](client, args)


__all__ = ["JobSpec", "add_job_commands", "run_job_command"]
