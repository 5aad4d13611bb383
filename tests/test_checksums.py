"""Format 2 integrity: every stored chunk (zarr) or committed episode (memmap, hdf5) carries a
crc32c; damage reads as CorruptChunkError naming field, slot, timesteps and file; ``verify``
lists every damaged episode and ``--repair`` drops exactly those."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaybuf import (
    ChecksumEntryError,
    ChunkChecksumError,
    CorruptChunkError,
    EpisodeLengthError,
    ReplayBuffer,
    ReplayDatasetTimeWindow,
    StorageError,
)
from replaybuf.cli import main
from replaybuf.maintenance import verify
from replaybuf.storage import _local
from replaybuf.storage._codecs import ChunkCodec, ChunkDamage, crc32c

from ._backends import LOCAL_BACKENDS, require
from ._data import random_episode, released_copy

h5py = require("h5py")  # every test reads a buffer of each local backend

# frame: 4096 bytes a step -> sharded, blosc-lz4 (named: noise frames would be measured and
# stored raw); state: packed (format 3: the 4 slots share one raw chunk, a crc32c per episode in
# replaybuf/checksums); raw: no compressor, a chunk per episode
FIELDS = dict(
    frame={"dtype": "uint8", "shape": (32, 32, 4), "compressor": "blosc-lz4"},
    state=("float", 3),
    raw={"dtype": "float", "shape": (2,), "compressor": "none"},
)
LENGTHS = [5, 7, 4]
MAX_TIMESTEPS = 8


def _episode(i: int) -> dict[str, np.ndarray]:
    """Episode ``i``, of LENGTHS[i] steps; no frame byte is 0 or 255."""
    return random_episode(FIELDS, LENGTHS[i], i, frame=lambda rng, shape: rng.integers(1, 255, shape, dtype=np.uint8))


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """One buffer per backend with three committed episodes; tests damage copies of it."""
    root = tmp_path_factory.mktemp("originals")
    for backend in LOCAL_BACKENDS:
        buffer = ReplayBuffer(str(root / backend), 4, MAX_TIMESTEPS, FIELDS, backend=backend, circular=True)
        for i in range(len(LENGTHS)):
            buffer.store_episode(**_episode(i))
        buffer.close()
    return root


def _copy(originals, backend: str, tmp_path) -> str:
    path = str(tmp_path / backend)
    shutil.copytree(originals / backend, path)
    return path


def _damage(path: str, how: str) -> None:
    if how == "delete":
        os.unlink(path)
        return
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[len(data) // 3] ^= 0x10
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    elif how == "garbage":
        data = bytearray(np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())
    with open(path, "wb") as f:
        f.write(data)


def _check_only_slot_1_dropped(path: str) -> None:
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    assert buffer.valid_episodes().tolist() == [0, 2] and buffer.num_episodes == 3  # slot 1: padding
    assert buffer.get_all_data()["episode_lens"].tolist() == [LENGTHS[0], 0, LENGTHS[2]]
    for slot in (0, 2):
        expected = _episode(slot)
        for name in FIELDS:
            np.testing.assert_array_equal(np.asarray(buffer.data[name][slot, : LENGTHS[slot]]), expected[name])
    buffer.get_all_data()


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "garbage", "delete"])
@pytest.mark.parametrize(("field", "key"), [("frame", "c.1.0.0.0.0"), ("raw", "c.1.0.0")])
def test_zarr_damaged_chunk_is_named_reported_and_repaired(originals, tmp_path, capsys, field, key, how):
    path = _copy(originals, "zarr", tmp_path)
    chunk = os.path.join(path, "data", field, key)
    _damage(chunk, how)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    reads = [
        buffer.get_all_data,
        lambda: np.asarray(buffer.data[field][1]),
        lambda: buffer.storage.gather(field, np.full(LENGTHS[1], 1), np.arange(LENGTHS[1])),
    ]
    for read in reads:
        with pytest.raises(CorruptChunkError, match=f"data/{field}: slot 1, timesteps") as raised:
            read()
        assert chunk in str(raised.value) and raised.value.slot == 1 and raised.value.field == f"data/{field}"
    np.testing.assert_array_equal(np.asarray(buffer.data[field][2, :4]), _episode(2)[field])  # others still read
    assert main(["verify", path]) == 1
    assert f"data/{field}: slot 1" in capsys.readouterr().err
    assert main(["verify", "--repair", path]) == 1
    assert "dropped the damaged episodes in slots [1]" in capsys.readouterr().err
    assert verify(path) == []
    _check_only_slot_1_dropped(path)


STATE_ROW = MAX_TIMESTEPS * 3 * 4  # bytes of one slot's row in the packed state chunk


@pytest.mark.parametrize(
    ("how", "at", "damaged"), [("flip", STATE_ROW + 13, [1]), ("truncate", 2 * STATE_ROW + 8, [2])]
)
def test_zarr_packed_rows_are_checked_per_episode(originals, tmp_path, capsys, how, at, damaged):
    """A flipped byte in one slot's row of a packed chunk, or a chunk cut short inside it, is
    that slot's damage alone: named, reported by verify and dropped by --repair."""
    path = _copy(originals, "zarr", tmp_path)
    chunk = os.path.join(path, "data", "state", "c.0.0.0")
    data = bytearray(open(chunk, "rb").read())
    assert len(data) == 4 * STATE_ROW
    if how == "flip":
        data[at] ^= 0x10
    else:
        data = data[:at]
    with open(chunk, "wb") as f:
        f.write(data)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    slot = damaged[0]
    reads = [
        buffer.get_all_data,
        lambda: np.asarray(buffer.data["state"][slot]),
        lambda: buffer.storage.gather("state", np.full(LENGTHS[slot], slot), np.arange(LENGTHS[slot])),
    ]
    for read in reads:
        with pytest.raises(CorruptChunkError, match=f"data/state: slot {slot}, timesteps") as raised:
            read()
        assert chunk in str(raised.value) and raised.value.slot == slot
    for other in sorted({0, 1, 2} - set(damaged)):
        np.testing.assert_array_equal(
            np.asarray(buffer.data["state"][other, : LENGTHS[other]]), _episode(other)["state"]
        )
    assert main(["verify", "--repair", path]) == 1
    assert f"dropped the damaged episodes in slots {damaged}" in capsys.readouterr().err
    assert verify(path) == []


def test_zarr_packed_chunk_or_checksums_missing_is_damage(originals, tmp_path):
    path = _copy(originals, "zarr", tmp_path)
    os.unlink(os.path.join(path, "data", "state", "c.0.0.0"))
    with pytest.raises(CorruptChunkError, match="data/state: slot 0, timesteps 0..7: chunk missing"):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    assert [p.split(",")[0] for p in verify(path) if p.startswith("data/state")] == [
        f"data/state: slot {slot}" for slot in range(3)
    ]
    path = _copy(originals, "zarr", tmp_path / "again")
    os.unlink(os.path.join(path, "replaybuf", "checksums"))
    with pytest.raises(
        ChecksumEntryError, match=r"slot 0: its checksum entry in .*checksums is damaged \(it is missing"
    ):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()


