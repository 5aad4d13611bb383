"""The write side attacked as a hostile user would: a buffer writes only what it owns and never
through a link (the writer lease's file included), a user's own ``replaybuf/`` folder is not a
buffer's to erase or write into, and a write that fails (a file size limit: EFBIG) raises, never
returning as if it were stored."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import resource
import signal
import tempfile
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from replaybuf import BufferLockedError, ForeignEntriesError, ReplayBuffer, StorageError, verify
from replaybuf.storage._codecs import crc32c
from replaybuf.storage._zarr import ZarrStorage
from replaybuf.storage.lease import FileLease

from ._backends import LOCAL_BACKENDS as LOCAL
from ._backends import snapshot

pytest_plugins = ["tests._servers"]  # fixtures: s3_server

FIELDS = {"state": ("float", 3), "reward": "float"}


def new(location, backend=None, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(location, max_episodes=3, max_timesteps=4, fields=FIELDS, backend=backend, **kwargs)


def store(buffer: ReplayBuffer, value: float = 1.0) -> None:
    buffer.store_episode(state=np.full((3, 3), value, np.float32), reward=np.full(3, value, np.float32))


def stored_buffer(path, backend) -> None:
    buffer = new(path, backend)
    store(buffer)
    buffer.close()


# ---- the writer lease never writes through a link ----------------------------------------------


@pytest.mark.parametrize("open_for_writing", ["from_folder", "overwrite"])
@pytest.mark.parametrize("backend", LOCAL)
def test_a_linked_lease_file_is_refused_and_its_target_kept(tmp_path, backend, open_for_writing):
    stored_buffer(tmp_path / "buf", backend)
    theirs = tmp_path / "notes.txt"
    theirs.write_text("precious")
    lock = tmp_path / "buf" / "replaybuf" / "writer.lock"
    lock.unlink(missing_ok=True)
    os.symlink(theirs, lock)
    with pytest.raises(StorageError, match="writer.lock' is a symbolic link"):
        if open_for_writing == "from_folder":
            ReplayBuffer.from_folder(tmp_path / "buf")
        else:
            new(tmp_path / "buf", backend)
    assert theirs.read_text() == "precious" and os.path.islink(lock)
    assert len(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)) == 1


@pytest.mark.parametrize("backend", LOCAL)
def test_a_linked_blob_folder_is_refused_before_the_lease_writes_into_it(tmp_path, backend):
    stored_buffer(tmp_path / "buf", backend)
    target = tmp_path / "elsewhere"
    os.rename(tmp_path / "buf" / "replaybuf", target)
    (target / "writer.lock").write_text("precious")
    os.symlink(target, tmp_path / "buf" / "replaybuf")
    before = snapshot(str(target))
    with pytest.raises(StorageError, match="replaybuf' is a symbolic link"):
        ReplayBuffer.from_folder(tmp_path / "buf")
    assert snapshot(str(target)) == before  # the old lease deleted the user's writer.lock here


# ---- a writer whose folder moved writes nothing where it was ------------------------------------


@pytest.mark.parametrize("replaced_by", ["rename", "symlink"])
@pytest.mark.parametrize("backend", LOCAL)
def test_a_writer_whose_folder_was_moved_and_replaced_writes_nothing_into_the_new_one(tmp_path, backend, replaced_by):
    stored_buffer(tmp_path / "other", backend)  # another buffer: put where the writer's was
    writer = new(tmp_path / "buf", backend)
    store(writer, 2.0)
    os.rename(tmp_path / "buf", tmp_path / "moved")
    if replaced_by == "rename":
        os.rename(tmp_path / "other", tmp_path / "buf")
    else:
        os.symlink(tmp_path / "other", tmp_path / "buf")
    before = snapshot(str(tmp_path / "buf"))
    with pytest.raises(BufferLockedError, match="moved, renamed or replaced"):
        store(writer, 3.0)  # zarr wrote this episode into the other buffer, damaging it
    with contextlib.suppress(BufferLockedError):  # raised where counters were left to write
        writer.close()  # gives the lease back all the same
    assert snapshot(str(tmp_path / "buf")) == before
    moved = ReplayBuffer.from_folder(tmp_path / "moved")  # its own writer now
    assert len(moved) == 1 and float(moved.get_all_data()["state"][0, 0, 0]) == 2.0
    moved.close()


@pytest.mark.parametrize("which", ["writer.lock", "folder"])
def test_a_process_asking_who_writes_does_not_refuse_a_writer(tmp_path, which):
    """Before: a shared flock taken for a moment by holder() (replaybuf info, verify, a reader
    mid-edit) made a writer opening then fail as locked by "an unknown writer" (11% of 300
    opens beside a process asking in a loop)."""
    import fcntl
    import threading

    path = tmp_path / "buffer"
    ReplayBuffer(path, 2, 4, {"x": "float"}).close()
    (path / "replaybuf" / "writer.lock").touch()  # as a killed writer leaves it
    probe = os.open(path / "replaybuf" / "writer.lock" if which == "writer.lock" else path, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    threading.Timer(0.01, os.close, (probe,)).start()  # the probe lets go, as holder() does
    ReplayBuffer.from_folder(path).close()


@pytest.mark.parametrize("backend", LOCAL)
def test_a_lock_file_deleted_under_a_live_writer_lets_no_second_writer_in(tmp_path, backend):
    writer = new(tmp_path / "buf", backend)
    store(writer, 2.0)
    os.remove(tmp_path / "buf" / "replaybuf" / "writer.lock")  # "a stale lock", thought the user
    second = FileLease(str(tmp_path / "buf"))  # another process's open: it locked a new lock file
    with pytest.raises(BufferLockedError, match="its writer.lock is gone"):
        second.acquire()
    assert FileLease(str(tmp_path / "buf")).live_holder() == {}  # a writer, unknown: verify --repair waits
    store(writer, 3.0)  # the writer still holds the buffer alone
    writer.close()
    second.acquire()  # free once the writer closed
    second.release()
    reader = ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)
    assert sorted(np.asarray(reader.get_all_data()["state"])[:, 0, 0].tolist()) == [2.0, 3.0]


# ---- a user's own replaybuf/ folder is not a buffer's -------------------------------------------


def user_folder(path, backend) -> None:
    """A folder of the user's: files a buffer of ``backend`` would own by name, and a
    ``replaybuf/`` folder of their own, with a ``state.json`` that is no buffer's counters."""
    (path / "replaybuf" / "snapshots").mkdir(parents=True)
    (path / "replaybuf" / "state.json").write_text('{"num_episodes": 7}')
    (path / "replaybuf" / "snapshots" / "best.txt").write_text("mine")
    if backend == "memmap":
        (path / "obs.data.npy").write_bytes(np.arange(4).tobytes())
        (path / "metadata.pkl").write_bytes(b"mine")
    elif backend == "hdf5":
        import h5py

        with h5py.File(path / "data.h5", "w") as f:
            f["obs"] = np.arange(4)


