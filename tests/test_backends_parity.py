"""The same behaviour on every backend: zarr on disk, zarr in memory://, memmap and hdf5."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.maintenance import verify
from replaybuf.storage import detect_backend

from ._backends import LOCAL_BACKENDS, make_place, snapshot
from ._data import FIELDS, META_FIELDS, episode

REPO = Path(__file__).resolve().parents[1]


def new_buffer(place, max_episodes=6, max_timesteps=12, circular=False, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(
        place.location,
        max_episodes,
        max_timesteps,
        fields=FIELDS,
        meta_fields=META_FIELDS,
        circular=circular,
        **place.kwargs,
        **kwargs,
    )


def fill(buffer: ReplayBuffer, lengths, seed0=0) -> list[dict]:
    """Store one episode per length, alternating store() and store_episode(); return their data."""
    stored = []
    for i, length in enumerate(lengths):
        data = episode(length, seed0 + i)
        if i % 2 == 0:
            with buffer.one_episode(task_id=seed0 + i):
                for t in range(length):
                    buffer.store(**{k: v[t] for k, v in data.items()})
        else:
            buffer.store_episode(**data, task_id=seed0 + i)
        stored.append({**data, "task_id": seed0 + i})
    return stored


def assert_holds(buffer: ReplayBuffer, stored: list[dict]) -> None:
    """The buffer's committed episodes, oldest first, are exactly ``stored``."""
    slots = buffer.valid_episodes()
    assert len(slots) == len(stored)
    for slot, expected in zip(slots, stored):
        length = len(expected["reward"])
        assert buffer.episode_lens[slot] == length
        for name in FIELDS:
            np.testing.assert_array_equal(buffer.data[name][int(slot), :length], expected[name])
        assert buffer.meta_data["task_id"][int(slot)] == expected["task_id"]


def test_write_then_read_back(place):
    buffer = new_buffer(place)
    stored = fill(buffer, [5, 7, 3])
    assert buffer.num_episodes == 3 and len(buffer) == 3
    assert_holds(buffer, stored)
    everything = buffer.get_all_data()
    assert everything["state"].shape == (3, 7, 3, 4, 4)
    np.testing.assert_array_equal(everything["reward"][2, :3].numpy(), stored[2]["reward"])
    assert (everything["reward"][2, 3:] == 0).all()
    np.testing.assert_array_equal(everything["task_id"].numpy(), [0, 1, 2])

    reopened = ReplayBuffer.from_folder(place.location, read_only=True)
    assert reopened.storage.backend_name == place.backend
    assert_holds(reopened, stored)


def test_detects_its_backend(place):
    new_buffer(place).store_episode(**episode(2, 0))
    assert detect_backend(place.location) == place.backend


def test_batched_episodes(place):
    buffer = new_buffer(place)
    data = [episode(4, s) for s in range(3)]
    with buffer.batched_episode(3, task_id=[7, 8, 9]):
        for t in range(4):
            buffer.store_batch(**{k: np.stack([d[k][t] for d in data]) for k in FIELDS})
    assert_holds(buffer, [{**d, "task_id": 7 + i} for i, d in enumerate(data)])


def test_gather_and_read_rows_match_numpy(place):
    buffer = new_buffer(place)
    stored = fill(buffer, [5, 7, 3, 6])
    dense = {
        n: np.stack([np.pad(s[n], [(0, 12 - len(s[n]))] + [(0, 0)] * (s[n].ndim - 1)) for s in stored]) for n in FIELDS
    }
    episodes = np.array([3, 0, 1, 1, 3, 2, 0])
    timesteps = np.array([5, 0, 6, 6, 1, 2, 4])
    for name in FIELDS:
        np.testing.assert_array_equal(
            buffer.storage.gather(name, episodes, timesteps), dense[name][episodes, timesteps]
        )
        np.testing.assert_array_equal(
            buffer.storage.read_rows(name, np.array([2, 0, 2]), 1, 5), dense[name][[2, 0, 2], 1:5]
        )


def test_update_in_place(place):
    buffer = new_buffer(place)
    fill(buffer, [5, 7, 3])
    buffer.update([2, 0], reward=np.full((2, 3), 9.0))
    buffer.update(1, task_id=42)
    buffer.update(reward=torch.zeros(3, 1))
    assert (buffer.data["reward"][[0, 1, 2], :1] == 0).all()
    np.testing.assert_array_equal(buffer.data["reward"][0, 1:3], [9.0, 9.0])
    assert buffer.meta_data["task_id"][1] == 42
    reopened = ReplayBuffer.from_folder(place.location, read_only=True)
    np.testing.assert_array_equal(reopened.data["reward"][2, 1:3], [9.0, 9.0])
    assert reopened.meta_data["task_id"][1] == 42


