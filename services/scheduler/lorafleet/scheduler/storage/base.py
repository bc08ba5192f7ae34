"""What every object-storage backend offers the scheduler, and the key rules they share.

The scheduler is the only process holding storage credentials. Workers get short-lived signed
URLs for exactly the keys of their job (docs/DESIGN.md, "URLs and stored objects"); everything
server-side (listing, deleting, small reads and writes) goes through an `ObjectStore`.

Workers are strangers' machines (docs/DESIGN.md, "Trust"), so what a PUT URL allows is narrow:

* Write-once: a PUT URL (unless signed with `write_once=False`) only creates; a PUT to a key that
  already holds an object is refused (HTTP 412) and nothing is replaced. The local backend
  decides this itself, atomically; on S3 the URL signs `If-None-Match: *` (S3's conditional
  write), so the request must carry that header (`SignedUrl.headers`).
* Checked before recorded: `verify` tells whether the stored bytes have the size and sha256 a
  worker announced, so the ledger never records a digest the store does not hold.
* Bound to a lease: a URL (PUT or GET) signed with `lease_id` stops working when that lease
  ends: a holder that let its lease go keeps neither its job's inputs nor its writes. The
  local backend asks the scheduler (`lease_is_live`) on every such PUT, so the end is immediate.
  S3 cannot ask anyone: there the URL simply lives a short time (the signer gives lease PUT URLs
  a short TTL and renews them on heartbeats), and write-once plus `verify` make a late PUT
  harmless: it can only create a key nothing recorded, never replace one that was.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Literal, Protocol, Self

from lorafleet.core.errors import InvalidArgument, StorageError

# SigV4 presigned URLs live at most 7 days; the local backend keeps the same bound so that a
# caller written against one backend never fails on the other.
MAX_URL_TTL_S = 7 * 24 * 3600
# S3's key limit, in UTF-8 bytes.
MAX_KEY_BYTES = 1024
# Most filesystems' limit on one path component; the local backend maps segments to names.
MAX_SEGMENT_BYTES = 255
# Names starting with this are the local backend's in-progress uploads; no key may use it, so an
# upload that never finished can never be mistaken for (or collide with) an object.
RESERVED_SEGMENT_PREFIX = ".lftmp-"
# What a lease id may look like in a URL (the scheduler's are UUIDs).
_LEASE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# The conditional-write header: "create only, never replace" (S3 and HTTP alike).
IF_NONE_MATCH = "If-None-Match"

HttpMethod = Literal["GET", "PUT"]


@dataclass(frozen=True, kw_only=True)
class SignedUrl:
    """A URL that lets its holder do one thing (`method`) to one object (`key`) until expiry.

    PUT URLs take the raw body with a plain HTTP PUT plus `headers`, which the request must
    carry as they are (on S3 they are signed: a request without them is refused). A worker's
    uploader sends `If-None-Match: *` on every PUT, which is all any backend requires today. A
    `Content-MD5` header is honoured and checked by both backends.
    """

    key: str
    url: str
    method: HttpMethod
    expires_at: datetime
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ObjectInfo:
    """One stored object, as listed."""

    key: str
    size_bytes: int


class ObjectNotFound(StorageError):
    """The key names no object; retrying cannot help."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object at key {key!r}", retryable=False)
        self.key = key


