"""Importers and exporters attacked as a user and an attacker would: values a format cannot hold,
parts of a source an import left out without a word, exports that could not be read back,
sizes no import can read, and an import killed at a random moment."""

from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr

from replaybuf import ReplayBuffer, StorageError, convert
from replaybuf import importers as imp

from ._backends import require, tmpfs
from ._lerobot_fixture import write_lerobot
from .test_importers import (
    _flip_bytes,
    assert_same,
    cartpole_dataset,
    episodes_by_source,
    write_diffusion_policy,
    write_robomimic,
)

pytest_plugins = ["tests._servers"]  # fixtures: s3_server (moto's S3 on 127.0.0.1)


# ---- LeRobot: a data file's values against the features info.json declares ---------------------


def _lerobot_with_column(root, feature: str, dtype: str, values) -> None:
    """The fixture dataset with one more feature: declared ``dtype``, its column holding ``values``
    (one per frame, 15 frames) as they are, whatever their type."""
    pa = require("pyarrow")
    import pyarrow.parquet as pq

    write_lerobot(root, video=False)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"][feature] = {"dtype": dtype, "shape": [1], "names": None}
    info_path.write_text(json.dumps(info))
    data = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data)
    pq.write_table(table.append_column(feature, pa.array(values)), data)


@pytest.mark.parametrize(
    ("dtype", "values", "message"),
    [
        ("float32", [None] + [0.5] * 14, r"column 'observation\.x': frame 0 holds an empty value"),
        ("int64", [1, 2, None] + [0] * 12, r"column 'observation\.x': frame 2 holds an empty value"),
        ("int64", [0.5] * 15, r"column 'observation\.x' of type double: Float value 0\.5.* truncated.*dtype is int64"),
        ("uint8", list(range(250, 265)), r"column 'observation\.x' of type int64: Integer value 256 not in range"),
        ("float32", [1.0, 1e300] + [0.0] * 13, r"column 'observation\.x': frame 1 holds 1e\+300, out of the range"),
        ("bool", [0, 1, 2] + [0] * 12, r"column 'observation\.x': frame 2 holds 2, not a flag \(0 or 1\)"),
        ("bool", [1.0, float("nan")] + [0.0] * 13, r"column 'observation\.x': frame 1 holds nan, not a flag"),
    ],
    ids=["null-float", "null-int", "fraction-in-int", "uint8-overflow", "float32-overflow", "2-in-bool", "nan-in-bool"],
)
def test_lerobot_values_the_feature_cannot_hold_are_refused_not_changed(tmp_path, dtype, values, message):
    """They were stored changed without a word: an empty value as NaN (or -2**63 in an int64
    feature), 0.5 as 0, 256 as 0 in uint8, 1e300 as inf in float32, 2 and NaN as true in bool."""
    _lerobot_with_column(tmp_path / "src", "observation.x", dtype, values)
    with pytest.raises(imp.ImportSourceError, match=rf"file-000\.parquet: episode \d: {message}"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)


def test_lerobot_values_that_fit_the_feature_dtype_are_kept(tmp_path):
    """The checks refuse values changed by the cast, not casts: integral floats into int64, NaN."""
    values = [float(i) for i in range(15)]
    _lerobot_with_column(tmp_path / "src", "observation.x", "int64", values)
    imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    steps = np.concatenate([episode["observation_x"] for episode in episodes_by_source(tmp_path / "dst").values()])
    np.testing.assert_array_equal(steps, np.arange(15))
    _lerobot_with_column(tmp_path / "nan", "observation.x", "float32", [float("nan")] * 15)
    imp.lerobot(tmp_path / "nan", tmp_path / "nan-dst", progress=False)
    assert all(
        np.isnan(episode["observation_x"]).all() for episode in episodes_by_source(tmp_path / "nan-dst").values()
    )


def test_lerobot_feature_without_a_column_names_it(tmp_path):
    """Arrow's 'No match for FieldRef.Nested(...)' and the file's whole schema said which column only in passing."""
    write_lerobot(tmp_path / "src", video=False)
    info_path = tmp_path / "src" / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.gone"] = {"dtype": "float32", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info))
    with pytest.raises(
        imp.ImportSourceError,
        match=r"file-000\.parquet: episode 0: cannot read its frames: it has no columns \['observation\.gone'\]; "
        r"expected one per feature of meta/info\.json",
    ):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


# ---- LeRobot export: frames PNG cannot hold as they are -------------------------------------------

FRAME_SHAPES = {"rgba": (8, 8, 4), "two_channels": (8, 6, 2), "chw": (3, 8, 8), "plain": (8, 8), "gray": (8, 8, 1)}


def test_lerobot_export_round_trips_frames_of_any_layout(tmp_path):
    """(C, H, W), (H, W), 2- and 4-channel uint8 fields were written as PNG images: the export
    failed in PIL ('Cannot handle this data type', naming no field) or wrote images that read back
    with another shape. Only (H, W, 1) and (H, W, 3) are images now, the others arrays."""
    require("pyarrow")
    rng = np.random.default_rng(0)
    fields = {name: {"dtype": "uint8", "shape": shape} for name, shape in FRAME_SHAPES.items()}
    fields["state"] = {"dtype": "float16", "shape": (2,)}
    written = {}
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=3, max_timesteps=5, fields=fields) as buffer:
        for episode, length in enumerate((3, 5)):
            values = {
                name: rng.integers(0, 256, (length, *spec["shape"])).astype(spec["dtype"])
                for name, spec in fields.items()
            }
            buffer.store_episode(**values)
            written[episode] = values
    assert imp.export_lerobot(tmp_path / "buf", tmp_path / "out") == 2
    features = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())["features"]
    assert features["gray"]["dtype"] == "image" and features["rgba"]["dtype"] == "uint8"
    imp.lerobot(tmp_path / "out", tmp_path / "back", verify=True, progress=False)
    assert_same(episodes_by_source(tmp_path / "back"), written)


