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
"""

from __future__ import annotations

from collections.abc import Sequence
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


def read_episodes_consistent(buffer: ReplayBuffer, slots: Sequence[int] | np.ndarray,
                             fields: Sequence[str] | None = None,
                             generations: Sequence[int] | np.ndarray | None = None) -> ConsistentEpisodes:
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
        raise ValueError(f"read_episodes_consistent: invalid field names {unknown} - must be among "
                         f"{sorted(buffer.schema.fields)}")
    before = stored_meta(buffer, "_generation", slots)
    if generations is not None:
        generations = np.asarray(generations, dtype=np.int64)
        if generations.shape != slots.shape:
            raise ValueError(f"generations has shape {generations.shape}, slots {slots.shape}: pass one per slot")
        before = np.where(before == generations, before, 0)
    lens = stored_meta(buffer, "episode_lens", slots)
    candidates = (before > 0) & (lens > 0)
    meta = {n: stored_meta(buffer, n, slots[candidates]) for n in buffer.schema.meta_fields}
    longest = int(lens[candidates].max()) if candidates.any() else 0
    data = {}
    for name in fields:
        rows = buffer.storage.read_rows(name, slots[candidates], 0, longest)
        rows[np.arange(longest)[None, :] >= lens[candidates][:, None]] = 0
        data[name] = rows
    after = stored_meta(buffer, "_generation", slots[candidates])
    keep = after == before[candidates]
    kept = slots[candidates][keep]
    kept_lens = lens[candidates][keep]
    cut = int(kept_lens.max()) if len(kept_lens) else 0
    return ConsistentEpisodes(
        slots=kept, generations=before[candidates][keep], lens=kept_lens,
        data={n: v[keep][:, :cut] for n, v in data.items()}, meta={n: v[keep] for n, v in meta.items()},
        dropped=np.setdiff1d(slots, kept),
    )
