"""Load cubins with the CUDA driver API (cuda-python) and launch them on torch's streams.

The launch path is built for small host overhead: the kernel handle, launch configs (one per
grid/block/smem/cluster/pdl/device combination) and, per parameter layout, a buffer with the ``void*``
array pointing into it are made once; a warm launch packs its parameters into one byte string (code
generated per signature, jit.args), copies it into that buffer and calls ``cuLaunchKernelEx`` with the
array's raw address.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import torch

from . import compiler
from .driver import check, driver, ensure_context
from .args import Layout, compile_positional
from .tma import TensorMap

_MAX_PLANS = 256


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device, but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__})")


class _Plan:
    """A reusable launch config for one (grid, block, smem, cluster, pdl, device)."""

    __slots__ = ("config", "attrs")

    def __init__(self, cuda, grid, block, smem, cluster, pdl):
        config = cuda.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = smem
        attrs = []
        if cluster is not None and tuple(cluster) != (1, 1, 1):
            attr = cuda.CUlaunchAttribute()
            attr.id = cuda.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
            attrs.append(attr)
        if pdl:
            attr = cuda.CUlaunchAttribute()
            attr.id = cuda.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        config.attrs = attrs
        config.numAttrs = len(attrs)
        self.config = config
        self.attrs = attrs  # keeps the attribute objects alive with the config


class _ParamBuffer:
    """One layout's parameter bytes in 64-byte aligned host memory and the ``void*[]`` pointing into them
    (written once: a launch copies its bytes in and hands the driver the array)."""

    __slots__ = ("layout", "storage", "base", "params", "address")

    def __init__(self, layout: Layout):
        self.layout = layout
        self.storage = (ctypes.c_ubyte * (layout.size + 64))()
        self.base = (ctypes.addressof(self.storage) + 63) // 64 * 64
        self.params = (ctypes.c_void_p * max(len(layout.offsets), 1))(*(self.base + o for o in layout.offsets))
        self.address = ctypes.addressof(self.params)


def _check_dims(label: str, dims) -> tuple[int, int, int]:
    if not (isinstance(dims, tuple) and len(dims) == 3 and all(isinstance(d, int) and d >= 1 for d in dims)):
        raise ValueError(f"{label}={dims!r}: expected a tuple of three positive ints")
    return dims


#: The symbol under which a kernel source exports its dynamic shared memory bytes.
SMEM_SYMBOL = "dge_dynamic_smem_bytes"


class Kernel:
    """One compiled ``__global__`` function; loaded into the driver on its first launch."""

    def __init__(self, name: str, entry: compiler.CacheEntry, arch: str):
        self.name = name
        self.entry = entry
        self.arch = arch
        self._function = None  # CUfunction-cast CUkernel, context independent
        self._kernel = None
        self._library = None
        self._load_lock = threading.Lock()
        self._plans: dict = {}
        self._smem_limit: dict[int, int] = {}  # device -> max dynamic smem already allowed
        # Parameter buffers per thread: the autograd engine launches from its own threads.
        self._buffers = threading.local()

    @property
    def cubin_path(self):
        return self.entry.cubin_path

    def resources(self) -> list[compiler.ResourceUsage]:
        return self.entry.resources()

    @functools.cached_property
    def dynamic_smem(self) -> int | None:
        """The dynamic smem bytes the kernel source exports (DGE_EXPORT_SMEM_BYTES), read from the
        cubin once; None when it exports none."""
        return self.entry.exported_u32(SMEM_SYMBOL)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, {self.entry.path})"

    # -- loading ---------------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        """Whether the kernel's module is loaded into the device's context (its launches load nothing)."""
        return self._function is not None

    def _load(self) -> None:
        with self._load_lock:
            if self._function is not None:
                return
            if _loads_forbidden:
                raise RuntimeError(f"kernel {self.name!r} is not loaded, and loading it now would synchronize the "
                                   f"device while kernels that wait on each other run (emulated ranks); it is not a "
                                   f"registered configuration (jit.load_registered loads those beforehand)")
            _require_cuda(f"launching kernel {self.name!r}")
            torch.cuda.init()
            device = torch.cuda.current_device()
            self._check_arch(device)
            cuda = driver()
            data = self.entry.cubin_path.read_bytes()
            library = check(cuda.cuLibraryLoadData(data, None, None, 0, None, None, 0),
                            f"cuLibraryLoadData({self.entry.cubin_path})")
            count = check(cuda.cuLibraryGetKernelCount(library), "cuLibraryGetKernelCount")
            kernels = check(cuda.cuLibraryEnumerateKernels(count, library), "cuLibraryEnumerateKernels")
            if count != 1:
                names = [check(cuda.cuKernelGetName(k), "cuKernelGetName") for k in kernels]
                raise RuntimeError(f"{self.entry.cubin_path} holds {count} kernels {names}: a JIT source must "
                                   f"instantiate exactly one __global__ function")
            self._library = library
            self._kernel = kernels[0]
            self._function = cuda.CUfunction(int(kernels[0]))

    def load(self) -> None:
        """Load the kernel into the current device's context now rather than at its first launch
        (loading a module synchronizes the device, which must not happen while kernels that wait on
        each other run: ranks emulated on one GPU)."""
        self._load()
        check(driver().cuKernelGetFunction(self._kernel), "cuKernelGetFunction")

    def _check_arch(self, device: int) -> None:
        major, minor = torch.cuda.get_device_capability(device)
        digits = self.arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")
        if digits != f"{major}{minor}":
            raise RuntimeError(f"kernel {self.name!r} was built for {self.arch}, but device {device} "
                               f"({torch.cuda.get_device_name(device)}) is sm_{major}{minor}")

    # -- launching -------------------------------------------------------------------------------

    def _plan(self, key, grid, block, smem, cluster, pdl, device):
        _check_dims("grid", grid)
        _check_dims("block", block)
        if cluster is not None:
            _check_dims("cluster", cluster)
        if not isinstance(smem, int) or smem < 0:
            raise ValueError(f"smem={smem!r}: expected a non-negative int (bytes of dynamic shared memory)")
        cuda = driver()
        self._allow_smem(cuda, smem, device)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        plan = self._plans[key] = _Plan(cuda, grid, block, smem, cluster, pdl)
        return plan

    def _allow_smem(self, cuda, smem: int, device: int) -> None:
        if smem > self._smem_limit.get(device, 48 * 1024):
            check(cuda.cuKernelSetAttribute(
                cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem, self._kernel,
                check(cuda.cuDeviceGet(device), "cuDeviceGet")),
                f"raising the dynamic shared memory of {self.name!r} to {smem} bytes")
            self._smem_limit[device] = smem

    def max_active_clusters(self, cluster: tuple[int, int, int], block: tuple[int, int, int], smem: int) -> int:
        """How many clusters of ``cluster`` CTAs (``block`` threads, ``smem`` dynamic bytes each) the
        current device holds at once (cuOccupancyMaxActiveClusters), cached per device: a persistent
        grid of clusters must not exceed it, or the clusters past it wait for the first ones to exit."""
        _check_dims("cluster", cluster)
        _check_dims("block", block)
        if self._function is None:
            self._load()
        device = torch._C._cuda_getDevice()
        key = ("clusters", cluster, block, smem, device)
        count = self._plans.get(key)
        if count is None:
            cuda = driver()
            self._allow_smem(cuda, smem, device)
            plan = _Plan(cuda, cluster, block, smem, cluster, False)
            plan.config.hStream = torch._C._cuda_getCurrentRawStream(device)
            count = check(cuda.cuOccupancyMaxActiveClusters(self._function, plan.config),
                          f"cuOccupancyMaxActiveClusters({self.name}, cluster={cluster}, smem={smem})")
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = count = int(count)
        return count

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, *, smem: int = 0,
               stream: torch.cuda.Stream | None = None, cluster: tuple[int, int, int] | None = None,
               pdl: bool = False) -> None:
        """Launch on ``stream`` (default: torch's current stream of the current device).

        ``args``: torch.Tensor (device pointer), jit.TensorMap (128-byte CUtensorMap by value) or
        ctypes c_int32/c_uint32/c_int64/c_uint64/c_float; the types must match the kernel signature.
        """
        kinds = tuple(map(type, args))
        packer = _POSITIONAL.get(kinds)
        if packer is None:
            packer = _positional_packer(self.name, kinds, args)
        self.launch_bytes(grid, block, packer[0], packer[1](self.name, args), smem=smem, stream=stream, cluster=cluster,
                          pdl=pdl)

    def launch_bytes(self, grid: tuple[int, int, int], block: tuple[int, int, int], layout: Layout, payload: bytes, *,
                     smem: int = 0, stream: torch.cuda.Stream | None = None, cluster: tuple[int, int, int] | None = None,
                     pdl: bool = False) -> None:
        """:meth:`launch` with the parameters already packed: ``(layout, payload)`` from ``jit.pack_bytes``."""
        if len(payload) != layout.size:
            raise ValueError(f"{self.name}: {len(payload)} bytes of parameters, expected {layout.size} (the layout's)")
        if self._function is None:
            self._load()
        device = torch._C._cuda_getDevice()
        # Per thread: a launch writes its stream into the plan's config, so host threads launching
        # on their own streams at once (emulated ranks) must not share one.
        key = (grid, block, smem, cluster, pdl, device, threading.get_ident())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, grid, block, smem, cluster, pdl, device)
        # Per thread and layout: the bytes stay where the driver reads them only until it returns.
        buffers = self._buffers.__dict__
        buffer = buffers.get(id(layout))
        if buffer is None or buffer.layout is not layout:
            if len(buffers) >= _MAX_PLANS:
                buffers.clear()
            buffer = buffers[id(layout)] = _ParamBuffer(layout)
        ctypes.memmove(buffer.base, payload, layout.size)
        plan.config.hStream = (torch._C._cuda_getCurrentRawStream(device) if stream is None
                               else stream.cuda_stream)
        (err,) = _launch(plan.config, self._function, buffer.address, 0)
        if err != 0:
            if err == _INVALID_CONTEXT:
                ensure_context(device)
                (err,) = _launch(plan.config, self._function, buffer.address, 0)
            if err != 0:
                check((err,), f"cuLaunchKernelEx({self.name}, grid={grid}, block={block}, smem={smem})")


#: Launch-tuple packers by the tuple of argument types (jit.args.compile_positional).
_POSITIONAL: dict = {}


def _positional_packer(name: str, kinds: tuple, args: tuple):
    packer = compile_positional(kinds)
    if packer is None:
        for i, arg in enumerate(args):
            if compile_positional((type(arg),)) is None:
                raise TypeError(f"{name}: argument {i} has type {type(arg).__name__}; expected torch.Tensor, "
                                f"jit.TensorMap or one of ctypes c_int32/c_uint32/c_int64/c_uint64/c_float "
                                f"(plain Python numbers are ambiguous)")
    if len(_POSITIONAL) >= 1024:
        _POSITIONAL.clear()
    _POSITIONAL[kinds] = packer
    return packer


def _launch(config, function, params, extra):
    # Bound at first use so importing this module needs no CUDA driver.
    global _launch, _INVALID_CONTEXT
    cuda = driver()
    _INVALID_CONTEXT = cuda.CUresult.CUDA_ERROR_INVALID_CONTEXT
    _launch = cuda.cuLaunchKernelEx
    return _launch(config, function, params, extra)


_INVALID_CONTEXT = -1

_kernels: dict[tuple[str, str, str], Kernel] = {}
_kernels_lock = threading.Lock()


def build(name: str, code: str, *, arch: str | None = None) -> Kernel:
    """Compile (or find in the caches) the one kernel that ``code`` instantiates.

    Works without a GPU (the cubin lands in the disk cache); loading waits for the first launch.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r}: expected a non-empty str")
    if not isinstance(code, str):
        raise TypeError(f"code: expected str, got {type(code).__name__}")
    arch = arch or compiler.DEFAULT_ARCH
    key = (name, code, arch)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    entry = compiler.compile_cached(name, code, arch)
    with _kernels_lock:
        return _kernels.setdefault(key, Kernel(name, entry, arch))


