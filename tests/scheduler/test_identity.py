"""Provider identities: SaladCloud tokens against a JWKS served on loopback, EC2 identity
documents against a certificate, and the local supervisor's tokens. Each proof is accepted only
for the machine it names, and only from the operator's own container groups and accounts."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import datetime
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import jwt
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from lorafleet.core.errors import Unauthenticated
from lorafleet.core.identity import local_identity_token
from lorafleet.core.model import IdentityProof
from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.fleet.v1 import fleet_pb2_grpc as fgrpc
from lorafleet.scheduler.identity import (
    Ec2IdentityVerifier,
    IdentityVerifiers,
    LocalIdentityVerifier,
    SaladIdentityVerifier,
)
from lorafleet.scheduler.server import read_or_create_secret
from tests.support.fleet import WORKER_TOKEN, Fleet
from tests.support.jobs import WAIT_S
from tests.support.workers import ScriptedWorker

GROUP = "8e6c3f1a-1b2c-4d5e-8f90-123456789abc"
MACHINE = "0f3b6c2e-5d4a-4b7c-9e8f-abcdef012345"


def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@dataclass
class Jwks:
    """SaladCloud's workload JWKS on loopback: the keys it publishes, and how often it was read."""

    keys: dict[str, rsa.RSAPrivateKey] = field(default_factory=dict)
    hits: int = 0
    url: str = ""

    def token(self, kid: str, **claims: Any) -> str:
        payload = {
            "salad_machine_id": MACHINE,
            "salad_container_group_id": GROUP,
            "iat": int(time.time()),
            "exp": int(time.time()) + 600,
            **claims,
        }
        return jwt.encode(payload, self.keys[kid], algorithm="RS256", headers={"kid": kid})


@pytest.fixture
async def jwks() -> AsyncIterator[Jwks]:
    state = Jwks(keys={"k1": _rsa_key()})

    async def serve(request: web.Request) -> web.Response:
        state.hits += 1
        keys = []
        for kid, key in state.keys.items():
            jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
            keys.append({**jwk, "kid": kid, "use": "sig", "alg": "RS256"})
        return web.json_response({"keys": keys})

    app = web.Application()
    app.router.add_get("/.well-known/workload-jwks.json", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state.url = f"http://127.0.0.1:{port}/.well-known/workload-jwks.json"
    try:
        yield state
    finally:
        await runner.cleanup()


def _salad(jwks: Jwks, **options: Any) -> SaladIdentityVerifier:
    return SaladIdentityVerifier(
        container_group_ids=frozenset({GROUP}), jwks_url=jwks.url, **options
    )


async def test_a_salad_token_of_the_fleet_names_its_machine(jwks: Jwks) -> None:
    verifiers = IdentityVerifiers(salad=_salad(jwks))
    verified = await verifiers.verify(MACHINE, IdentityProof(salad_jwt=jwks.token("k1")))
    assert (verified.provider, verified.machine_id) == ("salad", MACHINE)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        # Any SaladCloud customer can get a validly signed token for their own containers.
        (lambda j: j.token("k1", salad_container_group_id="someone-elses"), "container groups"),
        (lambda j: j.token("k1", exp=int(time.time()) - 3600), "does not verify"),
        (lambda j: j.token("k1", salad_machine_id="../../etc"), "not a machine id"),
        # Signed, but a claim of the wrong type (a list is unhashable): refused, not a crash.
        (lambda j: j.token("k1", salad_container_group_id=[GROUP]), "container groups"),
        # Signed by a key the JWKS does not publish, under a kid it does.
        (
            lambda j: jwt.encode(
                {"salad_machine_id": MACHINE, "salad_container_group_id": GROUP, "exp": 2**40},
                _rsa_key(),
                algorithm="RS256",
                headers={"kid": "k1"},
            ),
            "does not verify",
        ),
        # HMAC keyed with something public: refused by algorithm before any key is used.
        (
            lambda j: jwt.encode(
                {"salad_machine_id": MACHINE, "salad_container_group_id": GROUP, "exp": 2**40},
                "a-public-key-anyone-could-have-read",
                algorithm="HS256",
                headers={"kid": "k1"},
            ),
            "algorithm",
        ),
        (lambda j: "not.a.jwt", "not a JWT"),
        (lambda j: "x" * 5000, "characters"),
    ],
)
async def test_a_salad_token_that_is_not_the_fleets_is_refused(
    jwks: Jwks, make: Callable[[Jwks], str], reason: str
) -> None:
    verifiers = IdentityVerifiers(salad=_salad(jwks))
    with pytest.raises(Unauthenticated, match=reason):
        await verifiers.verify(MACHINE, IdentityProof(salad_jwt=make(jwks)))


