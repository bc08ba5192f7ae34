"""`ObjectStore` over any S3-compatible endpoint (AWS S3, Cloudflare R2, MinIO) with boto3.

boto3 is synchronous: every call that can touch the network (including presigning, which may
refresh credentials) runs in a worker thread through `asyncio.to_thread`, so the scheduler's
event loop never blocks on storage.

PUT URLs (see `storage.base` for the rules both backends keep):

* Write-once is S3's conditional write: `presign_put(write_once=True)` signs
  `If-None-Match: *` into the URL, so S3 refuses the PUT without that header (the signature no
  longer matches) and, with it, refuses to replace an existing object (412 PreconditionFailed;
  409 ConditionalRequestConflict while another conditional write of the key is in flight).
  `SignedUrl.headers` names the header; the worker's uploader always sends it.
* Nothing can ask the scheduler whether a lease is live when a presigned URL is used, so
  `lease_id` is not part of the URL: a lease's PUT URLs die when they expire, and the signer
  keeps their TTL short (minutes) and renews them on heartbeats. Until then a late PUT can only
  create a key of that lease that is still empty: it can never replace a recorded object
  (write-once), and `verify` keeps the ledger from recording bytes it did not announce.
* The body's sha256 cannot be signed into the URL: S3 would need the value when signing, and a
  lease's URLs are made before its bytes exist. `verify` therefore trusts a full-object SHA256
  checksum S3 itself holds for the object (it validated it when the object was written) and
  otherwise reads the object back through hashlib, in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

import boto3
import boto3.s3.transfer
import botocore.config
import botocore.exceptions
import s3transfer.exceptions

from lorafleet.core.errors import StorageError
from lorafleet.core.lifecycle import AsyncLifecycle
from lorafleet.scheduler.storage.base import (
    IF_NONE_MATCH,
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

T = TypeVar("T")

# S3's own limits: DeleteObjects takes at most 1000 keys, ListObjectsV2 returns at most 1000.
_MAX_DELETE_BATCH = 1000
_MAX_LIST_PAGE = 1000

# Error codes that mean "slow down or try again" even when the status is a 4xx.
_RETRYABLE_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "SlowDown",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# The object changed between verify's HEAD and its GET (If-Match): not the object we checked.
_CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
_VERIFY_BLOCK_BYTES = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Where and how to reach the bucket.

    Credentials: leave `access_key_id`/`secret_access_key` empty to use boto3's standard chain
    (environment, shared config, instance/container roles). `endpoint_url` empty means AWS.
    `addressing_style="path"` suits MinIO and most self-hosted endpoints; "auto" lets botocore
    choose (virtual-hosted on AWS).
    """

    bucket: str
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    # Create the bucket on start() if it does not exist (the demo and tests; not production).
    create_bucket: bool = False
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    # Attempts per request, botocore's "standard" retry mode (throttling, 5xx, connection).
    max_attempts: int = 5
    max_pool_connections: int = 16
    # Objects above this size go up and down in parallel multipart parts.
    multipart_threshold_bytes: int = 64 * 1024 * 1024
    multipart_chunk_bytes: int = 16 * 1024 * 1024
    transfer_concurrency: int = 8
    list_page_size: int = _MAX_LIST_PAGE
    delete_batch_size: int = _MAX_DELETE_BATCH

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("bucket must not be empty")
        if not 1 <= self.list_page_size <= _MAX_LIST_PAGE:
            raise ValueError(f"list_page_size must be in 1..{_MAX_LIST_PAGE}")
        if not 1 <= self.delete_batch_size <= _MAX_DELETE_BATCH:
            raise ValueError(f"delete_batch_size must be in 1..{_MAX_DELETE_BATCH}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set both access_key_id and secret_access_key, or neither")