def test_circular_reuses_oldest_slots(place):
    buffer = new_buffer(place, max_episodes=3, circular=True)
    stored = fill(buffer, [8, 7, 9, 2, 4])
    assert buffer.num_episodes == 3
    assert buffer.valid_episodes().tolist() == [2, 0, 1]
    assert_holds(buffer, stored[2:])
    # the short episode reusing slot 0 must not expose the old episode's steps (get_all_data
    # returns slots in order, as the seed does)
    assert (buffer.get_all_data()["state"][0, 2:] == 0).all()
    assert (np.asarray(buffer.data["state"][0, 2:]) == 0).all()
    assert verify(place.location) == []


def test_full_non_circular_buffer_refuses_and_changes_nothing(place):
    buffer = new_buffer(place, max_episodes=2)
    fill(buffer, [3, 3])
    before = snapshot(place.location)
    with pytest.raises(ValueError, match="full"):
        buffer.store_episode(**episode(3, 9))
    with pytest.raises(ValueError, match="full"):
        with buffer.one_episode():
            buffer.store(reward=1.0)
    assert buffer.num_episodes == 2
    assert snapshot(place.location) == before


def test_reopen_for_writing_continues(place):
    stored = fill(new_buffer(place), [3, 4])
    again = ReplayBuffer(place.location, 6, 12, fields=FIELDS, meta_fields=META_FIELDS, overwrite=False, **place.kwargs)
    stored += fill(again, [5], seed0=2)
    assert again.episode_index == 3
    assert_holds(ReplayBuffer.from_folder(place.location, read_only=True), stored)


def test_mismatched_config_lists_the_differences_and_touches_nothing(place):
    """The config is checked before the writer lease is taken: a refused reopen changes no
    file, no folder and no modification time (the lease file is not even created)."""
    with new_buffer(place) as buffer:
        buffer.store_episode(**episode(2, 0))
    before = snapshot(place.location)
    with pytest.raises(ValueError, match=r"max_episodes: stored 6 vs passed 7(.|\n)*fields.reward"):
        ReplayBuffer(
            place.location,
            7,
            12,
            fields={**FIELDS, "reward": "int"},
            meta_fields=META_FIELDS,
            overwrite=False,
            **place.kwargs,
        )
    assert snapshot(place.location) == before


def test_clear_erases_episodes(place):
    buffer = new_buffer(place)
    fill(buffer, [3, 4])
    buffer.clear()
    assert len(buffer) == 0 and buffer.num_episodes == 0
    assert len(ReplayBuffer.from_folder(place.location, read_only=True)) == 0
    stored = fill(buffer, [2], seed0=5)
    assert_holds(buffer, stored)


def test_read_only_writes_nothing(place):
    buffer = new_buffer(place)
    fill(buffer, [3, 5])
    buffer.close()
    before = snapshot(place.location)
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    reader.get_all_data()
    reader.storage.gather("state", np.array([0, 1]), np.array([2, 4]))
    reader.refresh()
    for method, args, kwargs in (
        ("store_episode", (), episode(2, 0)),
        ("update", (0,), {"task_id": 3}),
        ("clear", (), {}),
        ("store", (), {"reward": 1.0}),
    ):
        with pytest.raises(ValueError, match="read-only"):
            getattr(reader, method)(*args, **kwargs)
    reader.close()
    del reader
    assert snapshot(place.location) == before


def test_read_only_arrays_refuse_writes(place):
    with new_buffer(place) as writer:  # closed: an unclosed writer's files change when it is collected
        fill(writer, [3])
    before = snapshot(place.location)
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    with pytest.raises((PermissionError, ValueError)):
        reader.data["reward"][0, 0] = 5.0
    reader.close()
    assert snapshot(place.location) == before


def test_read_only_on_a_missing_buffer_creates_nothing(place):
    with pytest.raises(FileNotFoundError):
        ReplayBuffer(place.location, read_only=True, overwrite=False, **place.kwargs)
    assert snapshot(place.location) == {}
    if place.on_disk:
        assert not os.path.exists(place.location)


def test_bad_input_is_refused_before_anything_is_written(place):
    buffer = new_buffer(place)
    fill(buffer, [3])
    before = snapshot(place.location)
    with pytest.raises(ValueError, match="state"):
        buffer.store_episode(state=np.zeros((4, 3, 5, 5)), reward=np.zeros(4))
    with pytest.raises(ValueError, match="reward"):
        buffer.store_episode(state=np.zeros((4, 3, 4, 4)), reward=np.zeros(5))
    with pytest.raises(ValueError, match="nope"):
        buffer.store_episode(nope=np.zeros(3))
    with pytest.raises((TypeError, ValueError), match="reward"):
        buffer.update(0, reward=np.array(["a", "b"]))
    with pytest.raises(ValueError, match="out of range"):
        buffer.update([99], reward=np.zeros((1, 2)))
    assert snapshot(place.location) == before
    assert buffer.num_episodes == 1


