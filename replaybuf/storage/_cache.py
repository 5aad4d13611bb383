"""A read-through local cache of decoded rows: a storage layer over any ``Storage``.

Compressed or remote episodes are decoded once, on their first read, into raw files that every
reader of the machine maps: DataLoader workers (fork or spawn), other processes, later runs.
One file per (field, slot, generation, revision), holding the episode's ``episode_lens`` steps:

- **Keyed by generation and revision.** A slot's ``_generation`` only grows, so a reused slot
  gets a new file and is refetched, never served stale; its ``_revision`` takes a new random
  even value with each in-place edit of its rows (odd while the edit runs: such a slot is
  neither cached nor served from the cache), so an edited episode is refetched once a reader's
  view (``drop_caches``, ``refresh``) has the new revision. Each commit publishes its writer
  session's random revision too, so a buffer put back from a copy and written again, whose new
  episodes take the generations of those written after the copy, never has them served from
  the discarded episodes' files (``commit.py``). A fill publishes a file only when the slot held the same
  generation and revision before and after reading its rows, so a file holds the bytes of one
  committed episode as of one revision, never a torn mix.
- **Verified reads.** A read given ``generations`` (what the consistent reads of
  ``consistency.py`` pass) serves each slot from the file of exactly that generation; rows it
  must read from the wrapped storage (steps past a cached length, a slot whose fill found it
  reused) are followed by a read of those slots' ``_generation``. So the layer
  ``verifies_generations``: a read served wholly from files reads nothing from the wrapped
  storage, not even ``_generation`` (the second epoch over S3 issues no GET at all), and a slot
  reused since the caller planned raises ``GenerationMismatchError``. A read without
  ``generations`` serves the generation this process last saw for the slot (loaded lazily,
  refreshed by ``drop_caches`` and by every ``_generation`` read passing through it); every read
  serves the revision this process last saw (the same way, from ``_revision``).
- **Checked.** A file holds the rows, then the crc32c (4 bytes, little-endian) of its name in the
  cache folder followed by the rows, checked when a process maps the file: one that fails (a
  flipped byte, a truncation, another episode's file renamed or copied into its place) is
  deleted and its episode fetched again from the wrapped storage, never served. Each process
  checks a file (an inode) once, the first time it maps it. Damage done to a file after that is
  not seen by that process, and a truncation from outside then faults it (SIGBUS) as it would
  any np.memmap: replaybuf itself only ever replaces whole files. Nor is a file served whose row
  count differs from the slot's stored length as last read under that generation (a damaged
  length): the read goes to the wrapped storage, whose checks name it.
- **Atomic, once.** A filler writes a temp file and renames it into place: a file that exists is
  whole (a filler killed mid-write leaves only a temp file, never served, deleted by the next
  eviction scan, which every process runs at its first fill, once nobody holds its slot's lock). A filler holds a lock per (field, slot) (``flock`` on ``.locks/<field>-<slot>``,
  released by the kernel if it dies) while it fetches; another filler wanting the same episode
  waits for it instead of fetching it again, for at most ``FILL_WAIT_S`` (a filler stopped
  with its lock held, say): then it reads the episode from the wrapped storage, uncached.
- **Bounded.** ``cache_size`` bytes per buffer, least recently used files evicted first (use is
  the file's mtime, touched when a process maps it and at most every ``TOUCH_S`` after). A
  deleted file's blocks stay taken while any map holds it, so a process drops its maps of the
  files gone from the folder at each of its eviction scans and, for one it keeps using, at its
  next touch (then maps it again or refills it): what the cache takes on disk stays near
  ``cache_size``, not that plus every file each reader ever mapped. The bytes are counted in
  one file per buffer folder (``USAGE_FILE``) that every filling process adds to, so the bound
  holds for all of them together, give or take the fills being written at that moment.

- **Its own files only.** The folders under ``cache_dir`` (the buffer's, its fields', ``.locks``)
  must be plain directories, and a cache, temp or lock file a plain file, opened without
  following a symlink and without blocking (a FIFO): a symlinked folder, or a ``cache_dir`` the
  process cannot write or in a local buffer's own folder, makes the reads go to the wrapped storage (warned once, tried again
  after ``FULL_RETRY_S``), an odd cache file is never served, an odd lock entry leaves its
  episode filled unlocked, and no write, touch or delete reaches outside those files. A folder
  deleted meanwhile (by another process) only leaves that read uncached.
- **Replaced buffers' folders removed.** A buffer's folder records whose it is (``OWNER_FILE``:
  its location, host or endpoint, uuid); a process's first read of a buffer removes the folders
  recorded for the same location and store under another uuid, the buffers created there before
  it (``overwrite=True``), whose rows no reader can be served again (``_remove_replaced``).

Only a storage opened read-only is cached (a writer's rows change under it), or a writer's for
a dataset's snapshot reads (``snapshot=True``); steps past an episode's length are read from
the wrapped storage.

A process serves its maps as fast as one np.memmap: ``MappedRows`` keeps, per field and slot,
the generation, length and address of the map it holds, so a batch is checked with a few
vectorized comparisons and gathered with one fancy index (timesteps) or copied one slice per
span (trajectories, ``get_all_data``); only the items it cannot serve go through the per-slot
path (map, fill, touch).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import threading
import time
import uuid as uuid_module
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

import numpy as np

from ..schema import Field, Schema
from ._codecs import crc32c
from ._kv import copy_spans
from ._mapping import map_file
from ._strided import gather_addresses, take_at
from .base import (
    ArrayLike,
    BufferNotFoundError,
    BufferReplacedError,
    GenerationMismatchError,
    Storage,
    StorageError,
    is_url,
    object_store_endpoint,
    object_store_url,
)
from .spans import Spans

#: default bound of one buffer's cache folder (``cache_size``)
DEFAULT_CACHE_SIZE = 20 << 30
#: maps a process keeps open per cached storage (no file descriptor each: ``_mapping.map_file``)
MAX_OPEN_MAPS = 4096
#: files whose check a layer remembers (``CachedStorage._checked``): a map evicted and made
#: again is not checked again
MAX_CHECKED = 1 << 20
#: seconds between two touches of a file a process keeps using (its LRU clock)
TOUCH_S = 30.0
#: a scan that finds the folder over ``cache_size`` evicts down to this fraction of it, so the
#: fills of the next tenth need no scan: evicting only down to ``cache_size`` made every fill of
#: a full cache scan (and stat) every file of the folder, a cost per batch growing with the
#: episodes cached (5,000 cached episodes: 200 batches took 13.4 s, 3.4 s with room)
EVICT_TO = 0.9
#: a temp file older than this was left by a killed filler; eviction deletes it
STALE_TEMP_S = 3600.0
#: seconds a filler waits for another process's fill of the same episode before it reads the
#: episode from the wrapped storage itself (uncached this time)
FILL_WAIT_S = 60.0
#: episodes fetched per ``warm`` step
WARM_BATCH = 16
#: a field whose whole (max_episodes, max_timesteps) array is at most this many bytes is also
#: copied into RAM per process as its episodes are mapped, so sampling it is one fancy index
#: (vectors and scalars; mapping one file per sampled episode costs more than their bytes)
DENSE_BYTES = 64 << 20
#: a cache file: the rows, then their crc32c (``CHECK_BYTES``); files of the unchecked layout
#: (``OLD_SUFFIX``) are deleted by the next eviction scan
SUFFIX = ".rows"
OLD_SUFFIX = ".raw"
CHECK_BYTES = 4
#: errors of a cache folder with no room left: the rows are then read from the store
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: seconds a process reads past a full (or unusable) cache folder before it tries to fill it again
FULL_RETRY_S = 10.0
#: the file in a buffer's ``.locks`` folder holding the bytes of its cache files, as its
#: fillers count them (8 bytes, little-endian; a field's lock is ``<field>-<slot>``)
USAGE_FILE = ".used"
#: seconds a filler waits for the usage file's lock (held for a count, or a scan) before it
#: counts its own writes alone (a process stopped with the lock held delays no fill for long)
USAGE_WAIT_S = 2.0
#: how the cache opens its files: never through a symlink, never blocked by a FIFO
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: how the sweep of replaced buffers' folders opens a folder: never through a symlink
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: the file in a buffer's ``.locks`` folder recording whose cache the folder is (JSON, see
#: ``owner_record``): it marks the folder as the cache's own, and lets the first reader of a
#: buffer created again at the same location remove the folder of the one it replaced
OWNER_FILE = ".owner"
#: the most bytes an owner record may take (a larger file is no record of the cache's)
OWNER_MAX_BYTES = 1 << 16
#: the names of the cache's lock files in ``.locks`` (``<field>-<slot>``)
LOCK_NAME = re.compile(r".+-[0-9]+")


class CacheFolderError(Exception):
    """A file operation on the cache folder failed (``error``): the reads it served go to the
    wrapped storage instead (an error of the wrapped storage is never one of these)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


