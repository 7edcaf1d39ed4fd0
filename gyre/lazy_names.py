"""Names a package exports but imports only on first access (PEP 562), so importing the package stays light.

`gyre.engine` and `gyre.models` export torch-backed names (`NativeEngine`, `DecoderLM`, ...) beside stdlib ones;
a light process (the proxy) imports the package for the stdlib names and never loads torch. Use:

    __getattr__, __dir__ = lazy_names(__name__, {"DecoderLM": "gyre.models.decoder", ...})

Each name resolves once (it is then stored in the package's namespace); an unknown name is the usual
AttributeError. Stdlib only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, modules: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`: each name in `modules` is imported from its module on first use."""
    table = dict(modules)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *table])

    return __getattr__, __dir__
