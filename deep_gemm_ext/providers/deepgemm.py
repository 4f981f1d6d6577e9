"""The layer's grouped GEMMs on upstream DeepGEMM's published kernels, called unchanged (a GEMM
provider: the layer, routing and elementwise steps are this package's own).

SM90 (Hopper): the forward and the data gradients run on DeepGEMM's m-grouped contiguous GEMMs
over the block-aligned pool of :mod:`deep_gemm_ext.routing`, the weight gradients on its
k-grouped GEMMs.

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

SM100 (Blackwell): the same bf16 GEMM calls (untested: no SM100 machine was available).
"""
from __future__ import annotations

import functools

import torch

# The fp8 recipe's quantizers and weight copies live in recipes/fp8.py; these names stay for callers.
from ..recipes.fp8 import FP8_BLOCK, WEIGHT_CACHE, Fp8ExpertWeights
from ..recipes.fp8 import quantize_cols as quantize_cols_fp8
from ..recipes.fp8 import quantize_rows as quantize_rows_fp8
from ..routing import RoutingMeta
from .base import GemmProvider

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


#: K multiple of upstream's SM90 bf16 GEMMs (their k-block).
BF16_K_MULTIPLE = 64


def unsupported_shape_reason(hidden: int, intermediate: int, recipe) -> str | None:
    """Why ``(hidden, intermediate)`` cannot run on DeepGEMM's GEMMs under ``recipe`` (a
    :class:`deep_gemm_ext.recipes.Recipe`); None if it can."""
    # fp8 scales cover 128-wide blocks of H, I and 2I; upstream's SM90 bf16 GEMMs take K in steps of
    # their 64-wide k-block (it asserts K % 64 == 0), and H and I are each some GEMM's K.
    multiple = FP8_BLOCK if recipe.fp8 else BF16_K_MULTIPLE
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if value <= 0 or value % multiple:
            return f"{name}={value} must be a positive multiple of {multiple} for recipe={recipe.name!r}"
    return None


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


def _check_recipe(fp8: bool, arch_major: int) -> None:
    if arch_major not in (9, 10):
        raise RuntimeError(f"DeepGEMM's grouped GEMMs need SM90 or SM100, got SM{arch_major}0")
    if fp8 and arch_major != 9:
        raise RuntimeError(f"recipe='fp8' through DeepGEMM's grouped GEMMs is implemented for SM90 "
                           f"(fp32 scales) only, got SM{arch_major}0; use recipe='bf16'")


def _check_pool(name: str, t: torch.Tensor, meta: RoutingMeta) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16 or t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D bf16 tensor, got {t.dtype} shape "
                         f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")
    if t.shape[0] != meta.num_pool_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected meta.num_pool_rows={meta.num_pool_rows}")


def _check_meta(meta: RoutingMeta, alignment: int) -> None:
    if meta.align % alignment:
        raise ValueError(f"meta.align={meta.align} is not a multiple of DeepGEMM's contiguous-layout "
                         f"alignment {alignment}; route with align=token_group_alignment()")


def _weights(name: str, w, fp8: bool, num_experts: int, k: int, k_dim: int):
    """bf16 expert weights as given, or their fp8 form (quantized here unless already prepared);
    ``k_dim`` is the dimension the GEMM contracts over (2 for ``[E, N, K]``, 1 for ``[E, K, N]``)."""
    if isinstance(w, Fp8ExpertWeights):
        if not fp8:
            raise TypeError(f"{name} is Fp8ExpertWeights but the recipe is bf16; pass bf16 weights")
    elif isinstance(w, torch.Tensor):
        if w.dtype != torch.bfloat16 or w.dim() != 3:
            raise ValueError(f"{name} must be a 3-D bf16 tensor, got {w.dtype} of shape {tuple(w.shape)}")
    else:
        raise TypeError(f"{name} must be a torch.Tensor or Fp8ExpertWeights, got {type(w).__name__}")
    if w.shape[0] != num_experts or w.shape[k_dim] != k:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {num_experts} experts (the routing's) and "
                         f"{k} in dimension {k_dim} (the operand's contraction size)")
    if fp8 and isinstance(w, torch.Tensor):
        return WEIGHT_CACHE.get(w)  # quantized once per weight version
    return w.contiguous() if isinstance(w, torch.Tensor) else w


