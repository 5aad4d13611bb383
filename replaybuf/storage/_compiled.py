"""The optional compiled extension ``replaybuf._native`` (``replaybuf/_native.c``), built by
``pip install`` where a C compiler is present: each caller keeps a slower path for its absence."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def compiled(name: str) -> Callable[..., Any] | None:
    """The extension's function ``name``, or None where the extension was not built."""
    try:
        return getattr(importlib.import_module("replaybuf._native"), name)
    except ImportError:
        return None
