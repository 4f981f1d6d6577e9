"""The benchmark, tree-comparison and profiling scripts on the CPU: their dry runs end to end, and
the parts the GPU runs rely on (skip reasons, the torch.compile fallback, NaN-aware comparison, the
kernel-gap arithmetic, the Liger adapter's argument conversion, the upstream GEMM comparison's
reasons and error arithmetic)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from deep_gemm_ext import baselines
from deep_gemm_ext.providers import deepgemm
from deep_gemm_ext.testing import WORKLOADS, Workload, make_inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load("bench")
compare_trees = _load("compare_trees")
profile_layer = _load("profile_layer")
gemm_bench = _load("gemm_bench")
layer_variants = _load("layer_variants")

TINY = Workload("tiny", 24, 32, 16, 4, 2)


def _last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# bench.py


def test_bench_dry_run_end_to_end(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--dry-run", "--no-compile", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _last_line(proc.stdout).startswith("| dry-run | ours | torch |")
    assert "x compiled grouped_mm" in proc.stdout
    records = json.loads(out.read_text())
    measured = [r for r in records if "skipped" not in r]
    assert {(r["impl"], r["backend"]) for r in measured} >= {("grouped_mm", "torch"), ("ours", "auto")}
    for r in measured:
        assert r["check_max_rel_err"] < bench.CHECK_MAX_REL_ERR[r["recipe"]]
        assert r["fwdbwd_ms"] > 0
        assert r["ratio_vs_compiled_grouped_mm"] is None  # --no-compile: no such row to divide by
    if not torch.cuda.is_available():
        assert "not measured: liger (triton, bf16): Liger-Kernel's fused MoE is Triton code" in proc.stdout


def _records(impls, capsys):
    meta = dict(gpu="cpu", commit="test", date="today")
    records = bench.run_workload(TINY, impls, {}, 1, "cpu", meta, check=TINY)
    return {(r["impl"], r["backend"]): r for r in records}, capsys.readouterr().out


def test_bench_hands_each_row_over_as_it_finishes(capsys):
    """A run stopped by a time limit keeps every row it finished: on_row gets the workload's records after each
    row (a failing row too), and each timed line carries the row's ratios to the baselines timed before it."""
    def raises(*args):
        raise RuntimeError("no kernel for this shape")

    impls = {bench.BASE: bench.Impl(baselines.grouped_mm_moe), ("broken", "x", "bf16"): bench.Impl(raises),
             ("ours", "auto", "bf16"): bench.Impl(bench._ours())}
    seen = []
    meta = dict(gpu="cpu", commit="test", date="today")
    records = bench.run_workload(TINY, impls, {}, 1, "cpu", meta, check=TINY,
                                 on_row=lambda rows: seen.append([(r["impl"], "skipped" in r) for r in rows]))
    assert seen == [[("grouped_mm", False)], [("grouped_mm", False), ("broken", True)],
                    [("grouped_mm", False), ("broken", True), ("ours", False)]]
    out = capsys.readouterr().out
    ours = [line for line in out.splitlines() if line.startswith("tiny: ours (auto, bf16) timed:")]
    assert len(ours) == 1 and "x grouped_mm, - compiled, peak - GiB" in ours[0], ours
    ratio = next(r for r in records if r["impl"] == "ours")["ratio_vs_grouped_mm"]
    assert f"{ratio:.2f}x grouped_mm" in ours[0]


def test_bench_rows_do_not_inherit_the_fp8_weight_cache():
    """An fp8 row leaves its weights' fp8 copies cached; the next row starts without them, so its
    memory columns are its own."""
    from deep_gemm_ext.recipes import WEIGHT_CACHE
    inputs = make_inputs(16, 128, 128, 4, 2, device="cpu", seed=3)  # fp8: 128 x 128 weight blocks
    seen = []

    def bf16_row(*args):
        seen.append(len(WEIGHT_CACHE))
        return bench._ours()(*args)
    bench.bench_one(bench.Impl(bench._ours(recipe="fp8")), inputs, reps=1, device="cpu")
    assert len(WEIGHT_CACHE) > 0  # the fp8 row's copies of l1 and l2
    bench.bench_one(bench.Impl(bf16_row), inputs, reps=1, device="cpu")
    assert seen and seen[0] == 0


