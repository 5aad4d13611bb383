"""The viewer pages in Debian's headless Chromium, driven by playwright, served on 127.0.0.1.

Frames of the ``front`` field are flat grays that encode (episode, timestep), so the tests
read the pixel a <video> shows and check it is the frame the counter names.
"""

from __future__ import annotations

import io
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from replaybuf.video import episode_frames, trajectory_to_video
from replaybuf.viewer import BufferApp, ReplayApp, ViewerServer
from tests._viewer_data import STEPS, gray_level, make_image_buffer, make_plot_only_buffer

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_MS = 20_000
# one xdist worker runs the module, so Chromium and the buffer (module fixtures) start once
pytestmark = pytest.mark.xdist_group("viewer_browser")
# H.264 at the viewer's quality keeps flat grays within a few levels
GRAY_TOLERANCE = 6


def find_chromium() -> str | None:
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    if executable is None:
        pytest.skip(
            "no Chromium binary (looked for /usr/bin/chromium, chromium, chromium-browser); apt-get install chromium"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def new_page(browser, bypass_csp: bool):
    context = browser.new_context(viewport={"width": 1280, "height": 860}, bypass_csp=bypass_csp)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
    return context, page


@pytest.fixture
def page(browser):
    """A page whose tests may wait on script predicates, which the viewer's Content-Security-Policy
    (no eval) would refuse; ``strict_page`` keeps the policy."""
    context, page = new_page(browser, bypass_csp=True)
    yield page
    context.close()


@pytest.fixture
def strict_page(browser):
    context, page = new_page(browser, bypass_csp=False)
    yield page
    context.close()


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    return make_image_buffer(tmp_path_factory.mktemp("browser") / "buffer")


def wait_videos_ready(page, count):
    page.wait_for_function(
        """count => {
            const videos = [...document.querySelectorAll('#videos video')];
            return videos.length === count && videos.every(v => v.readyState >= 2 && v.videoWidth > 0 && !v.seeking);
        }""",
        arg=count,
        timeout=WAIT_MS,
    )


def wait_counter(page, text):
    page.wait_for_function(
        "text => document.getElementById('frame-counter').textContent === text", arg=text, timeout=WAIT_MS
    )


def shown_gray(page, field="front"):
    """The red level at the centre of the frame a video currently shows, once its seek is done."""
    wait_videos_ready(page, page.locator("#videos video").count())
    return page.evaluate(
        """field => {
            const video = document.querySelector(`#videos video[data-field="${field}"]`);
            const canvas = document.createElement('canvas');
            canvas.width = video.videoWidth;
            canvas.height = video.videoHeight;
            const context = canvas.getContext('2d');
            context.drawImage(video, 0, 0);
            return context.getImageData(canvas.width >> 1, canvas.height >> 1, 1, 1).data[0];
        }""",
        field,
    )


def control_pixels(page, selector="#play-pause") -> np.ndarray:
    """A control's pixels; its size is pinned first, so every state screenshots the same box."""
    page.eval_on_selector(
        selector,
        "el => { const r = el.getBoundingClientRect(); el.style.width = `${r.width}px`; el.style.height = `${r.height}px`; }",
    )
    return np.asarray(Image.open(io.BytesIO(page.locator(selector).screenshot())).convert("L"), dtype=np.int16)


def assert_visible_icons(page, shots: dict[str, np.ndarray], selector="#play-pause") -> None:
    """Each shot differs from the control emptied and from it showing a glyph no font has: the
    box a missing glyph (such as U+23F8 in Debian's fonts) draws. Leaves the control changed."""
    page.eval_on_selector(selector, "el => { el.textContent = '\\uE000'; }")
    missing_glyph = control_pixels(page, selector)
    page.eval_on_selector(selector, "el => el.replaceChildren()")
    empty = control_pixels(page, selector)
    assert (missing_glyph != empty).sum() > 10  # the comparison can tell a box from nothing
    for name, shot in shots.items():
        for other, pixels in (("empty", empty), ("missing glyph", missing_glyph)):
            assert shot.shape == pixels.shape
            assert (np.abs(shot - pixels) > 32).sum() > 10, f"{selector} {name} looks like the {other} control"


def video_states(page):
    return page.evaluate(
        "[...document.querySelectorAll('#videos video')].map(v => ({time: v.currentTime, rate: v.playbackRate, paused: v.paused}))"
    )


def test_replay_page_plays_steps_and_slows_synced_videos(page, buffer, tmp_path):
    episodes = [0, 2]
    videos = {
        field: trajectory_to_video(episode_frames(buffer, episodes, field), tmp_path / f"replay.{field}.mp4")
        for field in ("front", "wrist")
    }
    total = STEPS[0] + STEPS[2]
    info = {"location": "buffer", "episodes": episodes, "frames": total, "fps": 30, "scale": 1}
    expected_gray = [gray_level(0, t) for t in range(STEPS[0])] + [gray_level(2, t) for t in range(STEPS[2])]

    with ViewerServer(ReplayApp(videos, info)) as server:
        page.goto(server.url)
        wait_videos_ready(page, 2)
        assert page.evaluate("[...document.querySelectorAll('#videos video')].map(v => v.videoWidth)") == [32, 32]
        # it autoplays: the counter moves on its own, then space pauses
        page.wait_for_function("document.getElementById('frame-counter').dataset.frame !== '0'", timeout=WAIT_MS)
        icons = {"pause": control_pixels(page)}
        page.keyboard.press("Space")
        assert all(state["paused"] for state in video_states(page))
        icons["play"] = control_pixels(page)
        assert (np.abs(icons["play"] - icons["pause"]) > 32).sum() > 10
        icons["step back"] = control_pixels(page, "#step-back")

        page.keyboard.press("Home")
        wait_counter(page, f"0 / {total}")
        page.keyboard.press("ArrowRight")
        wait_counter(page, f"1 / {total}")
        assert abs(shown_gray(page) - expected_gray[1]) <= GRAY_TOLERANCE
        page.keyboard.press("Shift+ArrowRight")
        wait_counter(page, f"11 / {total}")
        page.keyboard.press("ArrowLeft")
        wait_counter(page, f"10 / {total}")
        page.click("#step-forward")
        wait_counter(page, f"11 / {total}")
        page.locator("#videos").hover()
        page.mouse.wheel(0, 120)
        wait_counter(page, f"12 / {total}")
        page.keyboard.press("Shift+ArrowRight")
        page.keyboard.press("Shift+ArrowRight")
        wait_counter(page, f"32 / {total}")
        # frame 32 is timestep 12 of the second episode, in both videos at once
        assert abs(shown_gray(page) - expected_gray[32]) <= GRAY_TOLERANCE
        times = [state["time"] for state in video_states(page)]
        assert times[0] == times[1] and int(times[0] * 30) == 32

        page.locator("#timeline").fill("5")
        wait_counter(page, f"5 / {total}")
        assert abs(shown_gray(page) - expected_gray[5]) <= GRAY_TOLERANCE

        page.select_option("#speed", "0.1")
        assert [state["rate"] for state in video_states(page)] == [0.1, 0.1]
        page.keyboard.press("+")
        assert [state["rate"] for state in video_states(page)] == [0.25, 0.25]
        assert page.input_value("#speed") == "0.25"

        page.click("#play-pause")
        page.wait_for_function("document.getElementById('frame-counter').dataset.frame !== '5'", timeout=WAIT_MS)
        page.click("#play-pause")
        assert all(state["paused"] for state in video_states(page))
        page.screenshot(path=str(tmp_path / "replay.png"))
        assert_visible_icons(page, {"step back": icons.pop("step back")}, "#step-back")
        assert_visible_icons(page, icons)
    assert page.errors == []


def test_view_page_browses_episodes_with_plots_following_the_cursor(page, buffer, tmp_path):
    with ViewerServer(BufferApp(buffer, location="demo-buffer", fps=10)) as server:
        page.goto(server.url)
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '0'", timeout=WAIT_MS)
        assert page.locator("#episode-rows tr").count() == 3
        assert page.locator("#episode-columns th").all_inner_texts() == ["#", "len", "success", "task_id"]
        wait_videos_ready(page, 3)
        assert page.locator("#videos video").evaluate_all("videos => videos.map(v => v.dataset.field)") == [
            "front",
            "wrist",
            "depth",
        ]
        assert page.locator(".plot").evaluate_all("plots => plots.map(p => p.dataset.field)") == [
            "reward",
            "action",
            "done",
        ]
        drawn = page.evaluate(
            """() => {
                const canvas = document.querySelector('.plot[data-field="reward"] canvas.lines');
                const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
                let painted = 0;
                for (let i = 3; i < pixels.length; i += 4) painted += pixels[i] > 0;
                return painted;
            }"""
        )
        assert drawn > 100
        assert page.locator('.plot[data-field="action"] .legend span').count() == 4
        reward_legend = page.locator('.plot[data-field="reward"] .legend span')
        assert reward_legend.inner_text() == "reward = 0"

        for _ in range(3):
            page.keyboard.press("ArrowRight")
        wait_counter(page, f"3 / {STEPS[0]}")
        assert reward_legend.inner_text() == "reward = 0.841"  # sin(3 / 3)
        assert abs(shown_gray(page) - gray_level(0, 3)) <= GRAY_TOLERANCE

        page.keyboard.press("ArrowDown")
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '1'", timeout=WAIT_MS)
        wait_counter(page, f"0 / {STEPS[1]}")
        assert reward_legend.inner_text() == "reward = 1"
        wait_videos_ready(page, 3)
        assert abs(shown_gray(page) - gray_level(1, 0)) <= GRAY_TOLERANCE

        page.fill('input[data-column="success"]', "true")
        assert page.locator("#episode-rows tr").evaluate_all("rows => rows.map(r => r.dataset.index)") == ["0", "2"]
        assert page.inner_text("#episode-count") == "2 of 3 episodes"
        page.click('#episode-rows tr[data-index="2"]')
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '2'", timeout=WAIT_MS)
        wait_counter(page, f"0 / {STEPS[2]}")

        wait_videos_ready(page, 3)
        plot = page.locator('.plot[data-field="reward"] .plot-canvas')
        box = plot.bounding_box()
        plot.click(position={"x": box["width"] - 2, "y": box["height"] / 2})
        wait_counter(page, f"{STEPS[2] - 1} / {STEPS[2]}")
        assert abs(shown_gray(page) - gray_level(2, STEPS[2] - 1)) <= GRAY_TOLERANCE

        page.select_option("#speed", "0.1")
        assert {state["rate"] for state in video_states(page)} == {0.1}
        page.keyboard.press("ArrowUp")  # the previous episode in the filtered list is 0
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '0'", timeout=WAIT_MS)
        wait_videos_ready(page, 3)
        page.screenshot(path=str(tmp_path / "view.png"))
    assert page.errors == []


def test_view_page_without_image_fields_steps_and_plays_the_plots(page, tmp_path):
    with ViewerServer(BufferApp(make_plot_only_buffer(tmp_path / "plots"), fps=20)) as server:
        page.goto(server.url)
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '0'", timeout=WAIT_MS)
        assert page.locator("#videos video").count() == 0
        assert page.locator(".plot").count() == 2
        page.keyboard.press("ArrowRight")
        wait_counter(page, "1 / 12")
        page.keyboard.press("Space")
        page.wait_for_function("document.getElementById('frame-counter').dataset.frame !== '1'", timeout=WAIT_MS)
        page.keyboard.press("Space")
        page.keyboard.press("End")
        wait_counter(page, "11 / 12")
        assert page.locator('.plot[data-field="reward"] .legend span').inner_text() == "reward = 1"
    assert page.errors == []


# hostile buffers: strings that are markup, names outside ASCII, values JSON has no word for

PAYLOAD = '<img src=x onerror="window.pwned=1">\'"</title><script>window.pwned=2</script>\u202e\u0000'


def test_markup_in_the_location_and_names_outside_ascii_show_as_text_and_run_nothing(page, tmp_path):
    from replaybuf import ReplayBuffer

    buffer = ReplayBuffer(
        tmp_path / "b",
        max_episodes=1,
        max_timesteps=4,
        fields={"前方": ("uint8", (16, 16, 3)), "ŝtep": "float"},
        meta_fields={"é": "float", "len": "int"},  # "len": also the name of the lengths' column
    )
    buffer.store_episode(
        **{"前方": np.full((4, 16, 16, 3), 90, np.uint8), "ŝtep": np.array([1, np.nan, np.inf, -np.inf], np.float32)},
        é=np.nan,
        len=7,
    )
    with ViewerServer(BufferApp(buffer, location=PAYLOAD, fps=10)) as server:
        page.goto(server.url)
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '0'", timeout=WAIT_MS)
        wait_videos_ready(page, 1)
        assert page.evaluate("window.pwned") is None
        assert page.evaluate("document.querySelectorAll('img, script:not([src])').length") == 0
        assert page.inner_text("#location").startswith(PAYLOAD.replace("\u0000", "\ufffd")[:60])
        assert page.locator("#videos video").evaluate_all("videos => videos.map(v => v.dataset.field)") == ["前方"]
        assert page.locator("#episode-columns th").all_inner_texts() == ["#", "len", "len", "é"]
        assert page.locator("#episode-rows td").all_inner_texts() == ["0", "4", "7", "nan"]
        assert page.locator('.plot[data-field="ŝtep"]').count() == 1
        assert page.title() == "replaybuf view"
    videos = {"前方": trajectory_to_video(np.full((4, 16, 16, 3), 90, np.uint8), tmp_path / "replay.mp4")}
    info = {"location": PAYLOAD, "episodes": [0], "frames": 4, "fps": 10, "scale": 1}
    with ViewerServer(ReplayApp(videos, info)) as server:
        page.goto(server.url)
        wait_videos_ready(page, 1)
        assert page.evaluate("window.pwned") is None
        assert PAYLOAD[:40] in page.inner_text("#stats")
    assert page.errors == []


def test_a_damaged_image_field_shows_the_servers_error_naming_field_and_slot(page, tmp_path):
    from replaybuf import ReplayBuffer

    make_image_buffer(tmp_path / "b").close()
    shard = tmp_path / "b" / "data" / "front" / "c.0.0.0.0.0"  # one shard: 5 slots of 20 frames
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # in slot 2's frames
    shard.write_bytes(bytes(damaged))
    with ViewerServer(BufferApp(ReplayBuffer.from_folder(tmp_path / "b", read_only=True), fps=10)) as server:
        page.goto(server.url + "#episode=2")
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '2'", timeout=WAIT_MS)
        page.wait_for_selector("#videos figure.failed figcaption", timeout=WAIT_MS)
        page.wait_for_function(
            "document.querySelector('#videos figure.failed figcaption').textContent.includes('slot 2')",
            timeout=WAIT_MS,
        )
        caption = page.inner_text("#videos figure.failed figcaption")
        assert caption.startswith("front: CorruptChunkError: data/front: slot 2") and "crc32c" in caption
        assert page.locator("#videos figure.failed").count() == 1  # wrist and depth play


def test_a_long_episodes_thinned_plot_follows_the_episodes_steps(page, tmp_path, monkeypatch):
    from replaybuf import ReplayBuffer
    from replaybuf.viewer import apps

    monkeypatch.setattr(apps, "MAX_SERIES_POINTS", 50)
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=1, max_timesteps=1001, fields={"reward": "float"})
    buffer.store_episode(reward=np.arange(1001, dtype=np.float32))  # 21 steps a point
    with ViewerServer(BufferApp(buffer, fps=10)) as server:
        page.goto(server.url)
        page.wait_for_function("document.getElementById('episode-header').dataset.episode === '0'", timeout=WAIT_MS)
        assert page.text_content('.plot[data-field="reward"] h2') == "reward (one point per 21 steps)"
        legend = page.locator('.plot[data-field="reward"] .legend span')
        assert legend.inner_text() == "reward @0 = 0"
        for _ in range(5):
            page.keyboard.press("Shift+ArrowRight")
        wait_counter(page, "50 / 1001")
        assert legend.inner_text() == "reward @42 = 42"  # the step kept at or before 50
        page.keyboard.press("End")
        wait_counter(page, "1000 / 1001")
        assert legend.inner_text() == "reward @987 = 987"
        plot = page.locator('.plot[data-field="reward"] .plot-canvas')
        box = plot.bounding_box()
        plot.click(position={"x": 44 + (box["width"] - 52) / 2, "y": box["height"] / 2})
        wait_counter(page, "500 / 1001")  # a click seeks in the episode's steps, not the points'
    assert page.errors == []


