"""BufferView: the read side ReplayBuffer and ConcatReplayBuffer share, and what readers get."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.sampling import make_dataset, update_priorities
from replaybuf.sampling.datasets import as_buffer, take_snapshot
from replaybuf.view import BufferView

FIELDS = {"obs": ("float", (2,)), "priority": "float"}
META = {"task": "int"}


def write(location, lengths, circular=False, first=0) -> ReplayBuffer:
    """A buffer holding episodes ``first, first + 1, ...``: obs all ``index``, task ``10 + index``."""
    buffer = ReplayBuffer(location, max_episodes=3, max_timesteps=6, fields=FIELDS, meta_fields=META, circular=circular)
    for index, length in enumerate(lengths, start=first):
        buffer.store_episode(obs=np.full((length, 2), index, np.float32), priority=np.ones(length), task=10 + index)
    return buffer


def test_both_buffers_are_buffer_views(tmp_path):
    writer = write(tmp_path / "a", [2, 3])
    reader = ReplayBuffer.from_folder(tmp_path / "a", read_only=True)
    concat = ConcatReplayBuffer([reader, writer])
    for view in (writer, reader, concat):
        assert isinstance(view, BufferView)
        assert as_buffer(view) is view
    with pytest.raises(TypeError, match="replay_buffer must be a ReplayBuffer, a path or a URL, got dict"):
        as_buffer({"storage": None, "schema": None})


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_every_array_object_has_numpy_len_ndim_and_asarray(tmp_path, backend):
    """The views (``data``, ``meta_data``, a concatenation's) and the local backends' own arrays
    share ``storage.ArrayBase``: ``len``, ``ndim`` and ``np.asarray`` (with a dtype) agree with
    ``shape`` and ``[:]``; ``np.asarray`` of a memmap array is a copy, not a window on the file."""
    location = str(tmp_path / "a")
    writer = ReplayBuffer(location, 3, 6, fields=FIELDS, meta_fields=META, backend=backend)
    writer.store_episode(obs=np.full((4, 2), 7, np.float32), priority=np.ones(4), task=3)
    concat = ConcatReplayBuffer([writer])
    arrays = [writer.data["obs"], writer.meta_data["task"], concat.data["obs"], concat.storage.array("obs")]
    if backend != "zarr":  # the zarr backend's arrays are ChunkedArray (storage/_chunks.py)
        arrays += [writer.storage.array("obs"), writer.storage.array("episode_lens", meta=True)]
    for array in arrays:
        assert (len(array), array.ndim) == (array.shape[0], len(array.shape)), array
        whole = np.asarray(array)
        assert whole.shape == array.shape and whole.dtype == array.dtype
        np.testing.assert_array_equal(whole, array[:])
        assert np.asarray(array, dtype=np.float64).dtype == np.float64
    if backend == "memmap":
        np.asarray(writer.storage.array("obs"))[0] = -1
        assert (writer.data["obs"][0, :4] == 7).all()


def test_snapshot_is_public_and_read_only(tmp_path):
    writer = write(tmp_path / "a", [2, 3, 4], circular=True)
    np.testing.assert_array_equal(writer.generations, [1, 2, 3])
    np.testing.assert_array_equal(writer.meta_values("task"), [10, 11, 12])
    np.testing.assert_array_equal(writer.meta_values("episode_lens"), [2, 3, 4])
    for view in (writer.generations, writer.episode_lens, writer.meta_values("task")):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 0
    with pytest.raises(
        ValueError, match=r"meta_values: invalid meta field name 'nope' - must be one of \['episode_lens', 'task'\]"
    ):
        writer.meta_values("nope")
    reader = ReplayBuffer.from_folder(tmp_path / "a", read_only=True)
    writer.store_episode(obs=np.zeros((5, 2), np.float32), priority=np.ones(5), task=13)  # reuses slot 0
    np.testing.assert_array_equal(reader.generations, [1, 2, 3])  # a reader's snapshot moves on refresh only
    lens, generations = take_snapshot(reader)
    np.testing.assert_array_equal(generations, [4, 2, 3])
    np.testing.assert_array_equal(lens, [5, 3, 4])
    np.testing.assert_array_equal(reader.meta_data["task"][:], [13, 11, 12])


def test_seed_attributes_come_from_the_schema(tmp_path):
    buffer = write(tmp_path / "a", [2])
    assert buffer.fieldnames == {"obs", "priority"} and buffer.meta_fieldnames == {"task", "episode_lens"}
    assert buffer.shapes == {"obs": (2,), "priority": ()}
    assert buffer.dtypes == {"obs": np.float32, "priority": np.float32}
    assert buffer.meta_shapes == {"task": (), "episode_lens": ()}
    assert buffer.meta_dtypes == {"task": np.int32, "episode_lens": np.int32}
    assert (buffer.max_episodes, buffer.max_timesteps, buffer.circular) == (3, 6, False)
    assert buffer.store(obs=[1, 2], priority=0.5)._fields == ("obs", "priority")
    copy = pickle.loads(pickle.dumps(buffer))
    assert copy.read_only and copy.memory_namedtuple._fields == ("obs", "priority")
    assert copy.shapes == buffer.shapes


def test_writes_through_a_concatenation_are_refused(tmp_path):
    concat = ConcatReplayBuffer([write(tmp_path / "a", [2]), write(tmp_path / "b", [3])])
    with pytest.raises(NotImplementedError, match="ConcatReplayBuffer is read-only: `update_priorities`"):
        update_priorities(concat, [[0, 0]], [2.0])
    with pytest.raises(
        NotImplementedError, match=r"ConcatReplayBuffer is read-only: `meta_data\['task'\]\[...\] = ...`"
    ):
        concat.meta_data["task"][0] = 1
    np.testing.assert_array_equal(concat.buffers[0].storage.read_rows("priority", np.array([0]), 0, 2), [[1, 1]])
    reader = ReplayBuffer.from_folder(tmp_path / "a", read_only=True)
    with pytest.raises(ValueError, match="cannot call `update_priorities` on a buffer opened read-only"):
        update_priorities(reader, [[0, 0]], [2.0])


def test_a_dataset_over_a_concatenation_reads_each_member(tmp_path):
    concat = ConcatReplayBuffer([write(tmp_path / "a", [2]), write(tmp_path / "b", [3], first=5)])
    dataset = make_dataset(concat, timestep_level=True)
    assert sorted(float(dataset[i]["obs"][0]) for i in range(len(dataset))) == [0, 0, 5, 5, 5]
    assert sorted(int(dataset[i]["task"]) for i in range(len(dataset))) == [10, 10, 15, 15, 15]
