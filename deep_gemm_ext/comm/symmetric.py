"""Expert-parallel token exchange over NVLink symmetric memory, moved by our own CUDA kernels.

Same contract and same received layout as the all-to-all exchange (:mod:`.all_to_all`): rank r
owns the experts ``[r * E_loc, (r + 1) * E_loc)``; dispatch delivers ``R = W * cap`` rows, block s
holding source rank s's tokens at row t (unsent rows zero, ids -1, weights 0); sums over ranks run
in rank order in fp32 (fp64 for fp64) and round once. So the layer computes the same bits over
either exchange.

The transport (kernels/impls/ep_transport.cuh) is pull-based. Every rank owns one region of a
symmetric allocation (``torch.distributed._symmetric_memory``; :func:`symmetric_ep_memory_bytes`
bytes a rank): a rows area, an ids and a weights area, a token count and flags. Each piece
publishes this rank's data into its own region and raises its ``ready`` flag on every peer, then
pulls from the peers' regions once their flags say their data is there, into fresh local tensors,
and raises its ``consumed`` flag on every peer (the region is reused by the next piece only once
every peer has read it). The flags carry epochs counted on the device, so nothing waits on the
host and the exchange can be captured in a CUDA graph; every rank must call the pieces in the
same order (the layer does: dispatch, combine forward; combine_backward, dispatch_backward).

Waits are bounded by ``DGE_EP_TIMEOUT_S`` (default 600 s): a rank whose peer never arrives prints
which flag of which peer it waited on and traps (the CUDA context is lost, as with a device-side
assertion).

Ranks emulated on one GPU (:mod:`.emulated`) use the same buffers and kernels over W regions of
one allocation.

Dispatch overlapped with the L1 GEMM (``DGE_EP_OVERLAP=1``, :meth:`SymmetricExchange.dispatch_overlapped`):
the pull is split in two. ``pull_meta`` (ids, weights, received mask) runs on the caller's stream;
``pull_rows_arrive`` (x's rows) runs on the buffer's side stream, source blocks in the order me,
me + 1, ..., and stores the piece's epoch into ``arrivals[s]`` (a local tensor of the buffer) once
source s's block is written. The L1 GEMM, launched right after on the caller's stream, waits per
tile for the sources of its rows (jit_kernels' AwaitRows). SM reservation: the GEMM is persistent
and one CTA takes a whole SM (its registers), so its grid is capped to leave the pull its SMs
(:meth:`SymmetricEpBuffer.overlap_gemm_ctas`); a GEMM holding every SM while it waits for a pull
that cannot start would never finish.
"""
from __future__ import annotations

import atexit
import itertools
import sys
import threading
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import _env
from .all_to_all import (_DTYPES, BlockedExchange, _raise_on_disagreement, check_buffer_sizes, fp8_row_bytes, fp8_rows_of, received_rows_of,
                         resolve_group)
from .emulated import EmulatedGroup, EmulatedWorld

#: Transport CTAs per launch on real ranks: the exchange runs beside the GEMMs of another stream
#: (communication overlapped with computation), so it leaves most SMs to them; 24 CTAs of 256
#: threads keep enough 16-byte loads in flight to saturate a GPU's NVLink bandwidth.
DEFAULT_BLOCKS = 24
_WEIGHT_BYTES = 8  # the weights area holds fp64 weights (fp32 ones take half)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class RegionLayout(NamedTuple):
    """Byte layout of one rank's region (rows at offset 0)."""
    row_pitch: int
    ids: int
    weights: int
    count: int
    flags: int
    size: int


def region_layout(world_size: int, max_tokens_per_rank: int, hidden: int, top_k: int,
                  dtype: torch.dtype = torch.bfloat16) -> RegionLayout:
    """Rows of ``max(hidden * itemsize, fp8_row_bytes(hidden))`` bytes padded to 16, ``R * K``
    int32 ids, ``R * K`` 8-byte weights, a 16-byte token count and the flags ``ready[W]``,
    ``consumed[W]``, epoch and a block counter (u64 each), every area 16-byte aligned and the
    region a multiple of 128 bytes (R = W * max_tokens_per_rank)."""
    rows = world_size * max_tokens_per_rank
    pitch = _round_up(max(hidden * dtype.itemsize, fp8_row_bytes(hidden)), 16)
    ids = rows * pitch
    weights = ids + _round_up(rows * top_k * 4, 16)
    count = weights + _round_up(rows * top_k * _WEIGHT_BYTES, 16)
    flags = count + 16
    size = _round_up(flags + (2 * world_size + 2) * 8, 128)
    return RegionLayout(pitch, ids, weights, count, flags, size)


