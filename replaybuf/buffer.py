"""ReplayBuffer: episode bookkeeping and the write API, on any Storage.

The buffer validates input, stages episodes in progress (``staging.py``) and hands them to its
``Committer`` (``commit.py``), which keeps the per-episode bookkeeping mirrored in RAM and
commits them in the order that keeps every committed episode intact through a crash:

1. a reused circular slot is invalidated first (``episode_lens = 0``, ``_generation = 0``);
2. the data slabs are written;
3. meta rows, then ``_generation`` and ``episode_lens`` are published;
4. the counters object is committed; the step log of the episode is cleared.

A reader trusts only slots whose published length is > 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import numpy as np

from . import metasums, snapshots, video
from .attrs import BufferAttrs
from .commit import Committer, CountersNotWritten
from .consistency import REFRESH_READS, read_consistent, replanner, snapshot_gone, stored_bookkeeping
from .editlog import Write
from .inputs import (
    batch_value,
    cast_values,
    check_flag,
    check_index,
    fill_value,
    fit_shape,
    step_value,
    tensor_to_numpy,
    to_numpy,
)
from .metasums import META_SUM
from .schema import Field, Schema, parse_field
from .staging import EpisodeGroup
from .storage import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_HOT_BYTES,
    STATE_KEY,
    ArrayBase,
    BufferLockedError,
    BufferNotFoundError,
    BufferReplacedError,
    CachedStorage,
    CompactionSummary,
    LostLengthError,
    Storage,
    StorageError,
    WrappedArray,
    bookkeeping_fields,
    check_bookkeeping,
    check_lost_lengths,
    check_state,
    collecting,
    committed_without_length,
    detect_backend,
    empty_state,
    fill_beyond,
    make_storage,
    missing_folder_hint,
    new_uuid,
    seed_h5_hint,
    unpublished_slots,
    with_cache,
)
from .view import BufferView, CommittedViews, FieldViews, mirror_lock, read_only_message

if TYPE_CHECKING:  # torch, dask and the loaders are imported by the methods that use them
    from .collector import EpisodeCollector

_HIDDEN_META = ("_generation", "_revision", "_meta_sum")
# the bookkeeping arrays a slot's ``_meta_sum`` entry covers (with its meta fields), and the entry
_SUMMED = ("_generation", "episode_lens", META_SUM)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _fields_as_keywords(method: _Method) -> _Method:
    """``method`` takes its fields as keywords only: a dict passed as such (``store_episode(episode)``)
    is refused naming the ``**`` it needs, where Python said only "takes 1 positional argument
    but 2 were given"."""

    @functools.wraps(method)
    def checked(self: ReplayBuffer, *args: Any, **kwargs: Any) -> Any:
        if args:
            given = "a dict" if len(args) == 1 and isinstance(args[0], Mapping) else f"{len(args)} positional value(s)"
            raise TypeError(
                f"{method.__name__}() takes the fields as keywords ({method.__name__}(state=..., action=...)), "
                f"got {given}: pass a dict of them as {method.__name__}(**values)"
            )
        return method(self, **kwargs)

    return cast(_Method, checked)


