#!/usr/bin/env bash
# compute-sanitizer over scripts/sanitize_driver.py (every kernel path at tiny shapes):
# memcheck, racecheck, synccheck and initcheck. Prints each tool's summary lines, the kernels
# named in its findings, and a final table; exits non-zero on any finding or failed run.
#
# Usage: bash scripts/sanitize.sh [OUT_DIR] [--ours-only]
#   OUT_DIR      logs (default $OUT or /tmp/dge_sanitize); the JIT cache goes to $DGE_JIT_CACHE_DIR
#   --ours-only  instrument only this package's kernels (namespace dge) in racecheck / synccheck,
#                for when torch's own kernels report hazards that are not ours
# About 2-4 minutes on an H200 with a warm JIT cache (kernels are built once, untimed, first).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/dge_sanitize}
ours_only=0
for arg in "$@"; do
    case "$arg" in
        --ours-only) ours_only=1 ;;
        *) out=$arg ;;
    esac
done
mkdir -p "$out"
# -lineinfo puts file:line into the reports; no caching allocator, so every tensor is its own
# allocation and memcheck / initcheck see the bounds of each one.
export PYTHONUNBUFFERED=1 DGE_JIT_WITH_LINEINFO=1 DGE_JIT_CACHE_DIR=${DGE_JIT_CACHE_DIR:-$out/jit_cache}
san=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$san" ]; then
    echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 3
fi
"$san" --version | tail -1
tool_timeout=${SANITIZE_TOOL_TIMEOUT:-200}

# The driver once without a tool: builds the kernels (untimed by the tools) and tells a plain
# failure apart from a sanitizer finding.
start=$SECONDS
python3 scripts/sanitize_driver.py > "$out/plain.log" 2>&1
plain_rc=$?
echo "plain run: rc=$plain_rc in $((SECONDS - start)) s: $(tail -1 "$out/plain.log")"
if [ $plain_rc = 2 ]; then
    exit 2  # no GPU
fi

declare -a rows
status_all=0
run_tool() {  # name, tool, driver args (one word), extra sanitizer flags...
    local name=$1 tool=$2 driver_args=$3; shift 3
    local log="$out/$name.log" t0=$SECONDS rc
    # shellcheck disable=SC2086
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 10 "$tool_timeout" "$san" --tool "$tool" --target-processes all \
        --error-exitcode 86 --print-limit 200 "$@" python3 scripts/sanitize_driver.py $driver_args > "$log" 2>&1
    rc=$?
    local secs=$((SECONDS - t0)) status
    case $rc in
        0) status=clean ;;
        86) status=FINDINGS ;;
        124) status=TIMEOUT ;;
        1) status=DRIVER-RAISED ;;
        *) status="FAILED(rc=$rc)" ;;
    esac
    # cuda-python resolves every driver entry point by name when it first calls the driver; the
    # ones this driver lacks answer CUDA_ERROR_INVALID_VALUE to cuGetProcAddress, which memcheck
    # reports as API errors. They come from no kernel and no call of ours: counted, not findings.
    local probes others
    probes=$(grep -c 'Program hit CUDA_ERROR_INVALID_VALUE .* on CUDA API call to cuGetProcAddress' "$log")
    others=$(grep -E '^=+ [A-Z]' "$log" | grep -vE 'COMPUTE-SANITIZER|SUMMARY|cuGetProcAddress|Target application returned|LEAK' | grep -c .)
    if [ "$rc" = 86 ] && [ "$others" = 0 ] && ! grep -q "errors were not printed" "$log"; then
        status="clean (+${probes} cuGetProcAddress probes)"
    fi
    if grep -q -i "device not supported\|unable to find injection library" "$log"; then
        status=UNSUPPORTED  # e.g. a gVisor sandbox: compute-sanitizer cannot attach there
    fi
    if [ "$expect_findings" = 1 ]; then
        [ "$status" = FINDINGS ] && status="FINDINGS (expected)" || status_all=1
    else
        case "$status" in clean*) ;; *) status_all=1 ;; esac
    fi
    echo "== $name: $status (rc=$rc, ${secs} s)"
    grep -E "SUMMARY" "$log" | sed 's/^/   /'
    # The first findings verbatim, so the report alone says what and where.
    grep -E "^=+ +(Invalid|Program hit|Error|Warning|Race|Uninitialized|Barrier|Address|Saved host|[A-Z][a-z]+ access)" "$log" \
        | grep -v cuGetProcAddress | head -6 | cut -c1-200 | sed 's/^/   > /'
    # The kernels named in the findings, ours (namespace dge) marked, and the driver cases whose
    # runs they fall in (a case prints its status line when it ends).
    python3 - "$log" <<'EOF'
import collections, re, sys
text = open(sys.argv[1], errors="replace").read()
cases, pending = collections.Counter(), 0
for line in text.splitlines():
    if re.match(r"^=+ +(Invalid|Program hit|Error|Race|Uninitialized|Barrier|[A-Z][a-z]+ access)", line) \
            and "cuGetProcAddress" not in line:
        pending += 1
    elif re.match(r"^(ok|ERROR|skipped) +\S", line) and pending:
        cases[line.split(None, 1)[1][:100]] += pending
        pending = 0
for name, n in cases.most_common(6):
    print(f"   {n:4d}  in case: {name}")
kernels = collections.Counter()
# "at <kernel>(<args>)+0x.. in file:line" (also "Race reported between Write access at ...").
for m in re.finditer(r"^=+\s.*?\bat (?:0x[0-9a-f]+ in )?(.+?\(.*\))(?:\+0x[0-9a-f]+)?(?: in .*)?$", text, re.M):
    kernels[m.group(1).strip()[:110]] += 1
for name, n in kernels.most_common(10):
    ours = "dge::" in name or "_ZN3dge" in name
    print(f"   {n:4d}  {'ours ' if ours else 'other'}  {name}")
EOF
    rows+=("$(printf '%-16s %-40s %6s  %s' "$name" "$status" "$secs" "$log")")
}
expect_findings=0

filter=()
if [ $ours_only = 1 ]; then
    filter=(--kernel-name kns=dge)
fi
run_tool memcheck memcheck ""
run_tool racecheck racecheck "" ${filter[@]+"${filter[@]}"}
run_tool synccheck synccheck "" ${filter[@]+"${filter[@]}"}
# initcheck does not track TMA bulk stores: a host read of memory only a TMA store wrote is
# reported as uninitialized (the probe shows it, and is expected to be flagged). So initcheck runs
# the kernel cases without host reads of TMA-stored outputs, and the layer cases (whose combine and
# SwiGLU kernels read TMA-stored GEMM outputs) are left to memcheck; that every row of a GEMM output
# is written is tested with NaN-poisoned outputs in tests/test_gpu_grouped_gemm.py.
run_tool initcheck initcheck "--part kernels --initcheck"
expect_findings=1
run_tool initcheck-probe initcheck "--part tma-store-probe"
expect_findings=0

echo
printf '%-16s %-40s %6s  %s\n' tool status secs log
printf '%-16s %-40s %6s  %s\n' "plain" "rc=$plain_rc" "" "$out/plain.log"
for row in "${rows[@]}"; do echo "$row"; done
[ $plain_rc = 0 ] || status_all=1
echo "sanitize: $([ $status_all = 0 ] && echo CLEAN || echo 'NOT CLEAN') in $SECONDS s"
exit $status_all
