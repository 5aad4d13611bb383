"""Rate-limited sampling: a loader that does not hand out samples faster than a writer commits.

Reverb's ``SampleToInsertRatio(samples_per_insert=R, min_size_to_sample=N, error_buffer=E)``
on the sampling side: a batch of ``n`` samples is handed out only once ``inserted >= N`` and
``sampled + n <= R * (inserted - N) + E``, so a learner that outpaces its actors waits for
them instead of overfitting a stale buffer. ``inserted`` counts committed steps (timesteps),
read from the store's committed bookkeeping (``refresh()``: episode lengths and generations),
so the writer can be another process or another machine writing to an object store. A sample
is one item of a batch (a trajectory, a timestep or an n-step transition).

The counting happens where batches are delivered, in the process iterating the loader: with
DataLoader workers the ratio holds for the loader as a whole; under DDP each rank's loader
counts its own samples against all inserts (per rank: pass ``R / world_size`` for a global R).
The writer is not throttled (it may live elsewhere), so only the upper side of Reverb's band
is enforced here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from ..view import BufferView
from .datasets import take_snapshot
from .distributed import ResumableDistributedSampler
from .mixture import MixtureBatchSampler
from .prioritized import PrioritizedBatchSampler

_FIRST_WAIT, _LONGEST_WAIT = 0.01, 0.5  # seconds between refreshes while blocked (doubling)


class RateLimitTimeout(TimeoutError):
    """The loader waited ``rate_timeout`` seconds for the writer without being allowed to sample."""


def _check_number(
    name: str, value: Any, minimum: float, integer: bool = False, above: bool = False
) -> float | np.number:
    """``value`` if it is a number (an int with ``integer``) >= ``minimum`` (> with ``above``)."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (value > minimum if above else value >= minimum):
        expected = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {expected} {'>' if above else '>='} {minimum}, got {value!r}")
    return value


