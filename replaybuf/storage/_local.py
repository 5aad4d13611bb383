"""Helpers shared by the backends that store a local folder (memmap, hdf5)."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
import stat
import threading
import weakref
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from ..schema import Schema
from ._chunks import SMALL_ARRAY_BYTES, chunk_cache
from ._codecs import crc32c, crc_bit_flipped
from ._kv import KVBlobs, LocalKV, open_stored, own_file
from ._mapping import map_array, map_file
from ._owned import check_owned
from ._owner import Owner
from ._seed import NPY_HEADER_ERRORS, out_of_descriptors, seed_h5_hint
from .base import (
    COUNTERS,
    STATE_CHECKSUM,
    STATE_KEY,
    STATE_KEYS,
    BufferDamagedError,
    BufferReplacedError,
    ChecksumEntryError,
    CorruptChunkError,
    EpisodeLengthError,
    Storage,
    StorageError,
    detect_backend,
    edited_rows,
    refuse_another_backends_buffer,
    state_body,
)

# room a create takes beyond its arrays (``check_schema``): the counters, the config and the
# file system's own, and a block per array (its .npy header, its HDF5 object header)
CREATE_MARGIN_BYTES = 64 << 10
ARRAY_MARGIN_BYTES = 4 << 10


def _file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes (RLIMIT_FSIZE), None where none."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


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
    hint = seed_h5_hint(storage.location)
    if hint:
        raise ValueError(f"cannot create a buffer at {storage.location!r}, nothing was deleted{hint}")
    refuse_another_backends_buffer(storage)
    refuse_enclosing_buffer(storage)


def enclosing_buffer(location: str) -> tuple[str, str] | None:
    """(folder, backend) of the buffer whose folder holds local ``location`` (at any depth,
    links resolved: where its files would be), or None. A folder whose buffer cannot be read
    (damaged, its backend not installed) is left to the open of that folder."""
    folder = os.path.realpath(location.removeprefix("file://"))
    while True:
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
        try:
            backend = detect_backend(folder)
        except Exception:
            continue
        if backend is not None:
            return folder, backend


def refuse_enclosing_buffer(storage: Storage) -> None:
    """Raise before creating a buffer inside another buffer's folder (``buf/data/x``,
    ``buf/replaybuf/steplog/x``): an overwrite of that buffer erases its own folders with what
    they hold, the new buffer's episodes too, and elsewhere in it (``buf/x``) the new buffer's
    files are foreign entries that make the other's overwrite refused."""
    found = enclosing_buffer(storage.location)
    if found is not None:
        folder, backend = found
        raise ValueError(
            f"cannot create a buffer at {storage.location!r}: it is inside the {backend!r} buffer at "
            f"{folder!r}, whose overwrite would erase it; nothing was written. Choose a folder outside "
            "that buffer"
        )


# one .npy header parse at a time: np.load's (ast.literal_eval) is not thread-safe on Python
# 3.11 ("AST constructor recursion depth mismatch"); a fork never leaves it held in the child
NPY_HEADERS = threading.Lock()
os.register_at_fork(before=NPY_HEADERS.acquire, after_in_parent=NPY_HEADERS.release, after_in_child=NPY_HEADERS.release)


def _let_go(pin: object) -> None:
    """A finalizer that only drops what it was given (the map pinning a reader's buffer)."""


def read_npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of the ``.npy`` file ``f``, left at its first data byte."""
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return read_header(f)


def npy_data_offset(path: str) -> int:
    """Where the data of the ``.npy`` file ``path`` begins (called holding ``NPY_HEADERS``)."""
    with open(path, "rb") as f:
        read_npy_header(f)
        return f.tell()


def map_npy(path: str, writable: bool) -> np.ndarray:
    """``np.load(path, mmap_mode="r+" if writable else "r")`` (called holding ``NPY_HEADERS``),
    except that a read-only map holds no file descriptor (``_mapping.map_file``): Python's mmap
    keeps one per map, and a reader of a few hundred memmap or hdf5 shards
    (``ConcatReplayBuffer(root)``, several arrays each) ran out of the process's open-file limit
    (1024 by default) while opening them."""
    if writable:
        return np.load(path, mmap_mode="r+", allow_pickle=False)
    with open(path, "rb") as f:
        shape, fortran, dtype = read_npy_header(f)
        if fortran or dtype.hasobject:  # never written by replaybuf: numpy's map (or its refusal)
            return np.load(path, mmap_mode="r", allow_pickle=False)
        return map_array(f.fileno(), f.tell(), dtype, shape)


def _owns_nothing(name: str) -> bool:
    """``_owns`` of a folder that holds no buffer: every entry in it is the user's."""
    return False


# the identity of a buffer whose identity file was missing when it was opened: no file's
_NO_FILE = (-1, -1)


