"""Buffers written by earlier releases still open: read as they were, and writable (after a copy)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import memmap_replay_buffer
import numpy as np
import pytest
import torch

from replaybuf import (
    BufferDamagedError,
    ChecksumEntryError,
    CorruptChunkError,
    ForeignEntriesError,
    MetaChecksumError,
    ReplayBuffer,
    UnfinishedEditError,
    metasums,
    verify,
)
from replaybuf.cli import main as cli_main
from replaybuf.maintenance import upgrade
from replaybuf.metasums import META_SUM, Summed, buffer_word
from replaybuf.storage import make_storage
from replaybuf.storage._shards import ShardBinding
from replaybuf.storage.lease import BufferLockedError

from .data.make_fixtures import expected_episode

DATA = os.path.join(os.path.dirname(__file__), "data")
FORMATS = [
    (version, backend)
    for version in ("format-v1", "format-v2", "format-v3", "format-v4", "format-v5")
    for backend in ("zarr", "memmap", "hdf5")
] + [
    ("format-v6", "zarr"),  # format 6 binds zarr shards to their buffer: memmap and hdf5 stay format 5
    ("format-v7", "zarr"),  # format 7 binds zarr shards to their episode's generation too
]
# buffers of main's first commits of a format, which already wrote its version but not yet its
# layout: zarr format 1 with zarr's default chunk keys (`c/0/0`, 4a115de), format 5 with meta
# checksums hashed as format 4's, without the lengths (7eeb1c3), zarr format 6 with them bound to no
# buffer, its shards' documents naming their uuid `shards_bound_to` (8dde15c)
EARLY_FORMATS = (
    [("format-v1-early", "zarr")]
    + [("format-v5-early", backend) for backend in ("zarr", "memmap", "hdf5")]
    + [("format-v6-early", "zarr")]
)
# slot -> commit ordinal: 4 episodes stored circularly into 3 slots
SLOT_EPISODES = {0: 3, 1: 1, 2: 2}


def _check_contents(buffer: ReplayBuffer) -> None:
    assert buffer.num_episodes == 3
    assert buffer.valid_episodes().tolist() == [1, 2, 0]
    for slot, episode in SLOT_EPISODES.items():
        expected = expected_episode(episode)
        n = len(expected["reward"])
        assert int(buffer.episode_lens[slot]) == n
        for name in ("frame", "state", "reward", "done"):
            np.testing.assert_array_equal(np.asarray(buffer.data[name][slot, :n]), expected[name], err_msg=name)
        assert int(buffer.meta_data["task"][slot]) == int(expected["task"])


@pytest.mark.parametrize(("version", "backend"), FORMATS + EARLY_FORMATS)
def test_released_format_reads(version, backend):
    buffer = ReplayBuffer.from_folder(os.path.join(DATA, version, backend), read_only=True)
    _check_contents(buffer)
    all_data = buffer.get_all_data()
    assert all_data["frame"].shape[0] == 3
    assert verify(os.path.join(DATA, version, backend)) == []


@pytest.mark.parametrize(("version", "backend"), FORMATS)
def test_released_format_writes(version, backend, tmp_path):
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, version, backend), path)
    buffer = ReplayBuffer.from_folder(path)
    _check_contents(buffer)
    extra = expected_episode(0)
    buffer.store_episode(**extra)  # goes to slot 1, the oldest
    buffer.close()
    again = ReplayBuffer.from_folder(path, read_only=True)
    assert again.valid_episodes().tolist() == [2, 0, 1]
    np.testing.assert_array_equal(np.asarray(again.data["state"][1, :5]), extra["state"])
    assert verify(path) == []
    # a buffer keeps its format: format 1 gets no checksums it never had, format 3 no meta checksums
    stored = _format_number(version)
    assert _stored_version(path, backend) == stored
    assert os.path.exists(path / "replaybuf" / "checksums.npy") == (version != "format-v1" and backend != "zarr")
    assert _keeps_meta_sums(path) == (stored >= 4)
    if backend == "zarr":  # the new episode's shard, as every other, bound to its slot from format 5 only,
        # to its buffer too from format 6 only, to its episode's generation too from format 7 only
        assert [_shard_bound(path, slot) for slot in range(3)] == [stored == 5] * 3
        assert [_shard_bound(path, slot, to_buffer=True) for slot in range(3)] == [stored == 6] * 3
        assert [_shard_bound(path, slot, to_buffer=True, to_episode=True) for slot in range(3)] == [stored >= 7] * 3
    if stored >= 4:  # each slot's meta checksum too (zarr only): a format-5 buffer's entries stay unbound
        bound = stored >= 6
        assert _meta_sums_match(path, to_buffer=bound) and not _meta_sums_match(path, to_buffer=not bound)
        if backend == "zarr":
            document = json.loads((path / "meta" / META_SUM / "zarr.json").read_text())
            assert ("bound_to" in document["attributes"]) == bound


@pytest.mark.parametrize(("version", "backend"), EARLY_FORMATS)
def test_a_format_its_first_main_commits_wrote_writes_as_written_and_catches_damage(version, backend, tmp_path):
    """Such a buffer opens and takes new episodes as it was written; its slots tell how its meta
    checksums were hashed, new ones are hashed so, and a flipped meta value is still found and
    restored."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, version, backend), path)
    writer = ReplayBuffer.from_folder(path)
    _check_contents(writer)
    extra = expected_episode(0)
    writer.store_episode(**extra)  # slot 1, the oldest
    writer.close()
    again = ReplayBuffer.from_folder(path, read_only=True)
    assert again.valid_episodes().tolist() == [2, 0, 1]
    np.testing.assert_array_equal(np.asarray(again.data["state"][1, :5]), extra["state"])
    assert _stored_version(path, backend) == _format_number(version)
    assert verify(path) == []
    if _format_number(version) < 4:
        return  # no meta checksums
    for slot, task in ((1, 10), (2, 12)):  # the new episode's entry, and one the early commit wrote
        _write_meta(path, "task", slot, task ^ 8)
        with pytest.raises(MetaChecksumError, match=rf"meta/task: slot {slot}: holds {task ^ 8}, .* matches {task}"):
            ReplayBuffer.from_folder(path, read_only=True)
        assert any(f"restored meta/task of slot {slot} to {task}" in line for line in verify(path, repair=True))
    assert verify(path) == []


