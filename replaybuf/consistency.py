"""Reading episodes while a writer in another process commits new ones, possibly into the
same slots (circular mode).

The writer's commit order (``buffer.py``) makes a slot's ``_generation`` the guard: it is set
to 0 before a slot's data is touched and published, with a new, larger value, only after the
data and meta rows are written; a value never returns. So if a slot's generation reads ``g > 0``
before and after a read, the slot held episode ``g`` during the whole read, and what was read
(data, meta rows, length) belongs to it. A reader therefore

1. reads the generation (or takes the one its batch plan was made with),
2. reads lengths, meta rows and data,
3. reads the generation again and keeps only slots where it did not change.

The writer rewrites a reused slot's data objects in place, so step 2 may also fail to decode
a slot being rewritten; ``read_unchanged`` drops such slots and reads the others again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .buffer import ReplayBuffer


def stored_meta(buffer: ReplayBuffer, name: str, slots: np.ndarray) -> np.ndarray:
    """``meta/name[slots]`` read from storage now (not from the buffer's RAM mirror)."""
    slots = np.asarray(slots, dtype=np.int64)
    if len(slots) == 0:
        return np.asarray(buffer.storage.array(name, meta=True)[np.zeros(0, np.int64)])
    unique, inverse = np.unique(slots, return_inverse=True)
    return np.asarray(buffer.storage.array(name, meta=True)[unique])[inverse]


def unchanged_slots(buffer: ReplayBuffer, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
    """After reading ``slots`` planned at ``generations``: True where each slot still holds
    that episode. Call it after the read; drop or resample the slots where it is False."""
    generations = np.asarray(generations)
    return (stored_meta(buffer, "_generation", slots) == generations) & (generations > 0)


def read_unchanged(
    buffer: ReplayBuffer,
    slots: np.ndarray,
    generations: np.ndarray,
    read: Callable[[np.ndarray], dict[str, np.ndarray]],
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Run ``read(positions)`` for the positions of ``slots`` planned at ``generations`` and keep
    what was read from slots that still hold those episodes afterwards.

    ``read`` gets indices into ``slots`` and returns arrays whose first axis follows them (a
    sampler passes its (slot, timestep) pairs). A writer rewrites a reused slot's objects in
    place, so a read that overlaps a rewrite may also fail to decode: the error is dropped with
    the slots that changed, and the others are read again; an error with no slot changed is
    raised. Returns (positions kept, their values).
    """
    slots, generations = np.asarray(slots, dtype=np.int64), np.asarray(generations, dtype=np.int64)
    positions = np.flatnonzero(generations > 0)
    while len(positions):
        try:
            values = read(positions)
        except Exception:
            still = unchanged_slots(buffer, slots[positions], generations[positions])
            if still.all():
                raise
            positions = positions[still]
            continue
        still = unchanged_slots(buffer, slots[positions], generations[positions])
        return positions[still], {name: value[still] for name, value in values.items()}
    return positions, read(positions)


@dataclass
class ConsistentEpisodes:
    """Episodes that stayed committed and unchanged while they were read."""

    slots: np.ndarray
    generations: np.ndarray
    lens: np.ndarray
    data: dict[str, np.ndarray]
    meta: dict[str, np.ndarray]
    dropped: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)


def read_episodes_consistent(
    buffer: ReplayBuffer,
    slots: Sequence[int] | np.ndarray,
    fields: Sequence[str] | None = None,
    generations: Sequence[int] | np.ndarray | None = None,
) -> ConsistentEpisodes:
    """Read whole episodes from ``slots`` of a buffer another process may be writing.

    Returns the slots that held one committed episode throughout the read, with their data
    (``(n, T, *shape)``, zero past each length, ``T`` the longest kept length), meta fields and
    lengths as stored; ``dropped`` lists the slots left out (empty, being rewritten, or no longer
    holding ``generations`` when a batch plan passes them).
    """
    slots = np.asarray(slots, dtype=np.int64)
    if slots.ndim != 1:
        raise ValueError(f"slots must be a 1-d sequence of episode indices, got shape {slots.shape}")
    bad = slots[(slots < 0) | (slots >= buffer.max_episodes)]
    if len(bad):
        raise ValueError(f"slots {bad.tolist()} out of range - must be in [0, {buffer.max_episodes})")
    fields = list(buffer.schema.fields) if fields is None else list(fields)
    unknown = sorted(set(fields) - set(buffer.schema.fields))
    if unknown:
        raise ValueError(
            f"read_episodes_consistent: invalid field names {unknown} - must be among {sorted(buffer.schema.fields)}"
        )
    before = stored_meta(buffer, "_generation", slots)
    if generations is not None:
        generations = np.asarray(generations, dtype=np.int64)
        if generations.shape != slots.shape:
            raise ValueError(f"generations has shape {generations.shape}, slots {slots.shape}: pass one per slot")
        before = np.where(before == generations, before, 0)
    lens = stored_meta(buffer, "episode_lens", slots)
    before = np.where(lens > 0, before, 0)
    meta = {n: stored_meta(buffer, n, slots) for n in buffer.schema.meta_fields}
    longest = int(lens[before > 0].max()) if (before > 0).any() else 0

    def read(positions: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for name in fields:
            rows = buffer.storage.read_rows(name, slots[positions], 0, longest)
            rows[np.arange(longest)[None, :] >= lens[positions][:, None]] = 0
            out[name] = rows
        return out

    kept, data = read_unchanged(buffer, slots, before, read)
    cut = int(lens[kept].max()) if len(kept) else 0
    return ConsistentEpisodes(
        slots=slots[kept],
        generations=before[kept],
        lens=lens[kept],
        data={n: v[:, :cut] for n, v in data.items()},
        meta={n: v[kept] for n, v in meta.items()},
        dropped=np.setdiff1d(slots, slots[kept]),
    )
