"""The viewer attacked: foreign origins, frames no encoder takes, huge episodes, foreign files in
its cache. Real servers on 127.0.0.1 and real requests; nothing leaves loopback."""

from __future__ import annotations

import http.client
import json

import pytest

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
