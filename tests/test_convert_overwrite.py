"""``convert(src, dst, overwrite=True)`` onto a local buffer: the copy is built beside the
destination and swapped in only once complete, so a copy that fails at any point (a damaged
source episode, a full disk, an interrupt) leaves the buffer it was to replace as it was, and
no folder of its own beside it."""

from __future__ import annotations

import errno
import hashlib
import os

import numpy as np
import pytest

import replaybuf.maintenance as maintenance
from replaybuf import BufferDamagedError, CorruptChunkError, ReplayBuffer
from replaybuf.cli import main
from replaybuf.maintenance import convert, info, verify
from replaybuf.storage import backend_class

from .test_maintenance import filled

LOCAL = ["zarr", "memmap", "hdf5"]


def tree(folder) -> dict[str, tuple]:
    """Every file under ``folder`` (size, mtime, content hash) and every folder (its name only:
    taking and giving back the writer lease touches the mtime of ``replaybuf/``)."""
    out: dict[str, tuple] = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs:
            out[os.path.relpath(os.path.join(parent, name), folder) + "/"] = ()
        for name in files:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def place(tmp_path):
    """A source (memmap, 4 episodes) and, at ``dst``, an older buffer it is to replace."""

    def make(backend: str):
        filled(tmp_path / "src", "memmap")
        filled(tmp_path / "dst", backend, lengths=(2, 3), max_episodes=6, circular=False)
        return tmp_path / "src", tmp_path / "dst"

    return make


def fail_at(monkeypatch, backend: str, method: str, call: int, error: BaseException) -> None:
    """Make the ``call``-th call (from 1) of ``method`` of ``backend``'s storage raise ``error``."""
    cls = backend_class(backend)
    original = getattr(cls, method)
    count = {"n": 0}

    def failing(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] == call:
            raise error
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, failing)


def assert_kept(tmp_path, dst, before) -> None:
    assert tree(dst) == before
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]  # no copy left beside it
    with ReplayBuffer.from_folder(dst, read_only=True) as kept:
        assert kept.episode_lens[:2].tolist() == [2, 3] and len(kept) == 2


FAILURES = [
    ("write_rows", 1, OSError(errno.ENOSPC, "No space left on device (injected)")),
    ("write_rows", 3, KeyboardInterrupt()),
    ("write_meta", 2, OSError(errno.EFBIG, "File too large (injected)")),
    ("commit_state", 1, OSError(errno.EIO, "I/O error (injected)")),
]


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize(("method", "call", "error"), FAILURES, ids=[f"{m}-{c}" for m, c, _ in FAILURES])
def test_a_convert_overwrite_failing_part_way_leaves_the_old_buffer_as_it_was(
    tmp_path, monkeypatch, place, backend, method, call, error
):
    # before: the old buffer was erased when the copy was created, and the copy left half written
    src, dst = place(backend)
    before = tree(dst)
    fail_at(monkeypatch, backend, method, call, error)
    with pytest.raises(BaseException) as raised:  # a create wraps an OSError in a StorageError
        convert(src, dst, backend=backend, progress=False, overwrite=True)
    assert error in (raised.value, raised.value.__cause__)
    assert_kept(tmp_path, dst, before)


@pytest.mark.parametrize("backend", LOCAL)
def test_a_convert_overwrite_whose_swap_fails_leaves_the_old_buffer_as_it_was(tmp_path, monkeypatch, place, backend):
    # the copy complete and checked, the exchange refused (a bind mount: EXDEV)
    src, dst = place(backend)
    before = tree(dst)

    def refused(one, other, command="upgrade"):
        raise OSError(errno.EXDEV, f"{command}: swapping {one!r} and {other!r}: Invalid cross-device link")

    monkeypatch.setattr(maintenance, "_exchange", refused)
    with pytest.raises(OSError, match="cross-device"):
        convert(src, dst, backend=backend, progress=False, overwrite=True)
    assert_kept(tmp_path, dst, before)


def test_a_convert_overwrite_from_a_source_with_a_damaged_episode_leaves_the_old_buffer(tmp_path, place):
    src, dst = place("zarr")
    before = tree(dst)
    state = np.load(src / "state.data.npy", mmap_mode="r+")
    state[1, 0] += 1  # the first row of slot 1: found when the episode is copied
    state.flush()
    del state
    with pytest.raises(CorruptChunkError, match="slot 1"):
        convert(src, dst, progress=False, overwrite=True)
    assert_kept(tmp_path, dst, before)


