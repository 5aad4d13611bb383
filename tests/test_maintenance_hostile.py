"""The maintenance commands (``info``, ``verify``, ``verify --repair``, ``upgrade``, ``convert``,
``unlock``) against damaged buffers, bad arguments and other processes, as a user or an attacker
would run them: a message and an exit status, never a traceback, and nothing committed lost."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from replaybuf import BufferLockedError
from replaybuf.cli import main

from .test_maintenance import filled

pytest_plugins = ["tests._servers"]  # fixtures: s3_server


def run_cli(argv) -> int:
    return main([str(a) for a in argv])


@pytest.mark.parametrize(
    ("backend", "name"),
    [("memmap", "reward.data.npy"), ("memmap", "replaybuf/checksums.npy"), ("hdf5", "replaybuf/checksums.npy")],
)
@pytest.mark.parametrize("command", ["info", "verify"])
def test_a_npy_header_whose_quote_became_a_comment_is_damage_not_a_traceback(tmp_path, capsys, backend, name, command):
    # "{'descr': ..." with its quote flipped to '#' comments out the rest of the header: numpy's
    # parse raises tokenize.TokenError, which is neither ValueError nor SyntaxError
    filled(tmp_path / "b", backend)
    path = tmp_path / "b" / name
    header = bytearray(path.read_bytes())
    assert header[20:21] == b"'"
    header[20] = ord("#")
    path.write_bytes(bytes(header))
    assert run_cli([command, tmp_path / "b"]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "not a readable" in err


def _upgrade_killed_deleting_the_original(path: str) -> None:
    """Child: upgrade ``path``, SIGKILLed once the copy is swapped in, as it starts deleting
    the original (any folder of the upgrade beside ``path``)."""
    import os
    import shutil
    import signal
    import types

    import replaybuf.maintenance as maintenance

    name = os.path.basename(path)

    def rmtree(target, *args, **kwargs):
        if f"/.{name}." in str(target):
            os.kill(os.getpid(), signal.SIGKILL)
        shutil.rmtree(target, *args, **kwargs)

    maintenance.shutil = types.SimpleNamespace(rmtree=rmtree)
    maintenance.upgrade(path, progress=False)


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_an_upgrade_killed_deleting_the_original_leaves_a_leftover_that_info_names_and_upgrade_removes(
    tmp_path, capsys, backend
):
    import multiprocessing
    import os
    import shutil
    import signal

    from replaybuf import ReplayBuffer
    from replaybuf.maintenance import upgrade

    from .test_format_fixtures import DATA, NEWEST, _check_contents, _stored_version

    path = tmp_path / "buf"
    shutil.copytree(os.path.join(DATA, "format-v1", backend), path)
    child = multiprocessing.get_context("fork").Process(target=_upgrade_killed_deleting_the_original, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert _stored_version(path, backend) == NEWEST[backend]  # swapped in before the kill
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))
    (left,) = [entry for entry in os.listdir(tmp_path) if entry != "buf"]
    # not a hidden copy of the original that nothing reports
    assert run_cli(["info", path]) == 0
    assert f"leftover   {tmp_path / left}: the copy of a killed upgrade" in capsys.readouterr().out
    done = upgrade(path, progress=False)
    assert not done["upgraded"] and done["removed"] == [str(tmp_path / left)]
    assert os.listdir(tmp_path) == ["buf"]
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


def _upgrade_killed_after_its_swap(path: str) -> None:
    """Child: upgrade ``path``, SIGKILLed once the copy is swapped in, before the original moved
    aside is marked for deletion."""
    import os
    import signal

    import replaybuf.maintenance as maintenance

    maintenance._discard_original = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    maintenance.upgrade(path, progress=False)


def _fork_upgrade(path: str, child) -> int:
    """The exit status of ``child(path)`` run in a forked process (SIGKILLed: minus SIGKILL)."""
    import multiprocessing

    process = multiprocessing.get_context("fork").Process(target=child, args=(path,))
    process.start()
    process.join(60)
    return process.exitcode


def test_an_upgrade_killed_after_its_swap_leaves_an_original_that_info_names(tmp_path, capsys):
    """Before: a kill there left the full-size original as ``.buf.format5-<pid>``, which nothing
    reported (not an upgrade's marked copy), though an upgrade promises no hidden copy."""
    import signal

    from replaybuf import ReplayBuffer

    from ._data import released_copy
    from .test_format_fixtures import NEWEST, _check_contents, _stored_version

    path = Path(released_copy("format-v5", "zarr", tmp_path))
    assert _fork_upgrade(str(path), _upgrade_killed_after_its_swap) == -signal.SIGKILL
    assert _stored_version(path, "zarr") == NEWEST["zarr"]
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))
    (left,) = [tmp_path / entry for entry in os.listdir(tmp_path) if entry != path.name]
    assert _stored_version(left, "zarr") == 5
    assert run_cli(["info", path]) == 0
    assert f"leftover   {left}: " in capsys.readouterr().out


