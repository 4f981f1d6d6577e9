"""W expert-parallel ranks on one GPU, for testing the symmetric-memory exchange without W GPUs.

    buffers = emulated_ep_buffers(4, max_tokens_per_rank, hidden, top_k, torch.bfloat16, "cuda")
    def rank_step(r):
        y = mega_moe_train(x[r], idx[r], w[r], l1[r], l2[r], group=buffers[r].group, ep_buffer=buffers[r])
        y.backward(dy[r])
        return y
    ys = run_emulated_ranks(rank_step, 4)

The W regions live in one allocation and share one peer pointer table; buffer r is rank r's.
Each rank runs on its own host thread and CUDA stream; the ranks' transport kernels meet through
the regions' flags on the device (their grids are capped so that all of them are resident at once).
The layer code is the ordinary one: nothing but the exchange knows the ranks share a GPU.
Streams share the device's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default): set it
to at least 2 W before CUDA starts, so that no rank's waiting kernel sits in front of another's.
``CUDA_MODULE_LOADING=EAGER`` must be set too (run_emulated_ranks refuses to run without it), and
every registered JIT kernel is loaded before the ranks start: loading a module synchronizes the
device, which would wait for transport kernels that wait for launches behind the load.
"""
from __future__ import annotations

import itertools
import threading
import warnings

import torch

from .. import _env, jit
from ..jit.driver import module_loading_mode, new_stream

_NAMES = itertools.count()


class EmulatedGroup:
    """The ``group`` of one emulated rank: ``rank()``, ``size()`` and ``group_name`` like a
    ProcessGroup's (the layer asks for nothing else); ``world`` is what its ranks share."""

    def __init__(self, world: "EmulatedWorld", rank: int):
        self.world = world
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    @property
    def group_name(self) -> str:
        return self.world.name

    def __repr__(self) -> str:
        return f"EmulatedGroup(rank={self._rank}, size={self.world.size}, name={self.world.name!r})"


class EmulatedWorld:
    """What the W emulated ranks share: a name, and the host-side stand-in of an all_gather (a
    barrier over the ranks' threads) for the agreement check."""

    def __init__(self, size: int):
        self.size = size
        self.name = f"emulated_ep_{next(_NAMES)}"
        self._lock = threading.Lock()
        self._rounds: dict[object, tuple[threading.Barrier, dict[int, tuple]]] = {}

    def all_gather(self, key, rank: int, values: tuple, timeout_s: float) -> list[tuple]:
        """Every rank's ``values`` for ``key``, once all W ranks have called it (each from its own thread)."""
        with self._lock:
            barrier, table = self._rounds.setdefault(key, (threading.Barrier(self.size), {}))
            table[rank] = values
        try:
            barrier.wait(timeout_s)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"emulated rank {rank}: not every rank of {self.name} (size {self.size}) reached the "
                               f"agreement check within {timeout_s:g} s; every rank must call the layer") from None
        return [table[r] for r in range(self.size)]


def emulated_ep_buffers(world_size: int, max_tokens_per_rank: int, hidden: int, top_k: int,
                        dtype: torch.dtype = torch.bfloat16, device=None, *, blocks: int | None = None):
    """One :class:`~deep_gemm_ext.comm.symmetric.SymmetricEpBuffer` per emulated rank: all regions
    in one allocation (poisoned with 0xFF bytes, flags zeroed), one peer pointer table, buffer r of
    rank r with ``buffer.group`` its :class:`EmulatedGroup`. ``blocks`` (default
    ``ceil(num_SMs / (2 * world_size))``) caps every transport launch's grid so that all ranks'
    transport kernels are resident at once."""
    from .symmetric import SymmetricEpBuffer

    return SymmetricEpBuffer._emulated(world_size, max_tokens_per_rank, hidden, top_k, dtype, device, blocks)


_PRELOADED: set[int] = set()
_RANK_STREAMS: dict[int, list] = {}
_SIDE_STREAMS: dict[int, list] = {}


def rank_streams(world_size: int, device: int | None = None) -> list:
    """The streams of emulated ranks 0..W-1 on ``device``: created once (jit.driver.new_stream,
    never torch's pooled streams, which come round again and would put two ranks' waiting
    kernels, or a rank and a buffer's side stream, into one queue), the same on every call."""
    device = torch.cuda.current_device() if device is None else device
    streams = _RANK_STREAMS.setdefault(device, [])
    while len(streams) < world_size:
        streams.append(new_stream(device))
    return streams[:world_size]


