#!/usr/bin/env bash
# One call on a lent GPU machine (docs/BENCHMARKS.md, "On a GPU"): the machine is bare and
# offline, its python3 holds CUDA torch, and its minutes are few, so everything runs from here.
#
#   bash bench/gpu_session.sh OUT [sections...]
#
# Sections (default: all, in this order; each under its own timeout, so one that hangs costs only
# its own figures): model (build the full-size SDXL architecture, random bf16 weights, on the
# GPU), gpu (bench/bench_gpu.py), tests (the CUDA and checkpoint tests), trainer
# (bench/bench_trainer.py --gpu against diffusers' script).
#
# Carried beside the tree (ignored by git, named in the call's `carry`): .whl/ the wheels the
# image lacks or has too old (pip download --no-deps for cp312 manylinux: diffusers, transformers,
# peft, protobuf, regex, opentelemetry api/sdk/semantic-conventions), and .gpu/ diffusers'
# examples/dreambooth/train_dreambooth_lora_sdxl.py, the reference trainer.
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
