"""The commit protocol in one place (``replaybuf/commit.py``): every write path commits through
``Committer``, publishes each commit once through ``Committer.publish``, and ``store_episode``
stores exactly what the same steps stored one by one store."""

from __future__ import annotations

import gc

import numpy as np

from replaybuf import ReplayBuffer

from ._data import random_episode

FIELDS = {"state": ("float", 3), "bonus": ("float", (), 1.0)}
META = {"score": "float"}


def new_buffer(path, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(path, max_episodes=8, max_timesteps=6, fields=FIELDS, meta_fields=META, **kwargs)


def steps(n: int, seed: int) -> dict[str, np.ndarray]:
    return random_episode({"state": FIELDS["state"]}, n, seed)


def record_commits(buffer: ReplayBuffer) -> list[tuple[list[int], int]]:
    """The (slots, length) of each commit, in order, as ``Committer.publish`` is called."""
    calls: list[tuple[list[int], int]] = []
    publish = buffer._commit.publish

    def recorded(slots: np.ndarray, length: int, *args, **kwargs) -> None:
        calls.append((slots.tolist(), length))
        publish(slots, length, *args, **kwargs)

    buffer._commit.publish = recorded
    return calls


def test_every_write_path_publishes_each_commit_once(tmp_path):
    buffer = new_buffer(tmp_path / "b")
    calls = record_commits(buffer)
    with buffer.one_episode(score=1.0):
        for step in steps(2, 0)["state"]:
            buffer.store(state=step)
    with buffer.batched_episode(2):
        buffer.store_batch(state=np.ones((2, 3), np.float32))
    buffer.store_episode(**steps(3, 1), score=2.0)
    buffer.advance_episode(batch_size=2)  # two length-0 episodes
    buffer.store(state=np.zeros(3, np.float32))
    buffer.advance_episode()
    assert calls == [([0], 2), ([1, 2], 1), ([3], 3), ([4, 5], 0), ([6], 1)]
    assert buffer.num_episodes == 7
    buffer.close()


def test_recovery_commits_through_the_same_path(tmp_path):
    buffer = new_buffer(tmp_path / "b")
    for step in steps(4, 2)["state"]:
        buffer.store(state=step)
    buffer.flush()
    buffer.storage.release_writer()
    del buffer  # killed with its episode in the step log only
    gc.collect()
    reopened = new_buffer(tmp_path / "b", overwrite=False)
    assert reopened.episode_lens[0] == 4
    np.testing.assert_array_equal(reopened.data["state"][0, :4], steps(4, 2)["state"])
    calls = record_commits(reopened)
    reopened.store_episode(**steps(1, 3))
    assert calls == [([1], 1)]
    reopened.close()


def test_store_episode_stores_what_steps_stored_one_by_one_store(tmp_path):
    """Both go through the same group and padding: the rows past the end hold the field's
    default (``bonus`` defaults to 1), in a slot reused after a longer episode too."""
    by_steps, whole = new_buffer(tmp_path / "steps", circular=True), new_buffer(tmp_path / "whole", circular=True)
    for length, seed in [(5, 0), (2, 1)] * 4 + [(3, 2)]:  # the last one reuses slot 0
        data = steps(length, seed)
        with by_steps.one_episode(score=float(seed)):
            for step in data["state"]:
                by_steps.store(state=step)
        whole.store_episode(**data, score=float(seed))
    for name in FIELDS:
        np.testing.assert_array_equal(whole.data[name][:], by_steps.data[name][:], err_msg=name)
    np.testing.assert_array_equal(whole.episode_lens, by_steps.episode_lens)
    assert whole.data["bonus"][0, 3:].tolist() == [1.0] * 3
    by_steps.close()
    whole.close()
