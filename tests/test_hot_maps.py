"""Reads of hot shards from memory maps (``storage/_hotmap.py``): a reader keeps its maps while
the writer reuses slots, compacts or is killed, never faults (SIGBUS) and never returns a frame
of two versions; damage in a mapped shard is still named."""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replaybuf import ReplayBuffer, consistency
from replaybuf.storage import CorruptChunkError, GenerationMismatchError, _hotmap, _strided, chunk_cache
from replaybuf.storage._hotmap import shard_maps

from .test_hot_tier import FIELDS, STEPS, WAIT_S, episode, is_hot, shard_file

FORK = multiprocessing.get_context("fork")
SEEDS = 12  # episodes a writer stores into a circular buffer of 2 slots
# a file's mtime and ctime move with the kernel's coarse clock (a few ms): an edit in place made
# within the same tick as the write would leave the fingerprint a reader checks unchanged
CLOCK_TICK_S = 0.02


@pytest.fixture(autouse=True)
def _resident_budget():
    """Readers here turn the resident copies off (``open_reader``); later tests get them back."""
    budget = chunk_cache().resident_bytes
    yield
    chunk_cache().resize(resident_bytes=budget)


def make(location: str, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(location, max_episodes=2, max_timesteps=STEPS, fields=FIELDS, circular=True, **kwargs)


def open_reader(location: str) -> ReplayBuffer:
    chunk_cache().resize(resident_bytes=0)  # frames read from the files, not a copy held in RAM
    return ReplayBuffer.from_folder(location, read_only=True)


def frames(reader: ReplayBuffer, slot: int) -> dict[str, np.ndarray]:
    """Slot's image frames read the three ways a training loop reads them."""
    storage, steps = reader.storage, np.arange(STEPS)
    spans = np.zeros((1, STEPS, 40, 40, 3), np.uint8)
    storage.read_spans("image", [slot], [0], [STEPS], spans)
    return {
        "gather": storage.gather("image", np.full(STEPS, slot), steps),
        "spans": spans[0],
        "reversed": storage.gather("image", np.full(STEPS, slot), steps[::-1])[::-1],
    }


def two_hot_episodes(location: str) -> tuple[ReplayBuffer, list[dict]]:
    """A writer at ``location`` holding two stored episodes (hot), and their values."""
    writer = make(location)
    stored = [episode(seed) for seed in range(2)]
    for data in stored:
        writer.store_episode(**data)
    return writer, stored


def test_hot_frames_are_served_from_maps_and_match(tmp_path):
    location = str(tmp_path / "buffer")
    writer, stored = two_hot_episodes(location)
    assert is_hot(writer, 0) and is_hot(writer, 1)
    reader = open_reader(location)
    shard_maps().clear()
    for slot in (0, 1):
        for how, values in frames(reader, slot).items():
            assert np.array_equal(values, stored[slot]["image"]), (slot, how)
    mapped = {path for path in shard_maps()._entries if shard_maps()._entries[path].map is not None}
    assert shard_file(writer, 0) in mapped and shard_file(writer, 1) in mapped
    everything = reader.get_all_data()
    assert np.array_equal(np.asarray(everything["depth"]), np.stack([d["depth"] for d in stored]))
    writer.compact()  # the maps see the compacted files (a new inode) and leave them to the usual path
    for slot in (0, 1):
        for how, values in frames(reader, slot).items():
            assert np.array_equal(values, stored[slot]["image"]), (slot, how)
    assert shard_maps()._entries[shard_file(writer, 0)].map is None
    writer.store_episode(**episode(2))  # slot 0 hot again, slot 1 compacted: one batch reads both
    assert is_hot(writer, 0) and not is_hot(writer, 1)
    slots, steps = np.tile([0, 1], STEPS), np.repeat(np.arange(STEPS), 2)
    mixed = reader.storage.gather("image", slots, steps)
    assert np.array_equal(mixed[0::2], episode(2)["image"]) and np.array_equal(mixed[1::2], stored[1]["image"])
    reader.close()  # unmaps the buffer's files
    assert not [path for path in shard_maps()._entries if path.startswith(location)]
    writer.close()


def _expected(stored: dict[int, dict], name: str, slots: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """What a gather of ``name`` at (slots, steps) must return: the stored frames, zeros past an
    episode's length."""
    frames = []
    for slot, step in zip(slots.tolist(), steps.tolist()):
        values = stored[slot][name]
        frames.append(values[step] if step < len(values) else np.zeros_like(values[0]))
    return np.stack(frames)


@pytest.mark.parametrize("limit", [_hotmap.MAX_MAPS, 1])
def test_a_batch_mixes_hot_compacted_repeated_unsorted_and_absent_pairs(tmp_path, monkeypatch, limit):
    """One timestep batch over hot shards (whole-checked maps, or frame by frame once maps are
    evicted), compacted shards and steps past an episode's end returns exactly what was
    written, pairs repeated and in any order, for bytes and floats."""
    monkeypatch.setattr(_hotmap, "_maps", _hotmap.ShardMaps(limit))
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(location, max_episodes=4, max_timesteps=STEPS, fields=FIELDS)
    stored = {slot: episode(10 + slot) for slot in range(4)}
    stored[2] = {name: values[: STEPS - 6] for name, values in stored[2].items()}  # ends early
    for slot in (0, 1):
        writer.store_episode(**stored[slot])
    writer.compact()
    for slot in (2, 3):
        writer.store_episode(**stored[slot])
    assert [is_hot(writer, slot) for slot in range(4)] == [False, False, True, True]
    reader = open_reader(location)
    rng = np.random.default_rng(0)
    slots = rng.integers(0, 4, 300)
    steps = rng.integers(0, STEPS, 300)
    slots[:3], steps[:3] = 2, [STEPS - 1, 0, STEPS - 1]  # a step past slot 2's end, repeated
    for picked in (np.arange(300), np.flatnonzero(slots >= 2)):  # mixed; hot only
        for name in ("image", "depth"):
            got = reader.storage.gather(name, slots[picked], steps[picked])
            assert got.dtype == stored[0][name].dtype
            assert np.array_equal(got, _expected(stored, name, slots[picked], steps[picked])), (name, len(picked))
    if limit > 1:  # the hot shards were mapped, the compacted ones left to the usual path
        entries = shard_maps()._entries
        assert entries[shard_file(writer, 3)].map is not None and entries[shard_file(writer, 0)].map is None
    writer.close()


def test_a_batch_copies_frame_by_frame_when_the_maps_span_too_wide(tmp_path, monkeypatch):
    location = str(tmp_path / "buffer")
    writer = make(location)
    stored = {slot: episode(slot) for slot in range(2)}
    for data in stored.values():
        writer.store_episode(**data)
    reader = open_reader(location)
    slots, steps = np.array([1, 0, 1, 1, 0]), np.array([3, 19, 0, 3, 7])

    def too_big(*args, **kwargs):
        raise ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size")

    monkeypatch.setattr(np.lib.stride_tricks, "as_strided", too_big)
    monkeypatch.setattr("replaybuf.storage._strided._gather", None)  # the strided view's path
    assert np.array_equal(reader.storage.gather("image", slots, steps), _expected(stored, "image", slots, steps))
    assert shard_file(writer, 1) in shard_maps()._entries  # served from the maps, one frame at a time
    writer.close()


@given(
    picks=st.lists(st.integers(0, 11), min_size=1, max_size=20),
    first=st.integers(0, 11),
    strided=st.booleans(),
    compiled=st.booleans(),
)
def test_take_at_copies_the_items_at_the_offsets(picks, first, strided, compiled):
    """The compiled copy (contiguous items) and the strided view (any items) both return the
    items at the offsets from the anchor, laid out as its items."""
    if compiled and _strided._gather is None:
        pytest.skip("built without the compiled extension")
    items = np.arange(12 * 3 * 4, dtype=np.int32).reshape(12, 3, 4)
    items = items[:, :, ::2] if strided else items
    chosen = np.array([pick for pick in picks if pick >= first] or [first])  # any order, repeats
    offsets = (chosen - first) * items.strides[0]
    saved = _strided._gather
    _strided._gather = saved if compiled else None
    try:
        taken = _strided.take_at(items[first:], offsets.astype(np.int64))
    finally:
        _strided._gather = saved
    assert taken is not None and taken.shape == (len(chosen), *items.shape[1:])
    np.testing.assert_array_equal(taken, items[chosen])


def test_more_hot_shards_stay_mapped_than_the_process_may_open_files(tmp_path, monkeypatch):
    """A map holds no file descriptor: a reader keeps every hot shard of a buffer of many short
    episodes mapped under a small open-file limit (Python's mmap keeps one each, so it once
    kept 256 and remapped the rest at every batch)."""
    import resource

    monkeypatch.setattr(_hotmap, "_maps", _hotmap.ShardMaps(_hotmap.MAX_MAPS))
    location = str(tmp_path / "buffer")
    slots = 96
    writer = ReplayBuffer(location, max_episodes=slots, max_timesteps=STEPS, fields=FIELDS)
    stored = {slot: episode(slot) for slot in range(slots)}
    for data in stored.values():
        writer.store_episode(**data)
    reader = open_reader(location)
    picked, steps = np.repeat(np.arange(slots), 2), np.tile([0, STEPS - 1], slots)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    try:
        got = reader.storage.gather("image", picked, steps)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    np.testing.assert_array_equal(got, _expected(stored, "image", picked, steps))
    mapped = [entry for entry in shard_maps()._entries.values() if entry.map is not None]
    assert len(mapped) >= slots
    writer.close()


def test_a_map_outlives_its_descriptor_and_never_reaches_past_the_file(tmp_path):
    from replaybuf.storage._mapping import map_file

    path = tmp_path / "file"
    path.write_bytes(bytes(range(200)))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="greater than file size"):
            map_file(fd, 4096)
        mapped = map_file(fd, 200)
    finally:
        os.close(fd)
    view = mapped[10:14]
    del mapped
    assert view.tolist() == [10, 11, 12, 13] and not view.flags.writeable


def test_a_shard_replaced_between_batches_is_never_served_stale(tmp_path):
    """A slot reused (a new hot shard at the path) or compacted between two batches: the next
    batch reads the file now at the path."""
    location = str(tmp_path / "buffer")
    writer = make(location)
    for seed in range(2):
        writer.store_episode(**episode(seed))
    reader = open_reader(location)
    slots, steps = np.array([0, 1, 0] * 3), np.arange(9)[::-1] + 5
    first = reader.storage.gather("image", slots, steps)
    assert np.array_equal(first, _expected({0: episode(0), 1: episode(1)}, "image", slots, steps))
    writer.store_episode(**episode(2))  # slot 0 reused: a new hot shard file at its path
    assert is_hot(writer, 0)
    stored = {0: episode(2), 1: episode(1)}
    assert np.array_equal(reader.storage.gather("image", slots, steps), _expected(stored, "image", slots, steps))
    writer.compact()
    assert np.array_equal(reader.storage.gather("image", slots, steps), _expected(stored, "image", slots, steps))
    assert all(shard_maps()._entries[shard_file(writer, slot)].map is None for slot in (0, 1))
    writer.close()


def test_a_batch_naming_its_generations_reuses_a_verified_map_until_the_slot_moves_or_a_refresh(tmp_path, monkeypatch):
    """A read naming each slot's planned generation checks the slots' generations once per new
    map (the map then holds that generation: ``verifies_gathers``) and uses a verified map
    without a stat of its file; a new generation, a refresh (``drop_caches``) or this process's
    own write of the slot makes the next read look at the file again, and a generation the
    slot does not hold is refused."""
    # this process's maps as new: after an eviction (earlier tests) maps are checked frame by
    # frame, and only maps checked whole are indexed
    monkeypatch.setattr(_hotmap, "_maps", _hotmap.ShardMaps(_hotmap.MAX_MAPS))
    location = str(tmp_path / "buffer")
    writer = make(location)
    for seed in range(2):
        writer.store_episode(**episode(seed))
    reader = open_reader(location)
    assert reader.storage.verifies_gathers(["image"])
    slots, steps = np.array([0, 1, 0, 1]), np.array([3, 2, 1, 0])
    stats, checks = [], []  # stats of shard files; reads of the slots' generations
    real_stat = os.stat
    monkeypatch.setattr(
        _hotmap.os,
        "stat",
        lambda path, *a, **k: ("_generation" not in path and stats.append(path)) or real_stat(path, *a, **k),
    )
    array = reader.storage.array("image")
    real_check = array.generations_of
    monkeypatch.setattr(array, "generations_of", lambda rows: checks.append(sorted(rows.tolist())) or real_check(rows))

    def gather(generations=None):
        stats.clear()
        checks.clear()
        return reader.storage.gather("image", slots, steps, generations)

    planned = reader.storage.read_meta_rows("_generation", [0, 1])[slots]
    stored = {0: episode(0), 1: episode(1)}
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps))
    assert len(stats) == 2 and checks == [[0, 1]]  # new maps: verified once
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps)) and stats == checks == []
    assert np.array_equal(gather(), _expected(stored, "image", slots, steps)) and len(stats) == 2  # none named
    assert checks == [[0, 1]]  # the maps' bindings checked against the stored generations instead (format 7)
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps)) and stats == checks == []

    # another process's edit in place: a new file at slot 0's path, the same generation
    path = shard_file(writer, 0)
    edit = writer.storage.array("image").encode_shard(0, episode(1)["image"], hot=True, generation=int(planned[0]))
    with open(path + ".new", "wb") as f:
        f.write(edit)
    os.replace(path + ".new", path)
    edited = {0: episode(1), 1: episode(1)}
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps)) and stats == checks == []
    reader.storage.drop_caches()  # refresh(): the edit is seen
    assert np.array_equal(gather(planned), _expected(edited, "image", slots, steps))
    assert len(stats) == 2 and checks == [[0]]  # slot 1's map is the same file version: still verified

    writer.store_episode(**episode(2))  # slot 0 reused (a new generation) by this process's writer
    assert path not in shard_maps()._entries  # its own write dropped the map
    stored = {0: episode(2), 1: episode(1)}
    planned = reader.storage.read_meta_rows("_generation", [0, 1])[slots]
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps)) and checks == [[0]]
    entry = shard_maps()._entries[path]
    entry.confirmed -= _hotmap.TRUST_S  # the trust lapses: the next read stats the file again
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps))
    assert stats == [path] and checks == []  # the same file version: verified already
    assert np.array_equal(gather(planned), _expected(stored, "image", slots, steps)) and stats == checks == []
    # a read planning a generation slot 0 does not hold stats its file and is refused
    other = planned.copy()
    other[slots == 0] += 7
    with pytest.raises(GenerationMismatchError) as refused:
        gather(other)
    assert refused.value.slots == [0] and stats == [path] and checks == [[0]]
    writer.close()


