"""The hot write tier (``storage/_hot.py``): image shards of a local zarr writer are stored at
blosc clevel 0 and compacted to the configured level in the background, by ``compact()`` and by
``close()``; every read path returns the same bytes before, during and after compaction."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest
import zarr

from replaybuf import ReplayBuffer
from replaybuf.maintenance import format_info, info
from replaybuf.storage import BufferLockedError, CorruptChunkError, _hot, chunk_cache
from replaybuf.storage._codecs import BLOSC_MEMCPYED
from replaybuf.storage._shards import ShardedArray

from ._fifo import refused_never_waited_on

FORK = multiprocessing.get_context("fork")
# two sharded fields: bytes (blosc without shuffle) and floats (blosc with shuffle)
FIELDS = {"image": ("uint8", (40, 40, 3)), "depth": ("float", (32, 40)), "state": ("float", 4)}
SHARDED = ("image", "depth")
STEPS = 20
FRAME_BYTES = 40 * 40 * 3
DEPTH_BYTES = 32 * 40 * 4
WAIT_S = 30  # bound on waiting for the background thread (never reached when it works)


def episode(seed: int) -> dict[str, np.ndarray]:
    """A compressible episode: each frame a coloured square on black (lz4 shrinks it ~20x), a
    depth map of one value per frame."""
    rng = np.random.default_rng(seed)
    image = np.zeros((STEPS, 40, 40, 3), np.uint8)
    image[:, :20, :20] = rng.integers(1, 256, (STEPS, 1, 1, 3), dtype=np.uint8)
    depth = np.broadcast_to(rng.standard_normal((STEPS, 1, 1)), (STEPS, 32, 40)).astype(np.float32)
    return {"image": image, "depth": depth, "state": rng.standard_normal((STEPS, 4)).astype(np.float32)}


def make(tmp_path, max_episodes: int = 6, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(
        str(tmp_path / "buffer"), max_episodes=max_episodes, max_timesteps=STEPS, fields=FIELDS, **kwargs
    )


def shard_file(buffer: ReplayBuffer, slot: int) -> str:
    array = buffer.storage.array("image")
    return array.kv.where(array.shard_key(slot))


def is_hot_file(path: str) -> bool:
    """The blosc flag of a shard's first inner chunk, read from its file."""
    with open(path, "rb") as f:
        return bool(f.read(3)[2] & BLOSC_MEMCPYED)


def is_hot(buffer: ReplayBuffer, slot: int) -> bool:
    return is_hot_file(shard_file(buffer, slot))


def hot_slots(buffer: ReplayBuffer) -> list[int]:
    return sorted(buffer.storage.hot_shards(buffer.valid_episodes()))


def wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def check_reads(buffer: ReplayBuffer, episodes: dict[int, dict]) -> None:
    """Whole-buffer, timestep and trajectory reads of ``episodes`` (slot -> data) match."""
    slots = sorted(episodes)
    everything = buffer.get_all_data()
    steps = buffer.dataset(timestep_level=True)
    step_batch = steps.__getitems__(list(range(len(steps)))).batch
    trajectories = buffer.dataset()
    trajectory_batch = trajectories.__getitems__(list(range(len(trajectories)))).batch
    for name in SHARDED:
        wanted = np.stack([episodes[s][name] for s in slots])
        assert np.array_equal(np.asarray(everything[name])[slots], wanted)
        assert np.array_equal(np.asarray(step_batch[name]), wanted.reshape(-1, *wanted.shape[2:]))
        assert np.array_equal(np.asarray(trajectory_batch[name])[:, :STEPS], wanted)


def test_store_episode_writes_hot_shards_and_compact_makes_them_cold(tmp_path):
    buffer = make(tmp_path)
    stored = {slot: episode(slot) for slot in range(3)}
    for data in stored.values():
        buffer.store_episode(**data)
    assert [is_hot(buffer, slot) for slot in range(3)] == [True] * 3
    assert all(os.path.getsize(shard_file(buffer, slot)) > STEPS * FRAME_BYTES for slot in range(3))
    assert hot_slots(buffer) == [0, 1, 2]
    check_reads(buffer, stored)
    # zarr-python decodes hot shards too: blosc reads a raw payload whatever clevel zarr.json names
    for name in SHARDED:
        on_disk = zarr.open_array(str(tmp_path / "buffer"), path=f"data/{name}", mode="r")
        assert np.array_equal(on_disk[:3], np.stack([d[name] for d in stored.values()]))

    summary = buffer.compact()
    assert summary.episodes == 3 and summary.bytes_after * 4 < summary.bytes_before
    assert [is_hot(buffer, slot) for slot in range(3)] == [False] * 3
    assert hot_slots(buffer) == [] and buffer.compact().episodes == 0
    check_reads(buffer, stored)
    for name in SHARDED:
        on_disk = zarr.open_array(str(tmp_path / "buffer"), path=f"data/{name}", mode="r")
        assert np.array_equal(on_disk[:3], np.stack([d[name] for d in stored.values()]))
    assert buffer.storage.describe()["arrays"]["data/image"]["compressor"] == "blosc-lz4:9"
    buffer.close()


