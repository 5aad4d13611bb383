"""Cold reads of compressed shards: a shard's frames checked (crc32c) and decoded in one call
(``ChunkCodec.decode_many_into``, through c-blosc and crc32c directly where they are
exported), whole-shard reads spread over the pool (``_kv.in_pool``), whole objects read with
one pread (``_kv._pread``). Each path gives exactly what the per-chunk path gives, and damage
is named as before."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np
import pytest

from replaybuf import CorruptChunkError, ReplayBuffer
from replaybuf.storage import _codecs, _kv, _shards
from replaybuf.storage._chunks import chunk_cache
from replaybuf.storage._codecs import BLOSC_HEADER, ChunkCodec, ChunkDamage

FRAME = (32, 32, 4)  # 4096 bytes a step: sharded, one frame per inner chunk
BLOSC = {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 9, "shuffle": "noshuffle"}}
PATHS = ["loop", "native", "numcodecs"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Every decode path: the compiled loop (``replaybuf/_native.c``, which also reads the
    ranges), c-blosc through ctypes chunk by chunk, and numcodecs chunk by chunk (these two read
    the ranges with a preadv each)."""
    if request.param == "loop":
        if _codecs._native_loop() is None or _kv._pread_many is None:
            pytest.skip("the compiled loop was not built here: the ctypes path serves")
        return request.param
    monkeypatch.setattr(_kv, "_pread_many", None)
    if request.param == "native":
        if _codecs._native() is None:
            pytest.skip("c-blosc or crc32c not exported here: the numcodecs path serves")
        monkeypatch.setattr(_codecs, "_native_loop", lambda: None)
    else:
        monkeypatch.setattr(_codecs, "_native", lambda: None)
    return request.param


def frames(count: int, seed: int = 0) -> np.ndarray:
    """Compressible frames (a gradient plus sparse noise), no two alike."""
    rng = np.random.default_rng(seed)
    base = np.arange(np.prod(FRAME), dtype=np.uint8).reshape(FRAME)
    out = np.repeat(base[None], count, axis=0) + np.arange(count, dtype=np.uint8)[:, None, None, None]
    out[rng.random(out.shape) < 0.05] = 7
    return out


