"""Reads that never lie: one file of a committed buffer is damaged (a flipped bit, a truncation,
junk appended, zeros written over it, or swapped with another file of its array), then one
public read path runs on a fresh read-only reader. It either returns exactly the committed
values or raises a replaybuf error naming the damaged file or key; never a wrong value, an
unrelated exception or an allocation sized by a damaged length.

Each backend's clean buffer is built once (for zarr: three episodes compacted into shards, one
still hot, i.e. raw, and a warm read cache filled by a ``cache='disk'`` reader); each example
copies it to the same place, so the cache's folder, keyed by the location, still belongs to it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from replaybuf import (
    BufferDamagedError,
    BufferNotFoundError,
    ConcatReplayBuffer,
    ConcurrentWriteError,
    CorruptChunkError,
    EpisodeLengthError,
    LostLengthError,
    MetaChecksumError,
    NewerFormatError,
    ReplayBuffer,
    ReplayDatasetTimeWindow,
    SnapshotError,
    StorageError,
    verify,
)
from replaybuf.consistency import read_episodes_consistent
from replaybuf.sampling.datasets import SnapshotOverwrittenError
from replaybuf.storage import make_storage
from replaybuf.viewer import BufferApp

from ._backends import LOCAL_BACKENDS, require
from ._data import random_episode, released_copy
from .data.make_fixtures import expected_episode
from .test_hot_tier import is_hot_file

h5py = require("h5py")

FIELDS = {
    "frame": {"dtype": "uint8", "shape": (32, 32, 4), "compressor": "blosc-lz4"},
    "state": ("float", 3),
    "priority": ("float", (), 1.0),
}
META_FIELDS = {"task": "int", "score": "float"}
COLD_LENGTHS = [6, 5, 7]
HOT_LENGTH = 4  # zarr only: the episode a live writer left hot
MAX_EPISODES, MAX_TIMESTEPS = 5, 8
SNAPSHOT = "fuzz"
REPLAYBUF_ERRORS = (
    StorageError,
    BufferDamagedError,
    BufferNotFoundError,
    NewerFormatError,
    SnapshotError,
    ConcurrentWriteError,
    SnapshotOverwrittenError,
)
DAMAGES = ["flip", "truncate", "extend", "zeros", "swap"]


def _episode(slot: int, length: int) -> dict:
    """Episode ``slot``: each frame a coloured square on black, compressible (so the hot and
    compacted shards differ) and distinct per step."""
    rng = np.random.default_rng(slot)
    frame = np.zeros((length, 32, 32, 4), np.uint8)
    frame[:, :16, :16] = rng.integers(1, 256, (length, 1, 1, 4), dtype=np.uint8)
    return {
        "frame": frame,
        "state": rng.standard_normal((length, 3)).astype(np.float32),
        "priority": rng.uniform(0.5, 2.0, length).astype(np.float32),
        "task": slot + 10,
        "score": slot + 0.25,
    }


def _lengths(backend: str) -> list[int]:
    return COLD_LENGTHS + [HOT_LENGTH] if backend == "zarr" else COLD_LENGTHS


def _frames_hot(buffer: ReplayBuffer, slot: int) -> bool:
    array = buffer.storage.array("frame")
    return is_hot_file(array.kv.where(array.shard_key(slot)))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """backend -> (template folder holding ``buffer`` and ``cache``, the folder examples use)."""
    root = tmp_path_factory.mktemp("damaged_reads")
    made = {}
    for backend in LOCAL_BACKENDS:
        work, template = root / f"{backend}-work", root / f"{backend}-template"
        location = str(work / "buffer")
        writer = ReplayBuffer(location, MAX_EPISODES, MAX_TIMESTEPS, FIELDS, META_FIELDS, backend=backend)
        for slot, length in enumerate(COLD_LENGTHS):
            writer.store_episode(**_episode(slot, length))
        if backend == "zarr":
            writer.compact()  # the frames so far into compressed shards
            writer.store_episode(**_episode(len(COLD_LENGTHS), HOT_LENGTH))
            assert _frames_hot(writer, len(COLD_LENGTHS)) and not _frames_hot(writer, 0)
        writer.snapshot(SNAPSHOT)
        writer.flush()
        if backend == "zarr":
            reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=str(work / "cache"))
            reader.warm_cache()
            reader.close()
            assert any(path.is_file() for path in (work / "cache").rglob("*"))
        shutil.copytree(work, template)  # as a writer killed now leaves it: the last episode hot
        writer.close()
        made[backend] = (template, work)
    return made


def _files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def _damage(target: Path, how: str, where: float, bit: int, files: list[Path]) -> Path | None:
    """Damage ``target``; returns the file it was swapped with, if any."""
    data = bytearray(target.read_bytes())
    position = min(int(where * len(data)), max(len(data) - 1, 0))
    if how == "swap":
        partners = [path for path in files if path.parent == target.parent and path != target]
        if not partners:
            how = "zeros"
        else:
            partner = partners[int(where * len(partners))]
            other = partner.read_bytes()
            partner.write_bytes(bytes(data))
            target.write_bytes(other)
            return partner
    if how == "flip" and data:
        data[position] ^= 1 << bit
    elif how == "truncate":
        data = data[:position]
    elif how == "extend":
        data += np.random.default_rng(bit).integers(0, 256, 1 + int(where * 5000), dtype=np.uint8).tobytes()
    elif how == "zeros":
        data = bytearray(len(data))
    target.write_bytes(bytes(data))
    return None


# ---- what a reader must return -------------------------------------------------------------


class Expected:
    """The committed values of a backend's clean buffer, by slot."""

    def __init__(self, backend: str):
        self.lengths = _lengths(backend)
        self.episodes = [_episode(slot, length) for slot, length in enumerate(self.lengths)]

    def steps(self, name: str, slot: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.episodes[slot][name][start:stop]

    def check_rows(self, name: str, rows, slots=None) -> None:
        """``rows[i]`` is slot ``slots[i]`` (default: i), padded past its length."""
        rows = np.asarray(rows)
        slots = range(len(self.lengths)) if slots is None else slots
        for row, slot in zip(rows, slots):
            length = self.lengths[slot]
            np.testing.assert_array_equal(row[:length], self.steps(name, slot), err_msg=f"{name} slot {slot}")

    def check_all_data(self, everything, fields=tuple(FIELDS), meta=tuple(META_FIELDS)) -> None:
        assert np.asarray(everything["episode_lens"]).tolist() == self.lengths
        for name in fields:
            self.check_rows(name, everything[name])
        for name in meta:
            assert np.asarray(everything[name]).tolist() == [e[name] for e in self.episodes], name

    def check_trajectories(self, batch) -> None:
        for i, slot in enumerate(batch["_index"].tolist()):
            assert int(batch["_lens"][i]) == self.lengths[slot]
            for name in FIELDS:
                np.testing.assert_array_equal(batch[name][i].numpy()[: self.lengths[slot]], self.steps(name, slot))
            self.check_meta(batch, i, slot)

    def check_meta(self, batch, i: int, slot: int) -> None:
        for name in META_FIELDS:
            assert np.asarray(batch[name])[i] == self.episodes[slot][name], name

    def check_timesteps(self, batch, names=tuple(FIELDS)) -> None:
        for i, (slot, t) in enumerate(batch["_indices"].tolist()):
            for name in names:
                np.testing.assert_array_equal(batch[name][i].numpy(), self.steps(name, slot)[t])
            self.check_meta(batch, i, slot)


# ---- the read paths ------------------------------------------------------------------------


def _open(location: str, **kwargs) -> ReplayBuffer:
    return ReplayBuffer.from_folder(location, read_only=True, **kwargs)


def _all_data(location, expected, tmp):
    expected.check_all_data(_open(location).get_all_data())


def _some_data(location, expected, tmp):
    expected.check_all_data(
        _open(location).get_all_data(fields=["state"], meta_fields=["task", "episode_lens"]), ["state"], ["task"]
    )


def _cached_data(location, expected, tmp):
    reader = _open(location, cache="disk", cache_dir=str(Path(location).parent / "cache"))
    expected.check_all_data(reader.get_all_data())
    batch = next(iter(reader.dataloader(batch_size=64, timestep_level=True, return_indices=True)))
    expected.check_timesteps(batch)


def _views(location, expected, tmp):
    reader = _open(location)
    for name in FIELDS:
        for slot, length in enumerate(expected.lengths):
            np.testing.assert_array_equal(np.asarray(reader.data[name][slot, :length]), expected.steps(name, slot))
        expected.check_rows(name, reader.data[name][: len(expected.lengths)])
    slots = len(expected.lengths)
    assert np.asarray(reader.episode_lens[:slots]).tolist() == expected.lengths
    for name in META_FIELDS:
        assert np.asarray(reader.meta_data[name][:slots]).tolist() == [e[name] for e in expected.episodes]


def _episodes(location, expected, tmp):
    reader = _open(location)
    got = read_episodes_consistent(reader, list(range(len(expected.lengths))))
    assert got.slots.tolist() == list(range(len(expected.lengths)))
    for name in FIELDS:
        expected.check_rows(name, got.data[name])
    for slot in range(len(expected.lengths)):
        np.testing.assert_array_equal(reader.episode_frames(slot, "frame"), expected.steps("frame", slot))


def _trajectories(location, expected, tmp):
    for batch in _open(location).dataloader(batch_size=2, return_indices=True):
        expected.check_trajectories(batch)


def _timesteps(location, expected, tmp):
    for batch in _open(location).dataloader(batch_size=16, timestep_level=True, return_indices=True):
        expected.check_timesteps(batch)


def _n_steps(location, expected, tmp):
    loader = _open(location).dataloader(
        batch_size=16,
        n_steps=2,
        current_fields=("state", "frame"),
        next_fields=("state",),
        sequence_fields=("priority",),
        return_indices=True,
    )
    for batch in loader:
        for i, (slot, t) in enumerate(batch["_indices"].tolist()):
            n = int(batch["n_step_lens"][i])
            np.testing.assert_array_equal(batch["state"][i].numpy(), expected.steps("state", slot)[t])
            np.testing.assert_array_equal(batch["frame"][i].numpy(), expected.steps("frame", slot)[t])
            np.testing.assert_array_equal(batch["next_state"][i].numpy(), expected.steps("state", slot)[t + n])
            np.testing.assert_array_equal(
                batch["seq_priority"][i].numpy()[:n], expected.steps("priority", slot, t, t + n)
            )


def _windows(location, expected, tmp):
    windows = ReplayDatasetTimeWindow(_open(location), 3, return_indices=True)
    for i in range(len(windows)):
        window = windows[i]
        slot, start, length = int(window["_index"]), int(window["_start"]), int(window["_lens"])
        for name in FIELDS:
            np.testing.assert_array_equal(
                np.asarray(window[name])[:length], expected.steps(name, slot, start, start + length)
            )


def _prioritized(location, expected, tmp):
    loader = _open(location).dataloader(
        batch_size=16,
        timestep_level=True,
        sampler="prioritized",
        priority_field="priority",
        return_indices=True,
        seed=0,
    )
    expected.check_timesteps(next(iter(loader)))


def _dask(location, expected, tmp):
    reader = _open(location)
    arrays = {name: array.compute() for name, array in reader.to_dask().items()}
    order = np.argsort(reader.generations[: len(expected.lengths)], kind="stable").tolist()
    for name in FIELDS:
        expected.check_rows(name, arrays[name], order)
    assert np.asarray(reader.episode_mask().compute()).sum() == sum(expected.lengths)


def _xarray(location, expected, tmp):
    dataset = _open(location).to_xarray().compute()
    slots = dataset["slot"].values.tolist()
    assert dataset["episode_lens"].values.tolist() == [expected.lengths[s] for s in slots]
    for name in FIELDS:
        expected.check_rows(name, dataset[name].values, slots)
    for name in META_FIELDS:
        assert dataset[name].values.tolist() == [expected.episodes[s][name] for s in slots]


def _concat(location, expected, tmp):
    mixture = ConcatReplayBuffer([location])
    expected.check_all_data(mixture.get_all_data())
    for batch in mixture.dataloader(batch_size=16, timestep_level=True, return_indices=True):
        expected.check_timesteps(batch)


def _snapshot(location, expected, tmp):
    view = _open(location, snapshot=SNAPSHOT)
    expected.check_all_data(view.get_all_data())
    for batch in view.dataloader(batch_size=2, return_indices=True):
        expected.check_trajectories(batch)


def _video(location, expected, tmp):
    reader = _open(location)
    for slot in range(len(expected.lengths)):
        path = reader.save_video(os.path.join(tmp, f"{slot}.mp4"), slot, "frame", fps=10)
        assert os.path.getsize(path) > 0


def _viewer(location, expected, tmp):
    app = BufferApp(_open(location), location="fuzz", fps=10)
    try:
        listed = app.respond("/api/episodes").body
        assert listed["lengths"][: len(expected.lengths)] == expected.lengths
        for name in META_FIELDS:
            assert listed["meta"][name][: len(expected.lengths)] == pytest.approx([e[name] for e in expected.episodes])
        for slot in range(len(expected.lengths)):
            episode = app.respond(f"/api/episodes/{slot}").body
            assert episode["length"] == expected.lengths[slot]
            for name in ("state", "priority"):
                np.testing.assert_array_equal(
                    np.asarray(episode["series"][name], np.float32), expected.steps(name, slot)
                )
        app.render(0, "frame")
    finally:
        app.close()


def _verify(location, expected, tmp):
    problems = verify(location)
    assert isinstance(problems, list) and all(isinstance(problem, str) for problem in problems)


PATHS: dict[str, Callable] = {
    "get_all_data": _all_data,
    "get_all_data(fields)": _some_data,
    "cache='disk'": _cached_data,
    "data[...]/meta_data": _views,
    "episodes": _episodes,
    "trajectories": _trajectories,
    "timesteps": _timesteps,
    "n-step": _n_steps,
    "windows": _windows,
    "prioritized": _prioritized,
    "dask": _dask,
    "xarray": _xarray,
    "concat": _concat,
    "snapshot": _snapshot,
    "video": _video,
    "viewer": _viewer,
    "verify": _verify,
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_every_read_path_returns_the_committed_values_of_an_undamaged_buffer(clean, tmp_path, backend, path):
    template, work = clean[backend]
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)
    PATHS[path](str(work / "buffer"), Expected(backend), str(tmp_path))


def _names_damage(message: str, location: Path, damaged: list[Path]) -> bool:
    """Whether ``message`` names one of the damaged files: its path, or its array (``data/x``,
    ``meta/x``: a zarr array's folder, a memmap array's file ``x.data.npy``, ``x.data.meta.npy``)."""
    for path in damaged:
        relative = os.path.relpath(path, location / os.path.relpath(path, location).split(os.sep)[0])
        array = os.path.dirname(relative)
        if path.name.endswith(".data.meta.npy"):
            array = f"meta/{path.name.removesuffix('.data.meta.npy')}"
        elif path.name.endswith(".data.npy"):
            array = f"data/{path.name.removesuffix('.data.npy')}"
        if str(path) in message or relative in message or (os.sep in array and array in message):
            return True
    return False


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
)
@given(
    backend=st.sampled_from(LOCAL_BACKENDS),
    pick=st.integers(0, 10**6),
    how=st.sampled_from(DAMAGES),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    path=st.sampled_from(sorted(PATHS)),
)
def test_every_read_path_returns_the_committed_values_or_names_the_damage(
    clean, tmp_path, backend, pick, how, where, bit, path
):
    template, work = clean[backend]
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)
    files = _files(work)
    target = files[pick % len(files)]
    partner = _damage(target, how, where, bit, files)
    damaged = [target] if partner is None else [target, partner]
    location = str(work / "buffer")
    try:
        PATHS[path](location, Expected(backend), tempfile.mkdtemp(dir=tmp_path))
    except REPLAYBUF_ERRORS as error:
        event("a named error")
        assert _names_damage(str(error), work, damaged), (
            f"{path}: {type(error).__name__} names no damaged file: {error}"
        )
    else:
        event("the committed values")


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_cached_reader_names_the_file_of_a_damaged_meta_value(tmp_path, backend):
    """Before: a ``cache='disk'`` reader's MetaChecksumError named only ``meta/score in <folder>``:
    the read cache did not pass on its storage's ``data_file``."""
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(location, MAX_EPISODES, MAX_TIMESTEPS, FIELDS, META_FIELDS, backend=backend)
    for slot, length in enumerate(COLD_LENGTHS):
        writer.store_episode(**_episode(slot, length))
    writer.close()
    plain = _open(location)
    damaged_file = plain.storage.data_file("score", meta=True)
    plain.close()
    flipped = np.float32(_episode(1, 1)["score"]).view(np.uint32) ^ np.uint32(1)
    if backend == "memmap":
        np.load(damaged_file, mmap_mode="r+")[1] = flipped.view(np.float32)
    else:
        file, dataset = damaged_file.split(":")
        with h5py.File(file, "r+") as f:
            f[dataset][1] = flipped.view(np.float32)
    with pytest.raises(MetaChecksumError, match=f"one flipped bit.*{re.escape(damaged_file)}"):
        _open(location, cache="disk", cache_dir=str(tmp_path / "cache")).get_all_data()