def symmetric_ep_memory_bytes(world_size: int, max_tokens_per_rank: int, hidden: int, top_k: int,
                              dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one rank's region of a :class:`SymmetricEpBuffer` (held for the buffer's life;
    each piece also allocates its outputs, as the all-to-all exchange does)."""
    return region_layout(world_size, max_tokens_per_rank, hidden, top_k, dtype).size


_IDS = itertools.count()
#: Live buffers by id: plans name their buffer by id (a plan is a string).
_BUFFERS: "weakref.WeakValueDictionary[int, SymmetricEpBuffer]" = weakref.WeakValueDictionary()


_REPORT_LOCK = threading.Lock()
_REPORT: list = []


def overlap_report_tensor() -> torch.Tensor:
    """The process's pinned int64 [5] record of an L1 GEMM's wait that timed out (set flag, rank,
    source, awaited epoch, seen): the GEMM cannot printf (a call serializes its wgmmas), so it
    writes there before it traps; the host reads it after the CUDA error (and at exit)."""
    with _REPORT_LOCK:
        if not _REPORT:
            _REPORT.append(torch.zeros(5, dtype=torch.int64, pin_memory=True))
            atexit.register(_print_overlap_report)
        return _REPORT[0]


def overlap_timeout_report() -> str | None:
    """What an overlapped L1 GEMM's timed-out wait left in :func:`overlap_report_tensor`, or None."""
    if not _REPORT:
        return None
    flag, rank, source, epoch, seen = (int(v) for v in _REPORT[0].tolist())
    if not flag:
        return None
    return (f"deep_gemm_ext expert-parallel overlap: rank {rank}'s L1 GEMM timed out waiting for the rows of "
            f"source rank {source}: awaited epoch {epoch}, arrivals[{source}] = {seen} (DGE_EP_TIMEOUT_S)")


def _print_overlap_report() -> None:
    message = overlap_timeout_report()
    if message is not None:
        print(message, file=sys.stderr, flush=True)


class PendingRows(NamedTuple):
    """x_r of :meth:`SymmetricExchange.dispatch_overlapped` is still being written: ``wait`` is what
    the waiting L1 GEMM takes (jit_kernels.AwaitRows); ``done`` is recorded on the side stream
    after the pull: any other reader of x_r waits on it first (``torch.cuda.current_stream().wait_event``)."""
    wait: object
    done: torch.cuda.Event


def _check_sizes(max_tokens_per_rank, hidden, top_k, dtype) -> None:
    check_buffer_sizes(max_tokens_per_rank, hidden, top_k, dtype)
    if (hidden * dtype.itemsize) % 16:
        raise ValueError(f"hidden={hidden}: rows of {hidden * dtype.itemsize} bytes; the symmetric exchange copies "
                         f"16-byte vectors, so hidden * itemsize must be a multiple of 16")


def _init_regions(storage: torch.Tensor, layout: RegionLayout, world: int) -> None:
    """0xFF bytes everywhere (NaN in every float dtype, -1 ids), flags zero."""
    storage.fill_(0xFF)
    regions = storage.view(-1, layout.size)
    regions[:, layout.flags:].zero_()


