"""Argument checks for the public API. Every error names the argument, the value and the expectation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import plan
from .comm.all_to_all import EpBuffer, resolve_group
from .comm.emulated import EmulatedGroup
from .comm.symmetric import SymmetricEpBuffer
from .plan import unsupported_shape_reason

__all__ = ["MoEShape", "check_alignment", "check_expert_ids", "unsupported_shape_reason", "validate_inputs"]


@dataclass(frozen=True)
class MoEShape:
    num_tokens: int
    hidden: int
    top_k: int
    num_experts: int
    intermediate: int
    group: object = None  # the expert-parallel ProcessGroup (a DeviceMesh resolved), or None


_FP32_MAX = torch.finfo(torch.float32).max


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_dim(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {tuple(t.shape)}")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape "
                         f"{tuple(t.shape)}; call .contiguous() first")


def compute_float_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    # The GPU path is bf16; the CPU reference path also takes fp32/fp64 (fp64 for gradcheck).
    if device.type == "cuda":
        return (torch.bfloat16,)
    return (torch.bfloat16, torch.float32, torch.float64)


def validate_inputs(x, topk_idx, topk_weights, l1_weights, l2_weights, *, group=None, recipe="bf16",
                    activation_clamp=None, backend="auto", ep_buffer=None) -> MoEShape:
    x = _tensor("x", x)
    topk_idx = _tensor("topk_idx", topk_idx)
    topk_weights = _tensor("topk_weights", topk_weights)
    l1_weights = _tensor("l1_weights", l1_weights)
    l2_weights = _tensor("l2_weights", l2_weights)

    plan.check_options(backend, recipe)
    if activation_clamp is not None:
        if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, (int, float)):
            raise TypeError(f"activation_clamp must be a float or None, got {type(activation_clamp).__name__}")
        try:
            finite = float(activation_clamp) != float("inf")
        except OverflowError:  # an int past the float range
            finite = False
        if not (activation_clamp > 0 and finite):
            raise ValueError(f"activation_clamp={activation_clamp} must be a finite positive number or None")
    group = resolve_group(group)
    if ep_buffer is not None:
        if not isinstance(ep_buffer, (EpBuffer, SymmetricEpBuffer)):
            raise TypeError(f"ep_buffer must be a deep_gemm_ext.EpBuffer, a deep_gemm_ext.SymmetricEpBuffer or None, "
                            f"got {type(ep_buffer).__name__}")
        if group is None:
            raise ValueError("ep_buffer is given but group is None; pass the group the buffer was made for")
        if ep_buffer.group is not group:
            raise ValueError(f"ep_buffer was made for group {ep_buffer.group_name!r} but group is "
                             f"{group.group_name!r}; expected the same group")
    elif isinstance(group, EmulatedGroup):
        raise ValueError(f"group is an emulated rank's group ({group!r}) but ep_buffer is None; pass the "
                         f"SymmetricEpBuffer of that rank (comm.emulated.emulated_ep_buffers)")

    _check_dim("x", x, 2, "[num_tokens, hidden]")
    _check_dim("topk_idx", topk_idx, 2, "[num_tokens, top_k]")
    _check_dim("topk_weights", topk_weights, 2, "[num_tokens, top_k]")
    _check_dim("l1_weights", l1_weights, 3, "[num_experts, 2 * intermediate, hidden]")
    _check_dim("l2_weights", l2_weights, 3, "[num_experts, hidden, intermediate]")

    device = x.device
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                    ("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}; all inputs must share one device")

    dtypes = compute_float_dtypes(device)
    if x.dtype not in dtypes:
        raise TypeError(f"x has dtype {x.dtype}; expected one of {dtypes} on {device.type}")
    for name, t in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected x's dtype {x.dtype}")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_idx has dtype {topk_idx.dtype}; expected torch.int64 or torch.int32")
    if activation_clamp is not None and x.dtype != torch.float64 and activation_clamp > _FP32_MAX:
        raise ValueError(f"activation_clamp={activation_clamp} exceeds the float32 range ({_FP32_MAX:.6g}) the layer "
                         f"computes in for x of dtype {x.dtype}; expected at most that, or None (no clamp)")
    weight_dtypes = (torch.float32,) if x.dtype != torch.float64 else (torch.float32, torch.float64)
    if topk_weights.dtype not in weight_dtypes:
        raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; expected one of {weight_dtypes}")

    num_tokens, hidden = x.shape
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {num_tokens} tokens")
    top_k = topk_idx.shape[1]
    if top_k < 1:
        raise ValueError(f"topk_idx has top_k={top_k} columns; expected at least 1")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; expected topk_idx's shape "
                         f"{tuple(topk_idx.shape)}")
    num_experts, two_i, l1_hidden = l1_weights.shape
    if num_experts < 1:
        raise ValueError(f"l1_weights has {num_experts} experts; expected at least 1")
    if two_i % 2:
        raise ValueError(f"l1_weights.shape[1]={two_i} must be even (gate rows then up rows)")
    intermediate = two_i // 2
    if l1_hidden != hidden:
        raise ValueError(f"l1_weights.shape[2]={l1_hidden} must equal x's hidden size {hidden}")
    expected_l2 = (num_experts, hidden, intermediate)
    if two_i > 0 and tuple(l2_weights.shape) == (num_experts, hidden, two_i):
        # l2_weights fits an l1_weights of [E, I, H]: l1 holds the gate (or up) rows only.
        raise ValueError(f"l1_weights has shape {tuple(l1_weights.shape)}; expected "
                         f"{(num_experts, 2 * two_i, hidden)} ([num_experts, 2 * intermediate, hidden], gate rows "
                         f"then up rows, with intermediate={two_i} from l2_weights)")
    if tuple(l2_weights.shape) != expected_l2:
        raise ValueError(f"l2_weights has shape {tuple(l2_weights.shape)}; expected {expected_l2} "
                         f"([num_experts, hidden, intermediate] from x and l1_weights)")
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                    ("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        _check_contiguous(name, t)

    if ep_buffer is not None:
        for name, want, got in (("hidden", ep_buffer.hidden, hidden), ("top_k", ep_buffer.top_k, top_k),
                                ("dtype", ep_buffer.dtype, x.dtype)):
            if want != got:
                raise ValueError(f"ep_buffer has {name}={want} but the inputs have {name}={got}; expected an "
                                 f"{type(ep_buffer).__name__} made for these shapes")

    reason = plan.shape_reason_for_backend(backend, recipe, device, hidden, intermediate)
    if reason is not None:
        raise ValueError(reason)
    return MoEShape(num_tokens, hidden, top_k, num_experts, intermediate, group)


def check_alignment(**tensors: torch.Tensor) -> None:
    """The GPU kernels read rows with 16-byte loads and TMA: a view at an odd offset would fault.

    Called from the op's body, which runs eagerly even under torch.compile (data pointers cannot
    be traced)."""
    for name, t in tensors.items():
        if t.is_cuda and t.data_ptr() % 16:
            raise ValueError(f"{name} starts at address {t.data_ptr():#x}, not 16-byte aligned; expected a "
                             f"16-byte aligned tensor (call .clone())")


def ids_out_of_range(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Where ``topk_idx`` holds an id outside ``[-1, num_experts)`` (a bool tensor of its shape)."""
    return (topk_idx < -1) | (topk_idx >= num_experts)


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int, *, host_check: bool = True) -> None:
    """Reject ids outside ``[-1, num_experts)``.

    Reading the verdict costs one host sync, so it is skipped while a CUDA graph is being
    captured (and without ``host_check``: ``DGE_CHECK_IDS=0``, through the plan); there a
    device-side assertion fires instead. Either way the routing treats such ids as unused slots,
    so no kernel indexes out of bounds.
    """
    if topk_idx.numel() == 0:
        return
    bad = ids_out_of_range(topk_idx, num_experts)
    capturing = topk_idx.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or not host_check:
        if topk_idx.is_cuda:
            torch._assert_async(~bad.any(), f"topk_idx holds ids outside [-1, {num_experts})")
        return
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        value = int(topk_idx[pos[0], pos[1]])
        raise ValueError(f"topk_idx[{pos[0]}, {pos[1]}] = {value} is out of range; expected expert ids "
                         f"in [-1, {num_experts}) (-1 marks an unused slot)")
