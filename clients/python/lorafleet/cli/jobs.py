"""The user-facing job commands: submit, watch, list, get, cancel, events, download.

Every JobSpec field is a flag (`--learning-rate 2e-4`, `--train-text-encoder`,
`--label team=a`), derived from the proto so that no option can be forgotten; a YAML or JSON
file (`--spec job.yaml`) gives the same fields, and flags override it.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from lorafleet.cli.report import format_report, report_command, report_to_json
from lorafleet.cli.timeline import timeline_command
from lorafleet.client import AsyncClient
from lorafleet.errors import InvalidArgument
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.model import Job, JobEvent, JobState
from lorafleet.spec import JobSpec

_ENUM_FIELDS = {
    "lr_scheduler": [
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
    ],
    "mixed_precision": ["no", "fp16", "bf16"],
    "caption_mode": ["file_else_prompt", "instance_prompt"],
}


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="scheduler host:port (LORAFLEET_TARGET, localhost:50051)")
    parser.add_argument("--api-key", help="API key (LORAFLEET_API_KEY)")
    parser.add_argument("--tls", action="store_true", help="connect over TLS")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("job spec (any field of lorafleet.jobs.v1.JobSpec)")
    for field in pb.JobSpec.DESCRIPTOR.fields:
        flag = "--" + field.name.replace("_", "-")
        if field.name in ("labels", "webhook"):
            continue
        if field.name in _ENUM_FIELDS:
            group.add_argument(flag, dest=f"spec_{field.name}", choices=_ENUM_FIELDS[field.name])
        elif field.type == field.TYPE_BOOL:
            group.add_argument(
                flag, dest=f"spec_{field.name}", action=argparse.BooleanOptionalAction, default=None
            )
        elif field.type in (field.TYPE_INT32, field.TYPE_INT64):
            group.add_argument(flag, dest=f"spec_{field.name}", type=int, metavar="N")
        elif field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
            group.add_argument(flag, dest=f"spec_{field.name}", type=float, metavar="X")
        else:
            group.add_argument(flag, dest=f"spec_{field.name}", metavar="TEXT")
    group.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    group.add_argument("--webhook-url", help="POST signed notifications here")
    group.add_argument(
        "--webhook-event",
        action="append",
        default=[],
        choices=["checkpoint", "succeeded", "failed", "canceled"],
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
        "step": p.step,
        "max_steps": p.max_steps,
        "loss": p.loss,
        "seconds_per_step": p.seconds_per_step,
        "eta_seconds": p.eta_seconds,
        "machine_id": job.machine_id,
        "error": job.error,
        "failure_class": job.failure_class.value if job.failure_class else None,
        "result": vars(job.result) if job.result else None,
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


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def describe_job(job: Job) -> str:
    p = job.progress
    lines = [
        f"job        {job.job_id}",
        f"state      {job.state.value}" + (f" ({job.error})" if job.error else ""),
        f"progress   step {p.step}/{p.max_steps}"
        + (f", loss {p.loss:.4f}" if p.loss is not None else "")
        + (f", {p.seconds_per_step:.2f} s/step" if p.seconds_per_step else "")
        + (f", ETA {p.eta_seconds:.0f} s" if p.eta_seconds and not job.state.terminal else ""),
        f"attempts   {job.epoch} (failures {job.failures})",
        f"machine    {job.machine_id or '-'}",
        f"checkpoint {job.latest_checkpoint.step if job.latest_checkpoint else '-'}",
        f"result     {job.result.key if job.result else '-'}",
        f"gpu        {job.gpu_seconds or 0:.0f} s",
        f"prompt     {job.spec.instance_prompt!r} on {job.spec.instance_data_prefix}",
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


async def submit(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.batch:
        documents = load_document(Path(args.batch))
        if not isinstance(documents, list):
            raise InvalidArgument("batch", "the file must hold a list of job specs")
        specs = []
        for i, document in enumerate(documents):
            if not isinstance(document, dict):
                raise InvalidArgument(f"batch[{i}]", "must be a mapping of spec fields")
            document = dict(document)
            images = document.pop("images", None)
            if images:
                prefix = document.setdefault("instance_data_prefix", _upload_prefix(Path(images)))
                await client.upload_dir(Path(images), prefix=prefix)
            specs.append(document)
        jobs = await client.submit_batch(specs)
    else:
        base = load_document(Path(args.spec)) if args.spec else {}
        spec = spec_from_args(args, base)
        if args.images:
            spec.setdefault(
                "instance_data_prefix", args.prefix or _upload_prefix(Path(args.images))
            )
            await client.upload_dir(Path(args.images), prefix=spec["instance_data_prefix"])
        if args.class_images:
            spec.setdefault("class_data_prefix", _upload_prefix(Path(args.class_images)))
            await client.upload_dir(Path(args.class_images), prefix=spec["class_data_prefix"])
        jobs = [await client.submit(spec, idempotency_key=args.idempotency_key or "")]
    if args.json:
        print_json([job_json(j) for j in jobs])
    else:
        for job in jobs:
            print(f"submitted {job.job_id} ({job.state.value.lower()})")
    if args.watch and len(jobs) == 1:
        return await watch(client, jobs[0].job_id, as_json=args.json)
    return 0


def _upload_prefix(directory: Path) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in directory.resolve().name)
    return f"{safe or 'images'}-{uuid.uuid4().hex[:8]}"


async def watch(client: AsyncClient, job_id: str, *, as_json: bool) -> int:
    """Follows the job to its end; exit code 0 only if it succeeded."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    final: Job | None = None
    if as_json:
        async for update in client.watch(job_id):
            final = update.job
            if update.event is not None:
                print(json.dumps(event_json(update.event)), flush=True)
        return 0 if final is not None and final.state is JobState.SUCCEEDED else 1
    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]{task.fields[state]}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[sps]} s/step"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = None
        async for update in client.watch(job_id):
            job = final = update.job
            p = job.progress
            state = job.state.value.lower()
            loss = f"{p.loss:.4f}" if p.loss is not None else "-"
            sps = f"{p.seconds_per_step:.2f}" if p.seconds_per_step else "-"
            if task is None:
                task = progress.add_task(
                    "train", total=p.max_steps, completed=p.step, state=state, loss=loss, sps=sps
                )
            progress.update(task, completed=p.step, state=state, loss=loss, sps=sps)
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


