"""The raw backend: one numpy ``.npy`` memmap per field, for the fastest local sampling.

Layout of a folder (every array readable with ``numpy.load(path, mmap_mode='r')``)::

    replaybuf.json                 {"format": "replaybuf", "version": 1, "backend": "memmap", <schema>}
    <field>.data.npy               (max_episodes, max_timesteps, *shape)
    <meta>.data.meta.npy           (max_episodes, *shape), incl. episode_lens and _generation
    replaybuf/state.json           the counters, replaced atomically (temp file + rename)
    replaybuf/checksums.npy        format 2: a crc32c per committed (field, episode), ``_local.py``
                                   (format 3: each entry tagged so that it checks itself)
    _meta_sum.data.meta.npy        format 4: a checksum of each slot's meta values (``metasums.py``)
    replaybuf/steplog/             the step log of episodes in progress
    replaybuf/writing              the slots being written in place (``Storage.mark_writing``)

The file names are those of memmap-replay-buffer 0.2.x, whose folders this backend also opens
(``_seed.py``). A seed folder opened read-only is read as it is, nothing written. Opened for
writing it is adopted: ``_generation.data.meta.npy``, ``replaybuf/state.json`` and
``replaybuf.json`` (with ``"origin": "memmap-replay-buffer"``) are added, the seed's episode in
progress is committed at its current length, and every later counter commit is mirrored into
the seed's ``*.state.npy`` files, so the seed library can still open and extend the folder.
``metadata.pkl`` and the seed's arrays are left in place. When the seed library has written to
an adopted folder since (its counters no longer match the mirror), the folder is adopted again
from the seed's counters on the next open (read-only opens derive them in RAM).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from ..schema import FORMAT_NAME, FORMAT_VERSION, Schema
from . import _seed
from ._kv import copy_spans, open_stored, own_file
from ._local import NPY_HEADERS as _OPENING
from ._local import EpisodeChecksums, LocalFolderStorage, map_npy, read_npy_header
from ._owned import erase_owned
from ._owner import Owner
from .base import (
    OPTIONAL_META,
    STATE_KEY,
    AbsentMeta,
    BufferDamagedError,
    BufferNotFoundError,
    StorageError,
    WrappedArray,
    check_layout,
    empty_state,
    expected_layouts,
    parse_json,
    refuse_unencodable_names,
    warn_local_options,
)
from .spans import Spans

CONFIG_FILE = "replaybuf.json"
# a config is a few KiB; more is not one (a link to /dev/zero would otherwise be read until RAM ends)
MAX_CONFIG_BYTES = 16 << 20
SEED_ORIGIN = "memmap-replay-buffer"
# the arrays and the seed's counters: <field>.data.npy, <meta>.data.meta.npy, <name>.state.npy
_OWNED_SUFFIXES = (".data.npy", ".data.meta.npy", ".state.npy")


def array_filename(name: str, meta: bool) -> str:
    return f"{name}.data.meta.npy" if meta else f"{name}.data.npy"


def _npy_layout(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a ``.npy`` header, after checking the file holds every byte they
    imply: mapping a short file for writing would zero-extend it silently."""
    try:
        with _OPENING, open(path, "rb") as f:  # the header parse is np.load's (see _OPENING)
            shape, fortran, dtype = read_npy_header(f)
            offset = f.tell()
    except _seed.NPY_HEADER_ERRORS as e:
        if _seed.out_of_descriptors(e):
            raise
        raise BufferDamagedError(f"{path}: not a readable .npy file ({e})") from None
    if fortran or dtype.hasobject:
        raise BufferDamagedError(f"{path}: holds a Fortran-ordered or object array, replaybuf writes neither")
    size, needed = os.path.getsize(path), offset + int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if size < needed:
        raise BufferDamagedError(
            f"{path}: {size} bytes, its header ({dtype}{list(shape)}) needs {needed}: the file was truncated"
        )
    return shape, dtype