class ObjectStore(Protocol):
    """Async object storage for the scheduler; one way to do each thing.

    Lifecycle: `async with store:` (or `start()` ... `close()`); `close()` is idempotent.
    Every method raises `StorageError` (with `retryable` set) when storage fails, and
    `InvalidArgument` (field "key" or "prefix") for a key that breaks `validate_key`.
    """

    async def start(self) -> None:
        """Connect (and, where configured, create the bucket or start serving URLs)."""
        ...

    async def close(self) -> None:
        """Release connections and stop serving; safe to call twice."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def presign_get(self, key: str, *, ttl_s: int, lease_id: str | None = None) -> SignedUrl:
        """A URL that reads `key` (GET) for `ttl_s` seconds; the object need not exist yet.
        `lease_id`: the URL is one of that lease's and dies with it, like a lease's PUT URLs
        (at once on the local backend; on S3 at `ttl_s`, which the caller keeps short)."""
        ...

    async def presign_put(
        self, key: str, *, ttl_s: int, lease_id: str | None = None, write_once: bool = True
    ) -> SignedUrl:
        """A URL that writes `key` with an HTTP PUT of the body for `ttl_s` seconds.

        `write_once` (the default): the PUT only creates; if `key` holds an object it is
        refused with 412 and nothing is replaced. `lease_id`: the URL is one of that lease's and
        dies with it (at once on the local backend; on S3 at `ttl_s`, which the caller keeps
        short). See the module docstring.
        """
        ...

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Every object whose key starts with `prefix` (a plain string prefix, as in S3),
        across all pages, sorted by key."""
        ...

    async def delete(self, keys: Sequence[str]) -> None:
        """Delete `keys` in as few requests as the backend allows; missing keys are fine."""
        ...

    async def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` at `key`, replacing any object there; readers see old or new, never a
        mix. Server-side only (trusted); URLs given to workers are write-once."""
        ...

    async def verify(self, key: str, *, size_bytes: int, sha256: str) -> bool:
        """True only if an object exists at `key` with exactly `size_bytes` bytes whose sha256
        is `sha256` (hex); False for a missing object or any difference. The stored bytes are
        what is checked, so call it before the ledger records an object a worker announced."""
        ...

    async def get_bytes(self, key: str) -> bytes:
        """The object's bytes; `ObjectNotFound` when there is none."""
        ...

    async def read_range(self, key: str, start: int, length: int) -> bytes:
        """At most `length` bytes of the object from byte `start` (fewer at its end, none
        past it); `ObjectNotFound` when there is none. For headers: reads only what it returns."""
        ...


def validate_key(key: str, *, field: str = "key") -> None:
    """Raise `InvalidArgument` unless `key` is a plain relative path both backends can store.

    Rules: 1..1024 UTF-8 bytes; "/"-separated segments, none empty, "." or ".." and none over
    255 bytes; no backslash or control characters; no segment starting with ".lftmp-". These
    keep a key from escaping the local backend's root and make the two backends agree on which
    keys exist.
    """
    if not key:
        raise InvalidArgument(field, "must not be empty")
    if len(key.encode("utf-8", errors="surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidArgument(field, f"longer than {MAX_KEY_BYTES} bytes")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in key):
        raise InvalidArgument(field, "contains a control character")
    if "\\" in key:
        raise InvalidArgument(field, 'contains "\\"')
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidArgument(field, 'has an empty, "." or ".." segment (or a leading "/")')
        try:
            encoded = segment.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(field, "is not valid UTF-8") from None
        if len(encoded) > MAX_SEGMENT_BYTES:
            raise InvalidArgument(field, f"has a segment longer than {MAX_SEGMENT_BYTES} bytes")
        if segment.startswith(RESERVED_SEGMENT_PREFIX):
            raise InvalidArgument(field, f"has a segment starting with {RESERVED_SEGMENT_PREFIX!r}")


def validate_prefix(prefix: str) -> None:
    """Raise `InvalidArgument` unless `prefix` is "" or a key, optionally ending in "/"."""
    stem = prefix.removesuffix("/")
    if stem:
        validate_key(stem, field="prefix")
    elif prefix:
        raise InvalidArgument("prefix", 'must not be "/"')


def check_lease_id(lease_id: str | None) -> None:
    """Raise `ValueError` unless `lease_id` is None or a plain id a URL can carry."""
    if lease_id is not None and not _LEASE_ID.fullmatch(lease_id):
        raise ValueError(f"lease_id must match {_LEASE_ID.pattern}, got {lease_id!r}")


def is_sha256_hex(value: str) -> bool:
    """Whether `value` is a sha256 digest written as 64 hex digits."""
    return len(value) == 64 and all(ch in "0123456789abcdefABCDEF" for ch in value)


def check_ttl(ttl_s: int) -> None:
    """Raise `ValueError` unless `ttl_s` is a whole number of seconds in 1..7 days."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int):
        raise TypeError(f"ttl_s must be an int, got {type(ttl_s).__name__}")
    if not 1 <= ttl_s <= MAX_URL_TTL_S:
        raise ValueError(f"ttl_s must be in 1..{MAX_URL_TTL_S}, got {ttl_s}")