class LocalFolderStorage(KVBlobs, Storage):
    """The base of the backends that keep a buffer in files of one local folder (memmap, hdf5):
    the folder and its side objects, detection, what ``create`` may erase, and the per-episode
    checksums that in-place edits recompute."""

    supports_remote = False
    supports_field_codecs = False  # per-field ``compressor`` specs do not apply here
    kv: LocalKV

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        super().__init__(location, storage_options, fsync=fsync)
        self.root = local_root(self)
        self.kv = LocalKV(self.root, fsync=fsync)
        self._checksums: EpisodeChecksums | None = None
        # a reader's buffer: (device, inode) of ``identity_file`` as opened, held open by the
        # finalizer's file descriptor so that no new file can get that inode while it is read
        self._identity: tuple[int, int] | None = None
        self._pin: weakref.finalize | None = None

    def __getstate__(self) -> dict:
        # a pickled reader (a DataLoader worker) keeps the identity; the opener's process pins it
        return {**super().__getstate__(), "_pin": None}

    def _config(self) -> dict | None:
        """The stored config (None where there is none): each backend reads its own."""
        raise NotImplementedError

    def identity_file(self) -> str:
        """The file whose inode is the buffer's: only a create or an upgrade puts a new one at
        its path (memmap: episode_lens' array; hdf5: data.h5); the files a reader maps or
        holds open are of that buffer while the path still names the same inode."""
        raise NotImplementedError

    def pin_identity(self, read_only: bool) -> None:
        """At an open: a reader records the identity of the buffer it opens (before it reads
        anything of it, so everything it reads later is of that buffer, or ``replaced`` says
        so); a writer holds the lease, so nobody replaces its buffer: it records none."""
        if self._pin is not None:
            self._pin()
        self._identity = self._pin = None
        if not read_only:
            return
        path = self.identity_file()
        try:
            fd = open_stored(path)  # a FIFO there is refused, never waited on
        except FileNotFoundError:
            # no buffer (the open says so), or one created since: read as replaced
            self._identity = _NO_FILE
            return
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # a folder (or a link to one) cannot be mapped: named, as the arrays are
            os.close(fd)
            raise BufferDamagedError(
                f"{path}: not a regular file (a FIFO, a device, a folder or a broken link) where the buffer's "
                "array belongs"
            )
        self._identity = (st.st_dev, st.st_ino)
        if st.st_size:  # a map of its first byte pins the inode without a descriptor (``map_file``)
            try:
                self._pin = weakref.finalize(self, _let_go, map_file(fd, 1))
            finally:
                os.close(fd)
        else:
            self._pin = weakref.finalize(self, os.close, fd)

    def replaced(self, cheap_only: bool = False) -> bool:
        # docstring inherited: one stat of ``identity_file``
        if self._identity is None:
            return False
        try:
            st = os.stat(self.identity_file())
        except FileNotFoundError:
            return True  # erased, its successor not yet created
        return (st.st_dev, st.st_ino) != self._identity

    def check_not_replaced(self) -> None:
        """``BufferReplacedError`` when ``replaced()``: after a reader maps or opens a file of
        the buffer by its path, which names a new buffer's file once it was replaced."""
        if self.replaced():
            raise BufferReplacedError(self.location)

    def check_identity(self, fd: int) -> None:
        """``BufferReplacedError`` when the open file ``fd`` (of ``identity_file``, opened by
        its path again) is not the file this reader's buffer was opened with."""
        if self._identity is not None:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._identity:
                raise BufferReplacedError(self.location)

    def excess_bookkeeping(self, trim: bool = False) -> list[str]:
        # docstring inherited: ``replaybuf/checksums.npy`` past the array its header gives
        if self._checksums is None:
            return []
        if trim:
            self._check_writable()
        return self._checksums.excess(trim)

    @staticmethod
    def _owns(name: str) -> bool:
        """Whether the top-level entry ``name`` of the folder belongs to a buffer of this backend."""
        raise NotImplementedError

    def _lens_now(self) -> np.ndarray:
        """``episode_lens`` as stored now (the writer's own, in a write)."""
        return self.read_meta("episode_lens")

    def data_file(self, name: str, meta: bool = False) -> str:
        """Where data field ``name`` (``meta``: meta field) is stored (named by CorruptChunkError)."""
        raise NotImplementedError

    def unchecked_rows(self, name: str, episodes: np.ndarray, t0: int, t1: int) -> np.ndarray:
        """``read_rows`` without the checksum check (to compute the checksums)."""
        raise NotImplementedError

    def _row_map(self, name: str) -> np.ndarray | None:
        """Data field ``name`` as a memmap of its file, showing this process's writes; None where
        the file cannot be mapped (a chunked HDF5 dataset)."""
        raise NotImplementedError

    def read_rows(
        self, name: str, episodes: np.ndarray, t0: int, t1: int, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited: whole committed episodes are checked against their crc32c
        if self._checksums is None:
            return self.unchecked_rows(name, episodes, t0, t1)
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        lens = self._lens_now()[episodes]
        mapped = self._row_map(name)
        if mapped is not None:  # checked as copied out of the map
            return self._checksums.read_rows(name, mapped, episodes, t0, t1, lens)
        partial = (t0 < lens) & (t0 < t1) & ((t0 > 0) | (t1 < lens))  # some steps of an episode: checked once
        self._checksums.check_once(name, None, episodes[partial], lens[partial])
        rows = self.unchecked_rows(name, episodes, t0, t1)
        if t0 == 0:
            self._checksums.check(name, episodes, rows, t1, lens)
        return rows

    @property
    def checks_whole_episodes(self) -> bool:
        # docstring inherited: format-2 folders keep a crc32c per (field, episode)
        return self._checksums is not None

    @classmethod
    def can_open(cls, location: str, storage_options: dict | None = None) -> bool:
        # docstring inherited
        if "://" in str(location) and not str(location).startswith("file://"):
            return False
        return cls(location).exists()

    def check_creatable(self) -> list[str]:
        # docstring inherited
        refuse_foreign_buffer(self)
        self._refuse_erasing_a_newer_format(self._config())
        # the names are this backend's only in a buffer (or in a create cut short after its
        # counters): a user's own data.h5, foo.data.npy or metadata.pkl is not ours to erase,
        # nor is a folder whose replaybuf/state.json is not counters a create wrote
        ours = self.exists() or self._holds_created_counters()
        return check_owned(self.kv, self.location, self._owns if ours else _owns_nothing, holds_buffer=ours)

    #: whether a create writes every array into one file (hdf5), else one file each (memmap)
    reserves_one_file = False

    def reserved_layouts(self, schema: Schema) -> dict[tuple[str, bool], tuple[tuple[int, ...], np.dtype]]:
        """(name, meta) -> (shape, dtype) of the arrays a create of ``schema`` reserves on disk
        up front (``expected_layouts``), every block of them: none by default."""
        return {}

    def check_schema(self, schema: Schema) -> None:
        # docstring inherited: the arrays reserved up front must fit in the disk's free space,
        # with that of the buffer the create erases, and each file in this process's file size
        # limit; a create that ran out of either failed only after erasing it
        layouts = self.reserved_layouts(schema)
        sizes = {key: math.prod(shape) * np.dtype(dtype).itemsize for key, (shape, dtype) in layouts.items()}
        if not sizes:
            return
        # and the checksum of each (field, episode) (``EpisodeChecksums``), 8 bytes
        needed = sum(sizes.values()) + 8 * schema.max_episodes * len(schema.fields)
        (name, meta), size = max(sizes.items(), key=lambda item: item[1])
        shape, dtype = layouts[name, meta]
        kind = "meta field" if meta and name in schema.meta_fields else "field" if not meta else "bookkeeping array"
        largest = f"the largest, {kind} {name!r}: {np.dtype(dtype)}{list(shape)}, {size:,} bytes"
        where = f"creating the {self.backend_name} buffer at {self.location!r}"
        file_bytes = (sum(sizes.values()) if self.reserves_one_file else size) + ARRAY_MARGIN_BYTES
        limit = _file_size_limit()
        if limit is not None and file_bytes > limit:
            raise StorageError(
                f"{where} writes a file of about {file_bytes:,} bytes ({largest}), over this process's file size "
                f"limit (RLIMIT_FSIZE, `ulimit -f`) of {limit:,} bytes; nothing was erased. Lower max_episodes or "
                "max_timesteps, or raise the limit"
            )
        folder = self.root
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        erased = self._bytes_erased()
        room = shutil.disk_usage(folder).free + erased
        if needed + CREATE_MARGIN_BYTES + ARRAY_MARGIN_BYTES * len(layouts) <= room:
            return
        raise StorageError(
            f"{where} reserves {needed:,} bytes of disk up front ({largest}), and its file system has {room:,} "
            f"free ({erased:,} of them held by the buffer it replaces); nothing was erased. Lower max_episodes "
            "or max_timesteps, free disk space, or use a backend that stores only what is written (zarr, or hdf5 "
            "with compression)"
        )

    def _bytes_erased(self) -> int:
        """The disk space of the files a create here erases (``check_creatable``): those with
        no other link, which the erase frees (unless a reader still holds one open)."""
        total = 0
        for entry in self.check_creatable():
            path = os.path.join(self.root, entry.rstrip("/"))
            paths = [path]
            if entry.endswith("/"):
                paths = [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]
            for file in paths:
                with contextlib.suppress(OSError):
                    st = os.lstat(file)
                    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                        total += getattr(st, "st_blocks", st.st_size // 512) * 512
        return total

    def _holds_created_counters(self) -> bool:
        """Whether ``replaybuf/state.json`` holds counters sealed as a create writes them (with
        their crc32c): what a create cut short after its counters leaves."""
        try:
            state = json.loads(self.kv.get_document(STATE_KEY) or b"null")
        except (ValueError, RecursionError, NotADirectoryError):  # not JSON, nested too deep, or too large
            return False  # (BufferDamagedError), or replaybuf/ is a file of the user's
        if not isinstance(state, dict) or not set(COUNTERS) <= set(state) <= STATE_KEYS:
            return False
        return state.get(STATE_CHECKSUM) == crc32c(state_body(state))

    def lengths_matching(self, name: str, slot: int) -> list[int] | None:
        # docstring inherited: the crc32c of the episode's steps from step 0
        if self._checksums is None:
            return None
        return self._checksums.lengths_matching(name, slot)

    def update_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        # docstring inherited
        self.write_rows(name, episodes, t0, values)
        self.rows_rewritten(name, np.asarray(episodes))

    def reseal(self, episodes: np.ndarray, lengths: np.ndarray, names: list[str] | None = None) -> None:
        # docstring inherited
        self._check_writable()
        if self._checksums is not None:
            self._checksums.seal(episodes, lengths, names)

    def _update_steps(self, name: str, episodes: np.ndarray, timesteps: np.ndarray, values: np.ndarray) -> None:
        # docstring inherited: the touched rows read whole and checked in one pass (the checked
        # read's per-row copies cost ~4x more), then rewritten and resealed
        lens = self._lens_now()

        def read(slots: np.ndarray, steps: int) -> np.ndarray:
            committed = lens[slots]
            rows = self.unchecked_rows(name, slots, 0, max(steps, int(committed.max())))
            if self._checksums is not None:
                self._checksums.check(name, slots, rows, rows.shape[1], committed)
            return rows

        slots, rows = edited_rows(read, episodes, timesteps, values)
        self.update_rows(name, slots, 0, rows)

    def rows_rewritten(self, name: str, key: Any) -> None:
        """After ``data/name[key] = ...`` (update, store_datapoint): recompute the checksums of
        the committed episodes it touched."""
        if self._checksums is not None:
            first = key[0] if isinstance(key, tuple) else key
            lens = self._lens_now()
            self._checksums.reseal_written(name, np.arange(len(lens))[first], lens)


def reserve(path: str) -> None:
    """Reserve on disk every block of the file at ``path``: a memmap write to (or, on tmpfs, a
    read of) a block the full disk has no room for kills the process with SIGBUS, so a full
    disk is a StorageError here, naming the file, and never later."""
    try:
        with open(path, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as e:
        raise StorageError(f"cannot reserve the disk space of {path!r}: {e.strerror or e}") from e


CHECKSUM_FILE = "replaybuf/checksums.npy"
_SEALED = np.uint64(1 << 32)
# the first format whose entries check themselves (``entries``); format 2's hold no tag
TAGGED_FORMAT = 3
_CRC_BITS = np.uint64(0xFFFFFFFF)
# rows copied then checksummed together: fits a core's L2 cache with room to spare
_BLOCK_BYTES = 256 << 10
# fields of at most this many bytes keep a private copy of the episodes that passed (CheckedCopy)
CHECKED_COPY_BYTES = SMALL_ARRAY_BYTES


def entries(crcs: np.ndarray, episodes: np.ndarray, column: int, tagged: bool) -> np.ndarray:
    """The checksum entries of ``crcs`` (uint64, < 2**32) of ``episodes`` in ``column``: bit
    32 set ("kept") over the crc32c and, ``tagged`` (format 3), bits 33-63 a hash of the crc,
    the episode and the column (splitmix64's finalizer, a bijection of its 64-bit input), so a
    flipped bit anywhere in an entry, and an entry moved to another cell, fail ``expected``'s
    check, which recomputes the entry from its low 32 bits: damage is blamed on checksums.npy,
    not on the data. Vectorized: a batch costs a few µs."""
    crcs = np.asarray(crcs, dtype=np.uint64)
    if not tagged:
        return crcs | _SEALED
    x = crcs | (np.asarray(episodes, dtype=np.uint64) << np.uint64(32))
    x ^= np.uint64((0x9E3779B97F4A7C15 * (column + 1)) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(33) << np.uint64(33)) | _SEALED | crcs


class EpisodeChecksums:
    """A crc32c per committed (data field, episode) of a local folder buffer (format 2 and later).

    The memmap and hdf5 backends store data as raw bytes, so nothing on the read path checks
    them. ``replaybuf/checksums.npy`` (max_episodes, fields) uint64 holds an entry (``entries``)
    of the crc of the committed rows ``[0, length)`` of each field (0: never committed). It
    is written before the length is published, and recomputed when a committed episode's rows
    are rewritten in place, so a reader can check every whole-episode read (read_rows /
    read_spans from step 0 to at least the length). Reads of some steps of an episode (sampled
    steps, windows) check it whole once per process and entry (``gather``, ``check_once``). Each
    entry a check uses is checked first: one
    that is not what its low 32 bits make (0 included: a committed episode always has one) is
    ``ChecksumEntryError`` naming checksums.npy. Format 2's entries hold no tag, so there only
    the kept bit and bits 33-63 (0) are checked; a flipped crc bit reads as damaged data.
    """

    def __init__(self, storage: LocalFolderStorage, root: str, fields: list[str], tagged: bool):
        self._storage = Owner(storage)  # the storage owns this: no cycle (``_owner.py``)
        self.path = os.path.join(root, CHECKSUM_FILE)
        self.columns = {name: i for i, name in enumerate(fields)}
        self.tagged = tagged
        self._sums: np.ndarray | None = None
        self._copies: dict[str, CheckedCopy | None] = {}
        # per (slot, column) of a field without a private copy, the check its mapped steps last
        # passed (``check_once``): memory shared with the DataLoader workers forked after
        # ``share_checks``, so a worker does not read again an episode another one checked
        self._checked: np.ndarray | None = None
        # per cell, the entry last seen to pass its own check (this process's memory: the same
        # value in the same cell passes again, so a batch recomputes only entries that changed)
        self._passed: np.ndarray | None = None

    @property
    def storage(self) -> LocalFolderStorage:
        return self._storage()

    @classmethod
    def create(cls, storage: LocalFolderStorage, root: str, fields: list[str], max_episodes: int) -> EpisodeChecksums:
        """An empty table for a new buffer (the newest format: tagged entries)."""
        self = cls(storage, root, fields, tagged=True)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # a new file, never the old one rewritten in place: a reader of the buffer this one
        # replaces may still map it (and would fault on pages a shorter file no longer has)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        open_memmap(self.path, mode="w+", dtype=np.uint64, shape=(max_episodes, len(fields))).flush()
        try:
            reserve(self.path)
        except StorageError:
            os.unlink(self.path)
            raise
        self.share_checks()  # before DataLoader workers fork
        return self

    @classmethod
    def open(
        cls, storage: LocalFolderStorage, root: str, fields: list[str], max_episodes: int, version: int
    ) -> EpisodeChecksums | None:
        """The checksums of a folder of format ``version`` (its config's), None for one without
        (format 1, seed folders: ``version`` 0). A folder whose config says it keeps them
        (format 2 and later) and has none, or whose file is not a (max_episodes, fields) uint64
        array, is damaged: reading it unchecked would lie."""
        self = cls(storage, root, fields, tagged=version >= TAGGED_FORMAT)
        if not os.path.lexists(self.path):
            if version >= 2:
                raise BufferDamagedError(
                    f"{self.path}: missing; this buffer's config says it checksums its data, so its "
                    "episodes cannot be checked (restore the file, or copy the buffer from a backup)"
                )
            return None
        sums = self.sums
        if sums.shape != (max_episodes, len(fields)) or sums.dtype != np.uint64:
            raise BufferDamagedError(
                f"{self.path}: holds {sums.dtype}{list(sums.shape)}, expected uint64[{max_episodes}, {len(fields)}]"
            )
        if not storage.read_only:
            reserve(self.path)  # a file an earlier release created sparse
        self.share_checks()  # before DataLoader workers fork
        return self

    @property
    def sums(self) -> np.ndarray:
        writable = not self.storage.read_only
        if self._sums is None or self._sums.flags.writeable != writable:
            try:
                if not os.path.isfile(self.path):  # a folder, a device, a dangling or looping link
                    raise ValueError("not a regular file")
                if writable:  # written in place: never through a hard link
                    own_file(self.path)
                with NPY_HEADERS:
                    sums = map_npy(self.path, writable)
            except NPY_HEADER_ERRORS as e:  # a damaged header or a file cut short
                if out_of_descriptors(e):
                    raise
                self.storage.check_not_replaced()  # or erased with the buffer, by an overwrite
                raise BufferDamagedError(f"{self.path}: not a readable checksum array ({e})") from None
            self.storage.check_not_replaced()  # mapped by its path: a new buffer's file, then
            self._sums = sums
        return self._sums

    def excess(self, trim: bool) -> list[str]:
        """``excess_bookkeeping`` of the file: bytes past the (max_episodes, fields) array its
        header gives (checked at open) are never mapped nor read; ``trim`` cuts them off."""
        sums = self.sums
        with NPY_HEADERS:
            expected = npy_data_offset(self.path) + sums.nbytes
        size = os.path.getsize(self.path)
        if size <= expected:
            return []
        if not trim:
            return [
                f"{self.path}: the per-episode checksums hold {size} bytes, more than the {expected} bytes its "
                f"header and the config give them; the {size - expected} bytes past them are not read"
            ]
        # in place: what a reader maps ends at ``expected``, so no mapped page is cut
        own_file(self.path)
        with open(self.path, "r+b") as f:
            f.truncate(expected)
            if self.storage.fsync:
                os.fsync(f.fileno())
        return [
            f"repaired: cut {self.path} to the {expected} bytes its header and the config give it "
            f"(removed {size - expected})"
        ]

    def seal(self, slots: np.ndarray, lengths: np.ndarray, names: list[str] | None = None) -> None:
        """Compute and store the checksums of ``slots`` committed at ``lengths``. A slot being
        emptied (0) keeps its entry until its next episode is sealed: a reader that read its
        length before it was unpublished, with the generation not yet cleared, checks the
        episode it saw against its own entry, rather than finding none (damage)."""
        slots, lengths = np.asarray(slots, dtype=np.int64).reshape(-1), np.asarray(lengths).reshape(-1)
        lengths = np.broadcast_to(lengths, slots.shape)
        committed = lengths > 0
        if not committed.any():
            return
        sums = self.sums
        picked = slots[committed]
        for name in self.columns if names is None else names:
            column = self.columns[name]
            rows = self.storage.unchecked_rows(name, picked, 0, int(lengths[committed].max()))
            crcs = [crc32c(np.ascontiguousarray(row[:n])) for row, n in zip(rows, lengths[committed].tolist())]
            sums[picked, column] = entries(np.array(crcs, np.uint64), picked, column, self.tagged)
        # other processes see the page cache; msync only for power loss (~2 ms); a writer's is a memmap
        if self.storage.fsync and isinstance(sums, np.memmap):
            sums.flush()

    def reseal_written(self, name: str, episodes: np.ndarray, lengths: np.ndarray) -> None:
        """After rows of ``episodes`` were rewritten in place: recompute the committed ones."""
        episodes = np.unique(np.asarray(episodes, dtype=np.int64).reshape(-1))
        lengths = np.asarray(lengths)[episodes]
        self.seal(episodes, lengths, [name])

    def expected(self, name: str, episodes: np.ndarray, read: np.ndarray, lengths: np.ndarray) -> list[int]:
        """Per episode: its stored entry (the crc32c in the low 32 bits) where ``read[i]`` steps
        from step 0 hold the whole committed episode (``lengths`` as published now), else 0
        (nothing to check). An entry to check that fails its own check is ChecksumEntryError."""
        if name not in self.columns:
            return [0] * len(episodes)
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        column = self.columns[name]
        sums = self.sums
        stored = np.array(sums[episodes, column])  # one read of each entry, checked and used
        lengths = np.asarray(lengths)
        whole = (lengths > 0) & (lengths <= np.asarray(read))
        if self._passed is None:
            self._passed = np.zeros(sums.shape, np.uint64)  # 0 is no entry: never passed
        new = np.flatnonzero(whole & ((stored != self._passed[episodes, column]) | (stored == 0)))
        if len(new):
            picked, values = episodes[new], stored[new]
            bad = values != entries(values & _CRC_BITS, picked, column, self.tagged)
            if bad.any():
                k = int(new[np.argmax(bad)])
                self._fail_entry(name, int(episodes[k]), int(lengths[k]), int(stored[k]))
            self._passed[picked, column] = values
        return np.where(whole, stored, 0).tolist()

    def _fail_entry(self, name: str, episode: int, length: int, stored: int) -> None:
        """Raise ChecksumEntryError for the damaged entry ``stored`` of committed ``episode``,
        saying whether the data still matches the crc32c (or, tagged, the tag) it holds."""
        column = self.columns[name]
        try:
            row = self.storage.unchecked_rows(name, np.array([episode]), 0, length)[0]
            crc = np.array([crc32c(np.ascontiguousarray(row))], np.uint64)
        except (OSError, ValueError, CorruptChunkError):  # unreadable data (hdf5): not verified
            verified = False
        else:
            entry = int(entries(crc, np.array([episode]), column, self.tagged)[0])
            verified = int(crc[0]) == stored & 0xFFFFFFFF or (self.tagged and entry >> 33 == stored >> 33)
        raise ChecksumEntryError(
            f"data/{name}: slot {episode}: its checksum entry in {self.path} is damaged (it holds "
            f"{stored:#018x}, which fails the entry's own check), so the episode cannot be checked; "
            + ("its data still matches the crc32c the entry holds" if verified else "its data cannot be verified")
            + ". `replaybuf verify --repair` re-seals the entry from the data",
            field=f"data/{name}",
            slot=episode,
            steps=(0, length),
            location=self.path,
            data_verified=verified,
        )

    def check_row(self, name: str, episode: int, row: np.ndarray, expected: int) -> None:
        """Raise CorruptChunkError when ``row`` (the committed steps of ``episode``, as read)
        differs from its checksum ``expected`` (from ``expected``; 0: nothing to check)."""
        if expected and crc32c(np.ascontiguousarray(row)) != expected & 0xFFFFFFFF:
            self._fail(name, episode, len(row), expected)

    def check(self, name: str, episodes: np.ndarray, rows: np.ndarray, read: int, lengths: np.ndarray) -> None:
        """``check_row`` for each of ``rows`` (read from step 0, ``read`` steps each)."""
        expected = self.expected(name, episodes, np.full(len(episodes), read), lengths)
        for i, (episode, n, value) in enumerate(zip(np.asarray(episodes).tolist(), lengths.tolist(), expected)):
            self.check_row(name, episode, rows[i, :n], value)

    def copy_row(
        self, name: str, mapped: np.ndarray, episode: int, start: int, out: np.ndarray, committed: int, expected: int
    ) -> None:
        """``out[...] = mapped[episode, start:start + len(out)]`` (``mapped``: the field's
        (episode, time, ...) memmap), checking the first ``committed`` steps against
        ``expected`` (0: nothing to check; else ``start`` is 0) as they are copied.

        The file's pages are shared with every process that maps or writes it and are read
        again from disk after eviction, so bytes that passed once can change under this
        process: they are never trusted. Only a private copy can be (``CheckedCopy``, small
        fields): later reads of the same committed episode are served from it. Otherwise each
        block is checksummed as it is copied, while it is in the core's cache (crc32c runs ~2x
        faster there than over a 2 MB episode), and the copies, which give up the GIL, overlap
        with the checks, which hold it, when several episodes are copied in parallel."""
        rows = mapped[episode, start : start + len(out)]
        if not expected:
            out[...] = rows
            return
        copy = self._copy_of(name, mapped)
        if copy is not None and copy.serve(episode, out, committed, expected):
            out[committed:] = rows[committed:]
            return
        step = max(1, _BLOCK_BYTES // max(1, out[:1].nbytes))
        crc = 0
        for lo in range(0, len(out), step):
            block = out[lo : lo + step]
            block[...] = rows[lo : lo + step]
            if lo < committed:
                crc = crc32c(np.ascontiguousarray(block[: committed - lo]), crc)
        if crc != expected & 0xFFFFFFFF:
            self._fail(name, episode, committed, expected)
        if copy is not None:
            copy.keep(episode, out[:committed], expected)

    def serve_kept(
        self,
        name: str,
        mapped: np.ndarray,
        out: np.ndarray,
        items: np.ndarray,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        committed: np.ndarray,
        expected: list[int],
    ) -> np.ndarray:
        """Copy into ``out[items[i], :lengths[i]]`` each whole committed episode, where the field
        has a private copy: the episodes it keeps under their ``expected`` checksum from it, the
        others from ``mapped``, each checked (one crc32c call) and then kept; each with one fancy
        index for all. Per item, whether it was served (the others, a failed check included, go
        through ``copy_row``, which names the damage). A batch of short episodes (trajectories of
        20 steps) otherwise took one Python step per episode and field: 0.33 ms unchecked, 1.16 ms
        checked per 64 episodes of memmap."""
        copy = self._copy_of(name, mapped)
        served = np.zeros(len(items), bool)
        if copy is None or not len(items):
            return served
        wanted = np.asarray(expected, dtype=np.uint64)
        whole = (starts == 0) & (lengths == committed) & (wanted != 0)
        served = whole & (copy.sums[episodes] == wanted) & (copy.lens[episodes] == committed)
        if served.any():
            counts = lengths[served]
            steps = _steps(counts)
            out[np.repeat(items[served], counts), steps] = copy.rows[np.repeat(episodes[served], counts), steps]
        fresh = np.flatnonzero(whole & ~served)
        if len(fresh):
            counts = lengths[fresh]
            steps = _steps(counts)
            out[np.repeat(items[fresh], counts), steps] = mapped[np.repeat(episodes[fresh], counts), steps]
            passed = np.array(
                [
                    crc32c(out[i, :n]) == value & 0xFFFFFFFF
                    for i, n, value in zip(items[fresh].tolist(), counts.tolist(), wanted[fresh].tolist())
                ],
                dtype=bool,
            )
            fresh = fresh[passed]
            copy.keep_many(episodes[fresh], out[items[fresh]], lengths[fresh], wanted[fresh])
            served[fresh] = True
        return served

    def gather(
        self, name: str, mapped: np.ndarray, episodes: np.ndarray, timesteps: np.ndarray, lengths: np.ndarray
    ) -> np.ndarray | None:
        """``mapped[episodes, timesteps]`` (single steps, a sampled batch's) from the field's
        private copy: the first batch that samples an episode not kept yet checks every
        committed episode not kept (``lengths`` as published now) against its stored checksum
        and keeps it (one pass over the field, as a zarr loader loads its small fields; damage
        raises CorruptChunkError); steps outside a committed episode come from ``mapped``.
        None where the field has no private copy (over CHECKED_COPY_BYTES): its sampled episodes
        are then checked once (``check_once``) and the caller reads ``mapped``."""
        copy = self._copy_of(name, mapped)
        if name not in self.columns:
            return None
        lengths = np.asarray(lengths)
        committed = lengths[episodes]
        if copy is None:
            touched = timesteps < committed
            self.check_once(name, mapped, episodes[touched], committed[touched])
            return None
        stored = self.sums[episodes, self.columns[name]]
        # an episode with no entry to check (0: a slot being rewritten, a seed folder's) reads the map
        unkept = (
            (stored != 0) & (committed > 0) & ((copy.sums[episodes] != stored) | (copy.lens[episodes] != committed))
        )
        if unkept.any():
            self._keep_committed(name, mapped, copy, lengths, episodes)
            stored = self.sums[episodes, self.columns[name]]
        held = copy.lens[episodes]
        kept = (stored != 0) & (copy.sums[episodes] == stored) & (held == committed) & (timesteps < held)
        if kept.all():  # the usual batch
            return copy.rows[episodes, timesteps]
        out = np.empty((len(episodes), *mapped.shape[2:]), mapped.dtype)
        out[kept] = copy.rows[episodes[kept], timesteps[kept]]
        out[~kept] = mapped[episodes[~kept], timesteps[~kept]]
        return out

    def check_once(self, name: str, mapped: np.ndarray | None, episodes: np.ndarray, committed: np.ndarray) -> None:
        """Before committed steps of ``episodes`` (``committed[i]``: ``episodes[i]``'s length as
        published now) are read part by part from ``mapped`` (single steps, windows; None: a
        chunked HDF5 dataset, read through ``unchecked_rows``): check each committed
        episode this process has not checked under its stored entry and length, reading it
        whole once (CorruptChunkError, or ChecksumEntryError for a damaged entry). Reading it
        whole on every batch would cost one episode per sampled step (a 2 MB episode of frames
        for one 21 kB frame), so a field too large for a private copy trusts its mapped bytes
        once checked, as zarr's hot maps trust a shard they checked: a rewrite or a new episode
        in the slot changes the entry and is checked again; damage after the check is found by
        the next process, whole-episode reads and ``verify``."""
        if name not in self.columns or not len(episodes):
            return
        episodes, committed = np.asarray(episodes, dtype=np.int64).reshape(-1), np.asarray(committed).reshape(-1)
        slots, first = np.unique(episodes, return_index=True)
        lengths = committed[first].astype(np.uint64)
        column = self.columns[name]
        checked = self._checked if self._checked is not None else self.share_checks()
        stored = self.sums[slots, column]
        # one 8-byte word per check, written at once (another process reads it any time): the
        # crc, which with the slot and column makes the whole entry, over the length
        marks = (stored << np.uint64(32)) | lengths
        todo = (lengths > 0) & ((stored == 0) | (checked[slots, column] != marks))
        if not todo.any():
            return
        slots, lengths = slots[todo], lengths[todo].astype(np.int64)
        for slot, n, value in zip(slots.tolist(), lengths.tolist(), self.expected(name, slots, lengths, lengths)):
            rows = (
                mapped[slot, :n] if mapped is not None else self.storage.unchecked_rows(name, np.array([slot]), 0, n)[0]
            )
            if crc32c(np.ascontiguousarray(rows)) != value & 0xFFFFFFFF:
                self._fail(name, slot, n, value)
            checked[slot, column] = (value << 32 | n) & 0xFFFFFFFFFFFFFFFF

    def share_checks(self) -> np.ndarray:
        """Keep ``check_once``'s record in memory that processes forked from now on share
        (DataLoader workers): anonymous shared pages, taken only as checks are recorded."""
        shape = self.sums.shape
        memory = mmap.mmap(-1, max(1, shape[0] * shape[1] * 8))  # MAP_SHARED | MAP_ANONYMOUS
        self._checked = np.frombuffer(memory, np.uint64, shape[0] * shape[1]).reshape(shape)
        return self._checked

    def _keep_committed(
        self, name: str, mapped: np.ndarray, copy: CheckedCopy, lengths: np.ndarray, sampled: np.ndarray
    ) -> None:
        """Check each committed episode of ``name`` that ``copy`` does not keep under its stored
        checksum now, and keep it: copied whole with one fancy index, then one crc32c each. One
        failing its check raises when ``sampled`` (the batch's slots) names it; any other is left
        unkept (a slot a writer is rewriting now), to be checked when a batch samples it."""
        # one copy: ``lengths`` may be the live map, which a writer reusing a slot zeroes before
        # its generation, so a second look could check the old episode at length 0 (reported
        # as a damaged length) while the slot's generation still reads unchanged
        lengths = np.array(lengths)
        slots = np.flatnonzero(lengths > 0)
        committed = lengths[slots]
        wanted = set(np.asarray(sampled).tolist())
        try:
            expected = np.asarray(self.expected(name, slots, committed, committed), np.uint64)
        except ChecksumEntryError:  # a damaged entry: raised for a sampled slot, others left unkept
            expected = np.zeros(len(slots), np.uint64)
            for k, slot in enumerate(slots.tolist()):
                try:
                    expected[k] = self.expected(name, slots[k : k + 1], committed[k : k + 1], committed[k : k + 1])[0]
                except ChecksumEntryError:
                    if slot in wanted:
                        raise
        fresh = (expected != 0) & ((copy.sums[slots] != expected) | (copy.lens[slots] != committed))
        slots, committed, expected = slots[fresh], committed[fresh], expected[fresh]
        copy.sums[slots] = 0  # not served while written
        copy.rows[slots] = mapped[slots]
        for slot, n, value in zip(slots.tolist(), committed.tolist(), expected.tolist()):
            if crc32c(copy.rows[slot, :n]) == value & 0xFFFFFFFF:
                copy.lens[slot], copy.sums[slot] = n, value
            elif slot in wanted:
                self._fail(name, slot, n, value)

    def _copy_of(self, name: str, mapped: np.ndarray) -> CheckedCopy | None:
        """The field's private copy, made on first use when the whole field fits in
        CHECKED_COPY_BYTES and in the process's resident budget (shared with zarr's)."""
        if name not in self._copies:
            copy = None
            if mapped.nbytes <= CHECKED_COPY_BYTES and chunk_cache().take_resident(mapped.nbytes):
                copy = CheckedCopy(mapped.shape, mapped.dtype)
                weakref.finalize(copy, chunk_cache().release_resident, mapped.nbytes)
            self._copies.setdefault(name, copy)  # threads racing here keep one; the other is freed
        return self._copies[name]

    def read_rows(
        self, name: str, mapped: np.ndarray, episodes: np.ndarray, t0: int, t1: int, lengths: np.ndarray
    ) -> np.ndarray:
        """``mapped[episodes, t0:t1]`` (the field's (episode, time, ...) memmap) as a new array,
        whole committed episodes (``lengths`` as published now) checked as they are copied."""
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        t1 = min(t1, mapped.shape[1])
        out = np.empty((len(episodes), max(t1 - t0, 0), *mapped.shape[2:]), dtype=mapped.dtype)
        read = np.full(len(episodes), t1 if t0 == 0 else 0)
        expected = self.expected(name, episodes, read, lengths)
        # steps of the episode, not all of them
        partial = (np.asarray(expected) == 0) & (t0 < np.asarray(lengths)) & (t0 < t1)
        self.check_once(name, mapped, episodes[partial], np.asarray(lengths)[partial])
        for i, (episode, n, value) in enumerate(zip(episodes.tolist(), np.asarray(lengths).tolist(), expected)):
            self.copy_row(name, mapped, episode, t0, out[i], n, value)
        return out

    def _fail(self, name: str, episode: int, steps: int, expected: int) -> None:
        """Raise for committed ``episode`` failing its entry ``expected`` over ``steps`` steps:
        EpisodeLengthError when its data matches the entry at another length (the length is
        damaged, or, from format 5, maybe the data file is another episode's), ChecksumEntryError
        when a format-2 entry (no tag to check itself) is one flipped bit away from the data's
        crc, else CorruptChunkError naming the data file and checksums.npy (either may be the
        one copied in from elsewhere)."""
        if not self.tagged:
            self._check_entry_bit(name, episode, steps, expected)
        matches = [n for n in self._lengths_matching(name, episode, expected) if n != steps]
        if matches:
            raise EpisodeLengthError.found(
                f"data/{name}",
                episode,
                steps,
                "matches its checksum at",
                matches[0],
                self.storage.data_file("episode_lens", meta=True),
                self.storage.data_file(name),
                self.storage.sums_lengths,
            )
        raise CorruptChunkError.against_kept(
            f"data/{name}", episode, (0, steps), self.storage.data_file(name), self.path
        )

    def _check_entry_bit(self, name: str, episode: int, steps: int, expected: int) -> None:
        """Raise ChecksumEntryError when the crc32c of ``episode``'s ``steps`` stored steps is
        one bit away from its untagged entry ``expected`` (``crc_bit_flipped``): the entry is
        damaged, and the data matches it but for that bit."""
        try:
            row = np.ascontiguousarray(self.storage.unchecked_rows(name, np.array([episode]), 0, steps)[0])
        except (OSError, ValueError, CorruptChunkError):  # unreadable data (hdf5): not the entry's fault
            return
        computed = crc32c(row)
        if crc_bit_flipped(computed, expected, row.nbytes):
            raise ChecksumEntryError(
                f"data/{name}: slot {episode}: its checksum entry in {self.path} is damaged (it holds "
                f"{expected:#018x}, one bit away from the crc32c {computed:#010x} of the episode's data, which "
                "damaged data cannot cause), so the episode cannot be checked; its data matches the entry but "
                "for that bit. `replaybuf verify --repair` re-seals the entry from the data",
                field=f"data/{name}",
                slot=episode,
                steps=(0, steps),
                location=self.path,
                data_verified=True,
            )

    def lengths_matching(self, name: str, episode: int) -> list[int] | None:
        """``Storage.lengths_matching``: the lengths at which ``episode``'s stored steps match its
        entry, None when it holds none or one that fails its own check."""
        if name not in self.columns:
            return None
        stored = int(self.sums[episode, self.columns[name]])
        if not stored or stored != int(
            entries(np.array([stored & _CRC_BITS], np.uint64), np.array([episode]), self.columns[name], self.tagged)[0]
        ):
            return None
        return self._lengths_matching(name, episode, stored)

    def _lengths_matching(self, name: str, episode: int, expected: int) -> list[int]:
        """The lengths at which ``episode``'s steps of field ``name``, as stored, match its
        entry ``expected`` (one pass over the row: the error path only)."""
        try:
            row = self.storage.unchecked_rows(name, np.array([episode]), 0, self.storage.array(name).shape[1])[0]
        except (OSError, ValueError, CorruptChunkError):  # unreadable data (hdf5): nothing matches
            return []
        crc, found = 0, []
        for step in range(len(row)):
            crc = crc32c(np.ascontiguousarray(row[step]), crc)
            if crc == expected & 0xFFFFFFFF:
                found.append(step + 1)
        return found

    def release(self) -> None:
        self._sums = None
        self._copies = {}
        self._passed = None  # ``_checked`` stays: checks of content (crc, length), shared with forks

    def __getstate__(self) -> dict:
        # a spawned process checks and keeps its own copies
        return {**self.__dict__, "_sums": None, "_copies": {}, "_checked": None, "_passed": None}


class CheckedCopy:
    """This process's private copy of the committed steps of whole episodes of one field that
    passed their crc32c, each under the stored checksum it passed (``1 << 32 | crc``, with the
    length): while checksums.npy holds the same value for the slot, the copy is what was
    committed, and it lives in memory no other process and no disk fault can change, so it is
    served without a new check. A new episode in the slot or an in-place rewrite reseals the
    slot (a new value), and the next read checks the file again; damage to the file is never
    returned: reads serve bytes that passed, or check the file and raise."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.rows = np.empty(shape, dtype)  # pages are taken as episodes are kept
        self.sums = np.zeros(shape[0], np.uint64)
        self.lens = np.zeros(shape[0], np.int64)

    def serve(self, episode: int, out: np.ndarray, committed: int, expected: int) -> bool:
        """Copy the kept steps into ``out[:committed]`` when kept under ``expected``."""
        if self.sums[episode] != expected or self.lens[episode] != committed:
            return False
        out[:committed] = self.rows[episode, :committed]
        return True

    def keep_many(self, episodes: np.ndarray, rows: np.ndarray, lengths: np.ndarray, expected: np.ndarray) -> None:
        """``keep`` of ``rows[i, :lengths[i]]`` for each of ``episodes``, with one fancy index."""
        if not len(episodes):
            return
        steps = _steps(lengths)
        self.sums[episodes] = 0  # no thread serves a row while it is written
        self.rows[np.repeat(episodes, lengths), steps] = rows[np.repeat(np.arange(len(episodes)), lengths), steps]
        self.lens[episodes] = lengths
        self.sums[episodes] = expected

    def keep(self, episode: int, rows: np.ndarray, expected: int) -> None:
        """Keep ``rows`` (the committed steps, as they passed) under ``expected``."""
        self.sums[episode] = 0  # no thread serves a row while it is written
        self.rows[episode, : len(rows)] = rows
        self.lens[episode] = len(rows)
        self.sums[episode] = expected


def _steps(counts: np.ndarray) -> np.ndarray:
    """``0 .. counts[i] - 1`` for each i, one after another (the step of each row of a ragged batch)."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
