"""Grouped bf16 GEMMs on the block-aligned expert pool (kernels/impls/sm90_bf16_grouped_gemm.cuh), SM90.

Layout letters follow DeepGEMM: the first says how A is given, the second how B is given, ``n`` for
the operand's natural layout (A [M, K], B [K, N]) and ``t`` for its transpose (A [K, M], B [N, K]).

    m_grouped_bf16_gemm_nt_contiguous(a [P, K], b [E, N, K])   out[r] = a[r] @ b[e].T   forward
    m_grouped_bf16_gemm_nn_contiguous(a [P, K], b [E, K, N])   out[r] = a[r] @ b[e]     dgrad
    k_grouped_bf16_gemm_tn_contiguous(a [P, M], b [P, N])      out[e] = a_e.T @ b_e     wgrad

With ``scatter=Scatter(row_to_slot, T*K, weights or row_weights)`` the M-grouped GEMMs write each pool row into its
token's top-k slot of a [T*K, N] output instead (kernels/epilogue/sm90_scatter_slots.cuh):
the combine epilogue of the L2 forward (weighted) and the L1 dgrad, reduced by combine_slots.

Expert ``e`` owns pool rows ``[starts[e], ends[e])``; both are multiples of ``GROUP_ALIGNMENT`` (the
routing of ``deep_gemm_ext.routing`` produces such pools) and padding rows of the pool are zero.
M-grouped GEMMs leave output rows that no expert owns unwritten; the K-grouped GEMM writes zeros
for experts without rows. ``starts``/``ends`` stay on the device: nothing here synchronises.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _env, jit
from ..jit import KernelArg
from ..routing import TOKEN_GROUP_ALIGNMENT
from .gather_combine import take_or_zero

#: Rows per expert block the kernel assumes (its BLOCK_M): starts/ends must be multiples of it.
GROUP_ALIGNMENT = TOKEN_GROUP_ALIGNMENT
_BLOCK_M = 128
_BLOCK_K = 64
#: Bytes of one operand row in a stage (the 128-byte swizzle span): TMA boxes are 64 rows of it.
STAGE_ROW_BYTES = 128
_THREADS = 384
#: M blocks per scheduler group of the M-grouped GEMMs (GemmConfig.group_m): the persistent grid walks
#: the tiles of group_m pool blocks across all N blocks before the next group, so the CTAs resident at
#: one time share A blocks and expert weights in L2 (kernels/scheduler/sm90_grouped.cuh).
GROUP_M_DEFAULT = 16
GROUP_M_CHOICES = (1, 2, 4, 8, 16, 32)
assert GROUP_ALIGNMENT % _BLOCK_M == 0

_TYPES = {"nt": ("MGroupedContiguous", "K", "K"), "nn": ("MGroupedContiguous", "K", "MN"),
          "tn": ("KGroupedContiguous", "MN", "MN"),
          # fp8 only: the K-grouped GEMM on the transposed pools At [M, P], Bt [N, P] (e4m3 wgmma reads K-major).
          "k_nt": ("KGroupedContiguous", "K", "K")}


class Tile(NamedTuple):
    """A candidate N tile width and the smem ring depth that fits it."""
    block_n: int
    stages: int


#: Candidates in order of preference. Measured on H200 (tests/cuda harness): 128 x 256 tiles with 4
#: stages beat 128 x 128 with 6 stages on every MoE shape; 128-wide tiles only pay off where they pad
#: N less.
TILES = (Tile(256, 4), Tile(128, 6))
#: The tile widths the bf16 kernel takes (GemmTraits' static_asserts), and their stages.
_WIDTHS = (256, 128)
_STAGES = {256: 4, 128: 6}

#: The core kernel's arguments before the epilogue's (kernels/impls/sm90_bf16_grouped_gemm.cuh).
CORE_ARGS = (
    KernelArg("starts", "const int*"), KernelArg("ends", "const int*"), KernelArg("num_experts", "uint32_t"),
    KernelArg("shape_m", "uint32_t"), KernelArg("shape_n", "uint32_t"), KernelArg("shape_k", "uint32_t"),
    KernelArg("gather_row_to_slot", "const int*"), KernelArg("gather_top_k", "uint32_t"),
    KernelArg("gather_x", "const __nv_bfloat16*", nullable=True), KernelArg("gather_x_rows", "uint32_t"),
    KernelArg("tma_a", "CUtensorMap"), KernelArg("tma_b", "CUtensorMap"),
)


class Epilogue(NamedTuple):
    """An epilogue policy of the core: its C++ class, its header and its kernel arguments."""
    cpp: str
    header: str
    args: tuple[KernelArg, ...]


_SCATTER_ARGS = (KernelArg("out", "__nv_bfloat16*"), KernelArg("row_to_slot", "const int*"),
                 KernelArg("weights", "const float*", nullable=True), KernelArg("num_rows", "uint32_t"),
                 KernelArg("num_slots", "uint32_t"), KernelArg("out_cols", "uint32_t"))
_EPILOGUES = {
    "store": Epilogue("dge::gemm::EpilogueStoreBF16", "epilogue/sm90_store_bf16.cuh",
                      (KernelArg("tma_c", "CUtensorMap"),)),
    # Combine epilogues: pool rows into their top-k slots of a [T*K, N] output (times the slot's weight;
    # the unweighted one never reads `weights`).
    "scatter": Epilogue("dge::gemm::EpilogueScatterSlots<false>", "epilogue/sm90_scatter_slots.cuh", _SCATTER_ARGS),
    "scatter_weighted": Epilogue("dge::gemm::EpilogueScatterSlots<true>", "epilogue/sm90_scatter_slots.cuh",
                                 _SCATTER_ARGS),
}

#: The store epilogue of the 192-wide fp8 tile: its three 64 x 64 chunks per slice staged in three buffers.
_STAGED_STORE_CPP = "dge::gemm::EpilogueStoreBF16Buffers<3>"


#: Loader policies (kernels/loader/sm90_gemm_loaders.cuh) by gathering prologue: None (A is a pool) or
#: "cp_async" (the producer warpgroup gathers A's rows with cp.async instructions that each read whole
#: 32-byte sectors; the L1 forward's A, layout "nt" only: the backward's GEMMs read pools gathered
#: once, which measured faster than GEMMs that gather, docs/perf-notes.md v39-v40).
_LOADERS = {None: "dge::gemm::LoaderTma", "cp_async": "dge::gemm::LoaderGatherCpAsync"}
GATHER_MODES = ("cp_async",)
#: The cp.async gather that waits for rows still arriving from the expert-parallel dispatch
#: (GemmConfig.await_rows; DGE_EP_OVERLAP), and the kernel arguments it reads after the core's.
_AWAIT_LOADER = "dge::gemm::LoaderGatherCpAsyncAwait"
AWAIT_ARGS = (KernelArg("await_arrivals", "const long long*"), KernelArg("await_epoch", "const long long*"),
              KernelArg("await_capacity", "uint32_t"), KernelArg("await_timeout_ns", "unsigned long long"),
              KernelArg("await_rank", "int"), KernelArg("await_report", "unsigned long long"),
              KernelArg("await_m_order", "const int*"))
#: What the waiting loader takes: the L1 forward's layout and gather, bf16, no clusters.
_AWAIT_RULES = dict(layout="nt", gather_a="cp_async", dtype="bf16", cluster_n=1)
#: What groups within experts take (GemmConfig.expert_groups): no clusters (whose pairs of M blocks
#: may straddle two experts), no awaited rows (which walk the M blocks in their arrival order).
_EXPERT_GROUP_RULES = dict(cluster_n=1, await_rows=False)


class Mainloop(NamedTuple):
    """A mainloop policy of the core by operand type: GemmTraits' ElementType, its C++ class, its
    header and the kernel arguments it reads (after the core's, before the epilogue's)."""
    element: str
    cpp: str
    header: str
    args: tuple[KernelArg, ...]


MAINLOOPS = {
    "bf16": Mainloop("BF16", "dge::gemm::MainloopBF16", "mma/sm90_mainloop.cuh", ()),
    # Blockwise fp8 (recipes/fp8.py): e4m3 A [P, K] and B [E, N, K], both K-major, with fp32 scales
    # [P, ceil(K/128)] and [E, ceil(N/128), ceil(K/128)].
    "fp8": Mainloop("E4M3", "dge::gemm::MainloopFP8", "mma/sm90_mainloop_fp8.cuh",
                    (KernelArg("scale_a", "const float*"), KernelArg("scale_b", "const float*"))),
}
#: What the fp8 mainloop takes (GemmTraits' static_assert): NT layout, the plain TMA loader; its default
#: N tile (and the K-grouped GEMM's only one):
_FP8_BLOCK_N = 128
#: N tiles of the M-grouped fp8 GEMM: 128, or 192 (serial mainloop only: 96 + 96 accumulator registers,
#: a tile straddling two 128-column weight-scale blocks).
FP8_BLOCK_NS = (128, 192)
#: Schedules of the fp8 mainloop (MainloopFP8's kOverlapPromotion), each with its C++ policy: "serial"
#: waits for a k-block's wgmmas before promoting its partial sums; "overlap" alternates two partial
#: sets, issuing k-block kb + 1 before promoting kb. Same bits under both.
FP8_MAINLOOPS = {"serial": "dge::gemm::MainloopFP8", "overlap": "dge::gemm::MainloopFP8Overlap"}
#: Stages of the fp8 GEMMs per N tile: each stage also holds its scales (MainloopFP8::kStageScaleBytes:
#: 528 bytes M-grouped, 1 KiB K-grouped), so the 128-wide tile takes 5 x 32 KiB (6 with them and the
#: epilogue's 32 KiB exceed 227 KiB), the 192-wide one 4 x 40 KiB.
_FP8_STAGES = {128: 5, 192: 4}
#: Ring depths of the fp8 GEMMs with K compiled in (GemmConfig.shape_k), most preferred first: the
#: k-block count must be a multiple of the depth (every tile then starts at stage 0). Not 3: the
#: 3-deep ring of K = 768 (6 k-blocks) measured 0.97x of the 5-deep K-argument kernel, where 4 deep
#: gave 1.01-1.10x (docs/perf-notes.md v25). The 192-wide tile fits 4 stages only.
FP8_STATIC_K_STAGES = (5, 4)
_FP8_STATIC_K_STAGES = {128: FP8_STATIC_K_STAGES, 192: (4,)}
#: At most this many k-blocks with K compiled in, per N tile: the 128-wide tile's overlap loop is
#: unrolled over the whole tile, which grows with K (~1800 instructions at 16 k-blocks, ~6500 at 56; K
#: up to 2048 is what was measured, docs/perf-notes.md v25); the 192-wide tile's serial loop is unrolled
#: over one turn of the ring whatever K is (v26).
FP8_STATIC_K_MAX_BLOCKS = {128: 16, 192: 64}
#: Where no ring depth divides the k-blocks, the 192-wide tile's serial loop still takes K compiled in up
#: to this many k-blocks: a tile then starts at one of depth / gcd(k-blocks, depth) stages, and the loop is
#: unrolled over the whole tile once per start (GemmTraits::kRingStep; Qwen3-30B's K = 768, 6 k-blocks,
#: two starts).
FP8_STATIC_K_UNROLLED_BLOCKS = {192: 16}


def fp8_static_k_stages(shape_k: int, block_n: int = _FP8_BLOCK_N) -> int | None:
    """The ring depth of the fp8 M-grouped GEMM with K = shape_k compiled in, or None where no depth of
    FP8_STATIC_K_STAGES (of the 192-wide tile: 4) divides its ceil(K / 128) k-blocks or they are more
    than FP8_STATIC_K_MAX_BLOCKS of the tile; the 192-wide tile takes its 4 stages also where no depth
    divides up to FP8_STATIC_K_UNROLLED_BLOCKS k-blocks."""
    k_blocks = -(-shape_k // 128)
    if not 0 < k_blocks <= FP8_STATIC_K_MAX_BLOCKS.get(block_n, 0):
        return None
    depths = _FP8_STATIC_K_STAGES.get(block_n, ())
    divides = next((s for s in depths if k_blocks % s == 0), None)
    if divides is None and k_blocks <= FP8_STATIC_K_UNROLLED_BLOCKS.get(block_n, 0):
        return depths[0]
    return divides
#: CTAs per cluster (GemmConfig.cluster_n). A cluster of 2 takes two adjacent M blocks of one N
#: block and multicasts their shared B tile; same bits as 1. What it takes: the plain TMA loader and
#: unpaired tiles.
CLUSTER_SIZES = (1, 2)
_CLUSTER_RULES = dict(gather_a=None, paired_n=False)


@dataclass(frozen=True)
class GemmConfig:
    """One instantiation of the core: layout, N tile, epilogue and loader (stages follow block_n)."""
    layout: str         # "nt", "nn", "tn", or "k_nt" (fp8 K-grouped on transposed pools)
    block_n: int
    paired_n: bool = False
    epilogue: str = "store"
    gather_a: str | None = None  # gathering prologue ("cp_async", layout "nt"): A rows come from x via row_to_slot
    dtype: str = "bf16"  # operand type, a key of MAINLOOPS: "bf16" or "fp8" (blockwise-scaled e4m3)
    fp8_mainloop: str = "serial"  # dtype "fp8" only: the fp8 mainloop's schedule, a key of FP8_MAINLOOPS
    # CTAs per cluster (CLUSTER_SIZES): 2 pairs adjacent M blocks of one N block, which share the B
    # tile by TMA multicast (kernels/scheduler/sm90_grouped.cuh); plain TMA loader and unpaired tiles
    # only.
    cluster_n: int = 1
    # The cp.async gather of A waits, tile by tile, for the source ranks of its rows to have
    # arrived (LoaderGatherCpAsyncAwait: the L1 forward overlapped with the expert-parallel
    # dispatch, DGE_EP_OVERLAP); its kernel arguments are AWAIT_ARGS.
    await_rows: bool = False
    # K compiled into the kernel (M-grouped fp8 only; 0: K is a kernel argument): the mainloop's trip
    # count is a constant, and the ring is as deep as the largest of FP8_STATIC_K_STAGES that divides
    # the k-block count, so every tile starts at stage 0 (GemmTraits::kStaticRing), or, for the 192-wide
    # tile with at most FP8_STATIC_K_UNROLLED_BLOCKS k-blocks that no depth divides, 4 deep with the tile
    # unrolled once per start stage (GemmTraits::kRingStep). fp8_static_k_stages() says which K can be.
    shape_k: int = 0
    # M blocks per scheduler group (GROUP_M_CHOICES; M-grouped layouts only, K-grouped tiles are walked
    # expert by expert).
    group_m: int = GROUP_M_DEFAULT
    # The scheduler's groups stay within one expert (M-grouped, no clusters, no awaited rows): each
    # expert's blocks are cut into groups of group_m from its first block (kernels/scheduler/sm90_grouped.cuh).
    expert_groups: bool = False

    def __post_init__(self):
        widths = FP8_BLOCK_NS if (self.dtype == "fp8" and self.layout == "nt") else _WIDTHS
        if self.block_n not in widths:
            raise ValueError(f"GemmConfig: block_n={self.block_n}, expected one of {widths}")
        if self.dtype not in MAINLOOPS:
            raise ValueError(f"GemmConfig: dtype={self.dtype!r}, expected one of {tuple(MAINLOOPS)}")
        if self.layout not in _TYPES:
            raise ValueError(f"GemmConfig: layout={self.layout!r}, expected one of {tuple(_TYPES)}")
        if self.epilogue not in _EPILOGUES:
            raise ValueError(f"GemmConfig: epilogue={self.epilogue!r}, expected one of {tuple(_EPILOGUES)}")
        if self.dtype == "fp8" and self.layout == "k_nt":
            # The K-grouped fp8 GEMM: plain store of the [E, M, N] output, 128-wide tiles (its 32
            # per-column scales a thread beside two 64-register partial sets), either mainloop.
            fp8 = dict(block_n=_FP8_BLOCK_N, paired_n=False, gather_a=None, epilogue="store")
            wrong = {k: getattr(self, k) for k, v in fp8.items() if getattr(self, k) != v}
            if wrong:
                raise ValueError(f"GemmConfig: dtype='fp8' with layout='k_nt' takes {fp8}, got {wrong}")
        elif self.dtype == "fp8":
            fp8 = dict(layout="nt", paired_n=False, gather_a=None)
            wrong = {k: getattr(self, k) for k, v in fp8.items() if getattr(self, k) != v}
            if self.block_n != _FP8_BLOCK_N and self.fp8_mainloop != "serial":
                wrong["fp8_mainloop"] = self.fp8_mainloop  # two partial sets of a 192-wide slice do not fit
            if wrong:
                raise ValueError(f"GemmConfig: dtype='fp8' takes {fp8}, got {wrong}")
        elif self.layout == "k_nt":
            raise ValueError(f"GemmConfig: layout='k_nt' with dtype={self.dtype!r}, expected dtype='fp8' (bf16 "
                             f"K-grouped GEMMs read the pools as they are: layout 'tn')")
        if self.fp8_mainloop not in FP8_MAINLOOPS:
            raise ValueError(f"GemmConfig: fp8_mainloop={self.fp8_mainloop!r}, expected one of {tuple(FP8_MAINLOOPS)}")
        if self.dtype != "fp8" and self.fp8_mainloop != "serial":
            raise ValueError(f"GemmConfig: fp8_mainloop={self.fp8_mainloop!r} with dtype={self.dtype!r}, expected "
                             f"dtype='fp8' (the bf16 mainloop has one schedule)")
        if isinstance(self.cluster_n, bool) or self.cluster_n not in CLUSTER_SIZES:
            raise ValueError(f"GemmConfig: cluster_n={self.cluster_n!r}, expected one of {CLUSTER_SIZES}")
        if self.cluster_n > 1:
            wrong = {k: getattr(self, k) for k, v in _CLUSTER_RULES.items() if getattr(self, k) != v}
            if wrong:
                raise ValueError(f"GemmConfig: cluster_n={self.cluster_n} takes {_CLUSTER_RULES}, got {wrong}")
        if self.gather_a not in _LOADERS:
            raise ValueError(f"GemmConfig: gather_a={self.gather_a!r}, expected one of {tuple(_LOADERS)}")
        if not isinstance(self.await_rows, bool):
            raise ValueError(f"GemmConfig: await_rows={self.await_rows!r}, expected a bool")
        if self.await_rows:
            wrong = {k: getattr(self, k) for k, v in _AWAIT_RULES.items() if getattr(self, k) != v}
            if wrong:
                raise ValueError(f"GemmConfig: await_rows=True takes {_AWAIT_RULES}, got {wrong}")
        if self.gather_a and self.layout != "nt":
            raise ValueError(f"GemmConfig: gather_a={self.gather_a!r} with layout={self.layout!r}, expected layout='nt' "
                             f"(the L1 forward's A; the backward's GEMMs read pools)")
        if isinstance(self.group_m, bool) or self.group_m not in GROUP_M_CHOICES:
            raise ValueError(f"GemmConfig: group_m={self.group_m!r}, expected one of {GROUP_M_CHOICES}")
        if self.group_m != GROUP_M_DEFAULT and _TYPES[self.layout][0] != "MGroupedContiguous":
            raise ValueError(f"GemmConfig: group_m={self.group_m} with layout={self.layout!r}, expected "
                             f"{GROUP_M_DEFAULT} (K-grouped tiles are walked expert by expert)")
        if not isinstance(self.expert_groups, bool):
            raise ValueError(f"GemmConfig: expert_groups={self.expert_groups!r}, expected a bool")
        if self.expert_groups:
            wrong = {k: getattr(self, k) for k, v in _EXPERT_GROUP_RULES.items() if getattr(self, k) != v}
            if _TYPES[self.layout][0] != "MGroupedContiguous":
                wrong["layout"] = self.layout
            if wrong:
                raise ValueError(f"GemmConfig: expert_groups=True takes an M-grouped layout and "
                                 f"{_EXPERT_GROUP_RULES}, got {wrong}")
        if isinstance(self.shape_k, bool) or not isinstance(self.shape_k, int) or self.shape_k < 0:
            raise ValueError(f"GemmConfig: shape_k={self.shape_k!r}, expected a non-negative int (0: K at run time)")
        if self.shape_k:
            if self.dtype != "fp8" or self.layout != "nt":
                raise ValueError(f"GemmConfig: shape_k={self.shape_k} with dtype={self.dtype!r}, "
                                 f"layout={self.layout!r}: K is compiled into the M-grouped fp8 GEMMs only")
            if fp8_static_k_stages(self.shape_k, self.block_n) is None:
                raise ValueError(f"GemmConfig: shape_k={self.shape_k}: its {-(-self.shape_k // 128)} k-blocks are a "
                                 f"multiple of none of the ring depths {_FP8_STATIC_K_STAGES[self.block_n]} of "
                                 f"block_n={self.block_n}, or more than "
                                 f"{FP8_STATIC_K_MAX_BLOCKS.get(self.block_n)}"
                                 + (f" (and more than {FP8_STATIC_K_UNROLLED_BLOCKS[self.block_n]}, the most it "
                                    f"unrolls where no depth divides them)"
                                    if self.block_n in FP8_STATIC_K_UNROLLED_BLOCKS else ""))

    @property
    def stages(self) -> int:
        if self.shape_k:
            return fp8_static_k_stages(self.shape_k, self.block_n)
        if self.dtype == "fp8":
            return _FP8_STAGES[self.block_n]
        return _STAGES[self.block_n]

    @property
    def name(self) -> str:
        name = f"sm90_{self.dtype}_grouped_gemm_{self.layout}_n{self.block_n}_s{self.stages}"
        if self.paired_n:
            name += "_paired"
        if self.epilogue != "store":
            name += f"_{self.epilogue}"
        if self.gather_a:
            name += "_gather_cpasync"
        if self.fp8_mainloop != "serial":
            name += f"_{self.fp8_mainloop}"
        if self.cluster_n > 1:
            name += f"_c{self.cluster_n}"
        if self.await_rows:
            name += "_await"
        if self.shape_k:
            name += f"_k{self.shape_k}"
        if self.group_m != GROUP_M_DEFAULT:
            name += f"_g{self.group_m}"
        if self.expert_groups:
            name += "_eg"
        return name

    @property
    def args(self) -> tuple[KernelArg, ...]:
        """The kernel's arguments: the core's, the loader's (AWAIT_ARGS with await_rows), the
        mainloop's, then the epilogue's."""
        return CORE_ARGS + self.loader_args + MAINLOOPS[self.dtype].args + _EPILOGUES[self.epilogue].args

    @property
    def loader_args(self) -> tuple[KernelArg, ...]:
        return AWAIT_ARGS if self.await_rows else ()

    def code(self) -> str:
        gemm_type, major_a, major_b = _TYPES[self.layout]
        epilogue = _EPILOGUES[self.epilogue]
        epilogue_cpp = epilogue.cpp
        if self.block_n == 192 and self.epilogue == "store":
            # The 192-wide fp8 tile's three chunks per slice all staged before their TMA stores: with
            # two buffers the third would wait inside the tile for the first one's store.
            epilogue_cpp = _STAGED_STORE_CPP
        loader = _AWAIT_LOADER if self.await_rows else _LOADERS[self.gather_a]
        mainloop = MAINLOOPS[self.dtype]
        mainloop_cpp = FP8_MAINLOOPS[self.fp8_mainloop] if self.dtype == "fp8" else mainloop.cpp
        if self.dtype == "bf16":  # the bf16 sources predate the element type: their text is unchanged
            includes = f"#include <{epilogue.header}>\n"
            extra = smem_extra = ""
        else:
            includes = f"#include <{epilogue.header}>\n#include <{mainloop.header}>\n"
            extra = f", dge::gemm::ElementType::{mainloop.element}"
            if self.shape_k or self.expert_groups:
                extra += f", {self.shape_k}"
            # The mainloop's own smem (the fp8 M-grouped mainloop's staged scales).
            smem_extra = f", {mainloop_cpp}<Traits, false>::kSmemBytes"
        if self.expert_groups:
            if not extra:
                extra = f", dge::gemm::ElementType::{mainloop.element}, 0"
            extra += ", true"
        return (includes +
                "#include <impls/sm90_bf16_grouped_gemm.cuh>\n"
                f"using Traits = dge::gemm::GemmTraits<dge::sched::GroupedGemmType::{gemm_type}, "
                f"dge::mma::Major::{major_a}, dge::mma::Major::{major_b},\n"
                f"    {self.block_n}, {self.stages}, {self.cluster_n}, {'true' if self.paired_n else 'false'}, {self.group_m}"
                f"{extra}>;\n"
                f"using Epilogue = {epilogue_cpp};\n"
                "DGE_EXPORT_SMEM_BYTES((dge::gemm::SmemLayout<Traits::BLOCK_N, Traits::kNumStages, Epilogue"
                f"{smem_extra}>::kTotalBytes))\n"
                "static void* __instantiate = reinterpret_cast<void*>(&dge::gemm::sm90_grouped_gemm_kernel<\n"
                f"    Traits, {loader}, {mainloop_cpp}, Epilogue, "
                f"{jit.render_types(self.loader_args + mainloop.args + epilogue.args)}>);\n")

    def kernel(self) -> jit.Kernel:
        """The built kernel (a configuration's name and source are rendered once per process)."""
        kernel = _CONFIG_KERNELS.get(self)
        if kernel is None:
            kernel = _CONFIG_KERNELS[self] = jit.build(self.name, self.code())
        return kernel

    def launch_args(self) -> tuple[KernelArg, ...]:
        """``args``, computed once per configuration (the launch packs them every call)."""
        args = _CONFIG_ARGS.get(self)
        if args is None:
            args = _CONFIG_ARGS[self] = self.args
        return args

    def smem_bytes(self) -> int:
        """Dynamic smem of the launch, as the kernel source computes it (SmemLayout::kTotalBytes,
        exported into the cubin): the layout arithmetic lives in C++ only."""
        smem = self.kernel().dynamic_smem
        if smem is None:
            raise RuntimeError(f"{self.name}: the cubin exports no {jit.SMEM_SYMBOL}")
        return smem


#: GemmConfig -> its kernel / its argument declarations (configurations are frozen and hashable).
_CONFIG_KERNELS: dict = {}
_CONFIG_ARGS: dict = {}

#: GemmConfig(...) of the launchers, one instance per argument list: its checks run once, not per launch.
cached_config = functools.lru_cache(maxsize=1024)(GemmConfig)


def _check_cluster(cluster_n, *, gather=None, paired_n: bool = False) -> None:
    """``cluster_n=`` of a launcher: one of CLUSTER_SIZES, and 2 only where GemmConfig takes it."""
    if isinstance(cluster_n, bool) or cluster_n not in CLUSTER_SIZES:
        raise ValueError(f"cluster_n={cluster_n!r}: expected one of {CLUSTER_SIZES}")
    if cluster_n == 1:
        return
    for label, value, plain in (("gather", gather, None), ("paired_n", paired_n, False)):
        if value != plain:
            raise ValueError(f"cluster_n={cluster_n} with {label}={value!r}: clusters take the plain TMA loader "
                             f"and unpaired tiles (expected {label}={plain!r})")


def _check_walk(group_m, expert_groups=None, *, cluster_n: int = 1, awaits: bool = False) -> None:
    """``group_m=`` / ``expert_groups=`` of an M-grouped launcher: None (select_walk), one of
    GROUP_M_CHOICES / a bool; groups within experts not with clusters or awaited rows."""
    if group_m is not None and (isinstance(group_m, bool) or group_m not in GROUP_M_CHOICES):
        raise ValueError(f"group_m={group_m!r}: expected None or one of {GROUP_M_CHOICES}")
    if expert_groups is not None and not isinstance(expert_groups, bool):
        raise ValueError(f"expert_groups={expert_groups!r}: expected None or a bool")
    conflict = _expert_groups_conflict(cluster_n, awaits)
    if expert_groups and conflict:
        raise ValueError(f"expert_groups=True with {conflict}")


def _expert_groups_conflict(cluster_n: int, awaits: bool) -> str | None:
    """Why a launch cannot take groups within experts (_EXPERT_GROUP_RULES), None where it can."""
    if cluster_n != _EXPERT_GROUP_RULES["cluster_n"]:
        return (f"cluster_n={cluster_n}: a cluster's pair of M blocks may straddle two experts "
                f"(expected cluster_n=1)")
    if awaits != _EXPERT_GROUP_RULES["await_rows"]:
        return "gather.await_rows: awaited rows walk the M blocks in their arrival order"
    return None


#: Groups within experts where the pool holds at most this many 128-row blocks per expert on average ...
EXPERT_GROUPS_MAX_BLOCKS = 6
#: ... and one expert's weight matrix of the GEMM is at least this many bytes.
EXPERT_GROUPS_MIN_WEIGHT_BYTES = 8 << 20


def select_walk(rows: int, num_experts: int, expert_weight_bytes: int) -> tuple[int, bool]:
    """The scheduler's walk of the M-grouped GEMMs for a pool of ``rows`` rows over ``num_experts``
    experts whose weight matrices are ``expert_weight_bytes`` each (all known on the host, no
    synchronisation): (group_m, expert_groups). Groups of 16 M blocks; within experts where experts own
    few blocks and their weights are large: there fixed groups split most experts, and the two groups
    that share an expert sweep its weights far apart in time, so they come from DRAM twice
    (docs/perf-notes.md v46). Where an expert's weights are a few MB they stay in the L2 between the
    two, and fixed groups measured as fast or faster."""
    few = rows <= EXPERT_GROUPS_MAX_BLOCKS * _BLOCK_M * max(num_experts, 1)
    return GROUP_M_DEFAULT, few and expert_weight_bytes >= EXPERT_GROUPS_MIN_WEIGHT_BYTES


def walk_tiles(starts, ends, n_blocks: int, group_m: int, expert_groups: bool,
               block_m: int = _BLOCK_M) -> list[tuple[int, int, int]]:
    """The (M block, N block, expert) tiles the M-grouped scheduler (clusters of 1, no M order) hands out
    for units 0, 1, ..., in that order: the arithmetic of GroupedScheduler::next on the host, for a pool
    whose expert ``e`` owns the rows [starts[e], ends[e]) (Python ints, ends non-decreasing). Blocks no
    expert owns are skipped as the kernel skips them."""
    starts, ends = [int(s) for s in starts], [int(t) for t in ends]
    num_m = -(-ends[-1] // block_m) if ends else 0
    owner = [None] * num_m
    for e in range(len(starts) - 1, -1, -1):  # the first expert whose range holds the block's first row
        for m in range(-(-starts[e] // block_m), min(-(-ends[e] // block_m), num_m)):
            owner[m] = e
    tiles = []
    for unit in range(num_m * n_blocks):
        if expert_groups:
            block = unit // n_blocks
            e = owner[block]
            if e is None:
                continue
            first, last = -(-starts[e] // block_m), -(-ends[e] // block_m)
            group_first = first + (block - first) // group_m * group_m
            rows = min(group_m, last - group_first)
            in_group = unit - group_first * n_blocks
            m, n = group_first + in_group % rows, in_group // rows
        else:
            group, in_group = divmod(unit, group_m * n_blocks)
            rows = min(group_m, num_m - group * group_m)
            m, n = group * group_m + in_group % rows, in_group // rows
            e = owner[m]
            if e is None:
                continue
        tiles.append((m, n, e))
    return tiles


def resolve_walk(group_m, expert_groups, rows: int, num_experts: int, expert_weight_bytes: int, *,
                 cluster_n: int = 1, awaits: bool = False) -> tuple[int, bool]:
    """The launcher's ``group_m`` / ``expert_groups`` where given, select_walk's where None (groups within
    experts only where the launch takes them)."""
    chosen_m, chosen_e = select_walk(rows, num_experts, expert_weight_bytes)
    if group_m is None:
        group_m = chosen_m
    if expert_groups is None:
        expert_groups = chosen_e and _expert_groups_conflict(cluster_n, awaits) is None
    return group_m, expert_groups


def select_tile(n: int, *, divides: bool = False) -> Tile:
    """The candidate tile for N columns: the one that pads N least, ties going to the earlier
    (preferred) candidate. ``divides``: only tiles whose width divides N."""
    candidates = [t for t in TILES if not divides or n % t.block_n == 0]
    if not candidates:
        raise ValueError(f"N={n}: no tile of {[t.block_n for t in TILES]} divides it")
    return min(candidates, key=lambda t: -(-n // t.block_n) * t.block_n)


def _all_configs() -> list[GemmConfig]:
    configs = [GemmConfig(layout, block_n) for layout in ("nt", "nn", "tn") for block_n in (256, 128)]
    configs.append(GemmConfig("nt", 256, paired_n=True))
    configs += [GemmConfig("nt", block_n, gather_a=mode) for block_n in (256, 128) for mode in GATHER_MODES]
    # The combine epilogues of the layer: the L2 forward (weighted) and the L1 dgrad (unweighted).
    configs += [GemmConfig("nt", block_n, epilogue="scatter_weighted") for block_n in (256, 128)]
    configs += [GemmConfig("nn", block_n, epilogue="scatter") for block_n in (256, 128)]
    # The L1 forward overlapped with the expert-parallel dispatch (DGE_EP_OVERLAP): the waiting
    # cp.async gather.
    configs += [GemmConfig("nt", block_n, gather_a="cp_async", await_rows=True) for block_n in (256, 128)]
    # Clusters of 2 (cluster_n=2): the 256-wide store GEMMs of every layout and the combine epilogues.
    clusters = [GemmConfig(layout, 256, cluster_n=2) for layout in ("nt", "nn", "tn")]
    clusters += [GemmConfig("nt", 256, epilogue="scatter_weighted", cluster_n=2),
                 GemmConfig("nn", 256, epilogue="scatter", cluster_n=2)]
    # Groups within experts (select_walk: few blocks per expert, large expert weights): the layer's four
    # M-grouped GEMMs and the plain store of each layout.
    within = [GemmConfig(layout, block_n, gather_a=gather, epilogue=epilogue, expert_groups=True)
              for block_n in (256, 128)
              for layout, gather, epilogue in (("nt", None, "store"), ("nt", "cp_async", "store"),
                                               ("nt", None, "scatter_weighted"), ("nn", None, "store"),
                                               ("nn", None, "scatter"))]
    return configs + clusters + within


@jit.register("sm90_bf16_grouped_gemm")
def configs():
    return [(c.name, c.code(), True) for c in _all_configs()]


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


def _check_inputs(a, b, b_dim: int, starts, ends, *, names: tuple[str, str] = ("a", "b"),
                  extra: tuple = (), dtype: torch.dtype = torch.bfloat16) -> int:
    """dtype/shape checks first, then devices: all on one CUDA device. Returns E.

    ``names``: how the messages call a and b; ``extra``: more (label, tensor, dim, dtype) operands;
    ``dtype``: a's and b's."""
    a_name, b_name = names
    _check_tensor(a_name, a, 2, dtype)
    _check_tensor(b_name, b, b_dim, dtype)
    for label, tensor, dim, dtype in extra:
        _check_tensor(label, tensor, dim, dtype)
    _check_tensor("starts", starts, 1, torch.int32)
    _check_tensor("ends", ends, 1, torch.int32)
    if starts.shape != ends.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and ends {tuple(ends.shape)}: expected the same shape [E]")
    if not a.is_cuda:
        raise ValueError(f"{a_name}: on {a.device}, expected a CUDA tensor")
    for label, t in ((b_name, b), *((label, t) for label, t, _, _ in extra), ("starts", starts), ("ends", ends)):
        if t.device != a.device:
            raise ValueError(f"{label}: on {t.device}, expected {a.device} like {a_name}")
    return starts.shape[0]


def _check_multiple(label: str, value: int, multiple: int, why: str) -> None:
    if value % multiple:
        raise ValueError(f"{label}={value}: expected a multiple of {multiple} ({why})")


def _check_expert_weight(label: str, w: torch.Tensor, experts_w: int, k_w: int, num_experts: int, k: int,
                         k_name: str, a_label: str, a: torch.Tensor) -> None:
    """An expert weight [E, ., .] holds one matrix per expert of starts/ends and contracts over a's K."""
    if experts_w != num_experts:
        raise ValueError(f"{label}: {experts_w} experts (shape {tuple(w.shape)}), expected {num_experts} like "
                         f"starts/ends")
    if k_w != k:
        raise ValueError(f"{label}: shape {tuple(w.shape)} contracts over {k_w}, expected {k_name}={k} of {a_label} "
                         f"{tuple(a.shape)}")


def _check_out(out, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    _check_tensor("out", out, len(shape), torch.bfloat16)
    if tuple(out.shape) != shape:
        raise ValueError(f"out: shape {tuple(out.shape)}, expected {shape}")
    if out.device != device:
        raise ValueError(f"out: on {out.device}, expected {device} like the inputs")
    return out


# Checks passed, by what they read of their arguments (:func:`checks_key`): a launcher called again with
# arguments of the same types, shapes, dtypes, devices and contiguity skips them (addresses still checked
# where they matter: alignment, the TMA maps' storage).
_CHECKED: dict = {}
_CHECKED_MAX = 1024


def _tensor_key(t):
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.is_contiguous())


def checks_key(*items):
    """A hashable key of ``items`` (tensors, None, Gather / Scatter without awaited rows, plain values) by
    everything a launcher's checks read of them but addresses and data, or None where one is something
    else (the checks then run, and raise)."""
    parts = []
    for item in items:
        if item is None or isinstance(item, torch.Tensor):
            parts.append(_tensor_key(item))
        elif type(item) is Scatter:
            weights, row_weights = item.weights, item.row_weights
            if not isinstance(item.row_to_slot, torch.Tensor) or not all(
                    w is None or isinstance(w, torch.Tensor) for w in (weights, row_weights)):
                return None
            parts.append(("scatter", _tensor_key(item.row_to_slot), type(item.num_slots), item.num_slots,
                          _tensor_key(weights), _tensor_key(row_weights)))
        elif type(item) is Gather:
            if item.await_rows is not None or not isinstance(item.row_to_slot, torch.Tensor):
                return None
            parts.append(("gather", _tensor_key(item.row_to_slot), type(item.top_k), item.top_k, item.mode))
        elif isinstance(item, (Gather, Scatter, tuple, list, dict, set)):
            return None
        else:
            parts.append((type(item), item))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def checked(key, check):
    """``check()``'s result, from the cache when its key passed before (``key`` None: always run)."""
    if key is None:
        return check()
    hit = _CHECKED.get(key)
    if hit is None:
        hit = check()
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = hit
    return hit


# -- launch -----------------------------------------------------------------------------------------------


class AwaitRows(NamedTuple):
    """Rows of the gathered x that are still arriving (the expert-parallel dispatch overlapped with
    the L1 forward, DGE_EP_OVERLAP): x is x_r [W * capacity, K], row j from source rank
    j // capacity, whose block is complete once ``arrivals[s] >= epoch`` (both int64 on x's device:
    ``arrivals [W]``, ``epoch [1]`` a view of this rank's epoch in its exchange region, read on the
    device). The GEMM's loader waits for that per tile (LoaderGatherCpAsyncAwait), at most
    ``timeout_ns``; then it writes (1, rank, source, awaited epoch, seen) into ``report`` (int64
    [5], pinned host memory, readable after the trap) and traps. ``max_ctas`` caps the persistent
    grid, so that the kernel writing the rows always has SMs (comm.symmetric)."""
    arrivals: torch.Tensor
    epoch: torch.Tensor
    capacity: int
    rank: int
    timeout_ns: int
    max_ctas: int
    report: torch.Tensor


class Gather(NamedTuple):
    """The gathering prologue of an M-grouped GEMM: ``a`` is the token matrix x [T, K] and pool row
    r reads ``x[row_to_slot[r] // top_k]``, a zero row where ``row_to_slot[r] < 0`` (padding).
    ``row_to_slot`` [P] int32 is the routing's map (deep_gemm_ext.routing.RoutingMeta.row_to_slot);
    P is the pool's row count; a slot past the tokens also reads a zero row. ``mode``: the loader,
    "cp_async" (the producer warpgroup copies rows with 16-byte cp.async, each instruction reading
    whole 32-byte sectors), the one there is.
    ``await_rows`` (:class:`AwaitRows`, the "nt" M-grouped GEMMs): x's rows are
    still arriving and the loader waits for them."""
    row_to_slot: torch.Tensor
    top_k: int
    mode: str = "cp_async"
    await_rows: AwaitRows | None = None


class Scatter(NamedTuple):
    """The combine epilogue of an M-grouped GEMM: pool row r of the output is written to row
    ``row_to_slot[r]`` (its token's top-k slot t*K + k) of a slot-ordered [num_slots, N] output,
    times its slot's weight in fp32 before the one rounding to bf16 when weights are given. Padding
    rows (row_to_slot < 0) and slots past num_slots are not stored, so the output rows of unused slots
    keep their contents (combine_slots skips them).

    The weights come in one of two orders (at most one of the two fields): ``weights`` ([T, K] or
    [num_slots] fp32) in slot order, or ``row_weights`` ([P] fp32, one per pool row) in pool order,
    ``row_weights[r] = weights.reshape(-1)[row_to_slot[r]]`` (any value on rows that are not stored).
    The kernel reads pool order, loading a row's weight before the tile's mainloop; slot-order weights
    are put in that order first by one more launch (take_or_zero), the same bits."""
    row_to_slot: torch.Tensor
    num_slots: int
    weights: torch.Tensor | None = None
    row_weights: torch.Tensor | None = None

    @property
    def weighted(self) -> bool:
        return self.weights is not None or self.row_weights is not None


def _check_scatter(scatter: Scatter | None, rows: int, device: torch.device) -> None:
    if scatter is None:
        return
    if not isinstance(scatter, Scatter):
        raise TypeError(f"scatter: expected jit_kernels.Scatter(row_to_slot, num_slots, weights), got "
                        f"{type(scatter).__name__}")
    _check_tensor("scatter.row_to_slot", scatter.row_to_slot, 1, torch.int32)
    if scatter.row_to_slot.shape[0] != rows:
        raise ValueError(f"scatter.row_to_slot: shape {tuple(scatter.row_to_slot.shape)}, expected ({rows},) (one "
                         f"slot per pool row)")
    if scatter.row_to_slot.device != device:
        raise ValueError(f"scatter.row_to_slot: on {scatter.row_to_slot.device}, expected {device}")
    if isinstance(scatter.num_slots, bool) or not isinstance(scatter.num_slots, int) or scatter.num_slots < 0:
        raise ValueError(f"scatter.num_slots={scatter.num_slots!r}: expected a non-negative int")
    if scatter.weights is not None and scatter.row_weights is not None:
        raise ValueError("scatter: weights and row_weights both given, expected at most one (the same weights in "
                         "slot order or in pool order)")
    for label, w, count, what in (("weights", scatter.weights, scatter.num_slots, f"num_slots={scatter.num_slots}"),
                                  ("row_weights", scatter.row_weights, rows, f"one per pool row, {rows}")):
        if w is None:
            continue
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.numel() != count:
            raise ValueError(f"scatter.{label}: expected a float32 tensor of {what} elements, "
                             f"got {w.dtype if isinstance(w, torch.Tensor) else type(w).__name__} "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else ''}")
        if label == "row_weights" and (w.dim() != 1 or not w.is_contiguous()):
            raise ValueError(f"scatter.row_weights: shape {tuple(w.shape)}, strides {w.stride()}, expected a "
                             f"contiguous ({rows},) tensor")
        if w.device != device:
            raise ValueError(f"scatter.{label}: on {w.device}, expected {device}")


def _check_gather(gather: Gather | None) -> None:
    """Type, dtype and shape of a gather (before the operands' device checks)."""
    if gather is None:
        return
    if not isinstance(gather, Gather):
        raise TypeError(f"gather: expected jit_kernels.Gather(row_to_slot, top_k), got {type(gather).__name__}")
    _check_tensor("gather.row_to_slot", gather.row_to_slot, 1, torch.int32)
    if not isinstance(gather.top_k, int) or gather.top_k < 1:
        raise ValueError(f"gather.top_k={gather.top_k!r}: expected a positive int")
    if gather.mode not in GATHER_MODES:
        raise ValueError(f"gather.mode={gather.mode!r}: expected one of {GATHER_MODES}")
    if len(gather) > 3 and gather.await_rows is not None:
        _check_await(gather)


def _check_await(gather: Gather) -> None:
    w = gather.await_rows
    if not isinstance(w, AwaitRows):
        raise TypeError(f"gather.await_rows: expected jit_kernels.AwaitRows, got {type(w).__name__}")
    for label, t in (("arrivals", w.arrivals), ("epoch", w.epoch)):
        _check_tensor(f"gather.await_rows.{label}", t, 1, torch.int64)
    if w.epoch.shape[0] != 1:
        raise ValueError(f"gather.await_rows.epoch: shape {tuple(w.epoch.shape)}, expected (1,)")
    for label, value, low in (("capacity", w.capacity, 1), ("rank", w.rank, 0), ("timeout_ns", w.timeout_ns, 1),
                              ("max_ctas", w.max_ctas, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"gather.await_rows.{label}={value!r}: expected an int >= {low}")
    r = w.report
    if not isinstance(r, torch.Tensor) or r.dtype != torch.int64 or tuple(r.shape) != (5,) or not r.is_pinned():
        raise ValueError(f"gather.await_rows.report: expected a pinned int64 CPU tensor of shape (5,), got "
                         f"{r.dtype if isinstance(r, torch.Tensor) else type(r).__name__}")
    if w.rank >= w.arrivals.shape[0]:
        raise ValueError(f"gather.await_rows.rank={w.rank}: expected < W={w.arrivals.shape[0]} (arrivals' length)")


def arrival_block_order(row_to_slot: torch.Tensor, top_k: int, wait: AwaitRows, ends: torch.Tensor) -> torch.Tensor:
    """The pool's 128-row M blocks in the order their rows arrive (int32 [ceil(P / 128)], torch ops,
    no sync): a block's key is the latest arrival among the sources of its rows, source s arriving
    (s - rank) mod W-th (the row pull walks me, me + 1, ...); blocks with no row key 0, blocks past
    the last expert's end W, after all used ones. A stable sort keeps pool order (expert by expert)
    among the blocks of one key. The waiting GEMM's scheduler walks its tiles in this order."""
    world = wait.arrivals.shape[0]
    rows = row_to_slot.shape[0]
    num_blocks = -(-rows // _BLOCK_M)
    slots = torch.nn.functional.pad(row_to_slot.long(), (0, num_blocks * _BLOCK_M - rows), value=-1)
    slots = slots.view(num_blocks, _BLOCK_M)
    source = torch.div(slots, top_k * wait.capacity, rounding_mode="floor")
    key = torch.where(slots >= 0, torch.remainder(source - wait.rank, world), 0).amax(1)
    used = torch.div(ends[-1:].long() + _BLOCK_M - 1, _BLOCK_M, rounding_mode="floor")
    key = torch.where(torch.arange(num_blocks, device=key.device) < used, key, world)
    return torch.sort(key, stable=True).indices.to(torch.int32)


def _await_of(gather: Gather | None) -> AwaitRows | None:
    return gather.await_rows if gather is not None and len(gather) > 3 else None


def _check_await_source(gather: Gather | None, x: torch.Tensor) -> None:
    """The waiting loader reads x_r [W * capacity, K] in place, on the arrivals' device."""
    w = _await_of(gather)
    if w is None:
        return
    world = w.arrivals.shape[0]
    if x.shape[0] != world * w.capacity:
        raise ValueError(f"x: shape {tuple(x.shape)} with gather.await_rows: expected W * capacity = {world} * "
                         f"{w.capacity} = {world * w.capacity} rows (the dispatched x_r)")
    for label, t in (("arrivals", w.arrivals), ("epoch", w.epoch)):
        if t.device != x.device:
            raise ValueError(f"gather.await_rows.{label}: on {t.device}, expected {x.device} like x")
    if x.data_ptr() % 16 or x.shape[1] % 8 or not x.is_contiguous():
        raise ValueError(f"x: data_ptr() % 16 = {x.data_ptr() % 16}, {x.shape[1]} columns, strides {x.stride()}: "
                         f"the waiting gather reads the arriving rows in place (no copy can be made), expected a "
                         f"contiguous 16-byte aligned tensor with a multiple of 8 columns")


def _pool_rows(gather: Gather | None, a: torch.Tensor) -> int:
    """The pool's row count: a's rows, or row_to_slot's with a gather (checked to be on a's device)."""
    if gather is None:
        return a.shape[0]
    if gather.row_to_slot.device != a.device:
        raise ValueError(f"gather.row_to_slot: on {gather.row_to_slot.device}, expected {a.device} like x")
    return gather.row_to_slot.shape[0]


def _launch(config: GemmConfig, a: torch.Tensor, b_map: jit.TensorMap, epi_args: dict, starts, ends,
            shape_m: int, shape_n: int, shape_k: int, max_tiles: int, gather: Gather | None = None,
            mainloop_args: dict | None = None) -> None:
    """``epi_args`` / ``mainloop_args``: the epilogue's / the mainloop's kernel arguments by name
    (config.args declares them). With ``gather``, ``a`` is the token matrix whose rows are gathered."""
    kernel = config.kernel()
    a_map = jit.make_tma_2d(a, 64, STAGE_ROW_BYTES // a.element_size())
    smem = config.smem_bytes()
    cluster = None
    wait = _await_of(gather)
    if config.cluster_n == 1:
        # Waiting for rows (await_rows): the grid leaves SMs to the kernel that writes them.
        cap = jit.num_sms(a.device) if wait is None else min(jit.num_sms(a.device), wait.max_ctas)
        grid = (max(1, min(cap, max_tiles)), 1, 1)
    else:
        # Whole clusters only, no more than the device holds at once (a persistent grid past that
        # would run its last clusters after the first ones), and no more than the tiles need.
        cluster = (config.cluster_n, 1, 1)
        resident = kernel.max_active_clusters(cluster, (_THREADS, 1, 1), smem)
        if resident < 1:
            raise RuntimeError(f"{config.name}: the device holds no cluster of {config.cluster_n} CTAs with "
                               f"{smem} bytes of shared memory each")
        clusters = min(jit.num_sms(a.device) // config.cluster_n, resident, -(-max_tiles // config.cluster_n))
        grid = (max(1, clusters) * config.cluster_n, 1, 1)
    if gather is not None:
        gather_args = dict(gather_row_to_slot=gather.row_to_slot, gather_top_k=gather.top_k, gather_x=a,
                           gather_x_rows=a.shape[0])
    else:  # placeholders: LoaderTma reads none of them
        gather_args = dict(gather_row_to_slot=starts, gather_top_k=1, gather_x=None, gather_x_rows=0)
    if config.await_rows:
        if wait is None:
            raise ValueError(f"{config.name}: the waiting loader needs gather.await_rows")
        gather_args.update(await_arrivals=wait.arrivals, await_epoch=wait.epoch, await_capacity=wait.capacity,
                           await_timeout_ns=wait.timeout_ns, await_rank=wait.rank, await_report=wait.report.data_ptr(),
                           await_m_order=arrival_block_order(gather.row_to_slot, gather.top_k, wait, ends))
    if _env.print_configs():
        print(f"[deep_gemm_ext] {config.name}: M={shape_m} N={shape_n} K={shape_k} block_n={config.block_n} "
              f"stages={config.stages} grid={grid[0]} cluster={config.cluster_n} tiles<={max_tiles} smem={smem}",
              file=sys.stderr, flush=True)
    layout, payload = jit.pack_bytes(kernel.name, config.launch_args(), starts=starts, ends=ends,
                                     num_experts=starts.shape[0], shape_m=shape_m, shape_n=shape_n, shape_k=shape_k,
                                     **gather_args, tma_a=a_map, tma_b=b_map, **(mainloop_args or {}), **epi_args)
    kernel.launch_bytes(grid, (_THREADS, 1, 1), layout, payload, smem=smem, cluster=cluster)


def _gather_source(x: torch.Tensor, gather: Gather | None):
    """The token matrix the L1 forward's gather reads (``x`` unchanged without a gather). An empty one is
    replaced by one zero row, since every pool row then reads zeros anyway; cp.async copies 16-byte
    chunks, so the rows need 16-byte alignment."""
    if gather is None:
        return x
    if x.shape[0] == 0:
        x = x.new_zeros(1, x.shape[1])
    if x.data_ptr() % 16 or x.shape[-1] % 8:
        raise ValueError(f"a: data_ptr() % 16 = {x.data_ptr() % 16}, {x.shape[-1]} columns: expected a "
                         f"16-byte aligned tensor with a multiple of 8 columns for the cp.async gather")
    return x


def _store_or_scatter_args(out: torch.Tensor, scatter: Scatter | None, rows: int, n: int) -> dict:
    """The kernel arguments of the store epilogue (a TMA map of ``out``) or of the slot-scatter one."""
    if scatter is None:
        return dict(tma_c=jit.make_tma_2d(out, 64, 64))
    if out.data_ptr() % 16:  # an address: checked on every call, not by the checks' key
        raise ValueError(f"out: starts at address {out.data_ptr():#x}, not 16-byte aligned; expected an aligned "
                         f"tensor (the slot-scatter epilogue stores 16-byte vectors)")
    weights = scatter.row_weights
    if weights is None and scatter.weights is not None:
        weights = take_or_zero(scatter.weights.reshape(-1).contiguous(), scatter.row_to_slot)
    return dict(out=out, row_to_slot=scatter.row_to_slot, weights=weights, num_rows=rows,
                num_slots=scatter.num_slots, out_cols=n)


def _m_grouped(layout: str, a, b, starts, ends, out, paired_n: bool, gather: Gather | None = None,
               scatter: Scatter | None = None, cluster_n: int = 1, group_m: int | None = None,
               expert_groups: bool | None = None) -> torch.Tensor:
    key = checks_key("m", layout, a, b, starts, ends, out, paired_n, gather, scatter, cluster_n, group_m,
                     expert_groups)
    num_experts, k, rows, n, block_n, config = checked(key, lambda: _m_grouped_checks(
        layout, a, b, starts, ends, out, paired_n, gather, scatter, cluster_n, group_m, expert_groups))
    if out is None:
        out = torch.empty((rows if scatter is None else scatter.num_slots, n), dtype=torch.bfloat16, device=a.device)
    if config is None:  # nothing to compute
        return out
    _check_await_source(gather, a)
    a = _gather_source(a, gather)
    with jit.device_guard(a):
        b_map = (jit.make_tma_2d(b, 64, 64, rows=num_experts * n, cols=k) if layout == "nt"
                 else jit.make_tma_2d(b, 64, 64, rows=num_experts * k, cols=n))
        num_n_blocks = n // block_n if paired_n else -(-n // block_n)
        epi_args = _store_or_scatter_args(out, scatter, rows, n)
        _launch(config, a, b_map, epi_args, starts, ends, rows, n, k, -(-rows // _BLOCK_M) * num_n_blocks, gather)
    return out


def _m_grouped_checks(layout, a, b, starts, ends, out, paired_n, gather, scatter, cluster_n, group_m=None,
                      expert_groups=None):
    """Every check of :func:`_m_grouped` that its key settles; ``(E, K, rows, N, block_n, config)``,
    config None when there is nothing to compute."""
    _check_gather(gather)
    _check_cluster(cluster_n, gather=gather, paired_n=paired_n)
    awaits = _await_of(gather) is not None
    _check_walk(group_m, expert_groups, cluster_n=cluster_n, awaits=awaits)
    if scatter is not None and paired_n:
        raise ValueError("scatter with paired_n=True: the combine epilogue stores plain (unpaired) N tiles")
    num_experts = _check_inputs(a, b, 3, starts, ends)
    k = a.shape[1]
    rows = _pool_rows(gather, a)
    if layout == "nt":
        experts_b, n, k_b = b.shape
    else:
        experts_b, k_b, n = b.shape
    _check_expert_weight("b", b, experts_b, k_b, num_experts, k, "K", "a", a)
    _check_scatter(scatter, rows, a.device)
    if out is not None:
        _check_out(out, (rows if scatter is None else scatter.num_slots, n), a.device)
    _check_multiple("K", k, 8, "16-byte rows for TMA")
    _check_multiple("N", n, 8, "16-byte rows for TMA")
    if layout == "nn":
        _check_multiple("K", k, _BLOCK_K, "an [E, K, N] weight is read in K blocks that must not cross experts")
    if paired_n:
        _check_multiple("N", n, 256, "paired N tiling pairs columns j and N/2 + j in 256-wide tiles")
    block_n = select_tile(n, divides=paired_n).block_n
    if rows == 0 or num_experts == 0 or n == 0:
        return num_experts, k, rows, n, block_n, None
    if k == 0:
        raise ValueError(f"a: shape {tuple(a.shape)}: K=0, expected a non-empty contraction")
    epilogue = "store" if scatter is None else "scatter_weighted" if scatter.weighted else "scatter"
    group_m, expert_groups = resolve_walk(group_m, expert_groups, rows, num_experts, n * k * b.element_size(),
                                          cluster_n=cluster_n, awaits=awaits)
    config = cached_config(layout, block_n, paired_n, epilogue=epilogue,
                           gather_a=gather.mode if gather is not None else None, cluster_n=cluster_n,
                           await_rows=awaits, group_m=group_m, expert_groups=expert_groups)
    return num_experts, k, rows, n, block_n, config


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                      out: torch.Tensor | None = None, *, paired_n: bool = False,
                                      gather: Gather | None = None, scatter: Scatter | None = None,
                                      cluster_n: int = 1, group_m: int | None = None,
                                      expert_groups: bool | None = None) -> torch.Tensor:
    """out [P, N] bf16 with ``out[r] = a[r] @ b[e].T`` for every pool row r of expert e.

    a [P, K] bf16 pool, b [E, N, K] bf16 (K-major weights, e.g. l1_weights [E, 2I, H]),
    starts/ends [E] int32 on the device. ``paired_n`` computes the same output through tiles that
    hold columns j and N/2 + j together (N % 256 == 0).
    ``gather``: a is x [T, K] and the GEMM reads pool row r from ``x[row_to_slot[r] // top_k]``
    (bit-identical to gathering the pool first). ``scatter``: out is [num_slots, N] in slot order and
    row r of the product goes to out[row_to_slot[r]] (weighted when scatter has weights); see
    Scatter. ``cluster_n``: CTAs per cluster (CLUSTER_SIZES; 2 shares B tiles between adjacent M blocks
    by multicast, without gather or paired_n), same bits under each. ``group_m``: M blocks per
    scheduler group (GROUP_M_CHOICES), ``expert_groups``: groups that stay within one expert (cluster_n=1,
    no awaited rows); None: select_walk's; the same bits under each.
    """
    return _m_grouped("nt", a, b, starts, ends, out, paired_n, gather, scatter, cluster_n, group_m, expert_groups)


def m_grouped_bf16_gemm_nn_contiguous(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                      out: torch.Tensor | None = None, *, scatter: Scatter | None = None,
                                      cluster_n: int = 1, group_m: int | None = None,
                                      expert_groups: bool | None = None) -> torch.Tensor:
    """out [P, N] bf16 with ``out[r] = a[r] @ b[e]`` for every pool row r of expert e.

    a [P, K] bf16 pool, b [E, K, N] bf16 (MN-major, e.g. l2_weights [E, H, I] for da' = dy @ W2[e]),
    K a multiple of 64. ``scatter``: out is [num_slots, N] in slot order (e.g. dx's top-k rows for
    combine_slots). ``cluster_n``, ``group_m``, ``expert_groups``: as for m_grouped_bf16_gemm_nt_contiguous.
    """
    return _m_grouped("nn", a, b, starts, ends, out, False, None, scatter, cluster_n, group_m, expert_groups)


def k_grouped_bf16_gemm_tn_contiguous(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                      out: torch.Tensor | None = None, *, cluster_n: int = 1) -> torch.Tensor:
    """out [E, M, N] bf16 with ``out[e] = a[s:t].T @ b[s:t]`` over expert e's pool rows [s, t).

    a [P, M], b [P, N] bf16 pools (e.g. dh and x's pool for dW1 [E, 2I, H]), M a multiple of 128.
    Experts without rows get zeros. ``cluster_n``: CTAs per cluster (CLUSTER_SIZES; 2 pairs adjacent M
    blocks of one expert, sharing B).
    """
    key = checks_key("k", a, b, starts, ends, out, cluster_n)
    num_experts, rows, m, n, block_n, config = checked(key, lambda: _k_grouped_checks(
        a, b, starts, ends, out, cluster_n))
    if out is None:
        out = torch.empty((num_experts, m, n), dtype=torch.bfloat16, device=a.device)
    if num_experts == 0 or m == 0 or n == 0:
        return out
    if rows == 0:
        return out.zero_()
    with jit.device_guard(a):
        _launch(config, a, jit.make_tma_2d(b, 64, 64), dict(tma_c=jit.make_tma_2d(out, 64, 64, rows=num_experts * m,
                                                                                  cols=n)),
                starts, ends, m, n, rows, num_experts * (m // _BLOCK_M) * -(-n // block_n))
    return out


def _k_grouped_checks(a, b, starts, ends, out, cluster_n):
    """Every check of :func:`k_grouped_bf16_gemm_tn_contiguous` that its key settles;
    ``(E, rows, M, N, block_n, config)``, config None when there is nothing to compute."""
    _check_cluster(cluster_n)
    num_experts = _check_inputs(a, b, 2, starts, ends)
    rows = a.shape[0]
    if b.shape[0] != rows:
        raise ValueError(f"b: shape {tuple(b.shape)}, expected {rows} pool rows like a {tuple(a.shape)}")
    m = a.shape[1]
    n = b.shape[1]
    if out is not None:
        _check_out(out, (num_experts, m, n), a.device)
    _check_multiple("M", m, _BLOCK_M, "output tiles of 128 rows must not cross experts")
    _check_multiple("N", n, 8, "16-byte rows for TMA")
    if num_experts == 0 or m == 0 or n == 0 or rows == 0:
        return num_experts, rows, m, n, 0, None
    block_n = select_tile(n).block_n
    config = cached_config("tn", block_n, cluster_n=cluster_n)
    return num_experts, rows, m, n, block_n, config
