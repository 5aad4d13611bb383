"""The read cache of decoded rows (``storage/_cache.py``, issue 16): cached reads equal uncached
ones on every read path, one copy shared by workers and processes, generation-keyed, bounded,
refilled, never torn; on S3 the second epoch issues no data GETs."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.consistency import read_episodes_consistent
from replaybuf.maintenance import verify
from replaybuf.sampling import make_dataloader, make_dataset
from replaybuf.storage import BufferReplacedError, CorruptChunkError, GenerationMismatchError, _cache, make_storage
from replaybuf.storage._cache import CHECK_BYTES, CachedStorage, buffer_identity
from replaybuf.testing import StorageFactory, StorageTests
from tests._data import SAMPLING_FIELDS as FIELDS
from tests._data import SAMPLING_LENGTHS as LENGTHS
from tests._data import SAMPLING_META_FIELDS as META_FIELDS
from tests._data import fill_sampling_buffer as fill
from tests._data import sampling_episode as episode
from tests._data import seed_buffer
from tests.test_sampling import assert_same

pytest_plugins = ["tests._servers"]  # fixture: s3_server

OPTIONS = dict(max_episodes=8, max_timesteps=10, fields=FIELDS, meta_fields=META_FIELDS)
LOADER_CASES = [{}, {"timestep_level": True, "return_indices": True}, {"n_steps": 3, "sequence_fields": ("image",)}]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestCachedZarr(StorageTests):
    @pytest.fixture
    def storage_factory(self, tmp_path) -> StorageFactory:
        # the cache (filled by reads) outside the buffers' folder, which no_writes watches
        return lambda name="buffer": CachedStorage(make_storage(tmp_path / "buffers" / name), tmp_path / "cache")


@pytest.fixture
def written(tmp_path) -> str:
    buffer = ReplayBuffer(tmp_path / "buffer", **OPTIONS)
    fill(buffer)
    buffer.close()
    return str(tmp_path / "buffer")


def cache_files(cache_dir) -> dict[str, int]:
    """Relative path -> size of every published cache file."""
    out = {}
    for folder, _, files in os.walk(cache_dir):
        if os.path.basename(folder) == ".locks":
            continue
        for name in files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, cache_dir)] = os.path.getsize(path)
    return out


def rows_file(field: str, slot: int, generation: int, revision: int) -> str:
    """The path, under its buffer's cache folder, of the file of ``field``'s rows of ``slot`` at
    ``generation`` and ``revision`` (``CachedStorage._path``)."""
    return os.path.join(field, f"{slot}-{generation}-{revision}.rows" if revision else f"{slot}-{generation}.rows")


def revisions(location: str) -> np.ndarray:
    """The slots' revisions as stored (every commit of a writer session stamps its own)."""
    return ReplayBuffer.from_folder(location, read_only=True)._meta["_revision"]


def expected_bytes(buffer: ReplayBuffer, fields=None) -> int:
    """One raw copy of the committed rows of ``fields``, and a checksum per file."""
    lens = buffer._meta["episode_lens"]
    chosen = [f for n, f in buffer.schema.fields.items() if fields is None or n in fields]
    return int(lens.sum()) * sum(f.step_nbytes for f in chosen) + int((lens > 0).sum()) * len(chosen) * CHECK_BYTES


def run_python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, **kwargs)


@pytest.mark.parametrize("dense_bytes", [None, 0], ids=["dense", "mapped"])
@pytest.mark.parametrize("case", LOADER_CASES, ids=lambda c: ",".join(c) or "trajectory")
def test_cached_batches_equal_uncached(written, tmp_path, monkeypatch, case, dense_bytes):
    if dense_bytes is not None:  # every field gathered from its maps (MappedRows), none from RAM
        monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", dense_bytes)
    plain = ReplayBuffer.from_folder(written, read_only=True)
    cached = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    assert isinstance(cached.storage, CachedStorage) and not isinstance(plain.storage, CachedStorage)
    for epoch in range(2):  # the first fills the cache, the second reads it
        ours = list(make_dataloader(cached, batch_size=4, **case))
        theirs = list(make_dataloader(plain, batch_size=4, **case))
        assert len(ours) == len(theirs) > 0
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, (epoch, i))
    assert cache_files(tmp_path / "cache")


def test_get_all_data_and_views_cached(written, tmp_path):
    plain = ReplayBuffer.from_folder(written, read_only=True)
    cached = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    a, b = plain.get_all_data(), cached.get_all_data()
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    np.testing.assert_array_equal(cached.data["image"][1:4, 2:5], plain.data["image"][1:4, 2:5])
    assert sum(cache_files(tmp_path / "cache").values()) == expected_bytes(plain)


def test_warm_cache_fills_every_committed_episode(written, tmp_path):
    cached = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    cached.warm_cache(episodes=[0, 2], fields=["state"], progress=False)
    root, revision = cached.storage.root, cached._meta["_revision"]
    assert sorted(cache_files(root)) == [rows_file("state", 0, 1, revision[0]), rows_file("state", 2, 3, revision[2])]
    cached.warm_cache(progress=False)
    files = cache_files(root)
    assert len(files) == len(LENGTHS) * len(FIELDS) and sum(files.values()) == expected_bytes(cached)
    with pytest.raises(ValueError, match="invalid field names"):
        cached.warm_cache(fields=["nope"])


def test_warm_cache_names_episodes_and_fields_it_cannot_warm(written, tmp_path):
    """A slot named that holds no episode (never written, dropped) is refused by name, not
    skipped without a word; a field name given as a string is not read as its letters."""
    writer = ReplayBuffer.from_folder(written)
    writer.drop_episodes(2)
    writer.close()
    cached = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    empty = len(LENGTHS)  # never written
    for episodes, match in [([0, 2], r"episodes \[2\] hold no committed"), (empty, rf"episodes \[{empty}\] hold no")]:
        with pytest.raises(ValueError, match=match):
            cached.warm_cache(episodes=episodes, progress=False)
    with pytest.raises(ValueError, match=r"episode indices \[-1\] out of range"):
        cached.warm_cache(episodes=[-1], progress=False)
    with pytest.raises(TypeError, match="got the string 'state'"):
        cached.warm_cache(episodes=[0], fields="state", progress=False)
    assert not cache_files(tmp_path / "cache")  # a refused call fills nothing
    cached.warm_cache(episodes=slice(None), fields=["state"], progress=False)  # a slice: the committed ones
    assert len(cache_files(cached.storage.root)) == len(LENGTHS) - 1


def test_cache_arguments_refused(written, tmp_path):
    with pytest.raises(ValueError, match="read_only=True"):
        ReplayBuffer.from_folder(written, cache="disk")
    with pytest.raises(ValueError, match="read_only=True"):
        ReplayBuffer.from_folder(written, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="cache must be"):
        ReplayBuffer.from_folder(written, read_only=True, cache="ram")
    with pytest.raises(ValueError, match="cache_size"):
        ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_size=-1)
    with pytest.raises(ValueError, match="no read cache"):
        ReplayBuffer.from_folder(written, read_only=True).warm_cache()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cache", [None, False], ids=["local default", "off"])
@pytest.mark.parametrize("read_only", [True, False], ids=["reader", "writer"])
def test_a_bad_cache_size_is_refused_where_no_cache_is_made(written, cache, read_only):
    # it was ignored unchecked: a typo'd size surfaced only once the cache was turned on
    for size in (-1, 1.5e9, "20GB"):
        with pytest.raises(ValueError, match=f"cache_size must be a number of bytes >= 0, got {re.escape(repr(size))}"):
            ReplayBuffer.from_folder(written, read_only=read_only, cache=cache, cache_size=size)


@pytest.mark.parametrize("cache_dir", ["", b"cache", 3])
def test_a_cache_dir_naming_no_folder_is_refused_at_open(written, tmp_path, monkeypatch, cache_dir):
    # '' cached into the working directory; bytes failed the first fill without naming cache_dir
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"cache_dir must name a folder .*, got {re.escape(repr(cache_dir))}"):
        ReplayBuffer.from_folder(written, read_only=True, cache_dir=cache_dir).get_all_data()
    assert sorted(os.listdir(tmp_path)) == ["buffer"]


