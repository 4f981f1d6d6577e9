"""The one place that reads ``DGE_*`` environment variables.

Every knob is documented in README.md ("Environment variables"). Values are read on each call
so tests (and users) can flip them at run time with ``os.environ``.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

# Per thread, while recording() is active: every variable a knob read, with the raw value it saw
# (None: unset). Threads resolve plans at once (emulated ranks, the autograd engine's thread).
_local = threading.local()


def _get(name: str, default=None):
    """``os.environ.get(name, default)``, noted by an active :func:`recording` of this thread."""
    raw = _raw(name)
    recorded = getattr(_local, "recorded", None)
    if recorded is not None:
        recorded.setdefault(name, raw)
    return default if raw is None else raw


@contextlib.contextmanager
def recording():
    """Within (on this thread): the knobs note the variables they read; yields the dict ``{name: raw
    value or None}``, complete when the block ends. A decision made from knobs stays valid while
    :func:`unchanged` says so (deep_gemm_ext.plan caches its resolution this way)."""
    outer = getattr(_local, "recorded", None)
    reads = _local.recorded = {}
    try:
        yield reads
    finally:
        _local.recorded = outer
        if outer is not None:
            for name, raw in reads.items():
                outer.setdefault(name, raw)


def note(reads: tuple) -> None:
    """Add ``(name, raw value)`` pairs read earlier to this thread's active :func:`recording`, if any
    (a decision reused from a cache depends on the variables it read when it was made)."""
    recorded = getattr(_local, "recorded", None)
    if recorded is not None:
        for name, raw in reads:
            recorded.setdefault(name, raw)


def unchanged(reads: tuple) -> bool:
    """Whether every ``(name, raw value)`` of a :func:`recording` still reads the same."""
    for name, raw in reads:
        if _raw(name) != raw:
            return False
    return True


_ENCODED_KEYS: dict = {}


def _raw(name: str):
    """``os.environ.get(name)``. Where ``os.environ`` is CPython's mapping over its encoded ``_data``
    (what ``os.environ[...] = ...`` and ``del`` update), the key is looked up there: ``os.environ.get``
    of an unset name raises and catches a KeyError inside (~1 µs, and most ``DGE_*`` names are unset),
    and a cached call checks a dozen names (:func:`unchanged`)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(environ) is not os._Environ or type(data) is not dict:
        return environ.get(name)
    key = _ENCODED_KEYS.get(name)
    if key is None:
        key = _ENCODED_KEYS[name] = environ.encodekey(name)
    value = data.get(key)
    return None if value is None else environ.decodevalue(value)


def _flag(name: str, default: bool = False) -> bool:
    value = _get(name, "1" if default else "0").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of 0/1/true/false/yes/no/on/off")


def jit_cache_dir() -> Path:
    """DGE_JIT_CACHE_DIR: where compiled kernels live (default ~/.deep_gemm_ext)."""
    return Path(_get("DGE_JIT_CACHE_DIR", str(Path.home() / ".deep_gemm_ext"))).expanduser()


def jit_debug() -> bool:
    """DGE_JIT_DEBUG: log every compile and cache hit, keep temporary build files."""
    return _flag("DGE_JIT_DEBUG")


def jit_use_nvrtc() -> bool:
    """DGE_JIT_USE_NVRTC: compile with NVRTC even when nvcc is found."""
    return _flag("DGE_JIT_USE_NVRTC")


def jit_nvcc_compiler() -> str | None:
    """DGE_JIT_NVCC_COMPILER: path of the nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH)."""
    return _get("DGE_JIT_NVCC_COMPILER") or None


def jit_ptxas_verbose() -> bool:
    """DGE_JIT_PTXAS_VERBOSE: print ptxas' resource report (registers, spills, smem) per compile."""
    return _flag("DGE_JIT_PTXAS_VERBOSE")


def jit_dump_ptx() -> bool:
    """DGE_JIT_DUMP_PTX: keep the PTX next to the cubin in the cache entry."""
    return _flag("DGE_JIT_DUMP_PTX")


def jit_dump_sass() -> bool:
    """DGE_JIT_DUMP_SASS: write the SASS (cuobjdump) next to the cubin in the cache entry."""
    return _flag("DGE_JIT_DUMP_SASS")


def jit_with_lineinfo() -> bool:
    """DGE_JIT_WITH_LINEINFO: compile with -lineinfo (for compute-sanitizer / ncu source view)."""
    return _flag("DGE_JIT_WITH_LINEINFO")


def print_configs() -> bool:
    """DGE_PRINT_CONFIGS: print the chosen SM90 GEMM config (tile, stages, grid, smem) of every launch
    to stderr."""
    return _flag("DGE_PRINT_CONFIGS")


def use_jit_kernels() -> bool:
    """DGE_DISABLE_JIT: set to 1 to run the GPU path on torch ops only (no JIT kernels)."""
    return not _flag("DGE_DISABLE_JIT")


_GATHER_MODES = {"cp_async": "cp_async", "1": "cp_async", "on": "cp_async", "true": "cp_async", "yes": "cp_async",
                 "0": None, "off": None, "false": None, "no": None, "": None}


def fused_gather() -> str | None:
    """DGE_FUSED_GATHER: the SM90 L1 forward GEMM gathers its rows of x itself (no dispatched pool
    in the forward; the backward rebuilds it for dW1, so the layer saves x instead of the
    [T*K, H] pool). ``cp_async`` (default; also 1) names the loader; 0 gathers into a pool first
    and saves it for dW1 (faster by about 1% of a step on the H100, at the pool's memory).
    Returns the loader or None."""
    value = _get("DGE_FUSED_GATHER", "cp_async").strip().lower()
    if value not in _GATHER_MODES:
        raise ValueError(f"DGE_FUSED_GATHER={os.environ['DGE_FUSED_GATHER']!r}: expected cp_async, 1 or 0")
    return _GATHER_MODES[value]


