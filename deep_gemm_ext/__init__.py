"""deep_gemm_ext: trainable Mega MoE layers (forward + backward) for NVIDIA GPUs."""
from .adapters import (
    MegaQwen3MoeSparseBlock,
    from_hf_qwen3_moe_experts,
    from_torchtitan_experts,
    replace_qwen3_moe_experts,
    restore_qwen3_moe_experts,
    to_hf_qwen3_moe_experts,
    to_torchtitan_experts,
)
from .api import mega_moe_train
from .comm.all_to_all import EpBuffer, ep_memory_bytes
from .module import MegaMoE
from .reference import reference_forward
from .routing import TOKEN_GROUP_ALIGNMENT, RoutingMeta, compute_routing_torch
from .validation import unsupported_shape_reason

__version__ = "0.1.0"

__all__ = [
    "mega_moe_train",
    "MegaMoE",
    "EpBuffer",
    "ep_memory_bytes",
    "MegaQwen3MoeSparseBlock",
    "replace_qwen3_moe_experts",
    "restore_qwen3_moe_experts",
    "from_hf_qwen3_moe_experts",
    "to_hf_qwen3_moe_experts",
    "from_torchtitan_experts",
    "to_torchtitan_experts",
    "reference_forward",
    "RoutingMeta",
    "compute_routing_torch",
    "TOKEN_GROUP_ALIGNMENT",
    "unsupported_shape_reason",
]
