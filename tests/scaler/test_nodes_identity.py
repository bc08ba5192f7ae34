"""`lorafleet nodes` showed a worker's unchecked claims as fact: a stream announcing an H100 with
80 GiB read as one, with no column saying that no provider vouched for the machine (only
`--json` had `identity_provider: ""`). The table names the provider, or `unverified`."""

from __future__ import annotations

import asyncpg
import pytest

from lorafleet.app.main import build_parser
from lorafleet.app.services import run_nodes
from tests.scaler.test_cli import populated  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.usefixtures("populated")
async def test_the_table_says_who_vouched_for_each_machine(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE machines SET identity_provider = 'salad' WHERE machine_id = 'm2'"
        )
    finally:
        await conn.close()
    parser = build_parser(with_services=True)
    assert await run_nodes(parser.parse_args(["nodes", "--database-url", database_url])) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    column = header.index("IDENTITY")
    rows = {line.split()[0]: line[column:].split()[0] for line in lines}
    assert rows == {"m1": "unverified", "m2": "salad"}