def test_bench_requantizing_row_quantizes_the_weights_in_every_call(monkeypatch):
    """auto+requant: every call's weights are a new version (an optimizer step before it), so each call
    quantizes l1 and l2 once, where the cached row quantizes them in its first call only."""
    from deep_gemm_ext.recipes import fp8
    inputs = make_inputs(16, 128, 128, 4, 2, device="cpu", seed=3)
    calls = []
    real = fp8.Fp8ExpertWeights.from_bf16
    monkeypatch.setattr(fp8.Fp8ExpertWeights, "from_bf16", classmethod(lambda cls, w: calls.append(1) or real(w)))
    impls = bench.implementations(False, compiled=False)
    for backend, per_call in (("auto", False), ("auto+requant", True)):
        fp8.WEIGHT_CACHE.clear()
        fn = impls[("ours", backend, "fp8")].fn
        calls.clear()
        for _ in range(3):
            fn(*inputs).sum().backward()
        assert len(calls) == (6 if per_call else 2), backend


def test_bench_fp8_rows_are_bounded_by_the_emulation():
    """An fp8 row is timed only within 1.02x (+1e-3) of the fp32 emulation's error (the protocol); bf16 rows
    within the fixed bound."""
    emulated = dict.fromkeys(bench.OUTPUTS, 0.065)
    assert bench.error_bounds("fp8", "auto", emulated) == dict.fromkeys(bench.OUTPUTS, 1.02 * 0.065 + 1e-3)
    assert bench.error_bounds("fp8", "deep_gemm", emulated)["y"] == pytest.approx(1.1 * 0.065 + 2e-3)
    assert bench.error_bounds("bf16", "auto", None) == dict.fromkeys(bench.OUTPUTS, 2e-2)
    impl = bench.Impl(bench._ours(recipe="fp8"))
    errors, emulated = bench.check_errors(impl, "cpu", bench.DRY_RUN, emulate_fp8=True)  # 128 x 128 blocks
    bounds = bench.error_bounds("fp8", "auto", emulated)
    assert all(errors[name] <= bounds[name] for name in bench.OUTPUTS), (errors, bounds)
    # The emulation layer itself is what the CPU row runs: its error is the emulation's, to rounding.
    assert all(abs(errors[name] - emulated[name]) <= 1e-6 + 1e-3 * emulated[name] for name in bench.OUTPUTS)


def test_bench_energy_column_is_power_times_time(capsys):
    """J per forward+backward: the median power times the median time; "-" without NVML readings."""
    read = dict(sm_mhz=1590.4, power_w=738.25, power_capped=1.0)
    got = bench._readings_record(read, 8.054)
    assert got == dict(sm_mhz=1590, power_w=738.2, power_capped=1.0, energy_j=round(738.25 * 8.054e-3, 4))
    assert bench._readings_record(None, 8.054)["energy_j"] is None
    row = dict(workload="w", impl="ours", backend="auto", recipe="bf16", fwd_ms=2.0, fwdbwd_ms=8.054, tflops=461.0,
               ratio_vs_grouped_mm=3.1, ratio_vs_compiled_grouped_mm=1.75, peak_gib=3.97, saved_gib=0.48, **got)
    bench.print_table([row, dict(row, **bench._readings_record(None, 8.054))])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| SM MHz | W | capped | J |") and lines[1].count("|") == lines[0].count("|")
    assert lines[2].endswith("| 1590 | 738 | 100% | 5.95 |") and lines[3].endswith("| - | - | - | - |")


def test_layer_variants_dry_run_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "layer_variants.py"), "--dry-run", "--reps", "1",
                           "--rounds", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| dry-run |")]
    assert [line.split(" | ")[1] for line in rows] == list(layer_variants.VARIANTS)
    assert all(" | same | " in line for line in rows), proc.stdout


def test_layer_variants_give_the_launchers_their_options(monkeypatch):
    """A variant's options reach every bf16 GEMM launch that takes them (not a gathering or paired one), and
    the launchers are restored after it."""
    from deep_gemm_ext import jit_kernels as kernels
    seen = []

    def fake(name):
        def launcher(*args, **kwargs):
            seen.append((name, kwargs))
        return launcher
    for name in layer_variants.LAUNCHERS:
        monkeypatch.setattr(kernels, name, fake(name))
    before = {n: getattr(kernels, n) for n in layer_variants.LAUNCHERS}
    with layer_variants.variant("c2+pool"):
        assert os.environ["DGE_FUSED_GATHER"] == "0"
        kernels.m_grouped_bf16_gemm_nt_contiguous("a", "b", gather=None, scatter="s")
        kernels.m_grouped_bf16_gemm_nt_contiguous("a", "b", gather="g")
        kernels.m_grouped_bf16_gemm_nt_contiguous("a", "b", paired_n=True)
        kernels.k_grouped_bf16_gemm_tn_contiguous("a", "b")
    assert seen == [("m_grouped_bf16_gemm_nt_contiguous", dict(gather=None, scatter="s", cluster_n=2)),
                    ("m_grouped_bf16_gemm_nt_contiguous", dict(gather="g")),
                    ("m_grouped_bf16_gemm_nt_contiguous", dict(paired_n=True)),
                    ("k_grouped_bf16_gemm_tn_contiguous", dict(cluster_n=2))]
    assert {n: getattr(kernels, n) for n in layer_variants.LAUNCHERS} == before
    with layer_variants.variant("default"):
        assert {n: getattr(kernels, n) for n in layer_variants.LAUNCHERS} == before


