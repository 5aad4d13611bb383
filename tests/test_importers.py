"""Importers and exporters (issue 17): sources made here in each library's layout, offline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from replaybuf import ReplayBuffer
from replaybuf import importers as imp
from replaybuf.cli import main
from replaybuf.video import image_fields

from ._backends import require
from ._lerobot_fixture import FPS, LENGTHS, write_lerobot

DP_ENDS = (5, 12, 20)


def dp_arrays(total: int = DP_ENDS[-1]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "img": rng.integers(0, 255, (total, 8, 8, 3), dtype=np.uint8),
        "state": rng.normal(size=(total, 2)).astype(np.float32),
        "action": rng.normal(size=(total, 2)).astype(np.float64),
    }


def write_diffusion_policy(path, arrays: dict[str, np.ndarray], ends=DP_ENDS) -> None:
    """diffusion_policy's ReplayBuffer layout, in zarr format 2 as it writes it."""
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    for name, values in arrays.items():
        root.create_array(f"data/{name}", data=values, chunks=(4, *values.shape[1:]))
    root.create_array("meta/episode_ends", data=np.asarray(ends, dtype=np.int64))


def episodes_by_source(location) -> dict[int, dict[str, np.ndarray]]:
    """{source_episode: {field: committed steps}} of a buffer."""
    buffer = ReplayBuffer.from_folder(location, read_only=True)
    out = {}
    for slot in buffer.valid_episodes():
        length = int(buffer.episode_lens[slot])
        out[int(buffer.meta_data["source_episode"][slot])] = {
            name: buffer.data[name][slot, :length] for name in buffer.fieldnames
        }
    return out


def assert_same(a: dict[int, dict[str, np.ndarray]], b: dict[int, dict[str, np.ndarray]]) -> None:
    assert a.keys() == b.keys()
    for episode in a:
        assert a[episode].keys() == b[episode].keys()
        for name in a[episode]:
            np.testing.assert_array_equal(a[episode][name], b[episode][name], err_msg=f"{episode} {name}")


# ---- diffusion_policy ------------------------------------------------------------------------


def test_diffusion_policy_import_splits_episodes_and_sizes_buffer(tmp_path):
    arrays = dp_arrays()
    write_diffusion_policy(tmp_path / "dp.zarr", arrays)
    result = imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", verify=True, progress=False)
    assert result == imp.ImportResult(imported=3, skipped=0, frames=20)

    buffer = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True)
    assert (buffer.max_episodes, buffer.max_timesteps) == (3, 8)
    assert buffer.dtypes["action"] == np.float64 and buffer.shapes["img"] == (8, 8, 3)
    assert image_fields(buffer) == ["img"]
    starts = (0, *DP_ENDS[:-1])
    expected = {i: {k: v[s:e] for k, v in arrays.items()} for i, (s, e) in enumerate(zip(starts, DP_ENDS))}
    assert_same(episodes_by_source(tmp_path / "dst"), expected)


def test_truncated_source_names_file_and_episode_keeps_committed_then_resumes(tmp_path):
    arrays = dp_arrays()
    write_diffusion_policy(tmp_path / "dp.zarr", {k: v[:15] for k, v in arrays.items()})  # episode 2 cut short
    with pytest.raises(imp.ImportSourceError, match=r"dp\.zarr: episode 2: .*data/\w+ has 15 steps"):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False)
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0, 1]

    write_diffusion_policy(tmp_path / "dp.zarr", arrays)  # the whole source again: only episode 2 is new
    result = imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", verify=True, progress=False)
    assert result == imp.ImportResult(imported=1, skipped=2, frames=8)
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0, 1, 2]
    np.testing.assert_array_equal(episodes_by_source(tmp_path / "dst")[2]["state"], arrays["state"][12:20])


def test_a_source_moved_since_resumes(tmp_path):
    """The resume check compares the episodes, not the path: the same dataset moved resumes."""
    arrays = dp_arrays()
    write_diffusion_policy(tmp_path / "dp.zarr", {k: v[:15] for k, v in arrays.items()})  # episode 2 cut short
    with pytest.raises(imp.ImportSourceError, match="episode 2"):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False)
    write_diffusion_policy(tmp_path / "moved.zarr", arrays)
    result = imp.diffusion_policy(tmp_path / "moved.zarr", tmp_path / "dst", verify=True, progress=False)
    assert result == imp.ImportResult(imported=1, skipped=2, frames=8)
    np.testing.assert_array_equal(episodes_by_source(tmp_path / "dst")[2]["state"], arrays["state"][12:20])


def test_resume_into_a_buffer_of_another_schema_is_refused(tmp_path):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    ReplayBuffer(tmp_path / "dst", max_episodes=3, max_timesteps=8, fields={"x": "float"}).close()
    with pytest.raises(ValueError, match="dst"):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False)
    assert ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).fieldnames == {"x"}


def test_not_a_diffusion_policy_zarr(tmp_path):
    zarr.open_group(str(tmp_path / "empty.zarr"), mode="w", zarr_format=2)
    with pytest.raises(imp.ImportSourceError, match=r"empty\.zarr: not a diffusion_policy zarr"):
        imp.diffusion_policy(tmp_path / "empty.zarr", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "arrays, message",
    [
        (["data", "meta/episode_ends"], "data is a Array"),
        (["data/state", "meta/episode_ends/x"], "meta/episode_ends a Group"),
    ],
)
def test_diffusion_policy_zarr_with_an_array_where_a_group_belongs(tmp_path, arrays, message):
    root = zarr.open_group(str(tmp_path / "bad.zarr"), mode="w", zarr_format=2)
    for path in arrays:
        root.create_array(path, data=np.arange(1, 5))
    with pytest.raises(imp.ImportSourceError, match=rf"bad\.zarr: not a diffusion_policy zarr.*{message}"):
        imp.diffusion_policy(tmp_path / "bad.zarr", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("ends", [np.array([[5, 12, 20]]), np.array([5.5, 20.0])], ids=["2-d", "float"])
def test_diffusion_policy_episode_ends_of_another_shape_or_dtype_are_named(tmp_path, ends):
    """2-d ends raised a bare numpy 'truth value of an array' error; float ends were truncated."""
    root = zarr.open_group(str(tmp_path / "bad.zarr"), mode="w", zarr_format=2)
    root.create_array("data/state", data=np.zeros((20, 2), np.float32))
    root.create_array("meta/episode_ends", data=ends)
    with pytest.raises(imp.ImportSourceError, match=r"bad\.zarr/meta/episode_ends: expected a 1-d array of integer"):
        imp.diffusion_policy(tmp_path / "bad.zarr", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_diffusion_policy_round_trip_is_exact(tmp_path):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "a", progress=False)
    assert imp.export("diffusion_policy", tmp_path / "a", tmp_path / "out.zarr") == 3
    exported = zarr.open_group(str(tmp_path / "out.zarr"), mode="r")
    assert exported.metadata.zarr_format == 2
    np.testing.assert_array_equal(exported["meta/episode_ends"][:], DP_ENDS)
    imp.diffusion_policy(tmp_path / "out.zarr", tmp_path / "b", verify=True, progress=False)
    assert_same(episodes_by_source(tmp_path / "a"), episodes_by_source(tmp_path / "b"))


def test_diffusion_policy_carries_buffer_attrs_through_the_zarr_attributes(tmp_path):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    zarr.open_group(str(tmp_path / "dp.zarr"), mode="a").attrs["robot"] = "pusht"
    imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "a", progress=False)
    with ReplayBuffer.from_folder(tmp_path / "a") as buffer:
        assert buffer.attrs["robot"] == "pusht"
        assert buffer.attrs["imported_from"] == {"format": "diffusion_policy", "path": str(tmp_path / "dp.zarr")}
        buffer.attrs.update(fps=10, lerobot={"tasks": {"0": "push the T"}})
    imp.export("diffusion_policy", tmp_path / "a", tmp_path / "out.zarr")
    exported = dict(zarr.open_group(str(tmp_path / "out.zarr"), mode="r").attrs)
    assert exported["fps"] == 10 and exported["lerobot"] == {"tasks": {"0": "push the T"}}
    imp.diffusion_policy(tmp_path / "out.zarr", tmp_path / "b", progress=False)
    again = dict(ReplayBuffer.from_folder(tmp_path / "b", read_only=True).attrs)
    assert again == {**exported, "imported_from": {"format": "diffusion_policy", "path": str(tmp_path / "out.zarr")}}


