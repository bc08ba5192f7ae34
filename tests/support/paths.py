"""Where tests put what outlives one test: the run's shared directory, the public temp dir."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory every process of this test run shares: the base temp of a serial
    run, its parent under xdist (each worker's base temp is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def public_tmp_dir() -> Path:
    """The system's temporary directory, which every user can traverse."""
    return Path(tempfile.gettempdir())
