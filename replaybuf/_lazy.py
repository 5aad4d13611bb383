"""Module attributes imported on first use (PEP 562): ``replaybuf`` and ``replaybuf.storage``
name a few things whose modules need heavy libraries (torch, dask, numcodecs, zarr)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(module: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from module ``table[name]`` (relative to
    ``module``) on first use and keeps it in the module, so later uses cost nothing."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(import_module(table[name], module), name)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__