# ---- robomimic and diffusion_policy: parts of the source left out without a word ------------------


def test_robomimic_groups_beside_obs_are_imported(tmp_path):
    """robomimic's action_dict (and MimicGen's nested datagen_info) were left out without a word:
    only obs and next_obs were read as groups."""
    written = write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        for n, values in written.items():
            length = len(values["actions"])
            values["action_dict_abs_pos"] = np.full((length, 3), n, np.float32)
            values["datagen_info_object_poses_cube"] = np.full((length, 4, 4), -n, np.float64)
            f.create_dataset(f"data/demo_{n}/action_dict/abs_pos", data=values["action_dict_abs_pos"])
            f.create_dataset(
                f"data/demo_{n}/datagen_info/object_poses/cube", data=values["datagen_info_object_poses_cube"]
            )
    imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", verify=True, progress=False)
    assert_same(episodes_by_source(tmp_path / "dst"), written)
    fields = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs["robomimic"]["fields"]
    assert fields["datagen_info_object_poses_cube"] == "datagen_info/object_poses/cube"


def test_robomimic_entries_under_data_that_are_not_demos_are_refused(tmp_path):
    """demo_1a, Demo_2 or a dataset under data/ were skipped without a word."""
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f["data/demo_1a"] = f["data/demo_1"]
        f.create_dataset("data/notes", data=np.zeros(3))
    with pytest.raises(
        imp.ImportSourceError, match=r"demo\.hdf5: data/ holds \['demo_1a', 'notes'\], expected only demo_N groups"
    ):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_diffusion_policy_group_under_data_is_refused(tmp_path):
    """data/obs/pos (a group under data/) was left out without a word: only data/'s arrays were read."""
    write_diffusion_policy(tmp_path / "src.zarr", {"state": np.zeros((20, 2), np.float32)})
    zarr.open_group(str(tmp_path / "src.zarr"), mode="a").create_array("data/obs/pos", data=np.ones((20, 3)))
    with pytest.raises(
        imp.ImportSourceError, match=r"src\.zarr: data/obs is a group; expected only arrays under data/"
    ):
        imp.diffusion_policy(tmp_path / "src.zarr", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


# ---- sizes and dtypes ---------------------------------------------------------------------------


def test_an_episode_too_large_to_read_at_once_names_it_and_what_to_do(tmp_path):
    """One D4RL episode of 10**6 image steps (no terminal in the file) was refused with 'lower
    max_timesteps', an option an import has not: it reads one episode whole."""
    h5py = require("h5py")
    with h5py.File(tmp_path / "big.hdf5", "w") as f:  # chunked and never written: a few KiB on disk
        f.create_dataset("observations", shape=(10**6, 84, 84, 3), dtype=np.uint8, chunks=(64, 84, 84, 3))
        f.create_dataset("terminals", data=np.zeros(10**6, bool))
    with pytest.raises(imp.ImportSourceError) as caught:
        imp.d4rl(tmp_path / "big.hdf5", tmp_path / "dst", progress=False)
    message = str(caught.value)
    assert "big.hdf5: no buffer can hold this dataset: episode 0 has 1000000 steps of field 'observations'" in message
    assert "21168 bytes each: 20 GiB per episode" in message and "max_timesteps" not in message
    assert message.endswith("split it into episodes of at most 811596 steps in the source")
    assert not (tmp_path / "dst").exists()


ROUND_TRIP_DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint64",
    "bool",
]


