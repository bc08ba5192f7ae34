"""The lease runner's side of generated class images, on its own (a scripted link, transfer and
trainer; no scheduler, no model): which recorded images it reuses, and what it announces."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lorafleet.core.errors import StorageError
from lorafleet.core.model import class_image_key
from lorafleet.core.serde import spec_to_proto
from lorafleet.core.settings import load
from lorafleet.core.spec import JobSpec
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.lease_runner import LeaseResult, LeaseRunner
from lorafleet.worker.training import (
    Finished,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingOutcome,
    TrainingSnapshot,
)
from lorafleet.worker.training_thread import TrainingThread
from tests.support.jobs import WAIT_S

JOB_ID = "00000000-0000-4000-8000-000000000001"
EPOCH = 3


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Transfer:
    """Objects by URL; a URL missing from `objects` fails like an unreachable store."""

    objects: dict[str, bytes]
    uploads: dict[str, bytes] = field(default_factory=dict)

    async def download(self, url: str) -> bytes:
        if url not in self.objects:
            raise StorageError(f"GET {url}: 404", retryable=False)
        return self.objects[url]

    async def download_many(
        self, items: Iterable[tuple[str, str]], *, concurrency: int = 8
    ) -> dict[str, bytes]:
        return {name: await self.download(url) for name, url in items}

    async def upload(self, url: str, data: bytes, *, md5: str | None = None) -> None:
        self.uploads[url] = data


@dataclass
class Link:
    """The scheduler's side: answers UrlsRequested with this lease's keys, keeps the rest."""

    sent: list[fpb.ConnectRequest] = field(default_factory=list)
    announced: asyncio.Event = field(default_factory=asyncio.Event)
    runner: LeaseRunner | None = None

    async def send(self, message: fpb.ConnectRequest) -> None:
        self.sent.append(message)
        kind = message.WhichOneof("message")
        if kind == "urls_requested":
            uploads = [
                fpb.UploadUrl(slot=slot, key="result", url="put://result")
                if slot.kind == fpb.ARTIFACT_KIND_RESULT
                else fpb.UploadUrl(
                    slot=slot,
                    key=class_image_key(JOB_ID, slot.index, EPOCH),
                    url=f"put://{slot.index}",
                )
                for slot in message.urls_requested.slots
            ]
            assert self.runner is not None
            asyncio.get_running_loop().call_soon(
                self.runner.urls_renewed, fpb.JobUrls(uploads=uploads)
            )
        if kind == "class_images_committed":
            self.announced.set()

    def of(self, kind: str) -> list[fpb.ConnectRequest]:
        return [m for m in self.sent if m.WhichOneof("message") == kind]


@dataclass
class Trainer:
    """Generates the class images it was not given (index i: b"generated i"), then waits for
    the test before it finishes."""

    num_class_images: int
    given: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def run(
        self,
        *,
        instance_images: Sequence[TrainingImage],
        class_images: Sequence[TrainingImage] = (),
        resume: TrainingSnapshot | None = None,
        hooks: TrainingHooks | None = None,
    ) -> TrainingOutcome:
        assert hooks is not None and hooks.on_class_images is not None
        self.given = [image.name for image in class_images]
        missing = range(len(class_images), self.num_class_images)
        hooks.on_class_images([(i, f"generated {i}".encode()) for i in missing])
        assert self.release.wait(WAIT_S)
        return Finished(step=1, loss=0.5, lora_weights=b"lora")


async def test_a_runner_reuses_the_verified_run_and_announces_what_it_generates() -> None:
    """Recorded images 0, 1 and 3 verify and 2 does not: 0 and 1 are reused, 2 is generated
    again with 3 (the trainer generates from the first missing index on), a notice names 2, and
    the generated ones are announced with their checksums at this lease's keys, again after a
    reconnect."""
    spec = JobSpec(
        instance_prompt="a photo of sks dog",
        instance_data_prefix="dog",
        max_train_steps=1,
        with_prior_preservation=True,
        class_prompt="a dog",
        num_class_images=4,
    )
    recorded = {i: f"recorded {i}".encode() for i in range(4)}
    objects = {f"get://{i}": data for i, data in recorded.items()}
    objects["get://2"] = b"not what the ledger recorded"
    objects["get://instance"] = b"instance image"
    objects["put://result"] = b""
    grant = fpb.LeaseGranted(
        lease=fpb.Lease(lease_id="lease-1", job_id=JOB_ID, epoch=EPOCH, machine_id="m1"),
        spec=spec_to_proto(spec),
        urls=fpb.JobUrls(
            instance_files=[fpb.FileUrl(name="0.png", key="k", url="get://instance")],
            generated_class_images=[
                fpb.ClassImageDownload(
                    image=fpb.ClassImage(
                        index=i,
                        key=class_image_key(JOB_ID, i, 1),
                        size_bytes=len(data),
                        sha256=_sha(data),
                    ),
                    url=f"get://{i}",
                )
                for i, data in recorded.items()
            ],
        ),
    )
    config = load(
        WorkerConfig,
        env={},
        worker_token="t",
        scheduler_address="127.0.0.1:1",
        machine_id="m1",
        allow_cpu=True,
        device="cpu",
    )
    trainer = Trainer(num_class_images=4)
    link = Link()
    transfer = Transfer(objects)
    training = TrainingThread()
    training.start()

    def factory(_: TrainingConfig) -> Trainer:
        return trainer

    runner = LeaseRunner(
        grant=grant,
        link=link,
        transfer=transfer,  # type: ignore[arg-type]
        training=training,
        config=config,
        trainer_factory=factory,
    )
    link.runner = runner
    try:
        run = asyncio.ensure_future(runner.run())
        await asyncio.wait_for(link.announced.wait(), WAIT_S)
        link.announced.clear()
        runner.reconnected()
        await asyncio.wait_for(link.announced.wait(), WAIT_S)
        trainer.release.set()
        assert await asyncio.wait_for(run, WAIT_S) is LeaseResult.SUCCEEDED
    finally:
        trainer.release.set()
        await training.shutdown(WAIT_S)

    assert sorted(trainer.given) == ["00000.png", "00001.png"]
    assert runner.reused_class_images == [0, 1]
    (notice,) = runner.notices
    assert "class image 2" in notice and "sha256" in notice
    generated = {i: f"generated {i}".encode() for i in (2, 3)}
    assert {url: data for url, data in transfer.uploads.items() if url != "put://result"} == {
        "put://2": generated[2],
        "put://3": generated[3],
    }
    first, again = link.of("class_images_committed")
    assert first == again
    assert [
        (i.index, i.key, i.size_bytes, i.sha256) for i in first.class_images_committed.images
    ] == [(i, class_image_key(JOB_ID, i, EPOCH), len(d), _sha(d)) for i, d in generated.items()]
