"""Object storage for the scheduler: one `ObjectStore` protocol, an S3 and a local backend.

Build one from configuration with `open_object_store(config)` and run it with `async with`.
PUT URLs are write-once and die with their lease; `storage.base` says how each backend keeps
that.
"""

from __future__ import annotations

from lorafleet.scheduler.storage.base import (
    IF_NONE_MATCH,
    MAX_URL_TTL_S,
    HttpMethod,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    SignedUrl,
    validate_key,
    validate_prefix,
)
from lorafleet.scheduler.storage.local import LocalObjectStore
from lorafleet.scheduler.storage.local_server import LocalObjectServer
from lorafleet.scheduler.storage.local_urls import (
    LeaseIsLive,
    LocalStoreConfig,
    always_live,
    url_signature,
)
from lorafleet.scheduler.storage.s3 import S3Config, S3ObjectStore

__all__ = [
    "IF_NONE_MATCH",
    "MAX_URL_TTL_S",
    "HttpMethod",
    "LeaseIsLive",
    "LocalObjectServer",
    "LocalObjectStore",
    "LocalStoreConfig",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "S3Config",
    "S3ObjectStore",
    "SignedUrl",
    "always_live",
    "open_object_store",
    "url_signature",
    "validate_key",
    "validate_prefix",
]


def open_object_store(
    config: S3Config | LocalStoreConfig, *, lease_is_live: LeaseIsLive = always_live
) -> ObjectStore:
    """The backend `config` describes, not yet started (`async with` it, or call `start()`).

    `lease_is_live` is the local backend's check of a lease's PUT URLs (S3 cannot ask; there
    they are short-lived instead); a scheduler passes its ledger's.
    """
    if isinstance(config, S3Config):
        return S3ObjectStore(config)
    return LocalObjectStore(config, lease_is_live=lease_is_live)
