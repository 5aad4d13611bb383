"""``python -m replaybuf.demo`` leaves a buffer to look at, says how, and overwrites nothing else."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.cli import main as cli_main
from replaybuf.demo import main, next_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )


# one xdist worker runs the module, so the demo (its fixture, a few seconds) runs once
pytestmark = pytest.mark.xdist_group("demo")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    return workdir, run("-m", "replaybuf.demo", cwd=workdir)


def test_demo_keeps_its_buffer_and_prints_the_next_commands(demo_run, capsys):
    workdir, result = demo_run
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  replaybuf view ./replaybuf-demo" in lines
    assert "  replaybuf info ./replaybuf-demo" in lines
    snippet = "\n".join(line[2:] for line in lines[lines.index("  from replaybuf import ReplayBuffer") :])
    assert snippet.count("\n") == 1
    namespace = {}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exec(snippet, namespace)  # the printed snippet runs as printed
    finally:
        os.chdir(cwd)
    assert namespace["arrays"]["frame"].shape[:1] == (16,)
    buffer = ReplayBuffer.from_folder(workdir / "replaybuf-demo", read_only=True)
    assert buffer.num_episodes == 16
    assert cli_main(["info", str(workdir / "replaybuf-demo")]) == 0
    assert "data/frame" in capsys.readouterr().out


def test_demo_reruns_over_its_own_buffer(demo_run, capsys):
    workdir, _ = demo_run
    assert main([str(workdir / "replaybuf-demo")]) == 0
    assert "wrote 16 episodes" in capsys.readouterr().out
    assert ReplayBuffer.from_folder(workdir / "replaybuf-demo", read_only=True).num_episodes == 16


def test_next_steps_quote_the_folder_given():
    text = next_steps("/tmp/my demo")
    assert "  replaybuf view '/tmp/my demo'" in text.splitlines()
    assert "from_folder('/tmp/my demo', read_only=True)" in text


def test_demo_refuses_a_folder_holding_anything_else(tmp_path, capsys):
    notes = tmp_path / "replaybuf-demo" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    assert main([str(notes.parent)]) == 2
    err = capsys.readouterr().err
    assert f"not writing to {str(notes.parent)!r}" in err and "['notes.txt']" in err
    assert sorted(os.listdir(notes.parent)) == ["notes.txt"]
    assert main([str(notes)]) == 2
    assert "it is a file, not a folder" in capsys.readouterr().err

    other = tmp_path / "other"
    buffer = ReplayBuffer(str(other), max_episodes=2, max_timesteps=3, fields={"x": "float"})
    buffer.store_episode(x=np.ones(3))
    buffer.close()
    assert main([str(other)]) == 2
    err = capsys.readouterr().err
    assert "not the demo's" in err and "max_episodes: stored 2 vs passed 64" in err
    assert ReplayBuffer.from_folder(other, read_only=True).num_episodes == 1


def test_demo_names_a_folder_it_cannot_create_without_a_traceback(tmp_path, capsys):
    """A path under a file (or on a read-only file system, or held by another writer) raised
    the buffer's error as a traceback, where a folder holding other files is refused in two lines."""
    above = tmp_path / "notes.txt"
    above.write_text("mine")
    assert main([str(above / "demo")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write to {str(above / 'demo')!r}" in err and "above it is a file" in err
    assert "Name another folder" in err and above.read_text() == "mine"


def test_ctrl_c_in_the_demo_says_what_is_left_and_a_rerun_starts_over(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the demo writes: a line saying what the folder keeps and how to start over,
    status 130, where a KeyboardInterrupt traceback from inside numpy or zarr was printed."""
    import replaybuf.demo as demo

    frames = []

    def interrupted_frame(t: int, episode: int) -> np.ndarray:
        if episode == 2:
            raise KeyboardInterrupt
        frames.append(t)
        return np.zeros((64, 64, 3), np.uint8)

    monkeypatch.setattr(demo, "rendered_frame", interrupted_frame)
    folder = str(tmp_path / "my demo")
    assert main([folder]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"interrupted; {folder!r} keeps the episodes committed before it" in err
    assert f"python -m replaybuf.demo '{folder}'" in err
    reader = ReplayBuffer.from_folder(folder, read_only=True)
    assert reader.num_episodes == 2 and reader.episode_lens[:2].sum() == len(frames)
    assert demo.foreign_content(tmp_path / "my demo") is None  # a rerun takes the folder over


def test_the_demo_piped_into_a_reader_that_stops_early_ends_quietly(monkeypatch, capsys):
    """``python -m replaybuf.demo | head -1``: status 141 and nothing said, as the CLI's commands
    (a BrokenPipeError traceback before)."""
    import replaybuf.demo as demo

    read_end, write_end = os.pipe()
    os.close(read_end)
    closed_pipe = os.fdopen(write_end, "w")
    monkeypatch.setattr(demo, "_write_and_sample", lambda name: print("wrote 16 episodes") or 0)
    monkeypatch.setattr(sys, "stdout", closed_pipe)
    try:
        assert main(["unused"]) == 141
    finally:
        monkeypatch.undo()
        closed_pipe.close()
    assert capsys.readouterr().err == ""
