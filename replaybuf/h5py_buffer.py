"""``ReplayBufferH5PY``: memmap-replay-buffer's HDF5 variant, as a ReplayBuffer on the hdf5 backend.

Importing this module never imports h5py; creating a buffer without h5py installed raises an
ImportError that says what to install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from .buffer import ReplayBuffer
from .inputs import to_numpy
from .storage.base import Storage

if TYPE_CHECKING:
    from .storage import HDF5Storage

INSTALL_HINT = "ReplayBufferH5PY needs h5py: pip install 'replaybuf[h5py]'"


def _require_h5py() -> None:
    try:
        found = importlib.util.find_spec("h5py") is not None
    except ValueError:  # h5py blocked in sys.modules
        found = False
    if not found:
        raise ImportError(INSTALL_HINT)
    try:
        importlib.import_module("h5py")
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e


def _check_stored_compression(folder: str | os.PathLike, compression: str | None, level: int | None) -> None:
    """ValueError, as memmap-replay-buffer's config check raised, when the HDF5 buffer stored at
    ``folder`` was created with another compression than a reopen passes: the reopen kept the
    stored one, ignoring what was asked. Read through a read-only open that writes nothing; a
    folder without a readable buffer is left to the open itself, which reports it."""
    from .storage import make_storage

    try:
        probe = make_storage(folder, "hdf5", {})
    except Exception:
        return
    try:
        if not probe.exists():
            return
        probe.open(read_only=True)
        stored = probe.compression()  # type: ignore[attr-defined]
    except Exception:
        return
    finally:
        with contextlib.suppress(Exception):
            probe.close()
    passed = (compression, 4 if compression == "gzip" and level is None else level)  # h5py's default gzip level
    if stored != passed:
        # the level only where the compression is the same
        key, was, given = ("", stored[0], passed[0]) if stored[0] != passed[0] else ("_opts", stored[1], passed[1])
        raise ValueError(
            f"buffer at {os.fspath(folder)!r} was created with a different config:\n"
            f"  h5py_compression{key}: stored {was!r} vs passed {given!r}\n"
            "Open it with ReplayBufferH5PY.from_folder(...) to use the stored config, "
            "or pass overwrite=True to recreate it (erasing its episodes)."
        )


class ReplayBufferH5PY(ReplayBuffer):
    """A ReplayBuffer stored in one HDF5 file (``<folder>/data.h5``), optionally compressed.

    ``h5py_compression`` is 'gzip', 'lzf' or None and ``h5py_compression_opts`` the gzip level,
    as in memmap-replay-buffer; they apply when the buffer is created, and a reopen that passes
    a config (``overwrite=False``) must pass the compression it was created with, as there
    (``from_folder`` takes the stored one). Everything else is ReplayBuffer's.
    """

    def __init__(
        self,
        folder: str | os.PathLike | Storage,
        max_episodes: int | None = None,
        max_timesteps: int | None = None,
        fields: dict[str, Any] | None = None,
        meta_fields: dict[str, Any] | None = None,
        circular: bool = False,
        overwrite: bool = True,
        read_only: bool = False,
        flush_every_store_step: int = 1,
        h5py_compression: str | None = None,
        h5py_compression_opts: int | None = None,
        *,
        fsync: bool = False,
        break_lock: bool = False,
    ):
        _require_h5py()
        if fields is not None and (read_only or not overwrite) and not isinstance(folder, Storage):
            _check_stored_compression(folder, h5py_compression, h5py_compression_opts)
        options: dict[str, Any] = {}
        if h5py_compression is not None:
            options["compression"] = h5py_compression
        if h5py_compression_opts is not None:
            options["compression_opts"] = h5py_compression_opts
        super().__init__(
            folder,
            max_episodes,
            max_timesteps,
            fields,
            meta_fields,
            circular,
            overwrite,
            read_only,
            flush_every_store_step,
            storage_options=options,
            backend="hdf5",
            fsync=fsync,
            break_lock=break_lock,
        )

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        read_only: bool = False,
        storage_options: dict | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> Self:
        """Reopen the HDF5 buffer stored at ``folder`` with its stored config. ``h5py_compression``
        and ``h5py_compression_opts`` are taken as the storage options they stand for, so one that
        differs from the stored compression is warned of (the stored one wins), never ignored
        without a word."""
        _require_h5py()
        if backend not in (None, "hdf5"):
            raise ValueError(f"ReplayBufferH5PY reads the 'hdf5' backend only, got backend={backend!r}")
        options = dict(storage_options or {})
        for argument, key in (("h5py_compression", "compression"), ("h5py_compression_opts", "compression_opts")):
            if argument not in kwargs:
                continue
            value = kwargs.pop(argument)
            if key in options and options[key] != value:
                raise ValueError(
                    f"{argument}={value!r} and storage_options[{key!r}]={options[key]!r} name two "
                    "compressions; give one"
                )
            options[key] = value
        return super().from_folder(folder, read_only=read_only, storage_options=options, backend="hdf5", **kwargs)

    @property
    def h5_path(self) -> Path:
        """The HDF5 file, ``<folder>/data.h5`` (as the seed's attribute), e.g. for ``h5py.File``."""
        from .storage import DATA_FILE

        return Path(self.folder) / DATA_FILE

    @property
    def h5py_compression(self) -> str | None:
        """The compression the file's data fields were created with ('gzip', 'lzf' or None)."""
        return self._h5_storage().compression()[0]

    @property
    def h5py_compression_opts(self) -> int | None:
        """The gzip level the file's data fields were created with (None without gzip)."""
        return self._h5_storage().compression()[1]

    def _h5_storage(self) -> HDF5Storage:
        from .storage import HDF5Storage

        storage = getattr(self.storage, "inner", self.storage)  # behind a read cache, if any
        assert isinstance(storage, HDF5Storage), "a ReplayBufferH5PY stores in HDF5"
        return storage

    def get_buffered_storer(self, flush_freq: int) -> Callable[..., None]:
        """memmap-replay-buffer's batched writer of whole episodes.

        Returns ``storer(force_flush=False, **episode)``: each call adds one episode (data
        fields (T, *shape), meta fields as values, optionally ``episode_lens`` to cut the data
        at that length); once ``flush_freq`` episodes are collected, or on ``force_flush=True``,
        they are checked together and stored in order, then flushed (a batch that fails the
        checks is dropped and nothing of it is stored). An episode's length is
        ``episode_lens`` when given, else its T.
        """
        if isinstance(flush_freq, bool) or not isinstance(flush_freq, int) or flush_freq < 1:
            raise ValueError(f"get_buffered_storer: flush_freq must be a positive int, got {flush_freq!r}")
        pending: dict[str, list] = {}
        allowed = self.fieldnames | self.meta_fieldnames

        def buffered_storer(force_flush: bool = False, **data: Any) -> None:
            with self._lock:  # one object shared by threads: their batches commit one after another
                self._check_writable("buffered_storer")
                self._check_episode_thread("buffered_storer")
                self._check_names(data, allowed, "field", "buffered_storer")
                for name, value in data.items():
                    pending.setdefault(name, []).append(value)
                if not pending or not (force_flush or len(next(iter(pending.values()))) >= flush_freq):
                    return
                counts = {name: len(values) for name, values in pending.items()}
                batch = dict(pending)
                pending.clear()  # a rejected batch is dropped, not retried on every later call
                if len(set(counts.values())) > 1:
                    raise ValueError(
                        f"buffered_storer: fields hold different numbers of episodes {counts}; the batch is dropped"
                    )
                episodes = [{name: values[i] for name, values in batch.items()} for i in range(max(counts.values()))]
                checked = [
                    self._episode_values(self._cut_to_length(episode), "buffered_storer") for episode in episodes
                ]
                if any(length == 0 for _, _, length in checked):
                    raise ValueError(
                        "buffered_storer: an episode needs at least one timestep, got 0; the batch is dropped"
                    )
                self._check_room(len(checked))
                for steps, meta, length in checked:
                    self._commit.commit_episode(steps, meta, length)
                self.flush()

        return buffered_storer

    def _cut_to_length(self, episode: dict[str, Any]) -> dict[str, Any]:
        """An episode's data fields cut at its ``episode_lens`` value (which is then dropped)."""
        if "episode_lens" not in episode:
            return episode
        episode = dict(episode)
        length = np.asarray(episode.pop("episode_lens"))
        if length.ndim != 0 or length.dtype.kind not in "iu" or not 0 < length <= self.max_timesteps:
            raise ValueError(
                f"buffered_storer: episode_lens must be an int in [1, {self.max_timesteps}], got {length!r}"
            )
        for name in self.fieldnames & set(episode):
            array = to_numpy(episode[name], name)
            if array.ndim and array.shape[0] < length:
                raise ValueError(
                    f"buffered_storer: field {name!r} has {array.shape[0]} timesteps, episode_lens is {int(length)}"
                )
            episode[name] = array[: int(length)]
        return episode


def copy_seed_h5(src: str | os.PathLike, dst: str | os.PathLike, **kwargs: Any) -> ReplayBufferH5PY:
    """Copy a folder written by memmap-replay-buffer's ``ReplayBufferH5PY`` (``metadata.pkl``
    and a ``data.h5`` of ``data_<field>`` / ``meta_<field>`` datasets, a layout replaybuf does
    not open) into a new ReplayBufferH5PY at ``dst`` with the same config and compression.

    Each episode keeps its slot and they are stored oldest first, so a circular buffer keeps
    its order; an episode the seed had in progress is stored as an episode of the steps it holds
    (as a seed memmap folder is read). ``src`` is only read; ``dst`` must not hold a buffer. ``kwargs`` go to the new
    buffer (``fsync``). Returns it, open for writing.
    """
    _require_h5py()
    from .storage import DATA_FILE, open_h5, read_seed_schema, refuse_outside_storage

    src, dst = os.fspath(src), os.fspath(dst)
    schema = read_seed_schema(src)
    path = os.path.join(src, DATA_FILE)
    with open_h5(path, "r") as file:
        names = [f"data_{n}" for n in schema.fields] + [f"meta_{n}" for n in (*schema.meta_fields, "episode_lens")]
        for name in names:  # a link or external storage read another file into the copy
            refuse_outside_storage(file, name, path, writer="memmap-replay-buffer")
        missing = [n for n in names if n not in file]
        if missing:
            raise ValueError(
                f"{src}: {DATA_FILE} lacks the datasets {missing}; not a memmap-replay-buffer ReplayBufferH5PY"
            )
        lens, (episode_index, num_episodes, timestep_index) = _checked_seed_h5(file, path, schema)
        # slots oldest first: a full (or wrapped) buffer's oldest is where the next one goes
        start = episode_index if num_episodes >= schema.max_episodes else 0
        order = [(start + i) % schema.max_episodes for i in range(schema.max_episodes)]
        if timestep_index > 0:  # the episode in progress is the newest
            order.remove(episode_index)
            order.append(episode_index)
            lens[episode_index] = timestep_index
        first = file[f"data_{next(iter(schema.fields))}"]
        buffer = ReplayBufferH5PY(
            dst,
            schema.max_episodes,
            schema.max_timesteps,
            {n: f.to_json() for n, f in schema.fields.items()},
            {n: f.to_json() for n, f in schema.meta_fields.items()},
            circular=schema.circular,
            overwrite=False,
            h5py_compression=first.compression,
            h5py_compression_opts=first.compression_opts,
            **kwargs,
        )
        if buffer.num_episodes:
            buffer.close()
            raise FileExistsError(f"copy_seed_h5: {dst!r} already holds a buffer; choose a new folder")
        for slot in (s for s in order if lens[s] > 0):
            length = int(lens[slot])
            buffer.episode_index = int(slot)  # the same slot: row i of get_all_data stays the seed's row i
            buffer.store_episode(
                **{n: file[f"data_{n}"][slot, :length] for n in schema.fields},
                **{n: file[f"meta_{n}"][slot] for n in schema.meta_fields},
            )
    return buffer


def _checked_seed_h5(file: Any, path: str, schema: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The lengths and counters (episode_index, num_episodes, timestep_index) of a seed
    ``data.h5``, with every dataset's shape checked against ``metadata.pkl``'s config first, so
    ``copy_seed_h5`` copies each episode whole or refuses, naming the file, before it creates
    anything: a length outside ``[0, max_timesteps]`` left its episode out of the copy
    silently, and a short dataset or an out-of-range counter failed with numpy's unnamed errors."""
    from .storage.base import BufferDamagedError

    expected = {f"data_{n}": (schema.max_episodes, schema.max_timesteps, *f.shape) for n, f in schema.fields.items()}
    expected |= {f"meta_{n}": (schema.max_episodes, *f.shape) for n, f in schema.meta_fields.items()}
    expected["meta_episode_lens"] = (schema.max_episodes,)
    for name, shape in expected.items():
        dataset = file[name]
        if tuple(dataset.shape) != shape or dataset.dtype.kind not in "biuf":
            raise BufferDamagedError(
                f"{path}: dataset {name!r} holds {dataset.dtype}{list(dataset.shape)}, metadata.pkl's config "
                f"expects numbers of shape {list(shape)}"
            )
    lens = np.asarray(file["meta_episode_lens"][:], dtype=np.int64)
    bad = np.flatnonzero((lens < 0) | (lens > schema.max_timesteps))
    if len(bad):
        raise BufferDamagedError(
            f"{path}: meta_episode_lens of slots {bad.tolist()} hold {lens[bad].tolist()}, "
            f"outside [0, max_timesteps={schema.max_timesteps}]"
        )
    counters = []
    for name, limit in (
        ("episode_index", schema.max_episodes - 1),
        ("num_episodes", schema.max_episodes),
        ("timestep_index", schema.max_timesteps),
    ):
        value = file.attrs.get(name, 0)
        if np.ndim(value) or np.asarray(value).dtype.kind not in "iu" or not 0 <= int(value) <= limit:
            raise BufferDamagedError(f"{path}: attribute {name!r} is {value!r}, expected an int in [0, {limit}]")
        counters.append(int(value))
    return lens, (counters[0], counters[1], counters[2])
