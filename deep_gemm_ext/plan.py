"""The plan: every decision about how one call of the layer runs, made once, in one place.

``resolve(...)`` (with ``resolve_exchange`` for ``group``) reads the ``backend`` / ``recipe`` / ``group`` arguments, the device's capability and
the ``DGE_*`` knobs (through :mod:`deep_gemm_ext._env`) and returns a :class:`Plan`: which GEMM
provider runs the grouped GEMMs, under which precision recipe, over which token exchange, which
steps are fused into the GEMMs, and the pool's row alignment. The layer (:mod:`deep_gemm_ext.layer`)
and everything below it take the plan and decide nothing themselves: this is the only module that
compares backend / recipe names or reads the environment for the layer. (Diagnostics are read
where they act, through _env like every knob: ``DGE_PRINT_CONFIGS`` at each GEMM launch, the JIT
compiler's ``DGE_JIT_*`` when it compiles.)

A plan travels through the custom ops as a short string (``Plan.encode`` / ``decode``), so the fake
implementations, ``setup_context`` and the backward all see the decisions of the forward.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _env
from . import comm
from .comm.all_to_all import default_ep_buffer
from .providers import PROVIDERS, GemmProvider, ScatterSlots
from .recipes import RECIPES as _RECIPE_OBJECTS
from .recipes import Recipe
from .recipes.fp8 import FP8_BLOCK

try:
    from . import jit_kernels as _jit_kernels
except ImportError:  # no cuda-python: the JIT kernels are never used
    _jit_kernels = None

#: Precision recipes of the public API.
RECIPES = ("bf16", "fp8")
BACKENDS = ("auto", "torch", "deep_gemm")
DEFAULT_BACKEND = "auto"
#: Recipes each backend runs; fp8 (1x128 activation / 128x128 weight scales) is upstream's today.
BACKEND_RECIPES = {"auto": RECIPES, "torch": RECIPES, "deep_gemm": RECIPES}
#: Row alignment torch._grouped_mm needs on SM90 (16-byte strides and TMA boxes of bf16 rows).
_GPU_DIM_MULTIPLE = 8
#: torch._grouped_mm refuses more groups than this.
GROUPED_MM_MAX_GROUPS = 1024

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Plan:
    """How one call runs. Fields are plain values so the plan encodes to a string losslessly.

    provider          GEMM provider: "sm90" (our kernels), "grouped_mm" (torch), "loop" (experts one by
                      one, the CPU reference path), "deep_gemm" (upstream's kernels)
    recipe            "bf16" or "fp8"
    exchange          token exchange between ranks: "local" (all experts on this rank) or
                      "all_to_all:<group>:<E_loc>:<capacity>:<x|fp8>" or
                      "symmetric:<buffer id>:<E_loc>:<capacity>:<x|fp8>" (deep_gemm_ext.comm; "fp8":
                      x's rows travel in e4m3 with 1x128 scales, under recipe="fp8")
    align             rows per expert group of the pool
    compute_dtype     dtype of the pool, h and the GEMMs
    jit_routing       routing metadata from the JIT kernel (else torch ops)
    jit_elementwise   gather / combine / SwiGLU in JIT kernels (else torch ops)
    gather_x          the L1 forward GEMM reads x's rows itself, with this loader ("cp_async"; the forward then
                      saves x); "" builds a pool of x first and saves it for dW1
    gather_backward   the backward builds no pools of dy and x: every backward operand is quantized by a kernel
                      that gathers the token rows (needs gather_x; fp8 weight gradients on a provider whose fp8
                      quantizers gather, the sm90 one; DGE_FUSED_GATHER_BACKWARD=0 turns it off). bf16 weight
                      gradients always read pools gathered once
    combine_epilogue  the L2 forward and L1 dgrad GEMMs write top-k slot order (reduced by combine_slots)
    fp8_wgrad         under the fp8 recipe, the weight gradients' operands: "fp8" (column-quantized) or "bf16"
                      (DGE_FP8_WGRAD; unset: "bf16" on the sm90 provider, "fp8" on the others)
    fp8_rows          under the fp8 recipe, the layer hands the fp8 GEMMs 1x128-quantized rows made where they
                      cost least: act by the SwiGLU forward (no bf16 act), dh by the SwiGLU backward (besides
                      the bf16 dh), dy's pool rows quantized per token and gathered (providers that take
                      Fp8Rows)
    fp8_cols          with fp8_rows and fp8 weight gradients on a provider that takes Fp8Cols: the SwiGLU backward
                      also writes dh and act_w quantized 128x1 down their columns and transposed (the weight
                      gradients' operands) in the same pass, and no bf16 dh or act_w
    check_ids         check topk_idx on the host when not capturing a CUDA graph (else, on a GPU, a
                      device-side assertion)
    ep_overlap        the symmetric exchange's dispatch pulls x's rows on a side stream while the L1 GEMM
                      runs, waiting tile by tile for its rows' source ranks (DGE_EP_OVERLAP; bf16 rows and x,
                      the sm90 provider with the cp.async gather; same bits as without)
    """

    provider: str
    recipe: str = "bf16"
    exchange: str = "local"
    align: int = 1
    compute_dtype: str = "float32"
    jit_routing: bool = False
    jit_elementwise: bool = False
    gather_x: str = ""
    gather_backward: bool = False
    combine_epilogue: bool = False
    check_ids: bool = True
    fp8_wgrad: str = "fp8"
    fp8_rows: bool = False
    fp8_cols: bool = False
    ep_overlap: bool = False

    # -- the parts ------------------------------------------------------------------------------

    @property
    def gemms(self) -> GemmProvider:
        return PROVIDERS[self.provider]

    @property
    def precision(self) -> Recipe:
        return _precision(self.recipe, self.fp8_wgrad)

    @property
    def tokens(self):
        """The token exchange (:mod:`deep_gemm_ext.comm`)."""
        return comm.exchange(self.exchange)

    @property
    def saves_x_pool(self) -> bool:
        """The forward saves x's pool for dW1 (built before the L1 GEMM), not x's rows."""
        return not self.gather_x

    @property
    def exchanges_tokens(self) -> bool:
        """Tokens travel between ranks (expert parallelism): dispatch's outputs are new tensors."""
        return self.exchange != "local"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.compute_dtype]

    @property
    def kernels(self):
        """The JIT kernel module for the elementwise steps, or None (torch ops)."""
        return _jit_kernels_module() if self.jit_elementwise else None

    @property
    def routing_kernels(self):
        return _jit_kernels_module() if self.jit_routing else None

    # -- string form ----------------------------------------------------------------------------

    def encode(self) -> str:
        return ";".join(f"{f.name}={_encode_value(getattr(self, f.name))}" for f in dataclasses.fields(self))

    @staticmethod
    def decode(text: str) -> "Plan":
        return _decode(text)

    def describe(self) -> str:
        """One line for people: which provider and which fusions run."""
        names = {"sm90": "our SM90 grouped GEMMs", "grouped_mm": "torch._grouped_mm",
                 "loop": "a loop over experts", "deep_gemm": "DeepGEMM's grouped GEMMs"}
        parts = [f"{names[self.provider]} ({self.recipe}, {self.compute_dtype})",
                 "elementwise steps in " + ("JIT kernels" if self.jit_elementwise else "torch ops")]
        fusions = [name for name, on in (("L1 gathers x", self.gather_x),
                                         ("backward gathers", self.gather_backward),
                                         ("combine epilogues", self.combine_epilogue),
                                         ("act and dh quantized in the SwiGLU kernels, dy per token", self.fp8_rows),
                                         ("dh and act_w column-quantized in the SwiGLU backward", self.fp8_cols),
                                         ("dispatch overlapped with the L1 GEMM", self.ep_overlap)) if on]
        if fusions:
            parts.append(", ".join(fusions))
        if self.exchange != "local":
            how = "symmetric memory" if self.exchange.startswith("symmetric:") else "all-to-all"
            parts.append(f"tokens exchanged by {how}" + (" (fp8 rows)" if self.exchange.endswith(":fp8") else ""))
        return "; ".join(parts)