# the file operations an upgrade's child counts (audit events), besides opens for writing
_WRITES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"}


def _upgrade_killed_at(path: str, copying: int, swapping: int) -> None:
    """Child: upgrade ``path``, SIGKILLed before its ``copying``-th file operation (or write
    open), or before the ``swapping``-th after the one removing its copy's marker (0: that
    one; the swap follows it); -1: not counted."""
    import signal
    import sys

    import replaybuf.maintenance as maintenance

    count = {"all": 0, "swap": -1}

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            mode, flags = args[1], args[2]
            if not (any(c in str(mode) for c in "wax+") if mode is not None else flags & (os.O_WRONLY | os.O_RDWR)):
                return
        elif event not in _WRITES:
            return
        count["all"] += 1
        if count["swap"] >= 0:
            count["swap"] += 1
        elif event == "os.remove" and str(args[0]).endswith("upgrading.json"):
            count["swap"] = 0
        if count["all"] == copying or count["swap"] == swapping:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    maintenance.upgrade(path, progress=False)


@pytest.mark.parametrize(("copying", "swapping"), [(25, -1), (-1, 0), (-1, 1), (-1, 2), (-1, 4)])
def test_an_upgrade_killed_at_any_step_leaves_the_old_or_the_new_buffer_and_the_next_one_finishes(
    tmp_path, copying, swapping
):
    """SIGKILLed during the copy, or before one of the file operations around the swap: the
    folder holds the intact old buffer or the intact new one, never neither (killed between the
    two renames of the swap, the upgrade left no folder at all), and the next upgrade finishes."""
    import multiprocessing
    import signal

    from replaybuf import ReplayBuffer
    from replaybuf.maintenance import upgrade, verify

    from ._data import released_copy
    from .test_format_fixtures import NEWEST, _check_contents, _stored_version

    path = Path(released_copy("format-v5", "zarr", tmp_path))
    child = multiprocessing.get_context("fork").Process(target=_upgrade_killed_at, args=(str(path), copying, swapping))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert _stored_version(path, "zarr") in (5, NEWEST["zarr"])
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))
    upgrade(path, progress=False)
    assert _stored_version(path, "zarr") == NEWEST["zarr"] and verify(path) == []
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


