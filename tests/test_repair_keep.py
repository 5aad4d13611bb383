"""Damaged bookkeeping never costs intact episodes: a zarr buffer's per-episode checksums file
holding more than its config gives it is read no further than that, reported by ``verify`` and
cut back by ``verify --repair``, dropping nothing; ``data[]`` of a reader whose buffer was
replaced raises BufferReplacedError as every other read path does; ``stats`` of a reader
that found every slot changing under a writer raises ConcurrentWriteError, not "empty"; an
array document whose chunk shape differs from the one the buffer was created with is refused
on open, so repair drops nothing."""

from __future__ import annotations

import json
import os
import re

import fsspec
import numpy as np
import pytest

from replaybuf import BufferDamagedError, ReplayBuffer, verify
from replaybuf.storage import BufferReplacedError, ConcurrentWriteError

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


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_junk_appended_to_a_local_checksums_file_is_reported_and_cut(tmp_path, backend):
    """Junk appended to a memmap or hdf5 buffer's ``replaybuf/checksums.npy`` was read past
    silently and ``verify`` reported nothing: it names the file, its size and the size its
    header and config give it; repair cuts the file to that size, dropping no episode."""
    location = str(tmp_path / "b")
    buffer = ReplayBuffer(location, backend=backend, max_episodes=4, max_timesteps=5, fields={"x": "float32"})
    for value in range(4):
        buffer.store_episode(x=np.full(value + 2, value, np.float32))
    buffer.close()
    sums = os.path.join(location, "replaybuf", "checksums.npy")
    expected = os.path.getsize(sums)
    with open(sums, "ab") as f:
        f.write(b"junk" * 10)
    excess = (
        f"{sums}: the per-episode checksums hold {expected + 40} bytes, more than the {expected} bytes its "
        "header and the config give them; the 40 bytes past them are not read"
    )
    assert verify(location) == [excess]
    assert verify(location, repair=True) == [
        excess,
        f"repaired: cut {sums} to the {expected} bytes its header and the config give it (removed 40)",
    ]
    assert os.path.getsize(sums) == expected
    assert verify(location) == []
    with ReplayBuffer.from_folder(location, read_only=True) as reader:
        assert np.asarray(reader.valid_episodes()).tolist() == [0, 1, 2, 3]
        assert [np.asarray(reader.data["x"][value, : value + 2]).tolist() for value in range(4)] == [
            [float(value)] * (value + 2) for value in range(4)
        ]
        assert np.asarray(reader.episode_lens).tolist() == [2, 3, 4, 5]


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


def writer_in_every_slot(tmp_path, monkeypatch):
    """(writer, reader, let_through) over a 2-slot circular buffer of episodes x = 1 and 2, where
    the writer commits into both slots between the reader's two reads of the generations at
    each of its bookkeeping reads, so every refresh finds every slot changing; ``let_through()``
    lets the reader's refreshes through again."""
    location = str(tmp_path / "b")
    writer = ReplayBuffer(location, max_episodes=2, max_timesteps=4, fields={"x": "float32"}, circular=True)
    for value in (1, 2):
        writer.store_episode(x=np.full(3, value, np.float32))
    reader = ReplayBuffer.from_folder(location, read_only=True)
    storage = reader.storage
    read_meta = storage.read_meta

    def read_beside_writer(name):
        if name == "episode_lens":  # between the two reads of the generations
            for value in (3, 4):
                writer.store_episode(x=np.full(3, value, np.float32))
        return read_meta(name)

    monkeypatch.setattr(storage, "read_meta", read_beside_writer)
    return writer, reader, lambda: monkeypatch.setattr(storage, "read_meta", read_meta)


