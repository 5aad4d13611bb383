"""Checksums of each slot's per-episode values (``_meta_sum``).

A committed slot's user meta values and ``_generation`` are raw bytes in place on every
backend (a commit writes a few bytes of each), so nothing on the read path would notice a
flipped bit in them. ``_meta_sum`` (uint64, one entry per slot) holds a hash of the slot
number, its generation, every meta value's bytes, from format 5 its length, and from zarr
format 6 its buffer: the slot word is hashed with a 64-bit word of the buffer's uuid
(``buffer_word``), so entries copied in with their values from another buffer (its meta chunk
files, equal lengths and all) fail here as damaged ones do. ``Summed`` is what a storage's
entries cover (``summed``), passed to every function below. The uuid they are bound to is kept
a second time in ``meta/_meta_sum``'s zarr.json (``storage._zarr.BOUND_TO``), checked at every
open: another buffer's whole ``meta/`` folder, or a damaged config uuid, is refused there by
name, never every slot read as damaged (which ``verify --repair`` would drop). A commit writes the entry with the meta values, before the
generation and the length publish the episode (one more in-place write of 8 bytes), so a
slot being published or unpublished (its length 0) is never checked against it; an edit
of meta values in place rewrites it inside the slots' ``_revision`` bracket
(``Committer.edit_meta``). Every ``refresh`` checks the entries of the committed slots
(``damaged``) and raises ``MetaChecksumError`` for one that does not match, naming the value
one flipped bit explains (``diagnose``). An entry has bits 0 and 63 set, so no single flipped
bit makes it 0: an entry of 0 is one lost (a missing chunk reads as zeros), ``verify --repair``
writes it again. Only format 4 and later keep them (``Storage.keeps_meta_sums``): an earlier
release writes earlier formats and would leave them stale, so a buffer of an earlier format
keeps none, checks none, and stays in its format until ``replaybuf upgrade`` rewrites it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .schema import Field, Schema
from .storage import META_SUM, BufferDamagedError, CorruptChunkError, Storage, meta_file

_KEPT = np.uint64((1 << 63) | 1)
_SEED = np.uint64(0x9E3779B97F4A7C15)
_LENGTH = Field("episode_lens", np.dtype("int32"))


@dataclass(frozen=True)
class Summed:
    """What a storage's ``_meta_sum`` entries cover besides each slot and its generation:
    ``fields``, the per-episode arrays (the meta fields, and ``episode_lens`` where the format's
    entries cover lengths: ``Storage.sums_lengths``), and ``buffer``, the word of the buffer's
    uuid hashed with each slot's (``buffer_word``; 0 where the format binds none:
    ``Storage.binds_meta_sums``, which leaves the entries as they were before). Every function
    below takes it, so a commit, a refresh, ``verify`` and ``convert`` agree."""

    fields: dict[str, Field]
    buffer: int = 0


def summed(schema: Schema, storage: Storage) -> Summed:
    """What the ``_meta_sum`` entries of ``storage`` (opened or created, with ``schema``) cover."""
    fields = {**schema.meta_fields, "episode_lens": _LENGTH} if storage.sums_lengths else dict(schema.meta_fields)
    if not storage.binds_meta_sums:
        return Summed(fields)
    assert schema.uuid is not None, "a format that binds its entries refuses a config without a uuid at the open"
    return Summed(fields, buffer_word(schema.uuid))


@lru_cache(maxsize=64)
def buffer_word(uuid: str) -> int:
    """The 64-bit word of buffer ``uuid`` its slots are hashed with: the first 8 bytes
    (little-endian) of its blake2b."""
    return int.from_bytes(hashlib.blake2b(uuid.encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise (a bijection of uint64: a change in one input word
    always changes the hash)."""
    x = x + _SEED
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


_M64 = (1 << 64) - 1
# at most this many slots are hashed with Python ints (a commit's: numpy's per-call overhead
# over 1-element arrays cost ~30 µs per store_episode), more with numpy; both give the same
_SMALL = 8


