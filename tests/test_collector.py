"""EpisodeCollector: every method against memmap-replay-buffer's collector on the same inputs,
plus the error paths (which leave both the collector and the buffer unchanged)."""

from __future__ import annotations

import warnings

import memmap_replay_buffer as seed
import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.collector import EpisodeCollector, UnknownFieldError
from tests._compare import assert_same

G = 3  # parallel environments
FIELDS = dict(state=("float", (2, 3)), action=("int", 2), reward="float", done="bool", returns="float")
META = dict(task="int", goal=("float", 2))
CONFIG = dict(max_episodes=8, max_timesteps=12, fields=FIELDS, meta_fields=META)


def make_pair(tmp_path, location: tuple[str, dict] | None = None, **overrides):
    """The seed's buffer and ours (at ``location``: a path or URL and backend kwargs), configured alike."""
    config = {**CONFIG, **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = seed.ReplayBuffer(str(tmp_path / "seed"), **config)
    folder, backend_kwargs = location or (str(tmp_path / "ours"), {})
    ours = ReplayBuffer(folder, **config, **backend_kwargs)
    return theirs, ours


def collectors(tmp_path, num_groups=G, **kwargs):
    theirs, ours = make_pair(tmp_path)
    return seed.EpisodeCollector(theirs, num_groups, **kwargs), EpisodeCollector(ours, num_groups, **kwargs)


def rollout_steps(kind: str, steps: int = 4, seed_value: int = 0):
    """Group-batched steps as torch tensors, numpy arrays or per-group lists."""
    generator = torch.Generator().manual_seed(seed_value)
    out = []
    for t in range(steps):
        step = dict(
            state=torch.randn(G, 2, 3, generator=generator),
            action=torch.randint(0, 5, (G, 2), generator=generator, dtype=torch.int32),
            reward=torch.randn(G, generator=generator),
            done=torch.tensor([t == steps - 1] * G),
        )
        if kind == "numpy":
            step = {name: value.numpy() for name, value in step.items()}
        elif kind == "list":
            step = {name: list(value.numpy()) for name, value in step.items()}
            step["reward"] = [float(r) for r in step["reward"]]
        elif kind == "singleton":  # (G, 1, *shape)
            step = {name: value[:, None] for name, value in step.items()}
        out.append(step)
    return out


def snapshot(buffer) -> dict:
    return dict(num_episodes=buffer.num_episodes, size=len(buffer), data=buffer.get_all_data())


def slots(buffer) -> dict[str, np.ndarray]:
    """Every slot's data (zeroed past its length) and meta, in slot order, as numpy arrays.

    Slot order, not get_all_data's: replaybuf returns a wrapped circular buffer oldest first.
    """
    lens = np.asarray(buffer.episode_lens[:])
    out = {"episode_lens": lens}
    for name in sorted(buffer.fieldnames):
        values = np.array(buffer.data[name][:])
        values[np.arange(values.shape[1])[None, :] >= lens[:, None]] = 0
        out[name] = values
    for name in sorted(META):
        out[name] = np.asarray(buffer.meta_data[name][:])
    return out


def assert_same_buffers(ours, theirs):
    assert ours.num_episodes == theirs.num_episodes and len(ours) == len(theirs)
    assert_same(slots(ours), slots(theirs), "buffer slots")


# behaviour matches the seed


@pytest.mark.parametrize("kind", ["torch", "numpy", "list", "singleton"])
def test_append_reads_back_like_the_seed(tmp_path, kind):
    theirs, ours = collectors(tmp_path)
    for step in rollout_steps(kind):
        theirs.append(**step, task=2)
        ours.append(**step, task=2)
    assert len(ours) == len(theirs) == 4
    for name in ("state", "action", "reward", "done", "task"):
        assert_same(ours.time_major(name), theirs.time_major(name))
        assert_same(ours.env_major(name), theirs.env_major(name))
        assert_same(ours.groups(name), theirs.groups(name))
    assert ours.env_major("state").shape == (G, 4, 2, 3)
    assert ours.time_major("state").shape == (4, G, 2, 3)
    assert_same(ours.all_data(), theirs.all_data())
    assert_same(ours.all_data(fields=("reward", "task"), device="cpu"), theirs.all_data(fields=("reward", "task")))


def test_extend_reads_back_like_the_seed(tmp_path):
    theirs, ours = collectors(tmp_path)
    steps = rollout_steps("torch", steps=5)
    for step in steps:
        theirs.append(**step)
        ours.append(**step)
    returns = torch.randn(5, G)
    goals = torch.randn(5, G, 2)
    for collector in (theirs, ours):
        collector.extend(returns=returns, goal=goals)
    assert_same(ours.env_major("returns"), returns.T)
    assert_same(ours.env_major("returns"), theirs.env_major("returns"))
    assert_same(ours.time_major("goal"), goals[-1])  # meta keeps the last timestep, per group
    assert_same(ours.time_major("goal"), theirs.time_major("goal"))
    assert_same(ours.all_data(), theirs.all_data())


def test_extend_into_an_empty_collector_sets_its_length(tmp_path):
    theirs, ours = collectors(tmp_path)
    state = np.random.default_rng(0).normal(size=(7, G, 2, 3)).astype(np.float32)
    for collector in (theirs, ours):
        collector.extend(state=state, reward=np.ones((7, G), dtype=np.float64))
    assert len(ours) == len(theirs) == 7
    assert_same(ours.all_data(), theirs.all_data())


@pytest.mark.parametrize("kind", ["torch", "numpy", "list"])
def test_store_writes_the_same_episodes_as_the_seed(tmp_path, kind):
    theirs, ours = collectors(tmp_path)
    for step in rollout_steps(kind, steps=6):
        theirs.append(**step, task=4)
        ours.append(**step, task=4)
    for collector in (theirs, ours):
        collector.extend(returns=np.arange(6 * G, dtype=np.float32).reshape(6, G))
        collector.store(goal=torch.tensor([0.5, -1.0]))
    assert len(ours) == 0
    assert_same_buffers(ours.replay_buffer, theirs.replay_buffer)
    data = ours.replay_buffer.get_all_data()
    assert data["episode_lens"].tolist() == [6] * G
    assert data["task"].tolist() == [4] * G
    assert data["goal"].tolist() == [[0.5, -1.0]] * G


def test_store_with_per_group_meta_matches_the_seed(tmp_path):
    theirs, ours = collectors(tmp_path)
    for step in rollout_steps("torch", steps=3):
        theirs.append(**step)
        ours.append(**step)
    for collector in (theirs, ours):
        collector.store(task=torch.tensor([10, 11, 12]), goal=np.arange(G * 2, dtype=np.float32).reshape(G, 2))
    assert_same_buffers(ours.replay_buffer, theirs.replay_buffer)
    assert ours.replay_buffer.get_all_data()["task"].tolist() == [10, 11, 12]


def test_per_group_meta_in_append_is_split_across_groups(tmp_path):
    """The seed would keep the whole (G,) value for every group and fail at store; we split it."""
    _, ours = collectors(tmp_path)
    for step in rollout_steps("torch", steps=2):
        ours.append(**step, task=torch.tensor([5, 6, 7]))
    assert ours.time_major("task").tolist() == [5, 6, 7]
    ours.store()
    assert ours.replay_buffer.get_all_data()["task"].tolist() == [5, 6, 7]


def test_repeated_stores_wrap_a_circular_buffer_like_the_seed(tmp_path, make_location):
    location = make_location()
    theirs_buffer, ours_buffer = make_pair(tmp_path, location, max_episodes=5, circular=True)
    theirs, ours = seed.EpisodeCollector(theirs_buffer, G), EpisodeCollector(ours_buffer, G)
    for round_index, steps in enumerate((4, 2, 7)):
        for step in rollout_steps("numpy", steps=steps, seed_value=round_index):
            theirs.append(**step)
            ours.append(**step)
        theirs.store(task=round_index)
        ours.store(task=round_index)
        assert_same_buffers(ours_buffer, theirs_buffer)
    assert slots(ours_buffer)["task"].tolist() == [1, 2, 2, 2, 1]  # slots 0-2, then 3, 4, 0, then 1-3
    folder, backend_kwargs = location
    assert_same_buffers(ReplayBuffer.from_folder(folder, read_only=True, **backend_kwargs), theirs_buffer)


def test_a_single_group_stores_one_episode(tmp_path):
    theirs, ours = collectors(tmp_path, num_groups=1)
    for t in range(3):
        for collector in (theirs, ours):
            collector.append(reward=torch.tensor([float(t)]), task=1)
    theirs.store()
    ours.store()
    assert_same_buffers(ours.replay_buffer, theirs.replay_buffer)
    assert ours.replay_buffer.num_episodes == 1


def test_a_field_subset_collects_only_those_fields(tmp_path):
    theirs, ours = collectors(tmp_path, fieldnames=("state", "reward"), meta_fieldnames=("task",))
    with pytest.raises(UnknownFieldError, match="'action'"):
        ours.append(action=torch.zeros(G, 2))
    for step in rollout_steps("torch", steps=3):
        subset = dict(state=step["state"], reward=step["reward"])
        theirs.append(**subset, task=3)
        ours.append(**subset, task=3)
    theirs.store()
    ours.store()
    assert_same_buffers(ours.replay_buffer, theirs.replay_buffer)


def test_non_strict_collectors_ignore_unknown_names_like_the_seed(tmp_path):
    theirs, ours = collectors(tmp_path, fieldnames=("reward",), strict=False)
    for t in range(3):
        for collector in (theirs, ours):
            collector.append(reward=torch.full((G,), float(t)), action=torch.zeros(G, 2), nonsense=1)
    for collector in (theirs, ours):
        collector.extend(nonsense=np.zeros((3, G)))
    assert_same(ours.all_data(), theirs.all_data())
    theirs.store(nonsense=1)
    ours.store(nonsense=1)
    assert_same_buffers(ours.replay_buffer, theirs.replay_buffer)


@pytest.mark.parametrize(
    "options",
    [
        dict(batch_size=4),
        dict(batch_size=5, fields=("reward", "state")),
        dict(batch_size=2, filter_fields=dict(done=False), to_named_tuple=("state", "done")),
        dict(batch_size=3, to_named_tuple=("reward", "action"), device="cpu", drop_last=True),
    ],
    ids=["plain", "fields", "filter", "named-tuple"],
)
def test_dataloader_yields_the_seeds_batches(tmp_path, options):
    theirs, ours = collectors(tmp_path)
    for step in rollout_steps("torch", steps=5):
        theirs.append(**step)
        ours.append(**step)
    expected, got = list(theirs.dataloader(**options)), list(ours.dataloader(**options))
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)


