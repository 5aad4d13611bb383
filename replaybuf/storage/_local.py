"""Helpers shared by the backends that store a local folder (memmap, hdf5)."""

from __future__ import annotations

import os

from .base import Storage, detect_backend


def local_root(storage: Storage) -> str:
    """The absolute folder of a local backend; URLs are refused with what to use instead."""
    location = storage.location
    if "://" in location and not location.startswith("file://"):
        raise ValueError(
            f"the {storage.backend_name} backend stores local folders only, got {location!r}; "
            "use backend='zarr' for URLs"
        )
    return os.path.abspath(location.removeprefix("file://"))


def refuse_foreign_buffer(storage: Storage) -> None:
    """Raise before creating a buffer where another backend's buffer lives: erasing it is not
    this backend's business, and leaving it would make the folder's backend ambiguous."""
    other = detect_backend(storage.location)
    if other is not None and other != storage.backend_name:
        raise ValueError(
            f"{storage.location!r} holds a {other!r} buffer; delete it first, or open it with backend={other!r}"
        )