def _values(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values spanning ``dtype``: its extremes, and NaN and infinities for floats."""
    if dtype == "bool":
        return rng.random(shape) > 0.5
    kind = np.dtype(dtype)
    if kind.kind == "f":
        values = rng.normal(size=shape).astype(dtype)
        values.flat[:4] = [np.nan, np.inf, -np.inf, np.finfo(kind).max]
        return values
    info = np.iinfo(kind)
    values = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    values.flat[:2] = [info.min, info.max]
    return values


@pytest.mark.parametrize("format", ["diffusion_policy", "lerobot"])
def test_import_export_import_is_exact_for_every_dtype(tmp_path, format):
    if format == "lerobot":
        require("pyarrow")
    rng = np.random.default_rng(3)
    fields = {f"observation_{dtype}": {"dtype": dtype, "shape": (2, 3)} for dtype in ROUND_TRIP_DTYPES}
    written = {}
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=4, max_timesteps=7, fields=fields) as buffer:
        for episode, length in enumerate((7, 1, 4)):
            values = {name: _values(spec["dtype"], (length, *spec["shape"]), rng) for name, spec in fields.items()}
            buffer.store_episode(**values)
            written[episode] = values
    imp.export(format, tmp_path / "buf", tmp_path / "out")
    imp.load(format, tmp_path / "out", tmp_path / "back", verify=True, progress=False)
    back = episodes_by_source(tmp_path / "back")
    for episode, values in written.items():
        for name, expected in values.items():
            assert back[episode][name].dtype == expected.dtype, name
            np.testing.assert_array_equal(back[episode][name], expected, err_msg=f"{episode} {name}")


def test_lerobot_export_keeps_one_value_fields_apart_from_scalars(tmp_path):
    """A (1,) field (diffusion_policy's (T, 1) arrays) came back from a LeRobot round trip as a
    scalar field, and was written as a list column, which LeRobot's reader (a value per frame for
    shape [1]) cannot cast. Both are one value per frame now, and the (1,) shape comes back."""
    require("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields = {"reward": {"dtype": "float32", "shape": ()}, "gripper": {"dtype": "uint16", "shape": (1,)}}
    written = {}
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=2, max_timesteps=3, fields=fields) as buffer:
        for episode, length in enumerate((3, 1)):
            values = {
                "reward": np.arange(length, dtype=np.float32) + episode,
                "gripper": np.arange(length, dtype=np.uint16).reshape(length, 1) + 7,
            }
            buffer.store_episode(**values)
            written[episode] = values
    imp.export_lerobot(tmp_path / "buf", tmp_path / "out")
    schema = pq.read_schema(tmp_path / "out" / "data" / "chunk-000" / "file-000.parquet")
    assert (schema.field("reward").type, schema.field("gripper").type) == (pa.float32(), pa.uint16())
    features = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())["features"]
    assert features["reward"]["shape"] == features["gripper"]["shape"] == [1]
    imp.lerobot(tmp_path / "out", tmp_path / "back", verify=True, progress=False)
    back = ReplayBuffer.from_folder(tmp_path / "back", read_only=True)
    assert (back.shapes["reward"], back.shapes["gripper"]) == ((), (1,))
    assert_same(episodes_by_source(tmp_path / "back"), written)


# ---- an import killed at a random moment ----------------------------------------------------------


def test_import_killed_at_a_random_moment_holds_whole_episodes_and_resumes(tmp_path):
    """SIGKILL during an import: the destination is absent or opens with whole source episodes
    only, and the same command run again completes it, equal to the source."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 40, 150)
    ends = np.cumsum(lengths)
    arrays = {
        "img": rng.integers(0, 256, (int(ends[-1]), 16, 16, 3), dtype=np.uint8),
        "state": rng.normal(size=(int(ends[-1]), 4)).astype(np.float32),
    }
    write_diffusion_policy(tmp_path / "src.zarr", arrays, ends=ends)
    starts = np.concatenate([[0], ends[:-1]])
    expected = {e: {k: v[starts[e] : ends[e]] for k, v in arrays.items()} for e in range(len(ends))}
    code = (
        "from replaybuf import importers; "
        f"importers.diffusion_policy({str(tmp_path / 'src.zarr')!r}, {str(tmp_path / 'dst')!r}, progress=False)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    time.sleep(random.uniform(1.0, 3.0))  # anywhere from before the first episode to after the last
    child.send_signal(signal.SIGKILL)
    child.wait()
    if (tmp_path / "dst").exists():
        held = episodes_by_source(tmp_path / "dst")
        assert_same(held, {episode: expected[episode] for episode in held})
    result = imp.diffusion_policy(tmp_path / "src.zarr", tmp_path / "dst", verify=True, progress=False)
    assert result.imported + result.skipped == len(ends)
    assert_same(episodes_by_source(tmp_path / "dst"), expected)


# ---- resuming into a destination sized for another dataset ----------------------------------------


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_resume_from_a_source_that_gained_an_episode_says_what_differs(tmp_path, backend):
    """The buffer's own message ('pass overwrite=True ... or ReplayBuffer.from_folder') named
    options an import has not; the destination is left as it was."""
    arrays = {"state": np.arange(30, dtype=np.float32)}
    write_diffusion_policy(tmp_path / "src.zarr", {"state": arrays["state"][:20]}, ends=(5, 20))
    imp.diffusion_policy(tmp_path / "src.zarr", tmp_path / "dst", backend=backend, progress=False)
    before = episodes_by_source(tmp_path / "dst")
    write_diffusion_policy(tmp_path / "src.zarr", arrays, ends=(5, 20, 30))
    with pytest.raises(ValueError) as caught:
        imp.diffusion_policy(tmp_path / "src.zarr", tmp_path / "dst", backend=backend, progress=False)
    message = str(caught.value)
    assert "dst: holds a buffer of another config than importing" in message
    assert "max_episodes: stored 2 vs needed 3" in message and message.endswith("import into a new destination")
    assert "overwrite" not in message
    assert_same(episodes_by_source(tmp_path / "dst"), before)


# ---- a destination the disk cannot hold -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_destination_the_disk_cannot_hold_says_how_it_was_sized_and_leaves_nothing(tmp_path, backend):
    """Three 1-step episodes beside one of 1000 make four slots of 1000 steps: two 4 MB fields
    on a 6 MB disk. The error said 'No space left on device' alone, and the memmap field
    allocated before the one that failed was left behind (4 MB of a half buffer)."""
    if backend == "hdf5":
        require("h5py")
    arrays = {name: np.ones((1003, 250), np.float32) for name in ("a", "b")}
    write_diffusion_policy(tmp_path / "src.zarr", arrays, ends=(1, 2, 3, 1003))
    (tmp_path / "disk").mkdir()
    with tmpfs(tmp_path / "disk", "6m") as disk:
        with pytest.raises(StorageError) as caught:
            imp.diffusion_policy(tmp_path / "src.zarr", disk / "dst", backend=backend, progress=False)
        # refused before anything is written (the create checks the space its arrays reserve)
        assert re.search(r"reserves [\d,]+ bytes of disk up front .* file system has [\d,]+ free", str(caught.value))
        assert str(caught.value).endswith(
            "the destination holds 4 episodes of up to 1000 steps (one slot per source episode, each as long as "
            "the longest, episode 3; the source has 1003 steps in all): the memmap and hdf5 backends reserve all "
            "of it on disk, the zarr backend (the default) stores only the steps written"
        )
        left = [os.path.join(d, f) for d, _, fs in os.walk(disk) for f in fs]
        assert not left, left
        imp.diffusion_policy(tmp_path / "src.zarr", disk / "dst", progress=False)  # zarr: what is written
        assert_same(
            episodes_by_source(disk / "dst"),
            {e: {k: v[a:b] for k, v in arrays.items()} for e, (a, b) in enumerate([(0, 1), (1, 2), (2, 3), (3, 1003)])},
        )


def test_minari_import_by_id_into_the_dataset_folder_is_refused(tmp_path, monkeypatch):
    """The source-and-destination check ran only for a source given as a path: an id's dataset
    folder under MINARI_DATASETS_PATH took a buffer inside its data/."""
    cartpole_dataset(tmp_path, monkeypatch, "cartpole/apart-v0", 2)
    folder = tmp_path / "minari" / "cartpole" / "apart-v0"
    before = sorted(p.name for p in folder.rglob("*"))
    with pytest.raises(ValueError, match=r"import: the destination .*apart-v0/data/buf' is inside the source"):
        imp.minari("cartpole/apart-v0", folder / "data" / "buf", progress=False)
    assert sorted(p.name for p in folder.rglob("*")) == before


@pytest.mark.parametrize("tasks_column", [True, False], ids=["episodes-file-says", "data-file-says"])
def test_lerobot_episode_with_more_than_one_task_is_refused(tmp_path, tasks_column):
    """An episode whose frames change task (LeRobot takes a task per frame) was stored with its
    first frame's task_index alone: which frames had which task was lost without a word."""
    pa = require("pyarrow")
    import pyarrow.parquet as pq

    write_lerobot(tmp_path / "src", video=False)
    data = tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data)
    tasks = table.column("task_index").to_numpy().copy()
    episode = table.column("episode_index").to_numpy()
    tasks[np.flatnonzero(episode == 1)[2:]] = 0  # episode 1 (task 1) does task 0 from its third frame on
    pq.write_table(table.set_column(table.column_names.index("task_index"), "task_index", pa.array(tasks)), data)
    episodes = tmp_path / "src" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    rows = pq.read_table(episodes)
    if tasks_column:
        names = rows.column("tasks").to_pylist()
        names[1] = ["place", "pick"]
        rows = rows.set_column(rows.column_names.index("tasks"), "tasks", pa.array(names))
        message = r"file-000\.parquet: episodes \[1\] have more than one task; a buffer keeps one task_index"
    else:
        rows = rows.drop_columns(["tasks"])
        message = r"file-000\.parquet: episode 1: its frames have task_index \[0, 1\]; a buffer keeps one task_index"
    pq.write_table(rows, episodes)
    with pytest.raises(imp.ImportSourceError, match=message):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    held = sorted(episodes_by_source(tmp_path / "dst")) if (tmp_path / "dst").exists() else []
    assert held == ([] if tasks_column else [0])


def test_diffusion_policy_export_chunks_hold_about_2_mb_of_large_frames(tmp_path):
    """1024-step chunks whatever the frame size: 320 x 240 frames made 236 MB chunks, each
    rewritten whole for every episode written into it (61 s and 1.9 GB of RAM to export 230 MB)."""
    rng = np.random.default_rng(5)
    written = {}
    fields = {"img": {"dtype": "uint8", "shape": (128, 128, 3)}, "state": {"dtype": "float32", "shape": (2,)}}
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=2, max_timesteps=60, fields=fields) as buffer:
        for episode in range(2):
            values = {
                "img": rng.integers(0, 256, (60, 128, 128, 3), dtype=np.uint8),
                "state": rng.normal(size=(60, 2)).astype(np.float32),
            }
            buffer.store_episode(**values)
            written[episode] = values
    imp.export_diffusion_policy(tmp_path / "buf", tmp_path / "out.zarr")
    root = zarr.open_group(str(tmp_path / "out.zarr"), mode="r")
    assert root["data/img"].chunks == (2 * 2**20 // (128 * 128 * 3), 128, 128, 3)  # 42 frames
    assert root["data/state"].chunks == (120, 2)  # small steps: every step in one chunk, as before
    imp.diffusion_policy(tmp_path / "out.zarr", tmp_path / "back", verify=True, progress=False)
    assert_same(episodes_by_source(tmp_path / "back"), written)


@pytest.mark.parametrize("format", ["diffusion_policy", "lerobot"])
def test_failed_export_removes_the_parent_folders_it_made(tmp_path, format):
    """A failed export into new/deeper/out removed out and left new/deeper behind (empty)."""
    from replaybuf import CorruptChunkError

    with ReplayBuffer(tmp_path / "buf", max_episodes=2, max_timesteps=10, fields={"x": ("float32", (3,))}) as buffer:
        for episode in range(2):
            buffer.store_episode(x=np.full((10, 3), episode + 1, np.float32))
    _flip_bytes(tmp_path / "buf" / "data" / "x" / "c.0.0.0")
    (tmp_path / "keep").mkdir()
    with pytest.raises(CorruptChunkError):
        imp.export(format, tmp_path / "buf", tmp_path / "keep" / "new" / "deeper" / "out")
    assert list((tmp_path / "keep").iterdir()) == []  # the folder that was there stays


def test_d4rl_datasets_that_are_no_field_are_listed(tmp_path):
    """D4RL's metadata/ (the policy's weights, the algorithm's name), a 0-d dataset or a group
    under infos/ were left out without a word."""
    h5py = require("h5py")
    with h5py.File(tmp_path / "d4rl.hdf5", "w") as f:
        f.create_dataset("observations", data=np.zeros((6, 2), np.float32))
        f.create_dataset("terminals", data=np.arange(6) == 2)
        f.create_dataset("infos/qpos", data=np.zeros((6, 3)))
        f.create_dataset("infos/goal/xy", data=np.zeros((6, 2)))
        f.create_dataset("infos/scale", data=2.0)
        f.create_dataset("metadata/algorithm", data="SAC")
        f.create_dataset("metadata/policy/fc0/weight", data=np.zeros((3, 3)))
    imp.d4rl(tmp_path / "d4rl.hdf5", tmp_path / "dst", progress=False)
    attrs = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs["d4rl"]
    assert sorted(attrs["source_keys"].values()) == ["infos/qpos", "observations", "terminals"]
    assert attrs["left_out"] == ["infos/goal/xy", "infos/scale", "metadata/algorithm", "metadata/policy/fc0/weight"]


def test_robomimic_demo_holding_more_rows_than_num_samples_is_not_called_truncated(tmp_path):
    """A num_samples under its datasets' rows was reported as '(truncated?)', sending the user to
    look for a cut file."""
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f["data/demo_1"].attrs["num_samples"] = 5  # its datasets hold 7 rows
    with pytest.raises(
        imp.ImportSourceError,
        match=r"data/demo_1: episode 1: field '\w+' has shape \(7, ?\d*,?\), expected \(5, ?\d*,?\) "
        r"\(more steps than the source's index gives the episode\)",
    ):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)