def test_shuffled_dataloader_matches_the_seed_for_the_same_generator(tmp_path):
    theirs, ours = collectors(tmp_path)
    for step in rollout_steps("numpy", steps=5):
        theirs.append(**step)
        ours.append(**step)
    expected = list(theirs.dataloader(4, shuffle=True, generator=torch.Generator().manual_seed(3)))
    got = list(ours.dataloader(4, shuffle=True, generator=torch.Generator().manual_seed(3)))
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    flat_rewards = torch.cat([batch["reward"] for batch in got])
    assert sorted(flat_rewards.tolist()) == sorted(torch.as_tensor(ours.all_data()["reward"]).flatten().tolist())


def test_dataloader_strips_leading_underscores_in_named_tuples(tmp_path):
    _, ours = collectors(tmp_path)
    ours.extend(reward=torch.arange(4.0)[:, None].expand(4, G))
    batch = next(iter(ours.dataloader(G * 4, to_named_tuple=("reward",))))
    assert batch._fields == ("reward",)
    assert sorted(batch.reward.tolist()) == sorted([0.0, 1.0, 2.0, 3.0] * G)


def test_appended_values_are_copied(tmp_path):
    _, ours = collectors(tmp_path)
    observation = np.zeros((G, 2, 3), dtype=np.float32)
    reward = torch.zeros(G)
    for t in range(3):
        observation[:] = t  # an environment reusing its output array
        reward.fill_(t)
        ours.append(state=observation, reward=reward)
    assert ours.env_major("state")[:, :, 0, 0].tolist() == [[0, 1, 2]] * G
    assert ours.env_major("reward").tolist() == [[0, 1, 2]] * G
    ours.env_major("reward").zero_()  # readback is a copy too
    assert ours.env_major("reward").tolist() == [[0, 1, 2]] * G


