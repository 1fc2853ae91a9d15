"""Lazy re-exports for the serve subpackages: ``from gpufleet.serve.plan import plan`` imports only
the module that defines ``plan`` (numpy, aiohttp and friends load with the module that needs them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["attach"]


def attach(package: str, exports: dict[str, list[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """``{module: [names]}`` → (``__getattr__`` for the package, its ``__all__``)."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__, sorted(where)
