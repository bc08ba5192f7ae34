"""Workers as child processes of this machine: the provider behind `lorafleet up`.

One worker per GPU (pinned with CUDA_VISIBLE_DEVICES), or one CPU worker. Each runs
`python -m lorafleet.worker` in its own session (so a terminal's Ctrl-C reaches only `up`,
which then stops the workers in order), with its output in `<data dir>/logs/`. A worker that
exits on its own is restarted after `core.retry.backoff_delay`: the supervisor is the
provider's "node healing".

The `Provider` verbs, locally: an instance is a slot (`local-<index>`, pinned to GPU <index>);
`restart` restarts its process; `reallocate` stops it and starts the slot afresh under a new
machine id (`<host>-local-<index>.<generation>`), the nearest a single machine comes to
another node (a job banned from the old id may run there); `scale_to(n, remove=...)` stops the
named slots and fills free indexes up to n (shrinking without names stops the highest indexes:
`up`'s own use); there is no deletion cost.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from lorafleet.core.identity import local_identity_token
from lorafleet.core.retry import backoff_delay
from lorafleet.scaler.provider import Instance, InstanceState, StillWanted

log = structlog.get_logger(__name__)


@dataclass(kw_only=True)
class _Slot:
    index: int
    machine_id: str
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    generation: int = 0
    stopping: bool = False
    # Set before an asked-for SIGTERM: start again at once (restart) or as a new machine.
    restart_asked: bool = False
    replace_asked: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)


def detect_gpus() -> int:
    """NVIDIA GPUs on this machine (`nvidia-smi -L`), honouring CUDA_VISIBLE_DEVICES; 0 without.

    Asked of the driver's tool, not of torch: the scaler never imports the training stack.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listed.returncode != 0:
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


