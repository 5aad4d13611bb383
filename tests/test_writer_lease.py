"""One writer per buffer: the writer lease (issue #12, case 2 "two writers, no refusal").

Local folders (zarr, memmap, hdf5) hold an flock on ``replaybuf/writer.lock``; zarr on object
stores (memory://, S3 via moto) a lease object created with a conditional PUT, renewed by a
heartbeat and taken over once expired. Other processes are real ones (``tests/_lease_child.py``).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from replaybuf import BufferLockedError, ConcatReplayBuffer, ReplayBuffer
from replaybuf.actors import shard_location
from replaybuf.cli import main as cli_main
from replaybuf.storage import StorageError, make_storage
from replaybuf.storage.lease import LEASE_KEY, LEASE_SECONDS_ENV, TAKE_OVER_TRIES, ObjectLease
from tests._backends import snapshot
from tests._data import seed_buffer
from tests._lease_child import FIELDS, META

pytest_plugins = ["tests._servers"]  # fixtures: s3_server, gcs_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = ["zarr", "memmap", "hdf5"]


def _kwargs(backend: str) -> dict:
    return {} if backend in ("zarr", "memory") else {"backend": backend}


def _open(location: str, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(location, 200, 3, fields=FIELDS, meta_fields=META, **kwargs)


def _store(buffer: ReplayBuffer, uid: int) -> None:
    buffer.store_episode(x=np.full((3, 4), uid, np.float32), uid=uid)


# the children a test started: stopped and their pipes closed after it (``_children_closed``)
_CHILDREN: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _children_closed():
    yield
    while _CHILDREN:
        process = _CHILDREN.pop()
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def _child(mode: str, location: str, kwargs: dict, env: dict | None = None, **settings) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests._lease_child",
            mode,
            json.dumps({"location": location, "kwargs": kwargs, **settings}),
        ],
        cwd=ROOT,
        env={**environment, **(env or {})},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    _CHILDREN.append(process)
    return process


def _ready(process: subprocess.Popen) -> list[str]:
    line = process.stdout.readline().split()
    assert line[:1] == ["ready"], f"child failed to start (exit {process.wait()})"
    return line[1:]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _open_when_released(location: str, seconds: float = 20, **kwargs) -> ReplayBuffer:
    """A writable open, retried until the lease held so far is given back or expires."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return ReplayBuffer.from_folder(location, **kwargs)
        except BufferLockedError:
            assert time.monotonic() < deadline, f"the writer lease of {location} was never released"
            time.sleep(0.1)


def _assert_names_holder(error: BufferLockedError | str, pid: int) -> None:
    message = str(error)
    assert f"pid {pid} on host " in message and " since 20" in message
    assert "ReplayBuffer.shard(root, i)" in message and "ConcatReplayBuffer(root)" in message


@pytest.fixture
def location(backend, tmp_path) -> str:
    if backend == "memory":
        return f"memory://replaybuf-lease/{uuid.uuid4().hex}"
    return str(tmp_path / "buffer")


@pytest.fixture
def s3_location(s3_server) -> tuple[str, dict]:
    return s3_server.url(f"lease-{uuid.uuid4().hex[:8]}"), s3_server.storage_options


# ---- case 2: two writer processes, the second refused, the first's episodes intact -----------------


@pytest.mark.parametrize("backend", LOCAL)
def test_second_writer_process_is_refused_and_first_keeps_every_episode(backend, tmp_path):
    location = str(tmp_path / "buffer")
    kwargs = {"max_episodes": 5000, "max_timesteps": 3, **_kwargs(backend)}
    first = _child("store", location, kwargs)
    try:
        _ready(first)
        second = _child("try", location, kwargs, seconds=1.0)
        attempts = json.loads(second.communicate(timeout=60)[0])
        first.stdin.close()
        uids = json.loads(first.stdout.readline())
    finally:
        _kill(first.pid)
        first.wait()
    assert attempts["opened"] == 0 and attempts["refused"] > 0
    _assert_names_holder(attempts["message"], first.pid)
    assert attempts["holder"]["pid"] == first.pid
    reader = ReplayBuffer.from_folder(location, read_only=True)
    assert len(uids) > 0 and len(reader) == len(uids)
    slots = reader.valid_episodes()
    np.testing.assert_array_equal(np.sort(reader.meta_data["uid"][slots]), uids)
    data = reader.storage.read_rows("x", slots, 0, 3)
    np.testing.assert_array_equal(data, np.broadcast_to(reader.meta_data["uid"][slots, None, None], data.shape))


