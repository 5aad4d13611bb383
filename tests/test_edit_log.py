"""In-place edits are whole or not at all (``editlog.py``, ``Committer.edit``): an edit is
logged before any of its writes, so one interrupted part way is finished from the log (by the
object's next flush, or by the next writable open after a kill), never left half applied; a
log that is torn, damaged, planted or left by finished edits changes nothing it should not.

The SIGKILL of a writer part way through an edit is in test_edit_atomic.py.
"""

from __future__ import annotations

import dataclasses
import struct
import uuid
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaybuf import ReplayBuffer, editlog
from replaybuf.editlog import Edit, Write
from replaybuf.maintenance import verify

from ._backends import BACKENDS, LOCAL_BACKENDS
from .test_interrupts import LineInterrupt


@dataclasses.dataclass
class Place:
    """A local zarr location, as the ``place`` fixture gives one."""

    location: str
    kwargs: dict = dataclasses.field(default_factory=dict)


pytest_plugins = ["tests._servers"]

FIELDS = {"obs": {"dtype": "float32", "shape": [3]}, "step": "int32"}
LENGTH = 4


def make(place, circular: bool = False) -> ReplayBuffer:
    buffer = ReplayBuffer(
        place.location,
        max_episodes=4,
        max_timesteps=6,
        fields=FIELDS,
        meta_fields={"uid": "int"},
        circular=circular,
        **place.kwargs,
    )
    for uid in range(3):
        buffer.store_episode(obs=np.full((LENGTH, 3), uid, np.float32), step=np.full(LENGTH, uid), uid=uid)
    return buffer


def version(buffer: ReplayBuffer, slots=(0, 1, 2)) -> set[tuple[float, ...]]:
    """Per slot, the values of every field it holds (obs, step, uid): one tuple each."""
    return {
        (
            *np.unique(np.asarray(buffer.data["obs"][slot][:LENGTH])).tolist(),
            *np.unique(np.asarray(buffer.data["step"][slot][:LENGTH])).tolist(),
            int(buffer.meta_data["uid"][slot]),
        )
        for slot in slots
    }


OLD = {(0.0, 0, 0), (1.0, 1, 1), (2.0, 2, 2)}
NEW = {(7.0, 7, 7)}


def update(buffer: ReplayBuffer) -> None:
    """One edit of two data fields and a meta field of slots 0-2: every value becomes 7."""
    buffer.update([0, 1, 2], obs=np.full((3, LENGTH, 3), 7, np.float32), step=np.full((3, LENGTH), 7), uid=7)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_edits_given_steps_past_an_episodes_length_leave_a_buffer_verify_calls_clean(place):
    """``update`` of every timestep (episodes of length 4 in 6 steps, as the seed's README
    passes values of the whole time axis) and ``data[...] = ...`` over the whole width: the
    values past each episode's length are never shown by a read, so they are not stored
    (before: they were, and ``verify`` reported a clean buffer's episodes as holding data
    beyond their length). An empty slot (3) takes what is written, as the seed's does."""
    buffer = make(place)
    buffer.update([0, 1], obs=np.full((2, 6, 3), 7, np.float32))
    buffer.data["step"][2] = np.arange(6)
    buffer.update(slice(0, 4), step=np.full((4, 6), 5))
    assert np.array_equal(np.asarray(buffer.data["obs"][0]), [[7] * 3] * LENGTH + [[0] * 3] * 2)
    assert np.array_equal(np.asarray(buffer.data["step"][2]), [5] * LENGTH + [0, 0])
    assert np.array_equal(np.asarray(buffer.data["step"][3]), [5] * 6)
    buffer.close()
    assert verify(place.location) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_an_update_interrupted_at_any_line_lands_whole_or_not_at_all(place):
    """A KeyboardInterrupt at each line of an update (in the buffer, the commit protocol and the
    edit log): the object's next flush leaves the three slots all as before or all edited, never
    a mix; the buffer reopens with them so and verifies clean."""
    outcomes, n = set(), 1
    while True:
        buffer = make(place)
        with LineInterrupt(n, ("buffer.py", "commit.py", "editlog.py")) as interrupt:
            try:
                update(buffer)
            except KeyboardInterrupt:
                pass
        buffer.flush()
        seen = version(buffer)
        assert seen in (OLD, NEW), f"interrupted at line {n}: {seen}"
        buffer.close()
        with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
            assert version(again) == seen
        assert verify(place.location) == []
        outcomes.add(frozenset(seen))
        if not interrupt.fired:
            break
        n += 3  # every third line: the lines between are like their neighbours
    assert outcomes == {frozenset(OLD), frozenset(NEW)}  # both ends were reached


