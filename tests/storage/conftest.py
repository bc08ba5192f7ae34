"""Fixtures for the storage tests: a real S3 endpoint (moto's server) and the local backend,
both over HTTP on loopback, and a `TransferClient` tuned to retry fast."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from moto.server import ThreadedMotoServer

from lorafleet.scheduler.storage import (
    LocalObjectStore,
    LocalStoreConfig,
    ObjectStore,
    S3Config,
    S3ObjectStore,
)
from lorafleet.worker.transfer import TransferClient, TransferConfig

SECRET = b"test-secret-key-0123456789abcdef"


class FakeClock:
    """Unix seconds that only move when a test says so: expiry without sleeping."""

    def __init__(self, now: float = 1_900_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on a free loopback port, shared by the session (buckets isolate tests)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_config(endpoint: str, **overrides: object) -> S3Config:
    """A fresh bucket per call, small pages and batches so pagination is exercised cheaply."""
    values: dict[str, object] = {
        "bucket": f"lf-test-{uuid.uuid4().hex[:16]}",
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "addressing_style": "path",
        "create_bucket": True,
        "list_page_size": 2,
        "delete_batch_size": 2,
        "max_attempts": 2,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 5.0,
    }
    values.update(overrides)
    return S3Config(**values)  # type: ignore[arg-type]


@pytest.fixture
async def s3_store(moto_endpoint: str) -> AsyncIterator[S3ObjectStore]:
    async with S3ObjectStore(s3_config(moto_endpoint)) as store:
        yield store


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def objects_dir(tmp_path: Path) -> Path:
    return tmp_path / "objects"


@pytest.fixture
async def local_store(objects_dir: Path, clock: FakeClock) -> AsyncIterator[LocalObjectStore]:
    config = LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET, max_object_bytes=64 * 1024)
    async with LocalObjectStore(config, clock=clock) as store:
        yield store


@pytest.fixture(params=["s3", "local"])
async def store(
    request: pytest.FixtureRequest, moto_endpoint: str, objects_dir: Path
) -> AsyncIterator[ObjectStore]:
    """Each backend in turn, for the behaviour the `ObjectStore` protocol promises."""
    backend: ObjectStore
    if request.param == "s3":
        backend = S3ObjectStore(s3_config(moto_endpoint))
    else:
        backend = LocalObjectStore(LocalStoreConfig(root_dir=objects_dir, secret_key=SECRET))
    async with backend:
        yield backend


@pytest.fixture(scope="session")
async def transfer() -> AsyncIterator[TransferClient]:
    config = TransferConfig(
        max_attempts=3,
        initial_backoff_s=0.001,
        max_backoff_s=0.01,
        deadline_s=10.0,
        connect_timeout_s=2.0,
        read_timeout_s=5.0,
    )
    async with TransferClient(config) as client:
        yield client
