"""Blockwise FP8, the DeepSeek-V3 recipe on Hopper: quantizers, a weight cache, a torch emulation.

Format: e4m3 data (``torch.float8_e4m3fn``: max 448, no Inf) with one fp32 scale per tile; an
element's value is ``data.float() * scale``. Every GEMM reads both operands K-major, so each
operand is quantized along its GEMM's contraction dimension:

=============================================  ==============================  ===============================
operand                                        tile                            quantizer, scale shape
=============================================  ==============================  ===============================
activations and gradients (x, act, dy, dh)     1x128 along K                   ``quantize_rows``: ``[M, K/128]``
weight-gradient operands (contraction over     128x1 along the token rows      ``quantize_cols``: ``[R/128, M]``
the pool's rows)
expert weights ``[E, N, K]``                   128x128 blocks                  ``quantize_weight_blocks``:
                                                                               ``[E, N/128, K/128]``
=============================================  ==============================  ===============================

Sizes that are not multiples of 128 are allowed: the last tile is ragged, it covers the
remaining elements only (scale sizes round up) and its scale comes from them, as if the tensor
were zero-padded to the next multiple of 128.

Scales: ``scale = max(amax, AMAX_FLOOR) / 448`` in fp32 over the tile's finite values, and
``data = x / scale`` rounded to nearest even. On a CUDA tensor torch evaluates the scale's division
by the constant as a product with fl32(1/448), and our quantization kernels
(``jit_kernels.quantize_rows_fp8``) do the same, bit for bit; on the CPU it is a true division. The
two differ in the last bit of about half the scales. Under the division, quantizing a dequantized
tile gives back the same data and scale exactly (what the fp8 dispatch of the all-to-all exchange's
bit identity with one process rests on, tested on the CPU); under the product it need not. Making
every device divide (one division per tile in the kernels) is the planned change. Plain amax/448 scales, not powers of two: DeepSeek-V3
trains with them, DeepGEMM's SM90 fp8 GEMMs take fp32 scales, and every tile keeps the whole e4m3
range (rounding a scale up to a power of two leaves up to one binade unused). Saturation cannot happen: every finite
``|x| <= amax`` lands in ``[-448, 448]``. ``AMAX_FLOOR`` (the scale floor is float32's smallest
normal number, 2**-126) only keeps the scale of an all-zero tile, and its reciprocal, finite and
nonzero; zeros stay zeros. It is far below what a layer produces, unlike the 1e-4 amax floor of
DeepGEMM's test helpers: that floor keeps about 3 bits of a tile
with amax 1e-9 and flushes one below 2e-10 to zeros, and gradients of a loss averaged over many
tokens reach such magnitudes.

Non-finite values: the scale comes from the tile's finite elements only, which are quantized as if
the others were absent; a NaN, +Inf or -Inf element is stored as NaN (e4m3fn has no Inf, torch's
cast would saturate Inf to 448, and the sign of an Inf is lost). A GEMM over such operands then
puts NaN exactly into the outputs whose sum holds a non-finite term, which are the outputs the
fp64 reference on the unquantized operands makes non-finite (Inf times anything, zero included,
and Inf plus anything are never finite), as long as the finite products stay in fp32 range: the
set of non-finite output positions matches the reference's, with Inf reported as NaN.

The emulation (``emulate_grouped_gemm_nt`` / ``_tn``, ``fp8_reference_layer``) dequantizes and runs
fp32 matmuls per expert: the kernels accumulate in fp32 and promote every 128 of K into fp32
registers with the scales applied, so the two differ by fp32 rounding only.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _env, elementwise
from ..reference import swiglu
from ..routing import compute_routing_torch

#: Elements along a dimension covered by one scale (1x128 activation tiles, 128x128 weight blocks).
FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: Smallest scale: float32's smallest normal number, so a scale and its reciprocal are finite.
SCALE_FLOOR = torch.finfo(torch.float32).tiny
#: Smallest amax a scale is derived from (an all-zero tile gets SCALE_FLOOR).
AMAX_FLOOR = FP8_MAX * SCALE_FLOOR
WGRAD_MODES = ("fp8", "bf16")
#: Weight elements quantized per pass: bounds the fp32 temporaries (a few times 256 MiB) while
#: keeping the launches per weight few.
_WEIGHT_CHUNK_ELEMENTS = 1 << 26
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def num_blocks(size: int) -> int:
    """Scales along a dimension of ``size`` elements: ``ceil(size / 128)``."""
    return -(-size // FP8_BLOCK)


# ---------------------------------------------------------------------------------------------
# Checks.


def _check_input(name: str, t, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {_INPUT_DTYPES}")
    ndim = shape_doc.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(t.shape)}")


def _check_quantized(name: str, data, scale, ndim: int, scale_shape) -> None:
    for what, t, dtype in (("data", data, FP8_DTYPE), ("scale", scale, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name} {what} has dtype {t.dtype}; expected {dtype}")
    if data.dim() != ndim:
        raise ValueError(f"{name} data must be {ndim}-D, got shape {tuple(data.shape)}")
    expected = tuple(scale_shape(data.shape))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} scale has shape {tuple(scale.shape)}; expected {expected} for data of "
                         f"shape {tuple(data.shape)} (one scale per {FP8_BLOCK} elements, rounded up)")


def _row_scale_shape(shape):
    return shape[0], num_blocks(shape[1])


def _col_scale_shape(shape):
    return num_blocks(shape[0]), shape[1]


def _block_scale_shape(shape):
    return shape[0], num_blocks(shape[1]), num_blocks(shape[2])


# ---------------------------------------------------------------------------------------------
# Quantizers and dequantizers.


def _padded(x: torch.Tensor, dims) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dims`` to multiples of 128 (zeros change no amax)."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        pad[2 * (x.dim() - 1 - d) + 1] = -x.shape[d] % FP8_BLOCK
    return F.pad(x, pad) if any(pad) else x


def _quantize_tiles(x: torch.Tensor, tiled_shape, tile_dims):
    """fp32 ``x`` viewed as ``tiled_shape``: one scale per tile spanning ``tile_dims``.

    Returns e4m3 data in ``x``'s shape and the scales with the tile dims kept as size 1."""
    tiles = x.reshape(tiled_shape)
    finite = torch.isfinite(tiles)
    amax = torch.where(finite, tiles.abs(), 0).amax(dim=tile_dims, keepdim=True)
    # On CUDA torch computes this as a product with fl32(1/448) (as do our quantization kernels); on
    # the CPU it divides. The division makes re-quantizing a dequantized tile exact (module docstring).
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    # An explicit NaN: torch's cast saturates Inf to +-448, which would hide it.
    data = torch.where(finite, tiles / scale, math.nan).to(FP8_DTYPE)
    return data.reshape(x.shape), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 ``[M, ceil(K/128)]``): 1x128 tiles along each row."""
    _check_input("x", x, "[M, K]")
    m, k = x.shape
    kb = num_blocks(k)
    padded = _padded(x.float(), (1,))
    data, scale = _quantize_tiles(padded, (m, kb, FP8_BLOCK), 2)
    return data[:, :k].contiguous(), scale.reshape(m, kb)


def quantize_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, M]`` -> (e4m3 ``[R, M]``, fp32 ``[ceil(R/128), M]``): 128x1 tiles down each column.

    The weight gradients contract over the pool's rows (tokens), so their operands are quantized
    in that direction; in the pool each expert's rows start on a multiple of 128, so no tile spans
    two experts."""
    _check_input("x", x, "[R, M]")
    r, m = x.shape
    rb = num_blocks(r)
    padded = _padded(x.float(), (0,))
    data, scale = _quantize_tiles(padded, (rb, FP8_BLOCK, m), 1)
    return data[:r].contiguous(), scale.reshape(rb, m)


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> (e4m3 ``[E, N, K]``, fp32 ``[E, ceil(N/128), ceil(K/128)]``): 128x128 blocks."""
    _check_input("w", w, "[E, N, K]")
    e, n, k = w.shape
    nb, kb = num_blocks(n), num_blocks(k)
    data = torch.empty(e, n, k, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(e, nb, kb, dtype=torch.float32, device=w.device)
    step = max(1, _WEIGHT_CHUNK_ELEMENTS // max(1, nb * kb * FP8_BLOCK ** 2))
    for i in range(0, e, step):
        chunk = w[i:i + step]
        block_data, block_scale = _quantize_tiles(_padded(chunk.float(), (1, 2)),
                                                  (chunk.shape[0], nb, FP8_BLOCK, kb, FP8_BLOCK), (2, 4))
        data[i:i + step] = block_data[:, :n, :k]
        scale[i:i + step] = block_scale.reshape(chunk.shape[0], nb, kb)
    return data, scale


def _expand(scale: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return scale.repeat_interleave(FP8_BLOCK, dim).narrow(dim, 0, size)


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, K]`` from :func:`quantize_rows`' output."""
    _check_quantized("row-quantized", data, scale, 2, _row_scale_shape)
    return data.float() * _expand(scale, 1, data.shape[1])


