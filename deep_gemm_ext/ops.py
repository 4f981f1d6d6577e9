"""``torch.library`` custom ops for the MoE layer, with fake impls and a registered autograd.

``deep_gemm_ext::mega_moe_fwd`` returns ``y`` and the tensors it made for the backward (a list:
the pool or nothing where the L1 GEMM gathers x, h, the routing metadata, the exchange's handle);
``deep_gemm_ext::mega_moe_bwd`` takes the saved list and returns the four gradients. Both take the
call's plan as a string (deep_gemm_ext.plan), so adding a saved tensor or a plan field changes no
schema. Both are opaque to ``torch.compile`` (one node each) and free of host syncs on the GPU path
(but the optional id check), so they can be captured in CUDA graphs.

:func:`call` (what ``mega_moe_train`` runs) takes the ops where the dispatcher is needed
(torch.compile, torch.jit.trace, dispatch and function modes, functorch, tensor subclasses, meta
tensors, DGE_EAGER_CUSTOM_OP=1) and otherwise the same forward and backward through a
``torch.autograd.Function`` (whose backward, traced by compiled autograd, is the backward op).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _env, layer
from .plan import Plan
from .validation import check_alignment, check_expert_ids

_LIB = "deep_gemm_ext"


@torch.library.custom_op(f"{_LIB}::mega_moe_fwd", mutates_args=())
def mega_moe_fwd(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    activation_clamp: Optional[float],
    plan: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    p = Plan.decode(plan)
    y, saved = _forward(p, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp)
    return y, layer.produced_of(p, saved)


_NO_CONTEXT = contextlib.nullcontext()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a device autocast does not know: meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _autocast_off(t: torch.Tensor):
    """A context with autocast off for ``t``'s device where it is on, else a free no-op: the layer computes in
    its inputs' dtypes (README, "The contract"), and autocast would re-cast the matmuls of the CPU and torch
    paths, in the forward and in a backward run under autocast (MegaMoE casts its inputs first)."""
    device_type = "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


def _forward(p: Plan, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp):
    with _autocast_off(x):
        return _forward_impl(p, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp)


def _backward_impl(plan: str, dy, saved, activation_clamp):
    with _autocast_off(dy):
        return layer.backward(Plan.decode(plan), dy.contiguous(), saved, activation_clamp)


def _forward_impl(p: Plan, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp):
    check_alignment(x=x, topk_idx=topk_idx, topk_weights=topk_weights, l1_weights=l1_weights,
                    l2_weights=l2_weights)
    num_experts = p.tokens.num_experts(l1_weights.shape[0])
    if p.check_ids or not topk_idx.is_cuda:
        check_expert_ids(topk_idx, num_experts, host_check=p.check_ids)
        return layer.forward(p, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp)
    if p.jit_routing and not p.exchanges_tokens:
        # The routing's histogram kernel reads every id anyway: it asserts on the device (no launch of
        # its own, no host work).
        return layer.forward(p, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp,
                             assert_ids=True)
    # The device-side assertion goes in after the forward's kernels, off the path to the first GEMM:
    # the routing and the exchanges treat out-of-range ids as unused slots meanwhile (nothing reads
    # out of bounds), and the assertion still fails the step.
    out = layer.forward(p, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp)
    check_expert_ids(topk_idx, num_experts, host_check=False)
    return out


@mega_moe_fwd.register_fake
def _(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan):
    return x.new_empty(x.shape), layer.produced_like(Plan.decode(plan), x, topk_idx, topk_weights, l1_weights)


@torch.library.custom_op(f"{_LIB}::mega_moe_bwd", mutates_args=())
def mega_moe_bwd(
    dy: torch.Tensor,
    saved: list[torch.Tensor],
    activation_clamp: Optional[float],
    plan: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(plan, dy, list(saved), activation_clamp)


@mega_moe_bwd.register_fake
def _(dy, saved, activation_clamp, plan):
    _, w_rows, l1_weights, l2_weights, *_ = saved  # w_rows: the dispatched weights, [R, K]
    # dx is computed from dy.contiguous(): contiguous whatever dy's strides.
    return (dy.new_empty(dy.shape), w_rows.new_empty(dy.shape[0], w_rows.shape[1]), torch.empty_like(l1_weights),
            torch.empty_like(l2_weights))


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan = inputs
    _, produced = output
    ctx.mark_non_differentiable(*produced)
    ctx.x_ref = weakref.ref(x) if x.requires_grad else None  # for a double backward's error only
    # The saved tensors get no gradient: do not let autograd fill zeros for them (two [P, H]-sized
    # memsets per backward).
    ctx.set_materialize_grads(False)
    ctx.activation_clamp = activation_clamp
    ctx.plan = plan
    ctx.save_for_backward(*layer.saved_of(Plan.decode(plan), x, topk_weights, l1_weights, l2_weights, produced))


def _backward(ctx, dy, *unused_grads):
    if dy is None:
        return (None,) * 7
    dx, d_topk, d_l1, d_l2 = torch.ops.deep_gemm_ext.mega_moe_bwd(dy, list(ctx.saved_tensors), ctx.activation_clamp,
                                                                  ctx.plan)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True: see _once_differentiable
        dx, d_topk, d_l1, d_l2 = _join_for_double_backward(ctx, (dx, d_topk, d_l1, d_l2), (dy,))
    return dx, None, d_topk, d_l1, d_l2, None, None


mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)


_NO_DOUBLE_BACKWARD = ("mega_moe_train has no double backward (gradients of its gradients): its backward is not "
                       "differentiable")


class _NoDoubleBackward(torch.autograd.Function):
    """The gradients ``grads`` as they are, joined in the graph to ``inputs`` (what they depend on: the
    saved inputs that require grad, and dy): differentiating them with respect to any of those raises,
    where a node hung on detached copies (torch's once_differentiable) is never reached from the real
    inputs and a gradient taken with ``allow_unused=True`` comes back None."""

    @staticmethod
    def forward(ctx, count, *tensors):
        ctx.set_materialize_grads(False)
        return tuple(None if t is None else t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_DOUBLE_BACKWARD)


def _once_differentiable(backward):
    """``torch.autograd.function.once_differentiable``, but joined to what the gradients depend on whenever
    the backward runs with grad mode on (``create_graph=True``): torch's own wraps the gradients only
    where an argument of the backward (dy) requires grad, and then on detached copies, so a gradient of
    them with respect to x or a weight is silently wrong or None. Here it raises."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        return _join_for_double_backward(ctx, outputs, grads)

    return wrapper


def _join_for_double_backward(ctx, outputs: tuple, grads: tuple) -> tuple:
    """``outputs`` joined by :class:`_NoDoubleBackward` to the differentiable tensors they depend on: x (held
    weakly: it is not saved on every path), the saved tensors and the incoming gradients."""
    x = ctx.x_ref() if ctx.x_ref is not None else None
    inputs = [t for t in (x, *ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not inputs:  # nothing the gradients depend on is differentiable: no second-order path exists
        return outputs
    return _NoDoubleBackward.apply(len(outputs), *outputs, *inputs)


class _EagerMegaMoE(torch.autograd.Function):
    """The custom ops' forward and backward without the dispatcher: what :func:`call` runs for an
    eager call with plain tensors. The custom-op layers (argument schema, the alias check over
    every produced tensor, the autograd wrapper around both ops) are host work per call that a
    host-bound step (a short layer, few tokens) pays in full; the layer's work is the same
    function calls on the same tensors, so the results are the same bits."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan):
        y, saved = _forward(Plan.decode(plan), x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp)
        ctx.set_materialize_grads(False)  # as the custom op: no zero-filled gradients for unused outputs
        # For a double backward's error only (_once_differentiable): a weak reference, not x's memory.
        ctx.x_ref = weakref.ref(x) if x.requires_grad else None
        ctx.activation_clamp = activation_clamp
        ctx.plan = plan
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    @_once_differentiable
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 7
        if torch.compiler.is_compiling():  # compiled autograd traces this: keep the backward one opaque op
            dx, d_topk, d_l1, d_l2 = torch.ops.deep_gemm_ext.mega_moe_bwd(dy, list(ctx.saved_tensors),
                                                                          ctx.activation_clamp, ctx.plan)
        else:
            dx, d_topk, d_l1, d_l2 = _backward_impl(ctx.plan, dy, list(ctx.saved_tensors), ctx.activation_clamp)
        return dx, None, d_topk, d_l1, d_l2, None, None

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError("mega_moe_train has no forward-mode AD (jvp): differentiate it with backward "
                                  "(reverse mode) instead")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dispatcher_needed(tensors) -> bool:
    """Whether a call must go through the custom ops: under torch.compile or torch.jit.trace, inside a
    torch dispatch or function mode (fake tensors, FlopCounterMode, ``with torch.device(...)``), under a
    functorch transform, with a tensor subclass or a tensor on another device than CPU / CUDA (meta
    tensors take the ops' fake), or when DGE_EAGER_CUSTOM_OP=1 asks for it."""
    return (torch.compiler.is_compiling() or _env.eager_custom_op() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active()
            or torch.jit.is_tracing()
            # is_cuda / is_cpu: about a third of the host time of device.type (which builds a torch.device)
            or not all(type(t) in _PLAIN and (t.is_cuda or t.is_cpu) for t in tensors))


_REVERSE_MODE = ("it has a custom backward only; differentiate it with torch.autograd (loss.backward() or "
                 "torch.autograd.grad) outside functorch transforms")
_UNSUPPORTED_TRANSFORMS = {
    TransformType.Grad: "torch.func.grad / vjp / jacrev: " + _REVERSE_MODE,
    TransformType.Jvp: "torch.func.jvp / jacfwd (forward-mode AD): " + _REVERSE_MODE,
    TransformType.Vmap: ("torch.func.vmap: it has no batching rule; flatten the batch into its tokens (x [B*T, H]) "
                         "or loop over it"),
} if (TransformType := getattr(torch._C._functorch, "TransformType", None)) is not None else {}


def check_transforms(tensors) -> None:
    """Raise a clear error under what the layer has no rule for: functorch's grad, jvp and vmap transforms
    (functionalization passes), and forward-mode AD's dual tensors (which the op would silently drop)."""
    if torch._C._are_functorch_transforms_active():
        active = {interpreter.key() for interpreter in torch._C._functorch.get_interpreter_stack() or ()}
        for transform, what in _UNSUPPORTED_TRANSFORMS.items():  # jacfwd is vmap over jvp: name the AD first
            if transform in active:
                raise NotImplementedError(f"mega_moe_train does not support {what}")
    if _forward_ad._current_level >= 0 and any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError("mega_moe_train has no forward-mode AD (an input is a dual tensor with a "
                                  "tangent): differentiate it with backward (reverse mode) instead")


def call(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan: str) -> torch.Tensor:
    """y of the layer: through ``deep_gemm_ext::mega_moe_fwd`` where the dispatcher is needed (see
    :func:`_dispatcher_needed`), else through :class:`_EagerMegaMoE`."""
    tensors = (x, topk_idx, topk_weights, l1_weights, l2_weights)
    if _dispatcher_needed(tensors):
        if not torch.compiler.is_compiling():
            check_transforms(tensors)
        return torch.ops.deep_gemm_ext.mega_moe_fwd(x, topk_idx, topk_weights, l1_weights, l2_weights,
                                                    activation_clamp, plan)[0]
    return _EagerMegaMoE.apply(x, topk_idx, topk_weights, l1_weights, l2_weights, activation_clamp, plan)
