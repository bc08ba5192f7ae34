"""Generated class images (prior preservation) are keyed per lease and recorded like checkpoints:
a holder writes only its own epoch's keys, the ledger records an image only once the store holds
exactly what was announced, and a later holder is given only recorded images, with their
checksums. Scripted workers over a real stream against a real scheduler, store and Postgres."""

from __future__ import annotations

import hashlib
import uuid

import aiohttp
import asyncpg
import grpc
import pytest

from lorafleet.core.model import class_image_key
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from tests.support.fleet import Fleet
from tests.support.images import png
from tests.support.workers import ScriptedWorker, connect_worker, http_put

PRIOR = {"with_prior_preservation": True, "class_prompt": "a photo of a dog", "num_class_images": 3}


async def _store(
    worker: ScriptedWorker, lease: fpb.Lease, images: dict[int, bytes]
) -> list[fpb.UploadUrl]:
    """What a worker does with generated class images: ask for their URLs and upload them."""
    slots = [fpb.UploadSlot(kind=fpb.ARTIFACT_KIND_CLASS_IMAGE, index=i) for i in images]
    await worker.send(urls_requested=fpb.UrlsRequested(lease=worker.ref(lease), slots=slots))
    uploads = list((await worker.expect("urls_renewed")).urls.uploads)
    for upload in uploads:
        await http_put(upload.url, images[upload.slot.index])
    return uploads


def _announced(uploads: list[fpb.UploadUrl], images: dict[int, bytes]) -> list[fpb.ClassImage]:
    return [
        fpb.ClassImage(
            index=u.slot.index,
            key=u.key,
            size_bytes=len(images[u.slot.index]),
            sha256=hashlib.sha256(images[u.slot.index]).hexdigest(),
        )
        for u in uploads
    ]


async def _recorded(database_url: str, job_id: str) -> list[tuple[int, int]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT image_index, epoch FROM class_images WHERE job_id = $1 ORDER BY 1, 2",
            uuid.UUID(job_id),
        )
    finally:
        await conn.close()
    return [(r["image_index"], r["epoch"]) for r in rows]


async def _drain(worker: ScriptedWorker, lease: fpb.Lease) -> None:
    await worker.send(draining=fpb.Draining(lease=worker.ref(lease), reason="test"))


async def test_class_images_a_holder_stored_without_announcing_never_reach_the_next_holder(
    fleet: Fleet, database_url: str
) -> None:
    """A hostile holder fills its class image slots with bad images and leaves: the next holder
    is handed none of them (it generates its own), and writes only keys of its own epoch."""
    job = await fleet.alice.submit(**PRIOR)
    bad = {i: png(1000 + i) for i in range(3)}
    async with connect_worker(fleet.channel, fleet.token, "mallory") as mallory:
        first = await mallory.ready_for_lease()
        uploads = await _store(mallory, first.lease, bad)
        await _drain(mallory, first.lease)
    assert {u.key for u in uploads} == {class_image_key(job.job_id, i, 1) for i in range(3)}
    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        second = await honest.ready_for_lease()
        assert second.lease.job_id == job.job_id and second.lease.epoch == 2
        assert list(second.urls.generated_class_images) == []
        assert list(second.urls.class_files) == []
        # Its own slots are its epoch's keys: nothing mallory stored is read or overwritten.
        mine = await _store(honest, second.lease, {0: png(7)})
        assert [u.key for u in mine] == [class_image_key(job.job_id, 0, 2)]
    assert await _recorded(database_url, job.job_id) == []


async def test_a_class_image_announced_with_a_wrong_checksum_is_refused_and_not_recorded(
    fleet: Fleet, database_url: str
) -> None:
    """An announcement is recorded all or none, and only when the store holds exactly the
    announced bytes: one wrong sha256 refuses the message, and the next holder gets nothing."""
    job = await fleet.alice.submit(**PRIOR)
    images = {0: png(1), 1: png(2)}
    async with connect_worker(fleet.channel, fleet.token, "mallory") as mallory:
        first = await mallory.ready_for_lease()
        uploads = await _store(mallory, first.lease, images)
        announced = _announced(uploads, images)
        announced[1].sha256 = hashlib.sha256(b"an image it did not store").hexdigest()
        await mallory.send(
            class_images_committed=fpb.ClassImagesCommitted(
                lease=mallory.ref(first.lease), images=announced
            )
        )
        rejected = await mallory.expect("rejected")
        assert "does not match" in rejected.reason
    assert await _recorded(database_url, job.job_id) == []
    # Back with its lease (a fresh stream resumes it), only to leave it: the next holder gets
    # no class image of the first lease.
    async with connect_worker(
        fleet.channel, fleet.token, "mallory", held=mallory.ref(first.lease)
    ) as again:
        assert again.welcome is not None and again.welcome.resumed_lease.lease_id
        await _drain(again, first.lease)
    async with connect_worker(fleet.channel, fleet.token, "honest") as honest:
        second = await honest.ready_for_lease()
    assert second.lease.job_id == job.job_id
    assert list(second.urls.generated_class_images) == []