class SymmetricEpBuffer:
    """One rank's region of the symmetric exchange's allocation, for one shape class: create it
    once on every rank of ``group`` (a collective: the regions are exchanged by rendezvous), pass it
    as ``ep_buffer`` on every call of the layer with that group. ``max_tokens_per_rank`` caps the
    tokens any rank passes; :meth:`memory_bytes` is the region's size.

    ``blocks``: CTAs of every transport launch (default :data:`DEFAULT_BLOCKS`; emulated ranks:
    ``ceil(num_SMs / (2 W))``)."""

    def __init__(self, group, max_tokens_per_rank: int, hidden: int, top_k: int,
                 dtype: torch.dtype = torch.bfloat16, *, blocks: int | None = None):
        group = resolve_group(group)
        if group is None:
            raise TypeError("group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None")
        if isinstance(group, EmulatedGroup):
            raise TypeError("an emulated group's buffers come from deep_gemm_ext.comm.emulated.emulated_ep_buffers")
        _check_sizes(max_tokens_per_rank, hidden, top_k, dtype)
        if not torch.cuda.is_available():
            raise RuntimeError("SymmetricEpBuffer needs a CUDA device (symmetric memory)")
        from torch.distributed import _symmetric_memory as symm

        world = group.size()
        layout = region_layout(world, max_tokens_per_rank, hidden, top_k, dtype)
        device = torch.device("cuda", torch.cuda.current_device())
        storage = symm.empty(layout.size, dtype=torch.uint8, device=device)
        _init_regions(storage, layout, world)
        handle = symm.rendezvous(storage, group.group_name)
        # Every region is initialized before any peer raises a flag in it: the barrier is a kernel
        # on this stream, so the host waits for it too before the first piece can run on another.
        torch.cuda.synchronize(device)
        handle.barrier()
        torch.cuda.synchronize(device)
        peers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self._setup(group, group.rank(), max_tokens_per_rank, hidden, top_k, dtype, layout, storage, peers,
                    DEFAULT_BLOCKS if blocks is None else blocks)
        self._handle = handle

    @classmethod
    def _emulated(cls, world_size, max_tokens_per_rank, hidden, top_k, dtype, device, blocks):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: expected a positive int")
        _check_sizes(max_tokens_per_rank, hidden, top_k, dtype)
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda":
            raise ValueError(f"device={device}: emulated ranks run on one CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        layout = region_layout(world_size, max_tokens_per_rank, hidden, top_k, dtype)
        storage = torch.empty(world_size * layout.size, dtype=torch.uint8, device=device)
        _init_regions(storage, layout, world_size)
        base = storage.data_ptr()
        peers = torch.tensor([base + r * layout.size for r in range(world_size)], dtype=torch.int64, device=device)
        if blocks is None:
            from .. import jit

            blocks = -(-jit.num_sms(device) // (2 * world_size))
        from .emulated import side_streams

        world = EmulatedWorld(world_size)
        # Made here, on the calling thread, not lazily inside the ranks' threads: the side streams
        # (one per rank for all emulated buffers, a bounded count of streams) and the pinned report.
        sides = side_streams(world_size, device.index)
        overlap_report_tensor()
        buffers = []
        for rank in range(world_size):
            buffer = cls.__new__(cls)
            buffer._setup(EmulatedGroup(world, rank), rank, max_tokens_per_rank, hidden, top_k, dtype, layout,
                          storage, peers, blocks)
            buffer._handle = None
            buffer._side_stream = sides[rank]
            buffers.append(buffer)
        return buffers

    def _setup(self, group, rank, max_tokens_per_rank, hidden, top_k, dtype, layout, storage, peers, blocks):
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"blocks={blocks!r}: expected a positive int (CTAs per transport launch)")
        self.group = group
        self.rank = rank
        self.world_size = group.size()
        self.max_tokens_per_rank = max_tokens_per_rank
        self.hidden = hidden
        self.top_k = top_k
        self.dtype = dtype
        self.layout = layout
        self.blocks = blocks
        self._storage = storage  # every region (emulated) or this rank's (symmetric memory)
        self.peers = peers
        self._overlap = None
        self._side_stream = None
        self.agreed: set = set()
        self.agree_round = 0
        self.id = next(_IDS)
        _BUFFERS[self.id] = self

    @property
    def emulated(self) -> bool:
        return isinstance(self.group, EmulatedGroup)

    @property
    def group_name(self) -> str:
        return self.group.group_name

    def exchange_spec(self, num_local_experts: int, fp8_rows: bool = False) -> str:
        """How a plan names the exchange over this buffer (``symmetric:<id>:<E_loc>:<cap>:<x|fp8>``)."""
        return f"symmetric:{self.id}:{num_local_experts}:{self.max_tokens_per_rank}:{'fp8' if fp8_rows else 'x'}"

    def exchange(self, num_local_experts: int, fp8_rows: bool = False) -> "SymmetricExchange":
        """The four exchange pieces over this buffer for ``num_local_experts`` experts a rank."""
        key = (int(num_local_experts), bool(fp8_rows))
        cache = self.__dict__.setdefault("_exchanges", {})
        if key not in cache:
            cache[key] = SymmetricExchange(self, *key)
        return cache[key]

    def memory_bytes(self, fp8_rows: bool = False) -> int:
        """Bytes of this rank's region (:func:`symmetric_ep_memory_bytes`); the same with fp8 rows."""
        return self.layout.size

    def overlap_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The overlapped dispatch's local state, made at its first use (never in the symmetric
        region): ``arrivals [W]`` int64, the epoch of the last dispatch whose block of source s is
        written; the row pull's CTA counters ``[W]`` int32; and this rank's epoch (the u64 in its
        region) as a one-element int64 view."""
        if self._overlap is None:
            device = self.peers.device
            first = self.rank * self.layout.size if self.emulated else 0
            epoch = first + self.layout.flags + 2 * self.world_size * 8
            self._overlap = (torch.zeros(self.world_size, dtype=torch.int64, device=device),
                             torch.zeros(self.world_size, dtype=torch.int32, device=device),
                             self._storage[epoch:epoch + 8].view(torch.int64))
        return self._overlap

    def side_stream(self) -> torch.cuda.Stream:
        """The stream of the overlapped dispatch's row pull (one per buffer: per rank)."""
        if self._side_stream is None:
            from ..jit.driver import new_stream

            self._side_stream = new_stream(self.peers.device)  # never a pooled stream (new_stream says why)
        return self._side_stream

    def overlap_gemm_ctas(self) -> int:
        """The persistent grid cap of the L1 GEMM that waits for the overlapped pull's rows.

        A GEMM CTA takes a whole SM (384 threads of up to 168 registers: the register file), so
        whatever SMs the GEMM holds no transport CTA can use. The GEMM waits only for this rank's
        row pull, which waits for nothing that is not already there (pull_meta, before it in stream
        order, saw every ready flag); so the pull finishes once it has any SM, and the GEMM after it.

        Real ranks: ``num_SMs - blocks``: the pull, launched first, always has its SMs.

        Emulated ranks share the GPU, and a transport kernel of one rank may wait for another
        rank's launches. Per rank at most two transport grids run at once (one on the rank's
        stream, the row pull on its side stream), ``blocks`` CTAs each, and one waiting GEMM; with
        ``G <= (num_SMs - 2 W blocks) / W`` CTAs a GEMM, all W GEMMs and all 2 W transport grids fit
        on the device together, each transport CTA on its own SM even. Then every kernel that can
        wait is resident at once: every pull runs (it waits for nothing), every GEMM finishes after
        its pull, and the transport kernels waiting for other ranks see those ranks' streams go on.
        No wait cycle can hold all SMs. Raises where that leaves no CTA (create the emulated buffers
        with fewer ``blocks``)."""
        from .. import jit

        sms = jit.num_sms(self.peers.device)
        if self.emulated:
            ctas = (sms - 2 * self.world_size * self.blocks) // self.world_size
            if ctas < 1:
                raise ValueError(f"DGE_EP_OVERLAP with {self.world_size} emulated ranks of blocks={self.blocks} on "
                                 f"{sms} SMs: the waiting L1 GEMMs would get no SM beside 2 * W * blocks = "
                                 f"{2 * self.world_size * self.blocks} transport CTAs; create the buffers with "
                                 f"emulated_ep_buffers(..., blocks=b), b <= "
                                 f"{(sms - self.world_size) // (2 * self.world_size)}")
            return ctas
        if sms - self.blocks < 1:
            raise ValueError(f"DGE_EP_OVERLAP: blocks={self.blocks} transport CTAs leave no SM of {sms} to the L1 GEMM")
        return sms - self.blocks

    def transport(self):
        from ..jit_kernels.ep_transport import Transport

        timeout_ns = int(_env.ep_timeout_s() * 1e9)
        return Transport(self.peers, (self.layout.ids, self.layout.weights, self.layout.count, self.layout.flags),
                         self.rank, self.layout.row_pitch, self.blocks, timeout_ns)

    def __repr__(self) -> str:
        return (f"SymmetricEpBuffer(group={self.group_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, hidden={self.hidden}, top_k={self.top_k}, "
                f"dtype={self.dtype}, blocks={self.blocks}, region_bytes={self.layout.size})")


