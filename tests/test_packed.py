"""Packed small fields (zarr format 3, issue 20): many episodes share one raw chunk written in
place, a crc32c per (field, episode) is written before the length publishes the episode, and
the counters of back-to-back ``store_episode`` calls are batched. A SIGKILL at any write of a
commit loses no committed episode and serves no torn one."""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

from replaybuf import ReplayBuffer, verify

from ._workloads import check_episode, episode, episode_length

FORK = multiprocessing.get_context("fork")
MAX_TIMESTEPS = 24  # as _workloads: episode(uid) fits
FIELDS = {"obs": ("float32", 3), "step": "int32"}  # no chunks/compressor spec: packed
SLOTS = 3


def kwargs() -> dict:
    return dict(
        max_episodes=SLOTS, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields={"uid": "int"}, circular=True
    )


def store(buffer: ReplayBuffer, uid: int) -> None:
    data = episode(uid)
    buffer.store_episode(obs=data["obs"], step=data["step"], uid=uid)


def stored(buffer: ReplayBuffer) -> dict[int, int]:
    """uid -> slot of every committed episode, each checked whole and zero past its length."""
    found = {}
    for slot in buffer.valid_episodes().tolist():
        uid, length = int(buffer.meta_data["uid"][slot]), int(buffer.episode_lens[slot])
        rows = {n: np.asarray(buffer.data[n][slot]) for n in FIELDS}
        check_episode(uid, length, rows)
        found[uid] = slot
    return found


def _kill_at_write(kv, at: int) -> None:
    """SIGKILL this process at the ``at``-th write through ``kv`` (in place or whole objects)."""
    writes = []

    def dying(method):
        def write(*args, **options):
            writes.append(method.__name__)
            if len(writes) == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return method(*args, **options)

        return write

    kv.write_at, kv.set_many = dying(kv.write_at), dying(kv.set_many)


def _die_at_write(location: str, uid: int, at: int) -> None:
    """Child: store episode ``uid``, SIGKILLed at its ``at``-th write to the store (chunk
    creation, in-place rows, checksums, meta, counters)."""
    buffer = ReplayBuffer(location, **kwargs(), overwrite=False)
    _kill_at_write(buffer.storage.kv, at)
    store(buffer, uid)
    os._exit(3)  # the store finished before the at-th write: no kill


def _run(target, *args) -> int:
    child = FORK.Process(target=target, args=args)
    child.start()
    child.join(60)
    return child.exitcode


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused"])
def test_kill_at_every_write_of_a_packed_commit(tmp_path, reuse):
    """Killed at write 1, 2, ... of one store_episode (a fresh slot whose chunk is created, or a
    reused slot of a full circular buffer) until a store runs to its end: every episode read
    after the kill is whole, the killed one is there whole or not at all, verify finds nothing."""
    earlier = [1, 2, 3] if reuse else []
    at = 0
    while True:
        at += 1
        location = str(tmp_path / f"{at}")
        with ReplayBuffer(location, **kwargs()) as buffer:
            for uid in earlier:
                store(buffer, uid)
        code = _run(_die_at_write, location, 7, at)
        if code == 3:
            break
        assert code == -signal.SIGKILL
        reader = ReplayBuffer.from_folder(location, read_only=True)
        found = stored(reader)  # before any writable open: no torn episode is served
        with ReplayBuffer(location, **kwargs(), overwrite=False) as buffer:
            assert stored(buffer) == found
            # uid 7 goes to slot 0, holding uid 1 when reused: 1 stays, or both are gone, or 7 is in
            assert set(found) in (set(earlier), set(earlier) - {1}, set(earlier) - {1} | {7})
            # every slot up to the highest holding an episode is listed (an emptied slot as padding)
            assert buffer.num_episodes == (3 if reuse else len(found))
            store(buffer, 8)
            assert 8 in stored(buffer)
        assert verify(location) == []
    assert at > 5, "a packed commit makes several writes; the loop covered each"