def test_background_compaction_keeps_hot_bytes_under_the_bound_and_close_compacts_the_rest(tmp_path):
    bound = int(2.5 * STEPS * (FRAME_BYTES + DEPTH_BYTES))  # two and a half episodes
    buffer = make(tmp_path, max_episodes=8, hot_bytes=bound)
    stored = {slot: episode(slot) for slot in range(6)}
    for data in stored.values():
        buffer.store_episode(**data)
    hot = buffer.storage._hot
    wait_for(lambda: hot.committed_bytes() <= bound and not hot.busy)
    assert sum(buffer.storage.hot_shards(buffer.valid_episodes()).values()) <= bound
    assert hot_slots(buffer) == [4, 5]  # the oldest went first
    assert "hot        2 episodes" in format_info(info(str(tmp_path / "buffer")))
    check_reads(buffer, stored)
    buffer.flush()
    assert hot_slots(buffer) == [4, 5]  # flush() does not compact
    buffer.close()
    reader = ReplayBuffer.from_folder(str(tmp_path / "buffer"), read_only=True)
    assert hot_slots(reader) == [] and info(str(tmp_path / "buffer"))["hot_episodes"] == 0
    check_reads(reader, stored)


def test_a_reopened_writer_s_own_episodes_stay_hot_when_its_compactor_scans_after_them(tmp_path, monkeypatch):
    """A writable open's background thread first looks for shards a killed writer left hot
    and compacts those whatever the hot bytes; episodes this writer stored before that scan
    stay hot until they exceed ``hot_bytes`` (they were compacted with the leftovers: the
    newest episodes, the most sampled, went cold at once)."""
    with make(tmp_path) as buffer:
        buffer.store_episode(**episode(0))
    scan, passed = threading.Event(), threading.Event()
    find_hot, compact_pending = _hot.find_hot, _hot.HotTier._compact_pending

    def find_hot_later(*args):
        scan.wait(WAIT_S)
        return find_hot(*args)

    def compact_pending_then_say(self):
        try:
            return compact_pending(self)
        finally:
            passed.set()

    monkeypatch.setattr(_hot, "find_hot", find_hot_later)
    monkeypatch.setattr(_hot.HotTier, "_compact_pending", compact_pending_then_say)
    buffer = ReplayBuffer.from_folder(str(tmp_path / "buffer"))
    stored = {slot: episode(slot) for slot in range(3)}
    buffer.store_episode(**stored[1])
    buffer.store_episode(**stored[2])
    scan.set()
    assert passed.wait(WAIT_S), "the compactor's first pass never ended"
    assert hot_slots(buffer) == [1, 2]
    check_reads(buffer, stored)
    buffer.close()
    assert hot_slots(ReplayBuffer.from_folder(str(tmp_path / "buffer"), read_only=True)) == []


def test_hot_bytes_zero_writes_compressed(tmp_path):
    buffer = make(tmp_path, hot_bytes=0)
    buffer.store_episode(**episode(0))
    assert not is_hot(buffer, 0) and os.path.getsize(shard_file(buffer, 0)) * 4 < STEPS * FRAME_BYTES
    assert buffer.compact().episodes == 0
    buffer.close()


@pytest.mark.parametrize("hot_bytes", [-1, 1.5, True, "1GB"])
def test_hot_bytes_is_checked(tmp_path, hot_bytes):
    with pytest.raises(ValueError, match="hot_bytes must be a number of bytes >= 0"):
        make(tmp_path, hot_bytes=hot_bytes)
    assert not (tmp_path / "buffer").exists()


