"""The scheduler's metrics endpoint, its health service and its listening port, over the wire."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.core.settings import ConfigError
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.scheduler.server import Scheduler
from tests.support.artifacts import checkpoint_blob
from tests.support.fleet import Fleet, scheduler_config
from tests.support.jobs import WAIT_S
from tests.support.workers import connect_worker

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(port: int) -> Samples:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("scheduler_overrides", [{"metrics_port": 0}])
async def test_counters_move_with_the_events_that_drive_them(fleet: Fleet) -> None:
    port = fleet.scheduler.metrics_port
    assert port > 0
    before = await scrape(port)
    job = await fleet.alice.submit()
    checkpoint = checkpoint_blob(10)
    async with connect_worker(fleet.channel, fleet.token, "metrics-m1") as worker:
        granted = await worker.ready_for_lease()
        await worker.store_checkpoint(granted.lease, step=10, data=checkpoint)
        await worker.heartbeat(granted.lease, step=11)
        # A message for a lease this stream does not hold: refused (stale).
        await worker.send(
            heartbeat=fpb.Heartbeat(
                lease=fpb.LeaseRef(lease_id=granted.lease.lease_id, epoch=99), step=1
            )
        )
        await worker.expect("rejected")
        mid = await scrape(port)
        assert (
            value(mid, "lorafleet_worker_streams") == value(before, "lorafleet_worker_streams") + 1
        )
        await worker.send(draining=fpb.Draining(lease=worker.ref(granted.lease), reason="test"))
        # The scheduler ends the stream once it has handled everything sent before the close.
        await worker.call.done_writing()
        async with asyncio.timeout(WAIT_S):
            while await worker.call.read() is not grpc.aio.EOF:
                pass
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == 1)  # QUEUED again
    after = await scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("lorafleet_grants_total") == 1
    assert delta("lorafleet_grant_latency_seconds_count") == 1
    assert delta("lorafleet_checkpoints_committed_total") == 1
    assert delta("lorafleet_checkpoint_bytes_committed_total") == len(checkpoint)
    assert delta("lorafleet_stale_rejections_total") == 1
    assert delta("lorafleet_drains_total") == 1
    assert delta("lorafleet_requeues_total", reason="drained") == 1
    assert value(after, "lorafleet_jobs", state="QUEUED") == 1
    assert value(after, "lorafleet_jobs", state="RUNNING") == 0
    assert value(mid, "lorafleet_jobs", state="RUNNING") == 1
    assert value(after, "lorafleet_ledger_up") == 1


@pytest.mark.parametrize(
    "scheduler_overrides", [{"metrics_port": 0, "lease_ttl_s": 1.0, "heartbeat_interval_s": 0.2}]
)
async def test_an_expired_lease_is_counted(fleet: Fleet) -> None:
    before = await scrape(fleet.scheduler.metrics_port)
    job = await fleet.alice.submit()
    async with connect_worker(fleet.channel, fleet.token, "metrics-m2") as worker:
        await worker.ready_for_lease()
        # Silent: the sweeper expires the lease and re-queues the job.
        await fleet.alice.wait_for(job.job_id, lambda j: j.state == 1)

    def requeued(samples: Samples) -> float:
        return value(samples, "lorafleet_requeues_total", reason="expired")

    # The sweeper counts an expiry just after committing it, and the watch can see the re-queue
    # first (on a loaded machine it did): scrape until the counter has caught up, bounded.
    async with asyncio.timeout(WAIT_S):
        while True:
            after = await scrape(fleet.scheduler.metrics_port)
            # (the sweeper counts the re-queue after the expiry, in one go)
            if requeued(after) > requeued(before):
                break
            await asyncio.sleep(0.05)
    assert (
        value(after, "lorafleet_lease_expiries_total")
        - value(before, "lorafleet_lease_expiries_total")
        >= 1
    )
    assert (
        value(after, "lorafleet_requeues_total", reason="expired")
        - value(before, "lorafleet_requeues_total", reason="expired")
        >= 1
    )


async def test_metrics_are_off_by_default(fleet: Fleet) -> None:
    assert fleet.scheduler.metrics_port == 0


class CuttableProxy:
    """A TCP proxy to Postgres that the test can cut (every connection dropped, new ones
    refused) and restore: the ledger becomes unreachable as in a network partition."""

    def __init__(self, host: str, port: int, *, socket_path: str | None = None) -> None:
        self._target = (host, port)
        # The embedded server listens on a Unix socket only (`?host=<folder>` in its URL).
        self._socket_path = socket_path
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def close(self) -> None:
        if self._server is not None:
            await self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._socket_path is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self._socket_path)
        else:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for task in (
            asyncio.create_task(pipe(reader, up_writer)),
            asyncio.create_task(pipe(up_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


@contextlib.asynccontextmanager
async def proxied(database_url: str) -> AsyncIterator[tuple[CuttableProxy, str]]:
    """A proxy in front of the test's Postgres and a URL through it. The server may be a TCP one
    (`host:port`) or the embedded one on a Unix socket (`?host=/folder`, the port naming the
    socket file): either way the URL handed out is loopback TCP through the proxy."""
    parts = urlsplit(database_url)
    query = parse_qs(parts.query)
    socket_dir = next((h for h in query.pop("host", []) if h.startswith("/")), None)
    port = parts.port or 5432
    socket_path = f"{socket_dir}/.s.PGSQL.{port}" if socket_dir is not None else None
    proxy = CuttableProxy(parts.hostname or "127.0.0.1", port, socket_path=socket_path)
    await proxy.start()
    netloc = (
        f"{parts.username}@127.0.0.1:{proxy.port}" if parts.username else f"127.0.0.1:{proxy.port}"
    )
    rest = urlencode(query, doseq=True)
    try:
        yield proxy, urlunsplit(parts._replace(netloc=netloc, query=rest))
    finally:
        await proxy.close()


async def test_health_is_not_serving_while_the_ledger_is_unreachable(
    database_url: str, tmp_path: Path
) -> None:
    async with proxied(database_url) as (proxy, url):
        config = scheduler_config(url, tmp_path / "data", sweep_interval_s=0.2)
        async with (
            Scheduler(config) as scheduler,
            grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel,
        ):
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=3 * WAIT_S)
            seen: list[int] = []

            async def until(status: int) -> None:
                async with asyncio.timeout(WAIT_S):
                    while not seen or seen[-1] != status:
                        seen.append((await watch.read()).status)

            await until(health_pb2.HealthCheckResponse.SERVING)
            port = proxy.port
            await proxy.cut()
            await until(health_pb2.HealthCheckResponse.NOT_SERVING)
            proxy.port = port  # the same address comes back
            await proxy.start()
            await until(health_pb2.HealthCheckResponse.SERVING)
            watch.cancel()
            assert (
                seen[-3:]
                == [
                    health_pb2.HealthCheckResponse.SERVING,
                    health_pb2.HealthCheckResponse.NOT_SERVING,
                    health_pb2.HealthCheckResponse.SERVING,
                ][-len(seen[-3:]) :]
            )


async def test_a_second_scheduler_on_a_port_in_use_fails_clearly(
    fleet: Fleet, database_url: str, tmp_path: Path
) -> None:
    listen = f"127.0.0.1:{fleet.scheduler.port}"
    config = scheduler_config(database_url, tmp_path / "second", listen=listen)
    with pytest.raises(ConfigError, match=r"LORAFLEET_LISTEN.*in use"):
        async with Scheduler(config):
            pass
    # The first one still serves.
    stub = health_pb2_grpc.HealthStub(fleet.channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