def _encode_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> Plan:
    values = dict(item.split("=", 1) for item in text.split(";"))
    kwargs = {}
    for f in dataclasses.fields(Plan):
        raw = values[f.name]
        kwargs[f.name] = (raw == "1") if f.type in (bool, "bool") else int(raw) if f.type in (int, "int") else raw
    return Plan(**kwargs)


@functools.lru_cache(maxsize=None)
def _precision(recipe: str, fp8_wgrad: str) -> Recipe:
    base = _RECIPE_OBJECTS[recipe]
    return dataclasses.replace(base, fp8_wgrad=fp8_wgrad == "fp8") if base.fp8 else base


# ---------------------------------------------------------------------------------------------
# What the device and the environment offer.


def _jit_kernels_module():
    return _jit_kernels


def jit_available(device: torch.device) -> bool:
    """Our JIT kernels serve this device: an SM90 GPU with a CUDA compiler, and DGE_DISABLE_JIT unset."""
    if device.type != "cuda" or not _env.use_jit_kernels():
        return False
    module = _jit_kernels_module()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return module is not None and module.available(index)


def sm90_gemm_supported(hidden: int, intermediate: int) -> bool:
    """Shapes our SM90 grouped GEMMs take: 128-row weight-gradient tiles over H and 2I, and 64-deep
    K blocks of the dgrad GEMMs (K = H and K = 2I)."""
    return hidden % 128 == 0 and (2 * intermediate) % 128 == 0