def _flip_committed_byte(path: str, backend: str, field: str, slot: int, step: int, bit: int = 4, at: int = 1) -> None:
    """Flip bit ``bit`` of byte ``at`` (modulo the step's size) of ``data/field[slot, step]``,
    where the backend stores it raw."""
    if backend == "memmap":
        array = np.load(os.path.join(path, f"{field}.data.npy"), mmap_mode="r+")
        step_bytes = array.view(np.uint8).reshape(array.shape[0], array.shape[1], -1)[slot, step]
        step_bytes[at % len(step_bytes)] ^= 1 << bit
        array.flush()
        return
    with h5py.File(os.path.join(path, "data.h5"), "r+", locking=False) as f:
        block = f[f"data/{field}"][slot, step]
        flat = block.view(np.uint8).reshape(-1)
        flat[at % len(flat)] ^= 1 << bit
        f[f"data/{field}"][slot, step] = block


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
@pytest.mark.parametrize("field", ["frame", "state"])
def test_local_backends_check_whole_episodes(originals, tmp_path, capsys, backend, field):
    path = _copy(originals, backend, tmp_path)
    _flip_committed_byte(path, backend, field, 1, 3)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    with pytest.raises(CorruptChunkError, match=f"data/{field}: slot 1, timesteps 0..6: episode fails its crc32c"):
        buffer.get_all_data()
    with pytest.raises(CorruptChunkError, match="slot 1"):
        buffer.storage.read_rows(field, np.array([0, 1]), 0, MAX_TIMESTEPS)
    assert buffer.storage.read_rows(field, np.array([0, 2]), 0, MAX_TIMESTEPS).shape[0] == 2
    buffer.close()
    problems = verify(path)
    assert len(problems) == 1 and f"data/{field}: slot 1" in problems[0] and "data" in problems[0]
    assert main(["verify", "--repair", path]) == 1
    assert "slots [1]" in capsys.readouterr().err
    assert verify(path) == []
    _check_only_slot_1_dropped(path)


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_clean_reads_past_the_lengths_pass_the_checks(originals, backend):
    buffer = ReplayBuffer.from_folder(originals / backend, read_only=True)
    slots = np.arange(3)
    for name in FIELDS:
        out = np.zeros((3, MAX_TIMESTEPS, *buffer.data[name].shape[2:]), buffer.data[name].dtype)
        buffer.storage.read_spans(name, slots, np.zeros(3, np.int64), np.full(3, MAX_TIMESTEPS), out)
        rows = buffer.storage.read_rows(name, slots, 0, MAX_TIMESTEPS)
        for slot in slots:
            np.testing.assert_array_equal(out[slot, : LENGTHS[slot]], _episode(slot)[name])
            np.testing.assert_array_equal(rows[slot, : LENGTHS[slot]], _episode(slot)[name])
    assert verify(originals / backend) == []


def test_hdf5_damaged_compressed_chunk_is_named(tmp_path):
    path = str(tmp_path / "gz")
    buffer = ReplayBuffer(path, 3, MAX_TIMESTEPS, FIELDS, backend="hdf5", storage_options={"compression": "gzip"})
    for i in range(3):
        buffer.store_episode(**_episode(i))
    buffer.close()
    with h5py.File(os.path.join(path, "data.h5"), "r", locking=False) as f:
        offset = f["data/state"].id.get_chunk_info_by_coord((1, 0, 0)).byte_offset
    with open(os.path.join(path, "data.h5"), "r+b") as f:
        f.seek(offset + 4)
        f.write(b"\xff\x00\xff\x00")
    with pytest.raises(CorruptChunkError, match="data/state: slots \\[1\\]"):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    assert any("data/state: slots [1]" in p for p in verify(path))


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_in_place_rewrites_keep_checksums_valid(originals, tmp_path, backend):
    path = _copy(originals, backend, tmp_path)
    buffer = ReplayBuffer.from_folder(path)
    buffer.update([0, 2], state=np.full((2, 4, 3), 7.0, np.float32))
    buffer.store_datapoint(1, 6, "frame", np.full((32, 32, 4), 9, np.uint8))
    buffer.store_episode(**_episode(0))  # slot 3
    buffer.store_episode(**_episode(2))  # slot 0 again: a shorter episode over a rewritten one
    buffer.close()
    assert verify(path) == []
    again = ReplayBuffer.from_folder(path, read_only=True)
    data = again.get_all_data()  # slot order: 0 holds episode 2 now
    np.testing.assert_array_equal(np.asarray(data["frame"][0, :4]), _episode(2)["frame"])
    assert (np.asarray(data["state"][2, :4]) == 7).all() and (np.asarray(data["frame"][1, 6]) == 9).all()


def test_corrupt_chunk_error_is_a_storage_error_and_new_buffers_are_format_7_on_zarr_5_elsewhere(originals):
    assert issubclass(ChecksumEntryError, CorruptChunkError) and issubclass(CorruptChunkError, StorageError)
    attributes = json.loads((originals / "zarr" / "zarr.json").read_text())["attributes"]
    assert attributes["version"] == 7
    assert json.loads((originals / "memmap" / "replaybuf.json").read_text())["version"] == 5
    assert os.path.isfile(originals / "hdf5" / "replaybuf" / "checksums.npy")


def test_dropping_episodes_keeps_the_buffer_writable(originals, tmp_path):
    path = _copy(originals, "zarr", tmp_path)
    buffer = ReplayBuffer.from_folder(path)
    assert buffer.drop_episodes([1, 3]) == [1]
    assert buffer.num_episodes == 3 and len(buffer) == 2  # slot 1 lists as padding
    buffer.store_episode(**_episode(1))  # slot 3
    assert buffer.num_episodes == 4 and verify(path) == []
    lens = buffer.get_all_data()["episode_lens"].tolist()
    assert lens[1] == 0 and lens[3] == len(_episode(1)["state"])  # no committed episode hidden
    buffer.close()
    assert ReplayBuffer.from_folder(path, read_only=True).num_episodes == 4
    reopened = ReplayBuffer.from_folder(path)
    assert reopened.num_episodes == 4  # a writable open's recount keeps it
    with pytest.raises(ValueError, match="drop_episodes: slots must be ints in \\[0, 4\\)"):
        reopened.drop_episodes([4])


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
@pytest.mark.parametrize("reopen", [False, True])
def test_a_dropped_slot_reused_by_a_shorter_episode_holds_nothing_past_its_end(originals, tmp_path, backend, reopen):
    """The dropped episode's steps past a later, shorter episode's end in the slot are gone
    (memmap and hdf5 zeroed only what the published length, 0 once dropped, said was written)."""
    path = _copy(originals, backend, tmp_path)
    buffer = ReplayBuffer.from_folder(path)
    assert buffer.drop_episodes([1]) == [1]
    if reopen:
        buffer.close()
        buffer = ReplayBuffer.from_folder(path)
    for i in (0, 1, 2):  # slots 3, 0, then 1: episode 2, 4 steps where 7 were
        buffer.store_episode(**_episode(i))
    buffer.close()
    assert verify(path) == []
    reader = ReplayBuffer.from_folder(path, read_only=True)
    np.testing.assert_array_equal(np.asarray(reader.data["state"][1, : LENGTHS[2]]), _episode(2)["state"])
    assert not np.asarray(reader.data["frame"][1, LENGTHS[2] :]).any()


