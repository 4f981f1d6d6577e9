"""Routing metadata on the GPU (kernels/impls/moe_routing.cuh): bit-identical to compute_routing_torch."""
from __future__ import annotations

import ctypes

import torch

from .. import jit
from ..routing import RoutingMeta, pool_rows

_INCLUDE = "#include <impls/moe_routing.cuh>\n"
_INDEX_CTYPES = {torch.int32: "int", torch.int64: "long long"}
_THREADS = 256
_WARPS = _THREADS // 32
_SCAN_WARPS = 8
# Slots per CTA: small enough to spread over the GPU, a multiple of 256 so each warp owns whole
# 32-slot steps; grows past the minimum only to keep the per-chunk histogram table bounded.
_MIN_CHUNK = 2048
_MAX_CHUNKS = 1024
MAX_EXPERTS = 4096


def _histogram_code(index_type: str) -> str:
    return _INCLUDE + (f"template __global__ void dge::moe_routing_histogram_kernel<{index_type}>"
                       f"(const {index_type}*, int, int, int, int*, int);\n")


def _scan_code() -> str:
    return _INCLUDE + f"template __global__ void dge::moe_routing_scan_kernel<{_SCAN_WARPS}>(int*, int, int, int*);\n"


def _scatter_code(index_type: str) -> str:
    return _INCLUDE + (f"template __global__ void dge::moe_routing_scatter_kernel<{index_type}>"
                       f"(const {index_type}*, int, int, int, int, int, const int*, const int*, int*, int*, int*, "
                       f"int*);\n")


def _cluster_code(index_type: str) -> str:
    return _INCLUDE + (f"template __global__ void dge::moe_routing_cluster_kernel<{index_type}>"
                       f"(const {index_type}*, int, int, int, int, int, int*, int*, int*, int*, int*, int);\n")


# (name, code) of each launch, rendered once: the warm path hashes no new strings.
_SCAN = ("moe_routing_scan", _scan_code())
_HISTOGRAM = {dtype: (f"moe_routing_histogram_{str(dtype)[6:]}", _histogram_code(c))
              for dtype, c in _INDEX_CTYPES.items()}
_SCATTER = {dtype: (f"moe_routing_scatter_{str(dtype)[6:]}", _scatter_code(c)) for dtype, c in _INDEX_CTYPES.items()}
_CLUSTER = {dtype: (f"moe_routing_cluster_{str(dtype)[6:]}", _cluster_code(c)) for dtype, c in _INDEX_CTYPES.items()}
# The one-launch kernel: one cluster of _CLUSTER_CTAS CTAs of _CLUSTER_THREADS threads (moe_routing.cuh), its
# shared memory (_CLUSTER_WARPS + 4) * E + _CLUSTER_WARPS ints. Up to CLUSTER_MAX_SLOTS slots (T * K) and
# CLUSTER_MAX_EXPERTS experts; past either the three launches spread the slots over more SMs.
_CLUSTER_CTAS = 8
_CLUSTER_THREADS = 1024
_CLUSTER_WARPS = _CLUSTER_THREADS // 32
CLUSTER_MAX_SLOTS = 1 << 17
CLUSTER_MAX_EXPERTS = 1024


@jit.register("moe_routing")
def configs():
    return [(name, code, False) for name, code in [_SCAN, *_HISTOGRAM.values(), *_SCATTER.values(),
                                                   *_CLUSTER.values()]]