def _two_hot_episodes(tmp_path, monkeypatch) -> tuple[ReplayBuffer, dict[int, dict], ReplayBuffer]:
    """A writer of two hot episodes (circular, 2 slots), what it stored by slot, and a reader;
    this process's maps as new (none evicted yet: maps are checked whole, and indexed)."""
    monkeypatch.setattr(_hotmap, "_maps", _hotmap.ShardMaps(_hotmap.MAX_MAPS))
    writer = make(str(tmp_path / "buffer"))
    stored = {seed: episode(seed) for seed in range(2)}
    for seed in range(2):
        writer.store_episode(**stored[seed])
    return writer, stored, open_reader(str(tmp_path / "buffer"))


def test_a_batch_the_map_index_serves_is_exact_and_lapses_with_the_maps(tmp_path, monkeypatch):
    """Batches over slots whose maps are confirmed are served by the per-array index
    (``MapIndex``) with the stored frames; a write of this process, a refresh or a new map makes
    the next batch look the maps up again."""
    writer, stored, reader = _two_hot_episodes(tmp_path, monkeypatch)
    array = reader.storage.array("image")
    rng = np.random.default_rng(1)
    planned = reader.storage.read_meta_rows("_generation", [0, 1])
    for round in range(6):
        slots, steps = rng.integers(0, 2, 64), rng.integers(0, STEPS, 64)
        got = reader.storage.gather("image", slots, steps, planned[slots])
        assert np.array_equal(got, _expected(stored, "image", slots, steps)), round
    index = _hotmap._index_of(array)
    assert index.version == shard_maps().version and sorted(np.flatnonzero(index.where >= 0)) == [0, 1]
    # steps counted from the end read as numpy reads them; a step past the rows is refused
    slots = np.array([0, 1, 1])
    got = reader.storage.gather("image", slots, np.array([-1, 0, -STEPS]), planned[slots])
    assert np.array_equal(got, _expected(stored, "image", slots, np.array([STEPS - 1, 0, 0])))
    with pytest.raises(IndexError):
        reader.storage.gather("image", slots, np.array([0, STEPS, 1]), planned[slots])
    writer.store_episode(**episode(5))  # slot 0 reused by this process: its map dropped
    assert index.version != shard_maps().version
    stored[0] = episode(5)
    planned = reader.storage.read_meta_rows("_generation", [0, 1])
    for round in range(3):
        slots, steps = rng.integers(0, 2, 64), rng.integers(0, STEPS, 64)
        got = reader.storage.gather("image", slots, steps, planned[slots])
        assert np.array_equal(got, _expected(stored, "image", slots, steps)), round
    reader.storage.drop_caches()
    assert index.version != shard_maps().version  # refreshed: looked up (and stat'ed) again
    writer.close()