def planted(buffer: ReplayBuffer, writes: list[Write], odd: bool = True) -> bytes:
    """The record of an edit of ``writes`` as a writer killed after its log (``odd``: and after
    marking its slots) leaves it; the record is appended to the buffer's edit log."""
    slots = np.unique(np.concatenate([w.episodes for w in writes]))
    revisions = buffer._meta["_revision"][slots] | 1
    record = editlog.encode(Edit(slots, buffer._meta["_generation"][slots].copy(), revisions, writes), buffer.schema)
    editlog.write(buffer.storage, record)
    if odd:
        buffer._commit.write_meta("_revision", slots, revisions)
    return record


def seven(slots=(0, 1, 2)) -> list[Write]:
    episodes = np.array(slots)
    count = len(episodes)
    return [
        Write("meta", "uid", episodes, np.full(count, 7, np.int64)),
        Write("rows", "obs", episodes, np.full((count, LENGTH, 3), 7, np.float32), 0),
        Write(
            "steps",
            "step",
            np.repeat(episodes, LENGTH),
            np.full(count * LENGTH, 7, np.int32),
            np.tile(np.arange(LENGTH), count),
        ),
    ]


@pytest.mark.parametrize("backend", BACKENDS)  # memory://: a log of one object per append
def test_a_killed_writer_s_logged_edit_is_applied_whole_by_the_next_writable_open(place):
    """The edit log of a writer killed right after marking its slots (none of its writes made):
    a reader is told the slots are mid-edit; the next writable open applies every write, seals
    the slots with new even revisions and clears the log; verify is clean."""
    buffer = make(place)
    before = buffer._meta["_revision"][:3].copy()
    planted(buffer, seven())
    buffer.close()
    assert any("edit log" in problem for problem in verify(place.location))
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert version(again) == NEW
        revisions = again._meta["_revision"][:3]
        assert (revisions % 2 == 0).all() and not np.isin(revisions, before).any()
        assert editlog.read(again.storage, again.schema) == (None, None)
    assert verify(place.location) == []


@pytest.mark.parametrize("backend", BACKENDS)  # memory://: a log of one object per append
def test_a_record_torn_by_a_kill_is_dropped_and_the_episodes_keep_their_values(place):
    """A record cut short (the writer killed while appending it: its slots were never marked):
    nothing of it is applied, and no warning is given."""
    buffer = make(place)
    record = editlog.encode(
        Edit(np.array([0]), buffer._meta["_generation"][:1].copy(), np.array([1]), seven([0])), buffer.schema
    )
    editlog.write(buffer.storage, record[: len(record) - 5])
    buffer.close()
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert version(again) == OLD
        assert editlog.read(again.storage, again.schema) == (None, None)
    assert verify(place.location) == []


@pytest.mark.parametrize("backend", BACKENDS)  # memory://: a log of one object per append
def test_a_finished_edit_left_in_the_log_is_not_applied_again(place):
    """A record whose edit finished (its slots moved on to new even revisions) and whose slot
    was since given another episode: applying it would overwrite the new episode. It is not."""
    buffer = make(place, circular=True)
    planted(buffer, seven([0]), odd=False)  # as if finished, its log left (a delete the store refused)
    buffer.update([0], uid=5)  # an edit after it: its log is appended after the stale record
    buffer.store_episode(obs=np.full((LENGTH, 3), 3, np.float32), step=np.full(LENGTH, 3), uid=3)
    buffer.store_episode(obs=np.full((LENGTH, 3), 4, np.float32), step=np.full(LENGTH, 4), uid=4)  # slot 0 again
    planted(buffer, seven([0]), odd=False)
    buffer.close()
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert version(again, [0, 1]) == {(4.0, 4, 4), (1.0, 1, 1)}
    assert verify(place.location) == []


