"""Traces reach a collector over the wire: one job, one trace, across a worker kill.

A real OTLP/gRPC receiver (opentelemetry-proto's TraceService on a grpc.aio server on loopback)
gets spans from the real CLI process (`lorafleet submit`), the scheduler (in this process) and
two real worker processes (`python -m lorafleet.worker`, simulated trainer), each configured by
the standard OTEL_* environment. The first worker is killed after a checkpoint; the second
resumes the job, and its spans join the same trace under the scheduler's second grant.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from lorafleet.jobs.v1 import jobs_pb2 as pb
from tests.support.fleet import WORKER_TOKEN, Fleet
from tests.support.jobs import PREFIX
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S

# Real workers training the tiny model (in this process or as processes): slow, not in
# the fast lane (README, Development).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span; `wait_for` returns once a condition over them holds."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = asyncio.Condition()

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        async with self._changed:
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool]) -> None:
        async with asyncio.timeout(3 * WAIT_S), self._changed:
            await self._changed.wait_for(lambda: condition(self.spans))


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    server = grpc.aio.server()
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"http://127.0.0.1:{port}"
    finally:
        await server.stop(0)


@pytest.fixture
async def exporting_scheduler(
    receiver: tuple[Receiver, str], span_exporter: object
) -> AsyncIterator[None]:
    """The in-process scheduler's spans go over OTLP/gRPC to the receiver too (the session's
    tracer provider is set once, by `span_exporter`; this adds an exporter to it)."""
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    processor = BatchSpanProcessor(
        OTLPSpanExporter(endpoint=receiver[1], insecure=True), schedule_delay_millis=100
    )
    provider.add_span_processor(processor)
    yield
    # Shut down on another thread: its last export goes to the receiver, which this event
    # loop serves (a blocking shutdown here would wait out the exporter's retries).
    await asyncio.to_thread(processor.shutdown)


def otel_env(endpoint: str, service: str) -> dict[str, str]:
    return {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


async def start_worker(
    fleet: Fleet, endpoint: str, machine_id: str, log_dir: Path
) -> asyncio.subprocess.Process:
    env = {
        **otel_env(endpoint, f"lorafleet-worker-{machine_id}"),
        "LORAFLEET_SCHEDULER": fleet.address,
        "LORAFLEET_WORKER_TOKEN": WORKER_TOKEN,
        "LORAFLEET_ALLOW_CPU": "1",
        "LORAFLEET_COMPILE_MODEL": "off",  # auto compiles a long job: minutes here
        "SALAD_MACHINE_ID": machine_id,
        "LORAFLEET_SIMULATE_STEP_S": "0.05",
        # Stands for a GPU node: the jobs' memory estimates are not held to this host's memory.
        "LORAFLEET_VRAM_MB": "81920",
        "LORAFLEET_SIMULATE_CHECKPOINT_BYTES": "4096",
        "LORAFLEET_MIN_FREE_DISK_MB": "0",
        "LORAFLEET_MIN_FREE_MEMORY_MB": "0",
        "LORAFLEET_RECONNECT_MAX_BACKOFF_S": "0.5",
        "LORAFLEET_LOG_FORMAT": "json",
    }
    with (log_dir / f"worker-{machine_id}.log").open("wb") as log_file:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "lorafleet.worker",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )


def named(spans: list[ReceivedSpan], name: str, **attributes: Any) -> list[ReceivedSpan]:
    return [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]


@pytest.mark.parametrize("scheduler_overrides", [{"lease_ttl_s": 2.0}])
async def test_one_jobs_trace_from_the_cli_through_a_worker_kill(
    fleet: Fleet,
    receiver: tuple[Receiver, str],
    exporting_scheduler: None,
    tmp_path: Path,
) -> None:
    spans, endpoint = receiver
    # The client: the real CLI process, its span and the gRPC client span sent over OTLP.
    cli = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.app.main",
        "submit",
        "--target",
        fleet.address,
        "--api-key",
        fleet.client.api_key,
        "--json",
        "--instance-prompt",
        "a photo of sks dog",
        "--instance-data-prefix",
        PREFIX,
        "--max-train-steps",
        "60",
        "--checkpointing-steps",
        "5",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=otel_env(endpoint, "lorafleet-cli"),
    )
    out, err = await asyncio.wait_for(cli.communicate(), WAIT_S)
    assert cli.returncode == 0, err.decode()
    (submitted,) = json.loads(out)
    job_id = submitted["job_id"]

    workers: list[asyncio.subprocess.Process] = []
    try:
        workers.append(await start_worker(fleet, endpoint, "trace-w1", tmp_path))
        # The first worker's checkpoint span has reached the collector: then it is killed.
        await spans.wait_for(
            lambda got: any(
                s.name == "worker.checkpoint" and s.service == "lorafleet-worker-trace-w1"
                for s in got
            )
        )
        workers[0].send_signal(signal.SIGKILL)
        await asyncio.wait_for(workers[0].wait(), WAIT_S)
        workers.append(await start_worker(fleet, endpoint, "trace-w2", tmp_path))
        await spans.wait_for(
            lambda got: (
                bool(named(got, "scheduler.job_succeeded", **{"lorafleet.job_id": job_id}))
                and any(
                    s.name == "worker.upload_result" and s.service == "lorafleet-worker-trace-w2"
                    for s in got
                )
            )
        )
        job = await fleet.client.get(job_id)
        assert job.state == pb.JOB_STATE_SUCCEEDED
    finally:
        for process in workers:
            if process.returncode is None:
                process.kill()
            await process.wait()

    got = spans.spans
    (root,) = [s for s in got if s.service == "lorafleet-cli" and not s.parent_id]
    assert root.name == "lorafleet submit"
    ours = [s for s in got if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in ours}
    assert len(by_id) == len(ours), "span ids repeat within the trace"

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_id]

    # CLI -> gRPC client span -> the scheduler's server span -> lorafleet.submit
    (submit,) = named(ours, "lorafleet.submit")
    server_call = parent(submit)
    assert server_call.name == "/lorafleet.jobs.v1.JobService/SubmitJob"
    client_call = parent(server_call)
    assert client_call.service == "lorafleet-cli" and parent(client_call) == root

    # Two grants under the submit, one per epoch; each worker's lease under its grant.
    grants = {s.attributes["lorafleet.epoch"]: s for s in named(ours, "scheduler.grant")}
    assert sorted(grants) == [1, 2]
    assert all(parent(g) == submit for g in grants.values())
    assert grants[1].attributes["lorafleet.machine_id"] == "trace-w1"
    assert grants[2].attributes["lorafleet.machine_id"] == "trace-w2"
    (second_lease,) = named(ours, "worker.lease", **{"lorafleet.epoch": 2})
    assert second_lease.service == "lorafleet-worker-trace-w2"
    assert parent(second_lease) == grants[2]
    # The killed worker never ended its lease span; what it finished is in the trace, under
    # the first grant's lease.
    first_checkpoints = [
        s for s in named(ours, "worker.checkpoint") if s.service == "lorafleet-worker-trace-w1"
    ]
    assert first_checkpoints

    def under(span: ReceivedSpan, ancestor_id: str) -> bool:
        while span.parent_id in by_id:
            if span.parent_id == ancestor_id:
                return True
            span = by_id[span.parent_id]
        return span.parent_id == ancestor_id

    first_lease_id = first_checkpoints[0].parent_id
    assert all(s.parent_id == first_lease_id for s in first_checkpoints)
    # The resumed run: training, checkpoint and result spans under the second lease.
    for name in ("worker.train", "worker.checkpoint", "worker.upload_result"):
        mine = [s for s in named(ours, name) if s.service == "lorafleet-worker-trace-w2"]
        assert mine and all(under(s, second_lease.span_id) for s in mine), name
    # The scheduler's bookkeeping for each lease joins the trace under that lease's grant.
    commits = named(ours, "scheduler.commit_checkpoint")
    assert {c.attributes["lorafleet.epoch"] for c in commits} == {1, 2}
    assert all(parent(c) == grants[c.attributes["lorafleet.epoch"]] for c in commits)
    (succeeded,) = named(ours, "scheduler.job_succeeded")
    assert parent(succeeded) == grants[2]
    # The local store's requests (the workers' uploads) are in the trace too.
    assert named(ours, "storage.PUT")
