"""Hostile arguments to the read side: dataset positions, indices, fields, fieldname_map and
the prioritized sampler's numbers. Each must read the samples asked for or raise a clear error,
never read past an episode's end, drop an output or draw from NaN priorities."""

from __future__ import annotations

import re

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.sampling import ReplayDatasetTimeWindow, make_dataloader, make_dataset
from tests._backends import make_place
from tests._data import SAMPLING_FIELDS as FIELDS
from tests._data import SAMPLING_META_FIELDS as META_FIELDS
from tests._data import fill_sampling_buffer as fill

LENGTHS = (4, 2, 3)


@pytest.fixture
def buffer(tmp_path):
    place = make_place("zarr", tmp_path)
    fields = {**FIELDS, "priority": ("float", (), 1.0)}
    buffer = ReplayBuffer(
        place.location, **place.kwargs, max_episodes=4, max_timesteps=6, fields=fields, meta_fields=META_FIELDS
    )
    fill(buffer, LENGTHS)
    yield buffer
    buffer.close()


def idents(batch) -> list:
    return batch["ident"].tolist()


@pytest.mark.parametrize("kind", [{}, {"timestep_level": True}, {"n_steps": 2}])
def test_positions_outside_the_dataset_are_refused_not_read_as_padding(buffer, kind):
    dataset = make_dataset(buffer, **kind)
    size = len(dataset)
    for position in (size, size + 1, -size - 1):
        with pytest.raises(IndexError, match=f"indices \\[{position}\\] out of range for a dataset of {size}"):
            dataset.__getitems__([0, position])
    # negative positions count from the end, as dataset[-1] and a list do
    assert idents(dataset.__getitems__([-1, -size]).batch) == idents(dataset.__getitems__([size - 1, 0]).batch)
    # a custom sampler's positions reach __getitems__ the same way
    with pytest.raises(IndexError, match="out of range"):
        next(iter(make_dataloader(buffer, 2, sampler=[0, size], **kind)))
    last = next(iter(make_dataloader(buffer, 1, sampler=[-1], **kind)))
    assert idents(last) == idents(dataset.__getitems__([size - 1]).batch)
    # a batch of floats or flags (a custom batch sampler's) is refused, not truncated
    for batch in ([1.0, 2.0], np.array([1.5]), [True, False]):
        with pytest.raises(TypeError, match="a dataset index must be an int"):
            dataset.__getitems__(batch)
    assert idents(dataset.__getitems__(torch.tensor([1, 0])).batch) == idents(dataset.__getitems__([1, 0]).batch)


def test_a_dataset_index_must_be_an_int(buffer):
    dataset = make_dataset(buffer, timestep_level=True)
    for index in (1.0, 1.5, slice(0, 2), np.array([True, False]), True, torch.tensor(True), "1", torch.tensor(1.0)):
        with pytest.raises(TypeError, match="a dataset index must be an int"):
            dataset[index]
    for index in (5, np.int64(5), np.array(5), torch.tensor(5), -4):
        assert dataset[index]["ident"] == 1001, index


def test_empty_fields_give_the_meta_fields_only_as_the_seed(buffer, tmp_path):
    theirs = seed.ReplayBuffer(
        str(tmp_path / "seed"), max_episodes=4, max_timesteps=6, fields={"x": "float"}, meta_fields={"task": "int"}
    )
    ours = ReplayBuffer(
        str(tmp_path / "ours"), max_episodes=4, max_timesteps=6, fields={"x": "float"}, meta_fields={"task": "int"}
    )
    for b in (theirs, ours):
        for n in LENGTHS:
            b.store_episode(x=np.arange(n, dtype=np.float32), task=n)
    for kind in ({}, {"timestep_level": True}, {"return_mask": True}):
        expected = next(iter(theirs.dataloader(2, fields=(), **kind)))
        got = next(iter(ours.dataloader(2, fields=(), **kind)))
        assert sorted(got) == sorted(expected), kind
        for key in expected:
            assert torch.equal(got[key], expected[key]), (kind, key)
    ours.close()


