# syntax=docker/dockerfile:1
#
# lorafleet GPU worker: one `lorafleet worker` process on one NVIDIA GPU.
# Build from the repository root:
#
#   docker build -f docker/worker.Dockerfile -t lorafleet-worker .
#
#   # SDXL base baked in (recommended on SaladCloud, see docs/DEPLOYING.md):
#   docker build -f docker/worker.Dockerfile -t lorafleet-worker:sdxl \
#     --build-arg PRELOAD_MODELS=stabilityai/stable-diffusion-xl-base-1.0 .
#
#   # a gated model: pass a Hugging Face token as a build secret (it never lands in a layer)
#   docker build ... --secret id=hf_token,env=HF_TOKEN --build-arg PRELOAD_MODELS=org/model .
#
# Run: docker run --gpus all -e LORAFLEET_SCHEDULER=host:port -e LORAFLEET_WORKER_TOKEN=... IMAGE
#
# Base image. The CUDA runtime comes with torch, not with the base: torch's Linux wheels on PyPI
# are CUDA builds that depend on NVIDIA's CUDA libraries as wheels (torch 2.13.0: CUDA 13.0,
# cuDNN 9). An nvidia/cuda runtime base would add a second, unused copy of those libraries, some
# gigabytes more to pull on every node a provider hands out. The host supplies only the driver
# (nvidia-container-toolkit mounts it); the NVIDIA_* variables below ask for it.
FROM python:3.11-slim-bookworm

# torch is installed first, in its own layer, because the worker extra deliberately does not
# pin it. The default is PyPI's build of torch 2.13.0, which needs an NVIDIA driver that
# supports CUDA 13.0 (R580 or newer). For older drivers, use a build for an older CUDA, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# if PyTorch publishes that CUDA variant for TORCH_VERSION.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
# Space-separated Hugging Face model ids to download into the image's model cache at build
# time (empty: none; the worker then downloads what a job names, once per node).
ARG PRELOAD_MODELS=""
# Extra pip requirements installed next to lorafleet, e.g. "bitsandbytes" so that jobs asking for
# use_8bit_adam can run (without it the worker refuses them as an input fault).
ARG EXTRA_PACKAGES=""

# The worker passes LORAFLEET_MODEL_CACHE_DIR to from_pretrained(cache_dir=); HF_HUB_CACHE points
# every other huggingface_hub call at the same directory, and HF_HOME keeps the hub's other files
# (token, transfer caches) beside it, writable by the worker's user.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LORAFLEET_MODEL_CACHE_DIR=/models \
    LORAFLEET_COMPILE_CACHE_DIR=/compile-cache \
    HF_HUB_CACHE=/models \
    HF_HOME=/models/.hf-home \
    HF_HUB_DISABLE_TELEMETRY=1 \
    LORAFLEET_LOG_FORMAT=json

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin lorafleet \
 && mkdir -p /models /compile-cache \
 && chown lorafleet:lorafleet /models /compile-cache

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Only what the wheel is built from (see [tool.hatch.build] in pyproject.toml).
WORKDIR /tmp/lorafleet-src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY core ./core
COPY clients ./clients
COPY services ./services
RUN pip install ".[worker]" ${EXTRA_PACKAGES} \
 && python -c "import torch, diffusers, peft, lorafleet.worker.main" \
 && cd / && rm -rf /tmp/lorafleet-src

USER lorafleet
WORKDIR /home/lorafleet

# Downloads exactly the files the worker's loaders read (model.py: tokenizers, both text
# encoders, UNet, VAE, scheduler config, in the repository's default full-precision
# safetensors), for a diffusers pipeline repository or a standalone VAE repository, and nothing
# else (no single-file checkpoints, fp16 variants, ONNX, OpenVINO or Flax weights). Runs as the
# worker's user so no chown has to copy the files into another layer.
RUN --mount=type=secret,id=hf_token,required=false,uid=10001 python - <<'EOF'
import os
import shutil
from pathlib import Path

from huggingface_hub import snapshot_download

models = os.environ.get("PRELOAD_MODELS", "").split()
secret = Path("/run/secrets/hf_token")
token = secret.read_text().strip() if secret.is_file() else None
patterns = [
    "model_index.json",
    "scheduler/*",
    "tokenizer/*",
    "tokenizer_2/*",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "text_encoder_2/config.json",
    "text_encoder_2/model.safetensors",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    # A standalone VAE (a job's vae_model) keeps these at the top level.
    "config.json",
    "diffusion_pytorch_model.safetensors",
]
for model in models:
    path = snapshot_download(
        model, cache_dir=os.environ["LORAFLEET_MODEL_CACHE_DIR"], allow_patterns=patterns,
        token=token,
    )
    print(f"preloaded {model} into {path}", flush=True)
# Transfer caches are not needed at run time; keep them out of the layer.
shutil.rmtree(Path(os.environ["HF_HOME"]) / "xet", ignore_errors=True)
EOF

# No VOLUME: the worker keeps instance images, checkpoints and results in memory and moves them
# over presigned URLs; nothing it must keep survives the container. The only disk it uses is the
# model cache above (baked in, or filled on first use).
#
# SIGTERM (what `docker stop`, SaladCloud and systemd send) starts a drain: the current step
# finishes, a checkpoint is uploaded from memory and committed, the job is re-queued, and the
# process exits 0 within LORAFLEET_DRAIN_GRACE_S (default 25 s). A second signal stops at once.
# Give the container more than that before SIGKILL (docker stop -t / --stop-timeout).
# `lorafleet` runs as PID 1 and handles the signals itself; it starts no child processes.
STOPSIGNAL SIGTERM

ENTRYPOINT ["lorafleet", "worker"]
