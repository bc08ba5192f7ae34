"""The local backend's HTTP server: GET, HEAD and PUT on the signed URLs of `storage.local_urls`.

Refusals are plain-text HTTP answers:

* 400: the key breaks `validate_key`, a malformed `Content-MD5`, a body that ended early or does
  not match its `Content-MD5`, an `If-None-Match` other than `*`;
* 403: a missing or wrong signature, the wrong method, an expired URL, a key reaching through a
  symlink, a URL whose lease has ended;
* 404: GET of a missing object; 405: another method; 409: a key whose path collides with
  another key's folder (`a` and `a/b` cannot both exist on a filesystem);
* 411: PUT without `Content-Length` (as S3); 412: the key already holds an object (write-once);
  413: PUT above `max_object_bytes`; 503: the lease could not be checked (retry).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from opentelemetry import propagate, trace

from lorafleet.core.errors import InvalidArgument, StorageError
from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.scheduler.storage.base import IF_NONE_MATCH, check_lease_id, validate_key
from lorafleet.scheduler.storage.local_files import (
    IO_BLOCK_BYTES,
    AtomicWriter,
    Files,
    KeyConflict,
    ObjectExists,
    is_object,
    open_object,
)
from lorafleet.scheduler.storage.local_urls import (
    PARAM_EXPIRES,
    PARAM_LEASE,
    PARAM_METHOD,
    PARAM_REPLACE,
    PARAM_SIGNATURE,
    URL_PATH_PREFIX,
    LeaseIsLive,
    LocalStoreConfig,
    always_live,
    url_signature,
)

log = structlog.get_logger(__name__)
_tracer = trace.get_tracer("lorafleet.scheduler.storage")


class LocalObjectServer(AsyncLifecycle):
    """The HTTP side of the local backend: serves GET and PUT on signed URLs.

    A component with the usual lifecycle: `async with`, `start()`, an idempotent `shutdown()`
    that stops accepting, lets requests in progress finish within `shutdown_timeout_s` and then
    cancels them (a cancelled upload leaves no object and no temporary file).
    """

    def __init__(
        self,
        config: LocalStoreConfig,
        *,
        clock: Callable[[], float] = time.time,
        lease_is_live: LeaseIsLive = always_live,
    ) -> None:
        self._config = config
        self._clock = clock
        self.lease_is_live = lease_is_live
        self._files = Files(config.root_dir)
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        # Handlers still running, tracked by hand: aiohttp stops waiting for a request once its
        # client has gone, and shutdown must not return while such an upload is cleaning up.
        self._in_flight: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def port(self) -> int:
        """The bound port (the real one when configured with 0)."""
        if self._port is None:
            raise RuntimeError("LocalObjectServer is not started")
        return self._port

    @property
    def serving(self) -> bool:
        return self._runner is not None

    @property
    def base_url(self) -> str:
        """What signed URLs start with: `public_base_url`, or this server's own address."""
        if self._config.public_base_url is not None:
            return self._config.public_base_url.rstrip("/")
        host = self._config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and start serving; calling it on a running server does nothing."""
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_route("*", URL_PATH_PREFIX + "{tail:.*}", self._handle)
        # No access log: request lines carry signatures, which must not end up in log files.
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=self._config.shutdown_timeout_s,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._config.host, self._config.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        log.info("storage.local.serving", root=str(self._config.root_dir), base_url=self.base_url)

    async def close(self) -> None:
        """Stop serving; idempotent."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        await runner.cleanup()
        try:
            async with asyncio.timeout(self._config.shutdown_timeout_s):
                await self._idle.wait()
        except TimeoutError:
            for task in list(self._in_flight):
                task.cancel()
            # The handlers' own cleanup runs on cancellation; wait for it, not for the tasks
            # (they belong to aiohttp and may outlive the request).
            await self._idle.wait()
        self._port = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        self._idle.clear()
        try:
            # A server span per request, in the caller's trace when it sent a traceparent (the
            # worker's uploads do). The key (and never the signed query) names the object.
            with _tracer.start_as_current_span(
                f"storage.{request.method}",
                context=propagate.extract(request.headers),
                kind=trace.SpanKind.SERVER,
                attributes={
                    "http.request.method": request.method,
                    "url.path": request.rel_url.raw_path,
                },
            ) as span:
                response = await self._serve(request)
                span.set_attribute("http.response.status_code", response.status)
                return response
        finally:
            self._in_flight.discard(task)
            if not self._in_flight:
                self._idle.set()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        method = request.method
        if method not in ("GET", "HEAD", "PUT"):
            return web.Response(
                status=405, text="only GET, HEAD and PUT", headers={"Allow": "GET, HEAD, PUT"}
            )
        # Decoded here, once, from the raw path: the key checked and signed must be exactly the
        # one the client sent, with no router decoding or normalisation in between.
        try:
            key = urllib.parse.unquote(
                request.rel_url.raw_path.removeprefix(URL_PATH_PREFIX), errors="strict"
            )
        except UnicodeDecodeError:
            return _refuse(request, 400, "key is not valid UTF-8")
        try:
            validate_key(key)
        except InvalidArgument as exc:
            return _refuse(request, 400, f"invalid key: {exc.reason}")
        grant = self._check_authorisation(request, key)
        if isinstance(grant, str):
            return _refuse(request, 403, grant, key=key)
        try:
            path = self._files.path_for(key)
        except StorageError as exc:
            return _refuse(request, 403, str(exc), key=key)
        if method == "PUT":
            return await self._put(request, key, path, grant)
        # A lease's read URLs die with it too: its holder keeps none of the job's inputs.
        if grant.lease_id is not None and (refusal := await self._lease_refusal(grant.lease_id)):
            return _refuse(request, *refusal, key=key)
        return await self._get(request, key, path)

    def _check_authorisation(self, request: web.Request, key: str) -> _Grant | str:
        """What the request's URL allows, or why the request may not proceed."""
        values: dict[str, str] = {}
        for name in (PARAM_METHOD, PARAM_EXPIRES, PARAM_SIGNATURE):
            found = request.query.getall(name, [])
            if len(found) != 1:
                return f"URL needs exactly one {name} parameter"
            values[name] = found[0]
        optional: dict[str, str | None] = {}
        for name in (PARAM_LEASE, PARAM_REPLACE):
            found = request.query.getall(name, [])
            if len(found) > 1:
                return f"URL has more than one {name} parameter"
            optional[name] = found[0] if found else None
        signed_method = values[PARAM_METHOD]
        if signed_method not in ("GET", "PUT"):
            return f"{PARAM_METHOD} must be GET or PUT"
        try:
            expires = int(values[PARAM_EXPIRES])
        except ValueError:
            return f"{PARAM_EXPIRES} must be unix seconds"
        lease_id = optional[PARAM_LEASE]
        try:
            check_lease_id(lease_id)
        except ValueError:
            return f"{PARAM_LEASE} is not a lease id"
        replace = optional[PARAM_REPLACE]
        if replace not in (None, "1"):
            return f"{PARAM_REPLACE} must be 1 when present"
        expected = url_signature(
            self._config.secret_key,
            method="GET" if signed_method == "GET" else "PUT",
            key=key,
            expires=expires,
            lease_id=lease_id,
            replace=replace == "1",
        )
        # Constant-time, so the response time reveals nothing about how much of a guess matched.
        # As bytes: compare_digest refuses str with non-ASCII characters, which a client may send.
        if not hmac.compare_digest(
            expected.encode(), values[PARAM_SIGNATURE].encode(errors="replace")
        ):
            return "signature does not match this key, method and expiry"
        allowed = ("GET", "HEAD") if signed_method == "GET" else ("PUT",)
        if request.method not in allowed:
            return f"URL is signed for {signed_method}, not {request.method}"
        if self._clock() >= expires:
            at = datetime.fromtimestamp(expires, UTC).isoformat()
            return f"URL expired at {at}"
        return _Grant(lease_id=lease_id, replace=replace == "1")

    async def _lease_refusal(self, lease_id: str) -> tuple[int, str] | None:
        """Why a request on a URL of lease `lease_id` may not proceed (status, reason), or None
        while the lease is live."""
        try:
            live = await self.lease_is_live(lease_id)
        except Exception as exc:
            # The ledger is unreachable: the worker retries (503 is retryable), nothing stored.
            log.warning("storage.local.lease_check_failed", lease_id=lease_id, error=repr(exc))
            return 503, f"cannot check lease {lease_id} now; try again"
        if not live:
            return 403, f"lease {lease_id} has ended: its URLs no longer work"
        return None

    async def _get(self, request: web.Request, key: str, path: Path) -> web.StreamResponse:
        try:
            file, size = await asyncio.to_thread(open_object, path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return _refuse(request, 404, f"no object at key {key!r}", key=key)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        try:
            await response.prepare(request)
            if request.method == "GET":
                # The open file keeps the version that was current at open time, even if a PUT
                # replaces the object meanwhile.
                while block := await asyncio.to_thread(file.read, IO_BLOCK_BYTES):
                    await response.write(block)
            await response.write_eof()
        except OSError as exc:
            # The client went away mid-download; it retries with a new request.
            log.info("storage.local.download_interrupted", key=key, error=str(exc))
        finally:
            file.close()
        return response

    async def _put(
        self, request: web.Request, key: str, path: Path, grant: _Grant
    ) -> web.StreamResponse:
        create_only = not grant.replace
        if (condition := request.headers.get(IF_NONE_MATCH)) is not None:
            if condition.strip() != "*":
                return _refuse(request, 400, f"{IF_NONE_MATCH} must be *", key=key)
            create_only = True
        if grant.lease_id is not None and (refusal := await self._lease_refusal(grant.lease_id)):
            return _refuse(request, *refusal, key=key)
        length = request.content_length
        if length is None:
            return _refuse(request, 411, "Content-Length is required", key=key)
        if length > self._config.max_object_bytes:
            return _refuse(
                request,
                413,
                f"{length} bytes exceed the limit of {self._config.max_object_bytes}",
                key=key,
            )
        expected_md5: bytes | None = None
        if (header := request.headers.get("Content-MD5")) is not None:
            try:
                expected_md5 = base64.b64decode(header, validate=True)
            except binascii.Error:
                expected_md5 = b""
            if len(expected_md5) != 16:
                return _refuse(request, 400, "Content-MD5 must be a base64 MD5 digest", key=key)
        # Early, so that a refused upload does not send its whole body first; the link in
        # `commit` is what decides, also for two PUTs racing past this point.
        if create_only and await asyncio.to_thread(is_object, path):
            return _refuse(request, *_write_refusal(ObjectExists(), key), key=key)
        try:
            writer = await asyncio.to_thread(AtomicWriter, path)
        except StorageError as exc:
            return _refuse(request, *_write_refusal(exc, key), key=key)
        md5 = hashlib.md5(usedforsecurity=False)
        received = 0
        pending = bytearray()
        try:
            async for chunk in request.content.iter_any():
                received += len(chunk)
                md5.update(chunk)
                pending += chunk
                if len(pending) >= IO_BLOCK_BYTES:
                    block, pending = bytes(pending), bytearray()
                    await asyncio.to_thread(writer.write, block)
            if received != length:
                return _refuse(
                    request, 400, f"body ended after {received} of {length} bytes", key=key
                )
            if expected_md5 is not None and md5.digest() != expected_md5:
                return _refuse(request, 400, "body does not match Content-MD5", key=key)
            await asyncio.to_thread(writer.write, bytes(pending))
            # Again at the last moment: an upload that outlived its lease stores nothing.
            if grant.lease_id is not None and (
                refusal := await self._lease_refusal(grant.lease_id)
            ):
                return _refuse(request, *refusal, key=key)
            await asyncio.to_thread(writer.commit, replace=not create_only)
        except StorageError as exc:
            return _refuse(request, *_write_refusal(exc, key), key=key)
        except (OSError, HttpProcessingError) as exc:
            # The client went away or sent a broken body. Nobody is left to read an answer;
            # say so in the log instead of letting aiohttp print a traceback.
            log.info("storage.local.upload_interrupted", key=key, received=received, error=str(exc))
            return web.Response(status=400, text="upload interrupted\n")
        finally:
            # Runs on every way out, cancellation and a vanished client included. Synchronous on
            # purpose: it must not be interrupted by a second cancellation; it is a close and an
            # unlink (a no-op after commit).
            writer.abort()
        log.info("storage.local.stored", key=key, size_bytes=received)
        return web.Response(status=200, headers={"ETag": f'"{md5.hexdigest()}"'})


@dataclass(frozen=True, kw_only=True)
class _Grant:
    """What a verified URL allows beyond its method and key."""

    lease_id: str | None
    replace: bool


def _write_refusal(exc: StorageError, key: str) -> tuple[int, str]:
    if isinstance(exc, ObjectExists):
        return 412, (
            f"an object already exists at key {key!r}; stored objects are write-once and "
            "are never replaced"
        )
    if isinstance(exc, KeyConflict):
        return 409, str(exc)
    return 500, str(exc)


def _refuse(
    request: web.Request, status: int, reason: str, *, key: str | None = None
) -> web.Response:
    log.warning(
        "storage.local.refused", method=request.method, key=key, status=status, reason=reason
    )
    return web.Response(status=status, text=f"{status} {HTTPStatus(status).phrase}: {reason}\n")
