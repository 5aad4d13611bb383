"""The write API and bookkeeping of ReplayBuffer, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer

FIELDS = dict(state=("float", (3, 4, 4), 0.0), action=("int", 2), reward="float", done=("bool", (), False))
META = dict(task_id="int")


def make(make_location, **kwargs):
    location, extra = make_location()
    args = dict(max_episodes=6, max_timesteps=12, fields=FIELDS, meta_fields=META)
    args.update(kwargs)
    return ReplayBuffer(location, **args, **extra), location, extra


def fill_episode(buffer, steps, task, seed=0):
    rng = np.random.default_rng(seed)
    states = rng.normal(size=(steps, 3, 4, 4)).astype(np.float32)
    with buffer.one_episode(task_id=task):
        for t in range(steps):
            buffer.store(state=states[t], action=np.array([t, task]), reward=float(t))
    return states


def snapshot(buffer):
    """Everything a reader can see, for 'unchanged' checks."""
    reopened = ReplayBuffer.from_folder(buffer.storage.location, read_only=True, backend=buffer.storage.backend_name)
    data = {k: v.numpy().copy() for k, v in reopened.get_all_data().items()}
    return reopened.num_episodes, reopened.episode_lens.copy(), data


def assert_same_snapshot(a, b):
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for key in a[2]:
        np.testing.assert_array_equal(a[2][key], b[2][key])


def test_store_and_rehydrate(make_location):
    buffer, location, extra = make(make_location)
    states = fill_episode(buffer, 5, task=2)
    fill_episode(buffer, 7, task=3, seed=1)
    assert buffer.num_episodes == 2 and len(buffer) == 2
    assert buffer.episode_lens[:3].tolist() == [5, 7, 0]
    buffer.close()  # one writer at a time

    again = ReplayBuffer.from_folder(location, **({"backend": extra["backend"]} if extra else {}))
    assert again.num_episodes == 2
    np.testing.assert_allclose(again.data["state"][0, :5], states)
    assert again.data["action"][1, 6].tolist() == [6, 3]
    assert again.meta_data["task_id"][:2].tolist() == [2, 3]
    assert again.meta_data["episode_lens"][:2].tolist() == [5, 7]
    assert again.fieldnames == set(FIELDS)
    assert again.shapes["state"] == (3, 4, 4) and again.dtypes["action"] == np.int32


def test_store_fills_defaults_and_returns_namedtuple(make_location):
    buffer, *_ = make(make_location)
    with buffer.one_episode():
        memory = buffer.store(action=[1, 2])
    assert memory.action == [1, 2]  # as given, as the seed returns it
    assert memory.reward == 0 and memory.done == np.False_
    assert memory._fields == tuple(FIELDS)
    assert buffer.data["state"][0, 0].tolist() == np.zeros((3, 4, 4)).tolist()


def test_field_default_value_is_used(make_location):
    location, extra = make_location()
    buffer = ReplayBuffer(location, 2, 4, fields=dict(x=("float", 3, 1.5), y="int"), **extra)
    with buffer.one_episode():
        buffer.store(y=1)
    assert buffer.data["x"][0, 0].tolist() == [1.5, 1.5, 1.5]


def test_one_episode_yields_final_meta(make_location):
    buffer, *_ = make(make_location)
    with buffer.one_episode(task_id=1) as final:
        buffer.store(reward=1.0)
        final["task_id"] = 9
    assert buffer.meta_data["task_id"][0] == 9


def test_exception_in_one_episode_rolls_back(make_location):
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    before = snapshot(buffer)
    with pytest.raises(RuntimeError, match="boom"):
        with buffer.one_episode(task_id=4):
            buffer.store(reward=1.0)
            raise RuntimeError("boom")
    assert_same_snapshot(before, snapshot(buffer))
    assert buffer.timestep_index == 0
    fill_episode(buffer, 2, task=5)
    assert buffer.episode_lens[:2].tolist() == [3, 2]


def test_store_episode_accepts_seed_shapes(make_location):
    buffer, *_ = make(make_location)
    buffer.store_episode(
        state=torch.randn(10, 3, 4, 4),
        action=torch.randint(0, 4, (10, 2)),
        reward=torch.randn(10, 1),
        task_id=torch.tensor([1]),
    )
    buffer.store_episode(state=np.ones((4, 3, 4, 4)), reward=np.arange(4.0), task_id=2)
    assert buffer.episode_lens[:2].tolist() == [10, 4]
    assert buffer.meta_data["task_id"][:2].tolist() == [1, 2]
    assert buffer.data["reward"][1, :4].tolist() == [0, 1, 2, 3]
    assert buffer.data["reward"][1, 4:].tolist() == [0] * 8


def test_batched_episode_and_store_batch(make_location):
    buffer, *_ = make(make_location)
    with buffer.batched_episode(batch_size=3, task_id=[0, 1, 2]):
        for t in range(4):
            buffer.store_batch(state=torch.full((3, 3, 4, 4), float(t)), action=torch.tensor([[t, 0]] * 3))
    assert buffer.num_episodes == 3
    assert buffer.episode_lens[:3].tolist() == [4, 4, 4]
    assert buffer.meta_data["task_id"][:3].tolist() == [0, 1, 2]
    assert buffer.data["state"][2, 3, 0, 0, 0] == 3.0
    with buffer.batched_episode(batch_size=2):
        buffer.store_meta_batch(task_id=np.array([7, 8]))
        buffer.store_batch(reward=np.array([1.0, 2.0]))
    assert buffer.meta_data["task_id"][3:5].tolist() == [7, 8]
    assert buffer.data["reward"][4, 0] == 2.0
    # scalars only, at the group's first step too (refused there: "need a leading batch dimension")
    with buffer.batched_episode(batch_size=1):
        buffer.store_batch(reward=1.5, done=True)
        buffer.store_batch(reward=np.float32(2.5))
    assert buffer.data["reward"][5, :2].tolist() == [1.5, 2.5] and buffer.data["done"][5, :2].tolist() == [True, False]


def test_store_datapoint_and_meta_datapoint(make_location):
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    buffer.store_datapoint(0, 1, "reward", 42.0)
    buffer.store_meta_datapoint(0, "task_id", 5)
    assert buffer.data["reward"][0, 1] == 42.0
    assert buffer.meta_data["task_id"][0] == 5
    with pytest.raises(ValueError, match="out of range"):
        buffer.store_datapoint(6, 0, "reward", 1.0)
    with pytest.raises(ValueError, match="timestep_index"):
        buffer.store_datapoint(0, 12, "reward", 1.0)
    with pytest.raises(ValueError, match="nope"):
        buffer.store_datapoint(0, 0, "nope", 1.0)


def test_update_variants(make_location):
    buffer, *_ = make(make_location)
    for task in range(3):
        fill_episode(buffer, 4, task=task)
    buffer.update(reward=torch.ones(3, 4))
    assert buffer.data["reward"][:3, :4].sum() == 12
    buffer.update([0, 2], reward=torch.full((2, 4), 2.0))
    assert buffer.data["reward"][[0, 1, 2], 0].tolist() == [2, 1, 2]
    buffer.update(1, reward=torch.full((4,), 3.0))
    assert buffer.data["reward"][1, :4].tolist() == [3] * 4
    buffer.update(slice(0, 2), task_id=7)
    assert buffer.meta_data["task_id"][:3].tolist() == [7, 7, 2]
    buffer.update(np.array([2]), reward=5.0)
    assert buffer.data["reward"][2, 0] == 5.0
    buffer.update(None, action=np.array([[[1, 1]]]))
    assert buffer.data["action"][2, 0].tolist() == [1, 1]
    buffer.update(None, action=4)  # a scalar is one timestep, broadcast over the feature shape, as the seed
    assert buffer.data["action"][:3, 0].tolist() == [[4, 4]] * 3 and buffer.data["action"][0, 1].tolist() != [4, 4]
    buffer.update(0, action=np.array([[6]]))  # (episodes, time, 1) broadcasts to (2,)
    assert buffer.data["action"][0, 0].tolist() == [6, 6]


def test_update_rejects_bad_values_before_writing(make_location):
    buffer, *_ = make(make_location)
    fill_episode(buffer, 4, task=1)
    before = snapshot(buffer)
    with pytest.raises(ValueError, match="'action'"):
        buffer.update(reward=np.zeros((1, 4)), action=np.zeros((1, 4, 3)))
    with pytest.raises(ValueError, match="max_timesteps"):
        buffer.update(reward=np.zeros((1, 13)))
    with pytest.raises(ValueError, match="out of range"):
        buffer.update([9], reward=np.zeros((1, 4)))
    with pytest.raises(ValueError, match="'bogus'"):
        buffer.update(bogus=1)
    assert_same_snapshot(before, snapshot(buffer))


def test_clear(make_location):
    buffer, location, extra = make(make_location)
    fill_episode(buffer, 3, task=1)
    buffer.clear()
    assert buffer.num_episodes == 0 and len(buffer) == 0
    assert ReplayBuffer.from_folder(location, read_only=True, **extra).num_episodes == 0
    fill_episode(buffer, 2, task=1)
    assert buffer.episode_lens[0] == 2


def test_circular_overwrites_oldest(make_location):
    buffer, *_ = make(make_location, circular=True, max_episodes=3)
    for task in range(5):
        fill_episode(buffer, 2 + task, task=task)
    assert buffer.num_episodes == 3 and len(buffer) == 3
    assert buffer.meta_data["task_id"][:].tolist() == [3, 4, 2]
    assert buffer.episode_lens.tolist() == [5, 6, 4]
    assert buffer.valid_episodes().tolist() == [2, 0, 1]
    data = buffer.get_all_data()
    assert data["task_id"].tolist() == [3, 4, 2], "slot order, as the seed"
    assert data["reward"].shape == (3, 6)
    assert data["reward"][2].tolist() == [0, 1, 2, 3, 0, 0]


def test_circular_reuse_clears_longer_previous_episode(make_location):
    buffer, *_ = make(make_location, circular=True, max_episodes=1)
    fill_episode(buffer, 10, task=1)
    fill_episode(buffer, 2, task=2)
    assert buffer.episode_lens[0] == 2
    assert not buffer.data["reward"][0, 2:].any()
    assert not buffer.data["action"][0, 2:].any()


def test_full_buffer_rejects_and_keeps_everything(make_location):
    buffer, *_ = make(make_location, max_episodes=2)
    fill_episode(buffer, 3, task=1)
    fill_episode(buffer, 3, task=2)
    before = snapshot(buffer)
    with pytest.raises(ValueError, match="full"):
        fill_episode(buffer, 3, task=3)
    with pytest.raises(ValueError, match="full"):
        buffer.store_episode(reward=np.ones(3))
    with pytest.raises(ValueError, match="full"):
        with buffer.batched_episode(2):
            pass
    assert_same_snapshot(before, snapshot(buffer))


def test_reopen_with_other_config_lists_every_difference(make_location):
    buffer, location, extra = make(make_location)
    fill_episode(buffer, 3, task=1)
    buffer.close()  # one writer at a time
    with pytest.raises(ValueError) as info:
        ReplayBuffer(
            location, 7, 12, fields=dict(FIELDS, reward=("float", 2)), meta_fields=META, overwrite=False, **extra
        )
    message = str(info.value)
    assert "max_episodes: stored 6 vs passed 7" in message
    assert "fields.reward" in message
    with ReplayBuffer.from_folder(location, **extra) as again:
        assert again.num_episodes == 1
    same = ReplayBuffer(location, 6, 12, fields=FIELDS, meta_fields=META, overwrite=False, **extra)
    assert same.num_episodes == 1


def test_missing_buffer_names_the_path(make_location):
    location, extra = make_location()
    with pytest.raises(FileNotFoundError, match="no replaybuf buffer"):
        ReplayBuffer.from_folder(location, **extra)
    with pytest.raises(FileNotFoundError, match="read-only"):
        ReplayBuffer(location, 2, 2, fields=dict(x="float"), read_only=True, **extra)


def test_read_only_refuses_writes(make_location):
    buffer, location, extra = make(make_location)
    fill_episode(buffer, 3, task=1)
    reader = ReplayBuffer.from_folder(location, read_only=True, **extra)
    for call in (
        lambda: reader.store(reward=1.0),
        lambda: reader.store_episode(reward=np.ones(2)),
        lambda: reader.update(reward=np.ones((1, 2))),
        reader.clear,
        lambda: reader.store_datapoint(0, 0, "reward", 1.0),
    ):
        with pytest.raises(ValueError, match="read-only"):
            call()
    with pytest.raises(ValueError, match="read-only"):
        with reader.one_episode():
            pass
    assert reader.num_episodes == 1


def test_read_only_creates_nothing_on_disk(tmp_path):
    location = tmp_path / "buf"
    ReplayBuffer(str(location), 3, 5, fields=dict(x="float")).store_episode(x=np.ones(3))
    before = {p: p.stat().st_mtime_ns for p in location.rglob("*")}
    reader = ReplayBuffer.from_folder(str(location), read_only=True)
    reader.get_all_data()
    reader.refresh()
    del reader
    after = {p: p.stat().st_mtime_ns for p in location.rglob("*")}
    assert before == after
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError):
        ReplayBuffer.from_folder(str(missing), read_only=True)
    assert not missing.exists()


def test_get_all_data_subsets_and_device(make_location):
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    fill_episode(buffer, 5, task=2)
    data = buffer.get_all_data(fields=("reward",), meta_fields=("task_id",), device="cpu")
    assert set(data) == {"reward", "task_id"}
    assert data["reward"].shape == (2, 5) and data["reward"].dtype == torch.float32
    assert data["reward"][0].tolist() == [0, 1, 2, 0, 0]
    full = buffer.get_all_data()
    assert set(full) == set(FIELDS) | {"task_id", "episode_lens"}
    with pytest.raises(ValueError, match="bogus"):
        buffer.get_all_data(fields=("bogus",))


def test_empty_buffer_get_all_data(make_location):
    buffer, *_ = make(make_location)
    assert buffer.get_all_data() == {}


def test_max_timesteps_is_enforced(make_location):
    buffer, *_ = make(make_location, max_timesteps=3)
    with pytest.raises(ValueError, match="max_timesteps"):
        with buffer.one_episode():
            for _ in range(4):
                buffer.store(reward=1.0)
    with pytest.raises(ValueError, match="max_timesteps"):
        buffer.store_episode(reward=np.ones(4))
    assert buffer.num_episodes == 0


def test_advance_episode_commits_implicit_episode(make_location):
    buffer, *_ = make(make_location)
    buffer.store(reward=1.0)
    buffer.store(reward=2.0)
    assert buffer.timestep_index == 2 and buffer.num_episodes == 0
    buffer.advance_episode()
    assert buffer.num_episodes == 1 and buffer.episode_lens[0] == 2


def test_long_episodes_cross_chunk_and_span_boundaries(make_location):
    location, extra = make_location()
    fields = dict(
        frame=("uint8", (64, 64, 3)),
        x=(
            "float",
            (),
            0.0,
        ),
        y={"dtype": "float16", "shape": 2, "chunks": 3},
    )
    buffer = ReplayBuffer(location, 3, 400, fields=fields, **extra)
    frames = np.random.default_rng(0).integers(0, 255, (300, 64, 64, 3), dtype=np.uint8)
    with buffer.one_episode():
        for t in range(300):
            buffer.store(frame=frames[t], x=t, y=[t, -t])
    np.testing.assert_array_equal(buffer.data["frame"][0, :300], frames)
    assert buffer.data["x"][0, :300].tolist() == list(range(300))
    assert buffer.data["y"][0, 299].tolist() == [299, -299]
    assert buffer.dtypes["y"] == np.float16


@pytest.mark.parametrize("flush", [0, 1, 5])
def test_flush_settings_store_the_same(make_location, flush):
    buffer, location, extra = make(make_location, flush_every_store_step=flush)
    states = fill_episode(buffer, 9, task=1)
    buffer.close()
    again = ReplayBuffer.from_folder(location, **extra)
    np.testing.assert_allclose(again.data["state"][0, :9], states)


def test_collector_style_numpy_scalars_and_tensors(make_location):
    buffer, *_ = make(make_location)
    with buffer.one_episode(task_id=np.int64(3)):
        buffer.store(
            state=torch.zeros(3, 4, 4), action=torch.tensor([1, 2]), reward=torch.tensor(0.5), done=torch.tensor(True)
        )
    assert buffer.data["done"][0, 0] == np.True_
    assert buffer.data["reward"][0, 0] == 0.5


def test_tensors_of_floats_numpy_lacks_are_stored_as_their_values(tmp_path):
    """bfloat16 and float8 tensors (a policy's outputs) go through every write as the float32
    values they hold; numpy has no such dtype."""
    buffer = ReplayBuffer(tmp_path / "b", 6, 4, fields=dict(x=("float", 2), a="int"), meta_fields=dict(m="float"))
    half = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    buffer.store(x=half, a=torch.tensor(3.75, dtype=torch.bfloat16))
    buffer.advance_episode()
    buffer.store_episode(x=half.expand(2, 2), m=torch.tensor(0.5, dtype=torch.float8_e4m3fn))
    buffer.store_batch(x=half.expand(2, 2))
    buffer.advance_episode(2)
    collector = buffer.create_collector(2)
    collector.append(x=half.expand(2, 2), m=torch.tensor([1, 2], dtype=torch.bfloat16))
    collector.store()
    buffer.update([1], m=torch.tensor([4.0], dtype=torch.bfloat16))
    data = buffer.get_all_data()
    assert data["episode_lens"].tolist() == [1, 2, 1, 1, 1, 1]
    assert (data["x"][:, 0] == torch.tensor([1.5, -2.25])).all()
    assert data["a"][0, 0] == 3 and data["m"].tolist() == [0, 4, 0, 0, 1, 2]


def test_a_tensor_numpy_cannot_take_is_refused_naming_the_field(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", 2, 4, fields=dict(x=("float", 2)))
    with pytest.raises(TypeError, match="field 'x': cannot turn a tensor of dtype torch.float32 into an array"):
        buffer.store(x=torch.tensor([1.0, 0.0]).to_sparse())
    assert buffer.timestep_index == 0


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_arrays_given_to_store_episode_are_not_kept(tmp_path, backend):
    """A whole span of a stored episode is written from the caller's array without a copy:
    changing that array afterwards changes nothing stored, for episodes of any length."""
    fields = {"frame": ("uint8", (4, 4, 3)), "x": "float"}
    buffer = ReplayBuffer(tmp_path / "b", 4, 6, fields=fields, backend=backend)
    frames, xs = np.full((6, 4, 4, 3), 7, np.uint8), np.arange(6, dtype=np.float32)
    buffer.store_episode(frame=frames, x=xs)
    buffer.store_episode(frame=frames[:3], x=xs[:3])
    frames[:] = 0
    xs[:] = -1
    buffer.store_episode(frame=frames[:2] + 1, x=xs[:2])
    data = buffer.get_all_data()
    assert (data["frame"][0] == 7).all() and data["x"][0].tolist() == list(range(6))
    assert (data["frame"][1, :3] == 7).all() and (data["frame"][1, 3:] == 0).all()
    assert (data["frame"][2, :2] == 1).all() and data["x"][2, :2].tolist() == [-1, -1]


def test_refresh_of_a_writer_keeps_its_last_episodes_counted(tmp_path):
    # the counters of episodes stored in a burst are written a moment later: a refresh of the
    # writer must not go back to the counters before them (its next episode would overwrite one)
    writer = ReplayBuffer(tmp_path / "b", 10, 5, fields={"x": "float"}, meta_fields={"uid": "int"})
    for uid in range(3):
        writer.store_episode(x=np.ones(2), uid=uid)
    writer.refresh()
    assert writer.num_episodes == 3 and writer.episode_index == 3
    writer.store_episode(x=np.ones(2), uid=3)
    writer.close()
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    assert reader.meta_data["uid"][reader.valid_episodes()].tolist() == [0, 1, 2, 3]


def test_edits_of_the_episode_in_progress_are_committed_with_it(make_location):
    # as in the seed, where store() writes each step in place: a relabel before the commit stays
    buffer, *_ = make(make_location)
    fill_episode(buffer, 2, task=1)
    buffer.store(reward=1.0)
    buffer.store(reward=2.0)
    slot = buffer.episode_index
    assert buffer.data["reward"][slot, :3].tolist() == [1.0, 2.0, 0.0]  # the writer sees its steps
    buffer.data["reward"][slot, 0] = 10.0
    buffer.update([slot], action=np.array([[[3, 4], [5, 6]]]), task_id=7)
    buffer.data["action"][slot, 1, 0] = 9  # the other values of the step stay
    buffer.store(reward=3.0)
    buffer.advance_episode()
    assert buffer.data["reward"][slot, :3].tolist() == [10.0, 2.0, 3.0]
    assert buffer.data["action"][slot, :3].tolist() == [[3, 4], [9, 6], [0, 0]]
    assert buffer.meta_data["task_id"][slot] == 7
    assert buffer.data["reward"][0, :2].tolist() == [0.0, 1.0]  # the committed episode is untouched


def test_rows_edited_past_an_episode_end_do_not_show_under_the_next_episode(make_location):
    # an edit may write past a slot's committed end (the seed's padded update arrays): those rows
    # are zeroed when the slot's next, shorter episode commits, on every backend
    buffer, *_ = make(make_location, max_episodes=2, circular=True)
    fill_episode(buffer, 3, task=1)
    buffer.update([0], reward=np.full((1, 6), 7.0))  # past the end of episode 0
    buffer.update([1], reward=np.full((1, 6), 6.0))  # an empty slot
    fill_episode(buffer, 2, task=2)  # slot 1
    fill_episode(buffer, 2, task=3)  # slot 0 reused
    reader = ReplayBuffer.from_folder(buffer.storage.location, read_only=True, backend=buffer.storage.backend_name)
    assert reader.data["reward"][:, :6].tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]] * 2


def test_the_writer_reads_its_episode_in_progress_alone_in_a_reused_slot(make_location):
    # past its steps, the view showed the rows of the episode the slot still holds (committed
    # until this one commits): one read of two episodes
    buffer, _, _ = make(make_location, max_episodes=2, circular=True)
    for task in (1, 2):
        fill_episode(buffer, 7, task=task)
    with buffer.one_episode(task_id=5):  # no step yet: the slot shows its committed episode
        assert buffer.data["reward"][0, :3].tolist() == [0.0, 1.0, 2.0]
    buffer.store(action=np.array([9, 9]), reward=9.0, done=True)
    assert buffer.data["reward"][0, :7].tolist() == [9.0] + [0.0] * 6
    assert buffer.data["action"][0, :3].tolist() == [[9, 9], [0, 0], [0, 0]]
    assert buffer.data["done"][0].tolist() == [True] + [False] * 11
    assert buffer.episode_lens[0] == 7 and buffer.meta_data["task_id"][0] == 1  # committed: still there
    buffer.advance_episode()
    assert buffer.data["reward"][0, :3].tolist() == [9.0, 0.0, 0.0] and buffer.episode_lens[0] == 1
