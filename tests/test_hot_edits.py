"""Where in-place edits meet the hot tier, its compaction and the read cache: a reader in another
process (``cache='disk'``) never keeps or serves the rows from before an edit once it has
refreshed, whether the edited shard stays hot, is compacted, or was written compressed."""

from __future__ import annotations

import glob
import multiprocessing
import os

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.maintenance import verify

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
