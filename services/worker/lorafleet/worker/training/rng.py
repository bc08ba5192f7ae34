"""The run's own torch random stream, kept apart from the process-wide generators.

Training draws its noise, timesteps, crops, flips and data order from explicit generators
(`torch.Generator`s owned by the run). A few torch ops take no generator and draw from torch's
default one: peft's LoRA initialisation and dropout (`lora_dropout`). For those the run keeps a
`TorchRngStream`: its own generator state, swapped into torch's default generator only while
the run's code executes (`with stream.active():`) and swapped out again afterwards, so

* the process-wide generators (Python's `random`, NumPy's, torch's) are never seeded with the
  job's seed nor restored from a checkpoint: other libraries drawing from them (OpenTelemetry's
  span ids come from Python's `random`) see nothing of the job;
* the stream's state is part of every checkpoint, and a resumed run draws the same numbers.

Gradient checkpointing keeps working: torch's checkpoint saves and restores the default
generator's state around recomputation, which inside `active()` is the run's stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class TorchRngStream:
    """A torch default-generator state (CPU, and the run's CUDA device) owned by one run."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        # Seeding a fresh generator gives exactly the state torch.manual_seed would set.
        self.cpu_state = torch.Generator("cpu").manual_seed(seed).get_state()
        self.device_state = (
            torch.Generator(device).manual_seed(seed).get_state() if device.type == "cuda" else None
        )

    @property
    def device_key(self) -> str | None:
        """Checkpoint tensor name of the device state (None on the CPU)."""
        return f"rng/cuda/{self.device.index or 0}" if self.device_state is not None else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Torch's default generators draw from this stream inside the block; the process's
        own states are put back on leaving it (also on an exception)."""
        saved_cpu = torch.get_rng_state()
        saved_device = None
        torch.set_rng_state(self.cpu_state)
        if self.device_state is not None:
            saved_device = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.device_state, self.device)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if saved_device is not None:
                self.device_state = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved_device, self.device)
