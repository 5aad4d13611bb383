"""``inspect-replay-buffer`` and ``replaybuf``: outputs written, usage errors, serving."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from replaybuf.cli import Command, commands, inspect_main, main, register_command
from tests._viewer_data import STEPS, gray_level, make_image_buffer
from tests._viewer_s3 import moto_s3

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def buffer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "demos"
    make_image_buffer(folder).close()
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def usage_error(capsys, entry, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        entry(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


# outputs


def test_default_output_is_named_after_the_buffer_and_episodes(buffer_folder, workdir, capsys):
    assert inspect_main([str(buffer_folder), "--field", "front", "--episode", "0,2"]) == 0
    path = workdir / "demos-episode-0-2.mp4"
    assert f"wrote {path.name}" in capsys.readouterr().out
    decoded = iio.imread(path)
    assert decoded.shape == (STEPS[0] + STEPS[2], 32, 32, 3)
    expected = [gray_level(0, t) for t in range(STEPS[0])] + [gray_level(2, t) for t in range(STEPS[2])]
    assert np.abs(decoded[:, 16, 16, 0].astype(int) - expected).max() <= 4


def test_default_output_of_the_current_folder_is_named_after_it_as_the_seeds(tmp_path, monkeypatch, capsys):
    """``inspect-replay-buffer .`` inside a buffer: the seed names the output after the folder
    (``Path(folder).resolve().name``); replaybuf wrote ``replay-episode-0.mp4``."""
    make_image_buffer(tmp_path / "demos", steps=(2,)).close()
    monkeypatch.chdir(tmp_path / "demos")
    assert inspect_main([".", "--field", "front"]) == 0
    assert "wrote demos-episode-0.mp4" in capsys.readouterr().out
    assert (tmp_path / "demos" / "demos-episode-0.mp4").is_file()


def test_inspect_renders_every_field_from_the_same_episode_while_a_writer_reuses_its_slot(tmp_path, monkeypatch):
    """Each field was read just before its video was rendered: a writer reusing the slot after
    the first field's read made ``front`` show the old episode and ``wrist`` the new one, written
    (and served side by side) as one episode's cameras."""
    import replaybuf.cli
    from replaybuf import ReplayBuffer

    fields = {"front": ("uint8", (8, 8, 3)), "wrist": ("uint8", (8, 8, 3))}
    writer = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=4, fields=fields, circular=True)
    writer.store_episode(front=np.full((4, 8, 8, 3), 50, np.uint8), wrist=np.full((4, 8, 8, 3), 50, np.uint8))
    writer.flush()
    convert, written = replaybuf.cli.to_rgb_uint8, []

    def convert_then_write(frames):  # the writer reuses the slot once the first field is converted
        if not written:
            new = np.full((4, 8, 8, 3), 200, np.uint8)
            written.append(writer.store_episode(front=new, wrist=new))
            writer.flush()
        return convert(frames)

    monkeypatch.setattr(replaybuf.cli, "to_rgb_uint8", convert_then_write)
    out = tmp_path / "out.gif"
    assert inspect_main([str(tmp_path / "b"), "-f", "front,wrist,front", "-o", str(out)]) == 0
    assert [iio.imread(tmp_path / f"out.{field}.gif")[0, 4, 4, 0] for field in fields] == [50, 50]
    assert sorted(path.name for path in tmp_path.glob("out*")) == ["out.front.gif", "out.wrist.gif"]
    writer.close()


