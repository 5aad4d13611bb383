"""Bulk whole-episode reads (``storage.spans.read_spans``, ``ChunkedArray.read_into``) give
exactly what the per-element path (``storage.gather``) gives, on every backend, and what
``get_all_data`` and trajectory batches are built on."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from replaybuf import ConcatReplayBuffer, ReplayBuffer, ReplayDatasetTrajectory, StorageError
from replaybuf.analysis import get_all_data
from replaybuf.sampling.fetch import Fetcher
from replaybuf.storage import _kv
from replaybuf.storage.spans import Spans, fill_beyond, read_spans_by_rows

FRAME = (32, 32, 4)  # 4096 bytes a step: sharded, one frame per inner chunk, on the zarr backend
FIELDS = {
    "frame": ("uint8", FRAME),
    "clip": {"dtype": "uint8", "shape": FRAME, "chunks": 3, "compressor": "zstd:1"},  # 3 frames per inner chunk
    "raw": {"dtype": "uint8", "shape": FRAME, "compressor": "none"},
    "state": ("float", (3,)),
    "action": ("int", 2, -1),  # padding is the default, -1
    "reward": "float",
}
MAX_STEPS = 14
LENGTHS = [5, 14, 3, 9, 7, 1, 11, 8]


def episode(index: int, length: int) -> dict[str, np.ndarray]:
    """Frames with all-zero steps (left out of the shard) and, for episode 3, none at all."""
    rng = np.random.default_rng(index)
    frames = rng.integers(0, 256, (length, *FRAME), dtype=np.uint8)
    frames[rng.random(length) < 0.3] = 0
    if index == 3:
        frames[:] = 0
    return {
        "frame": frames,
        "clip": frames[::-1].copy(),
        "raw": frames // 2,
        "state": rng.normal(size=(length, 3)).astype(np.float32),
        "action": rng.integers(0, 5, (length, 2)).astype(np.int32),
        "reward": rng.uniform(-1, 1, length).astype(np.float32),
    }


def make_buffer(location: str, kwargs: dict, lengths=LENGTHS, max_episodes: int = 6) -> ReplayBuffer:
    """A circular buffer that wrapped: the last ``max_episodes`` episodes are kept."""
    buffer = ReplayBuffer(
        location, max_episodes=max_episodes, max_timesteps=MAX_STEPS, fields=FIELDS, circular=True, **kwargs
    )
    for index, length in enumerate(lengths):
        buffer.store_episode(**episode(index, length))
    return buffer


@pytest.fixture
def buffer(make_location):
    location, kwargs = make_location()
    return make_buffer(location, kwargs)


def per_element(storage, name: str, episodes, starts, lengths, width: int, fill) -> np.ndarray:
    """The reference: every step through ``gather``, padding set to ``fill``."""
    shape = storage.array(name).shape[2:]
    out = None
    for row, (e, s, n) in enumerate(zip(episodes, starts, lengths)):
        values = storage.gather(name, np.full(n, e), np.arange(s, s + n))
        if out is None:
            out = np.full((len(episodes), width, *shape), fill, values.dtype)
        out[row, :n] = values
    return out


def random_spans(rng: np.random.Generator, slots: np.ndarray, count: int):
    episodes = rng.choice(slots, count)
    starts = rng.integers(0, MAX_STEPS, count)
    lengths = rng.integers(0, MAX_STEPS - starts + 1)
    return episodes, starts, lengths


@pytest.mark.parametrize("name", list(FIELDS))
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("named", [False, True], ids=["stored", "named-generations"])
def test_read_spans_matches_per_element_reads(buffer, name, parallel, named, monkeypatch):
    """Read from the store, and naming generations (served from resident copies where the
    backend keeps them), with every copy of several spans on the pool when ``parallel``."""
    monkeypatch.setattr(_kv, "PARALLEL_COPY_BYTES", 0)
    storage, slots = buffer.storage, np.arange(buffer.max_episodes)
    generations = np.asarray(buffer.generations)
    rng = np.random.default_rng(7)
    cases = [random_spans(rng, slots, 9) for _ in range(4)]
    cases.append((slots, np.zeros(len(slots), int), buffer.episode_lens[slots]))  # whole episodes
    cases.append((np.array([2, 2, 0]), np.array([0, 4, 13]), np.array([14, 3, 1])))  # repeats, last step
    for episodes, starts, lengths in cases:
        out = np.full((len(episodes), MAX_STEPS, *storage.array(name).shape[2:]), 77, storage.array(name).dtype)
        named_generations = generations[episodes] if named else None
        storage.read_spans(name, episodes, starts, lengths, out, parallel=parallel, generations=named_generations)
        np.testing.assert_array_equal(out, per_element(storage, name, episodes, starts, lengths, MAX_STEPS, 77))


@pytest.mark.parametrize("cache", [None, "ram"])
def test_windows_are_zero_past_each_length(buffer, cache):
    """Rows shorter than the width (one of no steps, whose start lies past the time axis) read
    their steps and zeros after them, in batches mostly padding and mostly full."""
    lens, generations = np.array(buffer.episode_lens, np.int64), np.array(buffer.generations, np.int64)
    slots = np.flatnonzero(lens > 0)
    fetcher = Fetcher(buffer, ["frame", "state", "action"], slots, lens, generations, cache=cache)
    episodes = slots[[0, 1, 2, 1, 3]]
    starts = np.array([MAX_STEPS, 2, 0, lens[episodes[3]] - 1, 0])
    for lengths in (np.array([0, 3, 1, 1, 4]), np.array([0, 4, 3, 1, 4])):
        for name in ("frame", "state", "action"):
            windows = fetcher.windows(name, episodes, starts, lengths, 4)
            reference = per_element(buffer.storage, name, episodes, starts, lengths, 4, 0)
            np.testing.assert_array_equal(windows, reference, err_msg=f"{name} {lengths}")


@pytest.mark.parametrize("name", ["frame", "clip", "state"])
def test_generic_path_through_read_rows_agrees(buffer, name):
    storage, rng = buffer.storage, np.random.default_rng(3)
    episodes, starts, lengths = random_spans(rng, np.arange(buffer.max_episodes), 12)
    shape, dtype = storage.array(name).shape[2:], storage.array(name).dtype
    bulk, generic = (np.full((12, MAX_STEPS, *shape), 5, dtype) for _ in range(2))
    storage.read_spans(name, episodes, starts, lengths, bulk)
    read_spans_by_rows(storage, name, Spans.of(episodes, starts, lengths), generic)
    np.testing.assert_array_equal(bulk, generic)


def test_zarr_arrays_read_rows_into_out_and_with_generations(tmp_path):
    buffer = make_buffer(str(tmp_path / "b"), {})
    frames, state = buffer.storage.array("frame"), buffer.storage.array("state")
    slots = np.array([5, 0, 3])
    for array in (frames, state):
        out = np.empty((3, 6, *array.shape[2:]), array.dtype)
        assert array.read_rows(slots, 2, 8, out=out) is out
        flat = array.gather(np.repeat(slots, 6), np.tile(np.arange(2, 8), 3))
        np.testing.assert_array_equal(out, flat.reshape(out.shape))
        generations = buffer.storage.read_meta("_generation")[slots]
        again = np.zeros_like(out)
        array.read_into(again, slots, np.full(3, 2), np.full(3, 6), generations)  # ranged shard reads / resident rows
        np.testing.assert_array_equal(again, out)


def test_shard_that_was_never_written_reads_as_zero(tmp_path):
    buffer = make_buffer(str(tmp_path / "b"), {}, lengths=[4, 6], max_episodes=3)
    frames = buffer.storage.array("frame")
    out = np.full((2, 6, *FRAME), 9, np.uint8)
    frames.read_into(out, [2, 2], [0, 5], [6, 1])  # slot 2: no shard at all; whole and ranged reads
    assert (out[0] == 0).all() and (out[1, :1] == 0).all() and (out[1, 1:] == 9).all()


def test_read_into_rejects_a_wrong_output_or_span(tmp_path):
    frames = make_buffer(str(tmp_path / "b"), {}).storage.array("frame")
    with pytest.raises(ValueError, match="out has dtype float32"):
        frames.read_into(np.empty((1, 4, *FRAME), np.float32), [0], [0], [4])
    with pytest.raises(ValueError, match="out has dtype uint8 and shape"):
        frames.read_into(np.empty((1, 4, 3), np.uint8), [0], [0], [4])
    with pytest.raises(ValueError, match="must lie within the time axis"):
        frames.read_into(np.empty((1, 20, *FRAME), np.uint8), [0], [10], [8])
    with pytest.raises(ValueError, match="must lie within the time axis"):
        frames.read_into(np.empty((1, 4, *FRAME), np.uint8), [0], [0], [5])
    with pytest.raises(ValueError, match="differ in length"):
        frames.read_into(np.empty((2, 4, *FRAME), np.uint8), [0, 1], [0], [4, 4])


def test_fill_beyond_pads_after_each_length():
    out = np.zeros((3, 4, 2), np.int32)
    fill_beyond(out, np.array([4, 0, 2]), -1)
    assert (out[0] == 0).all() and (out[1] == -1).all() and (out[2, :2] == 0).all() and (out[2, 2:] == -1).all()


@pytest.mark.parametrize("scheduler", ["threads", "sync", "processes", "threads, a call an episode"])
def test_get_all_data_equals_per_element_reads(buffer, scheduler, monkeypatch):
    """In this process the storage decodes into the results (one call per ``_CALL_BYTES``);
    a scheduler elsewhere (processes) computes the dask arrays: the same rows either way."""
    if scheduler.endswith("an episode"):
        monkeypatch.setattr("replaybuf.analysis._CALL_BYTES", 1)
        scheduler = "threads"
    storage = buffer.storage
    if scheduler == "processes" and storage.location.startswith("memory://"):
        with pytest.raises(StorageError, match="lives in the memory of the process that created it"):
            get_all_data(buffer, scheduler=scheduler)  # not an empty store read as zeros
        return
    slots = np.flatnonzero(buffer.episode_lens > 0)  # slot order, as the seed
    lens = buffer.episode_lens[slots]
    data = get_all_data(buffer, scheduler=scheduler)
    for name, field in buffer.schema.fields.items():
        reference = per_element(storage, name, slots, np.zeros(len(slots), int), lens, int(lens.max()), field.fill)
        assert data[name].dtype == torch.from_numpy(reference).dtype
        np.testing.assert_array_equal(data[name].numpy(), reference)
    np.testing.assert_array_equal(data["episode_lens"].numpy(), lens)


def test_trajectory_batches_equal_per_element_reads(buffer):
    dataset = ReplayDatasetTrajectory(buffer, include_metadata=False)
    positions = [4, 0, 2, 5, 4]
    batch = dataset.__getitems__(positions).batch
    slots = dataset._slots[positions]
    lens = buffer.episode_lens[slots]
    for name in FIELDS:
        reference = per_element(buffer.storage, name, slots, np.zeros(len(slots), int), lens, int(lens.max()), 0)
        np.testing.assert_array_equal(batch[name].numpy(), reference)
    np.testing.assert_array_equal(batch["_lens"].numpy(), lens)


def test_trajectory_ram_cache_equals_storage_reads(buffer):
    stored = ReplayDatasetTrajectory(buffer, include_metadata=False).__getitems__([0, 1, 2, 3]).batch
    cached = ReplayDatasetTrajectory(buffer, include_metadata=False, cache="ram").__getitems__([0, 1, 2, 3]).batch
    for name in FIELDS:
        np.testing.assert_array_equal(stored[name].numpy(), cached[name].numpy())


def test_concat_reads_spans_across_members_of_different_lengths(tmp_path):
    make_buffer(str(tmp_path / "a"), {}, lengths=[5, 14, 3], max_episodes=4)
    second = ReplayBuffer(str(tmp_path / "b"), max_episodes=3, max_timesteps=6, fields=FIELDS)
    for index, length in enumerate([6, 2]):
        second.store_episode(**episode(10 + index, length))
    concat = ConcatReplayBuffer([str(tmp_path / "a"), str(tmp_path / "b")])
    storage = concat.storage
    episodes, starts, lengths = np.array([4, 0, 1, 3, 5]), np.array([0, 2, 0, 4, 0]), np.array([6, 3, 14, 7, 2])
    for name in ("frame", "state"):
        shape, dtype = storage.array(name).shape[2:], storage.array(name).dtype
        bulk, generic = (np.full((5, MAX_STEPS, *shape), 3, dtype) for _ in range(2))
        storage.read_spans(name, episodes, starts, lengths, bulk)
        read_spans_by_rows(storage, name, Spans.of(episodes, starts, lengths), generic)
        np.testing.assert_array_equal(bulk, generic)
    data = get_all_data(concat)
    np.testing.assert_array_equal(data["frame"][3, :6].numpy(), episode(10, 6)["frame"])
    assert (data["frame"][3, 6:] == 0).all()


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.bool_])
def test_byte_moments_equal_float64_moments(dtype):
    from replaybuf.analysis import _block_moments

    rng = np.random.default_rng(1)
    block = rng.integers(-128 if dtype == np.int8 else 0, 2 if dtype == np.bool_ else 128, (4, 600, 3, 2)).astype(dtype)
    lens = np.array([600, 0, 17, 257])
    count, mean, m2, low, high = _block_moments(block, lens)
    steps = block[np.arange(600)[None] < lens[:, None]].reshape(-1, 6)
    assert count == len(steps)
    np.testing.assert_allclose(mean, steps.astype(np.float64).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(m2 / count, steps.astype(np.float64).var(axis=0), rtol=1e-9)
    np.testing.assert_array_equal(low, steps.min(axis=0))
    np.testing.assert_array_equal(high, steps.max(axis=0))


def test_parallel_first_reads_of_a_small_field_share_one_resident_copy(tmp_path):
    """Reads naming generations use the zarr backend's resident copy of small fields; threads
    reading other slots of one array at once (get_all_data's dask tasks) all see their rows,
    none a copy another thread replaced while it was first made (about 1 read in 7 did)."""
    location = str(tmp_path / "b")
    writer = ReplayBuffer(location, max_episodes=8, max_timesteps=50, fields={"state": ("float", 4)})
    for i in range(8):
        writer.store_episode(state=np.full((50, 4), i + 1, np.float32))
    writer.close()
    wrong = []
    for _ in range(30):
        reader = ReplayBuffer.from_folder(location, read_only=True)
        generations, start = reader._meta["_generation"], threading.Barrier(4)

        def read(slot: int, storage=reader.storage, generations=generations, start=start) -> None:
            out = np.zeros((1, 50, 4), np.float32)
            start.wait()
            storage.read_spans(
                "state", np.array([slot]), np.zeros(1, np.int64), np.full(1, 50), out, False, generations[[slot]]
            )
            if not (out == slot + 1).all():
                wrong.append(slot)

        threads = [threading.Thread(target=read, args=(slot,)) for slot in (0, 2, 4, 6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert wrong == []


def test_get_into_reads_byte_ranges_into_buffers_on_files_and_stores(tmp_path):
    """``KeyValue.get_into``: files (read in place) and other stores (fetched, then copied)
    fill each buffer with its byte range and return the object's size; an absent object
    returns None and leaves its buffer as it was, a short one fills what it has."""
    import zarr.storage

    memory = zarr.storage.MemoryStore()
    for kv in (_kv.LocalKV(str(tmp_path)), _kv.StoreKV(lambda: memory, "memory")):
        kv.set_many({"a/c.0": bytes(range(100)), "b": b"xyz"})
        outs = [bytearray(b"-" * n) for n in (10, 3, 5, 4)]
        requests = [("a/c.0", 90, outs[0]), ("a/c.0", 0, outs[1]), ("b", 1, outs[2]), ("none", 0, outs[3])]
        sizes = kv.get_into([(key, start, memoryview(out)) for key, start, out in requests])
        assert sizes == [100, 100, 3, None], type(kv).__name__
        assert outs == [bytearray(range(90, 100)), bytearray(range(3)), bytearray(b"yz---"), bytearray(b"----")]


def test_a_mapped_object_shows_the_file_as_it_is_now(tmp_path):
    """``KeyValue.mapped`` (the per-batch re-check of generations reads through it): a write in
    place shows at once, a replaced file is mapped again, another size or an absent file gives
    None (the caller reads the usual way), and an object store maps nothing."""
    import os

    import zarr.storage

    kv = _kv.LocalKV(str(tmp_path))
    kv.set_many({"meta/c.0": np.arange(4, dtype="<i8").tobytes()})
    mapped = kv.mapped("meta/c.0", 32)
    assert mapped is not None and mapped.view("<i8").tolist() == [0, 1, 2, 3]
    assert kv.write_at("meta/c.0", 8, np.int64(7).tobytes())
    assert kv.mapped("meta/c.0", 32).view("<i8").tolist() == [0, 7, 2, 3]  # in place: the same map
    kv.set_many({"meta/c.0": np.arange(10, 14, dtype="<i8").tobytes()})  # a temp file renamed over it
    assert kv.mapped("meta/c.0", 32).view("<i8").tolist() == [10, 11, 12, 13]
    assert kv.mapped("meta/c.0", 40) is None  # not the size asked
    os.truncate(tmp_path / "meta" / "c.0", 16)
    assert kv.mapped("meta/c.0", 32) is None
    assert kv.mapped("absent", 32) is None
    memory = zarr.storage.MemoryStore()
    remote = _kv.StoreKV(lambda: memory, "memory")
    remote.set_many({"meta/c.0": bytes(32)})
    assert remote.mapped("meta/c.0", 32) is None


def test_a_readers_recheck_sees_a_slot_reused_through_its_map(tmp_path):
    """A reader's re-check of generations (``committed_generations``, read through a map of
    the ``_generation`` chunk) sees each generation a writer commits at once; a buffer created
    again in its place is reported, never read through the old map."""
    from replaybuf import BufferReplacedError
    from replaybuf.consistency import committed_generations

    fields = {"state": ("float", (3,))}
    folder = str(tmp_path / "b")
    writer = ReplayBuffer(folder, max_episodes=2, max_timesteps=4, fields=fields, circular=True)
    writer.store_episode(state=np.zeros((3, 3), np.float32))
    reader = ReplayBuffer.from_folder(folder, read_only=True)
    for _ in range(5):
        writer.store_episode(state=np.zeros((3, 3), np.float32))
        committed = np.asarray(writer.generations)[[0, 1]].tolist()
        assert committed_generations(reader, np.array([0, 1])).tolist() == committed
    writer.close()
    again = ReplayBuffer(folder, max_episodes=2, max_timesteps=4, fields=fields, overwrite=True)
    again.store_episode(state=np.ones((3, 3), np.float32))
    with pytest.raises(BufferReplacedError):
        committed_generations(reader, np.array([0, 1]))
    again.close()
