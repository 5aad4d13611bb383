"""The zarr backend's on-disk format: valid zarr v3 that zarr-python reads, JSON config only."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr

from replaybuf import ReplayBuffer, verify
from replaybuf.sampling import chunk_cache
from replaybuf.schema import Schema
from replaybuf.storage import _zarr, make_storage


@pytest.mark.parametrize("compressor", ["zstd", "zstd:7", "blosc-lz4", "blosc-zstd:3", "gzip:4", "none"])
def test_zarr_python_reads_what_replaybuf_writes(tmp_path, compressor):
    path = str(tmp_path / "b")
    fields = dict(
        frame={"dtype": "uint8", "shape": (32, 32, 3), "compressor": compressor},
        state={"dtype": "float", "shape": 5, "compressor": compressor, "chunks": 4},
        reward="float",
    )
    buffer = ReplayBuffer(path, 4, 11, fields=fields, meta_fields=dict(task=("int", 2)))
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (9, 32, 32, 3), dtype=np.uint8)
    frames[3] = 0
    states = rng.normal(size=(9, 5)).astype(np.float32)
    buffer.store_episode(frame=frames, state=states, reward=np.arange(9.0), task=[3, 4])
    with buffer.one_episode(task=[1, 2]):
        for t in range(11):
            buffer.store(frame=frames[t % 9], state=states[t % 9], reward=-t)

    group = zarr.open_group(path, mode="r")
    np.testing.assert_array_equal(group["data/frame"][0, :9], frames)
    assert not group["data/frame"][0, 9:].any()
    np.testing.assert_array_equal(group["data/state"][0, :9], states)
    np.testing.assert_array_equal(group["data/reward"][1, :], -np.arange(11.0))
    assert group["meta/task"][:2].tolist() == [[3, 4], [1, 2]]
    assert group["meta/episode_lens"][:3].tolist() == [9, 11, 0]
    assert group.attrs["format"] == "replaybuf" and group.attrs["fields"]["frame"]["compressor"] == compressor
    np.testing.assert_array_equal(buffer.data["frame"][1, 2:5], frames[2:5])
    assert buffer.storage.describe()["arrays"]["data/state"]["chunks"][1] == 4
    # each shard read above holds its binding to its slot before its index, which zarr-python
    # skips; so do the shards a close() compacts
    assert buffer.storage.binds_shards
    buffer.close()
    frame = zarr.open_group(path, mode="r")["data/frame"]
    np.testing.assert_array_equal(frame[0, :9], frames)
    np.testing.assert_array_equal(frame[1, :11], frames[np.arange(11) % 9])


def test_image_fields_are_one_shard_per_episode(tmp_path):
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 5, 40, fields=dict(frame=("uint8", (64, 64, 3)), reward="float"))
    for _ in range(3):
        buffer.store_episode(frame=np.full((30, 64, 64, 3), 9, np.uint8), reward=np.ones(30))
    shards = [p.name for p in (path / "data" / "frame").iterdir() if p.name != "zarr.json"]
    assert sorted(shards) == ["c.0.0.0.0.0", "c.1.0.0.0.0", "c.2.0.0.0.0"]
    assert buffer.storage.describe()["arrays"]["data/frame"]["chunks"] == (1, 1, 64, 64, 3)
    assert buffer.storage.gather("frame", np.array([2, 0, 2]), np.array([29, 0, 5]))[:, 0, 0, 0].tolist() == [9] * 3
    assert buffer.storage.read_rows("frame", np.array([1]), 28, 32)[0, :, 0, 0, 0].tolist() == [9, 9, 0, 0]


def test_default_codecs_are_blosc_lz4_for_images_and_packed_raw_vectors(tmp_path):
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 2, 6, fields=dict(frame=("uint8", (64, 64, 3)), state=("float", 4)))
    buffer.store_episode(
        frame=np.arange(6 * 64 * 64 * 3, dtype=np.uint64).reshape(6, 64, 64, 3).astype(np.uint8), state=np.ones((6, 4))
    )
    sharding = json.loads((path / "data" / "frame" / "zarr.json").read_text())["codecs"][0]
    *_, blosc, crc = sharding["configuration"]["codecs"]
    assert blosc["name"] == "blosc" and crc["name"] == "crc32c"
    assert {k: blosc["configuration"][k] for k in ("cname", "clevel", "shuffle")} == {
        "cname": "lz4",
        "clevel": 9,
        "shuffle": "noshuffle",
    }
    # format 3: small fields of both slots share one uncompressed chunk of whole rows
    state = json.loads((path / "data" / "state" / "zarr.json").read_text())
    assert [c["name"] for c in state["codecs"]] == ["bytes"]
    assert state["chunk_grid"]["configuration"]["chunk_shape"] == [2, 6, 4]
    assert sorted(os.listdir(path / "data" / "state")) == ["c.0.0.0", "zarr.json"]
    explicit = ReplayBuffer(
        str(tmp_path / "z"), 2, 6, fields=dict(state={"dtype": "float", "shape": 4, "compressor": "zstd"})
    )
    codecs = json.loads((tmp_path / "z" / "data" / "state" / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "zstd", "crc32c"] and codecs[1]["configuration"]["level"] == 3
    explicit.close()
    group = zarr.open_group(str(path), mode="r")
    np.testing.assert_array_equal(group["data/frame"][0, :, 5, 7], buffer.data["frame"][0, :, 5, 7])
    assert group["data/frame"][0, 3].any()


def test_update_inside_a_shard_keeps_the_other_frames(tmp_path):
    buffer = ReplayBuffer(str(tmp_path / "b"), 2, 10, fields=dict(frame=("uint8", (48, 48, 3))))
    frames = np.arange(10, dtype=np.uint8)[:, None, None, None] * np.ones((1, 48, 48, 3), np.uint8)
    buffer.store_episode(frame=frames)
    buffer.update(0, frame=np.full((1, 48, 48, 3), 200, np.uint8))
    buffer.store_datapoint(0, 5, "frame", np.full((48, 48, 3), 100, np.uint8))
    assert buffer.data["frame"][0, :, 0, 0, 0].tolist() == [200, 1, 2, 3, 4, 100, 6, 7, 8, 9]


def test_config_is_json_and_no_pickle_anywhere(tmp_path):
    path = tmp_path / "b"
    ReplayBuffer(str(path), 2, 3, fields=dict(x=("float", 2, 0.5)), meta_fields=dict(m="int")).store_episode(
        x=np.ones((2, 2)), m=1
    )
    attributes = json.loads((path / "zarr.json").read_text())["attributes"]
    assert attributes["version"] == 7 and attributes["fields"]["x"] == {
        "dtype": "float32",
        "shape": [2],
        "default": 0.5,
    }
    assert json.loads((path / "replaybuf" / "state.json").read_text())["num_episodes"] == 1
    assert not [p for p in path.rglob("*") if p.suffix in (".pkl", ".pickle")]


def test_newer_format_version_is_refused(tmp_path):
    path = tmp_path / "b"
    ReplayBuffer(str(path), 2, 3, fields=dict(x="float"))
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["version"] = 99
    (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="upgrade replaybuf"):
        ReplayBuffer.from_folder(str(path))


@pytest.fixture
def no_resident_copies():
    """Small test arrays would be held whole in RAM; make reads go to the files."""
    cache = chunk_cache()
    before = cache.resident_bytes
    cache.resize(resident_bytes=0)
    yield
    cache.resize(resident_bytes=before)


def test_frame_reads_through_kept_open_files_see_rewrites(tmp_path, no_resident_copies):
    """Versioned frame reads keep shard files open; a reused slot (new generation) read by
    another buffer, and an update in place or a deleted shard read by the writer itself, must
    all read as the data now stored, never the old file's."""
    path = str(tmp_path / "b")
    writer = ReplayBuffer(path, 2, 4, fields=dict(frame=("uint8", (48, 48, 3))), circular=True)
    frames = lambda value: np.full((4, 48, 48, 3), value, np.uint8)  # noqa: E731
    writer.store_episode(frame=frames(1))
    writer.store_episode(frame=frames(2))
    reader = ReplayBuffer.from_folder(path, read_only=True)

    def read(buffer: ReplayBuffer, slot: int) -> list[int]:
        versions = np.full(4, buffer._meta["_generation"][slot])
        return buffer.storage.array("frame").gather(np.full(4, slot), np.arange(4), versions)[:, 0, 0, 0].tolist()

    assert read(reader, 0) == [1] * 4 and read(writer, 1) == [2] * 4
    writer.store_episode(frame=frames(3))  # reuses slot 0 under a new generation
    reader.refresh()
    assert read(reader, 0) == [3] * 4
    writer.update(1, frame=frames(5))  # same generation, the file replaced
    assert read(writer, 1) == [5] * 4
    writer.update(1, frame=frames(0))  # an all-zero shard is deleted
    assert read(writer, 1) == [0] * 4
    loader = writer.dataloader(8, timestep_level=True, shuffle=False)
    assert sorted(next(iter(loader))["frame"][:, 0, 0, 0].tolist()) == [0] * 4 + [3] * 4