@pytest.mark.parametrize("backend", [*LOCAL, "s3"])
def test_second_writer_process_is_refused_even_with_overwrite_and_erases_nothing(backend, tmp_path, request):
    if backend == "s3":
        location, options = request.getfixturevalue("s3_location")
        kwargs = {"storage_options": options}
    else:
        location, kwargs = str(tmp_path / "buffer"), _kwargs(backend)
    holder = _open(location, **kwargs)
    _store(holder, 1)
    before = _stored(holder)
    other = _child("try", location, {"max_episodes": 200, "max_timesteps": 3, **kwargs}, seconds=0.3, overwrite=True)
    attempts = json.loads(other.communicate(timeout=60)[0])
    assert attempts["opened"] == 0 and attempts["refused"] > 0
    _assert_names_holder(attempts["message"], os.getpid())
    if backend == "s3":
        assert "break_lock=True" in attempts["message"] and f"replaybuf unlock {location}" in attempts["message"]
    assert _stored(holder) == before
    _store(holder, 2)
    holder.close()
    with ReplayBuffer.from_folder(location, read_only=True, **kwargs) as reader:
        assert reader.meta_data["uid"][reader.valid_episodes()].tolist() == [1, 2]


# ---- in one process ----------------------------------------------------------------------------------


def _stored(buffer: ReplayBuffer) -> dict:
    """Every object of the buffer but the lease (renewed by the heartbeat) and its bytes."""
    kv = buffer.storage.kv
    keys = [key for key in kv.list_prefix("") if key != LEASE_KEY]
    return dict(zip(keys, kv.get_many(keys)))


def _held(location: str, **kwargs) -> bool:
    return make_storage(location, **kwargs).writer_lease().holder() is not None


def test_writers_in_one_process_share_the_lease_as_the_seed_readme_does(location, backend):
    # memmap-replay-buffer's README reopens with from_folder() and keeps writing with the first
    first = _open(location, **_kwargs(backend))
    _store(first, 7)
    rehydrated = ReplayBuffer.from_folder(location)
    _store(first, 8)
    assert rehydrated.refresh().meta_data["uid"][rehydrated.valid_episodes()].tolist() == [7, 8]
    first.close()
    assert _held(location), "the lease stays until the last writer sharing it closes"
    rehydrated.close()
    assert not _held(location)


def test_one_process_shares_an_object_lease_across_spellings_and_takes_one_per_endpoint(s3_location):
    """``s3a://b/x/`` is the buffer at ``s3://b/x``: a second open in the
    process shares its lease (they were refused, naming this process). ``s3://b/x`` on another
    endpoint is another buffer: it shared the first one's lease, so its own server got no lease
    object (a second writer process opened it) and its ``overwrite=True`` stopped the first."""
    url, options = s3_location
    first = _open(url, storage_options=options)
    again = ReplayBuffer.from_folder(url.replace("s3://", "s3a://") + "/", storage_options=options)
    assert again.storage.writer_lease().key == first.storage.writer_lease().key
    _store(again, 1)
    elsewhere = make_storage(url, storage_options={**options, "endpoint_url": "http://127.0.0.1:9"})
    assert elsewhere.writer_lease().key != first.storage.writer_lease().key
    assert first.refresh().meta_data["uid"][first.valid_episodes()].tolist() == [1]
    first.close()


def test_a_closed_writer_refuses_writes_and_leaves_the_buffer_to_the_next(location, backend):
    """close() gives the lease back: writes through the closed object would run beside the next
    writer (both once wrote the same slots), so each is refused, naming the buffer, and changes
    nothing; reads still work, and closing again does nothing."""
    first = _open(location, **_kwargs(backend))
    _store(first, 7)
    first.close()
    first.close()
    calls = {
        "store_episode": lambda: _store(first, 8),
        "store": lambda: first.store(**{name: np.zeros(shape, np.float32) for name, (_, shape) in FIELDS.items()}),
        "clear": first.clear,
        "drop_episodes": lambda: first.drop_episodes([0]),
        "compact": first.compact,
    }
    for call, attempt in calls.items():
        with pytest.raises(ValueError, match=rf"cannot call `{call}` on .*was closed.*from_folder"):
            attempt()
    assert not _held(location)
    second = ReplayBuffer.from_folder(location)
    _store(second, 9)
    second.close()
    assert _uids(location) == [7, 9]
    assert first.refresh().meta_data["uid"][first.valid_episodes()].tolist() == [7, 9]


def _uids(location: str) -> list[int]:
    with ReplayBuffer.from_folder(location, read_only=True) as reader:
        return reader.meta_data["uid"][reader.valid_episodes()].tolist()


