"""Large result arrays in recycled memory (``storage/_recycle.py``): memory is reused only once
nothing refers to it, the pool stays bounded and goes back to the kernel when idle, and batches
and ``get_all_data`` results a caller keeps never change under it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.storage import _recycle

MIB = 1 << 20


@pytest.fixture
def small_pool(monkeypatch):
    """Recycle arrays from 64 KiB (every frame batch of these tests), from an empty pool."""
    monkeypatch.setattr(_recycle, "MIN_BYTES", 64 << 10)
    _recycle.sweep(now=math.inf)
    yield
    _recycle.sweep(now=math.inf)


def address(array: np.ndarray | torch.Tensor) -> int:
    return array.data_ptr() if isinstance(array, torch.Tensor) else array.__array_interface__["data"][0]


def test_small_arrays_come_from_numpy():
    array = _recycle.recycled_empty((4, 5), np.float32)
    assert array.shape == (4, 5) and array.dtype == np.float32 and array.flags.owndata


def test_memory_is_reused_only_once_nothing_refers_to_it(small_pool):
    first = _recycle.recycled_empty((2, MIB), np.uint8)
    assert first.shape == (2, MIB) and first.flags.writeable and not first.flags.owndata
    first[:] = 7
    where = address(first)
    other = _recycle.recycled_empty((2, MIB), np.uint8)  # the first is alive: never the same memory
    assert address(other) != where
    other[:] = 9
    assert (first == 7).all()
    view, tensor = first[1:], torch.from_numpy(first)
    held = []  # what the checks allocate stays alive: only the first array's memory can be freed
    del first
    held.append(_recycle.recycled_empty((2, MIB), np.uint8))
    assert address(held[-1]) != where  # a view and a tensor hold it
    del view
    held.append(_recycle.recycled_empty((2, MIB), np.uint8))
    assert address(held[-1]) != where
    assert (tensor == 7).all()
    del tensor
    again = _recycle.recycled_empty((MIB // 8, 4), np.float32)  # as large, another shape and dtype
    assert address(again) == where and again.shape == (MIB // 8, 4) and again.dtype == np.float32


def test_a_freed_region_serves_sizes_up_to_a_quarter_smaller(small_pool):
    big = _recycle.recycled_empty((4 * MIB,), np.uint8)
    where = address(big)
    del big
    assert address(_recycle.recycled_empty((MIB,), np.uint8)) != where  # far smaller: not given 4x the memory
    smaller = _recycle.recycled_empty((int(3.5 * MIB),), np.uint8)
    assert address(smaller) == where


def test_the_pool_is_bounded_and_goes_back_to_the_kernel_when_idle(small_pool, monkeypatch):
    monkeypatch.setattr(_recycle, "POOL_BYTES", 5 * MIB)
    arrays = [_recycle.recycled_empty((2 * MIB,), np.uint8) for _ in range(4)]
    del arrays
    kept = _recycle.sweep(now=0.0)  # nothing idle yet: only the bound applies
    assert 0 < kept <= 5 * MIB
    assert _recycle.sweep(now=math.inf) == 0


def test_kept_trajectory_batches_and_results_never_change(small_pool, tmp_path):
    """Every batch of an epoch kept while the next ones are read, and a get_all_data result kept
    across later calls, hold what was read."""
    frames = {"frame": ("uint8", (64, 64, 3)), "state": ("float", (3,))}
    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=6, max_timesteps=40, fields=frames)
    rng = np.random.default_rng(0)
    episodes = []
    for length in (40, 31, 40, 12, 40, 25):
        episode = {
            "frame": rng.integers(0, 255, (length, 64, 64, 3), dtype=np.uint8),
            "state": rng.normal(size=(length, 3)).astype(np.float32),
        }
        buffer.store_episode(**episode)
        episodes.append(episode)
    batches = list(buffer.dataloader(batch_size=2, return_indices=True))
    assert len({address(batch["frame"]) for batch in batches}) == len(batches)
    # forked workers recycle their own memory; each batch reaches this process in shared memory
    batches += list(buffer.dataloader(batch_size=2, return_indices=True, shuffle=True, num_workers=2))
    for batch in batches:
        for row, slot in enumerate(batch["_index"].tolist()):
            length = len(episodes[slot]["frame"])
            np.testing.assert_array_equal(batch["frame"][row, :length].numpy(), episodes[slot]["frame"])
            assert not batch["frame"][row, length:].any()
    first = buffer.get_all_data()
    second = buffer.get_all_data()
    assert address(first["frame"]) != address(second["frame"])
    for data in (first, second):
        for slot, episode in enumerate(episodes):
            length = len(episode["frame"])
            np.testing.assert_array_equal(np.asarray(data["frame"][slot, :length]), episode["frame"])
            assert not np.asarray(data["frame"][slot, length:]).any()
    buffer.close()
