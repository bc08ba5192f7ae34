"""The worker stream decodes a message whole before acting on it: a malformed one is refused with
INVALID_ARGUMENT and leaves nothing half-done (no machine id taken, no session left behind)."""

from __future__ import annotations

import grpc
import pytest

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from tests.support.fleet import Fleet
from tests.support.workers import connect_worker


async def test_a_malformed_held_lease_is_refused_before_the_machine_id_is_taken(
    fleet: Fleet,
) -> None:
    malformed = fpb.LeaseRef(lease_id="some-lease", epoch=0)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with connect_worker(
            fleet.channel, fleet.token, "m1", held=malformed, held_secret="s", session_token=""
        ):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.held_lease.epoch" in (refused.value.details() or "")
    assert "m1" not in fleet.scheduler.sessions.by_machine
    # The machine id was never claimed: a first Hello for it is welcome at once (a claimed one
    # would be refused with ALREADY_EXISTS for a lease TTL of silence).
    async with connect_worker(fleet.channel, fleet.token, "m1", session_token="") as worker:
        await worker.send(heartbeat=fpb.Heartbeat())
        assert "m1" in fleet.scheduler.sessions.by_machine