def test_other_compressors_and_read_only_buffers_have_no_hot_tier(tmp_path):
    zstd = ReplayBuffer(
        str(tmp_path / "zstd"),
        4,
        STEPS,
        fields={"image": {"dtype": "uint8", "shape": (40, 40, 3), "compressor": "zstd:3"}},
    )
    zstd.store_episode(image=episode(0)["image"])
    assert zstd.storage._hot is None and zstd.compact().episodes == 0
    zstd.close()
    buffer = make(tmp_path)
    buffer.store_episode(**episode(0))
    buffer.storage._hot.stop()  # leave it hot, as a killed writer would
    buffer.storage.release_writer()
    reader = ReplayBuffer.from_folder(str(tmp_path / "buffer"), read_only=True)
    with pytest.raises(ValueError, match="cannot call `compact` on a buffer opened read-only"):
        reader.compact()
    reader.close()
    assert is_hot(reader, 0)  # a read-only open never compacts


def test_a_slot_overwritten_before_its_compaction_is_never_encoded(tmp_path):
    buffer = make(tmp_path, max_episodes=3, circular=True)
    for seed in range(5):  # slots 0 and 1 are overwritten while hot
        buffer.store_episode(**episode(seed))
    assert hot_slots(buffer) == [0, 1, 2]
    summary = buffer.compact()
    assert summary.episodes == 3  # the two overwritten episodes were never compacted
    check_reads(buffer, {0: episode(3), 1: episode(4), 2: episode(2)})
    buffer.close()


def test_a_reused_slot_gets_a_new_shard_file_and_the_old_one_stays_whole(tmp_path):
    """A shard a reader may map is replaced by a rename, never truncated and rewritten in place:
    a reader holding the old file keeps one whole version of it (a map of it never faults)."""
    buffer = make(tmp_path, max_episodes=2, circular=True)
    buffer.store_episode(**episode(0))
    paths = [shard_file(buffer, 0), buffer.storage.array("depth").kv.where(buffer.storage.array("depth").shard_key(0))]
    held = [open(path, "rb") for path in paths]
    try:
        old = [f.read() for f in held]
        for seed in (1, 2):  # slot 0 is written again
            buffer.store_episode(**episode(seed))
        for f, path, data in zip(held, paths, old):
            assert os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
            f.seek(0)
            assert f.read() == data
    finally:
        for f in held:
            f.close()
    check_reads(buffer, {0: episode(2), 1: episode(1)})
    buffer.close()


def test_compaction_racing_rewrites_never_puts_old_data_in_a_new_episode(tmp_path):
    buffer = make(tmp_path, max_episodes=2, circular=True, hot_bytes=1)  # compact at once, in the background
    stop = threading.Event()
    errors: list[BaseException] = []

    def compact_again() -> None:
        try:
            while not stop.is_set():
                buffer.storage.compact()
        except BaseException as e:  # reported below
            errors.append(e)

    racer = threading.Thread(target=compact_again)
    racer.start()
    try:
        for seed in range(40):
            buffer.store_episode(**episode(seed))
            slot = seed % 2
            stored = buffer.storage.read_rows("image", np.array([slot]), 0, STEPS)[0]
            assert np.array_equal(stored, episode(seed)["image"]), f"episode {seed} in slot {slot}"
    finally:
        stop.set()
        racer.join()
    assert not errors
    buffer.compact()
    check_reads(buffer, {0: episode(38), 1: episode(39)})
    buffer.close()


def test_a_damaged_hot_shard_is_left_as_it_is_with_a_warning(tmp_path):
    buffer = make(tmp_path)
    for seed in range(2):
        buffer.store_episode(**episode(seed))
    with open(shard_file(buffer, 0), "r+b") as f:
        f.seek(100)  # inside the first frame's raw payload
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = open(shard_file(buffer, 0), "rb").read()
    with pytest.warns(UserWarning, match=r"data/image, slot 0 hot: .*crc32c"):
        summary = buffer.compact()
    assert summary.episodes == 1 and hot_slots(buffer) == [0]
    assert open(shard_file(buffer, 0), "rb").read() == before
    with pytest.raises(CorruptChunkError, match="slot 0"):
        buffer.get_all_data()
    buffer.drop_episodes(0)
    buffer.close()