def _lerobot_with_images(root, images: list, channels: int = 3) -> None:
    """The fixture dataset (image mode) with the first frames of episode 0 replaced by PNGs of
    ``images`` (PIL images) and, for ``channels`` 1, the camera feature of shape (16, 16, 1)."""
    pa = require("pyarrow")
    import pyarrow.parquet as pq

    write_lerobot(root, video=False)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.images.top"]["shape"] = [16, 16, channels]
    info_path.write_text(json.dumps(info))
    data = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data)
    column = table.column_names.index("observation.images.top")
    cells = table.column(column).to_pylist()
    for frame, image in enumerate(images):
        out = io.BytesIO()
        image.save(out, format="PNG")
        cells[frame] = {"bytes": out.getvalue(), "path": None}
    pq.write_table(table.set_column(column, "observation.images.top", pa.array(cells, table.column(column).type)), data)


def _image(mode: str, values: np.ndarray):
    from PIL import Image

    image = Image.fromarray(values)  # uint16: 'I;16'; (H, W, 4): 'RGBA'
    return image.convert(mode) if mode in ("P", "LA") else image


@pytest.mark.parametrize(
    ("mode", "channels", "message"),
    [
        ("I;16", 3, r"an image of mode 'I;16': a uint8 image feature holds 8-bit channels"),
        ("RGBA", 3, r"an image of mode 'RGBA' with transparent pixels"),
        ("RGB", 1, r"an image of mode 'RGB' in colour; the feature's shape holds one channel"),
    ],
)
def test_lerobot_images_the_feature_would_change_are_refused(tmp_path, mode, channels, message):
    """PIL's convert clipped a 16-bit (depth) image to 255, dropped a transparent alpha channel,
    and read colours as their luminance for a one-channel feature, without a word."""
    rng = np.random.default_rng(5)
    values = {
        "I;16": rng.integers(0, 4000, (16, 16), dtype=np.uint16),
        "RGBA": np.dstack([rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), np.full((16, 16), 7, np.uint8)]),
        "RGB": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8),
    }[mode]
    _lerobot_with_images(tmp_path / "src", [_image(mode, values)], channels)
    with pytest.raises(imp.ImportSourceError, match=r"file-000\.parquet: episode 0: " + message):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("channels", [1, 3])
