"""The viewer's HTTP server and JSON API, over real sockets on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.schema import MAX_NAME_BYTES
from replaybuf.video import trajectory_to_video
from replaybuf.viewer import BufferApp, ReplayApp, ViewerServer, apps
from replaybuf.viewer.server import parse_range
from tests._viewer_data import STEPS, make_image_buffer, reward_value


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    return make_image_buffer(tmp_path_factory.mktemp("server") / "buffer")


@pytest.fixture
def browse_server(buffer):
    with ViewerServer(BufferApp(buffer, location="test-buffer", fps=10)) as server:
        yield server


def request(server, path, method="GET", headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def get_json(server, path):
    status, headers, body = request(server, path)
    assert headers["Content-Type"] == "application/json"
    return status, json.loads(body)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-9", (0, 9)),
        ("bytes=5-", (5, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=90-500", (90, 99)),
        ("bytes=0-1,5-6", (0, 1)),
        ("items=0-1", None),
    ],
)
def test_parse_range(header, expected):
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=5-2", "bytes=a-b", "bytes=7", "bytes=-0"])
def test_parse_range_rejects_unsatisfiable(header):
    with pytest.raises(ValueError, match="range"):
        parse_range(header, 100)


def test_server_listens_on_loopback_only_and_frees_the_port(buffer):
    server = ViewerServer(BufferApp(buffer)).start()
    assert server.url == f"http://127.0.0.1:{server.port}/"
    assert server._httpd.server_address[0] == "127.0.0.1"
    cache_dir = server.app.cache_dir
    assert request(server, "/")[0] == 200
    server.stop()
    assert not cache_dir.exists()
    with pytest.raises(ConnectionRefusedError):
        request(server, "/")


def test_a_port_in_use_is_a_clear_error(buffer, browse_server):
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{browse_server.port}.*pick another port"):
        ViewerServer(BufferApp(buffer), port=browse_server.port)
    with pytest.raises(ValueError, match="port"):
        ViewerServer(BufferApp(buffer), port=70000)


def test_page_and_static_files_are_served_from_the_package(browse_server):
    status, headers, body = request(browse_server, "/")
    assert status == 200 and headers["Content-Type"] == "text/html"
    assert b"/static/browse.js" in body
    for name, content_type in [
        ("browse.js", "text/javascript"),
        ("player.js", "text/javascript"),
        ("style.css", "text/css"),
    ]:
        status, headers, body = request(browse_server, f"/static/{name}")
        assert (status, headers["Content-Type"]) == (200, content_type)
        assert b"http://" not in body and b"https://" not in body  # nothing fetched from the network
    assert request(browse_server, "/static/../server.py")[0] == 404
    assert request(browse_server, "/static/%2e%2e/server.py")[0] == 404
    assert request(browse_server, "/nothing")[0] == 404


def test_requests_for_other_hosts_are_refused(browse_server):
    assert request(browse_server, "/api/info", headers={"Host": "attacker.example:80"})[0] == 403
    assert request(browse_server, "/api/info", headers={"Host": f"localhost:{browse_server.port}"})[0] == 200


@pytest.mark.parametrize(
    ("site", "mode"), [("cross-site", "no-cors"), ("cross-site", "cors"), ("same-site", "no-cors")]
)
def test_pages_of_other_origins_cannot_load_episode_data_or_start_renders(browse_server, site, mode):
    # what a browser sends for <video src>, fetch() or <img> on a page of another site, or of
    # another port of this host: refused before anything is read or rendered
    foreign = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": mode, "Origin": "http://attacker.example"}
    for path in ("/api/info", "/api/episodes", "/api/episodes/0", "/video/episodes/0/front.mp4", "/static/browse.js"):
        status, headers, body = request(browse_server, path, headers=foreign)
        assert status == 403, path
        assert b"another site" in body
    assert list(browse_server.app.cache_dir.glob("*.mp4")) == []
    # navigating to the viewer from elsewhere opens it, but not a video (a link or window.open
    # there rendered one) nor the API; the page's own requests are same-origin
    navigation = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    for path in ("/video/episodes/0/front.mp4", "/api/episodes/0"):
        assert request(browse_server, path, headers=navigation)[0] == 403, path
    assert list(browse_server.app.cache_dir.glob("*.mp4")) == []
    assert request(browse_server, "/", headers=navigation)[0] == 200
    assert request(browse_server, "/", headers={"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "navigate"})[0] == 200
    own = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}
    status, headers, _ = request(browse_server, "/api/episodes/0", headers=own)
    assert status == 200
    # no CORS grant, and no embedding by another origin in browsers that send no Sec-Fetch-Site
    assert "Access-Control-Allow-Origin" not in headers
    assert (headers["Cross-Origin-Resource-Policy"], headers["X-Content-Type-Options"]) == ("same-origin", "nosniff")


@pytest.mark.parametrize(
    "path",
    [
        "/api/episodes/-1",
        "/api/episodes/1.5",
        "/api/episodes/1%0a",  # a trailing newline
        "/api/episodes/%D9%A1",  # ARABIC-INDIC DIGIT ONE, which int() reads as 1
        pytest.param("/api/episodes/" + "9" * 5000, id="/api/episodes/<5000 digits>"),
        "/api/episodes/1/../0",
        "/video/episodes/%D9%A1/front.mp4",
        "/video/episodes/0/front.mp4%0a",
        "/video/episodes/0/..%2f..%2fetc%2fpasswd.mp4",
    ],
)
def test_episode_paths_take_plain_indices_only(browse_server, path):
    status, body = get_json(browse_server, path)
    assert status == 404, body
    assert list(browse_server.app.cache_dir.glob("*.mp4")) == []


def test_a_file_removed_after_it_was_named_is_404(tmp_path):
    video = trajectory_to_video(np.zeros((2, 8, 8, 3), np.uint8), tmp_path / "front.mp4")
    with ViewerServer(ReplayApp({"front": video}, {})) as server:
        video.unlink()
        status, body = get_json(server, "/video/front")
        assert status == 404 and "front.mp4" in body["error"]


def test_clients_that_hang_up_print_no_traceback(browse_server, capsys):
    for error in (ConnectionResetError(), BrokenPipeError(), TimeoutError()):
        try:
            raise error
        except OSError:
            browse_server._httpd.handle_error(None, ("127.0.0.1", 1))
    assert capsys.readouterr().err == ""
    try:
        raise RuntimeError("a real bug")
    except RuntimeError:
        browse_server._httpd.handle_error(None, ("127.0.0.1", 1))
    assert "a real bug" in capsys.readouterr().err


def test_info_lists_videos_plots_and_columns(browse_server):
    status, info = get_json(browse_server, "/api/info")
    assert status == 200
    assert info["image_fields"] == ["front", "wrist", "depth"]
    assert info["series_fields"] == ["reward", "action", "done"]
    assert info["meta_columns"] == ["success", "task_id"]
    assert info["fields"]["wrist"] == {"shape": [3, 32, 32], "dtype": "float32"}
    assert (info["num_episodes"], info["fps"], info["location"]) == (3, 10, "test-buffer")


def test_numpy_fps_and_scale_are_served_as_json_numbers_and_render(buffer):
    # values read from meta_data are numpy scalars, which json.dumps refuses: /api/info hung up
    with ViewerServer(BufferApp(buffer, fps=np.float32(10), scale=np.int64(2))) as server:
        status, info = get_json(server, "/api/info")
        assert (status, info["fps"], info["scale"]) == (200, 10, 2)
        status, headers, _ = request(server, "/video/episodes/0/front.mp4")
        assert (status, headers["Content-Type"]) == (200, "video/mp4")


def test_episode_list_has_lengths_and_meta(browse_server):
    _, episodes = get_json(browse_server, "/api/episodes")
    assert episodes["num_episodes"] == 3
    assert episodes["lengths"] == list(STEPS)
    assert episodes["meta"] == {"task_id": [0, 1, 2], "success": [True, False, True]}


def test_episode_series_and_video_links(browse_server):
    _, episode = get_json(browse_server, "/api/episodes/1")
    assert (episode["index"], episode["length"]) == (1, STEPS[1])
    assert episode["meta"] == {"task_id": 1, "success": False}
    assert np.allclose(episode["series"]["reward"], [reward_value(1, t) for t in range(STEPS[1])], atol=1e-6)
    assert np.asarray(episode["series"]["action"]).shape == (STEPS[1], 4)
    assert episode["series"]["done"] == [False] * (STEPS[1] - 1) + [True]
    assert list(episode["videos"]) == ["front", "wrist", "depth"]
    for name, link in episode["videos"].items():
        assert re.fullmatch(rf"/video/episodes/1/gen-[0-9]+-rev-[0-9]+-open-0/{name}\.mp4", link)
    assert get_json(browse_server, "/api/episodes/3")[0] == 404


def test_every_backend_serves_episodes_series_and_videos(make_location):
    location, kwargs = make_location("viewer")
    make_image_buffer(location, steps=(4, 3), **kwargs).close()
    from replaybuf import ReplayBuffer

    with ViewerServer(BufferApp(ReplayBuffer.from_folder(location, read_only=True, **kwargs))) as server:
        assert get_json(server, "/api/episodes")[1]["lengths"] == [4, 3]
        episode = get_json(server, "/api/episodes/1")[1]
        assert np.allclose(episode["series"]["reward"], [reward_value(1, t) for t in range(3)], atol=1e-6)
        status, headers, _ = request(server, "/video/episodes/1/depth.mp4", headers={"Range": "bytes=0-3"})
        assert (status, headers["Content-Type"]) == (206, "video/mp4")


def test_an_empty_buffer_lists_no_episodes(tmp_path):
    from replaybuf import ReplayBuffer

    ReplayBuffer(tmp_path / "empty", max_episodes=2, max_timesteps=3, fields={"cam": ("uint8", (8, 8))}).close()
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(tmp_path / "empty", read_only=True))) as server:
        assert get_json(server, "/api/episodes")[1] == {
            "num_episodes": 0,
            "slots": 0,
            "columns": [],
            "lengths": [],
            "meta": {},
        }
        assert get_json(server, "/api/info")[1]["image_fields"] == ["cam"]
        assert get_json(server, "/api/episodes/0")[0] == 404


def test_an_episode_after_a_dropped_one_is_listed_and_rendered(tmp_path, capsys):
    """After drop_episodes (or verify --repair) of slot 1 of 3 the viewer listed, and inspect
    and save_video accepted, slots below num_episodes only (it was recounted to 2, hiding slot
    2's episode; it now stays 3)."""
    from replaybuf import ReplayBuffer
    from replaybuf.cli import main

    writer = make_image_buffer(tmp_path / "b", steps=(4, 3, 5))
    writer.drop_episodes([1])
    writer.close()
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    assert reader.num_episodes == 3 and reader.valid_episodes().tolist() == [0, 2]
    with ViewerServer(BufferApp(reader)) as server:
        listed = get_json(server, "/api/episodes")[1]
        assert (listed["num_episodes"], listed["slots"], listed["lengths"]) == (3, 3, [4, 0, 5])
        assert get_json(server, "/api/episodes/2")[1]["length"] == 5
        assert request(server, "/video/episodes/2/front.mp4")[0] == 200
        # the empty slot's meta values as the list shows them (a bool was sent as 0)
        dropped = get_json(server, "/api/episodes/1")[1]
        assert (dropped["length"], dropped["meta"]) == (0, {"success": False, "task_id": 0})
        assert [type(listed["meta"][name][1]) for name in ("success", "task_id")] == [bool, int]
        assert [type(dropped["meta"][name]) for name in ("success", "task_id")] == [bool, int]
    assert (
        main(["inspect", str(tmp_path / "b"), "--episode", "2", "--field", "front", "-o", str(tmp_path / "e.gif")]) == 0
    )
    assert "(5 frames" in capsys.readouterr().out
    assert len(reader.episode_frames(2, "front")) == 5


def test_non_finite_values_become_null(tmp_path):
    from replaybuf import ReplayBuffer

    buffer = ReplayBuffer(tmp_path / "nan", max_episodes=1, max_timesteps=3, fields={"reward": "float"}, overwrite=True)
    buffer.store_episode(reward=np.array([1.0, np.nan, np.inf], np.float32))
    buffer.flush()
    with ViewerServer(BufferApp(buffer)) as server:
        assert get_json(server, "/api/episodes/0")[1]["series"]["reward"] == [1.0, None, None]


def test_integers_a_page_cannot_hold_exactly_are_sent_as_their_digits(tmp_path):
    """A page's numbers hold integers up to 2**53: an int64 id of 2**60 + 1 showed (and filtered)
    as 1152921504606847000, another episode's id. Plotted series stay numbers."""
    buffer = ReplayBuffer(
        tmp_path / "ids", max_episodes=2, max_timesteps=1, fields={"stamp": "int64"}, meta_fields={"run": "int64"}
    )
    for run in (2**60 + 1, 7):
        buffer.store_episode(stamp=np.array([2**60 + 1]), run=run)
    buffer.flush()
    with ViewerServer(BufferApp(buffer)) as server:
        assert get_json(server, "/api/episodes")[1]["meta"]["run"] == [str(2**60 + 1), 7]
        episodes = [get_json(server, f"/api/episodes/{index}")[1] for index in (0, 1)]
        assert [episode["meta"]["run"] for episode in episodes] == [str(2**60 + 1), 7]
        assert episodes[0]["series"]["stamp"] == [2**60 + 1]


def test_videos_render_once_and_serve_byte_ranges(browse_server):
    status, headers, whole = request(browse_server, "/video/episodes/2/front.mp4")
    assert (status, headers["Content-Type"], headers["Accept-Ranges"]) == (200, "video/mp4", "bytes")
    cached = list(browse_server.app.cache_dir.glob("*.mp4"))
    generation = int(browse_server.app.buffer._meta["_generation"][2])
    revision = int(browse_server.app.buffer._meta["_revision"][2])
    assert [path.name for path in cached] == [f"episode-2-gen-{generation}-rev-{revision}-open-0.field-0.mp4"]
    modified = cached[0].stat().st_mtime_ns

    status, headers, part = request(browse_server, "/video/episodes/2/front.mp4", headers={"Range": "bytes=10-19"})
    assert status == 206
    assert headers["Content-Range"] == f"bytes 10-19/{len(whole)}"
    assert part == whole[10:20]
    status, headers, tail = request(browse_server, "/video/episodes/2/front.mp4", headers={"Range": "bytes=-7"})
    assert (status, tail) == (206, whole[-7:])
    status, headers, _ = request(
        browse_server, "/video/episodes/2/front.mp4", headers={"Range": f"bytes={len(whole)}-"}
    )
    assert (status, headers["Content-Range"]) == (416, f"bytes */{len(whole)}")
    status, headers, body = request(browse_server, "/video/episodes/2/front.mp4", method="HEAD")
    assert (status, int(headers["Content-Length"]), body) == (200, len(whole), b"")
    assert cached[0].stat().st_mtime_ns == modified


def test_a_rendered_video_is_served_without_reading_its_frames_again(browse_server, monkeypatch):
    """Each byte range a <video> asked for read and re-checked the whole episode's frames."""
    status, _, whole = request(browse_server, "/video/episodes/1/front.mp4")
    assert status == 200
    storage = browse_server.app.buffer.storage
    frames_read, read_rows = [], storage.read_rows

    def counted(name, *args, **kwargs):
        frames_read.append(name)
        return read_rows(name, *args, **kwargs)

    monkeypatch.setattr(storage, "read_rows", counted)
    for start in (0, 10, len(whole) - 5):
        status, _, part = request(browse_server, "/video/episodes/1/front.mp4", headers={"Range": f"bytes={start}-"})
        assert (status, part) == (206, whole[start:])
    assert frames_read == []
    assert request(browse_server, "/video/episodes/1/wrist.mp4")[0] == 200  # not rendered yet: read once
    assert frames_read == ["wrist"]


def test_concurrent_renders_beyond_the_bound_all_complete(buffer, monkeypatch):
    monkeypatch.setattr(apps, "MAX_RENDERS", 1)  # every render waits for the one before
    paths = [f"/video/episodes/{index}/{field}.mp4" for index in range(3) for field in ("front", "wrist", "depth")]
    with ViewerServer(BufferApp(buffer, fps=10)) as server, ThreadPoolExecutor(len(paths)) as pool:
        answers = list(pool.map(lambda path: request(server, path), paths * 2))
        assert [status for status, _, _ in answers] == [200] * len(answers)
        assert [body for _, _, body in answers[: len(paths)]] == [body for _, _, body in answers[len(paths) :]]
        assert len(list(server.app.cache_dir.glob("*.mp4"))) == len(paths)


def test_a_slot_a_writer_reused_is_rendered_again_not_served_from_the_cache(tmp_path):
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=2, max_timesteps=4, fields={"img": ("uint8", (8, 8, 3))}, circular=True
    )
    for level in (50, 100):
        writer.store_episode(img=np.full((4, 8, 8, 3), level, np.uint8))
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(tmp_path / "b", read_only=True))) as server:
        status, _, video = request(server, "/video/episodes/0/img.mp4")
        assert status == 200 and iio.imread(video, extension=".mp4")[:, 4, 4, 0].tolist() == [50] * 4
        writer.store_episode(img=np.full((2, 8, 8, 3), 200, np.uint8))  # into slot 0, the reader not refreshed
        status, _, video = request(server, "/video/episodes/0/img.mp4")
        assert status == 200 and iio.imread(video, extension=".mp4")[:, 4, 4, 0].tolist() == [200] * 2
    writer.close()