def m_indices(meta: RoutingMeta) -> torch.Tensor:
    """DeepGEMM's per-row group layout for the pool: each row's expert, -1 on padding rows."""
    rows = torch.arange(meta.num_pool_rows, dtype=torch.int32, device=meta.ends.device)
    expert = torch.searchsorted(meta.ends, rows, right=True).to(torch.int32)
    return torch.where(meta.row_to_slot >= 0, expert, torch.full_like(expert, -1))


def _cached(meta: RoutingMeta, key: str, make):
    """One value per routing (the layout of the m-grouped GEMMs, the k-grouped GEMMs' host sizes)."""
    if key not in meta.extras:
        meta.extras[key] = make(meta)
    return meta.extras[key]


def _expert_rows(meta: RoutingMeta) -> list[int]:
    return (meta.ends - meta.starts).tolist()


class DeepGemmProvider(GemmProvider):
    """Upstream's ``m_grouped_{bf16,fp8}_gemm_*_contiguous`` and ``k_grouped_*`` GEMMs."""

    row_alignment = 128
    recipes = ("bf16", "fp8")

    is_available = staticmethod(is_available)
    require = staticmethod(require)
    unsupported_shape_reason = staticmethod(unsupported_shape_reason)

    def supports(self, recipe, epilogue):
        return False

    def m_grouped(self, a, w, meta: RoutingMeta, layout, *, recipe, gather=None, epilogue=None, zero_unowned=False):
        """Rows past ``meta.ends[-1]`` of the output are zero with ``zero_unowned``, else unspecified."""
        dg = _deep_gemm()
        _check_recipe(recipe.fp8, _arch_major("a", a))
        _check_pool("a", a, meta)
        _check_meta(meta, int(dg.get_mk_alignment_for_contiguous_layout()))
        transposed = layout == "nn"
        w = _weights("w", w, recipe.fp8, meta.num_experts, a.shape[1], 1 if transposed else 2)
        layout_rows = _cached(meta, "deep_gemm.m_indices", m_indices)
        if not recipe.fp8:
            out = (a.new_zeros if zero_unowned else a.new_empty)(a.shape[0], w.shape[2] if transposed else w.shape[1])
            gemm = dg.m_grouped_bf16_gemm_nn_contiguous if transposed else dg.m_grouped_bf16_gemm_nt_contiguous
            gemm(a, w, out, layout_rows)
            return out
        b = w.kn if transposed else w.nk
        out = (a.new_zeros if zero_unowned else a.new_empty)(a.shape[0], b[0].shape[1])
        dg.m_grouped_fp8_gemm_nt_contiguous(quantize_rows_fp8(a), b, out, layout_rows)
        return out

    def k_grouped(self, a, b, meta: RoutingMeta, *, recipe, gather_a=None, gather_b=None):
        """``d[e] = a[rows of e]^T @ b[rows of e]``: fp32 ``[E, M, N]``."""
        dg = _deep_gemm()
        _check_recipe(recipe.fp8, _arch_major("a", a))
        _check_pool("a", a, meta)
        _check_pool("b", b, meta)
        # Each expert's rows are a K of upstream's K-grouped GEMMs, which it takes in multiples of 128.
        _check_meta(meta, int(dg.get_mk_alignment_for_contiguous_layout()))
        ks = _cached(meta, "deep_gemm.expert_rows", _expert_rows)
        rows = sum(ks)
        a, b = a[:rows], b[:rows]
        d = torch.zeros(len(ks), a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
        layout = torch.tensor(ks, dtype=torch.int32, device=a.device)
        if not (recipe.fp8 and recipe.fp8_wgrad):
            dg.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, layout, d)
            return d
        (aq, a_scale), (bq, b_scale) = quantize_cols_fp8(a), quantize_cols_fp8(b)
        dg.k_grouped_fp8_gemm_nt_contiguous((group_transpose(aq, ks), a_scale.t()),
                                            (group_transpose(bq, ks), b_scale.t()),
                                            d, ks, layout, d, recipe=(1, 1, FP8_BLOCK))
        return d