_loads_forbidden = 0


@contextlib.contextmanager
def no_loads():
    """Within: a kernel that is not loaded yet raises instead of loading (loading a module
    synchronizes the device, which deadlocks kernels that wait on each other's progress)."""
    global _loads_forbidden
    _loads_forbidden += 1
    try:
        yield
    finally:
        _loads_forbidden -= 1


def loads_allowed() -> bool:
    """False within :func:`no_loads`: a kernel that is not loaded yet would raise at its launch."""
    return not _loads_forbidden


def load_registered() -> int:
    """Build (from the caches where they are) and load every registered kernel configuration into
    the current device's context; returns how many. Compiles what the disk cache lacks (slow on a
    cold cache: ``python -m deep_gemm_ext.jit build --all`` first)."""
    from .registry import import_kernel_modules, registered_configs

    # Every kernel module, not only those the package imports: a configuration missing here would
    # load at its first launch, the very load this function exists to avoid.
    failures = import_kernel_modules()
    if failures:
        raise RuntimeError("load_registered: kernel modules failed to import: " + "; ".join(
            f"{name}: {type(exc).__name__}: {exc}" for name, exc in failures.items()))
    count = 0
    for configs in registered_configs().values():
        for config in configs:
            build(config.name, config.code).load()
            count += 1
    return count


_sm_counts: dict = {}


def num_sms(device: torch.device | int | None = None) -> int:
    """Multiprocessor count of ``device`` (default: current), cached: grid sizes of persistent kernels."""
    count = _sm_counts.get(device)  # keyed by the argument itself: the warm path converts nothing
    if count is None:
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if resolved.index is None:  # "the current device": resolve it, cache only the concrete index
            return num_sms(torch.cuda.current_device())
        count = _sm_counts[device] = torch.cuda.get_device_properties(resolved.index).multi_processor_count
    return count


def device_guard(tensor: torch.Tensor):
    """A context that makes ``tensor``'s GPU current, free when it already is."""
    if tensor.get_device() == torch._C._cuda_getDevice():
        return _NO_GUARD
    return torch.cuda.device(tensor.device)


_NO_GUARD = contextlib.nullcontext()  # stateless: one serves every call