def test_a_format_6_meta_folder_without_its_uuid_beside_shards_keeping_theirs_is_refused_by_name(tmp_path):
    """Only main's first format-6 buffers keep no uuid in any array document: one whose shards'
    documents keep it has a meta folder copied in from such a buffer, or a damaged document."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v6", "zarr"), path)
    document = path / "meta" / META_SUM / "zarr.json"
    stored = json.loads(document.read_text())
    del stored["attributes"]["bound_to"]
    document.write_text(json.dumps(stored))
    with pytest.raises(BufferDamagedError, match=r"meta/_meta_sum/zarr\.json .*bound to the buffer uuid None"):
        ReplayBuffer.from_folder(path, read_only=True)


def test_a_flat_keyed_format_1_document_naming_zarr_s_default_keys_is_refused_by_name(tmp_path):
    """Only main's first buffers name zarr's default chunk keys: in one of flat keys that name is a
    flipped bit ('.' to '/'), which would read every chunk as missing (zeros: format 1 keeps no
    checksums)."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v1", "zarr"), path)
    document = path / "data" / "state" / "zarr.json"
    document.write_text(document.read_text().replace('"separator": "."', '"separator": "/"'))
    with pytest.raises(
        BufferDamagedError, match=r"data/state/zarr\.json .*stored under flat keys \(data/state/c\.0\.0\.0"
    ):
        ReplayBuffer.from_folder(path, read_only=True)


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
def test_an_edit_killed_part_way_by_main_s_first_edit_log_commit_is_finished_whole(backend, tmp_path):
    """main at 8e0c9c1 appended the edit log to the step log's log ``edit`` (later ones keep one
    record at replaybuf/edit). Its writer killed between the two fields of ``update([1],
    state=7.0, reward=9.0)`` (tests/data/killed-edit-8e0c9c1) left state new and reward old: a
    reader refuses the half-applied episode whole, and the next writable open applies the edit
    again from that log, whole, and removes it."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "killed-edit-8e0c9c1", backend), path)
    legacy = path / "replaybuf" / "steplog" / "edit"
    assert legacy.exists()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    assert np.asarray(reader.data["state"][1, :3]).tolist() == [[7.0] * 3] * 3
    assert np.asarray(reader.data["reward"][1, :3]).tolist() != [9.0] * 3
    with pytest.raises(UnfinishedEditError, match=r"slots \[1\]"):
        reader.get_all_data()
    ReplayBuffer.from_folder(path).close()
    after = ReplayBuffer.from_folder(path, read_only=True)
    assert np.asarray(after.data["reward"][1, :3]).tolist() == [9.0] * 3
    assert np.asarray(after.data["state"][1, :3]).tolist() == [[7.0] * 3] * 3
    np.testing.assert_array_equal(np.asarray(after.data["state"][2, :6]), expected_episode(2)["state"])
    assert not legacy.exists()
    assert verify(path) == []


def _format_number(version: str) -> int:
    """The format version of fixture folder ``version`` (``format-v5``, ``format-v5-early``)."""
    return int(re.fullmatch(r"format-v(\d+)(-early)?", version)[1])


def _meta_sums_match(path: Path, to_buffer: bool) -> bool:
    """Whether every committed slot's ``_meta_sum`` entry of the buffer at ``path`` matches its
    values hashed bound to the buffer's uuid (``to_buffer``: zarr format 6) or to none."""
    storage = make_storage(str(path))
    schema = storage.open(read_only=True)
    meta = {name: np.asarray(storage.read_meta(name)) for name in ("task", "episode_lens", "_generation", META_SUM)}
    summed = Summed(metasums.summed(schema, storage).fields, buffer_word(schema.uuid) if to_buffer else 0)
    storage.close()
    slots = np.flatnonzero(meta["episode_lens"] > 0)
    expected = metasums.entries(slots, meta["_generation"][slots], {n: v[slots] for n, v in meta.items()}, summed)
    return bool((expected == meta[META_SUM][slots]).all())


