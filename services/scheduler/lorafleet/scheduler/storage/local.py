"""`ObjectStore` on a local directory, with signed URLs served over HTTP by the scheduler.

The embedded default needs no S3 endpoint, yet a worker must not care which backend it talks
to: this backend hands out URLs with the same meaning as S3 presigned URLs (one method, one key,
an expiry) and serves them from an aiohttp server that the scheduler process runs.

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

The backend's parts, one module each: `local_urls` (the URL format and its signature, and
`LocalStoreConfig`), `local_server` (the HTTP server that checks and serves the URLs, and its
refusals), `local_files` (objects as files, written atomically). This module holds the store
that ties them together.
"""

from __future__ import annotations

import asyncio
import builtins
import time
import urllib.parse
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import structlog

from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.scheduler.storage.base import (
    HttpMethod,
    ObjectInfo,
    SignedUrl,
    check_lease_id,
    check_ttl,
    is_sha256_hex,
    validate_key,
    validate_prefix,
)
from lorafleet.scheduler.storage.local_files import Files, in_thread
from lorafleet.scheduler.storage.local_server import LocalObjectServer
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
        self._files = Files(config.root_dir)
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
        return await in_thread("list", prefix, self._files.list, prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            validate_key(key)
        await in_thread("delete", keys[0] if keys else "", self._files.delete, keys)

    async def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        await in_thread("put", key, self._files.write, key, data)

    async def get_bytes(self, key: str) -> bytes:
        validate_key(key)
        return await in_thread("get", key, self._files.read, key)

    async def read_range(self, key: str, start: int, length: int) -> bytes:
        validate_key(key)
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        return await in_thread("get", key, self._files.read_range, key, start, length)

    async def verify(self, key: str, *, size_bytes: int, sha256: str) -> bool:
        """Hashes the stored file in a thread (nothing cached: the bytes on disk are what is
        checked); the size is compared first, so a wrong size costs no read."""
        validate_key(key)
        if size_bytes < 0 or not is_sha256_hex(sha256):
            return False
        return await in_thread("verify", key, self._files.verify, key, size_bytes, sha256.lower())

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
