"""The MoE layer's GEMMs on upstream DeepGEMM's published kernels, called unchanged.

SM90 (Hopper): the forward and the data gradients run on DeepGEMM's m-grouped contiguous GEMMs
over the block-aligned pool of :mod:`deep_gemm_ext.routing`, the weight gradients on its
k-grouped GEMMs; SwiGLU forward and backward are this package's own (:mod:`deep_gemm_ext.unfused`).

What DeepGEMM expects, and how the pool maps onto it:

- m-grouped contiguous: ``a [P, K]`` K-major, weights ``[E, N, K]`` (``nt``) or ``[E, K, N]``
  (``nn``, bf16 only: fp8 needs K-major weights on SM90), ``d [P, N]`` bf16, and ``m_indices [P]``
  int32 with each row's expert, -1 on padding rows. Blocks of
  ``get_mk_alignment_for_contiguous_layout()`` rows (128) belong to one expert; a block whose first
  row is -1 is skipped and its output rows stay unwritten, while the padding rows of a block that
  starts with a real row are computed (zeros, from zero inputs), which the weight gradients rely on.
  The pool's experts start on multiples of ``meta.align``, so ``meta.align`` must be a multiple of
  that alignment.
- fp8 (SM90, the DeepSeek-V3 recipe): e4m3 data and fp32 scales, 1x128 along K per row for
  activations and gradients, 128x128 blocks for weights. Both operands must be K-major, so the data
  gradients read a transposed copy of each weight (:class:`Fp8ExpertWeights` holds both).
- k-grouped: every expert's row count on the host (``ks_cpu``, multiples of the alignment) and as
  an int32 tensor; the result is accumulated into fp32 ``d [E, M, N]`` given as ``c``. bf16 takes
  the pool slabs as they are (MN-major, ``k_grouped_bf16_gemm_tn_contiguous``); fp8 on SM90 takes
  each expert's slab transposed to K-major and flattened, with one scale per 128 rows and column
  (``k_grouped_fp8_gemm_nt_contiguous``). Reading the counts costs one host synchronisation per
  backward.

SM100 (Blackwell): :func:`mega_moe_forward_sm100` calls upstream's fused ``bf16_mega_moe`` /
``fp8_fp4_mega_moe``. It is untested: no SM100 machine was available.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import unfused
from ..routing import RoutingMeta

RECIPES = ("bf16", "fp8")
MEGA_MOE_RECIPES = ("bf16", "fp8xfp4")
#: Rows and columns covered by one fp8 scale (1x128 activations, 128x128 weights).
FP8_BLOCK = 128
_FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8_DTYPE).max
#: Smallest amax a scale is derived from, so all-zero blocks get a finite scale.
_AMAX_FLOOR = 1e-4

_INSTALL_HINT = (
    "DeepGEMM is not importable in this process ({error}). The deep_gemm backend needs upstream "
    "DeepGEMM built from source against this process's torch and CUDA: clone "
    "https://github.com/deepseek-ai/DeepGEMM with its submodules, check that this project's "
    "patches still apply with `python scripts/check_patches.py <checkout>`, apply them in the "
    "order of patches/README.md (`git apply patches/NNNN-*.patch`), then run `./install.sh` in the "
    "checkout (or `./develop.sh` and put the checkout on PYTHONPATH). Build with a compiler that "
    "links the shared libstdc++ torch uses (e.g. CXX=/usr/bin/g++; `readelf -d deep_gemm/_C*.so` must "
    "list libstdc++.so.6): an extension with a static copy segfaults at its first GEMM call."
)


@functools.lru_cache(maxsize=1)
def _load():
    try:
        import deep_gemm
    except Exception as exc:  # a broken build fails in many ways: ImportError, OSError, AssertionError
        return None, f"{type(exc).__name__}: {exc}"
    return deep_gemm, None


def _deep_gemm():
    module, error = _load()
    if module is None:
        raise RuntimeError(_INSTALL_HINT.format(error=error))
    return module


def require() -> None:
    """Raise the install hint unless deep_gemm is importable here."""
    _deep_gemm()


def is_available() -> bool:
    """True when deep_gemm imports and the current CUDA device is SM90 or SM100."""
    if not torch.cuda.is_available() or _load()[0] is None:
        return False
    return torch.cuda.get_device_capability()[0] in (9, 10)


def token_group_alignment() -> int:
    """Rows per expert block DeepGEMM's contiguous layouts need (the ``align`` to route with)."""
    return int(_deep_gemm().get_mk_alignment_for_contiguous_layout())


