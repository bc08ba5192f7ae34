"""The proof of which machine this worker runs on, sent in every Hello.

The scheduler takes a machine's id from what the provider signs, not from what a worker says
(docs/DESIGN.md, "Identities"; the scheduler's identity module verifies). Fetched anew for
every stream: SaladCloud's tokens are short-lived.

* `salad`: the container instance's identity token, from SaladCloud's instance metadata service
  through the official `salad-cloud-imds-sdk` (`GET /v1/token`).
* `ec2`: the instance identity document and its signature, from the EC2 metadata service
  (IMDSv2, as the spot notice watcher reads it).
* `local`: the token `lorafleet up`'s supervisor gave this process (`LORAFLEET_IDENTITY_TOKEN`).

`auto` picks by where the worker runs: a local token when one was given, SaladCloud when
SaladCloud set `SALAD_CONTAINER_GROUP_ID`, EC2 with `--spot-notice ec2`, else none.
"""

from __future__ import annotations

import aiohttp
import structlog
from salad_cloud_imds_sdk import SaladCloudImdsSdkAsync
from salad_cloud_imds_sdk.models import Metadata

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.spot_notice import TOKEN_HEADER, imds_token

log = structlog.get_logger(__name__)

EC2_DOCUMENT_PATH = "/latest/dynamic/instance-identity/document"
EC2_SIGNATURE_PATH = "/latest/dynamic/instance-identity/signature"


def identity_kind(config: WorkerConfig) -> str:
    if config.provider_identity != "auto":
        return config.provider_identity
    if config.identity_token:
        return "local"
    if config.salad_container_group_id:
        return "salad"
    if config.spot_notice == "ec2":
        return "ec2"
    return "none"


async def fetch_identity(config: WorkerConfig, *, timeout_s: float = 5.0) -> fpb.ProviderIdentity:
    """This machine's proof; an empty one when there is none or it cannot be read (logged: the
    scheduler then decides, and refuses the Hello where it requires a proof)."""
    kind = identity_kind(config)
    try:
        if kind == "local":
            return fpb.ProviderIdentity(local_token=config.identity_token)
        if kind == "salad":
            return fpb.ProviderIdentity(salad_jwt=await _salad_token(config, timeout_s))
        if kind == "ec2":
            document, signature = await _ec2_document(config.ec2_metadata_url, timeout_s)
            return fpb.ProviderIdentity(
                ec2=fpb.Ec2IdentityDocument(document=document, signature=signature)
            )
    except Exception as exc:  # the SDK's ApiError, aiohttp's errors: all mean "no proof now"
        log.error(
            "could not read this machine's provider identity",
            provider=kind,
            error=f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"[:300],
        )
    return fpb.ProviderIdentity()


async def _salad_token(config: WorkerConfig, timeout_s: float) -> str:
    sdk = SaladCloudImdsSdkAsync(
        base_url=config.salad_imds_url, timeout=max(1, int(timeout_s * 1000))
    )
    token = await sdk.metadata.get_token(Metadata.TRUE)
    return str(token.jwt)


async def _ec2_document(base_url: str, timeout_s: float) -> tuple[bytes, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        headers = {TOKEN_HEADER: await imds_token(session, base_url, 60)}
        parts = []
        for path in (EC2_DOCUMENT_PATH, EC2_SIGNATURE_PATH):
            async with session.get(base_url + path, headers=headers) as response:
                response.raise_for_status()
                parts.append((await response.read()).strip())
        return parts[0], parts[1]
