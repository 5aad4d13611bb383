"""Per-episode statistics sketches, written at commit time and merged on demand.

For every numeric field with at most ``MAX_FEATURES`` values per step (states, actions,
rewards; not images), each committed episode gets one side blob ``replaybuf/sketches/<slot>``: per
feature, count, sum, sum of squares, min, max and an Apache DataSketches KLL quantile sketch
(``kll_floats_sketch``, k = ``KLL_K``: normalized rank error about 1.3 % for a merge of any
number of sketches, measured ~0.35 % on 1e6 floats). The blob names the slot's generation, so a
blob outliving its episode (slot reused, writer killed before the blob was written) is ignored.
``summary()`` of any set of episodes, or of a ``ConcatReplayBuffer``, merges the blobs without
reading data; an episode without a valid blob (written step by step, by an older release, or
shorter than ``KLL_K`` steps) is read and sketched on the fly, all such episodes together.

Episodes shorter than ``KLL_K`` steps get no blob: a KLL sketch of fewer than k values holds
every value, so the blob would be larger than the episode's data (a 20-step episode of 39
floats: a 7.9 kB blob for 3.1 kB of data) and would cost more than the rest of its commit
(~270 us to encode and a file to write, against ~300 us for the whole ``store_episode``).

Blob layout (no pickle): ``b"RBSK"``, a little-endian uint32 header length, a JSON header
``{"generation", "length", "fields": {name: {"count", "sum", "sumsq", "min", "max", "kll"}}}``
(``kll``: byte lengths of the per-feature sketches) and the sketches' bytes, in order.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .consistency import read_episodes_consistent

if TYPE_CHECKING:  # torch loads with the first summary, not at commit time
    import torch

MAX_FEATURES = 64
KLL_K = 200
# missing episodes are sketched together in groups of this many (bounds the float64 copy)
_SKETCH_GROUP = 4096
PREFIX = "replaybuf/sketches/"
_MAGIC = b"RBSK"


def _kll():
    try:
        from datasketches import kll_floats_sketch
    except ImportError as error:
        raise ImportError("statistics sketches need Apache DataSketches: pip install 'replaybuf[sketches]'") from error
    return kll_floats_sketch


def available() -> bool:
    """Whether Apache DataSketches is installed (without it no blob is written)."""
    try:
        import datasketches  # noqa: F401
    except ImportError:
        return False
    return True


def sketched_fields(schema: Any) -> list[str]:
    """The fields that get sketches: numeric, at most ``MAX_FEATURES`` values per step."""
    return [
        name
        for name, field in schema.fields.items()
        if field.dtype.kind in "fiub" and int(np.prod(field.shape, dtype=np.int64)) <= MAX_FEATURES
    ]


def _field_sketch(values: np.ndarray) -> tuple[dict[str, Any], list[bytes]]:
    """Moments and per-feature KLL bytes of ``values`` (steps, features)."""
    values = values.astype(np.float64)
    sketch = _kll()
    blobs = []
    for feature in range(values.shape[1]):
        kll = sketch(KLL_K)
        kll.update(values[:, feature].astype(np.float32))
        blobs.append(kll.serialize())
    header = {
        "count": int(values.shape[0]),
        "sum": values.sum(axis=0).tolist(),
        "sumsq": np.square(values).sum(axis=0).tolist(),
        "min": values.min(axis=0).tolist(),
        "max": values.max(axis=0).tolist(),
        "kll": [len(b) for b in blobs],
    }
    return header, blobs


def encode(generation: int, episode: dict[str, np.ndarray]) -> bytes:
    """The blob of one episode: ``episode`` maps field -> (T, *shape) committed steps."""
    fields, payload = {}, []
    for name, steps in episode.items():
        fields[name], blobs = _field_sketch(np.asarray(steps).reshape(len(steps), -1))
        payload += blobs
    length = len(next(iter(episode.values()))) if episode else 0
    header = json.dumps({"generation": int(generation), "length": length, "fields": fields}).encode()
    return _MAGIC + struct.pack("<I", len(header)) + header + b"".join(payload)


def decode(blob: bytes) -> dict[str, Any]:
    """The header of a blob with each field's ``kll`` replaced by its sketches' bytes."""
    if blob[:4] != _MAGIC:
        raise ValueError(f"not a replaybuf sketch blob (starts with {blob[:4]!r})")
    (size,) = struct.unpack("<I", blob[4:8])
    header = json.loads(blob[8 : 8 + size])
    position = 8 + size
    for field in header["fields"].values():
        parts = []
        for length in field["kll"]:
            parts.append(blob[position : position + length])
            position += length
        field["kll"] = parts
    return header


def record(buffer: Any, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
    """Write the sketch blob of each just-committed episode in ``slots``: ``rows`` maps field ->
    (len(slots), T, *shape), the episodes' committed steps (all ``T`` of them). Call it after
    the episodes are published (their generations are read from the buffer)."""
    names = [n for n in sketched_fields(buffer.schema) if n in rows]
    if not names or not available() or rows[names[0]].shape[1] < KLL_K:
        return  # no blob: summary() sketches these episodes from their data when asked
    for row, slot in enumerate(np.asarray(slots).tolist()):
        generation = int(buffer._meta["_generation"][slot])
        try:
            buffer.storage.write_blob(f"{PREFIX}{slot}", encode(generation, {n: rows[n][row] for n in names}))
        except OSError as error:
            # the episode is committed already; summary() sketches it from its data instead
            warnings.warn(f"could not write the statistics sketch of slot {slot}: {error}", stacklevel=3)


@dataclass
class FieldSummary:
    """Merged statistics of one field, per feature (shape: the field's)."""

    count: int
    mean: torch.Tensor
    std: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    sketches: list[Any]
    shape: tuple[int, ...]

    def quantile(self, q: float | Sequence[float]) -> torch.Tensor:
        """Quantiles per feature (shape ``(len(q), *shape)``, or ``shape`` for one ``q``),
        within the KLL sketch's rank error (``rank_error``)."""
        qs = np.atleast_1d(np.asarray(q, np.float64))
        if ((qs < 0) | (qs > 1)).any():
            raise ValueError(f"quantile: q must be in [0, 1], got {q!r}")
        values = np.array([[s.get_quantile(float(x)) for s in self.sketches] for x in qs], np.float32)
        values = values.reshape(len(qs), *self.shape)
        import torch

        return torch.from_numpy(values[0] if np.ndim(q) == 0 else values)

    @property
    def rank_error(self) -> float:
        """The sketches' stated normalized rank error (one-sided quantile queries)."""
        return max(s.normalized_rank_error(False) for s in self.sketches)


class _Accumulator:
    def __init__(self, features: int):
        sketch = _kll()
        self.count, self.sum, self.sumsq = 0, np.zeros(features), np.zeros(features)
        self.min, self.max = np.full(features, np.inf), np.full(features, -np.inf)
        self.sketches = [sketch(KLL_K) for _ in range(features)]

    def add(self, field: dict[str, Any]) -> None:
        sketch = _kll()
        self.count += field["count"]
        self.sum += field["sum"]
        self.sumsq += field["sumsq"]
        self.min = np.minimum(self.min, field["min"])
        self.max = np.maximum(self.max, field["max"])
        for merged, part in zip(self.sketches, field["kll"]):
            merged.merge(sketch.deserialize(part))

    def result(self, shape: tuple[int, ...]) -> FieldSummary:
        mean = self.sum / self.count
        std = np.sqrt(np.maximum(self.sumsq / self.count - mean**2, 0.0))

        def tensor(values: np.ndarray) -> torch.Tensor:
            import torch

            return torch.from_numpy(values.reshape(shape).astype(np.float32))

        return FieldSummary(
            self.count, tensor(mean), tensor(std), tensor(self.min), tensor(self.max), self.sketches, shape
        )


def _episode_headers(buffer: Any, slots: np.ndarray, names: list[str]) -> list[dict[str, Any]]:
    """The decoded blob of each slot; slots without a valid one are read and sketched now."""
    if hasattr(buffer, "buffers"):  # a ConcatReplayBuffer: each member's own blobs
        offsets = buffer.storage.offsets
        owner = np.searchsorted(offsets, slots, side="right") - 1
        return [
            header
            for k, member in enumerate(buffer.buffers)
            for header in _episode_headers(member, slots[owner == k] - offsets[k], names)
        ]
    headers, missing = [], []
    generations = buffer._meta["_generation"]
    for slot in slots.tolist():
        blob = buffer.storage.read_blob(f"{PREFIX}{slot}")
        header = decode(blob) if blob is not None else None
        if header is None or header["generation"] != generations[slot] or not set(names) <= set(header["fields"]):
            missing.append(slot)
        else:
            headers.append(header)
    for start in range(0, len(missing), _SKETCH_GROUP):
        got = read_episodes_consistent(buffer, missing[start : start + _SKETCH_GROUP], names, with_meta=False)
        steps = np.arange(got.data[names[0]].shape[1]) < got.lens[:, None]
        if steps.any():  # one header for the group: merging it equals merging one per episode
            headers.append(decode(encode(0, {n: got.data[n][steps] for n in names})))
    return headers


def summary(
    buffer: Any, fields: Sequence[str] | None = None, episodes: Sequence[int] | np.ndarray | None = None
) -> dict[str, FieldSummary]:
    """Merged statistics of ``fields`` (default: every sketched field) over ``episodes`` (slots;
    default: every committed episode) of a ReplayBuffer or ConcatReplayBuffer."""
    allowed = sketched_fields(buffer.schema)
    names = list(allowed) if fields is None else list(fields)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(
            f"summary: fields {unknown} have no sketches - sketched fields (numeric, at most "
            f"{MAX_FEATURES} values per step): {allowed}"
        )
    valid = np.asarray(buffer.valid_episodes(), np.int64)
    slots = valid if episodes is None else np.asarray(episodes, np.int64).reshape(-1)
    stray = sorted(set(slots.tolist()) - set(valid.tolist()))
    if stray:
        raise ValueError(f"summary: episodes {stray} hold no committed episode (committed: {valid.tolist()})")
    if len(slots) == 0:
        raise ValueError("summary: no episodes to summarize")
    shapes = {n: buffer.schema.fields[n].shape for n in names}
    totals = {n: _Accumulator(int(np.prod(shapes[n], dtype=np.int64))) for n in names}
    for header in _episode_headers(buffer, slots, names):
        for name in names:
            totals[name].add(header["fields"][name])
    return {n: totals[n].result(shapes[n]) for n in names}


@dataclass
class Normalizer:
    """``(x - shift) / scale``, and back with ``unnormalize``."""

    shift: torch.Tensor
    scale: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.shift.to(x.device)) / self.scale.to(x.device)

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.scale.to(y.device) + self.shift.to(y.device)


def normalizer(
    buffer: Any,
    field: str,
    kind: str = "meanstd",
    q: tuple[float, float] = (0.01, 0.99),
    episodes: Sequence[int] | np.ndarray | None = None,
    eps: float = 1e-8,
) -> Normalizer:
    """A normalizer of ``field`` from the sketches: ``'meanstd'`` (zero mean, unit std) or
    ``'quantile'`` (the quantiles ``q`` map to -1 and 1)."""
    if kind not in ("meanstd", "quantile"):
        raise ValueError(f"normalizer: kind must be 'meanstd' or 'quantile', got {kind!r}")
    stats = summary(buffer, [field], episodes)[field]
    if kind == "meanstd":
        return Normalizer(stats.mean, stats.std.clamp_min(eps))
    low, high = stats.quantile(list(q))
    return Normalizer((high + low) / 2, ((high - low) / 2).clamp_min(eps))