def unsupported_shape_reason(hidden: int, intermediate: int, recipe: str = "bf16") -> str | None:
    """Why ``(hidden, intermediate)`` cannot run on this backend under ``recipe``; None if it can."""
    if recipe not in RECIPES:
        return f"recipe={recipe!r} is not supported by the deep_gemm backend; expected one of {RECIPES}"
    # fp8 scales cover 128-wide blocks of H, I and 2I; bf16 rows must be 16-byte aligned for TMA.
    multiple = FP8_BLOCK if recipe == "fp8" else 8
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if value <= 0 or value % multiple:
            return f"{name}={value} must be a positive multiple of {multiple} for recipe={recipe!r}"
    return None


# ---------------------------------------------------------------------------------------------
# fp8 quantization (torch ops; the layouts DeepGEMM's SM90 kernels read).


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, K / 128]``), one scale per row and 128 columns."""
    m, k = x.shape
    blocks = x.reshape(m, k // FP8_BLOCK, FP8_BLOCK).float()
    scale = blocks.abs().amax(dim=2).clamp(min=_AMAX_FLOOR) / _FP8_MAX
    data = (blocks / scale.unsqueeze(2)).to(_FP8_DTYPE).reshape(m, k)
    return data, scale


def quantize_cols_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, M]`` (R a multiple of 128) -> (e4m3 ``[R, M]``, fp32 ``[R / 128, M]``): scales along rows."""
    r, m = x.shape
    blocks = x.reshape(r // FP8_BLOCK, FP8_BLOCK, m).float()
    scale = blocks.abs().amax(dim=1).clamp(min=_AMAX_FLOOR) / _FP8_MAX
    data = (blocks / scale.unsqueeze(1)).to(_FP8_DTYPE).reshape(r, m)
    return data, scale


@dataclass
class Fp8ExpertWeights:
    """Expert weights ``[E, N, K]`` in 128x128-block fp8, in both K-major orientations.

    ``nk`` serves ``a @ W[e]^T`` (forward), ``kn`` serves ``a @ W[e]`` (data gradient). A 128x128
    block transposes exactly (data and scale grid), so ``kn`` adds no quantization error. Build it
    once per weight version, not per call.
    """

    nk: tuple[torch.Tensor, torch.Tensor]
    kn: tuple[torch.Tensor, torch.Tensor]

    @property
    def shape(self) -> torch.Size:
        return self.nk[0].shape

    @classmethod
    def from_bf16(cls, w: torch.Tensor) -> "Fp8ExpertWeights":
        if w.dim() != 3 or w.shape[1] % FP8_BLOCK or w.shape[2] % FP8_BLOCK:
            raise ValueError(f"expert weights must be [E, N, K] with N and K multiples of {FP8_BLOCK} "
                             f"for fp8, got shape {tuple(w.shape)}")
        e, n, k = w.shape
        blocks = w.reshape(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK).float()
        scale = blocks.abs().amax(dim=(2, 4)).clamp(min=_AMAX_FLOOR) / _FP8_MAX
        data = (blocks / scale[:, :, None, :, None]).to(_FP8_DTYPE).reshape(e, n, k)
        return cls(nk=(data, scale),
                   kn=(data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()))


def group_transpose(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Each group's rows ``x[s:s+k]`` ([k, M]) stored as ``[M, k]`` row-major, concatenated (1-D)."""
    parts, start = [], 0
    for k in ks:
        if k:
            parts.append(x[start:start + k].t().reshape(-1))
        start += k
    return torch.cat(parts) if parts else x.new_empty(0)


# ---------------------------------------------------------------------------------------------
# Argument checks.


def _arch_major(name: str, t) -> int:
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got {type(t).__name__} on "
                         f"{getattr(t, 'device', None)}")
    return torch.cuda.get_device_capability(t.device)[0]


def _check_recipe(recipe: str, arch_major: int) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}; expected one of {RECIPES}")
    if arch_major not in (9, 10):
        raise RuntimeError(f"DeepGEMM's grouped GEMMs need SM90 or SM100, got SM{arch_major}0")
    if recipe == "fp8" and arch_major != 9:
        raise RuntimeError(f"recipe='fp8' through DeepGEMM's grouped GEMMs is implemented for SM90 "
                           f"(fp32 scales) only, got SM{arch_major}0; use recipe='bf16'")


