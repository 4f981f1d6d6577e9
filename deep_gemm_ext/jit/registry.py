"""Registered kernel configurations: what `python -m deep_gemm_ext.jit build --all` compiles."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, NamedTuple

_registry: dict[str, Callable[[], list]] = {}


class Config(NamedTuple):
    """One compilable configuration; ``dynamic_smem`` is the bytes a launch asks for, when fixed."""

    name: str
    code: str
    is_gemm: bool
    dynamic_smem: int | None = None


def register(name: str):
    """Decorator: ``configs() -> list[(config_name, code, is_gemm[, dynamic_smem])]`` for the CLI."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name={name!r}, expected a non-empty str")

    def decorate(configs: Callable[[], list]):
        if name in _registry and _registry[name] is not configs:
            raise ValueError(f"register: {name!r} is already registered by {_registry[name].__module__}")
        _registry[name] = configs
        return configs

    return decorate


def import_kernel_modules() -> dict[str, Exception]:
    """Import every ``deep_gemm_ext.jit_kernels.*`` module so their ``@register`` hooks run;
    returns the modules that failed to import, with their errors."""
    package = importlib.import_module("deep_gemm_ext.jit_kernels")
    failures = {}
    for module in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{module.name}"
        try:
            importlib.import_module(name)
        except Exception as exc:  # one broken module must not hide the others' configs
            failures[name] = exc
    return failures


def registered_configs(*, strict: bool = True) -> dict[str, list[Config]]:
    """group name -> its configurations, after importing all kernel modules (``strict``: a module
    that fails to import is an error; otherwise its configs are simply missing)."""
    failures = import_kernel_modules()
    if strict and failures:
        raise RuntimeError("kernel modules failed to import: " +
                           "; ".join(f"{name}: {type(exc).__name__}: {exc}" for name, exc in failures.items()))
    result = {}
    for group, configs in sorted(_registry.items()):
        items = []
        for item in configs():
            if not (isinstance(item, tuple) and len(item) in (3, 4)):
                raise ValueError(f"{group}: a config must be (name, code, is_gemm[, dynamic_smem]), got {item!r}")
            items.append(Config(*item))
        result[group] = items
    return result
