"""Trace context travels with the job: the submit span's context reaches the worker's grant
(through the scheduler's grant span)."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

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
