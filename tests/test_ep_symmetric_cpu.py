"""The symmetric-memory exchange's Python side without a GPU: the plan spec, the region layout and
its byte count, argument checks, the timeout knob, and the transport kernels' rendered configs."""
from __future__ import annotations

import re

import pytest
import torch

import deep_gemm_ext as dge
from deep_gemm_ext import _env, comm, jit
from deep_gemm_ext.comm import symmetric
from deep_gemm_ext.comm.emulated import EmulatedGroup, EmulatedWorld, run_emulated_ranks
from deep_gemm_ext.comm.symmetric import SymmetricEpBuffer, region_layout, symmetric_ep_memory_bytes
from deep_gemm_ext.recipes.fp8 import num_blocks


def _fake_buffer(world=4, cap=16, hidden=256, top_k=4, dtype=torch.bfloat16, rank=0):
    """A buffer object without storage (the Python side only; nothing launches)."""
    layout = region_layout(world, cap, hidden, top_k, dtype)
    buffer = SymmetricEpBuffer.__new__(SymmetricEpBuffer)
    buffer._setup(EmulatedGroup(EmulatedWorld(world), rank), rank, cap, hidden, top_k, dtype, layout, None,
                  torch.zeros(world, dtype=torch.int64), 8)
    return buffer


@pytest.mark.parametrize("world,cap,hidden,top_k,dtype", [(2, 64, 256, 4, torch.bfloat16), (8, 300, 7168, 8,
                         torch.bfloat16), (3, 5, 200, 3, torch.float32), (1, 1, 8, 1, torch.float64)])
