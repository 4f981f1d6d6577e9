"""``MegaMoE``: the routed experts of an MoE layer as an ``nn.Module`` over ``mega_moe_train``.

The module owns the two expert weight tensors in the layout of the contract (README) and nothing else:
the router, the top-k choice and any shared expert stay with the caller, who passes
``topk_idx`` / ``topk_weights`` to :meth:`MegaMoE.forward`.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .api import mega_moe_train
from .ops import autocast_enabled
from .comm.all_to_all import resolve_group
from .plan import DEFAULT_BACKEND
from .validation import _tensor, validate_inputs


def _group_size_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if not (hasattr(group, "size") and hasattr(group, "rank")):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got "
                        f"{type(group).__name__}")
    return int(group.size()), int(group.rank())


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return int(value)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (FSDP2 shards by expert, dim 0), else the tensor:
    an in-place init of a slice of a DTensor does not reach its storage, one of the shard's does."""
    return param.to_local() if hasattr(param, "to_local") else param


@torch.no_grad()
def trunc_normal_fp32_(view: torch.Tensor, std: float) -> None:
    """``nn.init.trunc_normal_(view, std=std)`` (truncated at +-2), drawn in fp32: in bf16 it rounds
    some uniforms to exactly +-1, whose erfinv is +-inf, clamped to +-2 (std 0.1 instead of 0.02 on CUDA)."""
    view.copy_(nn.init.trunc_normal_(torch.empty_like(view, dtype=torch.float32), std=std))


def check_routed_inputs(x, topk_idx, topk_weights, weights_name: str = "topk_weights") -> None:
    """The modules' ``x [..., H]``, ``topk_idx [..., K]`` and weights ``[..., K]``: tensors, a floating ``x``,
    and the same leading dimensions (one row of ``topk_idx`` per token of ``x``)."""
    x, topk_idx, topk_weights = (_tensor(name, t) for name, t in (("x", x), ("topk_idx", topk_idx),
                                                                 (weights_name, topk_weights)))
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {x.dtype}; expected a floating dtype")
    if topk_idx.dim() < 1 or x.dim() < 1 or topk_idx.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)} and x {tuple(x.shape)}; expected the same "
                         f"leading dimensions (x [..., hidden], topk_idx [..., top_k]: one row per token)")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"{weights_name} has shape {tuple(topk_weights.shape)}; expected topk_idx's shape "
                         f"{tuple(topk_idx.shape)}")


def experts_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                    l2: torch.Tensor, *, checked: bool = False, **options) -> torch.Tensor:
    """``mega_moe_train`` over ``x [..., H]``, ``topk_idx`` / ``topk_weights [..., K]`` (weights of any
    float dtype, computed in fp32, or fp64 for fp64 ``x``): leading dimensions are flattened and
    restored, and under ``torch.autocast`` ``x`` and the weights are cast to the autocast dtype.
    ``checked``: the caller ran :func:`check_routed_inputs` already."""
    if not checked:
        check_routed_inputs(x, topk_idx, topk_weights)
    device_type = x.device.type
    autocast = autocast_enabled(device_type)
    if autocast:
        dtype = torch.get_autocast_dtype(device_type)
        x, l1, l2 = x.to(dtype), l1.to(dtype), l2.to(dtype)
    weight_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    top_k = topk_idx.shape[-1]
    flat_x = x.reshape(-1, x.shape[-1]).contiguous()
    flat_idx = topk_idx.reshape(-1, top_k).contiguous()
    flat_w = topk_weights.to(weight_dtype).reshape(-1, top_k).contiguous()
    y = mega_moe_train(flat_x, flat_idx, flat_w, l1, l2, **options)  # runs with autocast off
    # A 2-D input gets the op's output itself: FSDP2 warns about modules returning views.
    return y if x.dim() == 2 else y.view(x.shape)


