"""MegaGroupedExperts against torchtitan's MoE experts math, written out here in fp64: for each
token t and slot k with expert e and score s,
    inp = s * x[t] if score_before_experts else x[t]
    out = w2[e] @ (silu(w1[e] @ inp) * (w3[e] @ inp))
    y[t] += out if score_before_experts else s * out
(torchtitan's MoE rounds the scaled input to x's dtype; in fp64 that is exact). Outputs and the
gradients of x, the scores, w1, w2 and w3; torchtitan's parameter names and shapes (state dicts
load unchanged) and init_weights; a bf16 GPU check."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_routing, rel_err

from conftest import requires_cuda

H, I, E, K = 24, 16, 6, 2


def torchtitan_experts_reference(x, idx, scores, w1, w2, w3, score_before_experts):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            inp = x[t] * scores[t, k] if score_before_experts else x[t]
            out = w2[e] @ (F.silu(w1[e] @ inp) * (w3[e] @ inp))
            y[t] = y[t] + (out if score_before_experts else scores[t, k] * out)
    return y


def make_module(score_before_experts, dtype=torch.float64, device="cpu", seed=0):
    torch.manual_seed(seed)
    module = dge.MegaGroupedExperts(H, I, E, score_before_experts, device=device, dtype=dtype)
    module.init_weights(0.2)
    with torch.no_grad():  # the default 0.02 of w1 would make the gate nearly linear
        module.w1.normal_(0, 0.3)
    return module


@pytest.mark.parametrize("score_before_experts", [True, False])
@pytest.mark.parametrize("routing", ["uniform", "zipf", "one_expert", "empty_experts", "unused_slots"])
@pytest.mark.parametrize("num_tokens", [0, 1, 19])
def test_matches_torchtitan_math_and_gradients(score_before_experts, routing, num_tokens):
    module = make_module(score_before_experts)
    gen = torch.Generator().manual_seed(num_tokens)
    idx = make_routing(num_tokens, E, K, routing, generator=gen)
    x = torch.randn(num_tokens, H, dtype=torch.float64, generator=gen, requires_grad=True)
    scores = torch.rand(num_tokens, K, dtype=torch.float64, generator=gen).add_(0.1).requires_grad_()
    params = (module.w1, module.w2, module.w3)
    y = module(x, idx, scores)
    y_ref = torchtitan_experts_reference(x, idx, scores, *params, score_before_experts)
    assert y.shape == (num_tokens, H) and y.dtype == torch.float64
    assert torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12), rel_err(y, y_ref)
    if num_tokens == 0:
        return
    dy = torch.randn(num_tokens, H, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(y, (x, scores, *params), dy, allow_unused=True)
    want = torch.autograd.grad(y_ref, (x, scores, *params), dy, allow_unused=True)
    for name, g, w in zip(("dx", "d scores", "d w1", "d w2", "d w3"), got, want):
        w = torch.zeros_like(g) if w is None else w  # no slot reached these
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12), (name, rel_err(g, w))


def test_the_two_score_placements_differ():
    """Not one contract under two names: with scores != 1 the experts see different inputs."""
    x = torch.randn(8, H, dtype=torch.float64)
    idx = make_routing(8, E, K, "uniform", generator=torch.Generator().manual_seed(1))
    scores = torch.full((8, K), 0.3, dtype=torch.float64)
    before, after = make_module(True), make_module(False)
    assert not torch.allclose(before(x, idx, scores), after(x, idx, scores))


def test_leading_dimensions_and_fp32():
    module = make_module(True, dtype=torch.float32)
    x = torch.randn(2, 5, H)
    idx = make_routing(10, E, K, "uniform", generator=torch.Generator().manual_seed(2)).view(2, 5, K)
    scores = torch.rand(2, 5, K)
    y = module(x, idx, scores)
    assert y.shape == x.shape and y.dtype == torch.float32
    ref = torchtitan_experts_reference(x.double().view(10, H), idx.view(10, K), scores.double().view(10, K),
                                       module.w1.double(), module.w2.double(), module.w3.double(), True)
    assert rel_err(y.view(10, H), ref) < 1e-5


def test_parameters_and_state_dict_are_torchtitans():
    module = dge.MegaGroupedExperts(H, I, E)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    assert shapes == {"w1": (E, I, H), "w2": (E, H, I), "w3": (E, I, H)}
    assert module.num_experts == E and module.score_before_experts is True
    checkpoint = {name: torch.randn(shape) for name, shape in shapes.items()}
    module.load_state_dict(checkpoint)
    assert all(torch.equal(module.state_dict()[name], t) for name, t in checkpoint.items())


def test_init_weights_like_torchtitan():
    module = dge.MegaGroupedExperts(256, 128, 8)
    module.init_weights(init_std=0.006)
    for name, std in (("w1", 0.02), ("w2", 0.006), ("w3", 0.006)):
        p = getattr(module, name)
        assert abs(p.std().item() - std) < 0.05 * std and p.abs().max() <= 2.0, name


def test_argument_errors():
    with pytest.raises(TypeError, match="score_before_experts must be a bool, got str"):
        dge.MegaGroupedExperts(H, I, E, "yes")
    with pytest.raises(ValueError, match="hidden_dim=0 must be at least 1"):
        dge.MegaGroupedExperts(H, 0, E)
    with pytest.raises(ValueError, match="backend='cutlass' is not supported"):
        dge.MegaGroupedExperts(H, I, E, backend="cutlass")
    module = make_module(True)
    x, idx = torch.randn(4, H, dtype=torch.float64), torch.zeros(4, K, dtype=torch.long)
    for before in (True, False):
        module.score_before_experts = before
        with pytest.raises(ValueError, match=r"expected topk_idx's shape \(4, 2\)"):
            module(x, idx, torch.rand(4, 3, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"topk_idx has shape \(5, 2\) and x \(4, 24\)"):
            module(x, torch.zeros(5, K, dtype=torch.long), torch.rand(5, K, dtype=torch.float64))
        with pytest.raises(TypeError, match="x has dtype torch.int64; expected a floating dtype"):
            module(x.long(), idx, torch.rand(4, K, dtype=torch.float64))
        with pytest.raises(TypeError, match="topk_scores must be a torch.Tensor, got NoneType"):
            module(x, idx, None)


@requires_cuda
@pytest.mark.parametrize("score_before_experts", [True, False])
def test_gpu_bf16_against_fp64_reference(score_before_experts):
    hidden, inter, experts, top_k, tokens = 256, 128, 16, 4, 300
    torch.manual_seed(0)
    module = dge.MegaGroupedExperts(hidden, inter, experts, score_before_experts, device="cuda",
                                    dtype=torch.bfloat16)
    module.init_weights(0.05)
    idx = make_routing(tokens, experts, top_k, "zipf", generator=torch.Generator().manual_seed(3)).cuda()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(tokens, top_k, device="cuda", requires_grad=True)
    params = (module.w1, module.w2, module.w3)
    y = module(x, idx, scores)
    dy = torch.randn_like(y)
    got = (y, *torch.autograd.grad(y, (x, scores, *params), dy))
    leaves = [t.detach().double().requires_grad_() for t in (x, scores, *params)]
    y_ref = torchtitan_experts_reference(leaves[0], idx, leaves[1], *leaves[2:], score_before_experts)
    want = (y_ref, *torch.autograd.grad(y_ref, leaves, dy.double()))
    for name, g, w in zip(("y", "dx", "d scores", "d w1", "d w2", "d w3"), got, want):
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))