def test_an_episodes_video_link_shows_that_episode_never_the_one_a_writer_put_in_its_slot_after(tmp_path):
    """The page shows an episode's length, meta and plots from /api/episodes/N, then asks for its
    videos: a writer reusing the slot in between made the link play the new episode's frames
    under the old one's label (and a <video> reading byte ranges of it could get parts of two
    files). A link names its episode: served while that video is kept, else 404 saying so."""
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=2, max_timesteps=4, fields={"img": ("uint8", (8, 8, 3))}, circular=True
    )
    for level in (50, 100):
        writer.store_episode(img=np.full((4, 8, 8, 3), level, np.uint8))
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(tmp_path / "b", read_only=True))) as server:
        shown, unseen = (get_json(server, f"/api/episodes/{index}")[1]["videos"]["img"] for index in (0, 1))
        assert request(server, shown)[0] == 200  # rendered while the slot held it
        for level in (200, 250):  # into slots 0 and 1, the reader not refreshed
            writer.store_episode(img=np.full((2, 8, 8, 3), level, np.uint8))
        status, _, video = request(server, shown, headers={"Range": "bytes=0-"})
        assert status == 206 and iio.imread(video, extension=".mp4")[:, 4, 4, 0].tolist() == [50] * 4
        status, _, body = request(server, unseen)
        assert status == 404 and "episode 1 as shown" in json.loads(body)["error"]
        assert not list(server.app.cache_dir.glob("episode-1-*"))  # nothing rendered for it
        status, _, video = request(server, get_json(server, "/api/episodes/1")[1]["videos"]["img"])
        assert status == 200 and iio.imread(video, extension=".mp4")[:, 4, 4, 0].tolist() == [250] * 2
    writer.close()


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
def test_an_episode_edited_in_place_is_rendered_again_not_served_from_the_cache(tmp_path, backend):
    """Videos were keyed by generation alone: frames a writer edited in place (same episode,
    same generation) kept showing as rendered before the edit."""
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=2, max_timesteps=4, fields={"img": ("uint8", (8, 8, 3))}, backend=backend
    )
    writer.store_episode(img=np.full((4, 8, 8, 3), 50, np.uint8))
    writer.flush()
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(tmp_path / "b", read_only=True))) as server:
        status, _, video = request(server, "/video/episodes/0/img.mp4")
        assert status == 200 and iio.imread(video, extension=".mp4")[:, 4, 4, 0].tolist() == [50] * 4
        writer.update([0], img=np.full((1, 4, 8, 8, 3), 150, np.uint8))  # the reader not refreshed
        status, _, video = request(server, "/video/episodes/0/img.mp4")
        assert status == 200 and iio.imread(video, extension=".mp4")[:, 4, 4, 0].tolist() == [150] * 4
        assert len(list(server.app.cache_dir.glob("episode-0-*.field-0.mp4"))) == 2
    writer.close()


