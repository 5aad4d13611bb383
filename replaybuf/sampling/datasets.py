"""Map-style datasets over a snapshot of a ReplayBuffer: trajectories, timesteps, n-step
transitions and time windows, with the seed's (memmap-replay-buffer) semantics.

Each dataset fixes, at creation, the slots it uses with their lengths and generations: it sees
the episodes committed up to then and never a half-written one. ``__getitems__`` (what torch's
DataLoader calls with a whole batch) reads every field once for the batch, naming the snapshot's
generations, through the one optimistic read (``consistency.read_consistent``): samples whose
slot a writer reused in the meantime are replaced by fresh draws among those the batch's sampler
could have drawn in their place (the same member's in a weighted mixture, the rank's share of the
epoch under DDP), or dropped (in a
prioritized batch, whose importance weights are its samples' own, or when nothing is left; a
batch finding every episode of the snapshot overwritten raises SnapshotOverwrittenError). On a storage that ``verifies_generations`` (the read cache) a sample is served from the
copy of the episode the snapshot named, when one is kept, even after the slot was reused.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..consistency import RETRIES, check_settled, read_consistent
from ..inputs import check_flag
from ..schema import UnknownFieldError
from ..storage import BufferReplacedError, GenerationMismatchError, fill_beyond
from ..view import BufferView, mirror_lock
from .collate import CollatedSamples
from .distributed import Shard
from .fetch import Fetcher


class SnapshotOverwrittenError(RuntimeError):
    """A batch found every episode of its dataset's snapshot overwritten or dropped by a writer
    since the dataset was made (slots reused, ``clear()``, ``drop_episodes``): nothing is left
    to sample (instead of a batch of no samples). Not retryable with the same loader: make a
    new one, which sees the episodes committed then."""


def as_buffer(replay_buffer: BufferView | str | os.PathLike) -> BufferView:
    """A buffer from a buffer (any ``BufferView``), a path or a URL (opened read-only)."""
    if isinstance(replay_buffer, (str, os.PathLike)):
        from ..buffer import ReplayBuffer

        return ReplayBuffer.from_folder(replay_buffer, read_only=True)
    if not isinstance(replay_buffer, BufferView):
        raise TypeError(f"replay_buffer must be a ReplayBuffer, a path or a URL, got {type(replay_buffer).__name__}")
    return replay_buffer


def check_names(names: Iterable[str] | None, allowed: Iterable[str], argument: str) -> tuple[str, ...] | None:
    """``names`` as a tuple, or an ``UnknownFieldError`` (a ValueError and, as the seed's lookups
    raise, a KeyError) naming the unknown ones and the valid choices."""
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"{argument} must be a sequence of field names, got the string {names!r}")
    if not isinstance(names, Iterable):  # 5: "'int' object is not iterable", naming no argument
        raise TypeError(f"{argument} must be a sequence of field names, got {names!r}")
    names = tuple(names)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise UnknownFieldError(f"{argument}: invalid field names {unknown} - must be among {sorted(allowed)}")
    return names


def sample_index(index: Any) -> int:
    """``index`` as an int (numpy's, a 0-d array or tensor too, as the seed's datasets and torch's
    DataLoader take it), or a TypeError: a float would be truncated, a flag, slice or mask read
    as something else."""
    if not isinstance(index, bool) and getattr(index, "dtype", None) not in (torch.bool, np.bool_):
        try:
            return operator.index(index)
        except TypeError:
            pass
    raise TypeError(f"a dataset index must be an int, got {index!r} ({type(index).__name__})")


def check_filter_value(argument: str, name: str, value: Any, shape: tuple[int, ...]) -> None:
    """A ValueError naming ``argument[name]`` when ``value`` cannot be compared with each row of a
    field of ``shape`` (a list of several values for a scalar field, a vector of the wrong length)."""
    given = np.shape(value)
    try:
        fits = np.size(value) == 1 or np.broadcast_shapes(given, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{argument}[{name!r}]: a value of shape {given} for a field of shape {shape} - "
            "give one value of the field's shape (episodes or steps equal to it are kept)"
        )


def refresh_for_snapshot(buffer: BufferView, min_episode_len: int = 1) -> None:
    """Refresh a read-only ``buffer``, flush a writable one. ``refresh()`` leaves out a slot a
    writer changed while it was loaded (``consistency.stored_bookkeeping``): when that left no
    episode of ``min_episode_len`` steps although the buffer (or a member of a
    ConcatReplayBuffer) counts more committed episodes than it lists (a writer rewriting the
    slots of a small circular buffer), it is loaded again, up to ``RETRIES`` times, rather than
    handing a loader an empty buffer, or a dataset none of the episodes it needs."""
    if not buffer.read_only:
        buffer.flush()
        return
    from ..concat import ConcatReplayBuffer

    members = buffer.buffers if isinstance(buffer, ConcatReplayBuffer) else [buffer]
    for _ in range(RETRIES + 1):
        buffer.refresh()
        if not any(_left_out_all_it_needs(member, min_episode_len) for member in members):
            return


def _left_out_all_it_needs(member: BufferView, min_episode_len: int) -> bool:
    """Whether ``member`` lists no episode of ``min_episode_len`` steps and fewer episodes than
    its counters count: its last refresh may have left out, as a writer was changing them, the
    episodes a snapshot needs."""
    lens = np.asarray(member.episode_lens)
    return not (lens >= min_episode_len).any() and len(member) < member.num_episodes


def empty_buffer_error(buffer: BufferView) -> ValueError:
    """The error for a buffer with no episode to sample, saying why when it counts some; a
    reader whose last refresh found a writer changing every slot raises ConcurrentWriteError
    (retryable, ``check_settled``) instead: it is not empty."""
    check_settled(buffer)
    if not buffer.num_episodes:
        in_progress = getattr(buffer, "timestep_index", 0)  # a writer's steps not yet ended
        return ValueError(
            f"replay buffer is empty: {buffer!r} holds no committed episode; "
            + (
                f"its {in_progress} steps stored are an episode in progress: end it with advance_episode() "
                "(or store steps inside `with buffer.one_episode():`) before sampling"
                if in_progress
                else "store episodes first (store_episode, or store() steps and advance_episode()), or open "
                "the folder that holds them"
            )
        )
    return ValueError(
        f"replay buffer is empty: of its {buffer.num_episodes} committed episodes none has a step "
        + (
            f"(each empty, or rewritten by a writer during each of {RETRIES + 1} loads; retry)"
            if buffer.read_only
            else "(each empty)"
        )
    )


def take_snapshot(buffer: BufferView, min_episode_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(lens, generations) of every slot, committed and mutually consistent
    (``refresh_for_snapshot`` first)."""
    with mirror_lock(buffer):  # a commit or refresh of another thread through this object waits
        refresh_for_snapshot(buffer, min_episode_len)
        lens = np.array(buffer.episode_lens, dtype=np.int64)
        generations = np.array(buffer.generations, dtype=np.int64)
    lens[generations <= 0] = 0
    return lens, generations