def test_lerobot_images_of_other_8_bit_modes_are_imported_as_they_are(tmp_path, channels):
    """Palette, grey, grey with an opaque alpha and grey RGB images hold the same pixels in
    either feature: they are imported exactly."""
    grey = np.random.default_rng(6).integers(0, 256, (16, 16), dtype=np.uint8)
    images = [_image(mode, grey) for mode in ("L", "LA", "P")] + [_image("RGB", np.dstack([grey] * 3))]
    _lerobot_with_images(tmp_path / "src", images, channels)
    imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    frames = episodes_by_source(tmp_path / "dst")[0]["observation_images_top"][: len(images)]
    np.testing.assert_array_equal(frames, np.broadcast_to(grey[..., None], (len(images), 16, 16, channels)))


def test_lerobot_columns_no_field_holds_are_listed(tmp_path):
    """A data file's column that info.json does not declare (or a text feature) was left out
    without a word."""
    _lerobot_with_column(tmp_path / "src", "observation.extra", "float32", [0.5] * 15)
    info_path = tmp_path / "src" / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    del info["features"]["observation.extra"]  # in the data file, not declared
    info_path.write_text(json.dumps(info))
    imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    attrs = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs["lerobot"]
    assert attrs["left_out"] == ["observation.extra"]


def test_ragged_shapes_between_episodes_are_named_not_called_truncated(tmp_path):
    """obs/eef_pos of (7, 4) in demo_1 beside (n, 3) in the others: '(truncated?)' sent the user
    looking for a cut file; the episodes before it stay, as for any source error."""
    written = write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        del f["data/demo_1/obs/eef_pos"]
        f.create_dataset("data/demo_1/obs/eef_pos", data=np.zeros((7, 4)))
    with pytest.raises(
        imp.ImportSourceError,
        match=r"data/demo_1: episode 1: field 'obs_eef_pos' has shape \(7, 4\), expected \(7, 3\) "
        r"\(another shape per step than the source declares\)",
    ):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    assert_same(episodes_by_source(tmp_path / "dst"), {0: written[0]})