def _mix_int(x: int) -> int:
    """``_mix`` of one Python int."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _raw(values: np.ndarray, field: Field, count: int) -> np.ndarray:
    """``values`` (count, *shape) of ``field`` as stored: (count, bytes) of little-endian bytes."""
    raw = np.ascontiguousarray(np.asarray(values, dtype=field.dtype.newbyteorder("<")))
    return raw.reshape(count, -1).view(np.uint8).reshape(count, -1)


def _words(values: np.ndarray, field: Field, count: int) -> np.ndarray:
    """``values`` (count, *shape) of ``field`` as stored (little-endian bytes), zero-padded to
    whole uint64 words: (count, words)."""
    raw = _raw(values, field, count)
    pad = -raw.shape[1] % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((count, pad), np.uint8)], axis=1)
    return raw.view("<u8").reshape(count, -1)


def entries(
    slots: np.ndarray,
    generations: np.ndarray,
    values: Mapping[str, np.ndarray],
    summed: Summed,
) -> np.ndarray:
    """The ``_meta_sum`` entries of ``slots`` holding ``generations`` and the values
    ``values[name]`` (one row per slot) of every field ``summed`` covers, in its buffer.
    Vectorized: a few µs per commit, a few ms per million slots at a refresh."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    count = len(slots)
    if not count:
        return np.zeros(0, np.uint64)
    if count <= _SMALL:
        return _entries_int(slots, generations, values, summed)
    with np.errstate(over="ignore"):
        h = slots.astype(np.uint64)
        h ^= np.uint64(summed.buffer)
        h = _mix(h)
        h = _mix(h ^ np.broadcast_to(np.asarray(generations, dtype=np.int64), (count,)).astype(np.uint64))
        for name, field in summed.fields.items():
            for word in _words(values[name], field, count).T:
                h = _mix(h ^ word)
    return h | _KEPT


def _entries_int(
    slots: np.ndarray, generations: np.ndarray, values: Mapping[str, np.ndarray], summed: Summed
) -> np.ndarray:
    """``entries`` of a few slots, hashed with Python ints over each value's bytes."""
    count = len(slots)
    gens = np.asarray(generations, dtype=np.int64).reshape(-1).tolist()
    gens = gens * count if len(gens) == 1 else gens  # one generation for every slot
    blobs = []
    for name, field in summed.fields.items():
        stored = field.dtype.newbyteorder("<")
        array = np.asarray(values[name])
        data = (array if array.dtype == stored else array.astype(stored)).tobytes()  # C order
        size = len(data) // count
        blobs.append((data, size, -size % 8))
    out = []
    for i, slot in enumerate(slots.tolist()):
        h = _mix_int(_mix_int((slot & _M64) ^ summed.buffer) ^ (gens[i] & _M64))
        for data, size, pad in blobs:
            row = data[i * size : (i + 1) * size] + bytes(pad)
            for k in range(0, len(row), 8):
                h = _mix_int(h ^ int.from_bytes(row[k : k + 8], "little"))
        out.append(h | ((1 << 63) | 1))
    return np.array(out, dtype=np.uint64)


class MetaChecksumError(CorruptChunkError, BufferDamagedError):
    """A committed slot's per-episode values (its meta fields, ``_generation``) do not match
    their checksum in ``_meta_sum``. Also a ``BufferDamagedError``: a refresh (an open) raises
    it, as for other damaged bookkeeping. ``restore``: (name, value) when one flipped bit in one
    value (or in the entry) explains it (``diagnose``), and ``location`` names that file;
    ``verify --repair`` writes it back. Else None, ``location`` names every file involved (which
    one is damaged cannot be told) and ``verify --repair`` drops the episode."""

    def __init__(self, message: str, *, restore: tuple[str, Any] | None = None, **facts: Any):
        super().__init__(message, **facts)
        self.restore = restore


def _checked(meta: Mapping[str, np.ndarray], slots: np.ndarray | None) -> np.ndarray:
    """The slots among ``slots`` (None: those with a published length) whose revision is even
    (no edit in progress): those ``damaged`` checks."""
    if slots is None:
        slots = np.flatnonzero(np.asarray(meta["episode_lens"]) > 0)
    slots = np.asarray(slots, dtype=np.int64)
    revisions = meta.get("_revision")
    return slots if revisions is None else slots[np.asarray(revisions)[slots] % 2 == 0]


