#!/usr/bin/env bash
# Both GPU issues' check in one go (under 8 minutes), writing one JSON:
#
# - "kernels" (benchmarks/gpu_check.py): versions, the measured copy bandwidth, the Triton
#   kernel tests compiled on CUDA, the kernels against the torch backend at GPU sizes, and
#   decode bandwidth per KV format at batch 64 x context 1k and 4k beside the torch backend;
# - "engine" (benchmarks/gpu_engine.py): the engine on a random model of Llama-3.2-1B's shape,
#   batch 64, 512-token prompts, 256 output tokens, bf16 and fp8 KV, eager and CUDA graphs,
#   against transformers' generate: tokens/s, the decode step against its roofline, host time
#   and host waits per decode step, the pool at --gpu-memory-utilization 0.9.
#
# Each part has its own time limit; one that runs out or fails leaves the other's figures,
# and the JSON says which. Run from the repository root:
#
#     bash benchmarks/gpu_check.sh [OUT.json] [PYTHON]
#
# OUT defaults to $OUT/gpu_check.json when OUT is a directory (the device runner's), else
# ./gpu_check.json. The engine imports msgspec and pyzmq, which a GPU image may lack: wheels
# in .whl/ are installed first (for a CPython 3.12 image: `python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform
# manylinux2014_x86_64 -d .whl msgspec pyzmq`, with .whl/ kept out of git and carried to the
# GPU machine beside the working tree).
set -uo pipefail
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
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv,noheader || true
PARTS=$(mktemp -d)
timeout 270 "$PY" benchmarks/gpu_check.py --out "$PARTS/kernels.json" "${@:3}"
echo $? > "$PARTS/kernels.rc"
timeout 200 "$PY" -m benchmarks.gpu_engine 2>&1 | tee "$PARTS/engine.log"
echo "${PIPESTATUS[0]}" > "$PARTS/engine.rc"
"$PY" - "$PARTS" "$JSON" <<'EOF'
import json, sys
from pathlib import Path

parts, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {}
for name in ("kernels", "engine"):
    rc = int((parts / f"{name}.rc").read_text())
    if name == "kernels":
        f = parts / "kernels.json"
        got = json.loads(f.read_text()) if f.exists() else None
    else:
        lines = (parts / "engine.log").read_text().splitlines()
        last = [x for x in lines if x.startswith('{"')]
        got = json.loads(last[-1]) if last else None
    why = "timed out" if rc == 124 else f"exit status {rc}"
    result[name] = got if got is not None else {"ok": False, "error": f"no result: {why}"}
    result[name + "_exit_status"] = rc
out.write_text(json.dumps(result, indent=1))
print(json.dumps({"out": str(out), **{k: v for k, v in result.items() if k.endswith("status")}}))
EOF