def test_unlock_takes_an_object_store_lease_at_once_and_its_live_writer_stops(s3_server, capsys):
    """``replaybuf unlock`` is for the impatient (issue 12): it removes a lease that has not
    expired, says that a writer still running stops writing, and that writer then refuses."""
    import json
    import time

    from replaybuf import ReplayBuffer
    from replaybuf.storage.lease import LEASE_KEY

    url, options = s3_server.url("unlock-live"), s3_server.storage_options
    writer = ReplayBuffer(url, 4, 3, fields={"x": "float"}, storage_options=options)
    writer.store_episode(x=[1.0, 2.0])
    flags = ["--storage-options", json.dumps(options)]
    record = writer.storage.kv.get(LEASE_KEY)
    writer.store_episode(x=[3.0])
    assert run_cli(["unlock", url, *flags]) == 0
    said = capsys.readouterr().out
    assert f"removed the writer lease of pid {os.getpid()}" in said and "if that writer is still running" in said
    assert writer.storage.kv.get(LEASE_KEY) is None
    writer.storage._lease.renew()  # its next renewal: the writer learns it lost the lease
    assert writer.storage._lease.lost is not None
    with pytest.raises(BufferLockedError, match="was taken over"):
        writer.store_episode(x=[4.0])
    with contextlib.suppress(BufferLockedError):  # its counters may be pending: not written either
        writer.close()
    # an expired lease (a writer killed a minute ago) goes as well
    expired = {**json.loads(record), "expires": time.time() - 1}
    writer.storage.kv.set(LEASE_KEY, json.dumps(expired).encode())
    assert run_cli(["unlock", url, *flags]) == 0
    assert writer.storage.kv.get(LEASE_KEY) is None
    with ReplayBuffer.from_folder(url, read_only=True, storage_options=options) as reader:
        assert reader.episode_lens[reader.valid_episodes()].tolist() == [2, 1]


@pytest.mark.parametrize("command", ["info", "verify", "upgrade", "convert"])
def test_a_buffer_an_upgrade_left_between_its_renames_is_pointed_to_by_every_command(tmp_path, capsys, command):
    # what a kill between the two renames leaves: the original beside the missing folder
    filled(tmp_path / ".buf.format1-999999999", "zarr")
    argv = [command, tmp_path / "buf"] + ([tmp_path / "copy"] if command == "convert" else [])
    with pytest.raises(SystemExit) as usage:
        run_cli(argv)
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert f"left the original at '{tmp_path / '.buf.format1-999999999'}': rename it back" in err
    assert sorted(os.listdir(tmp_path)) == [".buf.format1-999999999"]  # nothing made or moved


def test_a_lease_released_after_its_folder_moved_leaves_the_new_folders_writer_locked(tmp_path):
    # upgrade holds the original's lease across its swap and gives it back after: by then its
    # path names the upgraded folder, where a writer may have opened meanwhile
    from replaybuf import ReplayBuffer
    from replaybuf.storage import make_storage
    from replaybuf.storage.lease import BufferLockedError, FileLease

    folder = tmp_path / "buf"
    filled(folder, "memmap")
    lease = FileLease(str(folder))
    lease.acquire()
    os.rename(folder, tmp_path / "backup")
    filled(tmp_path / "copy", "memmap")
    os.rename(tmp_path / "copy", folder)
    writer = ReplayBuffer.from_folder(folder)  # opened in between
    lease.release()
    assert (folder / "replaybuf" / "writer.lock").exists()
    with pytest.raises(BufferLockedError):  # a second writer is still refused
        make_storage(str(folder)).writer_lease().acquire()
    writer.close()


