"""JIT kernels on the GPU against torch: routing bit-identical, SwiGLU vs fp64 autograd,
gather/combine exact; plus the launch path itself (args, TMA descriptors, CUDA graphs)."""
from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import poison_cached_memory, requires_cuda

pytestmark = requires_cuda

from deep_gemm_ext import jit  # noqa: E402
from deep_gemm_ext.jit_kernels import (combine_rows, gather_rows, routing_metadata, swiglu_backward,  # noqa: E402
                                       zero_rows_past,
                                       swiglu_forward)
from deep_gemm_ext.routing import compute_routing_torch  # noqa: E402
from deep_gemm_ext.testing import make_routing  # noqa: E402

DEVICE = "cuda"


@pytest.fixture(scope="module", autouse=True)
def prebuilt():
    """Compile every config of these kernels in parallel once (the tests then hit the cache)."""
    from deep_gemm_ext.jit_kernels import gather_combine, routing, swiglu
    configs = routing.configs() + swiglu.configs() + gather_combine.configs()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda c: jit.build(c[0], c[1]), configs))


# -- routing --------------------------------------------------------------------------------------------


def _launch_modes(topk_idx: torch.Tensor, num_experts: int) -> list[int]:
    """Both launch modes where the one-launch kernel applies, else the three launches."""
    from deep_gemm_ext.jit_kernels.routing import single_launch
    return [1, 3] if single_launch(topk_idx.numel(), num_experts) else [3]


def _assert_routing_equal(topk_idx: torch.Tensor, num_experts: int, align: int) -> None:
    ref = compute_routing_torch(topk_idx, num_experts, align)
    for launches in _launch_modes(topk_idx, num_experts):
        poison_cached_memory(0xF9)  # ints -101058055: no routing output takes that value
        got = routing_metadata(topk_idx, num_experts, align, launches=launches)
        names = ("counts", "starts", "ends", "slot_to_row", "row_to_slot")
        for name, a, b in zip(names, got.tensors(), ref.tensors()):
            assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, name
            mismatch = (a != b).nonzero()
            assert mismatch.numel() == 0, (f"launches={launches}, {name}: {mismatch.shape[0]} entries differ, first "
                                           f"at {mismatch[:4].tolist()}")
        assert (got.num_experts, got.top_k, got.align) == (num_experts, topk_idx.shape[1], align)


def test_routing_default_is_one_launch_where_it_fits():
    from deep_gemm_ext.jit_kernels import routing as r
    assert r.single_launch(16384 * 8, 128) and r.single_launch(r.CLUSTER_MAX_SLOTS, r.CLUSTER_MAX_EXPERTS)
    assert not r.single_launch(r.CLUSTER_MAX_SLOTS + 1, 8) and not r.single_launch(8, r.CLUSTER_MAX_EXPERTS + 1)
    idx = make_routing(64, r.CLUSTER_MAX_EXPERTS + 1, 2, "uniform").to(DEVICE)
    with pytest.raises(ValueError, match="launches=1"):
        routing_metadata(idx, r.CLUSTER_MAX_EXPERTS + 1, 128, launches=1)
    with pytest.raises(ValueError, match="launches=2"):
        routing_metadata(idx, r.CLUSTER_MAX_EXPERTS + 1, 128, launches=2)
    with pytest.raises(ValueError, match="launches=True"):
        routing_metadata(idx, 8, 128, launches=True)


@pytest.mark.parametrize("num_experts", [1023, 1024, 1025, 4096])
def test_routing_many_experts(num_experts):
    """Either side of the one-launch kernel's expert limit (its shared memory grows with E)."""
    idx = make_routing(3000, num_experts, 8, "zipf", generator=torch.Generator().manual_seed(num_experts)).to(DEVICE)
    _assert_routing_equal(idx, num_experts, 128)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_expert", "empty_experts", "unused_slots"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(4096, 128, 8), (1000, 16, 4), (130, 64, 6)])
