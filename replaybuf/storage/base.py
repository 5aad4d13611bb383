"""The Storage protocol, the backend registry, and ``make_storage``.

A Storage is where one buffer's bytes live. ``buffer.py`` only talks to this protocol and never
branches on the backend: a backend implements the eight primitives marked abstract below, and
everything else (counters, the step log, batched reads and writes) is built on them here.
"""

from __future__ import annotations

import importlib
import json
import os
import types
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import numpy as np

from ..schema import Field, Schema

STATE_KEY = "replaybuf/state.json"
LOG_PREFIX = "replaybuf/steplog/"


class BufferNotFoundError(FileNotFoundError):
    """No replaybuf buffer exists at the given location."""


class StorageError(RuntimeError):
    """The backing store failed (disk full, connection lost, ...) while reading or writing."""


class ArrayLike(Protocol):
    """What ``buffer.data[name]`` and ``buffer.meta_data[name]`` return: numpy-style indexing."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, key: Any) -> np.ndarray: ...

    def __setitem__(self, key: Any, value: Any) -> None: ...


def bookkeeping_fields(schema: Schema) -> dict[str, Field]:
    """Per-episode arrays every backend stores besides the user's meta fields.

    ``episode_lens`` (int32, as the seed) is the published length of each slot: 0 means the slot
    holds no committed episode. ``_generation`` (int64) is the 1-based ordinal of the commit that
    filled the slot, so readers can order a circular buffer chronologically and notice reuse.
    """
    del schema
    return {
        "episode_lens": Field("episode_lens", np.dtype("int32")),
        "_generation": Field("_generation", np.dtype("int64")),
    }


def empty_state() -> dict:
    """Counters of an empty buffer."""
    return {"num_episodes": 0, "episode_index": 0, "total_episodes": 0}


class Storage(ABC):
    """One buffer's bytes: arrays ``data/<field>`` (episode, time, *shape), ``meta/<field>``
    (episode, *shape), the counters object and the step log.

    Parameters
    ----------
    location
        A local path or a URL the backend understands.
    storage_options
        Passed to the underlying store (endpoint, credentials, ...); never stored.
    fsync
        Make every committed write durable against power loss, not only process crashes.
    """

    backend_name: ClassVar[str] = ""
    supports_remote: ClassVar[bool] = False
    supports_field_codecs: ClassVar[bool] = False

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        self.location = str(location)
        self.storage_options = dict(storage_options or {})
        self.fsync = fsync
        self.read_only = True

    # ---- primitives -------------------------------------------------------------------

    @classmethod
    def can_open(cls, location: str, storage_options: dict | None = None) -> bool:
        """Whether ``location`` holds a buffer of this backend (used to detect backends)."""
        return False

    @abstractmethod
    def exists(self) -> bool:
        """Whether a buffer of this backend exists at the location."""

    @abstractmethod
    def create(self, schema: Schema, overwrite: bool) -> None:
        """Create an empty buffer (erasing an existing one when ``overwrite``) and open it for writing."""

    @abstractmethod
    def open(self, read_only: bool) -> Schema:
        """Open an existing buffer and return its stored schema; raise BufferNotFoundError if none."""

    @abstractmethod
    def array(self, name: str, meta: bool = False) -> ArrayLike:
        """The stored array of a field (``meta`` for per-episode fields and bookkeeping)."""

    @abstractmethod
    def read_blob(self, key: str) -> bytes | None:
        """The bytes of a small side object, or None when absent."""

    @abstractmethod
    def write_blob(self, key: str, data: bytes) -> None:
        """Write a small side object atomically (temp file + rename on disk, one PUT remotely)."""

    @abstractmethod
    def delete_blobs(self, prefix: str) -> None:
        """Delete every side object whose key starts with ``prefix``."""

    @abstractmethod
    def list_blobs(self, prefix: str) -> list[str]:
        """Sorted keys of the side objects starting with ``prefix``."""

    # ---- counters ---------------------------------------------------------------------

    def load_state(self) -> dict:
        """The last committed counters (num_episodes, episode_index, total_episodes)."""
        raw = self.read_blob(STATE_KEY)
        return empty_state() if raw is None else {**empty_state(), **json.loads(raw)}

    def commit_state(self, state: dict) -> None:
        """Publish the counters as one atomic object: the last step of every commit."""
        self._check_writable()
        self.write_blob(STATE_KEY, json.dumps(state, sort_keys=True).encode())

    # ---- step log: the durability of episodes in progress --------------------------------

    def append_log(self, name: str, data: bytes) -> None:
        """Append bytes to the step log ``name``. Backends with real appends override this;
        the default writes one numbered segment object per call."""
        self._check_writable()
        index = len(self.list_blobs(f"{LOG_PREFIX}{name}/"))
        self.write_blob(f"{LOG_PREFIX}{name}/{index:010d}", data)

    def read_log(self, name: str) -> bytes:
        """Everything appended to the step log ``name`` since it was last cleared."""
        return b"".join(self.read_blob(k) or b"" for k in self.list_blobs(f"{LOG_PREFIX}{name}/"))

    def log_names(self) -> list[str]:
        """Names of the step logs left in the store (by writers that did not finish)."""
        return sorted({k[len(LOG_PREFIX) :].split("/")[0] for k in self.list_blobs(LOG_PREFIX)})

    def clear_log(self, name: str) -> None:
        self._check_writable()
        self.delete_blobs(f"{LOG_PREFIX}{name}")

    # ---- batched reads and writes ----------------------------------------------------------

    def time_chunk(self, name: str) -> int:
        """Timesteps per storage chunk of data field ``name``: staging writes whole chunks."""
        return 1

    def write_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        """Write ``values`` (len(episodes), T, *shape) into ``data/name[episodes, t0:t0+T]``.

        The buffer calls this only for slots no reader trusts (new or invalidated), so a backend
        may write in place instead of atomically."""
        self._check_writable()
        array = self.array(name)
        for row, episode in enumerate(np.asarray(episodes)):
            array[int(episode), t0 : t0 + values.shape[1]] = values[row]

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` (len(episodes), *shape) into ``meta/name[episodes]``."""
        self._check_writable()
        episodes = np.asarray(episodes)
        order = np.argsort(episodes)
        self.array(name, meta=True)[episodes[order]] = np.asarray(values)[order]

    def read_rows(self, name: str, episodes: np.ndarray, t0: int, t1: int) -> np.ndarray:
        """``data/name[episodes, t0:t1]`` as one array (len(episodes), t1 - t0, *shape)."""
        array = self.array(name)
        return np.stack([np.asarray(array[int(e), t0:t1]) for e in np.asarray(episodes)])

    def read_spans(
        self,
        name: str,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out: np.ndarray,
        parallel: bool = True,
    ) -> None:
        """Steps ``starts[i] .. starts[i] + lengths[i]`` of episode ``episodes[i]`` into
        ``out[i, :lengths[i]]`` (the rest of ``out`` untouched): whole-episode reads for
        get_all_data, stats and trajectory batches. ``parallel=False``: decode in the calling
        thread (the caller runs one task per core). Backends with a bulk path override this."""
        from .spans import read_spans_by_rows

        read_spans_by_rows(self, name, episodes, starts, lengths, out)

    def gather(self, name: str, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        """``data/name[episodes[i], timesteps[i]]`` for every i, as one array (N, *shape)."""
        episodes, timesteps = np.asarray(episodes), np.asarray(timesteps)
        array = self.array(name)
        out = np.empty((len(episodes), *array.shape[2:]), dtype=array.dtype)
        for episode in np.unique(episodes):
            rows = np.flatnonzero(episodes == episode)
            lo, hi = int(timesteps[rows].min()), int(timesteps[rows].max()) + 1
            out[rows] = np.asarray(array[int(episode), lo:hi])[timesteps[rows] - lo]
        return out

    def read_meta(self, name: str) -> np.ndarray:
        """The whole per-episode array ``meta/name`` in RAM."""
        return np.asarray(self.array(name, meta=True)[:])

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        """``meta/name[episodes]`` read from the store now, only those entries (what a reader
        re-checks after each read, see ``consistency.py``); never served from a cache."""
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        if len(episodes) == 0:
            return self.read_meta(name)[:0]
        # one slice over the entries' range: the backends' fast path (a fancy index over a zarr
        # array took 16x longer than reading its whole 1,000 entries)
        lo, hi = int(episodes.min()), int(episodes.max()) + 1
        return np.asarray(self.array(name, meta=True)[lo:hi])[episodes - lo]

    # ---- lifecycle ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Make written data durable as far as the backend can (a no-op for most)."""

    def drop_caches(self) -> None:
        """Forget decoded chunks and open files this process keeps for reading, so the next
        reads see what writers elsewhere changed (a no-op where reads are never cached)."""

    def close(self) -> None:
        """Release handles; the object can still be reopened."""

    def describe(self) -> dict:
        """Backend facts for ``replaybuf info``: chunking, compressor, stored vs raw bytes."""
        return {"backend": self.backend_name, "location": self.location}

    def _check_writable(self) -> None:
        if self.read_only:
            raise PermissionError(f"buffer at {self.location!r} was opened read-only; writing is not allowed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"


# ---- registry -----------------------------------------------------------------------------

_registry: dict[str, tuple[str, str]] = {
    "zarr": ("replaybuf.storage._zarr:ZarrStorage", "zarr is a core dependency; reinstall replaybuf"),
    "memmap": ("replaybuf.storage._memmap:MemmapStorage", "reinstall replaybuf"),
    "hdf5": ("replaybuf.storage._hdf5:HDF5Storage", "install h5py: pip install 'replaybuf[h5py]'"),
}
registry = types.MappingProxyType(_registry)


def register_backend(name: str, target: str, install_hint: str = "", clobber: bool = False) -> None:
    """Register a backend as ``"module:Class"``; refuses to replace an existing name unless ``clobber``."""
    if name in _registry and not clobber:
        raise ValueError(f"backend {name!r} is already registered as {_registry[name][0]!r}")
    _registry[name] = (target, install_hint)


def backend_class(name: str) -> type[Storage]:
    """Import and return the Storage class registered as ``name``."""
    if name not in _registry:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_registry)}")
    target, hint = _registry[name]
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"backend {name!r} is not available: {hint} ({e})") from e
    return getattr(module, class_name)


def detect_backend(location: str, storage_options: dict | None = None) -> str | None:
    """The name of the backend whose buffer is at ``location``, or None when there is none."""
    for name in _registry:
        try:
            cls = backend_class(name)
        except ImportError:
            continue
        if cls.can_open(location, storage_options):
            return name
    return None


def make_storage(
    location: str | os.PathLike | Storage,
    backend: str | None = None,
    storage_options: dict | None = None,
    **kwargs: Any,
) -> Storage:
    """Turn a path, URL or Storage into a Storage.

    - a ``Storage`` instance is returned as it is;
    - ``backend`` given: that registered backend at ``location``;
    - otherwise the backend of the buffer found at ``location`` (``detect_backend``), and
      ``'zarr'`` when there is none yet. The zarr backend takes local paths and any URL
      (``memory://``, ``s3://``, ``gs://``, other fsspec protocols).
    """
    if isinstance(location, Storage):
        return location
    location = os.fspath(location)
    if backend is None:
        backend = detect_backend(location, storage_options) or "zarr"
    return backend_class(backend)(location, storage_options, **kwargs)
