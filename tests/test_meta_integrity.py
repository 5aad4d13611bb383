"""Reads never lie about per-episode values: a flipped byte in a meta value, a generation, the
counters object or an array document raises an error naming the file, or reads the right data
(``replaybuf/metasums.py``, ``Storage.load_state``, zarr's ``_check_document``)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import threading

import numpy as np
import pytest

from replaybuf import BufferDamagedError, CorruptChunkError, MetaChecksumError, ReplayBuffer, UnfinishedEditError
from replaybuf.maintenance import convert, verify
from replaybuf.metasums import META_SUM, Summed, buffer_word, entries
from replaybuf.storage import make_storage

from ._backends import LOCAL_BACKENDS, require

DATA = os.path.join(os.path.dirname(__file__), "data")
FIELDS = {"s": ("float", 3), "img": ("uint8", (4, 4, 3))}
META = {"reward_sum": "float", "goal": ("int", 2)}
LENGTHS = (5, 6, 7)


def build(path, backend: str, episodes: int = 3) -> str:
    """A buffer of ``episodes`` episodes (reward_sum i + 0.5, goal [i, -i]) in 4 slots."""
    path = str(path)
    rng = np.random.default_rng(0)
    with ReplayBuffer(path, 4, 8, fields=FIELDS, meta_fields=META, backend=backend) as buffer:
        for i in range(episodes):
            n = LENGTHS[i]
            buffer.store_episode(
                s=rng.normal(size=(n, 3)).astype(np.float32),
                img=rng.integers(0, 255, (n, 4, 4, 3), dtype=np.uint8),
                reward_sum=i + 0.5,
                goal=[i, -i],
            )
    return path


def read(path) -> dict[str, np.ndarray]:
    """Everything a read-only open returns of the committed episodes."""
    with ReplayBuffer.from_folder(path, read_only=True) as buffer:
        valid = np.asarray(buffer.valid_episodes())
        out = {f"all.{k}": np.asarray(v).copy() for k, v in buffer.get_all_data().items()}
        out.update({f"meta.{k}": np.asarray(v)[valid].copy() for k, v in buffer.meta_data.items()})
        out["lens"] = np.asarray(buffer.episode_lens)[valid].copy()
        return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and np.array_equal(a[k], b[k], equal_nan=True) for k in a
    )


def write_raw(path: str, name: str, slots, values) -> None:
    """Write meta array ``name`` of ``slots`` through the storage alone, as damage would: the
    checksums are left as they were."""
    storage = make_storage(path)
    storage.open(read_only=False)
    storage.write_meta(name, np.asarray(slots), np.asarray(values))
    storage.close()


def flip_file(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ bit]))


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize(
    "name, value, one_bit",
    [
        ("reward_sum", 1.5625, True),  # 1.5 with one bit flipped
        ("reward_sum", 100.0, False),
        ("goal", [1, -2], True),
        ("_generation", 3, True),
        ("_generation", 7, False),
        (META_SUM, 12345, False),
    ],
)
def test_a_damaged_meta_value_or_generation_is_an_error_naming_the_files(tmp_path, backend, name, value, one_bit):
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    write_raw(path, name, [1], [value])
    for read_only in (True, False):
        with pytest.raises(MetaChecksumError, match=r"slot 1: ") as caught:
            ReplayBuffer.from_folder(path, read_only=read_only)
        error = caught.value
        assert isinstance(error, CorruptChunkError) and isinstance(error, BufferDamagedError)
        assert error.slot == 1 and name in error.location
        if one_bit:  # the one value a flipped bit explains is named, with what its checksum matches
            assert error.field == f"meta/{name}" and META_SUM not in error.location and error.restore[0] == name
            assert "matches" in str(error) and "one flipped bit" in str(error)
        else:  # every file that may be damaged is named
            assert error.restore is None and META_SUM in error.location and "reward_sum" in error.location


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_a_flipped_bit_in_a_meta_file_is_an_error(tmp_path, backend):
    path = build(tmp_path / "b", backend)
    if backend == "zarr":
        target, offset = os.path.join(path, "meta", "reward_sum", "c.0"), 4 * 1 + 2
    else:
        target = os.path.join(path, "reward_sum.data.meta.npy")
        offset = os.path.getsize(target) - 4 * 4 + 4 * 1 + 2  # slot 1's float32, after the header
    flip_file(target, offset, 0x10)
    with pytest.raises(MetaChecksumError, match="reward_sum"):
        read(path)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_flipped_counters_are_refused_naming_the_file(tmp_path, backend):
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    state = os.path.join(path, "replaybuf", "state.json")
    with open(state, "rb") as f:
        raw = f.read()
    assert b'"num_episodes": 3' in raw
    for damaged in (raw.replace(b'"num_episodes": 3', b'"num_episodes": 2'), raw.replace(b'"crc32c"', b'"crc33c"')):
        with open(state, "wb") as f:
            f.write(damaged)
        for read_only in (True, False):
            with pytest.raises(BufferDamagedError, match=r"replaybuf/state.json"):
                ReplayBuffer.from_folder(path, read_only=read_only)
        assert any("state.json" in line for line in verify(path))
    os.unlink(state)  # what the message offers: the counters are counted again
    with ReplayBuffer.from_folder(path) as buffer:
        assert buffer.num_episodes == 3 and buffer.episode_index == 3
    assert verify(path) == []


@pytest.mark.parametrize(
    "old, new",
    [
        (b'"separator": "."', b'"separator": "/"'),
        (b'"fill_value": 0.0', b'"fill_value": 1.0'),
        (b'"endian": "little"', b'"endian": "big"'),
        (b'"name": "regular"', b'"name": "rectilinear"'),
    ],
)
def test_a_damaged_zarr_array_document_is_refused_naming_it(tmp_path, old, new):
    path = build(tmp_path / "b", "zarr")
    document = os.path.join(path, "meta", "reward_sum", "zarr.json")
    with open(document, "rb") as f:
        raw = f.read()
    assert old in raw
    with open(document, "wb") as f:
        f.write(raw.replace(old, new))
    with pytest.raises(BufferDamagedError, match=r"meta/reward_sum/zarr.json"):
        ReplayBuffer.from_folder(path, read_only=True)


def test_a_missing_meta_chunk_of_committed_episodes_is_an_error(tmp_path):
    """(memmap and hdf5 keep each meta array in one file the config requires)"""
    path = build(tmp_path / "b", "zarr")
    os.unlink(os.path.join(path, "meta", "reward_sum", "c.0"))
    with pytest.raises(MetaChecksumError, match="reward_sum"):
        read(path)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_meta_edits_keep_their_checksums(tmp_path, backend):
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    with ReplayBuffer.from_folder(path) as buffer:
        buffer.update([0, 2], reward_sum=[7.0, 8.0])
        buffer.store_meta_datapoint(1, "goal", [5, 6])
        buffer.store_batch_meta_datapoint([0, 1], "reward_sum", [9.0, 10.0])
    got = read(path)
    assert got["meta.reward_sum"].tolist() == [9.0, 10.0, 8.0]
    assert got["meta.goal"].tolist() == [[0, 0], [5, 6], [2, -2]]
    assert verify(path) == []
    write_raw(path, "reward_sum", [2], [8.5])  # damage after the edits is still told
    with pytest.raises(MetaChecksumError, match="slot 2"):
        read(path)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_meta_edit_killed_midway_is_refused_whole_until_the_next_writer_seals_it(tmp_path, backend):
    """A writer killed inside a meta edit of an earlier release (no edit log): a reader's
    meta values show it as stored, its whole-buffer reads refuse the slot as unfinished; the
    next writable open seals it as stored."""
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    # a writer killed inside the edit: the revision odd, the value written, its checksum not
    write_raw(path, "_revision", [1], [1])
    write_raw(path, "reward_sum", [1], [4.0])
    with ReplayBuffer.from_folder(path, read_only=True) as reader:
        assert np.asarray(reader.meta_data["reward_sum"])[reader.valid_episodes()].tolist() == [0.5, 4.0, 2.5]
        assert reader.unfinished_edit_slots().tolist() == [1]
        with pytest.raises(UnfinishedEditError, match=r"slots \[1\] hold an in-place edit"):
            reader.get_all_data()
    with ReplayBuffer.from_folder(path) as buffer:  # closes the edit: the checksum is recomputed
        assert buffer._meta["_revision"][1] % 2 == 0 and buffer._meta["_revision"][1] > 1
    assert read(path)["meta.reward_sum"].tolist() == [0.5, 4.0, 2.5]
    assert verify(path) == []


def test_a_reader_racing_meta_edits_never_raises(tmp_path):
    path = build(tmp_path / "b", "memmap")
    done = threading.Event()
    errors: list[BaseException] = []

    def edit() -> None:
        try:
            with ReplayBuffer.from_folder(path) as writer:
                for i in range(400):
                    writer.update([0, 1, 2], reward_sum=[i, i + 1, i + 2], goal=[[i, i]] * 3)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=edit)
    with ReplayBuffer.from_folder(path, read_only=True) as reader:
        thread.start()
        refreshes = 0
        while not done.is_set():
            reader.refresh()
            refreshes += 1
        thread.join()
        reader.refresh()
        assert reader.meta_data["reward_sum"][:3].tolist() == [399, 400, 401]
    assert not errors and refreshes > 0


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_verify_reports_damaged_meta_values_and_repair_restores_one_flipped_bit_or_drops(tmp_path, backend):
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    before = read(path)
    write_raw(path, "_generation", [0], [1 | 1 << 40])  # slot 0 would read as the newest episode
    write_raw(path, "reward_sum", [1], [100.0])  # more than one bit: which value is wrong is unknown
    problems = verify(path)
    assert len(problems) == 2 and "meta/_generation: slot 0: holds 1099511627777" in problems[0]
    assert "meta: slot 1" in problems[1] and "reward_sum" in problems[1]
    repaired = verify(path, repair=True)
    assert any("restored meta/_generation of slot 0 to 1" in line for line in repaired)
    assert any("dropped the damaged episodes in slots [1]" in line for line in repaired)
    assert verify(path) == []
    got = read(path)
    assert got["meta.reward_sum"].tolist() == [0.5, 2.5] and got["lens"].tolist() == [5, 7]
    assert np.array_equal(got["all.s"][0], before["all.s"][0])
    with ReplayBuffer.from_folder(path) as buffer:  # the counters never counted the damaged generation
        assert (buffer.episode_index, buffer._state["total_episodes"]) == (3, 3)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_generation_s_flipped_sign_bit_is_reported_and_restored_by_repair(tmp_path, backend):
    """Before: a flipped sign bit in slot 1's generation (which then reads negative) made
    ``verify`` and ``verify --repair`` crash with an OverflowError (their diagnosis tried the
    flips as uint64 and only 63 bits of them), and the repair's writable open refused the
    negative generation its own report said the repair restores."""
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    before = read(path)
    write_raw(path, "_generation", [1], [2 - (1 << 63)])  # generation 2, its sign bit flipped
    with pytest.raises(BufferDamagedError, match="meta/_generation"):
        read(path)
    problems = verify(path)
    assert "meta/_generation: slot 1: holds -9223372036854775806" in problems[0] and "matches 2" in problems[0]
    assert "repaired: restored meta/_generation of slot 1 to 2, which its checksum matches" in verify(path, repair=True)
    assert verify(path) == []
    assert same(read(path), before)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_convert_refuses_damaged_meta_and_seals_what_it_copies(tmp_path, backend):
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    convert(path, str(tmp_path / "copy"), backend="zarr")
    assert same(read(str(tmp_path / "copy")), read(path))
    write_raw(str(tmp_path / "copy"), "goal", [0], [[0, 1]])
    with pytest.raises(BufferDamagedError, match="slot 0"):
        convert(str(tmp_path / "copy"), str(tmp_path / "again"), backend=backend)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_lost_checksum_entry_is_an_error_and_repair_writes_it_again(tmp_path, backend):
    """An entry of 0 (a missing chunk of meta/_meta_sum reads so) is never "not kept" in
    format 4: the slot's values cannot be checked, so a read refuses it; --repair writes the
    entry again for the values as stored, dropping nothing."""
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    before = read(path)
    if backend == "zarr":
        os.unlink(os.path.join(path, "meta", META_SUM, "c.0"))  # every slot's entry
    else:
        write_raw(path, META_SUM, [0, 1, 2], [0, 0, 0])
    with pytest.raises(MetaChecksumError, match=r"meta/_meta_sum: slot 0: its checksum entry is 0 \(lost") as caught:
        read(path)
    assert caught.value.field == f"meta/{META_SUM}" and caught.value.restore[0] == META_SUM
    problems = verify(path, repair=True)
    assert [line.split(":")[0] for line in problems[:3]] == [f"meta/{META_SUM}"] * 3
    assert not any("dropped" in line for line in problems)
    assert verify(path) == [] and same(read(path), before)
    write_raw(path, "reward_sum", [2], [9.0])  # checked again
    with pytest.raises(MetaChecksumError, match="slot 2"):
        read(path)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_counters_without_their_crc_are_refused_in_format_4(tmp_path, backend):
    if backend == "hdf5":
        require("h5py")
    path = build(tmp_path / "b", backend)
    state = os.path.join(path, "replaybuf", "state.json")
    with open(state) as f:
        counters = json.load(f)
    del counters["crc32c"]
    with open(state, "w") as f:
        json.dump(counters, f)
    with pytest.raises(BufferDamagedError, match=r"state.json.*: the counters hold no crc32c"):
        read(path)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_flipped_bit_anywhere_is_an_error_or_reads_the_same(tmp_path, backend):
    """A bit flipped at sampled offsets of every file of a small buffer: the read raises or
    returns what was committed, never something else."""
    if backend == "hdf5":
        require("h5py")
    base = build(tmp_path / "base", backend, episodes=2)
    reference = read(base)
    files = sorted(f for f in glob.glob(os.path.join(base, "**"), recursive=True) if os.path.isfile(f))
    rng = np.random.default_rng(1)
    silent = []
    for file in files:
        relative = os.path.relpath(file, base)
        size = os.path.getsize(file)
        picks = np.unique(rng.integers(0, size, 6)) if size else []
        if relative.endswith("zarr.json") or relative.endswith(".json"):
            picks = np.unique(np.r_[picks, rng.integers(0, size, 6)])  # documents: more places
        for offset in picks:
            trial = str(tmp_path / "trial")
            shutil.rmtree(trial, ignore_errors=True)
            shutil.copytree(base, trial)
            flip_file(os.path.join(trial, relative), int(offset), 1 << int(rng.integers(0, 8)))
            try:
                got = read(trial)
            except Exception:
                continue
            if not same(got, reference):
                silent.append((relative, int(offset)))
    assert not silent, f"read back changed without an error: {silent}"


def test_the_meta_checksum_array_is_hidden_and_reserved(tmp_path):
    path = build(tmp_path / "b", "memmap")
    with ReplayBuffer.from_folder(path, read_only=True) as buffer:
        assert META_SUM not in buffer.meta_data and META_SUM not in buffer.meta_fieldnames
    with pytest.raises(ValueError, match=META_SUM):
        ReplayBuffer(str(tmp_path / "c"), 2, 3, fields={"x": "float"}, meta_fields={META_SUM: "int"})
    assert json.loads(open(os.path.join(path, "replaybuf", "state.json")).read())["crc32c"] > 0


@pytest.mark.parametrize("buffer", [0, buffer_word("d363077d46ac48cbb72bde037c3f1d31")])
def test_entries_of_a_few_slots_and_of_many_agree(buffer):
    """A commit's few slots are hashed with Python ints, a refresh's many with numpy: the same
    entries, whatever the values' byte order, bound to a buffer (zarr format 6) or not."""
    from replaybuf.schema import parse_field

    fields = {
        "a": parse_field("a", "float"),
        "b": parse_field("b", ("int", 3)),
        "c": parse_field("c", "bool"),
        "d": parse_field("d", ("uint8", 11)),
    }
    rng = np.random.default_rng(0)
    values = {
        "a": rng.normal(size=40).astype(np.float32),
        "b": rng.integers(-5, 5, (40, 3)).astype(np.int32),
        "c": rng.random(40) > 0.5,
        "d": rng.integers(0, 255, (40, 11)).astype(np.uint8),
    }
    slots, generations = rng.permutation(40), rng.integers(0, 1 << 62, 40)
    summed = Summed(fields, buffer)
    many = entries(slots, generations, values, summed)
    few = [
        entries(slots[i : i + 4], generations[i : i + 4], {k: v[i : i + 4] for k, v in values.items()}, summed)
        for i in range(0, 40, 4)
    ]
    swapped = {k: v[:3].astype(v.dtype.newbyteorder(">")) for k, v in values.items()}
    assert (np.concatenate(few) == many).all() and (
        entries(slots[:3], generations[:3], swapped, summed) == many[:3]
    ).all()
    assert len(np.unique(many)) == 40 and ((many >> np.uint64(63)) & (many & np.uint64(1)) == 1).all()


