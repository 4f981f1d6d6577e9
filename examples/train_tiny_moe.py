"""Train a small Qwen3-MoE-like decoder twice on the same data: experts computed by
``deep_gemm_ext.MegaMoE`` ("ours") and by the torchtitan-style baseline
``deep_gemm_ext.baselines.grouped_mm_moe`` ("grouped_mm"), with the same weights, seed and batches.

Prints the final loss and the median step time of each, and the end-to-end speedup; writes the
loss curves and step times as JSON and PNG (PNG needs matplotlib). Exits 1 when the curves
disagree:

- over the first 20 steps the raw losses of ours and the baseline must agree within
  ``--early-tolerance`` (1%): there the curves reflect the numerics of the two implementations, not
  yet the chaos of training;
- at the end, ours' smoothed loss must be no worse than ``--tolerance`` (3%) above the baseline's.
  Training is chaotic (the time the model takes to leave its early plateau shifts with any
  perturbation) and the baseline's own kernels (embedding backward, scatter_add) sum in a
  nondeterministic order, so two runs of the same baseline from the same seed can end several
  percent apart. On GPU the example therefore trains a second baseline model in the same process
  ("grouped_mm (repeat)", ``--no-noise-run`` to skip it) and compares ours with the worse of the two
  baseline runs. Without the repeat, ``--tolerance`` bounds the smoothed gap to the one baseline
  run over the last 50 steps.

    python examples/train_tiny_moe.py                      # GPU defaults: 300 steps, MoE-heavy sizes
    python examples/train_tiny_moe.py --tiny --steps 3     # CPU smoke run
    python examples/train_tiny_moe.py --tiny --recipe fp8  # ours under the blockwise-fp8 recipe

The runs step in turn (one step of each, then the next), so all see the same GPU state.
On the GPU the expert-id range check is a device-side assertion (no host sync per layer);
``DGE_CHECK_IDS=1`` would add the host check and its sync.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import deep_gemm_ext as dge
from deep_gemm_ext import plan
from deep_gemm_ext.baselines import grouped_mm_moe

IMPLS = ("ours", "grouped_mm")
#: The second baseline model that measures the run-to-run noise.
REPEAT = "grouped_mm (repeat)"
#: Steps compared at the end, and the window of the moving average that smooths each curve.
COMPARE_LAST, SMOOTH = 50, 20
#: Steps compared at the start, before training's chaos amplifies rounding differences.
EARLY_STEPS = 20


# ---------------------------------------------------------------------------------------------
# Data: a fixed random Markov chain over the vocabulary, each token with a few likely successors.


class MarkovChain:
    def __init__(self, vocab: int, branching: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=g)
        probs = torch.softmax(1.5 * torch.randn(vocab, branching, generator=g, dtype=torch.float64), -1)
        self.cdf = probs.cumsum(-1)
        self.cdf[:, -1] = 1.0
        dense = torch.zeros(vocab, vocab, dtype=torch.float64)
        dense.scatter_add_(1, self.successors, probs)
        stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(200):
            stationary = stationary @ dense
        row_entropy = -(dense * dense.clamp_min(1e-300).log()).sum(-1)
        #: The loss a perfect model reaches, in nats per token.
        self.entropy_rate = float(stationary @ row_entropy)
        self.vocab = vocab
        self.generator = g

    def sample(self, num_sequences: int, length: int) -> torch.Tensor:
        tokens = torch.empty(num_sequences, length, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (num_sequences,), generator=self.generator)
        for t in range(1, length):
            u = torch.rand(num_sequences, 1, generator=self.generator, dtype=torch.float64)
            prev = tokens[:, t - 1]
            pick = torch.searchsorted(self.cdf[prev], u).squeeze(1).clamp_(max=self.cdf.shape[1] - 1)
            tokens[:, t] = self.successors[prev, pick]
        return tokens


# ---------------------------------------------------------------------------------------------
# Model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(batch, seq, hidden))


class MoE(nn.Module):
    """Qwen3-MoE routing (softmax, top-k, renormalised) in front of the experts; ``impl`` picks who
    computes them. Returns the output and a Switch-style load-balancing loss."""

    def __init__(self, cfg, impl, dtype, device):
        super().__init__()
        self.top_k = cfg.top_k
        self.impl = impl
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = dge.MegaMoE(cfg.experts, cfg.hidden, cfg.intermediate, cfg.top_k, backend=cfg.backend,
                                   recipe=cfg.recipe, device=device, dtype=dtype)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.impl == "ours":
            y = self.experts(flat, idx, weights)
        else:
            y = grouped_mm_moe(flat, idx, weights, self.experts.l1_weights, self.experts.l2_weights)
        num_experts = probs.shape[1]
        load = torch.zeros(num_experts, device=x.device).scatter_add_(
            0, idx.flatten(), torch.ones(idx.numel(), device=x.device)) / idx.numel()
        aux = num_experts * (load * probs.mean(0)).sum()
        return y.view(shape), aux


class Block(nn.Module):
    def __init__(self, cfg, impl, dtype, device):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.moe_norm = RMSNorm(cfg.hidden)
        self.moe = MoE(cfg, impl, dtype, device)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class TinyMoEDecoder(nn.Module):
    def __init__(self, cfg, impl, dtype, device):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, impl, dtype, device) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.to(device=device, dtype=dtype)
        self.init_weights(cfg.layers)

    @torch.no_grad()
    def init_weights(self, layers: int):
        depth_std = 0.02 / math.sqrt(2 * layers)  # output projections, as torchtitan does
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=0.02)
            elif isinstance(module, dge.MegaMoE):
                module.reset_parameters(init_std=depth_std)
        for block in self.blocks:
            nn.init.trunc_normal_(block.attn.out.weight, std=depth_std)

    def forward(self, tokens):
        x = self.embed(tokens)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.head(self.norm(x)), aux


# ---------------------------------------------------------------------------------------------
# Training


#: The model's sizes: defaults, and the defaults under --tiny (a CPU smoke run).
SIZES = dict(hidden=1024, intermediate=512, experts=64, top_k=8, layers=4, heads=8, vocab=2048, seq=2048, batch=4)
TINY_SIZES = dict(hidden=64, intermediate=32, experts=8, top_k=2, layers=2, heads=4, vocab=128, seq=32, batch=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impl", choices=IMPLS + ("both",), default="both")
    p.add_argument("--backend", choices=("auto", "torch"), default="auto",
                   help="mega_moe_train's backend for 'ours' (auto: our SM90 kernels where they apply)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="model dtype; default bfloat16 on GPU (the fast path), float32 on CPU")
    p.add_argument("--steps", type=int, default=None, help="default: 300 on GPU, 20 on CPU")
    p.add_argument("--tiny", action="store_true", help="small sizes for a CPU smoke run")
    p.add_argument("--recipe", choices=("bf16", "fp8"), default="bf16",
                   help="ours' precision recipe (fp8: blockwise, hidden and intermediate multiples of 128)")
    for name in SIZES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {SIZES[name]} ({TINY_SIZES[name]} with --tiny)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--aux-coef", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="how far ours' final smoothed loss may lie above the baseline's (relative)")
    p.add_argument("--early-tolerance", type=float, default=0.01,
                   help="max relative gap of the raw losses over the first 20 steps")
    p.add_argument("--noise-run", action=argparse.BooleanOptionalAction, default=None,
                   help="also train a second baseline model to measure the run-to-run noise (default: on GPU)")
    p.add_argument("--out-dir", type=Path, default=Path("train_tiny_moe_out"))
    args = p.parse_args(argv)
    # --tiny changes the defaults; a size given explicitly is kept.
    defaults = dict(TINY_SIZES) if args.tiny else dict(SIZES)
    if args.tiny and args.recipe == "fp8":  # 128x128 weight blocks
        defaults.update(hidden=128, intermediate=128)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    on_gpu = args.device.startswith("cuda")
    if args.steps is None:
        args.steps = 300 if on_gpu else 20
    for name in ("steps", *SIZES):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k}: expected at most --experts ({args.experts})")
    if args.dtype is None:
        args.dtype = "bfloat16" if on_gpu else "float32"
    if args.noise_run is None:
        args.noise_run = on_gpu and args.impl == "both"
    return args


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine down to 10% of the peak."""
    warmup = max(1, total // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def smooth(values, window: int = SMOOTH):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


class Run:
    def __init__(self, impl, args, device, dtype, name=None):
        torch.manual_seed(args.seed)  # same initial weights for every impl
        self.impl = impl
        self.name = name or impl
        self.model = TinyMoEDecoder(args, impl, dtype, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                     weight_decay=0.0, fused=device.type == "cuda")
        self.losses, self.step_ms, self.peak_gib = [], [], []

    def step(self, tokens, lr, aux_coef, device):
        for group in self.opt.param_groups:
            group["lr"] = lr
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
        sync()
        start = time.perf_counter()
        logits, aux = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        (loss + aux_coef * aux).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        sync()
        self.step_ms.append(1e3 * (time.perf_counter() - start))
        self.losses.append(loss_value)
        if device.type == "cuda":
            self.peak_gib.append((torch.cuda.max_memory_allocated() - resident) / 2 ** 30)


def write_plot(path: Path, runs, entropy_rate: float) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written ({path.name})")
        return
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        line, = ax_loss.plot(run.losses, alpha=0.25)
        ax_loss.plot(smooth(run.losses), color=line.get_color(), label=f"{run.name} (smoothed)")
        ax_time.plot(run.step_ms, color=line.get_color(), label=run.name)
    ax_loss.axhline(entropy_rate, color="gray", linestyle=":", label="entropy rate of the data")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="training loss")
    ax_time.set(xlabel="step", ylabel="ms", title="step time (forward + backward + AdamW)")
    median_ms = max(statistics.median(r.step_ms) for r in runs)
    ax_time.set_ylim(0, 3 * median_ms)
    for ax in (ax_loss, ax_time):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    impls = IMPLS if args.impl == "both" else (args.impl,)
    chain = MarkovChain(args.vocab, branching=4, seed=args.seed)
    data = chain.sample(args.steps * args.batch, args.seq + 1).to(device)
    runs = [Run(impl, args, device, dtype) for impl in impls]
    if args.noise_run:
        runs.append(Run("grouped_mm", args, device, dtype, name=REPEAT))
    tokens_per_step = args.batch * args.seq
    probe = torch.empty(1, args.hidden, device=device, dtype=dtype)
    probe_l1 = torch.empty(args.experts, 2 * args.intermediate, args.hidden, device="meta", dtype=dtype)
    engine = plan.resolve(probe, probe_l1, backend=args.backend, recipe=args.recipe).describe()
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{dtype}, {args.steps} steps of {tokens_per_step} tokens; hidden {args.hidden}, "
          f"intermediate {args.intermediate}, {args.experts} experts, top-{args.top_k}, "
          f"{args.layers} layers; ours runs {engine}; "
          f"data entropy rate {chain.entropy_rate:.3f} nats/token")
    for step in range(args.steps):
        tokens = data[step * args.batch:(step + 1) * args.batch]
        lr = lr_at(step, args.steps, args.lr)
        for run in runs:
            run.step(tokens, lr, args.aux_coef, device)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  " + "  ".join(f"{r.name} {r.losses[-1]:.4f} ({r.step_ms[-1]:.1f} ms)"
                                                   for r in runs))

    skip = min(5, args.steps - 1)  # first steps compile kernels and warm allocators
    summary = {}
    for run in runs:
        summary[run.name] = {
            "final_loss_smoothed": smooth(run.losses)[-1],
            "median_step_ms": statistics.median(run.step_ms[skip:]),
            "tokens_per_s": tokens_per_step / (statistics.median(run.step_ms[skip:]) / 1e3),
            "step_peak_gib": max(run.peak_gib) if run.peak_gib else None,
        }
    print(f"\n{'impl':20s} {'final loss':>10s} {'median step ms':>15s} {'tokens/s':>12s} {'step peak GiB':>14s}")
    for name, s in summary.items():
        peak = f"{s['step_peak_gib']:.2f}" if s["step_peak_gib"] is not None else "-"
        print(f"{name:20s} {s['final_loss_smoothed']:10.4f} {s['median_step_ms']:15.2f} "
              f"{s['tokens_per_s']:12.0f} {peak:>14s}")

    ok = True
    curves = {r.name: smooth(r.losses) for r in runs}
    raw = {r.name: r.losses for r in runs}
    if "ours" in curves and "grouped_mm" in curves:
        last = min(COMPARE_LAST, args.steps)
        early_steps = min(EARLY_STEPS, args.steps)

        def max_gap(a, b, steps):
            return max(abs(x - y) / abs(y) for x, y in zip(a[:steps], b[:steps]))

        speedup = summary["grouped_mm"]["median_step_ms"] / summary["ours"]["median_step_ms"]
        summary["speedup_end_to_end"] = speedup
        print(f"end-to-end speedup (grouped_mm step time / ours): {speedup:.3f}x")
        early = max_gap(raw["ours"], raw["grouped_mm"], early_steps)
        summary["max_relative_loss_gap_first_steps"] = early
        early_ok = early <= args.early_tolerance
        line = f"loss gap over the first {early_steps} steps: {100 * early:.2f}%"
        if REPEAT in raw:
            noise = max_gap(raw[REPEAT], raw["grouped_mm"], early_steps)
            summary["baseline_repeat_gap_first_steps"] = noise
            line += f" (the baseline's repeat: {100 * noise:.2f}%)"
        print(f"{line}, tolerance {100 * args.early_tolerance:.1f}%: {'OK' if early_ok else 'FAIL'}")
        gap = max(abs(a - b) / abs(b) for a, b in zip(curves["ours"][-last:], curves["grouped_mm"][-last:]))
        summary["max_relative_loss_gap_last_steps"] = gap
        if REPEAT in curves:
            finals = {name: curves[name][-1] for name in ("ours", "grouped_mm", REPEAT)}
            worst = max(finals["grouped_mm"], finals[REPEAT])
            final_ok = finals["ours"] <= (1 + args.tolerance) * worst
            summary["baseline_repeat_final_gap"] = abs(finals[REPEAT] - finals["grouped_mm"]) / finals["grouped_mm"]
            print(f"final smoothed loss: ours {finals['ours']:.4f}, baseline {finals['grouped_mm']:.4f} and "
                  f"{finals[REPEAT]:.4f} (repeat; run-to-run gap {100 * summary['baseline_repeat_final_gap']:.1f}%); "
                  f"ours within {100 * args.tolerance:.1f}% of the worse baseline run: {'OK' if final_ok else 'FAIL'}")
        else:
            final_ok = gap < args.tolerance
            print(f"smoothed loss gap over the last {last} steps: {100 * gap:.2f}% "
                  f"(tolerance {100 * args.tolerance:.1f}%): {'OK' if final_ok else 'FAIL'}")
        ok = early_ok and final_ok

    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": str(device), "dtype": str(dtype), "engine": engine, "entropy_rate": chain.entropy_rate,
        "summary": summary,
        "curves": {r.name: {"loss": r.losses, "step_ms": r.step_ms} for r in runs},
    }
    json_path = args.out_dir / "train_tiny_moe.json"
    json_path.write_text(json.dumps(record, indent=1))
    print(f"wrote {json_path}")
    write_plot(args.out_dir / "train_tiny_moe.png", runs, chain.entropy_rate)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
