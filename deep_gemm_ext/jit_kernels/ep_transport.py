"""Launchers of the symmetric-memory token exchange (kernels/impls/ep_transport.cuh).

Each exchange piece is a publish launch (this rank's data into its own region, then its ready
flag on every peer) and a pull launch (the peers' regions into a fresh local tensor, then its
consumed flag on every peer). :class:`Transport` holds what every launch of one rank shares: the
peer pointer table, the region layout, the rank, the grid cap and the wait timeout. The
protocol, the layout and the ordering rules are described in the header.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import jit
from ..jit import KernelArg

_INCLUDE = "#include <impls/ep_transport.cuh>\n"
_THREADS = 256

#: Element types of the sums over ranks (combine, dispatch_backward) and their C++ names.
SUM_DTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float",
              torch.float64: "double"}
#: Byte widths of the routing weights (fp32, or fp64 with fp64 inputs).
WEIGHT_BYTES = {torch.float32: 4, torch.float64: 8}

_COMMON = (KernelArg("peers", "const long long*"), KernelArg("ids_offset", "unsigned long long"),
           KernelArg("weights_offset", "unsigned long long"), KernelArg("count_offset", "unsigned long long"),
           KernelArg("flags_offset", "unsigned long long"), KernelArg("world", "int"), KernelArg("rank", "int"))
_TIMEOUT = (KernelArg("timeout_ns", "unsigned long long"),)

_PUBLISH_ARGS = (*_COMMON, KernelArg("rows", "const void*", nullable=True), KernelArg("num_rows", "unsigned int"),
                 KernelArg("row_bytes", "unsigned int"), KernelArg("row_pitch", "unsigned int"),
                 KernelArg("ids", "const void*", nullable=True), KernelArg("ids_bytes", "unsigned int"),
                 KernelArg("weights", "const void*", nullable=True), KernelArg("weight_bytes", "unsigned int"),
                 KernelArg("num_tokens", "int"), *_TIMEOUT)
_DISPATCH_ARGS = (*_COMMON, KernelArg("capacity", "int"), KernelArg("top_k", "int"),
                  KernelArg("num_local_experts", "int"), KernelArg("row_bytes", "unsigned int"),
                  KernelArg("row_pitch", "unsigned int"), KernelArg("x_r", "void*"), KernelArg("idx_r", "int*"),
                  KernelArg("w_r", "void*"), KernelArg("received", "void*"), *_TIMEOUT)
_ROWS_ARGS = (*_COMMON, KernelArg("capacity", "int"), KernelArg("row_bytes", "unsigned int"),
              KernelArg("row_pitch", "unsigned int"), KernelArg("mask", "const unsigned char*"),
              KernelArg("out", "void*"), *_TIMEOUT)


# The dispatch split for the overlap with the L1 GEMM (DGE_EP_OVERLAP; see the header).
_META_ARGS = (*_COMMON, KernelArg("capacity", "int"), KernelArg("top_k", "int"),
              KernelArg("num_local_experts", "int"), KernelArg("idx_r", "int*"), KernelArg("w_r", "void*"),
              KernelArg("received", "void*"), *_TIMEOUT)
_ARRIVE_ARGS = (*_COMMON, KernelArg("capacity", "int"), KernelArg("row_bytes", "unsigned int"),
                KernelArg("row_pitch", "unsigned int"), KernelArg("mask", "const unsigned char*"),
                KernelArg("out", "void*"), KernelArg("arrivals", "long long*"),
                KernelArg("counters", "int*"), *_TIMEOUT)


def _sum_args(dtype: torch.dtype) -> tuple[KernelArg, ...]:
    return (*_COMMON, KernelArg("capacity", "int"), KernelArg("num_tokens", "int"), KernelArg("hidden", "int"),
            KernelArg("row_pitch", "unsigned int"), KernelArg("sent", "const unsigned char*"),
            KernelArg("out", SUM_DTYPES[dtype] + "*"), KernelArg("owner", "const long long*", nullable=True),
            KernelArg("top_k", "int"), KernelArg("d_topk", "void*", nullable=True), *_TIMEOUT)


def _code(kernel: str, args: tuple[KernelArg, ...], template: str) -> str:
    return _INCLUDE + f"template __global__ void dge::{kernel}{template}({jit.render_types(args)});\n"


_PUBLISH = ("ep_transport_publish", _code("ep_publish_kernel", _PUBLISH_ARGS, f"<{_THREADS}>"))
_DISPATCH = {b: (f"ep_transport_pull_dispatch_w{8 * b}", _code("ep_pull_dispatch_kernel", _DISPATCH_ARGS, f"<{b}>"))
             for b in (4, 8)}
_ROWS = ("ep_transport_pull_rows", _code("ep_pull_rows_kernel", _ROWS_ARGS, f"<{_THREADS}>"))
_META = {b: (f"ep_transport_pull_meta_w{8 * b}", _code("ep_pull_meta_kernel", _META_ARGS, f"<{b}>")) for b in (4, 8)}
_ARRIVE = ("ep_transport_pull_rows_arrive", _code("ep_pull_rows_arrive_kernel", _ARRIVE_ARGS, f"<{_THREADS}>"))
_SUM_ARGS = {dtype: _sum_args(dtype) for dtype in SUM_DTYPES}
_SUM = {(dtype, b): (f"ep_transport_pull_sum_{str(dtype)[6:]}_w{8 * b}",
                     _code("ep_pull_sum_kernel", _sum_args(dtype), f"<{SUM_DTYPES[dtype]}, {b}>"))
        for dtype in SUM_DTYPES for b in (4, 8)}


@jit.register("ep_transport")
def configs():
    return [(name, code, False) for name, code in [_PUBLISH, *_DISPATCH.values(), _ROWS, *_SUM.values(), *_META.values(),
                                                     _ARRIVE]]


class Transport(NamedTuple):
    """What every transport launch of one rank shares.

    peers       int64 [W] on the device: the base address of every rank's region
    offsets     byte offsets of the ids, weights, count and flags areas in a region (rows at 0)
    rank        this rank, in [0, W)
    row_pitch   bytes between rows of the rows area (a multiple of 16)
    blocks      CTAs of every launch (the grid cap: see comm.symmetric)
    timeout_ns  how long a wait spins before it reports and traps
    """
    peers: torch.Tensor
    offsets: tuple[int, int, int, int]
    rank: int
    row_pitch: int
    blocks: int
    timeout_ns: int

    @property
    def world(self) -> int:
        return self.peers.shape[0]

    def common(self) -> dict:
        ids, weights, count, flags = self.offsets
        return dict(peers=self.peers, ids_offset=ids, weights_offset=weights, count_offset=count, flags_offset=flags,
                    world=self.world, rank=self.rank, timeout_ns=self.timeout_ns)

    def launch(self, config: tuple[str, str], args: tuple[KernelArg, ...], **values) -> None:
        with jit.device_guard(self.peers):
            jit.build(*config).launch((self.blocks, 1, 1), (_THREADS, 1, 1),
                                      jit.pack_args(config[0], args, **self.common(), **values))


def _check_rows(label: str, rows: torch.Tensor, device) -> None:
    if not isinstance(rows, torch.Tensor) or rows.device != device or rows.dim() != 2:
        raise ValueError(f"{label}: expected a 2-D tensor on {device}, got "
                         f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
    if not rows.is_contiguous() or rows.data_ptr() % 16 or (rows.shape[1] * rows.element_size()) % 16:
        raise ValueError(f"{label}: rows of {rows.shape[1] * rows.element_size()} bytes at {rows.data_ptr():#x}, "
                         f"stride {rows.stride()}; expected contiguous 16-byte aligned rows of a multiple of 16 bytes")


def publish(transport: Transport, rows: torch.Tensor | None = None, ids: torch.Tensor | None = None,
            weights: torch.Tensor | None = None, num_tokens: int = 0) -> None:
    """This rank's piece into its region: ``rows [n, B]`` (B bytes a row, a multiple of 16) into the
    rows area at the region's pitch, ``ids`` (int32) and ``weights`` (any dtype) as flat bytes into
    the ids and weights areas, ``num_tokens`` into the count; then the ready flags. Always launches
    (the flags advance even with nothing to send)."""
    device = transport.peers.device
    num_rows = row_bytes = 0
    if rows is not None:
        _check_rows("rows", rows, device)
        num_rows, row_bytes = rows.shape[0], rows.shape[1] * rows.element_size()
        if row_bytes > transport.row_pitch:
            raise ValueError(f"rows: {row_bytes} bytes a row exceed the region's row pitch {transport.row_pitch}")
        if num_rows == 0:
            rows = None
    blobs = {}
    for name, blob in (("ids", ids), ("weights", weights)):
        if blob is not None and blob.numel():
            if blob.device != device or not blob.is_contiguous() or (blob.numel() * blob.element_size()) % 4:
                raise ValueError(f"{name}: expected a contiguous tensor on {device} of a multiple of 4 bytes")
            blobs[name] = (blob, blob.numel() * blob.element_size())
        else:
            blobs[name] = (None, 0)
    # What fits the region's areas (rows at 0, then ids, weights, count): past them a piece would
    # overwrite the next area or the flags.
    ids_offset, weights_offset, count_offset, _ = transport.offsets
    for what, need, room in (("rows", num_rows * transport.row_pitch, ids_offset),
                             ("ids", blobs["ids"][1], weights_offset - ids_offset),
                             ("weights", blobs["weights"][1], count_offset - weights_offset)):
        if need > room:
            raise ValueError(f"publish: {what} of {need} bytes exceed the region's {what} area of {room} bytes "
                             f"(sized from max_tokens_per_rank and top_k of the buffer)")
    transport.launch(_PUBLISH, _PUBLISH_ARGS, rows=rows, num_rows=num_rows, row_bytes=row_bytes,
                     row_pitch=transport.row_pitch, ids=blobs["ids"][0], ids_bytes=blobs["ids"][1],
                     weights=blobs["weights"][0], weight_bytes=blobs["weights"][1], num_tokens=int(num_tokens))


def pull_dispatch(transport: Transport, capacity: int, top_k: int, num_local_experts: int, row_bytes: int,
                  weight_dtype: torch.dtype):
    """``(x_r bytes [R, row_bytes] uint8, idx_r [R, K] int32, w_r [R, K] weight_dtype, received [R] bool)``
    from every rank's published dispatch (R = W * capacity; see the header)."""
    device = transport.peers.device
    rows = transport.world * capacity
    x_r = torch.empty(rows, row_bytes, dtype=torch.uint8, device=device)
    idx_r = torch.empty(rows, top_k, dtype=torch.int32, device=device)
    w_r = torch.empty(rows, top_k, dtype=weight_dtype, device=device)
    received = torch.empty(rows, dtype=torch.bool, device=device)
    transport.launch(_DISPATCH[WEIGHT_BYTES[weight_dtype]], _DISPATCH_ARGS, capacity=capacity, top_k=top_k,
                     num_local_experts=num_local_experts, row_bytes=row_bytes, row_pitch=transport.row_pitch,
                     x_r=x_r, idx_r=idx_r, w_r=w_r, received=received)
    return x_r, idx_r, w_r, received


