"""JIT runtime on the CPU: cache keys, the disk cache under concurrency, env knobs, errors.

Compiling needs nvcc (or NVRTC); those tests skip where neither exists.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deep_gemm_ext import jit
from deep_gemm_ext.jit import compiler

from conftest import requires_compiler

REPO = Path(__file__).resolve().parents[1]



# A tiny kernel on the real include tree; `tag` makes each test's source (and cache key) unique.
_KERNEL = """#include <common/utils.cuh>
template <int kScale>
__global__ void scale_kernel(float* out, const float* in, int n) {{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * kScale;  // {tag}
}}
template __global__ void scale_kernel<{scale}>(float*, const float*, int);
"""


def _code(tag: str, scale: int = 2) -> str:
    return _KERNEL.format(tag=tag, scale=scale)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("DGE_JIT_CACHE_DIR", str(path))
    for knob in ("DGE_JIT_DEBUG", "DGE_JIT_USE_NVRTC", "DGE_JIT_NVCC_COMPILER", "DGE_JIT_PTXAS_VERBOSE",
                 "DGE_JIT_DUMP_PTX", "DGE_JIT_DUMP_SASS", "DGE_JIT_WITH_LINEINFO"):
        monkeypatch.delenv(knob, raising=False)
    return path


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "kernels").iterdir()) if (cache / "kernels").is_dir() else []


# -- cache key --------------------------------------------------------------------------------------


def test_import_needs_no_gpu_or_compiler():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PATH="/nonexistent", DGE_JIT_NVCC_COMPILER="")
    code = "import deep_gemm_ext.jit as j, deep_gemm_ext.jit_kernels as k; print(j.kernels_dir().name)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("kernels", "_kernels")


def test_cache_key_follows_transitive_headers(tmp_path):
    root = tmp_path / "kernels"
    (root / "impls").mkdir(parents=True)
    (root / "common").mkdir()
    (root / "impls" / "k.cuh").write_text('#pragma once\n#include "../common/a.cuh"\n#include <cuda_bf16.h>\n')
    (root / "common" / "a.cuh").write_text("#pragma once\n  #  include <common/b.cuh>\n")
    (root / "common" / "b.cuh").write_text("// v1\n")
    (root / "common" / "unrelated.cuh").write_text("// v1\n")
    code = "#include <impls/k.cuh>\ntemplate __global__ void f<1>();\n"
    args = (["-O3"], "nvcc:test", "sm_90a")

    headers = compiler.included_headers(code, root)
    assert sorted(headers) == ["common/a.cuh", "common/b.cuh", "impls/k.cuh"]
    key = compiler.cache_key(code, *args, root=root)
    (root / "common" / "unrelated.cuh").write_text("// v2\n")
    assert compiler.cache_key(code, *args, root=root) == key
    (root / "common" / "b.cuh").write_text("// v2\n")  # two includes deep
    assert compiler.cache_key(code, *args, root=root) != key


def test_cache_key_covers_code_flags_compiler_and_arch(tmp_path):
    code = "#include <impls/none.cuh>\n"
    base = compiler.cache_key(code, ["-O3"], "nvcc:13.0", "sm_90a", root=tmp_path)
    assert compiler.cache_key(code, ["-O3"], "nvcc:13.0", "sm_90a", root=tmp_path) == base
    assert compiler.cache_key(code + " ", ["-O3"], "nvcc:13.0", "sm_90a", root=tmp_path) != base
    assert compiler.cache_key(code, ["-O3", "-lineinfo"], "nvcc:13.0", "sm_90a", root=tmp_path) != base
    assert compiler.cache_key(code, ["-O3"], "nvcc:13.1", "sm_90a", root=tmp_path) != base
    assert compiler.cache_key(code, ["-O3"], "nvrtc:13.0", "sm_90a", root=tmp_path) != base
    assert compiler.cache_key(code, ["-O3"], "nvcc:13.0", "sm_100a", root=tmp_path) != base


def test_real_kernels_include_their_headers():
    from deep_gemm_ext.jit_kernels import routing
    name, code = routing._SCAN
    assert {"impls/moe_routing.cuh", "common/utils.cuh"} <= set(compiler.included_headers(code, jit.kernels_dir()))


def test_gencode_flag_rejects_virtual_arch():
    assert compiler.gencode_flag("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"
    with pytest.raises(ValueError, match="compute_90a"):
        compiler.gencode_flag("compute_90a")


def test_parse_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
"""
    (usage,) = compiler.parse_ptxas_log(log)
    assert usage == compiler.ResourceUsage("_Z3fooPf", registers=168, stack_frame=24, spill_stores=8,
                                           spill_loads=12, static_smem=1024)
    assert usage.spill_bytes == 20