def test_a_convert_refused_by_a_writer_that_took_its_new_destination_deletes_nothing_of_it(tmp_path, monkeypatch):
    # two processes aiming at one new folder: the other one creates its buffer there after this
    # convert found the folder missing, and holds it; the refused convert must not erase it
    import subprocess
    import sys

    import replaybuf.maintenance as maintenance
    from replaybuf import ReplayBuffer
    from replaybuf.storage.lease import BufferLockedError

    filled(tmp_path / "src", "zarr")
    dst = tmp_path / "dst"
    script = (
        "import sys\nfrom replaybuf import ReplayBuffer\n"
        f"b = ReplayBuffer({str(dst)!r}, 4, 3, fields={{'x': 'float'}})\n"
        "b.store_episode(x=[1.0, 2.0])\nb.flush()\nprint('ready', flush=True)\nsys.stdin.read()\nb.close()\n"
    )
    other: list[subprocess.Popen] = []
    found_missing = maintenance._new_local_folders

    def then_taken(location):
        made = found_missing(location)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's replaybuf
        process = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": root},
        )
        other.append(process)
        assert process.stdout.readline().strip() == "ready"
        return made

    monkeypatch.setattr(maintenance, "_new_local_folders", then_taken)
    try:
        with pytest.raises(BufferLockedError, match="it is being written by pid") as refused:
            maintenance.convert(tmp_path / "src", dst, progress=False)
        assert f"pid {other[0].pid} " in str(refused.value)
    finally:
        for process in other:
            process.stdin.close()
            assert process.wait(60) == 0  # it kept writing, and closed its buffer
    with ReplayBuffer.from_folder(dst, read_only=True) as kept:
        assert kept.episode_lens[kept.valid_episodes()].tolist() == [2]


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_a_convert_cut_short_removes_the_parent_folders_it_made_and_no_others(tmp_path, monkeypatch, backend):
    # convert made the destination's missing parents and left them behind, empty, when the
    # copy failed; a folder that was there before (with the user's file) is kept as it was
    import replaybuf.maintenance as maintenance

    filled(tmp_path / "src", "zarr")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(maintenance, "_copy_episodes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        maintenance.convert(tmp_path / "src", tmp_path / "mine" / "new" / "deeper" / "dst", backend, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["mine", "src"]
    assert sorted(os.listdir(tmp_path / "mine")) == ["notes.txt"]


def _flip(path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_a_flipped_crc_bit_of_a_zarr_packed_checksum_entry_is_resealed_not_the_episode_dropped(tmp_path):
    # local zarr packs small fields and keeps an untagged 1 << 32 | crc32c entry per (episode,
    # field) in replaybuf/checksums: a bit flipped in the crc read as damaged data, and repair
    # dropped the sound episode
    import numpy as np

    from replaybuf import ChecksumEntryError, CorruptChunkError, ReplayBuffer
    from replaybuf.maintenance import verify

    folder = tmp_path / "b"
    filled(folder, "zarr")
    with ReplayBuffer.from_folder(folder, read_only=True) as before:
        packed = before.storage._packed
        assert packed == ["state", "action", "reward"]
        rows = {s: before.storage.read_rows("state", np.array([s]), 0, 12).copy() for s in before.valid_episodes()}
    _flip(folder / "replaybuf" / "checksums", 8 * (1 * len(packed) + 0) + 2, 0x10)  # slot 1, state
    with ReplayBuffer.from_folder(folder, read_only=True) as reader, pytest.raises(ChecksumEntryError) as caught:
        reader.storage.read_rows("state", np.array([1]), 0, int(reader.episode_lens[1]))
    assert caught.value.data_verified and "replaybuf/checksums" in str(caught.value)
    found = verify(folder, repair=True, progress=False)
    assert any("slot 1: its checksum entry" in line and "one bit away" in line for line in found)
    assert any(
        line.startswith("repaired: re-sealed the damaged checksum entries of data/state in slots [1]") for line in found
    )
    assert not any("dropped" in line for line in found)
    assert verify(folder, progress=False) == []
    with ReplayBuffer.from_folder(folder, read_only=True) as after:
        assert sorted(after.valid_episodes().tolist()) == sorted(rows)
        for slot, stored in rows.items():
            np.testing.assert_array_equal(after.storage.read_rows("state", np.array([slot]), 0, 12), stored)
    # a flipped bit of the data itself still fails as damaged data, and is dropped on repair
    _flip(folder / "data" / "reward" / "c.0.0", 4 * (2 * 12 + 1) + 1, 0x10)  # slot 2, step 1
    with ReplayBuffer.from_folder(folder, read_only=True) as reader, pytest.raises(CorruptChunkError) as caught:
        reader.storage.read_rows("reward", np.array([2]), 0, int(reader.episode_lens[2]))
    assert not isinstance(caught.value, ChecksumEntryError)
    assert any("repaired: dropped the damaged episodes in slots [2]" in line for line in verify(folder, repair=True))


def test_a_dead_upgrade_copy_whose_replaybuf_folder_is_a_link_is_not_followed(tmp_path):
    # a look-alike of a killed upgrade's copy whose replaybuf/ links to a user's folder that
    # holds a matching marker: removing leftovers must never delete through the link
    import json
    import shutil

    from replaybuf.maintenance import UPGRADE_MARKER, _upgrade_record, upgrade, upgrade_leftovers

    from .test_format_fixtures import DATA

    path = tmp_path / "buf"
    shutil.copytree(os.path.join(DATA, "format-v4", "zarr"), path)
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.txt").write_text("mine")
    record = {**_upgrade_record(os.path.realpath(path)), "pid": 999999999}
    (users / os.path.basename(UPGRADE_MARKER)).write_text(json.dumps(record))
    look_alike = tmp_path / ".buf.upgrading-999999999"
    look_alike.mkdir()
    (look_alike / "replaybuf").symlink_to(users)
    assert upgrade_leftovers(os.path.realpath(path)) == ([], [str(look_alike)])
    assert upgrade(path, progress=False)["removed"] == []
    assert (users / "thesis.txt").read_text() == "mine" and look_alike.is_dir()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_flipped_crc_bit_of_a_format_2_entry_is_resealed_not_the_episode_dropped(tmp_path, backend):
    # format 2's entries carry no tag to check themselves: one bit away from the data's crc32c
    # is still provably the entry's damage (a flipped data bit moves the crc by more)
    import shutil

    import numpy as np

    from replaybuf import ChecksumEntryError, ReplayBuffer
    from replaybuf.maintenance import verify

    from .test_format_fixtures import DATA, _check_contents, _stored_version

    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "format-v2", backend), path)
    sums_file = path / "replaybuf" / "checksums.npy"
    sums = np.load(sums_file, mmap_mode="r+")
    sums[1, 0] ^= np.uint64(1 << 7)  # a crc bit of slot 1's first field
    sums.flush()
    del sums
    with pytest.raises(ChecksumEntryError, match=r"slot 1: its checksum entry in .*checksums\.npy.*one bit away"):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    problems = verify(path, repair=True)
    assert any(p.startswith("repaired: re-sealed the damaged checksum entries") for p in problems)
    assert "dropped" not in " ".join(problems) and verify(path) == []
    assert _stored_version(path, backend) == 2
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