def _serialized(method: _Method) -> _Method:
    """``method`` runs holding its object's lock (``ReplayBuffer._lock``): one object shared by
    threads (an actor storing, a learner sampling, updating priorities or closing it) runs one
    write at a time, and no read of it beside (``view.mirror_lock``). Unlocked, two commits took
    the same slot and counters (episodes lost, slots left failing their checksums), a read
    returned rows of two episodes, and close() closed an HDF5 file under a read."""

    @functools.wraps(method)
    def locked(self: ReplayBuffer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(_Method, locked)


def _given_settings(
    max_episodes: Any, max_timesteps: Any, meta_fields: Any, circular: bool, fields: Any = None
) -> dict[str, Any]:
    """The config settings a reopen passed without a whole config (None and ``circular=False``
    are the defaults), as ``Schema`` attributes."""
    given: dict[str, Any] = {}
    if fields is not None:
        if not isinstance(fields, dict):
            raise TypeError(f"fields must be a dict of name -> spec, got {fields!r}")
        given["fields"] = {n: parse_field(n, s) for n, s in fields.items()}
    if max_episodes is not None:
        given["max_episodes"] = max_episodes
    if max_timesteps is not None:
        given["max_timesteps"] = max_timesteps
    if circular:
        given["circular"] = True
    if meta_fields is not None:
        if not isinstance(meta_fields, dict):
            raise TypeError(f"meta_fields must be a dict of name -> spec, got {meta_fields!r}")
        given["meta_fields"] = {n: parse_field(n, s, meta=True) for n, s in meta_fields.items()}
    return given


def as_writer(buffer: BufferView, call: str) -> ReplayBuffer:
    """``buffer`` when it takes the write ``call``: a view with no writer of its own
    (ConcatReplayBuffer) raises NotImplementedError, a buffer opened read-only ValueError."""
    if not isinstance(buffer, ReplayBuffer):
        raise NotImplementedError(read_only_message(type(buffer).__name__, call))
    buffer._check_writable(call)
    return buffer


class MetaView(WrappedArray):
    """``buffer.meta_data[name]``: reads from the buffer's snapshot, writes through to storage."""

    def __init__(self, buffer: BufferView, name: str):
        self._buffer, self._name = buffer, name

    def _wrapped(self) -> np.ndarray:
        return self._buffer.meta_values(self._name)

    def __getitem__(self, key: Any) -> np.ndarray:
        value = self._wrapped()[key]
        return value.copy() if isinstance(value, np.ndarray) else value

    def __setitem__(self, key: Any, value: Any) -> None:
        buffer = as_writer(self._buffer, f"meta_data[{self._name!r}][...] = ...")
        with buffer._lock:
            self._assign(buffer, key, value)

    def _assign(self, buffer: ReplayBuffer, key: Any, value: Any) -> None:
        if self._name in buffer._bookkeeping:
            raise ValueError(
                f"meta_data[{self._name!r}] is read-only: a slot's length is published by committing "
                "an episode (store / store_episode) and reset by clear()"
            )
        field = buffer.schema.meta_fields[self._name]
        if _reaches_features(key):
            buffer._set_meta(self._name, *self._assigned_rows(buffer, field, key, value))
            return
        try:
            # flat: a key of more dimensions ([[0, 1]], True) names its slots in numpy's order
            episodes = np.arange(buffer.max_episodes)[key].reshape(-1)
        except (IndexError, OverflowError) as e:  # OverflowError: an index past 2**63 - 1
            raise ValueError(f"meta_data[{self._name!r}][{key!r}]: {e} (max_episodes {buffer.max_episodes})") from None
        array = to_numpy(value, self._name)
        try:  # one value for every episode, as store_meta_datapoint takes it, or one per episode
            fitted = fit_shape(array, field, 0)[None] if array.ndim <= len(field.shape) else fit_shape(array, field, 1)
            values = np.broadcast_to(fitted, (len(episodes), *field.shape))
        except ValueError:
            # else by numpy's rules, as the seed's memmap takes it: [1, 2] into each row of a
            # (2, 2) field, a scalar into every item
            target = (*np.shape(np.arange(buffer.max_episodes)[key]), *field.shape)
            try:
                values = np.broadcast_to(array, target).reshape(len(episodes), *field.shape)
            except ValueError as e:
                raise ValueError(
                    f"meta_data[{self._name!r}][{key!r}]: value of shape {np.shape(value)} does not fit "
                    f"{len(episodes)} episode(s) of shape {field.shape} ({e})"
                ) from None
        buffer._set_meta(self._name, episodes, cast_values(values, field))

    def _assigned_rows(self, buffer: ReplayBuffer, field: Field, key: Any, value: Any) -> tuple[np.ndarray, np.ndarray]:
        """(the episodes, their whole new rows) of ``meta_data[name][key] = value`` for a key into
        the feature axes (``[:, 0]``, ``[..., 1]``), with numpy's semantics: the other items of
        each row keep their values (the staged ones for episodes in progress)."""
        rows = np.array(self._wrapped())
        group = buffer._group
        if group is not None and self._name in group.meta:
            rows[group.slots] = group.meta[self._name]
        episode_of = np.broadcast_to(np.arange(len(rows)).reshape(-1, *[1] * len(field.shape)), rows.shape)
        array = cast_values(to_numpy(value, self._name), field)
        try:
            episodes = np.unique(episode_of[key])
            rows[key] = array
        except (IndexError, ValueError) as e:
            raise ValueError(f"meta_data[{self._name!r}][{key!r}]: {e} (meta shape {rows.shape})") from None
        return episodes, rows[episodes]

    def __repr__(self) -> str:
        return f"<meta {self._name} {self._wrapped()!r}>"


def _reaches_features(key: Any) -> bool:
    """Whether an index of ``meta_data[name]`` reaches past the episode axis (``[:, 0]``, ``[..., 1]``)."""
    keys = key if isinstance(key, tuple) else (key,)
    return len(keys) > 1 or any(k is Ellipsis or k is None for k in keys)


def _episode_index(key: Any, size: int) -> tuple[np.ndarray, Any]:
    """(the sorted slots ``key`` picks along the episode axis, the key that picks the same rows,
    in the same order and with the same numpy semantics, from a block of just those slots)."""
    picked = np.arange(size)[key]  # ints, slices, int arrays and masks, with numpy's errors
    if isinstance(key, slice):
        step = 1 if key.step is None else key.step
        return (picked, slice(None)) if step > 0 else (picked[::-1], slice(None, None, -1))
    if np.ndim(picked) == 0:
        return np.atleast_1d(picked), 0
    unique = np.unique(picked)
    return unique, np.searchsorted(unique, picked)


def _time_index(key: Any, size: int) -> tuple[int, int, Any]:
    """(t0, t1, key): the step range ``key`` touches along the time axis and the key that picks
    the same steps from a block of steps ``t0 .. t1``."""
    picked = np.arange(size)[key]
    if picked.size == 0:
        return 0, 0, (slice(0, 0) if isinstance(key, slice) else picked)
    t0, t1 = int(picked.min()), int(picked.max()) + 1
    if not isinstance(key, slice):
        return t0, t1, picked - t0 if np.ndim(picked) else int(picked) - t0
    step = 1 if key.step is None else key.step
    stop = int(picked[-1]) - t0 + (1 if step > 0 else -1)
    return t0, t1, slice(int(picked[0]) - t0, None if stop < 0 else stop, step)


class DataView(ArrayBase):
    """``buffer.data[name]``: numpy-style indexing of (episode, time, *shape).

    On a read-only buffer (a reader beside a writer) every read is consistent: each slot read
    holds its committed episode (the default past its length) or, when empty or being rewritten, zeros,
    never parts of two episodes (``consistency.py``). On a writable buffer reads are the
    storage's (the writer sees its episode in progress); writes go through ``Committer.editing``.
    """

    def __init__(self, buffer: BufferView, name: str):
        self._buffer, self._name = buffer, name
        field = buffer.schema.fields[name]
        self.shape = (buffer.schema.max_episodes, buffer.schema.max_timesteps, *field.shape)
        self.dtype = np.dtype(field.dtype)

    def __getitem__(self, key: Any) -> np.ndarray:
        slots, t0, t1, local = self._block(key)
        return self._read(slots, t0, t1)[local]

    def _block(self, key: Any) -> tuple[np.ndarray, int, int, tuple]:
        """(sorted slots, t0, t1, local key): the rows ``key`` touches and the key that indexes
        a block of them (len(slots), t1 - t0, *shape) as ``key`` indexes the whole array."""
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = next(i for i, k in enumerate(key) if k is Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1 :]
        if any(k is None for k in key[:2]) or (np.ndim(key[0]) > 1 and np.asarray(key[0]).dtype == bool):
            return np.arange(self.shape[0]), 0, self.shape[1], key  # new axes, masks over several axes
        episode_key, time_key = (key + (slice(None), slice(None)))[:2]
        slots, local_episodes = _episode_index(episode_key, self.shape[0])
        t0, t1, local_steps = _time_index(time_key, self.shape[1])
        return slots, t0, t1, (local_episodes, local_steps) + tuple(key[2:])

    def _read(self, slots: np.ndarray, t0: int, t1: int) -> np.ndarray:
        """Steps ``t0 .. t1`` of ``slots`` (sorted, unique) as (len(slots), t1 - t0, *shape):
        a committed episode's steps then the field's default past its length, zeros for an
        empty slot."""
        buffer, storage = self._buffer, self._buffer.storage
        out = np.zeros((len(slots), t1 - t0, *self.shape[2:]), self.dtype)
        if not buffer.read_only:
            if len(slots):
                with mirror_lock(buffer, writer_only=True):  # no commit of another thread meanwhile
                    out[:] = storage.read_rows(self._name, slots, t0, t1)
                    self._fill_past_lengths(out, np.asarray(buffer.episode_lens)[slots], t0)
                    if isinstance(buffer, ReplayBuffer):  # a writer's episode in progress
                        buffer._overlay_staged(self._name, slots, t0, out)
            return out

        def read(items: np.ndarray) -> None:
            out[items] = storage.read_rows(self._name, slots[items], t0, t1, generations[items])

        # a reader whose refresh closes its file (hdf5): another thread's refresh waits for the read
        with mirror_lock(buffer, writer_only=True):
            planned = stored_bookkeeping(storage, (), slots)
            generations, lens = planned["_generation"], np.array(planned["episode_lens"], np.int64)
            if (generations > buffer.generations.max(initial=0)).any() and storage.replaced():
                # episodes newer than the last refresh may be another buffer's (every backend
                # checks here; memmap and hdf5 also at each read's re-check)
                raise BufferReplacedError(storage.location)
            snapshot = getattr(buffer, "snapshot_name", None)
            if snapshot is not None:  # a snapshot view reads its own episodes only, or raises
                recorded = np.asarray(buffer.generations, np.int64)[slots]
                gone = (recorded > 0) & (generations != recorded)
                if gone.any():
                    raise snapshot_gone(snapshot, storage.location, slots[gone])
                generations[recorded == 0] = 0
            kept = read_consistent(buffer, slots.copy(), generations, read, replanner(storage, slots, lens))
            # a buffer deleted and created again counts generations from 1 again, so they can name
            # its episodes: only this tells (a stat on a local folder, a GET on an object store)
            if storage.replaced(cheap_only=storage.is_local):
                raise BufferReplacedError(storage.location)
            out[~kept] = 0
            self._fill_past_lengths(out, np.where(kept, lens, 0), t0)
            return out

    def _fill_past_lengths(self, out: np.ndarray, lens: np.ndarray, t0: int) -> None:
        """Set the steps of ``out`` (read from step ``t0``) at or past each committed episode's
        length to the field's default, as ``get_all_data`` and the datasets give them and the
        seed's slots hold them: memmap and hdf5 store zeros there, zarr the default up to its
        chunk's end only. Empty slots (length 0) stay zeros."""
        lens = np.asarray(lens, np.int64)
        ends = lens - t0
        short = np.flatnonzero((lens > 0) & (ends < out.shape[1]))
        if len(short):
            fill = self._buffer.schema.fields[self._name].fill
            for i in short.tolist():
                out[i, max(int(ends[i]), 0) :] = fill

    def __setitem__(self, key: Any, value: Any) -> None:
        """Write in place inside ``Committer.editing``: ``value`` is checked as every write
        is, then the rows ``key`` touches are read, assigned with numpy's indexing and
        broadcasting and written back whole (and into the steps of an episode in progress)."""
        buffer = as_writer(self._buffer, f"data[{self._name!r}][...] = ...")
        with buffer._lock:
            self._assign(buffer, key, value)

    def _assign(self, buffer: ReplayBuffer, key: Any, value: Any) -> None:
        # checked as every write is (no NaN into ints, no wrapping out-of-range values): numpy's
        # assignment would cast them silently; the block read after holds this dtype already
        array = cast_values(to_numpy(value, self._name), buffer.schema.fields[self._name])
        try:
            slots, t0, t1, local = self._block(key)
        except (IndexError, OverflowError) as e:  # OverflowError: an index past 2**63 - 1
            raise IndexError(f"data[{self._name!r}][{key!r}]: {e} (shape {self.shape})") from None
        rows = self._read(slots, t0, t1)
        try:
            rows[local] = array
        except ValueError as e:
            raise ValueError(
                f"data[{self._name!r}][{key!r}] = value of shape {array.shape}: {e} "
                f"(expected a value that broadcasts to the selection's shape {np.shape(rows[local])})"
            ) from None
        if len(slots) and t1 > t0:
            rows = buffer._past_committed_ends(self._name, slots, t0, rows)
            buffer._commit.edit(
                [Write("rows", self._name, slots, rows, t0)],
                staged=lambda: buffer._edit_staged(steps=[(self._name, slots, t0, rows)]),
            )

    def __repr__(self) -> str:
        return f"<data {self._name} shape={self.shape} dtype={self.dtype}>"


def _no_buffer_error(
    storage: Storage, shown: str, backend: str | None, storage_options: dict | None, detail: str = ""
) -> BufferNotFoundError:
    """The error for an open of ``shown`` (as the caller named it) where ``storage`` finds no
    buffer: naming the backend the folder does hold when ``backend`` named another one."""
    other = detect_backend(storage.location, storage_options) if backend is not None else None
    if other is not None and other != storage.backend_name:  # the backend named is the wrong one
        return BufferNotFoundError(
            f"no {storage.backend_name!r} buffer at {shown!r}: it holds a {other!r} buffer; "
            f"open it with backend={other!r}, or leave backend out"
        )
    from .actors import shards_hint  # actors imports this module

    return BufferNotFoundError(
        f"no replaybuf buffer found at {shown!r}{detail}"
        + missing_folder_hint(storage.location)
        + seed_h5_hint(storage.location)
        + shards_hint(shown)
        + _unlistable_hint(storage)
    )


def _unlistable_hint(storage: Storage) -> str:
    """Why an object-store location cannot be read at all (a missing bucket, a denied listing),
    as the end of a "no buffer found" message; else ''. A GET of an absent key answers the same
    for a missing bucket as for an empty prefix, so the listing tells them apart."""
    kv = getattr(storage, "kv", None)
    if kv is None or "://" not in storage.location or storage.location.startswith(("memory://", "file://")):
        return ""
    try:
        kv.list_prefix("")
    except StorageError as e:
        return f"; listing it failed: {e}"
    return ""


class ReplayBuffer(CommittedViews):
    """An episode store: write steps or whole episodes, read them back as tensors and batches.

    The signature is memmap-replay-buffer's: ``fields`` map names to specs such as ``'float'``,
    ``('int', 2)`` or ``('float', (3, 16, 16), 0.)``; ``meta_fields`` are per episode.
    ``overwrite=True`` (the default, as in the seed) erases an existing buffer at ``folder``,
    only what it owns there: a folder or prefix holding anything else raises
    ``ForeignEntriesError`` and nothing is deleted. Pass ``overwrite=False`` or use
    ``from_folder`` to reopen one.

    Parameters beyond the seed: ``storage_options`` for URLs (``s3://``, ``gs://``,
    ``memory://``), ``backend`` (``'zarr'`` default, ``'memmap'``, ``'hdf5'``), ``fsync``
    (power-loss durability of commits and the step log, at a cost per write) and ``break_lock``.
    ``cache``, ``cache_dir``, ``cache_size``: the local read cache of decoded rows
    (``storage/_cache.py``), on by default for read-only buffers on object stores, asked for
    with ``cache='disk'`` elsewhere, off with ``cache=False``. ``hot_bytes``: a writer of a zarr
    buffer on local disk stores recent episodes of image fields raw (hot) and compresses the
    oldest in a background thread once their bytes exceed it (``storage/_hot.py``);
    ``compact()`` and ``close()`` compress them all; 0 compresses every episode as it is written.

    A buffer takes one writer at a time: a writable open takes the buffer's writer lease before
    it erases or writes anything, and ``close()`` gives it back; a writer in another process (or
    an ``overwrite=True`` open in this one) gets ``BufferLockedError`` (``storage/lease.py``).
    Writable opens within this process share the lease and take turns (``_take_turn``): none
    commits or overwrites another's episodes, and a write while another object has an episode
    in progress is refused.
    ``break_lock=True`` takes an object-store lease from a writer that stopped without closing,
    without waiting for it to expire.

    ``snapshot='name'`` opens a read-only view of exactly the episodes ``buffer.snapshot('name')``
    recorded (``snapshots.py``). A writer refuses (``SnapshotHeldError``, before writing) to
    overwrite, clear or drop an episode a snapshot holds; ``drop_snapshots_on_overwrite=True``
    drops those snapshots instead, with a warning.
    """

    def __init__(
        self,
        folder: str | os.PathLike | Storage,
        max_episodes: int | None = None,
        max_timesteps: int | None = None,
        fields: dict[str, Any] | None = None,
        meta_fields: dict[str, Any] | None = None,
        circular: bool = False,
        overwrite: bool = True,
        read_only: bool = False,
        flush_every_store_step: int = 1,
        *,
        storage_options: dict | None = None,
        backend: str | None = None,
        fsync: bool = False,
        break_lock: bool = False,
        cache: bool | str | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        hot_bytes: int = DEFAULT_HOT_BYTES,
        snapshot: str | None = None,
        drop_snapshots_on_overwrite: bool = False,
    ):
        if isinstance(hot_bytes, bool) or not isinstance(hot_bytes, (int, np.integer)) or hot_bytes < 0:
            raise ValueError(f"hot_bytes must be a number of bytes >= 0 (0: no hot tier), got {hot_bytes!r}")
        # True / False read as the flag the name suggests, as in the seed: 1 (every step) / 0 (never)
        if not isinstance(flush_every_store_step, int) or flush_every_store_step < 0:
            raise ValueError(f"flush_every_store_step must be an int >= 0, got {flush_every_store_step!r}")
        flush_every_store_step = int(flush_every_store_step)
        flags = {"overwrite": overwrite, "read_only": read_only, "circular": circular, "fsync": fsync}
        flags |= {"break_lock": break_lock, "drop_snapshots_on_overwrite": drop_snapshots_on_overwrite}
        for name, value in flags.items():
            check_flag(name, value)
        self.read_only = bool(read_only) or snapshot is not None
        self._rlock, self._lock_pid = threading.RLock(), os.getpid()  # ``_lock``
        self._closed = False  # by close(): the writer lease is given back, writes are refused
        self.snapshot_name = None if snapshot is None else snapshots.check_name(snapshot)
        self.drop_snapshots_on_overwrite = bool(drop_snapshots_on_overwrite)
        self.flush_every_store_step = flush_every_store_step
        self.store_step = 0  # ``store()`` calls made through this object, as the seed counts them
        self.storage = with_cache(
            make_storage(folder, backend, storage_options, fsync=fsync) if not isinstance(folder, Storage) else folder,
            self.read_only,
            cache,
            cache_dir,
            cache_size,
        )
        location = self.storage.location
        self.folder = location if "://" in location else Path(location)
        # fields without max_episodes or max_timesteps, to a reopen (``from_folder(path, fields=...)``):
        # settings to check against the stored config, as those given without fields; to a create,
        # Schema.build refuses the missing one with a message naming it
        partial = fields is not None and None in (max_episodes, max_timesteps) and (self.read_only or not overwrite)
        wanted = (
            None
            if fields is None or partial
            else Schema.build(fields, meta_fields, max_episodes, max_timesteps, circular)  # type: ignore[arg-type]
        )
        # settings passed without a whole config (a reopen) must be the stored ones, not silently ignored
        self._given = (
            {}
            if wanted is not None
            else _given_settings(max_episodes, max_timesteps, meta_fields, circular, fields if partial else None)
        )

        if self.read_only:
            if not self.storage.exists():
                raise _no_buffer_error(self.storage, location, backend, storage_options, "; nothing to open read-only")
            self._setup(self._open(wanted))
            return
        held: list[str] = []  # overwrite=True: snapshots erased with the episodes they hold
        if overwrite or not self.storage.exists():
            creating = self._check_creatable(wanted)
            self.storage.check_creatable()  # a refused create takes no lease: it writes nothing
            self.storage.check_schema(creating)
            self._check_codecs(creating)
            if overwrite and self.storage.exists():
                held = snapshots.check_overwrite(self.storage, self.drop_snapshots_on_overwrite)
        elif wanted is not None or self._given:
            self._refuse_another_config(wanted)  # before the lease: a refused reopen writes nothing
        self.storage.acquire_writer(break_lock, erase=overwrite)
        lease = self.storage.held_lease
        if lease is not None:  # one lock for the opens sharing the lease (``WriterLease.lock``)
            self._rlock = lease.lock
        with self._lock:
            self._open_writable(wanted, overwrite, held, hot_bytes)

    def _open_writable(self, wanted: Schema | None, overwrite: bool, held: list[str], hot_bytes: int) -> None:
        """The rest of a writable open, once the writer lease is taken, holding the lock of
        the opens sharing it: another object's write in another thread waits for it."""
        try:
            self._setup(self._create(wanted) if overwrite or not self.storage.exists() else self._open(wanted))
            snapshots.warn_dropped(self.storage.location, held)
            # the step log of an open sharing the lease is a live writer's episode in progress
            # (an erasing open's is its own new buffer: the opens before it may not write)
            if self.storage.writer_shared and not overwrite:
                gc.collect()  # an object dropped (``del``) that a cycle of the user's keeps
            shared = self.storage.writer_shared and not overwrite
            self._commit.recover(step_log=not shared)
            if not shared:
                # an open sharing the lease writes every episode compressed: a second tier's
                # compactor would not see the other object's writes (``_take_turn``)
                self.storage.start_hot_tier(int(hot_bytes), self._meta["_generation"])
        except BaseException:
            # a refused open holds no file: an HDF5 file left open for writing stays locked
            # against every other process (and marked open) while the exception lives
            self._closed = True  # nothing for ``__del__`` to flush
            with contextlib.suppress(Exception):
                self.storage.close()
            self.storage.release_writer()
            raise

    def _open(self, wanted: Schema | None) -> Schema:
        schema = self.storage.open(read_only=self.read_only)
        self.storage.warn_ignored_options()
        if wanted is not None:
            schema.check_matches(wanted, self.storage.location)
        self._check_given(schema)
        return schema

    def _check_given(self, stored: Schema) -> None:
        """ValueError when a setting passed without ``fields`` (``from_folder(path, circular=True)``,
        ``ReplayBuffer(path, max_episodes=n, overwrite=False)``) is not the stored one: opening
        with the stored value instead ignored what the caller asked for. ``circular=False``, the
        default, is not told from an omitted one."""
        if self._given:
            stored.check_matches(dataclasses.replace(stored, **self._given), self.storage.location)

    def _refuse_another_config(self, wanted: Schema | None) -> None:
        """ValueError when the config stored here is not ``wanted`` (or the settings given
        without fields, ``_check_given``), read through a read-only
        open of a new storage object, so that a refused reopen takes no lease and touches no
        file. Any other failure of that open is left to the writable open, which reports it."""
        probe = self.storage.fresh()
        try:
            stored = probe.open(read_only=True)
        except Exception:
            return
        finally:
            with contextlib.suppress(Exception):
                probe.close()
        if wanted is not None:
            stored.check_matches(wanted, self.storage.location)
        self._check_given(stored)

    def _check_creatable(self, schema: Schema | None) -> Schema:
        if schema is None:
            where = self.storage.location
            if self.storage.exists():  # overwrite=True (the default) asks for a new buffer
                raise ValueError(
                    f"{where!r} holds a buffer: reopen it with ReplayBuffer.from_folder({where!r}) (or pass "
                    "overwrite=False); creating a new one there needs max_episodes, max_timesteps and fields"
                )
            other = detect_backend(where, self.storage.storage_options)
            if other is not None and other != self.storage.backend_name:  # backend= named the wrong one
                raise BufferNotFoundError(
                    f"no {self.storage.backend_name!r} buffer at {where!r}: it holds a {other!r} buffer; "
                    f"open it with backend={other!r}, or leave backend out"
                )
            raise BufferNotFoundError(
                f"no buffer exists at {where!r}: pass max_episodes, max_timesteps and fields to create one"
            )
        schema.check_defaults()
        schema.check_names()
        return schema

    def _check_codecs(self, schema: Schema) -> None:
        """Warn, for a new buffer, of a per-field ``compressor`` its backend does not apply: the
        memmap and hdf5 backends store every field as one raw (or whole-file compressed) array,
        so it is kept in the config (a reopen with the same fields matches) and not applied."""
        if self.storage.supports_field_codecs:
            return
        ignored = {f.name: f.compressor for f in (*schema.fields.values(), *schema.meta_fields.values())}
        ignored = {n: c for n, c in ignored.items() if c not in (None, "none")}
        if ignored:
            how = (
                "compresses every field alike (storage_options={'compression': 'gzip'} or h5py_compression=)"
                if self.storage.backend_name == "hdf5"
                else "stores fields raw"
            )
            warnings.warn(
                f"per-field compressors {ignored} are not applied by the {self.storage.backend_name!r} backend, "
                f"which {how}; the zarr backend (the default) applies them",
                UserWarning,
                stacklevel=3,
            )

    def _create(self, wanted: Schema | None) -> Schema:
        schema = self._check_creatable(wanted)
        schema = dataclasses.replace(schema, uuid=new_uuid())  # the identity of this buffer's read cache
        counted = self._generations_before()
        self.storage.create(schema, overwrite=True)
        if counted:  # its first episode gets generation counted + 1
            self.storage.commit_state({**empty_state(), "total_episodes": counted})
        return schema

    def _generations_before(self) -> int:
        """Where the new buffer's generations count on from: above every generation the buffer
        it replaces published, so that a reader still reading that one never finds a planned
        generation again in a slot of the new one (``consistency.py``); 0 where none is stored.
        Where the old buffer cannot be read (damaged, an erase cut short) its generations are
        unknown: the microseconds since the epoch then, above those of every buffer created
        here before (each counted from 0, or from its own creation time, and no writer commits
        an episode per microsecond)."""
        if not self.storage.exists():
            return 0
        try:
            return self.storage.published_generations()
        except Exception:  # any failure to read it: its generations are unknown
            return time.time_ns() // 1000

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        read_only: bool = False,
        storage_options: dict | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> Self:
        """Reopen the buffer stored at ``folder`` with its stored config; ``snapshot='name'`` opens
        a read-only view of exactly the episodes that snapshot recorded."""
        if "overwrite" in kwargs:  # said "ReplayBuffer() got multiple values for keyword argument 'overwrite'"
            raise TypeError(
                f"from_folder() opens the buffer stored at {os.fspath(folder)!r} and takes no overwrite "
                f"(got overwrite={kwargs['overwrite']!r}); to erase it and create another: "
                "ReplayBuffer(folder, max_episodes=..., max_timesteps=..., fields=..., overwrite=True)"
            )
        storage = make_storage(folder, backend, storage_options, fsync=kwargs.pop("fsync", False))
        if not storage.exists():
            raise _no_buffer_error(storage, os.fspath(folder), backend, storage_options)
        return cls(storage, overwrite=False, read_only=read_only, **kwargs)

    @staticmethod
    def shard(root: str | os.PathLike, index: int, **kwargs: Any) -> ReplayBuffer:
        """Open or create actor ``index``'s own buffer under ``root`` (``root/actor-NNN``), for
        parallel writers; ``ConcatReplayBuffer(root)`` reads all shards as one."""
        from .actors import open_shard

        return open_shard(root, index, **kwargs)

    # ---- setup --------------------------------------------------------------------------

    def _setup(self, schema: Schema) -> None:
        self.schema = schema
        self._bookkeeping = bookkeeping_fields(schema)
        self._meta_fields = {**schema.meta_fields, **self._bookkeeping}
        self._listed_meta_names = tuple(name for name in self._meta_fields if name not in _HIDDEN_META)
        self._commit: Committer = Committer(self.storage, schema, self.flush_every_store_step)
        self._commit.held.drop_on_overwrite = self.drop_snapshots_on_overwrite
        self._snapshot = (
            None if self.snapshot_name is None else snapshots.load(self.storage, self.snapshot_name, schema)
        )
        # the per-episode values the last refresh found matching their checksums, and where
        self._verified: tuple[dict[str, np.ndarray], np.ndarray] | None = None
        # the slots the last refresh found a writer changing, when it found no episode besides
        self._unsettled = np.zeros(0, np.int64)
        self._fills = {n: fill_value(f) for n, f in schema.fields.items()}
        for fill in self._fills.values():
            fill.flags.writeable = False
        self._group: EpisodeGroup | None = None
        self._group_thread = threading.get_ident()  # the thread that began ``_group``
        self._group_scoped = False  # ``_group`` was begun by a one_episode/batched_episode block
        self._store_step = 0
        self._pending_steps = 0  # ``timestep_index = n`` set before the group it applies to began
        self.refresh()

    @property
    def data(self) -> FieldViews[DataView]:
        """Each data field's numpy-style view by name: ``buffer.data["obs"][episode, t]``."""
        return FieldViews("data", self.schema.fields, functools.partial(DataView, self))

    @property
    def meta_data(self) -> FieldViews[MetaView]:
        """Each meta field's view by name (``episode_lens`` included): ``buffer.meta_data["task"][slot]``."""
        return FieldViews("meta_data", self._listed_meta_names, functools.partial(MetaView, self))

    @_serialized
    def refresh(self) -> ReplayBuffer:
        """Reload counters and per-episode arrays, and drop this process's cached reads: a
        reader picks up what writers committed or updated since. A reader whose buffer another
        process replaced (``overwrite=True``, an upgrade) since opens the new one when its config
        is the reader's (``_reopen``); another config, or a buffer erased, raises
        ``BufferReplacedError``."""
        if not self.read_only:  # the counters of this writer's last episodes may still wait
            self._commit.flush_counters()
        try:
            state, meta = self._load_bookkeeping()
        except Exception:
            # an overwrite erasing the buffer while (or before) it was loaded: not damage
            if self.read_only and self.storage.replaced():
                return self._reopen()
            raise
        if self.read_only and self.storage.replaced():  # what was loaded may be the new one's
            return self._reopen()
        if self._snapshot is not None:  # a snapshot view: only its episodes, its counters
            # built before it is kept: a view refused (SnapshotError) keeps its snapshot's
            # bookkeeping, never the episodes that overwrote it
            meta, state = snapshots.view(self._snapshot, self.schema, meta, self.storage)
        self._state, self._meta = state, meta
        if self._snapshot is None and self.read_only:  # the counters of a live writer's last episodes may still wait
            self._state = self._commit.caught_up(self._state)
        return self

    def _load_bookkeeping(self, again: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The counters and per-episode arrays as stored now, checked (``refresh``). A reader
        that finds slots mid-change and no live writer reads everything ``again`` once: the
        writer may have finished them and let go after the reads (its close)."""
        # the counters first: a commit publishes its length before it counts its generation
        state = check_state(self.storage.load_state(), self.schema, self.storage.describe_key(STATE_KEY))
        self.storage.drop_caches()
        summed = self.storage.keeps_meta_sums  # an earlier format's meta values are not checksummed
        names = ("_generation", "episode_lens", "_revision", *self.schema.meta_fields, *((META_SUM,) if summed else ()))
        as_read: dict[str, np.ndarray] = {}
        damaged, checked = np.zeros(0, np.int64), np.zeros(self.max_episodes, bool)
        for _ in range(REFRESH_READS):
            damaged = np.zeros(0, np.int64)
            if self.read_only:
                # a slot a writer changed while it was loaded reads as empty until the next refresh
                meta = stored_bookkeeping(self.storage, names[2:], as_read=as_read)
                # read again after its meta values: a slot whose revision moved was edited meanwhile
                edited = np.asarray(self.storage.read_meta("_revision")) != meta["_revision"]
            else:
                meta = as_read = {n: self.storage.read_meta(n) for n in names}
                edited = np.zeros(self.max_episodes, bool)
            # a commit landing during the reads can leave a length without its generation for a
            # moment; one that stays is damage (a lost _generation chunk), refused below
            if len(unpublished_slots(meta["episode_lens"], meta["_generation"])):
                continue
            # as is a slot's length cleared before its generation (a reuse, a drop); one that
            # stays without a live writer is damage (a zeroed length), refused below
            if self.read_only and len(committed_without_length(meta["episode_lens"], as_read["_generation"], state)):
                continue
            if self.read_only and not (meta["episode_lens"] > 0).any() and as_read["moved"].any():
                continue  # a writer changed every slot it holds while they were read
            checked = (meta["episode_lens"] > 0) & ~edited
            if summed:
                damaged = metasums.settle(self.storage, self.schema, meta, self._unverified(meta, checked))
            if not len(damaged):
                break
        unpublished = unpublished_slots(meta["episode_lens"], meta["_generation"])
        unsettled = committed_without_length(meta["episode_lens"], as_read["_generation"], state)
        beside_writer = (
            self.read_only
            and bool(len(unpublished) or len(unsettled))
            and self.storage.writer_lease().live_holder() is not None
        )
        if self.read_only and again and (len(unpublished) or len(unsettled)) and not beside_writer:
            return self._load_bookkeeping(again=False)
        if len(unpublished) and beside_writer:
            # a live writer between a reuse's (or a drop's) two writes, slower than the re-reads
            # (an hdf5 flush on a loaded machine): those slots read as empty, as a slot changed
            # during the reads does; with no writer running, a length without a generation stays
            # damage (a lost _generation chunk), refused below
            meta["episode_lens"] = lens = meta["episode_lens"].copy()
            lens[unpublished] = 0
        moving = np.union1d(np.flatnonzero(as_read.get("moved", ())), unpublished) if self.read_only else ()
        self._unsettled = np.zeros(0, np.int64) if (meta["episode_lens"] > 0).any() else np.asarray(moving, np.int64)
        lens = meta["episode_lens"]
        if not metasums.checking() and len(unpublished):
            # verify --repair's open: slots that lost their generation are repaired as slots with
            # damaged meta values are (left out of the counters, then dropped), not refused
            damaged = np.union1d(damaged, unpublished)
            lens = np.where(np.isin(np.arange(len(lens)), unpublished), 0, lens)
        generations = meta["_generation"]
        if not metasums.checking() and len(damaged):
            # verify --repair's open: the generation of a slot failing its meta checksum (one
            # with a flipped sign bit reads negative) is restored by the repair, or the episode
            # dropped, not refused here
            generations = np.where(np.isin(np.arange(len(generations)), damaged), 1, generations)
        check_bookkeeping(lens, generations, self.schema, self.storage.location)
        try:
            check_lost_lengths(self.storage, meta["episode_lens"], as_read["_generation"], state, beside_writer)
        except LostLengthError as e:
            if metasums.checking():
                raise
            self._commit.lost = tuple(e.slots)  # kept for verify --repair to restore
        if len(damaged) and metasums.checking():
            raise metasums.error(self.storage, int(damaged[0]), self._commit.summed, meta, self.max_timesteps)
        self._commit.suspect = damaged
        if summed and not len(damaged):  # a writer's mirror changes as it writes: its values are copied
            kept = {n: meta[n] if self.read_only else meta[n].copy() for n in (*self.schema.meta_fields, *_SUMMED)}
            self._verified = (kept, checked)
        return state, meta

    def _unverified(self, meta: dict[str, np.ndarray], checked: np.ndarray) -> np.ndarray:
        """The slots of mask ``checked`` whose values ``meta`` (just loaded) are not what the
        last refresh found matching their checksums (``_verified``): a refresh of a large
        buffer hashes only the slots committed or edited since (~0.2-0.4 µs a slot)."""
        if self._verified is None:
            return np.flatnonzero(checked)
        kept, passed = self._verified
        changed = ~passed
        for name in (*self.schema.meta_fields, *_SUMMED):
            changed |= (meta[name] != kept[name]).reshape(len(checked), -1).any(axis=1)
        return np.flatnonzero(checked & changed)

    def _reopen(self) -> ReplayBuffer:
        """A reader whose buffer another process replaced opens the new one, as a learner
        reading an actor's buffer that the actor created again (``overwrite=True``, the
        default) wants: its plans, mirror and caches all move to the new buffer at once, so
        no read mixes the two. ``BufferReplacedError`` instead when the new buffer's config is
        not this reader's (the arrays it hands out would change shape), for a snapshot view
        (its episodes are gone), or while the new buffer is not yet created (retryable)."""
        location = self.storage.location
        if self._snapshot is not None:
            raise BufferReplacedError(location, f"snapshot {self.snapshot_name!r} was erased with it")
        # a new storage object: the old one (which datasets and loaders made before hold) keeps
        # saying its buffer was replaced, so their reads raise instead of reaching the new one
        fresh, before = self.storage.fresh(), dict(self.__dict__)
        try:
            schema = fresh.open(read_only=True)
            differences = "; ".join(line.strip() for line in schema.differences(self.schema))
            if differences:
                raise BufferReplacedError(
                    location, f"the new buffer has another config ({differences}); open it with from_folder"
                )
            self.storage = fresh
            self._setup(schema)
        except BaseException as error:
            # this reader stays as it was (reads raise, the next refresh tries again)
            self.__dict__.update(before)
            fresh.close()
            if isinstance(error, (OSError, ValueError, KeyError, StorageError)):  # erased, or being created
                raise BufferReplacedError(location, f"the new buffer cannot be opened yet ({error})") from error
            raise
        before["storage"].close()
        return self

    # ---- state ---------------------------------------------------------------------------

    @property
    def _state(self) -> dict[str, Any]:
        """The counters object as last loaded or committed (``Committer.state``)."""
        return self._commit.state

    @_state.setter
    def _state(self, state: dict[str, Any]) -> None:
        self._commit.state = state

    @property
    def _meta(self) -> dict[str, np.ndarray]:
        """The RAM mirror of the per-episode arrays (``Committer.meta``)."""
        return self._commit.meta

    @_meta.setter
    def _meta(self, meta: dict[str, np.ndarray]) -> None:
        self._commit.meta = meta

    @property
    def attrs(self) -> BufferAttrs:
        """Attributes of the dataset as a whole (fps, feature names, task texts, ...): a JSON dict
        stored with the buffer, written through on each change (``attrs.py``); read-only buffers
        refuse changes."""
        return BufferAttrs(self.storage, self._check_writable)

    @property
    def should_flush(self) -> bool:
        """Whether stores are logged as they are made (``flush_every_store_step > 0``), as the seed names it."""
        return self.flush_every_store_step > 0

    @property
    def num_episodes(self) -> int:
        """Episodes committed (capped at ``max_episodes`` in circular mode), as the seed counts."""
        return int(self._state["num_episodes"])

    @property
    def episode_index(self) -> int:
        """The slot the next episode goes to."""
        return int(self._group.slots[0]) if self._group is not None else int(self._state["episode_index"])

    @episode_index.setter
    @_serialized
    def episode_index(self, value: int) -> None:
        """Choose the slot the next episode goes to, as the seed allows (not while steps are staged)."""
        self._check_writable("episode_index = ...")
        self._check_episode_thread("episode_index = ...")
        slot = check_index(value, self.max_episodes, "episode_index", "episode_index")
        group = self._group
        if group is not None and group.length > 0:
            raise ValueError(
                f"episode_index: {group.length} steps of the episode(s) in slots {group.slots.tolist()} are "
                "staged; commit them with advance_episode() before choosing another slot"
            )
        if group is not None:  # its slots move: refused, as a new group is, onto a held episode
            moved = (slot + np.arange(group.batch_size)) % self.max_episodes
            self._commit.held.check(moved, self._meta["_generation"][moved], "overwrite")
        self._commit.commit_state(episode_index=slot)
        if group is not None:  # only meta was set: it moves with the group
            group.slots = self._next_slots(group.batch_size)
            self._commit.discard_log()
            if self.flush_every_store_step > 0:
                self._commit.log_header(group)

    @property
    def timestep_index(self) -> int:
        """Steps stored so far in the episode in progress."""
        return self._pending_steps if self._group is None else self._group.length

    @timestep_index.setter
    @_serialized
    def timestep_index(self, value: int) -> None:
        """Move the write position of the episode in progress, as the seed allows: the next store
        writes step ``value``: steps after it keep their values until stored again (as in the seed),
        skipped ones hold the default."""
        self._check_writable("timestep_index = ...")
        self._check_episode_thread("timestep_index = ...")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= self.max_timesteps:
            raise ValueError(f"timestep_index: expected an int in [0, {self.max_timesteps}], got {value!r}")
        value, group = int(value), self._group
        if group is None:
            self._pending_steps = value
            return
        if value < group.length:
            if self.flush_every_store_step > 0:  # written first, as an edit is: a kill after it replays the cut
                self._commit.log_edit([self._commit.step_log.truncate(value)], durable=True)
            group.rewind(value, lambda name, t0, t1: self._read_rows(name, group.slots, t0, t1))
        while group.length < value:
            self._stage({})

    def _read_rows(self, name: str, slots: np.ndarray, t0: int, t1: int) -> np.ndarray:
        return np.stack([np.asarray(self.data[name][int(slot), t0:t1]) for slot in slots])

    @property
    def is_new_episode(self) -> bool:
        return self.timestep_index == 0

    def _committed(self) -> dict[str, np.ndarray]:
        return self._meta

    def listed_slots(self) -> np.ndarray:
        """The slots ``get_all_data`` returns a row for: ``0 .. num_episodes - 1``, as the seed."""
        return np.arange(min(self.num_episodes, self.max_episodes), dtype=np.int64)

    def empty_episodes(self) -> np.ndarray:
        """Slots of committed length-0 episodes (``advance_episode(batch_size=n)`` before any
        step): counted in ``num_episodes`` and listed by ``get_all_data`` with their meta values."""
        return self._commit.empty_episodes()

    def valid_episodes(self) -> np.ndarray:
        """Slots holding a committed episode, oldest first."""
        valid = np.flatnonzero(self._meta["episode_lens"] > 0)
        return valid[np.argsort(self._meta["_generation"][valid], kind="stable")]

    def unsettled_slots(self) -> np.ndarray:
        """The slots the last ``refresh()`` of a reader found a writer changing while it loaded
        them, when it found no committed episode besides (they read as empty until the next
        refresh): the buffer looks empty without being so, and ``stats`` raises
        ``ConcurrentWriteError`` (retryable) for them instead of saying it is empty."""
        return self._unsettled

    def unfinished_edit_slots(self) -> np.ndarray:
        """The committed slots (as last loaded) holding an in-place edit that a stopped writer left
        part applied: an odd ``_revision`` while no live writer holds the buffer (a live one's
        edit is running; the writer's own finishes by its next edit, commit or flush). Only
        when a slot is odd are the lease and then its revision as stored now read (a writable
        open may have finished the edit since the last load)."""
        revisions = self._meta.get("_revision")
        if revisions is None or not self.read_only:
            return np.zeros(0, np.int64)
        odd = np.flatnonzero((revisions % 2 == 1) & (self._meta["episode_lens"] > 0)).astype(np.int64)
        if not len(odd) or self.storage.writer_lease().live_holder() is not None:
            return np.zeros(0, np.int64)
        return odd[self.storage.read_meta_rows("_revision", odd) == revisions[odd]]

    def __len__(self) -> int:
        return int((self._meta["episode_lens"] > 0).sum())

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer({self.storage.location!r}, backend={self.storage.backend_name!r}, "
            f"episodes={len(self)}/{self.max_episodes}, fields={list(self.schema.fields)})"
        )

    def _field(self, name: str) -> Field:
        if name in self.schema.fields:
            return self.schema.fields[name]
        if name in self._meta_fields and name not in _HIDDEN_META:
            return self._meta_fields[name]
        raise ValueError(
            f"invalid field name {name!r} - must be one of {sorted(self.fieldnames)} "
            f"or meta fields {sorted(self.meta_fieldnames)}"
        )

    def _check_writable(self, call: str) -> None:
        self._refuse_unwritable(call)
        self.storage.check_lease_current()
        self._take_turn(call)

    def _refuse_unwritable(self, call: str) -> None:
        """ValueError for ``call`` on a read-only or closed object."""
        if self.read_only and self.__dict__.get("_unpickled_writer"):
            raise ValueError(
                f"cannot call `{call}` on {self.storage.location!r}: this is a pickled copy of a writable buffer "
                "(sent to another process, e.g. a spawned one or a DataLoader worker), which is read-only; the "
                "buffer takes one writer at a time: write from the process that opened it, or close it there "
                "and open it with ReplayBuffer.from_folder here"
            )
        if self.read_only:
            raise ValueError(f"cannot call `{call}` on a buffer opened read-only ({self.storage.location!r})")
        if self._closed:
            # its lease is given back: another writer may hold the buffer now
            raise ValueError(
                f"cannot call `{call}` on {self.storage.location!r}: this ReplayBuffer was closed (its writer "
                "lease given back); open the buffer again to write: ReplayBuffer.from_folder(path)"
            )

    def _take_turn(self, call: str) -> CompactionSummary | None:
        """Make this object the one writing among the writable opens of this buffer in this
        process (which share its lease): after another one wrote, this one reloads what it
        committed (its pending counters written and its hot episodes compacted first), so
        neither overwrites the other's episodes. Refused while the other has an episode in
        progress: both would write its slot, and this object's open must not commit it early.
        Returns what compacting the other object's hot episodes did (None: no other's turn ended)."""
        lease = self.storage.held_lease
        compacted = None
        if lease is None or (lease.turn is not None and lease.turn() is self):
            return compacted
        if lease.turn is not None:
            previous = lease.turn()
            if previous is not None and previous._writing_episode():
                # before refusing: an object dropped (``del``) that a cycle of the user's keeps
                # (replaybuf's own objects make none) is collected; only here: a full
                # collection takes seconds in a large heap
                del previous
                gc.collect()
                previous = lease.turn()
            if previous is not None and previous.storage.held_lease is lease:
                group = previous._group
                if group is not None and group.length > 0:
                    raise BufferLockedError(
                        f"cannot call `{call}` on {self.storage.location!r}: another writable ReplayBuffer of "
                        f"it in this process has an episode in progress ({group.length} steps in slots "
                        f"{group.slots.tolist()} not yet ended). End it (advance_episode(), or leave its "
                        "one_episode block) or close() that object first; to read alongside it, open the "
                        "buffer with read_only=True"
                    )
                # its compactor sees only its own writes: nothing of it stays hot to be
                # compacted over a shard this object writes
                compacted = previous.storage.compact()
                previous._commit.flush_counters()
                previous._commit.log_pending = []  # its group holds only meta: rebuilt on its turn
            elif lease.orphaned_state is not None:  # collected with counters it could not write
                self.storage.commit_state(lease.orphaned_state)
            lease.orphaned_state = None
            self.refresh()
            group = self._group
            if group is not None:  # only meta set: the group moves past the other's episodes
                group.slots = self._next_slots(group.batch_size)
                self._commit.discard_log()
                if self.flush_every_store_step > 0:
                    self._commit.log_header(group)
        lease.turn = weakref.ref(self)
        return compacted

    def _check_episode_thread(self, call: str, discards: bool = False) -> None:
        """BufferLockedError for ``call`` from another thread than the one that began the episode
        in progress, where that would be lost or mixed: a call that ``discards`` it (a whole
        episode stored, ``clear()``, a new episode block), or a step into an episode begun by a
        ``one_episode``/``batched_episode`` block (the block's thread owns it: another thread's
        steps would make one episode of both). The lock keeps each call whole; steps handed from
        thread to thread (an executor's) without a block extend the episode in progress, as one
        thread's would."""
        group = self._group
        if group is None or self._group_thread == threading.get_ident():
            return
        if not discards and not self._group_scoped:
            return
        raise BufferLockedError(
            f"cannot call `{call}` on {self.storage.location!r} from this thread: another thread has an episode "
            f"in progress in this ReplayBuffer ({group.length} steps in slots {group.slots.tolist()} not yet ended). "
            "One object collects one episode at a time: end it in that thread first (leave its one_episode block, "
            "advance_episode()), store whole episodes with store_episode() (safe from several threads), or give "
            "each actor thread a buffer of its own: ReplayBuffer.shard(root, i), read together with "
            "ConcatReplayBuffer(root)"
        )

    def _writing_episode(self) -> bool:
        """Whether this object has an episode in progress (steps stored, not yet ended)."""
        return self._group is not None and self._group.length > 0

    def _check_names(self, names: Iterable[str], allowed: set[str], what: str, call: str) -> None:
        unknown = sorted(set(names) - allowed)
        if unknown:
            raise ValueError(f"{call}: invalid {what} names {unknown} - must be among {sorted(allowed)}")

    def _full_message(self, batch_size: int = 1) -> str:
        return (
            f"the replay buffer is full ({self.num_episodes} of {self.max_episodes} episodes, "
            f"{batch_size} more requested) and is not circular: pass circular=True, clear() it, "
            "or create it with a larger max_episodes"
        )

    def _check_room(self, batch_size: int) -> None:
        if batch_size > self.max_episodes:
            raise ValueError(f"batch_size {batch_size} exceeds max_episodes {self.max_episodes}")
        if not self.circular and self.num_episodes + batch_size > self.max_episodes:
            raise ValueError(self._full_message(batch_size))

    # ---- the episode group in progress ------------------------------------------------------

    def _next_slots(self, batch_size: int) -> np.ndarray:
        return (self._state["episode_index"] + np.arange(batch_size)) % self.max_episodes

    def _begin_group(self, batch_size: int, meta: dict[str, np.ndarray]) -> EpisodeGroup:
        """Start a group of ``batch_size`` episodes. It replaces a group that has only meta set
        (``store_meta_batch`` before any step) and keeps that meta for the rows both share, as the
        seed keeps meta written to the next slots."""
        self._check_room(batch_size)
        group = self._commit.new_group(batch_size, {})
        if self._group is not None:
            shared = min(batch_size, self._group.batch_size)
            for name, values in self._group.meta.items():
                group.meta[name][:shared] = values[:shared]
        for name, values in meta.items():
            group.meta[name][:] = values
        self._group, self._group_thread, self._group_scoped = group, threading.get_ident(), False
        self._store_step = 0
        if self.flush_every_store_step > 0:
            self._commit.log_header(group)
        pending, self._pending_steps = self._pending_steps, 0
        for _ in range(pending):
            self._stage({})
        return group

    def _stage(self, values: dict[str, np.ndarray]) -> None:
        group = self._group
        assert group is not None, "a step is staged into the group in progress"
        before, logged = group.checkpoint(), False
        try:
            filled = group.append(values)
            self._commit.write_slabs(group, filled)
            if self.flush_every_store_step > 0:
                logged = True
                self._commit.log_pending.append(
                    self._commit.step_log.steps(
                        {
                            n: values[n]
                            if n in values
                            else np.broadcast_to(self._fills[n], (group.batch_size, *f.shape))
                            for n, f in self.schema.fields.items()
                        }
                    )
                )
                if (self._store_step + 1) % self.flush_every_store_step == 0:
                    try:
                        self._commit.flush_log()
                    except StorageError:
                        self._commit.log_pending.pop()  # the log on disk ends at its last whole record
                        raise
        except StorageError as e:
            # the step is taken back (a full disk): the episode in progress stays as it was
            # before this call, whole, and this step can be stored again once there is room
            group.unappend(filled)
            raise StorageError(
                f"{e}; this step was not stored, the episode in progress keeps its {group.length} earlier "
                "step(s): store the step again once the store can be written"
            ) from e
        except BaseException:
            # interrupted (a KeyboardInterrupt, a MemoryError), even part way through staging
            # it: the step is taken back as above, so the call stored nothing and may be made
            # again; whether the step log took its record is unknown, so this episode is logged
            # no more (``abandon_log``)
            group.restore(before)
            if logged:
                self._commit.abandon_log()
            raise
        self._store_step += 1

    def _commit_group(self, final_meta: dict[str, np.ndarray] | None = None) -> None:
        group, self._group = self._group, None
        if group is None or group.length == 0:
            self._commit.discard_log()
            return
        try:
            self._commit.commit(group, final_meta)
        except CountersNotWritten:
            raise  # the episode is committed
        except BaseException as e:
            # not published: rolled back whole, its log too (this object's next episode
            # starts a new log, which must not follow this one's records). An interrupted
            # commit (a KeyboardInterrupt) may have published it: kept then, never replayed
            self._commit.discard_log()
            if not isinstance(e, StorageError):
                raise
            raise StorageError(
                f"{e}; the episode in slot(s) {group.slots.tolist()} ({group.length} steps) was not committed "
                "and is discarded: store it again once the store can be written"
            ) from e

    def _abort_group(self) -> None:
        self._group = None
        self._pending_steps = 0
        self._commit.discard_log()

    # ---- the write API -------------------------------------------------------------------------

    def _meta_values(self, meta: dict[str, Any], batch_size: int, call: str) -> dict[str, np.ndarray]:
        self._check_names(meta, set(self.schema.meta_fields), "meta field", call)
        return {n: batch_value(v, self.schema.meta_fields[n], batch_size) for n, v in meta.items()}

    @contextmanager
    def one_episode(self, **meta: Any) -> Iterator[dict]:
        """Collect one episode with ``store()``; it is committed when the block exits.

        Yields a dict: values put in it are stored as meta fields at the end (e.g. a return).
        An exception inside the block rolls the episode back: nothing of it becomes visible.
        A block that stored no step commits nothing; its meta waits for the next episode, as in
        the seed.
        """
        with self._lock:  # not held inside the block: other threads read (and update) meanwhile
            self._check_writable("one_episode")
            self._check_episode_thread("one_episode", discards=True)
            values = self._meta_values(meta, 1, "one_episode")
            if self._group is not None and self._group.length > 0:
                raise RuntimeError("an episode is already in progress: finish it before starting one_episode")
            self._begin_group(1, values)
            self._group_scoped = True
        final: dict[str, Any] = {}
        try:
            yield final
            # bad final meta is refused as an exception in the block is: the episode is rolled back
            final_values = self._meta_values(final, 1, "one_episode (final meta)")
            with self._lock:
                group = self._group
                if group is not None and group.length == 0:
                    for name, value in final_values.items():
                        group.meta[name][:] = value
                    self._group_scoped = False  # the block ended: its meta waits for any thread's next episode
                    return
                self._commit_group(final_values)
        except BaseException:
            # and a commit interrupted (a KeyboardInterrupt) before it took the episode: not
            # left in progress, where the next store() would add steps to it
            with self._lock:
                self._abort_group()
            raise

    @contextmanager
    def batched_episode(self, batch_size: int, **meta_batch: Any) -> Iterator[None]:
        """Collect ``batch_size`` episodes in lockstep with ``store_batch``; committed on exit."""
        with self._lock:
            self._check_writable("batched_episode")
            self._check_episode_thread("batched_episode", discards=True)
            if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
                raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
            values = self._meta_values(meta_batch, int(batch_size), "batched_episode")
            if self._group is not None and self._group.length > 0:
                raise RuntimeError("an episode is already in progress: finish it before starting batched_episode")
            self._begin_group(int(batch_size), values)
            self._group_scoped = True
        try:
            yield
            self.advance_episode(int(batch_size))
        except BaseException:
            with self._lock:  # and a commit interrupted before it took the group (as above)
                self._abort_group()
            raise

    @contextmanager
    def _unlogged(self) -> Iterator[None]:
        """Store the block's episodes without the step log, whatever ``flush_every_store_step``
        says: for a caller holding them whole (``EpisodeCollector.store``), a kill then loses them
        all, never leaving them committed cut short at the step the log reached."""
        every = self.flush_every_store_step
        self.flush_every_store_step = 0
        try:
            yield
        finally:
            self.flush_every_store_step = every

    @_serialized
    @_fields_as_keywords
    def store(self, **data: Any):
        """Store one timestep of the episode in progress; missing fields (and fields given as
        None, as in the seed) get their default.

        Returns a namedtuple of the values stored, as the seed does: a value given as an array,
        tensor or list is returned as given, a scalar or a default as an array of the field.
        """
        self._check_writable("store")
        self._check_episode_thread("store")
        self._check_names(data, self.fieldnames, "field", "store")
        data = {n: v for n, v in data.items() if v is not None}
        values = {n: step_value(v, self.schema.fields[n]) for n, v in data.items()}
        if self.timestep_index >= self.max_timesteps:
            raise ValueError(
                f"store: the episode already has max_timesteps ({self.max_timesteps}) steps; "
                "increase max_timesteps when creating the buffer"
            )
        group = self._group
        if group is None or (group.length == 0 and group.batch_size != 1):
            self._begin_group(1, {})
        elif group.batch_size != 1:
            raise ValueError(f"store: a batched episode of {group.batch_size} is in progress; use store_batch")
        full = {n: values[n] if n in values else self._fills[n] for n in self.schema.fields}
        # made first: a call interrupted (a KeyboardInterrupt) after its step is staged is rarer
        stored = self.memory_namedtuple(
            *(data[n] if n in data and not np.isscalar(data[n]) else full[n].copy() for n in full)
        )
        self._stage({n: v[None] for n, v in full.items()})
        self.store_step += 1
        return stored

    @_serialized
    @_fields_as_keywords
    def store_batch(self, **data: Any) -> None:
        """Store one timestep for every episode of the batched group in progress."""
        self._check_writable("store_batch")
        self._check_episode_thread("store_batch")
        if not data:
            raise ValueError("store_batch: no data provided")
        self._check_names(data, self.fieldnames, "field", "store_batch")
        data = self._fit_to_room({n: to_numpy(v, n) for n, v in data.items()})
        group = self._group
        batch = group.batch_size if group is not None and group.length > 0 else None
        sizes = {n: int(v.shape[0]) if v.ndim else None for n, v in data.items()}
        if batch is None:
            known = [s for s in sizes.values() if s is not None]
            if known:
                batch = known[0]
            elif group is not None:  # scalars only: one for every episode of ``batched_episode``'s group
                batch = group.batch_size
            else:
                raise ValueError("store_batch: values need a leading batch dimension")
            if batch < 1:
                raise ValueError(f"store_batch: values have batch size 0 ({sizes}), expected at least 1 episode")
        for name, size in sizes.items():
            if size is not None and size != batch:
                raise ValueError(f"store_batch: field {name!r} has batch size {size}, expected {batch}")
        values = {n: batch_value(v, self.schema.fields[n], batch) for n, v in data.items()}
        if self.timestep_index >= self.max_timesteps:
            raise ValueError(
                f"store_batch: the episodes already have max_timesteps ({self.max_timesteps}) steps; "
                "increase max_timesteps when creating the buffer"
            )
        if self._group is None or self._group.batch_size != batch:
            self._begin_group(batch, {})
        self._stage(values)

    def _fit_to_room(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A non-circular buffer keeps only the episodes it has room for (the seed cuts a longer
        batch silently); a full one refuses the batch."""
        if self.circular:
            return arrays
        room = self.max_episodes - self.num_episodes
        if room <= 0:
            raise ValueError(self._full_message())
        fields = {**self.schema.fields, **self.schema.meta_fields}
        return {
            n: a[:room] if a.ndim and a.shape[0] > room and a.shape != fields[n].shape else a for n, a in arrays.items()
        }

    @_serialized
    @_fields_as_keywords
    def store_meta_batch(self, **data: Any) -> None:
        """Set meta fields for every episode of the group in progress (or the next group)."""
        self._check_writable("store_meta_batch")
        self._check_episode_thread("store_meta_batch")
        if not data:
            raise ValueError("store_meta_batch: no data provided")
        self._check_names(data, set(self.schema.meta_fields), "meta field", "store_meta_batch")
        data = self._fit_to_room({n: to_numpy(v, n) for n, v in data.items()})
        group = self._group
        batch = group.batch_size if group is not None and group.length > 0 else None
        if batch is None:
            first = next(iter(data.values()))
            batch = int(first.shape[0]) if first.ndim else 1
            if batch < 1:
                raise ValueError(
                    f"store_meta_batch: values have batch size 0 ({ {n: v.shape for n, v in data.items()} }), "
                    "expected at least 1 episode"
                )
        values = self._meta_values(data, batch, "store_meta_batch")
        if group is None or group.batch_size != batch:
            self._begin_group(batch, values)
            return
        self._edit_staged(meta=[(name, group.slots, value) for name, value in values.items()])

    @_serialized
    @_fields_as_keywords
    def store_episode(self, **data: Any) -> None:
        """Store a whole episode: one (T, *shape) array per field, meta fields as values."""
        self._check_writable("store_episode")
        self._check_episode_thread("store_episode", discards=True)
        steps, meta_values, length = self._episode_values(data, "store_episode")
        if length == 0:  # as in the seed, which skips it too: an empty trajectory is no episode
            warnings.warn("store_episode: the fields given have 0 timesteps; nothing is stored", stacklevel=2)
            return
        self._check_room(1)
        if self.timestep_index > 0:
            warnings.warn(
                f"store_episode called with an episode in progress ({self.timestep_index} steps); "
                "its steps are discarded",
                stacklevel=2,
            )
        if self._group is not None:  # the meta of the episode in progress is kept, as in the seed
            meta_values = {n: self._group.meta[n][:1] for n in self._group.meta} | meta_values
        self._abort_group()
        try:
            self._commit.commit_episode(steps, meta_values, length)
        except StorageError as e:
            if type(e) is not StorageError:  # CountersNotWritten: committed; others say what they are
                raise
            raise StorageError(f"{e}; the episode was not stored: store it again once the store can be written") from e

    def _episode_values(self, data: dict[str, Any], call: str) -> tuple[dict[str, np.ndarray], dict, int]:
        """Checked (steps, meta values, length) of one whole episode given as ``data``; the
        length may be 0 (the caller decides what an empty episode means)."""
        if not data:
            raise ValueError(f"{call}: no data provided")
        self._check_names(data, self.fieldnames | set(self.schema.meta_fields), "field", call)
        steps, meta, length = {}, {}, None
        for name, value in data.items():
            if name in self.fieldnames:
                f = self.schema.fields[name]
                array = to_numpy(value, name)
                if array.ndim == 0:
                    raise ValueError(f"{call}: time-varying field {name!r} needs a time dimension, got a scalar")
                if length is not None and array.shape[0] != length:
                    raise ValueError(
                        f"{call}: field {name!r} has {array.shape[0]} timesteps, other fields have {length}"
                    )
                length = array.shape[0]
                steps[name] = cast_values(fit_shape(array, f, 1), f)
            else:
                meta[name] = value
        if length is None:
            raise ValueError(f"{call}: at least one time-varying field is needed, got only meta fields {sorted(meta)}")
        if length > self.max_timesteps:
            raise ValueError(f"{call}: {length} timesteps exceed max_timesteps ({self.max_timesteps})")
        return steps, self._meta_values(meta, 1, call), length

    @_serialized
    def advance_episode(self, batch_size: int | None = None) -> None:
        """Commit the episode(s) in progress (what ``one_episode`` does on exit).

        Without ``batch_size`` the whole group in progress is committed. ``batch_size=n`` commits
        n episodes as the seed does: the group's first n (the rest is dropped) or, when no step was
        stored yet, n episodes of length 0 that count in ``num_episodes`` (n == 1: nothing).
        """
        self._check_writable("advance_episode")
        self._check_episode_thread("advance_episode")
        group = self._group
        if batch_size is None:
            if group is not None and group.length > 0:
                self._commit_group()
            return
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"advance_episode: batch_size must be a positive int, got {batch_size!r}")
        count = int(batch_size)
        if self.timestep_index == 0:
            if count > 1:
                self._commit_empty(count)
            return
        if group is None:  # only ``timestep_index = n`` was set: n default steps
            group = self._begin_group(count, {})
        if count > group.batch_size:
            raise ValueError(
                f"advance_episode: batch_size {count} exceeds the {group.batch_size} episode(s) in progress "
                f"(slots {group.slots.tolist()})"
            )
        self._commit.dirty_slots.update(group.keep_first(count).tolist())
        self._commit_group()

    def _commit_empty(self, count: int) -> None:
        """Commit ``count`` episodes of length 0 with the meta set so far (the seed's
        ``advance_episode(batch_size=n)`` before any step)."""
        group = self._begin_group(count, {})
        self._group = None
        self._commit.commit_empty(group)

    @_serialized
    def flush(self) -> None:
        """Push buffered step-log records and batched counters, and make written data durable
        as configured."""
        if self.read_only or self._closed:  # a closed writer's close() flushed (or its next open derives)
            return
        self._commit.finish_unpublishing()
        self._commit.finish_interrupted_edit()
        self._commit.flush_counters()
        self._commit.flush_log()
        self.storage.flush()

    @_serialized
    def clear(self) -> None:
        """Erase every episode (the arrays keep their shape and config)."""
        self._check_writable("clear")
        self._check_episode_thread("clear", discards=True)
        self._abort_group()
        self._commit.clear()

    def reset_(self) -> None:
        """The seed's name for ``clear()``."""
        self._refuse_unwritable("reset_")  # a refusal names the call made
        self.clear()

    @_serialized
    def drop_episodes(self, slots: int | Sequence[int] | np.ndarray) -> list[int]:
        """Empty the slots of committed episodes (damaged ones ``replaybuf verify`` found): each
        is unpublished as a reused slot is (length, then generation set to 0). ``num_episodes``
        stays, so ``get_all_data`` lists a dropped slot as a row of padding (length 0) and never
        hides the episodes after it; ``len(buffer)`` counts the episodes left. Other episodes are
        untouched. Returns the slots dropped (those that held a committed episode)."""
        self._check_writable("drop_episodes")
        slots = np.unique(np.atleast_1d(np.asarray(slots)))
        if slots.size == 0:  # [] is float64 to numpy: no slot to drop (a verify that found none)
            slots = slots.astype(np.int64)
        if slots.dtype.kind not in "iu" or ((slots < 0) | (slots >= self.max_episodes)).any():
            raise ValueError(f"drop_episodes: slots must be ints in [0, {self.max_episodes}), got {slots.tolist()}")
        return self._commit.drop(slots).tolist()

    @_serialized
    def snapshot(self, name: str) -> None:
        """Record the committed episodes (slots, generations, lengths) and counters as snapshot
        ``name``: ``from_folder(path, snapshot=name)`` reads exactly them later, and this buffer
        (and any later writer) refuses to overwrite them until ``drop_snapshot(name)``. Only the
        writer takes snapshots; an episode in progress that would reuse a committed slot must be
        committed or aborted first."""
        self._check_writable("snapshot")
        snapshots.check_name(name)
        group = self._group
        if group is not None and (self._meta["episode_lens"][group.slots] > 0).any():
            raise snapshots.SnapshotError(
                f"snapshot {name!r}: the episode(s) in progress will overwrite the committed episode(s) in slots "
                f"{group.slots.tolist()}; commit them (advance_episode) or abort them before taking a snapshot"
            )
        snapshots.create(self.storage, name, self.schema, self._meta, self._state)
        self._commit.held.reset()

    def snapshots(self) -> list[str]:
        """The names of this buffer's snapshots, sorted."""
        return snapshots.names(self.storage)

    @_serialized
    def drop_snapshot(self, name: str) -> None:
        """Delete snapshot ``name``: its episodes may be overwritten again."""
        self._check_writable("drop_snapshot")
        snapshots.drop(self.storage, name)
        self._commit.held.reset()

    @_serialized
    def store_datapoint(self, episode_index: int, timestep_index: int, name: str, datapoint: Any) -> None:
        """Write one value of a data field at (episode, timestep)."""
        self._check_writable("store_datapoint")
        episode = check_index(episode_index, self.max_episodes, "episode_index", "store_datapoint")
        t = check_index(timestep_index, self.max_timesteps, "timestep_index", "store_datapoint")
        self._check_names([name], self.fieldnames, "field", "store_datapoint")
        value = step_value(datapoint, self.schema.fields[name])
        group, edit = self._group, [(name, np.array([episode]), t, value[None, None])]
        if group is not None and episode in group.slots and group.holds(name, t):
            self._edit_staged(steps=edit)  # a step in RAM: written at its commit
            return
        # a step of the episode in progress that left RAM is logged in the step log too
        self._commit.edit(
            [Write("rows", name, np.array([episode]), value[None, None], t)], lambda: self._edit_staged(steps=edit)
        )

    @_serialized
    def store_meta_datapoint(self, episode_index: int, name: str, datapoint: Any) -> None:
        """Write one meta value of an episode."""
        self._check_writable("store_meta_datapoint")
        episode = check_index(episode_index, self.max_episodes, "episode_index", "store_meta_datapoint")
        self._check_names([name], set(self.schema.meta_fields), "meta field", "store_meta_datapoint")
        self._set_meta(name, np.array([episode]), step_value(datapoint, self.schema.meta_fields[name])[None])

    @_serialized
    def store_batch_datapoint(
        self, episode_indices: Any, timestep_index: int | Sequence[int], name: str, datapoints: Any
    ) -> None:
        """``store_datapoint`` for several episodes at one timestep (the seed's batched form), or
        at one timestep each (a sequence of ``timestep_index``, as the seed's memmap indexing
        takes): ``datapoints`` holds one value per episode, or one value for all. Everything is
        checked before anything is written."""
        self._check_writable("store_batch_datapoint")
        episodes = self._datapoint_episodes(episode_indices, "store_batch_datapoint")
        timesteps = self._datapoint_timesteps(timestep_index, len(episodes))
        self._check_names([name], self.fieldnames, "field", "store_batch_datapoint")
        values = self._broadcast(datapoints, self.schema.fields[name], len(episodes), "store_batch_datapoint")
        for episode, timestep, value in zip(episodes, timesteps, values):
            self.store_datapoint(int(episode), timestep, name, value)

    def _datapoint_timesteps(self, timestep_index: Any, count: int) -> list[int]:
        """``store_batch_datapoint``'s timesteps: one int for all ``count`` episodes, or one each."""
        call = "store_batch_datapoint"
        if np.ndim(timestep_index) == 0:
            check_index(timestep_index, self.max_timesteps, "timestep_index", call)
            return [timestep_index] * count
        timesteps = to_numpy(timestep_index, "timestep_index")
        if timesteps.shape != (count,) or (count and timesteps.dtype.kind not in "iu"):
            raise ValueError(
                f"{call}: timestep_index must be one int, or one int per episode ({count}), "
                f"got {timesteps.dtype} {list(timesteps.shape)}"
            )
        for timestep in timesteps.tolist():
            check_index(timestep, self.max_timesteps, "timestep_index", call)
        return timesteps.tolist()

    @_serialized
    def store_batch_meta_datapoint(self, episode_indices: Any, name: str, datapoints: Any) -> None:
        """``store_meta_datapoint`` for several episodes (the seed's batched form)."""
        self._check_writable("store_batch_meta_datapoint")
        episodes = self._datapoint_episodes(episode_indices, "store_batch_meta_datapoint")
        self._check_names([name], set(self.schema.meta_fields), "meta field", "store_batch_meta_datapoint")
        f = self.schema.meta_fields[name]
        self._set_meta(name, episodes, self._broadcast(datapoints, f, len(episodes), "store_batch_meta_datapoint"))

    def _broadcast(self, value: Any, f: Field, count: int, call: str) -> np.ndarray:
        """``value`` broadcast to (count, *shape) by numpy's rules, as the seed's assignment does."""
        array = to_numpy(value, f.name)
        try:
            array = np.broadcast_to(array, (count, *f.shape))
        except ValueError:
            raise ValueError(
                f"{call}: field {f.name!r} value of shape {array.shape} does not broadcast to {(count, *f.shape)}"
            ) from None
        return cast_values(array, f)

    def _datapoint_episodes(self, episode_indices: Any, call: str) -> np.ndarray:
        episodes = np.atleast_1d(to_numpy(episode_indices, "episode_indices"))
        if episodes.ndim != 1 or (len(episodes) and episodes.dtype.kind not in "iu"):
            raise ValueError(
                f"{call}: episode_indices must be a 1-D sequence of ints, got {episodes.dtype} {episodes.shape}"
            )
        for episode in episodes:
            check_index(int(episode), self.max_episodes, "episode_index", call)
        return episodes.astype(np.int64)

    def _set_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        """Checked meta values of ``episodes``: staged for the episodes in progress (committed
        with them), written through for the others."""
        group = self._group
        staged = np.zeros(len(episodes), bool)
        if group is not None:
            staged = np.isin(episodes, group.slots)
            self._edit_staged(meta=[(name, episodes[staged], values[staged])])
        if not staged.all():
            self._commit.edit_meta(name, episodes[~staged], values[~staged])

    @_serialized
    def update(self, indices: int | Sequence[int] | np.ndarray | slice | None = None, **data: Any) -> None:
        """Overwrite stored episodes in place (all committed ones when ``indices`` is None).

        Time-varying values are (episodes, time, *shape) and broadcast; meta values
        (episodes, *shape). Every value is checked before anything is written.
        """
        self._check_writable("update")
        if not data:
            raise ValueError("update: no data provided")
        self._check_names(data, self.fieldnames | set(self.schema.meta_fields), "field", "update")
        episodes, scalar = self._episode_indices(indices, "update")
        writes = []
        for name, value in data.items():
            f = self._field(name)
            array = to_numpy(value, name)
            if array.ndim == 0:
                array = array[None, None] if name in self.fieldnames else array[None]
            elif scalar:
                array = array[None]
            if name in self.fieldnames:
                if array.ndim < 2:
                    raise ValueError(
                        f"update: field {name!r} expects (episodes, time, *{f.shape}) values, got shape {array.shape}"
                    )
                # () <-> (1,) as the seed casts; any other feature shape must broadcast
                array = fit_shape(array, f, 2) if array.shape[2:] in ((), (1,)) and f.shape in ((), (1,)) else array
                length = array.shape[1]
                if length > self.max_timesteps:
                    raise ValueError(
                        f"update: field {name!r} has {length} timesteps, max_timesteps is {self.max_timesteps}"
                    )
                target = (len(episodes), length, *f.shape)
            else:
                array = fit_shape(array, f, 1) if array.shape[1:] in ((), (1,)) and f.shape in ((), (1,)) else array
                target = (len(episodes), *f.shape)
            try:
                array = np.broadcast_to(array, target)
            except ValueError:
                raise ValueError(
                    f"update: field {name!r} value of shape {array.shape} does not broadcast to {target}"
                ) from None
            writes.append((name, cast_values(array, f)))
        rows = [
            (name, self._past_committed_ends(name, episodes, 0, array))
            for name, array in writes
            if name in self.fieldnames
        ]
        # one edit of every field's rows and the meta values (with their checksums)
        values = [(name, array) for name, array in writes if name not in self.fieldnames]
        self._commit.edit(
            [Write("meta", name, episodes, array) for name, array in values]
            + [Write("rows", name, episodes, array, 0) for name, array in rows],
            staged=lambda: self._edit_staged(
                steps=[(name, episodes, 0, array) for name, array in rows],
                meta=[(name, episodes, array) for name, array in values],
            ),
        )

    def _overlay_staged(self, name: str, episodes: np.ndarray, t0: int, rows: np.ndarray) -> None:
        """Put into ``rows`` (of ``episodes`` from step ``t0``, as read from storage) the steps of
        the episodes in progress still staged in RAM, and the default past their steps: the
        writer sees its episode in progress (and ``data[...] = ...`` keeps the staged steps it
        does not assign)."""
        group = self._group
        if group is None or not group.length:  # no step yet: meta waiting for the next episode
            return
        start, staged = group.staged(name)
        lo, hi = max(t0, start), min(t0 + rows.shape[1], start + staged.shape[1])
        fill = self.schema.fields[name].fill
        for i in np.flatnonzero(np.isin(episodes, group.slots)):
            # past its steps, the default: not the rows of the episode the slot still holds
            # (committed until this one commits), which made one read of two episodes
            rows[i, max(group.length - t0, 0) :] = fill
            if lo < hi:
                row = int(np.flatnonzero(group.slots == episodes[i])[0])
                rows[i, lo - t0 : hi - t0] = staged[row, lo - start : hi - start]

    def _edit_staged(
        self,
        steps: Sequence[tuple[str, np.ndarray, int, np.ndarray]] = (),
        meta: Sequence[tuple[str, np.ndarray, np.ndarray]] = (),
    ) -> None:
        """One edit call's part in the episodes in progress: ``steps`` as (field, episodes, first
        step, rows (episodes, steps, *shape)), ``meta`` as (field, episodes, values). The step
        log records it first (``Committer.log_edit``: a StorageError there leaves everything as
        it was), so a killed writer's episode is replayed with the edit; then the steps staged
        in RAM and the meta values take it: their commit writes them, so an edit written to
        storage only would be lost (in the seed the edit lands on the step ``store`` wrote).
        Steps that left RAM are the caller's to write to storage. An episode given twice keeps
        its last value, as numpy assignment does."""
        group = self._group
        if group is None:
            return
        rows_of = {int(slot): row for row, slot in enumerate(group.slots)}

        def hits(episodes: np.ndarray) -> dict[int, int]:
            """Row of the group -> the last index of ``episodes`` naming its slot."""
            return {rows_of[e]: i for i, e in enumerate(np.asarray(episodes).tolist()) if e in rows_of}

        parts = []
        for name, episodes, t0, rows in steps:
            end = min(t0 + rows.shape[1], group.length)
            parts += [(name, row, t0, rows[i, : end - t0]) for row, i in sorted(hits(episodes).items()) if end > t0]
        edited_meta: dict[str, np.ndarray] = {}
        for name, episodes, values in meta:
            for row, i in hits(episodes).items():
                edited_meta.setdefault(name, group.meta[name].copy())[row] = values[i]
        if self.flush_every_store_step > 0 and (parts or edited_meta):
            records = [self._commit.step_log.meta(edited_meta)] if edited_meta else []
            records += [self._commit.step_log.edit(parts)] if parts else []
            # written now once the log holds steps to replay (until then nothing is replayed)
            self._commit.log_edit(records, durable=group.length > 0 or self._commit.log_written)
        for name, values in edited_meta.items():
            group.meta[name][:] = values
        for name, row, t0, values in parts:
            for t, value in enumerate(values, t0):
                group.set_step(name, row, t, value)

    @_serialized
    def update_steps(self, episodes: Any, timesteps: Any, **data: Any) -> None:
        """Overwrite single steps of committed episodes in place: ``data[name]`` holds one value
        per (``episodes[i]``, ``timesteps[i]``) pair, (N, *shape) or broadcast to it; a pair given
        twice keeps its last value, as numpy assignment does. The scattered write-back of
        prioritized replay (``update_priorities``): only the touched bytes of each row are
        rewritten, where ``update`` rewrites whole episodes. Every value is checked before
        anything is written."""
        self._check_writable("update_steps")
        if not data:
            raise ValueError("update_steps: no data provided")
        self._check_names(data, self.fieldnames, "field", "update_steps")
        pairs = [to_numpy(v, n) for n, v in (("episodes", episodes), ("timesteps", timesteps))]
        if any(p.ndim != 1 or p.dtype.kind not in "iu" for p in pairs) or len(pairs[0]) != len(pairs[1]):
            raise ValueError(
                f"update_steps: episodes and timesteps must be 1-D int arrays of one length, got "
                f"{pairs[0].dtype} {pairs[0].shape} and {pairs[1].dtype} {pairs[1].shape}"
            )
        episodes, timesteps = (p.astype(np.int64) for p in pairs)
        beyond = episodes[(episodes < 0) | (episodes >= self.max_episodes)]
        if len(beyond):
            raise ValueError(
                f"update_steps: episodes {beyond[:5].tolist()} out of range - must be in [0, {self.max_episodes})"
            )
        lens = self._meta["episode_lens"][episodes]
        outside = (timesteps < 0) | (timesteps >= lens)
        if outside.any():
            bad = np.stack([episodes[outside], timesteps[outside]], 1)[:5].tolist()
            raise ValueError(
                f"update_steps: (episode, timestep) pairs {bad} are outside the committed episodes "
                f"(their episode_lens: {lens[outside][:5].tolist()})"
            )
        writes = []
        for name, value in data.items():
            f = self._field(name)
            array = to_numpy(value, name)
            # () <-> (1,) as the seed casts; any other feature shape must broadcast
            array = (
                fit_shape(array, f, 1)
                if array.ndim and array.shape[1:] in ((), (1,)) and f.shape in ((), (1,))
                else array
            )
            try:
                array = np.broadcast_to(array, (len(episodes), *f.shape))
            except ValueError:
                raise ValueError(
                    f"update_steps: field {name!r} value of shape {array.shape} does not broadcast to "
                    f"{(len(episodes), *f.shape)}"
                ) from None
            writes.append((name, cast_values(array, f)))
        if not len(episodes):
            return
        # one edit of every field's steps
        self._commit.edit([Write("steps", name, episodes, array, timesteps) for name, array in writes])

    def _past_committed_ends(self, name: str, slots: np.ndarray, t0: int, rows: np.ndarray) -> np.ndarray:
        """``rows`` of an edit (of ``slots`` from step ``t0``) with the steps at or past each
        committed episode's length set to the field's default: no read shows values there, and
        ``verify`` would report them as damage. Empty slots (stored as written, as the seed's
        views show them) and the episodes in progress (their length not known yet) keep every step."""
        lens = self._meta["episode_lens"][slots].astype(np.int64)
        ends = np.where(lens > 0, lens - t0, rows.shape[1])
        if self._group is not None:
            ends[np.isin(slots, self._group.slots)] = rows.shape[1]
        if not (ends < rows.shape[1]).any():
            return rows
        rows = np.array(rows)
        fill_beyond(rows, np.clip(ends, 0, rows.shape[1]), self.schema.fields[name].fill)
        return rows

    def _episode_indices(self, indices: Any, call: str, argument: str = "indices") -> tuple[np.ndarray, bool]:
        """(the slots ``indices`` names, whether it is one int); errors name ``call`` and its
        ``argument``. An empty list or tuple names no slot, as a numpy index (``np.asarray([])`` is
        float: it was refused as no ints)."""
        if indices is None:
            return np.flatnonzero(self._meta["episode_lens"] > 0), False
        if isinstance(indices, slice):
            return np.arange(self.max_episodes)[indices], False
        if isinstance(indices, (list, tuple)) and not indices:
            return np.zeros(0, np.int64), False
        is_tensor = hasattr(indices, "detach") and hasattr(indices, "cpu")  # bfloat16, meta device: named
        array = tensor_to_numpy(indices, argument) if is_tensor else np.asarray(indices)
        if array.dtype.kind not in "iu":
            raise TypeError(f"{call}: {argument} must be ints, a slice or None, got {indices!r}")
        if array.ndim > 1:  # numpy would give (*index shape, ...) values; the backends take a list of slots
            raise ValueError(f"{call}: {argument} must be an int or a 1-D sequence of ints, got shape {array.shape}")
        scalar = array.ndim == 0
        array = np.atleast_1d(array)
        bad = array[(array < 0) | (array >= self.max_episodes)]
        if len(bad):
            raise ValueError(
                f"{call}: episode indices {bad.tolist()} out of range - must be in [0, {self.max_episodes})"
            )
        return array, scalar

    # ---- reads ---------------------------------------------------------------------------------

    def warm_cache(
        self, episodes: Any = None, fields: Sequence[str] | None = None, progress: bool | None = None
    ) -> None:
        """Decode ``episodes`` (slots; None: every committed one) of ``fields`` (None: all data
        fields) into the read cache now, ahead of training, instead of on their first reads.
        Needs a cached buffer (``cache='disk'``, or a read-only one on an object store). Slots
        named one by one must hold committed episodes (a slice takes the committed ones in it):
        an empty or dropped slot named would otherwise be skipped without a word."""
        if not isinstance(self.storage, CachedStorage):
            raise ValueError(
                f"warm_cache: {self.storage.location!r} has no read cache; open it with read_only=True and "
                "cache='disk' (object stores have one by default)"
            )
        if self.storage.seed_may_write:
            raise ValueError(
                f"warm_cache: {self.storage.location!r} is a memmap-replay-buffer folder, whose reads are never "
                "cached (that library writes it without moving any slot's generation)"
            )
        slots, _ = self._episode_indices(episodes, "warm_cache", "episodes")
        if isinstance(fields, str):  # list('image') would name its letters
            raise TypeError(f"warm_cache: fields must be a sequence of field names, got the string {fields!r}")
        fields = list(self.schema.fields) if fields is None else list(fields)
        unknown = sorted(set(fields) - set(self.schema.fields))
        if unknown:
            raise ValueError(f"warm_cache: invalid field names {unknown} - must be among {sorted(self.schema.fields)}")
        committed = self._meta["episode_lens"][slots] > 0
        if episodes is not None and not isinstance(episodes, slice) and not committed.all():
            raise ValueError(
                f"warm_cache: episodes {np.unique(slots[~committed]).tolist()} hold no committed episode "
                f"({len(self.valid_episodes())} committed: see valid_episodes())"
            )
        self.storage.warm(slots[committed], fields, progress)

    # ---- reading back: dataset() and dataloader() are CommittedViews' (replaybuf.sampling) --------

    @_serialized
    def update_priorities(
        self, indices: Any, priorities: Any, priority_field: str = "priority", generations: Any = None
    ) -> int:
        """Write new priorities for a prioritized batch's ``_indices`` (B, 2) into
        ``priority_field`` and into the live prioritized loaders of this buffer; with the batch's
        ``_generations``, pairs whose slot was reused since are skipped. Returns the pairs written."""
        from .sampling import update_priorities

        return update_priorities(self, indices, priorities, priority_field, generations)

    def image_fields(self) -> list[str]:
        """Fields holding one frame per step ((H, W), (H, W, C) or (C, H, W)), in declaration order."""
        return video.image_fields(self)

    def default_image_field(self) -> str:
        return video.default_image_field(self)

    def episode_frames(self, episode_index: int | Sequence[int] = 0, field: str | None = None) -> np.ndarray:
        """Frames of one episode, or several concatenated in time (one slab read per episode)."""
        return video.episode_frames(self, episode_index, field)

    def save_video(
        self,
        path: str | os.PathLike,
        episode_index: int | Sequence[int] = 0,
        field: str | None = None,
        fps: float = 30,
        **kwargs: Any,
    ) -> Path:
        """Render episode(s) of an image field to .mp4 / .webm / .gif."""
        return video.save_video(self, os.fspath(path), episode_index, field, fps, **kwargs)

    def create_collector(
        self,
        num_groups: int,
        fieldnames: tuple[str, ...] | None = None,
        meta_fieldnames: tuple[str, ...] | None = None,
        **collector_kwargs: Any,
    ) -> EpisodeCollector:
        """An EpisodeCollector that gathers ``num_groups`` lock-step episodes and stores them here."""
        from .collector import EpisodeCollector

        return EpisodeCollector(
            self, num_groups, fieldnames=fieldnames, meta_fieldnames=meta_fieldnames, **collector_kwargs
        )

    create_rollout_collector = create_collector

    def __getstate__(self) -> dict[str, Any]:
        """A pickled buffer (e.g. sent to a DataLoader worker) is a read-only view of what was
        committed; it carries no open handle and reopens its store lazily in the new process."""
        state = dict(self.__dict__)
        # the copy checks every committed slot's meta checksum at its first refresh (a few ms a
        # million slots) rather than carrying the values this one checked
        state.update(
            _group=None,
            read_only=True,
            _verified=None,
            _unpickled_writer=not self.read_only or self.__dict__.get("_unpickled_writer", False),
        )
        state.pop("memory_namedtuple", None)
        state.pop("_rlock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rlock, self._lock_pid = threading.RLock(), os.getpid()
        self.storage.read_only = True

    @_serialized
    def compact(self) -> CompactionSummary:
        """Compress every episode the hot tier holds raw (``hot_bytes``) now, each replaced
        atomically, and return when done: episodes compacted, their bytes before and after,
        seconds. ``close()`` does it too; ``flush()`` does not. Counted with them: the hot episodes
        of another writable object of this buffer in this process, compacted as this one takes
        its turn (only the first object opened keeps a hot tier)."""
        started = time.perf_counter()
        self._refuse_unwritable("compact")
        handed = self._take_turn("compact")
        summary = self._compact()
        if handed is not None:
            summary.episodes += handed.episodes
            summary.bytes_before += handed.bytes_before
            summary.bytes_after += handed.bytes_after
            summary.seconds = time.perf_counter() - started
        return summary

    @_serialized
    def close(self) -> None:
        """Flush, compress what the hot tier holds raw (``compact``), release the storage
        handles and give the writer lease back. Reads still work after it; writes raise (open
        the buffer again to write). Closing again does nothing."""
        self._release(compact=True)

    def _compact(self) -> CompactionSummary:
        """``storage.compact()``; a failure (a full disk) says what it means for the episodes: its
        message names the compressed shard it could not write, which read as damage to them."""
        try:
            return self.storage.compact()
        except (OSError, StorageError) as error:
            error.add_note(
                "compaction stopped; every episode it had not compacted stays stored uncompressed (hot) and reads "
                "back the same: compact() or close() again once the cause is gone"
            )
            raise

    def _release(self, compact: bool) -> None:
        """``close()``; ``compact`` False leaves the hot episodes hot (for the next writer's
        compactor), as a dropped buffer does."""
        if self._closed:
            return
        try:
            try:
                if not self._superseded():
                    self.flush()
                    if compact and not self.read_only:
                        self._compact()
            finally:
                # closed even when the flush failed (a full disk): nothing committed needs the
                # counters it could not write, the next writable open derives them
                self.storage.close()
        finally:
            self._closed = True
            self.storage.release_writer()

    def _superseded(self) -> bool:
        """Whether a later ``overwrite=True`` open in this process erased the buffer this object
        wrote to (or its lease was taken over): what it has pending belongs to a buffer gone, so
        closing it writes nothing there and refuses nothing."""
        try:
            self.storage.check_lease_current()
        except BufferLockedError:
            return True
        return False

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()  # closes and gives the lease back even when it raises
        except Exception as error:
            # the block's error, the first cause (a store a full disk refused), goes on: a failed
            # close (the compaction the same full disk refused) replaced it, hiding what was lost
            exc.add_note(f"then close() failed too: {error}")

    def __del__(
        self, _suppress: Any = contextlib.suppress, _collecting: Any = collecting, _finalizing: Any = sys.is_finalizing
    ) -> None:
        # dropped without close() (``del``, a function returning, a name bound again): no
        # reference cycle holds a buffer (``storage/_owner.py``), so this runs at once and gives
        # back what close() does, compacting nothing (README, Durability). What it calls is bound
        # here: a buffer held by a module's globals is freed at exit after other modules' globals
        # were set to None ("'NoneType' object has no attribute 'suppress'")
        if getattr(self, "_closed", True):
            return
        with _suppress(Exception):  # a failed open may not have made its storage
            if _collecting() or _finalizing():
                # freed by a garbage collection (a cycle of the user's held it), which may run at
                # any allocation, inside a lock close() takes (a map pool's, an event loop's), or
                # at exit, whose hook gave the lease back (daemon threads frozen): only what is
                # pending on local disk is written; the storage's finalizer gives the lease back
                if self.storage.is_local:
                    self._commit.flush_counters()
                    if self._commit.log_pending:
                        self._commit.flush_log()
                elif self._commit.counters_pending and (lease := self.storage.held_lease) is not None:
                    # a remote write could wait on what the collection interrupted: another
                    # object of this process sharing the lease writes these counters before it
                    # writes (``_take_turn``), or it would reuse the slots of the episodes they count
                    lease.orphaned_state = dict(self._commit.state)
            else:
                self._release(compact=False)
