"""A worker stream that ends while the scheduler is writing to it ends quietly (issue 31,
found by bench/lb_attack.py): a replica thawed after a SIGSTOP found its workers gone with
replies still being written, and asyncio logged each unfinished write at ERROR ("Task
exception was never retrieved ... ExecuteBatchError"), a line an operator would page on. A
replica restarting with writes stuck on slow workers did the same."""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from tests.support.fleet import WORKER_TOKEN, Fleet
from tests.support.jobs import WAIT_S
from tests.support.workers import LEASE_SECRETS, SESSION_TOKENS, connect_worker


@pytest.mark.parametrize(
    "scheduler_overrides", [{"worker_outbox_limit": 10_000, "worker_message_burst": 1000}]
)
async def test_a_stream_ended_during_a_write_logs_no_error(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "m1") as reader:
        granted = await reader.ready_for_lease()
    held = reader.ref(granted.lease)
    hello = fpb.ConnectRequest(
        hello=fpb.Hello(
            machine_id="m1",
            qualification=fpb.Qualification(passed=True),
            held_lease=held,
            held_lease_secret=LEASE_SECRETS[held.lease_id],
            session_token=SESSION_TOKENS["m1"],
        )
    )
    # Big replies (64 URLs each) fill the transport's window (64 KiB without BDP probing), so
    # the scheduler's write waits on a worker that reads nothing; the outbox is large enough
    # that the scheduler never gives up on its own.
    slots = [fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=i) for i in range(1, 65)]
    asks = [fpb.ConnectRequest(urls_requested=fpb.UrlsRequested(lease=held, slots=slots))] * 40
    sessions = fleet.scheduler.sessions

    async def produce() -> object:
        for request in [hello, *asks]:
            yield request
        await asyncio.Event().wait()

    address = f"127.0.0.1:{fleet.scheduler.port}"
    deaf = grpc.aio.insecure_channel(
        address, options=[("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
    )
    call = None
    try:
        call = fgrpc.WorkerServiceStub(deaf).Connect(
            produce(), metadata=(("authorization", f"Bearer {WORKER_TOKEN}"),)
        )
        async with asyncio.timeout(WAIT_S):
            # Replies pile up in the outbox only while a write is stuck on the full window.
            # (The outbox is a plain queue: nothing to wait on but its size.)
            while not (  # noqa: ASYNC110
                (session := sessions.by_machine.get("m1")) is not None
                and session.outbox.qsize() > 0
            ):
                await asyncio.sleep(0.02)
    finally:
        # The worker's connection goes away mid-write (a dropped path), and the replica stops
        # (a restart): whichever ends the stream first, the write is left pending.
        if call is not None:
            call.cancel()
        await deaf.close()
    async with asyncio.timeout(WAIT_S):
        await fleet.scheduler.close(grace_s=0.5)
    del call
    # The stuck write fails once its call is gone; whoever left it unheard shows at collection.
    for _ in range(50):
        await asyncio.sleep(0.01)
        gc.collect()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