@pytest.mark.parametrize("format", ["diffusion_policy", "lerobot"])
def test_export_never_overwrites(tmp_path, format):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "a", progress=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="out: the export destination must be a new or empty folder"):
        imp.export(format, tmp_path / "a", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]
    before = sorted(p.name for p in (tmp_path / "a").rglob("*"))
    with pytest.raises(ValueError, match="the export destination is inside the source buffer"):
        imp.export(format, tmp_path / "a", tmp_path / "a" / "out")
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == before


# ---- robomimic and D4RL -------------------------------------------------------------------------


def write_robomimic(path, lengths=(4, 7, 3), truncate: int | None = None) -> dict[int, dict[str, np.ndarray]]:
    """robomimic's layout: data/demo_N/{obs/*, next_obs/*, actions, rewards, dones, states}."""
    rng = np.random.default_rng(1)
    written = {}
    with require("h5py").File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["env_args"] = json.dumps({"env_name": "Lift", "type": 1})
        for n, length in enumerate(lengths):
            demo = data.create_group(f"demo_{n}")
            demo.attrs["num_samples"] = length
            values = {
                "obs_eef_pos": rng.normal(size=(length, 3)),
                "obs_agentview_image": rng.integers(0, 255, (length, 8, 8, 3), dtype=np.uint8),
                "next_obs_eef_pos": rng.normal(size=(length, 3)),
                "actions": rng.normal(size=(length, 7)),
                "rewards": rng.normal(size=length),
                "dones": (np.arange(length) == length - 1).astype(np.int64),
                "states": rng.normal(size=(length, 5)),
            }
            for name, value in values.items():
                key = name.replace("next_obs_", "next_obs/").replace("obs_", "obs/") if "obs" in name else name
                stored = value[: length - 2] if truncate == n and name == "actions" else value
                demo.create_dataset(key, data=stored)
            written[n] = values
    return written


def test_robomimic_import(tmp_path):
    written = write_robomimic(tmp_path / "demo.hdf5")
    result = imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", verify=True, progress=False)
    assert result.imported == 3 and result.frames == 14
    buffer = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True)
    assert (buffer.max_episodes, buffer.max_timesteps) == (3, 7)
    assert image_fields(buffer) == ["obs_agentview_image"]
    assert_same(episodes_by_source(tmp_path / "dst"), written)
    assert imp.FORMATS["robomimic"](tmp_path / "demo.hdf5").env_args == {"env_name": "Lift", "type": 1}
    attrs = buffer.attrs["robomimic"]
    assert attrs["env_args"] == {"env_name": "Lift", "type": 1}
    assert attrs["fields"]["obs_eef_pos"] == "obs/eef_pos" and attrs["fields"]["actions"] == "actions"


@pytest.mark.parametrize("env_args", ['{"env_name": "Lift", "gain": NaN}', "not json"])
def test_robomimic_env_args_that_are_not_plain_json_are_kept_as_text(tmp_path, env_args):
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f["data"].attrs["env_args"] = env_args
    imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    buffer = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True)
    assert buffer.attrs["robomimic"]["env_args"] == env_args and buffer.num_episodes == 3


def test_robomimic_truncated_demo_names_the_demo(tmp_path):
    write_robomimic(tmp_path / "demo.hdf5", truncate=1)
    with pytest.raises(imp.ImportSourceError, match=r"demo\.hdf5:data/demo_1: episode 1: field 'actions'"):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0]


