"""Codec by measurement (zarr): an image field whose spec names no compressor is measured at its
first write and stored raw when its codec gains under MIN_COMPRESSION_RATIO (camera noise)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from replaybuf import ReplayBuffer
from replaybuf.maintenance import verify
from replaybuf.storage import BufferDamagedError
from replaybuf.storage._zarr import MEASURED_CODECS

STEPS = 12
FRAME = (32, 32, 4)  # 4096 bytes a step: an image field (sharded, blosc-lz4 by default)


def _episode(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ramp = np.arange(FRAME[1], dtype=np.uint8)[None, None, :, None]
    return dict(
        noise=rng.integers(0, 256, (STEPS, *FRAME), dtype=np.uint8),  # camera noise: ~1.0x
        smooth=np.broadcast_to(ramp + np.arange(STEPS, dtype=np.uint8)[:, None, None, None], (STEPS, *FRAME)).copy(),
        state=rng.standard_normal((STEPS, 3)).astype(np.float32),
    )


FIELDS = dict(noise=("uint8", FRAME), smooth=("uint8", FRAME), state=("float", 3))


def _attributes(path) -> dict:
    return json.loads((path / "zarr.json").read_text())["attributes"]


def _stack(document: dict) -> list[str]:
    """Codec names inside an array document's shard (or of the array when not sharded)."""
    codecs = document["codecs"]
    if codecs[0]["name"] == "sharding_indexed":
        codecs = codecs[0]["configuration"]["codecs"]
    return [c["name"] for c in codecs]


def test_noise_is_stored_raw_smooth_frames_compressed_and_the_choice_survives_reopen(tmp_path):
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 3, STEPS, FIELDS)
    assert _attributes(path)[MEASURED_CODECS] == {"noise": None, "smooth": None}  # small fields are not measured
    reader = ReplayBuffer.from_folder(str(path), read_only=True)  # opened before the choice
    first, second = _episode(0), _episode(1)
    buffer.store_episode(**first)
    buffer.store_episode(**second)
    buffer.close()

    measured = _attributes(path)[MEASURED_CODECS]
    assert measured["noise"]["compressor"] == "none" and measured["noise"]["ratio"] < 1.2
    assert measured["smooth"]["compressor"] == "blosc-lz4:9" and measured["smooth"]["ratio"] > 5
    root = json.loads((path / "zarr.json").read_text())
    for name, stack in [("noise", ["bytes", "crc32c"]), ("smooth", ["bytes", "blosc", "crc32c"])]:
        assert _stack(json.loads((path / "data" / name / "zarr.json").read_text())) == stack
        assert _stack(root["consolidated_metadata"]["metadata"][f"data/{name}"]) == stack  # xarray's copy
    assert (path / "data" / "noise" / "c.0.0.0.0.0").stat().st_size > STEPS * 4096  # raw, plus index and crc32c

    reader.refresh()  # takes the writer's choice: decodes the raw chunks
    for opened in (
        reader,
        ReplayBuffer.from_folder(str(path), read_only=True),
        ReplayBuffer(str(path), 3, STEPS, FIELDS, overwrite=False),
    ):
        assert opened.storage.array("noise").codec.label == "none"
        assert opened.storage.array("smooth").codec.label == "blosc-lz4:9"
        data = opened.get_all_data()
        for slot, episode in enumerate((first, second)):
            for name in FIELDS:
                np.testing.assert_array_equal(np.asarray(data[name][slot]), episode[name], err_msg=name)
        opened.close()
    group = zarr.open_group(str(path), mode="r", use_consolidated=True)  # any zarr reader decodes both
    np.testing.assert_array_equal(group["data/noise"][1], second["noise"])
    np.testing.assert_array_equal(group["data/smooth"][1], second["smooth"])


def test_a_named_compressor_forces_either_way(tmp_path):
    path = tmp_path / "b"
    fields = dict(
        noise={"dtype": "uint8", "shape": FRAME, "compressor": "blosc-lz4:9"},
        smooth={"dtype": "uint8", "shape": FRAME, "compressor": "none"},
        state=("float", 3),
    )
    buffer = ReplayBuffer(str(path), 2, STEPS, fields)
    buffer.store_episode(**_episode(0))
    assert MEASURED_CODECS not in _attributes(path)
    assert buffer.storage.array("noise").codec.label == "blosc-lz4:9"
    assert buffer.storage.array("smooth").codec.label == "none"
    buffer.close()