class LocalProcessProvider:
    def __init__(
        self,
        *,
        scheduler_address: str,
        worker_token: str,
        log_dir: Path,
        identity_secret: str = "",
        gpus: int,
        extra_env: dict[str, str] | None = None,
        restart_backoff_s: float = 1.0,
        max_restart_backoff_s: float = 60.0,
        worker_argv: Sequence[str] = (sys.executable, "-m", "lorafleet.worker"),
    ) -> None:
        self._scheduler_address = scheduler_address
        self._worker_token = worker_token
        # Shared with the scheduler: each worker gets a token for its own machine id only.
        self._identity_secret = identity_secret
        self._log_dir = log_dir
        self._gpus = gpus
        self._extra_env = dict(extra_env or {})
        self._restart_backoff_s = restart_backoff_s
        self._max_restart_backoff_s = max_restart_backoff_s
        # What a slot runs (tests supervise a stand-in process).
        self._worker_argv = tuple(worker_argv)
        self._slots: dict[int, _Slot] = {}
        self._supervisors: dict[int, asyncio.Task[None]] = {}
        # What `stop()` sends the workers: SIGTERM, or SIGINT once the operator interrupted
        # (`interrupted()`), so that a drain recorded on a job's timeline says what happened.
        self._stop_signal = signal.SIGTERM

    def interrupted(self) -> None:
        """The operator pressed Ctrl-C: `stop()` passes the interrupt on (SIGINT)."""
        self._stop_signal = signal.SIGINT

    def _slot_env(self, index: int, machine_id: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._extra_env)
        env.update(
            LORAFLEET_SCHEDULER=self._scheduler_address,
            LORAFLEET_WORKER_TOKEN=self._worker_token,
            LORAFLEET_MACHINE_ID=machine_id,
            LORAFLEET_PROVIDER_INSTANCE_ID=f"local-{index}",
            # The worker stops when this process dies (worker.main.stop_with_parent).
            LORAFLEET_PARENT_PID=str(os.getpid()),
        )
        if self._identity_secret:
            env["LORAFLEET_IDENTITY_TOKEN"] = local_identity_token(
                self._identity_secret, machine_id
            )
        if self._gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        else:
            env["LORAFLEET_ALLOW_CPU"] = "1"
            env.setdefault("LORAFLEET_DEVICE", "cpu")
        return env

    def _machine_id(self, index: int, generation: int) -> str:
        base = f"{os.uname().nodename}-local-{index}"
        return base if generation == 0 else f"{base}.{generation}"

    def _slot(self, instance_id: str) -> _Slot:
        try:
            return self._slots[int(instance_id.removeprefix("local-"))]
        except (KeyError, ValueError):
            raise KeyError(f"no local instance {instance_id!r}") from None

    async def list_instances(self) -> list[Instance]:
        out = []
        for slot in sorted(self._slots.values(), key=lambda s: s.index):
            if slot.stopping:
                state = InstanceState.STOPPING if slot.process else InstanceState.STOPPED
            elif slot.process is None:
                state = InstanceState.STARTING
            elif slot.process.returncode is not None:
                state = InstanceState.FAILED
            else:
                state = InstanceState.RUNNING
            out.append(
                Instance(
                    instance_id=f"local-{slot.index}",
                    machine_id=slot.machine_id,
                    state=state,
                    restarts=slot.restarts,
                )
            )
        return out

    async def replicas(self) -> int:
        return sum(1 for slot in self._slots.values() if not slot.stopping)

    async def scale_to(
        self, replicas: int, *, remove: Sequence[str] = (), still_wanted: StillWanted | None = None
    ) -> None:
        if replicas < 0:
            raise ValueError("replicas: must be >= 0")
        if self._gpus and replicas > self._gpus:
            raise ValueError(f"replicas: only {self._gpus} GPUs on this machine")
        leaving = [self._slot(i).index for i in remove]
        keep = sorted(i for i in self._slots if i not in leaving)
        # Shrinking without names: the highest indexes go (`up`'s own use).
        leaving += keep[replicas:]
        await asyncio.gather(*(self._remove_slot(i) for i in leaving))
        index = 0
        while len(self._slots) < replicas:
            if index not in self._slots:
                machine_id = self._machine_id(index, 0)
                slot = _Slot(
                    index=index, machine_id=machine_id, env=self._slot_env(index, machine_id)
                )
                self._slots[index] = slot
                self._supervisors[index] = asyncio.create_task(self._supervise(slot))
            index += 1

    async def _remove_slot(self, index: int) -> None:
        await self._stop_slot(self._slots[index], timeout_s=60)
        self._slots.pop(index)
        task = self._supervisors.pop(index)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def restart(self, instance_id: str) -> None:
        """SIGTERM the worker (it drains); the supervisor starts it again at once."""
        slot = self._slot(instance_id)
        if slot.process is not None and slot.process.returncode is None:
            slot.restart_asked = True
            slot.process.send_signal(signal.SIGTERM)

    async def reallocate(self, instance_id: str) -> None:
        """SIGTERM the worker; the slot starts again as a new machine (a new machine id)."""
        slot = self._slot(instance_id)
        slot.replace_asked = True
        if slot.process is not None and slot.process.returncode is None:
            slot.process.send_signal(signal.SIGTERM)

    async def set_deletion_cost(self, instance_id: str, cost: int) -> None:
        """Local slots have no deletion cost: the policy names the slots to stop."""

    async def stop(self, *, timeout_s: float) -> None:
        await asyncio.gather(
            *(
                self._stop_slot(s, timeout_s=timeout_s, sig=self._stop_signal)
                for s in self._slots.values()
            )
        )
        for task in self._supervisors.values():
            task.cancel()
        await asyncio.gather(*self._supervisors.values(), return_exceptions=True)

    async def _stop_slot(
        self, slot: _Slot, *, timeout_s: float, sig: signal.Signals = signal.SIGTERM
    ) -> None:
        slot.stopping = True
        process = slot.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(sig)
        try:
            async with asyncio.timeout(timeout_s):
                await process.wait()
        except TimeoutError:
            log.warning("worker did not drain in time; killing it", machine_id=slot.machine_id)
            process.kill()
            await process.wait()

    async def _supervise(self, slot: _Slot) -> None:
        failures = 0
        self._log_dir.mkdir(parents=True, exist_ok=True)
        while not slot.stopping:
            if slot.replace_asked:
                slot.replace_asked = False
                slot.generation += 1
                slot.machine_id = self._machine_id(slot.index, slot.generation)
                slot.env = self._slot_env(slot.index, slot.machine_id)
            with open(self._log_dir / f"worker-{slot.index}.log", "ab") as output:  # noqa: ASYNC230
                slot.process = await asyncio.create_subprocess_exec(
                    *self._worker_argv,
                    env=slot.env,
                    stdout=output,
                    stderr=output,
                    start_new_session=True,
                )
            log.info("worker started", machine_id=slot.machine_id, pid=slot.process.pid)
            started = asyncio.get_running_loop().time()
            code = await slot.process.wait()
            if slot.stopping:
                break
            if slot.restart_asked or slot.replace_asked:
                slot.restart_asked = False
                log.info("worker stopped on request; starting it again", machine_id=slot.machine_id)
                continue
            # A worker that ran for a while before dying is not crash-looping: back off anew.
            if asyncio.get_running_loop().time() - started > 60:
                failures = 0
            slot.restarts += 1
            delay = backoff_delay(
                failures, initial_s=self._restart_backoff_s, max_s=self._max_restart_backoff_s
            )
            failures += 1
            log.warning(
                "worker exited; restarting",
                machine_id=slot.machine_id,
                exit_code=code,
                restart_in_s=round(delay, 3),
            )
            await asyncio.sleep(delay)
        slot.exited.set()