@pytest.mark.parametrize(
    "kind, mapping, names",
    [
        ({}, {"state": "reward"}, "'reward' and 'state'|'state' and 'reward'"),
        ({"timestep_level": True}, {"task": "ident"}, "'ident' and 'task'"),
        ({"n_steps": 2}, {"state": "next_state"}, "'state' and 'next_state'"),
        ({"n_steps": 2}, {"seq_reward": "n_step_lens"}, "'seq_reward' and 'n_step_lens'"),
        ({}, {"reward": "_lens"}, "'reward' and '_lens'"),
    ],
)
def test_a_fieldname_map_giving_two_outputs_one_name_is_refused(buffer, kind, mapping, names):
    if kind.get("n_steps"):
        kind = {**kind, "sequence_fields": ("reward",)}
    with pytest.raises(ValueError, match=f"fieldname_map: ({names}) would both be returned as"):
        make_dataloader(buffer, 2, fieldname_map=mapping, **kind)


def test_a_fieldname_map_onto_the_loaders_own_keys_or_not_to_a_name_is_refused(buffer):
    with pytest.raises(ValueError, match=r"fieldname_map: \['_mask'\] would be overwritten"):
        make_dataloader(buffer, 2, return_mask=True, fieldname_map={"state": "_mask"})
    with pytest.raises(ValueError, match=r"fieldname_map: \['_weights'\] would be overwritten"):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", fieldname_map={"reward": "_weights"})
    for mapping in ({"state": 3}, {"state": ""}, {"state": None}):
        with pytest.raises(TypeError, match="fieldname_map: new names must be non-empty strings"):
            make_dataloader(buffer, 2, fieldname_map=mapping)


def test_a_fieldname_map_swapping_names_keeps_both(buffer):
    plain = next(iter(make_dataloader(buffer, 3)))
    swapped = next(iter(make_dataloader(buffer, 3, fieldname_map={"state": "reward", "reward": "state"})))
    assert torch.equal(swapped["reward"], plain["state"]) and torch.equal(swapped["state"], plain["reward"])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_prioritized_refuses_stored_priorities_that_are_not_finite_or_negative(buffer, bad):
    """A negative stored priority (a signed TD error) was drawn as 0, never, without a word."""
    buffer.update_steps([1], [1], priority=[bad])
    loader = make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized")
    with pytest.raises(
        ValueError,
        match=r"'priority' holds 1 NaN, infinite or negative value\(s\), at \(episode, timestep\) \[\(1, 1\)\]",
    ):
        next(iter(loader))
    buffer.update_steps([1], [1], priority=[2.0])
    assert torch.isfinite(next(iter(loader))["_weights"]).all()


@pytest.mark.parametrize(
    "case, message",
    [
        ({"alpha": float("nan")}, "alpha must be a number >= 0, and finite, got nan"),
        ({"beta": float("inf")}, "beta must be a number >= 0, and finite, got inf"),
        ({"alpha": True}, "alpha must be a number >= 0"),
        ({"num_batches": 0}, "num_batches must be an int >= 1"),
        ({"num_batches": -1}, "num_batches must be an int >= 1"),
        ({"num_batches": 1.5}, "num_batches must be an int >= 1"),
    ],
)
def test_prioritized_refuses_bad_numbers(buffer, case, message):
    with pytest.raises(ValueError, match=message):
        make_dataloader(buffer, 2, timestep_level=True, sampler="prioritized", **case)


def test_prioritized_takes_numpy_numbers(buffer):
    loader = make_dataloader(
        buffer, 2, timestep_level=True, sampler="prioritized", alpha=np.float32(0.5), num_batches=np.int64(3)
    )
    assert len(list(loader)) == 3


