"""Parallel writers: one buffer per actor under a common root, found again by listing the root.

A buffer has exactly one writer (a second one gets ``BufferLockedError``), so several actors
collecting at once each write their own shard: ``root/actor-000``, ``root/actor-001``, ...
(local folders or URL prefixes), each with its own writer lease. Readers list the root
(``discover_shards``) and read the shards together, e.g. with ``ConcatReplayBuffer``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .buffer import ReplayBuffer
from .storage import UnfinishedCreateError, detect_backend, is_url, list_children

SHARD_PREFIX = "actor-"
_SHARD_NAME = re.compile(rf"^{SHARD_PREFIX}(\d{{3,}})$")
_CONFIG = ("max_episodes", "max_timesteps", "fields")  # what a create needs


def shard_location(root: str | os.PathLike, index: int) -> str:
    """Where shard ``index`` of ``root`` lives: ``root/actor-{index:03d}``."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"shard index must be an int >= 0, got {index!r}")
    return _join(os.fspath(root), f"{SHARD_PREFIX}{index:03d}")


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)


def open_shard(root: str | os.PathLike, index: int, **kwargs: Any) -> ReplayBuffer:
    """Open (creating it if needed) the buffer of actor ``index`` under ``root``.

    ``kwargs`` are ``ReplayBuffer``'s (``max_episodes``, ``fields``, ``storage_options``, ...).
    Unlike ``ReplayBuffer``, ``overwrite`` defaults to False here: an actor restarted after a
    crash reopens its shard, recovering its last episode, instead of erasing it; a shard whose
    create never finished (the actor was killed while it created it) holds no episode and is
    created again.
    """
    kwargs.setdefault("overwrite", False)
    location = shard_location(root, index)
    try:
        return ReplayBuffer(location, **kwargs)
    except UnfinishedCreateError:
        if kwargs.get("read_only") or any(kwargs.get(name) is None for name in _CONFIG):
            raise  # only a writer given the config can create it again
        # the actor was killed while it created its shard: nothing was ever committed there (and
        # a create still under way in another process holds the lease: overwrite is refused)
        return ReplayBuffer(location, **{**kwargs, "overwrite": True})


def shards_hint(location: str) -> str:
    """A hint for a local folder that holds no buffer but shards (``actor-NNN``, what
    ``ReplayBuffer.shard`` writes), as the end of a "no buffer found" message; else ''."""
    if "://" in location or not os.path.isdir(location):
        return ""
    names = sorted(name for name in os.listdir(location) if _SHARD_NAME.match(name))
    if not names:
        return ""
    return (
        f"; it holds the shards {names[:3]}{' ...' if len(names) > 3 else ''} (ReplayBuffer.shard): open one "
        f"(e.g. {os.path.join(location, names[0])!r}), or read them together with ConcatReplayBuffer({location!r})"
    )


def discover_shards(root: str | os.PathLike, storage_options: dict | None = None) -> list[str]:
    """Locations of the shards under ``root`` that hold a buffer, ordered by actor index.

    Entries that are not named ``actor-NNN`` or hold no buffer (yet) are skipped, so a reader
    may list a root while actors are still creating their shards.
    """
    root = os.fspath(root)
    found = []
    for name in list_children(root, storage_options):
        match = _SHARD_NAME.match(name)
        if match is None:
            continue
        location = _join(root, name)
        if detect_backend(location, storage_options) is not None:
            found.append((int(match.group(1)), location))
    return [location for _, location in sorted(found)]
