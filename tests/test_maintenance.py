"""convert / info / verify, in Python and as ``replaybuf`` subcommands."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from replaybuf import CorruptChunkError, ReplayBuffer
from replaybuf.cli import main
from replaybuf.maintenance import CLI_COMMANDS, convert, format_info, info, verify

from ._backends import BACKENDS, make_place, snapshot
from ._data import FIELDS, META_FIELDS, SEED_FIELDS, episode, seed_buffer


def filled(location, backend="zarr", lengths=(5, 7, 3, 6, 4), max_episodes=4, circular=True, **kwargs):
    buffer = ReplayBuffer(
        location, max_episodes, 12, fields=FIELDS, meta_fields=META_FIELDS, circular=circular, backend=backend, **kwargs
    )
    for i, length in enumerate(lengths):
        buffer.store_episode(**episode(length, i), task_id=10 + i)
    buffer.close()
    return buffer


def assert_same_buffers(a: ReplayBuffer, b: ReplayBuffer) -> None:
    assert a.valid_episodes().tolist() == b.valid_episodes().tolist()
    np.testing.assert_array_equal(a.episode_lens, b.episode_lens)
    assert (a.num_episodes, a.episode_index) == (b.num_episodes, b.episode_index)
    for name in a.schema.fields:
        for slot in a.valid_episodes():
            length = a.episode_lens[slot]
            np.testing.assert_array_equal(a.data[name][int(slot), :length], b.data[name][int(slot), :length])
    for name in a.schema.meta_fields:
        np.testing.assert_array_equal(a.meta_data[name][:], b.meta_data[name][:])
    for name, tensor in a.get_all_data().items():
        np.testing.assert_array_equal(tensor.numpy(), b.get_all_data()[name].numpy())


@pytest.mark.parametrize("src_name", BACKENDS)
@pytest.mark.parametrize("dst_name", BACKENDS)
def test_convert_between_backends_keeps_everything(tmp_path, src_name, dst_name):
    src, dst = make_place(src_name, tmp_path / "src"), make_place(dst_name, tmp_path / "dst")
    filled(src.location, src.backend)
    summary = convert(src.location, dst.location, backend=dst.backend, progress=False)
    assert summary["episodes"] == 4 and summary["timesteps"] == 7 + 3 + 6 + 4 and summary["verified"]
    source = ReplayBuffer.from_folder(src.location, read_only=True)
    copy = ReplayBuffer.from_folder(dst.location, read_only=True)
    assert copy.storage.backend_name == dst.backend
    assert_same_buffers(source, copy)
    assert verify(dst.location) == []
    # the copy continues where the source stood
    writer = ReplayBuffer.from_folder(dst.location)
    writer.store_episode(**episode(2, 99), task_id=99)
    assert writer.valid_episodes()[-1] == source.episode_index


def test_seed_folder_converts_to_zarr_with_identical_data(tmp_path):
    folder = tmp_path / "seed"
    seed_buffer(folder)
    before = snapshot(str(folder))
    convert(folder, tmp_path / "zarr", progress=False)
    assert snapshot(str(folder)) == before
    copy = ReplayBuffer.from_folder(tmp_path / "zarr", read_only=True)
    assert copy.storage.backend_name == "zarr"
    lens = np.load(folder / "episode_lens.data.meta.npy")
    lens[1] = 2  # the seed's episode in progress, published at its step count
    np.testing.assert_array_equal(copy.episode_lens, lens)
    for name in SEED_FIELDS:
        stored = np.load(folder / f"{name}.data.npy")
        for slot, length in enumerate(lens):
            np.testing.assert_array_equal(copy.data[name][slot, :length], stored[slot, :length])
    np.testing.assert_array_equal(copy.meta_data["task_id"][:], np.load(folder / "task_id.data.meta.npy"))
    assert copy.valid_episodes().tolist() == [2, 3, 0, 1]
    assert_same_buffers(ReplayBuffer.from_folder(folder, read_only=True), copy)


def test_chunks_and_compressor_reach_the_destination(tmp_path):
    filled(tmp_path / "src", "memmap")
    convert(tmp_path / "src", tmp_path / "dst", chunks=["state=2", "reward=5"], compressor="zstd:5", progress=False)
    facts = info(tmp_path / "dst")
    assert facts["fields"]["data/state"]["chunks"] == [1, 2, 3, 4, 4]
    assert facts["fields"]["data/reward"]["chunks"] == [1, 5]
    assert {f["compressor"] for f in facts["fields"].values()} == {"zstd:5"}
    convert(
        tmp_path / "src",
        tmp_path / "h5",
        backend="hdf5",
        chunks={"state": 3},
        dst_storage_options={"compression": "gzip"},
        progress=False,
    )
    assert info(tmp_path / "h5")["fields"]["data/state"]["chunks"] == [1, 3, 3, 4, 4]
    assert info(tmp_path / "h5")["fields"]["data/state"]["compressor"].startswith("gzip")


@pytest.mark.parametrize(
    "kwargs, error, complaint",
    [
        ({"chunks": ["nope=3"]}, ValueError, "unknown data fields \\['nope'\\]"),
        ({"chunks": ["state"]}, ValueError, "field=TIMESTEPS"),
        ({"chunks": {"state": 0}}, ValueError, "positive number"),
        ({"compressor": "lz4"}, ValueError, "unknown compressor"),
        ({"compressor": "zstd:3", "backend": "hdf5"}, ValueError, "per-field compressors"),
        ({"backend": "parquet"}, ValueError, "unknown backend 'parquet'"),
    ],
)
def test_bad_convert_arguments_create_nothing(tmp_path, kwargs, error, complaint):
    filled(tmp_path / "src", "memmap")
    with pytest.raises(error, match=complaint):
        convert(tmp_path / "src", tmp_path / "dst", progress=False, **kwargs)
    assert not (tmp_path / "dst").exists()


def test_convert_refuses_an_existing_destination_unless_told(tmp_path):
    filled(tmp_path / "src")
    filled(tmp_path / "dst", lengths=(2,))
    before = snapshot(str(tmp_path / "dst"))
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(tmp_path / "src", tmp_path / "dst", progress=False)
    assert snapshot(str(tmp_path / "dst")) == before
    convert(tmp_path / "src", tmp_path / "dst", progress=False, overwrite=True)
    assert len(ReplayBuffer.from_folder(tmp_path / "dst", read_only=True)) == 4
    with pytest.raises(ValueError, match="same location"):
        convert(tmp_path / "src", tmp_path / "src", progress=False, overwrite=True)


@pytest.mark.parametrize("dst_name", ["memmap", "hdf5"])
def test_convert_carries_snapshots_and_refuses_a_damaged_one_before_writing(tmp_path, dst_name):
    writer = ReplayBuffer(tmp_path / "src", 6, 12, fields=FIELDS, meta_fields=META_FIELDS, circular=True)
    for i in range(3):
        writer.store_episode(**episode(4 + i, i), task_id=i)
    writer.snapshot("first-three")
    writer.store_episode(**episode(2, 9), task_id=9)
    writer.close()
    summary = convert(tmp_path / "src", tmp_path / "dst", backend=dst_name, progress=False)
    assert summary["snapshots"] == ["first-three"]
    source = ReplayBuffer.from_folder(tmp_path / "src", snapshot="first-three")
    copy = ReplayBuffer.from_folder(tmp_path / "dst", snapshot="first-three")
    assert copy.valid_episodes().tolist() == source.valid_episodes().tolist() == [0, 1, 2]
    for name in FIELDS:
        assert np.array_equal(copy.get_all_data()[name].numpy(), source.get_all_data()[name].numpy()), name
    held = tmp_path / "src" / "replaybuf" / "snapshots" / "first-three" / "snapshot.json"
    held.write_text(held.read_text().replace('"slots": [0', '"slots": [-7'))
    with pytest.raises(ValueError, match="snapshot.json"):
        convert(tmp_path / "src", tmp_path / "other", backend=dst_name, progress=False)
    assert not (tmp_path / "other").exists()


def test_convert_of_a_missing_buffer(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert(tmp_path / "nothing", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("name", BACKENDS)
def test_info_reports_schema_sizes_and_chunking(tmp_path, name):
    place = make_place(name, tmp_path)
    filled(place.location, place.backend)
    facts = info(place.location)
    assert facts["backend"] == place.backend
    assert (facts["episodes"], facts["timesteps"], facts["max_episodes"]) == (4, 20, 4)
    state = facts["fields"]["data/state"]
    assert state["dtype"] == "float32" and state["shape"] == [3, 4, 4]
    assert state["data_bytes"] == 20 * 3 * 4 * 4 * 4
    assert state["stored_bytes"] > 0 and facts["ratio"] > 0
    assert "meta/task_id" in facts["fields"]
    text = format_info(facts)
    assert "data/state" in text and f"{place.backend} (" in text and "ratio" in text


def test_verify_finds_problems_without_changing_anything(tmp_path):
    folder = tmp_path / "b"
    filled(folder, "memmap", circular=False, max_episodes=6, lengths=(5, 7, 3))
    assert verify(folder) == []
    lens = np.load(folder / "episode_lens.data.meta.npy", mmap_mode="r+")
    lens[4] = 2  # an episode published without counters or ordinal
    lens.flush()
    del lens
    state = np.load(folder / "state.data.npy", mmap_mode="r+")
    state[2, 9] = 1.5  # data beyond slot 2's length (3)
    state.flush()
    del state
    task_ids = np.load(folder / "task_id.data.meta.npy")
    os.unlink(folder / "task_id.data.meta.npy")
    before = snapshot(str(folder))
    problems = verify(folder)
    assert snapshot(str(folder)) == before
    text = "\n".join(problems)
    assert "missing" in text and "task_id" in text
    np.save(folder / "task_id.data.meta.npy", task_ids)  # zeros would fail their checksums
    text = "\n".join(verify(folder))
    assert "num_episodes is 3 but 4 slots" in text
    assert "data/state: slot 2 (length 3) holds data beyond its length at timesteps 9..9" in text
    assert "slots [4] have no ordinal" in text


def test_verify_beside_a_live_writer_takes_batched_counters_for_what_they_are(tmp_path, monkeypatch):
    monkeypatch.setattr("replaybuf.commit.COUNTERS_INTERVAL", 3600.0)  # the counters wait
    writer = ReplayBuffer(tmp_path / "b", 8, 12, fields=FIELDS, meta_fields=META_FIELDS)
    for i in range(5):
        writer.store_episode(**episode(3, i), task_id=i)
    stored = json.loads((tmp_path / "b" / "replaybuf" / "state.json").read_text())
    assert stored["num_episodes"] < 5  # published lengths ran ahead of the counters object
    assert verify(tmp_path / "b") == []
    writer.close()
    assert verify(tmp_path / "b") == []


def test_verify_reports_a_leftover_step_log_not_a_live_writers_episode_in_progress(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", 4, 8, fields={"x": "float"})
    buffer.store(x=1.0)
    buffer.flush()
    assert verify(tmp_path / "b") == []  # the writer collecting it holds the buffer: no problem
    buffer.close()  # its episode in progress stays in the step log, left for the next writer
    assert any("step log" in p for p in verify(tmp_path / "b"))
    assert verify(tmp_path / "nowhere")[0].startswith("cannot open")


def run_cli(argv) -> int:
    return main([str(a) for a in argv])


def test_cli_commands(tmp_path, capsys):
    assert [c[0] for c in CLI_COMMANDS] == ["convert", "upgrade", "info", "verify", "unlock"]
    filled(tmp_path / "src", "memmap")
    assert (
        run_cli(
            ["convert", tmp_path / "src", tmp_path / "dst", "--chunks", "state=3", "--compressor", "zstd:4", "--quiet"]
        )
        == 0
    )
    assert "copied 4 episodes" in capsys.readouterr().out
    assert run_cli(["info", tmp_path / "dst"]) == 0
    out = capsys.readouterr().out
    assert "1x3x3x4x4" in out and "zstd:4" in out
    assert run_cli(["info", "--json", tmp_path / "dst"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 4
    assert run_cli(["verify", tmp_path / "dst"]) == 0
    assert "consistent" in capsys.readouterr().out
    state = np.load(tmp_path / "src" / "state.data.npy", mmap_mode="r+")
    state[0, 11] = 3.0
    state.flush()
    del state
    assert run_cli(["verify", tmp_path / "src"]) == 1
    assert "beyond its length" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_verify_repair_resets_data_beyond_an_episodes_length(tmp_path, backend):
    folder = tmp_path / backend
    filled(folder, backend, circular=False, max_episodes=6, lengths=(5, 7, 3))
    before = ReplayBuffer.from_folder(folder, read_only=True).get_all_data()
    writer = ReplayBuffer.from_folder(folder)
    stray = np.full((1, 2, *writer.schema.fields["state"].shape), 1.5, np.float32)
    writer.storage.write_rows("state", np.array([2]), 8, stray)  # past slot 2's length (3), as a stray write
    writer.close()
    assert any("slot 2 (length 3) holds data beyond its length at timesteps 8..9" in p for p in verify(folder))
    said = verify(folder, repair=True)
    assert said[-1] == "repaired: set the steps beyond the lengths of slots [2] to their defaults"
    assert verify(folder) == []
    after = ReplayBuffer.from_folder(folder, read_only=True)
    for name, values in after.get_all_data().items():
        np.testing.assert_array_equal(values.numpy(), before[name].numpy(), err_msg=name)
    assert (np.asarray(after.data["state"][2, 3:]) == after.schema.fields["state"].fill).all()


def memmap_with_slot_1_damaged(tmp_path):
    """A memmap buffer of three episodes whose slot 1 no longer matches its checksum."""
    folder = tmp_path / "memmap"
    filled(folder, "memmap", circular=False, max_episodes=6, lengths=(5, 7, 3))
    state = np.load(folder / "state.data.npy", mmap_mode="r+")
    state[1, 0] += 1.0
    state.flush()
    del state
    return folder


def test_verify_repair_leaves_a_slot_a_writer_replaced_after_the_check(tmp_path, monkeypatch):
    folder = memmap_with_slot_1_damaged(tmp_path)
    assert any("slot 1" in p for p in verify(folder))
    opened = ReplayBuffer.from_folder.__func__

    def after_a_writer_replaced_slot_1(cls, *args, **kwargs):  # between verify's check and its repair
        with opened(cls, folder) as writer:
            writer.episode_index = 1
            writer.store_episode(**episode(4, 9), task_id=99)
        return opened(cls, *args, **kwargs)

    monkeypatch.setattr(ReplayBuffer, "from_folder", classmethod(after_a_writer_replaced_slot_1))
    said = verify(folder, repair=True)
    assert said[-1] == "not repaired: slots [1] changed since they were checked; run verify again"
    monkeypatch.undo()
    assert verify(folder) == []
    with ReplayBuffer.from_folder(folder, read_only=True) as after:
        assert after.valid_episodes().tolist() == [0, 2, 1] and int(after.meta_data["task_id"][1]) == 99


def test_verify_repair_says_nothing_of_slots_a_writer_filled_after_the_check(tmp_path, monkeypatch):
    """Before: episodes a writer committed between the check and the repair were reported as
    "not repaired: slots [3, 4] changed since they were checked", though nothing was found there."""
    folder = memmap_with_slot_1_damaged(tmp_path)
    opened = ReplayBuffer.from_folder.__func__

    def after_a_writer_committed_two_episodes(cls, *args, **kwargs):  # between the check and the repair
        with opened(cls, folder) as writer:
            for task_id in (98, 99):
                writer.store_episode(**episode(4, task_id), task_id=task_id)
        return opened(cls, *args, **kwargs)

    monkeypatch.setattr(ReplayBuffer, "from_folder", classmethod(after_a_writer_committed_two_episodes))
    said = verify(folder, repair=True)
    assert not any("not repaired" in line for line in said)
    assert said[-1].startswith("repaired: dropped the damaged episodes in slots [1]")
    monkeypatch.undo()
    assert verify(folder) == []


def test_a_converted_copy_is_a_buffer_of_its_own_whose_shards_its_source_refuses(tmp_path):
    """Before: the copy kept its source's uuid, so each read the other's frame shards as its own
    (the same slot and field). Now the copy has a uuid of its own, which its shards are bound to."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    fields = {"frame": ("uint8", (32, 32, 4))}
    with ReplayBuffer(src, 4, 6, fields=fields) as writer:
        for i in range(2):
            writer.store_episode(frame=np.full((3, 32, 32, 4), i + 1, np.uint8))
    convert(src, dst, progress=False)
    source, copy = (ReplayBuffer.from_folder(location, read_only=True) for location in (src, dst))
    assert copy.schema.uuid is not None and copy.schema.uuid != source.schema.uuid
    shard = os.path.join("data", "frame", "c.1.0.0.0.0")
    with open(os.path.join(dst, shard), "rb") as f, open(os.path.join(src, shard), "wb") as out:
        out.write(f.read())
    with pytest.raises(CorruptChunkError, match=r"data/frame: slot 1, .*holds slot 1's data of another buffer"):
        ReplayBuffer.from_folder(src, read_only=True).get_all_data()


def test_verify_accepts_an_episode_index_set_by_hand(tmp_path):
    """``episode_index = k`` (the seed's way to choose the next slot) is kept by the counters and
    by every writable open, so it is no damage: here it points back at the newest episode's slot."""
    with ReplayBuffer(tmp_path / "b", 3, 4, fields={"x": "float"}, circular=True) as buffer:
        buffer.store_episode(x=np.ones(2))
        buffer.episode_index = 0
    assert verify(tmp_path / "b") == []
    with ReplayBuffer(tmp_path / "b", 3, 4, fields={"x": "float"}, circular=True, overwrite=False) as buffer:
        assert buffer.episode_index == 0
