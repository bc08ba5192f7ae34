"""The full-size trainer on one GPU: where a step's time goes, and what a warm node saves.

    python bench/bench_gpu.py --model-dir /tmp/sdxl [--json out.json]

Trains the full-size SDXL architecture (random weights, `python -m lorafleet.worker.tiny_model
DIR --preset sdxl --weights-dtype bf16`) at 1024 px, bf16 mixed precision, batch 1, rank 4,
through `Trainer` with one `ResidentModel`, as a worker does, and reports:

* **throughput** (`eager frozen`, `eager trained`): seconds per step over the steps after a
  warm-up, with progress read once a second as the worker does (no host sync a step), for
  frozen and trained text encoders; then the frozen one with the UNet in channels_last and
  with cuDNN's autotuner, each measured on the same resident model;
* **the step's anatomy** (`profile`): over three steps, kernels launched, the GPU's busy time
  (kernel time summed) against wall time, the synchronising CUDA calls, and the host ops that
  cost most; plus any synchronising operation torch's sync debug mode reports in a step;
* **FLOPs and utilisation** (`flops`): one step's FLOPs counted by `torch.utils.flop_counter`,
  over the step's time and the matrix rate measured here (an 8192^3 bf16 product);
* **checkpoint stall** (`checkpoints`): a checkpoint every 5 steps, serialised on another
  thread as the worker does, progress read every step: the training thread's time in the
  snapshot, and how much longer than the median the step after a checkpoint ran (GIL
  contention from serialising included);
* **grant to first step** (`warm start`): a new run of the same shape on the resident model,
  from `Trainer.run` to its first step done on the GPU, against the first (cold) run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer import PROMPT, make_images  # type: ignore[import-not-found]

from lorafleet.core.spec import JobSpec
from lorafleet.worker.training import (
    Finished,
    Trainer,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingSnapshot,
    serialize_checkpoint,
)
from lorafleet.worker.training.resident import ResidentModel

# A step's hooks: called at the poll before each optimizer step with the number of steps done.
StepHook = Callable[[int], None]


def spec_for(*, steps: int, text_encoder: bool, checkpoint_every: int = 10_000) -> JobSpec:
    cuda = torch.cuda.is_available()
    return JobSpec(
        instance_prompt=PROMPT,
        instance_data_prefix="bench",
        max_train_steps=steps,
        resolution=1024 if cuda else 64,
        train_batch_size=1,
        learning_rate=1e-4,
        text_encoder_learning_rate=5e-6,
        train_text_encoder=text_encoder,
        lr_scheduler="constant",
        lora_rank=4,
        lora_alpha=4.0,
        checkpointing_steps=checkpoint_every,
        mixed_precision="bf16" if cuda else "no",
        seed=0,
    )


class Bench:
    def __init__(self, model_dir: Path, images: list[TrainingImage]) -> None:
        self.model_dir = model_dir
        self.images = images
        self.resident = ResidentModel()

    def run(
        self,
        spec: JobSpec,
        *,
        before_step: StepHook | None = None,
        on_checkpoint: Callable[[TrainingSnapshot], None] | None = None,
        progress_interval_s: float = 1.0,
        on_progress: Callable[[int], None] | None = None,
    ) -> Trainer:
        config = TrainingConfig(
            spec=spec,
            model_path=str(self.model_dir),
            local_files_only=True,
            progress_interval_s=progress_interval_s,
        )
        trainer = Trainer(config, self.resident)
        done = [0]

        def should_stop() -> None:
            if before_step is not None:
                before_step(done[0])
            done[0] += 1
            return None

        def progress(step: int, loss: float, lr: float, seconds: float) -> None:
            if on_progress is not None:
                on_progress(step)

        outcome = trainer.run(
            instance_images=self.images,
            hooks=TrainingHooks(
                should_stop=should_stop, on_checkpoint=on_checkpoint, on_progress=progress
            ),
        )
        assert isinstance(outcome, Finished)
        return trainer

    def throughput(self, *, text_encoder: bool, warmup: int, steps: int) -> dict[str, float]:
        """Seconds per step over steps warmup+1..warmup+steps, synchronised only at both ends."""
        marks: dict[str, float] = {}

        def before_step(done: int) -> None:
            if done == warmup:
                sync()
                marks["start"] = time.perf_counter()

        def on_progress(step: int) -> None:
            if step == warmup + steps:  # the last report reads the loss: synchronised
                marks["end"] = time.perf_counter()

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = self.run(
            spec_for(steps=warmup + steps, text_encoder=text_encoder),
            before_step=before_step,
            on_progress=on_progress,
            progress_interval_s=3600.0,
        )
        return {
            "s_per_step": (marks["end"] - marks["start"]) / steps,
            "first_step_s": trainer.timings.step_seconds[0],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30
            if torch.cuda.is_available()
            else 0.0,
        }

    def profile(self, *, warmup: int, steps: int = 3) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        profiler = profile(activities=activities)
        marks: dict[str, float] = {}
        sync_warnings: collections.Counter[str] = collections.Counter()
        original_showwarning = warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
            if "synchroniz" in str(message):
                sync_warnings[f"{Path(filename).name}:{lineno}"] += 1
            else:
                original_showwarning(message, category, filename, lineno)

        def before_step(done: int) -> None:
            if done == warmup:
                sync()
                set_sync_debug_mode("warn")
                warnings.showwarning = record  # type: ignore[assignment]
                profiler.__enter__()  # type: ignore[no-untyped-call]
                marks["start"] = time.perf_counter()
            elif done == warmup + steps:
                sync()
                marks["end"] = time.perf_counter()
                profiler.__exit__(None, None, None)  # type: ignore[no-untyped-call]
                set_sync_debug_mode("default")
                warnings.showwarning = original_showwarning

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            self.run(
                spec_for(steps=warmup + steps + 1, text_encoder=False),
                before_step=before_step,
                progress_interval_s=3600.0,
            )
        events = profiler.events()  # type: ignore[no-untyped-call]
        cuda = torch.autograd.DeviceType.CUDA  # type: ignore[attr-defined]
        kernels = [e for e in events if e.device_type == cuda]
        runtime_calls = collections.Counter(
            e.name for e in events if e.name.startswith(("cuda", "cu")) and e.name[:4] != "cuda_"
        )
        busy_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / steps
        wall_s = (marks["end"] - marks["start"]) / steps
        host_ops = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        kernel_names = collections.Counter(e.name for e in kernels)
        return {
            "wall_s_per_step": wall_s,
            "gpu_busy_s_per_step": busy_s,
            "gpu_busy_fraction": busy_s / wall_s,
            "kernels_per_step": len(kernels) / steps,
            "runtime_calls_per_step": {k: v / steps for k, v in runtime_calls.most_common(12)},
            "sync_warnings": dict(sync_warnings),
            "attention_kernels": sorted(
                {n for n in kernel_names if "flash" in n or "fmha" in n or "attention" in n}
            )[:6],
            "host_ops_table": host_ops,
        }

    def flops(self, *, text_encoder: bool) -> float:
        """FLOPs of one optimizer step (the second), as torch's FLOP counter counts them."""
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)

        def before_step(done: int) -> None:
            if done == 1:
                counter.__enter__()  # type: ignore[no-untyped-call]
            elif done == 2:
                counter.__exit__(None, None, None)  # type: ignore[no-untyped-call]

        self.run(
            spec_for(steps=3, text_encoder=text_encoder),
            before_step=before_step,
            progress_interval_s=3600.0,
        )
        return float(counter.get_total_flops())

    def checkpoints(self, *, steps: int, every: int) -> dict[str, Any]:
        stamps: list[float] = []
        threads: list[threading.Thread] = []

        def on_checkpoint(snapshot: TrainingSnapshot) -> None:
            thread = threading.Thread(target=serialize_checkpoint, args=(snapshot,))
            thread.start()
            threads.append(thread)

        trainer = self.run(
            spec_for(steps=steps, text_encoder=False, checkpoint_every=every),
            on_checkpoint=on_checkpoint,
            progress_interval_s=0.0,
            on_progress=lambda step: stamps.append(time.perf_counter()),
        )
        for thread in threads:
            thread.join()
        durations = {s: stamps[s - 1] - stamps[s - 2] for s in range(2, len(stamps) + 1)}
        after = {s + 1 for s in range(every, steps, every)}
        median = statistics.median(d for s, d in durations.items() if s not in after)
        extra = [durations[s] - median for s in sorted(after) if s in durations]
        snapshot_s = trainer.timings.snapshot_seconds
        return {
            "median_step_s": median,
            "snapshot_s": snapshot_s,
            "step_after_checkpoint_extra_s": extra,
            "stall_fraction_of_step": (statistics.median(snapshot_s) + max(0.0, *extra)) / median,
        }

    def warm_start(self, *, label: str) -> dict[str, float]:
        """From `Trainer.run` to the first step done on the GPU."""
        marks: dict[str, float] = {}

        def before_step(done: int) -> None:
            if done == 1:
                sync()
                marks["first_step"] = time.perf_counter()

        started = time.perf_counter()
        trainer = self.run(
            spec_for(steps=2, text_encoder=False),
            before_step=before_step,
            progress_interval_s=3600.0,
        )
        return {
            f"{label}_grant_to_first_step_s": marks["first_step"] - started,
            **{f"{label}_setup_{k}_s": v for k, v in trainer.timings.setup_seconds.items()},
        }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def set_sync_debug_mode(mode: str) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def matmul_tflops() -> float:
    """The bf16 matrix rate of this GPU, measured: an 8192^3 product, median of 20."""
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


