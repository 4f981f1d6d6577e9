"""Moving expert weights between :class:`MegaMoE` and the layouts of Hugging Face transformers and
torchtitan, and swapping transformers' Qwen3-MoE sparse blocks for ``MegaMoE``-backed ones.

Nothing here imports transformers or torchtitan: modules are recognised by their attributes, so
both transformers layouts work:

- 4.x: ``block.gate`` is an ``nn.Linear(hidden, E)`` router, ``block.experts`` an ``nn.ModuleList``
  of MLPs with ``gate_proj`` / ``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]`` Linears; the
  block returns ``(y, router_logits)``.
- 5.x: ``block.gate`` is a top-k router module returning ``(logits, scores, indices)``;
  ``block.experts`` holds fused ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
  ``down_proj`` ``[E, H, I]`` (``[E, H, 2I]`` / ``[E, I, H]`` when ``experts.is_transposed``;
  gate and up rows alternate when ``experts.is_concatenated`` is False); the block returns ``y``.

torchtitan's ``GroupedExperts`` holds ``w1`` (gate) ``[E, I, H]``, ``w2`` ``[E, H, I]`` and ``w3`` (up)
``[E, I, H]``: ``l1 = cat(w1, w3, dim=1)``, ``l2 = w2``.

Every conversion copies. Source tensors cover all ``E`` experts; a ``MegaMoE`` sharded over an
expert-parallel group reads and writes its own slice ``[expert_offset, expert_offset + E_loc)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .module import MegaMoE

_SWIGLU_ACTS = ("silu", "swish")


# ---------------------------------------------------------------------------------------------
# Expert weights as (gate [E][I, H], up [E][I, H], down [E][H, I]): views into the source, indexed
# by global expert id, so reading and writing both go through the same copy loop.


def _is_per_expert_list(experts) -> bool:
    return isinstance(experts, nn.ModuleList) and len(experts) > 0 and all(
        hasattr(m, name) for m in experts for name in ("gate_proj", "up_proj", "down_proj"))


def _check_activation(owner, where: str) -> None:
    act = getattr(getattr(owner, "config", None), "hidden_act", "silu")
    if act not in _SWIGLU_ACTS:
        raise ValueError(f"{where} uses hidden_act={act!r}; MegaMoE computes SwiGLU, which needs one of "
                         f"{_SWIGLU_ACTS}")


def _hf_views(experts):
    if _is_per_expert_list(experts):
        for m in experts:
            _check_activation(m, "an expert MLP")
            if any(getattr(lin, "bias", None) is not None for lin in (m.gate_proj, m.up_proj, m.down_proj)):
                raise ValueError("the expert Linears carry biases; MegaMoE's experts have none")
        return ([m.gate_proj.weight for m in experts], [m.up_proj.weight for m in experts],
                [m.down_proj.weight for m in experts])
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        raise TypeError(f"{type(experts).__name__} is not a transformers MoE experts module: expected an "
                        f"nn.ModuleList of gate_proj/up_proj/down_proj MLPs (4.x) or gate_up_proj and "
                        f"down_proj tensors (5.x)")
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise ValueError("the experts carry biases (has_bias=True); MegaMoE's experts have none")
    if not getattr(experts, "has_gate", True):
        raise ValueError("the experts have no gate projection (has_gate=False); MegaMoE computes SwiGLU")
    _check_activation(experts, "the experts module")
    transposed = bool(getattr(experts, "is_transposed", False))
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 or tuple(down.shape) != (
            gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        raise ValueError(f"gate_up_proj {tuple(experts.gate_up_proj.shape)} and down_proj "
                         f"{tuple(experts.down_proj.shape)} do not form [E, 2I, H] and [E, H, I] "
                         f"(is_transposed={transposed})")
    if getattr(experts, "is_concatenated", True):
        gate, up = gate_up.chunk(2, dim=1)
    else:  # gate and up rows alternate
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return gate, up, down


def _torchtitan_views(experts):
    missing = [n for n in ("w1", "w2", "w3") if not isinstance(getattr(experts, n, None), torch.Tensor)]
    if missing:
        raise TypeError(f"{type(experts).__name__} is not a torchtitan GroupedExperts: it lacks the "
                        f"tensors {missing} (w1 [E, I, H], w2 [E, H, I], w3 [E, I, H])")
    return experts.w1, experts.w3, experts.w2


def _check_views(gate, up, down, what: str) -> tuple[int, int, int]:
    """(num_experts, intermediate, hidden) of consistent views, else ValueError."""
    num_experts = len(gate)
    inter, hidden = gate[0].shape
    if len(up) != num_experts or len(down) != num_experts or any(
            tuple(g.shape) != (inter, hidden) or tuple(u.shape) != (inter, hidden)
            or tuple(d.shape) != (hidden, inter) for g, u, d in zip(gate, up, down)):
        raise ValueError(f"{what}: gate / up / down projections are not {num_experts} experts of "
                         f"[I, H] / [I, H] / [H, I] with I={inter}, H={hidden}")
    return num_experts, inter, hidden


def _match(module: MegaMoE, views, what: str) -> None:
    num_experts, inter, hidden = _check_views(*views, what)
    if (num_experts, inter, hidden) != (module.num_experts, module.intermediate, module.hidden):
        raise ValueError(f"{what} has num_experts={num_experts}, intermediate={inter}, hidden={hidden}; "
                         f"the module has num_experts={module.num_experts}, intermediate="
                         f"{module.intermediate}, hidden={module.hidden}")


@torch.no_grad()
def _copy_in(module: MegaMoE, views, what: str) -> MegaMoE:
    _match(module, views, what)
    gate, up, down = views
    inter = module.intermediate
    for e in range(module.num_local_experts):
        src = module.expert_offset + e
        module.l1_weights[e, :inter].copy_(gate[src])
        module.l1_weights[e, inter:].copy_(up[src])
        module.l2_weights[e].copy_(down[src])
    return module


@torch.no_grad()
def _copy_out(module: MegaMoE, views, what: str) -> None:
    _match(module, views, what)
    gate, up, down = views
    inter = module.intermediate
    for e in range(module.num_local_experts):
        dst = module.expert_offset + e
        gate[dst].copy_(module.l1_weights[e, :inter])
        up[dst].copy_(module.l1_weights[e, inter:])
        down[dst].copy_(module.l2_weights[e])


def _new_module(views, top_k: int, what: str, kwargs) -> MegaMoE:
    num_experts, inter, hidden = _check_views(*views, what)
    kwargs.setdefault("device", views[0][0].device)
    kwargs.setdefault("dtype", views[0][0].dtype)
    return _copy_in(MegaMoE(num_experts, hidden, inter, top_k, **kwargs), views, what)


def from_hf_qwen3_moe_experts(experts, *, top_k: int, **module_kwargs) -> MegaMoE:
    """A new :class:`MegaMoE` holding a copy of a transformers experts module's weights (4.x
    ``ModuleList`` or 5.x fused tensors), on their device and in their dtype unless ``device=`` /
    ``dtype=`` say otherwise; other keywords (``group``, ``activation_clamp``...) go to ``MegaMoE``."""
    return _new_module(_hf_views(experts), top_k, "the transformers experts", module_kwargs)


def to_hf_qwen3_moe_experts(module: MegaMoE, experts) -> None:
    """Copy ``module``'s weights into a transformers experts module (either layout), in place."""
    _copy_out(module, _hf_views(experts), "the transformers experts")


