"""Hostile and careless edit logs (``editlog.py``): a planted record that passes its checksum
but names what no edit could (a slot twice, an int past int64) is refused as damaged, copied
aside and applied to nothing; neither ``verify`` nor a writable open raises for it. Two opens
of one buffer in one process (sharing the lease) never replace each other's running edit. An
edit killed in an earlier release's HDF5 buffer leaves it readable."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import struct
import zlib

import numpy as np
import pytest

from replaybuf import ReplayBuffer, editlog
from replaybuf.maintenance import verify
from replaybuf.storage import StorageError

from ._backends import BACKENDS, LOCAL_BACKENDS
from ._data import released_copy
from .test_crash import FORK
from .test_edit_log import LENGTH, OLD, Place, make, update, version


def crafted(header: dict, body: bytes = b"") -> bytes:
    """A record of ``header`` and ``body`` with a valid magic, size and checksum."""
    document = json.dumps(header).encode()
    payload = struct.pack("<I", len(document)) + document + body
    return struct.pack("<4sQI", b"RBE1", len(payload), zlib.crc32(payload)) + payload


@pytest.mark.parametrize(
    "lie", ["slot twice", "slot past int64", "generation past int64", "revision past int64", "t0 true"]
)
def test_a_planted_record_no_edit_could_write_is_refused_whole(tmp_path, lie):
    """Slot 0 named twice (once with its generation, once with another: the slots kept and
    their revisions differ in number), an int past int64, or JSON's ``true`` for the first step of rows
    (an int to Python, not to JSON): ``verify`` reports, a writable
    open warns, applies nothing and seals the odd slots."""
    path = str(tmp_path / "b")
    buffer = make(Place(path))
    generations, revisions = buffer._meta["_generation"][:2].tolist(), (buffer._meta["_revision"][:2] | 1).tolist()
    header = {"slots": [0, 1], "generations": [*generations], "revisions": [*revisions], "writes": []}
    if lie == "slot twice":
        header.update(
            slots=[0, 0, 1], generations=[generations[0], 99, generations[1]], revisions=[revisions[0], *revisions]
        )
    elif lie != "t0 true":
        header[lie.split()[0] + "s"][0] = 1 << 70
    if lie == "t0 true":
        header["writes"] = [{"kind": "rows", "field": "step", "count": 1, "t0": True, "steps": 1}]
        values = np.array([[7]], buffer.schema.fields["step"].dtype)
    else:
        header["writes"] = [{"kind": "meta", "field": "uid", "count": 1}]
        values = np.array([7], buffer.schema.meta_fields["uid"].dtype)
    editlog.write(buffer.storage, crafted(header, np.array([0], "<i8").tobytes() + values.tobytes()))
    buffer._commit.write_meta("_revision", np.array([0, 1]), np.array(revisions))
    buffer.close()
    assert verify(path)  # the odd slots, named
    with pytest.warns(UserWarning, match=r"the edit log replaybuf/edit in .* is damaged"):
        again = ReplayBuffer.from_folder(path)
    with again:
        assert version(again) == OLD
        assert (again._meta["_revision"] % 2 == 0).all()
    assert verify(path) == []


@contextlib.contextmanager
def interrupted_after_first_rows(buffer, monkeypatch):
    """Within: the buffer's first write of an edit's rows is made, then a KeyboardInterrupt."""
    update_rows = buffer.storage.update_rows

    def interrupted(*args, **kwargs):
        update_rows(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(buffer.storage, "update_rows", interrupted)
        yield


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_edit_is_refused_while_another_open_s_interrupted_edit_is_running(place, monkeypatch):
    """Two writable opens in one process share the lease. The first one's edit is interrupted
    after its first write (a KeyboardInterrupt): the second one's edit is refused, as its record
    would replace the running one's, leaving it half applied for good; it changes nothing. The
    first one's close finishes its edit whole; then the second one edits."""
    first = make(place)
    second = ReplayBuffer.from_folder(place.location, **place.kwargs)
    with interrupted_after_first_rows(first, monkeypatch), pytest.raises(KeyboardInterrupt):
        update(first)
    with pytest.raises(
        StorageError, match=r"another open of .* was interrupted in an in-place edit of slots \[0, 1, 2\]"
    ):
        second.update([2], uid=9)
    assert int(second.meta_data["uid"][2]) != 9
    first.close()
    second.update([2], uid=9)
    second.close()
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert version(again, [0, 1]) == {(7.0, 7, 7)}
        assert version(again, [2]) == {(7.0, 7, 9)}
    if place.name != "memory":
        assert verify(place.location) == []