class MegaMoE(nn.Module):
    """Routed SwiGLU experts computed by :func:`deep_gemm_ext.mega_moe_train`.

    Parameters (``E_loc`` = ``num_experts / group.size()``, the experts this rank owns):

    - ``l1_weights`` ``[E_loc, 2 * intermediate, hidden]``: gate rows ``[0, I)``, then up rows
      ``[I, 2I)`` (torchtitan's ``w1`` then ``w3``; transformers' ``gate_up_proj``).
    - ``l2_weights`` ``[E_loc, hidden, intermediate]`` (torchtitan's ``w2``; ``down_proj``).

    Under expert parallelism rank ``r`` of ``group`` owns the global experts
    ``[r * E_loc, (r + 1) * E_loc)`` (``expert_offset = r * E_loc``) and ``topk_idx`` holds global
    ids; ``group`` is a ProcessGroup or a 1-D DeviceMesh. ``ep_buffer`` (a
    :class:`deep_gemm_ext.EpBuffer` for ``group``) fixes the all-to-all capacity so that no call
    syncs with the host; without it every call finds the capacity with one all_gather.

    ``forward(x, topk_idx, topk_weights)`` takes ``x [..., hidden]``, ``topk_idx [..., top_k]``
    (int64/int32, -1 = unused slot) and ``topk_weights [..., top_k]`` (any float dtype; computed in
    fp32) and returns ``y`` shaped like ``x``. Under ``torch.autocast`` it computes in the
    autocast dtype (weights cast per call, gradients flow back to the stored weights).
    ``recipe``, ``activation_clamp``, ``backend`` and ``ep_buffer`` are passed to ``mega_moe_train`` on
    every call.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int, *, group=None,
                 recipe: str = "bf16", activation_clamp: float | None = None, backend: str = DEFAULT_BACKEND,
                 ep_buffer=None, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        num_experts, hidden, intermediate, top_k = (
            _positive_int(name, value) for name, value in (("num_experts", num_experts), ("hidden", hidden),
                                                           ("intermediate", intermediate), ("top_k", top_k)))
        if isinstance(group, DeviceMesh):  # its 1-D group; other objects need only size() and rank() here
            group = resolve_group(group)
        world, rank = _group_size_and_rank(group)
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} is not divisible by the group size {world}; "
                             f"every rank must own the same number of experts")
        # mega_moe_train's own checks, once, on empty meta tensors: a recipe, backend or clamp it
        # would reject fails here rather than at the first forward.
        num_local = num_experts // world

        # An fp64 module computes in fp64 (its clamp may exceed fp32's range); the rest as bf16 calls do.
        float_dtype = torch.float64 if dtype == torch.float64 else torch.bfloat16

        def meta(*shape, dtype=float_dtype):
            return torch.empty(shape, device="meta", dtype=dtype)

        validate_inputs(meta(0, hidden), meta(0, top_k, dtype=torch.int64), meta(0, top_k, dtype=torch.float32),
                        meta(num_local, 2 * intermediate, hidden), meta(num_local, hidden, intermediate),
                        recipe=recipe, activation_clamp=activation_clamp, backend=backend)

        self.num_experts = num_experts
        self.num_local_experts = num_local
        self.expert_offset = rank * self.num_local_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.top_k = top_k
        self.group = group
        self.recipe = recipe
        self.backend = backend
        self.ep_buffer = ep_buffer
        self.activation_clamp = None if activation_clamp is None else float(activation_clamp)
        factory = dict(device=device, dtype=dtype)
        self.l1_weights = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate, hidden, **factory))
        self.l2_weights = nn.Parameter(torch.empty(self.num_local_experts, hidden, intermediate, **factory))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """torchtitan's ``GroupedExperts.init_weights``: the gate projection (``w1``) gets a normal of
        std 0.02, the up (``w3``) and down (``w2``) projections std ``init_std``; all truncated at
        +-2 as ``nn.init.trunc_normal_`` does by default."""
        inter = self.intermediate
        l1, l2 = local_tensor(self.l1_weights), local_tensor(self.l2_weights)
        for view, std in ((l1[:, :inter], 0.02), (l1[:, inter:], init_std), (l2, init_std)):
            trunc_normal_fp32_(view, std)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        check_routed_inputs(x, topk_idx, topk_weights)
        if topk_idx.dim() < 1 or topk_idx.shape[-1] != self.top_k:
            raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}; expected its last dim to be "
                             f"top_k={self.top_k}")
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected its last dim to be hidden={self.hidden}")
        return experts_forward(x, topk_idx, topk_weights, self.l1_weights, self.l2_weights, checked=True,
                               group=self.group,
                               recipe=self.recipe, activation_clamp=self.activation_clamp, backend=self.backend,
                               ep_buffer=self.ep_buffer)

    def extra_repr(self) -> str:
        parts = [f"num_experts={self.num_experts}"]
        if self.num_local_experts != self.num_experts:
            parts.append(f"num_local_experts={self.num_local_experts}, expert_offset={self.expert_offset}")
        parts += [f"hidden={self.hidden}", f"intermediate={self.intermediate}", f"top_k={self.top_k}",
                  f"recipe={self.recipe!r}"]
        if self.activation_clamp is not None:
            parts.append(f"activation_clamp={self.activation_clamp}")
        if self.backend != DEFAULT_BACKEND:
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)