def dequantize_cols(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, M]`` from :func:`quantize_cols`' output."""
    _check_quantized("column-quantized", data, scale, 2, _col_scale_shape)
    return data.float() * _expand(scale, 0, data.shape[0])


def dequantize_weight_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[E, N, K]`` from :func:`quantize_weight_blocks`' output."""
    _check_quantized("block-quantized", data, scale, 3, _block_scale_shape)
    return data.float() * _expand(_expand(scale, 1, data.shape[1]), 2, data.shape[2])


# ---------------------------------------------------------------------------------------------
# Expert weights and their cache.


@dataclass
class Fp8ExpertWeights:
    """Expert weights ``[E, N, K]`` in 128x128-block fp8, in both K-major orientations.

    ``nk`` (data ``[E, N, K]``, scales ``[E, N/128, K/128]``) serves ``a @ W[e]^T`` (forward);
    ``kn`` (``[E, K, N]``, ``[E, K/128, N/128]``) serves ``a @ W[e]`` (data gradient). A 128x128
    block transposes exactly, data and scale grid, so ``kn`` adds no quantization error.
    """

    nk: tuple[torch.Tensor, torch.Tensor]
    kn: tuple[torch.Tensor, torch.Tensor]

    @property
    def shape(self) -> torch.Size:
        return self.nk[0].shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.nk, *self.kn))

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[E, N, K]``: the values the GEMMs compute with."""
        return dequantize_weight_blocks(*self.nk)

    @classmethod
    def from_bf16(cls, w: torch.Tensor) -> "Fp8ExpertWeights":
        """Quantize ``w [E, N, K]`` (bf16, or any float dtype); N and K must be multiples of 128,
        the block size the fp8 GEMMs tile by."""
        _check_input("expert weights", w, "[E, N, K]")
        if w.shape[1] % FP8_BLOCK or w.shape[2] % FP8_BLOCK:
            raise ValueError(f"expert weights must be [E, N, K] with N and K multiples of {FP8_BLOCK} "
                             f"for fp8, got shape {tuple(w.shape)}")
        if w.is_cuda and w.dtype == torch.bfloat16 and _env.fp8_weight_kernel() and _env.use_jit_kernels():
            # One pass writing both copies (DGE_FP8_WEIGHT_KERNEL=1): the same bits as the torch quantizer.
            from ..jit_kernels.fp8_quant import quantize_weight_blocks_fp8

            nk, nk_scale, kn, kn_scale = quantize_weight_blocks_fp8(w.detach())
            return cls(nk=(nk, nk_scale), kn=(kn, kn_scale))
        with torch.no_grad():
            data, scale = quantize_weight_blocks(w.detach())
        return cls(nk=(data, scale),
                   kn=(data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()))


def _capturing_cuda_graph(weight: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream. Its replays must read the weights as
    they are at each replay (an optimizer step between replays writes them in place, unseen by a
    cache that lives in Python), so under capture the quantization is recorded into the graph and
    nothing is cached: each replay quantizes the weights again (twice per weight and step: once for
    the forward, once for the backward)."""
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