def _store_and_die(location: str, uids: list[int], progress: str) -> None:
    """Child: store ``uids`` back to back (their counters batch), recording each one after
    store_episode returned, then die without closing."""
    buffer = ReplayBuffer(
        location, max_episodes=50, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields={"uid": "int"}
    )
    for uid in uids:
        store(buffer, uid)
        with open(progress, "a") as f:
            f.write(f"{uid}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def test_batched_counters_lose_no_returned_episode(tmp_path):
    location, progress = str(tmp_path / "b"), str(tmp_path / "progress")
    uids = list(range(10, 30))
    assert _run(_store_and_die, location, uids, progress) == -signal.SIGKILL
    returned = [int(line) for line in open(progress)]
    assert returned == uids
    reader = ReplayBuffer.from_folder(location, read_only=True)
    assert sorted(stored(reader)) == uids, "a reader samples every published episode"
    assert reader.num_episodes == len(uids), "a reader catches the stored counters up"
    with ReplayBuffer.from_folder(location) as buffer:  # a writable open reconciles the counters
        assert buffer.num_episodes == len(uids) and sorted(stored(buffer)) == uids
        assert [episode_length(u) for u in uids] == buffer.episode_lens[: len(uids)].tolist()
    assert ReplayBuffer.from_folder(location, read_only=True).num_episodes == len(uids)
    assert verify(location) == []


def test_packed_layout_and_in_place_update(tmp_path):
    """One chunk file per field for all slots; an update in place of a committed episode is
    re-checksummed (it reads back, verify stays clean) and a reader's refresh re-reads it."""
    location = str(tmp_path / "b")
    buffer = ReplayBuffer(location, **kwargs())
    for uid in (1, 2, 3):
        store(buffer, uid)
    assert sorted(os.listdir(os.path.join(location, "data", "obs"))) == ["c.0.0.0", "zarr.json"]
    reader = ReplayBuffer.from_folder(location, read_only=True)
    before = next(iter(reader.dataloader(batch_size=4, fields=["step"])))
    assert before["step"].shape[0] == 3
    length = episode_length(2)
    buffer.update(1, step=np.full(length, -5, np.int32))
    assert np.asarray(buffer.data["step"][1, :length]).tolist() == [-5] * length
    buffer.flush()
    assert verify(location) == []
    reader.refresh()
    assert np.asarray(reader.data["step"][1, :length]).tolist() == [-5] * length
    buffer.close()


def _packed_reader(tmp_path, monkeypatch, count: int) -> ReplayBuffer:
    """A read-only reader of ``count`` stored episodes (uid = slot + 1) packed 8 to a chunk."""
    from replaybuf.storage import _zarr

    monkeypatch.setattr(_zarr, "PACKED_CHUNK_BYTES", 8 * MAX_TIMESTEPS * 12)  # 8 rows of obs f32[3]
    location = str(tmp_path / "b")
    writer = ReplayBuffer(
        location, max_episodes=40, max_timesteps=MAX_TIMESTEPS, fields=FIELDS, meta_fields={"uid": "int"}
    )
    for uid in range(1, count + 1):
        store(writer, uid)
    writer.close()
    return ReplayBuffer.from_folder(location, read_only=True)


def _load(reader: ReplayBuffer, name: str) -> None:
    slots = reader.valid_episodes()
    reader.storage.preload(name, slots, np.asarray(reader.generations)[slots])


def test_first_load_of_a_packed_field_reads_its_files_in_place(tmp_path, monkeypatch):
    """The resident copy of a packed field is read from its chunk files straight into place
    (``KeyValue.get_into``): no chunk is fetched as bytes, and every row, the partly used last
    chunk's included, is the episode stored."""
    reader = _packed_reader(tmp_path, monkeypatch, 37)
    array, kv = reader.storage.array("obs"), reader.storage.kv
    assert array.chunks[0] == 8 and array.packed
    fetched, get_many = [], kv.get_many
    monkeypatch.setattr(kv, "get_many", lambda keys, *limit: fetched.extend(keys) or get_many(keys, *limit))
    for name in FIELDS:
        _load(reader, name)
    assert [k for k in fetched if k.startswith("data/")] == []
    assert len(stored(reader)) == 37
    rows = np.zeros((37, MAX_TIMESTEPS, 3), np.float32)
    for slot in range(37):
        data = episode(slot + 1)["obs"]
        rows[slot, : len(data)] = data
    np.testing.assert_array_equal(array._resident[:37], rows)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_first_load_of_a_damaged_packed_chunk_names_its_slot(tmp_path, monkeypatch, damage):
    """A chunk file of the wrong size, or missing, under committed episodes fails the load
    with CorruptChunkError naming a slot of that chunk, not rows of whatever was read."""
    from replaybuf import CorruptChunkError

    reader = _packed_reader(tmp_path, monkeypatch, 24)
    path = os.path.join(reader.storage.location, "data", "obs", "c.1.0.0")
    if damage == "missing":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CorruptChunkError, match=r"slots? (8|9|1[0-5])\b"):
        _load(reader, "obs")