def test_timestep_batches_need_no_recheck_and_keep_their_snapshot_when_a_slot_is_reused(tmp_path, monkeypatch):
    """A read-only reader's timestep batches are verified by their gathers (``verifies_gathers``):
    no batch re-reads its slots' generations (``committed_generations``), and after the writer
    reuses a slot every sample still holds the snapshot's episode of its slot, never the new one."""
    writer, stored, reader = _two_hot_episodes(tmp_path, monkeypatch)
    rechecks = []
    real = consistency.committed_generations
    monkeypatch.setattr(consistency, "committed_generations", lambda *a: rechecks.append(a) or real(*a))
    loader = reader.dataloader(timestep_level=True, batch_size=16, shuffle=True, return_indices=True)

    def check_epoch() -> int:
        samples = 0
        for batch in loader:
            for (slot, step), image, state in zip(batch["_indices"].tolist(), batch["image"], batch["state"]):
                assert np.array_equal(image.numpy(), stored[slot]["image"][step]), (slot, step)
                assert np.array_equal(state.numpy(), stored[slot]["state"][step]), (slot, step)
                samples += 1
        return samples

    assert check_epoch() == 2 * STEPS and rechecks == []
    writer.store_episode(**episode(7))  # slot 0 reused while the loader's snapshot names its old episode
    for lapse in (False, True):
        if lapse:  # the maps' trust lapses: the reader stats slot 0's shard, finds the new file
            for entry in shard_maps()._entries.values():
                entry.confirmed -= _hotmap.TRUST_S
        samples = check_epoch()
        assert 0 < samples <= 2 * STEPS and rechecks == []
    writer.close()