def test_routing_matches_torch(kind, dtype, num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    idx = make_routing(num_tokens, num_experts, top_k, kind, generator=gen).to(DEVICE, dtype)
    _assert_routing_equal(idx, num_experts, 128)


@pytest.mark.parametrize("num_tokens", [0, 1, 2, 127, 129])
@pytest.mark.parametrize("align", [1, 64, 128])
def test_routing_small_and_odd(num_tokens, align):
    idx = make_routing(num_tokens, 32, 4, "unused_slots").to(DEVICE)
    _assert_routing_equal(idx, 32, align)


@pytest.mark.parametrize("n_src,n", [(0, 5), (1, 1), (777, 4096), (139264, 131072)])
def test_take_or_zero(n_src, n):
    """out[i] = src[index[i]], 0 where index[i] is -1 or past src (read nowhere); NaN and Inf in src
    travel (they are data)."""
    from deep_gemm_ext.jit_kernels import take_or_zero

    gen = torch.Generator().manual_seed(n_src + n)
    src = torch.randn(n_src, generator=gen)
    if n_src > 2:
        src[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    index = torch.randint(-1, n_src + 2, (n,), generator=gen, dtype=torch.int32)
    if n > 1:
        index[:2] = torch.tensor([n_src, 2 ** 31 - 1])
    poison_cached_memory(0xFF)  # NaN floats: an element the kernel skipped would show
    got = take_or_zero(src.to(DEVICE), index.to(DEVICE)).cpu()
    inside = (index >= 0) & (index < n_src)
    want = torch.where(inside, src[index.clamp(0, max(n_src - 1, 0)).long()] if n_src else 0.0, 0.0)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="index"):
        take_or_zero(src.to(DEVICE), index.to(DEVICE).long())


@pytest.mark.parametrize("launches", [1, 3])
def test_routing_assert_ids_passes_valid_ids(launches):
    """assert_ids=True on ids in [-1, E): the same metadata as without."""
    idx = make_routing(1000, 16, 4, "unused_slots").to(DEVICE)
    ref = compute_routing_torch(idx, 16, 128)
    got = routing_metadata(idx, 16, 128, assert_ids=True, launches=launches)
    for a, b in zip(got.tensors(), ref.tensors()):
        assert torch.equal(a, b)


def test_routing_treats_out_of_range_ids_as_unused():
    idx = torch.randint(-3, 40, (777, 5), device=DEVICE)  # -3, -2 and 32..39 are invalid for E = 32
    idx[0] = torch.tensor([2**40, -(2**40), 31, 0, -1])
    _assert_routing_equal(idx, 32, 128)
    _assert_routing_equal(idx.int(), 32, 128)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(16384, 128, 8), (37500, 512, 8), (16384, 256, 8)])
def test_routing_large(num_tokens, num_experts, top_k):
    idx = make_routing(num_tokens, num_experts, top_k, "zipf").to(DEVICE)
    _assert_routing_equal(idx, num_experts, 128)


@pytest.mark.parametrize("launches", [1, 3])
def test_routing_is_graph_capturable(launches):
    idx = make_routing(2048, 64, 8, "uniform").to(DEVICE)
    static = idx.clone()
    routing_metadata(static, 64, 128, launches=launches)  # warm: compile + load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta = routing_metadata(static, 64, 128, launches=launches)
    fresh = make_routing(2048, 64, 8, "zipf").to(DEVICE)
    static.copy_(fresh)
    graph.replay()
    ref = compute_routing_torch(fresh, 64, 128)
    for a, b in zip(meta.tensors(), ref.tensors()):
        assert torch.equal(a, b)


# -- SwiGLU ---------------------------------------------------------------------------------------------


def _swiglu_reference(h, da, w, clamp):
    """fp64 autograd of act = silu(min(g, c)) * clamp(u, -c, c): torch's own gradient conventions."""
    c = math.inf if clamp is None else clamp
    h64 = h.double().requires_grad_(True)
    g, u = h64.chunk(2, dim=-1)
    act = torch.nn.functional.silu(g.clamp(max=c)) * u.clamp(-c, c)
    if da is None:
        return act.detach()
    d = w.double()[:, None] * da.double()
    (dh,) = torch.autograd.grad(act, h64, d)
    dweight = (da.double() * act.detach()).sum(-1)
    return act.detach(), dh, dweight, w.double()[:, None] * act.detach()


def _random_h(rows, inter, clamp):
    h = (torch.randn(rows, 2 * inter, device=DEVICE) * 3).bfloat16()
    if clamp is not None and rows:
        # Hit the clamp bounds exactly: the gradient passes at equality.
        h[:, :4] = clamp
        h[:, inter:inter + 2] = clamp
        h[:, inter + 2:inter + 4] = -clamp
    return h


