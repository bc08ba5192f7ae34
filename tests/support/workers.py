"""Scripted workers: one worker stream whose every message a test writes by hand, driving a
real scheduler over loopback gRPC."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from lorafleet.core.families import FAMILIES
from lorafleet.core.identity import local_identity_token
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from tests.support.artifacts import checkpoint_blob, lora_blob
from tests.support.jobs import WAIT_S

# What a real worker remembers across its reconnects: the session token of its last stream
# (per machine id) and each lease's secret. Scripted workers share them the same way, so a
# test reconnecting "m1" is the same machine; an attacker in a test passes its own values.
SESSION_TOKENS: dict[str, str] = {}
LEASE_SECRETS: dict[str, str] = {}


@dataclass
class ScriptedWorker:
    """One worker stream whose every message the test writes by hand."""

    machine_id: str
    call: Any
    received: list[fpb.ConnectResponse] = field(default_factory=list)
    welcome: fpb.Welcome | None = None

    async def send(self, **message: Any) -> None:
        await self.call.write(fpb.ConnectRequest(**message))

    async def expect(self, kind: str, timeout: float = WAIT_S) -> Any:  # noqa: ASYNC109
        """Reads until a message of `kind` arrives; others are kept in `received`."""

        async def read() -> Any:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    raise AssertionError(f"stream ended while waiting for {kind}")
                self.received.append(message)
                if message.WhichOneof("message") == "lease_granted":
                    granted = message.lease_granted
                    LEASE_SECRETS[granted.lease.lease_id] = granted.lease_secret
                if message.WhichOneof("message") == kind:
                    return getattr(message, kind)

        return await asyncio.wait_for(read(), timeout)

    async def ready_for_lease(self) -> fpb.LeaseGranted:
        await self.send(ready=fpb.Ready())
        granted: fpb.LeaseGranted = await self.expect("lease_granted")
        return granted

    async def heartbeat(self, lease: fpb.Lease, step: int, **extra: Any) -> None:
        await self.send(
            heartbeat=fpb.Heartbeat(
                lease=fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch), step=step, **extra
            )
        )

    def ref(self, lease: fpb.Lease) -> fpb.LeaseRef:
        return fpb.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch)

    async def store_checkpoint(
        self, lease: fpb.Lease, step: int, data: bytes | None = None
    ) -> None:
        """What a worker does for a checkpoint: ask for its URL, upload, then announce it.
        `data`: the stored bytes (default: a well-formed checkpoint of `step`)."""
        data = checkpoint_blob(step) if data is None else data
        slot = fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=step)
        await self.send(urls_requested=fpb.UrlsRequested(lease=self.ref(lease), slots=[slot]))
        (upload,) = (await self.expect("urls_renewed")).urls.uploads
        await http_put(upload.url, data)
        await self.send(
            checkpoint_committed=fpb.CheckpointCommitted(
                lease=self.ref(lease),
                step=step,
                key=upload.key,
                size_bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )

    async def store_result(
        self, granted: fpb.LeaseGranted, step: int, data: bytes | None = None
    ) -> None:
        """Upload the result to the grant's URL, then say the job succeeded. `data`: the
        stored bytes (default: a well-formed LoRA file)."""
        data = lora_blob() if data is None else data
        await http_put(granted.urls.result_upload.url, data)
        await self.send(
            job_succeeded=fpb.JobSucceeded(
                lease=self.ref(granted.lease),
                key=granted.urls.result_upload.key,
                size_bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                step=step,
            )
        )


async def http_put(url: str, data: bytes) -> None:
    async with aiohttp.ClientSession() as http, http.put(url, data=data) as response:
        assert response.status in (200, 201, 204), await response.text()


@asynccontextmanager
async def connect_worker(
    channel: grpc.aio.Channel,
    token: str,
    machine_id: str,
    *,
    vram_mb: int = 81_920,
    held: fpb.LeaseRef | None = None,
    held_secret: str | None = None,
    session_token: str | None = None,
    qualified: bool = True,
    identity: fpb.ProviderIdentity | None = None,
    gpu_model: str = "NVIDIA H200",
    families: Sequence[str] = FAMILIES,
) -> AsyncIterator[ScriptedWorker]:
    """A scripted worker stream. By default it presents what the machine's previous stream was
    given (session token, the held lease's secret); pass values to act as someone else.
    `identity`: the provider's proof of the machine id (none: an unverified machine).
    `families`: the model families it says it serves (every one, as a current worker)."""
    stub = fgrpc.WorkerServiceStub(channel)
    call = stub.Connect(metadata=(("authorization", f"Bearer {token}"),))
    worker = ScriptedWorker(machine_id=machine_id, call=call)
    hello = fpb.Hello(
        machine_id=machine_id,
        provider_instance_id=f"instance-{machine_id}",
        gpu_model=gpu_model,
        vram_mb=vram_mb,
        qualification=fpb.Qualification(passed=qualified, detail="scripted"),
        version="test",
        families=list(families),
    )
    if identity is not None:
        hello.identity.CopyFrom(identity)
    if held is not None:
        hello.held_lease.CopyFrom(held)
        hello.held_lease_secret = (
            LEASE_SECRETS.get(held.lease_id, "") if held_secret is None else held_secret
        )
    hello.session_token = (
        SESSION_TOKENS.get(machine_id, "") if session_token is None else session_token
    )
    await worker.send(hello=hello)
    worker.welcome = await worker.expect("welcome")
    SESSION_TOKENS[machine_id] = worker.welcome.session_token
    try:
        yield worker
    finally:
        await _close(call)


def local_identity(secret: str, machine_id: str) -> fpb.ProviderIdentity:
    """The proof `lorafleet up`'s supervisor gives a worker it starts as `machine_id`."""
    return fpb.ProviderIdentity(local_token=local_identity_token(secret, machine_id))


async def _close(call: Any) -> None:
    """Ends the stream the way a worker that stops does: half-close, then read to the end. The
    scheduler handles a stream's messages in order before it ends the stream, so every message the
    test sent has taken effect when this returns (a bare cancel could drop the last ones)."""
    if call.done():
        return  # the test ended or cancelled it itself
    try:
        await asyncio.wait_for(call.done_writing(), WAIT_S)

        async def drain() -> None:
            while await call.read() is not grpc.aio.EOF:
                pass

        await asyncio.wait_for(drain(), WAIT_S)
    except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError):
        pass  # the stream had already ended (or broke): nothing is left to take effect
    finally:
        call.cancel()