async def test_a_proof_of_another_machine_is_refused(jwks: Jwks) -> None:
    verifiers = IdentityVerifiers(salad=_salad(jwks))
    with pytest.raises(Unauthenticated, match="names machine"):
        await verifiers.verify("victim-machine", IdentityProof(salad_jwt=jwks.token("k1")))


async def test_a_rotated_key_is_fetched_once_and_forged_key_ids_do_not_hammer_the_jwks(
    jwks: Jwks,
) -> None:
    verifier = _salad(jwks, refresh_interval_s=3600)
    await verifier.verify(jwks.token("k1"))
    assert jwks.hits == 1
    await verifier.verify(jwks.token("k1"))
    assert jwks.hits == 1  # cached
    jwks.keys["k2"] = _rsa_key()
    # Within the refresh interval an unknown kid is refused without another fetch...
    with pytest.raises(Unauthenticated, match="names no key"):
        await verifier.verify(jwks.token("k2"))
    assert jwks.hits == 1
    # ...and after it, the rotated key is fetched once.
    rotating = _salad(jwks, refresh_interval_s=0)
    assert (await rotating.verify(jwks.token("k2"))).machine_id == MACHINE
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            await verifier.verify(jwks.token("k2") + "x")
    assert jwks.hits == 2


@dataclass
class Ec2:
    key: rsa.RSAPrivateKey
    certificate_pem: bytes

    def document(self, **fields: Any) -> tuple[bytes, bytes]:
        doc = json.dumps(
            {"accountId": "123456789012", "instanceId": "i-0abc123", "region": "eu-west-1"} | fields
        ).encode()
        signature = self.key.sign(doc, padding.PKCS1v15(), hashes.SHA256())
        return doc, base64.b64encode(signature)


@pytest.fixture(scope="module")
def ec2() -> Ec2:
    key = _rsa_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Amazon Web Services LLC")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    return Ec2(key=key, certificate_pem=certificate.public_bytes(serialization.Encoding.PEM))


def _ec2_verifiers(ec2: Ec2) -> IdentityVerifiers:
    verifier = Ec2IdentityVerifier(
        certificates_pem=ec2.certificate_pem, account_ids=frozenset({"123456789012"})
    )
    return IdentityVerifiers(ec2=verifier)


async def test_an_ec2_identity_document_names_its_instance(ec2: Ec2) -> None:
    document, signature = ec2.document()
    verified = await _ec2_verifiers(ec2).verify(
        "i-0abc123", IdentityProof(ec2_document=document, ec2_signature=signature)
    )
    assert (verified.provider, verified.machine_id, verified.instance_id) == (
        "ec2",
        "i-0abc123",
        "i-0abc123",
    )


async def test_a_tampered_or_foreign_ec2_document_is_refused(ec2: Ec2) -> None:
    verifiers = _ec2_verifiers(ec2)
    document, signature = ec2.document()
    tampered = document.replace(b"i-0abc123", b"i-0victim")
    with pytest.raises(Unauthenticated, match="does not verify"):
        await verifiers.verify(
            "i-0victim", IdentityProof(ec2_document=tampered, ec2_signature=signature)
        )
    foreign, foreign_signature = ec2.document(accountId="999999999999")
    with pytest.raises(Unauthenticated, match="accounts"):
        await verifiers.verify(
            "i-0abc123", IdentityProof(ec2_document=foreign, ec2_signature=foreign_signature)
        )
    with pytest.raises(Unauthenticated, match="base64"):
        await verifiers.verify(
            "i-0abc123", IdentityProof(ec2_document=document, ec2_signature=b"%%%")
        )


async def test_local_tokens_come_only_from_the_supervisors_secret() -> None:
    secret = "s" * 32
    verifiers = IdentityVerifiers(local=LocalIdentityVerifier(secret=secret))
    token = local_identity_token(secret, "local-0")
    assert (await verifiers.verify("local-0", IdentityProof(local_token=token))).machine_id == (
        "local-0"
    )
    with pytest.raises(Unauthenticated):  # another machine's token
        await verifiers.verify("local-1", IdentityProof(local_token=token))
    forged = local_identity_token("worker-token-anyone-has", "local-1")
    with pytest.raises(Unauthenticated):  # minted with the worker token, say
        await verifiers.verify("local-1", IdentityProof(local_token=forged))


