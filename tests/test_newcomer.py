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

import numpy as np
import pytest

from replaybuf import ReplayBuffer, StorageError, verify

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


def test_a_broken_pipe_that_is_not_stdouts_is_still_an_error(capsys):
    """Only a closed stdout ends a command quietly: a pipe or socket of its own work breaking is
    reported as any other error."""
    import argparse

    from replaybuf.cli import Command, _run

    def lose_a_connection(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe", "a worker's pipe")

    parser = argparse.ArgumentParser(prog="replaybuf work")
    with pytest.raises(SystemExit) as exit_info:
        _run(Command("work", "", lambda parser: None, lose_a_connection), argparse.Namespace(), parser)
    assert exit_info.value.code == 2
    assert 'Broken pipe: "a worker\'s pipe"' in capsys.readouterr().err


def test_a_buffer_of_a_newer_format_names_a_newer_replaybuf_not_the_upgrade_command(tmp_path):
    """``replaybuf upgrade`` on a buffer a newer release wrote cannot help: the message says to
    install a newer replaybuf, and the folder is left as it was."""
    path = tmp_path / "newer"
    shutil.copytree(DATA / "format-v4" / "zarr", path)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["version"] = 99
    (path / "zarr.json").write_text(json.dumps(root))
    before = sorted((p.relative_to(path), p.read_bytes()) for p in path.rglob("*") if p.is_file())
    done = run_python("import sys; from replaybuf.cli import main; sys.exit(main())", "upgrade", str(path))
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


# runs each argv of sys.argv[1] (JSON) through the CLI's main in this process, then prints the statuses
CLI_RUNS = """
import json, sys
from replaybuf.cli import main
statuses = []
for argv in json.loads(sys.argv[1]):
    try:
        statuses.append(main(argv))
    except SystemExit as end:
        statuses.append(end.code)
print(statuses, file=sys.stderr)
"""


def test_commands_report_non_ascii_names_where_the_output_encoding_cannot_write_them(tmp_path):
    """With an ASCII stdout (``PYTHONIOENCODING=ascii``, a Latin-1 or C locale without UTF-8
    mode) a name it cannot encode is escaped: ``convert`` reported "error: 'ascii' codec can't
    encode" with exit status 2 after making the copy, ``info`` and ``verify`` the same."""
    source, copy = tmp_path / "données", tmp_path / "copie-été"
    buffer = ReplayBuffer(
        str(source), max_episodes=2, max_timesteps=3, fields={"x": "float"}, meta_fields={"réussi": "bool"}
    )
    buffer.store_episode(x=np.zeros(3, np.float32), réussi=True)
    buffer.close()
    runs = [["convert", str(source), str(copy)], ["verify", str(copy)], ["info", str(copy)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-c", CLI_RUNS, json.dumps(runs)], env=env, capture_output=True, timeout=300)
    assert done.stderr.decode().splitlines()[-1] == "[0, 0, 0]", done.stderr.decode()
    said = done.stdout.decode("ascii")
    assert "copie-\\xe9t\\xe9 [zarr], verified" in said and "copie-\\xe9t\\xe9: consistent" in said, said
    assert "meta/r\\xe9ussi" in said, said
    assert ReplayBuffer.from_folder(str(copy), read_only=True).num_episodes == 1


def test_a_buffer_in_a_folder_whose_name_is_not_utf8_is_read_through_the_read_cache(tmp_path):
    """A folder named in Latin-1 bytes (an old archive's, a Windows share's) opens as a path with
    surrogate escapes; the read cache hashed it as UTF-8 and failed every read with
    "UnicodeEncodeError: surrogates not allowed"."""
    path = str(tmp_path / os.fsdecode(b"caf\xe9"))
    buffer = ReplayBuffer(path, max_episodes=2, max_timesteps=4, fields={"x": "float"})
    buffer.store_episode(x=np.arange(4, dtype=np.float32))
    buffer.close()
    reader = ReplayBuffer.from_folder(path, read_only=True, cache="disk", cache_dir=str(tmp_path / "cache"))
    reader.warm_cache()
    assert reader.data["x"][0, :4].tolist() == [0, 1, 2, 3]
    assert len(os.listdir(tmp_path / "cache")) == 1


# creates a buffer per backend named in sys.argv[1] with a non-ASCII meta field, then opens the
# one of each backend made under UTF-8 (``made-<backend>``), read-only and writable; prints each outcome
NON_ASCII_FIELD_IN_AN_ASCII_LOCALE = """
import os, sys
from replaybuf import ReplayBuffer
calls = {}
for backend in sys.argv[1].split(","):
    calls[f"create-{backend}"] = lambda backend=backend: ReplayBuffer(
        backend, max_episodes=2, max_timesteps=3, fields={"x": "float"}, meta_fields={"r\\u00e9ussi": "bool"}, backend=backend
    )
    for read_only in (True, False):
        calls[f"open-{backend}-{read_only}"] = lambda backend=backend, ro=read_only: ReplayBuffer.from_folder(
            f"made-{backend}", read_only=ro
        )
for name, call in calls.items():
    try:
        call().close()
    except ValueError as error:
        print(name, ascii(str(error)), os.path.exists(name.removeprefix("create-")))
    else:
        print(name, "ran")
"""


def test_a_field_name_the_locales_file_names_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    """Without UTF-8 mode in an ASCII locale (``PYTHONUTF8=0 LC_ALL=C``), the zarr and memmap
    backends, whose files are named by their fields, stopped creating at the first such file with
    a UnicodeEncodeError, leaving a half-made buffer, and failed opening one with it; hdf5 keeps
    names inside its file."""
    for backend in ("zarr", "memmap", "hdf5"):
        made = ReplayBuffer(
            str(tmp_path / f"made-{backend}"),
            max_episodes=2,
            max_timesteps=3,
            fields={"x": "float"},
            meta_fields={"réussi": "bool"},
            backend=backend,
        )
        made.store_episode(x=np.zeros(3, np.float32), réussi=True)
        made.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}
    done = subprocess.run(
        [sys.executable, "-c", NON_ASCII_FIELD_IN_AN_ASCII_LOCALE, "zarr,memmap,hdf5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert len(said) == 9, done.stderr
    for backend in ("zarr", "memmap"):
        for call in (f"create-{backend}", f"open-{backend}-True", f"open-{backend}-False"):
            assert f"the {backend} buffer at " in said[call] and "field 'r\\xe9ussi' names a file" in said[call], said[
                call
            ]
            assert "PYTHONUTF8=1" in said[call] and said[call].endswith('nothing was written" False'), said[call]
    assert [said[f"{call}hdf5{end}"] for call, end in (("create-", ""), ("open-", "-True"), ("open-", "-False"))] == [
        "ran"
    ] * 3


# ---- replaybuf upgrade of the released formats: damage, a full disk, a second run -------------------

OLDER_FORMATS = [(version, backend) for version in ("format-v1", "format-v3") for backend in ("zarr", "memmap", "hdf5")]
# the format this release writes, per backend (zarr's 6 binds shards to their buffer)
NEWEST = {"zarr": 7, "memmap": 5, "hdf5": 5}


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def frame_file(buffer: Path, backend: str) -> Path:
    """The largest file holding the ``frame`` field's bytes (hdf5: the one data file)."""
    if backend == "hdf5":
        return buffer / "data.h5"
    files = [
        p for p in buffer.rglob("*") if p.is_file() and "frame" in str(p.relative_to(buffer)) and p.suffix != ".json"
    ]
    return max(files, key=lambda p: p.stat().st_size)


# format 1 keeps no checksums: only a truncation of its frames can be seen, not a flipped byte
DAMAGED = [
    (version, backend, damage)
    for version, backend in OLDER_FORMATS
    for damage in ("flipped byte", "truncated")
    if (version, damage) != ("format-v1", "flipped byte")
]


@pytest.mark.parametrize(("version", "backend", "damage"), DAMAGED)
def test_upgrade_refuses_a_damaged_source_and_changes_nothing(tmp_path, version, backend, damage):
    """A source whose frames fail their checks is refused naming the file, left byte for byte,
    and no copy stays beside it."""
    path = tmp_path / "buffer"
    shutil.copytree(DATA / version / backend, path)
    target = frame_file(path, backend)
    stored = bytearray(target.read_bytes())
    if damage == "truncated":
        del stored[len(stored) // 2 :]
    else:  # hdf5: a byte of the last dataset's rows (its layout puts the metadata first)
        stored[len(stored) - 50 if backend == "hdf5" else len(stored) // 2] ^= 0xFF
    target.write_bytes(bytes(stored))
    before = contents(path)
    done = run_python("import sys; from replaybuf.cli import main; sys.exit(main())", "upgrade", "--quiet", str(path))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert str(path) in done.stderr, done.stderr
    assert contents(path) == before
    assert sorted(os.listdir(tmp_path)) == ["buffer"]


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    from ._backends import tmpfs

    with tmpfs(tmp_path_factory.mktemp("small-disk"), "3m") as folder:
        yield Path(folder)


def release(disk: Path) -> None:
    """Let go of this process's maps and kept handles of files on ``disk``: deleted files keep
    their space while mapped or open, and would free it while the disk is meant to be full."""
    import gc

    from replaybuf.storage import _kv
    from replaybuf.storage._hotmap import shard_maps

    from ._backends import holds_files_under

    shard_maps().drop_under(str(disk))
    _kv._read_handles.drop_under(str(disk))
    if holds_files_under(disk):  # else a collection frees nothing there
        gc.collect()


def fill_but(disk: Path, spare: int) -> None:
    """Take all but ``spare`` free bytes of ``disk`` with a ballast file."""
    ballast = disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for block in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)
    os.truncate(ballast, max(0, ballast.stat().st_size - spare))


@pytest.mark.parametrize("spare", [0, 8 << 10, 32 << 10, 100 << 10])
@pytest.mark.parametrize(("version", "backend"), OLDER_FORMATS)
def test_upgrade_on_a_full_disk_leaves_the_buffer_as_it_was_and_nothing_beside_it(small_disk, version, backend, spare):
    """Whether the disk fills at the lease, the copy's creation or its data, the upgrade fails
    naming the disk, the buffer is byte for byte as it was, no copy is left, and once space is
    freed the same upgrade goes through."""
    from replaybuf.maintenance import upgrade

    release(small_disk)
    for entry in small_disk.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    path = small_disk / "buffer"
    shutil.copytree(DATA / version / backend, path)
    before = contents(path)
    fill_but(small_disk, spare)
    # memmap and hdf5 copies reserve their arrays: refused before they are written (``check_schema``)
    with pytest.raises(StorageError, match="No space left on device|bytes of disk up front"):
        upgrade(path, progress=False)
    assert contents(path) == before
    assert sorted(os.listdir(small_disk)) == ["ballast", "buffer"]
    (small_disk / "ballast").unlink()
    assert upgrade(path, progress=False)["upgraded"]
    assert verify(path) == []
    assert sorted(os.listdir(small_disk)) == ["buffer"]


@pytest.mark.parametrize(("version", "backend"), OLDER_FORMATS)
def test_a_second_upgrade_changes_nothing_and_the_upgraded_buffer_holds_what_the_original_did(
    tmp_path, version, backend
):
    from replaybuf import ReplayBuffer
    from replaybuf.maintenance import upgrade

    path = tmp_path / "buffer"
    shutil.copytree(DATA / version / backend, path)
    original = ReplayBuffer.from_folder(path, read_only=True)
    expected = {name: np.asarray(original.data[name][:]) for name in original.fieldnames}
    expected_meta = {name: np.asarray(original.meta_data[name][:]) for name in original.meta_fieldnames}
    order, counters = original.valid_episodes().tolist(), (original.episode_index, original.num_episodes)
    original.close()
    assert upgrade(path, progress=False)["upgraded"]
    upgraded = contents(path)
    again = upgrade(path, progress=False)
    assert again["upgraded"] is False and again["from_version"] == again["to_version"] == NEWEST[backend]
    assert contents(path) == upgraded
    reader = ReplayBuffer.from_folder(path, read_only=True)
    assert reader.valid_episodes().tolist() == order and (reader.episode_index, reader.num_episodes) == counters
    for name, values in expected.items():
        np.testing.assert_array_equal(np.asarray(reader.data[name][:]), values, err_msg=name)
    for name, values in expected_meta.items():
        np.testing.assert_array_equal(np.asarray(reader.meta_data[name][:]), values, err_msg=name)


def test_export_help_says_an_empty_folder_is_a_destination(tmp_path, capsys):
    """``export --help`` said "a new one" while an empty folder is taken as well (README:
    Importing and exporting)."""
    from replaybuf import ReplayBuffer
    from replaybuf.cli import build_parser, main

    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    dst = next(a for a in subparsers["export"]._actions if a.dest == "dst")
    assert "new or empty" in dst.help, dst.help
    source = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=3, fields={"x": "float"})
    source.store_episode(x=np.ones(3, np.float32))
    source.close()
    (tmp_path / "empty").mkdir()
    assert main(["export", "diffusion_policy", str(tmp_path / "buffer"), str(tmp_path / "empty")]) == 0


def test_the_anon_options_of_a_destination_do_not_say_read(capsys):
    """``convert --dst-anon`` and ``import --anon`` are for stores written to: their help said
    "read the destination's object store without credentials"."""
    from replaybuf.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for command, flag in (("convert", "--dst-anon"), ("import", "--anon"), ("convert", "--anon")):
        action = next(a for a in subparsers[command]._actions if flag in a.option_strings)
        assert action.help.startswith("access ") and "without credentials" in action.help, (command, action.help)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--bogus"], ["a", "b"]])
def test_the_demo_takes_its_options_as_options_not_as_a_folder(tmp_path, argv):
    """``python -m replaybuf.demo --help`` wrote a buffer into a folder named "--help"; now it
    prints the usage, and an unknown option or a second folder is a usage error."""
    done = subprocess.run(
        [sys.executable, "-m", "replaybuf.demo", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "usage: python -m replaybuf.demo [-h] [folder]" in done.stdout + done.stderr
    assert done.returncode == (0 if argv[0] in ("--help", "-h") else 2)
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_video_into_a_folder_it_may_not_write_names_the_output_before_rendering(tmp_path, capsys, monkeypatch):
    """``inspect --output`` / ``--sheet`` into a read-only folder: one line naming the file asked
    for (it named the hidden temp file beside it, after rendering every frame), and nothing
    written: with ``--sheet`` alone the video went to the current folder before the sheet failed."""
    from replaybuf.cli import main

    from ._backends import tmpfs

    folder, current = tmp_path / "read-only", tmp_path / "current"
    folder.mkdir()
    current.mkdir()
    monkeypatch.chdir(current)
    with tmpfs(folder, "1m"):
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        for option, name in (("--output", "episode.gif"), ("--sheet", "sheet.png")):
            # the disk refused: a failure (status 1), not a usage error
            assert main(["inspect", str(DATA / "format-v4" / "zarr"), option, str(folder / name)]) == 1
            said = capsys.readouterr().err.strip().splitlines()[-1]
            assert f"cannot write {str(folder / name)!r}: Read-only file system" in said, said
            assert ".partial" not in said
            assert os.listdir(current) == []


def without_file_permission_override() -> list[str]:
    """The command prefix that runs a child under the file permissions (root bypasses them:
    setpriv drops the capabilities that do)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: the file permissions cannot be made to apply")
    dropped = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--bounding-set={dropped}", f"--inh-caps={dropped}"]


def cli_without_permission(locked: Path, mode: int, *args: str) -> subprocess.CompletedProcess:
    """``python -m replaybuf.cli *args`` under the file permissions, ``locked`` set to ``mode``
    meanwhile (0: unreadable, 0o555: read-only)."""
    locked.chmod(mode)
    try:
        return subprocess.run(
            [*without_file_permission_override(), sys.executable, "-m", "replaybuf.cli", *args],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("command", ["info", "verify", "upgrade", "inspect"])
def test_a_buffer_folder_it_may_not_read_is_named_as_such(tmp_path, command):
    """A folder without read permission: one line naming the folder and that it must be
    readable (it named replaybuf.json, the memmap backend's marker, for any buffer)."""
    path = tmp_path / "buffer"
    shutil.copytree(DATA / "format-v4" / "zarr", path)
    done = cli_without_permission(path, 0, command, str(path))
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"cannot read {str(path)!r}: Permission denied" in said and "must be readable" in said, said


@pytest.mark.parametrize("read_only", ["buffer", "parent", "replaybuf"])
def test_upgrade_where_it_may_not_write_says_where_and_why_and_changes_nothing(tmp_path, read_only):
    """An upgrade writes beside the buffer and deletes the original's files: a read-only folder
    holding it, or of it, is refused before anything is written, naming that folder. A read-only
    buffer folder was upgraded, then reported as a failure (deleting the original's files was
    refused) with the whole original left as a hidden ``.buffer.upgrading-<pid>``; a read-only
    parent named that hidden copy."""
    parent = tmp_path / "runs"
    path = parent / "buffer"
    shutil.copytree(DATA / "format-v2" / "memmap", path)
    before = contents(path)
    locked = {"buffer": path, "parent": parent, "replaybuf": path / "replaybuf"}[read_only]
    done = cli_without_permission(locked, 0o555, "upgrade", str(path))
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"upgrade: cannot write in {str(locked)!r}" in said and "Nothing was changed" in said, said
    assert contents(path) == before and sorted(os.listdir(parent)) == ["buffer"]


@pytest.mark.parametrize("command", ["info", "verify", "upgrade", "convert", "unlock"])
def test_every_command_on_a_folder_of_the_seeds_hdf5_buffer_names_copy_seed_h5(tmp_path, command, capsys):
    """A memmap-replay-buffer ReplayBufferH5PY folder: ``view`` and ``from_folder`` said what it
    is and how to copy it, these said only "no replaybuf or memmap-replay-buffer buffer"."""
    import memmap_replay_buffer as seed

    from replaybuf.cli import main

    from ._backends import require

    require("h5py")
    folder = tmp_path / "seed-h5"
    written = seed.ReplayBufferH5PY(folder, max_episodes=2, max_timesteps=3, fields={"x": "float"})
    written.store_episode(x=np.ones(3, np.float32))
    written._close_storage()  # the seed's file, closed as its process would at exit
    before = contents(folder)
    argv = [command, str(folder)] + ([str(tmp_path / "copy")] if command == "convert" else [])
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert "ReplayBufferH5PY folder" in said and "replaybuf.copy_seed_h5(src, dst)" in said, said
    assert contents(folder) == before and sorted(os.listdir(tmp_path)) == ["seed-h5"]


def set_format_version(path: Path, backend: str, version: int) -> None:
    """Make the buffer at ``path`` claim format ``version``, as a newer release would write."""
    if backend == "hdf5":
        from ._backends import require

        with require("h5py").File(path / "data.h5", "r+") as f:
            f.attrs["replaybuf"] = json.dumps({**json.loads(f.attrs["replaybuf"]), "version": version})
        return
    document = path / ("zarr.json" if backend == "zarr" else "replaybuf.json")
    stored = json.loads(document.read_text())
    (stored["attributes"] if backend == "zarr" else stored)["version"] = version
    document.write_text(json.dumps(stored))


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_overwrite_refuses_to_erase_a_buffer_of_a_newer_format(tmp_path, backend):
    """``ReplayBuffer(path, ...)`` (overwrite=True, the default) on a buffer a newer replaybuf
    wrote: it cannot open it, and erased it. Now refused, naming both versions, nothing written."""
    from replaybuf import ReplayBuffer

    path = tmp_path / "newer"
    shutil.copytree(DATA / "format-v4" / backend, path)
    set_format_version(path, backend, 99)
    before = contents(path)
    with pytest.raises(
        ValueError, match=f"has format version 99; this replaybuf reads formats up to {NEWEST[backend]} and does not"
    ):
        ReplayBuffer(path, max_episodes=2, max_timesteps=3, fields={"x": "float"}, backend=backend)
    assert contents(path) == before


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
@pytest.mark.parametrize("argv", [["info"], ["inspect"], ["verify"], ["verify", "--repair"]])
def test_every_command_on_a_buffer_of_a_newer_format_exits_2_with_the_same_message(tmp_path, backend, argv, capsys):
    """``replaybuf verify`` on a buffer a newer replaybuf wrote exited 1 ("cannot open the
    buffer", as for damage) where the other commands exit 2 (a refusal): it exits 2 with the
    message they give, and ``verify()`` raises NewerFormatError; nothing is written."""
    from replaybuf import NewerFormatError, verify
    from replaybuf.cli import main

    if backend == "hdf5":
        from ._backends import require

        require("h5py")
    path = tmp_path / "newer"
    shutil.copytree(DATA / "format-v4" / backend, path)
    set_format_version(path, backend, 99)
    before = contents(path)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, str(path)])
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert said == (
        f"replaybuf {argv[0]}: error: buffer at {str(path)!r} has format version 99; this replaybuf reads formats "
        f"up to {NEWEST[backend]}: install a newer replaybuf (`pip install --upgrade replaybuf`) to open it; `replaybuf upgrade` "
        "only rewrites earlier formats"
    ), said
    with pytest.raises(NewerFormatError, match="has format version 99"):
        verify(path)
    assert contents(path) == before


def test_a_misspelt_path_says_there_is_no_such_folder_and_names_the_close_ones(tmp_path, monkeypatch, capsys):
    """``from_folder('./replay_dat')`` and ``replaybuf info replay_dat`` said only "no replaybuf
    buffer found at './replay_dat'": not that the folder is missing, where a relative path was
    looked for, nor the ``./replay_data`` beside it."""
    from replaybuf import BufferNotFoundError, ReplayBuffer
    from replaybuf.cli import main

    monkeypatch.chdir(tmp_path)
    ReplayBuffer("replay_data", max_episodes=2, max_timesteps=2, fields={"x": "float"}).close()
    missing = f": there is no such folder (looked for in the current folder {str(tmp_path)!r})"
    with pytest.raises(BufferNotFoundError, match="at './replay_dat'") as error:
        ReplayBuffer.from_folder("./replay_dat", read_only=True)
    assert str(error.value).endswith(missing + "; did you mean './replay_data'?")
    with pytest.raises(SystemExit):
        main(["info", "replay_dta"])
    assert capsys.readouterr().err.rstrip().endswith(missing + "; did you mean 'replay_data'?")
    with pytest.raises(BufferNotFoundError, match=r"there is no such folder \('~' is not expanded here"):
        ReplayBuffer.from_folder("~/replay_data")  # a folder named "~" would be created here
    with pytest.raises(BufferNotFoundError, match=r"at 'replay_data/sub'$"):  # it exists: not "no such folder"
        (tmp_path / "replay_data" / "sub").mkdir() or ReplayBuffer.from_folder("replay_data/sub")
    assert not (tmp_path / "~").exists() and sorted(os.listdir(tmp_path)) == ["replay_data"]


def test_from_folder_with_part_of_a_config_checks_it_and_says_how_to_open_or_recreate(tmp_path):
    """``from_folder(path, fields=...)`` said "max_episodes must be a positive int, got None",
    ``from_folder(path, overwrite=True)`` "ReplayBuffer() got multiple values for keyword argument
    'overwrite'", and a config that differs "Open it with ReplayBuffer.from_folder(...)" to a
    caller of from_folder. Nothing is written by any of them."""
    from replaybuf import ReplayBuffer

    folder = tmp_path / "buf"
    with ReplayBuffer(folder, max_episodes=2, max_timesteps=3, fields={"x": "float"}) as buffer:
        buffer.store_episode(x=np.ones(3))
    before = contents(folder)
    how = f"Open it with ReplayBuffer.from_folder({str(folder)!r}) and no settings to use the stored config"
    for read_only in (False, True):
        with pytest.raises(ValueError, match=r"fields.x: stored .*float32.* vs passed .*int32") as error:
            ReplayBuffer.from_folder(folder, read_only=read_only, fields={"x": "int"})
        assert how in str(error.value) and "ReplayBuffer(folder, ..., overwrite=True)" in str(error.value)
        with pytest.raises(TypeError, match=r"from_folder\(\) opens the buffer .* takes no overwrite"):
            ReplayBuffer.from_folder(folder, read_only=read_only, overwrite=True)
    assert contents(folder) == before
    with ReplayBuffer.from_folder(folder, fields={"x": "float"}) as same:  # the stored fields: opened
        assert same.num_episodes == 1


def test_an_image_shape_given_without_its_parentheses_is_named_with_the_spec_meant(tmp_path):
    """``fields={'frame': ('uint8', 64, 64, 3)}``, the shape's parentheses forgotten, said only
    "spec must be 'dtype', (dtype, shape) or (dtype, shape, default)"; nothing is created."""
    from replaybuf import ReplayBuffer

    with pytest.raises(TypeError, match=r"; the shape is one tuple: \('uint8', \(64, 64, 3\)\)$"):
        ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=3, fields={"frame": ("uint8", 64, 64, 3)})
    with pytest.raises(TypeError, match=r"got \('float', \(3,\), 0.0, 'x'\)$"):  # no shape to name there
        ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=3, fields={"x": ("float", (3,), 0.0, "x")})
    assert not (tmp_path / "b").exists()


def test_a_dict_passed_to_store_episode_names_the_keywords_it_needs(tmp_path):
    """``store_episode(episode)`` with the episode's dict: Python said "takes 1 positional argument
    but 2 were given"; each store method now names ``**``. Nothing is stored."""
    from replaybuf import ReplayBuffer

    buffer = ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=3, fields={"x": "float"})
    episode = {"x": np.ones(3, np.float32)}
    for method in ("store_episode", "store", "store_batch", "store_meta_batch"):
        with pytest.raises(
            TypeError, match=rf"^{method}\(\) takes the fields as keywords .* got a dict: .*\(\*\*values\)"
        ):
            getattr(buffer, method)(episode)
    assert buffer.num_episodes == 0 and buffer.timestep_index == 0
    buffer.store_episode(**episode)
    assert buffer.num_episodes == 1 and buffer.data["x"][0, :3].tolist() == [1.0, 1.0, 1.0]