@pytest.mark.parametrize(
    "case, message",
    [
        (
            {"filter_meta": {"task": [0, 1]}},
            r"filter_meta\['task'\]: a value of shape \(2,\) for a field of shape \(\)",
        ),
        (
            {"timestep_level": True, "filter_fields": {"reward": [0.5, 1.0]}},
            r"filter_fields\['reward'\]: a value of shape \(2,\) for a field of shape \(\)",
        ),
        ({"to_named_tuple": ("state", "state")}, r"to_named_tuple \('state', 'state'\): .*duplicate field name"),
        ({"device": "nope"}, "device: 'nope' is not a torch device"),
        ({"return_mask": True, "return_episode_lens": False}, "return_mask builds _mask .* no _lens"),
        ({"return_mask": True, "dataset_kwargs": {"return_episode_lens": False}}, "return_mask builds _mask"),
    ],
)
def test_bad_filters_names_and_devices_are_refused_when_the_loader_is_made(buffer, case, message):
    with pytest.raises(ValueError, match=message):
        make_dataloader(buffer, 2, **case)


def test_return_mask_over_a_given_timestep_dataset_is_refused_when_the_loader_is_made(buffer):
    dataset = make_dataset(buffer, timestep_level=True)
    with pytest.raises(ValueError, match="return_mask builds _mask .* no _lens \\(ReplayDatasetTimestep\\)"):
        make_dataloader(buffer, 2, dataset=dataset, return_mask=True)


def test_filters_take_one_value_in_any_container(buffer):
    kept = [
        sorted(batch["task"].tolist())
        for value in (1, [1], np.array([1]), torch.tensor(1))
        for batch in make_dataloader(buffer, 8, filter_meta={"task": value})
    ]
    assert kept == [[1]] * 4


def prioritized_draws(buffer, **kwargs) -> list:
    loader = make_dataloader(buffer, 4, timestep_level=True, sampler="prioritized", num_batches=3, **kwargs)
    return [batch["_indices"].tolist() for batch in loader]


def test_prioritized_draws_follow_the_seed_and_differ_between_ranks(buffer):
    draws = {}
    for rank in (0, 1):
        torch.manual_seed(0)  # every DDP rank seeds torch alike
        draws[rank] = prioritized_draws(buffer, rank=rank, world_size=2)
    assert draws[0] != draws[1]
    torch.manual_seed(1)
    first = prioritized_draws(buffer, seed=5)
    torch.manual_seed(2)
    assert prioritized_draws(buffer, seed=5) == first
    assert prioritized_draws(buffer, seed=5, rank=1, world_size=2) != first
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        prioritized_draws(buffer, seed=-1)
    with pytest.raises(ValueError, match="rank must be in \\[0, world_size=2\\), got 2"):
        prioritized_draws(buffer, rank=2, world_size=2)


@pytest.mark.parametrize("kind", ["window", "whole rows", "renamed window", "renamed whole rows"])
def test_return_mask_is_as_wide_as_the_batch_s_time_axis(buffer, kind):
    """Windows longer than every episode (5 > 4) and whole rows (max_timesteps 6) are padded past
    the longest sample: ``_mask`` was only 4 wide (the seed's), so ``data[mask]`` failed; and
    still was when the dataset given renamed every field (its ``fieldname_map``, not the loader's)."""
    renamed = {name: f"out_{name}" for name in buffer.fieldnames} if kind.startswith("renamed") else {}
    if kind.endswith("window"):
        dataset = ReplayDatasetTimeWindow(buffer, window_length=5, fieldname_map=renamed)
    else:
        dataset = make_dataset(buffer, fieldname_map=renamed, slice_by_episode_len=False)
    batch = next(iter(make_dataloader(buffer, 3, dataset=dataset, return_mask=True)))
    ident = batch[renamed.get("ident", "ident")]
    width = 5 if kind.endswith("window") else 6
    assert ident.shape == (3, width) and batch["_lens"].tolist() == list(LENGTHS)
    assert torch.equal(batch["_mask"], torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None])
    if kind.endswith("window"):  # a window is zero past its steps
        assert (ident[~batch["_mask"]] == 0).all()
    assert ident[batch["_mask"]].shape == (sum(LENGTHS),)


