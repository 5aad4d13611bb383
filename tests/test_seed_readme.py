"""memmap-replay-buffer's README, run end to end against replaybuf and against the seed itself.

Every code snippet of ``shared/seed/memmap-replay-buffer-README.txt`` is read from the file (not
copied), its import spelled ``replaybuf``, and executed in order in one namespace inside a
temporary directory, as a user pasting the README would. Around each snippet the tests add the
inputs the README leaves undefined (``states``, ``episode_ids``, ...) and extra checks: values
round-trip, ``from_folder`` rehydrates, ``read_only`` touches no file, ``clear``, the ``update``
variants, ``get_all_data`` shapes and padding, video files, the CLI and its page,
``ConcatReplayBuffer``. The same run against memmap-replay-buffer proves the checks right, and
each section's outputs (batches, ``get_all_data`` tensors, ...) must equal the seed's.
"""

from __future__ import annotations

import gc
import importlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._compare import assert_same

# slow: the seed msyncs on every store(), and the CLI starts two interpreters; one xdist worker
# runs the module, so the README runs (the ``runs`` fixture, ~12 s) are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("seed_readme")]

REPO_ROOT = Path(__file__).resolve().parents[1]
README = Path(__file__).parent / "data" / "memmap-replay-buffer-README.txt"  # the seed's PyPI page, verbatim

OURS, SEED = "replaybuf", "memmap_replay_buffer"

# (heading, first line, last line) of each code snippet, in README order
SNIPPETS = {
    "usage": ("Usage", "import torch", "assert buffer_rehydrated.num_episodes == 4"),
    "trajectory": ("Trajectory-level", "dataloader = buffer.dataloader(", "    assert mask.shape    == (2, 100)"),
    "timestep": ("Timestep-level", "dataloader = buffer.dataloader(", "    assert task_id.shape == (8,)"),
    "n_step": ("N-step transitions", "dataloader = buffer.dataloader(", "    assert n_step_lens.shape == (4,)"),
    "store_episode": ("Storing whole episodes", "buffer.store_episode(", ")"),
    "batched": ("Batched parallel collection", "with buffer.batched_episode(", "        )"),
    "update": ("Updating data in place", "buffer.update(returns", "buffer.update(0, returns"),
    "get_all_data": (
        "Pulling everything at once",
        "all_data = buffer.get_all_data()",
        "all_data = buffer.get_all_data()",
    ),
    "video": (
        "Rendering episodes to video",
        "buffer.save_video('./episode-0.mp4'",
        "buffer.save_video('./episodes-0-3-5.mp4'",
    ),
    "cli": ("Rendering episodes to video", "$ inspect-replay-buffer", "$ inspect-replay-buffer"),
    "reopen": ("Reopening, read-only, and clearing", "buffer = ReplayBuffer.from_folder(", "buffer.clear()"),
    "concat": (
        "Concatenating buffers",
        "from memmap_replay_buffer import ConcatReplayBuffer",
        "dataloader = concat.dataloader(",
    ),
}


def readme_snippet(name: str, lib: str = OURS) -> str:
    """The snippet's lines as they stand in the README, with the import spelled for ``lib``."""
    heading, first, last = SNIPPETS[name]
    lines = README.read_text().splitlines()
    start = lines.index(heading)
    begin = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(first))
    end = next(i for i in range(begin, len(lines)) if lines[i].startswith(last))
    return "\n".join(lines[begin : end + 1]).replace(SEED, lib) + "\n"