def _committed(location: str, backend: str, lengths: list[int]) -> None:
    writer = ReplayBuffer(location, MAX_EPISODES, MAX_TIMESTEPS, FIELDS, META_FIELDS, backend=backend)
    for slot, length in enumerate(lengths):
        writer.store_episode(**_episode(slot, length))
    writer.close()


def _flip_length_bit(location: str, backend: str, slot: int, bit: int) -> None:
    """Flip bit ``bit`` of ``slot``'s stored length (an int32) in its file."""
    _flip_length_bit_in(_length_file(location, backend), backend, slot, bit)


def _length_file(location: str, backend: str) -> str:
    """The file holding the stored lengths (``file:dataset`` for hdf5)."""
    if backend == "zarr":
        return str(Path(location) / "meta" / "episode_lens" / "c.0")
    reader = _open(location)
    where = reader.storage.data_file("episode_lens", meta=True)
    reader.close()
    return where


def _flip_length_bit_in(where: str, backend: str, slot: int, bit: int) -> None:
    """Flip bit ``bit`` of ``slot``'s stored length in ``where`` (``_length_file``)."""
    if backend == "zarr":
        chunk = Path(where)
        stored = bytearray(chunk.read_bytes())
        stored[4 * slot + bit // 8] ^= 1 << bit % 8
        chunk.write_bytes(bytes(stored))
    elif backend == "memmap":
        np.load(where, mmap_mode="r+")[slot] ^= 1 << bit
    else:
        file, dataset = where.split(":")
        with h5py.File(file, "r+") as f:
            f[dataset][slot] ^= 1 << bit


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_snapshot_view_calls_a_changed_length_of_its_episode_damage_not_an_overwrite(tmp_path, backend):
    """Before: SnapshotError said the episode was overwritten or dropped, naming no damaged file.
    (Format 4: from format 5 every open finds a changed length first, as below.)"""
    location = released_copy("format-v4", backend, tmp_path)
    writer = ReplayBuffer.from_folder(location)
    writer.snapshot(SNAPSHOT)
    writer.close()
    _flip_length_bit(location, backend, 0, 0)  # 4 -> 5
    with pytest.raises(BufferDamagedError, match=r"meta/episode_lens .* or snapshot 'fuzz' \(replaybuf/snapshots/fuzz"):
        _open(location, snapshot=SNAPSHOT)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_flipped_length_bit_is_refused_by_every_open_naming_the_length_it_was(tmp_path, backend):
    """Format 5: each slot's length is under its meta checksum, so a length damaged within
    [1, max_timesteps] is found by every open (a snapshot's, a cached reader's, a writer's)
    before any data is read, naming the length the checksum matches; before, the episode
    listed with the damaged length until its data was read."""
    location = str(tmp_path / "buffer")
    _committed(location, backend, [6, 4, 7])
    writer = ReplayBuffer.from_folder(location)
    writer.snapshot(SNAPSHOT)
    writer.close()
    _flip_length_bit(location, backend, 0, 0)  # 6 -> 7
    blamed = r"meta/episode_lens: slot 0: holds 7, but the slot's checksum in meta/_meta_sum matches 6"
    opens = (
        lambda: _open(location),
        lambda: _open(location, snapshot=SNAPSHOT),
        lambda: _open(location, cache="disk", cache_dir=str(tmp_path / "cache")),
        lambda: ReplayBuffer.from_folder(location),
    )
    for open_ in opens:
        with pytest.raises(MetaChecksumError, match=blamed) as caught:
            open_()
        assert caught.value.restore == ("episode_lens", 6)
    report = verify(location, repair=True)
    assert [line for line in report if line.startswith("repaired")] == [
        "repaired: restored meta/episode_lens of slot 0 to 6, which its checksum matches"
    ]
    assert _open(location).episode_lens[:3].tolist() == [6, 4, 7] and verify(location) == []


# not hdf5: verify holds data.h5 open, which this process's h5py cannot open to write meanwhile
@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_verify_reads_again_a_commit_caught_midway_by_a_writer_that_closed_since(tmp_path, backend, monkeypatch):
    """Before: a slot verify read between a live writer's two bookkeeping writes, the writer
    closing before verify asked who writes, was reported as a lost length (1 in ~200 verify
    runs beside a writer opening and closing hdf5 in a loop)."""
    from replaybuf.storage.lease import WriterLease

    location = str(tmp_path / "buffer")
    _committed(location, backend, [6, 4, 7])
    lengths = _length_file(location, backend)
    _flip_length_bit_in(lengths, backend, 1, 2)  # slot 1 as read midway: its generation, no length yet
    asked = WriterLease.live_holder

    def writer_finished_and_closed(lease: WriterLease) -> dict | None:
        if not finished:
            finished.append(True)
            _flip_length_bit_in(lengths, backend, 1, 2)  # the writer wrote the length, then closed
        return asked(lease)

    finished: list[bool] = []
    monkeypatch.setattr(WriterLease, "live_holder", writer_finished_and_closed)
    assert verify(location) == [] and finished


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_committed_length_flipped_to_zero_is_damage_not_an_empty_slot(tmp_path, backend):
    """Before: the slot read as one being rewritten, and the episode vanished from every read."""
    location = str(tmp_path / "buffer")
    _committed(location, backend, [6, 4, 7])
    _flip_length_bit(location, backend, 1, 2)  # 4 -> 0
    with pytest.raises(LostLengthError, match=r"committed slots \[1\] hold length 0") as caught:
        _open(location).get_all_data()
    assert caught.value.slots == [1] and "episode_lens" in caught.value.location
    assert isinstance(caught.value, BufferDamagedError) and isinstance(caught.value, StorageError)
    assert any("slots [1] hold length 0" in line for line in verify(location))


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_drop_finished_by_a_writer_that_let_go_before_the_reader_looked_is_no_damage(tmp_path, backend, monkeypatch):
    """Before: a reader whose reads all fell between a drop's two writes (a slow flush) and
    whose look for a live writer came after the writer closed called the slot's length lost."""
    import threading

    location = str(tmp_path / "buffer")
    _committed(location, backend, [6, 4, 7])
    reader = _open(location)
    writer = ReplayBuffer.from_folder(location)
    commit, mid, go = writer._commit, threading.Event(), threading.Event()
    write_meta = commit.write_meta

    def slow_generation_write(name, *args):
        if name == "_generation":  # the length is cleared: the reader reads now
            mid.set()
            go.wait(30)
        write_meta(name, *args)

    monkeypatch.setattr(commit, "write_meta", slow_generation_write)
    dropping = threading.Thread(target=lambda: (writer.drop_episodes([1]), writer.close()))
    dropping.start()
    assert mid.wait(30)
    lease = type(reader.storage.writer_lease())
    live_holder = lease.live_holder

    def holder_looked_up_after_the_writer_closed(self):
        go.set()
        dropping.join(30)
        return live_holder(self)

    monkeypatch.setattr(lease, "live_holder", holder_looked_up_after_the_writer_closed)
    reader.refresh()
    assert reader.episode_lens[:3].tolist() == [6, 0, 7]
    assert not dropping.is_alive()


def _zero_lengths(location: str, backend: str) -> None:
    """Overwrite every stored length with 0, in place."""
    if backend == "zarr":
        chunk = Path(location) / "meta" / "episode_lens" / "c.0"
        chunk.write_bytes(bytes(len(chunk.read_bytes())))
        return
    storage = make_storage(location, backend=backend)
    storage.open(read_only=True)
    where = storage.data_file("episode_lens", meta=True)
    storage.close()
    if backend == "memmap":
        np.load(where, mmap_mode="r+")[:] = 0
    else:
        file, dataset = where.split(":")
        with h5py.File(file, "r+") as f:
            f[dataset][:] = 0


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_zeroed_lengths_file_is_refused_and_repair_restores_every_length(tmp_path, backend):
    """Before: every episode read as empty (get_all_data returned rows of length 0)."""
    location = str(tmp_path / "buffer")
    _committed(location, backend, COLD_LENGTHS)
    with _open(location) as reader:
        before = reader.get_all_data()
    _zero_lengths(location, backend)
    with pytest.raises(LostLengthError, match=r"committed slots \[0, 1, 2\] hold length 0"):
        _open(location)
    with pytest.raises(LostLengthError):
        ReplayBuffer.from_folder(location)  # nor a writer, whose recovery would clear the generations
    assert any("slots [0, 1, 2] hold length 0" in line for line in verify(location))
    report = verify(location, repair=True)
    assert f"restored the lengths of slots [0, 1, 2] to {COLD_LENGTHS}" in report[-1]
    assert verify(location) == []
    with _open(location) as reader:
        after = reader.get_all_data()
    assert after.keys() == before.keys()
    for name, values in before.items():
        np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(values), err_msg=name)