def test_a_slot_rewritten_between_the_blocks_of_its_render_fails_that_render_and_the_next_renders_anew(
    tmp_path, monkeypatch
):
    """A render reads its episode a block of frames at a time, each naming the episode the first
    block read: the slot reused after the first two blocks fails the render (nothing cached,
    never a video of two episodes), and the next request renders the episode it holds now."""
    monkeypatch.setattr(apps, "RENDER_BLOCK_BYTES", 2 * 8 * 8 * 3)  # 2 frames a block
    writer = ReplayBuffer(
        tmp_path / "b", max_episodes=1, max_timesteps=8, fields={"img": ("uint8", (8, 8, 3))}, circular=True
    )
    writer.store_episode(img=np.full((8, 8, 8, 3), 50, np.uint8))
    app = BufferApp(ReplayBuffer.from_folder(tmp_path / "b", read_only=True))
    read_rows, blocks = app.buffer.storage.read_rows, []

    def reuse_the_slot_during_the_second_block(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        blocks.append((t0, t1))
        if len(blocks) == 2:
            writer.store_episode(img=np.full((6, 8, 8, 3), 200, np.uint8))
        return rows

    app.buffer.storage.read_rows = reuse_the_slot_during_the_second_block
    with pytest.raises(ValueError, match="episode 0 was rewritten while its 'img' video was rendered; ask again"):
        app.render(0, "img")
    assert blocks == [(0, 2), (2, 4)] and list(app.cache_dir.glob("*.mp4")) == []
    video = iio.imread(app.render(0, "img"), extension=".mp4")
    assert video[:, 4, 4, 0].tolist() == [200] * 6 and blocks[2:] == [(0, 2), (2, 4), (4, 6)]
    app.close()
    writer.close()


def test_a_buffer_created_again_at_the_location_is_served_not_the_old_ones_videos(tmp_path):
    folder = tmp_path / "buffer"
    make_image_buffer(folder).close()
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(folder, read_only=True), fps=10)) as server:
        status, _, video = request(server, "/video/episodes/1/front.mp4")
        assert (status, len(iio.imread(video, extension=".mp4"))) == (200, STEPS[1])
        shutil.rmtree(folder)  # the same config again, generations from 1 again: episode 1 is shorter
        make_image_buffer(folder, steps=(STEPS[0], 7, STEPS[2])).close()
        assert get_json(server, "/api/episodes/1")[1]["length"] == 7
        status, _, video = request(server, "/video/episodes/1/front.mp4")
        assert (status, len(iio.imread(video, extension=".mp4"))) == (200, 7)  # was the old 19-frame video


