"""Prioritized sampling: draws follow the stored priorities, weights, write-back, workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.sampling import make_dataloader, update_priorities
from tests._backends import make_place
from tests._data import SAMPLING_FIELDS as FIELDS
from tests._data import SAMPLING_META_FIELDS as META_FIELDS
from tests._data import fill_sampling_buffer as fill

LENGTHS = (5, 3, 6)


@pytest.fixture(params=["zarr", "memory"])
def buffer(request, tmp_path):
    fields = {**FIELDS, "priority": "float"}
    place = make_place(request.param, tmp_path)
    buffer = ReplayBuffer(
        place.location,
        **place.kwargs,
        max_episodes=4,
        max_timesteps=8,
        fields=fields,
        meta_fields=META_FIELDS,
    )
    fill(buffer, LENGTHS)
    return buffer


def set_priorities(buffer, values: dict[tuple[int, int], float]) -> None:
    rows = np.zeros((len(LENGTHS), max(LENGTHS)), np.float32)
    for (e, t), p in values.items():
        rows[e, t] = p
    buffer.update(np.arange(len(LENGTHS)), priority=rows)


def drawn(loader) -> list[tuple[int, int]]:
    return [tuple(pair) for batch in loader for pair in batch["_indices"].tolist()]


def test_draws_only_prioritized_timesteps_with_weights(buffer):
    set_priorities(buffer, {(0, 1): 1.0, (2, 4): 4.0})
    loader = make_dataloader(buffer, 64, timestep_level=True, sampler="prioritized", alpha=1.0, beta=1.0, num_batches=4)
    batches = list(loader)
    assert len(batches) == 4
    pairs = drawn(batches)
    assert set(pairs) == {(0, 1), (2, 4)}
    assert 0.6 < pairs.count((2, 4)) / len(pairs) < 0.95
    for batch in batches:
        for (e, t), w, ident in zip(batch["_indices"].tolist(), batch["_weights"].tolist(), batch["ident"].tolist()):
            assert ident == 1000 * e + t
            assert w == pytest.approx(1.0 if (e, t) == (0, 1) else 0.25)
    assert batches[0]["_weights"].dtype == torch.float32


def test_alpha_zero_is_uniform_and_weights_are_one(buffer):
    set_priorities(buffer, {(0, 0): 5.0, (1, 2): 0.5})
    batch = next(iter(make_dataloader(buffer, 256, timestep_level=True, sampler="prioritized", alpha=0.0)))
    assert len(set(map(tuple, batch["_indices"].tolist()))) > 8
    assert torch.allclose(batch["_weights"], torch.ones(256))


def test_update_priorities_writes_back_and_steers_the_next_batch(buffer):
    set_priorities(buffer, {(0, 0): 1.0})
    loader = make_dataloader(buffer, 8, n_steps=2, sampler="prioritized", num_batches=3)
    batches = iter(loader)
    first = next(batches)
    assert set(drawn([first])) == {(0, 0)}
    update_priorities(buffer, torch.tensor([[0, 0], [2, 3]]), torch.tensor([0.0, 2.0]))
    assert buffer.data["priority"][0, 0] == 0.0 and buffer.data["priority"][2, 3] == 2.0
    second = next(batches)
    assert set(drawn([second])) == {(2, 3)}
    assert second["next_ident"].tolist() == [2005] * 8 and second["n_step_lens"].tolist() == [2] * 8
    fresh = make_dataloader(buffer, 8, timestep_level=True, sampler="prioritized", num_batches=1)
    assert set(drawn(fresh)) == {(2, 3)}


def test_prioritized_with_workers(buffer):
    if buffer.storage.location.startswith("memory://"):
        pytest.skip("fork workers of a memory:// store are covered in test_sampling")
    set_priorities(buffer, {(1, 1): 1.0, (2, 5): 1.0})
    loader = make_dataloader(buffer, 16, timestep_level=True, sampler="prioritized", num_batches=4, num_workers=2)
    assert set(drawn(loader)) == {(1, 1), (2, 5)}


def test_bad_input(buffer):
    with pytest.raises(ValueError, match="shuffle cannot be combined"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", shuffle=True)
    with pytest.raises(ValueError, match="priority_field 'state' must hold one value per timestep"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", priority_field="state")
    with pytest.raises(ValueError, match="alpha must be a number >= 0"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", alpha=-1)
    set_priorities(buffer, {})
    with pytest.raises(ValueError, match="every priority in 'priority' is 0"):
        next(iter(make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized")))
    with pytest.raises(ValueError, match="shape \\(B, 2\\)"):
        update_priorities(buffer, [0, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 values for 1 indices"):
        update_priorities(buffer, [[0, 1]], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        update_priorities(buffer, [[0, 1]], [-1.0])
    with pytest.raises(ValueError, match="outside the committed episodes"):
        update_priorities(buffer, [[1, 3]], [1.0])
