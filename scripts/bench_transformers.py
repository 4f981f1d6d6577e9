"""A training step (forward + backward) of a transformers Qwen3-MoE model through
``experts_implementation="deep_gemm_ext"`` against transformers' ``"grouped_mm"``.

Qwen3-30B-A3B's layer shapes (hidden 2048, moe_intermediate 768, 128 experts, top-8, 32 query and
4 key/value heads of 128), 2 decoder layers, 8192 tokens a step (4 x 2048), random bf16 weights,
one model whose experts implementation is switched in place, both timed in this process: CUDA-event
medians of whole steps (loss.backward() included, gradients freed between steps). Run once with
Qwen3's vocabulary (the LM head is a large share of such a short model's step) and once with a
small one. Also times the rearranging copies that other weight layouts cost per MoE layer. Prints
markdown tables; ``--json`` writes the rows.

    python scripts/bench_transformers.py [--tokens 8192] [--seq 2048] [--layers 2] [--vocab 151936 4096]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deep_gemm_ext as dge  # noqa: E402
from deep_gemm_ext.testing import median_ms  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
IMPLEMENTATIONS = ("grouped_mm", dge.register_transformers())


def qwen3_moe(vocab: int, layers: int, seq: int):
    import transformers
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=6144, moe_intermediate_size=INTER,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=max(seq, 4096), rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None,
        eos_token_id=None)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             experts_implementation=IMPLEMENTATIONS[0])


def time_steps(model, ids, reps: int, warmup: int) -> dict:
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    step()  # first call: JIT builds, allocator warm-up
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, reps, warmup)
    return dict(step_ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30, loss=loss)


def copy_costs(reps: int) -> list[tuple[str, float]]:
    """Forward + backward of the per-call copies one MoE layer pays in other weight layouts."""
    gate_up = torch.randn(EXPERTS, HIDDEN, 2 * INTER, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(EXPERTS, INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1, w3 = (torch.randn(EXPERTS, INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for _ in range(2))

    def transposed():  # transformers' is_transposed=True: both weights
        for w in (gate_up, down):
            out = w.transpose(1, 2).contiguous()
            out.backward(torch.ones_like(out))

    def concatenated():  # torchtitan's w1 / w3 into l1_weights
        out = torch.cat((w1, w3), dim=1)
        out.backward(torch.ones_like(out))

    return [("transformers is_transposed=True (gate_up_proj and down_proj)", median_ms(transposed, reps)),
            ("torchtitan MegaGroupedExperts (cat(w1, w3))", median_ms(concatenated, reps))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 4096])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows to this path")
    args = parser.parse_args()
    if args.tokens % args.seq:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --seq {args.seq}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{__import__('transformers').__version__}; Qwen3-MoE H {HIDDEN} I {INTER} E {EXPERTS} K {TOP_K}, "
          f"{args.layers} layers, {args.tokens} tokens a step ({args.tokens // args.seq} x {args.seq}), bf16\n")
    records = []
    for vocab in args.vocab:
        torch.manual_seed(0)
        model = qwen3_moe(vocab, args.layers, args.seq)
        ids = torch.randint(0, vocab, (args.tokens // args.seq, args.seq), device="cuda")
        results = {}
        for impl in IMPLEMENTATIONS:
            model.set_experts_implementation(impl)
            results[impl] = time_steps(model, ids, args.reps, args.warmup)
        base = results["grouped_mm"]["step_ms"]
        print(f"vocabulary {vocab}\n")
        print("| experts_implementation | step ms | x grouped_mm | peak GiB | loss |\n|---|---|---|---|---|")
        for impl, r in results.items():
            print(f"| {impl} | {r['step_ms']:.2f} | {base / r['step_ms']:.2f}x | {r['peak_gib']:.2f} | "
                  f"{r['loss']:.4f} |")
            records.append(dict(vocab=vocab, experts_implementation=impl, **r))
        print()
        del model
        torch.cuda.empty_cache()
    print("| per-call weight copy of one MoE layer (fwd + bwd) | ms |\n|---|---|")
    for name, ms in copy_costs(args.reps):
        print(f"| {name} | {ms:.3f} |")
        records.append(dict(copy=name, ms=ms))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(tokens=args.tokens, seq=args.seq, layers=args.layers,
                                                   rows=records), indent=1))


if __name__ == "__main__":
    main()
