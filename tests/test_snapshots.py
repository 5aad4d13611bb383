"""Named snapshots: a view reads exactly the recorded episodes after the writer moved on; the
writer refuses, before writing anything, to overwrite, clear or drop a held episode; snapshot
files survive kills whole or not at all, and damaged ones are named in the error."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ReplayBuffer, SnapshotError, SnapshotHeldError, read_episodes_consistent
from replaybuf.snapshots import key

from ._backends import BACKENDS, make_place, snapshot

pytest_plugins = ["tests._servers"]  # fixture: s3_server

FORK = multiprocessing.get_context("fork")
FIELDS = {"obs": ("float", (2,)), "reward": "float"}
META = {"uid": "int"}


def episode(uid: int) -> dict:
    length = 3 + uid % 4
    return {"obs": np.full((length, 2), uid, np.float32), "reward": np.arange(length, dtype=np.float32) + uid}


def make(location, max_episodes=5, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(
        location, max_episodes=max_episodes, max_timesteps=8, fields=FIELDS, meta_fields=META, circular=True, **kwargs
    )


def write(buffer: ReplayBuffer, uids) -> None:
    for uid in uids:
        buffer.store_episode(**episode(uid), uid=uid)


def uids_of(view: ReplayBuffer) -> dict[int, int]:
    """slot -> uid of every episode the view reads, checked against its data as ``data[...]``
    and ``get_all_data`` (rows ``0 .. num_episodes - 1``) read it."""
    data = view.get_all_data()
    rewards = view.data["reward"][:]
    out = {}
    for slot in view.valid_episodes().tolist():
        uid = int(view.meta_data["uid"][slot])
        length = int(view.episode_lens[slot])
        np.testing.assert_array_equal(rewards[slot, :length], episode(uid)["reward"])
        if slot < len(data["uid"]):
            assert int(data["uid"][slot]) == uid and int(data["episode_lens"][slot]) == length
            np.testing.assert_array_equal(data["reward"][slot, :length].numpy(), episode(uid)["reward"])
        out[slot] = uid
    assert set(np.flatnonzero(rewards.any(axis=1)).tolist()) <= set(out), "other slots read as padding"
    return out


def held_by_loader(view: ReplayBuffer) -> set[int]:
    """The uids one epoch of a trajectory loader yields."""
    seen = set()
    for batch in view.dataloader(batch_size=2, return_indices=True):
        seen.update(int(u) for u in view.meta_data["uid"][batch["_index"].numpy()])
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_view_reads_exactly_the_snapshot_across_a_wrap(tmp_path, backend):
    place = make_place(backend, tmp_path)
    writer = make(place.location, max_episodes=6, **place.kwargs)
    write(writer, range(8))  # wrapped: slots 0, 1 hold uids 6, 7
    writer.drop_episodes([3])  # a free slot for the writer to append into after the snapshot
    writer.snapshot("run-1")
    expected = {0: 6, 1: 7, 2: 2, 4: 4, 5: 5}
    with pytest.raises(SnapshotHeldError, match="cannot overwrite slot 2"):
        write(writer, [100])
    writer.episode_index = 3
    write(writer, [100])  # appended into the free slot
    with pytest.raises(SnapshotHeldError, match="cannot overwrite slot 4"):
        write(writer, [101])
    assert writer.snapshots() == ["run-1"]
    view = ReplayBuffer.from_folder(place.location, snapshot="run-1", **place.kwargs)
    assert view.read_only and view.num_episodes == 6 and writer.num_episodes == 6  # slot 3: padding
    assert uids_of(view) == expected, "the view shows the recorded set, not the appended episode"
    assert held_by_loader(view) == set(expected.values())
    assert view.stats()["reward"].count == sum(len(episode(u)["reward"]) for u in expected.values())
    view.refresh()
    assert uids_of(view) == expected
    del writer, view


def test_refused_overwrite_changes_nothing(tmp_path):
    location = str(tmp_path / "b")
    writer = make(location)
    write(writer, range(7))  # wrapped twice over slots 0, 1
    writer.snapshot("pinned")
    writer.flush()
    before = snapshot(location)
    for attempt in (
        lambda: writer.store_episode(**episode(50), uid=50),
        lambda: writer.store(obs=np.zeros(2), reward=1.0),
        lambda: writer.advance_episode(batch_size=2),
        lambda: writer.clear(),
        lambda: writer.drop_episodes([4]),
    ):
        with pytest.raises(
            SnapshotHeldError, match=r"slot \d of .*held by snapshot\(s\) \['pinned'\].*nothing was written"
        ):
            attempt()
    assert snapshot(location) == before, "a refused write wrote nothing"
    assert writer.timestep_index == 0 and writer.episode_index == 2
    writer.drop_snapshot("pinned")
    write(writer, [50])
    assert writer.meta_data["uid"][2] == 50


def test_moving_a_meta_only_group_onto_a_held_slot_is_refused(tmp_path):
    writer = make(str(tmp_path / "b"))
    write(writer, range(2))
    writer.snapshot("s")
    writer.store_meta_batch(uid=np.array([8, 9]))  # two episodes with only meta set: slots 2, 3
    with pytest.raises(SnapshotHeldError, match="cannot overwrite slot 0"):
        writer.episode_index = 4  # would move them onto slots 4 and 0
    assert writer.episode_index == 2 and writer._state["episode_index"] == 2
    writer.episode_index = 3
    writer.store_batch(obs=np.ones((2, 2)), reward=np.ones(2))
    writer.advance_episode()
    assert writer.meta_data["uid"][[3, 4]].tolist() == [8, 9]
    assert uids_of(ReplayBuffer.from_folder(writer.folder, snapshot="s")) == {0: 0, 1: 1}


def test_drop_snapshots_on_overwrite(tmp_path):
    location = str(tmp_path / "b")
    writer = make(location, max_episodes=3)
    write(writer, range(3))
    writer.snapshot("a")
    writer.snapshot("b")
    writer.drop_snapshot("a")
    with pytest.raises(SnapshotHeldError, match=r"held by snapshot\(s\) \['b'\]"):
        write(writer, [10])
    writer.snapshot("a")
    writer.close()
    writer = ReplayBuffer.from_folder(location, drop_snapshots_on_overwrite=True)
    with pytest.warns(UserWarning, match=r"snapshot\(s\) \['a', 'b'\] .* dropped: overwrite of slot\(s\) \[0\]"):
        write(writer, [10])
    assert writer.snapshots() == []
    with pytest.raises(SnapshotError, match="no snapshot 'a'"):
        ReplayBuffer.from_folder(location, snapshot="a")


def test_a_view_of_an_overwritten_snapshot_is_refused(tmp_path):
    location = str(tmp_path / "b")
    writer = make(location, max_episodes=3)
    write(writer, range(3))
    writer.snapshot("a")
    writer.close()
    view = ReplayBuffer.from_folder(location, snapshot="a")
    writer = ReplayBuffer.from_folder(location, drop_snapshots_on_overwrite=True)
    with pytest.warns(UserWarning, match="dropped"):
        write(writer, [10])
    with pytest.raises(SnapshotError, match=r"snapshot 'a' of .*: slot 0 holds generation 4 .*recorded generation 1"):
        view.refresh()


@pytest.mark.parametrize("concat", [False, True])
def test_an_open_view_never_reads_a_reused_slot(tmp_path, concat):
    """A view opened before its snapshot was dropped and a slot reused raises on every read path
    (it used to return the new episode from get_all_data and episode_frames, and leave it out of
    stats), and reads as before while its episodes stay."""
    location = str(tmp_path / "b")
    writer = make(location, max_episodes=3)
    write(writer, range(3))
    writer.snapshot("a")
    view = ReplayBuffer.from_folder(location, snapshot="a")
    if concat:
        view = ConcatReplayBuffer([view])
    reads = {
        "get_all_data": lambda: view.get_all_data()["reward"],
        "get_all_data lazy": lambda: view.get_all_data(lazy=True)["reward"].compute(),
        "to_dask": lambda: view.to_dask()["reward"].compute(),
        "stats": lambda: view.stats(["reward"])["reward"].mean,
        "stats exact": lambda: view.stats(["reward"], exact=True)["reward"].mean,
        "data": lambda: view.data["reward"][0],
        "episode": lambda: read_episodes_consistent(view, [0], ["reward"]).data["reward"],
    }
    before = {name: np.asarray(read()) for name, read in reads.items()}
    writer.drop_snapshot("a")
    write(writer, [10])  # reuses slot 0
    for read in reads.values():
        with pytest.raises(SnapshotError, match=r"snapshot 'a' of .*slot\(s\) \[0\] were overwritten or dropped"):
            read()
    assert before["episode"][0, 0] == 0.0 and before["get_all_data"][:, 0].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_overwrite_true_refuses_held_snapshots_and_erases_them_when_asked(tmp_path, backend):
    """overwrite=True (the default) erased the episodes and left the snapshots behind, naming
    slots and generations the new buffer counts again from 1: refused while they hold episodes,
    and erased with the buffer under drop_snapshots_on_overwrite=True."""
    place = make_place(backend, tmp_path)
    writer = make(place.location, **place.kwargs)
    writer.snapshot("empty")  # holds no episode
    write(writer, range(2))
    writer.snapshot("a")
    writer.close()
    before = snapshot(place.location)
    with pytest.raises(SnapshotHeldError, match=r"overwrite=True would erase .* held by snapshot\(s\) \['a'\]"):
        make(place.location, **place.kwargs)
    assert snapshot(place.location) == before, "a refused overwrite wrote nothing"
    with pytest.warns(UserWarning, match=r"snapshot\(s\) \['a'\] .* dropped: overwrite=True erased"):
        writer = make(place.location, drop_snapshots_on_overwrite=True, **place.kwargs)
    assert writer.snapshots() == [] and len(writer) == 0
    write(writer, range(2))  # the same slots, generations and lengths as the dropped 'a' recorded
    with pytest.raises(SnapshotError, match="no snapshot 'a'"):
        ReplayBuffer.from_folder(place.location, snapshot="a", **place.kwargs)
    writer.snapshot("b")
    writer.drop_snapshot("b")
    writer.close()
    make(place.location, **place.kwargs).close()  # no snapshot left: overwrite as before


def test_names_and_misuse(tmp_path):
    location = str(tmp_path / "b")
    writer = make(location)
    write(writer, range(2))
    for bad in ("", "../up", "a/b", "a\\b", ".hidden", "x" * 129, None, 3):
        with pytest.raises(SnapshotError, match="invalid snapshot name"):
            writer.snapshot(bad)
    writer.snapshot("x" * 128)
    writer.snapshot("v1.2_final")
    with pytest.raises(SnapshotError, match="'v1.2_final' already exists"):
        writer.snapshot("v1.2_final")
    assert writer.snapshots() == sorted(["x" * 128, "v1.2_final"])
    with pytest.raises(SnapshotError, match=r"no snapshot 'nope' .* snapshots: \['v1.2_final'"):
        ReplayBuffer.from_folder(location, snapshot="nope")
    with pytest.raises(SnapshotError, match="no snapshot 'nope'"):
        writer.drop_snapshot("nope")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    with pytest.raises(ValueError, match="cannot call `snapshot` on a buffer opened read-only"):
        reader.snapshot("r")
    with pytest.raises(ValueError, match="cannot call `drop_snapshot`"):
        reader.drop_snapshot("v1.2_final")
    writer.drop_snapshot("x" * 128)
    assert writer.snapshots() == ["v1.2_final"]


def test_a_folder_no_snapshot_could_write_holds_nothing(tmp_path):
    """A copy of a snapshot under a name snapshot() refuses (or one level deeper) made every
    overwrite fail with 'invalid snapshot name' (or 'no snapshot'), and drop_snapshot could not
    remove it; it is not a snapshot: not listed, holding nothing, left where it is."""
    location = tmp_path / "b"
    writer = make(str(location), max_episodes=2)
    write(writer, range(2))
    writer.snapshot("good")
    folder = location / "replaybuf" / "snapshots"
    for copy in ("bad name", "a/b"):
        (folder / copy).mkdir(parents=True)
        (folder / copy / "snapshot.json").write_bytes((folder / "good" / "snapshot.json").read_bytes())
    assert writer.snapshots() == ["good"]
    with pytest.raises(SnapshotHeldError, match=r"held by snapshot\(s\) \['good'\]"):
        write(writer, [2])
    writer.drop_snapshot("good")
    write(writer, [2])
    assert uids_of(ReplayBuffer.from_folder(str(location), read_only=True)) == {0: 2, 1: 1}
    assert sorted(p.name for p in folder.iterdir()) == ["a", "bad name"]


def test_snapshot_refused_while_an_episode_in_progress_reuses_a_slot(tmp_path):
    writer = make(str(tmp_path / "b"), max_episodes=2)
    write(writer, range(2))
    writer.store(obs=np.zeros(2), reward=0.0)  # reuses slot 0
    with pytest.raises(SnapshotError, match=r"in progress will overwrite the committed episode\(s\) in slots \[0\]"):
        writer.snapshot("s")
    writer.advance_episode()
    writer.snapshot("s")


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\x00garbage", "Expecting value|Unicode|JSON"),
        (b"[1, 2]", "expected a JSON object with format 1"),
        (b"[" * 5000 + b"]" * 5000, "recursion"),  # raised RecursionError
        (json.dumps({"format": 1, "name": "other"}).encode(), "it names snapshot 'other'"),
        (
            json.dumps({"format": 1, "name": "s", "slots": [0, 99], "generations": [1, 2], "lengths": [1, 1]}).encode(),
            r"'slots' must be a list of ints in \[0, 5\)",
        ),
        (
            json.dumps({"format": 1, "name": "s", "slots": [0], "generations": [1], "lengths": [10**12]}).encode(),
            r"'lengths' must be a list of ints in \[1, 9\)",
        ),
        (
            json.dumps(
                {
                    "format": 1,
                    "name": "s",
                    "slots": [1, 0],
                    "generations": [1, 2],
                    "lengths": [1, 1],
                    "state": {"num_episodes": 2, "episode_index": 2, "total_episodes": 2},
                    "created": 0,
                }
            ).encode(),
            "not distinct and ascending",
        ),
    ],
    ids=["garbage", "list", "deep", "other-name", "slot-range", "length-range", "unsorted"],
)
def test_damaged_snapshot_file_is_named(tmp_path, content, problem):
    location = str(tmp_path / "b")
    writer = make(location)
    write(writer, range(5))
    writer.storage.write_blob(key("s"), content)
    where = r"snapshot 's' is damaged \(replaybuf/snapshots/s/snapshot.json in .*b\): "
    with pytest.raises(SnapshotError, match=where + f"(.*)({problem})"):
        ReplayBuffer.from_folder(location, snapshot="s")
    with pytest.raises(SnapshotError, match=where):  # the writer cannot tell what it holds
        write(writer, [5])
    assert writer.num_episodes == 5 and writer.episode_index == 0
    writer.drop_snapshot("s")  # a damaged snapshot can still be dropped
    write(writer, [5])


def _snapshot_forever(location: str, run: int) -> None:
    writer = ReplayBuffer.from_folder(location)
    for i in range(10**6):
        writer.snapshot(f"r{run}-{i}")
        if i >= 2:
            writer.drop_snapshot(f"r{run}-{i - 2}")


def _refuse_forever(location: str, run: int) -> None:
    writer = ReplayBuffer.from_folder(location)
    for _ in range(10**6):
        try:
            writer.store_episode(**episode(99), uid=99)
        except SnapshotHeldError:
            pass


@pytest.mark.parametrize("target", [_snapshot_forever, _refuse_forever])
def test_sigkill(tmp_path, target):
    location = str(tmp_path / "b")
    writer = make(location, max_episodes=4)
    write(writer, range(6))
    writer.snapshot("keep")
    writer.close()
    expected = uids_of(ReplayBuffer.from_folder(location, snapshot="keep"))
    rng = np.random.default_rng(0)
    for run in range(3):
        child = FORK.Process(target=target, args=(location, run))
        child.start()
        time.sleep(0.3 + float(rng.uniform(0, 0.2)))
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        reopened = ReplayBuffer.from_folder(location)
        for name in reopened.snapshots():  # each is whole: it opens and reads its episodes
            assert uids_of(ReplayBuffer.from_folder(location, snapshot=name)) == expected
        assert uids_of(ReplayBuffer.from_folder(location, snapshot="keep")) == expected
        assert uids_of(reopened) == expected
        reopened.close()


def test_second_writer_process_honors_snapshots(tmp_path):
    location = str(tmp_path / "b")
    writer = make(location, max_episodes=3)
    write(writer, range(3))
    writer.snapshot("from-first")
    writer.close()
    code = (
        "import numpy as np, sys\n"
        "from replaybuf import ReplayBuffer, SnapshotHeldError\n"
        "w = ReplayBuffer.from_folder(sys.argv[1])\n"
        "try:\n"
        "    w.store_episode(obs=np.zeros((2, 2)), reward=np.zeros(2), uid=7)\n"
        "except SnapshotHeldError as e:\n"
        "    print('refused:', e)\n"
        "w.drop_snapshot('from-first')\n"
        "w.store_episode(obs=np.full((6, 2), 7.0), reward=np.arange(6.0) + 7, uid=7)\n"
        "w.snapshot('from-second')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code, location], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: cannot overwrite slot 0" in done.stdout
    view = ReplayBuffer.from_folder(location, snapshot="from-second")
    assert uids_of(view) == {0: 7, 1: 1, 2: 2}


def test_on_s3(s3_server):
    location = s3_server.url("snapshots-test")
    options = s3_server.storage_options
    writer = make(location, max_episodes=3, storage_options=options)
    write(writer, range(4))
    writer.snapshot("remote")
    with pytest.raises(SnapshotHeldError, match="held by snapshot"):
        write(writer, [9])
    view = ReplayBuffer.from_folder(location, snapshot="remote", storage_options=options)
    assert uids_of(view) == {0: 3, 1: 1, 2: 2}
    writer.drop_snapshot("remote")
    write(writer, [9])
    assert ReplayBuffer.from_folder(location, storage_options=options).snapshots() == []
    writer.close()


def test_concat_of_shards_at_one_snapshot(tmp_path):
    for shard in range(2):
        with ReplayBuffer.shard(tmp_path / "root", shard, max_episodes=8, max_timesteps=4, fields={"x": "float"}) as b:
            for i in range(3):
                b.store_episode(x=np.full(2, 10 * shard + i, np.float32))
            b.snapshot("frozen")
            b.store_episode(x=np.full(2, 99, np.float32))  # after the snapshot: not in it
    frozen = ConcatReplayBuffer(tmp_path / "root", snapshot="frozen")
    assert len(frozen) == 6
    assert sorted(frozen.get_all_data()["x"][:, 0].tolist()) == [0, 1, 2, 10, 11, 12]
    assert len(ConcatReplayBuffer(tmp_path / "root")) == 8
    with pytest.raises(SnapshotError, match="no snapshot 'other'"):
        ConcatReplayBuffer(tmp_path / "root", snapshot="other")
    whole = ReplayBuffer.from_folder(frozen.folder[0], read_only=True)
    with pytest.raises(ValueError, match="is the whole buffer"):
        ConcatReplayBuffer([whole], snapshot="frozen")


def test_a_cached_snapshot_view_serves_in_place_edits_and_convert_keeps_revisions(tmp_path):
    """Snapshots pin episodes, not values: a cached view reads an edited episode's new rows after
    ``refresh()``; ``convert`` copies the revisions with the snapshots."""
    from replaybuf.maintenance import convert

    writer = make(tmp_path / "buf")
    write(writer, range(3))
    writer.snapshot("a")
    view = ReplayBuffer.from_folder(tmp_path / "buf", snapshot="a", cache="disk", cache_dir=tmp_path / "cache")
    assert uids_of(view) == {0: 0, 1: 1, 2: 2}  # every episode now cached
    writer.update([1], reward=np.full((1, 4), 9.0))
    writer.flush()
    view.refresh()
    assert view.data["reward"][1, :4].tolist() == [9.0] * 4
    assert view.get_all_data()["reward"][1, :4].tolist() == [9.0] * 4
    revisions = writer._meta["_revision"][:3].copy()
    writer.close()
    convert(str(tmp_path / "buf"), str(tmp_path / "copy"), backend="memmap", progress=False)
    copy = ReplayBuffer.from_folder(tmp_path / "copy", snapshot="a")
    assert copy._meta["_revision"][:3].tolist() == revisions.tolist()
    assert copy.data["reward"][1, :4].tolist() == [9.0] * 4


def test_info_lists_the_snapshots(tmp_path):
    """`replaybuf info` listed attrs but not snapshots, which block overwrites and clear()."""
    from replaybuf.maintenance import format_info, info

    buffer = make(tmp_path / "b")
    buffer.store_episode(**episode(0))
    assert info(tmp_path / "b")["snapshots"] == [] and "\nsnapshots " not in format_info(info(tmp_path / "b"))
    buffer.snapshot("run-2")
    buffer.snapshot("run-1")
    facts = info(tmp_path / "b")
    assert facts["snapshots"] == ["run-1", "run-2"]
    assert "snapshots  run-1, run-2" in format_info(facts)


def test_a_view_refused_by_refresh_keeps_its_snapshot_never_the_new_episodes(tmp_path):
    """README (Named snapshots): a view whose episodes were overwritten raises SnapshotError on
    its next read, never returning the new episodes. A refused ``refresh()`` (also run by
    ``dataloader()``) kept the bookkeeping it had loaded, so the next ``get_all_data`` and
    ``stats`` returned the episode that overwrote the snapshot's."""
    writer = ReplayBuffer(tmp_path / "b", 2, 3, fields={"x": "float"}, circular=True)
    writer.store_episode(x=np.ones(2))
    writer.store_episode(x=np.full(2, 2.0))
    writer.snapshot("s")
    view = ReplayBuffer.from_folder(tmp_path / "b", snapshot="s")
    writer.drop_snapshot("s")
    writer.store_episode(x=np.full(2, 3.0))  # slot 0's episode of the snapshot overwritten
    with pytest.raises(SnapshotError):
        view.refresh()
    assert np.asarray(view.generations).tolist() == [1, 2]
    for read in (view.get_all_data, view.stats):
        with pytest.raises(SnapshotError):
            read()
    writer.close()
