"""lorafleet's trainer against diffusers' DreamBooth-LoRA scripts, same model, same run.

    /work/venv/bin/python bench/bench_trainer.py \\
        --reference /tmp/train_dreambooth_lora_sdxl.py --steps 40
    /work/bench-venv/bin/python bench/bench_trainer.py --family flux2 \\
        --reference /tmp/train_dreambooth_lora_flux2_klein.py --steps 24

The reference is the family's script from huggingface/diffusers' `examples/dreambooth/` (not
part of this repository: pass its path): `train_dreambooth_lora_sdxl.py` (`--family sdxl`, the
default), `train_dreambooth_lora_flux.py` (`flux`, FLUX.1) or `train_dreambooth_lora_flux2_klein.py`
(`flux2`, FLUX.2 [klein]). Both train the same randomly initialised model of the family's
architecture (`lorafleet.worker.tiny_model`), on the same generated images, with the same
hyperparameters (batch 1, constant LR, rank 4 (16 for flux and flux2 on a GPU), alpha = rank,
seed 0), with and without text-encoder training (SDXL, FLUX.1's CLIP; FLUX.2 [klein]'s Qwen3
is never trained). The flow-matching scripts get what makes them train as lorafleet does:
`--cache_latents` (lorafleet always encodes the images once), the pipeline's guidance 3.5 and
512-token prompts (both their defaults), and for klein `--text_encoder_out_layers 9 18 27`
(the script's default 10 20 30 is FLUX.2 [dev]'s; `Flux2KleinPipeline` reads 9, 18, 27).
Reported, per trainer:

* median seconds per optimizer step over steps 2..N (checkpoint steps excluded), and the ratio
  reference / lorafleet;
* the training stall per checkpoint: for lorafleet the time the training thread spends taking
  the host snapshot (serialising happens on another thread, as the worker does it); for the
  reference the extra time of the step that saves `accelerator.save_state` to disk;
* bytes written to local disk during the run: /proc/self/io `write_bytes` plus every
  Python-level open for writing (audit hook) for lorafleet; the output directory the reference
  leaves (checkpoints and LoRA) for it;
* the size of the final LoRA file;
* peak memory: on CUDA `torch.cuda.max_memory_allocated`; on the CPU the peak resident set of
  the process while it trains (the reference's own process; for lorafleet, which runs in this
  process, the high-water mark reset through /proc/self/clear_refs just before the run, so it
  counts this process's baseline, imports and the images included, as the script's does).

The reference runs in a subprocess under a small harness that timestamps its "Steps" progress
bar. Its `torchvision` import (used only for image transforms at dataset creation) is satisfied
by a PIL-based shim when torchvision cannot be imported (the CPU torch build here has no
matching torchvision on PyPI); transformers and diffusers are imported first so that they
never see the shim.

`--gpu` trains the family's full-size architecture (`--preset`; by default SDXL, FLUX.1-dev or
FLUX.2 [klein] 4B; random weights, bf16 files) at 1024 px in bf16 mixed precision on CUDA, and
reports each run's peak GPU memory (`torch.cuda.max_memory_allocated`).
`--gradient-checkpointing` turns it on in both trainers. `--base-quantization nf4` loads the
frozen transformer in bitsandbytes 4-bit NF4 (lorafleet's `base_quantization`; the klein script's
`--bnb_quantization_config_path` with the same config; FLUX.1's script has no quantization
option, so with nf4 only lorafleet runs for `flux`). `--json-file` writes every run's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from lorafleet.core.spec import JobSpec
from lorafleet.worker.tiny_model import Family, build_tiny_model
from lorafleet.worker.training import (
    Finished,
    Trainer,
    TrainingConfig,
    TrainingHooks,
    TrainingImage,
    TrainingSnapshot,
    serialize_checkpoint,
)

PROMPT = "a photo of sks dog"

FAMILIES = ("sdxl", "flux", "flux2")
# The full-size preset a family measures on a GPU by default (lorafleet.worker.tiny_model).
GPU_PRESETS = {"sdxl": "sdxl", "flux": "flux-dev", "flux2": "klein-4b"}
# Every FLUX.2 [klein] pipeline encodes prompts with Qwen3 layers 9, 18 and 27 (the klein
# script's own default is FLUX.2 [dev]'s 10, 20, 30: diffusers issue #13445).
KLEIN_TEXT_ENCODER_LAYERS = (9, 18, 27)
# bitsandbytes' 4-bit NF4 as the QLoRA recipe sets it (the script fills in the compute dtype).
NF4_CONFIG = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}

# Runs the reference script with its progress bar timestamped. argv: script, times.json, args...
_HARNESS = """
import json, os, runpy, sys, time
import tqdm.auto

