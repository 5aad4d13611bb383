"""Per-episode statistics sketches, stored by a writer's ``stats()`` and merged on demand.

For every numeric field with at most ``MAX_FEATURES`` values per step (states, actions,
rewards; not images), an episode of at least ``KLL_K`` steps gets one side blob
``replaybuf/sketches/<slot>``: per feature, count, sum, the sum of squared deviations from the
episode mean (``m2``), min, max and an Apache DataSketches KLL quantile sketch
(``kll_floats_sketch``, or ``kll_doubles_sketch`` where float32 would round the field's values:
``sketch_kind``; k = ``KLL_K``: normalized rank error about 1.3 % for a merge of any
number of sketches, measured ~0.35 % on 1e6 floats). The blob names the slot's generation and
revision, so a blob outliving its episode (slot reused) or its values (edited in place:
``update``, ``store_datapoint``, ``data[...] = ...``) is ignored. ``buffer.stats()`` / ``summary()`` of any
set of episodes, or of a ``ConcatReplayBuffer``, merge the blobs without reading data; an
episode without a valid blob is read and sketched then, and a writable buffer stores its blob
(every sketched field) so that the next call reads no data. A read-only reader stores nothing.

Sketches are built there, not at commit: at commit, sketching a 1,000-step episode of 39
features cost ~2.7 ms of CPU (KLL updates, moments, the blob's JSON and file), four to five
times the rest of its ``store_episode`` (~0.6 ms), which made it 0.3x the seed's. The cost is
now paid once, by the first ``stats()`` (~2 ms per such episode), which reads the episodes
without a blob ``READ_BYTES`` at a time. A killed writer loses nothing: blobs are derived data.
Episodes shorter than ``KLL_K`` steps get no blob: a KLL sketch of fewer than k values holds
every value, so the blob would be larger than the episode's data (a 20-step episode of 39
floats: a 7.9 kB blob for 3.1 kB of data); they are sketched from their data at every
``stats()``.

Blob layout (no pickle): ``b"RBS2"``, the little-endian uint32 crc32 of all that follows it, a
little-endian uint32 header length, a JSON header ``{"generation", "revision", "length", "fields": {name:
{"count", "sum", "m2", "min", "max", "kll", "sketch"}}}`` (``kll``: byte lengths of the
per-feature sketches; ``sketch``: their ``sketch_kind``, ``kll_floats`` when absent) and the
sketches' bytes, in order. A blob that fails its crc32 (a flipped byte in a sum would otherwise
shift the mean silently), its layout, or a header that does not describe its episode (``_fits``), an older release's ``b"RBSK"`` blob (no checksum), or
one of float sketches for a field that now gets double ones, is ignored and its episode
sketched again.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .consistency import check_same_buffer, read_episodes_consistent
from .schema import Field
from .storage import SKETCHES_PREFIX
from .storage.base import Storage, StorageError

if TYPE_CHECKING:  # torch loads with the first summary, not at commit time
    import torch

    from .analysis import FieldStats

MAX_FEATURES = 64
KLL_K = 200
PREFIX = SKETCHES_PREFIX
# the most bytes of episodes read at once to sketch them from their data (RAM stays bounded
# when a first stats() sketches a whole buffer)
READ_BYTES = 64 << 20
_MAGIC = b"RBS2"


def sketch_kind(dtype: np.dtype) -> str:
    """The KLL sketch of a field of ``dtype``: ``kll_doubles`` where float32 would round its values
    (float64, and ints of 4 bytes or more: 1e300 would be inf, an int64 timestamp off by minutes),
    ``kll_floats`` (half the bytes) otherwise."""
    wide = dtype.itemsize >= 4 if dtype.kind in "iu" else dtype.kind == "f" and dtype.itemsize > 4
    return "kll_doubles" if wide else "kll_floats"


def _kll(kind: str = "kll_floats"):
    try:
        from datasketches import kll_doubles_sketch, kll_floats_sketch
    except ImportError as error:
        raise ImportError("statistics sketches need Apache DataSketches: pip install 'replaybuf[sketches]'") from error
    return kll_doubles_sketch if kind == "kll_doubles" else kll_floats_sketch


def available() -> bool:
    """Whether Apache DataSketches is installed (without it no blob is written)."""
    try:
        import datasketches  # noqa: F401
    except ImportError:
        return False
    return True


def chan_merge(
    count: int, mean: np.ndarray, m2: np.ndarray, other_count: int, other_mean: np.ndarray, other_m2: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, m2) of two parts merged with Chan's parallel update, per feature. Where a part's
    mean is infinite the update's difference is not finite: the mean is then the weighted sum
    (inf, or NaN for inf and -inf, as ``np.mean``) and m2 NaN (``np.std`` of values holding inf)."""
    total = count + other_count
    with np.errstate(invalid="ignore", over="ignore"):
        delta = other_mean - mean
        finite = np.isfinite(delta)
        merged_mean = np.where(
            finite, mean + delta * (other_count / total), (mean * count + other_mean * other_count) / total
        )
        merged_m2 = np.where(finite, m2 + other_m2 + delta * delta * (count * other_count / total), np.nan)
    return merged_mean, merged_m2