def test_a_hot_shard_of_an_earlier_episode_of_its_slot_is_never_served_from_a_map(tmp_path):
    """Format 7 binds a shard to its episode's generation: slot 1's hot shard of an earlier
    episode, as long as the one there now (a partial backup restore of a circular buffer),
    put back over the current one's after slot 1 was mapped is left to the usual path, which
    names it, on reads naming the slots' generations or not; slot 0's map still serves. Before:
    its frames were served as the current episode's."""
    location = str(tmp_path / "buffer")
    writer, _ = two_hot_episodes(location)
    older = _copy(shard_file(writer, 1), str(tmp_path / "older"))
    stored = [episode(seed) for seed in (2, 3)]
    for data in stored:  # slots 0 and 1 reused by episodes of the same length
        writer.store_episode(**data)
    assert is_hot(writer, 0) and is_hot(writer, 1)
    reader = open_reader(location)
    planned = reader.storage.read_meta_rows("_generation", [0, 1])
    assert planned.tolist() == [3, 4]
    assert np.array_equal(frames(reader, 1)["gather"], stored[1]["image"])
    time.sleep(CLOCK_TICK_S)
    path = shard_file(writer, 1)
    os.replace(_copy(older, path + ".new"), path)
    slots, steps = np.array([0, 1, 0, 1]), np.array([5, 4, 2, 5])
    for read in (
        lambda: reader.storage.gather("image", slots, steps),
        lambda: reader.storage.gather("image", slots, steps, planned[slots]),
        lambda: reader.storage.read_spans("image", [1], [0], [STEPS], np.zeros((1, STEPS, 40, 40, 3), np.uint8)),
        lambda: frames(reader, 1),
        reader.get_all_data,
    ):
        with pytest.raises(
            CorruptChunkError,
            match="data/image: slot 1, .*the shard holds slot 1's episode of generation 2, not generation 4: "
            "restored from an older copy",
        ) as raised:
            read()
        assert path in str(raised.value)
    for how, values in frames(reader, 0).items():
        assert np.array_equal(values, stored[0]["image"]), how
    writer.drop_episodes(1)
    writer.close()