def test_meta_rows_read_only_the_chunks_holding_them(tmp_path, monkeypatch):
    """The re-check of a batch reads the chunks of its slots, in any order, across chunks."""
    monkeypatch.setattr(_zarr, "META_CHUNK_EPISODES", 4)
    buffer = ReplayBuffer(str(tmp_path / "b"), max_episodes=10, max_timesteps=3, fields={"x": "float"})
    for length in range(1, 10):
        buffer.store_episode(x=np.zeros(length % 3 + 1, np.float32))
    storage = buffer.storage
    assert storage.array("episode_lens", meta=True).chunks == (4,)
    lens = storage.read_meta("episode_lens")
    for slots in ([9, 0, 5, 5, 2], [6], [3, 1]):
        np.testing.assert_array_equal(storage.read_meta_rows("episode_lens", np.array(slots)), lens[slots])
    with pytest.raises(IndexError, match=r"meta/_generation: slots \[10, -1\] out of range - must be in \[0, 10\)"):
        storage.read_meta_rows("_generation", np.array([3, 10, -1]))


def test_a_zarr_create_without_a_uuid_is_refused_before_anything_is_written(tmp_path):
    """Each shard is bound to the buffer's uuid (format 6): a storage-level create of a schema
    without one (ReplayBuffer and convert always give one) writes nothing."""
    storage = make_storage(str(tmp_path / "b"), backend="zarr")
    with pytest.raises(ValueError, match=r"its schema has no uuid, which each of its shards is bound to"):
        storage.create(Schema.build({"frame": ("uint8", (32, 32, 4))}, None, 2, 4), overwrite=False)
    assert not (tmp_path / "b").exists()


