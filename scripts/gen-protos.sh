#!/usr/bin/env bash
# Regenerates the committed Python code for protos/ (the one command; CI runs it and fails on a diff).
set -euo pipefail
cd "$(dirname "$0")/.."
out=core
find "$out/lorafleet" -path '*/v1/*_pb2*' -delete
mapfile -t protos < <(cd protos && find lorafleet -name '*.proto' | sort)
python -m grpc_tools.protoc -I protos \
  --python_out="$out" --mypy_out="$out" \
  --grpc_python_out="$out" --mypy_grpc_out="$out" \
  "${protos[@]}"
