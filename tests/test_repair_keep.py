"""Damaged bookkeeping never costs intact episodes: a zarr buffer's per-episode checksums file
holding more than its config gives it is read no further than that, reported by ``verify`` and
cut back by ``verify --repair``, dropping nothing; ``data[]`` of a reader whose buffer was
replaced raises BufferReplacedError as every other read path does."""

from __future__ import annotations

import os

import numpy as np
import pytest

from replaybuf import ReplayBuffer, verify
from replaybuf.storage import BufferReplacedError

from .test_derived_hostile import delete
from .test_derived_hostile import make as make_three
from .test_packed_hostile import CHECKSUMS, FIELDS, SLOTS, check_all, make

pytest_plugins = ["tests._servers"]  # fixtures: s3_server (moto's S3 on 127.0.0.1)


def test_junk_appended_to_the_checksums_is_cut_not_the_episodes_dropped(tmp_path):
    """Junk appended to ``replaybuf/checksums`` made every read of many slots raise "hold more
    than N bytes", and ``verify --repair`` dropped all 8 intact episodes: the rows the config
    gives are read as they are, verify names the file and its excess, repair removes it."""
    make(tmp_path)
    sums = str(tmp_path / CHECKSUMS)
    expected = os.path.getsize(sums)
    assert expected == 8 * len(FIELDS) * SLOTS
    with open(sums, "ab") as f:
        f.write(b"junk" * 10)
    reader = ReplayBuffer.from_folder(tmp_path, read_only=True)
    values = reader.get_all_data()  # every slot at once: the table read whole
    assert values["episode_lens"].tolist() == [int(n) for n in reader.episode_lens]
    reader.close()
    assert check_all(tmp_path) == list(range(SLOTS))
    excess = (
        f"{sums}: the checksums of packed fields hold {expected + 40} bytes, more than the {expected} bytes the "
        "config gives them; the 40 bytes past them are not read"
    )
    assert verify(tmp_path) == [excess]
    assert verify(tmp_path, repair=True) == [
        excess,
        f"repaired: cut {sums} to the {expected} bytes the config gives it (removed 40)",
    ]
    assert os.path.getsize(sums) == expected
    assert verify(tmp_path) == []
    assert check_all(tmp_path) == list(range(SLOTS))
    assert np.asarray(ReplayBuffer.from_folder(tmp_path, read_only=True).valid_episodes()).tolist() == list(
        range(SLOTS)
    )


@pytest.mark.parametrize("where", ["s3", "folder"])
def test_data_of_a_buffer_deleted_and_created_again_raises(tmp_path, s3_server, where):
    """``data[name][...]`` of a read-only reader on S3 (moto) whose buffer was deleted and
    created again returned the new buffer's episodes (``k`` 100 in slot 0) under the old plan;
    every other read path raised BufferReplacedError, and so does this one (in a zarr folder
    too, where the check is a stat)."""
    if where == "s3":
        location, options = s3_server.url(f"keep-{tmp_path.name}"), s3_server.storage_options
    else:
        location, options = str(tmp_path / "b"), None
    make_three(location, 0, storage_options=options)
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=options)
    assert np.asarray(reader.data["k"][0, 0]).tolist() == 0
    delete(location, options)
    make_three(location, 100, storage_options=options)
    with pytest.raises(BufferReplacedError):
        reader.data["k"][0]
    with pytest.raises(BufferReplacedError):
        reader.data["x"][:, :2]
    assert np.asarray(reader.refresh().data["k"][0, 0]).tolist() == 100