def _assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    """Within ~1 bf16 rounding of the fp64 value (plus a floor for values near zero)."""
    assert out.shape == ref.shape, f"{label}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    assert not out.isnan().any(), f"{label}: NaN (unwritten output?)"
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0**-7 + 1e-6 * max(ref.abs().max().item(), 1.0)
    worst = (err - bound).max().item()
    assert worst <= 0, f"{label}: max error {err.max().item():.3g} exceeds bf16 rounding"


@pytest.mark.parametrize("clamp", [None, 3.0])
@pytest.mark.parametrize("rows,inter", [(1000, 768), (3, 64), (257, 24), (0, 64)])
def test_swiglu_forward(rows, inter, clamp):
    h = _random_h(rows, inter, clamp)
    poison_cached_memory()
    act = swiglu_forward(h, clamp)
    assert act.shape == (rows, inter) and act.dtype == torch.bfloat16
    _assert_bf16_close(act, _swiglu_reference(h, None, None, clamp), "act")


@pytest.mark.parametrize("clamp", [None, 3.0])
@pytest.mark.parametrize("rows,inter", [(1000, 768), (5, 64), (130, 200), (0, 64)])
def test_swiglu_backward(rows, inter, clamp):
    h = _random_h(rows, inter, clamp)
    da = torch.randn(rows, inter, device=DEVICE).bfloat16()
    w = torch.rand(rows, device=DEVICE) + 0.1
    poison_cached_memory()
    dh, dweight, act_w = swiglu_backward(h, da, w, clamp)
    ref_act, ref_dh, ref_dweight, ref_act_w = _swiglu_reference(h, da, w, clamp)
    _assert_bf16_close(dh, ref_dh, "dh")
    _assert_bf16_close(act_w, ref_act_w, "act_w")
    assert dweight.dtype == torch.float32 and not dweight.isnan().any()
    # fp32 accumulation of I products: error relative to the sum of magnitudes.
    scale = (da.double().abs() * ref_act.abs()).sum(-1) + 1e-30
    assert ((dweight.double() - ref_dweight).abs() / scale).max().item() < 1e-5 if rows else True
    if clamp is not None and rows:
        assert (dh[:, :4] != 0).any() and (dh[:, inter:inter + 4] != 0).any()  # equality passes the gradient
    again = swiglu_backward(h, da, w, clamp)[1]
    assert torch.equal(again, dweight)  # deterministic reduction


# -- gather / combine -------------------------------------------------------------------------------------


def _meta(num_tokens, num_experts, top_k, kind="unused_slots"):
    return compute_routing_torch(make_routing(num_tokens, num_experts, top_k, kind).to(DEVICE), num_experts, 128)


