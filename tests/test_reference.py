"""The contract itself: reference vs a naive per-token loop, and the glue's hand-written backward."""
import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext.reference import reference_forward, reference_forward_ep, swiglu, upcast
from deep_gemm_ext.testing import ROUTINGS, make_inputs, rel_err


def naive_per_token(x, idx, w, l1, l2, clamp):
    y = torch.zeros(x.shape[0], l2.shape[1], dtype=x.dtype)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            h = l1[e] @ x[t]
            g, u = h[: l1.shape[1] // 2], h[l1.shape[1] // 2:]
            c = float("inf") if clamp is None else clamp
            act = torch.nn.functional.silu(torch.clamp(g, max=c)) * torch.clamp(u, -c, c)
            y[t] += w[t, k] * (l2[e] @ act)
    return y


@pytest.mark.parametrize("clamp", [None, 0.7])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_reference_matches_naive_loop(routing, clamp):
    x, idx, w, l1, l2 = upcast(*make_inputs(19, 16, 12, 5, 3, routing=routing, requires_grad=False))
    ref = reference_forward(x, idx, w, l1, l2, clamp)
    assert torch.allclose(ref, naive_per_token(x, idx, w, l1, l2, clamp), rtol=1e-12, atol=1e-12)


def test_reference_ep_equals_single_rank():
    world, e_loc = 3, 2
    x, idx, w, l1, l2 = upcast(*make_inputs(10, 8, 6, world * e_loc, 2, requires_grad=False))
    full = reference_forward(x, idx, w, l1, l2)
    xs, idxs, ws = x.chunk(2), idx.chunk(2), w.chunk(2)
    ys = reference_forward_ep(xs, idxs, ws, l1.chunk(world), l2.chunk(world))
    assert torch.allclose(torch.cat(ys), full, atol=1e-12)


def test_swiglu_clamp_semantics():
    h = torch.tensor([[3.0, -0.5, 5.0, -4.0]], dtype=torch.float64)  # g = [3, -.5], u = [5, -4]
    out = swiglu(h, 2.0)
    expected = torch.nn.functional.silu(torch.tensor([2.0, -0.5], dtype=torch.float64)) * torch.tensor([2.0, -2.0])
    assert torch.allclose(out[0], expected)


@pytest.mark.parametrize("clamp", [None, 0.3])
def test_gradcheck_reference(clamp):
    x, idx, w, l1, l2 = make_inputs(5, 4, 3, 3, 2, routing="unused_slots", dtype=torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda *a: reference_forward(*a[:2], a[2], a[3], a[4], clamp),
                                     (x, idx, w.double().detach().requires_grad_(), l1, l2))


@pytest.mark.parametrize("clamp", [None, 0.3])
@pytest.mark.parametrize("routing", ["uniform", "unused_slots", "one_expert"])
def test_gradcheck_glue(routing, clamp):
    x, idx, w, l1, l2 = make_inputs(6, 4, 3, 3, 2, routing=routing, dtype=torch.float64, seed=2)
    w = w.double().detach().requires_grad_()
    fn = lambda x, w, l1, l2: dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, l1, l2))


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 130])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("clamp", [None, 1.0])
def test_cpu_path_matches_fp64_reference(num_tokens, routing, clamp):
    """The CPU path (fp32 math, bf16 in/out) against the fp64 reference, forward and all grads."""
    x, idx, w, l1, l2 = make_inputs(num_tokens, 32, 16, 6, 4, routing=routing)
    y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp)
    assert y.dtype == x.dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, l1, l2), dy)
    if num_tokens == 0:
        assert all(g.shape == p.shape and float(g.abs().sum()) == 0 for g, p in zip(grads, (x, w, l1, l2)))
        return
    rx, rw, rl1, rl2 = (t.detach().double().requires_grad_() for t in (x, w, l1, l2))
    ref = reference_forward(rx, idx, rw, rl1, rl2, clamp)
    if ref.requires_grad:
        ref_grads = torch.autograd.grad(ref, (rx, rw, rl1, rl2), dy.double(), allow_unused=True)
    else:  # every slot unused: nothing depends on the inputs
        ref_grads = (None,) * 4
    assert rel_err(y, ref) < 1e-2
    for name, g, r, p in zip(("dx", "dtopk_w", "dl1", "dl2"), grads, ref_grads, (x, w, l1, l2)):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        assert not g.isnan().any(), name
        if r is None or float(r.norm()) == 0:
            assert float(g.abs().max()) == 0, name
        else:
            assert rel_err(g, r) < 1e-2, (name, rel_err(g, r))


@pytest.mark.parametrize("routing", ["uniform", "unused_slots", "one_expert"])
def test_baselines_match_reference(routing):
    from deep_gemm_ext.baselines import grouped_mm_moe, hf_loop_moe

    x, idx, w, l1, l2 = make_inputs(23, 16, 8, 5, 3, routing=routing, dtype=torch.float64, seed=4)
    ref = reference_forward(x, idx, w.double(), l1, l2, 0.8)
    ref_grads = torch.autograd.grad(ref, (x, l1, l2), torch.ones_like(ref))
    for fn in (grouped_mm_moe, hf_loop_moe):
        y = fn(x, idx, w.double(), l1, l2, 0.8)
        assert rel_err(y, ref) < 1e-12, fn.__name__
        grads = torch.autograd.grad(y, (x, l1, l2), torch.ones_like(y))
        assert all(rel_err(g, r) < 1e-12 for g, r in zip(grads, ref_grads)), fn.__name__
