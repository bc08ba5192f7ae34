"""Object storage for the scheduler: one `ObjectStore` protocol, an S3 and a local backend.

Build one from configuration with `open_object_store(config)` and run it with `async with`.
"""

from __future__ import annotations

from lorafleet.scheduler.storage.base import (
    MAX_URL_TTL_S,
    HttpMethod,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    SignedUrl,
    validate_key,
    validate_prefix,
)
from lorafleet.scheduler.storage.local import (
    LocalObjectServer,
    LocalObjectStore,
    LocalStoreConfig,
    url_signature,
)
from lorafleet.scheduler.storage.s3 import S3Config, S3ObjectStore

__all__ = [
    "MAX_URL_TTL_S",
    "HttpMethod",
    "LocalObjectServer",
    "LocalObjectStore",
    "LocalStoreConfig",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "S3Config",
    "S3ObjectStore",
    "SignedUrl",
    "open_object_store",
    "url_signature",
    "validate_key",
    "validate_prefix",
]


def open_object_store(config: S3Config | LocalStoreConfig) -> ObjectStore:
    """The backend `config` describes, not yet started (`async with` it, or call `start()`)."""
    if isinstance(config, S3Config):
        return S3ObjectStore(config)
    return LocalObjectStore(config)
