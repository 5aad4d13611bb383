"""Sharding samples across DDP ranks, reproducibly, and resuming an epoch where it stopped.

``ResumableDistributedSampler`` splits a dataset's indices across ``world_size`` ranks the way
``torch.utils.data.DistributedSampler`` does (a shared, seeded permutation per epoch, padded
by repeating indices unless ``drop_last``), so ranks never overlap within an epoch and together
cover every index. It also records how far the current epoch went, so ``state_dict()`` /
``load_state_dict()`` continue an interrupted run exactly.

A DataLoader asks its sampler for indices ahead of the training loop (prefetching), so the
sampler alone overcounts what the loop received; ``ResumableDataLoader`` counts delivered
batches and reports that position instead. Its batches carry their rank's share of the epoch
(``ShardIndices``), so that a sample redrawn in place of one whose slot a writer reused is
drawn within that share and the ranks still never overlap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Sampler

_SETTINGS = ("seed", "shuffle", "drop_last", "world_size")


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, or a ValueError naming ``name`` unless it is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the given values, else torch.distributed's when it is initialized,
    else ``(0, 1)``; a ``world_size`` above 1 needs a ``rank`` then."""
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is not None:
        world_size = check_int("world_size", world_size, 1)
    if rank is None and not initialized and world_size is not None and world_size > 1:
        # every process would be rank 0 and read the same samples (torch's DistributedSampler
        # refuses this too)
        raise ValueError(
            f"world_size={world_size!r} given without rank, and torch.distributed is not initialized: "
            "pass each process its own rank (e.g. int(os.environ['RANK']))"
        )
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


@dataclass(frozen=True)
class Shard:
    """One rank's share of one epoch of a ``ResumableDistributedSampler``: what it needs to list
    the share again (a few ints, not the indices, which a batch would carry to every worker)."""

    length: int
    epoch: int
    seed: int
    shuffle: bool
    drop_last: bool
    rank: int
    world_size: int

    def positions(self) -> np.ndarray:
        """The share's indices, in order."""
        if self.length == 0:
            return np.zeros(0, dtype=np.int64)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.length) if self.shuffle else None
        order = np.arange(self.length) if order is None else order
        share = self.length // self.world_size if self.drop_last else -(-self.length // self.world_size)
        total = share * self.world_size
        if total > self.length:
            order = np.resize(order, total)
        return order[self.rank : total : self.world_size]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64 arrays (arrays wrap silently where scalars warn)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_uniforms(key: tuple[int, ...], counters: np.ndarray) -> np.ndarray:
    """Floats in [0, 1), one per counter, each a function of ``key`` (non-negative ints: a seed,
    an epoch, ...) and its counter alone: a batch's random draws (window starts) come out the
    same in any process, with any number of DataLoader workers, and after a resume."""
    state = np.zeros(1, np.uint64)
    for word in key:
        while True:  # 64 bits at a time: a seed may be any int >= 0, as numpy's generators take
            state = _splitmix64(state ^ np.uint64(word & 0xFFFFFFFFFFFFFFFF))
            word >>= 64
            if not word:
                break
    mixed = _splitmix64(state ^ np.asarray(counters, dtype=np.int64).astype(np.uint64))
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53


class ShardIndices(list):
    """A batch of dataset positions with the ``Shard`` they were drawn from (what
    ``__getitems__`` gets from a ``ResumableDataLoader``)."""

    def __init__(self, positions: list[int], shard: Shard):
        super().__init__(positions)
        self.shard = shard

    def __reduce__(self):
        return ShardIndices, (list(self), self.shard)

    def uniforms(self, positions: np.ndarray, items: np.ndarray) -> np.ndarray:
        """The batch's random draws for ``positions[items]``, keyed by seed, epoch and each
        sample's position (unique within a rank's share of an epoch, and across ranks)."""
        return keyed_uniforms((self.shard.seed, self.shard.epoch), positions[items])


