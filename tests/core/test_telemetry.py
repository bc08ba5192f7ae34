"""Every log line is one JSON object, the libraries' included (asyncpg's pool, grpc, aiohttp)."""

from __future__ import annotations

import json
import logging
import os
import pty
import subprocess
import sys
from collections.abc import Iterator

import pytest
import structlog

from lorafleet.core.telemetry import configure_logging


@pytest.fixture
def json_logging() -> Iterator[None]:
    """JSON lines for this test only: the process's other tests read the console format that
    tests/conftest.py set (xdist runs many tests in one process)."""
    configure_logging(level="INFO", fmt="json")
    yield
    configure_logging(fmt="console")


@pytest.mark.usefixtures("json_logging")
def test_library_records_are_json_lines_like_ours(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        raise ConnectionRefusedError("postgres is starting")
    except ConnectionRefusedError:
        logging.getLogger("asyncpg.pool").exception("connection failed; retrying")
    structlog.get_logger("lorafleet.test").info("ours", job_id="j1")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses on its own
    library, ours = records[-2], records[-1]
    assert library["logger"] == "asyncpg.pool" and library["level"] == "error"
    assert "ConnectionRefusedError: postgres is starting" in library["exception"]
    assert ours["event"] == "ours" and ours["job_id"] == "j1"


def test_a_terminal_gets_readable_lines_and_a_pipe_json() -> None:
    """`lorafleet up` in a terminal: no JSON at a person (LORAFLEET_LOG_FORMAT still decides)."""
    script = (
        "import structlog\n"
        "from lorafleet.core.telemetry import configure_logging\n"
        "configure_logging()\n"
        "structlog.get_logger().info('hello', job_id='j1')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LORAFLEET_LOG_FORMAT"}
    piped = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert json.loads(piped.stderr.strip().splitlines()[-1])["event"] == "hello"
    leader, follower = pty.openpty()
    try:
        subprocess.run(
            [sys.executable, "-c", script],
            stderr=follower,
            stdout=subprocess.DEVNULL,
            env=env,
            timeout=60,
            check=True,
        )
        on_tty = os.read(leader, 65536).decode(errors="replace")
    finally:
        os.close(leader)
        os.close(follower)
    assert "hello" in on_tty and "job_id" in on_tty and not on_tty.lstrip().startswith("{")


def test_the_console_format_has_no_colour_codes_off_a_terminal() -> None:
    """The demo's progress output (stderr to a file or a pipe) once carried a raw ANSI-coloured
    warning line: colours are for a terminal only."""
    script = (
        "import structlog\n"
        "from lorafleet.core.telemetry import configure_logging\n"
        "configure_logging(level='WARNING', fmt='console')\n"
        "structlog.get_logger().warning('disk nearly full', free_mb=10)\n"
    )
    piped = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    line = piped.stderr.strip().splitlines()[-1]
    assert "disk nearly full" in line and "free_mb=10" in line, line
    assert "\x1b[" not in piped.stderr, repr(piped.stderr)
