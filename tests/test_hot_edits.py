"""Where in-place edits meet the hot tier, its compaction and the read cache: a reader in another
process (``cache='disk'``) never keeps or serves the rows from before an edit once it has
refreshed, whether the edited shard stays hot, is compacted, or was written compressed."""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ReplayBuffer
from replaybuf.maintenance import verify
from replaybuf.storage import ConcurrentWriteError

from .test_hot_tier import STEPS, WAIT_S, hot_slots, wait_for

FORK = multiprocessing.get_context("fork")
FIELDS = {"image": ("uint8", (40, 40, 3)), "state": ("float", 4)}  # image: sharded, written hot


def episode(value: int) -> dict[str, np.ndarray]:
    """An episode whose every row holds ``value``."""
    return {
        "image": np.full((STEPS, 40, 40, 3), value, np.uint8),
        "state": np.full((STEPS, 4), value, np.float32),
    }


def _cached_reader(location: str, conn) -> None:
    """Child: a ``cache='disk'`` reader answering the parent's requests: ``(field, slot)`` -> the
    first value of that episode's rows, ``'refresh'`` -> 'ok', None -> exit."""
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=location + "-cache")
    while (request := conn.recv()) is not None:
        try:
            if request == "refresh":
                reader.refresh()
                conn.send("ok")
            else:
                field, slot = request
                conn.send(int(np.asarray(reader.data[field][slot]).reshape(-1)[0]))
        except Exception as e:  # noqa: BLE001 - told to the parent, which fails the test
            conn.send(repr(e))


def cache_files_of(location: str, field: str, slot: int) -> dict[str, int]:
    """File name -> first value of every cache file of ``field``'s rows in ``slot``."""
    dtype = np.dtype(FIELDS[field][0] if FIELDS[field][0] != "float" else np.float32)
    found = {}
    for path in glob.glob(os.path.join(location + "-cache", "*", field, f"{slot}-*.rows")):
        with open(path, "rb") as f:
            found[os.path.basename(path)] = int(np.frombuffer(f.read(dtype.itemsize), dtype)[0])
    return found


@pytest.mark.parametrize("compact", [False, True], ids=["hot", "compacted"])
@pytest.mark.parametrize("hot_bytes", [1 << 30, 0], ids=["tier", "no-tier"])
@pytest.mark.parametrize("field, other", [("image", "state"), ("state", "image")], ids=["shards", "chunks"])
def test_a_cached_reader_never_fills_the_new_revision_with_rows_from_before_the_edit(
    tmp_path, compact, hot_bytes, field, other
):
    """A reader that read an episode before an edit keeps a copy of its rows keyed by the
    episode's generation (decoded chunks, shard index, open file, hot map), which an edit in
    place does not change. A read of another field of the slot then teaches its cache the new
    revision; the next fill of the first field at that revision must read the rows as stored,
    not that copy: else the old rows are published under the new revision, and served after
    every refresh, to every process sharing the cache."""
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(location, max_episodes=4, max_timesteps=STEPS, fields=FIELDS, hot_bytes=hot_bytes)
    for value in range(4):
        writer.store_episode(**episode(value))
    writer.flush()
    parent, child_end = FORK.Pipe()
    child = FORK.Process(target=_cached_reader, args=(location, child_end))
    child.start()

    def ask(request):
        parent.send(request)
        assert parent.poll(WAIT_S)
        return parent.recv()

    try:
        assert ask((field, 1)) == 1  # cached at the revision of the commit
        writer.update([1], **{name: values[None] for name, values in episode(9).items()})
        if compact:
            writer.compact()
        assert ask((other, 1)) == 9  # a read of the slot past its known revision
        ask((field, 1))  # before a refresh: old or new rows
        assert ask("refresh") == "ok"
        assert ask((field, 1)) == 9
        assert ask((other, 1)) == 9
        revision = int(writer._meta["_revision"][1])
        files = cache_files_of(location, field, 1)
        assert all(value == 9 for name, value in files.items() if name.endswith(f"-{revision}.rows")), files
    finally:
        parent.send(None)
        child.join(WAIT_S)
    writer.close()
    assert verify(location) == []


