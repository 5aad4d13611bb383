"""The memmap backend: plain .npy files, JSON config, and folders of memmap-replay-buffer 0.2.3."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import numpy as np
import pytest

from replaybuf import BufferDamagedError, ForeignEntriesError, ReplayBuffer
from replaybuf.storage import detect_backend
from replaybuf.storage._seed import UnsafePickleError, load_plain_pickle

from ._backends import snapshot
from ._data import FIELDS, META_FIELDS, SEED_FIELDS, episode, seed_buffer

seed = pytest.importorskip("memmap_replay_buffer")


def test_files_are_plain_npy_and_json(tmp_path):
    folder = tmp_path / "buf"
    buffer = ReplayBuffer(folder, 5, 8, fields=FIELDS, meta_fields=META_FIELDS, backend="memmap")
    data = episode(6, 1)
    buffer.store_episode(**data, task_id=3)
    names = sorted(os.listdir(folder))
    assert "state.data.npy" in names and "task_id.data.meta.npy" in names and "replaybuf.json" in names
    assert not [n for n in names if n.endswith(".pkl")]
    state = np.load(folder / "state.data.npy", mmap_mode="r")
    assert state.shape == (5, 8, 3, 4, 4) and state.dtype == np.float32
    np.testing.assert_array_equal(state[0, :6], data["state"])
    assert np.load(folder / "episode_lens.data.meta.npy")[0] == 6
    config = json.loads((folder / "replaybuf.json").read_text())
    assert config["backend"] == "memmap" and list(config["fields"]) == ["state", "action", "reward"]
    assert json.loads((folder / "replaybuf" / "state.json").read_text())["num_episodes"] == 1
    assert detect_backend(str(folder)) == "memmap"


@pytest.mark.parametrize(("before", "after"), [("replaybuf", "replaycuf"), ("memmap", "memmaq")])
def test_a_config_naming_another_format_or_backend_is_damage_naming_it(tmp_path, before, after):
    """Before: a flipped bit in replaybuf.json's format name read as 'no replaybuf buffer found'
    naming only the folder."""
    path = tmp_path / "buffer"
    ReplayBuffer(str(path), 3, 4, fields=FIELDS, meta_fields=META_FIELDS, backend="memmap").close()
    config = path / "replaybuf.json"
    config.write_text(config.read_text().replace(f'"{before}"', f'"{after}"', 1))
    with pytest.raises(BufferDamagedError, match=f"{config}: names .*'{after}'.*expected 'replaybuf' and 'memmap'"):
        ReplayBuffer.from_folder(str(path), read_only=True)


def test_overwrite_replaces_only_buffer_files(tmp_path):
    folder = tmp_path / "buf"
    with ReplayBuffer(folder, 2, 3, fields={"x": "float"}, backend="memmap") as first:
        first.store_episode(x=np.ones(2))
    ReplayBuffer(folder, 2, 3, fields={"y": "int"}, backend="memmap")
    names = set(os.listdir(folder))
    assert "x.data.npy" not in names and "y.data.npy" in names
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(ForeignEntriesError, match="'notes.txt'"):
        ReplayBuffer(folder, 2, 3, fields={"z": "int"}, backend="memmap")
    assert set(os.listdir(folder)) == names | {"notes.txt"}


def test_urls_are_refused(tmp_path):
    with pytest.raises(ValueError, match="local folders only"):
        ReplayBuffer("s3://bucket/x", 2, 3, fields={"x": "float"}, backend="memmap")


def test_gather_is_one_fancy_index(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", 4, 6, fields={"x": ("float", 2)}, backend="memmap")
    for i in range(3):
        buffer.store_episode(x=np.arange(12, dtype=np.float32).reshape(6, 2) + 100 * i)
    out = buffer.storage.gather("x", np.array([2, 0, 2]), np.array([5, 1, 0]))
    np.testing.assert_array_equal(out, [[210, 211], [2, 3], [200, 201]])
    assert type(out) is np.ndarray


# ---- memmap-replay-buffer folders ---------------------------------------------------------------


def test_seed_folder_opens_read_only_untouched(tmp_path):
    folder = tmp_path / "seed"
    writer = seed_buffer(folder)
    before = snapshot(str(folder))
    buffer = ReplayBuffer.from_folder(folder, read_only=True)
    assert buffer.storage.backend_name == "memmap"
    # slots 1..3 hold episodes 1..3 (slot 0's first episode was overwritten by episode 4), the
    # episode in progress (2 steps) sits in slot 1 and is the newest
    assert writer.episode_index == 1 and writer.timestep_index == 2
    assert buffer.valid_episodes().tolist() == [2, 3, 0, 1]
    assert buffer.episode_lens.tolist() == [7, 2, 5, 6]
    assert buffer.num_episodes == 4
    for name in SEED_FIELDS:
        np.testing.assert_array_equal(buffer.data[name][:], np.load(folder / f"{name}.data.npy"))
    np.testing.assert_array_equal(buffer.meta_data["task_id"][:], [4, 0, 2, 3])  # the seed resets meta of a new episode
    everything = buffer.get_all_data()
    np.testing.assert_array_equal(everything["reward"][1, :2].numpy(), [-1.0, -1.0])  # slot order
    buffer.close()
    del buffer
    assert snapshot(str(folder)) == before


def test_seed_folder_continues_appending_and_stays_readable_by_the_seed(tmp_path):
    folder = tmp_path / "seed"
    seed_buffer(folder, circular=False, lengths=(3, 4), partial=2, max_episodes=6)
    metadata = (folder / "metadata.pkl").read_bytes()
    buffer = ReplayBuffer.from_folder(folder)
    assert buffer.num_episodes == 3 and buffer.episode_lens[2] == 2  # the partial episode is committed
    buffer.store_episode(state=np.full((5, 3), 7.0), action=np.ones((5, 2)), reward=np.arange(5), task_id=42)
    assert buffer.valid_episodes().tolist() == [0, 1, 2, 3]
    names = set(os.listdir(folder))
    assert {"replaybuf.json", "_generation.data.meta.npy", "replaybuf"} <= names
    assert (folder / "metadata.pkl").read_bytes() == metadata
    buffer.close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = seed.ReplayBuffer.from_folder(str(folder))
        assert (again.num_episodes, again.episode_index, again.timestep_index) == (4, 4, 0)
        np.testing.assert_array_equal(again.get_all_data()["task_id"].numpy(), [0, 1, 0, 42])
        # the seed writes on; replaybuf picks its counters up again
        with again.one_episode(task_id=77):
            again.store(reward=5.0)
        again.flush()
        del again
    reopened = ReplayBuffer.from_folder(folder)
    assert reopened.valid_episodes().tolist() == [0, 1, 2, 3, 4]
    assert reopened.meta_data["task_id"][4] == 77 and reopened.episode_index == 5


def test_seed_hdf5_folder_is_not_taken_for_memmap(tmp_path):
    folder = tmp_path / "h5seed"
    from memmap_replay_buffer import ReplayBufferH5PY

    ReplayBufferH5PY(str(folder), max_episodes=2, max_timesteps=3, fields={"x": "float"}).flush()
    assert detect_backend(str(folder)) is None


def test_crafted_pickle_cannot_run_code(tmp_path):
    folder = tmp_path / "seed"
    seed_buffer(folder)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "metadata.pkl").write_bytes(pickle.dumps({"max_episodes": Exploit(), "fields": {}}))
    before = snapshot(str(folder))
    with pytest.raises(UnsafePickleError, match="refusing to load (posix|os|nt).system"):
        ReplayBuffer.from_folder(folder, read_only=True)
    with pytest.raises(UnsafePickleError):
        ReplayBuffer.from_folder(folder)
    assert not marker.exists()
    assert snapshot(str(folder)) == before


@pytest.mark.parametrize(
    "value, complaint",
    [
        ({"fields": {"x"}}, "set"),
        ({"fields": b"raw"}, "bytes"),
        ({"default": np.float32(1.0)}, "numpy"),
        ([1, 2], "expected a dict"),
    ],
)
def test_restricted_unpickler_accepts_plain_data_only(value, complaint):
    with pytest.raises(ValueError, match=complaint):
        load_plain_pickle(pickle.dumps(value), "metadata.pkl")


def test_restricted_unpickler_reads_seed_configs():
    config = {
        "max_episodes": 3,
        "fields": {"s": ("float", (3, 16, 16), 0.0), "a": ("int", 2)},
        "circular": True,
        "meta_fields": {},
        "extra": None,
    }
    assert load_plain_pickle(pickle.dumps(config), "metadata.pkl") == config


def test_short_trajectories_are_served_checked_then_from_the_private_copy(tmp_path):
    """Whole short episodes are checked on their first read, then served from the process's
    private copy in one fancy index per field; an episode rewritten since is checked again."""
    location = tmp_path / "short"
    writer = ReplayBuffer(location, max_episodes=6, max_timesteps=8, fields={"x": ("float", 3)}, backend="memmap")
    rng = np.random.default_rng(1)
    stored = [rng.random((n, 3), dtype=np.float32) for n in (3, 5, 8, 2, 7, 4)]
    for rows in stored:
        writer.store_episode(x=rows)
    writer.flush()
    reader = ReplayBuffer.from_folder(location, read_only=True)
    storage = reader.storage
    slots = np.array([4, 0, 2, 5, 1, 3])
    lens = np.array([len(stored[s]) for s in slots])
    for _ in range(2):  # the second read is served from the private copy
        out = np.full((len(slots), 8, 3), -1.0, np.float32)
        storage.read_spans("x", slots, np.zeros(len(slots), np.int64), lens, out)
        for i, slot in enumerate(slots.tolist()):
            np.testing.assert_array_equal(out[i, : lens[i]], stored[slot])
            assert (out[i, lens[i] :] == -1).all(), "steps past the span are left as they were"
    kept = storage._checksums._copies["x"]
    assert (kept.lens[slots] == lens).all()
    writer.update([2], x=np.full((1, 8, 3), 9.0, np.float32))  # rewritten in place: a new checksum
    writer.flush()
    reader.refresh()
    out = np.zeros((1, 8, 3), np.float32)
    storage.read_spans("x", np.array([2]), np.zeros(1, np.int64), np.array([8]), out)
    assert (out == 9.0).all()
