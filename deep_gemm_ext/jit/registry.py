"""Registered kernel configurations: what `python -m deep_gemm_ext.jit build --all` compiles.

The registry only stores: kernel modules (deep_gemm_ext.jit_kernels.*) register their configs when
they are imported, and whoever wants all of them (the CLI, jit.load_registered) imports every one of
those modules first (import_kernel_modules): the package's __init__ imports only some.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, NamedTuple

_registry: dict[str, Callable[[], list]] = {}


class Config(NamedTuple):
    """One compilable configuration (a source that instantiates one kernel)."""

    name: str
    code: str
    is_gemm: bool


def register(name: str):
    """Decorator: ``configs() -> list[(config_name, code, is_gemm)]`` for the CLI."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name={name!r}, expected a non-empty str")

    def decorate(configs: Callable[[], list]):
        if name in _registry and _registry[name] is not configs:
            raise ValueError(f"register: {name!r} is already registered by {_registry[name].__module__}")
        _registry[name] = configs
        return configs

    return decorate


def registered_configs() -> dict[str, list[Config]]:
    """group name -> its configurations, for every group registered so far."""
    result = {}
    for group, configs in sorted(_registry.items()):
        items = []
        for item in configs():
            if not (isinstance(item, tuple) and len(item) == 3):
                raise ValueError(f"{group}: a config must be (name, code, is_gemm), got {item!r}")
            items.append(Config(*item))
        result[group] = items
    return result


#: The package whose modules register the kernel configurations.
KERNEL_PACKAGE = "deep_gemm_ext.jit_kernels"


def import_kernel_modules() -> dict[str, Exception]:
    """Import every module of KERNEL_PACKAGE so their ``@register`` hooks run; returns the modules
    that failed to import, with their errors (one broken module must not hide the others' configs)."""
    try:
        package = importlib.import_module(KERNEL_PACKAGE)
    except Exception as exc:
        return {KERNEL_PACKAGE: exc}
    failures = {}
    for module in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{module.name}"
        try:
            importlib.import_module(name)
        except Exception as exc:
            failures[name] = exc
    return failures
