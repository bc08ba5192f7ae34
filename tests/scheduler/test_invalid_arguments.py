"""Property: every request, however malformed, gets OK or INVALID_ARGUMENT naming a real field.

Hypothesis mutates valid requests field by field (and builds wild ones), sends them over real
gRPC, and checks that no request ever produces an internal error and that rejected submissions
write nothing to the ledger.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from tests.support.fleet import Fleet

SPEC_FIELDS = {f.name for f in pb.JobSpec.DESCRIPTOR.fields}
EXAMPLES = 150
ints = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([0, -1, 1, 7, 8, 64, 100, 1024, 100_000, 100_001]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, -1.0, 1e-4, 0.5, 1.0, 1.5, 1e9]),
)
texts = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", " ", "../x", "a/../b", "/abs", "a//b", "a\x00b", "x" * 3000, "dogs/rex"]),
)
_FIELD_VALUES: dict[int, st.SearchStrategy[Any]] = {}


def _value_for(field: Any) -> st.SearchStrategy[Any]:
    t = field.type
    if t == field.TYPE_STRING:
        return texts
    if t == field.TYPE_BOOL:
        return st.booleans()
    if t in (field.TYPE_INT32, field.TYPE_INT64):
        return ints
    if t in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        return floats
    if t == field.TYPE_ENUM:
        return st.integers(-3, 12)
    raise AssertionError(field.name)


@st.composite
def job_specs(draw: st.DrawFn) -> pb.JobSpec:
    spec = pb.JobSpec(
        instance_prompt="a photo of sks dog", instance_data_prefix="dogs/rex", max_train_steps=10
    )
    fields = [f for f in pb.JobSpec.DESCRIPTOR.fields if f.name not in ("labels", "webhook")]
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3)):
        if field.is_repeated:  # validation_prompts
            getattr(spec, field.name).extend(draw(st.lists(_value_for(field), max_size=20)))
        else:
            setattr(spec, field.name, draw(_value_for(field)))
    if draw(st.booleans()):
        for key, value in draw(st.dictionaries(texts, texts, max_size=3)).items():
            spec.labels[key] = value
    if draw(st.booleans()):
        spec.webhook.url = draw(st.one_of(texts, st.just("https://example.test/hook")))
        spec.webhook.events.extend(
            pb.WebhookEvent.ValueType(e) for e in draw(st.lists(st.integers(-2, 6), max_size=3))
        )
    return spec


def _field_of(details: str) -> str:
    return details.split(":", 1)[0]


def _check_spec_error(details: str, prefix: str) -> None:
    field = _field_of(details)
    if field == prefix.replace("spec.", "idempotency_key"):
        return
    assert field.startswith(prefix), details
    name = re.split(r"[.\[]", field.removeprefix(prefix))[0]
    assert name in SPEC_FIELDS | {"idempotency_key"}, details


async def test_bad_requests_get_invalid_argument_naming_the_field(fleet: Fleet) -> None:
    port = fleet.scheduler.port
    metadata = fleet.alice.metadata
    accepted: list[str] = []

    def drive() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pbgrpc.JobServiceStub(channel)

            def call(method: Any, request: Any) -> Any:
                try:
                    return method(request, metadata=metadata, timeout=10)
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                        err.code(),
                        err.details(),
                        request,
                    )
                    return err

            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
            @given(spec=job_specs(), key=st.one_of(st.just(""), texts))
            def submit(spec: pb.JobSpec, key: str) -> None:
                result = call(stub.SubmitJob, pb.SubmitJobRequest(spec=spec, idempotency_key=key))
                if isinstance(result, grpc.RpcError):
                    _check_spec_error(result.details() or "", "spec.")
                else:
                    accepted.append(result.job.job_id)

            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
            @given(specs=st.lists(job_specs(), min_size=0, max_size=4))
            def submit_batch(specs: list[pb.JobSpec]) -> None:
                request = pb.SubmitJobsRequest(jobs=[pb.SubmitJobRequest(spec=s) for s in specs])
                result = call(stub.SubmitJobs, request)
                if isinstance(result, grpc.RpcError):
                    details = result.details() or ""
                    if not specs:
                        assert _field_of(details) == "jobs", details
                    else:
                        assert re.match(r"jobs\[\d+\]\.(spec\.|idempotency_key)", details), details
                        _check_spec_error(
                            details, re.sub(r"^(jobs\[\d+\]\.).*", r"\1spec.", details)
                        )
                else:
                    accepted.extend(j.job_id for j in result.jobs)

            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
            @given(
                job_id=texts,
                page_size=ints,
                token=texts,
                states=st.lists(st.integers(-2, 8), max_size=3),
                labels=st.dictionaries(texts, texts, max_size=2),
                after=st.integers(-(2**40), 2**40),
                prefix=texts,
                names=st.lists(texts, max_size=3),
            )
            def others(
                job_id: str,
                page_size: int,
                token: str,
                states: list[int],
                labels: dict[str, str],
                after: int,
                prefix: str,
                names: list[str],
            ) -> None:
                for method, request, fields in (
                    (stub.GetJob, pb.GetJobRequest(job_id=job_id), {"job_id"}),
                    (stub.CancelJob, pb.CancelJobRequest(job_id=job_id), {"job_id"}),
                    (stub.GetJobArtifacts, pb.GetJobArtifactsRequest(job_id=job_id), {"job_id"}),
                    (
                        stub.ListJobEvents,
                        pb.ListJobEventsRequest(
                            job_id=job_id, after_event_id=after, page_size=page_size
                        ),
                        {"job_id", "after_event_id", "page_size"},
                    ),
                    (
                        stub.ListJobs,
                        pb.ListJobsRequest(
                            page_size=page_size,
                            page_token=token,
                            states=[pb.JobState.ValueType(s) for s in states],
                            labels=labels,
                        ),
                        {"page_size", "page_token", "labels"} | {f"states[{i}]" for i in range(3)},
                    ),
                    (
                        stub.CreateUploadUrls,
                        pb.CreateUploadUrlsRequest(prefix=prefix, file_names=names),
                        {"prefix", "file_names"} | {f"file_names[{i}]" for i in range(3)},
                    ),
                ):
                    try:
                        method(request, metadata=metadata, timeout=10)
                    except grpc.RpcError as err:
                        # A well-formed id of a job that is not ours is NOT_FOUND, never INTERNAL.
                        assert err.code() in (
                            grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.NOT_FOUND,
                        ), (err.code(), err.details(), request)
                        if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                            assert _field_of(err.details() or "") in fields, err.details()

            submit()
            submit_batch()
            others()

    await asyncio.to_thread(drive)
    # Nothing rejected was written: the ledger holds exactly the accepted jobs.
    listed: list[str] = []
    token = ""
    while True:
        page = await fleet.alice.stub.ListJobs(
            pb.ListJobsRequest(page_size=1000, page_token=token), metadata=metadata
        )
        listed.extend(j.job_id for j in page.jobs)
        if not (token := page.next_page_token):
            break
    assert sorted(listed) == sorted(set(accepted))


WORKER_MESSAGES = st.one_of(
    st.builds(
        lambda lease_id, epoch, step, loss: fpb.ConnectRequest(
            heartbeat=fpb.Heartbeat(
                lease=fpb.LeaseRef(lease_id=lease_id, epoch=epoch), step=step, loss=loss
            )
        ),
        texts,
        ints,
        ints,
        floats,
    ),
    st.builds(
        lambda lease_id, epoch, step, key, size, sha: fpb.ConnectRequest(
            checkpoint_committed=fpb.CheckpointCommitted(
                lease=fpb.LeaseRef(lease_id=lease_id, epoch=epoch),
                step=step,
                key=key,
                size_bytes=size,
                sha256=sha,
            )
        ),
        texts,
        ints,
        ints,
        texts,
        ints,
        st.one_of(texts, st.just("a" * 64)),
    ),
    st.builds(
        lambda lease_id, epoch, cls, message: fpb.ConnectRequest(
            job_failed=fpb.JobFailed(
                lease=fpb.LeaseRef(lease_id=lease_id, epoch=epoch),
                failure_class=pb.FailureClass.ValueType(cls),
                message=message,
            )
        ),
        texts,
        ints,
        st.integers(-2, 6),
        texts,
    ),
    st.builds(
        lambda lease_id, epoch, kinds: fpb.ConnectRequest(
            urls_requested=fpb.UrlsRequested(
                lease=fpb.LeaseRef(lease_id=lease_id, epoch=epoch),
                slots=[
                    fpb.UploadSlot(kind=fpb.ArtifactKind.ValueType(k), step=s, index=i)
                    for k, s, i in kinds
                ],
            )
        ),
        texts,
        ints,
        st.lists(st.tuples(st.integers(-1, 5), ints, ints), max_size=3),
    ),
    st.builds(
        lambda lease_id, epoch, reason: fpb.ConnectRequest(
            draining=fpb.Draining(lease=fpb.LeaseRef(lease_id=lease_id, epoch=epoch), reason=reason)
        ),
        texts,
        ints,
        texts,
    ),
    st.just(fpb.ConnectRequest()),
    st.just(fpb.ConnectRequest(hello=fpb.Hello(machine_id="again"))),
)


async def test_a_batch_of_one_names_its_fields_as_a_batch(fleet: Fleet) -> None:
    """SubmitJobs names a field `jobs[i].spec...` however many jobs it holds: a batch of one
    whose images are missing said `spec.instance_data_prefix` (the fuzzing above found it, in
    a clean clone's run)."""
    stub = pbgrpc.JobServiceStub(fleet.channel)
    spec = pb.JobSpec(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="nothing-here",
        max_train_steps=10,
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.SubmitJobs(
            pb.SubmitJobsRequest(jobs=[pb.SubmitJobRequest(spec=spec)]),
            metadata=fleet.alice.metadata,
            timeout=30,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("jobs[0].spec.instance_data_prefix: no files")


# A hundred streams from one address in a few seconds: past the per-peer stream bound, which
# is not what this test is about (test_hostile_holders.py is).
@pytest.mark.parametrize("scheduler_overrides", [{"worker_streams_per_peer_per_min": 0}])
async def test_bad_worker_messages_never_cause_an_internal_error(fleet: Fleet) -> None:
    """A malformed worker message ends the stream with INVALID_ARGUMENT naming the field, or is
    refused as stale (Rejected); the scheduler never fails internally and stays up."""
    port = fleet.scheduler.port
    metadata = (("authorization", f"Bearer {fleet.token}"),)
    outcomes: Counter[str] = Counter()

    def drive() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = fgrpc.WorkerServiceStub(channel)

            @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
            @given(message=WORKER_MESSAGES)
            def one(message: fpb.ConnectRequest) -> None:
                # A machine id per example: each stream is a machine of its own.
                outcomes["examples"] += 1
                hello = fpb.ConnectRequest(
                    hello=fpb.Hello(
                        machine_id=f"fuzz-{outcomes['examples']}",
                        vram_mb=1,
                        qualification=fpb.Qualification(passed=True),
                    )
                )
                responses = stub.Connect(iter([hello, message]), metadata=metadata, timeout=10)
                try:
                    kinds = [r.WhichOneof("message") for r in responses]
                    outcomes["rejected" if "rejected" in kinds else "ok"] += 1
                    assert kinds[0] == "welcome"
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.details(), message)
                    field = _field_of(err.details() or "")
                    assert field.split(".")[0] in {
                        "heartbeat",
                        "checkpoint_committed",
                        "job_failed",
                        "urls_requested",
                        "draining",
                        "message",
                        "hello",
                    }, err.details()
                    outcomes["invalid"] += 1

            one()

    await asyncio.to_thread(drive)
    assert outcomes["invalid"] > 0 and outcomes["rejected"] > 0
    # Still serving after all that.
    assert (await fleet.alice.submit()).state == pb.JOB_STATE_QUEUED