@pytest.mark.parametrize("name", ["return_mask", "return_episode_lens", "slice_by_episode_len"])
def test_loader_flags_take_a_bool_and_refuse_other_values_by_name(buffer, name):
    # they were multiplied into the lists of output names: "yes" or None gave TypeError "can't
    # multiply sequence by non-int of type 'str'" from inside, np.True_ the same for numpy's bool
    for flag in (None, "yes", 2):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got {flag!r}"):
            make_dataloader(buffer, 2, **{name: flag})
    batch = next(iter(make_dataloader(buffer, 2, **{name: np.bool_(True)})))
    assert batch.keys() == next(iter(make_dataloader(buffer, 2, **{name: True}))).keys()


def test_dataset_kwargs_must_be_a_dict(buffer):
    for given in ([1], "ab"):  # dict() of them failed: "cannot convert dictionary update sequence ..."
        with pytest.raises(
            TypeError,
            match=re.escape(f"dataset_kwargs must be a dict of the dataset's keyword arguments, got {given!r}"),
        ):
            make_dataloader(buffer, 2, dataset_kwargs=given)


def test_a_misspelt_loader_keyword_is_refused_by_name_before_anything_is_read(buffer, tmp_path):
    """``dataloader(timestep_levl=True)`` reached torch after the dataset was made, as
    "DataLoader.__init__() got an unexpected keyword argument 'timestep_levl'" (naming neither
    dataloader() nor timestep_level); rate-limited on an empty buffer, only after waiting for
    ``min_size`` steps. Every keyword torch's DataLoader takes still goes through."""
    for keywords, close in (({"timestep_levl": True}, "'timestep_level'"), ({"num_worker": 2}, "'num_workers'")):
        with pytest.raises(TypeError, match=rf"^dataloader\(\) got unexpected keyword .*did you mean {close}\?"):
            buffer.dataloader(batch_size=2, **keywords)
    empty = ReplayBuffer(str(tmp_path / "empty"), max_episodes=2, max_timesteps=3, fields={"x": "float"})
    with pytest.raises(TypeError, match=r"\['zzz'\] \(it takes"):
        empty.dataloader(batch_size=2, samples_per_insert=1, zzz=1)
    loader = buffer.dataloader(batch_size=2, num_workers=0, drop_last=True, pin_memory=False, timeout=0)
    assert loader.drop_last and len(next(iter(loader))["ident"]) == 2
    with pytest.raises(TypeError, match=r"takes no window_length: windows of steps are ReplayDatasetTimeWindow\("):
        buffer.dataset(window_length=2)  # said "ReplayDatasetTrajectory.__init__() got an unexpected keyword"
    windows = buffer.dataloader(batch_size=2, dataset=ReplayDatasetTimeWindow(buffer, window_length=2))
    assert next(iter(windows))["ident"].shape == (2, 2)  # as the README's "What `replaybuf` exports" says


def test_drop_last_with_fewer_samples_than_a_batch_warns_and_yields_no_batch_as_the_seed(buffer):
    """``dataloader(batch_size=256, drop_last=True)`` over a small buffer yields no batch, as the
    seed's does (a loop written for it runs as it did), but no longer without a word."""
    steps = sum(LENGTHS)
    with pytest.warns(UserWarning, match=rf"batch_size=256 with drop_last=True: the loader has {steps} samples, so"):
        assert list(buffer.dataloader(batch_size=256, timestep_level=True, drop_last=True)) == []
    with pytest.warns(UserWarning, match=r"has 1 samples on this rank, so it yields no batch"):
        buffer.dataloader(batch_size=2, drop_last=True, rank=0, world_size=3)  # 3 episodes, one a rank
    assert len(list(buffer.dataloader(batch_size=steps, timestep_level=True, drop_last=True, shuffle=True))) == 1
    assert len(list(buffer.dataloader(batch_size=256, timestep_level=True))) == 1  # without drop_last: one short batch
