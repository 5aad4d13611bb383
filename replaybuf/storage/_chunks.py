"""Direct chunk I/O for the zarr arrays replaybuf writes itself.

zarr-python 3 spends ~0.3 ms per chunk on a read and 1-3 ms on a write, far too much for
per-step sampling and per-episode commits. The arrays replaybuf creates use one codec stack
(``_codecs.py``: bytes, an optional compressor, crc32c from format 2), so their chunks can be
fetched from the store as bytes, checked and decoded in a thread pool (the codecs release the
GIL) and assembled with numpy. The result is byte-for-byte the zarr array zarr-python and
dask read; any other array goes through zarr-python.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._codecs import ChunkCodec, ChunkDamage, crc32c
from ._kv import KeyValue, ReadInto, copy_spans, thread_pool
from .base import ChunkChecksumError, CorruptChunkError, GenerationMismatchError, last_occurrences

_PARALLEL_DECODE_BYTES = 1 << 20
_PACKED_READ_BYTES = 16 << 20
# in-place edits of rows this close in a chunk share one read and one write of the bytes between
# them (``_edit_in_place``): copying 32 KiB twice costs about what another pread + pwrite does
_GAP_BYTES = 32 << 10
DEFAULT_CHUNK_CACHE_BYTES = 128 << 20
# Small fields (at most RESIDENT_STEP_BYTES per step: vectors, scalars) are held whole in RAM
# per process, up to DEFAULT_RESIDENT_BYTES for all arrays together (their full capacity,
# max_episodes x max_timesteps; pages never written cost no memory).
DEFAULT_RESIDENT_BYTES = 1 << 30
RESIDENT_STEP_BYTES = 4096
# any array this small is held whole too, frames included (a small image buffer samples from RAM)
SMALL_ARRAY_BYTES = 64 << 20
_SEEN_KEYS = 1 << 16


class ChunkCache:
    """A per-process LRU of decoded chunks, bounded in bytes, for readers that pass generations.

    An entry is keyed by (array, chunk grid index) and remembers the generation (of the
    episode's slot) it was read under; a lookup under another generation misses, so a slot that
    a writer in another process reused is never served from an old read. Writes made in this
    process replace what they touch. A one-element chunk (a frame) is copied in on its second
    miss only (``second_misses``). ``resident_bytes`` bounds the arrays (small vectors and
    scalars, ``RESIDENT_STEP_BYTES`` per step at most) that are instead held whole in RAM per
    process (``ChunkedArray.load_resident``); ``resident_nbytes`` is what they take now.
    """

    def __init__(self, max_bytes: int = DEFAULT_CHUNK_CACHE_BYTES, resident_bytes: int = DEFAULT_RESIDENT_BYTES):
        self.max_bytes = int(max_bytes)
        self.resident_bytes = int(resident_bytes)
        self.resident_nbytes = 0
        self.nbytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[str, Any], tuple[int, np.ndarray]] = OrderedDict()
        self._seen: OrderedDict[tuple[str, Any], bool] = OrderedDict()
        # reentrant: a garbage collection inside a locked section may run the finalizer of a
        # resident copy (``release_resident``) in the same thread
        self._lock = threading.RLock()

    def get_many(self, namespace: str, keys: Sequence[Any], generations: Sequence[int]) -> list[np.ndarray | None]:
        found: list[np.ndarray | None] = []
        with self._lock:
            for key, generation in zip(keys, generations):
                entry = self._entries.get((namespace, key))
                if entry is not None and entry[0] == generation:
                    self._entries.move_to_end((namespace, key))
                    found.append(entry[1])
                else:
                    found.append(None)
            hits = sum(f is not None for f in found)
            self.hits += hits
            self.misses += len(found) - hits
        return found

    def put_many(self, namespace: str, items: Sequence[tuple[Any, int, np.ndarray]]) -> None:
        if self.max_bytes <= 0:
            return
        with self._lock:
            for key, generation, chunk in items:
                if chunk.nbytes > self.max_bytes:
                    continue
                if chunk.flags.writeable:
                    chunk.flags.writeable = False
                old = self._entries.pop((namespace, key), None)
                if old is not None:
                    self.nbytes -= old[1].nbytes
                self._entries[namespace, key] = (generation, chunk)
                self.nbytes += chunk.nbytes
            self._evict()

    def second_misses(self, namespace: str, keys: Sequence[Any]) -> list[bool]:
        """For each missed key, whether it missed before (recently): only those are worth
        copying into the cache. Uniformly random reads of a buffer much larger than the cache
        rarely miss twice, so they skip the copy; hot chunks get in on their second read."""
        seen = self._seen
        flags = []
        with self._lock:
            for key in keys:
                flags.append(seen.pop((namespace, key), None) is not None)
                seen[namespace, key] = True
            while len(seen) > _SEEN_KEYS:
                seen.popitem(last=False)
        return flags

    def admits(self, nbytes: int) -> bool:
        """Whether one read of ``nbytes`` new chunk bytes is cached: a read larger than a quarter
        of the cache (a trajectory scan) would only flush it."""
        return 0 < nbytes * 4 <= self.max_bytes

    def discard(self, namespace: str, keys: Sequence[Any]) -> None:
        with self._lock:
            for key in keys:
                old = self._entries.pop((namespace, key), None)
                if old is not None:
                    self.nbytes -= old[1].nbytes

    def discard_namespace(self, namespace: str) -> None:
        """Drop every chunk and miss record of one array."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == namespace]:
                self.nbytes -= self._entries.pop(key)[1].nbytes
            for key in [k for k in self._seen if k[0] == namespace]:
                del self._seen[key]

    def resize(self, max_bytes: int | None = None, resident_bytes: int | None = None) -> None:
        """Change the bounds; shrinking drops the least recently used chunks."""
        with self._lock:
            if max_bytes is not None:
                self.max_bytes = int(max_bytes)
            if resident_bytes is not None:
                self.resident_bytes = int(resident_bytes)
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._seen.clear()
            self.nbytes = 0
            self.hits = self.misses = 0

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self._entries:
            _, (_, chunk) = self._entries.popitem(last=False)
            self.nbytes -= chunk.nbytes

    def take_resident(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of the resident budget; False when it does not fit."""
        with self._lock:
            if self.resident_nbytes + nbytes > self.resident_bytes:
                return False
            self.resident_nbytes += nbytes
            return True

    def release_resident(self, nbytes: int) -> None:
        with self._lock:
            self.resident_nbytes -= nbytes

    def _after_fork(self) -> None:
        self._lock = threading.RLock()


_cache = ChunkCache()
ABSENT = np.zeros(0, np.uint8)  # cached for a chunk that was never written (reads as zeros)
os.register_at_fork(after_in_child=_cache._after_fork)


def chunk_cache() -> ChunkCache:
    """This process's cache of decoded chunks (``resize`` it to change its bounds)."""
    return _cache


# a resident row generation no request carries: the row is read again on its next use
_NEVER = -2


def _per_pair(generations, count: int) -> np.ndarray:
    generations = np.asarray(generations, dtype=np.int64)
    return generations if generations.shape == (count,) else np.broadcast_to(generations, (count,))


def _is_run(values: np.ndarray) -> bool:
    """Whether ``values`` (a non-empty int array) are consecutive and ascending."""
    return bool(values[-1] - values[0] == len(values) - 1 and (len(values) == 1 or (np.diff(values) == 1).all()))


def _copy_rows(
    out: np.ndarray, picked: np.ndarray, chunk: np.ndarray, local: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> None:
    """``out[picked[k], :lengths[k]] = chunk[local[k], starts[k]:...]``: one slice copy for a
    run of whole rows (a first load), else one copy per row."""
    count = len(picked)
    if (starts == 0).all() and (lengths == out.shape[1]).all():
        if _is_run(picked) and _is_run(local):
            out[picked[0] : picked[0] + count] = chunk[local[0] : local[0] + count, : out.shape[1]]
        else:
            out[picked] = chunk[local, : out.shape[1]]
        return
    for i, e, s, n in zip(picked.tolist(), local.tolist(), starts.tolist(), lengths.tolist()):
        out[i, :n] = chunk[e, s : s + n]


def nearby_spans(slots: np.ndarray, row_nbytes: int, per_chunk: int) -> np.ndarray:
    """Bounds (into sorted unique ``slots``) of the spans an in-place edit reads and writes
    whole: rows of one chunk of ``per_chunk`` rows, ``_GAP_BYTES`` apart at most."""
    apart = (np.diff(slots // per_chunk) != 0) | ((np.diff(slots) - 1) * row_nbytes > _GAP_BYTES)
    return np.concatenate([[0], np.flatnonzero(apart) + 1, [len(slots)]])


class ChunkedArray:
    """A zarr v3 array read and written chunk by chunk through a KeyValue.

    Indexing is numpy-style on the first two axes (an int, a slice or an int array on the
    episode axis; an int or a slice on the time axis) with trailing feature axes read whole;
    anything else goes through zarr-python. Missing chunks read as zero, and a chunk written as
    all zeros is deleted, as zarr does with ``write_empty_chunks=False``.

    Format 2 data arrays (``committed`` given) keep every chunk they write, zeros included, so
    a chunk missing inside a committed episode (``committed(slot)`` is its published length)
    is damage, reported as ``CorruptChunkError`` like a chunk failing its crc32c or its codec.
    The length is read only when a chunk is missing: the normal path costs nothing.

    Packed arrays (``packed``) carry no chunk checksum: ``check_rows(episodes, starts,
    lengths, out)`` checks whole-episode reads against per-episode checksums kept by the
    storage, ``rows_written(slots, rows)`` tells it which rows a write changed (``rows``: as
    written, or None: read them back), and ``row_prints(rows)`` fingerprints rows by those
    checksums (a chunk's file changes with any of its rows: a refresh re-reads only the rows
    whose checksum changed).

    ``generations_of(slots)`` (the ``_generation`` of slots as stored now) makes the resident
    copy verified: a row is loaded for the generation a read names and kept only when its slot
    still holds that generation after the load (``_load_resident``), so every later read of it
    returns rows of the generation it names, or GenerationMismatchError (``verifies_resident``).
    """

    def __init__(
        self,
        kv: KeyValue,
        path: str,
        shape: tuple[int, ...],
        chunks: tuple[int, ...],
        dtype: np.dtype,
        codec: ChunkCodec,
        grid_axes: int,
        zarr_array: Any = None,
        separator: str = "/",
        check_writable: Any = None,
        committed: Callable[[int], int] | None = None,
        check_rows: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None] | None = None,
        rows_written: Callable[[np.ndarray, np.ndarray | None], None] | None = None,
        row_prints: Callable[[np.ndarray], np.ndarray] | None = None,
        generations_of: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        self.kv = kv
        self.path = path
        self.shape = tuple(shape)
        self.chunks = tuple(chunks)
        self.dtype = np.dtype(dtype)
        self.codec = codec
        self._zarr_array = zarr_array
        self.grid_axes = grid_axes
        self.separator = separator
        self.check_writable = check_writable
        self.committed = committed
        self.check_rows = check_rows
        self.rows_written = rows_written
        self.row_prints = row_prints
        self.generations_of = generations_of
        # bytes of one element of the time axis (grid_axes 2) or of one row (grid_axes 1)
        self.item_nbytes = int(np.prod(self.shape[grid_axes:], dtype=np.int64)) * self.dtype.itemsize
        # the most bytes a stored chunk takes, with room to spare (blosc adds 16 to its raw bytes,
        # zstd and gzip under 1 %, crc32c 4): a larger object is damage, read no further
        self.max_stored = 2 * int(np.prod(self.chunks, dtype=np.int64)) * self.dtype.itemsize + 4096
        self._namespace = uuid.uuid4().hex
        self._resident: np.ndarray | None = None
        self._resident_generations: np.ndarray | None = None
        # per resident row, a fingerprint of its stored objects (KeyValue.fingerprints) and
        # whether it was compared since the last drop_cached
        self._resident_prints: np.ndarray | None = None
        self._resident_checked: np.ndarray | None = None
        # whether some resident row awaits that comparison (spares each batch its look)
        self._resident_unchecked = False
        self._too_large_to_hold = False  # set once _make_resident finds the array not small
        # the resident copy is made and brought to generations by one thread at a time: reads of
        # several episode runs of one array run in parallel (get_all_data's dask tasks)
        self._resident_lock = threading.Lock()
        self.resident_rows_read = 0  # rows (re)loaded into the resident copy: a test hook

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def packed(self) -> bool:
        """A packed data array (format 3): uncompressed chunks of whole rows of several
        episodes, written in place (``_write_in_place``) and read by rows (``_read_packed``)."""
        return (
            self.grid_axes == 2
            and self.chunks[0] > 1
            and self.chunks[1] >= self.shape[1]
            and not self.codec.compressed
            and not self.codec.checksum
        )

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"<ChunkedArray {self.path} shape={self.shape} chunks={self.chunks} dtype={self.dtype}>"

    # ---- keys and boxes ---------------------------------------------------------------

    def chunk_key(self, index: tuple[int, ...]) -> str:
        full = tuple(index) + (0,) * (self.ndim - len(index))
        sep = self.separator
        return f"{self.path}/c{sep}" + sep.join(str(i) for i in full)

    def _damage(
        self, index: tuple, reason: str, slot: int | None = None, error: type[CorruptChunkError] = CorruptChunkError
    ) -> CorruptChunkError:
        """The ``error`` for chunk ``index`` (grid position), naming its slots (``slot``: the one
        read from a packed chunk), steps and file."""
        where = self.kv.where(self.chunk_key(index))
        lo = int(index[0]) * self.chunks[0] if slot is None else slot
        if self.grid_axes == 1 or (self.chunks[0] > 1 and slot is None):
            hi = min(lo + self.chunks[0], self.shape[0])
            return error(f"{self.path}: slots {lo}..{hi - 1}: {reason} ({where})", field=self.path, location=where)
        ct = self.chunks[1]
        steps = (int(index[1]) * ct, min((int(index[1]) + 1) * ct, self.shape[1]))
        return error.at(self.path, lo, steps, where, reason)

    def _chunk_damage(self, index: tuple, damage: ChunkDamage) -> CorruptChunkError:
        """The error for chunk ``index`` failing its codec with ``damage``: ChunkChecksumError
        when only its stored crc32c is damaged."""
        return self._damage(index, str(damage), error=ChunkChecksumError if damage.checksum_only else CorruptChunkError)

    def _check_stored(self, data: bytes | memoryview, index: tuple) -> None:
        if len(data) > self.max_stored:
            reason = f"more than the {self.max_stored:,} bytes any encoding of the chunk takes are stored"
            raise self._damage(index, reason)

    def _decode(self, data: bytes | memoryview, index: tuple) -> np.ndarray:
        self._check_stored(data, index)
        try:
            return self.codec.decode(data, self.chunks)
        except ChunkDamage as e:
            raise self._chunk_damage(index, e) from None

    def _decode_into(self, data: bytes | memoryview, out: np.ndarray, index: tuple) -> None:
        self._check_stored(data, index)
        try:
            self.codec.decode_into(data, out)
        except ChunkDamage as e:
            raise self._chunk_damage(index, e) from None

    def _decode_many_into(
        self,
        data: bytes | memoryview,
        ranges: list[tuple[int, int]] | np.ndarray,
        out: np.ndarray,
        offsets: list[int] | np.ndarray,
        indices: list[tuple] | np.ndarray,
    ) -> None:
        """Chunks ``indices`` (grid positions: tuples, or one row each), stored at ``ranges`` of
        ``data``, decoded into the C-contiguous ``out`` at byte ``offsets``
        (``ChunkCodec.decode_many_into``)."""
        try:
            self.codec.decode_many_into(data, ranges, out, offsets, self.item_nbytes * self.chunks[1])
        except ChunkDamage as e:
            raise self._chunk_damage(tuple(int(i) for i in indices[e.item]), e) from None

    def _absent(self, index: tuple, slot: int | None = None) -> None:
        """A chunk that is not stored reads as zeros, unless it lies in a committed episode
        (``slot``: the one read from a packed chunk; else any of the chunk's)."""
        if self.committed is None:
            return
        ce, ti = self.chunks[0], int(index[1])
        first = int(index[0]) * ce
        slots = range(first, min(first + ce, self.shape[0])) if slot is None else [slot]
        for episode in slots:
            if ti * self.chunks[1] < self.committed(episode):
                reason = "chunk missing from a committed episode"
                raise self._damage(index, reason, episode) if ce > 1 else self._damage(index, reason)

    def _boxes_chunks(self, box: Sequence[tuple[int, int]]):
        """Chunk indices intersecting a box of [start, stop) over the grid axes."""
        ranges = [range(lo // c, (hi - 1) // c + 1) if hi > lo else range(0) for (lo, hi), c in zip(box, self.chunks)]
        return itertools.product(*ranges)

    # ---- reads --------------------------------------------------------------------------

    def _decode_many(self, raws: dict[tuple, bytes | None]) -> dict[tuple, np.ndarray | None]:
        present = [(k, v) for k, v in raws.items() if v is not None]
        total = sum(len(v) for _, v in present)
        if len(present) > 1 and total * 4 > _PARALLEL_DECODE_BYTES:
            decoded = thread_pool().map(lambda kv: self._decode(kv[1], kv[0]), present)
        else:
            decoded = (self._decode(v, k) for k, v in present)
        out: dict[tuple, np.ndarray | None] = {k: None for k in raws}
        out.update(zip((k for k, _ in present), decoded))
        return out

    def fetch_chunks(self, indices: Sequence[tuple]) -> dict[tuple, np.ndarray | None]:
        """Decoded chunks for chunk indices (None for chunks never written)."""
        unique = list(dict.fromkeys(indices))
        raws = self.kv.get_many([self.chunk_key(i) for i in unique], self.max_stored)
        return self._decode_many(dict(zip(unique, raws)))

    def read_boxes(self, boxes: Sequence[Sequence[tuple[int, int]]], check_absent: bool = True) -> list[np.ndarray]:
        """Each box (per grid axis [start, stop)) as an array, all chunks fetched in one batch;
        ``check_absent=False`` reads missing chunks as zeros without asking whether they lie in
        a committed episode (a write merging into a slot)."""
        needed = [list(self._boxes_chunks(box)) for box in boxes]
        chunks = self.fetch_chunks([i for per_box in needed for i in per_box])
        results = []
        for box, per_box in zip(boxes, needed):
            out = np.zeros(tuple(hi - lo for lo, hi in box) + self.shape[len(box) :], dtype=self.dtype)
            for index in per_box:
                chunk = chunks[index]
                if chunk is None:
                    if check_absent:
                        self._absent(index)
                    continue
                src, dst = [], []
                for (lo, hi), i, c in zip(box, index, self.chunks):
                    a, b = max(lo, i * c), min(hi, (i + 1) * c)
                    src.append(slice(a - i * c, b - i * c))
                    dst.append(slice(a - lo, b - lo))
                out[tuple(dst)] = chunk[tuple(src)]
            results.append(out)
        return results

    def take(self, episodes: np.ndarray) -> np.ndarray:
        """Entries ``episodes`` of an array chunked along episodes only (a meta array), read from
        the store now: the chunks holding them, fetched in one batch, never from a cache (a
        local raw chunk through a map of its file, ``KeyValue.mapped``, which shows the file as
        it is now). The re-check after every batch of a reader
        (``consistency.committed_generations``): a slice through ``__getitem__`` cost 2-3x as
        much for the one chunk it usually reads."""
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        ce = self.chunks[0]
        single = False
        if len(episodes):
            lo, hi = int(episodes.min()), int(episodes.max())
            if lo < 0 or hi >= self.shape[0]:
                bad = episodes[(episodes < 0) | (episodes >= self.shape[0])]
                raise IndexError(f"{self.path}: slots {bad.tolist()} out of range - must be in [0, {self.shape[0]})")
            single = lo // ce == hi // ce
        if single and not self.codec.compressed and not self.codec.checksum:
            # one raw chunk: indexed through a map of its file where the store has files (an
            # open, read and decode of the chunk per batch cost ~4x as much)
            first = lo // ce
            mapped = self.kv.mapped(self.chunk_key((first,)), math.prod(self.chunks) * self.dtype.itemsize)
            if mapped is not None:
                entries = mapped.view(self.codec.dtype).reshape(self.chunks)
                return entries[episodes - first * ce].astype(self.dtype, copy=False)
        ids = episodes // ce
        unique = [lo // ce] if single else np.unique(ids).tolist()
        chunks = self.fetch_chunks([(i,) for i in unique])
        out = np.empty((len(episodes), *self.shape[1:]), dtype=self.dtype)
        for i in unique:
            rows = slice(None) if len(unique) == 1 else ids == i
            chunk = chunks[(i,)]
            if chunk is None:
                self._absent((i,))
                out[rows] = 0
            else:
                out[rows] = chunk[episodes[rows] - i * ce]
        return out

    def gather(self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None) -> np.ndarray:
        """One element per (episode, timestep) pair; each chunk fetched and decoded once.

        ``generations`` (one per pair: the generation of the episode's slot, as the reader knows
        it) lets the read use the resident copy and the chunk cache; without it every chunk
        is read from the store. With ``generations_of`` the read is verified
        (``verifies_gathers``): rows of the generations named, else GenerationMismatchError.
        """
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        timesteps = np.asarray(timesteps, dtype=np.int64).reshape(-1)
        if len(episodes) and generations is not None and self.grid_axes == 2 and self._resident_enabled():
            return self._gather_resident(episodes, timesteps, _per_pair(generations, len(episodes)))
        out = self._gather_stored(episodes, timesteps, generations)
        if len(episodes) and generations is not None and self.verifies_gathers:
            self._check_generations(episodes, _per_pair(generations, len(episodes)))
        return out

    @property
    def verifies_gathers(self) -> bool:
        """Whether ``gather`` given generations returns rows of those generations only (else
        GenerationMismatchError): rows from the resident copy (``verifies_resident``) or read
        and then found still at the generations named (``_check_generations``)."""
        return self.generations_of is not None and self.grid_axes == 2

    def _check_generations(self, episodes: np.ndarray, generations: np.ndarray) -> None:
        """GenerationMismatchError naming the slots among ``episodes`` that do not hold their
        ``generations`` now, after a read of their rows: the others held them through the read
        (planned before it; generations never return)."""
        assert self.generations_of is not None
        slots, first = np.unique(episodes, return_index=True)
        moved = np.asarray(self.generations_of(slots), np.int64) != generations[first]
        if moved.any():
            raise GenerationMismatchError(self.kv.where(self.path), slots[moved])

    def _gather_stored(self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None) -> np.ndarray:
        """``gather`` from the stored chunks (through the chunk cache when ``generations`` are given)."""
        out = np.empty((len(episodes), *self.shape[2:]), dtype=self.dtype)
        if len(episodes) == 0:
            return out
        if self.packed:  # whole rows (checked), through the chunk cache when generations are given
            rows, first, inverse = np.unique(episodes, return_index=True, return_inverse=True)
            row_generations = None if generations is None else _per_pair(generations, len(episodes))[first].tolist()
            out[...] = self._packed_rows(rows, row_generations)[inverse.reshape(-1), timesteps]
            return out
        ce, ct = self.chunks[0], self.chunks[1]
        per_row = -(-self.shape[1] // ct)
        ids = (episodes // ce) * per_row + timesteps // ct
        unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        grid = [(int(i // per_row), int(i % per_row)) for i in unique]
        cached_generations = None
        if generations is not None and ce == 1 and _cache.max_bytes > 0:
            cached_generations = _per_pair(generations, len(episodes))[first].tolist()
        if ce == 1 and ct == 1:
            self._gather_whole(grid, first, cached_generations, out)
            duplicate = first[inverse] != np.arange(len(episodes))
            if duplicate.any():
                out[duplicate] = out[first[inverse[duplicate]]]
            return out
        chunks = self._chunks_cached(grid, cached_generations)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(unique) + 1))
        local_e, local_t = episodes % ce, timesteps % ct
        for u, chunk in enumerate(chunks):
            rows = order[bounds[u] : bounds[u + 1]]
            if chunk is None:
                self._absent(grid[u])
                out[rows] = 0
            else:
                out[rows] = chunk[local_e[rows], local_t[rows]]
        return out

    def read_rows(
        self,
        episodes: np.ndarray,
        t0: int,
        t1: int,
        generations: np.ndarray | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """``[episodes, t0:t1]`` as (len(episodes), t1 - t0, *shape), written into ``out`` when
        given; ``generations`` as in ``gather``."""
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        length = max(t1 - t0, 0)
        if out is None:
            out = np.empty((len(episodes), length, *self.shape[2:]), dtype=self.dtype)
        count = len(episodes)
        self.read_into(out, episodes, np.full(count, t0), np.full(count, length), generations)
        return out

    # ---- bulk reads of time spans ---------------------------------------------------------------

    def read_into(
        self,
        out: np.ndarray,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        generations: np.ndarray | None = None,
        parallel: bool = True,
        check: bool = True,
    ) -> None:
        """Steps ``starts[i] .. starts[i] + lengths[i]`` of episode ``episodes[i]`` into
        ``out[i, :lengths[i]]``; the rest of ``out`` is left as it is.

        Each chunk is fetched once and decoded straight into ``out`` when it lies inside the
        span (else into a scratch chunk and copied), the chunks spread over the thread pool
        unless ``parallel`` is False (a caller that runs its own parallel tasks, such as dask).
        ``generations`` (one per episode) lets small arrays use their resident copy. ``check=False``
        skips the per-episode checksums of a packed array (a writer sealing what it wrote).
        """
        episodes, starts, lengths = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (episodes, starts, lengths))
        self._check_out(out, episodes, starts, lengths)
        if not len(episodes) or not lengths.any():
            return
        if self._read_resident_into(out, episodes, starts, lengths, generations, parallel):
            return
        if self.packed:
            self._read_packed(out, episodes, starts, lengths)
            if check and self.check_rows is not None:
                self.check_rows(episodes, starts, lengths, out)
            return
        if self.chunks[0] != 1:
            self._read_into_by_gather(out, episodes, starts, lengths)
            return
        ct = self.chunks[1]
        pieces = [
            (i, e, ti)
            for i, (e, s, n) in enumerate(zip(episodes.tolist(), starts.tolist(), lengths.tolist()))
            if n > 0
            for ti in range(s // ct, (s + n - 1) // ct + 1)
        ]

        def decode(k: int, data: bytes | None) -> None:
            i, e, ti = pieces[k]
            self._decode_piece(data, e, ti, out, i, int(starts[i]), int(lengths[i]))

        keys = [self.chunk_key((e, ti)) for _, e, ti in pieces]
        if parallel:
            self.kv.get_each(keys, decode, limit=self.max_stored)
        else:
            for k, data in enumerate(self.kv.get_many(keys, self.max_stored)):
                decode(k, data)

    def _check_out(self, out: np.ndarray, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        if not (len(episodes) == len(starts) == len(lengths)):
            raise ValueError(
                f"{self.path}: episodes, starts and lengths differ in length "
                f"({len(episodes)}, {len(starts)}, {len(lengths)})"
            )
        if out.dtype != self.dtype or out.shape[0] < len(episodes) or out.shape[2:] != self.shape[2:]:
            raise ValueError(
                f"{self.path}: out has dtype {out.dtype} and shape {out.shape}; expected "
                f"{self.dtype} and ({len(episodes)}, time, *{self.shape[2:]})"
            )
        used = lengths > 0
        if len(episodes) and (
            lengths.min() < 0
            or used.any()
            and (
                starts[used].min() < 0 or (starts + lengths)[used].max() > self.shape[1] or lengths.max() > out.shape[1]
            )
        ):
            raise ValueError(
                f"{self.path}: spans (starts {starts.tolist()}, lengths {lengths.tolist()}) must lie "
                f"within the time axis ({self.shape[1]}) and out ({out.shape[1]} steps)"
            )

    def _decode_piece(
        self, data: bytes | memoryview | None, e: int, ti: int, out: np.ndarray, i: int, start: int, length: int
    ) -> None:
        """Chunk ``ti`` of episode ``e``'s time axis (its bytes, or None when never written) into
        its part of ``out[i, :length]``, which holds steps ``start .. start + length``."""
        ct = self.chunks[1]
        lo, hi = max(start, ti * ct), min(start + length, (ti + 1) * ct)
        target = out[i, lo - start : hi - start]
        if data is None:
            self._absent((e, ti))
            target[...] = 0
        elif hi - lo == ct and target.flags.c_contiguous:
            self._decode_into(data, target.reshape(1, *target.shape), (e, ti))
        else:
            target[...] = self._decode(data, (e, ti))[0, lo - ti * ct : hi - ti * ct]

    def _packed_rows(self, rows: np.ndarray, generations: list[int] | None) -> np.ndarray:
        """Whole rows of a packed array, (len(rows), T, *shape): from the chunk cache where
        cached under ``generations``, the rest read (and checked) in one ``read_into``."""
        keys = rows.tolist()
        found: list[np.ndarray | None] = [None] * len(keys)
        if generations is not None and _cache.max_bytes > 0:
            found = list(_cache.get_many(self._namespace, keys, generations))
        missing = [i for i, row in enumerate(found) if row is None]
        if missing:
            count = len(missing)
            block = np.empty((count, *self.shape[1:]), self.dtype)
            self.read_into(block, rows[missing], np.zeros(count, np.int64), np.full(count, self.shape[1], np.int64))
            for k, i in enumerate(missing):
                found[i] = block[k]
            if generations is not None and _cache.max_bytes > 0 and _cache.admits(block.nbytes):
                _cache.put_many(
                    self._namespace, [(keys[i], generations[i], block[k].copy()) for k, i in enumerate(missing)]
                )
        if not found:
            return np.empty((0, *self.shape[1:]), self.dtype)
        return np.stack([row for row in found if row is not None])

    def row_range(self, episode: int, start: int, length: int) -> tuple[str, int, int]:
        """(key, first byte, end byte) of steps ``start .. start + length`` of ``episode`` in a
        packed array's chunk."""
        step = self.item_nbytes
        first = (episode % self.chunks[0] * self.shape[1] + start) * step
        return self.chunk_key((episode // self.chunks[0], 0)), first, first + length * step

    def _read_packed(self, out: np.ndarray, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """``read_into`` for a packed array: a chunk many of whose rows are wanted is read
        whole (a first load of a field: a few large reads, straight into ``out`` where its rows
        land there as stored, ``_read_rows_in_place``); a few rows of a chunk (a refresh, a
        writer reading back what it wrote) are read as byte ranges, one per row span."""
        ce = self.chunks[0]
        ids = episodes // ce
        unique, counts = np.unique(ids, return_counts=True)
        wanted: list[int] = unique[counts * 8 >= ce].tolist()
        whole: list[int] = []
        size = int(np.prod(self.chunks, dtype=np.int64)) * self.dtype.itemsize
        # fetched a few at a time: the raw bytes held at once (chunks not read in place) stay
        # ~_PACKED_READ_BYTES
        group = max(1, _PACKED_READ_BYTES // size)
        for first in range(0, len(wanted), group):
            batch = wanted[first : first + group]
            picks = {c: np.flatnonzero(ids == c) for c in batch}
            placed = self._read_rows_in_place(out, episodes, starts, lengths, picks, size)
            copied = [c for c in batch if c not in placed]
            fetched = self.kv.get_many([self.chunk_key((c, 0)) for c in copied], self.max_stored)
            # whole chunks (None: absent); a chunk of the wrong size is read row by row below:
            # each row is whole or damaged
            raws = {c: raw for c, raw in zip(copied, fetched) if raw is None or len(raw) == size}
            raws.update((c, None) for c, stored in placed.items() if not stored)
            whole += [*raws, *(c for c, stored in placed.items() if stored)]
            for c, raw in raws.items():
                picked = picks[c]
                if raw is None:
                    for episode in episodes[picked].tolist():
                        self._absent((c, 0), episode)
                    chunk = np.zeros(self.chunks, self.dtype)
                else:
                    chunk = np.frombuffer(raw, self.codec.dtype).reshape(self.chunks)
                _copy_rows(out, picked, chunk, episodes[picked] - c * ce, starts[picked], lengths[picked])
        rest = [i for i in np.flatnonzero(~np.isin(ids, whole)).tolist() if lengths[i] > 0]
        if not rest:
            return
        requests = [self.row_range(int(episodes[i]), int(starts[i]), int(lengths[i])) for i in rest]
        for i, (_, lo, hi), data in zip(rest, requests, self.kv.get_ranges(requests)):
            index = (int(ids[i]), 0)
            if data is None:
                self._absent(index, int(episodes[i]))
                out[i, : lengths[i]] = 0
            elif len(data) != hi - lo:
                if self.committed is not None and not self.committed(int(episodes[i])):
                    out[i, : lengths[i]] = 0  # no episode there: its next write rewrites it whole
                    continue
                raise self._damage(index, f"{len(data)} bytes where the row needs {hi - lo}", int(episodes[i]))
            else:
                out[i, : lengths[i]] = np.frombuffer(data, self.codec.dtype).reshape(int(lengths[i]), *self.shape[2:])

    def _read_rows_in_place(
        self,
        out: np.ndarray,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        picks: dict[int, np.ndarray],
        size: int,
    ) -> dict[int, bool]:
        """Of the packed chunks ``picks`` (chunk -> the items read from it), those whose items
        are a run of whole rows going, in order, to consecutive rows of ``out`` as stored (a
        first load) are read from the store straight into ``out``: no bytes object and no
        second copy of the field is held while it loads. Returns chunk -> True (read) or False
        (absent: nothing written) for those chunks; the others, and chunks of the wrong size,
        are left to the caller."""
        if (
            out.dtype != self.codec.dtype
            or out.shape[1] != self.chunks[1]
            or not out.flags.c_contiguous
            or not ((starts == 0).all() and (lengths == out.shape[1]).all())
        ):
            return {}
        ce, row = self.chunks[0], self.chunks[1] * self.item_nbytes
        runs: list[int] = []
        requests: list[ReadInto] = []
        for c, picked in picks.items():
            local = episodes[picked] - c * ce
            if _is_run(picked) and _is_run(local):
                runs.append(c)
                view = out[picked[0] : picked[0] + len(picked)].reshape(-1).view(np.uint8).data
                requests.append((self.chunk_key((c, 0)), int(local[0]) * row, view))
        sizes = self.kv.get_into(requests) if requests else []
        return {c: n is not None for c, n in zip(runs, sizes) if n is None or n == size}

    def _read_into_by_gather(
        self, out: np.ndarray, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Chunks spanning several episodes (not an array replaybuf writes): through ``gather``."""
        steps = np.arange(int(lengths.max()))
        mask = steps[None] < lengths[:, None]
        values = self.gather(np.repeat(episodes, lengths), (starts[:, None] + steps[None])[mask])
        out[: len(episodes), : len(steps)][mask] = values

    # ---- the chunk cache and the resident copy -----------------------------------------------

    def _chunks_cached(self, grid: list[tuple[int, int]], generations: list | None) -> list[np.ndarray | None]:
        """Decoded chunks at grid positions, served from the cache where the generation matches."""
        keys = grid
        found: list = [None] * len(keys) if generations is None else _cache.get_many(self._namespace, keys, generations)
        missing = [i for i, chunk in enumerate(found) if chunk is None]
        if missing:
            decoded = self.fetch_chunks([grid[i] for i in missing])
            for i in missing:
                found[i] = decoded[grid[i]]
            if generations is not None:
                _cache.put_many(
                    self._namespace,
                    [(keys[i], generations[i], ABSENT if found[i] is None else found[i]) for i in missing],
                )
        return [None if chunk is ABSENT else chunk for chunk in found]

    def _gather_whole(
        self, grid: list[tuple[int, int]], first: np.ndarray, generations: list | None, out: np.ndarray
    ) -> None:
        """Chunks of one element: decode each straight into its row of ``out``."""
        keys = grid
        rows = first.tolist()
        todo = list(range(len(grid)))
        if generations is not None:
            todo = []
            for i, chunk in enumerate(_cache.get_many(self._namespace, keys, generations)):
                if chunk is None:
                    todo.append(i)
                else:
                    out[rows[i]] = chunk.reshape(out.shape[1:])
        if not todo:
            return
        self._read_whole_into(
            [grid[i] for i in todo],
            [rows[i] for i in todo],
            out,
            None if generations is None else [generations[i] for i in todo],
        )
        if generations is not None and _cache.admits(len(todo) * out[0].nbytes):
            again = _cache.second_misses(self._namespace, [keys[i] for i in todo])
            _cache.put_many(
                self._namespace, [(keys[i], generations[i], out[rows[i]].copy()) for i, hot in zip(todo, again) if hot]
            )

    def _read_whole_into(
        self, grid: list[tuple[int, int]], rows: list[int], out: np.ndarray, generations: list | None
    ) -> None:
        """Fetch the one-element chunks at ``grid`` and decode chunk i into ``out[rows[i]]``."""
        del generations

        def decode(i: int, data: bytes | None) -> None:
            if data is None:
                self._absent(grid[i])
                out[rows[i]] = 0
            else:
                self._decode_into(data, out[rows[i] : rows[i] + 1], grid[i])

        self.kv.get_each([self.chunk_key(g) for g in grid], decode, limit=self.max_stored)

    def _resident_enabled(self) -> bool:
        """Whether the array is held whole in RAM: a small field (``RESIDENT_STEP_BYTES`` per
        step at most) or a small array (``SMALL_ARRAY_BYTES`` in all) whose full size fits what
        is left of the process's resident budget."""
        if self._resident is not None:
            return True
        if self._too_large_to_hold:  # a frame array: asked per batch, without the lock
            return False
        with self._resident_lock:
            return self._make_resident()

    @property
    def verifies_resident(self) -> bool:
        """Whether reads given generations are served from a resident copy whose rows were
        checked against their slots' stored generations when loaded (``generations_of``): such
        a read returns rows of the generations it names only (else GenerationMismatchError),
        and its caller needs no re-check of its own (``Storage.verifies_reads``)."""
        return self.generations_of is not None and self._resident is not None

    def _make_resident(self) -> bool:
        """``_resident_enabled`` for an array without a resident copy yet (lock held)."""
        if self._resident is None:  # asked per batch of a large array: math.prod, not numpy's (~3 us)
            step = math.prod(self.shape[2:]) * self.dtype.itemsize
            nbytes = math.prod(self.shape) * self.dtype.itemsize
            small = step <= RESIDENT_STEP_BYTES or nbytes <= SMALL_ARRAY_BYTES
            if self.grid_axes != 2 or not small:
                self._too_large_to_hold = True  # for good: the shape never changes
                return False
            if not _cache.take_resident(nbytes):  # the budget may free up later
                return False
            weakref.finalize(self, _cache.release_resident, nbytes)
            self._resident = np.zeros(self.shape, dtype=self.dtype)
            self._resident_generations = np.full(self.shape[0], _NEVER, dtype=np.int64)
            self._resident_prints = np.zeros(self.shape[0], dtype=np.int64)
            self._resident_checked = np.ones(self.shape[0], dtype=bool)
        return True

    def _resident_copy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The resident rows, their generations, fingerprints and checked flags: callers asked
        ``_resident_enabled`` first, which makes the four together."""
        rows, generations = self._resident, self._resident_generations
        prints, checked = self._resident_prints, self._resident_checked
        assert rows is not None and generations is not None and prints is not None and checked is not None
        return rows, generations, prints, checked

    def load_resident(self, episodes: np.ndarray, generations: np.ndarray) -> bool:
        """Bring the resident rows of ``episodes`` (slots) to ``generations`` (their generations):
        only rows loaded at another generation, or whose stored objects changed since (after
        ``drop_cached``), are read, all in one parallel pass. False when the array is not
        held in RAM (too large; see ``_resident_enabled``)."""
        if not self._resident_enabled():
            return False
        self._current_rows(np.asarray(episodes, dtype=np.int64), np.asarray(generations, dtype=np.int64))
        return True

    def _current_rows(self, episodes: np.ndarray, generations: np.ndarray) -> None:
        """Make the resident rows of ``episodes`` hold ``generations`` (one per episode)."""
        with self._resident_lock:
            self._bring_rows(episodes, generations)

    def _bring_rows(self, episodes: np.ndarray, generations: np.ndarray) -> None:
        """``_current_rows`` with the lock held."""
        _, known, _, checked = self._resident_copy()
        if self._resident_unchecked:
            unchecked = ~checked[episodes]
            if unchecked.any():
                self._recheck(np.unique(episodes[unchecked]))
            self._resident_unchecked = not checked.all()
        stale = known[episodes] != generations
        if stale.any():
            rows, index = np.unique(episodes[stale], return_index=True)
            self._load_resident(rows, generations[stale][index])

    def _read_resident_into(
        self,
        out: np.ndarray,
        episodes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        generations,
        parallel: bool = True,
    ) -> bool:
        """``read_into`` from the resident copy, when the array is held in RAM and the caller
        gave ``generations``; False otherwise (nothing done). Its rows were checked against their
        chunks' crc32c when loaded and live in this process's private memory: a later change
        on disk is never returned from it (a new generation or changed stored objects, seen by
        ``refresh``, reload the row). Large batches are copied on the pool (``copy_spans``)."""
        if generations is None or not self._resident_enabled():
            return False
        self._current_rows(episodes, _per_pair(generations, len(episodes)))
        resident = self._resident_copy()[0]
        spans = list(zip(episodes.tolist(), starts.tolist(), lengths.tolist()))

        def copy(i: int) -> None:
            e, s, n = spans[i]
            out[i, :n] = resident[e, s : s + n]

        copy_spans(len(spans), copy, int(lengths.sum()) * resident[0, 0].nbytes, parallel)
        return True

    def _gather_resident(self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """Small arrays are held whole in RAM; rows are read when first used or stale. One
        ``take`` of flat positions is the batch's only copy (assigning it into a preallocated
        array doubled the time of a frame batch; a two-axis fancy index of vector rows took
        ~3x as long)."""
        self._current_rows(episodes, generations)
        resident = self._resident_copy()[0]
        try:
            flat = np.ravel_multi_index((episodes, timesteps), resident.shape[:2])
        except ValueError:  # negative (counted from the end) or out of range: numpy's answer
            return resident[episodes, timesteps]
        return resident.reshape(-1, *resident.shape[2:]).take(flat, axis=0)

    def _row_keys(self, episode: int) -> list[str]:
        """The stored objects holding episode ``episode``'s row."""
        first = episode // self.chunks[0]
        return [self.chunk_key((first, ti)) for ti in range(-(-self.shape[1] // self.chunks[1]))]

    def _fingerprints(self, rows: np.ndarray) -> np.ndarray | None:
        """One fingerprint per row of its stored objects, or None where the store cannot tell
        cheaply (object stores: asking costs as much as reading a small chunk)."""
        if self.row_prints is not None:
            return self.row_prints(rows)
        keys = [self._row_keys(e) for e in rows.tolist()]
        prints = self.kv.fingerprints([k for per_row in keys for k in per_row])
        if prints is None:
            return None
        width = len(keys[0]) if keys else 0
        return np.asarray([hash(tuple(p)) for p in zip(*[iter(prints)] * width)] if width else [], dtype=np.int64)

    def _recheck(self, rows: np.ndarray) -> None:
        """Rows kept through ``drop_cached``: those whose stored objects changed are read again."""
        _, known, kept_prints, checked = self._resident_copy()
        prints = self._fingerprints(rows)
        if prints is None:
            known[rows] = _NEVER
        else:
            known[rows[prints != kept_prints[rows]]] = _NEVER
        checked[rows] = True

    def _load_resident(self, rows: np.ndarray, generations: np.ndarray) -> None:
        """Read whole rows into the resident copy: one parallel pass over their objects,
        fingerprinted before the read (a write racing the read then shows as a change). With
        ``generations_of``, a row whose slot no longer holds its generation after the read (a
        writer reused it meanwhile) is not kept: GenerationMismatchError names those slots,
        after the other rows are kept."""
        resident, known, kept_prints, _ = self._resident_copy()
        prints = self._fingerprints(rows)
        count = len(rows)
        run = count and int(rows[-1]) - int(rows[0]) == count - 1  # ascending (np.unique), no gap
        # one run of slots (a first load) is decoded in place; scattered ones through a copy
        values = resident[rows[0] : rows[0] + count] if run else np.empty((count, *self.shape[1:]), self.dtype)
        known[rows] = _NEVER  # until read and checked: a failed read leaves nothing trusted
        self.read_into(values, rows, np.zeros(count, np.int64), np.full(count, self.shape[1], np.int64))
        if not run:
            resident[rows] = values
        # a generation read after the data and equal to the one named held through the read:
        # generations never return (``consistency.py``)
        moved = np.zeros(count, bool) if self.generations_of is None else self.generations_of(rows) != generations
        known[rows[~moved]] = generations[~moved]
        if prints is not None:
            kept_prints[rows] = prints
        self.resident_rows_read += count
        if moved.any():
            raise GenerationMismatchError(self.kv.where(self.path), rows[moved])

    def _forget_rows(self, slots: np.ndarray) -> None:
        """After rows ``slots`` were written in place: their resident rows are read again on
        next use (the other rows of a packed chunk stay)."""
        _cache.discard(self._namespace, slots.tolist())
        if self._resident_generations is not None:
            self._resident_generations[slots] = _NEVER

    def _forget(self, chunks: dict[tuple, np.ndarray | None]) -> None:
        """Keep the cache and the resident copy true to chunks written in this process."""
        _cache.discard(self._namespace, list(chunks))
        if self._resident_generations is None:  # set together with _resident
            return
        for index in chunks:
            lo = index[0] * self.chunks[0]
            self._resident_generations[lo : lo + self.chunks[0]] = _NEVER

    def drop_cached_episodes(self, episodes: Sequence[int]) -> None:
        """Forget what this process holds of ``episodes``' rows (decoded chunks, packed rows,
        resident rows, open read handles), so their next read reads them as stored now: all are
        keyed by generation, which a writer elsewhere editing them in place keeps."""
        slots = sorted({int(e) for e in episodes})
        steps = -(-self.shape[1] // self.chunks[1])
        grid = dict.fromkeys((slot // self.chunks[0], ti) for slot in slots for ti in range(steps))
        _cache.discard(self._namespace, [*grid, *slots])
        self.kv.drop_read_handles([key for slot in slots for key in self._row_keys(slot)])
        if self._resident_generations is not None:
            self._resident_generations[slots] = _NEVER

    def drop_cached(self) -> None:
        """Forget what this process holds of the array (chunk cache, shard indexes) and mark
        the resident rows for a check: the generations they are keyed by do not change when a
        writer elsewhere updates a committed episode in place, so a row is kept only while
        its stored objects' fingerprints are unchanged (``_recheck``)."""
        _cache.discard_namespace(self._namespace)
        with self._resident_lock:  # not between a batch's look at the flag and its reset
            if self._resident_checked is not None:
                self._resident_checked[:] = False
                self._resident_unchecked = True

    def __getstate__(self) -> dict:
        # The resident copy stays in the process that read it; a spawned worker loads its own.
        resident = ("_resident", "_resident_generations", "_resident_prints", "_resident_checked", "_resident_lock")
        return {**self.__dict__, **dict.fromkeys(resident), "_resident_unchecked": False, "resident_rows_read": 0}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._resident_lock = threading.Lock()

    # ---- writes -------------------------------------------------------------------------

    def _edit_in_place(
        self, slots: np.ndarray, edit: Callable[[np.ndarray, np.ndarray], None], covers: bool, published: bool
    ) -> bool:
        """Edit rows ``slots`` (sorted, unique) of an uncompressed array whose chunks hold whole
        rows (the meta arrays, packed data arrays) in place, as a memmap would: False when that
        is not possible (other arrays, a medium without in-place writes).

        Nearby rows of a chunk (``_GAP_BYTES`` apart at most) make one span, read once unless
        ``covers`` (the edit sets every byte of its rows and they are contiguous), edited by
        ``edit(block, at)`` (``block[at[i]]`` is row ``slots[i]``) and written back with one
        pwrite. Committed rows read are first checked (``check_rows``: CorruptChunkError, and
        nothing written, rather than new checksums over damage); rows between edited ones are
        written back as read, so this relies on the one
        writer (the lease) making no other write meanwhile. A chunk not stored yet is first
        created whole (zeros, ``_create_chunk``). ``published``: the rows may hold committed
        episodes, handed to ``rows_written`` as now stored."""
        if self.grid_axes != 1 and not self.packed or self.codec.compressed or not self.kv.writes_in_place:
            return False
        per_chunk, row_shape = self.chunks[0], self.shape[1:]
        row_nbytes = self.item_nbytes * (self.shape[1] if self.grid_axes == 2 else 1)
        if len(slots) == 1:  # one episode's commit, per field and meta array: no span planning
            first = int(slots[0])
            at, rows = np.zeros(1, np.int64), 1
            spans = [(first // per_chunk, first % per_chunk * row_nbytes, 0, 1)]
        else:
            bounds = nearby_spans(slots, row_nbytes, per_chunk)
            firsts, lasts = slots[bounds[:-1]], slots[bounds[1:] - 1] + 1
            offsets = np.concatenate([[0], np.cumsum(lasts - firsts)])  # row of each span in block
            group = np.repeat(np.arange(len(firsts)), np.diff(bounds))
            at, rows = offsets[group] + slots - firsts[group], int(offsets[-1])
            spans = [  # (chunk, first byte in it, rows lo .. hi of block)
                (first // per_chunk, first % per_chunk * row_nbytes, lo, hi)
                for first, lo, hi in zip(firsts.tolist(), offsets[:-1].tolist(), offsets[1:].tolist())
            ]
        block = np.zeros((rows, *row_shape), self.codec.dtype)
        if not covers or len(at) != len(block):
            raws = self.kv.get_ranges(
                [(self.chunk_key((chunk,)), byte, byte + (hi - lo) * row_nbytes) for chunk, byte, lo, hi in spans]
            )
            flat = block.reshape(len(block), -1).view(np.uint8)
            for (_, _, lo, hi), raw in zip(spans, raws):
                if raw is None:  # a chunk not stored yet: zeros, created below
                    continue
                if len(raw) != (hi - lo) * row_nbytes:
                    return False  # write_box rewrites the chunk
                flat[lo:hi] = np.frombuffer(raw, np.uint8).reshape(hi - lo, -1)
            if published and self.check_rows is not None:  # sealing damage read here would hide it
                count = len(slots)
                self.check_rows(slots, np.zeros(count, np.int64), np.full(count, self.shape[1], np.int64), block[at])
        edit(block, at)
        for chunk, byte, lo, hi in spans:
            key, data = self.chunk_key((chunk,)), block[lo:hi].tobytes()
            if not self.kv.write_at(key, byte, data):
                if not self._create_chunk(chunk) or not self.kv.write_at(key, byte, data):
                    return False  # write_box writes it all
        if self.packed:
            self._forget_rows(slots)
            if published and self.rows_written is not None:
                self.rows_written(slots, block[at])
        return True

    def _create_chunk(self, chunk: int) -> bool:
        """Store chunk ``chunk`` (of a packed or meta array) whole, as zeros, where the medium
        writes in place (a local file): True when it was created. Only a writer creates chunks:
        a meta chunk not stored reads as zeros, and a packed one holds no published slot yet."""
        if not self.kv.writes_in_place:
            return False
        self.kv.set_many({self.chunk_key((chunk,)): self.codec.encode(np.zeros(self.chunks, self.dtype))})
        return True

    def write_box(
        self, start: Sequence[int], values: np.ndarray, atomic: bool = True, padding_from: int | None = None
    ) -> None:
        """Write ``values`` at ``start`` (per grid axis), rewriting partly covered chunks.

        ``atomic=False`` allows writing objects in place: only for slots no reader trusts yet.
        ``padding_from`` (steps from it on are zeros that need not be stored) is used by shards
        only: a chunk of several steps stores its padding compressed.
        """
        if self.check_writable is not None:
            self.check_writable()
        published = atomic
        # a packed chunk holds other slots that readers trust: it is only ever replaced whole
        atomic = atomic or self.packed
        box = [(s, s + n) for s, n in zip(start, values.shape)]
        indices = list(self._boxes_chunks(box))
        partial = [i for i in indices if not self._covers(box, i)]
        existing = self._old_chunks(partial) if partial else {}
        encoded: dict[str, np.ndarray] = {}
        empty: list[str] = []
        written: dict[tuple, np.ndarray | None] = {}
        for index in indices:
            chunk_box = [(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self.chunks, self.shape)]
            src = tuple(slice(max(lo, a) - lo, min(hi, b) - lo) for (lo, hi), (a, b) in zip(box, chunk_box))
            if index in existing:
                chunk = existing[index]
                chunk = np.zeros(self.chunks, self.dtype) if chunk is None else chunk.copy()
                dst = tuple(slice(max(lo, a) - a, min(hi, b) - a) for (lo, hi), (a, b) in zip(box, chunk_box))
                chunk[dst] = values[src]
            else:
                chunk = values[src]
                if chunk.shape != self.chunks:
                    padded = np.zeros(self.chunks, self.dtype)
                    padded[tuple(slice(0, n) for n in chunk.shape)] = chunk
                    chunk = padded
            key = self.chunk_key(index)
            if chunk.any() or self.committed is not None:
                encoded[key] = written[index] = chunk
            else:
                empty.append(key)
                written[index] = None
        if len(encoded) > 1 and sum(v.nbytes for v in encoded.values()) > _PARALLEL_DECODE_BYTES:
            blobs = dict(zip(encoded, thread_pool().map(self.codec.encode, encoded.values())))
        else:
            blobs = {k: self.codec.encode(v) for k, v in encoded.items()}
        if blobs:
            self.kv.set_many(blobs, atomic=atomic)
        if empty:
            self.kv.delete_many(empty)
        self._forget(written)
        if self.packed:
            slots = np.arange(int(start[0]), int(start[0]) + len(values))
            self._forget_rows(slots)
            if published and self.rows_written is not None:
                self.rows_written(slots, None)

    def _sealed(self, data: bytes | memoryview, index: tuple) -> bytes | None:
        """Chunk ``index`` stored as ``data`` with its crc32c recomputed when only that crc is
        damaged (ChunkChecksumError; the payload then still has to decode), None when the chunk
        is sound; any other damage raises CorruptChunkError."""
        try:
            self._decode(data, index)
            return None
        except ChunkChecksumError:
            payload = bytes(memoryview(data)[:-4])
        sealed = payload + crc32c(payload).to_bytes(4, "little")
        self._decode(sealed, index)
        return sealed

    def reseal_chunks(self, episode: int, write: bool) -> list[str]:
        """The stored chunks of ``episode`` (an array of one episode per chunk, checksummed)
        whose own crc32c alone is damaged, re-sealed in place (``write``: each file replaced
        whole, atomically) or only found; any other damage (a chunk of the committed steps
        missing included) raises CorruptChunkError, and nothing is written then. Returns where
        each one lies."""
        indices = [(episode, t) for t in range(-(-self.shape[1] // self.chunks[1]))]
        keys = [self.chunk_key(index) for index in indices]
        sealed = {}
        for index, key, data in zip(indices, keys, self.kv.get_many(keys, self.max_stored)):
            if data is None:
                self._absent(index)
            elif (fixed := self._sealed(data, index)) is not None:
                sealed[key] = fixed
        if write and sealed:
            if self.check_writable is not None:
                self.check_writable()
            self.kv.set_many(sealed, atomic=True)
            self._forget(dict.fromkeys(indices))
        return [self.kv.where(key) for key in sealed]

    def _stale_damage(self, error: CorruptChunkError) -> bool:
        """Whether damage lies in a slot that holds no committed episode (being rewritten): its
        old bytes are overwritten, not merged, so they may be read as zeros."""
        return self.committed is not None and error.slot is not None and self.committed(error.slot) == 0

    def _old_chunks(self, indices: list[tuple]) -> dict[tuple, np.ndarray | None]:
        """The chunks a partial write merges into; damaged ones of uncommitted slots as None."""
        try:
            return self.fetch_chunks(indices)
        except CorruptChunkError as e:
            if not self._stale_damage(e):
                raise
        found = {}
        for index in indices:
            try:
                found.update(self.fetch_chunks([index]))
            except CorruptChunkError as e:
                if not self._stale_damage(e):
                    raise
                found[index] = None
        return found

    def _covers(self, box, index) -> bool:
        for (lo, hi), i, c, n in zip(box, index, self.chunks, self.shape):
            if lo > i * c or hi < min((i + 1) * c, n):
                return False
        return True

    # ---- numpy-style indexing -------------------------------------------------------------

    def _normalize(self, key: Any):
        """(episode selector, time slice or None, rest) or None when the key needs zarr-python."""
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis or k is None for k in key) or len(key) > self.ndim:
            return None
        first = key[0] if key else slice(None)
        if isinstance(first, (int, np.integer)):
            e = int(first) + (self.shape[0] if first < 0 else 0)
            if not 0 <= e < self.shape[0]:
                raise IndexError(f"index {first} is out of bounds for axis 0 with size {self.shape[0]}")
            episodes, squeeze = np.array([e]), True
        elif isinstance(first, slice):
            episodes, squeeze = np.arange(*first.indices(self.shape[0])), False
        else:
            arr = np.asarray(first)
            if arr.dtype == bool and arr.shape == (self.shape[0],):
                arr = np.flatnonzero(arr)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                return None
            episodes = np.where(arr < 0, arr + self.shape[0], arr)
            if episodes.size and (episodes.min() < 0 or episodes.max() >= self.shape[0]):
                raise IndexError(f"index out of bounds for axis 0 with size {self.shape[0]}")
            squeeze = False
        rest = key[1:]
        if self.grid_axes == 1:
            return episodes, squeeze, None, False, rest
        second = rest[0] if rest else slice(None)
        rest = rest[1:]
        if isinstance(second, (int, np.integer)):
            t = int(second) + (self.shape[1] if second < 0 else 0)
            if not 0 <= t < self.shape[1]:
                raise IndexError(f"index {second} is out of bounds for axis 1 with size {self.shape[1]}")
            time, squeeze_t = (t, t + 1), True
        elif isinstance(second, slice):
            start, stop, step = second.indices(self.shape[1])
            if step != 1:
                return None
            time, squeeze_t = (start, max(start, stop)), False
        else:
            return None
        return episodes, squeeze, time, squeeze_t, rest

    def __getitem__(self, key: Any) -> np.ndarray:
        parsed = self._normalize(key)
        if parsed is None:
            return np.asarray(self._zarr()[key])
        episodes, squeeze, time, squeeze_t, rest = parsed
        if self.packed and time is not None:  # through read_into: whole episodes are checked
            count, (t0, t1) = len(episodes), time
            out = np.zeros((count, t1 - t0, *self.shape[2:]), self.dtype)
            self.read_into(out, episodes, np.full(count, t0, np.int64), np.full(count, t1 - t0, np.int64))
            index = (0 if squeeze else slice(None), 0 if squeeze_t else slice(None))
            return out[index + tuple(rest)]
        if len(episodes) > 1 and episodes[-1] - episodes[0] == len(episodes) - 1 and (np.diff(episodes) == 1).all():
            boxes = [((int(episodes[0]), int(episodes[-1]) + 1),) + ((time,) if time is not None else ())]
        else:
            boxes = [((int(e), int(e) + 1),) + ((time,) if time is not None else ()) for e in episodes]
        full = (len(episodes),) + ((time[1] - time[0],) if time else ()) + self.shape[self.grid_axes :]
        parts = self.read_boxes(boxes)
        out = np.concatenate(parts) if parts else np.zeros(full, self.dtype)
        picked = (0 if squeeze else slice(None),) + ((0 if squeeze_t else slice(None),) if time else ())
        return out[picked + tuple(rest)]

    def write_rows(
        self, episodes: np.ndarray, t0: int, values: np.ndarray, atomic: bool = True, padding_from: int | None = None
    ) -> None:
        """Write (len(episodes), T, *shape) rows at time ``t0`` (an episode given twice: its last
        row): in place where the array allows (``_edit_in_place``), else one request batch per
        run of consecutive episodes (none for no episodes). ``padding_from``: steps from it on
        are zeros that need not be stored (``Storage.write_tail_rows``)."""
        episodes = np.asarray(episodes).reshape(-1)
        if len(episodes) == 0:
            return
        if self.check_writable is not None:
            self.check_writable()
        if len(episodes) > 1:  # a one-episode commit pays this per field and per meta array
            keep = last_occurrences(episodes)
            episodes, values = episodes[keep], values[keep]
        steps = (slice(t0, t0 + values.shape[1]),) if self.grid_axes > 1 else ()

        def edit(block: np.ndarray, at: np.ndarray) -> None:
            block[(at, *steps)] = values

        covers = self.grid_axes == 1 or values.shape[1] == self.shape[1]
        if self._edit_in_place(episodes, edit, covers, published=atomic):
            return
        bounds = [0, *(np.flatnonzero(np.diff(episodes) != 1) + 1).tolist(), len(episodes)]
        for lo, hi in zip(bounds, bounds[1:]):
            start = (int(episodes[lo]),) + ((t0,) if self.grid_axes > 1 else ())
            self.write_box(start, values[lo:hi], atomic=atomic, padding_from=padding_from)

    def write_steps(self, episodes: np.ndarray, timesteps: np.ndarray, values: np.ndarray) -> bool:
        """Write ``values[i]`` at step ``timesteps[i]`` of committed episode ``episodes[i]`` of a
        packed array in place, one read-modify-write per span of nearby rows (a pair given
        twice: its last value); False where the array is not written in place (the caller
        writes whole rows instead)."""
        if not self.packed:
            return False
        if self.check_writable is not None:
            self.check_writable()
        keep = last_occurrences(episodes * self.shape[1] + timesteps)  # sorted by episode
        episodes, timesteps, values = episodes[keep], timesteps[keep], values[keep]
        slots, inverse = np.unique(episodes, return_inverse=True)

        def edit(block: np.ndarray, at: np.ndarray) -> None:
            block[at[inverse], timesteps] = values

        return self._edit_in_place(slots, edit, covers=False, published=True)

    def __setitem__(self, key: Any, value: Any) -> None:
        parsed = self._normalize(key)
        if parsed is None or parsed[4]:
            self._zarr()[key] = value
            return
        episodes, squeeze, time, squeeze_t, _ = parsed
        full = (len(episodes),) + ((time[1] - time[0],) if time else ()) + self.shape[self.grid_axes :]
        drops = (squeeze,) + ((squeeze_t,) if time else ()) + (False,) * (self.ndim - self.grid_axes)
        view = tuple(n for n, drop in zip(full, drops) if not drop)
        values = np.broadcast_to(np.asarray(value, dtype=self.dtype), view).reshape(full)
        if len(episodes):
            self.write_rows(episodes, time[0] if time else 0, values)

    def _zarr(self):
        if self._zarr_array is None:
            raise IndexError(f"indexing {self.path} this way is not supported")
        return self._zarr_array() if callable(self._zarr_array) else self._zarr_array
