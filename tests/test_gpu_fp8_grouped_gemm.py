"""Blockwise-FP8 M-grouped GEMM (MainloopFP8 on the SM90 grouped GEMM core) against the torch emulation.

CPU: the configurations (registered for `jit build --all`, fp8 only where the mainloop supports it,
the bf16 sources untouched), argument checks, and the compile for sm_90a: PTX issues the e4m3 wgmma
m64n128k32, SASS has QGMMA (where cuobjdump is installed), no spills.

GPU (Hopper): ``m_grouped_fp8_gemm_nt_contiguous`` against ``recipes.fp8.emulate_grouped_gemm_nt``
(fp32 torch on the dequantized operands) and an fp64 reference, outputs NaN-poisoned first (rows no
expert owns must stay NaN, every owned row must be written). Operands and bounds:

- exact: integer e4m3 data (|a| <= 4, |b| <= 2, so every partial sum of a 128-wide k-block is an
  integer below 2^10, exact in the tensor cores' reduced-precision fp8 accumulation) and power-of-2
  scales (2^-2 .. 2^2, or row/column-constant extremes 2^-60 .. 2^60): every sum is exact in fp32,
  so the output must equal ``emulation.to(bf16)`` bit for bit.
- fp32-level: the same integer data with random fp32 scales (2^-8 .. 2^8, not powers of 2): kernel
  and emulation differ only by fp32 rounding, then one bf16 rounding. Bound per element:
  |out - emu| <= 2^-8 |emu| + 2^-11 M, M = (|A| @ |B|^T) the sum of the absolute products (2^-9 is
  bf16's half ulp; fp32 sums of K <= 4096 terms in two orders are within 2 K 2^-24 M <= 2^-11 M);
  relative Frobenius error <= 2^-8 overall and <= 2^-7 per row.
- realistic: Gaussian data quantized by ``quantize_rows`` / ``quantize_weight_blocks`` (the full
  e4m3 range): the tensor cores keep about 14 bits of a k-block's sum (DeepSeek-V3 report, 3.5.2),
  so the bound is looser: relative Frobenius error <= 1e-2 overall and <= 2e-2 per row, against
  the emulation and against fp64. A model of that accumulation (products aligned to the largest
  term, including the running sum, floored to 14 bits; the sum truncated to 13 mantissa bits)
  gives 1.0e-3 overall and 1.5e-3 in the worst row at K = 2048 (1.9e-3 with the bf16 rounding);
  the e4m3 quantization error itself is about 4%.

Shapes: Qwen3-30B-A3B's (N=1536, K=2048 and N=2048, K=768), ragged N and K (not multiples of 128),
one partial k-block, routed pools (uniform, Zipf, empty experts, one expert), hand-made expert
ranges with gaps and empty experts, no rows at all; a zero tile with its floor scale; the scatter
epilogues (slot order, weighted) against the plain store.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg
from deep_gemm_ext.jit_kernels import sm90_fp8_grouped_gemm as fg
from deep_gemm_ext.jit_kernels import m_grouped_fp8_gemm_nt_contiguous
from deep_gemm_ext.recipes import fp8 as recipe
from deep_gemm_ext.routing import compute_routing_torch
from deep_gemm_ext.testing import make_routing

from conftest import requires_compiler, requires_hopper

E4M3 = torch.float8_e4m3fn
_CUOBJDUMP = shutil.which("cuobjdump") or (
    "/usr/local/cuda/bin/cuobjdump" if shutil.which("/usr/local/cuda/bin/cuobjdump") else None)


# -- CPU ----------------------------------------------------------------------------------------------------


def test_fp8_configs_are_registered():
    configs = {group: [c.name for c in items] for group, items in jit.registered_configs().items()}
    assert configs["sm90_fp8_grouped_gemm"] == ["sm90_fp8_grouped_gemm_nt_n128_s5",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_weighted",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_overlap",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_overlap",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_weighted_overlap",
                                                # clusters of 2 (tests/test_gpu_gemm_clusters.py)
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_c2",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_c2",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_weighted_c2",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_overlap_c2",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_overlap_c2",
                                                "sm90_fp8_grouped_gemm_nt_n128_s5_scatter_weighted_overlap_c2",
                                                # 128 x 192 tiles, serial mainloop, clusters of 1 and 2
                                                "sm90_fp8_grouped_gemm_nt_n192_s4",
                                                "sm90_fp8_grouped_gemm_nt_n192_s4_scatter",
                                                "sm90_fp8_grouped_gemm_nt_n192_s4_scatter_weighted",
                                                "sm90_fp8_grouped_gemm_nt_n192_s4_c2",
                                                "sm90_fp8_grouped_gemm_nt_n192_s4_scatter_c2",
                                                "sm90_fp8_grouped_gemm_nt_n192_s4_scatter_weighted_c2"]
    for name, code, is_gemm in fg.configs():
        assert is_gemm and code.count("sm90_grouped_gemm_kernel<") == 1, name
        assert "mma/sm90_mainloop_fp8.cuh" in code and "dge::gemm::ElementType::E4M3" in code, name
        policy = "MainloopFP8Overlap" if name.removesuffix("_c2").endswith("_overlap") else "MainloopFP8"
        assert f"dge::gemm::{policy}, Epilogue" in code, name
    store = fg.GemmConfig("nt", 128, dtype="fp8")
    # Kernel arguments: the core's, the mainloop's scales, then the epilogue's.
    assert [a.name for a in store.args[len(gg.CORE_ARGS):]] == ["scale_a", "scale_b", "tma_c"]
    assert "dge::gemm::MainloopFP8, Epilogue, const float*, const float*, CUtensorMap>);" in store.code()
    overlap = fg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="overlap")
    assert overlap.args == store.args
    # The policy names the kernel's mainloop and, in the exported smem size, the mainloop's own bytes.
    assert "dge::gemm::MainloopFP8<Traits, false>::kSmemBytes>::kTotalBytes" in store.code()
    assert overlap.code() == (store.code().replace("dge::gemm::MainloopFP8,", "dge::gemm::MainloopFP8Overlap,")
                              .replace("dge::gemm::MainloopFP8<", "dge::gemm::MainloopFP8Overlap<"))


def test_serial_fp8_sources_are_unchanged():
    # The serial schedule is the default and renders the text it had before the overlap knob (same
    # names, same cache keys, byte-identical cubins).
    for epilogue in ("store", "scatter", "scatter_weighted"):
        default = fg.GemmConfig("nt", 128, dtype="fp8", epilogue=epilogue)
        serial = fg.GemmConfig("nt", 128, dtype="fp8", epilogue=epilogue, fp8_mainloop="serial")
        assert default == serial and default.code() == serial.code()
        assert "Overlap" not in default.code() and not default.name.endswith("_overlap")


def test_fp8_mainloop_knob_is_checked():
    with pytest.raises(ValueError, match=r"fp8_mainloop='fast', expected one of \('serial', 'overlap'\)"):
        gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="fast")
    with pytest.raises(ValueError, match="fp8_mainloop='overlap' with dtype='bf16', expected dtype='fp8'"):
        gg.GemmConfig("nt", 128, fp8_mainloop="overlap")
    assert fg.MAINLOOP_SCHEDULES == ("serial", "overlap")


def test_bf16_sources_do_not_mention_the_element_type():
    # The bf16 configurations of the default walk render the text they had before the fp8 policy (same
    # cache keys); those of groups within experts spell the trailing template arguments, element type
    # included, but never fp8.
    for config in gg._all_configs():
        code = config.code()
        assert config.dtype == "bf16" and "fp8" not in code, config.name
        if not config.expert_groups:
            assert "ElementType" not in code, config.name
        assert "dge::gemm::MainloopBF16, Epilogue" in code, config.name
    # + the clusters of 2 (tests/test_gpu_gemm_clusters.py), + the waiting L1 gathers
    # (tests/test_gpu_ep_overlap.py), + groups within experts (tests/test_gpu_gemm_group_m.py)
    assert len(gg.configs()) == 13 + 5 + 2 + 10
    assert sum(c.expert_groups for c in gg._all_configs()) == 10


@pytest.mark.parametrize("kwargs", [dict(layout="nn"), dict(gather_a="cp_async"), dict(paired_n=True),
                                    dict(block_n=192, fp8_mainloop="overlap")])
def test_fp8_config_rejects_what_the_mainloop_does_not_take(kwargs):
    base = dict(layout="nt", block_n=128, dtype="fp8")
    with pytest.raises(ValueError, match="dtype='fp8' takes"):
        gg.GemmConfig(**{**base, **kwargs})
    for block_n in (64, 256):
        with pytest.raises(ValueError, match=rf"block_n={block_n}, expected one of \(128, 192\)"):
            gg.GemmConfig("nt", block_n, dtype="fp8")
    with pytest.raises(ValueError, match=r"block_n=192, expected one of \(256, 128\)"):
        gg.GemmConfig("k_nt", 192, dtype="fp8")
    with pytest.raises(ValueError, match="dtype='fp16'"):
        gg.GemmConfig("nt", 128, dtype="fp16")
    with pytest.raises(ValueError, match=r"epilogue='unknown', expected one of \('store', 'scatter', "
                                         r"'scatter_weighted'\)"):
        gg.GemmConfig("nt", 128, dtype="fp8", epilogue="unknown")


def _cpu_operands(p=256, k=256, e=2, n=128):
    a_q = torch.zeros(p, k, dtype=E4M3)
    sa = torch.ones(p, -(-k // 128))
    b_q = torch.zeros(e, n, k, dtype=E4M3)
    sb = torch.ones(e, -(-n // 128), -(-k // 128))
    se = torch.tensor([0, 128], dtype=torch.int32)[:e]
    return a_q, sa, b_q, sb, se, se.clone()


def test_argument_checks():
    a_q, sa, b_q, sb, starts, ends = _cpu_operands()
    f = m_grouped_fp8_gemm_nt_contiguous
    with pytest.raises(TypeError, match="a_q: dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        f(a_q.bfloat16(), sa, b_q, sb, starts, ends)
    with pytest.raises(TypeError, match="b_q: dtype torch.float8_e5m2, expected torch.float8_e4m3fn"):
        f(a_q, sa, b_q.to(torch.float8_e5m2), sb, starts, ends)
    with pytest.raises(TypeError, match="sa: dtype torch.bfloat16, expected torch.float32"):
        f(a_q, sa.bfloat16(), b_q, sb, starts, ends)
    with pytest.raises(TypeError, match="starts: dtype torch.int64"):
        f(a_q, sa, b_q, sb, starts.long(), ends)
    with pytest.raises(ValueError, match="sa: strides .* expected a contiguous tensor"):
        f(a_q, sa.t().contiguous().t(), b_q, sb, starts, ends)
    with pytest.raises(ValueError, match=r"sa: shape \(256, 1\), expected \(256, 2\)"):
        f(a_q, sa[:, :1].contiguous(), b_q, sb, starts, ends)
    with pytest.raises(ValueError, match=r"sb: shape \(2, 1, 1\), expected \(2, 1, 2\)"):
        f(a_q, sa, b_q, sb[:, :, :1].contiguous(), starts, ends)
    with pytest.raises(ValueError, match="b_q: 3 experts"):
        f(a_q, sa, torch.zeros(3, 128, 256, dtype=E4M3), torch.ones(3, 1, 2), starts, ends)
    with pytest.raises(ValueError, match="contracts over 128, expected K=256"):
        f(a_q, sa, b_q[:, :, :128].contiguous(), sb[:, :, :1].contiguous(), starts, ends)
    with pytest.raises(ValueError, match="starts \\(2,\\) and ends \\(1,\\)"):
        f(a_q, sa, b_q, sb, starts, ends[:1])
    a8, sa8, b8, sb8, _, _ = _cpu_operands(k=200)
    with pytest.raises(ValueError, match="K=200: expected a multiple of 16"):
        f(a8, sa8, b8, sb8, starts, ends)
    a8, sa8, b8, sb8, _, _ = _cpu_operands(n=100)
    with pytest.raises(ValueError, match="N=100: expected a multiple of 8"):
        f(a8, sa8, b8, sb8, starts, ends)
    with pytest.raises(ValueError, match="a_q: on cpu, expected a CUDA tensor"):
        f(a_q, sa, b_q, sb, starts, ends)
    with pytest.raises(ValueError, match="a_q: on cpu, expected a CUDA tensor"):
        f(a_q, sa, b_q, sb, starts, ends, mainloop="overlap")
    for bad in ("fast", "Overlap", None, 1):
        with pytest.raises(ValueError, match=rf"mainloop={bad!r}: expected one of \('serial', 'overlap'\)"):
            f(a_q, sa, b_q, sb, starts, ends, mainloop=bad)
    for bad in (256, 64, True, "192"):
        with pytest.raises(ValueError, match=rf"block_n={bad!r}: expected one of \(128, 192\)"):
            f(a_q, sa, b_q, sb, starts, ends, block_n=bad)
    with pytest.raises(ValueError, match="block_n=192 with mainloop='overlap': the 192-wide tile runs the serial"):
        f(a_q, sa, b_q, sb, starts, ends, block_n=192, mainloop="overlap")
    with pytest.raises(ValueError, match="a_q: on cpu, expected a CUDA tensor"):
        f(a_q, sa, b_q, sb, starts, ends, block_n=192)


def _build(config):
    return jit.build(config.name, config.code())


def _unserialized_sass(config, kernel, entry) -> str:
    """Checks that ptxas serialized no wgmma of the kernel; its SASS (the test skips without cuobjdump)."""
    log = (entry.path / "ptxas.log").read_text()
    assert "wgmma.mma_async instructions are serialized" not in log and "warpgroup.wait is injected" not in log, \
        f"{config.name}: {log[-2000:]}"
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: PTX checked, SASS not")
    return subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout


@requires_compiler
@pytest.mark.parametrize("mainloop", ["serial", "overlap"])
@pytest.mark.parametrize("epilogue", ["store", "scatter", "scatter_weighted"])
def test_fp8_kernel_compiles_to_e4m3_wgmma_without_spills(epilogue, mainloop):
    config = gg.GemmConfig("nt", 128, dtype="fp8", epilogue=epilogue, fp8_mainloop=mainloop)
    kernel = _build(config)
    usage = kernel.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    # Same stage bytes as bf16's 128-wide tile (a 128 x 128 e4m3 k-block is 128 x 128 bytes), 5 stages
    # of them, each with its 528 bytes of scales (128 row scales, the B scale, padding), after the
    # epilogue's 32 KiB: 5 x 32 KiB + 32 KiB + 5 x 528 B, the barriers' 1024-byte alignment, 80 bytes of
    # barriers, the scheduler's 1024-byte expert table and the 1024 of the run-time alignment.
    assert config.stages == 5 and gg.GemmConfig("nt", 128).stages == 6
    assert config.smem_bytes() == (5 * 32 + 32) * 1024 + 3072 + 80 + 1024 + 1024 == 201808
    entry = jit.compile_cached(config.name, config.code(), want_ptx=True)
    ptx = entry.ptx_path.read_text()
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+) ", ptx)
    assert shapes and set(shapes) == {("m64n128k32", "e4m3", "e4m3")}, shapes
    # serial: every k-block waits for all its wgmmas; overlap: the wait before a promotion leaves
    # the next k-block's group in flight (wait_group 1), the tile's last k-block drains (0).
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx))
    assert waits == ({"0"} if mainloop == "serial" else {"0", "1"}), f"{config.name}: wait_group {waits}"
    # ptxas serializes wgmmas (C7510-C7520 "Potential Performance Loss: wgmma.mma_async instructions
    # are serialized") when it cannot prove the accumulators untouched while they run: the overlap
    # would be lost without any error.
    sass = _unserialized_sass(config, kernel, entry)
    assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass and "HGMMA" not in sass, config.name
    # The scales reach the consumers through shared memory: the producer's 4-byte cp.async copies
    # (LDGSTS) fill them, and no global load (LDG) sits among the consumers' QGMMAs from the second
    # k-block on (before, the next k-block's scales were loaded there). The overlap loop's first
    # k-block (its 4 wgmmas issued before the loop) runs under the next tile's scheduling, whose search
    # reads `ends` from global memory where the ranges are not staged; the serial loop's 4 wgmmas are
    # its one k-block, that work out of line.
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    gmma = [i for i, line in enumerate(lines) if "QGMMA" in line]
    assert "LDGSTS" in sass, config.name
    first = gmma[4] if mainloop == "overlap" else gmma[0]
    assert not [line for line in lines[first:gmma[-1] + 1] if re.search(r"\bLDG\.", line)], config.name
    # wait_group 1 is WARPGROUP.DEPBAR.LE gsb0, 0x1 in SASS.
    depbars = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    assert depbars == ({"0x0"} if mainloop == "serial" else {"0x0", "0x1"}), f"{config.name}: {depbars}"
    if mainloop == "overlap":
        # Two accumulator sets: the QGMMAs write two distinct register ranges.
        dests = set(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3 (R\d+),", sass))
        assert len(dests) == 2, f"{config.name}: QGMMA destinations {dests}"


@requires_compiler
@requires_compiler
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("epilogue", ["store", "scatter", "scatter_weighted"])
def test_fp8_n192_kernel_compiles_to_e4m3_wgmma_without_spills(epilogue, cluster_n):
    """128 x 192 tiles: m64n192k32 wgmmas, 96 + 96 accumulators without spills, one wait per k-block
    (serial), 4 smem stages of 40 KiB, the wgmmas not serialized."""
    config = gg.GemmConfig("nt", 192, dtype="fp8", epilogue=epilogue, cluster_n=cluster_n)
    assert config.stages == 4 and config.name.startswith("sm90_fp8_grouped_gemm_nt_n192_s4")
    kernel = _build(config)
    usage = kernel.resources()
    assert usage and all(u.spill_bytes == 0 for u in usage), f"{config.name}: {usage}"
    assert config.smem_bytes() <= 232448
    entry = jit.compile_cached(config.name, config.code(), want_ptx=True)
    ptx = entry.ptx_path.read_text()
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+) ", ptx)
    assert shapes and set(shapes) == {("m64n192k32", "e4m3", "e4m3")}, shapes
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)) == {"0"}, config.name
    sass = _unserialized_sass(config, kernel, entry)
    assert "QGMMA.64x192x32.F32.E4M3.E4M3" in sass and "HGMMA" not in sass, config.name
    assert "STL" not in sass and "LDL" not in sass, config.name


def test_e4m3_wgmma_shapes_assemble(tmp_path):
    # Both defined e4m3 shapes assemble (ptxas rejects a wrong accumulator count or operand list).
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    (tmp_path / "q.cu").write_text("""#include <ptx/wgmma.cuh>
template <uint32_t N>
__global__ void k(float* p, uint64_t a, uint64_t b) {
    float d[N / 2];
    for (uint32_t i = 0; i < N / 2; ++i) d[i] = p[i];
    dge::ptx::WgmmaE4M3SS<N>::mma(d, a, b, 0);
    for (uint32_t i = 0; i < N / 2; ++i) p[i] = d[i];
}
template __global__ void k<128>(float*, uint64_t, uint64_t);
template __global__ void k<256>(float*, uint64_t, uint64_t);
""")
    for kind, out in (("-ptx", tmp_path / "q.ptx"), ("-cubin", tmp_path / "q.cubin")):
        result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", f"-I{jit.kernels_dir()}", kind, "-o", str(out),
                                 str(tmp_path / "q.cu")], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-4000:]
    found = re.findall(r"\.m64n(\d+)k32\.f32\.e4m3\.e4m3 \{([^}]*)\}", (tmp_path / "q.ptx").read_text())
    assert sorted((int(n), len(regs.split(","))) for n, regs in found) == [(128, 64), (256, 128)]


# -- GPU ----------------------------------------------------------------------------------------------------


@pytest.fixture
def exact_fp32_matmul(monkeypatch):
    """The emulation's fp32 matmuls in full fp32 (no TF32)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _routed(num_tokens: int, num_experts: int, top_k: int, routing: str, g: torch.Generator):
    """starts/ends of a routed 128-aligned pool, its row count and padding rows (row_to_slot < 0)."""
    idx = make_routing(num_tokens, num_experts, top_k, routing, generator=g).cuda()
    meta = compute_routing_torch(idx, num_experts, gg.GROUP_ALIGNMENT)
    return meta.starts, meta.ends, meta.num_pool_rows, meta.row_to_slot < 0, meta


