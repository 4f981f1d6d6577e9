"""Blockwise-FP8 K-grouped (weight-gradient) GEMM, ``k_grouped_fp8_gemm_nt_contiguous``, against the
torch emulation ``recipes.fp8.emulate_grouped_gemm_tn``.

The kernel reads the transposed pools: at_q, sa = quantize_rows(A.T), bt_q, sb = quantize_rows(B.T),
which equal quantize_cols(A) / quantize_cols(B) with data and scales transposed, bit for bit (checked
here on the CPU, and on the GPU for the GPU's quantization).

CPU: the configuration (registered for ``jit build --all``, K-grouped K-major e4m3, serial mainloop,
store epilogue), config and argument checks, and the compile for sm_90a: PTX issues only the e4m3
wgmma m64n128k32 with wait_group 0, ptxas serializes no wgmma, no spills, SASS has QGMMA (where
cuobjdump is installed).

GPU (Hopper), outputs NaN-poisoned first (every element of [E, M, N] must be written, zeros for an
expert without rows), seeds in the failure messages:

- exact: integer e4m3 data (|a| <= 4, |b| <= 2: a 128-row k-block's partial sum is an integer below
  2^10, exact in the tensor cores' fp8 accumulation) and power-of-2 scales (2^-2 .. 2^2, so every
  partial sum is a multiple of 2^-4 below 2^17), different per row of At, per row of Bt and per
  k-block: every sum is exact in fp32, so out == emulation.to(bf16) bit
  for bit. This pins the per-(m, n) promotion scale sa[m, kb] * sb[n, kb], the pool's k-block index
  of each expert (starts[e] / 128 + j), ragged N (columns past N read clamped scales and are not
  stored), a last expert ending at P off a multiple of 128, gaps and empty experts.
- fp32-level: the same integer data, random fp32 scales in [2^-8, 2^8]: |out - emu| <= 2^-8 |emu| +
  2^-11 Mag per element (Mag = |A|^T |B| of the dequantized operands; bf16 half ulp 2^-9, plus
  fp32 sums of up to 4096 terms in two orders).
- realistic: Gaussian pools quantized by ``quantize_cols`` at Qwen3-30B-A3B's weight-gradient shapes
  (dW1: M = 2I = 1536, N = H = 2048; dW2: M = H = 2048, N = I = 768) over routed pools with empty
  experts: relative Frobenius error <= 1e-2 per expert against the emulation and against fp64 (the
  tensor cores keep about 14 bits of a k-block's sum).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit_kernels import k_grouped_fp8_gemm_nt_contiguous
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.jit_kernels import sm90_fp8_grouped_gemm as fg
from deep_gemm_ext.recipes import fp8 as recipe
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing

from conftest import requires_compiler, requires_hopper

E4M3 = torch.float8_e4m3fn


def _find_cuobjdump():
    found = shutil.which("cuobjdump") or shutil.which("/usr/local/cuda/bin/cuobjdump")
    if found:
        return found
    try:  # the nvidia-cuda-cuobjdump wheel
        import nvidia
        for root in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_cuobjdump/bin"):
                path = os.path.join(root, sub, "cuobjdump")
                if os.access(path, os.X_OK):
                    return path
    except ImportError:
        pass
    return None


_CUOBJDUMP = _find_cuobjdump()
CONFIG = fg.K_GROUPED_CONFIG


# -- CPU ----------------------------------------------------------------------------------------------------


def test_k_grouped_config_is_registered():
    configs = {group: [c.name for c in items] for group, items in jit.registered_configs().items()}
    assert configs["sm90_fp8_k_grouped_gemm"] == ["sm90_fp8_grouped_gemm_k_nt_n128_s5",
                                                  "sm90_fp8_grouped_gemm_k_nt_n128_s5_overlap"]
    assert CONFIG is fg.K_GROUPED_CONFIGS[fg.K_GROUPED_MAINLOOP]
    for mainloop, policy in (("serial", "MainloopFP8"), ("overlap", "MainloopFP8Overlap")):
        config = fg.K_GROUPED_CONFIGS[mainloop]
        code = config.code()
        assert code.count("sm90_grouped_gemm_kernel<") == 1
        assert ("GroupedGemmType::KGroupedContiguous, dge::mma::Major::K, dge::mma::Major::K" in code
                and "dge::gemm::ElementType::E4M3" in code), code
        assert (f"dge::gemm::LoaderTma, dge::gemm::{policy}, Epilogue, const float*, const float*, CUtensorMap>"
                in code), code
        assert [a.name for a in config.args[len(gg.CORE_ARGS):]] == ["scale_a", "scale_b", "tma_c"]


def test_k_grouped_mainloop_argument_is_checked():
    with pytest.raises(ValueError, match=r"mainloop='fast', expected one of \('serial', 'overlap'\)"):
        k_grouped_fp8_gemm_nt_contiguous(*_cpu_operands(), mainloop="fast")


@pytest.mark.parametrize("kwargs", [dict(epilogue="scatter"), dict(block_n=256),
                                    dict(paired_n=True), dict(gather_a="cp_async")])
def test_k_grouped_config_rejects_what_the_kernel_does_not_take(kwargs):
    with pytest.raises(ValueError, match="dtype='fp8' with layout='k_nt' takes"):
        gg.GemmConfig(**{**dict(layout="k_nt", block_n=128, dtype="fp8"), **kwargs})
    with pytest.raises(ValueError, match="layout='k_nt' with dtype='bf16', expected dtype='fp8'"):
        gg.GemmConfig("k_nt", 128)
    with pytest.raises(ValueError, match="layout='tt', expected one of"):
        gg.GemmConfig("tt", 128)


@pytest.mark.parametrize("rows, cols", [(256, 128), (300, 136), (128, 8), (1, 24)])
def test_quantize_rows_of_transpose_is_quantize_cols_transposed(rows, cols):
    seed = 1000 + rows + cols
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 9, (rows, cols), generator=g).float())
    x[: rows // 3, : cols // 2] = 0  # all-zero tiles: the floor scale
    data_c, scale_c = recipe.quantize_cols(x)
    data_r, scale_r = recipe.quantize_rows(x.t().contiguous())
    assert torch.equal(data_r.view(torch.uint8), data_c.t().contiguous().view(torch.uint8)), f"seed {seed}"
    assert torch.equal(scale_r.view(torch.int32), scale_c.t().contiguous().view(torch.int32)), f"seed {seed}"


def _cpu_operands(m=256, n=128, rows=256):
    at_q = torch.zeros(m, rows, dtype=E4M3)
    sa = torch.ones(m, -(-rows // 128))
    bt_q = torch.zeros(n, rows, dtype=E4M3)
    sb = torch.ones(n, -(-rows // 128))
    starts = torch.tensor([0, 128], dtype=torch.int32)
    return at_q, sa, bt_q, sb, starts, torch.tensor([128, 256], dtype=torch.int32)


def test_argument_checks():
    at_q, sa, bt_q, sb, starts, ends = _cpu_operands()
    f = k_grouped_fp8_gemm_nt_contiguous
    with pytest.raises(TypeError, match="at_q: dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        f(at_q.bfloat16(), sa, bt_q, sb, starts, ends)
    with pytest.raises(TypeError, match="bt_q: dtype torch.float8_e5m2, expected torch.float8_e4m3fn"):
        f(at_q, sa, bt_q.to(torch.float8_e5m2), sb, starts, ends)
    with pytest.raises(TypeError, match="sb: dtype torch.bfloat16, expected torch.float32"):
        f(at_q, sa, bt_q, sb.bfloat16(), starts, ends)
    with pytest.raises(TypeError, match="ends: dtype torch.int64"):
        f(at_q, sa, bt_q, sb, starts, ends.long())
    with pytest.raises(ValueError, match="at_q: strides .* expected a contiguous tensor"):
        f(at_q.t().contiguous().t(), sa, bt_q, sb, starts, ends)
    with pytest.raises(ValueError, match=r"sa: shape \(2, 256\), expected \(256, 2\)"):
        f(at_q, sa.t().contiguous(), bt_q, sb, starts, ends)
    with pytest.raises(ValueError, match=r"sb: shape \(128, 1\), expected \(128, 2\)"):
        f(at_q, sa, bt_q, sb[:, :1].contiguous(), starts, ends)
    with pytest.raises(ValueError, match=r"bt_q: shape \(128, 128\) contracts over 128 pool rows, expected P=256"):
        f(at_q, sa, bt_q[:, :128].contiguous(), sb, starts, ends)
    with pytest.raises(ValueError, match=r"bt_q: shape \(128, 256, 1\), expected 2 dimensions"):
        f(at_q, sa, bt_q[:, :, None], sb, starts, ends)
    with pytest.raises(ValueError, match=r"starts \(2,\) and ends \(1,\)"):
        f(at_q, sa, bt_q, sb, starts, ends[:1])
    a, s_a, b, s_b, _, _ = _cpu_operands(m=192)
    with pytest.raises(ValueError, match=r"M=192: expected a multiple of 128"):
        f(a, s_a, b, s_b, starts, ends)
    a, s_a, b, s_b, _, _ = _cpu_operands(n=100)
    with pytest.raises(ValueError, match=r"N=100: expected a multiple of 8"):
        f(a, s_a, b, s_b, starts, ends)
    a, s_a, b, s_b, _, _ = _cpu_operands(rows=200)
    with pytest.raises(ValueError, match=r"P=200: expected a multiple of 16"):
        f(a, s_a, b, s_b, starts, torch.tensor([128, 200], dtype=torch.int32))
    with pytest.raises(ValueError, match="at_q: on cpu, expected a CUDA tensor"):
        f(at_q, sa, bt_q, sb, starts, ends)


@requires_compiler
@pytest.mark.parametrize("mainloop", fg.MAINLOOP_SCHEDULES)
def test_k_grouped_kernel_compiles_to_e4m3_wgmma_without_spills(mainloop):
    config = fg.K_GROUPED_CONFIGS[mainloop]
    kernel = jit.build(config.name, config.code())
    usage = kernel.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    # 5 stages of 32 KiB operands and 1 KiB scales, the epilogue's 32 KiB: the M-grouped 128-wide tile's
    # stages with 496 more bytes of scales each.
    m_grouped = gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop=mainloop)
    assert config.stages == m_grouped.stages == 5
    assert (config.smem_bytes(), m_grouped.smem_bytes()) == (203856, 201808)  # barriers 1024-aligned after them
    entry = jit.compile_cached(config.name, config.code(), want_ptx=True)
    ptx = entry.ptx_path.read_text()
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+) ", ptx)
    assert shapes and set(shapes) == {("m64n128k32", "e4m3", "e4m3")}, shapes
    waits = {"0"} if mainloop == "serial" else {"0", "1"}
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)) == waits
    # The scales come from shared memory (the producer's 4-byte cp.async), none from global memory in
    # the consumers' loop: 16 8-byte column-scale loads per k-block.
    assert "cp.async.ca.shared.global" in ptx and "ld.shared.v2.f32" in ptx
    log = (entry.path / "ptxas.log").read_text()
    assert "wgmma.mma_async instructions are serialized" not in log and "warpgroup.wait is injected" not in log, \
        log[-2000:]
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: PTX checked, SASS not")
    sass = subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout
    assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass and "HGMMA" not in sass


# -- GPU ----------------------------------------------------------------------------------------------------


@pytest.fixture
def exact_fp32_matmul(monkeypatch):
    """The emulation's fp32 matmuls in full fp32 (no TF32)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _seed(*key) -> int:
    """A seed that is the same in every process (str hashes are randomized)."""
    return zlib.crc32(repr(key).encode())


