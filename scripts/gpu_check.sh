#!/usr/bin/env bash
# One command for a GPU machine: warm the JIT cache, run every test (GPU tests run there, CPU tests
# too; the emulated expert-parallel ranks in a process of their own), the fuzz, optionally the
# bit-identity check against an older tree, then the benchmarks; each step has a time limit, logs go
# to OUT_DIR, and the short tables come last.
#
# Usage: bash scripts/gpu_check.sh [OUT_DIR] [STEP ...]
#   steps (default: all but variants): build tests fuzz compare bench transformers variants
#   OLD_TREE=/path/to/older/tree  compare: y and gradients bit for bit against that tree (--hash-only)
#   BENCH_ARGS="--workloads ..."  extra arguments of scripts/bench.py
#   VARIANTS_ARGS="--workloads ..."  extra arguments of scripts/layer_variants.py (variants: the layer with GEMM
#                                 options its plan does not take, time and J per step against the default)
#   TEST_WORKERS=6                pytest-xdist workers of the tests step
#   TESTS="tests/test_a.py ..."   the tests step's files (default: tests, all of them), to split it over runs
#   TESTS_LIMIT=900               the tests step's time limit in seconds
#   a wheel .whl/liger_kernel-*.whl (pure Python) is unpacked onto PYTHONPATH for the Liger rows,
#   .whl/nvidia_ml_py-*.whl for bench.py's SM clock and power columns (where pynvml is missing)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/dge_gpu_check}}
[ $# -gt 0 ] && shift
steps=${*:-build tests fuzz compare bench transformers}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 DGE_JIT_CACHE_DIR=${DGE_JIT_CACHE_DIR:-/tmp/dge_jit_cache}
summary="$out/summary.txt"; : > "$summary"
start=$(date +%s)
note() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$summary"; }
has() { [[ " $steps " == *" $1 "* ]]; }
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
for wheel in .whl/liger_kernel-*.whl; do
  [ -f "$wheel" ] || continue
  python3 -m zipfile -e "$wheel" /tmp/dge_liger && export PYTHONPATH=/tmp/dge_liger${PYTHONPATH:+:$PYTHONPATH}
  note "liger: $(python3 -c 'import liger_kernel.ops as o; print("importable from", o.__file__)' 2>&1 | tail -1)"
done
# nvidia-ml-py (pure Python) for the benchmark's SM clock and power columns, where python3 lacks pynvml
for wheel in .whl/nvidia_ml_py-*.whl; do
  [ -f "$wheel" ] || continue
  python3 -c "import pynvml" 2>/dev/null && break
  python3 -m zipfile -e "$wheel" /tmp/dge_nvml && export PYTHONPATH=/tmp/dge_nvml${PYTHONPATH:+:$PYTHONPATH}
  note "nvml: $(python3 -c 'import pynvml; print("importable from", pynvml.__file__)' 2>&1 | tail -1)"
done
if has build; then
  timeout 600 python3 -m deep_gemm_ext.jit build --arch sm_90a --all -j "$(nproc)" > "$out/jit_build.log" 2>&1 \
    || { tail -20 "$out/jit_build.log"; exit 1; }
  note "build: $(tail -1 "$out/jit_build.log")"
fi
if has tests; then
  # Several workers share the GPU; test_gpu_fuzz has its own time budget and runs alone.
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-6}" || echo "")
  # -v: each test's outcome is logged as it ends, so a run cut by the time limit still names its failures.
  timeout "${TESTS_LIMIT:-900}" python3 -m pytest -v -rfE $workers --ignore=tests/test_gpu_fuzz.py \
    --ignore=tests/test_gpu_ep_symmetric.py --ignore=tests/test_gpu_ep_overlap.py ${TESTS:-tests} > "$out/tests.log" 2>&1 \
    || status=1
  note "tests: $(tail -1 "$out/tests.log")"
  grep -E "(^|\] )(FAILED|ERROR) " "$out/tests.log" | sort -u | head -30 | tee -a "$summary"
  # Ranks emulated on one GPU: their own process, with the driver settings they need from CUDA's start.
  CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 DGE_EP_TIMEOUT_S=${DGE_EP_TIMEOUT_S:-30} \
    timeout 600 python3 -m pytest -q -rfE tests/test_gpu_ep_symmetric.py tests/test_gpu_ep_overlap.py > "$out/tests_ep.log" 2>&1 || status=1
  note "tests (emulated EP ranks): $(tail -1 "$out/tests_ep.log")"
  grep -E "^(FAILED|ERROR)" "$out/tests_ep.log" | head -30 | tee -a "$summary"
fi
if has fuzz; then
  timeout 300 python3 -m pytest -q tests/test_gpu_fuzz.py > "$out/fuzz.log" 2>&1 || status=1
  note "fuzz: $(tail -1 "$out/fuzz.log")"
fi
if has compare && [ -n "${OLD_TREE:-}" ]; then
  timeout 900 python3 scripts/compare_trees.py "$OLD_TREE" . --hash-only --cache-root "$out/compare_cache" \
    --work-dir "$out/compare_work" > "$out/compare.log" 2>&1 || status=1
  note "compare against $OLD_TREE: $(grep -E 'cases identical' "$out/compare.log" | tail -1)"
fi
if has bench; then
  timeout 900 python3 scripts/bench.py --json "$out/h200.json" --png "$out/h200.png" ${BENCH_ARGS:-} \
    > "$out/bench.log" 2>&1 || status=1
  note "bench"; grep -E "^\||not measured" "$out/bench.log" | tee -a "$summary"
fi
if has variants; then
  timeout 600 python3 scripts/layer_variants.py ${VARIANTS_ARGS:-} > "$out/variants.log" 2>&1 || status=1
  note "layer variants"; grep -E "^\|" "$out/variants.log" | tee -a "$summary"
fi
if has transformers; then
  timeout 300 python3 scripts/bench_transformers.py --json "$out/bench_transformers.json" > "$out/bench_tf.log" 2>&1 \
    || status=1
  note "transformers"; grep -E "^\|" "$out/bench_tf.log" | tee -a "$summary"
fi
echo "===== summary"; cat "$summary"
exit $status