def damaged(meta: Mapping[str, np.ndarray], summed: Summed, slots: np.ndarray | None = None) -> np.ndarray:
    """The slots among ``slots`` (None: those with a published length), their revision even
    (no edit in progress), whose ``_meta_sum`` entry (0 too: lost) does not match the values in
    ``meta`` (the per-episode arrays as loaded; none without ``_meta_sum``: a format that keeps
    none)."""
    sums = meta.get(META_SUM)
    if sums is None:
        return np.zeros(0, np.int64)
    slots = _checked(meta, slots)
    if not len(slots):
        return slots
    expected = entries(
        slots,
        np.asarray(meta["_generation"])[slots],
        {name: np.asarray(meta[name])[slots] for name in summed.fields},
        summed,
    )
    return slots[expected != np.asarray(sums)[slots].astype(np.uint64)]


def settle(
    storage: Storage, schema: Schema, meta: Mapping[str, np.ndarray], slots: np.ndarray | None = None
) -> np.ndarray:
    """``damaged`` for ``storage``'s entries, after settling how they are hashed. A buffer of a
    format whose first commits on main hashed them as the format before
    (``Storage.early_hashing``: format 5 without the lengths, zarr format 6 bound to no buffer)
    is told by its slots: where every slot checked fails the hashing the storage follows and
    fewer fail the other, ``storage.meta_sums_as_earlier`` is flipped for good (its writer goes
    on hashing so, keeping the buffer as written) and the slots failing that are returned. A
    slot matching one hashing by chance where it was written under the other is ~2**-63, so a
    damaged slot stays damaged either way. Costs nothing while every slot passes."""
    current = summed(schema, storage)
    found = damaged(meta, current, slots)
    aspect = storage.early_hashing
    if not len(found) or len(found) < len(_checked(meta, slots)) or aspect is None:
        return found
    if aspect == "lengths":
        lengths = "episode_lens" not in current.fields
        other = Summed({**schema.meta_fields, **({"episode_lens": _LENGTH} if lengths else {})}, current.buffer)
    else:
        assert schema.uuid is not None, "a format that binds its entries refuses a config without a uuid at the open"
        other = Summed(current.fields, 0 if current.buffer else buffer_word(schema.uuid))
    still = damaged(meta, other, found)
    if len(still) >= len(found):
        return found
    storage.meta_sums_as_earlier = not storage.meta_sums_as_earlier
    return still


