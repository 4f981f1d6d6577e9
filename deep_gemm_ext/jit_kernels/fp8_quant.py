"""Blockwise-fp8 quantization of bf16 tensors on the GPU (kernels/impls/fp8_quant.cuh).

Each function is one pass over its input and produces bit for bit what the torch quantizers of
``deep_gemm_ext.recipes.fp8`` produce for the same CUDA tensor (``quantize_rows``, ``quantize_cols``):
e4m3 data and one fp32 scale per 1x128 (rows) or 128x1 (columns) tile, scale
``max(amax, AMAX_FLOOR) * fl32(1/448)`` over the tile's finite values (torch's CUDA division by the
Python scalar 448 multiplies by its fp32 reciprocal; on the CPU torch divides, which differs in the
last bit for about half of all amaxes), ``data = x / scale`` rounded to nearest even, non-finite
elements stored as NaN (0x7f), ragged last tiles covering the remaining elements only.

- :func:`quantize_rows_fp8`: ``x [M, K]`` -> ``(data [M, K], scale [M, ceil(K/128)])``; with
  ``gather=(row_to_slot, top_k)`` it quantizes the dispatched pool instead (row ``r`` is
  ``x[row_to_slot[r] // top_k]``, padding rows ``row_to_slot[r] < 0`` are zeros), i.e.
  ``quantize_rows(gather_rows(x, row_to_slot, top_k))`` without the bf16 pool.
- :func:`quantize_cols_fp8`: ``x [R, M]`` -> ``(data [R, M], scale [ceil(R/128), M])``, 128-row
  tiles from row 0 (in the routed pool every expert starts on a multiple of 128).
- :func:`quantize_cols_transposed_fp8`: ``x [R, M]`` (or the gathered pool) -> ``(data [M, R],
  scale [M, ceil(R/128)])``, ``quantize_cols``' data and scales transposed: the K-major operands
  of ``k_grouped_fp8_gemm_nt_contiguous``. R must be a multiple of 16.
- :func:`swiglu_forward_fp8`: ``h [P, 2I]`` -> the rows of ``act = swiglu_forward(h, clamp)`` (the
  JIT kernel's bf16 act) quantized, optionally with act itself.
- :func:`swiglu_backward_fp8`: ``jit_kernels.swiglu_backward`` (same bits) that also quantizes its
  bf16 dh 1x128 along 2I (I must be a multiple of 128).
- :func:`swiglu_backward_fp8_t`: the same dweight and dh rows, and instead of the bf16 dh and act_w
  their column-quantized transposes (``quantize_cols_transposed_fp8``' bits), for fp8 weight gradients.

Rows need a multiple of 8 elements (16-byte vectors).
"""
from __future__ import annotations

import math

import torch

from .. import jit
from ..jit import KernelArg
from .gather_combine import MAX_TOP_K, _aligned, gather_rows
from .swiglu import _check_backward_args, _check_clamp

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
_THREADS = 256
_WARPS = _THREADS // 32
#: Tiles each half warp quantizes per step of the row kernel (loads in flight per lane).
TILES_PER_HALF_WARP = 2
#: Rows each thread of the column kernel holds (its CTA covers 128 rows x 256 * this / 16 columns).
COL_ROWS_PER_THREAD = 8
_COL_BLOCK_COLS = _THREADS * COL_ROWS_PER_THREAD // FP8_BLOCK * 8
#: Work items (row tiles, or 128x128 column blocks) per launch: the kernels index them in 32 bits,
#: larger tensors are quantized in several launches.
_MAX_ITEMS = 2 ** 31 - 1
_INCLUDE = "#include <impls/fp8_quant.cuh>\n"

_ROW_ARGS = (
    KernelArg("x", "const __nv_bfloat16*"), KernelArg("row_to_slot", "const int*", nullable=True),
    KernelArg("data", "unsigned char*"), KernelArg("scale", "float*"),
    KernelArg("act", "__nv_bfloat16*", nullable=True), KernelArg("num_rows", "unsigned int"),
    KernelArg("cols", "unsigned int"), KernelArg("top_k", "unsigned int"), KernelArg("num_tokens", "unsigned int"),
    KernelArg("clamp", "float"),
)
_COL_ARGS = (KernelArg("x", "const __nv_bfloat16*"), KernelArg("data", "unsigned char*"),
             KernelArg("scale", "float*"), KernelArg("num_rows", "unsigned int"), KernelArg("cols", "unsigned int"))
_COL_T_ARGS = (KernelArg("x", "const __nv_bfloat16*"), KernelArg("row_to_slot", "const int*", nullable=True),
               KernelArg("data", "unsigned char*"), KernelArg("scale", "float*"), KernelArg("num_rows", "unsigned int"),
               KernelArg("out_rows", "unsigned int"), KernelArg("cols", "unsigned int"),
               KernelArg("top_k", "unsigned int"), KernelArg("num_tokens", "unsigned int"))
