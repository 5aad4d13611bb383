"""Weighted mixtures: batches drawn from the sources of a ``ConcatReplayBuffer`` with chosen
probabilities (``ConcatReplayBuffer([...], weights=[...])``).

Each sample of a batch picks its source with probability ``weights[k] / sum(weights)`` and then
a sample of that source uniformly (an episode for trajectory loaders, a timestep or an n-step
start otherwise), so the mixture is exact in expectation whatever the sources' sizes. Batch
``b`` of pass ``p`` is drawn from its own generator seeded with ``(seed, rank, p, b)``: the batches are
reproducible from the seed (default: drawn from torch's generator, so ``torch.manual_seed``
fixes it), differ between DDP ranks, and a resumed loader continues with the next undelivered batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .distributed import check_int, keyed_uniforms


def check_weights(weights: Any, sources: int) -> np.ndarray | None:
    """``weights`` as float64 probabilities (summing to 1), or a ValueError saying what is wrong."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray, torch.Tensor)):
        raise TypeError(f"weights must be a sequence of {sources} numbers, got {weights!r}")
    try:
        given = weights.detach().cpu().numpy() if isinstance(weights, torch.Tensor) else np.asarray(weights)
    except (TypeError, ValueError):  # ragged nesting
        raise TypeError(f"weights must be a sequence of {sources} numbers, got {weights!r}") from None
    # strings would be parsed as numbers, nested lists flattened
    if given.dtype.kind not in "biuf" or given.ndim != 1:
        raise TypeError(f"weights must be a sequence of {sources} numbers, got {weights!r}")
    values = given.astype(np.float64)
    if len(values) != sources:
        raise ValueError(f"weights has {len(values)} entries for {sources} buffers; give one per buffer")
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"weights must be finite numbers >= 0, got {list(weights)}")
    if values.max() == 0:
        raise ValueError(f"weights are all 0: no buffer could be sampled, got {list(weights)}")
    values = values / values.max()  # weights near the float64 maximum would sum to inf
    return values / values.sum()


class MixtureIndices(list):
    """Batch ``batch`` of pass ``pass_index``'s dataset positions, with what keys its random draws."""

    def __init__(self, positions: list[int], key: tuple[int, ...]):
        super().__init__(positions)
        self.key = key  # (seed, rank, pass, batch)

    def __reduce__(self):
        return MixtureIndices, (list(self), self.key)

    def uniforms(self, positions: np.ndarray, items: np.ndarray) -> np.ndarray:
        """The batch's random draws for ``positions[items]``, keyed by the batch and each sample's
        place in it (a position may be drawn twice in a batch: each gets its own draw)."""
        return keyed_uniforms(self.key, items)


class MixtureBatchSampler(Sampler[list[int]]):
    """Batches of dataset positions drawn source by source with ``probabilities``.

    ``offsets`` are the sources' first global slots (``ConcatStorage.offsets``); ``num_batches``
    per pass defaults to one dataset's worth.
    """

    kind = "mixture"

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        probabilities: np.ndarray,
        offsets: np.ndarray,
        num_batches: int | None = None,
        seed: int | None = None,
        rank: int = 0,
    ):
        slots = dataset._slots_of(np.arange(len(dataset)))
        source = np.searchsorted(offsets, slots, side="right") - 1
        self.positions = [np.flatnonzero(source == k) for k in range(len(probabilities))]
        empty = [k for k, p in enumerate(probabilities) if p > 0 and len(self.positions[k]) == 0]
        if empty:
            raise ValueError(f"weights: buffers {empty} have a weight > 0 but no sample to draw (after filter_meta)")
        # a numpy int too, as the prioritized sampler takes it (it was refused as "not an int >= 1, got 3")
        self.num_batches = (
            max(1, len(dataset) // batch_size) if num_batches is None else check_int("num_batches", num_batches, 1)
        )
        self.batch_size = batch_size
        self.probabilities = probabilities
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else check_int("seed", seed, 0)
        self.rank = rank
        self.next_pass = 0
        self.start = 0

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """Start at pass ``epoch``, batch 0 (a loader made anew for each pass, as a rate-limited
        one is, would otherwise draw pass 0 each time)."""
        self.next_pass, self.start = int(epoch), 0

    def draw(self, pass_index: int, batch: int) -> MixtureIndices:
        """Positions of batch ``batch`` of pass ``pass_index``."""
        key = (self.seed, self.rank, pass_index, batch)
        rng = np.random.default_rng(key)
        sources = rng.choice(len(self.probabilities), size=self.batch_size, p=self.probabilities)
        out = np.empty(self.batch_size, np.int64)
        for k in np.unique(sources):
            picked = np.flatnonzero(sources == k)
            out[picked] = self.positions[k][rng.integers(0, len(self.positions[k]), len(picked))]
        return MixtureIndices(out.tolist(), key)

    def __iter__(self) -> Iterator[list[int]]:
        pass_index, start = self.next_pass, self.start
        self.next_pass, self.start = pass_index + 1, 0
        for batch in range(start, self.num_batches):
            yield self.draw(pass_index, batch)


class SeededPasses(Protocol):
    """A batch sampler drawing ``num_batches`` batches a pass, pass ``next_pass`` from batch
    ``start`` on, each a function of ``seed`` and its place (``MixtureBatchSampler``,
    ``PrioritizedBatchSampler``)."""

    kind: str  # what error messages call its loader: "mixture", "prioritized"
    seed: int
    next_pass: int
    start: int
    num_batches: int

    def set_epoch(self, epoch: int) -> None: ...


class PassDataLoader(DataLoader):
    """A DataLoader over a ``SeededPasses`` batch sampler whose ``state_dict()`` records the
    batches the training loop received (not those prefetched by workers)."""

    def __init__(self, dataset: Any, batch_sampler: SeededPasses, **kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)  # type: ignore[arg-type]
        self._passes = batch_sampler  # ``self.batch_sampler`` typed as what it is
        self._delivered = (batch_sampler.next_pass, batch_sampler.start)

    # a generator over the base iterator, to record each batch as it is handed out
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self._passes
        pass_index, batch = sampler.next_pass, sampler.start
        for item in super().__iter__():
            batch += 1
            self._delivered = (pass_index, batch)
            yield item
        self._delivered = (pass_index + 1, 0)

    def set_epoch(self, epoch: int) -> None:
        """The next pass is pass ``epoch`` (the batch sampler's ``set_epoch``)."""
        self._passes.set_epoch(epoch)
        self._delivered = (self._passes.next_pass, 0)

    def state_dict(self) -> dict[str, int]:
        """Seed, pass and batch to continue from."""
        pass_index, batch = self._delivered
        if batch >= self._passes.num_batches:
            pass_index, batch = pass_index + 1, 0
        return {"seed": self._passes.seed, "pass": pass_index, "batch": batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a state saved by ``state_dict()``: the next pass starts at its batch."""
        if not isinstance(state, dict):  # set(None) would fail with "'NoneType' object is not iterable"
            raise TypeError(f"state must be a {self._passes.kind} loader's state_dict() (a dict), got {state!r}")
        missing = sorted({"seed", "pass", "batch"} - set(state))
        if missing:
            raise ValueError(f"{self._passes.kind} loader state is missing keys {missing}")
        sampler = self._passes
        sampler.seed, sampler.next_pass, sampler.start = (check_int(k, state[k], 0) for k in ("seed", "pass", "batch"))
        self._delivered = (sampler.next_pass, sampler.start)
