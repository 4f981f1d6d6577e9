"""Every GEMM configuration's kernel arguments have distinct names, so a launch can pass them by name."""
from deep_gemm_ext.jit_kernels import sm90_bf16_grouped_gemm as gg


def test_kernel_argument_names_are_unique():
    for config in gg._all_configs():
        names = [arg.name for arg in config.args]
        assert len(names) == len(set(names)), f"{config.name}: repeated argument names in {names}"
