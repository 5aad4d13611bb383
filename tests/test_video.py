"""Frames to videos, gifs and contact sheets; reading an episode's frames from a buffer."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest

from replaybuf import ReplayBuffer, video
from replaybuf.video import (
    check_sheet_size,
    default_image_field,
    episode_frames,
    frame_size,
    frames_to_sheet,
    image_fields,
    save_video,
    to_rgb_uint8,
    trajectory_to_video,
)
from tests._viewer_data import STEPS, gray_level, make_image_buffer, make_plot_only_buffer


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    return make_image_buffer(tmp_path_factory.mktemp("video") / "buffer")


def gray_frames(levels, height=16, width=16):
    frames = np.empty((len(levels), height, width, 3), np.uint8)
    frames[:] = np.asarray(levels, np.uint8)[:, None, None, None]
    return frames


# layouts and dtypes


@pytest.mark.parametrize(
    "frames",
    [
        np.full((4, 8, 10, 3), 128, np.uint8),  # channel-last
        np.full((4, 3, 8, 10), 128, np.uint8),  # channel-first
        np.full((4, 8, 10), 128, np.uint8),  # grayscale
        np.full((4, 8, 10, 1), 128, np.uint8),  # one channel
        np.full((4, 8, 10, 4), 128, np.uint8),  # rgba: alpha dropped
        np.full((4, 8, 10, 3), 128 / 255, np.float32),  # float in [0, 1]
    ],
    ids=["channel-last", "channel-first", "grayscale", "one-channel", "rgba", "float"],
)
def test_layouts_become_rgb_uint8(frames):
    rgb = to_rgb_uint8(frames)
    assert rgb.shape == (4, 8, 10, 3)
    assert rgb.dtype == np.uint8
    assert (rgb == 128).all()


def test_float_frames_are_clipped_and_bools_are_black_or_white():
    assert to_rgb_uint8(np.array([-1.0, 0.5, 2.0, np.nan], np.float32).reshape(1, 1, 4)).ravel()[::3].tolist() == [
        0,
        128,
        255,
        0,
    ]
    assert to_rgb_uint8(np.array([[[True, False]]])).ravel()[::3].tolist() == [255, 0]


def test_float_frames_convert_block_by_block_as_whole(monkeypatch):
    frames = np.random.default_rng(0).normal(0.5, 0.5, (7, 3, 5, 6)).astype(np.float32)
    frames[2, 1, 1, 1] = np.nan
    expected = (np.nan_to_num(frames).clip(0, 1) * 255).round().astype(np.uint8)
    monkeypatch.setattr(video, "CONVERT_BLOCK_ELEMENTS", 2 * frames[0].size)  # blocks of 2 frames, one of 1
    np.testing.assert_array_equal(video.to_uint8(frames), expected)
    np.testing.assert_array_equal(video.to_rgb_uint8(frames), np.moveaxis(expected, 1, -1))
    assert video.to_uint8(np.float64(0.5)) == 128


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (np.zeros((4, 8), np.uint8), "2 dims"),
        (np.zeros((4, 8, 8, 5), np.uint8), "C in"),
        (np.zeros((4, 8, 8, 3), np.int16), "int16"),
        (np.zeros((0, 8, 8, 3), np.uint8), "0 frames"),
    ],
)
def test_bad_frames_are_rejected(frames, message):
    with pytest.raises((ValueError, TypeError), match=message):
        to_rgb_uint8(frames)


# writing


@pytest.mark.parametrize("suffix", [".mp4", ".webm", ".gif"])
def test_video_round_trip_keeps_frame_count_and_content(tmp_path, suffix):
    levels = [20 * index for index in range(12)]
    path = trajectory_to_video(gray_frames(levels), tmp_path / f"clip{suffix}", fps=10)
    assert path == tmp_path / f"clip{suffix}"
    decoded = iio.imread(path)
    assert decoded.shape[:3] == (12, 16, 16)
    assert np.abs(decoded[..., :3].astype(int).mean(axis=(1, 2, 3)) - levels).max() <= 4


def test_numpy_fps_writes_an_mp4_at_that_rate(tmp_path):
    # an fps read from meta_data is a numpy scalar; imageio-ffmpeg asserted a Python float
    path = trajectory_to_video(gray_frames([0, 100, 200]), tmp_path / "clip.mp4", fps=np.int64(10))
    assert iio.immeta(path, plugin="pyav")["fps"] == 10


def test_odd_sizes_are_padded_for_ffmpeg_but_not_for_gif(tmp_path):
    frames = gray_frames([50] * 3, height=15, width=17)
    assert iio.imread(trajectory_to_video(frames, tmp_path / "odd.mp4")).shape[1:3] == (16, 18)
    assert iio.imread(trajectory_to_video(frames, tmp_path / "odd.gif")).shape[1:3] == (15, 17)


def test_gif_palette_covers_every_frame(tmp_path):
    levels = list(range(0, 240, 6))  # 40 grays, each in one frame only
    decoded = iio.imread(trajectory_to_video(gray_frames(levels, 8, 8), tmp_path / "ramp.gif"))
    assert decoded[:, 0, 0, 0].tolist() == levels


def test_gif_frame_duration_follows_fps(tmp_path):
    path = trajectory_to_video(gray_frames([0, 100, 200]), tmp_path / "slow.gif", fps=4)
    assert iio.immeta(path, index=0)["duration"] == 250


@pytest.mark.parametrize(
    ("suffix", "levels", "fps"),
    [
        (".gif", [0, 100, 200], 0.001),  # 1,000 s a frame: a gif's delay is 16-bit centiseconds
        (".gif", [0] * 700, 1),  # a static stretch: Pillow merges it into one frame of 700 s
        (".webp", [0, 100], 1e-5),
        (".png", [0, 100], 1e-5),
    ],
)
def test_frames_longer_than_the_format_stores_are_refused_naming_fps(tmp_path, suffix, levels, fps):
    # Pillow raised OverflowError("int too big to convert") from deep in its writer
    with pytest.raises(ValueError, match=rf"fps: fps={fps!r} .* makes a frame longer than \{suffix} can store"):
        trajectory_to_video(gray_frames(levels), tmp_path / f"slow{suffix}", fps=fps, progress=False)
    assert list(tmp_path.iterdir()) == []


def _animation(path) -> tuple:
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        colours = [np.asarray(frame.convert("RGB"))[0, 0].tolist() for frame in ImageSequence.Iterator(image)]
        return image.format, image.info.get("duration"), image.info.get("loop"), colours


@pytest.mark.parametrize(
    ("suffix", "kwargs"), [(".gif", {}), (".gif", {"loop": 0}), (".webp", {}), (".png", {}), (".apng", {})]
)
def test_animated_images_are_written_as_the_seed_writes_them(tmp_path, suffix, kwargs):
    """Frames, frame duration and looping match memmap-replay-buffer's: a gif plays once unless
    told ``loop=0``; a webp or (a)png, which the seed wrote through imageio as well, loops."""
    seed_video = pytest.importorskip("memmap_replay_buffer.video")
    frames = gray_frames([0, 50, 100, 150])
    expected = _animation(seed_video.trajectory_to_video(frames, tmp_path / f"seed{suffix}", fps=20, **kwargs))
    assert _animation(trajectory_to_video(frames, tmp_path / f"ours{suffix}", fps=20, **kwargs)) == expected
    assert expected[3] == [[level] * 3 for level in (0, 50, 100, 150)]


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("clip.avi2", {}, "suffix"),
        ("clip", {}, "suffix"),
        ("clip.mp4", {"fps": 0}, "fps"),
        ("clip.mp4", {"fps": float("inf")}, "finite positive number, got inf"),
        ("clip.gif", {"fps": float("nan")}, "fps"),
        ("clip.gif", {"fps": True}, "got True"),
        # imageio-ffmpeg passes 1e-9 as the fraction 0, 1e300 overflows ffmpeg's ints: ffmpeg
        # said only "the encoder wrote nothing"
        ("clip.mp4", {"fps": 1e-9}, r"fps: 1e-09 is outside the frame rates ffmpeg takes for \.mp4"),
        ("clip.webm", {"fps": 1e300}, r"fps: 1e\+300 is outside the frame rates ffmpeg takes for \.webm"),
    ],
)
def test_bad_paths_and_fps_raise_before_writing(tmp_path, name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        trajectory_to_video(gray_frames([0, 1]), tmp_path / name, **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("missing/clip.mp4", FileNotFoundError, "its folder .*missing' does not exist"),
        ("a-file/clip.gif", FileNotFoundError, "its folder .*a-file' is not a folder"),
        ("a-folder.mp4", IsADirectoryError, "a-folder.mp4' is a folder"),
    ],
)
def test_unwritable_output_paths_raise_before_writing(tmp_path, name, error, message):
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "a-folder.mp4").mkdir()
    with pytest.raises(error, match=message):
        trajectory_to_video(gray_frames([0, 1]), tmp_path / name)
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["a-file", "a-folder.mp4"]


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_a_failed_render_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, suffix):
    path = trajectory_to_video(gray_frames([0, 50]), tmp_path / f"clip{suffix}")
    before = path.read_bytes()
    bad = {"codec": "no-such-codec"} if suffix == ".mp4" else {"duration": "not a number"}
    with pytest.raises(Exception):  # noqa: B017 - whatever the writer raises
        trajectory_to_video(gray_frames([100, 150, 200]), path, **bad)
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    trajectory_to_video(gray_frames([100, 150, 200]), path)  # a file already there is replaced
    assert len(iio.imread(path)) == 3


def test_an_output_that_is_a_symlink_is_replaced_never_written_through(tmp_path):
    """A link at the output path (one planted in a shared folder, aimed at a file of the user's)
    is replaced by the video; the file it points to is left as it was."""
    elsewhere = tmp_path / "elsewhere.gif"
    elsewhere.write_bytes(b"the user's file")
    (tmp_path / "clip.gif").symlink_to(elsewhere)
    trajectory_to_video(gray_frames([0, 50]), tmp_path / "clip.gif")
    assert not (tmp_path / "clip.gif").is_symlink() and len(iio.imread(tmp_path / "clip.gif")) == 2
    assert elsewhere.read_bytes() == b"the user's file"


def test_long_renders_show_progress(tmp_path, capsys):
    trajectory_to_video(gray_frames([0] * 5), tmp_path / "short.gif", progress=True)
    assert "rendering short.gif" in capsys.readouterr().err
    trajectory_to_video(gray_frames([0] * 5), tmp_path / "quiet.gif")
    assert "rendering" not in capsys.readouterr().err


# contact sheets


def test_sheet_samples_first_and_last_frames_row_by_row():
    frames = gray_frames(list(range(0, 100, 10)), height=4, width=6)
    sheet = frames_to_sheet(frames, rows=2, columns=3)
    assert sheet.shape == (8, 18, 3)
    tiles = sheet[::4, ::6, 0]
    # frames linspace(0, 9, 6) rounded down, as memmap-replay-buffer picks them
    assert tiles.tolist() == [[0, 10, 30], [50, 70, 90]]


def test_sheet_accepts_grayscale_and_rejects_bad_grid():
    assert frames_to_sheet(np.zeros((3, 4, 4), np.float32), rows=1, columns=2).shape == (4, 8, 3)
    with pytest.raises(ValueError, match="rows"):
        frames_to_sheet(np.zeros((3, 4, 4), np.uint8), rows=0)
    with pytest.raises(ValueError, match="columns"):
        frames_to_sheet(np.zeros((3, 4, 4), np.uint8), columns=2.5)


def test_sheet_over_the_pixel_bound_is_refused_before_it_is_built():
    check_sheet_size(512, 512, 16, 16)  # exactly MAX_SHEET_PIXELS
    with pytest.raises(ValueError, match=r"rows 512 x columns 513: .* 16x16 has 67239936 pixels, over the bound"):
        check_sheet_size(512, 513, 16, 16)
    # channel-first frames are measured as to_rgb_uint8 reads them: (3, 64, 32) is 32 wide
    frames = np.broadcast_to(np.zeros((1, 3, 64, 32), np.float32), (2, 3, 64, 32))
    with pytest.raises(ValueError, match=r"a contact sheet of 33024 frames of 32x64"):
        frames_to_sheet(frames, rows=129, columns=256)
    assert frame_size((3, 64, 32)) == (64, 32) and frame_size((64, 32, 4)) == (64, 32) and frame_size((5, 7)) == (5, 7)


# buffers


def test_image_fields_are_frames_in_declaration_order(buffer):
    assert image_fields(buffer) == ["front", "wrist", "depth"]


def test_default_field_needs_exactly_one_candidate(buffer, tmp_path):
    with pytest.raises(ValueError, match=r"several image-like fields \['front', 'wrist', 'depth'\]"):
        default_image_field(buffer)
    with pytest.raises(ValueError, match="no image-like field.*'reward'"):
        default_image_field(make_plot_only_buffer(tmp_path / "plots"))


def test_episode_frames_reads_stored_steps_and_concatenates_in_time(buffer):
    one = episode_frames(buffer, 1, "front")
    assert one.shape == (STEPS[1], 32, 32, 3)
    assert one[:, 0, 0, 0].tolist() == [gray_level(1, t) for t in range(STEPS[1])]
    several = episode_frames(buffer, [2, 0], "front")
    expected = [gray_level(2, t) for t in range(STEPS[2])] + [gray_level(0, t) for t in range(STEPS[0])]
    assert several[:, 0, 0, 0].tolist() == expected
    assert episode_frames(buffer, np.int64(0), "wrist").shape == (STEPS[0], 3, 32, 32)


def test_episode_frames_of_a_slot_rewritten_shorter_during_the_read_are_its_new_episode_alone(tmp_path):
    """Slot 0 reused by a shorter episode after the first read: its frames are the new
    episode's, as many as it has, between slot 1's; none of the first episode's trail after."""
    from replaybuf import ReplayBuffer

    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=2, max_timesteps=6, fields={"img": ("uint8", (4, 4, 3))}, circular=True
    )
    for level, steps in ((10, 6), (20, 4)):
        writer.store_episode(
            img=np.full((steps, 4, 4, 3), level, np.uint8) + np.arange(steps, dtype=np.uint8)[:, None, None, None]
        )
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    read_rows, reads = reader.storage.read_rows, []

    def reuse_slot_0_after_the_first_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        reads.append((list(map(int, episodes)), t1))
        if len(reads) == 1:
            writer.store_episode(img=np.full((2, 4, 4, 3), 30, np.uint8))
        return rows

    reader.storage.read_rows = reuse_slot_0_after_the_first_read
    frames = episode_frames(reader, [1, 0, 1], "img")
    assert reads == [([0, 1], 6), ([0], 4)]
    assert frames[:, 0, 0, 0].tolist() == [20, 21, 22, 23, 30, 30, 20, 21, 22, 23]