def test_robomimic_dataset_only_some_demos_hold_is_named_not_dropped(tmp_path):
    """Fields came from demo_0 alone: the obs of every later demo were dropped without a word."""
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        del f["data/demo_0/obs/eef_pos"]
    with pytest.raises(imp.ImportSourceError, match=r"data/demo_0: episode 0: dataset 'obs/eef_pos' is missing"):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_d4rl_array_with_more_rows_than_steps_is_refused(tmp_path):
    """Its rows past the last observation were dropped without a word."""
    with require("h5py").File(tmp_path / "d4rl.hdf5", "w") as f:
        f.create_dataset("observations", data=np.zeros((6, 2), np.float32))
        f.create_dataset("actions", data=np.zeros((9, 2), np.float32))
        f.create_dataset("terminals", data=np.arange(6) == 2)
    with pytest.raises(imp.ImportSourceError, match=r"d4rl\.hdf5: \{'actions': 9\} have more rows than the 6 steps"):
        imp.d4rl(tmp_path / "d4rl.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_d4rl_splits_at_terminals_and_timeouts(tmp_path):
    rng = np.random.default_rng(2)
    steps = 12
    terminals = np.zeros(steps, bool)
    timeouts = np.zeros(steps, bool)
    terminals[3], timeouts[7] = True, True  # episodes 0..3, 4..7, and 8..11 cut by the dataset's end
    values = {
        "observations": rng.normal(size=(steps, 4)).astype(np.float32),
        "actions": rng.normal(size=(steps, 2)).astype(np.float32),
        "rewards": rng.normal(size=steps).astype(np.float32),
        "terminals": terminals,
        "timeouts": timeouts,
    }
    with require("h5py").File(tmp_path / "d4rl.hdf5", "w") as f:
        for name, value in values.items():
            f.create_dataset(name, data=value)
        f.create_dataset("infos/qpos", data=np.arange(steps * 2.0).reshape(steps, 2))
        f.attrs.update(env_name="hopper-medium-v2", max_steps=np.int64(1000), bounds=np.array([0.5, np.inf]))
    values["infos_qpos"] = np.arange(steps * 2.0).reshape(steps, 2)
    assert imp.load("d4rl", tmp_path / "d4rl.hdf5", tmp_path / "dst", verify=True, progress=False).imported == 3
    bounds = [(0, 4), (4, 8), (8, 12)]
    expected = {i: {k: v[a:b] for k, v in values.items()} for i, (a, b) in enumerate(bounds)}
    assert_same(episodes_by_source(tmp_path / "dst"), expected)
    attrs = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs["d4rl"]
    assert attrs["source_keys"]["infos_qpos"] == "infos/qpos" and attrs["source_keys"]["rewards"] == "rewards"
    assert attrs["episode_ends"] == ["terminals", "timeouts"]
    # numpy attributes become plain values; an infinity JSON cannot hold is left out
    assert attrs["file_attrs"] == {"env_name": "hopper-medium-v2", "max_steps": 1000}


def test_d4rl_file_without_steps_has_no_episodes(tmp_path):
    """An empty D4RL file made one episode of 0 steps: 'max_timesteps must be a positive int'."""
    with require("h5py").File(tmp_path / "empty.hdf5", "w") as f:
        for name in ("observations", "actions", "rewards", "terminals", "timeouts"):
            f.create_dataset(name, data=np.zeros(0, np.float32))
    with pytest.raises(imp.ImportSourceError, match=r"empty\.hdf5: no episodes to import"):
        imp.d4rl(tmp_path / "empty.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_bad_hdf5_file_names_it(tmp_path):
    (tmp_path / "broken.hdf5").write_bytes(b"not hdf5 at all")
    with pytest.raises(imp.ImportSourceError, match=r"broken\.hdf5: cannot open as HDF5"):
        imp.d4rl(tmp_path / "broken.hdf5", tmp_path / "dst")


# ---- LeRobot v3 --------------------------------------------------------------------------------


def test_lerobot_image_mode_import_and_round_trip(tmp_path):
    written = write_lerobot(tmp_path / "src", video=False)
    imp.lerobot(tmp_path / "src", tmp_path / "a", verify=True, progress=False)
    buffer = ReplayBuffer.from_folder(tmp_path / "a", read_only=True)
    assert (buffer.max_episodes, buffer.max_timesteps) == (len(LENGTHS), max(LENGTHS))
    assert image_fields(buffer) == ["observation_images_top"]
    assert buffer.shapes["next_reward"] == () and buffer.dtypes["next_done"] == np.bool_
    slots = buffer.valid_episodes()
    assert buffer.meta_data["task_index"][slots].tolist() == [0, 1, 0]
    assert buffer.meta_data["fps"][slots].tolist() == [FPS] * 3
    expected = {e: {k.replace(".", "_"): v for k, v in values.items()} for e, values in written.items()}
    assert_same(episodes_by_source(tmp_path / "a"), expected)

    assert main(["export", "lerobot", str(tmp_path / "a"), str(tmp_path / "out")]) == 0
    info = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())
    assert info["fps"] == FPS and info["features"]["observation.images.top"]["dtype"] == "image"
    assert info["features"]["next.reward"]["shape"] == [1]
    imp.lerobot(tmp_path / "out", tmp_path / "b", verify=True, progress=False)
    assert_same(episodes_by_source(tmp_path / "a"), episodes_by_source(tmp_path / "b"))
    round_trip = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    assert round_trip.meta_data["task_index"][round_trip.valid_episodes()].tolist() == [0, 1, 0]


def test_lerobot_attrs_are_recorded_and_the_export_uses_them(tmp_path):
    write_lerobot(tmp_path / "src", video=False)
    source_info = json.loads((tmp_path / "src" / "meta" / "info.json").read_text())
    imp.lerobot(tmp_path / "src", tmp_path / "a", progress=False)
    attrs = dict(ReplayBuffer.from_folder(tmp_path / "a", read_only=True).attrs)
    assert attrs["fps"] == FPS
    lerobot = attrs["lerobot"]
    assert lerobot["tasks"] == {"0": "pick", "1": "place"}
    assert (lerobot["robot_type"], lerobot["codebase_version"]) == ("fixture", "v3.0")
    assert lerobot["features"] == source_info["features"]
    assert lerobot["fields"]["observation_images_top"] == "observation.images.top"
    assert lerobot["fields"]["next_done"] == "next.done"

    # a feature whose name the field-name rule cannot give back, and fps only in the attrs
    with ReplayBuffer.from_folder(tmp_path / "a") as buffer:
        buffer.attrs["lerobot"] = {**lerobot, "fields": {**lerobot["fields"], "action": "action.joints"}}
    imp.export_lerobot(tmp_path / "a", tmp_path / "out")
    import pandas as pd
    import pyarrow.parquet as pq

    info = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())
    assert info["fps"] == FPS and info["robot_type"] == "fixture"
    assert info["features"]["observation.state"]["names"] == ["x", "y", "z"]
    # the feature was renamed: the imported "action"'s names do not apply to it
    assert "action" not in info["features"] and info["features"]["action.joints"]["names"] is None
    tasks = pd.read_parquet(tmp_path / "out" / "meta" / "tasks.parquet")
    assert dict(zip(tasks.index, tasks["task_index"])) == {"pick": 0, "place": 1}
    episodes = pq.read_table(tmp_path / "out" / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert episodes.column("tasks").to_pylist() == [["pick"], ["place"], ["pick"]]
    imp.lerobot(tmp_path / "out", tmp_path / "b", progress=False)
    again = dict(ReplayBuffer.from_folder(tmp_path / "b", read_only=True).attrs)
    assert (
        again["lerobot"]["tasks"] == lerobot["tasks"] and again["lerobot"]["fields"]["action_joints"] == "action.joints"
    )


def test_lerobot_export_without_attrs_names_tasks_by_index(tmp_path):
    with ReplayBuffer(
        tmp_path / "plain",
        max_episodes=2,
        max_timesteps=3,
        fields={"action": ("float", 2)},
        meta_fields={"task_index": "int"},
    ) as buffer:
        buffer.store_episode(action=np.ones((3, 2), np.float32), task_index=4)
    imp.export_lerobot(tmp_path / "plain", tmp_path / "out")
    import pandas as pd

    info = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())
    assert info["fps"] == 30.0 and info["robot_type"] is None
    assert pd.read_parquet(tmp_path / "out" / "meta" / "tasks.parquet").index.tolist() == ["task_4"]


def test_lerobot_export_numbers_tasks_as_rows_of_the_tasks_file(tmp_path):
    """LeRobot's reader takes a frame's task as ``tasks.iloc[task_index]``: task indices with gaps
    (a buffer holding episodes of tasks 1 and 3 only) read as another task's text, or failed;
    they are written as 0 .. N - 1 in their order, each episode keeping its text. A task_index of
    2.7 was written as 2."""
    import pandas as pd
    import pyarrow.parquet as pq

    fields, meta = {"action": ("float", 2)}, {"task_index": "float"}
    with ReplayBuffer(tmp_path / "buf", max_episodes=4, max_timesteps=2, fields=fields, meta_fields=meta) as buffer:
        buffer.attrs["lerobot"] = {"tasks": {"1": "open", "3": "close"}}
        for task in (3, 1, 3):
            buffer.store_episode(action=np.zeros((2, 2), np.float32), task_index=task)
    imp.export_lerobot(tmp_path / "buf", tmp_path / "out")
    tasks = pd.read_parquet(tmp_path / "out" / "meta" / "tasks.parquet")
    frames = pq.read_table(tmp_path / "out" / "data" / "chunk-000" / "file-000.parquet").to_pandas()
    assert [tasks.iloc[index].name for index in frames["task_index"]] == ["close"] * 2 + ["open"] * 2 + ["close"] * 2
    assert tasks["task_index"].tolist() == [0, 1]
    imp.lerobot(tmp_path / "out", tmp_path / "back", progress=False)
    with ReplayBuffer.from_folder(tmp_path / "back", read_only=True) as back:
        texts = back.attrs["lerobot"]["tasks"]
        assert [texts[str(back.meta_data["task_index"][slot])] for slot in back.valid_episodes()] == [
            "close",
            "open",
            "close",
        ]
    with ReplayBuffer.from_folder(tmp_path / "buf") as buffer:
        buffer.store_episode(action=np.zeros((2, 2), np.float32), task_index=2.7)
    with pytest.raises(ValueError, match=r"meta field 'task_index' of slot 3 holds 2\.7\d*, which is no task index"):
        imp.export_lerobot(tmp_path / "buf", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_lerobot_tasks_file_without_task_texts_is_named(tmp_path):
    write_lerobot(tmp_path / "src", video=False)
    import pandas as pd

    pd.DataFrame({"id": [0, 1]}).to_parquet(tmp_path / "src" / "meta" / "tasks.parquet")
    with pytest.raises(imp.ImportSourceError, match=r"tasks\.parquet: expected columns 'task' and 'task_index'"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)


def test_lerobot_video_mode_decodes_each_episode_from_its_timestamp(tmp_path):
    written = write_lerobot(tmp_path / "src", video=True)
    imp.lerobot(tmp_path / "src", tmp_path / "a", verify=True, progress=False)
    got = episodes_by_source(tmp_path / "a")
    for episode, values in written.items():
        np.testing.assert_array_equal(got[episode]["action"], values["action"])
        frames = got[episode]["observation_images_top"].astype(int)
        # H.264 is lossy; consecutive frames differ by 20 levels, so a frame off by one would show
        assert np.abs(frames - values["observation.images.top"]).mean() < 5

    assert imp.export_lerobot(tmp_path / "a", tmp_path / "out", video=True) == 3
    imp.lerobot(tmp_path / "out", tmp_path / "b", progress=False)
    again = episodes_by_source(tmp_path / "b")
    for episode in written:
        np.testing.assert_array_equal(again[episode]["observation_state"], got[episode]["observation_state"])
        diff = np.abs(again[episode]["observation_images_top"].astype(int) - got[episode]["observation_images_top"])
        assert diff.mean() < 5


def test_lerobot_truncated_video_names_file_and_episode(tmp_path):
    write_lerobot(tmp_path / "src", video=True)
    episodes = tmp_path / "src" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    import pyarrow.parquet as pq

    table = pq.read_table(episodes).to_pylist()
    table[2]["videos/observation.images.top/from_timestamp"] = 100.0  # past the end of the video
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), episodes)
    with pytest.raises(imp.ImportSourceError, match=r"file-000\.parquet: episode 2: .*file-000\.mp4 holds 0 frames"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0, 1]


