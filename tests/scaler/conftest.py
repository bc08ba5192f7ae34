"""The scaler's end-to-end `world` (tests/scaler/test_scenarios.py) for every scaler test."""

from tests.scaler.test_scenarios import world  # noqa: F401 (a fixture)
