"""The edit log: an in-place edit's writes, stored before any of them is applied.

An in-place edit of committed episodes (``update``, ``update_steps``, ``data[...] = ...``,
``store_datapoint``, meta values) is several writes: a field's rows of each episode, then the
next field's. A writer killed between two of them would leave one call's values half applied.
So ``Committer.edit`` first writes the whole edit as one checksummed record to ``KEY`` (in
place, ``Storage.write_record``: one write on local disk, one PUT remotely), then applies it,
then empties the record; a writable open finds the record of an edit a killed writer left
running and applies it again (every write sets values, so applying one twice changes
nothing), so each edit lands whole. A record torn by a kill was never applied: its slots are
marked as being edited only once it is written. One record at a time: an edit interrupted in
the process is finished before the next one is written.

A record: ``_RECORD`` (magic, payload size, crc32 of the payload), then the payload: the size
of a JSON header, the header (the slots, their generations and the odd ``_revision`` the edit
gives them, and each write's kind, field, count and steps), then each write's episodes (and
timesteps) as int64 and its values as raw bytes of the field's dtype. Bytes after the record
(an in-place write over a longer one, cut short before its truncation) are not read.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .schema import Field, Schema
from .storage import EDIT_KEY, LOG_PREFIX, MAX_DOCUMENT_BYTES, Storage

#: where the record is kept: beside the step log's records, erased with the buffer
KEY = EDIT_KEY
#: the step log's log main's first edit-log commit (8e0c9c1) appended its records to (records
#: back to back, the running edit's last), where a writer it ran may have left an edit running
LEGACY_LOG = "edit"
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

    def kept(self, generations: np.ndarray) -> np.ndarray:
        """The edit's slots that still hold the generations it edited (of ``generations``, every
        slot's)."""
        return self.slots[generations[self.slots] == self.generations]

    def running(self, generations: np.ndarray, revisions: np.ndarray) -> bool:
        """Whether the edit was running when its writer stopped, by every slot's ``generations``
        and ``revisions`` now: a kept slot holds the odd revision it gave them (a finished edit
        moved them all to a new even one; a refused one never marked them or left them odd
        with its record emptied)."""
        kept = self.kept(generations)
        return bool(len(kept)) and bool((revisions[kept] == self.revisions[np.isin(self.slots, kept)]).any())


def encode(edit: Edit, schema: Schema) -> bytearray:
    """The log record of ``edit`` (each write's values as its field's dtype in ``schema``),
    built in one buffer: the values are copied once. A ``steps`` write keeps one value per
    (episode, timestep), the last given, as applying it does; values equal for every episode
    (broadcast: ``update(None, reward=0.0)``) are stored once."""
    header: dict = {
        "slots": edit.slots.tolist(),
        "generations": edit.generations.tolist(),
        "revisions": edit.revisions.tolist(),
        "writes": [],
    }
    arrays: list[np.ndarray] = []
    for write in edit.writes:
        episodes, values, at = write.episodes, write.values, write.at
        if write.kind == "steps":
            assert isinstance(at, np.ndarray), "a steps write has one timestep per episode"
            pairs = episodes.astype(np.int64) * (1 << 32) + at.astype(np.int64)
            last = len(pairs) - 1 - np.unique(pairs[::-1], return_index=True)[1]
            episodes, values, at = episodes[last], values[last], at[last]
            arrays.append(np.asarray(at, "<i8"))
        entry = {"kind": write.kind, "field": write.name, "count": len(episodes)}
        if write.kind == "rows":
            entry.update(t0=int(at), steps=write.steps)
        fields = schema.meta_fields if write.kind == "meta" else schema.fields
        values = np.asarray(values, fields[write.name].dtype)
        if len(values) > 1 and values.strides[0] == 0:
            entry["same"], values = True, values[:1]
        header["writes"].append(entry)
        arrays += [np.asarray(episodes, "<i8"), values]
    document = json.dumps(header).encode()
    start = _RECORD.size + _HEADER_SIZE.size + len(document)
    record = bytearray(start + sum(array.nbytes for array in arrays))
    _HEADER_SIZE.pack_into(record, _RECORD.size, len(document))
    record[_RECORD.size + _HEADER_SIZE.size : start] = document
    for array in arrays:
        np.frombuffer(record, array.dtype, array.size, start).reshape(array.shape)[...] = array
        start += array.nbytes
    payload = memoryview(record)[_RECORD.size :]
    _RECORD.pack_into(record, 0, _MAGIC, len(payload), zlib.crc32(payload))
    payload.release()
    return record


def bound(schema: Schema) -> int:
    """The most bytes one valid record holds: every step of every field of every slot, every
    meta value, and for each (an edit of single steps) its episode and timestep."""
    episodes, steps = schema.max_episodes, schema.max_timesteps
    rows = episodes * steps * sum(f.step_nbytes + 16 for f in schema.fields.values())
    meta = episodes * sum(f.step_nbytes + 8 for f in schema.meta_fields.values())
    return _RECORD.size + _HEADER_SIZE.size + MAX_DOCUMENT_BYTES + rows + meta + 8 * episodes


def write(storage: Storage, record: bytes | bytearray) -> None:
    """Store ``record`` (``encode``) as the edit running; StorageError when it cannot be."""
    storage.write_record(KEY, memoryview(record))


def clear(storage: Storage) -> None:
    """Mark no edit running: the record emptied in place (no delete, so an edit costs two small
    writes of the log)."""
    storage.write_record(KEY, b"")


