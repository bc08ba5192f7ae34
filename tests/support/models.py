"""The tiny SDXL, FLUX.1 and FLUX.2 [klein] models, built once per test run and shared by every
xdist worker.

Building one costs seconds of CPU each time; with one build per worker process (or per fixture,
as the suite did) that was paid several times a run. A model lands in a directory of the run's
temporary root (shared by the workers of one `pytest -n` run), named by its family and a hash of
the builders' source, and a file lock makes the first worker build it while the others wait and
reuse it."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from filelock import FileLock

from tests.support.paths import run_root

if TYPE_CHECKING:
    from lorafleet.worker.tiny_model import Family


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
    """Changes whenever the builders' code does (a stale model is never reused): the entry
    point and every module of the `tiny_models` package (tokenizers shared by the families)."""
    from lorafleet.worker import tiny_model, tiny_models

    sources = [Path(tiny_model.__file__)]
    sources += sorted(Path(tiny_models.__file__).parent.glob("*.py"))
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def tiny_model(tmp_path_factory: pytest.TempPathFactory, family: Family = "sdxl") -> Path:
    """The tiny preset of `family` (seed 0), built once per run."""
    from lorafleet.worker.tiny_model import build_tiny_model

    def build(directory: Path) -> Path:
        return build_tiny_model(directory, family=family)

    return shared_artifact(run_root(tmp_path_factory), f"tiny-{family}", tiny_model_key(), build)
