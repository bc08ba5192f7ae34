"""EC2's instance metadata service (IMDSv2), as the worker uses it: the spot interruption notice,
and the instance id.

EC2 gives a spot instance about two minutes' notice, best effort: from then on
`GET /latest/meta-data/spot/instance-action` answers `{"action": "terminate" | "stop" |
"hibernate", "time": "<UTC>"}` instead of 404. IMDSv2 wants a session token first
(`PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`), sent back as
`X-aws-ec2-metadata-token`; a 401 means the token expired, and a fresh one is fetched.
`watch_spot_notice` polls every `interval_s` (5 s by default: a notice leaves the worker well
over 100 s to checkpoint and drain), each request bounded by `timeout_s`, and returns the
notice, or None once `stop` is set. An unreachable metadata service (not on EC2, a blip) is
logged once and polled again at the same pace: it never raises out of the watcher. The agent
runs it beside its connection when `spot_notice` is `ec2` and drains when it returns a notice.

`fetch_instance_id` reads `/latest/meta-data/instance-id`, the worker's machine id on EC2 (the
scaler joins its instances to the ledger's nodes on it); `with_ec2_identity` applies it to a
configuration that names no machine id.

Inside a container on EC2 the token's PUT crosses one more network hop than on the host: the
launch template must allow it (`MetadataOptions.HttpPutResponseHopLimit` 2), or every look
fails (docs/DEPLOYING.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import aiohttp
import structlog

from lorafleet.core.settings import ConfigError
from lorafleet.worker.config import WorkerConfig

DEFAULT_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"

log = structlog.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class SpotNotice:
    action: str
    # When EC2 acts, as it wrote it (UTC, ISO 8601).
    time: str


class _Expired(Exception):
    pass


async def imds_token(session: aiohttp.ClientSession, base_url: str, ttl_s: int) -> str:
    async with session.put(base_url + TOKEN_PATH, headers={TTL_HEADER: str(ttl_s)}) as response:
        response.raise_for_status()
        return await response.text()


async def fetch_spot_notice(
    session: aiohttp.ClientSession, base_url: str, token: str
) -> SpotNotice | None:
    """One look: the notice, or None while there is none (404)."""
    async with session.get(base_url + NOTICE_PATH, headers={TOKEN_HEADER: token}) as response:
        if response.status == 404:
            return None
        if response.status == 401:
            raise _Expired
        response.raise_for_status()
        body = await response.json(content_type=None)
        return SpotNotice(action=str(body["action"]), time=str(body["time"]))


async def watch_spot_notice(
    *,
    base_url: str = DEFAULT_BASE_URL,
    interval_s: float = 5.0,
    timeout_s: float = 2.0,
    token_ttl_s: int = 21600,
    stop: asyncio.Event | None = None,
) -> SpotNotice | None:
    stop = stop or asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    token: str | None = None
    warned = False
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            fresh = token is None
            try:
                if token is None:
                    token = await imds_token(session, base_url, token_ttl_s)
                notice = await fetch_spot_notice(session, base_url, token)
                if notice is not None:
                    return notice
                warned = False
            except _Expired:
                token = None
                if not fresh:
                    continue  # a fresh token at once, not after a whole interval
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                token = None
                if not warned:
                    log.warning("spot notice: metadata service unreachable", error=repr(exc))
                    warned = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await stop.wait()
    return None


async def fetch_instance_id(
    *,
    base_url: str = DEFAULT_BASE_URL,
    timeout_s: float = 2.0,
    attempts: int = 3,
    token_ttl_s: int = 60,
) -> str:
    """This instance's id (`i-...`), asked up to `attempts` times (each bounded by `timeout_s`,
    a second apart at most). Raises `ConnectionError` naming the last failure."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    error = "no attempt"
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for attempt in range(max(1, attempts)):
            if attempt:
                await asyncio.sleep(min(1.0, 0.1 * 2**attempt))  # backoff between attempts
            try:
                token = await imds_token(session, base_url, token_ttl_s)
                async with session.get(
                    base_url + INSTANCE_ID_PATH, headers={TOKEN_HEADER: token}
                ) as response:
                    response.raise_for_status()
                    instance_id = (await response.text()).strip()
                if instance_id:
                    return instance_id
                error = "an empty instance id"
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
    raise ConnectionError(f"the EC2 metadata service at {base_url} did not answer: {error}")


async def with_ec2_identity(config: WorkerConfig) -> WorkerConfig:
    """With `spot_notice` `ec2` and no machine id configured, `config` with the instance id as
    machine id (and as provider instance id, unless one is configured); otherwise `config`.

    Raises `ConfigError` when the metadata service gives no instance id: a worker told it runs
    on EC2 that cannot read its own identity would report a hostname (a container id, new at
    every restart) that neither bans nor the scaler can follow."""
    if config.spot_notice != "ec2" or config.machine_id_configured:
        return config
    try:
        instance_id = await fetch_instance_id(base_url=config.ec2_metadata_url)
    except ConnectionError as exc:
        raise ConfigError(
            f"--spot-notice ec2 with no machine id: {exc} (set LORAFLEET_MACHINE_ID, or let"
            " the container reach the metadata service: hop limit 2)"
        ) from None
    log.info("machine id from the EC2 metadata service", machine_id=instance_id)
    return config.with_changes(
        machine_id=instance_id,
        provider_instance_id=config.provider_instance_id or instance_id,
    )
