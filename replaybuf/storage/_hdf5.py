"""The HDF5 backend: one ``data.h5`` per buffer, optionally gzip/lzf compressed (needs h5py).

Layout: ``data.h5`` holds datasets ``data/<field>`` (episode, time, *shape) and ``meta/<field>``
(episode, *shape, incl. ``episode_lens`` and ``_generation``); its root attribute ``replaybuf``
is the config as JSON. HDF5 cannot replace a value atomically and a killed writer can leave
the file's own metadata half-written, so the counters (``replaybuf/state.json``, temp file +
rename) and the step log (``replaybuf/steplog/``) live next to it as plain files, and the
file is flushed before every counter commit. Format 2 adds ``replaybuf/checksums.npy``, a
crc32c per committed (field, episode) checked on whole-episode reads (``_local.py``; format 3:
each entry checks itself, so a damaged entry is not blamed on the data): HDF5's
fletcher32 filter would need chunked datasets, and uncompressed fields stay contiguous so that
sampling reads them through a numpy memmap. Errors h5py raises reading data (a damaged
compressed chunk) become ``CorruptChunkError``.

Sampling: uncompressed data fields are contiguous blocks at a fixed offset in the file, so
``gather`` fancy-indexes a read-only numpy memmap of those bytes (the memmap backend's speed);
compressed fields are read step by step, and a reader keeps those up to 32 MB in RAM.

Storage options (``storage_options=`` or ``ReplayBufferH5PY(h5py_compression=...)``):
``compression`` ('gzip', 'lzf' or None) and ``compression_opts`` (the gzip level). Compressed
data fields are chunked (1, T, *shape) with T chosen as for zarr; uncompressed ones are
contiguous, as memmap-replay-buffer's HDF5 variant stores them.

Files are opened with HDF5's default file locking, as a plain ``h5py.File(path)`` opens them:
HDF5 refuses a second open in one process whose locking flags differ, so this keeps a user's
own h5py reads of ``data.h5`` working next to an open buffer. Where another process holds a
lock, the open retries without locking (readers next to a live writer). One writer per buffer
is enforced by the writer lease (``lease.py``), as for every backend.

Reading beside a writer in another process (no SWMR): an uncompressed file (the default, the
seed's layout) keeps every dataset at a fixed place, so a reader's reads, checked by slot
generations like every backend's (``consistency.py``), see committed episodes only. A
compressed file's chunks move as the writer rewrites them and a reader's HDF5 index of them
goes stale (reads fail, or return other bytes). So a writer holds a shared ``flock`` on
``replaybuf/hdf5-writer.lock`` while open, and a reader of a compressed file refuses, with
``StorageError``, to refresh or read while a writer in another process holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import stat
import uuid
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import h5py
import numpy as np

from ..schema import FORMAT_NAME, FORMAT_VERSION, Schema
from ._kv import WRITE_HEADROOM, open_stored, own_file
from ._local import EpisodeChecksums, LocalFolderStorage, reserve
from ._mapping import map_array
from ._owned import erase_owned
from ._owner import Owner
from ._zarr import default_time_chunk
from .base import (
    OPTIONAL_META,
    AbsentMeta,
    BufferDamagedError,
    BufferNotFoundError,
    BufferReplacedError,
    CorruptChunkError,
    StorageError,
    WrappedArray,
    bookkeeping_fields,
    check_layout,
    empty_state,
    expected_layouts,
    parse_json,
)
from .spans import Spans, read_spans_by_rows

DATA_FILE = "data.h5"
CONFIG_ATTRIBUTE = "replaybuf"
META_CHUNK_EPISODES = 1024
WRITER_MARK = os.path.join("replaybuf", "hdf5-writer.lock")
STORAGE_OPTIONS = ("compression", "compression_opts")
# a reader keeps data fields up to this size in RAM for random sampling
SMALL_FIELD_BYTES = 32 << 20
COMPRESSIONS = ("gzip", "lzf")


def _expand_key(key: Any, shape: tuple[int, ...]) -> tuple:
    """A numpy key as a full-length tuple of ints, slices and integer arrays (negatives resolved)."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = key[:at] + (slice(None),) * (len(shape) - len(key) + 1) + key[at + 1 :]
    key = key + (slice(None),) * (len(shape) - len(key))
    if len(key) > len(shape):
        raise IndexError(f"too many indices ({len(key)}) for an array of shape {shape}")
    out: list[Any] = []
    for k, n in zip(key, shape):
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            if not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for an axis of size {n}")
            out.append(int(k) % n)
        elif isinstance(k, slice):
            out.append(slice(*k.indices(n)))
        else:
            index = np.asarray(k)
            if index.dtype == bool:
                index = np.flatnonzero(index)
            if index.dtype.kind not in "iu":
                raise IndexError(f"unsupported index {k!r}")
            if index.size and (index.min() < -n or index.max() >= n):
                raise IndexError(f"index {k!r} is out of bounds for an axis of size {n}")
            out.append(index % n)
    return tuple(out)