def test_uuid_is_stored_and_never_a_config_difference(written, tmp_path):
    reader = ReplayBuffer.from_folder(written, read_only=True)
    assert reader.schema.uuid and len(reader.schema.uuid) == 32
    again = ReplayBuffer(written, overwrite=False, **OPTIONS)  # the caller passes no uuid
    assert again.schema.uuid == reader.schema.uuid
    again.close()
    other = ReplayBuffer(tmp_path / "other", **OPTIONS)
    assert other.schema.uuid != reader.schema.uuid
    # same config at another location, or the same location recreated: another cache folder
    assert buffer_identity(written, reader.schema) != buffer_identity(str(tmp_path / "other"), other.schema)


def test_buffer_without_uuid_is_cached_by_config(tmp_path):
    fixture = os.path.join(REPO, "tests", "data", "format-v1", "zarr")
    reader = ReplayBuffer.from_folder(fixture, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    assert reader.schema.uuid is None
    plain = ReplayBuffer.from_folder(fixture, read_only=True).get_all_data()
    cached = reader.get_all_data()
    for key in plain:
        assert torch.equal(plain[key], cached[key]), key
    assert cache_files(tmp_path / "cache")


def create_at(location) -> None:
    """A buffer created (again) at ``location``: a new uuid each time, as an actor restarted each run."""
    buffer = ReplayBuffer(location, overwrite=True, **OPTIONS)
    fill(buffer)
    buffer.close()


def read_cached(location, cache_dir) -> ReplayBuffer:
    """A reader of ``location`` that has read every row through the cache in ``cache_dir``."""
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache_dir)
    reader.get_all_data()
    return reader


def folder_name(reader: ReplayBuffer) -> str:
    return os.path.basename(reader.storage.root)


def test_a_buffer_created_again_removes_the_cache_folder_of_the_one_it_replaced(tmp_path):
    # each buffer created again at a location left its full cache folder behind, never read again
    cache, location = tmp_path / "cache", tmp_path / "buffer"
    create_at(location)
    replaced = folder_name(read_cached(location, cache))
    shutil.copytree(location, tmp_path / "copy")
    copy = folder_name(read_cached(tmp_path / "copy", cache))  # the same uuid elsewhere: another buffer
    (cache / "mine").mkdir()  # a folder of the user's (no owner record, as one an older replaybuf made)
    (cache / "mine" / "notes.txt").write_text("kept")
    os.symlink(location, tmp_path / "link")
    create_at(location)
    new = folder_name(read_cached(tmp_path / "link", cache))  # the location spelt another way
    assert replaced not in os.listdir(cache)
    assert sorted(os.listdir(cache)) == sorted([new, copy, "mine"])
    assert (cache / "mine" / "notes.txt").read_text() == "kept"
    assert cache_files(cache / copy) and cache_files(cache / new)


def test_a_reader_of_the_replaced_buffer_never_removes_the_new_one_s_folder(tmp_path, monkeypatch):
    """A reader that opened the buffer before it was created again is told of the new buffer
    (its maps of the removed files stay readable); the first read of its cache layer, after the
    new buffer's, removes nothing (the location holds another uuid); what it left is removed by
    the next process reading the new buffer."""
    cache, location = tmp_path / "cache", tmp_path / "buffer"
    create_at(location)
    old = read_cached(location, cache)
    stale = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)  # no read yet
    create_at(location)
    new = read_cached(location, cache)
    assert os.listdir(cache) == [folder_name(new)]
    with pytest.raises(BufferReplacedError):
        old.get_all_data()
    filled = cache_files(new.storage.root)
    monkeypatch.setattr(_cache, "_SWEPT", set())  # the stale reader in a process of its own
    stale.storage.rows("state", [0])  # a read reaching its cache layer before the buffer's check
    assert folder_name(new) in os.listdir(cache) and cache_files(new.storage.root) == filled != {}
    monkeypatch.setattr(_cache, "_SWEPT", set())  # the next process
    read_cached(location, cache)
    assert os.listdir(cache) == [folder_name(new)]


def test_warm_cache_of_no_episodes_warms_nothing(written, tmp_path):
    # an empty list was refused by the shared index parser: "indices must be ints"
    cached = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    cached.warm_cache(episodes=[], progress=False)
    assert not cache_files(tmp_path / "cache")
    with pytest.raises(TypeError, match=r"warm_cache: episodes must be ints, a slice or None, got array\(\[\]"):
        cached.warm_cache(episodes=np.array([]), progress=False)  # a float array, refused by numpy too
    writer = ReplayBuffer.from_folder(written)
    before = writer.get_all_data()
    writer.update([], state=np.zeros((0, 10, 4)))  # the parser's other caller: no episode, nothing written
    after = writer.get_all_data()
    assert all(torch.equal(before[key], after[key]) for key in before)
    writer.close()