def test_an_upgrade_whose_backup_name_is_taken_refuses_before_copying(tmp_path):
    # a backup an earlier --keep-backup left under this process's pid: the rename would fail
    # after the whole copy, with a bare "Directory not empty"
    import shutil

    from replaybuf.maintenance import upgrade

    from .test_format_fixtures import DATA, _stored_version

    path = tmp_path / "buf"
    shutil.copytree(os.path.join(DATA, "format-v1", "memmap"), path)
    earlier = tmp_path / f".buf.format1-{os.getpid()}"
    earlier.mkdir()
    (earlier / "kept.txt").write_text("an earlier backup")
    with pytest.raises(FileExistsError, match="move it away and run the upgrade again") as refused:
        upgrade(path, progress=False)
    assert str(earlier) in str(refused.value)
    assert sorted(os.listdir(tmp_path)) == [earlier.name, "buf"] and _stored_version(path, "memmap") == 1
    assert (earlier / "kept.txt").read_text() == "an earlier backup"


@pytest.mark.parametrize("command", ["convert", "info"])
def test_a_writer_outpacing_a_command_is_a_message_and_status_1_not_a_traceback(tmp_path, capsys, monkeypatch, command):
    import replaybuf.maintenance as maintenance

    filled(tmp_path / "src", "memmap")
    if command == "convert":  # every read of the source finds a slot its writer is replacing
        read_bookkeeping = maintenance._read_bookkeeping
        monkeypatch.setattr(maintenance, "_read_bookkeeping", lambda *a: (*read_bookkeeping(*a)[:2], {0}))
    else:  # every read of the lengths catches a commit midway
        monkeypatch.setattr(maintenance, "_midway", lambda lens, generations: True)
        monkeypatch.setattr(maintenance, "_BOOKKEEPING_READS", 2)
    from replaybuf.storage.lease import WriterLease

    monkeypatch.setattr(WriterLease, "live_holder", lambda lease: {"pid": 1, "host": "h", "since": "now"})
    argv = [command, tmp_path / "src"] + ([tmp_path / "dst", "--quiet"] if command == "convert" else [])
    assert run_cli(argv) == 1
    err = capsys.readouterr().err
    assert "faster than" in err and "Traceback" not in err
    assert not (tmp_path / "dst").exists()  # nothing published, the folder it made removed