@pytest.mark.parametrize("backend", LOCAL)
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_convert_overwrite_replaces_the_old_buffer_and_leaves_nothing_beside_it(
    tmp_path, monkeypatch, place, backend, exchange
):
    src, dst = place(backend)
    if not exchange:  # a system without renameat2
        monkeypatch.setattr(maintenance, "_exchange", lambda *args: False)
    old_uuid = ReplayBuffer.from_folder(dst, read_only=True).schema.uuid
    done = convert(src, dst, backend=backend, progress=False, overwrite=True)
    assert done["episodes"] == 4 and done["verified"]
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]
    assert verify(dst) == []
    with ReplayBuffer.from_folder(src, read_only=True) as a, ReplayBuffer.from_folder(dst, read_only=True) as b:
        assert b.storage.backend_name == backend
        np.testing.assert_array_equal(a.episode_lens, b.episode_lens)
        np.testing.assert_array_equal(a.data["state"][:], b.data["state"][:])
        assert b.schema.uuid not in (a.schema.uuid, old_uuid)  # a buffer of its own, as before
    assert not os.path.exists(dst / "replaybuf" / "writer.lock")


def test_the_cli_convert_overwrite_failing_part_way_leaves_the_old_buffer(tmp_path, monkeypatch, capsys, place):
    src, dst = place("zarr")
    before = tree(dst)
    fail_at(monkeypatch, "zarr", "write_rows", 2, OSError(errno.ENOSPC, "No space left on device (injected)"))
    assert main(["convert", "--quiet", "--overwrite", str(src), str(dst)]) == 1  # a failure, not a usage error
    assert "No space left" in capsys.readouterr().err
    assert_kept(tmp_path, dst, before)
    monkeypatch.undo()
    assert main(["convert", "--quiet", "--overwrite", str(src), str(dst)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"] and len(ReplayBuffer.from_folder(dst, read_only=True)) == 4


def test_a_convert_overwrite_through_a_link_replaces_the_buffer_it_names_and_keeps_the_link(tmp_path, monkeypatch):
    filled(tmp_path / "src", "memmap")
    (tmp_path / "real").mkdir()
    filled(tmp_path / "real" / "buf", "zarr", lengths=(2, 3), max_episodes=6, circular=False)
    (tmp_path / "links").mkdir()
    os.symlink(tmp_path / "real" / "buf", tmp_path / "links" / "dst")
    before = tree(tmp_path / "real" / "buf")
    fail_at(monkeypatch, "zarr", "write_rows", 1, OSError(errno.ENOSPC, "No space left on device (injected)"))
    with pytest.raises(OSError, match="No space"):
        convert(tmp_path / "src", tmp_path / "links" / "dst", progress=False, overwrite=True)
    assert tree(tmp_path / "real" / "buf") == before
    assert os.listdir(tmp_path / "real") == ["buf"] and os.listdir(tmp_path / "links") == ["dst"]
    monkeypatch.undo()
    convert(tmp_path / "src", tmp_path / "links" / "dst", progress=False, overwrite=True)
    assert os.path.islink(tmp_path / "links" / "dst") and os.listdir(tmp_path / "links") == ["dst"]
    assert os.listdir(tmp_path / "real") == ["buf"]
    assert len(ReplayBuffer.from_folder(tmp_path / "real" / "buf", read_only=True)) == 4


def _convert_killed_while_copying(src: str, dst: str) -> None:
    """Child: ``convert --overwrite`` of ``src`` onto ``dst``, SIGKILLed once the rows are copied."""
    import signal

    copy_episodes = maintenance._copy_episodes

    def then_killed(*args, **kwargs):
        copy_episodes(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    maintenance._copy_episodes = then_killed
    maintenance.convert(src, dst, progress=False, overwrite=True)


def test_a_killed_convert_overwrite_leaves_the_old_buffer_and_a_copy_info_names_and_the_next_removes(
    tmp_path, capsys, place
):
    import multiprocessing
    import signal

    src, dst = place("zarr")
    before = tree(dst)
    child = multiprocessing.get_context("fork").Process(target=_convert_killed_while_copying, args=(str(src), str(dst)))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    # as it was, but for the lock file of the killed process's lease (as any killed writer's)
    assert {k: v for k, v in tree(dst).items() if k != "replaybuf/writer.lock"} == before
    (left,) = [tmp_path / entry for entry in os.listdir(tmp_path) if entry not in ("dst", "src")]
    assert info(dst)["killed_upgrades"] == [str(left)]
    assert main(["info", str(dst)]) == 0
    assert f"leftover   {left}: the copy of a killed upgrade or convert --overwrite" in capsys.readouterr().out
    convert(src, dst, progress=False, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]
    assert len(ReplayBuffer.from_folder(dst, read_only=True)) == 4


def test_a_source_whose_meta_fail_their_checksums_is_refused_before_an_erase_in_place(tmp_path, monkeypatch, place):
    # where no swap is possible (an object store, a mount point) the erase comes first: every
    # refusal decidable from the source's bookkeeping comes before it
    src, dst = place("zarr")
    before = tree(dst)
    path = src / "task_id.data.meta.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last slot's task_id, no longer its checksum's
    path.write_bytes(bytes(data))
    monkeypatch.setattr(maintenance, "_swappable_folder", lambda location: None)
    with pytest.raises(BufferDamagedError, match="nothing was written"):
        convert(src, dst, progress=False, overwrite=True)
    assert tree(dst) == before


def test_a_source_whose_meta_fail_their_checksums_is_refused_before_erasing_a_url_destination(tmp_path):
    # an fsspec URL (as S3/GCS) is erased in place: the refusal comes first, not after the erase
    import uuid

    from replaybuf.testing import snapshot

    src, dst = tmp_path / "src", f"memory://convert-overwrite-{uuid.uuid4().hex[:8]}"
    filled(src, "memmap")
    filled(dst, "zarr", lengths=(2, 3), max_episodes=6, circular=False)
    before = snapshot(dst)
    assert before
    values = np.load(src / "task_id.data.meta.npy", mmap_mode="r+")
    values[-1] += 1  # no longer its checksum's
    values.flush()
    del values
    with pytest.raises(BufferDamagedError, match="nothing was written"):
        convert(src, dst, progress=False, overwrite=True)
    assert snapshot(dst) == before


def test_only_an_existing_local_folder_is_built_beside_and_swapped(tmp_path):
    from replaybuf.maintenance import _swappable_folder

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert _swappable_folder(str(tmp_path / "real")) == str(tmp_path / "real")
    assert _swappable_folder(f"file://{tmp_path / 'real'}/") == str(tmp_path / "real")
    assert _swappable_folder(str(tmp_path / "link")) == str(tmp_path / "real")  # the folder the link names
    assert _swappable_folder(str(tmp_path / "new")) is None  # nothing there to keep
    assert _swappable_folder("s3://bucket/run") is None  # no atomic swap on an object store
    assert _swappable_folder("/") is None


def test_a_convert_overwrite_lets_go_of_the_old_buffer_s_files_this_process_mapped(tmp_path):
    # erasing in place dropped them; swapped and deleted, the old shards stayed mapped (their
    # disk space held) under paths that now name the new buffer's files
    from replaybuf.storage._hotmap import shard_maps

    fields = {"image": {"dtype": "uint8", "shape": (64, 64, 3), "compressor": "blosc-lz4"}}
    for name, value in (("src", 7), ("dst", 3)):
        with ReplayBuffer(tmp_path / name, 4, 6, fields=fields) as buffer:
            for _ in range(2):
                buffer.store_episode(image=np.full((5, 64, 64, 3), value, np.uint8))
            buffer.compact()
    reader = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True)
    assert np.unique(reader.data["image"][0, :5]).tolist() == [3]  # maps its shard
    under = str(tmp_path / "dst") + os.sep
    assert [path for path in shard_maps()._entries if path.startswith(under)]
    convert(tmp_path / "src", tmp_path / "dst", progress=False, overwrite=True)
    assert not [path for path in shard_maps()._entries if path.startswith(under)]
    with ReplayBuffer.from_folder(tmp_path / "dst", read_only=True) as copy:
        assert np.unique(copy.data["image"][0, :5]).tolist() == [7]
    reader.close()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_copy_onto_another_backends_buffer_names_the_backend_to_convert_to(tmp_path, overwrite):
    """It said "open it with backend='memmap'", advice for ReplayBuffer that convert takes none of."""
    filled(tmp_path / "src", "zarr")
    filled(tmp_path / "dst", "memmap", lengths=(2, 3))
    before = tree(tmp_path / "dst")
    with pytest.raises(FileExistsError, match=r"holds a 'memmap' buffer.*--backend memmap\)$"):
        convert(tmp_path / "src", tmp_path / "dst", progress=False, overwrite=overwrite)
    assert tree(tmp_path / "dst") == before
