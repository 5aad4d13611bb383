"""The read cache (``cache='disk'``) against hostile and damaged cache folders: symlinked
folders and files, odd lock entries, damaged and absurd files, an unusable ``cache_dir``, a
folder deleted under a reader. Each read returns the store's rows; nothing outside the cache's
own files is created, changed or deleted."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaybuf import ReplayBuffer
from replaybuf.storage import _cache
from replaybuf.storage._cache import CHECK_BYTES, CachedStorage
from replaybuf.storage._codecs import crc32c
from tests._data import SAMPLING_LENGTHS as LENGTHS
from tests._data import fill_sampling_buffer as fill
from tests.test_cache import OPTIONS, create_at, folder_name, read_cached, run_python

#: the episode whose cache files the tests damage (slot 1 of ``written``: generation 2, 4 steps)
SLOT, GENERATION = 1, 2
NAME = f"{SLOT}-{GENERATION}.rows"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hostile") / "buffer"
    buffer = ReplayBuffer(folder, **OPTIONS)
    buffer._commit.revision = 0  # stamped by none, as by an earlier replaybuf: each file is NAMEd slot-generation
    fill(buffer)
    buffer.close()
    return str(folder)


@pytest.fixture(scope="module")
def expected(written) -> dict[str, torch.Tensor]:
    return ReplayBuffer.from_folder(written, read_only=True).get_all_data()


def reader(written: str, cache_dir, **kwargs) -> ReplayBuffer:
    return ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache_dir, **kwargs)


def assert_reads_right(buffer: ReplayBuffer, expected: dict[str, torch.Tensor]) -> None:
    """Every field's rows, read twice (a fill, then the maps), and a sampled batch, are the store's."""
    for _ in range(2):
        got = buffer.get_all_data()
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
        buffer.storage.drop_caches()
    batch = next(iter(buffer.dataloader(batch_size=16, timestep_level=True, return_indices=True)))
    episodes, steps = batch["_indices"].T
    for key in ("ident", "image"):
        assert torch.equal(batch[key], expected[key][episodes, steps]), key


def snapshot(folder) -> dict[str, tuple]:
    """Relative path -> (kind, bytes or link target, mtime) of everything under ``folder`` (links not followed)."""
    out = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(parent, name)
            st_ = os.lstat(path)
            if os.path.islink(path):
                content = os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    content = f.read()
            else:
                content = None
            out[os.path.relpath(path, folder)] = (st_.st_mode, content, st_.st_mtime_ns)
    return out


def checked_file(rows: bytes, served_as: str) -> bytes:
    """A cache file's bytes: ``rows`` then the crc32c of ``served_as`` (its name in the cache
    folder) and the rows, valid where it would be served."""
    check = crc32c(np.frombuffer(rows, np.uint8), crc32c(served_as.encode()))
    return rows + check.to_bytes(CHECK_BYTES, "little")


def served_name(storage: CachedStorage) -> str:
    """The name in the cache folder of the file of ``SLOT``'s image rows."""
    return os.path.join(os.path.basename(storage.root), "image", NAME)