def packed(codec: ChunkCodec, chunks: np.ndarray, hot: bool = False) -> tuple[bytes, list[tuple[int, int]]]:
    """The chunks encoded one after another behind 5 bytes of something else, and their ranges."""
    blobs = [codec.encode(chunk[None], hot=hot) for chunk in chunks]
    ranges, at = [], 5
    for blob in blobs:
        ranges.append((at, at + len(blob)))
        at += len(blob)
    return b"\x00" * 5 + b"".join(blobs), ranges


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("hot", [False, True])
@pytest.mark.parametrize("arrays", [False, True])
def test_decode_many_into_places_every_chunk(path, checksum, hot, arrays):
    """Ranges and offsets as lists, or as the int64 arrays a whole shard's read builds."""
    codec = ChunkCodec(np.dtype("uint8"), BLOSC, checksum=checksum)
    chunks = frames(6)
    data, ranges = packed(codec, chunks, hot)
    out = np.full((8, *FRAME), 99, np.uint8)
    rows = [7, 0, 3, 1, 6, 2]  # scattered, as a gather places sampled frames
    step = chunks[0].nbytes
    offsets = [row * step for row in rows]
    if arrays:
        ranges, offsets = np.array(ranges, np.int64), np.array(offsets, np.int64)
    codec.decode_many_into(memoryview(data), ranges, out, offsets, step)
    np.testing.assert_array_equal(out[rows], chunks)
    assert (out[[4, 5]] == 99).all()


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_decode_many_into_other_codecs_and_dtypes(dtype):
    for compressor in [None, {"name": "zstd", "configuration": {"level": 1}}, BLOSC]:
        codec = ChunkCodec(np.dtype(dtype), compressor, checksum=True)
        chunks = (frames(3) // 3).astype(dtype)
        data, ranges = packed(codec, chunks)
        out = np.zeros((3, *FRAME), dtype)
        codec.decode_many_into(data, ranges, out, [k * chunks[0].nbytes for k in range(3)], chunks[0].nbytes)
        np.testing.assert_array_equal(out, chunks)


def damaged(how: str, data: bytes, ranges: list[tuple[int, int]], codec: ChunkCodec) -> tuple[bytes, list]:
    """Damage chunk 2 of ``packed``'s output."""
    data, ranges = bytearray(data), list(ranges)
    start, stop = ranges[2]
    if how == "flip":
        data[start + BLOSC_HEADER + 3] ^= 0x10
    elif how == "short":
        ranges[2] = (start, start + BLOSC_HEADER - 1)
    elif how == "past-the-end":
        data = data[: stop - 10]
        ranges = ranges[:3]
    else:  # a header claiming another size, behind a checksum that matches it
        data[start + 4 : start + 8] = (int.from_bytes(data[start + 4 : start + 8], "little") - 1).to_bytes(4, "little")
        data[stop - 4 : stop] = _codecs.crc32c(bytes(data[start : stop - 4])).to_bytes(4, "little")
    return bytes(data), ranges


@pytest.mark.parametrize("how", ["flip", "short", "past-the-end", "header"])
@pytest.mark.parametrize("arrays", [False, True])
def test_a_damaged_chunk_is_named_by_position_after_the_ones_before_it(path, how, arrays):
    codec = ChunkCodec(np.dtype("uint8"), BLOSC, checksum=True)
    chunks = frames(4)
    data, ranges = damaged(how, *packed(codec, chunks), codec)
    out = np.zeros_like(chunks)
    step = chunks[0].nbytes
    offsets = [k * step for k in range(len(ranges))]
    with pytest.raises(ChunkDamage) as error:
        if arrays:
            codec.decode_many_into(data, np.array(ranges, np.int64), out, np.array(offsets, np.int64), step)
        else:
            codec.decode_many_into(data, ranges, out, offsets, step)
    assert error.value.item == 2
    np.testing.assert_array_equal(out[:2], chunks[:2])


def test_decode_many_into_refuses_an_output_it_cannot_fill():
    codec = ChunkCodec(np.dtype("uint8"), BLOSC, checksum=True)
    chunks = frames(2)
    data, ranges = packed(codec, chunks)
    step = chunks[0].nbytes
    with pytest.raises(ValueError, match="do not fit out"):
        codec.decode_many_into(data, ranges, np.zeros_like(chunks), [0, step + 1], step)
    with pytest.raises(ValueError, match="do not fit out"):
        codec.decode_many_into(data, np.array(ranges), np.zeros_like(chunks), np.array([-1, step]), step)
    with pytest.raises(ValueError, match="2 ranges for 1 offsets"):
        codec.decode_many_into(data, ranges, np.zeros_like(chunks), [0], step)
    with pytest.raises(ValueError, match="C-contiguous"):
        codec.decode_many_into(data, ranges, np.zeros((2, *FRAME, 2), np.uint8)[..., 0], [0, step], step)


def test_native_functions_agree_with_the_modules():
    native = _codecs._native()
    if native is None:
        pytest.skip("c-blosc or crc32c not exported here")
    decompress, extend = native
    codec = ChunkCodec(np.dtype("uint8"), BLOSC)
    chunk = frames(1)
    encoded = np.frombuffer(codec.encode(chunk), np.uint8)
    out = np.zeros_like(chunk)
    assert decompress(encoded.ctypes.data, out.ctypes.data, out.nbytes, 1) == out.nbytes
    np.testing.assert_array_equal(out, chunk)
    assert extend(0, encoded.ctypes.data, encoded.nbytes) == _codecs.crc32c(encoded)


# ---- spreading heavy tasks ----------------------------------------------------------------------


def test_spread_tasks_use_the_pool_even_on_two_cores(monkeypatch):
    monkeypatch.setattr(_kv, "CORES", 2)
    threads: dict[int, int] = {}
    both_took_one = threading.Event()

    def task(i: int) -> None:
        threads[i] = threading.get_ident()
        if len(set(threads.values())) == 2:
            both_took_one.set()

    _kv.in_pool(8, task)
    assert set(threads.values()) == {threading.get_ident()}  # small tasks: inline on 2 cores
    threads.clear()

    def first_waits_for_the_other_thread(i: int) -> None:
        task(i)
        if i == 0:  # else, on a loaded machine, one thread may take all 8 before the other starts
            assert both_took_one.wait(60), "no second thread took a task"

    _kv.in_pool(8, first_waits_for_the_other_thread, spread=True)
    assert sorted(threads) == list(range(8)) and len(set(threads.values())) == 2


def test_a_failing_task_returns_only_after_the_others_stopped(monkeypatch):
    monkeypatch.setattr(_kv, "CORES", 2)
    running, finished = [0], []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            running[0] += 1
        try:
            time.sleep(0.003)
            if i == 1:
                raise RuntimeError("task 1 failed")
        finally:
            with lock:
                running[0] -= 1
                finished.append(i)

    with pytest.raises(RuntimeError, match="task 1 failed"):
        _kv.in_pool(6, task, spread=True)
    assert running[0] == 0 and 1 in finished


def test_planned_items_run_while_the_plan_is_still_being_made(monkeypatch):
    """``in_pool_as_planned``: items of the first group run on another thread while the caller
    is still planning (the plan waits for one of them), every item runs once."""
    monkeypatch.setattr(_kv, "CORES", 2)
    first_done = threading.Event()
    ran: dict[int, int] = {}

    def plan():
        yield [0, 1]
        assert first_done.wait(60), "no item ran while the plan was being made"
        yield [2, 3, 4]
        yield []
        yield [5]

    def task(item: int) -> None:
        ran[item] = ran.get(item, 0) + 1
        if item in (0, 1):
            first_done.set()

    _kv.in_pool_as_planned(plan(), task)
    assert ran == dict.fromkeys(range(6), 1)


def test_a_failed_plan_raises_after_the_items_handed_out_finished(monkeypatch):
    monkeypatch.setattr(_kv, "CORES", 2)
    finished: list[int] = []
    started = threading.Event()

    def plan():
        yield [0, 1, 2]
        started.wait(60)
        raise ValueError("shard index damaged")

    def task(item: int) -> None:
        started.set()
        time.sleep(0.003)
        finished.append(item)

    with pytest.raises(ValueError, match="shard index damaged"):
        _kv.in_pool_as_planned(plan(), task)
    assert sorted(finished) == [0, 1, 2]  # none still writing when the caller sees the error


def test_planned_items_run_inline_in_a_loader_worker_and_from_a_busy_pool(monkeypatch):
    monkeypatch.setattr(_kv, "CORES", 2)
    threads: list[int] = []
    monkeypatch.setattr(_kv, "_in_loader_worker", lambda: True)
    _kv.in_pool_as_planned(iter([[0, 1], [2]]), lambda item: threads.append(threading.get_ident()))
    assert threads == [threading.get_ident()] * 3
    monkeypatch.setattr(_kv, "_in_loader_worker", lambda: False)
    # every pool thread busy: the caller does the work itself instead of waiting for a helper
    release = threading.Event()
    blockers = [_kv.thread_pool().submit(release.wait, 10) for _ in range(_kv.thread_pool()._max_workers)]
    try:
        done: list[int] = []
        _kv.in_pool_as_planned(iter([[0, 1], [2]]), done.append)
        assert sorted(done) == [0, 1, 2]
    finally:
        release.set()
        for blocker in blockers:
            blocker.result()


# ---- whole-object reads -----------------------------------------------------------------------


def test_whole_objects_and_ranges_read_past_a_short_pread(tmp_path, monkeypatch):
    kv = _kv.LocalKV(str(tmp_path))
    payload = os.urandom(10_000)
    kv.set("a/b", payload)
    real = os.pread
    monkeypatch.setattr(_kv.os, "pread", lambda fd, n, offset: real(fd, min(n, 999), offset))  # as past 2 GiB
    assert kv.get("a/b") == payload
    assert kv.get_ranges([("a/b", 10, 9_000), ("a/b", -5_000, None)]) == [payload[10:9_000], payload[-5_000:]]
    assert kv.get("a/missing") is None


# ---- through the buffer -------------------------------------------------------------------------

STEPS = 60


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A closed zarr buffer (compacted shards) of 5 episodes, 3 of them whole, and its frames."""
    location = str(tmp_path_factory.mktemp("cold") / "b")
    buffer = ReplayBuffer(
        location,
        6,
        STEPS,
        fields={"frame": {"dtype": "uint8", "shape": FRAME, "compressor": "blosc-lz4"}, "reward": "float"},
    )
    episodes = [frames(length, seed) for seed, length in enumerate([STEPS, 17, STEPS, 1, STEPS])]
    for episode in episodes:
        buffer.store_episode(frame=episode, reward=np.ones(len(episode), np.float32))
    buffer.close()
    return location, episodes


@pytest.mark.parametrize("parallel", [True, False])
def test_cold_spans_equal_the_frames_written(cold, path, parallel, monkeypatch):
    monkeypatch.setattr(_kv, "CORES", 2)
    monkeypatch.setattr(_shards, "SPREAD_BYTES", 0)  # every read spread: the path trajectories take
    location, episodes = cold
    storage = ReplayBuffer.from_folder(location, read_only=True).storage
    assert storage.describe()["arrays"]["data/frame"]["compressor"].startswith("blosc")
    slots = np.array([4, 0, 2, 1, 3, 0])
    starts = np.array([0, 0, 5, 3, 0, 40])  # whole shards, and ranges under half of one
    lengths = np.array([STEPS, STEPS, 20, 14, 1, 20])
    out = np.full((len(slots), STEPS, *FRAME), 1, np.uint8)
    storage.read_spans("frame", slots, starts, lengths, out, parallel=parallel)
    for row, (e, s, n) in enumerate(zip(slots, starts, lengths)):
        np.testing.assert_array_equal(out[row, :n], episodes[e][s : s + n])
        assert (out[row, n:] == 1).all()
    timesteps = np.array([0, 16, 59, 0, 33])
    gathered = storage.gather("frame", np.array([2, 1, 4, 3, 0]), timesteps)
    np.testing.assert_array_equal(gathered, [episodes[e][t] for e, t in zip([2, 1, 4, 3, 0], timesteps)])


def test_a_flip_in_a_cold_shard_names_its_frame(cold, path, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(_kv, "CORES", 2)
    location = str(tmp_path / "copy")
    shutil.copytree(cold[0], location)
    shard = os.path.join(location, "data", "frame", "c.2.0.0.0.0")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x04  # inside a frame near the middle of episode 2
    open(shard, "wb").write(bytes(data))
    buffer = ReplayBuffer.from_folder(location, read_only=True)
    with pytest.raises(CorruptChunkError) as error:
        buffer.get_all_data()
    assert error.value.field == "data/frame" and error.value.slot == 2
    assert error.value.location.startswith(f"{shard}, inner chunk ")
    with pytest.raises(CorruptChunkError, match="crc32c"):
        buffer.storage.read_spans(
            "frame", np.array([2]), np.zeros(1, int), np.array([STEPS]), np.zeros((1, STEPS, *FRAME), np.uint8)
        )


@pytest.mark.parametrize("medium", ["file", "memory"])
def test_ranges_read_into_place_short_or_absent(tmp_path, medium, path):
    """``get_ranges_into``: LocalKV's reads (compiled or a preadv each, with and without kept
    handles) and the base class's copy of ``get_ranges`` (a zarr memory store) agree; a file
    that cannot be read (a folder in its place) is named."""
    payload = os.urandom(3_000)
    if medium == "file":
        kv = _kv.LocalKV(str(tmp_path))
    else:
        storage = ReplayBuffer(f"memory://cold-{os.getpid()}-{path}/b", 2, 4, fields={"reward": "float"}).storage
        kv = storage.kv
        assert not isinstance(kv, _kv.LocalKV)
    kv.set("x/a", payload)
    requests = [("x/a", 10, 110), ("x/missing", 0, 50), ("x/a", 2_950, 3_050), ("x/a", 0, 10)]
    for generations in [None, [1, 1, 1, 1]]:
        out = bytearray(b"\xff" * 260)
        assert kv.get_ranges_into(requests, memoryview(out), generations) == [100, -1, 50, 10]
        assert out[:100] == payload[10:110] and out[150:200] == payload[2_950:] and out[250:] == payload[:10]
    if medium == "file":
        os.mkdir(tmp_path / "x" / "folder")
        with pytest.raises(IsADirectoryError) as error:
            kv.get_ranges_into([("x/a", 0, 10), ("x/folder", 0, 10)], memoryview(bytearray(20)))
        assert error.value.filename == str(tmp_path / "x" / "folder")


def test_a_truncated_cold_shard_fails_the_gathers_that_reach_past_its_end(cold, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(chunk_cache(), "resident_bytes", 0)  # frames read from the shards, not RAM
    location = str(tmp_path / "copy")
    shutil.copytree(cold[0], location)
    shard = os.path.join(location, "data", "frame", "c.4.0.0.0.0")
    buffer = ReplayBuffer.from_folder(location, read_only=True)
    storage = buffer.storage
    generations = np.asarray(buffer.generations)[[4, 2]]
    storage.gather("frame", np.array([4, 2]), np.array([0, 0]), generations)  # the indexes, cached
    with open(shard, "r+b") as f:  # the last frames and the index gone: an index read before sees them
        f.truncate(os.path.getsize(shard) - 4_000)
    monkeypatch.setattr(_shards, "COMPACTION_RETRIES", 0)  # the first read's error, not a retry's
    with pytest.raises(CorruptChunkError, match="the shard ends before the chunk") as error:
        storage.gather("frame", np.array([4, 2]), np.array([STEPS - 1, 3]), generations)
    assert error.value.slot == 4 and error.value.location.startswith(shard)
    with pytest.raises(CorruptChunkError, match="shard index"):  # read again: the index is gone
        storage.gather("frame", np.array([4]), np.array([0]))


def test_spread_tasks_do_not_wait_for_a_busy_pool(monkeypatch):
    """With every pool thread busy elsewhere, the caller runs all the tasks itself and returns
    (a helper that never started is not waited for)."""
    monkeypatch.setattr(_kv, "CORES", 2)
    release = threading.Event()
    pool = _kv.thread_pool()
    blockers = [pool.submit(release.wait) for _ in range(_kv.POOL_THREADS)]
    done: list[int] = []
    caller = threading.Thread(target=_kv.in_pool, args=(5, done.append), kwargs={"spread": True})
    try:
        caller.start()
        caller.join(timeout=30)  # returns at once; hangs until the release where helpers are awaited
        assert not caller.is_alive() and sorted(done) == list(range(5))
    finally:
        release.set()
        caller.join()
        for blocker in blockers:
            blocker.result()


@pytest.mark.parametrize(
    "bad", [(-5, 40), (10**12, 10**12 + 40), (60, 20), (0, 2**62)], ids=["negative", "far", "reversed", "huge"]
)
def test_absurd_ranges_are_damage_never_a_read_outside_the_data(path, bad):
    """Ranges from a crafted shard index (negative, beyond the data, reversed, absurdly long)
    name the chunk as damaged on every decode path; nothing outside ``data`` is read."""
    codec = ChunkCodec(np.dtype("uint8"), BLOSC, checksum=True)
    chunks = frames(2)
    data, ranges = packed(codec, chunks)
    out = np.zeros_like(chunks)
    step = chunks[0].nbytes
    with pytest.raises(ChunkDamage) as error:
        codec.decode_many_into(data, [ranges[0], bad], out, [0, step], step)
    assert error.value.item == 1
    np.testing.assert_array_equal(out[0], chunks[0])


def test_a_forged_shard_index_never_sizes_a_read(cold, tmp_path, monkeypatch):
    """An index entry naming a chunk larger than any encoding of it, behind a crc32c that
    matches (forged, or an index written without one), is damage named by file: no read is
    sized by it."""
    import shutil

    monkeypatch.setattr(chunk_cache(), "resident_bytes", 0)
    location = str(tmp_path / "copy")
    shutil.copytree(cold[0], location)
    shard = os.path.join(location, "data", "frame", "c.2.0.0.0.0")
    data = bytearray(open(shard, "rb").read())
    index_at = len(data) - (16 * STEPS + 4)
    data[index_at + 8 : index_at + 16] = (1 << 40).to_bytes(8, "little")  # chunk 0: a terabyte
    data[-4:] = _codecs.crc32c(bytes(data[index_at:-4])).to_bytes(4, "little")
    open(shard, "wb").write(bytes(data))
    buffer = ReplayBuffer.from_folder(location, read_only=True)
    for read in (
        lambda: buffer.storage.gather("frame", np.array([2, 0]), np.array([0, 1])),
        lambda: buffer.get_all_data(),
    ):
        with pytest.raises(CorruptChunkError, match="shard index names a chunk over") as error:
            read()
        assert error.value.slot == 2 and shard in str(error.value)


def mapped_under(folder: str) -> list[str]:
    """The files under ``folder`` this process has mapped now (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if folder in line]