def test_lerobot_video_frames_away_from_the_episode_s_timestamps_are_refused(tmp_path):
    """A negative from_timestamp took the video's first frames (episode 0's) as episode 1's,
    without a word; LeRobot's reader refuses frames away from the timestamps it queries."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_lerobot(tmp_path / "src", video=True)
    episodes = tmp_path / "src" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(episodes).to_pylist()
    table[1]["videos/observation.images.top/from_timestamp"] = -1.0
    pq.write_table(pa.Table.from_pylist(table), episodes)
    with pytest.raises(
        imp.ImportSourceError,
        match=r"episode 1: .*file-000\.mp4: frame 0 of the episode is at 0\.000 s, expected -1\.000 s",
    ):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0]


def test_lerobot_video_of_another_resolution_is_refused_before_its_frames_are_decoded(tmp_path, monkeypatch):
    """A crafted mp4 of another size than its feature declares was decoded whole, an episode's
    frames at the video's size (gigabytes for 4K frames), before the episode's shape check."""
    import av

    from replaybuf.importers import _lerobot

    write_lerobot(tmp_path / "src", video=True)
    path = tmp_path / "src" / "videos" / "observation.images.top" / "chunk-000" / "file-000.mp4"
    _lerobot.encode_frames(path, np.zeros((15, 32, 48, 3), np.uint8), 10)
    decoded = []
    monkeypatch.setattr(av.VideoFrame, "to_ndarray", lambda frame, **kwargs: decoded.append(frame))
    with pytest.raises(imp.ImportSourceError, match=r"episode 0: .*file-000\.mp4 holds frames of 48 x 32 pixels"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert decoded == [] and not (tmp_path / "dst").exists()


def lerobot_with_info(source, change, video: bool = False) -> None:
    """A small LeRobot dataset at ``source`` whose meta/info.json ``change`` edited."""
    write_lerobot(source, video=video)
    info_path = source / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    change(info)
    info_path.write_text(json.dumps(info))


def test_lerobot_refuses_other_versions(tmp_path):
    write_lerobot(tmp_path / "src", video=False)
    info_path = tmp_path / "src" / "meta" / "info.json"
    info_path.write_text(json.dumps({**json.loads(info_path.read_text()), "codebase_version": "v2.1"}))
    with pytest.raises(imp.ImportSourceError, match=r"info\.json: codebase_version 'v2.1'"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda info: info.pop("features"), r"malformed LeRobot info \(missing key 'features'\)"),
        (lambda info: info.pop("fps"), r"malformed LeRobot info \(missing key 'fps'\)"),
        (lambda info: info.update(fps=0), r"malformed LeRobot info \(ValueError: fps must be a number > 0"),
        (lambda info: info.update(fps="inf"), r"malformed LeRobot info \(ValueError: fps must be a number > 0"),
        # a str or a bool was read as a frame rate (and LeRobot's reader fails on a str)
        (lambda info: info.update(fps="10"), r".*fps must be a number > 0 and finite, got '10'"),
        (lambda info: info.update(fps=True), r".*fps must be a number > 0 and finite, got True"),
        # path patterns raised a bare AttributeError, IndexError or KeyError naming no file
        (lambda info: info.update(data_path=5), r".*data_path must be a path pattern such as 'data/chunk-.*got 5"),
        (lambda info: info.update(data_path="{0}"), r".*data_path '\{0\}' is no path pattern .*IndexError"),
        (
            lambda info: info.update(video_path="{camera}.mp4"),
            r".*video_path '\{camera\}.mp4' is no path pattern .*KeyError",
        ),
        (lambda info: info["features"]["action"].pop("dtype"), r"malformed LeRobot info \(missing key 'dtype'\)"),
        (lambda info: info.update(features=[1, 2]), r"malformed LeRobot info \(AttributeError"),
    ],
)
def test_lerobot_malformed_info_names_the_file(tmp_path, change, message):
    """A malformed info.json raised a bare KeyError ('features'), which the CLI printed alone."""
    lerobot_with_info(tmp_path / "src", change, video="video_path" in message)
    with pytest.raises(imp.ImportSourceError, match=r"info\.json: " + message):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_lerobot_missing_data_file_is_named(tmp_path):
    write_lerobot(tmp_path / "src", video=False)
    (tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet").unlink()
    with pytest.raises(imp.ImportSourceError, match=r"episode 0: cannot read its frames: no such file '.*file-000"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()  # refused at the first episode: no empty buffer left behind


def _edit_parquet(path, change) -> None:
    import pyarrow.parquet as pq

    pq.write_table(change(pq.read_table(path)), path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda rows: [row.pop("length") for row in rows], r"without the columns \['length'\]"),
        (lambda rows: [row.pop("data/chunk_index") for row in rows], r"without the columns \['data/chunk_index'\]"),
        (
            lambda rows: [row.update(length=str(row["length"])) for row in rows],
            r"wrong type \{'length': 'string'\}; expected integers",
        ),
        (lambda rows: rows[1].update(episode_index=None), r"empty cells \['episode_index'\]"),
    ],
)
def test_lerobot_episodes_file_with_missing_or_bad_columns_is_named(tmp_path, change, message):
    """A bare KeyError ('length') or TypeError came out of these."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_lerobot(tmp_path / "src", video=True)
    path = tmp_path / "src" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    rows = pq.read_table(path).to_pylist()
    change(rows)
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(imp.ImportSourceError, match=r"file-000\.parquet: LeRobot episode.* " + message):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("data_path", "../outside.parquet"),
        ("data_path", "{outside}"),
        ("image path", "{outside}"),
        ("image path", "images/../../outside.parquet"),
    ],
)
def test_lerobot_files_outside_the_dataset_are_not_read(tmp_path, where, name):
    """A crafted info.json or image cell named any file of the machine (absolute or through ``..``)."""
    import pyarrow as pa

    write_lerobot(tmp_path / "src", video=False)
    data = tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet"
    outside = tmp_path / "outside.parquet"
    data.rename(outside)
    data.symlink_to(outside)  # a link inside the dataset (a hub cache) still reads
    name = name.replace("{outside}", str(outside))
    if where == "data_path":
        info_path = tmp_path / "src" / "meta" / "info.json"
        info_path.write_text(json.dumps({**json.loads(info_path.read_text()), "data_path": name}))
    else:

        def image_at(table):
            column = table.column_names.index("observation.images.top")
            cells = table.column(column).to_pylist()
            cells[0] = {"bytes": None, "path": name}
            return table.set_column(column, "observation.images.top", pa.array(cells, table.column(column).type))

        _edit_parquet(outside, image_at)
    what = "data file" if where == "data_path" else "image path"
    with pytest.raises(imp.ImportSourceError, match=f"episode 0: {what} '{name}' leaves the dataset folder"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda info: info["features"]["observation.state"].update(shape=[10**9]), "22 GiB per episode"),
        (lambda info: info["features"]["action"].update(shape=[-2]), "field 'action': shape must be a positive"),
    ],
)
def test_lerobot_features_no_buffer_can_hold_are_refused_naming_the_dataset(tmp_path, change, message):
    lerobot_with_info(tmp_path / "src", change)
    with pytest.raises(imp.ImportSourceError, match=f"src: no buffer can hold this dataset: .*{message}"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_lerobot_missing_column_leaves_no_destination_but_a_resume_keeps_what_it_has(tmp_path):
    write_lerobot(tmp_path / "src", video=False)
    data = tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet"
    whole = data.read_bytes()
    _edit_parquet(data, lambda table: table.drop_columns(["action"]))
    with pytest.raises(imp.ImportSourceError, match=r"file-000\.parquet: episode 0: cannot read its frames: .*action"):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()
    data.write_bytes(whole)
    assert imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False).imported == len(LENGTHS)
    _edit_parquet(data, lambda table: table.drop_columns(["action"]))
    assert imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False).skipped == len(LENGTHS)


