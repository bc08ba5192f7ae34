"""The local backend's signed URLs: their format, their signature, what signs and serves them.

URL format (method, expiry and signature are required; lease and replace only where signed)::

    {base_url}/o/{percent-encoded key}?X-Lf-Method=GET|PUT&X-Lf-Expires={unix seconds}
        [&X-Lf-Lease={lease id}][&X-Lf-Replace=1]
        &X-Lf-Signature={hex HMAC-SHA256(secret_key, "lorafleet-url-v2\\n" method "\\n"
                                          expires "\\n" lease id or "" "\\n" "1" if replace
                                          else "0" "\\n" key)}

The signature covers the key taken from the path, the lease and the write mode, so a URL signed
for one key cannot touch another and neither the lease binding nor write-once can be stripped;
a GET URL also allows HEAD.

`LocalStoreConfig` holds the signing secret and where the URLs are served; `LeaseIsLive` is how
a URL bound to a lease learns whether that lease still lives. The store (`storage.local`) signs
these URLs; the server (`storage.local_server`) checks them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from lorafleet.scheduler.storage.base import HttpMethod

URL_PATH_PREFIX: Final = "/o/"
PARAM_METHOD: Final = "X-Lf-Method"
PARAM_EXPIRES: Final = "X-Lf-Expires"
PARAM_SIGNATURE: Final = "X-Lf-Signature"
PARAM_LEASE: Final = "X-Lf-Lease"
PARAM_REPLACE: Final = "X-Lf-Replace"
_SIGNING_CONTEXT: Final = "lorafleet-url-v2"
_MIN_SECRET_BYTES: Final = 16
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", ""})

LeaseIsLive = Callable[[str], Awaitable[bool]]
"""Whether the lease with this id is still live (the scheduler answers from its ledger)."""


async def always_live(lease_id: str) -> bool:
    """The `lease_is_live` of a store used without a scheduler: every lease is live.

    Only for tests of the store alone and tools; a scheduler must pass its ledger's check, or
    a lease's upload URLs keep working after the lease ended (until they expire).
    """
    return True


@dataclass(frozen=True, kw_only=True)
class LocalStoreConfig:
    """The local backend: a root directory, the URL signing secret and where URLs are served.

    `secret_key` defaults to random bytes per config object: URLs then stop working when the
    scheduler restarts. Set it (at least 16 bytes) when URLs must outlive the process.
    `public_base_url` (e.g. "http://scheduler.lan:8081") is what URLs start with; it is required
    when `host` binds every interface, because remote workers cannot reach "0.0.0.0". Without
    it, URLs use `host` and the bound port (`port=0` picks a free one).
    """

    root_dir: Path
    secret_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    public_base_url: str | None = None
    # 5 GiB, S3's single-PUT limit, so the two backends accept the same uploads.
    max_object_bytes: int = 5 * 1024**3
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if len(self.secret_key) < _MIN_SECRET_BYTES:
            raise ValueError(f"secret_key must be at least {_MIN_SECRET_BYTES} bytes")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_object_bytes < 0:
            raise ValueError("max_object_bytes must not be negative")
        if self.public_base_url is not None:
            parsed = urllib.parse.urlsplit(self.public_base_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError("public_base_url must be an http(s) URL with a host")
            if parsed.query or parsed.fragment:
                raise ValueError("public_base_url must not have a query or fragment")
        elif self.host in _WILDCARD_HOSTS:
            raise ValueError(f"host {self.host!r} binds every interface: set public_base_url")


def url_signature(
    secret_key: bytes,
    *,
    method: HttpMethod,
    key: str,
    expires: int,
    lease_id: str | None = None,
    replace: bool = False,
) -> str:
    """The hex HMAC-SHA256 that authorises `method` on `key` until unix time `expires`, for
    the lease `lease_id` only (None: not bound to a lease) and, for a PUT, replacing an
    existing object only if `replace`.

    Newlines separate the fields and no field can hold one (methods and numbers cannot, lease
    ids are checked by `check_lease_id`, `validate_key` forbids control characters), so two
    different URLs never sign alike.
    """
    message = (
        f"{_SIGNING_CONTEXT}\n{method}\n{expires}\n{lease_id or ''}\n"
        f"{'1' if replace else '0'}\n{key}"
    ).encode()
    return hmac.new(secret_key, message, hashlib.sha256).hexdigest()
