"""Module attributes imported on first use (PEP 562): ``replaybuf`` and ``replaybuf.storage``
name a few things whose modules need heavy libraries (torch, dask, numcodecs, zarr)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib import import_module
from typing import Any

# replaybuf's dependencies that only some features import (``import replaybuf`` works without
# them): where one is missing (an install with --no-deps, a package removed since), using such a
# feature names the package to install, not just the module Python did not find
IMPORTED_ON_USE = {"torch": "torch", "dask": "'dask[array]'", "imageio": "imageio"}


@contextmanager
def feature_imports(feature: str) -> Iterator[None]:
    """Around the imports of ``feature``: a ``ModuleNotFoundError`` for a package of
    ``IMPORTED_ON_USE`` becomes one naming the feature and the ``pip install`` that fixes it."""
    try:
        yield
    except ModuleNotFoundError as error:
        package = (error.name or "").split(".")[0]
        if package not in IMPORTED_ON_USE:
            raise
        raise ModuleNotFoundError(
            f"{feature} needs {package}, a dependency of replaybuf that is not installed: "
            f"pip install {IMPORTED_ON_USE[package]}",
            name=package,
        ) from error


def lazy_attributes(module: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from module ``table[name]`` (relative to
    ``module``) on first use and keeps it in the module, so later uses cost nothing."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        with feature_imports(f"{module}.{name}"):
            value = getattr(import_module(table[name], module), name)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__