def test_region_layout_arithmetic(world, cap, hidden, top_k, dtype):
    layout = region_layout(world, cap, hidden, top_k, dtype)
    rows = world * cap
    pitch = -(-max(hidden * dtype.itemsize, hidden + 4 * num_blocks(hidden)) // 16) * 16
    assert layout.row_pitch == pitch and pitch % 16 == 0
    assert layout.ids == rows * pitch
    assert layout.weights - layout.ids >= rows * top_k * 4
    assert layout.count - layout.weights >= rows * top_k * 8  # room for fp64 weights
    assert layout.flags - layout.count == 16
    assert layout.size - layout.flags >= (2 * world + 2) * 8 and layout.size % 128 == 0
    assert all(o % 16 == 0 for o in layout[1:])
    expect = rows * pitch + rows * top_k * 12 + 16 + (2 * world + 2) * 8
    assert expect <= layout.size < expect + 3 * 16 + 128
    assert symmetric_ep_memory_bytes(world, cap, hidden, top_k, dtype) == layout.size


def test_memory_bytes_example():
    # 8 ranks, 4096 tokens, H 7168, top-8, bf16: 32768 rows of 14336 bytes + ids/weights + flags.
    rows = 8 * 4096
    got = dge.symmetric_ep_memory_bytes(8, 4096, 7168, 8)
    assert got == -(-(rows * 14336 + rows * 8 * 12 + 16 + 18 * 8) // 128) * 128
    assert _fake_buffer(8, 4096, 7168, 8).memory_bytes() == got


def test_plan_spec_round_trip():
    buffer = _fake_buffer()
    for fp8 in (False, True):
        spec = buffer.exchange_spec(3, fp8_rows=fp8)
        assert spec == f"symmetric:{buffer.id}:3:16:{'fp8' if fp8 else 'x'}"
        ex = comm.exchange(spec)
        assert isinstance(ex, symmetric.SymmetricExchange)
        assert ex.buffer is buffer and ex.num_local_experts == 3 and ex.capacity == 16 and ex.fp8_rows == fp8
        assert ex is comm.exchange(spec)  # cached per buffer
        assert ex.received_rows(5) == 64 and ex.num_experts(3) == 12
        like = ex.handle_like(torch.empty(5, 256), torch.empty(5, 4, dtype=torch.int64))
        assert [tuple(t.shape) for t in like] == [(4, 5), (5, 4), (64,)]
        assert [t.dtype for t in like] == [torch.bool, torch.int64, torch.bool]


def test_plan_spec_errors():
    buffer = _fake_buffer()
    with pytest.raises(ValueError, match="capacity|max_tokens_per_rank=16"):
        comm.exchange(f"symmetric:{buffer.id}:3:17:x")
    with pytest.raises(ValueError, match="does not exist"):
        comm.exchange("symmetric:999999:3:16:x")
    for bad in ("symmetric:1:2:x", "symmetric:a:2:3:x", f"symmetric:{buffer.id}:2:16:bf16"):
        with pytest.raises(ValueError, match="expected 'local'"):
            comm.exchange(bad)


def test_resolve_exchange_picks_the_transport_from_the_buffer():
    from deep_gemm_ext import plan

    buffer = _fake_buffer(world=2, cap=8, hidden=32, top_k=2, dtype=torch.float64)
    x = torch.zeros(3, 32, dtype=torch.float64)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    l1 = torch.zeros(3, 16, 32, dtype=torch.float64)
    assert plan.resolve_exchange(x, idx, l1, buffer.group, buffer) == buffer.exchange_spec(3)
    assert plan.resolve_exchange(x, idx, l1, buffer.group, buffer, recipe="fp8").endswith(":fp8")
    one = _fake_buffer(world=1, cap=8, hidden=32, top_k=2, dtype=torch.float64)
    assert plan.resolve_exchange(x, idx, l1, one.group, one) == "local"
    p = plan.resolve(x, l1, exchange=buffer.exchange_spec(3))
    assert "symmetric memory" in p.describe()


def test_validation_of_the_buffer_and_group():
    buffer = _fake_buffer(world=2, cap=8, hidden=32, top_k=2, dtype=torch.float64)
    x = torch.zeros(3, 32, dtype=torch.float64)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    w = torch.full((3, 2), 0.5, dtype=torch.float64)
    l1 = torch.zeros(3, 16, 32, dtype=torch.float64)
    l2 = torch.zeros(3, 32, 8, dtype=torch.float64)
    from deep_gemm_ext.validation import validate_inputs

    assert validate_inputs(x, idx, w, l1, l2, group=buffer.group, ep_buffer=buffer).group is buffer.group
    with pytest.raises(ValueError, match="emulated rank's group .* ep_buffer is None"):
        validate_inputs(x, idx, w, l1, l2, group=buffer.group)
    other = _fake_buffer(world=2, cap=8, hidden=32, top_k=2, dtype=torch.float64)
    with pytest.raises(ValueError, match="made for group"):
        validate_inputs(x, idx, w, l1, l2, group=other.group, ep_buffer=buffer)
    wrong = _fake_buffer(world=2, cap=8, hidden=64, top_k=2, dtype=torch.float64)
    with pytest.raises(ValueError, match="ep_buffer has hidden=64 .* SymmetricEpBuffer"):
        validate_inputs(x, idx, w, l1, l2, group=wrong.group, ep_buffer=wrong)
    with pytest.raises(TypeError, match="SymmetricEpBuffer"):
        validate_inputs(x, idx, w, l1, l2, group=buffer.group, ep_buffer=object())


def test_constructor_argument_errors():
    world = EmulatedWorld(2)
    with pytest.raises(TypeError, match="emulated_ep_buffers"):
        SymmetricEpBuffer(EmulatedGroup(world, 0), 8, 32, 2)
    with pytest.raises(TypeError, match="got None"):
        SymmetricEpBuffer(None, 8, 32, 2)
    for kwargs, match in ((dict(max_tokens_per_rank=0), "max_tokens_per_rank=0"), (dict(hidden=4), "hidden=4"),
                          (dict(top_k=1.5), "top_k must be an int"), (dict(dtype=torch.int8), "dtype=")):
        args = dict(max_tokens_per_rank=8, hidden=32, top_k=2, dtype=torch.bfloat16) | kwargs
        with pytest.raises((TypeError, ValueError), match=match):
            symmetric._check_sizes(args["max_tokens_per_rank"], args["hidden"], args["top_k"], args["dtype"])
    with pytest.raises(ValueError, match="world_size"):
        SymmetricEpBuffer._emulated(0, 8, 32, 2, torch.bfloat16, "cuda", None)
    with pytest.raises(ValueError, match="one CUDA device"):
        SymmetricEpBuffer._emulated(2, 8, 32, 2, torch.bfloat16, "cpu", None)
    with pytest.raises(ValueError, match="blocks=0"):
        SymmetricEpBuffer.__new__(SymmetricEpBuffer)._setup(EmulatedGroup(world, 0), 0, 8, 32, 2, torch.bfloat16,
                                                            region_layout(2, 8, 32, 2), None, None, 0)
    with pytest.raises(ValueError, match="world_size"):
        run_emulated_ranks(lambda r: r, 0)


def test_capacity_error_names_rank_and_capacity():
    buffer = _fake_buffer(world=2, cap=4, hidden=32, top_k=2, dtype=torch.float32, rank=1)
    ex = buffer.exchange(2)
    with pytest.raises(ValueError, match=r"rank 1 passes 5 tokens .* max_tokens_per_rank=4"):
        ex.dispatch(torch.zeros(5, 32), torch.zeros(5, 2, dtype=torch.int64), torch.zeros(5, 2))


def test_emulated_agreement_check_on_the_host():
    """The host stand-in of the all_gather: every rank sees every rank's values, and all raise alike."""
    import threading

    world = EmulatedWorld(3)
    tables = [None] * 3

    def body(r):
        tables[r] = world.all_gather("k", r, (r % 2, 7), 10.0)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tables == [[(0, 7), (1, 7), (0, 7)]] * 3
    with pytest.raises(RuntimeError, match="not every rank"):
        world.all_gather("lonely", 0, (1,), 0.05)


def test_timeout_knob(monkeypatch):
    monkeypatch.delenv("DGE_EP_TIMEOUT_S", raising=False)
    assert _env.ep_timeout_s() == 600.0
    monkeypatch.setenv("DGE_EP_TIMEOUT_S", "2.5")
    assert _env.ep_timeout_s() == 2.5
    assert _fake_buffer().transport().timeout_ns == 2_500_000_000
    for bad in ("0", "-1", "abc", "inf"):
        monkeypatch.setenv("DGE_EP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="DGE_EP_TIMEOUT_S"):
            _env.ep_timeout_s()


def test_transport_configs_render():
    from deep_gemm_ext.jit_kernels import ep_transport

    groups = jit.registered_configs()
    configs = groups["ep_transport"]
    names = {c.name for c in configs}
    assert {"ep_transport_publish", "ep_transport_pull_rows", "ep_transport_pull_dispatch_w32",
            "ep_transport_pull_dispatch_w64"} <= names
    for dtype in ("bfloat16", "float16", "float32", "float64"):
        assert f"ep_transport_pull_sum_{dtype}_w32" in names
    for c in configs:
        assert c.code.startswith("#include <impls/ep_transport.cuh>") and c.code.count("template __global__") == 1
        assert not c.is_gemm
    sum_bf16 = next(c for c in configs if c.name == "ep_transport_pull_sum_bfloat16_w32").code
    assert "ep_pull_sum_kernel<__nv_bfloat16, 4>(" in sum_bf16 and "__nv_bfloat16*" in sum_bf16
    assert re.search(r"ep_pull_sum_kernel<double, 8>\(.*double\*", dict((c.name, c.code) for c in configs)[
        "ep_transport_pull_sum_float64_w64"])
    # The launch tuple packs by name and type.
    t = ep_transport.Transport(torch.zeros(2, dtype=torch.int64), (16, 32, 48, 64), 1, 64, 4, 10)
    packed = jit.pack_args("publish", ep_transport._PUBLISH_ARGS, **t.common(), rows=None, num_rows=0, row_bytes=0,
                           row_pitch=64, ids=None, ids_bytes=0, weights=torch.zeros(4), weight_bytes=16,
                           num_tokens=0)
    assert len(packed) == len(ep_transport._PUBLISH_ARGS)
    with pytest.raises(TypeError, match="peers"):
        jit.pack_args("publish", ep_transport._PUBLISH_ARGS, **(t.common() | dict(peers=torch.zeros(2))),
                      rows=None, num_rows=0, row_bytes=0, row_pitch=64, ids=None, ids_bytes=0, weights=None,
                      weight_bytes=0, num_tokens=0)


def test_kernel_arg_scalar_ranges():
    arg = jit.KernelArg("n", "int")
    assert jit.pack_args("k", (arg,), n=-3)[0].value == -3
    with pytest.raises(TypeError, match="expected an int"):
        jit.pack_args("k", (arg,), n=2 ** 31)
    big = jit.KernelArg("t", "unsigned long long")
    assert jit.pack_args("k", (big,), t=2 ** 63)[0].value == 2 ** 63
    raw = jit.KernelArg("p", "void*")
    assert jit.pack_args("k", (raw,), p=torch.zeros(2, dtype=torch.uint8))[0].dtype == torch.uint8
    with pytest.raises(TypeError, match="expected a tensor"):
        jit.pack_args("k", (raw,), p=3)