def from_torchtitan_experts(experts, *, top_k: int, **module_kwargs) -> MegaMoE:
    """A new :class:`MegaMoE` holding ``cat(w1, w3, dim=1)`` and ``w2`` of a torchtitan
    ``GroupedExperts`` (copies, on their device and in their dtype unless told otherwise)."""
    return _new_module(_torchtitan_views(experts), top_k, "the torchtitan experts", module_kwargs)


def to_torchtitan_experts(module: MegaMoE, experts) -> None:
    """Copy ``module``'s weights into a torchtitan ``GroupedExperts``' ``w1`` / ``w2`` / ``w3``, in place."""
    _copy_out(module, _torchtitan_views(experts), "the torchtitan experts")


# ---------------------------------------------------------------------------------------------
# transformers Qwen3-MoE sparse block


def _is_legacy_block(block) -> bool:
    return isinstance(block.gate, nn.Linear) and _is_per_expert_list(block.experts)


class MegaQwen3MoeSparseBlock(nn.Module):
    """Drop-in for transformers' ``Qwen3MoeSparseMoeBlock``: the same router module (shared, not
    copied, so its parameters and any output-recording hooks stay), the experts in a
    :class:`MegaMoE` built from a copy of the block's expert weights.

    Routing follows Qwen3-MoE: softmax over the router logits in fp32, top-k, renormalised when
    ``norm_topk_prob``, rounded to the hidden states' dtype as transformers does, then handed to
    ``MegaMoE`` in fp32. ``forward`` returns what the original block returned: ``y`` (5.x) or
    ``(y, router_logits)`` (4.x).
    """

    def __init__(self, block, **module_kwargs):
        super().__init__()
        if not (hasattr(block, "gate") and hasattr(block, "experts")):
            raise TypeError(f"{type(block).__name__} is not a Qwen3-MoE sparse block: expected .gate and .experts")
        self.legacy = _is_legacy_block(block)
        router = block if self.legacy else block.gate
        for name in ("top_k", "norm_topk_prob"):
            if not hasattr(router, name):
                raise TypeError(f"{type(router).__name__} has no {name!r}: not a Qwen3-MoE router")
        self.gate = block.gate
        self.top_k = int(router.top_k)
        self.norm_topk_prob = bool(router.norm_topk_prob)
        self.experts = from_hf_qwen3_moe_experts(block.experts, top_k=self.top_k, **module_kwargs)

    def route(self, hidden: torch.Tensor):
        """``(router_logits, topk_weights, topk_idx)`` for ``hidden [T, H]``, as transformers computes them."""
        if not self.legacy:
            return self.gate(hidden)
        logits = self.gate(hidden)
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(hidden.dtype), idx

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        logits, weights, idx = self.route(flat)
        y = self.experts(flat, idx, weights).view(shape)
        return (y, logits) if self.legacy else y


