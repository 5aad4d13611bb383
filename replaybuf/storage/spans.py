"""Bulk reads of whole episodes (or time spans of them) straight into a caller's array.

``get_all_data``, ``stats`` and trajectory batches read many whole episodes at once. Rather
than a generic per-element read followed by copies, they hand the final array to
``Storage.read_spans``: the zarr backend reads each episode's shard or chunk once and decodes
frames into place; the default goes through ``read_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Spans:
    """Steps ``starts[i] .. starts[i] + lengths[i]`` of episode ``episodes[i]``, as 1-D int64
    arrays: what ``Storage.read_spans`` hands a backend's ``_read_spans``, converted once."""

    episodes: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, episodes: Any, starts: Any, lengths: Any) -> Spans:
        """The spans of ``read_spans``'s arguments (any int sequences of one length)."""
        return cls(*(np.asarray(a, dtype=np.int64).reshape(-1) for a in (episodes, starts, lengths)))

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, rows: Any) -> Spans:
        """The spans of ``rows`` (an index array, a mask or a slice)."""
        return Spans(self.episodes[rows], self.starts[rows], self.lengths[rows])


def read_spans_by_rows(storage: Any, name: str, spans: Spans, out: np.ndarray) -> None:
    """``Storage.read_spans`` through ``storage.read_rows``: one call per run of episodes sharing a span."""
    starts, lengths = spans.starts, spans.lengths
    bounds = np.flatnonzero((np.diff(starts) != 0) | (np.diff(lengths) != 0)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(spans)]):
        start, length = int(starts[lo]), int(lengths[lo])
        if length > 0:
            out[lo:hi, :length] = storage.read_rows(name, spans.episodes[lo:hi], start, start + length)


def fill_beyond(out: np.ndarray, lengths: np.ndarray, fill: Any) -> None:
    """Set ``out[i, lengths[i]:]`` to ``fill`` (the padding after each episode); only the
    short rows are visited (a batch of full windows costs one comparison)."""
    lengths = np.asarray(lengths)
    for i in np.flatnonzero(lengths < out.shape[1]).tolist():
        out[i, int(lengths[i]) :] = fill