def _edit_killed_at_its_first_row_write(location: str) -> None:
    """Child: open the buffer writable and update the first step of its first slot, SIGKILLed as
    the first rows are written (after the record and the odd ``_revision``)."""
    buffer = ReplayBuffer.from_folder(location)

    def dying(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    buffer.storage.update_rows = dying  # type: ignore[method-assign]
    buffer.update([0], **{name: np.ones((1, 1, *f.shape), f.dtype) for name, f in buffer.schema.fields.items()})
    os._exit(3)


@pytest.mark.parametrize("version", ["format-v1", "format-v3"])
def test_an_edit_killed_in_an_earlier_release_s_hdf5_buffer_leaves_it_readable(tmp_path, version):
    """An earlier release's data.h5 holds a meta dataset not yet placed (meta/_revision: added
    by the writable open, or created unplaced): placed at the edit's first write of it, a kill
    before the next flush left data.h5 unreadable ("invalid dataset size"). The writable open
    places it first: the reopen applies the edit whole, verify clean."""
    path = released_copy(version, "hdf5", tmp_path)
    child = FORK.Process(target=_edit_killed_at_its_first_row_write, args=(path,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    with ReplayBuffer.from_folder(path) as again:
        for name in again.schema.fields:
            assert (np.asarray(again.data[name][0][:1]) == 1).all()
    assert verify(path) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_rows_an_edit_wrote_past_an_episode_s_end_are_zeroed_by_its_slot_s_next_episode_after_a_reopen(place):
    """An update of every step of a 4-step episode (max_timesteps 6) writes rows past its end;
    after a close and reopen, a 2-step episode reusing the slot zeroes them (backends that
    write rows in pieces kept the slot to zero in RAM only): verify finds no data past it."""
    buffer = make(place, circular=True)
    buffer.store_episode(obs=np.full((LENGTH, 3), 3, np.float32), step=np.full(LENGTH, 3), uid=3)
    buffer.update([0], obs=np.full((1, 6, 3), 7, np.float32))
    buffer.close()
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        again.store_episode(obs=np.full((2, 3), 9, np.float32), step=np.full(2, 9), uid=9)  # slot 0 again
    assert verify(place.location) == []


def test_a_planted_sparse_edit_log_is_judged_by_its_first_bytes(tmp_path):
    """A sparse 16 MiB file at replaybuf/edit (within what a record of this buffer may hold)
    whose header claims 2**62 bytes, beside a slot marked mid-edit: the writable open reads its
    16 header bytes only, warns, and copies those aside (was: read whole into memory and
    copied whole, a sparse file made dense on disk); verify reads no more."""
    path = str(tmp_path / "b")
    fields = {"obs": {"dtype": "float32", "shape": [1024]}}
    with ReplayBuffer(path, max_episodes=128, max_timesteps=128, fields=fields) as buffer:
        buffer.store_episode(obs=np.zeros((2, 1024), np.float32))
        assert editlog.bound(buffer.schema) > 32 << 20
        buffer._commit.write_meta("_revision", np.array([0]), buffer._meta["_revision"][[0]] | 1)
    with open(os.path.join(path, "replaybuf", "edit"), "wb") as f:
        f.write(struct.pack("<4sQI", b"RBE1", 1 << 62, 0))
        f.truncate(16 << 20)
    assert verify(path)  # the odd slot
    with pytest.warns(UserWarning, match=r"is damaged \(a record of [\d,]+ bytes, more than any of this buffer"):
        again = ReplayBuffer.from_folder(path)
    again.close()
    (aside,) = (os.path.join(d, "edit") for d in glob.glob(os.path.join(path, "replaybuf", "steplog-damaged-*")))
    assert os.path.getsize(aside) == 16
    assert verify(path) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_hard_link_at_the_edit_log_is_never_written_through(place, tmp_path):
    """replaybuf/edit made a hard link to a file outside the buffer: the record is written in
    place, so the writable open (emptying a log that holds no record) and each edit wrote
    into that file. The log is made a file of its own first; the file keeps its bytes."""
    make(place).close()
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the buffer's")
    log = os.path.join(place.location, "replaybuf", "edit")
    if os.path.lexists(log):
        os.unlink(log)
    os.link(outside, log)
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        again.update([0], uid=5)
    assert outside.read_bytes() == b"not the buffer's"
    assert verify(place.location) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_an_interrupted_edit_is_finished_from_what_is_stored_after_another_open_reused_its_slot(place, monkeypatch):
    """Two writable opens in one process. The first one's edit of slots 0 and 1 is interrupted;
    the second one then stores two episodes, the second reusing slot 0 (circular). The first
    one's close finishes its edit from what is stored: slot 1 edited whole, slot 0 keeps the
    new episode (was: resealed from the first open's mirror, slot 0's checksums computed at the
    old length and its meta values, and the buffer refused as damaged at the next open)."""
    first = make(place, circular=True)
    second = ReplayBuffer.from_folder(place.location, **place.kwargs)
    with interrupted_after_first_rows(first, monkeypatch), pytest.raises(KeyboardInterrupt):
        first.update([0, 1], obs=np.full((2, LENGTH, 3), 7, np.float32), step=np.full((2, LENGTH), 7), uid=7)
    for uid in (3, 4):
        second.store_episode(obs=np.full((2, 3), uid, np.float32), step=np.full(2, uid), uid=uid)
    first.close()
    second.close()
    assert verify(place.location) == []
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert again._meta["episode_lens"][0] == 2 and int(again.meta_data["uid"][0]) == 4
        assert version(again, [1]) == {(7.0, 7, 7)}