def test_reused_slot_is_refetched(tmp_path):
    location, cache = str(tmp_path / "ring"), tmp_path / "cache"
    writer = ReplayBuffer(location, **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    writer.close()
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    assert reader.data["ident"][0, 0] == 0  # slot 0 holds episode 0, now cached
    child = run_python(
        f"""
        from replaybuf import ReplayBuffer
        from tests._data import sampling_episode as episode
        buffer = ReplayBuffer.from_folder({location!r})
        buffer.store_episode(**episode(7, 5), task=7, success=True)  # wraps into slot 0
        buffer.close()
        """
    )
    assert child.wait(timeout=120) == 0
    # before refresh the reader's plan is stale: its read is checked and re-planned
    assert reader.data["ident"][0, 0] == 7000
    reader.refresh()
    np.testing.assert_array_equal(reader.get_all_data(fields=["ident"])["ident"][0, :5].numpy(), 7000 + np.arange(5))
    names, first = sorted(cache_files(reader.storage.root)), revisions(location)[1]  # the ring's first writer's
    assert rows_file("ident", 0, 1, first) in names and rows_file("ident", 0, 4, reader._meta["_revision"][0]) in names


@pytest.mark.parametrize("dense_bytes", [0, 64 << 20], ids=["mapped", "dense"])
def test_sampled_steps_follow_a_reused_slot(tmp_path, monkeypatch, dense_bytes):
    monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", dense_bytes)
    location = str(tmp_path / "ring")
    writer = ReplayBuffer(location, **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=tmp_path / "cache")

    def sampled() -> set[int]:
        loader = make_dataloader(reader, batch_size=5, timestep_level=True, shuffle=True, seed=0)
        return {int(v) for batch in loader for v in batch["ident"].reshape(-1)}

    assert sampled() == {1000 * e + t for e in range(3) for t in range(4)}  # cached, dense copies made
    assert (reader.storage._dense_rows("ident") is not None) == bool(dense_bytes)
    writer.store_episode(**episode(7, 4), task=7, success=True)  # wraps into slot 0, same length
    reader.refresh()
    assert sampled() == {1000 * e + t for e in (1, 2, 7) for t in range(4)}


def ring_of_three(tmp_path) -> tuple[ReplayBuffer, ReplayBuffer, ReplayBuffer]:
    """(writer, plain reader, cached reader) of a circular buffer of 3 slots holding episodes
    0, 1, 2 of 4 steps (generations 1, 2, 3); the writer stays open."""
    location = str(tmp_path / "ring")
    writer = ReplayBuffer(location, **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    plain = ReplayBuffer.from_folder(location, read_only=True)
    return writer, plain, ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=tmp_path / "cache")


def test_vectorized_gather_serves_each_item_at_its_planned_generation(tmp_path, monkeypatch):
    monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", 0)
    writer, plain, cached = ring_of_three(tmp_path)
    storage = cached.storage

    def gather(episodes, timesteps, generations):
        return storage.gather("ident", np.array(episodes), np.array(timesteps), np.array(generations)).tolist()

    assert gather([0, 1, 2, 0], [0, 1, 3, 2], [1, 2, 3, 1]) == [0, 1001, 2003, 2]  # filled, then mapped
    assert gather([2, 0, 1], [0, 3, 2], [3, 1, 2]) == [2000, 3, 1002]  # one fancy index
    mapped = storage._mapped["ident"]
    assert sorted(mapped.maps) == [0, 1, 2] and mapped.held.tolist() == [1, 2, 3]
    writer.store_episode(**episode(7, 6), task=7, success=True)  # wraps into slot 0: generation 4
    assert gather([0, 0, 1], [5, 1, 0], [4, 4, 2]) == [7005, 7001, 1000]  # the new episode's file
    assert mapped.held[0] == 4
    assert gather([0, 1], [3, 0], [1, 2]) == [3, 1000]  # a plan of the old one: its own file
    assert mapped.held[0] == 1
    # steps past a mapped length, or before 0, are never read through the maps: the wrapped
    # storage answers them, as it does uncached
    for timesteps in ([4, 0], [-1, 0]):
        expected = plain.storage.gather("ident", np.array([1, 1]), np.array(timesteps), np.array([2, 2]))
        assert gather([1, 1], timesteps, [2, 2]) == expected.tolist()
    # a refresh keeps the maps (each serves its one version): no file is mapped again
    storage.drop_caches()
    assert sorted(mapped.maps) == [0, 1, 2]
    assert gather([1, 0], [0, 2], [2, 1]) == [1000, 2]
    # the old episode's file gone (evicted by another process): the map's next touch finds it,
    # and a plan naming it is refused
    revision = writer._commit.revision  # every episode's: one writer session wrote them all
    os.unlink(os.path.join(storage.root, rows_file("ident", 0, 1, revision)))
    monkeypatch.setattr("replaybuf.storage._cache.TOUCH_S", -1.0)
    with pytest.raises(GenerationMismatchError) as caught:
        gather([1, 0], [0, 2], [2, 1])
    assert caught.value.slots == [0]
    assert gather([1, 0], [0, 2], [2, 4]) == [1000, 7002]
    # a refresh drops the maps of files gone, whose disk space they would hold
    os.unlink(os.path.join(storage.root, rows_file("ident", 0, 4, revision)))
    storage.drop_caches()
    assert sorted(mapped.maps) == [1, 2] and mapped.held[0] == 0
    writer.close()


def test_spans_are_copied_from_the_maps_of_their_planned_generation(tmp_path, monkeypatch):
    writer, plain, cached = ring_of_three(tmp_path)
    storage = cached.storage

    def read_spans(episodes, starts, lengths, generations, source=storage):
        out = np.full((len(episodes), 6), -1, np.int32)
        source.read_spans("ident", np.array(episodes), np.array(starts), np.array(lengths), out, True, generations)
        return out.tolist()

    assert read_spans([2, 0, 1], [0, 1, 3], [4, 2, 1], np.array([3, 1, 2])) == [
        [2000, 2001, 2002, 2003, -1, -1],
        [1, 2, -1, -1, -1, -1],
        [1003, -1, -1, -1, -1, -1],
    ]
    assert sorted(storage._mapped["ident"].maps) == [0, 1, 2]
    # an empty span, and one past its episode's 4 steps (the wrapped storage answers it)
    spans = ([1, 2, 0], [2, 0, 2], [0, 3, 4], np.array([2, 3, 1]))
    assert read_spans(*spans) == read_spans(*spans, source=plain.storage)
    writer.store_episode(**episode(7, 6), task=7, success=True)  # wraps into slot 0: generation 4
    assert read_spans([0, 0], [1, 4], [3, 2], np.array([4, 4])) == [
        [7001, 7002, 7003, -1, -1, -1],
        [7004, 7005, -1, -1, -1, -1],
    ]
    assert read_spans([0], [0], [2], np.array([1])) == [[0, 1, -1, -1, -1, -1]]  # the old episode's file
    storage.drop_caches()  # a refresh keeps the maps: the old episode is still served from its own
    assert read_spans([0], [0], [2], np.array([1])) == [[0, 1, -1, -1, -1, -1]]
    os.unlink(os.path.join(storage.root, rows_file("ident", 0, 1, writer._commit.revision)))
    monkeypatch.setattr("replaybuf.storage._cache.TOUCH_S", -1.0)  # its next touch finds the file gone
    with pytest.raises(GenerationMismatchError) as caught:
        read_spans([1, 0], [0, 0], [2, 2], np.array([2, 1]))
    assert caught.value.slots == [0]
    writer.close()


def test_vectorized_gather_keeps_the_map_bound_and_the_lru_clock(tmp_path, monkeypatch):
    monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", 0)
    monkeypatch.setattr("replaybuf.storage._cache.MAX_OPEN_MAPS", 2)
    writer, plain, cached = ring_of_three(tmp_path)
    writer.close()
    storage, generations, revision = cached.storage, np.array([1, 2, 3]), writer._commit.revision
    episodes, timesteps = np.array([0, 1, 2, 2, 0]), np.array([3, 0, 1, 2, 0])
    expected = plain.storage.gather("ident", episodes, timesteps, generations[episodes])
    for _ in range(2):  # three slots, two maps: the evicted ones are read from the buffer
        np.testing.assert_array_equal(storage.gather("ident", episodes, timesteps, generations[episodes]), expected)
        assert len(storage._maps) <= 2 and len(storage._mapped["ident"].maps) <= 2
    # a gather served from the maps still touches their files once TOUCH_S has passed
    monkeypatch.setattr("replaybuf.storage._cache.TOUCH_S", 0.0)
    held = sorted(storage._mapped["ident"].maps)
    paths = [os.path.join(storage.root, rows_file("ident", slot, slot + 1, revision)) for slot in held]
    for path in paths:
        os.utime(path, (1e9, 1e9))
    picked = np.array(held)
    rows = storage.gather("ident", picked, np.zeros(len(picked), np.int64), generations[picked])
    assert rows.tolist() == [1000 * slot for slot in held]
    assert all(os.path.getmtime(path) > 1e9 for path in paths)


def test_a_process_keeps_more_episodes_mapped_than_it_may_open_files(tmp_path):
    """A cached episode's map holds no file descriptor: a reader serves 96 cached episodes under
    an open-file limit of 32 more than it has open (Python's mmap keeps one per map)."""
    import resource

    slots = 96
    writer = ReplayBuffer(tmp_path / "buffer", max_episodes=slots, max_timesteps=4, fields={"state": ("float", 3)})
    for slot in range(slots):
        writer.store_episode(state=np.full((4, 3), slot, np.float32))
    writer.close()
    options = dict(read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    ReplayBuffer.from_folder(tmp_path / "buffer", **options).warm_cache()
    reader = ReplayBuffer.from_folder(tmp_path / "buffer", **options)  # maps nothing yet
    picked = np.arange(slots)
    generations = reader._meta["_generation"][picked]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    try:
        rows = reader.storage.gather("state", picked, np.full(slots, 3), generations)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    np.testing.assert_array_equal(rows[:, 0], picked)
    assert len(reader.storage._maps) == slots


def test_vectorized_gather_copies_per_item_when_the_maps_span_too_wide(tmp_path, monkeypatch):
    monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", 0)
    writer, plain, cached = ring_of_three(tmp_path)
    writer.close()
    episodes, timesteps = np.array([2, 0, 1, 2]), np.array([1, 3, 0, 3])
    generations = np.array([1, 2, 3])[episodes]
    cached.storage.gather("image", episodes, timesteps, generations)  # mapped

    def too_big(*args, **kwargs):
        raise ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size")

    monkeypatch.setattr(np.lib.stride_tricks, "as_strided", too_big)
    monkeypatch.setattr("replaybuf.storage._strided._gather", None)  # the strided view's path
    np.testing.assert_array_equal(
        cached.storage.gather("image", episodes, timesteps, generations),
        plain.storage.gather("image", episodes, timesteps, generations),
    )


def test_processes_and_workers_share_one_copy(written, tmp_path):
    cache = tmp_path / "cache"
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache)
    # fork: two workers fill the cache at once; spawn: one, which maps what they filled (each
    # spawned worker imports torch anew, and a second would only map the same files again)
    for context, workers in (("fork", 2), ("spawn", 1)):
        batches = list(
            make_dataloader(
                reader, batch_size=4, num_workers=workers, multiprocessing_context=context, persistent_workers=False
            )
        )
        assert batches
    child = run_python(
        f"""
        from replaybuf import ReplayBuffer
        ReplayBuffer.from_folder({written!r}, read_only=True, cache="disk", cache_dir={str(cache)!r}).get_all_data()
        """
    )
    assert child.wait(timeout=120) == 0
    reader.get_all_data()
    files = cache_files(cache)
    assert len(files) == len(LENGTHS) * len(FIELDS)  # one file per (field, episode), no temp files
    assert sum(files.values()) == expected_bytes(reader)


def test_lru_eviction_and_refill(written, tmp_path):
    cache = tmp_path / "cache"
    probe = ReplayBuffer.from_folder(written, read_only=True)
    lens, step = probe._meta["episode_lens"], probe.schema.fields["state"].step_nbytes
    size = int(lens[[0, 1, 2]].sum()) * step
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache, cache_size=size)
    storage = reader.storage
    for slot in (0, 1, 2):
        storage.rows("state", [slot])
    storage.drop_caches()
    storage.rows("state", [0])  # slot 0 used again: slot 1 is now the least recently used
    storage.rows("state", [3])
    names, revision = sorted(cache_files(storage.root)), probe._meta["_revision"]
    assert rows_file("state", 1, 2, revision[1]) not in names
    assert rows_file("state", 0, 1, revision[0]) in names and rows_file("state", 3, 4, revision[3]) in names
    assert sum(cache_files(storage.root).values()) <= size
    np.testing.assert_array_equal(storage.read_rows("state", np.array([1]), 0, 4), probe.data["state"][1:2, :4])
    for path in cache_files(storage.root):
        os.unlink(os.path.join(storage.root, path))
    storage.drop_caches()
    np.testing.assert_array_equal(storage.read_rows("state", np.array([2]), 0, 7), probe.data["state"][2:3, :7])
    assert rows_file("state", 2, 3, revision[2]) in cache_files(storage.root)