class ShapeFacts(NamedTuple):
    """What the plan needs to know of the layer's sizes (plain bools, so that the resolution is a
    constant of a compiled graph even where torch.compile treats the sizes as symbols)."""
    sm90_gemm: bool          # our SM90 GEMMs take (hidden, intermediate)
    grouped_mm_groups: bool  # torch._grouped_mm takes this many experts


def shape_facts(hidden: int, intermediate: int, num_experts: int) -> ShapeFacts:
    # `True if ... else False`: under torch.compile a size comparison is specialized (guarded) here.
    return ShapeFacts(
        sm90_gemm=True if sm90_gemm_supported(hidden, intermediate) else False,
        grouped_mm_groups=True if num_experts <= GROUPED_MM_MAX_GROUPS else False,
    )


def choose_provider(device: torch.device, dtype: torch.dtype, facts: ShapeFacts, backend: str, recipe: str) -> str:
    """Who runs the grouped GEMMs for these inputs under ``backend`` and ``recipe`` (the torch
    providers run fp8 as its emulation)."""
    if not (device.type == "cuda" and dtype == torch.bfloat16):
        return "loop"
    if backend == "deep_gemm":
        return "deep_gemm"
    major, minor = torch.cuda.get_device_capability(device)
    if (backend == "auto" and (major, minor) == (9, 0) and facts.sm90_gemm and jit_available(device)
            and recipe in PROVIDERS["sm90"].recipes):
        return "sm90"
    return "grouped_mm" if major >= 9 and facts.grouped_mm_groups else "loop"


