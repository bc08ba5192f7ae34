"""Moving bytes between the worker's memory and object storage through signed URLs.

The worker holds no storage credentials: the scheduler hands it presigned S3 URLs or the local
backend's signed URLs, and both are plain HTTP GET and PUT. Nothing here touches local disk
(no checkpoint byte ever does: docs/DESIGN.md, "Checkpoints").

Failures that may pass (connection errors, timeouts, truncated bodies, HTTP 5xx, 408 and 429)
are retried with `lorafleet.core.retry.backoff_delay` (exponential, full jitter), within
`max_attempts` and `deadline_s`.
Other HTTP errors (an expired or wrong URL answers 403, a missing object 404) are raised at once
as `StorageError(retryable=False)`. Error messages never contain a URL's query string, which
holds its signature.

Stored objects are write-once: every PUT carries `If-None-Match: *` (S3 URLs sign that header,
so S3 refuses a PUT without it; the local store is create-only whatever the header). A 412 on
the first attempt (the key already holds an object) is raised, not retryable; on a retry it
means an earlier attempt whose answer was lost stored the object, and the upload counts as
done: the scheduler checks the stored bytes' size and sha256 before it records them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import structlog
from opentelemetry import propagate

from lorafleet.core.errors import StorageError
from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.core.retry import backoff_delay
from lorafleet.worker import metrics

log = structlog.get_logger(__name__)

T = TypeVar("T")

_RETRYABLE_STATUSES = frozenset({408, 429})
_UPLOAD_BLOCK_BYTES = 256 * 1024
# How much of an error response body to quote; S3 and the local backend explain refusals there.
_ERROR_BODY_BYTES = 512


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """Retry and timeout policy for `TransferClient`."""

    # Attempts per transfer, the first included.
    max_attempts: int = 6
    # Backoff after failed attempt n (from 1): `backoff_delay(n - 1, ...)`, i.e. uniform in
    # [0, min(max_backoff_s, initial_backoff_s * 2**(n - 1))].
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 20.0
    # Wall-clock bound on one transfer, all attempts and backoff included.
    deadline_s: float = 900.0
    connect_timeout_s: float = 10.0
    # Longest silence while reading a response; the body of a large object may take longer
    # in total, so there is no per-attempt total.
    read_timeout_s: float = 60.0
    # Connections kept to all hosts together.
    max_connections: int = 16

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if min(self.initial_backoff_s, self.max_backoff_s) < 0:
            raise ValueError("backoff must not be negative")
        if min(self.deadline_s, self.connect_timeout_s, self.read_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")


class _Retryable(Exception):
    """One attempt failed in a way the next attempt may not."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def content_md5(data: bytes | memoryview) -> str:
    """The `Content-MD5` header of `data` (base64 of its MD5). Blocks for a large body: call it
    off the event loop, in the same thread pass that computes the body's sha256 when there is
    one (see `upload`)."""
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