# -- compiling and the disk cache ----------------------------------------------------------------------


@requires_compiler
def test_build_populates_cache_then_hits(cache_dir):
    code = _code("build")
    kernel = jit.build("scale_build", code)
    (entry,) = _entries(cache_dir)
    assert entry.name.startswith("scale_build.")
    assert kernel.cubin_path == entry / "kernel.cubin"
    assert kernel.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert (entry / "kernel.cu").read_text() == code
    (usage,) = kernel.resources()
    assert usage.registers > 0 and usage.spill_bytes == 0
    assert jit.build("scale_build", code) is kernel  # in-process cache
    again = compiler.compile_cached("scale_build", code)  # disk cache
    assert not again.compiled and again.path == entry
    assert not any((cache_dir / "tmp").iterdir())


@requires_compiler
def test_compile_error_is_reported_and_cleaned(cache_dir):
    with pytest.raises(RuntimeError, match="failed") as info:
        jit.build("broken", _code("broken").replace("in[i] * kScale", "in[i] * undefined_symbol"))
    assert "undefined_symbol" in str(info.value)
    assert _entries(cache_dir) == []
    assert not any((cache_dir / "tmp").iterdir())


def _compile_in_child(cache: str, code: str, start_at: float):
    os.environ["DGE_JIT_CACHE_DIR"] = cache
    while time.time() < start_at:
        time.sleep(0.001)
    entry = compiler.compile_cached("scale_race", code)
    return str(entry.path), entry.compiled