@contextlib.contextmanager
def unet_memory_format(bench: Bench, memory_format: torch.memory_format) -> Iterator[None]:
    unet = bench.resident._held.components.denoiser  # type: ignore[union-attr]
    unet.to(memory_format=memory_format)
    try:
        yield
    finally:
        unet.to(memory_format=torch.contiguous_format)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--only", nargs="*", default=None, help="sections to run (default: all, in order)"
    )
    args = parser.parse_args(argv)
    resolution = 1024 if torch.cuda.is_available() else 64  # without a GPU: a smoke run
    images = [TrainingImage(name, data) for name, data in make_images(4, resolution)]
    bench = Bench(args.model_dir, images)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "matmul_tflops": matmul_tflops(),
    }
    sections: dict[str, Callable[[], Any]] = {
        "warm_start": lambda: {
            **bench.warm_start(label="cold"),
            **bench.warm_start(label="warm"),
        },
        "eager_frozen": lambda: bench.throughput(
            text_encoder=False, warmup=args.warmup, steps=args.steps
        ),
        "eager_trained": lambda: bench.throughput(
            text_encoder=True, warmup=args.warmup, steps=args.steps
        ),
        "checkpoints": lambda: bench.checkpoints(steps=31, every=5),
        "profile": lambda: bench.profile(warmup=args.warmup),
        "flops": lambda: {
            "frozen": bench.flops(text_encoder=False),
            "trained": bench.flops(text_encoder=True),
        },
        "channels_last": lambda: _with(
            unet_memory_format(bench, torch.channels_last),
            lambda: bench.throughput(text_encoder=False, warmup=args.warmup, steps=args.steps),
        ),
        "cudnn_benchmark": lambda: _with(
            _cudnn_benchmark(),
            lambda: bench.throughput(text_encoder=False, warmup=args.warmup, steps=args.steps),
        ),
    }
    for name, section in sections.items():
        if args.only is not None and name not in args.only:
            continue
        started = time.perf_counter()
        try:
            results[name] = section()
        except Exception as exc:  # one broken section must not cost the others' figures
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        table = (
            results[name].pop("host_ops_table", None) if isinstance(results[name], dict) else None
        )
        if table:
            print(table)
        print(f"== {name} ({time.perf_counter() - started:.0f} s): {json.dumps(results[name])}")
        sys.stdout.flush()
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    _summary(results)


