"""`ObjectStore` on a local directory, with signed URLs served over HTTP by the scheduler.

The embedded default needs no S3 endpoint, yet a worker must not care which backend it talks
to: this backend hands out URLs with the same meaning as S3 presigned URLs (one method, one key,
an expiry) and serves them from an aiohttp server that the scheduler process runs.

URL format (method, expiry and signature are required; lease and replace only where signed)::

    {base_url}/o/{percent-encoded key}?X-Lf-Method=GET|PUT&X-Lf-Expires={unix seconds}
        [&X-Lf-Lease={lease id}][&X-Lf-Replace=1]
        &X-Lf-Signature={hex HMAC-SHA256(secret_key, "lorafleet-url-v2\\n" method "\\n"
                                          expires "\\n" lease id or "" "\\n" "1" if replace
                                          else "0" "\\n" key)}

The signature covers the key taken from the path, the lease and the write mode, so a URL signed
for one key cannot touch another and neither the lease binding nor write-once can be stripped;
a GET URL also allows HEAD.

What a PUT URL allows (see `storage.base` for why):

* Write-once: unless signed with `X-Lf-Replace=1` (never for a worker's URL), a PUT to a key
  that holds an object is refused with 412 and nothing is replaced, also when two PUTs of the
  same key race: the upload goes into a temporary file that is hard-linked to the key
  (`os.link` fails if the name exists, so the check and the write are one step). A request
  carrying `If-None-Match: *` is create-only whatever its URL says, as on S3.
* Dies with its lease: a URL carrying `X-Lf-Lease` works only while the injected
  `lease_is_live(lease_id)` says so; it is asked when the PUT arrives and again just before the
  object is stored, so an upload that outlives its lease stores nothing. Unlike S3, where a
  lease's URLs can only be short-lived, the end is immediate here.

Refusals are plain-text HTTP answers:

* 400: the key breaks `validate_key`, a malformed `Content-MD5`, a body that ended early or does
  not match its `Content-MD5`, an `If-None-Match` other than `*`;
* 403: a missing or wrong signature, the wrong method, an expired URL, a key reaching through a
  symlink, a URL whose lease has ended;
* 404: GET of a missing object; 405: another method; 409: a key whose path collides with
  another key's folder (`a` and `a/b` cannot both exist on a filesystem);
* 411: PUT without `Content-Length` (as S3); 412: the key already holds an object (write-once);
  413: PUT above `max_object_bytes`; 503: the lease could not be checked (retry).

Objects are files under `root_dir` at their key's path. A PUT streams its body into a temporary
file beside the target (named with the reserved `.lftmp-` prefix, which no key may use), fsyncs
it and links it to the target's name (renames, for the scheduler's own `put_bytes`), so a
reader sees a whole object, never a part, and a crash mid-upload leaves at most a temporary file
that `start()` sweeps away.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path
from typing import BinaryIO, Final, ParamSpec, TypeVar

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from opentelemetry import propagate, trace

from lorafleet.core.errors import InvalidArgument, StorageError
from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.scheduler.storage.base import (
    IF_NONE_MATCH,
    RESERVED_SEGMENT_PREFIX,
    HttpMethod,
    ObjectInfo,
    ObjectNotFound,
    SignedUrl,
    check_lease_id,
    check_ttl,
    is_sha256_hex,
    validate_key,
    validate_prefix,
)

log = structlog.get_logger(__name__)
_tracer = trace.get_tracer("lorafleet.scheduler.storage")

_P = ParamSpec("_P")
_T = TypeVar("_T")

URL_PATH_PREFIX: Final = "/o/"
PARAM_METHOD: Final = "X-Lf-Method"
PARAM_EXPIRES: Final = "X-Lf-Expires"
PARAM_SIGNATURE: Final = "X-Lf-Signature"
PARAM_LEASE: Final = "X-Lf-Lease"
PARAM_REPLACE: Final = "X-Lf-Replace"
_SIGNING_CONTEXT: Final = "lorafleet-url-v2"
_MIN_SECRET_BYTES: Final = 16
# Read and write in blocks of this size: big enough that the thread hop per block is cheap,
# small enough that a multi-GB upload never sits in memory.
_IO_BLOCK_BYTES: Final = 1024 * 1024
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", ""})

LeaseIsLive = Callable[[str], Awaitable[bool]]
"""Whether the lease with this id is still live (the scheduler answers from its ledger)."""


async def always_live(lease_id: str) -> bool:
    """The `lease_is_live` of a store used without a scheduler: every lease is live.

    Only for tests of the store alone and tools; a scheduler must pass its ledger's check, or
    a lease's upload URLs keep working after the lease ended (until they expire).
    """
    return True


@dataclass(frozen=True, kw_only=True)
class LocalStoreConfig:
    """The local backend: a root directory, the URL signing secret and where URLs are served.

    `secret_key` defaults to random bytes per config object: URLs then stop working when the
    scheduler restarts. Set it (at least 16 bytes) when URLs must outlive the process.
    `public_base_url` (e.g. "http://scheduler.lan:8081") is what URLs start with; it is required
    when `host` binds every interface, because remote workers cannot reach "0.0.0.0". Without
    it, URLs use `host` and the bound port (`port=0` picks a free one).
    """

    root_dir: Path
    secret_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    public_base_url: str | None = None
    # 5 GiB, S3's single-PUT limit, so the two backends accept the same uploads.
    max_object_bytes: int = 5 * 1024**3
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if len(self.secret_key) < _MIN_SECRET_BYTES:
            raise ValueError(f"secret_key must be at least {_MIN_SECRET_BYTES} bytes")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_object_bytes < 0:
            raise ValueError("max_object_bytes must not be negative")
        if self.public_base_url is not None:
            parsed = urllib.parse.urlsplit(self.public_base_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError("public_base_url must be an http(s) URL with a host")
            if parsed.query or parsed.fragment:
                raise ValueError("public_base_url must not have a query or fragment")
        elif self.host in _WILDCARD_HOSTS:
            raise ValueError(f"host {self.host!r} binds every interface: set public_base_url")


def url_signature(
    secret_key: bytes,
    *,
    method: HttpMethod,
    key: str,
    expires: int,
    lease_id: str | None = None,
    replace: bool = False,
) -> str:
    """The hex HMAC-SHA256 that authorises `method` on `key` until unix time `expires`, for
    the lease `lease_id` only (None: not bound to a lease) and, for a PUT, replacing an
    existing object only if `replace`.

    Newlines separate the fields and no field can hold one (methods and numbers cannot, lease
    ids are checked by `check_lease_id`, `validate_key` forbids control characters), so two
    different URLs never sign alike.
    """
    message = (
        f"{_SIGNING_CONTEXT}\n{method}\n{expires}\n{lease_id or ''}\n"
        f"{'1' if replace else '0'}\n{key}"
    ).encode()
    return hmac.new(secret_key, message, hashlib.sha256).hexdigest()


class LocalObjectStore(AsyncLifecycle):
    """`ObjectStore` on `config.root_dir`, serving its signed URLs with a `LocalObjectServer`.

    `start()` sweeps temporary files left by a crash and starts the server; `close()` stops it.
    Server-side methods (`list`, `delete`, `put_bytes`, `get_bytes`, `verify`) work on the
    directory and need no server. `clock` (unix seconds) is injectable so expiry can be tested
    without waiting. `lease_is_live` decides whether a lease's PUT URLs still work; the
    scheduler passes its ledger's check, and only a store used without a scheduler may keep the
    default (`always_live`).
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
        self._files = _Files(config.root_dir)
        self._server = LocalObjectServer(config, clock=clock, lease_is_live=lease_is_live)

    @property
    def server(self) -> LocalObjectServer:
        return self._server

    async def start(self) -> None:
        """Sweep crash leftovers and start serving URLs; does nothing when already serving."""
        if self._server.serving:
            # Sweeping now would delete the temporary files of uploads in progress.
            return
        swept = await asyncio.to_thread(self._files.prepare)
        if swept:
            log.info("storage.local.swept_partial_uploads", count=swept)
        await self._server.start()
        if self._server.lease_is_live is always_live:
            log.warning(
                "storage.local.lease_check_off",
                detail="no lease_is_live given: lease PUT URLs work until they expire",
            )

    async def close(self) -> None:
        """Stop serving URLs, letting uploads in progress finish; idempotent."""
        await self._server.close()

    async def presign_get(self, key: str, *, ttl_s: int, lease_id: str | None = None) -> SignedUrl:
        check_lease_id(lease_id)
        return self._sign("GET", key, ttl_s, lease_id=lease_id)

    async def presign_put(
        self, key: str, *, ttl_s: int, lease_id: str | None = None, write_once: bool = True
    ) -> SignedUrl:
        check_lease_id(lease_id)
        return self._sign("PUT", key, ttl_s, lease_id=lease_id, replace=not write_once)

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        validate_prefix(prefix)
        return await _in_thread("list", prefix, self._files.list, prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            validate_key(key)
        await _in_thread("delete", keys[0] if keys else "", self._files.delete, keys)

    async def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        await _in_thread("put", key, self._files.write, key, data)

    async def get_bytes(self, key: str) -> bytes:
        validate_key(key)
        return await _in_thread("get", key, self._files.read, key)

    async def read_range(self, key: str, start: int, length: int) -> bytes:
        validate_key(key)
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        return await _in_thread("get", key, self._files.read_range, key, start, length)

    async def verify(self, key: str, *, size_bytes: int, sha256: str) -> bool:
        """Hashes the stored file in a thread (nothing cached: the bytes on disk are what is
        checked); the size is compared first, so a wrong size costs no read."""
        validate_key(key)
        if size_bytes < 0 or not is_sha256_hex(sha256):
            return False
        return await _in_thread("verify", key, self._files.verify, key, size_bytes, sha256.lower())

    def _sign(
        self,
        method: HttpMethod,
        key: str,
        ttl_s: int,
        *,
        lease_id: str | None = None,
        replace: bool = False,
    ) -> SignedUrl:
        validate_key(key)
        check_ttl(ttl_s)
        expires = int(self._clock()) + ttl_s
        signature = url_signature(
            self._config.secret_key,
            method=method,
            key=key,
            expires=expires,
            lease_id=lease_id,
            replace=replace,
        )
        params = {PARAM_METHOD: method, PARAM_EXPIRES: str(expires)}
        if lease_id is not None:
            params[PARAM_LEASE] = lease_id
        if replace:
            params[PARAM_REPLACE] = "1"
        params[PARAM_SIGNATURE] = signature
        query = urllib.parse.urlencode(params)
        path = URL_PATH_PREFIX + urllib.parse.quote(key, safe="/")
        return SignedUrl(
            key=key,
            url=f"{self._server.base_url}{path}?{query}",
            method=method,
            expires_at=datetime.fromtimestamp(expires, UTC),
        )


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
        self._files = _Files(config.root_dir)
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
            file, size = await asyncio.to_thread(_open_object, path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return _refuse(request, 404, f"no object at key {key!r}", key=key)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        try:
            await response.prepare(request)
            if request.method == "GET":
                # The open file keeps the version that was current at open time, even if a PUT
                # replaces the object meanwhile.
                while block := await asyncio.to_thread(file.read, _IO_BLOCK_BYTES):
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
        if create_only and await asyncio.to_thread(_is_object, path):
            return _refuse(request, *_write_refusal(_ObjectExists(), key), key=key)
        try:
            writer = await asyncio.to_thread(_AtomicWriter, path)
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
                if len(pending) >= _IO_BLOCK_BYTES:
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
    if isinstance(exc, _ObjectExists):
        return 412, (
            f"an object already exists at key {key!r}; stored objects are write-once and "
            "are never replaced"
        )
    if isinstance(exc, _KeyConflict):
        return 409, str(exc)
    return 500, str(exc)


def _refuse(
    request: web.Request, status: int, reason: str, *, key: str | None = None
) -> web.Response:
    log.warning(
        "storage.local.refused", method=request.method, key=key, status=status, reason=reason
    )
    return web.Response(status=status, text=f"{status} {HTTPStatus(status).phrase}: {reason}\n")


def _is_object(path: Path) -> bool:
    """Whether `path` (from `_Files.path_for`) is a stored object."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _open_object(path: Path) -> tuple[BinaryIO, int]:
    # O_NOFOLLOW: `_Files.path_for` already refused symlinks; this closes the gap in which one
    # could be swapped in for the last component.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(str(path))
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


class _Files:
    """Objects as files under one root: key -> path, atomic writes, listing, deletion.

    Blocking; callers run these methods in threads.
    """

    def __init__(self, root: Path) -> None:
        # Resolved once, so that every object path is compared with the real location.
        self._root = Path(os.path.realpath(root))

    def path_for(self, key: str) -> Path:
        """The file for `key` (a validated key); refuses paths that run through a symlink."""
        path = self._root.joinpath(*key.split("/"))
        # realpath resolves the existing part of the path; anything different from the literal
        # path means a symlink on the way, which could lead outside the root.
        if os.path.realpath(path) != str(path):
            raise StorageError(f"key {key!r} runs through a symlink; refused", retryable=False)
        return path

    def write(self, key: str, data: bytes) -> None:
        """The scheduler's own write (`put_bytes`): replaces, as it is trusted to."""
        writer = _AtomicWriter(self.path_for(key))
        try:
            for start in range(0, len(data), _IO_BLOCK_BYTES):
                writer.write(data[start : start + _IO_BLOCK_BYTES])
            writer.commit(replace=True)
        finally:
            writer.abort()

    def read(self, key: str) -> bytes:
        try:
            file, _ = _open_object(self.path_for(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        with file:
            return file.read()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            file, _ = _open_object(self.path_for(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        with file:
            file.seek(start)
            return file.read(length)

    def verify(self, key: str, size_bytes: int, sha256: str) -> bool:
        try:
            file, size = _open_object(self.path_for(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except StorageError:
            # Through a symlink: not an object this store wrote.
            return False
        with file:
            if size != size_bytes:
                return False
            digest = hashlib.sha256()
            read = 0
            while block := file.read(_IO_BLOCK_BYTES):
                read += len(block)
                digest.update(block)
        return read == size_bytes and digest.hexdigest() == sha256

    def delete(self, keys: Sequence[str]) -> None:
        for key in dict.fromkeys(keys):
            path = self.path_for(key)
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                continue
            except IsADirectoryError:
                # `key` is only a folder of other keys: there is no object to delete.
                continue
            self._prune_empty_parents(path.parent)

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        # Start at the deepest folder that holds every match, then filter by plain string
        # prefix, as S3 does ("jobs/a" matches "jobs/ab/x").
        folder = prefix.rpartition("/")[0]
        found: builtins.list[ObjectInfo] = []
        stack = [(self._root.joinpath(*folder.split("/")) if folder else self._root, folder)]
        while stack:
            directory, rel = stack.pop()
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for entry in entries:
                    if entry.name.startswith(RESERVED_SEGMENT_PREFIX):
                        continue
                    key = f"{rel}/{entry.name}" if rel else entry.name
                    # Symlinks are neither followed nor listed: they are not objects we wrote.
                    if entry.is_dir(follow_symlinks=False):
                        if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                            stack.append((Path(entry.path), key))
                    elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                        try:
                            validate_key(key)
                            size = entry.stat(follow_symlinks=False).st_size
                        except (InvalidArgument, FileNotFoundError):
                            # A file no key could name, or one deleted while listing.
                            continue
                        found.append(ObjectInfo(key=key, size_bytes=size))
        found.sort(key=lambda info: info.key)
        return found

    def prepare(self) -> int:
        """Create the root and remove partial uploads a crash left behind; returns how many."""
        self._root.mkdir(parents=True, exist_ok=True)
        removed = 0
        for directory, subdirs, files in os.walk(self._root):
            subdirs[:] = [d for d in subdirs if not d.startswith(RESERVED_SEGMENT_PREFIX)]
            for name in files:
                if name.startswith(RESERVED_SEGMENT_PREFIX):
                    Path(directory, name).unlink(missing_ok=True)
                    removed += 1
        return removed

    def _prune_empty_parents(self, directory: Path) -> None:
        # S3 has no folders; without this, every finished job would leave empty ones behind.
        while directory != self._root:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent


class _KeyConflict(StorageError):
    """`a` and `a/b` cannot both be files: the key collides with another key's folder."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class _ObjectExists(StorageError):
    """The key already holds an object, and the write was create-only (write-once)."""

    def __init__(self) -> None:
        super().__init__("an object already exists at this key", retryable=False)


class _AtomicWriter:
    """Writes one object into a temporary file beside it, then links or renames it into place.

    `abort()` is always safe to call and a no-op after `commit()`; it waits for a commit running
    in another thread rather than racing it.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._done = False
        try:
            fd, temp = self._make_temporary(path.parent)
        except (FileExistsError, NotADirectoryError) as exc:
            raise _KeyConflict(f"{path.name!r}: a parent folder is an existing object") from exc
        except PermissionError as exc:
            raise StorageError(f"cannot write {path}: {exc}", retryable=False) from exc
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc}", retryable=True) from exc
        self._temp = Path(temp)
        self._file = os.fdopen(fd, "wb")

    @staticmethod
    def _make_temporary(directory: Path) -> tuple[int, str]:
        for _ in range(4):
            directory.mkdir(parents=True, exist_ok=True)
            try:
                return tempfile.mkstemp(prefix=RESERVED_SEGMENT_PREFIX, dir=directory)
            except FileNotFoundError:
                # A delete pruned the folder between mkdir and mkstemp: make it again.
                continue
        raise OSError(f"{directory} keeps disappearing")

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise StorageError(f"cannot write {self._path}: {exc}", retryable=True) from exc

    def commit(self, *, replace: bool) -> None:
        """Make the object visible. `replace=False` (write-once): raises `_ObjectExists` if the
        key holds an object, atomically, whoever else is committing the same key meanwhile."""
        with self._lock:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                if replace:
                    os.replace(self._temp, self._path)
                else:
                    # link(2) fails with EEXIST if the name exists: the check and the write are
                    # one step, so of two racing uploads exactly one creates the object.
                    os.link(self._temp, self._path)
            except FileExistsError as exc:
                if not replace and _is_object(self._path):
                    raise _ObjectExists() from exc
                raise _KeyConflict(f"{self._path.name!r} is a folder of other objects") from exc
            except IsADirectoryError as exc:
                raise _KeyConflict(f"{self._path.name!r} is a folder of other objects") from exc
            except OSError as exc:
                raise StorageError(f"cannot write {self._path}: {exc}", retryable=True) from exc
            self._done = True
            if not replace:
                # The object has its name; the temporary one goes (a crash here leaves a second
                # name for the same bytes, which `start()` sweeps).
                with contextlib.suppress(OSError):
                    self._temp.unlink()
            # The rename is durable only once the folder's entry is on disk.
            _fsync_directory(self._path.parent)

    def abort(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self._file.close()
            self._temp.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _in_thread(
    operation: str, key: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
) -> _T:
    """Run blocking file work off the event loop, turning OS errors into `StorageError`."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except StorageError:
        raise
    except PermissionError as exc:
        raise StorageError(f"{operation} {key!r}: {exc}", retryable=False) from exc
    except OSError as exc:
        # Disk full, I/O errors: may clear up; the caller decides.
        raise StorageError(f"{operation} {key!r}: {exc}", retryable=True) from exc