def test_a_lost_length_no_data_checksum_tells_is_restored_from_the_meta_checksum(tmp_path):
    """Zarr fields kept compressed one chunk per episode hold no data checksum that depends on
    the length; from format 5 the slot's meta checksum does, and verify --repair restores it."""
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(
        location, MAX_EPISODES, MAX_TIMESTEPS, {"state": {"dtype": "float", "shape": (3,), "compressor": "zstd"}}
    )
    for length in COLD_LENGTHS:
        writer.store_episode(state=np.ones((length, 3)))
    writer.close()
    _flip_length_bit(location, "zarr", 1, 0)  # 5 -> 4
    _flip_length_bit(location, "zarr", 1, 2)  # 4 -> 0: lost
    with pytest.raises(LostLengthError, match=r"slots \[1\]"):
        _open(location)
    assert verify(location, repair=True)[-1].startswith("repaired: restored the lengths of slots [1] to [5]")
    assert _open(location).episode_lens[:3].tolist() == COLD_LENGTHS


def test_lost_lengths_nothing_tells_are_dropped_by_repair_not_guessed(tmp_path):
    """A format-1 buffer keeps no checksum at all: verify --repair cannot tell its lost lengths,
    so it empties those slots (the buffer opens again) instead of restoring a guess; the slots
    whose lengths were not lost are kept."""
    location = released_copy("format-v1", "memmap", tmp_path)
    _flip_length_bit(location, "memmap", 1, 0)
    _flip_length_bit(location, "memmap", 1, 1)  # 3 -> 0: lost
    with pytest.raises(LostLengthError, match=r"slots \[1\]"):
        _open(location)
    assert "slots [1] lost their lengths and no checksum tells them" in verify(location, repair=True)[-1]
    reader = _open(location)
    assert reader.episode_lens.tolist() == [4, 0, 6] and len(reader) == 2


