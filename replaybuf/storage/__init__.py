"""Storage backends behind one protocol; ``make_storage`` picks one by name or by what is stored."""

from .base import (
    BufferNotFoundError,
    Storage,
    StorageError,
    backend_class,
    detect_backend,
    make_storage,
    register_backend,
    registry,
)
from .lease import BufferLockedError

__all__ = [
    "BufferLockedError",
    "BufferNotFoundError",
    "Storage",
    "StorageError",
    "backend_class",
    "detect_backend",
    "make_storage",
    "register_backend",
    "registry",
]