@pytest.mark.parametrize("format", ["diffusion_policy", "lerobot"])
def test_export_of_a_buffer_without_episodes_is_refused(tmp_path, format):
    """It wrote a dataset of none: LeRobot's episodes file without columns (no reader opens
    it), a zarr the importers refuse ('no episodes to import')."""
    if format == "lerobot":
        require("pyarrow")
    ReplayBuffer(str(tmp_path / "buf"), max_episodes=2, max_timesteps=4, fields={"x": "float"}).close()
    with pytest.raises(ValueError, match=r"buf: the buffer holds no committed episodes; nothing to export"):
        imp.export(format, tmp_path / "buf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("feature", ["../../escaped", "..", "a/b"])
def test_lerobot_export_never_writes_outside_its_folder(tmp_path, feature):
    """A diffusion_policy zarr's root attributes become the buffer's: {"lerobot": {"fields":
    {"img": "../../escaped"}}} made a video export write videos/../../escaped/... outside the
    export's folder."""
    require("pyarrow")
    require("av")
    arrays = {"img": np.zeros((20, 16, 16, 3), np.uint8)}
    write_diffusion_policy(tmp_path / "src.zarr", arrays)
    zarr.open_group(str(tmp_path / "src.zarr"), mode="a").attrs["lerobot"] = {"fields": {"img": feature}}
    imp.diffusion_policy(tmp_path / "src.zarr", tmp_path / "buf", progress=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=r"field 'img' would be exported as feature .*, which is no folder name"):
        imp.export_lerobot(tmp_path / "buf", tmp_path / "out" / "inner" / "export", video=True)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("key", "message"),
    [("lambda", "field name 'lambda' is a Python keyword"), ("x" * 201, "is 201 bytes long")],
    ids=["keyword", "too-long"],
)
def test_source_keys_no_new_buffer_takes_name_the_source(tmp_path, key, message):
    """A key the buffer's create refuses raised its bare ValueError, naming no source file."""
    write_diffusion_policy(tmp_path / "dp.zarr", {key: np.zeros(20, np.float32)})
    with pytest.raises(imp.ImportSourceError, match=rf"dp\.zarr: no buffer can hold this dataset: .*{message}"):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_diffusion_policy_array_metadata_of_another_type_names_the_source(tmp_path):
    """meta/episode_ends/.zarray holding a JSON list: zarr's TypeError reached the user as
    'unsupported operand type(s) for |: 'list' and 'dict'', naming no file."""
    write_diffusion_policy(tmp_path / "src.zarr", {"state": np.zeros((20, 2), np.float32)})
    (tmp_path / "src.zarr" / "meta" / "episode_ends" / ".zarray").write_text("[]")
    with pytest.raises(imp.ImportSourceError, match=r"src\.zarr: not a diffusion_policy zarr \(expected data/<key>"):
        imp.diffusion_policy(tmp_path / "src.zarr", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def _external_file(tmp_path) -> str:
    """An HDF5 file outside the source, one a crafted source could link to."""
    with require("h5py").File(tmp_path / "outside.hdf5", "w") as f:
        f.create_dataset("secret", data=np.arange(7 * 2, dtype=np.float64).reshape(7, 2))
    return str(tmp_path / "outside.hdf5")


def _hdf5_source(tmp_path, format: str) -> tuple[Path, str]:
    """A robomimic or D4RL source file, and where in it a test puts a dataset of its own."""
    path = tmp_path / "src.hdf5"
    if format == "robomimic":
        write_robomimic(path)
        return path, "data/demo_1/obs/leak"
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=np.zeros((7, 2)))
        f.create_dataset("terminals", data=np.arange(7) == 3)
    return path, "infos/leak"