def fp8_weight_cache_bytes(num_experts: int, hidden: int, intermediate: int) -> int:
    """Bytes :class:`WeightCache` holds for one layer's ``l1 [E, 2I, H]`` and ``l2 [E, H, I]``.

    ``(2I*H + H*I) * E * 2`` bytes of e4m3 data (the ``nk`` and the ``kn`` copy), plus 4 bytes per
    128x128 block per copy for the scales: as many bytes as the bf16 weights themselves (plus
    0.025% for the scales), held for as long as the weights live.
    """
    blocks = num_blocks(2 * intermediate) * num_blocks(hidden) + num_blocks(hidden) * num_blocks(intermediate)
    data = (2 * intermediate * hidden + hidden * intermediate) * num_experts
    return 2 * (data + 4 * blocks * num_experts)


_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    WEIGHT_CACHE.sweep()  # a deleted model's copies go by the next step at the latest (O(entries) a step)


# Every torch.optim step anywhere in the process ages the cache: FSDP2 refills its all-gathered
# parameters under _unsafe_preserve_version_counter, so their version counter never moves.
register_optimizer_step_post_hook(_count_optimizer_step)


@dataclass
class _Entry:
    storage: StorageWeakRef  # the weight's storage: a new one at a recycled address is another weight
    signature: tuple
    weights: Fp8ExpertWeights
    ref: weakref.ref | None = None  # a non-parameter's (a per-call cast or cat): its entry dies with it

    def serves(self, weight: torch.Tensor, signature: tuple) -> bool:
        return (self.signature == signature and (self.ref is None or self.ref() is weight)
                and self.storage.cdata == weight.untyped_storage()._cdata and not self.storage.expired())


