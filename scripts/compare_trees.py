#!/usr/bin/env python3
"""Do two source trees of deep_gemm_ext compute the same bits? y and all four gradients, case by case.

Each tree runs in its own subprocess (PYTHONPATH set to the tree, its own DGE_JIT_CACHE_DIR) on
inputs both generate from the same seeds with the tree's ``deep_gemm_ext.testing.make_inputs``; a
fingerprint of the inputs is compared too, so a difference in the generator is reported as such and
not as a difference in the layer. Cases (``--groups``):

- ``headline``: Qwen3-30B-A3B T16384, Qwen3-235B-A22B T8192 and DeepSeek-V3 T8192 on 32 of its 256
  experts (all its shapes but the expert count, so it runs quickly);
- ``fuzz``: the seeded cases of tests/fuzz_utils.py (the GPU fuzz's seeds, 0-255 by default);
- ``env``: Qwen3-30B-A3B T4096 and the first ``--env-fuzz-seeds`` fuzz cases under each documented
  variant: DGE_FUSED_GATHER=0, DGE_FUSED_COMBINE=0.

Outputs are saved as .pt files (per tree, per case) in a temporary directory and compared with
NaN-aware equality (equal, or NaN in both); the table ends the output. Exit status 0 when every case
is identical, 1 otherwise. Both trees' fuzz cases come from this script's tests/fuzz_utils.py, so an
old tree needs only its package. Git is not used: a tree is any directory holding deep_gemm_ext/
(a ``git worktree`` or an unpacked ``git archive``).

    python scripts/compare_trees.py /tmp/old-tree .                    # on the GPU
    python scripts/compare_trees.py /tmp/old-tree . --bench --bench-args="--workloads qwen3-30b-a3b-t4096"
    python scripts/compare_trees.py . . --device cpu                   # tiny cases on the CPU
    python scripts/compare_trees.py /tmp/old-tree . --time-only --time-rounds 3   # speed only, same run

``--time-only``: no outputs compared; each tree's default layer (``mega_moe_train``, fwd+bwd, bf16) is
timed on the headline shapes, the trees in turn (a first in odd rounds, b first in even ones; median of
CUDA-event timings per round, inputs from the tree's ``make_inputs`` with the same seed), and the table
gives b / a. Each timed step starts on an idle GPU (a synchronize ends the one before), so the host's
time before the first kernel is part of it, as in scripts/bench.py.

Comparing a tree with itself checks that the layer is deterministic run to run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUTPUTS = ("y", "dx", "dtopk_w", "dl1", "dl2")
#: The variants README.md documents, each against the defaults.
ENV_VARIANTS = ({"DGE_FUSED_GATHER": "0"}, {"DGE_FUSED_COMBINE": "0"})
#: name -> (T, H, I, E, K); the GPU's headline shapes and the CPU's tiny stand-ins.
HEADLINE = {
    "cuda": {"qwen3-30b-a3b-t16384": (16384, 2048, 768, 128, 8),
             "qwen3-235b-a22b-t8192": (8192, 4096, 1536, 128, 8),
             "deepseek-v3-t8192-e32": (8192, 7168, 2048, 32, 8)},
    "cpu": {"tiny-t48": (48, 64, 32, 8, 2), "tiny-t33": (33, 32, 48, 5, 3)},
}
ENV_SHAPE = {"cuda": ("qwen3-30b-a3b-t4096", (4096, 2048, 768, 128, 8)), "cpu": ("tiny-t48", (48, 64, 32, 8, 2))}
DEFAULT_FUZZ_SEEDS = {"cuda": list(range(256)), "cpu": list(range(6))}
DEFAULT_ENV_FUZZ_SEEDS = {"cuda": 32, "cpu": 2}


# ---------------------------------------------------------------------------------------------
# Child: one tree, every case.


def _env_name(env: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in env.items()) or "default"


def case_list(device_type: str, groups, fuzz_seeds, env_fuzz_seeds: int) -> list[dict]:
    """Every case as a JSON-able description; the same list in both children."""
    cases = []
    if "headline" in groups:
        cases += [dict(name=name, shape=shape, env={}) for name, shape in HEADLINE[device_type].items()]
    if "fuzz" in groups:
        cases += [dict(name=f"fuzz-seed-{s}", seed=s, env={}) for s in fuzz_seeds]
    if "env" in groups:
        name, shape = ENV_SHAPE[device_type]
        for env in ENV_VARIANTS:
            cases.append(dict(name=f"{name} {_env_name(env)}", shape=shape, env=env))
            cases += [dict(name=f"fuzz-seed-{s} {_env_name(env)}", seed=s, env=env)
                      for s in fuzz_seeds[:env_fuzz_seeds]]
    return cases


def _case_inputs(case: dict, device: str):
    """(x, idx, w, l1, l2, dy, clamp) of a case, from its seed."""
    import fuzz_utils
    from deep_gemm_ext.testing import make_inputs

    if "seed" in case:
        fc = fuzz_utils.draw_case(case["seed"], "cuda" if device == "cuda" else "cpu")
        return (*fuzz_utils.make_case_inputs(fc, device), fc.clamp)
    T, H, I, E, K = case["shape"]
    x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, device=device, seed=1234)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(4321)).to(device, x.dtype)
    return x, idx, w, l1, l2, dy, None


def fingerprint(tensors) -> str:
    """A hash of the tensors' bytes, dtypes and shapes."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _set_env(env: dict, base: dict) -> None:
    for key in {k for v in ENV_VARIANTS for k in v}:
        if key in env:
            os.environ[key] = env[key]
        elif base.get(key) is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = base[key]