def test_a_second_open_in_one_process_leaves_an_episode_in_progress_to_its_writer(location, backend):
    first = _open(location, **_kwargs(backend))
    _store(first, 7)
    with first.one_episode(uid=8):  # an episode in progress, stored step by step
        first.store(x=np.full(4, 8, np.float32))
        first.flush()  # its step log is on disk: a killed writer's would be recovered from it
        second = ReplayBuffer.from_folder(location)
        assert len(second) == 1 and _uids(location) == [7], "the open committed another object's episode"
        with pytest.raises(BufferLockedError, match="episode in progress") as refused:
            _store(second, 9)
        assert repr(location) in str(refused.value) and "read_only=True" in str(refused.value)
        assert _uids(location) == [7], "a refused write leaves the buffer as it was"
        first.store(x=np.full(4, 8, np.float32))
    assert _uids(location) == [7, 8]
    _store(second, 9)  # the episode ended: the second object writes after it
    _store(first, 10)  # and the first after the second's
    assert _uids(location) == [7, 8, 9, 10]
    with ReplayBuffer.from_folder(location, read_only=True) as reader:
        assert reader.episode_lens[reader.valid_episodes()].tolist() == [3, 2, 3, 3]
    first.close()
    second.close()


def test_a_dropped_writer_a_reference_cycle_keeps_does_not_refuse_the_next(location, backend):
    first = _open(location, **_kwargs(backend))
    _store(first, 1)
    second = ReplayBuffer.from_folder(location)
    _store(first, 2)
    first.store(x=np.full(4, 3, np.float32))  # an episode in progress ...
    first.itself = first  # ... in an object only a cycle keeps once dropped
    del first
    _store(second, 4)  # the dropped object is collected, its unfinished episode with it
    assert _uids(location) == [1, 2, 4]
    second.close()


def test_writers_in_one_process_never_overwrite_each_others_episodes(location, backend):
    first = _open(location, **_kwargs(backend))
    _store(first, 1)
    second = ReplayBuffer.from_folder(location)
    _store(first, 2)
    with second.one_episode(uid=3):  # its meta-only group moves past the first's episodes too
        _store(first, 4)
        second.store(x=np.full(4, 3, np.float32))
    assert _uids(location) == [1, 2, 4, 3]
    first.close()
    second.close()


def test_overwrite_in_the_same_process_replaces_the_buffer_and_stops_the_old_writer(location, backend):
    # a notebook cell that creates the buffer, run again: the new buffer wins, the old object
    # (still referenced until the assignment) can no longer write into it
    writer = _open(location, **_kwargs(backend))
    _store(writer, 3)
    again = _open(location, overwrite=True, **_kwargs(backend))
    assert again.num_episodes == 0
    with pytest.raises(BufferLockedError, match="later open of it with overwrite=True"):
        _store(writer, 4)
    _store(again, 5)
    assert ReplayBuffer.from_folder(location, read_only=True).meta_data["uid"][again.valid_episodes()].tolist() == [5]
    writer.close()
    assert _held(location), "the lease stays with the newer writer"
    again.close()
    assert not _held(location)


def test_a_full_old_writer_is_told_it_was_replaced_not_that_the_buffer_is_full(location, backend):
    """README (One writer per buffer): after ``overwrite=True`` in the same process the older
    objects refuse every further write with BufferLockedError. An older object that had filled
    its (not circular) buffer answered "the replay buffer is full ... clear() it" from the erased
    buffer's counters instead, though the new buffer is empty."""
    writer = ReplayBuffer(location, 2, 3, fields=FIELDS, meta_fields=META, **_kwargs(backend))
    _store(writer, 1)
    _store(writer, 2)
    again = ReplayBuffer(location, 2, 3, fields=FIELDS, meta_fields=META, overwrite=True, **_kwargs(backend))
    for write in (lambda: _store(writer, 3), lambda: writer.store(x=np.zeros(4, np.float32)), writer.clear):
        with pytest.raises(BufferLockedError, match="later open of it with overwrite=True"):
            write()
    assert again.num_episodes == 0
    writer.close()
    again.close()


def test_lock_survives_overwriting_an_existing_buffer(location, backend):
    _open(location, **_kwargs(backend)).close()
    writer = _open(location, overwrite=True, **_kwargs(backend))  # erases the old buffer, not the lock
    assert _held(location)
    writer.close()


