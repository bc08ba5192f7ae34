"""Presigned URLs: the only way a worker or a user reaches stored bytes.

Which keys a URL may name is decided here and nowhere else: a lease's grant and renewals read
the job's own data, checkpoints and recorded class images and write only that lease's result
and artifact keys; a user's upload URLs write only under `uploads/<owner>/`; artifact URLs read
only the job's recorded objects. Workers hold no storage credentials.

A lease's PUT URLs (its result, checkpoint and artifact slots) are write-once and bound to the
lease (`lease_id`): the local store refuses them the moment the lease ends; on S3, which cannot
ask, they live only `lease_put_ttl_s` (minutes) and are renewed with the lease's URL set. Its
GET URLs (the job's instance and class images, recorded class images, checkpoints) are bound
the same way and live `lease_get_ttl_s`: a holder that gives its lease up (or takes lease after
lease only to collect URLs) keeps nothing to read with for longer than that. Users'
data-upload URLs stay replaceable: they write only the user's own namespace, and the client
sends no `If-None-Match` (which S3 would require of a write-once URL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafleet.core.model import (
    Checkpoint,
    Job,
    SampleTask,
    StoredImage,
    result_format,
    result_formats,
    result_key,
    sample_image_key,
    upload_key,
)
from lorafleet.core.serde import (
    checkpoint_to_proto,
    class_image_to_proto,
    sample_slots,
    upload_slot_key,
)
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.ledger.ledger import Ledger
from lorafleet.scheduler.storage import ObjectStore, SignedUrl


@dataclass(frozen=True, kw_only=True)
class Artifacts:
    """GET URLs for what a job has stored: its result, its live checkpoints, and its
    validation images (step, prompt index, prompt, the image, its URL)."""

    result: SignedUrl | None
    checkpoints: list[tuple[Checkpoint, SignedUrl]]
    # Every result file by format ("diffusers", "kohya"); `result` is one of them.
    results_by_format: dict[str, SignedUrl] = field(default_factory=dict)
    samples: list[tuple[int, str, StoredImage, SignedUrl]] = field(default_factory=list)


# How long a lease's PUT URLs live: what ends them on S3 (on the local store the lease's end
# does, at once). Well above a heartbeat interval, so renewals on heartbeats keep a live lease's
# URLs fresh, and short enough that a URL leaked by a lease that ended dies soon.
DEFAULT_LEASE_PUT_TTL_S = 300
# Likewise a lease's GET URLs: renewed with the set while the lease lives.
DEFAULT_LEASE_GET_TTL_S = 300


class UrlSigner:
    """Signs every URL the scheduler hands out.

    `url_ttl_s` (kept as `long_url_ttl_s`): the lifetime of users' URLs. `lease_put_ttl_s` and
    `lease_get_ttl_s`: the lifetimes of a lease's PUT and GET URLs (each at most `url_ttl_s`).
    """

    def __init__(
        self,
        *,
        storage: ObjectStore,
        ledger: Ledger,
        url_ttl_s: int,
        lease_put_ttl_s: int = DEFAULT_LEASE_PUT_TTL_S,
        lease_get_ttl_s: int = DEFAULT_LEASE_GET_TTL_S,
    ) -> None:
        if min(url_ttl_s, lease_put_ttl_s, lease_get_ttl_s) < 1:
            raise ValueError("url_ttl_s, lease_put_ttl_s and lease_get_ttl_s must be at least 1 s")
        self._storage = storage
        self._ledger = ledger
        self.long_url_ttl_s = url_ttl_s
        self.lease_put_ttl_s = min(lease_put_ttl_s, url_ttl_s)
        self.lease_get_ttl_s = min(lease_get_ttl_s, url_ttl_s)

    @property
    def lease_urls_ttl_s(self) -> int:
        """How long a set from `lease_urls` stays usable: its shortest URL. Renew the set well
        before this (WorkerHandler renews at a third left)."""
        return min(self.lease_put_ttl_s, self.lease_get_ttl_s)

    # For a lease (the worker's side) ---------------------------------------------------------

    async def lease_urls(self, job: Job) -> fpb.JobUrls:
        """Everything a lease starts with: its inputs to read, resumable checkpoints, and the
        result key of this epoch to write (write-once, bound to the lease)."""
        lease_id = _lease_id(job)
        spec = job.spec

        async def get(key: str) -> SignedUrl:
            return await self._storage.presign_get(
                key, ttl_s=self.lease_get_ttl_s, lease_id=lease_id
            )

        async def listed(base: str) -> list[fpb.FileUrl]:
            objects = await self._storage.list(base)
            signed = await asyncio.gather(*(get(o.key) for o in objects))
            return [
                fpb.FileUrl(name=o.key.removeprefix(base), key=o.key, url=s.url)
                for o, s in zip(objects, signed, strict=True)
            ]

        urls = fpb.JobUrls(
            instance_files=await listed(upload_key(job.owner, spec.instance_data_prefix))
        )
        if spec.class_data_prefix:
            urls.class_files.extend(await listed(upload_key(job.owner, spec.class_data_prefix)))
        if spec.with_prior_preservation:
            # Class images generated by earlier leases: only those the ledger recorded (the
            # store verified them), with their checksums for the worker to check. Whatever else
            # a holder left under the job's prefix is never listed.
            recorded = await self._ledger.recorded_class_images(job.job_id, job.epoch)
            gets = await asyncio.gather(*(get(image.key) for image in recorded))
            urls.generated_class_images.extend(
                fpb.ClassImageDownload(image=class_image_to_proto(image), url=signed.url)
                for image, signed in zip(recorded, gets, strict=True)
            )
        for checkpoint in await self._ledger.live_checkpoints(job.job_id):
            signed = await get(checkpoint.key)
            urls.checkpoints.append(
                fpb.CheckpointDownload(checkpoint=checkpoint_to_proto(checkpoint), url=signed.url)
            )
        # The main result file, and with output_format both the kohya file beside it: each at
        # its own per-epoch key, write-once and bound to this lease like every other PUT URL.
        main, *others = result_formats(job.spec.output_format)
        key = result_key(job.job_id, job.epoch, main)
        put = await self._storage.presign_put(key, ttl_s=self.lease_put_ttl_s, lease_id=lease_id)
        urls.result_upload.CopyFrom(fpb.UploadUrl(key=key, url=put.url))
        if "kohya" in others:
            kohya_key = result_key(job.job_id, job.epoch, "kohya")
            kohya_put = await self._storage.presign_put(
                kohya_key, ttl_s=self.lease_put_ttl_s, lease_id=lease_id
            )
            urls.kohya_result_upload.CopyFrom(fpb.UploadUrl(key=kohya_key, url=kohya_put.url))
        urls.expires_at.FromDatetime(put.expires_at)
        return urls

    async def slot_urls(self, job: Job, slots: Sequence[fpb.UploadSlot]) -> fpb.JobUrls:
        """PUT URLs for the artifact slots a lease asked for (keys derived from the lease;
        write-once, bound to the lease)."""
        lease_id = _lease_id(job)
        keys = [
            upload_slot_key(slot, job.job_id, job.epoch, job.spec, f"urls_requested.slots[{i}]")
            for i, slot in enumerate(slots)
        ]
        signed = await asyncio.gather(
            *(
                self._storage.presign_put(key, ttl_s=self.lease_put_ttl_s, lease_id=lease_id)
                for key in keys
            )
        )
        return fpb.JobUrls(
            uploads=[
                fpb.UploadUrl(slot=slot, key=key, url=s.url)
                for slot, key, s in zip(slots, keys, signed, strict=True)
            ]
        )

    async def sample_task_urls(
        self, task: SampleTask
    ) -> tuple[fpb.FileUrl, list[fpb.SampleUpload]]:
        """A sample task's weights to read, and one PUT URL per image it makes: keys derived
        from the task and its epoch, write-once, bound to the task's lease."""
        if task.lease_id is None:
            raise ValueError(f"sample task {task.task_id} holds no lease: no URLs to sign")
        lease_id = task.lease_id
        # Bound to the task's lease (the local store refuses it once the task ends); it keeps
        # the long TTL, since the worker reads it once, after loading its model, and a task's
        # URLs are never renewed.
        weights = await self._storage.presign_get(
            task.weights_key, ttl_s=self.long_url_ttl_s, lease_id=lease_id
        )
        slots = sample_slots(task.settings)
        keys = [
            sample_image_key(task.job_id, task.step, task.task_id, task.epoch, p, i)
            for p, i in slots
        ]
        signed = await asyncio.gather(
            *(
                self._storage.presign_put(key, ttl_s=self.lease_put_ttl_s, lease_id=lease_id)
                for key in keys
            )
        )
        return fpb.FileUrl(name=task.weights_key, key=task.weights_key, url=weights.url), [
            fpb.SampleUpload(prompt_index=p, image_index=i, key=key, url=s.url)
            for (p, i), key, s in zip(slots, keys, signed, strict=True)
        ]

    async def sample_image_urls(self, keys: Sequence[str]) -> list[SignedUrl]:
        """GET URLs of a job's recorded validation images (GetJobArtifacts)."""
        return await asyncio.gather(
            *(self._storage.presign_get(key, ttl_s=self.long_url_ttl_s) for key in keys)
        )

    # For a user ------------------------------------------------------------------------------

    async def data_upload_urls(
        self, owner: str, prefix: str, file_names: Sequence[str]
    ) -> list[SignedUrl]:
        return await asyncio.gather(
            *(
                self._storage.presign_put(
                    upload_key(owner, prefix, name), ttl_s=self.long_url_ttl_s, write_once=False
                )
                for name in file_names
            )
        )

    async def artifacts(
        self,
        job: Job,
        checkpoints: Sequence[Checkpoint],
        sample_tasks: Sequence[SampleTask] = (),
    ) -> Artifacts:
        ttl = self.long_url_ttl_s
        files = job.result.files if job.result is not None else {}
        by_format = dict(
            zip(
                files,
                await asyncio.gather(
                    *(self._storage.presign_get(f.key, ttl_s=ttl) for f in files.values())
                ),
                strict=True,
            )
        )
        result = by_format[result_format(job.result.key)] if job.result is not None else None
        urls = await asyncio.gather(
            *(self._storage.presign_get(c.key, ttl_s=ttl) for c in checkpoints)
        )
        images = [
            (task.step, task.settings.prompts[image.prompt_index], image)
            for task in sample_tasks
            if task.state == "SUCCEEDED"
            for image in sorted(task.images, key=lambda i: (i.prompt_index, i.image_index))
            if image.prompt_index < len(task.settings.prompts)
        ]
        image_urls = await self.sample_image_urls([image.key for _, _, image in images])
        return Artifacts(
            result=result,
            checkpoints=list(zip(checkpoints, urls, strict=True)),
            results_by_format=by_format,
            samples=[
                (step, prompt, image, url)
                for (step, prompt, image), url in zip(images, image_urls, strict=True)
            ],
        )


def _lease_id(job: Job) -> str:
    """The lease a job's upload URLs are bound to; only a job that holds one gets any."""
    if job.lease_id is None:
        raise ValueError(f"job {job.job_id} holds no lease: no lease URLs to sign")
    return job.lease_id
