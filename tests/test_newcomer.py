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


# hides packages as an environment without them would: importing one (or a module in it) raises
# ModuleNotFoundError naming it
HIDE = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
"""

WITHOUT_OPTIONAL_PACKAGES = (
    HIDE
    + """
import numpy as np
import replaybuf
from replaybuf import ReplayBuffer, importers

for name in ("torch", "dask", "imageio", "h5py"):
    assert sys.modules[name] is None, name  # import replaybuf imported none of them
buffer = ReplayBuffer("core", max_episodes=4, max_timesteps=5, fields={"x": "float", "frame": ("uint8", (8, 8, 3))})
buffer.store_episode(x=np.arange(5, dtype=np.float32), frame=np.zeros((5, 8, 8, 3), np.uint8))
buffer.close()
reader = ReplayBuffer.from_folder("core", read_only=True)
assert reader.num_episodes == 1 and reader.data["x"][0, :5].tolist() == [0, 1, 2, 3, 4]
uses = {
    "dataloader": lambda: reader.dataloader(batch_size=2),
    "dataset": lambda: reader.dataset(),
    "get_all_data": lambda: reader.get_all_data(),
    "to_dask": lambda: reader.to_dask(),
    "episode_mask": lambda: reader.episode_mask(),
    "stats": lambda: reader.stats(),
    "ConcatReplayBuffer": lambda: replaybuf.ConcatReplayBuffer,
    "save_video": lambda: reader.save_video("episode.mp4", episode_index=0),
    "hdf5": lambda: ReplayBuffer("h5", max_episodes=2, max_timesteps=2, fields={"x": "float"}, backend="hdf5"),
    "s3": lambda: ReplayBuffer.from_folder("s3://bucket/run", storage_options={"endpoint_url": "http://127.0.0.1:9"}),
    "gs": lambda: ReplayBuffer.from_folder("gs://bucket/run"),
    "d4rl": lambda: importers.load("d4rl", "source.hdf5", "d4rl"),
    "robomimic": lambda: importers.load("robomimic", "source.hdf5", "robomimic"),
}
for use, call in uses.items():
    try:
        call()
    except ImportError as error:
        print(f"{use}: {error}")
    else:
        print(f"{use}: ran")
"""
)


def test_without_the_packages_only_some_features_use_the_core_works_and_each_feature_names_its_install(tmp_path):
    """``import replaybuf``, writing and reading need none of torch, dask, imageio, h5py, s3fs,
    obstore or gcsfs; a feature that needs a missing one says which ``pip install`` brings it
    (torch, dask and imageio said only "No module named ...", S3 "Install s3fs to access S3")."""
    hidden = "torch,dask,imageio,h5py,s3fs,obstore,gcsfs"
    (tmp_path / "source.hdf5").write_bytes(b"\x89HDF\r\n\x1a\n")
    done = run_python(WITHOUT_OPTIONAL_PACKAGES, hidden, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    torch_hint = "needs torch, a dependency of replaybuf that is not installed: pip install torch"
    for use in ("dataloader", "dataset", "ConcatReplayBuffer"):
        assert use in said[use] and torch_hint in said[use], said[use]
    for use in ("get_all_data", "to_dask", "episode_mask", "stats"):
        assert said[use].startswith(f"{use} needs ") and "a dependency of replaybuf that is not installed" in said[use]
        assert "pip install torch" in said[use] or "pip install 'dask[array]'" in said[use], said[use]
    assert "writing .mp4 videos needs imageio" in said["save_video"] and "pip install imageio" in said["save_video"]
    assert "pip install 'replaybuf[h5py]'" in said["hdf5"]
    assert "pip install 'replaybuf[s3]'" in said["s3"], said["s3"]
    assert "pip install 'replaybuf[gcs]'" in said["gs"], said["gs"]
    for use in ("d4rl", "robomimic"):  # said "No module named 'h5py'"
        assert "pip install 'replaybuf[h5py]'" in said[use], said[use]
    assert not any((tmp_path / name).exists() for name in ("episode.mp4", "h5", "d4rl", "robomimic"))
