"""Call-for-call parity with memmap-replay-buffer 0.2.3 for the cases issue 14 found: each test
runs the same calls on the seed and on replaybuf and compares what a user sees."""

from __future__ import annotations

import os

import memmap_replay_buffer as seed
import memmap_replay_buffer.video as seed_video
import numpy as np
import pytest
import torch

import replaybuf.video as video
from replaybuf import ReplayBuffer, ReplayBufferH5PY
from replaybuf.maintenance import verify

from ._backends import require

FIELDS = {"state": ("float", 2), "done": "bool"}
META = {"label": "int"}


def make_pair(tmp_path, name: str, circular: bool = False, max_episodes: int = 4, h5: bool = False):
    """The seed's buffer and replaybuf's, created with the same arguments in two folders."""
    if h5:  # the seed has ReplayBufferH5PY only where h5py imports
        require("h5py")
    seed_cls, ours_cls = (seed.ReplayBufferH5PY, ReplayBufferH5PY) if h5 else (seed.ReplayBuffer, ReplayBuffer)
    args = dict(max_episodes=max_episodes, max_timesteps=5, fields=FIELDS, meta_fields=META, circular=circular)
    return seed_cls(tmp_path / f"seed-{name}", **args), ours_cls(tmp_path / f"ours-{name}", **args)


def observed(buffer) -> dict:
    """What the comparisons look at: counters, lengths and get_all_data within episode lengths."""
    lens = np.asarray(buffer.episode_lens[:])
    data = {k: v.numpy() for k, v in buffer.get_all_data().items()}
    for name in set(data) & set(FIELDS):  # beyond an episode's end the seed keeps what the slot held
        steps = np.arange(data[name].shape[1])[None] < lens[: len(data[name]), None]
        data[name] = np.where(steps.reshape(*steps.shape, *[1] * (data[name].ndim - 2)), data[name], 0)
    return dict(
        num_episodes=int(buffer.num_episodes),
        episode_index=int(buffer.episode_index),
        timestep_index=int(buffer.timestep_index),
        episode_lens=lens.tolist(),
        data={k: v.tolist() for k, v in data.items()},
    )


@pytest.mark.parametrize("circular", [False, True])
def test_advance_episode_batch_size_commits_that_many_episodes(tmp_path, circular):
    seed_buffer, ours = make_pair(tmp_path, "advance", circular=circular)
    for buffer in (seed_buffer, ours):
        buffer.store_batch(state=torch.ones(3, 2), done=torch.zeros(3, dtype=torch.bool))
        buffer.store_batch(state=torch.full((3, 2), 2.0), done=torch.ones(3, dtype=torch.bool))
        buffer.advance_episode(batch_size=3)
    assert observed(ours) == observed(seed_buffer)
    assert ours.num_episodes == 3 and ours.episode_lens.tolist() == [2, 2, 2, 0]


def test_advance_episode_batch_size_keeps_the_first_rows_of_a_larger_group(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "first-rows", circular=True)
    for buffer in (seed_buffer, ours):
        buffer.store_batch(state=torch.arange(6.0).reshape(3, 2))
        buffer.advance_episode(batch_size=2)
    assert ours.num_episodes == seed_buffer.num_episodes == 2
    assert ours.episode_index == seed_buffer.episode_index == 2
    np.testing.assert_array_equal(ours.get_all_data()["state"], seed_buffer.get_all_data()["state"][:2])


def test_advance_episode_batch_size_beyond_the_group_is_refused(tmp_path):
    _, ours = make_pair(tmp_path, "beyond", circular=True)
    ours.store_batch(state=torch.ones(2, 2))
    with pytest.raises(ValueError, match="batch_size 3 exceeds the 2 episode"):
        ours.advance_episode(batch_size=3)
    assert ours.num_episodes == 0 and ours.timestep_index == 1  # nothing committed, group intact
    ours.advance_episode(batch_size=2)
    assert ours.num_episodes == 2
    with pytest.raises(ValueError, match="positive int"):
        ours.advance_episode(batch_size=0)