def test_reader_alongside_writer_takes_nothing_and_writes_nothing(location, backend):
    writer = _open(location, **_kwargs(backend))
    _store(writer, 5)
    before = snapshot(location)
    reader = ReplayBuffer.from_folder(location, read_only=True)
    assert reader.meta_data["uid"][reader.valid_episodes()].tolist() == [5]
    assert reader.storage._lease is None
    reader.close()
    assert snapshot(location) == before
    _store(writer, 6)
    writer.close()


def test_close_releases_the_lock_and_dropping_the_object_too(location, backend, no_gc):
    writer = _open(location, **_kwargs(backend))
    writer.close()
    assert not _held(location)
    second = ReplayBuffer.from_folder(location)
    assert _held(location)
    del second  # without close() nor a collection: an object-store lease goes a moment later
    deadline = time.monotonic() + 10
    while _held(location):
        assert time.monotonic() < deadline, "the collected writer's lease was never released"
        time.sleep(0.05)


def test_a_failed_open_gives_the_lock_back(location, backend):
    _open(location, **_kwargs(backend)).close()
    with pytest.raises(ValueError, match="max_episodes"):
        ReplayBuffer(location, 999, 3, fields=FIELDS, meta_fields=META, overwrite=False, **_kwargs(backend))
    assert not _held(location)


def test_pickled_buffer_is_read_only_and_carries_no_lease(location, backend):
    writer = _open(location, **_kwargs(backend))
    _store(writer, 2)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.read_only and copy.storage._lease is None
    with pytest.raises(ValueError, match="pickled copy of a writable buffer"):  # not "opened read-only"
        _store(pickle.loads(pickle.dumps(copy)), 3)
    copy.close()
    del copy
    gc.collect()
    assert _held(location)
    writer.close()


def test_shards_write_in_parallel_each_shard_once(tmp_path):
    root = str(tmp_path / "root")
    shards = [
        ReplayBuffer.shard(root, i, max_episodes=4, max_timesteps=3, fields=FIELDS, meta_fields=META) for i in (0, 1)
    ]
    assert _held(shard_location(root, 0)) and _held(shard_location(root, 1))
    for i, shard in enumerate(shards):
        _store(shard, i)
        shard.close()
    assert len(ConcatReplayBuffer(root)) == 2


def test_seed_folder_writer_is_locked_and_reader_writes_nothing(tmp_path):
    folder = tmp_path / "seed"
    seed_buffer(folder, lengths=(3,), partial=1)
    before = snapshot(str(folder))
    ReplayBuffer.from_folder(folder, read_only=True).close()
    assert snapshot(str(folder)) == before
    writer = ReplayBuffer.from_folder(folder)  # adopts the folder under the lease
    assert _held(str(folder))
    writer.close()
    assert not _held(str(folder))


# ---- stale locks: a killed writer, expiry, break_lock, replaybuf unlock ------------------------------------


@pytest.mark.parametrize("backend", LOCAL)
def test_sigkilled_writer_frees_its_local_lock_even_with_a_forked_child_alive(backend, tmp_path):
    location = str(tmp_path / "buffer")
    holder = _child("hold", location, {"max_episodes": 4, "max_timesteps": 3, **_kwargs(backend)}, fork=True)
    pid, child = map(int, _ready(holder))
    try:
        with pytest.raises(BufferLockedError) as caught:
            ReplayBuffer.from_folder(location)
        _assert_names_holder(caught.value, pid)
        _kill(pid)
        holder.wait()
        writer = ReplayBuffer.from_folder(location)  # the forked child still runs: no lock with it
        assert writer.meta_data["uid"][writer.valid_episodes()].tolist() == [0]
        writer.close()
    finally:
        _kill(pid)
        _kill(child)


def test_local_break_lock_and_unlock_refuse_a_live_holder(tmp_path, capsys):
    location = str(tmp_path / "buffer")
    with pytest.raises(SystemExit):  # nothing there: a mistyped path
        cli_main(["unlock", location])
    assert "no replaybuf buffer (nor writer lease)" in capsys.readouterr().err
    _open(location).close()
    assert cli_main(["unlock", location]) == 0
    assert "no writer lease held" in capsys.readouterr().out
    writer = _open(location, overwrite=False)
    with pytest.raises(BufferLockedError, match="stop that process"):
        make_storage(location).writer_lease().acquire(break_lock=True)
    assert cli_main(["unlock", location]) == 1
    assert f"pid {os.getpid()}" in capsys.readouterr().err
    writer.close()