def fused_gather_backward() -> bool | None:
    """DGE_FUSED_GATHER_BACKWARD: where the forward gathered x in its L1 GEMM and the weight gradients
    are fp8 on our SM90 kernels, the backward builds no pools of dy and x: the kernels that quantize
    its operands read the token rows themselves (the default there). 0 turns that off (the quantizers
    then read pools). bf16 weight gradients always read pools gathered once: a K-grouped GEMM that
    gathers re-reads each row for every tile of its expert (1.9-4.2x the GEMM on a pool,
    docs/perf-notes.md v39), so 1 changes nothing there. None when unset."""
    if not _get("DGE_FUSED_GATHER_BACKWARD", "").strip():
        return None
    return _flag("DGE_FUSED_GATHER_BACKWARD")


def fused_combine() -> bool:
    """DGE_FUSED_COMBINE: on SM90 the L2 forward GEMM and the L1 dgrad GEMM write each pool row into its
    token's top-k slot (the L2 one times the top-k weight) and an ordered reduction over each token's
    contiguous top-k rows gives y and dx, instead of a GEMM output in pool order and a gathering
    combine. Default on; 0 restores the pool-order output."""
    return _flag("DGE_FUSED_COMBINE", default=True)


def fp8_wgrad() -> str | None:
    """DGE_FP8_WGRAD: under recipe="fp8", the weight-gradient GEMMs take column-quantized fp8
    operands (``fp8``) or bf16 ones (``bf16``: unquantized operands, twice the bytes). None when
    unset: the plan then takes bf16 on our SM90 kernels (their fp8 K-grouped GEMM is opt-in until
    measured faster) and fp8 elsewhere."""
    if not _get("DGE_FP8_WGRAD", "").strip():
        return None
    value = os.environ["DGE_FP8_WGRAD"].strip().lower()
    if value not in ("fp8", "bf16"):
        raise ValueError(f"DGE_FP8_WGRAD={os.environ['DGE_FP8_WGRAD']!r}: expected fp8 or bf16")
    return value


def fp8_weight_kernel() -> bool:
    """DGE_FP8_WEIGHT_KERNEL: 1 quantizes bf16 CUDA expert weights (once per weight version) with the JIT
    kernel that writes both 128x128-block copies in one pass (``jit_kernels.quantize_weight_blocks_fp8``,
    the same bits as the torch quantizer by construction); default 0, the torch quantizer, until the
    kernel's GPU test and timing have run."""
    return _flag("DGE_FP8_WEIGHT_KERNEL", default=False)


def eager_custom_op() -> bool:
    """DGE_EAGER_CUSTOM_OP: 1 routes eager calls of the layer through its ``torch.library`` custom
    ops, as under torch.compile. Default off: eager calls with plain CPU / CUDA tensors (no tensor
    subclass, meta tensor, dispatch or function mode, functorch transform or torch.jit.trace) run the
    same forward and backward through a ``torch.autograd.Function``, which skips the dispatcher's
    per-call work; same results bit for bit."""
    return _flag("DGE_EAGER_CUSTOM_OP", default=False)


def check_ids() -> bool | None:
    """DGE_CHECK_IDS: 1 checks topk_idx's range on the host (one sync per forward on a GPU), 0 never
    does; unset (the default) checks on the host for CPU tensors only, and leaves GPU tensors to a
    device-side assertion (no sync)."""
    if not _get("DGE_CHECK_IDS", "").strip():
        return None
    return _flag("DGE_CHECK_IDS")


def ep_timeout_s() -> float:
    """DGE_EP_TIMEOUT_S: seconds a wait of the symmetric-memory exchange spins on a peer's flag
    before it prints which rank waited on which flag of which peer and traps (default 600, NCCL's
    default timeout: ranks may be that far apart at a checkpoint or an evaluation)."""
    raw = _get("DGE_EP_TIMEOUT_S", "").strip()
    if not raw:
        return 600.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < 1e9):
        raise ValueError(f"DGE_EP_TIMEOUT_S={os.environ['DGE_EP_TIMEOUT_S']!r}: expected a positive number of seconds")
    return value


def ep_overlap() -> bool:
    """DGE_EP_OVERLAP: overlap the symmetric-memory dispatch's pull of x's rows with the L1 forward
    GEMM, which waits tile by tile for the source ranks of its rows (default off; bf16 rows, the
    sm90 provider with the cp.async gather; elsewhere the layer runs as without it)."""
    return _flag("DGE_EP_OVERLAP")


def cuda_device_max_connections() -> int:
    """CUDA_DEVICE_MAX_CONNECTIONS (the CUDA driver's, read when the context is created; default 8):
    hardware queues the device's streams share. Ranks emulated on one GPU need one per rank and
    more, or one rank's waiting kernel can hold back another rank's launches in a shared queue."""
    raw = _get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    return int(raw) if raw.isdigit() else 8


def commit_label() -> str | None:
    """DGE_COMMIT: the commit scripts/bench.py writes into its records (for a tree without git history)."""
    return _get("DGE_COMMIT") or None


def cuda_home() -> Path | None:
    """CUDA_HOME (or CUDA_PATH): the CUDA toolkit the JIT takes nvcc and headers from."""
    value = _get("CUDA_HOME") or _get("CUDA_PATH")
    return Path(value).expanduser() if value else None
