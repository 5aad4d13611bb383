"""The features beyond the peers used as a careless user or an attacker would: a priority update
that arrives after its slot was reused, quantiles of adversarial values (NaN, only NaN, float64
beyond float32's range, int64 timestamps)."""

from __future__ import annotations

import numpy as np
import pytest

from replaybuf import ReplayBuffer

PRIORITY_FIELDS = {"ident": "int", "priority": "float"}


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_late_priority_update_never_lands_on_the_episode_that_reused_the_slot(tmp_path, backend):
    """A learner draws a batch, its actor stores an episode into the slot the batch came from
    (circular buffer), then the learner writes the batch's priorities back: the new episode's
    priorities stay as its actor stored them; the still-live pairs are written."""
    buffer = ReplayBuffer(
        tmp_path / "b", max_episodes=2, max_timesteps=4, fields=PRIORITY_FIELDS, circular=True, backend=backend
    )
    buffer.store_episode(ident=np.arange(4), priority=np.ones(4))
    buffer.store_episode(ident=np.arange(4) + 10, priority=np.ones(4))
    loader = buffer.dataloader(
        batch_size=64, timestep_level=True, sampler="prioritized", priority_field="priority", seed=0
    )
    batch = next(iter(loader))
    drawn = batch["_indices"].numpy()
    assert set(drawn[:, 0].tolist()) == {0, 1}, "the batch names both slots"
    np.testing.assert_array_equal(batch["_generations"].numpy(), buffer.generations[drawn[:, 0]])
    buffer.store_episode(ident=np.arange(4) + 20, priority=np.full(4, 7.0))  # reuses slot 0

    written = buffer.update_priorities(batch["_indices"], np.full(64, 0.5), generations=batch["_generations"])

    assert written == int((drawn[:, 0] == 1).sum())
    data = buffer.get_all_data()
    by_ident = {int(ident[0]): row for ident, row in zip(data["ident"].numpy(), data["priority"].numpy())}
    expected_old = np.where(np.isin(np.arange(4), drawn[drawn[:, 0] == 1, 1]), 0.5, 1.0)
    np.testing.assert_array_equal(by_ident[10], expected_old)
    np.testing.assert_array_equal(by_ident[20], np.full(4, 7.0)), "the new episode keeps its priorities"


def test_bad_generations_and_priorities_are_refused_naming_them(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=4, fields=PRIORITY_FIELDS)
    buffer.store_episode(ident=np.arange(4), priority=np.ones(4))
    pairs = np.array([[0, 1], [0, 2]])
    with pytest.raises(ValueError, match=r"generations must be one int per pair, shape \(2,\).*shape \(1,\)"):
        buffer.update_priorities(pairs, [1.0, 2.0], generations=[1])
    with pytest.raises(ValueError, match=r"generations must be one int per pair.*float64"):
        buffer.update_priorities(pairs, [1.0, 2.0], generations=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"priorities must be numbers, got a <U1 array"):
        buffer.update_priorities(pairs, ["a", "b"])
    np.testing.assert_array_equal(buffer.get_all_data()["priority"].numpy(), np.ones((1, 4))), "nothing written"
