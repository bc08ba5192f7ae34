"""The local backend's signed URLs, proven where moto cannot: scoping, expiry, tampering,
traversal, atomic uploads and size limits, all over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aiohttp
import pytest
from yarl import URL

from lorafleet.core.errors import StorageError
from lorafleet.scheduler.storage import (
    LocalObjectServer,
    LocalObjectStore,
    LocalStoreConfig,
    ObjectNotFound,
    url_signature,
)
from lorafleet.worker.transfer import TransferClient
from tests.storage.conftest import SECRET, FakeClock

pytestmark = pytest.mark.timeout(30)


async def _status(method: str, url: str, data: bytes = b"") -> tuple[int, str]:
    """One plain request, no retries; `yarl` must not re-encode the path we built."""
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, URL(url, encoded=True), data=data) as response,
    ):
        return response.status, await response.text()


async def _raw(port: int, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (paths no HTTP client would send) and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        status_line = await reader.readline()
        rest = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    return int(status_line.split()[1]), rest


def _with_query(url: str, **changes: str | None) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    for name, value in changes.items():
        name = name.replace("_", "-")
        if value is None:
            query.pop(name)
        else:
            query[name] = value
    return urlunsplit(parts._replace(query=urlencode(query)))


def _with_path(url: str, path: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=path))


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


# -- scoping -----------------------------------------------------------------------------------


async def test_url_for_one_key_cannot_touch_another(local_store: LocalObjectStore) -> None:
    await local_store.put_bytes("jobs/a/result", b"secret A")
    await local_store.put_bytes("jobs/b/result", b"secret B")
    get_a = await local_store.presign_get("jobs/a/result", ttl_s=60)
    put_a = await local_store.presign_put("jobs/a/new", ttl_s=60)

    assert await _status("GET", get_a.url) == (200, "secret A")
    status, reason = await _status("GET", _with_path(get_a.url, "/o/jobs/b/result"))
    assert (status, "signature does not match" in reason) == (403, True)
    status, _ = await _status("PUT", _with_path(put_a.url, "/o/jobs/b/result"), b"overwrite")
    assert status == 403
    assert await local_store.get_bytes("jobs/b/result") == b"secret B"


async def test_get_url_cannot_put_and_put_url_cannot_get(
    local_store: LocalObjectStore, transfer: TransferClient
) -> None:
    await local_store.put_bytes("k", b"original")
    get = await local_store.presign_get("k", ttl_s=60)
    put = await local_store.presign_put("k", ttl_s=60)

    with pytest.raises(StorageError, match="403") as caught:
        await transfer.upload(get.url, b"evil")
    assert caught.value.retryable is False
    assert "signed for GET, not PUT" in str(caught.value)
    assert await local_store.get_bytes("k") == b"original"

    status, reason = await _status("GET", put.url)
    assert status == 403
    assert "signed for PUT, not GET" in reason
    # Changing the method parameter itself breaks the signature.
    assert (await _status("PUT", _with_query(get.url, X_Lf_Method="PUT"), b"evil"))[0] == 403
    assert await local_store.get_bytes("k") == b"original"


async def test_head_is_allowed_with_a_get_url(local_store: LocalObjectStore) -> None:
    await local_store.put_bytes("k", b"12345")
    get = await local_store.presign_get("k", ttl_s=60)
    async with aiohttp.ClientSession() as session, session.head(get.url) as response:
        assert response.status == 200
        assert response.content_length == 5


@pytest.mark.parametrize(
    "change",
    [
        {"X_Lf_Signature": "0" * 64},
        {"X_Lf_Signature": "not-hex"},
        {"X_Lf_Signature": "é" * 64},
        {"X_Lf_Signature": None},
        {"X_Lf_Expires": None},
        {"X_Lf_Method": None},
        {"X_Lf_Expires": "99999999999"},
        {"X_Lf_Expires": "soon"},
    ],
)
async def test_tampered_or_incomplete_urls_are_refused(
    local_store: LocalObjectStore, change: dict[str, str | None]
) -> None:
    await local_store.put_bytes("k", b"v")
    get = await local_store.presign_get("k", ttl_s=60)
    status, reason = await _status("GET", _with_query(get.url, **change))
    assert status == 403
    assert reason.startswith("403 Forbidden: ")


async def test_duplicated_parameters_are_refused(local_store: LocalObjectStore) -> None:
    await local_store.put_bytes("k", b"v")
    get = await local_store.presign_get("k", ttl_s=60)
    assert (await _status("GET", get.url + "&X-Lf-Method=PUT"))[0] == 403


async def test_url_signed_with_another_secret_is_refused(
    local_store: LocalObjectStore, objects_dir: Path, clock: FakeClock
) -> None:
    await local_store.put_bytes("k", b"v")
    other = LocalObjectStore(
        LocalStoreConfig(
            root_dir=objects_dir,
            secret_key=b"another-secret-0123456789abcdef!",
            public_base_url=local_store.server.base_url,
        ),
        clock=clock,
    )
    forged = await other.presign_get("k", ttl_s=60)
    assert (await _status("GET", forged.url))[0] == 403


# -- expiry ------------------------------------------------------------------------------------


async def test_urls_expire(
    local_store: LocalObjectStore, clock: FakeClock, transfer: TransferClient
) -> None:
    await local_store.put_bytes("k", b"v")
    get = await local_store.presign_get("k", ttl_s=30)
    put = await local_store.presign_put("k", ttl_s=30)
    assert get.expires_at.timestamp() == int(clock.now) + 30

    clock.now += 29
    assert await transfer.download(get.url) == b"v"

    clock.now += 1
    with pytest.raises(StorageError, match="expired") as caught:
        await transfer.download(get.url)
    assert caught.value.retryable is False
    with pytest.raises(StorageError, match="expired"):
        await transfer.upload(put.url, b"late")
    assert await local_store.get_bytes("k") == b"v"


# -- traversal and odd keys --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/o/../secret.txt",
        "/o/a/../../secret.txt",
        "/o/%2e%2e/secret.txt",
        "/o/a/%2E%2E/%2e%2e/secret.txt",
        "/o/%2Fetc/passwd",
        "/o/a%5C..%5Csecret.txt",
        "/o/a//b",
        "/o/.lftmp-abc",
        "/o/%ff",
        "/o/",
    ],
)
async def test_paths_outside_the_key_space_are_refused(
    local_store: LocalObjectStore, objects_dir: Path, path: str
) -> None:
    (objects_dir.parent / "secret.txt").write_text("outside the root")
    port = local_store.server.port
    for method, body in (("GET", b""), ("PUT", b"evil")):
        request = (
            f"{method} {path}?X-Lf-Method={method}&X-Lf-Expires=9999999999&X-Lf-Signature=00 "
            f"HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        status, _ = await _raw(port, request)
        assert status == 400
    assert (objects_dir.parent / "secret.txt").read_text() == "outside the root"
    assert _files_under(objects_dir) == []


async def test_traversal_is_refused_even_with_a_valid_signature(
    local_store: LocalObjectStore, objects_dir: Path, clock: FakeClock
) -> None:
    # Defence in depth: a signing bug must still not let a URL escape the root.
    expires = int(clock.now) + 60
    signature = url_signature(SECRET, method="PUT", key="../escaped", expires=expires)
    request = (
        f"PUT /o/%2e%2e/escaped?X-Lf-Method=PUT&X-Lf-Expires={expires}"
        f"&X-Lf-Signature={signature} HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        "Connection: close\r\n\r\nevil"
    ).encode()
    status, body = await _raw(local_store.server.port, request)
    assert status == 400
    assert b"invalid key" in body
    assert not (objects_dir.parent / "escaped").exists()


async def test_symlinks_are_not_followed(
    local_store: LocalObjectStore, objects_dir: Path, tmp_path: Path, transfer: TransferClient
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_bytes(b"outside")
    (objects_dir / "link").symlink_to(outside, target_is_directory=True)
    (objects_dir / "filelink").symlink_to(outside / "file")

    for key in ("link/file", "filelink"):
        get = await local_store.presign_get(key, ttl_s=60)
        assert (await _status("GET", get.url))[0] == 403
        put = await local_store.presign_put(key, ttl_s=60)
        with pytest.raises(StorageError, match="symlink") as caught:
            await transfer.upload(put.url, b"evil")
        assert caught.value.retryable is False
        with pytest.raises(StorageError, match="symlink"):
            await local_store.put_bytes(key, b"evil")
    assert (outside / "file").read_bytes() == b"outside"
    assert await local_store.list("") == []


async def test_keys_with_spaces_and_unicode_round_trip(
    local_store: LocalObjectStore, transfer: TransferClient
) -> None:
    key = "owners/o/instance/photo 1 (copy)+ü%20.png"
    put = await local_store.presign_put(key, ttl_s=60)
    await transfer.upload(put.url, b"image")
    assert [i.key for i in await local_store.list("owners/o/")] == [key]
    get = await local_store.presign_get(key, ttl_s=60)
    assert await transfer.download(get.url) == b"image"


async def test_a_key_cannot_be_both_object_and_folder(local_store: LocalObjectStore) -> None:
    await local_store.put_bytes("a/b", b"file")
    with pytest.raises(StorageError) as caught:
        await local_store.put_bytes("a/b/c", b"x")
    assert caught.value.retryable is False
    with pytest.raises(StorageError) as caught:
        await local_store.put_bytes("a", b"x")
    assert caught.value.retryable is False
    put = await local_store.presign_put("a/b/c", ttl_s=60)
    assert (await _status("PUT", put.url, b"x"))[0] == 409
    with pytest.raises(ObjectNotFound):
        await local_store.get_bytes("a")
    assert await local_store.get_bytes("a/b") == b"file"


# -- uploads: atomicity, integrity, limits -----------------------------------------------------


async def test_interrupted_upload_leaves_no_object_and_no_temporary_file(
    objects_dir: Path, clock: FakeClock
) -> None:
    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    store = LocalObjectStore(config, clock=clock)
    await store.start()
    await store.put_bytes("jobs/j/checkpoints/1-e1", b"committed")
    put = await store.presign_put("jobs/j/checkpoints/2-e1", ttl_s=60)
    target = urlsplit(put.url)

    reader, writer = await asyncio.open_connection("127.0.0.1", store.server.port)
    writer.write(
        f"PUT {target.path}?{target.query} HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n"
        "Expect: 100-continue\r\n\r\n".encode()
    )
    # "100 Continue" means the server has routed the request and is about to read the body.
    assert (await reader.readline()).startswith(b"HTTP/1.1 100")
    writer.write(b"n" * 1_500_000)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    # Shutdown waits for the abandoned handler, so what is on disk afterwards is final.
    await store.close()

    with pytest.raises(ObjectNotFound):
        await store.get_bytes("jobs/j/checkpoints/2-e1")
    assert _files_under(objects_dir) == ["jobs/j/checkpoints/1-e1"]


async def test_content_md5_mismatch_is_refused(
    local_store: LocalObjectStore, objects_dir: Path
) -> None:
    put = await local_store.presign_put("k", ttl_s=60)
    wrong = base64.b64encode(hashlib.md5(b"other", usedforsecurity=False).digest()).decode()
    async with (
        aiohttp.ClientSession() as session,
        session.put(put.url, data=b"body", headers={"Content-MD5": wrong}) as response,
    ):
        assert response.status == 400
        assert "Content-MD5" in await response.text()
    async with (
        aiohttp.ClientSession() as session,
        session.put(put.url, data=b"body", headers={"Content-MD5": "garbage"}) as response,
    ):
        assert response.status == 400
    assert _files_under(objects_dir) == []


async def test_upload_above_the_limit_is_refused(
    local_store: LocalObjectStore, objects_dir: Path, transfer: TransferClient
) -> None:
    # The fixture's limit is 64 KiB.
    put = await local_store.presign_put("big", ttl_s=60)
    await transfer.upload(put.url, b"x" * 64 * 1024)
    with pytest.raises(StorageError, match="413") as caught:
        await transfer.upload(put.url, b"x" * (64 * 1024 + 1))
    assert caught.value.retryable is False
    assert await local_store.get_bytes("big") == b"x" * 64 * 1024
    assert _files_under(objects_dir) == ["big"]


async def test_upload_without_content_length_is_refused(local_store: LocalObjectStore) -> None:
    put = await local_store.presign_put("chunked", ttl_s=60)

    async def body() -> object:
        yield b"chunk"

    async with aiohttp.ClientSession() as session, session.put(put.url, data=body()) as response:
        assert response.status == 411
    with pytest.raises(ObjectNotFound):
        await local_store.get_bytes("chunked")


async def test_large_upload_streams_in_blocks(
    objects_dir: Path, clock: FakeClock, transfer: TransferClient
) -> None:
    data = os.urandom(5 * 1024 * 1024 + 123)
    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    async with LocalObjectStore(config, clock=clock) as store:
        put = await store.presign_put("big", ttl_s=60)
        await transfer.upload(put.url, data)
        get = await store.presign_get("big", ttl_s=60)
        assert await transfer.download(get.url) == data


# -- housekeeping ------------------------------------------------------------------------------


async def test_start_sweeps_partial_uploads_a_crash_left(objects_dir: Path) -> None:
    leftover = objects_dir / "jobs" / "j" / ".lftmp-deadbeef"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half")
    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    store = LocalObjectStore(config)
    assert await store.list("") == []
    async with store:
        assert not leftover.exists()


async def test_delete_removes_empty_folders(
    local_store: LocalObjectStore, objects_dir: Path
) -> None:
    await local_store.put_bytes("jobs/j/checkpoints/1-e1", b"x")
    await local_store.put_bytes("jobs/k/result", b"x")
    await local_store.delete(["jobs/j/checkpoints/1-e1", "jobs/j"])
    assert not (objects_dir / "jobs" / "j").exists()
    assert (objects_dir / "jobs" / "k" / "result").exists()


async def test_server_lifecycle(objects_dir: Path) -> None:
    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    async with LocalObjectServer(config) as server:
        await server.start()
        assert server.base_url == f"http://127.0.0.1:{server.port}"
        port = server.port
        await server.close()
        await server.close()
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.port
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_public_base_url_is_what_urls_start_with(objects_dir: Path) -> None:
    config = LocalStoreConfig(
        root_dir=objects_dir,
        secret_key=SECRET,
        host="0.0.0.0",
        public_base_url="https://scheduler.example:8443/storage/",
    )
    store = LocalObjectStore(config)
    url = await store.presign_get("jobs/j/result", ttl_s=60)
    assert url.url.startswith("https://scheduler.example:8443/storage/o/jobs/j/result?")


def test_config_is_checked(objects_dir: Path) -> None:
    with pytest.raises(ValueError, match="public_base_url"):
        LocalStoreConfig(root_dir=objects_dir, host="0.0.0.0")
    with pytest.raises(ValueError, match="secret_key"):
        LocalStoreConfig(root_dir=objects_dir, secret_key=b"short")
    with pytest.raises(ValueError, match="public_base_url"):
        LocalStoreConfig(root_dir=objects_dir, public_base_url="ftp://x")
    assert "secret" not in repr(LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET))
