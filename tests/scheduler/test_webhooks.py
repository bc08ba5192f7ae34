"""Webhooks: signed deliveries from the outbox, retries with backoff, give-up with a record; public
addresses only unless the operator allows more, and outcomes (not exception text) in the log."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import asyncpg
import grpc
import pytest
from aiohttp import web

from lorafleet.core.webhooks import InvalidSignature, sign, standard_secret, verify
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.config import SchedulerConfig
from lorafleet.scheduler.webhooks import (
    REFUSED,
    AddressPolicy,
    NotPublicAddress,
    PublicResolver,
    is_public,
    webhook_session,
)
from tests.support.artifacts import checkpoint_blob, lora_blob
from tests.support.fleet import Fleet
from tests.support.jobs import WAIT_S, JobClient, spec
from tests.support.workers import connect_worker

FAST_RETRIES: dict[str, object] = {"webhook_backoff_s": 0.01, "webhook_max_attempts": 3}
# The receivers below listen on loopback: only an operator's allowance lets webhooks reach them.
LOOPBACK_ALLOWED = {**FAST_RETRIES, "webhook_allowed_networks": "127.0.0.0/8"}
fast_retries = pytest.mark.parametrize("scheduler_overrides", [FAST_RETRIES])
loopback_allowed = pytest.mark.parametrize("scheduler_overrides", [LOOPBACK_ALLOWED])


@dataclass
class Receiver:
    url: str
    port: int
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # /hang answers only once this is set (at teardown): the sender's timeout ends it first.
    release: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """An HTTP receiver on 127.0.0.1: /fail answers 500, /redirect 307 to /elsewhere, /hang
    nothing; any other path 204."""
    app = web.Application()
    holder: list[Receiver] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        holder[0].requests.append((request.path, dict(request.headers), body))
        holder[0].arrived.set()
        if request.path == "/redirect":
            raise web.HTTPTemporaryRedirect(f"{holder[0].url}/elsewhere")
        if request.path == "/hang":
            await holder[0].release.wait()
        return web.Response(status=500 if request.path == "/fail" else 204, text="nope")

    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    holder.append(Receiver(url=f"http://127.0.0.1:{port}", port=port))
    yield holder[0]
    holder[0].release.set()
    await runner.cleanup()


@pytest.fixture
async def ended(database_url: str) -> AsyncIterator[asyncio.Queue[str]]:
    """Ids of deliveries as they end for good (delivered or given up)."""
    done = asyncio.Queue[str]()
    listener = await asyncpg.connect(database_url)
    # No replica needs to hear that a delivery ended for good; these tests do, so they add the
    # notification to their own database.
    await listener.execute(
        "CREATE FUNCTION test_notify_webhook_done() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF NEW.delivered_at IS NOT NULL OR NEW.gave_up_at IS NOT NULL THEN"
        " PERFORM pg_notify('test_webhook_done', NEW.delivery_id::text); END IF;"
        " RETURN NULL; END $$;"
        " CREATE TRIGGER test_webhook_done AFTER UPDATE ON webhook_deliveries"
        " FOR EACH ROW EXECUTE FUNCTION test_notify_webhook_done();"
    )
    await listener.add_listener("test_webhook_done", lambda *args: done.put_nowait(args[-1]))
    try:
        yield done
    finally:
        await listener.close()


async def _deliveries(client: JobClient, job_id: str) -> list[pb.WebhookDelivery]:
    response = await client.stub.ListWebhookDeliveries(
        pb.ListWebhookDeliveriesRequest(job_id=job_id), metadata=client.metadata, timeout=WAIT_S
    )
    return list(response.deliveries)


async def _canceled_delivery(
    client: JobClient, url: str, ended: asyncio.Queue[str]
) -> pb.WebhookDelivery:
    """Submits a job with a webhook for `canceled`, cancels it, and returns the delivery once it
    ended for good."""
    job = await client.submit(webhook=pb.Webhook(url=url, events=[pb.WEBHOOK_EVENT_CANCELED]))
    await client.cancel(job.job_id)
    delivery_id = await asyncio.wait_for(ended.get(), WAIT_S)
    (delivery,) = await _deliveries(client, job.job_id)
    assert str(delivery.delivery_id) == delivery_id
    return delivery


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released; nothing here reuses it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _finish(fleet: Fleet, machine: str, checkpoint: bool = False) -> str:
    async with connect_worker(fleet.channel, fleet.token, machine) as worker:
        granted = await worker.ready_for_lease()
        ref = worker.ref(granted.lease)
        if checkpoint:
            await worker.send(
                urls_requested=fpb.UrlsRequested(
                    lease=ref, slots=[fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=10)]
                )
            )
            (upload,) = (await worker.expect("urls_renewed")).urls.uploads
            data = checkpoint_blob(10)
            async with aiohttp.ClientSession() as http, http.put(upload.url, data=data):
                pass
            await worker.send(
                checkpoint_committed=fpb.CheckpointCommitted(
                    lease=ref,
                    step=10,
                    key=upload.key,
                    size_bytes=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                )
            )
        lora = lora_blob()
        async with (
            aiohttp.ClientSession() as http,
            http.put(granted.urls.result_upload.url, data=lora),
        ):
            pass
        await worker.send(
            job_succeeded=fpb.JobSucceeded(
                lease=ref,
                key=granted.urls.result_upload.key,
                size_bytes=len(lora),
                sha256=hashlib.sha256(lora).hexdigest(),
                step=100,
            )
        )
        # Keep the stream open until the scheduler has read the result.
        await fleet.alice.wait_for(
            granted.lease.job_id, lambda j: j.state == pb.JOB_STATE_SUCCEEDED
        )
        return granted.lease.job_id


@loopback_allowed
async def test_key_default_webhook_is_signed_and_verifies(fleet: Fleet, receiver: Receiver) -> None:
    created = await create_api_key(
        fleet.scheduler.ledger,
        "alice",
        webhook_url=f"{receiver.url}/hook",
        webhook_events=["succeeded"],
    )
    client = JobClient(fleet.alice.stub, created.key)
    job = await client.submit()
    await _finish(fleet, "m1", checkpoint=True)  # the checkpoint event is not subscribed
    await asyncio.wait_for(receiver.arrived.wait(), 15)
    ((path, headers, body),) = receiver.requests
    assert path == "/hook"
    verify(created.webhook_secret, headers, body)
    payload = json.loads(body)
    assert payload["event"] == "job.succeeded" and payload["job_id"] == job.job_id
    assert payload["state"] == "SUCCEEDED"
    assert payload["result"]["sha256"] == hashlib.sha256(lora_blob()).hexdigest()
    assert headers["webhook-id"] == f"lfd_{payload['delivery_id']}"
    assert headers["Lorafleet-Event"] == "job.succeeded"
    # Standard Webhooks: the ready verifier accepts it with the secret `keys create` prints.
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    printed = standard_secret(created.webhook_secret)
    assert printed.startswith("whsec_")
    assert Webhook(printed).verify(body, headers)["job_id"] == job.job_id
    verify(printed, headers, body)  # ours takes either form of the secret
    with pytest.raises(WebhookVerificationError):
        Webhook(printed).verify(body.replace(b"SUCCEEDED", b"FAILED"), headers)
    # And ours accepts what the reference signer signs.
    msg_id, at = headers["webhook-id"], datetime.fromtimestamp(int(time.time()), UTC)
    reference = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(printed).sign(msg_id, at, body.decode()),
    }
    verify(created.webhook_secret, reference, body)
    with pytest.raises(InvalidSignature):
        verify(created.webhook_secret, headers, body.replace(b"SUCCEEDED", b"FAILED"))
    with pytest.raises(InvalidSignature):
        verify("another secret", headers, body)
    old = int(time.time()) - 3600
    with pytest.raises(InvalidSignature, match="tolerance"):
        verify(
            created.webhook_secret,
            {
                **headers,
                "webhook-timestamp": str(old),
                "webhook-signature": sign(created.webhook_secret, headers["webhook-id"], old, body),
            },
            body,
        )


@loopback_allowed
async def test_failing_endpoint_is_retried_then_given_up_with_a_record(
    fleet: Fleet, receiver: Receiver, ended: asyncio.Queue[str]
) -> None:
    job = await fleet.alice.submit(
        webhook=pb.Webhook(url=f"{receiver.url}/fail", events=[pb.WEBHOOK_EVENT_CHECKPOINT])
    )
    await _finish(fleet, "m1", checkpoint=True)
    await asyncio.wait_for(ended.get(), 30)
    (delivery,) = await _deliveries(fleet.alice, job.job_id)  # only the subscribed event
    assert delivery.event == "checkpoint" and delivery.attempts == 3
    assert delivery.HasField("gave_up_at") and not delivery.HasField("delivered_at")
    # The outcome, not the receiver's body ("nope": that goes to the scheduler's log).
    assert delivery.last_status == 500 and delivery.last_error == "HTTP 500"
    attempts = [r for r in receiver.requests if r[0] == "/fail"]
    assert len(attempts) == 3
    # Every retry is the same delivery (receivers deduplicate on it), freshly signed.
    assert len({h["webhook-id"] for _, h, _ in attempts}) == 1


@fast_retries
async def test_loopback_webhook_is_refused_by_default_and_recorded_as_refused(
    fleet: Fleet, receiver: Receiver, ended: asyncio.Queue[str]
) -> None:
    # A key's default webhook is set by the operator, so nothing checks it at submit: delivery
    # is where it is refused.
    created = await create_api_key(
        fleet.scheduler.ledger, "alice", webhook_url=f"{receiver.url}/hook"
    )
    client = JobClient(fleet.alice.stub, created.key)
    job = await client.submit()
    await client.cancel(job.job_id)
    await asyncio.wait_for(ended.get(), WAIT_S)
    (delivery,) = await _deliveries(client, job.job_id)
    assert delivery.HasField("gave_up_at") and not delivery.HasField("delivered_at")
    # Refused before any connection, and not retried: no attempt could go anywhere else.
    assert delivery.attempts == 1 and delivery.last_status == 0
    assert delivery.last_error == REFUSED
    assert receiver.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://10.1.2.3/hook",
        "http://172.16.0.1/hook",
        "https://192.168.1.10/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://100.64.0.1/hook",
        "http://0.0.0.0:80/hook",
        "http://224.0.0.1/hook",
        "http://[::1]:8080/hook",
        "http://[fd00::1]/hook",
        "http://[fe80::1]/hook",
        "http://[::ffff:10.0.0.1]/hook",
    ],
)
@fast_retries
async def test_webhook_to_a_non_public_literal_is_refused_at_submit(fleet: Fleet, url: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await fleet.alice.submit(webhook=pb.Webhook(url=url))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith("spec.webhook.url: "), raised.value.details()
    # In a batch, the field names the job.
    batch = pb.SubmitJobsRequest(
        jobs=[
            pb.SubmitJobRequest(spec=spec()),
            pb.SubmitJobRequest(spec=spec(webhook=pb.Webhook(url=url))),
        ]
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await fleet.alice.stub.SubmitJobs(batch, metadata=fleet.alice.metadata, timeout=WAIT_S)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith("jobs[1].spec.webhook.url: ")


@fast_retries
async def test_public_literal_and_names_pass_submit(fleet: Fleet) -> None:
    for url in ("https://93.184.215.14/hook", "https://hooks.example.com/x", "http://localhost/"):
        await fleet.alice.submit(webhook=pb.Webhook(url=url))


@fast_retries
async def test_name_resolving_to_loopback_is_refused_at_delivery(
    fleet: Fleet, receiver: Receiver, ended: asyncio.Queue[str]
) -> None:
    delivery = await _canceled_delivery(
        fleet.alice, f"http://localhost:{receiver.port}/hook", ended
    )
    assert delivery.HasField("gave_up_at") and not delivery.HasField("delivered_at")
    assert delivery.attempts == 1 and delivery.last_error == REFUSED
    assert receiver.requests == []


@loopback_allowed
async def test_operator_allowance_lets_names_and_literals_through(
    fleet: Fleet, receiver: Receiver, ended: asyncio.Queue[str]
) -> None:
    delivery = await _canceled_delivery(
        fleet.alice, f"http://localhost:{receiver.port}/by-name", ended
    )
    assert delivery.HasField("delivered_at") and delivery.last_status == 204
    delivery = await _canceled_delivery(fleet.alice, f"{receiver.url}/by-address", ended)
    assert delivery.HasField("delivered_at") and delivery.last_status == 204
    (by_name, by_address) = receiver.requests
    # Connected to the vetted address, still speaking to the name.
    assert by_name[0] == "/by-name" and by_name[1]["Host"] == f"localhost:{receiver.port}"
    assert by_address[0] == "/by-address"


@pytest.mark.parametrize(
    "scheduler_overrides",
    [{**LOOPBACK_ALLOWED, "webhook_max_attempts": 1, "webhook_timeout_s": 0.5}],
)
async def test_delivery_log_shows_outcomes_not_connection_errors(
    fleet: Fleet, receiver: Receiver, ended: asyncio.Queue[str]
) -> None:
    closed = await _canceled_delivery(fleet.alice, f"http://127.0.0.1:{_closed_port()}/", ended)
    hung = await _canceled_delivery(fleet.alice, f"{receiver.url}/hang", ended)
    moved = await _canceled_delivery(fleet.alice, f"{receiver.url}/redirect", ended)
    assert closed.last_error == "unreachable" and closed.last_status == 0
    assert hung.last_error == "timeout" and hung.last_status == 0
    assert moved.last_error == "HTTP 307 (redirects are not followed)"
    assert moved.last_status == 307
    assert [r[0] for r in receiver.requests] == ["/hang", "/redirect"]  # not /elsewhere
    for delivery in (closed, hung, moved):
        assert delivery.HasField("gave_up_at")
        assert "127.0.0.1" not in delivery.last_error and "onnect" not in delivery.last_error


# The address policy and the resolver on their own.


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("93.184.215.14", True),
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("10.0.0.1", False),
        ("172.31.255.255", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("100.127.255.254", False),
        ("0.0.0.0", False),
        ("224.0.0.251", False),
        ("239.255.255.250", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("192.0.2.1", False),
        ("::", False),
        ("::1", False),
        ("fc00::1", False),
        ("fd12:3456::1", False),
        ("fe80::1", False),
        ("fec0::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("::ffff:8.8.8.8", True),
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
        ("2001:db8::1", False),
    ],
)
def test_public_addresses(address: str, public: bool) -> None:
    assert is_public(ipaddress.ip_address(address)) is public


def test_allowed_networks_extend_the_public_ones() -> None:
    policy = AddressPolicy.from_text("127.0.0.0/8, 10.20.0.0/16")
    assert policy.permits(ipaddress.ip_address("127.0.0.1"))
    assert policy.permits(ipaddress.ip_address("::ffff:127.0.0.1"))
    assert policy.permits(ipaddress.ip_address("10.20.1.2"))
    assert policy.permits(ipaddress.ip_address("8.8.8.8"))
    assert not policy.permits(ipaddress.ip_address("10.21.0.1"))
    assert not policy.permits(ipaddress.ip_address("::1"))
    assert not AddressPolicy().permits(ipaddress.ip_address("127.0.0.1"))


def test_allowed_networks_are_checked_at_start() -> None:
    config = SchedulerConfig(webhook_allowed_networks=" 127.0.0.0/8 , ::1/128")
    assert config.webhook_allowed_networks == "127.0.0.0/8,::1/128"
    for bad in ("10.0.0.1/8", "localhost", "10.0.0.0/33"):
        with pytest.raises(ValueError, match="webhook_allowed_networks"):
            SchedulerConfig(webhook_allowed_networks=bad)


def _lookup_of(table: dict[str, list[str]], calls: list[str]) -> Any:
    async def lookup(host: str, port: int, **_: object) -> list[tuple[Any, ...]]:
        calls.append(host)
        out: list[tuple[Any, ...]] = []
        for text in table[host]:
            if ":" in text:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (text, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (text, port)))
        return out

    return lookup


async def test_resolver_refuses_internal_names_and_drops_internal_addresses_of_mixed_ones() -> None:
    table = {
        "metadata.example": ["169.254.169.254"],
        "internal.example": ["10.0.0.7", "fd00::7"],
        "mixed.example": ["10.0.0.7", "93.184.215.14"],
    }
    resolver = PublicResolver(AddressPolicy(), lookup=_lookup_of(table, []))
    for host in ("metadata.example", "internal.example"):
        with pytest.raises(NotPublicAddress):
            await resolver.resolve(host, 443)
    (only,) = await resolver.resolve("mixed.example", 443)
    assert only["host"] == "93.184.215.14" and only["hostname"] == "mixed.example"
    assert only["flags"] & socket.AI_NUMERICHOST  # nothing looks the address up again


async def test_the_connection_goes_to_the_address_the_resolver_vetted(receiver: Receiver) -> None:
    # `receiver.test` exists only in this lookup: reaching the receiver through it proves the
    # connection used the vetted answer, with no second lookup anywhere.
    calls: list[str] = []
    policy = AddressPolicy.from_text("127.0.0.0/8")
    lookup = _lookup_of({"receiver.test": ["127.0.0.1"]}, calls)
    async with webhook_session(policy, timeout_s=WAIT_S, lookup=lookup) as http:
        url = f"http://receiver.test:{receiver.port}/vetted"
        async with http.post(url, data=b"{}", allow_redirects=False) as response:
            assert response.status == 204
    assert calls == ["receiver.test"]
    ((path, headers, _),) = receiver.requests
    assert path == "/vetted" and headers["Host"] == f"receiver.test:{receiver.port}"
    # Without the allowance the same name is refused before any connection.
    async with webhook_session(AddressPolicy(), timeout_s=WAIT_S, lookup=lookup) as http:
        with pytest.raises(NotPublicAddress):
            await http.post(f"http://receiver.test:{receiver.port}/refused")
    assert len(receiver.requests) == 1
