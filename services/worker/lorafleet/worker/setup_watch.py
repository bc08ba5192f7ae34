"""The watch over a lease's preparation: what its run does before its first training step.

Before the first step a run loads the base model (from the hub, maybe), generates class images,
precomputes embeddings and latents, and compiles the step: minutes on a GPU, and a hub download
that cannot succeed would otherwise retry in silence for as long as the library likes. The
training thread tells the watch what it is doing (`phase`, from the trainer's `on_phase` hook,
which may be called again within a phase as a sign of progress, e.g. per file downloaded) and
that it is alive (`sign`: class images made, a notice); the event loop reads it to put a notice
on the job's timeline every `setup_notice_interval_s` and to fail the lease as a node fault once
it showed no progress for `setup_stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from lorafleet.core.model import FailureClass
from lorafleet.worker.training import TrainingFailure

# What a phase name says on the timeline; names not listed are shown as they are.
_PHASES = {
    "starting": "starting the run",
    "decode_images": "decoding the images",
    "load_model": "loading the base model",
    "class_images": "generating class images",
    "precompute": "precomputing the embeddings and latents",
    "compile": "compiling the training step",
}


def describe_phase(name: str) -> str:
    return _PHASES.get(name, name.replace("_", " "))


class SetupStalled(TrainingFailure):
    """The run showed no progress before its first step for the stall timeout: this machine
    cannot prepare it (no network to the hub, a hung load). The job goes elsewhere."""

    def __init__(self, message: str) -> None:
        super().__init__(FailureClass.NODE, message)


@dataclass(frozen=True, kw_only=True)
class SetupState:
    phase: str
    phase_s: float  # in this phase
    quiet_s: float  # since the last sign of progress
    stepped: bool  # a training step was reported: the preparation is over


class SetupWatch:
    """Written by the training thread, read by the event loop; each call holds a lock for a
    few assignments (correct on a free-threaded interpreter too)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._phase = "starting"
        self._phase_since = now
        self._last_sign = now
        self._stepped = False

    def phase(self, name: str) -> None:
        """The run entered `name`, or shows progress within it (the same name again)."""
        with self._lock:
            now = self._clock()
            if name != self._phase:
                self._phase, self._phase_since = name, now
            self._last_sign = now

    def sign(self) -> None:
        with self._lock:
            self._last_sign = self._clock()

    def stepped(self) -> None:
        with self._lock:
            self._stepped = True
            self._last_sign = self._clock()

    def state(self) -> SetupState:
        with self._lock:
            now = self._clock()
            return SetupState(
                phase=self._phase,
                phase_s=now - self._phase_since,
                quiet_s=now - self._last_sign,
                stepped=self._stepped,
            )

    async def watch(
        self,
        *,
        notice: Callable[[str], Awaitable[None]],
        notice_interval_s: float,
        stall_timeout_s: float,
    ) -> None:
        """Until the run's first step (event loop): `notice` every `notice_interval_s` saying
        what it is doing (the timeline of a job whose node is still downloading the model is
        never silent), and `SetupStalled` once it showed no progress for `stall_timeout_s`."""
        while True:
            state = self.state()
            if state.stepped:
                return
            if state.quiet_s >= stall_timeout_s:
                raise SetupStalled(
                    f"no progress for {state.quiet_s:.0f} s while {describe_phase(state.phase)}"
                    f" (setup_stall_timeout_s {stall_timeout_s:g}); this machine could not"
                    " prepare the run, e.g. no network to the model's hub"
                )
            # Wakes for the next notice, or when the stall bound would be reached.
            await asyncio.sleep(min(notice_interval_s, stall_timeout_s - state.quiet_s))
            state = self.state()
            if state.stepped:
                return
            if state.quiet_s < stall_timeout_s:
                await notice(
                    f"preparing: {describe_phase(state.phase)} for {state.phase_s:.0f} s"
                    " (no training step yet)"
                )