def test_a_buffer_replaced_by_another_config_is_named_so_not_damaged(tmp_path):
    folder = tmp_path / "buffer"
    make_image_buffer(folder).close()
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(folder, read_only=True), fps=10)) as server:
        ReplayBuffer(folder, max_episodes=3, max_timesteps=5, fields={"obs": "float"}, overwrite=True).close()
        for path in ("/api/episodes", "/api/episodes/0", "/video/episodes/0/front.mp4"):
            status, body = get_json(server, path)
            assert status == 500
            assert body["error"].startswith("BufferReplacedError: the buffer at"), body  # was CorruptChunkError
            assert "max_episodes: stored 3 vs passed 5" in body["error"]


def test_a_field_with_the_longest_name_a_buffer_takes_is_rendered(tmp_path):
    # its cached video was named after it, past the 255 bytes a file name may hold
    name = "f" * MAX_NAME_BYTES
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=2, fields={name: ("uint8", (8, 8, 3))})
    buffer.store_episode(**{name: np.zeros((2, 8, 8, 3), np.uint8)})
    with ViewerServer(BufferApp(buffer)) as server:
        status, headers, _ = request(server, f"/video/episodes/0/{name}.mp4")
        assert (status, headers["Content-Type"]) == (200, "video/mp4")


def test_unknown_video_fields_and_episodes_are_404(browse_server):
    assert request(browse_server, "/video/episodes/0/reward.mp4")[0] == 404
    assert request(browse_server, "/video/episodes/9/front.mp4")[0] == 404


