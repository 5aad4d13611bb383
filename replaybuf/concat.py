"""ConcatReplayBuffer: one read-only buffer over several stored buffers, on any mix of backends.

The member buffers keep their own storage; ``ConcatStorage`` puts them side by side on one
episode axis (member ``k``'s slot ``s`` is global episode ``offsets[k] + s``) and one time
axis as long as the longest member's, reading zeros past a shorter member's end. The
ConcatReplayBuffer implements ``view.BufferView`` from its members' public snapshots
(``episode_lens``, ``generations``, ``meta_values``), so the sampling datasets, the dask views
in ``analysis.py`` and the viewer work on it unchanged. It has no writer: ReplayBuffer's write
methods (``WRITE_METHODS``) raise NotImplementedError naming the call.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .attrs import BufferAttrs
from .buffer import DataView, MetaView, ReplayBuffer
from .consistency import snapshot_gone
from .sampling.mixture import check_weights
from .schema import Field, Schema
from .storage import (
    ArrayBase,
    BufferNotFoundError,
    BufferReplacedError,
    GenerationMismatchError,
    Spans,
    Storage,
    UnfinishedCreateError,
    WrappedArray,
    is_url,
)
from .view import CommittedViews, FieldViews, read_only_message

__all__ = ["ConcatReplayBuffer", "ConcatStorage", "WRITE_METHODS"]

# ReplayBuffer's write methods: on a ConcatReplayBuffer each raises NotImplementedError
WRITE_METHODS = frozenset(
    {
        "store",
        "store_batch",
        "store_meta_batch",
        "store_episode",
        "store_datapoint",
        "store_meta_datapoint",
        "store_batch_datapoint",
        "store_batch_meta_datapoint",
        "update",
        "update_priorities",
        "advance_episode",
        "one_episode",
        "batched_episode",
        "clear",
        "reset_",
        "drop_episodes",
        "create_collector",
        "create_rollout_collector",
    }
)

Member = ReplayBuffer | str | os.PathLike


class ConcatArray(ArrayBase):
    """The stored array of a data field over the concatenated episodes: plain numpy-style reads
    (``concat.data[name]`` reads through ``buffer.DataView``, consistently)."""

    def __init__(self, storage: ConcatStorage, name: str, shape: tuple[int, ...], dtype: np.dtype):
        self._storage, self._name = storage, name
        self.shape, self.dtype = shape, np.dtype(dtype)

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        episode_key, time_key = (key + (slice(None), slice(None)))[:2]
        episodes = np.arange(self.shape[0])[episode_key]
        steps = np.arange(self.shape[1])[time_key]
        flat = np.atleast_1d(steps)
        t0, t1 = (int(flat.min()), int(flat.max()) + 1) if flat.size else (0, 0)
        rows = self._storage.read_rows(self._name, np.atleast_1d(episodes), t0, t1)[:, flat - t0]
        squeeze = tuple(0 if np.ndim(index) == 0 else slice(None) for index in (episodes, steps))
        return rows[squeeze + key[2:]]

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NotImplementedError(
            f"data/{self._name} of a ConcatReplayBuffer is read-only: write to its member buffers"
        )


class ConcatMetaArray(WrappedArray):
    """The stored array of a meta field over the concatenated episodes: reads of the members'
    values now; writes refused, as every write to the concatenation is (a plain copy took
    them and dropped them)."""

    def __init__(self, storage: ConcatStorage, name: str):
        self._storage, self._name = storage, name

    def _wrapped(self) -> np.ndarray:
        return self._storage.read_meta(self._name)

    def __getitem__(self, key: Any) -> np.ndarray:
        return self._wrapped()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NotImplementedError(
            f"meta/{self._name} of a ConcatReplayBuffer is read-only: write to its member buffers"
        )


class ConcatStorage(Storage):
    """Read-only storage routing reads by global episode index to the member storages."""

    backend_name = "concat"
    supports_writes = False

    def __init__(self, buffers: Sequence[ReplayBuffer], schema: Schema):
        super().__init__(" + ".join(b.storage.location for b in buffers))
        self.members = [b.storage for b in buffers]
        # a member's refresh closes what its reads use (hdf5): the concatenation's lock is then
        # held by its reads and refreshes, as a ReplayBuffer's (``view.mirror_lock``)
        self.closes_at_refresh = any(m.closes_at_refresh for m in self.members)
        self.member_timesteps = np.array([b.max_timesteps for b in buffers], np.int64)
        self.offsets = np.cumsum([0] + [b.max_episodes for b in buffers])
        self.schema = schema
        self.read_only = True
        # per member: its snapshot's name and recorded generations (None: the whole buffer), so
        # that a member opened at a snapshot reads exactly that snapshot, as the view alone does
        self.snapshots = [b.snapshot_name for b in buffers]
        self.recorded = [None if b.snapshot_name is None else np.array(b.generations, np.int64) for b in buffers]

    def _route(self, episodes: np.ndarray):
        """(member index, rows of ``episodes`` in it, local slots) for each member touched."""
        episodes = np.asarray(episodes, np.int64)
        if episodes.size and (episodes.min() < 0 or episodes.max() >= self.offsets[-1]):
            raise IndexError(f"episode indices must be in [0, {self.offsets[-1]}), got {episodes.tolist()}")
        owner = np.searchsorted(self.offsets, episodes, side="right") - 1
        for member in np.unique(owner):
            rows = np.flatnonzero(owner == member)
            yield int(member), rows, episodes[rows] - self.offsets[member]

    @contextlib.contextmanager
    def _member(self, member: int) -> Iterator[Storage]:
        """Member ``member``'s storage; a GenerationMismatchError it raises names global slots,
        or, from a member opened at a snapshot, is the SnapshotError of its episodes gone."""
        try:
            yield self.members[member]
        except GenerationMismatchError as error:
            slots = np.asarray(error.slots)
            name = self.snapshots[member]
            if name is not None:
                raise snapshot_gone(name, self.members[member].location, slots) from None
            raise GenerationMismatchError(self.location, slots + self.offsets[member]) from None

    def _snapshot_generations(self, member: int, local: np.ndarray, stored: np.ndarray) -> np.ndarray:
        """``stored`` generations of a member's ``local`` slots as its snapshot sees them: 0
        outside the snapshot (an empty slot, as to the view alone), SnapshotError where a
        recorded episode was overwritten; a whole buffer's as stored."""
        recorded, name = self.recorded[member], self.snapshots[member]
        if recorded is None or name is None:  # both or neither
            return stored
        recorded = recorded[local]
        gone = (recorded > 0) & (stored != recorded)
        if gone.any():
            raise snapshot_gone(name, self.members[member].location, np.asarray(local)[gone])
        return np.where(recorded > 0, stored, 0)

    def _empty(self, name: str, leading: tuple[int, ...]) -> np.ndarray:
        field = self.schema.fields[name]
        return np.zeros(leading + field.shape, field.dtype)

    # ---- primitives -------------------------------------------------------------------

    def exists(self) -> bool:
        # docstring inherited
        return all(m.exists() for m in self.members)

    def create(self, schema: Schema, overwrite: bool) -> None:
        # docstring inherited
        raise NotImplementedError(_read_only_message("create"))

    def open(self, read_only: bool) -> Schema:
        # docstring inherited
        if not read_only:
            raise NotImplementedError(_read_only_message("open(read_only=False)"))
        return self.schema

    def array(self, name: str, meta: bool = False) -> ConcatArray | ConcatMetaArray:
        # docstring inherited
        if meta:
            return ConcatMetaArray(self, name)
        field = self.schema.fields[name]
        return ConcatArray(self, name, (int(self.offsets[-1]), self.schema.max_timesteps, *field.shape), field.dtype)

    def read_blob(self, key: str, limit: int | None = None) -> bytes | None:
        # docstring inherited
        return None

    def write_blob(self, key: str, data: bytes) -> None:
        # docstring inherited
        raise NotImplementedError(_read_only_message("write_blob"))

    def delete_blobs(self, prefix: str) -> None:
        # docstring inherited
        raise NotImplementedError(_read_only_message("delete_blobs"))

    def list_blobs(self, prefix: str) -> list[str]:
        # docstring inherited
        return []

    # ---- reads ----------------------------------------------------------------------------

    def time_chunk(self, name: str) -> int:
        # docstring inherited
        return max(m.time_chunk(name) for m in self.members)

    @property
    def verifies_generations(self) -> bool:  # type: ignore[override]
        """Reads are verified when every member's are (generations are per member)."""
        return all(m.verifies_generations for m in self.members)

    @property
    def checks_whole_episodes(self) -> bool:
        # docstring inherited: when any member's does
        return any(m.checks_whole_episodes for m in self.members)

    @property
    def seed_may_write(self) -> bool:
        # docstring inherited: when it may write any member
        return any(m.seed_may_write for m in self.members)

    def verifies_reads(self, names: Iterable[str]) -> bool:
        # docstring inherited: when every member's are
        names = tuple(names)
        return all(m.verifies_reads(names) for m in self.members)

    def verifies_gathers(self, names: Iterable[str]) -> bool:
        # docstring inherited: when every member's are
        names = tuple(names)
        return all(m.verifies_gathers(names) for m in self.members)

    def read_rows(
        self, name: str, episodes: np.ndarray, t0: int, t1: int, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        episodes = np.asarray(episodes, np.int64)
        out = self._empty(name, (len(episodes), max(0, t1 - t0)))
        for member, rows, local in self._route(episodes):
            stop = min(t1, int(self.member_timesteps[member]))
            if stop > t0:
                with self._member(member) as storage:
                    out[rows, : stop - t0] = storage.read_rows(name, local, t0, stop, _part(generations, rows))
        return out

    def _read_spans(
        self, name: str, spans: Spans, out: np.ndarray, parallel: bool, generations: np.ndarray | None
    ) -> None:
        """Each run of consecutive rows from its member's bulk path (``Storage.read_spans``);
        steps past a member's time axis read as zero, as ``read_rows`` gives them."""
        starts, lengths = spans.starts, spans.lengths
        for member, rows, local in self._route(spans.episodes):
            stop = self.member_timesteps[member]
            kept = np.clip(np.minimum(starts[rows] + lengths[rows], stop) - starts[rows], 0, None)
            firsts = np.where(kept > 0, starts[rows], 0)
            runs = np.flatnonzero(np.diff(rows) != 1) + 1
            for lo, hi in zip(np.r_[0, runs], np.r_[runs, len(rows)]):
                first = int(rows[lo])
                with self._member(member) as storage:
                    storage.read_spans(
                        name,
                        local[lo:hi],
                        firsts[lo:hi],
                        kept[lo:hi],
                        out[first : first + hi - lo],
                        parallel,
                        _part(generations, rows[lo:hi]),
                    )
            for row, span, length in zip(rows.tolist(), kept.tolist(), lengths[rows].tolist()):
                out[row, span:length] = 0

    def gather(
        self, name: str, episodes: np.ndarray, timesteps: np.ndarray, generations: np.ndarray | None = None
    ) -> np.ndarray:
        # docstring inherited
        episodes, timesteps = np.asarray(episodes, np.int64), np.asarray(timesteps, np.int64)
        out = self._empty(name, (len(episodes),))
        for member, rows, local in self._route(episodes):
            inside = timesteps[rows] < self.member_timesteps[member]
            if inside.any():
                with self._member(member) as storage:
                    out[rows[inside]] = storage.gather(
                        name, local[inside], timesteps[rows][inside], _part(generations, rows[inside])
                    )
        return out

    def preload(self, name: str, episodes: np.ndarray, generations: np.ndarray) -> None:
        # docstring inherited
        for member, rows, local in self._route(episodes):
            with self._member(member) as storage:  # a reused slot is named by its global index
                storage.preload(name, local, np.asarray(generations)[rows])

    def read_meta(self, name: str) -> np.ndarray:
        # docstring inherited
        parts = [m.read_meta(name) for m in self.members]
        if name == "_generation":
            parts = [self._snapshot_generations(k, np.arange(len(p)), p) for k, p in enumerate(parts)]
        return np.concatenate(parts)

    def read_meta_rows(self, name: str, episodes: np.ndarray) -> np.ndarray:
        """Each member's own entries, read from that member (generations are per member)."""
        episodes = np.asarray(episodes, np.int64).reshape(-1)
        parts = []
        for m, rows, local in self._route(episodes):
            values = self.members[m].read_meta_rows(name, local)
            parts.append((rows, self._snapshot_generations(m, local, values) if name == "_generation" else values))
        if not parts:
            return self.members[0].read_meta(name)[:0]
        out = np.empty((len(episodes), *parts[0][1].shape[1:]), parts[0][1].dtype)
        for rows, values in parts:
            out[rows] = values
        return out

    def write_rows(self, name: str, episodes: np.ndarray, t0: int, values: np.ndarray) -> None:
        # docstring inherited
        raise NotImplementedError(_read_only_message("write_rows"))

    def write_meta(self, name: str, episodes: np.ndarray, values: np.ndarray) -> None:
        # docstring inherited
        raise NotImplementedError(_read_only_message("write_meta"))

    def drop_caches(self) -> None:
        # docstring inherited
        for member in self.members:
            member.drop_caches()

    def drop_cached_rows(self, name: str, slots: np.ndarray) -> None:
        # docstring inherited: each member's own slots
        for member, _, local in self._route(np.asarray(slots, np.int64).reshape(-1)):
            self.members[member].drop_cached_rows(name, local)

    def replaced(self, cheap_only: bool = False) -> bool:
        """Whether any member's buffer was replaced since its storage here opened it (another
        process created it again): reads planned on this storage then raise instead of mixing."""
        return any(m.replaced(cheap_only) for m in self.members)

    def close(self) -> None:
        # docstring inherited
        for member in self.members:
            member.close()

    def _check_writable(self) -> None:
        # the writes Storage implements on top of write_blob (counters, step log) refuse as the others do
        raise NotImplementedError(_read_only_message("writing"))


def _part(generations: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    """The generations of ``rows`` (positions in a read) for the member they route to."""
    return None if generations is None else np.asarray(generations)[rows]


def _read_only_message(call: str) -> str:
    return read_only_message("ConcatReplayBuffer", call)


def _same_fill(a: Field, b: Field) -> bool:
    """Whether fields ``a`` and ``b`` pad with the same value (NaN equal to NaN)."""
    return bool(np.array_equal(np.array(a.fill, a.dtype), np.array(b.fill, b.dtype), equal_nan=a.dtype.kind in "fc"))


def _check_same_fields(buffers: Sequence[ReplayBuffer]) -> None:
    """Every member must store the same data and meta fields (names, dtypes, shapes, defaults):
    the concatenation pads every member's rows with one default per field."""
    first = buffers[0]
    problems = []
    for index, buffer in enumerate(buffers[1:], start=1):
        for group, ours, theirs in (
            ("fields", first.schema.fields, buffer.schema.fields),
            ("meta fields", first.schema.meta_fields, buffer.schema.meta_fields),
        ):
            missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
            if missing:
                problems.append(f"  buffer {index} ({buffer.storage.location!r}) lacks {group} {missing}")
            if extra:
                problems.append(f"  buffer {index} ({buffer.storage.location!r}) has extra {group} {extra}")
            for name in sorted(set(ours) & set(theirs)):
                a, b = ours[name], theirs[name]
                if (a.dtype, a.shape) != (b.dtype, b.shape):
                    problems.append(
                        f"  buffer {index} ({buffer.storage.location!r}) {group[:-1]} {name!r} is "
                        f"{b.dtype.name}{list(b.shape)}, buffer 0 has {a.dtype.name}{list(a.shape)}"
                    )
                elif not _same_fill(a, b):
                    problems.append(
                        f"  buffer {index} ({buffer.storage.location!r}) {group[:-1]} {name!r} has default "
                        f"{b.fill!r}, buffer 0 has {a.fill!r} (rows are padded with one default)"
                    )
    if problems:
        raise ValueError(
            f"ConcatReplayBuffer: all buffers must have the same fields as buffer 0 "
            f"({first.storage.location!r}):\n" + "\n".join(problems)
        )


class ConcatReplayBuffer(CommittedViews):
    """Several stored buffers read as one, read-only: local paths, URLs and buffers mixed.

    ``buffers`` are paths or URLs (opened read-only with ``storage_options``, one dict for all
    or one per entry; one dict for all applies to the URLs only, so that local and remote
    members mix) or ``ReplayBuffer`` objects. Episodes are the members' committed
    episodes, member by member, each oldest first; data is time-padded with the fields' default
    (else zeros) to the longest member's ``max_timesteps``. All members must store the same fields (names, dtypes,
    shapes, defaults).

    ``weights`` (one number >= 0 per buffer) makes its loaders draw each sample's buffer with
    those probabilities (``sampling.mixture``); ``filter_meta`` may then be one dict per buffer.
    ``snapshot``: open every member at its named snapshot (``ReplayBuffer.snapshot``), e.g. the
    shards of a parallel collection each frozen under one name. ``folders`` is memmap-replay-buffer's
    name for ``buffers``.
    """

    def __init__(
        self,
        buffers: Sequence[Member] | str | os.PathLike | None = None,
        storage_options: dict | Sequence[dict | None] | None = None,
        weights: Sequence[float] | None = None,
        snapshot: str | None = None,
        *,
        folders: Sequence[Member] | None = None,
    ):
        members = folders if buffers is None else buffers
        if members is None or (buffers is not None and folders is not None):
            raise TypeError(
                "ConcatReplayBuffer takes its members as buffers (or folders, the seed's name): one of them"
            )
        buffers = members
        # shards of a root whose create never finished (an actor creating it now, or killed
        # while it did) hold no episode and are left out, unless weights or per-shard options
        # are given one per shard found
        skip_unfinished, root = False, None
        if isinstance(buffers, (str, os.PathLike)):
            from .actors import discover_shards

            root = os.fspath(buffers)
            # per-buffer options (a list) apply to the shards found, not to finding them
            found = discover_shards(root, storage_options if isinstance(storage_options, dict) else None)
            buffers = found or [root]
            skip_unfinished = bool(found) and weights is None and not isinstance(storage_options, Sequence)
        if isinstance(buffers, ReplayBuffer) or not isinstance(buffers, Sequence):
            raise TypeError(
                f"ConcatReplayBuffer takes a shard root or a list of paths, URLs or ReplayBuffers, got {buffers!r}"
            )
        if len(buffers) == 0:
            raise ValueError("ConcatReplayBuffer requires at least one buffer")
        if isinstance(storage_options, Sequence):
            options = list(storage_options)
        else:  # one dict for all: the URLs' (a local member takes none, and would warn)
            options = [storage_options if is_url(str(buffer)) else None for buffer in buffers]
        if len(options) != len(buffers):
            raise ValueError(
                f"storage_options has {len(options)} entries for {len(buffers)} buffers; "
                "pass one dict for all or one per buffer"
            )
        self.weights = check_weights(weights, len(buffers))
        self.buffers = []
        for buffer, options_of_buffer in zip(buffers, options):
            try:
                self.buffers.append(self._open(buffer, options_of_buffer, snapshot))
            except UnfinishedCreateError:
                if not skip_unfinished:
                    raise
        if not self.buffers:
            raise BufferNotFoundError(f"no shard under {root!r} holds a finished buffer yet (each is being created)")
        _check_same_fields(self.buffers)
        first = self.buffers[0].schema
        self.schema = Schema(
            dict(first.fields),
            dict(first.meta_fields),
            sum(b.max_episodes for b in self.buffers),
            max(b.max_timesteps for b in self.buffers),
        )
        self.read_only = True
        # members all at one snapshot: reads raise SnapshotError for an episode no longer stored
        names = {b.snapshot_name for b in self.buffers}
        self.snapshot_name = names.pop() if len(names) == 1 else None
        self.folder = [b.folder for b in self.buffers]
        self.storage = ConcatStorage(self.buffers, self.schema)
        self.refresh()

    @property
    def data(self) -> FieldViews[DataView]:
        """Each data field's numpy-style view by name, reading across the members."""
        return FieldViews("data", self.schema.fields, functools.partial(DataView, self))

    @property
    def meta_data(self) -> FieldViews[MetaView]:
        """Each meta field's view by name, reading across the members."""
        return FieldViews("meta_data", self.meta_shapes, functools.partial(MetaView, self))

    @staticmethod
    def _open(buffer: Member, storage_options: dict | None, snapshot: str | None) -> ReplayBuffer:
        if isinstance(buffer, ReplayBuffer):
            if snapshot is not None and buffer.snapshot_name != snapshot:
                raise ValueError(
                    f"ConcatReplayBuffer(snapshot={snapshot!r}): member {buffer.folder!r} is "
                    f"{'the whole buffer' if buffer.snapshot_name is None else f'snapshot {buffer.snapshot_name!r}'}; "
                    "pass its path, or ReplayBuffer.from_folder(path, snapshot=...)"
                )
            return buffer
        if isinstance(buffer, (str, os.PathLike)):
            return ReplayBuffer.from_folder(buffer, read_only=True, storage_options=storage_options, snapshot=snapshot)
        raise TypeError(f"ConcatReplayBuffer: each buffer must be a path, a URL or a ReplayBuffer, got {buffer!r}")

    def refresh(self) -> ConcatReplayBuffer:
        """Pick up episodes the members' writers committed since (a member passed in as a
        writable buffer is its own writer and already up to date). A member another process
        replaced (``overwrite=True``, or deleted and created again) is reopened as
        ``ReplayBuffer.refresh`` does, and the concatenation then reads through a new
        ``ConcatStorage``: datasets and loaders made before keep raising ``BufferReplacedError``
        instead of reading the new member under their old plan. A replaced member of another
        config raises ``BufferReplacedError`` naming it, and every read keeps raising.
        A refresh of another thread waits for this object's reads (``_lock``)."""
        with self._lock:
            return self._refresh()

    def _refresh(self) -> ConcatReplayBuffer:
        """``refresh``, holding the lock."""
        try:
            for k, buffer in enumerate(self.buffers):
                if buffer.read_only:
                    try:
                        buffer.refresh()
                    except BufferReplacedError as error:
                        raise BufferReplacedError(
                            error.location, f"ConcatReplayBuffer member {k}: {error.detail or 'cannot be reopened'}"
                        ) from error
        finally:  # never route reads to a member storage a reopen closed
            if any(b.storage is not m for b, m in zip(self.buffers, self.storage.members)):
                self.storage = ConcatStorage(self.buffers, self.schema)
        self._snapshot = {n: np.concatenate([b.meta_values(n) for b in self.buffers]) for n in self.meta_shapes}
        self._snapshot["_generation"] = np.concatenate([b.generations for b in self.buffers])
        return self

    @property
    def member_attrs(self) -> tuple[BufferAttrs, ...]:
        """Each member buffer's attributes (``ReplayBuffer.attrs``), in member order."""
        return tuple(b.attrs for b in self.buffers)

    @property
    def attrs(self) -> Mapping[str, Any]:
        """The attributes every member holds with the same value, read-only: what is true of the
        whole concatenation (each member's own: ``member_attrs``)."""
        first, *others = self.member_attrs
        return MappingProxyType({k: v for k, v in first.items() if all(k in o and o[k] == v for o in others)})

    # ---- bookkeeping, as ReplayBuffer -----------------------------------------------------------

    @property
    def num_episodes(self) -> int:
        return sum(b.num_episodes for b in self.buffers)

    def _committed(self) -> dict[str, np.ndarray]:
        return self._snapshot

    def listed_slots(self) -> np.ndarray:
        """The global slots ``get_all_data`` returns a row for: each member's ``0 .. num_episodes - 1``."""
        offsets = self.storage.offsets
        return np.concatenate([b.listed_slots() + offsets[k] for k, b in enumerate(self.buffers)]).astype(np.int64)

    def empty_episodes(self) -> np.ndarray:
        """The global slots of the members' committed length-0 episodes."""
        offsets = self.storage.offsets
        return np.concatenate([b.empty_episodes() + offsets[k] for k, b in enumerate(self.buffers)]).astype(np.int64)

    def valid_episodes(self) -> np.ndarray:
        """Global slots holding a committed episode: member by member, each oldest first."""
        offsets = self.storage.offsets
        return np.concatenate([b.valid_episodes() + offsets[k] for k, b in enumerate(self.buffers)]).astype(np.int64)

    def unsettled_slots(self) -> np.ndarray:
        """Global slots of the members' ``unsettled_slots``."""
        offsets = self.storage.offsets
        return np.concatenate([b.unsettled_slots() + offsets[k] for k, b in enumerate(self.buffers)]).astype(np.int64)

    def unfinished_edit_slots(self) -> np.ndarray:
        """Global slots of the members' ``unfinished_edit_slots``."""
        offsets = self.storage.offsets
        return np.concatenate([b.unfinished_edit_slots() + offsets[k] for k, b in enumerate(self.buffers)]).astype(
            np.int64
        )

    def filter_episodes(self, filter_meta: Sequence[dict | None], lens: np.ndarray, min_episode_len: int) -> np.ndarray:
        """Global slots of ``lens`` (a snapshot of ``episode_lens``) matching one filter per member
        (``None``: all of the member's episodes with at least ``min_episode_len`` steps)."""
        from .sampling.datasets import episode_filter

        if len(filter_meta) != len(self.buffers):
            raise ValueError(
                f"filter_meta has {len(filter_meta)} entries for {len(self.buffers)} buffers; "
                "give one dict (or None) per buffer, or one dict for all"
            )
        offsets = self.storage.offsets
        slots = []
        for k, (buffer, wanted) in enumerate(zip(self.buffers, filter_meta)):
            try:
                found = episode_filter(buffer, lens[offsets[k] : offsets[k + 1]], wanted, min_episode_len)
            except ValueError as error:
                raise ValueError(f"filter_meta[{k}] on {buffer.storage.location}: {error}") from None
            slots.append(found + offsets[k])
        return np.concatenate(slots).astype(np.int64)

    def __len__(self) -> int:
        return sum(len(b) for b in self.buffers)

    def __repr__(self) -> str:
        return f"ConcatReplayBuffer({[b.storage.location for b in self.buffers]!r}, episodes={len(self)})"

    def __getstate__(self) -> dict[str, Any]:
        """Pickles (to DataLoader or dask workers) as the members do: no open handle."""
        state = dict(self.__dict__)
        state.pop("memory_namedtuple", None)
        state.pop("_rlock", None)
        return state

    if not TYPE_CHECKING:  # to a type checker a concatenation has no write method at all

        def __getattr__(self, name: str) -> Callable[..., NoReturn]:
            """ReplayBuffer's write methods (``WRITE_METHODS``): each raises when called."""
            if name not in WRITE_METHODS:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

            def refuse(*args: Any, **kwargs: Any) -> NoReturn:
                raise NotImplementedError(_read_only_message(name))

            refuse.__name__ = name
            return refuse

    # ---- reads --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Nothing to flush: the buffer is read-only."""

    def close(self) -> None:
        """Release the members' storage handles."""
        for buffer in self.buffers:
            buffer.storage.close()

    def __enter__(self) -> ConcatReplayBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