# ---- zarr shards bound to their field and slot (format 5) ----------------------------------------

SHARD_HOT = [True, False]
SHARD_STATES = ["hot", "compacted"]


def _bound_shards(tmp_path: Path, hot: bool, fields: dict = FIELDS, first: int = 0) -> str:
    """A zarr buffer of the ``COLD_LENGTHS`` episodes (``_episode(first + slot, ...)``), their
    frame shards hot (copied while its writer runs, as a writer killed before compacting leaves
    them) or compacted (by its close)."""
    written, location = tmp_path / "written", tmp_path / "buffer"
    writer = ReplayBuffer(str(written), MAX_EPISODES, MAX_TIMESTEPS, fields, META_FIELDS)
    for slot, length in enumerate(COLD_LENGTHS):
        writer.store_episode(**_episode(first + slot, length))
    writer.flush()
    if hot:
        shutil.copytree(written, location)
    writer.close()
    if not hot:
        shutil.copytree(written, location)
    assert [is_hot_file(str(_shard(str(location), slot))) for slot in range(3)] == [hot] * 3
    return str(location)


def _shard(location: str, slot: int, field: str = "frame") -> Path:
    return Path(location) / "data" / field / f"c.{slot}.0.0.0.0"


def _move_shard(location: str, source: int, target: int) -> None:
    """Copy ``source``'s frame shard over ``target``'s, whole and intact."""
    _shard(location, target).write_bytes(_shard(location, source).read_bytes())


