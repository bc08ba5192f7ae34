"""The tiny SDXL-architecture model, built once per test run and shared by every xdist worker.

Building it costs seconds of CPU each time; with one build per worker process (or per fixture,
as the suite did) that was paid several times a run. The model lands in a directory of the run's
temporary root (shared by the workers of one `pytest -n` run), named by a hash of the builder's
source, and a file lock makes the first worker build it while the others wait and reuse it."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.support.paths import run_root


def shared_artifact(root: Path, name: str, key: str, build: Callable[[Path], object]) -> Path:
    """`build(directory)` run once per `root`, `name` and `key` across processes; its result
    directory is returned to every caller. A half-built directory (a worker killed mid-build)
    is never used: the build goes to a scratch directory and is renamed when complete."""
    target = root / f"{name}-{key}"
    with FileLock(str(root / f"{name}-{key}.lock"), timeout=600):
        if not target.is_dir():
            scratch = root / f"{name}-{key}.building"
            shutil.rmtree(scratch, ignore_errors=True)
            build(scratch)
            scratch.rename(target)
    return target


def tiny_model_key() -> str:
    """Changes whenever the builder's code does (a stale model is never reused)."""
    from lorafleet.worker import tiny_model

    return hashlib.sha256(Path(tiny_model.__file__).read_bytes()).hexdigest()[:16]


def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.worker.tiny_model import build_tiny_model

    return shared_artifact(
        run_root(tmp_path_factory), "tiny-sdxl", tiny_model_key(), build_tiny_model
    )