def _check_pool(name: str, t: torch.Tensor, meta: RoutingMeta, width: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16 or t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D bf16 tensor, got {t.dtype} shape "
                         f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")
    if t.shape[0] != meta.num_pool_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected meta.num_pool_rows={meta.num_pool_rows}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} has {t.shape[1]} columns, expected {width}")


def _check_meta(meta: RoutingMeta, alignment: int) -> None:
    if meta.align % alignment:
        raise ValueError(f"meta.align={meta.align} is not a multiple of DeepGEMM's contiguous-layout "
                         f"alignment {alignment}; route with align=token_group_alignment()")


def _weights(name: str, w, recipe: str, shape: tuple[int, int, int]):
    """bf16 ``[E, N, K]`` as given, or its fp8 form (quantized here unless already prepared)."""
    if isinstance(w, Fp8ExpertWeights):
        if recipe != "fp8":
            raise TypeError(f"{name} is Fp8ExpertWeights but recipe={recipe!r}; pass bf16 weights")
        got = tuple(w.shape)
    elif isinstance(w, torch.Tensor):
        if w.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bf16, got {w.dtype}")
        got = tuple(w.shape)
    else:
        raise TypeError(f"{name} must be a torch.Tensor or Fp8ExpertWeights, got {type(w).__name__}")
    if got != shape:
        raise ValueError(f"{name} has shape {got}, expected {shape}")
    if recipe == "fp8" and isinstance(w, torch.Tensor):
        return Fp8ExpertWeights.from_bf16(w)
    return w.contiguous() if isinstance(w, torch.Tensor) else w


def _layer_shapes(x_pool: torch.Tensor, meta: RoutingMeta, l2) -> tuple[int, int, int]:
    if not isinstance(l2, (torch.Tensor, Fp8ExpertWeights)) or len(l2.shape) != 3:
        raise ValueError(f"l2 must be [E, H, I], got {type(l2).__name__} of shape "
                         f"{tuple(getattr(l2, 'shape', ()))}")
    return meta.num_experts, x_pool.shape[1], l2.shape[2]


# ---------------------------------------------------------------------------------------------
# The GEMMs.


def m_indices(meta: RoutingMeta) -> torch.Tensor:
    """DeepGEMM's per-row group layout for the pool: each row's expert, -1 on padding rows."""
    rows = torch.arange(meta.num_pool_rows, dtype=torch.int32, device=meta.ends.device)
    expert = torch.searchsorted(meta.ends, rows, right=True).to(torch.int32)
    return torch.where(meta.row_to_slot >= 0, expert, torch.full_like(expert, -1))


def _m_grouped(dg, a: torch.Tensor, w, layout: torch.Tensor, recipe: str, *, transposed: bool) -> torch.Tensor:
    """Pool GEMM: ``a @ W[e]^T`` for ``W [E, N, K]``, or ``a @ W[e]`` when ``transposed``."""
    if recipe == "bf16":
        out = a.new_empty(a.shape[0], w.shape[2] if transposed else w.shape[1])
        gemm = dg.m_grouped_bf16_gemm_nn_contiguous if transposed else dg.m_grouped_bf16_gemm_nt_contiguous
        gemm(a, w, out, layout)
        return out
    b = w.kn if transposed else w.nk
    out = a.new_empty(a.shape[0], b[0].shape[1])
    dg.m_grouped_fp8_gemm_nt_contiguous(quantize_rows_fp8(a), b, out, layout)
    return out