@pytest.mark.parametrize("name, value", [("reward_sum", 100.0), ("_generation", 9), (META_SUM, 12345)])
def test_a_reader_hashes_only_changed_slots_and_still_sees_damage_after_it_opened(tmp_path, name, value):
    path = build(tmp_path / "b", "memmap")
    with ReplayBuffer.from_folder(path, read_only=True) as reader:
        assert len(reader._unverified(reader._meta, np.ones(4, bool))) == 1  # slot 3: never committed
        write_raw(path, name, [2], [value])
        with pytest.raises(MetaChecksumError, match="slot 2"):
            reader.refresh()


def build_state_only(path, tasks) -> str:
    """A zarr buffer of state fields only (no shard, so no data document holds its uuid), one
    episode of 4 steps per value of ``tasks`` (the same steps in every buffer built so)."""
    path = str(path)
    with ReplayBuffer(path, 4, 8, fields={"s": ("float", 3)}, meta_fields={"task": "int"}) as buffer:
        for task in tasks:
            buffer.store_episode(s=np.full((4, 3), 0.5, np.float32), task=task)
    return path


def files_of(path) -> dict[str, bytes]:
    return {
        name: open(name, "rb").read()
        for name in glob.glob(os.path.join(path, "**"), recursive=True)
        if os.path.isfile(name)
    }


