"""The SDK against a live scheduler: every call, typed results, errors as lorafleet errors."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import aiohttp
import grpc
import pytest

from lorafleet.client import AsyncClient, Client, WatchUpdate
from lorafleet.client.api import _error
from lorafleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    LorafleetError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from lorafleet.core.model import EventKind, JobState, upload_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.scheduler.auth import create_api_key
from lorafleet.scheduler.server import Scheduler
from tests.support.artifacts import lora_blob
from tests.support.fleet import Fleet, scheduler_config
from tests.support.images import png
from tests.support.jobs import WAIT_S
from tests.support.workers import connect_worker


def _photos(directory: Path) -> Path:
    directory.mkdir()
    for i in range(3):
        (directory / f"{i}.png").write_bytes(png(i))
    (directory / "0.txt").write_text("a photo of sks dog on grass")
    (directory / "notes.md").write_text("ignored")
    return directory


async def test_async_client_end_to_end(fleet: Fleet, tmp_path: Path) -> None:
    target = f"127.0.0.1:{fleet.scheduler.port}"
    async with AsyncClient(target, api_key=fleet.alice.api_key) as client:
        keys = await client.upload_dir(_photos(tmp_path / "rex"), prefix="dogs/rex2")
        assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["0.png", "0.txt", "1.png", "2.png"]
        job = await client.submit(
            instance_prompt="a photo of sks dog",
            instance_data_prefix="dogs/rex2",
            max_train_steps=20,
            lr_scheduler="cosine",
            mixed_precision="bf16",
            labels={"batch": "sdk"},
        )
        assert job.state is JobState.QUEUED
        assert job.spec.lr_scheduler == "cosine" and job.spec.mixed_precision == "bf16"
        with pytest.raises(InvalidArgument) as bad:
            await client.submit(
                instance_prompt="x", instance_data_prefix="dogs/rex2", max_train_steps=0
            )
        assert bad.value.field == "max_train_steps"
        with pytest.raises(InvalidArgument) as missing:
            await client.submit(
                instance_prompt="x", instance_data_prefix="nothing/here", max_train_steps=5
            )
        assert missing.value.field == "spec.instance_data_prefix"
        with pytest.raises(FailedPrecondition):
            await client.download_result(job.job_id, tmp_path / "early.safetensors")

        async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
            granted = await worker.ready_for_lease()
            assert sorted(f.name for f in granted.urls.instance_files) == [
                "0.png",
                "0.txt",
                "1.png",
                "2.png",
            ]
            lora = lora_blob()
            async with (
                aiohttp.ClientSession() as http,
                http.put(granted.urls.result_upload.url, data=lora),
            ):
                pass
            await worker.send(
                job_succeeded=fpb.JobSucceeded(
                    lease=worker.ref(granted.lease),
                    key=granted.urls.result_upload.key,
                    size_bytes=len(lora),
                    sha256=hashlib.sha256(lora).hexdigest(),
                    step=20,
                )
            )
            updates = [u async for u in client.watch(job.job_id)]
        assert updates[0].event is None
        assert updates[-1].job.state is JobState.SUCCEEDED
        assert updates[-1].event is not None and updates[-1].event.kind is EventKind.SUCCEEDED
        out = await client.download_result(job.job_id, tmp_path / "rex.safetensors")
        assert out.read_bytes() == lora
        listed = [j.job_id async for j in client.list(labels={"batch": "sdk"}, page_size=1)]
        assert listed == [job.job_id]
        kinds = [e.kind for e in await client.events(job.job_id)]
        assert kinds[0] is EventKind.SUBMITTED and kinds[-1] is EventKind.SUCCEEDED
        done = await client.get(job.job_id)
        assert done.result is not None and done.gpu_seconds is not None and done.gpu_seconds > 0


async def test_blocking_client(fleet: Fleet) -> None:
    target = f"127.0.0.1:{fleet.scheduler.port}"

    def use() -> None:
        with Client(target, api_key=fleet.alice.api_key) as client:
            job = client.submit(
                {
                    "instance_prompt": "a photo of sks dog",
                    "instance_data_prefix": "dogs/rex",
                    "max_train_steps": 5,
                }
            )
            assert client.get(job.job_id).state is JobState.QUEUED
            assert [j.job_id for j in client.list(states=[JobState.QUEUED])] == [job.job_id]
            assert client.cancel(job.job_id).state is JobState.CANCELED
            updates = list(client.watch(job.job_id))
            assert updates[-1].job.state is JobState.CANCELED
            with pytest.raises(NotFound):
                client.get("00000000-0000-0000-0000-000000000000")
        with Client(target, api_key=fleet.bob.api_key) as other, pytest.raises(NotFound):
            other.get(job.job_id)

    await asyncio.to_thread(use)


async def test_watch_goes_on_across_a_scheduler_restart(database_url: str, tmp_path: Path) -> None:
    """The scheduler stops and comes back on the same address mid-watch: the watch reopens after
    the last event it saw and ends at the final state, no event lost or repeated."""
    config = scheduler_config(database_url, tmp_path / "data")
    updates: asyncio.Queue[WatchUpdate | None] = asyncio.Queue()
    async with Scheduler(config) as first:
        port = first.port
        await first.storage.put_bytes(upload_key("alice", "dogs/rex", "1.png"), b"png")
        api_key = (await create_api_key(first.ledger, "alice")).key
        client = AsyncClient(f"127.0.0.1:{port}", api_key=api_key)
        job = await client.submit(
            instance_prompt="a photo of sks dog", instance_data_prefix="dogs/rex", max_train_steps=5
        )

        async def watch() -> None:
            async for update in client.watch(job.job_id):
                updates.put_nowait(update)
            updates.put_nowait(None)

        watching = asyncio.create_task(watch())
        first_update = await asyncio.wait_for(updates.get(), WAIT_S)
        assert first_update is not None and first_update.job.state is JobState.QUEUED
    # Down: the watch keeps trying. Back on the same port, over the same ledger.
    async with Scheduler(
        scheduler_config(database_url, tmp_path / "data", listen=f"127.0.0.1:{port}")
    ):
        try:
            # The watch reopens first (it starts again with the job as it is). Only then is the
            # client's channel known to be up: a call made while it still backs off from the
            # outage fails at once with "connection refused".
            reopened = await asyncio.wait_for(updates.get(), WAIT_S)
            assert reopened is not None and reopened.job.state is JobState.QUEUED
            assert (await client.cancel(job.job_id)).state is JobState.CANCELED
            seen: list[WatchUpdate] = [reopened]
            while (update := await asyncio.wait_for(updates.get(), WAIT_S)) is not None:
                seen.append(update)
            await asyncio.wait_for(watching, WAIT_S)
        finally:
            watching.cancel()
            await client.close()
    assert seen[-1].job.state is JobState.CANCELED
    event_ids = [u.event.event_id for u in seen if u.event is not None]
    assert event_ids == sorted(set(event_ids))
    assert EventKind.CANCELED in {u.event.kind for u in seen if u.event is not None}


def test_the_blocking_client_offers_every_call_of_the_async_one() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    assert public(AsyncClient) <= public(Client)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.ALREADY_EXISTS, AlreadyExists),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    ],
)
def test_every_status_the_scheduler_answers_maps_back_to_its_error(
    code: grpc.StatusCode, kind: type[LorafleetError]
) -> None:
    err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")
    mapped = _error(err)
    assert type(mapped) is kind
    assert str(mapped) == "why"
    assert mapped.retryable is (kind is ResourceExhausted)
