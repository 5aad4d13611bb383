"""``StorageTests``: the conformance suite every Storage backend passes.

Shipped with the package, as zarr-python ships ``zarr.testing.store.StoreTests``, so that a
backend registered with ``register_backend`` is held to the same contract (``storage/base.py``)
as the built-in ones. A backend's test module subclasses the suite and provides one fixture::

    import pytest
    from replaybuf.storage import make_storage
    from replaybuf.testing import StorageTests

    class TestMyStorage(StorageTests):
        @pytest.fixture
        def storage_factory(self, tmp_path):
            return lambda name="buffer": make_storage(str(tmp_path / name), backend="mine")

``storage_factory(name)`` returns a new, unopened Storage on the location called ``name``: the
same location for the same name (the tests open several objects on one buffer, as separate
processes would) and a sibling location for another name. A storage whose buffer cannot be
created through it (``supports_writes = False``) also overrides ``write``; one whose location
is neither a local path nor ``memory://`` overrides ``no_writes``.

This module imports pytest; ``import replaybuf`` does not import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from . import metasums
from .metasums import META_SUM
from .schema import Schema
from .storage import new_uuid
from .storage.base import (
    BufferNotFoundError,
    GenerationMismatchError,
    Storage,
    bookkeeping_fields,
    empty_state,
)

__all__ = ["StorageFactory", "StorageTests", "snapshot"]

StorageFactory = Callable[..., Storage]
PICKLE_BYTES = 32 << 10


def snapshot(location: str | os.PathLike) -> dict[str, tuple]:
    """Everything stored at a local folder (path -> size, mtime, content hash) or a
    ``memory://`` location (key -> content hash): equal snapshots mean nothing was written."""
    location = os.fspath(location)
    if location.startswith("memory://"):
        import fsspec

        store = fsspec.filesystem("memory").store
        prefix = "/" + location[len("memory://") :].strip("/") + "/"
        return {k: (hashlib.sha1(bytes(v.getbuffer())).hexdigest(),) for k, v in store.items() if k.startswith(prefix)}
    location = location.removeprefix("file://")
    out = {}
    for folder, dirs, files in os.walk(location):
        for name in dirs + files:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            digest = ""
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
            out[os.path.relpath(path, location)] = (stat.st_size, stat.st_mtime_ns, digest)
    return out


def assert_stored(got: np.ndarray, expected: np.ndarray, name: str) -> None:
    """``got`` is an ndarray of ``expected``'s dtype, shape and values: a read returning
    another dtype (float64 for a float32 field) passes ``assert_array_equal`` but is not
    what was stored."""
    assert isinstance(got, np.ndarray), f"{name}: a read returned {type(got).__name__}, not an ndarray"
    assert got.dtype == expected.dtype, f"{name}: read as {got.dtype}, stored as {expected.dtype}"
    np.testing.assert_array_equal(got, expected, err_msg=name, strict=True)


