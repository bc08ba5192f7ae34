"""A job that cannot succeed, end to end: a real worker that `lorafleet up` vouches for (a local
identity), the suite's scheduler and ledger. Its input fault fails the job at once with the
worker's message: nothing waits QUEUED for a second machine that a one-node fleet never has."""

from __future__ import annotations

import pytest

from lorafleet.core.identity import local_identity_token
from lorafleet.jobs.v1 import jobs_pb2 as pb
from lorafleet.worker.agent import Agent
from lorafleet.worker.qualify import QualificationResult
from tests.support.fleet import Fleet, running
from tests.support.jobs import TRAINING_WAIT_S as WAIT_S

# A real worker process's code in this process (it checks the model before loading anything).
pytestmark = pytest.mark.slow


async def test_a_base_model_that_is_no_model_fails_the_job_at_once(
    fleet: Fleet, cpu_qualification: QualificationResult
) -> None:
    config = fleet.worker_config(
        "local-0",
        model_path=None,  # the spec's base_model, as a worker without an override reads it
        provider_identity="local",
        identity_token=local_identity_token(fleet.scheduler.identity_secret, "local-0"),
    )
    async with running(Agent(config, qualification=cpu_qualification)):
        job = await fleet.client.submit(base_model="/no/such/model")
        failed = await fleet.client.wait_state(job.job_id, pb.JOB_STATE_FAILED, timeout=WAIT_S)
    assert failed.failure_class == pb.FAILURE_CLASS_INPUT and failed.failures == 0
    assert "base_model" in failed.error and "/no/such/model" in failed.error, failed.error
    events = await fleet.client.events(job.job_id)
    attempts = [e for e in events if e.kind == pb.JOB_EVENT_KIND_ATTEMPT_FAILED]
    assert len(attempts) == 1 and attempts[0].state == pb.JOB_STATE_FAILED
