"""Batched reads of a buffer snapshot: one grouped read per field per batch.

A ``Fetcher`` knows the slots, lengths and generations a dataset saw at creation. It reads
(episode, timestep) pairs and time windows through the storage's batched ``gather`` and
``read_spans``, always naming the snapshot's generation of each slot (``storage/base.py``,
"Generations"): backends key their caches by it (the zarr chunk cache and resident copies, the
read cache's files), so a reused slot is never served stale, and a storage that
``verifies_generations`` spares the batch its re-check (``consistency.read_consistent``).
``Storage.preload`` is called for every field when the fetcher is made (the zarr backend then
loads the snapshot's rows of small fields into RAM in one parallel pass, so that DataLoader
workers started by fork share them); a spawned worker preloads again when it unpickles the
fetcher.
``cache='ram'`` instead decodes the snapshot's fields once into RAM at creation (DataLoader
workers started by fork share it; spawned workers decode their own), ``cache='memmap'`` into
temporary ``.npy`` files that every worker maps (fork or spawn), removed with the dataset.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable

import numpy as np

from ..storage import GenerationMismatchError, fill_beyond
from ..view import BufferView

CACHE_MODES = (None, "ram", "memmap")
_RAM_BATCH_EPISODES = 16
# Windows at least this long on average (trajectories, long time windows) are read whole through
# the storage's bulk path; shorter ones (n-step sequences) gather steps and use the chunk cache.
_BULK_MIN_STEPS = 32


def _remove_folder(folder: str, owner: int) -> None:
    """Delete the cache files, from the process that made them only (not a forked worker)."""
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


class Fetcher:
    """Reads fields of the slots of one snapshot.

    Parameters
    ----------
    buffer
        The ReplayBuffer read from.
    fields
        The data fields this fetcher reads (those ``cache='ram'`` loads).
    slots, lens, generations
        The snapshot: slots used, and per slot (whole ``max_episodes`` arrays) their length and
        generation at creation. ``generations`` is shared with the dataset, not copied: a slot
        this fetcher finds reused while loading ``cache='ram'`` is set to -1 there (never drawn).
    cache
        None: read through the storage; ``'ram'``: decode the fields of ``slots`` into RAM once;
        ``'memmap'``: decode them once into temporary files under ``cache_dir`` (default: the
        system temp folder, i.e. ``$TMPDIR``) that worker processes map instead of copying.
    """

    def __init__(
        self,
        buffer: BufferView,
        fields: Iterable[str],
        slots: np.ndarray,
        lens: np.ndarray,
        generations: np.ndarray,
        cache: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {list(CACHE_MODES)}, got {cache!r}")
        self.storage = buffer.storage
        self.schema = buffer.schema
        self.fields = tuple(dict.fromkeys(fields))
        self.slots = np.asarray(slots, dtype=np.int64)
        self.lens = np.asarray(lens, dtype=np.int64)
        self.generations = generations
        self.cache = cache
        self._ram: dict[str, np.ndarray] | None = None
        self._folder: str | None = None
        if cache is not None:
            if cache == "memmap":
                self._folder = tempfile.mkdtemp(prefix="replaybuf-cache-", dir=cache_dir)
                weakref.finalize(self, _remove_folder, self._folder, os.getpid())
            self._load_ram()
        else:
            self._load_resident()

    def __getstate__(self) -> dict:
        # A spawned worker maps the memmap files, or decodes its own RAM copy, instead of
        # receiving the arrays pickled.
        return {**self.__dict__, "_ram": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._folder is not None:
            self._ram = {
                n: np.load(os.path.join(self._folder, f"{i}.npy"), mmap_mode="r") for i, n in enumerate(self.fields)
            }
        elif self.cache is None:
            self._load_resident()

    def _load_resident(self) -> None:
        """``Storage.preload`` of the snapshot's rows of every field.

        A slot the preload finds reused since the snapshot is dropped from it (generation -1:
        never drawn). A slot being rewritten may fail to decode: the preload then stops there,
        and the batch reads (checked by ``consistency.read_consistent``) load what they use, as
        they would have without it."""
        for name in self.fields:
            live = self.slots[self.generations[self.slots] > 0]
            try:
                self.storage.preload(name, live, self.generations[live])
            except GenerationMismatchError as error:
                self.generations[error.slots] = -1
            except Exception:  # noqa: BLE001 - retried, checked, by the batch reads
                return

    def verified(self) -> bool:
        """Whether every read of this fetcher returns rows of the generations it names only
        (``Storage.verifies_reads``): a batch then needs no re-check of its slots."""
        return self.cache is None and self.storage.verifies_reads(self.fields)

    def _load_ram(self) -> None:
        longest = int(self.lens[self.slots].max()) if len(self.slots) else 0
        self._row = np.full(len(self.lens), -1, dtype=np.int64)
        self._row[self.slots] = np.arange(len(self.slots))
        ram = {}
        for i, name in enumerate(self.fields):
            field = self.schema.fields[name]
            shape = (len(self.slots), longest, *field.shape)
            if self._folder is None:
                dense = np.zeros(shape, dtype=field.dtype)
            else:
                dense = np.lib.format.open_memmap(
                    os.path.join(self._folder, f"{i}.npy"), mode="w+", dtype=field.dtype, shape=shape
                )
            for lo in range(0, len(self.slots), _RAM_BATCH_EPISODES):
                self._load_ram_rows(dense, name, np.arange(lo, min(lo + _RAM_BATCH_EPISODES, len(self.slots))))
            if isinstance(dense, np.memmap):
                dense.flush()
            ram[name] = dense
        self._ram = ram

    def _load_ram_rows(self, dense: np.ndarray, name: str, rows: np.ndarray) -> None:
        """Rows ``rows`` of ``dense`` from their slots; a slot a verifying storage finds reused
        since the snapshot is dropped from it (generation -1: never drawn) and the rest read."""
        while len(rows):
            part = self.slots[rows]
            block = np.zeros((len(rows), *dense.shape[1:]), dense.dtype)
            try:
                self._read_spans_into(block, name, part, np.zeros(len(part), np.int64), self.lens[part])
            except GenerationMismatchError as error:
                self.generations[error.slots] = -1
                rows = rows[self.generations[part] > 0]
                continue
            dense[rows] = block
            return

    # ---- reads -------------------------------------------------------------------------------

    def gather(self, name: str, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        """``data/name[episodes[i], timesteps[i]]`` for every i, as one array (N, *shape)."""
        if self.cache is not None and name in self.fields:
            if self._ram is None:
                self._load_ram()
            assert self._ram is not None  # set by _load_ram()
            return self._ram[name][self._row[episodes], timesteps]
        return self._gather_storage(name, episodes, timesteps)

    def _gather_storage(self, name: str, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        episodes = np.asarray(episodes, dtype=np.int64)
        return self.storage.gather(name, episodes, timesteps, self.generations[episodes])

    def windows(
        self, name: str, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int
    ) -> np.ndarray:
        """(N, width, *shape): row i holds steps ``starts[i] .. starts[i] + lengths[i]`` of
        ``episodes[i]``, zero beyond ``lengths[i]``."""
        if self.cache is not None and name in self.fields:
            return self._windows(self.gather, name, episodes, starts, lengths, width)
        return self._windows_from_storage(name, episodes, starts, lengths, width)

    def _windows_from_storage(self, name, episodes, starts, lengths, width):
        lengths = np.minimum(np.asarray(lengths, dtype=np.int64), width)
        if len(lengths) == 0 or lengths.mean() < _BULK_MIN_STEPS:
            return self._windows(self._gather_storage, name, episodes, starts, lengths, width)
        field = self.schema.fields[name]
        out = np.empty((len(lengths), width, *field.shape), dtype=field.dtype)
        self._read_spans_into(out, name, episodes, starts, lengths)
        fill_beyond(out, lengths, 0)
        return out

    def _read_spans_into(
        self, out: np.ndarray, name: str, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Long windows through the storage's bulk path, decoded straight into ``out``."""
        episodes = np.asarray(episodes, dtype=np.int64)
        self.storage.read_spans(name, episodes, starts, lengths, out, generations=self.generations[episodes])

    def _windows(self, gather, name, episodes, starts, lengths, width):
        episodes = np.asarray(episodes, dtype=np.int64)
        lengths = np.minimum(np.asarray(lengths, dtype=np.int64), width)
        steps = np.arange(width, dtype=np.int64)
        if 2 * int(lengths.sum()) >= len(lengths) * width:
            # mostly full (n-step ``seq_`` fields): one rectangular gather, steps past a row's
            # length repeating its last one (step 0 for a row of none) and zeroed after, instead
            # of a boolean-mask scatter
            starts = np.where(lengths > 0, np.asarray(starts, dtype=np.int64), 0)
            offsets = np.minimum(steps[None], np.maximum(lengths - 1, 0)[:, None])
            flat = gather(name, np.repeat(episodes, width), (starts[:, None] + offsets).reshape(-1))
            out = flat.reshape(len(episodes), width, *flat.shape[1:])
            fill_beyond(out, lengths, 0)
            return out
        mask = steps[None] < lengths[:, None]
        flat = gather(name, np.repeat(episodes, lengths), (np.asarray(starts)[:, None] + steps[None])[mask])
        out = np.zeros((len(episodes), width, *flat.shape[1:]), dtype=flat.dtype)
        out[mask] = flat
        return out