def test_a_folder_made_between_the_upgrades_renames_keeps_both_copies_and_names_them(tmp_path, monkeypatch):
    # a writer (or anyone) creating the buffer's folder while it is moved aside: the second
    # rename fails; the verified copy was deleted and a bare "Directory not empty" hid the original
    # (on a system without an atomic exchange of the two folders: Linux swaps them in one step)
    import shutil

    import replaybuf.maintenance as maintenance
    from replaybuf import ReplayBuffer
    from replaybuf.maintenance import upgrade

    from .test_format_fixtures import DATA, NEWEST, _check_contents, _stored_version

    path = tmp_path / "buf"
    shutil.copytree(os.path.join(DATA, "format-v1", "memmap"), path)
    rename = os.rename

    def then_recreated(src, dst):
        rename(src, dst)
        if str(src) == str(path):  # the original moved aside: someone makes the folder anew
            path.mkdir()
            (path / "notes.txt").write_text("theirs")

    monkeypatch.setattr(maintenance, "_exchange", lambda *args: False)
    monkeypatch.setattr(os, "rename", then_recreated)
    with pytest.raises(FileExistsError, match="nothing is lost") as refused:
        upgrade(path, progress=False)
    monkeypatch.undo()
    backup = tmp_path / f".buf.format1-{os.getpid()}"
    copy = tmp_path / f".buf.upgrading-{os.getpid()}"
    assert str(backup) in str(refused.value) and str(copy) in str(refused.value)
    assert (path / "notes.txt").read_text() == "theirs"
    assert _stored_version(backup, "memmap") == 1 and _stored_version(copy, "memmap") == NEWEST["memmap"]
    _check_contents(ReplayBuffer.from_folder(backup, read_only=True))
    _check_contents(ReplayBuffer.from_folder(copy, read_only=True))


def test_unlock_of_a_live_local_writer_says_what_it_refused_and_why(tmp_path, capsys):
    from replaybuf import ReplayBuffer

    folder = tmp_path / "b"
    writer = ReplayBuffer(folder, 4, 3, fields={"x": "float"})
    writer.store_episode(x=[1.0])
    assert run_cli(["unlock", folder]) == 1
    err = capsys.readouterr().err
    # not "cannot open ... for writing": unlock opens nothing
    assert err.startswith(f"unlock: {str(folder)!r} is being written by pid {os.getpid()} ")
    assert "never stale" in err and "Nothing was changed" in err
    writer.store_episode(x=[2.0])  # still its writer's
    writer.close()
    with ReplayBuffer.from_folder(folder, read_only=True) as reader:
        assert len(reader) == 2


def test_an_upgrade_whose_disk_fills_as_it_deletes_the_original_still_succeeds(tmp_path, monkeypatch):
    # the copy doubled the space used: marking the original for deletion can hit a full disk
    # once the swap is done, which must not turn a finished upgrade into an error
    import errno
    import json
    import shutil
    import types

    import replaybuf.maintenance as maintenance
    from replaybuf import ReplayBuffer

    from .test_format_fixtures import DATA, NEWEST, _check_contents, _stored_version

    path = tmp_path / "buf"
    shutil.copytree(os.path.join(DATA, "format-v1", "zarr"), path)
    writes = []

    def dump(record, f):
        writes.append(record)
        if len(writes) > 1:  # the first marks the copy, the second the original
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        json.dump(record, f)

    monkeypatch.setattr(maintenance, "json", types.SimpleNamespace(dump=dump, dumps=json.dumps, loads=json.loads))
    done = maintenance.upgrade(path, progress=False)
    assert done["upgraded"] and len(writes) == 2
    assert os.listdir(tmp_path) == ["buf"] and _stored_version(path, "zarr") == NEWEST["zarr"]
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


