"""Stored bytes are write-once, checked by digest, and a lease's upload URLs die with it.

Over real HTTP on loopback: the local backend (lorafleet's own code, where every rule is
enforced by the store) and S3 through moto's server (which honours `If-None-Match: *` but does
not check signatures, so there the signed header is asserted on the URL itself).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

import aiohttp
import pytest

from lorafleet.core.errors import InvalidArgument, StorageError
from lorafleet.core.model import Job, JobState, Progress
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.signing import UrlSigner
from lorafleet.scheduler.storage import (
    LocalObjectStore,
    LocalStoreConfig,
    ObjectStore,
    S3ObjectStore,
)
from lorafleet.worker.transfer import TransferClient
from tests.storage.conftest import SECRET, FakeClock

pytestmark = pytest.mark.timeout(30)

LEASE = "0f6c1f6e-5a38-4a35-9a52-3c1c2b7a9d10"
OTHER_LEASE = "5d0e2f4b-8f7e-4c8e-9d53-0b2a8c9e1f22"


class Leases:
    """The scheduler's `lease_is_live`, played by the test: a set of live lease ids."""

    def __init__(self, *live: str) -> None:
        self.live = set(live)
        self.asked: list[str] = []

    async def __call__(self, lease_id: str) -> bool:
        self.asked.append(lease_id)
        return lease_id in self.live


@pytest.fixture
def leases() -> Leases:
    return Leases(LEASE)


@pytest.fixture
async def leased(
    objects_dir: Path, clock: FakeClock, leases: Leases
) -> AsyncIterator[LocalObjectStore]:
    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    async with LocalObjectStore(config, clock=clock, lease_is_live=leases) as local:
        yield local


async def _put(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.put(url, data=data, headers=headers or {}) as response,
    ):
        return response.status, await response.text()


def _with_query(url: str, **changes: str | None) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    for name, value in changes.items():
        name = name.replace("_", "-")
        if value is None:
            query.pop(name, None)
        else:
            query[name] = value
    return urlunsplit(parts._replace(query=urlencode(query)))


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- write-once (local) ------------------------------------------------------------------------


async def test_a_second_put_is_refused_and_nothing_is_replaced(
    leased: LocalObjectStore, objects_dir: Path, transfer: TransferClient
) -> None:
    key = "jobs/j/checkpoints/100-e1"
    first = await leased.presign_put(key, ttl_s=60, lease_id=LEASE)
    assert await _put(first.url, b"committed") == (200, "")

    # The same URL again, and a fresh URL for the same key: neither replaces the object.
    second = await leased.presign_put(key, ttl_s=60, lease_id=LEASE)
    for url in (first.url, second.url):
        status, reason = await _put(url, b"forged")
        assert status == 412
        assert reason.startswith("412 Precondition Failed: ")
        assert "write-once" in reason
    with pytest.raises(StorageError, match="412") as caught:
        await transfer.upload(second.url, b"forged")
    assert caught.value.retryable is False

    assert await leased.get_bytes(key) == b"committed"
    assert await leased.verify(key, size_bytes=9, sha256=_sha(b"committed"))
    assert _files_under(objects_dir) == ["jobs/j/checkpoints/100-e1"]


async def test_two_racing_puts_of_one_key_exactly_one_wins(
    objects_dir: Path, clock: FakeClock
) -> None:
    # Each PUT asks whether its lease is live twice: when it arrives and just before its
    # object is stored. The barrier holds each request at both points until the other is
    # there too, so both have passed every check and written their whole body before either
    # stores: only the store's no-replace step can pick the winner.
    barrier = asyncio.Barrier(2)

    async def live_after_both_arrive(lease_id: str) -> bool:
        async with asyncio.timeout(10):
            await barrier.wait()
        return True

    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    async with LocalObjectStore(config, clock=clock, lease_is_live=live_after_both_arrive) as race:
        key = "jobs/j/result/e1/pytorch_lora_weights.safetensors"
        url = (await race.presign_put(key, ttl_s=60, lease_id=LEASE)).url
        bodies = [b"A" * 70_000, b"B" * 70_000]
        answers = await asyncio.gather(*(_put(url, body) for body in bodies))

        statuses = sorted(status for status, _ in answers)
        assert statuses == [200, 412]
        winner = bodies[[status for status, _ in answers].index(200)]
        assert await race.get_bytes(key) == winner
    # No second name, no temporary file left behind.
    assert _files_under(objects_dir) == ["jobs/j/result/e1/pytorch_lora_weights.safetensors"]


