"""Dask views of a buffer: ``to_dask``, ``get_all_data`` through dask, masks and field statistics.

Every function takes a buffer-like object: a ``ReplayBuffer`` or a ``ConcatReplayBuffer``,
anything with ``schema``, ``valid_episodes()``, ``episode_lens``, ``meta_data`` and a
``storage`` that serves the data. The dask graphs read whole episodes through
``Storage.read_spans`` (the backend's bulk path where it has one, else ``read_rows``),
so they work on every backend, and the storage objects pickle without open handles, so the
same graphs run on a ``dask.distributed`` cluster. In this process (threads or sync),
``get_all_data`` allocates each result once and the storage decodes episodes straight into it.

Dask chunks hold whole episodes over the whole (trimmed) time extent, so each task reads
whole storage chunks; a chunk holds about ``dask.config['array.chunk-size']`` bytes. One
task per storage chunk, dask's default for zarr, was 3x slower locally and 20x slower on a
2-process cluster (DESIGN.md, "Measured while planning").
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dask
import dask.array as da
import numpy as np
import torch
from dask.base import tokenize
from dask.utils import parse_bytes

from . import sketches
from .consistency import (
    RETRIES,
    ConcurrentWriteError,
    check_same_buffer,
    check_settled,
    committed_generations,
    read_consistent,
    replanner,
)
from .progress import dask_progress, progress_bar
from .schema import Field, UnknownFieldError
from .storage import (
    BufferReplacedError,
    GenerationMismatchError,
    StalePlanError,
    UnfinishedEditError,
    fill_beyond,
    recycled_empty,
)
from .view import BufferView, RefreshLock, mirror_lock

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["to_dask", "to_xarray", "get_all_data", "episode_mask", "stats", "BufferStats", "FieldStats"]

# Rows of a block whose moments are computed at once: bounds the float64 temporaries, and keeps
# float32 sums of 1-byte values and their squares exact (256 * 255**2 < 2**24).
_MOMENT_ROWS = 256
_HISTOGRAM_BINS = 32
# Decoded bytes one storage call of get_all_data reads: a progress step; the storage spreads
# each call's episodes over its thread pool, and each call starts with its planning alone and
# ends with its last part decoding alone (a cold 213 MB read in 4 calls of 64 MiB: 0.104 and
# 0.109 s median in two runs of 8 fresh processes, in 1 call: 0.087 and 0.099 s).
_CALL_BYTES = 256 << 20
# Schedulers whose tasks run in this process, so episodes can be decoded into arrays allocated here.
_SHARED_MEMORY_SCHEDULERS = ("threads", "threading", "sync", "synchronous", "single-threaded")
_THREADED_SCHEDULERS = ("threads", "threading")


# ---- argument checks ----------------------------------------------------------------------


def _meta_names(buffer: BufferView) -> list[str]:
    return sorted(buffer.meta_fieldnames)


def _select(
    buffer: BufferView, fields: Sequence[str] | None, meta_fields: Sequence[str] | None, call: str
) -> tuple[list[str], list[str]]:
    """The data and meta field names a call works on (the seed's defaults), checked."""
    if fields is None and meta_fields is None:
        return list(buffer.schema.fields), _meta_names(buffer)
    fields = _names(fields, "fields", call)
    meta_fields = _names(meta_fields, "meta_fields", call)
    _check_known(fields, set(buffer.schema.fields), "field", call)
    _check_known(meta_fields, set(buffer.meta_fieldnames), "meta field", call)
    return fields, meta_fields


def _names(names: Sequence[str] | str | None, argument: str, call: str) -> list[str]:
    if names is None:
        return []
    if isinstance(names, str):
        return [names]
    chosen = list(names) if isinstance(names, Iterable) else None  # 5: "'int' object is not iterable"
    if chosen is None or not all(isinstance(n, str) for n in chosen):
        raise TypeError(f"{call}: {argument} must be field names (str), got {names!r}")
    return chosen


def _check_known(names: Sequence[str], allowed: set[str], what: str, call: str) -> None:
    unknown = sorted(set(names) - allowed)
    if unknown:
        raise UnknownFieldError(f"{call}: invalid {what} names {unknown} - must be among {sorted(allowed)}")


# ---- dask arrays over the storage ------------------------------------------------------------


class EpisodeRows:
    """The planned episodes of one data field as a lazily read array (episodes, time, *shape).

    Episode ``i`` is slot ``slots[i]`` as it held generation ``generations[i]`` when planned;
    time runs to ``length``; steps at or beyond an episode's length read as ``fill`` (the
    field's default, else zero, as the seed pads). Each block is read consistently when it is
    computed (``consistency.read_consistent``): a row planned empty reads as ``fill``
    throughout, and one whose slot no longer holds the planned episode raises
    ``StalePlanError``. ``dask.array.from_array`` slices it block by block; it pickles with the
    storage (no open handle) for distributed workers.
    Rows of a snapshot view (``snapshot``: its name) raise ``SnapshotError`` instead. Each block
    is read holding ``refresh_lock`` (an hdf5 reader's: its ``refresh()`` closes the file).
    """

    def __init__(
        self,
        storage: Any,
        name: str,
        slots: np.ndarray,
        lens: np.ndarray,
        length: int,
        field_shape: tuple[int, ...],
        dtype: np.dtype,
        fill: Any = 0,
        generations: np.ndarray | None = None,
        snapshot: str | None = None,
        refresh_lock: RefreshLock | None = None,
    ):
        self.storage, self.name, self.fill, self.snapshot = storage, name, fill, snapshot
        self.refresh_lock = refresh_lock or RefreshLock()
        self.slots, self.lens = np.asarray(slots, np.int64), np.asarray(lens, np.int64)
        self.generations = np.asarray(generations if generations is not None else np.ones(len(self.slots)), np.int64)
        self.shape = (len(self.slots), int(length), *field_shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (2 - min(len(key), 2))
        episodes = np.arange(self.shape[0])[key[0]]
        steps = np.arange(self.shape[1])[key[1]]
        flat = np.atleast_1d(steps)
        t0, t1 = (int(flat.min()), int(flat.max()) + 1) if flat.size else (0, 0)
        picked = np.atleast_1d(episodes)
        # only each episode's own steps are read; the padding after them is set, not read
        lengths = np.clip(self.lens[picked] - t0, 0, t1 - t0)
        rows = np.empty((len(picked), t1 - t0, *self.shape[2:]), self.dtype)
        slots, generations = self.slots[picked], self.generations[picked].copy()

        def read(items: np.ndarray) -> None:
            for lo, hi in _runs(items):
                self.storage.read_spans(
                    self.name,
                    slots[lo:hi],
                    np.full(hi - lo, t0),
                    lengths[lo:hi],
                    rows[lo:hi],
                    generations=generations[lo:hi],
                )

        with self.refresh_lock():
            kept = read_consistent(
                self.storage, slots.copy(), np.where(lengths > 0, generations, 0), read, snapshot=self.snapshot
            )
            check_same_buffer(self.storage)
        gone = (lengths > 0) & ~kept
        if gone.any():  # padding under the planned lengths and meta values would pass for data
            raise StalePlanError(self.storage.location, slots[gone])
        fill_beyond(rows, lengths, self.fill)
        if not (isinstance(key[1], slice) and key[1].step in (None, 1)):
            rows = rows[:, flat - t0]
        squeeze = tuple(0 if np.ndim(index) == 0 else slice(None) for index in (episodes, steps))
        return rows[squeeze + key[2:]]


def _runs(items: np.ndarray) -> list[tuple[int, int]]:
    """``items`` (sorted indices) as (lo, hi) runs of consecutive indices."""
    if len(items) == 0:
        return []
    breaks = np.flatnonzero(np.diff(items) != 1) + 1
    return [(int(items[a]), int(items[b - 1]) + 1) for a, b in zip(np.r_[0, breaks], np.r_[breaks, len(items)])]


def _episodes_per_chunk(step_nbytes: int, length: int, episodes: int) -> int:
    """Episodes per dask chunk: about ``array.chunk-size`` bytes of whole episodes."""
    target = parse_bytes(dask.config.get("array.chunk-size"))
    per_episode = max(1, step_nbytes * max(length, 1))
    return int(max(1, min(max(episodes, 1), target // per_episode)))


_ORDERS = ("chronological", "slot")


@dataclass
class _Plan:
    """The snapshot a read names: slots, the generation and length each held (from the buffer's
    mirror as of ``refresh()``; 0 for an empty slot) and their meta rows."""

    slots: np.ndarray
    generations: np.ndarray
    lens: np.ndarray
    meta: dict[str, np.ndarray]

    @property
    def length(self) -> int:
        return int(self.lens.max(initial=0))


def _plan(buffer: BufferView, slots: np.ndarray, meta_fields: Sequence[str] = ()) -> _Plan:
    with mirror_lock(buffer):  # lengths, generations and meta rows of one state of a writer's mirror
        return _planned(buffer, slots, meta_fields)


def _planned(buffer: BufferView, slots: np.ndarray, meta_fields: Sequence[str]) -> _Plan:
    slots = np.asarray(slots, np.int64)
    lens = np.asarray(buffer.episode_lens, np.int64)[slots]
    generations = np.asarray(buffer.generations, np.int64)[slots]
    empty = (lens <= 0) | (generations <= 0)
    lens, generations = np.where(empty, 0, lens), np.where(empty, 0, generations)
    check_no_unfinished_edit(buffer, slots[~empty])
    # committed length-0 episodes keep their meta values, as the seed returns them
    unset = empty & ~np.isin(slots, buffer.empty_episodes())
    meta = {}
    for name in meta_fields:
        values = lens.astype(np.int32) if name == "episode_lens" else np.asarray(buffer.meta_data[name][:])[slots]
        if unset.any() and name != "episode_lens":
            values[unset] = buffer.schema.meta_fields[name].fill
        meta[name] = values
    return _Plan(slots, generations, lens, meta)


def check_no_unfinished_edit(buffer: BufferView, slots: np.ndarray) -> None:
    """Refuse (``UnfinishedEditError``) to read ``slots`` as whole episodes when some hold an
    in-place edit a stopped writer left part applied (``unfinished_edit_slots``): their values
    are part old, part new until the next writable open finishes the edit from its log."""
    unfinished = np.intersect1d(slots, buffer.unfinished_edit_slots())
    if len(unfinished):
        raise UnfinishedEditError(
            f"{buffer.storage.location!r}: slots {unfinished.tolist()} hold an in-place edit that a writer stopped "
            "part way through (odd meta/_revision): their values are part old, part new. Open the buffer for "
            "writing once (ReplayBuffer.from_folder(...).close(), or `replaybuf verify --repair`), which finishes "
            "it from the edit log, then refresh() and read again"
        )


def _committed(buffer: BufferView, order: str = "chronological", meta_fields: Sequence[str] = ()) -> _Plan:
    """The committed episodes: valid slots (oldest first, or by slot index), as planned."""
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {list(_ORDERS)}, got {order!r}")
    with mirror_lock(buffer):
        all_lens = np.asarray(buffer.episode_lens, np.int64)
        slots = np.asarray(
            buffer.valid_episodes() if order == "chronological" else np.flatnonzero(all_lens > 0), np.int64
        )
        return _plan(buffer, slots, meta_fields)


def to_dask(
    buffer: BufferView,
    fields: Sequence[str] | None = None,
    meta_fields: Sequence[str] | None = None,
    episodes_per_chunk: int | None = None,
    order: str = "chronological",
) -> dict[str, da.Array]:
    """Fields of the committed episodes as dask arrays, oldest episode first.

    Data fields are (episodes, time, *shape) with time trimmed to the longest committed episode
    and the padding value beyond each episode's length (the field's default, else zero, as the
    seed pads); meta fields are (episodes, *shape). Without
    ``fields`` and ``meta_fields`` every field is returned, as ``get_all_data`` does.
    ``episodes_per_chunk`` overrides the chunking (default: whole episodes, about
    ``dask.config['array.chunk-size']`` bytes per chunk); ``order='slot'`` orders episodes by
    slot (the same unless a circular buffer wrapped).

    The rows are the episodes committed as of the buffer's last ``refresh()``; blocks are read
    when computed, each checked against a writer in another process: a block holding a row
    whose slot was rewritten or dropped since raises ``StalePlanError`` (a retryable
    ``ConcurrentWriteError``: ``refresh()`` and plan again), as padding under the planned
    lengths and meta values would pass for data; a block of a buffer replaced since (created
    again at its location) raises ``BufferReplacedError``.
    """
    fields, meta_fields = _select(buffer, fields, meta_fields, "to_dask")
    _check_episodes_per_chunk("to_dask", episodes_per_chunk)
    plan = _committed(buffer, order, meta_fields)
    return _dask_arrays(buffer, fields, meta_fields, plan, episodes_per_chunk, RefreshLock(buffer))


def _dask_arrays(
    buffer: BufferView,
    fields: Sequence[str],
    meta_fields: Sequence[str],
    plan: _Plan,
    episodes_per_chunk: int | None = None,
    refresh_lock: RefreshLock | None = None,
) -> dict[str, da.Array]:
    """Dask arrays of ``plan``'s rows: data read consistently when computed, meta as planned;
    each block's read holds ``refresh_lock`` (none for a caller that holds the buffer's lock
    through the computation: a worker thread waiting for it would wait forever)."""
    slots, lens, length = plan.slots, plan.lens, plan.length
    # A fresh token per call: the same slots and lengths may hold other episodes later.
    token = tokenize(buffer.storage.location, slots, lens, uuid.uuid4().hex)
    out: dict[str, da.Array] = {}
    for name in fields:
        field = buffer.schema.fields[name]
        rows = EpisodeRows(
            buffer.storage,
            name,
            slots,
            lens,
            length,
            field.shape,
            field.dtype,
            field.fill,
            plan.generations,
            getattr(buffer, "snapshot_name", None),
            refresh_lock,
        )
        per_chunk = episodes_per_chunk or _episodes_per_chunk(field.step_nbytes, length, len(slots))
        out[name] = da.from_array(
            rows,
            chunks=(per_chunk, max(length, 1), *field.shape),
            name=f"replaybuf-{name}-{token}",
            asarray=False,
            fancy=False,
            meta=np.empty((0,) * rows.ndim, field.dtype),
        )
    for name in meta_fields:
        out[name] = da.from_array(plan.meta[name], chunks=-1, name=f"replaybuf-meta-{name}-{token}")
    return out


def _check_episodes_per_chunk(call: str, episodes_per_chunk: Any) -> None:
    """A ValueError naming ``call`` unless ``episodes_per_chunk`` is None or an int >= 1 (dask
    took 0 or -1 as one chunk, and failed on 1.5 or 'x' naming neither argument)."""
    if episodes_per_chunk is not None and (
        isinstance(episodes_per_chunk, bool) or not isinstance(episodes_per_chunk, int) or episodes_per_chunk < 1
    ):
        raise ValueError(f"{call}: episodes_per_chunk must be a positive int, got {episodes_per_chunk!r}")


def episode_mask(buffer: BufferView, episodes_per_chunk: int | None = None, order: str = "chronological") -> da.Array:
    """Dask bool array (episodes, time): True where a committed episode has a step (rows as ``to_dask``)."""
    _check_episodes_per_chunk("episode_mask", episodes_per_chunk)
    plan = _committed(buffer, order)
    lens, length = plan.lens, plan.length
    chunk = episodes_per_chunk or max(1, len(lens))
    lens = da.from_array(lens, chunks=chunk)
    return da.arange(length, chunks=max(length, 1))[None, :] < lens[:, None]


def to_xarray(
    buffer: BufferView,
    fields: Sequence[str] | None = None,
    meta_fields: Sequence[str] | None = None,
    order: str = "chronological",
) -> Any:
    """The arrays of ``to_dask`` as a lazy ``xarray.Dataset`` (needs ``pip install 'replaybuf[xarray]'``).

    Data variables have dims ``episode``, ``time`` and the field's feature dims
    (``Field.dimension_names``: ``frame_height``, ``action_dim0``, ...), the names the zarr
    backend stores. Coordinates: ``slot`` (the buffer slot of each episode), ``episode_lens``,
    ``valid`` (episode, time: the steps each episode has, ``episode_mask``), ``time`` and the
    meta fields; a field named as one of these coordinates or dims is refused (ValueError):
    leave it out with ``fields``/``meta_fields``. Nothing is read until computed.
    """
    try:
        import xarray
    except ImportError as e:
        raise ImportError("to_xarray needs xarray: pip install 'replaybuf[xarray]' (or pip install xarray)") from e
    from .storage import bookkeeping_fields

    fields, meta_fields = _select(buffer, fields, meta_fields, "to_xarray")
    meta_names = sorted({*meta_fields, "episode_lens"})
    _check_xarray_names(
        [buffer.schema.fields[n] for n in fields],
        [buffer.schema.meta_fields[n] for n in meta_fields if n != "episode_lens"],
    )
    arrays = to_dask(buffer, fields, meta_names, order=order)
    plan = _committed(buffer, order)
    slots, length = plan.slots, plan.length
    meta_schema = {**buffer.schema.meta_fields, **bookkeeping_fields(buffer.schema)}
    coords = {
        "slot": ("episode", slots),
        "time": np.arange(length),
        "valid": (("episode", "time"), episode_mask(buffer, order=order)),
    }
    # per-episode values are already in memory (to_dask wraps them): numpy coordinates select at once
    coords.update({n: (meta_schema[n].dimension_names(per_episode=True), np.asarray(arrays[n])) for n in meta_names})
    variables = {n: (buffer.schema.fields[n].dimension_names(), arrays[n]) for n in fields}
    return xarray.Dataset(variables, coords=coords, attrs={"source": buffer.storage.location})


def _check_xarray_names(data: Sequence[Field], meta: Sequence[Field]) -> None:
    """Refuse fields named as a coordinate or dimension of ``to_xarray``'s Dataset: xarray
    would put the field in its place (a meta field ``valid`` as the valid-step mask) or fail."""
    taken = {"episode", "time", "slot", "valid", "episode_lens"}
    for f in data:
        taken.update(f.dimension_names())
    for f in meta:
        taken.update(f.dimension_names(per_episode=True))
    clashes = sorted(f.name for f in (*data, *meta) if f.name in taken)
    if clashes:
        raise ValueError(
            f"to_xarray: field names {clashes} are also names of the Dataset's coordinates or dimensions "
            f"{sorted(taken)}; leave them out with fields=... and meta_fields=..., or read them with to_dask()"
        )


# ---- get_all_data ------------------------------------------------------------------------------


def get_all_data(
    buffer: BufferView,
    fields: Sequence[str] | None = None,
    meta_fields: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    lazy: bool = False,
    scheduler: Any = None,
    progress: bool | None = None,
) -> dict[str, torch.Tensor] | dict[str, da.Array]:
    """One row per slot ``0 .. num_episodes - 1`` (row i = slot i, as the seed), as tensors
    time-padded to the longest with zeros (or the field's default, as the seed).

    A slot that is empty (a killed writer's) or being rewritten by a writer in another process
    during the read gives a row of padding with length 0 in ``episode_lens`` (its meta values
    are the fields' defaults, else zero): later rows never shift, and every row holds one whole
    committed episode or nothing. A slot that changed during the read is read again as the
    episode it holds now (``consistency.read_consistent``); ``ConcurrentWriteError`` if it keeps
    changing. Decoding runs on the storage's thread pool straight into the results (scheduler
    ``'threads'``, the default; ``'sync'``: in this thread), or through dask where ``scheduler``
    (a name or a ``dask.distributed`` client) or an active client runs it elsewhere. ``lazy=True`` returns
    dask arrays of the same rows instead (read when computed: see ``to_dask``); they live on no
    device, so ``device`` is refused with it. An empty buffer gives ``{}``, as the seed.
    ``progress``: a tqdm bar over the bytes decoded, or dask's tasks (``replaybuf.progress``: by
    default on a terminal, after two seconds).
    """
    if lazy and device is not None:
        raise ValueError(
            f"get_all_data: lazy=True returns dask arrays, which have no device; got device={device!r}. "
            "Call .compute() and move the tensors, or pass lazy=False"
        )
    if device is not None:  # before any read: torch would refuse it only once every row is decoded
        from .sampling.loader import check_device

        check_device(device)
    fields, meta_fields = _select(buffer, fields, meta_fields, "get_all_data")
    plan = _plan(buffer, buffer.listed_slots(), meta_fields)
    if lazy:
        return _dask_arrays(buffer, fields, meta_fields, plan, refresh_lock=RefreshLock(buffer))
    if len(plan.slots) == 0:
        return {}
    scheduler = scheduler or _default_scheduler()
    if isinstance(scheduler, str) and scheduler in _SHARED_MEMORY_SCHEDULERS:
        with progress_bar(progress, desc="get_all_data", unit="B", unit_scale=True, total=0) as bar:
            results = _read_rows(buffer, fields, plan, scheduler, bar)
    else:
        with dask_progress(progress, "get_all_data"):
            results = _read_rows(buffer, fields, plan, scheduler, None)
    results.update(plan.meta)
    out = {n: torch.from_numpy(np.ascontiguousarray(results[n])) for n in (*fields, *meta_fields)}
    if device is not None:
        out = {n: t.to(device) for n, t in out.items()}
    return out


def _read_rows(
    buffer: BufferView, fields: Sequence[str], plan: _Plan, scheduler: Any, bar: tqdm | None
) -> dict[str, np.ndarray]:
    """The data rows of ``get_all_data``, read consistently; slots that changed meanwhile are
    re-planned and read again.

    Where the scheduler shares this process's memory (``bar`` given: threads or sync), each
    result is allocated once and the storage decodes whole episodes straight into it, spread
    over its own thread pool (threads) or in this thread (sync), ``_CALL_BYTES`` a call: dask
    tasks of a few episodes each took 1.3x as long for the same decoding. Elsewhere (processes,
    a distributed client) dask arrays of the same rows are computed and copied in."""
    storage, schema = buffer.storage, buffer.schema
    results = {
        n: recycled_empty((len(plan.slots), plan.length, *schema.fields[n].shape), schema.fields[n].dtype)
        for n in fields
    }
    parallel = scheduler in _THREADED_SCHEDULERS

    def read(items: np.ndarray) -> None:
        longest = int(plan.lens[items].max(initial=0))
        for name, array in results.items():
            if longest > array.shape[1]:  # a re-planned episode is longer than any planned
                grown = np.empty((len(array), longest, *array.shape[2:]), array.dtype)
                grown[:, : array.shape[1]] = array
                grown[:, array.shape[1] :] = schema.fields[name].fill
                results[name] = grown
        if bar is None:
            plan_items = _Plan(plan.slots[items], plan.generations[items], plan.lens[items], {})
            arrays = _dask_arrays(buffer, fields, (), plan_items)
            try:
                computed = dask.compute(*arrays.values(), scheduler=scheduler)
            except StalePlanError as error:  # slots moved before their block's read: re-plan them
                raise GenerationMismatchError(storage.location, error.slots) from error
            for name, values in zip(arrays, computed):
                out = results[name]
                out[items, : values.shape[1]] = values
                out[items, values.shape[1] :] = schema.fields[name].fill
            # slots that moved after their blocks' reads: re-plan them too
            moved = committed_generations(storage, plan.slots[items]) != plan.generations[items]
            if moved.any():
                raise GenerationMismatchError(storage.location, plan.slots[items][moved])
            return
        nbytes = int(plan.lens[items].sum()) * sum(schema.fields[n].step_nbytes for n in fields)
        bar.total = bar.n + nbytes  # each read (a re-read of moved slots too) adds its bytes
        for name, array in results.items():
            field = schema.fields[name]
            per_call = max(1, _CALL_BYTES // max(1, field.step_nbytes * array.shape[1]))
            for lo, hi in _runs(items):
                for start in range(lo, hi, per_call):
                    part = slice(start, min(hi, start + per_call))
                    rows, lens = array[part], plan.lens[part]
                    starts = np.zeros(len(rows), np.int64)
                    storage.read_spans(name, plan.slots[part], starts, lens, rows, parallel, plan.generations[part])
                    fill_beyond(rows, lens, field.fill)
                    bar.update(int(lens.sum()) * field.step_nbytes)

    replan = replanner(storage, plan.slots, plan.lens, plan.meta)
    kept = read_consistent(buffer, plan.slots, plan.generations, read, replan)
    check_same_buffer(storage)
    plan.lens[~kept] = 0
    lost = ~kept & ~np.isin(plan.slots, buffer.empty_episodes())  # length-0 episodes keep their meta
    for name, values in plan.meta.items():
        values[lost] = 0 if name == "episode_lens" else schema.meta_fields[name].fill
    width = plan.length
    for name, array in results.items():
        array[~kept] = schema.fields[name].fill
        results[name] = array[:, :width]
    return results


def _default_scheduler() -> str | Any:
    """The active distributed client when there is one, else threads.

    ``distributed`` is only consulted when already imported: no client can exist otherwise,
    and importing it costs a second.
    """
    distributed = sys.modules.get("distributed")
    if distributed is None:
        return "threads"
    try:
        return distributed.default_client()
    except ValueError:
        return "threads"


# ---- statistics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldStats:
    """Per feature dimension statistics of one field over valid timesteps (shape = field shape).

    ``std`` is the population standard deviation (``ddof=0``), what observation normalizers use;
    ``mean`` and ``std`` have the field's dtype when it is floating point, float32 otherwise,
    ``min``/``max`` the field's dtype.
    """

    mean: torch.Tensor
    std: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    count: int
    # per-feature KLL quantile sketches (sketches.py); empty for exact=True or unsketched fields
    sketches: Sequence[Any] = field(default=(), repr=False, compare=False)

    def quantile(self, q: float | Sequence[float]) -> torch.Tensor:
        """Quantiles per feature (shape ``(len(q), *shape)``, or the field's shape for one ``q``)
        from the merged sketches, within their rank error (``rank_error``); 0 and 1 give the
        exact ``min`` and ``max``; NaN for a feature holding NaN. float64 for float64 fields and
        ints of 4 bytes or more, float32 otherwise."""
        if not self.sketches and not sketches.available():  # said only "carry no sketches", no install
            raise ImportError(
                "quantile needs Apache DataSketches, which is not installed: pip install 'replaybuf[sketches]', "
                "then call stats() again"
            )
        if not self.sketches:
            raise ValueError(
                "quantile: these statistics carry no quantile sketches (stats(exact=True), or a field "
                f"that is not sketched: more than {sketches.MAX_FEATURES} values per step, or not numeric)"
            )
        try:  # a string or None: "could not convert string to float", naming neither q nor quantile
            qs = np.atleast_1d(np.asarray(q, np.float64))
        except (TypeError, ValueError):
            qs = np.array([np.nan])
        if qs.ndim != 1 or not ((qs >= 0) & (qs <= 1)).all():  # NaN fails too
            raise ValueError(f"quantile: q must be in [0, 1], got {q!r}")
        # a feature holding NaN has NaN quantiles, as np.quantile and its NaN min, max and mean
        # (the sketches skip NaN: one of only NaN is empty and has no quantile at all)
        nan = np.isnan(self.min.numpy().astype(np.float64)).reshape(-1)
        # float64 where the sketches are (float64 and wide int fields: float32 would round them)
        wide = getattr(self.sketches, "kind", "kll_floats") == "kll_doubles"
        values = np.array(
            [[np.nan if n else s.get_quantile(float(x)) for s, n in zip(self.sketches, nan)] for x in qs],
            np.float64 if wide else np.float32,
        )
        values = values.reshape(len(qs), *self.mean.shape)
        # the ends are known exactly: a merged KLL sketch may have dropped the extreme values
        values[qs == 0] = self.min.numpy()
        values[qs == 1] = self.max.numpy()
        # values[0] of a scalar field is a numpy scalar: keep it a 0-d array
        return torch.from_numpy(np.asarray(values[0]) if np.ndim(q) == 0 else values)

    @property
    def rank_error(self) -> float:
        """The sketches' stated normalized rank error (one-sided quantile queries)."""
        return max(s.normalized_rank_error(False) for s in self.sketches)


@dataclass(frozen=True)
class BufferStats:
    """What ``stats()`` returns: plain numbers and tensors, episodes in chronological order."""

    num_episodes: int
    num_timesteps: int
    episode_lens: torch.Tensor
    lens_histogram: tuple[torch.Tensor, torch.Tensor]
    fields: dict[str, FieldStats]
    episode_sums: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> FieldStats:
        return self.fields[name]

    def __iter__(self) -> Iterator[str]:
        """The field names, as a dict's keys (``list(stats)`` asked for ``stats[0]``: KeyError)."""
        return iter(self.fields)

    def __contains__(self, name: object) -> bool:
        return name in self.fields


def _block_moments(block: np.ndarray, lens: np.ndarray) -> tuple:
    """(count, mean, M2, min, max) over the valid steps of one block, per feature dimension.

    Moments are shifted by the block's first valid step (its finite values: an infinite shift
    would turn an infinite mean into NaN), which keeps the float64 sums exact enough where
    values sit far from zero; blocks are merged with Chan's parallel update.
    """
    if block.dtype.itemsize == 1:
        return _byte_moments(block, lens)
    feature_shape = block.shape[2:]
    valid = np.arange(block.shape[1])[None, :] < lens[:, None]
    steps = block[valid].reshape(-1, int(np.prod(feature_shape, dtype=np.int64)))
    count = steps.shape[0]
    if count == 0:
        return 0, None, None, None, None
    shift = steps[0].astype(np.float64)
    shift[~np.isfinite(shift)] = 0.0
    total = np.zeros(steps.shape[1])
    squares = np.zeros(steps.shape[1])
    for start in range(0, count, _MOMENT_ROWS):
        part = steps[start : start + _MOMENT_ROWS].astype(np.float64)
        part -= shift
        total += part.sum(axis=0)
        squares += np.einsum("ij,ij->j", part, part)
    mean = shift + total / count
    with np.errstate(invalid="ignore"):  # inf - inf: the m2 of values holding inf is NaN, as np.std
        m2 = np.maximum(squares - total * total / count, 0.0)
    return count, mean, m2, steps.min(axis=0), steps.max(axis=0)


def _byte_moments(block: np.ndarray, lens: np.ndarray) -> tuple:
    """``_block_moments`` for 1-byte values (frames, masks), exact and ~4x faster: float32 sums
    of at most 256 rows of them (and of their squares) are exact integers, added up in float64;
    each episode's valid steps are read in place, not copied out of the block."""
    features = int(np.prod(block.shape[2:], dtype=np.int64))
    total, squares = np.zeros(features), np.zeros(features)
    low = high = None
    for i, length in enumerate(lens.tolist()):
        steps = block[i, :length].reshape(length, features)
        for start in range(0, length, _MOMENT_ROWS):
            part = steps[start : start + _MOMENT_ROWS]
            values = part.astype(np.float32)
            total += values.sum(axis=0)
            squares += np.einsum("ij,ij->j", values, values)
            part_low, part_high = part.min(axis=0), part.max(axis=0)
            low = part_low if low is None else np.minimum(low, part_low)
            high = part_high if high is None else np.maximum(high, part_high)
    count = int(lens.sum())
    if count == 0:
        return 0, None, None, None, None
    return count, total / count, np.maximum(squares - total * total / count, 0.0), low, high


def _merge_moments(parts: list[tuple]) -> tuple:
    count = 0
    mean: Any = None
    m2: Any = None
    low: Any = None
    high: Any = None
    for n, m, s, lo, hi in parts:
        if n == 0:
            continue
        if count == 0:
            count, mean, m2, low, high = n, m, s, lo, hi
            continue
        mean, m2 = sketches.chan_merge(count, mean, m2, n, m, s)
        low, high, count = np.minimum(low, lo), np.maximum(high, hi), count + n
    return count, mean, m2, low, high


def _lens_histogram(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts of episode lengths in at most 32 integer-aligned bins; edges are bin starts + last end."""
    low, high = int(lens.min()), int(lens.max()) + 1
    width = max(1, -(-(high - low) // _HISTOGRAM_BINS))
    edges = np.arange(low, high + width, width)
    counts, _ = np.histogram(lens, bins=edges)
    return counts, edges


def _block_stats(
    storage: Any,
    fields: dict[str, Any],
    slots: np.ndarray,
    generations: np.ndarray,
    lens: np.ndarray,
    snapshot: str | None = None,
    refresh_lock: RefreshLock | None = None,
) -> tuple:
    """(kept, moments per field, per-episode sums of scalar fields) of a few whole episodes,
    every field read in one consistent read: an episode a writer rewrote meanwhile is left out
    (``kept`` False, sums 0), or raises ``SnapshotError`` in a ``snapshot`` view. The read
    holds ``refresh_lock`` (an hdf5 reader's: its ``refresh()`` closes the file)."""
    length = int(lens.max(initial=0))
    blocks = {n: np.empty((len(slots), length, *f.shape), f.dtype) for n, f in fields.items()}

    def read(items: np.ndarray) -> None:
        for name, block in blocks.items():
            for lo, hi in _runs(items):
                storage.read_spans(
                    name,
                    slots[lo:hi],
                    np.zeros(hi - lo, np.int64),
                    lens[lo:hi],
                    block[lo:hi],
                    False,
                    generations[lo:hi],
                )

    with (refresh_lock or RefreshLock())():
        kept = read_consistent(storage, slots.copy(), generations.copy(), read, snapshot=snapshot)
        check_same_buffer(storage)
    lens = np.where(kept, lens, 0)
    valid = np.arange(length)[None, :] < lens[:, None]
    moments = {n: _block_moments(block, lens) for n, block in blocks.items()}
    sums = {
        n: np.where(valid, block, 0).sum(axis=1, dtype=sketches.episode_sum_dtype(block.dtype))
        for n, block in blocks.items()
        if fields[n].shape == ()
    }
    return kept, moments, sums


def _merge_stats(parts: list[tuple]) -> tuple:
    kept = np.concatenate([p[0] for p in parts])
    moments = {n: _merge_moments([p[1][n] for p in parts]) for n in parts[0][1]}
    sums = {n: np.concatenate([p[2][n] for p in parts])[kept] for n in parts[0][2]}
    return kept, moments, sums


def stats(
    buffer: BufferView,
    fields: Sequence[str] | None = None,
    scheduler: Any = None,
    progress: bool | None = None,
    episodes: Sequence[int] | np.ndarray | None = None,
    exact: bool = False,
) -> BufferStats:
    """Statistics of the committed episodes (or of ``episodes``, a subset of their slots).

    Per data field: mean, std, min and max per feature dimension over valid timesteps only
    (padding never counts); the episode count, the lengths and their histogram; and for
    scalar fields (shape ``()``, such as rewards) the per-episode sums, i.e. returns.
    ``stats(buffer, ['obs'])['obs'].mean`` and ``.std`` are what an observation normalizer needs.

    ``exact=False``: sketched fields (numeric, at most ``sketches.MAX_FEATURES`` values per step)
    are merged from the per-episode sketches (``sketches.py``: an episode without one is
    sketched from its data, and a writable buffer stores it for the next call), and carry
    ``quantile()``; the other fields (images) are computed from the data. ``exact=True``: every
    field is computed from the data as one dask graph, each task reading a few whole episodes,
    every field at once, consistently: an episode a writer in another process rewrote during the
    computation is left out of every figure. ``progress`` as in ``get_all_data``.
    """
    names = list(buffer.schema.fields) if fields is None else _names(fields, "fields", "stats")
    _check_known(names, set(buffer.schema.fields), "field", "stats")
    if not len(buffer.valid_episodes()):
        check_settled(buffer)  # not empty: a writer kept changing every slot it holds while it was loaded
        raise ValueError("stats: the buffer has no committed episodes")
    chosen_slots = sketches.chosen_episodes(buffer, episodes, "stats")
    plan = _plan(buffer, chosen_slots)
    sketched = set(sketches.sketched_fields(buffer.schema)) if not exact and sketches.available() else set()
    from_data = [n for n in names if n not in sketched]
    kept = np.ones(len(plan.slots), bool)
    per_field: dict[str, FieldStats] = {}
    episode_sums: dict[str, np.ndarray] = {}
    if from_data:
        kept, per_field, episode_sums = _data_stats(buffer, from_data, plan, scheduler, progress)
    if len(from_data) < len(names):
        with RefreshLock(buffer)():  # reads the sketch blobs through the storage, as a block does
            sketch_kept, merged, sums = sketches.merge(buffer, [n for n in names if n in sketched], plan.slots[kept])
        per_field.update(merged)
        episode_sums = {n: v[sketch_kept] for n, v in episode_sums.items()} | sums
        kept[np.flatnonzero(kept)[~sketch_kept]] = False
    lens = plan.lens[kept]
    if len(lens) == 0:
        if buffer.storage.replaced():  # every episode gone with the buffer, not being rewritten
            raise BufferReplacedError(buffer.storage.location)
        raise ConcurrentWriteError(buffer.storage.location, plan.slots, RETRIES)
    counts, edges = _lens_histogram(lens)
    return BufferStats(
        num_episodes=len(lens),
        num_timesteps=int(lens.sum()),
        episode_lens=torch.from_numpy(lens.copy()),
        lens_histogram=(torch.from_numpy(counts), torch.from_numpy(edges)),
        fields={n: per_field[n] for n in names},
        episode_sums={n: torch.from_numpy(np.asarray(episode_sums[n])) for n in names if n in episode_sums},
    )


def _data_stats(
    buffer: Any, names: list[str], plan: _Plan, scheduler: Any, progress: bool | None
) -> tuple[np.ndarray, dict[str, FieldStats], dict[str, np.ndarray]]:
    """(kept, statistics per field, per-episode sums of scalar fields) of ``names`` over the
    planned episodes, read from the data as one dask graph."""
    chosen = {n: buffer.schema.fields[n] for n in names}
    per_task = _episodes_per_chunk(sum(f.step_nbytes for f in chosen.values()), plan.length, len(plan.slots))
    parts = [
        dask.delayed(_block_stats, pure=False)(
            buffer.storage,
            chosen,
            plan.slots[lo : lo + per_task],
            plan.generations[lo : lo + per_task],
            plan.lens[lo : lo + per_task],
            getattr(buffer, "snapshot_name", None),
            RefreshLock(buffer),
        )
        for lo in range(0, len(plan.slots), per_task)
    ]
    with dask_progress(progress, "stats"):
        kept, computed_moments, computed_sums = dask.compute(
            dask.delayed(_merge_stats)(parts), scheduler=scheduler or _default_scheduler()
        )[0]
    per_field = {}
    for name, (count, mean, m2, low, high) in computed_moments.items():
        if count == 0:
            continue
        f = buffer.schema.fields[name]
        shape, real = f.shape, f.dtype if f.dtype.kind == "f" else np.dtype(np.float32)
        per_field[name] = FieldStats(
            mean=torch.from_numpy(mean.reshape(shape).astype(real)),
            std=torch.from_numpy(np.sqrt(m2 / count).reshape(shape).astype(real)),
            min=torch.from_numpy(np.ascontiguousarray(low).reshape(shape)),
            max=torch.from_numpy(np.ascontiguousarray(high).reshape(shape)),
            count=int(count),
        )
    return kept, per_field, computed_sums