class TransferClient(AsyncLifecycle):
    """Downloads and uploads over signed URLs with one pooled `aiohttp.ClientSession`.

    Use as `async with TransferClient() as client:`; `close()` is idempotent.
    """

    def __init__(self, config: TransferConfig | None = None) -> None:
        self._config = config or TransferConfig()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the connection pool (it must be made inside the running event loop)."""
        if self._session is not None:
            return
        config = self._config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.max_connections),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=config.connect_timeout_s,
                sock_connect=config.connect_timeout_s,
                sock_read=config.read_timeout_s,
            ),
            # The bytes must be exactly what was stored (checkpoints are verified by sha256);
            # never let a proxy or CDN compress them on the way.
            auto_decompress=False,
            headers={"Accept-Encoding": "identity"},
        )

    async def close(self) -> None:
        """Close the connection pool; idempotent."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def download(self, url: str) -> bytes:
        """The body of a GET on `url`, retried as the module docstring says."""
        session = self._require_session()

        async def attempt() -> bytes:
            async with session.get(url, headers=_trace_headers({})) as response:
                await _raise_for_status(response, "GET", url)
                # aiohttp checks the body against Content-Length; a short body raises
                # ClientPayloadError, which is retried.
                return await response.read()

        return await self._with_retries("GET", url, attempt)

    async def download_many(
        self, items: Iterable[tuple[str, str]], *, concurrency: int = 8
    ) -> dict[str, bytes]:
        """Download `(name, url)` pairs, at most `concurrency` at once; `{name: body}`.

        The first failure cancels the rest and is raised as it is (a `StorageError`).
        """
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        pairs = list(items)
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError("download_many needs distinct names")
        gate = asyncio.Semaphore(concurrency)
        results: dict[str, bytes] = {}

        async def fetch(name: str, url: str) -> None:
            async with gate:
                results[name] = await self.download(url)

        try:
            async with asyncio.TaskGroup() as group:
                for name, url in pairs:
                    group.create_task(fetch(name, url))
        except BaseExceptionGroup as group_error:
            # Callers handle one StorageError, not a group; the first failure is the cause,
            # the rest are usually its echoes (the same store being down).
            raise _first_leaf(group_error) from None
        # In the order given, which callers may rely on when they iterate.
        return {name: results[name] for name in names}

    async def upload(self, url: str, data: bytes | memoryview, *, md5: str | None = None) -> None:
        """PUT `data` to `url`, retried as the module docstring says.

        A `Content-MD5` header goes along so the store (S3 and the local backend both check it)
        rejects a body damaged in transit: nothing else compares the stored bytes with the
        digest the worker announces. `md5` is that header's value when the caller already has
        it (`content_md5(data)`, computed beside the sha256 in one thread pass, as the lease
        runner does for checkpoints and results); without it the digest is computed here, in a
        thread. Nothing is hashed on the event loop.
        """
        session = self._require_session()
        if md5 is None:
            md5 = await asyncio.to_thread(content_md5, data)
        # An explicit length keeps the streamed body from going chunked: S3 and the local
        # backend both refuse a PUT without Content-Length.
        headers = {
            "Content-MD5": md5,
            "Content-Type": "application/octet-stream",
            "Content-Length": str(len(data)),
            "If-None-Match": "*",
        }
        _trace_headers(headers)
        attempts = 0

        async def attempt() -> None:
            nonlocal attempts
            attempts += 1
            async with session.put(url, data=_blocks(data), headers=headers) as response:
                if response.status == 412 and attempts > 1:
                    log.info("transfer.stored_by_earlier_attempt", url=redact_url(url))
                    return
                await _raise_for_status(response, "PUT", url)
                await response.read()

        await self._with_retries("PUT", url, attempt)

    # -- internals -------------------------------------------------------------------------

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("TransferClient is not started (use `async with` or start())")
        return self._session

    async def _with_retries(self, method: str, url: str, attempt: Callable[[], Awaitable[T]]) -> T:
        config = self._config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.deadline_s
        where = f"{method} {redact_url(url)}"
        for number in range(1, config.max_attempts + 1):
            remaining = deadline - loop.time()
            try:
                async with asyncio.timeout(remaining):
                    return await attempt()
            except StorageError:
                raise
            except _Retryable as exc:
                problem, retry_after_s = str(exc), exc.retry_after_s
            except TimeoutError:
                problem, retry_after_s = "timed out", None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                problem, retry_after_s = f"{type(exc).__name__}: {exc}", None
            except aiohttp.ClientError as exc:
                # Invalid URLs and the like: the same request fails the same way again.
                raise StorageError(
                    f"{where}: {type(exc).__name__}: {exc} (not retryable)", retryable=False
                ) from exc
            if number == config.max_attempts:
                break
            backoff = backoff_delay(
                number - 1, initial_s=config.initial_backoff_s, max_s=config.max_backoff_s
            )
            if retry_after_s is not None:
                backoff = min(max(backoff, retry_after_s), config.max_backoff_s)
            if loop.time() + backoff >= deadline:
                break
            metrics.TRANSFER_RETRIES.labels(method).inc()
            log.info(
                "transfer.retrying",
                method=method,
                url=redact_url(url),
                attempt=number,
                problem=problem,
                backoff_s=round(backoff, 3),
            )
            await asyncio.sleep(backoff)
        # Retryable: the store may recover, so the caller (or the job, on another attempt) may
        # try again later.
        metrics.TRANSFER_FAILURES.labels(method).inc()
        raise StorageError(f"{where}: gave up after {number} attempt(s): {problem}", retryable=True)


def _trace_headers(headers: dict[str, str]) -> dict[str, str]:
    """Adds the current span's W3C traceparent: the store's request span joins the job's trace
    (stores ignore a header they do not know)."""
    propagate.inject(headers)
    return headers


async def _raise_for_status(response: aiohttp.ClientResponse, method: str, url: str) -> None:
    if response.status < 400:
        return
    # Bounded: an error body is an explanation, never worth reading in full.
    raw = await response.content.read(_ERROR_BODY_BYTES)
    body = raw.decode("utf-8", errors="replace").strip()
    summary = f"HTTP {response.status} {response.reason or ''}".rstrip()
    detail = f"{summary}: {body}" if body else summary
    if response.status >= 500 or response.status in _RETRYABLE_STATUSES:
        raise _Retryable(detail, retry_after_s=_retry_after_s(response))
    # 403 is what an expired or wrongly scoped URL gets; the body (S3's XML, the local
    # backend's text) says which.
    raise StorageError(f"{method} {redact_url(url)}: {detail} (not retryable)", retryable=False)


def _retry_after_s(response: aiohttp.ClientResponse) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        # The HTTP-date form; rare for storage, and the backoff covers it.
        return None


async def _blocks(data: bytes | memoryview) -> AsyncIterator[memoryview]:
    """`data` in slices that share its memory: a checkpoint of hundreds of MB is sent without
    a copy, and the event loop gets a turn between blocks."""
    view = memoryview(data)
    for start in range(0, len(view), _UPLOAD_BLOCK_BYTES):
        yield view[start : start + _UPLOAD_BLOCK_BYTES]


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def redact_url(url: str) -> str:
    """`url` without its query string and user info, fit for logs and error messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