def files_under(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read()


def count_frames(path: Path) -> int:
    import imageio.v2 as imageio

    with imageio.get_reader(str(path)) as reader:
        return reader.count_frames() if path.suffix == ".mp4" else len(list(reader))


def regenerate_usage_data(seed_value: int) -> dict[str, torch.Tensor]:
    """The values the Usage snippet draws, in its order, for the round-trip check."""
    torch.manual_seed(seed_value)
    states, actions = [], []
    for _ in range(4):
        for _ in range(100):
            states.append(torch.randn(3, 16, 16))
            actions.append(torch.randint(0, 4, (2,)))
    return dict(state=torch.stack(states).view(4, 100, 3, 16, 16), action=torch.stack(actions).view(4, 100, 2))


FIELDS = dict(state=("float", (3, 16, 16), 0.0), action=("int", 2), reward="float")
META_FIELDS = dict(task_id="int")


@dataclass
class ReadmeRun:
    """One pass over the README with one library: per-section outputs or the error it raised."""

    lib: str
    workdir: Path
    namespace: dict = field(default_factory=dict)
    outputs: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def module(self):
        return importlib.import_module(self.lib)

    def exec(self, section: str, code: str | None = None) -> None:
        exec(compile(code or readme_snippet(section, self.lib), f"<README {section}>", "exec"), self.namespace)

    def run(self, sections: dict[str, Callable[[ReadmeRun, dict], None]]) -> None:
        cwd = os.getcwd()
        os.chdir(self.workdir)
        try:
            for index, (section, check) in enumerate(sections.items()):
                outputs = self.outputs.setdefault(section, {})
                torch.manual_seed(index)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        check(self, outputs)
                except Exception:  # recorded per section, reported by that section's test
                    self.errors[section] = traceback.format_exc()
        finally:
            os.chdir(cwd)


# the sections: each runs its snippet, then checks and records what it produced


def usage(run: ReadmeRun, out: dict) -> None:
    torch.manual_seed(100)
    run.exec("usage")
    buffer, rehydrated = run.namespace["buffer"], run.namespace["buffer_rehydrated"]
    data = buffer.get_all_data()
    expected = regenerate_usage_data(100)
    assert torch.equal(data["state"], expected["state"])
    assert torch.equal(data["action"], expected["action"].to(torch.int32))
    assert torch.equal(data["reward"], torch.ones(4, 100))
    assert data["task_id"].tolist() == [1] * 4
    assert data["episode_lens"].tolist() == [100] * 4
    assert buffer.num_episodes == len(buffer) == 4
    assert_same(rehydrated.get_all_data(), data, "from_folder get_all_data")
    out.update(data=data, num_episodes=rehydrated.num_episodes)


def collect_batches(run: ReadmeRun, out: dict) -> None:
    out["batches"] = [tuple(batch) for batch in run.namespace["dataloader"]]


def trajectory(run: ReadmeRun, out: dict) -> None:
    run.exec("trajectory")
    collect_batches(run, out)
    assert len(out["batches"]) == 2
    state, action, reward, task_id, mask, lens = out["batches"][0]
    assert lens.tolist() == [100, 100] and bool(mask.all())
    assert torch.equal(state, run.namespace["buffer"].get_all_data()["state"][:2])


def timestep(run: ReadmeRun, out: dict) -> None:
    run.exec("timestep")
    collect_batches(run, out)
    assert len(out["batches"]) == 4 * 100 // 8
    assert all(bool((task_id == 1).all()) for _, _, task_id in out["batches"])


def n_step(run: ReadmeRun, out: dict) -> None:
    run.exec("n_step")
    collect_batches(run, out)
    state, next_state, action_chunk, rewards, n_step_lens = out["batches"][0]
    assert n_step_lens.tolist() == [5, 5, 5, 5]
    assert torch.equal(rewards, torch.ones(4, 5))


def store_episode(run: ReadmeRun, out: dict) -> None:
    torch.manual_seed(200)
    run.exec("store_episode")
    buffer = run.namespace["buffer"]
    torch.manual_seed(200)
    expected_state, expected_action, expected_reward = (
        torch.randn(100, 3, 16, 16),
        torch.randint(0, 4, (100, 2)),
        torch.randn(100),
    )
    data = buffer.get_all_data()
    assert buffer.num_episodes == 5
    assert torch.equal(data["state"][4], expected_state)
    assert torch.equal(data["action"][4], expected_action.to(torch.int32))
    assert torch.equal(data["reward"][4], expected_reward)
    assert data["task_id"][4].item() == 1 and data["episode_lens"][4].item() == 100
    out["data"] = data


def batched(run: ReadmeRun, out: dict) -> None:
    states, actions = torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4, 2))
    run.namespace.update(states=states, actions=actions)
    run.exec("batched")
    buffer = run.namespace["buffer"]
    data = buffer.get_all_data()
    assert buffer.num_episodes == 9
    assert torch.equal(data["state"][5:], states[:, None].expand(4, 100, 3, 16, 16))
    assert torch.equal(data["action"][5:], actions[:, None].expand(4, 100, 2).to(torch.int32))
    assert torch.equal(data["reward"][5:], torch.zeros(4, 100))  # not given: the declared default, zero
    assert data["task_id"][5:].tolist() == [0, 1, 2, 3]
    assert data["episode_lens"].tolist() == [100] * 9
    out["data"] = data


