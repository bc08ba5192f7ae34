"""Webhooks: signed deliveries from the outbox, retries with backoff, give-up with a record."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.scheduler.auth import create_api_key
from lorafleet.webhooks import InvalidSignature, sign, verify
from tests.scheduler.conftest import Fleet
from tests.scheduler.harness import UserClient, connect_worker

pytestmark = pytest.mark.parametrize(
    "scheduler_overrides", [{"webhook_backoff_s": 0.01, "webhook_max_attempts": 3}]
)


@dataclass
class Receiver:
    url: str
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    app = web.Application()
    holder: list[Receiver] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        holder[0].requests.append((request.path, dict(request.headers), body))
        holder[0].arrived.set()
        return web.Response(status=500 if request.path == "/fail" else 204, text="nope")

    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    holder.append(Receiver(url=f"http://127.0.0.1:{port}"))
    yield holder[0]
    await runner.cleanup()


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
            data = b"checkpoint"
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
        lora = b"lora"
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


async def test_key_default_webhook_is_signed_and_verifies(fleet: Fleet, receiver: Receiver) -> None:
    created = await create_api_key(
        fleet.scheduler.ledger,
        "alice",
        webhook_url=f"{receiver.url}/hook",
        webhook_events=["succeeded"],
    )
    client = UserClient(fleet.alice.stub, created.key)
    job = await client.submit()
    await _finish(fleet, "m1", checkpoint=True)  # the checkpoint event is not subscribed
    await asyncio.wait_for(receiver.arrived.wait(), 15)
    ((path, headers, body),) = receiver.requests
    assert path == "/hook"
    verify(created.webhook_secret, headers, body)
    payload = json.loads(body)
    assert payload["event"] == "job.succeeded" and payload["job_id"] == job.job_id
    assert payload["state"] == "SUCCEEDED"
    assert payload["result"]["sha256"] == hashlib.sha256(b"lora").hexdigest()
    assert headers["Lorafleet-Delivery"] == str(payload["delivery_id"])
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
                "Lorafleet-Timestamp": str(old),
                "Lorafleet-Signature": sign(created.webhook_secret, old, body),
            },
            body,
        )


async def test_failing_endpoint_is_retried_then_given_up_with_a_record(
    fleet: Fleet, receiver: Receiver, database_url: str
) -> None:
    job = await fleet.alice.submit(
        webhook=pb.Webhook(url=f"{receiver.url}/fail", events=[pb.WEBHOOK_EVENT_CHECKPOINT])
    )
    done = asyncio.Queue[str]()
    listener = await asyncpg.connect(database_url)
    await listener.add_listener("lorafleet_webhook_done", lambda *args: done.put_nowait(args[-1]))
    try:
        await _finish(fleet, "m1", checkpoint=True)
        await asyncio.wait_for(done.get(), 30)
    finally:
        await listener.close()
    response = await fleet.alice.stub.ListWebhookDeliveries(
        pb.ListWebhookDeliveriesRequest(job_id=job.job_id), metadata=fleet.alice.metadata
    )
    (delivery,) = response.deliveries  # only the subscribed event
    assert delivery.event == "checkpoint" and delivery.attempts == 3
    assert delivery.HasField("gave_up_at") and not delivery.HasField("delivered_at")
    assert delivery.last_status == 500 and "HTTP 500" in delivery.last_error
    attempts = [r for r in receiver.requests if r[0] == "/fail"]
    assert len(attempts) == 3
    # Every retry is the same delivery (receivers deduplicate on it), freshly signed.
    assert len({h["Lorafleet-Delivery"] for _, h, _ in attempts}) == 1