class WeightCache:
    """Expert weights quantized once per weight version, not once per call.

    An entry is keyed by the tensor's identity and checked against its storage (a weak reference
    to it: ``t.data = new`` or a swapped parameter is a new storage even where the allocator hands
    back the same address), version counter (``t._version``, bumped by every in-place write through
    the tensor or its views: optimizer steps, ``load_state_dict``, ``mul_``), data pointer, shape,
    strides, dtype and device, and the count of ``torch.optim`` steps taken in the process; any
    change re-quantizes. The step count covers what the version counter misses: FSDP2 refills the
    unsharded parameters it all-gathers without bumping their counter, and the values change only
    when an optimizer steps the shards. A tensor that is not an ``nn.Parameter`` (a weight made per
    call: a cast under autocast, torchtitan's ``cat(w1, w3)``) is held by a weak reference, and its
    entry goes when it dies. A parameter is not referenced at all (a weak reference would make
    ``torch.utils.swap_tensors``, and with it ``Module.to`` / ``load_state_dict`` under
    ``torch.__future__.set_swap_module_params_on_conversion``, refuse it): the entries of parameters
    whose storage died are dropped by a sweep at later quantizations (amortised: when the entries
    have doubled since the last one), or by :meth:`clear`.
    Not seen, so call :meth:`invalidate` or :meth:`clear` after them: writes through ``t.data``
    (``t.data.mul_(2)`` bumps a separate counter), and, under FSDP2, a ``load_state_dict`` after
    the first forward. Inference tensors have no version counter and are quantized on every call;
    so are weights read while a CUDA graph is captured (the quantization becomes part of the graph,
    so that every replay reads the weights as they are then).
    Quantization is deterministic; the cache is not thread-safe.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._sweep_at = 16  # entries at which a quantization first sweeps out the dead ones

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _signature(t: torch.Tensor) -> tuple:
        return _optimizer_steps, t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device

    def get(self, weight: torch.Tensor) -> Fp8ExpertWeights:
        """``weight``'s :class:`Fp8ExpertWeights`, quantized now if its cached copy is stale."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        if weight.is_inference() or _capturing_cuda_graph(weight):
            return Fp8ExpertWeights.from_bf16(weight)
        key, signature = id(weight), self._signature(weight)
        entry = self._entries.get(key)
        if entry is not None and entry.serves(weight, signature):
            return entry.weights
        self._entries.pop(key, None)  # free the stale copy before building the new one
        if len(self._entries) >= self._sweep_at:
            self.sweep()
            self._sweep_at = max(16, 2 * len(self._entries))
        weights = Fp8ExpertWeights.from_bf16(weight)
        ref = None if isinstance(weight, torch.nn.Parameter) else weakref.ref(weight, self._forget(key))
        self._entries[key] = _Entry(StorageWeakRef(weight.untyped_storage()), signature, weights, ref)
        return weights

    def _forget(self, key: int):
        def callback(ref: weakref.ref) -> None:
            entry = self._entries.get(key)
            if entry is not None and entry.ref is ref:
                del self._entries[key]
        return callback

    def sweep(self) -> None:
        """Drop the entries whose weight's storage has died (a deleted model's parameters)."""
        for dead in [key for key, entry in self._entries.items() if entry.storage.expired()]:
            del self._entries[dead]

    def invalidate(self, weight: torch.Tensor) -> None:
        """Drop ``weight``'s entry (after a write the version counter does not see)."""
        self._entries.pop(id(weight), None)

    def clear(self) -> None:
        """Drop every entry (frees the fp8 copies, e.g. before evaluation in bf16)."""
        self._entries.clear()

    def memory_bytes(self) -> int:
        """Bytes of fp8 data and scales held (see :func:`fp8_weight_cache_bytes`)."""
        return sum(entry.weights.nbytes for entry in self._entries.values())


