"""Expert-parallel token exchange over ``torch.distributed.all_to_all_single`` (NCCL on GPUs, gloo on CPU).

Rank ``r`` of a group of ``W`` owns the experts ``[r * E_loc, (r + 1) * E_loc)``. The exchange moves
tokens to the ranks that own their experts and results back; the layer runs its local experts in
between. Four pieces, none of which records autograd (the layer pairs them):

- ``dispatch(x, topk_idx, topk_weights) -> (x_r, idx_r, w_r, handle)``
- ``combine(y_r, handle) -> y``, and its adjoint ``combine_backward(dy, handle) -> dy_r``
- ``dispatch_backward(dx_r, dw_r, handle) -> (dx, d_topk_weights)``, the adjoint of dispatch

Layout: every rank sends a block of ``cap = max_tokens_per_rank`` rows to every rank, so
``R = W * cap`` rows arrive and block ``s`` holds source rank ``s``'s tokens. Token ``t`` of the
source sits at row ``t`` of its block when it has a slot on the destination; otherwise (and for
``t >= T``) the row is zero with every id -1. A token reaches a rank at most once, so no routing
can overflow ``cap``; and no shape depends on the routing, so nothing syncs with the host and the
exchange can be captured in a CUDA graph.

Sums over ranks (combine, dx) run in rank order in fp32 (fp64 for fp64 inputs) and round once:
the results are deterministic and do not depend on which ranks answered first.

Rows in fp8 (``fp8_rows``, the plan's choice under ``recipe="fp8"``): dispatch sends x's rows as
the recipe's e4m3 data with their 1x128 fp32 scales (``quantize_rows``; ``H + 4 * ceil(H / 128)``
bytes a row, about half of bf16's), one uint8 buffer, and the receiving rank dequantizes them into
x's dtype. This is the quantization point the L1 forward has anyway (x 1x128 along H): quantizing
the dequantized rows again gives back the same e4m3 data and the same scales, bit for bit (for
bf16, fp32 and fp64 x: the tile's largest element dequantizes to a value whose amax / 448 is the
original scale), so the L1 forward and everything after it compute what one process computes. For bf16 x
that holds under either scale rule, the true division amax / 448 of the CPU and the product with
fl32(1/448) that torch and our quantization kernels compute on CUDA tensors (recipes/fp8.py): the
re-quantized amax is the original one, and bf16's rounding of the dequantized values stays far
inside half an e4m3 step. For fp32 x on CUDA the product rule can give a re-quantized scale one
bit off the sender's (the data still equal); one division per tile everywhere would remove that.
The weight gradient dW1 reads the received rows, i.e. x after the 1x128 quantization (then its own
128x1 quantization under ``wgrad="fp8"``), where one process reads x itself. The backward's
exchanges (combine, dispatch_backward) stay in the gradients' dtype.

Waits are bounded by the process group's timeout (``timeout=`` of ``init_process_group`` /
``new_group``); with NCCL the watchdog aborts a collective that runs past it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..recipes.fp8 import FP8_DTYPE, dequantize_rows, num_blocks, quantize_rows
from .emulated import EmulatedGroup

# Shapes and dtypes every rank must agree on before the first exchange (equal-split all-to-all
# would otherwise mis-slice rows or hang). Dtypes travel as their index here.
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: Shape classes whose agreement check passed, with the group it passed on (names are reused).
_AGREED: dict[tuple, dist.ProcessGroup] = {}


def resolve_group(group):
    """The ``ProcessGroup`` behind ``group``: a ProcessGroup, or a 1-D DeviceMesh (its only
    dimension's group); an emulated rank's group (comm.emulated) as it is. ``None`` stays ``None``
    (all experts local)."""
    # Two isinstance checks: under torch.compile a ProcessGroup is a script object that dynamo
    # matches against ProcessGroup alone, not inside a tuple of types.
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, EmulatedGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group is a {group.ndim}-D DeviceMesh (shape {tuple(group.shape)}); expected a "
                             f"1-D mesh of the expert-parallel ranks (slice it, e.g. mesh['ep'])")
        return group.get_group()
    raise TypeError(f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got "
                    f"{type(group).__name__}")


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one row of an fp8 dispatch: ``hidden`` e4m3 values and ``ceil(hidden / 128)`` fp32 scales."""
    return hidden + 4 * num_blocks(hidden)


def ep_memory_bytes(world_size: int, max_tokens_per_rank: int, hidden: int, top_k: int,
                   dtype: torch.dtype = torch.bfloat16, weight_dtype: torch.dtype = torch.float32,
                   fp8_rows: bool = False) -> int:
    """Bytes one ``dispatch`` allocates: the send and receive copies of ``W * max_tokens_per_rank``
    token rows (``hidden`` elements of ``dtype``, or :func:`fp8_row_bytes` with ``fp8_rows``) and of
    their routing (``top_k`` int32 ids and ``top_k`` weights of ``weight_dtype``). The received rows
    ``x_r`` are the layer's input and live as long as it keeps them (in ``dtype`` also under
    ``fp8_rows``, which adds them to the count); each of ``combine``, ``combine_backward`` and
    ``dispatch_backward`` allocates at most as much again for the time of its call."""
    rows = world_size * max_tokens_per_rank
    route_bytes = top_k * (4 + weight_dtype.itemsize)
    if fp8_rows:
        return rows * (2 * (fp8_row_bytes(hidden) + route_bytes) + hidden * dtype.itemsize)
    return 2 * rows * (hidden * dtype.itemsize + route_bytes)


def fp8_rows_of(x: torch.Tensor) -> torch.Tensor:
    """x's rows as dispatch sends them under ``fp8_rows``: uint8 ``[T, fp8_row_bytes(H)]``, the
    recipe's 1x128 e4m3 data then the fp32 scales' bytes."""
    data, scale = quantize_rows(x)
    return torch.cat([data.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def received_rows_of(rows: torch.Tensor, hidden: int, dtype: torch.dtype, fp8_rows: bool) -> torch.Tensor:
    """x_r from the rows that arrived: under ``fp8_rows`` (uint8 rows of :func:`fp8_rows_of`)
    dequantized into ``dtype`` (unsent rows, all zero bytes, give zeros); else the rows themselves."""
    if not fp8_rows:
        return rows
    data = rows[:, :hidden].contiguous().view(FP8_DTYPE)
    scale = rows[:, hidden:].contiguous().view(torch.float32)
    return dequantize_rows(data, scale).to(dtype)


def check_buffer_sizes(max_tokens_per_rank, hidden, top_k, dtype) -> None:
    """An EP buffer's shape class: positive ints and one of the exchanged dtypes."""
    for name, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if dtype not in _DTYPES:
        raise TypeError(f"dtype={dtype}; expected one of {_DTYPES}")


class EpBuffer:
    """Capacity of the all-to-all exchange for one (group, shape class): create it once, pass it on
    every call. ``max_tokens_per_rank`` is the most tokens any rank passes (the same on every rank);
    with it the exchange syncs with the host only at the first call of a shape class (the ranks'
    agreement check), so the layer can run under CUDA graphs and torch.compile.

    Without one, the layer finds the capacity itself with one all_gather of the ranks' token
    counts per call (a host sync), see :func:`default_ep_buffer`.

    The all-to-all transport holds no storage between calls: its send and receive rows come from
    torch's caching allocator on each call, :meth:`memory_bytes` of them per dispatch.
    """

    def __init__(self, group, max_tokens_per_rank: int, hidden: int, top_k: int,
                 dtype: torch.dtype = torch.bfloat16):
        self.group = resolve_group(group)
        if self.group is None:
            raise TypeError("group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None")
        if any(c in self.group.group_name for c in ";="):
            # The name travels inside the plan string (deep_gemm_ext.plan), whose separators these are.
            raise ValueError(f"group name {self.group.group_name!r} contains ';' or '='; expected a group made by "
                             f"torch.distributed.new_group or a DeviceMesh")
        check_buffer_sizes(max_tokens_per_rank, hidden, top_k, dtype)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.hidden = hidden
        self.top_k = top_k
        self.dtype = dtype

    @property
    def group_name(self) -> str:
        return self.group.group_name

    def exchange_spec(self, num_local_experts: int, fp8_rows: bool = False) -> str:
        """How a plan names the exchange over this buffer for ``num_local_experts`` experts a rank,
        sending x's rows in fp8 or in x's dtype."""
        rows = "fp8" if fp8_rows else "x"
        return f"all_to_all:{self.group_name}:{num_local_experts}:{self.max_tokens_per_rank}:{rows}"

    def memory_bytes(self, fp8_rows: bool = False) -> int:
        """Bytes one dispatch allocates (see :func:`ep_memory_bytes`; ``fp8_rows`` under recipe="fp8")."""
        weight_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        return ep_memory_bytes(self.group.size(), self.max_tokens_per_rank, self.hidden, self.top_k, self.dtype,
                              weight_dtype, fp8_rows)

    def __repr__(self) -> str:
        return (f"EpBuffer(group={self.group_name!r}, world_size={self.group.size()}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, hidden={self.hidden}, top_k={self.top_k}, "
                f"dtype={self.dtype})")


_DEFAULT_BUFFERS: dict[tuple, EpBuffer] = {}


def _raise_on_disagreement(table: list, names: tuple, decode: dict) -> None:
    """Every rank raises the same error where a column of the gathered ``table`` (a row per rank) differs."""
    for col, name in enumerate(names):
        values = [row[col] for row in table]
        if len(set(values)) > 1:
            values = [decode[name][v] for v in values] if name in decode else values
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"{name} differs across the expert-parallel group ({per_rank}); every rank "
                             f"must pass the same value")


_CALL_COLUMNS = ("num_local_experts", "hidden", "top_k", "dtype", "topk_weights dtype", "fp8_rows")


def default_ep_buffer(group, num_tokens: int, hidden: int, top_k: int, dtype: torch.dtype,
                      device: torch.device, *, num_local_experts: int | None = None,
                      weight_dtype: torch.dtype | None = None, fp8_rows: bool = False,
                      bad_ids: torch.Tensor | None = None, ids_error=None) -> EpBuffer:
    """The buffer the layer uses when the caller passes none: one per (group, hidden, top_k, dtype,
    device), its capacity the largest token count any rank has passed so far.

    Costs one all_gather of a few integers per rank and a host sync per call (every rank must call it,
    with its own ``num_tokens``); CUDA graphs and torch.compile need an explicit :class:`EpBuffer`.
    With ``num_local_experts`` and ``weight_dtype`` the same collective compares, on every call, what
    the ranks must pass alike (E_loc, hidden, top_k, the dtypes, the row format), and ``bad_ids`` (a
    0-d tensor, nonzero where this rank's ids fail the host check) makes every rank raise, not only the
    one whose ids are bad while the others wait for it in the exchange: that rank by ``ids_error()``
    (which raises the host check's error, naming the slot), the others naming the rank."""
    group = resolve_group(group)
    checked = num_local_experts is not None and weight_dtype is not None
    row = [num_tokens]
    if checked:
        row += [num_local_experts, hidden, top_k, _DTYPES.index(dtype), _DTYPES.index(weight_dtype), int(fp8_rows)]
    mine = torch.tensor(row + [0], dtype=torch.int64, device=device)
    if bad_ids is not None:
        mine[-1] = bad_ids.to(torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).tolist()
    bad = [r for r, entry in enumerate(table) if entry[-1]]
    if bad:
        if group.rank() in bad and ids_error is not None:
            ids_error()
        limit = "num_experts" if num_local_experts is None else group.size() * num_local_experts
        raise ValueError(f"topk_idx of rank(s) {bad} holds expert ids outside [-1, {limit}); expected global "
                         f"ids in [-1, W * E_loc) (-1 marks an unused slot)")
    if checked:
        _raise_on_disagreement([entry[1:-1] for entry in table], _CALL_COLUMNS,
                               {"dtype": _DTYPES, "topk_weights dtype": _DTYPES})
    most = max(max(entry[0] for entry in table), 1)
    key = (group.group_name, hidden, top_k, dtype, str(device))
    buffer = _DEFAULT_BUFFERS.get(key)
    # Capacity only grows: every rank sees the same maxima, so the shapes agree and settle.
    if buffer is None or buffer.group is not group or buffer.max_tokens_per_rank < most:
        buffer = EpBuffer(group, most, hidden, top_k, dtype)
        _DEFAULT_BUFFERS[key] = buffer
    if checked:  # dispatch's own check of this shape class would ask the same again
        _AGREED[(group.group_name, buffer.max_tokens_per_rank, hidden, top_k, dtype, weight_dtype)] = group
    return buffer


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockedExchange:
    """What the exchanges with the blocked received layout share (module docstring: ``R = W * cap``
    rows, block s from source rank s): the group's size and rank, the sizes the custom ops' fake
    implementations ask for, and the routing part of the handle."""

    def __init__(self, group, world_size: int, rank: int, num_local_experts: int, max_tokens_per_rank: int,
                 fp8_rows: bool):
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.num_local_experts = int(num_local_experts)
        self.capacity = int(max_tokens_per_rank)
        self.fp8_rows = bool(fp8_rows)

    @property
    def num_rows(self) -> int:
        """R: rows every rank receives (``W * max_tokens_per_rank``)."""
        return self.world_size * self.capacity

    # -- sizes, for the custom ops' fake implementations ----------------------------------------

    def received_rows(self, num_tokens: int) -> int:
        return self.num_rows

    def handle_like(self, x: torch.Tensor, topk_idx: torch.Tensor) -> list[torch.Tensor]:
        """Empty tensors shaped like dispatch's handle: which ranks each token went to ``[W, T]``, and
        the rank owning each slot's expert ``[T, K]`` (-1 for unused slots)."""
        num_tokens, top_k = topk_idx.shape
        return [torch.empty(self.world_size, num_tokens, dtype=torch.bool, device=x.device),
                torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)]

    def num_experts(self, num_local_experts: int) -> int:
        return self.world_size * num_local_experts


class AllToAllExchange(BlockedExchange):
    """The four exchange pieces for ``num_local_experts`` experts per rank and a capacity of
    ``max_tokens_per_rank`` rows from each source; ``fp8_rows``: dispatch sends x's rows in the
    fp8 recipe's 1x128 format (see the module docstring)."""

    def __init__(self, group, num_local_experts: int, max_tokens_per_rank: int, fp8_rows: bool = False):
        group = resolve_group(group)
        if group is None:
            raise TypeError("group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None")
        super().__init__(group, group.size(), group.rank(), num_local_experts, max_tokens_per_rank, fp8_rows)

    # -- checks -----------------------------------------------------------------------------

    def _check_agreement(self, hidden: int, top_k: int, dtype: torch.dtype, weight_dtype: torch.dtype,
                         device: torch.device) -> None:
        """Once per shape class (group, capacity, hidden, top_k, dtypes): every rank has the same E_loc,
        capacity, shapes, dtypes (topk_weights' sets the width of the ids-and-weights exchange) and row
        format (fp8 or not: the recipe).

        One all_gather and a host sync; skipped while a CUDA graph is captured (run one eager step
        before capturing). The key leaves E_loc out on purpose: whether to check must be decided
        alike on every rank, and E_loc (or the row format) is what may differ; so with an ``EpBuffer``
        a rank that changes its E_loc or recipe in a shape class the group already checked is not
        caught. Without one, :func:`default_ep_buffer` compares them on every call."""
        key = (self.group.group_name, self.capacity, hidden, top_k, dtype, weight_dtype)
        if _AGREED.get(key) is self.group or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        names = ("num_local_experts", "max_tokens_per_rank", "hidden", "top_k", "dtype", "fp8_rows",
                 "topk_weights dtype")
        mine = torch.tensor([self.num_local_experts, self.capacity, hidden, top_k, _DTYPES.index(dtype),
                             self.fp8_rows, _DTYPES.index(weight_dtype)], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        _raise_on_disagreement([g.tolist() for g in gathered], names, {"dtype": _DTYPES, "topk_weights dtype": _DTYPES})
        _AGREED[key] = self.group

    # -- the four pieces -----------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Send each token once to every rank that owns one of its experts.

        Returns ``x_r [R, H]`` (x's dtype; under ``fp8_rows`` x's rows quantized 1x128 and
        dequantized), ``idx_r [R, K]`` int32 local ids (-1: unused or another rank's expert),
        ``w_r [R, K]`` (topk_weights' dtype, 0 where idx_r is -1) and the handle the other pieces take."""
        num_tokens, hidden = x.shape
        top_k = topk_idx.shape[1]
        world, cap, num_local = self.world_size, self.capacity, self.num_local_experts
        if num_tokens > cap:
            raise ValueError(f"rank {self.rank} passes {num_tokens} tokens but the exchange's capacity is "
                             f"max_tokens_per_rank={cap}; create the EpBuffer with max_tokens_per_rank >= "
                             f"{num_tokens}")
        self._check_agreement(hidden, top_k, x.dtype, topk_weights.dtype, x.device)

        ids = topk_idx.long()
        dest = torch.arange(world, device=x.device).view(world, 1, 1)
        # Ids outside [-1, W * E_loc) (let through by DGE_CHECK_IDS=0 on CPU) are unused slots, as on one rank.
        valid = (ids >= 0) & (ids < world * num_local)
        slot_rank = torch.where(valid, ids.div(num_local, rounding_mode="floor"), -1)       # [T, K]
        on_dest = slot_rank.unsqueeze(0) == dest                                            # [W, T, K]
        sent = on_dest.any(-1)                                                              # [W, T]

        send_idx = torch.full((world, cap, top_k), -1, dtype=torch.int32, device=x.device)
        send_idx[:, :num_tokens] = torch.where(on_dest, ids.unsqueeze(0) - dest * num_local, -1).to(torch.int32)
        send_w = topk_weights.new_zeros(world, cap, top_k)
        send_w[:, :num_tokens] = torch.where(on_dest, topk_weights.unsqueeze(0), 0)
        # Ids and weights travel together as bytes: one collective instead of two.
        send_meta = torch.cat([send_idx.view(torch.uint8), send_w.view(torch.uint8)], dim=-1)

        x_r = self._received_rows(self._all_to_all(self.send_rows(x, sent)), hidden, x.dtype)
        meta_r = self._all_to_all(send_meta.view(world * cap, -1))
        idx_bytes = top_k * 4
        idx_r = meta_r[:, :idx_bytes].contiguous().view(torch.int32)
        w_r = meta_r[:, idx_bytes:].contiguous().view(topk_weights.dtype)
        return x_r, idx_r, w_r, [sent, slot_rank]

    def combine(self, y_r: torch.Tensor, handle: list[torch.Tensor]) -> torch.Tensor:
        """``y [T, H]``: each token's partial results from the ranks it went to, summed in rank order."""
        sent, _ = handle
        return self._sum_over_ranks(self._all_to_all(y_r.contiguous()), sent)

    def combine_backward(self, dy: torch.Tensor, handle: list[torch.Tensor]) -> torch.Tensor:
        """``dy_r [R, H]``: ``dy[t]`` on the rows token t was dispatched to, zero elsewhere."""
        sent, _ = handle
        return self._all_to_all(self._scatter_to_ranks(dy, sent))

    def dispatch_backward(self, dx_r: torch.Tensor, dw_r: torch.Tensor, handle: list[torch.Tensor]):
        """``(dx [T, H], d_topk_weights [T, K])``: dx summed over the ranks each token went to in rank
        order; each slot's weight gradient from the rank that owns its expert (0 for -1 slots)."""
        sent, slot_rank = handle
        world, cap = self.world_size, self.capacity
        num_tokens, top_k = slot_rank.shape
        dx = self._sum_over_ranks(self._all_to_all(dx_r.contiguous()), sent)
        dw_back = self._all_to_all(dw_r.contiguous()).view(world, cap, top_k)[:, :num_tokens]
        owner = slot_rank.clamp(min=0).unsqueeze(0)
        d_topk = torch.where(slot_rank >= 0, dw_back.gather(0, owner).squeeze(0), 0)
        return dx, d_topk

    # -- helpers -------------------------------------------------------------------------------

    def send_rows(self, x: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """What dispatch sends of x ``[R, ...]`` (``sent [W, T]``: which ranks each token goes to):
        x's rows, or under ``fp8_rows`` uint8 rows of e4m3 data then the fp32 scales' bytes."""
        return self._scatter_to_ranks(fp8_rows_of(x) if self.fp8_rows else x, sent)

    def _received_rows(self, rows: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        return received_rows_of(rows, hidden, dtype, self.fp8_rows)

    def _all_to_all(self, rows: torch.Tensor) -> torch.Tensor:
        # Equal splits: block d of the input goes to rank d, block s of the output came from rank s.
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows, group=self.group)
        return out

    def _sum_over_ranks(self, back: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        world, num_tokens = sent.shape
        blocks = back.view(world, self.capacity, -1)[:, :num_tokens]
        acc = torch.zeros(blocks.shape[1:], dtype=_accumulate_dtype(back.dtype), device=back.device)
        for d in range(world):  # fixed order: the same bits whatever the arrival order
            acc += torch.where(sent[d].unsqueeze(-1), blocks[d], 0).to(acc.dtype)
        return acc.to(back.dtype)

    def _scatter_to_ranks(self, rows: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """[R, ...]: row t of block d is rows[t] where token t goes to rank d, else zero."""
        world, num_tokens = sent.shape
        out = rows.new_zeros(world, self.capacity, rows.shape[1])
        out[:, :num_tokens] = torch.where(sent.unsqueeze(-1), rows.unsqueeze(0), 0)
        return out.view(world * self.capacity, -1)


_EXCHANGES: dict[tuple, AllToAllExchange] = {}


def exchange_from_name(group_name: str, num_local_experts: int, max_tokens_per_rank: int,
                       fp8_rows: bool = False) -> AllToAllExchange:
    """The exchange for a group given by name (custom-op arguments can only be tensors, scalars and
    strings; functional collectives resolve groups the same way), cached per (group, E_loc,
    capacity, row format)."""
    group = _resolve_process_group(group_name)
    key = (group_name, num_local_experts, max_tokens_per_rank, fp8_rows)
    exchange = _EXCHANGES.get(key)
    # Names are reused once a group is destroyed: a cached exchange of a dead group is rebuilt.
    if exchange is None or exchange.group is not group:
        exchange = _EXCHANGES[key] = AllToAllExchange(group, num_local_experts, max_tokens_per_rank, fp8_rows)
    return exchange
