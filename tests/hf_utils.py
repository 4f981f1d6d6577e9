"""Tiny random transformers MoE models shared by test_transformers.py and test_gpu_transformers.py
(import it after ``pytest.importorskip("transformers")``)."""
from __future__ import annotations

import pytest
import torch
import transformers

from deep_gemm_ext.integrations import transformers as dge_tf


def tiny_config(family: str, hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 2):
    """A 2-layer config of ``family`` (ids 0-2 reserved for pad / bos / eos, vocabulary 64)."""
    common = dict(vocab_size=64, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  num_experts_per_tok=top_k)
    head_dim = hidden // 4
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=4 * inter, moe_intermediate_size=inter,
                                           head_dim=head_dim, num_experts=experts, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[])
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=inter, head_dim=head_dim,
                                          num_local_experts=experts)
    if family == "deepseek_v3":  # first layer dense, then routed + shared experts, group-limited routing
        return transformers.DeepseekV3Config(**common, intermediate_size=3 * inter, moe_intermediate_size=inter,
                                             n_routed_experts=experts, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16,
                                             q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=inter, num_experts=experts)
    raise ValueError(f"family={family!r}")


FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "olmoe")


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, device="cpu", expert_std=0.3,
               sizes=None, **kwargs):
    torch.manual_seed(seed)
    config = tiny_config(family, **(sizes or {}))
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs).to(device, dtype)
    with torch.no_grad():  # experts large enough that their output matters to the loss
        for experts in experts_modules(model):
            experts.gate_up_proj.normal_(0, expert_std)
            experts.down_proj.normal_(0, expert_std)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def layer_calls(monkeypatch):
    """Counts the layer calls our experts function makes, so a silent fallback to eager fails."""
    count = [0]
    inner = dge_tf.experts_forward

    def counting(*args, **kwargs):
        count[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(dge_tf, "experts_forward", counting)
    return count
