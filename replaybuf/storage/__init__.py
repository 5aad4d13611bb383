"""Storage backends behind one protocol; ``make_storage`` picks one by name or by what is stored."""

from ._owned import ForeignEntriesError
from .base import (
    BufferDamagedError,
    BufferNotFoundError,
    CorruptChunkError,
    GenerationMismatchError,
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
    "BufferDamagedError",
    "BufferLockedError",
    "BufferNotFoundError",
    "ForeignEntriesError",
    "CorruptChunkError",
    "GenerationMismatchError",
    "Storage",
    "StorageError",
    "backend_class",
    "detect_backend",
    "make_storage",
    "register_backend",
    "registry",
]
