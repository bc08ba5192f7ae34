"""The user-facing job commands: submit, watch, list, get, cancel, events, download, and
their parser registration.

The flags of a job spec come from `spec_flags`, what the commands print from `render`, and
what `submit` reads from this machine (images, a local model's family) from `local_inputs`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from lorafleet.cli.local_inputs import (
    family_from_local_model,
    image_source,
    read_images,
    say_skipped,
    upload_prefix,
)
from lorafleet.cli.render import (
    describe_estimate,
    describe_event,
    describe_job,
    estimate_json,
    event_json,
    format_age,
    format_eta,
    job_json,
    load_hint,
    print_json,
    watch_columns,
)
from lorafleet.cli.report import format_report, report_command, report_to_json
from lorafleet.cli.samples import SAMPLES_HELP, add_samples_arguments, samples_command
from lorafleet.cli.spec_flags import (
    add_spec_flags,
    given_spec_flags,
    load_document,
    load_spec_file,
    parse_labels,
    spec_from_args,
)
from lorafleet.cli.timeline import timeline_command
from lorafleet.client import AsyncClient
from lorafleet.client.api import build_spec
from lorafleet.client.dataset import TrainingFile, read_folder
from lorafleet.core.errors import InvalidArgument
from lorafleet.core.model import RESULT_FILE_NAMES, Estimate, Job, JobState, result_format
from lorafleet.core.spec import JobSpec

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


async def submit(client: AsyncClient, args: argparse.Namespace) -> int:
    """Checks everything it can (the spec, then the scheduler's checks of it for this fleet,
    then the folders, zips and URLs: every image decodes) before uploading anything, then
    uploads, then submits. A refused spec downloads nothing (`--images-url`) and `--estimate`
    reads no image."""
    # The images each spec uploads, read once the specs passed the scheduler's checks.
    readers: list[tuple[str, Callable[[], Awaitable[list[TrainingFile]]]]] = []
    if args.batch:
        refuse_flags_beside_batch(args)
        documents = load_document(Path(args.batch), "batch")
        if not isinstance(documents, list):
            raise InvalidArgument("batch", "the file must hold a list of job specs")
        if args.watch and len(documents) != 1:
            raise InvalidArgument(
                "batch", f"--watch follows one job; the file holds {len(documents)}"
            )
        specs = []
        for i, document in enumerate(documents):
            if not isinstance(document, dict):
                raise InvalidArgument(f"batch[{i}]", "must be a mapping of spec fields")
            document = dict(document)
            folder = document.pop("images", None)
            zip_file = document.pop("images_zip", None)
            url = document.pop("images_url", None)
            source = image_source(folder, zip_file, url, where=f"batch[{i}].")
            if note := family_from_local_model(document, where=f"batch[{i}]."):
                print(f"batch[{i}]: {note}", file=sys.stderr)
            if source:
                document.setdefault("instance_data_prefix", upload_prefix(source))
            try:
                build_spec(document)
            except InvalidArgument as exc:
                raise InvalidArgument(f"batch[{i}].{exc.field}", exc.reason) from None
            if source:
                readers.append(
                    (
                        document["instance_data_prefix"],
                        partial(read_images, client, folder=folder, zip_file=zip_file, url=url),
                    )
                )
            specs.append(document)
    else:
        base = load_spec_file(Path(args.spec)) if args.spec else {}
        spec = spec_from_args(args, base)
        if note := family_from_local_model(spec):
            print(note, file=sys.stderr)
        source = image_source(args.images, args.images_zip, args.images_url)
        if source:
            spec.setdefault("instance_data_prefix", args.prefix or upload_prefix(source))
        if args.class_images:
            spec.setdefault("class_data_prefix", upload_prefix(Path(args.class_images).name))
        build_spec(spec)  # the spec's own checks, as the scheduler runs them
        if source:
            readers.append(
                (
                    spec["instance_data_prefix"],
                    partial(
                        read_images,
                        client,
                        folder=args.images,
                        zip_file=args.images_zip,
                        url=args.images_url,
                    ),
                )
            )
        if args.class_images:
            readers.append(
                (spec["class_data_prefix"], partial(read_class_images, args.class_images))
            )
        specs = [spec]
    # The scheduler's checks of each spec for this fleet (a job no node of it can hold, a
    # webhook host it forbids) before any image is read, downloaded or uploaded: EstimateJob
    # runs SubmitJob's, the data's presence and the spend limit aside.
    estimates = (
        await estimate_each(client, specs, in_batch=bool(args.batch))
        if (args.estimate or readers)
        else []
    )
    if args.estimate:
        if args.json:
            print_json([estimate_json(e) for e in estimates])
        else:
            for e in estimates:
                print(describe_estimate(e))
        return 0
    uploads = [(prefix, await read()) for prefix, read in readers]
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


# submit's flags that say what one job is or uploads: a batch file's jobs say it themselves.
JOB_INPUT_FLAGS = (
    "--spec",
    "--images",
    "--images-zip",
    "--images-url",
    "--class-images",
    "--prefix",
)


def refuse_flags_beside_batch(args: argparse.Namespace) -> None:
    """A job's flags beside --batch were silently dropped (the jobs took the file's fields and
    no image was uploaded): refused, naming them, as is --idempotency-key (SubmitJobs takes
    none). The connection flags, --json, --estimate and --watch (of a one-job batch) apply."""
    given = [
        flag
        for flag in JOB_INPUT_FLAGS
        if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None
    ]
    given += given_spec_flags(args)
    if given:
        raise InvalidArgument(
            "batch",
            f"--batch takes each job's fields from its file: give {', '.join(given)} there"
            " as fields of the jobs, not as flags",
        )
    if args.idempotency_key is not None:
        raise InvalidArgument(
            "batch", "--batch submits all or nothing and takes no --idempotency-key"
        )


async def read_class_images(folder: str) -> list[TrainingFile]:
    skipped: list[str] = []
    files = await asyncio.to_thread(read_folder, folder, field="class_images", skipped=skipped)
    say_skipped(folder, skipped)
    return files


async def estimate_each(
    client: AsyncClient, specs: list[dict[str, Any]], *, in_batch: bool
) -> list[Estimate]:
    """Each spec's estimate; a refusal names the field as the batch file does (`batch[1].x`)."""
    estimates = []
    for i, spec in enumerate(specs):
        try:
            estimates.append(await client.estimate(spec))
        except InvalidArgument as exc:
            if not in_batch:
                raise
            field = exc.field.removeprefix("spec.")
            raise InvalidArgument(f"batch[{i}].{field}", exc.reason) from None
    return estimates


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
            f"{job.job_id:36}  {job.state.value:9}  {step:>11}"
            f"  {format_age(job.created_at):>9}  {labels}"
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
