"""The suite's shared fixtures (a pytest plugin, loaded by tests/conftest.py): the live fleet,
the tiny model, a CPU qualification result, one intra-op thread for tests that train."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support import models
from tests.support.fleet import SCRIPTED, Fleet, FleetProfile, start_fleet
from tests.support.paths import public_tmp_dir

if TYPE_CHECKING:
    from lorafleet.worker.qualify import QualificationResult


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel run the long tests start first (those allowed the longest timeout, then
    the rest marked slow), so the run does not end waiting on one started last. Every xdist
    worker sorts the same way; a serial run keeps the files' order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def allowed_s(item: pytest.Item) -> float:
        marker = item.get_closest_marker("timeout")
        return float(marker.args[0]) if marker is not None and marker.args else 0.0

    items.sort(key=lambda item: (-allowed_s(item), item.get_closest_marker("slow") is None))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keeps each phase's report on the test item (`public_tmp_path` keeps a failed test's
    directory for its logs)."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def public_tmp_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A temporary directory outside pytest's own tree, for an embedded Postgres (`lorafleet up`,
    `demo`, the chaos benchmark). Run as root, pgserver runs Postgres as its own user and opens
    the directories above its data to it; but every pytest process that starts (another run
    beside this one) makes its tree private again (0700), and Postgres then fails with
    "Permission denied". Removed after a test that passed; a failed one's stays, with its logs."""
    path = Path(tempfile.mkdtemp(prefix="lorafleet-test-", dir=public_tmp_dir()))
    yield path
    report = getattr(request.node, "report_call", None)
    if report is not None and report.passed:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SDXL-architecture model, built once per run (shared by xdist workers)."""
    return models.tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Path) -> Path:
    """The trainer tests' name for `tiny_model`."""
    return tiny_model


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.1-dev-architecture model (a `FluxPipeline`), built once per run."""
    return models.tiny_model(tmp_path_factory, "flux")


@pytest.fixture(scope="session")
def tiny_flux2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 [klein]-architecture model (a `Flux2KleinPipeline`), built once per run."""
    return models.tiny_model(tmp_path_factory, "flux2")


@pytest.fixture
def scheduler_overrides() -> dict[str, Any]:
    """SchedulerConfig overrides of one test (`@pytest.mark.parametrize` it)."""
    return {}


@pytest.fixture
def fleet_profile() -> FleetProfile:
    """Scripted workers unless a directory says otherwise (tests/agent/conftest.py)."""
    return SCRIPTED


@pytest.fixture
def fleet_tiny_model() -> Path | None:
    """The model the fleet's workers load; only fleets of real workers need one."""
    return None


@pytest.fixture
async def fleet(
    database_url: str,
    tmp_path: Path,
    fleet_profile: FleetProfile,
    fleet_tiny_model: Path | None,
    scheduler_overrides: dict[str, Any],
) -> AsyncIterator[Fleet]:
    async with start_fleet(
        database_url,
        tmp_path / "data",
        fleet_profile,
        tiny_model=fleet_tiny_model,
        **scheduler_overrides,
    ) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """The tiny model's kernels are too small to gain from intra-op parallelism, and where other
    processes share the two cores, OpenMP threads spinning against them made a training step
    four times slower. Worker processes get OMP_NUM_THREADS=1 likewise, so in-process reference
    runs and workers compute the same way (a different thread count may sum in a different
    order). Restored after each module, for other test directories."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def cpu_qualification() -> QualificationResult:
    """One real probe result reused by tests that are not about qualification."""
    from lorafleet.core.settings import load
    from lorafleet.worker.config import WorkerConfig
    from lorafleet.worker.qualify import probe

    return probe(
        load(
            WorkerConfig,
            env={},
            worker_token="x",
            allow_cpu=True,
            min_free_disk_mb=0,
            min_free_memory_mb=0,
        )
    )
