"""Integrations with training stacks: transformers' ExpertsInterface, a torchtitan experts module."""
from .torchtitan import MegaGroupedExperts
from .transformers import IMPLEMENTATION_NAME, register_transformers, transformers_experts_forward

__all__ = ["IMPLEMENTATION_NAME", "register_transformers", "transformers_experts_forward", "MegaGroupedExperts"]