async def download(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        step = None if args.checkpoint == "latest" else int(args.checkpoint)
        out = Path(args.output or f"{args.job_id}-checkpoint.bin")
        await client.download_checkpoint(args.job_id, step, out)
    else:
        out = Path(args.output or "pytorch_lora_weights.safetensors")
        await client.download_result(args.job_id, out)
        print(
            f"wrote {out}; load it with:\n"
            f"  pipe.load_lora_weights({str(out.parent)!r}, weight_name={out.name!r})",
            file=sys.stderr,
        )
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
    p.add_argument("--images", help="a local folder of images (+ .txt captions) to upload")
    p.add_argument("--class-images", help="a local folder of class images to upload")
    p.add_argument("--prefix", help="storage prefix for --images (default: folder name + id)")
    p.add_argument("--spec", help="YAML or JSON file of spec fields (flags override it)")
    p.add_argument("--batch", help="YAML or JSON list of specs, submitted all or nothing")
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the first job")
    p.add_argument("--watch", action="store_true", help="follow the job until it ends")
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

    p = sub.add_parser("download", help="download the final LoRA (or a checkpoint)")
    add_connection_flags(p)
    p.add_argument("job_id")
    p.add_argument("-o", "--output", help="file to write")
    p.add_argument("--checkpoint", metavar="STEP|latest", help="a retained checkpoint instead")


async def run_job_command(args: argparse.Namespace) -> int:
    async with AsyncClient(args.target, api_key=args.api_key, tls=args.tls) as client:
        if args.command == "submit":
            return await submit(client, args)
        if args.command == "watch":
            return await watch(client, args.job_id, as_json=args.json)
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
        }
        return await commands[args.command](client, args)


__all__ = ["JobSpec", "add_job_commands", "run_job_command"]