class RateLimiter:
    """Counts committed steps of ``buffer`` and samples handed out, and blocks ``acquire`` while
    handing out more would exceed ``samples_per_insert * (inserted - min_size) + error_buffer``.

    Inserts are counted from slot generations: a slot whose generation changed since the last
    look holds a newly committed episode, whose length is added. An episode committed and
    overwritten (circular buffer) between two looks is not seen, which can only undercount
    (block longer), never let the loader oversample. The store is reread only when the counts
    already seen would block, so a limiter that never blocks costs no I/O per batch.
    """

    def __init__(
        self,
        buffer: BufferView,
        samples_per_insert: float,
        min_size: int = 1,
        error_buffer: float = 0.0,
        timeout: float | None = 60.0,
    ):
        self.samples_per_insert = float(_check_number("samples_per_insert", samples_per_insert, 0.0, above=True))
        self.min_size = int(_check_number("min_size", min_size, 1, integer=True))
        members = getattr(buffer, "buffers", [buffer])  # a ConcatReplayBuffer's, or the buffer
        if not any(m.circular for m in members):  # committed steps never exceed the capacity
            capacity = sum(m.max_episodes * m.max_timesteps for m in members)
            if self.min_size > capacity:
                raise ValueError(
                    f"min_size={min_size}: more steps than {buffer!r} can hold ({capacity}: max_episodes x "
                    "max_timesteps, not circular); the loader would wait for them forever"
                )
        self.error_buffer = float(_check_number("error_buffer", error_buffer, 0.0))
        if timeout is not None:
            _check_number("rate_timeout", timeout, 0.0)
        self.timeout = timeout
        self.buffer = buffer
        self.inserted = 0
        self.sampled = 0
        self._generations = np.zeros(0, np.int64)
        # per member, the newest generation a resumed count covers: the next look counts only
        # episodes committed after it (``load_state_dict``)
        self._resumed_newest: np.ndarray | None = None

    def _members_of(self, slots: int) -> np.ndarray:
        """Per slot of the buffer's ``generations``, the member holding it (0 unless a
        ConcatReplayBuffer, whose members count their generations each on their own)."""
        offsets = getattr(self.buffer.storage, "offsets", None)
        if offsets is None:
            return np.zeros(slots, np.int64)
        return np.searchsorted(offsets, np.arange(slots), side="right") - 1

    def _newest(self) -> list[int]:
        """Per member, the newest generation counted so far (0: none)."""
        members = getattr(self.buffer, "buffers", [self.buffer])
        newest = np.zeros(len(members), np.int64)
        if self._resumed_newest is not None:
            newest = self._resumed_newest.copy()
        if len(self._generations):
            np.maximum.at(newest, self._members_of(len(self._generations)), self._generations)
        return newest.tolist()

    def state_dict(self) -> dict[str, Any]:
        """The samples handed out and the steps inserted so far, with the newest generation
        counted (per member), to resume the count in a fresh loader: the buffer then holds fewer
        steps than were inserted once a circular writer has reused slots."""
        return {"sampled": self.sampled, "inserted": self.inserted, "newest": self._newest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the counts of ``state``: episodes committed after its newest generation are
        counted as inserted at the next look (a state with ``sampled`` alone, from an earlier
        replaybuf, counts the steps the buffer holds, as a fresh limiter does)."""
        if not isinstance(state, dict) or "sampled" not in state:
            raise ValueError(f"state['rate_limiter'] must be a dict with 'sampled' (from state_dict()), got {state!r}")
        sampled = int(_check_number("state['rate_limiter']['sampled']", state["sampled"], 0, integer=True))
        inserted, newest = 0, None
        if "inserted" in state or "newest" in state:
            inserted = int(_check_number("state['rate_limiter']['inserted']", state.get("inserted"), 0, integer=True))
            members = len(getattr(self.buffer, "buffers", [self.buffer]))
            given = state.get("newest")
            if (
                not isinstance(given, (list, tuple))
                or len(given) != members
                or not all(isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g >= 0 for g in given)
            ):
                raise ValueError(
                    f"state['rate_limiter']['newest'] must be {members} int(s) >= 0 (one per buffer, from "
                    f"state_dict()), got {given!r}"
                )
            newest = np.asarray(given, np.int64)
        self.sampled, self.inserted, self._resumed_newest = sampled, inserted, newest
        self._generations = np.zeros(0, np.int64)

    def update(self) -> int:
        """Reread the committed bookkeeping and add the steps of newly committed episodes."""
        lens, generations = take_snapshot(self.buffer)
        if len(self._generations) != len(generations):
            self._generations = np.zeros(len(generations), np.int64)
            if self._resumed_newest is not None:  # what the resumed count covers is not new
                self._generations = np.where(
                    generations <= self._resumed_newest[self._members_of(len(generations))], generations, 0
                )
        new = (generations != self._generations) & (generations > 0)
        self.inserted += int(lens[new].sum())
        self._generations = generations
        return self.inserted

    def allows(self, n: int) -> bool:
        """Whether ``n`` more samples may be handed out with the inserts counted so far."""
        if self.inserted < self.min_size:
            return False
        if self.samples_per_insert == float("inf"):  # min_size only (inf * 0 would be nan)
            return True
        return self.sampled + n <= self.samples_per_insert * (self.inserted - self.min_size) + self.error_buffer

    def wait(self, n: int) -> None:
        """Block until ``n`` samples may be handed out (``n = 0``: until ``min_size`` steps are
        committed), rereading the store with a growing pause; raise ``RateLimitTimeout`` after
        ``timeout`` seconds."""
        if self.allows(n):
            return
        start, pause = time.monotonic(), _FIRST_WAIT
        while True:
            self.update()
            if self.allows(n):
                return
            waited = time.monotonic() - start
            if self.timeout is not None and waited >= self.timeout:
                raise RateLimitTimeout(self._timeout_message(n, waited))
            time.sleep(pause if self.timeout is None else min(pause, max(0.0, self.timeout - waited)))
            pause = min(2 * pause, _LONGEST_WAIT)

    def acquire(self, n: int) -> None:
        """Wait for, then count, ``n`` samples handed out."""
        self.wait(n)
        self.sampled += n

    def _timeout_message(self, n: int, waited: float) -> str:
        if self.inserted < self.min_size:
            waiting = f"for min_size={self.min_size} committed steps before the first sample"
        else:
            allowed = self.samples_per_insert * (self.inserted - self.min_size) + self.error_buffer
            waiting = f"to hand out {n} more samples (allowed: {allowed:g} until more steps are committed)"
        return (
            f"rate limiter on {self.buffer!r}: waited {waited:.1f} s {waiting}; samples_per_insert="
            f"{self.samples_per_insert:g}, min_size={self.min_size}, error_buffer={self.error_buffer:g}, "
            f"{self.sampled} sampled, {self.inserted} steps inserted. Is the writer running?"
        )


def batch_length(batch: Any) -> int:
    """Number of samples in a collated batch (dict, named tuple or tuple of tensors)."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    while isinstance(first, dict):
        first = next(iter(first.values()))
    return len(first)


def _set_epoch(loader: Any, epoch: int) -> None:
    """Tell ``loader`` (or its sampler, or its batch sampler) which pass it serves, where it
    takes one (``set_epoch``: the seeded samplers)."""
    for target in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        set_epoch = getattr(target, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
            return


def _next_pass(loader: Any, default: int) -> int:
    """The pass ``loader``'s seeded sampler draws when iterated again, as a plain loader does: a
    mixture's or a prioritized sampler's next pass begins with each iteration (a loop that
    breaks out of one moves on), a shuffled one's epoch with a whole pass (as torch's
    DistributedSampler); ``default`` for any other loader."""
    for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if isinstance(sampler, (MixtureBatchSampler, PrioritizedBatchSampler)):
            return sampler.next_pass
        if isinstance(sampler, ResumableDistributedSampler):
            return sampler.epoch
    return default


class PassLoader(Protocol):
    """What ``RateLimitedLoader`` iterates each pass: a DataLoader (or a loader wrapping one)."""

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


class RateLimitedLoader:
    """Iterates DataLoaders made by ``build`` (one per pass, each over the episodes committed when
    the pass starts), handing out a batch only when ``limiter`` allows its samples.

    The pass starts once ``min_size`` steps are committed. ``state_dict()`` holds the sample
    count (and the inner loader's state where it has one) to resume a run with its ratio. A
    batch that timed out waiting is handed out first by the next iteration, which goes on with
    its pass.
    """

    def __init__(self, build: Callable[[], PassLoader], limiter: RateLimiter):
        self.build = build
        self.limiter = limiter
        self.loader: PassLoader | None = None
        self._inner_state: dict | None = None
        self.passes = 0  # the pass (epoch) the next iteration's loader draws
        # a pass interrupted while a batch waited (RateLimitTimeout): (its batches, the batch read
        # but not handed out, the pass loader's state before it); the next iteration continues it
        self._interrupted: tuple[Iterator[Any], Any, dict | None] | None = None

    def _start_pass(self) -> Iterator[Any]:
        """The batches of a new pass, once ``min_size`` steps are committed."""
        self.limiter.wait(0)
        loader = self.loader = self.build()
        _set_epoch(loader, self.passes)  # a seeded order differs from pass to pass, as one loader's does
        if self._inner_state is not None:
            if not hasattr(loader, "load_state_dict"):
                raise AttributeError(
                    f"state['loader'] was given but this loader ({type(loader).__name__}) has no load_state_dict"
                )
            loader.load_state_dict(self._inner_state)
            self._inner_state = None
        return iter(loader)

    def __iter__(self) -> Iterator[Any]:
        # A batch is read before the limiter knows its size: one whose wait times out (or is
        # interrupted) is kept and handed out first when the loop iterates again (it had restarted
        # the pass, repeating a seeded pass's batches); state_dict() counts it as not received
        # (a resumed run skipped it)
        if self._interrupted is None:
            batches, pending, before = self._start_pass(), None, None
        else:
            (batches, pending, before), self._interrupted = self._interrupted, None
        stateful = hasattr(self.loader, "state_dict")
        ended = False
        try:
            while True:
                if pending is None:
                    before = self.loader.state_dict() if stateful else None  # type: ignore[union-attr]
                    try:
                        pending = next(batches)
                    except StopIteration:
                        break
                try:
                    self.limiter.acquire(batch_length(pending))
                except BaseException:  # RateLimitTimeout, or a KeyboardInterrupt while waiting
                    self._interrupted = (batches, pending, before)
                    raise
                batch, pending = pending, None
                yield batch
            ended = True
        finally:
            # the pass ended, or the loop left it (break): the next iteration draws the pass a
            # plain loader would (it drew a mixture's or prioritized pass again after a break)
            if self._interrupted is None:
                self.passes = _next_pass(self.loader, self.passes + ended)

    def __len__(self) -> int:
        """Batches of the current (or last) pass; the next pass may have more."""
        if self.loader is None:
            raise TypeError("a rate-limited loader has no length before its first pass (the buffer may be growing)")
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rate_limiter": self.limiter.state_dict(), "passes": self.passes}
        if self._interrupted is not None and self._interrupted[2] is not None:
            state["loader"] = self._interrupted[2]  # the batch that timed out was not received
        elif self.loader is not None and hasattr(self.loader, "state_dict"):
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "rate_limiter" not in state:
            raise ValueError(
                f"state must be a rate-limited loader's state_dict() (a dict with 'rate_limiter'), got {state!r}"
            )
        passes = state.get("passes", 0)  # a state saved before passes were counted: 0
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 0:
            raise ValueError(f"state['passes'] must be an int >= 0, got {passes!r}")
        self.limiter.load_state_dict(state["rate_limiter"])
        self.passes, self._inner_state, self._interrupted = passes, state.get("loader"), None

    def __getattr__(self, name: str) -> Any:
        # batch_size, dataset, sampler, ... of the current pass's loader
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)