def _k_grouped(dg, a: torch.Tensor, b: torch.Tensor, ks: list[int], recipe: str) -> torch.Tensor:
    """``d[e] = a[rows of e]^T @ b[rows of e]`` over the leading ``sum(ks)`` rows: fp32 ``[E, M, N]``."""
    rows = sum(ks)
    a, b = a[:rows], b[:rows]
    d = torch.zeros(len(ks), a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    layout = torch.tensor(ks, dtype=torch.int32, device=a.device)
    if recipe == "bf16":
        dg.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, layout, d)
        return d
    (aq, a_scale), (bq, b_scale) = quantize_cols_fp8(a), quantize_cols_fp8(b)
    dg.k_grouped_fp8_gemm_nt_contiguous((group_transpose(aq, ks), a_scale.t()),
                                        (group_transpose(bq, ks), b_scale.t()),
                                        d, ks, layout, d, recipe=(1, 1, FP8_BLOCK))
    return d


def deepgemm_forward(x_pool: torch.Tensor, meta: RoutingMeta, l1, l2,
                     activation_clamp: float | None = None, recipe: str = "bf16"):
    """L1 GEMM, SwiGLU and L2 GEMM over the pool: ``(o_pool [P, H], h [P, 2I])``, both bf16.

    ``x_pool`` is x gathered in pool order with zero padding rows (``unfused.gather_rows``);
    ``l1 [E, 2I, H]`` and ``l2 [E, H, I]`` are bf16, or :class:`Fp8ExpertWeights` under
    ``recipe="fp8"`` (bf16 weights are then quantized on every call). Rows past ``meta.ends[-1]``
    of both outputs are unspecified; the caller's combine reads real rows only.
    """
    dg = _deep_gemm()
    _check_recipe(recipe, _arch_major("x_pool", x_pool))
    _check_pool("x_pool", x_pool, meta)
    _check_meta(meta, int(dg.get_mk_alignment_for_contiguous_layout()))
    num_experts, hidden, inter = _layer_shapes(x_pool, meta, l2)
    l1 = _weights("l1", l1, recipe, (num_experts, 2 * inter, hidden))
    l2 = _weights("l2", l2, recipe, (num_experts, hidden, inter))
    layout = m_indices(meta)
    h = _m_grouped(dg, x_pool, l1, layout, recipe, transposed=False)
    act = unfused.swiglu_forward(h, activation_clamp)
    o_pool = _m_grouped(dg, act, l2, layout, recipe, transposed=False)
    return o_pool, h


def deepgemm_backward(dy_pool: torch.Tensor, x_pool: torch.Tensor, h: torch.Tensor, meta: RoutingMeta,
                      row_weight: torch.Tensor, l1, l2, activation_clamp: float | None = None,
                      recipe: str = "bf16"):
    """Gradients over the pool: ``(dx_pool [P, H] bf16, d_row_weight [P] fp32, d_l1, d_l2)``.

    ``dy_pool`` is dy gathered in pool order and ``x_pool`` the saved pool, both zero on padding
    rows; ``h`` is the saved L1 output; ``row_weight [P]`` holds each row's routing weight (0 on
    padding). ``d_row_weight[r] = <dy_pool[r] @ l2[e], act[r]>`` is d topk_weights of row r's slot;
    ``d_l1 [E, 2I, H]`` and ``d_l2 [E, H, I]`` are fp32. Reads the expert sizes on the host once.
    """
    dg = _deep_gemm()
    _check_recipe(recipe, _arch_major("x_pool", x_pool))
    _check_pool("x_pool", x_pool, meta)
    num_experts, hidden, inter = _layer_shapes(x_pool, meta, l2)
    _check_pool("dy_pool", dy_pool, meta, hidden)
    _check_pool("h", h, meta, 2 * inter)
    if row_weight.shape != (meta.num_pool_rows,):
        raise ValueError(f"row_weight has shape {tuple(row_weight.shape)}, expected ({meta.num_pool_rows},)")
    _check_meta(meta, int(dg.get_mk_alignment_for_contiguous_layout()))
    l1 = _weights("l1", l1, recipe, (num_experts, 2 * inter, hidden))
    l2 = _weights("l2", l2, recipe, (num_experts, hidden, inter))
    layout = m_indices(meta)
    ks = (meta.ends - meta.starts).tolist()

    da = _m_grouped(dg, dy_pool, l2, layout, recipe, transposed=True)
    dh, d_row_weight, act_w = unfused.swiglu_backward(h, da, row_weight, activation_clamp)
    del da
    d_l2 = _k_grouped(dg, dy_pool, act_w, ks, recipe)
    del act_w
    dx_pool = _m_grouped(dg, dh, l1, layout, recipe, transposed=True)
    d_l1 = _k_grouped(dg, dh, x_pool, ks, recipe)
    return dx_pool, d_row_weight, d_l1, d_l2