def test_zarr_meta_chunks_of_another_buffer_fail_their_checksums_and_repair_drops_them(tmp_path):
    """B holds episodes of A's lengths and steps, with other task values, and B's meta chunk
    files (values, generations, lengths and their checksums, all whole and agreeing) are copied
    over A's. Before format 6 bound each entry to its buffer, A read B's task values silently.
    Now every slot fails its entry, none is "restored" to fit (no flipped bit explains it), and
    ``verify --repair`` drops the slots rather than keeping B's values."""
    a = build_state_only(tmp_path / "a", [1, 2, 3])
    b = build_state_only(tmp_path / "b", [7, 8, 9])
    for chunk in glob.glob(os.path.join(b, "meta", "*", "c.*")):
        shutil.copyfile(chunk, os.path.join(a, os.path.relpath(chunk, b)))
    with pytest.raises(MetaChecksumError, match=r"meta: slot 0: .*damaged or was copied in from another buffer") as e:
        read(a)
    assert e.value.restore is None and all(f"meta/{name} in {a}" in str(e.value) for name in ("task", META_SUM))
    problems = verify(a)
    assert len(problems) == 3 and all("copied in from another buffer" in line for line in problems)
    assert verify(a, repair=True)[-1] == "repaired: dropped the damaged episodes in slots [0, 1, 2]; 0 episodes remain"
    assert read(a)["lens"].tolist() == [] and verify(a) == []