class S3ObjectStore(AsyncLifecycle):
    """`ObjectStore` on an S3-compatible bucket; see `S3Config`."""

    def __init__(self, config: S3Config) -> None:
        self._config = config
        # Typed loosely on purpose: the S3 client's precise type lives in the optional
        # mypy-boto3-s3 stubs, and botocore builds the client class at runtime.
        self._client: Any = None
        self._transfer_config = boto3.s3.transfer.TransferConfig(
            multipart_threshold=config.multipart_threshold_bytes,
            multipart_chunksize=config.multipart_chunk_bytes,
            max_concurrency=config.transfer_concurrency,
        )

    @property
    def config(self) -> S3Config:
        return self._config

    async def start(self) -> None:
        """Build the client (resolving credentials may hit the network) and, if configured,
        create the bucket."""
        if self._client is not None:
            return
        self._client = await asyncio.to_thread(self._make_client)
        if self._config.create_bucket:
            await self._call("create bucket", self._config.bucket, self._create_bucket)

    async def close(self) -> None:
        """Close the client's connection pool; idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    async def presign_get(self, key: str, *, ttl_s: int, lease_id: str | None = None) -> SignedUrl:
        """See `ObjectStore.presign_get`; `lease_id` is checked but not in the URL (S3 cannot
        ask whether a lease is live): keep `ttl_s` short for a lease's URLs."""
        check_lease_id(lease_id)
        return await self._presign("GET", "get_object", key, ttl_s)

    async def presign_put(
        self, key: str, *, ttl_s: int, lease_id: str | None = None, write_once: bool = True
    ) -> SignedUrl:
        """See `ObjectStore.presign_put`; `lease_id` is checked but not in the URL (S3 cannot
        ask whether a lease is live): keep `ttl_s` short for a lease's URLs."""
        check_lease_id(lease_id)
        if not write_once:
            return await self._presign("PUT", "put_object", key, ttl_s)
        return await self._presign(
            "PUT",
            "put_object",
            key,
            ttl_s,
            params={"IfNoneMatch": "*"},
            headers={IF_NONE_MATCH: "*"},
        )

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        validate_prefix(prefix)
        client = self._require_client()

        def list_all() -> builtins.list[ObjectInfo]:
            paginator = client.get_paginator("list_objects_v2")
            pages = paginator.paginate(
                Bucket=self._config.bucket,
                Prefix=prefix,
                PaginationConfig={"PageSize": self._config.list_page_size},
            )
            return [
                ObjectInfo(key=item["Key"], size_bytes=item["Size"])
                for page in pages
                for item in page.get("Contents", ())
            ]

        found = await self._call("list", prefix, list_all)
        # S3 already lists in UTF-8 byte order, which equals str order; some compatible
        # stores do not promise it, and callers rely on it.
        return sorted(found, key=lambda info: info.key)

    async def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            validate_key(key)
        client = self._require_client()
        # Deduplicate: S3 rejects nothing for duplicates, but they waste batch slots.
        unique = list(dict.fromkeys(keys))
        size = self._config.delete_batch_size
        for start in range(0, len(unique), size):
            batch = unique[start : start + size]

            def delete_batch(batch: builtins.list[str] = batch) -> Any:
                return client.delete_objects(
                    Bucket=self._config.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )

            response = await self._call("delete", batch[0], delete_batch)
            # DeleteObjects answers 200 even when single keys failed; the failures are listed.
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                code = str(first.get("Code", ""))
                raise StorageError(
                    f"delete failed for {len(errors)} of {len(batch)} keys, first "
                    f"{first.get('Key')!r}: {code} {first.get('Message', '')}".rstrip(),
                    retryable=code in _RETRYABLE_CODES,
                )

    async def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        client = self._require_client()

        def upload() -> None:
            # The transfer manager splits large bodies into parallel multipart parts; S3 makes
            # the object visible only when the upload completes, so readers never see a part.
            client.upload_fileobj(
                io.BytesIO(data), self._config.bucket, key, Config=self._transfer_config
            )

        await self._call("put", key, upload)

    async def get_bytes(self, key: str) -> bytes:
        validate_key(key)
        client = self._require_client()

        def download() -> bytes:
            buffer = io.BytesIO()
            client.download_fileobj(self._config.bucket, key, buffer, Config=self._transfer_config)
            return buffer.getvalue()

        return await self._call("get", key, download)

    async def read_range(self, key: str, start: int, length: int) -> bytes:
        validate_key(key)
        if start < 0 or length < 0:
            raise ValueError("start and length must not be negative")
        if length == 0:
            return b""
        client = self._require_client()
        bucket = self._config.bucket

        def ranged() -> bytes:
            try:
                response = client.get_object(
                    Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
                )
            except botocore.exceptions.ClientError as exc:
                if _error_code(exc) in ("InvalidRange", "416"):
                    return b""  # the object ends before `start`
                raise
            with contextlib.closing(response["Body"]) as body:
                data: bytes = body.read(length)
            return data

        return await self._call("get", key, ranged)

    async def verify(self, key: str, *, size_bytes: int, sha256: str) -> bool:
        validate_key(key)
        if size_bytes < 0 or not is_sha256_hex(sha256):
            return False
        client = self._require_client()
        bucket = self._config.bucket
        wanted = bytes.fromhex(sha256)

        def check() -> bool:
            try:
                head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            except botocore.exceptions.ClientError as exc:
                if _error_code(exc) in _NOT_FOUND_CODES:
                    return False
                raise
            if int(head["ContentLength"]) != size_bytes:
                return False
            stored = head.get("ChecksumSHA256")
            # A multipart object's checksum is of its parts ("...-3", type COMPOSITE): useless.
            full_object = head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
            if stored and "-" not in stored and full_object:
                return bool(base64.b64decode(stored) == wanted)
            try:
                # If-Match: the bytes hashed are those of the object whose size was checked.
                body = client.get_object(Bucket=bucket, Key=key, IfMatch=head["ETag"])["Body"]
            except botocore.exceptions.ClientError as exc:
                if _error_code(exc) in _NOT_FOUND_CODES | _CHANGED_CODES:
                    return False
                raise
            digest = hashlib.sha256()
            read = 0
            with contextlib.closing(body):
                while block := body.read(_VERIFY_BLOCK_BYTES):
                    read += len(block)
                    digest.update(block)
            return read == size_bytes and digest.digest() == wanted

        return await self._call("verify", key, check)

    # -- internals -------------------------------------------------------------------------

    def _make_client(self) -> Any:
        config = self._config
        # A session per store: boto3's default session is shared global state and sessions are
        # not thread-safe; the client itself is.
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            aws_session_token=config.session_token,
            region_name=config.region,
        )
        return session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=botocore.config.Config(
                signature_version="s3v4",
                s3={"addressing_style": config.addressing_style},
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"mode": "standard", "max_attempts": config.max_attempts},
                max_pool_connections=config.max_pool_connections,
                # Recent botocore adds CRC checksums to requests by default; several
                # S3-compatible stores reject them, and a presigned PUT would carry the
                # checksum of an empty body. Checksums only where the API requires them.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def _create_bucket(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self._config.bucket}
        # us-east-1 is the one region that rejects an explicit LocationConstraint.
        if self._config.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self._config.region}
        try:
            self._require_client().create_bucket(**kwargs)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) != "BucketAlreadyOwnedByYou":
                raise

    async def _presign(
        self,
        method: HttpMethod,
        operation: str,
        key: str,
        ttl_s: int,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> SignedUrl:
        """A presigned URL; `params` that botocore sends as headers (IfNoneMatch) are signed,
        so the request must carry them: `headers` says which, for `SignedUrl.headers`."""
        validate_key(key)
        check_ttl(ttl_s)
        client = self._require_client()
        # Taken before signing, so the URL expires no earlier than promised.
        expires_at = datetime.now(UTC) + timedelta(seconds=ttl_s)

        def sign() -> str:
            url: str = client.generate_presigned_url(
                operation,
                Params={"Bucket": self._config.bucket, "Key": key, **(params or {})},
                ExpiresIn=ttl_s,
                HttpMethod=method,
            )
            return url

        url = await self._call("presign", key, sign)
        return SignedUrl(
            key=key, url=url, method=method, expires_at=expires_at, headers=dict(headers or {})
        )

    def _require_client(self) -> Any:
        if self._client is None:
            raise RuntimeError("S3ObjectStore is not started (use `async with` or start())")
        return self._client

    async def _call(self, operation: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except (
            botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError,
            boto3.exceptions.Boto3Error,
            s3transfer.exceptions.RetriesExceededError,
        ) as exc:
            raise storage_error(operation, self._config.bucket, key, exc) from exc


def storage_error(operation: str, bucket: str, key: str, exc: Exception) -> StorageError:
    """Translate a boto3/botocore failure into `StorageError`, deciding whether a retry can help.

    Retryable: throttling, 5xx, timeouts and connection failures (botocore has already retried
    these `max_attempts` times; a later retry by the caller may still succeed). Not retryable:
    missing keys (`ObjectNotFound`), access denied, bad credentials or parameters.
    """
    where = f"{operation} s3://{bucket}/{key}"
    if isinstance(exc, botocore.exceptions.ClientError):
        code = _error_code(exc)
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _NOT_FOUND_CODES and operation == "get":
            return ObjectNotFound(key)
        message = exc.response.get("Error", {}).get("Message", "")
        retryable = status >= 500 or status == 429 or code in _RETRYABLE_CODES
        return StorageError(
            f"{where}: {code} (HTTP {status}) {message}".rstrip(), retryable=retryable
        )
    if isinstance(
        exc,
        s3transfer.exceptions.RetriesExceededError | boto3.exceptions.RetriesExceededError,
    ):
        # boto3's stubs omit `last_exception`, the useful part; both classes set it.
        last = getattr(exc, "last_exception", exc)
        return StorageError(f"{where}: retries exhausted: {last}", retryable=True)
    if isinstance(exc, botocore.exceptions.SSLError):
        # A certificate problem does not fix itself between attempts.
        return StorageError(f"{where}: {exc}", retryable=False)
    if isinstance(
        exc,
        botocore.exceptions.ConnectionError
        | botocore.exceptions.HTTPClientError
        | botocore.exceptions.IncompleteReadError,
    ):
        return StorageError(f"{where}: {exc}", retryable=True)
    return StorageError(f"{where}: {exc}", retryable=False)


def _error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
