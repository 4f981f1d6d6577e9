"""Grouped bf16 GEMMs on the block-aligned expert pool (kernels/impls/sm90_bf16_grouped_gemm.cuh), SM90.

Layout letters follow DeepGEMM: the first says how A is given, the second how B is given, ``n`` for
the operand's natural layout (A [M, K], B [K, N]) and ``t`` for its transpose (A [K, M], B [N, K]).

    m_grouped_bf16_gemm_nt_contiguous(a [P, K], b [E, N, K])   out[r] = a[r] @ b[e].T   forward
    m_grouped_bf16_gemm_nn_contiguous(a [P, K], b [E, K, N])   out[r] = a[r] @ b[e]     dgrad
    k_grouped_bf16_gemm_tn_contiguous(a [P, M], b [P, N])      out[e] = a_e.T @ b_e     wgrad

Expert ``e`` owns pool rows ``[starts[e], ends[e])``; both are multiples of ``GROUP_ALIGNMENT`` (the
routing of ``deep_gemm_ext.routing`` produces such pools) and padding rows of the pool are zero.
M-grouped GEMMs leave output rows that no expert owns unwritten; the K-grouped GEMM writes zeros
for experts without rows. ``starts``/``ends`` stay on the device: nothing here synchronises.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .. import jit
from ..routing import TOKEN_GROUP_ALIGNMENT

#: Rows per expert block the kernel assumes (its BLOCK_M): starts/ends must be multiples of it.
GROUP_ALIGNMENT = TOKEN_GROUP_ALIGNMENT
_BLOCK_M = 128
_BLOCK_K = 64
_THREADS = 384
# M blocks per scheduler group (tiles of GROUP_M pool blocks sweep all N blocks for L2 reuse).
_GROUP_M = 16
assert GROUP_ALIGNMENT % _BLOCK_M == 0

_TYPES = {"nt": ("MGroupedContiguous", "K", "K"), "nn": ("MGroupedContiguous", "K", "MN"),
          "tn": ("KGroupedContiguous", "MN", "MN")}
# Measured on H200 (tests/cuda harness): 128 x 256 tiles with 4 stages beat 128 x 128 with 6
# stages on every MoE shape; 128-wide tiles only pay off where they pad N less.
_STAGES = {256: 4, 128: 6}


@dataclass(frozen=True)
class GemmConfig:
    layout: str         # "nt", "nn" or "tn"
    block_n: int
    paired_n: bool = False

    @property
    def stages(self) -> int:
        return _STAGES[self.block_n]

    @property
    def name(self) -> str:
        return f"sm90_bf16_grouped_gemm_{self.layout}_n{self.block_n}_s{self.stages}" + ("_paired" if self.paired_n else "")

    def smem_bytes(self) -> int:
        """Dynamic smem of the launch: SmemLayout<BLOCK_N, kNumStages, EpilogueStoreBF16>::kTotalBytes."""
        stage = _BLOCK_M * _BLOCK_K * 2 + self.block_n * _BLOCK_K * 2
        epilogue = 2 * 2 * 64 * 64 * 2  # two warpgroups x two 64x64 bf16 staging buffers
        barriers = -(-(self.stages * stage + epilogue) // 1024) * 1024
        return barriers + 2 * self.stages * 8 + 1024

    def code(self) -> str:
        gemm_type, major_a, major_b = _TYPES[self.layout]
        return ("#include <impls/sm90_bf16_grouped_gemm.cuh>\n"
                "static void* __instantiate = reinterpret_cast<void*>(&dge::gemm::sm90_bf16_grouped_gemm_kernel<\n"
                f"    dge::sched::GroupedGemmType::{gemm_type}, dge::mma::Major::{major_a}, dge::mma::Major::{major_b},\n"
                f"    {self.block_n}, {self.stages}, 1, {'true' if self.paired_n else 'false'}, {_GROUP_M},\n"
                "    dge::gemm::EpilogueStoreBF16, CUtensorMap>);\n")


def _all_configs() -> list[GemmConfig]:
    configs = [GemmConfig(layout, block_n) for layout in ("nt", "nn", "tn") for block_n in (256, 128)]
    return configs + [GemmConfig("nt", 256, paired_n=True)]


@jit.register("sm90_bf16_grouped_gemm")
def configs():
    return [(c.name, c.code(), True, c.smem_bytes()) for c in _all_configs()]


def _pick_block_n(n: int) -> int:
    """256 unless 128-wide tiles pad N less (e.g. N = 384)."""
    return 128 if -(-n // 128) * 128 < -(-n // 256) * 256 else 256


# -- checks -----------------------------------------------------------------------------------------------


def _check_tensor(label: str, tensor, dim: int, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{label}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise TypeError(f"{label}: dtype {tensor.dtype}, expected {dtype}")
    if tensor.dim() != dim:
        raise ValueError(f"{label}: shape {tuple(tensor.shape)}, expected {dim} dimensions")
    if not tensor.is_contiguous():
        raise ValueError(f"{label}: strides {tuple(tensor.stride())}, expected a contiguous tensor")


def _check_inputs(a, b, b_dim: int, starts, ends) -> int:
    """dtype/shape checks first, then devices: all on one CUDA device. Returns E."""
    _check_tensor("a", a, 2, torch.bfloat16)
    _check_tensor("b", b, b_dim, torch.bfloat16)
    _check_tensor("starts", starts, 1, torch.int32)
    _check_tensor("ends", ends, 1, torch.int32)
    if starts.shape != ends.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and ends {tuple(ends.shape)}: expected the same shape [E]")
    if not a.is_cuda:
        raise ValueError(f"a: on {a.device}, expected a CUDA tensor")
    for label, t in (("b", b), ("starts", starts), ("ends", ends)):
        if t.device != a.device:
            raise ValueError(f"{label}: on {t.device}, expected {a.device} like a")
    return starts.shape[0]


def _check_multiple(label: str, value: int, multiple: int, why: str) -> None:
    if value % multiple:
        raise ValueError(f"{label}={value}: expected a multiple of {multiple} ({why})")


def _check_out(out, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    _check_tensor("out", out, len(shape), torch.bfloat16)
    if tuple(out.shape) != shape:
        raise ValueError(f"out: shape {tuple(out.shape)}, expected {shape}")
    if out.device != device:
        raise ValueError(f"out: on {out.device}, expected {device} like a")
    return out


# -- launch -----------------------------------------------------------------------------------------------


def _launch(config: GemmConfig, a: torch.Tensor, b_map: jit.TensorMap, out_map: jit.TensorMap, starts, ends,
            shape_m: int, shape_n: int, shape_k: int, max_tiles: int) -> None:
    kernel = jit.build(config.name, config.code())
    a_map = jit.make_tma_2d(a, 64, 64)
    grid = (max(1, min(jit.num_sms(a.device), max_tiles)), 1, 1)
    kernel.launch(grid, (_THREADS, 1, 1),
                  (starts, ends, ctypes.c_uint32(starts.shape[0]), ctypes.c_uint32(shape_m),
                   ctypes.c_uint32(shape_n), ctypes.c_uint32(shape_k), a_map, b_map, out_map),
                  smem=config.smem_bytes())


def _m_grouped(layout: str, a, b, starts, ends, out, paired_n: bool) -> torch.Tensor:
    num_experts = _check_inputs(a, b, 3, starts, ends)
    rows, k = a.shape
    if layout == "nt":
        experts_b, n, k_b = b.shape
    else:
        experts_b, k_b, n = b.shape
    if experts_b != num_experts:
        raise ValueError(f"b: {experts_b} experts (shape {tuple(b.shape)}), expected {num_experts} like starts/ends")
    if k_b != k:
        raise ValueError(f"b: shape {tuple(b.shape)} contracts over {k_b}, expected K={k} of a {tuple(a.shape)}")
    out = _check_out(out, (rows, n), a.device)
    _check_multiple("K", k, 8, "16-byte rows for TMA")
    _check_multiple("N", n, 8, "16-byte rows for TMA")
    if layout == "nn":
        _check_multiple("K", k, _BLOCK_K, "an [E, K, N] weight is read in K blocks that must not cross experts")
    block_n = 256 if paired_n else _pick_block_n(n)
    if paired_n:
        _check_multiple("N", n, block_n, "paired N tiling pairs columns j and N/2 + j in 256-wide tiles")
    if rows == 0 or num_experts == 0 or n == 0:
        return out
    if k == 0:
        raise ValueError(f"a: shape {tuple(a.shape)}: K=0, expected a non-empty contraction")
    config = GemmConfig(layout, block_n, paired_n)
    with jit.device_guard(a):
        b_map = (jit.make_tma_2d(b, 64, 64, rows=num_experts * n, cols=k) if layout == "nt"
                 else jit.make_tma_2d(b, 64, 64, rows=num_experts * k, cols=n))
        num_n_blocks = n // block_n if paired_n else -(-n // block_n)
        _launch(config, a, b_map, jit.make_tma_2d(out, 64, 64), starts, ends, rows, n, k,
                -(-rows // _BLOCK_M) * num_n_blocks)
    return out


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                      out: torch.Tensor | None = None, *, paired_n: bool = False) -> torch.Tensor:
    """out [P, N] bf16 with ``out[r] = a[r] @ b[e].T`` for every pool row r of expert e.

    a [P, K] bf16 pool, b [E, N, K] bf16 (K-major weights, e.g. l1_weights [E, 2I, H]),
    starts/ends [E] int32 on the device. ``paired_n`` computes the same output through tiles that
    hold columns j and N/2 + j together (the tiling a SwiGLU epilogue needs; N % 256 == 0).
    """
    return _m_grouped("nt", a, b, starts, ends, out, paired_n)


def m_grouped_bf16_gemm_nn_contiguous(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out [P, N] bf16 with ``out[r] = a[r] @ b[e]`` for every pool row r of expert e.

    a [P, K] bf16 pool, b [E, K, N] bf16 (MN-major, e.g. l2_weights [E, H, I] for da' = dy @ W2[e]),
    K a multiple of 64.
    """
    return _m_grouped("nn", a, b, starts, ends, out, False)