def test_append_keeps_autograd_history(tmp_path):
    _, ours = collectors(tmp_path)
    weight = torch.ones((), requires_grad=True)
    for _ in range(2):
        ours.append(reward=weight * torch.ones(G))
    ours.all_data()["reward"].sum().backward()
    assert weight.grad.item() == 2 * G


def test_clear_discards_the_rollout(tmp_path):
    _, ours = collectors(tmp_path)
    ours.append(reward=torch.ones(G), task=1)
    ours.clear()
    assert len(ours) == 0
    with pytest.raises(ValueError, match="empty"):
        ours.all_data()


def test_create_collector_returns_an_episode_collector(tmp_path):
    _, buffer = make_pair(tmp_path)
    collector = buffer.create_collector(G, fieldnames=("reward",), strict=False)
    assert isinstance(collector, EpisodeCollector)
    assert collector.num_groups == G and collector.fieldnames == {"reward"} and not collector.strict
    assert collector.meta_fieldnames == set(META)


# bad input: a clear error, nothing changed


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        (dict(reward=1.0), TypeError, r"'reward'.*\(3, \*\(\)\)"),
        (dict(reward=torch.zeros(4)), ValueError, r"'reward'.*\(4,\)"),
        (dict(reward=torch.zeros(())), ValueError, r"'reward'.*got shape \(\)"),
        (dict(state=torch.zeros(G, 3, 2)), ValueError, r"'state'.*\(3, 2\) should be \(2, 3\)"),
        (dict(reward=[1.0, 2.0]), ValueError, r"'reward'.*length 2"),
        (dict(state=[np.zeros((2, 3)), np.zeros((3, 2)), np.zeros((2, 3))]), ValueError, r"'state'.*do not stack"),
        (dict(task=torch.zeros(2)), ValueError, r"meta field 'task'.*\(2,\)"),
        (dict(task="pick"), TypeError, r"'task'.*dtype <U4"),
        (dict(state=np.full((G, 2, 3), "x")), TypeError, r"'state'.*dtype <U1"),
        (dict(reward=[None] * G), TypeError, r"'reward'.*dtype object"),
        (dict(reward=torch.zeros(G), bogus=torch.zeros(G)), UnknownFieldError, r"'bogus'"),
        (dict(reward=torch.zeros(G), state=torch.zeros(G)), ValueError, r"'state'"),
    ],
)
def test_bad_append_raises_and_changes_nothing(tmp_path, values, error, message):
    _, ours = collectors(tmp_path)
    ours.append(reward=torch.full((G,), 7.0), task=1)
    with pytest.raises(error, match=message):
        ours.append(**values)
    assert len(ours) == 1
    assert ours.all_data().keys() == {"reward"}
    assert ours.env_major("reward").tolist() == [[7.0]] * G
    assert ours.time_major("task").tolist() == [1] * G