async def test_racing_puts_without_a_lease_also_leave_one_object(
    local_store: LocalObjectStore, objects_dir: Path
) -> None:
    url = (await local_store.presign_put("k", ttl_s=60)).url
    answers = await asyncio.gather(*(_put(url, bytes([n]) * 1000) for n in range(8)))
    assert sorted(status for status, _ in answers).count(200) == 1
    assert _files_under(objects_dir) == ["k"]


async def test_replaceable_urls_and_if_none_match(
    local_store: LocalObjectStore, objects_dir: Path
) -> None:
    # A URL signed with write_once=False (users' own uploads) may replace...
    url = (await local_store.presign_put("owners/o/a.png", ttl_s=60, write_once=False)).url
    assert (await _put(url, b"one"))[0] == 200
    assert (await _put(url, b"two"))[0] == 200
    assert await local_store.get_bytes("owners/o/a.png") == b"two"
    # ...unless the request itself asks for create-only, as S3 does.
    assert (await _put(url, b"three", {"If-None-Match": "*"}))[0] == 412
    assert (await _put(url, b"three", {"If-None-Match": '"etag"'}))[0] == 400
    assert await local_store.get_bytes("owners/o/a.png") == b"two"
    # A worker's (write-once) URL cannot be turned into a replacing one.
    once = (await local_store.presign_put("owners/o/a.png", ttl_s=60)).url
    status, reason = await _put(_with_query(once, X_Lf_Replace="1"), b"evil")
    assert (status, "signature does not match" in reason) == (403, True)
    # The scheduler's own writes replace, as before.
    await local_store.put_bytes("owners/o/a.png", b"server")
    assert await local_store.get_bytes("owners/o/a.png") == b"server"
    assert _files_under(objects_dir) == ["owners/o/a.png"]


# -- upload URLs die with their lease (local) ----------------------------------------------------


async def test_a_lease_url_works_while_the_lease_lives_and_not_after(
    leased: LocalObjectStore, leases: Leases, objects_dir: Path, transfer: TransferClient
) -> None:
    live = await leased.presign_put("jobs/j/checkpoints/100-e1", ttl_s=600, lease_id=LEASE)
    assert parse_qs(urlsplit(live.url).query)["X-Lf-Lease"] == [LEASE]
    await transfer.upload(live.url, b"while live")
    assert leases.asked == [LEASE, LEASE]

    late = await leased.presign_put("jobs/j/checkpoints/200-e1", ttl_s=600, lease_id=LEASE)
    leases.live.clear()  # the lease ended: expired, drained, failed, succeeded or superseded
    status, reason = await _put(late.url, b"after the end")
    assert status == 403
    assert f"lease {LEASE} has ended" in reason
    with pytest.raises(StorageError, match="has ended") as caught:
        await transfer.upload(late.url, b"after the end")
    assert caught.value.retryable is False

    # URLs that belong to no lease, and reads, do not depend on one.
    free = await leased.presign_put("owners/o/x.png", ttl_s=600)
    assert (await _put(free.url, b"user data"))[0] == 200
    get = await leased.presign_get("jobs/j/checkpoints/100-e1", ttl_s=600)
    assert await transfer.download(get.url) == b"while live"
    assert _files_under(objects_dir) == ["jobs/j/checkpoints/100-e1", "owners/o/x.png"]


async def test_an_upload_that_outlives_its_lease_stores_nothing(
    objects_dir: Path, clock: FakeClock
) -> None:
    answers = iter([True, False])  # live when the PUT arrives, over when it is to be stored

    async def ends_during_upload(lease_id: str) -> bool:
        return next(answers)

    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    async with LocalObjectStore(config, clock=clock, lease_is_live=ends_during_upload) as local:
        url = (await local.presign_put("jobs/j/result/e1/x", ttl_s=60, lease_id=LEASE)).url
        status, reason = await _put(url, os.urandom(900_000))
    assert status == 403
    assert "has ended" in reason
    assert _files_under(objects_dir) == []


async def test_a_lease_that_cannot_be_checked_answers_503_and_stores_nothing(
    objects_dir: Path, clock: FakeClock
) -> None:
    async def ledger_down(lease_id: str) -> bool:
        raise ConnectionError("ledger unreachable")

    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET)
    async with LocalObjectStore(config, clock=clock, lease_is_live=ledger_down) as local:
        url = (await local.presign_put("jobs/j/result/e1/x", ttl_s=60, lease_id=LEASE)).url
        status, reason = await _put(url, b"x")
    assert status == 503
    assert "try again" in reason
    assert _files_under(objects_dir) == []