def _copy(source: str, target: str) -> str:
    with open(source, "rb") as f, open(target, "wb") as out:
        out.write(f.read())
    return target


def _read_until(location: str, stop, rounds, results) -> None:
    """Child: read both slots until ``stop``, counting ``rounds`` of both; each read must be one
    whole stored episode (never a mix of two versions, never a torn frame); report (reads, bad
    reads, maps held)."""
    reader = open_reader(location)
    expected = [episode(seed)["image"] for seed in range(SEEDS)]
    reads = bad = 0
    while not stop.is_set():
        for slot in (0, 1):
            try:
                got = frames(reader, slot)
            except CorruptChunkError:  # a slot invalidated for its rewrite: the reader sees it
                continue
            for values in got.values():
                reads += 1
                bad += not any(np.array_equal(values, e) for e in expected)
        with rounds.get_lock():
            rounds.value += 1
    results.put((reads, bad, sum(entry.map is not None for entry in shard_maps()._entries.values())))


def _run_reader(location: str):
    stop, rounds, results = FORK.Event(), FORK.Value("i", 0), FORK.Queue()
    child = FORK.Process(target=_read_until, args=(location, stop, rounds, results))
    child.start()
    return child, stop, rounds, results


def _wait_for_rounds(child, rounds, more: int) -> None:
    """Wait until the reader ``child`` has read both slots ``more`` times more than now."""
    target, deadline = rounds.value + more, time.monotonic() + WAIT_S
    while rounds.value < target:
        assert child.is_alive() and time.monotonic() < deadline, f"the reader stopped at round {rounds.value}"
        time.sleep(0.01)


