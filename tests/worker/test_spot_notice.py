"""The EC2 metadata client (spot notice watcher, instance id) against an IMDSv2 double over HTTP.

The agent draining on a notice is in tests/agent/test_metadata_services.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from lorafleet.core.settings import ConfigError, load
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.spot_notice import (
    SpotNotice,
    fetch_instance_id,
    watch_spot_notice,
    with_ec2_identity,
)
from tests.worker.imds_double import ImdsDouble

pytestmark = pytest.mark.timeout(30)

NOTICE = {"action": "terminate", "time": "2025-01-01T00:02:00Z"}


@pytest.fixture
async def imds() -> AsyncIterator[ImdsDouble]:
    double = ImdsDouble()
    await double.start()
    yield double
    await double.close()


async def next_poll(imds: ImdsDouble) -> None:
    imds.polled.clear()
    await asyncio.wait_for(imds.polled.wait(), 5)


async def test_returns_the_notice_when_it_appears(imds: ImdsDouble) -> None:
    watcher = asyncio.create_task(watch_spot_notice(base_url=imds.base_url, interval_s=0.05))
    await next_poll(imds)
    await next_poll(imds)
    assert not watcher.done()
    imds.notice = NOTICE
    notice = await asyncio.wait_for(watcher, 5)
    assert notice == SpotNotice(action="terminate", time="2025-01-01T00:02:00Z")
    assert imds.token_puts == 1  # one session token for every look


async def test_an_expired_token_is_replaced(imds: ImdsDouble) -> None:
    watcher = asyncio.create_task(watch_spot_notice(base_url=imds.base_url, interval_s=0.05))
    await next_poll(imds)
    imds.expire_tokens()
    imds.notice = NOTICE
    assert (await asyncio.wait_for(watcher, 5)) is not None
    assert imds.token_puts == 2


async def test_stop_ends_the_watch_without_a_notice(imds: ImdsDouble) -> None:
    stop = asyncio.Event()
    watcher = asyncio.create_task(
        watch_spot_notice(base_url=imds.base_url, interval_s=10.0, stop=stop)
    )
    await next_poll(imds)
    stop.set()
    assert (await asyncio.wait_for(watcher, 5)) is None


async def test_a_broken_service_is_polled_again_not_raised() -> None:
    """A metadata address that drops every connection: the watcher keeps looking, quietly."""
    attempts: asyncio.Queue[None] = asyncio.Queue()

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await attempts.put(None)
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    stop = asyncio.Event()
    watcher = asyncio.create_task(
        watch_spot_notice(
            base_url=f"http://{host}:{port}", interval_s=0.05, timeout_s=0.5, stop=stop
        )
    )
    try:
        for _ in range(3):
            await asyncio.wait_for(attempts.get(), 5)
        assert not watcher.done()
        stop.set()
        assert (await asyncio.wait_for(watcher, 5)) is None
    finally:
        server.close()


def worker_config(**values: Any) -> WorkerConfig:
    return load(WorkerConfig, env={}, worker_token="t", **values)


async def test_fetch_instance_id_with_a_session_token(imds: ImdsDouble) -> None:
    assert await fetch_instance_id(base_url=imds.base_url) == "i-0123456789abcdef0"
    assert imds.token_puts == 1 and imds.instance_id_reads == 1


async def test_ec2_identity_replaces_an_unset_machine_id(imds: ImdsDouble) -> None:
    config = worker_config(spot_notice="ec2", ec2_metadata_url=imds.base_url)
    assert not config.machine_id_configured
    resolved = await with_ec2_identity(config)
    assert resolved.machine_id == "i-0123456789abcdef0"
    assert resolved.provider_instance_id == "i-0123456789abcdef0"
    assert resolved.spot_notice == "ec2" and resolved.worker_token == "t"


async def test_ec2_identity_keeps_what_is_configured(imds: ImdsDouble) -> None:
    given = worker_config(spot_notice="ec2", ec2_metadata_url=imds.base_url, machine_id="node-7")
    assert await with_ec2_identity(given) is given
    # Only the machine id is looked up; a configured provider instance id stays.
    partly = worker_config(
        spot_notice="ec2", ec2_metadata_url=imds.base_url, provider_instance_id="inst-9"
    )
    resolved = await with_ec2_identity(partly)
    assert (resolved.machine_id, resolved.provider_instance_id) == (
        "i-0123456789abcdef0",
        "inst-9",
    )
    # Without the EC2 option the metadata service is never asked.
    off = worker_config(ec2_metadata_url=imds.base_url)
    assert await with_ec2_identity(off) is off
    assert imds.instance_id_reads == 1


async def test_ec2_identity_refuses_to_guess_when_the_service_is_silent() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        config = worker_config(spot_notice="ec2", ec2_metadata_url=f"http://{host}:{port}")
        with pytest.raises(ConfigError, match="LORAFLEET_MACHINE_ID"):
            await with_ec2_identity(config)
    finally:
        server.close()


def test_the_drain_must_fit_in_the_notice() -> None:
    assert worker_config(spot_notice="ec2", drain_grace_s=90).drain_grace_s == 90
    with pytest.raises(ConfigError, match="two-minute notice"):
        worker_config(spot_notice="ec2", drain_grace_s=96)
    # Without the notice, the grace period is the operator's business.
    assert worker_config(drain_grace_s=300).drain_grace_s == 300
