#!/usr/bin/env bash
# Build the standalone SM90 grouped GEMM harness, report ptxas resources and the HGMMA count of
# its SASS, then run every case (one process each, so a crash or hang costs one case) and print
# the table last. Env: CASES="0 3 11" to pick cases, CASE_TIMEOUT (seconds, default 40).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build
BIN=$BUILD/sm90_grouped_gemm_harness
mkdir -p "$BUILD"
cd "$ROOT"

echo "== build"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader 2>/dev/null || true
nvcc -std=c++20 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels \
    -DDGE_HANG_TRAP_CYCLES=4000000000 \
    tests/cuda/sm90_grouped_gemm_harness.cu -o "$BIN" -ldl >"$BUILD/ptxas.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
    cat "$BUILD/ptxas.log"
    echo "build failed ($rc)"
    exit $rc
fi
# One line per GEMM kernel instantiation: registers, stack and spills.
awk '/Compiling entry function/ { name = $0; sub(/.*sm90_grouped_gemm_kernel/, "gemm", name); sub(/ for .*/, "", name) }
     /spill stores/ && name != "" { spill = $0 }
     /Used [0-9]+ registers/ && name != "" { sub(/.*Used/, "Used"); printf "ptxas %s | %s | %s\n", name, $0, spill; name = "" }' \
    "$BUILD/ptxas.log" | sed -e 's/  */ /g' -e 's/ILNS_5sched15GroupedGemmTypeE/<type=/' -e 's/ELNS_3mma5MajorE/,majorA=/' \
        -e 's/ELS5_/,majorB=/' -e 's/ELj/,/g' -e 's/ELb/,paired=/' -e 's/ENS0_.*EEEv[^ |]*/>/'
if command -v cuobjdump >/dev/null 2>&1; then
    echo "SASS HGMMA instructions: $(cuobjdump --dump-sass "$BIN" | grep -c HGMMA)"
    echo "SASS local-memory ops in GEMM kernels: $(cuobjdump --dump-sass "$BIN" | awk '/Function :/ {g = /grouped_gemm/} g && /(LDL|STL)/' | wc -l)"
else
    echo "cuobjdump not found: SASS not checked"
fi

# cuBLAS for the dense ceiling: the system library, else the pip wheel next to torch.
if [ -z "${DGE_CUBLAS_LIB:-}" ]; then
    lib=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 / {print $NF; exit}')
    if [ -z "$lib" ]; then
        lib=$(python3 -c 'import glob, os, nvidia; print(next(iter(sorted(g for p in nvidia.__path__ for g in glob.glob(os.path.join(p, "**", "libcublas.so.*"), recursive=True))), ""))' 2>/dev/null)
    fi
    [ -n "$lib" ] && export DGE_CUBLAS_LIB=$lib && export LD_LIBRARY_PATH=$(dirname "$lib"):${LD_LIBRARY_PATH:-}
fi
echo "cuBLAS: ${DGE_CUBLAS_LIB:-<default search>}"

echo "== run"
CASES=${CASES:-$("$BIN" list | awk '{print $1}')}
TIMEOUT=${CASE_TIMEOUT:-40}
RESULTS=$BUILD/results.txt
: >"$RESULTS"
for c in $CASES; do
    timeout "$TIMEOUT" "$BIN" "$c" >"$BUILD/case_$c.log" 2>&1
    rc=$?
    if grep -q '^RESULT' "$BUILD/case_$c.log"; then
        grep '^RESULT' "$BUILD/case_$c.log" | sed "s/^RESULT/[$c]/" >>"$RESULTS"
    else
        echo "[$c] no result (exit $rc): $(tail -n 3 "$BUILD/case_$c.log" | tr '\n' ' ')" >>"$RESULTS"
    fi
done
echo "== results (TFLOP/s over routed pool rows; cuBLAS = dense GEMM of the same FLOPs)"
cat "$RESULTS"