def _int_data(shape, bound: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-bound, bound + 1, shape, generator=g).float().cuda().to(E4M3)


def _pow2(shape, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    return torch.exp2(torch.randint(lo, hi + 1, shape, generator=g).float()).cuda()


def _int_operands(rows, m, n, g, *, exact: bool):
    """Pool-layout operands (quantize_cols format): a_q [P, M], sa [ceil(P/128), M], b_q [P, N], sb."""
    a_q, b_q = _int_data((rows, m), 4, g), _int_data((rows, n), 2, g)
    blocks = -(-rows // 128)
    if exact:
        sa, sb = _pow2((blocks, m), -2, 2, g), _pow2((blocks, n), -2, 2, g)
    else:
        sa = torch.exp2(torch.rand(blocks, m, generator=g) * 16 - 8).cuda()
        sb = torch.exp2(torch.rand(blocks, n, generator=g) * 16 - 8).cuda()
    return a_q, sa, b_q, sb


def _transposed(a_q, sa, b_q, sb):
    """The kernel's operands from quantize_cols-format ones."""
    return a_q.t().contiguous(), sa.t().contiguous(), b_q.t().contiguous(), sb.t().contiguous()


def _run(a_q, sa, b_q, sb, starts, ends, mainloop="serial"):
    """The kernel (mainloop schedule ``mainloop``) on NaN-poisoned output; returns it."""
    at_q, s_a, bt_q, s_b = _transposed(a_q, sa, b_q, sb)
    e, m, n = starts.shape[0], a_q.shape[1], b_q.shape[1]
    out = torch.full((e, m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    result = k_grouped_fp8_gemm_nt_contiguous(at_q, s_a, bt_q, s_b, starts, ends, out, mainloop=mainloop)
    assert result is out
    torch.cuda.synchronize()
    return out


def _dequant64(q, scale):
    rows = q.shape[0]
    return q.double() * scale.double().repeat_interleave(128, 0)[:rows]


def _references(a_q, sa, b_q, sb, starts, ends):
    """(emulation fp32 [E, M, N], fp64 reference, Mag = |A_e|^T |B_e| in fp64)."""
    emu = recipe.emulate_grouped_gemm_tn(a_q, sa, b_q, sb, starts, ends)
    a, b = _dequant64(a_q, sa), _dequant64(b_q, sb)
    e = starts.shape[0]
    ref = torch.zeros(e, a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
    mag = torch.zeros_like(ref)
    for i, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if t > s:
            ref[i] = a[s:t].t() @ b[s:t]
            mag[i] = a[s:t].abs().t() @ b[s:t].abs()
    return emu, ref, mag


def _ranges(bounds):
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int32, device="cuda")
    ends = torch.tensor([t for _, t in bounds], dtype=torch.int32, device="cuda")
    return starts, ends


# Hand-made expert row ranges [start, end) of a pool of P rows: gaps, empty experts (at the front,
# in the middle, at the end), one-block experts, a last expert ending at P off a multiple of 128.
_CASES = {
    "gaps_and_empty": (640, [(0, 0), (128, 384), (384, 384), (512, 640), (640, 640)]),
    "ragged_end": (464, [(0, 128), (128, 128), (256, 464)]),
    "one_expert": (1024, [(0, 1024)]),
    "all_empty": (256, [(0, 0), (256, 256)]),
}


@requires_hopper
@pytest.mark.parametrize("mainloop", fg.MAINLOOP_SCHEDULES)
@pytest.mark.parametrize("m, n", [(256, 128), (128, 136), (384, 264)])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_exact_operands_match_the_emulation_bit_for_bit(case, m, n, mainloop, exact_fp32_matmul):
    rows, bounds = _CASES[case]
    seed = _seed(case, m, n)
    g = torch.Generator().manual_seed(seed)
    a_q, sa, b_q, sb = _int_operands(rows, m, n, g, exact=True)
    starts, ends = _ranges(bounds)
    out = _run(a_q, sa, b_q, sb, starts, ends, mainloop)
    emu, ref, _ = _references(a_q, sa, b_q, sb, starts, ends)
    assert not out.isnan().any(), f"seed {seed}: unwritten output elements"
    assert torch.equal(emu.double(), ref), f"seed {seed}: the emulation itself is not exact"
    bad = (out != emu.to(torch.bfloat16))
    assert not bad.any(), (f"seed {seed}: {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}: "
                           f"{out[bad][:4].tolist()} vs {emu.to(torch.bfloat16)[bad][:4].tolist()}")
    for i, (s, t) in enumerate(bounds):
        if t == s:
            assert torch.equal(out[i], torch.zeros_like(out[i])), f"seed {seed}: expert {i} has no rows"


@requires_hopper
@pytest.mark.parametrize("mainloop", fg.MAINLOOP_SCHEDULES)
@pytest.mark.parametrize("case", ["gaps_and_empty", "ragged_end", "one_expert"])
def test_fp32_scales_within_fp32_rounding(case, mainloop, exact_fp32_matmul):
    rows, bounds = _CASES[case]
    m, n = 256, 200
    seed = _seed("fp32", case)
    g = torch.Generator().manual_seed(seed)
    a_q, sa, b_q, sb = _int_operands(rows, m, n, g, exact=False)
    starts, ends = _ranges(bounds)
    out = _run(a_q, sa, b_q, sb, starts, ends, mainloop)
    emu, ref, mag = _references(a_q, sa, b_q, sb, starts, ends)
    assert not out.isnan().any(), f"seed {seed}: unwritten output elements"
    err = (out.double() - emu.double()).abs()
    bound = 2.0 ** -8 * emu.double().abs() + 2.0 ** -11 * mag
    worst = (err - bound).max()
    assert worst <= 0, f"seed {seed}: error exceeds the fp32-level bound by {worst.item():.3e}"
    assert (out.double() - ref).norm() <= 2.0 ** -8 * ref.norm() + 1e-30, f"seed {seed}"


def _routed(num_tokens, num_experts, top_k, routing, g):
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
    return meta.starts, meta.ends, meta.num_pool_rows, meta.row_to_slot < 0


@requires_hopper
@pytest.mark.parametrize("m, n", [(1536, 2048), (2048, 768)])
@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_qwen3_weight_gradient_shapes(m, n, routing, exact_fp32_matmul):
    seed = _seed(m, n, routing)
    g = torch.Generator().manual_seed(seed)
    # 16 experts, 1024 tokens top-8: routed pools with ragged expert sizes (zipf leaves some empty).
    starts, ends, rows, pad = _routed(1024, 16, 8, routing, g)
    a = torch.randn(rows, m, generator=g) * torch.exp2(torch.randint(-4, 5, (1, m), generator=g).float())
    b = torch.randn(rows, n, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    a[pad.cpu()] = 0
    b[pad.cpu()] = 0
    a_q, sa = recipe.quantize_cols(a.cuda())
    b_q, sb = recipe.quantize_cols(b.cuda())
    # The GPU's quantization of the transposed pools is the same operand (the layer's path).
    at_q, s_a = recipe.quantize_rows(a.cuda().t().contiguous())
    assert torch.equal(at_q.view(torch.uint8), a_q.t().contiguous().view(torch.uint8)), f"seed {seed}"
    assert torch.equal(s_a, sa.t().contiguous()), f"seed {seed}"
    out = _run(a_q, sa, b_q, sb, starts, ends)
    # The two schedules promote the same partial sums in the same order: the same bits.
    overlap = _run(a_q, sa, b_q, sb, starts, ends, "overlap")
    assert torch.equal(out.view(torch.int16), overlap.view(torch.int16)), f"seed {seed}: the schedules differ"
    emu, ref, _ = _references(a_q, sa, b_q, sb, starts, ends)
    assert not out.isnan().any(), f"seed {seed}: unwritten output elements"
    for i, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if t == s:
            assert torch.equal(out[i], torch.zeros_like(out[i])), f"seed {seed}: expert {i} has no rows"
            continue
        for what, want in (("emulation", emu[i].double()), ("fp64", ref[i])):
            rel = (out[i].double() - want).norm() / want.norm().clamp_min(1e-300)
            assert rel <= 1e-2, f"seed {seed}: expert {i} rows [{s}, {t}): relative error {rel:.3e} vs {what}"


@requires_hopper
def test_empty_inputs():
    at_q, sa, bt_q, sb = (torch.zeros(256, 0, dtype=E4M3, device="cuda"), torch.ones(256, 0, device="cuda"),
                          torch.zeros(128, 0, dtype=E4M3, device="cuda"), torch.ones(128, 0, device="cuda"))
    starts = torch.zeros(3, dtype=torch.int32, device="cuda")
    out = torch.full((3, 256, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    k_grouped_fp8_gemm_nt_contiguous(at_q, sa, bt_q, sb, starts, starts.clone(), out)
    assert torch.equal(out, torch.zeros_like(out))
    none = k_grouped_fp8_gemm_nt_contiguous(at_q, sa, bt_q, sb, starts[:0], starts[:0])
    assert none.shape == (0, 256, 128)
