"""The viewer attacked: foreign origins, frames no encoder takes, huge episodes, foreign files in
its cache. Real servers on 127.0.0.1 and real requests; nothing leaves loopback."""

from __future__ import annotations

import http.client
import json
import shutil
import tracemalloc

import imageio.v3 as iio
import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.viewer import BufferApp, ViewerServer, apps
from tests._viewer_data import make_image_buffer


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    return make_image_buffer(tmp_path_factory.mktemp("hostile") / "buffer")


@pytest.fixture
def server(buffer):
    with ViewerServer(BufferApp(buffer, location="hostile", fps=10)) as server:
        yield server


def request(server, path, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


# cross-origin requests from browsers that send no Sec-Fetch-Site


@pytest.mark.parametrize("origin", ["http://attacker.example", "null", "http://127.0.0.1:1", "http://localhost"])
def test_a_fetch_naming_another_origin_is_refused_before_anything_is_rendered(server, origin):
    for path in ("/api/info", "/api/episodes/0", "/video/episodes/0/front.mp4"):
        status, headers, body = request(server, path, headers={"Origin": origin})
        assert (status, headers["Content-Type"]) == (403, "application/json"), path
        assert "another site" in json.loads(body)["error"]
    assert list(server.app.cache_dir.glob("*.mp4")) == []


def test_the_servers_own_origin_is_served(server):
    for host in ("127.0.0.1", "localhost"):
        status, _, body = request(server, "/api/episodes/0", headers={"Origin": f"http://{host}:{server.port}"})
        assert status == 200 and json.loads(body)["index"] == 0


# frames no encoder takes


@pytest.mark.parametrize(("shape", "size"), [((1, 20000, 3), "20000x2"), ((16385, 2), "2x16386")])
def test_frames_too_large_for_the_encoder_are_refused_naming_the_field_before_they_are_read(
    tmp_path, monkeypatch, shape, size
):
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=2, fields={"strip": ("uint8", shape)})
    buffer.store_episode(strip=np.full((2, *shape), 9, np.uint8))
    with ViewerServer(BufferApp(buffer)) as server:
        read_rows, frames_read = buffer.storage.read_rows, []
        monkeypatch.setattr(
            buffer.storage, "read_rows", lambda name, *a, **kw: frames_read.append(name) or read_rows(name, *a, **kw)
        )
        status, _, body = request(server, "/video/episodes/0/strip.mp4")
        assert status == 400
        error = json.loads(body)["error"]
        assert f"field 'strip': {size} frames are larger than the 16384 pixels a side" in error
        assert frames_read == [] and list(server.app.cache_dir.iterdir()) == [server.app.cache_dir / ".lock"]
    buffer.close()


def test_trajectory_to_video_names_the_encoders_limit_and_writes_nothing(tmp_path):
    from replaybuf.video import trajectory_to_video

    with pytest.raises(ValueError, match="16386x2 frames are larger than the 16384 pixels a side that libx264"):
        trajectory_to_video(np.zeros((2, 2, 16385, 3), np.uint8), tmp_path / "wide.mp4")
    assert list(tmp_path.iterdir()) == []
    assert trajectory_to_video(np.zeros((2, 2, 16384, 3), np.uint8), tmp_path / "edge.mp4").stat().st_size > 0
    assert trajectory_to_video(np.zeros((2, 2, 16385, 3), np.uint8), tmp_path / "wide.webm").stat().st_size > 0


# a long episode renders in the memory of a block of frames, not of the episode


def red_levels(video: bytes) -> list[int]:
    return [int(frame[4, 4, 0]) for frame in iio.imread(video, extension=".mp4")]


def ramp_episode(length: int, offset: float = 0.0) -> np.ndarray:
    """Channel-first float frames whose red level climbs with the step (0 .. 1 - offset)."""
    frames = np.zeros((length, 3, 64, 64), np.float32)
    frames[:, 0] = (np.arange(length) / (length - 1) * (1 - offset))[:, None, None]
    return frames