def set_aside(storage: Storage, schema: Schema) -> str:
    """Copy the log (a damaged record: the bytes ``read`` reads of it) to
    ``replaybuf/steplog-damaged-<UTC time>-<pid>/edit``, as a damaged step log is, for
    inspection; returns the copy's description."""
    raw = _record_bytes(storage, schema) or b""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    key = f"{LOG_PREFIX.rstrip('/')}-damaged-{stamp}-{os.getpid()}/edit"
    storage.write_blob(key, raw)
    return storage.describe_key(key)


def read(storage: Storage, schema: Schema) -> tuple[Edit | None, str | None]:
    """(the edit the log holds, else None; why a record it holds is not one, else None: cut
    short, which a kill mid-write leaves before the edit's slots are marked, or damaged).
    Every value is checked against ``schema`` before it is kept, and no more is read than the
    record says it holds, nor more than ``bound``: a planted or damaged log of any size (a
    sparse file of terabytes) costs no more."""
    raw = _record_bytes(storage, schema)
    if raw is not None and len(raw) == _RECORD.size:
        magic, size, _ = _RECORD.unpack(raw)
        if magic == _MAGIC and _RECORD.size + size > bound(schema):
            return None, f"a record of {_RECORD.size + size:,} bytes, more than any of this buffer ({bound(schema):,})"
    return parse(raw or b"", schema)


def _record_bytes(storage: Storage, schema: Schema) -> bytes | None:
    """The bytes of the log's record (None: no log): its magic, size and checksum, then as many
    bytes as that size says when it says at most ``bound``; only those first bytes otherwise
    (no record: another magic, or a size no record has)."""
    head = storage.read_blob_head(KEY, _RECORD.size)
    if head is None:
        return _legacy_record_bytes(storage, schema)
    if len(head) < _RECORD.size:
        return head
    magic, size, _ = _RECORD.unpack(head)
    if magic != _MAGIC or _RECORD.size + size > bound(schema):
        return head
    return storage.read_blob_head(KEY, _RECORD.size + size)


def _legacy_record_bytes(storage: Storage, schema: Schema) -> bytes | None:
    """The last record of the ``LEGACY_LOG`` a writer of main's first edit-log commit left (its
    bytes from there on where it is torn or damaged, for ``parse`` to name); None where there is
    none. Read as the step log is, in pieces, up to twice ``bound``."""
    if LEGACY_LOG not in storage.log_names():
        return None
    data = b""
    for piece in storage.log_pieces(LEGACY_LOG, 2 * bound(schema)):
        data += piece
        if len(data) > 2 * bound(schema):
            return data[: _RECORD.size]  # no record is that long: ``read`` names its size
    at = 0
    while len(data) - at >= _RECORD.size:
        magic, size, _ = _RECORD.unpack_from(data, at)
        end = at + _RECORD.size + size
        if magic != _MAGIC or end >= len(data):
            break
        at = end  # a finished edit's record, left beside the running one
    return data[at:]


def clear_legacy(storage: Storage) -> None:
    """Delete the ``LEGACY_LOG`` (once its edit was applied again, or none was running)."""
    if LEGACY_LOG in storage.log_names():
        storage.clear_log(LEGACY_LOG)


def parse(raw: bytes, schema: Schema) -> tuple[Edit | None, str | None]:
    """The edit of the record at the start of ``raw`` (as ``read``)."""
    if not raw:
        return None, None
    if len(raw) < _RECORD.size:
        return None, f"a record cut short ({len(raw)} bytes)"
    magic, size, crc = _RECORD.unpack_from(raw)
    if magic != _MAGIC:
        return None, f"no edit record ({bytes(magic)!r})"
    if _RECORD.size + size > len(raw):
        return None, f"a record cut short ({len(raw):,} of {_RECORD.size + size:,} bytes)"
    payload = raw[_RECORD.size : _RECORD.size + size]
    if zlib.crc32(payload) != crc:
        return None, "checksum mismatch"
    try:
        return _decode(payload, schema), None
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as e:  # OverflowError: an int past int64
        return None, str(e)


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
    if len(np.unique(slots)) != len(slots):  # each slot has one generation and revision (``Edit.running``)
        raise ValueError("a slot named twice")
    pos, writes = _HEADER_SIZE.size + length, []
    for entry in header["writes"]:
        kind, name, count = entry["kind"], entry["field"], entry["count"]
        if kind not in KINDS:
            raise ValueError(f"a write of kind {kind!r}")
        fields = schema.meta_fields if kind == "meta" else schema.fields
        if not isinstance(name, str) or name not in fields:
            raise ValueError(f"a {kind} write of unknown field {name!r}")
        f: Field = fields[name]
        if not _is_int(count) or not 0 <= count <= len(payload):
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
            if not (_is_int(t0) and _is_int(steps) and 0 <= t0 and 1 <= steps <= schema.max_timesteps):
                raise ValueError(f"field {name!r}: rows of steps {t0!r} + {steps!r}")
            if t0 + steps > schema.max_timesteps:
                raise ValueError(f"field {name!r}: rows past max_timesteps ({schema.max_timesteps})")
            at, shape = t0, (steps, *f.shape)
        same = entry.get("same", False)
        if not isinstance(same, bool) or (same and count < 2):
            raise ValueError(f"field {name!r}: same {same!r} for {count} episodes")
        values = _array(payload, pos, 1 if same else count, f.dtype, shape)
        pos += values.nbytes
        if same:
            values = np.broadcast_to(values, (count, *shape))
        writes.append(Write(kind, name, episodes, values, at))
    if pos != len(payload):
        raise ValueError(f"{len(payload) - pos:,} bytes past the last write")
    return Edit(slots, generations, revisions, writes)


def _is_int(value: object) -> bool:
    """Whether a JSON value is an integer (``true`` is not, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(values: object, name: str) -> np.ndarray:
    if not isinstance(values, list) or not all(_is_int(v) for v in values):
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