def _reader(location: str, ready, go, results) -> None:
    """Child: read 2 frames of each episode (a ranged read; the shard index is cached under the
    slot generation), wait for the parent's compaction, read them again, then a damaged one."""
    chunk_cache().resize(resident_bytes=0)  # frames read from the file, not a copy held in RAM
    buffer = ReplayBuffer.from_folder(location, read_only=True)
    storage = buffer.storage
    generations = np.asarray(buffer._meta["_generation"][:3])

    def frames(slot: int) -> np.ndarray:
        out = np.zeros((1, 2, 40, 40, 3), np.uint8)
        storage.read_spans("image", [slot], [5], [2], out, generations=generations[slot : slot + 1])
        return out[0]

    first = [frames(slot) for slot in range(3)]
    ready.set()
    go.wait(WAIT_S)
    try:
        again = [frames(slot) for slot in range(2)]
        results.put(("ok", all(np.array_equal(a, b) for a, b in zip(first, again))))
    except CorruptChunkError as e:
        results.put(("corrupt", str(e)))
    try:
        frames(2)
        results.put(("damage read", "no error"))
    except CorruptChunkError as e:
        results.put(("damage", str(e)))


def test_readers_with_cached_indexes_read_compacted_shards(tmp_path):
    buffer = make(tmp_path)
    stored = [episode(seed) for seed in range(3)]
    for data in stored:
        buffer.store_episode(**data)
    ready, go, results = FORK.Event(), FORK.Event(), FORK.Queue()
    child = FORK.Process(target=_reader, args=(str(tmp_path / "buffer"), ready, go, results))
    child.start()
    try:
        assert ready.wait(WAIT_S)
        assert buffer.compact().episodes == 3
        with open(shard_file(buffer, 2), "r+b") as f:  # a real flipped byte, inside frame 5
            f.seek(0)
            data = bytearray(f.read())
            index = np.frombuffer(bytes(data[-(16 * STEPS + 4) : -4]), "<u8").reshape(STEPS, 2)
            data[int(index[5, 0]) + 20] ^= 0xFF
            f.seek(0)
            f.write(data)
        go.set()
        assert results.get(timeout=WAIT_S) == ("ok", True)
        kind, message = results.get(timeout=WAIT_S)
        assert kind == "damage" and "slot 2" in message
    finally:
        go.set()
        child.join(WAIT_S)
    buffer.drop_episodes(2)
    buffer.close()


def _writer(location: str, marker: str) -> None:
    """Child: store 24 hot episodes, say so, compact them (to be killed meanwhile)."""
    buffer = ReplayBuffer(location, max_episodes=24, max_timesteps=STEPS, fields=FIELDS)
    for seed in range(24):
        buffer.store_episode(**episode(seed))
    buffer.flush()
    open(marker, "w").close()
    buffer.compact()
    time.sleep(WAIT_S)


@pytest.mark.parametrize("round_", range(3))
def test_a_writer_killed_while_compacting_leaves_every_episode_readable(tmp_path, round_):
    location, marker = str(tmp_path / "buffer"), str(tmp_path / "stored")
    child = FORK.Process(target=_writer, args=(location, marker))
    child.start()
    wait_for(lambda: os.path.exists(marker))
    # once the oldest episode is compacted, at a random moment of the rest
    wait_for(lambda: not is_hot_file(os.path.join(location, "data", "image", "c.0.0.0.0.0")))
    time.sleep(float(np.random.default_rng(round_).uniform(0, 0.002)))
    os.kill(child.pid, signal.SIGKILL)
    child.join(WAIT_S)
    assert child.exitcode == -signal.SIGKILL
    stored = {slot: episode(slot) for slot in range(24)}
    # a temp file of an interrupted rename, as a kill between write and rename leaves
    open(os.path.join(location, "data", "image", ".killed.partial"), "wb").close()
    check_reads(ReplayBuffer.from_folder(location, read_only=True), stored)
    buffer = ReplayBuffer.from_folder(location)  # its compactor finds the leftovers
    assert not os.path.exists(os.path.join(location, "data", "image", ".killed.partial"))
    wait_for(lambda: not hot_slots(buffer))
    assert hot_slots(buffer) == []
    check_reads(buffer, stored)
    buffer.close()
    ReplayBuffer(location, max_episodes=2, max_timesteps=STEPS, fields=FIELDS).close()  # no foreign entries


def test_a_replaced_buffer_never_compacts_the_new_one(tmp_path):
    old = make(tmp_path)
    old.store_episode(**episode(0))
    new = make(tmp_path)  # overwrite=True in the same process: the old object may not write
    new.store_episode(**episode(1))
    before = open(shard_file(new, 0), "rb").read()
    with pytest.raises(BufferLockedError, match="erased the buffer this object wrote to"):
        old.compact()
    assert open(shard_file(new, 0), "rb").read() == before and is_hot(new, 0)
    check_reads(new, {0: episode(1)})
    new.close()