def test_lerobot_video_export_needs_even_frames(tmp_path):
    buffer = ReplayBuffer(tmp_path / "odd", max_episodes=1, max_timesteps=2, fields={"cam": ("uint8", (5, 5, 3))})
    buffer.store_episode(cam=np.zeros((2, 5, 5, 3), np.uint8))
    buffer.close()
    with pytest.raises(ValueError, match=r"field 'cam': video mode needs .* even H and W, got \(5, 5, 3\)"):
        imp.export_lerobot(tmp_path / "odd", tmp_path / "out", video=True)
    assert imp.export_lerobot(tmp_path / "odd", tmp_path / "out") == 1  # image mode takes any size


class LossySource(imp.Source):
    """A source declaring float32 steps while holding float64 values: stored values differ."""

    format = "lossy"

    def fields(self):
        return {"x": {"dtype": "float32", "shape": ()}}

    def episode_ids(self):
        return [0, 1]

    def lengths(self):
        return [3, 3]

    def read(self, position):
        return {"x": np.full(3, 0.1 if position else 0.5, dtype=np.float64)}, {}


def test_verify_catches_an_episode_that_reads_back_different(tmp_path):
    with pytest.raises(imp.ImportVerifyError, match="field 'x' of slot 1 reads back different"):
        imp.run_import(LossySource("lossy-src"), tmp_path / "dst", verify=True, progress=False)
    imp.run_import(LossySource("lossy-src"), tmp_path / "other", progress=False)  # unchecked: accepted


def test_progress_bar_shows_episodes_and_frames_per_second(tmp_path, capsys):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=True)
    err = capsys.readouterr().err
    assert "import diffusion_policy" in err and "3/3" in err and "episode/s" in err and "frames_per_s=" in err


# ---- Minari ------------------------------------------------------------------------------------


def cartpole_episode(env, seed: int):
    """One random CartPole episode as minari's EpisodeBuffer, what its DataCollector records
    (which needs jax, a multi-second import, only to append steps)."""
    from minari.data_collector import EpisodeBuffer

    observation, _ = env.reset(seed=seed)
    steps: dict[str, list] = {
        "observations": [observation],
        "actions": [],
        "rewards": [],
        "terminations": [],
        "truncations": [],
    }
    while not (steps["terminations"] and (steps["terminations"][-1] or steps["truncations"][-1])):
        action = env.action_space.sample()
        observation, reward, terminated, truncated, _ = env.step(action)
        for name, value in zip(steps, (observation, action, reward, terminated, truncated)):
            steps[name].append(value)
    return EpisodeBuffer(id=seed, seed=seed, **steps)


def cartpole_dataset(tmp_path, monkeypatch, dataset_id: str, count: int):
    """A minari dataset ``dataset_id`` of ``count`` random CartPole episodes, written by minari
    under ``tmp_path / 'minari'`` (MINARI_DATASETS_PATH); returns its episodes and dataset."""
    minari = pytest.importorskip("minari")
    gym = pytest.importorskip("gymnasium")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    env = gym.make("CartPole-v1")
    env.action_space.seed(0)
    episodes = [cartpole_episode(env, seed) for seed in range(count)]
    with pytest.warns(UserWarning):  # no description / eval_env: fine for a fixture
        dataset = minari.create_dataset_from_buffers(dataset_id, episodes, env, algorithm_name="random")
    return episodes, dataset


def test_minari_dataset_written_by_minari(tmp_path, monkeypatch):
    episodes, dataset = cartpole_dataset(tmp_path, monkeypatch, "cartpole/fixture-v0", 3)
    import gymnasium as gym

    source = {
        e.id: {
            "observations": e.observations[:-1],
            "next_observations": e.observations[1:],
            "actions": e.actions,
            "rewards": e.rewards,
            "terminations": e.terminations,
            "truncations": e.truncations,
        }
        for e in dataset.iterate_episodes()
    }
    result = imp.minari("cartpole/fixture-v0", tmp_path / "by-id", verify=True, progress=False)
    assert result.imported == 3 and result.frames == sum(len(e["rewards"]) for e in source.values())
    assert_same(episodes_by_source(tmp_path / "by-id"), source)
    attrs = ReplayBuffer.from_folder(tmp_path / "by-id", read_only=True).attrs["minari"]
    assert attrs["dataset_id"] == "cartpole/fixture-v0" and attrs["algorithm_name"] == "random"
    assert gym.envs.registration.EnvSpec.from_json(attrs["env_spec"]).id == "CartPole-v1"
    from minari.serialization import deserialize_space

    assert deserialize_space(attrs["observation_space"]) == dataset.spec.observation_space
    assert deserialize_space(attrs["action_space"]) == dataset.spec.action_space
    folder = tmp_path / "minari" / "cartpole" / "fixture-v0"
    assert main(["import", "minari", str(folder), str(tmp_path / "by-path"), "--quiet"]) == 0
    assert_same(episodes_by_source(tmp_path / "by-path"), source)


def test_minari_total_steps_that_lie_are_refused_before_anything_is_created(tmp_path, monkeypatch):
    """The longest claimed episode sizes the destination: a total_steps of 1e8 over 18 steps
    would have reserved gigabytes (memmap); it is now refused naming the episode."""
    cartpole_dataset(tmp_path, monkeypatch, "cartpole/lying-v0", 3)
    with require("h5py").File(tmp_path / "minari" / "cartpole" / "lying-v0" / "data" / "main_data.hdf5", "r+") as f:
        held = len(f["episode_1"]["rewards"])
        f["episode_1"].attrs["total_steps"] = 100_000_000
    for backend in ("memmap", "hdf5", "zarr"):
        dst = tmp_path / backend
        with pytest.raises(
            imp.ImportSourceError,
            match=f"episode 1: its metadata says total_steps=100000000, but it holds {held} steps",
        ):
            imp.minari("cartpole/lying-v0", dst, backend=backend, progress=False)
        assert not dst.exists()