def _finish_reader(child, stop, results) -> tuple[int, int, int]:
    stop.set()
    child.join(WAIT_S)
    assert child.exitcode == 0, f"reader exit code {child.exitcode} (-{int(signal.SIGBUS)}: SIGBUS)"
    return results.get(timeout=WAIT_S)


def test_a_reader_holding_maps_survives_slot_reuse_and_compaction(tmp_path):
    location = str(tmp_path / "buffer")
    writer = make(location)
    for seed in range(2):
        writer.store_episode(**episode(seed))
    child, stop, rounds, results = _run_reader(location)
    try:
        _wait_for_rounds(child, rounds, 1)  # the reader maps both hot shards
        for seed in range(2, 4 * SEEDS):  # each slot rewritten 23 times, compacted every third episode
            writer.store_episode(**episode(seed % SEEDS))
            if seed % 3 == 0:
                writer.compact()
    finally:
        reads, bad, _ = _finish_reader(child, stop, results)
    assert reads and not bad
    writer.close()


def _write_forever(location: str) -> None:
    """Child: store episodes hot into the circular buffer until killed."""
    writer = ReplayBuffer.from_folder(location)
    seed = 0
    while True:
        writer.store_episode(**episode(seed % SEEDS))
        seed += 1


def test_a_killed_writer_and_its_temp_files_never_disturb_a_mapping_reader(tmp_path):
    location = str(tmp_path / "buffer")
    writer = make(location)
    for seed in range(2):
        writer.store_episode(**episode(seed))
    writer.storage._hot.stop()  # left hot, for the reader to map
    writer.storage.release_writer()
    child, stop, rounds, results = _run_reader(location)
    killed = FORK.Process(target=_write_forever, args=(location,))
    killed.start()
    try:
        _wait_for_rounds(child, rounds, 1)  # the reader maps both hot shards
        time.sleep(0.5)  # the writer is killed wherever it is then
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(WAIT_S)
        folder = os.path.dirname(shard_file(writer, 0))
        with open(os.path.join(folder, ".left-by-a-killed-writer.partial"), "wb") as f:
            f.write(b"\x02\x01" * 100)  # a temp file cut short, as a kill mid-write leaves one
        _wait_for_rounds(child, rounds, 2)  # a whole round begun after the temp file was left
    finally:
        reads, bad, mapped = _finish_reader(child, stop, results)
    assert reads and not bad and mapped
    writer = ReplayBuffer.from_folder(location)  # deletes the temp files
    assert not glob.glob(os.path.join(folder, "*.partial"))
    reader = open_reader(location)
    for slot in writer.valid_episodes().tolist():
        values = frames(reader, slot)["gather"]
        assert any(np.array_equal(values, episode(seed)["image"]) for seed in range(SEEDS))
    writer.close()