class StorageTests:
    """The Storage contract as tests; subclass it and define the ``storage_factory`` fixture.

    Tests that create a buffer or write through the storage skip when the storage class says
    ``supports_writes = False``; the read tests then run on what ``write`` put in place.
    """

    fields: dict = {
        # image-like steps: zarr stores one shard per episode with one chunk per frame
        "frame": ("uint8", (16, 16, 16)),
        # time chunks shorter than an episode: partial writes rewrite part of a chunk
        "state": {"dtype": "float32", "shape": [3], "chunks": 4},
        "action": ("int", 2),
        "reward": "float",
    }
    meta_fields: dict = {"task": "int", "score": ("float64", 2)}
    max_episodes = 6
    max_timesteps = 10
    #: the size of the side object ``test_blob_readers_never_see_a_torn_write`` replaces
    torn_blob_bytes = 1 << 18

    # ---- hooks -------------------------------------------------------------------------------

    @pytest.fixture
    def storage_factory(self) -> StorageFactory:
        """``factory(name="buffer") -> Storage``: a new, unopened Storage on location ``name``."""
        raise NotImplementedError("a StorageTests subclass defines the storage_factory fixture")

    def schema(self) -> Schema:
        """The suite's schema, with a new uuid, as ``ReplayBuffer`` gives every buffer it creates."""
        schema = Schema.build(self.fields, self.meta_fields, self.max_episodes, self.max_timesteps)
        return dataclasses.replace(schema, uuid=new_uuid())

    def write(
        self,
        factory: StorageFactory,
        episodes: np.ndarray,
        rows: dict[str, np.ndarray],
        meta: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """Write whole rows (len(episodes), max_timesteps, *shape) and meta values of
        ``episodes`` as another writer would: through a new Storage on the location, created
        when absent, then closed; ``meta["_meta_sum"]`` is set to the checksums of the values
        (as a commit writes them). Returns the rows as a reader should now see them."""
        storage = factory()
        if storage.exists():
            schema = storage.open(read_only=False)
        else:
            schema = self.schema()
            storage.create(schema, overwrite=False)
        storage.plan_generations(episodes, meta["_generation"])  # a commit's step 2: data bound to its episodes
        for name, values in rows.items():
            storage.write_rows(name, episodes, 0, values)
        meta[META_SUM] = metasums.entries(episodes, meta["_generation"], meta, metasums.summed(schema, storage))
        for name, values in meta.items():
            storage.write_meta(name, episodes, values)
        storage.commit_state({**storage.load_state(), "total_episodes": int(meta["_generation"].max())})
        storage.close()
        return rows

    @contextlib.contextmanager
    def no_writes(self, storage: Storage) -> Iterator[None]:
        """Fail unless nothing at ``storage``'s location, nor beside it (a lock file next to
        the folder), changed inside the block: the folder holding the factory's locations."""
        location = storage.location
        if "://" in location and not location.startswith(("memory://", "file://")):
            raise NotImplementedError(f"{type(self).__name__} must override no_writes for {location!r}")
        around = location.rstrip("/").rpartition("/")[0]
        before = snapshot(around)
        yield
        assert snapshot(around) == before, f"a read-only storage wrote at or beside {location!r}"

    # ---- data -------------------------------------------------------------------------------

    def random_rows(self, episodes: int, seed: int) -> dict[str, np.ndarray]:
        """Random rows (episodes, max_timesteps, *shape) of every data field."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, field in self.schema().fields.items():
            shape = (episodes, self.max_timesteps, *field.shape)
            if field.dtype.kind == "f":
                out[name] = rng.standard_normal(shape).astype(field.dtype)
            else:
                out[name] = rng.integers(1, 100, shape).astype(field.dtype)
        return out

    def random_meta(self, episodes: int, seed: int, first_generation: int = 1) -> dict[str, np.ndarray]:
        """Random values of every meta field, lengths in [1, max_timesteps], generations
        counting from ``first_generation`` and even revisions."""
        rng = np.random.default_rng(seed)
        schema = self.schema()
        out = {
            name: rng.integers(1, 100, (episodes, *field.shape)).astype(field.dtype)
            for name, field in schema.meta_fields.items()
        }
        out["episode_lens"] = rng.integers(1, self.max_timesteps + 1, episodes).astype(np.int32)
        out["_generation"] = np.arange(first_generation, first_generation + episodes, dtype=np.int64)
        out["_revision"] = 2 * rng.integers(0, 5, episodes, dtype=np.int64)
        out[META_SUM] = rng.integers(0, 2**63, episodes, dtype=np.uint64)  # ``write`` seals them
        return out

    @pytest.fixture
    def writable(self, storage_factory: StorageFactory) -> Iterator[Storage]:
        """A new buffer, created through the storage (skipped for storages that cannot write)."""
        storage = storage_factory()
        if not storage.supports_writes:
            pytest.skip(f"{type(storage).__name__} does not support writes")
        storage.create(self.schema(), overwrite=False)
        yield storage
        storage.close()

    @pytest.fixture
    def filled(self, storage_factory: StorageFactory) -> Iterator[tuple[Storage, dict, dict]]:
        """(a Storage opened read-only, its rows, its meta): every slot holds random data."""
        episodes = np.arange(self.max_episodes)
        meta = self.random_meta(self.max_episodes, seed=1)
        rows = self.write(storage_factory, episodes, self.random_rows(self.max_episodes, seed=0), meta)
        reader = storage_factory()
        reader.open(read_only=True)
        yield reader, rows, meta
        reader.close()

    def assert_reads(
        self, storage: Storage, rows: dict[str, np.ndarray], seed: int = 0, generations: np.ndarray | None = None
    ) -> None:
        """``read_rows``, ``gather``, ``read_spans`` and ``array`` all agree with ``rows``:
        repeated and unsorted episodes, partial and empty spans; with ``generations`` (one per
        slot) the reads name them."""
        rng = np.random.default_rng(seed)
        n, t = self.max_episodes, self.max_timesteps
        episodes = np.r_[rng.permutation(n), rng.integers(0, n, 3)]  # every slot, some repeated
        count = len(episodes)
        timesteps = rng.integers(0, t, count)
        starts = rng.integers(0, t, count)
        lengths = rng.integers(0, t + 1, count) * (rng.random(count) < 0.8)  # some zero lengths
        lengths = np.minimum(lengths, t - starts)
        named = None if generations is None else np.asarray(generations)[episodes]
        for name, expected in rows.items():
            assert_stored(storage.gather(name, episodes, timesteps, named), expected[episodes, timesteps], name)
            for t0, t1 in ((0, t), (t // 3, 2 * t // 3 + 1), (t // 2, t // 2)):
                assert_stored(storage.read_rows(name, episodes, t0, t1, named), expected[episodes, t0:t1], name)
            for parallel in (True, False):
                sentinel = np.array(7, expected.dtype)
                out = np.full((len(episodes), t, *expected.shape[2:]), sentinel)
                storage.read_spans(name, episodes, starts, lengths, out, parallel, named)
                for i, (e, s, k) in enumerate(zip(episodes, starts, lengths)):
                    np.testing.assert_array_equal(out[i, :k], expected[e, s : s + k], err_msg=f"{name} span {i}")
                    assert (out[i, k:] == sentinel).all(), f"read_spans wrote {name} past the span of row {i}"
            array = storage.array(name)
            assert tuple(array.shape) == expected.shape and np.dtype(array.dtype) == expected.dtype
            assert_stored(np.asarray(array[int(episodes[0]), 2:6]), expected[episodes[0], 2:6], name)

    # ---- create / open ----------------------------------------------------------------------

    def test_create_open_exists(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        if not storage.supports_writes:
            pytest.skip(f"{type(storage).__name__} does not support writes")
        assert not storage.exists()
        with pytest.raises(BufferNotFoundError):
            storage_factory().open(read_only=True)
        schema = self.schema()
        storage.create(schema, overwrite=False)
        assert storage.exists() and not storage.read_only
        assert storage.load_state() == empty_state()
        other = storage_factory()
        assert other.exists()
        assert other.open(read_only=True).to_json() == schema.to_json()
        assert other.read_only
        assert not storage_factory("other").exists()
        storage.close()
        other.close()

    def test_create_overwrite_erases(self, writable: Storage, storage_factory: StorageFactory) -> None:
        writable.append_log("episode", b"x")
        for name, values in self.random_rows(1, seed=5).items():
            writable.write_rows(name, np.array([0]), 0, values)
        writable.commit_state({**empty_state(), "num_episodes": 1})
        again = storage_factory()
        again.create(self.schema(), overwrite=True)
        assert again.log_names() == []
        assert again.load_state() == empty_state()
        for name in self.schema().fields:
            assert not again.read_rows(name, np.array([0]), 0, self.max_timesteps).any(), name
        again.close()

    def test_time_chunk_and_describe(self, filled: tuple) -> None:
        storage = filled[0]
        for name in self.schema().fields:
            chunk = storage.time_chunk(name)
            assert isinstance(chunk, int) and 1 <= chunk <= self.max_timesteps, (name, chunk)
        facts = storage.describe()
        assert facts["backend"] == storage.backend_name and facts["location"] == storage.location

    # ---- side objects ------------------------------------------------------------------------

    def test_blobs_replace_whole(self, writable: Storage) -> None:
        key = "replaybuf/extra/blob"
        assert writable.read_blob(key) is None
        writable.write_blob(key, b"first version, long")
        assert writable.read_blob(key) == b"first version, long"
        writable.write_blob(key, b"second")
        assert writable.read_blob(key) == b"second"
        writable.write_blob(key, b"")
        assert writable.read_blob(key) == b""

    def test_blob_readers_never_see_a_torn_write(self, writable: Storage, storage_factory: StorageFactory) -> None:
        """A reader polling a side object while the writer replaces it again and again reads
        one whole version each time, never a mix, a truncated or an empty object (a write in
        place, truncating first, shows those)."""
        key = "replaybuf/extra/replaced"
        versions = [bytes([ord("a") + k]) * self.torn_blob_bytes for k in range(2)]
        writable.write_blob(key, versions[0])
        reader = storage_factory()  # another object, as another process would read
        reader.open(read_only=True)
        writes = threading.Thread(target=lambda: [writable.write_blob(key, versions[k % 2]) for k in range(1, 9)])
        writes.start()
        try:
            while writes.is_alive():
                raw = reader.read_blob(key)
                assert raw in versions, f"read {len(raw or b'')} bytes, not one whole version of {self.torn_blob_bytes}"
        finally:
            writes.join()
            reader.close()
        assert reader.read_blob(key) == versions[0]

    def test_blob_head_reads_only_the_start(self, writable: Storage) -> None:
        key = "replaybuf/extra/head"
        assert writable.read_blob_head(key, 4) is None
        writable.write_blob(key, b"")
        assert writable.read_blob_head(key, 4) == b""
        writable.write_blob(key, b"0123456789")
        assert writable.read_blob_head(key, 4) == b"0123"
        assert writable.read_blob_head(key, 100) == b"0123456789"

    def test_list_blobs_sorted_by_prefix(self, writable: Storage) -> None:
        keys = ["replaybuf/t/b", "replaybuf/t/a", "replaybuf/t/c/d", "replaybuf/u/a", "replaybuf/tail"]
        for key in keys:
            writable.write_blob(key, key.encode())
        assert writable.list_blobs("replaybuf/t/") == ["replaybuf/t/a", "replaybuf/t/b", "replaybuf/t/c/d"]
        assert writable.list_blobs("replaybuf/t/c/") == ["replaybuf/t/c/d"]
        assert writable.list_blobs("replaybuf/none/") == []
        listed = writable.list_blobs("replaybuf/")
        assert listed == sorted(listed) and set(keys) <= set(listed)

    def test_delete_blobs_limited_to_prefix(self, writable: Storage, storage_factory: StorageFactory) -> None:
        sibling = storage_factory("buffer2")  # a string-prefix neighbour of "buffer"
        sibling.create(self.schema(), overwrite=False)
        for storage in (writable, sibling):
            for key in ("replaybuf/t/a", "replaybuf/t/b/c", "replaybuf/tail", "replaybuf/u/a"):
                storage.write_blob(key, b"x")
        writable.delete_blobs("replaybuf/t/")
        assert writable.list_blobs("replaybuf/t/") == []
        assert writable.read_blob("replaybuf/tail") == b"x" and writable.read_blob("replaybuf/u/a") == b"x"
        writable.delete_blobs("replaybuf/")
        assert writable.list_blobs("replaybuf/") == []
        assert writable.exists(), "deleting side objects removed the buffer itself"
        assert sibling.list_blobs("replaybuf/t/") == ["replaybuf/t/a", "replaybuf/t/b/c"]
        assert sibling.read_blob("replaybuf/tail") == b"x"
        sibling.close()

    def test_counters(self, writable: Storage, storage_factory: StorageFactory) -> None:
        state = {"num_episodes": 2, "episode_index": 2, "total_episodes": 5, "cleared": True}
        writable.commit_state(state)
        assert writable.load_state() == state
        reader = storage_factory()
        reader.open(read_only=True)
        assert reader.load_state() == state
        writable.commit_state({**state, "total_episodes": 6})
        assert reader.load_state()["total_episodes"] == 6
        reader.close()

    def test_commit_publishes_what_was_written_before(self, writable: Storage, storage_factory: StorageFactory) -> None:
        """A reader that loads the counters a commit published sees the rows and meta values
        written before it, while the writer stays open (nothing held back until ``close``)."""
        episodes = np.array([3, 1])
        rows, meta = self.random_rows(2, seed=22), self.random_meta(2, seed=23)
        writable.plan_generations(episodes, meta["_generation"])
        for name, values in rows.items():
            writable.write_rows(name, episodes, 0, values)
        probe = storage_factory()
        summed = metasums.summed(probe.open(read_only=True), writable)  # the stored schema: its uuid
        probe.close()
        meta[META_SUM] = metasums.entries(episodes, meta["_generation"], meta, summed)
        for name, values in meta.items():
            writable.write_meta(name, episodes, values)
        writable.commit_state({**empty_state(), "num_episodes": 2, "total_episodes": 2})
        reader = storage_factory()
        reader.open(read_only=True)
        assert reader.load_state()["total_episodes"] == 2
        for name, values in rows.items():
            assert_stored(reader.read_rows(name, episodes, 0, self.max_timesteps), values, name)
        for name, values in meta.items():
            assert_stored(reader.read_meta_rows(name, episodes), values, f"meta {name}")
        reader.close()

    def test_step_log(self, writable: Storage, storage_factory: StorageFactory) -> None:
        assert writable.log_names() == [] and writable.read_log("a") == b""
        writable.append_log("a", b"x")
        writable.append_log("a", b"yz")
        writable.append_log("ab", b"1")  # a name sharing a prefix with "a"
        assert writable.read_log("a") == b"xyz" and writable.read_log("ab") == b"1"
        assert writable.log_names() == ["a", "ab"]
        recovering = storage_factory()  # the next writer, after this one was killed
        recovering.open(read_only=False)
        assert recovering.read_log("a") == b"xyz"
        recovering.clear_log("a")
        assert recovering.read_log("a") == b"" and recovering.log_names() == ["ab"]
        assert recovering.read_log("ab") == b"1"
        recovering.append_log("a", b"new")
        assert recovering.read_log("a") == b"new"
        recovering.close()

    def test_damaged_step_log_copied_aside(self, writable: Storage) -> None:
        """Recovery of a damaged step log copies its first bytes aside and is told the bytes it
        left out (None where the store cannot tell them unread); the log itself stays."""
        writable.append_log("a", b"0123")
        writable.append_log("a", b"456789")
        for keep, left_out in ((10, 0), (6, 4)):
            key, dropped = writable.copy_log_aside("a", keep, limit=1 << 20)
            assert writable.read_blob(key) == b"0123456789"[:keep], keep
            assert dropped in (left_out, None if left_out else 0), (keep, dropped)
        assert writable.read_log("a") == b"0123456789"

    # ---- rows and meta -----------------------------------------------------------------------

    def test_write_rows_read_back(self, writable: Storage) -> None:
        """Partial, unaligned and overlapping writes in unsorted episode order land exactly."""
        rng = np.random.default_rng(3)
        schema = self.schema()
        mirror = {
            n: np.zeros((self.max_episodes, self.max_timesteps, *f.shape), f.dtype) for n, f in schema.fields.items()
        }
        t = self.max_timesteps
        for step, (t0, t1) in enumerate(((0, t), (t // 3, 2 * t // 3 + 1), (1, 2), (t // 2, t), (0, t // 2 - 1))):
            episodes = rng.permutation(self.max_episodes)[: 1 + step % 3]
            values = self.random_rows(len(episodes), seed=10 + step)
            for name, full in values.items():
                writable.write_rows(name, episodes, t0, full[:, t0:t1])
                mirror[name][episodes, t0:t1] = full[:, t0:t1]
        self.assert_reads(writable, mirror)

    def test_write_tail_rows_reads_its_padding_as_zeros(self, writable: Storage) -> None:
        """The last rows of an episode, padded with zeros past ``end``, over a slot that held a
        longer episode: every step reads back as written, the padding as zeros."""
        t = self.max_timesteps
        end = max(1, t // 2 - 1)
        old, new = self.random_rows(2, seed=20), self.random_rows(2, seed=21)
        episodes = np.array([self.max_episodes - 1, 0])
        mirror = {}
        for name, full in new.items():
            writable.write_rows(name, episodes, 0, old[name])
            padded = full.copy()
            padded[:, end:] = 0
            writable.write_tail_rows(name, episodes, 0, padded, end)
            mirror[name] = np.zeros((self.max_episodes, t, *full.shape[2:]), full.dtype)
            mirror[name][episodes] = padded
        self.assert_reads(writable, mirror)

    def test_write_meta_read_back(self, writable: Storage) -> None:
        schema = self.schema()
        names = [*schema.meta_fields, *bookkeeping_fields(schema)]
        for name in names:
            assert not writable.read_meta(name).any(), f"meta {name!r} is not zero in a new buffer"
        values = self.random_meta(3, seed=4)
        episodes = np.array([self.max_episodes - 1, 0, self.max_episodes // 2])
        for name in names:
            writable.write_meta(name, episodes, values[name])
            expected = np.zeros((self.max_episodes, *values[name].shape[1:]), values[name].dtype)
            expected[episodes] = values[name]
            stored = writable.read_meta(name)
            assert stored.dtype == expected.dtype, name
            np.testing.assert_array_equal(stored, expected, err_msg=name)

    def test_reads_agree(self, filled: tuple) -> None:
        reader, rows, meta = filled
        self.assert_reads(reader, rows, seed=1)
        picked = np.r_[np.random.default_rng(2).permutation(self.max_episodes), 0, 0]  # unsorted, repeated
        for name, values in meta.items():
            assert_stored(reader.read_meta(name), values, f"meta {name}")
            assert_stored(reader.read_meta_rows(name, picked), values[picked], f"meta {name}")
            assert reader.read_meta_rows(name, np.zeros(0, np.int64)).shape == (0, *values.shape[1:]), name

    def test_generations(self, filled: tuple) -> None:
        reader, _, meta = filled
        for name, field in bookkeeping_fields(self.schema()).items():
            stored = reader.read_meta(name)
            assert stored.dtype == field.dtype and stored.shape == (self.max_episodes,), name
        assert reader.read_meta("_generation").dtype == np.int64
        np.testing.assert_array_equal(reader.read_meta("_generation"), meta["_generation"])

    def test_reads_name_generations(self, filled: tuple) -> None:
        """Reads given the slots' stored generations return the stored rows, twice (the
        second may be served from whatever the first cached); ``preload`` changes nothing."""
        reader, rows, meta = filled
        slots = np.arange(self.max_episodes)
        for name in rows:
            reader.preload(name, slots, meta["_generation"])
        for seed in (7, 8):
            self.assert_reads(reader, rows, seed=seed, generations=meta["_generation"])

    def test_reads_of_a_reused_slot(self, filled: tuple, storage_factory: StorageFactory) -> None:
        """A writer reuses two slots (new rows, new generations). Reads naming the new
        generations return the new rows; reads naming the old ones either return the old rows
        (a copy kept for that generation) or raise GenerationMismatchError naming reused slots
        (all those read, for fields whose reads the storage ``verifies_reads``). Slots not reused
        read as before."""
        reader, rows, meta = filled
        self.assert_reads(reader, rows, seed=9, generations=meta["_generation"])  # fill caches
        reused = np.array([self.max_episodes - 1, 1])
        new_meta = self.random_meta(2, seed=11, first_generation=self.max_episodes + 1)
        new_rows = self.write(storage_factory, reused, self.random_rows(2, seed=10), new_meta)
        reader.drop_caches()
        generations = meta["_generation"].copy()
        generations[reused] = new_meta["_generation"]
        expected = {n: r.copy() for n, r in rows.items()}
        for name, values in new_rows.items():
            expected[name][reused] = values
        self.assert_reads(reader, expected, seed=9, generations=generations)
        episodes, t = np.array([0, 1, self.max_episodes - 1, 1]), self.max_timesteps
        for name, old in rows.items():
            try:
                got = reader.read_rows(name, episodes, 0, t, meta["_generation"][episodes])
            except GenerationMismatchError as error:
                # only reused slots, and every one read where the storage verifies these reads
                # (a concatenation whose zarr member verifies its resident fields names its own)
                assert error.slots and set(error.slots) <= set(reused.tolist()), (name, error.slots)
                if reader.verifies_reads([name]):
                    assert error.slots == sorted(reused.tolist()), (name, error.slots)
                assert pickle.loads(pickle.dumps(error)).slots == error.slots
                continue
            new = expected[name][episodes]
            for i, slot in enumerate(episodes.tolist()):
                assert (got[i] == old[slot]).all() or (
                    not reader.verifies_reads([name]) and (got[i] == new[i]).all()
                ), f"{name}: slot {slot} read as neither its planned generation's rows nor the stored ones"

    def test_verified_reads_refuse_a_generation_never_stored(self, filled: tuple) -> None:
        """On a storage that ``verifies_generations``, every read naming a generation the slot
        does not hold (and never held) raises GenerationMismatchError naming that slot only."""
        reader, rows, meta = filled
        if not reader.verifies_generations:
            pytest.skip(f"{type(reader).__name__} does not verify generations")
        episodes = np.array([0, 2, 3])
        planned = meta["_generation"][episodes].copy()
        planned[1] += 1000
        name, t = next(iter(rows)), self.max_timesteps
        reads = {
            "read_rows": lambda: reader.read_rows(name, episodes, 0, t, planned),
            "gather": lambda: reader.gather(name, episodes, np.zeros(3, np.int64), planned),
            "read_spans": lambda: reader.read_spans(
                name,
                episodes,
                np.zeros(3, np.int64),
                np.full(3, t),
                np.zeros((3, *rows[name].shape[1:]), rows[name].dtype),
                True,
                planned,
            ),
        }
        for call, read in reads.items():
            with pytest.raises(GenerationMismatchError) as caught:
                read()
            assert caught.value.slots == [2], (call, caught.value.slots)

    def test_verified_gathers_refuse_a_generation_not_held(self, filled: tuple) -> None:
        """On a storage that ``verifies_gathers`` a field, a gather naming a generation a slot
        does not hold raises GenerationMismatchError naming that slot only, before and after
        gathers naming the held generations (whatever those left cached or verified)."""
        reader, rows, meta = filled
        names = [name for name in rows if reader.verifies_gathers([name])]
        if not names:
            pytest.skip(f"{type(reader).__name__} verifies no gathers")
        episodes, steps = np.array([0, 2, 3, 2]), np.array([0, 1, 0, self.max_timesteps - 1])
        planned = meta["_generation"][episodes].copy()
        wrong = planned.copy()
        wrong[episodes == 2] += 1000
        for name in names:
            for attempt in ("first", "after a sound gather"):
                with pytest.raises(GenerationMismatchError) as caught:
                    reader.gather(name, episodes, steps, wrong)
                assert caught.value.slots == [2], (name, attempt, caught.value.slots)
                np.testing.assert_array_equal(
                    reader.gather(name, episodes, steps, planned), rows[name][episodes, steps], err_msg=name
                )

    def test_update_rows_in_committed_episodes(self, writable: Storage) -> None:
        """``update_rows`` edits committed episodes in place; whole-episode reads (which check
        checksums where a backend keeps them) return the edit."""
        episodes = np.array([2, 0])
        rows = self.random_rows(2, seed=12)
        meta = self.random_meta(2, seed=13)
        meta["episode_lens"][:] = self.max_timesteps
        writable.plan_generations(episodes, meta["_generation"])
        for name, values in rows.items():
            writable.write_rows(name, episodes, 0, values)
        for name, values in meta.items():
            writable.write_meta(name, episodes, values)
        edit = self.random_rows(2, seed=14)
        t0, t1 = 1, self.max_timesteps // 2
        for name, values in edit.items():
            writable.update_rows(name, episodes, t0, values[:, t0:t1])
            writable.update_rows(name, episodes[:0], t0, values[:0, t0:t1])  # no episodes: nothing
            rows[name][:, t0:t1] = values[:, t0:t1]
        for name, values in rows.items():
            np.testing.assert_array_equal(writable.read_rows(name, episodes, 0, self.max_timesteps), values)
            out = np.zeros_like(values)
            writable.read_spans(name, episodes, np.zeros(2, np.int64), np.full(2, self.max_timesteps), out)
            np.testing.assert_array_equal(out, values, err_msg=name)

    def test_update_steps_in_committed_episodes(self, writable: Storage) -> None:
        """``update_steps`` sets single steps of committed episodes in place, pairs in any order
        (a pair given twice keeps its last value; no pairs: nothing), and leaves every other
        step as it was; whole-episode reads (checked where a backend keeps checksums) agree."""
        episodes = np.array([2, 0, 1])
        rows = self.random_rows(3, seed=15)
        meta = self.random_meta(3, seed=16)
        meta["episode_lens"][:] = self.max_timesteps
        writable.plan_generations(episodes, meta["_generation"])
        for name, values in rows.items():
            writable.write_rows(name, episodes, 0, values)
        for name, values in meta.items():
            writable.write_meta(name, episodes, values)
        last = self.max_timesteps - 1
        slots, steps = np.array([1, 0, 2, 1, 0]), np.array([last, 0, 1, last, 0])
        edit = self.random_rows(len(slots), seed=17)  # a value per pair: the repeated ones differ
        for name, values in edit.items():
            picked = values[np.arange(len(slots)), steps]
            writable.update_steps(name, slots, steps, picked)
            writable.update_steps(name, slots[:0], steps[:0], picked[:0])  # no pairs: nothing
            row_of = {int(slot): i for i, slot in enumerate(episodes)}
            for slot, step, value in zip(slots.tolist(), steps.tolist(), picked):
                rows[name][row_of[slot], step] = value
        for name, values in rows.items():
            np.testing.assert_array_equal(writable.read_rows(name, episodes, 0, self.max_timesteps), values)
            out = np.zeros_like(values)
            writable.read_spans(name, episodes, np.zeros(3, np.int64), np.full(3, self.max_timesteps), out)
            np.testing.assert_array_equal(out, values, err_msg=name)

    def test_new_buffer_generations_are_zero(self, writable: Storage) -> None:
        generations = writable.read_meta("_generation")
        assert generations.dtype == np.int64 and not generations.any()

    # ---- read-only ----------------------------------------------------------------------------

    def test_read_only_refuses_and_writes_nothing(self, filled: tuple, storage_factory: StorageFactory) -> None:
        reader, rows, meta = filled
        refusal = PermissionError if reader.supports_writes else NotImplementedError
        one, name = np.array([0]), next(iter(rows))
        row = rows[name][:1]
        with self.no_writes(reader):
            again = storage_factory()
            again.open(read_only=True)
            for field in rows:
                again.preload(field, np.arange(self.max_episodes), meta["_generation"])
            self.assert_reads(again, rows, seed=2, generations=meta["_generation"])
            again.load_state()
            again.list_blobs("replaybuf/")
            again.log_names()
            again.read_log("a")
            again.drop_caches()
            again.flush()
            again.close()
            attempts = {
                "write_blob": lambda: reader.write_blob("replaybuf/extra/x", b"x"),
                "delete_blobs": lambda: reader.delete_blobs("replaybuf/"),
                "commit_state": lambda: reader.commit_state(empty_state()),
                "append_log": lambda: reader.append_log("a", b"x"),
                "clear_log": lambda: reader.clear_log("a"),
                "write_rows": lambda: reader.write_rows(name, one, 0, row),
                "update_rows": lambda: reader.update_rows(name, one, 0, row),
                "write_meta": lambda: reader.write_meta("task", one, meta["task"][:1]),
                "write_tail_rows": lambda: reader.write_tail_rows(name, one, 0, row, 1),
                "update_steps": lambda: reader.update_steps(name, one, one * 0, row[:, 0]),
                "write_record": lambda: reader.write_record("replaybuf/extra/x", b"x"),
                "mark_writing": lambda: reader.mark_writing([0]),
                "array(...)[...] =": lambda: reader.array(name).__setitem__((0, 0), 1),
                "array(meta)[...] =": lambda: reader.array("task", meta=True).__setitem__(0, 1),
            }
            for call, attempt in attempts.items():
                with pytest.raises(refusal):
                    attempt()
                    pytest.fail(f"{call} on a read-only storage did not raise {refusal.__name__}")
            reader.flush()
        self.assert_reads(reader, rows, seed=3)

    def test_reads_share_no_memory(self, filled: tuple) -> None:
        """What a read returns is the caller's: changing it in place changes no later read (no
        view of a cache or of the stored bytes)."""
        reader, rows, meta = filled
        one, t = np.array([1]), self.max_timesteps
        reads = {}
        for name in rows:
            reads[f"{name}: read_rows"] = reader.read_rows(name, one, 0, t)
            reads[f"{name}: gather"] = reader.gather(name, one, np.array([2]))
            reads[f"{name}: array[...]"] = np.asarray(reader.array(name)[1, 2:6])
        for name in meta:
            reads[f"meta {name}: read_meta"] = reader.read_meta(name)
            reads[f"meta {name}: read_meta_rows"] = reader.read_meta_rows(name, one)
            reads[f"meta {name}: array[...]"] = np.asarray(reader.array(name, meta=True)[0:2])
        for read in reads.values():
            if read.flags.writeable:  # a read-only result cannot be changed, so shares nothing that can
                read[...] = 3
        self.assert_reads(reader, rows, seed=10)
        for name, values in meta.items():
            assert_stored(reader.read_meta(name), values, f"meta {name} after changing what a read returned")

    def test_writes_keep_no_reference(self, writable: Storage) -> None:
        """What a write was given stays the caller's: changing it after the call changes
        nothing stored (no reference kept in a cache or a pending write)."""
        one, t = np.array([1]), self.max_timesteps
        given = self.random_rows(1, seed=18)
        kept = {name: values.copy() for name, values in given.items()}
        task = np.array([41], dtype=self.schema().meta_fields["task"].dtype)
        for name, values in given.items():
            writable.write_rows(name, one, 0, values)
            values[...] = 5
        writable.write_meta("task", one, task)
        task[...] = 5
        for name, values in kept.items():
            assert_stored(writable.read_rows(name, one, 0, t), values, f"{name}: changed with the array it was given")
        assert writable.read_meta("task")[1] == 41, "meta task: changed with the array it was given"

    # ---- processes and caches ---------------------------------------------------------------

    def test_pickles_without_open_handles(self, filled: tuple) -> None:
        reader, rows, _ = filled
        self.assert_reads(reader, rows, seed=4)  # open whatever a reader opens
        payload = pickle.dumps(reader)
        # a location, a schema and codec settings: a few KB, far below the ~250 KB of rows
        assert len(payload) < PICKLE_BYTES, f"a pickled {type(reader).__name__} carries data ({len(payload)} bytes)"
        clone = pickle.loads(payload)
        assert clone.read_only
        self.assert_reads(clone, rows, seed=5)
        clone.close()

    def test_writer_pickles(self, writable: Storage) -> None:
        writable.append_log("a", b"x")
        rows = self.random_rows(1, seed=6)
        for name, values in rows.items():
            writable.write_rows(name, np.array([1]), 0, values)
        clone = pickle.loads(pickle.dumps(writable))
        assert not clone.read_only and clone.read_log("a") == b"x"
        for name, values in rows.items():
            np.testing.assert_array_equal(clone.read_rows(name, np.array([1]), 0, 2), values[:, :2], err_msg=name)

    def test_drop_caches_sees_another_writer(self, filled: tuple, storage_factory: StorageFactory) -> None:
        reader, rows, meta = filled
        self.assert_reads(reader, rows, seed=6)  # fill whatever the reader caches
        for name in meta:
            reader.read_meta(name)
        episodes = np.array([self.max_episodes - 2, 1])
        new_meta = self.random_meta(2, seed=8, first_generation=self.max_episodes + 1)
        written = self.write(storage_factory, episodes, self.random_rows(2, seed=7), new_meta)
        reader.drop_caches()
        expected = {n: r.copy() for n, r in rows.items()}
        for name, values in written.items():
            expected[name][episodes] = values
        self.assert_reads(reader, expected, seed=6)
        for name, values in new_meta.items():
            np.testing.assert_array_equal(reader.read_meta(name)[episodes], values, err_msg=name)
        if reader.supports_writes:
            assert reader.load_state()["total_episodes"] == self.max_episodes + 2
