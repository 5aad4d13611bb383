"""Hostile folders found by an attacker's audit: files a buffer does not own keep their bytes,
and damage to a local backend's side files is refused by name, never read unchecked."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import stat
import subprocess
import sys

import numpy as np
import pytest

from replaybuf import (
    BufferDamagedError,
    ConcatReplayBuffer,
    CorruptChunkError,
    ForeignEntriesError,
    ReplayBuffer,
    StorageError,
)
from replaybuf.cli import main
from replaybuf.snapshots import SnapshotError, SnapshotHeldError

from ._backends import require, snapshot
from ._data import FIELDS, episode, seed_buffer
from ._fifo import refused_never_waited_on

ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def filled(location, backend: str) -> str:
    buffer = ReplayBuffer(str(location), 4, 8, fields=FIELDS, backend=backend)
    for i, length in enumerate((5, 3)):
        buffer.store_episode(**episode(length, i))
    buffer.close()
    return str(location)


def files(location) -> dict:
    """The files at ``location`` (``snapshot``) without folders: a writable open's lease comes and goes."""
    return {k: v for k, v in snapshot(location).items() if v[2] and not k.endswith(".lock")}


def new(location, backend: str) -> ReplayBuffer:
    return ReplayBuffer(str(location), 2, 4, fields={"x": "float"}, backend=backend)


# ---- a user's files that happen to carry a buffer's names -----------------------------------------


def users_hdf5(path) -> None:
    with require("h5py").File(path, "w") as f:
        f["obs"] = np.arange(5)


@pytest.mark.parametrize(
    "backend, name, write",
    [
        ("hdf5", "data.h5", users_hdf5),
        ("memmap", "obs.data.npy", lambda path: np.save(path, np.arange(3))),
        ("memmap", "metadata.pkl", lambda path: path.write_bytes(pickle.dumps({"lr": 0.1}))),
    ],
)
def test_a_users_file_with_a_buffers_name_is_not_erased(tmp_path, backend, name, write):
    write(tmp_path / name)
    before = snapshot(str(tmp_path))
    with pytest.raises(ForeignEntriesError, match=rf"'{name}'.*nothing was deleted"):
        new(tmp_path, backend)
    assert snapshot(str(tmp_path)) == before


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_opening_a_buffer_without_its_config_points_to_from_folder(tmp_path, backend):
    location = filled(tmp_path / "b", backend)
    before = snapshot(location)
    with pytest.raises(ValueError, match=r"holds a buffer.*from_folder"):
        ReplayBuffer(location)
    assert snapshot(location) == before


# ---- damaged side files of the memmap and hdf5 backends -------------------------------------------