def test_unknown_fields_are_value_and_key_errors(tmp_path):
    _, ours = collectors(tmp_path)
    for caught in (ValueError, KeyError):
        with pytest.raises(caught):
            ours.append(bogus=torch.zeros(G))
    with pytest.raises(UnknownFieldError, match="'bogus'") as info:
        ours.append(bogus=torch.zeros(G))
    assert str(info.value).startswith("unknown field 'bogus'")


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        (dict(returns=[[1.0] * G] * 2), TypeError, r"'returns'.*tensor / ndarray"),
        (dict(returns=torch.zeros(2, G + 1)), ValueError, r"'returns'.*\(2, 4\)"),
        (dict(returns=torch.zeros(2)), ValueError, r"'returns'.*\(2,\)"),
        (dict(returns=torch.zeros(0, G)), ValueError, r"'returns'.*time >= 1"),
        (dict(returns=torch.zeros(3, G)), ValueError, r"'returns'.*time dim 3 does not match the rollout's 2 steps"),
        (dict(state=torch.zeros(2, G, 3)), ValueError, r"'state'.*feature shape \(3,\) does not match \(2, 3\)"),
        (dict(returns=torch.zeros(2, G), goal=torch.zeros(2, G)), ValueError, r"'goal'"),
        (dict(returns=np.zeros((2, G), dtype=object)), TypeError, r"'returns'.*dtype object"),
    ],
)
def test_bad_extend_raises_and_changes_nothing(tmp_path, values, error, message):
    _, ours = collectors(tmp_path)
    for _ in range(2):
        ours.append(reward=torch.ones(G))
    with pytest.raises(error, match=message):
        ours.extend(**values)
    assert len(ours) == 2 and list(ours.all_data()) == ["reward"]


def test_extend_checks_every_field_against_the_first(tmp_path):
    _, ours = collectors(tmp_path)
    with pytest.raises(ValueError, match=r"'reward'.*time dim 2 does not match the rollout's 3 steps"):
        ours.extend(returns=torch.zeros(3, G), reward=torch.zeros(2, G))
    assert len(ours) == 0


def assert_store_rejected(collector, buffer, error, message, **meta):
    before, steps = snapshot(buffer), len(collector)
    with pytest.raises(error, match=message):
        collector.store(**meta)
    after = snapshot(buffer)
    assert after["num_episodes"] == before["num_episodes"] and after["size"] == before["size"]
    assert after["data"].keys() == before["data"].keys()
    for name in before["data"]:
        assert torch.equal(after["data"][name], before["data"][name]), name
    assert len(collector) == steps  # the rollout is kept, so the caller can fix and retry