def _bound_generations(buffer: ReplayBuffer) -> dict[int, int]:
    """Slot -> the generation the binding of its frame shard names (format 7), for every slot
    holding an episode."""
    array = buffer.storage.array("frame")
    bound = {}
    for slot in buffer.valid_episodes().tolist():
        shard = array.kv.get(array.shard_key(slot))
        bound[slot] = array.binding.held_generation(shard[-array.index_nbytes :])
    return bound


def _published_generations(buffer: ReplayBuffer) -> dict[int, int]:
    slots = buffer.valid_episodes()
    return dict(zip(slots.tolist(), buffer.storage.read_meta_rows("_generation", slots).tolist()))


def test_every_shard_is_bound_to_the_generation_its_episode_publishes(tmp_path):
    """Format 7: a shard is written before its episode's generation publishes, so the generation
    is fixed when the group starts writing (``Committer.plan_generations``). Whatever the API
    interleaves with an episode stored step by step (edits of committed episodes, meta edits,
    flushes, a whole episode that discards the steps, batches cut short, drops, reuse), each
    committed slot's shard names the generation its slot publishes, and an edit keeps it."""
    path = str(tmp_path / "b")
    fields = dict(frame=("uint8", (40, 40, 3)), reward="float")
    buffer = ReplayBuffer(path, 3, 6, fields=fields, meta_fields=dict(task="int"), circular=True)
    rng = np.random.default_rng(0)

    def frames(n: int, batch: int | None = None) -> np.ndarray:
        shape = (n, 40, 40, 3) if batch is None else (n, batch, 40, 40, 3)
        return rng.integers(1, 255, shape, dtype=np.uint8)

    def check() -> None:
        assert _bound_generations(buffer) == _published_generations(buffer)

    for _ in range(2):
        buffer.store_episode(frame=frames(4), reward=np.zeros(4))
    check()
    steps = frames(5)
    for t in range(3):  # slot 2, step by step, with edits of the committed slots in between
        buffer.store(frame=steps[t], reward=float(t))
        buffer.store_datapoint(0, 1, "frame", steps[t])
        buffer.update([1], frame=frames(4)[None])
        buffer.store_meta_datapoint(1, "task", t)
        buffer.flush()
        check()
    for t in range(3, 5):
        buffer.store(frame=steps[t], reward=float(t))
    buffer.advance_episode()
    check()
    np.testing.assert_array_equal(buffer.data["frame"][0, 1], steps[2])
    batch = frames(6, 2)
    with buffer.batched_episode(2):  # slots 0 and 1 reused
        for t in range(6):
            buffer.store_batch(frame=batch[t], reward=np.full(2, float(t)))
    check()
    buffer.store(frame=steps[0], reward=0.0)
    with pytest.warns(UserWarning, match="its steps are discarded"):
        buffer.store_episode(frame=frames(3), reward=np.zeros(3))  # slot 2, over the steps begun there
    check()
    buffer.store_batch(frame=frames(1, 2)[0], reward=np.zeros(2))  # slots 0 and 1; only the first is kept
    buffer.advance_episode(batch_size=1)
    check()
    assert buffer.drop_episodes([2]) == [2]
    buffer.store_episode(frame=frames(2), reward=np.zeros(2))  # slot 1
    buffer.store_episode(frame=frames(6), reward=np.zeros(6))  # slot 2, dropped before
    check()
    expected = buffer.get_all_data()
    buffer.close()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    for name, values in reader.get_all_data().items():
        np.testing.assert_array_equal(np.asarray(values), np.asarray(expected[name]), err_msg=name)
    assert _bound_generations(reader) == _published_generations(reader) and len(reader.valid_episodes()) == 3
    assert verify(path) == []