def test_expired_s3_lease_of_a_killed_writer_is_taken_over(s3_location):
    url, options = s3_location
    holder = _child(
        "hold", url, {"max_episodes": 4, "max_timesteps": 3, "storage_options": options}, env={LEASE_SECONDS_ENV: "2"}
    )
    pid = int(_ready(holder)[0])
    _kill(pid)
    holder.wait()
    with pytest.raises(BufferLockedError, match="lease expires at") as caught:
        ReplayBuffer.from_folder(url, storage_options=options)
    _assert_names_holder(caught.value, pid)
    writer = _open_when_released(url, storage_options=options)
    assert json.loads(writer.storage.kv.get(LEASE_KEY))["pid"] == os.getpid()
    assert writer.meta_data["uid"][writer.valid_episodes()].tolist() == [0]
    writer.close()
    assert writer.storage.kv.get(LEASE_KEY) is None  # released at close


@pytest.mark.parametrize("how", ["break_lock", "unlock"])
def test_breaking_an_object_store_lease_stops_the_old_writer(s3_location, monkeypatch, capsys, how):
    monkeypatch.setenv(
        LEASE_SECONDS_ENV, "2"
    )  # heartbeats every 0.5 s (slack for a loaded machine), here and in the child
    url, options = s3_location
    old = _open(url, storage_options=options)
    _store(old, 1)
    kwargs = {"max_episodes": 200, "max_timesteps": 3, "storage_options": options}
    if how == "unlock":
        assert cli_main(["unlock", url, "--storage-options", json.dumps(options)]) == 0
        assert f"removed the writer lease of pid {os.getpid()}" in capsys.readouterr().out
    else:
        kwargs["break_lock"] = True
    new = _child("hold", url, kwargs)  # takes the lease and stores uid 0
    try:
        pid = int(_ready(new)[0])
        deadline = time.monotonic() + 10
        while old.storage._lease.lost is None:
            assert time.monotonic() < deadline, "the old writer never noticed"
            time.sleep(0.05)
        with pytest.raises(BufferLockedError, match="cannot write to"):
            _store(old, 2)
        time.sleep(2.5)  # longer than the expiry: the new writer's heartbeat keeps its lease
        with pytest.raises(BufferLockedError) as caught:
            ReplayBuffer.from_folder(url, storage_options=options)
        _assert_names_holder(caught.value, pid)
        new.stdin.close()
        assert new.wait(timeout=60) == 0
    finally:
        _kill(new.pid)
    with ReplayBuffer.from_folder(url, storage_options=options) as reader:
        assert reader.meta_data["uid"][reader.valid_episodes()].tolist() == [1, 0]


def test_a_writer_paused_past_its_lease_writes_nothing_once_it_was_taken_over(s3_location, monkeypatch):
    """A writer paused longer than its lease's expiry (SIGSTOP, a suspended machine: its
    heartbeat paused with it) renews before its next write: taken over meanwhile by another
    writer, it refuses and writes nothing (it wrote its episode into the buffer the new holder
    writes)."""
    monkeypatch.setenv(LEASE_SECONDS_ENV, "0.5")
    url, options = s3_location
    old = _open(url, storage_options=options)
    _store(old, 1)
    lease = old.storage._lease
    lease._stop.set()  # the heartbeat stops, as a paused process's does
    lease._thread.join()
    time.sleep(0.6)  # past the expiry
    taker = ObjectLease(old.storage.kv, url)  # another writer's lease (not this process's shared one)
    taker.acquire()  # takes the expired lease over
    try:
        with pytest.raises(BufferLockedError, match="taken over by pid"):
            _store(old, 2)
    finally:
        taker.release()
    old.close()
    with ReplayBuffer.from_folder(url, storage_options=options, read_only=True) as reader:
        assert reader.meta_data["uid"][reader.valid_episodes()].tolist() == [1]


# ---- maintenance beside a live writer in another process ---------------------------------------------