def test_a_long_episode_renders_block_by_block_within_a_blocks_memory(tmp_path, monkeypatch):
    length, frame_bytes = 480, 3 * 64 * 64 * 4  # 23.6 MB of float frames, rendered 10 (0.5 MB) at a time
    # room for 8 episodes: over the 64 MiB the buffer keeps in RAM whole (SMALL_ARRAY_BYTES)
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=8, max_timesteps=length, fields={"cam": ("float", (3, 64, 64))})
    buffer.store_episode(cam=ramp_episode(length))
    monkeypatch.setattr(apps, "RENDER_BLOCK_BYTES", 10 * frame_bytes)
    app = BufferApp(buffer)
    try:
        tracemalloc.start()
        try:
            video = app.render(0, "cam").read_bytes()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < length * frame_bytes // 4, f"peak {peak} bytes"  # measured: ~5 blocks
        expected = np.round(np.arange(length) / (length - 1) * 255)
        assert np.abs(np.array(red_levels(video)) - expected).max() <= 3  # every block, in order
    finally:
        app.close()
        buffer.close()


def test_a_slot_rewritten_mid_render_is_refused_and_the_next_request_renders_the_new_episode(tmp_path, monkeypatch):
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=1, max_timesteps=60, fields={"cam": ("float", (3, 64, 64))}, circular=True
    )
    writer.store_episode(cam=ramp_episode(60))
    monkeypatch.setattr(apps, "RENDER_BLOCK_BYTES", 20 * 3 * 64 * 64 * 4)
    reads, read = [], apps.read_episodes_consistent

    def rewritten_after_the_first_block(*args, **kwargs):
        if len(reads) == 1:
            writer.store_episode(cam=ramp_episode(60, offset=0.5))  # into slot 0, mid-render
        reads.append(kwargs.get("t0", 0))
        return read(*args, **kwargs)

    monkeypatch.setattr(apps, "read_episodes_consistent", rewritten_after_the_first_block)
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(tmp_path / "b", read_only=True))) as server:
        status, _, body = request(server, "/video/episodes/0/cam.mp4")
        assert (status, reads) == (400, [0, 20])
        assert "episode 0 was rewritten while its 'cam' video was rendered" in json.loads(body)["error"]
        assert list(server.app.cache_dir.iterdir()) == [server.app.cache_dir / ".lock"]
        status, _, video = request(server, "/video/episodes/0/cam.mp4")
        assert status == 200 and abs(red_levels(video)[-1] - 128) <= 3  # the new episode, whole
    writer.close()


# the video cache's folder holds files that are not the viewer's