def chunking(num_slots: int) -> tuple[int, int]:
    """(slots per CTA, number of CTAs) of the histogram and scatter launches."""
    chunk = max(_MIN_CHUNK, -(-num_slots // _MAX_CHUNKS))
    chunk = -(-chunk // _THREADS) * _THREADS
    return chunk, max(1, -(-num_slots // chunk))


#: Slots and pool rows stay below this: the kernels index both in int32, and a CTA's or a grid's stride
#: (at most 2^21 slots a chunk, 1024 x 256 rows a grid step) may step past the last one.
INDEX_LIMIT = 2**31 - 2**22


def check_index_range(num_slots: int, num_rows: int, what: str) -> None:
    if num_slots >= INDEX_LIMIT or num_rows >= INDEX_LIMIT:
        raise ValueError(f"{what}: {num_slots} slots and {num_rows} pool rows; the routing kernels take fewer than "
                         f"{INDEX_LIMIT} (2^31 - 2^22) of each (int32 indices with room for a stride past the end)")


_RESIDENT: dict = {}


def _cluster_resident(topk_idx: torch.Tensor, smem: int) -> bool:
    """Whether topk_idx's device holds a cluster of the one-launch kernel's CTAs at once (not where an
    SM-limited context leaves fewer than 8 SMs of one GPC); per device, dtype and shared memory size."""
    key = (topk_idx.get_device(), topk_idx.dtype, smem)
    hit = _RESIDENT.get(key)
    if hit is None:
        with jit.device_guard(topk_idx):
            hit = _RESIDENT[key] = jit.build(*_CLUSTER[topk_idx.dtype]).max_active_clusters(
                (_CLUSTER_CTAS, 1, 1), (_CLUSTER_THREADS, 1, 1), smem) >= 1
    return hit


def single_launch(num_slots: int, num_experts: int) -> bool:
    """Whether :func:`routing_metadata` takes the one-launch cluster kernel for this size."""
    return num_slots <= CLUSTER_MAX_SLOTS and num_experts <= CLUSTER_MAX_EXPERTS


def routing_metadata(topk_idx: torch.Tensor, num_experts: int, align: int, *,
                     assert_ids: bool = False, launches: int | None = None) -> RoutingMeta:
    """Counts, aligned starts/ends and both slot<->row maps of ``topk_idx [T, K]``; no host sync.
    Ids outside ``[0, num_experts)`` are unused slots; with ``assert_ids`` one outside ``[-1, num_experts)``
    also fails the routing kernel with a device-side assertion (the check the layer makes on a GPU).
    ``launches``: 1 (one cluster kernel; up to CLUSTER_MAX_SLOTS slots and CLUSTER_MAX_EXPERTS experts, on a
    device that holds a cluster of its 8 CTAs) or 3 (histogram, scan, scatter; any size); by default 1 where
    it applies. Both give the same bits."""
    if not isinstance(topk_idx, torch.Tensor) or not topk_idx.is_cuda:
        raise ValueError(f"topk_idx: expected a CUDA tensor, got "
                         f"{topk_idx.device if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected shape [T, K], got {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in _INDEX_CTYPES:
        raise TypeError(f"topk_idx: dtype {topk_idx.dtype}, expected torch.int32 or torch.int64")
    if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts!r}: expected an int in [1, {MAX_EXPERTS}]")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r}: expected a positive int")
    num_tokens, top_k = topk_idx.shape
    num_slots = num_tokens * top_k
    num_rows = pool_rows(num_slots, num_experts, align)
    check_index_range(num_slots, num_rows, f"topk_idx {tuple(topk_idx.shape)} with {num_experts} experts, "
                                           f"align {align}")
    if launches is not None and (isinstance(launches, bool) or launches not in (1, 3)):
        raise ValueError(f"launches={launches!r}: expected None, 1 or 3")
    smem = 4 * ((_CLUSTER_WARPS + 4) * num_experts + _CLUSTER_WARPS)
    fits = single_launch(num_slots, num_experts)
    if fits and launches != 3:
        fits = _cluster_resident(topk_idx, smem)
    if launches is None:
        launches = 1 if fits else 3
    elif launches == 1 and not fits:
        raise ValueError(f"launches=1: the one-launch kernel takes at most {CLUSTER_MAX_SLOTS} slots and "
                         f"{CLUSTER_MAX_EXPERTS} experts (here {num_slots} and {num_experts}) on a device that holds "
                         f"a cluster of {_CLUSTER_CTAS} of its CTAs; expected None or 3")

    device = topk_idx.device
    ids = topk_idx.contiguous()
    new = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
    counts, starts, ends = new(num_experts), new(num_experts), new(num_experts)
    slot_to_row, row_to_slot = new(num_slots), new(num_rows)
    i32 = ctypes.c_int32
    if launches == 1:
        per_cta = -(-num_slots // _CLUSTER_CTAS)
        chunk = max(_CLUSTER_THREADS, -(-per_cta // _CLUSTER_THREADS) * _CLUSTER_THREADS)
        with jit.device_guard(ids):
            jit.build(*_CLUSTER[ids.dtype]).launch(
                (_CLUSTER_CTAS, 1, 1), (_CLUSTER_THREADS, 1, 1),
                (ids, i32(num_slots), i32(num_experts), i32(align), i32(chunk), i32(num_rows), counts, starts, ends,
                 slot_to_row, row_to_slot, i32(1 if assert_ids else 0)),
                smem=smem, cluster=(_CLUSTER_CTAS, 1, 1))
        return RoutingMeta(counts=counts, starts=starts, ends=ends, slot_to_row=slot_to_row, row_to_slot=row_to_slot,
                           num_experts=num_experts, top_k=top_k, align=align)
    chunk, num_chunks = chunking(num_slots)
    chunk_counts = new(num_experts * num_chunks)
    with jit.device_guard(ids):
        jit.build(*_HISTOGRAM[ids.dtype]).launch(
            (num_chunks, 1, 1), (_THREADS, 1, 1),
            (ids, i32(num_slots), i32(num_experts), i32(chunk), chunk_counts, i32(1 if assert_ids else 0)),
            smem=4 * num_experts)
        jit.build(*_SCAN).launch(
            (-(-num_experts // _SCAN_WARPS), 1, 1), (_SCAN_WARPS * 32, 1, 1),
            (chunk_counts, i32(num_chunks), i32(num_experts), counts))
        jit.build(*_SCATTER[ids.dtype]).launch(
            (num_chunks, 1, 1), (_THREADS, 1, 1),
            (ids, i32(num_slots), i32(num_experts), i32(align), i32(chunk), i32(num_rows), chunk_counts, counts,
             starts, ends, slot_to_row, row_to_slot),
            smem=4 * ((_WARPS + 1) * num_experts + _WARPS))
    return RoutingMeta(counts=counts, starts=starts, ends=ends, slot_to_row=slot_to_row, row_to_slot=row_to_slot,
                       num_experts=num_experts, top_k=top_k, align=align)