def test_minari_unknown_dataset(tmp_path, monkeypatch):
    pytest.importorskip("minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    with pytest.raises(imp.ImportSourceError, match="nothing/here-v0: cannot open as a Minari dataset") as raised:
        imp.minari("nothing/here-v0", tmp_path / "dst")
    assert "`minari download nothing/here-v0` first" in str(raised.value)


# ---- command line ------------------------------------------------------------------------------


def test_cli_import_and_export(tmp_path, capsys):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    dst = str(tmp_path / "dst")
    assert main(["import", "diffusion_policy", str(tmp_path / "dp.zarr"), dst, "--verify", "--quiet"]) == 0
    assert "imported 3 episodes (20 steps)" in capsys.readouterr().out
    assert main(["import", "diffusion_policy", str(tmp_path / "dp.zarr"), dst, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "imported 0 episodes (0 steps)" in out and "3 were already there" in out
    assert main(["export", "diffusion_policy", dst, str(tmp_path / "out.zarr")]) == 0
    out = capsys.readouterr().out
    assert "exported 3 episodes" in out
    assert "meta fields ['source_episode'] have no place in the diffusion_policy layout and were left out" in out
    assert main(["export", "lerobot", dst, str(tmp_path / "out-lr")]) == 0
    assert "meta fields ['source_episode'] have no place in the lerobot layout" in capsys.readouterr().out


def test_cli_errors_are_usage_messages(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "rlds", "x", str(tmp_path / "dst")])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "robomimic", str(tmp_path / "missing.hdf5"), str(tmp_path / "dst"), "--quiet"])
    assert exit_info.value.code == 2 and "missing.hdf5" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown format 'rlds': expected one of \['d4rl', "):
        imp.load("rlds", "x", tmp_path / "dst")


# ---- hostile, damaged and absurd sources; destinations that are not the import's -----------------


def _flip_bytes(path, at: float = 0.5, count: int = 8) -> None:
    raw = bytearray(path.read_bytes())
    start = int(len(raw) * at)
    raw[start : start + count] = bytes(b ^ 0xFF for b in raw[start : start + count])
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("ends", "extra", "message"),
    [
        # a lying end made the destination reserve it: 2.4 GB of memmap (51 GB as hdf5) for 20 rows
        ((5, 12, 10**8), {}, r"meta/episode_ends: episode 2 has 99999988 steps, more than the 20 rows"),
        ((5, 12), {}, r"\{'data/action': 20, 'data/img': 20, 'data/state': 20\} have more rows than .* \(12\)"),
        (DP_ENDS, {"scale": np.array(2.0)}, r"data/scale is 0-d; expected one row per step"),  # a bare IndexError
    ],
    ids=["lying-end", "rows-past-the-last-end", "0-d-array"],
)
def test_diffusion_policy_ends_its_arrays_contradict_are_refused_before_a_destination(tmp_path, ends, extra, message):
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays(), ends=ends)
    for name, value in extra.items():
        zarr.open_group(str(tmp_path / "dp.zarr"), mode="a").create_array(f"data/{name}", data=value)
    with pytest.raises(imp.ImportSourceError, match=r"dp\.zarr.*" + message):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", backend="memmap", progress=False)
    assert not (tmp_path / "dst").exists()


def test_robomimic_num_samples_its_datasets_do_not_hold_is_refused_before_a_destination(tmp_path):
    """A demo past the first claiming 10**8 steps made a memmap destination reserve 16.8 GB."""
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f["data/demo_1"].attrs["num_samples"] = 10**8
    with pytest.raises(
        imp.ImportSourceError, match=r"data/demo_1: num_samples is 100000000, but its datasets hold at most 7"
    ):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", backend="memmap", progress=False)
    assert not (tmp_path / "dst").exists()


def _episodes_claiming(rows: list[dict], case: str) -> list[dict]:
    """The fixture's episode rows with one claiming more frames than its data file holds."""
    if case == "many":  # 1000 episodes, each of a length the 15-row file holds
        return [dict(rows[0], episode_index=episode, length=6) for episode in range(1000)]
    # 10**8 steps of 16 x 16 x 3 frames are over what an episode may hold: the file's rows must refuse 10**6
    rows[1].update(
        {"length": 10**8, "data/file_index": 0} if case == "long" else {"length": 10**6, "data/file_index": 7}
    )
    return rows


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("long", rf"episode 1 has length 100000000, more than the {sum(LENGTHS)} rows"),
        # a data file that cannot be read was left to fail when its episode came: the memmap
        # destination had been sized (gigabytes reserved on disk) from the length it could not check
        (
            "unread",
            r"file-007\.parquet: episode 1: cannot read its frames: no such file .*its length 1000000 cannot be",
        ),
        # each episode fit the file, all of them did not: a slot was reserved for each (463 MB for 10**5)
        (
            "many",
            rf"its 1000 episodes in data file .*file-000\.parquet' have 6000 frames in all, more than .* {sum(LENGTHS)} rows",
        ),
    ],
)
def test_lerobot_episode_longer_than_its_data_file_is_refused_before_a_destination(tmp_path, case, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_lerobot(tmp_path / "src", video=False)
    path = tmp_path / "src" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    rows = _episodes_claiming(pq.read_table(path).to_pylist(), case)
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(imp.ImportSourceError, match=message):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", backend="memmap", progress=False)
    assert not (tmp_path / "dst").exists()


def test_d4rl_flags_that_are_not_one_per_step_are_refused(tmp_path):
    """(N, 2) terminals were read as 2 N flags by np.flatnonzero; timeouts of another length
    than terminals raised a bare broadcast error."""
    with require("h5py").File(tmp_path / "d4rl.hdf5", "w") as f:
        f.create_dataset("observations", data=np.zeros((6, 2), np.float32))
        f.create_dataset("terminals", data=np.ones((6, 2), bool))
    with pytest.raises(imp.ImportSourceError, match=r"\{'terminals': \(6, 2\)\}: expected one flag per step"):
        imp.d4rl(tmp_path / "d4rl.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_damaged_zarr_chunk_names_file_and_episode_and_keeps_what_was_committed(tmp_path):
    """blosc's RuntimeError came out bare, naming neither the file nor the episode."""
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    (tmp_path / "dp.zarr" / "data" / "state" / "2.0").write_bytes(b"\0" * 5)  # steps 8..11: episode 1
    with pytest.raises(imp.ImportSourceError, match=r"dp\.zarr: episode 1: .*blosc") as error:
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False)
    assert isinstance(error.value.__cause__, RuntimeError)
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0]


def test_resume_from_another_source_is_refused_and_leaves_the_buffer(tmp_path):
    """Another file, or the same file rewritten, resumed as 'already there': two datasets in one buffer."""
    arrays = dp_arrays()
    write_diffusion_policy(tmp_path / "a.zarr", {k: v[:15] for k, v in arrays.items()})  # episode 2 cut short
    with pytest.raises(imp.ImportSourceError, match="episode 2"):
        imp.diffusion_policy(tmp_path / "a.zarr", tmp_path / "dst", progress=False)
    before = episodes_by_source(tmp_path / "dst")
    assert sorted(before) == [0, 1]
    other = {name: values[::-1].copy() for name, values in arrays.items()}
    write_diffusion_policy(tmp_path / "b.zarr", other)  # same fields and lengths, other data
    with pytest.raises(ValueError, match=r"source episode 1 was imported with other values than .*b\.zarr' now holds"):
        imp.diffusion_policy(tmp_path / "b.zarr", tmp_path / "dst", progress=False)
    # the same file, rewritten with other episode lengths (the longest the same: the schema matches)
    write_diffusion_policy(tmp_path / "a.zarr", arrays, ends=(6, 12, 20))
    with pytest.raises(ValueError, match=r"source episodes \[0, 1\] were imported with other lengths"):
        imp.diffusion_policy(tmp_path / "a.zarr", tmp_path / "dst", progress=False)
    write_diffusion_policy(tmp_path / "a.zarr", other)  # the same file and lengths, other data
    with pytest.raises(ValueError, match=r"source episode 1 was imported with other values than .*a\.zarr' now holds"):
        imp.diffusion_policy(tmp_path / "a.zarr", tmp_path / "dst", progress=False)
    assert_same(episodes_by_source(tmp_path / "dst"), before)
    attrs = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs
    assert attrs["imported_from"]["path"] == str(tmp_path / "a.zarr")