@requires_compiler
def test_concurrent_compiles_publish_one_entry(cache_dir):
    code = _code(f"race {time.time_ns()}")
    start_at = time.time() + 3.0  # all four children compile at once, after their imports
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(_compile_in_child, [(str(cache_dir), code, start_at)] * 4)
    paths = {path for path, _ in results}
    assert len(paths) == 1
    assert sum(compiled for _, compiled in results) >= 1
    (entry,) = _entries(cache_dir)
    assert str(entry) in paths
    assert (entry / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    assert list((cache_dir / "tmp").iterdir()) == []  # losers removed their copies


# -- environment knobs ------------------------------------------------------------------------------


@requires_compiler
def test_cache_dir_knob(cache_dir, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("DGE_JIT_CACHE_DIR", str(other))
    entry = compiler.compile_cached("scale_dir", _code("dir"))
    assert entry.path.parent == other / "kernels"
    assert _entries(cache_dir) == []


@pytest.mark.skipif(compiler.find_nvcc() is None, reason="no nvcc here")
def test_nvcc_compiler_knob(cache_dir, tmp_path, monkeypatch):
    real = compiler.find_nvcc()
    calls = tmp_path / "calls.txt"
    wrapper = tmp_path / "my-nvcc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("DGE_JIT_NVCC_COMPILER", str(wrapper))
    assert compiler.select_compiler().path == wrapper
    entry = compiler.compile_cached("scale_nvcc", _code("nvcc"))
    assert (entry.path / "command.txt").read_text().startswith(str(wrapper))
    assert "-cubin" in calls.read_text()

    monkeypatch.setenv("DGE_JIT_NVCC_COMPILER", str(tmp_path / "missing-nvcc"))
    with pytest.raises(RuntimeError, match="DGE_JIT_NVCC_COMPILER"):
        compiler.select_compiler()


@pytest.mark.skipif(compiler.find_nvcc() is None, reason="no nvcc here")
def test_lineinfo_knob(cache_dir, monkeypatch):
    plain = compiler.compile_cached("scale_lines", _code("lines"))
    assert "-lineinfo" not in (plain.path / "command.txt").read_text()
    monkeypatch.setenv("DGE_JIT_WITH_LINEINFO", "1")
    lined = compiler.compile_cached("scale_lines", _code("lines"))
    assert "-lineinfo" in (lined.path / "command.txt").read_text()
    assert lined.path != plain.path  # a different key, not a stale hit


@requires_compiler
def test_dump_ptx_knob(cache_dir, monkeypatch):
    entry = compiler.compile_cached("scale_ptx", _code("ptx"))
    assert not entry.ptx_path.exists()
    monkeypatch.setenv("DGE_JIT_DUMP_PTX", "1")
    hit = compiler.compile_cached("scale_ptx", _code("ptx"))  # a hit gains the dump
    assert hit.path == entry.path and ".entry" in hit.ptx_path.read_text()
    fresh = compiler.compile_cached("scale_ptx_fresh", _code("ptx fresh"))
    assert ".entry" in fresh.ptx_path.read_text()


@requires_compiler
def test_dump_sass_knob(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("DGE_JIT_DUMP_SASS", "1")
    with caplog.at_level(logging.WARNING, logger="deep_gemm_ext.jit"):
        entry = compiler.compile_cached("scale_sass", _code("sass"))
    if compiler.select_compiler().cuobjdump() is None:
        assert "cuobjdump" in caplog.text and not (entry.path / "kernel.sass").exists()
    else:
        assert "scale_kernel" in (entry.path / "kernel.sass").read_text()


@requires_compiler
def test_ptxas_verbose_knob(cache_dir, monkeypatch, capfd):
    monkeypatch.setenv("DGE_JIT_PTXAS_VERBOSE", "1")
    compiler.compile_cached("scale_verbose", _code("verbose"))
    err = capfd.readouterr().err
    assert "ptxas report for scale_verbose" in err and "registers" in err


@requires_compiler
def test_debug_knob_logs_compiles_and_hits(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("DGE_JIT_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger="deep_gemm_ext.jit"):
        compiler.compile_cached("scale_debug", _code("debug"))
        compiler.compile_cached("scale_debug", _code("debug"))
    assert "compiled scale_debug" in caplog.text and "cache hit scale_debug" in caplog.text


@requires_compiler
def test_slow_first_compile_logs_one_line(cache_dir, monkeypatch, caplog):
    monkeypatch.setattr(compiler, "SLOW_COMPILE_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="deep_gemm_ext.jit"):
        compiler.compile_cached("scale_slow", _code("slow"))
        compiler.compile_cached("scale_slow", _code("slow"))
    lines = [r.getMessage() for r in caplog.records if "scale_slow" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("compiled scale_slow in ") and lines[0].endswith(" s")


def test_use_nvrtc_knob(cache_dir, monkeypatch):
    monkeypatch.setenv("DGE_JIT_USE_NVRTC", "1")
    try:
        chosen = compiler.select_compiler()
    except RuntimeError as exc:
        assert "DGE_JIT_USE_NVRTC" in str(exc) and "nvrtc" in str(exc).lower()
        return
    assert chosen.kind == "nvrtc"
    entry = compiler.compile_cached("scale_nvrtc", _code("nvrtc"))
    assert (entry.path / "command.txt").read_text().startswith("nvrtc ")
    assert entry.cubin_path.read_bytes()[:4] == b"\x7fELF"


def test_no_compiler_error_is_clear(cache_dir, monkeypatch):
    monkeypatch.setattr(compiler, "find_nvcc", lambda: None)
    monkeypatch.setattr(compiler, "_nvrtc_compiler", lambda: (_ for _ in ()).throw(RuntimeError("NVRTC is gone")))
    with pytest.raises(RuntimeError, match="no CUDA compiler found.*NVRTC is gone"):
        compiler.select_compiler()


# -- registry and launch errors ----------------------------------------------------------------------


def test_registered_configs_cover_the_jit_kernels():
    import deep_gemm_ext.jit_kernels  # noqa: F401  (its modules register their configs on import)
    groups = jit.registered_configs()
    names = {config.name for configs in groups.values() for config in configs}
    assert {"moe_routing", "swiglu", "gather_combine"} <= set(groups)
    assert {"moe_routing_scatter_int64", "swiglu_backward_clamp", "combine_rows_weighted"} <= names
    for configs in groups.values():
        for config in configs:
            assert config.code.count("template __global__") + config.code.count("__instantiate") >= 1


def test_registry_imports_no_kernel_module():
    # The registry only stores; the CLI imports the kernel modules (no jit <-> jit_kernels cycle).
    import ast
    from pathlib import Path
    for module in ("registry", "__init__", "compiler", "runtime", "args", "tma"):
        tree = ast.parse((Path(jit.__file__).parent / f"{module}.py").read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not any("jit_kernels" in name for name in names), module


def test_register_rejects_a_second_owner():
    @jit.register("test_jit_duplicate")
    def first():
        return []

    with pytest.raises(ValueError, match="already registered"):
        jit.register("test_jit_duplicate")(lambda: [])


@requires_compiler
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_launch_without_gpu_is_a_clear_error(cache_dir):
    kernel = jit.build("scale_nogpu", _code("nogpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel.launch((1, 1, 1), (32, 1, 1), ())


def test_make_tma_2d_rejects_host_tensors():
    with pytest.raises(ValueError, match="CUDA tensor"):
        jit.make_tma_2d(torch.zeros(64, 64, dtype=torch.bfloat16), 64, 64)


def test_pack_args_fast_path_matches_the_checked_one():
    """The cached per-declaration packers give the checked packer's tuple (and its errors)."""
    import ctypes
    from deep_gemm_ext.jit.args import _pack_checked
    decl = (jit.KernelArg("a", "const int*"), jit.KernelArg("b", "float*", True), jit.KernelArg("n", "uint32_t"),
            jit.KernelArg("i", "int"), jit.KernelArg("f", "float"), jit.KernelArg("raw", "const void*", True),
            jit.KernelArg("q", "unsigned long long"))
    a, b = torch.zeros(2, dtype=torch.int32), torch.zeros(3)
    cases = [dict(a=a, b=b, n=5, i=-7, f=1.5, raw=None, q=2 ** 63),
             dict(a=torch.nn.Parameter(a.float(), requires_grad=False).int(), b=None, n=0, i=3, f=2, raw=b, q=0)]
    for values in cases:
        for _ in range(2):  # first call builds the packers, the second uses them
            got, ref = jit.pack_args("k", decl, **values), _pack_checked("k", decl, values)
            assert len(got) == len(ref)
            for g, r in zip(got, ref):
                if isinstance(r, torch.Tensor):
                    assert g is r
                else:
                    assert type(g) is type(r) and g.value == r.value and isinstance(g, ctypes._SimpleCData)
    for bad, message in ((dict(n=True), "expected an int in"), (dict(n=2 ** 32), "expected an int in"),
                         (dict(b=a), "float32 tensor or None"), (dict(raw=3), "tensor or None, got int"),
                         (dict(f="x"), "expected a float"), (dict(a=None), "expected a torch.int32 tensor")):
        with pytest.raises(TypeError, match=message):
            jit.pack_args("k", decl, **(cases[0] | bad))
    with pytest.raises(TypeError, match="missing \\['q'\\]"):
        jit.pack_args("k", decl, **{k: v for k, v in cases[0].items() if k != "q"})
    with pytest.raises(TypeError, match="unexpected \\['z'\\]"):
        jit.pack_args("k", decl, **(cases[0] | dict(z=1)))
