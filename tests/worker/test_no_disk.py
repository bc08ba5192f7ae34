"""A training run with checkpoints, class images and a resume writes nothing locally.

Two independent witnesses:

* an audit hook (`sys.addaudithook`) records every Python-level open for writing, rename,
  replace, remove, mkdir and shutil operation anywhere while the run is in progress;
* the run happens with a fresh empty cwd, temp dir, HOME and cache dirs (XDG, torch, triton),
  which must still be empty afterwards, and the Hugging Face cache and the model directory must
  be unchanged: this catches writes made from C++ or Rust code, which audit hooks cannot see.

Audit hooks cannot be removed, so one is installed per process and gated by a flag.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest

from lorafleet.worker.training import (
    Finished,
    Stopped,
    TrainingImage,
    load_checkpoint,
    serialize_checkpoint,
)
from tests.support.training import SAMPLING_WARNING, Recorder, TrainFn, tiny_spec

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_MUTATING_EVENTS = {
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.chmod",
    "os.utime",
    "shutil.copyfile",
    "shutil.copymode",
    "shutil.copystat",
    "shutil.copytree",
    "shutil.move",
    "shutil.rmtree",
    "shutil.make_archive",
    "shutil.unpack_archive",
    "tempfile.mkstemp",
    "tempfile.mkdtemp",
}
# Character devices that are not storage.
_HARMLESS = ("/dev/null", "/dev/tty", "/dev/urandom")


class _Audit:
    active: ClassVar[bool] = False
    events: ClassVar[list[tuple[str, str]]] = []
    installed: ClassVar[bool] = False


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _Audit.active:
        return
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int) or str(path).startswith(_HARMLESS):
            return
        writes = bool(mode and any(c in str(mode) for c in "wax+"))
        writes = writes or bool(isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writes:
            _Audit.events.append((event, str(path)))
    elif event in _MUTATING_EVENTS:
        _Audit.events.append((event, repr(args)[:200]))


@contextmanager
def audited() -> Iterator[list[tuple[str, str]]]:
    if not _Audit.installed:
        sys.addaudithook(_hook)
        _Audit.installed = True
    _Audit.events = []
    _Audit.active = True
    try:
        yield _Audit.events
    finally:
        _Audit.active = False


def _private_home_and_temp(monkeypatch: pytest.MonkeyPatch, base: Path) -> list[Path]:
    """Points the cwd, the temp dir and every cache location read at call time to fresh empty
    directories, so that any file a library (Python, C++ or Rust) drops there is ours."""
    dirs = {name: base / name for name in ("cwd", "tmp", "home", "cache")}
    for path in dirs.values():
        path.mkdir()
    monkeypatch.chdir(dirs["cwd"])
    monkeypatch.setattr(tempfile, "tempdir", str(dirs["tmp"]))
    monkeypatch.setenv("TMPDIR", str(dirs["tmp"]))
    monkeypatch.setenv("HOME", str(dirs["home"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(dirs["cache"]))
    monkeypatch.setenv("TORCH_HOME", str(dirs["cache"] / "torch"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dirs["cache"] / "triton"))
    return list(dirs.values())


def _hub_cache() -> Path:
    # Resolved when huggingface_hub was imported, so it is watched where it really is.
    from huggingface_hub import constants

    return Path(constants.HF_HOME)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` with (size, mtime_ns); a missing root is recorded as such."""
    if not root.exists():
        return {str(root): (-1, -1)}
    seen: dict[str, tuple[int, int]] = {}
    for current, dirs, files in os.walk(root):
        for name in [*files, *dirs, "."]:
            info = os.lstat(os.path.join(current, name))
            seen[os.path.join(current, name)] = (info.st_size, info.st_mtime_ns)
    return seen


@pytest.mark.filterwarnings(SAMPLING_WARNING)
def test_training_run_writes_nothing_to_local_disk(
    train: TrainFn, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec(
        max_train_steps=4,
        checkpointing_steps=1,
        train_text_encoder=True,
        random_flip=True,
        with_prior_preservation=True,
        class_prompt="a photo of a dog",
        num_class_images=2,
        validation_prompt="a photo of sks dog",
        validation_steps=2,
    )
    private = _private_home_and_temp(monkeypatch, tmp_path)
    hub_cache_before = _tree(_hub_cache())
    model_before = _tree(tiny_model_dir)
    blobs: list[bytes] = []
    with audited() as events:
        first = Recorder(stop_at=3)
        stopped, _ = train(spec, recorder=first)
        assert isinstance(stopped, Stopped)
        assert stopped.snapshot is not None
        blobs = [bytes(serialize_checkpoint(s)) for s in first.snapshots]
        blobs.append(bytes(serialize_checkpoint(stopped.snapshot)))
        classes = [TrainingImage(f"{i}.png", png) for i, png in first.class_images]
        finished, _ = train(spec, class_images=classes, resume=load_checkpoint(blobs[-1]))
        assert isinstance(finished, Finished)
    assert events == []
    for directory in private:
        assert list(directory.iterdir()) == [], directory
    assert _tree(_hub_cache()) == hub_cache_before
    # The model directory is only read.
    assert _tree(tiny_model_dir) == model_before
    # The run really did checkpoint, generate and validate in memory.
    assert [s.step for s in first.snapshots] == [1, 2, 3]
    assert len(blobs) == 4
    assert len(first.class_images) == 2
    assert finished.lora_weights


def test_the_audit_hook_sees_writes(tmp_path: Path) -> None:
    """Guards the test above: a write inside the window is recorded."""
    with audited() as events:
        (tmp_path / "x.bin").write_bytes(b"x")
        os.replace(tmp_path / "x.bin", tmp_path / "y.bin")
    assert [e[0] for e in events] == ["open", "os.rename"]
