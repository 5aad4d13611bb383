"""read_only=True creates and writes nothing: every reading entry point and read command leaves
each file's bytes, size and mtime and every folder's listing as they were, on every local
backend, beside a live writer too; a folder this process may not write reads all the same, and
a writable open of it is refused naming the folder and read_only=True."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ReplayBuffer, verify
from replaybuf.cli import main as cli_main
from tests._backends import LOCAL_BACKENDS

FIELDS = dict(
    image=("uint8", (8, 8, 3)),
    state=("float", 3),
    action="int",
    reward="float",
    priority=("float", (), 1.0),
)


def _tree(root: str) -> dict[str, tuple]:
    """Every entry under ``root``, hidden ones too: a file's bytes, size and mtime, a folder's
    listing and mtime (atime is left out: reading may move it)."""
    out: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root):
        info = os.lstat(folder)
        out[os.path.relpath(folder, root) + "/"] = (info.st_mtime_ns, tuple(sorted(dirs + files)))
        for name in files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (info.st_size, info.st_mtime_ns, f.read())
    return out


def _make(location: str, backend: str) -> ReplayBuffer:
    buffer = ReplayBuffer(location, 6, 10, fields=FIELDS, meta_fields=dict(task="int"), circular=True, backend=backend)
    rng = np.random.default_rng(0)
    for n in (4, 6, 5):
        buffer.store_episode(
            image=rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
            state=rng.standard_normal((n, 3)).astype(np.float32),
            action=np.arange(n),
            reward=np.ones(n),
            priority=np.ones(n),
            task=n,
        )
    buffer.attrs["fps"] = 10
    buffer.snapshot("first")
    return buffer


def _read_everything(location: str, backend: str, scratch: str) -> None:
    """Every reading entry point of the library and of the CLI, once."""
    reader = ReplayBuffer.from_folder(location, read_only=True)
    configured = ReplayBuffer(
        location, 6, 10, fields=FIELDS, meta_fields=dict(task="int"), circular=True, backend=backend, read_only=True
    )
    assert len(reader) == len(configured) > 0 and reader.num_episodes == 3
    assert reader.data["state"][1].shape == (10, 3) and reader.meta_data["task"][:3].tolist() == [4, 6, 5]
    assert reader.get_all_data()["image"].shape[0] == 3
    assert reader.attrs["fps"] == 10 and dict(reader.attrs) == {"fps": 10}
    reader.refresh()
    reader.stats()
    reader.to_dask()["state"].compute()
    for kwargs in (
        dict(timestep_level=True, shuffle=True),
        dict(n_steps=2, current_fields=("state",), next_fields=("state",), sequence_fields=("reward",)),
        dict(return_mask=True),
        dict(timestep_level=True, sampler="prioritized", priority_field="priority"),
        dict(timestep_level=True, cache="ram"),
        dict(timestep_level=True, num_workers=2, multiprocessing_context="fork"),
    ):
        assert sum(len(batch["state"]) for batch in reader.dataloader(batch_size=4, **kwargs)) > 0
    reader.save_video(os.path.join(scratch, "episode.gif"), [0, 1])
    assert ConcatReplayBuffer([location, location]).get_all_data()["state"].shape[0] == 6
    assert ReplayBuffer.from_folder(location, snapshot="first").get_all_data()["state"].shape[0] == 3
    cached = ReplayBuffer.from_folder(location, read_only=True, cache="disk", cache_dir=os.path.join(scratch, "cache"))
    cached.get_all_data()
    assert os.listdir(os.path.join(scratch, "cache"))
    verify(location)
    assert cli_main(["info", location]) == 0
    cli_main(["verify", location])  # 1 beside a writer with an episode in progress
    assert cli_main(["inspect", location, "-o", os.path.join(scratch, "inspect.mp4")]) == 0
    reader.close()
    configured.close()


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize("writer", ["closed", "live"])
def test_every_read_entry_point_writes_nothing(backend, writer, tmp_path, capsys):
    location = str(tmp_path / "buffer")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    buffer = _make(location, backend)
    if writer == "closed":
        buffer.close()
    else:  # an episode in progress in the step log, the counters written
        buffer.store(image=np.zeros((8, 8, 3), np.uint8), state=np.zeros(3), action=1, reward=0.0, priority=1.0)
        buffer.flush()
    before = _tree(location)
    _read_everything(location, backend, str(scratch))
    assert _tree(location) == before
    buffer.close()


_CHILD = textwrap.dedent(
    """
    import sys
    import pytest
    from replaybuf import ReplayBuffer, verify
    from replaybuf.cli import main as cli_main
    from replaybuf.storage import make_storage

    plain, *locations = sys.argv[1:]
    for location in locations:
        reader = ReplayBuffer.from_folder(location, read_only=True)
        assert reader.get_all_data()["state"].shape[0] == 3
        for _ in reader.dataloader(batch_size=4, timestep_level=True, shuffle=True):
            pass
        reader.stats()
        assert verify(location) == []
        assert cli_main(["info", location]) == 0
        assert make_storage(location).writer_lease().holder() is None
        assert cli_main(["unlock", location]) == 0
        with pytest.raises(PermissionError, match="read-only to this process.*read_only=True") as refused:
            ReplayBuffer.from_folder(location)
        assert repr(location) in str(refused.value)
    with pytest.raises(PermissionError, match="read_only=True"):  # not inside a buffer: that is refused first
        ReplayBuffer(plain + "/new", 2, 2, fields=dict(x="float"))
    print("read")
    """
)


def _unprivileged() -> list[str]:
    """The prefix that runs a command bound by permission bits: none for a user, for root a
    ``setpriv`` dropping every capability (root without them obeys the bits)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    drop = [setpriv, "--bounding-set=-all", "--inh-caps=-all"] if setpriv else []
    if not drop or subprocess.run([*drop, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root without a working setpriv to drop the capabilities that ignore permissions")
    return drop


def _set_writable(root: str, writable: bool) -> None:
    for folder, _, files in os.walk(root):
        for path in (folder, *(os.path.join(folder, name) for name in files)):
            mode = os.lstat(path).st_mode
            os.chmod(path, mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_a_folder_this_process_may_not_write_reads_and_a_writable_open_is_refused_clearly(tmp_path):
    prefix = _unprivileged()
    locations = []
    for backend in LOCAL_BACKENDS:
        location = str(tmp_path / backend)
        writer = _make(location, backend)
        lock = os.path.join(location, "replaybuf", "writer.lock")
        with open(lock, "rb") as f:
            record = f.read()
        writer.close()
        with open(lock, "wb") as f:  # the lock file a killed writer leaves, held by no process
            f.write(record)
        locations.append(location)
    plain = str(tmp_path / "plain")  # a folder of no buffer, where a create is refused too
    os.mkdir(plain)
    before = {location: _tree(location) for location in locations}
    locations.append(plain)
    for location in locations:
        _set_writable(location, False)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", _CHILD, plain, *locations[:-1]],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            timeout=300,
        )
    finally:
        for location in locations:
            _set_writable(location, True)
    assert done.returncode == 0 and "read" in done.stdout, done.stderr[-3000:]
    for location in locations[:-1]:
        assert _tree(location) == before[location]
    assert os.listdir(plain) == []