@pytest.mark.parametrize(
    "shape, scale, reported",
    [((8, 6, 3), 2, (4, 3, 3)), ((8, 6), 2, (4, 3)), ((8, 6, 4), 2, (4, 3, 4)), ((3, 8, 6), 1, (3, 8, 6))],
    # (the seed's own contact sheet of channel-first frames fails: none is asked for there)
    ids=["rgb", "gray", "rgba", "channel-first"],
)
def test_report_lines_are_the_seeds(tmp_path, monkeypatch, capsys, shape, scale, reported):
    """What ``inspect-replay-buffer`` prints for each file matches memmap-replay-buffer's lines:
    the frames' shape as stored, scaled (replaybuf printed the shape it converted them to, (H, W, 3),
    for gray, RGBA and channel-first frames)."""
    seed = pytest.importorskip("memmap_replay_buffer")
    from memmap_replay_buffer.video import main as seed_main

    folder = tmp_path / "images"
    images = seed.ReplayBuffer(folder, max_episodes=2, max_timesteps=4, fields=dict(front=("uint8", shape)))
    images.store_episode(front=np.zeros((4, *shape), np.uint8))
    images.flush()
    sheet = len(shape) == 2 or shape[-1] in (3, 4)
    argv = [str(folder), "-f", "front", "-o", "out.gif", "--fps", "5", "--scale", str(scale)]
    argv += ["--sheet", "sheet.png"] if sheet else []
    printed = []
    for name, entry in (("seed", seed_main), ("ours", inspect_main)):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        entry(argv)
        printed.append(capsys.readouterr().out)
    assert (
        printed[1]
        == printed[0]
        == f"wrote out.gif (4 frames of {reported} at 5 fps)\n"
        + ("wrote sheet.png (2x5 contact sheet)\n" if sheet else "")
    )


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_two_cameras_render_as_the_seeds_on_every_backend(tmp_path, monkeypatch, capsys, backend):
    """The seed README's multi-camera command on a buffer of each backend writes the files, the
    report lines and the sheets (lossless PNG, every pixel) that memmap-replay-buffer writes for
    the same episodes, and videos of the same frame counts and sizes."""
    seed = pytest.importorskip("memmap_replay_buffer")
    from memmap_replay_buffer.video import main as seed_main

    import replaybuf

    if backend == "hdf5":
        pytest.importorskip("h5py")
    rng = np.random.default_rng(0)
    episodes = [rng.integers(0, 256, (n, 8, 6, 3), dtype=np.uint8) for n in (3, 5)]
    args = dict(max_episodes=3, max_timesteps=5, fields=dict(front=("uint8", (8, 6, 3)), wrist=("uint8", (8, 6, 3))))
    buffers = {
        "seed": seed.ReplayBuffer(tmp_path / "b-seed", **args),
        "ours": replaybuf.ReplayBuffer(tmp_path / "b-ours", backend=backend, **args),
    }
    for buffer in buffers.values():
        for frames in episodes:
            buffer.store_episode(front=frames, wrist=255 - frames)
        buffer.flush()
    written = {}
    for name, entry in (("seed", seed_main), ("ours", inspect_main)):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        argv = [str(tmp_path / f"b-{name}"), "-e", "1,0", "-f", "front,wrist", "-o", "r.gif", "--sheet", "s.png"]
        argv += ["--rows", "2", "--columns", "2"]
        assert entry(argv) in (None, 0)
        written[name] = (capsys.readouterr().out.replace(f"b-{name}", "b"), sorted(os.listdir(tmp_path / name)))
    assert written["ours"] == written["seed"]
    assert written["seed"][1] == ["r.front.gif", "r.wrist.gif", "s.front.png", "s.wrist.png"]
    for file in written["seed"][1]:
        theirs, ours = iio.imread(tmp_path / "seed" / file), iio.imread(tmp_path / "ours" / file)
        assert ours.shape == theirs.shape, file
        if file.endswith(".png"):
            np.testing.assert_array_equal(ours, theirs, err_msg=file)


def test_several_fields_write_one_video_and_sheet_each(buffer_folder, workdir):
    argv = [
        str(buffer_folder),
        "-e",
        "1",
        "-f",
        "front,wrist",
        "-o",
        "replay.gif",
        "--scale",
        "2",
        "--sheet",
        "sheet.png",
        "--rows",
        "1",
        "--columns",
        "3",
        "--fps",
        "12.5",
    ]
    assert inspect_main(argv) == 0
    assert sorted(path.name for path in workdir.iterdir()) == [
        "replay.front.gif",
        "replay.wrist.gif",
        "sheet.front.png",
        "sheet.wrist.png",
    ]
    assert iio.imread(workdir / "replay.wrist.gif").shape == (STEPS[1], 16, 16, 3)
    sheet = iio.imread(workdir / "sheet.front.png")
    assert sheet.shape == (16, 48, 3)
    assert sheet[0, ::16, 0].tolist() == [gray_level(1, 0), gray_level(1, 9), gray_level(1, STEPS[1] - 1)]


def test_without_field_every_image_field_is_rendered(buffer_folder, workdir):
    assert main(["inspect", str(buffer_folder), "--output", "all.mp4"]) == 0
    assert sorted(path.name for path in workdir.iterdir()) == ["all.depth.mp4", "all.front.mp4", "all.wrist.mp4"]