#: Columns one CTA step of the transposing column kernel covers (128 rows x this).
_COL_T_BLOCK_COLS = 64
_SWIGLU_BWD_ARGS = (
    KernelArg("h", "const __nv_bfloat16*"), KernelArg("da", "const __nv_bfloat16*"),
    KernelArg("row_weight", "const float*"), KernelArg("dh", "__nv_bfloat16*"), KernelArg("dweight", "float*"),
    KernelArg("act_w", "__nv_bfloat16*"), KernelArg("dh_data", "unsigned char*"), KernelArg("dh_scale", "float*"),
    KernelArg("num_rows", "unsigned int"), KernelArg("inter", "unsigned int"), KernelArg("clamp", "float"),
)

_SWIGLU_BWD_T_ARGS = (
    KernelArg("h", "const __nv_bfloat16*"), KernelArg("da", "const __nv_bfloat16*"),
    KernelArg("row_weight", "const float*"), KernelArg("dweight", "float*"),
    KernelArg("dh_data", "unsigned char*"), KernelArg("dh_scale", "float*"),
    KernelArg("dht_data", "unsigned char*"), KernelArg("dht_scale", "float*"),
    KernelArg("awt_data", "unsigned char*"), KernelArg("awt_scale", "float*"),
    KernelArg("num_rows", "unsigned int"), KernelArg("out_rows", "unsigned int"), KernelArg("inter", "unsigned int"),
    KernelArg("clamp", "float"),
)
#: The transposing SwiGLU backward: 512 threads, one CTA per SM; its dynamic shared memory holds three bf16
#: 128 x 128 result tiles and the three staged input tiles.
_SWIGLU_BWD_T_THREADS = 512
_SWIGLU_BWD_T_SMEM = 2 * 3 * FP8_BLOCK * FP8_BLOCK * 2

_TOKEN_ROW_ARGS = (
    KernelArg("x", "const __nv_bfloat16*"), KernelArg("slot_to_row", "const int*"),
    KernelArg("row_to_slot", "const int*"), KernelArg("data", "unsigned char*"), KernelArg("scale", "float*"),
    KernelArg("pool", "__nv_bfloat16*", nullable=True),
    KernelArg("num_tokens", "unsigned int"), KernelArg("cols", "unsigned int"), KernelArg("top_k", "unsigned int"),
    KernelArg("num_rows", "unsigned int"),
)
#: Tiles each half warp of the token-order quantizer holds per step (a Qwen3 hidden row of 16-32 tiles
#: takes 2-4 steps).
TOKEN_TILES_PER_HALF_WARP = 4

_SOURCES = {"rows": "kRows", "gather": "kGather", "swiglu": "kSwiglu"}


def _rows_code(source: str, clamp: bool) -> str:
    return _INCLUDE + (f"template __global__ void dge::quantize_rows_kernel<dge::Fp8RowSource::{_SOURCES[source]}, "
                       f"{'true' if clamp else 'false'}, {TILES_PER_HALF_WARP}>({jit.render_types(_ROW_ARGS)});\n")


_ROWS = {
    ("rows", False): ("fp8_quant_rows", _rows_code("rows", False)),
    ("gather", False): ("fp8_quant_rows_gather", _rows_code("gather", False)),
    ("swiglu", False): ("fp8_quant_swiglu_plain", _rows_code("swiglu", False)),
    ("swiglu", True): ("fp8_quant_swiglu_clamp", _rows_code("swiglu", True)),
}
_TOKEN_ROWS = ("fp8_quant_token_rows",
               _INCLUDE + (f"template __global__ void dge::quantize_token_rows_kernel<{TOKEN_TILES_PER_HALF_WARP}>"
                           f"({jit.render_types(_TOKEN_ROW_ARGS)});\n"))
_COLS = ("fp8_quant_cols", _INCLUDE + (f"template __global__ void dge::quantize_cols_kernel<{COL_ROWS_PER_THREAD}>"
                                        f"({jit.render_types(_COL_ARGS)});\n"))

_COLS_T = {gather: (f"fp8_quant_cols_t{'_gather' if gather else ''}",
                    _INCLUDE + (f"template __global__ void dge::quantize_cols_t_kernel<{'true' if gather else 'false'}>"
                                f"({jit.render_types(_COL_T_ARGS)});\n"))
           for gather in (False, True)}
_SWIGLU_BWD = {clamp: (f"fp8_quant_swiglu_bwd_{'clamp' if clamp else 'plain'}",
                       _INCLUDE + ("template __global__ void dge::swiglu_backward_fp8_kernel"
                                   f"<{'true' if clamp else 'false'}>({jit.render_types(_SWIGLU_BWD_ARGS)});\n"))
               for clamp in (False, True)}

