"""The host path of a launch and of a call: parameter bytes packed by generated code, launcher checks
and call plans reused by what they read of their arguments. CPU tests (no kernel runs)."""
import ctypes
import struct

import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext import plan
from deep_gemm_ext.jit.args import KernelArg, compile_positional, layout_of, pack_args, pack_bytes
from deep_gemm_ext.jit.tma import TensorMap, _Encoded
from deep_gemm_ext.testing import make_inputs

try:
    from deep_gemm_ext.jit_kernels.sm90_bf16_grouped_gemm import Gather, Scatter, checked, checks_key
except ImportError:  # no cuda-python
    checks_key = None


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU: packing reads only ``is_cuda`` and the address."""

    @property
    def is_cuda(self):
        return True


DECL = (KernelArg("a", "const float*"), KernelArg("n", "uint32_t"), KernelArg("m", "CUtensorMap"),
        KernelArg("f", "float"), KernelArg("o", "int*", True), KernelArg("q", "unsigned long long"),
        KernelArg("i", "int"), KernelArg("raw", "const void*"))


def _map(seed: int) -> TensorMap:
    return TensorMap(_Encoded(bytes((seed + j) % 256 for j in range(128))), torch.empty(1), 1, 1, 1, 1, 0)


def test_layout_aligns_each_parameter():
    layout = layout_of([("Q", 8), ("I", 4), ("128s", 64), ("f", 4), ("Q", 8)])
    assert layout.offsets == (0, 8, 64, 192, 200) and layout.size == 208
    assert struct.calcsize(layout.fmt) == layout.size


def test_pack_bytes_writes_what_pack_args_packs():
    x = torch.randn(8).as_subclass(_OnGpu)
    o = torch.zeros(4, dtype=torch.int32).as_subclass(_OnGpu)
    raw = torch.zeros(3, dtype=torch.float16).as_subclass(_OnGpu)
    m = _map(5)
    for values in (dict(a=x, n=7, m=m, f=0.25, o=None, q=2 ** 40 + 3, i=-9, raw=raw),
                   dict(a=x, n=0, m=m, f=3, o=o, q=0, i=2 ** 31 - 1, raw=raw)):  # an int for the float
        layout, payload = pack_bytes("k", DECL, **values)
        got = struct.unpack(layout.fmt, payload)
        want = []
        for arg, packed in zip(DECL, pack_args("k", DECL, **values)):
            want.append(packed.data_ptr() if isinstance(packed, torch.Tensor) else packed.data
                        if isinstance(packed, TensorMap) else packed.value)
        assert list(got) == want
        assert got[0] == x.data_ptr() and got[2] == m.data and got[4] == (0 if values["o"] is None else o.data_ptr())


@pytest.mark.parametrize("bad, error", [
    (dict(n=-1), "kernel argument 'n' (uint32_t): expected an int in [0, 2**32)"),
    (dict(n=True), "kernel argument 'n' (uint32_t): expected an int"),
    (dict(i=2 ** 31), "kernel argument 'i' (int): expected an int in [-2**31, 2**31)"),
    (dict(f="x"), "kernel argument 'f' (float): expected a float, got 'x'"),
    (dict(m=3), "kernel argument 'm' (CUtensorMap): expected a jit.TensorMap, got int"),
    (dict(a=torch.zeros(2, dtype=torch.int32)), "expected a torch.float32 tensor, got a torch.int32 tensor"),
    (dict(a=torch.zeros(2)), "argument 0 is a tensor on cpu, expected a CUDA tensor"),
    (dict(o=5), "kernel argument 'o' (int*): expected a torch.int32 tensor or None, got int"),
])
def test_pack_bytes_names_the_bad_argument(bad, error):
    values = dict(a=torch.randn(2).as_subclass(_OnGpu), n=1, m=_map(0), f=1.0, o=None, q=1, i=0,
                  raw=torch.zeros(1).as_subclass(_OnGpu))
    values.update(bad)
    with pytest.raises((TypeError, ValueError)) as info:
        pack_bytes("k", DECL, **values)
    assert error in str(info.value)


def test_pack_bytes_names_missing_and_unexpected_arguments():
    with pytest.raises(TypeError, match=r"missing \['m', 'f', 'o', 'q', 'i', 'raw'\], unexpected \['z'\]"):
        pack_bytes("k", DECL, a=torch.zeros(1).as_subclass(_OnGpu), n=1, z=2)


def test_positional_packer_matches_the_argument_types():
    x = torch.randn(4).as_subclass(_OnGpu)
    m = _map(9)
    kinds = (_OnGpu, ctypes.c_int32, TensorMap, ctypes.c_int64, ctypes.c_float, ctypes.c_uint32, ctypes.c_uint64)
    layout, pack = compile_positional(kinds)
    payload = pack("k", (x, ctypes.c_int32(-5), m, ctypes.c_int64(-2 ** 40), ctypes.c_float(2.5),
                         ctypes.c_uint32(2 ** 32 - 1), ctypes.c_uint64(2 ** 64 - 1)))
    assert struct.unpack(layout.fmt, payload) == (x.data_ptr(), -5, m.data, -2 ** 40, 2.5, 2 ** 32 - 1, 2 ** 64 - 1)
    assert compile_positional((int,)) is None  # plain numbers are ambiguous: the launch raises
    _, pack_cpu = compile_positional((torch.Tensor,))
    with pytest.raises(ValueError, match="argument 0 is a tensor on cpu, expected a CUDA tensor"):
        pack_cpu("k", (torch.zeros(1),))


@pytest.mark.skipif(checks_key is None, reason="needs cuda-python (the launchers' module)")
def test_checks_key_reads_everything_the_checks_read():
    a = torch.zeros(8, 16)
    same = torch.ones(8, 16)
    base = checks_key("m", a, None, 1, "nt")
    assert base == checks_key("m", same, None, 1, "nt")  # the data and the address are not in it
    for other in (torch.zeros(8, 32)[:, :16],  # not contiguous
                  torch.zeros(8, 16, dtype=torch.float64), torch.zeros(16, 8), torch.zeros(8, 16).as_subclass(_OnGpu)):
        assert checks_key("m", other, None, 1, "nt") != base
    assert checks_key("m", a, None, True, "nt") != base  # True is not 1 here
    idx = torch.zeros(8, dtype=torch.int32)
    assert checks_key(Gather(idx, 2)) != checks_key(Gather(idx, 2, "other"))
    assert checks_key(Scatter(idx, 8)) != checks_key(Scatter(idx, 8, torch.zeros(8)))
    assert checks_key(Scatter(idx, 8, torch.zeros(8))) != checks_key(Scatter(idx, 8, row_weights=torch.zeros(8)))
    assert checks_key(Gather(idx, 2, "cp_async", object())) is None  # awaited rows: always checked
    assert checks_key(Scatter("rows", 8)) is None and checks_key([1, 2]) is None and checks_key(1.0, {}) is None
    assert checks_key("m", a, ["unhashable"]) is None


@pytest.mark.skipif(checks_key is None, reason="needs cuda-python (the launchers' module)")
def test_checked_caches_only_what_passed():
    calls = []

    def check(ok):
        calls.append(ok)
        if not ok:
            raise ValueError("bad")
        return "config"

    key = checks_key("test_checked_caches_only_what_passed", torch.zeros(3))
    with pytest.raises(ValueError):
        checked(key, lambda: check(False))
    assert checked(key, lambda: check(True)) == "config"
    assert checked(key, lambda: check(False)) == "config"  # passed once: the same key is not checked again
    assert calls == [False, True]
    assert checked(None, lambda: check(True)) == "config" and calls == [False, True, True]


def test_a_cached_call_still_rejects_what_its_key_does_not_cover(monkeypatch):
    x, idx, w, l1, l2 = make_inputs(32, 64, 32, 4, 2, device="cpu", dtype=torch.float32, seed=3)
    plan.clear_cache()
    y = dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=1.0)
    assert torch.isfinite(y).all()
    assert len(plan._CALLS) == 1
    with pytest.raises(TypeError, match="activation_clamp must be a float or None"):
        dge.mega_moe_train(x, idx, w, l1, l2, activation_clamp=True)  # == 1.0, but not the same call
    x_strided = torch.randn(32, 128)[:, ::2]
    with pytest.raises(ValueError, match="x must be contiguous"):
        dge.mega_moe_train(x_strided, idx, w, l1, l2, activation_clamp=1.0)
    with pytest.raises(ValueError, match="l2_weights has shape"):
        dge.mega_moe_train(x, idx, w, l1, l2[:, :, :16], activation_clamp=1.0)
    # The same shapes with other data: the cached plan, and the result of a fresh resolution.
    x2 = torch.randn_like(x)
    y2 = dge.mega_moe_train(x2, idx, w, l1, l2, activation_clamp=1.0)
    plan.clear_cache()
    assert torch.equal(y2, dge.mega_moe_train(x2, idx, w, l1, l2, activation_clamp=1.0))


def test_a_cached_call_follows_the_environment(monkeypatch):
    x, idx, w, l1, l2 = make_inputs(16, 64, 32, 4, 2, device="cpu", dtype=torch.float32, seed=4)
    plan.clear_cache()
    dge.mega_moe_train(x, idx, w, l1, l2)
    (key, (reads, encoded)), = plan._CALLS.items()
    assert any(name == "DGE_CHECK_IDS" for name, _ in reads), reads  # the plan's variables are noted
    monkeypatch.setenv("DGE_CHECK_IDS", "0")
    assert plan.cached_call(key) is None  # a variable the plan read changed: resolved again
    dge.mega_moe_train(x, idx, w, l1, l2)
    assert plan.cached_call(key) is not None and plan.cached_call(key) != encoded


def _fake_kernel(monkeypatch, seen):
    """A Kernel whose driver call records what it is handed (no GPU): the function handle, and the bytes
    behind each of the parameter pointers."""
    from deep_gemm_ext.jit import runtime

    pytest.importorskip("cuda.bindings.driver")
    kernel = runtime.Kernel.__new__(runtime.Kernel)
    kernel.name, kernel._function, kernel._plans, kernel._smem_limit = "fake", "function", {}, {}
    kernel._buffers = __import__("threading").local()
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)

    def launch(config, function, params, extra):
        seen.append((function, params))
        return (0,)

    monkeypatch.setattr(runtime, "_launch", launch)
    return kernel


def _params(address: int, sizes) -> list[bytes]:
    pointers = (ctypes.c_void_p * len(sizes)).from_address(address)
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]


def test_a_launch_hands_the_driver_each_parameter(monkeypatch):
    seen = []
    kernel = _fake_kernel(monkeypatch, seen)
    x = torch.randn(4).as_subclass(_OnGpu)
    m = _map(3)
    for value in (7, 8):  # the second launch reuses the buffer: its bytes are the new ones
        kernel.launch((1, 1, 1), (32, 1, 1), (x, ctypes.c_int32(-value), m, ctypes.c_uint64(value), ctypes.c_float(0.5)))
        function, address = seen[-1]
        got = _params(address, (8, 4, 128, 8, 4))
        assert function == "function"
        assert got == [struct.pack("=Q", x.data_ptr()), struct.pack("=i", -value), m.data, struct.pack("=Q", value),
                       struct.pack("=f", 0.5)]
    layout, payload = pack_bytes("fake", DECL, a=x, n=5, m=m, f=2.0, o=None, q=9, i=-1,
                                 raw=torch.zeros(1).as_subclass(_OnGpu))
    kernel.launch_bytes((1, 1, 1), (32, 1, 1), layout, payload)
    got = _params(seen[-1][1], (8, 4, 128, 4, 8, 8, 4, 8))
    assert got[:4] == [struct.pack("=Q", x.data_ptr()), struct.pack("=I", 5), m.data, struct.pack("=f", 2.0)]
    assert got[4:7] == [struct.pack("=Q", 0), struct.pack("=Q", 9), struct.pack("=i", -1)]
    with pytest.raises(ValueError, match="fake: 8 bytes of parameters, expected"):
        kernel.launch_bytes((1, 1, 1), (32, 1, 1), layout, payload[:8])
    with pytest.raises(TypeError, match="fake: argument 1 has type int"):
        kernel.launch((1, 1, 1), (32, 1, 1), (x, 3))
    with pytest.raises(ValueError, match="fake: argument 0 is a tensor on cpu, expected a CUDA tensor"):
        kernel.launch((1, 1, 1), (32, 1, 1), (torch.zeros(1), ctypes.c_int32(1)))
    assert len(seen) == 3  # nothing reached the driver from the rejected launches
