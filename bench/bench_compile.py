"""Regional against whole-model compilation of the trainer's step: cold compile and step time.

    .venv/bin/python bench/bench_compile.py --families sdxl flux flux2 --steps 8
    python3 bench/bench_compile.py --device cuda --families sdxl --model-dir /tmp/sdxl \
        --gradient-checkpointing --steps 10   # on a GPU, the full-size model (gpu_session.sh)

Per family, lorafleet's `Trainer` trains the family's random model (`build_tiny_model` at
`--preset`, tiny by default, or `--model-dir`; on CUDA in bf16 mixed precision at 1024 px),
text encoders frozen (the default job: the step compiles the denoiser, compiled_step.py;
`--text-encoder` trains them, below), once per mode:

* `eager`: not compiled (the baseline of the step time);
* `whole`: `torch.compile` of the whole denoiser, as the trainer compiled it before regional
  compilation (patched in here; the trainer has one way);
* `regional`: the trainer's own `CompiledBlocks` (the denoiser's repeated blocks).

With `--text-encoder`, `whole` is the trainer's own one graph from the prompt's token ids to the
loss, and `regional` the denoiser's `CompiledBlocks` with the encoders eager (patched in here).

Each mode runs in a fresh subprocess with an empty inductor cache (`TORCHINDUCTOR_CACHE_DIR`
and the run's `compile_cache_dir`), so its first step pays a cold compile. Reported per run:
the first step's wall and CPU seconds beyond a later step's (the compile: CPU of this process
and its finished children, from `resource.getrusage`: on a shared machine the wall time is
noisy, the CPU time less so), the median wall and CPU seconds of steps 2..N, and the ratios
whole / regional. `--rounds N` runs the modes N times in turn and reports each figure's median
over the rounds. `--json FILE` writes every run's figures.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

FAMILIES = ("sdxl", "flux", "flux2")
MODES = ("eager", "whole", "regional")
PROMPT = "a photo of sks dog"


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _images(count: int, resolution: int) -> list[Any]:
    import numpy as np
    from PIL import Image

    from lorafleet.worker.training import TrainingImage

    rng = np.random.default_rng(0)
    out = []
    for index in range(count):
        array = rng.integers(0, 256, size=(resolution, resolution, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(array, "RGB").save(buffer, format="PNG")
        out.append(TrainingImage(f"img{index}.png", buffer.getvalue()))
    return out


def _use_whole_model_compile() -> None:
    """The trainer's denoiser compile as it was before regional compilation."""
    import torch

    from lorafleet.worker.training import compiled_step, loop

    def whole(config: Any, resident: Any, components: Any) -> Any:
        compiled_step._use_cache_dir(config)
        return resident.compiled(
            config.spec.compiled_shape_key, lambda: torch.compile(components.denoiser)
        )

    loop.compiled_denoiser = whole  # type: ignore[attr-defined]


