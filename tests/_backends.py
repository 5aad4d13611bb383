"""Shared helpers for the backend tests: where each backend's buffer lives, and snapshots of
everything stored there (to prove that read-only access writes nothing)."""

from __future__ import annotations

import itertools
import os
import warnings
from dataclasses import dataclass

import numpy as np

from replaybuf.testing import snapshot

__all__ = [
    "BACKENDS",
    "FIELDS",
    "META_FIELDS",
    "SEED_FIELDS",
    "Place",
    "episode",
    "make_place",
    "seed_buffer",
    "snapshot",
]


# 'memory' is the zarr backend on a memory:// URL. hdf5 is always in the list: h5py is in the
# test extra, and a missing optional backend must fail the run, not drop out of it
BACKENDS = ["zarr", "memory", "memmap", "hdf5"]
_counter = itertools.count()


@dataclass
class Place:
    """A buffer location for one backend: pass ``**place.kwargs`` to ReplayBuffer."""

    name: str
    location: str
    backend: str

    @property
    def kwargs(self) -> dict:
        return {"backend": self.backend}

    @property
    def on_disk(self) -> bool:
        return "://" not in self.location


def make_place(name: str, tmp_path, label: str = "buffer") -> Place:
    """Where backend ``name``'s buffer ``label`` lives: under ``tmp_path``, or a ``memory://``
    URL unique to this call."""
    if name == "memory":
        return Place(name, f"memory://replaybuf-test-{os.getpid()}-{next(_counter)}/{label}", "zarr")
    return Place(name, str(tmp_path / f"{label}-{name}"), name)


def episode(length: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic episode data for the standard test fields."""
    rng = np.random.default_rng(seed)
    return {
        "state": rng.standard_normal((length, 3, 4, 4)).astype(np.float32),
        "action": rng.integers(0, 5, (length, 2)).astype(np.int32),
        "reward": rng.standard_normal(length).astype(np.float32),
    }


FIELDS = {"state": ("float", (3, 4, 4)), "action": ("int", 2), "reward": "float"}
META_FIELDS = {"task_id": "int"}


SEED_FIELDS = {"state": ("float", (3,)), "action": ("int", 2, -1), "reward": "float"}


def seed_buffer(folder, circular=True, lengths=(3, 4, 5, 6, 7), partial=2, max_episodes=4):
    """A folder written by the real memmap-replay-buffer 0.2.3 (episodes of ``lengths``, then one
    in progress of ``partial`` steps); returns the seed's buffer object."""
    import memmap_replay_buffer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buffer = memmap_replay_buffer.ReplayBuffer(
            str(folder),
            max_episodes=max_episodes,
            max_timesteps=10,
            fields=SEED_FIELDS,
            meta_fields={"task_id": "int"},
            circular=circular,
        )
        for i, length in enumerate(lengths):
            with buffer.one_episode(task_id=i):
                for t in range(length):
                    buffer.store(state=np.full(3, i + t / 10, np.float32), action=np.array([t, i]), reward=float(t))
        for _ in range(partial):
            buffer.store(state=np.full(3, 9.0, np.float32), reward=-1.0)
        buffer.flush()
    return buffer