times = []

class TimedTqdm(tqdm.auto.tqdm):
    def update(self, n=1):
        if self.desc == "Steps":
            times.append((time.perf_counter(), time.process_time()))
        return super().update(n)

tqdm.auto.tqdm = TimedTqdm
peak = reserved = None


def peak_rss():
    # VmHWM, this address space's own peak: getrusage's ru_maxrss would carry the forking
    # parent's peak across the exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


# Settle every library's "is torchvision installed" check before the shim is importable.
import transformers.utils.import_utils as transformers_imports
import diffusers, peft, accelerate, torch
transformers_imports.is_torchvision_available()
if {threads}:
    torch.set_num_threads({threads})
shim = {shim!r}
if shim:
    sys.path.insert(0, shim)
script, out = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
# --memory-cap-gib: the same cap as lorafleet's run.
if "LORAFLEET_BENCH_MEMORY_CAP_GIB" in os.environ:
    cap = float(os.environ["LORAFLEET_BENCH_MEMORY_CAP_GIB"]) * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
try:
    runpy.run_path(script, run_name="__main__")
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
finally:
    with open(out, "w") as f:
        json.dump({{"times": times, "peak_gpu_bytes": peak, "peak_gpu_reserved_bytes": reserved,
                   "peak_rss_bytes": peak_rss()}}, f)
"""

# The torchvision surface the reference script uses, on PIL.
_SHIM_FILES = {
    "torchvision/__init__.py": "from . import transforms\n",
    "torchvision/transforms/functional.py": """
def crop(img, top, left, height, width):
    return img.crop((left, top, left + width, top + height))


# The klein script's dataset calls the functional forms; they reuse the classes below.
def resize(img, size, interpolation=None):
    from . import _PIL, InterpolationMode

    height, width = size  # the klein script passes [height, width]
    return img.resize((width, height), _PIL[interpolation or InterpolationMode.BILINEAR])


def center_crop(img, size):
    from . import CenterCrop

    return CenterCrop(size)(img)


def hflip(img):
    from PIL import Image

    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


def to_tensor(pic):
    from . import ToTensor

    return ToTensor()(pic)


def normalize(tensor, mean, std):
    from . import Normalize

    return Normalize(mean, std)(tensor)
""",
    "torchvision/transforms/__init__.py": """
import enum
import numpy as np
import torch
import torch
from PIL import Image
from . import functional


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


_PIL = {
    InterpolationMode.NEAREST: Image.Resampling.NEAREST,
    InterpolationMode.BILINEAR: Image.Resampling.BILINEAR,
    InterpolationMode.BICUBIC: Image.Resampling.BICUBIC,
    InterpolationMode.LANCZOS: Image.Resampling.LANCZOS,
}


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Resize:
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR):
        self.size, self.interpolation = size, interpolation

    def __call__(self, img):
        w, h = img.size
        s = self.size / min(w, h)
        return img.resize((max(self.size, round(w * s)), max(self.size, round(h * s))),
                          _PIL[self.interpolation])


class CenterCrop:
    def __init__(self, size):
        self.size = _pair(size)

    def __call__(self, img):
        th, tw = self.size
        w, h = img.size
        return functional.crop(img, int(round((h - th) / 2)), int(round((w - tw) / 2)), th, tw)


class RandomCrop:
    def __init__(self, size):
        self.size = _pair(size)

    @staticmethod
    def get_params(img, output_size):
        w, h = img.size
        th, tw = output_size
        i = int(torch.randint(0, h - th + 1, size=(1,)).item())
        j = int(torch.randint(0, w - tw + 1, size=(1,)).item())
        return i, j, th, tw

    def __call__(self, img):
        return functional.crop(img, *self.get_params(img, self.size))


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img):
        if torch.rand(1).item() < self.p:
            return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img


