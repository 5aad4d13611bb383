"""diffusion_policy's ReplayBuffer layout (zarr format 2): ``data/<key>`` arrays whose first
axis concatenates every episode's steps, and ``meta/episode_ends`` (exclusive end of each
episode). Each key becomes a field of the same name, dtype and per-step shape; (T, H, W, C)
uint8 keys such as ``img`` are image fields as they are. The zarr root's attributes and the
buffer's attributes (``buffer.attrs``) carry over to each other: an export writes the buffer's
attributes there (fps, task texts, ... of a LeRobot import) and an import reads them back."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._engine import ImportSourceError, Source, exported_episodes, new_folder

__all__ = ["DiffusionPolicySource", "export_diffusion_policy"]


class DiffusionPolicySource(Source):
    format = "diffusion_policy"

    def __init__(self, path: str | os.PathLike):
        import zarr

        super().__init__(path)
        try:
            root = zarr.open_group(self.path, mode="r")
            data, stored_ends = root["data"], root["meta/episode_ends"]
            if not isinstance(data, zarr.Group) or not isinstance(stored_ends, zarr.Array):
                raise ValueError(
                    f"data is a {type(data).__name__} and meta/episode_ends a {type(stored_ends).__name__}"
                )
            self._arrays = {name: array for name, array in data.arrays()}
            groups = sorted(name for name, _group in data.groups())
            self._attrs = dict(root.attrs)
            ends = np.asarray(stored_ends[:])
        except (KeyError, FileNotFoundError, ValueError, TypeError, AttributeError) as error:  # zarr on bad metadata
            raise ImportSourceError(
                f"{self.path}: not a diffusion_policy zarr (expected data/<key> arrays and meta/episode_ends): {error}"
            ) from error
        if groups:  # their arrays were left out without a word
            raise ImportSourceError(
                f"{self.path}: data/{groups[0]} is a group; expected only arrays under data/ (one per key)"
            )
        if not self._arrays:
            raise ImportSourceError(f"{self.path}: data/ holds no arrays")
        scalars = sorted(name for name, array in self._arrays.items() if array.ndim == 0)
        if scalars:
            raise ImportSourceError(f"{self.path}: data/{scalars[0]} is 0-d; expected one row per step")
        if ends.ndim != 1 or (len(ends) and ends.dtype.kind not in "iu"):
            raise ImportSourceError(
                f"{self.path}/meta/episode_ends: expected a 1-d array of integer step counts, "
                f"got {ends.dtype} of shape {ends.shape}"
            )
        ends = ends.astype(np.int64)
        if len(ends) and (np.any(np.diff(ends) < 0) or ends[0] < 0):  # equal ends: an episode of 0 steps
            raise ImportSourceError(f"{self.path}/meta/episode_ends: expected non-decreasing ends >= 0, got {ends}")
        self._starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self._ends = ends
        self._check_rows()
        self._fields = {
            name: {"dtype": str(array.dtype), "shape": tuple(array.shape[1:])} for name, array in self._arrays.items()
        }

    def _check_rows(self) -> None:
        """Refuse ends that the data arrays contradict, before a destination is sized from them:
        rows past the last end (they would be dropped without a word), or an episode longer than
        the arrays hold (a lying end would reserve its size in the destination). Ends past the
        arrays' rows but within them are a truncated source: its episodes there fail when read."""
        rows = {name: int(array.shape[0]) for name, array in self._arrays.items()}
        last = int(self._ends[-1]) if len(self._ends) else 0
        longer = {f"data/{name}": rows[name] for name in sorted(rows) if rows[name] > last}
        if longer:
            raise ImportSourceError(
                f"{self.path}: {longer} have more rows than meta/episode_ends covers ({last}); expected one row "
                "per step of its episodes"
            )
        lengths = self._ends - self._starts
        too_long = np.flatnonzero(lengths > max(rows.values()))
        if len(too_long):
            episode = int(too_long[0])
            raise ImportSourceError(
                f"{self.path}/meta/episode_ends: episode {episode} has {int(lengths[episode])} steps, more than "
                f"the {max(rows.values())} rows of the data arrays"
            )

    def fields(self) -> dict[str, dict[str, Any]]:
        return self._fields

    def attrs(self) -> dict[str, Any]:
        return self._attrs

    def episode_ids(self) -> list[int]:
        return list(range(len(self._ends)))

    def lengths(self) -> list[int]:
        return (self._ends - self._starts).tolist()

    def read(self, position: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        start, end = int(self._starts[position]), int(self._ends[position])
        data = {}
        for name, array in self._arrays.items():
            if end > array.shape[0]:
                raise ValueError(f"data/{name} has {array.shape[0]} steps, the episode ends at step {end} (truncated?)")
            data[name] = np.asarray(array[start:end])
        return data, {}


# bytes a chunk of an exported array holds at most (whole steps, at least one): diffusion_policy's
# own ReplayBuffer aims at 2 MB chunks (get_optimal_chunks). 1024 steps of 320 x 240 frames made
# one 236 MB chunk rewritten whole for every episode written into it: 61 s and 1.9 GB of RAM to
# export 230 MB (4 s and 224 MB with 2 MB chunks).
CHUNK_BYTES = 2 * 2**20


def _chunk_steps(total: int, chunk_steps: int, step_nbytes: int) -> int:
    """Steps per chunk of an exported array: at most ``chunk_steps`` and ``CHUNK_BYTES``."""
    return max(1, min(total, chunk_steps, CHUNK_BYTES // max(1, step_nbytes)))


def export_diffusion_policy(
    src: Any, dst: str | os.PathLike, *, storage_options: dict | None = None, chunk_steps: int = 1024
) -> int:
    """Write the committed episodes of buffer ``src`` (oldest first) as a diffusion_policy zarr
    (format 2) at ``dst``, a new or empty folder, in chunks of at most ``chunk_steps`` steps and
    ``CHUNK_BYTES``; returns the number of episodes. The buffer's
    attributes become the zarr root's; meta fields are not part of that layout and are left out.
    A failed export removes what it wrote."""
    with new_folder(dst, src):
        return _write_diffusion_policy(src, dst, storage_options, chunk_steps)


def _write_diffusion_policy(src: Any, dst: str | os.PathLike, storage_options: dict | None, chunk_steps: int) -> int:
    """The body of ``export_diffusion_policy``; ``meta/episode_ends`` is written last, so an
    export killed half-way is no diffusion_policy zarr (its unwritten chunks would read as zeros)."""
    import zarr

    buffer, lengths, episodes = exported_episodes(src, storage_options)
    with buffer:
        total = int(lengths.sum())
        # "w-": the folder is empty (checked), and mode "w" erased it first, which failed on a link
        # to an empty folder (rmtree of a link) and would erase what appeared there since the check
        root = zarr.open_group(os.fspath(dst), mode="w-", zarr_format=2, attributes=dict(buffer.attrs))
        arrays = {
            name: root.create_array(
                f"data/{name}",
                shape=(total, *field.shape),
                chunks=(_chunk_steps(total, chunk_steps, field.step_nbytes), *field.shape),
                dtype=field.dtype,
            )
            for name, field in buffer.schema.fields.items()
        }
        start = 0
        for (_slot, data, _meta), length in zip(episodes, lengths.tolist()):
            for name, array in arrays.items():
                array[start : start + length] = data[name]
            start += length
        root.create_array("meta/episode_ends", data=np.cumsum(lengths))
    return len(lengths)
