"""Bring datasets of other libraries into replaybuf buffers, and buffers out to them.

Importers: ``diffusion_policy`` (zarr format 2), ``robomimic`` and ``d4rl`` (HDF5), ``lerobot``
(LeRobot v3 folders) and ``minari`` (through the ``minari`` package), each also reachable as ``load(format, src, dst)`` and as
``replaybuf import FORMAT SRC DST``. Every import copies one episode at a time (memory bounded
by one episode), records each source episode's index in the meta field ``source_episode`` and
skips those already committed in ``dst`` (so an interrupted import resumes), and with
``verify=True`` reads every episode back and compares it with its source. A malformed or
truncated source raises ``ImportSourceError`` naming the file and episode; the episodes
committed before it stay in ``dst``, and a new ``dst`` is created only once the first episode
has read well (a source refused at once, or whose fields no buffer can hold, leaves nothing).
What a source says about the dataset as a whole (LeRobot's fps, features and task texts,
Minari's env spec, robomimic's env_args, ...) goes to ``buffer.attrs``, with ``imported_from``
(format and path); each format's module says which keys.

Exporters: ``export_diffusion_policy`` and ``export_lerobot``, also ``export(format, src, dst)``
and ``replaybuf export FORMAT SRC DST``. They read the buffer's attributes back: the LeRobot
export takes fps, feature names, task texts and robot type from them, the diffusion_policy
export writes them as the zarr root's attributes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from ._diffusion_policy import DiffusionPolicySource, export_diffusion_policy
from ._engine import ImportResult, ImportSourceError, ImportVerifyError, Source, run_import
from ._hdf5 import D4RLSource, RobomimicSource
from ._lerobot import LeRobotSource, export_lerobot
from ._minari import MinariSource

__all__ = [
    "EXPORTERS",
    "FORMATS",
    "ImportResult",
    "ImportSourceError",
    "ImportVerifyError",
    "Source",
    "d4rl",
    "diffusion_policy",
    "export",
    "export_diffusion_policy",
    "export_lerobot",
    "lerobot",
    "load",
    "minari",
    "robomimic",
    "run_import",
]

FORMATS: MappingProxyType[str, type[Source]] = MappingProxyType(
    {
        "diffusion_policy": DiffusionPolicySource,
        "robomimic": RobomimicSource,
        "d4rl": D4RLSource,
        "lerobot": LeRobotSource,
        "minari": MinariSource,
    }
)
EXPORTERS: MappingProxyType[str, Callable[..., int]] = MappingProxyType(
    {"diffusion_policy": export_diffusion_policy, "lerobot": export_lerobot}
)


def _check_format(format: str, table: MappingProxyType) -> None:
    if format not in table:
        raise ValueError(f"unknown format {format!r}: expected one of {sorted(table)}")


def load(
    format: str,
    src: str | os.PathLike,
    dst: Any,
    *,
    backend: str | None = None,
    storage_options: dict | None = None,
    verify: bool = False,
    progress: bool | None = None,
) -> ImportResult:
    """Import dataset ``src`` of ``format`` (a key of ``FORMATS``) into the buffer at ``dst``.

    ``dst`` is created with one slot per source episode (``max_episodes``) and the longest
    source episode as ``max_timesteps``; an existing ``dst`` is reopened and the source
    episodes it already holds are skipped. ``backend``/``storage_options`` are the
    destination's, as for ``ReplayBuffer``; ``progress`` as in ``replaybuf.progress``.
    """
    _check_format(format, FORMATS)
    source = FORMATS[format](src)
    return run_import(source, dst, backend=backend, storage_options=storage_options, verify=verify, progress=progress)


def diffusion_policy(src: str | os.PathLike, dst: Any, **kwargs: Any) -> ImportResult:
    """Import a diffusion_policy zarr; see ``load``."""
    return load("diffusion_policy", src, dst, **kwargs)


def robomimic(src: str | os.PathLike, dst: Any, **kwargs: Any) -> ImportResult:
    """Import a robomimic HDF5 file; see ``load``."""
    return load("robomimic", src, dst, **kwargs)


def d4rl(src: str | os.PathLike, dst: Any, **kwargs: Any) -> ImportResult:
    """Import a D4RL-style flat HDF5 file; see ``load``."""
    return load("d4rl", src, dst, **kwargs)


def lerobot(src: str | os.PathLike, dst: Any, **kwargs: Any) -> ImportResult:
    """Import a local LeRobot v3 dataset folder; see ``load``."""
    return load("lerobot", src, dst, **kwargs)


def minari(src: str | os.PathLike, dst: Any, **kwargs: Any) -> ImportResult:
    """Import a Minari dataset (an id under Minari's root, or a dataset folder); see ``load``."""
    return load("minari", src, dst, **kwargs)


def export(format: str, src: Any, dst: str | os.PathLike, **kwargs: Any) -> int:
    """Export buffer ``src`` as ``format`` (a key of ``EXPORTERS``) to ``dst``; returns the
    number of episodes written."""
    _check_format(format, EXPORTERS)
    return EXPORTERS[format](src, dst, **kwargs)