@pytest.mark.parametrize(
    ("dst", "message"), [("dp.zarr", "are the same location"), ("dp.zarr/data/out", "is inside the source")]
)
def test_import_into_its_own_source_is_refused(tmp_path, dst, message):
    """An import into dp.zarr/data/out wrote a zarr v3 group inside the user's dataset."""
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "dp.zarr").rglob("*"))
    with pytest.raises(ValueError, match=f"import: .*{message}"):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / dst, progress=False)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "dp.zarr").rglob("*")) == before


@pytest.mark.parametrize("format", ["diffusion_policy", "lerobot"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "empty-folder"])
def test_failed_export_leaves_nothing_that_passes_for_a_dataset(tmp_path, format, existing):
    """A diffusion_policy export stopped by a damaged episode left a complete-looking zarr whose
    unwritten episodes imported as zeros."""
    from replaybuf import CorruptChunkError

    with ReplayBuffer(tmp_path / "buf", max_episodes=4, max_timesteps=10, fields={"x": ("float32", (3,))}) as buffer:
        for episode in range(4):
            buffer.store_episode(x=np.full((10, 3), episode + 1, np.float32))
    _flip_bytes(tmp_path / "buf" / "data" / "x" / "c.0.0.0")
    if existing:
        (tmp_path / "out").mkdir()
    with pytest.raises(CorruptChunkError):
        imp.export(format, tmp_path / "buf", tmp_path / "out")
    if existing:
        assert list((tmp_path / "out").iterdir()) == []  # the user's folder stays, as empty as it was
    else:
        assert not (tmp_path / "out").exists()


def test_an_episode_index_given_twice_is_refused(tmp_path):
    """demo_1 and demo_01 were both source_episode 1: a resume would skip the one not yet copied."""
    write_robomimic(tmp_path / "demo.hdf5")
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f.copy(f["data/demo_1"], f["data"], name="demo_01")
    with pytest.raises(imp.ImportSourceError, match=r"demo\.hdf5: episode indices \[1\] name more than one episode"):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_source_episodes_without_steps_are_left_out_and_counted(tmp_path, capsys):
    """An empty demo stopped every import (and every resume) at it with a bare store_episode
    error; diffusion_policy ends repeated for an empty episode were refused as malformed."""
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays(), ends=(5, 5, 12, 20))
    assert main(["import", "diffusion_policy", str(tmp_path / "dp.zarr"), str(tmp_path / "dst"), "--quiet"]) == 0
    assert "1 source episodes have no steps and were left out" in capsys.readouterr().out
    assert sorted(episodes_by_source(tmp_path / "dst")) == [0, 2, 3]
    # no slot for the empty one: a slot each made 10**5 of them reserve gigabytes (memmap, hdf5)
    with ReplayBuffer.from_folder(tmp_path / "dst", read_only=True) as imported:
        assert imported.max_episodes == 3
    (tmp_path / "dp.zarr" / "data" / "state" / "4.0").write_bytes(b"\0" * 5)  # the newest: not read again
    result = imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False)
    assert result == imp.ImportResult(imported=0, skipped=3, frames=0, empty=1)

    write_robomimic(tmp_path / "demo.hdf5", lengths=(4, 0, 3))
    with require("h5py").File(tmp_path / "demo.hdf5", "a") as f:
        f["data/demo_1"].attrs["num_samples"] = 0
        del f["data/demo_1/actions"]
        f["data/demo_1"].create_dataset("actions", data=np.zeros((2, 7)))  # 0 steps said, 2 rows held
    with pytest.raises(imp.ImportSourceError, match=r"data/demo_1: episode 1: field 'actions' has shape \(2, 7\)"):
        imp.robomimic(tmp_path / "demo.hdf5", tmp_path / "rm", progress=False)
    write_diffusion_policy(tmp_path / "none.zarr", {"x": np.zeros((0, 2))}, ends=(0, 0))
    with pytest.raises(imp.ImportSourceError, match=r"none\.zarr: none of its 2 episodes has a step"):
        imp.diffusion_policy(tmp_path / "none.zarr", tmp_path / "none", progress=False)
    assert not (tmp_path / "none").exists()


def test_source_metadata_a_buffer_cannot_hold_is_kept_as_text_or_refused_before_a_destination(tmp_path):
    """A NaN in a zarr's root attributes failed after the destination was made: an empty buffer
    was left, and every resume failed the same way."""
    write_diffusion_policy(tmp_path / "dp.zarr", dp_arrays())
    zarr.open_group(str(tmp_path / "dp.zarr"), mode="a").attrs.update(gain={"kp": float("nan")}, robot="pusht")
    assert imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "dst", progress=False).imported == 3
    attrs = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True).attrs
    assert attrs["gain"] == '{"kp": NaN}' and attrs["robot"] == "pusht"

    zarr.open_group(str(tmp_path / "dp.zarr"), mode="a").attrs["notes"] = "x" * (1 << 20)
    with pytest.raises(imp.ImportSourceError, match=r"dp\.zarr: its metadata cannot be kept in buffer\.attrs: .*bytes"):
        imp.diffusion_policy(tmp_path / "dp.zarr", tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()


def test_an_episode_overwritten_during_an_export_is_refused_not_mixed(tmp_path):
    """Exports read each field as the slot held it at that moment: a writer overwriting a slot
    mid-export gave another episode's steps under the planned length (15 of 15 exports of a busy
    circular buffer were wrong)."""
    from replaybuf import ConcurrentWriteError
    from replaybuf.importers._engine import exported_episodes

    def episode(value: float, length: int) -> dict[str, np.ndarray]:
        return {"x": np.full((length, 2), value, np.float32)}

    config = {"max_episodes": 3, "max_timesteps": 9, "fields": {"x": ("float32", (2,))}, "circular": True}
    with ReplayBuffer(tmp_path / "buf", **config) as buffer:
        for value in range(3):
            buffer.store_episode(**episode(value, 4 + value))
    reader, lengths, episodes = exported_episodes(tmp_path / "buf")
    with reader:
        assert lengths.tolist() == [4, 5, 6]
        slot, data, _meta = next(episodes)
        np.testing.assert_array_equal(data["x"], episode(0, 4)["x"])
        with ReplayBuffer.from_folder(tmp_path / "buf") as writer:
            writer.store_episode(**episode(7, 9))  # slot 0, exported already
            writer.store_episode(**episode(8, 9))  # slot 1, not yet
        with pytest.raises(ConcurrentWriteError, match=r"slots \[1\]"):
            next(episodes)


def _frames_of_another_layout(table, column):
    """The data file's ``column`` with frames 0 and 1 holding 2 and 4 state values, or frame 2 an
    image of 32 x 8 pixels: as many values as the feature's shape, in another layout."""
    import io

    import pyarrow as pa
    from PIL import Image

    cells = table.column(column).to_pylist()
    if column == "observation.state":
        cells[0], cells[1] = cells[0][:2], [*cells[1], cells[0][2]]
        kind = pa.list_(pa.float32())
    else:
        png = io.BytesIO()
        Image.fromarray(np.zeros((8, 32, 3), np.uint8)).save(png, format="PNG")
        cells[2], kind = {"bytes": png.getvalue(), "path": None}, table.schema.field(column).type
    return table.set_column(table.schema.get_field_index(column), column, pa.array(cells, kind))


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (
            "observation.state",
            r"column 'observation.state': frame 0 holds 2 values, the feature's shape \(3,\) holds 3",
        ),
        ("observation.images.top", r"an image of 32 x 8 pixels, the feature's shape is \(16, 16, 3\)"),
    ],
)
def test_lerobot_frames_of_another_layout_are_named_not_reshaped(tmp_path, column, message):
    """A reshape moved values across frames (and rows of pixels across an image) and --verify passed."""
    write_lerobot(tmp_path / "src", video=False)
    _edit_parquet(
        tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet", lambda t: _frames_of_another_layout(t, column)
    )
    with pytest.raises(imp.ImportSourceError, match=r"file-000\.parquet: episode 0: " + message):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", verify=True, progress=False)
    assert not (tmp_path / "dst").exists()


