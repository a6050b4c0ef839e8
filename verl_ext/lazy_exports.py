"""A package's public names, imported from their modules on first use (PEP 562 ``__getattr__``), so
that importing the package loads nothing heavy. Used by :mod:`verl_ext.check`, :mod:`verl_ext.inspect`
and :mod:`verl_ext.view`."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """The ``__all__`` and the module ``__getattr__`` of ``package``: each name of ``exports`` (name ->
    the module defining it) is imported from its module when first asked for; any other name is an
    AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return list(exports), __getattr__