@pytest.mark.parametrize("parallel", [True, False])
def test_whole_blosc_shards_decode_from_maps_in_parts(cold, path, parallel, monkeypatch):
    """Spans reading whole blosc shards on local disk decode from maps of the files (no read of
    a shard into memory), in parts of about ``SPREAD_BYTES`` over the pool, ``MAPPED_SHARDS``
    mapped at a time; no map outlives the read. Spans under half a shard read ranges as before."""
    monkeypatch.setattr(_kv, "CORES", 2)
    monkeypatch.setattr(_shards, "SPREAD_BYTES", 5 * int(np.prod(FRAME)))  # ~12 parts a whole shard
    monkeypatch.setattr(_shards, "MAPPED_SHARDS", 2)
    mapped: list[str] = []
    read: list[str] = []
    real_map, real_read = _kv.LocalKV.map, _kv.LocalKV._read
    monkeypatch.setattr(_kv.LocalKV, "map", lambda self, key: mapped.append(key) or real_map(self, key))
    monkeypatch.setattr(
        _kv.LocalKV, "_read", lambda self, key, limit=None: read.append(key) or real_read(self, key, limit)
    )
    location, episodes = cold
    storage = ReplayBuffer.from_folder(location, read_only=True).storage
    slots = np.array([4, 0, 2, 1, 3, 0])
    starts = np.array([0, 0, 0, 0, 0, 2])  # the last: all but 2 frames, still a whole-shard read
    lengths = np.array([len(episodes[e]) for e in slots]) - starts
    out = np.full((len(slots), STEPS, *FRAME), 1, np.uint8)
    storage.read_spans("frame", slots, starts, lengths, out, parallel=parallel)
    for row, (e, s, n) in enumerate(zip(slots, starts, lengths)):
        np.testing.assert_array_equal(out[row, :n], episodes[e][s : s + n])
        assert (out[row, n:] == 1).all()
    array = storage.array("frame")
    assert sorted(key for key in mapped if key.startswith("data/")) == sorted(array.shard_key(e) for e in [4, 0, 2, 0])
    assert not [key for key in read if key.startswith("data/frame/")]
    if os.path.exists("/proc/self/maps"):
        assert not mapped_under(os.path.join(location, "data"))  # format 7 maps meta/_generation (kept)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="maps are listed in /proc/self/maps (Linux)")
