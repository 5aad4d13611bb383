"""The edit log: an in-place edit's writes, stored before any of them is applied.

An in-place edit of committed episodes (``update``, ``update_steps``, ``data[...] = ...``,
``store_datapoint``, meta values) is several writes: a field's rows of each episode, then the
next field's. A writer killed between two of them would leave one call's values half applied.
So ``Committer.edit`` first appends the whole edit to the edit log as one checksummed record,
then applies it, then clears the log; a writable open finds the record of an edit a killed
writer left running and applies it again (every write sets values, so applying one twice
changes nothing), so each edit lands whole. A record torn by a kill was never applied: its
slots were marked as being edited only after the append.

A record: ``_RECORD`` (magic, payload size, crc32 of the payload), then the payload: the size
of a JSON header, the header (the slots, their generations and the odd ``_revision`` the edit
gives them, and each write's kind, field, count and steps), then each write's episodes (and
timesteps) as int64 and its values as raw bytes of the field's dtype.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .schema import Field, Schema
from .storage import MAX_DOCUMENT_BYTES, BufferDamagedError

#: the name of the edit log among the store's logs (``Storage.append_log``)
EDIT_LOG = "edit"
_RECORD = struct.Struct("<4sQI")
_MAGIC = b"RBE1"
_HEADER_SIZE = struct.Struct("<I")
KINDS = ("rows", "steps", "meta")


@dataclass(frozen=True)
class Write:
    """One write of an edit: ``rows``: data field rows of ``episodes`` from step ``at`` (an
    int) on, values (episodes, steps, *shape); ``steps``: single steps (``at``: one timestep
    per episode), values (episodes, *shape); ``meta``: meta values (episodes, *shape)."""

    kind: str
    name: str
    episodes: np.ndarray
    values: np.ndarray
    at: int | np.ndarray = 0

    @property
    def steps(self) -> int:
        """The steps each episode's rows span (``rows``), else 0."""
        return int(self.values.shape[1]) if self.kind == "rows" else 0

    def only(self, kept: np.ndarray) -> Write:
        """This write limited to the episodes in ``kept``."""
        mask = np.isin(self.episodes, kept)
        at = self.at[mask] if isinstance(self.at, np.ndarray) else self.at
        return Write(self.kind, self.name, self.episodes[mask], self.values[mask], at)


@dataclass(frozen=True)
class Edit:
    """One logged edit: its slots, their generations and the odd revisions it gave them."""

    slots: np.ndarray
    generations: np.ndarray
    revisions: np.ndarray
    writes: list[Write]


def encode(edit: Edit, schema: Schema) -> bytes:
    """The log record of ``edit`` (each write's values as its field's dtype in ``schema``). A
    ``steps`` write keeps one value per (episode, timestep), the last given, as applying it
    does."""
    header: dict = {
        "slots": edit.slots.tolist(),
        "generations": edit.generations.tolist(),
        "revisions": edit.revisions.tolist(),
        "writes": [],
    }
    raw: list[bytes] = []
    for write in edit.writes:
        episodes, values, at = write.episodes, write.values, write.at
        if write.kind == "steps":
            assert isinstance(at, np.ndarray), "a steps write has one timestep per episode"
            pairs = episodes.astype(np.int64) * (1 << 32) + at.astype(np.int64)
            last = len(pairs) - 1 - np.unique(pairs[::-1], return_index=True)[1]
            episodes, values, at = episodes[last], values[last], at[last]
            raw.append(np.ascontiguousarray(at, "<i8").tobytes())
        entry = {"kind": write.kind, "field": write.name, "count": len(episodes)}
        if write.kind == "rows":
            entry.update(t0=int(at), steps=write.steps)
        header["writes"].append(entry)
        raw.append(np.ascontiguousarray(episodes, "<i8").tobytes())
        fields = schema.meta_fields if write.kind == "meta" else schema.fields
        raw.append(np.ascontiguousarray(values, fields[write.name].dtype).tobytes())
    document = json.dumps(header).encode()
    payload = b"".join([_HEADER_SIZE.pack(len(document)), document, *raw])
    return _RECORD.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def bound(schema: Schema) -> int:
    """The most bytes one valid record holds: every step of every field of every slot, every
    meta value, and for each (an edit of single steps) its episode and timestep."""
    episodes, steps = schema.max_episodes, schema.max_timesteps
    rows = episodes * steps * sum(f.step_nbytes + 16 for f in schema.fields.values())
    meta = episodes * sum(f.step_nbytes + 8 for f in schema.meta_fields.values())
    return _RECORD.size + _HEADER_SIZE.size + MAX_DOCUMENT_BYTES + rows + meta + 8 * episodes


