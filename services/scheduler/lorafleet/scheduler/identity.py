"""Which provider machine a worker stream runs on, as the provider vouches for it.

The worker token only lets a process join the fleet: every worker holds it, so a machine id in a
Hello is a claim. Where the provider signs an identity, the Hello carries that proof and the
scheduler takes the machine id from it (docs/DESIGN.md, "Identities"):

* **SaladCloud**: the container instance's identity token (IMDS `GET /v1/token`), a JWT signed
  with SaladCloud's workload JWKS. Its claims name `salad_machine_id` and
  `salad_container_group_id`; only tokens of the operator's own container groups are accepted
  (any SaladCloud customer can get a validly signed token for their own containers).
* **EC2**: the instance identity document and its RSA-SHA256 signature (IMDS
  `/latest/dynamic/instance-identity/document` and `/signature`), checked against the region's
  AWS public certificate the operator configures; the machine id is the document's
  `instanceId`, and only the operator's own accounts are accepted. The document carries no
  expiry, so a copy of it identifies its instance for as long as that instance exists: it is
  read only by the operator's own VM.
* **Local** (`lorafleet up`): the supervisor that starts worker processes gives each an
  HMAC-SHA256 of its machine id under a secret that only the supervisor and the scheduler hold
  (not the worker token).

A machine whose Hello carries no proof is unverified: with `require_provider_identity` it is
refused; otherwise it may train, but the scaler never acts on a provider instance for it.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import jwt
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from lorafleet.core.errors import LorafleetError, Unauthenticated
from lorafleet.core.identity import local_identity_token
from lorafleet.core.model import IdentityProof
from lorafleet.core.serde import MACHINE_ID

# Bounds on what a stranger may make the scheduler parse.
MAX_JWT_CHARS = 4096
MAX_EC2_DOCUMENT_BYTES = 8192
MAX_EC2_SIGNATURE_BYTES = 1024
# Asymmetric algorithms only: an HMAC algorithm would let anyone holding the public key sign.
_JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA")

SALAD_JWKS_URL = "https://matrix-rest-api.salad.com/.well-known/workload-jwks.json"


@dataclass(frozen=True, kw_only=True)
class VerifiedIdentity:
    """A machine identity the provider (or the local supervisor) signed."""

    provider: str  # "salad", "ec2" or "local"
    machine_id: str
    # The provider's instance id where the proof names one (EC2); "" where it does not.
    instance_id: str = ""


def _refused(reason: str) -> Unauthenticated:
    return Unauthenticated(f"identity: {reason}")


def _machine_id(value: object, claim: str) -> str:
    if not isinstance(value, str) or not MACHINE_ID.fullmatch(value):
        raise _refused(f"the proof's {claim} is not a machine id")
    return value


class SaladIdentityVerifier:
    """Verifies SaladCloud instance identity tokens against the workload JWKS.

    The key set is fetched on first use and again when a token names a key id it lacks (key
    rotation), at most once per `refresh_interval_s`, so a stream of forged key ids cannot make
    the scheduler hammer the JWKS endpoint."""

    def __init__(
        self,
        *,
        container_group_ids: frozenset[str],
        jwks_url: str = SALAD_JWKS_URL,
        leeway_s: float = 30.0,
        refresh_interval_s: float = 60.0,
        timeout_s: float = 10.0,
    ) -> None:
        if not container_group_ids:
            raise ValueError("SaladCloud identities need the operator's container group ids")
        self._groups = container_group_ids
        self._jwks_url = jwks_url
        self._leeway_s = leeway_s
        self._refresh_interval_s = refresh_interval_s
        self._timeout_s = timeout_s
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()

    async def verify(self, token: str) -> VerifiedIdentity:
        if not token or len(token) > MAX_JWT_CHARS:
            raise _refused(f"a SaladCloud token is 1 to {MAX_JWT_CHARS} characters")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise _refused("the SaladCloud token is not a JWT") from exc
        algorithm, kid = header.get("alg"), header.get("kid")
        if algorithm not in _JWT_ALGORITHMS:
            raise _refused(f"the SaladCloud token's algorithm {str(algorithm)[:20]!r} is refused")
        key = await self._key(kid if isinstance(kid, str) else "")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                leeway=self._leeway_s,
                options={"require": ["exp"], "verify_aud": False},
            )
        except jwt.PyJWTError as exc:
            raise _refused(f"the SaladCloud token does not verify ({exc})") from exc
        group = claims.get("salad_container_group_id")
        if not isinstance(group, str) or group not in self._groups:
            raise _refused("the SaladCloud token is not of this fleet's container groups")
        return VerifiedIdentity(
            provider="salad", machine_id=_machine_id(claims.get("salad_machine_id"), "machine id")
        )

    async def _key(self, kid: str) -> jwt.PyJWK:
        async with self._lock:
            if kid not in self._keys and (
                time.monotonic() - self._fetched_at >= self._refresh_interval_s
            ):
                self._fetched_at = time.monotonic()
                self._keys = await self._fetch()
        if kid in self._keys:
            return self._keys[kid]
        if not kid and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        raise _refused("the SaladCloud token names no key of the workload JWKS")

    async def _fetch(self) -> dict[str, jwt.PyJWK]:
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(self._jwks_url) as response,
            ):
                response.raise_for_status()
                body = await response.content.read(1 << 20)
            keys = jwt.PyJWKSet.from_dict(json.loads(body))
        except (aiohttp.ClientError, TimeoutError, ValueError, jwt.PyJWTError) as exc:
            error = LorafleetError(f"identity: the workload JWKS could not be read ({exc})")
            error.retryable = True
            raise error from exc
        return {k.key_id or "": k for k in keys.keys}


class Ec2IdentityVerifier:
    """Verifies EC2 instance identity documents against AWS's public certificates."""

    def __init__(self, *, certificates_pem: bytes, account_ids: frozenset[str]) -> None:
        if not account_ids:
            raise ValueError("EC2 identities need the operator's AWS account ids")
        keys = [c.public_key() for c in x509.load_pem_x509_certificates(certificates_pem)]
        self._keys = [k for k in keys if isinstance(k, rsa.RSAPublicKey)]
        if not self._keys:
            raise ValueError("no RSA certificate among the EC2 identity certificates")
        self._accounts = account_ids

    def verify(self, document: bytes, signature: bytes) -> VerifiedIdentity:
        if not 0 < len(document) <= MAX_EC2_DOCUMENT_BYTES or not (
            0 < len(signature) <= MAX_EC2_SIGNATURE_BYTES
        ):
            raise _refused("an EC2 identity document or signature of a wrong size")
        try:
            # EC2 serves the base64 text wrapped over lines.
            raw_signature = base64.b64decode(b"".join(signature.split()), validate=True)
        except ValueError as exc:
            raise _refused("the EC2 signature is not base64") from exc
        if not any(self._signed_by(key, document, raw_signature) for key in self._keys):
            raise _refused("the EC2 identity document's signature does not verify")
        try:
            fields = json.loads(document)
        except ValueError as exc:
            raise _refused("the EC2 identity document is not JSON") from exc
        if not isinstance(fields, Mapping) or fields.get("accountId") not in self._accounts:
            raise _refused("the EC2 instance is not of this fleet's accounts")
        instance = _machine_id(fields.get("instanceId"), "instance id")
        return VerifiedIdentity(provider="ec2", machine_id=instance, instance_id=instance)

    @staticmethod
    def _signed_by(key: rsa.RSAPublicKey, document: bytes, signature: bytes) -> bool:
        try:
            key.verify(signature, document, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            return False
        return True


class LocalIdentityVerifier:
    def __init__(self, *, secret: str) -> None:
        if len(secret) < 16:
            raise ValueError("the local identity secret must be at least 16 characters")
        self._secret = secret

    def verify(self, machine_id: str, token: str) -> VerifiedIdentity:
        expected = local_identity_token(self._secret, machine_id)
        if not hmac.compare_digest(expected.encode(), token.encode()[:128]):
            raise _refused("the local identity token is not the supervisor's")
        return VerifiedIdentity(provider="local", machine_id=_machine_id(machine_id, "machine id"))


class IdentityVerifiers:
    """The verifiers this scheduler is configured with; a proof of another kind is refused."""

    def __init__(
        self,
        *,
        salad: SaladIdentityVerifier | None = None,
        ec2: Ec2IdentityVerifier | None = None,
        local: LocalIdentityVerifier | None = None,
        required: bool = False,
    ) -> None:
        self._salad, self._ec2, self._local = salad, ec2, local
        self.required = required

    async def verify(self, declared_machine_id: str, proof: IdentityProof) -> VerifiedIdentity:
        """The machine the proof names; it must be the one the Hello declares (a worker that
        says one id and proves another is refused, rather than silently renamed)."""
        if proof.salad_jwt:
            if self._salad is None:
                raise _refused("this scheduler takes no SaladCloud identities")
            verified = await self._salad.verify(proof.salad_jwt)
        elif proof.ec2_document:
            if self._ec2 is None:
                raise _refused("this scheduler takes no EC2 identities")
            verified = self._ec2.verify(proof.ec2_document, proof.ec2_signature)
        elif proof.local_token:
            if self._local is None:
                raise _refused("this scheduler takes no local identities")
            verified = self._local.verify(declared_machine_id, proof.local_token)
        else:
            raise _refused("the Hello carries no proof of identity")
        if verified.machine_id != declared_machine_id:
            raise _refused(
                f"the proof names machine {verified.machine_id!r}, the Hello"
                f" {declared_machine_id[:128]!r}"
            )
        return verified


def _ids(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def build_verifiers(
    *,
    local_secret: str,
    required: bool,
    salad_container_group_ids: str = "",
    salad_jwks_url: str = SALAD_JWKS_URL,
    ec2_certificates_pem: bytes | None = None,
    ec2_account_ids: str = "",
) -> IdentityVerifiers:
    """The verifiers a scheduler's configuration names; the local one always (only the
    scheduler and the supervisor it shares `local_secret` with can mint its tokens)."""
    groups = _ids(salad_container_group_ids)
    return IdentityVerifiers(
        salad=SaladIdentityVerifier(container_group_ids=groups, jwks_url=salad_jwks_url)
        if groups
        else None,
        ec2=Ec2IdentityVerifier(
            certificates_pem=ec2_certificates_pem, account_ids=_ids(ec2_account_ids)
        )
        if ec2_certificates_pem is not None
        else None,
        local=LocalIdentityVerifier(secret=local_secret),
        required=required,
    )
