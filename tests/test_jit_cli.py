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

from conftest import requires_compiler

REPO = Path(__file__).resolve().parents[1]

pytestmark = requires_compiler


def _block(stdout: str, group: str) -> dict[str, list[str]]:
    """The rows under ``group``'s heading, by (short) config name."""
    lines = stdout.splitlines()
    start = lines.index(group) + 1
    rows = {}
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        rows[line.split()[0]] = line.split()
    return rows


def test_cli_builds_the_routing_kernels(tmp_path):
    env = dict(os.environ, DGE_JIT_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "deep_gemm_ext.jit", "build", "--arch", "sm_90a", "--only", "moe_routing", "-j", "2"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _block(result.stdout, "moe_routing")
    assert {"scan", "histogram_int32", "scatter_int64", "cluster_int32", "cluster_int64"} <= set(rows)
    entries = sorted(entry.name for entry in (tmp_path / "kernels").iterdir())
    assert len(entries) == 7
    for cells in rows.values():
        registers, spills, key = int(cells[1]), cells[2], cells[-1]
        assert 0 < registers <= 255 and spills == "0+0"
        assert len(key) == 8 and sum(entry.rsplit(".", 1)[1].startswith(key) for entry in entries) == 1
    assert "7/7 configurations OK for sm_90a" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 100
    assert str(tmp_path) not in result.stdout  # paths only with -v

    verbose = subprocess.run(command + ["-v"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    for cells in _block(verbose.stdout, "moe_routing").values():
        assert cells[6] == "hit" and Path(cells[8]).parent == tmp_path / "kernels"


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
    row = _block(capsys.readouterr().out, "test_cli_fake_gemm")["fake_gemm"]
    assert row[4:6] == ["4096", "NO"]  # dynamic smem as the source exports it; no wgmma in the PTX

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


_LOAD_ALL_SCRIPT = """
import deep_gemm_ext
from deep_gemm_ext.jit import compiler, registry, runtime
loaded = []
runtime.Kernel.load = lambda self: loaded.append(self.name)  # no GPU: record what would load
compiler.compile_cached = lambda name, code, arch: None       # and build nothing
count = runtime.load_registered()
registry.import_kernel_modules()
every = sorted(c.name for configs in registry.registered_configs().values() for c in configs)
assert count == len(every) and sorted(loaded) == every, (count, len(every), sorted(set(every) - set(loaded)))
print("OK", count)
"""


def test_load_registered_loads_what_the_cli_builds():
    """In a fresh process (only the package imported): every configuration of every kernel module,
    the exchange's too (the package's __init__ does not import every module)."""
    proc = subprocess.run([sys.executable, "-c", _LOAD_ALL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = int(proc.stdout.split()[1])
    assert count >= 15, proc.stdout  # the exchange's 15 at least


def test_cli_refuses_an_empty_only(capsys):
    """``--only ''`` would match every configuration: an argument error, not a silent --all."""
    with pytest.raises(SystemExit):
        cli.main(["build", "--only", ""])
    assert "--only '' matches every configuration" in capsys.readouterr().err