def _shard_bound(path: Path, slot: int, to_buffer: bool = False, to_episode: bool = False) -> bool:
    """Whether the zarr buffer at ``path`` holds a frame shard for ``slot`` bound to data/frame
    and that slot (the 16 bytes before its index: ``ShardBinding``), with ``to_buffer`` to the
    buffer's uuid too (format 6), with ``to_episode`` to the generation the slot holds too (format 7)."""
    storage = make_storage(str(path))
    schema = storage.open(read_only=True)
    array = storage.array("frame")
    data = array.kv.get(array.shard_key(slot))
    generation = int(storage.read_meta_rows("_generation", np.array([slot]))[0])
    storage.close()
    index = 16 * array.inner_per_shard + 4
    binding = ShardBinding("frame", buffer=schema.uuid if to_buffer else None, generations=to_episode)
    raw = None if data is None else data[-index - ShardBinding.NBYTES : -index]
    return raw is not None and binding.problem(raw, slot, generation) is None and (not to_episode or generation > 0)


def _keeps_meta_sums(path: Path) -> bool:
    """Whether the buffer at ``path`` holds meta checksums (meta/_meta_sum) and a crc32c in its
    counters: both or neither."""
    import h5py

    if (path / "data.h5").exists():
        with h5py.File(path / "data.h5", "r") as f:
            array = "meta/_meta_sum" in f
    else:
        array = any(META_SUM in p.name for p in path.rglob("*"))
    crc = "crc32c" in json.loads((path / "replaybuf" / "state.json").read_text())
    assert array == crc, (array, crc)
    return array


def _write_meta(path: Path, name: str, slot: int, value: int) -> None:
    """Write meta value ``name`` of ``slot`` through the storage alone, as an earlier release or
    damage would: the meta checksums are left as they were."""
    storage = make_storage(str(path))
    storage.open(read_only=False)
    storage.write_meta(name, np.array([slot]), np.array([value], np.int32))
    storage.close()


def _stored_version(path, backend: str) -> int:
    if backend == "zarr":
        return json.loads((path / "zarr.json").read_text())["attributes"]["version"]
    if backend == "memmap":
        return json.loads((path / "replaybuf.json").read_text())["version"]
    import h5py

    with h5py.File(path / "data.h5", "r") as f:  # a plain h5py read, as users inspect files
        return json.loads(f.attrs["replaybuf"])["version"]