def run_child(args) -> int:
    tree = Path(args.child).resolve()
    sys.path.insert(0, str(HERE.parent / "tests"))  # fuzz_utils: this script's case generator
    import deep_gemm_ext
    import fuzz_utils

    where = Path(deep_gemm_ext.__file__).resolve()
    if tree not in where.parents:
        print(f"deep_gemm_ext was imported from {where}, not from the tree {tree}", file=sys.stderr)
        return 2
    device = args.device
    out = Path(args.child_out)
    out.mkdir(parents=True, exist_ok=True)
    cases = case_list(device, args.groups, args.fuzz_seeds, args.env_fuzz_seeds)
    if cases:  # the generator must be a function of the seed alone for the comparison to mean anything
        once, again = (fingerprint(_case_inputs(cases[0], device)[:6]) for _ in range(2))
        print(f"[{args.label}] inputs of {cases[0]['name']!r} generated twice on {device}: "
              f"{'identical' if once == again else 'DIFFERENT'}", flush=True)
    base_env = {k: os.environ.get(k) for v in ENV_VARIANTS for k in v}
    manifest = []
    for i, case in enumerate(cases):
        entry = dict(name=case["name"], file=f"case{i:04d}.pt")
        _set_env(case["env"], base_env)
        try:
            x, idx, w, l1, l2, dy, clamp = _case_inputs(case, device)
            entry["inputs"] = fingerprint((x, idx, w, l1, l2, dy))
            y, grads = fuzz_utils.run_layer(fuzz_utils.ours, x, idx, w, l1, l2, clamp, dy)
            if args.hash_only:  # bit identity only: a hash per output instead of a file
                entry["hashes"] = {n: fingerprint([t]) for n, t in zip(OUTPUTS, (y, *grads))}
            else:
                torch.save({n: t.detach().cpu() for n, t in zip(OUTPUTS, (y, *grads))}, out / entry["file"])
        except Exception as exc:  # the comparison reports it, for this case only
            entry["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        manifest.append(entry)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"[{args.label}] {len(manifest)} cases, {sum('error' in e for e in manifest)} raised", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent: run both trees, compare.


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    """(max |a - b| over the elements not NaN in both, equal): equal means the same shape and dtype
    and every element equal or NaN in both. A NaN on one side only counts as an infinite difference."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf"), False
    if not a.is_floating_point():
        diff = (a.long() - b.long()).abs().max().item() if a.numel() else 0
        return float(diff), torch.equal(a, b)
    worst, equal = 0.0, True
    for ca, cb in zip(a.reshape(-1).split(1 << 24), b.reshape(-1).split(1 << 24)):
        both_nan = ca.isnan() & cb.isnan()
        equal &= bool(((ca == cb) | both_nan).all())
        one_nan = ca.isnan() ^ cb.isnan()
        if one_nan.any():
            worst = float("inf")
            continue
        d = (ca.double() - cb.double()).abs().masked_fill(both_nan, 0)
        worst = max(worst, d.max().item() if d.numel() else 0.0)
    return worst, equal


def compare_case(entry_a: dict | None, entry_b: dict | None, dir_a: Path, dir_b: Path, device: str):
    """(max |diff|, identical, what differs) of one case."""
    if entry_a is None or entry_b is None:
        return None, False, "missing in " + ("a" if entry_a is None else "b")
    if "error" in entry_a or "error" in entry_b:
        same = entry_a.get("error") == entry_b.get("error")
        return None, same, f"a: {entry_a.get('error', 'ok')}; b: {entry_b.get('error', 'ok')}"
    if entry_a["inputs"] != entry_b["inputs"]:
        return None, False, "the trees generated different inputs"
    if "hashes" in entry_a and "hashes" in entry_b:  # --hash-only: identical or not, no |diff|
        differing = [name for name in OUTPUTS if entry_a["hashes"][name] != entry_b["hashes"][name]]
        return None, not differing, ", ".join(differing)
    out_a = torch.load(dir_a / entry_a["file"], map_location=device)
    out_b = torch.load(dir_b / entry_b["file"], map_location=device)
    worst, differing = 0.0, []
    for name in OUTPUTS:
        diff, equal = compare_tensors(out_a[name], out_b[name])
        worst = max(worst, diff)
        if not equal:
            differing.append(name)
    return worst, not differing, ", ".join(differing)


def _tree_env(tree: Path, cache: Path, label: str) -> dict:
    """The tree first on PYTHONPATH (the child checks that its deep_gemm_ext came from there; what
    followed stays reachable, e.g. liger_kernel unpacked on a path), its own JIT cache."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, DGE_JIT_CACHE_DIR=str(cache), DGE_COMMIT=f"{label}:{tree}")


def _last_table(text: str) -> str:
    lines = text.rstrip().splitlines()
    end = len(lines)
    while end and not lines[end - 1].startswith("|"):
        end -= 1
    start = end
    while start and lines[start - 1].startswith("|"):
        start -= 1
    return "\n".join(lines[start:end]) or "(no table in the output)"


def prebuild(label: str, tree: Path, cache: Path, work: Path) -> None:
    """Every kernel of the tree compiled into its cache, in parallel (a tree without the build command
    compiles on first use)."""
    if not (tree / "deep_gemm_ext" / "jit" / "__main__.py").is_file():
        print(f"[{label}] no `python -m deep_gemm_ext.jit build` in this tree: kernels compile on first use")
        return
    cmd = [sys.executable, "-m", "deep_gemm_ext.jit", "build", "--arch", "sm_90a", "--all", "-j", str(os.cpu_count())]
    proc = subprocess.run(cmd, env=_tree_env(tree, cache, label), cwd=work, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    print(f"[{label}] jit build exit {proc.returncode}: {last}", flush=True)
    if proc.returncode:
        sys.stdout.write(proc.stdout[-3000:] + proc.stderr[-3000:])


#: The timing child: argv = shape name, T, H, I, E, K, reps; prints "ms <median>".
_TIME_CHILD = """
import sys, statistics, torch, deep_gemm_ext as dge
from deep_gemm_ext.testing import make_inputs
name, T, H, I, E, K, reps = sys.argv[1], *map(int, sys.argv[2:])
x, idx, w, l1, l2 = make_inputs(T, H, I, E, K, device="cuda", seed=1234)
dy = torch.randn_like(x)
def step():
    y = dge.mega_moe_train(x, idx, w, l1, l2)
    torch.autograd.grad(y, (x, w, l1, l2), dy)
for _ in range(3):
    step()
times = []
for _ in range(reps):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); step(); b.record(); torch.cuda.synchronize()
    times.append(a.elapsed_time(b))
print(f"ms {statistics.median(times):.4f}")
"""


def run_timing(trees: dict, caches: dict, rounds: int, reps: int) -> str:
    """The default layer's fwd+bwd median per tree and headline shape; the trees run in turn, a first in
    odd rounds and b first in even ones (so that neither always runs second, e.g. on a warmer GPU)."""
    results = {}
    for r in range(rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, shape in HEADLINE["cuda"].items():
            for label, tree in order:
                proc = subprocess.run([sys.executable, "-c", _TIME_CHILD, name, *map(str, shape), str(reps)],
                                      env=_tree_env(tree, caches[label], label), capture_output=True, text=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ms ")]
                if proc.returncode or not line:
                    raise RuntimeError(f"timing {label} {name} exited {proc.returncode}: {proc.stderr[-1500:]}")
                results.setdefault((name, label), []).append(float(line[-1].split()[1]))
                print(f"[time] round {r + 1} {name} {label}: {results[(name, label)][-1]:.3f} ms", flush=True)
    rows = ["| shape | a ms (per round) | b ms (per round) | b / a (medians) |", "|---|---|---|---|"]
    for name in HEADLINE["cuda"]:
        a, b = results[(name, "a")], results[(name, "b")]
        rows.append(f"| {name} | {' '.join(f'{t:.3f}' for t in a)} | {' '.join(f'{t:.3f}' for t in b)} "
                    f"| {statistics.median(b) / statistics.median(a):.3f} |")
    return "\n".join(rows)


def run_bench(trees: dict, caches: dict, bench_args: list[str], rounds: int) -> list[str]:
    """scripts/bench.py of each tree, alternating a, b per round; the table each one ended with."""
    reports = []
    for r in range(rounds):
        for label, tree in trees.items():
            script = tree / "scripts" / "bench.py"
            if not script.is_file():
                reports.append(f"### bench {label} ({tree}): no scripts/bench.py in this tree")
                continue
            proc = subprocess.run([sys.executable, str(script), *bench_args], env=_tree_env(tree, caches[label], label),
                                  cwd=tree, capture_output=True, text=True)
            sys.stdout.write(proc.stdout[-4000:] if proc.returncode else "")
            sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
            reports.append(f"### bench {label} ({tree}), round {r + 1}, exit {proc.returncode}\n\n"
                           + _last_table(proc.stdout))
    return reports


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree_a", nargs="?", type=Path, help="directory holding deep_gemm_ext/ (e.g. the old tree)")
    p.add_argument("tree_b", nargs="?", type=Path, help="directory holding deep_gemm_ext/ (e.g. the new tree)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--groups", nargs="+", choices=("headline", "fuzz", "env"), default=["headline", "fuzz", "env"])
    p.add_argument("--fuzz-seeds", nargs="+", type=int, default=None,
                   help="default: 0-255 on the GPU (the GPU fuzz's seeds), 0-5 on the CPU")
    p.add_argument("--env-fuzz-seeds", type=int, default=None,
                   help="how many of the fuzz seeds each env variant reruns (default 32 on the GPU, 2 on the CPU)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the .pt files go (default: a new temporary directory, deleted unless --keep)")
    p.add_argument("--cache-root", type=Path, default=None,
                   help="JIT caches <root>/a and <root>/b (default: under the work dir); reuse one to skip rebuilds")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--hash-only", action="store_true",
                   help="store a hash of each output instead of the tensors (much faster on the headline shapes; "
                        "reports identical or not, without max |diff|)")
    p.add_argument("--prebuild", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each tree's kernels in parallel first (python -m deep_gemm_ext.jit build "
                        "--all) rather than one by one on first use; default on for cuda")
    p.add_argument("--bench", action="store_true", help="also run each tree's scripts/bench.py, alternately")
    p.add_argument("--bench-args", default="", help="arguments for bench.py (one string)")
    p.add_argument("--bench-rounds", type=int, default=1)
    p.add_argument("--time-only", action="store_true", help="only time both trees' default layer (see above)")
    p.add_argument("--time-rounds", type=int, default=3)
    p.add_argument("--time-reps", type=int, default=20)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fuzz_seeds is None:
        args.fuzz_seeds = DEFAULT_FUZZ_SEEDS[args.device]
    if args.prebuild is None:
        args.prebuild = args.device == "cuda"
    if args.env_fuzz_seeds is None:
        args.env_fuzz_seeds = DEFAULT_ENV_FUZZ_SEEDS[args.device]
    if args.child is None:
        for name in ("tree_a", "tree_b"):
            tree = getattr(args, name)
            if tree is None or not (tree / "deep_gemm_ext" / "__init__.py").is_file():
                p.error(f"{name}={tree}: expected a directory holding deep_gemm_ext/__init__.py")
            setattr(args, name, tree.resolve())
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return run_child(args)
    import shutil

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dge-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    cache_root = args.cache_root or work / "jit-cache"
    trees = {"a": args.tree_a, "b": args.tree_b}
    caches = {label: cache_root / label for label in trees}
    child_args = ["--device", args.device, *(["--hash-only"] if args.hash_only else []),
                  "--groups", *args.groups, "--fuzz-seeds", *map(str, args.fuzz_seeds),
                  "--env-fuzz-seeds", str(args.env_fuzz_seeds)]
    failed = []
    if args.time_only:
        for label, tree in trees.items():
            if args.prebuild:
                prebuild(label, tree, caches[label], work)
        table = run_timing(trees, caches, args.time_rounds, args.time_reps)
        print(f"\na = {args.tree_a}\nb = {args.tree_b}\n\n{table}")
        return 0
    for label, tree in trees.items():
        if args.prebuild:
            prebuild(label, tree, caches[label], work)
        print(f"[{label}] {tree}: running the cases (JIT cache {caches[label]})", flush=True)
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *child_args, "--child", str(tree),
                             "--child-out", str(work / label), "--label", label],
                            env=_tree_env(tree, caches[label], label), cwd=work).returncode
        if rc:
            failed.append(f"tree {label} exited {rc}")

    def manifest(label):
        path = work / label / "manifest.json"
        return {e["name"]: e for e in json.loads(path.read_text())} if path.is_file() else {}

    man_a, man_b = manifest("a"), manifest("b")
    compare_device = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    rows = []
    for name in dict.fromkeys([*man_a, *man_b]):
        diff, same, what = compare_case(man_a.get(name), man_b.get(name), work / "a", work / "b", compare_device)
        rows.append((name, diff, same, what))
    reports = run_bench(trees, caches, args.bench_args.split(), args.bench_rounds) if args.bench else []
    if not args.keep and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"outputs kept in {work}")

    for report in reports:
        print(f"\n{report}")
    print(f"\na = {args.tree_a}\nb = {args.tree_b}\n")
    for line in failed:
        print(f"- {line}")
    identical = sum(same for _, _, same, _ in rows)
    print(f"- {identical} of {len(rows)} cases identical on {args.device}\n")
    print("| case | max abs diff | identical | differs in |")
    print("|---|---|---|---|")
    for name, diff, same, what in rows:
        print(f"| {name} | {'-' if diff is None else f'{diff:.3e}'} | {'yes' if same else 'NO'} | {what or '-'} |")
    return 0 if rows and identical == len(rows) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
