"""Shared by every test file: the GPU skip markers, the NaN-poisoning of the CUDA allocator, and
a summary of the skips by reason at the end of a run."""
from __future__ import annotations

import gc
import os
import tempfile
from collections import Counter

import pytest
import torch

from gpu_lock import GpuTestLock

HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_hopper = pytest.mark.skipif(not IS_HOPPER, reason="needs an SM90 (Hopper) GPU")


@pytest.fixture
def launched(monkeypatch):
    """The config names the bf16 GEMM launchers ran, in order (a test checks which kernel ran)."""
    from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg

    names = []
    launch = gg._launch

    def spy(config, *args, **kwargs):
        names.append(config.name)
        return launch(config, *args, **kwargs)

    monkeypatch.setattr(gg, "_launch", spy)
    return names


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test resolves its own plans: one that replaced a provider's attribute leaves no plan made
    from it to the next (deep_gemm_ext.plan caches resolutions)."""
    from deep_gemm_ext import plan

    plan.clear_cache()
    yield
    plan.clear_cache()


# Under pytest-xdist with a GPU, the tests of all workers share the GPU's memory through one readers-writer
# lock (tests/gpu_lock.py): every test holds it shared, a headline-size test exclusive.
_GPU_LOCK = GpuTestLock(tempfile.gettempdir(), f"deep_gemm_ext_gpu_tests_{os.getuid()}")
_SHARED_GPU = HAS_CUDA and bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _release_gpu_memory() -> None:
    """This process's cached GPU blocks back to the driver."""
    gc.collect()
    if HAS_CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gpu_shared_by_workers():
    """Every test of an xdist run on a GPU holds the lock shared: it waits while a headline-size test
    waits or runs, and hands its cached blocks back when it ends while one waits."""
    if not _SHARED_GPU:
        yield
        return
    with _GPU_LOCK.shared(_release_gpu_memory):
        yield


@pytest.fixture
def one_large_test_at_a_time():
    """For a test whose fp64 reference takes tens of GB of GPU memory (the headline layers' sizes): under
    pytest-xdist it runs alone on the GPU (the lock exclusive: the other workers' running tests end first,
    and they hand their cached blocks back); it hands its own back when it ends. Without it, such a test
    ran out of memory beside the other workers' tests and caches (7 of them on 78 GiB with five workers)."""
    if not _SHARED_GPU:
        try:
            yield
        finally:
            _release_gpu_memory()
        return
    with _GPU_LOCK.exclusive(_release_gpu_memory):
        yield


def _modules_load_eagerly() -> bool:
    """Whether the CUDA driver of this process loads modules eagerly (fixed when CUDA started)."""
    if not HAS_CUDA:
        return True  # the GPU markers decide
    from deep_gemm_ext.jit.driver import module_loading_mode

    torch.cuda.init()
    return module_loading_mode() == "EAGER"


# Kernels that wait on each other inside one process (emulated expert-parallel ranks, a GEMM waiting
# for rows another stream writes) need every module loaded before they run: a lazy load synchronizes
# the device. Such tests run in a process started with the settings below (scripts/gpu_check.sh).
requires_eager_loading = pytest.mark.skipif(
    not _modules_load_eagerly(),
    reason="needs CUDA_MODULE_LOADING=EAGER from CUDA's start: run `CUDA_MODULE_LOADING=EAGER "
           "CUDA_DEVICE_MAX_CONNECTIONS=32 python -m pytest tests/test_gpu_ep_symmetric.py "
           "tests/test_gpu_ep_overlap.py` on their own (scripts/gpu_check.sh does)")


def _has_compiler() -> bool:
    from deep_gemm_ext.jit import compiler
    try:
        compiler.select_compiler()
        return True
    except RuntimeError:
        return False


# Building kernels needs nvcc or NVRTC, not a GPU.
requires_compiler = pytest.mark.skipif(not _has_compiler(), reason="no nvcc and no NVRTC here")


def poison_cached_memory(byte: int = 0xFF, reserve_bytes: int = 4 << 30) -> None:
    """Fill every block the CUDA caching allocator may hand out next with ``byte`` (0xFF: NaN in
    bf16 / fp32, -1 in integers), so an output element a kernel forgets to write shows up.

    A single large poisoned blob only covers requests that land in it: the allocator prefers the
    best-fitting cached block, and requests up to 1 MiB come from a separate small pool. So every
    inactive cached block of the current stream's default pool is taken at its exact size, plus
    fresh large and small segments for requests that fit nowhere else; all are filled, then freed.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    stream = torch.cuda.current_stream().cuda_stream
    held = []
    for _ in range(2):  # taking a block can split it; a second pass takes the pieces
        for seg in torch.cuda.memory_snapshot():
            if seg["stream"] != stream or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
                continue
            for block in seg["blocks"]:
                # A free piece <= 1 MiB of a large segment is never handed out alone (such
                # requests go to the small pool), so only whole usable blocks are taken.
                if block["state"] == "inactive" and (seg["segment_type"] == "small" or block["size"] > 1 << 20):
                    held.append(torch.empty(block["size"], dtype=torch.uint8, device="cuda"))
    free, _ = torch.cuda.mem_get_info()
    held.append(torch.empty(min(reserve_bytes, int(free * 0.5)), dtype=torch.uint8, device="cuda"))
    held += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    for t in held:
        t.fill_(byte)
    del held


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = Counter(_skip_reason(report) for report in skipped)
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:6d}  {reason}")