# usage errors


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--episode", "0,x"], "invalid episode list '0,x'"),
        (["--episode", ","], "at least one index"),
        (["--episode", "-1"], "must be >= 0"),
        (["--episode", "0,5"], r"--episode: \[5\] out of range, the buffer has 3 episodes \(valid: 0..2\)"),
        (
            ["--field", "camera"],
            r"unknown field\(s\) \['camera'\], image-like fields are \['front', 'wrist', 'depth'\]",
        ),
        (["--field", "reward"], r"\['reward'\] do not hold image frames"),
        (["--fps", "0"], "positive number"),
        (["--fps", "inf"], "positive number, got 'inf'"),
        (["--fps", "nan"], "positive number, got 'nan'"),
        (["--fps", "fast"], "positive number, got 'fast'"),
        (["--scale", "0"], "positive integer"),
        (["--scale", "1.5"], "positive integer, got '1.5'"),
        (["--output", "replay.txt"], "unsupported suffix"),
        (["--sheet", "sheet.mp4"], "image path"),
        (["--serve", "99999"], "invalid port"),
        # 32x32 frames: 1000 x 1000 of them would be a ~3 GB sheet, refused before any video is written
        (
            ["--sheet", "sheet.png", "--rows", "1000", "--columns", "1000"],
            r"--rows 1000 x --columns 1000: a contact sheet of 1000000 frames of 32x32 has 1024000000 pixels, "
            r"over the bound of 67108864",
        ),
        (["--sheet", "sheet.png", "--rows", "1", "--columns", "65537"], r"--columns 65537: .* over the bound"),
    ],
)
def test_inspect_usage_errors_exit_2_without_writing(buffer_folder, workdir, capsys, extra, message):
    error = usage_error(capsys, inspect_main, [str(buffer_folder), *extra])
    assert error.startswith("usage: inspect-replay-buffer")
    assert re.search(message, error), error
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--output", "missing/replay.mp4"], r"output 'missing/replay.front.mp4': its folder 'missing' does not exist"),
        (["--output", "a-file/replay.mp4"], r"its folder 'a-file' is not a folder"),  # ffmpeg failed silently here
        (["--output", "a-folder.mp4", "--field", "front"], r"output 'a-folder.mp4' is a folder"),
        (["--output", "replay.mp4", "--sheet", "missing/sheet.png"], r"'missing/sheet.front.png': its folder"),
    ],
)
def test_unwritable_outputs_exit_2_before_rendering_anything(buffer_folder, workdir, capsys, extra, message):
    (workdir / "a-file").write_text("mine")
    (workdir / "a-folder.mp4").mkdir()
    error = usage_error(capsys, inspect_main, [str(buffer_folder), *extra])
    assert re.search(message, error), error
    assert sorted(path.name for path in workdir.rglob("*")) == ["a-file", "a-folder.mp4"]
    assert (workdir / "a-file").read_text() == "mine"


def test_a_buffer_another_process_writes_is_refused_with_status_1_not_a_traceback(tmp_path, capsys):
    """verify --repair (and import into it) beside a live writer raised BufferLockedError's traceback."""
    folder = str(tmp_path / "held")
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests._lease_child",
            "hold",
            json.dumps({"location": folder, "kwargs": {"max_episodes": 4, "max_timesteps": 3}}),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().startswith("ready"), f"the writer did not start (exit {child.wait()})"
        assert main(["verify", folder, "--repair"]) == 1
        error = capsys.readouterr().err
        assert error.startswith("replaybuf verify: verify --repair:") and "is being written by pid" in error
        assert "Traceback" not in error
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_a_missing_buffer_is_a_usage_error(workdir, capsys):
    error = usage_error(capsys, inspect_main, [str(workdir / "nothing")])
    assert "inspect-replay-buffer: error:" in error and "nothing" in error


def test_several_image_fields_and_field_none_is_not_an_error_but_none_at_all_is(tmp_path, workdir, capsys):
    from replaybuf import ReplayBuffer

    plots = ReplayBuffer(tmp_path / "plots", max_episodes=1, max_timesteps=4, fields={"reward": "float"})
    plots.store_episode(reward=np.zeros(4, np.float32))
    plots.close()
    assert "has no image-like field" in usage_error(capsys, inspect_main, [str(tmp_path / "plots")])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["explode"], "invalid choice: 'explode'"),
        (["view"], "the following arguments are required: FOLDER_OR_URL"),
        (["view", "x", "--port", "http"], "invalid port 'http'"),
        (["view", "x", "--scale", "-2"], "positive integer"),
        (["view", "x", "--cache-mb", "0"], "argument --cache-mb: expected a positive integer, got '0'"),
        (["view", "definitely/not/here", "--no-browser"], "no replaybuf buffer found"),
    ],
)
def test_replaybuf_usage_errors_exit_2(capsys, argv, message):
    assert message in usage_error(capsys, main, argv)


