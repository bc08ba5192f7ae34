"""The worker's `TransferClient` against a small aiohttp server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from lorafleet.core.errors import StorageError
from lorafleet.worker import transfer as transfer_module
from lorafleet.worker.transfer import TransferClient, TransferConfig, content_md5, redact_url

pytestmark = pytest.mark.timeout(30)

FAST = TransferConfig(
    max_attempts=4,
    initial_backoff_s=0.001,
    max_backoff_s=0.005,
    deadline_s=10.0,
    connect_timeout_s=2.0,
    read_timeout_s=0.3,
)


@dataclass
class Flaky:
    """Answers `failures` requests badly (with `failure(request)`), then well; keeps what it got."""

    failures: int = 0
    failure: Callable[[web.Request], web.StreamResponse] = lambda _: web.Response(status=503)
    requests: int = 0
    stored: dict[str, bytes] = field(default_factory=dict)
    headers: list[dict[str, str]] = field(default_factory=list)
    hang: asyncio.Event = field(default_factory=asyncio.Event)
    hang_first: bool = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.headers.append(dict(request.headers))
        body = await request.read()
        if self.hang_first and self.requests == 1:
            # Never answers (the test never sets it): the client's read timeout must fire.
            await self.hang.wait()
        if self.requests <= self.failures:
            response = self.failure(request)
            if isinstance(response, _Drop):
                assert request.transport is not None
                request.transport.close()
            return response
        if request.method == "PUT":
            self.stored[request.path] = body
            return web.Response(status=200)
        return web.Response(body=self.stored.get(request.path, b"payload:" + request.path.encode()))


class _Drop(web.Response):
    """Marker: close the connection instead of answering."""


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[Flaky, str]]:
    state = Flaky()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", state.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield state, f"http://127.0.0.1:{port}"
    state.hang.set()
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[TransferClient]:
    async with TransferClient(FAST) as transfer:
        yield transfer


async def test_upload_survives_503s(
    flaky: tuple[Flaky, str], client: TransferClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, base = flaky
    state.failures = 2
    waits: list[tuple[int, float, float]] = []

    def recording_backoff(attempt: int, *, initial_s: float, max_s: float) -> float:
        waits.append((attempt, initial_s, max_s))
        return 0.0

    # The shared backoff rule, from attempt 0, with the configured bounds.
    monkeypatch.setattr(transfer_module, "backoff_delay", recording_backoff)
    data = b"checkpoint" * 1000
    await client.upload(f"{base}/k?sig=abc", data)
    assert state.requests == 3
    assert state.stored["/k"] == data
    assert waits == [(n, FAST.initial_backoff_s, FAST.max_backoff_s) for n in (0, 1)]
    # Every attempt sent the whole body with its length and digest.
    md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
    for headers in state.headers:
        assert headers["Content-Length"] == str(len(data))
        assert headers["Content-MD5"] == md5
        assert "Transfer-Encoding" not in headers


async def test_upload_digest_is_computed_off_the_event_loop_or_taken_as_given(
    flaky: tuple[Flaky, str], client: TransferClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, base = flaky
    threads: list[int] = []

    def recording_md5(data: bytes) -> str:
        threads.append(threading.get_ident())
        return content_md5(data)

    monkeypatch.setattr(transfer_module, "content_md5", recording_md5)
    await client.upload(f"{base}/a", b"image")
    assert len(threads) == 1 and threads[0] != threading.get_ident()
    assert state.headers[-1]["Content-MD5"] == content_md5(b"image")

    # A digest the caller computed already (beside its sha256) is sent as it is.
    await client.upload(f"{base}/b", b"blob", md5=content_md5(b"blob"))
    assert len(threads) == 1
    assert state.headers[-1]["Content-MD5"] == content_md5(b"blob")
    assert state.stored["/b"] == b"blob"


async def test_download_survives_429_and_dropped_connections(
    flaky: tuple[Flaky, str], client: TransferClient
) -> None:
    state, base = flaky
    state.failures = 2
    answers = iter([web.Response(status=429, headers={"Retry-After": "0"}), _Drop()])
    state.failure = lambda _: next(answers)
    assert await client.download(f"{base}/obj") == b"payload:/obj"
    assert state.requests == 3


async def test_download_retries_after_a_read_timeout(
    flaky: tuple[Flaky, str], client: TransferClient
) -> None:
    state, base = flaky
    state.hang_first = True
    assert await client.download(f"{base}/slow") == b"payload:/slow"
    assert state.requests == 2


async def test_403_is_not_retried(flaky: tuple[Flaky, str], client: TransferClient) -> None:
    state, base = flaky
    state.failures = 10
    state.failure = lambda _: web.Response(status=403, text="URL expired at 2030-01-01")
    with pytest.raises(StorageError) as caught:
        await client.upload(f"{base}/k?X-Lf-Signature=topsecret", b"data")
    assert state.requests == 1
    error = caught.value
    assert error.retryable is False
    assert "403" in str(error)
    assert "not retryable" in str(error)
    assert "URL expired" in str(error)
    # The signature is a credential: it must not leak into messages or logs.
    assert "topsecret" not in str(error)


async def test_every_put_is_create_only(flaky: tuple[Flaky, str], client: TransferClient) -> None:
    # Write-once stores: S3 URLs sign `If-None-Match: *`, so a PUT without it is refused there.
    state, base = flaky
    await client.upload(f"{base}/k", b"data", md5=content_md5(b"data"))
    await client.upload(f"{base}/l", b"data")
    assert [headers["If-None-Match"] for headers in state.headers] == ["*", "*"]


async def test_412_is_an_error_unless_an_earlier_attempt_may_have_stored_it(
    flaky: tuple[Flaky, str], client: TransferClient
) -> None:
    state, base = flaky
    # On the first attempt the key was taken by someone else: raised, not retried.
    state.failures = 1
    state.failure = lambda _: web.Response(status=412, text="an object already exists at key")
    with pytest.raises(StorageError, match="412") as caught:
        await client.upload(f"{base}/k", b"forged")
    assert caught.value.retryable is False
    assert "already exists" in str(caught.value)
    assert state.requests == 1

    # The first attempt's connection drops after the body went out (the store may have kept
    # it); the retry finds the key taken. The upload is done: the scheduler verifies the bytes.
    state.requests = 0
    state.failures = 2
    answers = iter([_Drop(), web.Response(status=412, text="already exists")])
    state.failure = lambda _: next(answers)
    await client.upload(f"{base}/l", b"checkpoint")
    assert state.requests == 2


async def test_attempts_are_bounded(flaky: tuple[Flaky, str], client: TransferClient) -> None:
    state, base = flaky
    state.failures = 100
    with pytest.raises(StorageError, match="gave up after 4 attempt") as caught:
        await client.download(f"{base}/k")
    assert state.requests == FAST.max_attempts
    assert caught.value.retryable is True


async def test_deadline_bounds_the_whole_transfer(flaky: tuple[Flaky, str]) -> None:
    state, base = flaky
    state.hang_first = True
    config = TransferConfig(max_attempts=50, initial_backoff_s=0.001, deadline_s=0.2)
    async with TransferClient(config) as transfer:
        with pytest.raises(StorageError, match="timed out") as caught:
            await transfer.download(f"{base}/k")
    assert state.requests == 1
    assert caught.value.retryable is True


async def test_connection_refused_is_retried_then_reported(client: TransferClient) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(StorageError, match="gave up after 4 attempt") as caught:
            await client.download(f"http://127.0.0.1:{port}/k")
    assert caught.value.retryable is True


async def test_download_many_runs_in_parallel_and_keeps_names(
    flaky: tuple[Flaky, str], client: TransferClient
) -> None:
    state, base = flaky
    items = [(f"img{n}.png", f"{base}/instance/{n}") for n in range(20)]
    got = await client.download_many(items, concurrency=4)
    assert list(got) == [name for name, _ in items]
    assert got["img7.png"] == b"payload:/instance/7"
    assert state.requests == 20


async def test_download_many_raises_the_first_failure(
    flaky: tuple[Flaky, str], client: TransferClient
) -> None:
    state, base = flaky
    state.failure = lambda request: web.Response(
        status=404 if request.path == "/missing" else 200, body=b"ok"
    )
    state.failures = 1000
    with pytest.raises(StorageError, match="404") as caught:
        await client.download_many([("a", f"{base}/a"), ("m", f"{base}/missing")])
    assert caught.value.retryable is False
    with pytest.raises(ValueError, match="distinct"):
        await client.download_many([("a", f"{base}/a"), ("a", f"{base}/b")])


async def test_client_lifecycle() -> None:
    transfer = TransferClient(FAST)
    with pytest.raises(RuntimeError, match="not started"):
        await transfer.download("http://127.0.0.1:1/x")
    async with transfer:
        pass
    await transfer.close()


def test_redact_url_drops_query_and_credentials() -> None:
    assert (
        redact_url("https://user:pw@bkt.s3.example.com:8443/a/b%20c?X-Amz-Signature=s#f")
        == "https://bkt.s3.example.com:8443/a/b%20c"
    )


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        TransferConfig(max_attempts=0)
    with pytest.raises(ValueError, match="timeouts"):
        TransferConfig(deadline_s=0)