async def test_a_proof_of_a_kind_the_scheduler_does_not_take_is_refused(jwks: Jwks) -> None:
    with pytest.raises(Unauthenticated, match="no SaladCloud identities"):
        await IdentityVerifiers().verify(MACHINE, IdentityProof(salad_jwt=jwks.token("k1")))
    with pytest.raises(Unauthenticated, match="no proof"):
        await IdentityVerifiers().verify(MACHINE, IdentityProof())


# On the worker stream -------------------------------------------------------------------------


async def _hello(
    channel: grpc.aio.Channel, machine_id: str, identity: fpb.ProviderIdentity | None = None
) -> ScriptedWorker:
    call = fgrpc.WorkerServiceStub(channel).Connect(
        metadata=(("authorization", f"Bearer {WORKER_TOKEN}"),)
    )
    worker = ScriptedWorker(machine_id=machine_id, call=call)
    hello = fpb.Hello(
        machine_id=machine_id,
        gpu_model="NVIDIA H200",
        vram_mb=81_920,
        qualification=fpb.Qualification(passed=True, detail="scripted"),
        version="test",
    )
    if identity is not None:
        hello.identity.CopyFrom(identity)
    await worker.send(hello=hello)
    return worker


async def _refusal(worker: ScriptedWorker) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await worker.expect("welcome")
    return refused.value


async def _identity_of(fleet: Fleet, machine_id: str) -> str:
    (node,) = await fleet.scheduler.ledger.list_nodes([machine_id], fault_window_s=60, limit=1)
    return node.identity_provider


async def test_a_squatter_cannot_keep_the_real_machine_out_nor_take_a_verified_id(
    fleet: Fleet,
) -> None:
    secret = fleet.scheduler.identity_secret
    proof = fpb.ProviderIdentity(local_token=local_identity_token(secret, "local-0"))
    # A squatter says Hello first, under the real machine's id, with no proof.
    squatter = await _hello(fleet.channel, "local-0")
    await squatter.expect("welcome")
    assert await _identity_of(fleet, "local-0") == ""
    # The real worker proves its id and takes it at once (it used to wait a lease TTL).
    real = await _hello(fleet.channel, "local-0", proof)
    await real.expect("welcome")
    assert await _identity_of(fleet, "local-0") == "local"
    # From now on no unverified stream takes this id, not even after the machine's silence.
    await real.call.done_writing()
    async with asyncio.timeout(WAIT_S):
        while (await real.call.read()) is not grpc.aio.EOF:
            pass
    conn = await asyncpg.connect(fleet.scheduler.database_url)
    try:
        await conn.execute(
            "UPDATE machines SET last_seen_at = now() - interval '1 day'"
            " WHERE machine_id = 'local-0'"
        )
    finally:
        await conn.close()
    late = await _hello(fleet.channel, "local-0")
    refusal = await _refusal(late)
    assert refusal.code() == grpc.StatusCode.ALREADY_EXISTS
    # Nor does a token minted for another machine id.
    forged = await _hello(
        fleet.channel,
        "local-0",
        fpb.ProviderIdentity(local_token=local_identity_token(secret, "local-1")),
    )
    refusal = await _refusal(forged)
    assert refusal.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "identity" in (refusal.details() or "")


@pytest.mark.parametrize("scheduler_overrides", [{"require_provider_identity": True}])
async def test_a_scheduler_that_requires_identities_refuses_a_hello_without_one(
    fleet: Fleet,
) -> None:
    refusal = await _refusal(await _hello(fleet.channel, "m1"))
    assert refusal.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no proof" in (refusal.details() or "")
    proof = fpb.ProviderIdentity(
        local_token=local_identity_token(fleet.scheduler.identity_secret, "m1")
    )
    worker = await _hello(fleet.channel, "m1", proof)
    assert (await worker.expect("welcome")).session_token


def test_replicas_starting_together_on_one_data_dir_read_one_secret(tmp_path: Path) -> None:
    """A replica that read a half-written secret would verify no local token of the others'."""
    path = tmp_path / "identity-secret"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        values = set(pool.map(lambda _: read_or_create_secret(path), range(32)))
    assert values == {path.read_text().strip()} and len(values.pop()) >= 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity-secret"]