def _is_simple(key: tuple) -> bool:
    return all(isinstance(k, int) or (isinstance(k, slice) and k.step == 1) for k in key)


def _bounding_box(key: tuple) -> tuple[tuple, tuple]:
    """The smallest box of unit-step slices covering ``key``, and ``key`` relative to that box."""
    box: list[slice] = []
    relative: list[Any] = []
    for k in key:
        if isinstance(k, int):
            box.append(slice(k, k + 1))
            relative.append(0)
        elif isinstance(k, slice) and k.step == 1:
            box.append(slice(k.start, max(k.start, k.stop)))
            relative.append(slice(None))
        elif isinstance(k, slice):
            index = np.arange(k.start, k.stop, k.step)
            if not index.size:
                box.append(slice(0, 0))
                relative.append(slice(None))
                continue
            lo, first, last = int(index.min()), int(index[0]), int(index[-1])
            box.append(slice(lo, int(index.max()) + 1))
            stop = last - lo + (1 if k.step > 0 else -1)
            relative.append(slice(first - lo, stop if stop >= 0 else None, k.step))
        else:
            lo = int(k.min()) if k.size else 0
            box.append(slice(lo, int(k.max()) + 1 if k.size else 0))
            relative.append(k - lo)
    return tuple(box), tuple(relative)


@contextmanager
def reading(storage: HDF5Storage, dataset: str) -> Iterator[None]:
    """A reader's read of ``dataset``: refused before and after while a writer in another
    process has a compressed file open (see above); HDF5 errors as ``StorageError`` naming the
    file and dataset."""
    storage.refuse_live_writer()
    try:
        yield
    except OSError as e:
        if not storage.read_only:
            raise
        storage.refuse_live_writer()  # a writer that started during the read: say so
        raise StorageError(f"reading {dataset!r} of {storage.path!r} failed: {e}") from e
    storage.refuse_live_writer()


def written_to(dataset: h5py.Dataset, key: Any, values: np.ndarray, path: str) -> None:
    """``dataset[key] = values``, flushed while ``dataset`` is open: HDF5 keeps a small write's
    bytes until the dataset is closed (its h5py object freed), where a failed write (a full
    disk, a file size limit: EFBIG) is only printed and the bytes are lost, the call that
    wrote them having returned. Flushed here, it raises a StorageError naming the file."""
    try:
        dataset[key] = values
        dataset.flush()
    except (OSError, RuntimeError) as e:
        raise StorageError(f"writing {dataset.name} into {path!r} failed: {e}") from e


def _ascending_last(episodes: np.ndarray) -> np.ndarray:
    """The positions of ``episodes`` in ascending order of episode, each episode once at the
    position it is last given: h5py refuses a repeated index ("Indexing elements must be in
    increasing order"), where numpy assignment (memmap, zarr, the base ``write_rows``) keeps the
    last value given (``update([0, 0], ...)``, ``meta_data['x'][[0, 0]] = ...``)."""
    order = np.argsort(episodes, kind="stable")
    ordered = episodes[order]
    last = np.ones(len(ordered), bool)  # empty for no episode
    last[:-1] = ordered[1:] != ordered[:-1]
    return order[last]


def open_h5(path: str, mode: str) -> h5py.File:
    """``h5py.File(path, mode)`` with the default locking a plain h5py open uses; without
    locking when another process holds a lock on the file or this process opened it so."""
    try:
        return h5py.File(path, mode)
    except OSError as e:  # BlockingIOError: locked elsewhere; "flag values don't match": here
        if "lock" not in str(e):
            raise
    return h5py.File(path, mode, locking=False)