def _check_copy_is_whole(location: str) -> int:
    """Every episode of the buffer at ``location`` is one the churn child stored, whole."""
    with ReplayBuffer.from_folder(location, read_only=True) as copy:
        slots = copy.valid_episodes()
        uids = copy.meta_data["uid"][slots]
        lens = copy.episode_lens[slots]
        np.testing.assert_array_equal(lens, 1 + uids % copy.max_timesteps)
        for slot, uid, length in zip(slots, uids, lens):
            np.testing.assert_array_equal(copy.storage.read_rows("x", np.array([slot]), 0, 12)[0, length:], 0)
            np.testing.assert_array_equal(copy.storage.read_rows("x", np.array([slot]), 0, int(length)), uid)
        return len(slots)


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_maintenance_beside_a_live_writer_process_is_refused_or_safe(backend, tmp_path):
    from replaybuf.maintenance import convert, unlock, upgrade, verify

    location = str(tmp_path / "buffer")
    kwargs = {"max_episodes": 6, "max_timesteps": 12, "circular": True, **_kwargs(backend)}
    writer = _child("churn", location, kwargs)
    try:
        _ready(writer)
        with pytest.raises(BufferLockedError, match=f"pid {writer.pid} on host") as refused:
            verify(location, repair=True)
        assert "close that writer first" in str(refused.value)
        with pytest.raises(BufferLockedError, match=f"pid {writer.pid} on host"):
            unlock(location)
        assert upgrade(location)["upgraded"] is False  # the newest format: nothing to swap
        copies, deadline = 0, time.monotonic() + 1.0
        for attempt in range(1000):
            if time.monotonic() > deadline and copies:
                break
            found = verify(location, progress=False)
            assert found == [], f"a slot the writer replaced was reported: {found}"
            destination = str(tmp_path / f"copy-{attempt}")
            try:
                convert(location, destination, backend=backend, progress=False)
            except RuntimeError as error:  # the writer outran the copy: nothing published
                assert "faster than" in str(error)
                if os.path.exists(destination):  # refused before or after creating it: empty
                    assert ReplayBuffer.from_folder(destination, read_only=True).num_episodes == 0
                continue
            assert _check_copy_is_whole(destination) > 0
            copies += 1
        assert copies, "no copy of the live buffer succeeded"
    finally:
        writer.stdin.close()
        stored = int(writer.stdout.readline())
        writer.wait()
    assert stored > 6 and verify(location) == []  # circular: slots were replaced during the checks
    assert _check_copy_is_whole(location) == 6


def _two_objects_then_killed(location: str) -> None:
    """Child: an object closed with its episode unended, then another object sharing the lease
    is killed during its own episode."""
    first = _open(location)
    second = ReplayBuffer.from_folder(location)
    with pytest.raises(RuntimeError):
        with first.one_episode(uid=1):
            first.store(x=np.full(4, 1, np.float32))
            first.flush()
            raise RuntimeError("the episode is abandoned")
    first.store(x=np.full(4, 1, np.float32))  # an episode left unended: its step log stays
    first.close()
    second.store(x=np.full(4, 2, np.float32))
    second.store(x=np.full(4, 2, np.float32))
    second.flush()
    os._exit(0)  # killed: nothing more is written