@contextmanager
def _in_cache_folder() -> Iterator[None]:
    """Raise the OSErrors of the cache folder's file operations within as ``CacheFolderError``."""
    try:
        yield
    except OSError as e:
        raise CacheFolderError(e) from e


class DenseRows:
    """One process's in-RAM copy of a small field's cached episodes: row ``slot`` holds
    ``lengths[slot]`` steps of generation ``held[slot]`` (0: nothing) at revision
    ``revisions[slot]``. Pages are allocated as rows are filled (``np.zeros``)."""

    def __init__(self, field: Field, max_episodes: int, max_timesteps: int):
        self.rows = np.zeros((max_episodes, max_timesteps, *field.shape), field.dtype)
        self.held = np.zeros(max_episodes, np.int64)
        self.revisions = np.zeros(max_episodes, np.int64)
        self.lengths = np.zeros(max_episodes, np.int64)
        self.lock = threading.Lock()

    def put(self, slot: int, generation: int, revision: int, rows: np.ndarray) -> None:
        if len(rows) > self.rows.shape[1]:
            return  # not an episode of this buffer: served from its map, never copied
        with self.lock:
            if self.held[slot] != generation or self.revisions[slot] != revision:
                self.rows[slot, : len(rows)] = rows
                self.lengths[slot] = len(rows)
                self.held[slot], self.revisions[slot] = generation, revision

    def gather(
        self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray, revisions: np.ndarray
    ) -> np.ndarray | None:
        """The items' steps when every item's slot is held at its generation and revision, else None."""
        with self.lock:
            if (
                (self.held[episodes] != generations).any()
                or (self.revisions[episodes] != revisions).any()
                or (timesteps >= self.lengths[episodes]).any()
            ):
                return None
            try:  # one flat take (a two-axis fancy index of vector rows took ~2-3x as long)
                flat = np.ravel_multi_index((episodes, timesteps), self.rows.shape[:2])
            except ValueError:  # negative steps: numpy's answer
                return self.rows[episodes, timesteps]
            return self.rows.reshape(-1, *self.rows.shape[2:]).take(flat, axis=0)


class MappedRows:
    """One process's index of a field's mapped episodes, for gathers: per slot the generation
    ``held[slot]`` (0: none), the length and the start address of the map serving it, and when
    its file was last touched (``time.monotonic``). A batch of (episode, timestep) pairs is
    gathered with one compiled copy from each item's address (``_strided.gather_addresses``,
    as the hot maps are), or without the C extension one fancy index through a strided view
    based at the lowest map of the batch (``_strided.take_at``: 256 frames of 84x84x3 took
    0.70 ms so, 0.84 ms with one copy per item from its map, 0.65 ms from one np.memmap); only
    the rows of items checked against their slot's generation and length are read, so no byte
    outside the maps is touched."""

    def __init__(self, field: Field, max_episodes: int):
        self.field, self.step_nbytes = field, field.step_nbytes
        self.held = np.zeros(max_episodes, np.int64)
        self.revisions = np.zeros(max_episodes, np.int64)
        self.lengths = np.zeros(max_episodes, np.int64)
        self.addresses = np.zeros(max_episodes, np.int64)
        self.touched = np.zeros(max_episodes, np.float64)
        self.maps: dict[int, np.ndarray] = {}  # slot -> its map (keeps it alive while indexed)
        self.lock = threading.Lock()

    def put(self, slot: int, generation: int, revision: int, rows: np.ndarray, touched: float) -> None:
        """Serve ``slot`` at ``generation`` and ``revision`` from ``rows`` (a map from
        ``CachedStorage._map``)."""
        with self.lock:
            self.maps[slot] = rows
            self.held[slot], self.lengths[slot], self.touched[slot] = generation, len(rows), touched
            self.revisions[slot] = revision
            self.addresses[slot] = rows.__array_interface__["data"][0]

    def drop(self, slot: int, rows: np.ndarray) -> None:
        """Stop serving ``slot`` if it is served from ``rows`` (a map this process closes)."""
        with self.lock:
            if self.maps.get(slot) is rows:
                del self.maps[slot]
                self.held[slot] = self.lengths[slot] = 0

    def clear(self) -> None:
        with self.lock:
            self.maps.clear()
            self.held[:] = self.lengths[:] = 0

    def gather(
        self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray, revisions: np.ndarray, now: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows, served): ``rows[i]`` holds the item's step where ``served[i]``: its slot is
        held at ``generations[i]`` (> 0) and ``revisions[i]``, the step within its length, its file touched less than
        ``TOUCH_S`` ago (the others are for the caller to map, touch or read elsewhere)."""
        field = self.field
        if not len(episodes) or episodes.min() < 0 or timesteps.min() < 0:
            return np.empty((len(episodes), *field.shape), field.dtype), np.zeros(len(episodes), bool)
        with self.lock:
            # a slot held at no generation has length 0: the step check refuses it
            served = (
                (self.held[episodes] == generations)
                & (self.revisions[episodes] == revisions)
                & (timesteps < self.lengths[episodes])
                & (self.touched[episodes] >= now - TOUCH_S)
            )
            picked = episodes if served.all() else episodes[served]
            if not len(picked):
                return np.empty((len(episodes), *field.shape), field.dtype), served
            steps = timesteps if len(picked) == len(episodes) else timesteps[served]
            addresses = self.addresses[picked] + steps * self.step_nbytes
            # the compiled copy from each item's address (the maps stay held under the lock)
            rows = gather_addresses(addresses, self.maps[int(picked[0])][0])
            if rows is None:  # not built: a fancy index over a view based at the lowest map
                lowest = int(np.argmin(addresses))
                base = self.maps[int(picked[lowest])][int(steps[lowest]) :]
                rows = take_at(base, addresses - addresses[lowest])
            if rows is None:  # a span of maps too wide for one view's size: one copy per item
                rows = np.stack([self.maps[s][t] for s, t in zip(picked.tolist(), steps.tolist())])
        if len(picked) == len(episodes):
            return rows, served
        out = np.empty((len(episodes), *field.shape), field.dtype)
        out[served] = rows
        return out, served

    def slices(
        self, spans: Spans, generations: np.ndarray, revisions: np.ndarray, now: float
    ) -> tuple[np.ndarray, list]:
        """(served, copies): per span, whether it is served (as in ``gather``: its slot held at
        its generation and revision, its steps within the length, the file touched less than ``TOUCH_S``
        ago; an empty span is served), and (span index, its rows in the map) per served span
        that has steps."""
        episodes, starts, lengths = spans.episodes, spans.starts, spans.lengths
        with self.lock:
            held = (
                (episodes >= 0)
                & (self.held[episodes] == generations)
                & (self.revisions[episodes] == revisions)
                & (starts >= 0)
                & (starts + lengths <= self.lengths[episodes])
                & (self.touched[episodes] >= now - TOUCH_S)
            )
            picked = np.flatnonzero(held & (lengths > 0))
            maps = self.maps
            copies = [
                (i, maps[e][t : t + n])
                for i, e, t, n in zip(
                    picked.tolist(), episodes[picked].tolist(), starts[picked].tolist(), lengths[picked].tolist()
                )
            ]
        return held | (lengths == 0), copies


def check_cache_size(cache_size: Any) -> None:
    """ValueError unless ``cache_size`` is a number of bytes >= 0 (an int, not a bool)."""
    if isinstance(cache_size, bool) or not isinstance(cache_size, (int, np.integer)) or cache_size < 0:
        raise ValueError(f"cache_size must be a number of bytes >= 0, got {cache_size!r}")


def default_cache_dir() -> str:
    """``$REPLAYBUF_CACHE_DIR`` when set, else the user's cache folder for replaybuf:
    platformdirs' when installed, else ``$XDG_CACHE_HOME/replaybuf`` or ``~/.cache/replaybuf``."""
    if os.environ.get("REPLAYBUF_CACHE_DIR"):
        return os.environ["REPLAYBUF_CACHE_DIR"]
    try:
        import platformdirs
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "replaybuf")
    return platformdirs.user_cache_dir("replaybuf", appauthor=False)