def episode_sum_dtype(dtype: np.dtype) -> type[np.number]:
    """The dtype of an episode's sum of ``dtype`` values, from the data or from sketches alike:
    int64 for ints and bools of up to 4 bytes (exact, and 2**32 values of any length fit),
    float64 for floats and for 8-byte ints (an int64 sum of nanosecond timestamps wraps past 5
    steps; float64 is what the sketches sum in)."""
    return np.int64 if dtype.kind in "iub" and dtype.itemsize <= 4 else np.float64


def sketched_fields(schema: Any) -> list[str]:
    """The fields that get sketches: numeric, at most ``MAX_FEATURES`` values per step."""
    return [
        name
        for name, field in schema.fields.items()
        if field.dtype.kind in "fiub" and int(np.prod(field.shape, dtype=np.int64)) <= MAX_FEATURES
    ]


def _kll_blobs(ordered: np.ndarray, kind: str) -> list[bytes]:
    """One serialized KLL sketch of ``kind`` per row of ``ordered`` (features, values)."""
    sketch = _kll(kind)
    blobs = []
    for column in np.asarray(ordered, np.float64 if kind == "kll_doubles" else np.float32):
        kll = sketch(KLL_K)
        kll.update(column)
        blobs.append(kll.serialize())
    return blobs


def _sorted_features(values: np.ndarray) -> np.ndarray:
    """``values`` (steps, features) as each feature's values in a sorted row: KLL's rank error
    holds for any order of the input and sorted values compact ~3x faster; moments along rows are
    faster too (1,000 steps x 32 float32 features: 1.6 -> 0.64 ms)."""
    return np.sort(np.asarray(values).T, axis=1)


def _field_moments(ordered: np.ndarray) -> dict[str, Any]:
    """Count, sum, m2, min and max per feature of ``ordered`` (``_sorted_features``); ``m2`` is
    the sum of squared deviations from the episode's mean (merged with Chan's update: exact
    where values sit far from zero, unlike a sum of squares)."""
    count = ordered.shape[1]
    total = ordered.sum(axis=1, dtype=np.float64)
    deviations = ordered.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: the m2 of values holding inf is NaN, as np.std
        deviations -= (total / count)[:, None]
    low, high = ordered[:, 0], ordered[:, -1]  # in the field's dtype: int64 beyond 2**53 stays exact
    if ordered.dtype.kind == "f":  # NaN sorts last: NaN in a column, as np.min and np.max
        low = np.where(np.isnan(high), high, low)
    return {
        "count": count,
        "sum": total.tolist(),
        "m2": np.einsum("ij,ij->i", deviations, deviations).tolist(),
        "min": low.tolist(),
        "max": high.tolist(),
        "sketch": sketch_kind(ordered.dtype),
    }