def update(run: ReadmeRun, out: dict) -> None:
    ns = run.namespace
    main_buffer = ns["buffer"]
    ReplayBuffer = run.module.ReplayBuffer
    buffer = ReplayBuffer(
        "./update_data",
        max_episodes=10,
        max_timesteps=100,
        fields=dict(reward="float", returns="float"),
        overwrite=True,
    )
    for _ in range(3):
        buffer.store_episode(reward=torch.randn(100))
    returns_for_ids, returns_for_one = torch.randn(2, 100), torch.randn(100)
    ns.update(buffer=buffer, episode_ids=[0, 2], returns_for_ids=returns_for_ids, returns_for_one=returns_for_one)
    torch.manual_seed(300)
    run.exec("update")
    torch.manual_seed(300)
    expected = torch.randn(3, 100)
    expected[[0, 2]] = returns_for_ids
    expected[0] = returns_for_one
    data = buffer.get_all_data()
    assert torch.equal(data["returns"], expected)
    buffer.update(slice(1, 3), returns=torch.full((1, 50), 7.0))  # broadcast over episodes, first 50 steps
    expected[1:3, :50] = 7.0
    assert torch.equal(buffer.get_all_data()["returns"], expected)
    out["data"] = buffer.get_all_data()
    ns["buffer"] = main_buffer