def resolve_exchange(x: torch.Tensor, topk_idx: torch.Tensor, l1_weights: torch.Tensor, group=None,
                     ep_buffer=None, recipe: str = "bf16", topk_weights: torch.Tensor | None = None) -> str:
    """The token exchange of one call (``Plan.exchange``): ``"local"`` without a group or with a
    group of one rank, else the all-to-all over ``group`` (already resolved to a ProcessGroup) with
    ``ep_buffer``'s capacity, or the default buffer's (one all_gather and a host sync per call).
    Under ``recipe="fp8"`` dispatch sends x's rows in fp8: the L1 forward quantizes them 1x128 along
    H anyway, and quantizing at the source is that same quantization point (comm.all_to_all)."""
    if group is None or group.size() == 1:
        return "local"
    # The transport follows the buffer: EpBuffer -> all_to_all, SymmetricEpBuffer -> symmetric.
    if ep_buffer is None:
        # The call's collective also compares what every rank must pass alike, and the ids where the host
        # checks them (so that every rank raises, not only the one with bad ids).
        num_local = l1_weights.shape[0]
        host_check = _env.check_ids()
        bad_ids = ids_error = None
        if host_check or (host_check is None and not topk_idx.is_cuda):
            from .validation import check_expert_ids, ids_out_of_range

            num_experts = group.size() * num_local
            bad_ids = ids_out_of_range(topk_idx, num_experts).any()

            def ids_error():
                check_expert_ids(topk_idx, num_experts)
        ep_buffer = default_ep_buffer(group, x.shape[0], x.shape[1], topk_idx.shape[1], x.dtype, x.device,
                                      num_local_experts=num_local,
                                      weight_dtype=None if topk_weights is None else topk_weights.dtype,
                                      fp8_rows=recipe == "fp8", bad_ids=bad_ids, ids_error=ids_error)
    return ep_buffer.exchange_spec(l1_weights.shape[0], fp8_rows=recipe == "fp8")