def _field_sketch(values: np.ndarray) -> tuple[dict[str, Any], list[bytes]]:
    """Moments (``_field_moments``) and per-feature KLL bytes of ``values`` (steps, features)."""
    ordered = _sorted_features(values)
    header = _field_moments(ordered)
    blobs = _kll_blobs(ordered, header["sketch"])
    return header | {"kll": [len(b) for b in blobs]}, blobs


def _unstored_headers(episodes: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
    """The decoded headers (``decode``'s form) of ``episodes`` (each: field -> (T, *shape)
    committed steps) whose blobs are not stored: each episode's moments, and one KLL sketch per
    feature of all their values, held by the first header (the others hold none). Merging the
    same values, at a fraction of the cost of a sketch per episode that is serialized, parsed
    and merged (stats() of 100,000 read-only 5-step episodes: 76 s and 830 MB)."""
    headers: list[dict[str, Any]] = [{"fields": {}} for _ in episodes]
    for name in episodes[0] if episodes else ():
        rows = [np.asarray(episode[name]).reshape(len(episode[name]), -1) for episode in episodes]
        for header, values in zip(headers, rows):
            header["fields"][name] = _field_moments(_sorted_features(values)) | {"kll": []}
        every = _sorted_features(np.concatenate(rows))
        headers[0]["fields"][name]["kll"] = _kll_blobs(every, sketch_kind(every.dtype))
    return headers


def encode(generation: int, revision: int, episode: dict[str, np.ndarray]) -> bytes:
    """The blob of one episode: ``episode`` maps field -> (T, *shape) committed steps."""
    fields, payload = {}, []
    for name, steps in episode.items():
        fields[name], blobs = _field_sketch(np.asarray(steps).reshape(len(steps), -1))
        payload += blobs
    length = len(next(iter(episode.values()))) if episode else 0
    header = json.dumps(
        {"generation": int(generation), "revision": int(revision), "length": length, "fields": fields}
    ).encode()
    body = struct.pack("<I", len(header)) + header + b"".join(payload)
    return _MAGIC + struct.pack("<I", zlib.crc32(body)) + body


def decode(blob: bytes) -> dict[str, Any]:
    """The header of a blob with each field's ``kll`` replaced by its sketches' bytes; ValueError
    when it is not a current blob, fails its crc32 or its sketches do not fill it exactly."""
    if blob[:4] != _MAGIC:
        raise ValueError(f"not a current replaybuf sketch blob (starts with {blob[:4]!r})")
    (crc,) = struct.unpack("<I", blob[4:8])
    if zlib.crc32(blob[8:]) != crc:
        raise ValueError("sketch blob fails its crc32")
    (size,) = struct.unpack("<I", blob[8:12])
    header = json.loads(blob[12 : 12 + size])
    position = 12 + size
    for field in header["fields"].values():
        parts = []
        for length in field["kll"]:
            parts.append(blob[position : position + length])
            position += length
        field["kll"] = parts
    if position != len(blob):
        raise ValueError(f"sketch blob holds {len(blob)} bytes, its header describes {position}")
    return header


class MergedSketches(Sequence):
    """One KLL sketch per feature, merged from the episodes' serialized sketches when first
    used (``quantile()``): statistics that need only the moments never pay for the merge
    (~25 us per episode and feature)."""

    def __init__(self, parts: list[list[bytes]], kind: str = "kll_floats"):
        self._parts: list[list[bytes]] | None = parts
        self._merged: list[Any] = []
        self.kind = kind  # sketch_kind's: the sketches' class

    def _sketches(self) -> list[Any]:
        if self._parts is not None:
            sketch = _kll(self.kind)
            for parts in self._parts:
                merged = sketch(KLL_K)
                for part in parts:
                    merged.merge(sketch.deserialize(part))
                self._merged.append(merged)
            self._parts = None
        return self._merged

    def __getitem__(self, index: Any) -> Any:
        return self._sketches()[index]

    def __len__(self) -> int:
        return len(self._parts) if self._parts is not None else len(self._merged)


class _Accumulator:
    """Merges per-episode field headers: count, Chan-merged mean and m2, min, max, KLL."""

    def __init__(self, features: int):
        self.count, self.mean, self.m2 = 0, np.zeros(features), np.zeros(features)
        self.lows: list[list[Any]] = []  # each episode's, reduced in the field's dtype by ``result``
        self.highs: list[list[Any]] = []
        self.parts: list[list[bytes]] = [[] for _ in range(features)]

    def add(self, field: dict[str, Any]) -> None:
        count = field["count"]
        mean = np.asarray(field["sum"]) / count
        self.mean, self.m2 = chan_merge(self.count, self.mean, self.m2, count, mean, np.asarray(field["m2"]))
        self.count += count
        self.lows.append(field["min"])
        self.highs.append(field["max"])
        for parts, part in zip(self.parts, field["kll"]):
            parts.append(part)

    def result(self, field: Field) -> FieldStats:
        import torch  # with the first summary, not at commit

        from .analysis import FieldStats

        real = field.dtype if field.dtype.kind == "f" else np.dtype(np.float32)

        def tensor(values: np.ndarray, dtype: np.dtype) -> torch.Tensor:
            return torch.from_numpy(np.array(values.reshape(field.shape), dtype=dtype))

        return FieldStats(
            mean=tensor(self.mean, real),
            std=tensor(np.sqrt(self.m2 / self.count), real),
            min=tensor(np.min(np.asarray(self.lows, field.dtype), axis=0), field.dtype),
            max=tensor(np.max(np.asarray(self.highs, field.dtype), axis=0), field.dtype),
            count=int(self.count),
            sketches=MergedSketches(self.parts, sketch_kind(field.dtype)),
        )


def _episode_headers(buffer: Any, slots: np.ndarray, names: list[str]) -> list[dict[str, Any] | None]:
    """The decoded blob of each of ``slots`` (a list aligned with them); slots without a valid
    one are read (consistently) and sketched now; None for one a writer rewrote meanwhile."""
    if hasattr(buffer, "buffers"):  # a ConcatReplayBuffer: each member's own blobs
        offsets = buffer.storage.offsets
        owner = np.searchsorted(offsets, slots, side="right") - 1
        out: list[dict[str, Any] | None] = [None] * len(slots)
        for k, member in enumerate(buffer.buffers):
            rows = np.flatnonzero(owner == k)
            for row, header in zip(rows.tolist(), _episode_headers(member, slots[rows] - offsets[k], names)):
                out[row] = header
        return out
    headers: list[dict[str, Any] | None] = []
    kinds = {n: sketch_kind(buffer.schema.fields[n].dtype) for n in names}
    features = {n: int(np.prod(buffer.schema.fields[n].shape, dtype=np.int64)) for n in names}
    generations, revisions = buffer._meta["_generation"][slots], buffer._meta["_revision"][slots]
    lengths = buffer._meta["episode_lens"][slots]
    for slot, generation, revision, length in zip(
        slots.tolist(), generations.tolist(), revisions.tolist(), lengths.tolist()
    ):
        try:  # one over MAX_DOCUMENT_BYTES is refused unread (BufferDamagedError, a ValueError)
            blob = buffer.storage.read_blob(f"{PREFIX}{slot}")
            header = decode(blob) if blob is not None else None
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, struct.error):
            header = None  # a damaged blob: derived data, sketched again from the episode
        # a blob of another episode, of values since edited, or of an older release (no m2,
        # or float sketches of a field that now gets double ones), is sketched again
        fresh = (
            header is not None
            and header["generation"] == generation
            and header.get("revision") == revision
            and all(_fits(header["fields"].get(n), length, features[n], kinds[n]) for n in names)
        )
        headers.append(header if fresh else None)
    missing = np.asarray([i for i, h in enumerate(headers) if h is None], np.int64)
    sketched = _sketch_from_data(buffer, slots[missing], generations[missing], revisions[missing], names)
    for i, header in zip(missing.tolist(), sketched):
        headers[i] = header
    return headers


