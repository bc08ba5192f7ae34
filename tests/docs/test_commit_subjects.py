"""`.ci/check-subjects`, CI's rule for commit subjects, on a real git repository: a subject over
72 characters after the baseline fails the run, naming the commit; history before the baseline
is never judged (62 of the project's old subjects are longer)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / ".ci" / "check-subjects"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def _commit(repo: Path, subject: str, body: str = "") -> str:
    args = ["commit", "-q", "--allow-empty", "-m", subject]
    if body:
        args += ["-m", body]
    _git(repo, *args)
    return _git(repo, "rev-parse", "HEAD")


def _check(repo: Path, base: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHECK), base], cwd=repo, capture_output=True, text=True, check=False, timeout=30
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    return tmp_path


def test_only_commits_after_the_baseline_are_judged(repo: Path) -> None:
    _commit(repo, "an old subject from before the rule " + "x" * 100)
    base = _commit(repo, "the baseline")
    _commit(repo, "a" * 72, body="the detail goes in the body " * 10)
    done = _check(repo, base)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_long_subject_after_the_baseline_fails(repo: Path) -> None:
    base = _commit(repo, "the baseline")
    _commit(repo, "fine")
    long = _commit(repo, "b" * 73)
    done = _check(repo, base)
    assert done.returncode == 1
    assert f"commit {long[:7]}" in done.stdout
    assert "73 characters" in done.stdout


def test_characters_are_counted_not_bytes(repo: Path) -> None:
    base = _commit(repo, "the baseline")
    _commit(repo, "é" * 72)  # 144 bytes
    assert _check(repo, base).returncode == 0


def test_an_unknown_baseline_fails_loudly(repo: Path) -> None:
    _commit(repo, "c" * 100)
    assert _check(repo, "no-such-ref").returncode != 0