@pytest.mark.parametrize("version", ["format-v1", "format-v2"])
def test_released_zarr_keeps_its_codecs_when_written(version, tmp_path):
    """Buffers written before codecs were chosen by measurement record no choice: a new episode
    of noise frames (which a new buffer would store raw) is encoded with the codec the frames
    already stored were, so every episode stays readable."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, version, "zarr"), path)
    frame = json.loads((path / "data" / "frame" / "zarr.json").read_text())
    buffer = ReplayBuffer.from_folder(path)
    label = buffer.storage.array("frame").codec.label
    extra = expected_episode(0)
    extra["frame"] = np.random.default_rng(5).integers(0, 256, extra["frame"].shape, dtype=np.uint8)
    buffer.store_episode(**extra)
    assert buffer.storage.array("frame").codec.label == label != "none"
    buffer.close()
    assert json.loads((path / "data" / "frame" / "zarr.json").read_text()) == frame
    assert "measured_codecs" not in json.loads((path / "zarr.json").read_text())["attributes"]
    again = ReplayBuffer.from_folder(path, read_only=True)
    np.testing.assert_array_equal(np.asarray(again.data["frame"][1, : len(extra["frame"])]), extra["frame"])
    assert verify(path) == []


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_released_format_gets_revisions_on_its_first_writable_open(backend, tmp_path):
    """A buffer written before ``meta/_revision`` existed reads it as zeros; a reader opened then
    (with the read cache) serves an in-place edit a writer made after creating it, once it refreshes."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "format-v2", backend), path)
    reader = ReplayBuffer.from_folder(path, read_only=True, cache="disk", cache_dir=tmp_path / "cache")
    assert not reader._meta["_revision"].any() and reader.storage.inner.read_meta_rows(
        "_revision", [2, 0]
    ).tolist() == [0, 0]
    cached = np.asarray(reader.data["state"][1, :3])  # slot 1 is now cached at revision 0
    writer = ReplayBuffer.from_folder(path)  # creates meta/_revision (zeros)
    writer.update([1], state=np.full((1, 3, *cached.shape[1:]), 9.0))
    writer.close()
    reader.refresh()
    assert reader._meta["_revision"][[0, 2]].tolist() == [0, 0] and reader._meta["_revision"][1] % 2 == 0
    assert reader._meta["_revision"][1] > 0
    np.testing.assert_array_equal(np.asarray(reader.data["state"][1, :3]), np.full_like(cached, 9.0))
    assert verify(path) == []


# ---- replaybuf upgrade ---------------------------------------------------------------------------

NEWEST = {"zarr": 7, "memmap": 5, "hdf5": 5}


@pytest.mark.parametrize(("version", "backend"), FORMATS + EARLY_FORMATS)
def test_upgrade_rewrites_a_released_format_in_the_newest(version, backend, tmp_path, capsys):
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, version, backend), path)
    before = ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    assert cli_main(["upgrade", str(path), "--quiet"]) == 0
    stored = _format_number(version)
    said = capsys.readouterr().out
    assert (f"upgraded from format {stored} to {NEWEST[backend]}" in said) == (stored < NEWEST[backend])
    assert _stored_version(path, backend) == NEWEST[backend]
    assert sorted(os.listdir(tmp_path)) == [backend]  # no copy, no backup left beside it
    after = ReplayBuffer.from_folder(path, read_only=True)
    _check_contents(after)
    for name, values in after.get_all_data().items():
        assert torch.equal(values, before[name]), name
    assert verify(path) == []
    assert os.path.exists(path / "replaybuf" / "checksums.npy") == (backend != "zarr")  # format 2 checks reads
    assert _keeps_meta_sums(path)  # format 4: every committed slot's meta values checked from now on
    if backend == "zarr":  # format 7: each shard bound to its slot, buffer and episode (the copy goes through the
        # write path, the generations kept)
        assert all(_shard_bound(path, slot, to_buffer=True, to_episode=True) for slot in range(3))
    writer = ReplayBuffer.from_folder(path)
    writer.store_episode(**expected_episode(0))  # continues where the original stood: slot 1
    assert writer.valid_episodes().tolist() == [2, 0, 1]
    writer.close()
    for slot in (1, 2):  # sealed by the commit since, and by the upgrade
        task = int(expected_episode(SLOT_EPISODES[slot] if slot != 1 else 0)["task"])
        _write_meta(path, "task", slot, task ^ 1)  # one flipped bit
        with pytest.raises(MetaChecksumError, match=f"meta/task: slot {slot}: holds {task ^ 1}"):
            ReplayBuffer.from_folder(path, read_only=True)
        _write_meta(path, "task", slot, task)


