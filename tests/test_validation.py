"""Damaged or hostile folders are refused with an error naming the file, never trusted.

Every stored number is checked against the config on open (lengths, generations, counters,
array shapes and dtypes, file sizes, sizes against MAX_META_BYTES before any allocation);
``verify`` and ``info`` report damage as findings; seed pickles are bounded; a damaged step log
is copied aside and its valid prefix recovered; the command line takes store options.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from replaybuf import BufferDamagedError, ReplayBuffer
from replaybuf.cli import main
from replaybuf.maintenance import info, verify
from replaybuf.staging import StepLog
from replaybuf.storage._codecs import crc32c
from replaybuf.storage._seed import UnsafePickleError, load_plain_pickle
from replaybuf.storage.base import STATE_CHECKSUM, state_body

from ._backends import LOCAL_BACKENDS, require, snapshot
from ._data import FIELDS, META_FIELDS, episode, seed_buffer

LENGTHS = (5, 7, 3)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def filled(location, backend="zarr", max_episodes=4, circular=False, lengths=LENGTHS):
    buffer = ReplayBuffer(
        str(location), max_episodes, 12, fields=FIELDS, meta_fields=META_FIELDS, circular=circular, backend=backend
    )
    for i, length in enumerate(lengths):
        buffer.store_episode(**episode(length, i), task_id=10 + i)
    buffer.close()
    return str(location)


def refused(location, match, read_only=(False, True)):
    """Every open (writable, read-only) raises BufferDamagedError matching ``match``."""
    for ro in read_only:
        with pytest.raises(BufferDamagedError, match=match):
            ReplayBuffer.from_folder(location, read_only=ro)


def cli(capsys, *argv) -> tuple[int, str]:
    """Exit status and stdout + stderr of ``replaybuf ARGV``; a usage error (exit 2) fails the test."""
    status = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "usage:" not in out.err, out.err
    return status, out.out + out.err


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter using this checkout, bounded in time (a regression fails,
    never hangs the suite) and in address space (it cannot take the machine's memory)."""
    prelude = "import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def edit_json(path, **changes) -> None:
    with open(path) as f:
        doc = json.load(f)
    target = doc["attributes"] if "replaybuf" in json.dumps(doc.get("attributes")) else doc
    target.update(changes)
    if STATE_CHECKSUM in doc:  # the counters as a writer would commit them: sealed again
        doc[STATE_CHECKSUM] = crc32c(state_body(doc))
    with open(path, "w") as f:
        json.dump(doc, f)


def files(location) -> dict:
    """The files stored at ``location`` (``snapshot``), without folders and the writer's lease."""
    return {k: v for k, v in snapshot(location).items() if v[2] and "lease" not in k}


def config_path(location, backend) -> str:
    return os.path.join(location, "zarr.json" if backend == "zarr" else "replaybuf.json")


# ---- stored numbers against the config -------------------------------------------------------------


