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
# The child: what worker.main does first, then waits for its SIGTERM (a worker drains on it).
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from lorafleet.worker.main import stop_with_parent
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stop_with_parent(os.environ)
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
