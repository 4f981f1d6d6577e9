"""JIT runtime for the CUDA templates under ``kernels/``: compile, cache, load, launch.

    kernel = jit.build(name, code)            # code: #include <impls/...> + one instantiation
    kernel.launch(grid, block, args, smem=..., stream=..., cluster=..., pdl=...)
    kernel.launch_bytes(grid, block, *jit.pack_bytes(name, DECLARED_ARGS, **values), smem=...)
    tmap = jit.make_tma_2d(tensor, box_rows, box_cols, swizzle=128)

Importing this package needs neither a GPU nor a CUDA toolkit; building needs nvcc (or NVRTC),
launching needs a GPU.
"""
from .args import KernelArg, Layout, pack_args, pack_bytes, render_types
from .compiler import (CacheEntry, ResourceUsage, cache_key, compile_cached, included_headers,
                       kernels_dir, parse_ptxas_log, select_compiler)
from .registry import Config, register, registered_configs
from .runtime import SMEM_SYMBOL, Kernel, build, device_guard, load_registered, loads_allowed, no_loads, num_sms
from .tma import TensorMap, make_tma_2d

__all__ = [
    "CacheEntry", "Config", "Kernel", "KernelArg", "Layout", "ResourceUsage", "SMEM_SYMBOL", "TensorMap", "build", "cache_key",
    "compile_cached", "device_guard", "included_headers", "kernels_dir", "load_registered", "loads_allowed", "make_tma_2d", "no_loads",
    "num_sms", "pack_args", "pack_bytes", "parse_ptxas_log", "register", "registered_configs", "render_types", "select_compiler",
]