def test_fetch_chunks_reads_again_with_a_fresh_index(tmp_path, monkeypatch):
    buffer = make(tmp_path)
    buffer.store_episode(**episode(0))
    array = buffer.storage.array("image")
    stale, fresh = array.read_indexes([0]), array.read_indexes
    buffer.compact()  # new offsets: the stale index points at the wrong bytes
    reads = []

    def first_stale(episodes):
        """The index as read before the compaction, then as it is."""
        reads.append(episodes)
        return stale if len(reads) == 1 else fresh(episodes)

    monkeypatch.setattr(array, "read_indexes", first_stale)
    chunk = array.fetch_chunks([(0, 3)])[0, 3]
    assert np.array_equal(chunk[0, 0], episode(0)["image"][3]) and len(reads) == 2
    buffer.close()


def test_an_edit_in_place_is_written_hot_and_compacted_again(tmp_path):
    buffer = make(tmp_path)
    stored = {slot: episode(slot) for slot in range(2)}
    for data in stored.values():
        buffer.store_episode(**data)
    buffer.compact()
    frame = np.full((40, 40, 3), 7, np.uint8)
    buffer.data["image"][0, 3] = frame  # merges into the compacted shard, written hot
    stored[0]["image"][3] = frame
    assert hot_slots(buffer) == [0]
    check_reads(buffer, stored)
    assert buffer.compact().episodes == 1 and hot_slots(buffer) == []
    check_reads(buffer, stored)
    buffer.close()


def test_close_compacts_a_slot_its_compactor_gave_up_to_a_write_that_overtook_it(tmp_path, monkeypatch):
    """The background thread compacting a killed writer's hot shard gives it up when a write
    overtakes it (an edit, a repair's re-seal); close() waited for the thread, then returned
    with that shard still hot, as its compact() had skipped the slot the thread held."""
    buffer = make(tmp_path)
    stored = {slot: episode(slot) for slot in range(2)}
    for data in stored.values():
        buffer.store_episode(**data)
    del buffer  # dropped without close(): its shards stay hot, the next writer's leftovers
    compacting, go = threading.Event(), threading.Event()
    compacted = ShardedArray.compacted

    def compacted_when_told(self, episode, data):
        if threading.current_thread().name == "replaybuf-compactor" and episode == 0:
            compacting.set()
            go.wait(WAIT_S)
        return compacted(self, episode, data)

    monkeypatch.setattr(ShardedArray, "compacted", compacted_when_told)
    buffer = ReplayBuffer.from_folder(str(tmp_path / "buffer"))
    assert compacting.wait(WAIT_S), "the compactor never took the leftover shard"
    frame = np.full((40, 40, 3), 7, np.uint8)
    buffer.data["image"][0, 3] = frame  # overtakes the compaction in hand: written hot again
    stored[0]["image"][3] = frame
    idle = buffer.storage._hot._idle
    wait_for = idle.wait_for

    def let_the_compactor_finish(predicate, timeout=None):  # close() waits for the thread here
        go.set()
        return wait_for(predicate, timeout)

    idle.wait_for = let_the_compactor_finish
    buffer.close()
    reader = ReplayBuffer.from_folder(str(tmp_path / "buffer"), read_only=True)
    assert hot_slots(reader) == []
    check_reads(reader, stored)


def test_a_field_measured_raw_is_never_hot(tmp_path):
    buffer = ReplayBuffer(str(tmp_path / "noise"), 4, STEPS, fields={"image": ("uint8", (40, 40, 3))})
    noise = np.random.default_rng(0).integers(0, 256, (STEPS, 40, 40, 3), dtype=np.uint8)
    buffer.store_episode(image=noise)  # camera noise: the codec measurement stores it raw
    assert buffer.storage.describe()["arrays"]["data/image"]["compressor"] == "none"
    assert hot_slots(buffer) == [] and buffer.compact().episodes == 0
    assert np.array_equal(np.asarray(buffer.get_all_data()["image"])[0], noise)
    buffer.close()


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_raw_payloads_decode_as_blosc_does(dtype):
    from replaybuf.storage._codecs import ChunkCodec, ChunkDamage

    config = {"cname": "lz4", "clevel": 9, "shuffle": "shuffle" if dtype == "float32" else "noshuffle"}
    codec = ChunkCodec(np.dtype(dtype), {"name": "blosc", "configuration": config})
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 255, (1, 30, 20, 3)).astype(dtype)  # incompressible: blosc stores it raw too
    smooth = np.repeat(np.arange(30, dtype=dtype), 60).reshape(1, 30, 20, 3)
    for chunk, hot in [(noise, True), (noise, False), (smooth, True), (smooth, False)]:
        out = np.empty_like(chunk)
        codec.decode_into(codec.encode(chunk, hot=hot), out)
        np.testing.assert_array_equal(out, chunk)
    data = bytearray(codec.encode(smooth, hot=True))
    assert data[2] & BLOSC_MEMCPYED
    data[4:8] = (smooth.nbytes - 8).to_bytes(4, "little")  # a header that does not match its payload
    with pytest.raises(ChunkDamage):
        codec.decode_into(bytes(data), np.empty_like(smooth))