def test_edits_rewriting_compacted_episodes_hot_are_compacted_past_hot_bytes(tmp_path):
    """An edit rewrites a compacted episode's shard hot (raw): a pass editing every episode (a
    relabelling) without committing any must still have the background thread compact them
    once their bytes exceed ``hot_bytes``, not leave the whole buffer raw until close()."""
    episode_bytes = STEPS * 40 * 40 * 3
    writer = ReplayBuffer(
        str(tmp_path / "buffer"), max_episodes=8, max_timesteps=STEPS, fields=FIELDS, hot_bytes=2 * episode_bytes
    )
    for value in range(8):
        writer.store_episode(**episode(value))
    writer.compact()
    assert hot_slots(writer) == []
    for slot in range(8):
        writer.update([slot], image=episode(50 + slot)["image"][None])
    tier = writer.storage._hot
    wait_for(lambda: tier.committed_bytes() <= 2 * episode_bytes and not tier.busy)
    assert sum(writer.storage.hot_shards(writer.valid_episodes()).values()) <= 2 * episode_bytes
    assert [int(writer.data["image"][slot][0, 0, 0, 0]) for slot in range(8)] == [50 + slot for slot in range(8)]
    writer.close()
    assert verify(str(tmp_path / "buffer")) == []


EDITED = [0, 1, 2]