@pytest.mark.parametrize("backend", LOCAL)
def test_a_users_replaybuf_folder_is_refused_and_kept(tmp_path, backend):
    user_folder(tmp_path, backend)
    before = snapshot(str(tmp_path))
    with pytest.raises(ForeignEntriesError, match="'replaybuf/'"):
        new(tmp_path, backend)
    assert snapshot(str(tmp_path)) == before


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("backend", LOCAL)
def test_a_users_file_named_replaybuf_is_foreign_not_an_os_error(tmp_path, backend, overwrite):
    # taken for the blob folder a killed open leaves, it got past the check: the lease then
    # failed with a bare "[Errno 17] File exists" (zarr) or "[Errno 20] Not a directory" (memmap, hdf5)
    (tmp_path / "replaybuf").write_text("mine")
    before = snapshot(str(tmp_path))
    with pytest.raises(ForeignEntriesError, match="not part of a replaybuf buffer: 'replaybuf'. .*nothing was deleted"):
        ReplayBuffer(tmp_path, max_episodes=3, max_timesteps=4, fields=FIELDS, backend=backend, overwrite=overwrite)
    assert snapshot(str(tmp_path)) == before


def test_a_users_replaybuf_prefix_on_an_object_store_is_refused_and_kept():
    import fsspec

    location = f"memory://hostile-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{location}/replaybuf/snapshots/best.txt", b"mine")
    with pytest.raises(ForeignEntriesError, match="'replaybuf/'"):
        new(location)
    assert fs.cat(f"{location}/replaybuf/snapshots/best.txt") == b"mine"
    assert sorted(fs.find(location)) == [f"/{location.removeprefix('memory://')}/replaybuf/snapshots/best.txt"]


