"""Reads of hot shards (``_hot.py``) from memory maps of their files, at a plain gather's speed.

A hot shard on local disk holds each inner chunk raw behind blosc's 16-byte header, followed by
its crc32c, one after another from offset 0, with its binding (format 5) and the zarr shard index at the end. Reading it
frame by frame through ``pread`` cost ~17 us a frame (index lookup, read, crc32c, copy), 0.2-0.4x
an ``np.memmap`` gather of the same frames. Here a reader maps each hot shard file once and
checks its index (and, from format 5, its binding to the slot it is read for, from format 6 to
the buffer too: a shard copied from another slot or buffer is never mapped), the headers of its chunks and every chunk's crc32c once (~2.5 us a frame
here, as much as copying it), then copies frames straight from the maps: one fancy index over
all of them for a timestep batch (``_strided.take_at``), one copy per episode for trajectories. While the maps fit (``MAX_MAPS``) a
shard is checked whole when mapped; once maps are evicted, frame by frame as first read (a
shard mapped again would otherwise be checked whole to serve a few frames).

A map serves only the file version it was made from, and the file is stat'ed before a read
uses the map: a new inode, size, mtime or ctime drops the map, and the next read maps and checks
it again. A map's frames are of one episode: a read naming the generation it planned for the
slot (``consistency.read_consistent``) that finds the slot still at that generation after
mapping the file (``ShardedArray.gather``) knows the map holds that generation, and says so
(``HotMap.generation``). Such a verified map serves reads naming its generation without a stat
for ``TRUST_S`` (a stat of each sampled shard was a fifth of a batch's time), and without the
batch's re-read of its slots' generations (``Storage.verifies_gathers``): the file version it
maps never changes, and a writer reusing the slot puts a new inode at the path. An in-place
edit (same generation, a new inode) is seen after the reader's next ``drop_caches``
(``refresh()``), as it is from the read cache, and here within ``TRUST_S`` anyway; this
process's own writes drop their maps at once. An edit in place
within the kernel's timestamp tick (a few ms) of the file's write leaves all four unchanged
and is not seen by a reader that checked the file before it; a page the kernel evicts and reads
again from a failing disk is not checked again either.

Why a map is safe to keep: every write of a shard a reader may map is a rename of a complete
temp file (``ShardedArray._write_box``), so a map always sees one whole file version, and a
compaction or a reused slot puts a new inode at the path (the old one stays whole, mapped,
until the map goes: at the next read of the path, an eviction, or the buffer's ``close()``).
Only damage from outside replaybuf (a file truncated in place) could fault a map's pages
(SIGBUS), as it would any np.memmap's; a stat sees a truncation done before it.

Anything the maps cannot serve as checked raw frames is left to the array's usual read path,
which reports it as before: a shard absent or compressed (compacted, cold), an index or a
header not as a hot shard writes them, a frame failing its crc32c (the map is dropped, and the
usual path reads the file again and raises ``CorruptChunkError`` naming it, or reads the new
version a writer put in place meanwhile).
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ._codecs import BLOSC_HEADER, BLOSC_MEMCPYED, crc32c
from ._kv import LocalKV, copy_spans
from ._mapping import map_file
from ._strided import gather_addresses, take_at

if TYPE_CHECKING:
    from ._shards import Expected, ShardedArray

#: shard files a process keeps mapped, the least recently used going first: each map is one of
#: the kernel's per-process mappings (65530 by default) and ~3 KB here, and holds no file
#: descriptor (``_mapping.map_file``); a buffer of short episodes keeps thousands hot
MAX_MAPS = 4096
#: seconds a map verified to hold a slot's generation serves reads planned for that generation
#: without a stat of its file (see above)
TRUST_S = 1.0
_MISSING = 2**64 - 1


class HotMap:
    """One mapped version of a hot shard file: ``payloads[rows[ti]]`` holds inner chunk ``ti``'s
    raw bytes (``rows[ti]`` -1: not stored), checked against its crc32c once ``checked`` (all
    of them once ``whole``); it lies at memory ``address + rows[ti] * payloads.strides[0]``
    (for ``_strided.take_at``). ``generation``: the slot generation a read verified this
    version holds (0: not verified yet). ``bound``: the generation (low 32 bits) its binding
    names (format 7), None before."""

    __slots__ = (
        "fingerprint",
        "rows",
        "payloads",
        "address",
        "checked",
        "whole",
        "generation",
        "bound",
        "_bodies",
        "_sums",
    )

    def __init__(
        self,
        fingerprint: tuple[int, ...],
        items: np.ndarray,
        rows: np.ndarray,
        nbytes: int,
        checksum: bool,
        bound: int | None = None,
    ):
        self.fingerprint = fingerprint
        self.rows = rows
        self.payloads = items[:, BLOSC_HEADER : BLOSC_HEADER + nbytes]
        self.address: int = self.payloads.__array_interface__["data"][0]
        self.checked = np.full(len(items), not checksum)
        self.whole = not checksum
        self.generation = 0
        self.bound = bound
        self._bodies = items[:, :-4]  # what each crc32c covers: header and payload
        self._sums = items[:, -4:].copy().view("<u4").reshape(-1) if checksum else np.empty(0, np.uint32)

    def holds(self, generation: int) -> bool:
        """Whether this version may be of the slot's episode of ``generation`` (0: not known):
        its binding names it (format 7), or names none."""
        return self.bound is None or not generation or self.bound == generation & 0xFFFFFFFF

    def verified(self, rows: np.ndarray) -> bool:
        """Whether the stored items ``rows`` match their crc32c (each checked once per map)."""
        checked = self.checked
        return bool(checked[rows].all()) or all(self.verified_one(row) for row in rows[~checked[rows]].tolist())

    def verified_one(self, row: int) -> bool:
        """``verified`` for one stored item."""
        if self.checked[row]:
            return True
        if crc32c(self._bodies[row]) != int(self._sums[row]):
            return False
        self.checked[row] = True
        return True


def _fingerprint(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _map_shard(path: str, slot: int, array: ShardedArray) -> tuple[tuple[int, ...], HotMap | None] | None:
    """(fingerprint, map) of the file at ``path`` (``slot``'s shard) as it is now; map None
    where the file is not a hot shard of that slot as ``ShardedArray._hot_shard`` writes it (the
    usual read path takes it, and names a shard bound to another slot or field); None when the
    file is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there: unmapped (size 0), never waited on
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        fingerprint = _fingerprint(st)
        nbytes = array.chunks[1] * int(np.prod(array.shape[2:], dtype=np.int64)) * array.dtype.itemsize
        width = BLOSC_HEADER + nbytes + (4 if array.codec.checksum else 0)
        body = st.st_size - array.index_nbytes
        # a hot shard is whole items then its index (``_hot_shard``): a compressed one, told by
        # its size, is left unmapped (mapping and unmapping it cost a cold read ~5%)
        if body < width or body % width:
            return fingerprint, None
        whole = map_file(fd, st.st_size)
    finally:
        os.close(fd)
    binding, raw_index = whole[body : body + array.binding_nbytes].tobytes(), whole[body + array.binding_nbytes :]
    if array.binding_problem(binding, slot) is not None:
        return fingerprint, None
    bound = None if array.binding is None else array.binding.held_generation(binding)
    if array.index_crc and crc32c(raw_index[:-4]) != int.from_bytes(raw_index[-4:].tobytes(), "little"):
        return fingerprint, None
    index = raw_index[: 16 * array.inner_per_shard].view("<u8").reshape(-1, 2)
    present = index[:, 0] != _MISSING
    offsets, sizes = index[present, 0], index[present, 1]
    if not len(offsets) or (sizes != width).any() or (offsets % width).any() or int(offsets.max()) + width > body:
        return fingerprint, None
    items = whole[: body - body % width].reshape(-1, width)
    rows = np.full(array.inner_per_shard, -1, np.int64)
    rows[present] = (offsets // width).astype(np.int64)
    headers = items[rows[present], :8]
    if not ((headers[:, 2] & BLOSC_MEMCPYED).all() and (headers[:, 4:8].copy().view("<u4") == nbytes).all()):
        return fingerprint, None
    return fingerprint, HotMap(fingerprint, items, rows, nbytes, array.codec.checksum, bound)


class _Entry:
    """A path's map (None: the file is not a hot shard) as of the file version ``fingerprint``,
    last found at the path at ``confirmed`` (``time.monotonic``; -inf: look again)."""

    __slots__ = ("fingerprint", "map", "confirmed")

    def __init__(self, fingerprint: tuple[int, ...], map: HotMap | None):
        self.fingerprint, self.map, self.confirmed = fingerprint, map, -math.inf


class ShardMaps:
    """The hot shard files this process keeps mapped, by path, at most ``limit``, each used
    while a stat of its path gives the same fingerprint (or, for a read naming the generation
    its map was verified to hold, while ``TRUST_S`` has not passed since the last stat)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._evicted = False  # whether a map ever went for want of room
        self._lock = threading.Lock()
        # moves whenever a map goes, is replaced or is doubted: a ``MapIndex`` of another
        # version is stale
        self.version = 0

    def get(self, array: ShardedArray, slot: int) -> HotMap | None:
        """The map of ``slot``'s hot shard of ``array`` as the file is now; None when it is
        absent or not a hot shard of that slot."""
        return self.get_many(array, [slot])[0]

    def get_many(
        self, array: ShardedArray, slots: list[int], generations: list[int] | None = None
    ) -> list[HotMap | None]:
        """``get`` of each slot, one lock for all the lookups (a timestep batch asks for every
        sampled episode's shard). Each shard's path is stat'ed (a map never serves a replaced
        file), except where ``generations`` (the slot's planned generation, per slot) names the
        one the map was verified to hold and the last stat is less than ``TRUST_S`` old."""
        paths = [array.shard_path(slot) for slot in slots]
        now = time.monotonic()
        found: list[HotMap | None] = [None] * len(paths)
        todo = []
        with self._lock:
            for i, path in enumerate(paths):
                entry = self._entries.get(path)
                if (
                    generations is not None
                    and entry is not None
                    and entry.map is not None
                    and entry.map.generation == generations[i] > 0
                    and now - entry.confirmed < TRUST_S
                ):
                    self._entries.move_to_end(path)
                    found[i] = entry.map
                else:
                    todo.append(i)
        if not todo:
            return found
        fingerprints: dict[int, tuple[int, ...] | None] = {}
        for i in todo:
            try:
                fingerprints[i] = _fingerprint(os.stat(paths[i]))
            except FileNotFoundError:
                fingerprints[i] = None
        unmapped = []  # mapped below, outside the lock
        with self._lock:
            for i in todo:
                path, fingerprint = paths[i], fingerprints[i]
                entry = self._entries.get(path)
                if entry is not None and entry.fingerprint == fingerprint:
                    self._entries.move_to_end(path)
                    entry.confirmed = now
                    found[i] = entry.map
                elif fingerprint is None:
                    self._entries.pop(path, None)
                else:
                    unmapped.append(i)
        for i in unmapped:
            found[i] = self._map(paths[i], slots[i], array, now)
        return found

    def _map(self, path: str, slot: int, array: ShardedArray, now: float) -> HotMap | None:
        """Map the file at ``path`` (``slot``'s shard) as it is now and keep the map (``get``
        found none for it), found there at ``now``."""
        mapped = _map_shard(path, slot, array)
        if mapped is not None and mapped[1] is not None and not self._evicted:
            # while every map fits, a shard is checked whole when mapped (one tight pass, then
            # its frames copy at a gather's speed); once maps are evicted, frame by frame as
            # read, or a shard mapped again would be checked whole to serve a few frames
            shard = mapped[1]
            if shard.verified(shard.rows[shard.rows >= 0]):
                shard.whole = True
            else:
                mapped = (mapped[0], None)  # the usual path reads it and names the damage
        with self._lock:
            if mapped is None:
                self._entries.pop(path, None)
                return None
            entry = self._entries[path] = _Entry(*mapped)
            entry.confirmed = now
            self.version += 1
            self._entries.move_to_end(path)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
                self._evicted = True
        return entry.map

    def drop(self, path: str) -> None:
        with self._lock:
            self._entries.pop(path, None)
            self.version += 1

    def trusted(self, path: str) -> tuple[int, float] | None:
        """(the generation the map of ``path`` was verified to hold, the time of its last stat),
        None without a map."""
        with self._lock:
            entry = self._entries.get(path)
            return None if entry is None or entry.map is None else (entry.map.generation, entry.confirmed)

    def drop_under(self, folder: str) -> None:
        """Unmap the files under ``folder`` (a buffer closed: its replaced files are freed)."""
        with self._lock:
            for path in [p for p in self._entries if p.startswith(folder)]:
                del self._entries[path]
            self.version += 1

    def doubt_under(self, folder: str) -> None:
        """Stat the files under ``folder`` again before their next use (``drop_caches``: a
        reader refreshing sees edits made since)."""
        with self._lock:
            for path, entry in self._entries.items():
                if path.startswith(folder):
                    entry.confirmed = -math.inf
            self.version += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.version += 1

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


_maps = ShardMaps(MAX_MAPS)
os.register_at_fork(after_in_child=_maps._after_fork)


class MapIndex:
    """The maps of one array's hot shards that timestep batches verified, by slot, in arrays
    (``gather_mapped``'s fast path): a batch whose every pair names a slot here at the
    generation its map holds, stat'ed less than ``TRUST_S`` ago, and a stored, checked frame, is served with
    a few numpy operations and one fancy index, without a lookup per sampled episode (a set of
    the batch's episodes, a dict lookup each and a table of their rows cost as much as the copy).
    Valid while ``ShardMaps.version`` stays as it was when built; any other batch takes the
    usual path, which teaches the index what it confirmed."""

    def __init__(self, episodes: int):
        self.version = -1
        self.where = np.full(episodes, -1, np.int64)  # slot -> row of the arrays below
        self.maps: list[HotMap] = []  # references keep the maps alive while they are indexed
        self.rows = np.empty((0, 0), np.int64)
        self.address = np.empty(0, np.int64)
        self.generation = np.empty(0, np.int64)
        self.confirmed = np.empty(0, np.float64)
        self.lock = threading.Lock()

    def take(self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray) -> np.ndarray | None:
        """The frames (raw bytes, one row each) when the whole batch can be served, else None."""
        with self.lock:
            if self.version != _maps.version or not self.maps:
                return None
            k = self.where[episodes]
            if k.min() < 0 or (self.generation[k] != generations).any():
                return None
            if self.confirmed[k].min() <= time.monotonic() - TRUST_S:
                return None
            try:  # one flat take (a two-axis fancy index took ~2x as long)
                rows = self.rows.take(np.ravel_multi_index((k, timesteps), self.rows.shape))
            except ValueError:  # a step outside the rows: the usual read path answers
                return None
            if rows.min() < 0:
                return None
            maps = self.maps  # a reset makes a new list: this one keeps the maps alive for the copy
            addresses = self.address[k] + rows * maps[0].payloads.strides[0]
        frames = gather_addresses(addresses, maps[0].payloads[0])  # outside the lock: copies may overlap
        if frames is not None:
            return frames
        lowest = int(np.argmin(addresses))
        anchor = maps[int(k[lowest])].payloads[int(rows[lowest]) :]
        return take_at(anchor, addresses - addresses[lowest])  # outside the lock: copies may overlap

    def learn(
        self, version: int, episodes: list[int], shards: list[HotMap | None], paths: list[str], planned: list[int]
    ) -> None:
        """Index the whole-checked maps a batch used (``episodes``: its distinct slots) that
        ``ShardMaps`` verified for the ``planned`` generations, as of ``version`` (the maps'
        version when the batch looked them up: a map gone since is never indexed)."""
        with self.lock:
            if self.version != version:
                self.where[:] = -1
                self.maps, self.version = [], version
                self.rows, self.address = np.empty((0, 0), np.int64), np.empty(0, np.int64)
                self.generation, self.confirmed = np.empty(0, np.int64), np.empty(0, np.float64)
            added: list[tuple[int, HotMap, int, float]] = []
            for episode, shard, path, generation in zip(episodes, shards, paths, planned):
                if shard is None or not shard.whole:
                    continue
                trust = _maps.trusted(path)
                if trust is None or trust[0] != generation or generation <= 0:
                    continue
                k = int(self.where[episode])
                if k >= 0 and self.maps[k] is shard:
                    self.generation[k], self.confirmed[k] = trust
                elif k < 0:
                    added.append((episode, shard, *trust))
            if not added or _maps.version != version or len(self.maps) + len(added) > MAX_MAPS:
                return
            first = len(self.maps)
            for i, (episode, shard, _, _) in enumerate(added):
                self.where[episode] = first + i
                self.maps.append(shard)
            self.rows = (
                np.concatenate([self.rows.reshape(first, -1), np.stack([a[1].rows for a in added])])
                if first
                else np.stack([a[1].rows for a in added])
            )
            self.address = np.concatenate([self.address, [a[1].address for a in added]]).astype(np.int64)
            self.generation = np.concatenate([self.generation, [a[2] for a in added]]).astype(np.int64)
            self.confirmed = np.concatenate([self.confirmed, [a[3] for a in added]])


_indexes: weakref.WeakKeyDictionary[ShardedArray, MapIndex] = weakref.WeakKeyDictionary()
os.register_at_fork(after_in_child=_indexes.clear)


def _index_of(array: ShardedArray) -> MapIndex:
    index = _indexes.get(array)
    if index is None:
        index = _indexes.setdefault(array, MapIndex(array.shape[0]))
    return index


def shard_maps() -> ShardMaps:
    """The process's mapped hot shards."""
    return _maps


def _mappable(array: ShardedArray, dtype: np.dtype) -> bool:
    """Whether the array's shards may be hot files this reader can map: blosc (a writer stores
    those hot) on local disk, one step per inner chunk, read as little-endian ``dtype``."""
    return (
        array.codec.writes_hot and isinstance(array.kv, LocalKV) and array.chunks[1] == 1 and dtype == array.codec.dtype
    )


class Mapped(NamedTuple):
    """What ``gather_mapped`` read: ``frames`` (the pairs in ``left`` not filled), the indices
    of the pairs ``left`` to the usual read path, and the (slot, planned generation, map) of
    each map that served pairs without being verified to hold that generation (the caller
    checks the slots' generations, then marks the maps verified: ``ShardedArray.gather``)."""

    frames: np.ndarray
    left: np.ndarray
    unverified: list[tuple[int, int, HotMap]]


def gather_mapped(
    array: ShardedArray, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
) -> Mapped | None:
    """One frame per (episode, timestep) pair (int64 arrays) from the maps of hot shards, as
    ``ChunkedArray.gather`` returns them (``Mapped``), or None when the array cannot be mapped
    or none of the shards is hot.

    Each distinct episode's map is looked up once, the pairs' rows and checked flags found with
    numpy, and the frames copied with one fancy index over all the maps (``_strided.take_at``;
    only rows checked against their crc32c are indexed): one Python step per frame (a copy
    and a lookup or two) cost ~1 us a frame more than the copy itself. The references in
    ``shards`` keep the maps alive while they are indexed. ``generations``: per pair, the
    generation the read planned for the slot (``ShardMaps.get_many``); a batch naming them is
    first offered to the array's ``MapIndex``, which serves only maps verified for them."""
    if not len(episodes) or not _mappable(array, array.dtype):
        return None
    index = None if generations is None else _index_of(array)
    if index is not None and generations is not None:
        frames = index.take(episodes, timesteps, generations)
        if frames is not None:
            return Mapped(frames.view(array.dtype).reshape(len(episodes), *array.shape[2:]), np.empty(0, np.int64), [])
    version = _maps.version
    distinct, first, inverse = np.unique(episodes, return_index=True, return_inverse=True)
    slots = distinct.tolist()
    paths = [array.shard_path(slot) for slot in slots]
    planned = None if generations is None else generations[first].tolist()
    shards = _maps.get_many(array, slots, planned)
    if any(shard is not None for shard in shards):  # a map of another episode's shard (format 7) is
        expected = array.expected_generations(slots, planned)  # left to the usual path, which names it
        shards = [shard if shard is None or shard.holds(expected[slot]) else None for slot, shard in zip(slots, shards)]
    if index is not None and planned is not None:
        index.learn(version, slots, shards, paths, planned)
    live = [k for k, shard in enumerate(shards) if shard is not None]
    if not live:  # none hot (compacted): the usual path reads the whole batch
        return None
    maps = [shard for shard in shards if shard is not None]
    unverified: list[tuple[int, int, HotMap]] = []
    if planned is not None:
        for k, shard in enumerate(shards):
            if shard is not None and shard.generation != planned[k]:
                unverified.append((int(distinct[k]), planned[k], shard))
    which = np.full(len(shards), -1, np.int64)
    which[live] = np.arange(len(maps))
    which = which[inverse]  # each pair's map in ``maps``; -1: none
    # each pair's stored row: -1 not stored, -2 left to the usual path (the table's last row)
    table = np.concatenate([*(shard.rows for shard in maps), np.full(array.inner_per_shard, -2)])
    rows = table.reshape(len(maps) + 1, array.inner_per_shard)[which, timesteps]
    stored = np.flatnonzero(rows >= 0)
    if not all(shard.whole for shard in maps):  # maps checked frame by frame: check the unchecked
        counts = np.array([len(shard.checked) for shard in maps])
        checked = np.concatenate([shard.checked for shard in maps])  # the maps' flags one after another
        damaged: list[int] = []
        for k in stored[~checked[(np.cumsum(counts) - counts)[which[stored]] + rows[stored]]].tolist():
            m = int(which[k])
            if m not in damaged and not maps[m].verified_one(int(rows[k])):
                _maps.drop(paths[live[m]])  # the usual path reads the file again and names the damage
                damaged.append(m)
        if damaged:
            rows[np.isin(which, damaged)] = -2
            stored = np.flatnonzero(rows >= 0)
    absent = np.flatnonzero(rows == -1)
    for k in absent.tolist():  # not stored: zeros, unless inside the committed steps
        array._absent((int(episodes[k]), int(timesteps[k])))
    left = np.flatnonzero(rows == -2)
    frames = None
    if len(stored):
        width = maps[0].payloads.strides[0]
        addresses = np.array([shard.address for shard in maps], np.int64)[which[stored]] + rows[stored] * width
        lowest = int(np.argmin(addresses))
        anchor = maps[int(which[stored[lowest]])].payloads[int(rows[stored[lowest]]) :]
        frames = take_at(anchor, addresses - addresses[lowest])
        if frames is not None and len(stored) == len(episodes):
            return Mapped(frames.view(array.dtype).reshape(len(episodes), *array.shape[2:]), left, unverified)
    out = np.empty((len(episodes), *array.shape[2:]), array.dtype)
    flat = out.reshape(len(out), -1).view(np.uint8)
    if frames is not None:
        flat[stored] = frames
    else:  # a span of maps too wide for one view's size: one copy per frame
        for k in stored.tolist():
            flat[k] = maps[int(which[k])].payloads[int(rows[k])]
    flat[absent] = 0
    return Mapped(out, left, unverified)


def read_mapped_spans(
    array: ShardedArray,
    out: np.ndarray,
    episodes: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    parallel: bool,
    expected: Expected,
) -> np.ndarray:
    """Steps ``starts[i] .. starts[i] + lengths[i]`` of hot shards into ``out[i]`` from their
    maps (as ``ChunkedArray.read_into``); returns ``lengths`` with 0 for every span done, the
    others left to the usual read path: among them those whose map's binding names another
    generation than ``expected`` (per episode, ``ShardedArray.expected_generations``)."""
    if not out.size or not out.flags.c_contiguous or not _mappable(array, out.dtype):
        return lengths
    left = lengths.copy()
    flat = out.reshape(out.shape[0], out.shape[1], -1).view(np.uint8)
    copies: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # (span, length, source, stored rows)
    for i, (episode, start, length) in enumerate(zip(episodes.tolist(), starts.tolist(), lengths.tolist())):
        if length <= 0:
            continue
        shard = _maps.get(array, episode)
        if shard is None or not shard.holds(expected[episode]):
            continue
        stored = shard.rows[start : start + length]
        absent = stored < 0
        if absent.any():
            array._absent((episode, start + int(np.argmax(absent))))
        if not shard.verified(stored[~absent]):
            _maps.drop(array.shard_path(episode))
            continue
        copies.append((i, length, shard.payloads, stored))
        left[i] = 0

    def copy(k: int) -> None:
        i, length, payloads, stored = copies[k]
        first = int(stored[0])
        if first >= 0 and int(stored[-1]) - first == length - 1 and (np.diff(stored) == 1).all():
            flat[i, :length] = payloads[first : first + length]  # the usual episode: one run
        else:
            flat[i, :length] = np.where((stored >= 0)[:, None], payloads[np.maximum(stored, 0)], 0)

    copy_spans(len(copies), copy, int(lengths.sum() - left.sum()) * flat.shape[2], parallel)
    return left


def forget_files_under(*folders: str) -> None:
    """Let go of the files under ``folders`` that this process keeps open or mapped for reads
    (keyed by path), as erasing a buffer in place does: once two folders are swapped (``convert
    --overwrite``) their paths name other files, and a deleted file's space is freed only when
    nothing holds it."""
    for folder in {os.path.join(folder, "") for folder in folders}:  # its files only, not a sibling's
        LocalKV(folder).drop_read_handles()
        shard_maps().drop_under(folder)