def test_recovery_commits_only_the_last_episode_of_a_step_log_two_objects_wrote(tmp_path):
    import multiprocessing

    location = str(tmp_path / "buffer")
    child = multiprocessing.get_context("fork").Process(target=_two_objects_then_killed, args=(location,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    with ReplayBuffer.from_folder(location) as recovered:  # commits the killed writer's episode
        slots = recovered.valid_episodes()
        assert recovered.episode_lens[slots].tolist() == [2]
        np.testing.assert_array_equal(recovered.storage.read_rows("x", slots, 0, 2), 2)


def test_a_broken_holders_renewal_over_the_take_over_is_written_over(s3_location):
    """``break_lock`` while the holder is alive, on a store without a conditional replace (s3fs):
    a renewal of the holder that lands on the take-over's record in the same moment (it read its
    own record just before) is written over, and the holder sees the new token at its next
    renewal and stops."""
    url, options = s3_location
    options = {**options, "config_kwargs": {}}  # no obstore equivalent: s3fs
    old = _open(url, storage_options=options)
    holder = old.storage._lease
    record = old.storage.kv.get(LEASE_KEY)  # what the holder's renewal read, then writes back
    kv = make_storage(url, storage_options=options).kv  # a second handle on the same store
    assert not kv.replaces_conditionally
    set_once, clobbered = kv.set, []

    def set_then_renewed_over(key, data):
        set_once(key, data)
        if key == LEASE_KEY and not clobbered:
            clobbered.append(True)
            set_once(key, record)

    kv.set = set_then_renewed_over
    lease = ObjectLease(kv, url, seconds=60)
    lease.acquire(break_lock=True)
    try:
        assert clobbered and json.loads(kv.get(LEASE_KEY))["token"] == lease.token
        holder.renew()
        assert holder.lost is not None
    finally:
        lease.release()
        old.storage._lease = None  # lost: its close has no lease to give back
        old.close()


# ---- conditional replace (S3 through obstore): renewals and take-overs write over what they read ------


def _kv(url: str, options: dict):
    """A handle of its own on the store at ``url``, as another writer process has."""
    return make_storage(url, storage_options=options).kv


def _token(url: str, options: dict) -> str | None:
    raw = _kv(url, options).get(LEASE_KEY)
    return None if raw is None else json.loads(raw)["token"]


def test_replace_if_takes_the_current_version_only(s3_location):
    url, options = s3_location
    kv = _kv(url, options)
    assert kv.replaces_conditionally
    assert kv.get_versioned("k", 100) is None
    kv.set("k", b"one")
    first = kv.get_versioned("k", 100)
    assert first is not None and first.data == b"one"
    assert kv.replace_if("k", b"two", first.version)
    assert not kv.replace_if("k", b"three", first.version)  # stale: changed since read
    assert kv.get("k") == b"two"
    over = kv.get_versioned("k", 2)  # over the limit: left unread, yet replaceable
    assert over is not None and over.data is None and over.version != first.version
    assert kv.replace_if("k", b"four", over.version)
    assert kv.get("k") == b"four"
    current = kv.get_versioned("k", 100)
    assert current is not None
    kv.delete_many(["k"])
    assert not kv.replace_if("k", b"five", current.version)  # vanished
    assert kv.get("k") is None


@pytest.mark.parametrize("store", ["memory", "s3fs", "gcs"])
def test_stores_without_a_conditional_replace_say_so_and_refuse_it(store, request):
    if store == "memory":
        url, options = f"memory://replaybuf-lease/{uuid.uuid4().hex}", {}
    elif store == "s3fs":
        url, options = request.getfixturevalue("s3_location")
        options = {**options, "config_kwargs": {}}
    else:
        server = request.getfixturevalue("gcs_server")
        url, options = server.url(f"lease-{uuid.uuid4().hex[:8]}"), server.storage_options
    kv = _kv(url, options)
    assert not kv.replaces_conditionally
    with pytest.raises(StorageError, match="offers no conditional replace"):
        kv.get_versioned("k", 100)
    with pytest.raises(StorageError, match="offers no conditional replace"):
        kv.replace_if("k", b"x", {"e_tag": '"x"'})
    assert kv.get("k") is None


def test_a_second_writer_on_gcs_is_refused_while_the_first_holds_the_lease(gcs_server):
    """gcsfs creates the lease with ``ifGenerationMatch=0``; the test emulator ignored that
    condition (tests/_gcs_emulator.py now honours it, as GCS does), so a second writer's
    lease replaced the first's and no gs:// lease test could fail."""
    url, options = gcs_server.url(f"lease-{uuid.uuid4().hex[:8]}"), gcs_server.storage_options
    kv = _kv(url, options)
    assert kv.create("k", b"first") and not kv.create("k", b"second")
    assert kv.get("k") == b"first"
    kv.delete_many(["k"])
    writer = ReplayBuffer(url, 2, 3, fields=FIELDS, storage_options=options)
    assert not kv.create(LEASE_KEY, b"{}")  # what another process's open tries first
    assert json.loads(kv.get(LEASE_KEY))["pid"] == os.getpid()
    writer.close()


def test_a_renewal_racing_a_take_over_never_overwrites_it(s3_location):
    """``break_lock`` lands between the holder's renewal reading its record and writing it back:
    the renewal is refused, and the holder finds the new token and stops."""
    url, options = s3_location
    holder, breaker = ObjectLease(_kv(url, options), url, 60), ObjectLease(_kv(url, options), url, 60)
    holder.acquire()
    read = holder._read_versioned

    def read_then_taken_over():
        got = read()
        if breaker.token is None:
            breaker.acquire(break_lock=True)
        return got

    holder._read_versioned = read_then_taken_over
    try:
        holder.renew()
        assert breaker.token is not None and holder.lost is not None
        assert f"was taken over by pid {os.getpid()}" in holder.lost
        assert _token(url, options) == breaker.token
    finally:
        holder.release()  # not its record: left alone
        assert _token(url, options) == breaker.token
        breaker.release()
    assert _token(url, options) is None


def test_two_take_overs_of_one_expired_lease_exactly_one_wins(s3_location):
    """Both read the expired record before either writes: the second write is refused, and its
    writer finds the first's live lease and is refused as by any live holder."""
    url, options = s3_location
    dead = {"host": "gone", "pid": 1, "since": "2026-01-01T00:00:00+00:00", "expires": 0, "token": "dead"}
    _kv(url, options).set(LEASE_KEY, json.dumps(dead).encode())
    first, second = ObjectLease(_kv(url, options), url, 60), ObjectLease(_kv(url, options), url, 60)
    read = first._read_versioned

    def read_then_second_takes_over():
        got = read()
        if second.token is None:
            second.acquire()
        return got

    first._read_versioned = read_then_second_takes_over
    try:
        with pytest.raises(BufferLockedError, match="lease expires at") as caught:
            first.acquire()
        assert caught.value.holder is not None and caught.value.holder["token"] == second.token
        assert first.token is None and first._thread is None
        assert _token(url, options) == second.token
    finally:
        second.release()
    assert _token(url, options) is None


def test_a_take_over_on_a_server_ignoring_if_match_reads_back_and_yields(s3_location):
    """A server that ignores If-Match accepts both take-overs of one expired lease: the first,
    whose write the second overwrote, reads the record back and is refused instead of writing
    beside the second until its next renewal."""
    url, options = s3_location
    dead = {"host": "gone", "pid": 1, "since": "2026-01-01T00:00:00+00:00", "expires": 0, "token": "dead"}
    _kv(url, options).set(LEASE_KEY, json.dumps(dead).encode())
    first, second = ObjectLease(_kv(url, options), url, 60), ObjectLease(_kv(url, options), url, 60)

    def ignoring_if_match(key, data, version):  # as such a server answers: written, whatever changed
        first.kv.set(key, data)
        second.token = "second"
        first.kv.set(key, json.dumps({**dead, "expires": time.time() + 60, "token": "second"}).encode())
        return True

    first.kv.replace_if = ignoring_if_match
    with pytest.raises(BufferLockedError, match="at the same time") as caught:
        first.acquire()
    assert caught.value.holder is not None and caught.value.holder["token"] == "second"
    assert first.token is None and first._thread is None
    assert _token(url, options) == "second"


def test_a_renewal_between_a_break_lock_reading_and_writing_makes_it_read_again(s3_location):
    """The holder renews between ``break_lock`` reading its record and writing: the take-over's
    write is refused, it reads the renewed record, breaks that, and the holder stops."""
    url, options = s3_location
    holder, breaker = ObjectLease(_kv(url, options), url, 60), ObjectLease(_kv(url, options), url, 60)
    holder.acquire()
    read, renewed = breaker._read_versioned, []

    def read_then_renewed():
        got = read()
        if not renewed:
            holder.renew()
            renewed.append(True)
        return got

    breaker._read_versioned = read_then_renewed
    try:
        breaker.acquire(break_lock=True)
        assert renewed and holder.lost is None and _token(url, options) == breaker.token
        holder.renew()
        assert holder.lost is not None and _token(url, options) == breaker.token
    finally:
        holder.release()
        breaker.release()
    assert _token(url, options) is None


def test_a_take_over_refused_at_every_try_gives_up_locked(s3_location):
    """The record changes before each of the take-over's writes (here: every write refused):
    after ``TAKE_OVER_TRIES`` it is refused, holding nothing and leaving the record as it was."""
    url, options = s3_location
    dead = {"host": "gone", "pid": 1, "since": "2026-01-01T00:00:00+00:00", "expires": 0, "token": "dead"}
    _kv(url, options).set(LEASE_KEY, json.dumps(dead).encode())
    lease, tries = ObjectLease(_kv(url, options), url, 60), []
    lease.kv.replace_if = lambda key, data, version: tries.append(key) and False
    with pytest.raises(BufferLockedError, match="took the expired lease at the same time") as caught:
        lease.acquire()
    assert len(tries) == TAKE_OVER_TRIES and caught.value.holder == dead
    assert lease.token is None and lease._thread is None and _token(url, options) == "dead"


@pytest.mark.parametrize("how", ["renew", "take_over"])
def test_a_conditional_write_that_landed_though_refused_is_recognised_as_ours(s3_location, how):
    """A PUT whose answer was lost lands, and the client's retry of it is refused: the lease
    reads its own token back and goes on, renewed or taken."""
    url, options = s3_location
    if how == "take_over":
        dead = {"host": "gone", "pid": 1, "since": "2026-01-01T00:00:00+00:00", "expires": 0, "token": "dead"}
        _kv(url, options).set(LEASE_KEY, json.dumps(dead).encode())
    lease = ObjectLease(_kv(url, options), url, 60)
    replace_if, landed = lease.kv.replace_if, []

    def landed_but_refused(key, data, version):
        assert replace_if(key, data, version)
        landed.append(json.loads(data)["expires"])
        return False

    lease.kv.replace_if = landed_but_refused
    try:
        if how == "renew":
            lease.acquire()
            lease.renew()
        else:
            lease.acquire()
        assert len(landed) == 1 and json.loads(lease.kv.get(LEASE_KEY))["expires"] == landed[0]
        assert lease.lost is None and _token(url, options) == lease.token
    finally:
        lease.release()
    assert _token(url, options) is None
