"""What every `ObjectStore` promises, checked on both backends over real HTTP, plus the S3
backend's error translation."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import botocore.exceptions
import pytest

from lorafleet.core.errors import InvalidArgument, StorageError
from lorafleet.scheduler.storage import (
    MAX_URL_TTL_S,
    LocalObjectStore,
    LocalStoreConfig,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    S3ObjectStore,
    open_object_store,
)
from lorafleet.scheduler.storage.s3 import storage_error
from lorafleet.worker.transfer import TransferClient
from tests.storage.conftest import s3_config

pytestmark = pytest.mark.timeout(30)


async def test_presigned_put_then_get_round_trip(
    store: ObjectStore, transfer: TransferClient
) -> None:
    data = os.urandom(300_000)
    key = "jobs/j1/checkpoints/100-e1"
    put = await store.presign_put(key, ttl_s=600)
    assert (put.key, put.method) == (key, "PUT")
    before = datetime.now(UTC)
    assert before + timedelta(seconds=590) < put.expires_at <= before + timedelta(seconds=601)

    await transfer.upload(put.url, data)

    get = await store.presign_get(key, ttl_s=600)
    assert get.method == "GET"
    assert await transfer.download(get.url) == data
    assert await store.get_bytes(key) == data
    assert await store.list("jobs/j1/") == [ObjectInfo(key=key, size_bytes=len(data))]


async def test_put_bytes_is_readable_through_a_get_url(
    store: ObjectStore, transfer: TransferClient
) -> None:
    await store.put_bytes("jobs/j2/result/lora.safetensors", b"weights")
    await store.put_bytes("jobs/j2/result/lora.safetensors", b"weights v2")
    url = await store.presign_get("jobs/j2/result/lora.safetensors", ttl_s=60)
    assert await transfer.download(url.url) == b"weights v2"


async def test_empty_object_round_trip(store: ObjectStore, transfer: TransferClient) -> None:
    put = await store.presign_put("owners/o/empty.txt", ttl_s=60)
    await transfer.upload(put.url, b"")
    assert await store.get_bytes("owners/o/empty.txt") == b""


async def test_list_reads_every_page_and_uses_plain_prefixes(store: ObjectStore) -> None:
    # Page size is 2 for the S3 fixture, so seven objects take four pages.
    keys = [f"jobs/a/checkpoints/{step}-e1" for step in range(100, 800, 100)]
    for key in keys:
        await store.put_bytes(key, key.encode())
    await store.put_bytes("jobs/ab/other", b"x")
    await store.put_bytes("jobsx", b"x")

    listed = await store.list("jobs/a/checkpoints/")
    assert listed == sorted(
        (ObjectInfo(key=k, size_bytes=len(k)) for k in keys), key=lambda i: i.key
    )
    # A string prefix, not a folder: "jobs/a" also matches "jobs/ab/...".
    assert [i.key for i in await store.list("jobs/a")] == sorted([*keys, "jobs/ab/other"])
    assert len(await store.list("")) == len(keys) + 2
    assert await store.list("nothing/here/") == []


async def test_delete_batches_and_is_idempotent(store: ObjectStore) -> None:
    keys = [f"jobs/d/checkpoints/{n}-e1" for n in range(5)]
    for key in keys:
        await store.put_bytes(key, b"x")
    await store.put_bytes("jobs/d/result", b"keep")

    # Batch size is 2 for the S3 fixture: three requests, one of them for a missing key.
    await store.delete([*keys[:4], "jobs/d/never-existed"])
    assert [i.key for i in await store.list("jobs/d/")] == [keys[4], "jobs/d/result"]
    await store.delete(keys)
    await store.delete(keys)
    await store.delete([])
    assert [i.key for i in await store.list("jobs/d/")] == ["jobs/d/result"]


async def test_get_of_missing_key_is_not_retryable(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as caught:
        await store.get_bytes("jobs/none/result")
    assert isinstance(caught.value, StorageError)
    assert caught.value.retryable is False


async def test_download_of_missing_object_is_not_retried(
    store: ObjectStore, transfer: TransferClient
) -> None:
    url = await store.presign_get("jobs/none/result", ttl_s=60)
    with pytest.raises(StorageError, match="404") as caught:
        await transfer.download(url.url)
    assert caught.value.retryable is False


# One test per backend rather than per key: building an S3 client costs a few hundred ms.
INVALID_KEYS = [
    "",
    "/abs",
    "a//b",
    "a/../b",
    "..",
    "a/./b",
    "trailing/",
    "a\\b",
    "a\nb",
    "x" * 1025,
]


async def test_invalid_keys_are_refused_everywhere(store: ObjectStore) -> None:
    for key in INVALID_KEYS:
        with pytest.raises(InvalidArgument):
            await store.presign_put(key, ttl_s=60)
        with pytest.raises(InvalidArgument):
            await store.presign_get(key, ttl_s=60)
        with pytest.raises(InvalidArgument):
            await store.put_bytes(key, b"x")
        with pytest.raises(InvalidArgument):
            await store.get_bytes(key)
        with pytest.raises(InvalidArgument):
            await store.delete(["fine", key])
    for prefix in ("/", "../", "a//"):
        with pytest.raises(InvalidArgument):
            await store.list(prefix)


async def test_ttl_out_of_range_is_refused(store: ObjectStore) -> None:
    for ttl_s in (0, -5, MAX_URL_TTL_S + 1):
        with pytest.raises(ValueError, match="ttl_s"):
            await store.presign_get("a", ttl_s=ttl_s)


def test_open_object_store_picks_the_backend(moto_endpoint: str, tmp_path: Path) -> None:
    assert isinstance(open_object_store(s3_config(moto_endpoint)), S3ObjectStore)
    local = LocalStoreConfig(root_dir=tmp_path / "o", secret_key=b"k" * 32)
    assert isinstance(open_object_store(local), LocalObjectStore)


# -- S3 specifics ------------------------------------------------------------------------------


async def test_s3_unreachable_endpoint_is_retryable() -> None:
    # A bound socket that never listens: connections are refused at once, on every platform.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = s3_config(f"http://127.0.0.1:{port}", create_bucket=False, max_attempts=1)
        async with S3ObjectStore(config) as store:
            with pytest.raises(StorageError) as caught:
                await store.get_bytes("a")
    assert caught.value.retryable is True
    assert not isinstance(caught.value, ObjectNotFound)


async def test_s3_missing_bucket_is_not_retryable(moto_endpoint: str) -> None:
    async with S3ObjectStore(s3_config(moto_endpoint, create_bucket=False)) as store:
        with pytest.raises(StorageError, match="NoSuchBucket") as caught:
            await store.list("")
    assert caught.value.retryable is False


async def test_s3_create_bucket_twice_is_fine(moto_endpoint: str) -> None:
    config = s3_config(moto_endpoint)
    async with S3ObjectStore(config) as first:
        await first.put_bytes("k", b"v")
    async with S3ObjectStore(config) as second:
        assert await second.get_bytes("k") == b"v"


async def test_s3_large_object_goes_multipart(moto_endpoint: str) -> None:
    config = s3_config(
        moto_endpoint, multipart_threshold_bytes=5 * 1024**2, multipart_chunk_bytes=5 * 1024**2
    )
    data = os.urandom(11 * 1024**2)
    async with S3ObjectStore(config) as store:
        await store.put_bytes("big", data)
        assert await store.get_bytes("big") == data


async def test_s3_close_is_idempotent_and_calls_after_close_fail(moto_endpoint: str) -> None:
    store = S3ObjectStore(s3_config(moto_endpoint))
    await store.start()
    await store.close()
    await store.close()
    with pytest.raises(RuntimeError, match="not started"):
        await store.presign_get("a", ttl_s=60)


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "GetObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "status", "retryable"),
    [
        ("SlowDown", 503, True),
        ("InternalError", 500, True),
        ("Throttling", 400, True),
        ("RequestTimeout", 400, True),
        ("TooManyRequests", 429, True),
        ("AccessDenied", 403, False),
        ("InvalidAccessKeyId", 403, False),
        ("NoSuchBucket", 404, False),
    ],
)
def test_s3_error_classification(code: str, status: int, retryable: bool) -> None:
    error = storage_error("get", "bkt", "k", _client_error(code, status))
    assert error.retryable is retryable
    assert code in str(error)


def test_s3_missing_key_is_object_not_found() -> None:
    error = storage_error("get", "bkt", "k", _client_error("NoSuchKey", 404))
    assert isinstance(error, ObjectNotFound)
    assert error.retryable is False


def test_s3_connection_errors_are_retryable() -> None:
    error = storage_error(
        "put", "bkt", "k", botocore.exceptions.EndpointConnectionError(endpoint_url="http://x")
    )
    assert error.retryable is True
    assert (
        storage_error("put", "bkt", "k", botocore.exceptions.NoCredentialsError()).retryable
        is False
    )