@pytest.mark.parametrize("backend", BACKENDS)  # memory://: a log of one object per append
def test_a_running_edit_skips_a_slot_that_holds_another_episode_than_it_edited(place):
    """A running edit's record naming a generation its slot no longer holds (a planted log; a
    killed writer's slots cannot change before the next open) leaves that slot alone and edits
    the others."""
    buffer = make(place)
    generations = buffer._meta["_generation"][[0, 1]].copy()
    generations[1] += 100
    writes = seven([0, 1])
    revisions = buffer._meta["_revision"][[0, 1]] | 1
    editlog.write(buffer.storage, editlog.encode(Edit(np.array([0, 1]), generations, revisions, writes), buffer.schema))
    buffer._commit.write_meta("_revision", np.array([0, 1]), revisions)
    buffer.close()
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert version(again) == {(7.0, 7, 7), (1.0, 1, 1), (2.0, 2, 2)}
    assert verify(place.location) == []


@pytest.mark.parametrize(
    "damage",
    ["flip", "magic", "size", "garbage"],
)
def test_a_damaged_edit_log_is_copied_aside_named_and_the_buffer_opens(tmp_path, damage):
    """A flipped byte (checksum mismatch), a foreign magic, an absurd size (never read: no
    allocation of it) or garbage, with a slot marked mid-edit: the writable open copies it aside
    and warns naming the copy, applies nothing of it, keeps every episode and seals the marked
    slot."""
    path = str(tmp_path / "b")
    buffer = make(Place(path))
    record = bytearray(planted(buffer, seven([0]), odd=False))
    editlog.clear(buffer.storage)
    if damage == "flip":
        record[-1] ^= 0x10
    elif damage == "magic":
        record[:4] = b"XXXX"
    elif damage == "size":
        struct.pack_into("<Q", record, 4, 1 << 60)
    else:
        record = bytearray(b"\x00" * 7 + b"garbage" * 20)
    editlog.write(buffer.storage, bytes(record))
    buffer._commit.write_meta("_revision", np.array([0]), buffer._meta["_revision"][[0]] | 1)
    buffer.close()
    with pytest.warns(
        UserWarning,
        match=r"the edit log replaybuf/edit in .* is damaged \(.+\); it was copied to replaybuf/steplog-damaged-.*/edit in",
    ):
        again = ReplayBuffer.from_folder(path)
    with again:
        assert version(again) == OLD
        assert again._meta["_revision"][0] % 2 == 0
    assert verify(path) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_an_edit_refused_by_its_log_changes_nothing(place, monkeypatch):
    """The edit log cannot be written (a full disk): the edit raises StorageError saying it was
    not made, every value stays, no slot is left mid-edit, and the next edit works."""
    from replaybuf.storage import StorageError

    buffer = make(place)
    revisions = buffer._meta["_revision"].copy()

    def full(name, data):
        raise StorageError("writing the edit log failed: [Errno 28] No space left on device")

    monkeypatch.setattr(buffer.storage, "write_record", full)
    with pytest.raises(
        StorageError, match="nothing was written: the edit was not made, the episodes keep their values"
    ):
        update(buffer)
    assert version(buffer) == OLD and (buffer._meta["_revision"] == revisions).all()
    monkeypatch.undo()
    update(buffer)
    assert version(buffer) == NEW
    buffer.close()
    assert verify(place.location) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_records_read_back_as_written_and_any_cut_or_flip_is_caught(tmp_path, data):
    """Random edits encode and parse back equal (a steps write keeps each pair's last value);
    a record cut anywhere, or with a byte flipped anywhere, parses as no edit, and says why."""
    path = str(tmp_path / "h")
    with ReplayBuffer(
        path, max_episodes=5, max_timesteps=6, fields=FIELDS, meta_fields={"uid": "int"}, overwrite=True
    ) as b:
        schema = b.schema
    slots = np.array(sorted(data.draw(st.sets(st.integers(0, 4), min_size=1, max_size=5))))
    writes = []
    for kind in data.draw(st.lists(st.sampled_from(editlog.KINDS), min_size=1, max_size=4)):
        episodes = np.array(data.draw(st.lists(st.sampled_from(slots.tolist()), min_size=1, max_size=6)))
        if kind == "rows":
            t0 = data.draw(st.integers(0, 5))
            steps = data.draw(st.integers(1, 6 - t0))
            values = np.arange(len(episodes) * steps * 3, dtype=np.float32).reshape(len(episodes), steps, 3)
            writes.append(Write("rows", "obs", episodes, values, t0))
        elif kind == "steps":
            at = np.array(data.draw(st.lists(st.integers(0, 5), min_size=len(episodes), max_size=len(episodes))))
            writes.append(Write("steps", "step", episodes, np.arange(len(episodes), dtype=np.int32), at))
        else:
            writes.append(Write("meta", "uid", episodes, np.arange(len(episodes), dtype=np.int64)))
    edit = Edit(slots, slots * 10, slots * 2 + 1, writes)
    record = editlog.encode(edit, schema)
    parsed, damage = editlog.parse(record, schema)
    assert parsed is not None
    assert damage is None and parsed.slots.tolist() == slots.tolist()
    for written, read in zip(writes, parsed.writes):
        assert (written.kind, written.name) == (read.kind, read.name)
        if written.kind == "steps":  # one value per pair, the last given
            last = {
                (e, t): v for e, t, v in zip(written.episodes.tolist(), written.at.tolist(), written.values.tolist())
            }
            assert dict(zip(zip(read.episodes.tolist(), read.at.tolist()), read.values.tolist())) == last
        else:
            np.testing.assert_array_equal(read.episodes, written.episodes)
            np.testing.assert_array_equal(read.values, written.values)
    cut = data.draw(st.integers(0, len(record) - 1))
    assert editlog.parse(record[:cut], schema)[0] is None
    at = data.draw(st.integers(0, len(record) - 1))
    flipped = bytearray(record)
    flipped[at] ^= 1 << data.draw(st.integers(0, 7))
    edit, damage = editlog.parse(bytes(flipped), schema)
    assert edit is None and damage is not None


