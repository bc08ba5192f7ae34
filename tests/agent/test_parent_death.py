"""A supervised worker stops when its supervisor dies, however it dies (no orphans after a
`lorafleet up` killed with -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

# The supervisor: starts the child with its own pid in LORAFLEET_PARENT_PID, prints the child's
# pid, and waits to be killed.
SUPERVISOR = textwrap.dedent(
    """
    import os, subprocess, sys
    env = dict(os.environ, LORAFLEET_PARENT_PID=str(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True)
    print(child.pid, flush=True)
    child.wait()
    """
)
# The child: what worker.main does first, then says so on the shared stdout and waits for its
# SIGTERM (a worker drains on it). Importing the worker takes seconds (torch), longer on a busy
# machine: the test kills the supervisor only once the child is armed.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from lorafleet.worker.main import stop_with_parent
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stop_with_parent(os.environ)
    print("armed", flush=True)
    time.sleep(60)
    """
)


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (its parent died; in a container init may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_supervised_worker_gets_sigterm_when_its_supervisor_is_killed() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, CHILD], stdout=subprocess.PIPE, text=True
    ) as supervisor:
        assert supervisor.stdout is not None
        child_pid = int(supervisor.stdout.readline())
        assert supervisor.stdout.readline().strip() == "armed"
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _exited(child_pid):
            return
        # The child is not ours to reap (its parent died; init adopts it): poll for it to go.
        time.sleep(0.05)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the worker outlived its supervisor")


def test_a_worker_whose_supervisor_died_before_it_was_armed_stops_at_once() -> None:
    """The parent died while the worker was still importing: the parent named in
    LORAFLEET_PARENT_PID is not its parent any more, and it stops instead of training on."""
    not_my_parent = os.getpid() + 1_000_000  # no such process is this child's parent
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=dict(os.environ, LORAFLEET_PARENT_PID=str(not_my_parent)),
        capture_output=True,
        text=True,
        # A bound, not a wait: the child exits as soon as its imports are done, which took over
        # 120 s beside another test suite on a 2-core machine (within pytest's 300 s).
        timeout=240,
    )
    assert child.returncode == 143, child.stderr
    assert "armed" not in child.stdout
