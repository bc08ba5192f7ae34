"""`compile_model: auto`: compile when the remaining steps pay for it, by this node's own
measurements per shape (a conservative prior before any), kept in the node's cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.worker.config import WorkerConfig
from lorafleet.worker.training.compiling import COSTS_FILE, CompileCosts, ShapeCosts, decide

MEASURED = ShapeCosts(eager_step_s=1.0, compiled_step_s=0.5, compile_s=100.0)


def test_auto_compiles_only_when_the_remaining_steps_pay_for_it() -> None:
    assert not decide("auto", MEASURED, remaining_steps=150, warm=False).compile
    paid = decide("auto", MEASURED, remaining_steps=250, warm=False)
    assert paid.compile and "measured on this node" in paid.reason
    # Compiled on this node already: only the saving counts.
    assert decide("auto", MEASURED, remaining_steps=10, warm=True).compile
    # Never measured: the prior, which says so and wants a long job.
    prior = decide("auto", ShapeCosts(), remaining_steps=300, warm=False)
    assert not prior.compile and "prior" in prior.reason and "eager" in prior.reason
    assert decide("auto", ShapeCosts(), remaining_steps=5000, warm=False).compile
    # Compiled not faster here: never.
    slower = ShapeCosts(eager_step_s=1.0, compiled_step_s=1.1, compile_s=1.0)
    assert not decide("auto", slower, remaining_steps=10**6, warm=True).compile
    assert decide("on", ShapeCosts(), remaining_steps=1, warm=False).compile
    assert not decide("off", MEASURED, remaining_steps=10**6, warm=True).compile


def test_measurements_persist_per_shape_and_a_bad_file_is_ignored(tmp_path: Path) -> None:
    costs = CompileCosts(tmp_path)
    costs.record_run("s", [3.0, 1.0, 1.2, 1.0], compiled=False, cold=False)
    costs.record_run("s", [40.0, 0.5, 0.5], compiled=True, cold=True)
    again = CompileCosts(tmp_path).get("s")
    assert again == ShapeCosts(eager_step_s=1.0, compiled_step_s=0.5, compile_s=39.5)
    assert CompileCosts(tmp_path).get("other") == ShapeCosts()
    (tmp_path / COSTS_FILE).write_text('{"s": {"compile_s": -1}}')
    assert CompileCosts(tmp_path).get("s") == ShapeCosts()


@pytest.mark.parametrize(
    ("given", "expected"), [("auto", "auto"), ("true", "on"), ("0", "off"), ("on", "on")]
)
def test_compile_model_is_auto_by_default_and_takes_booleans(given: str, expected: str) -> None:
    base = {"LORAFLEET_WORKER_TOKEN": "t", "LORAFLEET_MACHINE_ID": "m1"}
    assert WorkerConfig.from_env(base).compile_model == "auto"
    config = WorkerConfig.from_env({**base, "LORAFLEET_COMPILE_MODEL": given})
    assert config.compile_model == expected
    assert config.compile_cache_path.name == "compile-m1"


def test_compile_artifacts_path_is_unset_by_default_and_read_from_the_env(tmp_path: Path) -> None:
    base = {"LORAFLEET_WORKER_TOKEN": "t", "LORAFLEET_MACHINE_ID": "m1"}
    assert WorkerConfig.from_env(base).compile_artifacts_path is None
    baked = tmp_path / "artifacts.bin"
    config = WorkerConfig.from_env({**base, "LORAFLEET_COMPILE_ARTIFACTS_PATH": str(baked)})
    assert config.compile_artifacts_path == baked