def _is_qwen3_moe_block(module: nn.Module) -> bool:
    return type(module).__name__ == "Qwen3MoeSparseMoeBlock"


def replace_qwen3_moe_experts(model: nn.Module, **module_kwargs) -> int:
    """Swap every ``Qwen3MoeSparseMoeBlock`` in ``model`` for a :class:`MegaQwen3MoeSparseBlock`, in
    place; returns how many were swapped.

    The original block's expert weights move to the ``meta`` device (their memory is freed) and
    the block is remembered, so :func:`restore_qwen3_moe_experts` can give transformers its own
    modules back (for ``save_pretrained``). Call this before building the optimizer and before
    wrapping the model (FSDP2, DDP, torch.compile).
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_qwen3_moe_block(child):
                continue
            block = MegaQwen3MoeSparseBlock(child, **module_kwargs)
            child.experts.to("meta")
            # Not a submodule: it must stay out of parameters(), state_dict() and .to().
            object.__setattr__(block, "_original_block", child)
            setattr(parent, name, block)
            swapped += 1
    return swapped


def restore_qwen3_moe_experts(model: nn.Module) -> int:
    """Undo :func:`replace_qwen3_moe_experts`: put the transformers blocks back, with the current
    (trained) expert weights copied in and the shared router. Needs unsharded parameters (gather a
    full state dict first under FSDP). Returns how many blocks were restored."""
    restored = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            original = getattr(child, "_original_block", None)
            if not isinstance(child, MegaQwen3MoeSparseBlock) or original is None:
                continue
            weights = child.experts.l1_weights
            original.experts.to_empty(device=weights.device).to(weights.dtype)
            to_hf_qwen3_moe_experts(child.experts, original.experts)
            original.gate = child.gate
            setattr(parent, name, original)
            restored += 1
    return restored
