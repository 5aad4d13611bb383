"""Buffers written by earlier releases still open: read as they were, and writable (after a copy)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from replaybuf import ReplayBuffer, verify

from .data.make_fixtures import expected_episode

DATA = os.path.join(os.path.dirname(__file__), "data")
FORMATS = [(version, backend) for version in ("format-v1", "format-v2") for backend in ("zarr", "memmap", "hdf5")]
FORMATS.append(("format-v3", "zarr"))  # format 3 changed the zarr layout only (packed small fields)
# slot -> commit ordinal: 4 episodes stored circularly into 3 slots
SLOT_EPISODES = {0: 3, 1: 1, 2: 2}


def _check_contents(buffer: ReplayBuffer) -> None:
    assert buffer.num_episodes == 3
    assert buffer.valid_episodes().tolist() == [1, 2, 0]
    for slot, episode in SLOT_EPISODES.items():
        expected = expected_episode(episode)
        n = len(expected["reward"])
        assert int(buffer.episode_lens[slot]) == n
        for name in ("frame", "state", "reward", "done"):
            np.testing.assert_array_equal(np.asarray(buffer.data[name][slot, :n]), expected[name], err_msg=name)
        assert int(buffer.meta_data["task"][slot]) == int(expected["task"])


@pytest.mark.parametrize(("version", "backend"), FORMATS)
def test_released_format_reads(version, backend):
    buffer = ReplayBuffer.from_folder(os.path.join(DATA, version, backend), read_only=True)
    _check_contents(buffer)
    all_data = buffer.get_all_data()
    assert all_data["frame"].shape[0] == 3
    assert verify(os.path.join(DATA, version, backend)) == []


@pytest.mark.parametrize(("version", "backend"), FORMATS)
def test_released_format_writes(version, backend, tmp_path):
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, version, backend), path)
    buffer = ReplayBuffer.from_folder(path)
    _check_contents(buffer)
    extra = expected_episode(0)
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


@pytest.mark.parametrize("version", ["format-v1", "format-v2"])
def test_released_zarr_keeps_its_codecs_when_written(version, tmp_path):
    """Buffers written before codecs were chosen by measurement record no choice: a new episode
    of noise frames (which a new buffer would store raw) is encoded with the codec the frames
    already stored were, so every episode stays readable."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, version, "zarr"), path)
    frame = json.loads((path / "data" / "frame" / "zarr.json").read_text())
    buffer = ReplayBuffer.from_folder(path)
    label = buffer.storage.array("frame").codec.label
    extra = expected_episode(0)
    extra["frame"] = np.random.default_rng(5).integers(0, 256, extra["frame"].shape, dtype=np.uint8)
    buffer.store_episode(**extra)
    assert buffer.storage.array("frame").codec.label == label != "none"
    buffer.close()
    assert json.loads((path / "data" / "frame" / "zarr.json").read_text()) == frame
    assert "measured_codecs" not in json.loads((path / "zarr.json").read_text())["attributes"]
    again = ReplayBuffer.from_folder(path, read_only=True)
    np.testing.assert_array_equal(np.asarray(again.data["frame"][1, : len(extra["frame"])]), extra["frame"])
    assert verify(path) == []


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_released_format_gets_revisions_on_its_first_writable_open(backend, tmp_path):
    """A buffer written before ``meta/_revision`` existed reads it as zeros; a reader opened then
    (with the read cache) serves an in-place edit a writer made after creating it, once it refreshes."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "format-v2", backend), path)
    reader = ReplayBuffer.from_folder(path, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    assert not reader._meta["_revision"].any() and reader.storage.inner.read_meta_rows(
        "_revision", [2, 0]
    ).tolist() == [0, 0]
    cached = np.asarray(reader.data["state"][1, :3])  # slot 1 is now cached at revision 0
    writer = ReplayBuffer.from_folder(path)  # creates meta/_revision (zeros)
    writer.update([1], state=np.full((1, 3, *cached.shape[1:]), 9.0))
    writer.close()
    reader.refresh()
    assert reader._meta["_revision"][:3].tolist() == [0, 2, 0]
    np.testing.assert_array_equal(np.asarray(reader.data["state"][1, :3]), np.full_like(cached, 9.0))
    assert verify(path) == []
