"""Lazy package exports: a package's names are imported on first use, not with the package.

So a process that needs one submodule (the data loader's download child, the command line)
imports neither torch nor Ray unless that submodule does (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` exporting each name from its module.

    ``exports`` maps a public name to the module (relative to ``package``) that defines it.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