def _newest(backend: str, tmp_path: Path) -> Path:
    """A copy of the newest released fixture of ``backend`` (the format this release writes)."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, f"format-v{NEWEST[backend]}", backend), path)
    return path


def test_upgrade_of_the_newest_format_changes_nothing(tmp_path, capsys):
    path = _newest("zarr", tmp_path)
    files = {p: p.stat().st_mtime_ns for p in path.rglob("*")}
    assert upgrade(path)["upgraded"] is False
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == files
    assert cli_main(["upgrade", str(path)]) == 0
    assert "already in format 7" in capsys.readouterr().out


def test_an_upgraded_zarr_buffer_calls_a_shard_moved_to_another_slot_damage(tmp_path):
    """Format 4 binds no shard to its slot; once upgraded, a shard copied over another slot's
    is named, and ``verify --repair`` drops that episode alone."""
    path = _newest("zarr", tmp_path)
    frames = path / "data" / "frame"
    (frames / "c.2.0.0.0.0").write_bytes((frames / "c.0.0.0.0.0").read_bytes())
    with pytest.raises(CorruptChunkError, match=r"data/frame: slot 2, .*holds slot 0's data, not slot 2's"):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    problems = verify(path, repair=True)
    assert any("data/frame: slot 2" in line for line in problems) and "dropped the damaged episodes in slots [2]" in (
        " ".join(problems)
    )
    assert verify(path) == [] and ReplayBuffer.from_folder(path, read_only=True).valid_episodes().tolist() == [1, 0]


def test_an_upgraded_zarr_buffer_is_another_buffer_whose_shards_its_original_s_are_not(tmp_path):
    """The upgraded buffer has a uuid of its own (a reader of the original sees it replaced) and
    binds its shards to it: a shard of the format-5 original (kept as the backup) copied into it
    is refused, naming the file."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v5", "zarr"), path)
    backup = Path(upgrade(path, keep_backup=True, progress=False)["backup"])
    uuids = [json.loads((p / "zarr.json").read_text())["attributes"]["uuid"] for p in (path, backup)]
    assert uuids[0] != uuids[1]
    shard = path / "data" / "frame" / "c.1.0.0.0.0"
    shard.write_bytes((backup / "data" / "frame" / "c.1.0.0.0.0").read_bytes())
    with pytest.raises(
        CorruptChunkError, match=r"data/frame: slot 1, .*holds slot 1's data of another buffer"
    ) as error:
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    assert str(shard) in str(error.value)


@pytest.mark.parametrize("version", [6, 7])
def test_a_format_6_or_later_zarr_config_without_its_uuid_is_refused_by_name(tmp_path, version):
    """Format 6 binds each shard to the uuid: a config that lost it is damage named at the open
    (not every shard read as another buffer's)."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, f"format-v{version}", "zarr"), path)
    root = path / "zarr.json"
    document = json.loads(root.read_text())
    del document["attributes"]["uuid"]
    root.write_text(json.dumps(document))
    binds = rf"zarr\.json in .*: invalid buffer config: format {version} binds each shard to the buffer's uuid, and the config holds none"
    for read_only in (True, False):
        with pytest.raises(BufferDamagedError, match=binds):
            ReplayBuffer.from_folder(path, read_only=read_only)


def _refused_at_every_open_and_left_as_it_was(path: Path, said: str) -> None:
    """Every open of ``path`` (read-only and writable) raises BufferDamagedError matching
    ``said``, ``verify --repair`` reports it, and no file changes."""
    files = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    for read_only in (True, False):
        with pytest.raises(BufferDamagedError, match=said):
            ReplayBuffer.from_folder(path, read_only=read_only)
    assert any(re.search(said, line) for line in verify(path, repair=True))
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == files


def test_a_format_1_zarr_config_naming_another_layout_is_refused_before_its_first_writable_open_adds_revisions(
    tmp_path,
):
    """A first writable open of an earlier release's buffer adds ``meta/_revision``: on zarr it
    created the array and rewrote the root document before checking the stored arrays against
    the config, so an open refused as damaged had written both (memmap and hdf5 check first)."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v1", "zarr"), path)
    config = path / "zarr.json"
    config.write_text(json.dumps(json.loads(config.read_text())).replace('"shape": [3]', '"shape": [4]'))
    files = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(BufferDamagedError, match=r"data/state/zarr\.json in .* the config expects float32\[3, 6, 4\]"):
        ReplayBuffer.from_folder(path)
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("document", ["zarr.json", "data/frame/zarr.json"])
def test_a_flipped_uuid_in_a_format_6_zarr_config_is_refused_by_name_and_repair_drops_nothing(tmp_path, document):
    """Each shard is bound to the config's uuid: one flipped character of it read every shard as
    another buffer's, and ``verify --repair`` would drop every episode. The sharded arrays'
    documents keep a second copy: the open refuses the disagreement, naming both documents."""
    path = _newest("zarr", tmp_path)
    stored = json.loads((path / document).read_text())
    uuid = stored["attributes"]["uuid" if document == "zarr.json" else "bound_to"]
    flipped = uuid[:5] + ("0" if uuid[5] != "0" else "1") + uuid[6:]
    (path / document).write_text((path / document).read_text().replace(uuid, flipped))
    disagree = (
        r"data/frame/zarr\.json in .*: its shards are bound to the buffer uuid .*, but the config in .*zarr\.json"
    )
    _refused_at_every_open_and_left_as_it_was(path, disagree)