@pytest.mark.parametrize("format", ["robomimic", "d4rl"])
def test_hdf5_links_out_of_the_source_or_to_nothing_are_refused(tmp_path, format):
    """An external link pulled a dataset of another file of this machine into the buffer (or,
    in robomimic's groups, was skipped without a word, as was a link to nothing)."""
    h5py = require("h5py")
    outside = _external_file(tmp_path)
    path, where = _hdf5_source(tmp_path, format)
    with h5py.File(path, "a") as f:
        f[where] = h5py.ExternalLink(outside, "/secret")
    with pytest.raises(imp.ImportSourceError, match=rf"{where} is an external link to .*outside\.hdf5:/secret"):
        imp.load(format, path, tmp_path / "dst", progress=False)
    with h5py.File(path, "a") as f:
        del f[where]
        f[where] = h5py.SoftLink("/nowhere")
    with pytest.raises(imp.ImportSourceError, match=rf"{where} is a link to nothing \(/nowhere\)"):
        imp.load(format, path, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("how", ["virtual", "external storage"])
@pytest.mark.parametrize("format", ["robomimic", "d4rl"])
def test_hdf5_datasets_kept_in_other_files_are_refused(tmp_path, format, how):
    """A virtual dataset or one in HDF5 external storage read another file of this machine into
    the buffer, as an external link did (which was refused)."""
    h5py = require("h5py")
    outside = _external_file(tmp_path)
    before = open(outside, "rb").read()
    path, where = _hdf5_source(tmp_path, format)
    with h5py.File(path, "a") as f:
        if how == "virtual":
            layout = h5py.VirtualLayout((7, 2), np.float64)
            layout[:] = h5py.VirtualSource(outside, "secret", shape=(7, 2))
            f.create_virtual_dataset(where, layout)
        else:
            f.create_dataset(where, (7, 2), np.float64, external=[(outside, 0, h5py.h5f.UNLIMITED)])
    with pytest.raises(
        imp.ImportSourceError,
        match=rf"{where} keeps its data in other files \({'a virtual dataset' if how == 'virtual' else how}\)",
    ):
        imp.load(format, path, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()
    assert open(outside, "rb").read() == before


def test_minari_datasets_kept_in_other_files_are_refused(tmp_path, monkeypatch):
    """minari reads its HDF5 file through h5py, which followed an external link, a virtual dataset
    or external storage: a crafted dataset imported another file of this machine into the buffer
    (robomimic and D4RL files were refused); a dangling soft link raised minari's bare KeyError."""
    import shutil

    from ._h5outside import KINDS, replace_with_outside

    _, dataset = cartpole_dataset(tmp_path, monkeypatch, "cartpole/linked-v0", 1)
    folder = Path(dataset.storage.data_path).parent
    messages = {
        "external storage": "keeps its data in other files \\(external storage\\)",
        "virtual": "keeps its data in other files \\(a virtual dataset\\)",
        "external link": "is an external link to .*outside-external link:v",
        "soft link": "is a link to nothing \\(elsewhere/rewards\\)",
    }
    for how in KINDS:
        source = tmp_path / how
        shutil.copytree(folder, source)
        main = source / "data" / "main_data.hdf5"
        with require("h5py").File(main, "r") as file:
            shape = file["episode_0/rewards"].shape
        outside = tmp_path / f"outside-{how}"
        before = replace_with_outside(main, "episode_0/rewards", how, outside, shape, 42.0, "elsewhere/rewards")
        with pytest.raises(imp.ImportSourceError, match=f"main_data\\.hdf5: episode_0/rewards {messages[how]}"):
            imp.minari(source, tmp_path / "dst", progress=False)
        assert not (tmp_path / "dst").exists() and outside.read_bytes() == before


def test_robomimic_soft_links_inside_the_file_are_read(tmp_path):
    """A soft link to a dataset of the same file is that dataset (visiting groups skipped them)."""
    h5py = require("h5py")
    written = write_robomimic(tmp_path / "demo.hdf5")
    with h5py.File(tmp_path / "demo.hdf5", "a") as f:
        for n in written:
            f[f"data/demo_{n}/action_dict/copy"] = h5py.SoftLink(f"/data/demo_{n}/actions")
            written[n]["action_dict_copy"] = written[n]["actions"]
    imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", verify=True, progress=False)
    assert_same(episodes_by_source(tmp_path / "dst"), written)


def test_robomimic_env_args_that_are_not_utf8_are_kept_escaped(tmp_path):
    """Bytes that are not UTF-8 raised UnicodeDecodeError, naming no file."""
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f["data"].attrs["env_args"] = np.bytes_(b'\xff{"env"')
    imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    assert ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs["robomimic"]["env_args"] == '\\xff{"env"'


@pytest.mark.parametrize("format", ["diffusion_policy", "lerobot"])
def test_export_killed_at_a_random_moment_leaves_no_dataset_and_names_the_leftovers(tmp_path, format):
    """SIGKILL during an export: what it left is no dataset an import takes (its marker file is
    written last), a second export says what the folder holds rather than only that it is not
    empty, and one into a new folder completes."""
    if format == "lerobot":
        require("pyarrow")
    rng = np.random.default_rng(6)
    with ReplayBuffer(
        str(tmp_path / "buf"), max_episodes=200, max_timesteps=30, fields={"img": ("uint8", (32, 32, 3))}
    ) as buffer:
        for _ in range(200):
            buffer.store_episode(img=rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8))
    out = tmp_path / "out"
    code = f"from replaybuf import importers; importers.export({format!r}, {str(tmp_path / 'buf')!r}, {str(out)!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    time.sleep(random.uniform(1.0, 4.0))  # anywhere from before the first file to after the last
    child.send_signal(signal.SIGKILL)
    finished = child.wait() == 0
    if out.exists() and not finished:
        try:
            back = imp.load(format, out, tmp_path / "back", progress=False)
        except imp.ImportSourceError:
            pass
        else:  # killed after its marker, the export's last file, and before it exited: a whole dataset
            assert (back.imported, back.frames) == (200, 200 * 30)
            return
        if any(out.iterdir()):
            with pytest.raises(FileExistsError, match=r"out: .*; it holds \[.*\] \(an export interrupted there"):
                imp.export(format, tmp_path / "buf", out)
    assert imp.export(format, tmp_path / "buf", tmp_path / "again") == 200


def test_export_into_a_folder_that_holds_files_says_which(tmp_path):
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=1, max_timesteps=2, fields={"x": "float"}) as buffer:
        buffer.store_episode(x=np.zeros(2, np.float32))
    (tmp_path / "out" / "data").mkdir(parents=True)
    (tmp_path / "out" / ".zgroup").write_text("{}")
    with pytest.raises(
        FileExistsError, match=r"out: .* new or empty folder; it holds \['\.zgroup', 'data'\] \(an export"
    ):
        imp.export_diffusion_policy(tmp_path / "buf", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".zgroup", "data"]