def side_streams(world_size: int, device: int | None = None) -> list:
    """The overlapped dispatch's side streams of emulated ranks 0..W-1 on ``device``, shared by
    every emulated buffer of that rank (created once, on the calling thread, as rank_streams): a
    stream per buffer would grow the process's streams past CUDA_DEVICE_MAX_CONNECTIONS over
    many buffers, and streams past it share hardware queues with live ones."""
    device = torch.cuda.current_device() if device is None else device
    streams = _SIDE_STREAMS.setdefault(device, [])
    while len(streams) < world_size:
        streams.append(new_stream(device))
    return streams[:world_size]


def _preload_kernels() -> None:
    """Every registered JIT kernel loaded into this device's context once (see run_emulated_ranks)."""
    device = torch.cuda.current_device()
    if device not in _PRELOADED:
        jit.load_registered()
        _PRELOADED.add(device)


def run_emulated_ranks(fn, world_size: int) -> list:
    """``[fn(0), ..., fn(W - 1)]``, each call on its own host thread and its own CUDA stream (of
    the current device, :func:`rank_streams`: the same W streams on every call); joins them,
    re-raises the first exception (by rank), and synchronizes the device before returning.

    ``fn`` should only enqueue work: a host wait on the device inside it (``.cpu()``, ``.item()``,
    a copy from or to pageable host memory, a synchronize) blocks that rank's thread until its
    stream has passed kernels that wait for the other ranks, while those may still have launches
    to make; whatever the waiting thread holds meanwhile (pageable copies go through the driver's
    shared staging buffers) can hold those launches back until the waits time out. Copy inputs to
    the device before ``run_emulated_ranks`` and results to the host after it."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive int")
    # DGE_EP_OVERLAP adds a side stream per rank (the overlapped dispatch's row pull).
    queues = (3 if _env.ep_overlap() else 2) * world_size
    if queues > _env.cuda_device_max_connections():
        warnings.warn(f"run_emulated_ranks({world_size}): CUDA_DEVICE_MAX_CONNECTIONS="
                      f"{_env.cuda_device_max_connections()} hardware queues for {world_size} ranks' streams; set it "
                      f"to at least {queues} before CUDA starts, or a waiting rank may hold back another's "
                      f"kernels", RuntimeWarning, stacklevel=2)
    torch.cuda.init()
    loading = module_loading_mode()
    if loading != "EAGER":
        # Loading a module synchronizes the device: a kernel loaded lazily at its first launch, on
        # any rank's thread (the backward's all run on autograd's one device thread), waits for the
        # other ranks' transport kernels, which wait for that thread's next launches.
        raise RuntimeError(f"run_emulated_ranks({world_size}): the CUDA driver loads modules {loading}; emulated "
                           f"ranks need CUDA_MODULE_LOADING=EAGER in the environment before CUDA starts (a "
                           f"lazily loaded kernel synchronizes the device while the ranks' transport kernels wait "
                           f"on each other), e.g. CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 python ...")
    _preload_kernels()
    device = torch.cuda.current_device()
    origin = torch.cuda.current_stream(device)
    streams = rank_streams(world_size, device)
    for stream in streams:
        stream.wait_stream(origin)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank: int) -> None:
        try:
            torch.cuda.set_device(device)
            with torch.cuda.stream(streams[rank]):
                results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 -- re-raised on the calling thread
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"emulated-rank-{r}") for r in range(world_size)]
    with jit.no_loads():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    failed = [(rank, exc) for rank, exc in enumerate(errors) if exc is not None]
    if failed:
        # The first rank's exception is the cause; the others' kernels may now wait for launches
        # that never come (their bounded waits trap), so the device is not touched before raising.
        rank, exc = failed[0]
        others = ", ".join(f"rank {r}: {type(e).__name__}" for r, e in failed[1:])
        note = f"raised on emulated rank {rank} of {world_size}" + (f" (also {others})" if others else "")
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(note)
        raise exc
    for stream in streams:
        origin.wait_stream(stream)
    torch.cuda.synchronize(device)
    return results


__all__ = ["EmulatedGroup", "EmulatedWorld", "emulated_ep_buffers", "rank_streams", "run_emulated_ranks",
           "side_streams"]
