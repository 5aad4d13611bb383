"""Buffers written by earlier releases still open: read as they were, and writable (after a copy)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from replaybuf import ReplayBuffer, verify

DATA = os.path.join(os.path.dirname(__file__), "data")


def _maker(version: str):
    spec = importlib.util.spec_from_file_location(f"fixture_{version}", os.path.join(DATA, version, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FORMATS = [(version, backend) for version in ("format-v1", "format-v2") for backend in ("zarr", "memmap", "hdf5")]
FORMATS.append(("format-v3", "zarr"))  # format 3 changed the zarr layout only (packed small fields)
# slot -> commit ordinal: 4 episodes stored circularly into 3 slots
SLOT_EPISODES = {0: 3, 1: 1, 2: 2}


def _check_contents(buffer: ReplayBuffer, maker) -> None:
    assert buffer.num_episodes == 3
    assert buffer.valid_episodes().tolist() == [1, 2, 0]
    for slot, episode in SLOT_EPISODES.items():
        expected = maker.expected_episode(episode)
        n = len(expected["reward"])
        assert int(buffer.episode_lens[slot]) == n
        for name in ("frame", "state", "reward", "done"):
            np.testing.assert_array_equal(np.asarray(buffer.data[name][slot, :n]), expected[name], err_msg=name)
        assert int(buffer.meta_data["task"][slot]) == int(expected["task"])


@pytest.mark.parametrize(("version", "backend"), FORMATS)
def test_released_format_reads(version, backend):
    maker = _maker(version)
    buffer = ReplayBuffer.from_folder(os.path.join(DATA, version, backend), read_only=True)
    _check_contents(buffer, maker)
    all_data = buffer.get_all_data()
    assert all_data["frame"].shape[0] == 3
    assert verify(os.path.join(DATA, version, backend)) == []


@pytest.mark.parametrize(("version", "backend"), FORMATS)
def test_released_format_writes(version, backend, tmp_path):
    maker = _maker(version)
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, version, backend), path)
    buffer = ReplayBuffer.from_folder(path)
    _check_contents(buffer, maker)
    extra = maker.expected_episode(0)
    buffer.store_episode(**extra)  # goes to slot 1, the oldest
    buffer.close()
    again = ReplayBuffer.from_folder(path, read_only=True)
    assert again.valid_episodes().tolist() == [2, 0, 1]
    np.testing.assert_array_equal(np.asarray(again.data["state"][1, :5]), extra["state"])
    assert verify(path) == []
    # a buffer keeps its format: format 1 gets no checksums it never had
    assert _stored_version(path, backend) == int(version.rsplit("v", 1)[1])
    assert os.path.exists(path / "replaybuf" / "checksums.npy") == (version == "format-v2" and backend != "zarr")


def _stored_version(path, backend: str) -> int:
    if backend == "zarr":
        return json.loads((path / "zarr.json").read_text())["attributes"]["version"]
    if backend == "memmap":
        return json.loads((path / "replaybuf.json").read_text())["version"]
    import h5py

    with h5py.File(path / "data.h5", "r") as f:  # a plain h5py read, as users inspect files
        return json.loads(f.attrs["replaybuf"])["version"]