def test_garbage_bytes_in_the_lengths_chunk_are_refused(tmp_path, capsys):
    location = filled(tmp_path / "b")
    with open(tmp_path / "b" / "meta" / "episode_lens" / "c.0", "wb") as f:
        f.write(struct.pack("<4i", 2**31 - 1, 2**31 - 2, 7, 3))  # 16 garbage bytes
    refused(location, r"meta/episode_lens of .*slots \[0, 1\] hold lengths \[2147483647, 2147483646\]")
    status, out = cli(capsys, "verify", location)
    assert status == 1 and "outside [0, 12]" in out and "unreadable" not in out  # those slots are not read


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize("length", [13, -3, 2**31 - 1])
def test_lengths_outside_max_timesteps_are_refused(tmp_path, backend, length):
    location = filled(tmp_path / "b", backend)
    buffer = ReplayBuffer.from_folder(location)
    buffer.storage.array("episode_lens", meta=True)[1] = length  # bypasses checks (and sealing)
    buffer.close()
    refused(location, rf"episode_lens.*slots \[1\] hold lengths \[{length}\], outside \[0, max_timesteps=12\]")
    # reported, and its slot not read: the length would size the read (gigabytes)
    assert verify(location) == ["episode_lens: slots [1] have lengths outside [0, 12]"]


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
@pytest.mark.parametrize("max_episodes", [10**9, 10**12])
def test_a_huge_max_episodes_is_refused_before_allocating(tmp_path, backend, max_episodes):
    location = filled(tmp_path / "b", backend)
    edit_json(config_path(location, backend), max_episodes=max_episodes)
    result = run_python(
        f"""
        from replaybuf import BufferDamagedError, ReplayBuffer
        from replaybuf.maintenance import verify
        for read_only in (False, True):
            try:
                ReplayBuffer.from_folder({location!r}, read_only=read_only)
            except BufferDamagedError as e:
                print(e)
        print(verify({location!r}))
        # this interpreter's peak (VmHWM starts again at exec; ru_maxrss keeps the forking parent's)
        peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        print("peak_mb", int(peak.split()[1]) // 1024)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    file = os.path.basename(config_path(location, backend))
    assert all("GiB of per-episode arrays" in line and file in line and location in line for line in lines[:3])
    assert int(lines[-1].split()[1]) < 1024  # the refusal allocated nothing of that size


def test_a_huge_max_timesteps_is_refused(tmp_path, capsys):
    location = filled(tmp_path / "b")
    edit_json(config_path(location, "zarr"), max_timesteps=10**12)
    refused(location, r"zarr.json in .*max_timesteps 1000000000000 exceeds")
    status, out = cli(capsys, "info", location)
    assert status == 1 and "damaged" in out and "max_timesteps" in out


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_an_array_whose_shape_or_dtype_differs_from_the_config_is_refused(tmp_path, backend):
    location = filled(tmp_path / "b", backend)
    if backend == "zarr":
        edit_json(os.path.join(location, "data", "reward", "zarr.json"), shape=[4, 11])
        where = "data/reward/zarr.json"
    elif backend == "memmap":
        np.save(os.path.join(location, "reward.data.npy"), np.zeros((4, 12), np.float64))
        where = "reward.data.npy"
    else:
        with require("h5py").File(os.path.join(location, "data.h5"), "r+") as f:
            del f["data/reward"]
            f.create_dataset("data/reward", shape=(4, 12), dtype="int16")
        where = "dataset 'data/reward'"
    refused(location, rf"{where}.* holds \w+\[4, 1[12]\], the config expects float32\[4, 12\]")
    assert any(where in p for p in verify(location))


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize(
    "counters, complaint",
    [
        ({"num_episodes": -1}, "num_episodes is -1, expected an int >= 0"),
        ({"num_episodes": 10**12}, "num_episodes is 1000000000000, over max_episodes 4"),
        ({"episode_index": 4}, "episode_index is 4, expected < max_episodes 4"),
        ({"total_episodes": "3"}, "total_episodes is '3', expected an int"),
    ],
)
def test_counters_out_of_range_are_refused_and_reported(tmp_path, capsys, backend, counters, complaint):
    location = filled(tmp_path / "b", backend)
    edit_json(os.path.join(location, "replaybuf", "state.json"), **counters)
    refused(location, rf"replaybuf/state.json in .*: {complaint}")
    status, out = cli(capsys, "verify", location)
    assert status == 1 and complaint in out
    status, out = cli(capsys, "info", location)
    assert status == 1 and complaint in out


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_counters_disagreeing_with_the_lengths_roll_to_the_lengths(tmp_path, backend):
    location = filled(tmp_path / "b", backend)  # 3 of 4 slots, not circular
    edit_json(os.path.join(location, "replaybuf", "state.json"), num_episodes=4, total_episodes=5)
    with ReplayBuffer.from_folder(location) as buffer:
        assert (buffer.num_episodes, len(buffer), buffer.episode_index) == (3, 3, 3)
        buffer.store_episode(**episode(2, 9), task_id=9)  # not refused as full
    assert verify(location) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize(
    "version, complaint",
    [
        (99, r"buffer at .* has format version 99; this replaybuf reads formats up to \d: install a newer replaybuf"),
        ("2", r"(replaybuf.json|data.h5|zarr.json.*): format version is '2', expected an int"),
        # no release wrote a version below 1: read as one, a buffer opened with every check skipped
        (0, r"(replaybuf.json|data.h5|zarr.json.*): format version is 0, expected an int from 1 to \d"),
        (None, r"(replaybuf.json|data.h5|zarr.json.*): format version is None, expected an int from 1 to \d"),
    ],
)
def test_a_format_version_this_release_cannot_read_is_refused_before_writing(tmp_path, backend, version, complaint):
    location = filled(tmp_path / "b", backend)
    if backend == "hdf5":
        with require("h5py").File(os.path.join(location, "data.h5"), "r+") as f:
            f.attrs["replaybuf"] = json.dumps({**json.loads(f.attrs["replaybuf"]), "version": version})
    else:
        edit_json(config_path(location, backend), version=version)
    before = files(location)
    for read_only in (True, False):
        with pytest.raises(ValueError, match=complaint):
            ReplayBuffer.from_folder(location, read_only=read_only)
    assert files(location) == before  # the writer's lease comes and goes; nothing else is written


def test_a_lost_generation_chunk_is_damage_not_an_empty_buffer(tmp_path, capsys):
    location = filled(tmp_path / "b")
    os.unlink(os.path.join(location, "meta", "_generation", "c.0"))
    refused(location, r"meta/_generation of .*committed slots \[0, 1, 2\] have generation 0")
    status, out = cli(capsys, "verify", location)
    assert status == 1 and "no ordinal" in out


@pytest.mark.parametrize(
    "backend, file, content",
    [
        ("zarr", "zarr.json", b'{"zarr_format": 3, "attributes": {'),
        ("zarr", "zarr.json", b"\xff\xfe garbage"),
        ("zarr", "meta/episode_lens/zarr.json", b"{"),
        ("zarr", "replaybuf/state.json", b'{"num_episodes" 3}'),
        ("memmap", "replaybuf.json", b'{"format": "replay'),
        ("memmap", "replaybuf/state.json", b""),
        ("memmap", "reward.data.npy", b"\x93NUMPY garbage"),
        ("hdf5", "replaybuf/state.json", b"[1, 2]"),
    ],
)
def test_garbage_or_truncated_metadata_names_the_file(tmp_path, capsys, backend, file, content):
    location = filled(tmp_path / "b", backend)
    with open(os.path.join(location, file), "wb") as f:
        f.write(content)
    refused(location, rf"{file}.*(not valid JSON|expected a JSON object|not a readable .npy)")
    status, out = cli(capsys, "verify", location)
    assert status == 1 and file in out


def test_a_damaged_chunk_shape_is_refused_before_any_chunk_is_read(tmp_path):
    location = filled(tmp_path / "b")
    path = os.path.join(location, "meta", "episode_lens", "zarr.json")
    with open(path) as f:
        doc = json.load(f)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [10**12]
    with open(path, "w") as f:
        json.dump(doc, f)
    refused(location, r"meta/episode_lens/zarr.json in .*: chunk shape \[1000000000000\] does not fit the array \[4\]")


def test_garbage_hdf5_config_attribute_names_the_attribute(tmp_path):
    location = filled(tmp_path / "b", "hdf5")
    with require("h5py").File(os.path.join(location, "data.h5"), "r+") as f:
        f.attrs["replaybuf"] = '{"format": "replaybuf", "max_'
    refused(location, r"attribute 'replaybuf' of .*data.h5: not valid JSON")


def test_a_truncated_memmap_file_is_refused_not_zero_extended(tmp_path, capsys):
    location = filled(tmp_path / "b", "memmap")
    path = os.path.join(location, "state.data.npy")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    refused(location, rf"state.data.npy: {size // 2} bytes, its header .* needs {size}: the file was truncated")
    assert os.path.getsize(path) == size // 2  # the writable open did not extend it
    status, out = cli(capsys, "verify", location)
    assert status == 1 and "truncated" in out


# ---- meta_data views -----------------------------------------------------------------------------------


@pytest.mark.parametrize("slot, value", [(0, 10**6), (0, -3), (3, 5)])
def test_episode_lens_are_read_only_through_the_view(tmp_path, slot, value):
    buffer = ReplayBuffer.from_folder(filled(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"meta_data\['episode_lens'\] is read-only"):
        buffer.meta_data["episode_lens"][slot] = value
    assert buffer.episode_lens.tolist() == [*LENGTHS, 0]
    assert ReplayBuffer.from_folder(tmp_path / "b", read_only=True).episode_lens.tolist() == [*LENGTHS, 0]


def test_meta_view_writes_are_checked_and_reach_the_episode_in_progress(tmp_path):
    buffer = ReplayBuffer.from_folder(filled(tmp_path / "b"))
    with pytest.raises(ValueError, match="do not fit dtype int32"):
        buffer.meta_data["task_id"][0] = 2**40
    with pytest.raises(ValueError, match=r"value of shape \(2, 2\) does not fit 2 episode\(s\) of shape \(\)"):
        buffer.meta_data["task_id"][0:2] = [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="out of bounds"):
        buffer.meta_data["task_id"][7] = 1
    assert buffer.meta_data["task_id"][:].tolist() == [10, 11, 12, 0]
    buffer.meta_data["task_id"][1:3] = [21, 22]
    with buffer.one_episode(task_id=5):
        buffer.store(**{n: v[0] for n, v in episode(1, 5).items()})
        buffer.meta_data["task_id"][3] = 42  # the slot in progress: committed with the episode
    buffer.close()
    assert ReplayBuffer.from_folder(tmp_path / "b").meta_data["task_id"][:].tolist() == [10, 21, 22, 42]


# ---- hostile seed folders ------------------------------------------------------------------------------


def shared_reference_pickle(levels: int = 60) -> bytes:
    """A small pickle of lists whose tree walk visits 2**levels objects."""
    value: list = []
    for _ in range(levels):
        value = [value, value]
    return pickle.dumps({"max_episodes": 4, "max_timesteps": 10, "fields": {"x": "float"}, "extra": value})


def hostile_seed_folder(folder, payload: bytes) -> str:
    os.makedirs(folder)
    with open(os.path.join(folder, "metadata.pkl"), "wb") as f:
        f.write(payload)
    for name in ("num_episodes", "episode_index", "timestep_index"):
        np.save(os.path.join(folder, f"{name}.state.npy"), np.array(0, np.int32))
    return str(folder)


def test_a_pickle_of_shared_references_is_refused_at_once(tmp_path):
    payload = shared_reference_pickle()
    assert len(payload) < 600
    folder = hostile_seed_folder(tmp_path / "seed", payload)
    result = run_python(
        f"""
        from replaybuf import ReplayBuffer
        from replaybuf.maintenance import verify
        for read_only in (False, True):
            try:
                ReplayBuffer.from_folder({folder!r}, read_only=read_only)
            except ValueError as e:
                print(type(e).__name__, e)
        print(verify({folder!r}))
        """,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all("metadata.pkl: expands to more than 100000 objects" in line for line in lines)
    assert lines[0].startswith("UnsafePickleError")


@pytest.mark.parametrize(
    "build, complaint",
    [
        (lambda: (lambda a: (a.append(a), a)[1])([]), "contains itself"),
        (lambda: (lambda d: (d.__setitem__("me", d), d)[1])({}), "contains itself"),
        (lambda: [[[[[[[[[[[]]]]]]]]]]] * 2, None),
        (lambda: __import__("functools").reduce(lambda v, _: [v], range(200), []), "nested deeper than 64"),
        (lambda: list(range(200_000)), "more than 100000"),
    ],
)
def test_cycles_depth_and_object_count_are_bounded(build, complaint):
    data = pickle.dumps({"fields": {}, "extra": build()})
    if complaint is None:
        assert load_plain_pickle(data, "metadata.pkl")["extra"] == build()
        return
    with pytest.raises(UnsafePickleError, match=f"metadata.pkl: .*{complaint}"):
        load_plain_pickle(data, "metadata.pkl")


@pytest.mark.parametrize(
    "counter, value", [("episode_index", 4), ("episode_index", 10**9), ("num_episodes", 5), ("timestep_index", 11)]
)
def test_seed_counters_past_the_config_are_refused_not_wrapped(tmp_path, counter, value):
    """memmap-replay-buffer keeps episode_index < max_episodes, num_episodes <= max_episodes and
    timestep_index <= max_timesteps. A larger value is damage: an episode_index of 10**9 was taken
    modulo max_episodes, and the next store_episode overwrote the committed episode in slot 0 of
    a buffer that is not circular."""
    seed_buffer(tmp_path / "seed", circular=False, lengths=(3, 4, 5), partial=0)
    location = str(tmp_path / "seed")
    before = {name: np.load(os.path.join(location, name)) for name in os.listdir(location) if name.endswith(".npy")}
    np.save(os.path.join(location, f"{counter}.state.npy"), np.array(value, np.int32))
    refused(location, f"{counter}.state.npy: .*expected an int in \\[0, ")
    before[f"{counter}.state.npy"] = np.array(value, np.int32)
    assert all(
        np.array_equal(np.load(os.path.join(location, name)), before[name]) for name in before
    )  # nothing written


@pytest.mark.parametrize(
    "damage, complaint",
    [
        (lambda path: np.save(path, np.array([None] * 4, dtype=object), allow_pickle=True), "object array"),
        (lambda path: np.save(path, np.ones(2, bool)), "holds bool\\[2\\], the config expects bool\\[4\\]"),
        (lambda path: os.truncate(path, 100), "not a readable .npy file"),
    ],
)
def test_a_damaged_seed_flags_array_is_refused_before_a_writable_open_writes(tmp_path, damage, complaint):
    """The seed's ``_initted`` flags, which each commit of an adopted seed folder updates: damaged,
    a writable open raised numpy's unnamed ValueError or IndexError after half adopting the folder
    (``_generation``, ``_revision`` and ``replaybuf/`` written), and ``verify`` called the folder
    consistent; now nothing is written and ``verify`` reports it."""
    seed_buffer(tmp_path / "seed", circular=False, lengths=(3, 4, 5), partial=0)
    location = str(tmp_path / "seed")
    damage(os.path.join(location, "_initted.data.meta.npy"))
    listing = sorted(os.listdir(location))
    refused(location, f"_initted.data.meta.npy:? .*{complaint}", read_only=(False,))
    assert sorted(os.listdir(location)) == listing
    assert any("_initted.data.meta.npy" in problem for problem in verify(location))  # said "consistent"
    assert ReplayBuffer.from_folder(location, read_only=True).episode_lens.tolist() == [3, 4, 5, 0]  # still read


@pytest.mark.parametrize(
    "key, value",
    [("max_episodes", 10**12), ("max_timesteps", 2.5), ("fields", {"x": ("float", (-3,))}), ("meta_fields", "a")],
)
def test_an_invalid_seed_config_names_its_metadata_pkl(tmp_path, key, value):
    """A metadata.pkl of plain data whose values no config takes is damage naming the file, as a
    replaybuf config's is (it raised the bare ValueError, TypeError or AttributeError of a bad
    argument, naming no file)."""
    seed_buffer(tmp_path / "seed", circular=False, lengths=(3,), partial=0)
    path = tmp_path / "seed" / "metadata.pkl"
    config = load_plain_pickle(path.read_bytes(), str(path))
    path.write_bytes(pickle.dumps({**config, key: value}))
    refused(str(tmp_path / "seed"), "metadata.pkl: invalid memmap-replay-buffer config: ")


def test_an_oversized_pickle_is_refused_unread(tmp_path):
    with pytest.raises(UnsafePickleError, match="over the 1048576 of any seed config"):
        load_plain_pickle(pickle.dumps({"fields": "x" * (2 << 20)}), "metadata.pkl")


def test_hostile_seed_folder_in_the_command_line_is_a_finding(tmp_path):
    folder = hostile_seed_folder(tmp_path / "seed", shared_reference_pickle())
    for command in ("verify", "info"):
        result = run_python(f"from replaybuf.cli import main; raise SystemExit(main([{command!r}, {folder!r}]))", 30)
        assert result.returncode in (1, 2) and "expands to more than" in result.stderr
        assert "Traceback" not in result.stderr


# ---- recovery that never dead-ends ------------------------------------------------------------------


def step_log(buffer, steps: int, meta: dict | None = None) -> tuple[StepLog, list[bytes]]:
    """The records a writer logs for one episode of ``steps`` steps in the next slot."""
    log = StepLog(buffer.schema.fields, buffer.schema.meta_fields)
    data = episode(steps, 77)
    records = [log.header(np.array([buffer.episode_index]), int(buffer._state["total_episodes"]), meta or {})]
    records += [log.steps({n: v[t][None] for n, v in data.items()}) for t in range(steps)]
    return log, records


def reopen_with_log(location, payload: bytes, damaged: bool):
    buffer = ReplayBuffer.from_folder(location)
    buffer.storage.append_log("episode", payload)
    buffer.storage.close()
    buffer.storage.release_writer()  # as a killed writer: its lease gone, its log left
    if damaged:
        with pytest.warns(
            UserWarning, match=r"step log .* is damaged \((.*)\); it was copied to 'replaybuf/steplog-damaged-"
        ):
            buffer = ReplayBuffer.from_folder(location)
    else:
        buffer = ReplayBuffer.from_folder(location)
    assert buffer.storage.log_names() == []
    return buffer


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize(
    "damage, recovered",
    [
        ("short step", 3),
        ("bad checksum", 1),
        ("non-numeric meta", 2),
        ("bad header", 0),
        ("torn tail", 4),
        ("torn record prefix", 4),
        ("absurd size of the last step", 4),
        ("absurd size mid-log", 2),
        ("absurd size of the header", 0),
        ("more steps than max_timesteps", 12),
        ("more slots than max_episodes", 0),
    ],
)
def test_a_damaged_step_log_is_set_aside_and_its_valid_prefix_recovered(tmp_path, backend, damage, recovered):
    """A kill mid-append (a last record cut short, its size one the writer gave) is silent
    recovery; a size no record of the log could have (0xFFFFFFFF with bytes after it) is
    damage, though the log ends within it."""
    location = filled(tmp_path / "b", backend, max_episodes=5)
    buffer = ReplayBuffer.from_folder(location)
    log, records = step_log(buffer, 13 if damage == "more steps than max_timesteps" else 5)
    buffer.close()
    torn = damage in ("torn tail", "torn record prefix")
    if damage == "short step":
        records[4] = log.record(b"s", records[4][13:-4])
    elif damage == "bad checksum":
        records[2] = records[2][:-1] + bytes([records[2][-1] ^ 1])
    elif damage == "non-numeric meta":
        records.insert(3, log.record(b"m", json.dumps({"task_id": ["abc"]}).encode()))
    elif damage == "bad header":
        records[0] = log.record(b"h", b'{"slots": "all"')
    elif damage == "torn tail":
        records[-1] = records[-1][:-3]  # a kill mid-append: not damage
    elif damage == "torn record prefix":
        records[-1] = records[-1][:5]
    elif damage == "more slots than max_episodes":  # its steps' size would follow it
        records = [log.header(np.arange(6), 3, {}), log.record(b"s", b"\0" * 6 * len(records[1][9:]))]
    elif damage != "more steps than max_timesteps":
        at = {"absurd size of the last step": 5, "absurd size mid-log": 3, "absurd size of the header": 0}[damage]
        records[at] = records[at][:1] + struct.pack("<I", 0xFFFFFFFF) + records[at][5:]
    buffer = reopen_with_log(location, b"".join(records), damaged=not torn)
    expected = [*LENGTHS, recovered] if recovered else list(LENGTHS)
    assert buffer.episode_lens[: len(expected)].tolist() == expected and len(buffer) == len(expected)
    assert buffer.num_episodes == len(expected)
    aside = buffer.storage.list_blobs("replaybuf/steplog-damaged-")
    assert len(aside) == (not torn)
    if aside:
        assert buffer.storage.read_blob(aside[0]) == b"".join(records)
    buffer.store_episode(**episode(2, 5), task_id=5)  # the buffer goes on
    buffer.close()
    assert verify(location) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_long_step_log_read_in_pieces_is_recovered_whole(tmp_path, monkeypatch, backend):
    """A valid log longer than a valid episode's steps (rewinds and meta records a writer may
    append without end) read in pieces that split its records anywhere is recovered whole,
    as the writer left it: no damage, nothing set aside."""
    monkeypatch.setattr("replaybuf.storage._kv.LOG_PIECE_BYTES", 7)
    location = filled(tmp_path / "b", backend, max_episodes=5)
    buffer = ReplayBuffer.from_folder(location)
    log, records = step_log(buffer, 12)
    buffer.close()
    for round in range(20):  # store 12 steps, rewind to 2, set a meta value: again and again
        records += [log.truncate(2), log.meta({"task_id": np.array([round])}), *records[3:13]]
    assert sum(r[:1] == b"s" for r in records) == 12 + 20 * 10  # far more than max_timesteps (12)
    buffer = reopen_with_log(location, b"".join(records), damaged=False)
    assert buffer.episode_lens.tolist() == [*LENGTHS, 12, 0]
    assert buffer.meta_data["task_id"][3] == 19
    for name, expected in episode(12, 77).items():
        np.testing.assert_array_equal(buffer.data[name][3, :12], expected)
    assert buffer.storage.list_blobs("replaybuf/steplog-damaged-") == []
    buffer.close()


def test_a_step_log_of_the_previous_release_is_recovered(tmp_path):
    location = filled(tmp_path / "b")
    buffer = ReplayBuffer.from_folder(location)
    _, records = step_log(buffer, 4, {"task_id": np.array([7])})
    buffer.close()
    # the first release's records: upper-case kind, size, payload; no checksum
    legacy = b"".join(struct.pack("<cI", r[:1].upper(), len(r) - 9) + r[9:] for r in records)
    buffer = reopen_with_log(location, legacy, damaged=False)
    assert buffer.episode_lens.tolist() == [*LENGTHS, 4]
    assert buffer.meta_data["task_id"][3] == 7


# ---- the command line on object stores -------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_options():
    from ._viewer_s3 import moto_s3

    with moto_s3() as options:
        yield options


def test_verify_info_and_convert_take_store_options(tmp_path, capsys, s3_options):
    s3fs = pytest.importorskip("s3fs")
    filled(tmp_path / "local")
    s3fs.S3FileSystem(**s3_options, skip_instance_cache=True).put(
        str(tmp_path / "local"), "demos/validation-run-1", recursive=True
    )
    url = "s3://demos/validation-run-1"
    credentials = json.dumps({k: v for k, v in s3_options.items() if k != "endpoint_url"})
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    assert cli(capsys, "verify", url, "--storage-options", credentials, *endpoint) == (0, f"{url}: consistent\n")
    status, out = cli(capsys, "info", url, "--json", "--storage-options", json.dumps(s3_options))
    assert status == 0 and json.loads(out)["episodes"] == 3
    status, out = cli(
        capsys, "convert", url, str(tmp_path / "copy"), "--quiet", "--storage-options", credentials, *endpoint
    )
    assert status == 0 and "copied 3 episodes" in out
    status, out = cli(
        capsys, "convert", str(tmp_path / "copy"), "s3://demos/validation-run-2", "--quiet",
        "--dst-storage-options", credentials, "--dst-endpoint-url", s3_options["endpoint_url"],
    )  # fmt: skip
    assert status == 0 and info("s3://demos/validation-run-2", s3_options)["timesteps"] == sum(LENGTHS)
    # --anon sends unsigned requests, which this moto bucket refuses: a message, not a traceback
    with pytest.raises(SystemExit) as exit_:
        main(["info", url, "--anon", *endpoint])
    assert exit_.value.code == 2 and "anon=True" in capsys.readouterr().err


def test_the_store_flags_merge_into_the_json_options():
    from replaybuf.cli import build_parser, store_options

    args = build_parser().parse_args(
        [
            "view",
            "s3://b/x",
            "--storage-options",
            '{"anon": false, "key": "k"}',
            "--anon",
            "--endpoint-url",
            "http://h:1",
        ]
    )
    assert store_options(args) == {"anon": True, "key": "k", "endpoint_url": "http://h:1"}
    assert store_options(build_parser().parse_args(["info", "/tmp/x"])) is None


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_dtype_of_the_other_byte_order_is_refused_before_anything_is_made(tmp_path, backend):
    """'>f4' was taken, and every backend stored float32 and then refused to reopen the buffer it
    made (BufferDamagedError): the episodes committed to it could not be read again."""
    with pytest.raises(TypeError, match=r"field 'x': dtype '>f4' is not in this machine's byte order; use 'float32'"):
        ReplayBuffer(tmp_path / "buf", max_episodes=2, max_timesteps=3, fields={"x": ">f4"}, backend=backend)
    assert not (tmp_path / "buf").exists()
    with ReplayBuffer(
        tmp_path / "buf", max_episodes=2, max_timesteps=3, fields={"x": "float32"}, backend=backend
    ) as buffer:
        buffer.store_episode(x=np.arange(3, dtype=">f4"))  # values of either order are converted
    np.testing.assert_array_equal(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True).data["x"][0], [0, 1, 2])