def test_a_pool_thread_that_still_holds_the_read_task_keeps_no_map(cold, monkeypatch):
    """A pool thread's finished work item holds the task it ran a moment after the read returns
    (concurrent.futures drops it after setting the result): the maps are let go all the same.
    They outlived the read by that moment on a loaded machine (xdist) and failed the test above."""
    lingering = []
    helped = _kv._helped

    @contextlib.contextmanager
    def holding(run, threads):
        with helped(run, threads):
            yield
        lingering.append(run)  # as the work item of a helper not yet deleted

    monkeypatch.setattr(_kv, "_helped", holding)
    monkeypatch.setattr(_shards, "SPREAD_BYTES", 5 * int(np.prod(FRAME)))
    location, episodes = cold
    storage = ReplayBuffer.from_folder(location, read_only=True).storage
    out = np.zeros((2, STEPS, *FRAME), np.uint8)
    storage.read_spans("frame", np.array([0, 2]), np.array([0, 0]), np.array([STEPS, STEPS]), out, parallel=True)
    np.testing.assert_array_equal(out, np.stack([episodes[0], episodes[2]]))
    assert lingering, "the read did not go through the pool"
    assert not mapped_under(os.path.join(location, "data"))  # format 7 maps meta/_generation (kept)


def test_shards_of_other_codecs_are_read_not_mapped(tmp_path, monkeypatch):
    """Only blosc shards are always replaced whole by a rename: others (zstd) may be written in
    place, where a map could see a truncation, so whole reads of them copy the file."""
    mapped: list[str] = []
    real_map = _kv.LocalKV.map
    monkeypatch.setattr(_kv.LocalKV, "map", lambda self, key: mapped.append(key) or real_map(self, key))
    buffer = ReplayBuffer(
        str(tmp_path / "b"), 2, STEPS, fields={"frame": {"dtype": "uint8", "shape": FRAME, "compressor": "zstd"}}
    )
    episode = frames(STEPS)
    buffer.store_episode(frame=episode)
    buffer.close()
    data = ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True).get_all_data()
    np.testing.assert_array_equal(data["frame"][0].numpy(), episode)
    assert not [key for key in mapped if key.startswith("data/")]  # (meta chunks are mapped: KeyValue.mapped)