@pytest.mark.parametrize("stream_stores", [False, True])
@pytest.mark.parametrize("num_tokens,hidden", [(1000, 2048), (130, 136), (1, 8), (0, 64)])
def test_gather_rows_exact(num_tokens, hidden, stream_stores):
    top_k = 4
    meta = _meta(num_tokens, 16, top_k)
    x = torch.randn(num_tokens, hidden, device=DEVICE).bfloat16()
    poison_cached_memory()
    pool = gather_rows(x, meta.row_to_slot, top_k, stream_stores=stream_stores)
    valid = meta.row_to_slot >= 0
    src = (meta.row_to_slot.long() // top_k).clamp(min=0)
    ref = torch.where(valid[:, None], x[src] if num_tokens else torch.zeros_like(pool), torch.zeros_like(pool))
    assert torch.equal(pool, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("kind,num_tokens,num_experts,top_k,hidden", [
    ("unused_slots", 1000, 16, 4, 2048), ("uniform", 130, 16, 8, 136), ("zipf", 513, 64, 8, 7168),
    ("one_expert", 77, 8, 1, 64), ("empty_experts", 300, 32, 32, 256), ("unused_slots", 1, 4, 2, 16),
    ("uniform", 0, 8, 4, 64)])
def test_gather_token_order_is_the_row_gather(kind, num_tokens, num_experts, top_k, hidden, dtype):
    """gather_rows(slot_to_row=) (each token read once, stored to its slots' rows, unmapped rows zeroed)
    writes the row gather's bytes into a poisoned pool: every routing kind, element size, top_k up to 32."""
    meta = _meta(num_tokens, num_experts, top_k, kind)
    elem = torch.empty(0, dtype=dtype).element_size()
    hidden += -hidden % (16 // elem)  # 16-byte rows
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    x = x.to(dtype) if dtype != torch.float8_e4m3fn else (x * 64).to(dtype)
    ref = gather_rows(x, meta.row_to_slot, top_k)
    poison_cached_memory()
    pool = gather_rows(x, meta.row_to_slot, top_k, slot_to_row=meta.slot_to_row)
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))
    if meta.num_pool_rows:
        assert (pool[meta.row_to_slot < 0].view(torch.uint8) == 0).all()


def test_gather_token_order_checks():
    meta = _meta(64, 8, 4)
    x = torch.randn(64, 128, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="slot_to_row: 255 slots, expected T \\* top_k = 64 \\* 4 = 256"):
        gather_rows(x, meta.row_to_slot, 4, slot_to_row=meta.slot_to_row[:-1])
    with pytest.raises(ValueError, match="slot_to_row: expected a 1-D int32 tensor"):
        gather_rows(x, meta.row_to_slot, 4, slot_to_row=meta.slot_to_row.long())
    with pytest.raises(ValueError, match="stream_stores=True with slot_to_row"):
        gather_rows(x, meta.row_to_slot, 4, stream_stores=True, slot_to_row=meta.slot_to_row)
    with pytest.raises(ValueError, match="top_k=33"):
        gather_rows(x[:8], torch.full((8 * 33,), -1, dtype=torch.int32, device=DEVICE), 33,
                    slot_to_row=torch.full((8 * 33,), -1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("kind,num_tokens,cols,dtype", [("unused_slots", 1000, 1536, torch.bfloat16),
                                                      ("uniform", 333, 136, torch.bfloat16),
                                                      ("all_unused", 64, 256, torch.bfloat16),
                                                      ("uniform", 200, 64, torch.float32)])
def test_zero_rows_past_touches_only_the_tail(kind, num_tokens, cols, dtype):
    """Rows [ends[-1], P) become zero, every row before keeps its (poisoned) bytes: the tail's start is
    read on the device, whatever the routing (all slots unused: the whole tensor)."""
    top_k = 4
    if kind == "all_unused":
        meta = compute_routing_torch(torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=DEVICE), 16, 128)
    else:
        meta = _meta(num_tokens, 16, top_k, kind)
    poison_cached_memory()
    out = torch.empty(meta.num_pool_rows, cols, dtype=dtype, device=DEVICE)
    before = out.clone()
    assert zero_rows_past(out, meta.ends) is out
    last = int(meta.ends[-1])
    assert last < meta.num_pool_rows, (kind, last, meta.num_pool_rows)  # a tail exists: the test can fail
    assert (out[last:] == 0).all(), f"{kind}: a row past ends[-1] = {last} is not zero"
    assert torch.equal(out[:last].view(torch.uint8), before[:last].view(torch.uint8)), \
        f"{kind}: a row before ends[-1] = {last} was written"


def test_zero_rows_past_rejects_bad_arguments():
    ends = torch.tensor([128], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        zero_rows_past(torch.empty(256, 6, dtype=torch.bfloat16, device=DEVICE), ends)
    with pytest.raises(ValueError, match="ends: expected a 1-D int32"):
        zero_rows_past(torch.empty(256, 64, dtype=torch.bfloat16, device=DEVICE), ends.long())
    with pytest.raises(ValueError, match="out: expected a CUDA tensor"):
        zero_rows_past(torch.empty(256, 64, dtype=torch.bfloat16), ends)


@pytest.mark.parametrize("stream_stores", [False, True])
@pytest.mark.parametrize("dtype,cols", [(torch.float8_e4m3fn, 256), (torch.float32, 16)])
def test_gather_rows_fp8_and_scales(dtype, cols, stream_stores):
    """e4m3 rows and fp32 scale rows (the per-token fp8 operands) gathered byte for byte."""
    meta = _meta(300, 8, 2)
    x = torch.randn(300, cols, device=DEVICE).to(dtype)
    poison_cached_memory()
    pool = gather_rows(x, meta.row_to_slot, 2, stream_stores=stream_stores)
    valid = meta.row_to_slot >= 0
    ref = x.view(torch.uint8)[(meta.row_to_slot.long() // 2).clamp(min=0)] * valid[:, None]
    assert torch.equal(pool.view(torch.uint8), ref)


def _combine_reference(o, slot_to_row, weights, top_k):
    """The same k-ordered fp32 loop in torch (separate mul and add, as the kernel does)."""
    rows = slot_to_row.view(-1, top_k).long()
    acc = torch.zeros(rows.shape[0], o.shape[1], dtype=torch.float32, device=o.device)
    for k in range(top_k):
        value = o[rows[:, k].clamp(min=0)].float()
        if weights is not None:
            value = weights[:, k:k + 1] * value
        acc = torch.where((rows[:, k] >= 0)[:, None], acc + value, acc)
    return acc.bfloat16()


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("num_tokens,hidden,top_k", [(1000, 2048, 8), (130, 136, 6), (3, 8, 1), (0, 64, 8)])
def test_combine_rows_exact(num_tokens, hidden, top_k, weighted):
    meta = _meta(num_tokens, 16, top_k)
    o = torch.randn(meta.num_pool_rows, hidden, device=DEVICE).bfloat16()
    o[meta.row_to_slot < 0] = float("nan")  # padding rows must never be read
    weights = torch.rand(num_tokens, top_k, device=DEVICE) if weighted else None
    poison_cached_memory()
    y = combine_rows(o, meta.slot_to_row, weights, top_k)
    assert torch.equal(y, _combine_reference(o, meta.slot_to_row, weights, top_k))


# -- the launch path ------------------------------------------------------------------------------------


def test_launch_rejects_untyped_and_host_arguments():
    from deep_gemm_ext.jit_kernels import swiglu
    kernel = jit.build(*swiglu._FORWARD[False])
    h = torch.randn(2, 16, device=DEVICE).bfloat16()
    act = torch.empty(2, 8, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="plain Python numbers"):
        kernel.launch((1, 1, 1), (256, 1, 1), (h, act, 2, ctypes.c_int32(8), ctypes.c_float(1.0)))
    with pytest.raises(ValueError, match="CUDA tensor"):
        kernel.launch((1, 1, 1), (256, 1, 1), (h.cpu(), act, ctypes.c_int64(2), ctypes.c_int32(8),
                                               ctypes.c_float(1.0)))
    kernel.launch((1, 1, 1), (256, 1, 1), (h, act, ctypes.c_int64(2), ctypes.c_int32(8), ctypes.c_float(math.inf)),
                  stream=torch.cuda.current_stream(), pdl=True)
    _assert_bf16_close(act, _swiglu_reference(h, None, None, None), "act")


_TMA_PROBE = r"""#include <cuda.h>
#include <common/utils.cuh>
template <int kBoxRows, int kBoxCols>
__global__ void tma_probe_kernel(const __grid_constant__ CUtensorMap tmap, __nv_bfloat16* out, int row0, int col0) {
    __shared__ __align__(128) __nv_bfloat16 tile[kBoxRows * kBoxCols];
    __shared__ __align__(8) unsigned long long barrier;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&barrier));
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(tile));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar), "r"(kBoxRows * kBoxCols * 2) : "memory");
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(dst), "l"(&tmap), "r"(col0), "r"(row0), "r"(bar) : "memory");
    }
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n@!p bra WAIT_%=;\n}"
                 :: "r"(bar) : "memory");
    for (int i = threadIdx.x; i < kBoxRows * kBoxCols; i += blockDim.x)
        out[i] = tile[i];
}
template __global__ void tma_probe_kernel<16, 64>(const __grid_constant__ CUtensorMap, __nv_bfloat16*, int, int);
"""


def test_tensor_map_by_value():
    kernel = jit.build("tma_probe", _TMA_PROBE)
    x = torch.randn(3, 40, 96, device=DEVICE).bfloat16()  # a 3-D tensor seen as [120, 96]
    tmap = jit.make_tma_2d(x, 16, 64, swizzle=0)
    assert (tmap.rows, tmap.cols) == (120, 96) and tmap.address % 64 == 0
    flat = x.view(120, 96)
    for row0, col0 in [(8, 32), (112, 0)]:  # the second box runs 8 rows past the end: zero filled
        out = torch.full((16, 64), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        kernel.launch((1, 1, 1), (128, 1, 1), (tmap, out, ctypes.c_int32(row0), ctypes.c_int32(col0)))
        ref = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
        valid = flat[row0:row0 + 16, col0:col0 + 64]
        ref[:valid.shape[0]] = valid
        assert torch.equal(out, ref)




def test_a_thread_without_a_context_encodes_maps():
    """A new thread has no current CUDA context (launches on a stream do not need one, so the autograd
    engine's thread or an emulated rank's may have none when its first GEMM encodes a map)."""
    import threading

    from deep_gemm_ext.jit import tma
    from deep_gemm_ext.jit.driver import check, driver

    tma._ENCODED.clear()  # the thread's map must be encoded, not found
    x = torch.randn(384, 128, device=DEVICE).bfloat16()
    seen = {}

    def body():
        try:
            seen["context before"] = int(check(driver().cuCtxGetCurrent(), "cuCtxGetCurrent"))
            seen["map"] = jit.make_tma_2d(x, 64, 64, rows=320)  # a key not encoded before in this process
        except Exception as exc:  # reported below
            seen["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert "error" not in seen, seen.get("error")
    assert seen["context before"] == 0, "the new thread had a context already: the test checks nothing"
    assert seen["map"].raw() == jit.make_tma_2d(x, 64, 64, rows=320).raw()


def test_a_cached_tensor_map_still_checks_the_storage():
    """A key encoded before, looked up for a tensor whose storage is smaller than the view (another
    tensor now at that address, as after a free): refused, not handed out for memory it does not own."""
    from deep_gemm_ext.jit import tma

    big = torch.zeros(256, 128, device=DEVICE, dtype=torch.bfloat16)
    jit.make_tma_2d(big, 64, 64)
    small = torch.zeros(64, 128, device=DEVICE, dtype=torch.bfloat16)
    # What a free and a reallocation at big's address would leave: big's key with small's address.
    tma._ENCODED[(small.data_ptr(), small.dtype, 256, 128, 128, 64, 64, 128)] = \
        tma._ENCODED[(big.data_ptr(), big.dtype, 256, 128, 128, 64, 64, 128)]
    with pytest.raises(ValueError, match="storage has"):
        jit.make_tma_2d(small, 64, 64, rows=256)
    assert jit.make_tma_2d(small, 64, 64).rows == 64


def test_tensor_maps_are_encoded_once_per_key(monkeypatch):
    """make_tma_2d reuses an encoding for the same address, dtype, view, box and swizzle (the bytes
    a fresh encoding gives), and encodes anew when any of them differs."""
    from deep_gemm_ext.jit import tma

    calls = []
    encode = tma._encode

    def counting(*args):
        calls.append(args)
        return encode(*args)

    monkeypatch.setattr(tma, "_encode", counting)
    x = torch.randn(256, 128, device=DEVICE).bfloat16()
    first = jit.make_tma_2d(x, 64, 64)
    again = jit.make_tma_2d(x, 64, 64)
    assert len(calls) == 1 and again.raw() == first.raw() and again.tensor is x
    tma._ENCODED.clear()
    assert jit.make_tma_2d(x, 64, 64).raw() == first.raw() and len(calls) == 2
    other_box = jit.make_tma_2d(x, 32, 64)
    other_rows = jit.make_tma_2d(x, 64, 64, rows=128)
    y = torch.randn(256, 128, device=DEVICE).bfloat16()
    other_address = jit.make_tma_2d(y, 64, 64)
    assert len(calls) == 5
    assert len({m.raw() for m in (first, other_box, other_rows, other_address)}) == 4
def test_nvrtc_build_runs(tmp_path, monkeypatch):
    from deep_gemm_ext.jit import compiler
    from deep_gemm_ext.jit_kernels import swiglu
    monkeypatch.setenv("DGE_JIT_USE_NVRTC", "1")
    monkeypatch.setenv("DGE_JIT_CACHE_DIR", str(tmp_path))
    try:
        compiler.select_compiler()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    name, code = swiglu._FORWARD[True]
    kernel = jit.build(name + "_nvrtc", code)
    assert (kernel.entry.path / "command.txt").read_text().startswith("nvrtc ")
    h = _random_h(300, 64, 3.0)
    act = torch.full((300, 64), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    kernel.launch((8, 1, 1), (256, 1, 1), (h, act, ctypes.c_int64(300), ctypes.c_int32(64), ctypes.c_float(3.0)))
    _assert_bf16_close(act, _swiglu_reference(h, None, None, 3.0), "act (nvrtc)")
