"""HDF5 datasets: robomimic (one group per demo) and D4RL (flat arrays split at episode ends).

robomimic: ``data/demo_N/{obs/<key>, next_obs/<key>, actions, rewards, dones, states}``, each
demo's length in its ``num_samples`` attribute. ``obs/<key>`` becomes field ``obs_<key>``
(``next_obs_<key>``, ``action_dict/<key>`` and any group's datasets likewise, their path joined
by ``_``), the others keep their names. Demos are read in order of N; ``data/`` holds nothing else.
``buffer.attrs["robomimic"]`` keeps ``env_args`` (the environment's metadata, parsed; its text
when it is not plain JSON, e.g. holds NaN) and ``fields`` (field -> dataset path).

D4RL: ``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts`` (and any other
top-level array with one row per step, ``infos/<key>`` as ``infos_<key>``); an episode ends at
each step where ``terminals | timeouts``, and steps after the last end form a final episode.
``buffer.attrs["d4rl"]`` keeps ``source_keys`` (field -> dataset path), ``episode_ends`` (the
keys that ended episodes), the file's root attributes that are plain JSON and ``left_out``: the
datasets that are no field (``metadata/*``, 0-d ones, groups under ``infos/``).
"""

from __future__ import annotations

import json
import os
import re
from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np

from ._engine import ImportSourceError, Source, is_plain_json

__all__ = ["D4RLSource", "RobomimicSource", "check_links_inside"]

INSTALL_HINT = "robomimic and D4RL datasets (HDF5) need h5py: pip install 'replaybuf[h5py]'"
# the most dataset paths ``buffer.attrs["d4rl"]["left_out"]`` lists (attributes hold 1 MiB)
LEFT_OUT_LISTED = 1000


def _open(path: str) -> Any:
    try:
        import h5py
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    try:
        return h5py.File(path, "r")
    except OSError as error:
        raise ImportSourceError(f"{path}: cannot open as HDF5: {error}") from error


def _text(value: Any) -> str:
    """An HDF5 string attribute (str, or bytes from fixed-length strings) as str; bytes that are
    not UTF-8 as escapes (they raised UnicodeDecodeError, naming no file)."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


def _plain(value: Any) -> Any:
    """An HDF5 attribute as Python values (numpy scalars and arrays, bytes)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def _spec(dataset: Any) -> dict[str, Any]:
    return {"dtype": str(dataset.dtype), "shape": tuple(dataset.shape[1:])}


def _resolved(group: Any, name: str, link: Any, prefix: str = "") -> Any:
    """The group or dataset the link ``name`` of ``group`` leads to; ValueError where it leads
    nowhere, or to another file (an external link, or a dataset kept in other files: a virtual
    dataset, external storage; an import reads only the source file, as a LeRobot import only
    its folder; it pulled any file of this machine into the buffer)."""
    import h5py

    if isinstance(link, h5py.ExternalLink):
        raise ValueError(
            f"{prefix}{name} is an external link to {link.filename}:{link.path}; an import reads only the source file"
        )
    item = group.get(name)
    if item is None:
        raise ValueError(f"{prefix}{name} is a link to nothing ({getattr(link, 'path', link)})")
    if isinstance(item, h5py.Dataset):
        _refuse_kept_elsewhere(f"{prefix}{name}", item)
    return item


def _refuse_kept_elsewhere(name: str, dataset: Any) -> None:
    """ValueError where ``dataset`` (at ``name``) keeps its data in other files: as an external
    link, it reads any file of this machine into the buffer."""
    from ..storage import stored_elsewhere

    elsewhere = stored_elsewhere(dataset)
    if elsewhere:
        raise ValueError(f"{name} keeps its data in other files ({elsewhere}); an import reads only the source file")


def check_links_inside(path: str | os.PathLike) -> None:
    """ImportSourceError naming the HDF5 file at ``path`` where one of its links leads nowhere or
    to another file (``_resolved``): for sources whose HDF5 files a package reads (Minari), which
    followed them and imported another file of this machine into the buffer. Walked with HDF5's
    own iteration: h5py's ``visititems_links`` and ``get`` cost ~20 s per 10,000 episodes."""
    import h5py

    file = _open(os.fspath(path))
    with file:
        links: list[tuple[str, int]] = []
        file.id.links.visit(lambda name, info: links.append((name.decode(), info.type)), info=True)
        datasets: list[bytes] = []  # each once, however many hard links lead to it
        h5py.h5o.visit(
            file.id, lambda name, info: datasets.append(name) if info.type == h5py.h5o.TYPE_DATASET else None, info=True
        )
        try:
            for name, kind in links:
                if kind != h5py.h5l.TYPE_HARD:  # external links, and soft links (to nothing?)
                    _resolved(file, name, file.get(name, getlink=True))
            for dataset in datasets:
                _refuse_kept_elsewhere(dataset.decode(), h5py.Dataset(h5py.h5d.open(file.id, dataset)))
        except ValueError as error:
            raise ImportSourceError(f"{os.fspath(path)}: {error}") from error