def test_a_second_writer_object_in_the_process_leaves_nothing_hot_behind_the_first(tmp_path):
    # each object's compactor sees only its own writes: the second writes compressed, and the
    # first's hot episodes are compacted before the second writes
    first = make(tmp_path)
    episodes = {0: episode(0), 1: episode(1)}
    for data in episodes.values():
        first.store_episode(**data)
    assert hot_slots(first) == [0, 1]
    second = ReplayBuffer.from_folder(tmp_path / "buffer")
    assert second.storage._hot is None
    episodes[2] = episode(2)
    second.store_episode(**episodes[2])
    assert hot_slots(first) == [] and not is_hot(second, 2)
    episodes[3] = episode(3)
    first.store_episode(**episodes[3])  # its turn again: it reloads and writes after the second
    check_reads(first.refresh(), episodes)
    first.close()
    second.close()
    check_reads(ReplayBuffer.from_folder(tmp_path / "buffer", read_only=True), episodes)


def test_compact_through_a_second_writer_object_counts_the_first_s_episodes_it_compacts(tmp_path):
    # the second object has no hot tier of its own: its compact() compacts the first's hot
    # episodes as it takes its turn, and says so instead of reporting nothing done
    first = make(tmp_path)
    for seed in range(2):
        first.store_episode(**episode(seed))
    second = ReplayBuffer.from_folder(tmp_path / "buffer")
    summary = second.compact()
    assert hot_slots(first) == []
    assert summary.episodes == 2 and summary.bytes_before > summary.bytes_after > 0
    assert second.compact().episodes == 0  # its turn already: nothing left
    second.close()
    first.close()


@pytest.mark.parametrize("hot", [True, False], ids=["hot", "compacted"])
def test_a_fifo_at_a_shard_s_name_is_named_by_every_read_never_waited_on(tmp_path, hot):
    # a plain open of a FIFO waits forever for a writer to it: a reader hung on its first read
    buffer = make(tmp_path)
    buffer.store_episode(**episode(0))
    buffer.store_episode(**episode(1))
    if hot:
        buffer._release(compact=False)  # as a killed writer leaves it: hot
    else:
        buffer.close()
    path = shard_file(buffer, 1)
    os.unlink(path)
    os.mkfifo(path)

    def reader() -> ReplayBuffer:  # opened in the calls' thread: an open may map the shards
        return ReplayBuffer.from_folder(tmp_path / "buffer", read_only=True)

    refused_never_waited_on(
        path,
        [
            lambda: reader().data["image"][1],
            lambda: reader().get_all_data(),
            lambda: (steps := reader().dataset(timestep_level=True)).__getitems__(list(range(len(steps)))),
            lambda: reader().dataset().__getitems__([1]),
        ],
    )


def test_compact_counts_the_fields_it_compacted_before_a_write_overtook_the_slot(tmp_path, monkeypatch):
    """A write overtaking a slot between its fields' compactions made the summary leave out the
    fields compacted before it (their shards were compacted all the same)."""
    buffer = make(tmp_path)
    buffer.store_episode(**episode(0))
    sizes = {
        name: os.path.getsize(buffer.storage.array(name).kv.where(buffer.storage.array(name).shard_key(0)))
        for name in SHARDED
    }
    tier, compacted, calls = buffer.storage._hot, ShardedArray.compacted, []

    def overtaken_at_the_second_field(self, episode, data):
        calls.append(self.path)
        if len(calls) == 2:
            with tier.lock:
                tier.versions[episode] += 1  # as a write of the slot's next field would
        return compacted(self, episode, data)

    monkeypatch.setattr(ShardedArray, "compacted", overtaken_at_the_second_field)
    summary = buffer.compact()
    assert summary.bytes_before == sum(sizes.values()) and hot_slots(buffer) == []
    buffer.close()