class MemmapArray(WrappedArray):
    """``buffer.data[name]``: numpy indexing on a ``.npy`` memmap that is opened lazily.

    It pickles as its path (DataLoader workers map the file themselves), never as its data.
    """

    def __init__(self, storage: MemmapStorage, path: str, name: str | None = None):
        self._owner = Owner(storage)  # the storage owns this: no cycle (``_owner.py``)
        self.path = path
        self.name = name  # a data field's name: in-place writes recompute its checksums
        self._memmap: np.ndarray | None = None
        self._plain: np.ndarray | None = None

    @property
    def _storage(self) -> MemmapStorage:
        return self._owner()

    @property
    def writable(self) -> bool:
        return not self._storage.read_only

    @property
    def memmap(self) -> np.ndarray:
        """The array over the file: an ``np.memmap`` for a writer, a read-only map holding no file
        descriptor for a reader (``map_npy``)."""
        memmap = self._memmap
        if memmap is None or memmap.flags.writeable != self.writable:
            # one open at a time: parallel read tasks open arrays lazily, and np.load's header
            # parse (ast.literal_eval) is not thread-safe on Python 3.11 ("AST constructor
            # recursion depth mismatch")
            with _OPENING:
                memmap = self._memmap
                if memmap is None or memmap.flags.writeable != self.writable:
                    try:
                        if self.writable:  # a memmap writes in place: never through a hard link
                            own_file(self.path)
                        memmap = map_npy(self.path, self.writable)
                    except FileNotFoundError:
                        self._storage.check_not_replaced()  # erased by an overwrite: say so
                        raise
                    # mapped by its path, which names a new buffer's file once it was replaced
                    self._storage.check_not_replaced()
                    self._memmap = memmap
        return memmap

    @property
    def plain(self) -> np.ndarray:
        """``memmap`` as a plain ndarray over the same pages, for reads: a slice of an
        np.memmap costs ~2 us of its ``__array_finalize__``, and a batch of short trajectories
        takes one per episode and field."""
        memmap = self.memmap
        plain = self._plain
        if plain is None or plain.base is not memmap:
            plain = self._plain = memmap.view(np.ndarray)
        return plain

    def _wrapped(self) -> np.ndarray:
        return self.memmap

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.asarray(self.memmap[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        if not self.writable:
            raise PermissionError(f"{self.path!r} was opened read-only; writing is not allowed")
        self.memmap[key] = value
        if self.name is not None:
            self._storage.rows_rewritten(self.name, key)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array(self.memmap, dtype=dtype)  # a copy: never a view that writes to the file

    def flush(self) -> None:
        if isinstance(self._memmap, np.memmap) and self._memmap.mode != "r":
            self._memmap.flush()

    def release(self) -> None:
        self._memmap = self._plain = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_memmap": None, "_plain": None}

    def __repr__(self) -> str:
        return f"MemmapArray({self.path!r}, shape={self.shape}, dtype={self.dtype})"


class MemmapStorage(LocalFolderStorage):
    """``.npy`` memmaps in a local folder; opens memmap-replay-buffer 0.2.x folders too."""

    backend_name = "memmap"

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        warn_local_options(location, storage_options or {}, self.backend_name)
        super().__init__(location, storage_options, fsync=fsync)
        self._arrays: dict[tuple[str, bool], MemmapArray] = {}
        self._seed_view: _seed.SeedState | None = None
        self._seed_limits: tuple[int, int] = (0, 0)  # (max_episodes, max_timesteps), set by open
        self._seed_origin = False

    # ---- discovery ----------------------------------------------------------------------------

    def _config(self) -> dict | None:
        path = os.path.join(self.root, CONFIG_FILE)
        try:
            with open(open_stored(path), "rb") as f:  # a FIFO there is refused, never waited on
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except FileNotFoundError:
            return None
        except IsADirectoryError:  # the read names the descriptor, not the file
            raise BufferDamagedError(
                f"{path}: not a regular file (a FIFO, a device, a folder or a broken link) where the buffer's "
                "config belongs"
            ) from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise BufferDamagedError(f"{path}: over {MAX_CONFIG_BYTES} bytes, not a buffer config")
        config = parse_json(raw, path)
        if config.get("format") != FORMAT_NAME or config.get("backend") != self.backend_name:
            # the file's name is this backend's config's: naming another format or backend, it is damaged
            raise BufferDamagedError(
                f"{path}: names format {config.get('format')!r} and backend {config.get('backend')!r}, expected "
                f"{FORMAT_NAME!r} and {self.backend_name!r} (a damaged config)"
            )
        return config

    def stored_uuid(self) -> str | None:
        # docstring inherited
        config = self._config()
        return None if config is None else config.get("uuid")

    def exists(self) -> bool:
        # docstring inherited
        return self._config() is not None or _seed.is_seed_folder(self.root)

    # ---- create / open --------------------------------------------------------------------------

    @staticmethod
    def _owns(name: str) -> bool:
        # a file of a replaybuf memmap buffer or of a seed folder
        return name.endswith(_OWNED_SUFFIXES) or name in (CONFIG_FILE, _seed.METADATA_FILE)

    def reserved_layouts(self, schema: Schema) -> dict[tuple[str, bool], tuple[tuple[int, ...], np.dtype]]:
        # docstring inherited: every array, allocated whole (``_allocate``)
        return expected_layouts(schema)

    def check_schema(self, schema: Schema) -> None:
        # docstring inherited: and each field names a file (``<name>.data.npy``)
        refuse_unencodable_names(schema, f"creating the memmap buffer at {self.location!r}")
        super().check_schema(schema)

    def create(self, schema: Schema, overwrite: bool) -> None:
        # docstring inherited
        entries = self.check_creatable()
        self.check_schema(schema)
        self.read_only = False
        self.format_version = FORMAT_VERSION
        self.meta_sums_as_earlier = False
        self.pin_identity(read_only=False)
        if overwrite:
            erase_owned(
                self.kv,
                entries,
                markers=(CONFIG_FILE, _seed.METADATA_FILE),
                first=(os.path.basename(self.identity_file()),),
            )
        os.makedirs(self.root, exist_ok=True)
        # the counters first: a create killed while allocating (seconds for a large buffer)
        # leaves arrays the next overwrite recognises as a create's (``check_creatable``),
        # instead of refusing them as the user's
        self.commit_state(empty_state())
        self._arrays = {}
        made: list[str] = []
        try:
            for (name, meta), (shape, dtype) in expected_layouts(schema).items():
                made.append(os.path.join(self.root, array_filename(name, meta)))
                self._allocate(name, meta, shape, dtype)
        except BaseException:
            # the arrays allocated before the one that failed (a full disk) were left behind: a
            # half buffer no open reads, holding their space (a 154 MB field beside a 123 GB one)
            self._arrays = {}
            for path in [*made, os.path.join(self.root, STATE_KEY)]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        self._checksums = EpisodeChecksums.create(self, self.root, list(schema.fields), schema.max_episodes)
        self._write_config(schema)

    def _allocate(self, name: str, meta: bool, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Create a zero-filled ``.npy`` with all its blocks reserved on disk: a memmap write
        to a page the disk has no room for kills the process with SIGBUS, so a full disk is
        a StorageError here, naming the file, and never later."""
        path = os.path.join(self.root, array_filename(name, meta))
        try:
            array = open_memmap(path, mode="w+", dtype=dtype, shape=shape)
            with open(path, "r+b") as f:
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise StorageError(
                f"cannot allocate {path!r} ({np.dtype(dtype)}{list(shape)}, "
                f"{np.prod(shape, dtype=np.int64) * np.dtype(dtype).itemsize} bytes): {e.strerror or e}"
            ) from e
        if self.fsync:
            array.flush()
        del array
        self._arrays[name, meta] = MemmapArray(self, path, None if meta else name)

    def _write_config(self, schema: Schema, **extra: Any) -> None:
        config = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "backend": self.backend_name,
            **schema.to_json(),
            **extra,
        }
        self.kv.set(CONFIG_FILE, json.dumps(config, indent=1).encode())

    def open(self, read_only: bool) -> Schema:
        # docstring inherited
        self.pin_identity(read_only)
        config = self._config()
        self._seed_view = None
        if config is not None:
            schema = self._schema_from_config(config, os.path.join(self.root, CONFIG_FILE))
            self._seed_origin = config.get("origin") == SEED_ORIGIN
        elif _seed.is_seed_folder(self.root):
            schema = _seed.read_seed_schema(self.root)
            self._seed_origin = True
            self.format_version = None
        else:
            raise BufferNotFoundError(
                f"no replaybuf memmap buffer at {self.location!r} "
                f"(neither {CONFIG_FILE} nor a memmap-replay-buffer metadata.pkl)"
            )
        refuse_unencodable_names(schema, f"opening the memmap buffer at {self.location!r}")
        self._seed_limits = (schema.max_episodes, schema.max_timesteps)
        if not read_only and self._seed_origin:
            self._check_seed_flags()
        if not read_only:
            self.kv.prepare_writes()  # before adopting a seed folder writes anything
        self.read_only = read_only
        adopting = config is None or (self._seed_origin and self._seed_wrote_since())
        self._open_arrays(schema, skip_generation=config is None)
        # folders the seed library may write to keep none: it would not update them
        self._checksums = (
            None
            if self._seed_origin
            else EpisodeChecksums.open(
                self,
                self.root,
                list(schema.fields),
                schema.max_episodes,
                (config or {}).get("version", 0),
            )
        )
        if adopting and read_only:
            self._seed_view = self._read_seed_state()
        elif adopting:
            self._adopt_seed_folder(schema)
        return schema

    @property
    def keeps_meta_sums(self) -> bool:
        # docstring inherited: a folder the seed library may write to keeps none (it would
        # leave them stale)
        return super().keeps_meta_sums and not self._seed_origin

    @property
    def seed_may_write(self) -> bool:
        # docstring inherited
        return self._seed_origin

    def writable_open_refusals(self) -> list[str]:
        # docstring inherited: a seed folder's ``_initted`` flags
        try:
            if self._seed_origin:
                self._check_seed_flags()
        except BufferDamagedError as e:
            return [str(e)]
        return []

    def _check_seed_flags(self) -> None:
        """Refuse a damaged ``_initted`` array of a seed folder (object dtype, truncated, another
        shape) before a writable open writes anything: each commit sets its flag of the next
        slot (``write_seed_state``), which failed with numpy's unnamed error after the folder
        was half adopted."""
        path = os.path.join(self.root, _seed.SEED_FLAGS_FILE)
        if os.path.lexists(path):  # the seed makes it; a folder without it is kept without
            if not os.path.isfile(path):
                raise BufferDamagedError(f"{path}: not a regular file (a FIFO, a device, a folder or a broken link)")
            check_layout(path, *_npy_layout(path), ((self._seed_limits[0],), np.dtype(bool)))

    def _read_seed_state(self) -> _seed.SeedState:
        """The seed's counters, checked against this folder's config (``open`` sets ``_seed_limits``)."""
        return _seed.SeedState.read(self.root, *self._seed_limits)

    def _seed_wrote_since(self) -> bool:
        """Whether the seed library wrote to an adopted folder after replaybuf last committed."""
        seed_state, state = self._read_seed_state(), super().load_state()
        return (seed_state.timestep_index, seed_state.num_episodes, seed_state.episode_index) != (
            0,
            state["num_episodes"],
            state["episode_index"],
        )

    def _open_arrays(self, schema: Schema, skip_generation: bool) -> None:
        self._arrays = {}
        for (name, meta), expected in self.stored_layouts(schema).items():
            if skip_generation and name == "_generation":
                continue
            path = os.path.join(self.root, array_filename(name, meta))
            if not os.path.isfile(path) and meta and name in OPTIONAL_META:
                # an earlier release's buffer: created by a writable open, zeros (``array``) read-only
                if not self.read_only:
                    self._allocate(name, meta, *expected)
                continue
            if not os.path.isfile(path):
                if os.path.lexists(path):  # a FIFO, a device or a folder: damage, not a missing file
                    raise BufferDamagedError(
                        f"{path}: not a regular file (a FIFO, a device, a folder or a broken link) where the buffer's array belongs"
                    )
                raise BufferNotFoundError(f"buffer at {self.location!r} is missing {os.path.basename(path)!r}")
            check_layout(path, *_npy_layout(path), expected)
            self._arrays[name, meta] = MemmapArray(self, path, None if meta else name)

    def _adopt_seed_folder(self, schema: Schema) -> None:
        """Take over a seed folder for writing (see the module docstring); safe to redo if killed."""
        seed_state = self._read_seed_state()
        lens_array = self._arrays["episode_lens", True]
        lens = seed_state.episode_lens(lens_array[:])
        generations = seed_state.generations(lens, schema.max_episodes)
        self._allocate("_generation", True, (schema.max_episodes,), np.dtype("int64"))
        self._arrays["_generation", True][:] = generations
        lens_array[:] = lens
        self._flush_arrays()
        self.commit_state(seed_state.replaybuf_state(lens, schema.max_episodes))
        self._write_config(schema, origin=SEED_ORIGIN)

    # ---- primitives ------------------------------------------------------------------------------

    def array(self, name: str, meta: bool = False) -> MemmapArray:
        # docstring inherited
        if self._seed_view is not None and name == "_generation" and meta:
            raise KeyError(
                "a memmap-replay-buffer folder opened read-only has no _generation array; use read_meta('_generation')"
            )
        return self._array_named(self._arrays, name, meta)

    # ---- counters and the step log ------------------------------------------------------------

    def load_state(self) -> dict:
        # docstring inherited
        if self._seed_view is not None:
            self._seed_view = self._read_seed_state()
            return self._seed_view.replaybuf_state(self.read_meta("episode_lens"), self._max_episodes())
        return super().load_state()

    def commit_state(self, state: dict) -> None:
        # docstring inherited
        if self.fsync:
            self._flush_arrays()
        super().commit_state(state)
        if self._seed_origin:
            _seed.write_seed_state(self.root, state)

    # ---- batched I/O ------------------------------------------------------------------------------

    def write_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        # docstring inherited
        self._check_writable()
        self.array(name).memmap[np.asarray(episodes), t0 : t0 + values.shape[1]] = values

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        # docstring inherited
        self._check_writable()
        if name == "episode_lens" and self._checksums is not None:
            self._checksums.seal(episodes, values)  # before the length publishes the episode
        if self.fsync and name == "episode_lens":
            self._flush_arrays()
        self.array(name, meta=True).memmap[np.asarray(episodes)] = values

    def _lens_now(self) -> np.ndarray:
        # docstring inherited: the mapped file, not a copy
        return self._arrays["episode_lens", True].plain

    def data_file(self, name: str, meta: bool = False) -> str:
        # docstring inherited: the field's file
        return self.array(name, meta).path

    def unchecked_rows(self, name: str, episodes: np.ndarray, t0: int, t1: int) -> np.ndarray:
        # docstring inherited
        return self.array(name).plain[np.asarray(episodes), t0:t1]

    def _row_map(self, name: str) -> np.ndarray | None:
        # docstring inherited
        return self.array(name).plain

    def _read_spans(
        self, name: str, spans: Spans, out: np.ndarray, parallel: bool, generations: np.ndarray | None
    ) -> None:
        # docstring inherited: one copy per episode straight from the page cache into ``out``
        memmap = self.array(name).plain
        rows = [
            (i, e, s, n)
            for i, (e, s, n) in enumerate(zip(spans.episodes.tolist(), spans.starts.tolist(), spans.lengths.tolist()))
            if n > 0
        ]

        expected, committed = [0] * len(rows), [0] * len(rows)
        checksums = self._checksums
        if checksums is not None and rows:
            items, picked, first, read = (np.array(column, dtype=np.int64) for column in zip(*rows))
            now = self._lens_now()[picked]
            expected = checksums.expected(name, picked, np.where(first == 0, read, 0), now)
            served = checksums.serve_kept(name, memmap, out, items, picked, first, read, now, expected)
            rest = np.flatnonzero(~served).tolist()
            rows = [rows[k] for k in rest]
            committed, expected = now[rest].tolist(), [expected[k] for k in rest]
            # windows holding steps of an episode, not all of it: checked once
            partial = [k for k, value in enumerate(expected) if not value and rows[k][2] < committed[k]]
            checksums.check_once(name, memmap, picked[rest][partial], now[rest][partial])

        def copy(k: int) -> None:
            i, e, s, n = rows[k]
            if checksums is None:
                out[i, :n] = memmap[e, s : s + n]
            else:
                checksums.copy_row(name, memmap, e, s, out[i, :n], committed[k], expected[k])

        copy_spans(len(rows), copy, out.nbytes, parallel)

    def gather(
        self, name: str, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited: fields with a private checked copy are served from it
        mapped, episodes, timesteps = self.array(name).plain, np.asarray(episodes), np.asarray(timesteps)
        if self._checksums is not None:
            checked = self._checksums.gather(name, mapped, episodes, timesteps, self._lens_now())
            if checked is not None:
                return checked
        return mapped[episodes, timesteps]

    def read_meta(self, name: str) -> np.ndarray:
        # docstring inherited
        if self._seed_view is not None and name in ("episode_lens", "_generation"):
            lens = self._seed_view.episode_lens(self._arrays["episode_lens", True][:])
            return lens if name == "episode_lens" else self._seed_view.generations(lens, len(lens))
        array = self.array(name, meta=True)
        return array[:] if isinstance(array, AbsentMeta) else np.array(array.memmap)

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        # docstring inherited
        if self._seed_view is not None and name in ("episode_lens", "_generation"):
            return self.read_meta(name)[np.asarray(episodes, dtype=np.int64)]
        return super().read_meta_rows(name, episodes)

    def identity_file(self) -> str:
        # docstring inherited
        return os.path.join(self.root, array_filename("episode_lens", True))

    def _max_episodes(self) -> int:
        return self._arrays["episode_lens", True].shape[0]

    # ---- lifecycle -----------------------------------------------------------------------------------

    def _flush_arrays(self) -> None:
        for array in self._arrays.values():
            array.flush()

    def flush(self) -> None:
        # docstring inherited
        if not self.read_only:
            self._flush_arrays()

    def drop_caches(self) -> None:
        # docstring inherited: a reader of a buffer an earlier release wrote takes the
        # ``OPTIONAL_META`` arrays a writable open created since it opened
        for name in OPTIONAL_META:
            path = os.path.join(self.root, array_filename(name, True))
            if (name, True) in self._arrays or not os.path.isfile(path):
                continue
            try:
                check_layout(path, *_npy_layout(path), ((self._max_episodes(),), OPTIONAL_META[name]))
            except (BufferDamagedError, ValueError, OSError):
                continue  # being allocated by the writer now: taken by a later refresh
            self._arrays[name, True] = MemmapArray(self, path)

    def close(self) -> None:
        # docstring inherited
        self.flush()
        for array in self._arrays.values():
            array.release()
        if self._checksums is not None:
            self._checksums.release()
        self.kv.close()

    def describe(self) -> dict:
        # docstring inherited
        arrays = {}
        for (name, meta), array in self._arrays.items():
            stat = os.stat(array.path)
            arrays[f"{'meta' if meta else 'data'}/{name}"] = {
                "shape": array.shape,
                "chunks": None,
                "dtype": array.dtype.name,
                "compressor": "none",
                "stored_bytes": min(stat.st_size, stat.st_blocks * 512),
                "raw_bytes": int(array.memmap.nbytes),
                "file": os.path.basename(array.path),
            }
        return {
            **super().describe(),
            "format": "memmap-replay-buffer 0.2.x" if self._seed_view is not None else "replaybuf memmap",
            "arrays": arrays,
        }
