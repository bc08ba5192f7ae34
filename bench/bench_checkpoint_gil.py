"""What serialising a full-size checkpoint costs the training thread beside it (the GIL).

    .venv/bin/python bench/bench_checkpoint_gil.py [--mb 90] [--repeats 5]

A snapshot of `--mb` MB in 6720 fp32 tensors (the count and size of an SDXL rank-4 LoRA's
weights and AdamW state), packed on the host as `to_host` packs it, is serialised on a second
thread, as the worker's uploader does, while the main thread runs a stand-in for a training
step's host work: small torch ops back to back (a GPU step is ~17k kernel launches, each a short
Python-and-dispatcher call that needs the GIL). Reported per way of building the blob, median
(min-max) of `--repeats` runs: the serialisation's wall time, the longest the training thread
went without an op done, and the ops it lost against its own idle rate over the same window.

Ways: `join` (before: `checkpoint_parts` joined into one `bytes`, which holds the GIL for the
whole copy when the parts are memoryviews) and `serialize_checkpoint` (now: the same parts
copied by numpy into uninitialised memory, which releases it). Both make the same bytes
(checked). Both hash the data first (hashlib releases the GIL for it).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

from lorafleet.worker.training import TrainingSnapshot, serialize_checkpoint
from lorafleet.worker.training.checkpoint import checkpoint_parts, to_host

TENSORS = 6720


def snapshot_of(megabytes: float) -> TrainingSnapshot:
    """LoRA-like tensors: rank-4 down and up projections of a few widths."""
    generator = torch.Generator().manual_seed(0)
    widths = (320, 640, 1280, 2048)
    per_tensor = megabytes * 2**20 / 4 / TENSORS
    scale = per_tensor / statistics.mean(4 * w for w in widths)
    tensors = {}
    for i in range(TENSORS):
        width = max(1, round(widths[i % len(widths)] * scale))
        shape = (4, width) if i % 2 else (width, 4)
        tensors[f"unet.{i // 4}.lora_{'AB'[i % 2]}.{i}"] = torch.randn(shape, generator=generator)
    return TrainingSnapshot(step=100, tensors=to_host(tensors), state={"epoch": 1})


def training_thread_cost(serialise: Callable[[], object]) -> tuple[float, float, float]:
    """(serialisation s, longest gap between ops s, ops lost vs the idle rate) for one run."""
    x = torch.ones(64)
    done = threading.Event()
    result: list[float] = []

    def serialiser() -> None:
        started = time.perf_counter()
        serialise()
        result.append(time.perf_counter() - started)
        done.set()

    # Idle rate first, the same loop.
    ops, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.2:
        x.mul_(1.0000001)
        ops += 1
    idle_rate = ops / (time.perf_counter() - started)
    thread = threading.Thread(target=serialiser)
    ops, longest = 0, 0.0
    window_start = last = time.perf_counter()
    thread.start()
    while not done.is_set():
        x.mul_(1.0000001)
        ops += 1
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    window = time.perf_counter() - window_start
    thread.join()
    return result[0], longest, max(0.0, idle_rate * window - ops) / idle_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=90.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    snapshot = snapshot_of(args.mb)
    new = serialize_checkpoint(snapshot)
    print(f"blob {len(new) / 2**20:.1f} MB, {TENSORS} tensors", flush=True)
    ways: dict[str, Callable[[], object]] = {
        "join": lambda: b"".join(checkpoint_parts(snapshot)),
        "serialize_checkpoint": lambda: serialize_checkpoint(snapshot),
    }
    assert b"".join(checkpoint_parts(snapshot)) == new
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
    for _ in range(args.repeats):  # interleaved, so both ways see the same machine
        for name, serialise in ways.items():
            figures[name].append(training_thread_cost(serialise))
    print("| way | serialise s | longest training-thread gap ms | training ops lost, s |")
    print("|---|---|---|---|")
    for name, runs in figures.items():
        columns = []
        for index, scale in ((0, 1.0), (1, 1000.0), (2, 1.0)):
            values = [run[index] * scale for run in runs]
            columns.append(f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        print(f"| {name} | " + " | ".join(columns) + " |")
    base, now = (statistics.median(r[1] for r in figures[n]) for n in ways)
    print(f"\nlongest gap, serialize_checkpoint / join: {now / base:.2f}")


if __name__ == "__main__":
    main()