def _flip(path: str, step: int) -> None:
    """Flip a byte of frame ``step``'s payload in a shard file, in place."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        index = np.frombuffer(bytes(data[-(16 * STEPS + 4) : -4]), "<u8").reshape(STEPS, 2)
        data[int(index[step, 0]) + 20] ^= 0xFF
        f.seek(0)
        f.write(data)


@pytest.mark.parametrize("limit", [_hotmap.MAX_MAPS, 1])
def test_a_byte_flipped_in_a_mapped_frame_is_named(tmp_path, monkeypatch, limit):
    """Whether shards are checked whole when mapped or frame by frame (maps evicted), a flip
    after a clean read raises CorruptChunkError naming the file and the slot."""
    monkeypatch.setattr(_hotmap, "_maps", _hotmap.ShardMaps(limit))
    location = str(tmp_path / "buffer")
    writer, stored = two_hot_episodes(location)
    reader = open_reader(location)
    for slot in (1, 0, 1):
        assert np.array_equal(frames(reader, slot)["gather"], stored[slot]["image"])
    time.sleep(CLOCK_TICK_S)
    _flip(shard_file(writer, 1), 5)
    for read in (
        lambda: reader.storage.gather("image", np.array([1]), np.array([5])),
        lambda: reader.storage.gather("image", np.array([0, 1, 0, 1]), np.array([5, 4, 2, 5])),  # mixed batch
        lambda: frames(reader, 1),
        reader.get_all_data,
    ):
        with pytest.raises(CorruptChunkError, match="data/image: slot 1") as raised:
            read()
        assert shard_file(writer, 1) in str(raised.value)
    assert np.array_equal(frames(reader, 0)["spans"], stored[0]["image"])  # the other slot still reads
    writer.drop_episodes(1)
    writer.close()


# where the shard copied over slot 1's comes from -> what the usual path says of it
COPIED_FROM = {
    "slot 0": "holds slot 0's data, not slot 1's",
    "another buffer": "holds slot 1's data of another buffer \\(or of a field this buffer does not have\\)",
}


@pytest.mark.parametrize("source", sorted(COPIED_FROM))
def test_a_hot_shard_copied_from_another_slot_or_buffer_is_never_served_from_a_map(tmp_path, source):
    """The maps check a shard's binding to its slot (and, format 6, its buffer) when they map
    it: slot 0's hot shard, or slot 1's of another buffer, copied over slot 1's (after slot 1
    was mapped) is left to the usual path, which names it; slot 0's own map still serves."""
    location = str(tmp_path / "buffer")
    writer, stored = two_hot_episodes(location)
    other, _ = two_hot_episodes(str(tmp_path / "other")) if source == "another buffer" else (writer, stored)
    assert is_hot(writer, 0) and is_hot(writer, 1)
    reader = open_reader(location)
    assert np.array_equal(frames(reader, 1)["gather"], stored[1]["image"])
    time.sleep(CLOCK_TICK_S)
    path = shard_file(writer, 1)
    os.replace(_copy(shard_file(other, 0 if source == "slot 0" else 1), path + ".new"), path)
    for read in (
        lambda: reader.storage.gather("image", np.array([1]), np.array([5])),
        lambda: reader.storage.gather("image", np.array([0, 1, 0, 1]), np.array([5, 4, 2, 5])),  # mixed batch
        lambda: frames(reader, 1),
        reader.get_all_data,
    ):
        with pytest.raises(CorruptChunkError, match=f"data/image: slot 1, .*{COPIED_FROM[source]}") as raised:
            read()
        assert path in str(raised.value)
    assert shard_maps()._entries[path].map is None
    for how, values in frames(reader, 0).items():
        assert np.array_equal(values, stored[0]["image"]), how
    writer.drop_episodes(1)
    writer.close()
    other.close()


def _read_truncated(location: str, path: str, ready, go, results) -> None:
    """Child: map the shard, wait while the parent truncates it in place, read it again."""
    reader = open_reader(location)
    frames(reader, 0)
    ready.set()
    go.wait(WAIT_S)
    try:
        frames(reader, 0)
        results.put("no error")
    except CorruptChunkError as e:
        results.put(str(e))


def test_a_mapped_shard_truncated_in_place_is_damage_not_a_crash(tmp_path):
    location = str(tmp_path / "buffer")
    writer = make(location)
    writer.store_episode(**episode(0))
    path = shard_file(writer, 0)
    ready, go, results = FORK.Event(), FORK.Event(), FORK.Queue()
    child = FORK.Process(target=_read_truncated, args=(location, path, ready, go, results))
    child.start()
    try:
        assert ready.wait(WAIT_S)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        go.set()
        message = results.get(timeout=WAIT_S)
    finally:
        go.set()
        child.join(WAIT_S)
    assert child.exitcode == 0, f"reader exit code {child.exitcode}"
    assert "data/image: slot 0" in message and path in message
    writer.drop_episodes(0)
    writer.close()
