"""Buffers on object storage (issue 5): the same calls as on local disk, on a real S3 API server
(moto) and a GCS emulator, both on 127.0.0.1 and started by fixtures."""

from __future__ import annotations

import uuid
from datetime import timedelta

import numpy as np
import pytest

from replaybuf import LostLengthError, ReplayBuffer, StorageError, verify

from ._data import fields, random_episode

pytest_plugins = ["tests._servers"]

FIELDS = fields("frame", "state", "reward", frame=("uint8", (16, 16, 3)))


@pytest.fixture(params=["s3", "gcs"])
def server(request):
    return request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")


def new_location(server) -> str:
    return server.url(f"buffers/{uuid.uuid4().hex[:12]}")


def episode(length: int, seed: int) -> dict:
    """Random frames and states; the reward is the step index."""
    return random_episode(
        FIELDS,
        length,
        seed,
        frame=lambda rng, shape: rng.integers(0, 255, shape, dtype=np.uint8),
        reward=lambda rng, shape: np.arange(length),
    )


def test_objects_ending_in_any_byte_read_back_whole(server):
    """A meta chunk ends in its last slot's last byte: endings a multipart upload's framing could
    take for its own line end (0x0d, 0x0a, 0x0d 0x0a) read back whole."""
    url = new_location(server)
    options = dict(storage_options=server.storage_options)
    buffer = ReplayBuffer(url, 1, 2, fields={"x": "float"}, meta_fields=dict(tag="int64"), circular=True, **options)
    for end in (b"\r", b"\n", b"\r\n", b"\n\r", b" "):
        tag = int(np.frombuffer(end.rjust(8, b"\x01"), "<i8")[0])  # little-endian: its last bytes end the chunk
        buffer.store_episode(x=np.zeros(2), tag=tag)
        assert ReplayBuffer.from_folder(url, read_only=True, **options).meta_data["tag"][0] == tag, end
    buffer.close()


def test_write_reopen_and_read_in_place(server):
    url = new_location(server)
    buffer = ReplayBuffer(
        url,
        4,
        12,
        fields=FIELDS,
        meta_fields=dict(task="int"),
        storage_options=server.storage_options,
        flush_every_store_step=0,
    )
    first = episode(7, 0)
    buffer.store_episode(**first, task=1)
    with buffer.one_episode(task=2):
        for t in range(5):
            buffer.store(frame=first["frame"][t], state=first["state"][t], reward=-t)
    with buffer.batched_episode(2, task=[3, 4]):
        buffer.store_batch(reward=np.array([1.0, 2.0]))

    again = ReplayBuffer.from_folder(url, storage_options=server.storage_options)
    assert again.num_episodes == 4 and again.episode_lens.tolist() == [7, 5, 1, 1]
    np.testing.assert_array_equal(again.data["frame"][0, :7], first["frame"])
    np.testing.assert_array_equal(
        again.storage.gather("frame", np.array([1, 0]), np.array([4, 6])), first["frame"][[4, 6]]
    )
    assert again.meta_data["task"][:].tolist() == [1, 2, 3, 4]
    data = again.get_all_data()
    assert data["reward"].shape == (4, 7) and data["reward"][1, :5].tolist() == [0, -1, -2, -3, -4]
    again.update([0], reward=np.zeros((1, 7)))
    assert (
        not ReplayBuffer.from_folder(url, read_only=True, storage_options=server.storage_options)
        .data["reward"][0]
        .any()
    )


def test_read_only_issues_no_write_request(server):
    url = new_location(server)
    writer = ReplayBuffer(url, 3, 8, fields=FIELDS, storage_options=server.storage_options)
    writer.store_episode(**episode(6, 1))
    with server.record() as requests:
        reader = ReplayBuffer.from_folder(url, read_only=True, storage_options=server.storage_options)
        reader.get_all_data()
        reader.refresh()
        with pytest.raises(ValueError, match="read-only"):
            reader.store_episode(**episode(2, 2))
        reader.close()
    assert requests.count() > 0
    assert requests.writes() == []


def test_missing_buffer_and_config_mismatch(server):
    url = new_location(server)
    with server.record() as requests:
        with pytest.raises(FileNotFoundError, match="no replaybuf buffer"):
            ReplayBuffer.from_folder(url, read_only=True, storage_options=server.storage_options)
    assert requests.writes() == []
    ReplayBuffer(url, 3, 8, fields=FIELDS, storage_options=server.storage_options).store_episode(**episode(3, 0))
    with pytest.raises(ValueError, match="max_episodes: stored 3 vs passed 4"):
        ReplayBuffer(url, 4, 8, fields=FIELDS, overwrite=False, storage_options=server.storage_options)
    assert ReplayBuffer.from_folder(url, storage_options=server.storage_options).num_episodes == 1