def test_abandoned_writer_is_recovered_from_the_step_log(place):
    buffer = new_buffer(place)
    stored = fill(buffer, [3, 4])
    data = episode(5, 99)
    buffer._begin_group(1, {})
    for t in range(5):
        buffer.store(**{k: v[t] for k, v in data.items()})
    buffer.flush()
    del buffer  # the writer goes away without committing its episode
    recovered = ReplayBuffer(
        place.location, 6, 12, fields=FIELDS, meta_fields=META_FIELDS, overwrite=False, **place.kwargs
    )
    assert_holds(recovered, [*stored, {**data, "task_id": 0}])
    assert verify(place.location) == []


def test_killed_writer_keeps_committed_episodes(place):
    if not place.on_disk:
        pytest.skip("memory:// lives inside one process")
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from replaybuf import ReplayBuffer
        from tests._data import FIELDS, META_FIELDS, episode
        buffer = ReplayBuffer({place.location!r}, 6, 12, fields=FIELDS, meta_fields=META_FIELDS,
                              backend={place.backend!r})
        for i in range(2):
            buffer.store_episode(**episode(4 + i, i), task_id=i)
        data = episode(6, 50)
        with buffer.one_episode(task_id=5):
            for t in range(6):
                buffer.store(**{{k: v[t] for k, v in data.items()}})
                if t == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    assert_holds(reader, [{**episode(4 + i, i), "task_id": i} for i in range(2)])
    writer = ReplayBuffer.from_folder(place.location)
    partial = {k: v[:4] for k, v in episode(6, 50).items()}
    assert_holds(writer, [*[{**episode(4 + i, i), "task_id": i} for i in range(2)], {**partial, "task_id": 5}])
    assert verify(place.location) == []


def test_pickles_without_its_data_and_reads_in_workers(place):
    buffer = new_buffer(place)
    stored = fill(buffer, [5, 7, 3])
    payload = pickle.dumps(buffer)
    assert len(payload) < sum(v.nbytes for v in buffer.data["state"][:3].reshape(1, -1))
    copy = pickle.loads(payload)
    assert copy.read_only
    assert_holds(copy, stored)
    if not place.on_disk:
        return

    class Steps(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.from_numpy(copy.storage.gather("state", np.array([i]), np.array([2]))[0])

    loader = torch.utils.data.DataLoader(Steps(), batch_size=3, num_workers=2, multiprocessing_context="fork")
    (batch,) = list(loader)
    np.testing.assert_array_equal(batch.numpy(), np.stack([s["state"][2] for s in stored]))


def test_fsync_commits(place):
    buffer = new_buffer(place, fsync=True)
    stored = fill(buffer, [3, 2])
    assert_holds(ReplayBuffer.from_folder(place.location, read_only=True), stored)


@pytest.mark.parametrize("target, other", [(t, o) for t in LOCAL_BACKENDS for o in LOCAL_BACKENDS if t != o])
def test_creating_over_another_backends_buffer(tmp_path, target, other):
    place = make_place(target, tmp_path)
    with ReplayBuffer(place.location, 2, 3, fields={"x": "float"}, backend=other) as first:
        first.store_episode(x=np.ones(2))
    before = snapshot(place.location)
    with pytest.raises(ValueError, match=f"holds a '{other}' buffer"):
        new_buffer(place)
    # every file as it was; the folder's mtime moved with the writer lock taken and given back
    assert {k: v for k, v in snapshot(place.location).items() if k != "replaybuf"} == {
        k: v for k, v in before.items() if k != "replaybuf"
    }
    assert set(snapshot(place.location)) == set(before)


def test_reader_refresh_sees_new_commits(place):
    writer = new_buffer(place)
    stored = fill(writer, [3])
    reader = ReplayBuffer.from_folder(place.location, read_only=True)
    stored += fill(writer, [4, 5], seed0=1)
    assert len(reader) == 1
    reader.refresh()
    assert_holds(reader, stored)
    episodes, timesteps = np.array([2, 1]), np.array([4, 3])
    np.testing.assert_array_equal(
        reader.storage.gather("reward", episodes, timesteps), [stored[2]["reward"][4], stored[1]["reward"][3]]
    )