def test_non_circular_batch_is_cut_to_the_free_room(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "room")
    for buffer in (seed_buffer, ours):
        buffer.store_episode(state=np.ones((2, 2)))
        buffer.store_episode(state=np.ones((3, 2)))
        buffer.store_batch(state=torch.arange(8.0).reshape(4, 2))
        buffer.advance_episode(2)
    assert observed(ours) == observed(seed_buffer)
    assert ours.num_episodes == 4
    for buffer in (seed_buffer, ours):
        with pytest.raises(ValueError, match="full"):
            buffer.store_batch(state=torch.ones(1, 2))


def test_meta_batch_then_advance_commits_length_zero_episodes(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "meta")
    for buffer in (seed_buffer, ours):
        buffer.store_meta_batch(label=[1, 2, 3])
        buffer.advance_episode(3)
    assert ours.num_episodes == seed_buffer.num_episodes == 3
    assert len(ours) == len(seed_buffer) == 0
    assert ours.get_all_data(meta_fields=("label",))["label"].tolist() == [1, 2, 3]
    assert seed_buffer.get_all_data(meta_fields=("label",))["label"].tolist() == [1, 2, 3]
    # the next episode goes after them and the empty ones stay out of datasets
    ours.store_episode(state=np.ones((2, 2)), label=9)
    assert ours.episode_index == 0 and ours.num_episodes == 4
    assert [int(x["_lens"]) for x in ours.dataset()] == [2]
    ours.close()
    assert verify(ours.folder) == []


def test_meta_batch_before_the_steps_is_kept(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "meta-first")
    for buffer in (seed_buffer, ours):
        buffer.store_meta_batch(label=[7])
        buffer.advance_episode()  # nothing stored yet: does nothing
        buffer.store(state=np.ones(2))
        buffer.advance_episode()
    assert ours.get_all_data()["label"].tolist() == seed_buffer.get_all_data()["label"].tolist() == [7]


def test_setting_timestep_index_moves_the_write_position(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "timestep", circular=True)
    for buffer in (seed_buffer, ours):
        buffer.store_batch(state=torch.ones(2, 2))
        buffer.timestep_index = 3
        buffer.store_batch(state=torch.full((2, 2), 5.0))
        buffer.advance_episode(2)
        buffer.store_batch(state=torch.ones(2, 2))
        buffer.store_batch(state=torch.ones(2, 2))
        buffer.store_batch(state=torch.ones(2, 2))
        buffer.timestep_index = 1  # rewind: the next step overwrites step 1
        buffer.store_batch(state=torch.full((2, 2), 7.0))
        buffer.advance_episode(2)
    assert observed(ours) == observed(seed_buffer)
    assert ours.episode_lens.tolist() == [4, 4, 2, 2]
    assert ours.get_all_data()["state"][2, :2, 0].tolist() == [1.0, 7.0]
    ours.close()
    assert verify(ours.folder) == []


def test_timestep_index_before_a_group_and_after_a_flushed_span(tmp_path):
    # 1 MB steps in chunks of 1: every step leaves RAM at once, so a rewind reads rows back
    shape = (256, 1024)
    ours = ReplayBuffer(tmp_path / "chunks", 2, 5, {"x": {"dtype": "float", "shape": shape, "chunks": 1}})
    ours.timestep_index = 2
    assert ours.timestep_index == 2
    for value in (1.0, 2.0, 3.0):
        ours.store_batch(x=np.full((1, *shape), value))
    ours.timestep_index = 3
    ours.store_batch(x=np.full((1, *shape), 4.0))
    ours.advance_episode()
    assert ours.get_all_data()["x"][0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 4.0]
    assert float(ours.data["x"][0, 4, 0, 0]) == 0.0  # the step cut off by the rewind is cleared
    with pytest.raises(ValueError, match=r"timestep_index: expected an int in \[0, 5\]"):
        ours.timestep_index = 6
    ours.close()
    assert verify(ours.folder) == []


