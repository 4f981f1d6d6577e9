#!/usr/bin/env bash
# One command for a GPU machine: GPU tests, then the benchmark; the short table comes last.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (the H200 run takes a few minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/dge_gpu_check}}
[ $# -gt 0 ] && shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DGE_JIT_CACHE_DIR=${DGE_JIT_CACHE_DIR:-/tmp/dge_jit_cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 -m pytest -q -rs tests 2>&1 | tee "$out/tests.log" | tail -5
status=${PIPESTATUS[0]}
python3 scripts/bench.py --json "$out/h200.json" --png "$out/h200.png" "$@" 2>&1 | tee "$out/bench.log"
exit $status
