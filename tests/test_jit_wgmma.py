"""The preprocessor-generated wgmma operand lists (kernels/ptx/wgmma.cuh) for shapes beyond the two
the GEMM core uses: ptxas rejects an instruction whose accumulator count or operand numbers are
wrong, so assembling them checks the generator (needs nvcc, no GPU)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from deep_gemm_ext import jit

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

# N and the decimal digits (T, U) of its N / 2 accumulators: every partial-row and carry case.
_SHAPES = [(8, "", 4), (16, "", 8), (24, 1, 2), (40, 2, 0), (56, 2, 8), (88, 4, 4), (120, 6, 0), (200, 10, 0),
           (248, 12, 4)]


def test_generated_shapes_assemble(tmp_path):
    defines = "\n".join(f"DGE_DEFINE_WGMMA_BF16_SS({n}, {t}, {u})" for n, t, u in _SHAPES)
    kernels = "\n".join(f"template __global__ void k<{n}>(float*, uint64_t, uint64_t);"
                        for n in [s[0] for s in _SHAPES] + [128, 256])
    (tmp_path / "wgmma.cu").write_text(f"""#include <ptx/wgmma.cuh>
namespace dge::ptx {{
{defines}
}}
template <uint32_t N>
__global__ void k(float* p, uint64_t a, uint64_t b) {{
    float d[N / 2];
    for (uint32_t i = 0; i < N / 2; ++i) d[i] = p[i];
    dge::ptx::WgmmaBF16SS<N, 0, 1>::mma(d, a, b, 1);
    for (uint32_t i = 0; i < N / 2; ++i) p[i] = d[i];
}}
{kernels}
""")
    ptx = tmp_path / "wgmma.ptx"
    for kind, out in (("-ptx", ptx), ("-cubin", tmp_path / "wgmma.cubin")):
        result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", f"-I{jit.kernels_dir()}", kind, "-o", str(out),
                                 str(tmp_path / "wgmma.cu")], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-4000:]
    for line in ptx.read_text().splitlines():
        m = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{([^}]*)\}, (.*);", line)
        if m:
            n, regs, rest = int(m.group(1)), m.group(2).split(","), m.group(3)
            assert len(regs) == n // 2, (n, len(regs))
            assert rest.replace(" ", "").endswith("p,1,1,0,1"), (n, rest)
    assert sorted(int(n) for n in re.findall(r"\.m64n(\d+)k16", ptx.read_text())) == sorted(
        [s[0] for s in _SHAPES] + [128, 256])


def test_wrong_digits_are_rejected(tmp_path):
    (tmp_path / "bad.cu").write_text("#include <ptx/wgmma.cuh>\nnamespace dge::ptx {\n"
                                     "DGE_DEFINE_WGMMA_BF16_SS(64, 3, 0)\n}\n")
    result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", f"-I{jit.kernels_dir()}", "-ptx", "-o",
                             str(tmp_path / "bad.ptx"), str(tmp_path / "bad.cu")], capture_output=True, text=True)
    assert result.returncode != 0 and "T, U must be the digits of N/2" in result.stdout + result.stderr
