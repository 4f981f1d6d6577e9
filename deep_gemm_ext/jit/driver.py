"""The CUDA driver API through cuda-python: the module, and the unpacking of its results."""
from __future__ import annotations


def driver():
    """The cuda-python driver module, or a clear error where it is missing."""
    try:
        from cuda.bindings import driver as cuda_driver
    except ImportError as exc:
        raise RuntimeError("deep_gemm_ext.jit needs cuda-python (`pip install cuda-bindings`) to load and "
                           "launch kernels") from exc
    return cuda_driver


def check(result, what: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising RuntimeError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != 0:
        cuda = driver()
        name = cuda.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
    return values[0] if len(values) == 1 else tuple(values)


def ensure_context(device: int) -> None:
    """Make torch's primary context of ``device`` current on this thread. A new thread has none: a
    launch on a stream still runs (the stream names its context), but context-bound calls such as
    cuTensorMapEncodeTiled fail with CUDA_ERROR_INVALID_CONTEXT until one is current."""
    cuda = driver()
    handle = check(cuda.cuDeviceGet(device), "cuDeviceGet")
    context = check(cuda.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def module_loading_mode() -> str:
    """The driver's module loading mode, "EAGER" or "LAZY" (CUDA_MODULE_LOADING as the driver read
    it when it started; setting the variable later changes nothing)."""
    cuda = driver()
    mode = check(cuda.cuModuleGetLoadingMode(), "cuModuleGetLoadingMode")
    return "EAGER" if mode == cuda.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING else "LAZY"


_OWNED_STREAMS: list = []  # created here, alive for the process (torch's wrappers do not own them)


def new_stream(device):
    """A CUDA stream of its own on ``device`` (cuStreamCreate, non-blocking), as a torch stream.

    ``torch.cuda.Stream()`` hands out 32 pooled streams per device round robin: a stream kept for
    later (a buffer's side stream) is handed out again as a "new" stream some 32 creations on, and
    the two users then share one queue. Kernels that wait on each other (the emulated ranks' on
    their streams) must not: a waiting kernel would hold back the kernel it waits for."""
    import torch

    cuda = driver()
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.init()
    if not int(check(cuda.cuCtxGetCurrent(), "cuCtxGetCurrent")):  # no context on this thread yet
        ctx = check(cuda.cuDevicePrimaryCtxRetain(check(cuda.cuDeviceGet(index), "cuDeviceGet")),
                    "cuDevicePrimaryCtxRetain")
        check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    with torch.cuda.device(index):
        handle = check(cuda.cuStreamCreate(cuda.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        _OWNED_STREAMS.append(handle)
        return torch.cuda.ExternalStream(int(handle), device=index)
