"""What a training stack needs on the GPU: fwd + bwd captured in a CUDA graph and replayed with new
inputs bit-equal to eager (torch.cuda.graph and make_graphed_callables); MegaMoE on the GPU path,
under autocast; transformers' Qwen3-MoE with its experts swapped (bf16).

torch.compile and opcheck on CUDA are in test_compile.py, FSDP2 over nccl in test_fsdp.py."""
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


def tiny_config(transformers, **over):
    kwargs = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], max_position_embeddings=256, router_aux_loss_coef=0.01)
    kwargs.update(over)
    return transformers.Qwen3MoeConfig(**kwargs)


def test_hf_qwen3_moe_bf16_block_and_model():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    config = tiny_config(transformers)
    torch.manual_seed(0)
    block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    adapted = dge.MegaQwen3MoeSparseBlock(block)
    x = torch.randn(2, 100, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    out_hf, out = block(x), adapted(x)
    y_hf, y = (o[0] if isinstance(o, tuple) else o for o in (out_hf, out))
    assert rel_err(y, y_hf) < 2e-2
    g_hf = torch.autograd.grad(y_hf, (x, block.gate.weight), dy)
    g = torch.autograd.grad(y, (x, adapted.gate.weight), dy)
    for name, a, b in zip(("dx", "d router"), g, g_hf):
        assert rel_err(a, b) < 3e-2, (name, rel_err(a, b))

    model = transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 128), device="cuda")
    loss_hf = model(input_ids=ids, labels=ids).loss
    assert dge.replace_qwen3_moe_experts(model) == config.num_hidden_layers
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - loss_hf.item()) < 2e-2 * loss_hf.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