class ToTensor:
    def __call__(self, pic):
        return torch.from_numpy(np.array(pic, dtype=np.uint8)).permute(2, 0, 1).float() / 255


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, t):
        return (t - torch.tensor(self.mean).view(-1, 1, 1)) / torch.tensor(self.std).view(-1, 1, 1)
""",
}


@dataclass
class Result:
    trainer: str
    text_encoder: bool
    steps: int
    median_step_s: float
    # CPU seconds of the training thread (lorafleet) / process (reference) per step: with one
    # intra-op thread, a figure that other load on the machine barely moves.
    median_step_cpu_s: float
    checkpoint_stall_s: float
    checkpoints: int
    local_disk_bytes: int
    lora_bytes: int
    wall_s: float
    # lorafleet only: Python-level opens for writing seen by the audit hook.
    write_opens: int | None = None
    # lorafleet only: the first step's seconds (with --compile, torch.compile's warm-up).
    first_step_s: float | None = None
    # On CUDA: the run's peak of torch.cuda.max_memory_allocated.
    peak_gpu_bytes: int | None = None
    # On CUDA: torch.cuda.max_memory_reserved, what the caching allocator held from the card
    # (a node's fit needs this, plus the CUDA context, not the allocated peak).
    peak_gpu_reserved_bytes: int | None = None
    # lorafleet on CUDA: the allocated peak of each setup phase (Trainer's on_phase), the last
    # phase's named "<phase>+train" as it runs on into the steps.
    phase_peak_gpu_bytes: dict[str, int] | None = None
    # lorafleet only: how much longer than the median the steps that carry a checkpoint took
    # (the snapshot's whole cost, its copies on the GPU included; the script's stall is this).
    checkpoint_step_extra_s: float | None = None
    # The trainer's peak resident set on the CPU (see the module docstring); None where the
    # high-water mark cannot be reset.
    peak_rss_bytes: int | None = None
    # lorafleet only: this process's resident set when the run started (what the peak counts
    # besides the run: the bench's own imports, the images, earlier runs' caches).
    start_rss_bytes: int | None = None
    family: str = "sdxl"
    preset: str = "tiny"
    base_quantization: str = "none"
    rank: int = 4


_CAP_VARIABLE = "LORAFLEET_BENCH_MEMORY_CAP_GIB"


def _cap_cuda_memory() -> None:
    cap = float(os.environ[_CAP_VARIABLE]) * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _write_bytes() -> int:
    """Bytes this process caused to be written to storage so far (Linux)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


class _WriteAudit:
    """Counts Python-level opens for writing while active (audit hooks cannot be removed)."""

    active = False
    opens: list[str] = []  # noqa: RUF012 -- one process-wide audit log

    @classmethod
    def install(cls) -> None:
        def hook(event: str, args: tuple[Any, ...]) -> None:
            if cls.active and event == "open":
                path, mode, flags = args
                writing = bool(mode and any(c in str(mode) for c in "wax+"))
                writing = writing or bool(isinstance(flags, int) and flags & _WRITE_FLAGS)
                if writing and not isinstance(path, int) and path != "/dev/null":
                    cls.opens.append(str(path))

        sys.addaudithook(hook)


