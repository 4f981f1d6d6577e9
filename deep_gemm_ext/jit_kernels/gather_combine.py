"""Dispatch (gather tokens into the expert-ordered pool) and combine (weighted top-k sum back)
on one GPU, by routing metadata (kernels/impls/gather_combine.cuh). Deterministic, no atomics."""
from __future__ import annotations

import ctypes

import torch

from .. import jit

_INCLUDE = "#include <impls/gather_combine.cuh>\n"
_THREADS = 256
_WARPS = _THREADS // 32
_CTAS_PER_SM = 8
MAX_TOP_K = 32
# Element sizes the gather serves: bf16 activations, fp8 ones and their fp32 1x128 scales.
_GATHER_DTYPES = {torch.bfloat16: 2, torch.float8_e4m3fn: 1, torch.float32: 4}


def _gather_code(elem_bytes: int, stream_stores: bool) -> str:
    flag = "true" if stream_stores else "false"
    return _INCLUDE + (f"template __global__ void dge::gather_rows_kernel<{elem_bytes}, {flag}>"
                       f"(const void*, const int*, void*, long long, int, int, int);\n")


def _scatter_code(elem_bytes: int) -> str:
    return _INCLUDE + (f"template __global__ void dge::scatter_token_rows_kernel<{elem_bytes}>"
                       f"(const void*, const int*, const int*, void*, long long, int, int, long long);\n")


def _combine_code(weighted: bool, slot_order: bool) -> str:
    flags = ", ".join("true" if f else "false" for f in (weighted, slot_order))
    return _INCLUDE + (f"template __global__ void dge::combine_rows_kernel<{flags}>"
                       f"(const __nv_bfloat16*, const int*, const float*, __nv_bfloat16*, long long, int, int, int);\n")


_GATHER = {(b, cs): (f"gather_rows_{8 * b}bit{'_cs' if cs else ''}", _gather_code(b, cs))
           for b in sorted(set(_GATHER_DTYPES.values())) for cs in (False, True)}
_SCATTER = {b: (f"gather_token_rows_{8 * b}bit", _scatter_code(b)) for b in sorted(set(_GATHER_DTYPES.values()))}
_COMBINE = {(w, s): (f"combine_{'slots' if s else 'rows'}_{'weighted' if w else 'unweighted'}", _combine_code(w, s))
            for s in (False, True) for w in (False, True)}


_ZERO_PAST = ("zero_rows_past", _INCLUDE + "template __global__ void dge::zero_rows_past_kernel<uint4>"
                                            "(void*, const int*, int, long long, int);\n")


_TAKE_OR_ZERO = ("take_or_zero_fp32", _INCLUDE + "template __global__ void dge::take_or_zero_kernel<float>"
                                                 "(const float*, long long, const int*, float*, long long);\n")


@jit.register("gather_combine")
def configs():
    return [(name, code, False) for name, code in [*_GATHER.values(), *_SCATTER.values(), *_COMBINE.values(),
                                                    _ZERO_PAST, _TAKE_OR_ZERO]]