def test_a_stopping_server_deletes_only_its_own_files_from_its_cache_folder(buffer, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the viewer's")
    server = ViewerServer(BufferApp(buffer)).start()
    folder = server.app.cache_dir
    assert request(server, "/video/episodes/0/front.mp4")[0] == 200
    (folder / "notes.txt").write_text("someone's")  # put there while it served
    link = folder / "episode-9-gen-1-open-0.front.mp4"  # a viewer's name, but a link it never made
    link.symlink_to(outside)
    server.stop()
    assert sorted(path.name for path in folder.iterdir()) == [link.name, "notes.txt"]
    assert outside.read_text() == "not the viewer's"
    shutil.rmtree(folder)


# a long episode's series are thinned to what a plot can show


def long_series_buffer(folder, length: int) -> ReplayBuffer:
    buffer = ReplayBuffer(
        folder, max_episodes=1, max_timesteps=length, fields={"reward": "float", "action": ("float", 3)}
    )
    steps = np.arange(length, dtype=np.float32)
    buffer.store_episode(reward=steps, action=np.stack([steps, -steps, steps * 2], axis=1))
    return buffer


def test_a_long_episodes_series_hold_every_nth_step_up_to_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(apps, "MAX_SERIES_POINTS", 50)
    buffer = long_series_buffer(tmp_path / "b", 1001)  # 21 steps a point: 48 points
    with ViewerServer(BufferApp(buffer)) as server:
        status, _, body = request(server, "/api/episodes/0")
        episode = json.loads(body)
        assert (status, episode["length"], episode["series_stride"]) == (200, 1001, 21)
        assert episode["series"]["reward"] == list(range(0, 1001, 21))
        assert episode["series"]["action"][-1] == [987, -987, 1974]
    buffer.close()
    short = long_series_buffer(tmp_path / "short", 50)  # at the bound: every step
    with ViewerServer(BufferApp(short)) as server:
        episode = json.loads(request(server, "/api/episodes/0")[2])
        assert (episode["series_stride"], episode["series"]["reward"]) == (1, list(range(50)))
    short.close()


def test_inspect_refuses_frames_too_large_for_mp4_before_reading_and_renders_them_to_webm(
    tmp_path, capsys, monkeypatch
):
    from replaybuf import cli
    from replaybuf.cli import inspect_main

    read, episodes_read = cli.episode_frames_by_field, []
    monkeypatch.setattr(cli, "episode_frames_by_field", lambda *args: episodes_read.append(args[1]) or read(*args))
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=2, fields={"strip": ("uint8", (2, 16385))})
    buffer.store_episode(strip=np.full((2, 2, 16385), 9, np.uint8))
    buffer.close()
    with pytest.raises(SystemExit) as exit_info:
        inspect_main([str(tmp_path / "b"), "--output", str(tmp_path / "strip.mp4")])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in error
    assert "--field strip: 16386x2 frames are larger than the 16384 pixels a side" in error
    assert episodes_read == []
    assert inspect_main([str(tmp_path / "b"), "--output", str(tmp_path / "strip.webm"), "--scale", "2"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["b", "strip.webm"]


@pytest.mark.parametrize("destination", ["iframe", "frame", "embed", "object"])
def test_another_sites_page_cannot_frame_the_viewer(server, destination):
    framed = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": destination}
    for path in ("/", "/video/episodes/0/front.mp4"):
        status, _, body = request(server, path, headers=framed)
        assert status == 403 and "another site" in json.loads(body)["error"], path
    assert list(server.app.cache_dir.glob("*.mp4")) == []
    opened = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    status, headers, _ = request(server, "/", headers=opened)
    assert status == 200 and headers["X-Frame-Options"] == "DENY"
    policy = headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self';" in policy and "unsafe" not in policy


# malformed requests


def raw_request(server, data: bytes) -> tuple[int, dict, bytes]:
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(data)
        response = http.client.HTTPResponse(connection)
        response.begin()
        return response.status, dict(response.getheaders()), response.read()


@pytest.mark.parametrize(
    ("data", "status", "message"),
    [
        (
            b"POST /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n",
            501,
            "Unsupported method ('POST')",
        ),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "Request-URI Too Long"),
        (b"GET /api/info HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431, "Too many headers"),
        (b"GET /api/ info HTTP/1.1\r\n\r\n", 400, "Bad request syntax"),
    ],
    ids=["POST", "a 70 kB path", "101 headers", "a space in the path"],
)
def test_malformed_requests_are_refused_in_json_with_the_usual_headers(server, data, status, message):
    got, headers, body = raw_request(server, data)
    assert (got, headers["Content-Type"]) == (status, "application/json")
    assert json.loads(body)["error"].startswith(message)
    assert headers["X-Content-Type-Options"] == "nosniff" and "Content-Security-Policy" in headers
    assert request(server, "/api/info")[0] == 200  # and the server goes on


def test_blocks_to_video_writes_blocks_in_order_and_nothing_when_one_fails(tmp_path):
    from replaybuf.video import blocks_to_video

    def blocks(fail_after: int | None = None):
        for index in range(3):
            if index == fail_after:
                raise OSError(f"block {index} could not be read")
            yield np.full((4, 8, 8, 3), 40 * (index + 1), np.uint8)

    video = blocks_to_video(blocks(), tmp_path / "ok.mp4", fps=10)
    expected = np.repeat([40, 80, 120], 4)
    assert np.abs(np.array(red_levels(video.read_bytes())) - expected).max() <= 3  # H.264 keeps flat grays close
    with pytest.raises(OSError, match="block 2 could not be read"):
        blocks_to_video(blocks(fail_after=2), tmp_path / "failed.mp4")
    with pytest.raises(ValueError, match=r"sheet\.gif': frames given in blocks are written to \('\.mp4'"):
        blocks_to_video(blocks(fail_after=0), tmp_path / "sheet.gif")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ok.mp4"]


def test_two_servers_on_one_temp_dir_keep_apart_and_stopping_one_leaves_the_others_videos(buffer):
    first, second = ViewerServer(BufferApp(buffer)).start(), ViewerServer(BufferApp(buffer)).start()
    try:
        assert first.app.cache_dir.parent == second.app.cache_dir.parent
        videos = [request(server, "/video/episodes/1/front.mp4") for server in (first, second)]
        assert [status for status, _, _ in videos] == [200, 200] and videos[0][2] == videos[1][2]
        kept = sorted(second.app.cache_dir.iterdir())
        first.stop()
        ViewerServer(BufferApp(buffer)).stop()  # a third starts (sweeping the temp dir) and stops
        assert not first.app.cache_dir.exists() and sorted(second.app.cache_dir.iterdir()) == kept
        status, _, video = request(second, "/video/episodes/1/front.mp4", headers={"Range": "bytes=0-"})
        assert (status, video) == (206, videos[1][2])
    finally:
        first.stop()
        second.stop()