@pytest.mark.parametrize("empty", ["", "file://"])
def test_export_to_an_empty_destination_is_refused_and_erases_nothing(tmp_path, monkeypatch, empty):
    """An empty destination (an unset setting) named the current folder: the diffusion_policy
    export's zarr group opened with mode "w" there erased everything in it, the buffer included."""
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=1, max_timesteps=2, fields={"x": "float"}) as buffer:
        buffer.store_episode(x=np.zeros(2, np.float32))
    (tmp_path / "mine.txt").write_text("precious")
    monkeypatch.chdir(tmp_path)
    for format in ("diffusion_policy", "lerobot"):
        with pytest.raises(ValueError, match=f"the location {empty!r} is empty: it names no folder"):
            imp.export(format, "buf", empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buf", "mine.txt"]
    assert ReplayBuffer.from_folder("buf", read_only=True).num_episodes == 1


def test_export_into_a_link_to_an_empty_folder_writes_there_and_keeps_the_link(tmp_path):
    """The diffusion_policy export opened its zarr group with mode "w", which erases the folder
    first: through a link to an empty folder that failed ("Cannot call rmtree on a symbolic link")."""
    with ReplayBuffer(str(tmp_path / "buf"), max_episodes=2, max_timesteps=3, fields={"x": "float"}) as buffer:
        buffer.store_episode(x=np.arange(3, dtype=np.float32))
    (tmp_path / "target").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "target")
    assert imp.export_diffusion_policy(tmp_path / "buf", tmp_path / "out") == 1
    assert (tmp_path / "out").is_symlink()
    imp.diffusion_policy(tmp_path / "target", tmp_path / "back", progress=False)
    np.testing.assert_array_equal(episodes_by_source(tmp_path / "back")[0]["x"], np.arange(3, dtype=np.float32))


def test_import_into_s3_resumes_and_refuses_another_config(tmp_path, s3_server):
    """The config check before a resume opens the destination a second time: on an object store
    too (moto on 127.0.0.1)."""
    arrays = {"state": np.arange(30, dtype=np.float32)}
    write_diffusion_policy(tmp_path / "src.zarr", {"state": arrays["state"][:20]}, ends=(5, 20))
    url, options = s3_server.url(f"interop-{uuid.uuid4().hex}"), s3_server.storage_options
    imp.diffusion_policy(tmp_path / "src.zarr", url, storage_options=options, progress=False)
    again = imp.diffusion_policy(tmp_path / "src.zarr", url, storage_options=options, verify=True, progress=False)
    assert (again.imported, again.skipped) == (0, 2)
    write_diffusion_policy(tmp_path / "src.zarr", arrays, ends=(5, 20, 30))
    with pytest.raises(ValueError, match=r"(?s)holds a buffer of another config .*max_episodes: stored 2 vs needed 3"):
        imp.diffusion_policy(tmp_path / "src.zarr", url, storage_options=options, progress=False)
    assert ReplayBuffer.from_folder(url, read_only=True, storage_options=options).num_episodes == 2


@pytest.mark.parametrize("value", [np.nan, 0.5, 2.0])
def test_d4rl_flags_other_than_0_or_1_are_refused(tmp_path, value):
    """A NaN (or 0.5, 2) in 'timeouts' read as True: an episode ended there without a word."""
    h5py = require("h5py")
    timeouts = np.zeros(8, np.float32)
    timeouts[[3, 7]] = 1.0
    timeouts[5] = value
    with h5py.File(tmp_path / "d4rl.hdf5", "w") as f:
        f.create_dataset("observations", data=np.zeros((8, 2), np.float32))
        f.create_dataset("terminals", data=np.zeros(8, bool))
        f.create_dataset("timeouts", data=timeouts)
    with pytest.raises(imp.ImportSourceError, match=r"d4rl\.hdf5: 'timeouts' holds .* at step 5; expected 0 or 1"):
        imp.d4rl(tmp_path / "d4rl.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda tmp: imp.diffusion_policy(["a"], tmp / "dst"),
            TypeError,
            r"import source must be a path .*list \['a'\]",
        ),
        (lambda tmp: imp.minari(3, tmp / "dst"), TypeError, r"the import source must be a path .*got int 3"),
        (lambda tmp: convert(tmp / "buf", None), TypeError, r"for source and destination, got NoneType None"),
        (
            lambda tmp: imp.export_lerobot(tmp / "buf", 5),
            TypeError,
            r"export destination must be a folder path .*int 5",
        ),
        (
            lambda tmp: imp.export_diffusion_policy(tmp / "buf", None),
            TypeError,
            r"export destination must be .*NoneType",
        ),
        (
            lambda tmp: ReplayBuffer.from_folder(None),
            TypeError,
            r"location must be a folder path or URL .*NoneType None",
        ),
        # sources are local files and exports local folders (the storage options are the other end's)
        (lambda tmp: imp.diffusion_policy("s3://bucket/pusht.zarr", tmp / "dst"), ValueError, r"import source .*local"),
        (lambda tmp: imp.lerobot("gs://bucket/lerobot/pusht", tmp / "dst"), ValueError, r"import source .*local"),
        (
            lambda tmp: imp.export_diffusion_policy(tmp / "buf", "s3://b/out.zarr"),
            ValueError,
            r"export destination .*local",
        ),
        (lambda tmp: imp.export_lerobot(tmp / "buf", "s3://bucket/out"), ValueError, r"export destination .*local"),
    ],
)
def test_a_location_that_is_no_local_path_is_named(tmp_path, call, error, message):
    """os.fspath said only "expected str, bytes or os.PathLike object, not int", naming no
    argument, and an int reached os.path.exists as a file descriptor; an s3:// source ended in
    botocore's "created in a different Context" traceback, an s3:// diffusion_policy export
    tried AWS itself, a lerobot one said "Missing bucket name"."""
    buffer = ReplayBuffer(tmp_path / "buf", max_episodes=1, max_timesteps=2, fields={"x": "float"})
    buffer.store_episode(x=np.zeros(2))
    buffer.close()
    with pytest.raises(error, match=message):
        call(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["buf"]