def test_all_zero_first_rows_keep_the_codec(tmp_path):
    """Padding says nothing of the data: the measurement samples frames that are not all zero,
    and keeps the codec when there are none."""
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 2, STEPS, FIELDS)
    episode = _episode(0)
    episode["noise"][:] = 0
    buffer.store_episode(**episode)
    assert _attributes(path)[MEASURED_CODECS]["noise"] == {"compressor": "blosc-lz4:9", "ratio": None}
    buffer.store_episode(**_episode(1))  # decided once: stays compressed
    np.testing.assert_array_equal(np.asarray(buffer.data["noise"][1]), _episode(1)["noise"])
    buffer.close()


def test_buffers_made_before_measuring_keep_their_codecs(tmp_path):
    """No MEASURED_CODECS in the root attributes (buffers of earlier releases): nothing is
    measured, so chunks already written with the codec stay readable."""
    path = tmp_path / "b"
    ReplayBuffer(str(path), 2, STEPS, FIELDS).close()
    document = json.loads((path / "zarr.json").read_text())
    del document["attributes"][MEASURED_CODECS]
    (path / "zarr.json").write_text(json.dumps(document))
    buffer = ReplayBuffer.from_folder(str(path))
    buffer.store_episode(**_episode(0))
    assert buffer.storage.array("noise").codec.label == "blosc-lz4:9" and MEASURED_CODECS not in _attributes(path)
    buffer.close()


@pytest.mark.parametrize("value", [["noise"], {"nofield": None}, {"noise": "none"}])
def test_a_damaged_choice_record_is_refused_by_name(tmp_path, value):
    path = tmp_path / "b"
    ReplayBuffer(str(path), 2, STEPS, FIELDS).close()
    document = json.loads((path / "zarr.json").read_text())
    document["attributes"][MEASURED_CODECS] = value
    (path / "zarr.json").write_text(json.dumps(document))
    with pytest.raises(BufferDamagedError, match=f"zarr.json in .*: {MEASURED_CODECS} must map data field names"):
        ReplayBuffer.from_folder(str(path), read_only=True)


def test_short_episodes_store_only_their_own_frames_and_are_measured_on_them(tmp_path):
    """Episodes far shorter than max_timesteps: a shard holds only the episode's frames (the
    padding is left out, hot and compacted), the codec is measured on the episode's frames (not
    its zero padding), and a reused slot reads its old episode's steps as zeros."""
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 2, 40 * STEPS, FIELDS, circular=True)
    long = {name: np.concatenate([values] * 3) for name, values in _episode(0).items()}
    short = [_episode(1), _episode(2)]

    def frame_bytes() -> int:
        return sum(f.stat().st_size for f in (path / "data" / "noise").glob("c*"))

    buffer.store_episode(**long)  # slot 0: 36 steps
    buffer.store_episode(**short[0])  # slot 1: 12 steps
    one_frame = int(np.prod(FRAME))
    index = 2 * (40 * STEPS * 16 + 4)  # each shard's index: 16 bytes per step, stored or not
    assert frame_bytes() < (36 + 12) * one_frame * 1.05 + index  # hot: raw frames, no padding
    assert _attributes(path)[MEASURED_CODECS]["noise"]["compressor"] == "none"  # noise, not zeros
    buffer.store_episode(**short[1])  # slot 0 reused by a shorter episode
    buffer.compact()
    assert frame_bytes() < 2 * STEPS * one_frame * 1.05 + index
    data = buffer.get_all_data()
    for slot, episode in enumerate([short[1], short[0]]):
        for name, values in episode.items():
            stored = np.asarray(data[name][slot])
            assert np.array_equal(stored[:STEPS], values) and not stored[STEPS:].any(), (slot, name)
    buffer.close()
    assert verify(str(path)) == []


@pytest.mark.parametrize("noise_first", [True, False])
def test_two_objects_sharing_the_lease_measure_a_field_once(tmp_path, noise_first):
    """Two writable objects of one process take turns: the second to write a field keeps the
    first's choice rather than measuring its own rows, which would leave chunks of both codecs
    under one array's metadata (every episode of the other codec unreadable)."""
    path = tmp_path / "b"
    first = ReplayBuffer(str(path), 3, STEPS, FIELDS)
    second = ReplayBuffer.from_folder(str(path))
    noisy, smooth = _episode(0), _episode(1)
    smooth["noise"] = smooth["smooth"]  # frames that compress well, in the field measured
    episodes = [noisy, smooth] if noise_first else [smooth, noisy]
    first.store_episode(**episodes[0])
    second.store_episode(**episodes[1])
    chosen = "none" if noise_first else "blosc-lz4:9"
    assert _attributes(path)[MEASURED_CODECS]["noise"]["compressor"] == chosen
    assert second.storage.array("noise").codec.label == chosen
    second.close()
    first.close()
    data = ReplayBuffer.from_folder(str(path), read_only=True).get_all_data()
    group = zarr.open_group(str(path), mode="r", use_consolidated=True)
    for slot, episode in enumerate(episodes):
        np.testing.assert_array_equal(np.asarray(data["noise"][slot]), episode["noise"])
        np.testing.assert_array_equal(group["data/noise"][slot], episode["noise"])