def test_packed_rows_read_out_of_order_land_where_asked(tmp_path, monkeypatch):
    """Whole rows of one chunk asked in another order than stored (a permuted run spanning as
    many slots as there are rows) are each read into their own row of ``out``."""
    reader = _packed_reader(tmp_path, monkeypatch, 8)
    array = reader.storage.array("obs")
    episodes = np.array([0, 2, 1, 3, 4, 5, 6, 7])  # first and last in place: spans 8 slots
    out = np.empty((8, MAX_TIMESTEPS, 3), np.float32)
    array.read_into(out, episodes, np.zeros(8, np.int64), np.full(8, MAX_TIMESTEPS))
    np.testing.assert_array_equal(out, np.asarray(reader.data["obs"][:8])[episodes])


def test_a_row_torn_on_its_first_read_is_kept_as_read_again(tmp_path, monkeypatch):
    """A row failing its crc32c on the load (a writer rewriting it meanwhile) is read again,
    and that second read, not the torn one, is what the resident copy keeps."""
    reader = _packed_reader(tmp_path, monkeypatch, 16)
    kv, get_into, calls = reader.storage.kv, reader.storage.kv.get_into, []

    def torn_once(requests):
        sizes = get_into(requests)
        if not calls:
            requests[0][2][:4] = b"\xff\xff\xff\xff"  # slot 0, step 0: as if mid-rewrite
        calls.append(len(requests))
        return sizes

    monkeypatch.setattr(kv, "get_into", torn_once)
    _load(reader, "obs")
    assert len(calls) == 2  # the load, then slot 0 again
    np.testing.assert_array_equal(reader.storage.array("obs")._resident[0, : episode_length(1)], episode(1)["obs"])


EDITED = [(0, 1), (2, 0), (0, 3), (2, 2), (1, 4)]  # (slot, step) pairs of one update_priorities


def _die_in_edit(location: str, at: int) -> None:
    """Child: set new priorities at ``EDITED`` in one call, SIGKILLed at its ``at``-th write to
    the store (revision, rows in place, checksums)."""
    from replaybuf.sampling import update_priorities

    buffer = ReplayBuffer.from_folder(location)
    _kill_at_write(buffer.storage.kv, at)
    update_priorities(buffer, EDITED, [100.0 + k for k in range(len(EDITED))])
    os._exit(3)


def test_kill_at_every_write_of_a_scattered_edit(tmp_path):
    """Killed at write 1, 2, ... of one ``update_priorities`` until it runs to its end: the next
    writable open closes the revisions left odd and reseals the rows, every edited step holds its
    old or its new value, the other steps their old ones, and verify finds nothing."""
    at = 0
    while True:
        at += 1
        location = str(tmp_path / f"{at}")
        with ReplayBuffer(location, **{**kwargs(), "fields": {**FIELDS, "priority": "float32"}}) as buffer:
            for slot in range(SLOTS):
                buffer.store_episode(
                    obs=np.zeros((5, 3)), step=np.arange(5), priority=np.arange(5) + 10.0 * slot, uid=slot
                )
        code = _run(_die_in_edit, location, at)
        if code == 3:
            break
        assert code == -signal.SIGKILL
        with ReplayBuffer.from_folder(location) as buffer:
            assert (buffer._meta["_revision"] % 2 == 0).all()
            rows = np.asarray(buffer.data["priority"][:, :5])
        old = np.arange(5) + 10.0 * np.arange(SLOTS)[:, None]
        new = old.copy()
        for k, (slot, step) in enumerate(EDITED):
            new[slot, step] = 100.0 + k
        assert ((rows == old) | (rows == new)).all(), rows
        assert verify(location) == []
    assert at > 3, "an edit writes its revisions, rows and checksums; the loop covered each"
