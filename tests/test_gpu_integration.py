"""What a training stack needs on the GPU: fwd + bwd captured in a CUDA graph and replayed with new
inputs bit-equal to eager (torch.cuda.graph and make_graphed_callables); MegaMoE on the GPU path,
under autocast.

torch.compile and opcheck on CUDA are in test_compile.py, FSDP2 over nccl in test_fsdp.py,
transformers models in test_gpu_transformers.py."""
import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs, rel_err

from conftest import requires_cuda
from gpu_utils import reference_grads

pytestmark = requires_cuda

T, H, I, E, K = 512, 512, 256, 16, 8


def leaves(x, idx, w, l1, l2):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in (x, idx, w, l1, l2)]


def eager_step(inputs, dy, backend, clamp):
    x, idx, w, l1, l2 = leaves(*inputs)
    y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=clamp, backend=backend)
    return (y.detach(), *torch.autograd.grad(y, (x, w, l1, l2), dy))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_cuda_graph_fwd_bwd_replay_bit_exact(backend, clamp):
    """Capture forward + backward once; replay with new x, routing, weights and dy copied in.
    The routing changes every replay (zipf, then uniform, then unused slots): the pool is static."""
    static = leaves(*make_inputs(T, H, I, E, K, routing="zipf", device="cuda", seed=0))
    sx, sidx, sw, sl1, sl2 = static
    sdy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y = dge.mega_moe_train(sx, sidx, sw, sl1, sl2, activation_clamp=clamp, backend=backend)
        return (y, *torch.autograd.grad(y, (sx, sw, sl1, sl2), sdy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: JIT compiles, allocator pools, lazy inits
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    for seed, routing in ((1, "zipf"), (2, "uniform"), (3, "unused_slots")):
        new = make_inputs(T, H, I, E, K, routing=routing, device="cuda", seed=seed, requires_grad=False)
        dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for dst, src in zip((*static, sdy), (*new, dy)):
                dst.copy_(src)
        graph.replay()
        want = eager_step(new, dy, backend, clamp)
        torch.cuda.synchronize()
        for name, got, ref in zip(("y", "dx", "dtopk_w", "dl1", "dl2"), outs, want):
            assert not got.isnan().any(), f"{routing}: {name} has NaN"
            assert torch.equal(got, ref), f"{routing}: replayed {name} differs from eager"


def test_make_graphed_callables_module():
    torch.manual_seed(0)
    module = dge.MegaMoE(E, H, I, K, device="cuda")
    x, idx, w, _, _ = leaves(*make_inputs(T, H, I, E, K, device="cuda", seed=4))
    graphed = torch.cuda.make_graphed_callables(module, (x, idx, w))
    for seed in (5, 6):
        nx, nidx, nw, _, _ = make_inputs(T, H, I, E, K, routing="zipf", device="cuda", seed=seed)
        dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        results = []
        for fn in (graphed, module):
            module.zero_grad(set_to_none=True)
            xl, wl = nx.detach().clone().requires_grad_(), nw.detach().clone().requires_grad_()
            y = fn(xl, nidx, wl)
            y.backward(dy)
            results.append((y.detach().clone(), xl.grad, wl.grad, module.l1_weights.grad.clone(),
                            module.l2_weights.grad.clone()))
        torch.cuda.synchronize()
        for name, got, ref in zip(("y", "dx", "dtopk_w", "dl1", "dl2"), *results):
            assert torch.equal(got, ref), f"graphed {name} differs from eager"


def test_module_on_gpu_matches_functional_and_reference():
    torch.manual_seed(0)
    module = dge.MegaMoE(E, H, I, K, device="cuda")
    module.reset_parameters(init_std=0.05)
    x, idx, w, _, _ = leaves(*make_inputs(T, H, I, E, K, routing="zipf", device="cuda", seed=7))
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    y = module(x, idx, w)
    got = (y.detach(), *torch.autograd.grad(y, (x, w, module.l1_weights, module.l2_weights), dy))
    want = eager_step((x, idx, w, module.l1_weights, module.l2_weights), dy, "auto", None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    y_ref, g_ref = reference_grads(x, idx, w, module.l1_weights, module.l2_weights, None, dy)
    for name, out, ref in zip(("y", "dx", "dtopk_w", "dl1", "dl2"), got, (y_ref, *g_ref)):
        assert rel_err(out, ref) < 2e-2, (name, rel_err(out, ref))


def test_module_under_autocast():
    """fp32 master weights, bf16 autocast: the GPU path runs on bf16 copies of the weights."""
    torch.manual_seed(0)
    module = dge.MegaMoE(E, H, I, K, device="cuda", dtype=torch.float32)
    x, idx, w, _, _ = make_inputs(T, H, I, E, K, device="cuda", dtype=torch.float32, seed=8)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x, idx, w)
    assert y.dtype == torch.bfloat16
    want = dge.mega_moe_train(x.bfloat16(), idx, w, module.l1_weights.bfloat16(), module.l2_weights.bfloat16())
    assert torch.equal(y, want)
    y.float().square().sum().backward()
    assert module.l1_weights.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