def test_a_users_replaybuf_prefix_on_s3_is_refused_unwritten(s3_server):
    location = f"s3://{s3_server.bucket}/hostile-{uuid.uuid4().hex[:8]}"
    kv = ZarrStorage(location, s3_server.storage_options).kv
    kv.set_many({"replaybuf/state.json": b'{"mine": 1}', "replaybuf/snapshots/best": b"mine"})
    with s3_server.record() as requests:
        with pytest.raises(ForeignEntriesError, match="'replaybuf/'"):
            new(location, storage_options=s3_server.storage_options)
    assert requests.writes() == []
    assert kv.list_prefix("") == ["replaybuf/snapshots/best", "replaybuf/state.json"]
    assert kv.get("replaybuf/state.json") == b'{"mine": 1}'


@pytest.mark.parametrize(
    ("record", "taken"),
    [
        (b"\x00\xff not json", True),
        (b"[1, 2]", True),
        (b'{"expires": "soon"}', True),
        (b'{"expires": 1e400}', True),  # not finite: damage, expired
        (b"x" * 5000, True),  # larger than any record: damage, refused unread
        (b'{"host": "elsewhere", "pid": 1, "expires": 99999999999}', False),  # a live lease, as far as it says
    ],
)
def test_a_hand_edited_s3_lease_is_taken_over_when_damaged_and_refused_while_live(s3_server, record, taken):
    location = f"s3://{s3_server.bucket}/hostile-{uuid.uuid4().hex[:8]}"
    buffer = new(location, storage_options=s3_server.storage_options)
    store(buffer)
    buffer.close()
    ZarrStorage(location, s3_server.storage_options).kv.set_many({"replaybuf/writer.lock": record})
    if taken:
        writer = ReplayBuffer.from_folder(location, storage_options=s3_server.storage_options)
        assert len(writer) == 1
        writer.close()
    else:
        with pytest.raises(BufferLockedError, match="elsewhere"):
            ReplayBuffer.from_folder(location, storage_options=s3_server.storage_options)
        writer = ReplayBuffer.from_folder(location, storage_options=s3_server.storage_options, break_lock=True)
        assert len(writer) == 1
        writer.close()


def _memmap_create_killed_allocating(path: str) -> None:
    """In a child: create a memmap buffer, killed (SIGKILL) as it allocates its second array."""
    from replaybuf.storage._memmap import MemmapStorage

    allocate, allocated = MemmapStorage._allocate, []

    def allocate_then_die(self, *args, **kwargs):
        allocated.append(args[0])
        if len(allocated) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return allocate(self, *args, **kwargs)

    MemmapStorage._allocate = allocate_then_die
    new(path, "memmap")
    os._exit(0)  # not reached


