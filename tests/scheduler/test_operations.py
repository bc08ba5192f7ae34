"""Operator-facing behaviour: cancel across replicas, TLS, reflection and health."""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lorafleet.fleet.v1 import fleet_pb2 as fpb
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.jobs.v1 import jobs_pb2_grpc as pbgrpc
from lorafleet.scheduler.server import Scheduler
from tests.support.fleet import Fleet, scheduler_config
from tests.support.jobs import JobClient
from tests.support.workers import connect_worker


async def test_cancel_through_another_replica_reaches_the_holder(
    fleet: Fleet, database_url: str
) -> None:
    job = await fleet.alice.submit()
    config = scheduler_config(database_url, fleet.scheduler.config.data_dir)
    async with (
        Scheduler(config) as other,
        grpc.aio.insecure_channel(f"127.0.0.1:{other.port}") as channel,
    ):
        via_other = JobClient(pbgrpc.JobServiceStub(channel), fleet.alice.api_key)
        async with connect_worker(fleet.channel, fleet.token, "m1") as worker:
            granted = await worker.ready_for_lease()
            assert granted.lease.job_id == job.job_id
            await via_other.cancel(job.job_id)
            revoked = await worker.expect("lease_revoked")
            assert revoked.reason == fpb.REVOKE_REASON_CANCELED


async def test_reflection_lists_every_service_and_health_is_serving(fleet: Fleet) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(fleet.channel)
    responses = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {
        "lorafleet.jobs.v1.JobService",
        "lorafleet.fleet.v1.WorkerService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    health = health_pb2_grpc.HealthStub(fleet.channel)
    for service in ("", "lorafleet.jobs.v1.JobService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


async def test_tls_switch(database_url: str, tmp_path: Path) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    config = scheduler_config(
        database_url, tmp_path / "data", tls_cert_file=cert_file, tls_key_file=key_file
    )
    async with Scheduler(config) as scheduler:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert_file.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{scheduler.port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = pbgrpc.JobServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.ListJobs(pb.ListJobsRequest(), timeout=10)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with grpc.aio.insecure_channel(f"localhost:{scheduler.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_database_pool_size_bounds_the_schedulers_connections(
    database_url: str, tmp_path: Path
) -> None:
    """Each replica holds at most this many connections: replicas x it must stay under the
    server's max_connections."""
    config = scheduler_config(database_url, tmp_path / "data", database_pool_size=3)
    async with Scheduler(config) as scheduler:
        assert scheduler.ledger._pool.get_max_size() == 3
