"""Registered kernel configurations: what `python -m deep_gemm_ext.jit build --all` compiles.

The registry only stores: kernel modules (deep_gemm_ext.jit_kernels.*) register their configs when
they are imported, and whoever wants all of them (the CLI) imports those modules first.
"""
from __future__ import annotations

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
