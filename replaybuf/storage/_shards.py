"""Sharded zarr arrays: one object per episode holding one compressed inner chunk per frame.

Image fields want one frame per chunk (random timestep sampling decodes only what it uses),
but one object per frame means millions of files or objects. The zarr v3 sharding codec puts
an episode's frames in one shard ``(1, max_timesteps, *shape)`` with an index at its end; this
module writes such shards whole (all frames encoded in parallel, all-zero frames left out) and
reads single frames with two small range reads (the index, then the coalesced frame bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._chunks import ABSENT, ChunkedArray, chunk_cache
from ._codecs import crc32c
from ._kv import CORES, thread_pool
from .base import CorruptChunkError

_MISSING = np.uint64(2**64 - 1)
_MISSING_INT = 2**64 - 1


class ShardedArray(ChunkedArray):
    """A (episode, time, *shape) array sharded as one shard per episode.

    ``chunks`` are the inner chunks ``(1, T_inner, *shape)``; the shard spans the whole time axis.
    """

    def __init__(self, *args, index_crc: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.inner_per_shard = -(-self.shape[1] // self.chunks[1])
        self.index_crc = index_crc
        self.index_nbytes = 16 * self.inner_per_shard + (4 if index_crc else 0)
        self._shard_keys: dict[int, str] = {}

    def shard_key(self, episode: int) -> str:
        # built once per slot: sampling asks for it once per sampled frame's episode
        key = self._shard_keys.get(episode)
        if key is None:
            key = self._shard_keys[episode] = self.chunk_key((episode, 0))
        return key

    def _row_keys(self, episode: int) -> list[str]:
        # docstring inherited: one shard per episode
        return [self.shard_key(episode)]

    @property
    def shard_time(self) -> int:
        """Timesteps one shard spans: the time axis rounded up to whole inner chunks."""
        return self.inner_per_shard * self.chunks[1]

    # ---- reads --------------------------------------------------------------------------

    def _damage(self, index: tuple, reason: str, slot: int | None = None) -> CorruptChunkError:
        # docstring inherited: the file is the episode's shard
        e, ti = int(index[0]), int(index[1])
        ct = self.chunks[1]
        where = f"{self.kv.where(self.shard_key(e))}, inner chunk {ti}"
        return CorruptChunkError.at(self.path, e, (ti * ct, min((ti + 1) * ct, self.shape[1])), where, reason)

    def _parse_index(self, raw: bytes | None, episode: int) -> np.ndarray | None:
        """The (offset, nbytes) rows of a shard index read from the shard's end, checked against
        its crc32c and the shard's size (``shard_nbytes`` when the whole shard is at hand)."""
        if raw is None:
            return None
        if len(raw) != self.index_nbytes:
            reason = f"shard index is {len(raw)} bytes, expected {self.index_nbytes} (truncated shard)"
        elif self.index_crc and crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            reason = "shard index fails its crc32c"
        else:
            body = raw[:-4] if self.index_crc else raw
            return np.frombuffer(body, dtype="<u8").reshape(self.inner_per_shard, 2)
        raise CorruptChunkError.at(
            self.path, episode, (0, self.shape[1]), self.kv.where(self.shard_key(episode)), reason
        )

    def read_indexes(self, episodes: Sequence[int]) -> dict[int, np.ndarray | None]:
        """The shard index (offset, nbytes per inner chunk) of each episode's shard."""
        unique = list(dict.fromkeys(int(e) for e in episodes))
        raws = self.kv.get_ranges([(self.shard_key(e), -self.index_nbytes, None) for e in unique])
        return {e: self._parse_index(r, e) for e, r in zip(unique, raws)}

    def fetch_chunks(self, indices: Sequence[tuple]) -> dict[tuple, np.ndarray | None]:
        # docstring inherited
        unique = list(dict.fromkeys(tuple(int(i) for i in index[:2]) for index in indices))
        indexes = self.read_indexes([e for e, _ in unique])
        spans: dict[int, list[tuple[int, int, tuple]]] = {}
        for e, ti in unique:
            index = indexes[e]
            if index is None or index[ti, 0] == _MISSING:
                continue  # the caller reads it as absent
            spans.setdefault(e, []).append((int(index[ti, 0]), int(index[ti, 1]), (e, ti)))
        requests, pieces = [], []
        for e, items in spans.items():
            items.sort()
            run = [items[0]]
            for item in items[1:]:
                if item[0] == run[-1][0] + run[-1][1]:
                    run.append(item)
                else:
                    requests.append((self.shard_key(e), run[0][0], run[-1][0] + run[-1][1]))
                    pieces.append(run)
                    run = [item]
            requests.append((self.shard_key(e), run[0][0], run[-1][0] + run[-1][1]))
            pieces.append(run)
        raws: dict[tuple, bytes | None] = {}
        for data, run in zip(self.kv.get_ranges(requests), pieces):
            base = run[0][0]
            for offset, nbytes, key in run:
                raws[key] = None if data is None else data[offset - base : offset - base + nbytes]
        decoded = self._decode_many({k: raws.get(k) for k in unique})
        return {index: decoded[tuple(int(i) for i in index[:2])] for index in indices}

    def _indexes_cached(self, episodes: list[int], generations: list | None) -> dict[int, np.ndarray | None]:
        """Shard indexes, kept in the chunk cache under the slot generation when one is given."""
        if generations is None:
            return self.read_indexes(episodes)
        cache = chunk_cache()
        keys = [self.index_cache_key(e) for e in episodes]
        found = dict(zip(episodes, cache.get_many(self._namespace, keys, generations)))
        missing = {e for e in episodes if found[e] is None}
        if missing:
            found.update(self.read_indexes(sorted(missing)))
            cache.put_many(
                self._namespace,
                [
                    (keys[i], generations[i], ABSENT if (index := found[e]) is None else index.copy())
                    for i, e in enumerate(episodes)
                    if e in missing
                ],
            )
        return {e: None if index is ABSENT else index for e, index in found.items()}

    @staticmethod
    def index_cache_key(episode: int) -> tuple:
        return ("index", episode)

    def _read_whole_into(
        self, grid: list[tuple[int, int]], rows: list[int], out: np.ndarray, generations: list | None
    ) -> None:
        # docstring inherited
        first_generation: dict[int, Any] = {}
        for (e, _), generation in zip(grid, generations if generations is not None else [None] * len(grid)):
            first_generation.setdefault(e, generation)
        episodes = list(first_generation)
        indexes = self._indexes_cached(
            episodes, None if generations is None else [first_generation[e] for e in episodes]
        )
        spans: dict[int, list[tuple[int, int, int, int]]] = {}
        for (e, ti), row in zip(grid, rows):
            index = indexes[e]
            if index is None or index[ti, 0] == _MISSING:
                self._absent((e, ti))
                out[row] = 0
            else:
                spans.setdefault(e, []).append((int(index[ti, 0]), int(index[ti, 1]), row, ti))
        requests, runs, request_generations = [], [], []
        for e, items in spans.items():
            key = self.shard_key(e)
            items.sort()
            run = [items[0]]
            for item in items[1:]:
                if item[0] == run[-1][0] + run[-1][1]:
                    run.append(item)
                else:
                    requests.append((key, run[0][0], run[-1][0] + run[-1][1]))
                    runs.append((e, run))
                    request_generations.append(first_generation[e])
                    run = [item]
            requests.append((key, run[0][0], run[-1][0] + run[-1][1]))
            runs.append((e, run))
            request_generations.append(first_generation[e])

        def decode(i: int, data: bytes | None) -> None:
            e, run = runs[i]
            view = memoryview(data) if data is not None else None
            base = run[0][0]
            for offset, nbytes, row, ti in run:
                if view is None:
                    self._absent((e, ti))
                    out[row] = 0
                else:
                    self._decode_into(view[offset - base : offset - base + nbytes], out[row : row + 1], (e, ti))

        self.kv.get_ranges_each(requests, decode, None if generations is None else request_generations)

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
        """Time spans of episodes into ``out`` (as ``ChunkedArray.read_into``; shards carry
        their own crc32c per frame, so ``check`` changes nothing) with one read per
        episode: the whole shard when the span needs at least half of it (its index comes with
        it), else the one byte range holding the span's frames (after the index, cached under
        ``generations``). Each episode is one pool task that decodes its frames into place. Arrays
        held in RAM are read from their resident copy when ``generations`` is given."""
        episodes, starts, lengths = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (episodes, starts, lengths))
        self._check_out(out, episodes, starts, lengths)
        if self._read_resident_into(out, episodes, starts, lengths, generations, parallel):
            return
        ct = self.chunks[1]
        spans = [
            (i, e, s // ct, (s + n - 1) // ct + 1)
            for i, (e, s, n) in enumerate(zip(episodes.tolist(), starts.tolist(), lengths.tolist()))
            if n > 0
        ]
        whole = [span for span in spans if 2 * (span[3] - span[2]) >= self.inner_per_shard]
        ranged = [span for span in spans if 2 * (span[3] - span[2]) < self.inner_per_shard]
        if whole:

            def decode_shard(k: int, data: bytes | None) -> None:
                view = None if data is None else memoryview(data)
                episode = whole[k][1]
                index = None if view is None else self._parse_index(bytes(view[-self.index_nbytes :]), episode)
                self._decode_span(view, 0, index, whole[k], out, starts, lengths)

            self._each([self.shard_key(e) for _, e, _, _ in whole], decode_shard, parallel, ranges=False)
        if ranged:
            self._read_ranged(ranged, out, starts, lengths, generations, parallel)

    def _read_ranged(
        self,
        spans: list[tuple[int, int, int, int]],
        out: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        generations: np.ndarray | None,
        parallel: bool,
    ) -> None:
        """Spans needing under half of their shard: the index, then one range per episode."""
        episodes = list(dict.fromkeys(e for _, e, _, _ in spans))
        per_episode = None
        if generations is not None:
            generation_of: dict[int, int] = {}
            all_generations = np.broadcast_to(np.asarray(generations, dtype=np.int64), (len(starts),))
            for i, e, _, _ in spans:
                generation_of.setdefault(e, int(all_generations[i]))
            per_episode = [generation_of[e] for e in episodes]
        indexes = self._indexes_cached(episodes, per_episode)
        requests, todo = [], []
        for span in spans:
            _, e, first, stop = span
            index = indexes[e]
            present = None if index is None else index[first:stop][index[first:stop, 0] != _MISSING]
            if present is None or not len(present):
                self._decode_span(None, 0, None, span, out, starts, lengths)
                continue
            lo, hi = int(present[:, 0].min()), int((present[:, 0] + present[:, 1]).max())
            requests.append((self.shard_key(e), lo, hi))
            todo.append((span, lo, index))

        def decode_range(k: int, data: bytes | None) -> None:
            span, lo, index = todo[k]
            self._decode_span(None if data is None else memoryview(data), lo, index, span, out, starts, lengths)

        self._each(requests, decode_range, parallel, ranges=True)

    def _each(self, requests: list, consume, parallel: bool, ranges: bool) -> None:
        """Fetch whole objects (or byte ranges) and ``consume(k, bytes)`` each: spread over the
        thread pool, or in this thread when not ``parallel``."""
        if parallel:
            (self.kv.get_ranges_each if ranges else self.kv.get_each)(requests, consume)
        else:
            for k, data in enumerate((self.kv.get_ranges if ranges else self.kv.get_many)(requests)):
                consume(k, data)

    def _decode_span(
        self,
        view: memoryview | None,
        base: int,
        index: np.ndarray | None,
        span: tuple[int, int, int, int],
        out: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Inner chunks ``first .. stop`` of one episode's shard into ``out[i]``; ``view`` holds
        the shard's bytes from offset ``base`` (None: the shard does not exist)."""
        i, e, first, stop = span
        start, length = int(starts[i]), int(lengths[i])
        if view is None or index is None:
            self._absent((e, first))  # the first chunk is the one most inside the episode
            out[i, :length] = 0
            return
        ct, row, decode_into = self.chunks[1], out[i], self._decode_into
        contiguous = row.flags.c_contiguous
        for ti, (offset, nbytes) in zip(range(first, stop), index[first:stop].tolist()):
            lo = ti * ct - start
            if offset == _MISSING_INT or lo < 0 or lo + ct > length or not contiguous:
                self._decode_piece(
                    None if offset == _MISSING_INT else view[offset - base : offset - base + nbytes],
                    e,
                    ti,
                    out,
                    i,
                    start,
                    length,
                )
            else:
                decode_into(view[offset - base : offset - base + nbytes], row[lo : lo + ct], (e, ti))

    # ---- writes -------------------------------------------------------------------------

    def encode_shard(self, rows: np.ndarray, keep: np.ndarray | None = None) -> bytes | None:
        """One episode's (time, *shape) rows as shard bytes; None when all zero.

        All-zero inner chunks are left out (they read back as zero) unless ``keep`` (one bool
        per inner chunk) marks them: format 2 stores every chunk of a written span, so a missing
        one is damage. The others are encoded in one run per core on the thread pool.
        """
        step = self.chunks[1]
        rows = rows[: self.inner_per_shard * step]
        if rows.shape[0] % step:
            pad = np.zeros((step - rows.shape[0] % step, *rows.shape[1:]), rows.dtype)
            rows = np.concatenate([rows, pad])
        pieces = rows.reshape(-1, step, *rows.shape[1:])
        stored = np.asarray(pieces.reshape(len(pieces), -1).any(axis=1))
        if keep is not None:
            stored |= keep[: len(stored)]
        nonzero = np.flatnonzero(stored)
        if not len(nonzero):
            return None

        def encode_run(run):
            return [self.codec.encode(pieces[i][None]) for i in run]

        # one run per core, the first in this thread: more runs cost CPU (~+20% at 4 runs on 2
        # cores) and gain no wall time
        runs = np.array_split(nonzero, min(len(nonzero), CORES)) if rows.nbytes > (1 << 20) else [nonzero]
        others = [thread_pool().submit(encode_run, run) for run in runs[1:]]
        blobs = encode_run(runs[0])
        for future in others:
            blobs.extend(future.result())
        index = np.full((self.inner_per_shard, 2), _MISSING, dtype="<u8")
        sizes = np.array([len(b) for b in blobs], dtype="<u8")
        index[nonzero, 0] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<u8")
        index[nonzero, 1] = sizes
        index_bytes = index.tobytes()
        if self.index_crc:
            index_bytes += crc32c(index_bytes).to_bytes(4, "little")
        return b"".join(blobs) + index_bytes

    def write_box(self, start: Sequence[int], values: np.ndarray, atomic: bool = True) -> None:
        # docstring inherited
        if self.check_writable is not None:
            self.check_writable()
        e0, t0 = int(start[0]), int(start[1]) if len(start) > 1 else 0
        count, length = values.shape[0], values.shape[1]
        whole = t0 == 0 and length >= self.shape[1]
        keep = None
        if self.committed is not None:
            step = self.chunks[1]
            keep = np.zeros((count, self.inner_per_shard), bool)
            keep[:, t0 // step : -(-(t0 + length) // step)] = True
        if whole:
            rows = values
        else:
            rows = np.empty((count, self.shape[1], *self.shape[2:]), self.dtype)
            for i in range(count):
                present = self._old_shard(e0 + i, rows[i], (t0, t0 + length))
                if keep is not None and present is not None:
                    keep[i] |= present
            rows[:, t0 : t0 + length] = values
        shards = {
            self.shard_key(e0 + i): self.encode_shard(rows[i], None if keep is None else keep[i]) for i in range(count)
        }
        written = {k: v for k, v in shards.items() if v is not None}
        if written:
            self.kv.set_many(written, atomic=atomic)
        empty = [k for k, v in shards.items() if v is None]
        if empty:
            self.kv.delete_many(empty)
        self._forget_episodes(range(e0, e0 + count))

    def _old_shard(self, episode: int, out: np.ndarray, skip: tuple[int, int]) -> np.ndarray | None:
        """Decode the episode's stored inner chunks into ``out`` (time, *shape), except those
        inside the steps ``skip`` that the write replaces, for a partial write to merge into;
        return which inner chunks the shard stores. A damaged shard of a slot that holds no
        committed episode (being rewritten) reads as empty."""
        out[...] = 0
        try:
            index = self.read_indexes([episode])[episode]
            if index is None:
                return None
            ct = self.chunks[1]
            present = index[:, 0] != _MISSING
            keep = present.copy()
            keep[-(-skip[0] // ct) : skip[1] // ct] = False  # wholly overwritten: not decoded
            wanted = np.flatnonzero(keep)
            if len(wanted):
                lo = int(index[wanted, 0].min())
                hi = int((index[wanted, 0] + index[wanted, 1]).max())
                data = self.kv.get_ranges([(self.shard_key(episode), lo, hi)])[0]
                view = memoryview(data if data is not None else b"")
                for ti in wanted.tolist():
                    offset, nbytes = int(index[ti, 0]) - lo, int(index[ti, 1])
                    a, b = ti * ct, min((ti + 1) * ct, self.shape[1])
                    out[a:b] = self._decode(view[offset : offset + nbytes], (episode, ti))[0, : b - a]
        except CorruptChunkError as e:
            if not self._stale_damage(e):
                raise
            out[...] = 0
            return None
        return present

    def _forget_episodes(self, episodes) -> None:
        """Drop what the cache and the resident copy hold of rewritten episodes."""
        keys = []
        for e in episodes:
            keys.append(self.index_cache_key(e))
            keys.extend((e, t) for t in range(self.inner_per_shard))
        chunk_cache().discard(self._namespace, keys)
        if self._resident_generations is not None:
            self._resident_generations[list(episodes)] = -1