def test_a_smaller_cache_size_bounds_a_folder_whose_episodes_are_all_cached(written, tmp_path):
    # only fills scanned the folder: a run opening it with a smaller cache_size, every episode
    # it read already cached, left it at the earlier runs' size for good
    cache = tmp_path / "cache"
    ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache).warm_cache(progress=False)
    full = sum(cache_files(cache).values())
    smaller = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache, cache_size=full // 3)
    got = {name: smaller.data[name][:] for name in FIELDS}
    assert 0 < sum(cache_files(cache).values()) <= full // 3
    expected = ReplayBuffer.from_folder(written, read_only=True, cache=False).data
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], expected[name][:])


def test_fills_of_a_full_cache_scan_the_folder_once_per_tenth_of_cache_size(tmp_path, monkeypatch):
    # a scan evicted only down to cache_size, so every later fill found the folder over it and
    # scanned (and stat'ed) every file again: a cost per batch growing with the episodes cached
    buffer = ReplayBuffer(
        tmp_path / "buffer",
        max_episodes=200,
        max_timesteps=2,
        fields={"state": {"dtype": "float", "compressor": "zstd"}},
    )
    for slot in range(200):
        buffer.store_episode(state=np.full(1, slot, np.float32))
    buffer.close()
    file_bytes = 4 + CHECK_BYTES
    reader = ReplayBuffer.from_folder(
        tmp_path / "buffer", read_only=True, cache="disk", cache_dir=tmp_path / "cache", cache_size=50 * file_bytes
    )
    scans = []
    evict = CachedStorage._evict
    monkeypatch.setattr(CachedStorage, "_evict", lambda self: scans.append(1) or evict(self))
    for slot in range(200):
        assert reader.storage.read_rows("state", np.array([slot]), 0, 1)[0, 0] == slot
        assert sum(cache_files(tmp_path / "cache").values()) <= 50 * file_bytes
    # the first fill's scan, then one per 5 files filled past a full folder (was one per fill)
    assert len(scans) <= 1 + 150 // 5 + 1, len(scans)
    assert len(cache_files(tmp_path / "cache")) >= 45, "evicted down to 90% of cache_size, no further"


def test_fillers_in_several_processes_keep_the_folder_within_cache_size(written, tmp_path):
    # each process counted only its own writes since its last scan: two processes filling in
    # turns left ~2x cache_size on disk (N processes or loader workers, ~N x)
    cache = tmp_path / "cache"
    probe = ReplayBuffer.from_folder(written, read_only=True)
    lens, step = probe._meta["episode_lens"], probe.schema.fields["state"].step_nbytes
    size = int(np.sort(lens)[-3:].sum()) * step + 3 * CHECK_BYTES  # the 3 longest episodes fit
    readers = [
        ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache, cache_size=size).storage
        for _ in range(2)
    ]  # one layer per process: each keeps its own count
    for slot in range(len(LENGTHS)):
        readers[slot % 2].rows("state", [slot])
        assert sum(cache_files(readers[0].root).values()) <= size
    for reader in readers:  # what is kept is still served
        for slot in range(len(LENGTHS)):
            np.testing.assert_array_equal(
                reader.read_rows("state", np.array([slot]), 0, LENGTHS[slot]),
                probe.data["state"][slot : slot + 1, : LENGTHS[slot]],
            )


@pytest.mark.parametrize("damage", ["flip rows", "flip checksum", "cut one byte", "cut one step", "empty"])
def test_damaged_cache_file_is_fetched_again_never_served(written, tmp_path, damage):
    cache = tmp_path / "cache"
    plain = ReplayBuffer.from_folder(written, read_only=True)
    first = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache)
    first.warm_cache(progress=False)
    name = rows_file("image", 1, 2, plain._meta["_revision"][1])
    path = os.path.join(first.storage.root, name)
    data = bytearray(open(path, "rb").read())
    step = plain.schema.fields["image"].step_nbytes
    if damage == "flip rows":
        data[len(data) // 3] ^= 0x10
    elif damage == "flip checksum":
        data[-1] ^= 0x01
    else:
        del data[{"cut one byte": -1, "cut one step": -step, "empty": 0}[damage] :]
    with open(path, "wb") as f:
        f.write(data)
    # a new reader maps the file, finds the damage, and fetches the episode again
    again = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache)
    for loaded, expected in zip(again.get_all_data().values(), plain.get_all_data().values()):
        assert torch.equal(loaded, expected)
    assert cache_files(again.storage.root)[name] == (int(plain._meta["episode_lens"][1]) * step + CHECK_BYTES)


def test_files_of_the_unchecked_layout_are_swept(written, tmp_path):
    cache = tmp_path / "cache"
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache)
    reader.warm_cache(episodes=[0], progress=False)
    old = os.path.join(reader.storage.root, "state", "1-2.raw")
    with open(old, "wb") as f:
        f.write(b"\0" * 64)  # an unchecked file of an earlier release: never mapped
    fresh = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache)
    fresh.warm_cache(episodes=[1], progress=False)
    assert not os.path.exists(old)
    np.testing.assert_array_equal(fresh.data["state"][1], plain_rows(written, "state", 1))


def plain_rows(folder: str, name: str, slot: int) -> np.ndarray:
    return np.asarray(ReplayBuffer.from_folder(folder, read_only=True).data[name][slot])


