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
_SUM = {(dtype, b): (f"ep_transport_pull_sum_{str(dtype)[6:]}_w{8 * b}",
                     _code("ep_pull_sum_kernel", _sum_args(dtype), f"<{SUM_DTYPES[dtype]}, {b}>"))
        for dtype in SUM_DTYPES for b in (4, 8)}


@jit.register("ep_transport")
def configs():
    return [(name, code, False) for name, code in [_PUBLISH, *_DISPATCH.values(), _ROWS, *_SUM.values()]]