def test_circular_wrap_and_step_log_on_object_storage(server):
    url = new_location(server)
    buffer = ReplayBuffer(
        url, 2, 6, fields=FIELDS, circular=True, storage_options=server.storage_options, flush_every_store_step=2
    )
    for seed in range(3):
        buffer.store_episode(**episode(3 + seed, seed))
    assert buffer.episode_lens.tolist() == [5, 4]
    with buffer.one_episode():
        for t in range(4):
            buffer.store(reward=float(t))
        assert len(buffer.storage.read_log("episode")) > 0, "flushed steps are durable in the store"
    assert buffer.storage.log_names() == []
    assert buffer.episode_lens.tolist() == [5, 4] and buffer.data["reward"][1, :4].tolist() == [0, 1, 2, 3]


def test_server_outage_mid_write_then_recovery(s3_server, s3_outage):
    url = new_location(s3_server)
    backoff = {"init_backoff": timedelta(seconds=0.05), "max_backoff": timedelta(seconds=0.1), "base": 2}
    options = dict(
        s3_server.storage_options,
        retry_config={"max_retries": 1, "retry_timeout": timedelta(seconds=2), "backoff": backoff},
    )
    buffer = ReplayBuffer(url, 4, 8, fields=FIELDS, storage_options=options, flush_every_store_step=0)
    kept = episode(5, 7)
    buffer.store_episode(**kept)
    s3_outage.stop()
    try:
        with pytest.raises(StorageError) as info:
            buffer.store_episode(**episode(4, 8))
        assert url in str(info.value) and "slots [1]" in str(info.value)
    finally:
        s3_outage.restart()
    again = ReplayBuffer.from_folder(url, storage_options=s3_server.storage_options)
    assert again.num_episodes == 1
    np.testing.assert_array_equal(again.data["frame"][0, :5], kept["frame"])
    again.store_episode(**episode(2, 9))
    assert again.episode_lens[:2].tolist() == [5, 2]


def test_lengths_zeroed_on_an_object_store_are_refused_and_restored(server):
    """A lengths chunk overwritten with zeros (a bad upload, a restore gone wrong) hid every
    episode; every open refuses it naming the chunk, and verify --repair restores the lengths
    from the slots' meta checksums."""
    url = new_location(server)
    options = server.storage_options
    writer = ReplayBuffer(url, 4, 12, fields=FIELDS, storage_options=options)
    for length in (7, 5, 9):
        writer.store_episode(**episode(length, length))
    kv, key = writer.storage.kv, "meta/episode_lens/c.0"
    stored = kv.get(key)
    writer.close()
    kv.set(key, bytes(len(stored)))
    with pytest.raises(LostLengthError, match=r"committed slots \[0, 1, 2\] hold length 0"):
        ReplayBuffer(url, read_only=True, storage_options=options)
    assert verify(url, storage_options=options, repair=True)[-1].startswith(
        "repaired: restored the lengths of slots [0, 1, 2] to [7, 5, 9]"
    )
    reader = ReplayBuffer(url, read_only=True, storage_options=options)
    assert reader.episode_lens[:3].tolist() == [7, 5, 9]
    np.testing.assert_array_equal(reader.data["reward"][1, :5], np.arange(5))


def test_an_in_place_update_of_many_image_episodes_reads_their_generations_once(s3_server):
    """Format 7 binds each rewritten shard to its episode's generation, as stored: an update of
    16 episodes reads ``meta/_generation`` in one GET, not one per episode, and the rewritten
    shards read back."""
    url = new_location(s3_server)
    frame = {"frame": ("uint8", (32, 32, 4))}
    writer = ReplayBuffer(url, 16, 2, fields=frame, circular=True, storage_options=s3_server.storage_options)
    for i in range(16):
        writer.store_episode(frame=np.full((2, 32, 32, 4), i, np.uint8))
    values = np.arange(16, dtype=np.uint8)[:, None, None, None, None] + np.zeros((16, 2, 32, 32, 4), np.uint8) + 100
    with s3_server.record() as requests:
        writer.update(list(range(16)), frame=values)
    assert sum(method == "GET" and "meta/_generation" in path for method, path in requests.requests) == 1
    np.testing.assert_array_equal(writer.get_all_data()["frame"].numpy(), values)
    writer.close()
    assert verify(url, storage_options=s3_server.storage_options) == []