def episode_filter(
    buffer: BufferView, lens: np.ndarray, filter_meta: dict | Sequence[dict | None] | None, min_episode_len: int
) -> np.ndarray:
    """Slots (ascending, as the seed) with at least ``min_episode_len`` steps matching ``filter_meta``
    (a list: one filter per source of a ConcatReplayBuffer, ``ConcatReplayBuffer.filter_episodes``)."""
    if isinstance(filter_meta, (list, tuple)):
        from ..concat import ConcatReplayBuffer

        if not isinstance(buffer, ConcatReplayBuffer):
            raise TypeError("filter_meta as a list (one dict per source) needs a ConcatReplayBuffer")
        return buffer.filter_episodes(filter_meta, lens, min_episode_len)
    if len(buffer) == 0 or not (lens > 0).any():
        raise empty_buffer_error(buffer)
    keep = lens >= min_episode_len
    if not keep.any():
        raise ValueError(f"no episode has at least {min_episode_len} timesteps (longest: {int(lens.max())})")
    if filter_meta is not None:
        if not isinstance(filter_meta, dict):
            raise TypeError(f"filter_meta must be a dict of meta field -> value, got {type(filter_meta).__name__}")
        check_names(filter_meta, buffer.meta_fieldnames, "filter_meta")
        for name, value in filter_meta.items():
            data = lens if name == "episode_lens" else np.asarray(buffer.meta_data[name][:])
            if isinstance(value, bool):
                data = data.astype(bool)
            if torch.is_tensor(value):
                value = value.cpu().numpy()
            check_filter_value("filter_meta", name, value, data.shape[1:])
            match = np.asarray(data == value)
            keep &= match.reshape(len(keep), -1).all(axis=1)
        if not keep.any():
            raise ValueError(
                f"filter_meta {filter_meta!r} matches no episode with at least {min_episode_len} "
                f"timesteps (of {int((lens > 0).sum())} stored)"
            )
    return np.flatnonzero(keep)


