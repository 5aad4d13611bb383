"""Statistics sketches: written at commit time, merged for any set of episodes or any
concatenation without reading data, quantiles within the KLL rank error of exact ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.sketches import PREFIX, decode, normalizer, summary

from ._data import random_episode

FIELDS = {"state": ("float", (3,)), "reward": "float", "image": ("uint8", (16, 16, 3))}
QS = [0.01, 0.1, 0.5, 0.9, 0.99]


def episode(index: int, length: int = 200) -> dict[str, np.ndarray]:
    """Skewed, heavy-tailed states and rewards, so that quantiles are far from a normal's."""
    return random_episode(
        FIELDS,
        length,
        index,
        state=lambda rng, shape: rng.standard_normal(shape) ** 3 + index,
        reward=lambda rng, shape: rng.exponential(1.0, shape),
        image=lambda rng, shape: rng.integers(0, 255, shape, dtype=np.uint8),
    )


def make(path, count: int, first: int = 0, **options) -> ReplayBuffer:
    buffer = ReplayBuffer(
        path, max_episodes=options.pop("max_episodes", count), max_timesteps=200, fields=FIELDS, **options
    )
    for index in range(first, first + count):
        buffer.store_episode(**episode(index))
    return buffer


def assert_within_rank_error(summary_field, values: np.ndarray) -> None:
    """Each sketch quantile's rank in the exact data is within the stated rank error of q."""
    values = values.reshape(len(values), -1)
    got = summary_field.quantile(QS).reshape(len(QS), -1).numpy()
    error = summary_field.rank_error
    for feature in range(values.shape[1]):
        column = np.sort(values[:, feature].astype(np.float32))
        for q, estimate in zip(QS, got[:, feature]):
            low = np.searchsorted(column, estimate, side="left") / len(column)
            high = np.searchsorted(column, estimate, side="right") / len(column)
            assert low - error <= q <= high + error, (q, low, high, error)


def test_subsets_match_exact_values(tmp_path):
    buffer = make(tmp_path / "b", 8)
    assert len(buffer.storage.list_blobs(PREFIX)) == 8, "one blob per committed episode"
    header = decode(buffer.storage.read_blob(f"{PREFIX}3"))
    assert set(header["fields"]) == {"state", "reward"}, "images are not sketched"
    for chosen in (None, [1, 4, 6]):
        slots = range(8) if chosen is None else chosen
        exact = {n: np.concatenate([episode(i)[n] for i in slots]) for n in ("state", "reward")}
        stats = summary(buffer, episodes=chosen)
        for name, values in exact.items():
            flat = values.reshape(len(values), -1).astype(np.float64)
            assert stats[name].count == len(values)
            np.testing.assert_allclose(stats[name].mean.reshape(-1), flat.mean(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(stats[name].std.reshape(-1), flat.std(0), rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(stats[name].min.reshape(-1), flat.min(0).astype(np.float32))
            np.testing.assert_array_equal(stats[name].max.reshape(-1), flat.max(0).astype(np.float32))
            assert_within_rank_error(stats[name], values)


def test_summary_reads_no_data_when_blobs_exist(tmp_path, monkeypatch):
    buffer = make(tmp_path / "b", 4)
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    monkeypatch.setattr(reader.storage, "read_rows", lambda *a, **k: pytest.fail("summary read data"))
    monkeypatch.setattr(reader.storage, "read_spans", lambda *a, **k: pytest.fail("summary read data"))
    assert summary(reader)["reward"].count == 4 * 200
    del buffer


def test_overwritten_and_step_written_episodes(tmp_path):
    buffer = make(tmp_path / "b", 6, max_episodes=4, circular=True)  # episodes 4, 5 overwrite slots 0, 1
    with buffer.one_episode():  # step by step: no blob at commit, sketched from its data on demand
        for step in episode(99, 200)["reward"][:50]:
            buffer.store(reward=step, state=np.zeros(3, np.float32))
    kept = {3: 3, 0: 4, 1: 5, 2: 99}  # slot -> episode; slot 2's blob is episode 2's: stale, ignored
    values = np.concatenate([episode(i)["reward"][: 50 if i == 99 else 200] for i in kept.values()])
    stats = summary(buffer, ["reward"])["reward"]
    assert stats.count == len(values)
    np.testing.assert_allclose(float(stats.mean), values.mean(), rtol=1e-5)
    assert_within_rank_error(stats, values)


def test_concatenation(tmp_path):
    first, second = make(tmp_path / "a", 3), make(tmp_path / "b", 5, first=3)
    both = ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"])
    values = np.concatenate([episode(i)["state"] for i in range(8)])
    stats = summary(both, ["state"])["state"]
    assert stats.count == len(values)
    np.testing.assert_allclose(stats.mean.numpy(), values.astype(np.float64).mean(0), rtol=1e-5, atol=1e-5)
    assert_within_rank_error(stats, values)
    del first, second


def test_normalizers(tmp_path):
    buffer = make(tmp_path / "b", 4)
    values = torch.from_numpy(np.concatenate([episode(i)["state"] for i in range(4)]))
    standard = normalizer(buffer, "state")(values)
    torch.testing.assert_close(standard.mean(0), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(standard.std(0, unbiased=False), torch.ones(3), atol=1e-3, rtol=0)
    scaled = normalizer(buffer, "state", kind="quantile", q=(0.05, 0.95))
    inside = ((scaled(values) >= -1) & (scaled(values) <= 1)).float().mean(0)
    assert ((inside > 0.85) & (inside < 0.95)).all(), inside
    torch.testing.assert_close(scaled.unnormalize(scaled(values)), values, atol=1e-3, rtol=1e-5)


def test_errors(tmp_path):
    buffer = make(tmp_path / "b", 2, max_episodes=3)
    with pytest.raises(ValueError, match=r"fields \['image'\] have no sketches"):
        summary(buffer, ["image"])
    with pytest.raises(ValueError, match=r"episodes \[2\] hold no committed episode"):
        summary(buffer, episodes=[0, 2])
    with pytest.raises(ValueError, match="kind must be 'meanstd' or 'quantile'"):
        normalizer(buffer, "state", kind="minmax")
    with pytest.raises(ValueError, match="q must be in"):
        summary(buffer)["state"].quantile(1.5)