def test_gemm_bench_variants_row_checks_bits_where_written_and_alternates(monkeypatch):
    """gemm_bench's variant tables: bits compared on the first ``used`` rows only, each variant timed in two
    rounds with the variants alternating, its better TFLOP/s kept."""
    order, times = [], iter([4.0, 2.0, 1.0, 8.0])  # ms: round 1 a, b; round 2 a, b

    def fake_median_ms(fn, reps, calls=1):
        order.append(fn())
        return next(times)
    monkeypatch.setattr(gemm_bench, "median_ms", fake_median_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    out = torch.randn(6, 4).to(torch.bfloat16)
    other = out.clone()
    other[4:] = float("nan")  # past `used`: not compared
    variants = {"a": lambda: out, "b": lambda: other}
    args = types.SimpleNamespace(reps=1, calls=1)
    row = gemm_bench._variants_row(variants, 1e9, 4, args)
    assert row == {"bit_identical": True, "a": 1e9 / 1.0 / 1e9, "b": 1e9 / 2.0 / 1e9}
    assert [o is out for o in order] == [True, False, True, False]
    other[0, 0] = other[0, 0] + 1
    times = iter([1.0] * 4)
    assert gemm_bench._variants_row(variants, 1e9, 4, args)["bit_identical"] is False


def test_bench_reports_failing_and_wrong_rows(capsys):
    def raises(*args):
        raise RuntimeError("no kernel for this shape")

    def wrong(x, idx, w, l1, l2):
        return baselines.grouped_mm_moe(x, idx, w, l1, l2) * 1.5

    impls = {bench.BASE: bench.Impl(baselines.grouped_mm_moe), ("broken", "x", "bf16"): bench.Impl(raises),
             ("wrong", "x", "bf16"): bench.Impl(wrong)}
    rows, out = _records(impls, capsys)
    assert rows[("broken", "x")]["skipped"] == "RuntimeError: no kernel for this shape"
    assert rows[("wrong", "x")]["skipped"].startswith("RuntimeError: disagrees with the fp64 reference")
    assert "tiny: broken (x, bf16) skipped: RuntimeError: no kernel for this shape" in out
    assert rows[("grouped_mm", "torch")]["ratio_vs_grouped_mm"] == 1.0
    assert rows[("grouped_mm", "torch")]["check_max_rel_err"] < 2e-2


def test_bench_compiled_row_falls_back_with_a_note(monkeypatch, capsys):
    """fullgraph=True failing on the first call: the row is timed with graph breaks and says why."""
    calls = []

    def fake_compile(fn, fullgraph=False, dynamic=None):
        assert dynamic is False
        calls.append(fullgraph)
        if fullgraph:
            def fails(*args):
                raise torch._dynamo.exc.Unsupported("data-dependent .tolist()")
            return fails
        return fn

    monkeypatch.setattr(bench.torch, "compile", fake_compile)
    impl = bench.compiled_grouped_mm()
    rows, out = _records({bench.BASE: bench.Impl(baselines.grouped_mm_moe), bench.COMPILED: impl}, capsys)
    assert calls == [True, False]
    row = rows[("grouped_mm", "torch.compile")]
    assert "skipped" not in row
    assert row["notes"] and "(fullgraph=True) failed (Unsupported: data-dependent .tolist())" in row["notes"][0]
    assert row["ratio_vs_compiled_grouped_mm"] == 1.0


def test_bench_plot_only_ignores_skipped_records(tmp_path, capsys):
    records = [dict(workload="w", impl="liger", backend="triton", recipe="bf16", skipped="no GPU")]
    bench.draw_png(records, tmp_path / "x.png")
    assert "no measured rows" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------
# The Liger adapter (its kernels need a GPU; the conversion does not)


def test_liger_inputs_convert_only_the_ids():
    x, idx, w, l1, l2 = make_inputs(8, 16, 8, 4, 2, seed=3)
    args = baselines.liger_inputs(x, idx, w, l1, l2)
    assert args[0] is x and args[1] is l1 and args[2] is l2 and args[4] is w  # gradients reach our leaves
    assert args[3].dtype == torch.int32 and torch.equal(args[3].long(), idx)


def test_liger_inputs_reject_what_liger_cannot_do():
    x, idx, w, l1, l2 = make_inputs(8, 16, 8, 4, 2, routing="unused_slots", seed=5)
    assert (idx < 0).any()
    with pytest.raises(ValueError, match=r"topk_idx has unused slots \(min id -1\)"):
        baselines.liger_inputs(x, idx, w, l1, l2)
    with pytest.raises(ValueError, match="activation_clamp=1.0: Liger's fused MoE has no clamp"):
        baselines.liger_inputs(x, idx.clamp(min=0), w, l1, l2, activation_clamp=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without a GPU")
def test_liger_unavailable_reason_without_gpu():
    assert "needs a CUDA GPU" in baselines.liger_unavailable_reason()


# ---------------------------------------------------------------------------------------------
# compare_trees.py


def test_compare_tensors_is_nan_aware():
    nan = float("nan")
    a = torch.tensor([1.0, nan, 0.0, -2.0])
    assert compare_trees.compare_tensors(a, a.clone()) == (0.0, True)
    assert compare_trees.compare_tensors(a, torch.tensor([1.0, nan, -0.0, -2.0])) == (0.0, True)
    assert compare_trees.compare_tensors(a, torch.tensor([1.0, nan, 0.0, -2.5])) == (0.5, False)
    assert compare_trees.compare_tensors(a, torch.tensor([1.0, 3.0, 0.0, -2.0])) == (float("inf"), False)
    assert compare_trees.compare_tensors(a, a.double())[1] is False
    assert compare_trees.compare_tensors(a, a[:3])[1] is False
    assert compare_trees.compare_tensors(torch.empty(0, 3), torch.empty(0, 3)) == (0.0, True)


def _copy_tree(dst: Path) -> Path:
    shutil.copytree(ROOT / "deep_gemm_ext", dst / "deep_gemm_ext", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _compare(tree_a, tree_b, tmp_path, *extra):
    cmd = [sys.executable, str(SCRIPTS / "compare_trees.py"), str(tree_a), str(tree_b), "--device", "cpu",
           "--groups", "headline", "fuzz", "--fuzz-seeds", "0", "2", "--cache-root", str(tmp_path / "cache"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)


def test_compare_trees_same_tree_is_identical(tmp_path):
    proc = _compare(_copy_tree(tmp_path / "a"), ROOT, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 of 4 cases identical on cpu" in proc.stdout
    assert "generated twice on cpu: identical" in proc.stdout
    assert _last_line(proc.stdout).startswith("| fuzz-seed-2 | 0.000e+00 | yes |")


@pytest.mark.parametrize("hash_only", [False, True], ids=["tensors", "hashes"])
def test_compare_trees_reports_a_perturbed_tree(tmp_path, hash_only):
    tree = _copy_tree(tmp_path / "perturbed")
    with open(tree / "deep_gemm_ext" / "__init__.py", "a") as f:
        f.write("\n_unperturbed = mega_moe_train\n\n\ndef mega_moe_train(x, *args, **kwargs):\n"
                "    return _unperturbed(x, *args, **kwargs) * 1.0078125\n")
    proc = _compare(ROOT, tree, tmp_path, *(["--hash-only"] if hash_only else []))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny-t48 ")]
    assert len(rows) == 1 and "| NO | y, dx, dtopk_w, dl1, dl2 |" in rows[0]
    assert "0 of 4 cases identical" in proc.stdout


def test_compare_trees_rejects_a_directory_without_the_package(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "compare_trees.py"), str(tmp_path), str(ROOT)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"tree_a={tmp_path}: expected a directory holding deep_gemm_ext/__init__.py" in proc.stderr


def test_compare_trees_last_table():
    text = "log\n| a | b |\n|---|---|\n| 1 | 2 |\n\ntrailing words\n"
    assert compare_trees._last_table(text) == "| a | b |\n|---|---|\n| 1 | 2 |"


# ---------------------------------------------------------------------------------------------
# profile_layer.py


def test_kernel_gaps_per_stream():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "swiglu", "ts": 15, "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 30, "dur": 1, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 12, "dur": 10, "args": {"stream": 9}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1},
    ]}
    acts = profile_layer.device_activities(trace)
    assert [a["name"] for a in acts] == ["gemm", "swiglu", "[memset] Memset", "gemm"]
    s = profile_layer.summarize(acts)
    assert (s["kernels"], s["kernel_us"], s["activities"], s["streams"]) == (3, 25.0, 4, 2)
    # stream 7: 10 -> 15 and 20 -> 30; the gemm on stream 9 overlaps, no gap of its own
    assert (s["gaps"], s["gap_us"], s["span_us"]) == (2, 15.0, 31.0)
    assert s["largest_gaps"][0] == (10.0, "swiglu", "[memset] Memset")
    assert s["per_name"][0] == ("gemm", 2, 20.0)


def test_gemm_label_names_our_gemm_configurations():
    fp8 = ("void dge::gemm::sm90_grouped_gemm_kernel<dge::gemm::GemmTraits<(dge::sched::GroupedGemmType)0, "
           "(dge::mma::Major)0, (dge::mma::Major)0, 192u, 4u, 1u, false, 16u, (dge::gemm::ElementType)1, "
           "1536u>, dge::gemm::LoaderTma, dge::gemm::MainloopFP8, "
           "dge::gemm::EpilogueScatterSlots<false>, float const*, float const*, __nv_bfloat16*, int const*, "
           "float const*, unsigned int, unsigned int, unsigned int>(int const*, int const*, unsigned int)")
    assert profile_layer.gemm_label(fp8) == "GEMM M-grouped MainloopFP8 EpilogueScatterSlots n192 s4 c1 K1536"
    wgrad = ("void dge::gemm::sm90_grouped_gemm_kernel<dge::gemm::GemmTraits<(dge::sched::GroupedGemmType)1, "
             "(dge::mma::Major)1, (dge::mma::Major)1, 256u, 4u, 1u, false, 16u, (dge::gemm::ElementType)0, "
             "0u>, dge::gemm::LoaderTma, dge::gemm::MainloopBF16, "
             "dge::gemm::EpilogueStoreBF16, CUtensorMap_st>(int const*, int const*)")
    assert profile_layer.gemm_label(wgrad) == "GEMM K-grouped MainloopBF16 EpilogueStoreBF16 n256 s4 c1 K0"
    staged = wgrad.replace("EpilogueStoreBF16,", "EpilogueStoreBF16Buffers<3u>,").replace("256u, 4u, 1u", "192u, 4u, 2u")
    assert profile_layer.gemm_label(staged) == "GEMM K-grouped MainloopBF16 EpilogueStoreBF16Buffers n192 s4 c2 K0"
    assert profile_layer.gemm_label("void dge::swiglu_backward_fp8_kernel<false>(__nv_bfloat16 const*)") is None


def test_profile_kernels_rejects_no_steps(capsys):
    assert profile_layer.main(["kernels", "--steps", "0"]) == 2
    assert "--steps 0: expected at least 1" in capsys.readouterr().err
    assert profile_layer.main(["kernels", "--warm-ms", "-1"]) == 2
    assert "--warm-ms -1.0: expected a number >= 0" in capsys.readouterr().err


def test_profile_after_marker_keeps_the_profiled_steps():
    acts = [dict(name="gemm", stream=7, ts=0.0, dur=10.0),       # warm-up, queued before the marker
            dict(name="swiglu", stream=7, ts=10.0, dur=5.0),
            dict(name="void at::native::spin_kernel(long)", stream=7, ts=15.0, dur=1.0),
            dict(name="gemm", stream=7, ts=16.0, dur=10.0),      # profiled
            dict(name="[memset] Memset", stream=7, ts=30.0, dur=1.0)]
    kept = profile_layer.after_marker(acts, profile_layer.MARKER_KERNEL)
    assert [(a["name"], a["ts"]) for a in kept] == [("gemm", 16.0), ("[memset] Memset", 30.0)]
    s = profile_layer.summarize(kept)
    assert (s["kernels"], s["kernel_us"], s["gap_us"], s["span_us"]) == (1, 10.0, 4.0, 15.0)
    with pytest.raises(ValueError, match="spin_kernel"):
        profile_layer.after_marker(acts[:2], profile_layer.MARKER_KERNEL)


def test_profile_sync_dry_run(capsys, monkeypatch):
    monkeypatch.setenv("DGE_CHECK_IDS", "1")
    assert profile_layer.main(["sync", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| DGE_CHECK_IDS | median step ms |" in out
    assert _last_line(out).count("|") == 4
    import os
    assert os.environ["DGE_CHECK_IDS"] == "1"  # restored


def test_profile_host_dry_run(capsys, monkeypatch):
    monkeypatch.delenv("DGE_EAGER_CUSTOM_OP", raising=False)
    assert profile_layer.main(["host", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("| workload | path | step ms, idle start | step ms, back to back | host forward ms | host backward ms |"
            in out)
    assert "custom ops (DGE_EAGER_CUSTOM_OP=1)" in out and "autograd.Function (default)" in out
    assert _last_line(out).count("|") == 7
    assert all(float(v) > 0 for v in _last_line(out).strip("|").split("|")[2:])
    import os
    assert "DGE_EAGER_CUSTOM_OP" not in os.environ  # restored


def test_profile_host_dry_run_fp8(capsys):
    assert profile_layer.main(["host", "--dry-run", "--recipe", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "recipe=fp8" in out and _last_line(out).count("|") == 7


def test_profile_old_command_line_means_kernels():
    if torch.cuda.is_available():
        pytest.skip("runs the profile on a GPU")
    assert profile_layer.main(["--impl", "ours"]) == 2  # parsed as `kernels --impl ours`, then no GPU


# ---------------------------------------------------------------------------------------------
# bench_ep_multi.py


def test_bench_ep_multi_dry_run_with_torchrun(tmp_path):
    """Two gloo ranks on the CPU through torchrun: the torchtitan-style EP baseline passes its check
    against our layer's y and is timed, ours over the all-to-all (bf16 and fp8) and the stubbed
    local layer are timed, the symmetric rows say why they are not, and both tables appear."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "bench_ep_multi.py"), "--dry-run", "--reps", "3", "--warmup", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = proc.stdout
    assert "| workload | row | ms | TFLOP/s per GPU | x torchtitan eager | x torchtitan compiled |" in out
    rows = {line.split(" | ")[1]: line for line in out.splitlines() if line.startswith("| tiny (dry run) |")}
    for label in ("torchtitan way (all_to_all_single + grouped_mm), eager", "ours, all-to-all (EpBuffer), bf16",
                  "ours, all-to-all (EpBuffer), fp8", "exchange pieces alone (all_to_all, bf16 rows)"):
        assert label in rows and "not measured" not in rows[label], (label, out)
    assert rows["torchtitan way (all_to_all_single + grouped_mm), eager"].split(" | ")[4] == "1.00x"
    assert any(k.startswith("local layer, exchange stubbed") and "not measured" not in v for k, v in rows.items())
    assert "not measured: needs CUDA GPUs" in rows["ours, symmetric (SymmetricEpBuffer), bf16"]
    assert "| workload | row | t_ep ms | t_stub ms | t_comm_alone ms | fraction hidden |" in out
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST': '1'" in out


def test_profile_memory_replay_finds_the_peak():
    """The allocator-trace replay: the peak of allocs less requested frees, and what is alive there."""
    def ev(action, addr, size, name="f"):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": "/x/deep_gemm_ext/layer.py", "line": 7, "name": name}]}
    events = [ev("alloc", 1, 100), ev("alloc", 2, 50), ev("free_requested", 1, 100), ev("free_completed", 1, 100),
              ev("alloc", 3, 120, "big"), ev("alloc", 4, 10), ev("free_requested", 3, 120), ev("alloc", 5, 60)]
    peak, index, alive = profile_layer.replay_peak(events)
    assert (peak, index) == (180, 5)
    assert sorted(e["addr"] for e in alive) == [2, 3, 4]
    assert profile_layer._alloc_site(alive[1]) == "layer.py:7:big"
    assert profile_layer.replay_peak([]) == (0, -1, [])
    if not torch.cuda.is_available():
        assert profile_layer.main(["memory"]) == 2


# ---------------------------------------------------------------------------------------------
# gemm_bench.py --upstream


@pytest.fixture
def deep_gemm_module(monkeypatch):
    """Sets what `import deep_gemm` gives (None: ImportError) for the provider's cached import."""
    def use(module):
        deepgemm._load.cache_clear()
        monkeypatch.setitem(sys.modules, "deep_gemm", module)
    yield use
    deepgemm._load.cache_clear()


def test_gemm_bench_upstream_without_deep_gemm_says_why(deep_gemm_module, capsys):
    deep_gemm_module(None)
    assert gemm_bench.main(["--upstream", "--workload", "qwen3-30b-a3b-t4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("not measured: DeepGEMM is not importable in this process (ModuleNotFoundError")
    assert out.count("\n") == 1 and "install.sh" in out and "libstdc++.so.6" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without a GPU")
def test_gemm_bench_upstream_without_gpu_says_why(deep_gemm_module, capsys):
    deep_gemm_module(types.ModuleType("deep_gemm"))
    assert gemm_bench.main(["--upstream"]) == 0
    out = capsys.readouterr().out
    assert out == "not measured: upstream DeepGEMM's SM90 GEMMs need a CUDA GPU, and torch sees none\n"


def test_gemm_bench_ceiling_without_gpu_says_why(capsys):
    assert gemm_bench.main(["--ceiling"]) == 0
    assert capsys.readouterr().out == "not measured: no CUDA GPU\n"
    with pytest.raises(SystemExit):
        gemm_bench.main(["--ceiling", "--fp8"])  # one table at a time


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU --wgrad runs its table")
def test_gemm_bench_wgrad_without_gpu_says_why(capsys):
    assert gemm_bench.main(["--wgrad"]) == 0
    assert capsys.readouterr().out == "not measured: no CUDA GPU\n"
    with pytest.raises(SystemExit):
        gemm_bench.main(["--wgrad", "--fp8"])  # one table at a time
    assert "one table at a time" in capsys.readouterr().err


def test_gemm_bench_upstream_is_a_table_of_its_own(capsys):
    with pytest.raises(SystemExit):
        gemm_bench.main(["--upstream", "--fp8"])
    assert "one table at a time" in capsys.readouterr().err


def test_gemm_bench_relative_errors_one_expert_at_a_time():
    """The references of --upstream's check, on the CPU: per-expert fp64 pieces, errors summed over them."""
    g = torch.Generator().manual_seed(0)
    bounds = [(0, 3), (3, 3), (3, 7)]  # the middle expert owns no rows
    a, b = torch.randn(7, 5, generator=g), torch.randn(7, 4, generator=g)
    w = torch.randn(3, 4, 5, generator=g)  # [E, N, K]
    exact = torch.cat([a[s:t] @ w[e].t() for e, (s, t) in enumerate(bounds)])
    pieces = list(gemm_bench._m_grouped_reference(bounds, lambda s, t: a[s:t], lambda e: w[e]))
    assert [index for index, _ in pieces] == [slice(0, 3), slice(3, 7)]
    assert all(ref.dtype == torch.float64 for _, ref in pieces)
    off = exact.clone()
    off[4] += 1.0
    errs = gemm_bench._rel_errs([exact, off], pieces)
    assert errs[0] < 1e-6 and errs[1] == pytest.approx(4 ** 0.5 / exact.double().norm().item(), rel=1e-5)
    wgrad = torch.stack([a[s:t].t() @ b[s:t] for s, t in bounds])  # [E, 5, 4]: zeros for the empty expert
    pieces = list(gemm_bench._k_grouped_reference(bounds, lambda s, t: a[s:t], lambda s, t: b[s:t]))
    assert [index for index, _ in pieces] == [0, 1, 2] and not pieces[1][1].any()
    assert gemm_bench._rel_errs([wgrad], pieces)[0] < 1e-6


# ---------------------------------------------------------------------------------------------
# walk_l2_model.py


def test_walk_l2_model_bounds():
    """With an L2 that holds everything the model reads each slab once (the minimum); with none, every
    touch of every K step; under every walk (the order changes what is re-read, not what is read)."""
    model = _load("walk_l2_model")
    from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
    bm, bn, step = model.BLOCK_M, model.BLOCK_N, model.K_STEP
    sizes = [3, 0, 5, 1, 7, 2, 4]  # blocks per expert, an empty one among them
    starts, ends, row = [], [], 0
    for s in sizes:
        starts.append(row)
        row += s * bm
        ends.append(row)
    n, k = 3 * bn, 4 * step
    blocks, experts = sum(sizes), sum(1 for s in sizes if s)
    for size, eg in ((4, False), (4, True), (1, False)):
        tiles = gg.walk_tiles(starts, ends, n // bn, size, eg)
        assert len(tiles) == blocks * (n // bn)
        assert model.dram_bytes(tiles, n, k, l2_bytes=1 << 40, sms=8) == blocks * bm * k * 2 + experts * n * k * 2
        assert model.dram_bytes(tiles, n, k, l2_bytes=0, sms=8) == len(tiles) * (k // step) * (bm + bn) * step * 2


def test_walk_l2_model_rejects_a_bad_walk(capsys, monkeypatch):
    model = _load("walk_l2_model")
    monkeypatch.setattr(sys, "argv", ["walk_l2_model.py", "--walks", "16,e3"])
    with pytest.raises(SystemExit):
        model.main()
    assert "--walks: 'e3'" in capsys.readouterr().err


def test_gemm_bench_walks_without_gpu_says_why(capsys):
    assert gemm_bench.main(["--walks"]) == 0
    assert capsys.readouterr().out == "not measured: no CUDA GPU\n"
    assert gemm_bench._parse_walks("16,e8,1") == {"16": (16, False), "e8": (8, True), "1": (1, False)}
    for bad in ("16,e3", "x", "e", "16,-4"):
        with pytest.raises(SystemExit):
            gemm_bench.main(["--walks", "--walk-list", bad])
        assert "--walk-list:" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        gemm_bench.main(["--walks", "--clusters"])  # one table at a time
    assert "one table at a time" in capsys.readouterr().err


def test_gemm_bench_walks_table_passes_each_walk_and_checks_bits(monkeypatch, capsys, tmp_path):
    """--walks on fake launchers: each GEMM runs under every walk of --walk-list with its group_m and expert_groups,
    select_walk's choice is reported, walks within experts with the same tile order are marked as such, and a walk
    whose output differs fails the table."""
    w = WORKLOADS["qwen3-30b-a3b-t4096"]
    E, H, I, T, K = w.num_experts, w.hidden, w.intermediate, w.num_tokens, w.top_k
    rows, used = 4 * 128, 3 * 128
    meta = types.SimpleNamespace(row_to_slot=torch.zeros(rows, dtype=torch.int32))
    # Three experts of one block each: every walk within experts is the same tile order (each expert one group).
    starts, ends = torch.tensor([0, 128, 256]), torch.tensor([128, 256, 384])
    operands = (meta, starts, ends, used, rows, H, I, torch.zeros(rows, 8), None, None, None,
                torch.zeros(1, dtype=torch.bfloat16), None, "combine", "plain")
    calls = []
    broken = {"walk": None}

    def launcher(layout):
        def run(a, b, starts, ends, *, gather=None, scatter=None, group_m=None, expert_groups=None):
            calls.append((layout, scatter, group_m, expert_groups))
            out = torch.zeros(rows, 4, dtype=torch.bfloat16)
            if (group_m, expert_groups) == broken["walk"]:
                out[0, 0] = 1
            return out
        return run
    monkeypatch.setattr(gemm_bench, "_layer_operands", lambda wl: operands)
    monkeypatch.setattr(gemm_bench.gg, "m_grouped_bf16_gemm_nt_contiguous", launcher("nt"))
    monkeypatch.setattr(gemm_bench.gg, "m_grouped_bf16_gemm_nn_contiguous", launcher("nn"))
    monkeypatch.setattr(gemm_bench.gg, "Gather", lambda *a, **k: "gather")
    monkeypatch.setattr(gemm_bench, "median_ms", lambda fn, reps, calls=1: (fn(), 1.0)[1])
    for name in ("is_available",):
        monkeypatch.setattr(torch.cuda, name, lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake")
    out = tmp_path / "walks.json"
    assert gemm_bench.main(["--walks", "--walk-list", "16,e8", "--workload", w.name, "--reps", "1",
                            "--json", str(out)]) == 0
    walks = {(g, e) for _, _, g, e in calls}
    assert walks == {(16, False), (8, True)}
    assert {(layout, scatter) for layout, scatter, _, _ in calls} == {("nt", None), ("nt", "combine"), ("nn", None),
                                                                      ("nn", "plain")}
    records = json.loads(out.read_text())
    assert len(records) == 4 and all(r["bit_identical"] and r["select_walk"] == "16" for r in records)
    assert all(r["same_walk_as"] == {} for r in records)
    assert "same" in _last_line(capsys.readouterr().out)
    assert gemm_bench.main(["--walks", "--walk-list", "16,e8,e16,e4", "--workload", w.name, "--reps", "1",
                            "--json", str(out)]) == 0
    assert all(r["same_walk_as"] == {"e16": "e8", "e4": "e8"} for r in json.loads(out.read_text()))
    assert "=e8" in _last_line(capsys.readouterr().out)
    broken["walk"] = (8, True)
    assert gemm_bench.main(["--walks", "--walk-list", "16,e8", "--workload", w.name, "--reps", "1"]) == 1
    assert "DIFFER" in _last_line(capsys.readouterr().out)


def test_gemm_bench_same_walks_only_where_every_expert_fits_one_group():
    """Walks within experts are the same tile order exactly where every expert's blocks fit one group of the
    smaller size; fixed walks are not compared."""
    starts, ends = torch.tensor([0, 10 * 128]), torch.tensor([10 * 128, 12 * 128])  # 10 blocks and 2 blocks
    walks = gemm_bench._parse_walks("16,e8,e16,8,e4")
    assert gemm_bench._same_walks(walks, starts, ends, 4096) == {}
    starts, ends = torch.tensor([0, 5 * 128]), torch.tensor([5 * 128, 7 * 128 + 1])  # 5 blocks and 3 blocks
    assert gemm_bench._same_walks(walks, starts, ends, 4096) == {"e16": "e8"}
    # One N block: every walk within experts runs its M blocks in order, whatever the group size.
    assert gemm_bench._same_walks(walks, starts, ends, 128) == {"e16": "e8", "e4": "e8"}
