"""The job ledger: `Ledger`, one async method per named query in sql/queries.sql.

`Ledger` is composed of one mixin per titled section of queries.sql, in the same order
(`sections/`, a module each); `base.LedgerBase` holds the pool, the query plumbing
(`_fetch`, `_fetchrow`, `_conn`) and the translation of driver errors into lorafleet's error
tree; `records` the values the methods return or take. Everything is imported from here, as
it always was: `from lorafleet.ledger.ledger import Ledger, NewJob, ...`.
"""

from __future__ import annotations

from lorafleet.ledger.base import QUERIES, LedgerError, load_queries, translate_error
from lorafleet.ledger.records import (
    OPERATOR_RUN_PROVIDERS,
    STANDING_MIN_AGE_S,
    ApiKeyInfo,
    ApiKeyRecord,
    BannedQueuedJob,
    ExpiredLease,
    Interruptions,
    KeySpending,
    LeaseRecord,
    NewJob,
    NodeRecord,
    PaceRecord,
    PaceReference,
    Quarantine,
    ResumedLease,
    ScalerAction,
    ScalerDecisionRecord,
    ScalerWork,
    ShapePace,
    ShapeWork,
    StalledLease,
    WebhookDelivery,
    WebhookDeliveryRecord,
    checkpoint_from_row,
    event_from_row,
    job_from_row,
    sample_task_from_row,
)
from lorafleet.ledger.sections.api_keys import ApiKeyQueries
from lorafleet.ledger.sections.fleet_figures import FleetFigureQueries
from lorafleet.ledger.sections.jobs import JobQueries
from lorafleet.ledger.sections.leases import LeaseQueries
from lorafleet.ledger.sections.machines import MachineQueries
from lorafleet.ledger.sections.retention import RetentionQueries
from lorafleet.ledger.sections.sample_tasks import SampleTaskQueries
from lorafleet.ledger.sections.scaler import ScalerQueries
from lorafleet.ledger.sections.timeline import TimelineQueries
from lorafleet.ledger.sections.webhooks import WebhookQueries

__all__ = [
    "OPERATOR_RUN_PROVIDERS",
    "QUERIES",
    "STANDING_MIN_AGE_S",
    "ApiKeyInfo",
    "ApiKeyRecord",
    "BannedQueuedJob",
    "ExpiredLease",
    "Interruptions",
    "KeySpending",
    "LeaseRecord",
    "Ledger",
    "LedgerError",
    "NewJob",
    "NodeRecord",
    "PaceRecord",
    "PaceReference",
    "Quarantine",
    "ResumedLease",
    "ScalerAction",
    "ScalerDecisionRecord",
    "ScalerWork",
    "ShapePace",
    "ShapeWork",
    "StalledLease",
    "WebhookDelivery",
    "WebhookDeliveryRecord",
    "checkpoint_from_row",
    "event_from_row",
    "job_from_row",
    "load_queries",
    "sample_task_from_row",
    "translate_error",
]


class Ledger(
    ApiKeyQueries,
    FleetFigureQueries,
    JobQueries,
    LeaseQueries,
    RetentionQueries,
    MachineQueries,
    TimelineQueries,
    WebhookQueries,
    ScalerQueries,
    SampleTaskQueries,
):
    """All reads and writes of the job ledger. Create with `await Ledger.connect(url)`.

    Its bases are queries.sql's sections, in that file's order."""