def _reset_peak_rss() -> bool:
    """Returns memory freed earlier to the system, then resets this process's peak resident
    set (VmHWM) to its current size (Linux: `5` to /proc/self/clear_refs). False where it
    cannot be reset."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_bytes(field: str) -> int | None:
    """A size from /proc/self/status (VmHWM: the peak resident set, VmRSS: the current)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def make_images(count: int, resolution: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(0)
    images = []
    ys, xs = np.mgrid[0:resolution, 0:resolution].astype(np.float32) / resolution
    for index in range(count):
        phase = rng.uniform(0, 6.28, size=3)
        freq = rng.uniform(2, 12, size=3)
        array = np.stack(
            [127.5 + 127.5 * np.sin(freq[c] * (xs + ys) + phase[c]) for c in range(3)], axis=-1
        )
        buffer = io.BytesIO()
        Image.fromarray(array.clip(0, 255).astype(np.uint8), "RGB").save(buffer, format="PNG")
        images.append((f"img{index}.png", buffer.getvalue()))
    return images


def _median_steps(durations: list[float]) -> float:
    return statistics.median(durations) if durations else float("nan")


def _step_figures(
    stamps: list[tuple[float, float]], steps: int, checkpoint_every: int
) -> tuple[float, float, list[float]]:
    """From (wall, cpu) stamps taken as each step finishes (before its checkpoint is saved, so
    a save lands in the next step's duration): median wall and CPU seconds over steps 2..N
    without the steps that carry a checkpoint, and those steps' extra wall time."""
    after_checkpoint = {s + 1 for s in range(checkpoint_every, steps, checkpoint_every)}
    wall = {s: stamps[s - 1][0] - stamps[s - 2][0] for s in range(2, len(stamps) + 1)}
    cpu = {s: stamps[s - 1][1] - stamps[s - 2][1] for s in range(2, len(stamps) + 1)}
    median_wall = _median_steps([d for s, d in wall.items() if s not in after_checkpoint])
    median_cpu = _median_steps([d for s, d in cpu.items() if s not in after_checkpoint])
    extra = [wall[s] - median_wall for s in sorted(after_checkpoint) if s in wall]
    return median_wall, median_cpu, extra


def run_lorafleet(
    model_dir: Path,
    images: list[tuple[str, bytes]],
    *,
    steps: int,
    checkpoint_every: int,
    resolution: int,
    text_encoder: bool,
    gpu: bool,
    compile_model: bool = False,
    gradient_checkpointing: bool = False,
    family: str = "sdxl",
    preset: str = "tiny",
    rank: int = 4,
    base_quantization: str = "none",
) -> tuple[Result, int]:
    # The flow families name their model: the default base_model is SDXL's hub id.
    family_fields: dict[str, Any] = (
        {}
        if family == "sdxl"
        else {
            "model_family": family,
            "base_model": str(model_dir),
            "base_quantization": base_quantization,
        }
    )
    spec = JobSpec(
        instance_prompt=PROMPT,
        instance_data_prefix="bench",
        max_train_steps=steps,
        resolution=resolution,
        train_batch_size=1,
        learning_rate=1e-4,
        text_encoder_learning_rate=5e-6,
        train_text_encoder=text_encoder,
        lr_scheduler="constant",
        lora_rank=rank,
        lora_alpha=float(rank),
        adam_weight_decay=1e-4,
        checkpointing_steps=checkpoint_every,
        mixed_precision="bf16" if gpu else "no",
        gradient_checkpointing=gradient_checkpointing,
        seed=0,
        **family_fields,
    )
    config = TrainingConfig(
        spec=spec,
        model_path=str(model_dir),
        local_files_only=True,
        device="auto",
        compile_model=compile_model,
    )
    blob_sizes: list[int] = []
    uploads: list[threading.Thread] = []

    def on_checkpoint(snapshot: TrainingSnapshot) -> None:
        # As the worker does it: serialise (and upload) on another thread.
        thread = threading.Thread(
            target=lambda: blob_sizes.append(len(serialize_checkpoint(snapshot)))
        )
        thread.start()
        uploads.append(thread)

    stamps: list[tuple[float, float]] = []

    def on_progress(step: int, loss: float, lr: float, seconds: float) -> None:
        stamps.append((time.perf_counter(), time.thread_time()))

    # On CUDA, each setup phase's own peak (allocated bytes), the steps' under "train": which
    # phase sets a family's peak is what its memory estimate must follow.
    phase_peaks: dict[str, int] = {}
    phase = ["start"]

    def on_phase(name: str) -> None:
        if gpu:
            phase_peaks[phase[0]] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        phase[0] = name

    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_reset = _reset_peak_rss()
    start_rss = _status_bytes("VmRSS") if rss_reset else None
    trainer = Trainer(config)
    inputs = [TrainingImage(name, data) for name, data in images]
    _WriteAudit.opens = []
    written = _write_bytes()
    started = time.perf_counter()
    _WriteAudit.active = True
    try:
        outcome = trainer.run(
            instance_images=inputs,
            hooks=TrainingHooks(
                on_progress=on_progress, on_checkpoint=on_checkpoint, on_phase=on_phase
            ),
        )
        for thread in uploads:
            thread.join()
    finally:
        _WriteAudit.active = False
    wall = time.perf_counter() - started
    disk = _write_bytes() - written
    if gpu:
        phase_peaks[f"{phase[0]}+train"] = torch.cuda.max_memory_allocated()
    peak = max(phase_peaks.values()) if gpu else None
    reserved = torch.cuda.max_memory_reserved() if gpu else None
    peak_rss = _status_bytes("VmHWM") if rss_reset else None
    timings = trainer.timings
    del trainer  # its model and optimizer, before the next run measures its own peak
    if gpu:
        torch.cuda.empty_cache()
    assert isinstance(outcome, Finished)
    median_wall, median_cpu, extra = _step_figures(stamps, steps, checkpoint_every)
    return (
        Result(
            trainer="lorafleet compiled" if compile_model else "lorafleet",
            text_encoder=text_encoder,
            steps=steps,
            median_step_s=median_wall,
            median_step_cpu_s=median_cpu,
            # Measured directly: the training thread's time inside the snapshot.
            checkpoint_stall_s=_median_steps(timings.snapshot_seconds),
            checkpoints=len(timings.snapshot_seconds),
            local_disk_bytes=disk,
            lora_bytes=len(outcome.lora_weights),
            wall_s=wall,
            write_opens=len(_WriteAudit.opens),
            first_step_s=timings.step_seconds[0],
            peak_gpu_bytes=peak,
            peak_gpu_reserved_bytes=reserved,
            phase_peak_gpu_bytes=phase_peaks or None,
            checkpoint_step_extra_s=_median_steps(extra),
            peak_rss_bytes=peak_rss,
            start_rss_bytes=start_rss,
            family=family,
            preset=preset,
            base_quantization=base_quantization,
            rank=rank,
        ),
        max(blob_sizes, default=0),
    )


def _shim_dir(python: str, work: Path) -> str:
    probe = subprocess.run([python, "-c", "import torchvision"], capture_output=True, check=False)
    if probe.returncode == 0:
        return ""
    root = work / "torchvision-shim"
    for name, text in _SHIM_FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def reference_args(
    family: str,
    *,
    model_dir: Path,
    image_dir: Path,
    out: Path,
    work: Path,
    steps: int,
    checkpoint_every: int,
    resolution: int,
    text_encoder: bool,
    gpu: bool,
    rank: int = 4,
    gradient_checkpointing: bool = False,
    base_quantization: str = "none",
) -> list[str]:
    """The family's diffusers script's arguments for the settings lorafleet trains with."""
    if family == "flux2" and text_encoder:
        raise SystemExit("FLUX.2 [klein]'s Qwen3 text encoder is never trained (--text-encoder)")
    if base_quantization != "none" and family != "flux2":
        raise SystemExit(f"the {family} script has no quantized base (--base-quantization)")
    args = [
        f"--pretrained_model_name_or_path={model_dir}",
        f"--instance_data_dir={image_dir}",
        f"--instance_prompt={PROMPT}",
        f"--output_dir={out}",
        f"--resolution={resolution}",
        "--train_batch_size=1",
        f"--max_train_steps={steps}",
        "--learning_rate=1e-4",
        "--lr_scheduler=constant",
        "--lr_warmup_steps=0",
        f"--rank={rank}",
        "--adam_weight_decay=1e-4",
        f"--checkpointing_steps={checkpoint_every}",
        "--seed=0",
        f"--mixed_precision={'bf16' if gpu else 'no'}",
    ]
    if family == "sdxl":
        # The SDXL script's LoRA alpha is its rank.
        args += ["--text_encoder_lr=5e-6", "--adam_weight_decay_text_encoder=1e-4"]
    else:
        # lorafleet encodes the images once and samples the posterior (FLUX.1) or takes its
        # mean (klein) each step: the scripts do the same with --cache_latents.
        args += [f"--lora_alpha={rank}", "--cache_latents"]
    if family == "flux":
        args += ["--text_encoder_lr=5e-6", "--adam_weight_decay_text_encoder=1e-4"]
    if family == "flux2":
        args += ["--text_encoder_out_layers", *map(str, KLEIN_TEXT_ENCODER_LAYERS)]
    if base_quantization == "nf4":
        config = work / "nf4.json"
        config.write_text(json.dumps(NF4_CONFIG))
        args.append(f"--bnb_quantization_config_path={config}")
    if text_encoder:
        args.append("--train_text_encoder")
    if gradient_checkpointing:
        args.append("--gradient_checkpointing")
    return args


def run_reference(
    script: Path,
    model_dir: Path,
    image_dir: Path,
    work: Path,
    *,
    steps: int,
    checkpoint_every: int,
    resolution: int,
    text_encoder: bool,
    gpu: bool,
    threads: int,
    gradient_checkpointing: bool = False,
    family: str = "sdxl",
    preset: str = "tiny",
    rank: int = 4,
    base_quantization: str = "none",
) -> Result:
    python = sys.executable
    out = work / f"reference-out-te{int(text_encoder)}"
    shutil.rmtree(out, ignore_errors=True)
    times_file = work / "times.json"
    args = reference_args(
        family,
        model_dir=model_dir,
        image_dir=image_dir,
        out=out,
        work=work,
        steps=steps,
        checkpoint_every=checkpoint_every,
        resolution=resolution,
        text_encoder=text_encoder,
        gpu=gpu,
        rank=rank,
        gradient_checkpointing=gradient_checkpointing,
        base_quantization=base_quantization,
    )
    harness = _HARNESS.format(shim=_shim_dir(python, work), threads=threads)
    started = time.perf_counter()
    completed = subprocess.run(
        [python, "-c", harness, str(script), str(times_file), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        sys.stderr.write(completed.stderr[-4000:])
        raise SystemExit(f"reference script failed ({completed.returncode})")
    recorded = json.loads(times_file.read_text())
    stamps = [(float(w), float(c)) for w, c in recorded["times"]]
    median_wall, median_cpu, stalls = _step_figures(stamps, steps, checkpoint_every)
    lora = out / "pytorch_lora_weights.safetensors"
    return Result(
        trainer="diffusers script",
        text_encoder=text_encoder,
        steps=steps,
        median_step_s=median_wall,
        median_step_cpu_s=median_cpu,
        checkpoint_stall_s=_median_steps(stalls),
        checkpoints=len(stalls),
        local_disk_bytes=_tree_bytes(out),
        lora_bytes=lora.stat().st_size if lora.exists() else 0,
        wall_s=wall,
        peak_gpu_bytes=recorded["peak_gpu_bytes"],
        peak_gpu_reserved_bytes=recorded.get("peak_gpu_reserved_bytes"),
        peak_rss_bytes=recorded.get("peak_rss_bytes"),
        family=family,
        preset=preset,
        base_quantization=base_quantization,
        rank=rank,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reference",
        type=Path,
        help="the family's script: train_dreambooth_lora_sdxl.py, _flux.py or _flux2_klein.py",
    )
    parser.add_argument("--family", choices=FAMILIES, default="sdxl")
    parser.add_argument(
        "--preset",
        help="the model's size (lorafleet.worker.tiny_model presets); default: tiny on the CPU,"
        f" with --gpu {', '.join(f'{f} {p}' for f, p in GPU_PRESETS.items())}",
    )
    parser.add_argument(
        "--rank", type=int, help="LoRA rank (= alpha); default 4, with --gpu 16 for flux, flux2"
    )
    parser.add_argument(
        "--base-quantization",
        choices=["none", "nf4"],
        default="none",
        help="the frozen transformer's weights (CUDA only; flux and flux2)",
    )
    parser.add_argument("--json-file", type=Path, help="write every run's figures here as JSON")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both trainers (0: torch's default)",
    )
    parser.add_argument("--gpu", action="store_true", help="full-size SDXL at 1024 px, bf16")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="in both trainers")
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="a model built by an earlier run (kept there; built when missing)",
    )
    parser.add_argument(
        "--text-encoder",
        choices=["both", "frozen", "trained"],
        help="which text-encoder settings to run (default: both; flux2 only frozen)",
    )
    parser.add_argument(
        "--no-eager",
        action="store_true",
        help="with --compile: lorafleet compiled only (no eager lorafleet run)",
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also train lorafleet with compile_model (torch.compile); its warm-up is reported",
    )
    parser.add_argument(
        "--memory-cap-gib",
        type=float,
        help="with --gpu: cap both trainers' CUDA allocator at this many GiB"
        " (torch.cuda.set_per_process_memory_fraction), as on a smaller card: a run that needs"
        " more fails out of memory",
    )
    args = parser.parse_args(argv)
    if args.memory_cap_gib:
        if not args.gpu:
            parser.error("--memory-cap-gib needs --gpu")
        os.environ[_CAP_VARIABLE] = str(args.memory_cap_gib)
        _cap_cuda_memory()

    family: Family = args.family
    preset: str = args.preset or (GPU_PRESETS[family] if args.gpu else "tiny")
    rank: int = args.rank or (16 if args.gpu and family != "sdxl" else 4)
    if args.base_quantization != "none" and (not args.gpu or family == "sdxl"):
        parser.error("--base-quantization needs --gpu and --family flux or flux2")
    text_encoder_choice = args.text_encoder or ("frozen" if family == "flux2" else "both")
    if family == "flux2" and text_encoder_choice != "frozen":
        parser.error("--text-encoder: FLUX.2 [klein]'s Qwen3 is never trained")
    # The flux script cannot quantize its base: with nf4 lorafleet runs alone.
    reference = args.reference
    if reference is not None and args.base_quantization != "none" and family == "flux":
        print("the FLUX.1 script has no quantized base: lorafleet only", flush=True)
        reference = None
    resolution = 1024 if args.gpu else 64
    if args.threads:
        torch.set_num_threads(args.threads)
    _WriteAudit.install()
    text_encoders = {"both": (False, True), "frozen": (False,), "trained": (True,)}[
        text_encoder_choice
    ]
    compile_modes = (True,) if args.no_eager else (False, True) if args.compile else (False,)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or work / "model"
        if not (model_dir / "model_index.json").exists():
            build_tiny_model(
                model_dir,
                family=family,
                preset=preset,
                weights_dtype="bf16" if args.gpu else "fp32",
            )
        images = make_images(args.images, resolution)
        image_dir = work / "images"
        image_dir.mkdir()
        for name, data in images:
            (image_dir / name).write_bytes(data)

        results: list[Result] = []
        blob_bytes = 0
        failed = 0
        # Alternate the trainers and repeat: on a shared machine load comes and goes, and a
        # ratio from one back-to-back pair can be off by several times.
        for _ in range(args.repeats):
            for text_encoder in text_encoders:
                for compile_model in compile_modes:
                    # A lorafleet run that fails still lets the script run the same job (its
                    # own process): whether the script fails too tells a kernel's fault from
                    # lorafleet's (the FLUX.1 bf16 crash on an H100, docs/BENCHMARKS.md).
                    try:
                        result, blob_bytes = run_lorafleet(
                            model_dir,
                            images,
                            steps=args.steps,
                            checkpoint_every=args.checkpoint_every,
                            resolution=resolution,
                            text_encoder=text_encoder,
                            gpu=args.gpu,
                            compile_model=compile_model,
                            gradient_checkpointing=args.gradient_checkpointing,
                            family=family,
                            preset=preset,
                            rank=rank,
                            base_quantization=args.base_quantization,
                        )
                    except Exception:  # reported; the script still runs
                        traceback.print_exc()
                        print("run: lorafleet failed", flush=True)
                        failed += 1
                        continue
                    results.append(result)
                    _progress(result)
                if reference is not None:
                    results.append(
                        run_reference(
                            reference,
                            model_dir,
                            image_dir,
                            work,
                            steps=args.steps,
                            checkpoint_every=args.checkpoint_every,
                            resolution=resolution,
                            text_encoder=text_encoder,
                            gpu=args.gpu,
                            threads=args.threads,
                            gradient_checkpointing=args.gradient_checkpointing,
                            family=family,
                            preset=preset,
                            rank=rank,
                            base_quantization=args.base_quantization,
                        )
                    )
                    _progress(results[-1])
    print(
        f"family {family}, preset {preset}, rank {rank}, base {args.base_quantization},"
        f" {resolution} px, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}"
    )
    report(results, blob_bytes)
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    if args.json_file is not None:
        args.json_file.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if failed:
        print(f"{failed} lorafleet run(s) failed (tracebacks above)", file=sys.stderr)
        sys.exit(1)


def _progress(result: Result) -> None:
    """Each run's figures as it ends: a run cut short by a time limit keeps what it measured."""
    print("run:", json.dumps(asdict(result)), flush=True)


def report(results: list[Result], blob_bytes: int) -> None:
    """Per trainer and text-encoder setting: the median over repeats of each figure (the
    fastest repeat's step time in brackets)."""
    groups: dict[tuple[str, bool], list[Result]] = {}
    for r in results:
        groups.setdefault((r.trainer, r.text_encoder), []).append(r)
    # Ratios are to the diffusers script's figure (to eager lorafleet's without --reference).
    base = "diffusers script" if any(t == "diffusers script" for t, _ in groups) else "lorafleet"
    ours = {
        te: statistics.median(r.median_step_s for r in rs)
        for (t, te), rs in groups.items()
        if t == base
    }
    cpu_ours = {
        te: statistics.median(r.median_step_cpu_s for r in rs)
        for (t, te), rs in groups.items()
        if t == base
    }
    print(
        f"{'trainer':<18} {'TE':<3} {'s/step (min)':>16} {'ratio':>6} {'CPU s/step':>10}"
        f" {'ratio':>6} {'stall s':>8} {'disk bytes':>11} {'LoRA bytes':>10} {'repeats':>7}"
        f" {'1st step s':>10} {'wall s':>7} {'peak GiB':>8}"
    )
    for (trainer, te), rs in groups.items():
        step = statistics.median(r.median_step_s for r in rs)
        fastest = min(r.median_step_s for r in rs)
        cpu = statistics.median(r.median_step_cpu_s for r in rs)
        stall = statistics.median(r.checkpoint_stall_s for r in rs)
        disk = max(r.local_disk_bytes for r in rs)
        firsts = [r.first_step_s for r in rs if r.first_step_s is not None]
        first = f"{statistics.median(firsts):>10.2f}" if firsts else f"{'-':>10}"
        wall = statistics.median(r.wall_s for r in rs)
        # GPU memory on CUDA, else the resident set.
        peaks = [r.peak_gpu_bytes for r in rs if r.peak_gpu_bytes is not None] or [
            r.peak_rss_bytes for r in rs if r.peak_rss_bytes is not None
        ]
        peak = f"{max(peaks) / 2**30:>8.2f}" if peaks else f"{'-':>8}"
        print(
            f"{trainer:<18} {'yes' if te else 'no':<3} {step:>8.4f} ({fastest:.4f})"
            f" {step / ours[te]:>6.2f} {cpu:>10.4f} {cpu / cpu_ours[te]:>6.2f}"
            f" {stall:>8.4f} {disk:>11} {rs[-1].lora_bytes:>10} {len(rs):>7} {first}"
            f" {wall:>7.1f} {peak}"
        )
    print(f"lorafleet checkpoint blob (serialised off-thread, TE run): {blob_bytes} bytes")
    for r in results:
        if r.phase_peak_gpu_bytes:
            phases = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in r.phase_peak_gpu_bytes.items())
            trained = "yes" if r.text_encoder else "no"
            print(f"{r.trainer} (TE {trained}) peak GiB by phase: {phases}")
    opens = [r.write_opens for r in results if r.write_opens is not None]
    print(f"lorafleet Python-level opens for writing during its runs: {sum(opens)}")


if __name__ == "__main__":
    main()