@pytest.mark.parametrize("version", [6, 5, 3, None])
def test_a_format_7_zarr_config_whose_version_was_edited_down_is_refused_by_name_and_repair_drops_nothing(
    tmp_path, version
):
    """Read as format 6, every shard binding of a format-7 buffer fails; as format 5 or 4, every
    meta checksum too (``verify --repair`` dropped all 3 episodes over one edited digit); as
    format 3 or earlier it read unchecked, and a writer would add unbound shards. Its sharded
    arrays' documents say their shards are bound to their episodes (``binds_generations``) and
    keep the uuid (``bound_to``), which no earlier format writes: the open refuses the config
    by name."""
    path = _newest("zarr", tmp_path)
    root = path / "zarr.json"
    original = root.read_text()
    document = json.loads(original)
    if version is None:
        del document["attributes"]["version"]
    else:
        document["attributes"]["version"] = version
    root.write_text(json.dumps(document))
    edited = (
        r"data/frame/zarr\.json in .* (keeps the uuid its contents are bound to|says its shards are bound to their "
        r"episodes' generations) .* config in zarr\.json in .* says (format|an earlier format)"
        r"|zarr\.json in .*: format version is missing \(key 'version'\), expected an int from 1 to 7"
    )
    _refused_at_every_open_and_left_as_it_was(path, edited)
    root.write_text(original)
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


def test_a_format_6_zarr_config_whose_version_was_edited_up_is_refused_by_name_and_repair_drops_nothing(tmp_path):
    """Read as format 7, every shard binding of a format-6 buffer would fail: its sharded arrays'
    documents lack ``binds_generations``, which format 7 writes, so the open refuses the config
    by name and ``verify --repair`` changes nothing."""
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v6", "zarr"), path)
    root = path / "zarr.json"
    root.write_text(root.read_text().replace('"version": 6', '"version": 7'))
    edited = r"data/frame/zarr\.json in .* lacks 'binds_generations', which format 7 and later write, but the config"
    _refused_at_every_open_and_left_as_it_was(path, edited)


def test_upgrade_keeps_a_backup_when_asked(tmp_path):
    path = tmp_path / "memmap"
    shutil.copytree(os.path.join(DATA, "format-v1", "memmap"), path)
    done = upgrade(path, keep_backup=True, progress=False)
    assert done["upgraded"] and os.path.dirname(done["backup"]) == str(tmp_path)
    assert _stored_version(Path(done["backup"]), "memmap") == 1
    _check_contents(ReplayBuffer.from_folder(done["backup"], read_only=True))
    # as a kill between the two renames leaves it: the next upgrade names the original
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError, match=r"rename it back"):
        upgrade(path)


def test_upgrade_refuses_a_held_buffer_and_foreign_files_leaving_it_as_it_was(tmp_path):
    path = tmp_path / "zarr"
    shutil.copytree(os.path.join(DATA, "format-v1", "zarr"), path)
    writer = ReplayBuffer.from_folder(path)  # a writer in this process: its buffer would be replaced
    with pytest.raises(BufferLockedError, match="close that writer first"):
        upgrade(path)
    writer.close()
    (path / "notes.txt").write_text("mine")  # the user's file would be left in the backup
    with pytest.raises(ForeignEntriesError, match="notes.txt"):
        upgrade(path)
    assert sorted(os.listdir(tmp_path)) == ["zarr"]
    assert _stored_version(path, "zarr") == 1 and (path / "notes.txt").read_text() == "mine"
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


def test_upgrade_names_what_it_cannot_upgrade(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="replaybuf convert"):
        upgrade("s3://bucket/run")
    seed = tmp_path / "seed"
    buffer = memmap_replay_buffer.ReplayBuffer(
        str(seed), max_episodes=2, max_timesteps=4, fields={"state": "float"}, overwrite=True
    )
    buffer.store_episode(state=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="memmap-replay-buffer folder.*replaybuf convert"):
        upgrade(seed)
    with pytest.raises(FileNotFoundError):
        upgrade(tmp_path / "missing")
    # an empty location (an unset setting) named the current folder, whose buffer it upgraded
    shutil.copytree(os.path.join(DATA, "format-v1", "memmap"), tmp_path / "here")
    monkeypatch.chdir(tmp_path / "here")
    for empty in ("", "file://"):
        with pytest.raises(ValueError, match=f"the location {empty!r} is empty: it names no folder"):
            upgrade(empty)
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["upgrade", empty, "--quiet"])
        assert exit_info.value.code == 2 and f"the location {empty!r} is empty" in capsys.readouterr().err
    assert _stored_version(tmp_path / "here", "memmap") == 1


