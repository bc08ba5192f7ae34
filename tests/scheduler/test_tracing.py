"""Trace context travels with the job: the submit span's context reaches the worker's grant
(through the scheduler's grant span)."""

from __future__ import annotations

import dataclasses

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.ledger.ledger import Ledger
from tests.scheduler.test_ledger import SECRET, TTL_S, new_job
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


async def test_grant_carries_the_submit_trace(
    fleet: Fleet, span_exporter: InMemorySpanExporter
) -> None:
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
    submit_spans = [
        s
        for s in span_exporter.get_finished_spans()
        if s.name == "lorafleet.submit"
        and s.attributes
        and s.attributes.get("lorafleet.job_ids") == (job.job_id,)
    ]
    assert len(submit_spans) == 1
    context = submit_spans[0].context
    assert context is not None
    version, trace_id, span_id, _flags = granted.traceparent.split("-")
    assert version == "00"
    assert int(trace_id, 16) == context.trace_id
    # The worker's spans go under the grant's span, which is the submit span's child.
    (grant,) = [
        s
        for s in span_exporter.get_finished_spans()
        if s.name == "scheduler.grant"
        and s.attributes
        and s.attributes.get("lorafleet.job_id") == job.job_id
    ]
    assert grant.context is not None and grant.parent is not None
    assert int(span_id, 16) == grant.context.span_id
    assert grant.parent.span_id == context.span_id
    assert grant.attributes is not None and grant.attributes["lorafleet.epoch"] == 1


async def test_a_resumed_lease_keeps_its_grant_as_parent(
    fleet: Fleet, span_exporter: InMemorySpanExporter
) -> None:
    """The worker's stream drops after its grant and it resumes the lease on a new one: what
    the scheduler does for the lease afterwards still joins the trace under that lease's grant
    span (the parent of the worker's own spans), not under the job's submit span."""
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
    async with connect_worker(
        fleet.channel, fleet.token, "m1", held=worker.ref(granted.lease)
    ) as back:
        assert back.welcome is not None
        assert back.welcome.resumed_lease.lease_id == granted.lease.lease_id
        await back.expect("urls_renewed")  # the resumed lease's URL set
        await back.store_checkpoint(granted.lease, 10)
        await back.store_result(granted, 100)
    # Leaving the block closed the stream after the scheduler handled every message above.
    assert (await fleet.alice.get(job.job_id)).state == pb.JOB_STATE_SUCCEEDED

    def only(name: str) -> ReadableSpan:
        (span,) = [
            s
            for s in span_exporter.get_finished_spans()
            if s.name == name
            and s.attributes
            and s.attributes.get("lorafleet.job_id") == job.job_id
        ]
        return span

    grant = only("scheduler.grant")
    assert grant.context is not None
    assert granted.traceparent.split("-")[2] == f"{grant.context.span_id:016x}"
    for name in ("scheduler.commit_checkpoint", "scheduler.job_succeeded"):
        span = only(name)
        assert span.parent is not None, name
        assert span.parent.span_id == grant.context.span_id, name
        assert span.context is not None and span.context.trace_id == grant.context.trace_id


async def test_the_ledger_resumes_a_lease_under_its_recorded_grant(ledger: Ledger) -> None:
    """Any replica's resume reads the grant span from the ledger; a lease granted before grants
    were recorded resumes under the job's submit span, as it did then."""
    submit = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    grant = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
    await ledger.insert_jobs("alice", [dataclasses.replace(new_job(), traceparent=submit)])
    job = await ledger.claim_job("m1", 80_000, TTL_S, secret_sha256=SECRET)
    assert job is not None and job.lease_id is not None

    async def resumed_traceparent() -> str:
        assert job.lease_id is not None
        resumed = await ledger.resume_lease(
            job.lease_id, job.epoch, "m1", TTL_S, secret_sha256=SECRET
        )
        assert resumed is not None and resumed.job.job_id == job.job_id
        return resumed.traceparent

    assert await resumed_traceparent() == submit
    await ledger.set_lease_traceparent(job.lease_id, job.epoch, grant)
    assert await resumed_traceparent() == grant