def test_episode_indices_may_be_integer_tensors_and_arrays_as_the_seeds_are(buffer):
    """``save_video(path, episode_index=torch.tensor([0, 2]))`` renders in memmap-replay-buffer
    (a loop over the ids a sampler returned); replaybuf refused it: 'expected ints, got tensor(0)'."""
    torch = pytest.importorskip("torch")
    expected = episode_frames(buffer, [0, 2], "front")
    for given in (torch.tensor([0, 2]), np.array([0, 2], np.uint8), [torch.tensor(0), np.int64(2)]):
        assert np.array_equal(episode_frames(buffer, given, "front"), expected)
    assert np.array_equal(episode_frames(buffer, torch.tensor(2), "front"), episode_frames(buffer, 2, "front"))
    for refused in (torch.tensor([True]), torch.tensor([0.0]), np.array([1.0]), torch.tensor(1.0), np.bool_(True)):
        with pytest.raises(TypeError, match="episode_index: expected"):
            episode_frames(buffer, refused, "front")


@pytest.mark.parametrize(
    ("episodes", "field", "error", "message"),
    [
        (3, "front", ValueError, "episode 3 is out of range, the buffer has 3 episodes"),
        ([0, -1], "front", ValueError, "episode -1 is out of range"),
        ([], "front", ValueError, "empty list"),
        ("0", "front", TypeError, "expected ints"),
        (True, "front", TypeError, "episode_index"),
        (0, "camera", ValueError, r"unknown field 'camera'.*image-like: \['front', 'wrist', 'depth'\]"),
        (0, None, ValueError, "several image-like fields"),
    ],
)
def test_episode_frames_errors_name_the_problem(buffer, episodes, field, error, message):
    with pytest.raises(error, match=message):
        episode_frames(buffer, episodes, field)


