"""The viewer attacked: foreign origins, frames no encoder takes, huge episodes, foreign files in
its cache. Real servers on 127.0.0.1 and real requests; nothing leaves loopback."""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.viewer import BufferApp, ViewerServer
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
