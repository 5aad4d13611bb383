"""Storage backends behind one protocol; ``make_storage`` picks one by name or by what is stored.

The names in ``__all__`` are the whole of what modules outside ``storage/`` use (checked by
``tests/test_seams.py``); the private modules (``_zarr``, ``_cache``, ...) are reached only
through them. ``chunk_cache`` and ``list_children`` import their modules (numcodecs, zarr) on
first use.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from ._cache import DEFAULT_CACHE_SIZE, CachedStorage, new_uuid, with_cache
from ._owned import ForeignEntriesError
from ._recycle import recycled_empty
from ._seed import read_seed_schema, seed_h5_hint
from .base import (
    ATTRS_KEY,
    DEFAULT_HOT_BYTES,
    EDIT_KEY,
    LOG_PREFIX,
    MAX_DOCUMENT_BYTES,
    META_SUM,
    SKETCHES_PREFIX,
    SNAPSHOTS_PREFIX,
    STATE_KEY,
    UPGRADE_MARKER,
    WRITING_KEY,
    ArrayBase,
    BufferDamagedError,
    BufferNotFoundError,
    BufferReplacedError,
    ChecksumEntryError,
    ChunkChecksumError,
    CompactionSummary,
    ConcurrentWriteError,
    CorruptChunkError,
    EpisodeLengthError,
    GenerationMismatchError,
    LostLengthError,
    NewerFormatError,
    StalePlanError,
    Storage,
    StorageError,
    UnfinishedCreateError,
    UnfinishedEditError,
    WrappedArray,
    backend_class,
    bookkeeping_fields,
    check_bookkeeping,
    check_lost_lengths,
    check_state,
    committed_without_length,
    detect_backend,
    document_limit,
    empty_state,
    is_url,
    make_storage,
    meta_file,
    missing_folder_hint,
    object_store_endpoint,
    parse_json,
    refuse_empty_location,
    register_backend,
    registry,
    unpublished_slots,
)
from .lease import BufferLockedError, collecting, describe_holder
from .spans import Spans, fill_beyond

if TYPE_CHECKING:
    from ._chunks import chunk_cache
    from ._hdf5 import DATA_FILE, HDF5Storage, open_h5, refuse_outside_storage, stored_elsewhere
    from ._hotmap import forget_files_under
    from ._zarr import list_children

_LAZY = {
    "chunk_cache": "._chunks",
    "forget_files_under": "._hotmap",
    "list_children": "._zarr",
    "DATA_FILE": "._hdf5",
    "HDF5Storage": "._hdf5",
    "open_h5": "._hdf5",
    "refuse_outside_storage": "._hdf5",
    "stored_elsewhere": "._hdf5",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "is_url",
    "ATTRS_KEY",
    "DATA_FILE",
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_HOT_BYTES",
    "LOG_PREFIX",
    "MAX_DOCUMENT_BYTES",
    "META_SUM",
    "SKETCHES_PREFIX",
    "SNAPSHOTS_PREFIX",
    "STATE_KEY",
    "UPGRADE_MARKER",
    "EDIT_KEY",
    "WRITING_KEY",
    "ArrayBase",
    "BufferDamagedError",
    "NewerFormatError",
    "BufferLockedError",
    "BufferNotFoundError",
    "CompactionSummary",
    "CachedStorage",
    "ChecksumEntryError",
    "ChunkChecksumError",
    "CorruptChunkError",
    "EpisodeLengthError",
    "LostLengthError",
    "ForeignEntriesError",
    "GenerationMismatchError",
    "BufferReplacedError",
    "ConcurrentWriteError",
    "StalePlanError",
    "HDF5Storage",
    "Spans",
    "Storage",
    "StorageError",
    "UnfinishedCreateError",
    "UnfinishedEditError",
    "WrappedArray",
    "backend_class",
    "bookkeeping_fields",
    "check_bookkeeping",
    "forget_files_under",
    "check_lost_lengths",
    "collecting",
    "committed_without_length",
    "meta_file",
    "missing_folder_hint",
    "object_store_endpoint",
    "check_state",
    "chunk_cache",
    "describe_holder",
    "detect_backend",
    "document_limit",
    "empty_state",
    "fill_beyond",
    "open_h5",
    "read_seed_schema",
    "recycled_empty",
    "refuse_outside_storage",
    "stored_elsewhere",
    "seed_h5_hint",
    "list_children",
    "make_storage",
    "parse_json",
    "new_uuid",
    "refuse_empty_location",
    "register_backend",
    "registry",
    "unpublished_slots",
    "with_cache",
]