def _owned(starts, ends, rows: int) -> torch.Tensor:
    owned = torch.zeros(rows, dtype=torch.bool)
    for s, t in zip(starts.tolist(), ends.tolist()):
        owned[s:t] = True
    return owned.cuda()


def _int_data(shape, bound: int, g: torch.Generator) -> torch.Tensor:
    """Integers in [-bound, bound] as e4m3 (exact)."""
    return torch.randint(-bound, bound + 1, shape, generator=g).float().cuda().to(E4M3)


def _zero(t: torch.Tensor, index) -> None:
    """t[index] = 0 for an e4m3 tensor (through its bytes: e4m3's zero is 0x00)."""
    t.view(torch.uint8)[index] = 0


def _pow2(shape, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    return torch.exp2(torch.randint(lo, hi + 1, shape, generator=g).float()).cuda()


def _int_operands(rows, k, e, n, pad, g, *, exact: bool):
    """Integer data (|a| <= 4, |b| <= 2); scales powers of 2 (exact) or random fp32 in [2^-8, 2^8]."""
    a_q = _int_data((rows, k), 4, g)
    _zero(a_q, pad)
    b_q = _int_data((e, n, k), 2, g)
    sa_shape, sb_shape = (rows, -(-k // 128)), (e, -(-n // 128), -(-k // 128))
    if exact:
        sa, sb = _pow2(sa_shape, -2, 2, g), _pow2(sb_shape, -2, 2, g)
    else:
        sa = torch.exp2(torch.rand(sa_shape, generator=g) * 16 - 8).cuda()
        sb = torch.exp2(torch.rand(sb_shape, generator=g) * 16 - 8).cuda()
    return a_q, sa, b_q, sb


def _gaussian_operands(rows, k, e, n, pad, g):
    """Gaussian data with magnitudes varying by row and by 128 x 128 block, quantized by the recipe."""
    a = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    a[pad.cpu()] = 0
    w = torch.randn(e, n, k, generator=g) / k ** 0.5
    block = torch.exp2(torch.randint(-3, 4, (e, -(-n // 128), -(-k // 128)), generator=g).float())
    w *= block.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    a_q, sa = recipe.quantize_rows(a.cuda())
    b_q, sb = recipe.quantize_weight_blocks(w.cuda())
    return a_q, sa, b_q, sb


def _dequant64(a_q, sa, b_q, sb):
    k, n = a_q.shape[1], b_q.shape[1]
    a = a_q.double() * sa.double().repeat_interleave(128, 1)[:, :k]
    b = b_q.double() * sb.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    return a, b


def _references(a_q, sa, b_q, sb, starts, ends):
    """(emulation fp32, fp64 reference, M = |A| @ |B|^T in fp64), zero on rows no expert owns."""
    emu = recipe.emulate_grouped_gemm_nt(a_q, sa, b_q, sb, starts, ends)
    a, b = _dequant64(a_q, sa, b_q, sb)
    ref = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    mag = torch.zeros_like(ref)
    for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if t > s:
            ref[s:t] = a[s:t] @ b[e].T
            mag[s:t] = a[s:t].abs() @ b[e].abs().T
    return emu, ref, mag


def _rel(x: torch.Tensor, y: torch.Tensor, dim=None) -> torch.Tensor:
    x, y = x.double(), y.double()
    if dim is None:
        return (x - y).norm() / y.norm().clamp_min(1e-300)
    return (x - y).norm(dim=dim) / y.norm(dim=dim).clamp_min(1e-300)


def _run(a_q, sa, b_q, sb, starts, ends):
    out = torch.full((a_q.shape[0], b_q.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    result = m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, starts, ends, out)
    assert result is out
    torch.cuda.synchronize()
    return out


def _check(out, a_q, sa, b_q, sb, starts, ends, *, mode: str, what: str):
    """mode: "exact", "fp32" or "realistic" (module docstring)."""
    emu, ref, mag = _references(a_q, sa, b_q, sb, starts, ends)
    owned = _owned(starts, ends, out.shape[0])
    where = f"[{what}]"
    assert torch.isnan(out[~owned].float()).all(), f"{where} rows no expert owns were written"
    got = out[owned]
    assert not torch.isnan(got.float()).any(), f"{where} owned rows left unwritten (NaN)"
    emu, ref, mag = emu[owned], ref[owned], mag[owned]
    if got.numel() == 0:
        return
    # The emulation itself is fp32 math on the same operands.
    emu_err = _rel(emu, ref).item()
    assert emu_err < 1e-5, f"{where} emulation vs fp64: {emu_err:.2e}"
    if mode == "exact":
        want = emu.to(torch.bfloat16)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, (f"{where} {bad.shape[0]} elements differ from the exact result, first at "
                                  f"{bad[0].tolist()}: {got[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}")
        return
    err_all, err_rows = _rel(got, emu).item(), _rel(got, emu, 1)
    worst_row = err_rows.max().item()
    if mode == "fp32":
        diff = (got.double() - emu.double()).abs()
        bound = 2.0 ** -8 * emu.double().abs() + 2.0 ** -11 * mag
        over = (diff > bound).nonzero()
        assert over.numel() == 0, (f"{where} {over.shape[0]} elements past |d| <= 2^-8|emu| + 2^-11 M, first at "
                                   f"{over[0].tolist()}: got {got[tuple(over[0])].item()}, emu "
                                   f"{emu[tuple(over[0])].item()}, M {mag[tuple(over[0])].item()}")
        assert err_all <= 2.0 ** -8 and worst_row <= 2.0 ** -7, \
            f"{where} relative error vs emulation {err_all:.2e} (all), {worst_row:.2e} (worst row)"
    else:
        err64, rows64 = _rel(got, ref).item(), _rel(got, ref, 1).max().item()
        assert err_all <= 1e-2 and worst_row <= 2e-2 and err64 <= 1e-2 and rows64 <= 2e-2, (
            f"{where} relative error vs emulation {err_all:.2e} (all), {worst_row:.2e} (worst row); vs fp64 "
            f"{err64:.2e}, {rows64:.2e}")


_QWEN3_30B = [(1536, 2048), (2048, 768)]  # L1 forward (N = 2I, K = H), L2 forward (N = H, K = I)
_RAGGED = [(1000, 1008), (200, 272), (64, 16), (384, 128)]


@requires_hopper
@pytest.mark.parametrize("mode", ["exact", "fp32", "realistic"])
@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert"])
@pytest.mark.parametrize("n,k", _QWEN3_30B + _RAGGED)
def test_routed_pools(n, k, routing, mode, exact_fp32_matmul):
    seed = 1000 * n + k + {"uniform": 0, "zipf": 1, "empty_experts": 2, "one_expert": 3}[routing] * 7 + len(mode)
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(600, 12, 4, routing, g)
    if mode == "realistic":
        ops = _gaussian_operands(rows, k, 12, n, pad, g)
    else:
        ops = _int_operands(rows, k, 12, n, pad, g, exact=mode == "exact")
    out = _run(*ops, starts, ends)
    _check(out, *ops, starts, ends, mode=mode, what=f"seed={seed} n={n} k={k} {routing} {mode}")


@requires_hopper
@pytest.mark.parametrize("mode", ["exact", "realistic"])
def test_many_experts_at_qwen3_30b_shape(mode, exact_fp32_matmul):
    # 128 experts, 2048 tokens x top-8: the L1 forward shape of Qwen3-30B-A3B on a full pool.
    seed = 77 + len(mode)
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(2048, 128, 8, "uniform", g)
    ops = (_gaussian_operands(rows, 2048, 128, 1536, pad, g) if mode == "realistic"
           else _int_operands(rows, 2048, 128, 1536, pad, g, exact=True))
    out = _run(*ops, starts, ends)
    _check(out, *ops, starts, ends, mode=mode, what=f"seed={seed} E=128 {mode}")


@requires_hopper
@pytest.mark.parametrize("mode", ["exact", "fp32"])
def test_expert_ranges_with_gaps_and_empty_experts(mode, exact_fp32_matmul):
    # Rows [128, 256), [512, 640) and [768, 1024) belong to no expert; experts 1 and 4 are empty.
    seed = 5 + len(mode)
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, 256, 256, 640, 768], dtype=torch.int32, device="cuda")
    ends = torch.tensor([128, 256, 512, 768, 768], dtype=torch.int32, device="cuda")
    rows, n, k = 1024, 384, 640
    ops = _int_operands(rows, k, 5, n, torch.zeros(rows, dtype=torch.bool, device="cuda"), g, exact=mode == "exact")
    out = _run(*ops, starts, ends)
    _check(out, *ops, starts, ends, mode=mode, what=f"seed={seed} gaps {mode}")


@requires_hopper
def test_scale_extremes_and_zero_tiles(exact_fp32_matmul):
    # Per row a scale from 2^-60 .. 2^60 (the same for all its k-blocks), per 128-column block of
    # each expert one from 2^-50 .. 2^50: every output element's terms share one scale, so the sums
    # stay exact. Zero tiles (an all-zero 1 x 128 tile of a, a 128 x 128 block of b) carry the
    # recipe's floor scale 2^-126, as quantize_rows / quantize_weight_blocks give them.
    seed = 11
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(700, 6, 2, "uniform", g)
    n, k, e = 640, 1024, 6
    a_q, _, b_q, _ = _int_operands(rows, k, e, n, pad, g, exact=True)
    kb, nb = k // 128, n // 128
    row_exp = torch.tensor([-60, -20, 0, 20, 60])[torch.randint(0, 5, (rows,), generator=g)]
    sa = torch.exp2(row_exp.float()).cuda()[:, None].expand(rows, kb).contiguous()
    col_exp = torch.tensor([-50, 0, 50])[torch.randint(0, 3, (e, nb), generator=g)]
    # |row exp + col exp| <= 110: products and sums stay normal fp32 (and bf16) numbers.
    sb = torch.exp2(col_exp.float()).cuda()[:, :, None].expand(e, nb, kb).contiguous()
    zero_rows = torch.randint(0, rows, (rows // 4,), generator=g).cuda()
    zero_kb = torch.randint(0, kb, (rows // 4,), generator=g).cuda()
    for r, b in zip(zero_rows.tolist(), zero_kb.tolist()):
        _zero(a_q, (r, slice(b * 128, (b + 1) * 128)))
        sa[r, b] = recipe.SCALE_FLOOR
    _zero(b_q, (0, slice(0, 128), slice(0, 128)))
    sb[0, 0, 0] = recipe.SCALE_FLOOR
    out = _run(a_q, sa, b_q, sb, starts, ends)
    _check(out, a_q, sa, b_q, sb, starts, ends, mode="exact", what=f"seed={seed} scale extremes")
    owned = out[_owned(starts, ends, rows)].float()
    assert owned.abs().max().item() > 2.0 ** 100 and torch.isfinite(owned).all()


@requires_hopper
def test_recipe_quantized_zero_tiles(exact_fp32_matmul):
    # Whole zero tiles through the recipe's quantizers (scale 2^-126 there): output rows of a zero
    # a-row are exactly 0, columns of a zero weight block contribute nothing.
    seed = 12
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(500, 4, 2, "uniform", g)
    a = torch.randn(rows, 512, generator=g)
    a[pad.cpu()] = 0
    a[:, 128:256] = 0
    w = torch.randn(4, 256, 512, generator=g) / 512 ** 0.5
    w[1, 128:, :] = 0
    a_q, sa = recipe.quantize_rows(a.cuda())
    b_q, sb = recipe.quantize_weight_blocks(w.cuda())
    assert (sa[:, 1] == recipe.SCALE_FLOOR).all() and (sb[1, 1] == recipe.SCALE_FLOOR).all()
    out = _run(a_q, sa, b_q, sb, starts, ends)
    _check(out, a_q, sa, b_q, sb, starts, ends, mode="realistic", what=f"seed={seed} recipe zero tiles")
    s1, t1 = starts[1].item(), ends[1].item()
    assert (out[s1:t1, 128:].float() == 0).all(), "expert 1's zero weight block gave nonzero columns"


@requires_hopper
def test_no_rows_and_no_owned_rows():
    g = torch.Generator().manual_seed(3)
    # A pool of 0 rows: nothing to do.
    a_q, sa, b_q, sb = _int_operands(0, 256, 4, 256, torch.zeros(0, dtype=torch.bool, device="cuda"), g, exact=True)
    z = torch.zeros(4, dtype=torch.int32, device="cuda")
    assert m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, z, z).shape == (0, 256)
    # 512 rows, every expert empty: no row is written.
    a_q, sa, b_q, sb = _int_operands(512, 256, 4, 256, torch.zeros(512, dtype=torch.bool, device="cuda"), g,
                                     exact=True)
    out = _run(a_q, sa, b_q, sb, z, z)
    assert torch.isnan(out.float()).all()


@requires_hopper
@pytest.mark.parametrize("routing", ["uniform", "empty_experts", "unused_slots"])
def test_scatter_epilogues_match_the_store(routing, exact_fp32_matmul):
    # Unweighted: slot rows == the plain store's pool rows bit for bit; weighted: bf16(fp32 sum * w),
    # exact here (integer data, power-of-2 scales and weights). Unused slots are never written.
    seed = 21 + len(routing)
    g = torch.Generator().manual_seed(seed)
    num_tokens, top_k, e, n, k = 500, 4, 8, 384, 768
    starts, ends, rows, pad, meta = _routed(num_tokens, e, top_k, routing, g)
    ops = _int_operands(rows, k, e, n, pad, g, exact=True)
    store = _run(*ops, starts, ends)
    num_slots = num_tokens * top_k
    weights = _pow2((num_tokens, top_k), -3, 3, g)
    real = meta.row_to_slot >= 0
    # Pool-order weights (what the layer passes): the slot's weight on used rows, NaN on the others
    # (rows that are not stored; their weight must not reach any slot).
    row_weights = torch.where(real, weights.reshape(-1)[meta.row_to_slot.clamp(min=0).long()], float("nan"))
    for w, order in ((None, None), (weights, "slot"), (row_weights, "row")):
        slots = torch.full((num_slots, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        scatter = (gg.Scatter(meta.row_to_slot, num_slots, row_weights=w) if order == "row"
                   else gg.Scatter(meta.row_to_slot, num_slots, w))
        m_grouped_fp8_gemm_nt_contiguous(*ops, starts, ends, slots, scatter=scatter)
        torch.cuda.synchronize()
        dest = meta.row_to_slot[real].long()
        want = store[real] if w is None else (store[real].float() * weights.reshape(-1)[dest, None]).to(torch.bfloat16)
        assert torch.equal(slots[dest], want), f"seed={seed} {routing} weights={order}"
        unused = torch.ones(num_slots, dtype=torch.bool, device="cuda")
        unused[dest] = False
        assert torch.isnan(slots[unused].float()).all(), f"seed={seed} {routing}: unused slots were written"


@requires_hopper
def test_deterministic(exact_fp32_matmul):
    g = torch.Generator().manual_seed(31)
    starts, ends, rows, pad, _ = _routed(900, 8, 4, "zipf", g)
    ops = _gaussian_operands(rows, 2048, 8, 1536, pad, g)
    first = _run(*ops, starts, ends)
    for _ in range(3):
        assert torch.equal(_run(*ops, starts, ends).nan_to_num(7.0), first.nan_to_num(7.0))


# -- the overlapping mainloop against the serial one -----------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 as its 16-bit patterns (NaN == NaN bit for bit)."""
    return t.view(torch.int16)


def _assert_same_bits(got, want, where: str, between: str = "mainloop='overlap' and 'serial'") -> None:
    differ = (_bits(got) != _bits(want)).nonzero()
    assert differ.numel() == 0, (f"{where}: {differ.shape[0]} elements differ between {between}, first at "
                                 f"{differ[0].tolist()}: {got[tuple(differ[0])].item()} vs "
                                 f"{want[tuple(differ[0])].item()}")


def _variants(ops, starts, ends, out_shape, variants, scatter=None):
    """The GEMM under each keyword set of ``variants`` into NaN-poisoned outputs."""
    outs = []
    for kwargs in variants:
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        assert m_grouped_fp8_gemm_nt_contiguous(*ops, starts, ends, out, scatter=scatter, **kwargs) is out
        outs.append(out)
    torch.cuda.synchronize()
    return outs


def _both(ops, starts, ends, out_shape, scatter=None):
    """The serial and the overlap GEMM into NaN-poisoned outputs."""
    return _variants(ops, starts, ends, out_shape, [dict(mainloop="serial"), dict(mainloop="overlap")], scatter)


def _scatter_case(n, k, routing, seed):
    """500 tokens, 8 experts, top-4 of ``routing``, Gaussian operands, random fp32 slot weights and the
    mask of the slots no row feeds."""
    g = torch.Generator().manual_seed(seed)
    num_tokens, top_k, e = 500, 4, 8
    starts, ends, rows, pad, meta = _routed(num_tokens, e, top_k, routing, g)
    ops = _gaussian_operands(rows, k, e, n, pad, g)
    num_slots = num_tokens * top_k
    weights = torch.rand(num_tokens, top_k, generator=g).cuda()
    unused = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    unused[meta.row_to_slot[meta.row_to_slot >= 0].long()] = False
    return starts, ends, rows, ops, meta, num_slots, weights, unused


def _routed_operands(n, k, routing, data, seed):
    """A 600-token, 12-expert top-4 pool of ``routing`` with Gaussian or integer operands."""
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(600, 12, 4, routing, g)
    ops = (_gaussian_operands(rows, k, 12, n, pad, g) if data == "gaussian"
           else _int_operands(rows, k, 12, n, pad, g, exact=False))
    return starts, ends, rows, ops


def _routed_cases(shapes):
    """The (data, routing, n, k) grid of a variant comparison on a Hopper GPU."""
    def mark(test):
        for m in (pytest.mark.parametrize("n,k", shapes),
                  pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts", "one_expert"]),
                  pytest.mark.parametrize("data", ["gaussian", "int"]), requires_hopper):
            test = m(test)
        return test
    return mark


def _routed_case(base: int, routing_step: int, n: int, k: int, routing: str, data: str):
    """One routed case of a variant comparison: its seed (from ``base`` + k, the routing kind times
    ``routing_step`` and the data kind), operands, label and the emulation check's mode."""
    seed = base + k + {"uniform": 0, "zipf": 1, "empty_experts": 2, "one_expert": 3}[routing] * routing_step \
        + len(data)
    starts, ends, rows, ops = _routed_operands(n, k, routing, data, seed)
    return starts, ends, rows, ops, f"seed={seed} n={n} k={k} {routing} {data}", \
        "realistic" if data == "gaussian" else "fp32"


# K = 16 .. 2048: 1 to 16 k-blocks, odd and even counts (the overlap schedule's two tails), ragged
# last k-blocks (272, 1008, 16) and N blocks (200, 1000, 64).
_OVERLAP_SHAPES = _QWEN3_30B + _RAGGED + [(256, 128), (384, 256), (128, 384), (256, 512), (640, 640)]


@_routed_cases(_OVERLAP_SHAPES)
def test_overlap_mainloop_is_bit_identical_to_serial(n, k, routing, data, exact_fp32_matmul):
    # Same partial sums (same wgmmas, scale-d = 0 first), promoted in the same order with the same
    # fmaf: every output bit equal, NaN rows (no expert) included; realistic Gaussian operands
    # exercise the tensor cores' reduced-precision accumulation, random fp32 scales the promotion's
    # roundings.
    starts, ends, rows, ops, where, mode = _routed_case(3000 + 1000 * n, 7, n, k, routing, data)
    serial, overlap = _both(ops, starts, ends, (rows, n))
    _assert_same_bits(overlap, serial, where)
    # Not both wrong the same way: the overlap output on its own against the emulation.
    _check(overlap, *ops, starts, ends, mode=mode, what=where)


@requires_hopper
def test_overlap_mainloop_exact_and_at_qwen3_30b_with_128_experts(exact_fp32_matmul):
    # 128 experts, 2048 tokens x top-8 at the L1 forward shape (many tiles per CTA), exact data.
    seed = 97
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(2048, 128, 8, "uniform", g)
    for ops, mode in ((_int_operands(rows, 2048, 128, 1536, pad, g, exact=True), "exact"),
                      (_gaussian_operands(rows, 2048, 128, 1536, pad, g), "realistic")):
        serial, overlap = _both(ops, starts, ends, (rows, 1536))
        _assert_same_bits(overlap, serial, f"seed={seed} E=128 {mode}")
        _check(overlap, *ops, starts, ends, mode=mode, what=f"seed={seed} E=128 {mode} overlap")


@requires_hopper
@pytest.mark.parametrize("k", [128, 256, 640])
def test_overlap_mainloop_with_gaps_and_empty_experts(k, exact_fp32_matmul):
    # Rows [128, 256), [512, 640) and [768, 1024) belong to no expert (stay NaN); experts 1 and 4 are empty.
    seed = 55 + k
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, 256, 256, 640, 768], dtype=torch.int32, device="cuda")
    ends = torch.tensor([128, 256, 512, 768, 768], dtype=torch.int32, device="cuda")
    rows, n = 1024, 384
    ops = _gaussian_operands(rows, k, 5, n, torch.zeros(rows, dtype=torch.bool, device="cuda"), g)
    serial, overlap = _both(ops, starts, ends, (rows, n))
    _assert_same_bits(overlap, serial, f"seed={seed} gaps k={k}")
    _check(overlap, *ops, starts, ends, mode="realistic", what=f"seed={seed} gaps k={k} overlap")


@requires_hopper
def test_overlap_mainloop_without_rows():
    g = torch.Generator().manual_seed(4)
    z = torch.zeros(4, dtype=torch.int32, device="cuda")
    a_q, sa, b_q, sb = _int_operands(0, 256, 4, 256, torch.zeros(0, dtype=torch.bool, device="cuda"), g, exact=True)
    assert m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, z, z, mainloop="overlap").shape == (0, 256)
    a_q, sa, b_q, sb = _int_operands(512, 256, 4, 256, torch.zeros(512, dtype=torch.bool, device="cuda"), g,
                                     exact=True)
    serial, overlap = _both((a_q, sa, b_q, sb), z, z, (512, 256))
    assert torch.isnan(overlap.float()).all() and torch.isnan(serial.float()).all()


@requires_hopper
@pytest.mark.parametrize("routing", ["uniform", "empty_experts", "unused_slots"])
@pytest.mark.parametrize("k", [384, 768])
def test_overlap_mainloop_scatter_epilogues(routing, k, exact_fp32_matmul):
    # Both scatter epilogues (unweighted, weighted with random fp32 weights) bit-identical under the
    # two mainloops; unused slots stay NaN.
    seed = 71 + len(routing) + k
    n = 384
    starts, ends, rows, ops, meta, num_slots, weights, unused = _scatter_case(n, k, routing, seed)
    for w in (None, weights):
        scatter = gg.Scatter(meta.row_to_slot, num_slots, w)
        serial, overlap = _both(ops, starts, ends, (num_slots, n), scatter=scatter)
        where = f"seed={seed} {routing} k={k} weighted={w is not None}"
        _assert_same_bits(overlap, serial, where)
        assert torch.isnan(overlap[unused].float()).all(), f"{where}: unused slots were written"
        assert not torch.isnan(overlap[~unused].float()).any(), f"{where}: used slots left unwritten"


@requires_hopper
def test_overlap_mainloop_deterministic(exact_fp32_matmul):
    g = torch.Generator().manual_seed(32)
    starts, ends, rows, pad, _ = _routed(900, 8, 4, "zipf", g)
    ops = _gaussian_operands(rows, 2048, 8, 1536, pad, g)
    first = _both(ops, starts, ends, (rows, 1536))[1]
    for _ in range(3):
        _assert_same_bits(_both(ops, starts, ends, (rows, 1536))[1], first, "seed=32 repeat")


# -- K compiled in (static_k) against K as an argument ----------------------------------------------------


def test_static_k_configs():
    assert gg.FP8_STATIC_K_STAGES == (5, 4) and gg.FP8_STATIC_K_MAX_BLOCKS == {128: 16, 192: 64}
    # The deepest ring (of 5, 4) that divides ceil(K / 128), up to 16 k-blocks; None: no kernel with K
    # compiled in.
    assert [gg.fp8_static_k_stages(k) for k in (2048, 768, 1536, 4096, 7168, 640, 1280, 896, 128, 512, 16)] == \
        [4, None, 4, None, None, 5, 5, None, None, 4, None]
    # The 192-wide tile fits 4 stages only, and takes up to 64 k-blocks where 4 divides them (its loop
    # unrolls one turn of the ring), up to 16 where it does not (the tile unrolled once per start stage).
    assert gg.FP8_STATIC_K_UNROLLED_BLOCKS == {192: 16}
    assert [gg.fp8_static_k_stages(k, 192) for k in (2048, 768, 1536, 640, 1280, 512, 4096, 3072, 7168, 8192,
                                                      8704, 1920, 2176, 128)] == \
        [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, None, 4, None, 4]
    wide = gg.GemmConfig("nt", 192, dtype="fp8", cluster_n=2, shape_k=1536)
    assert wide.stages == 4 and wide.name == "sm90_fp8_grouped_gemm_nt_n192_s4_c2_k1536"
    assert gg.GemmConfig("nt", 192, dtype="fp8", shape_k=768).name == "sm90_fp8_grouped_gemm_nt_n192_s4_k768"
    with pytest.raises(ValueError, match=r"shape_k=2176: its 17 k-blocks are a multiple of none of the ring depths "
                                         r"\(4,\) of block_n=192, or more than 64 \(and more than 16, the most it "
                                         r"unrolls where no depth divides them\)"):
        gg.GemmConfig("nt", 192, dtype="fp8", shape_k=2176)
    c = gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="overlap", cluster_n=2, epilogue="scatter", shape_k=2048)
    assert c.stages == 4 and c.name == "sm90_fp8_grouped_gemm_nt_n128_s4_scatter_overlap_c2_k2048"
    runtime = gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="overlap", cluster_n=2, epilogue="scatter")
    # Only the ring depth and the traits' trailing K differ from the K-argument kernel's source.
    assert c.code() == runtime.code().replace("128, 5, 2, false", "128, 4, 2, false").replace(
        "ElementType::E4M3>;", "ElementType::E4M3, 2048>;")
    assert c.args == runtime.args
    # The K-argument kernels stay the registered (prebuilt) ones; K-compiled ones are built on first use.
    assert all(config.shape_k == 0 and re.search(r"_k\d+$", config.name) is None for config in fg._configs())
    for kwargs, match in ((dict(shape_k=2048), r"K is compiled into the M-grouped fp8 GEMMs only"),
                          (dict(dtype="fp8", shape_k=896), r"shape_k=896: its 7 k-blocks are a multiple of none"),
                          (dict(dtype="fp8", shape_k=768), r"shape_k=768: its 6 k-blocks are a multiple of none"),
                          (dict(dtype="fp8", shape_k=4096), r"shape_k=4096: its 32 k-blocks .* or more than 16"),
                          (dict(dtype="fp8", shape_k=-128), r"shape_k=-128, expected a non-negative int"),
                          (dict(dtype="fp8", shape_k=True), r"shape_k=True, expected a non-negative int")):
        with pytest.raises(ValueError, match=match):
            gg.GemmConfig("nt", 128, **kwargs)
    with pytest.raises(ValueError, match=r"shape_k=2048 with dtype='fp8', layout='k_nt'"):
        gg.GemmConfig("k_nt", 128, dtype="fp8", shape_k=2048)


def test_static_k_argument_is_checked():
    a_q = torch.zeros(128, 256, dtype=E4M3)
    sa = torch.ones(128, 2)
    b_q = torch.zeros(1, 128, 256, dtype=E4M3)
    sb = torch.ones(1, 1, 2)
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"static_k=1: expected a bool"):
        m_grouped_fp8_gemm_nt_contiguous(a_q, sa, b_q, sb, z, z, static_k=1)


@requires_compiler
def test_static_k_kernel_unrolls_its_k_loop():
    # K = 2048 with the overlap mainloop: the consumers' loop over a tile holds all 16 k-blocks' QGMMAs
    # (4 each) and no loop over k-blocks is left inside it; no spills.
    config = gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop="overlap", shape_k=2048)
    kernel = _build(config)
    assert all(u.spill_bytes == 0 for u in kernel.resources()), config.name
    # 4 stages, the epilogue's 32 KiB, 4 x 528 bytes of scales, rounded up to 1 KiB; 64 bytes of barriers,
    # the scheduler's expert table, the run-time alignment.
    assert config.smem_bytes() == -(-((4 * 32 + 32) * 1024 + 4 * 528) // 1024) * 1024 + 64 + 1024 + 1024 == 169024
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: compile checked, SASS not")
    sass = subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout
    assert sass.count("QGMMA.64x128x32.F32.E4M3.E4M3") >= 64, config.name


def _static_and_argument(ops, starts, ends, out_shape, scatter=None, **kwargs):
    """The GEMM with K as an argument and with K compiled in, into NaN-poisoned outputs."""
    outs = []
    for static_k in (False, True):
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        assert m_grouped_fp8_gemm_nt_contiguous(*ops, starts, ends, out, scatter=scatter, static_k=static_k,
                                                **kwargs) is out
        outs.append(out)
    torch.cuda.synchronize()
    return outs


# 16, 12 and 5 k-blocks (rings of 4, 4, 5), a ragged last k-block (1200: 10, ring 5, or the K-argument
# kernel where that one spills), 6 and 7 k-blocks (no ring divides them: the K-argument kernel runs).
_STATIC_K = [2048, 1536, 640, 1200, 768, 896]


@requires_hopper
@pytest.mark.parametrize("mainloop", ["overlap", "serial"])
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("k", _STATIC_K)
def test_static_k_is_bit_identical(k, cluster_n, mainloop, exact_fp32_matmul):
    seed = 4100 + k + 10 * cluster_n + len(mainloop)
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, meta = _routed(700, 12, 4, "zipf", g)
    n = 384
    ops = _gaussian_operands(rows, k, 12, n, pad, g)
    where = f"seed={seed} k={k} cluster_n={cluster_n} {mainloop}"
    # Which kernel static_k runs: K compiled in where a ring divides the k-blocks and it does not spill.
    chosen = fg._static_k_config(gg.GemmConfig("nt", 128, dtype="fp8", fp8_mainloop=mainloop, cluster_n=cluster_n), k)
    spills = any(u.spill_bytes for u in dataclasses.replace(chosen, shape_k=k).kernel().resources()) \
        if gg.fp8_static_k_stages(k) else True
    assert chosen.shape_k == (0 if spills else k), where
    argument, static = _static_and_argument(ops, starts, ends, (rows, n), mainloop=mainloop, cluster_n=cluster_n)
    _assert_same_bits(static, argument, where)
    _check(static, *ops, starts, ends, mode="realistic", what=where)
    # The combine epilogue too (weighted slot scatter; unused slots stay NaN).
    num_slots = 700 * 4
    scatter = gg.Scatter(meta.row_to_slot, num_slots, torch.rand(700, 4, generator=g).cuda())
    argument, static = _static_and_argument(ops, starts, ends, (num_slots, n), scatter=scatter, mainloop=mainloop,
                                            cluster_n=cluster_n)
    _assert_same_bits(static, argument, where + " scatter")


@requires_hopper
def test_static_k_many_tiles_per_cta_at_qwen3_30b(exact_fp32_matmul):
    # 128 experts, 2048 tokens x top-8: many tiles per CTA, so each CTA's ring wraps many times (every
    # tile must start at stage 0, as the unrolled loop assumes).
    seed = 4242
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(2048, 128, 8, "uniform", g)
    for k, n in ((2048, 1536), (1536, 2048)):
        ops = _int_operands(rows, k, 128, n, pad, g, exact=True)
        argument, static = _static_and_argument(ops, starts, ends, (rows, n), mainloop="overlap")
        _assert_same_bits(static, argument, f"seed={seed} k={k}")
        _check(static, *ops, starts, ends, mode="exact", what=f"seed={seed} k={k} static")
    # The 192-wide tile where the 4-deep ring does not divide the k-blocks (6, 5): with ~16 tiles per CTA
    # the tiles start at every stage the unrolled copies cover (0 and 2; 0 to 3).
    for k, n in ((768, 2048), (640, 1536)):
        assert fg._static_k_config(gg.GemmConfig("nt", 192, dtype="fp8"), k).shape_k == k
        ops = _int_operands(rows, k, 128, n, pad, g, exact=True)
        argument, static = _static_and_argument(ops, starts, ends, (rows, n), mainloop="serial", block_n=192)
        _assert_same_bits(static, argument, f"seed={seed} k={k} n192")
        _check(static, *ops, starts, ends, mode="exact", what=f"seed={seed} k={k} n192 static")


# -- 128 x 192 tiles against 128 x 128 ---------------------------------------------------------------------


def _tiles(ops, starts, ends, out_shape, scatter=None, cluster_n=1):
    """The 128-wide and the 192-wide GEMM (serial mainloop) into NaN-poisoned outputs."""
    return _variants(ops, starts, ends, out_shape, [dict(block_n=b, cluster_n=cluster_n) for b in (128, 192)],
                     scatter)


def _assert_tile_bits(wide, narrow, where: str) -> None:
    _assert_same_bits(wide, narrow, where, between="block_n=192 and 128")


# N: tiles starting on a weight-scale block (n0 % 128 == 0) and half-way into one (64), a last tile past N
# (2048 = 10 tiles + 128 columns, 1000, 200, 64), one tile; K from one k-block to sixteen, ragged.
_N192_SHAPES = _QWEN3_30B + [(768, 2048), (1000, 1008), (200, 272), (64, 16), (192, 256), (384, 640)]


@_routed_cases(_N192_SHAPES)
def test_n192_tiles_match_n128(n, k, routing, data, exact_fp32_matmul):
    # Each output element's k-block partial sums come from one wgmma column either way and are promoted
    # with the same products (sa[row] * sb[block]) in the same k order, so the bits are expected equal;
    # on their own, the 192-wide outputs against the emulation too.
    starts, ends, rows, ops, where, mode = _routed_case(5000 + 997 * n, 11, n, k, routing, data)
    narrow, wide = _tiles(ops, starts, ends, (rows, n))
    _check(wide, *ops, starts, ends, mode=mode, what=where + " n192")
    _assert_tile_bits(wide, narrow, where)


@requires_hopper
def test_n192_tiles_exact_at_qwen3_30b_with_128_experts(exact_fp32_matmul):
    seed = 98
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(2048, 128, 8, "uniform", g)
    for n, k in ((1536, 2048), (2048, 768), (768, 2048)):
        ops = _int_operands(rows, k, 128, n, pad, g, exact=True)
        narrow, wide = _tiles(ops, starts, ends, (rows, n))
        _check(wide, *ops, starts, ends, mode="exact", what=f"seed={seed} E=128 n={n} k={k} n192")
        _assert_tile_bits(wide, narrow, f"seed={seed} E=128 n={n} k={k}")


@requires_hopper
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("routing", ["uniform", "empty_experts", "unused_slots"])
@pytest.mark.parametrize("n", [384, 2048, 200])
def test_n192_tiles_scatter_epilogues_and_clusters(routing, n, cluster_n, exact_fp32_matmul):
    # Both scatter epilogues, clusters of 1 and 2 (B multicast with three 64-row atoms: CTA r loads the
    # atoms j with j % 2 == r): the same bits as the 128-wide tile; unused slots stay NaN.
    seed = 91 + len(routing) + n + cluster_n
    starts, ends, rows, ops, meta, num_slots, weights, unused = _scatter_case(n, 768, routing, seed)
    for w in (None, weights):
        scatter = gg.Scatter(meta.row_to_slot, num_slots, w)
        narrow, wide = _tiles(ops, starts, ends, (num_slots, n), scatter=scatter, cluster_n=cluster_n)
        where = f"seed={seed} {routing} n={n} weighted={w is not None} cluster_n={cluster_n}"
        _assert_tile_bits(wide, narrow, where)
        assert torch.isnan(wide[unused].float()).all(), f"{where}: unused slots were written"
        assert not torch.isnan(wide[~unused].float()).any(), f"{where}: used slots left unwritten"
    # The plain store in clusters too, against the emulation.
    narrow, wide = _tiles(ops, starts, ends, (rows, n), cluster_n=cluster_n)
    _assert_tile_bits(wide, narrow, f"seed={seed} {routing} n={n} store cluster_n={cluster_n}")
    _check(wide, *ops, starts, ends, mode="realistic", what=f"seed={seed} {routing} n={n} cluster_n={cluster_n}")


@requires_hopper
def test_n192_tiles_with_gaps_and_without_rows(exact_fp32_matmul):
    seed = 77
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, 256, 256, 640, 768], dtype=torch.int32, device="cuda")
    ends = torch.tensor([128, 256, 512, 768, 768], dtype=torch.int32, device="cuda")
    rows, n = 1024, 448
    ops = _gaussian_operands(rows, 640, 5, n, torch.zeros(rows, dtype=torch.bool, device="cuda"), g)
    narrow, wide = _tiles(ops, starts, ends, (rows, n))
    _assert_tile_bits(wide, narrow, f"seed={seed} gaps")
    _check(wide, *ops, starts, ends, mode="realistic", what=f"seed={seed} gaps n192")
    z = torch.zeros(4, dtype=torch.int32, device="cuda")
    a_q, sa, b_q, sb = _int_operands(512, 256, 4, 256, torch.zeros(512, dtype=torch.bool, device="cuda"), g,
                                     exact=True)
    narrow, wide = _tiles((a_q, sa, b_q, sb), z, z, (512, 256))
    assert torch.isnan(wide.float()).all() and torch.isnan(narrow.float()).all()


# -- 128 x 192 tiles with K compiled in ---------------------------------------------------------------------


# K -> QGMMA m64n192k32 in the kernel. 16 and 32 k-blocks (the 4-deep ring divides them): a loop over turns of
# the ring, one turn unrolled (4 k-blocks x 4 wgmmas), once for each place where the tile crosses into its
# second weight block (after 128 or 64 columns), 2 x 4 x 4 whatever K is. 6, 5 and 10 k-blocks (it does not):
# a tile starts at a multiple of gcd(k-blocks, 4), and the whole k-loop is unrolled once per such start and
# per split: 2 x 2 x 6, 4 x 2 x 5 and 2 x 2 x 10 k-blocks of 4 wgmmas.
_N192_STATIC_K_QGMMA = {2048: 2 * 4 * 4, 4096: 2 * 4 * 4, 768: 2 * 2 * 6 * 4, 640: 4 * 2 * 5 * 4, 1280: 2 * 2 * 10 * 4}


@requires_compiler
@pytest.mark.parametrize("k", list(_N192_STATIC_K_QGMMA))
def test_n192_static_k_kernel_unrolls_its_loop(k):
    config = gg.GemmConfig("nt", 192, dtype="fp8", shape_k=k)
    kernel = _build(config)
    assert all(u.spill_bytes == 0 for u in kernel.resources()), config.name
    if _CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed: compile checked, SASS not")
    sass = subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout
    assert sass.count("QGMMA.64x192x32.F32.E4M3.E4M3") == _N192_STATIC_K_QGMMA[k], config.name


@requires_compiler
def test_static_k_falls_back_while_loads_are_forbidden():
    # Under jit.no_loads (emulated ranks) a K-compiled kernel that is not loaded yet would raise at its
    # launch: the K-argument configuration (registered, loaded beforehand) is chosen for that call, and
    # the K-compiled one again once loads are allowed (the choice itself stays cached).
    base = gg.GemmConfig("nt", 192, dtype="fp8", epilogue="scatter")
    for k in (768, 256, 2048):
        static = fg._static_k_config(base, k)
        assert static.shape_k == k, k
        if static.kernel().loaded:  # a GPU run that launched it already: nothing to fall back from
            continue
        with jit.no_loads():
            assert jit.loads_allowed() is False
            assert fg._static_k_config(base, k) is base, k
        assert jit.loads_allowed() is True
        assert fg._static_k_config(base, k) is static, k


@requires_hopper
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("k", [2048, 1536, 512, 768, 3072, 640, 1200])
def test_n192_static_k_is_bit_identical(k, cluster_n, exact_fp32_matmul):
    # 16, 12, 4 and 24 k-blocks (ring of 4, every tile from stage 0); 6, 5 and 10 (a ragged last one), which
    # the ring does not divide: tiles start at 2 or 4 stages, the tile unrolled once per start. 700 tokens
    # x top-4 over 12 experts: CTAs take several tiles, so every start is taken. N = 448: tiles starting on
    # a weight block and half-way into one, the last one past N.
    seed = 6100 + k + cluster_n
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, meta = _routed(700, 12, 4, "zipf", g)
    n = 448
    ops = _gaussian_operands(rows, k, 12, n, pad, g)
    where = f"seed={seed} k={k} cluster_n={cluster_n} n192"
    # K compiled in where the ring of 4 divides the k-blocks and the kernel does not spill (else the
    # K-argument kernel runs).
    chosen = fg._static_k_config(gg.GemmConfig("nt", 192, dtype="fp8", cluster_n=cluster_n), k)
    spills = any(u.spill_bytes for u in gg.GemmConfig("nt", 192, dtype="fp8", cluster_n=cluster_n, shape_k=k)
                 .kernel().resources()) if gg.fp8_static_k_stages(k, 192) else True
    assert chosen.shape_k == (0 if spills else k), where
    argument, static = _static_and_argument(ops, starts, ends, (rows, n), mainloop="serial", cluster_n=cluster_n,
                                            block_n=192)
    _assert_same_bits(static, argument, where)
    narrow, _ = _tiles(ops, starts, ends, (rows, n))
    _assert_tile_bits(static, narrow, where)
    _check(static, *ops, starts, ends, mode="realistic", what=where)
    num_slots = 700 * 4
    scatter = gg.Scatter(meta.row_to_slot, num_slots, torch.rand(700, 4, generator=g).cuda())
    argument, static = _static_and_argument(ops, starts, ends, (num_slots, n), scatter=scatter, mainloop="serial",
                                            cluster_n=cluster_n, block_n=192)
    _assert_same_bits(static, argument, where + " scatter")
    used = meta.slot_to_row >= 0
    assert not torch.isnan(static[used].float()).any(), f"{where}: used slots left unwritten"
    assert torch.isnan(static[~used].float()).all(), f"{where}: unused slots were written"


@requires_hopper
def test_n192_static_k_many_tiles_per_cta_at_qwen3_30b(exact_fp32_matmul):
    # 128 experts, 2048 tokens x top-8, the layer's K: each CTA's ring wraps many times.
    seed = 4343
    g = torch.Generator().manual_seed(seed)
    starts, ends, rows, pad, _ = _routed(2048, 128, 8, "uniform", g)
    for k, n in ((2048, 1536), (1536, 2048), (2048, 768), (4096, 384)):
        ops = _int_operands(rows, k, 128, n, pad, g, exact=True)
        argument, static = _static_and_argument(ops, starts, ends, (rows, n), mainloop="serial", block_n=192)
        _assert_same_bits(static, argument, f"seed={seed} k={k} n={n} n192")
        _check(static, *ops, starts, ends, mode="exact", what=f"seed={seed} k={k} n={n} n192 static")
