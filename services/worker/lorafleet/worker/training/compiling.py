"""Whether a run compiles its step, and where torch keeps what compiling makes.

`compile_model` is `on`, `off` or `auto`. With `auto` a run compiles when its remaining steps
make it pay: the compile costs seconds (a shape already compiled in this process: its guards
only) to minutes (cold), and saves a share of every step. Both come from this node's own
measurements per job shape (`JobSpec.compiled_shape_key`), kept in a small JSON file in the
node's compile cache directory; a shape never measured here is judged on a conservative prior
(`PRIOR`), and the reason says so.

The cache directory is node-local and outlives leases and restarts: inductor's FX-graph and
kernel caches (`TORCHINDUCTOR_CACHE_DIR`) live under it, so a restarted worker compiles a known
shape in seconds. It is never uploaded nor downloaded (compiled code from another machine is
code from a stranger); an operator may bake one into the worker image (docs/DEPLOYING.md).
Each worker has its own, so its cost records describe its own machine.

A fresh node need not compile cold either: torch's portable compile artifacts (the "mega-cache":
inductor's compiled graphs and kernels, AOTAutograd's entries) of the default job shapes, made
once per GPU architecture and torch version by the operator (`bake_compile_artifacts`) and baked
into the worker image, are loaded into the node's cache directory at worker start
(`load_compile_artifacts`, the worker's `compile_artifacts_path`). Only from that local file:
never downloaded, never from another worker, for the reason above.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    from lorafleet.core.spec import JobSpec
    from lorafleet.worker.training.config import DeviceChoice

log = logging.getLogger(__name__)

CompileChoice = Literal["auto", "on", "off"]
COSTS_FILE = "compile-costs.json"


@dataclass(frozen=True, kw_only=True)
class ShapeCosts:
    """What this node measured for one shape (None: never measured)."""

    eager_step_s: float | None = None
    compiled_step_s: float | None = None
    # Wall time a cold compile added to its first step (graph capture, inductor, kernels).
    compile_s: float | None = None


# A shape this node never ran: a compile as slow as a cold one on a small node (a whole-model
# compile: the CPU's 90-160 s, an H100's 7 minutes; regional compilation's is 3-4 times shorter
# on the CPU, not yet measured on a GPU), an eager step of a second, a quarter of it saved
# compiled. Only jobs of well over a thousand steps compile on the prior alone.
PRIOR_COMPILE_S = 300.0
PRIOR_EAGER_STEP_S = 1.0
PRIOR_COMPILED_SHARE = 0.75


@dataclass(frozen=True, kw_only=True)
class Decision:
    compile: bool
    reason: str


def decide(
    choice: CompileChoice, costs: ShapeCosts, *, remaining_steps: int, warm: bool
) -> Decision:
    """Whether to compile a run with `remaining_steps` to go; `warm`: this process already
    compiled the shape on the resident model (no compile to pay)."""
    if choice != "auto":
        return Decision(compile=choice == "on", reason=f"compile_model is {choice}")
    if costs.eager_step_s is not None and costs.compiled_step_s is not None:
        eager_s, compiled_s = costs.eager_step_s, costs.compiled_step_s
        source = "measured on this node"
    else:
        eager_s = costs.eager_step_s if costs.eager_step_s is not None else PRIOR_EAGER_STEP_S
        compiled_s = eager_s * PRIOR_COMPILED_SHARE
        source = "a conservative prior (this shape is not yet measured here)"
    if warm:
        compile_s, paid = 0.0, "already compiled here"
    else:
        compile_s = costs.compile_s if costs.compile_s is not None else PRIOR_COMPILE_S
        paid = f"a compile of ~{compile_s:.0f} s"
    saving = remaining_steps * (eager_s - compiled_s)
    pays = saving > compile_s
    return Decision(
        compile=pays,
        reason=(
            f"compile_model auto: {'compiled' if pays else 'eager'};"
            f" {remaining_steps} steps x ({eager_s:.3g} s eager - {compiled_s:.3g} s compiled)"
            f" = {saving:.0f} s saved against {paid}, from {source}"
        ),
    )


class CompileCosts:
    """The per-shape measurements in `<directory>/compile-costs.json` (in memory only without
    a directory). A missing or unreadable file is an empty record, never an error."""

    def __init__(self, directory: Path | None) -> None:
        self._path = directory / COSTS_FILE if directory is not None else None
        self._costs: dict[str, ShapeCosts] = {}
        if self._path is not None and self._path.is_file():
            try:
                raw = json.loads(self._path.read_text())
                self._costs = {
                    str(shape): ShapeCosts(**{k: _seconds(v) for k, v in values.items()})
                    for shape, values in raw.items()
                }
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("compile costs unreadable, starting afresh: %s", exc)
                self._costs = {}

    def get(self, shape: str) -> ShapeCosts:
        return self._costs.get(shape, ShapeCosts())

    def record_run(
        self, shape: str, step_seconds: list[float], *, compiled: bool, cold: bool
    ) -> None:
        """A run's step times: an eager run's median step, or a compiled run's median step and
        (when it compiled cold) what its first step took beyond that."""
        if len(step_seconds) < 2:
            return  # one step says nothing apart from its warm-up
        old = self.get(shape)
        typical = statistics.median(step_seconds[1:])
        if compiled:
            compile_s = max(0.0, step_seconds[0] - typical) if cold else old.compile_s
            new = ShapeCosts(
                eager_step_s=old.eager_step_s, compiled_step_s=typical, compile_s=compile_s
            )
        else:
            new = ShapeCosts(
                eager_step_s=typical, compiled_step_s=old.compiled_step_s, compile_s=old.compile_s
            )
        self._costs[shape] = new
        self._save()

    def _save(self) -> None:
        if self._path is None:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            data = json.dumps({k: asdict(v) for k, v in sorted(self._costs.items())}, indent=1)
            fd, scratch = tempfile.mkstemp(dir=self._path.parent, prefix=".costs-")
            with os.fdopen(fd, "w") as out:
                out.write(data)
            os.replace(scratch, self._path)
        except OSError as exc:
            log.warning("compile costs not saved: %s", exc)


def _seconds(value: object) -> float | None:
    if value is None:
        return None
    number = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"not a duration: {value!r}")
    return number


def use_cache_dir(directory: Path) -> None:
    """Points inductor's caches (FX graphs, kernels; Triton's beneath) at `directory`, read
    by torch whenever it compiles: call before compiling."""
    inductor = directory / "inductor"
    inductor.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)


def load_compile_artifacts(path: Path, cache_dir: Path) -> None:
    """Loads the compile artifacts the operator baked into the image at `path` into the node's
    cache directory `cache_dir`, where the compiles of the shapes they cover then find their
    graphs (a cache hit: dynamo traces, AOTAutograd and inductor lower nothing; on CUDA the
    Triton kernels are in them too, on a CPU the C++ compiler builds its kernels again). At
    worker start, before any compile. Artifacts of another torch version or GPU never hit;
    they cost nothing but the load. A missing or unreadable file fails the start: the operator
    named it."""
    use_cache_dir(cache_dir)
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    if info is None:
        raise ValueError(f"{path} holds no compile artifacts torch can read")
    count = sum(len(keys) for keys in info.artifacts.values())
    log.info("loaded %d compile artifacts from %s", count, path)


def bake_compile_artifacts(
    model_path: Path, specs: Sequence[JobSpec], out: Path, *, device: DeviceChoice = "auto"
) -> int:
    """The operator's command: compiles each job of `specs` (the default jobs' shapes) on the
    base model at `model_path` (one compiled step each, on generated images, in a fresh cache,
    so that every artifact is made here), and writes torch's compile artifacts of all of them to
    `out`, the file to bake into the worker image and name in `compile_artifacts_path`. Run it
    on the GPU and torch version the workers run. Returns the bytes written."""
    # The trainer imports this module: imported here, where the bake runs it.
    from lorafleet.worker.training import Trainer, TrainingConfig, TrainingImage
    from lorafleet.worker.training.resident import ResidentModel

    resident = ResidentModel()
    with tempfile.TemporaryDirectory(prefix="lorafleet-bake-") as scratch:
        for spec in specs:
            one_step = replace(spec, max_train_steps=1)
            config = TrainingConfig(
                spec=one_step,
                model_path=str(model_path),
                local_files_only=True,
                device=device,
                compile_model="on",
                compile_cache_dir=scratch,
            )
            images = [TrainingImage(f"{i}.png", _noise_png(spec.resolution, i)) for i in range(2)]
            Trainer(config, resident).run(instance_images=images)
        resident.release()
        saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError("nothing was compiled: no compile artifacts to save")
    data, _ = saved
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=out.parent, prefix=".artifacts-")
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.replace(partial, out)
    return len(data)


def _noise_png(size: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()
