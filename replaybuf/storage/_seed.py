"""Reading folders written by memmap-replay-buffer 0.2.x (the seed library).

A seed folder holds ``metadata.pkl`` (the config, pickled), ``<field>.data.npy`` and
``<meta>.data.meta.npy`` (numpy memmaps, including ``episode_lens`` and ``_initted``) and the
counters ``num_episodes.state.npy``, ``episode_index.state.npy``, ``timestep_index.state.npy``
(int32 scalars). The pickle is read by a restricted unpickler that refuses every global, so a
crafted ``metadata.pkl`` cannot run code; the loaded object must consist of plain
dict/list/tuple/str/int/float/bool/None.

The seed publishes an episode in progress through ``episode_lens[episode_index]`` (its
``timestep_index``); replaybuf shows it as the newest, committed episode of that length, which
is what the seed's own readers see.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass

import numpy as np

from ..schema import Schema

METADATA_FILE = "metadata.pkl"
STATE_NAMES = ("num_episodes", "episode_index", "timestep_index")
SEED_INTERNAL_META = ("episode_lens", "_initted")
_PLAIN_TYPES = (dict, list, tuple, str, int, float, bool, type(None))


class UnsafePickleError(ValueError):
    """A ``metadata.pkl`` holds something other than plain Python data."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, bools and None; refuses every global."""

    def find_class(self, module: str, name: str):
        raise UnsafePickleError(
            f"refusing to load {module}.{name}: metadata.pkl may only hold plain data "
            "(dict/list/tuple/str/int/float/bool/None)"
        )

    def persistent_load(self, pid):
        raise UnsafePickleError("refusing persistent ids in metadata.pkl")


def _check_plain(value: object, where: str) -> None:
    if not isinstance(value, _PLAIN_TYPES):
        raise UnsafePickleError(
            f"metadata.pkl: {where} is a {type(value).__name__}; only "
            "dict/list/tuple/str/int/float/bool/None are accepted"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")


def load_plain_pickle(data: bytes, source: str) -> dict:
    """Unpickle ``data`` allowing only plain Python data; a dict is expected."""
    try:
        value = _PlainDataUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{source}: {e}") from None
    except Exception as e:
        raise ValueError(f"{source} is not a readable memmap-replay-buffer config: {e}") from e
    _check_plain(value, "the config")
    if not isinstance(value, dict):
        raise ValueError(f"{source}: expected a dict config, got {type(value).__name__}")
    return value


def is_seed_folder(folder: str) -> bool:
    """Whether ``folder`` looks like a memmap-replay-buffer memmap folder (not its HDF5 variant)."""
    return os.path.isfile(os.path.join(folder, METADATA_FILE)) and all(
        os.path.isfile(state_path(folder, n)) for n in STATE_NAMES
    )


def state_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"{name}.state.npy")


def read_seed_schema(folder: str) -> Schema:
    """The seed config of ``folder`` as a replaybuf Schema."""
    path = os.path.join(folder, METADATA_FILE)
    with open(path, "rb") as f:
        config = load_plain_pickle(f.read(), path)
    missing = [k for k in ("max_episodes", "max_timesteps", "fields") if k not in config]
    if missing:
        raise ValueError(f"{path}: config lacks {missing}; not a memmap-replay-buffer folder")
    meta = {n: s for n, s in (config.get("meta_fields") or {}).items() if n not in SEED_INTERNAL_META}
    return Schema.build(
        config["fields"], meta, config["max_episodes"], config["max_timesteps"], bool(config.get("circular", False))
    )


@dataclass(frozen=True)
class SeedState:
    """The seed's counters, and what they mean in replaybuf's terms."""

    num_episodes: int
    episode_index: int
    timestep_index: int

    @classmethod
    def read(cls, folder: str) -> SeedState:
        values = [int(np.load(state_path(folder, n), mmap_mode="r")[()]) for n in STATE_NAMES]
        return cls(*values)

    def episode_lens(self, stored_lens: np.ndarray) -> np.ndarray:
        """Per-slot lengths with the episode in progress (if any) published at its step count."""
        lens = np.array(stored_lens, dtype=np.int32)
        if self.timestep_index > 0:
            lens[self.episode_index] = self.timestep_index
        return lens

    def generations(self, lens: np.ndarray, max_episodes: int) -> np.ndarray:
        """1-based chronological ordinals of the filled slots (0 for empty ones).

        Once the seed has filled every slot, the oldest episode sits at ``episode_index`` (the
        slot written next), or just after it when that slot holds the episode in progress.
        """
        start = 0
        if self.num_episodes >= max_episodes:
            start = (self.episode_index + (1 if self.timestep_index > 0 else 0)) % max_episodes
        order = (np.arange(max_episodes) - start) % max_episodes
        filled = np.flatnonzero(lens > 0)
        out = np.zeros(max_episodes, dtype=np.int64)
        out[filled[np.argsort(order[filled], kind="stable")]] = np.arange(1, len(filled) + 1)
        return out

    def replaybuf_state(self, lens: np.ndarray, max_episodes: int) -> dict:
        """Counters with the episode in progress counted as committed."""
        in_progress = self.timestep_index > 0
        return {
            "num_episodes": min(self.num_episodes + int(in_progress), max_episodes),
            "episode_index": (self.episode_index + int(in_progress)) % max_episodes,
            "total_episodes": int((lens > 0).sum()),
        }


def write_seed_state(folder: str, state: dict) -> None:
    """Mirror replaybuf's counters into the seed's state files, so the seed library can keep
    using a folder replaybuf wrote to (no episode in progress: ``timestep_index`` 0)."""
    values = {"num_episodes": state["num_episodes"], "episode_index": state["episode_index"], "timestep_index": 0}
    for name, value in values.items():
        array = np.load(state_path(folder, name), mmap_mode="r+")
        array[()] = value
        array.flush()
        del array
    initted = os.path.join(folder, "_initted.data.meta.npy")
    if os.path.isfile(initted):
        flags = np.load(initted, mmap_mode="r+")
        flags[state["episode_index"]] = False
        flags.flush()
        del flags