class H5Array(WrappedArray):
    """``buffer.data[name]``: numpy indexing on an HDF5 dataset.

    Keys h5py reads natively (ints and unit-step slices) go straight to it; any other key is
    served from the bounding box it covers, so callers get numpy semantics (unsorted or
    repeated episode lists, negative indices, several index arrays).
    """

    def __init__(self, storage: HDF5Storage, path: str):
        self._owner = Owner(storage)  # the storage owns this: no cycle (``_owner.py``)
        self.path = path

    @property
    def _storage(self) -> HDF5Storage:
        return self._owner()

    @property
    def dataset(self) -> h5py.Dataset:
        return self._storage.h5file[self.path]

    def _wrapped(self) -> h5py.Dataset:
        return self.dataset

    def __getitem__(self, key: Any) -> np.ndarray:
        with reading(self._storage, self.path):
            dataset = self.dataset
            key = _expand_key(key, dataset.shape)
            if _is_simple(key):
                return np.asarray(dataset[key])
            box, relative = _bounding_box(key)
            return np.asarray(dataset[box])[relative]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._storage._check_writable()
        dataset = self.dataset
        written = key  # as numpy reads it: an expanded reversed slice may stop at -1
        key = _expand_key(key, dataset.shape)
        if _is_simple(key):
            target = np.broadcast_to(np.zeros((), bool), dataset.shape)[key].shape
            self._storage._check_room(int(np.prod(target)) * dataset.dtype.itemsize, self.path)
            written_to(
                dataset, key, np.broadcast_to(np.asarray(value, dtype=dataset.dtype), target), self._storage.path
            )
        else:
            box, relative = _bounding_box(key)
            block = np.asarray(dataset[box])
            block[relative] = value
            self._storage._check_room(block.nbytes, self.path)
            written_to(dataset, box, block, self._storage.path)
        self._storage.flush()  # visible at once to memmap readers of the file
        if self.path.startswith("data/"):
            self._storage.rows_rewritten(self.path[len("data/") :], written)

    def __repr__(self) -> str:
        return f"H5Array({self._storage.location!r}, {self.path!r}, shape={self.shape}, dtype={self.dtype})"


def refuse_outside_storage(file: h5py.File, path: str, where: str, writer: str = "replaybuf") -> None:
    """BufferDamagedError naming ``path`` when that dataset (or its group) is a link (external, or
    soft: another field's dataset) or keeps its bytes in other files (external storage, a virtual
    dataset); replaybuf creates none, and through one a writer would write to files outside the
    buffer (a user's), a reader read them. Checked before the path is resolved, which would
    open an external link's file. An absent dataset is left to the caller. ``writer`` names
    who wrote the file (a seed file's is memmap-replay-buffer, which creates none either)."""
    group = file
    for part in path.split("/"):
        link = group.get(part, getlink=True)
        if link is None:
            return
        if not isinstance(link, h5py.HardLink):
            raise BufferDamagedError(
                f"{where}: {path!r} is reached through {type(link).__name__} {getattr(link, 'path', '')!r}"
                f"{' in ' + repr(link.filename) if isinstance(link, h5py.ExternalLink) else ''}, "
                f"where {writer} stores a dataset of this file"
            )
        group = group[part]
    if not isinstance(group, h5py.Dataset):
        return  # a group where a dataset belongs: the layout check names it
    elsewhere = stored_elsewhere(group)
    if elsewhere:
        raise BufferDamagedError(
            f"{where}: dataset {path!r} keeps its data in other files ({elsewhere}), "
            f"where {writer} stores it in this file"
        )


def stored_elsewhere(dataset: h5py.Dataset) -> str | None:
    """'a virtual dataset' or 'external storage' where ``dataset`` keeps its bytes in other
    files (reading it reads them, writing it writes them), else None."""
    plist = dataset.id.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        return "a virtual dataset"
    return "external storage" if plist.get_external_count() else None


def _check_storage_options(options: dict) -> None:
    unknown = sorted(set(options) - set(STORAGE_OPTIONS))
    if unknown:
        raise ValueError(f"hdf5 storage_options: unknown keys {unknown}; expected {list(STORAGE_OPTIONS)}")
    compression = options.get("compression")
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"hdf5 compression must be one of {COMPRESSIONS} or None, got {compression!r}")
    level = options.get("compression_opts")
    if level is not None and (
        compression != "gzip" or isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 9
    ):
        raise ValueError(
            f"hdf5 compression_opts must be a gzip level 0-9 with compression='gzip', got "
            f"{level!r} with compression={compression!r}"
        )


def _reserved(path: str) -> bool:
    """Whether every block of the file at ``path`` is on disk (none sparse)."""
    stat = os.stat(path)
    return stat.st_blocks * 512 >= stat.st_size


