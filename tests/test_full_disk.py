"""A disk that fills up while a buffer works: every write path raises an error naming the file,
what was committed reads back as it was, the episode in progress is kept whole or not at all,
and once space is freed the same object (or a reopen) goes on as before.

One small tmpfs for the module (mounted by the test: we may run as root; skipped where a mount
is refused); a ballast file fills it at the moment a test chooses.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import resource
import shutil
import subprocess
import warnings

import numpy as np
import pytest

from replaybuf import ReplayBuffer, StorageError, convert, verify
from replaybuf.importers import export_diffusion_policy, export_lerobot
from replaybuf.storage import _kv
from replaybuf.storage._hotmap import shard_maps
from replaybuf.storage._kv import LocalKV
from replaybuf.video import blocks_to_video

from ._backends import LOCAL_BACKENDS as LOCAL
from ._backends import holds_files_under, tmpfs
from ._backends import snapshot as snapshot_of_folder

IMAGE = (64, 64, 3)  # a frame over 4 KiB: zarr stores it in its own shard per slot, hot
FIELDS = {"image": ("uint8", IMAGE), "state": ("float", 3)}


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    with tmpfs(tmp_path_factory.mktemp("fulldisk"), "6m") as folder:
        yield folder


@pytest.fixture
def disk(mount):
    """The tmpfs, emptied after the test. Maps and open files of earlier tests' buffers are let
    go first: space they hold is freed when they go, which would make room a test just filled."""
    release(mount)
    yield mount
    release(mount)
    for entry in os.listdir(mount):
        path = os.path.join(mount, entry)
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


def release(mount) -> None:
    """Drop this process's maps and kept handles of files on the tmpfs (deleted files keep their
    space while mapped or open)."""
    shard_maps().drop_under(str(mount))
    _kv._read_handles.drop_under(str(mount))
    if holds_files_under(mount):  # else a collection frees nothing there
        gc.collect()


def fill(disk) -> None:
    """Take every free byte of the tmpfs with a ballast file."""
    fd = os.open(os.path.join(disk, "ballast"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            for block in (1 << 16, 1 << 12, 1):
                while True:
                    os.write(fd, b"\0" * block)
    finally:
        os.close(fd)


def free(disk) -> None:
    os.unlink(os.path.join(disk, "ballast"))


def episode(seed: int, length: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # compressible frames (zarr keeps them hot, then compacts them)
    frames = np.repeat(rng.integers(0, 255, (length, IMAGE[0], IMAGE[1] // 4, 3), dtype=np.uint8), 4, axis=2)
    return {"image": frames, "state": rng.standard_normal((length, 3)).astype(np.float32)}


def assert_holds(buffer: ReplayBuffer, episodes: list[dict[str, np.ndarray]]) -> None:
    assert len(buffer) == len(episodes)
    for slot, stored in enumerate(episodes):
        for name, values in stored.items():
            np.testing.assert_array_equal(np.asarray(buffer.data[name][slot])[: len(values)], values)


def new(location, backend: str, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(location, max_episodes=8, max_timesteps=8, fields=FIELDS, backend=backend, **kwargs)


def assert_disk_full(error: pytest.ExceptionInfo, folder) -> None:
    message = str(error.value)
    assert "no space left" in message.lower(), message
    # names the file, or the buffer's folder when the write was refused before it started
    assert str(folder) + os.sep in message or f"{str(folder)!r}" in message and "nothing was written" in message, (
        message
    )


@pytest.mark.parametrize("backend", LOCAL)
def test_store_episode_on_a_full_disk(disk, backend):
    folder = disk / "buf"
    buffer = new(folder, backend)
    kept = [episode(1), episode(2)]
    for stored in kept:
        buffer.store_episode(**stored)
    fill(disk)
    with pytest.raises(StorageError) as error:
        for seed in range(3, 9):  # memmap and hdf5 reserve their data: their counters fill the disk
            buffer.store_episode(**episode(seed))
            buffer.flush()
            kept.append(episode(seed))
    assert_disk_full(error, folder)
    if "counters are written again" in str(error.value):  # the episode is committed, and says so
        kept.append(episode(seed))
    else:
        assert "the episode was not stored" in str(error.value)
    assert_holds(buffer, kept)
    free(disk)
    buffer.store_episode(**episode(20))
    kept.append(episode(20))
    buffer.close()
    assert verify(folder) == []
    with ReplayBuffer.from_folder(folder, read_only=True) as again:
        assert_holds(again, kept)


@pytest.mark.parametrize("backend", LOCAL)
def test_steps_on_a_full_disk_roll_the_episode_back(disk, backend):
    folder = disk / "buf"
    buffer = new(folder, backend)
    kept = [episode(1)]
    buffer.store_episode(**kept[0])
    fill(disk)
    steps = episode(2)
    with pytest.raises(StorageError, match="steplog") as error, buffer.one_episode():
        for t in range(6):
            buffer.store(image=steps["image"][t], state=steps["state"][t])
    assert_disk_full(error, folder)
    assert buffer.timestep_index == 0  # the block's exception rolled its episode back
    assert_holds(buffer, kept)
    free(disk)
    # a step refused outside one_episode is taken back: the episode keeps its earlier steps
    for t in range(2):
        buffer.store(image=steps["image"][t], state=steps["state"][t])
    fill(disk)
    with pytest.raises(StorageError, match="this step was not stored") as error:
        buffer.store(image=steps["image"][2], state=steps["state"][2])
    assert_disk_full(error, folder)
    assert buffer.timestep_index == 2
    free(disk)
    for t in range(2, 6):
        buffer.store(image=steps["image"][t], state=steps["state"][t])
    buffer.advance_episode()
    kept.append(steps)
    buffer.close()
    assert verify(folder) == []  # no step log left behind
    with new(folder, backend, overwrite=False) as again:  # a writable open commits nothing more
        assert_holds(again, kept)


def test_a_commit_on_a_full_disk_keeps_the_episode_whole_or_not_at_all(disk):
    folder = disk / "buf"
    buffer = new(folder, "zarr", flush_every_store_step=0)
    kept = [episode(1)]
    buffer.store_episode(**kept[0])
    fill(disk)
    steps = episode(2)
    with pytest.raises(StorageError) as error, buffer.one_episode():
        for t in range(6):
            buffer.store(image=steps["image"][t], state=steps["state"][t])
    assert_disk_full(error, folder)
    assert "discarded" in str(error.value)
    assert_holds(buffer, kept)
    free(disk)
    buffer.store_episode(**steps)
    buffer.close()
    assert verify(folder) == []
    with ReplayBuffer.from_folder(folder, read_only=True) as again:
        assert_holds(again, [*kept, steps])


def test_hdf5_reserves_its_file_and_a_compressed_one_refuses_before_writing(disk):
    plain = new(disk / "plain", "hdf5")
    stat = os.stat(disk / "plain" / "data.h5")
    assert stat.st_blocks * 512 >= stat.st_size  # every block on disk: a write never needs space
    plain.store_episode(**episode(1))
    plain.close()
    folder = disk / "gzip"
    buffer = new(folder, "hdf5", storage_options={"compression": "gzip"})
    buffer.store_episode(**episode(1))
    before = (folder / "data.h5").read_bytes()
    fill(disk)
    # h5py reports a failed write only as a warning when it frees a handle: refused up front
    with pytest.raises(StorageError, match=r"no space left on the disk of .*data\.h5.*nothing was written"):
        buffer.store_episode(**episode(2))
    with pytest.raises(StorageError, match=r"no space left on the disk of .*data\.h5"):
        buffer.data["state"][0, 0] = np.zeros(3, np.float32)  # an edit in place too
    buffer.storage.flush()
    assert (folder / "data.h5").read_bytes() == before
    assert_holds(buffer, [episode(1)])
    free(disk)
    buffer.store_episode(**episode(2))
    buffer.close()
    assert verify(folder) == []


def test_a_failed_log_append_is_cut_back_to_its_last_record(disk):
    kv = LocalKV(str(disk / "kv"))
    kv.append("log", b"whole record")
    fill(disk)
    with pytest.raises(StorageError, match=r"kv/log.*No space left"):
        kv.append("log", b"x" * (1 << 20))
    free(disk)
    assert kv.get("log") == b"whole record"
    kv.append("log", b"+next")
    assert kv.get("log") == b"whole record+next"
    kv.close()


def test_a_failed_write_of_many_leaves_no_write_running(tmp_path):
    """A write of many objects that fails is raised only once its other writes have finished:
    a caller that cleans up after it (a create cut short) found temp files still being written."""
    kv = LocalKV(str(tmp_path / "kv"))
    os.makedirs(tmp_path / "kv" / "blocked")  # a folder where an object goes: its write fails at once
    big = {f"big{i}": bytes(64 << 20) for i in range(3)}
    with pytest.raises(StorageError, match="blocked"):
        kv.set_many({"blocked": b"x", **big})
    assert not [name for name in os.listdir(tmp_path / "kv") if name.endswith(".partial")]
    assert all(os.path.getsize(tmp_path / "kv" / key) == 64 << 20 for key in big)


def test_a_writable_open_on_a_full_disk_leaves_no_lock_behind(disk):
    folder = disk / "buf"
    new(folder, "memmap").close()
    fill(disk)
    with pytest.raises(StorageError, match=r"writer\.lock.*No space left"):
        new(folder, "memmap", overwrite=False)
    free(disk)
    with new(folder, "memmap", overwrite=False) as buffer:  # not locked by "an unknown writer"
        buffer.store_episode(**episode(1))


def test_a_full_read_cache_never_fails_a_read(disk, tmp_path):
    kept = [episode(seed) for seed in range(4)]
    with new(tmp_path / "buf", "zarr") as buffer:
        for stored in kept:
            buffer.store_episode(**stored)
    reader = ReplayBuffer.from_folder(tmp_path / "buf", read_only=True, cache="disk", cache_dir=disk / "cache")
    fill(disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader.warm_cache()
        assert_holds(reader, kept)
        batch = next(iter(reader.dataloader(batch_size=8, timestep_level=True)))
    assert batch["image"].shape == (8, *IMAGE)
    full = [w for w in caught if "is full" in str(w.message)]
    assert len(full) == 1 and str(disk / "cache") in str(full[0].message)
    assert not [name for _, _, files in os.walk(disk / "cache") for name in files if name.startswith(".tmp-")]
    reader.close()


def test_convert_into_a_full_destination_leaves_no_half_buffer(disk, tmp_path):
    with new(tmp_path / "src", "zarr") as buffer:
        for seed in range(8):
            buffer.store_episode(**episode(seed, length=8))
    fill(disk)
    free_bytes = os.statvfs(disk).f_bavail
    os.truncate(disk / "ballast", os.path.getsize(disk / "ballast") - (256 << 10))  # room for a part
    with pytest.raises(StorageError) as error:
        convert(tmp_path / "src", disk / "dst")
    assert_disk_full(error, disk / "dst")
    assert not (disk / "dst").exists()
    assert os.statvfs(disk).f_bavail >= free_bytes
    assert verify(tmp_path / "src") == []


def test_the_command_line_reports_a_full_disk_as_a_failure_not_a_usage_error(disk, tmp_path, capsys):
    """``replaybuf convert`` into a full disk printed the whole usage text and exited 2, as for
    a mistyped argument; the disk's answer is a failure of the command (status 1)."""
    from replaybuf.cli import main

    with new(tmp_path / "src", "zarr") as buffer:
        buffer.store_episode(**episode(0, length=8))
    fill(disk)
    assert main(["convert", str(tmp_path / "src"), str(disk / "dst")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("replaybuf convert: ") and "no space left" in error.lower(), error
    assert "usage:" not in error
    assert not (disk / "dst").exists()


def test_a_sparse_hdf5_file_of_an_earlier_release_is_reserved_at_a_writable_open(disk):
    folder = disk / "buf"
    new(folder, "hdf5").close()
    path = folder / "data.h5"
    subprocess.run(["cp", "--sparse=always", str(path), str(disk / "sparse.h5")], check=True)
    os.replace(disk / "sparse.h5", path)
    assert os.stat(path).st_blocks * 512 < os.stat(path).st_size
    with new(folder, "hdf5", overwrite=False) as buffer:
        buffer.store_episode(**episode(1))
    assert os.stat(path).st_blocks * 512 >= os.stat(path).st_size
    assert verify(folder) == []


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize("room", [8 << 10, 24 << 10])  # a zarr create takes ~48 KiB of pages
def test_a_create_on_a_full_disk_leaves_no_half_buffer(disk, backend, room):
    folder = disk / "buf"
    fill(disk)
    os.truncate(disk / "ballast", os.path.getsize(disk / "ballast") - room)
    # memmap and hdf5 reserve their arrays: refused before anything is written (``check_schema``)
    with pytest.raises(StorageError, match="(?i)no space left|bytes of disk up front"):
        ReplayBuffer(folder, max_episodes=64, max_timesteps=100, fields=FIELDS, backend=backend)
    left = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs] if folder.exists() else []
    assert not left, left
    free(disk)
    with new(folder, backend) as buffer:
        buffer.store_episode(**episode(1))
    assert verify(folder) == []


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_an_overwrite_the_disk_has_no_room_for_keeps_the_buffer_it_replaces(disk, backend):
    # memmap and hdf5 reserve every array at the create: one that ran out of room failed only
    # after erasing the buffer it replaced
    folder = disk / "buf"
    with new(folder, backend) as buffer:
        buffer.store_episode(**episode(1))
    fill(disk)
    os.truncate(disk / "ballast", os.path.getsize(disk / "ballast") - (256 << 10))
    before = snapshot_of_folder(folder)
    with pytest.raises(StorageError, match=r"reserves [\d,]+ bytes of disk up front \(the largest, field 'image'"):
        ReplayBuffer(folder, max_episodes=16, max_timesteps=8, fields=FIELDS, backend=backend)
    assert snapshot_of_folder(folder) == before
    with ReplayBuffer(folder, read_only=True) as buffer:
        assert_holds(buffer, [episode(1)])
    del buffer  # a reader pins the file it opened, which keeps its space after the erase unlinks it
    release(disk)
    with new(folder, backend) as buffer:  # as large again: the space of the buffer it erases counts
        buffer.store_episode(**episode(2))
    assert verify(folder) == []


def test_a_step_whose_rows_cannot_be_written_is_taken_back(disk):
    """Large frames leave RAM a span (~1 MiB) at a time: the step that completes one fails to
    write it (compressed hdf5, which refuses a write the disk has no room for)."""
    folder = disk / "buf"
    shape = (256, 256, 3)
    buffer = ReplayBuffer(
        folder,
        max_episodes=2,
        max_timesteps=8,
        fields={"frame": ("uint8", shape)},
        backend="hdf5",
        storage_options={"compression": "gzip"},
        flush_every_store_step=0,
    )
    assert buffer._commit.spans["frame"] == 5
    frames = np.random.default_rng(0).integers(0, 255, (7, *shape), dtype=np.uint8)
    for t in range(4):
        buffer.store(frame=frames[t])
    fill(disk)
    with pytest.raises(StorageError, match="this step was not stored") as error:
        buffer.store(frame=frames[4])  # completes the span of steps 0..4
    assert_disk_full(error, folder)
    assert buffer.timestep_index == 4
    free(disk)
    for t in range(4, 7):
        buffer.store(frame=frames[t])
    buffer.advance_episode()
    assert_holds(buffer, [{"frame": frames}])
    buffer.close()
    assert verify(folder) == []


@pytest.mark.parametrize("backend", LOCAL)
def test_an_edit_on_a_full_disk_is_whole_or_refused(disk, backend):
    """An ``update`` of several fields and episodes that the disk may have no room for (its rows
    and its edit log record) is refused before anything is written, whatever room is left: a
    zarr edit cut short after 96 KiB had rewritten slot 0's frames and left its state and slot 1
    as they were."""
    stored, edit = [episode(seed) for seed in range(3)], episode(9)
    edited = [edit, edit, stored[2]]
    outcomes = set()
    for room in [*range(16 << 10, 257 << 10, 24 << 10), 2 << 20]:
        folder = disk / f"buf{room}"
        with new(folder, backend) as buffer:
            for values in stored:
                buffer.store_episode(**values)
        buffer = ReplayBuffer.from_folder(folder)
        fill(disk)
        os.truncate(disk / "ballast", os.path.getsize(disk / "ballast") - room)
        try:
            buffer.update([0, 1], image=np.stack([edit["image"]] * 2), state=np.stack([edit["state"]] * 2))
        except StorageError as error:
            assert "no space left" in str(error).lower() and str(folder) in str(error), error
            assert "nothing was written" in str(error), error
            outcomes.add("refused")
            expected = stored
        else:
            outcomes.add("edited")
            expected = edited
        free(disk)
        with ReplayBuffer.from_folder(folder, read_only=True) as reader:
            assert_holds(reader, expected)
        buffer.update([0, 1], image=np.stack([edit["image"]] * 2), state=np.stack([edit["state"]] * 2))
        buffer.close()
        with ReplayBuffer.from_folder(folder, read_only=True) as reader:
            assert_holds(reader, edited)
        assert verify(folder) == []
        del buffer, reader  # their maps go now: release() then has no collection to run
        release(disk)
        shutil.rmtree(folder)
    # memmap and an uncompressed data.h5 edit reserved files in place, but log the edit first
    assert outcomes == {"refused", "edited"}


def store_steps(buffer: ReplayBuffer, values: dict[str, np.ndarray]) -> None:
    for t in range(len(values["state"])):
        buffer.store(**{name: rows[t] for name, rows in values.items()})
    buffer.advance_episode()


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize("room", [0, 32 << 10])
@pytest.mark.parametrize("how", ["store_episode", "store"])
def test_a_circular_buffer_keeps_its_oldest_episode_when_the_next_has_no_room(disk, backend, room, how):
    """The oldest episode goes only when a new one takes its slot: a zarr buffer that wrapped
    onto a full disk had dropped slot 0's episode and stored nothing in its place (steps stored
    with ``store()`` and no step log too: their rows are written at the commit)."""
    folder = disk / "buf"
    stored = [episode(seed) for seed in range(3)]
    buffer = ReplayBuffer(
        folder, max_episodes=3, max_timesteps=8, fields=FIELDS, backend=backend, circular=True, flush_every_store_step=0
    )
    for values in stored:
        buffer.store_episode(**values)
    fill(disk)
    os.truncate(disk / "ballast", os.path.getsize(disk / "ballast") - room)
    try:
        buffer.store_episode(**episode(9)) if how == "store_episode" else store_steps(buffer, episode(9))
    except StorageError as error:
        # memmap and hdf5 write into reserved files: only their counters can meet the full disk,
        # after the episode was published (the counters are written again by close())
        published = "counters are written again" in str(error)
        assert published and backend != "zarr" or "nothing was written" in str(error), error
        expected = [episode(9), *stored[1:]] if published else stored
    else:
        assert backend != "zarr", "zarr has no room for a new shard here"
        expected = [episode(9), *stored[1:]]
    free(disk)
    with ReplayBuffer.from_folder(folder, read_only=True) as reader:
        assert sorted(reader.valid_episodes().tolist()) == [0, 1, 2]
        assert_holds(reader, expected)
    buffer.close()
    assert verify(folder) == []


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize("how", ["update", "store_datapoint"])
def test_an_edit_of_the_episode_in_progress_that_cannot_be_logged_is_not_made(disk, backend, how):
    """An edit of steps in progress is logged before it is applied: when the log cannot be
    written it is refused whole, the log cut back to its last record and the staged steps as
    they were (zarr's room check may refuse it first, nothing written either)."""
    folder = disk / "buf"
    buffer = new(folder, backend)
    values = episode(1)
    for t in range(6):
        buffer.store(image=values["image"][t], state=values["state"][t])
    log = buffer.storage.read_log("episode")
    fill(disk)
    with pytest.raises(StorageError) as error:
        if how == "update":
            buffer.update(0, image=np.zeros((6, *IMAGE), np.uint8))
        else:
            buffer.store_datapoint(0, 2, "image", np.zeros(IMAGE, np.uint8))
    assert_disk_full(error, folder)
    assert buffer.storage.read_log("episode") == log
    np.testing.assert_array_equal(buffer.data["image"][0, :6], values["image"])
    free(disk)
    buffer.advance_episode()
    assert_holds(buffer, [values])
    buffer.close()
    assert verify(folder) == []


def test_a_convert_overwrite_that_fits_only_in_place_of_the_old_buffer_is_refused_keeping_it(disk, tmp_path):
    # the copy is built beside the old buffer and swapped in once complete, so both take their
    # room at once: counting the old buffer's space as free, the copy ran out of disk part way
    # (memmap reserves its files) after the old buffer was erased
    def memmap(location) -> ReplayBuffer:
        return ReplayBuffer(location, max_episodes=36, max_timesteps=8, fields=FIELDS, backend="memmap")

    with memmap(tmp_path / "src") as buffer:
        buffer.store_episode(**episode(1))
    with memmap(disk / "dst") as buffer:
        buffer.store_episode(**episode(2))
    before = snapshot_of_folder(disk / "dst")
    with pytest.raises(StorageError, match="must fit at once") as error:
        convert(tmp_path / "src", disk / "dst", backend="memmap", progress=False, overwrite=True)
    assert "nothing was erased" in str(error.value)
    assert snapshot_of_folder(disk / "dst") == before and os.listdir(disk) == ["dst"]
    with ReplayBuffer.from_folder(disk / "dst", read_only=True) as kept:
        assert_holds(kept, [episode(2)])


@contextlib.contextmanager
def read_only(folder):
    """``folder`` read-only for the block, as a file system remounted so after an error: a
    read-only bind mount over it (what this process opened before keeps its descriptors).
    Skips the test where a mount is refused."""
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("backend", LOCAL)
def test_a_writer_whose_folder_turned_read_only_still_gives_its_lease_back(tmp_path, backend):
    """close() deleted the lease's lock file before closing the descriptor holding its flock: a
    folder turned read-only made the delete raise, the flock was kept, and no writer (this
    process's included) could open the buffer until the process ended."""
    folder = tmp_path / "buf"
    buffer = new(folder, backend)
    buffer.store_episode(**episode(1))
    with read_only(folder / "replaybuf"):
        with pytest.raises(StorageError, match="Read-only file system") as error:
            buffer.store_episode(**episode(2))
        assert ".partial" not in str(error.value)  # the object, not the temp file it could not make
        buffer.close()
    with new(folder, backend, overwrite=False) as again:
        assert_holds(again, [episode(1)])
        again.store_episode(**episode(3))
    assert verify(folder) == []


def test_a_short_write_in_place_is_an_error(tmp_path):
    """A write in place that the disk (or a file size limit) takes only part of returns a short
    count, not an error: it was taken for whole, the rest of the bytes silently unwritten."""
    kv = LocalKV(str(tmp_path / "kv"))
    kv.set("table", bytes(8192))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(StorageError, match=r"kv/table.*96 of 200 bytes written: no space left"):
            kv.write_at("table", 4000, b"x" * 200)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    kv.close()


@pytest.mark.parametrize("room", [0, 24 << 10])
def test_a_video_the_disk_has_no_room_for_is_an_error_and_leaves_nothing(disk, room):
    """ffmpeg failing to write a video's end exits with an error that imageio-ffmpeg does not
    check: the truncated file (no player opens it) was kept as rendered, and the viewer's
    cache served it."""
    frames = np.random.default_rng(0).integers(0, 255, (40, 64, 64, 3), dtype=np.uint8)  # ~150 KB of mp4
    fill(disk)
    os.truncate(disk / "ballast", os.path.getsize(disk / "ballast") - room)
    with pytest.raises(OSError, match="ffmpeg did not finish the video") as error:
        blocks_to_video([frames[:20], frames[20:]], disk / "episode.mp4")
    assert error.value.errno == errno.ENOSPC and str(disk / "episode.mp4") in str(error.value)
    assert os.listdir(disk) == ["ballast"]


@pytest.mark.parametrize("export", [export_diffusion_policy, export_lerobot])
def test_an_export_into_a_full_disk_names_its_folder_and_leaves_nothing(disk, tmp_path, export):
    with new(tmp_path / "src", "zarr") as buffer:
        buffer.store_episode(**episode(1))
    fill(disk)
    with pytest.raises(OSError, match="(?i)no space left") as error:
        export(tmp_path / "src", disk / "dst")
    assert str(disk / "dst") in str(error.value)
    assert os.listdir(disk) == ["ballast"]


def test_a_compressed_hdf5_file_refuses_a_write_past_the_file_size_limit(tmp_path):
    """A file size limit (``ulimit -f``; a quota acts alike) cut HDF5's write of a new chunk
    short: data.h5 then named an end past its own and could not be opened, every episode lost."""
    folder = tmp_path / "buf"
    buffer = new(folder, "hdf5", storage_options={"compression": "gzip"})
    buffer.store_episode(**episode(1))
    buffer.flush()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(folder / "data.h5") + 4096, hard))
    try:
        with pytest.raises(StorageError, match=r"data\.h5' may grow to .*file size limit.*nothing was written"):
            buffer.store_episode(**episode(2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    buffer.store_episode(**episode(3))
    buffer.close()
    with ReplayBuffer.from_folder(folder, read_only=True) as reader:
        assert_holds(reader, [episode(1), episode(3)])
    assert verify(folder) == []


def test_a_with_block_a_full_disk_stopped_raises_its_own_error_not_the_close(disk):
    """The error of a ``with`` block's store was replaced by that of the close() at its exit
    (its compaction refused by the same full disk): ``replaybuf import`` reported a compaction,
    not the episode it could not store."""
    folder = disk / "buf"
    with pytest.raises(StorageError, match=r"slots \[1\] .*No space left on device") as error:  # noqa: PT012
        with new(folder, "zarr") as buffer:
            buffer.store_episode(**episode(1))
            fill(disk)
            buffer.store_episode(**episode(2))
    assert "then close() failed too" in error.value.__notes__[0] and "No space left" in error.value.__notes__[0]
    free(disk)
    with new(folder, "zarr", overwrite=False) as again:  # closed all the same
        assert_holds(again, [episode(1)])


def test_a_compaction_the_disk_has_no_room_for_says_the_episodes_stay_hot_and_whole(disk):
    """Its message named the shard it could not write (``.../c.0.0.0.0.0``), which read as damage
    to episode 0; the episodes stay hot and read back the same."""
    folder = disk / "buf"
    buffer = new(folder, "zarr")
    stored = [episode(1), episode(2)]
    for values in stored:
        buffer.store_episode(**values)
    buffer.flush()
    fill(disk)
    with pytest.raises((OSError, StorageError), match="No space left") as error:
        buffer.compact()
    assert "stays stored uncompressed (hot) and reads back the same" in " ".join(error.value.__notes__)
    assert_holds(buffer, stored)
    free(disk)
    buffer.close()  # compacted now
    with ReplayBuffer.from_folder(folder, read_only=True) as reader:
        assert_holds(reader, stored)
    assert verify(folder) == []