# ---- property: random damage to data files never passes silently --------------------------


def _data_files(path: str) -> list[str]:
    files = []
    for field in FIELDS:
        folder = os.path.join(path, "data", field)
        files += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f != "zarr.json"]
    return files


def _reads_original_or_named_error(path: str) -> None:
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    originals = {i: _episode(i) for i in range(3)}

    def check(read, compare) -> None:
        try:
            values = read()
        except CorruptChunkError as e:
            assert e.field is not None and e.slot is not None and e.location is not None
            return
        compare(values)

    def all_data(values) -> None:
        for name in FIELDS:
            for slot in range(3):
                np.testing.assert_array_equal(np.asarray(values[name][slot, : LENGTHS[slot]]), originals[slot][name])

    check(buffer.get_all_data, all_data)
    for name in FIELDS:
        for slot in range(3):
            check(
                lambda name=name, slot=slot: np.asarray(buffer.data[name][slot, : LENGTHS[slot]]),
                lambda v, name=name, slot=slot: np.testing.assert_array_equal(v, originals[slot][name]),
            )

    def batch(values) -> None:
        for (slot, t), frame in zip(values["_indices"].tolist(), values["frame"].numpy()):
            np.testing.assert_array_equal(frame, originals[slot]["frame"][t])

    loader = buffer.dataloader(batch_size=16, timestep_level=True, return_indices=True, fields=["frame"])
    check(lambda: next(iter(loader)), batch)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pick=st.integers(0, 10**6),
    how=st.sampled_from(["flip", "truncate", "delete"]),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
)
def test_random_damage_to_data_files_is_never_silent(originals, pick, how, where, bit):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b")
        shutil.copytree(originals / "zarr", path)
        files = _data_files(path)
        target = files[pick % len(files)]
        data = bytearray(open(target, "rb").read())
        position = int(where * len(data))
        if how == "delete":
            os.unlink(target)
        else:
            if how == "flip":
                data[position] ^= 1 << bit
            else:
                data = data[:position]
            with open(target, "wb") as f:
                f.write(data)
        _reads_original_or_named_error(path)
        # the packed state chunk's last row is slot 3's, which holds no episode: damage there
        # loses nothing (slot 3's next episode is written over its whole row)
        harmless = target.endswith(os.path.join("state", "c.0.0.0")) and position >= 3 * STATE_ROW
        assert verify(path) or harmless, f"{how} of {os.path.relpath(target, path)} at {position} went unreported"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    backend=st.sampled_from(["memmap", "hdf5"]),
    field=st.sampled_from(sorted(FIELDS)),
    slot=st.integers(0, 2),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
)
def test_random_flips_in_committed_rows_are_never_silent(originals, backend, field, slot, where, bit):
    """memmap and hdf5 check whole-episode reads (get_all_data, trajectories) and verify."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b")
        shutil.copytree(originals / backend, path)
        step = int(where * LENGTHS[slot])
        _flip_committed_byte(path, backend, field, slot, step, bit=bit, at=int(where * 1000))
        buffer = ReplayBuffer.from_folder(path, read_only=True)
        with pytest.raises(CorruptChunkError, match=f"data/{field}: slot {slot}, timesteps 0..{LENGTHS[slot] - 1}"):
            buffer.get_all_data()
        buffer.close()
        problems = verify(path)
        assert len(problems) == 1 and f"data/{field}: slot {slot}" in problems[0]


# 64 KiB a step: an episode spans several of the blocks EpisodeChecksums.copy_row checks as it
# copies (256 KiB), and a batch of four is large enough for the parallel copy path
BIG_FRAME = (64, 64, 16)
BIG_LENGTHS = [30, 37, 40, 33]
BIG_STEPS = 40


def _big_buffer(path: str, backend: str) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    frames = [rng.integers(0, 256, (n, *BIG_FRAME), dtype=np.uint8) for n in BIG_LENGTHS]
    buffer = ReplayBuffer(path, len(frames), BIG_STEPS, {"frame": ("uint8", BIG_FRAME)}, backend=backend)
    for frame in frames:
        buffer.store_episode(frame=frame)
    buffer.close()
    return frames


def _frame_file_offset(path: str, backend: str) -> tuple[str, int]:
    """The file holding data/frame raw and the offset of its first byte."""
    if backend == "memmap":
        target = os.path.join(path, "frame.data.npy")
        return target, np.load(target, mmap_mode="r").offset
    target = os.path.join(path, "data.h5")
    with h5py.File(target, "r", locking=False) as f:
        return target, f["data/frame"].id.get_offset()


def _xor_byte(target: str, offset: int) -> None:
    """Flip one byte in place, as another process damaging the file would (the page cache
    every reader maps sees it at once)."""
    fd = os.open(target, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x20]), offset)
    finally:
        os.close(fd)


def _flipped_big_buffer(tmp_path, backend: str) -> tuple[str, list[np.ndarray], str, int]:
    """``_big_buffer`` with one byte of slot 1's step 17 flipped: (path, frames, file, offset)."""
    path = str(tmp_path / backend)
    frames = _big_buffer(path, backend)
    target, base = _frame_file_offset(path, backend)
    offset = base + (BIG_STEPS + 17) * frames[0][0].nbytes + 5
    _xor_byte(target, offset)
    return path, frames, target, offset


def _big_reads(buffer: ReplayBuffer) -> list:
    """A trajectory batch's path (one parallel copy per episode), get_all_data's, a DataLoader's."""
    slots = np.arange(len(BIG_LENGTHS))
    out = np.zeros((len(slots), BIG_STEPS, *BIG_FRAME), np.uint8)

    def spans():
        buffer.storage.read_spans("frame", slots, np.zeros_like(slots), np.full(len(slots), BIG_STEPS), out)
        return out

    loader = buffer.dataloader(batch_size=len(slots))  # made once: making one refreshes a reader
    return [
        spans,
        lambda: buffer.storage.read_rows("frame", slots, 0, BIG_STEPS),
        lambda: np.asarray(next(iter(loader))["frame"]),
    ]


