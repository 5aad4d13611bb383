"""Zarr and xarray conventions: dimension names, a quiet zarr listing, ``to_xarray``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings

import numpy as np
import pytest
import zarr

from replaybuf import ConcatReplayBuffer, ReplayBuffer

from ._data import random_episode

xarray = pytest.importorskip("xarray")

DATA = os.path.join(os.path.dirname(__file__), "data")
FIELDS = {
    "frame": ("uint8", (6, 5, 3)),
    "planes": ("uint8", (3, 6, 5)),
    "obs": ("float", (4,)),
    "reward": "float",
}
META = {"task": "int", "goal": ("float", (2,))}
LENGTHS = [4, 7, 2, 5]


def _fill(buffer: ReplayBuffer, lengths=LENGTHS) -> None:
    for index, length in enumerate(lengths):
        buffer.store_episode(
            **{**random_episode(FIELDS, length, index), "reward": np.arange(length, dtype=np.float32) + index},
            task=index,
            goal=np.array([index, -index], np.float32),
        )


@pytest.fixture
def folder(tmp_path) -> str:
    path = str(tmp_path / "buffer")
    buffer = ReplayBuffer(path, max_episodes=3, max_timesteps=8, fields=FIELDS, meta_fields=META, circular=True)
    _fill(buffer)  # 4 episodes into 3 slots: wrapped, the oldest kept one is in slot 1
    buffer.close()
    return path


def test_arrays_carry_dimension_names(folder):
    root = zarr.open_group(folder, mode="r")
    names = {path: tuple(array.metadata.dimension_names) for path, array in root.arrays()}
    names.update({f"data/{n}": tuple(a.metadata.dimension_names) for n, a in root["data"].arrays()})
    names.update({f"meta/{n}": tuple(a.metadata.dimension_names) for n, a in root["meta"].arrays()})
    assert names["data/frame"] == ("episode", "time", "frame_height", "frame_width", "frame_channel")
    assert names["data/planes"] == ("episode", "time", "planes_channel", "planes_height", "planes_width")
    assert names["data/obs"] == ("episode", "time", "obs_dim0")
    assert names["data/reward"] == ("episode", "time")
    assert names["meta/goal"] == ("episode", "goal_dim0")
    assert names["meta/task"] == names["meta/episode_lens"] == ("episode",)


def test_xarray_opens_the_data_group(folder):
    buffer = ReplayBuffer.from_folder(folder, read_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # as a notebook user opens it: consolidated metadata is there, so no warning either way
        data = xarray.open_zarr(folder, group="data")
        meta = xarray.open_zarr(folder, group="meta")
    assert data.sizes["episode"] == 3 and data.sizes["time"] == 8
    np.testing.assert_array_equal(data["frame"].values, np.asarray(buffer.data["frame"][:]))
    np.testing.assert_array_equal(meta["goal"].values, np.asarray(buffer.meta_data["goal"][:]))


def test_zarr_listing_is_quiet_with_state_and_side_files(folder):
    """The state folder is a zarr member: no "not recognized as a component" warning, even with
    an unfinished episode's step log and a stray lock file beside the counters."""
    writer = ReplayBuffer.from_folder(folder)
    writer.store(frame=np.zeros((6, 5, 3), np.uint8), reward=1.0)
    writer.flush()
    with open(os.path.join(folder, "replaybuf", "writer.lock"), "w") as f:
        f.write("1234")
    assert os.listdir(os.path.join(folder, "replaybuf", "steplog"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = zarr.open_group(folder, mode="r")
        members = dict(root.members(max_depth=None))
        root.tree()
    assert members["replaybuf"].shape == (0,)
    assert {"data/frame", "meta/task"} <= set(members)


def test_released_buffer_gets_the_state_node_on_writable_open(tmp_path):
    """Buffers written before the node existed open as before; a writable open adds it."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v1", "zarr"), path)
    node = path / "replaybuf" / "zarr.json"
    ReplayBuffer.from_folder(path, read_only=True).close()
    assert not node.exists()
    ReplayBuffer.from_folder(path).close()
    assert json.loads(node.read_text())["node_type"] == "array"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(zarr.open_group(str(path), mode="r").members(max_depth=None))
    assert ReplayBuffer.from_folder(path, read_only=True).num_episodes == 3


def test_to_xarray(make_location):
    location, kwargs = make_location()
    buffer = ReplayBuffer(
        location, max_episodes=3, max_timesteps=8, fields=FIELDS, meta_fields=META, circular=True, **kwargs
    )
    _fill(buffer)
    ds = buffer.to_xarray()
    assert ds["frame"].dims == ("episode", "time", "frame_height", "frame_width", "frame_channel")
    assert ds["obs"].dims == ("episode", "time", "obs_dim0")
    assert ds.sizes["time"] == 7  # trimmed to the longest committed episode, as to_dask
    assert ds["reward"].chunks is not None  # lazy: dask-backed
    assert ds["slot"].values.tolist() == [1, 2, 0]  # oldest first
    assert ds["episode_lens"].values.tolist() == [7, 2, 5]
    assert ds["task"].values.tolist() == [1, 2, 3]
    assert ds["goal"].dims == ("episode", "goal_dim0")
    np.testing.assert_array_equal(ds["valid"].values, np.arange(7)[None, :] < np.array([7, 2, 5])[:, None])
    returns = ds["reward"].where(ds["valid"]).sum("time").values
    np.testing.assert_allclose(returns, [sum(range(7)) + 7, 1 + 2 * 2, sum(range(5)) + 15])
    for name, array in buffer.to_dask(fields=["frame", "obs"], meta_fields=[]).items():
        np.testing.assert_array_equal(ds[name].values, array.compute())
    picked = ds.sel(episode=ds["task"] == 3)
    assert picked["slot"].values.tolist() == [0]


def test_concat_to_xarray(folder, tmp_path):
    other = ReplayBuffer(str(tmp_path / "other"), max_episodes=3, max_timesteps=8, fields=FIELDS, meta_fields=META)
    _fill(other, [3])
    ds = ConcatReplayBuffer([folder, str(tmp_path / "other")]).to_xarray(["reward"], ["task"])
    assert ds["episode_lens"].values.tolist() == [7, 2, 5, 3]
    assert ds["task"].values.tolist() == [1, 2, 3, 0]
    assert ds.sizes["time"] == 7


def test_to_xarray_selection_and_errors(folder, monkeypatch):
    buffer = ReplayBuffer.from_folder(folder, read_only=True)
    ds = buffer.to_xarray(fields=["reward"], meta_fields=["task"])
    assert set(ds.data_vars) == {"reward"}
    assert {"task", "episode_lens", "valid", "slot"} <= set(ds.coords)
    assert "goal" not in ds.coords
    with pytest.raises(ValueError, match=r"to_xarray: invalid field names \['rewards'\]"):
        buffer.to_xarray(fields=["rewards"])
    monkeypatch.setitem(sys.modules, "xarray", None)
    with pytest.raises(ImportError, match=r"pip install 'replaybuf\[xarray\]'"):
        buffer.to_xarray()
