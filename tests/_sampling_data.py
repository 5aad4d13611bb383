"""Small buffers for the sampling tests: the same episodes in a replaybuf buffer and the seed."""

from __future__ import annotations

import uuid

import numpy as np

FIELDS = {
    "image": ("uint8", (6, 5, 3)),
    "state": ("float", 4),
    "reward": "float",
    "done": "bool",
    "ident": "int",
}
META_FIELDS = {"task": "int", "success": "bool"}
LENGTHS = (1, 4, 7, 2, 9, 5)


def episode(index: int, length: int, image_shape: tuple[int, ...] = (6, 5, 3)) -> dict[str, np.ndarray]:
    """Episode ``index``: every step's ``ident`` is 1000 * index + t, so a sample names its origin."""
    rng = np.random.default_rng(index)
    return {
        "image": rng.integers(0, 256, (length, *image_shape), dtype=np.uint8),
        "state": rng.standard_normal((length, 4)).astype(np.float32),
        "reward": rng.random(length).astype(np.float32),
        "done": np.arange(length) == length - 1,
        "ident": 1000 * index + np.arange(length, dtype=np.int32),
    }


def meta(index: int) -> dict:
    return {"task": index % 3, "success": index % 2 == 0}


def location(backend: str, tmp_path) -> str:
    """Where a test buffer of ``backend`` lives: a folder, or a fresh ``memory://`` URL."""
    if backend == "memory":
        return f"memory://replaybuf-test-{uuid.uuid4().hex}"
    return str(tmp_path / f"buffer-{backend}")


def storage_backend(backend: str) -> str | None:
    return None if backend == "memory" else backend


def fill(buffer, lengths=LENGTHS, start: int = 0) -> None:
    image_shape = tuple(buffer.shapes["image"])
    for offset, length in enumerate(lengths):
        index = start + offset
        buffer.store_episode(**episode(index, length, image_shape), **meta(index))