def _unique(found: list[tuple[str, str]], prefix: str = "") -> dict[str, str]:
    """field name -> dataset path of ``found`` (pairs); ValueError where two datasets map to one
    field name (``obs/x`` and a dataset ``obs_x``): one of them would be dropped without a word."""
    paths: dict[str, str] = {}
    for name, path in found:
        if name in paths:
            raise ValueError(f"datasets {prefix}{paths[name]} and {prefix}{path} map to one field name {name!r}")
        paths[name] = path
    return paths


class _HDF5Source(Source):
    """An HDF5 file, indexed when opened: ImportSourceError naming the file where its layout is
    not the format's (a group where a dataset belongs raised a bare AttributeError)."""

    layout: ClassVar[str]

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._file = _open(self.path)
        try:
            self._index()
        except ImportSourceError:
            self.close()
            raise
        except (KeyError, AttributeError, TypeError, ValueError, IndexError, OSError) as error:
            self.close()
            raise ImportSourceError(f"{self.path}: not {self.layout}: {error}") from error

    @abstractmethod
    def _index(self) -> None:
        """Read the file's layout (its episodes and fields)."""

    def close(self) -> None:
        self._file.close()


class RobomimicSource(_HDF5Source):
    format = "robomimic"
    layout = "a robomimic file (data/demo_N groups of datasets, obs/ and next_obs/ groups of datasets)"

    def _index(self) -> None:
        if not hasattr(self._file.get("data"), "keys"):
            raise ImportSourceError(f"{self.path}: not a robomimic file (no 'data' group)")
        demos = [name for name in self._file["data"] if re.fullmatch(r"demo_\d+", name)]
        others = sorted(set(self._file["data"]) - set(demos))
        if others:  # they were left out without a word
            raise ImportSourceError(
                f"{self.path}: data/ holds {others}, expected only demo_N groups (N a number, as robomimic writes)"
            )
        self._demos = sorted(demos, key=lambda name: int(name.split("_")[1]))
        # the datasets of every demo: one that only some demos hold is missing from the others
        # (an error naming it), not dropped from all of them
        self._fields: dict[str, str] = {}
        self._specs: dict[str, dict[str, Any]] = {}
        for demo in self._demos:
            for name, key in self._paths(demo).items():
                if name not in self._fields:
                    self._fields[name] = key
                    self._specs[name] = _spec(self._file[f"data/{demo}/{key}"])
        self._lengths = [self._length(demo) for demo in self._demos]

    def _paths(self, demo: str) -> dict[str, str]:
        """field name -> dataset path inside ``data/<demo>``, the datasets of its groups (``obs``,
        ``next_obs``, ``action_dict``, MimicGen's ``datagen_info``, at any depth) with their path
        joined by ``_``: those other than obs and next_obs were dropped without a word. ValueError
        where ``obs`` or ``next_obs`` is not a group."""
        group = self._file[f"data/{demo}"]
        for key in ("obs", "next_obs"):
            if key in group and not hasattr(group[key], "keys"):
                raise ValueError(f"data/{demo}/{key} is a dataset, expected a group of datasets")
        links: list[tuple[str, Any]] = []
        # soft links too (visititems skips them); checked after the visit (an exception raised
        # inside h5py's callback came out as SystemError)
        group.visititems_links(lambda path, link: links.append((path, link)))
        found = [
            (path.replace("/", "_"), path)
            for path, link in links
            if not hasattr(_resolved(group, path, link, f"data/{demo}/"), "keys")
        ]
        return _unique(found, f"data/{demo}/")

    @property
    def env_args(self) -> dict[str, Any] | None:
        """The ``env_args`` JSON attribute of ``data`` (the environment's metadata), if any."""
        raw = self._file["data"].attrs.get("env_args")
        return None if raw is None else json.loads(raw)

    def fields(self) -> dict[str, dict[str, Any]]:
        return self._specs

    def attrs(self) -> dict[str, Any]:
        env_args: Any
        try:
            env_args = self.env_args
        except ValueError:  # not JSON: keep the text
            env_args = None
        if env_args is None or not is_plain_json(env_args):
            raw = self._file["data"].attrs.get("env_args")
            env_args = None if raw is None else _text(raw)
        return {"robomimic": {"env_args": env_args, "fields": dict(self._fields)}}

    def episode_ids(self) -> list[int]:
        return [int(demo.split("_")[1]) for demo in self._demos]

    def _length(self, demo: str) -> int:
        """Steps of ``demo``: its ``num_samples`` attribute (else the rows of ``actions``), refused
        where no dataset of the demo holds that many rows (a lying count would reserve its size in
        the destination); a dataset holding fewer is a truncated demo, which fails when read."""
        where = f"{self.path}:data/{demo}"
        group = self._file[f"data/{demo}"]
        count = group.attrs.get("num_samples")
        rows = [self._file[f"data/{demo}/{key}"].shape[:1] for key in self._paths(demo).values()]
        most = max((int(shape[0]) for shape in rows if shape), default=0)
        if count is None:
            if "actions" not in group:
                raise ImportSourceError(f"{where}: neither a num_samples attribute nor an actions dataset")
            return int(group["actions"].shape[0])
        try:
            length = int(count)
        except (TypeError, ValueError) as error:
            raise ImportSourceError(f"{where}: num_samples {count!r} is not a step count") from error
        if length > most:
            raise ImportSourceError(f"{where}: num_samples is {length}, but its datasets hold at most {most} rows")
        return length

    def lengths(self) -> list[int]:
        return self._lengths

    def read(self, position: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        group = self._file[f"data/{self._demos[position]}"]
        data = {}
        for name, key in self._fields.items():
            if key not in group:
                raise ValueError(f"dataset {key!r} is missing from data/{self._demos[position]}")
            data[name] = group[key][()]
        return data, {}

    def where(self, position: int) -> str:
        return f"{self.path}:data/{self._demos[position]}"


class D4RLSource(_HDF5Source):
    format = "d4rl"
    layout = "a D4RL file (one row per step in 'observations', 'terminals', ...; 'infos/' a group of datasets)"

    def _index(self) -> None:
        f = self._file
        missing = [key for key in ("observations", "terminals") if key not in f]
        if missing:
            raise ImportSourceError(f"{self.path}: not a D4RL file, missing {missing}")
        if hasattr(f["observations"], "keys") or f["observations"].ndim == 0:
            raise ValueError("'observations' is a group or 0-d, expected an array with one row per step")
        if "infos" in f and not hasattr(f["infos"], "keys"):
            raise ValueError("'infos' is a dataset, expected a group of datasets")
        for group, prefix in ((f, ""), (f.get("infos"), "infos/")):
            for name in group if hasattr(group, "keys") else ():
                _resolved(group, name, group.get(name, getlink=True), prefix)
        steps = f["observations"].shape[0]
        # every per-step array (groups and scalars are not); one shorter than ``observations``
        # fails the episodes past its end
        found = [(key, key) for key, item in f.items() if not hasattr(item, "keys") and item.ndim >= 1]
        if "infos" in f:
            found += [
                (f"infos_{key}", f"infos/{key}")
                for key, item in f["infos"].items()
                if not hasattr(item, "keys") and item.ndim >= 1
            ]
        self._paths = _unique(found)
        self._specs = {name: _spec(f[key]) for name, key in self._paths.items()}
        longer = {key: f[key].shape[0] for key in self._paths.values() if f[key].shape[0] > steps}
        if longer:  # their rows past the last step would be dropped without a word
            raise ImportSourceError(
                f"{self.path}: {longer} have more rows than the {steps} steps of 'observations'; "
                "expected one row per step"
            )
        flags = [key for key in ("terminals", "timeouts") if key in f]
        not_flat = {key: f[key].shape for key in flags if f[key].ndim != 1}
        if not_flat:  # np.flatnonzero would read (N, 2) flags as 2 N steps
            raise ImportSourceError(f"{self.path}: {not_flat}: expected one flag per step, shape (steps,)")
        ends = np.zeros(steps, dtype=bool)
        for key in flags:
            values = np.asarray(f[key][:steps])
            if values.dtype.kind not in "biuf":
                raise ImportSourceError(f"{self.path}: '{key}' holds {values.dtype}, expected a flag per step (0 or 1)")
            other = np.flatnonzero((values != 0) & (values != 1))  # NaN and 0.5 read as an episode's end
            if len(other):
                raise ImportSourceError(
                    f"{self.path}: '{key}' holds {values[other[0]]!r} at step {int(other[0])}; expected 0 or 1 "
                    "(where an episode ends)"
                )
            ends[: len(values)] |= values.astype(bool)
        stops = (np.flatnonzero(ends) + 1).tolist()
        if steps and (not stops or stops[-1] != steps):  # an empty file: no episode, not one of 0 steps
            stops.append(steps)
        self._bounds = list(zip([0, *stops[:-1]], stops))

    def fields(self) -> dict[str, dict[str, Any]]:
        return self._specs

    def attrs(self) -> dict[str, Any]:
        ends = [key for key in ("terminals", "timeouts") if key in self._file]
        root = {key: _plain(value) for key, value in self._file.attrs.items()}
        file_attrs = {key: value for key, value in root.items() if is_plain_json(value)}
        return {
            "d4rl": {
                "source_keys": dict(self._paths),
                "episode_ends": ends,
                "file_attrs": file_attrs,
                "left_out": self._left_out(),
            }
        }

    def _left_out(self) -> list[str]:
        """The file's datasets that are no field (``metadata/*``, 0-d ones, groups under
        ``infos/``), at most ``LEFT_OUT_LISTED``: they were left out without a word."""
        imported = set(self._paths.values())
        found: list[str] = []
        self._file.visititems(
            lambda path, item: None if hasattr(item, "keys") or path in imported else found.append(path)
        )
        return sorted(found)[:LEFT_OUT_LISTED]

    def episode_ids(self) -> list[int]:
        return list(range(len(self._bounds)))

    def lengths(self) -> list[int]:
        return [stop - start for start, stop in self._bounds]

    def read(self, position: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        start, stop = self._bounds[position]
        return {name: self._file[key][start:stop] for name, key in self._paths.items()}, {}

    def where(self, position: int) -> str:
        start, stop = self._bounds[position]
        return f"{self.path} (steps {start}..{stop})"