def test_setting_episode_index_chooses_the_next_slot(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "episode", circular=True)
    for buffer in (seed_buffer, ours):
        buffer.episode_index = 2
        buffer.store_episode(state=np.ones((2, 2)))
    assert observed(ours) == observed(seed_buffer)
    assert ours.episode_lens.tolist() == [0, 0, 2, 0]
    ours.store(state=np.ones(2))
    with pytest.raises(ValueError, match="staged"):
        ours.episode_index = 0
    with pytest.raises(ValueError, match="out of range"):
        ours.episode_index = 4


def test_h5py_buffered_storer(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "storer", h5=True)
    for buffer in (seed_buffer, ours):
        store = buffer.get_buffered_storer(2)
        store(state=np.ones((5, 2)), done=np.zeros(5, bool), label=1, episode_lens=2)
        assert buffer.num_episodes == 0  # buffered until flush_freq episodes
        store(state=np.full((5, 2), 2.0), done=np.ones(5, bool), label=2, episode_lens=5)
        store(state=np.full((5, 2), 3.0), done=np.ones(5, bool), label=3, episode_lens=1, force_flush=True)
    assert observed(ours) == observed(seed_buffer)
    assert ours.episode_lens.tolist() == [2, 5, 1, 0]
    store = ours.get_buffered_storer(1)
    with pytest.raises(ValueError, match="invalid field names"):
        store(nope=1)
    with pytest.raises(ValueError, match="full"):
        store(state=np.ones((5, 2)), label=4, episode_lens=2) or store(state=np.ones((5, 2)), label=5)
    assert ours.num_episodes == 4
    with pytest.raises(ValueError, match="flush_freq"):
        ours.get_buffered_storer(0)


def test_h5py_buffered_storer_drops_a_batch_of_mismatched_fields(tmp_path):
    buffer = ReplayBufferH5PY(tmp_path / "b", max_episodes=4, max_timesteps=5, fields=FIELDS, meta_fields=META)
    store = buffer.get_buffered_storer(2)
    store(state=np.ones((3, 2)), label=1)
    with pytest.raises(ValueError, match=r"different numbers of episodes \{'state': 2, 'label': 1\}"):
        store(state=np.ones((3, 2)))
    assert buffer.num_episodes == 0
    store(state=np.ones((2, 2)), label=2)  # the storer works again: the bad batch was dropped
    store(state=np.ones((4, 2)), label=3)
    assert buffer.episode_lens.tolist() == [2, 4, 0, 0] and buffer.meta_data["label"][:2].tolist() == [2, 3]


def test_plain_h5py_reads_next_to_an_open_h5py_buffer(tmp_path):
    seed_buffer, ours = make_pair(tmp_path, "plain", h5=True)
    for buffer in (seed_buffer, ours):
        buffer.store_episode(state=np.ones((2, 2)))
        with require("h5py").File(os.path.join(buffer.folder, "data.h5"), "r") as f:
            assert len(f.keys()) > 0
    with require("h5py").File(os.path.join(ours.folder, "data.h5"), "r") as f:
        assert f["meta/episode_lens"][:].tolist() == [2, 0, 0, 0]
    ours.store_episode(state=np.ones((3, 2)))  # the buffer still writes after the plain read closed
    reader = ReplayBufferH5PY.from_folder(ours.folder, read_only=True)
    assert reader.episode_lens.tolist() == [2, 3, 0, 0]


# the video module


FRAME_CASES = {
    "uint8 rgb": np.random.default_rng(0).integers(0, 256, (7, 4, 6, 3), dtype=np.uint8),
    "uint8 gray": np.random.default_rng(1).integers(0, 256, (12, 3, 5), dtype=np.uint8),
    "float rgb": np.random.default_rng(2).uniform(-0.2, 1.2, (5, 4, 4, 3)).astype(np.float32),
}