#: The cache the layer's fp8 recipe reads.
WEIGHT_CACHE = WeightCache()


# ---------------------------------------------------------------------------------------------
# Torch emulation of the fp8 grouped GEMMs.


def _spans(starts, ends, num_rows: int, num_experts: int) -> list[tuple[int, int]]:
    starts = starts.tolist() if isinstance(starts, torch.Tensor) else list(starts)
    ends = ends.tolist() if isinstance(ends, torch.Tensor) else list(ends)
    if len(starts) != num_experts or len(ends) != num_experts:
        raise ValueError(f"starts and ends have {len(starts)} and {len(ends)} entries; expected one per "
                         f"expert ({num_experts})")
    for e, (s, t) in enumerate(zip(starts, ends)):
        if not 0 <= s <= t <= num_rows:
            raise ValueError(f"expert {e} owns rows [{s}, {t}); expected 0 <= start <= end <= {num_rows}")
    return list(zip(starts, ends))


def _grouped_nt(a: torch.Tensor, weight_of, spans, n: int) -> torch.Tensor:
    """``out[s:t] = a[s:t] @ weight_of(e)^T`` over each expert's rows, zero elsewhere (fp32)."""
    out = a.new_zeros(a.shape[0], n)
    for e, (s, t) in enumerate(spans):
        if t > s:
            out[s:t] = a[s:t] @ weight_of(e).t()
    return out


def _grouped_tn(a: torch.Tensor, b: torch.Tensor, spans) -> torch.Tensor:
    """``d[e] = a[s:t]^T @ b[s:t]`` over each expert's rows: fp32 ``[E, M, N]``, zero if empty."""
    out = a.new_zeros(len(spans), a.shape[1], b.shape[1])
    for e, (s, t) in enumerate(spans):
        if t > s:
            out[e] = a[s:t].t() @ b[s:t]
    return out