def pull_rows(transport: Transport, capacity: int, mask: torch.Tensor, hidden: int, dtype: torch.dtype):
    """``out [R, hidden]`` of ``dtype``: row s * cap + t is row t of rank s's rows area where
    ``mask [R]`` (bool), else zero."""
    device = transport.peers.device
    out = torch.empty(transport.world * capacity, hidden, dtype=dtype, device=device)
    transport.launch(_ROWS, _ROWS_ARGS, capacity=capacity, row_bytes=hidden * out.element_size(),
                     row_pitch=transport.row_pitch, mask=mask.contiguous().view(torch.uint8), out=out)
    return out


def pull_sum(transport: Transport, capacity: int, sent: torch.Tensor, hidden: int, dtype: torch.dtype,
             owner: torch.Tensor | None = None, weight_dtype: torch.dtype = torch.float32):
    """``out [T, hidden]``: out[t] = the rank-order sum over d with ``sent[d, t]`` of row
    (me * cap + t) of rank d's rows area, accumulated in fp32 (fp64 for fp64) and rounded once;
    with ``owner [T, K]`` (int64 ranks, -1: none) also ``d_topk [T, K]`` of ``weight_dtype`` from
    the owners' weights areas (else None)."""
    if dtype not in SUM_DTYPES:
        raise TypeError(f"dtype={dtype}: expected one of {list(SUM_DTYPES)}")
    device = transport.peers.device
    num_tokens = sent.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    d_topk = None
    top_k = 0
    if owner is not None:
        top_k = owner.shape[1]
        d_topk = torch.empty(num_tokens, top_k, dtype=weight_dtype, device=device)
        owner = owner.to(torch.int64).contiguous()
    transport.launch(_SUM[dtype, WEIGHT_BYTES[weight_dtype]], _SUM_ARGS[dtype], capacity=capacity,
                     num_tokens=num_tokens, hidden=hidden, row_pitch=transport.row_pitch,
                     sent=sent.contiguous().view(torch.uint8), out=out, owner=owner, top_k=top_k, d_topk=d_topk)
    return out, d_topk