def _fits(field: Any, length: int, features: int, kind: str) -> bool:
    """Whether ``field`` (a blob's header of one field) describes ``length`` steps of ``features``
    values each in sketches of ``kind``: one from an older release (no ``m2``, float sketches of
    a field that now gets double ones), or one whose checksum was recomputed over a changed
    header (a count of 0 would divide by zero, another one weigh the episode wrongly), is not."""
    if not isinstance(field, dict) or field.get("count") != length or field.get("sketch", "kll_floats") != kind:
        return False
    numbers = [field.get(key) for key in ("sum", "m2", "min", "max")]
    return (
        all(
            isinstance(values, list)
            and len(values) == features
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            for values in numbers
        )
        and isinstance(field.get("kll"), list)
        and len(field["kll"]) == features
    )


def _sketch_from_data(
    buffer: Any, slots: np.ndarray, generations: np.ndarray, revisions: np.ndarray, names: list[str]
) -> list[dict[str, Any] | None]:
    """The headers of ``slots`` (holding ``generations`` at ``revisions``) sketched from their
    data, read ``READ_BYTES`` at a time; None for one a writer rewrote meanwhile. A writable
    buffer stores the blobs of episodes of at least ``KLL_K`` steps, of every sketched field
    (read for them)."""
    stored = (buffer._meta["episode_lens"][slots] >= KLL_K) & (not buffer.read_only)
    headers: list[dict[str, Any] | None] = [None] * len(slots)
    storing = True  # until the storage refuses a blob
    for store, fields in ((True, sketched_fields(buffer.schema)), (False, names)):
        rows = np.flatnonzero(stored == store)
        step_bytes = sum(buffer.schema.fields[n].step_nbytes for n in fields)
        per_read = max(1, READ_BYTES // max(1, step_bytes * buffer.max_timesteps))
        for lo in range(0, len(rows), per_read):
            batch = rows[lo : lo + per_read]
            got = read_episodes_consistent(buffer, slots[batch], fields, generations[batch], with_meta=False)
            read = {slot: i for i, slot in enumerate(got.slots.tolist())}
            found = [(row, read[int(slots[row])]) for row in batch.tolist() if int(slots[row]) in read]
            episodes = [{n: got.data[n][i, : int(got.lens[i])] for n in fields} for _, i in found]
            if not store:  # rewritten ones (not read) are left None
                for (row, _), header in zip(found, _unstored_headers(episodes)):
                    headers[row] = header
                continue
            for (row, _), episode in zip(found, episodes):
                blob = encode(generations[row], revisions[row], episode)
                if storing:
                    storing = _store(buffer.storage, int(slots[row]), blob)
                headers[row] = decode(blob)
    return headers


def _store(storage: Storage, slot: int, blob: bytes) -> bool:
    """Write the sketch blob of ``slot``; False (after a warning) when the storage refuses it:
    stats() goes on, and sketches that episode from its data again next time."""
    try:
        storage.write_blob(f"{PREFIX}{slot}", blob)
    except (OSError, StorageError) as error:
        warnings.warn(
            f"stats: could not store the statistics sketch of slot {slot} in {storage.location!r} (the "
            f"episodes without one are sketched from their data at each stats()): {error}",
            stacklevel=7,  # the caller of ReplayBuffer.stats()
        )
        return False
    return True


def merge(buffer: Any, names: list[str], slots: np.ndarray) -> tuple[np.ndarray, dict[str, FieldStats], dict]:
    """(kept, statistics per field, per-episode sums of the scalar fields) of the episodes in
    ``slots`` of a ReplayBuffer or ConcatReplayBuffer, merged from their sketches; ``kept``:
    False for an episode a writer rewrote while it was being sketched from its data."""
    headers = _episode_headers(buffer, slots, names)
    check_same_buffer(buffer.storage)  # the blobs of a buffer created again name the same generations
    kept = np.array([h is not None for h in headers], bool)
    fields = {n: buffer.schema.fields[n] for n in names}
    totals = {n: _Accumulator(int(np.prod(f.shape, dtype=np.int64))) for n, f in fields.items()}
    for header in headers:
        if header is not None:
            for name in names:
                totals[name].add(header["fields"][name])
    sums = {
        n: np.array([h["fields"][n]["sum"][0] for h in headers if h is not None]).astype(episode_sum_dtype(f.dtype))
        for n, f in fields.items()
        if f.shape == ()
    }
    if not kept.any():
        return kept, {}, sums
    return kept, {n: totals[n].result(fields[n]) for n in names}, sums


def chosen_episodes(buffer: Any, episodes: Sequence[int] | np.ndarray | None, call: str) -> np.ndarray:
    """The committed slots ``episodes`` names (default: all, oldest first), checked."""
    valid = np.asarray(buffer.valid_episodes(), np.int64)
    given = None if episodes is None else np.asarray(episodes).reshape(-1)
    if given is not None and given.dtype.kind not in "iu" and len(given):  # 0.5 would read as slot 0
        raise ValueError(f"{call}: episodes must be slots (ints), got {given.tolist()}")
    slots = valid if given is None else given.astype(np.int64)
    values, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():  # each would count twice
        raise ValueError(f"{call}: episodes lists slot(s) {values[counts > 1].tolist()} more than once")
    stray = sorted(set(slots.tolist()) - set(valid.tolist()))
    if stray:
        raise ValueError(f"{call}: episodes {stray} hold no committed episode (committed: {valid.tolist()})")
    if len(slots) == 0:
        raise ValueError(f"{call}: no episodes to summarize")
    return slots


def summary(
    buffer: Any, fields: Sequence[str] | None = None, episodes: Sequence[int] | np.ndarray | None = None
) -> dict[str, FieldStats]:
    """Merged statistics of ``fields`` (default: every sketched field) over ``episodes`` (slots;
    default: every committed episode) of a ReplayBuffer or ConcatReplayBuffer, from their
    sketches (``buffer.stats(fields, episodes=...)`` adds lengths and the unsketched fields)."""
    allowed = sketched_fields(buffer.schema)
    names = list(allowed) if fields is None else list(fields)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(
            f"summary: fields {unknown} have no sketches - sketched fields (numeric, at most "
            f"{MAX_FEATURES} values per step): {allowed}"
        )
    return merge(buffer, names, chosen_episodes(buffer, episodes, "summary"))[1]


@dataclass
class Normalizer:
    """``(x - shift) / scale``, and back with ``unnormalize``. A tensor comes back as a tensor on
    its device; a numpy array (or a list or number: an observation from an environment, say)
    as a numpy array, where torch's operators would refuse it."""

    shift: torch.Tensor
    scale: torch.Tensor

    def __call__(self, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if not isinstance(x, type(self.shift)):  # not a tensor (torch is imported lazily here)
            return (np.asarray(x) - self.shift.numpy()) / self.scale.numpy()
        return (x - self.shift.to(x.device)) / self.scale.to(x.device)

    def unnormalize(self, y: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if not isinstance(y, type(self.shift)):
            return np.asarray(y) * self.scale.numpy() + self.shift.numpy()
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
    try:  # a single number or strings fail len() or the comparisons
        fits = kind != "quantile" or (len(q) == 2 and 0 <= q[0] < q[1] <= 1)
    except TypeError:
        fits = False
    if not fits:
        raise ValueError(f"normalizer: q must be two quantiles 0 <= low < high <= 1, got {q!r}")
    number = isinstance(eps, int | float | np.integer | np.floating) and not isinstance(eps, bool | np.bool_)
    if not (number and 0 < eps < math.inf):  # NaN made every value NaN, <= 0 a constant feature inf
        raise ValueError(f"normalizer: eps must be a finite number > 0, got {eps!r}")
    stats = summary(buffer, [field], episodes)[field]
    if kind == "meanstd":
        return Normalizer(stats.mean, stats.std.clamp_min(eps))
    low, high = stats.quantile(list(q))
    return Normalizer((high + low) / 2, ((high - low) / 2).clamp_min(eps))