def test_replay_app_serves_its_videos(tmp_path):
    frames = np.zeros((5, 8, 8, 3), np.uint8)
    videos = {name: trajectory_to_video(frames, tmp_path / f"replay.{name}.mp4") for name in ("front", "wrist")}
    info = {
        "location": "x",
        "episodes": [0],
        "frames": 5,
        "fps": 30,
        "scale": 1,
        "field_info": {"front": {"shape": "8 x 8 x 3", "dtype": "uint8"}},
    }
    with ViewerServer(ReplayApp(videos, info)) as server:
        _, body = get_json(server, "/api/info")
        assert body["videos"] == {"front": "/video/front", "wrist": "/video/wrist"}
        assert body["fields"] == [{"name": "front", "shape": "8 x 8 x 3", "dtype": "uint8"}, {"name": "wrist"}]
        assert request(server, "/video/wrist")[2] == videos["wrist"].read_bytes()
        assert request(server, "/video/side")[0] == 404
    with pytest.raises(ValueError, match="no such file"):
        ReplayApp({"front": tmp_path / "missing.mp4"}, info)


# the video cache: bounded, and what a killed server left


@pytest.fixture(scope="module")
def noise_buffer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("noise") / "b"
    writer = ReplayBuffer(folder, max_episodes=3, max_timesteps=6, fields={"img": ("uint8", (16, 16, 3))})
    rng = np.random.default_rng(0)
    for _ in range(3):
        writer.store_episode(img=rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    writer.close()
    return ReplayBuffer.from_folder(folder, read_only=True)


def serve(app, index: int) -> None:
    """One request's answer: the video pinned while it is 'sent', then released."""
    response = app.respond(f"/video/episodes/{index}/img.mp4")
    assert response.path.stat().st_size > 0
    response.release()


def test_the_video_cache_keeps_its_byte_budget_least_recently_served_deleted_first(noise_buffer):
    unbounded = BufferApp(noise_buffer)
    sizes = [unbounded.render(index, "img").stat().st_size for index in range(3)]
    unbounded.close()
    app = BufferApp(noise_buffer, cache_bytes=sum(sizes) - 1)
    try:
        for index in (0, 1, 0, 2):  # 0 served again after 1: 1 is the least recently served
            serve(app, index)
        assert sorted(path.name.split("-")[1] for path in app.cache_dir.glob("*.mp4")) == ["0", "2"]
        assert app._cache.size == sizes[0] + sizes[2] <= app._cache.max_bytes
        serve(app, 1)  # rendered again, the least recently served (0) makes room
        assert sorted(path.name.split("-")[1] for path in app.cache_dir.glob("*.mp4")) == ["1", "2"]
        for video in app.cache_dir.glob("*.mp4"):  # deleted by something else: rendered again
            video.unlink()
        serve(app, 2)
        assert [path.name.split("-")[1] for path in app.cache_dir.glob("*.mp4")] == ["2"]
    finally:
        app.close()


def test_a_video_being_served_is_never_deleted_to_stay_within_budget(noise_buffer):
    app = BufferApp(noise_buffer, cache_bytes=1)  # every video is over budget
    try:
        sending = app.respond("/video/episodes/0/img.mp4")  # pinned until its answer is sent
        assert not app.render(1, "img").exists()  # rendered, returned, then over budget and unpinned
        assert sending.path.exists()
        sending.release()
        assert list(app.cache_dir.glob("*.mp4")) == []
        with ViewerServer(app) as server:  # the server sends it whole, then lets it go
            status, _, video = request(server, "/video/episodes/2/img.mp4")
            assert status == 200 and len(iio.imread(video, extension=".mp4")) == 6
            assert list(app.cache_dir.glob("*.mp4")) == []
    finally:
        app.close()
    with pytest.raises(ValueError, match="cache_bytes: expected a positive integer, got 0"):
        BufferApp(noise_buffer, cache_bytes=0)


KILLED_SERVER = """
import os, signal, sys
from replaybuf.viewer.cache import VideoCache
cache = VideoCache(parent=sys.argv[1])
(cache.folder / "episode-0-gen-1-open-0.img.mp4").write_bytes(b"video")
(cache.folder / ".episode-1-gen-2-open-0.img.0123abcd.partial.mp4").write_bytes(b"half a video")
(cache.folder / ".replay.front.4567cdef.partial.mp4").write_bytes(b"inspect --serve's")
print(cache.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # mid-render: close() never runs
"""


def test_a_killed_servers_cache_is_removed_by_the_next_without_touching_anything_else(tmp_path):
    import subprocess
    import sys

    from replaybuf.viewer.cache import VideoCache

    def killed_server() -> Path:
        run = subprocess.run([sys.executable, "-c", KILLED_SERVER, str(tmp_path)], capture_output=True, text=True)
        assert run.returncode == -9, run.stderr
        return Path(run.stdout.strip())

    left, with_mine = killed_server(), killed_server()
    (with_mine / "notes.txt").write_text("mine")  # not the viewer's: kept, and so is its folder
    unlocked = tmp_path / "replaybuf-view-1-abcdefgh"  # the name, but no lock: not provably a viewer's
    unlocked.mkdir()
    (unlocked / "episode-0-gen-1-open-0.img.mp4").write_bytes(b"someone's")
    running = VideoCache(parent=str(tmp_path))
    (running.folder / ".episode-0-gen-1-open-0.img.00000000.partial.mp4").write_bytes(b"rendering")
    try:
        VideoCache(parent=str(tmp_path)).close()
        assert not left.exists()
        assert [path.name for path in with_mine.iterdir()] == ["notes.txt"]
        assert [path.name for path in unlocked.iterdir()] == ["episode-0-gen-1-open-0.img.mp4"]
        assert sorted(path.name for path in running.folder.iterdir()) == [
            ".episode-0-gen-1-open-0.img.00000000.partial.mp4",
            ".lock",
        ]
    finally:
        running.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([with_mine.name, unlocked.name])
