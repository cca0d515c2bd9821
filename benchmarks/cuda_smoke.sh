#!/usr/bin/env bash
# The CUDA smoke test: the same tests and the same throughput benchmark as on the
# CPU, with the engine on a GPU. Run from the repository root on a machine with CUDA and a
# python that has torch, transformers, pytest and hypothesis (a GPU box's stock image);
# everything goes to stdout and, when OUT is set, to $OUT/cuda_smoke.log.
#
#     bash benchmarks/cuda_smoke.sh [PYTHON]
set -uo pipefail
PY=${1:-python3}
LOG=${OUT:-/tmp}/cuda_smoke.log
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Load every CUDA kernel at start: lazily loaded ones cost their first call milliseconds,
# which would land in whichever engine and dtype happens to run first.
export CUDA_MODULE_LOADING=EAGER
# Packages the GPU image lacks (the server's, redis' client), carried as wheels in .whl/.
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"
  echo "== tests with the engine on cuda (KVSERVE_TEST_DEVICE=cuda; Redis tests left out)"
  KVSERVE_TEST_DEVICE=cuda timeout 240 $PY -m pytest -q -p no:cacheprovider --tb=short -rf -k "not redis" --continue-on-collection-errors \
    -W ignore::DeprecationWarning tests/test_host_copies.py tests/test_exactness.py tests/test_prefix_caching.py \
    tests/test_kv_offload.py tests/test_kv_tiers.py tests/test_sampling.py \
    tests/test_kv_quant.py tests/test_engine_core.py tests/test_hybrid_kv.py \
    tests/test_retention.py tests/test_prefix_transfer.py ${KVSERVE_SMOKE_TESTS:-} 2>&1 | tee ${OUT:-/tmp}/cuda_tests.log | tail -100
  echo "== throughput on cuda"
  timeout 200 $PY -m benchmarks.throughput --device cuda --sizes ${KVSERVE_SMOKE_SIZES:-5m,50m,135m} \
    --dtype both --hf-batch-sizes 32,64 --agreement 2>&1 | grep -v Warning
} 2>&1 | tee "$LOG"