def buffer_by_id(buffer_id: int) -> SymmetricEpBuffer:
    buffer = _BUFFERS.get(buffer_id)
    if buffer is None:
        raise ValueError(f"symmetric exchange buffer {buffer_id} does not exist (any more); keep the "
                         f"SymmetricEpBuffer alive while the layer uses it")
    return buffer


def exchange_from_spec(buffer_id: int, num_local_experts: int, max_tokens_per_rank: int,
                       fp8_rows: bool = False) -> "SymmetricExchange":
    buffer = buffer_by_id(buffer_id)
    if buffer.max_tokens_per_rank != max_tokens_per_rank:
        raise ValueError(f"symmetric exchange buffer {buffer_id} has max_tokens_per_rank="
                         f"{buffer.max_tokens_per_rank}, the plan names {max_tokens_per_rank}")
    return buffer.exchange(num_local_experts, fp8_rows)


def _accumulate_check(dtype):
    from ..jit_kernels.ep_transport import SUM_DTYPES

    if dtype not in SUM_DTYPES:
        raise TypeError(f"dtype {dtype}: the symmetric exchange sums {list(SUM_DTYPES)}")


class SymmetricExchange(BlockedExchange):
    """The four exchange pieces over a :class:`SymmetricEpBuffer` (see the module docstring)."""

    def __init__(self, buffer: SymmetricEpBuffer, num_local_experts: int, fp8_rows: bool = False):
        super().__init__(buffer.group, buffer.world_size, buffer.rank, num_local_experts, buffer.max_tokens_per_rank,
                         fp8_rows)
        self.buffer = buffer

    def handle_like(self, x: torch.Tensor, topk_idx: torch.Tensor) -> list[torch.Tensor]:
        """The routing part of the handle (:meth:`BlockedExchange.handle_like`) and which received
        rows hold a token for this rank ``[R]``."""
        return [*super().handle_like(x, topk_idx), torch.empty(self.num_rows, dtype=torch.bool, device=x.device)]

    # -- checks -----------------------------------------------------------------------------

    def _check_agreement(self, hidden: int, top_k: int, dtype: torch.dtype, weight_dtype: torch.dtype,
                         device: torch.device) -> None:
        """Once per buffer and (E_loc, row format, shapes): every rank passes the same values. One
        all_gather and a host sync on a real group, skipped under CUDA graph capture (run one eager
        step first); emulated ranks compare on the host."""
        buffer = self.buffer
        key = (self.num_local_experts, self.fp8_rows, hidden, top_k, dtype, weight_dtype)
        if key in buffer.agreed:
            return
        # The region's layout too: the buffers' dtypes set the row pitch and so every offset a peer
        # writes to.
        names = ("num_local_experts", "max_tokens_per_rank", "hidden", "top_k", "dtype", "fp8_rows",
                 "topk_weights dtype", "buffer region bytes")
        mine = (self.num_local_experts, self.capacity, hidden, top_k, _DTYPES.index(dtype), int(self.fp8_rows),
                _DTYPES.index(weight_dtype), buffer.layout.size)
        if buffer.emulated:
            # The n-th check of every rank meets the n-th of the others (the ranks call alike).
            buffer.agree_round += 1
            table = self.group.world.all_gather(("agree", buffer.agree_round), self.rank, mine, _env.ep_timeout_s())
        else:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            local = torch.tensor(mine, dtype=torch.int64, device=device)
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local, group=self.group)
            table = [tuple(g.tolist()) for g in gathered]
        _raise_on_disagreement(table, names, {name: _DTYPES for name in names if "dtype" in name})
        buffer.agreed.add(key)

    def _check_rows(self, label: str, t: torch.Tensor, rows: int) -> torch.Tensor:
        if not t.is_cuda or t.device != self.buffer.peers.device:
            raise ValueError(f"{label} is on {t.device}; the symmetric exchange's buffer is on {self.buffer.peers.device}")
        if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != self.buffer.hidden:
            raise ValueError(f"{label} has shape {tuple(t.shape)}; expected ({rows}, {self.buffer.hidden})")
        _accumulate_check(t.dtype)
        if t.dtype.itemsize > self.buffer.dtype.itemsize:
            raise ValueError(f"{label} has dtype {t.dtype}; the buffer's rows hold {self.buffer.dtype}")
        t = t.contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()

    # -- the four pieces -----------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """``(x_r [R, H], idx_r [R, K] int32, w_r [R, K], handle)``, as AllToAllExchange.dispatch."""
        from ..jit_kernels import ep_transport

        x, transport, rows, row_bytes, sent, slot_rank = self._publish_dispatch(x, topk_idx, topk_weights)
        hidden, top_k = x.shape[1], topk_idx.shape[1]
        x_bytes, idx_r, w_r, received = ep_transport.pull_dispatch(transport, self.capacity, top_k,
                                                                   self.num_local_experts, row_bytes,
                                                                   topk_weights.dtype)
        if self.fp8_rows:
            x_r = received_rows_of(x_bytes[:, :fp8_row_bytes(hidden)], hidden, x.dtype, True)
        else:
            x_r = x_bytes.view(x.dtype)
        return x_r, idx_r, w_r, [sent, slot_rank, received]

    def dispatch_overlapped(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """``(x_r, idx_r, w_r, handle, pending)``: :meth:`dispatch` whose x_r rows are still arriving
        when it returns (``pending``: :class:`PendingRows`). idx_r, w_r and the handle are complete
        on the caller's stream; x_r is written by the side stream's row pull, which the L1 GEMM's
        waiting loader follows (``pending.wait``), and every other reader waits on ``pending.done``.
        The same values as :meth:`dispatch` (same kernels' copies, same layout). bf16 rows only."""
        from ..jit_kernels import AwaitRows, ep_transport

        if self.fp8_rows:
            raise ValueError("dispatch_overlapped: the overlapped dispatch moves bf16 rows; this exchange sends "
                             "fp8 rows")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"dispatch_overlapped: x has dtype {x.dtype}; the waiting L1 GEMM reads bf16 rows")
        buffer = self.buffer
        max_ctas = buffer.overlap_gemm_ctas()
        arrivals, counters, epoch = buffer.overlap_state()
        x, transport, rows, row_bytes, sent, slot_rank = self._publish_dispatch(x, topk_idx, topk_weights)
        hidden, top_k = x.shape[1], topk_idx.shape[1]
        idx_r, w_r, received = ep_transport.pull_meta(transport, self.capacity, top_k, self.num_local_experts,
                                                      topk_weights.dtype)
        x_r = torch.empty(self.num_rows, hidden, dtype=x.dtype, device=x.device)
        main = torch.cuda.current_stream(x.device)
        side = buffer.side_stream()
        side.wait_stream(main)  # received and x_r are made on the caller's stream
        with torch.cuda.stream(side):
            ep_transport.pull_rows_arrive(transport, self.capacity, received, x_r, arrivals, counters)
            done = torch.cuda.Event()
            done.record(side)
        # The allocator must not hand x_r's or received's memory out again before the pull is done.
        x_r.record_stream(side)
        received.record_stream(side)
        wait = AwaitRows(arrivals, epoch, self.capacity, self.rank, transport.timeout_ns, max_ctas,
                         overlap_report_tensor())
        return x_r, idx_r, w_r, [sent, slot_rank, received], PendingRows(wait, done)

    def _publish_dispatch(self, x, topk_idx, topk_weights):
        """Checks, then this rank's dispatch published: ``(x, transport, rows, row_bytes, sent, slot_rank)``."""
        from ..jit_kernels import ep_transport

        num_tokens, hidden = x.shape
        top_k = topk_idx.shape[1]
        world, cap, num_local = self.world_size, self.capacity, self.num_local_experts
        if num_tokens > cap:
            raise ValueError(f"rank {self.rank} passes {num_tokens} tokens but the exchange's capacity is "
                             f"max_tokens_per_rank={cap}; create the SymmetricEpBuffer with max_tokens_per_rank >= "
                             f"{num_tokens}")
        if top_k != self.buffer.top_k:
            raise ValueError(f"topk_idx has top_k={top_k}; the SymmetricEpBuffer was made for top_k={self.buffer.top_k}")
        if topk_weights.dtype not in ep_transport.WEIGHT_BYTES:
            raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected one of "
                            f"{list(ep_transport.WEIGHT_BYTES)}")
        x = self._check_rows("x", x, num_tokens)
        self._check_agreement(hidden, top_k, x.dtype, topk_weights.dtype, x.device)

        ids = topk_idx.long()
        dest = torch.arange(world, device=x.device).view(world, 1, 1)
        valid = (ids >= 0) & (ids < world * num_local)
        slot_rank = torch.where(valid, ids.div(num_local, rounding_mode="floor"), -1)       # [T, K]
        sent = (slot_rank.unsqueeze(0) == dest).any(-1)                                     # [W, T]

        if self.fp8_rows:
            rows = fp8_rows_of(x)
            row_bytes = _round_up(rows.shape[1], 16)
            rows = torch.nn.functional.pad(rows, (0, row_bytes - rows.shape[1])).contiguous()
        else:
            rows, row_bytes = x, hidden * x.element_size()
        transport = self.buffer.transport()
        # Ids out of int32's range are outside [-1, W * E_loc) anyway: clamped, they stay another rank's.
        ids32 = ids.clamp(-1, world * num_local).to(torch.int32).contiguous()
        ep_transport.publish(transport, rows, ids=ids32, weights=topk_weights.contiguous(), num_tokens=num_tokens)
        return x, transport, rows, row_bytes, sent, slot_rank

    def combine(self, y_r: torch.Tensor, handle: list[torch.Tensor]) -> torch.Tensor:
        """``y [T, H]``: each token's partial results from the ranks it went to, summed in rank order."""
        from ..jit_kernels import ep_transport

        sent, _, _ = handle
        y_r = self._check_rows("y_r", y_r, self.num_rows)
        transport = self.buffer.transport()
        ep_transport.publish(transport, y_r)
        return ep_transport.pull_sum(transport, self.capacity, sent, y_r.shape[1], y_r.dtype)[0]

    def combine_backward(self, dy: torch.Tensor, handle: list[torch.Tensor]) -> torch.Tensor:
        """``dy_r [R, H]``: ``dy[t]`` on the rows token t was dispatched to, zero elsewhere."""
        from ..jit_kernels import ep_transport

        sent, _, received = handle
        dy = self._check_rows("dy", dy, sent.shape[1])
        transport = self.buffer.transport()
        ep_transport.publish(transport, dy)
        return ep_transport.pull_rows(transport, self.capacity, received, dy.shape[1], dy.dtype)

    def dispatch_backward(self, dx_r: torch.Tensor, dw_r: torch.Tensor, handle: list[torch.Tensor]):
        """``(dx [T, H], d_topk_weights [T, K])``: dx summed over the ranks each token went to in rank
        order; each slot's weight gradient from the rank that owns its expert (0 for -1 slots)."""
        from ..jit_kernels import ep_transport

        sent, slot_rank, _ = handle
        dx_r = self._check_rows("dx_r", dx_r, self.num_rows)
        if dw_r.dtype not in ep_transport.WEIGHT_BYTES or tuple(dw_r.shape) != (self.num_rows, slot_rank.shape[1]):
            raise ValueError(f"dw_r: {dw_r.dtype} {tuple(dw_r.shape)}; expected fp32/fp64 "
                             f"({self.num_rows}, {slot_rank.shape[1]})")
        transport = self.buffer.transport()
        ep_transport.publish(transport, dx_r, weights=dw_r.contiguous())
        return ep_transport.pull_sum(transport, self.capacity, sent, dx_r.shape[1], dx_r.dtype, owner=slot_rank,
                                     weight_dtype=dw_r.dtype)


__all__ = ["DEFAULT_BLOCKS", "PendingRows", "RegionLayout", "SymmetricEpBuffer", "SymmetricExchange", "buffer_by_id",
           "exchange_from_spec", "overlap_report_tensor", "overlap_timeout_report", "region_layout",
           "symmetric_ep_memory_bytes"]