@pytest.mark.parametrize("read_only", [True, False])
def test_an_object_opened_before_the_choice_reads_raw_rows(tmp_path, read_only):
    """``data[...]`` reads the store as it is now, refreshed or not, and so does every read of a
    second writable object that never wrote: an object opened on the empty buffer takes the codec
    chosen since rather than report the raw chunks as damage."""
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 2, STEPS, FIELDS)
    other = ReplayBuffer.from_folder(str(path), read_only=read_only)
    episode = _episode(0)
    buffer.store_episode(**episode)
    np.testing.assert_array_equal(np.asarray(other.data["noise"][0]), episode["noise"])
    assert other.storage.array("noise").codec.label == "none"
    np.testing.assert_array_equal(np.asarray(other.refresh().get_all_data()["noise"][0]), episode["noise"])
    other.close()
    buffer.close()


def test_a_measurement_killed_before_the_root_document_is_made_again_by_the_default_codec(tmp_path):
    """A kill between the array's metadata (raw) and the root attributes leaves the field
    unmeasured: the next writer measures its frames by blosc-lz4 again, not by the raw stack the
    kill left, so frames that compress are stored compressed and the record is a true ratio."""
    path = tmp_path / "b"
    ReplayBuffer(str(path), 2, STEPS, FIELDS).close()
    array_document = path / "data" / "smooth" / "zarr.json"
    document = json.loads(array_document.read_text())
    inner = document["codecs"][0]["configuration"]
    inner["codecs"] = [c for c in inner["codecs"] if c["name"] != "blosc"]  # as the killed writer left it
    array_document.write_text(json.dumps(document))
    buffer = ReplayBuffer.from_folder(str(path))
    episode = _episode(0)
    buffer.store_episode(**episode)
    buffer.close()
    measured = _attributes(path)[MEASURED_CODECS]["smooth"]
    assert measured["compressor"] == "blosc-lz4:9" and measured["ratio"] > 5
    root = json.loads((path / "zarr.json").read_text())
    assert _stack(json.loads(array_document.read_text())) == ["bytes", "blosc", "crc32c"]
    assert _stack(root["consolidated_metadata"]["metadata"]["data/smooth"]) == ["bytes", "blosc", "crc32c"]
    group = zarr.open_group(str(path), mode="r", use_consolidated=True)
    np.testing.assert_array_equal(group["data/smooth"][0], episode["smooth"])
    stored = ReplayBuffer.from_folder(str(path), read_only=True).get_all_data()["smooth"][0]
    np.testing.assert_array_equal(np.asarray(stored), episode["smooth"])


def test_a_field_whose_chunks_exist_keeps_their_codec_when_its_record_is_lost(tmp_path):
    """A choice record reading null beside chunks already written (a damaged or hand-edited root
    document) is not measured again: the chunks keep the codec they were written by."""
    path = tmp_path / "b"
    buffer = ReplayBuffer(str(path), 3, STEPS, FIELDS)
    noisy = _episode(0)
    buffer.store_episode(**noisy)  # noise: stored raw
    buffer.close()
    document = json.loads((path / "zarr.json").read_text())
    document["attributes"][MEASURED_CODECS]["noise"] = None
    (path / "zarr.json").write_text(json.dumps(document))
    buffer = ReplayBuffer.from_folder(str(path))
    smooth = _episode(1)
    smooth["noise"] = smooth["smooth"]  # frames that would be measured compressed
    buffer.store_episode(**smooth)
    buffer.close()
    assert _attributes(path)[MEASURED_CODECS]["noise"] == {"compressor": "none", "ratio": None}
    data = ReplayBuffer.from_folder(str(path), read_only=True).get_all_data()
    for slot, episode in enumerate((noisy, smooth)):
        np.testing.assert_array_equal(np.asarray(data["noise"][slot]), episode["noise"])
