"""Worker processes without paying their imports each time: a fork server for the benchmark.

A worker process imports torch, diffusers and grpc: about 6 CPU-seconds on the benchmark's
two cores, and the chaos plan kills and restarts workers hundreds of times. This server
imports `lorafleet.worker.main` once and forks a fresh worker process per request. The child
is a real, separate worker process (its own session, environment, stdio, event loop, gRPC
channel); a SIGKILL of the chaos plan goes to it by pid.

The local provider (`lorafleet.scaler.local.LocalProcessProvider`) starts the stand-in
`python -m bench.chaos_spawn` (standard library only, starts in milliseconds) in place of
`python -m lorafleet.worker`. It sends its argv, environment and stdio descriptors here, gets
the worker's pid, forwards SIGTERM/SIGINT to it, and exits the way the worker did (a worker
killed by a signal: the stand-in kills itself with that signal), so the provider supervises
it exactly as it would the worker. A stand-in that disappears takes its worker with it.

    python -m bench.chaos_forkserver SOCKET_PATH
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys

_MAX_MESSAGE = 1 << 20


def _child(sockets: list[socket.socket], request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: become the worker. Never returns."""
    code = 1
    try:
        for sock in sockets:
            sock.close()
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        # This server is the worker's parent, not the provider that named itself there; the
        # harness stops its workers itself.
        os.environ.pop("LORAFLEET_PARENT_PID", None)
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        sys.argv = ["lorafleet worker", *argv]
        from lorafleet.worker.main import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    # Everything a worker imports, once; frozen so the children's refcounting touches fewer
    # shared pages.
    import lorafleet.worker.main  # noqa: F401

    gc.collect()
    gc.freeze()
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    by_conn: dict[int, int] = {}
    print("forkserver ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                msg, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
                request = json.loads(msg.decode())
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _child([conn, listener, *children.values()], request, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = conn
                by_conn[conn.fileno()] = pid
                selector.register(conn, selectors.EVENT_READ)
            else:
                # The stand-in went away (it only ever reads): its worker goes with it.
                stand_in = key.fileobj
                assert isinstance(stand_in, socket.socket)
                pid = by_conn.pop(stand_in.fileno(), 0)
                selector.unregister(stand_in)
                if pid and pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            waiting = children.pop(pid, None)
            if waiting is None:
                continue
            conn = waiting
            by_conn.pop(conn.fileno(), None)
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
