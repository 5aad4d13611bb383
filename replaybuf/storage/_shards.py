"""Sharded zarr arrays: one object per episode holding one compressed inner chunk per frame.

Image fields want one frame per chunk (random timestep sampling decodes only what it uses),
but one object per frame means millions of files or objects. The zarr v3 sharding codec puts
an episode's frames in one shard ``(1, max_timesteps, *shape)`` with an index at its end; this
module writes such shards whole (all frames encoded in parallel, or copied raw at blosc clevel 0
for a writer's hot tier, ``_hot.py``; all-zero frames left out) and reads single frames with two
small range reads (the index, then the coalesced frame bytes), once more with a fresh index when
a compaction replaced the shard in between.

From format 5 each shard is bound to its field and slot (``ShardBinding``), from format 6 to its
buffer too, from format 7 to its episode (its generation): 16 bytes just before its index, read
with it, so a shard copied or moved to another slot, field or buffer, or an older one of the
same slot, is damage naming where it came from, at no cost per frame (a checked index is cached
as before).
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from ._chunks import ABSENT, ChunkedArray, _per_pair, chunk_cache
from ._codecs import BLOSC_HEADER, crc32c, crc_bit_flipped
from ._hotmap import HotMap, gather_mapped, read_mapped_spans, shard_maps
from ._kv import CORES, LocalKV, in_pool, in_pool_as_planned, thread_pool
from .base import ChunkChecksumError, CorruptChunkError, GenerationMismatchError

if TYPE_CHECKING:
    from ._hot import HotTier

_MISSING = np.uint64(2**64 - 1)
# reads again with fresh indexes after a crc32c failure before calling it damage (a compaction
# may have replaced the shard meanwhile: ``_fresh_on_damage``)
COMPACTION_RETRIES = 3
# shard reads decoding this much each on average are spread over the pool even on 2 cores
# (``_kv.in_pool``): ~50 frames of 84x84x3, ~0.6 ms of decoding that frees the GIL
SPREAD_BYTES = 1 << 20
# whole shards one ``read_into`` keeps mapped at a time (``_read_mapped``): each map is one of
# the kernel's per-process mappings (65530 by default)
MAPPED_SHARDS = 256


class ShardBinding:
    """What binds a shard to the field and slot it was written for (format 5 and later), to its
    buffer (format 6 and later) and to its episode (format 7): 16 bytes just before the shard's
    index, which no zarr reader reads (no index entry points at them). Formats 5 and 6: a tag,
    the slot (uint32: ``schema.MAX_META_BYTES`` keeps max_episodes under 2**28), the crc32c of
    the field's name (format 6: of the buffer's uuid, a ``/`` and the name), and the crc32c of
    those 12 bytes. Format 7 (``generations``): the slot, that field crc32c, the low 32 bits of
    the generation the slot's episode publishes (``commit.py``: fixed before its data is written,
    ``Storage.plan_generations``), and the crc32c of the tag and those 12 bytes; an older shard
    of the same slot (a partial backup restore) names an older generation."""

    NBYTES = 16
    TAG = b"rbSB"

    def __init__(self, field: str, fields: Iterable[str] = (), buffer: str | None = None, generations: bool = False):
        self.field = field
        self.buffer = buffer  # the buffer's uuid (format 6), or None (format 5: no buffer bound)
        self.generations = generations  # format 7: the episode's generation bound too
        self._field_sum = self.field_sum(field)
        # the fields a shard's binding may name: a shard of another field is named by it
        self._names = {self.field_sum(name): name for name in fields}

    def field_sum(self, name: str) -> int:
        """The crc32c a binding holds for field ``name`` (of this buffer, from format 6)."""
        return crc32c(name.encode() if self.buffer is None else f"{self.buffer}/{name}".encode())

    def of(self, slot: int, generation: int = 0) -> bytes:
        """The binding a shard of ``slot`` holds (format 7: of the episode of ``generation``)."""
        if self.generations:
            head = struct.pack("<III", slot, self._field_sum, generation & 0xFFFFFFFF)
            return head + crc32c(self.TAG + head).to_bytes(4, "little")
        head = self.TAG + struct.pack("<II", slot, self._field_sum)
        return head + crc32c(head).to_bytes(4, "little")

    def held_generation(self, raw: bytes) -> int | None:
        """The generation (low 32 bits) a sound format-7 binding ``raw`` holds; None before format 7."""
        return struct.unpack("<I", raw[8:12])[0] if self.generations else None

    def _earlier_format(self, raw: bytes) -> bool:
        """Whether ``raw`` is a sound binding of format 5 or 6 (a tag first, which no format-7
        binding starts with: its slot would be over 2**30)."""
        return raw[:4] == self.TAG and crc32c(raw[:12]) == int.from_bytes(raw[12:16], "little")

    def problem(self, raw: bytes, slot: int, generation: int | None = None) -> str | None:
        """None when ``raw`` (``NBYTES``) binds a shard to this field's ``slot`` (format 7: to
        its episode of ``generation``, unless None or 0: not known, or no episode published),
        else what is wrong."""
        if self.generations:
            sound = crc32c(self.TAG + bytes(raw[:12])) == int.from_bytes(raw[12:16], "little")
            held, field_sum, held_generation = struct.unpack("<III", raw[:12])
        else:
            sound = self._earlier_format(raw)
            (held, field_sum), held_generation = struct.unpack("<II", raw[4:12]), None
        if not sound and self.generations and self._earlier_format(raw):
            held = struct.unpack("<I", raw[4:8])[0]
            return (
                f"the shard holds slot {held}'s data of another buffer (its binding is an earlier format's, which "
                "names no episode: a buffer written before format 7, or this one's original before `replaybuf "
                "upgrade`): it was copied here"
            )
        if not sound:
            return (
                f"the shard's binding to its field and slot (the {self.NBYTES} bytes before its index) is damaged "
                f"or absent (it holds {bytes(raw).hex()})"
            )
        if field_sum != self._field_sum:
            other = self._names.get(field_sum)
            if other is not None:
                owner = f"data/{other}"
            elif self.buffer is None:
                owner = "a field this buffer does not have"
            else:
                owner = "another buffer (or of a field this buffer does not have)"
            return (
                f"the shard holds slot {held}'s data of {owner}, not of data/{self.field}: it was copied or moved here"
            )
        if held != slot:
            return (
                f"the shard holds slot {held}'s data, not slot {slot}'s: it was copied or moved here from slot {held}"
            )
        if held_generation is not None and generation and held_generation != generation & 0xFFFFFFFF:
            origin = (
                "restored from an older copy"
                if held_generation < generation & 0xFFFFFFFF
                else "a later episode's, written after the read was planned, or copied from a newer copy"
            )
            return (
                f"the shard holds slot {slot}'s episode of generation {held_generation}, not generation "
                f"{generation}: {origin}"
            )
        return None


class Expected(dict[int, int]):
    """Per episode, the generation its shard's binding must name (format 7; 0 for any episode
    not listed: none checked). ``planned``: the read's own plan, so a shard of another episode
    in a slot that no longer holds the planned one is a writer's reuse since the plan
    (``GenerationMismatchError``, retried); else the slots' generations as found by the read
    itself (a writer racing such a read fails it as damage, as any rewrite under it does)."""

    def __init__(self, generations: Iterable[tuple[int, int]] = (), planned: bool = False):
        super().__init__(generations)
        self.planned = planned

    def __missing__(self, episode: int) -> int:
        return 0


_UNCHECKED = Expected()  # a format binding no generation


def _runs(spans: dict[int, list[tuple]]) -> list[tuple[int, list[tuple]]]:
    """Per episode, its (offset, nbytes, ...) items sorted and cut into runs of adjacent bytes
    (one range read each): ``[(episode, run), ...]``."""
    runs = []
    for e, items in spans.items():
        items.sort()
        run = [items[0]]
        for item in items[1:]:
            if item[0] == run[-1][0] + run[-1][1]:
                run.append(item)
            else:
                runs.append((e, run))
                run = [item]
        runs.append((e, run))
    return runs


class ShardedArray(ChunkedArray):
    """A (episode, time, *shape) array sharded as one shard per episode.

    ``chunks`` are the inner chunks ``(1, T_inner, *shape)``; the shard spans the whole time axis.
    """

    def __init__(
        self,
        *args,
        index_crc: bool = True,
        binding: ShardBinding | None = None,
        length_error: Callable[[str, int, int, int], CorruptChunkError] | None = None,
        writing_generations: Callable[[np.ndarray], np.ndarray] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.length_error = length_error  # (path, slot, stored length, frames held): a length blamed
        # format 7: the generations shards of slots written now are bound to (``Storage.plan_generations``)
        self.writing_generations = writing_generations
        self.inner_per_shard = -(-self.shape[1] // self.chunks[1])
        self.index_crc = index_crc
        # format 5 and later: the shard's binding (``ShardBinding``) lies just before its index, read with it
        self.binding = binding
        self.binding_nbytes = 0 if binding is None else ShardBinding.NBYTES
        self.index_nbytes = self.binding_nbytes + 16 * self.inner_per_shard + (4 if index_crc else 0)
        self._shard_keys: dict[int, str] = {}
        self._shard_paths: dict[int, str] = {}
        self._hot_tier: weakref.ref[HotTier] | None = None

    @property
    def binds_generations(self) -> bool:
        """Whether each shard's binding names its episode's generation (format 7)."""
        return self.binding is not None and self.binding.generations and self.generations_of is not None

    def expected_generations(self, episodes: Sequence[int], planned: Sequence[int] | None = None) -> Expected:
        """Per episode, the generation its shard's binding must name (format 7; 0: none
        checked): the one the read planned (``planned``, per episode), else the slot's as
        stored now (one read for all of them). Before format 7: 0 for any episode, unread."""
        if not self.binds_generations:
            return _UNCHECKED
        episodes = [int(e) for e in episodes]
        generations = planned
        if generations is None and episodes:
            assert self.generations_of is not None  # binds_generations
            generations = np.asarray(self.generations_of(np.array(episodes, np.int64)), np.int64).tolist()
        return Expected(zip(episodes, (int(g) for g in generations or ())), planned=planned is not None)

    def _planned_per_episode(self, episodes: np.ndarray, generations: np.ndarray | None) -> Expected:
        """``expected_generations`` of the distinct ``episodes`` of a read given ``generations``
        (one per item, or one for all, or None)."""
        if not self.binds_generations:
            return _UNCHECKED
        distinct, first = np.unique(episodes, return_index=True)
        planned = None if generations is None else _per_pair(generations, len(episodes))[first].tolist()
        return self.expected_generations(distinct.tolist(), planned)

    @property
    def hot(self) -> HotTier | None:
        """A writer's hot tier (``_hot.py``), which sets itself here; held weakly, since the
        tier refers to its arrays (the storage owns both: no cycle, ``_owner.py``)."""
        return None if self._hot_tier is None else self._hot_tier()

    @hot.setter
    def hot(self, tier: HotTier | None) -> None:
        self._hot_tier = None if tier is None else weakref.ref(tier)

    def shard_key(self, episode: int) -> str:
        # built once per slot: sampling asks for it once per sampled frame's episode
        key = self._shard_keys.get(episode)
        if key is None:
            key = self._shard_keys[episode] = self.chunk_key((episode, 0))
        return key

    def shard_path(self, episode: int) -> str:
        """``kv.where`` of the episode's shard, built once per slot (the maps of hot shards,
        ``_hotmap.py``, look it up per sampled episode per batch)."""
        path = self._shard_paths.get(episode)
        if path is None:
            path = self._shard_paths[episode] = self.kv.where(self.shard_key(episode))
        return path

    def _row_keys(self, episode: int) -> list[str]:
        # docstring inherited: one shard per episode
        return [self.shard_key(episode)]

    @property
    def shard_time(self) -> int:
        """Timesteps one shard spans: the time axis rounded up to whole inner chunks."""
        return self.inner_per_shard * self.chunks[1]

    # ---- reads --------------------------------------------------------------------------

    def _damage(
        self, index: tuple, reason: str, slot: int | None = None, error: type[CorruptChunkError] = CorruptChunkError
    ) -> CorruptChunkError:
        # docstring inherited: the file is the episode's shard
        e, ti = int(index[0]), int(index[1])
        ct = self.chunks[1]
        where = f"{self.kv.where(self.shard_key(e))}, inner chunk {ti}"
        return error.at(self.path, e, (ti * ct, min((ti + 1) * ct, self.shape[1])), where, reason)

    def _absent(self, index: tuple, slot: int | None = None) -> None:
        """``ChunkedArray._absent``, but a shard whose frames stop short of the episode's stored
        length, every frame before present and none after, blames the length
        (``length_error``): ``verify --repair`` then restores it instead of dropping the episode."""
        try:
            super()._absent(index, slot)
        except CorruptChunkError as error:
            blamed = self._length_blamed(int(index[0]))
            raise (error if blamed is None else blamed) from None

    def _length_blamed(self, episode: int) -> CorruptChunkError | None:
        """The ``length_error`` for ``episode`` when its shard holds fewer whole frames than its
        stored length (one frame per inner chunk); else None."""
        if self.length_error is None or self.committed is None:
            return None
        held, length = self.frames_held(episode), self.committed(episode)
        if not held or not held[0] < length:
            return None
        return self.length_error(self.path, episode, length, held[0])

    def frames_held(self, episode: int) -> list[int] | None:
        """``[frames]`` when ``episode``'s shard holds frames for steps ``0 .. frames - 1`` and
        none after (a writer stores a shard whole, the frames of its episode's steps), else None
        (no shard, an unreadable index, or inner chunks of several frames)."""
        if self.chunks[1] != 1:
            return None
        try:
            stored = self.read_indexes([episode])[episode]
        except CorruptChunkError:
            return None
        if stored is None:
            return None
        present = stored[:, 0] != _MISSING
        frames = int(np.argmin(present)) if not present.all() else len(present)
        return [frames] if frames and not present[frames:].any() else None

    def _parse_index(self, raw: bytes | None, episode: int, expected: Expected = _UNCHECKED) -> np.ndarray | None:
        """The (offset, nbytes) rows of a shard index read from the shard's end (with the
        shard's binding before it, from format 5), checked against the index's crc32c, then the
        binding (a shard cut short fails the crc32c first; format 7: to the episode of the
        generation ``expected`` names for ``episode``), and the sizes any encoding takes."""
        if raw is None:
            return None
        error: type[CorruptChunkError] = CorruptChunkError
        skip = self.binding_nbytes
        if len(raw) != self.index_nbytes:
            reason = f"shard index is {len(raw)} bytes, expected {self.index_nbytes} (truncated shard)"
        elif self.index_crc and (computed := crc32c(raw[skip:-4])) != (stored := int.from_bytes(raw[-4:], "little")):
            reason = "shard index fails its crc32c"
            if crc_bit_flipped(computed, stored, len(raw) - skip - 4):
                error = ChunkChecksumError
                reason = (
                    f"the shard index's stored crc32c is damaged, not the index (it holds {stored:#010x}, one bit "
                    f"away from the crc32c {computed:#010x} of the index, which damaged data cannot cause); "
                    "`replaybuf verify --repair` re-seals the shard"
                )
        elif (problem := self.binding_problem(raw[:skip], episode, expected[episode])) is not None:
            reason = problem  # a sound index of a shard written for another slot, field or episode
            self._check_not_moved(raw[:skip], episode, expected)
        else:
            body = raw[skip:-4] if self.index_crc else raw[skip:]
            index = np.frombuffer(body, dtype="<u8").reshape(self.inner_per_shard, 2)
            # a read is sized by these: a chunk no encoding makes, or one past the end of any
            # shard this array writes, is damage (an index without a crc32c, or one forged)
            stored = index[index[:, 0] != _MISSING]
            if not ((stored[:, 1] <= self.max_stored) & (stored[:, 0] <= self.inner_per_shard * self.max_stored)).all():
                reason = f"shard index names a chunk over the {self.max_stored:,} bytes any encoding of it takes"
            else:
                return index
        raise error.at(self.path, episode, (0, self.shape[1]), self.kv.where(self.shard_key(episode)), reason)

    def _check_not_moved(self, raw: bytes, episode: int, expected: Expected) -> None:
        """GenerationMismatchError when the binding ``raw`` fails only for naming another
        generation than the read planned for ``episode`` (format 7) and the slot no longer holds
        that one: a writer reused it since the read was planned (its new shard is written before
        its generation publishes), which is a retry, not damage."""
        generation = expected[episode]
        if not expected.planned or not generation or self.binding_problem(raw, episode) is not None:
            return
        assert self.generations_of is not None  # a generation is checked: binds_generations
        if int(self.generations_of(np.array([episode], np.int64))[0]) != generation:
            raise GenerationMismatchError(self.kv.where(self.path), [episode])

    def binding_problem(self, raw: bytes, episode: int, generation: int = 0) -> str | None:
        """None when the binding bytes ``raw`` bind the shard to this field's ``episode`` (format
        7: of ``generation``, unless 0), or the format binds none; else what is wrong
        (``ShardBinding.problem``)."""
        return None if self.binding is None else self.binding.problem(raw, episode, generation)

    def read_indexes(
        self,
        episodes: Sequence[int],
        generations: dict[int, Any] | None = None,
        expected: Expected | None = None,
    ) -> dict[int, np.ndarray | None]:
        """The shard index (offset, nbytes per inner chunk) of each episode's shard; with
        ``generations`` (per episode) through the files the store keeps open under them, the
        ones the frames are then read from: index and frames come from one file even when a
        compaction renames another into place in between. Format 7: each shard's binding must
        name ``expected`` (per episode; default: ``expected_generations`` of ``generations``)."""
        unique = list(dict.fromkeys(int(e) for e in episodes))
        if expected is None:
            expected = self.expected_generations(
                unique, None if generations is None else [generations[e] for e in unique]
            )
        requests = [(self.shard_key(e), -self.index_nbytes, None) for e in unique]
        if generations is None:
            raws = self.kv.get_ranges(requests)
        else:
            raws = [None] * len(unique)

            def keep(i: int, data: bytes | None) -> None:
                raws[i] = data

            self.kv.get_ranges_each(requests, keep, [generations[e] for e in unique])
        return {e: self._parse_index(r, e, expected) for e, r in zip(unique, raws)}

    def fetch_chunks(self, indices: Sequence[tuple]) -> dict[tuple, np.ndarray | None]:
        # docstring inherited
        unique = list(dict.fromkeys((int(index[0]), int(index[1])) for index in indices))
        episodes = list(dict.fromkeys(e for e, _ in unique))
        decoded = self._fresh_on_damage(episodes, lambda: self._fetch_chunks(unique, episodes))
        return {index: decoded[tuple(int(i) for i in index[:2])] for index in indices}

    def _fetch_chunks(self, unique: list[tuple[int, int]], episodes: list[int]) -> dict[tuple, np.ndarray | None]:
        """``fetch_chunks`` of distinct (episode, inner chunk) pairs: the indexes, then one
        range read per run of adjacent stored chunks."""
        indexes = self.read_indexes(episodes)
        spans: dict[int, list[tuple[int, int, tuple]]] = {}
        for e, ti in unique:
            index = indexes[e]
            if index is None or index[ti, 0] == _MISSING:
                continue  # the caller reads it as absent
            spans.setdefault(e, []).append((int(index[ti, 0]), int(index[ti, 1]), (e, ti)))
        runs = _runs(spans)
        raws: dict[tuple, bytes | None] = {}
        for data, (_, run) in zip(self.kv.get_ranges([self._run_request(e, run) for e, run in runs]), runs):
            base = run[0][0]
            for offset, nbytes, key in run:
                raws[key] = None if data is None else data[offset - base : offset - base + nbytes]
        return self._decode_many({k: raws.get(k) for k in unique})

    def _run_request(self, episode: int, run: list[tuple]) -> tuple[str, int, int]:
        """The byte range of episode's shard holding a run of adjacent inner chunks."""
        return self.shard_key(episode), run[0][0], run[-1][0] + run[-1][1]

    def _fresh_on_damage(self, episodes: list[int], read: Callable[[], Any]) -> Any:
        """``read()``, again with fresh shard indexes when it fails a crc32c: a compaction
        (``_hot.py``) replaces a shard with new offsets under the same slot generation, so an
        index read (or cached) before it points at the wrong bytes of the new file. A retry
        can itself fall between its index read and its data read of another shard being
        replaced (a writer's close() compacts one shard after another), so up to
        ``COMPACTION_RETRIES`` times; damage that stays raises. Costs nothing on the normal path."""
        for _ in range(COMPACTION_RETRIES):
            try:
                return read()
            except CorruptChunkError:
                self._forget_indexes(episodes)
        return read()

    def _forget_indexes(self, episodes: Sequence[int]) -> None:
        """Drop the cached indexes and open read handles of episodes' shards."""
        chunk_cache().discard(self._namespace, [self.index_cache_key(e) for e in episodes])
        self.kv.drop_read_handles([self.shard_key(e) for e in episodes])

    def _indexes_cached(
        self, episodes: list[int], generations: list | None, expected: Expected | None = None
    ) -> dict[int, np.ndarray | None]:
        """Shard indexes, kept in the chunk cache under the slot generation when one is given
        (``expected``: as ``read_indexes``)."""
        if generations is None:
            return self.read_indexes(episodes, expected=expected)
        cache = chunk_cache()
        keys = [self.index_cache_key(e) for e in episodes]
        found = dict(zip(episodes, cache.get_many(self._namespace, keys, generations)))
        missing = {e for e in episodes if found[e] is None}
        if missing:
            found.update(self.read_indexes(sorted(missing), dict(zip(episodes, generations)), expected))
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

    def gather(self, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None) -> np.ndarray:
        # docstring inherited: hot shards on local disk from their maps (``_hotmap.py``), at a
        # gather's speed (the chunk cache would only add its lookups and copies); the resident
        # copy of a small array first. Maps not yet verified to hold the generations named are
        # verified after the copy (``verifies_gathers``)
        episodes = np.asarray(episodes, dtype=np.int64).reshape(-1)
        timesteps = np.asarray(timesteps, dtype=np.int64).reshape(-1)
        planned = None if generations is None else _per_pair(generations, len(episodes))
        mapped = (
            None
            if generations is not None and self._resident_enabled()
            else gather_mapped(self, episodes, timesteps, planned)
        )
        if mapped is None:
            return super().gather(episodes, timesteps, generations)
        out, left, unverified = mapped
        if len(left):
            kept = None if planned is None else planned[left]
            out[left] = super().gather(episodes[left], timesteps[left], kept)
        if unverified and self.generations_of is not None:
            self._verify_maps(unverified)
        return out

    def _verify_maps(self, unverified: list[tuple[int, int, HotMap]]) -> None:
        """Mark each map verified for the generation a read named for its slot, where the slot
        holds it now (read after the map was found at its path, which was after the read was
        planned: generations never return, so the slot held it all along and the map's file
        version is that episode's); GenerationMismatchError names the other slots."""
        slots = np.array([slot for slot, _, _ in unverified], np.int64)
        named = np.array([generation for _, generation, _ in unverified], np.int64)
        assert self.generations_of is not None
        held = named == np.asarray(self.generations_of(slots), np.int64)
        for (_, generation, shard), ok in zip(unverified, held.tolist()):
            if ok:
                shard.generation = generation
        if not held.all():
            raise GenerationMismatchError(self.kv.where(self.path), slots[~held])

    def _read_whole_into(
        self, grid: list[tuple[int, int]], rows: list[int], out: np.ndarray, generations: list | None
    ) -> None:
        # docstring inherited
        if not grid:
            return
        first_generation: dict[int, Any] = {}
        for (e, _), generation in zip(grid, generations if generations is not None else [None] * len(grid)):
            first_generation.setdefault(e, generation)
        episodes = list(first_generation)

        def read() -> None:
            indexes = self._indexes_cached(
                episodes, None if generations is None else [first_generation[e] for e in episodes]
            )
            # every chunk's (offset, nbytes) looked up at once in a table of the indexes (a numpy
            # scalar lookup per sampled frame cost more than its read)
            table = np.full((len(episodes), self.inner_per_shard, 2), _MISSING, np.uint64)
            for k, e in enumerate(episodes):
                if (index := indexes[e]) is not None:
                    table[k] = index
            position = {e: k for k, e in enumerate(episodes)}
            chunk_e, chunk_t = (np.array(axis, np.int64) for axis in zip(*grid))
            entries = table[[position[e] for e in chunk_e.tolist()], chunk_t]
            stored = entries[:, 0] != _MISSING
            for k in np.flatnonzero(~stored).tolist():
                self._absent(grid[k])
                out[rows[k]] = 0
            picked = np.flatnonzero(stored)
            offset, nbytes = entries[picked, 0].astype(np.int64), entries[picked, 1].astype(np.int64)
            order = np.lexsort((offset, chunk_e[picked]))
            picked, offset, nbytes, episode = picked[order], offset[order], nbytes[order], chunk_e[picked][order]
            # runs of adjacent chunks of one shard: one range read each, placed one after another
            begins = np.ones(len(picked), bool)
            begins[1:] = (episode[1:] != episode[:-1]) | (offset[1:] != offset[:-1] + nbytes[:-1])
            first = np.flatnonzero(begins)
            run = np.cumsum(begins) - 1
            lo = offset[first]
            hi = np.maximum.reduceat(offset + nbytes, first) if len(first) else lo
            places = np.concatenate([[0], np.cumsum(hi - lo)])
            run_episodes = episode[first].tolist()
            requests = [(self.shard_key(e), a, b) for e, a, b in zip(run_episodes, lo.tolist(), hi.tolist())]
            keyed = None if generations is None else [first_generation[e] for e in run_episodes]
            buffer = np.empty(int(places[-1]), np.uint8)
            got = np.asarray(self.kv.get_ranges_into(requests, buffer.data, keyed), np.int64)[run]
            begin = places[run] + offset - lo[run]
            end = begin + nbytes
            absent = got < 0
            short = np.flatnonzero(~absent & (end > places[run] + got))
            if len(short):
                k = int(short[0])
                raise self._damage(grid[picked[k]], f"the shard ends before the chunk ({got[k]} of the bytes asked)")
            for k in picked[absent].tolist():
                self._absent(grid[k])
                out[rows[k]] = 0
            kept = picked[~absent].tolist()
            self._decode_spread(
                buffer.data,
                list(zip(begin[~absent].tolist(), end[~absent].tolist())),
                out,
                [rows[k] * self.item_nbytes for k in kept],
                [grid[k] for k in kept],
            )

        self._fresh_on_damage(episodes, read)

    def _decode_spread(
        self, data: memoryview, ranges: list[tuple[int, int]], out: np.ndarray, offsets: list[int], chunks: list[tuple]
    ) -> None:
        """``_decode_many_into`` in parts of about ``SPREAD_BYTES`` decoded, spread over the
        pool (``_kv.in_pool``): a batch of sampled frames is milliseconds of decoding."""
        size = self.item_nbytes * self.chunks[1]
        parts = max(1, min(len(ranges), len(ranges) * size // max(SPREAD_BYTES, 1)))
        bounds = np.linspace(0, len(ranges), parts + 1).astype(int).tolist()

        def part(k: int) -> None:
            a, b = bounds[k], bounds[k + 1]
            self._decode_many_into(data, ranges[a:b], out, offsets[a:b], chunks[a:b])

        in_pool(parts, part, spread=True)

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
        live = lengths > 0
        expected = self._planned_per_episode(
            episodes[live], None if generations is None else _per_pair(generations, len(episodes))[live]
        )
        # hot shards (``_hotmap.py``)
        lengths = read_mapped_spans(self, out, episodes, starts, lengths, parallel, expected)
        ct = self.chunks[1]
        spans = [
            (i, e, s // ct, (s + n - 1) // ct + 1)
            for i, (e, s, n) in enumerate(zip(episodes.tolist(), starts.tolist(), lengths.tolist()))
            if n > 0
        ]
        whole = [span for span in spans if 2 * (span[3] - span[2]) >= self.inner_per_shard]
        ranged = [span for span in spans if 2 * (span[3] - span[2]) < self.inner_per_shard]
        if whole and isinstance(self.kv, LocalKV) and self.codec.writes_hot:
            for k in range(0, len(whole), MAPPED_SHARDS):
                self._read_mapped(self.kv, whole[k : k + MAPPED_SHARDS], out, starts, lengths, parallel, expected)
        elif whole:

            def decode_shard(k: int, data: bytes | None) -> None:
                view = None if data is None else memoryview(data)
                episode = whole[k][1]
                index = (
                    None if view is None else self._parse_index(bytes(view[-self.index_nbytes :]), episode, expected)
                )
                self._decode_span(view, 0, index, whole[k], out, starts, lengths)

            keys = [self.shard_key(e) for _, e, _, _ in whole]
            nbytes = int(lengths[[i for i, _, _, _ in whole]].sum()) * self.item_nbytes
            self._each(keys, decode_shard, parallel, ranges=False, nbytes=nbytes)
        if ranged:
            self._read_ranged(ranged, out, starts, lengths, generations, parallel, expected)

    def _read_mapped(
        self,
        kv: LocalKV,
        spans: list[tuple[int, int, int, int]],
        out: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        parallel: bool,
        expected: Expected,
    ) -> None:
        """Spans read from whole shards on local disk, from maps of their files: the bytes are
        decoded where the page cache holds them (a pread copied each shard first, ~10% of a cold
        ``get_all_data``). Each shard is mapped and its index checked here, then its whole inner
        chunks decoded in parts of about ``SPREAD_BYTES`` over the pool, straight into their rows
        of ``out``: parts, not shards, so the last shards do not leave a core idle. Only blosc
        shards are mapped: they are only ever replaced whole, by a rename (``_write_box``), so a
        map sees one complete file version."""
        frame_nbytes = self.item_nbytes * self.chunks[1]
        Part = tuple[memoryview, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

        def plan() -> Iterator[list[Part]]:
            for span in spans:
                episode = span[1]
                mapped = kv.map(self.shard_key(episode))
                view = None if mapped is None else mapped.data
                index = (
                    None if view is None else self._parse_index(bytes(view[-self.index_nbytes :]), episode, expected)
                )
                chunks = self._span_chunks(view, 0, index, span, out, starts, lengths)
                if view is None or chunks is None:
                    continue
                ranges, row, offsets, indices = chunks
                count = max(1, min(len(ranges), len(ranges) * frame_nbytes // max(SPREAD_BYTES, 1)))
                bounds = np.linspace(0, len(ranges), count + 1).astype(int).tolist()
                yield [(view, ranges[a:b], row, offsets[a:b], indices[a:b]) for a, b in pairwise(bounds)]

        def decode(part: Part) -> None:
            self._decode_many_into(*part)

        if parallel:  # each shard's parts decoded on the pool while the next shard is planned
            in_pool_as_planned(plan(), decode)
        else:
            for parts in plan():
                for part in parts:
                    decode(part)

    def _read_ranged(
        self,
        spans: list[tuple[int, int, int, int]],
        out: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        generations: np.ndarray | None,
        parallel: bool,
        expected: Expected,
    ) -> None:
        """Spans needing under half of their shard: the index, then one range per episode
        (``expected``: the generation each shard's binding must name, ``read_indexes``)."""
        episodes = list(dict.fromkeys(e for _, e, _, _ in spans))
        per_episode = None
        if generations is not None:
            generation_of: dict[int, int] = {}
            all_generations = np.broadcast_to(np.asarray(generations, dtype=np.int64), (len(starts),))
            for i, e, _, _ in spans:
                generation_of.setdefault(e, int(all_generations[i]))
            per_episode = [generation_of[e] for e in episodes]
        self._fresh_on_damage(
            episodes, lambda: self._read_ranges(spans, episodes, per_episode, out, starts, lengths, parallel, expected)
        )

    def _read_ranges(
        self,
        spans: list[tuple[int, int, int, int]],
        episodes: list[int],
        generations: list[int] | None,
        out: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        parallel: bool,
        expected: Expected,
    ) -> None:
        """``_read_ranged`` given the distinct episodes and their generations (or None)."""
        indexes = self._indexes_cached(episodes, generations, expected)
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

        nbytes = int(lengths[[span[0] for span, _, _ in todo]].sum()) * self.item_nbytes
        self._each(requests, decode_range, parallel, ranges=True, nbytes=nbytes)

    def _each(self, requests: list, consume, parallel: bool, ranges: bool, nbytes: int) -> None:
        """Fetch whole objects (or byte ranges) and ``consume(k, bytes)`` each, decoding
        ``nbytes`` in all: spread over the thread pool (even on 2 cores when each request
        decodes ``SPREAD_BYTES`` or more on average), or in this thread when not ``parallel``."""
        if parallel:
            spread = nbytes >= SPREAD_BYTES * len(requests)
            if ranges:
                self.kv.get_ranges_each(requests, consume, spread=spread)
            else:
                self.kv.get_each(requests, consume, spread=spread)
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
        chunks = self._span_chunks(view, base, index, span, out, starts, lengths)
        if chunks is not None:
            self._decode_many_into(view, *chunks)  # type: ignore[arg-type]  # chunks imply a view

    def _span_chunks(
        self,
        view: memoryview | None,
        base: int,
        index: np.ndarray | None,
        span: tuple[int, int, int, int],
        out: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """``_decode_span`` but for its whole inner chunks, which it returns as ``_decode_many_into``
        takes them after ``view`` (ranges, the row ``out[i]``, byte offsets in it, (episode,
        chunk) rows), or None when there are none. Chunks absent, or cut by the span, are decoded
        here piece by piece. The others are found with numpy: a Python step per frame cost ~1 us
        and a few objects (a whole buffer's read left ~2.6x as many live ones, bringing the
        collector's full pass, ~0.15 s with torch and dask loaded, nearer)."""
        i, e, first, stop = span
        start, length = int(starts[i]), int(lengths[i])
        if view is None or index is None:
            self._absent((e, first))  # the first chunk is the one most inside the episode
            out[i, :length] = 0
            return None
        ct, row = self.chunks[1], out[i]
        entries = index[first:stop]
        chunks = np.arange(first, stop, dtype=np.int64)
        lo = chunks * ct - start
        stored = entries[:, 0] != _MISSING
        whole = stored & (lo >= 0) & (lo + ct <= length) & row.flags.c_contiguous
        for k in np.flatnonzero(~whole).tolist():
            offset, nbytes = int(entries[k, 0]) - base, int(entries[k, 1])
            self._decode_piece(
                view[offset : offset + nbytes] if stored[k] else None, e, first + k, out, i, start, length
            )
        if not whole.any():
            return None
        begin = entries[whole, 0].astype(np.int64) - base
        ranges = np.stack([begin, begin + entries[whole, 1].astype(np.int64)], axis=1)
        picked = chunks[whole]
        return ranges, row, lo[whole] * self.item_nbytes, np.stack([np.full_like(picked, e), picked], axis=1)

    # ---- writes -------------------------------------------------------------------------

    def encode_shard(
        self, slot: int, rows: np.ndarray, keep: np.ndarray | None = None, hot: bool = False, generation: int = 0
    ) -> bytes | memoryview | None:
        """The shard of ``slot`` holding one episode's (time, *shape) rows, bound to the episode
        of ``generation`` (format 7); None when all zero.

        All-zero inner chunks are left out (they read back as zero) unless ``keep`` (one bool
        per inner chunk) marks them: format 2 stores every chunk of a written span, so a missing
        one is damage. The others are encoded in one run per core on the thread pool; ``hot``:
        at blosc clevel 0 (``ChunkCodec.encode``), copied into one buffer (``_hot_shard``).
        """
        step = self.chunks[1]
        rows = rows[: self.inner_per_shard * step]
        if rows.shape[0] % step:
            pad = np.zeros((step - rows.shape[0] % step, *rows.shape[1:]), rows.dtype)
            rows = np.concatenate([rows, pad])
        pieces = rows.reshape(-1, step, *rows.shape[1:])
        stored = np.zeros(len(pieces), bool) if keep is None else keep[: len(pieces)].copy()
        scan = np.flatnonzero(~stored)  # chunks kept anyway need no look for data
        if len(scan) == len(pieces):
            stored = np.asarray(pieces.reshape(len(pieces), -1).any(axis=1))
        elif len(scan):
            stored[scan] = pieces[scan].reshape(len(scan), -1).any(axis=1)
        nonzero = np.flatnonzero(stored)
        if not len(nonzero):
            return None
        if hot:
            first, last = int(nonzero[0]), int(nonzero[-1])
            # a run of chunks (the usual episode) is a view: no copy before the shard's own
            chosen = pieces[first : last + 1] if last - first + 1 == len(nonzero) else pieces[nonzero]
            return self._hot_shard(slot, chosen, nonzero, generation)

        def encode_run(run):
            return [self.codec.encode(pieces[i][None]) for i in run]

        # one run per core, the first in this thread: more runs cost CPU (~+20% at 4 runs on 2
        # cores) and gain no wall time
        runs = np.array_split(nonzero, min(len(nonzero), CORES)) if rows.nbytes > (1 << 20) else [nonzero]
        others = [thread_pool().submit(encode_run, run) for run in runs[1:]]
        blobs = encode_run(runs[0])
        for future in others:
            blobs.extend(future.result())
        sizes = np.array([len(b) for b in blobs], dtype="<u8")
        return b"".join(blobs) + self._tail_bytes(slot, nonzero, sizes, generation)

    def _tail_bytes(self, slot: int, stored: np.ndarray, sizes: np.ndarray, generation: int) -> bytes:
        """What follows the inner chunks of ``slot``'s shard: its binding (format 5; format 7: to
        the episode of ``generation``), then its index (and the index's crc32c) of inner chunks
        ``stored`` of ``sizes`` bytes, laid out one after another from offset 0."""
        index = np.full((self.inner_per_shard, 2), _MISSING, dtype="<u8")
        index[stored, 0] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<u8")
        index[stored, 1] = sizes
        index_bytes = index.tobytes()
        if self.index_crc:
            index_bytes += crc32c(index_bytes).to_bytes(4, "little")
        return index_bytes if self.binding is None else self.binding.of(slot, generation) + index_bytes

    def _hot_shard(self, slot: int, chunks: np.ndarray, stored: np.ndarray, generation: int) -> memoryview:
        """A hot shard of ``slot`` of ``chunks`` (inner chunks ``stored``) built in one buffer: per
        chunk the blosc header ``encode(hot=True)`` writes (the same for every chunk of one size),
        the raw bytes and the crc32c, then the binding and the index. One copy of the frames and
        their checksums, none of the per-chunk allocations and joins of ``encode``."""
        count = len(chunks)
        raw = np.ascontiguousarray(chunks, dtype=self.codec.dtype).reshape(count, -1).view(np.uint8)
        header = self.codec.encode(chunks[0], hot=True)[:BLOSC_HEADER]
        width = BLOSC_HEADER + raw.shape[1] + (4 if self.codec.checksum else 0)
        index = self._tail_bytes(slot, stored, np.full(count, width, dtype="<u8"), generation)
        out = np.empty(count * width + len(index), np.uint8)
        items = out[: count * width].reshape(count, width)
        items[:, :BLOSC_HEADER] = np.frombuffer(header, np.uint8)
        items[:, BLOSC_HEADER : BLOSC_HEADER + raw.shape[1]] = raw
        if self.codec.checksum:
            sums = np.array([crc32c(item[:-4]) for item in items], dtype="<u4")
            items[:, -4:] = sums.view(np.uint8).reshape(count, 4)
        out[count * width :] = np.frombuffer(index, np.uint8)
        return out.data

    def write_box(
        self, start: Sequence[int], values: np.ndarray, atomic: bool = True, padding_from: int | None = None
    ) -> None:
        # docstring inherited: under the hot tier's lock when it has one (a compaction never
        # replaces a shard written meanwhile), hot where it writes hot; the padding's inner
        # chunks are left out of the shard (they read as zeros, past the committed length)
        tier = self.hot
        if tier is None:
            self._write_box(start, values, atomic, False, padding_from)
            return
        with tier.lock:
            self._write_box(start, values, atomic, tier.writes_hot and self.codec.writes_hot, padding_from)

    def _write_box(
        self, start: Sequence[int], values: np.ndarray, atomic: bool, hot: bool, padding_from: int | None = None
    ) -> None:
        """``write_box``; ``hot``: the shards encoded hot (``encode_shard``)."""
        if self.check_writable is not None:
            self.check_writable()
        e0, t0 = int(start[0]), int(start[1]) if len(start) > 1 else 0
        count, length = values.shape[0], values.shape[1]
        whole = t0 == 0 and length >= self.shape[1]
        keep = None
        bound = self._binding_generations(np.arange(e0, e0 + count))  # format 7: each shard's episode
        if self.committed is not None:
            step = self.chunks[1]
            keep = np.zeros((count, self.inner_per_shard), bool)
            end = t0 + length if padding_from is None else min(t0 + length, max(padding_from, t0))
            keep[:, t0 // step : -(-end // step)] = True
        if whole:
            rows = values
        else:
            rows = np.empty((count, self.shape[1], *self.shape[2:]), self.dtype)
            for i in range(count):
                present = self._old_shard(e0 + i, rows[i], (t0, t0 + length), bound[i])
                if keep is not None and present is not None:
                    keep[i] |= present
            rows[:, t0 : t0 + length] = values
        shards = {
            self.shard_key(e0 + i): self.encode_shard(e0 + i, rows[i], None if keep is None else keep[i], hot, bound[i])
            for i in range(count)
        }
        written = {k: v for k, v in shards.items() if v is not None}
        if written:
            # a shard a reader may map (``_hotmap.py``) is only ever replaced whole, by a rename:
            # a map sees one complete file version, never a truncation (SIGBUS) or a torn frame
            self.kv.set_many(written, atomic=atomic or self.codec.writes_hot)
        empty = [k for k, v in shards.items() if v is None]
        if empty:
            self.kv.delete_many(empty)
        self._forget_episodes(range(e0, e0 + count))
        if self.hot is not None:
            sizes = [len(shard) if hot and shard is not None else 0 for shard in shards.values()]
            self.hot.written(self.path, range(e0, e0 + count), sizes)

    def _binding_generations(self, slots: np.ndarray) -> list[int]:
        """The generations shards of ``slots`` written now are bound to (format 7; else 0s)."""
        if not self.binds_generations or self.writing_generations is None:
            return [0] * len(slots)
        return np.asarray(self.writing_generations(slots), np.int64).tolist()

    def compacted(self, episode: int, data: bytes) -> bytes | memoryview | None:
        """Episode's shard ``data`` re-encoded at the codec's level, or None when it is not hot
        (its first stored inner chunk is not raw). Every inner chunk is checked (crc32c) and
        decoded first: damage raises ``CorruptChunkError`` and is never re-encoded. The new shard
        keeps the binding's generation (format 7): it is the same episode's."""
        index = self._parse_index(data[-self.index_nbytes :], episode)
        assert index is not None  # data is not None
        present = index[:, 0] != _MISSING
        if not present.any():
            return None
        first = int(index[present, 0].min())
        if not self.codec.is_hot(data[first : first + 3]):
            return None
        rows = np.empty((1, *self.shape[1:]), self.dtype)
        span = (0, episode, 0, self.inner_per_shard)
        self._decode_span(memoryview(data), 0, index, span, rows, np.zeros(1, np.int64), np.full(1, self.shape[1]))
        bound = None if self.binding is None else self.binding.held_generation(data[-self.index_nbytes :])
        return self.encode_shard(episode, rows[0], present, generation=bound or 0)

    def reseal_chunks(self, episode: int, write: bool) -> list[str]:
        # docstring inherited: the episode's shard, its index's crc32c and its inner chunks',
        # replaced whole by a rename under the hot tier's lock (a compaction never replaces it
        # meanwhile, and compacts it later if it is hot)
        tier = self.hot
        if tier is None:
            return self._reseal_shard(episode, write)
        with tier.lock:
            return self._reseal_shard(episode, write)

    def _reseal_shard(self, episode: int, write: bool) -> list[str]:
        """``reseal_chunks`` of the episode's shard (the hot tier's lock held, if any)."""
        key = self.shard_key(episode)
        data = self.kv.get(key)
        if data is None:
            self._absent((episode, 0))
            return []
        shard = bytearray(data)
        where = self.kv.where(key)
        found = []
        raw_index = bytes(shard[-self.index_nbytes :])
        try:
            index = self._parse_index(raw_index, episode)
        except ChunkChecksumError:
            shard[-4:] = crc32c(raw_index[self.binding_nbytes : -4]).to_bytes(4, "little")
            index = self._parse_index(bytes(shard[-self.index_nbytes :]), episode)
            found.append(f"{where}, shard index")
        assert index is not None  # data is not None
        for ti in range(self.inner_per_shard):
            if index[ti, 0] == _MISSING:
                self._absent((episode, ti))
                continue
            offset, nbytes = int(index[ti, 0]), int(index[ti, 1])
            if offset + nbytes > len(shard) - self.index_nbytes:
                raise self._damage((episode, ti), f"the shard ends before the chunk ({len(shard)} bytes)")
            sealed = self._sealed(bytes(shard[offset : offset + nbytes]), (episode, ti))
            if sealed is not None:
                shard[offset : offset + nbytes] = sealed
                found.append(f"{where}, inner chunk {ti}")
        if write and found:
            if self.check_writable is not None:
                self.check_writable()
            self.kv.set_many({key: bytes(shard)}, atomic=True)
            self._forget_episodes([episode])
            if self.hot is not None:
                self.hot.written(self.path, [episode], [len(shard) if self.codec.is_hot(bytes(shard[:3])) else 0])
        return found

    def hot_sizes(self, episodes: Sequence[int]) -> list[int]:
        """Per episode, the stored size of its shard when the shard is hot (its first stored
        inner chunk raw: the blosc header's flag, one 3-byte read; 1 where the store cannot
        tell sizes cheaply), else 0."""
        keys = [self.shard_key(e) for e in episodes]
        heads = self.kv.get_ranges([(key, 0, 3) for key in keys])
        sizes = {key: 1 for key, head in zip(keys, heads) if head is not None and self.codec.is_hot(head)}
        for key, fingerprint in zip(list(sizes), self.kv.fingerprints(list(sizes)) or []):
            if len(fingerprint) > 3:  # LocalKV: (inode, mtime, ctime, size)
                sizes[key] = int(fingerprint[3])
        return [sizes.get(key, 0) for key in keys]

    def __getstate__(self) -> dict:
        # the hot tier (its lock and thread) stays with the writer
        return {**super().__getstate__(), "_hot_tier": None}

    def _old_shard(self, episode: int, out: np.ndarray, skip: tuple[int, int], generation: int) -> np.ndarray | None:
        """Decode the episode's stored inner chunks into ``out`` (time, *shape), except those
        inside the steps ``skip`` that the write replaces, for a partial write to merge into;
        return which inner chunks the shard stores. The shard must be bound to the episode of
        ``generation`` (format 7), the one the write binds its shard to (an edit's, or the episode
        being written's). A damaged shard of a slot that holds no committed episode (being
        rewritten; format 7: a shard of the episode replaced there) reads as empty."""
        out[...] = 0
        try:
            index = self.read_indexes([episode], expected=Expected([(episode, generation)]))[episode]
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

    def drop_cached_episodes(self, episodes: Sequence[int]) -> None:
        # docstring inherited: the shards' cached indexes and maps too
        self._forget_indexes(episodes)
        self._forget_episodes(episodes)

    def _forget_episodes(self, episodes) -> None:
        """Drop what the cache and the resident copy hold of rewritten episodes."""
        keys = []
        for e in episodes:
            keys.append(self.index_cache_key(e))
            keys.extend((e, t) for t in range(self.inner_per_shard))
        chunk_cache().discard(self._namespace, keys)
        if self.codec.writes_hot and isinstance(self.kv, LocalKV):  # this process reads its own writes at once
            for e in episodes:
                shard_maps().drop(self.shard_path(e))
        if self._resident_generations is not None:
            self._resident_generations[list(episodes)] = -1
