"""Public entry point: ``mega_moe_train``."""
from __future__ import annotations

import contextlib

import torch

from . import _env, ops
from . import plan
from .validation import validate_inputs


def mega_moe_train(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   l1_weights: torch.Tensor, l2_weights: torch.Tensor, *, group=None,
                   recipe: str = "bf16", activation_clamp: float | None = None,
                   backend: str = "auto", ep_buffer=None) -> torch.Tensor:
    """The MoE layer (README, "The contract"; in code, ``deep_gemm_ext/reference.py``),
    differentiable w.r.t. x, topk_weights and both weights.

    x [T, H]; topk_idx [T, K] int64/int32, expert ids in [-1, E) (-1 = unused slot);
    topk_weights [T, K] fp32; l1_weights [E, 2I, H] (gate rows, then up rows); l2_weights [E, H, I].
    ``activation_clamp=c`` computes ``silu(min(g, c)) * clamp(u, -c, c)``. Returns y [T, H] in x's
    dtype. On CPU this runs the reference path, in fp32 (fp64 for fp64 inputs); on SM90+ bf16 the
    GPU path.

    backend: ``"auto"`` (our SM90 kernels where they apply, else the torch path), ``"torch"``
    (grouped GEMMs through ``torch._grouped_mm``), or ``"deep_gemm"`` (upstream DeepGEMM's grouped
    GEMMs; needs deep_gemm installed). recipe: ``"bf16"``; ``"fp8"`` (blockwise fp8: 1x128 activation
    and 128x128 weight scales, deep_gemm_ext.recipes.fp8) on DeepGEMM's kernels, elsewhere as its
    torch emulation.

    Expert parallelism: ``group`` (a ProcessGroup or a 1-D DeviceMesh of W ranks) makes rank r the
    owner of the global experts ``[r * E_loc, (r + 1) * E_loc)``: l1_weights / l2_weights hold those
    ``E_loc``, topk_idx holds global ids in ``[-1, W * E_loc)``, and x, y and the gradients of x and
    topk_weights are this rank's own tokens (any number per rank, 0 included). Tokens travel by
    all-to-all (deep_gemm_ext.comm.all_to_all); ``ep_buffer`` (an :class:`~deep_gemm_ext.EpBuffer`)
    fixes the capacity, else every call finds it with one all_gather (a host sync; CUDA graphs and
    torch.compile need the buffer). Every rank of the group must call the layer.
    """
    tensors = (x, topk_idx, topk_weights, l1_weights, l2_weights)
    # One rank: arguments shaped as a call's before passed the same checks and get the same plan.
    key = plan.call_key(tensors, recipe, activation_clamp, backend) if group is None and ep_buffer is None else None
    encoded = None if key is None else plan.cached_call(key)
    if encoded is None:
        with _env.recording() if key is not None else contextlib.nullcontext({}) as reads:
            group = validate_inputs(*tensors, group=group, recipe=recipe, activation_clamp=activation_clamp,
                                    backend=backend, ep_buffer=ep_buffer).group
            exchange = plan.resolve_exchange(x, topk_idx, l1_weights, group, ep_buffer, recipe, topk_weights)
            encoded = plan.resolve_encoded(x, l1_weights, backend=backend, recipe=recipe, exchange=exchange)
        if key is not None:
            plan.remember_call(key, reads, encoded)
    clamp = None if activation_clamp is None else float(activation_clamp)
    return ops.call(x, topk_idx, topk_weights, l1_weights, l2_weights, clamp, encoded)