def _use_regional_loss_compile() -> None:
    """With trained text encoders: the denoiser's blocks compiled, the encoders and the rest of
    the loss eager (the alternative to the trainer's one graph from token ids to the loss)."""
    from lorafleet.worker.training import compiled_step, loop

    def regional(config: Any, resident: Any, components: Any, loss_from_token_ids: Any) -> Any:
        compiled_step._use_cache_dir(config)
        resident.compiled(
            config.spec.compiled_shape_key,
            lambda: compiled_step.CompiledBlocks(components.denoiser),
        )
        return loss_from_token_ids

    loop.compiled_loss = regional  # type: ignore[attr-defined]


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this (fresh) process; returns its figures."""
    import torch

    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.training import Trainer, TrainingConfig, TrainingHooks

    gpu = args.device == "cuda"
    if args.text_encoder and args.mode == "regional":
        _use_regional_loss_compile()
    elif not args.text_encoder and args.mode == "whole":
        _use_whole_model_compile()
    family_fields: dict[str, Any] = (
        {}
        if args.family == "sdxl"
        else {"model_family": args.family, "base_model": str(args.model_dir)}
    )
    spec = JobSpec(
        instance_prompt=PROMPT,
        instance_data_prefix="bench",
        max_train_steps=args.steps,
        resolution=1024 if gpu else 64,
        train_batch_size=1,
        learning_rate=1e-4,
        train_text_encoder=args.text_encoder,
        lr_scheduler="constant",
        lora_rank=args.rank,
        lora_alpha=float(args.rank),
        checkpointing_steps=args.steps,
        mixed_precision="bf16" if gpu else "no",
        gradient_checkpointing=args.gradient_checkpointing,
        seed=0,
        **family_fields,
    )
    config = TrainingConfig(
        spec=spec,
        model_path=str(args.model_dir),
        local_files_only=True,
        device=args.device,
        compile_model=args.mode != "eager",
        compile_cache_dir=os.environ["LORAFLEET_BENCH_CACHE"],
    )
    stamps: list[tuple[float, float]] = []

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def on_phase(name: str) -> None:
        if name == "optimizer":  # the last setup phase before the steps (no resume here)
            sync()
            stamps.append((time.perf_counter(), _cpu_seconds()))

    def on_progress(step: int, loss: float, lr: float, seconds: float) -> None:
        sync()
        stamps.append((time.perf_counter(), _cpu_seconds()))

    Trainer(config).run(
        instance_images=_images(4, spec.resolution),
        hooks=TrainingHooks(on_progress=on_progress, on_phase=on_phase),
    )
    # stamps[0] is taken as the optimizer phase begins (the compile happens in step 1).
    walls = [b[0] - a[0] for a, b in itertools.pairwise(stamps)]
    cpus = [b[1] - a[1] for a, b in itertools.pairwise(stamps)]
    step_s, step_cpu_s = statistics.median(walls[1:]), statistics.median(cpus[1:])
    return {
        "family": args.family,
        "mode": args.mode,
        "text_encoder": args.text_encoder,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "compile_s": walls[0] - step_s,
        "compile_cpu_s": cpus[0] - step_cpu_s,
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "steps_s": walls,
        "steps_cpu_s": cpus,
    }


# `--deep`: the tiny FLUX models with this many double- and single-stream blocks (2 and 2
# otherwise; FLUX.1-dev has 19 and 38, FLUX.2 [klein] 4B 5 and 20), about the tiny SDXL's 11
# transformer blocks: what regional compilation saves grows with the blocks a model repeats.
DEEP_FLUX_BLOCKS = (4, 8)


def _model_dir(family: str, preset: str, work: Path, *, deep: bool) -> Path:
    import dataclasses

    from lorafleet.worker.tiny_model import Family, build_tiny_model
    from lorafleet.worker.tiny_models import flux, flux2

    deep = deep and family != "sdxl"
    directory = work / f"{family}-{preset}{'-deep' if deep else ''}"
    if not (directory / "model_index.json").is_file():
        if deep:
            presets: Any = flux.PRESETS if family == "flux" else flux2.PRESETS
            double, single = DEEP_FLUX_BLOCKS
            presets[preset] = dataclasses.replace(
                presets[preset], num_layers=double, num_single_layers=single
            )
        build_tiny_model(directory, family=cast(Family, family), preset=preset)
    return directory


def run_child(args: argparse.Namespace, family: str, mode: str, model_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as cache:
        env = {
            **os.environ,
            "LORAFLEET_BENCH_CACHE": cache,
            "TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "inductor"),
        }
        argv = [
            sys.executable,
            __file__,
            "--child",
            f"--family={family}",
            f"--mode={mode}",
            f"--model-dir={model_dir}",
            f"--device={args.device}",
            f"--steps={args.steps}",
            f"--rank={args.rank}",
        ]
        if args.gradient_checkpointing:
            argv.append("--gradient-checkpointing")
        if args.text_encoder:
            argv.append("--text-encoder")
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{family} {mode}: exit {done.returncode}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result


FIGURES = ("compile_s", "compile_cpu_s", "step_s", "step_cpu_s")


def report(results: list[dict[str, Any]]) -> None:
    """Per family and mode the median of its rounds' figures, and the ratios."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["family"], r["mode"]), []).append(r)
    by = {
        key: {f: statistics.median(r[f] for r in rounds) for f in FIGURES}
        for key, rounds in runs.items()
    }
    print(
        f"{'family':7} {'mode':8} {'rounds':>6} {'compile s':>9} {'cpu s':>8} {'step s':>8}"
        f" {'cpu s':>8}",
        flush=True,
    )
    for (family, mode), m in by.items():
        print(
            f"{family:7} {mode:8} {len(runs[family, mode]):6} {m['compile_s']:9.1f}"
            f" {m['compile_cpu_s']:8.1f} {m['step_s']:8.4f} {m['step_cpu_s']:8.4f}"
        )
    for family in dict.fromkeys(r["family"] for r in results):
        whole, regional = by.get((family, "whole")), by.get((family, "regional"))
        if whole is None or regional is None:
            continue
        eager = by.get((family, "eager"))
        line = (
            f"{family}: whole/regional compile {whole['compile_s'] / regional['compile_s']:.2f}x"
            f" (cpu {whole['compile_cpu_s'] / regional['compile_cpu_s']:.2f}x),"
            f" step regional/whole {regional['step_s'] / whole['step_s']:.3f}"
            f" (cpu {regional['step_cpu_s'] / whole['step_cpu_s']:.3f})"
        )
        if eager is not None:
            line += f", step regional/eager {regional['step_s'] / eager['step_s']:.3f}"
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", default=None, help="model preset (default: tiny on the CPU)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each mode, interleaved; medians reported"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--text-encoder",
        action="store_true",
        help="train the text encoders (sdxl, flux): whole is the trainer's one graph from token"
        " ids to the loss, regional the denoiser's blocks with the encoders eager",
    )
    parser.add_argument(
        "--deep", action="store_true", help=f"FLUX models with {DEEP_FLUX_BLOCKS} blocks"
    )
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-compile")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument(
        "--model-dir", type=Path, help="the model to train (one family; default: built here)"
    )
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    results = []
    for family in args.families:
        model_dir = args.model_dir or _model_dir(
            family, args.preset or "tiny", args.work, deep=args.deep
        )
        for _, mode in itertools.product(range(args.rounds), args.modes):
            result = run_child(args, family, mode, model_dir)
            print(json.dumps(result), flush=True)
            results.append(result)
            if args.json is not None:  # after each run: a run past a time limit keeps the rest
                args.json.write_text(json.dumps(results, indent=1))
    report(results)


if __name__ == "__main__":
    main()
