"""Bulk reads of whole episodes (or time spans of them) straight into a caller's array.

``get_all_data``, ``stats`` and trajectory batches read many whole episodes at once. Rather
than a generic per-element read followed by copies, they hand the final array to
``Storage.read_spans``: the zarr backend reads each episode's shard or chunk once and decodes
frames into place; the default goes through ``read_rows``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def read_spans_by_rows(
    storage: Any, name: str, episodes: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray
) -> None:
    """``Storage.read_spans`` through ``storage.read_rows``: one call per run of episodes sharing a span."""
    episodes, starts, lengths = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (episodes, starts, lengths))
    bounds = np.flatnonzero((np.diff(starts) != 0) | (np.diff(lengths) != 0)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(episodes)]):
        start, length = int(starts[lo]), int(lengths[lo])
        if length > 0:
            out[lo:hi, :length] = storage.read_rows(name, episodes[lo:hi], start, start + length)


def fill_beyond(out: np.ndarray, lengths: np.ndarray, fill: Any) -> None:
    """Set ``out[i, lengths[i]:]`` to ``fill`` (the padding after each episode); only the
    short rows are visited (a batch of full windows costs one comparison)."""
    lengths = np.asarray(lengths)
    for i in np.flatnonzero(lengths < out.shape[1]).tolist():
        out[i, int(lengths[i]) :] = fill