def test_lerobot_export_refuses_a_frame_rate_timestamps_cannot_divide_by(tmp_path):
    """fps=0 raised ZeroDivisionError with the data file half written; -1 wrote negative timestamps;
    a 0 fps meta value was taken as the default."""
    with ReplayBuffer(
        tmp_path / "buf", max_episodes=2, max_timesteps=4, fields={"x": "float32"}, meta_fields={"fps": "float64"}
    ) as buffer:
        buffer.store_episode(x=np.arange(4, dtype=np.float32), fps=0.0)
    for fps in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"fps must be a number > 0 and finite, got"):
            imp.export_lerobot(tmp_path / "buf", tmp_path / "out", fps=fps)
        assert not (tmp_path / "out").exists()
    imp.export_lerobot(tmp_path / "buf", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "meta" / "info.json").read_text())["fps"] == 30.0


def _obs_as_dataset(f):
    del f["data/demo_0/obs"]
    f["data/demo_0/obs"] = np.zeros((4, 2))


@pytest.mark.parametrize(
    ("format", "edit", "message"),
    [
        ("robomimic", _obs_as_dataset, r"data/demo_0/obs is a dataset, expected a group of datasets"),
        ("d4rl", lambda f: f.create_dataset("infos", data=np.zeros(6)), r"'infos' is a dataset, expected a group"),
        ("d4rl", lambda f: f.create_dataset("observations", data=np.float32(1)), r"'observations' is a group or 0-d"),
        (
            "robomimic",
            lambda f: f.create_dataset("data/demo_0/obs_eef_pos", data=np.zeros((4, 3))),
            r"datasets data/demo_0/obs/eef_pos and data/demo_0/obs_eef_pos map to one field name 'obs_eef_pos'",
        ),
        (
            "d4rl",
            lambda f: (
                f.create_dataset("infos/qpos", data=np.zeros(6)),
                f.create_dataset("infos_qpos", data=np.ones(6)),
            ),
            r"datasets infos_qpos and infos/qpos map to one field name 'infos_qpos'",
        ),
    ],
    ids=[
        "robomimic-obs-dataset",
        "d4rl-infos-dataset",
        "d4rl-0-d-observations",
        "robomimic-one-field-name",
        "d4rl-one-field-name",
    ],
)
def test_hdf5_layouts_of_another_shape_name_the_file(tmp_path, format, edit, message):
    """A group where a dataset belongs (or the reverse) raised a bare AttributeError, KeyError or IndexError."""
    h5py = require("h5py")
    path = tmp_path / "src.hdf5"
    if format == "robomimic":
        write_robomimic(path)
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("terminals", data=np.arange(6) == 2)
            if "observations" not in message:
                f.create_dataset("observations", data=np.zeros((6, 2), np.float32))
    with h5py.File(path, "a") as f:
        edit(f)
    with pytest.raises(
        imp.ImportSourceError,
        match=rf"src\.hdf5: not a {'robomimic' if format == 'robomimic' else 'D4RL'} file .*{message}",
    ):
        imp.load(format, path, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("format", ["diffusion_policy", "d4rl"])
def test_big_endian_source_arrays_are_stored_in_native_order(tmp_path, format):
    """A '>f4' source array made a buffer that refused to reopen (it held float32, its config said >f4)."""
    values = np.arange(20, dtype=">f4").reshape(10, 2)
    if format == "diffusion_policy":
        write_diffusion_policy(tmp_path / "src", {"x": values}, ends=(4, 10))
    else:
        with require("h5py").File(tmp_path / "src", "w") as f:
            f.create_dataset("observations", data=values)
            f.create_dataset("terminals", data=np.arange(10) == 3)
    assert imp.load(format, tmp_path / "src", tmp_path / "dst", verify=True, progress=False).imported == 2
    buffer = ReplayBuffer.from_folder(tmp_path / "dst", read_only=True)
    field = "x" if format == "diffusion_policy" else "observations"
    assert buffer.dtypes[field] == np.float32
    np.testing.assert_array_equal(buffer.data[field][1, :6], values[4:])


def test_lerobot_episode_with_a_frame_twice_and_one_missing_is_named(tmp_path):
    """The frame count matched, so the duplicate was stored in the missing frame's place."""
    import pyarrow as pa

    def repeat_frame_1(table):
        index = table.column("frame_index").to_pylist()
        episode = table.column("episode_index").to_pylist()
        row = next(i for i, (e, f) in enumerate(zip(episode, index)) if e == 0 and f == 2)
        index[row] = 1
        return table.set_column(table.schema.get_field_index("frame_index"), "frame_index", pa.array(index, pa.int64()))

    write_lerobot(tmp_path / "src", video=False)
    _edit_parquet(tmp_path / "src" / "data" / "chunk-000" / "file-000.parquet", repeat_frame_1)
    with pytest.raises(
        imp.ImportSourceError, match=r"episode 0: frame_index is not 0 \.\. 5: frames \[2\] are missing"
    ):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


def test_lerobot_features_that_map_to_one_field_are_refused(tmp_path):
    """'observation.state' and 'observation_state' both became field observation_state: one was dropped."""
    write_lerobot(tmp_path / "src", video=False)
    info_path = tmp_path / "src" / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation_state"] = info["features"]["observation.state"]
    info_path.write_text(json.dumps(info))
    with pytest.raises(
        imp.ImportSourceError,
        match=r"info\.json: features 'observation\.state' and 'observation_state' map to one field",
    ):
        imp.lerobot(tmp_path / "src", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    ("fields", "mapping", "message"),
    [
        (("a", "b"), {"a": "x", "b": "x"}, r"fields 'a' and 'b' would both be exported as feature 'x'"),
        (("a",), {"a": "timestamp"}, r"field 'a' would be exported as 'timestamp', a column LeRobot adds"),
        (("index",), {}, r"field 'index' would be exported as 'index', a column LeRobot adds"),
    ],
)
def test_lerobot_export_refuses_fields_that_would_share_a_column(tmp_path, fields, mapping, message):
    """The second column of a name replaced the first in the data file: a field lost without a word."""
    with ReplayBuffer(
        tmp_path / "buf", max_episodes=1, max_timesteps=3, fields={n: "float32" for n in fields}
    ) as buffer:
        buffer.store_episode(**{n: np.zeros(3, np.float32) for n in fields})
        buffer.attrs.update(lerobot={"fields": mapping})
    with pytest.raises(ValueError, match=message):
        imp.export_lerobot(tmp_path / "buf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_minari_space_parts_that_map_to_one_field_are_refused():
    """Dict keys 'a_b' and 'a' holding 'b' both became observations_a_b: one was dropped."""
    from replaybuf.importers._minari import _flatten

    flat = _flatten("observations", {"a": {"b": np.zeros(2)}, "c": (np.ones(2), np.zeros(2))})
    assert sorted(flat) == ["observations_a_b", "observations_c_0", "observations_c_1"]
    with pytest.raises(
        ValueError, match=r"two parts of the 'observations' space map to one field name 'observations_a_b'"
    ):
        _flatten("observations", {"a": {"b": np.zeros(2)}, "a_b": np.ones(2)})