def emulate_grouped_gemm_nt(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                            starts, ends) -> torch.Tensor:
    """The m-grouped fp8 GEMM: ``out[r] = A[r] @ W[e]^T`` for the pool rows ``[starts[e], ends[e])``.

    ``a`` is ``[P, K]`` row-quantized (:func:`quantize_rows`), ``w`` is ``[E, N, K]`` block-quantized
    (an ``nk`` copy for the forward, a ``kn`` copy for a data gradient). Returns fp32 ``[P, N]``,
    zero on rows no expert owns. ``starts`` / ``ends``: tensors or lists (read on the host).
    """
    a = dequantize_rows(a_q, a_scale)
    _check_quantized("weight", w_q, w_scale, 3, _block_scale_shape)
    if w_q.shape[2] != a.shape[1]:
        raise ValueError(f"weight has K={w_q.shape[2]} (shape {tuple(w_q.shape)}) but a has K={a.shape[1]}")
    spans = _spans(starts, ends, a.shape[0], w_q.shape[0])
    return _grouped_nt(a, lambda e: dequantize_weight_blocks(w_q[e:e + 1], w_scale[e:e + 1])[0], spans,
                       w_q.shape[1])


def emulate_grouped_gemm_tn(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                            starts, ends) -> torch.Tensor:
    """The k-grouped fp8 weight-gradient GEMM: ``d[e] = A_e^T @ B_e``, contracting over the pool
    rows ``[starts[e], ends[e])``; fp32 ``[E, M, N]``, zero for an empty expert.

    ``a [P, M]`` and ``b [P, N]`` are column-quantized (:func:`quantize_cols`); every non-empty
    expert's rows must start and end on multiples of 128 (or end at ``P``) so that no tile spans
    two experts, as in the routed pool.
    """
    a, b = dequantize_cols(a_q, a_scale), dequantize_cols(b_q, b_scale)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a has {a.shape[0]} rows and b has {b.shape[0]}; expected the same pool")
    spans = _spans(starts, ends, a.shape[0], len(starts))
    for e, (s, t) in enumerate(spans):
        if t > s and (s % FP8_BLOCK or (t % FP8_BLOCK and t != a.shape[0])):
            raise ValueError(f"expert {e} owns rows [{s}, {t}); column-quantized operands need experts that "
                             f"start and end on multiples of {FP8_BLOCK} (route with align={FP8_BLOCK})")
    return _grouped_tn(a, b, spans)


def emulated_m_grouped(a: torch.Tensor, w: Fp8ExpertWeights, starts, ends, layout: str) -> torch.Tensor:
    """The layer's M-grouped GEMM under the fp8 recipe: ``a`` (the pool, in the compute dtype)
    quantized 1x128 along K as the producing kernel quantizes it, times ``w.nk`` (``layout`` "nt":
    ``a @ W[e]^T``) or ``w.kn`` ("nn": ``a @ W[e]``). Returns ``a``'s dtype."""
    if not isinstance(w, Fp8ExpertWeights):
        raise TypeError(f"w must be Fp8ExpertWeights under the fp8 recipe, got {type(w).__name__}")
    data, scale = w.nk if layout == "nt" else w.kn
    return emulate_grouped_gemm_nt(*quantize_rows(a), data, scale, starts, ends).to(a.dtype)


def emulated_k_grouped(a: torch.Tensor, b: torch.Tensor, starts, ends, fp8_operands: bool) -> torch.Tensor:
    """The layer's weight-gradient GEMM under the fp8 recipe: operands column-quantized
    (``fp8_operands``) or rounded to bf16, fp32 result ``[E, M, N]``."""
    if fp8_operands:
        return emulate_grouped_gemm_tn(*quantize_cols(a), *quantize_cols(b), starts, ends)
    return _grouped_tn(a.bfloat16().float(), b.bfloat16().float(), _spans(starts, ends, a.shape[0], len(starts)))