@pytest.mark.parametrize(
    ("version", "backend"),
    [
        ("format-v1", "hdf5"),
        ("format-v3", "zarr"),
        ("format-v3", "memmap"),
        ("format-v4", "zarr"),
        ("format-v5", "zarr"),
    ],
)
def test_info_points_an_earlier_format_to_upgrade(version, backend, capsys):
    assert cli_main(["info", os.path.join(DATA, version, backend)]) == 0
    stored = version.rsplit("v", 1)[1]
    said = f"format     {stored}, written by an earlier replaybuf: `replaybuf upgrade` rewrites it in format"
    assert f"{said} {NEWEST[backend]}" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_info_of_the_newest_format_names_no_upgrade(backend, tmp_path, capsys):
    assert cli_main(["info", str(_newest(backend, tmp_path))]) == 0
    said = capsys.readouterr().out
    assert "replaybuf upgrade" not in said and "format     " not in said


def test_upgrade_through_a_link_rewrites_the_folder_it_names(tmp_path):
    real = tmp_path / "real"
    shutil.copytree(os.path.join(DATA, "format-v1", "zarr"), real)
    (tmp_path / "link").symlink_to(real)
    assert upgrade(tmp_path / "link", progress=False)["upgraded"]
    assert (tmp_path / "link").is_symlink() and _stored_version(tmp_path / "link", "zarr") == NEWEST["zarr"]
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    _check_contents(ReplayBuffer.from_folder(tmp_path / "link", read_only=True))


def _upgrade_killed_before_the_swap(path: str) -> None:
    """Child: upgrade ``path``, SIGKILLed once the copy is made, before its renames."""
    import signal

    import replaybuf.maintenance as maintenance

    maintenance.verify = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    maintenance.upgrade(path, progress=False)