class ResumableDistributedSampler(Sampler[int]):
    """This rank's share of ``range(len(data_source))`` for each epoch.

    Parameters
    ----------
    data_source
        The dataset (anything with ``len``) or its length. The length is read at the start of
        each epoch, so a dataset over a buffer that is still being written grows between epochs.
    rank, world_size
        Default to torch.distributed's when it is initialized, else 0 and 1.
    shuffle
        A fresh permutation per epoch, identical on every rank (seeded by ``seed`` and the epoch).
    seed
        Must be the same on every rank. ``None``: 0 with several ranks; with one, drawn from
        torch's global generator, so ``torch.manual_seed`` makes runs reproducible as with
        ``DataLoader(shuffle=True)``. The seed is part of ``state_dict()``.
    drop_last
        Drop the tail so every rank gets ``len // world_size`` indices; otherwise pad by
        repeating indices so every rank gets ``ceil(len / world_size)``.

    A full pass over the sampler moves it to the next epoch; ``set_epoch`` sets the epoch
    explicitly (as with torch's DistributedSampler). ``state_dict()`` records the epoch and how
    many of this rank's indices were handed out; every rank can load the same state, since
    ranks advance in lockstep.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
    ):
        if not isinstance(data_source, (int, np.integer)) and not hasattr(data_source, "__len__"):
            raise TypeError(
                f"data_source must be a dataset with len() or an int length, got {type(data_source).__name__}"
            )
        if isinstance(data_source, (int, np.integer)):
            check_int("data_source length", data_source, 0)
        self.data_source = data_source
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.shuffle = bool(shuffle)
        if seed is None:
            seed = 0 if self.world_size > 1 else int(torch.randint(0, 2**62, ()).item())
        self.seed = check_int("seed", seed, 0)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.current: Shard | None = None  # the share of the pass being iterated
        self._next: tuple[int, int] | None = None  # (position, length) the next pass of self.epoch starts at
        self._pass: dict[str, int] | None = None  # the pass being iterated

    def _current_length(self) -> int:
        return int(self.data_source) if isinstance(self.data_source, (int, np.integer)) else len(self.data_source)

    def num_samples(self, length: int) -> int:
        """Indices each rank gets in an epoch over ``length`` items."""
        if self.drop_last:
            return length // self.world_size
        return -(-length // self.world_size)

    def __len__(self) -> int:
        length = self._next[1] if self._next is not None else self._current_length()
        return self.num_samples(length)

    def shard(self, epoch: int, length: int) -> Shard:
        """This rank's share of ``epoch`` over ``length`` items."""
        return Shard(length, epoch, self.seed, self.shuffle, self.drop_last, self.rank, self.world_size)

    def epoch_indices(self, epoch: int, length: int) -> np.ndarray:
        """This rank's indices of ``epoch`` over ``length`` items, in order."""
        return self.shard(epoch, length).positions()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next pass (keeps a loaded position when the
        epoch is the one already set)."""
        epoch = check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self._next = None
            self._pass = None

    def plan_pass(self) -> tuple[int, int, int]:
        """Fix the next pass now and return its ``(epoch, start position, length)``."""
        if self._next is None:
            self._next = (0, self._current_length())
        return (self.epoch, *self._next)

    def __iter__(self) -> Iterator[int]:
        epoch, start, length = self.plan_pass()
        self._next = None
        self.current = self.shard(epoch, length)
        order = self.current.positions()
        self._pass = {"epoch": epoch, "position": start, "length": length}
        return self._iterate(order, self._pass)

    def _iterate(self, order: np.ndarray, state: dict[str, int]) -> Iterator[int]:
        for position in range(state["position"], len(order)):
            state["position"] = position + 1
            yield int(order[position])
        if self._pass is state:
            self._pass = None
            self.epoch = state["epoch"] + 1

    def state_dict(self) -> dict[str, Any]:
        """Where sampling stands: epoch, indices of it handed out, and the epoch's frozen length."""
        if self._pass is not None:
            epoch, position, length = self._pass["epoch"], self._pass["position"], self._pass["length"]
        elif self._next is not None:
            epoch, (position, length) = self.epoch, self._next
        else:
            epoch, position, length = self.epoch, 0, None
        return {
            "epoch": epoch,
            "position": position,
            "epoch_length": length,
            **{k: getattr(self, k) for k in _SETTINGS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass yields the rest of the recorded epoch."""
        if not isinstance(state, dict):  # set(None) would fail with "'NoneType' object is not iterable"
            raise TypeError(f"state must be a sampler's state_dict() (a dict), got {state!r}")
        missing = sorted({"epoch", "position", "epoch_length", *_SETTINGS} - set(state))
        if missing:
            raise ValueError(f"sampler state is missing keys {missing}")
        differing = [
            f"{k}: saved {state[k]!r} vs this sampler's {getattr(self, k)!r}"
            for k in _SETTINGS
            if state[k] != getattr(self, k)
        ]
        if differing:
            raise ValueError(
                "cannot resume exactly with different sampler settings:\n  "
                + "\n  ".join(differing)
                + "\nCreate the sampler with the saved settings."
            )
        epoch = check_int("epoch", state["epoch"], 0)
        position = check_int("position", state["position"], 0)
        length = (
            self._current_length()
            if state["epoch_length"] is None
            else check_int("epoch_length", state["epoch_length"], 0)
        )
        if length > self._current_length():
            raise ValueError(
                f"the saved epoch covered {length} items but the dataset now has "
                f"{self._current_length()}; cannot resume that epoch exactly"
            )
        if position > self.num_samples(length):
            raise ValueError(f"position {position} is past the epoch's {self.num_samples(length)} samples")
        self.epoch = epoch
        self._pass = None
        self._next = (position, length)


class ShardBatchSampler(BatchSampler):
    """torch's ``BatchSampler`` over a ``ResumableDistributedSampler``, each batch a
    ``ShardIndices`` naming the share it was drawn from."""

    sampler: ResumableDistributedSampler

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            assert self.sampler.current is not None  # set by the sampler's __iter__
            yield ShardIndices(batch, self.sampler.current)


class ResumableDataLoader(DataLoader):
    """A DataLoader over a ``ResumableDistributedSampler`` whose ``state_dict()`` records the
    batches the training loop actually received (not those prefetched), so that
    ``load_state_dict()`` on a fresh loader continues with the next undelivered batch. Its
    batches name their rank's share (``ShardIndices``): a dataset redraws a sample whose slot a
    writer reused within that share."""

    sampler: ResumableDistributedSampler

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        *,
        sampler: ResumableDistributedSampler,
        **kwargs: Any,
    ):
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(f"sampler must be a ResumableDistributedSampler, got {type(sampler).__name__}")
        super().__init__(dataset, batch_size, shuffle, sampler=sampler, **kwargs)
        if self.batch_size is None:
            raise ValueError("ResumableDataLoader needs a batch_size to count delivered samples")
        # torch makes a plain BatchSampler and forbids setting it after __init__ (its batch_size
        # and drop_last stay the loader's, as with any batch_size loader)
        object.__setattr__(self, "batch_sampler", ShardBatchSampler(sampler, self.batch_size, self.drop_last))
        self._delivering: dict[str, int] | None = None

    # a generator, to count the batches delivered; the base's _BaseDataLoaderIter is torch-internal
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch, start, length = self.sampler.plan_pass()
        progress = {"epoch": epoch, "start": start, "length": length, "batches": 0}
        self._delivering = progress
        for batch in super().__iter__():
            progress["batches"] += 1
            yield batch
        if self._delivering is progress:
            self._delivering = None

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the last batch delivered to the caller."""
        progress = self._delivering
        if progress is None or progress["batches"] == 0:
            return self.sampler.state_dict()
        total = self.sampler.num_samples(progress["length"])
        assert self.batch_size is not None  # checked in __init__
        position = min(progress["start"] + progress["batches"] * self.batch_size, total)
        settings = {k: getattr(self.sampler, k) for k in _SETTINGS}
        if position == total:
            return {"epoch": progress["epoch"] + 1, "position": 0, "epoch_length": None, **settings}
        return {"epoch": progress["epoch"], "position": position, "epoch_length": progress["length"], **settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved by ``state_dict()``."""
        self._delivering = None
        self.sampler.load_state_dict(state)
