"""deep_gemm_ext: trainable Mega MoE layers (forward + backward) for NVIDIA GPUs."""
from .api import mega_moe_train
from .comm.all_to_all import EpBuffer, ep_memory_bytes
from .comm.symmetric import SymmetricEpBuffer, symmetric_ep_memory_bytes
from .integrations import MegaGroupedExperts, register_transformers
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
    "SymmetricEpBuffer",
    "symmetric_ep_memory_bytes",
    "register_transformers",
    "MegaGroupedExperts",
    "reference_forward",
    "RoutingMeta",
    "compute_routing_torch",
    "TOKEN_GROUP_ALIGNMENT",
    "unsupported_shape_reason",
]