def refused_everywhere(capsys, location, match) -> None:
    """Both opens raise BufferDamagedError matching ``match``; verify reports it and exits 1."""
    for read_only in (True, False):
        with pytest.raises(BufferDamagedError, match=match):
            ReplayBuffer.from_folder(location, read_only=read_only)
    assert main(["verify", location]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert "checksums.npy" in out.out + out.err or "data.h5" in out.out + out.err


def cut(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def replace_with_folder(path) -> None:
    os.remove(path)
    os.mkdir(path)


def garbage_header(path) -> None:
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"garbage")


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
@pytest.mark.parametrize(
    "damage, complaint",
    [
        (os.remove, "missing; this buffer's config says it checksums its data"),
        (cut, "not a readable checksum array"),
        (replace_with_folder, "not a readable checksum array"),
        (garbage_header, "not a readable checksum array"),
        (lambda path: np.save(path, np.zeros((4, 1), np.uint64)), r"holds uint64\[4, 1\], expected uint64\[4, 3\]"),
    ],
)
def test_a_damaged_checksum_file_is_refused_not_skipped(tmp_path, capsys, backend, damage, complaint):
    location = filled(tmp_path / "b", backend)
    damage(os.path.join(location, "replaybuf", "checksums.npy"))
    before = files(location)
    refused_everywhere(capsys, location, rf"checksums.npy: {complaint}")
    assert files(location) == before


@pytest.mark.parametrize("size", [0, 1000, -1])
def test_a_truncated_hdf5_file_is_damage_not_a_missing_buffer(tmp_path, capsys, size):
    location = filled(tmp_path / "b", "hdf5")
    path = os.path.join(location, "data.h5")
    os.truncate(path, size if size >= 0 else os.path.getsize(path) - 1)
    refused_everywhere(capsys, location, r"data.h5: cannot be opened as an HDF5 file")


# ---- the counters object -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_counters_missing_a_key_are_damage_not_an_empty_buffer(tmp_path, backend):
    location = filled(tmp_path / "b", backend)
    path = os.path.join(location, "replaybuf", "state.json")
    with open(path, "w") as f:
        f.write('{"episode_index": 2, "num_eXisodes": 2, "total_episodes": 2}')  # one flipped byte
    for read_only in (True, False):
        with pytest.raises(BufferDamagedError, match=r"replaybuf/state.json.*: missing num_episodes"):
            ReplayBuffer.from_folder(location, read_only=read_only)


# ---- a location that is not a folder ----------------------------------------------------------------


def _opens(path, backend: str | None) -> list:
    """A create, a writable open and a read-only open of ``path``."""
    return [
        lambda: ReplayBuffer(path, 2, 3, fields={"x": "float"}, backend=backend),
        lambda: ReplayBuffer.from_folder(path, backend=backend),
        lambda: ReplayBuffer.from_folder(path, read_only=True, backend=backend),
    ]


@pytest.mark.parametrize("what", ["hdf5 file", "text file", "dangling link", "link loop"])
@pytest.mark.parametrize("backend", [None, "memmap", "hdf5"])
def test_a_location_that_is_not_a_folder_is_named_and_kept(tmp_path, what, backend):
    path = tmp_path / "x"
    if what == "hdf5 file":
        users_hdf5(path)
    elif what == "text file":
        path.write_text("notes")
    else:
        os.symlink(path if what == "link loop" else tmp_path / "nowhere", path)
    before = (os.listdir(tmp_path), os.readlink(path) if os.path.islink(path) else path.read_bytes())
    kind = "a file" if "file" in what else "a dangling or looping link"
    for attempt in _opens(path, backend):
        with pytest.raises(NotADirectoryError, match=rf"'{path}' is {kind}, not a folder"):
            attempt()
    assert (os.listdir(tmp_path), os.readlink(path) if os.path.islink(path) else path.read_bytes()) == before


@pytest.mark.parametrize("backend", [None, "memmap", "hdf5"])
def test_a_location_under_a_file_is_named_before_anything_is_made(tmp_path, backend):
    """A folder below a file (``notes.txt/run1/a``) can never be made: the error names the file
    above it, not ``[Errno 20]`` on some file inside the buffer, and the file is kept."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    path = notes / "run1" / "a"
    for attempt in _opens(path, backend):
        with pytest.raises(NotADirectoryError, match=rf"'{path}' cannot be a folder: '{notes}' above it is a file"):
            attempt()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and notes.read_text() == "mine"


# ---- trajectory batches of short episodes are checked too --------------------------------------------


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_trajectory_batches_of_short_episodes_check_their_rows(tmp_path, backend):
    location = filled(tmp_path / "b", backend)  # episodes of 5 and 3 steps: far below the bulk threshold
    if backend == "memmap":
        path = os.path.join(location, "reward.data.npy")
        offset = os.path.getsize(path) - 4 * 8 * 4 + 4  # float32[4, 8] after the header
    else:
        path = os.path.join(location, "data.h5")
        with require("h5py").File(path, "r") as f:
            offset = f["data/reward"].id.get_offset() + 4
    clean = next(iter(ReplayBuffer.from_folder(location, read_only=True).dataloader(batch_size=2, shuffle=False)))
    assert clean["reward"].shape == (2, 5)
    with open(path, "r+b") as f:  # step 1 of slot 0
        f.seek(offset)
        f.write(b"\x7f")
    for buffer in (ReplayBuffer.from_folder(location, read_only=True), ConcatReplayBuffer([location])):
        for kwargs in ({}, {"return_mask": True}):
            with pytest.raises(CorruptChunkError, match=r"data/reward: slot 0, timesteps 0..4"):
                list(buffer.dataloader(batch_size=2, shuffle=False, **kwargs))


# ---- a lost lengths chunk (zarr) ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deleted", "dangling link"])
def test_a_lost_lengths_chunk_is_damage_not_an_empty_buffer(tmp_path, capsys, how):
    location = filled(tmp_path / "b", "zarr")
    path = os.path.join(location, "meta", "episode_lens", "c.0")
    os.remove(path)
    if how == "dangling link":
        os.symlink(tmp_path / "nowhere", path)
    before = files(location) if how == "deleted" else os.readlink(path)
    with pytest.raises(BufferDamagedError, match=r"lengths of committed slots \[0, 1\] is missing"):
        ReplayBuffer.from_folder(location, read_only=True)
    # a writable open would have cleared every generation; it refuses a link before looking
    refusal = r"lengths of committed slots \[0, 1\] is missing" if how == "deleted" else "symbolic links"
    with pytest.raises(StorageError if how != "deleted" else BufferDamagedError, match=refusal):
        ReplayBuffer.from_folder(location)
    assert (files(location) if how == "deleted" else os.readlink(path)) == before
    assert main(["verify", location]) == 1
    out = capsys.readouterr()
    assert "committed slots [0, 1] is missing" in out.out + out.err


@pytest.mark.parametrize(
    "endless, refusal",
    [
        # a device is refused before a byte is read (as a FIFO there, which a read would wait on)
        ("/dev/zero", r"OSError: .*not a regular file .*replaybuf.json"),
        ("sparse file", r"BufferDamagedError: .*replaybuf.json: over \d+ bytes, not a buffer config"),
    ],
)
def test_a_memmap_config_linked_to_an_endless_file_is_refused_in_bounded_memory(tmp_path, endless, refusal):
    location = filled(tmp_path / "b", "memmap")
    path = os.path.join(location, "replaybuf.json")
    os.remove(path)
    if endless == "sparse file":
        with open(tmp_path / "sparse", "wb") as f:
            f.truncate(1 << 40)
        endless = str(tmp_path / "sparse")
    os.symlink(endless, path)
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a regression is a MemoryError, not the machine's RAM
from replaybuf import ReplayBuffer
ReplayBuffer.from_folder({location!r}, read_only=True)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert run.returncode == 1
    assert re.search(refusal, run.stderr), run.stderr


@pytest.mark.parametrize(
    "key", ["replaybuf/state.json", "data/reward/c.0.0", "data/action/c.0.0.0", "data/state/c.0.0.0.0.0"]
)
def test_a_folder_in_place_of_a_file_is_named(tmp_path, key):
    location = filled(tmp_path / "b", "zarr")
    path = os.path.join(location, *key.split("/"))
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(IsADirectoryError, match=key):
        ReplayBuffer.from_folder(location, read_only=True).get_all_data()


def test_convert_refuses_a_source_with_a_lost_lengths_chunk(tmp_path, capsys):
    location = filled(tmp_path / "b", "zarr")
    os.remove(os.path.join(location, "meta", "episode_lens", "c.0"))
    assert main(["convert", location, str(tmp_path / "copy")]) == 1
    out = capsys.readouterr()
    assert "committed slots [0, 1] is missing" in out.out + out.err
    assert not os.path.exists(tmp_path / "copy")  # refused before anything is written


# ---- overwrite=True replaces what was derived from the old episodes too -----------------------------


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_overwrite_drops_the_old_buffers_sketches_and_snapshots(tmp_path, backend):
    location = str(tmp_path / "b")
    old = ReplayBuffer(location, 2, 250, fields={"x": "float"}, backend=backend)
    old.store_episode(x=np.ones(220, np.float32))  # long enough for a stored sketch
    assert float(old.stats().fields["x"].mean) == 1.0
    old.snapshot("eval")
    old.close()
    with pytest.raises(SnapshotHeldError):  # the snapshot holds the episode: refused, unless asked
        ReplayBuffer(location, 2, 250, fields={"x": "float"}, backend=backend)
    with pytest.warns(UserWarning, match="eval"):  # generations restart at 1
        new_one = ReplayBuffer(
            location, 2, 250, fields={"x": "float"}, backend=backend, drop_snapshots_on_overwrite=True
        )
    assert new_one.snapshots() == []
    new_one.store_episode(x=np.full(220, 5.0, np.float32))
    new_one.close()
    reader = ReplayBuffer.from_folder(location, read_only=True)
    assert float(reader.stats().fields["x"].mean) == 5.0
    with pytest.raises(SnapshotError, match="no snapshot 'eval'"):
        ReplayBuffer.from_folder(location, read_only=True, snapshot="eval")


def test_a_refused_writable_open_leaves_the_hdf5_file_closed(tmp_path):
    location = filled(tmp_path / "b", "hdf5")
    path = os.path.join(location, "data.h5")
    h5py = require("h5py")
    with h5py.File(path, "r+") as f:
        f["meta/episode_lens"][0] = 99  # damage a writable open refuses after opening data.h5
    before = open(path, "rb").read()
    with pytest.raises(BufferDamagedError, match="outside"):
        ReplayBuffer.from_folder(location)
    assert open(path, "rb").read() == before  # not left marked open for writing
    other = subprocess.run(
        [sys.executable, "-c", f"import h5py; h5py.File({path!r}, 'r').close()"], capture_output=True, text=True
    )
    assert other.returncode == 0, other.stderr  # nor locked against other processes


# ---- metadata of absurd size ------------------------------------------------------------------------


def test_a_file_of_absurd_size_is_refused_by_name_in_bounded_memory(tmp_path):
    """A sparse 10 GB file in place of a metadata file or a chunk is refused by its size, unread:
    opening, ``replaybuf info`` and ``verify`` name it (metadata: its size and the limit), in a
    process whose address space could not hold it; a zarr buffer's per-episode checksums are
    read no further than the rows the config gives, and ``verify --repair`` cuts the file back
    to them, dropping no episode."""
    too_large = r"{path}: 10,737,418,240 bytes, over the 67,108,864-byte limit of this metadata object"
    damaged = [
        ("zarr", "zarr.json", too_large),
        ("zarr", "data/state/zarr.json", too_large),
        ("zarr", "replaybuf/state.json", too_large),
        ("memmap", "replaybuf/state.json", too_large),
        ("hdf5", "replaybuf/state.json", too_large),
        (
            "zarr",
            "meta/episode_lens/c.0",
            r"slots 0\.\.3: more than the [\d,]+ bytes any encoding of the chunk takes .*\({path}\)",
        ),
    ]
    paths = []
    for i, (backend, key, _) in enumerate(damaged):
        paths.append(os.path.join(filled(tmp_path / f"b{i}", backend), *key.split("/")))
        os.truncate(paths[-1], 10 << 30)
    sums = os.path.join(filled(tmp_path / "sums", "zarr"), "replaybuf", "checksums")
    os.truncate(sums, 10 << 30)
    code = f"""
import os, resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a regression is a MemoryError
from replaybuf import BufferDamagedError, CorruptChunkError, ReplayBuffer
from replaybuf.cli import main
for path, key in zip({paths!r}, {[key for _, key, _ in damaged]!r}):
    location = path[: -len(key) - 1]
    try:
        ReplayBuffer.from_folder(location, read_only=True)
    except (BufferDamagedError, CorruptChunkError) as e:
        print("open:", e)
    print("exit codes:", main(["info", location]), main(["verify", location]))
from replaybuf.maintenance import verify
location = {os.path.dirname(os.path.dirname(sums))!r}
print("read:", ReplayBuffer.from_folder(location, read_only=True).get_all_data()["episode_lens"].tolist())
print("repair:", verify(location, repair=True))
print("size:", os.path.getsize({sums!r}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert run.returncode == 0, run.stderr
    for path, (_, _, message) in zip(paths, damaged):
        line = message.format(path=re.escape(path))
        assert re.search(f"open: .*{line}", run.stdout), run.stdout
        assert len(re.findall(line, run.stderr)) == 2, run.stderr  # info, then verify
    assert run.stdout.count("exit codes: 1 1") == len(paths)
    assert "read: [5, 3]" in run.stdout  # the rows the config gives, read as they are
    assert f"repair: ['{sums}: the checksums of packed fields hold 10737418240 bytes, more than the " in run.stdout
    assert f"'repaired: cut {sums} to the " in run.stdout and "dropped" not in run.stdout
    assert "size: 96" in run.stdout  # 4 slots x 3 packed fields x 8 bytes


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_step_log_of_absurd_size_is_recovered_in_bounded_memory(tmp_path, backend):
    """A step log whose file is a sparse 10 GB (3 valid steps, then zeros) is read in pieces:
    a writable open in a process whose address space could not hold it recovers the 3 steps
    and names the copy set aside, which keeps what a valid log could hold and says how many
    bytes it left out."""
    if backend == "hdf5":
        require("h5py")
    location = filled(tmp_path / "b", backend)
    buffer = ReplayBuffer.from_folder(location)
    log = buffer._commit.step_log
    records = [log.header(np.array([2]), 2, {})]
    records += [log.steps({n: v[t][None] for n, v in episode(3, 7).items()}) for t in range(3)]
    buffer.storage.append_log("episode", b"".join(records))
    buffer.storage.close()
    buffer.storage.release_writer()  # as a killed writer: its lease gone, its log left
    (path,) = [os.path.join(d, f) for d, _, names in os.walk(location) for f in names if "steplog" in d]
    os.truncate(path, 10 << 30)
    code = f"""
import resource, warnings
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a regression is a MemoryError
from replaybuf import ReplayBuffer
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    buffer = ReplayBuffer.from_folder({location!r})
print("lens:", buffer.episode_lens.tolist(), buffer.storage.log_names())
print("warnings:", *[str(w.message) for w in caught])
print("aside:", *[buffer.storage.kv.size(k) for k in buffer.storage.list_blobs("replaybuf/steplog-damaged-")])
buffer.close()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr
    assert "lens: [5, 3, 3, 0] []" in run.stdout, run.stdout
    end = sum(map(len, records))
    kept = end + log.record_bound({"slots": [2]})
    assert re.search(
        rf"is damaged \(record at byte {end:,}: unknown kind b'\\x00'\); it was copied to "
        rf"'replaybuf/steplog-damaged-[^']+' \(its last {(10 << 30) - kept:,} bytes, past what a valid log could "
        r"hold, left out\) and 3 valid step\(s\) before the damage are recovered",
        run.stdout,
    ), run.stdout
    assert f"aside: {kept}" in run.stdout, run.stdout


def padded(document: bytes, size: int) -> bytes:
    """``document`` (JSON) padded with spaces to ``size`` bytes: still valid JSON."""
    return document + b" " * (size - len(document))


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_side_objects_over_the_limit_are_refused_or_set_aside(tmp_path, monkeypatch, backend):
    """Each metadata object over ``MAX_DOCUMENT_BYTES`` (here lowered; each still valid JSON) is
    refused by name where it carries the user's data, and treated as damaged where it is the
    writer's own record or derived data."""
    monkeypatch.setattr("replaybuf.storage.base.MAX_DOCUMENT_BYTES", 1 << 16)  # a root zarr.json: ~7 kB
    monkeypatch.setattr("replaybuf.attrs.MAX_ATTRS_BYTES", 1 << 16)  # attributes have their own, lower, limit
    location = str(tmp_path / "b")
    with ReplayBuffer(location, 4, 250, fields={"x": "float"}, backend=backend) as buffer:
        buffer.store_episode(x=np.arange(220, dtype=np.float32))  # long enough for a sketch (KLL_K)
        buffer.snapshot("eval")
        buffer.attrs["note"] = "kept"
        expected = buffer.stats().fields["x"].mean
    side = os.path.join(location, "replaybuf")

    def pad(name: str) -> None:
        path = os.path.join(side, *name.split("/"))
        with open(path, "rb") as f:
            document = f.read()
        with open(path, "wb") as f:
            f.write(padded(document, 70_000))

    pad("attrs.json")
    with pytest.raises(BufferDamagedError, match=r"attrs\.json: 70,000 bytes, over the 65,536-byte limit"):
        dict(ReplayBuffer.from_folder(location, read_only=True).attrs)
    pad("snapshots/eval/snapshot.json")  # a snapshot may take 64 bytes per episode more: 4 here
    with pytest.raises(SnapshotError, match=r"'eval' is damaged: .*snapshot\.json: 70,000 bytes, over the 65,792-byte"):
        ReplayBuffer.from_folder(location, read_only=True, snapshot="eval")
    for slot in os.listdir(os.path.join(side, "sketches")):  # derived data: sketched again
        with open(os.path.join(side, "sketches", slot), "ab") as f:
            f.write(b"x" * 70_000)
    assert ReplayBuffer.from_folder(location, read_only=True).stats().fields["x"].mean == expected
    with open(os.path.join(side, "writing"), "wb") as f:  # a writer's record: a torn one's recovery
        f.write(padded(b"[]", 70_000))
    with pytest.warns(UserWarning, match=r"replaybuf/writing in .* is damaged"):
        buffer = ReplayBuffer.from_folder(location)
    with buffer:
        buffer.store_episode(x=np.ones(3, np.float32))
    assert ReplayBuffer.from_folder(location, read_only=True).episode_lens[:2].tolist() == [220, 3]
    pad("state.json")
    with pytest.raises(BufferDamagedError, match=r"state\.json: 70,000 bytes, over the 65,536-byte limit"):
        ReplayBuffer.from_folder(location, read_only=True)


# ---- a FIFO at the name of a file a local backend opens ---------------------------------------------


@pytest.mark.parametrize("name", ["replaybuf.json", "episode_lens.data.meta.npy"])
def test_a_fifo_at_a_memmap_file_s_name_is_refused_naming_it_never_waited_on(tmp_path, capsys, name):
    """Before: opening the buffer waited forever: its config was read with a plain open, and a
    reader's open of episode_lens (the file that pins the buffer's identity) was one too."""
    location = filled(tmp_path / "b", "memmap")
    fifo = os.path.join(location, name)
    os.unlink(fifo)
    os.mkfifo(fifo)
    calls = [lambda: ReplayBuffer.from_folder(location, read_only=True)]
    if name == "replaybuf.json":  # a writable open of a FIFO'd episode_lens says it is missing
        calls.append(lambda: ReplayBuffer.from_folder(location))

    def verify() -> None:
        try:
            code = main(["verify", location])
        except SystemExit as e:  # argparse's error exit
            code = e.code
        out = capsys.readouterr()
        assert code != 0
        raise OSError(out.out + out.err)  # its message is checked like the others'

    refused_never_waited_on(fifo, [*calls, verify])
    assert stat_is_fifo(fifo)


def test_a_fifo_at_the_hdf5_writer_mark_is_refused_naming_it_never_waited_on(tmp_path):
    """Before: a reader of a compressed file waited forever opening the mark (a plain open), and
    a writer failed with a bare "[Errno 22] Invalid argument" naming no file."""
    require("h5py")
    location = str(tmp_path / "b")
    with ReplayBuffer(
        location, 2, 4, fields={"x": "float"}, backend="hdf5", storage_options={"compression": "gzip"}
    ) as b:
        b.store_episode(x=np.ones(3, np.float32))
    fifo = os.path.join(location, "replaybuf", "hdf5-writer.lock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fifo)
    os.mkfifo(fifo)

    def write() -> None:
        with ReplayBuffer.from_folder(location) as buffer:
            buffer.store_episode(x=np.ones(3, np.float32))

    refused_never_waited_on(fifo, [lambda: ReplayBuffer.from_folder(location, read_only=True).get_all_data(), write])
    assert stat_is_fifo(fifo)
    os.unlink(fifo)  # the refused writer left the buffer as it was
    assert ReplayBuffer.from_folder(location, read_only=True).num_episodes == 1


@pytest.mark.parametrize("kind", ["fifo", "folder", "broken link"])
@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_fifo_folder_or_broken_link_at_a_raw_backends_data_file_is_named_as_damage(tmp_path, backend, kind):
    """Before: "no replaybuf buffer found" (hdf5's data.h5) or "missing x.data.npy" (memmap): a
    buffer whose file was there, in another kind, reported as no buffer at all."""
    if backend == "hdf5":
        require("h5py")
    location = filled(tmp_path / "b", backend)
    path = os.path.join(location, "data.h5" if backend == "hdf5" else "state.data.npy")
    os.unlink(path)
    {"fifo": os.mkfifo, "folder": os.mkdir, "broken link": lambda p: os.symlink(str(tmp_path / "gone"), p)}[kind](path)
    with pytest.raises(BufferDamagedError, match=f"{re.escape(path)}: not a regular file"):
        ReplayBuffer.from_folder(location, read_only=True)
    # a writer refuses it the same way, or (memmap) as a symbolic link it would write through
    with pytest.raises(
        (BufferDamagedError, StorageError), match=f"{re.escape(path)}(: not a regular file|'\\), and a write through)"
    ):
        ReplayBuffer.from_folder(location)
    assert os.path.lexists(path)


@pytest.mark.parametrize("kind", ["folder", "link to a folder"])
@pytest.mark.parametrize("name", ["episode_lens.data.meta.npy", "replaybuf.json"])
def test_a_folder_at_memmap_s_lengths_or_config_file_is_named_as_damage(tmp_path, capsys, kind, name):
    """Before: a read-only open mapped a folder at the lengths file to pin the buffer's identity
    ('mmap of 1 bytes failed: No such device'), and read one at the config through its
    descriptor ('Is a directory: 3'): neither named the file."""
    location = filled(tmp_path / "b", "memmap")
    path = os.path.join(location, name)
    os.unlink(path)
    os.mkdir(path) if kind == "folder" else os.symlink(str(tmp_path), path)
    with pytest.raises(BufferDamagedError, match=f"{re.escape(path)}: not a regular file"):
        ReplayBuffer.from_folder(location, read_only=True)
    assert main(["verify", location]) == 1 and path in capsys.readouterr().err


def stat_is_fifo(path: str) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def test_a_fifo_at_a_seed_counter_of_an_adopted_folder_is_refused_naming_it_never_waited_on(tmp_path):
    """Before: every open of a memmap-replay-buffer folder replaybuf adopted waited forever on a
    FIFO at one of the seed's counters (``<name>.state.npy``, read by np.load's plain open)."""
    pytest.importorskip("memmap_replay_buffer")
    location = str(tmp_path / "seed")
    seed_buffer(location)
    ReplayBuffer.from_folder(location).close()  # adopted
    fifo = os.path.join(location, "num_episodes.state.npy")
    os.unlink(fifo)
    os.mkfifo(fifo)
    refused_never_waited_on(
        fifo, [lambda: ReplayBuffer.from_folder(location, read_only=True), lambda: ReplayBuffer.from_folder(location)]
    )
    assert stat_is_fifo(fifo)