# ---------------------------------------------------------------------------------------------
# SM100: upstream's fused forward. Untested (no SM100 machine was available).

_SYMM_BUFFERS: dict = {}


def _symm_buffer(dg, group, num_experts, num_tokens, top_k, hidden, inter, mma_type):
    key = (id(group), num_experts, num_tokens, top_k, hidden, inter, mma_type)
    if key not in _SYMM_BUFFERS:
        _SYMM_BUFFERS[key] = dg.get_symm_buffer_for_mega_moe(
            group, num_experts, num_tokens, top_k, hidden, inter, mma_type=mma_type)
    return _SYMM_BUFFERS[key]


def _fp4_weights(dg, w: torch.Tensor):
    """bf16 ``[E, N, K]`` -> upstream's FP4 weights with per-32 UE8M0 scales in its required layout."""
    from deep_gemm.utils import per_token_cast_to_fp4

    num_groups, n, k = w.shape
    data = torch.empty(num_groups, n, k // 2, dtype=torch.int8, device=w.device)
    scale = torch.empty(num_groups, n, k // 32, dtype=torch.float, device=w.device)
    for g in range(num_groups):
        data[g], scale[g] = per_token_cast_to_fp4(w[g], use_ue8m0=True, gran_k=32)
    return data, dg.transform_sf_into_required_layout(scale, n, k, (1, 32), num_groups)


def mega_moe_forward_sm100(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           l1_weights: torch.Tensor, l2_weights: torch.Tensor, group,
                           activation_clamp: float | None = None, recipe: str = "bf16") -> torch.Tensor:
    """``y [T, H]`` from upstream's fused Mega MoE forward on SM100 (untested here).

    ``group`` is the torch.distributed process group of the expert-parallel ranks (size 1 for a
    single GPU); its symmetric buffer is allocated once per shape and kept. ``recipe="bf16"`` runs
    ``bf16_mega_moe``; ``"fp8xfp4"`` casts x to fp8 and the weights to fp4 (per-32 UE8M0 scales)
    and runs ``fp8_fp4_mega_moe``. Weights are transformed on every call.
    """
    dg = _deep_gemm()
    arch_major = _arch_major("x", x)
    if arch_major != 10:
        raise RuntimeError(f"upstream Mega MoE runs on SM100 only, got SM{arch_major}0; on SM90 use "
                           f"deepgemm_forward")
    if recipe not in MEGA_MOE_RECIPES:
        raise ValueError(f"recipe={recipe!r}; expected one of {MEGA_MOE_RECIPES}")
    if group is None:
        raise ValueError("group must be a torch.distributed ProcessGroup (upstream allocates "
                         "symmetric memory over it), got None")
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = l1_weights.shape
    inter = two_inter // 2
    num_experts = num_local * group.size()
    mma_type = "bf16xbf16" if recipe == "bf16" else "fp8xfp4"
    buffer = _symm_buffer(dg, group, num_experts, num_tokens, topk_idx.shape[1], hidden, inter, mma_type)
    if recipe == "bf16":
        l1, l2 = dg.transform_weights_for_mega_moe(l1_weights, l2_weights)
        buffer.x[:num_tokens].copy_(x)
    else:
        from deep_gemm.utils import per_token_cast_to_fp8

        l1, l2 = dg.transform_weights_for_mega_moe(_fp4_weights(dg, l1_weights), _fp4_weights(dg, l2_weights))
        x_data, x_scale = per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        buffer.x[:num_tokens].copy_(x_data)
        buffer.x_sf[:num_tokens].copy_(x_scale)
    buffer.topk_idx[:num_tokens].copy_(topk_idx)
    buffer.topk_weights[:num_tokens].copy_(topk_weights)
    y = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=x.device)
    kernel = dg.bf16_mega_moe if recipe == "bf16" else dg.fp8_fp4_mega_moe
    kernel(y, l1, l2, buffer, activation_clamp=activation_clamp)
    return y