def test_view_reports_a_busy_port(buffer_folder, capsys):
    from replaybuf import ReplayBuffer
    from replaybuf.viewer import BufferApp, ViewerServer

    with ViewerServer(BufferApp(ReplayBuffer.from_folder(buffer_folder, read_only=True))) as busy:
        error = usage_error(capsys, main, ["view", str(buffer_folder), "--port", str(busy.port), "--no-browser"])
    assert f"cannot listen on 127.0.0.1:{busy.port}" in error


def test_inspect_serve_reports_a_busy_port_before_rendering(buffer_folder, workdir, capsys):
    """It rendered every video first (into a temp folder it then removed), then failed."""
    from replaybuf import ReplayBuffer
    from replaybuf.viewer import BufferApp, ViewerServer

    with ViewerServer(BufferApp(ReplayBuffer.from_folder(buffer_folder, read_only=True))) as busy:
        argv = [str(buffer_folder), "--serve", str(busy.port), "--no-browser", "--output", "replay.mp4"]
        error = usage_error(capsys, inspect_main, argv)
    assert f"cannot listen on 127.0.0.1:{busy.port}" in error
    assert list(workdir.iterdir()) == [], "nothing rendered"


def test_every_command_takes_the_store_options(capsys):
    """README: every command that takes a location accepts --storage-options, --anon and
    --endpoint-url (unlock had --storage-options only)."""
    for name in set(commands) - {"upgrade"}:  # upgrade rewrites local folders only
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        for option in ("--storage-options JSON", "--anon", "--endpoint-url URL"):
            assert option in text, f"replaybuf {name} lacks {option}"


def test_verify_of_a_mistyped_path_is_a_usage_error(workdir, capsys):
    """It printed 'cannot open the buffer' as a finding (exit 1), unlike every other command."""
    assert "no replaybuf or memmap-replay-buffer buffer at 'nope'" in usage_error(capsys, main, ["verify", "nope"])


def test_unlock_of_a_mistyped_path_is_an_error(workdir, capsys):
    """It printed 'no writer lease held' and exited 0 for a folder that does not exist."""
    assert "no replaybuf buffer (nor writer lease) at 'nope'" in usage_error(capsys, main, ["unlock", "nope"])
    assert not (workdir / "nope").exists()
    assert "invalid JSON '{bad'" in usage_error(capsys, main, ["unlock", "nope", "--storage-options", "{bad"])