async def test_the_lease_in_a_url_cannot_be_changed_or_dropped(
    leased: LocalObjectStore, leases: Leases, objects_dir: Path
) -> None:
    leases.live.add(OTHER_LEASE)
    leases.live.discard(LEASE)
    url = (await leased.presign_put("jobs/j/checkpoints/1-e1", ttl_s=60, lease_id=LEASE)).url
    for forged in (_with_query(url, X_Lf_Lease=OTHER_LEASE), _with_query(url, X_Lf_Lease=None)):
        status, reason = await _put(forged, b"evil")
        assert (status, "signature does not match" in reason) == (403, True)
    assert (await _put(url + f"&X-Lf-Lease={OTHER_LEASE}", b"evil"))[0] == 403
    with pytest.raises(ValueError, match="lease_id"):
        await leased.presign_put("k", ttl_s=60, lease_id="bad\nid")
    assert _files_under(objects_dir) == []


async def test_expiry_is_still_enforced_for_a_live_lease(
    leased: LocalObjectStore, clock: FakeClock, leases: Leases
) -> None:
    url = await leased.presign_put("jobs/j/checkpoints/1-e1", ttl_s=30, lease_id=LEASE)
    assert url.expires_at == datetime.fromtimestamp(int(clock.now) + 30, UTC)
    clock.now += 30
    status, reason = await _put(url.url, b"late")
    assert status == 403
    assert "expired" in reason
    assert leases.asked == []  # refused before the ledger is bothered
    clock.now -= 1
    assert (await _put(url.url, b"in time"))[0] == 200


# -- verify (both backends) ----------------------------------------------------------------------


async def test_verify_checks_the_stored_bytes(store: ObjectStore, transfer: TransferClient) -> None:
    data = os.urandom(2 * 1024 * 1024 + 7)
    key = "jobs/j/checkpoints/100-e1"
    put = await store.presign_put(key, ttl_s=60, lease_id=LEASE)
    await transfer.upload(put.url, data)
    digest = _sha(data)

    assert await store.verify(key, size_bytes=len(data), sha256=digest) is True
    assert await store.verify(key, size_bytes=len(data), sha256=digest.upper()) is True
    assert await store.verify(key, size_bytes=len(data) - 1, sha256=digest) is False
    assert await store.verify(key, size_bytes=len(data), sha256=_sha(b"other")) is False
    assert await store.verify(key, size_bytes=len(data), sha256="not-a-digest") is False
    assert await store.verify("jobs/j/checkpoints/200-e1", size_bytes=1, sha256=digest) is False
    # A folder of other keys is no object either.
    assert await store.verify("jobs/j", size_bytes=0, sha256=_sha(b"")) is False
    with pytest.raises(InvalidArgument):
        await store.verify("../x", size_bytes=1, sha256=digest)

    await store.put_bytes("empty", b"")
    assert await store.verify("empty", size_bytes=0, sha256=_sha(b"")) is True


async def test_a_write_once_put_is_refused_on_both_backends(
    store: ObjectStore, transfer: TransferClient
) -> None:
    put = await store.presign_put("jobs/j/result/e1/lora", ttl_s=60, lease_id=LEASE)
    await transfer.upload(put.url, b"delivered")
    with pytest.raises(StorageError, match="412") as caught:
        await transfer.upload(put.url, b"replaced")
    assert caught.value.retryable is False
    assert await store.get_bytes("jobs/j/result/e1/lora") == b"delivered"
    assert await store.verify("jobs/j/result/e1/lora", size_bytes=9, sha256=_sha(b"delivered"))


# -- S3 specifics --------------------------------------------------------------------------------


async def test_s3_put_urls_sign_the_conditional_header(s3_store: S3ObjectStore) -> None:
    put = await s3_store.presign_put("jobs/j/checkpoints/1-e1", ttl_s=60, lease_id=LEASE)
    query = parse_qs(urlsplit(put.url).query)
    # Signed: S3 computes the signature over it, so a PUT without the header does not match.
    assert "if-none-match" in query["X-Amz-SignedHeaders"][0].split(";")
    assert dict(put.headers) == {"If-None-Match": "*"}
    assert LEASE not in put.url  # S3 cannot ask about leases: the URL is short-lived instead

    replaceable = await s3_store.presign_put("owners/o/a.png", ttl_s=60, write_once=False)
    assert (
        "if-none-match" not in parse_qs(urlsplit(replaceable.url).query)["X-Amz-SignedHeaders"][0]
    )
    assert dict(replaceable.headers) == {}
    get = await s3_store.presign_get("jobs/j/checkpoints/1-e1", ttl_s=60)
    assert dict(get.headers) == {}


