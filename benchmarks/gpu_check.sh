#!/usr/bin/env bash
# The Triton backend on a GPU in one go (under 8 minutes), writing one JSON: versions, the
# measured copy bandwidth, the kernels against the torch backend at GPU sizes, and decode
# bandwidth per KV format at batch 64 x context 1k and 4k beside the torch backend
# (benchmarks/gpu_check.py says what each figure is). Run from the repository root:
#
#     bash benchmarks/gpu_check.sh [OUT.json] [PYTHON]
#
# OUT defaults to $OUT/gpu_check.json when OUT is a directory (the device runner's), else
# ./gpu_check.json.
set -euo pipefail
if [ -n "${1:-}" ]; then
  JSON=$1
elif [ -d "${OUT:-}" ]; then
  JSON=$OUT/gpu_check.json
else
  JSON=gpu_check.json
fi
PY=${2:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv,noheader || true
timeout 450 "$PY" benchmarks/gpu_check.py --out "$JSON" "${@:3}"
