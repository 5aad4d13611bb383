"""Test data shared by the test modules: field specs and deterministic episodes.

``fields`` picks a test's fields from one vocabulary (``COMMON_FIELDS``), ``random_episode``
builds the data of any fields spec, and ``padded`` what a buffer returns for a list of episodes.
The named variants below are the specs several modules share: the standard fields (``FIELDS``, ``META_FIELDS``, ``episode``), the seed's
fields and a folder it wrote (``SEED_FIELDS``, ``seed_buffer``), and the sampling tests' fields,
whose ``ident`` names the episode and step a sample came from (``SAMPLING_*``). A module whose
test needs other fields keeps its own spec and builds its episodes with ``random_episode``.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from replaybuf.schema import parse_field

Draw = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]

# the test fields by name: a test picks some with ``fields``
COMMON_FIELDS = {
    "obs": ("float", (3,)),
    "state": ("float", 4),
    "image": ("uint8", (6, 5, 3)),
    "reward": "float",
    "action": "int",
    "done": "bool",
    "ident": "int",  # random_episode: 1000 * episode + t, so a sample names where it came from
    "priority": "float",
}


def fields(*names: str, **specs) -> dict:
    """The fields ``names``, in that order: each one's spec from ``specs`` if given, else from
    COMMON_FIELDS."""
    return {name: specs[name] if name in specs else COMMON_FIELDS[name] for name in names}


def random_episode(fields: dict, length: int, seed: int, **draws: Draw) -> dict[str, np.ndarray]:
    """``length`` steps of every field of ``fields`` (a ReplayBuffer fields spec), the same for
    the same ``seed``: drawn in field order from ``np.random.default_rng(seed)``, float fields
    standard normal, uint8 ones in 0..255, int ones in 0..4; a bool field is True on the last
    step only, and ``ident`` is 1000 * seed + t. ``draws`` replace a field's rule
    (``name=lambda rng, shape: ...``, shape (length, *field shape)); values take the field's dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in fields.items():
        field = parse_field(name, spec)
        shape = (length, *field.shape)
        if name in draws:
            values = draws[name](rng, shape)
        elif name == "ident":
            values = 1000 * seed + np.arange(length)
        elif field.dtype == np.bool_:
            values = np.arange(length) == length - 1
        elif field.dtype == np.uint8:
            values = rng.integers(0, 256, shape, dtype=np.uint8)
        elif field.dtype.kind == "i":
            values = rng.integers(0, 5, shape)
        else:
            values = rng.standard_normal(shape)
        out[name] = np.asarray(values).astype(field.dtype, copy=False)
    return out


def padded(episodes: list[dict], name: str) -> np.ndarray:
    """Field ``name`` of ``episodes`` stacked as (episode, time, ...), zero past each one's end
    up to the longest: what a buffer holding them returns."""
    longest = max(len(e[name]) for e in episodes)
    first = episodes[0][name]
    out = np.zeros((len(episodes), longest, *first.shape[1:]), first.dtype)
    for row, data in enumerate(episodes):
        out[row, : len(data[name])] = data[name]
    return out


def uniform(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A draw for ``random_episode``: uniform in [0, 1)."""
    return rng.random(shape)


# ---- the standard fields: image-like state, a vector action, a scalar reward -----------------

FIELDS = {"state": ("float", (3, 4, 4)), "action": ("int", 2), "reward": "float"}
META_FIELDS = {"task_id": "int"}


def episode(length: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic episode data for the standard test fields."""
    return random_episode(FIELDS, length, seed)


# ---- the seed's fields, and a folder memmap-replay-buffer 0.2.3 wrote ------------------------

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


# ---- the sampling tests' fields: the same episodes in a replaybuf buffer and the seed --------

SAMPLING_FIELDS = fields("image", "state", "reward", "done", "ident")
SAMPLING_META_FIELDS = {"task": "int", "success": "bool"}
SAMPLING_LENGTHS = (1, 4, 7, 2, 9, 5)


def sampling_episode(index: int, length: int, image_shape: tuple[int, ...] = (6, 5, 3)) -> dict[str, np.ndarray]:
    """Episode ``index``: every step's ``ident`` is 1000 * index + t, so a sample names its origin."""
    return random_episode({**SAMPLING_FIELDS, "image": ("uint8", image_shape)}, length, index, reward=uniform)


def fill_sampling_buffer(buffer, lengths=SAMPLING_LENGTHS, start: int = 0) -> None:
    """Store sampling episodes ``start``, ``start + 1``, ... of ``lengths`` steps into ``buffer``."""
    image_shape = tuple(buffer.shapes["image"])
    for offset, length in enumerate(lengths):
        index = start + offset
        buffer.store_episode(**sampling_episode(index, length, image_shape), task=index % 3, success=index % 2 == 0)


RELEASED = Path(__file__).parent / "data"


def released_copy(version: str, backend: str, folder: Path) -> str:
    """A copy, in ``folder``, of the buffer released format ``version`` ("format-v4") wrote on
    ``backend`` (``tests/data/make_fixtures.py``: 3 slots holding episodes of 4, 3 and 6 steps)."""
    path = Path(folder) / f"{version}-{backend}"
    shutil.copytree(RELEASED / version / backend, path)
    return str(path)