def _with(context: contextlib.AbstractContextManager[Any], body: Callable[[], Any]) -> Any:
    with context:
        return body()


@contextlib.contextmanager
def _cudnn_benchmark() -> Iterator[None]:
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = False


def _summary(results: dict[str, Any]) -> None:
    peak = results["matmul_tflops"] * 1e12
    print(f"\n{results['gpu']}, torch {results['torch']}, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    flops = results.get("flops", {})
    for label, key in (("frozen", "eager_frozen"), ("trained", "eager_trained")):
        figures = results.get(key, {})
        step = figures.get("s_per_step")
        if step is None:
            continue
        line = f"eager {label}: {step:.4f} s/step, peak {figures['peak_gib']:.2f} GiB"
        if isinstance(flops.get(label), float):
            line += f", {flops[label] / 1e12:.1f} TFLOP/step, MFU {flops[label] / step / peak:.1%}"
        print(line)
    for key in ("channels_last", "cudnn_benchmark"):
        step = results.get(key, {}).get("s_per_step")
        if step is not None:
            print(f"{key}: {step:.4f} s/step")
    profile = results.get("profile", {})
    if "wall_s_per_step" in profile:
        print(
            f"profile: {profile['kernels_per_step']:.0f} kernels/step, GPU busy"
            f" {profile['gpu_busy_s_per_step']:.4f} of {profile['wall_s_per_step']:.4f} s"
            f" ({profile['gpu_busy_fraction']:.0%}); syncs: {profile['sync_warnings']}"
        )
    checkpoints = results.get("checkpoints", {})
    if "snapshot_s" in checkpoints:
        print(
            f"checkpoints: snapshot {checkpoints['snapshot_s']} s, step after"
            f" {checkpoints['step_after_checkpoint_extra_s']} s extra, median step"
            f" {checkpoints['median_step_s']:.4f} s: stall"
            f" {checkpoints['stall_fraction_of_step']:.1%} of a step"
        )
    warm = results.get("warm_start", {})
    if "warm_grant_to_first_step_s" in warm:
        print(
            f"grant to first step: cold {warm['cold_grant_to_first_step_s']:.2f} s,"
            f" warm {warm['warm_grant_to_first_step_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