@pytest.mark.parametrize(
    ("entry", "argv", "expected"),
    [
        (main, ["--help"], "view"),
        (main, ["inspect", "--help"], "--sheet"),
        (main, ["view", "--help"], "--port"),
        (inspect_main, ["--help"], "--serve [PORT]"),
    ],
)
def test_help_lists_the_options(capsys, entry, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        entry(argv)
    assert exit_info.value.code == 0
    assert expected in capsys.readouterr().out


def test_commands_register_once_unless_clobbered():
    assert {"inspect", "view"} <= set(commands)
    with pytest.raises(ValueError, match="'view' is already registered"):
        register_command(Command("view", "again", lambda parser: None, lambda args: 0))
    with pytest.raises(TypeError):
        commands["other"] = commands["view"]


# serving, as a user runs it


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_cli(args, cwd, temp_dir):
    """The command in a child started with SIGINT ignored, as a shell without job control starts
    a background job (its Python then installs no Ctrl-C handler): ``stop_cli``'s SIGINT must
    stop it all the same."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "TMPDIR": str(temp_dir)}
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        match = re.match(r"serving http://127\.0\.0\.1:(\d+)/", line)
        if match:
            return process, int(match[1]), lines
    process.wait(timeout=30)
    raise AssertionError(f"the server did not start: {lines} {process.stderr.read()}")


def get(port, path, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", path, headers=headers or {})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, response.getheader("Content-Range"), body


def stop_cli(process):
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    process.stdout.close()
    process.stderr.close()


def test_inspect_serve_renders_to_a_temp_dir_serves_ranges_and_cleans_up(buffer_folder, tmp_path):
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    process, port, lines = start_cli(
        [
            "replaybuf.cli",
            "inspect",
            str(buffer_folder),
            "-e",
            "0",
            "-f",
            "front,wrist",
            "--serve",
            "0",
            "--no-browser",
        ],
        tmp_path,
        temp_dir,
    )
    try:
        written = [Path(re.match(r"wrote (\S+)", line)[1]) for line in lines if line.startswith("wrote ")]
        assert [path.name for path in written] == ["replay.front.mp4", "replay.wrist.mp4"]
        status, _, body = get(port, "/api/info")
        info = json.loads(body)
        assert (status, info["frames"], info["episodes"], list(info["videos"])) == (
            200,
            STEPS[0],
            [0],
            ["front", "wrist"],
        )
        status, content_range, body = get(port, "/video/wrist", {"Range": "bytes=0-99"})
        assert (status, len(body)) == (206, 100)
        assert content_range == f"bytes 0-99/{written[1].stat().st_size}"
    finally:
        stop_cli(process)
    assert written[0].parent.parent == temp_dir
    assert list(temp_dir.iterdir()) == []
    assert [path.name for path in tmp_path.iterdir()] == ["tmp"]


def test_inspect_serve_of_a_gif_writes_it_and_serves_an_mp4_the_page_can_play(buffer_folder, workdir, monkeypatch):
    # a <video> cannot play a gif (nor webp, png, avi): the page showed "could not be loaded"
    from replaybuf.viewer import ViewerServer

    answers = []

    def serve_once(server, open_browser=True):
        answers.append(get(server.start().port, "/video/front"))
        server.stop()

    monkeypatch.setattr(ViewerServer, "serve_forever", serve_once)
    monkeypatch.setattr(tempfile, "tempdir", str(workdir / "tmp"))
    (workdir / "tmp").mkdir()
    assert inspect_main([str(buffer_folder), "-f", "front", "-o", "out.gif", "--serve", "0"]) == 0
    [(status, _, body)] = answers
    assert (status, body[4:8]) == (200, b"ftyp")  # an mp4
    assert len(iio.imread(body, extension=".mp4")) == len(iio.imread(workdir / "out.gif")) == STEPS[0]
    assert list((workdir / "tmp").iterdir()) == []  # the mp4 went with the server


def test_view_serves_the_buffer_until_interrupted_then_drops_its_cache(buffer_folder, tmp_path):
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    process, port, _ = start_cli(
        ["replaybuf", "view", str(buffer_folder), "--port", "0", "--no-browser"], tmp_path, temp_dir
    )
    try:
        assert [path.name[:15] for path in temp_dir.iterdir()] == ["replaybuf-view-"]
        status, _, body = get(port, "/api/episodes")
        assert status == 200
        assert json.loads(body)["lengths"] == list(STEPS)
        assert get(port, "/video/episodes/0/front.mp4")[0] == 200
    finally:
        stop_cli(process)
    assert list(temp_dir.iterdir()) == []


# remote buffers


@pytest.fixture(scope="module")
def s3_options():
    with moto_s3() as options:
        yield options


def test_inspect_and_view_read_a_buffer_on_s3(s3_options, workdir, capsys):
    s3fs = pytest.importorskip("s3fs", reason="remote buffers need replaybuf[s3]")
    from replaybuf.viewer import BufferApp, ViewerServer

    url = "s3://demos/run-1"
    steps = (5, 4, 3)
    # written locally and uploaded: this test is about reading (writing to S3 is the core's to test)
    make_image_buffer(workdir / "local", steps=steps).close()
    s3fs.S3FileSystem(**s3_options, skip_instance_cache=True).put(str(workdir / "local"), "demos/run-1", recursive=True)
    shutil.rmtree(workdir / "local")
    options = json.dumps(s3_options)
    assert inspect_main([url, "--storage-options", options, "-f", "front", "-e", "2"]) == 0
    assert iio.imread(workdir / "run-1-episode-2.mp4").shape == (steps[2], 32, 32, 3)

    from replaybuf.cli import open_buffer

    with ViewerServer(BufferApp(open_buffer(url, s3_options), location=url)) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("GET", "/api/episodes")
        assert json.loads(connection.getresponse().read())["lengths"] == list(steps)
        connection.request("GET", "/video/episodes/1/wrist.mp4", headers={"Range": "bytes=0-9"})
        response = connection.getresponse()
        assert (response.status, len(response.read())) == (206, 10)
        connection.close()
    assert "invalid JSON" in usage_error(capsys, main, ["view", url, "--storage-options", "{endpoint"])


def test_the_package_and_its_command_line_start_without_torch_or_dask(tmp_path):
    """torch and dask are imported by the loaders and analysis on first use, not by
    ``import replaybuf``: the command line starts in well under a second instead of seconds."""
    code = (
        "import sys, numpy as np, replaybuf, replaybuf.cli\n"
        f"b = replaybuf.ReplayBuffer({str(tmp_path / 'b')!r}, 2, 3, fields=dict(x='float'))\n"
        "b.store_episode(x=np.arange(3.0))\n"
        "print(sorted(m for m in ('torch', 'dask') if m in sys.modules))\n"
        "replaybuf.ReplayDataset\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[:2] == ["[]", "True"]


def test_version(capsys):
    """`replaybuf --version` said "the following arguments are required: COMMAND"."""
    import replaybuf

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"replaybuf {replaybuf.__version__}"