def test_stats_beside_a_writer_changing_every_slot_raises_concurrent_write(tmp_path, monkeypatch):
    """A writer committing into every slot while a reader's ``refresh()`` reads the bookkeeping
    (here: at each read of the lengths, each refresh re-reading it) left every slot unstable, and
    ``stats()`` said "the buffer has no committed episodes": it raises ConcurrentWriteError
    (retryable) naming the slots; once the writer lets a refresh through, stats answers; a
    buffer whose episodes were all dropped is still empty."""
    writer, reader, let_through = writer_in_every_slot(tmp_path, monkeypatch)
    assert len(reader.refresh()) == 0
    with pytest.raises(ConcurrentWriteError, match=r"slots \[0, 1\] of .* concurrent writer") as e:
        reader.stats()
    assert not isinstance(e.value, BufferReplacedError)
    let_through()
    assert float(reader.refresh().stats().fields["x"].mean) == 3.5
    writer.drop_episodes([0, 1])
    writer.flush()
    with pytest.raises(ValueError, match="the buffer has no committed episodes"):
        reader.refresh().stats()
    writer.close()


@pytest.mark.parametrize("make_loader", ["dataset", "dataloader", "timesteps"])
def test_a_loader_beside_a_writer_changing_every_slot_raises_concurrent_write(tmp_path, monkeypatch, make_loader):
    """As ``stats`` above: creating a dataset or dataloader while a writer commits into every
    slot at each refresh said "replay buffer is empty"; it raises ConcurrentWriteError
    (retryable) naming the slots, and works once the writer lets a refresh through."""
    writer, reader, let_through = writer_in_every_slot(tmp_path, monkeypatch)

    def load():
        if make_loader == "dataloader":
            return reader.dataloader(2)
        return reader.dataset(timestep_level=make_loader == "timesteps")

    assert len(reader.refresh()) == 0
    with pytest.raises(ConcurrentWriteError, match=r"slots \[0, 1\] of .* concurrent writer") as e:
        load()
    assert not isinstance(e.value, BufferReplacedError)
    let_through()
    assert len(load()) == (6 if make_loader == "timesteps" else 2 if make_loader == "dataset" else 1)
    writer.close()


@pytest.mark.parametrize(("where", "created", "edited"), [("folder", 8, 1), ("s3", 1, 8)])
def test_a_chunk_shape_edited_in_an_array_document_is_refused_not_the_episodes_dropped(
    tmp_path, s3_server, where, created, edited
):
    """A packed field's chunk shape edited in its zarr.json (8 -> 1 in a folder; on S3, where
    chunk shape 1 is what a buffer is created with, 1 -> 8) passed the layout check: in the
    folder, reads failed and ``verify --repair`` dropped all 3 intact episodes. Opening names the document,
    the shape it holds and the one the buffer was created with; verify --repair changes
    nothing; the document restored, every episode reads back."""
    if where == "s3":
        location, options = s3_server.url(f"chunks-{tmp_path.name}"), s3_server.storage_options
    else:
        location, options = str(tmp_path / "b"), {}
    fields = {"x": ("float32", 3), "k": "int64"}
    with ReplayBuffer(location, max_episodes=8, max_timesteps=6, fields=fields, storage_options=options) as buffer:
        for i in range(3):
            buffer.store_episode(x=np.full((i + 2, 3), i, np.float32), k=np.full(i + 2, i))
    fs, root = fsspec.core.url_to_fs(location, **options)
    key = f"{root}/data/x/zarr.json"
    original = fs.cat_file(key)
    document = json.loads(original)
    assert document["chunk_grid"]["configuration"]["chunk_shape"] == [created, 6, 3]
    document["chunk_grid"]["configuration"]["chunk_shape"] = [edited, 6, 3]
    fs.pipe_file(key, json.dumps(document).encode())
    refused = (
        rf"data/x/zarr.json.*: chunk shape \[{edited}, 6, 3\], but the buffer was created with \[{created}, 6, 3\]"
    )
    for read_only in (True, False):
        with pytest.raises(BufferDamagedError, match=refused):
            ReplayBuffer.from_folder(location, read_only=read_only, storage_options=options)
    report = verify(location, storage_options=options, repair=True)
    assert len(report) == 1 and re.search(refused, report[0]), report
    fs.pipe_file(key, original)
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=options)
    assert reader.valid_episodes().tolist() == [0, 1, 2]
    assert [int(np.asarray(reader.data["x"][i, 0, 0])) for i in range(3)] == [0, 1, 2]
    assert verify(location, storage_options=options) == []