_SWIGLU_BWD_T = {clamp: (f"fp8_quant_swiglu_bwd_t_{'clamp' if clamp else 'plain'}",
                         _INCLUDE + ("template __global__ void dge::swiglu_backward_fp8_t_kernel"
                                     f"<{'true' if clamp else 'false'}>({jit.render_types(_SWIGLU_BWD_T_ARGS)});\n"))
                 for clamp in (False, True)}


_WEIGHT_ARGS = (KernelArg("w", "const __nv_bfloat16*"), KernelArg("nk", "unsigned char*"),
                KernelArg("nk_scale", "float*"), KernelArg("kn", "unsigned char*"), KernelArg("kn_scale", "float*"),
                KernelArg("num_experts", "unsigned int"), KernelArg("n", "unsigned int"), KernelArg("k", "unsigned int"))
_WEIGHTS = ("fp8_quant_weight_blocks", _INCLUDE + ("template __global__ void dge::quantize_weight_blocks_kernel<8>"
                                                    f"({jit.render_types(_WEIGHT_ARGS)});\n"))


@jit.register("fp8_quant")
def configs():
    return [(name, code, False) for name, code in [*_ROWS.values(), _TOKEN_ROWS, _COLS, *_COLS_T.values(),
                                                   *_SWIGLU_BWD.values(), *_SWIGLU_BWD_T.values(), _WEIGHTS]]