class HDF5Storage(LocalFolderStorage):
    """One ``data.h5`` per buffer folder (h5py), with the counters and step log beside it."""

    backend_name = "hdf5"

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        _check_storage_options(storage_options or {})
        super().__init__(location, storage_options, fsync=fsync)
        self.path = os.path.join(self.root, DATA_FILE)
        self._file: h5py.File | None = None
        self._pid: int | None = None
        self._arrays: dict[tuple[str, bool], H5Array] = {}
        self._ram: dict[str, np.ndarray | None] = {}
        self._maps: dict[str, np.ndarray | None] = {}
        self._dirty = False
        self._writer_mark: Any = None
        self._compressed = False
        self._reserved = False

    @property
    def h5file(self) -> h5py.File:
        """The open file, (re)opened in this process: no HDF5 handle crosses a fork."""
        if self._file is None or self._pid != os.getpid() or not self._file.id.valid:
            self._file = self._open_file()
            self._pid = os.getpid()
            if not self.read_only and self._writer_mark is None:
                self._mark_writer()
        return self._file

    def _open_file(self) -> h5py.File:
        mode = "r" if self.read_only else "r+"
        if not self.read_only:  # HDF5 writes the file in place: never through a hard link
            own_file(self.path)
        try:
            file = open_h5(self.path, mode)
        except OSError as e:
            if self.read_only:
                self.check_not_replaced()  # erased by an overwrite: say so
            if self.read_only or "already open for read-only" not in str(e):
                raise
        else:
            try:  # opened by its path, which names a new buffer's file once it was replaced
                self.check_identity(file.id.get_vfd_handle())
            except BufferReplacedError:
                file.close()
                raise
            return file
        # HDF5 cannot open a file for writing while this process holds it read-only: close the
        # readers' handles (they reopen lazily, then sharing the writer's handle) and retry
        for file_id in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
            if os.path.exists(file_id.name) and os.path.samefile(file_id.name, self.path):
                h5py.File(file_id).close()
        return open_h5(self.path, mode)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_file": None, "_pid": None, "_ram": {}, "_maps": {}, "_writer_mark": None}

    # ---- readers beside a writer -----------------------------------------------------------------

    def _mark_writer(self) -> None:
        """Hold a shared lock on the writer mark while open for writing (released on close,
        when a storage never closed is collected, or when the process dies), so readers of a
        compressed file can tell a writer is live."""
        path = os.path.join(self.root, WRITER_MARK)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device: no file to lock and write
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file (a FIFO or a device where the writer mark belongs)", path)
        self._writer_mark = weakref.finalize(self, os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    def refuse_live_writer(self) -> None:
        """A reader of a compressed file: StorageError while a writer in another process has it
        open (HDF5 without SWMR gives such a reader stale chunk locations: wrong bytes)."""
        path = os.path.join(self.root, WRITER_MARK)
        if not (self.read_only and self._compressed and os.path.exists(path)):
            return
        with open(open_stored(path)) as mark:  # a FIFO there is refused, never waited on
            try:
                fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if mark.read(64).strip() != str(os.getpid()):  # this process's writer shares its cache
                    self.close()  # an open handle would keep serving this process stale metadata
                    raise StorageError(
                        f"{self.path!r} is compressed and open for writing by another process: HDF5 "
                        "(without SWMR) cannot be read consistently beside that writer. Read it after "
                        "the writer closes, or store live buffers uncompressed or with the zarr or "
                        "memmap backend"
                    ) from None
            else:
                fcntl.flock(mark, fcntl.LOCK_UN)

    # ---- discovery -----------------------------------------------------------------------------

    def _config(self) -> dict | None:
        if not os.path.isfile(self.path):
            if os.path.lexists(self.path):  # a FIFO, a device or a folder: no buffer file, nor one to erase
                raise BufferDamagedError(
                    f"{self.path}: not a regular file (a FIFO, a device, a folder or a broken link) where the buffer's HDF5 file belongs"
                )
            return None
        try:
            with open_h5(self.path, "r") as f:
                raw = f.attrs.get(CONFIG_ATTRIBUTE)
        except OSError as e:  # truncated or garbage bytes: damage, not "no buffer here"
            raise BufferDamagedError(f"{self.path}: cannot be opened as an HDF5 file ({e})") from None
        if raw is None:
            return None
        config = parse_json(raw.encode() if isinstance(raw, str) else bytes(raw), self._config_where)
        return config if config.get("format") == FORMAT_NAME else None

    @property
    def _config_where(self) -> str:
        return f"attribute {CONFIG_ATTRIBUTE!r} of {self.path}"

    def stored_uuid(self) -> str | None:
        # docstring inherited
        config = self._config()
        return None if config is None else config.get("uuid")

    def exists(self) -> bool:
        # docstring inherited
        return self._config() is not None

    # ---- create / open ---------------------------------------------------------------------------

    @staticmethod
    def _owns(name: str) -> bool:
        return name == DATA_FILE

    reserves_one_file = True  # docstring inherited
    closes_at_refresh = True  # docstring inherited: ``drop_caches`` closes the file of a reader

    def reserved_layouts(self, schema: Schema) -> dict[tuple[str, bool], tuple[tuple[int, ...], np.dtype]]:
        # docstring inherited: every dataset of an uncompressed file (``reserve``); a compressed
        # one's chunks are placed as they are written
        return {} if self.storage_options.get("compression") else expected_layouts(schema)

    def create(self, schema: Schema, overwrite: bool) -> None:
        # docstring inherited
        entries = self.check_creatable()
        self.check_schema(schema)
        self.read_only = False
        self.format_version = FORMAT_VERSION
        self.meta_sums_as_earlier = False
        self.pin_identity(read_only=False)
        self.close()
        if overwrite:
            # data.h5 is unlinked, not truncated: handles still open on the old file stay valid
            erase_owned(self.kv, entries, markers=(DATA_FILE,))
        os.makedirs(self.root, exist_ok=True)
        compression = self.storage_options.get("compression")
        options: dict[str, Any] = {
            "compression": compression,
            "compression_opts": self.storage_options.get("compression_opts"),
        }
        if not compression:
            # every uncompressed dataset placed now (the file's unwritten bytes read as zeros):
            # placed at its first write instead, its metadata changes while live readers read it
            options["dcpl"] = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            options["dcpl"].set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            options["dcpl"].set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        # written whole under a temp name and renamed into place: a reader (of the buffer this
        # one replaces, reopening) never opens a half-created file, whose HDF5 metadata it
        # would read as corrupt (the temp name is one a writable open deletes if left)
        temp = os.path.join(self.root, f".{DATA_FILE}.{uuid.uuid4().hex}.partial")
        try:
            with open_h5(temp, "w-") as f:
                data, meta = f.create_group("data"), f.create_group("meta")
                for field in schema.fields.values():
                    chunks = (1, default_time_chunk(field, schema.max_timesteps), *field.shape) if compression else None
                    data.create_dataset(
                        field.name,
                        shape=(schema.max_episodes, schema.max_timesteps, *field.shape),
                        dtype=field.dtype,
                        chunks=chunks,
                        **options,
                    )
                for field in {**schema.meta_fields, **bookkeeping_fields(schema)}.values():
                    chunks = (min(schema.max_episodes, META_CHUNK_EPISODES), *field.shape) if compression else None
                    meta.create_dataset(
                        field.name,
                        shape=(schema.max_episodes, *field.shape),
                        dtype=field.dtype,
                        chunks=chunks,
                        **options,
                    )
                f.attrs[CONFIG_ATTRIBUTE] = json.dumps(
                    {"format": FORMAT_NAME, "version": FORMAT_VERSION, "backend": self.backend_name, **schema.to_json()}
                )
            if not compression:
                reserve(temp)  # every dataset's block: a write into one never needs new space
            self.commit_state(empty_state())
            self._checksums = EpisodeChecksums.create(self, self.root, list(schema.fields), schema.max_episodes)
            if self.fsync:
                with open(temp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(temp, self.path)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, StorageError):  # h5py's, a full disk
                raise StorageError(f"creating {self.path!r} failed, nothing of it was kept: {e}") from e
            raise
        self._load_arrays(schema)

    def open(self, read_only: bool) -> Schema:
        # docstring inherited
        self.pin_identity(read_only)
        config = self._config()
        if config is None:
            raise BufferNotFoundError(
                f"no replaybuf buffer at {self.location!r} (no {DATA_FILE} with replaybuf config)"
            )
        schema = self._schema_from_config(config, self._config_where)
        self.close()
        self.read_only = read_only
        if not read_only:
            self.kv.prepare_writes()
        # checked before data.h5 is opened for writing: a refused open leaves its bytes as they were
        self._checksums = EpisodeChecksums.open(
            self, self.root, list(schema.fields), schema.max_episodes, config.get("version", 0)
        )
        self._load_arrays(schema)
        return schema

    def warn_ignored_options(self) -> None:
        """Warn where the ``compression`` / ``compression_opts`` given to an open differ from
        those the buffer's fields were created with: the stored ones win, as a file's datasets
        keep the compression they were created with."""
        stored = dict(zip(STORAGE_OPTIONS, self.compression()))
        given = {key: self.storage_options[key] for key in STORAGE_OPTIONS if key in self.storage_options}
        if "compression_opts" not in given and stored["compression"] == given.get("compression"):
            given["compression_opts"] = stored["compression_opts"]  # gzip's default level
        differing = {key: value for key, value in given.items() if value != stored[key]}
        if differing:
            warnings.warn(
                f"{self.path!r} was created with compression={stored['compression']!r}, "
                f"compression_opts={stored['compression_opts']!r}; the {differing} given are ignored: an "
                "existing buffer keeps its compression (convert it to recompress: `replaybuf convert "
                "--backend hdf5 --dst-storage-options`)",
                UserWarning,
                stacklevel=4,
            )

    def _load_arrays(self, schema: Schema) -> None:
        self._arrays = {}
        placed = False
        for (name, meta), expected in self.stored_layouts(schema).items():
            path = f"{'meta' if meta else 'data'}/{name}"
            refuse_outside_storage(self.h5file, path, self.path)
            if path not in self.h5file and meta and name in OPTIONAL_META:
                # an earlier release's buffer: created by a writable open, zeros (``array``) read-only
                if self.read_only:
                    continue
                self.h5file.create_dataset(path, shape=expected[0], dtype=expected[1])
            if path not in self.h5file:
                raise BufferNotFoundError(f"buffer at {self.location!r} is missing the dataset {path!r}")
            dataset = self.h5file[path]
            check_layout(f"dataset {path!r} of {self.path}", dataset.shape, dataset.dtype, expected)
            if meta and not self.read_only and dataset.chunks is None and dataset.id.get_offset() is None:
                # a contiguous meta dataset not yet placed (created so by an earlier release, or
                # just above): placed now, as the zeros it reads as, and flushed below. Placed at
                # its first write instead, the file's metadata would change then, and a writer
                # killed before its next flush (inside an in-place edit, whose first write is
                # meta/_revision) would leave data.h5 unreadable
                dataset[...] = np.zeros(dataset.shape, dataset.dtype)
                placed = True
            self._arrays[name, meta] = H5Array(self, path)
        if placed:
            self.h5file.flush()
        self._compressed = any(array.dataset.compression for array in self._arrays.values())
        # uncompressed datasets of a file with every block on disk: a write needs no new space
        self._reserved = not self._compressed and _reserved(self.path)
        if not self.read_only and not self._compressed and not self._reserved:
            # a file an earlier release created sparse: reserved now where the disk has room
            with contextlib.suppress(StorageError):
                reserve(self.path)
                self._reserved = _reserved(self.path)

    def identity_file(self) -> str:
        # docstring inherited
        return self.path

    def compression(self) -> tuple[str | None, int | None]:
        """(compression, compression_opts) the data fields were created with."""
        dataset = next(array.dataset for (_, meta), array in self._arrays.items() if not meta)
        return dataset.compression, dataset.compression_opts

    # ---- primitives -------------------------------------------------------------------------------

    def array(self, name: str, meta: bool = False) -> H5Array:
        # docstring inherited
        return self._array_named(self._arrays, name, meta)

    # ---- counters --------------------------------------------------------------------------------

    def load_state(self) -> dict:
        # docstring inherited
        if self.read_only:
            self.refuse_live_writer()
            self.close()  # a reader reopens the file to see what the writer flushed since
        return super().load_state()

    def commit_state(self, state: dict) -> None:
        # docstring inherited
        self.flush()
        super().commit_state(state)

    def write_record(self, key: str, data: bytes | memoryview) -> None:
        # docstring inherited: after flushing the file, as every counters commit, so a writer
        # killed while writing rows leaves the file's structure as flushed
        self.flush()
        super().write_record(key, data)

    # ---- batched I/O -------------------------------------------------------------------------------

    def _dataset(self, name: str, meta: bool = False) -> h5py.Dataset:
        return self.h5file[self.array(name, meta).path]

    def _check_room(self, nbytes: int, what: str) -> None:
        """Refuse, before HDF5 writes anything, a write the disk may have no room for: h5py
        reports a failed write of data.h5 only as a warning when it frees a handle, so the bytes
        would be lost silently and a read of them through a memmap would kill the process."""
        if self._reserved:
            return
        self.kv.check_room(nbytes, f"writing {what} into {DATA_FILE}")  # the headroom: HDF5's own metadata
        # a file size limit (``ulimit -f``) cut HDF5's write of a new chunk short: its metadata then
        # named an end past the file's, and data.h5 could no longer be opened, every episode lost
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        grown = os.path.getsize(self.path) + nbytes + WRITE_HEADROOM
        if limit != resource.RLIM_INFINITY and grown > limit:
            raise StorageError(
                f"{self.path!r} may grow to {grown:,} bytes writing {what}, over this process's file size limit "
                f"(RLIMIT_FSIZE, `ulimit -f`) of {limit:,} bytes; nothing was written"
            )

    def check_room(self, names: Sequence[str], steps: int, what: str) -> None:
        # docstring inherited: a compressed data.h5 may write every step whole
        if self._reserved:
            return
        datasets = [self._dataset(name) for name in names]
        step_bytes = sum(int(np.prod(d.shape[2:], dtype=np.int64)) * d.dtype.itemsize for d in datasets)
        self._check_room(steps * step_bytes, what)

    def write_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        # docstring inherited
        self._check_writable()
        self._check_room(np.asarray(values).nbytes, f"data/{name}")
        episodes = np.asarray(episodes)
        order = _ascending_last(episodes)
        written_to(
            self._dataset(name),
            (episodes[order], slice(t0, t0 + values.shape[1])),
            np.asarray(values)[order],
            self.path,
        )
        self._dirty = True

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        # docstring inherited
        self._check_writable()
        self._check_room(np.asarray(values).nbytes, f"meta/{name}")
        episodes = np.asarray(episodes)
        if name == "episode_lens" and self._checksums is not None:
            self._checksums.seal(episodes, values)  # before the length publishes the episode
        order = _ascending_last(episodes)
        dataset = self._dataset(name, meta=True)
        values = np.broadcast_to(np.asarray(values, dataset.dtype), (len(episodes), *dataset.shape[1:]))[order]
        written_to(dataset, episodes[order], values, self.path)
        self._dirty = True

    def data_file(self, name: str, meta: bool = False) -> str:
        # docstring inherited
        return f"{self.path}:/{'meta' if meta else 'data'}/{name}"

    def unchecked_rows(self, name: str, episodes: np.ndarray, t0: int, t1: int) -> np.ndarray:
        # docstring inherited
        mapped = self._row_map(name)
        if mapped is not None:
            return mapped[np.asarray(episodes), t0:t1]
        unique, inverse = np.unique(np.asarray(episodes), return_inverse=True)
        with reading(self, f"data/{name}"):
            try:
                rows = np.asarray(self._dataset(name)[unique, t0:t1])
            except OSError as e:
                if self.read_only:
                    self.refuse_live_writer()  # a writer that started during the read: say so
                raise CorruptChunkError(
                    f"data/{name}: slots {unique.tolist()}, timesteps {t0}..{t1 - 1}: {e} ({self.data_file(name)})",
                    field=f"data/{name}",
                    location=self.data_file(name),
                ) from e
        return rows[inverse.reshape(-1)]

    def _read_spans(
        self, name: str, spans: Spans, out: np.ndarray, parallel: bool, generations: np.ndarray | None
    ) -> None:
        # docstring inherited: whole episodes (trajectory batches) in one checked read_rows,
        # not one per distinct length, each of which reads the lengths again
        if len(spans) == 0 or spans.starts.any():
            read_spans_by_rows(self, name, spans, out)
            return
        try:
            rows = self.read_rows(name, spans.episodes, 0, int(spans.lengths.max()))
        except CorruptChunkError:
            if len(spans) == 1:
                raise
            for i in range(len(spans)):  # the damaged episode, by name
                one = None if generations is None else generations[i : i + 1]
                self._read_spans(name, spans[i : i + 1], out[i : i + 1], parallel, one)
            raise
        for i, length in enumerate(spans.lengths.tolist()):
            out[i, :length] = rows[i, :length]

    def gather(
        self, name: str, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        episodes, timesteps = np.asarray(episodes), np.asarray(timesteps)
        if self._dirty:
            self.flush()  # HDF5 may still hold written bytes that a memmap of the file cannot see
        fast = self._mapped(name)
        if fast is not None and self._checksums is not None:  # fields with a private checked copy
            checked = self._checksums.gather(name, fast, episodes, timesteps, self._lens_now())
            if checked is not None:
                return checked
        if fast is not None:
            return fast[episodes, timesteps]
        # chunked (compressed) data, each sampled episode checked whole once first (lzf keeps no
        # checksum of its own): a small field from a copy in RAM, else one hyperslab read per step
        # decodes only the chunk it needs
        fast = self._small_field(name)
        if self._checksums is not None:
            committed = self._lens_now()[episodes]
            sampled, lengths = episodes[timesteps < committed], committed[timesteps < committed]
            try:
                self._checksums.check_once(name, fast, sampled, lengths)
            except CorruptChunkError:
                if fast is None:
                    raise
                self._ram.pop(name, None)  # a copy older than an in-place rewrite: loaded again
                fast = self._small_field(name)
                self._checksums.check_once(name, fast, sampled, lengths)
        if fast is not None:
            return fast[episodes, timesteps]
        dataset = self._dataset(name)
        pairs, inverse = np.unique(np.stack([episodes, timesteps], axis=1), axis=0, return_inverse=True)
        rows = np.empty((len(pairs), *dataset.shape[2:]), dtype=dataset.dtype)
        with reading(self, f"data/{name}"):
            for i, (episode, t) in enumerate(pairs.tolist()):
                try:
                    rows[i] = dataset[episode, t]
                except OSError as e:
                    if self.read_only:
                        self.refuse_live_writer()
                    raise CorruptChunkError.at(f"data/{name}", episode, (t, t + 1), self.data_file(name), str(e)) from e
        return rows[inverse.reshape(-1)]

    def _row_map(self, name: str) -> np.ndarray | None:
        # docstring inherited: ``_mapped`` after writing out what this process has buffered
        if self._dirty:
            self.flush()
        return self._mapped(name)

    def _mapped(self, name: str) -> np.ndarray | None:
        """A read-only map of an uncompressed, contiguous data field's bytes in data.h5
        (HDF5 stores such a dataset as one C-order block at a fixed offset), or None."""
        if self._maps.get(name) is None:
            dataset = self._dataset(name)
            if dataset.chunks is not None or dataset.compression is not None:
                return None
            offset = dataset.id.get_offset()  # None until the first write allocates the block
            try:
                mapped = None if offset is None else self._map_block(offset, dataset.dtype, dataset.shape)
            except (OSError, ValueError):  # erased, or another (shorter) file: replaced, said below
                if self.read_only:
                    self.check_not_replaced()
                raise
            if self.read_only:  # mapped by its path, which names a new buffer's file once it was replaced
                self.check_not_replaced()
            self._maps[name] = mapped
        return self._maps[name]

    def _map_block(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only map of data.h5's bytes at ``offset`` that holds no file descriptor: a
        reader of hundreds of hdf5 shards kept one per field and ran out of the open-file limit."""
        fd = open_stored(self.path)
        try:
            return map_array(fd, offset, dtype, shape)
        finally:
            os.close(fd)

    def _small_field(self, name: str) -> np.ndarray | None:
        """A reader's copy in RAM of a data field of at most SMALL_FIELD_BYTES (vectors, scalars):
        random reads from it cost nothing; dropped whenever the reader refreshes."""
        if not self.read_only:
            return None
        if name not in self._ram:
            dataset = self._dataset(name)
            with reading(self, f"data/{name}"):
                small = dataset.size * dataset.dtype.itemsize <= SMALL_FIELD_BYTES
                self._ram[name] = dataset[()] if small else None
        return self._ram[name]

    def read_meta(self, name: str) -> np.ndarray:
        # docstring inherited
        array = self.array(name, meta=True)
        if isinstance(array, AbsentMeta):
            return array[:]
        with reading(self, f"meta/{name}"):
            return np.asarray(self.h5file[array.path][()])

    # ---- lifecycle -----------------------------------------------------------------------------------

    def flush(self) -> None:
        # docstring inherited
        if self.read_only or self._file is None or not self._file.id.valid:
            return
        try:
            self._file.flush()
        except (OSError, RuntimeError) as e:  # HDF5's failed writes (a full disk, a file size limit)
            raise StorageError(f"writing {self.path!r} failed: {e}") from e
        self._dirty = False
        if self.fsync:
            with open(self.path, "rb") as f:
                os.fsync(f.fileno())

    def drop_caches(self) -> None:
        # docstring inherited: a reader reopens the file and rereads the fields it keeps in RAM,
        # and takes the ``OPTIONAL_META`` datasets a writable open created since it opened
        if self.read_only:
            self.close()
            for name in OPTIONAL_META:
                path = f"meta/{name}"
                if (name, True) not in self._arrays and ("episode_lens", True) in self._arrays and path in self.h5file:
                    self._arrays[name, True] = H5Array(self, path)

    def close(self) -> None:
        # docstring inherited
        failed: Exception | None = None
        if self._file is not None and self._pid == os.getpid() and self._file.id.valid:
            try:  # a failed flush still closes the file and releases the lease below
                self.flush()
            except StorageError as e:
                failed = e
            try:
                self._file.close()
            except (OSError, RuntimeError) as e:  # HDF5 writes the file's superblock as it closes
                failed = failed or e
        self._file = None
        self._ram, self._maps = {}, {}
        if self._checksums is not None:
            self._checksums.release()
        if self._writer_mark is not None:
            self._writer_mark()  # closes the mark's descriptor: releases the lock
            self._writer_mark = None
        self.kv.close()
        if failed is not None:
            raise StorageError(
                f"closing {self.path!r} failed: {failed}; every episode committed before is kept"
            ) from failed

    def describe(self) -> dict:
        # docstring inherited
        arrays = {}
        for (name, meta), array in self._arrays.items():
            dataset = array.dataset
            compression = dataset.compression
            if compression == "gzip":
                compression = f"gzip:{dataset.compression_opts}"
            arrays[f"{'meta' if meta else 'data'}/{name}"] = {
                "shape": dataset.shape,
                "chunks": dataset.chunks,
                "dtype": dataset.dtype.name,
                "compressor": compression or "none",
                "stored_bytes": int(dataset.id.get_storage_size()),
                "raw_bytes": int(dataset.size * dataset.dtype.itemsize),
            }
        return {
            **super().describe(),
            "format": "replaybuf hdf5",
            "file_bytes": os.path.getsize(self.path),
            "arrays": arrays,
        }
