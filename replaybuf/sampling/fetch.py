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
``cache='ram'`` or ``'memmap'`` instead reads through the buffer's read cache
(``storage/_cache.py``: decoded rows in raw files under ``cache_dir`` that every worker and
process maps, kept for later runs and bounded by LRU eviction), filled with the snapshot's
episodes when the fetcher is made; a buffer opened with ``cache='disk'`` (or on an object
store) already reads through it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from ..storage import CachedStorage, GenerationMismatchError, Storage, fill_beyond, recycled_empty
from ..view import BufferView

CACHE_MODES = (None, "ram", "memmap")
# episodes per field filled into the read cache at once when a fetcher with a cache is made
_WARM_BATCH_EPISODES = 16
# Windows at least this long on average (trajectories, long time windows) are read whole through
# the storage's bulk path; shorter ones (n-step sequences) gather steps and use the chunk cache.
_BULK_MIN_STEPS = 32


class Fetcher:
    """Reads fields of the slots of one snapshot.

    Parameters
    ----------
    buffer
        The ReplayBuffer read from.
    fields
        The data fields this fetcher reads (those a cache is filled with).
    slots, lens, generations
        The snapshot: slots used, and per slot (whole ``max_episodes`` arrays) their length and
        generation at creation. ``generations`` is shared with the dataset, not copied: a slot
        this fetcher finds reused while it preloads or fills the cache is set to -1 there
        (never drawn).
    cache
        None: read through the buffer's storage; ``'ram'`` or ``'memmap'`` (the same): through
        its read cache (``CachedStorage``, under ``cache_dir``, default the user's cache
        folder), filled with the snapshot's episodes now.
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
        if buffer.storage.seed_may_write:
            cache = None  # a memmap-replay-buffer folder, read as it is: the seed's writes would leave a cache stale
        self.storage: Storage = buffer.storage if cache is None else read_cache(buffer, cache_dir)
        self.schema = buffer.schema
        self.fields = tuple(dict.fromkeys(fields))
        self.slots = np.asarray(slots, dtype=np.int64)
        self.lens = np.asarray(lens, dtype=np.int64)
        self.generations = generations
        self.cache = cache
        if cache is not None:
            self._fill_cache()
        else:
            self._load_resident()

    def __setstate__(self, state: dict) -> None:
        # a spawned worker maps the read cache's files, or preloads its own resident copies
        self.__dict__.update(state)
        if self.cache is None:
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

    def verified(self, gathers_only: bool = False) -> bool:
        """Whether every read of this fetcher returns rows of the generations it names only
        (``Storage.verifies_reads``; ``gathers_only``: the caller reads with ``gather`` and
        ``windows`` that ``gathers_windows`` alone, ``Storage.verifies_gathers``): a batch
        then needs no re-check of its slots."""
        if gathers_only:
            return self.storage.verifies_gathers(self.fields)
        return self.storage.verifies_reads(self.fields)

    def gathers_windows(self, width: int) -> bool:
        """Whether ``windows`` of at most ``width`` steps are always read with ``gather``."""
        return width < _BULK_MIN_STEPS and not self.storage.checks_whole_episodes

    def _fill_cache(self) -> None:
        """The snapshot's episodes of every field into the read cache, a few at a time; a slot
        whose fill finds another generation (reused since the snapshot) is never drawn. A slot
        the cache did not keep (evicted at once: more episodes than ``cache_size`` holds) is
        drawn as ever, its rows read from the store."""
        assert isinstance(self.storage, CachedStorage)
        for name in self.fields:
            live = self.slots[(self.generations[self.slots] > 0) & (self.lens[self.slots] > 0)]
            for lo in range(0, len(live), _WARM_BATCH_EPISODES):
                part = live[lo : lo + _WARM_BATCH_EPISODES]
                while len(part):
                    try:
                        filled = self.storage.rows(name, part, self.generations[part])
                    except GenerationMismatchError as error:
                        self.generations[error.slots] = -1
                        part = part[self.generations[part] > 0]
                        continue
                    left_out = part[~np.isin(part, list(filled))]
                    if len(left_out):  # reused since the snapshot, or only not kept
                        now = np.asarray(self.storage.read_meta_rows("_generation", left_out), dtype=np.int64)
                        self.generations[left_out[now != self.generations[left_out]]] = -1
                    break

    # ---- reads -------------------------------------------------------------------------------

    def gather(self, name: str, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        """``data/name[episodes[i], timesteps[i]]`` for every i, as one array (N, *shape)."""
        episodes = np.asarray(episodes, dtype=np.int64)
        return self.storage.gather(name, episodes, timesteps, self.generations[episodes])

    def windows(
        self, name: str, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int
    ) -> np.ndarray:
        """(N, width, *shape): row i holds steps ``starts[i] .. starts[i] + lengths[i]`` of
        ``episodes[i]``, zero beyond ``lengths[i]``."""
        lengths = np.minimum(np.asarray(lengths, dtype=np.int64), width)
        # whole episodes (trajectories) on a backend that checks only those take its checked path
        checked = self.storage.checks_whole_episodes and not np.any(starts)
        if len(lengths) == 0 or (lengths.mean() < _BULK_MIN_STEPS and not checked):
            return self._windows(self.gather, name, episodes, starts, lengths, width)
        field = self.schema.fields[name]
        out = recycled_empty((len(lengths), width, *field.shape), field.dtype)
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


def read_cache(buffer: BufferView, cache_dir: str | os.PathLike | None) -> CachedStorage:
    """The read cache over ``buffer``'s storage: its own where it has one, else a new one under
    ``cache_dir`` serving a dataset's snapshot reads only (the buffer's writes go on as before)."""
    if isinstance(buffer.storage, CachedStorage):
        return buffer.storage
    cached = CachedStorage(buffer.storage, cache_dir, snapshot=True)
    cached.schema = buffer.schema  # the storage is open: its schema is the buffer's
    return cached
