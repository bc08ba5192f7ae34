"""The clients are tested against the same live scheduler the scheduler tests use."""

from tests.scheduler.conftest import fleet, scheduler_overrides

__all__ = ["fleet", "scheduler_overrides"]