def pull_meta(transport: Transport, capacity: int, top_k: int, num_local_experts: int, weight_dtype: torch.dtype):
    """``(idx_r [R, K] int32, w_r [R, K] weight_dtype, received [R] bool)``: pull_dispatch's
    metadata, without the rows; raises no flag (:func:`pull_rows_arrive` does, for both)."""
    device = transport.peers.device
    rows = transport.world * capacity
    idx_r = torch.empty(rows, top_k, dtype=torch.int32, device=device)
    w_r = torch.empty(rows, top_k, dtype=weight_dtype, device=device)
    received = torch.empty(rows, dtype=torch.bool, device=device)
    transport.launch(_META[WEIGHT_BYTES[weight_dtype]], _META_ARGS, capacity=capacity, top_k=top_k,
                     num_local_experts=num_local_experts, idx_r=idx_r, w_r=w_r, received=received)
    return idx_r, w_r, received


def pull_rows_arrive(transport: Transport, capacity: int, received: torch.Tensor, out: torch.Tensor,
                     arrivals: torch.Tensor, counters: torch.Tensor) -> None:
    """Rows ``out [R, row_bytes]`` (any dtype, contiguous) as :func:`pull_rows` with mask
    ``received``, source blocks in the order me, me + 1, ...; ``arrivals [W]`` int64 gets the
    epoch of each source block once it is written (``counters [W]`` int32, zero, scratch). Must
    run after :func:`pull_meta` of the same piece has completed (stream order or an event)."""
    world = transport.world
    device = transport.peers.device
    for label, t, dtype in (("arrivals", arrivals, torch.int64), ("counters", counters, torch.int32)):
        if t.device != device or t.dtype != dtype or tuple(t.shape) != (world,) or not t.is_contiguous():
            raise ValueError(f"{label}: {t.dtype} {tuple(t.shape)} on {t.device}; expected contiguous {dtype} "
                             f"({world},) on {device}")
    _check_rows("out", out, device)
    if out.shape[0] != world * capacity or tuple(received.shape) != (world * capacity,):
        raise ValueError(f"out {tuple(out.shape)} / received {tuple(received.shape)}: expected "
                         f"{world * capacity} rows (W * capacity)")
    row_bytes = out.shape[1] * out.element_size()
    if row_bytes > transport.row_pitch:
        raise ValueError(f"out: {row_bytes} bytes a row exceed the region's row pitch {transport.row_pitch}")
    transport.launch(_ARRIVE, _ARRIVE_ARGS, capacity=capacity, row_bytes=row_bytes, row_pitch=transport.row_pitch,
                     mask=received.contiguous().view(torch.uint8), out=out, arrivals=arrivals, counters=counters)