def fp8_reference_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        l1_weights: torch.Tensor, l2_weights: torch.Tensor, activation_clamp: float | None,
                        dy: torch.Tensor, *, wgrad: str = "fp8", quantize: bool = True):
    """The layer of the README's contract under the fp8 recipe, in fp32 torch on any device.

    Returns ``(y, dx, d_topk_weights, d_l1, d_l2)`` (fp32) for the output gradient ``dy``, with
    the kernels' quantization points over the 128-aligned pool:

    - L1 forward ``h = x @ W1[e]^T``: x 1x128 along H, W1 ``nk`` blocks;
    - L2 forward ``o = act @ W2[e]^T``: act 1x128 along I, W2 ``nk``;
    - L2 dgrad ``da' = dy @ W2[e]``: dy 1x128 along H, W2 ``kn``; SwiGLU backward, ``<da', act>``
      and ``w * act`` from the unquantized fp32 values (the dgrad epilogue's registers);
    - L1 dgrad ``dx = dh @ W1[e]``: dh 1x128 along 2I, W1 ``kn``;
    - weight gradients ``dW2[e] = dy_e^T (w*act)_e`` and ``dW1[e] = dh_e^T x_e``: operands
      column-quantized (128x1 along the tokens) with ``wgrad="fp8"``, rounded to bf16 with
      ``wgrad="bf16"``.

    Everything between those points stays fp32 (operands are quantized from the producing
    epilogue's fp32 accumulators; the GPU layer also stores h and dh in bf16, a rounding 16 times
    finer than e4m3's). ``quantize=False`` turns every rounding off, which isolates the recipe's error.
    """
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"wgrad={wgrad!r}; expected one of {WGRAD_MODES}")
    num_tokens, hidden = x.shape
    if tuple(dy.shape) != (num_tokens, hidden):
        raise ValueError(f"dy has shape {tuple(dy.shape)}; expected x's shape {(num_tokens, hidden)}")
    num_experts, top_k = l1_weights.shape[0], topk_idx.shape[1]

    meta = compute_routing_torch(topk_idx, num_experts, FP8_BLOCK)
    spans = _spans(meta.starts, meta.ends, meta.num_pool_rows, num_experts)
    if quantize:
        w1, w2 = Fp8ExpertWeights.from_bf16(l1_weights), Fp8ExpertWeights.from_bf16(l2_weights)

        def m_grouped(a, w, layout):
            return emulated_m_grouped(a, w, meta.starts, meta.ends, layout)

        def k_grouped(a, b):
            return emulated_k_grouped(a, b, meta.starts, meta.ends, wgrad == "fp8")
    else:
        w1, w2 = l1_weights.detach().float(), l2_weights.detach().float()

        def m_grouped(a, w, layout):
            w = w if layout == "nt" else w.transpose(1, 2)
            return _grouped_nt(a, w.__getitem__, spans, w.shape[1])

        def k_grouped(a, b):
            return _grouped_tn(a, b, spans)

    flat_w = topk_weights.detach().float().reshape(-1)
    # Padding rows read the appended zero (an index that also exists when T = 0).
    padded_w = torch.cat([flat_w, flat_w.new_zeros(1)])
    row_weight = padded_w[torch.where(meta.row_to_slot >= 0, meta.row_to_slot, flat_w.numel()).long()]

    x_pool = elementwise.gather_rows(x.detach().float(), meta.row_to_slot, top_k)
    h = m_grouped(x_pool, w1, "nt")
    o = m_grouped(swiglu(h, activation_clamp), w2, "nt")
    y = elementwise.combine_rows(o, meta.slot_to_row, flat_w.view(num_tokens, top_k), top_k, torch.float32)

    dy_pool = elementwise.gather_rows(dy.detach().float(), meta.row_to_slot, top_k)
    da = m_grouped(dy_pool, w2, "nn")
    dh, d_row_weight, act_w = elementwise.swiglu_backward(h, da, row_weight, activation_clamp)
    dx = elementwise.combine_rows(m_grouped(dh, w1, "nn"), meta.slot_to_row, None, top_k, torch.float32)
    d_l2 = k_grouped(dy_pool, act_w)
    d_l1 = k_grouped(dh, x_pool)
    d_topk = torch.where(meta.slot_to_row >= 0, d_row_weight[meta.slot_to_row.clamp(min=0).long()], 0)
    return y, dx, d_topk.view(num_tokens, top_k), d_l1, d_l2
