"""SASS of every GEMM configuration issues HGMMA (the tensor-core warpgroup MMA of SM90).

Runs wherever cuobjdump is installed (the CUDA toolkit of a GPU machine; no GPU needed), on the
cubins of the JIT cache (built first if missing); skips otherwise.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from deep_gemm_ext import jit
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

_CUOBJDUMP = shutil.which("cuobjdump") or (
    "/usr/local/cuda/bin/cuobjdump" if shutil.which("/usr/local/cuda/bin/cuobjdump") else None)
pytestmark = pytest.mark.skipif(_CUOBJDUMP is None or shutil.which("nvcc") is None and
                                shutil.which("/usr/local/cuda/bin/nvcc") is None,
                                reason="needs cuobjdump and nvcc (the CUDA toolkit)")


@pytest.mark.parametrize("name,code", [(c[0], c[1]) for c in gg.configs()], ids=[c[0] for c in gg.configs()])
def test_gemm_sass_has_hgmma(name, code):
    kernel = jit.build(name, code)
    sass = subprocess.run([_CUOBJDUMP, "--dump-sass", str(kernel.cubin_path)], check=True, capture_output=True,
                          text=True).stdout
    count = sass.count("HGMMA")
    assert count > 0, f"{name}: no HGMMA in its SASS"
    assert all(u.spill_bytes == 0 for u in kernel.resources()), f"{name}: spills {kernel.resources()}"
