"""torch.compile(fullgraph=True) over mega_moe_train and MegaMoE gives bit-equal results to eager,
forward and all gradients; torch.library.opcheck passes on both custom ops. CPU always, CUDA when
there is a GPU (bf16, the GPU path)."""
import pytest
import torch
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs

from conftest import requires_cuda

# (device, backend): on the GPU "auto" runs our SM90 kernels where they apply, "torch" torch._grouped_mm.
DEVICES = [
    pytest.param("cpu", "auto", id="cpu"),
    pytest.param("cuda", "auto", id="cuda-auto", marks=requires_cuda),
    pytest.param("cuda", "torch", id="cuda-torch", marks=requires_cuda),
]


def device_dtype(device):
    # The GPU path is bf16 only; fp32 on CPU keeps the comparison free of bf16 rounding noise.
    return torch.bfloat16 if device == "cuda" else torch.float32


def shapes(device):
    # (T, H, I, E, K): on the GPU H and I must be multiples of 8.
    return (300, 256, 128, 16, 4) if device == "cuda" else (37, 16, 8, 5, 3)


def grads_of(fn, inputs, dy):
    x, idx, w, l1, l2 = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, l1, l2)]
    y = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


def assert_bit_equal(eager, compiled):
    names = ("y", "dx", "dtopk_w", "dl1", "dl2")
    for name, a, b in zip(names, eager, compiled):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: compiled differs from eager (max |diff| {(a - b).abs().max()})"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device,backend", DEVICES)
@pytest.mark.parametrize("clamp", [None, 0.7])
@pytest.mark.parametrize("routing", ["uniform", "unused_slots"])
def test_compiled_function_bit_equal(device, backend, clamp, routing):
    T, H, I, E, K = shapes(device)
    inputs = make_inputs(T, H, I, E, K, routing=routing, device=device, dtype=device_dtype(device), seed=3)
    dy = torch.randn(T, H, device=device, dtype=device_dtype(device))

    def layer(x, idx, w, l1, l2):
        return dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp, backend=backend)

    eager = grads_of(layer, inputs, dy)
    compiled = grads_of(torch.compile(layer, fullgraph=True), inputs, dy)
    assert_bit_equal(eager, compiled)


@pytest.mark.parametrize("device,backend", DEVICES)
def test_compiled_module_bit_equal(device, backend):
    T, H, I, E, K = shapes(device)
    x, idx, w, _, _ = make_inputs(T, H, I, E, K, device=device, dtype=device_dtype(device), seed=4)
    torch.manual_seed(0)
    module = dge.MegaMoE(E, H, I, K, backend=backend, device=device, dtype=device_dtype(device))
    compiled = torch.compile(module, fullgraph=True)
    dy = torch.randn(T, H, device=device, dtype=device_dtype(device))
    results = []
    for fn in (module, compiled):
        xl = x.detach().clone().requires_grad_()
        wl = w.detach().clone().requires_grad_()
        y = fn(xl, idx, wl)
        results.append((y.detach(), *torch.autograd.grad(y, (xl, wl, module.l1_weights, module.l2_weights), dy)))
    assert_bit_equal(*results)


def test_compiled_dynamic_token_count():
    """One compiled graph serves several token counts (T is symbolic), each equal to eager."""
    def layer(x, idx, w, l1, l2):
        return dge.mega_moe_train(x, idx, w, l1, l2)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for T in (17, 40, 65):
        inputs = make_inputs(T, 16, 8, 5, 3, routing="zipf", dtype=torch.float32, seed=T)
        dy = torch.randn(T, 16)
        assert_bit_equal(grads_of(layer, inputs, dy), grads_of(compiled, inputs, dy))


class RecordOps(TorchDispatchMode):
    """Records the arguments of each deep_gemm_ext op as mega_moe_train's forward and backward call it."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "deep_gemm_ext":
            self.calls[func.name()] = (args, kwargs or {})
        return func(*args, **(kwargs or {}))


def recorded_calls(device, dtype, backend, num_tokens, routing, clamp):
    x, idx, w, l1, l2 = make_inputs(num_tokens, *shapes(device)[1:], routing=routing, device=device,
                                    dtype=dtype, seed=5)
    w = w.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    with RecordOps() as recorder:
        y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp, backend=backend)
        torch.autograd.grad(y, (x, w, l1, l2), torch.randn_like(y))
    return recorder.calls


def fresh(args, requires_grad):
    """Detached copies of the tensors in ``args`` (also inside the saved-tensor list)."""
    def copy(a):
        if isinstance(a, (list, tuple)):
            return [copy(t) for t in a]
        if isinstance(a, torch.Tensor):
            return a.detach().clone().requires_grad_(requires_grad and a.is_floating_point())
        return a
    return [copy(a) for a in args]


OPCHECK_CASES = [
    pytest.param("cpu", torch.float32, "auto", id="cpu-fp32"),
    pytest.param("cpu", torch.float64, "auto", id="cpu-fp64"),
    pytest.param("cuda", torch.bfloat16, "auto", id="cuda-bf16-auto", marks=requires_cuda),
    pytest.param("cuda", torch.bfloat16, "torch", id="cuda-bf16-torch", marks=requires_cuda),
]


@pytest.mark.parametrize("device,dtype,backend", OPCHECK_CASES)
@pytest.mark.parametrize("num_tokens,routing,clamp", [(37, "uniform", None), (37, "unused_slots", 0.7),
                                                      (1, "one_expert", None), (0, "uniform", None)])
def test_opcheck_both_ops(device, dtype, backend, num_tokens, routing, clamp):
    """opcheck on the exact arguments mega_moe_train passes to each op (recorded, not rebuilt)."""
    calls = recorded_calls(device, dtype, backend, num_tokens, routing, clamp)
    assert set(calls) == {"deep_gemm_ext::mega_moe_fwd", "deep_gemm_ext::mega_moe_bwd"}
    args, kwargs = calls["deep_gemm_ext::mega_moe_fwd"]
    opcheck(torch.ops.deep_gemm_ext.mega_moe_fwd.default, fresh(args, True), kwargs)
    args, kwargs = calls["deep_gemm_ext::mega_moe_bwd"]
    opcheck(torch.ops.deep_gemm_ext.mega_moe_bwd.default, fresh(args, False), kwargs)
