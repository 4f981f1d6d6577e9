#!/usr/bin/env bash
# One command for a GPU machine: warm the JIT cache, run every test (GPU tests run there, CPU tests
# too), then the benchmark; the short table comes last.
# Usage: bash scripts/gpu_check.sh [OUT_DIR] [bench.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/dge_gpu_check}}
[ $# -gt 0 ] && shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DGE_JIT_CACHE_DIR=${DGE_JIT_CACHE_DIR:-/tmp/dge_jit_cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 -m deep_gemm_ext.jit build --arch sm_90a --all -j "$(nproc)" > "$out/jit_build.log" 2>&1 \
  || { tail -20 "$out/jit_build.log"; exit 1; }
tail -1 "$out/jit_build.log"
# Several workers share the GPU; test_gpu_fuzz has its own time budget and runs alone.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
python3 -m pytest -q -rs $workers --ignore=tests/test_gpu_fuzz.py tests > "$out/tests.log" 2>&1
status=$?
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20; tail -1 "$out/tests.log"
python3 scripts/bench.py --json "$out/h200.json" --png "$out/h200.png" "$@" 2>&1 | tee "$out/bench.log"
exit $status