def cache_location(location: str) -> str:
    """``location`` as the cache keys it: an object store's URL in one spelling (s3a:// and
    S3:// name the same objects as s3://), a local path resolved (links, ``file://``)."""
    return object_store_url(location) or (
        location if is_url(location) else os.path.realpath(location.removeprefix("file://"))
    )


def buffer_identity(location: str, schema: Schema) -> str:
    """The name of a buffer's cache folder: a hash of its resolved location and its uuid (or,
    for a buffer created before uuids were stored, its whole config). A path's bytes as the file
    system holds them: a folder name that is not UTF-8 (Python's surrogate escapes) hashes too."""
    what = schema.uuid if schema.uuid is not None else json.dumps(schema.to_json(), sort_keys=True)
    key = f"{cache_location(location)}\0{what}".encode(errors="surrogateescape")
    return hashlib.sha256(key).hexdigest()[:24]


def owner_record(location: str, storage_options: dict, schema: Schema) -> dict:
    """What a buffer's cache folder records of its buffer (``OWNER_FILE``): the folder's name,
    the location as the cache keys it, the buffer's uuid, and the store the location is one
    of: the host for a local path (the same path on another machine sharing ``cache_dir``, a
    home folder on NFS, is another buffer), the endpoint for an object store (the same URL on
    another S3-compatible server is another bucket; on S3 also one named by the environment,
    ``AWS_ENDPOINT_URL``); None for other URLs (``memory://``: one
    per process), whose folders are never taken for replaced ones."""
    scope: str | None = None
    if object_store_url(location) is not None:
        endpoint = object_store_endpoint(location, storage_options)
        scope = f"endpoint {endpoint}" if endpoint else "endpoint default"
    elif not is_url(location):
        scope = f"host {socket.gethostname()}"
    return {
        "replaybuf_cache": 1,
        "folder": buffer_identity(location, schema),
        "location": cache_location(location),
        "scope": scope,
        "uuid": schema.uuid,
    }


def new_uuid() -> str:
    """A fresh buffer identity for the stored config."""
    return uuid_module.uuid4().hex


# the per-slot bookkeeping a cached storage keeps a view of: array name -> attribute
_VIEWS = {"_generation": "_generations", "_revision": "_revisions"}