def _convert_killed_before_publishing(src: str, dst: str, backend: str) -> None:
    """Child: convert ``src`` to ``dst``, SIGKILLed once the episodes' rows are copied, before
    their lengths publish them."""
    import signal

    import replaybuf.maintenance as maintenance

    copy_episodes = maintenance._copy_episodes

    def then_killed(*args, **kwargs):
        copy_episodes(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    maintenance._copy_episodes = then_killed
    maintenance.convert(src, dst, backend=backend, progress=False)


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_killed_convert_leaves_a_copy_info_and_verify_call_unfinished(tmp_path, capsys, backend):
    # it opened as a valid, empty buffer: info showed "episodes 0" and nothing else
    import multiprocessing
    import signal

    from replaybuf import ReplayBuffer
    from replaybuf.maintenance import info, verify

    filled(tmp_path / "src", "memmap")
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    child = multiprocessing.get_context("fork").Process(
        target=_convert_killed_before_publishing, args=(src, dst, backend)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert run_cli(["info", dst]) == 0
    said = capsys.readouterr().out
    assert f"unfinished {dst!r} is an unfinished copy: a `replaybuf convert` from {src!r} stopped" in said
    assert any("unfinished copy" in problem and "--overwrite" in problem for problem in verify(dst))
    assert run_cli(["convert", "--quiet", "--overwrite", "--backend", backend, src, dst]) == 0
    assert info(dst)["unfinished_copy"] is None and verify(dst) == []
    with ReplayBuffer.from_folder(dst, read_only=True) as copy:
        assert len(copy) == 4


def test_a_flipped_bit_of_a_chunk_s_crc32c_on_s3_is_resealed_not_the_episode_dropped(s3_server):
    # an object store: no packed fields, a chunk object per episode of a small field and a shard
    # object per episode of an image field, each stored chunk ending with its crc32c
    import numpy as np

    from replaybuf import ChunkChecksumError, ReplayBuffer
    from replaybuf.maintenance import verify

    url, options = s3_server.url("chunk-crc-bit"), s3_server.storage_options
    fields = {"image": {"dtype": "uint8", "shape": (32, 32, 4), "compressor": "blosc-lz4"}, "x": ("float", 3)}
    episodes = [
        {"image": np.full((n, 32, 32, 4), 7 * n, np.uint8), "x": np.arange(3 * n, dtype=np.float32).reshape(n, 3)}
        for n in (4, 6)
    ]
    with ReplayBuffer(url, 3, 8, fields=fields, storage_options=options) as writer:
        for values in episodes:
            writer.store_episode(**values)
        kv = writer.storage.kv
        keys = [writer.storage.array(name).chunk_key((1, 0)) for name in fields]
    for key in keys:  # a bit of the last chunk's crc32c: the shard index's, the x chunk's
        data = bytearray(kv.get(key))
        data[-1] ^= 0x04
        kv.set(key, bytes(data))
    with ReplayBuffer.from_folder(url, read_only=True, storage_options=options) as reader:
        with pytest.raises(ChunkChecksumError, match="stored crc32c is damaged") as caught:
            np.asarray(reader.data["x"][1])
        assert caught.value.location.endswith(keys[1])
    found = verify(url, storage_options=options, repair=True, progress=False)
    assert not any("dropped" in line for line in found)
    for name in fields:
        assert any(
            line.startswith(f"repaired: re-sealed in place the damaged crc32c of data/{name}, slot 1") for line in found
        )
    assert verify(url, storage_options=options, progress=False) == []
    with ReplayBuffer.from_folder(url, read_only=True, storage_options=options) as reader:
        assert reader.valid_episodes().tolist() == [0, 1]
        for slot, values in enumerate(episodes):
            for name, stored in values.items():
                np.testing.assert_array_equal(np.asarray(reader.data[name][slot, : len(stored)]), stored)
