"""The agent against the real thing: the suite's fleet (tests/support/fleet.py) with real
pictures and the tiny SDXL-architecture model, trained on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fleet import FleetProfile, training_profile


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_intra_op_thread: None) -> None:
    """Every agent test trains: one intra-op thread (tests/support/fixtures.py says why)."""


@pytest.fixture
def fleet_profile() -> FleetProfile:
    return training_profile()


@pytest.fixture
def fleet_tiny_model(tiny_model: Path) -> Path:
    return tiny_model