def resolve_encoded(x: torch.Tensor, l1_weights: torch.Tensor, *, backend: str = "auto", recipe: str = "bf16",
                    exchange: str = "local") -> str:
    """The plan for one call, as the string the custom ops take (arguments already validated by
    :func:`deep_gemm_ext.validation.validate_inputs`; ``exchange`` from :func:`resolve_exchange`).
    Under torch.compile it is a constant of the graph."""
    num_experts, two_i, hidden = l1_weights.shape
    facts = shape_facts(hidden, two_i // 2, num_experts)
    return _resolve_encoded(x.device.type, -1 if x.device.index is None else x.device.index, x.dtype, *facts,
                            backend, recipe, exchange)


def resolve(x: torch.Tensor, l1_weights: torch.Tensor, *, backend: str = "auto", recipe: str = "bf16",
            exchange: str = "local") -> Plan:
    """:func:`resolve_encoded`, decoded."""
    return Plan.decode(resolve_encoded(x, l1_weights, backend=backend, recipe=recipe, exchange=exchange))


# Resolved plans by their arguments and the functions the resolution asks (replaced ones resolve anew),
# each with the environment variables it read: a hit whose variables all read the same again is the
# same plan, so a warm call reads a dozen variables instead of resolving (~0.2 ms of host time).
_RESOLVED: dict = {}
_RESOLVED_MAX = 256


def clear_cache() -> None:
    """Forget the resolved plans: for code that replaces what the resolution reads at run time other than
    the environment and this module's functions (a provider's class attributes, in tests)."""
    _RESOLVED.clear()
    _CALLS.clear()


# One-rank calls of mega_moe_train by everything their argument checks and plan read of the arguments
# but the data (type, shape, dtype, device, contiguity of each tensor; recipe, clamp, backend): the checks
# passed, and the plan, valid while the variables they read read the same.
_CALLS: dict = {}


def call_key(tensors: tuple, recipe, activation_clamp, backend):
    """The key of a one-rank call (:func:`cached_call`), or None where it is not cached: under
    torch.compile (a graph's plan is a constant of the graph), the DeepGEMM backend (its availability
    is not an argument), or arguments that are not what the checks pass."""
    if backend == "deep_gemm" or torch.compiler.is_compiling():
        return None
    try:
        key = (tuple([(type(t), t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors]),
               type(recipe), recipe, type(activation_clamp), activation_clamp, type(backend), backend,
               choose_provider, jit_available, _jit_kernels_module)
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def cached_call(key) -> str | None:
    """The plan of a call whose arguments passed the checks before with this :func:`call_key`, or None."""
    hit = _CALLS.get(key)
    if hit is not None and _env.unchanged(hit[0]):
        return hit[1]
    return None


def remember_call(key, reads: dict, encoded: str) -> None:
    if len(_CALLS) >= _RESOLVED_MAX:
        _CALLS.clear()
    _CALLS[key] = (tuple(reads.items()), encoded)


@torch._dynamo.assume_constant_result
def _resolve_encoded(device_type: str, device_index: int, dtype: torch.dtype, sm90_gemm: bool,
                     grouped_mm_groups: bool, backend: str, recipe: str, exchange: str) -> str:
    args = (device_type, device_index, dtype, sm90_gemm, grouped_mm_groups, backend, recipe, exchange)
    key = (args, choose_provider, jit_available, _jit_kernels_module)
    hit = _RESOLVED.get(key)
    if hit is not None and _env.unchanged(hit[0]):
        _env.note(hit[0])  # an outer recording (cached_call's) depends on them too
        return hit[1]
    with _env.recording() as reads:
        encoded = _resolve_uncached(*args)
    if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
    _RESOLVED[key] = (tuple(reads.items()), encoded)
    return encoded


def _resolve_uncached(device_type: str, device_index: int, dtype: torch.dtype, sm90_gemm: bool,
                      grouped_mm_groups: bool, backend: str, recipe: str, exchange: str) -> str:
    device = torch.device(device_type) if device_index < 0 else torch.device(device_type, device_index)
    facts = ShapeFacts(sm90_gemm, grouped_mm_groups)
    provider = choose_provider(device, dtype, facts, backend, recipe)
    gemms = PROVIDERS[provider]
    # Weight gradients under fp8: bf16 on our SM90 provider unless asked (its fp8 K-grouped GEMM is not
    # yet measured to be faster there).
    wgrad = _env.fp8_wgrad() or ("bf16" if provider == "sm90" else "fp8")
    precision = _precision(recipe, wgrad)
    compute = {torch.float64: "float64", torch.bfloat16: "bfloat16"}.get(gemms.compute_dtype(dtype), "float32")
    jit = jit_available(device)
    gather_mode = _env.fused_gather()
    gather_x = gather_mode if (gather_mode is not None and gemms.gathers) else ""
    gather_backward = _env.fused_gather_backward()
    fp8_rows = bool(precision.fp8 and gemms.takes_fp8_rows and jit and compute == "bfloat16")
    plan = Plan(
        provider=provider,
        recipe=recipe,
        exchange=exchange,
        align=math.lcm(gemms.row_alignment, precision.row_alignment),
        compute_dtype=compute,
        jit_routing=jit,
        jit_elementwise=jit and compute == "bfloat16",
        gather_x=gather_x,
        gather_backward=bool(gather_x) and gather_backward is not False and bool(
            precision.fp8 and precision.fp8_wgrad and gemms.fp8_quantizers_gather),
        combine_epilogue=gemms.supports(precision, ScatterSlots) and _env.fused_combine(),
        # On a GPU the host check costs a sync per forward: by default a device-side assertion does it.
        check_ids=_env.check_ids() if _env.check_ids() is not None else device.type != "cuda",
        fp8_wgrad=wgrad,
        fp8_rows=fp8_rows,
        fp8_cols=bool(fp8_rows and precision.fp8_wgrad and gemms.takes_fp8_cols),
        ep_overlap=ep_overlap_applies(_env.ep_overlap(), exchange, provider, recipe, dtype, gather_x),
    )
    return plan.encode()


def ep_overlap_applies(requested: bool, exchange: str, provider: str, recipe: str, dtype: torch.dtype,
                       gather_x: str) -> bool:
    """Whether DGE_EP_OVERLAP (``requested``) takes effect: the symmetric exchange with bf16 rows,
    bf16 x, the sm90 provider under the bf16 recipe and the cp.async gather of the L1 GEMM (whose
    waiting twin follows the arriving rows). Elsewhere the layer runs as without it."""
    return (requested and exchange.startswith("symmetric:") and exchange.endswith(":x") and provider == "sm90"
            and recipe == "bf16" and dtype == torch.bfloat16 and gather_x == "cp_async")


# ---------------------------------------------------------------------------------------------
# Argument checks of the options (the tensors are checked in validation.py).


def unsupported_shape_reason(hidden: int, intermediate: int, recipe: str = "bf16",
                             device_type: str = "cuda") -> str | None:
    """Why ``(hidden, intermediate)`` cannot run under ``recipe`` on ``device_type`` (a device type or any
    device spelling: ``"cuda"``, ``"cuda:0"``, a ``torch.device``); None if it can."""
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if value is None or isinstance(value, (bool, float, str, bytes)):  # ints, traced and symbolic sizes pass
            raise TypeError(f"{name}={value!r}: expected an int")
    if isinstance(device_type, str) and device_type not in ("cuda", "cpu", "meta"):
        try:
            device_type = torch.device(device_type).type
        except RuntimeError:
            raise ValueError(f"device_type={device_type!r}: expected a device type such as 'cuda' or 'cpu'") from None
    elif isinstance(device_type, torch.device):
        device_type = device_type.type
    elif not isinstance(device_type, str):
        raise TypeError(f"device_type={device_type!r}: expected a str or a torch.device")
    if recipe not in RECIPES:
        return f"recipe={recipe!r} is not supported; expected one of {RECIPES}"
    if hidden <= 0 or intermediate <= 0:
        return f"hidden={hidden} and intermediate={intermediate} must be positive"
    if recipe == "fp8":
        # The weights are quantized in 128x128 blocks over H, I and 2I.
        for name, value in (("hidden", hidden), ("intermediate", intermediate)):
            if value % FP8_BLOCK:
                return (f"{name}={value} is not a multiple of {FP8_BLOCK}, which recipe='fp8' needs for its "
                        f"128x128 weight blocks")
    if device_type == "cuda":
        for name, value in (("hidden", hidden), ("intermediate", intermediate)):
            if value % _GPU_DIM_MULTIPLE:
                return (f"{name}={value} is not a multiple of {_GPU_DIM_MULTIPLE}, which the bf16 GPU "
                        f"path needs for 16-byte aligned rows")
    return None


def check_options(backend, recipe) -> None:
    """``backend`` and ``recipe`` name something this package runs."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
    recipes = BACKEND_RECIPES[backend]
    if not isinstance(recipe, str) or recipe not in recipes:
        raise ValueError(f"recipe={recipe!r} is not supported by backend={backend!r}; expected one of {recipes}")


def shape_reason_for_backend(backend: str, recipe: str, device: torch.device, hidden: int,
                             intermediate: int) -> str | None:
    """:func:`unsupported_shape_reason`, then what the chosen backend itself needs (DeepGEMM must be
    importable and the GPU an SM90 / SM100 one); raises DeepGEMM's install hint when it is missing."""
    reason = unsupported_shape_reason(hidden, intermediate, recipe, device.type)
    if reason is None and backend == "deep_gemm":
        deepgemm = PROVIDERS["deep_gemm"]
        if device.type == "meta":
            # MegaMoE and MegaGroupedExperts check their options on meta tensors: the device is each
            # call's, but a missing DeepGEMM is known now.
            deepgemm.require()
            reason = deepgemm.unsupported_shape_reason(hidden, intermediate, _RECIPE_OBJECTS[recipe])
        elif device.type != "cuda":
            reason = f"backend='deep_gemm' needs CUDA tensors, got x on {device}"
        elif not deepgemm.is_available():
            deepgemm.require()  # raises RuntimeError saying how to install DeepGEMM
            reason = (f"backend='deep_gemm' needs an SM90 or SM100 GPU, got compute capability "
                      f"{torch.cuda.get_device_capability(device)}")
        else:
            reason = deepgemm.unsupported_shape_reason(hidden, intermediate, _RECIPE_OBJECTS[recipe])
    return reason