def test_killed_filler_leaves_nothing_served(written, tmp_path):
    cache = tmp_path / "cache"
    child = run_python(
        f"""
        import os, sys, time
        from replaybuf import ReplayBuffer
        publish = os.replace
        def stop(temp, path):  # killed between writing a rows file's temp file and renaming it
            if not path.endswith(".rows"):
                return publish(temp, path)  # the folder's owner record
            print("filled", flush=True)
            time.sleep(60)
        os.replace = stop
        ReplayBuffer.from_folder({written!r}, read_only=True, cache="disk", cache_dir={str(cache)!r}).get_all_data()
        """,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().startswith("filled")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    left = cache_files(cache)
    assert left and all(os.path.basename(p).startswith(".tmp-") for p in left)
    plain = ReplayBuffer.from_folder(written, read_only=True).get_all_data()
    cached = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache).get_all_data()
    for key in plain:
        assert torch.equal(plain[key], cached[key]), key


def test_s3_second_epoch_reads_no_data_and_first_epoch_is_concurrent(s3_server, tmp_path):
    # 64 episodes of one chunk each: the first batch fills them all in one bulk read
    options = dict(max_episodes=64, max_timesteps=10, fields={"image": ("uint8", (24, 24, 3)), "state": ("float", 4)})
    location = s3_server.url(f"cache-{uuid.uuid4().hex[:8]}")
    writer = ReplayBuffer(location, storage_options=s3_server.storage_options, **options)
    rng = np.random.default_rng(0)
    for _ in range(64):
        writer.store_episode(
            image=rng.integers(0, 256, (10, 24, 24, 3), dtype=np.uint8), state=rng.random((10, 4), dtype=np.float32)
        )
    writer.close()
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=s3_server.storage_options)
    assert isinstance(reader.storage, CachedStorage)  # on by default on object stores
    loader = make_dataloader(reader, batch_size=256, timestep_level=True, shuffle=True, seed=0)
    s3_server.latency = 0.05  # a network round trip: GETs sent together overlap whatever the load
    try:
        with s3_server.record() as first:
            assert sum(len(batch["state"]) for batch in loader) == 640
    finally:
        s3_server.latency = 0.0
    with s3_server.record() as second:  # the same loader again: not even a _generation re-check
        assert sum(len(batch["state"]) for batch in loader) == 640
    with s3_server.record() as third:  # a new loader: its snapshot reads bookkeeping, no data
        list(make_dataloader(reader, batch_size=256, timestep_level=True, shuffle=True, seed=1))
    data_gets = [path for method, path in third.requests if method == "GET" and "/data/" in path]
    assert first.peak_in_flight["GET"] >= 16, first.peak_in_flight
    assert second.count() == 0, second.requests[:10]
    assert data_gets == []
    off = ReplayBuffer.from_folder(location, read_only=True, storage_options=s3_server.storage_options, cache=False)
    assert not isinstance(off.storage, CachedStorage)


def test_every_spelling_of_an_object_store_url_is_cached_by_default_in_one_folder(s3_server, tmp_path):
    """``s3a://``, ``S3://`` and a trailing ``/`` name the objects ``s3://`` does: a read-only open
    through any of them is cached by default, in the one folder, so what one filled the others
    serve with no GET (a second folder would hold a second decoded copy of every episode)."""
    location = s3_server.url(f"spelled-{uuid.uuid4().hex[:8]}")
    writer = ReplayBuffer(
        location, max_episodes=2, max_timesteps=3, fields={"ident": "int"}, storage_options=s3_server.storage_options
    )
    writer.store_episode(ident=np.array([1000, 1001, 1002]))
    writer.close()
    readers = [
        ReplayBuffer.from_folder(
            scheme + location.split("://", 1)[1] + tail, read_only=True, storage_options=s3_server.storage_options
        )
        for scheme, tail in (("s3a://", ""), ("S3://", "/"), ("s3://", ""), ("s3://", "/"))
    ]
    assert all(isinstance(reader.storage, CachedStorage) for reader in readers)
    assert len({reader.storage.root for reader in readers}) == 1
    readers[0].warm_cache(progress=False)
    with s3_server.record() as requests:
        assert readers[1].data["ident"][0, 2] == 1002
    assert [path for method, path in requests.requests if method == "GET" and "/data/" in path] == []