class _SnapshotDataset(Dataset):
    """What all replaybuf datasets share: the snapshot, names, meta per sample, batched reads."""

    time_keys: frozenset[str] = frozenset()
    draws_at_random = False  # whether ``_read`` draws at random (takes ``uniforms``)

    def __init__(
        self,
        replay_buffer: BufferView | str | os.PathLike,
        fields: Sequence[str] | None = None,
        fieldname_map: dict[str, str] | None = None,
        include_metadata: bool = True,
        filter_meta: dict | None = None,
        return_indices: bool = False,
        cache: str | None = None,
        min_episode_len: int = 1,
    ):
        if (
            isinstance(min_episode_len, bool)
            or not isinstance(min_episode_len, (int, np.integer))
            or min_episode_len < 1
        ):
            raise ValueError(f"min_episode_len must be an int >= 1, got {min_episode_len!r}")
        buffer = as_buffer(replay_buffer)
        self.replay_buffer = buffer
        names = check_names(fields, buffer.fieldnames, "fields")
        # None: every field; an empty list: none (meta fields only), as the seed's datasets
        self.fields = tuple(buffer.schema.fields) if names is None else names
        if fieldname_map is not None and not isinstance(fieldname_map, dict):
            raise TypeError(f"fieldname_map must be a dict of name -> new name, got {type(fieldname_map).__name__}")
        odd = {k: v for k, v in (fieldname_map or {}).items() if not isinstance(v, str) or not v}
        if odd:
            raise TypeError(f"fieldname_map: new names must be non-empty strings, got {odd!r}")
        self.fieldname_map = dict(fieldname_map or {})
        self.meta_names = tuple(buffer.schema.meta_fields) if include_metadata else ()
        self.return_indices = bool(return_indices)
        self._lens, self._generations = take_snapshot(buffer, min_episode_len)
        self._slots = episode_filter(buffer, self._lens, filter_meta, min_episode_len)
        self.indices = torch.from_numpy(self._slots.copy())
        self._cache_mode = cache

    def _make_fetcher(self, fields: Iterable[str]) -> None:
        """The reader of ``fields``, made once the dataset's outputs are set (checked first)."""
        self._check_output_names()
        self.fetcher = Fetcher(self.replay_buffer, fields, self._slots, self._lens, self._generations, self._cache_mode)

    @property
    def meta_data(self) -> dict[str, Any]:
        """The buffer's views of the meta fields this dataset returns, by stored name, as the
        seed's datasets hold them (none with ``include_metadata=False``)."""
        return {name: self.replay_buffer.meta_data[name] for name in self.meta_names}

    def out_name(self, name: str) -> str:
        return self.fieldname_map.get(name, name)

    def _check_output_names(self) -> None:
        """A ValueError when ``fieldname_map`` gives two outputs one name: one of them would be
        dropped from every batch without a word."""
        mapping, self.fieldname_map = self.fieldname_map, {}
        try:
            names = list(dict.fromkeys(self.output_keys()))  # a field asked twice is one output
        finally:
            self.fieldname_map = mapping
        source: dict[str, str] = {}
        for name in names:
            out = self.out_name(name)
            if out in source:
                raise ValueError(
                    f"fieldname_map: {source[out]!r} and {name!r} would both be returned as {out!r} - "
                    "map them to distinct names"
                )
            source[out] = name

    def __len__(self) -> int:
        return len(self._slots)

    # ---- per-sample and per-batch access ------------------------------------------------------

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = sample_index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)}")
        return self.__getitems__([index % len(self)])[0]

    def __getitems__(self, indices: Sequence[int]) -> CollatedSamples:
        """The whole batch ``indices``, read with one grouped read per field, consistently
        (``consistency.read_consistent``): samples whose slot a writer reused are redrawn as
        the batch's sampler could have drawn them (``_redraw``; left out of a prioritized
        batch), and dropped after the bounded retries."""
        listed = indices if isinstance(indices, list) else list(indices)
        if listed:  # a float or flag batch (a custom sampler's) would be truncated or read as positions
            sample_index(listed[0])
        # a batch sampler's list: ~2x as fast as through a list copy
        positions = self._in_range(np.fromiter(listed, np.int64, len(listed)))
        weights = getattr(indices, "weights", None)
        shard = getattr(indices, "shard", None)  # a DDP rank's share (``ShardIndices``)
        slots = self._slots_of(positions)
        dead = self._generations[slots] <= 0  # slots earlier batches saw reused
        if dead.any():
            positions = self._redraw(positions, dead, weights is not None, shard)
            slots = self._slots_of(positions)
        last: dict[str, Any] = {}
        # a reader's re-check of the batch (``read_consistent``) asks its buffer's storage
        # whether the buffer was replaced; a storage of its own (the read cache) is asked here
        rechecked = self.replay_buffer.storage if self.replay_buffer.read_only else None

        # a seeded loader's batch keys its random draws (window starts): the same in any worker and on resume
        keyed = getattr(indices, "uniforms", None) if self.draws_at_random else None

        def read(items: np.ndarray) -> None:
            # ``last`` holds the last read that succeeded: a read that raises (a slot being
            # rewritten) is retried or dropped, and must not leave its items without columns
            columns, lens = self._read(positions[items], None if keyed is None else keyed(positions, items))
            if rechecked is not self.fetcher.storage and self.fetcher.storage.replaced(cheap_only=True):
                # the planned buffer is gone: one created again counts the same generations
                raise BufferReplacedError(self.fetcher.storage.location)
            last.update(items=items, columns=columns, lens=lens)

        def redraw(items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            storage = self.replay_buffer.storage
            if storage.replaced():  # not a writer reusing slots: the snapshot's buffer is gone
                raise BufferReplacedError(storage.location)
            stale = np.zeros(len(positions), dtype=bool)
            stale[items] = True
            positions[:] = self._redraw(positions, stale, weights is not None, shard)
            slots = self._slots_of(positions[items])
            return slots, self._generations[slots]

        kept = read_consistent(
            self.replay_buffer,
            slots,
            self._generations[slots],
            read,
            redraw,
            whole=True,
            exhausted="drop",
            verified=self.fetcher.verified(gathers_only=self.reads_by_gather),
        )
        if "items" not in last:
            read(np.zeros(0, np.int64))
        items, columns, lens = last["items"], last["columns"], last["lens"]
        keep = kept[items]
        if len(positions) and not keep.any() and not self._drawable(self._slots).any():
            raise self.overwritten_error()
        if not kept.all():  # samples dropped (items holds the kept ones when the last read left some out)
            self._check_members()
        if not keep.all():
            columns = {k: v[keep] for k, v in columns.items()}
            lens = None if lens is None else lens[keep]
        if weights is not None:  # a prioritized batch: its weights, and the generation each
            # sample was read at, so that ``update_priorities`` skips a slot reused since
            columns["_weights"] = np.asarray(weights, dtype=np.float32)[items][keep]
            columns["_generations"] = self._generations[self._slots_of(positions[items])[keep]]
        batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in columns.items()}
        return CollatedSamples(batch, lens, self.time_keys)

    def overwritten_error(self) -> SnapshotOverwrittenError:
        """The error of a batch finding every episode of this dataset's snapshot overwritten or
        dropped (a prioritized sampler's pass finding so raises it too)."""
        return SnapshotOverwrittenError(
            f"every one of the {len(self._slots)} episodes this loader's snapshot of "
            f"{self.replay_buffer.storage.location!r} holds was overwritten or dropped by a writer since the "
            "loader was made: none is left to sample; make a new loader (it sees the episodes "
            "committed then)"
        )

    def _check_members(self) -> None:
        """SnapshotOverwrittenError naming the members of a weighted mixture (weight > 0) left
        with no episode of the snapshot: their samples would be dropped from every batch, and the
        batches would shrink and hold the other members' alone, not the shares asked for."""
        mixture = self._mixture()
        if mixture is None:
            return
        weights = mixture[0]
        live = np.bincount(self._sources(self._slots[self.in_snapshot(self._slots)]), minlength=len(weights)) > 0
        gone = np.flatnonzero((weights > 0) & ~live)
        if len(gone):
            raise SnapshotOverwrittenError(
                f"members {gone.tolist()} of this loader's weighted mixture (shares "
                f"{[round(float(w), 6) for w in weights[gone]]}) have none of their episodes of the loader's snapshot left: a writer "
                "overwrote or dropped every one since the loader was made, and the batches can no longer hold "
                "the shares asked for; make a new loader (it sees the episodes committed then)"
            )

    def _in_range(self, positions: np.ndarray) -> np.ndarray:
        """``positions`` with negative ones counted from the end, as ``__getitem__`` takes them,
        or an IndexError naming those outside the dataset: a custom sampler's position past the
        end must not read a timestep past an episode's end (padding) or another episode's step."""
        if not len(positions):
            return positions
        size = len(self)
        low, high = int(positions.min()), int(positions.max())
        if low < -size or high >= size:
            bad = positions[(positions < -size) | (positions >= size)]
            raise IndexError(f"indices {bad[:8].tolist()} out of range for a dataset of {size} samples")
        return positions % size if low < 0 else positions

    def _check_meta_rows(self, slots: np.ndarray) -> None:
        """Meta columns come from the buffer's mirror, which a later ``refresh()`` may have
        moved past the snapshot: GenerationMismatchError names the slots it no longer agrees on
        (a storage that verifies generations checks the data, not these rows)."""
        if not self.meta_names or not len(slots):
            return
        mirror = np.asarray(self.replay_buffer.generations)[slots]
        moved = slots[mirror != self._generations[slots]]
        if len(moved):
            raise GenerationMismatchError(self.replay_buffer.storage.location, moved)

    def _redraw(
        self, positions: np.ndarray, stale: np.ndarray, weighted: bool = False, shard: Shard | None = None
    ) -> np.ndarray:
        """Forget slots reused by a writer and draw other samples for the stale ones, each among
        the live samples the batch's sampler could have drawn in its place: the same member's
        in a weighted mixture (a member of weight 0 is never drawn, and the members keep their
        shares), the DDP rank's share of the epoch (``shard``: ranks do not overlap while the
        share holds a live sample), any otherwise; none in a prioritized batch (``weighted``): a sample drawn in its place
        would carry the stale one's importance weight, and could have priority 0. A stale
        sample left without a replacement keeps its position: it is dropped."""
        slots = self._slots_of(positions)
        self._generations[np.unique(slots[stale])] = -1
        if weighted:
            return positions
        every = self._slots_of(np.arange(len(self)))
        alive = self._generations[every] >= 0
        if shard is not None:
            share = shard.positions()
            shared = alive & np.isin(np.arange(len(self)), share[share < len(self)])
        sources = self._sources(every)
        positions, rng = positions.copy(), None
        for source in np.unique(sources[positions[stale]]):
            drawable = alive & (sources == source)
            if shard is not None and (shared & drawable).any():
                drawable &= shared
            pool = np.flatnonzero(drawable)
            picked = np.flatnonzero(stale & (sources[positions] == source))
            if len(pool):
                rng = rng or self.rng()
                positions[picked] = pool[rng.integers(0, len(pool), len(picked))]
        return positions

    def _drawable(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, whether a batch may still hold its samples: it holds its snapshot episode
        (``in_snapshot``) and, in a weighted mixture, belongs to a member of weight > 0."""
        live = self.in_snapshot(slots)
        mixture = self._mixture()
        return live if mixture is None else live & (mixture[0][self._sources(slots)] > 0)

    def _sources(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, the member of a weighted mixture holding it (its loader draws each sample's
        member first, ``sampling.mixture``); 0 for every slot of any other buffer."""
        mixture = self._mixture()
        if mixture is None:
            return np.zeros(len(slots), np.int64)
        return np.searchsorted(mixture[1], slots, side="right") - 1

    def _mixture(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(member weights, member offsets) of a weighted mixture (``ConcatReplayBuffer(weights=...)``),
        else None."""
        from ..concat import ConcatReplayBuffer

        buffer = self.replay_buffer
        if not isinstance(buffer, ConcatReplayBuffer) or buffer.weights is None:
            return None
        return buffer.weights, buffer.storage.offsets

    def in_snapshot(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, whether it still holds its episode of the snapshot as far as this dataset's
        reads found (a slot found reused since is never drawn again)."""
        return self._generations[slots] > 0

    def rng(self) -> np.random.Generator:
        """A generator seeded from torch's: DataLoader workers differ, and ``torch.manual_seed``
        makes random windows (those of a loader without ``seed``) and redraws reproducible."""
        return np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))

    def _meta_columns(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """The meta columns of ``slots``, from the buffer's mirror (``_check_meta_rows``)."""
        self._check_meta_rows(slots)
        return {self.out_name(n): np.asarray(self.replay_buffer.meta_data[n][slots]) for n in self.meta_names}

    # ---- to implement ------------------------------------------------------------------------

    @property
    def reads_by_gather(self) -> bool:
        """Whether ``_read`` reads through ``Fetcher.gather`` alone (``Fetcher.verified``)."""
        return False

    def _slots_of(self, positions: np.ndarray) -> np.ndarray:
        return self._slots[positions]

    def _read(
        self, positions: np.ndarray, uniforms: np.ndarray | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """Columns of the batch (name -> stacked array) and, for padded batches, sample lengths;
        ``uniforms`` (one float in [0, 1) per sample, from a seeded loader's batch) make the
        random draws of a dataset that makes any (window starts) instead of ``rng()``."""
        raise NotImplementedError

    def output_keys(self) -> list[str]:
        """The keys of every batch (for checking ``to_named_tuple`` before iterating)."""
        raise NotImplementedError


class ReplayDatasetTrajectory(_SnapshotDataset):
    """Whole episodes, sliced to their length; batches are zero-padded to the longest, with
    ``_lens`` (and ``_index``, the slot, with ``return_indices``)."""

    def __init__(
        self,
        replay_buffer: BufferView | str | os.PathLike,
        fields: Sequence[str] | None = None,
        fieldname_map: dict[str, str] | None = None,
        include_metadata: bool = True,
        filter_meta: dict | None = None,
        filter_fields: dict | None = None,
        return_indices: bool = False,
        slice_by_episode_len: bool = True,
        return_episode_lens: bool = True,
        cache: str | None = None,
        min_episode_len: int = 1,
    ):
        if filter_fields is not None:
            raise ValueError("filter_fields is only supported for timestep-level and n-step datasets")
        check_flag("slice_by_episode_len", slice_by_episode_len)  # output_keys multiplies lists by them
        check_flag("return_episode_lens", return_episode_lens)
        if not slice_by_episode_len and not return_episode_lens:
            raise ValueError("cannot turn off return_episode_lens if slice_by_episode_len is also turned off")
        super().__init__(
            replay_buffer, fields, fieldname_map, include_metadata, filter_meta, return_indices, cache, min_episode_len
        )
        self.slice_by_episode_len = bool(slice_by_episode_len)
        self.return_episode_lens = bool(return_episode_lens)
        self.time_keys = frozenset(self.out_name(f) for f in self.fields) if slice_by_episode_len else frozenset()
        self._make_fetcher(self.fields)

    def _read(self, positions, uniforms=None):
        slots = self._slots[positions]
        lens = self._lens[slots]
        width = (int(lens.max()) if len(lens) else 0) if self.slice_by_episode_len else self.replay_buffer.max_timesteps
        starts = np.zeros(len(slots), np.int64)
        columns = {self.out_name(f): self.fetcher.windows(f, slots, starts, lens, width) for f in self.fields}
        if not self.slice_by_episode_len:  # whole rows, as the seed reads them: the default past the end
            for f in self.fields:
                fill_beyond(columns[self.out_name(f)], lens, self.replay_buffer.schema.fields[f].fill)
        columns.update(self._meta_columns(slots))
        if self.return_episode_lens:
            columns["_lens"] = lens
        if self.return_indices:
            columns["_index"] = slots
        return columns, (lens if self.slice_by_episode_len else None)

    def output_keys(self):
        keys = [self.out_name(f) for f in (*self.fields, *self.meta_names)]
        return keys + ["_lens"] * self.return_episode_lens + ["_index"] * self.return_indices


ReplayDataset = ReplayDatasetTrajectory


class ReplayDatasetTimeWindow(_SnapshotDataset):
    """One random window of ``window_length`` steps per episode (shorter episodes give their
    whole length), zero-padded, with ``_lens`` and ``_reaches_episode_end`` (and ``_index``,
    ``_start`` with ``return_indices``). Starts come from ``rng()``, or from the batch's keyed
    draws under a seeded loader (``ShardIndices``, ``MixtureIndices``), so those repeat."""

    draws_at_random = True

    def __init__(
        self,
        replay_buffer: BufferView | str | os.PathLike,
        window_length: int,
        fields: Sequence[str] | None = None,
        fieldname_map: dict[str, str] | None = None,
        include_metadata: bool = True,
        filter_meta: dict | None = None,
        return_indices: bool = False,
        cache: str | None = None,
        min_episode_len: int = 1,
    ):
        if isinstance(window_length, bool) or not isinstance(window_length, (int, np.integer)) or window_length < 1:
            raise ValueError(f"window_length must be an int >= 1, got {window_length!r}")
        super().__init__(
            replay_buffer, fields, fieldname_map, include_metadata, filter_meta, return_indices, cache, min_episode_len
        )
        self.window_length = int(window_length)
        self._make_fetcher(self.fields)

    def _read(self, positions, uniforms=None):
        slots = self._slots[positions]
        lens = self._lens[slots]
        actual = np.minimum(self.window_length, lens)
        if uniforms is None:
            starts = self.rng().integers(0, lens - actual + 1)
        else:
            starts = (uniforms * (lens - actual + 1)).astype(np.int64)
        columns = {
            self.out_name(f): self.fetcher.windows(f, slots, starts, actual, self.window_length) for f in self.fields
        }
        columns.update(self._meta_columns(slots))
        columns["_lens"] = actual
        columns["_reaches_episode_end"] = starts + actual >= lens
        if self.return_indices:
            columns["_index"] = slots
            columns["_start"] = starts
        return columns, None

    def output_keys(self):
        keys = [self.out_name(f) for f in (*self.fields, *self.meta_names)] + ["_lens", "_reaches_episode_end"]
        return keys + ["_index", "_start"] * self.return_indices


class TimepointIndex:
    """The (episode, timestep) pairs of a timepoint dataset, episode-major as the seed orders
    them, without an array per pair: each episode's first position (memory per episode, not
    per step: 100,000 episodes of 20 steps take 1.6 MB where two int64 arrays of pairs took
    32 MB) and, when ``filter_fields`` kept only some pairs, the positions kept (int32 where
    they fit). A batch maps its positions with one ``searchsorted`` over the episodes."""

    def __init__(self, slots: np.ndarray, counts: np.ndarray):
        nonempty = counts > 0
        self.slots = np.asarray(slots, dtype=np.int64)[nonempty]
        counts = np.asarray(counts, dtype=np.int64)[nonempty]
        self.first = np.cumsum(counts) - counts
        self.total = int(counts.sum())
        self.kept: np.ndarray | None = None
        # the last positions asked (bytes) and their pairs: a batch asks twice (``_slots_of``, ``_read``)
        self._last: tuple[bytes, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.total if self.kept is None else len(self.kept)

    def pairs(self, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(episodes, timesteps) at ``positions`` (None: every pair), as int64 arrays."""
        if positions is None:
            positions = np.arange(len(self), dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        key = positions.tobytes()
        last = self._last
        if last is not None and last[0] == key:  # a batch asks for its slots, then reads its pairs
            return last[1].copy(), last[2].copy()
        if self.kept is not None:
            positions = self.kept[positions].astype(np.int64)
        rows = self.first.searchsorted(positions, side="right") - 1
        episodes, timesteps = self.slots[rows], positions - self.first[rows]
        self._last = (key, episodes.copy(), timesteps.copy())
        return episodes, timesteps

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the pairs where ``mask`` (one flag per pair now) is True."""
        self._last = None
        kept = np.flatnonzero(mask)
        if self.kept is not None:
            kept = self.kept[kept]
        self.kept = kept.astype(np.int32 if self.total <= np.iinfo(np.int32).max else np.int64)


def draws_timepoints(dataset: Any) -> bool:
    """Whether ``dataset`` samples (episode, timestep) pairs: it has ``timepoints``, as the
    seed's timestep and n-step datasets do (asked without building them)."""
    return hasattr(type(dataset), "timepoints") or "timepoints" in getattr(dataset, "__dict__", {})


class _TimepointDataset(_SnapshotDataset):
    """Datasets indexed by (episode, timestep) pairs, in episode-major order as the seed."""

    horizon = 1

    def _set_timepoints(self, filter_fields: dict | None) -> None:
        counts = np.maximum(self._lens[self._slots] - self.horizon + 1, 0)
        self._index = TimepointIndex(self._slots, counts)
        if filter_fields is not None:
            self._index.keep(self._filter_fields_mask(filter_fields, *self._index.pairs()))
            if len(self._index) == 0:
                reused = int((self._generations[self._slots] < 0).sum())
                raise ValueError(
                    f"filter_fields {filter_fields!r} matches no timestep"
                    + (
                        f" of the episodes left ({reused} of the snapshot's were overwritten by a writer while "
                        "filtered: make the loader again)"
                        if reused
                        else ""
                    )
                )

    @property
    def timepoints(self) -> torch.Tensor:
        """Every (episode, timestep) pair, (N, 2) int64, as the seed's ``timepoints``; built on
        each access (the dataset keeps ``TimepointIndex``, not the pairs)."""
        return torch.from_numpy(np.stack(self._index.pairs(), axis=1))

    def pairs(self, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(episodes, timesteps) of the samples at ``positions`` (None: all)."""
        return self._index.pairs(positions)

    def _filter_fields_mask(self, filter_fields: dict, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        if not isinstance(filter_fields, dict):
            raise TypeError(f"filter_fields must be a dict of field -> value, got {type(filter_fields).__name__}")
        check_names(filter_fields, self.replay_buffer.fieldnames, "filter_fields")
        keep = np.ones(len(episodes), dtype=bool)
        for name, value in filter_fields.items():
            shape = self.replay_buffer.schema.fields[name].shape
            if shape not in ((), (1,)):
                raise ValueError(f"filter_fields only supports scalar fields, got shape {shape} for {name!r}")
            if torch.is_tensor(value):
                value = value.cpu().numpy()
            check_filter_value("filter_fields", name, value, shape)
            data = self.gather_live(name, episodes, timesteps).reshape(len(episodes))
            if isinstance(value, bool):
                data = data.astype(bool)
            keep &= np.asarray(data == value)
        return keep & (self._generations[episodes] > 0)

    def gather_live(self, name: str, episodes: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        """``fetcher.gather`` of the pairs, each read while its slot held the snapshot's episode
        (``consistency.read_consistent``), zeros for the pairs of slots no longer in it: a slot
        found reused since the snapshot leaves it (never drawn), as a batch would drop it."""
        field = self.replay_buffer.schema.fields[name]
        out = np.zeros((len(episodes), *field.shape), field.dtype)
        slots, inverse = np.unique(episodes, return_inverse=True)
        inverse = inverse.reshape(-1)

        def read(items: np.ndarray) -> None:
            pick = slice(None) if len(items) == len(slots) else np.isin(inverse, items)
            out[pick] = self.fetcher.gather(name, episodes[pick], timesteps[pick])

        generations = self._generations[slots]
        kept = read_consistent(
            self.replay_buffer, slots.copy(), generations, read, verified=self.fetcher.verified(gathers_only=True)
        )
        self._generations[slots[~kept & (self._generations[slots] > 0)]] = -1
        out[~kept[inverse]] = 0
        return out

    def __len__(self) -> int:
        return len(self._index)

    def _slots_of(self, positions):
        return self._index.pairs(positions)[0]

    def _indices_column(self, episodes: np.ndarray, timesteps: np.ndarray) -> dict[str, np.ndarray]:
        return {"_indices": np.stack([episodes, timesteps], axis=1)} if self.return_indices else {}


class ReplayDatasetTimestep(_TimepointDataset):
    """Every valid (episode, timestep) of the buffer, one sample each (``_indices`` = [episode,
    timestep] with ``return_indices``)."""

    def __init__(
        self,
        replay_buffer: BufferView | str | os.PathLike,
        fields: Sequence[str] | None = None,
        fieldname_map: dict[str, str] | None = None,
        return_indices: bool = False,
        include_metadata: bool = True,
        filter_meta: dict | None = None,
        filter_fields: dict | None = None,
        cache: str | None = None,
        min_episode_len: int = 1,
    ):
        super().__init__(
            replay_buffer, fields, fieldname_map, include_metadata, filter_meta, return_indices, cache, min_episode_len
        )
        self._make_fetcher(self.fields)
        self._set_timepoints(filter_fields)

    reads_by_gather = True

    def _read(self, positions, uniforms=None):
        episodes, timesteps = self._index.pairs(positions)
        columns = {self.out_name(f): self.fetcher.gather(f, episodes, timesteps) for f in self.fields}
        columns.update(self._meta_columns(episodes))
        columns.update(self._indices_column(episodes, timesteps))
        return columns, None

    def output_keys(self):
        return [self.out_name(f) for f in (*self.fields, *self.meta_names)] + ["_indices"] * self.return_indices


class ReplayDatasetNStep(_TimepointDataset):
    """n-step transitions from every (episode, t) with t + 1 < len: ``current_fields`` at t,
    ``next_<field>`` at t + min(n, len - t - 1), ``seq_<field>`` the steps t .. t + actual n
    zero-padded to n, and ``n_step_lens``. Episodes shorter than 2 steps are left out."""

    horizon = 2

    def __init__(
        self,
        replay_buffer: BufferView | str | os.PathLike,
        n_steps: int,
        current_fields: Sequence[str] | None = None,
        next_fields: Sequence[str] | None = None,
        sequence_fields: Sequence[str] | None = None,
        fieldname_map: dict[str, str] | None = None,
        return_indices: bool = False,
        include_metadata: bool = True,
        filter_meta: dict | None = None,
        filter_fields: dict | None = None,
        cache: str | None = None,
        fields: Sequence[str] | None = None,
    ):
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
            raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
        buffer = as_buffer(replay_buffer)
        allowed = buffer.fieldnames
        current = check_names(current_fields, allowed, "current_fields")
        following = check_names(next_fields, allowed, "next_fields")
        sequence = check_names(sequence_fields, allowed, "sequence_fields")
        super().__init__(
            buffer, fields, fieldname_map, include_metadata, filter_meta, return_indices, cache, min_episode_len=2
        )
        every = tuple(buffer.schema.fields)
        self.n_steps = int(n_steps)
        self.current_fields = every if current is None else current
        self.next_fields = every if following is None else following
        self.sequence_fields = () if sequence is None else sequence
        self._make_fetcher((*self.current_fields, *self.next_fields, *self.sequence_fields))
        self._set_timepoints(filter_fields)

    @property
    def reads_by_gather(self) -> bool:
        return not self.sequence_fields or self.fetcher.gathers_windows(self.n_steps)

    def _read(self, positions, uniforms=None):
        episodes, timesteps = self._index.pairs(positions)
        actual = np.minimum(self.n_steps, self._lens[episodes] - timesteps - 1)
        later = timesteps + actual
        now, following = {}, {}
        for f in (f for f in self.current_fields if f in self.next_fields):
            pair = self.fetcher.gather(f, np.concatenate([episodes, episodes]), np.concatenate([timesteps, later]))
            now[f], following[f] = pair[: len(episodes)], pair[len(episodes) :]
        # every current field, then every next_ one, as the seed: where a field is itself named
        # next_<other> (fields obs and next_obs), the next_ output of <other> is the one returned,
        # whatever the order the fields were declared in
        columns = {
            self.out_name(f): now[f] if f in now else self.fetcher.gather(f, episodes, timesteps)
            for f in self.current_fields
        }
        for f in self.next_fields:
            data = following[f] if f in following else self.fetcher.gather(f, episodes, later)
            columns[self.out_name(f"next_{f}")] = data
        for f in self.sequence_fields:
            columns[self.out_name(f"seq_{f}")] = self.fetcher.windows(f, episodes, timesteps, actual, self.n_steps)
        columns[self.out_name("n_step_lens")] = actual
        columns.update(self._meta_columns(episodes))
        columns.update(self._indices_column(episodes, timesteps))
        return columns, None

    def output_keys(self):
        keys = [self.out_name(f) for f in self.current_fields]
        keys += [self.out_name(f"next_{f}") for f in self.next_fields]
        keys += [self.out_name(f"seq_{f}") for f in self.sequence_fields]
        keys += [self.out_name("n_step_lens")] + [self.out_name(n) for n in self.meta_names]
        return keys + ["_indices"] * self.return_indices