async def test_recorded_class_images_reach_later_holders_with_their_checksums(
    fleet: Fleet, database_url: str
) -> None:
    """An honest holder's announced images are recorded and handed on (index, key, sha256, a
    URL that reads exactly them); one it stored but never announced (it crashed in between) is
    not, and the next holder's own image for that index is recorded under its own epoch."""
    job = await fleet.alice.submit(**PRIOR)
    images = {0: png(1), 1: png(2), 2: png(3)}
    async with connect_worker(fleet.channel, fleet.token, "m1") as m1:
        first = await m1.ready_for_lease()
        uploads = await _store(m1, first.lease, images)
        announced = [a for a in _announced(uploads, images) if a.index != 2]
        ref = m1.ref(first.lease)
        await m1.send(class_images_committed=fpb.ClassImagesCommitted(lease=ref, images=announced))
        # A repeat (after a reconnect) changes nothing.
        await m1.send(class_images_committed=fpb.ClassImagesCommitted(lease=ref, images=announced))
        await _drain(m1, first.lease)
        # Once the lease has ended, its announcements are refused.
        await m1.send(class_images_committed=fpb.ClassImagesCommitted(lease=ref, images=announced))
        assert "not live" in (await m1.expect("rejected")).reason
    assert await _recorded(database_url, job.job_id) == [(0, 1), (1, 1)]

    async with connect_worker(fleet.channel, fleet.token, "m2") as m2:
        second = await m2.ready_for_lease()
        given = list(second.urls.generated_class_images)
        assert [(g.image.index, g.image.key) for g in given] == [
            (0, class_image_key(job.job_id, 0, 1)),
            (1, class_image_key(job.job_id, 1, 1)),
        ]
        async with aiohttp.ClientSession() as http:
            for g in given:
                assert g.image.sha256 == hashlib.sha256(images[g.image.index]).hexdigest()
                assert g.image.size_bytes == len(images[g.image.index])
                async with http.get(g.url) as response:
                    assert await response.read() == images[g.image.index]
        regenerated = {2: png(4)}
        mine = await _store(m2, second.lease, regenerated)
        await m2.send(
            class_images_committed=fpb.ClassImagesCommitted(
                lease=m2.ref(second.lease), images=_announced(mine, regenerated)
            )
        )
        await _drain(m2, second.lease)
    assert await _recorded(database_url, job.job_id) == [(0, 1), (1, 1), (2, 2)]

    async with connect_worker(fleet.channel, fleet.token, "m3") as m3:
        third = await m3.ready_for_lease()
    assert third.lease.epoch == 3
    assert [(g.image.index, g.image.key) for g in third.urls.generated_class_images] == [
        (0, class_image_key(job.job_id, 0, 1)),
        (1, class_image_key(job.job_id, 1, 1)),
        (2, class_image_key(job.job_id, 2, 2)),
    ]


@pytest.mark.parametrize(
    ("spec", "index", "epoch_offset", "field"),
    [
        (PRIOR, 3, 0, "images[0].index"),  # past num_class_images
        (PRIOR, 0, -1, "images[0].key"),  # another epoch's key
        ({}, 0, 0, "images[0]"),  # a job without prior preservation
    ],
)
async def test_class_image_announcements_are_bounded_to_the_leases_own_keys(
    fleet: Fleet, spec: dict[str, object], index: int, epoch_offset: int, field: str
) -> None:
    job = await fleet.alice.submit(**spec)
    async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
        granted = await worker.ready_for_lease()
        key = class_image_key(job.job_id, index, granted.lease.epoch + epoch_offset)
        await worker.send(
            class_images_committed=fpb.ClassImagesCommitted(
                lease=worker.ref(granted.lease),
                images=[fpb.ClassImage(index=index, key=key, size_bytes=3, sha256="a" * 64)],
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.expect("welcome")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"class_images_committed.{field}" in (refused.value.details() or "")
