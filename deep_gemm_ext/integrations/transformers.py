"""``experts_implementation="deep_gemm_ext"`` for transformers 5.x models.

transformers' ``@use_experts_implementation`` decorator makes an experts module's ``forward`` look up
``config._experts_implementation`` in its ``ExpertsInterface`` and call the function found there as
``fn(experts_module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``.
:func:`register_transformers` adds ours under ``"deep_gemm_ext"``. It computes on the module's own
parameters: in the default layout (``gate_up_proj [E, 2I, H]``, gate rows then up rows, and
``down_proj [E, H, I]``, as in Qwen3-MoE, Mixtral, DeepSeek-V3, OLMoE...) they are ``mega_moe_train``'s
``l1_weights`` and ``l2_weights`` themselves. Transposed modules (``is_transposed``, e.g. Aria) are
transposed by a copy on every call, which autograd differentiates like any op (its cost: README,
"transformers"). What the layer cannot compute (biases, a gate other than transformers' default
``silu(gate) * up``, another activation, no gate, a post-expert norm) raises NotImplementedError at
the first call, naming the module's class and the feature.

Nothing here imports transformers at module import time.
"""
from __future__ import annotations

import torch
from torch import nn

from ..module import autocast_enabled, experts_forward

IMPLEMENTATION_NAME = "deep_gemm_ext"


def register_transformers() -> str:
    """Register :func:`transformers_experts_forward` in transformers' ``ExpertsInterface`` under
    ``"deep_gemm_ext"`` (idempotent) and return that name, so that
    ``from_pretrained(..., experts_implementation="deep_gemm_ext")``, ``from_config(...)`` and
    ``model.set_experts_implementation("deep_gemm_ext")`` run every experts module on our layer."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:
        raise ImportError("register_transformers() needs transformers >= 5 (its ExpertsInterface in "
                          f"transformers.integrations.moe), which is not importable here: {exc}") from exc
    _TRANSFORMERS.update(_transformers_names())
    ExpertsInterface.register(IMPLEMENTATION_NAME, transformers_experts_forward)
    return IMPLEMENTATION_NAME


#: transformers' SiLU class and default gate, looked up at registration: the experts forward must not
#: import (torch.compile cannot trace an import of transformers' lazy modules).
_TRANSFORMERS: dict = {}


def _transformers_names() -> dict:
    from transformers import activations
    from transformers.integrations import moe
    return {"silu": getattr(activations, "SiLUActivation", nn.SiLU),
            "default_gate": getattr(moe, "_default_apply_gate", None)}


def _is_silu(act) -> bool:
    return isinstance(act, (nn.SiLU, _TRANSFORMERS["silu"])) or act is torch.nn.functional.silu


def _has_default_gate(experts_class: type) -> bool:
    return getattr(experts_class, "_apply_gate", None) is _TRANSFORMERS["default_gate"]


def _unsupported_reason(experts) -> str | None:
    """What of ``experts`` our layer cannot compute, or None."""
    if not getattr(experts, "has_gate", True):
        return "no gate projection (has_gate=False)"
    if getattr(experts, "has_bias", False):
        return "expert biases (has_bias=True)"
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm=True)"
    if not _has_default_gate(type(experts)):
        return (f"its own gating function {type(experts).__name__}._apply_gate (deep_gemm_ext computes "
                f"silu(gate) * up)")
    if not getattr(experts, "is_concatenated", True):
        # transformers' default gate splits gate_up in halves whatever the flag says, while a kernel
        # honouring the flag would de-interleave: two meanings, so neither is guessed.
        return ("gate and up rows declared interleaved (is_concatenated=False) but gated by transformers' "
                "default _apply_gate, which splits them in halves")
    act = getattr(experts, "act_fn", None)
    if not _is_silu(act):
        return f"the activation {type(act).__name__} (deep_gemm_ext computes silu(gate) * up)"
    for name in ("gate_up_proj", "down_proj"):
        if not (isinstance(getattr(experts, name, None), torch.Tensor) and getattr(experts, name).dim() == 3):
            return f"no 3-D {name} tensor"
    return None


def _check_supported(experts) -> None:
    if not _TRANSFORMERS:  # registered by other means than register_transformers()
        _TRANSFORMERS.update(_transformers_names())
    reason = _unsupported_reason(experts)
    if reason is not None:
        model_type = getattr(getattr(experts, "config", None), "model_type", "?")
        raise NotImplementedError(
            f"experts_implementation={IMPLEMENTATION_NAME!r} cannot run {type(experts).__name__} (model_type "
            f"{model_type!r}): it has {reason}; use another experts_implementation (e.g. 'grouped_mm') for "
            f"this model")


def _layer_weights(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(l1 [E, 2I, H], l2 [E, H, I])`` from the module's parameters: the parameters themselves in
    the default layout, an autograd-tracked rearranging copy otherwise."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up.contiguous(), down.contiguous()


def transformers_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward contract, computed by :func:`deep_gemm_ext.mega_moe_train`.

    ``top_k_weights`` arrive in the model's dtype and are computed in fp32 (fp64 for an fp64
    model); ``hidden_states`` are cast to the weights' dtype (or the autocast dtype) and the result
    back to ``hidden_states``' dtype. Under transformers' expert parallelism the ids of experts held
    by other ranks (``>= num_experts``) become unused slots.
    """
    _check_supported(experts)
    l1, l2 = _layer_weights(experts)
    if getattr(experts, "_is_expert_parallel", False):
        top_k_index = top_k_index.masked_fill(top_k_index >= l1.shape[0], -1)
    x = hidden_states
    if not autocast_enabled(x.device.type):
        x = x.to(l1.dtype)
    return experts_forward(x, top_k_index, top_k_weights, l1, l2).to(hidden_states.dtype)