def _edit_and_compact_until_killed(location: str, at: int, hot_first: bool) -> None:
    """Child: edit episodes ``EDITED`` (image and state to 9), compact, edit steps 2-4 of
    episode 1's image to 11, compact, SIGKILLed at its ``at``-th store write (a rename of a
    shard, a meta chunk written in place, the edit log); exit code 3 if never reached. With
    ``hot_first`` the episodes are hot before (an edit of this writer rewrote them raw)."""
    writer = ReplayBuffer.from_folder(location)
    if hot_first:
        writer.update(EDITED, image=np.full((len(EDITED), STEPS, 40, 40, 3), 5, np.uint8))
    calls = 0
    kv = type(writer.storage.kv)

    def dying(write):
        def counted(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return write(*args, **kwargs)

        return counted

    for name in ("set_many", "write_at", "delete_many", "append"):
        setattr(kv, name, dying(getattr(kv, name)))
    writer.update(EDITED, **{name: np.repeat(values[None], len(EDITED), 0) for name, values in episode(9).items()})
    writer.compact()
    writer.data["image"][1, 2:5] = np.full((3, 40, 40, 3), 11, np.uint8)
    writer.compact()
    os._exit(3)


def all_rows(buffer: ReplayBuffer) -> dict[str, np.ndarray]:
    return {name: np.asarray(values) for name, values in buffer.get_all_data(fields=list(FIELDS)).items()}


@pytest.mark.parametrize("hot_first", [False, True], ids=["compacted", "hot"])
@pytest.mark.parametrize("at", range(1, 17))
def test_a_writer_killed_editing_and_compacting_leaves_each_edit_whole_and_caches_true(tmp_path, at, hot_first):
    """A writer SIGKILLed anywhere in an edit of hot (or compacted) episodes, their compaction,
    a partial edit and its compaction: after the writable reopen each edit is all applied or
    not at all (every step of image and state of every episode), verify is clean, and a
    ``cache='disk'`` reader that cached the rows before serves exactly those after refresh()."""
    location = str(tmp_path / "buffer")
    with ReplayBuffer(location, max_episodes=4, max_timesteps=STEPS, fields=FIELDS) as writer:
        for value in range(4):
            writer.store_episode(**episode(value))
    cache = dict(read_only=True, cache="disk", cache_dir=location + "-cache")
    reader = ReplayBuffer.from_folder(location, **cache)
    all_rows(reader)  # every episode cached
    child = FORK.Process(target=_edit_and_compact_until_killed, args=(location, at, hot_first))
    child.start()
    child.join(WAIT_S)
    if child.exitcode == 3:
        pytest.skip(f"the calls made fewer than {at} store writes")
    assert child.exitcode == -signal.SIGKILL
    ReplayBuffer.from_folder(location).close()
    found = all_rows(ReplayBuffer.from_folder(location, read_only=True))
    before = 5 if hot_first else None
    first = {(int(found["image"][e, 0, 0, 0, 0]) in (9, 11), int(found["state"][e, 0, 0]) == 9) for e in EDITED}
    assert len({done for pair in first for done in pair}) == 1, f"the first edit is half applied: {first}"
    for e in range(4):
        steps = [set(np.unique(found["image"][e, t]).tolist()) for t in range(STEPS)]
        assert all(len(values) == 1 for values in steps), f"episode {e}: a frame torn within"
        old = (before if before is not None and e in EDITED else e, 9 if e in EDITED else e)
        if e == 1 and {11} in steps:  # the second edit: steps 2-4 of its image, whole
            assert [values.pop() for values in steps] == [9, 9, 11, 11, 11] + [9] * (STEPS - 5)
        else:
            assert len(set().union(*steps)) == 1 and steps[0].pop() in old
        assert len(np.unique(found["state"][e])) == 1
    assert verify(location) == []
    reader.refresh()
    for name, values in all_rows(reader).items():
        np.testing.assert_array_equal(values, found[name], err_msg=f"{name}: the cached reader after refresh()")
    for name, values in all_rows(ReplayBuffer.from_folder(location, **cache)).items():
        np.testing.assert_array_equal(values, found[name], err_msg=f"{name}: a new cached reader")


def _read_beside_the_writer(location: str, cache: str | None, stop, results) -> None:
    """Child: read every episode's image and state (refreshing every other pass) until told to
    stop; report each frame or state row that is no whole version, and any error but a
    retryable ConcurrentWriteError."""
    options = {"cache": cache, "cache_dir": location + "-cache"} if cache else {}
    reader = ReplayBuffer.from_folder(location, read_only=True, **options)
    problems, reads, passes = [], 0, 0
    try:
        while not stop.is_set() or passes < 2:
            passes += 1
            if passes % 2:
                reader.refresh()
            for slot in range(4):
                try:
                    image, state = np.asarray(reader.data["image"][slot]), np.asarray(reader.data["state"][slot])
                except ConcurrentWriteError:
                    continue
                reads += 1
                frames = image.reshape(STEPS, -1)
                if (frames != frames[:, :1]).any() or (state != state[:, :1]).any():
                    problems.append(f"slot {slot}: a frame or state row mixes versions")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        problems.append(repr(e))
    results.put((problems, reads))


@pytest.mark.parametrize("cache", [None, "disk"])
def test_readers_beside_a_writer_editing_and_compacting_the_same_slots_read_whole_versions(tmp_path, cache):
    """A writer loops edits of slots 0-2 (whole episodes, a few steps, single steps) and
    compact() of them, while a reader in another process reads them: every read returns whole
    versions per step (or raises ConcurrentWriteError, retryable), never a damage error."""
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(location, max_episodes=4, max_timesteps=STEPS, fields=FIELDS)
    for value in range(4):
        writer.store_episode(**episode(value))
    writer.flush()
    stop, results = FORK.Event(), FORK.Queue()
    child = FORK.Process(target=_read_beside_the_writer, args=(location, cache, stop, results))
    child.start()
    try:
        for k in range(10, 130):
            if k % 3 == 0:
                writer.update([0, 1, 2], **{n: np.repeat(v[None], 3, 0) for n, v in episode(k).items()})
            elif k % 3 == 1:
                writer.data["image"][1, 3:9] = k
            else:
                writer.update_steps(np.array([0, 2, 2]), np.array([4, 1, 15]), image=k, state=float(k))
            if k % 2:
                writer.compact()
    finally:
        stop.set()
        problems, reads = results.get(timeout=WAIT_S)
        child.join(WAIT_S)
    writer.close()
    assert not problems, problems[:5]
    assert reads > 0


def test_a_concatenated_buffer_forgets_the_rows_of_each_member_s_own_slots(tmp_path, monkeypatch):
    """A loader's read cache over a ConcatReplayBuffer fills through its ConcatStorage: the
    forgetting before a fill (``drop_cached_rows``) reaches each member, at its own slots."""
    root = str(tmp_path / "shards")
    for shard in range(2):
        with ReplayBuffer.shard(root, shard, max_episodes=4, max_timesteps=STEPS, fields=FIELDS) as writer:
            writer.store_episode(**episode(shard))
    storage = ConcatReplayBuffer(root).storage
    forgotten = []
    for k, member in enumerate(storage.members):
        monkeypatch.setattr(
            member, "drop_cached_rows", lambda name, slots, k=k: forgotten.append((k, name, list(slots)))
        )
    storage.drop_cached_rows("image", np.array([1, 5, 6]))
    assert forgotten == [(0, "image", [1]), (1, "image", [1, 2])]
