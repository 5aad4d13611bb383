"""Minari datasets, read through the ``minari`` package (``pip install 'replaybuf[minari]'``).

``src`` is a dataset id found under Minari's root (``MINARI_DATASETS_PATH``, e.g.
``D4RL/door/human-v2``) or a dataset's folder (the one holding ``data/``). Minari keeps T + 1
observations per episode of T steps: they become ``observations`` (steps 0 .. T - 1) and
``next_observations`` (1 .. T). ``actions``, ``rewards``, ``terminations`` and ``truncations``
keep their names; dict and tuple spaces are flattened (``observations_<key>``,
``actions_<index>``). ``infos`` are not imported. The dataset's metadata goes to
``buffer.attrs["minari"]``: ``dataset_id``, ``env_spec`` (gymnasium's JSON, for
``EnvSpec.from_json``), ``observation_space``/``action_space`` (Minari's JSON, for
``minari.serialization.deserialize_space``), ``algorithm_name``, ``minari_version`` and the like.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ._engine import ImportSourceError, Source, is_plain_json
from ._hdf5 import check_links_inside

__all__ = ["MinariSource"]

INSTALL_HINT = "Minari datasets need the minari package: pip install 'replaybuf[minari]'"


def _flatten(prefix: str, value: Any) -> dict[str, np.ndarray]:
    """Arrays of a (nested) dict or tuple space value, keyed ``prefix_<key>``; ValueError where
    two map to one name (keys ``a_b`` and ``a`` holding ``b``): one would be dropped."""
    if not isinstance(value, (dict, tuple)):
        return {prefix: np.asarray(value)}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    out: dict[str, np.ndarray] = {}
    for key, item in items:
        for name, array in _flatten(f"{prefix}_{key}", item).items():
            if name in out:
                raise ValueError(f"two parts of the {prefix!r} space map to one field name {name!r}")
            out[name] = array
    return out


def _steps(episode: Any) -> dict[str, np.ndarray]:
    observations = _flatten("observations", episode.observations)
    return {
        **{name: values[:-1] for name, values in observations.items()},
        **{f"next_{name}": values[1:] for name, values in observations.items()},
        **_flatten("actions", episode.actions),
        "rewards": np.asarray(episode.rewards),
        "terminations": np.asarray(episode.terminations),
        "truncations": np.asarray(episode.truncations),
    }


class MinariSource(Source):
    format = "minari"

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        try:
            import minari
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        folder = Path(self.path)
        try:
            if folder.is_dir():
                self._dataset = minari.MinariDataset(folder / "data" if (folder / "data").is_dir() else folder)
            else:
                self._dataset = minari.load_dataset(self.path)
        except (OSError, ValueError, KeyError) as error:
            # minari's own advice (download=True) is no argument of ours: imports read local data only
            hint = "" if folder.is_dir() else f" (imports read local datasets: `minari download {self.path}` first)"
            raise ImportSourceError(f"{self.path}: cannot open as a Minari dataset: {error}{hint}") from error
        for file in sorted(Path(self._dataset.storage.data_path).glob("*.hdf5")):  # its HDF5 storage's
            check_links_inside(file)
        self._ids = [int(i) for i in self._dataset.episode_indices]
        metadata = self._dataset.storage.get_episode_metadata(self._ids)
        self._lengths = [int(row["total_steps"]) for row in metadata]
        # the longest episode sizes the destination: its claimed length is checked against the
        # steps it holds before anything is created (a total_steps of 1e8 would reserve terabytes)
        longest = int(np.argmax(self._lengths)) if self._ids else 0
        try:
            steps = _steps(next(self._dataset.iterate_episodes(self._ids[longest : longest + 1]))) if self._ids else {}
        except ValueError as error:
            raise ImportSourceError(f"{self.path}: {error}") from error
        if steps and len(steps["rewards"]) != self._lengths[longest]:
            raise ImportSourceError(
                f"{self.path}: episode {self._ids[longest]}: its metadata says total_steps="
                f"{self._lengths[longest]}, but it holds {len(steps['rewards'])} steps"
            )
        self._fields = {name: {"dtype": str(v.dtype), "shape": tuple(v.shape[1:])} for name, v in steps.items()}

    def fields(self) -> dict[str, dict[str, Any]]:
        return self._fields

    def location(self) -> str | None:
        """The dataset's folder (the one holding ``data/``), also for a dataset id: a destination
        inside Minari's root was written into the dataset."""
        return os.path.dirname(os.path.abspath(self._dataset.storage.data_path))

    def attrs(self) -> dict[str, Any]:
        from minari.serialization import serialize_space

        metadata = {}
        for key, value in self._dataset.storage.metadata.items():
            value = value.item() if isinstance(value, np.generic) else value
            if key.endswith("_space"):
                metadata[key] = serialize_space(value)  # a JSON string: spaces hold infinities JSON has not
            elif is_plain_json(value):
                metadata[key] = value
            else:
                metadata[key] = str(value)
        return {"minari": metadata}

    def episode_ids(self) -> list[int]:
        return self._ids

    def lengths(self) -> list[int]:
        return self._lengths

    def read(self, position: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return _steps(next(self._dataset.iterate_episodes([self._ids[position]]))), {}