class CachedStorage(Storage):
    """``inner`` with its data fields' committed rows served from raw files under
    ``cache_dir/<buffer identity>/`` (see the module docstring).

    Parameters
    ----------
    inner
        The storage holding the buffer (any backend, local or remote).
    cache_dir
        The folder holding the caches of all buffers (default: ``default_cache_dir()``).
    cache_size
        Bytes this buffer's cache may hold before least recently used episodes are evicted.
    snapshot
        Cache the reads of a writable ``inner`` too: for a dataset's reads of the episodes
        committed when it was made (``cache='ram'|'memmap'``), which, like any reader before its
        next refresh, are served as of the revision this layer first saw.
    """

    verifies_generations = True

    def __init__(
        self,
        inner: Storage,
        cache_dir: str | os.PathLike | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        snapshot: bool = False,
    ):
        check_cache_size(cache_size)
        folder = os.fspath(cache_dir) if isinstance(cache_dir, (str, os.PathLike)) else None
        if cache_dir is not None and (not isinstance(folder, str) or not folder):
            # '' would cache into the working directory, bytes fail a first fill unnamed
            raise ValueError(f"cache_dir must name a folder (a str or os.PathLike), got {cache_dir!r}")
        self.inner = inner
        self.closes_at_refresh = inner.closes_at_refresh  # its drop_caches drops the inner's
        self.location, self.storage_options, self.fsync = inner.location, inner.storage_options, inner.fsync
        # absolute now: a process that changes its directory later keeps the same folders, never
        # caches into new ones under its new working directory
        self.cache_dir = os.path.abspath(folder if folder is not None else default_cache_dir())
        self.cache_size = int(cache_size)
        self.snapshot = snapshot
        self.schema: Schema | None = None
        self._seed_warned = False  # ``open`` says once that a memmap-replay-buffer folder is not cached
        self._reset()

    def _reset(self) -> None:
        self._generations: np.ndarray | None = None
        self._revisions: np.ndarray | None = None
        # (2, max_episodes): each slot's stored length as last read through this layer, under the
        # generation this process then knew for the slot (-1: none known)
        self._lengths: np.ndarray | None = None
        self._maps: OrderedDict[tuple[str, int, int, int], tuple[np.ndarray, float]] = OrderedDict()
        self._checked: dict[str, tuple[int, int]] = {}  # path -> (inode, size) that passed its crc32c
        self._dense: dict[str, DenseRows | None] = {}
        self._mapped: dict[str, MappedRows] = {}
        self._lock = threading.Lock()
        self._used: int | None = None
        self._root: tuple[Schema, str] | None = None  # (the schema it was derived from, the folder)
        self._identity_checked = False  # ``load_state`` skips its identity check once after ``open``
        self._warned = False  # a full or unusable cache folder is reported once per process
        self._skip_fills_until = 0.0  # time.monotonic() until which fills are skipped (``_cannot_fill``)
        self._bounded = False  # ``_bound_once`` ran
        self._marked = False  # this layer found or wrote its folder's owner record (``_mark``)

    def __getstate__(self) -> dict:
        state = {**self.__dict__}
        for key in (
            "_generations",
            "_revisions",
            "_lengths",
            "_maps",
            "_checked",
            "_dense",
            "_mapped",
            "_lock",
            "_used",
            "_root",
            "_warned",
            "_skip_fills_until",
            "_bounded",
            "_marked",
        ):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def read_only(self) -> bool:
        return self.inner.read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        self.inner.read_only = value

    @property
    def keeps_meta_sums(self) -> bool:
        # docstring inherited: the wrapped storage's
        return self.inner.keeps_meta_sums

    @property
    def binds_shards(self) -> bool:
        # docstring inherited: the wrapped storage's
        return self.inner.binds_shards

    @property
    def sums_lengths(self) -> bool:
        # docstring inherited: the wrapped storage's
        return self.inner.sums_lengths

    @property
    def binds_meta_sums(self) -> bool:
        # docstring inherited: the wrapped storage's
        return self.inner.binds_meta_sums

    @property
    def early_hashing(self) -> str | None:
        # docstring inherited: the wrapped storage's
        return self.inner.early_hashing

    @property
    def meta_sums_as_earlier(self) -> bool:
        """The wrapped storage's (``Storage.meta_sums_as_earlier``): its checks and writes follow it."""
        return self.inner.meta_sums_as_earlier

    @meta_sums_as_earlier.setter
    def meta_sums_as_earlier(self, value: bool) -> None:
        self.inner.meta_sums_as_earlier = value

    @property
    def root(self) -> str:
        """This buffer's cache folder (known once the storage is opened)."""
        schema = self.schema
        if schema is None:
            raise RuntimeError(f"the cache of {self.location!r} has no folder before the storage is opened")
        if self._root is None or self._root[0] is not schema:  # once per open: a realpath and a hash
            self._root = (schema, os.path.join(self.cache_dir, buffer_identity(self.location, schema)))
        return self._root[1]

    # ---- the wrapped storage -------------------------------------------------------------------

    def exists(self) -> bool:
        return self.inner.exists()

    def create(self, schema: Schema, overwrite: bool) -> None:
        self.inner.create(schema, overwrite)
        self.schema = schema
        self._reset()

    def open(self, read_only: bool) -> Schema:
        self.schema = self.inner.open(read_only)
        self._reset()
        self._identity_checked = True  # the schema was read just now
        if self.inner.seed_may_write and not self._seed_warned:
            self._seed_warned = True  # once, not again in each DataLoader worker of a pickled copy
            warnings.warn(
                f"{self.location!r} is a memmap-replay-buffer folder, which that library may write without "
                "moving any slot's generation: its reads are not cached (its rows are raw files already); "
                "pass cache=False to open it without this warning",
                stacklevel=4,
            )
        return self.schema

    def load_state(self) -> dict:
        """The wrapped storage's counters, after checking (except right after ``open``) that the
        location still holds the buffer the cache folder belongs to: a buffer created there
        since (``overwrite=True``) reuses its slots and generations, so the cached rows of the
        old one would be served as its rows."""
        state = self.inner.load_state()
        if not self._identity_checked and self.schema is not None and self.schema.uuid is not None:
            now = self.inner.stored_uuid()
            if now is None and not self.inner.exists():
                raise BufferNotFoundError(
                    f"{self.location!r} no longer holds the buffer this reader opened (it was erased); "
                    "its cached rows are not served"
                )
            if now != self.schema.uuid:
                raise StorageError(
                    f"{self.location!r} holds another buffer (uuid {now}) than the one this reader opened "
                    f"(uuid {self.schema.uuid}): it was overwritten; its cached rows are not served, "
                    "open it again with from_folder"
                )
        self._identity_checked = False
        return state

    def array(self, name: str, meta: bool = False) -> ArrayLike:
        # docstring inherited: the wrapped storage's (only the layer's reads use the cache)
        return self.inner.array(name, meta)

    def data_file(self, name: str, meta: bool = False) -> str:
        """The file the wrapped storage keeps field ``name`` in, for error messages (memmap and
        hdf5); AttributeError where it keeps none (zarr: messages name the array's keys)."""
        return self.inner.data_file(name, meta)  # type: ignore[attr-defined]

    def read_blob(self, key: str, limit: int | None = None) -> bytes | None:
        return self.inner.read_blob(key, limit)

    def read_blob_head(self, key: str, nbytes: int) -> bytes | None:
        return self.inner.read_blob_head(key, nbytes)

    def write_blob(self, key: str, data: bytes) -> None:
        self.inner.write_blob(key, data)

    def delete_blobs(self, prefix: str) -> None:
        self.inner.delete_blobs(prefix)

    def list_blobs(self, prefix: str) -> list[str]:
        return self.inner.list_blobs(prefix)

    def read_meta(self, name: str) -> np.ndarray:
        values = self.inner.read_meta(name)
        if name in _VIEWS:
            setattr(self, _VIEWS[name], np.asarray(values, dtype=np.int64).copy())
        elif name == "episode_lens":
            self._remember_lengths(np.arange(len(values)), values)
        return values

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        values = self.inner.read_meta_rows(name, episodes)
        if name in _VIEWS:
            self._remember(np.asarray(episodes, dtype=np.int64).reshape(-1), values, name)
        elif name == "episode_lens":
            self._remember_lengths(np.asarray(episodes, dtype=np.int64).reshape(-1), values)
        return values

    def _remember_lengths(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Keep the stored lengths of ``slots`` with the generations this process knows for them
        now (none known: nothing kept), for ``_map`` to check a file's rows against."""
        if self._generations is None:
            return
        if self._lengths is None:
            self._lengths = np.full((2, len(self._generations)), -1, np.int64)
        self._lengths[0, slots] = self._generations[slots]
        self._lengths[1, slots] = np.asarray(values, dtype=np.int64).reshape(-1)

    def _stored_length(self, slot: int, generation: int) -> int | None:
        """The length stored for ``slot`` as last read through this layer, when the generation
        known then was ``generation`` (an episode's length never changes); else None."""
        if self._lengths is None or self._lengths[0, slot] != generation:
            return None
        return int(self._lengths[1, slot])

    def _remember(self, slots: np.ndarray, values: np.ndarray, name: str = "_generation") -> None:
        """Update this process's view of the slots' generations (``name``: or revisions; none
        held: nothing to update)."""
        known = getattr(self, _VIEWS[name])
        if known is not None:
            known[slots] = values

    def fresh(self) -> CachedStorage:
        # docstring inherited
        return CachedStorage(self.inner.fresh(), self.cache_dir, self.cache_size, self.snapshot)

    def replaced(self, cheap_only: bool = False) -> bool:
        # docstring inherited: the wrapped storage's
        return self.inner.replaced(cheap_only)

    def drop_caches(self) -> None:
        """Forget the slots' generations and revisions this process knows, and the maps whose
        files are gone (evicted by another process: their disk space is given back once
        unmapped). The other maps stay, as the files and in-RAM copies do: each is one
        version's (slot, generation and revision), never served for another. Mapping every file
        again at each refresh (each loader a reader makes) cost its page tables again: warm
        timestep batches with a new loader every 35 ran at 0.6-0.8x the speed of kept maps."""
        self.inner.drop_caches()
        with self._lock:
            self._generations = self._revisions = None
            for key in [key for key in self._maps if not os.path.exists(self._path(*key))]:
                self._forget_map(key)

    def close(self) -> None:
        self.inner.close()
        with self._lock:
            self._maps.clear()
            self._dense.clear()
            self._mapped.clear()

    def describe(self) -> dict:
        return {**self.inner.describe(), "cache": self.root if self.schema is not None else None}

    # ---- cached reads ------------------------------------------------------------------------

    def _cached(self, name: str) -> bool:
        return (
            (self.read_only or self.snapshot)
            and self.schema is not None
            and name in self.schema.fields
            and not self.inner.seed_may_write  # a seed write would leave its files stale
        )

    def _field(self, name: str) -> Field:
        """The data field ``name`` of the opened storage's schema."""
        assert self.schema is not None  # cached reads run on an opened storage (see ``_cached``)
        return self.schema.fields[name]

    def rows(
        self, name: str, episodes: Sequence[int] | np.ndarray, generations: Sequence[int] | np.ndarray | None = None
    ) -> dict[int, np.ndarray]:
        """Slot -> the committed rows (length, *shape) of every slot among ``episodes`` that
        holds an episode, mapped from the cache and filled first where absent: at
        ``generations`` (one per episode) when given, else at the generation this process last
        saw for the slot. A slot whose fill found another generation is left out."""
        slots, planned, _ = self._slots(episodes, generations)
        found = self._rows(name, slots, planned)
        return {slot: rows for (slot, _), rows in found.items()}

    def _slots(
        self, episodes: Sequence[int] | np.ndarray, generations: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct slots of ``episodes``, the generation each is read at (the planned one,
        else this process's view; a read plans one generation per slot) and, per item, the
        index of its slot."""
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        slots, first, inverse = np.unique(episodes, return_index=True, return_inverse=True)
        if generations is None:
            planned = self._known_generations()[slots]
        else:
            planned = np.broadcast_to(np.asarray(generations, dtype=np.int64).reshape(-1), episodes.shape)[first]
        return slots, planned, inverse.reshape(-1)

    def _planned(self, episodes: np.ndarray, generations: Any) -> np.ndarray:
        """Per item, the generation it is read at: ``generations`` (one per item, or one for
        all) when given, else this process's view of its slot."""
        if generations is None:
            return self._known_generations()[episodes]
        planned = np.asarray(generations, dtype=np.int64)
        return planned if planned.shape == episodes.shape else np.broadcast_to(planned, episodes.shape)

    def _map_slots_of(self, name: str, episodes: np.ndarray, planned: np.ndarray, served: np.ndarray) -> np.ndarray:
        """The indices of the items not ``served``, after mapping their slots at their planned
        generations (filling the cache first where absent) or touching their files."""
        rest = np.flatnonzero(~served)
        slots, first = np.unique(episodes[rest], return_index=True)
        self._rows(name, slots, planned[rest][first])
        return rest

    def _known_generations(self) -> np.ndarray:
        """This process's view of every slot's generation (loaded on first use)."""
        if self._generations is None:
            self._generations = np.asarray(self.inner.read_meta("_generation"), dtype=np.int64).copy()
        return self._generations

    def _known_revisions(self) -> np.ndarray:
        """This process's view of every slot's revision (loaded on first use)."""
        if self._revisions is None:
            self._revisions = np.asarray(self.inner.read_meta("_revision"), dtype=np.int64).copy()
        return self._revisions

    def _dense_rows(self, name: str) -> DenseRows | None:
        """The in-RAM copy of field ``name`` when it is small enough (``DENSE_BYTES``); the
        answer is kept (asked per gather)."""
        if name not in self._dense:
            assert self.schema is not None
            field, schema = self._field(name), self.schema
            small = schema.max_episodes * schema.max_timesteps * field.step_nbytes <= DENSE_BYTES
            with self._lock:
                self._dense.setdefault(
                    name, DenseRows(field, schema.max_episodes, schema.max_timesteps) if small else None
                )
        return self._dense[name]

    def _mapped_rows(self, name: str) -> MappedRows:
        """This process's index of field ``name``'s maps (made on first use)."""
        mapped = self._mapped.get(name)
        if mapped is None:
            assert self.schema is not None
            with self._lock:
                mapped = self._mapped.setdefault(name, MappedRows(self._field(name), self.schema.max_episodes))
        return mapped

    def _rows(self, name: str, slots: np.ndarray, generations: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
        """(slot, generation) -> cached rows for each of the distinct ``slots`` with a
        generation > 0 that is (or, after a fill, has become) cached at the revision this
        process knows for the slot (a slot known at an odd revision, an edit running, is not);
        each is also indexed for gathers (``MappedRows``)."""
        if not self._bounded:
            self._bound_once()
        out, touched, missing = {}, {}, []
        revisions = dict(zip(slots.tolist(), self._known_revisions()[slots].tolist()))
        now = time.monotonic()
        with self._lock:
            for slot, generation in zip(slots.tolist(), generations.tolist()):
                key = (name, slot, generation, revisions[slot])
                if generation <= 0 or key[3] % 2:
                    continue
                entry = self._maps.get(key)
                if entry is None:
                    missing.append(key[1:])
                    continue
                self._maps.move_to_end(key)
                if now - entry[1] > TOUCH_S:
                    if not self._touch(*key):  # evicted by another process: mapped again or filled
                        self._forget_map(key)
                        missing.append(key[1:])
                        continue
                    entry = self._maps[key] = (entry[0], now)
                out[slot, generation], touched[slot, generation] = entry
        opened = [(*version, self._map(name, *version)) for version in missing]
        absent = [version for *version, rows in opened if rows is None]
        if absent and now >= self._skip_fills_until:
            try:
                self._fill(name, *(np.array(column, dtype=np.int64) for column in zip(*absent)))
            except CacheFolderError as e:
                self._cannot_fill(e.error)
            opened += [(*version, self._map(name, *version)) for version in absent]
        mapped = self._mapped_rows(name)
        with self._lock:
            for slot, generation, revision, rows in opened:
                if rows is not None:
                    out[slot, generation], touched[slot, generation] = rows, now
                    self._maps[name, slot, generation, revision] = (rows, now)
            for (slot, generation), rows in out.items():
                mapped.put(slot, generation, revisions[slot], rows, touched[slot, generation])
            while len(self._maps) > MAX_OPEN_MAPS:
                self._forget_map(next(iter(self._maps)))
        dense = self._dense_rows(name)
        if dense is not None:
            for (slot, generation), rows in out.items():
                dense.put(slot, generation, revisions[slot], rows)
        return out

    def _bound_once(self) -> None:
        """Before this layer's first map: evict down to ``cache_size`` when the folder's count
        says it holds more (filled by runs with a larger ``cache_size``). Only fills scan the
        folder otherwise, so a reader whose episodes are all cached would leave it over the
        bound for good. One read of the count; the scan only when over."""
        self._bounded = True
        self._remove_replaced()
        try:
            with _in_cache_folder():
                self._folder(".locks", make=False)  # plain folders only, never followed
                try:
                    self._mark()  # a folder made before owner records: read, so marked as live
                except OSError:
                    pass  # a cache_dir this process may not write: its files are still served
                fd = os.open(os.path.join(self.root, ".locks", USAGE_FILE), os.O_RDONLY | OPEN_FLAGS)
                try:
                    counted = _read_count(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
                finally:
                    os.close(fd)
                if counted is not None and counted > self.cache_size:
                    self._account(0)
        except CacheFolderError as e:
            if e.error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO):
                self._cannot_fill(e.error)  # nothing counted yet (no folder, no file) is no error

    def _forget_map(self, key: tuple[str, int, int, int]) -> None:
        """Stop serving the map of ``key`` (name, slot, generation, revision); ``_lock`` held.
        The map closes once no batch uses it: an evicted file's disk space is given back then."""
        rows, _ = self._maps.pop(key)
        self._mapped[key[0]].drop(key[1], rows)

    def _cannot_fill(self, error: OSError) -> None:
        """After a fill the cache folder refused with ``error``: its slots are read from the
        wrapped storage. A folder deleted meanwhile (another process clearing the cache) is
        filled again by the next read; any other error (no room, a symlinked folder, one the
        process may not write) skips fills for ``FULL_RETRY_S`` (each would fail the same way,
        for nothing) and is warned once per process: a cache never fails a read."""
        if error.errno == errno.ENOENT:
            return
        self._skip_fills_until = time.monotonic() + FULL_RETRY_S
        if not self._warned:
            self._warned = True
            if error.errno in NO_ROOM:
                why = f"is full ({error.strerror}): episodes it could not hold are read from the store; free "
                hint = "space there or pass a smaller cache_size"
            else:
                why = f"cannot be used ({error}): episodes are read from the store; "
                hint = "pass a cache_dir this process may write, or cache=False"
            warnings.warn(f"the read cache {self.root!r} {why}{hint}", stacklevel=4)

    def _verified(self, read: Callable[[], Any], episodes: np.ndarray, generations: np.ndarray | None) -> Any:
        """``read()`` from the wrapped storage; with ``generations`` (one per episode), the
        slots' generations are read afterwards and a slot found at another one refuses the
        read (GenerationMismatchError): this layer ``verifies_generations``."""
        result = read()
        if generations is not None and len(episodes):
            slots, first = np.unique(np.asarray(episodes, dtype=np.int64), return_index=True)
            now = np.asarray(self.inner.read_meta_rows("_generation", slots), dtype=np.int64)
            self._remember(slots, now)
            moved = slots[now != np.broadcast_to(np.asarray(generations, dtype=np.int64), len(episodes))[first]]
            if len(moved):
                raise GenerationMismatchError(self.location, moved)
        return result

    def _path(self, name: str, slot: int, generation: int, revision: int) -> str:
        """The file of the slot's rows at (generation, revision); never edited: ``slot-generation``."""
        version = f"{generation}-{revision}" if revision else f"{generation}"
        return os.path.join(self.root, name, f"{slot}-{version}{SUFFIX}")

    def _check_value(self, path: str, rows: np.ndarray) -> int:
        """The crc32c a cache file ends with: of its name within the cache (buffer, field, slot,
        generation, revision), then its rows, so the file of another episode, field or buffer
        moved or copied into its place fails the check like a damaged one."""
        return crc32c(rows, crc32c(os.path.relpath(path, self.cache_dir).encode()))

    def _touch(self, name: str, slot: int, generation: int, revision: int) -> bool:
        """Mark the file used now (its LRU clock); False when it is gone (evicted, the folder
        deleted)."""
        try:
            os.utime(self._path(name, slot, generation, revision), follow_symlinks=False)
        except OSError:
            return False
        return True

    def _folder(self, name: str, make: bool = True) -> str:
        """This buffer's cache folder ``name`` (a field's, ``.locks``), made with the buffer's
        folder where absent (``make``); OSError when either is not a plain directory (a symlink
        to a user's folder, say: the cache writes, touches and deletes only in folders it made)."""
        if make:
            self._check_outside_buffer()
            try:
                os.makedirs(self.cache_dir, exist_ok=True)  # the user's: a symlink there is theirs to make
            except (FileExistsError, NotADirectoryError):  # said as "File exists": named here
                raise NotADirectoryError(
                    errno.ENOTDIR, "cache_dir is a file or lies under one, not a folder", self.cache_dir
                ) from None
        path = os.path.join(self.root, name)
        made = False
        for folder in (self.root, path):
            if make:
                try:
                    os.mkdir(folder)
                    made = True
                except FileExistsError:
                    pass
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise OSError(
                    errno.ENOTDIR, "not a plain directory (a symlink?): the cache uses only folders it made", folder
                )
        if make and (made or not self._marked):  # made again after a sweep: marked again
            self._mark()
        return path

    def _mark(self) -> None:
        """Write the folder's owner record (``OWNER_FILE`` in ``.locks``, made where absent)
        unless one is there: a temp file renamed into place, so a record is whole or absent."""
        try:
            os.mkdir(os.path.join(self.root, ".locks"))
        except FileExistsError:
            pass
        locks = self._folder(".locks", make=False)  # plain folders only, never followed
        path = os.path.join(locks, OWNER_FILE)
        if not os.path.lexists(path):
            assert self.schema is not None  # a folder is named once the storage is opened
            temp = os.path.join(locks, f"{OWNER_FILE}.tmp-{os.getpid()}-{threading.get_ident()}")
            record = json.dumps(owner_record(self.location, self.storage_options, self.schema)).encode()
            _publish(temp, path, record)
        self._marked = True

    def _remove_replaced(self) -> None:
        """Remove the cache folders of the buffers this one replaced: those whose owner record
        names this buffer's location and store but another folder (another uuid: a buffer
        created there before with ``overwrite=True``, whose rows nobody can be served again).
        Once per process and folder, and only while the location holds this buffer (its uuid
        read afresh: a reader opened before the buffer was created again never removes the
        new one's folder); folders without a record (the user's, or made before records were
        written) are left, as is any entry the cache did not make."""
        schema = self.schema
        assert schema is not None  # run by the first read of an opened storage
        owner = owner_record(self.location, self.storage_options, schema)
        key = (self.cache_dir, owner["folder"])
        if owner["scope"] is None or schema.uuid is None or key in _SWEPT:
            return
        _SWEPT.add(key)
        if self.inner.stored_uuid() != schema.uuid:
            return  # replaced since this reader opened it: its next refresh says so
        try:
            entries = _entries(self.cache_dir)
        except OSError:
            return  # a cache_dir that is a file, or one this process may not list: nothing of ours
        for entry in entries:
            if entry.name != owner["folder"]:
                _remove_if_replaced(self.cache_dir, entry.name, owner)

    def _check_outside_buffer(self) -> None:
        """OSError when the cache folder lies in a local buffer's own folder (``cache_dir`` the
        buffer's path, or one under it): a reader writes nothing in the buffer's folder, whose
        writer would find the cache's files there as entries not its own."""
        if "://" in self.location and not self.location.startswith("file://"):
            return
        buffer = os.path.realpath(self.location.removeprefix("file://"))
        if os.path.commonpath([buffer, os.path.realpath(self.cache_dir)]) == buffer:
            raise OSError(
                errno.EINVAL, f"it is in the folder of the buffer {buffer!r}, which readers never write", self.cache_dir
            )

    def _map(self, name: str, slot: int, generation: int, revision: int) -> np.ndarray | None:
        """The cached rows of the slot's generation and revision, mapped read-only; None when
        not cached."""
        field = self._field(name)
        assert self.schema is not None  # as in ``_field``
        most = self.schema.max_timesteps * field.step_nbytes  # the bytes of the longest episode
        path = self._path(name, slot, generation, revision)
        try:
            self._folder(name, make=False)
            fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
        except OSError as e:  # absent, or in no folder of the cache's own (the fill says so)
            if e.errno == errno.ELOOP:
                _unlink(path)  # a symlink: removed, never followed
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size - CHECK_BYTES
            # a healthy file is a plain file of whole rows (at most max_timesteps) and a checksum
            if not stat.S_ISREG(st.st_mode) or not 0 < size <= most or size % field.step_nbytes:
                _unlink(path)  # damaged: fetched again by the caller
                return None
            mapped = map_file(fd, size + CHECK_BYTES)
        except (OSError, ValueError):  # not mappable, or cut meanwhile
            return None
        finally:
            os.close(fd)
        # a plain array over the map (it keeps the map alive): indexing an np.memmap costs a
        # subclass round trip per call, paid once per sampled episode per field
        rows = mapped[:size]
        identity = (st.st_ino, st.st_size)
        # a file is checked once per layer (maps come and go), so each new layer (a loader's own
        # cache='ram' one) checks it again: damage made since another layer's check is caught
        if self._checked.get(path) != identity:
            if self._check_value(path, rows) != int.from_bytes(mapped[size:].tobytes(), "little"):
                _unlink(path)  # damaged: fetched again by the caller
                return None
            if len(self._checked) >= MAX_CHECKED:
                self._checked.clear()
            self._checked[path] = identity
        if self._stored_length(slot, generation) not in (None, size // field.step_nbytes):
            return None  # the stored length disagrees with the episode's rows: the wrapped storage's read names it
        self._touch(name, slot, generation, revision)
        return rows.view(field.dtype).reshape(size // field.step_nbytes, *field.shape)

    def _fill(self, name: str, slots: np.ndarray, generations: np.ndarray, revisions: np.ndarray) -> None:
        """Fetch and publish the slots no other filler is fetching now, then wait for the others
        (their files are mapped by the caller; a filler that died or is stuck past
        ``FILL_WAIT_S`` leaves them to be read from the wrapped storage)."""
        with _in_cache_folder():
            locks = self._folder(".locks")
        held, busy, mine = [], [], []
        try:
            for i, slot in enumerate(slots.tolist()):
                fd = _open_lock(os.path.join(locks, f"{name}-{slot}"))
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        busy.append(fd)
                        continue
                    held.append(fd)
                if not os.path.exists(self._path(name, slot, int(generations[i]), int(revisions[i]))):
                    mine.append(i)  # not published by a filler that held the lock before
            if mine:
                self._fetch(name, slots[mine], generations[mine], revisions[mine])
        except BaseException:
            for fd in busy:
                os.close(fd)
            raise
        finally:
            for fd in held:
                os.close(fd)
        deadline = time.monotonic() + FILL_WAIT_S
        for fd in busy:
            try:
                _wait_for_lock(fd, deadline)
            finally:
                os.close(fd)

    def _fetch(self, name: str, slots: np.ndarray, generations: np.ndarray, revisions: np.ndarray) -> None:
        """Read the committed rows of ``slots`` (expected at ``generations`` and even
        ``revisions``) from the wrapped storage in one bulk read, past every copy it kept of
        them (``drop_cached_rows``), and publish each as a file
        (temp file, then rename) when its slot held both before and after the read. A slot
        the writer reuses during the read is left out, the others read again: a verifying read
        names it (GenerationMismatchError), another read may fail to decode it."""
        before = self._versions(slots)
        lens = np.asarray(self.inner.read_meta_rows("episode_lens", slots), dtype=np.int64)
        ok = (before == (generations, revisions)).all(axis=0) & (lens > 0)
        slots, generations, revisions, lens = slots[ok], generations[ok], revisions[ok], lens[ok]
        if not len(slots):
            return
        # what this process kept of the rows is keyed by generation: it may predate an edit
        # (the revisions were learnt by another read since), and must not fill the new file
        self.inner.drop_cached_rows(name, slots)
        field = self._field(name)
        out = np.empty((len(slots), int(lens.max()), *field.shape), dtype=field.dtype)
        while True:  # each pass leaves out at least one slot
            try:
                starts = np.zeros(len(slots), np.int64)
                self.inner.read_spans(name, slots, starts, lens, out[: len(slots)], generations=generations)
                break
            except BufferReplacedError:
                raise
            except Exception as error:
                if isinstance(error, GenerationMismatchError):
                    moved = np.isin(slots, error.slots)
                else:  # an error with no slot moved is the store's: raised
                    moved = (self._versions(slots) != (generations, revisions)).any(axis=0)
                if not moved.any():
                    raise
                slots, generations, revisions, lens = (a[~moved] for a in (slots, generations, revisions, lens))
                if not len(slots):
                    return
        after = self._versions(slots)
        with _in_cache_folder():  # from here on only the cache folder's files are written
            folder = self._folder(name)
            written = 0
            try:
                for i in np.flatnonzero((after == (generations, revisions)).all(axis=0)):
                    slot, generation, revision = int(slots[i]), int(generations[i]), int(revisions[i])
                    temp = os.path.join(folder, f".tmp-{slot}-{generation}-{os.getpid()}-{threading.get_ident()}")
                    rows = np.ascontiguousarray(out[i, : lens[i]]).view(np.uint8).reshape(-1)
                    path = self._path(name, slot, generation, revision)
                    check = self._check_value(path, rows).to_bytes(CHECK_BYTES, "little")
                    written_file = _publish(temp, path, rows.data, check)
                    self._checked[path] = (written_file.st_ino, written_file.st_size)  # its map needs no check
                    written += rows.nbytes + CHECK_BYTES
            finally:
                self._account(written)

    def _versions(self, slots: np.ndarray) -> np.ndarray:
        """(2, len(slots)): the slots' generations and revisions as stored now (both remembered)."""
        versions = np.stack([np.asarray(self.inner.read_meta_rows(n, slots), dtype=np.int64) for n in _VIEWS])
        for name, values in zip(_VIEWS, versions):
            self._remember(slots, values, name)
        return versions

    def _account(self, written: int) -> None:
        """Count ``written`` bytes and evict least recently used files while over ``cache_size``.
        The count is the folder's, shared by every process filling it (``USAGE_FILE``, read and
        written under its ``flock``): a count of this process's own writes alone let N fillers
        (processes, loader workers) take ~N x ``cache_size``. A whole scan of the folder runs at
        this process's first fill (it also sweeps the temp files of killed fillers) and when the
        count says the folder may be over; where the usage file cannot be used (an odd entry,
        held past ``USAGE_WAIT_S``) this process counts its own writes."""
        fd = _open_lock(os.path.join(self.root, ".locks", USAGE_FILE))
        if fd is not None and not _wait_for_lock(fd, time.monotonic() + USAGE_WAIT_S):
            os.close(fd)
            fd = None
        try:
            counted = self._used if fd is None else _read_count(fd)
            if self._used is not None and counted is not None and counted + written <= self.cache_size:
                self._used = counted + written
            else:
                self._used = self._evict()
            if fd is not None:
                os.pwrite(fd, self._used.to_bytes(8, "little"), 0)
        finally:
            if fd is not None:
                os.close(fd)  # the lock goes with it

    def _evict(self) -> int:
        """Scan the folder, evict least recently used files when over ``cache_size`` (down to
        ``EVICT_TO`` of it) and return the bytes of the files kept."""
        files, now = [], time.time()
        for folder in _entries(self.root):  # checked a plain directory by the fill (``_folder``)
            if folder.name == ".locks" or not folder.is_dir(follow_symlinks=False):
                continue  # a symlinked folder is not the cache's; the locks (one per slot) hold no rows
            for entry in _entries(folder.path):
                try:
                    found = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(found.st_mode):
                    continue  # never one of the cache's files
                if entry.name.startswith(".tmp-"):
                    if now - found.st_mtime > STALE_TEMP_S or self._filler_died(folder.name, entry.name):
                        _unlink(entry.path)
                elif entry.name.endswith(OLD_SUFFIX):
                    _unlink(entry.path)
                elif entry.name.endswith(SUFFIX):
                    files.append((found.st_mtime, found.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        kept = {path for _, _, path in files}
        target = self.cache_size if total <= self.cache_size else int(self.cache_size * EVICT_TO)
        for _, size, path in sorted(files):
            if total <= target:
                break
            _unlink(path)
            kept.discard(path)
            total -= size
        # a deleted file's blocks stay taken while a map holds it: this process's maps of the
        # files gone (evicted now, or by another process) go, or cache_size would bound nothing
        with self._lock:
            for key in [key for key in self._maps if self._path(*key) not in kept]:
                self._forget_map(key)
        return total

    def _filler_died(self, name: str, temp: str) -> bool:
        """Whether the temp file ``temp`` of field ``name`` was left by a filler that died: a live
        one holds its slot's lock from its fetch to its rename (this process's own fills too, on
        another descriptor), so a lock nobody holds means nobody will finish the file."""
        slot = temp.split("-")[1]  # .tmp-<slot>-<generation>-<pid>-<thread>
        fd = _open_lock(os.path.join(self.root, ".locks", f"{name}-{slot}"))
        if fd is None:  # no lock to ask (filled unlocked): left to STALE_TEMP_S
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    def gather(
        self, name: str, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        if not self._cached(name):
            return self._verified(
                lambda: self.inner.gather(name, episodes, timesteps, generations), episodes, generations
            )
        episodes, timesteps = np.asarray(episodes, dtype=np.int64), np.asarray(timesteps, dtype=np.int64)
        planned = self._planned(episodes, generations)
        dense = self._dense_rows(name)
        if dense is not None:
            rows = dense.gather(episodes, timesteps, planned, self._known_revisions()[episodes])
            if rows is not None:
                return rows
        mapped, now = self._mapped_rows(name), time.monotonic()
        out, served = mapped.gather(episodes, timesteps, planned, self._known_revisions()[episodes], now)
        if served.all():
            return out
        # the items not served are gathered again once their slots are mapped (as of ``now``:
        # just touched is fresh); what is still missing (steps past a cached length, a fill
        # that found the slot reused) is read from the wrapped storage
        rest = self._map_slots_of(name, episodes, planned, served)
        again, now_served = mapped.gather(
            episodes[rest], timesteps[rest], planned[rest], self._known_revisions()[episodes[rest]], now
        )
        out[rest[now_served]] = again[now_served]
        rest = rest[~now_served]
        if len(rest):
            wanted = None if generations is None else planned[rest]
            out[rest] = self._verified(
                lambda: self.inner.gather(name, episodes[rest], timesteps[rest], wanted), episodes[rest], wanted
            )
        return out

    def _read_spans(
        self, name: str, spans: Spans, out: np.ndarray, parallel: bool, generations: np.ndarray | None
    ) -> None:
        # docstring inherited
        served = np.zeros(len(spans), dtype=bool)
        if self._cached(name):
            planned = self._planned(spans.episodes, generations)
            mapped, now = self._mapped_rows(name), time.monotonic()
            served, copies = mapped.slices(
                spans, planned, self._known_revisions()[spans.episodes], now
            )  # copied below, on the pool when large
            if not served.all():  # as in ``gather``
                rest = self._map_slots_of(name, spans.episodes, planned, served)
                again, more = mapped.slices(
                    spans[rest], planned[rest], self._known_revisions()[spans.episodes[rest]], now
                )
                served[rest] = again
                copies += [(int(rest[k]), rows) for k, rows in more]

            def copy(k: int) -> None:
                i, rows = copies[k]
                out[i, : len(rows)] = rows

            copy_spans(len(copies), copy, sum(rows.nbytes for _, rows in copies), parallel)
        rest = np.flatnonzero(~served)
        if not len(rest):
            return
        whole = len(rest) == len(spans)  # nothing served here: the wrapped storage reads into ``out``
        part, wanted = (out, spans) if whole else (out[rest], spans[rest])
        named = None if generations is None else np.broadcast_to(generations, served.shape)[rest]
        self._verified(
            lambda: self.inner.read_spans(name, wanted.episodes, wanted.starts, wanted.lengths, part, parallel, named),
            wanted.episodes,
            named,
        )
        if not whole:
            out[rest] = part

    def read_rows(
        self, name: str, episodes: np.ndarray, t0: int, t1: int, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        if not self._cached(name):
            return self._verified(
                lambda: self.inner.read_rows(name, episodes, t0, t1, generations), episodes, generations
            )
        field = self._field(name)
        episodes = np.asarray(episodes, dtype=np.int64)
        out = np.empty((len(episodes), t1 - t0, *field.shape), dtype=field.dtype)
        count = len(episodes)
        self.read_spans(name, episodes, np.full(count, t0), np.full(count, t1 - t0), out, generations=generations)
        return out

    def warm(self, slots: np.ndarray, fields: Sequence[str], progress: bool | None = None) -> None:
        """Fill the cache for ``slots`` (committed ones) and ``fields`` ahead of reads."""
        from ..progress import progress_bar

        with progress_bar(progress, total=len(slots) * len(fields), desc="warm cache", unit="episode") as bar:
            for name in fields:
                for lo in range(0, len(slots), WARM_BATCH):
                    part = slots[lo : lo + WARM_BATCH]
                    self.rows(name, part)
                    bar.update(len(part))

    def __repr__(self) -> str:
        return f"CachedStorage({self.inner!r}, cache_dir={self.cache_dir!r})"


#: (cache_dir, folder) whose replaced siblings this process removed (``_remove_replaced``)
_SWEPT: set[tuple[str, str]] = set()


def _remove_if_replaced(cache_dir: str, name: str, owner: dict) -> None:
    """Remove the cache folder ``name`` of ``cache_dir`` when its owner record names the
    location and store of ``owner`` (the record of the buffer there now): its cache files
    (``SUFFIX``, ``OLD_SUFFIX``, temp files) and field folders, its lock files, then its record
    and itself. Every folder is opened without following a symlink and every entry removed
    through it, so nothing outside the folder is reached even if it is swapped meanwhile; an
    entry the cache did not make (a symlink, a user's file) keeps the folder and its record,
    for the next sweep. A process still reading the replaced buffer keeps its maps (an unlinked
    file stays readable) and reads the rest from the store, as from any deleted folder."""
    try:
        root = os.open(os.path.join(cache_dir, name), FOLDER_FLAGS)
    except OSError:
        return  # a symlink, a file, gone: never the cache's folder
    try:
        locks = _open_folder(root, ".locks")
        if locks is None:
            return
        try:
            record = _read_owner(locks)
            if record is None or record.get("folder") != name:
                return  # not a folder of the cache's (or its record was moved here)
            if (record.get("location"), record.get("scope")) != (owner["location"], owner["scope"]):
                return
            for entry in _entries_of(root):
                if entry.name != ".locks" and entry.is_dir(follow_symlinks=False):
                    _remove_folder_of(root, entry.name, _is_cache_file)
            if {entry.name for entry in _entries_of(root)} != {".locks"}:
                return  # something the cache did not make is left: so are the folder and its record
            _remove_files(locks, _is_lock_file)
            if {entry.name for entry in _entries_of(locks)} != {OWNER_FILE}:
                return
            os.unlink(OWNER_FILE, dir_fd=locks)
        finally:
            os.close(locks)
        os.rmdir(".locks", dir_fd=root)
        os.rmdir(os.path.join(cache_dir, name))  # never a symlink's target: rmdir does not follow one
    except OSError:
        pass  # removed meanwhile, or filled again by a reader of the replaced buffer: left
    finally:
        os.close(root)


def _publish(temp: str, path: str, *parts: bytes | memoryview) -> os.stat_result:
    """Write ``parts`` to a new file ``temp`` and rename it to ``path``, so ``path`` is whole or
    absent; returns the written file's stat. A ``temp`` left by a killed process of the same id
    is made anew, never followed; one the disk had no room for is never left behind."""
    _unlink(temp)
    try:
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644), "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            result = os.fstat(f.fileno())
        os.replace(temp, path)
    except BaseException:
        _unlink(temp)
        raise
    return result


def _entries_of(folder: int) -> list[os.DirEntry]:
    """The entries of the folder ``folder`` (a descriptor)."""
    with os.scandir(folder) as entries:
        return list(entries)


def _open_folder(parent: int, name: str) -> int | None:
    """A descriptor of the plain folder ``name`` in the folder ``parent`` (a descriptor); None
    when it is absent or no plain folder."""
    try:
        return os.open(name, FOLDER_FLAGS, dir_fd=parent)
    except OSError:
        return None


def _read_owner(locks: int) -> dict | None:
    """The owner record in the ``.locks`` folder ``locks`` (a descriptor); None when there is
    none, or anything else than a plain file holding a JSON object."""
    try:
        fd = os.open(OWNER_FILE, os.O_RDONLY | OPEN_FLAGS, dir_fd=locks)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        record = json.loads(os.read(fd, OWNER_MAX_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return record if isinstance(record, dict) and record.get("replaybuf_cache") == 1 else None


def _is_cache_file(name: str) -> bool:
    """Whether ``name`` in a field's folder is one the cache writes (rows, temp files)."""
    return name.endswith((SUFFIX, OLD_SUFFIX)) or name.startswith(".tmp-")


def _is_lock_file(name: str) -> bool:
    """Whether ``name`` in ``.locks`` is one the cache writes, besides its owner record."""
    return name == USAGE_FILE or name.startswith(f"{OWNER_FILE}.tmp-") or LOCK_NAME.fullmatch(name) is not None


def _remove_files(folder: int, ours: Callable[[str], bool]) -> None:
    """Unlink the plain files of the folder ``folder`` (a descriptor) whose names are ``ours``."""
    for entry in _entries_of(folder):
        if ours(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.name, dir_fd=folder)
            except FileNotFoundError:
                pass


def _remove_folder_of(parent: int, name: str, ours: Callable[[str], bool]) -> None:
    """Remove the plain folder ``name`` of ``parent`` (a descriptor) after its files that are
    ``ours``; one that holds anything else stays."""
    folder = _open_folder(parent, name)
    if folder is None:
        return
    try:
        _remove_files(folder, ours)
    finally:
        os.close(folder)
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError:
        pass


def _unlink(path: str) -> None:
    """Remove the cache's entry ``path`` (never what a symlink there points to), as far as it can:
    one left behind is never served (``_map`` checks each file it maps)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _entries(folder: str) -> list[os.DirEntry]:
    """The entries of ``folder``; none when it was deleted meanwhile."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def _wait_for_lock(fd: int, deadline: float) -> bool:
    """Wait until the lock on ``fd`` is free (another filler finished) or ``deadline``
    (``time.monotonic``) passes, whichever comes first; whether it was taken."""
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _read_count(fd: int) -> int | None:
    """The byte count held by the usage file ``fd`` (its first 8 bytes); None when it holds
    none (made just now, or cut short: a scan counts the folder again). A damaged count is
    corrected by the scan it sets off (too high) or by the first scan of the next process to
    fill (too low)."""
    data = os.pread(fd, 8, 0)
    return int.from_bytes(data, "little") if len(data) == 8 else None


def _open_lock(path: str) -> int | None:
    """A descriptor of the lock file ``path`` (made when absent), or None when the entry there is
    no plain file (a symlink, a FIFO, a directory) or cannot be opened: its episode is then
    filled unlocked (a lock only spares a second fetch of the same episode)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o644)
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


_FORWARDED = (
    "check_creatable",
    "check_schema",
    "commit_state",
    "append_log",
    "read_log",
    "log_pieces",
    "log_size",
    "log_names",
    "clear_log",
    "copy_log_aside",
    "time_chunk",
    "plan_generations",
    "write_rows",
    "write_tail_rows",
    "update_rows",
    "write_meta",
    "writer_lease",
    "acquire_writer",
    "release_writer",
    "flush",
    "links",
    "describe_key",
    "unstored_meta_slots",
)


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` of the wrapped storage."
    return method


# the wrapped storage's name and capabilities, read from it
_FORWARDED_ATTRIBUTES = ("backend_name", "supports_remote", "supports_field_codecs", "is_local", "seed_may_write")

for _name in _FORWARDED:
    setattr(CachedStorage, _name, _forward(_name))
for _name in _FORWARDED_ATTRIBUTES:
    setattr(CachedStorage, _name, property(attrgetter(f"inner.{_name}"), doc=f"``{_name}`` of the wrapped storage."))


def with_cache(
    storage: Storage,
    read_only: bool,
    cache: bool | str | None,
    cache_dir: str | os.PathLike | None,
    cache_size: int,
) -> Storage:
    """``storage`` behind a ``CachedStorage`` when the buffer's ``cache`` arguments ask for one:
    ``cache='disk'`` (or True, or a ``cache_dir``) for a read-only buffer anywhere; by default
    (``cache=None``) for read-only buffers on object stores; never with ``cache=False``."""
    if cache not in (None, True, False, "disk"):
        raise ValueError(f"cache must be 'disk', True, False or None (automatic), got {cache!r}")
    check_cache_size(cache_size)  # refused even where no cache is made: never silently ignored
    asked = cache in (True, "disk") or (cache is None and cache_dir is not None)
    if asked and not read_only:
        raise ValueError(
            f"cache={cache!r}, cache_dir={cache_dir!r}: the read cache serves buffers opened with "
            f"read_only=True; {storage.location!r} is opened for writing"
        )
    automatic = cache is None and object_store_url(storage.location) is not None  # s3a://, S3://... too
    if isinstance(storage, CachedStorage) or not read_only or not (asked or automatic):
        return storage
    return CachedStorage(storage, cache_dir, cache_size)
