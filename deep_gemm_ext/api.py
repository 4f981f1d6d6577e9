"""Public entry point: ``mega_moe_train``."""
from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers the custom ops)
from . import plan
from .validation import validate_inputs


def mega_moe_train(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   l1_weights: torch.Tensor, l2_weights: torch.Tensor, *, group=None,
                   recipe: str = "bf16", activation_clamp: float | None = None,
                   backend: str = "auto") -> torch.Tensor:
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
    torch emulation. group: None or a group of one rank (expert
    parallelism over several ranks is not available yet).
    """
    validate_inputs(x, topk_idx, topk_weights, l1_weights, l2_weights, group=group, recipe=recipe,
                    activation_clamp=activation_clamp, backend=backend)
    clamp = None if activation_clamp is None else float(activation_clamp)
    encoded = plan.resolve_encoded(x, l1_weights, backend=backend, recipe=recipe, group=group)
    return torch.ops.deep_gemm_ext.mega_moe_fwd(x, topk_idx, topk_weights, l1_weights, l2_weights, clamp,
                                                encoded)[0]
