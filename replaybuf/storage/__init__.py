"""Storage backends behind one protocol; ``make_storage`` picks one by name or by what is stored."""

from .base import (
    BufferNotFoundError,
    CorruptChunkError,
    Storage,
    StorageError,
    backend_class,
    detect_backend,
    make_storage,
    register_backend,
    registry,
)

__all__ = [
    "BufferNotFoundError",
    "CorruptChunkError",
    "Storage",
    "StorageError",
    "backend_class",
    "detect_backend",
    "make_storage",
    "register_backend",
    "registry",
]