def test_a_memmap_create_killed_allocating_its_arrays_is_overwritten_not_refused(tmp_path):
    child = multiprocessing.get_context("fork").Process(
        target=_memmap_create_killed_allocating, args=(str(tmp_path / "buf"),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert any(name.endswith(".npy") for name in os.listdir(tmp_path / "buf"))  # its first array
    # the arrays were refused as the user's (ForeignEntriesError) by every later create
    store(new(tmp_path / "buf", "memmap"))
    assert len(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)) == 1


@pytest.mark.parametrize("backend", LOCAL)
def test_what_a_killed_open_or_create_leaves_is_still_overwritten(tmp_path, backend):
    # a writable open killed holding its lease, before its create wrote anything
    (tmp_path / "lease-only" / "replaybuf").mkdir(parents=True)
    (tmp_path / "lease-only" / "replaybuf" / "writer.lock").write_text('{"pid": 1}')
    store(new(tmp_path / "lease-only", backend))
    assert len(ReplayBuffer.from_folder(tmp_path / "lease-only", read_only=True)) == 1
    if backend == "zarr":
        return  # zarr's create writes its root document first: there is a buffer from then on
    # a create killed after its counters, before its config
    stored_buffer(tmp_path / "cut", backend)
    os.unlink(tmp_path / "cut" / ("replaybuf.json" if backend == "memmap" else "data.h5"))
    store(new(tmp_path / "cut", backend))
    assert len(ReplayBuffer.from_folder(tmp_path / "cut", read_only=True)) == 1


# ---- a write that fails raises; one that returned is stored ------------------------------------

EPISODES = [np.full((3, 3), value, np.float32) for value in (1.0, 2.0, 3.0)]
EDITS = {
    "store_episode": lambda buffer: buffer.store_episode(state=np.full((3, 3), 9.0, np.float32), reward=np.zeros(3)),
    "update": lambda buffer: buffer.update(0, state=np.full((3, 3), 7.0, np.float32)),
    "drop_episodes": lambda buffer: buffer.drop_episodes([1]),
    "clear": lambda buffer: buffer.clear(),
    "close": lambda buffer: None,  # the close after each edit: hdf5 writes data.h5's superblock then
}
# each edit's states of slots 0-3 once made (None: an empty slot)
MADE = {
    "store_episode": [*EPISODES, np.full((3, 3), 9.0, np.float32)],
    "update": [np.full((3, 3), 7.0, np.float32), *EPISODES[1:], None],
    "drop_episodes": [EPISODES[0], None, EPISODES[2], None],
    "clear": [None] * 4,
    "close": [*EPISODES, None],
}


def _edit_under_a_file_size_limit(path: str, edit: str, limit: int, results) -> None:
    """In a child: open the buffer, then make ``edit`` with every write past ``limit`` bytes of
    a file failing (EFBIG), and say how it ended."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the failing write returns EFBIG instead
    buffer = ReplayBuffer.from_folder(path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        EDITS[edit](buffer)
        buffer.close()
        results.send("returned")
    except BaseException as e:  # anything but a StorageError fails the test
        results.send(f"{type(e).__name__}: {e}")
    finally:
        os._exit(0)  # no exit hooks: the lease dies with the process


@pytest.mark.parametrize("limit", [0, 1024])  # 0: the counters cannot be written either
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("backend", LOCAL)
def test_an_edit_whose_writes_fail_raises_or_is_stored(tmp_path, backend, edit, limit):
    buffer = ReplayBuffer(tmp_path / "buf", max_episodes=4, max_timesteps=4, fields=FIELDS, backend=backend)
    for state in EPISODES:
        buffer.store_episode(state=state, reward=np.zeros(3, np.float32))
    buffer.close()
    receiver, sender = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_edit_under_a_file_size_limit, args=(str(tmp_path / "buf"), edit, limit, sender)
    )
    child.start()
    child.join(60)
    assert receiver.poll(), f"the child ended ({child.exitcode}) without saying how the edit went"
    outcome = receiver.recv()
    assert outcome == "returned" or outcome.startswith(("StorageError: ", "CountersNotWritten: ")), outcome
    # CountersNotWritten comes after the edit was made: its message must say so
    made = outcome == "returned" or outcome.startswith("CountersNotWritten")
    if made and edit == "clear" and outcome != "returned":
        assert "every episode was erased" in outcome, outcome
    expected = MADE[edit] if made else [*EPISODES, None]
    if backend == "hdf5" and limit and edit != "close":  # data.h5 is larger than 1 KiB, the others smaller
        assert outcome.startswith("StorageError") and "data.h5" in outcome, outcome
    reopened = ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)
    lens = np.asarray(reopened.meta_data["episode_lens"])
    for slot, state in enumerate(expected):
        if state is None:
            assert lens[slot] == 0, (outcome, slot)
        else:
            assert lens[slot] == 3, (outcome, slot)
            np.testing.assert_array_equal(np.asarray(reopened.data["state"][slot])[:3], state, err_msg=outcome)
    assert verify(tmp_path / "buf") == []


# ---- a kill at any point of a drop leaves the buffer readable ----------------------------------


def _drop_killed_at_its_second_bookkeeping_write(path: str) -> None:
    """In a child: drop slot 1, killed (SIGKILL) as it writes the second of the slot's length
    and generation."""
    buffer = ReplayBuffer.from_folder(path)
    write_meta, writes = buffer.storage.write_meta, []

    def write_then_die(name, *args, **kwargs):
        writes.append(name)
        if len(writes) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_meta(name, *args, **kwargs)

    buffer.storage.write_meta = write_then_die
    buffer.drop_episodes([1])
    os._exit(0)  # not reached


@pytest.mark.parametrize("backend", LOCAL)
def test_a_drop_killed_between_its_two_writes_leaves_every_other_episode_readable(tmp_path, backend):
    buffer = ReplayBuffer(tmp_path / "buf", max_episodes=4, max_timesteps=4, fields=FIELDS, backend=backend)
    for state in EPISODES:
        buffer.store_episode(state=state, reward=np.zeros(3, np.float32))
    buffer.close()
    child = multiprocessing.get_context("fork").Process(
        target=_drop_killed_at_its_second_bookkeeping_write, args=(str(tmp_path / "buf"),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    # the old order (generation first) left slot 1 with a length and no generation: every open,
    # read-only ones included, refused the whole buffer as damaged
    assert len(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)) == 2
    reopened = ReplayBuffer.from_folder(tmp_path / "buf")
    assert np.asarray(reopened.meta_data["episode_lens"]).tolist() == [3, 0, 3, 0]
    for slot in (0, 2):
        np.testing.assert_array_equal(np.asarray(reopened.data["state"][slot])[:3], EPISODES[slot])
    reopened.close()
    assert verify(tmp_path / "buf") == []


# ---- a rejected call leaves the buffer byte-identical ------------------------------------------

CALLS = {
    "store_episode": lambda buffer, value: buffer.store_episode(state=value, reward=np.zeros(3, np.float32), task=1),
    "store_episode meta": lambda buffer, value: buffer.store_episode(
        state=np.zeros((3, 3), np.float32), reward=np.zeros(3, np.float32), task=value
    ),
    "store": lambda buffer, value: buffer.store(state=value, reward=1.0),
    "update": lambda buffer, value: buffer.update(0, state=value),
    "update meta": lambda buffer, value: buffer.update(0, task=value),
    "data[...] =": lambda buffer, value: buffer.data["state"].__setitem__((0, slice(0, 3)), value),
    "meta_data[...] =": lambda buffer, value: buffer.meta_data["task"].__setitem__(0, value),
    "meta_data[name] =": lambda buffer, value: buffer.meta_data.__setitem__("task", value),
    "data[name] =": lambda buffer, value: buffer.data.__setitem__("state", value),
}
ODD_VALUES = st.sampled_from(
    ["abc", None, {"x": 1}, [[1.0, 2.0], [3.0]], 1e300, np.nan, np.array([object()] * 3), np.zeros((3, 3), complex)]
)
ARRAYS = hnp.arrays(
    st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_]),
    hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
)


def episode_in_progress_buffer(location: str, backend: str) -> ReplayBuffer:
    """A new buffer at ``location`` with a committed episode and one in progress (its step log
    written)."""
    buffer = ReplayBuffer(
        location, max_episodes=4, max_timesteps=4, fields=FIELDS, meta_fields={"task": "int"}, backend=backend
    )
    buffer.store_episode(state=np.ones((3, 3), np.float32), reward=np.ones(3, np.float32), task=3)
    buffer.store(state=np.ones(3, np.float32), reward=1.0)
    buffer.flush()
    return buffer


@pytest.fixture(scope="module")
def buffers():
    """One `episode_in_progress_buffer` per backend, shared by the examples: a rejected call
    must leave each as it was."""
    with tempfile.TemporaryDirectory() as root:
        made = {backend: episode_in_progress_buffer(os.path.join(root, backend), backend) for backend in LOCAL}
        yield made
        for buffer in made.values():
            buffer.close()


@pytest.mark.filterwarnings("ignore:store_episode called with an episode in progress")  # an accepted one
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.sampled_from(LOCAL), call=st.sampled_from(list(CALLS)), value=ODD_VALUES | ARRAYS)
def test_a_rejected_call_leaves_the_buffer_byte_identical(buffers, backend, call, value):
    buffer = buffers[backend]
    before, task, state = (
        snapshot(buffer.storage.location),
        buffer.meta_data["task"][0],
        np.asarray(buffer.data["state"][0]),
    )
    try:
        CALLS[call](buffer, value)
    except (ValueError, TypeError, IndexError) as e:
        assert snapshot(buffer.storage.location) == before, f"{call} of {value!r} was refused ({e}) but wrote"
        assert buffer.meta_data["task"][0] == task
        np.testing.assert_array_equal(np.asarray(buffer.data["state"][0]), state)
    else:  # accepted: made as a write, undone so that later examples start from the same buffer
        assert call not in ("meta_data[name] =", "data[name] ="), "assigning a field's name writes nothing"
        if call.startswith("store"):  # an episode committed (the one in progress dropped), or a step added
            buffer.close()
            buffers[backend] = episode_in_progress_buffer(buffer.storage.location, backend)
        else:
            buffer.update(0, state=state, task=task)


@pytest.mark.parametrize("backend", LOCAL)
def test_a_record_of_slots_nested_too_deep_is_damage_not_a_crash(tmp_path, backend):
    """A record of the slots being written that passes its checksum but holds JSON nested past
    the parser's recursion limit is a damaged record (every empty slot is then zeroed when
    reused), not a RecursionError out of the open."""
    stored_buffer(tmp_path / "buf", backend)
    body = b"[" * 100_000
    record = (crc32c(body).to_bytes(4, "little") + len(body).to_bytes(4, "little")) + body
    (tmp_path / "buf" / "replaybuf" / "writing").write_bytes(record)
    with pytest.warns(UserWarning, match="replaybuf/writing.*damaged"):
        buffer = ReplayBuffer.from_folder(tmp_path / "buf", backend=backend)
    with buffer:
        assert len(buffer) == 1
        store(buffer, 2.0)
        assert len(buffer) == 2


# ---- reopening with another config changes nothing ---------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fields": {"state": ("int", 3), "reward": "float"}}, "fields.state"),
        ({"fields": {"state": ("float", 4), "reward": "float"}}, "fields.state"),
        ({"fields": {**FIELDS, "extra": "int"}}, "fields.extra"),
        ({"max_episodes": 5}, "max_episodes: stored 3 vs passed 5"),
        ({"max_timesteps": 9}, "max_timesteps: stored 4 vs passed 9"),
    ],
)
@pytest.mark.parametrize("backend", LOCAL)
def test_reopening_with_another_config_is_refused_naming_it_and_changes_no_byte(tmp_path, backend, change, named):
    stored_buffer(tmp_path / "buf", backend)
    before = snapshot(tmp_path / "buf")
    config = {"max_episodes": 3, "max_timesteps": 4, "fields": FIELDS, **change}
    with pytest.raises(ValueError, match=named):
        ReplayBuffer(tmp_path / "buf", backend=backend, overwrite=False, **config)
    other = "zarr" if backend != "zarr" else "memmap"
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=f"holds a '{backend}' buffer"):
            ReplayBuffer(
                tmp_path / "buf", max_episodes=3, max_timesteps=4, fields=FIELDS, backend=other, overwrite=overwrite
            )
    assert snapshot(tmp_path / "buf") == before, "a refused reopen changed a file or a modification time"


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"max_episodes": 5}, "max_episodes: stored 3 vs passed 5"),
        ({"max_timesteps": 9}, "max_timesteps: stored 4 vs passed 9"),
        ({"circular": True}, "circular: stored False vs passed True"),
        ({"meta_fields": {"task": "int"}}, "meta_fields.task: stored .absent. vs passed"),
    ],
)
@pytest.mark.parametrize("backend", LOCAL)
def test_settings_given_without_fields_are_checked_not_ignored(tmp_path, backend, given, named):
    # from_folder(path, circular=True) or ReplayBuffer(path, max_episodes=n, overwrite=False)
    # opened with the stored settings, silently ignoring the ones asked for
    stored_buffer(tmp_path / "buf", backend)
    before = snapshot(tmp_path / "buf")
    for read_only in (False, True):
        with pytest.raises(ValueError, match=named):
            ReplayBuffer.from_folder(tmp_path / "buf", read_only=read_only, **given)
        with pytest.raises(ValueError, match=named):
            ReplayBuffer(tmp_path / "buf", overwrite=False, read_only=read_only, **given)
    assert snapshot(tmp_path / "buf") == before
    with ReplayBuffer.from_folder(tmp_path / "buf", max_episodes=3, max_timesteps=4) as buffer:  # the stored ones
        assert len(buffer) == 1


# ---- an empty location names no folder ---------------------------------------------------------


@pytest.mark.parametrize("location", ["", "file://"])
def test_an_empty_location_is_refused_not_taken_as_the_current_folder(tmp_path, monkeypatch, location):
    monkeypatch.chdir(tmp_path)
    stored_buffer(".", "zarr")  # the user's buffer in the current folder
    before = snapshot(str(tmp_path))
    # an unset setting (os.environ.get("BUFFER", "")) erased it: "" is the current folder to os.path
    with pytest.raises(ValueError, match=r"the location '(file://)?' is empty: it names no folder"):
        new(location)
    with pytest.raises(ValueError, match="is empty"):
        ReplayBuffer.from_folder(location)
    assert snapshot(str(tmp_path)) == before


# ---- SIGKILL at random points of every kind of write -------------------------------------------

KILLS_PER_BACKEND = 25


def _model(buffer: ReplayBuffer) -> list[list[float] | None]:
    """Each slot's episode as (its reward value, length, its state value), None where empty:
    every stored episode holds one value per field (an update rewrites the state's)."""
    lens = np.asarray(buffer.meta_data["episode_lens"]).tolist()
    return [
        [float(buffer.data["reward"][slot][0]), n, float(buffer.data["state"][slot][0, 0])] if n else None
        for slot, n in enumerate(lens)
    ]


def _write(path: str, record: object) -> None:
    with open(f"{path}.tmp", "w") as f:
        json.dump(record, f)
    os.replace(f"{path}.tmp", path)


def _write_until_killed(path: str, journal: str, seed: int, ready) -> None:
    """In a child: random writes, each recorded before it starts (``pending``: its kind, the
    slots it may change, its value) and after it returned (``done``: every slot's episode)."""
    rng = np.random.default_rng(seed)
    buffer = ReplayBuffer.from_folder(path)
    _write(f"{journal}/done.json", _model(buffer))
    ready.send(True)
    value = 1000.0 * seed
    while True:
        value += 1
        model = _model(buffer)
        committed = [slot for slot, episode in enumerate(model) if episode]
        kinds = ["store_episode", "steps", "update", "drop", "clear"] if committed else ["store_episode"]
        kind = str(rng.choice(kinds, p=[0.3, 0.25, 0.2, 0.15, 0.1] if committed else None))
        slots = {
            "store_episode": [buffer.episode_index],
            "steps": [buffer.episode_index],
            "clear": list(range(len(model))),
        }.get(kind) or [int(rng.choice(committed))]
        _write(f"{journal}/pending.json", {"kind": kind, "slots": slots, "value": value})
        steps = int(rng.integers(1, 5))
        if kind == "store_episode":
            buffer.store_episode(state=np.full((steps, 3), value, np.float32), reward=np.full(steps, value, np.float32))
        elif kind == "steps":
            for _ in range(steps):
                buffer.store(state=np.full(3, value, np.float32), reward=value)
            buffer.advance_episode()
        elif kind == "update":
            buffer.update(slots[0], state=np.full((model[slots[0]][1], 3), value, np.float32))
        elif kind == "drop":
            buffer.drop_episodes(slots)
        else:
            buffer.clear()
        _write(f"{journal}/done.json", _model(buffer))


def _allowed(episode, before, pending, state, reward) -> bool:
    """Whether a slot holding ``state`` and ``reward`` (its length theirs) is what it held when
    the last write returned (``before``), or what the write in flight (``pending``) may leave."""
    n = len(reward)
    if before is None and n == 0:
        return True
    if before is not None and n == before[1] and (state == before[2]).all() and (reward == before[0]).all():
        return True
    if pending is None or episode not in pending["slots"]:
        return False
    kind, value = pending["kind"], pending["value"]
    if n == 0:  # emptied by the write in flight: a reused slot, a drop, a clear
        return True
    if kind in ("store_episode", "steps"):  # (steps: committed from the step log at the reopen)
        return bool((state == value).all() and (reward == value).all())
    # an update killed part way leaves each row old or new, its checksums resealed on reopen
    return kind == "update" and before is not None and n == before[1] and bool(np.isin(state, [before[2], value]).all())


@pytest.mark.parametrize("backend", LOCAL)
def test_a_writer_killed_at_random_points_keeps_every_committed_episode(tmp_path, backend):
    path, journal = str(tmp_path / "buf"), str(tmp_path)
    buffer = ReplayBuffer(path, max_episodes=4, max_timesteps=4, fields=FIELDS, backend=backend, circular=True)
    buffer.store_episode(state=np.ones((2, 3), np.float32), reward=np.ones(2, np.float32))
    buffer.close()
    rng = np.random.default_rng(7)
    for kill in range(KILLS_PER_BACKEND):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{journal}/pending.json")
        receiver, sender = multiprocessing.Pipe(duplex=False)
        child = multiprocessing.get_context("fork").Process(
            target=_write_until_killed, args=(path, journal, kill + 1, sender)
        )
        child.start()
        assert receiver.poll(60), "the writer did not start"
        receiver.recv()
        time.sleep(float(rng.uniform(0.0, 0.15)))
        os.kill(child.pid, signal.SIGKILL)
        child.join(60)
        with open(f"{journal}/done.json") as f:
            done = json.load(f)
        pending = None
        if os.path.exists(f"{journal}/pending.json"):
            with open(f"{journal}/pending.json") as f:
                pending = json.load(f)
        reopened = ReplayBuffer.from_folder(path)  # a writable open: recovers what the kill left
        lens = np.asarray(reopened.meta_data["episode_lens"])
        for episode, before in enumerate(done):
            state = np.asarray(reopened.data["state"][episode])[: lens[episode], 0]
            reward = np.asarray(reopened.data["reward"][episode])[: lens[episode]]
            assert _allowed(episode, before, pending, state, reward), (kill, episode, before, pending, state, reward)
        reopened.close()
        assert verify(path) == [], (kill, pending)
