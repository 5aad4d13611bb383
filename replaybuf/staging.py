"""Episodes still being written: their rows in RAM, and the step log that makes them durable.

``store()`` copies a step into an ``EpisodeGroup`` (one row per episode of a batched group);
rows reach storage as chunk-aligned slabs once a write span fills and at commit. The step log
records each step as it is staged, and each edit of those steps and of their meta values
(``update``, ``data[...] = ...``, ``store_datapoint``, ``store_meta_datapoint``) before it is
applied, so a killed writer loses at most what it had not yet flushed: on the next writable
open the log is replayed and its episodes are committed, truncated where the log ends. Records
carry a crc32; a log damaged past its first records is recovered up to the damage and copied
aside (``commit.Committer.recover_step_log``).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .inputs import batch_value
from .schema import Field
from .storage import BufferDamagedError, document_limit

# write staged rows once a field's span holds about this many bytes per episode (several chunks
# per request, encoded in parallel) rather than one storage request per chunk
WRITE_SPAN_BYTES = 1 << 20

# a record is (kind, payload size, crc32 of kind, size and payload) then the payload; logs of
# the first release have no crc and upper-case kinds, so the first byte of a log says its format
_RECORD = struct.Struct("<cII")
_LEGACY_RECORD = struct.Struct("<cI")
HEADER, STEPS, META, TRUNCATE, EDIT = b"h", b"s", b"m", b"t", b"e"
# an edit record holds parts, each (field number, row of the group, first step, steps) then the
# field's values of those steps of that row; a log without edits is read as before they existed
_EDIT_PART = struct.Struct("<HIII")
_LEGACY_KINDS = {b"H": HEADER, b"S": STEPS, b"M": META, b"T": TRUNCATE}


def write_span(field: Field, time_chunk: int, max_timesteps: int) -> int:
    """Timesteps staged per field before a slab write: a whole number of chunks."""
    chunks = max(1, WRITE_SPAN_BYTES // max(field.step_nbytes * time_chunk, 1))
    return min(chunks * time_chunk, -(-max_timesteps // time_chunk) * time_chunk)


@dataclass
class EpisodeGroup:
    """The RAM rows of ``len(slots)`` episodes written in lockstep."""

    slots: np.ndarray
    fields: dict[str, Field]
    spans: dict[str, int]
    generation_base: int
    length: int = 0
    meta: dict[str, np.ndarray] = field(default_factory=dict)
    invalidated: bool = False
    previous_lens: np.ndarray | None = None
    # the span of each field being filled, allocated when a step first goes into it (None:
    # not yet; a whole span given at once is written from the caller's array, never staged)
    _rows: dict[str, np.ndarray | None] = field(default_factory=dict)
    _row_start: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for name in self.fields:
            self._row_start[name] = 0
            self._rows[name] = None

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def _span_rows(self, name: str) -> np.ndarray:
        rows = self._rows[name]
        if rows is None:
            rows = self._rows[name] = self._fresh_rows(self.fields[name])
        return rows

    def _fresh_rows(self, f: Field) -> np.ndarray:
        shape = (self.batch_size, self.spans[f.name], *f.shape)
        return np.zeros(shape, f.dtype) if f.fill == 0 else np.full(shape, f.fill, dtype=f.dtype)

    def append(self, values: dict[str, np.ndarray]) -> list[tuple[str, int, np.ndarray]]:
        """Stage one step (each value shaped (batch, *shape)); return the spans that filled up."""
        return self.extend({n: v[:, None] for n, v in values.items()}, 1)

    def extend(self, values: dict[str, np.ndarray], steps: int) -> list[tuple[str, int, np.ndarray]]:
        """Stage ``steps`` steps (each value shaped (batch, steps, *shape); a field left out keeps
        its default); return the spans that filled up, in order."""
        full = []
        for name in self._rows:
            done, width, given = 0, self.spans[name], values.get(name)
            while done < steps:
                start = self._row_start[name]
                offset = self.length + done - start
                n = min(steps - done, width - offset)
                if given is not None and offset == 0 and n == width and given.dtype == self.fields[name].dtype:
                    rows = given[:, done : done + n]  # a whole span given: written as it is, not copied
                else:
                    rows = self._span_rows(name)
                    if given is not None:
                        rows[:, offset : offset + n] = given[:, done : done + n]
                done += n
                if offset + n == width:
                    full.append((name, start, rows))
                    self._rows[name] = None
                    self._row_start[name] = start + width
        self.length += steps
        return full

    def unappend(self, filled: list[tuple[str, int, np.ndarray]]) -> None:
        """Take back the last ``append`` (its write to storage or to the step log failed), given
        the spans it returned: they are staged again (copied: a span may view the caller's
        values), and the next step takes the place of the one taken back."""
        for name, start, rows in filled:
            self._rows[name], self._row_start[name] = np.array(rows), start
        self.length -= 1

    def checkpoint(self) -> tuple[int, dict[str, np.ndarray | None], dict[str, int]]:
        """What ``restore`` takes the group back to: an ``append`` interrupted part way (a
        KeyboardInterrupt) may have moved some fields' spans on and not others."""
        return self.length, dict(self._rows), dict(self._row_start)

    def restore(self, checkpoint: tuple[int, dict[str, np.ndarray | None], dict[str, int]]) -> None:
        """Take the group back to ``checkpoint``: the steps staged since are gone (their values
        past ``length`` in a span are overwritten by the next steps)."""
        self.length, rows, starts = checkpoint
        self._rows, self._row_start = dict(rows), dict(starts)

    def staged(self, name: str) -> tuple[int, np.ndarray]:
        """(first step, rows (batch, steps, *shape)) of field ``name``'s steps still in RAM:
        those from the first step up to ``length`` are not in storage yet."""
        start, rows = self._row_start[name], self._rows[name]
        if rows is None:
            return start, np.zeros((self.batch_size, 0, *self.fields[name].shape), self.fields[name].dtype)
        return start, rows[:, : max(self.length - start, 0)]

    def holds(self, name: str, t: int) -> bool:
        """Whether step ``t`` of field ``name`` is staged in RAM (not yet written to storage)."""
        return 0 <= t - self._row_start[name] < self.spans[name] and t < self.length

    def set_step(self, name: str, row: int, t: int, value: np.ndarray) -> bool:
        """Overwrite a staged value; False when that step already left RAM."""
        if not self.holds(name, t):
            return False
        self._span_rows(name)[row, t - self._row_start[name]] = value
        return True

    def rewind(self, t: int, read_back: Callable[[str, int, int], np.ndarray]) -> None:
        """Move the episode's end back to step ``t`` (< length). The steps after keep their values
        until stored again, as the seed keeps them; a span that already left RAM is read back
        with ``read_back(name, t0, t1)``."""
        for name, f in self.fields.items():
            if t < self._row_start[name]:
                start = t // self.spans[name] * self.spans[name]  # spans start at multiples of span
                end = min(start + self.spans[name], self.length)
                rows = self._fresh_rows(f)
                rows[:, : end - start] = read_back(name, start, end)
                self._rows[name], self._row_start[name] = rows, start
        if self.previous_lens is not None:  # steps up to the old end are in storage: clear them at commit
            self.previous_lens = np.maximum(self.previous_lens, self.length)
        self.length = t

    def keep_first(self, count: int) -> np.ndarray:
        """Shrink the group to its first ``count`` episodes; return the slots dropped."""
        dropped = self.slots[count:]
        self.slots = self.slots[:count]
        self._rows = {n: None if rows is None else rows[:count] for n, rows in self._rows.items()}
        self.meta = {n: values[:count] for n, values in self.meta.items()}
        if self.previous_lens is not None:
            self.previous_lens = self.previous_lens[:count]
        return dropped

    def tail(self, time_chunks: dict[str, int], max_timesteps: int) -> list[tuple[str, int, np.ndarray]]:
        """The rows still in RAM, cut at the last chunk boundary past the episode's end."""
        out = []
        for name in self._rows:
            start = self._row_start[name]
            used = self.length - start
            if used <= 0:
                continue
            rows = self._span_rows(name)
            chunk = time_chunks[name]
            end = min(-(-used // chunk) * chunk, max_timesteps - start)
            rows[:, used:end] = self._fresh_rows(self.fields[name])[:, used:end]  # steps a rewind left
            out.append((name, start, rows[:, :end]))
        return out


@dataclass
class ParsedLog:
    """What a step log holds: its header, the steps (edits applied) and meta values of its valid
    prefix, where that prefix ends (``end``, bytes) and what is wrong with the rest (None when
    nothing is: a torn last record is a kill's normal residue, not damage)."""

    header: dict | None = None
    steps: list[dict[str, np.ndarray]] = field(default_factory=list)
    meta: dict[str, np.ndarray] = field(default_factory=dict)
    damage: str | None = None
    end: int = 0


class _Stream:
    """The bytes of a log given in pieces, taken in order: no more is held than the record
    being read and the rest of the piece it came in, whatever the log's size."""

    def __init__(self, pieces: Iterable[bytes]):
        self._pieces = iter(pieces)
        self._held = bytearray()
        self.pos = 0  # the log's offset of the next byte taken

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer where the log ends first), left to be taken."""
        while len(self._held) < n:
            piece = next(self._pieces, None)
            if piece is None:
                break
            self._held += piece
        return bytes(self._held[:n])

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer where the log ends first)."""
        out = self.peek(n)
        del self._held[:n]  # a bytearray drops its front without moving the rest
        self.pos += len(out)
        return out


class StepLog:
    """Encodes and parses the step log: checksummed, length-prefixed records ``h`` (header
    JSON), ``s`` (one step of every field for every episode of the group, raw bytes), ``m``
    (meta JSON), ``t`` (steps cut back to a length, ``timestep_index = n``) and ``e`` (one
    edit call's new values of logged steps: parts of one field and row each, ``_EDIT_PART``).
    An edit is one record so that replay applies it whole or, torn by a kill, not at all."""

    def __init__(self, fields: dict[str, Field], meta_fields: dict[str, Field]):
        self.fields = fields
        self.meta_fields = meta_fields

    @staticmethod
    def record(kind: bytes, payload: bytes) -> bytes:
        prefix = _LEGACY_RECORD.pack(kind, len(payload))
        return _RECORD.pack(kind, len(payload), zlib.crc32(payload, zlib.crc32(prefix))) + payload

    def header(self, slots: np.ndarray, generation_base: int, meta: dict[str, np.ndarray]) -> bytes:
        doc = {
            "slots": [int(s) for s in slots],
            "generation_base": generation_base,
            "fields": list(self.fields),
            "meta": {k: np.asarray(v).tolist() for k, v in meta.items()},
        }
        return self.record(HEADER, json.dumps(doc).encode())

    def steps(self, values: dict[str, np.ndarray]) -> bytes:
        return self.record(STEPS, b"".join(np.ascontiguousarray(values[n]).tobytes() for n in self.fields))

    def meta(self, meta: dict[str, np.ndarray]) -> bytes:
        return self.record(META, json.dumps({k: np.asarray(v).tolist() for k, v in meta.items()}).encode())

    def edit(self, parts: list[tuple[str, int, int, np.ndarray]]) -> bytes:
        """A record of new values of logged steps: ``parts`` are (field, row of the group, first
        step, values (steps, *shape)), each (field, row) at most once."""
        numbers = {name: i for i, name in enumerate(self.fields)}
        return self.record(
            EDIT,
            b"".join(
                _EDIT_PART.pack(numbers[name], row, t0, len(values)) + np.ascontiguousarray(values).tobytes()
                for name, row, t0, values in parts
            ),
        )

    def _records(self, stream: _Stream, log: ParsedLog) -> Iterator[tuple[int, bytes, bytes]]:
        """(offset, kind, payload) of every whole record, ``log`` holding what was parsed so
        far. Each record's size is checked (``_refused_size``) before its payload is read,
        so a damaged size never asks for more than a valid record holds; a record cut short
        with a valid size ends the log (a kill mid-append). Raises ValueError at a damaged
        record."""
        legacy = stream.peek(1) in _LEGACY_KINDS
        layout = _LEGACY_RECORD if legacy else _RECORD
        while True:
            pos = stream.pos
            prefix = stream.take(layout.size)
            if len(prefix) < layout.size:
                return  # the end, or a record prefix torn by a kill
            if legacy:
                kind, size = layout.unpack(prefix)
                kind = _LEGACY_KINDS.get(kind, b"?")
            else:
                kind, size, crc = layout.unpack(prefix)
            if kind not in (HEADER, STEPS, META, TRUNCATE, EDIT):
                raise ValueError(f"record at byte {pos:,}: unknown kind {kind!r}")
            why = self._refused_size(kind, size, log.header, len(log.steps))
            if why is not None:
                raise ValueError(f"record at byte {pos:,}: {why}; the log from there on is dropped")
            payload = stream.take(size)
            if len(payload) < size:
                return  # torn by a kill mid-append: not damage
            if not legacy and zlib.crc32(payload, zlib.crc32(prefix[: _LEGACY_RECORD.size])) != crc:
                raise ValueError(f"record at byte {pos:,}: checksum mismatch")
            yield pos, kind, payload

    def _step_nbytes(self, header: dict) -> int:
        return len(header["slots"]) * sum(f.step_nbytes for f in self.fields.values())

    def _edit_nbytes(self, batch: int, steps: int) -> int:
        """The most bytes an edit record of a group of ``batch`` episodes holding ``steps`` steps
        may hold: every step of every field of every row, each (field, row) one part."""
        return batch * (steps * sum(f.step_nbytes for f in self.fields.values()) + len(self.fields) * _EDIT_PART.size)

    def _refused_size(self, kind: bytes, size: int, header: dict | None, steps: int) -> str | None:
        """Why no writer wrote a record of ``kind`` and ``size`` after ``header`` and ``steps``
        logged steps, or None when one may have: a log starts with a header, a step's size is
        fixed by it, a truncate's is 4, an edit's is at most every logged step of every row,
        and a header or meta record (JSON) is a metadata object (``MAX_DOCUMENT_BYTES``)."""
        if kind != HEADER and header is None:
            return "the log does not start with a header"
        if kind == TRUNCATE and size != 4:
            return f"a truncate record of {size:,} bytes, expected 4"
        if kind in (STEPS, EDIT) and header is not None and header.get("fields") != list(self.fields):
            return f"the log holds fields {header.get('fields')}, the buffer {list(self.fields)}"
        if kind == STEPS and header is not None and size != self._step_nbytes(header):
            return f"a step record of {size:,} bytes, expected {self._step_nbytes(header):,}"
        if kind == EDIT and header is not None:
            most = self._edit_nbytes(len(header["slots"]), steps)
            if not _EDIT_PART.size <= size <= most:
                return f"an edit record of {size:,} bytes, expected {_EDIT_PART.size} to {most:,} after {steps} steps"
        if kind in (HEADER, META) and size > document_limit():
            return f"a {'header' if kind == HEADER else 'meta'} record of {size:,} bytes, over {document_limit():,}"
        return None

    def record_bound(self, header: dict | None, max_steps: int = 0) -> int:
        """The most bytes one record after ``header`` may hold (a header or meta document, a step,
        or an edit of up to ``max_steps`` steps): what a valid log can hold past the end of its
        valid prefix."""
        if header is None:
            return _RECORD.size + document_limit()
        edit = self._edit_nbytes(len(header["slots"]), max_steps)
        return _RECORD.size + max(document_limit(), self._step_nbytes(header), edit)

    def segment_bound(self, max_episodes: int, max_timesteps: int) -> int:
        """The most bytes one append of a writer holds without a rewind: a header, a meta record
        and ``max_timesteps`` steps of ``max_episodes`` episodes (the largest group), or one
        edit of those steps and a meta record (an edit is appended on its own: ``Committer.log_edit``)."""
        step = _RECORD.size + max_episodes * sum(f.step_nbytes for f in self.fields.values())
        edit = self.record_bound(None) + _RECORD.size + self._edit_nbytes(max_episodes, max_timesteps)
        return max(2 * self.record_bound(None) + max_timesteps * step, edit)

    def truncate(self, length: int) -> bytes:
        """A record cutting the logged steps back to ``length`` (``timestep_index = length``)."""
        return self.record(TRUNCATE, struct.pack("<I", length))

    def parse(
        self, pieces: bytes | Iterable[bytes], max_steps: int | None = None, max_batch: int | None = None
    ) -> ParsedLog:
        """The log's valid prefix, and a description of the first damaged record if any. The
        log may come in pieces (``Storage.log_pieces``): it is never held whole. A header of
        more slots than ``max_batch`` (the buffer's ``max_episodes``) or more steps than
        ``max_steps`` (its ``max_timesteps``: no writer stores more) is damage, so what is kept
        is bounded too; so is a piece the storage refused by its size (BufferDamagedError)."""
        log = ParsedLog()
        stream = _Stream([pieces] if isinstance(pieces, bytes) else pieces)
        try:
            for pos, kind, payload in self._records(stream, log):
                try:
                    if kind == HEADER:
                        header = json.loads(payload)
                        if not isinstance(header, dict) or not isinstance(header.get("slots"), list):
                            raise ValueError("the header is not a JSON object with slots")
                        if max_batch is not None and len(header["slots"]) > max_batch:
                            raise ValueError(f"{len(header['slots']):,} slots, more than max_episodes ({max_batch})")
                        # a header starts a group: steps before it are another group's,
                        # left by an open of this process that closed with its episode unended
                        log.header, log.steps = header, []
                        log.meta = self._meta_values(header.get("meta"), header)
                    elif log.header is None:
                        raise ValueError("the log does not start with a header")
                    elif kind == META:
                        log.meta.update(self._meta_values(json.loads(payload), log.header))
                    elif kind == TRUNCATE:
                        del log.steps[struct.unpack("<I", payload)[0] :]
                    elif kind == EDIT:
                        self._apply_edit(payload, log)
                    elif max_steps is not None and len(log.steps) >= max_steps:
                        raise ValueError(f"more than max_timesteps ({max_steps}) steps")
                    else:
                        log.steps.append(self._split_step(payload, log.header))
                except (ValueError, TypeError, KeyError, RecursionError) as e:  # RecursionError: JSON nested too deep
                    raise ValueError(f"record at byte {pos:,}: {e}") from None
                log.end = stream.pos
        except (ValueError, BufferDamagedError) as e:
            log.damage = str(e)
        return log

    def _meta_values(self, meta: object, header: dict) -> dict[str, np.ndarray]:
        """Meta values of a header or meta record, checked as ``store_meta_batch`` checks them."""
        if not isinstance(meta, dict):
            raise ValueError(f"meta values {meta!r} are not a JSON object")
        return {
            n: batch_value(v, self.meta_fields[n], len(header["slots"]))
            for n, v in meta.items()
            if n in self.meta_fields
        }

    def _apply_edit(self, payload: bytes, log: ParsedLog) -> None:
        """Put an edit record's values into the logged steps: every part is checked first, so a
        damaged record changes nothing."""
        assert log.header is not None, "checked by _refused_size"
        names, batch = list(self.fields), len(log.header["slots"])
        parts, pos = [], 0
        while pos < len(payload):
            if len(payload) - pos < _EDIT_PART.size:
                raise ValueError(f"an edit part cut short at its byte {pos:,}")
            number, row, t0, steps = _EDIT_PART.unpack_from(payload, pos)
            pos += _EDIT_PART.size
            if number >= len(names):
                raise ValueError(f"an edit of field number {number}, the log has {len(names)} fields")
            if row >= batch:
                raise ValueError(f"an edit of row {row}, the log's group has {batch} episode(s)")
            if steps < 1 or t0 + steps > len(log.steps):
                raise ValueError(f"an edit of steps {t0} to {t0 + steps - 1}, the log holds {len(log.steps)} steps")
            f = self.fields[names[number]]
            size = steps * f.step_nbytes
            if len(payload) - pos < size:
                raise ValueError(f"an edit of {f.name!r} holding {len(payload) - pos:,} bytes, expected {size:,}")
            values = np.frombuffer(payload[pos : pos + size], dtype=f.dtype).reshape(steps, *f.shape)
            parts.append((f.name, row, t0, values))
            pos += size
        for name, row, t0, values in parts:
            for t, value in enumerate(values, t0):
                step = log.steps[t]
                if not step[name].flags.writeable:  # a view of the record's bytes
                    step[name] = step[name].copy()
                step[name][row] = value

    def _split_step(self, payload: bytes, header: dict) -> dict[str, np.ndarray]:
        """The values of a step record (its size checked by ``_refused_size``)."""
        batch = len(header["slots"])
        out, pos = {}, 0
        for name, f in self.fields.items():
            size = batch * f.step_nbytes
            out[name] = np.frombuffer(payload[pos : pos + size], dtype=f.dtype).reshape(batch, *f.shape)
            pos += size
        return out
