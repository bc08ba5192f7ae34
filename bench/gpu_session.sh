#!/usr/bin/env bash
# One call on a lent GPU machine (docs/BENCHMARKS.md, "On a GPU"): the machine is bare and
# offline, its python3 holds CUDA torch, and its minutes are few, so everything runs from here.
#
#   bash bench/gpu_session.sh OUT [sections...]
#
# Sections (default: all, in this order; each under its own timeout, so one that hangs costs only
# its own figures): model (build the full-size SDXL architecture, random bf16 weights, on the
# GPU), gpu (bench/bench_gpu.py), tests (the CUDA and checkpoint tests), trainer
# (bench/bench_trainer.py --gpu against diffusers' script). Not in the default list, because one
# of its models takes a call of its own: families (issue 33: FLUX.1-dev and FLUX.2 [klein] 4B /
# 9B architectures, random bf16 weights, 1024 px, rank 16, batch 1, lorafleet against the
# family's diffusers script; s/step and peak GPU memory for a bf16 and an nf4 base; one
# JSON file a run, $OUT/family-<preset>-<base>-gc<0|1>[-cap<GiB>].json). FAMILY_RUNS picks the
# runs, each family/preset/base/gc[/cap] (gc: 1 for gradient checkpointing in both trainers;
# text encoders frozen, as in the default job; cap: both trainers' CUDA allocator capped at that
# many GiB, as on a smaller card, so a run that needs more fails out of memory). Runs of one
# preset share its model, built on the GPU and deleted before the next preset's (the three do
# not fit the 64 GiB disk together). The default is the two default jobs the 22 GiB goal is
# about (docs/BENCHMARKS.md, "Model families on a GPU"), the smaller first, each capped at 22 GiB:
#
#   FAMILY_RUNS="flux2/klein-4b/none/1/22 flux/flux-dev/nf4/1/22" bash bench/gpu_session.sh OUT families
#
# and the rest, a call each: flux/flux-dev/none/1 (the FLUX.1 script has no quantized base: with
# nf4 lorafleet runs alone), flux2/klein-4b/none/0, flux2/klein-4b/nf4/0, flux2/klein-9b/none/1,
# flux2/klein-9b/nf4/0.
# FAMILY_STEPS (default 10) steps a run, a checkpoint at the middle one; FAMILY_TIMEOUT (default
# 540) seconds for the whole section.
#
# What the next lent GPU should run (docs/BENCHMARKS.md, "Model families on a GPU" and "Regional
# compilation"), two calls of under 10 minutes:
#   bash bench/gpu_session.sh OUT model compile        # COMPILE_MODES="eager regional" if short
#   CUDA_LAUNCH_BLOCKING=1 FAMILY_RUNS=flux/flux-dev/none/1 bash bench/gpu_session.sh OUT families
# The second reruns the FLUX.1-dev bf16 job that crashed lorafleet's first step on an H100
# (CUBLAS_STATUS_EXECUTION_FAILED, then an illegal memory access, in the backward's recompute
# of a LoRA projection): with launches synchronous the traceback names the kernel that failed,
# and bench_trainer.py runs the diffusers script on the same job even when lorafleet's run
# fails, which tells torch's kernels from lorafleet.
#
# Carried beside the tree (ignored by git, named in the call's `carry`): .whl/ the wheels the
# image lacks or has too old (pip download --no-deps for cp312 manylinux: diffusers, peft,
# opentelemetry api/sdk/semantic-conventions, importlib-metadata; for nf4 runs bitsandbytes, for
# the fp8 tests torchao 0.17, the release for the image's torch 2.11; the image's transformers
# 5.17 serves: carrying 5.23 too would pass the call's 64 MiB), and .gpu/ diffusers'
# examples/dreambooth/train_dreambooth_lora_sdxl.py, the reference trainer (for families also train_dreambooth_lora_flux.py and
# train_dreambooth_lora_flux2_klein.py, unmodified, from the same diffusers commit).
set -uo pipefail
out=${1:?OUT directory}
shift
sections=${*:-model gpu tests trainer}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
if [ -d .whl ]; then
  $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
fi
repo=$PWD
export PYTHONPATH=/tmp/site:$repo:$repo/core:$repo/services/worker:$repo/clients/python
model=/tmp/sdxl
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
$python -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__,
  'diffusers', diffusers.__version__, 'transformers', transformers.__version__,
  'peft', peft.__version__)"

for section in $sections; do
  started=$(date +%s)
  case $section in
    model)
      # Built on the GPU: random initialisation of 3.5 B parameters on the CPU takes minutes.
      timeout 180 $python -c "
import time, torch
from lorafleet.worker.tiny_model import build_tiny_model
started = time.perf_counter()
try:
    with torch.device('cuda'):
        build_tiny_model('$model', preset='sdxl', weights_dtype='bf16')
except Exception as exc:
    print('built on the CPU instead:', repr(exc))
    build_tiny_model('$model', preset='sdxl', weights_dtype='bf16')
