"""Routing metadata: which pool row holds which (token, slot), per expert, block-aligned.

The pool is the dispatched copy of ``x`` in expert order. Expert ``e`` owns the rows
``[starts[e], ends[e])``; its ``counts[e]`` real rows come first (ordered by slot index
``t * K + k``, so the layout is deterministic), then padding up to a multiple of ``align``.
The pool has a static size (``pool_rows``) that depends on shapes only, so nothing here needs
the host to read device values: no synchronisation, CUDA-graph safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Rows per expert block of our Hopper kernels (the M tile). Export it so no caller hard-codes 128.
TOKEN_GROUP_ALIGNMENT = 128


def pool_rows(num_slots: int, num_experts: int, align: int) -> int:
    """Upper bound on the aligned pool size: every expert may waste ``align - 1`` rows."""
    return num_slots + num_experts * (align - 1)


@dataclass
class RoutingMeta:
    """Per-call routing metadata, all on the device of ``topk_idx``.

    counts      [E]   int32  real rows per expert
    starts      [E]   int32  first pool row of each expert (multiple of ``align``)
    ends        [E]   int32  ``starts + round_up(counts, align)``; ``torch._grouped_mm``'s offs
    slot_to_row [T*K] int32  pool row of slot ``t*K+k``, -1 for unused slots (id -1)
    row_to_slot [P]   int32  slot of each pool row, -1 for padding rows

    ``extras`` holds values a provider derives from the routing once per call (not saved).
    """

    counts: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    slot_to_row: torch.Tensor
    row_to_slot: torch.Tensor
    num_experts: int
    top_k: int
    align: int
    extras: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_pool_rows(self) -> int:
        return self.row_to_slot.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.counts, self.starts, self.ends, self.slot_to_row, self.row_to_slot)

    @classmethod
    def from_tensors(cls, tensors, num_experts: int, top_k: int, align: int) -> "RoutingMeta":
        return cls(*tensors, num_experts=num_experts, top_k=top_k, align=align)


def compute_routing_torch(topk_idx: torch.Tensor, num_experts: int, align: int) -> RoutingMeta:
    """Routing metadata with torch ops only (any device, no host sync).

    Ids outside ``[-1, num_experts)`` must have been rejected by validation; as a second line of
    defence they are treated as unused slots here, so no later index can go out of bounds.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int64,
                                                                                               torch.int32):
        what = (f"shape {tuple(topk_idx.shape)} and dtype {topk_idx.dtype}" if isinstance(topk_idx, torch.Tensor)
                else type(topk_idx).__name__)
        raise TypeError(f"topk_idx: expected a 2-D int64 or int32 tensor [num_tokens, top_k], got {what}")
    for name, value in (("num_experts", num_experts), ("align", align)):
        # Python ints checked by value; traced and symbolic sizes (torch.compile's) pass as they are.
        if value is None or isinstance(value, (bool, float, str)):
            raise TypeError(f"{name}={value!r}: expected a positive int")
        if type(value) is int and value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive int")
    num_tokens, top_k = topk_idx.shape
    device = topk_idx.device
    num_slots = num_tokens * top_k
    num_rows = pool_rows(num_slots, num_experts, align)
    ids = topk_idx.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    # Unused slots go to a sentinel bucket E that sorts last and owns no pool rows.
    bucket = torch.where(valid, ids, torch.full_like(ids, num_experts))

    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts_all.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts_all[:num_experts]
    padded = (counts + (align - 1)) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    dense_starts = torch.cumsum(counts_all, 0) - counts_all  # unaligned start of each bucket

    sorted_bucket, order = torch.sort(bucket, stable=True)
    rank = torch.arange(num_slots, device=device, dtype=torch.int64)
    starts_ext = torch.cat([starts, starts.new_zeros(1)])
    row_of_sorted = starts_ext[sorted_bucket] + rank - dense_starts[sorted_bucket]
    row_of_sorted = torch.where(sorted_bucket < num_experts, row_of_sorted, torch.full_like(rank, -1))

    slot_to_row = torch.empty(num_slots, dtype=torch.int64, device=device)
    slot_to_row.scatter_(0, order, row_of_sorted)
    # Unused slots scatter into a dump row at index num_rows, sliced off afterwards.
    row_to_slot = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    dest = torch.where(row_of_sorted >= 0, row_of_sorted, torch.full_like(rank, num_rows))
    row_to_slot.scatter_(0, dest, order)
    row_to_slot = row_to_slot[:num_rows]
    return RoutingMeta(
        counts=counts.to(torch.int32),
        starts=starts.to(torch.int32),
        ends=ends.to(torch.int32),
        slot_to_row=slot_to_row.to(torch.int32),
        row_to_slot=row_to_slot.to(torch.int32),
        num_experts=num_experts,
        top_k=top_k,
        align=align,
    )
