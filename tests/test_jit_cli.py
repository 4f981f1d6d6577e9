"""`python -m deep_gemm_ext.jit build`: compiles registered configs without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deep_gemm_ext import jit
from deep_gemm_ext.jit import __main__ as cli
from deep_gemm_ext.jit import compiler

REPO = Path(__file__).resolve().parents[1]

try:
    compiler.select_compiler()
    HAS_COMPILER = True
except RuntimeError:
    HAS_COMPILER = False

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no nvcc and no NVRTC here")


def test_cli_builds_the_routing_kernels(tmp_path):
    env = dict(os.environ, DGE_JIT_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "deep_gemm_ext.jit", "build", "--arch", "sm_90a",
                             "--only", "moe_routing", "-j", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split()[1]: line.split() for line in result.stdout.splitlines() if line.startswith("moe_routing ")}
    assert {"moe_routing_scan", "moe_routing_histogram_int32", "moe_routing_scatter_int64"} <= set(lines)
    for cells in lines.values():
        registers, spills = int(cells[2]), cells[3]
        assert 0 < registers <= 255 and spills == "0+0"
    assert "5/5 configurations OK for sm_90a" in result.stdout
    assert len(list((tmp_path / "kernels").iterdir())) == 5


_NO_WGMMA_GEMM = """#include <common/utils.cuh>
extern "C" __constant__ const unsigned int dge_dynamic_smem_bytes = 4096;
template <int kN>
__global__ void fake_gemm_kernel(float* out) { out[threadIdx.x] = kN; }
template __global__ void fake_gemm_kernel<1>(float*);
"""


@pytest.fixture
def registry_entry():
    added = []

    def add(name, configs):
        jit.register(name)(lambda: configs)
        added.append(name)

    yield add
    from deep_gemm_ext.jit import registry
    for name in added:
        registry._registry.pop(name, None)


def test_cli_reports_wgmma_and_fails_on_errors(tmp_path, monkeypatch, capsys, registry_entry):
    monkeypatch.setenv("DGE_JIT_CACHE_DIR", str(tmp_path))
    registry_entry("test_cli_fake_gemm", [("fake_gemm", _NO_WGMMA_GEMM, True)])
    assert cli.main(["build", "--only", "test_cli_fake_gemm"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("test_cli_fake_gemm"))
    assert row.split()[5:7] == ["4096", "NO"]  # dynamic smem as the source exports it; no wgmma in the PTX

    registry_entry("test_cli_broken", [("broken", _NO_WGMMA_GEMM.replace("kN;", "kN + nope;"), False)])
    assert cli.main(["build", "--only", "test_cli_broken"]) == 1
    assert "FAILED broken" in capsys.readouterr().err


def test_cli_fails_on_gemm_spills(tmp_path, monkeypatch, capsys, registry_entry):
    monkeypatch.setenv("DGE_JIT_CACHE_DIR", str(tmp_path))
    registry_entry("test_cli_spilly", [("spilly_gemm", _NO_WGMMA_GEMM, True)])
    spilling = compiler.ResourceUsage("fake_gemm_kernel", registers=255, spill_stores=64, spill_loads=64)
    monkeypatch.setattr(compiler.CacheEntry, "resources", lambda self: [spilling])
    assert cli.main(["build", "--only", "test_cli_spilly"]) == 1
    assert "spills 64 B stores + 64 B loads" in capsys.readouterr().err