def k_grouped_bf16_gemm_tn_contiguous(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                      out: torch.Tensor | None = None) -> torch.Tensor:
    """out [E, M, N] bf16 with ``out[e] = a[s:t].T @ b[s:t]`` over expert e's pool rows [s, t).

    a [P, M], b [P, N] bf16 pools (e.g. dh and x for dW1 [E, 2I, H]), M a multiple of 128. Experts
    without rows get zeros.
    """
    num_experts = _check_inputs(a, b, 2, starts, ends)
    rows, m = a.shape
    if b.shape[0] != rows:
        raise ValueError(f"b: shape {tuple(b.shape)}, expected {rows} pool rows like a {tuple(a.shape)}")
    n = b.shape[1]
    out = _check_out(out, (num_experts, m, n), a.device)
    _check_multiple("M", m, _BLOCK_M, "output tiles of 128 rows must not cross experts")
    _check_multiple("N", n, 8, "16-byte rows for TMA")
    if num_experts == 0 or m == 0 or n == 0:
        return out
    if rows == 0:
        return out.zero_()
    block_n = _pick_block_n(n)
    config = GemmConfig("tn", block_n)
    with jit.device_guard(a):
        _launch(config, a, jit.make_tma_2d(b, 64, 64), jit.make_tma_2d(out, 64, 64, rows=num_experts * m, cols=n),
                starts, ends, m, n, rows, num_experts * (m // _BLOCK_M) * -(-n // block_n))
    return out