def num_blocks(size: int) -> int:
    """Scales along a dimension of ``size`` elements: ``ceil(size / 128)``."""
    return -(-size // FP8_BLOCK)


# ---------------------------------------------------------------------------------------------
# Checks


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _check_bf16_input(label: str, x, cols_multiple: int = 8) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        raise ValueError(f"{label}: expected a CUDA tensor, got {_describe(x)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{label}: dtype {x.dtype}, expected torch.bfloat16")
    if x.dim() != 2 or x.shape[1] % cols_multiple:
        raise ValueError(f"{label}: shape {tuple(x.shape)}, expected 2-D with a column count divisible by "
                         f"{cols_multiple} (16-byte vectors)")
    if x.shape[0] >= 2 ** 31 or x.shape[1] >= 2 ** 31:
        raise ValueError(f"{label}: shape {tuple(x.shape)}, expected fewer than 2**31 rows and columns")
    return _aligned(x)


def _output(label: str, given, shape: tuple, dtype: torch.dtype, device: torch.device, align: int) -> torch.Tensor:
    """``given`` checked against what the kernel writes, or a new tensor."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{label}: expected a torch.Tensor or None, got {type(given).__name__}")
    if given.dtype != dtype or tuple(given.shape) != tuple(shape) or given.device != device:
        raise ValueError(f"{label}: got {_describe(given)}; expected a {dtype} tensor of shape {tuple(shape)} "
                         f"on {device}")
    if not given.is_contiguous() or given.data_ptr() % align:
        raise ValueError(f"{label}: must be contiguous and {align}-byte aligned (stride {given.stride()}, "
                         f"address {given.data_ptr():#x})")
    return given


def _check_gather(gather, device: torch.device):
    if not (isinstance(gather, tuple) and len(gather) == 2):
        raise ValueError(f"gather: expected None or a tuple (row_to_slot, top_k), got {type(gather).__name__}")
    row_to_slot, top_k = gather
    if not isinstance(row_to_slot, torch.Tensor) or row_to_slot.dtype != torch.int32 or row_to_slot.dim() != 1 \
            or row_to_slot.device != device:
        raise ValueError(f"gather: row_to_slot is {_describe(row_to_slot)}; expected a 1-D int32 tensor on {device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < 2 ** 31:
        raise ValueError(f"gather: top_k={top_k!r}, expected a positive int")
    return row_to_slot.contiguous(), top_k


def _transposed_rows(rows, in_rows: int, label: str, what: str) -> int:
    """The row count of a transposed e4m3 output (``rows=``, default the input's ``in_rows``): a multiple of 16
    (16-byte vectors of e4m3 per output row), at least ``in_rows``, below 2**31."""
    if rows is None:
        if in_rows % 16:
            raise ValueError(f"{label}: {in_rows} {what}, expected a multiple of 16 (the transposed output's rows are "
                             f"16-byte vectors of e4m3); pass rows= to pad")
        return in_rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < in_rows or rows % 16 or rows >= 2 ** 31:
        raise ValueError(f"rows={rows!r}: expected an int multiple of 16, at least the {in_rows} {what} of {label} and "
                         f"below 2**31")
    return rows


def _check_fp8_backward_args(h, da, row_weight):
    """The fp8 SwiGLU backward kernels' inputs: those of the bf16 one, fewer than 2**31 rows and columns, and
    I a multiple of 128 (dh's 1x128 tiles do not straddle its gate and up halves)."""
    h, da, row_weight = _check_backward_args(h, da, row_weight)
    inter = h.shape[1] // 2
    if h.shape[0] >= 2 ** 31 or h.shape[1] >= 2 ** 31:
        raise ValueError(f"h: shape {tuple(h.shape)}, expected fewer than 2**31 rows and columns")
    if inter % FP8_BLOCK:
        raise ValueError(f"h: shape {tuple(h.shape)}, I={inter}; expected I a multiple of {FP8_BLOCK} so that dh's "
                         f"1x{FP8_BLOCK} tiles do not straddle its gate and up halves")
    return h, da, row_weight


# ---------------------------------------------------------------------------------------------
# Launches

_resident: dict[str, int] = {}


def resident_ctas_per_sm(kernel) -> int:
    """CTAs of ``kernel`` one SM holds at once, from its register count (ptxas' report): the
    grid-stride kernels launch one full wave, since CTAs beyond it would run as a short second
    wave with as much work each as the first. 4 when the report is missing."""
    count = _resident.get(kernel.name)
    if count is None:
        usages = kernel.resources()
        if usages:
            regs = -(-max(u.registers for u in usages) // 8) * 8  # allocated per warp in units of 256
            count = max(1, min(2048 // _THREADS, 65536 // (max(regs, 8) * _THREADS)))
        else:
            count = 4
        _resident[kernel.name] = count
    return count


def _grid(kernel, work_ctas: int, device) -> tuple[int, int, int]:
    return (max(1, min(work_ctas, jit.num_sms(device) * resident_ctas_per_sm(kernel))), 1, 1)


def _rows(t: torch.Tensor, span: slice | None) -> torch.Tensor:
    return t if span is None else t[span]


def _launch_rows(config, x, data, scale, *, row_to_slot=None, act=None, top_k=1, clamp=math.inf) -> None:
    """Quantize ``data.shape[0]`` rows in launches of at most _MAX_ITEMS tiles."""
    rows, cols = data.shape
    tiles = num_blocks(cols)
    if rows == 0 or cols == 0:
        return
    chunk = max(1, _MAX_ITEMS // tiles)
    kernel = jit.build(*config)
    gathered = row_to_slot is not None
    with jit.device_guard(data):
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            n = stop - start
            # One launch (the usual case) takes the tensors themselves: a slice is host work per tensor.
            span = None if n == rows else slice(start, stop)
            layout, payload = jit.pack_bytes(
                config[0], _ROW_ARGS,
                x=x if gathered else _rows(x, span), row_to_slot=None if not gathered else _rows(row_to_slot, span),
                data=_rows(data, span), scale=_rows(scale, span), act=None if act is None else _rows(act, span),
                num_rows=n, cols=cols, top_k=top_k, num_tokens=x.shape[0] if gathered else n, clamp=clamp)
            per_cta = _WARPS * 2 * TILES_PER_HALF_WARP
            kernel.launch_bytes(_grid(kernel, -(-n * tiles // per_cta), data.device), (_THREADS, 1, 1), layout, payload)


def quantize_rows_fp8(x: torch.Tensor, *, gather: tuple[torch.Tensor, int] | None = None,
                      out: torch.Tensor | None = None,
                      scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along each row: ``x [M, K]`` bf16 -> ``(data [M, K] e4m3, scale [M, ceil(K/128)] fp32)``,
    bit for bit ``recipes.fp8.quantize_rows(x)``. K must be a multiple of 8.

    ``gather=(row_to_slot, top_k)`` quantizes the pool ``[P, K]`` (P = ``row_to_slot.shape[0]``) whose
    row r is ``x[row_to_slot[r] // top_k]``, and zeros (data 0, the zero tile's scale) where
    ``row_to_slot[r] < 0`` or the token is out of range, as ``jit_kernels.gather_rows`` builds it.
    ``out`` / ``scale_out``: contiguous tensors of exactly the output's shape and dtype to write into
    (``out`` 8-byte aligned).
    """
    x = _check_bf16_input("x", x)
    row_to_slot = top_k = None
    if gather is not None:
        row_to_slot, top_k = _check_gather(gather, x.device)
    rows = x.shape[0] if row_to_slot is None else row_to_slot.shape[0]
    cols = x.shape[1]
    data = _output("out", out, (rows, cols), FP8_DTYPE, x.device, 8)
    scale = _output("scale_out", scale_out, (rows, num_blocks(cols)), torch.float32, x.device, 4)
    if row_to_slot is None:
        _launch_rows(_ROWS["rows", False], x, data, scale)
    else:
        _launch_rows(_ROWS["gather", False], x, data, scale, row_to_slot=row_to_slot, top_k=top_k)
    return data, scale


def quantize_pool_rows_fp8(x: torch.Tensor, row_to_slot: torch.Tensor, top_k: int, *,
                           slot_to_row: torch.Tensor | None = None, with_pool: bool = False):
    """The pool ``[P, K]`` whose row r is ``x[row_to_slot[r] // top_k]``, quantized 1x128 along K:
    ``(data [P, K] e4m3, scale [P, ceil(K/128)] fp32)``. Each of ``x``'s T rows is quantized once: a
    row's tiles do not depend on where it lands, so every used row has the bits of quantizing the
    gathered bf16 pool, from T rows of bf16 reads instead of P. Padding rows (``row_to_slot < 0``) and
    rows of out-of-range tokens are zero in data and scale (they dequantize to zeros).

    ``slot_to_row`` [T * top_k] (the routing's inverse map, top_k <= 32): one launch walks the tokens,
    quantizes each row once and stores its bytes and scales to the rows of its used slots, then zeroes
    the rows no slot maps to. Without it, :func:`quantize_rows_fp8` on x and ``gather_rows`` of the data
    and of the scales (three launches; where a scale row is not a whole number of 16-byte vectors,
    ceil(K/128) not a multiple of 4, the gathering quantizer, which writes the zero tile's scale on
    padding rows). Same bits on every used row either way.

    ``with_pool=True`` also returns the bf16 pool ``[P, K]`` itself (``gather_rows(x, row_to_slot, top_k)``,
    bit for bit): ``(data, scale, pool)``. With ``slot_to_row`` the token-order launch stores it from the
    same read of x (one launch for both pools); without, a separate gather."""
    x = _check_bf16_input("x", x)
    row_to_slot, top_k = _check_gather((row_to_slot, top_k), x.device)
    if not isinstance(with_pool, bool):
        raise ValueError(f"with_pool={with_pool!r}: expected a bool")
    if slot_to_row is not None:
        return _quantize_token_rows(x, row_to_slot, top_k, slot_to_row, with_pool)
    if num_blocks(x.shape[1]) % 4 or x.shape[0] == 0:
        data, scale = quantize_rows_fp8(x, gather=(row_to_slot, top_k))
    else:
        data, scale = quantize_rows_fp8(x)
        # Evict-first pool stores: 1.04x (e4m3 rows) and 1.42x (scales) of plain stores at Qwen3-30B T16384
        # (docs/perf-notes.md v21); same bytes.
        data = gather_rows(data, row_to_slot, top_k, stream_stores=True)
        scale = gather_rows(scale, row_to_slot, top_k, stream_stores=True)
    if with_pool:
        return data, scale, gather_rows(x, row_to_slot, top_k)
    return data, scale


def _quantize_token_rows(x, row_to_slot, top_k, slot_to_row, with_pool=False):
    if not isinstance(slot_to_row, torch.Tensor) or slot_to_row.dtype != torch.int32 or slot_to_row.dim() != 1 \
            or slot_to_row.device != x.device:
        raise ValueError(f"slot_to_row is {_describe(slot_to_row)}; expected a 1-D int32 tensor on {x.device}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"top_k={top_k}: the token-order quantizer holds one slot per lane, at most {MAX_TOP_K}")
    num_tokens, cols = x.shape
    if slot_to_row.shape[0] != num_tokens * top_k:
        raise ValueError(f"slot_to_row: {slot_to_row.shape[0]} slots, expected T * top_k = {num_tokens} * {top_k} = "
                         f"{num_tokens * top_k}")
    rows = row_to_slot.shape[0]
    if max(num_tokens, rows, cols) >= 2 ** 31:
        raise ValueError(f"x {tuple(x.shape)} with {rows} pool rows: the token-order quantizer takes fewer than 2^31 "
                         f"tokens, rows and columns (int32 row maps; its grid-stride loops step in 32 bits)")
    data = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, num_blocks(cols), dtype=torch.float32, device=x.device)
    pool = torch.empty(rows, cols, dtype=x.dtype, device=x.device) if with_pool else None
    outputs = (data, scale, pool) if with_pool else (data, scale)
    if rows == 0 or cols == 0:
        return outputs
    kernel = jit.build(*_TOKEN_ROWS)
    layout, payload = jit.pack_bytes(_TOKEN_ROWS[0], _TOKEN_ROW_ARGS, x=x, slot_to_row=slot_to_row.contiguous(),
                                     row_to_slot=row_to_slot, data=data, scale=scale, pool=pool,
                                     num_tokens=num_tokens, cols=cols, top_k=top_k, num_rows=rows)
    work = max(-(-num_tokens // _WARPS), -(-rows // (_WARPS * 32)))
    with jit.device_guard(x):
        kernel.launch_bytes(_grid(kernel, work, x.device), (_THREADS, 1, 1), layout, payload)
    return outputs


def swiglu_forward_fp8(h: torch.Tensor, clamp: float | None = None, *, return_act: bool = False,
                       out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None):
    """``act = silu(min(g, c)) * clamp(u, -c, c)`` of ``h = [g | u] [P, 2I]`` bf16, rounded to bf16 exactly
    as ``jit_kernels.swiglu_forward`` rounds it, then quantized 1x128 along I:
    ``(data [P, I] e4m3, scale [P, ceil(I/128)] fp32)``, bit for bit
    ``recipes.fp8.quantize_rows(swiglu_forward(h, clamp))``; with ``return_act=True`` also act
    (``(data, scale, act)``). I must be a multiple of 8."""
    h = _check_bf16_input("h", h, cols_multiple=16)
    c = _check_clamp(clamp)
    if not isinstance(return_act, bool):
        raise ValueError(f"return_act={return_act!r}: expected a bool")
    rows, inter = h.shape[0], h.shape[1] // 2
    data = _output("out", out, (rows, inter), FP8_DTYPE, h.device, 8)
    scale = _output("scale_out", scale_out, (rows, num_blocks(inter)), torch.float32, h.device, 4)
    act = torch.empty(rows, inter, dtype=torch.bfloat16, device=h.device) if return_act else None
    _launch_rows(_ROWS["swiglu", clamp is not None], h, data, scale, act=act, clamp=c)
    return (data, scale, act) if return_act else (data, scale)


def quantize_cols_fp8(x: torch.Tensor, *, out: torch.Tensor | None = None,
                      scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 tiles down each column: ``x [R, M]`` bf16 -> ``(data [R, M] e4m3, scale [ceil(R/128), M] fp32)``,
    bit for bit ``recipes.fp8.quantize_cols(x)``: tile i covers rows [128 i, 128 i + 128) of each column
    (a ragged last one the remaining rows). M must be a multiple of 8. ``out`` must be 8-byte and
    ``scale_out`` 16-byte aligned."""
    x = _check_bf16_input("x", x)
    rows, cols = x.shape
    data = _output("out", out, (rows, cols), FP8_DTYPE, x.device, 8)
    scale = _output("scale_out", scale_out, (num_blocks(rows), cols), torch.float32, x.device, 16)
    if rows == 0 or cols == 0:
        return data, scale
    col_blocks = -(-cols // _COL_BLOCK_COLS)
    chunk = FP8_BLOCK * max(1, min(_MAX_ITEMS // col_blocks, _MAX_ITEMS // FP8_BLOCK))
    kernel = jit.build(*_COLS)
    with jit.device_guard(x):
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            blocks = num_blocks(stop - start) * col_blocks
            kernel.launch_bytes(_grid(kernel, blocks, x.device), (_THREADS, 1, 1), *jit.pack_bytes(
                _COLS[0], _COL_ARGS, x=x[start:stop], data=data[start:stop],
                scale=scale[start // FP8_BLOCK:num_blocks(stop)], num_rows=stop - start, cols=cols))
    return data, scale


def quantize_cols_transposed_fp8(x: torch.Tensor, *, gather: tuple[torch.Tensor, int] | None = None,
                                 rows: int | None = None, out: torch.Tensor | None = None,
                                 scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 tiles down each column, written transposed: ``x [R, M]`` bf16 ->
    ``(data [M, R] e4m3, scale [M, ceil(R/128)] fp32)``, bit for bit
    ``recipes.fp8.quantize_cols(x)`` with data and scales transposed (``.t().contiguous()``): the
    K-major operand ``at_q, sa`` (or ``bt_q, sb``) of ``k_grouped_fp8_gemm_nt_contiguous`` for a
    pool ``x``. Tile i covers rows [128 i, 128 i + 128) (in the routed pool every expert starts on a
    multiple of 128). M must be a multiple of 8.

    ``rows``: the output's row count R' (default R), a multiple of 16 (16-byte rows of e4m3) and at
    least R: x is quantized as if zero-padded to R' rows (data ``[M, R']``, scale
    ``[M, ceil(R'/128)]``; the padding's bytes are zeros and change no scale of a tile that has real
    rows). A routed pool has ``T*K + E*127`` rows, so the K-grouped GEMM (P % 16 == 0) takes it
    padded to the next multiple of 16.

    ``gather=(row_to_slot, top_k)`` quantizes the pool ``[P, M]`` (P = ``row_to_slot.shape[0]``) whose
    row r is ``x[row_to_slot[r] // top_k]``, zeros where ``row_to_slot[r] < 0`` or the token is out of
    range (``jit_kernels.gather_rows``' pool), without building it. ``out`` / ``scale_out``: contiguous
    tensors of exactly the output's shape and dtype to write into (``out`` 16-byte aligned)."""
    x = _check_bf16_input("x", x)
    row_to_slot = top_k = None
    if gather is not None:
        row_to_slot, top_k = _check_gather(gather, x.device)
    in_rows = x.shape[0] if row_to_slot is None else row_to_slot.shape[0]
    cols = x.shape[1]
    rows = _transposed_rows(rows, in_rows, "x", "pool rows" if gather is not None else "rows")
    data = _output("out", out, (cols, rows), FP8_DTYPE, x.device, 16)
    scale = _output("scale_out", scale_out, (cols, num_blocks(rows)), torch.float32, x.device, 4)
    if rows == 0 or cols == 0:
        return data, scale
    blocks = num_blocks(rows) * -(-cols // _COL_T_BLOCK_COLS)
    if blocks > _MAX_ITEMS:
        raise ValueError(f"x: {rows} rows x {cols} columns make {blocks} blocks of 128 x {_COL_T_BLOCK_COLS}, "
                         f"expected at most {_MAX_ITEMS}")
    config = _COLS_T[row_to_slot is not None]
    kernel = jit.build(*config)
    with jit.device_guard(x):
        kernel.launch_bytes(_grid(kernel, blocks, x.device), (_THREADS, 1, 1), *jit.pack_bytes(
            config[0], _COL_T_ARGS, x=x, row_to_slot=row_to_slot, data=data, scale=scale, num_rows=in_rows,
            out_rows=rows, cols=cols, top_k=1 if top_k is None else top_k, num_tokens=x.shape[0]))
    return data, scale


def swiglu_backward_fp8(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor, clamp: float | None = None):
    """``jit_kernels.swiglu_backward(h, da, row_weight, clamp)`` bit for bit, ``(dh [P, 2I] bf16,
    dweight [P] fp32, act_w [P, I] bf16)``, plus dh quantized 1x128 along 2I, ``(dh_data [P, 2I]
    e4m3, dh_scale [P, 2I/128] fp32)``, bit for bit ``recipes.fp8.quantize_rows(dh)`` (the operand
    of the L1 data gradient), in the same pass: returns ``(dh, dweight, act_w, dh_data, dh_scale)``.
    I must be a multiple of 128 (no tile straddles the gate and up halves of dh)."""
    h, da, row_weight = _check_fp8_backward_args(h, da, row_weight)
    c = _check_clamp(clamp)
    rows, inter = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    dweight = torch.empty(rows, dtype=torch.float32, device=h.device)
    act_w = torch.empty(rows, inter, dtype=torch.bfloat16, device=h.device)
    dh_data = torch.empty(rows, 2 * inter, dtype=FP8_DTYPE, device=h.device)
    dh_scale = torch.empty(rows, num_blocks(2 * inter), dtype=torch.float32, device=h.device)
    if rows == 0:
        return dh, dweight, act_w, dh_data, dh_scale
    if inter == 0:
        return dh, dweight.zero_(), act_w, dh_data, dh_scale
    config = _SWIGLU_BWD[clamp is not None]
    kernel = jit.build(*config)
    with jit.device_guard(h):
        kernel.launch_bytes(_grid(kernel, -(-rows // _WARPS), h.device), (_THREADS, 1, 1), *jit.pack_bytes(
            config[0], _SWIGLU_BWD_ARGS, h=h, da=da, row_weight=row_weight, dh=dh, dweight=dweight, act_w=act_w,
            dh_data=dh_data, dh_scale=dh_scale, num_rows=rows, inter=inter, clamp=c))
    return dh, dweight, act_w, dh_data, dh_scale


def swiglu_backward_fp8_t(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor, clamp: float | None = None,
                          *, rows: int | None = None):
    """The SwiGLU backward of the fp8 weight gradients, one pass over ``h [P, 2I]`` and ``da [P, I]``:
    ``(dweight [P] fp32, dh_data [P, 2I] e4m3, dh_scale [P, 2I/128], dht_data [2I, R] e4m3,
    dht_scale [2I, ceil(R/128)], awt_data [I, R] e4m3, awt_scale [I, ceil(R/128)])``, bit for bit what
    :func:`swiglu_backward_fp8` (``dweight``, ``dh_data``, ``dh_scale``) followed by
    ``quantize_cols_transposed_fp8(dh, rows=R)`` and ``quantize_cols_transposed_fp8(act_w, rows=R)`` give,
    without writing the bf16 dh and act_w: dh's rows for the L1 data gradient, the transposed
    column-quantized dh and ``act_w = w * act`` for the K-grouped fp8 weight gradients (dW1 and dW2).

    ``rows``: R, the transposed outputs' row count (default P), a multiple of 16 and at least P; rows past P
    are zeros. I must be a multiple of 128."""
    h, da, row_weight = _check_fp8_backward_args(h, da, row_weight)
    c = _check_clamp(clamp)
    num_rows, inter = h.shape[0], h.shape[1] // 2
    rows = _transposed_rows(rows, num_rows, "h", "rows")
    dev = h.device
    dweight = torch.empty(num_rows, dtype=torch.float32, device=dev)
    dh_data = torch.empty(num_rows, 2 * inter, dtype=FP8_DTYPE, device=dev)
    dh_scale = torch.empty(num_rows, num_blocks(2 * inter), dtype=torch.float32, device=dev)
    dht_data = torch.empty(2 * inter, rows, dtype=FP8_DTYPE, device=dev)
    dht_scale = torch.empty(2 * inter, num_blocks(rows), dtype=torch.float32, device=dev)
    awt_data = torch.empty(inter, rows, dtype=FP8_DTYPE, device=dev)
    awt_scale = torch.empty(inter, num_blocks(rows), dtype=torch.float32, device=dev)
    outputs = (dweight, dh_data, dh_scale, dht_data, dht_scale, awt_data, awt_scale)
    if inter == 0:
        dweight.zero_()
        return outputs
    if rows == 0:
        return outputs
    config = _SWIGLU_BWD_T[clamp is not None]
    kernel = jit.build(*config)
    grid = (max(1, min(num_blocks(rows), jit.num_sms(dev))), 1, 1)
    with jit.device_guard(h):
        kernel.launch_bytes(grid, (_SWIGLU_BWD_T_THREADS, 1, 1), *jit.pack_bytes(
            config[0], _SWIGLU_BWD_T_ARGS, h=h, da=da, row_weight=row_weight, dweight=dweight, dh_data=dh_data,
            dh_scale=dh_scale, dht_data=dht_data, dht_scale=dht_scale, awt_data=awt_data, awt_scale=awt_scale,
            num_rows=num_rows, out_rows=rows, inter=inter, clamp=c), smem=_SWIGLU_BWD_T_SMEM)
    return outputs


def quantize_weight_blocks_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert weights in 128x128 blocks, both K-major copies in one pass: ``w [E, N, K]`` bf16 (N and K
    multiples of 128) -> ``(nk [E, N, K] e4m3, nk_scale [E, N/128, K/128] fp32, kn [E, K, N] e4m3,
    kn_scale [E, K/128, N/128] fp32)``, bit for bit ``recipes.fp8.quantize_weight_blocks(w)`` and its
    transposes (``Fp8ExpertWeights.from_bf16``'s two copies), reading w once."""
    if not isinstance(w, torch.Tensor) or not w.is_cuda:
        raise ValueError(f"w: expected a CUDA tensor, got {_describe(w)}")
    if w.dtype != torch.bfloat16:
        raise TypeError(f"w: dtype {w.dtype}, expected torch.bfloat16")
    if w.dim() != 3 or w.shape[1] % FP8_BLOCK or w.shape[2] % FP8_BLOCK:
        raise ValueError(f"w: shape {tuple(w.shape)}, expected [E, N, K] with N and K multiples of {FP8_BLOCK}")
    experts, n, k = w.shape
    blocks = experts * (n // FP8_BLOCK) * (k // FP8_BLOCK)
    if blocks > _MAX_ITEMS or max(experts, n, k) >= 2 ** 31:
        raise ValueError(f"w: shape {tuple(w.shape)} makes {blocks} blocks of 128 x 128; expected at most {_MAX_ITEMS}")
    w = _aligned(w)
    nk = torch.empty(experts, n, k, dtype=FP8_DTYPE, device=w.device)
    kn = torch.empty(experts, k, n, dtype=FP8_DTYPE, device=w.device)
    nk_scale = torch.empty(experts, n // FP8_BLOCK, k // FP8_BLOCK, dtype=torch.float32, device=w.device)
    kn_scale = torch.empty(experts, k // FP8_BLOCK, n // FP8_BLOCK, dtype=torch.float32, device=w.device)
    if blocks == 0:
        return nk, nk_scale, kn, kn_scale
    kernel = jit.build(*_WEIGHTS)
    with jit.device_guard(w):
        kernel.launch_bytes(_grid(kernel, blocks, w.device), (_THREADS, 1, 1), *jit.pack_bytes(
            _WEIGHTS[0], _WEIGHT_ARGS, w=w, nk=nk, nk_scale=nk_scale, kn=kn, kn_scale=kn_scale,
            num_experts=experts, n=n, k=k))
    return nk, nk_scale, kn, kn_scale