def test_store_rejects_an_empty_collector(tmp_path):
    _, ours = collectors(tmp_path)
    assert_store_rejected(ours, ours.replay_buffer, ValueError, "no data field")
    ours.append(task=3)
    assert_store_rejected(ours, ours.replay_buffer, ValueError, "no data field")


def test_store_rejects_fields_of_different_lengths(tmp_path):
    _, ours = collectors(tmp_path)
    for t in range(3):
        ours.append(reward=torch.ones(G), **({"done": torch.zeros(G, dtype=torch.bool)} if t else {}))
    assert_store_rejected(ours, ours.replay_buffer, ValueError, r"'reward': 3, 'done': 2")


def test_store_rejects_a_rollout_longer_than_max_timesteps(tmp_path):
    _, ours = collectors(tmp_path)
    ours.extend(reward=torch.ones(2, G))
    ours.store()
    ours.extend(reward=torch.ones(CONFIG["max_timesteps"] + 1, G))
    assert_store_rejected(ours, ours.replay_buffer, ValueError, r"13 steps.*max_timesteps \(12\)")


def test_store_rejects_bad_meta(tmp_path):
    _, ours = collectors(tmp_path)
    ours.extend(reward=torch.ones(2, G))
    assert_store_rejected(ours, ours.replay_buffer, UnknownFieldError, "'tsk'", tsk=1)
    assert_store_rejected(ours, ours.replay_buffer, ValueError, r"'goal'.*\(3,\)", goal=torch.zeros(3))
    assert_store_rejected(ours, ours.replay_buffer, ValueError, r"'goal'.*\(2, 2\)", goal=torch.zeros(2, 2))


def test_store_into_a_full_buffer_writes_nothing(tmp_path):
    _, buffer = make_pair(tmp_path, max_episodes=4, circular=False)
    collector = EpisodeCollector(buffer, G)
    collector.extend(reward=torch.ones(2, G))
    collector.store(task=1)
    collector.extend(reward=torch.full((3, G), 2.0))
    assert_store_rejected(collector, buffer, ValueError, "full")
    assert buffer.num_episodes == G


def test_reading_a_field_that_was_not_collected(tmp_path):
    _, ours = collectors(tmp_path)
    ours.append(reward=torch.ones(G))
    for method in (ours.time_major, ours.env_major, ours.groups):
        with pytest.raises(UnknownFieldError, match=r"'state' has not been collected.*\['reward'\]"):
            method("state")
    with pytest.raises(UnknownFieldError, match="'state'"):
        ours.all_data(fields=("state",))


def test_bad_dataloader_arguments(tmp_path):
    _, ours = collectors(tmp_path)
    with pytest.raises(ValueError, match="empty"):
        ours.dataloader(2)
    for step in rollout_steps("torch", steps=2):
        ours.append(**step)
    with pytest.raises(ValueError, match=r"'state' has per-step shape \(2, 3\)"):
        ours.dataloader(2, filter_fields=dict(state=0.0))
    with pytest.raises(ValueError, match=r"'task' is not a collected field"):
        ours.dataloader(2, filter_fields=dict(task=1))
    with pytest.raises(ValueError, match=r"fields: \['returns'\] not collected"):
        ours.dataloader(2, fields=("returns",))
    with pytest.raises(ValueError, match=r"to_named_tuple: fields \['_mask'\] not found"):
        ours.dataloader(2, to_named_tuple=("state", "_mask"))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_groups=0), ValueError, "num_groups must be a positive int, got 0"),
        (dict(num_groups="4"), ValueError, "num_groups must be a positive int, got '4'"),
        (dict(num_groups=True), ValueError, "num_groups"),
        (dict(num_groups=2, fieldnames=("reward", "rewards")), ValueError, r"fieldnames: unknown fields \['rewards'\]"),
        (dict(num_groups=2, fieldnames="reward"), TypeError, "fieldnames must be a tuple of field names"),
        (dict(num_groups=2, meta_fieldnames=("reward",)), ValueError, r"meta_fieldnames: unknown fields \['reward'\]"),
    ],
)
def test_bad_constructor_arguments(tmp_path, kwargs, error, message):
    _, buffer = make_pair(tmp_path)
    with pytest.raises(error, match=message):
        EpisodeCollector(buffer, **kwargs)
