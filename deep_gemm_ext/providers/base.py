"""The interface every GEMM provider implements: M-grouped and K-grouped GEMMs over the expert pool.

The pool (deep_gemm_ext.routing) holds each expert's rows contiguously, ``[starts[e], ends[e])``,
padded to the provider's ``row_alignment``. Two GEMM shapes cover the whole layer:

    m_grouped(a, w, meta, "nt")   out[r] = a[r] @ w[e].T    w [E, N, K]    L1 / L2 forward
    m_grouped(a, w, meta, "nn")   out[r] = a[r] @ w[e]      w [E, K, N]    L2 / L1 data gradients
    k_grouped(a, b, meta)         out[e] = a_e.T @ b_e                     weight gradients

and each may carry, where ``supports`` says so:
- under the fp8 recipe, an operand already quantized 1x128 along K (:class:`Fp8Rows`, where the
  provider's ``takes_fp8_rows``): the M-grouped GEMM reads it as it is, no quantization pass; with fp8
  weight gradients likewise a K-grouped operand quantized down its columns and transposed
  (:class:`Fp8Cols`, where ``takes_fp8_cols``);
- a gathered operand (:class:`Gather`): ``a`` (or ``b``) is a token matrix [T, C] and pool row r reads
  its row ``row_to_slot[r] // top_k`` (zeros for padding rows), so no pool is built;
- an epilogue other than the plain store: :class:`ScatterSlots` (rows into top-k slot order, for the
  combine).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..routing import RoutingMeta


class Gather(NamedTuple):
    """Pool row r of the operand is row ``row_to_slot[r] // top_k`` of a token matrix; ``mode`` names
    the loader ("cp_async", jit_kernels.GATHER_MODES). ``await_rows`` (the sm90 provider's L1 forward only):
    the token matrix's rows are still arriving from the overlapped dispatch, and the GEMM waits for them
    (jit_kernels.AwaitRows)."""
    row_to_slot: torch.Tensor
    top_k: int
    mode: str = "cp_async"
    await_rows: object = None


class Fp8Rows(NamedTuple):
    """An M-grouped GEMM's operand ``a [P, K]`` already quantized 1x128 along K
    (``recipes.fp8.quantize_rows``' layout): e4m3 ``data [P, K]``, fp32 ``scale [P, ceil(K/128)]``."""
    data: torch.Tensor
    scale: torch.Tensor


class Fp8Cols(NamedTuple):
    """A K-grouped GEMM's operand, the pool ``a [P, C]``, already quantized 128x1 down its columns (the
    contraction over the pool's rows) and transposed, K-major: e4m3 ``data [C, P']`` and fp32
    ``scale [C, ceil(P'/128)]`` for ``P' = fp8_cols_rows(P)`` rows (``jit_kernels.quantize_cols_transposed_fp8``'
    layout; rows past P are zeros)."""
    data: torch.Tensor
    scale: torch.Tensor


def fp8_cols_rows(num_pool_rows: int) -> int:
    """Rows P' of an :class:`Fp8Cols` operand of a pool of ``num_pool_rows`` rows: rounded up to 16
    (16-byte rows of e4m3, as TMA reads them)."""
    return -(-num_pool_rows // 16) * 16


@dataclass(frozen=True)
class ScatterSlots:
    """Output row r goes to row ``row_to_slot[r]`` of a [T*K, N] output in top-k slot order, times that
    slot's ``weights`` (in fp32, before the one rounding) when given. Returns the slot-ordered output."""
    weights: torch.Tensor | None = None


class GemmProvider:
    """Grouped GEMMs of one library. Subclasses set the class attributes and implement the two GEMMs."""

    #: Rows per expert group the provider needs (the pool's padding).
    row_alignment: int = 1
    #: Names of the recipes whose operands the GEMMs take.
    recipes: tuple[str, ...] = ("bf16",)
    #: The M-grouped GEMM takes a :class:`Gather` operand.
    gathers: bool = False
    #: Under the fp8 recipe the M-grouped GEMM takes an :class:`Fp8Rows` operand.
    takes_fp8_rows: bool = False
    #: Under the fp8 recipe with fp8 weight gradients the K-grouped GEMM takes an :class:`Fp8Cols` operand.
    takes_fp8_cols: bool = False
    #: Under the fp8 recipe every operand the provider quantizes itself (the M-grouped GEMMs' rows,
    #: the fp8 weight gradients' columns) is quantized by a kernel that gathers the token rows, so a
    #: gathered operand costs no more than a pool.
    fp8_quantizers_gather: bool = False

    def compute_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """dtype of the pool, h and the GEMMs for inputs of ``x_dtype``."""
        return torch.bfloat16

    def supports(self, recipe, epilogue: type) -> bool:
        """The M-grouped GEMM runs ``epilogue`` (a class above) under ``recipe``."""
        return False

    def m_grouped(self, a: torch.Tensor, w, meta: RoutingMeta, layout: str, *, recipe, gather: Gather | None = None,
                  epilogue=None, zero_unowned: bool = False):
        """``layout`` "nt" or "nn" as above. Rows no expert owns (past ``meta.ends[-1]``) are left
        unwritten unless ``zero_unowned``."""
        raise NotImplementedError

    def k_grouped(self, a: torch.Tensor, b: torch.Tensor, meta: RoutingMeta, *, recipe, gather_a: Gather | None = None,
                  gather_b: Gather | None = None) -> torch.Tensor:
        """[E, a.shape[1], b.shape[1]]; zero for experts without rows."""
        raise NotImplementedError