def test_filler_waits_for_the_one_fetching_the_episode(written, tmp_path, monkeypatch):
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    storage, expected = reader.storage, ReplayBuffer.from_folder(written, read_only=True).data["state"][:2, :4]
    os.makedirs(os.path.join(storage.root, ".locks"))
    other = os.open(os.path.join(storage.root, ".locks", "state-0"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)  # another filler is fetching slot 0
    waiting, wait_for_lock = threading.Event(), _cache._wait_for_lock

    def wait_for_the_other_filler(fd, deadline):
        waiting.set()
        wait_for_lock(fd, deadline)

    monkeypatch.setattr(_cache, "_wait_for_lock", wait_for_the_other_filler)
    result = {}
    thread = threading.Thread(target=lambda: result.update(rows=storage.read_rows("state", np.array([0, 1]), 0, 4)))
    thread.start()
    try:
        assert waiting.wait(timeout=60), "the filler never waited for the one fetching slot 0"
        assert thread.is_alive()  # waiting for the other filler, not fetching slot 0 again
        assert sorted(cache_files(storage.root)) == [rows_file("state", 1, 2, reader._meta["_revision"][1])]
    finally:
        os.close(other)  # that filler dies without publishing
    thread.join(timeout=60)
    np.testing.assert_array_equal(result["rows"], expected)  # slot 0 read from the buffer this time
    storage.rows("state", [0])
    assert rows_file("state", 0, 1, reader._meta["_revision"][0]) in cache_files(storage.root)


def slot_of_key(path: str) -> int:
    """The slot (first chunk index) of a data object's key ``.../data/<field>/c.<slot>...``
    (or ``c/<slot>/...``)."""
    match = re.search(r"/data/[^/]+/c[./](\d+)", path)
    assert match, path
    return int(match.group(1))


def test_s3_slot_rewritten_between_epochs_is_refetched_alone(s3_server):
    options = dict(max_episodes=6, max_timesteps=10, fields=FIELDS, meta_fields=META_FIELDS)
    location = s3_server.url(f"cache-{uuid.uuid4().hex[:8]}")
    writer = ReplayBuffer(location, storage_options=s3_server.storage_options, circular=True, **options)
    fill(writer)
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=s3_server.storage_options)
    before = make_dataloader(reader, batch_size=8, timestep_level=True, return_indices=True, seed=0)
    list(before)  # fills the cache
    writer.store_episode(**episode(6, 8), task=6, success=True)  # wraps into slot 0
    reader.refresh()
    after = make_dataloader(reader, batch_size=8, timestep_level=True, return_indices=True, seed=1)
    with s3_server.record() as log:
        batches = list(after)
    slots = {slot_of_key(p) for m, p in log.requests if m == "GET" and "/data/" in p}
    assert slots == {0}, slots  # only the rewritten slot is fetched again
    ident = torch.cat([b["ident"] for b in batches]).reshape(-1)
    where = torch.cat([b["_indices"] for b in batches])
    assert (where[:, 0] == 0).sum() == 8  # all 8 steps of the new episode, none of the old one's 1
    expected = torch.where(where[:, 0] == 0, 6000 + where[:, 1], 1000 * where[:, 0] + where[:, 1])
    assert torch.equal(ident, expected.to(ident.dtype))
    # the loader made before: its snapshot named slot 0's old episode, whose meta rows the
    # refreshed mirror no longer holds; its samples of slot 0 are redrawn, never mixed
    with s3_server.record() as old_epoch:
        batches = list(before)
    where = torch.cat([b["_indices"] for b in batches])
    assert len(where) and not (where[:, 0] == 0).any()
    for b in batches:
        assert torch.equal(b["task"].reshape(-1), (b["ident"].reshape(-1) // 1000 % 3).to(b["task"].dtype))
    assert not [p for m, p in old_epoch.requests if m == "GET" and "/data/" in p]
    writer.close()


def test_fill_racing_a_writer_publishes_nothing_and_the_read_is_replanned(tmp_path):
    location, cache = str(tmp_path / "ring"), tmp_path / "cache"
    writer = ReplayBuffer(location, **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    storage = reader.storage
    dataset_loader = make_dataloader(reader, batch_size=12, timestep_level=True, return_indices=True, seed=0)
    read_spans, rewrites = storage.inner.read_spans, []

    def rewrite_slot_0_first(*args, **kwargs):  # the writer reuses slot 0 while the cache fills
        if not rewrites:
            rewrites.append(writer.store_episode(**episode(7, 5), task=7, success=True))
        return read_spans(*args, **kwargs)

    storage.inner.read_spans = rewrite_slot_0_first
    with pytest.raises(GenerationMismatchError) as caught:
        storage.read_rows("ident", np.array([0, 1]), 0, 4, np.array([1, 2]))
    assert caught.value.slots == [0] and rewrites
    files = sorted(cache_files(storage.root))
    revision = writer._commit.revision  # one writer session wrote every episode
    assert rows_file("ident", 0, 1, revision) not in files, "a fill that raced a writer published"
    # the wrapped zarr storage verifies its resident fields: its read raised for slot 0 before
    # the fill got slot 1's rows, which a next read fills from the inner resident copy
    assert storage.inner.verifies_reads(["ident"])
    loaded = storage.inner.array("ident").resident_rows_read
    storage.read_rows("ident", np.array([1]), 0, 4, np.array([2]))
    assert rows_file("ident", 1, 2, revision) in cache_files(storage.root)
    assert storage.inner.array("ident").resident_rows_read == loaded
    # the dataset planned slot 0 at generation 1: its samples are redrawn from slots 1 and 2
    batches = list(dataset_loader)
    where = torch.cat([b["_indices"] for b in batches])
    assert len(where) and not (where[:, 0] == 0).any()
    for b in batches:
        assert torch.equal(
            b["ident"].reshape(-1), (1000 * b["_indices"][:, 0] + b["_indices"][:, 1]).to(b["ident"].dtype)
        )
    # a read planned now (data[...] plans from the store) gets the new episode, then cached
    assert reader.data["ident"][0, :5].tolist() == [7000, 7001, 7002, 7003, 7004]
    assert rows_file("ident", 0, 4, revision) in cache_files(storage.root)
    writer.close()


def test_datasets_drop_a_slot_reused_while_they_load(tmp_path):
    location = str(tmp_path / "ring")
    writer = ReplayBuffer(location, **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    inner = reader.storage.inner
    read_spans, armed = inner.read_spans, []

    def rewrite_once(*args, **kwargs):  # the next episode goes into the next slot meanwhile
        if armed:
            writer.store_episode(**episode(armed.pop(), 4), task=0, success=True)
        return read_spans(*args, **kwargs)

    inner.read_spans = rewrite_once

    def samples(dataset) -> dict[str, torch.Tensor]:
        """Every sample of ``dataset`` read as one batch; each one's ``ident`` names its step."""
        batch = dataset.__getitems__(list(range(len(dataset)))).batch
        return batch

    armed.append(7)  # slot 0 is reused while cache='ram' decodes the snapshot
    ram = make_dataset(reader, fields=["ident"], timestep_level=True, cache="ram", return_indices=True)
    assert not armed
    batch = samples(ram)
    assert set(batch["_indices"][:, 0].tolist()) == {1, 2}
    assert torch.equal(
        batch["ident"].reshape(-1), (1000 * batch["_indices"][:, 0] + batch["_indices"][:, 1]).to(torch.int32)
    )
    armed.append(8)  # slot 1 is reused while filter_fields reads a field not cached yet
    filtered = make_dataset(reader, timestep_level=True, filter_fields={"done": False}, return_indices=True)
    assert not armed
    batch = samples(filtered)
    where = batch["_indices"]
    assert set(where[:, 0].tolist()) == {0, 2} and not batch["done"].any()
    ident = batch["ident"].reshape(-1)
    expected = torch.where(where[:, 0] == 0, 7000 + where[:, 1], 2000 + where[:, 1]).to(ident.dtype)
    assert torch.equal(ident, expected)
    writer.close()


# ---- in-place edits: every copy is keyed by (generation, revision) -------------------------------


def edit_three_ways(writer: ReplayBuffer) -> None:
    """Edit committed slots 1, 2 and 3 of ``ident`` through each in-place write of the API."""
    writer.update([1], ident=np.full((1, 4), 5))
    writer.store_datapoint(2, 0, "ident", 6)
    writer.data["ident"][3, 0] = 7


def sampled_idents(buffer: ReplayBuffer) -> set[int]:
    loader = make_dataloader(buffer, batch_size=8, timestep_level=True)
    return {int(v) for batch in loader for v in batch["ident"].reshape(-1)}


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
@pytest.mark.parametrize("dense_bytes", [0, 64 << 20], ids=["mapped", "dense"])
def test_in_place_edits_are_never_served_stale(tmp_path, monkeypatch, backend, dense_bytes):
    monkeypatch.setattr("replaybuf.storage._cache.DENSE_BYTES", dense_bytes)
    location, cache = str(tmp_path / "buffer"), tmp_path / "cache"
    writer = ReplayBuffer(location, backend=backend, **OPTIONS)
    fill(writer)
    writer.flush()
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    before = sampled_idents(reader)  # every episode cached (files, and in-RAM copies when dense)
    assert reader.get_all_data(fields=["ident"])["ident"][1, 0] == 1000 and 1000 in before
    edit_three_ways(writer)
    reader.refresh()
    assert [int(reader.data["ident"][slot, 0]) for slot in (1, 2, 3)] == [5, 6, 7]
    assert reader.get_all_data(fields=["ident"])["ident"][1:4, 0].tolist() == [5, 6, 7]
    assert {5, 6, 7} <= sampled_idents(reader) and not {1000, 2000, 3000} & sampled_idents(reader)
    # a reader opened now (another process) maps the same folder: no file of the old rows is served
    fresh = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    assert fresh.get_all_data(fields=["ident"])["ident"][1:4, 0].tolist() == [5, 6, 7]
    now = writer._meta["_revision"]
    assert (now[[0, 4]] == writer._commit.revision).all() and (now[1:4] != writer._commit.revision).all()
    files = cache_files(reader.storage.root)
    assert rows_file("ident", 1, 2, writer._commit.revision) in files and rows_file("ident", 1, 2, now[1]) in files
    writer.close()


def test_an_edit_left_open_is_never_cached_and_closed_by_the_next_writer(written, tmp_path):
    cache = tmp_path / "cache"
    writer = ReplayBuffer.from_folder(written)
    writer._commit.write_meta("_revision", np.array([2]), np.array([1]))  # as a writer killed mid-edit leaves it
    writer.storage.update_rows("ident", np.array([2]), 0, np.full((1, 1), 9, np.int64))
    writer.storage.release_writer()  # dropped without close(): the lease is given back only
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=cache)
    assert reader.data["ident"][2, 0] == 9  # read through, never cached while the edit is open
    assert not any(name.startswith(os.path.join("ident", "2-")) for name in cache_files(cache))
    ReplayBuffer.from_folder(written).close()  # a writable open closes the edit
    revision = revisions(written)[2]
    assert revision % 2 == 0 and revision > 1
    reader.refresh()
    assert reader.data["ident"][2, 0] == 9
    assert rows_file("ident", 2, 3, revision) in cache_files(reader.storage.root)


def test_an_edit_a_killed_writer_left_half_written_is_refused_by_name_not_waited_out(tmp_path):
    """A slot a killed writer left mid-edit (odd revision) whose rows fail their checksum is no
    edit running once no live writer holds the buffer: a read names the unfinished edit and the
    writable open that re-seals it, instead of waiting ~0.2 s and raising ConcurrentWriteError
    (retryable, though no retry can succeed); that open makes the slot read again."""
    location = str(tmp_path / "buffer")
    writer = ReplayBuffer(location, backend="memmap", **OPTIONS)
    fill(writer)
    writer._commit.write_meta("_revision", np.array([2]), np.array([1]))  # as a writer killed mid-edit leaves it
    writer.storage.array("ident").memmap[2, 0] = 9  # its rows written, their checksum not yet
    writer.storage.release_writer()  # dropped without close(): the lease is given back only
    for cache in ("disk", False):
        reader = ReplayBuffer.from_folder(location, read_only=True, cache=cache, cache_dir=tmp_path / "cache")
        with pytest.raises(CorruptChunkError, match=r"slot 2 was left mid-edit .* by a writer that stopped"):
            read_episodes_consistent(reader, [1, 2], ["ident"])
    ReplayBuffer.from_folder(location).close()  # re-seals the slot from its rows as stored
    reader.refresh()
    assert read_episodes_consistent(reader, [2], ["ident"]).data["ident"][0, :2].tolist() == [9, 2001]


def test_each_writer_session_stamps_its_commits_and_keeps_the_committed_revisions(tmp_path, monkeypatch):
    """A writer session publishes its own random even revision with each episode it commits, in
    one write with the empty slots ahead (``REVISION_RUN_AHEAD``, so a buffer filled in order
    writes revisions once per that many episodes); episodes committed before keep theirs, so an
    actor restarted beside a reader leaves the reader's cached files served."""
    monkeypatch.setattr("replaybuf.commit.REVISION_RUN_AHEAD", 4)
    location, cache = str(tmp_path / "buffer"), tmp_path / "cache"

    def session(indices, writer=None) -> tuple[ReplayBuffer, list[np.ndarray]]:
        writer = writer or ReplayBuffer.from_folder(location)
        stamped, write_meta = [], writer._commit.write_meta

        def recorded(name, slots, values):
            if name == "_revision":
                stamped.append(np.asarray(slots).tolist())
            write_meta(name, slots, values)

        monkeypatch.setattr(writer._commit, "write_meta", recorded)
        for index in indices:
            writer.store_episode(**episode(index, 4), task=0, success=False)
        writer.close()
        return writer, stamped

    first, stamped = session(range(3), ReplayBuffer(location, **OPTIONS))
    assert stamped == [[0, 1, 2, 3, 4]]  # slot 0 and the 4 empty slots after it, in one write
    assert (revisions(location)[:5] == first._commit.revision).all() and not revisions(location)[5:].any()
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    reader.warm_cache(progress=False)
    files = cache_files(cache)
    second, stamped = session(range(3, 6))
    assert second._commit.revision != first._commit.revision
    assert stamped == [[3, 4, 5, 6, 7]]
    assert revisions(location).tolist() == [first._commit.revision] * 3 + [second._commit.revision] * 5
    reader.refresh()
    assert reader.get_all_data(fields=["ident"])["ident"][:, 0].tolist() == [1000 * index for index in range(6)]
    reader.warm_cache(progress=False)
    now = cache_files(cache)
    assert set(files) < set(now) and len(now) == 6 * len(FIELDS)  # slots 0-2 kept their files


def _die_after_stamping(location: str) -> None:
    """Child: a new writer session reusing circular slot 0, killed once it stamped its revision
    there, before the episode's meta rows, generation and length are published."""
    buffer = ReplayBuffer.from_folder(location)
    write_meta = buffer._commit.write_meta

    def dying(name, episodes, values):
        write_meta(name, episodes, values)
        if name == "_revision":
            os.kill(os.getpid(), signal.SIGKILL)

    buffer._commit.write_meta = dying
    buffer.store_episode(**episode(7, 5), task=7, success=True)
    os._exit(3)


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_writer_killed_after_stamping_a_revision_loses_and_serves_nothing(tmp_path, backend):
    """The revision stamp is the first write of a commit's step 3: a kill right after it leaves
    the reused slot empty (its old episode was invalidated first), every other episode whole and
    served from the cache as before, and a buffer the next writable open takes as it is."""
    location, cache = str(tmp_path / "ring"), tmp_path / "cache"
    writer = ReplayBuffer(location, backend=backend, **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    writer.close()
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    reader.warm_cache(progress=False)
    child = multiprocessing.get_context("fork").Process(target=_die_after_stamping, args=(location,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    reader.refresh()
    assert reader.episode_lens.tolist() == [0, 4, 4]
    assert reader.get_all_data(fields=["ident"])["ident"][1:, :4].tolist() == [
        [1000 + t for t in range(4)],
        [2000 + t for t in range(4)],
    ]
    assert verify(location) == []
    with ReplayBuffer.from_folder(location) as again:
        again.store_episode(**episode(8, 5), task=8, success=True)  # slot 0 again
    reader.refresh()
    assert reader.get_all_data(fields=["ident"])["ident"][:, 0].tolist() == [8000, 1000, 2000]
    assert verify(location) == []


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_buffer_put_back_from_a_copy_is_never_served_the_discarded_episodes(tmp_path, backend):
    """A folder put back from a backup keeps its uuid, and a writer writing it again publishes the
    generations of the episodes written after the backup (and edits them from the same
    revisions): the cached rows of those discarded episodes are never served for the new ones,
    appended, written into a reused circular slot or edited in place, by a later run's reader
    or by one that read them and refreshes."""
    location, backup, cache = str(tmp_path / "buffer"), str(tmp_path / "backup"), tmp_path / "cache"
    writer = ReplayBuffer(location, backend=backend, **{**OPTIONS, "max_episodes": 4}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    writer.close()
    shutil.copytree(location, backup)

    def write_after_the_copy(index: int) -> list[list[int]]:
        """Episodes ``index`` (slot 3, empty in the copy) and ``index + 1`` (slot 0, reused), then
        slot 1 edited to ``index``: the first steps each slot then holds."""
        again = ReplayBuffer.from_folder(location)
        again.store_episode(**episode(index, 4), task=0, success=False)
        again.store_episode(**episode(index + 1, 4), task=0, success=False)
        again.update([1], ident=np.full((1, 4), index))
        again.close()
        return [
            [1000 * (index + 1), 1000 * (index + 1) + 1],
            [index, index],
            [2000, 2001],
            [1000 * index, 1000 * index + 1],
        ]

    discarded = write_after_the_copy(10)
    reader = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    reader.warm_cache(progress=False)
    assert reader.get_all_data(fields=["ident"])["ident"][:, :2].tolist() == discarded
    shutil.rmtree(location)
    shutil.copytree(backup, location)  # put back, and written again
    kept = write_after_the_copy(20)
    reader.refresh()
    assert reader.get_all_data(fields=["ident"])["ident"][:, :2].tolist() == kept
    later = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=cache)
    assert later.get_all_data(fields=["ident"])["ident"][:, :2].tolist() == kept
    assert [later.data["ident"][slot, :2].tolist() for slot in range(4)] == kept
    loader = make_dataloader(later, batch_size=16, timestep_level=True, return_indices=True, seed=0)
    for batch in loader:
        for (slot, step), value in zip(batch["_indices"].tolist(), batch["ident"].reshape(-1).tolist()):
            assert value == kept[slot][0] + (step if slot != 1 else 0), (slot, step)


def test_fill_racing_an_edit_publishes_nothing(written, tmp_path):
    writer = ReplayBuffer.from_folder(written)
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    storage = reader.storage
    read_spans, edits = storage.inner.read_spans, []

    def edit_slot_1_first(*args, **kwargs):  # the writer edits slot 1 while the cache fills
        if not edits:
            edits.append(writer.update([1], ident=np.full((1, 4), 5)))
        return read_spans(*args, **kwargs)

    storage.inner.read_spans = edit_slot_1_first
    rows = storage.read_rows("ident", np.array([1, 2]), 0, 4, np.array([2, 3]))
    assert edits and rows[1, :2].tolist() == [2000, 2001]
    files = cache_files(storage.root)
    assert rows_file("ident", 2, 3, reader._meta["_revision"][2]) in files
    assert not any(name.startswith(os.path.join("ident", "1-")) for name in files), (
        "a fill that raced an edit published"
    )
    reader.refresh()
    assert reader.data["ident"][1, :4].tolist() == [5, 5, 5, 5]
    assert rows_file("ident", 1, 2, writer._meta["_revision"][1]) in cache_files(storage.root)
    writer.close()


def test_revisions_move_once_per_edit_and_never_for_rejected_ones(written):
    writer = ReplayBuffer.from_folder(written)
    with pytest.raises(ValueError, match="does not broadcast"):
        writer.update([1, 2], ident=np.zeros((3, 4)), task=[1, 2])
    with pytest.raises(ValueError, match="invalid field"):
        writer.store_datapoint(1, 0, "nope", 1)
    committed = revisions(written)[:4].copy()  # the session that wrote them all stamped its own
    assert (committed == committed[0]).all() and committed[0] % 2 == 0 and committed[0] > 0
    assert (writer._meta["_revision"][:4] == committed).all()
    assert "_revision" not in writer.meta_data and "_revision" not in writer.meta_fieldnames
    writer.update([1], task=[7])  # meta values are edited with their checksums (``_meta_sum``)
    first = revisions(written)[:4].copy()
    assert (first != committed).tolist() == [False, True, False, False] and first[1] % 2 == 0
    writer.update([1, 2], ident=np.zeros((2, 4)), reward=np.ones((2, 4)), task=[3, 4])  # one edit of all of them
    second = revisions(written)[:4].copy()
    assert (second != first).tolist() == [False, True, True, False]
    writer.store_datapoint(2, 1, "ident", 5)
    third = revisions(written)[:4]
    assert (third != second).tolist() == [False, False, True, False] and (third % 2 == 0).all()
    writer.close()
    with pytest.raises(ValueError, match="_revision"):
        ReplayBuffer(
            written + "-other", max_episodes=2, max_timesteps=3, fields={"x": "float"}, meta_fields={"_revision": "int"}
        )


def test_a_writers_loader_cache_serves_its_snapshot_whole(tmp_path, monkeypatch):
    """A writer's loader with ``cache='ram'`` reads through the read cache: every sample is a step
    of the episode its slot held when the loader was made, also after the writer reuses and
    edits slots, and a new loader sees the new episodes."""
    monkeypatch.setenv("REPLAYBUF_CACHE_DIR", str(tmp_path / "cache"))
    writer = ReplayBuffer(tmp_path / "ring", **{**OPTIONS, "max_episodes": 3}, circular=True)
    for index in range(3):
        writer.store_episode(**episode(index, 4), task=index, success=False)
    loader = make_dataloader(writer, 4, timestep_level=True, return_indices=True, cache="ram")
    writer.store_episode(**episode(7, 4), task=0, success=True)  # slot 0 now holds episode 7
    writer.update([1], ident=np.full((1, 4), -5))  # slot 1 edited in place
    for batch in loader:
        slots, steps = batch["_indices"][:, 0], batch["_indices"][:, 1]
        assert torch.equal(batch["ident"].reshape(-1), (1000 * slots + steps).to(batch["ident"].dtype))
    fresh = make_dataloader(writer, 12, timestep_level=True, return_indices=True, cache="ram")
    ident = torch.cat([b["ident"].reshape(-1) for b in fresh])
    assert sorted(ident.tolist()) == sorted([7000, 7001, 7002, 7003, -5, -5, -5, -5, 2000, 2001, 2002, 2003])
    writer.close()


@pytest.mark.parametrize("cache_size", [0, 600])
def test_a_loader_filling_more_than_cache_size_still_draws_every_episode(written, tmp_path, cache_size):
    # a loader's cache='ram' fill took each episode the cache did not keep (evicted at once) for
    # one reused since its snapshot: never drawn (600 bytes: 1 of 6 episodes left), and with
    # cache_size 0 the loader said a writer had overwritten them all
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path, cache_size=cache_size)
    loader = make_dataloader(reader, 64, timestep_level=True, cache="ram")
    ident = torch.cat([batch["ident"].reshape(-1) for batch in loader])
    assert sorted(ident.tolist()) == [1000 * i + t for i, length in enumerate(LENGTHS) for t in range(length)]


def test_a_file_is_checked_once_per_process(written, tmp_path, monkeypatch):
    from replaybuf.storage._cache import CachedStorage

    checked = []
    real = CachedStorage._check_value
    monkeypatch.setattr(
        CachedStorage, "_check_value", lambda self, path, rows: checked.append(path) or real(self, path, rows)
    )
    reader = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    reader.warm_cache(episodes=[1], fields=["image"], progress=False)
    assert len(checked) == 1  # the filler's checksum, written: its own map reads no file again
    checked.clear()
    storage = reader.storage
    storage.drop_caches()  # the maps go; the files stay, checked
    storage.rows("image", [1])
    assert checked == []
    again = ReplayBuffer.from_folder(written, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    again.storage.rows("image", [1])  # another reader (a new storage) checks it itself
    assert len(checked) == 1


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_a_fill_leaves_out_a_slot_reused_during_its_read(tmp_path, monkeypatch, backend):
    """``warm_cache`` while a writer reuses a slot during the fill's bulk read: that slot is left
    out (no file of it, nothing raised: zarr's read, verified against the resident copy's
    generations, names it with GenerationMismatchError, which escaped ``warm_cache`` before),
    the others are published, and after ``refresh()`` the new episode is fetched."""
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=3, max_timesteps=4, fields={"ident": "int"}, circular=True, backend=backend
    )
    for index in range(3):
        writer.store_episode(ident=np.arange(4) + 10 * index)
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    inner = reader.storage.inner
    read_spans = inner.read_spans

    def reused_meanwhile(*args, **kwargs):
        monkeypatch.setattr(inner, "read_spans", read_spans)  # once
        writer.store_episode(ident=np.arange(4) + 30)  # slot 0, as the fill reads it
        return read_spans(*args, **kwargs)

    monkeypatch.setattr(inner, "read_spans", reused_meanwhile)
    reader.warm_cache()
    folder = os.path.join(reader.storage.root, "ident")
    assert sorted(int(name.split("-")[0]) for name in os.listdir(folder)) == [1, 2]
    reader.refresh()
    reader.warm_cache()
    assert sorted(int(name.split("-")[0]) for name in os.listdir(folder)) == [0, 1, 2]
    assert reader.get_all_data()["ident"].tolist() == [[30, 31, 32, 33], [10, 11, 12, 13], [20, 21, 22, 23]]


def test_a_folder_the_seed_library_writes_is_read_as_it_is_never_from_the_cache(tmp_path):
    """memmap-replay-buffer writes its folders (and those replaybuf adopted) without moving any
    slot's generation: after a whole turn of its ring every slot has the generation it had, so a
    cached copy, the buffer's (``cache='disk'``) or a loader's (``cache='ram'``, of the folder or
    of a mixture holding it), would serve the old episodes. Such a folder is read as it is (it is raw already), with a warning."""
    seed = seed_buffer(tmp_path / "seed", lengths=(3, 4, 5, 6), partial=0)

    def first_states() -> list[list[float]]:
        """Step 0's state of each slot, as a cached reader and a cached loader read them."""
        with pytest.warns(UserWarning, match="memmap-replay-buffer folder"):
            reader = ReplayBuffer.from_folder(
                tmp_path / "seed", read_only=True, cache="disk", cache_dir=tmp_path / "cache"
            )
        with pytest.raises(ValueError, match="never cached"):
            reader.warm_cache()
        loader = make_dataloader(ReplayBuffer.from_folder(tmp_path / "seed", read_only=True), 4, cache="ram")
        mixture = ConcatReplayBuffer([tmp_path / "seed"]).dataloader(batch_size=4, shuffle=False, cache="ram")
        return [reader.data["state"][:, 0, 0].tolist()] + [
            sorted(next(iter(each))["state"][:, 0, 0].tolist()) for each in (loader, mixture)
        ]

    assert first_states() == [[0.0, 1.0, 2.0, 3.0]] * 3
    for i in range(4, 8):  # the seed's next turn: every slot rewritten
        with seed.one_episode(task_id=i):
            for t in range(3):
                seed.store(state=np.full(3, i + t / 10, np.float32), action=np.array([t, i]), reward=0.0)
    seed.flush()
    assert first_states() == [[4.0, 5.0, 6.0, 7.0]] * 3