@pytest.mark.parametrize("case", sorted(FRAME_CASES))
def test_to_uint8_and_frames_to_sheet_match_the_seed(case):
    frames = FRAME_CASES[case]
    np.testing.assert_array_equal(video.to_uint8(frames), seed_video.to_uint8(frames))
    for rows, columns in ((2, 5), (1, 3), (3, 2)):
        expected = seed_video.frames_to_sheet(frames, rows, columns)
        if expected.dtype != np.uint8:  # the seed keeps float frames float; sheets here are uint8
            expected = seed_video.to_uint8(expected)
        np.testing.assert_array_equal(video.frames_to_sheet(frames, rows, columns), expected)


@pytest.mark.parametrize("case", ["uint8 rgb", "uint8 gray", "256 grays"])
def test_gif_frames_of_at_most_256_colours_decode_as_the_seeds(tmp_path, case):
    """The seed's gifs keep every frame of at most 256 colours exactly; so do these (Pillow's
    palette lookup returned a frame of all 256 grays up to 4 levels off)."""
    iio = pytest.importorskip("imageio.v3")
    frames = np.arange(256, dtype=np.uint8).reshape(1, 16, 16)[[0, 0]] if case == "256 grays" else FRAME_CASES[case]
    frames = frames.copy()
    frames[-1] = frames[-1][::-1]  # two frames that differ, so neither is merged into the other
    expected = iio.imread(seed_video.trajectory_to_video(frames, tmp_path / "seed.gif"))
    decoded = iio.imread(video.trajectory_to_video(frames, tmp_path / "ours.gif"))
    np.testing.assert_array_equal(decoded[..., :3], expected[..., :3])
    np.testing.assert_array_equal(decoded[..., :3], video.to_rgb_uint8(frames))


def test_to_uint8_refuses_what_the_seed_refuses():
    for module in (video, seed_video):
        with pytest.raises(TypeError, match="int64"):
            module.to_uint8(np.zeros((2, 2, 2), np.int64))
    assert video.to_uint8(np.array([True, False])).tolist() == [255, 0]  # the seed refuses bools


def test_seed_cli_helpers_are_offered(tmp_path, capsys):
    for name in ("main", "open_buffer", "parse_episodes", "parse_fields", "field_path"):
        assert callable(getattr(video, name)) and name in video.__all__
    assert video.parse_episodes("0,3,5") == seed_video.parse_episodes("0,3,5") == [0, 3, 5]
    assert video.parse_fields("a, b") == seed_video.parse_fields("a, b") == ["a", "b"]
    base = tmp_path / "out.mp4"
    assert video.field_path(base, "front", True) == seed_video.field_path(base, "front", True)
    assert video.field_path(base, "front", False) == base
    frames = FRAME_CASES["uint8 rgb"]
    buffer = ReplayBuffer(tmp_path / "frames", 2, 7, {"image": ("uint8", (4, 6, 3))})
    buffer.store_episode(image=frames)
    buffer.close()
    assert video.open_buffer(str(tmp_path / "frames")).num_episodes == 1
    assert video.main([str(tmp_path / "frames"), "--output", str(tmp_path / "ep.gif")]) == 0
    assert (tmp_path / "ep.gif").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out


def test_a_rewind_is_replayed_from_the_step_log(tmp_path):
    """A writer killed after ``timestep_index = n`` leaves a log whose recovery keeps n steps
    plus those stored after, not the steps the rewind dropped."""
    ours = ReplayBuffer(tmp_path / "log", 2, 5, {"x": "float"}, backend="memmap")
    for value in (1.0, 2.0, 3.0):
        ours.store(x=value)
    ours.timestep_index = 1
    ours.store(x=9.0)
    ours.flush()  # the step log is on disk; the episode is not committed
    del ours  # killed before advance_episode
    reopened = ReplayBuffer(tmp_path / "log", overwrite=False, backend="memmap")
    assert reopened.episode_lens.tolist() == [2, 0]
    assert reopened.get_all_data()["x"].tolist() == [[1.0, 9.0]]
