"""The local provider supervising real processes (a stand-in for the worker: it reports which
machine it is over a loopback socket, and drains on SIGTERM), through the `Provider` verbs."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from lorafleet.scaler.local import LocalProcessProvider
from lorafleet.scaler.provider import InstanceState

pytestmark = pytest.mark.timeout(60)

STAND_IN = """
import os, signal, socket, sys
machine = os.environ["LORAFLEET_MACHINE_ID"]
slot = os.environ["LORAFLEET_PROVIDER_INSTANCE_ID"]
host, port = os.environ["TEST_REPORT_TO"].split(":")
out = socket.create_connection((host, int(port)))
def say(*words):
    out.sendall((" ".join(map(str, words)) + "\\n").encode())
def drain(*_):
    say("drained", slot, machine, os.getpid())
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
say("ready", slot, machine, os.getpid())
while True:
    signal.pause()
"""


class Reports:
    """What the stand-ins say, in order, as they say it (no polling)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, str, str, int]] = asyncio.Queue()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            kind, slot, machine, pid = line.decode().split()
            await self.queue.put((kind, slot, machine, int(pid)))
        writer.close()

    async def next(self, timeout_s: float = 20.0) -> tuple[str, str, str, int]:
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def reports() -> AsyncIterator[Reports]:
    r = Reports()
    yield r
    await r.close()


@pytest.fixture
async def local(tmp_path: Path, reports: Reports) -> AsyncIterator[LocalProcessProvider]:
    address = await reports.start()
    provider = LocalProcessProvider(
        scheduler_address="127.0.0.1:1",
        worker_token="t",
        log_dir=tmp_path,
        gpus=0,
        extra_env={"TEST_REPORT_TO": address},
        restart_backoff_s=0.01,
        max_restart_backoff_s=0.05,
        worker_argv=(sys.executable, "-c", STAND_IN),
    )
    yield provider
    await provider.stop(timeout_s=10)


async def test_scale_restart_reallocate_remove(
    local: LocalProcessProvider, reports: Reports
) -> None:
    await local.scale_to(2)
    first = {(await reports.next())[1:3] for _ in range(2)}
    machines = dict(first)
    assert sorted(machines) == ["local-0", "local-1"]
    assert await local.replicas() == 2
    listed = await local.list_instances()
    assert [i.instance_id for i in listed] == ["local-0", "local-1"]
    assert {i.state for i in listed} == {InstanceState.RUNNING}
    assert all(i.deletion_cost is None for i in listed)
    assert [i.machine_id for i in listed] == [machines["local-0"], machines["local-1"]]

    await local.restart("local-0")
    assert (await reports.next())[:3] == ("drained", "local-0", machines["local-0"])
    assert (await reports.next())[:3] == ("ready", "local-0", machines["local-0"])

    await local.reallocate("local-1")
    assert (await reports.next())[:3] == ("drained", "local-1", machines["local-1"])
    moved = await reports.next()
    assert moved[:3] == ("ready", "local-1", f"{machines['local-1']}.1")
    assert (await local.list_instances())[1].machine_id == moved[2]
    assert all(i.restarts == 0 for i in await local.list_instances())

    await local.scale_to(1, remove=["local-0"])
    assert (await reports.next())[:2] == ("drained", "local-0")
    assert [i.instance_id for i in await local.list_instances()] == ["local-1"]
    # Growing again fills the free index.
    await local.scale_to(2)
    assert (await reports.next())[:2] == ("ready", "local-0")
    assert [i.instance_id for i in await local.list_instances()] == ["local-0", "local-1"]
    assert reports.queue.empty()


async def test_a_crashed_worker_is_restarted_with_backoff(
    local: LocalProcessProvider, reports: Reports
) -> None:
    await local.scale_to(1)
    _, _, machine, pid = await reports.next()
    os.kill(pid, signal.SIGKILL)
    kind, _, again, new_pid = await reports.next()
    assert (kind, again) == ("ready", machine) and new_pid != pid
    [inst] = await local.list_instances()
    assert inst.restarts == 1


async def test_unknown_instances_and_bad_counts_are_refused(local: LocalProcessProvider) -> None:
    with pytest.raises(KeyError):
        await local.reallocate("local-7")
    with pytest.raises(ValueError, match="replicas"):
        await local.scale_to(-1)


SAYS_ITS_SIGNAL = STAND_IN.replace(
    'say("drained", slot, machine, os.getpid())',
    'say("drained:" + signal.Signals(_[0]).name, slot, machine, os.getpid())',
).replace(
    "signal.signal(signal.SIGTERM, drain)",
    "signal.signal(signal.SIGTERM, drain)\nsignal.signal(signal.SIGINT, drain)",
)


async def test_an_interrupted_fleet_passes_the_interrupt_on(
    tmp_path: Path, reports: Reports
) -> None:
    """Ctrl-C on `lorafleet up` reaches the workers as SIGINT, so the drain their jobs record
    says SIGINT (an interrupt), not SIGTERM (a node going away)."""
    provider = LocalProcessProvider(
        scheduler_address="127.0.0.1:1",
        worker_token="t",
        log_dir=tmp_path,
        gpus=0,
        extra_env={"TEST_REPORT_TO": await reports.start()},
        worker_argv=(sys.executable, "-c", SAYS_ITS_SIGNAL),
    )
    try:
        await provider.scale_to(1)
        assert (await reports.next())[0] == "ready"
        await provider.restart("local-0")  # a restart is still a SIGTERM
        assert (await reports.next())[0] == "drained:SIGTERM"
        assert (await reports.next())[0] == "ready"
        provider.interrupted()
    finally:
        await provider.stop(timeout_s=10)
    assert (await reports.next())[0] == "drained:SIGINT"