print(f'model built in {time.perf_counter() - started:.0f} s')
" >"$out/model.log" 2>&1
      ;;
    gpu)
      # shellcheck disable=SC2086 # BENCH_GPU_ARGS is a list of arguments
      timeout 260 $python bench/bench_gpu.py --model-dir $model --warmup 3 --steps 10 ${BENCH_GPU_ARGS:-} \
        --json "$out/bench_gpu.json" \
        >"$out/bench_gpu.log" 2>&1
      ;;
    trainer)
      timeout 260 $python bench/bench_trainer.py --gpu --model-dir $model --steps 16 \
        --checkpoint-every 8 --repeats 1 --threads 0 \
        --reference .gpu/train_dreambooth_lora_sdxl.py >"$out/bench_trainer.log" 2>&1
      ;;
    families)
      # One model at a time: build it on the GPU (random initialisation of 12 B parameters on
      # the CPU takes many minutes), run bench_trainer once per base and gc, delete it. A run
      # or build that fails costs its own figures only. nvidia-smi samples the card's memory
      # beside (the CUDA context and the allocator's slack included), $OUT/families-smi.csv.
      nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 500 \
        >"$out/families-smi.csv" 2>/dev/null &
      smi=$!
      FAMILY_OUT=$out FAMILY_STEPS=${FAMILY_STEPS:-10} timeout "${FAMILY_TIMEOUT:-540}" bash -c '
        set -u
        built=""
        for entry in ${FAMILY_RUNS:-flux2/klein-4b/none/1/22 flux/flux-dev/nf4/1/22}; do
          IFS=/ read -r family preset base gc cap <<<"$entry"
          model=/tmp/family-$family-$preset
          if [ "$built" != "$family-$preset" ]; then
            [ -n "$built" ] && rm -rf "/tmp/family-$built"
            built=""
            echo "== building $preset at $(date +%T)"
            '"$python"' -c "
import time, torch
from lorafleet.worker.tiny_model import build_tiny_model
started = time.perf_counter()
with torch.device(\"cuda\"):
    build_tiny_model(\"$model\", family=\"$family\", preset=\"$preset\", weights_dtype=\"bf16\")
print(f\"$preset built in {time.perf_counter() - started:.0f} s\")
" || { echo "== $preset: build failed"; rm -rf "$model"; continue; }
            built=$family-$preset
          fi
          script=.gpu/train_dreambooth_lora_flux.py
          [ "$family" = flux2 ] && script=.gpu/train_dreambooth_lora_flux2_klein.py
          flags=()
          [ "$gc" = 1 ] && flags+=(--gradient-checkpointing)
          [ -n "$cap" ] && flags+=(--memory-cap-gib "$cap")
          echo "== $family $preset base $base gc $gc cap ${cap:-none} at $(date +%T)"
          '"$python"' bench/bench_trainer.py --gpu --family "$family" --preset "$preset" \
            --base-quantization "$base" --model-dir "$model" --steps "$FAMILY_STEPS" \
            --checkpoint-every $((FAMILY_STEPS / 2)) --repeats 1 --threads 0 \
            --text-encoder frozen --reference "$script" "${flags[@]}" \
            --json-file "$FAMILY_OUT/family-$preset-$base-gc$gc${cap:+-cap$cap}.json" \
            || echo "== $family $preset base $base gc $gc: failed"
        done
      ' >"$out/bench_families.log" 2>&1
      kill $smi 2>/dev/null
      ;;
    compile) # issue 34, not in the default list, after model: bench/bench_compile.py, COMPILE_MODES
      # shellcheck disable=SC2086 # COMPILE_MODES is a list of modes
      timeout 580 $python bench/bench_compile.py --device cuda --families sdxl --model-dir $model --gradient-checkpointing --steps 10 --modes ${COMPILE_MODES:-eager regional whole} --json "$out/bench_compile.json" >"$out/bench_compile.log" 2>&1 ;;
    tests)
      # The root conftest needs the fleet's services (Postgres, gRPC); the trainer's tests need
      # only the tiny model and one thread, given here by a plugin of two fixtures.
      mkdir -p /tmp/gpuplugin
      cat >/tmp/gpuplugin/gpu_fixtures.py <<'EOF'
import tempfile
from pathlib import Path

import pytest
import torch

from lorafleet.worker.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="session")
def tiny_flux_dir() -> Path:
    return build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-flux", family="flux")


@pytest.fixture(scope="session")
def tiny_flux2_dir() -> Path:
    return build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-flux2", family="flux2")


@pytest.fixture(scope="module")
def one_intra_op_thread():
    torch.set_num_threads(1)
    yield
EOF
      printf '[pytest]\nmarkers =\n  slow: slow\n  cuda: cuda\ntimeout = 120\n' >/tmp/gpuplugin/pytest.ini
      LORAFLEET_TEST_DEVICE=cuda PYTHONPATH=/tmp/gpuplugin:$PYTHONPATH timeout 90 \
        $python -m pytest -q -p gpu_fixtures -p no:cacheprovider -c /tmp/gpuplugin/pytest.ini \
        --rootdir "$repo" --confcutdir "$repo/tests/worker" \
        tests/worker/test_cuda.py tests/worker/test_checkpoint.py >"$out/tests.log" 2>&1
      ;;
  esac
  rc=$?
  case $section in model | tests) log=$section.log ;; *) log=bench_$section.log ;; esac
  echo "== $section: rc=$rc in $(( $(date +%s) - started )) s"
  tail -n 22 "$out/$log"
done