def test_a_killed_upgrade_leaves_the_buffer_as_it_was_and_the_next_removes_its_copy(tmp_path, capsys):
    import multiprocessing
    import signal

    path = tmp_path / "hdf5"
    shutil.copytree(os.path.join(DATA, "format-v1", "hdf5"), path)
    child = multiprocessing.get_context("fork").Process(target=_upgrade_killed_before_the_swap, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert _stored_version(path, "hdf5") == 1  # the original, untouched, its lease gone with the child
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))
    left = tmp_path / f".hdf5.upgrading-{child.pid}"
    assert sorted(os.listdir(tmp_path)) == [left.name, "hdf5"]
    assert cli_main(["info", str(path)]) == 0
    assert f"leftover   {left}: the copy of a killed upgrade" in capsys.readouterr().out
    # look-alikes that are not provably a dead upgrade's copy of this buffer stay
    alive = tmp_path / f".hdf5.upgrading-{os.getppid()}"  # a running process's
    shutil.copytree(left, alive)
    marker = alive / "replaybuf" / "upgrading.json"
    marker.write_text(marker.read_text().replace(str(child.pid), str(os.getppid())))
    mine = tmp_path / f".hdf5.upgrading-{os.getpid()}"  # where this upgrade would copy: refused
    mine.mkdir()
    with pytest.raises(FileExistsError, match="remove it if no upgrade is running"):
        upgrade(path, progress=False)
    assert os.listdir(mine) == [] and left.is_dir() and _stored_version(path, "hdf5") == 1
    mine.rmdir()
    unmarked = tmp_path / ".hdf5.upgrading-999999999"
    unmarked.mkdir()
    (unmarked / "mine.txt").write_text("not an upgrade's")
    done = upgrade(path, progress=False)
    assert done["upgraded"] and done["removed"] == [str(left)]
    assert sorted(os.listdir(tmp_path)) == [alive.name, unmarked.name, "hdf5"]
    assert (unmarked / "mine.txt").read_text() == "not an upgrade's"
    assert _stored_version(path, "hdf5") == NEWEST["hdf5"] and verify(path) == []
    assert not (path / "replaybuf" / "upgrading.json").exists()
    assert cli_main(["info", str(path)]) == 0
    said = capsys.readouterr().out
    assert f"leftover   {alive}: an upgrade's copy" in said and f"leftover   {unmarked}: an upgrade's copy" in said


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_format_2_entries_are_checked_as_far_as_they_hold_and_stay_format_2(backend, tmp_path):
    """Format 2's entries carry no tag: a flipped kept bit or high bit, or a zeroed entry of a
    committed episode, is still ChecksumEntryError naming checksums.npy; --repair re-seals it
    in format 2's form and the buffer stays format 2 (a flipped crc bit is told apart by being
    one bit away from the data's crc: tests/test_maintenance_hostile.py)."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "format-v2", backend), path)
    sums_file = path / "replaybuf" / "checksums.npy"
    sums = np.load(sums_file, mmap_mode="r+")
    assert not (sums >> np.uint64(33)).any()  # untagged
    sums[1, 0] ^= np.uint64(1 << 32)
    sums[2, 1] ^= np.uint64(1 << 45)
    sums[0, 2] = 0
    sums.flush()
    with pytest.raises(ChecksumEntryError, match=r"data/frame: slot 1: its checksum entry in .*checksums\.npy"):
        ReplayBuffer.from_folder(path, read_only=True).get_all_data()
    problems = verify(path, repair=True)
    assert [p.split(": its")[0] for p in problems[:3]] == [
        "data/frame: slot 1",
        "data/state: slot 2",
        "data/reward: slot 0",
    ]
    assert "dropped" not in " ".join(problems) and verify(path) == []
    assert not (np.load(sums_file) >> np.uint64(33)).any() and _stored_version(path, backend) == 2
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))


# ---- meta checksums: format 4 and later -------------------------------------------------------


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_format_3_stays_format_3_and_its_meta_values_are_not_checked(backend, tmp_path):
    """An earlier release still writes format 3, and would leave meta checksums stale: this
    release opens, reads and writes a format-3 buffer as it was, adds no meta/_meta_sum and no
    crc32c to its counters, and does not check its meta values (a value changed behind its back
    reads as stored); ``replaybuf upgrade`` rewrites it in the newest format, which checks them."""
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "format-v3", backend), path)
    with ReplayBuffer.from_folder(path) as writer:
        writer.store_episode(**expected_episode(0))  # slot 1
        writer.update([2], task=np.array([77], np.int32))  # an edit of a meta value in place
    assert _stored_version(path, backend) == 3 and not _keeps_meta_sums(path)
    _write_meta(path, "task", 0, 5)  # as an earlier release writes it
    with ReplayBuffer.from_folder(path, read_only=True) as reader:
        assert reader.valid_episodes().tolist() == [2, 0, 1]
        assert reader.meta_data["task"][:3].tolist() == [5, 10, 77]
    assert verify(path) == []
    assert upgrade(path, progress=False)["upgraded"]
    assert _stored_version(path, backend) == NEWEST[backend] and _keeps_meta_sums(path)
    _write_meta(path, "task", 0, 4)  # one flipped bit, caught now
    with pytest.raises(MetaChecksumError, match=r"meta/task: slot 0: holds 4, .* matches 5"):
        ReplayBuffer.from_folder(path, read_only=True)
    assert any("meta/task: slot 0" in line for line in verify(path))


def test_format_3_ignores_meta_checksums_an_earlier_build_left(tmp_path):
    """A format-3 buffer a build that sealed them wrote meta checksums and a counters crc32c
    into, and an earlier release wrote since (both stale now): neither is checked, and the
    next commit writes counters without a crc32c."""
    path = tmp_path / "memmap"
    shutil.copytree(os.path.join(DATA, "format-v3", "memmap"), path)
    np.save(path / f"{META_SUM}.data.meta.npy", np.full(3, 12345, np.uint64))
    state = path / "replaybuf" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "crc32c": 1}))
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))
    with ReplayBuffer.from_folder(path) as writer:
        writer.store_episode(**expected_episode(0))
    assert "crc32c" not in json.loads(state.read_text()) and _stored_version(path, "memmap") == 3
    assert np.load(path / f"{META_SUM}.data.meta.npy").tolist() == [12345] * 3  # never written
    assert verify(path) == []


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_format_4_fixture_catches_a_flipped_meta_value_and_counters(backend, tmp_path):
    path = tmp_path / backend
    shutil.copytree(os.path.join(DATA, "format-v4", backend), path)
    _write_meta(path, "task", 2, 12 ^ 8)
    with pytest.raises(MetaChecksumError, match=r"meta/task: slot 2: holds 4, .* matches 12"):
        ReplayBuffer.from_folder(path, read_only=True)
    assert any("restored meta/task of slot 2 to 12" in line for line in verify(path, repair=True))
    _check_contents(ReplayBuffer.from_folder(path, read_only=True))
    state = path / "replaybuf" / "state.json"
    state.write_text(state.read_text().replace('"num_episodes": 3', '"num_episodes": 2'))
    with pytest.raises(BufferDamagedError, match="do not match their crc32c"):
        ReplayBuffer.from_folder(path, read_only=True)