def user_file_folder(tmp_path) -> Path:
    """A user's folder holding one file, ``file``: what a hostile link points at."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "file").write_bytes(b"user data")
    return user


def user_folder(tmp_path, step_nbytes: int, served_as: str) -> str:
    """A user's folder of files named like cache files (valid checksums over wrong rows, old temp
    files, files of the old layout), flat and under ``image/``."""
    user = tmp_path / "user"
    for sub in (user, user / "image"):
        sub.mkdir(parents=True)
        (sub / NAME).write_bytes(checked_file(b"\xab" * (LENGTHS[SLOT] * step_nbytes), served_as))
        (sub / "0-1.raw").write_bytes(b"user data")
        (sub / ".tmp-1-2-3-4").write_bytes(b"user data")
        os.utime(sub / ".tmp-1-2-3-4", (1, 1))
        (sub / "image-1").write_bytes(b"user data")  # named like a lock file
    return str(user)


@pytest.mark.parametrize("linked", ["identity", "field", ".locks"])
def test_a_symlinked_cache_folder_is_never_used(written, expected, tmp_path, linked):
    probe = reader(written, tmp_path / "cache", cache_size=1)  # cache_size=1: every fill evicts
    user = user_folder(tmp_path, probe.schema.fields["image"].step_nbytes, served_name(probe.storage))
    before = snapshot(user)
    root = probe.storage.root
    os.makedirs(root if linked != "identity" else os.path.dirname(root), exist_ok=True)
    link = root if linked == "identity" else os.path.join(root, linked if linked == ".locks" else "image")
    os.symlink(user, link)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_reads_right(probe, expected)
        probe.warm_cache(progress=False)
    assert snapshot(user) == before
    assert os.path.islink(link)
    unusable = [w for w in caught if "read cache" in str(w.message)]
    assert len(unusable) == 1 and link in str(unusable[0].message) and "symlink" in str(unusable[0].message)


@pytest.mark.parametrize("target", ["valid file", "short file", "missing file", "fifo", "fifo in place"])
def test_a_cache_file_replaced_by_a_symlink_is_never_served_or_written(written, expected, tmp_path, target):
    cache = tmp_path / "cache"
    first = reader(written, cache)
    first.warm_cache(progress=False)
    path = os.path.join(first.storage.root, "image", NAME)
    user = tmp_path / "user"
    user.mkdir()
    pointed = user / "file"
    if target == "valid file":  # the right size and a valid checksum, over rows that are not the episode's
        pointed.write_bytes(checked_file(bytes(os.path.getsize(path) - CHECK_BYTES), served_name(first.storage)))
    elif target == "short file":
        pointed.write_bytes(b"user data")
    elif target == "fifo":
        os.mkfifo(pointed)
    os.unlink(path)
    if target == "fifo in place":  # no symlink: the cache file itself is a FIFO
        os.mkfifo(path)
    else:
        os.symlink(pointed, path)
    before = snapshot(user)
    with no_hang(pointed if target == "fifo" else path if target == "fifo in place" else None):
        assert_reads_right(reader(written, cache), expected)
    assert snapshot(user) == before
    assert os.path.isfile(path) and not os.path.islink(path)  # refilled in its place


def test_a_symlink_at_a_fillers_temp_name_is_never_written_through(written, expected, tmp_path):
    probe = reader(written, tmp_path / "cache")
    folder = os.path.join(probe.storage.root, "image")
    os.makedirs(folder)
    user = user_file_folder(tmp_path)
    before = snapshot(user)
    # the temp name a fill of this thread uses (pid and thread id are easy to guess)
    os.symlink(user / "file", os.path.join(folder, f".tmp-{SLOT}-{GENERATION}-{os.getpid()}-{threading.get_ident()}"))
    assert_reads_right(probe, expected)
    assert snapshot(user) == before
    assert os.path.isfile(os.path.join(folder, NAME))


class no_hang:
    """Fail, rather than hang, when a read blocks on opening the FIFO ``fifo``: after a while a
    watchdog opens it for writing (freeing the reader) and the test fails."""

    def __init__(self, fifo):
        self.fifo, self.done, self.hung = fifo, threading.Event(), False

    def watch(self) -> None:
        while not self.done.wait(60):
            try:
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader: nothing blocked on it
                continue
            self.hung = True

    def __enter__(self) -> no_hang:
        if self.fifo is not None:
            self.thread = threading.Thread(target=self.watch, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.fifo is not None:
            self.thread.join()
        assert not self.hung, f"a read blocked on the FIFO {self.fifo}"


@pytest.mark.parametrize("entry", ["fifo", "directory", "symlink", "dangling symlink"])
def test_an_odd_lock_entry_never_hangs_or_fails_a_read(written, expected, tmp_path, entry):
    probe = reader(written, tmp_path / "cache")
    locks = os.path.join(probe.storage.root, ".locks")
    os.makedirs(locks)
    user = user_file_folder(tmp_path)
    before = snapshot(user)
    for name in [*probe.schema.fields, _cache.USAGE_FILE]:  # the fill locks and the byte count
        lock = os.path.join(locks, name if name == _cache.USAGE_FILE else f"{name}-{SLOT}")
        if entry == "fifo":
            os.mkfifo(lock)
        elif entry == "directory":
            os.mkdir(lock)
            open(os.path.join(lock, "inside"), "wb").close()
        else:
            os.symlink(user / ("file" if entry == "symlink" else f"absent-{name}"), lock)
    with no_hang(None):
        assert_reads_right(probe, expected)
    assert snapshot(user) == before
    assert os.path.isfile(os.path.join(probe.storage.root, "image", NAME))  # still cached


def test_a_fill_lock_held_forever_delays_a_read_but_never_hangs_it(written, expected, tmp_path, monkeypatch):
    """Another process's filler stuck with the episode's locks held: the reader waits
    ``FILL_WAIT_S`` for it, then reads the episode from the store, uncached."""
    monkeypatch.setattr(_cache, "FILL_WAIT_S", 0.2)
    probe = reader(written, tmp_path / "cache")
    locks = os.path.join(probe.storage.root, ".locks")
    os.makedirs(locks)
    held = []
    for name in probe.schema.fields:  # flock conflicts between open files, in one process too
        fd = os.open(os.path.join(locks, f"{name}-{SLOT}"), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
    try:
        done = threading.Event()

        def read() -> None:
            assert_reads_right(probe, expected)
            done.set()

        worker = threading.Thread(target=read, daemon=True)
        worker.start()
        worker.join(120)
        assert done.is_set(), "the read hung on a fill lock held by another filler"
        assert not os.path.exists(os.path.join(probe.storage.root, "image", NAME))  # read uncached
    finally:
        for fd in held:
            os.close(fd)
    assert_reads_right(probe, expected)  # the locks free: the episode is cached again
    assert os.path.isfile(os.path.join(probe.storage.root, "image", NAME))


def test_a_byte_count_lock_held_forever_never_hangs_a_fill(written, expected, tmp_path, monkeypatch):
    """Another process stopped holding the lock of the folder's byte count (``USAGE_FILE``): a
    filler waits ``USAGE_WAIT_S`` for it, then counts its own writes; its episodes are cached."""
    monkeypatch.setattr(_cache, "USAGE_WAIT_S", 0.1)
    probe = reader(written, tmp_path / "cache")
    locks = os.path.join(probe.storage.root, ".locks")
    os.makedirs(locks)
    fd = os.open(os.path.join(locks, _cache.USAGE_FILE), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # conflicts with the reader's own open file, in one process too
    try:
        assert_reads_right(probe, expected)
        assert os.path.isfile(os.path.join(probe.storage.root, "image", NAME))
    finally:
        os.close(fd)


def damage_cases() -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 1 << 30), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(0, 1 << 30), st.just(0)),
        st.tuples(st.just("extend"), st.integers(1, 400), st.integers(0, 255)),
    )


@pytest.fixture(scope="module")
def warm(written, tmp_path_factory) -> tuple[str, bytes]:
    """(cache_dir, the whole bytes of ``image/NAME``) of a cache filled once."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    filled = reader(written, cache)
    filled.warm_cache(progress=False)
    with open(os.path.join(filled.storage.root, "image", NAME), "rb") as f:
        return str(cache), f.read()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=damage_cases())