@pytest.mark.parametrize("how", ["empty", "cut", "folder", "absent", "flip"])
@pytest.mark.parametrize("spread", [False, True])
def test_a_whole_shard_damaged_outside_is_named_from_its_map(cold, tmp_path, how, spread, monkeypatch):
    """A shard emptied, cut short (its index gone), replaced by a folder, deleted or with a bit
    flipped in a frame fails the mapped read with the error the copying read gave, naming the
    slot or the file; ``spread``: shards mapped and parts decoded by two pool threads, where
    the failure of one thread's shard ends the read once the other thread finished."""
    import shutil

    monkeypatch.setattr(_kv, "CORES", 2)
    if spread:
        monkeypatch.setattr(_shards, "SPREAD_BYTES", 0)
    location = str(tmp_path / "copy")
    shutil.copytree(cold[0], location)
    shard = os.path.join(location, "data", "frame", "c.2.0.0.0.0")
    if how == "folder":
        os.remove(shard)
        os.mkdir(shard)
    elif how == "absent":
        os.remove(shard)
    elif how == "flip":
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0x04  # inside a frame near the middle of the episode
        open(shard, "wb").write(bytes(data))
    else:
        with open(shard, "r+b") as f:
            f.truncate(0 if how == "empty" else os.path.getsize(shard) - 4_000)
    buffer = ReplayBuffer.from_folder(location, read_only=True)
    if how == "folder":
        with pytest.raises(IsADirectoryError) as folder:
            buffer.get_all_data()
        assert folder.value.filename == shard
        return
    with pytest.raises(CorruptChunkError) as error:
        buffer.get_all_data()
    assert error.value.slot == 2
    if how == "flip":
        assert "crc32c" in str(error.value) and error.value.location.startswith(f"{shard}, inner chunk ")
    elif how != "absent":
        assert "shard index" in str(error.value) and shard in str(error.value)
