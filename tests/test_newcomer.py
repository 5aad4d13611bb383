"""What a newcomer meets first: the commands run as a shell runs them (piped, on wrong paths),
without the optional packages, and on buffers of other formats.

Each test runs the current interpreter in a subprocess where the behaviour depends on the
process (its stdout, its imports), and hides a package with a meta path finder rather than
building a virtual environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def run_python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this checkout's replaybuf."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_command_piped_into_a_reader_that_stops_early_ends_quietly():
    """``replaybuf info BUF | head -1``: the reader closes the pipe; the command ends with the
    shell's SIGPIPE status and says nothing (it said "error: [Errno 32] Broken pipe" with its
    usage, status 2)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "replaybuf.cli", "info", str(DATA / "format-v4" / "zarr")]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before the child writes a byte: its first write meets a closed pipe
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=300) == 141
    assert stderr == ""


def test_a_buffer_of_a_newer_format_names_a_newer_replaybuf_not_the_upgrade_command(tmp_path):
    """``replaybuf upgrade`` on a buffer a newer release wrote cannot help: the message says to
    install a newer replaybuf, and the folder is left as it was."""
    path = tmp_path / "newer"
    shutil.copytree(DATA / "format-v4" / "zarr", path)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["version"] = 99
    (path / "zarr.json").write_text(json.dumps(root))
    before = sorted((p.relative_to(path), p.read_bytes()) for p in path.rglob("*") if p.is_file())
    done = run_python("from replaybuf.cli import main; main()", "upgrade", str(path))
    assert done.returncode == 2 and done.stdout == ""
    said = done.stderr.strip().splitlines()[-1]
    assert str(path) in said and "format version 99" in said and "pip install --upgrade replaybuf" in said, said
    assert "Traceback" not in done.stderr
    assert sorted((p.relative_to(path), p.read_bytes()) for p in path.rglob("*") if p.is_file()) == before