def parse(pieces: Iterable[bytes], schema: Schema) -> tuple[list[Edit], str | None]:
    """The whole records of a log given in pieces, and what is damaged (None: nothing; a record
    torn by a kill mid-append ends the log and is not damage). Every value is checked against
    ``schema`` before it is kept, and no record larger than ``bound`` is read."""
    limit, held, pos = bound(schema), bytearray(), 0
    edits: list[Edit] = []
    stream = iter(pieces)

    def fill(n: int) -> bool:
        while len(held) < n:
            piece = next(stream, None)
            if piece is None:
                return False
            held.extend(piece)
        return True

    try:
        while fill(_RECORD.size):
            magic, size, crc = _RECORD.unpack_from(held)
            if magic != _MAGIC:
                return edits, f"record at byte {pos:,}: no edit record ({bytes(magic)!r})"
            if size > limit:
                return edits, f"record at byte {pos:,}: {size:,} bytes, more than an edit of this buffer holds"
            if not fill(_RECORD.size + size):
                return edits, None  # torn by a kill mid-append: never applied
            payload = bytes(held[_RECORD.size : _RECORD.size + size])
            if zlib.crc32(payload) != crc:
                return edits, f"record at byte {pos:,}: checksum mismatch"
            try:
                edits.append(_decode(payload, schema))
            except (ValueError, TypeError, KeyError, RecursionError) as e:
                return edits, f"record at byte {pos:,}: {e}"
            del held[: _RECORD.size + size]
            pos += _RECORD.size + size
    except BufferDamagedError as e:
        return edits, str(e)
    return edits, None


def _decode(payload: bytes, schema: Schema) -> Edit:
    """The edit of one record's payload (its checksum checked), every value checked."""
    (length,) = _HEADER_SIZE.unpack_from(payload)
    header = json.loads(payload[_HEADER_SIZE.size : _HEADER_SIZE.size + length])
    if not isinstance(header, dict) or not isinstance(header.get("writes"), list):
        raise ValueError("the header is not a JSON object with writes")
    slots, generations, revisions = (_ints(header.get(k), k) for k in ("slots", "generations", "revisions"))
    if not len(slots) == len(generations) == len(revisions):
        raise ValueError("slots, generations and revisions of unequal lengths")
    _check_slots(slots, schema.max_episodes, "slots")
    pos, writes = _HEADER_SIZE.size + length, []
    for entry in header["writes"]:
        kind, name, count = entry["kind"], entry["field"], entry["count"]
        if kind not in KINDS:
            raise ValueError(f"a write of kind {kind!r}")
        fields = schema.meta_fields if kind == "meta" else schema.fields
        if not isinstance(name, str) or name not in fields:
            raise ValueError(f"a {kind} write of unknown field {name!r}")
        f: Field = fields[name]
        if not isinstance(count, int) or not 0 <= count <= len(payload):
            raise ValueError(f"a write of {count!r} episodes")
        at: int | np.ndarray = 0
        if kind == "steps":
            at, pos = _array(payload, pos, count, np.dtype("<i8"), ()), pos + 8 * count
            if ((at < 0) | (at >= schema.max_timesteps)).any():
                raise ValueError(f"field {name!r}: a timestep outside [0, {schema.max_timesteps})")
        episodes, pos = _array(payload, pos, count, np.dtype("<i8"), ()), pos + 8 * count
        _check_slots(episodes, schema.max_episodes, f"field {name!r}'s episodes")
        if not np.isin(episodes, slots).all():
            raise ValueError(f"field {name!r}: episodes that are not the edit's slots")
        shape = f.shape
        if kind == "rows":
            t0, steps = entry["t0"], entry["steps"]
            if not (isinstance(t0, int) and isinstance(steps, int) and 0 <= t0 and 1 <= steps <= schema.max_timesteps):
                raise ValueError(f"field {name!r}: rows of steps {t0!r} + {steps!r}")
            if t0 + steps > schema.max_timesteps:
                raise ValueError(f"field {name!r}: rows past max_timesteps ({schema.max_timesteps})")
            at, shape = t0, (steps, *f.shape)
        values = _array(payload, pos, count, f.dtype, shape)
        pos += values.nbytes
        writes.append(Write(kind, name, episodes, values, at))
    if pos != len(payload):
        raise ValueError(f"{len(payload) - pos:,} bytes past the last write")
    return Edit(slots, generations, revisions, writes)


def _ints(values: object, name: str) -> np.ndarray:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} is not a list of ints")
    return np.array(values, np.int64) if values else np.zeros(0, np.int64)


def _check_slots(slots: np.ndarray, max_episodes: int, what: str) -> None:
    if len(slots) and (slots.min() < 0 or slots.max() >= max_episodes):
        raise ValueError(f"{what} outside [0, {max_episodes})")


def _array(payload: bytes, pos: int, count: int, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """``count`` values of ``dtype`` and ``shape`` at ``pos`` of ``payload``, copied."""
    nbytes = count * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if pos + nbytes > len(payload):
        raise ValueError(f"a write of {nbytes:,} bytes past the record's end")
    return np.frombuffer(payload, dtype, count * int(np.prod(shape, dtype=np.int64)), pos).reshape(count, *shape).copy()
