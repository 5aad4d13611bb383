"""Episodes still being written: their rows in RAM, and the step log that makes them durable.

``store()`` copies a step into an ``EpisodeGroup`` (one row per episode of a batched group);
rows reach storage as chunk-aligned slabs once a write span fills and at commit. The step log
records each step as it is staged so a killed writer loses at most the steps it had not yet
flushed: on the next writable open the log is replayed and its episodes are committed,
truncated where the log ends.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .schema import Field

# write staged rows once a field's span holds about this many bytes per episode (several chunks
# per request, encoded in parallel) rather than one storage request per chunk
WRITE_SPAN_BYTES = 1 << 20

_RECORD = struct.Struct("<cI")
HEADER, STEPS, META, TRUNCATE = b"H", b"S", b"M", b"T"


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
    _rows: dict[str, np.ndarray] = field(default_factory=dict)
    _row_start: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for name, f in self.fields.items():
            self._row_start[name] = 0
            self._rows[name] = self._fresh_rows(f)

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def _fresh_rows(self, f: Field) -> np.ndarray:
        shape = (self.batch_size, self.spans[f.name], *f.shape)
        return np.zeros(shape, f.dtype) if f.fill == 0 else np.full(shape, f.fill, dtype=f.dtype)

    def append(self, values: dict[str, np.ndarray]) -> list[tuple[str, int, np.ndarray]]:
        """Stage one step (each value shaped (batch, *shape)); return the spans that filled up."""
        full = []
        t = self.length
        for name, rows in self._rows.items():
            offset = t - self._row_start[name]
            if name in values:
                rows[:, offset] = values[name]
            if offset + 1 == rows.shape[1]:
                full.append((name, self._row_start[name], rows))
                self._rows[name] = self._fresh_rows(self.fields[name])
                self._row_start[name] = t + 1
        self.length += 1
        return full

    def set_step(self, name: str, row: int, t: int, value: np.ndarray) -> bool:
        """Overwrite a staged value; False when that step already left RAM."""
        offset = t - self._row_start[name]
        if not 0 <= offset < self._rows[name].shape[1] or t >= self.length:
            return False
        self._rows[name][row, offset] = value
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
        self._rows = {n: rows[:count] for n, rows in self._rows.items()}
        self.meta = {n: values[:count] for n, values in self.meta.items()}
        if self.previous_lens is not None:
            self.previous_lens = self.previous_lens[:count]
        return dropped

    def tail(self, time_chunks: dict[str, int], max_timesteps: int) -> list[tuple[str, int, np.ndarray]]:
        """The rows still in RAM, cut at the last chunk boundary past the episode's end."""
        out = []
        for name, rows in self._rows.items():
            start = self._row_start[name]
            used = self.length - start
            if used <= 0:
                continue
            chunk = time_chunks[name]
            end = min(-(-used // chunk) * chunk, max_timesteps - start)
            rows[:, used:end] = self._fresh_rows(self.fields[name])[:, used:end]  # steps a rewind left
            out.append((name, start, rows[:, :end]))
        return out


class StepLog:
    """Encodes and parses the step log: length-prefixed records ``H`` (header JSON), ``S``
    (one step of every field for every episode of the group, raw bytes), ``M`` (meta JSON) and
    ``T`` (steps cut back to a length).
    A torn last record, as a kill mid-write leaves, is dropped when parsing."""

    def __init__(self, fields: dict[str, Field]):
        self.fields = fields

    @staticmethod
    def record(kind: bytes, payload: bytes) -> bytes:
        return _RECORD.pack(kind, len(payload)) + payload

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

    def truncate(self, length: int) -> bytes:
        """A record cutting the logged steps back to ``length`` (``timestep_index = length``)."""
        return self.record(TRUNCATE, struct.pack("<I", length))

    def parse(self, data: bytes) -> tuple[dict, list[dict[str, np.ndarray]], dict[str, list]] | None:
        """(header, steps, meta) from a log's bytes, or None when it holds no header."""
        header, steps, meta, pos = None, [], {}, 0
        while pos + _RECORD.size <= len(data):
            kind, size = _RECORD.unpack_from(data, pos)
            payload = data[pos + _RECORD.size : pos + _RECORD.size + size]
            if len(payload) < size:
                break
            pos += _RECORD.size + size
            if kind == HEADER:
                header = json.loads(payload)
                meta.update(header["meta"])
            elif kind == META:
                meta.update(json.loads(payload))
            elif kind == STEPS and header is not None:
                steps.append(self._split_step(payload, len(header["slots"]), header["fields"]))
            elif kind == TRUNCATE:
                del steps[struct.unpack("<I", payload)[0] :]
        return None if header is None else (header, steps, meta)

    def _split_step(self, payload: bytes, batch: int, names: list[str]) -> dict[str, np.ndarray]:
        out, pos = {}, 0
        for name in names:
            f = self.fields[name]
            size = batch * f.step_nbytes
            out[name] = np.frombuffer(payload[pos : pos + size], dtype=f.dtype).reshape(batch, *f.shape)
            pos += size
        return out