@pytest.mark.parametrize("document", ["zarr.json", f"meta/{META_SUM}/zarr.json"])
def test_a_flipped_uuid_in_a_state_only_zarr_buffer_is_refused_by_name_and_repair_writes_nothing(tmp_path, document):
    """Each meta checksum entry is bound to the config's uuid (format 6): one flipped character
    of it, in a buffer with no sharded array to keep a second copy, would fail every slot's
    entry, and ``verify --repair`` would drop every episode. ``meta/_meta_sum``'s document keeps
    the second copy: the open refuses the disagreement, naming both documents."""
    path = build_state_only(tmp_path / "b", [1, 2, 3])
    target = os.path.join(path, document)
    with open(target) as f:
        text = f.read()
    uuid = json.loads(text)["attributes"]["uuid" if document == "zarr.json" else "bound_to"]
    flipped = uuid[:5] + ("0" if uuid[5] != "0" else "1") + uuid[6:]
    with open(target, "w") as f:
        f.write(text.replace(uuid, flipped))
    files = files_of(path)
    disagree = (
        rf"meta/{META_SUM}/zarr\.json in .*: the checksum entries of its slots' meta values are bound to the buffer "
        r"uuid .*, but the config in .*zarr\.json .* holds .*: the slots' meta values \(meta/\) are another buffer's"
    )
    for read_only in (True, False):
        with pytest.raises(BufferDamagedError, match=disagree):
            ReplayBuffer.from_folder(path, read_only=read_only)
    problems = verify(path, repair=True)
    assert len(problems) == 1 and re.search(disagree, problems[0]) and "verify --repair` changes nothing" in problems[0]
    assert files_of(path) == files


def test_convert_binds_the_copy_s_meta_checksums_to_its_own_uuid(tmp_path):
    """A copy is a buffer of its own (a new uuid): its entries are computed for it, so it reads
    and verifies, and the source's meta checksums copied over the copy's fail there."""
    source = build_state_only(tmp_path / "a", [1, 2, 3])
    copy = str(tmp_path / "copy")
    convert(source, copy, backend="zarr")
    assert same(read(copy), read(source)) and verify(copy) == []
    sums = os.path.join("meta", META_SUM, "c.0")
    shutil.copyfile(os.path.join(source, sums), os.path.join(copy, sums))
    with pytest.raises(MetaChecksumError, match="slot 0"):
        read(copy)