def test_the_record_s_checksum_covers_its_payload(tmp_path):
    """The framing: magic, payload size, crc32 of the payload (so a torn tail is told from a flip)."""
    with make(Place(str(tmp_path / "b"))) as buffer:
        schema = buffer.schema
    edit = Edit(np.array([0]), np.array([1]), np.array([3]), [Write("meta", "uid", np.array([0]), np.array([5]))])
    record = editlog.encode(edit, schema)
    magic, size, crc = struct.unpack_from("<4sQI", record)
    assert magic == b"RBE1" and size == len(record) - 16 and crc == zlib.crc32(record[16:])


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_killed_writer_s_logged_edit_is_applied_whole_on_object_stores(request, store):
    """The same on S3 (moto) and GCS (the emulator), where the log is one object per append:
    the next writable open applies the logged edit whole and deletes the log's objects."""
    server = request.getfixturevalue(f"{store}_server")
    location = server.url(f"buffers/{uuid.uuid4().hex[:12]}")
    options = server.storage_options
    buffer = make(Place(location, {"storage_options": options}))
    planted(buffer, seven())
    buffer.close()
    with ReplayBuffer.from_folder(location, storage_options=options) as again:
        assert version(again) == NEW and (again._meta["_revision"][:3] % 2 == 0).all()
        assert editlog.read(again.storage, again.schema) == (None, None)
    assert verify(location, storage_options=options) == []


def test_values_equal_for_every_episode_are_stored_once(tmp_path):
    """A broadcast value (``update(None, obs=...)`` over many episodes) is one row in the
    record, not one per episode: the record stays small whatever the number of episodes, and
    reads back as the same value for each."""
    path = str(tmp_path / "b")
    with ReplayBuffer(path, max_episodes=400, max_timesteps=50, fields={"obs": ("float32", (64,))}) as buffer:
        schema = buffer.schema
    episodes = np.arange(400)
    row = np.arange(50 * 64, dtype=np.float32).reshape(50, 64)
    write = Write("rows", "obs", episodes, np.broadcast_to(row, (400, 50, 64)), 0)
    record = editlog.encode(Edit(episodes, episodes + 1, episodes * 2 + 1, [write]), schema)
    assert len(record) < row.nbytes + 400 * 8 * 4 + 4096  # one row, the episodes, the slots' numbers
    edit, damage = editlog.parse(bytes(record), schema)
    assert damage is None and edit is not None
    assert edit.writes[0].values.shape == (400, 50, 64)
    np.testing.assert_array_equal(edit.writes[0].values[399], row)
