"""Eager calls with plain tensors run the layer through an autograd.Function, not the custom ops'
dispatcher layers (deep_gemm_ext.ops.call): the same forward and backward functions, so y and all
four gradients must equal the custom-op path's bit for bit; and every case that needs the
dispatcher (a dispatch mode, DGE_EAGER_CUSTOM_OP=1, torch.compile: tests/test_compile.py) takes it.
CPU always, CUDA (the SM90 path) when there is a GPU."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs

from conftest import requires_cuda

CASES = [
    pytest.param("cpu", torch.float32, (37, 16, 8, 5, 3), id="cpu"),
    pytest.param("cuda", torch.bfloat16, (300, 256, 128, 16, 4), id="cuda", marks=requires_cuda),
]


def _run(inputs, dy, clamp):
    x, idx, w, l1, l2 = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp)
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    return type(y.grad_fn).__name__, (y.detach(), *grads)


def _assert_same(a, b):
    for name, u, v in zip(("y", "dx", "dtopk_w", "dl1", "dl2"), a, b):
        assert torch.equal(u, v), f"{name} differs between the eager Function and the custom-op path"


@pytest.mark.parametrize("device,dtype,shape", CASES)
@pytest.mark.parametrize("routing,clamp,tokens", [("uniform", None, None), ("unused_slots", 0.7, None),
                                                  ("one_expert", None, None), ("uniform", None, 0)])
def test_eager_function_equals_custom_op(monkeypatch, device, dtype, shape, routing, clamp, tokens):
    T, H, I, E, K = shape
    T = T if tokens is None else tokens
    inputs = make_inputs(T, H, I, E, K, routing=routing, device=device, dtype=dtype, seed=11)
    dy = torch.randn(T, H, dtype=dtype, device=device)
    fn_name, eager = _run(inputs, dy, clamp)
    assert fn_name == "_EagerMegaMoEBackward", fn_name
    monkeypatch.setenv("DGE_EAGER_CUSTOM_OP", "1")
    op_name, op = _run(inputs, dy, clamp)
    assert op_name != fn_name, op_name
    _assert_same(eager, op)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.name()))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_takes_the_custom_op():
    inputs = make_inputs(20, 16, 8, 5, 3, device="cpu", dtype=torch.float32, seed=3)
    dy = torch.randn(20, 16)
    plain = _run(inputs, dy, None)[1]
    with _Count() as mode:
        name, seen = _run(inputs, dy, None)
    assert {"deep_gemm_ext::mega_moe_fwd", "deep_gemm_ext::mega_moe_bwd"} <= mode.ops, sorted(mode.ops)
    assert name != "_EagerMegaMoEBackward"
    _assert_same(plain, seen)


def test_module_parameters_take_the_eager_function():
    torch.manual_seed(0)
    moe = dge.MegaMoE(5, 16, 8, 3, dtype=torch.float32)
    x, idx, w, *_ = make_inputs(20, 16, 8, 5, 3, device="cpu", dtype=torch.float32, seed=4)
    y = moe(x, idx, w)
    assert type(y.grad_fn).__name__ == "_EagerMegaMoEBackward"


@pytest.mark.parametrize("custom_op", ["0", "1"])
def test_double_backward_raises(monkeypatch, custom_op):
    """The backward is not differentiable: differentiating it again raises (on either path), never a
    silently wrong second derivative; create_graph=True alone (for other parts of a graph) works."""
    monkeypatch.setenv("DGE_EAGER_CUSTOM_OP", custom_op)
    x, idx, w, l1, l2 = make_inputs(20, 16, 8, 5, 3, device="cpu", dtype=torch.float32, seed=5)
    y = dge.mega_moe_train(x, idx, w, l1, l2)
    (dx,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    assert torch.isfinite(dx).all()
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dx.sum(), x)


@pytest.mark.parametrize("custom_op", ["0", "1"])
def test_double_backward_of_a_linear_loss_raises(monkeypatch, custom_op):
    """A loss linear in y hands the backward a dy that does not require grad; dx still depends on x
    through the saved tensors, so differentiating dx again must raise, not return a second derivative
    that silently lacks that dependence (torch's once_differentiable lets this through)."""
    monkeypatch.setenv("DGE_EAGER_CUSTOM_OP", custom_op)
    x, idx, w, l1, l2 = make_inputs(20, 16, 8, 5, 3, device="cpu", dtype=torch.float32, seed=5)
    c = torch.randn(20, 16)
    (dx,) = torch.autograd.grad((dge.mega_moe_train(x, idx, w, l1, l2) * c).sum(), x, create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError):
        ((dx ** 2).sum() + dge.mega_moe_train(x, idx, w, l1, l2).sum()).backward()
    # With respect to each input alone, allow_unused included: an error, never a None.
    (dx,) = torch.autograd.grad((dge.mega_moe_train(x, idx, w, l1, l2) * c).sum(), x, create_graph=True)
    for target in (x, w, l1, l2):
        with pytest.raises(RuntimeError):
            torch.autograd.grad((dx ** 2).sum(), target, allow_unused=True, retain_graph=True)
    # Without create_graph the same gradient, bit for bit.
    (plain,) = torch.autograd.grad((dge.mega_moe_train(x, idx, w, l1, l2) * c).sum(), x)
    assert torch.equal(dx.detach(), plain)


@pytest.mark.parametrize("custom_op", ["0", "1"])
def test_activation_checkpointing_gives_the_same_gradients(monkeypatch, custom_op):
    """torch.utils.checkpoint (non-reentrant) over the layer: the recomputed forward's saved tensors
    serve the backward, on either path, with the gradients of the plain call bit for bit."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv("DGE_EAGER_CUSTOM_OP", custom_op)
    inputs = make_inputs(37, 16, 8, 5, 3, routing="unused_slots", device="cpu", dtype=torch.float32, seed=8)
    dy = torch.randn(37, 16)
    plain = _run(inputs, dy, 0.7)[1]
    x, idx, w, l1, l2 = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    y = checkpoint(lambda *a: dge.mega_moe_train(*a, activation_clamp=0.7), x, idx, w, l1, l2, use_reentrant=False)
    _assert_same(plain, (y.detach(), *torch.autograd.grad(y, (x, w, l1, l2), dy)))


def _small(seed=6):
    return make_inputs(20, 16, 8, 5, 3, device="cpu", dtype=torch.float32, seed=seed)


def test_meta_tensors_take_the_fake():
    y = dge.mega_moe_train(*(t.detach().to("meta") for t in _small()))
    assert y.device.type == "meta" and y.shape == (20, 16)


def test_jit_trace_records_the_custom_op():
    x, idx, w, l1, l2 = (t.detach() for t in _small())
    traced = torch.jit.trace(lambda *a: dge.mega_moe_train(*a), (x, idx, w, l1, l2), check_trace=False)
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert "deep_gemm_ext::mega_moe_fwd" in kinds and "prim::PythonOp" not in kinds, sorted(kinds)
    x2, idx2, w2, l12, l22 = (t.detach() for t in _small(seed=9))
    assert torch.equal(traced(x2, idx2, w2, l12, l22), dge.mega_moe_train(x2, idx2, w2, l12, l22))


def test_compiled_autograd_sees_one_backward_op():
    """A forward run eagerly (the autograd.Function), its backward under compiled autograd: the
    traced backward holds the custom backward op, not the layer's Python, and equals eager."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    inputs = _small()
    dy = torch.randn(20, 16)
    plain = _run(inputs, dy, None)[1]
    x, idx, w, l1, l2 = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    y = dge.mega_moe_train(x, idx, w, l1, l2)
    assert type(y.grad_fn).__name__ == "_EagerMegaMoEBackward"
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return counter(gm, example_inputs)

    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
        grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    assert any("mega_moe_bwd" in s for s in seen), seen
    _assert_same(plain, (y.detach(), *grads))


@pytest.mark.parametrize("custom_op", ["0", "1"])
def test_forward_mode_ad_raises(monkeypatch, custom_op):
    import torch.autograd.forward_ad as fwAD

    monkeypatch.setenv("DGE_EAGER_CUSTOM_OP", custom_op)
    x, idx, w, l1, l2 = _small()
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        dge.mega_moe_train(fwAD.make_dual(x.detach(), torch.ones_like(x)), idx, w, l1, l2)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "grad", "vjp", "vmap"])
def test_functorch_transforms_raise(transform):
    """The op has no forward-AD, functorch-grad or batching rule: each transform raises an error that
    names it (jvp used to return zero tangents silently)."""
    x, idx, w, l1, l2 = (t.detach() for t in _small())

    def f(z):
        return dge.mega_moe_train(z, idx, w, l1, l2)

    run = {"jvp": lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
           "jacfwd": lambda: torch.func.jacfwd(f)(x),
           "grad": lambda: torch.func.grad(lambda z: f(z).sum())(x),
           "vjp": lambda: torch.func.vjp(f, x),
           "vmap": lambda: torch.func.vmap(f)(x[None])}[transform]
    name = {"jacfwd": "jvp", "vjp": "grad"}.get(transform, transform)
    with pytest.raises(NotImplementedError, match=f"torch.func.{name}"):
        run()


def test_functionalize_runs_the_layer():
    x, idx, w, l1, l2 = (t.detach() for t in _small())
    y = torch.func.functionalize(lambda z: dge.mega_moe_train(z, idx, w, l1, l2))(x)
    assert torch.equal(y, dge.mega_moe_train(x, idx, w, l1, l2))
