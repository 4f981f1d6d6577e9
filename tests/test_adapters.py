"""Adapters to and from transformers (Qwen3-MoE, 4.x and 5.x layouts) and torchtitan: weights
round-trip exactly, adapted blocks and models give transformers' outputs and gradients (fp64 on
CPU). The 5.x tests use the real transformers package and skip without it; the 4.x layout is
rebuilt here since one environment holds one transformers version."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deep_gemm_ext as dge
from deep_gemm_ext.reference import reference_forward

H, I, E, K = 16, 8, 6, 2


def randomize_(module, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return module


def routed(seed=0, tokens=13):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g, dtype=torch.float64)
    return x, idx, w


# ---------------------------------------------------------------------------------------------
# transformers 4.x layout, rebuilt: a ModuleList of MLPs and an nn.Linear router.


class LegacyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """transformers 4.x's block: per-expert loop, returns ``(y, router_logits)``."""

    def __init__(self, norm_topk_prob=True):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, K, norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(LegacyMLP() for _ in range(E))

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.view(-1, hidden)
        logits = self.gate(flat)
        weights, chosen = torch.topk(F.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[e](flat[token]) * weights[token, slot, None])
        return out.view(batch, seq, hidden), logits


class LegacyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": Qwen3MoeSparseMoeBlock()}) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["mlp"](x)[0]
        return x


