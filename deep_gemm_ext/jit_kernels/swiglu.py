"""SwiGLU forward / backward on pool rows (kernels/impls/swiglu.cuh), fp32 math on bf16 storage."""
from __future__ import annotations

import ctypes
import math

import torch

from .. import jit
from .gather_combine import _aligned

_INCLUDE = "#include <impls/swiglu.cuh>\n"
_THREADS = 256
_WARPS = _THREADS // 32
# Resident CTAs per SM for these 256-thread kernels: the grid-stride loops need no more.
_CTAS_PER_SM = 8


def _forward_code(clamp: bool) -> str:
    flag = "true" if clamp else "false"
    return _INCLUDE + (f"template __global__ void dge::swiglu_forward_kernel<{flag}>"
                       f"(const __nv_bfloat16*, __nv_bfloat16*, long long, int, float);\n")


def _backward_code(clamp: bool) -> str:
    flag = "true" if clamp else "false"
    return _INCLUDE + (f"template __global__ void dge::swiglu_backward_kernel<{flag}>"
                       f"(const __nv_bfloat16*, const __nv_bfloat16*, const float*, __nv_bfloat16*, float*, "
                       f"__nv_bfloat16*, long long, int, float);\n")


_FORWARD = {c: (f"swiglu_forward_{'clamp' if c else 'plain'}", _forward_code(c)) for c in (False, True)}
_BACKWARD = {c: (f"swiglu_backward_{'clamp' if c else 'plain'}", _backward_code(c)) for c in (False, True)}


@jit.register("swiglu")
def configs():
    return [(name, code, False) for name, code in [*_FORWARD.values(), *_BACKWARD.values()]]


def _check_clamp(clamp) -> float:
    if clamp is None:
        return math.inf
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0:
        raise ValueError(f"clamp={clamp!r}: expected None or a positive float")
    return float(clamp)


def _check_bf16_matrix(label: str, tensor, cols_multiple: int) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise ValueError(f"{label}: expected a CUDA tensor, got "
                         f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    if tensor.dtype != torch.bfloat16:
        raise TypeError(f"{label}: dtype {tensor.dtype}, expected torch.bfloat16")
    if tensor.dim() != 2 or tensor.shape[1] % cols_multiple:
        raise ValueError(f"{label}: shape {tuple(tensor.shape)}, expected 2-D with a column count divisible by "
                         f"{cols_multiple} (16-byte vectors)")


def _check_backward_args(h, da, row_weight):
    """The SwiGLU backward's inputs checked (h [P, 2I] and da [P, I] bf16, row_weight [P] fp32, one
    device), made contiguous."""
    _check_bf16_matrix("h", h, 16)
    _check_bf16_matrix("da", da, 8)
    rows, inter = h.shape[0], h.shape[1] // 2
    if tuple(da.shape) != (rows, inter):
        raise ValueError(f"da: shape {tuple(da.shape)}, expected ({rows}, {inter}) to match h {tuple(h.shape)}")
    if not isinstance(row_weight, torch.Tensor) or row_weight.dtype != torch.float32 or \
            tuple(row_weight.shape) != (rows,) or row_weight.device != h.device:
        raise ValueError(f"row_weight: expected a float32 tensor of shape ({rows},) on {h.device}, got "
                         f"{getattr(row_weight, 'dtype', type(row_weight).__name__)} "
                         f"{tuple(getattr(row_weight, 'shape', ()))} on {getattr(row_weight, 'device', None)}")
    if da.device != h.device:
        raise ValueError(f"da: on {da.device}, expected {h.device} like h")
    return _aligned(h), _aligned(da), row_weight.contiguous()


def _grid(work_items: int, items_per_cta: int, device) -> tuple[int, int, int]:
    return (max(1, min(-(-work_items // items_per_cta), jit.num_sms(device) * _CTAS_PER_SM)), 1, 1)


def swiglu_forward(h: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """act [P, I] = silu(min(g, c)) * clamp(u, -c, c) for h = [g | u] of shape [P, 2I], bf16."""
    _check_bf16_matrix("h", h, 16)
    c = _check_clamp(clamp)
    h = _aligned(h)
    rows, inter = h.shape[0], h.shape[1] // 2
    act = torch.empty(rows, inter, dtype=torch.bfloat16, device=h.device)
    if rows == 0 or inter == 0:
        return act
    with jit.device_guard(h):
        jit.build(*_FORWARD[clamp is not None]).launch(
            _grid(rows * inter // 8, _THREADS, h.device), (_THREADS, 1, 1),
            (h, act, ctypes.c_int64(rows), ctypes.c_int32(inter), ctypes.c_float(c)))
    return act


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, row_weight: torch.Tensor,
                    clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [P, 2I] bf16, dweight [P] fp32, act_w [P, I] bf16) for the weighted SwiGLU of each row.

    dweight[p] = <da[p], act[p]> (fp32, fixed reduction order); with d = w * da the gradient of
    act = silu(min(g, c)) * clamp(u, -c, c) goes to dh (clamp masks pass at equality), and
    act_w = w * act, both rounded to bf16.
    """
    h, da, row_weight = _check_backward_args(h, da, row_weight)
    c = _check_clamp(clamp)
    rows, inter = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    dweight = torch.empty(rows, dtype=torch.float32, device=h.device)
    act_w = torch.empty(rows, inter, dtype=torch.bfloat16, device=h.device)
    if rows == 0:
        return dh, dweight, act_w
    if inter == 0:
        return dh, dweight.zero_(), act_w
    with jit.device_guard(h):
        jit.build(*_BACKWARD[clamp is not None]).launch(
            _grid(rows, _WARPS, h.device), (_THREADS, 1, 1),
            (h, da, row_weight, dh, dweight, act_w, ctypes.c_int64(rows), ctypes.c_int32(inter), ctypes.c_float(c)))
    return dh, dweight, act_w