def get_all_data(run: ReadmeRun, out: dict) -> None:
    run.exec("get_all_data")
    data = run.namespace["all_data"]
    assert {name: tuple(value.shape) for name, value in data.items()} == {
        "state": (9, 100, 3, 16, 16),
        "action": (9, 100, 2),
        "reward": (9, 100),
        "task_id": (9,),
        "episode_lens": (9,),
    }
    assert data["state"].dtype == torch.float32 and data["action"].dtype == torch.int32
    assert data["task_id"].tolist() == [1] * 5 + [0, 1, 2, 3]
    subset = run.namespace["buffer"].get_all_data(fields=("reward",), meta_fields=("task_id",))
    assert sorted(subset) == ["reward", "task_id"]
    # padding: a shorter episode is padded to the longest, with zeros (or the field's default)
    padded = run.module.ReplayBuffer(
        "./padding_data",
        max_episodes=4,
        max_timesteps=10,
        fields=dict(reward="float", bonus=("float", (), 5.0), action=("int", 2)),
        overwrite=True,
    )
    padded.store_episode(reward=torch.arange(3.0), action=torch.ones(3, 2, dtype=torch.int32))
    padded.store_episode(reward=torch.arange(5.0), bonus=torch.zeros(5))
    padded_data = padded.get_all_data()
    assert padded_data["reward"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    assert padded_data["action"].shape == (2, 5, 2) and padded_data["action"][0, 3:].eq(0).all()
    assert padded_data["episode_lens"].tolist() == [3, 5]
    out.update(data=data, subset=subset, padded=padded_data)


def video(run: ReadmeRun, out: dict) -> None:
    import imageio_ffmpeg  # noqa: F401  (mp4 writing needs it: the test extra installs it)

    run.exec("video")
    sizes = {name: Path(name).stat().st_size for name in ("episode-0.mp4", "episodes-0-3-5.mp4")}
    assert all(size > 0 for size in sizes.values()), sizes
    frames = {name: count_frames(Path(name)) for name in sizes}
    assert frames == {"episode-0.mp4": 100, "episodes-0-3-5.mp4": 300}
    # trajectory_to_video(frames, path, fps) for plain (time, height, width, channels) arrays
    plain = np.linspace(0, 255, 6 * 16 * 16 * 3).astype(np.uint8).reshape(6, 16, 16, 3)
    for path in ("plain.gif", "plain.mp4"):
        run.module.trajectory_to_video(plain, path, 10)
        assert Path(path).stat().st_size > 0 and count_frames(Path(path)) == 6
    out["frames"] = frames


def cli_command(lib: str, argv: list[str]) -> list[str]:
    if lib == SEED:
        return [shutil.which("inspect-replay-buffer") or "inspect-replay-buffer", *argv]
    launcher = "import sys; from replaybuf.cli import inspect_main; sys.exit(inspect_main())"
    return [sys.executable, "-c", launcher, *argv]


def cli(run: ReadmeRun, out: dict) -> None:
    ReplayBuffer = run.module.ReplayBuffer
    images = ReplayBuffer(
        "./image_data",
        max_episodes=8,
        max_timesteps=8,
        fields=dict(front=("uint8", (32, 32, 3)), wrist=("uint8", (32, 32, 3))),
        overwrite=True,
    )
    for episode in range(6):
        ramp = torch.arange(8, dtype=torch.uint8)[:, None, None, None] * 30 + episode
        images.store_episode(front=ramp.expand(8, 32, 32, 3), wrist=(255 - ramp).expand(8, 32, 32, 3))
    images.flush()
    del images
    gc.collect()
    line = readme_snippet("cli", run.lib).strip()
    argv = shlex.split(line)[2:]  # drop "$ inspect-replay-buffer"
    port = free_port()
    argv[argv.index("--serve") + 1] = str(port)  # 8000 may be taken on a shared machine
    env = {**os.environ, "BROWSER": "true", "PYTHONPATH": str(REPO_ROOT)}  # the page "opens" in /bin/true
    process = subprocess.Popen(
        cli_command(run.lib, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        page = None
        deadline = time.monotonic() + 120
        while page is None and time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"CLI exited with {process.returncode}: {process.stdout.read().decode()}")
            try:
                status, page = http_get(f"http://127.0.0.1:{port}/")
            except OSError:
                time.sleep(0.2)
        assert page is not None, "the --serve page never answered"
        assert status == 200
        if b"front" not in page:  # replaybuf's page names its videos through its JSON API
            status, page = http_get(f"http://127.0.0.1:{port}/api/info")
        assert status == 200 and b"front" in page and b"wrist" in page
        status, head = http_get(f"http://127.0.0.1:{port}/video/front", {"Range": "bytes=0-99"})
        assert status == 206 and len(head) == 100
    finally:
        process.kill()
        process.wait()
    videos = {name: Path(name) for name in ("replay.front.mp4", "replay.wrist.mp4")}
    assert all(path.stat().st_size > 0 for path in videos.values())
    out["frames"] = {name: count_frames(path) for name, path in videos.items()}
    assert out["frames"] == {"replay.front.mp4": 24, "replay.wrist.mp4": 24}


def reopen(run: ReadmeRun, out: dict) -> None:
    ns = run.namespace
    ns["buffer"].flush()
    for name in ("buffer", "buffer_rehydrated", "dataloader"):
        ns.pop(name, None)
    gc.collect()
    ns.update(fields=FIELDS, meta_fields=META_FIELDS)
    first, second, third = readme_snippet("reopen", run.lib).splitlines()
    before = files_under(Path("replay_data"))

    run.exec("reopen", first)  # read_only = True
    buffer = ns["buffer"]
    assert buffer.num_episodes == 9
    out["read_only_data"] = buffer.get_all_data()
    for write in (lambda: buffer.store_episode(reward=torch.ones(3)), buffer.clear):
        with pytest.raises(ValueError):
            write()
    del buffer
    ns.pop("buffer")
    gc.collect()
    assert files_under(Path("replay_data")) == before, "read_only=True changed files"

    second = second.replace("fields = ...,", "fields = fields, meta_fields = meta_fields, circular = True,")
    run.exec("reopen", second)  # overwrite = False
    assert ns["buffer"].num_episodes == 9
    assert_same(ns["buffer"].get_all_data(), out["read_only_data"], "reopened get_all_data")
    with pytest.raises(ValueError, match="max_episodes"):
        run.module.ReplayBuffer(
            "./replay_data",
            max_episodes=999,
            max_timesteps=500,
            fields=FIELDS,
            meta_fields=META_FIELDS,
            circular=True,
            overwrite=False,
        )

    run.exec("reopen", third)  # clear()
    buffer = ns["buffer"]
    assert buffer.num_episodes == 0 and len(buffer) == 0 and buffer.get_all_data() == {}
    assert run.module.ReplayBuffer.from_folder("./replay_data").num_episodes == 0
    out["cleared"] = len(buffer)


def concat(run: ReadmeRun, out: dict) -> None:
    ReplayBuffer = run.module.ReplayBuffer
    lengths = {"./replay_data_a": (10, 12, 7), "./replay_data_b": (15, 5)}
    for (folder, lens), max_timesteps in zip(lengths.items(), (20, 30), strict=True):
        part = ReplayBuffer(
            folder, max_episodes=10, max_timesteps=max_timesteps, fields=FIELDS, meta_fields=META_FIELDS, overwrite=True
        )
        for length in lens:
            part.store_episode(
                state=torch.randn(length, 3, 16, 16),
                action=torch.randint(0, 4, (length, 2)),
                reward=torch.randn(length),
                task_id=length,
            )
        part.flush()
        del part
    gc.collect()
    before = {folder: files_under(Path(folder)) for folder in lengths}
    run.exec("concat")
    concat_buffer, dataloader = run.namespace["concat"], run.namespace["dataloader"]
    assert concat_buffer.num_episodes == len(concat_buffer) == 5
    assert concat_buffer.max_timesteps == 30
    batches = list(dataloader)
    assert {folder: files_under(Path(folder)) for folder in lengths} == before, "reading read-only buffers wrote files"
    assert [batch["_lens"].tolist() for batch in batches] == [[10, 12], [7, 15], [5]]
    assert [tuple(batch["_mask"].shape) for batch in batches] == [(2, 12), (2, 15), (1, 5)]
    assert all(torch.equal(batch["_mask"].sum(-1), batch["_lens"]) for batch in batches)
    data = concat_buffer.get_all_data()
    assert data["state"].shape == (5, 15, 3, 16, 16) and data["reward"].shape == (5, 15)
    assert data["task_id"].tolist() == [10, 12, 7, 15, 5]
    for row, length in enumerate((10, 12, 7, 15, 5)):
        assert data["reward"][row, length:].eq(0).all() and data["state"][row, length:].eq(0).all()
    with pytest.raises(Exception, match=r"(?i)read.?only"):
        concat_buffer.store_episode(reward=torch.ones(3))
    out.update(batches=batches, data=data)


def notes(run: ReadmeRun, out: dict) -> None:
    """The README's closing notes: circular overwrite, full non-circular buffers, defaults, flushing."""
    ReplayBuffer = run.module.ReplayBuffer
    fields = dict(x="float", y=("float", 2, 7.0))
    ring = ReplayBuffer(
        "./notes_ring", max_episodes=3, max_timesteps=4, fields=fields, circular=True, flush_every_store_step=0
    )
    for episode in range(5):
        ring.store_episode(x=torch.full((2,), float(episode)))
    assert ring.num_episodes == 3
    out["ring_x"] = np.array(ring.data["x"][:, :2])  # slots: the oldest two were overwritten
    assert out["ring_x"].tolist() == [[3, 3], [4, 4], [2, 2]]
    out["ring_y"] = np.array(ring.data["y"][:, :2])
    assert (out["ring_y"] == 7.0).all()

    full = ReplayBuffer("./notes_full", max_episodes=2, max_timesteps=4, fields=fields, flush_every_store_step=5)
    for _ in range(2):
        full.store_episode(x=torch.ones(3))
    with pytest.raises(ValueError, match="full"):
        full.store_episode(x=torch.ones(3))
    assert full.num_episodes == 2 and full.get_all_data()["x"].shape == (2, 3)

    with ring.one_episode():
        out["stored"] = ring.store(x=1.5)  # y missing: its declared default
    assert out["stored"].y.tolist() == [7.0, 7.0]
    assert ring.data["y"][2, 0].tolist() == [7.0, 7.0] and ring.data["x"][2, 0] == 1.5  # the next slot: 5 % 3


SECTIONS = dict(
    usage=usage,
    trajectory=trajectory,
    timestep=timestep,
    n_step=n_step,
    store_episode=store_episode,
    batched=batched,
    update=update,
    get_all_data=get_all_data,
    video=video,
    cli=cli,
    reopen=reopen,
    concat=concat,
    notes=notes,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, ReadmeRun]:
    out = {}
    for lib in (OURS, SEED):
        run = ReadmeRun(lib, tmp_path_factory.mktemp(lib))
        run.run(SECTIONS)
        out[lib] = run
    return out


def test_every_snippet_is_found_and_covered():
    text = README.read_text()
    code_lines = {line for name in SNIPPETS for line in readme_snippet(name, SEED).splitlines()}
    assert SEED in readme_snippet("usage", SEED) and OURS in readme_snippet("usage", OURS)
    # every line that looks like code (an import, a call, an assignment, a shell prompt) is in a snippet
    looks_like_code = [
        line
        for line in text.splitlines()
        if line.startswith(
            ("import ", "from ", "buffer", "with ", "for ", "dataloader", "all_data", "concat", "$ inspect")
        )
    ]
    assert looks_like_code and set(looks_like_code) <= code_lines
    assert set(SNIPPETS) <= set(SECTIONS)


@pytest.mark.parametrize("lib", [OURS, SEED])
@pytest.mark.parametrize("section", list(SECTIONS))
def test_readme_section_runs(runs, lib, section):
    error = runs[lib].errors.get(section)
    if error:
        pytest.fail(f"README section {section!r} with {lib}:\n{error}", pytrace=False)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_readme_section_matches_the_seed(runs, section):
    ours, theirs = runs[OURS], runs[SEED]
    assert section not in theirs.errors, theirs.errors.get(section)
    if section in ours.errors:
        pytest.fail(f"README section {section!r} failed with replaybuf:\n{ours.errors[section]}", pytrace=False)
    assert_same(ours.outputs[section], theirs.outputs[section], section)
