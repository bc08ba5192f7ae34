"""Workers as child processes of this machine: the provider behind `lorafleet up`.

One worker per GPU (pinned with CUDA_VISIBLE_DEVICES), or one CPU worker. Each runs
`python -m lorafleet.worker` in its own session (so a terminal's Ctrl-C reaches only `up`,
which then stops the workers in order), with its output in `<data dir>/logs/`. A worker that
exits on its own is restarted with backoff: the supervisor is the provider's "node healing".
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from lorafleet.scaler.provider import Instance, InstanceState

log = structlog.get_logger(__name__)


@dataclass(kw_only=True)
class _Slot:
    index: int
    machine_id: str
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    stopping: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)


def detect_gpus() -> int:
    """CUDA devices visible to torch, or 0 without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


class LocalProcessProvider:
    def __init__(
        self,
        *,
        scheduler_address: str,
        worker_token: str,
        log_dir: Path,
        gpus: int,
        extra_env: dict[str, str] | None = None,
        restart_backoff_s: float = 1.0,
        max_restart_backoff_s: float = 60.0,
    ) -> None:
        self._scheduler_address = scheduler_address
        self._worker_token = worker_token
        self._log_dir = log_dir
        self._gpus = gpus
        self._extra_env = dict(extra_env or {})
        self._restart_backoff_s = restart_backoff_s
        self._max_restart_backoff_s = max_restart_backoff_s
        self._slots: dict[int, _Slot] = {}
        self._supervisors: dict[int, asyncio.Task[None]] = {}

    def _slot_env(self, index: int, machine_id: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._extra_env)
        env.update(
            LORAFLEET_SCHEDULER=self._scheduler_address,
            LORAFLEET_WORKER_TOKEN=self._worker_token,
            LORAFLEET_MACHINE_ID=machine_id,
            LORAFLEET_PROVIDER_INSTANCE_ID=f"local-{index}",
        )
        if self._gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
        else:
            env["LORAFLEET_ALLOW_CPU"] = "1"
            env.setdefault("LORAFLEET_DEVICE", "cpu")
        return env

    async def list_instances(self) -> list[Instance]:
        out = []
        for slot in self._slots.values():
            if slot.stopping:
                state = InstanceState.STOPPING if slot.process else InstanceState.STOPPED
            elif slot.process is None or slot.process.returncode is not None:
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

    async def scale_to(self, replicas: int) -> None:
        if self._gpus and replicas > self._gpus:
            raise ValueError(f"replicas: only {self._gpus} GPUs on this machine")
        for index in range(replicas):
            if index not in self._slots:
                machine_id = f"{os.uname().nodename}-local-{index}"
                slot = _Slot(
                    index=index, machine_id=machine_id, env=self._slot_env(index, machine_id)
                )
                self._slots[index] = slot
                self._supervisors[index] = asyncio.create_task(self._supervise(slot))
        for index in [i for i in self._slots if i >= replicas]:
            await self._stop_slot(self._slots.pop(index), timeout_s=60)
            self._supervisors.pop(index).cancel()

    async def reallocate(self, instance_id: str) -> None:
        index = int(instance_id.removeprefix("local-"))
        slot = self._slots[index]
        if slot.process is not None and slot.process.returncode is None:
            slot.process.send_signal(signal.SIGTERM)  # the supervisor starts a fresh one

    async def stop(self, *, timeout_s: float) -> None:
        await asyncio.gather(
            *(self._stop_slot(s, timeout_s=timeout_s) for s in self._slots.values())
        )
        for task in self._supervisors.values():
            task.cancel()
        await asyncio.gather(*self._supervisors.values(), return_exceptions=True)

    async def _stop_slot(self, slot: _Slot, *, timeout_s: float) -> None:
        slot.stopping = True
        process = slot.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            log.warning("worker did not drain in time; killing it", machine_id=slot.machine_id)
            process.kill()
            await process.wait()

    async def _supervise(self, slot: _Slot) -> None:
        backoff = self._restart_backoff_s
        self._log_dir.mkdir(parents=True, exist_ok=True)
        while not slot.stopping:
            with open(self._log_dir / f"worker-{slot.index}.log", "ab") as output:  # noqa: ASYNC230
                slot.process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "lorafleet.worker",
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
            # A worker that ran for a while before dying is not crash-looping: back off anew.
            if asyncio.get_running_loop().time() - started > 60:
                backoff = self._restart_backoff_s
            slot.restarts += 1
            log.warning(
                "worker exited; restarting",
                machine_id=slot.machine_id,
                exit_code=code,
                restart_in_s=backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(self._max_restart_backoff_s, backoff * 2)
        slot.exited.set()