def test_legacy_experts_round_trip():
    block = randomize_(Qwen3MoeSparseMoeBlock().double())
    m = dge.from_hf_qwen3_moe_experts(block.experts, top_k=K)
    assert (m.num_experts, m.hidden, m.intermediate, m.l1_weights.dtype) == (E, H, I, torch.float64)
    assert torch.equal(m.l1_weights[3, :I], block.experts[3].gate_proj.weight)
    assert torch.equal(m.l1_weights[3, I:], block.experts[3].up_proj.weight)
    assert torch.equal(m.l2_weights[3], block.experts[3].down_proj.weight)
    other = randomize_(Qwen3MoeSparseMoeBlock().double(), seed=1)
    dge.to_hf_qwen3_moe_experts(m, other.experts)
    assert all(torch.equal(a, b) for a, b in zip(block.experts.parameters(), other.experts.parameters()))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_legacy_block_output_and_grads(norm_topk_prob):
    block = randomize_(Qwen3MoeSparseMoeBlock(norm_topk_prob).double())
    adapted = dge.MegaQwen3MoeSparseBlock(block)
    x = torch.randn(2, 7, H, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 7, H, dtype=torch.float64)
    y_hf, logits_hf = block(x)
    y, logits = adapted(x)
    torch.testing.assert_close(y, y_hf, rtol=1e-12, atol=1e-12)
    assert torch.equal(logits, logits_hf)
    g_hf = torch.autograd.grad(y_hf, [x, block.gate.weight, *block.experts.parameters()], dy)
    g = torch.autograd.grad(y, [x, adapted.gate.weight, adapted.experts.l1_weights, adapted.experts.l2_weights], dy)
    for a, b in zip(g[:2], g_hf[:2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # Expert gradients, mapped into the per-expert layout.
    mapped = nn.ModuleList(LegacyMLP() for _ in range(E)).double()
    grads = dge.MegaMoE(E, H, I, K, dtype=torch.float64)
    with torch.no_grad():
        grads.l1_weights.copy_(g[2])
        grads.l2_weights.copy_(g[3])
    dge.to_hf_qwen3_moe_experts(grads, mapped)
    for a, b in zip(mapped.parameters(), g_hf[2:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_legacy_replace_and_restore():
    model = LegacyModel().double()
    randomize_(model)
    x = torch.randn(2, 5, H, dtype=torch.float64)
    y_hf = model(x)
    assert dge.replace_qwen3_moe_experts(model) == 2
    assert all(isinstance(layer["mlp"], dge.MegaQwen3MoeSparseBlock) for layer in model.layers)
    names = sorted(n for n, _ in model.named_parameters())
    assert names == sorted(f"layers.{i}.mlp.{p}" for i in range(2)
                           for p in ("gate.weight", "experts.l1_weights", "experts.l2_weights"))
    torch.testing.assert_close(model(x), y_hf, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        model.layers[1]["mlp"].experts.l2_weights.mul_(2)
    y_trained = model(x)
    assert dge.restore_qwen3_moe_experts(model) == 2
    assert all(type(layer["mlp"]) is Qwen3MoeSparseMoeBlock for layer in model.layers)
    assert not any(p.is_meta for p in model.parameters())
    torch.testing.assert_close(model(x), y_trained, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# transformers 5.x fused layout, every flag combination, against the math written out.


class FusedExperts(nn.Module):
    def __init__(self, is_transposed, is_concatenated, hidden_act="silu"):
        super().__init__()
        self.is_transposed, self.is_concatenated = is_transposed, is_concatenated
        self.config = type("Config", (), {"hidden_act": hidden_act})()
        up_shape, down_shape = ((E, H, 2 * I), (E, I, H)) if is_transposed else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj = nn.Parameter(torch.empty(up_shape, dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.empty(down_shape, dtype=torch.float64))

    def expert(self, e):
        """(gate [I, H], up [I, H], down [H, I]) of expert e, read the way transformers reads it."""
        gate_up, down = self.gate_up_proj[e], self.down_proj[e]
        if self.is_transposed:
            gate_up, down = gate_up.t(), down.t()
        if self.is_concatenated:
            return gate_up[:I], gate_up[I:], down
        return gate_up[0::2], gate_up[1::2], down


@pytest.mark.parametrize("is_transposed", [False, True])
@pytest.mark.parametrize("is_concatenated", [True, False])
def test_fused_layouts(is_transposed, is_concatenated):
    experts = randomize_(FusedExperts(is_transposed, is_concatenated))
    m = dge.from_hf_qwen3_moe_experts(experts, top_k=K)
    x, idx, w = routed()
    want = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            gate, up, down = experts.expert(int(idx[t, k]))
            want[t] += w[t, k] * (down @ (F.silu(gate @ x[t]) * (up @ x[t])))
    torch.testing.assert_close(m(x, idx, w), want, rtol=1e-12, atol=1e-12)
    copy = FusedExperts(is_transposed, is_concatenated)
    dge.to_hf_qwen3_moe_experts(m, copy)
    assert torch.equal(copy.gate_up_proj, experts.gate_up_proj)
    assert torch.equal(copy.down_proj, experts.down_proj)


def test_adapter_errors():
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        dge.from_hf_qwen3_moe_experts(FusedExperts(False, True, hidden_act="gelu"), top_k=K)
    with pytest.raises(TypeError, match="is not a transformers MoE experts module"):
        dge.from_hf_qwen3_moe_experts(nn.Linear(4, 4), top_k=K)
    with pytest.raises(TypeError, match="is not a torchtitan GroupedExperts"):
        dge.from_torchtitan_experts(nn.Linear(4, 4), top_k=K)
    wrong = dge.MegaMoE(E, H, 2 * I, K, dtype=torch.float64)
    with pytest.raises(ValueError, match="intermediate=8, hidden=16; the module has num_experts=6, intermediate=16"):
        dge.to_hf_qwen3_moe_experts(wrong, FusedExperts(False, True))


# ---------------------------------------------------------------------------------------------
# torchtitan


class GroupedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, I, H, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(E, H, I, dtype=torch.float64))
        self.w3 = nn.Parameter(torch.randn(E, I, H, dtype=torch.float64))


def test_torchtitan_round_trip_and_semantics():
    experts = GroupedExperts()
    m = dge.from_torchtitan_experts(experts, top_k=K)
    assert torch.equal(m.l1_weights, torch.cat([experts.w1, experts.w3], 1))
    assert torch.equal(m.l2_weights, experts.w2)
    x, idx, w = routed(1)
    torch.testing.assert_close(m(x, idx, w), reference_forward(x, idx, w, m.l1_weights, m.l2_weights))
    other = GroupedExperts()
    dge.to_torchtitan_experts(m, other)
    assert all(torch.equal(getattr(other, n), getattr(experts, n)) for n in ("w1", "w2", "w3"))


class FakeGroup:
    def __init__(self, size, rank):
        self.size, self.rank = (lambda: size), (lambda: rank)


def test_expert_parallel_shard_reads_and_writes_its_slice():
    experts = GroupedExperts()
    m = dge.from_torchtitan_experts(experts, top_k=K, group=FakeGroup(3, 2))
    assert torch.equal(m.l2_weights, experts.w2[4:6])
    other = GroupedExperts()
    before = other.w2.detach().clone()
    dge.to_torchtitan_experts(m, other)
    assert torch.equal(other.w2[4:6], experts.w2[4:6]) and torch.equal(other.w2[:4], before[:4])


# ---------------------------------------------------------------------------------------------
# The real transformers 5.x Qwen3-MoE.


def tiny_qwen3_moe_config(**over):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3-MoE")
    kwargs = dict(vocab_size=64, hidden_size=H, intermediate_size=32, moe_intermediate_size=I,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                  num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], max_position_embeddings=64, router_aux_loss_coef=0.01)
    kwargs.update(over)
    return transformers, transformers.Qwen3MoeConfig(**kwargs)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_hf_block_output_and_grads(norm_topk_prob):
    transformers, config = tiny_qwen3_moe_config(norm_topk_prob=norm_topk_prob)
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    block = randomize_(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).double())
    if isinstance(block.experts, nn.ModuleList):
        pytest.skip(f"transformers {transformers.__version__} has the 4.x layout (tested above)")
    adapted = dge.MegaQwen3MoeSparseBlock(block)
    assert adapted.gate is block.gate and not adapted.legacy
    x = torch.randn(2, 7, H, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 7, H, dtype=torch.float64)
    y_hf, y = block(x), adapted(x)
    torch.testing.assert_close(y, y_hf, rtol=1e-12, atol=1e-12)
    g_hf = torch.autograd.grad(y_hf, (x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj), dy)
    g = torch.autograd.grad(y, (x, adapted.gate.weight, adapted.experts.l1_weights, adapted.experts.l2_weights), dy)
    for name, a, b in zip(("x", "router", "gate_up_proj", "down_proj"), g, g_hf):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def hf_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def test_hf_model_replace_and_restore():
    transformers, config = tiny_qwen3_moe_config()
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).double()
    if hasattr(model, "set_experts_implementation"):  # the per-expert loop: the others need bf16
        model.set_experts_implementation("eager")
    with torch.no_grad():  # transformers may zero-init the router; random routing is the harder case
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    ids = torch.randint(0, config.vocab_size, (2, 11))
    out_hf, g_hf = hf_step(model, ids)
    keys_hf = sorted(model.state_dict())

    assert dge.replace_qwen3_moe_experts(model) == config.num_hidden_layers
    out, g = hf_step(model, ids)
    torch.testing.assert_close(out.logits, out_hf.logits, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.loss, out_hf.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.aux_loss, out_hf.aux_loss, rtol=1e-12, atol=0)
    renamed = {"experts.gate_up_proj": "experts.l1_weights", "experts.down_proj": "experts.l2_weights"}
    for name, grad in g_hf.items():
        for old, new in renamed.items():
            name = name.replace(old, new)
        torch.testing.assert_close(g[name], grad, rtol=1e-9, atol=1e-12, msg=name)

    with torch.no_grad():  # stands in for training
        for layer in model.model.layers:
            layer.mlp.experts.l1_weights.add_(0.01)
    trained = model(input_ids=ids).logits
    assert dge.restore_qwen3_moe_experts(model) == config.num_hidden_layers
    assert sorted(model.state_dict()) == keys_hf
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    torch.testing.assert_close(model(input_ids=ids).logits, trained, rtol=1e-10, atol=1e-12)


def test_hf_model_with_mega_blocks_compiles_fullgraph():
    """The swapped model traces as one graph (aot_eager: tracing and fake impls, no codegen)."""
    transformers, config = tiny_qwen3_moe_config()
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    dge.replace_qwen3_moe_experts(model)
    ids = torch.randint(0, config.vocab_size, (2, 11))
    eager = model(input_ids=ids, labels=ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids)
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=1e-6, atol=1e-6)
    experts = model.model.layers[0].mlp.experts
    g_eager = torch.autograd.grad(eager.loss, experts.l1_weights)
    g_compiled = torch.autograd.grad(compiled.loss, experts.l1_weights)
    torch.testing.assert_close(g_compiled, g_eager, rtol=1e-5, atol=1e-7)