@pytest.mark.parametrize("field", ["front", "wrist", "depth"])
def test_save_video_renders_each_layout(buffer, tmp_path, field):
    path = save_video(buffer, tmp_path / f"{field}.mp4", episode_index=[0, 2], field=field, fps=15)
    decoded = iio.imread(path)
    assert decoded.shape == (STEPS[0] + STEPS[2], 32, 32, 3)


def test_save_video_of_a_field_without_frames_names_the_image_fields(buffer, tmp_path):
    """It failed inside the encoder with 'frames: expected (T, H, W) ... got shape (5, 4)'."""
    with pytest.raises(ValueError, match=r"'action' holds values of shape \(4,\) per step, not image frames; "):
        save_video(buffer, tmp_path / "a.mp4", field="action")
    assert list(tmp_path.iterdir()) == []


def test_save_video_of_frames_of_a_dtype_that_is_no_image_names_the_dtype(tmp_path):
    """A uint16 depth camera of (H, W) frames was refused as 'holds values of shape (8, 8) per
    step, not image frames': its shape is a frame's, its dtype is what is refused."""
    depth = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=2, fields={"depth": ("uint16", (8, 8))})
    depth.store_episode(depth=np.zeros((2, 8, 8), np.uint16))
    with pytest.raises(ValueError, match=r"'depth' .* its dtype is uint16, frames are uint8, bool or float values"):
        save_video(depth, tmp_path / "a.mp4", field="depth")
    assert not (tmp_path / "a.mp4").exists()


def test_save_video_checks_the_suffix_before_reading(buffer, tmp_path):
    with pytest.raises(ValueError, match="suffix"):
        save_video(buffer, tmp_path / "episode.txt", field="front")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    not hasattr(__import__("replaybuf").ReplayBuffer, "save_video"),
    reason="ReplayBuffer.image_fields/episode_frames/save_video not added to buffer.py yet (they delegate to replaybuf.video)",
)
def test_buffer_methods_match_the_seed_api(buffer, tmp_path):
    assert buffer.image_fields() == ["front", "wrist", "depth"]
    assert np.array_equal(buffer.episode_frames([1, 0], field="front"), episode_frames(buffer, [1, 0], "front"))
    path = buffer.save_video(tmp_path / "episodes.gif", episode_index=[0, 1], field="depth", fps=10)
    assert iio.imread(path).shape[0] == STEPS[0] + STEPS[1]
    with pytest.raises(ValueError, match="several image-like fields"):
        buffer.save_video(tmp_path / "episode.mp4")
