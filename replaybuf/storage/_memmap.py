"""The raw backend: one numpy ``.npy`` memmap per field, for the fastest local sampling.

Layout of a folder (every array readable with ``numpy.load(path, mmap_mode='r')``)::

    replaybuf.json                 {"format": "replaybuf", "version": 1, "backend": "memmap", <schema>}
    <field>.data.npy               (max_episodes, max_timesteps, *shape)
    <meta>.data.meta.npy           (max_episodes, *shape), incl. episode_lens and _generation
    replaybuf/state.json           the counters, replaced atomically (temp file + rename)
    replaybuf/steplog/             the step log of episodes in progress

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

import json
import os
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from ..schema import FORMAT_NAME, FORMAT_VERSION, Schema
from . import _seed
from ._kv import KVBlobs, LocalKV, thread_pool
from ._local import local_root, refuse_foreign_buffer
from .base import BufferNotFoundError, Storage, bookkeeping_fields, empty_state

CONFIG_FILE = "replaybuf.json"
SEED_ORIGIN = "memmap-replay-buffer"
_BLOB_DIR = "replaybuf"


def array_filename(name: str, meta: bool) -> str:
    return f"{name}.data.meta.npy" if meta else f"{name}.data.npy"


class MemmapArray:
    """``buffer.data[name]``: numpy indexing on a ``.npy`` memmap that is opened lazily.

    It pickles as its path (DataLoader workers map the file themselves), never as its data.
    """

    def __init__(self, storage: Storage, path: str):
        self._storage = storage
        self.path = path
        self._memmap: np.memmap | None = None

    @property
    def writable(self) -> bool:
        return not self._storage.read_only

    @property
    def memmap(self) -> np.memmap:
        if self._memmap is None or (self._memmap.mode == "r") == self.writable:
            self._memmap = np.load(self.path, mmap_mode="r+" if self.writable else "r")
        return self._memmap

    @property
    def shape(self) -> tuple[int, ...]:
        return self.memmap.shape

    @property
    def dtype(self) -> np.dtype:
        return self.memmap.dtype

    @property
    def ndim(self) -> int:
        return self.memmap.ndim

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        return np.asarray(self.memmap[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        if not self.writable:
            raise PermissionError(f"{self.path!r} was opened read-only; writing is not allowed")
        self.memmap[key] = value

    def __array__(self, dtype=None, copy=None):
        array = np.array(self.memmap)
        return array if dtype is None else array.astype(dtype)

    def flush(self) -> None:
        if self._memmap is not None and self._memmap.mode != "r":
            self._memmap.flush()

    def release(self) -> None:
        self._memmap = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_memmap": None}

    def __repr__(self) -> str:
        return f"MemmapArray({self.path!r}, shape={self.shape}, dtype={self.dtype})"


class MemmapStorage(KVBlobs, Storage):
    """``.npy`` memmaps in a local folder; opens memmap-replay-buffer 0.2.x folders too."""

    backend_name = "memmap"
    supports_remote = False
    supports_field_codecs = False  # per-field ``compressor`` specs do not apply here

    def __init__(self, location: str, storage_options: dict | None = None, *, fsync: bool = False):
        super().__init__(location, storage_options, fsync=fsync)
        self.root = local_root(self)
        self.kv = LocalKV(self.root, fsync=fsync)
        self._arrays: dict[tuple[str, bool], MemmapArray] = {}
        self._seed_view: _seed.SeedState | None = None
        self._seed_origin = False

    # ---- discovery ----------------------------------------------------------------------------

    def _config(self) -> dict | None:
        try:
            with open(os.path.join(self.root, CONFIG_FILE), "rb") as f:
                config = json.loads(f.read())
        except FileNotFoundError:
            return None
        return config if config.get("format") == FORMAT_NAME and config.get("backend") == self.backend_name else None

    @classmethod
    def can_open(cls, location: str, storage_options: dict | None = None) -> bool:
        # docstring inherited
        if "://" in str(location) and not str(location).startswith("file://"):
            return False
        return cls(location, storage_options).exists()

    def exists(self) -> bool:
        # docstring inherited
        return self._config() is not None or _seed.is_seed_folder(self.root)

    # ---- create / open --------------------------------------------------------------------------

    def create(self, schema: Schema, overwrite: bool) -> None:
        # docstring inherited
        refuse_foreign_buffer(self)
        self.read_only = False
        if overwrite:
            self._erase()
        os.makedirs(self.root, exist_ok=True)
        self._arrays = {}
        for field in schema.fields.values():
            self._allocate(field.name, False, (schema.max_episodes, schema.max_timesteps, *field.shape), field.dtype)
        for field in {**schema.meta_fields, **bookkeeping_fields(schema)}.values():
            self._allocate(field.name, True, (schema.max_episodes, *field.shape), field.dtype)
        self.commit_state(empty_state())
        self._write_config(schema)

    def _allocate(self, name: str, meta: bool, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Create a zero-filled ``.npy`` (sparse on disk until written)."""
        path = os.path.join(self.root, array_filename(name, meta))
        array = open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        if self.fsync:
            array.flush()
        del array
        self._arrays[name, meta] = MemmapArray(self, path)

    def _write_config(self, schema: Schema, **extra: Any) -> None:
        config = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "backend": self.backend_name,
            **schema.to_json(),
            **extra,
        }
        self.kv.set(CONFIG_FILE, json.dumps(config, indent=1).encode())

    def _erase(self) -> None:
        """Delete what a replaybuf memmap buffer or a seed folder consists of, and nothing else."""
        if not os.path.isdir(self.root):
            return
        self.kv.delete_prefix(f"{_BLOB_DIR}/")
        owned = (".data.npy", ".data.meta.npy", ".state.npy")
        for name in os.listdir(self.root):
            if name.endswith(owned) or name in (CONFIG_FILE, _seed.METADATA_FILE):
                os.unlink(os.path.join(self.root, name))

    def open(self, read_only: bool) -> Schema:
        # docstring inherited
        config = self._config()
        self._seed_view = None
        if config is not None:
            if config.get("version", 0) > FORMAT_VERSION:
                raise ValueError(
                    f"buffer at {self.location!r} has format version {config['version']}; "
                    f"this replaybuf reads up to {FORMAT_VERSION}: upgrade replaybuf"
                )
            schema = Schema.from_json(config)
            self._seed_origin = config.get("origin") == SEED_ORIGIN
        elif _seed.is_seed_folder(self.root):
            schema = _seed.read_seed_schema(self.root)
            self._seed_origin = True
        else:
            raise BufferNotFoundError(
                f"no replaybuf memmap buffer at {self.location!r} "
                f"(neither {CONFIG_FILE} nor a memmap-replay-buffer metadata.pkl)"
            )
        self.read_only = read_only
        adopting = config is None or (self._seed_origin and self._seed_wrote_since())
        self._open_arrays(schema, skip_generation=config is None)
        if adopting and read_only:
            self._seed_view = _seed.SeedState.read(self.root)
        elif adopting:
            self._adopt_seed_folder(schema)
        if not read_only:
            self.kv.remove_partials()
        return schema

    def _seed_wrote_since(self) -> bool:
        """Whether the seed library wrote to an adopted folder after replaybuf last committed."""
        seed_state, state = _seed.SeedState.read(self.root), super().load_state()
        return (seed_state.timestep_index, seed_state.num_episodes, seed_state.episode_index) != (
            0,
            state["num_episodes"],
            state["episode_index"],
        )

    def _open_arrays(self, schema: Schema, skip_generation: bool) -> None:
        self._arrays = {}
        expected = {
            (n, False): ((schema.max_episodes, schema.max_timesteps, *f.shape), f.dtype)
            for n, f in schema.fields.items()
        }
        expected.update(
            {
                (n, True): ((schema.max_episodes, *f.shape), f.dtype)
                for n, f in {**schema.meta_fields, **bookkeeping_fields(schema)}.items()
            }
        )
        for (name, meta), (shape, dtype) in expected.items():
            if skip_generation and name == "_generation":
                continue
            path = os.path.join(self.root, array_filename(name, meta))
            if not os.path.isfile(path):
                raise BufferNotFoundError(f"buffer at {self.location!r} is missing {os.path.basename(path)!r}")
            array = MemmapArray(self, path)
            if array.shape != shape or array.dtype != dtype:
                raise ValueError(
                    f"{path!r} holds {array.dtype}{list(array.shape)}, the config expects "
                    f"{np.dtype(dtype)}{list(shape)}"
                )
            self._arrays[name, meta] = array

    def _adopt_seed_folder(self, schema: Schema) -> None:
        """Take over a seed folder for writing (see the module docstring); safe to redo if killed."""
        seed_state = _seed.SeedState.read(self.root)
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
        try:
            return self._arrays[name, meta]
        except KeyError:
            raise KeyError(f"no {'meta ' if meta else ''}array {name!r} in {self.location!r}") from None

    # ---- counters and the step log ------------------------------------------------------------

    def load_state(self) -> dict:
        # docstring inherited
        if self._seed_view is not None:
            self._seed_view = _seed.SeedState.read(self.root)
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
        if self.fsync and name == "episode_lens":
            self._flush_arrays()
        self.array(name, meta=True).memmap[np.asarray(episodes)] = values

    def read_rows(self, name: str, episodes: np.ndarray, t0: int, t1: int) -> np.ndarray:
        # docstring inherited
        return self.array(name).memmap[np.asarray(episodes), t0:t1]

    def read_spans(
        self,
        name: str,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out: np.ndarray,
        parallel: bool = True,
    ) -> None:
        # docstring inherited: one copy per episode straight from the page cache into ``out``
        memmap = self.array(name).memmap
        spans = [
            (i, e, s, n)
            for i, (e, s, n) in enumerate(
                zip(*(np.asarray(a, dtype=np.int64).reshape(-1).tolist() for a in (episodes, starts, lengths)))
            )
            if n > 0
        ]

        def copy(span: tuple[int, int, int, int]) -> None:
            i, e, s, n = span
            out[i, :n] = memmap[e, s : s + n]

        if parallel and len(spans) > 1 and out.nbytes > (4 << 20):
            list(thread_pool().map(copy, spans))
        else:
            for span in spans:
                copy(span)

    def gather(self, name: str, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        # docstring inherited
        return self.array(name).memmap[np.asarray(episodes), np.asarray(timesteps)]

    def read_meta(self, name: str) -> np.ndarray:
        # docstring inherited
        if self._seed_view is not None and name in ("episode_lens", "_generation"):
            lens = self._seed_view.episode_lens(self._arrays["episode_lens", True][:])
            return lens if name == "episode_lens" else self._seed_view.generations(lens, len(lens))
        return np.array(self.array(name, meta=True).memmap)

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        # docstring inherited
        if self._seed_view is not None and name in ("episode_lens", "_generation"):
            return self.read_meta(name)[np.asarray(episodes, dtype=np.int64)]
        return super().read_meta_rows(name, episodes)

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

    def close(self) -> None:
        # docstring inherited
        self.flush()
        for array in self._arrays.values():
            array.release()
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
