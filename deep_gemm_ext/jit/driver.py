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


def module_loading_mode() -> str:
    """The driver's module loading mode, "EAGER" or "LAZY" (CUDA_MODULE_LOADING as the driver read
    it when it started; setting the variable later changes nothing)."""
    cuda = driver()
    mode = check(cuda.cuModuleGetLoadingMode(), "cuModuleGetLoadingMode")
    return "EAGER" if mode == cuda.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING else "LAZY"
