"""DRAM bytes of the layer's M-grouped GEMMs under each scheduler walk, from a model of the L2 (CPU only).

    python scripts/walk_l2_model.py [--workload deepseek-v3-t8192 ...] [--walks 16,8,1,e16,e8,e4]
                                    [--l2-mb 50] [--sms 132]

The pool is the one scripts/gemm_bench.py times (uniform routing, seed 0, 128-aligned). The tiles are
handed out in the scheduler's order (sm90_bf16_grouped_gemm.walk_tiles; "16" fixed groups of 16 M blocks,
"e16" groups of at most 16 blocks within each expert) to a persistent grid of --sms CTAs, and the model
assumes a wave of --sms tiles steps through K together. Each step of 256 K elements touches the tile's A
slab and its expert's B slab in an LRU cache of --l2-mb MB; a miss reads the slab from DRAM. "minimum"
reads each A block and each expert's weights once. The model ignores the L2's sets, its two partitions,
prefetch and the epilogue's traffic: it ranks walks by what they re-read, it does not predict a time.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg  # noqa: E402
from deep_gemm_ext.routing import compute_routing_torch  # noqa: E402
from deep_gemm_ext.testing import WORKLOADS, make_routing  # noqa: E402

BLOCK_M, BLOCK_N, K_STEP = 128, 256, 256


def gemm_shapes(w) -> dict[str, tuple[int, int]]:
    """(N, K) of the four M-grouped GEMMs of the layer."""
    h, i = w.hidden, w.intermediate
    return {"L1 fwd": (2 * i, h), "L2 fwd": (h, i), "L2 dgrad": (i, h), "L1 dgrad": (h, 2 * i)}


def dram_bytes(tiles, n: int, k: int, *, l2_bytes: int, sms: int) -> int:
    a_slab, b_slab = BLOCK_M * K_STEP * 2, BLOCK_N * K_STEP * 2
    k_steps = -(-k // K_STEP)
    lru: collections.OrderedDict = collections.OrderedDict()
    held = missed = 0
    for w0 in range(0, len(tiles), sms):
        wave = tiles[w0:w0 + sms]
        for kk in range(k_steps):
            for m, nb, e in wave:
                for key, size in ((("A", m, kk), a_slab), (("B", e, nb, kk), b_slab)):
                    if key in lru:
                        lru.move_to_end(key)
                        continue
                    missed += size
                    lru[key] = size
                    held += size
                    while held > l2_bytes:
                        held -= lru.popitem(last=False)[1]
    return missed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", nargs="+", default=["deepseek-v3-t8192", "qwen3-235b-a22b-t8192",
                                                      "qwen3-30b-a3b-t16384", "qwen3-30b-a3b-t4096"],
                   choices=sorted(WORKLOADS))
    p.add_argument("--walks", default="16,8,1,e16,e8,e4",
                   help="comma-separated: N (fixed groups of N blocks) or eN (groups within experts)")
    p.add_argument("--l2-mb", type=float, default=50.0)
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args()
    walks = []
    for token in args.walks.split(","):
        size = int(token.lstrip("e"))
        if size not in gg.GROUP_M_CHOICES:
            p.error(f"--walks: {token!r}, expected N or eN with N one of {gg.GROUP_M_CHOICES}")
        walks.append((token, size, token.startswith("e")))
    print(f"L2 model: LRU {args.l2_mb:g} MB, waves of {args.sms} tiles, {BLOCK_M} x {BLOCK_N} tiles, "
          f"K steps of {K_STEP}; GB read from DRAM")
    header = "| workload | GEMM | minimum | " + " | ".join(t for t, _, _ in walks) + " |"
    rows = [header, "|" + "---|" * (3 + len(walks))]
    for name in args.workload:
        w = WORKLOADS[name]
        torch.manual_seed(0)
        idx = make_routing(w.num_tokens, w.num_experts, w.top_k, "uniform")
        meta = compute_routing_torch(idx, w.num_experts, gg.GROUP_ALIGNMENT)
        starts, ends = meta.starts.tolist(), meta.ends.tolist()
        blocks = -(-ends[-1] // BLOCK_M)
        experts = sum(1 for s, t in zip(starts, ends) if t > s)
        for gemm, (n, k) in gemm_shapes(w).items():
            n_blocks = -(-n // BLOCK_N)
            minimum = blocks * BLOCK_M * k * 2 + experts * n * k * 2
            cells = [dram_bytes(gg.walk_tiles(starts, ends, n_blocks, size, eg), n, k,
                                l2_bytes=int(args.l2_mb * 2 ** 20), sms=args.sms) for _, size, eg in walks]
            rows.append(f"| {name} | {gemm} | {minimum / 1e9:.1f} | " +
                        " | ".join(f"{c / 1e9:.1f}" for c in cells) + " |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