def diagnose(
    meta: Mapping[str, np.ndarray], summed: Summed, slot: int, max_timesteps: int = 0
) -> tuple[str, Any] | None:
    """(name, value) of the one per-episode value of damaged ``slot`` whose single flipped bit
    explains its failed ``_meta_sum`` entry (``_meta_sum`` itself when only the entry is off by
    one bit, or is 0: lost), or, where the entry covers the length, the one length in
    ``[1, max_timesteps]`` that does (a length damaged in several bits); else None. The entry has
    63 bits of hash: a wrong value matching it by chance is ~2**-56 over every candidate."""
    stored = int(np.asarray(meta[META_SUM])[slot])
    generation = int(np.asarray(meta["_generation"])[slot])
    values = {name: np.asarray(meta[name])[slot : slot + 1] for name in summed.fields}
    computed = int(entries(np.array([slot]), np.array([generation]), values, summed)[0])
    if stored == 0 or bin(stored ^ computed).count("1") == 1:
        return META_SUM, computed
    # every bit of the int64 generation, its sign bit too (a flip there reads as a negative one)
    bits = np.uint64(1) << np.arange(64, dtype=np.uint64)
    candidates = (np.array(generation, np.int64).view(np.uint64) ^ bits).view(np.int64)
    found = _matching(slot, stored, candidates, {n: np.repeat(v, 64, axis=0) for n, v in values.items()}, summed)
    if found is not None:
        return "_generation", int(candidates[found])
    for name, field in summed.fields.items():
        raw = _raw(values[name], field, 1)[0]
        flips = np.repeat(raw[None], raw.size * 8, axis=0)
        index = np.arange(raw.size * 8)
        flips[index, index // 8] ^= (1 << (index % 8)).astype(np.uint8)
        shaped = flips.view(field.dtype.newbyteorder("<")).reshape(len(flips), *field.shape).astype(field.dtype)
        trial = {n: shaped if n == name else np.repeat(v, len(flips), axis=0) for n, v in values.items()}
        found = _matching(slot, stored, np.full(len(flips), generation), trial, summed)
        if found is not None:
            return name, shaped[found]
    lengths = lengths_matching(meta, summed, slot, max_timesteps) if max_timesteps else None
    return ("episode_lens", np.int32(lengths[0])) if lengths is not None and len(lengths) == 1 else None


def lengths_matching(meta: Mapping[str, np.ndarray], summed: Summed, slot: int, max_timesteps: int) -> list[int] | None:
    """The lengths in ``[1, max_timesteps]`` at which ``slot``'s entry matches its values as
    loaded (``meta``): what a lost length was. None where the entries do not cover lengths
    (``summed.fields`` without ``episode_lens``) or the slot's entry is not kept."""
    stored = int(np.asarray(meta[META_SUM])[slot])
    if "episode_lens" not in summed.fields or not stored:
        return None
    lengths = np.arange(1, max_timesteps + 1, dtype=np.int32)
    values = {name: np.repeat(np.asarray(meta[name])[slot : slot + 1], len(lengths), axis=0) for name in summed.fields}
    values["episode_lens"] = lengths
    generations = np.full(len(lengths), int(np.asarray(meta["_generation"])[slot]))
    computed = entries(np.full(len(lengths), slot), generations, values, summed)
    return (lengths[computed == np.uint64(stored)]).tolist()


def _matching(
    slot: int, stored: int, generations: np.ndarray, values: Mapping[str, np.ndarray], summed: Summed
) -> int | None:
    """The only candidate (row of ``generations`` and ``values``) whose entry is ``stored``."""
    found = np.flatnonzero(entries(np.full(len(generations), slot), generations, values, summed) == np.uint64(stored))
    return int(found[0]) if len(found) == 1 else None


def error(
    storage: Any, slot: int, summed: Summed, meta: Mapping[str, np.ndarray], max_timesteps: int = 0
) -> MetaChecksumError:
    """The ``MetaChecksumError`` for ``slot`` of ``storage`` (``meta``: its arrays as loaded),
    naming the damaged value and its file when ``diagnose`` finds it, else every file involved."""
    found = diagnose(meta, summed, slot, max_timesteps)
    if found is not None and found[0] == META_SUM and not int(np.asarray(meta[META_SUM])[slot]):
        where = meta_file(storage, META_SUM)
        return MetaChecksumError(
            f"meta/{META_SUM}: slot {slot}: its checksum entry is 0 (lost: a missing chunk reads so), so its "
            f"per-episode values cannot be checked ({where}). `replaybuf verify --repair` writes it again for the "
            "values as stored",
            field=f"meta/{META_SUM}",
            slot=slot,
            location=where,
            restore=found,
        )
    if found is not None:
        name, value = found
        where = meta_file(storage, name)
        held = np.asarray(meta[name])[slot]
        what = "the checksum entry" if name == META_SUM else "the value"
        flipped = name != "episode_lens" or bin(int(held) ^ int(value)).count("1") == 1
        return MetaChecksumError(
            f"meta/{name}: slot {slot}: holds {held.tolist()!r}, but the slot's checksum in meta/{META_SUM} "
            f"matches {np.asarray(value).tolist()!r}{' (one flipped bit)' if flipped else ''}: {what} is damaged "
            f"({where}). "
            "`replaybuf verify --repair` restores it",
            field=f"meta/{name}",
            slot=slot,
            location=where,
            restore=(name, value),
        )
    names = [*summed.fields, "_generation"]
    files = ", ".join(meta_file(storage, name) for name in [*names, META_SUM])
    return MetaChecksumError(
        f"meta: slot {slot}: its per-episode values ({', '.join(names)}) do not match their checksum in "
        f"meta/{META_SUM}: one of them is damaged or was copied in from another buffer ({files}). "
        "`replaybuf verify --repair` drops the episode",
        field="meta/" + ",".join(names),
        slot=slot,
        location=files,
    )


_UNCHECKED = threading.local()


@contextmanager
def unchecked() -> Iterator[None]:
    """Opens (refreshes) in this thread within the block do not raise ``MetaChecksumError``
    or ``LostLengthError``: ``verify --repair`` opens the buffer to repair what it found."""
    depth = getattr(_UNCHECKED, "depth", 0)
    _UNCHECKED.depth = depth + 1
    try:
        yield
    finally:
        _UNCHECKED.depth = depth


def checking() -> bool:
    """Whether a refresh in this thread raises for damaged slots (``unchecked``)."""
    return not getattr(_UNCHECKED, "depth", 0)
