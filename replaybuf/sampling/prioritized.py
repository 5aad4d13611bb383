"""Prioritized sampling over a stored per-timestep priority field.

``PrioritizedBatchSampler`` draws batches of timesteps (or n-step starts) with probability
proportional to ``priority ** alpha`` by inverse-CDF sampling (numpy cumulative sums and
``searchsorted``: O(N) to rebuild after updates, O(B log N) per batch) and attaches importance
weights ``(N * P(i)) ** -beta / max_j (N * P(j)) ** -beta``. ``update_priorities`` writes new
priorities into the buffer and into every live sampler over it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from numbers import Real
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ..buffer import as_writer
from ..view import BufferView
from .datasets import draws_timepoints
from .distributed import check_int

_samplers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class WeightedIndices(list):
    """A batch of dataset positions with their importance weights (what ``__getitems__`` gets)."""

    def __init__(self, positions: list[int], weights: np.ndarray):
        super().__init__(positions)
        self.weights = weights

    def __reduce__(self):
        return WeightedIndices, (list(self), self.weights)


def check_priority_field(buffer: BufferView, priority_field: str) -> None:
    if priority_field not in buffer.fieldnames:
        raise ValueError(
            f"priority_field {priority_field!r} is not a field of the buffer - must be one of "
            f"{sorted(buffer.fieldnames)} (add e.g. fields={{'{priority_field}': 'float'}})"
        )
    shape = buffer.schema.fields[priority_field].shape
    if shape not in ((), (1,)):
        raise ValueError(f"priority_field {priority_field!r} must hold one value per timestep, has shape {shape}")


class PrioritizedBatchSampler(Sampler):
    """Batches of positions of a timestep or n-step dataset, drawn by priority.

    Parameters
    ----------
    dataset
        A ``ReplayDatasetTimestep`` or ``ReplayDatasetNStep``.
    batch_size
        Samples per batch.
    priority_field
        A scalar per-timestep field holding priorities (>= 0).
    alpha, beta
        Priority exponent and importance-weight exponent.
    num_batches
        Batches per iteration (default: as many as one pass over the dataset).
    seed, rank
        Pass ``p``'s draws come from a generator seeded by ``(seed, rank, p)``: reproducible from ``seed``
        (default: drawn from torch's generator, so ``torch.manual_seed`` fixes it) and different
        on each DDP rank, even when every rank seeds torch the same; its ``PassDataLoader``
        resumes a pass at a batch (``state_dict()``).
    """

    kind = "prioritized"

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        priority_field: str = "priority",
        alpha: float = 0.6,
        beta: float = 0.4,
        num_batches: int | None = None,
        seed: int | None = None,
        rank: int = 0,
    ):
        if not draws_timepoints(dataset):
            raise ValueError("sampler='prioritized' draws timesteps: use timestep_level=True or n_steps")
        check_priority_field(dataset.replay_buffer, priority_field)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        for name, value in (("alpha", alpha), ("beta", beta)):
            # NaN or inf would make every weight NaN, or every draw the same sample
            if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a number >= 0, and finite, got {value!r}")
        if num_batches is not None and (
            isinstance(num_batches, bool) or not isinstance(num_batches, (int, np.integer)) or num_batches < 1
        ):
            raise ValueError(f"num_batches must be an int >= 1 (None: one dataset's worth), got {num_batches!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.priority_field = priority_field
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.num_batches = max(1, len(dataset) // batch_size) if num_batches is None else int(num_batches)
        max_t = dataset.replay_buffer.max_timesteps
        episodes, timesteps = dataset.pairs()
        self._keys = episodes * max_t + timesteps
        # priority ** alpha of every sample, each priority divided by ``_top`` first (the largest
        # seen so far, 1 at least) so that neither the power nor the sum of any finite
        # priorities overflows to inf, which would make every weight NaN
        self._scaled: np.ndarray | None = None
        self._top = 1.0
        self._cumulative: np.ndarray | None = None
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.seed, self.rank = check_int("seed", seed, 0), check_int("rank", rank, 0)
        # the next pass, and its first batch (a resumed loader's): pass ``p``'s draws come from a
        # generator seeded (seed, rank, p), each batch taking ``batch_size`` of its numbers
        self.next_pass = 0
        self.start = 0
        _samplers.setdefault(dataset.replay_buffer, weakref.WeakSet()).add(self)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass pass ``epoch``, from its first batch (a loader made anew for each
        pass, as a rate-limited one is, would otherwise draw pass 0 each time)."""
        self.next_pass, self.start = check_int("epoch", epoch, 0), 0

    def __len__(self) -> int:
        return self.num_batches

    def load(self) -> None:
        """Read the priorities of every sample from the buffer, as of the dataset's snapshot
        (``gather_live``): the samples of a slot a writer reused since get priority 0."""
        raw = self.dataset.gather_live(self.priority_field, *self.dataset.pairs()).reshape(-1).astype(np.float64)
        # NaN would stop every later sample being drawn, inf make the weights NaN, and a negative
        # one (a signed TD error stored as it is) would be drawn as 0: never, without a word
        bad = np.flatnonzero(~np.isfinite(raw) | (raw < 0))
        if len(bad):
            episodes, timesteps = self.dataset.pairs(bad[:8])
            raise ValueError(
                f"priority_field {self.priority_field!r} holds {len(bad)} NaN, infinite or negative value(s), at "
                f"(episode, timestep) {list(zip(episodes.tolist(), timesteps.tolist()))}: priorities must be "
                "finite and >= 0 (set them with update_priorities)"
            )
        self._set(np.arange(len(self._keys)), raw)

    def _set(self, positions: np.ndarray, priorities: np.ndarray) -> None:
        priorities = np.maximum(priorities, 0.0)
        if self._scaled is None:
            self._scaled = np.zeros(len(self._keys), dtype=np.float64)
        top = float(priorities.max()) if len(priorities) else 0.0
        if top > self._top:  # scale the others down to the new largest (the probabilities stay)
            self._scaled *= (self._top / top) ** self.alpha
            self._top = top
        self._scaled[positions] = np.power(priorities / self._top, self.alpha)
        self._cumulative = None

    def update(
        self, episodes: np.ndarray, timesteps: np.ndarray, priorities: np.ndarray, generations: np.ndarray | None = None
    ) -> None:
        """New priorities for (episode, timestep) pairs; pairs outside this sampler, or (given
        their ``generations``) of another episode than this sampler's slot holds, are ignored."""
        if self._scaled is None:
            return
        keys = episodes * self.dataset.replay_buffer.max_timesteps + timesteps
        positions = np.searchsorted(self._keys, keys)
        found = (positions < len(self._keys)) & (self._keys[np.minimum(positions, len(self._keys) - 1)] == keys)
        if generations is not None:
            found &= self.dataset._generations[episodes] == generations
        self._set(positions[found], priorities[found])

    def probabilities(self) -> np.ndarray:
        """P(i) of every sample under the current priorities."""
        if self._scaled is None:
            self.load()
        scaled = self._scaled
        assert scaled is not None  # set by load()
        return scaled / scaled.sum()

    def __iter__(self) -> Iterator[WeightedIndices]:
        pass_index, start = self.next_pass, self.start
        self.next_pass, self.start = pass_index + 1, 0
        bits = np.random.PCG64([self.seed, self.rank, pass_index])  # default_rng's
        bits.advance(start * self.batch_size)  # past the numbers of the batches before
        self._generator = np.random.Generator(bits)
        self.load()
        if not self.dataset.in_snapshot(self.dataset.pairs()[0]).any():
            # a writer reused or dropped every slot of the snapshot: SnapshotOverwrittenError, as a
            # uniform loader's batch raises (not "every priority is 0"; it yielded batches of no
            # samples for every pass, forever)
            raise self.dataset.overwritten_error()
        for _ in range(start, self.num_batches):
            yield self._draw()

    def _draw(self) -> WeightedIndices:
        scaled = self._scaled
        assert scaled is not None  # __iter__ loads before drawing
        if self._cumulative is None:
            self._cumulative = np.cumsum(scaled)
            positive = scaled[scaled > 0]
            if len(positive) == 0:
                raise ValueError(f"every priority in {self.priority_field!r} is 0 (or below): nothing can be drawn")
            self._max_weight = (len(scaled) * positive.min() / self._cumulative[-1]) ** -self.beta
        total = self._cumulative[-1]
        draws = self._generator.random(self.batch_size) * total
        positions = np.minimum(np.searchsorted(self._cumulative, draws, side="right"), len(scaled) - 1)
        probability = scaled[positions] / total
        weights = (len(scaled) * probability) ** -self.beta / self._max_weight
        return WeightedIndices(positions.tolist(), weights.astype(np.float32))


def update_priorities(
    buffer: BufferView,
    indices: Any,
    priorities: Any,
    priority_field: str = "priority",
    generations: Any = None,
) -> int:
    """Write ``priorities`` for the (episode, timestep) pairs ``indices`` (a batch's ``_indices``,
    shape (B, 2)) into ``priority_field`` of ``buffer`` and into its live prioritized samplers.

    ``generations`` (a prioritized batch's ``_generations``, shape (B,)) names the episode each
    pair was drawn from: a pair whose slot a circular writer has reused since is skipped, so a
    late update never lands on the newer episode. Without it every pair is written. Returns the
    number of pairs written."""
    check_priority_field(buffer, priority_field)
    pairs = _as_numpy(indices)
    values = _as_numpy(priorities)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
        raise ValueError(
            f"indices must be (episode, timestep) int pairs of shape (B, 2) as in `_indices`, "
            f"got {pairs.dtype} array of shape {pairs.shape}"
        )
    if values.dtype.kind not in "biuf":
        raise ValueError(f"priorities must be numbers, got a {values.dtype} array")
    values = values.astype(np.float64).reshape(-1)
    if len(values) != len(pairs):
        raise ValueError(f"priorities has {len(values)} values for {len(pairs)} indices")
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        raise ValueError(
            f"priorities must be finite and >= 0, got {values[bad][:5].tolist()} for (episode, timestep) "
            f"{pairs[bad][:5].tolist()}{' ...' if bad.sum() > 5 else ''}"
        )
    episodes, timesteps = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    writer = as_writer(buffer, "update_priorities")
    if generations is not None:
        drawn = _as_numpy(generations)
        if drawn.shape != (len(pairs),) or drawn.dtype.kind not in "iu":
            raise ValueError(
                f"generations must be one int per pair, shape ({len(pairs)},) as in `_generations`, "
                f"got {drawn.dtype} array of shape {drawn.shape}"
            )
        inside = (episodes >= 0) & (episodes < writer.max_episodes)  # update_steps names the others
        current = np.zeros(len(pairs), np.int64)
        current[inside] = writer.generations[episodes[inside]]
        live = ~inside | (current == drawn)
        episodes, timesteps, values, drawn = episodes[live], timesteps[live], values[live], drawn[live]
    writer.update_steps(episodes, timesteps, **{priority_field: values})
    for sampler in list(_samplers.get(buffer, ())):
        sampler.update(episodes, timesteps, values, None if generations is None else drawn)
    return len(episodes)


def _as_numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