MOVED = r"data/frame: slot 1, .*: the shard holds slot 0's data, not slot 1's: it was copied or moved here from slot 0"
READS_OF_SLOT_1: dict[str, Callable[[str, str], object]] = {
    "get_all_data": lambda location, cache: _open(location).get_all_data(),
    "data[...]": lambda location, cache: _open(location).data["frame"][1, :2],
    "trajectories": lambda location, cache: list(_open(location).dataloader(batch_size=3)),
    "timesteps": lambda location, cache: list(_open(location).dataloader(batch_size=64, timestep_level=True)),
    "n-steps": lambda location, cache: list(
        _open(location).dataloader(batch_size=64, n_steps=2, current_fields=("frame",), next_fields=("frame",))
    ),
    "gather": lambda location, cache: _open(location).storage.gather("frame", np.array([0, 1]), np.array([0, 2])),
    "cache fill": lambda location, cache: _open(location, cache="disk", cache_dir=cache).warm_cache(),
}


@pytest.mark.parametrize("bit", [3, 37, 71, 125], ids=["tag", "slot", "field", "crc32c"])
@pytest.mark.parametrize("hot", SHARD_HOT, ids=SHARD_STATES)
def test_a_flipped_bit_in_a_zarr_shard_s_binding_is_damage(tmp_path, hot, bit):
    location = _bound_shards(tmp_path, hot)
    reader = _open(location)
    index_nbytes = reader.storage.array("frame").index_nbytes  # the binding, then the index and its crc32c
    reader.close()
    shard = _shard(location, 1)
    data = bytearray(shard.read_bytes())
    data[len(data) - index_nbytes + bit // 8] ^= 1 << bit % 8
    shard.write_bytes(bytes(data))
    damaged = r"data/frame: slot 1, .*: the shard's binding to its field and slot .* is damaged or absent"
    with pytest.raises(CorruptChunkError, match=damaged):
        _open(location).get_all_data()
    assert [re.search(damaged, line) is not None for line in verify(location)] == [True]


def test_a_zarr_shard_of_another_field_is_damage_naming_that_field(tmp_path):
    fields = {**FIELDS, "depth": FIELDS["frame"]}  # a second image field, sharded as the frames
    location = _bound_shards(tmp_path, hot=False, fields=fields)
    _shard(location, 1).write_bytes(_shard(location, 1, "depth").read_bytes())
    with pytest.raises(CorruptChunkError, match=r"data/frame: slot 1, .*holds slot 1's data of data/depth, not of"):
        _open(location).get_all_data()


# ---- zarr shards bound to their buffer (format 6) -------------------------------------------------

FOREIGN = (
    r"data/frame: slot 1, .*: the shard holds slot 1's data of another buffer \(or of a field this buffer does "
    r"not have\), not of data/frame: it was copied or moved here"
)


def _copy_shard(source: str, target: str, slot: int) -> None:
    """Copy the buffer at ``source``'s frame shard of ``slot`` over that of the buffer at ``target``."""
    _shard(target, slot).write_bytes(_shard(source, slot).read_bytes())


def _two_buffers(tmp_path: Path, hot: bool) -> tuple[str, str]:
    """Two zarr buffers of the same config and lengths holding other episodes, each its own uuid."""
    return _bound_shards(tmp_path / "a", hot), _bound_shards(tmp_path / "b", hot, first=len(COLD_LENGTHS))


def _shard_moved(tmp_path: Path, hot: bool) -> str:
    """A buffer whose slot 1 holds slot 0's frame shard, whole and intact."""
    location = _bound_shards(tmp_path, hot)
    _move_shard(location, 0, 1)
    return location


def _shard_of_another_buffer(tmp_path: Path, hot: bool) -> str:
    """Buffer A whose slot 1 holds buffer B's frame shard of slot 1 (same config and lengths)."""
    a, b = _two_buffers(tmp_path, hot)
    _copy_shard(b, a, 1)
    return a


# how slot 1's shard came to hold another one: the buffer made so, what the error says
MISPLACED_SHARDS: dict[str, tuple[Callable[[Path, bool], str], str]] = {
    "moved": (_shard_moved, MOVED),
    "another-buffer": (_shard_of_another_buffer, FOREIGN),
}


@pytest.mark.parametrize("read", sorted(READS_OF_SLOT_1))
@pytest.mark.parametrize("hot", SHARD_HOT, ids=SHARD_STATES)
@pytest.mark.parametrize("how", sorted(MISPLACED_SHARDS))
def test_a_zarr_frame_shard_of_another_slot_or_buffer_is_damage(tmp_path, how, hot, read):
    """Before: slot 0's shard copied over slot 1's (format 5), or buffer B's shard of slot 1
    copied over buffer A's (format 6: its binding named only field and slot), read back as slot
    1's episode, and verify passed it. Each read path that reaches slot 1 names the file and
    where the shard came from."""
    make, says = MISPLACED_SHARDS[how]
    location = make(tmp_path, hot)
    with pytest.raises(CorruptChunkError, match=says) as error:
        READS_OF_SLOT_1[read](location, str(tmp_path / "cache"))
    assert error.value.slot == 1 and str(_shard(location, 1)) in str(error.value)


@pytest.mark.filterwarnings("ignore:compaction left the shard")  # the repair's writer finds slot 1 hot
@pytest.mark.parametrize("hot", SHARD_HOT, ids=SHARD_STATES)
@pytest.mark.parametrize("how", sorted(MISPLACED_SHARDS))
def test_verify_names_a_misplaced_zarr_shard_and_repair_drops_that_episode_alone(tmp_path, how, hot):
    """``verify --repair`` never re-seals a shard of another slot or buffer into place: the episode goes."""
    make, says = MISPLACED_SHARDS[how]
    location = make(tmp_path, hot)
    assert [re.search(says, line) is not None for line in verify(location) if "data/frame" in line] == [True]
    assert "repaired: dropped the damaged episodes in slots [1]" in "\n".join(verify(location, repair=True))
    assert verify(location) == []
    reader = _open(location)
    assert reader.valid_episodes().tolist() == [0, 2]
    for slot in (0, 2):
        np.testing.assert_array_equal(reader.episode_frames(slot, "frame"), _episode(slot, COLD_LENGTHS[slot])["frame"])


def test_frame_shards_swapped_between_two_buffers_are_refused(tmp_path):
    """The lead's report: two buffers of one config, two episodes each; B's frame shards of
    slots 0 and 1 copied over A's. ``get_all_data`` returned B's frames beside A's actions."""
    fields = {"frame": ("uint8", (84, 84, 3)), "action": ("float", 2), "reward": "float"}
    locations = [str(tmp_path / name) for name in ("a", "b")]
    for seed, location in enumerate(locations):
        with ReplayBuffer(location, 4, 20, fields) as writer:
            for episode in range(2):
                writer.store_episode(**random_episode(fields, 10, 2 * seed + episode))
    for slot in (0, 1):
        _copy_shard(locations[1], locations[0], slot)
    with pytest.raises(CorruptChunkError, match=r"data/frame: slot 0, .*holds slot 0's data of another buffer"):
        _open(locations[0]).get_all_data()
    assert len([line for line in verify(locations[0]) if "of another buffer" in line]) == 2


def test_a_format_5_zarr_shard_of_another_buffer_still_reads_as_that_slot_s(tmp_path):
    """The documented limit of format 5 (kept as it was: an earlier release writes it): its
    bindings name field and slot only, so another format-5 buffer's shard of the slot reads as
    the slot's frames; a shard moved to another slot is still named."""
    a, b = released_copy("format-v5", "zarr", tmp_path / "a"), released_copy("format-v5", "zarr", tmp_path / "b")
    other = expected_episode(1)  # what a's slot 1 holds (3 steps), other frames
    other["frame"] = 255 - other["frame"]
    with ReplayBuffer.from_folder(b) as writer:  # into slot 1, the oldest
        writer.store_episode(**other)
    _copy_shard(b, a, 1)
    reader = _open(a)
    assert reader.storage.format_version == 5
    np.testing.assert_array_equal(reader.episode_frames(1, "frame"), other["frame"])
    assert verify(a) == []
    _shard(a, 2).write_bytes(_shard(a, 0).read_bytes())
    with pytest.raises(CorruptChunkError, match=r"data/frame: slot 2, .*holds slot 0's data, not slot 2's"):
        _open(a).get_all_data()


def test_a_zarr_length_grown_by_a_flipped_bit_is_restored_not_the_episode_dropped(tmp_path):
    """Before: the frames' shard, one frame short of the grown length, read as 'chunk missing from
    a committed episode', so the data was blamed and ``verify --repair`` dropped a sound episode.
    (Format 4: from format 5 every open finds a changed length first.)"""
    location = released_copy("format-v4", "zarr", tmp_path)
    _flip_length_bit(location, "zarr", 0, 0)  # 4 -> 5
    reader = _open(location)
    blamed = r"slot 0 holds 5 steps, but its data/\w+ (holds whole frames of|matches its checksum at) 4 steps"
    for read in (reader.get_all_data, lambda: reader.data["frame"][0, :5], lambda: reader.episode_frames(0, "frame")):
        with pytest.raises(EpisodeLengthError, match=blamed) as error:
            read()
        assert error.value.matches == 4 and error.value.location.endswith(os.path.join("episode_lens", "c.0"))
    assert verify(location, repair=True)[-1] == (
        "repaired: restored the lengths of slots [0] to [4], where every field's data matches its checksum"
    )
    assert _open(location).episode_lens.tolist() == [4, 3, 6] and verify(location) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_warm_cache_never_serves_an_episode_shortened_by_a_damaged_length(tmp_path, backend):
    """Before: a ``cache='disk'`` reader served the first 4 of the 6 cached rows of slot 0 once
    its stored length had a bit flipped (6 -> 4): a silently shortened episode. (Format 4: from
    format 5 the open refuses it first.)"""
    location, cache = released_copy("format-v4", backend, tmp_path), str(tmp_path / "cache")
    warming = _open(location, cache="disk", cache_dir=cache)
    warming.warm_cache()
    warming.close()
    _flip_length_bit(location, backend, 2, 1)  # 6 -> 4
    reader = _open(location, cache="disk", cache_dir=cache)
    for read in (reader.get_all_data, lambda: reader.data["state"][2, :4]):
        with pytest.raises(EpisodeLengthError, match="slot 2 holds 4 steps, but its data/"):
            read()
