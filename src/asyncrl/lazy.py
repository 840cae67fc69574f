"""Package namespaces whose names load their module on first use (PEP 562).

    __getattr__, __dir__ = lazy_exports(__name__, {"args": ("ModelArgs",), "hf": ("from_pretrained",)})

`from asyncrl.model import ModelArgs` then imports `asyncrl.model.args` alone, not the torch-heavy
siblings: the launcher and `--help` start in well under a second, and each process of a run
imports only what it uses. The package keeps its `__all__` and a `TYPE_CHECKING` block of the real
imports, for readers, editors and type checkers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module `__getattr__` and `__dir__` of `package`, which exports each `modules[sub]` name
    from `package.sub`."""
    where = {name: sub for sub, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        sub = where.get(name)
        if sub is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sub}"), name)
        setattr(sys.modules[package], name, value)  # later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