def test_a_damaged_cache_file_is_never_served(written, expected, warm, case):
    cache, whole = warm
    kind, where, value = case
    data = bytearray(whole)
    if kind == "flip":  # one byte of the rows or of the checksum
        data[where % len(data)] ^= value
    elif kind == "cut":
        del data[where % len(data) :]
    else:
        data += bytes([value]) * where
    fresh = reader(written, cache)  # a new reader checks each file it maps
    path = os.path.join(fresh.storage.root, "image", NAME)
    with open(path, "wb") as f:
        f.write(data)
    rows = fresh.storage.read_rows("image", np.array([SLOT]), 0, LENGTHS[SLOT])
    np.testing.assert_array_equal(rows[0], expected["image"][SLOT, : LENGTHS[SLOT]].numpy())
    with open(path, "rb") as f:
        assert f.read() == whole  # refetched and published again


def test_another_episode_s_cache_file_moved_into_place_is_never_served(written, expected, warm):
    """Before: the check covered the rows only, so slot 2's file (whole, its checksum valid)
    renamed to slot 1's name was served as slot 1's rows."""
    cache, whole = warm
    fresh = reader(written, cache)
    folder = os.path.join(fresh.storage.root, "image")
    others = sorted(name for name in os.listdir(folder) if name.endswith(".rows") and name != NAME)
    assert others
    for other in others:
        shutil.copyfile(os.path.join(folder, other), os.path.join(folder, NAME))
        fresh = reader(written, cache)  # a new reader checks each file it maps
        rows = fresh.storage.read_rows("image", np.array([SLOT]), 0, LENGTHS[SLOT])
        np.testing.assert_array_equal(rows[0], expected["image"][SLOT, : LENGTHS[SLOT]].numpy(), err_msg=other)
        with open(os.path.join(folder, NAME), "rb") as f:
            assert f.read() == whole  # refetched and published again