def _check_frames(values: np.ndarray, frames: list[np.ndarray]) -> None:
    for slot, frame in enumerate(frames):
        np.testing.assert_array_equal(values[slot, : len(frame)], frame)


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_local_backends_check_every_read_of_fields_too_large_to_copy(tmp_path, backend, monkeypatch):
    """The pages of a mapped file can change after a read checked them (another process
    writes the file; an evicted page is read again from disk): a field too large for a private
    copy is checked on every whole-episode read. Flips in the first, a middle and the last
    committed block are caught after clean reads; the padding past the length is not checked."""
    monkeypatch.setattr(_local, "CHECKED_COPY_BYTES", 0)
    path = str(tmp_path / backend)
    frames = _big_buffer(path, backend)
    target, base = _frame_file_offset(path, backend)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    reads = _big_reads(buffer)
    for step, damaging in [(0, True), (17, True), (36, True), (38, False)]:  # slot 1 holds 37 steps
        for read in reads:
            _check_frames(read(), frames)
        offset = base + (BIG_STEPS + step) * frames[0][0].nbytes + step * 101  # slot 1
        _xor_byte(target, offset)
        for read in reads:
            if damaging:
                with pytest.raises(CorruptChunkError, match="data/frame: slot 1, timesteps 0..36"):
                    read()
            else:
                read()
        _xor_byte(target, offset)  # undone: the next reads are clean again
    buffer.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_local_backends_serve_their_checked_copy_never_a_later_flip(tmp_path, backend):
    """A small field keeps a private copy of the episodes that passed: a byte flipped in the
    file afterwards is never returned (reads serve the checked copy; a reader without one
    checks the file and raises), and an episode rewritten in place by replaybuf (resealed) is
    read from the file again, not served stale."""
    path = str(tmp_path / backend)
    frames = _big_buffer(path, backend)
    target, base = _frame_file_offset(path, backend)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    reads = _big_reads(buffer)
    for read in reads:
        _check_frames(read(), frames)
    offset = base + (BIG_STEPS + 17) * frames[0][0].nbytes + 5  # slot 1, step 17
    _xor_byte(target, offset)
    for read in reads:
        _check_frames(read(), frames)
    with pytest.raises(CorruptChunkError, match="data/frame: slot 1, timesteps 0..36"):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    _xor_byte(target, offset)
    if backend == "memmap":  # an in-place rewrite while the reader keeps its copy
        writer = ReplayBuffer.from_folder(path)
        frames[1][3] = 77
        writer.store_datapoint(1, 3, "frame", frames[1][3])
        writer.close()
        for read in reads:
            _check_frames(read(), frames)
    buffer.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_sampled_steps_of_a_small_field_are_checked_then_served_from_the_copy(tmp_path, backend):
    """Timestep batches read single steps: a flipped byte in a sampled episode was returned as
    data. Each sampled episode of a field with a private copy is now checked whole once and its
    steps served from the copy: a flip before the check raises, one after it is never seen."""
    path, frames, target, offset = _flipped_big_buffer(tmp_path, backend)
    damaged = ReplayBuffer.from_folder(path, read_only=True)
    episodes, steps = np.array([0, 1, 2]), np.array([3, 4, 5])  # step 4 of slot 1 is intact
    with pytest.raises(CorruptChunkError, match="data/frame: slot 1, timesteps 0..36"):
        damaged.storage.gather("frame", episodes, steps)
    with pytest.raises(CorruptChunkError, match="data/frame: slot 1"):
        for _ in damaged.dataloader(batch_size=16, timestep_level=True):
            pass
    np.testing.assert_array_equal(damaged.storage.gather("frame", np.array([0]), np.array([3])), frames[0][3:4])
    damaged.close()
    _xor_byte(target, offset)  # undone: checked and kept, then flipped again
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    every = np.concatenate([np.full(len(f), slot) for slot, f in enumerate(frames)])
    steps = np.concatenate([np.arange(len(f)) for f in frames])
    expected = np.concatenate(frames)
    batches = list(buffer.dataloader(batch_size=16, timestep_level=True))
    assert sum(len(batch["frame"]) for batch in batches) == len(expected)
    np.testing.assert_array_equal(buffer.storage.gather("frame", every, steps), expected)
    _xor_byte(target, offset)
    np.testing.assert_array_equal(buffer.storage.gather("frame", every, steps), expected)
    buffer.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_sampled_steps_and_windows_of_a_large_field_are_checked_once_per_process(tmp_path, backend, monkeypatch):
    """A field too large for a private copy (frames) returned a flipped byte to timestep and
    window batches. Each sampled episode is now checked whole once per process under its stored
    entry: a flip before the check raises for every per-step path; a slot rewritten in place
    (a new entry) is checked again; a new process checks again."""
    monkeypatch.setattr(_local, "CHECKED_COPY_BYTES", 0)
    path, frames, target, offset = _flipped_big_buffer(tmp_path, backend)
    damaged = ReplayBuffer.from_folder(path, read_only=True)
    slots = np.array([1])
    reads = [
        lambda: damaged.storage.gather("frame", np.array([0, 1]), np.array([3, 4])),  # step 4 is intact
        lambda: damaged.storage.read_rows("frame", slots, 2, 6),
        lambda: damaged.storage.read_spans(
            "frame", slots, np.array([2]), np.array([BIG_STEPS - 2]), np.zeros((1, BIG_STEPS - 2, *BIG_FRAME), np.uint8)
        ),
        lambda: list(damaged.dataloader(batch_size=16, timestep_level=True)),
        lambda: list(ReplayDatasetTimeWindow(damaged, window_length=BIG_STEPS // 2)),
    ]
    for read in reads:
        with pytest.raises(CorruptChunkError, match="data/frame: slot 1, timesteps 0..36"):
            read()
    np.testing.assert_array_equal(damaged.storage.gather("frame", np.array([0]), np.array([3])), frames[0][3:4])
    damaged.close()
    _xor_byte(target, offset)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    np.testing.assert_array_equal(buffer.storage.gather("frame", np.array([1]), np.array([4])), frames[1][4:5])
    if backend == "memmap":  # slot 1 rewritten in place, then damaged: its new entry is checked again
        writer = ReplayBuffer.from_folder(path)
        writer.store_datapoint(1, 3, "frame", np.full(BIG_FRAME, 77, np.uint8))
        writer.close()
        _xor_byte(target, offset)
        with pytest.raises(CorruptChunkError, match="data/frame: slot 1"):
            buffer.storage.gather("frame", np.array([1]), np.array([4]))
        _xor_byte(target, offset)
    buffer.close()
    _xor_byte(target, offset)  # a new process (reader) checks again
    with pytest.raises(CorruptChunkError, match="data/frame: slot 1"):
        ReplayBuffer.from_folder(path, read_only=True).storage.gather("frame", np.array([1]), np.array([4]))


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_forked_workers_share_the_checks_of_a_large_field(tmp_path, backend, monkeypatch):
    """Each sampled episode of a field too large to copy is read whole for its check: DataLoader
    workers forked after a check do not read it again (the record lives in shared memory)."""
    monkeypatch.setattr(_local, "CHECKED_COPY_BYTES", 0)
    path = str(tmp_path / backend)
    frames = _big_buffer(path, backend)
    log = tmp_path / "checks.log"
    crc32c = _local.crc32c

    def logged(data, *args):  # forked workers inherit it and append their pid
        with open(log, "a") as out:
            out.write(f"{os.getpid()}\n")
        return crc32c(data, *args)

    monkeypatch.setattr(_local, "crc32c", logged)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    slots = np.arange(len(frames))
    buffer.storage.gather("frame", slots, np.zeros_like(slots))  # the parent checks every episode
    assert log.read_text().split() == [str(os.getpid())] * len(frames)
    log.unlink()
    loader = buffer.dataloader(batch_size=8, timestep_level=True, num_workers=2, multiprocessing_context="fork")
    assert sum(len(batch["frame"]) for batch in loader) == sum(BIG_LENGTHS)
    assert not log.exists()
    buffer.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_damaged_entry_fails_only_the_batches_that_sample_its_slot(tmp_path, backend):
    """The first batch checks every committed episode of the field: a damaged checksum entry of
    a slot it does not sample must not fail it (nor hide the damage from one that does)."""
    path = str(tmp_path / backend)
    with ReplayBuffer(path, 4, 10, {"x": ("float32", (3,))}, backend=backend) as buffer:
        for episode in range(4):
            buffer.store_episode(x=np.full((10, 3), episode + 1, np.float32))
    sums = np.load(os.path.join(path, "replaybuf", "checksums.npy"), mmap_mode="r+")
    sums[2, 0] ^= np.uint64(1 << 40)
    sums.flush()
    del sums
    reader = ReplayBuffer.from_folder(path, read_only=True)
    values = reader.storage.gather("x", np.array([0, 1, 3]), np.array([1, 2, 3]))
    np.testing.assert_array_equal(values[:, 0], [1, 2, 4])
    with pytest.raises(ChecksumEntryError, match="data/x: slot 2: its checksum entry"):
        reader.storage.gather("x", np.array([0, 2]), np.array([1, 2]))
    reader.close()


def test_zarr_trajectories_of_a_resident_array_serve_the_checked_copy(originals, tmp_path):
    """A zarr array held in RAM (small) serves trajectory batches from its resident copy: its
    rows were checked against their chunks' crc32c when loaded and live in this process's own
    memory, so a shard damaged afterwards is never returned; ``refresh`` sees the file changed,
    reads it again and raises."""
    path = _copy(originals, "zarr", tmp_path)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    frame = buffer.storage.array("frame")

    loader = buffer.dataloader(batch_size=3)  # refreshes the reader: made once

    def trajectories():
        return np.asarray(next(iter(loader))["frame"])

    first = trajectories()
    assert frame.resident_rows_read == 3  # loaded once, checked, then read from RAM
    shard = os.path.join(path, "data", "frame", "c.1.0.0.0.0")
    _damage(shard, "flip")
    np.testing.assert_array_equal(trajectories(), first)
    np.testing.assert_array_equal(first[1, : LENGTHS[1]], _episode(1)["frame"])
    assert frame.resident_rows_read == 3
    buffer.refresh()
    with pytest.raises(CorruptChunkError, match="data/frame: slot 1"):
        trajectories()
    buffer.close()


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_writable_open_reseals_rows_a_killed_edit_left_unsealed(tmp_path, backend):
    """A writer killed inside an in-place edit, after its rows and before their checksums (an odd
    ``_revision`` over rows that fail their crc32c): the next writable open recomputes the
    checksums of those slots from the rows as stored and closes the revision (a new even one)."""
    path = str(tmp_path / backend)
    buffer = ReplayBuffer(path, backend=backend, max_episodes=3, max_timesteps=4, fields={"x": "float"})
    for i in range(3):
        buffer.store_episode(x=np.arange(4.0) + 10 * i)
    committed = buffer._meta["_revision"].copy()
    buffer._commit.write_meta("_revision", np.array([1]), np.array([1]))  # the edit began
    buffer.storage.write_rows("x", np.array([1]), 2, np.array([[7.0]]))  # rows only: no reseal
    buffer.close()
    unfinished = (
        "slot 1: an in-place edit a writer that stopped left unfinished (odd meta/_revision): its rows are as that "
        "writer left them and fail their checksums until the next writable open finishes the edit (verify --repair "
        "does)"
    )
    assert verify(path) == [unfinished]  # not damage: dropped by no repair
    assert verify(path, repair=True) == [  # its writable open closes the edit, and says so
        unfinished,
        "repaired: the writable open finished the unfinished edit of slots [1] (applied again whole from the edit "
        "log; one no log holds, an earlier release's, re-sealed as it was left)",
    ]
    with ReplayBuffer.from_folder(path) as again:
        now = again._meta["_revision"]
        assert now[[0, 2]].tolist() == committed[[0, 2]].tolist() and now[1] % 2 == 0 and now[1] > 1
        assert np.asarray(again.data["x"][1]).tolist() == [10.0, 11.0, 7.0, 13.0]
    assert verify(path) == []


# ---- damaged checksum entries (memmap, hdf5) -------------------------------------------------------

COLUMNS = {name: i for i, name in enumerate(FIELDS)}  # checksums.npy's columns, in schema order
# bit flipped in an entry: a crc bit, the kept bit, a bit of the tag
ENTRY_BITS = {"crc": 5, "kept": 32, "tag": 50}


def _damage_entry(path: str, how: str, slot: int, field: str = "state") -> list[int]:
    """Damage the checksum entry of ``field`` in ``slot`` (swap: with slot 0's); the slots hit."""
    sums = np.load(os.path.join(path, _local.CHECKSUM_FILE), mmap_mode="r+")
    column = COLUMNS[field]
    if how == "zero":
        sums[slot, column] = 0
    elif how == "swap":
        sums[[0, slot], column] = sums[[slot, 0], column]
    else:
        sums[slot, column] ^= np.uint64(1 << ENTRY_BITS[how])
    sums.flush()
    return [0, slot] if how == "swap" else [slot]


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
@pytest.mark.parametrize("how", ["crc", "kept", "tag", "zero", "swap"])
def test_a_damaged_checksum_entry_is_named_reported_and_resealed(originals, tmp_path, capsys, backend, how):
    """A damaged entry of checksums.npy (behind its valid header) is ChecksumEntryError naming
    checksums.npy, the field and the slot, on every read path, never blamed on the data file;
    verify reports it and --repair re-seals it from the data, keeping the episode."""
    path = _copy(originals, backend, tmp_path)
    hit = _damage_entry(path, how, 1)
    sums_file = os.path.join(path, _local.CHECKSUM_FILE)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    loader = buffer.dataloader(batch_size=3)
    reads = [
        buffer.get_all_data,
        lambda: np.asarray(buffer.data["state"][1]),
        lambda: np.asarray(buffer.data["state"][1, : LENGTHS[1]]),
        lambda: next(iter(loader)),
    ]
    for read in reads:
        with pytest.raises(ChecksumEntryError, match=r"data/state: slot (0|1): its checksum entry in .*checksums\.npy"):
            read()
    with pytest.raises(ChecksumEntryError) as raised:
        buffer.storage.read_rows("state", np.array([1]), 0, MAX_TIMESTEPS)
    error = raised.value
    assert (error.location, error.field, error.slot, error.steps) == (sums_file, "data/state", 1, (0, LENGTHS[1]))
    assert "state.data.npy" not in str(error) and "data.h5" not in str(error)
    assert error.data_verified == (how in ("crc", "kept", "tag"))  # the tag or the crc bits still match
    np.testing.assert_array_equal(np.asarray(buffer.data["frame"][1, : LENGTHS[1]]), _episode(1)["frame"])
    buffer.close()
    problems = verify(path)
    assert [p.split(":")[0:2] for p in problems] == [["data/state", f" slot {slot}"] for slot in hit]
    assert all(sums_file in p for p in problems)
    assert main(["verify", "--repair", path]) == 1
    said = capsys.readouterr().err
    assert f"re-sealed the damaged checksum entries of data/state in slots {hit}" in said
    assert ("could not be verified" in said) == (how in ("zero", "swap")) and "dropped" not in said
    assert verify(path) == []
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    assert buffer.valid_episodes().tolist() == [0, 1, 2]
    values = buffer.get_all_data()
    for slot in range(3):
        for name in FIELDS:
            np.testing.assert_array_equal(np.asarray(values[name][slot, : LENGTHS[slot]]), _episode(slot)[name])
    buffer.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_repair_drops_damaged_data_and_reseals_only_entries_of_kept_episodes(originals, tmp_path, capsys, backend):
    """Slot 1's data is damaged and slot 2's entry of another field: slot 1 is dropped (its
    entry is not re-sealed over the damage), slot 2 is kept with its data."""
    path = _copy(originals, backend, tmp_path)
    _flip_committed_byte(path, backend, "frame", 1, 2)
    _damage_entry(path, "zero", 2, field="raw")
    problems = verify(path, repair=True)
    assert problems[-2:] == [
        "repaired: dropped the damaged episodes in slots [1]; 2 episodes remain",
        "repaired: re-sealed the damaged checksum entries of data/raw in slots [2] from the data as stored; "
        "slots [2]: the data could not be verified (it is kept as stored)",
    ]
    assert verify(path) == []
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    assert buffer.valid_episodes().tolist() == [0, 2]
    np.testing.assert_array_equal(np.asarray(buffer.data["raw"][2, : LENGTHS[2]]), _episode(2)["raw"])


def test_an_entry_of_a_reader_s_checked_copy_is_still_checked(tmp_path):
    """A reader serving a field from its private checked copy still refuses an entry damaged
    since: it cannot tell the copy is what the damaged entry was made from."""
    path = str(tmp_path / "memmap")
    buffer = ReplayBuffer(path, 4, MAX_TIMESTEPS, FIELDS, backend="memmap")
    for i in range(3):
        buffer.store_episode(**_episode(i))
    buffer.close()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    reader.get_all_data()  # checked, kept in the copy
    _damage_entry(path, "tag", 2)
    with pytest.raises(ChecksumEntryError, match="slot 2"):
        reader.get_all_data()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.sampled_from(["memmap", "hdf5"]), slot=st.integers(0, 2), field=st.sampled_from(sorted(FIELDS)))
def test_every_single_bit_flip_in_a_committed_entry_is_named(originals, tmp_path_factory, backend, slot, field):
    """Each of the 64 bits of an entry, flipped, is ChecksumEntryError on a whole-episode read
    (the crc bits with odds 1 - 2**-31: the tag no longer matches), and undone reads clean."""
    path = str(tmp_path_factory.mktemp("flips") / backend)
    shutil.copytree(originals / backend, path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    sums = np.load(os.path.join(path, _local.CHECKSUM_FILE), mmap_mode="r+")  # the reader maps the same pages
    for bit in range(64):
        sums[slot, COLUMNS[field]] ^= np.uint64(1 << bit)
        with pytest.raises(ChecksumEntryError, match=f"data/{field}: slot {slot}: its checksum entry"):
            reader.storage.read_rows(field, np.array([slot]), 0, MAX_TIMESTEPS)
        sums[slot, COLUMNS[field]] ^= np.uint64(1 << bit)
    rows = reader.storage.read_rows(field, np.array([slot]), 0, MAX_TIMESTEPS)
    np.testing.assert_array_equal(rows[0, : LENGTHS[slot]], _episode(slot)[field])
    reader.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_slot_being_emptied_keeps_its_entry_for_readers_that_saw_its_length(originals, tmp_path, backend):
    """A writer reusing or dropping a slot unpublishes its length before its generation: a
    reader that read the length just before checks the rows against the slot's entry, which
    stays until the next episode there is sealed (a cleared entry would read as damage while
    the generation still says nothing changed)."""
    path = _copy(originals, backend, tmp_path)
    reader = ReplayBuffer.from_folder(path, read_only=True)
    writer = ReplayBuffer.from_folder(path)
    writer.storage.mark_writing([1])  # a drop of slot 1: its record, then its length
    writer.storage.write_meta("episode_lens", np.array([1]), np.zeros(1, np.int32))
    checksums = reader.storage._checksums
    expected = checksums.expected("state", np.array([1]), np.array([MAX_TIMESTEPS]), np.array([LENGTHS[1]]))
    rows = writer.storage.unchecked_rows("state", np.array([1]), 0, LENGTHS[1])
    checksums.check_row("state", 1, rows[0], expected[0])
    writer.close()
    # as a kill leaves it: the lock file nobody holds (a closed writer deletes it)
    Path(path, "replaybuf", "writer.lock").write_text("{}")
    writer = ReplayBuffer.from_folder(path)  # the killed reuse's stale generation cleared
    for i in (0, 2, 1):  # slots 3, 0, then 1 again: sealed anew
        writer.store_episode(**_episode(i))
    writer.close()
    reader.refresh()
    np.testing.assert_array_equal(np.asarray(reader.data["state"][1, : LENGTHS[1]]), _episode(1)["state"])
    assert verify(path) == []


def _set_length(path: str, backend: str, slot: int, length: int) -> str:
    """Overwrite ``episode_lens[slot]`` in the file as damage would; the file's name as errors give it."""
    if backend == "memmap":
        target = os.path.join(path, "episode_lens.data.meta.npy")
        lens = np.load(target, mmap_mode="r+")
        lens[slot] = length
        lens.flush()
        return target
    with h5py.File(os.path.join(path, "data.h5"), "r+", locking=False) as f:
        f["meta/episode_lens"][slot] = length
    return f"{os.path.join(path, 'data.h5')}:/meta/episode_lens"


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
@pytest.mark.parametrize("length", [1, 5, 6])
def test_a_damaged_length_is_named_and_restored_not_blamed_on_the_data(tmp_path, backend, length):
    """A length changed within [1, max_timesteps] makes every field fail its checksum: the data
    matches at the committed length, so the error names episode_lens (EpisodeLengthError) and
    --repair restores the length instead of dropping the episode. (Format 4, whose meta
    checksums leave lengths out: from format 5 every open finds a changed length first.)"""
    path = released_copy("format-v4", backend, tmp_path)
    with ReplayBuffer.from_folder(path, read_only=True) as buffer:
        before = {name: np.asarray(values) for name, values in buffer.get_all_data().items()}
    target = _set_length(path, backend, 1, length)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    for read in (buffer.get_all_data, lambda: np.asarray(buffer.data["frame"][1])):
        with pytest.raises(EpisodeLengthError, match=rf"slot 1 holds {length} steps, but its data/\w+ matches") as e:
            read()
        assert (e.value.location, e.value.matches, e.value.slot) == (target, 3, 1)
    buffer.close()
    problems = verify(path, repair=True)
    assert len(problems) == len(buffer.schema.fields) + 1 and all(target in p for p in problems[:-1])
    assert problems[-1] == (
        "repaired: restored the lengths of slots [1] to [3], where every field's data matches its checksum"
    )
    assert verify(path) == []
    with ReplayBuffer.from_folder(path, read_only=True) as buffer:
        for name, values in buffer.get_all_data().items():
            np.testing.assert_array_equal(np.asarray(values), before[name], err_msg=name)


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_damaged_length_over_damaged_data_is_dropped(originals, tmp_path, backend):
    path = _copy(originals, backend, tmp_path)
    _set_length(path, backend, 1, 6)
    _flip_committed_byte(path, backend, "state", 1, 2)  # the data no longer matches at any length
    problems = verify(path, repair=True)
    assert problems[-1] == "repaired: dropped the damaged episodes in slots [1]; 2 episodes remain"
    assert verify(path) == []
    _check_only_slot_1_dropped(path)


@pytest.mark.parametrize(("how", "verified"), [("kept", True), ("high", True), ("zero", False)])
def test_zarr_a_damaged_packed_entry_is_named_not_skipped(originals, tmp_path, capsys, how, verified):
    """A packed field's entry without its kept bit (or with a high bit set) was read as "no
    checksum kept", turning the check off: it is a damaged entry, named, and re-sealed."""
    path = _copy(originals, "zarr", tmp_path)
    sums_file = os.path.join(path, "replaybuf", "checksums")
    sums = np.fromfile(sums_file, "<u8")  # (slots, packed fields): state is the one packed field
    assert len(sums) == 4
    sums[1] = 0 if how == "zero" else sums[1] ^ np.uint64(1 << (32 if how == "kept" else 40))
    sums.tofile(sums_file)
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    for read in (buffer.get_all_data, lambda: np.asarray(buffer.data["state"][1])):
        with pytest.raises(ChecksumEntryError, match=r"data/state: slot 1: its checksum entry in .*checksums") as e:
            read()
        assert (e.value.location, e.value.data_verified) == (sums_file, verified)
    buffer.close()
    assert main(["verify", "--repair", path]) == 1
    said = capsys.readouterr().err
    assert "re-sealed the damaged checksum entries of data/state in slots [1]" in said and "dropped" not in said
    assert verify(path) == []
    _check_all_kept(path)


def _check_all_kept(path: str) -> None:
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    assert buffer.valid_episodes().tolist() == [0, 1, 2]
    values = buffer.get_all_data()
    assert values["episode_lens"].tolist() == LENGTHS
    for slot in range(3):
        for name in FIELDS:
            np.testing.assert_array_equal(np.asarray(values[name][slot, : LENGTHS[slot]]), _episode(slot)[name])


def test_verify_compares_steps_past_a_length_as_bytes(tmp_path):
    """Past an episode's length only the bytes of 0 or of the field's default are clean: a
    flipped sign bit (-0.0 == 0.0 as a value) is reported and repaired, a NaN default is not
    reported (NaN != NaN as a value)."""
    path = str(tmp_path / "b")
    fields = {"x": ("float32", 3), "y": {"dtype": "float32", "shape": (2,), "default": float("nan")}}
    buffer = ReplayBuffer(path, 2, 8, fields)
    buffer.store_episode(x=np.ones((5, 3), np.float32), y=np.ones((5, 2), np.float32))
    buffer.close()
    assert verify(path) == []  # y's padding is NaN, byte for byte its default
    chunk = os.path.join(path, "data", "x", "c.0.0.0")
    data = bytearray(open(chunk, "rb").read())
    data[6 * 12 + 3] ^= 0x80  # step 6 (past the length 5), the sign bit of its first value
    open(chunk, "wb").write(data)
    assert verify(path) == ["data/x: slot 0 (length 5) holds data beyond its length at timesteps 6..6"]
    assert verify(path, repair=True)[-1].startswith("repaired: set the steps beyond the lengths of slots [0]")
    assert verify(path) == []


# ---- a chunk's own crc32c damaged, its data sound ----------------------------------------------

# image: sharded, compressible (a compacted shard is blosc-lz4; one a writer still holds is hot,
# stored raw); raw: a chunk file per episode; each stored chunk ends with its crc32c
TRAILED_FIELDS = {
    "image": {"dtype": "uint8", "shape": (32, 32, 4), "compressor": "blosc-lz4:9"},
    "raw": {"dtype": "float", "shape": (2,), "compressor": "none"},
}


def _trailed_episode(i: int) -> dict[str, np.ndarray]:
    image = np.zeros((LENGTHS[i], 32, 32, 4), np.uint8)
    image[:, :8, :8] = np.arange(1, LENGTHS[i] + 1, dtype=np.uint8)[:, None, None, None] + 10 * i
    return {"image": image, "raw": random_episode(TRAILED_FIELDS, LENGTHS[i], i)["raw"]}


@pytest.fixture(scope="module")
def trailed(tmp_path_factory):
    """Two copies of a zarr buffer of three episodes: 'hot', taken while its writer still held
    the episodes' shards raw, and 'compacted', the buffer once closed."""
    root = tmp_path_factory.mktemp("trailed")
    buffer = ReplayBuffer(str(root / "compacted"), 4, MAX_TIMESTEPS, TRAILED_FIELDS, circular=True)
    for i in range(len(LENGTHS)):
        buffer.store_episode(**_trailed_episode(i))
    shutil.copytree(root / "compacted", root / "hot")
    buffer.close()
    return root


def _shard_index(path: str) -> np.ndarray:
    data = open(path, "rb").read()
    return np.frombuffer(data[-(16 * MAX_TIMESTEPS + 4) : -4], "<u8").reshape(MAX_TIMESTEPS, 2)


def _flip_bit(path: str, offset: int, bit: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 1 << bit
    with open(path, "wb") as f:
        f.write(data)


def _trailer_offset(path: str, where: str) -> int:
    """The offset in ``path`` of a byte of the crc32c named by ``where``."""
    if where == "inner chunk 2":
        offset, nbytes = _shard_index(path)[2]
        return int(offset + nbytes) - 3
    return os.path.getsize(path) - 2  # the shard index's crc32c, or the chunk file's


@pytest.mark.parametrize("state", ["hot", "compacted"])
@pytest.mark.parametrize(
    ("field", "key", "where"),
    [("image", "c.1.0.0.0.0", "inner chunk 2"), ("image", "c.1.0.0.0.0", "shard index"), ("raw", "c.1.0.0", "chunk")],
)
def test_zarr_a_flipped_bit_of_a_chunk_s_own_crc32c_is_resealed_not_the_episode_dropped(
    trailed, tmp_path, capsys, state, field, key, where
):
    """A bit flipped in the crc32c a stored chunk (an inner chunk of a shard, a shard index, a
    chunk file) carries read as damaged data, and ``verify --repair`` dropped the sound
    episode: reads name the damaged checksum, the repair rewrites the chunk with its crc32c."""
    path = str(tmp_path / "b")
    shutil.copytree(trailed / state, path)
    chunk = os.path.join(path, "data", field, key)
    if field == "image":
        assert (open(chunk, "rb").read(3)[2] & 0x02 != 0) == (state == "hot")  # blosc's MEMCPYED flag
    _flip_bit(chunk, _trailer_offset(chunk, where), 5)
    before = open(chunk, "rb").read()
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    for read in (buffer.get_all_data, lambda: np.asarray(buffer.data[field][1])):
        with pytest.raises(ChunkChecksumError, match=r"data/\w+: slot 1, timesteps .*stored crc32c is damaged") as e:
            read()
        assert isinstance(e.value, CorruptChunkError) and isinstance(e.value, ChecksumEntryError)
        assert e.value.data_verified and e.value.slot == 1 and e.value.location.startswith(chunk)
        assert "one bit away" in str(e.value) and "verify --repair" in str(e.value)
    buffer.close()
    found = verify(path)
    assert len(found) == 1 and "data/" + field in found[0] and chunk in found[0]
    assert open(chunk, "rb").read() == before  # verify alone changes nothing
    assert main(["verify", "--repair", path]) == 1
    said = capsys.readouterr().err
    assert f"repaired: re-sealed in place the damaged crc32c of data/{field}, slot 1: {chunk}" in said
    assert "the episode is kept" in said and "dropped" not in said
    assert verify(path) == []
    after = open(chunk, "rb").read()
    if field == "image" and state == "hot":  # the repair's writer compacted the re-sealed shard as it closed
        assert not after[2] & 0x02 and len(after) < len(before)
    else:
        assert len(after) == len(before) and sum(a != b for a, b in zip(after, before)) == 1  # only that byte
    buffer = ReplayBuffer.from_folder(path, read_only=True)
    assert buffer.valid_episodes().tolist() == [0, 1, 2]
    values = buffer.get_all_data()
    for slot in range(3):
        for name in TRAILED_FIELDS:
            np.testing.assert_array_equal(np.asarray(values[name][slot, : LENGTHS[slot]]), _trailed_episode(slot)[name])
    buffer.close()


@pytest.mark.parametrize("other", ["data", "missing chunk", "two crc bits"])
def test_zarr_a_chunk_s_crc32c_damaged_beside_other_damage_drops_the_episode(trailed, tmp_path, other):
    """Only damage the data cannot explain is re-sealed: a second flipped bit in the crc32c, a
    flipped data bit in a later chunk of the episode (past the chunk a read stops at) or a
    missing chunk is damaged data, and the episode is dropped as before."""
    path = str(tmp_path / "b")
    shutil.copytree(trailed / "compacted", path)
    chunk = os.path.join(path, "data", "image", "c.1.0.0.0.0")
    _flip_bit(chunk, _trailer_offset(chunk, "inner chunk 2"), 5)
    if other == "data":
        offset, nbytes = _shard_index(chunk)[5]
        _flip_bit(chunk, int(offset + nbytes // 2), 0)
    elif other == "missing chunk":  # inner chunk 5 of 7 committed steps left out of a sealed index
        index = _shard_index(chunk).copy()
        index[5] = 2**64 - 1
        data = open(chunk, "rb").read()[: -(16 * MAX_TIMESTEPS + 4)] + index.tobytes()
        with open(chunk, "wb") as f:
            f.write(data + crc32c(index.tobytes()).to_bytes(4, "little"))
    else:
        _flip_bit(chunk, _trailer_offset(chunk, "inner chunk 2"), 6)
    problems = verify(path, repair=True)
    assert problems[-1] == "repaired: dropped the damaged episodes in slots [1]; 2 episodes remain"
    assert not any("re-sealed" in line for line in problems)
    assert verify(path) == []


@pytest.mark.parametrize("compressor", [None, {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5}}])
def test_only_a_flipped_bit_of_a_chunk_s_crc32c_is_called_checksum_damage(compressor):
    """Every single-bit flip of a checksummed chunk fails its decode (one by one and in runs,
    ``decode_many_into``): as checksum damage for the 32 bits of its crc32c, as damaged data
    for every bit before it."""
    codec = ChunkCodec(np.dtype("uint8"), compressor, checksum=True)
    chunk = np.arange(48, dtype=np.uint8).reshape(1, 48)
    stored = codec.encode(chunk)
    for bit in range(8 * len(stored)):
        flipped = bytearray(stored)
        flipped[bit // 8] ^= 1 << (bit % 8)
        in_crc = bit >= 8 * (len(stored) - 4)
        with pytest.raises(ChunkDamage) as one:
            codec.decode(bytes(flipped), chunk.shape)
        run = bytes(stored) + bytes(flipped)
        out = np.zeros((2, 48), np.uint8)
        with pytest.raises(ChunkDamage) as many:
            codec.decode_many_into(run, [(0, len(stored)), (len(stored), len(run))], out, [0, 48], 48)
        assert many.value.item == 1
        assert one.value.checksum_only == many.value.checksum_only == in_crc, bit