def _grid(rows: int, device) -> tuple[int, int, int]:
    return (max(1, min(-(-rows // _WARPS), jit.num_sms(device) * _CTAS_PER_SM)), 1, 1)


def _check_cuda(label: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise ValueError(f"{label}: expected a CUDA tensor, got "
                         f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")


def _check_index(label: str, tensor, device) -> None:
    _check_cuda(label, tensor)
    if tensor.dtype != torch.int32 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{label}: expected a contiguous 1-D int32 tensor, got {tensor.dtype} {tuple(tensor.shape)} "
                         f"(strides {tensor.stride()})")
    if tensor.device != device:
        raise ValueError(f"{label}: on {tensor.device}, expected {device}")
    _check_int32(f"{label}'s length", tensor.shape[0])


_INT32_MAX = 2**31 - 1


def _check_int32(label: str, value: int) -> None:
    """Sizes the kernels take as (or compute in) 32-bit ints."""
    if value > _INT32_MAX:
        raise ValueError(f"{label}={value}: expected at most 2^31 - 1 (the kernels index in 32-bit ints)")


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous and at a 16-byte aligned address (the kernels move 16-byte vectors): a copy
    where a view starts mid-vector."""
    tensor = tensor.contiguous()
    return tensor.clone() if tensor.data_ptr() % 16 else tensor


def _check_top_k(top_k, limit: int | None = None) -> None:
    limit = _INT32_MAX if limit is None else limit
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or top_k > limit:
        raise ValueError(f"top_k={top_k!r}: expected an int in [1, {limit}]")


def gather_rows(x: torch.Tensor, row_to_slot: torch.Tensor, top_k: int, *, stream_stores: bool = False,
                slot_to_row: torch.Tensor | None = None) -> torch.Tensor:
    """pool [P, H]: row r = x[row_to_slot[r] // top_k], zeros where row_to_slot[r] < 0. ``stream_stores``
    writes the pool with evict-first (``st.global.cs``) stores, which leave L2 to the source rows each of
    which is read top_k times (same bits either way). ``slot_to_row`` [T * top_k] (the routing's inverse
    map, top_k <= 32): the kernel walks the tokens instead, reading each of x's rows once and storing it
    to its slots' rows, then zeroing the rows no slot maps to; the same pool where the two maps are
    inverse over the used slots (as routing metadata is). Its stores are plain (``stream_stores`` is for
    the row walk, whose source rows are read top_k times)."""
    _check_cuda("x", x)
    if x.dtype not in _GATHER_DTYPES:
        raise TypeError(f"x: dtype {x.dtype}, expected one of {list(_GATHER_DTYPES)}")
    elem = _GATHER_DTYPES[x.dtype]
    if x.dim() != 2 or (x.shape[1] * elem) % 16:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [T, H] with H * {elem} bytes a multiple of 16")
    _check_index("row_to_slot", row_to_slot, x.device)
    _check_top_k(top_k)
    if not isinstance(stream_stores, bool):
        raise ValueError(f"stream_stores={stream_stores!r}: expected a bool")
    if slot_to_row is not None:
        _check_index("slot_to_row", slot_to_row, x.device)
        _check_top_k(top_k, MAX_TOP_K)
        if stream_stores:
            raise ValueError("stream_stores=True with slot_to_row: the token walk reads each source row once and "
                             "stores plainly; evict-first stores are for the row walk")
        if slot_to_row.shape[0] != x.shape[0] * top_k:
            raise ValueError(f"slot_to_row: {slot_to_row.shape[0]} slots, expected T * top_k = {x.shape[0]} * "
                             f"{top_k} = {x.shape[0] * top_k}")
    x = _aligned(x)
    num_tokens, hidden = x.shape
    _check_int32("x.shape[0] (tokens)", num_tokens)
    _check_int32("x's row bytes", hidden * elem)
    _check_int32("tokens * top_k", num_tokens * top_k)
    rows = row_to_slot.shape[0]
    pool = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows == 0 or hidden == 0:
        return pool
    if slot_to_row is not None:
        with jit.device_guard(x):
            jit.build(*_SCATTER[elem]).launch(
                _grid(max(num_tokens, -(-rows // 32)), x.device), (_THREADS, 1, 1),
                (x, slot_to_row, row_to_slot, pool, ctypes.c_int64(num_tokens), ctypes.c_int32(hidden),
                 ctypes.c_int32(top_k), ctypes.c_int64(rows)))
        return pool
    with jit.device_guard(x):
        jit.build(*_GATHER[elem, stream_stores]).launch(
            _grid(rows, x.device), (_THREADS, 1, 1),
            (x, row_to_slot, pool, ctypes.c_int64(rows), ctypes.c_int32(hidden), ctypes.c_int32(top_k),
             ctypes.c_int32(num_tokens)))
    return pool


def combine_rows(o: torch.Tensor, slot_to_row: torch.Tensor, weights: torch.Tensor | None,
                 top_k: int) -> torch.Tensor:
    """y [T, H] bf16: y[t] = sum over k = 0..K-1 of weights[t, k] * o[slot_to_row[t*K + k]] in fp32,
    skipping unused slots (-1); ``weights=None`` means all ones."""
    return _combine(o, slot_to_row, weights, top_k, slot_order=False)


def combine_slots(o_slots: torch.Tensor, slot_to_row: torch.Tensor, top_k: int,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] bf16: y[t] = sum over k = 0..K-1 of weights[t, k] * o_slots[t*K + k] in fp32, in k order,
    for o_slots [T*K, H] already in slot order (a GEMM's combine epilogue, see
    sm90_bf16_grouped_gemm.Scatter, writes it); slots that slot_to_row marks unused (-1) are skipped,
    so their rows of o_slots are never read. ``weights=None`` means all ones (the weights were
    applied in the epilogue)."""
    return _combine(o_slots, slot_to_row, weights, top_k, slot_order=True)


def _combine(o, slot_to_row, weights, top_k, *, slot_order: bool) -> torch.Tensor:
    label = "o_slots" if slot_order else "o"
    _check_cuda(label, o)
    if o.dtype != torch.bfloat16 or o.dim() != 2 or o.shape[1] % 8:
        raise ValueError(f"{label}: expected a bf16 [rows, H] tensor with H divisible by 8, got {o.dtype} "
                         f"{tuple(o.shape)}")
    _check_index("slot_to_row", slot_to_row, o.device)
    _check_top_k(top_k, MAX_TOP_K)
    if slot_order and o.shape[0] != slot_to_row.shape[0]:
        raise ValueError(f"o_slots: shape {tuple(o.shape)}, expected {slot_to_row.shape[0]} rows (one per slot of "
                         f"slot_to_row)")
    if slot_to_row.shape[0] % top_k:
        raise ValueError(f"slot_to_row: {slot_to_row.shape[0]} slots is not a multiple of top_k={top_k}")
    num_tokens = slot_to_row.shape[0] // top_k
    if weights is not None:
        _check_cuda("weights", weights)
        if weights.dtype != torch.float32 or tuple(weights.shape) != (num_tokens, top_k) or weights.device != o.device:
            raise ValueError(f"weights: expected float32 ({num_tokens}, {top_k}) on {o.device}, got "
                             f"{weights.dtype} {tuple(weights.shape)} on {weights.device}")
        weights = weights.contiguous()
    o = _aligned(o)
    rows, hidden = o.shape
    _check_int32(f"{label}.shape[0] (rows)", rows)
    _check_int32(f"{label}'s row bytes", hidden * 2)
    y = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=o.device)
    if num_tokens == 0 or hidden == 0:
        return y
    # A null pointer stands for "no weights"; the unweighted kernel never reads it.
    weight_arg = weights if weights is not None else ctypes.c_uint64(0)
    with jit.device_guard(o):
        jit.build(*_COMBINE[weights is not None, slot_order]).launch(
            _grid(num_tokens, o.device), (_THREADS, 1, 1),
            (o, slot_to_row, weight_arg, y, ctypes.c_int64(num_tokens), ctypes.c_int32(hidden),
             ctypes.c_int32(top_k), ctypes.c_int32(rows)))
    return y


def zero_rows_past(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Sets rows ``[ends[-1], out.shape[0])`` of ``out`` to zero, in place, reading ``ends[-1]`` on the
    device (the rows an M-grouped GEMM over ``ends`` leaves unwritten); returns ``out``. ``out``: a
    contiguous CUDA tensor of rows whose byte width is a multiple of 16."""
    _check_cuda("out", out)
    if out.dim() != 2 or not out.is_contiguous() or (out.shape[1] * out.element_size()) % 16:
        raise ValueError(f"out: expected a contiguous [rows, N] tensor with rows of a multiple of 16 bytes, got "
                         f"{out.dtype} {tuple(out.shape)} (contiguous={out.is_contiguous()})")
    if out.data_ptr() % 16:
        raise ValueError(f"out: starts at address {out.data_ptr():#x}, not 16-byte aligned; expected an aligned "
                         f"tensor (the kernel stores 16-byte vectors)")
    _check_index("ends", ends, out.device)
    rows, row_vecs = out.shape[0], out.shape[1] * out.element_size() // 16
    _check_int32("out's row vectors", row_vecs)
    if rows == 0 or row_vecs == 0:
        return out
    if ends.shape[0] == 0:
        return out.zero_()
    # Enough CTAs for the largest tail a pool can have (rows past the last expert are padding only),
    # each thread striding from the tail's start.
    grid = (max(1, min(-(-rows * row_vecs // _THREADS), jit.num_sms(out.device) * 4)), 1, 1)
    with jit.device_guard(out):
        jit.build(*_ZERO_PAST).launch(grid, (_THREADS, 1, 1),
                                      (out, ends, ctypes.c_int32(ends.shape[0]), ctypes.c_int64(rows),
                                       ctypes.c_int32(row_vecs)))
    return out


def take_or_zero(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[index[i]]`` where ``0 <= index[i] < len(src)``, 0 elsewhere (-1: an unused slot or a
    padding row of the routing maps): float32 ``src`` (1-D, contiguous), int32 ``index``."""
    _check_cuda("src", src)
    if src.dtype != torch.float32 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"src: expected a contiguous 1-D float32 tensor, got {src.dtype} {tuple(src.shape)}")
    _check_index("index", index, src.device)
    out = torch.empty(index.shape[0], dtype=torch.float32, device=src.device)
    n = index.shape[0]
    if n == 0:
        return out
    grid = (max(1, min(-(-n // _THREADS), jit.num_sms(src.device) * 4)), 1, 1)
    with jit.device_guard(src):
        jit.build(*_TAKE_OR_ZERO).launch(grid, (_THREADS, 1, 1), (src, ctypes.c_int64(src.shape[0]), index, out,
                                                                             ctypes.c_int64(n)))
    return out