def test_an_absurdly_large_cache_file_is_never_read(written, expected, tmp_path):
    cache = tmp_path / "cache"
    first = reader(written, cache)
    first.warm_cache(progress=False)
    path = os.path.join(first.storage.root, "image", NAME)
    step = first.schema.fields["image"].step_nbytes
    with open(path, "r+b") as f:  # sparse: whole steps and a checksum, about 1 TB
        f.truncate(((1 << 40) // step) * step + CHECK_BYTES)
    assert_reads_right(reader(written, cache), expected)
    assert os.path.getsize(path) == LENGTHS[SLOT] * step + CHECK_BYTES


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_dir_that_is_a_file_leaves_reads_uncached(written, expected, tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"user data")
    cache = blocker if where == "a file" else blocker / "cache"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_reads_right(reader(written, cache), expected)
    assert blocker.read_bytes() == b"user data"
    unusable = [w for w in caught if "read cache" in str(w.message)]
    assert len(unusable) == 1 and "cannot be used" in str(unusable[0].message)
    # named as such ("[Errno 17] File exists" said nothing of cache_dir), with the folder given
    assert f"cache_dir is a file or lies under one, not a folder: {str(cache)!r}" in str(unusable[0].message)


def test_an_unwritable_cache_dir_leaves_reads_uncached(written, expected, tmp_path, monkeypatch):
    # permission bits do not stop root (CI): the folder's writes are refused here instead
    cache = str(tmp_path / "cache")
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(call):
        def refused(path, *args, **kwargs):
            if os.fspath(path).startswith(cache):
                raise PermissionError(13, "Permission denied", path)
            return call(path, *args, **kwargs)

        return refused

    monkeypatch.setattr(os, "open", refuse(real_open))
    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_reads_right(reader(written, cache), expected)
    assert not os.path.exists(cache)
    unusable = [w for w in caught if "read cache" in str(w.message)]
    assert len(unusable) == 1 and "Permission denied" in str(unusable[0].message)


def test_a_cache_folder_deleted_in_a_loop_never_fails_a_read(written, expected, tmp_path, monkeypatch):
    monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", 0)  # every read maps its files
    cache = tmp_path / "cache"
    buffer = reader(written, cache)
    root = buffer.storage.root
    child = run_python(
        f"""
        import shutil, sys
        print("started", flush=True)
        for _ in range(3000):
            shutil.rmtree({root!r}, ignore_errors=True)
        """,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().startswith("started")
    storage, rounds = buffer.storage, 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a folder deleted meanwhile is no reason to warn
        while child.poll() is None and rounds < 500:
            got = buffer.get_all_data()
            for key in expected:
                assert torch.equal(got[key], expected[key]), key
            storage.drop_caches()
            rounds += 1
    assert child.wait(timeout=120) == 0
    shutil.rmtree(cache, ignore_errors=True)
    assert isinstance(storage, CachedStorage) and rounds > 0


def test_a_relative_cache_dir_stays_where_it_was_when_the_process_changes_directory(
    written, expected, tmp_path, monkeypatch
):
    # resolved at open: a chdir later (a training script's, a library's) never starts a second
    # cache under the new working directory, and the buffer keeps its one folder
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    relative = os.path.relpath(written, start)
    opened = reader(relative, "cache")
    monkeypatch.chdir(elsewhere)  # before its first read
    assert_reads_right(opened, expected)
    opened.warm_cache(progress=False)
    assert os.listdir(elsewhere) == []
    assert os.listdir(start / "cache") == [os.path.basename(reader(written, start / "cache").storage.root)]


@pytest.mark.parametrize("inside", ["", "data", os.path.join("data", "image")])
def test_a_cache_dir_in_the_buffer_s_own_folder_is_never_written(written, expected, inside):
    # a reader writes nothing in the buffer's folder: its writer would find the cache's files
    # there as entries not its own (overwrite=True refused them as the user's)
    before = snapshot(written)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_reads_right(reader(written, os.path.join(written, inside)), expected)
    assert snapshot(written) == before
    unusable = [w for w in caught if "read cache" in str(w.message)]
    assert len(unusable) == 1 and "in the folder of the buffer" in str(unusable[0].message)


def test_removing_a_replaced_buffer_s_folder_never_reaches_past_the_cache_s_own_files(tmp_path, monkeypatch):
    """The folder of a buffer replaced at its location is removed file by file, only the
    cache's own (rows, temp, lock files): a symlinked folder in ``cache_dir`` recording the same
    location (a user's folder of files named like cache files behind it) is never followed,
    and a user's file or a symlink named like a cache file in the replaced folder is left, with
    the folder and its owner record, for a later sweep to finish once they are gone."""
    cache, location = tmp_path / "cache", tmp_path / "buffer"
    create_at(location)
    replaced = Path(read_cached(location, cache).storage.root)
    user = Path(user_folder(tmp_path, 1, "x"))
    (user / ".locks").mkdir()
    record = json.loads((replaced / ".locks" / _cache.OWNER_FILE).read_text())
    (user / ".locks" / _cache.OWNER_FILE).write_text(json.dumps({**record, "folder": "linked"}))
    os.symlink(user, cache / "linked")
    (replaced / "state" / "notes.txt").write_text("mine")
    os.symlink(user / NAME, replaced / "image" / NAME)
    before = snapshot(user)
    create_at(location)
    new = folder_name(read_cached(location, cache))
    assert snapshot(user) == before and os.readlink(cache / "linked") == str(user)
    assert sorted(os.listdir(cache)) == sorted([new, "linked", replaced.name])
    assert os.listdir(replaced / "state") == ["notes.txt"] and os.listdir(replaced / "image") == [NAME]
    assert (replaced / "image" / NAME).is_symlink() and (replaced / ".locks" / _cache.OWNER_FILE).is_file()
    os.unlink(replaced / "state" / "notes.txt")
    os.unlink(replaced / "image" / NAME)
    monkeypatch.setattr(_cache, "_SWEPT", set())  # as in the next process
    read_cached(location, cache)
    assert sorted(os.listdir(cache)) == sorted([new, "linked"]) and snapshot(user) == before
