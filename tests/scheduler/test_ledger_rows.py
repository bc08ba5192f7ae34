"""`lorafleet.ledger.rows.record`: a typed record from a row by field names, on rows of a real
Postgres (uuid, arrays, numeric, bytea, jsonb as the driver returns them) and on the mistakes
it must refuse (a missing column, a NULL where the record promises a value)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from lorafleet.ledger.rows import record


@dataclass(frozen=True, kw_only=True)
class Sample:
    job_id: str
    lease_id: str | None
    machines: tuple[str, ...]
    seconds: float
    secret: bytes
    figures: dict[str, Any]
    at: datetime
    count: int
    note: str = "none"
    tags: tuple[str, ...] = field(default_factory=tuple)


async def test_a_postgres_row_becomes_the_record_its_fields_name(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.set_type_codec(
            "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
        )
        row = await conn.fetchrow(
            """SELECT '7d1a3e0c-7f59-4c41-9d4c-3f1d2b9b2a10'::uuid AS job_id,
                      NULL::uuid AS lease_id,
                      ARRAY['m1', 'm2'] AS machines,
                      sum(x)::numeric AS seconds,
                      '\\x0102'::bytea AS secret,
                      '{"a": 1}'::jsonb AS figures,
                      now() AS at,
                      count(*) AS count
               FROM (VALUES (1), (2)) v(x)"""
        )
    finally:
        await conn.close()
    assert row is not None
    sample = record(Sample, row)
    assert sample.job_id == "7d1a3e0c-7f59-4c41-9d4c-3f1d2b9b2a10"
    assert sample.lease_id is None
    assert sample.machines == ("m1", "m2")
    assert sample.seconds == 3.0 and isinstance(sample.seconds, float)
    assert sample.secret == b"\x01\x02" and isinstance(sample.secret, bytes)
    assert sample.figures == {"a": 1}
    assert isinstance(sample.at, datetime)
    assert sample.count == 2
    assert (sample.note, sample.tags) == ("none", ())  # no such columns: the defaults


def _row(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "job_id": "j",
        "lease_id": None,
        "machines": [],
        "seconds": 1,
        "secret": b"",
        "figures": {},
        "at": datetime(2026, 1, 1),
        "count": 0,
    }
    row.update(overrides)
    return row


def test_given_fields_win_over_columns() -> None:
    sample = record(Sample, _row(note="column"), note="given", count=5)
    assert (sample.note, sample.count) == ("given", 5)


def test_a_missing_column_is_refused_by_name() -> None:
    row = _row()
    del row["count"]
    with pytest.raises(KeyError, match=r"Sample\.count"):
        record(Sample, row)


def test_null_for_a_field_that_is_never_none_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Sample\.job_id"):
        record(Sample, _row(job_id=None))


def test_an_unknown_given_field_is_refused() -> None:
    with pytest.raises(TypeError, match="no fields"):
        record(Sample, _row(), colour="red")