def test_the_view_page_works_under_its_content_security_policy(strict_page, buffer):
    """Every script, style, video and API call the page makes is one the policy allows: a
    violation would be a console error (the page's own requests), and the page would not play."""
    page = strict_page
    with ViewerServer(BufferApp(buffer, location="strict", fps=10)) as server:
        page.goto(server.url)
        page.wait_for_selector('#episode-header[data-episode="0"]', timeout=WAIT_MS)
        page.wait_for_selector('.plot[data-field="reward"] canvas.lines', timeout=WAIT_MS)
        ready = "[...document.querySelectorAll('#videos video')].map(v => v.readyState >= 2 && v.videoWidth > 0)"
        for _ in range(WAIT_MS // 100):  # polled from here: the policy refuses wait_for_function's eval
            if page.evaluate(ready) == [True, True, True]:
                break
            page.wait_for_timeout(100)
        assert page.evaluate(ready) == [True, True, True]
        assert page.evaluate("typeof window.viewer.player.seek") == "function"
        page.keyboard.press("ArrowRight")
        page.wait_for_selector('#frame-counter[data-frame="1"]', timeout=WAIT_MS)
        assert page.errors == []
        # markup that slipped into the page as HTML could not run a script
        page.evaluate("document.body.insertAdjacentHTML('beforeend', '<img src=data:, onerror=\"window.ran = 1\">')")
        page.evaluate(
            "document.body.append(Object.assign(document.createElement('script'), {textContent: 'window.ran = 2'}))"
        )
        page.wait_for_selector('img[src="data:,"]', state="attached")
        assert page.evaluate("window.ran") is None
    assert page.errors and all("Content Security Policy" in error for error in page.errors)