async def test_s3_moto_honours_if_none_match(s3_store: S3ObjectStore) -> None:
    put = await s3_store.presign_put("k", ttl_s=60)
    headers = {"Content-Type": "application/octet-stream", **put.headers}
    assert (await _put(put.url, b"first", headers))[0] == 200
    status, body = await _put(put.url, b"second", headers)
    assert (status, "PreconditionFailed" in body) == (412, True)
    assert await s3_store.get_bytes("k") == b"first"


async def test_s3_verify_uses_a_full_object_sha256_checksum(
    s3_store: S3ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An object written with a SHA256 checksum (S3 validated it on the way in): verify reads
    # the checksum from a HEAD and never downloads the object.
    client: Any = s3_store._client
    data = b"weights" * 1000
    await asyncio.to_thread(
        client.put_object,
        Bucket=s3_store.config.bucket,
        Key="with-checksum",
        Body=data,
        ChecksumAlgorithm="SHA256",
    )

    def no_download(**_: object) -> None:
        raise AssertionError("verify downloaded an object whose checksum S3 holds")

    monkeypatch.setattr(client, "get_object", no_download)
    assert await s3_store.verify("with-checksum", size_bytes=len(data), sha256=_sha(data))
    assert not await s3_store.verify("with-checksum", size_bytes=len(data), sha256=_sha(b"x"))


# -- the signer ----------------------------------------------------------------------------------


class _NoCheckpoints:
    async def live_checkpoints(self, job_id: str) -> list[object]:
        return []


def _job(lease_id: str | None = LEASE) -> Job:
    now = datetime.now(UTC)
    return Job(
        job_id="j1",
        owner="alice",
        spec=JobSpec(
            instance_prompt="a photo of sks dog", instance_data_prefix="dog", max_train_steps=10
        ),
        state=JobState.RUNNING,
        epoch=3,
        failures=0,
        progress=Progress(
            step=0,
            max_steps=10,
            loss=None,
            learning_rate=None,
            seconds_per_step=None,
            machine_id=None,
            updated_at=None,
        ),
        latest_checkpoint=None,
        result=None,
        error=None,
        failure_class=None,
        machine_id="m1",
        lease_id=lease_id,
        created_at=now,
        updated_at=now,
        finished_at=None,
    )


async def test_the_signer_binds_a_leases_put_urls_to_it_and_keeps_them_short(
    leased: LocalObjectStore, leases: Leases, clock: FakeClock
) -> None:
    signer = UrlSigner(
        storage=leased, ledger=cast(Ledger, _NoCheckpoints()), url_ttl_s=3600, lease_put_ttl_s=120
    )
    # What WorkerHandler renews a lease's URLs by: the lifetime of its PUT URLs.
    assert signer.lease_urls_ttl_s == 120
    job = _job()
    urls = await signer.lease_urls(job)
    slots = await signer.slot_urls(
        job, [fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CHECKPOINT, step=10)]
    )
    puts = [urls.result_upload.url, slots.uploads[0].url]
    for url in puts:
        query = parse_qs(urlsplit(url).query)
        assert query["X-Lf-Lease"] == [LEASE]
        assert int(query["X-Lf-Expires"][0]) == int(clock.now) + 120
        assert "X-Lf-Replace" not in query
    assert urls.expires_at.ToDatetime(UTC) == datetime.fromtimestamp(int(clock.now) + 120, UTC)

    # Users' upload URLs: long-lived, no lease, replaceable.
    (user,) = await signer.data_upload_urls("alice", "dog", ["1.png"])
    query = parse_qs(urlsplit(user.url).query)
    assert int(query["X-Lf-Expires"][0]) == int(clock.now) + 3600
    assert "X-Lf-Lease" not in query and query["X-Lf-Replace"] == ["1"]

    leases.live.clear()
    for url in puts:
        assert (await _put(url, b"after the lease"))[0] == 403
    assert (await _put(user.url, b"image"))[0] == 200
    with pytest.raises(ValueError, match="holds no lease"):
        await signer.lease_urls(_job(lease_id=None))
