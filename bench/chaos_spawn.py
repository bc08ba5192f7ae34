"""The stand-in the local provider starts for a benchmark worker (see chaos_forkserver.py).

    python -m bench.chaos_spawn [worker flags...]

Standard library only. Environment: BENCH_FORKSERVER (the server's socket), BENCH_PID_DIR
(where it writes `<provider instance id>` = "<worker pid> <machine id>" for the chaos plan).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys


def main() -> int:
    path = os.environ["BENCH_FORKSERVER"]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    env = dict(os.environ)
    # The chaos plan's bad node: this machine fails every job it is given (a worker flag).
    if env.get("BENCH_BAD_MACHINE") and env.get("LORAFLEET_MACHINE_ID") == env["BENCH_BAD_MACHINE"]:
        env["LORAFLEET_SIMULATE_NODE_FAULT"] = "1"
    request = {"argv": sys.argv[1:], "env": env}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    stream = conn.makefile("rb")
    pid = int(json.loads(stream.readline())["pid"])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    pid_dir = os.environ.get("BENCH_PID_DIR")
    instance = os.environ.get("LORAFLEET_PROVIDER_INSTANCE_ID", "")
    if pid_dir and instance:
        record = os.path.join(pid_dir, instance)
        with open(record + ".tmp", "w") as out:
            out.write(f"{pid} {os.environ.get('LORAFLEET_MACHINE_ID', '')}\n")
        os.replace(record + ".tmp", record)
    line = stream.readline()
    if not line:
        return 1
    status = int(json.loads(line)["status"])
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":
    sys.exit(main())
