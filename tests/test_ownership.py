"""A buffer writes and erases only what it owns (issue 12): overwrite scope, links out of the
root, convert onto its own source, bounded object-store writes, a full disk under memmap, and
the viewer's temp folder on SIGTERM."""

from __future__ import annotations

import gc
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from replaybuf import ForeignEntriesError, ReplayBuffer, StorageError, convert, verify
from replaybuf.cli import main as cli_main
from replaybuf.storage import detect_backend
from replaybuf.storage._kv import MAX_IN_FLIGHT, StoreKV
from replaybuf.storage._zarr import ZarrStorage

from ._backends import LOCAL_BACKENDS as LOCAL
from ._backends import snapshot, tmpfs
from ._viewer_data import make_plot_only_buffer

pytest_plugins = ["tests._servers"]  # fixtures: s3_server

FIELDS = {"state": ("float", 3), "reward": "float"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new(location, backend=None, storage_options=None, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(
        location, max_episodes=3, max_timesteps=4, fields=FIELDS, backend=backend, storage_options=storage_options
    )


def store(buffer: ReplayBuffer, length: int = 3, value: float = 1.0) -> None:
    buffer.store_episode(state=np.full((length, 3), value, np.float32), reward=np.full(length, value, np.float32))


def project_folder(path) -> None:
    """A folder of someone's code: no buffer in it."""
    (path / "src").mkdir(parents=True)
    (path / "train.py").write_text("print('train')")
    (path / "src" / "model.py").write_text("MODEL = 1")


# ---- 1. overwrite erases only what a buffer owns ------------------------------------------------


@pytest.mark.parametrize("backend", LOCAL)
def test_a_folder_of_foreign_files_is_refused_and_kept(tmp_path, backend):
    project_folder(tmp_path / "project")
    before = snapshot(str(tmp_path / "project"))
    with pytest.raises(ForeignEntriesError, match=r"'src/', 'train.py'.*nothing was deleted.*empty or new folder"):
        new(tmp_path / "project", backend)
    assert snapshot(str(tmp_path / "project")) == before


@pytest.mark.parametrize("backend", LOCAL)
def test_a_buffer_with_a_foreign_file_beside_it_is_kept_whole(tmp_path, backend):
    buffer = new(tmp_path / "buf", backend)
    store(buffer)
    buffer.close()
    (tmp_path / "buf" / "notes.txt").write_text("keep")
    before = snapshot(str(tmp_path / "buf"))
    with pytest.raises(ForeignEntriesError, match="'notes.txt'"):
        new(tmp_path / "buf", backend)
    assert snapshot(str(tmp_path / "buf")) == before
    assert len(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)) == 1


@pytest.mark.parametrize("inner", ["data/inner", "replaybuf/snapshots/inner", "inner"])
@pytest.mark.parametrize("backend", LOCAL)
def test_a_buffer_inside_another_buffers_folder_is_refused_before_writing(tmp_path, backend, inner):
    # a buffer created at buf/data/inner (zarr) or buf/replaybuf/snapshots/inner (every backend)
    # was accepted, and the next overwrite of buf erased it with its episodes
    buffer = new(tmp_path / "buf", backend)
    store(buffer)
    buffer.close()
    os.symlink(tmp_path / "buf", tmp_path / "link")
    before, enclosing = snapshot(str(tmp_path / "buf")), re.escape(repr(os.path.realpath(tmp_path / "buf")))
    for location in (tmp_path / "buf" / inner, tmp_path / "link" / inner):
        for other in LOCAL:
            with pytest.raises(ValueError, match=f"inside the '{backend}' buffer at {enclosing}.*outside"):
                new(location, other)
    assert snapshot(str(tmp_path / "buf")) == before
    assert len(new(tmp_path / "buf", backend)) == 0  # its own overwrite still works


@pytest.mark.parametrize("backend", LOCAL)
def test_overwrite_replaces_a_buffer_and_an_empty_or_new_folder_is_fine(tmp_path, backend):
    (tmp_path / "empty").mkdir()
    store(new(tmp_path / "empty", backend))
    store(new(tmp_path / "new" / "nested", backend))
    buffer = new(tmp_path / "empty", backend)
    assert len(buffer) == 0
    store(buffer)
    assert len(ReplayBuffer.from_folder(tmp_path / "empty", read_only=True)) == 1


def test_the_error_names_five_entries_and_counts_the_rest(tmp_path):
    (tmp_path / "many").mkdir()
    for i in range(8):
        (tmp_path / "many" / f"f{i}.txt").write_text("x")
    with pytest.raises(ForeignEntriesError, match=r"'f0.txt', 'f1.txt', 'f2.txt', 'f3.txt', 'f4.txt' and 3 more"):
        new(tmp_path / "many")


def test_a_users_data_folder_is_not_a_buffers(tmp_path):
    (tmp_path / "p" / "data").mkdir(parents=True)
    (tmp_path / "p" / "data" / "train.csv").write_text("1,2")
    with pytest.raises(ForeignEntriesError, match="'data/'"):
        new(tmp_path / "p")
    assert (tmp_path / "p" / "data" / "train.csv").read_text() == "1,2"


def test_other_objects_under_replaybuf_survive_an_overwrite(tmp_path):
    """``replaybuf/`` belongs to the buffer, but erasing takes only the counters and the step log
    there: a writer's lease (another object there) is not the erase's to delete."""
    buffer = new(tmp_path / "buf")
    store(buffer)
    buffer.close()
    (tmp_path / "buf" / "replaybuf" / "lease").write_text("held")
    buffer = new(tmp_path / "buf")
    assert len(buffer) == 0 and (tmp_path / "buf" / "replaybuf" / "lease").read_text() == "held"


def seed_folder(folder) -> None:
    """The files of a memmap-replay-buffer 0.2.x folder (its layout, written here without
    importing the seed library, which loads torch: see tests/test_memmap.py for the real one)."""
    folder.mkdir()
    config = {"max_episodes": 2, "max_timesteps": 4, "fields": {"state": ("float", (3,))}, "meta_fields": {}}
    (folder / "metadata.pkl").write_bytes(pickle.dumps(config))
    for name in ("num_episodes", "episode_index", "timestep_index"):
        np.save(folder / f"{name}.state.npy", np.array(0, np.int32))
    np.save(folder / "state.data.npy", np.zeros((2, 4, 3), np.float32))
    np.save(folder / "episode_lens.data.meta.npy", np.zeros(2, np.int32))
    np.save(folder / "_initted.data.meta.npy", np.zeros(2, bool))


def test_a_seed_folder_is_overwritten_but_not_with_a_foreign_file(tmp_path):
    seed_folder(tmp_path / "seed")
    assert detect_backend(str(tmp_path / "seed")) == "memmap"
    (tmp_path / "seed" / "run.log").write_text("keep")
    with pytest.raises(ForeignEntriesError, match="'run.log'"):
        new(tmp_path / "seed", "memmap")
    assert os.path.isfile(tmp_path / "seed" / "metadata.pkl")
    os.unlink(tmp_path / "seed" / "run.log")
    store(new(tmp_path / "seed", "memmap"))
    assert not os.path.exists(tmp_path / "seed" / "metadata.pkl")
    assert not any(name.endswith(".state.npy") for name in os.listdir(tmp_path / "seed"))


def test_memory_prefix_with_a_foreign_object_is_refused(tmp_path):
    import fsspec

    location = f"memory://ownership-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{location}/notes.txt", b"keep")
    with pytest.raises(ForeignEntriesError, match="'notes.txt'"):
        new(location)
    assert fs.cat(f"{location}/notes.txt") == b"keep"
    fs.rm(f"{location}/notes.txt")
    store(new(location))
    assert len(new(location)) == 0


@pytest.mark.parametrize("inner", ["data/inner", "replaybuf/inner", "inner"])
def test_a_buffer_inside_another_buffers_prefix_is_refused_on_object_stores(inner):
    # on an object store (memory://, S3, GCS) a buffer created at buf/data/inner was accepted,
    # and the next overwrite of buf erased it with its episodes (local folders refused it)
    import fsspec

    location = f"memory://nested-{uuid.uuid4().hex[:8]}"
    store(new(location))
    fs = fsspec.filesystem("memory")
    before = {path: fs.cat(path) for path in fs.find(location)}
    with pytest.raises(ValueError, match=f"inside the 'zarr' buffer at '{location}'.*outside"):
        new(f"{location}/{inner}")
    assert {path: fs.cat(path) for path in fs.find(location)} == before
    assert len(new(location)) == 0  # its own overwrite still works


def _bucket(s3_server) -> str:
    """A new, empty bucket on the moto server (the session bucket holds other tests' objects)."""
    import boto3

    name = f"ownership-{uuid.uuid4().hex[:8]}"
    boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return name


def test_s3_prefix_and_bucket_root_with_foreign_objects_are_refused(s3_server):
    options = s3_server.storage_options
    bucket = _bucket(s3_server)
    kv = ZarrStorage(f"s3://{bucket}", options).kv
    kv.set_many({"models/best.pt": b"weights", "runs/a/buf/other.txt": b"keep"})
    for location, named in ((f"s3://{bucket}", "'models/', 'runs/'"), (f"s3://{bucket}/runs/a", "'buf/'")):
        with s3_server.record() as requests:
            with pytest.raises(ForeignEntriesError, match=named):
                new(location, storage_options=options)
        assert requests.writes() == []
    assert kv.get("models/best.pt") == b"weights"
    buffer = new(f"s3://{bucket}/runs/b", storage_options=options)
    store(buffer)
    with pytest.raises(ValueError, match=f"inside the 'zarr' buffer at 's3://{bucket}/runs/b'"):
        new(f"s3://{bucket}/runs/b/data/inner", storage_options=options)
    assert len(new(f"s3://{bucket}/runs/b", storage_options=options)) == 0
    assert kv.get("runs/a/buf/other.txt") == b"keep"
    kv.delete_prefix("")
    store(new(f"s3://{bucket}", storage_options=options))  # an empty bucket takes a buffer at its root
    assert len(new(f"s3://{bucket}", storage_options=options)) == 0


# ---- 2. never a write or an erase through a link out of the root ------------------------------


@pytest.fixture
def outside(tmp_path):
    """A file outside every buffer, which links will point to."""
    path = tmp_path / "outside.bin"
    path.write_bytes(b"precious")
    return path


def test_a_chunk_linked_out_of_the_root_is_refused_at_writable_open(tmp_path, outside):
    buffer = new(tmp_path / "buf")
    store(buffer)
    buffer.close()
    link = tmp_path / "buf" / "data" / "state" / "c.1.0.0"
    os.symlink(outside, link)
    with pytest.raises(StorageError, match="c.1.0.0"):
        ReplayBuffer.from_folder(tmp_path / "buf")
    assert len(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)) == 1
    assert outside.read_bytes() == b"precious"
    assert any("c.1.0.0" in problem and "symbolic link" in problem for problem in verify(tmp_path / "buf"))


@pytest.mark.parametrize(
    ("compressor", "chunk"),
    [(None, "c.0.0.0"), ("zstd", "c.1.0.0")],  # packed: every slot's rows share one chunk, written in place
)
def test_a_link_planted_after_open_is_not_written_through(tmp_path, outside, compressor, chunk):
    fields = {
        **FIELDS,
        "state": {"dtype": "float32", "shape": (3,), **({"compressor": compressor} if compressor else {})},
    }
    buffer = ReplayBuffer(tmp_path / "buf", max_episodes=3, max_timesteps=4, fields=fields)
    store(buffer)
    path = tmp_path / "buf" / "data" / "state" / chunk
    if path.exists():
        path.unlink()
    os.symlink(outside, path)
    with pytest.raises(StorageError, match="symbolic link"):
        store(buffer, value=7.0)
    assert outside.read_bytes() == b"precious"


@pytest.mark.parametrize(("backend", "name"), [("memmap", "state.data.npy"), ("hdf5", "data.h5")])
def test_local_backends_refuse_a_linked_file(tmp_path, outside, backend, name):
    buffer = new(tmp_path / "buf", backend)
    store(buffer)
    buffer.close()
    path = tmp_path / "buf" / name
    os.replace(path, outside)
    os.symlink(outside, path)
    before = outside.read_bytes()
    with pytest.raises(StorageError, match=name):
        ReplayBuffer.from_folder(tmp_path / "buf")
    assert len(ReplayBuffer.from_folder(tmp_path / "buf", read_only=True)) == 1
    assert outside.read_bytes() == before


def test_a_buffer_reached_through_a_linked_root_is_writable(tmp_path):
    store(new(tmp_path / "real"))
    os.symlink(tmp_path / "real", tmp_path / "alias")
    buffer = ReplayBuffer.from_folder(tmp_path / "alias")
    store(buffer)
    assert len(buffer) == 2 and verify(tmp_path / "alias") == []


@pytest.mark.parametrize("backend", LOCAL)
def test_overwrite_refuses_a_linked_blob_folder_and_keeps_its_target(tmp_path, backend):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "state.json").write_text("theirs")
    (target / "writer.lock").write_text("theirs")  # the lease's file name: never written through the link
    store(new(tmp_path / "buf", backend))
    blobs = tmp_path / "buf" / "replaybuf"
    os.rename(blobs, tmp_path / "old-blobs")
    os.symlink(target, blobs)  # replaybuf/ -> a folder outside
    before = snapshot(str(target))
    with pytest.raises(StorageError, match="replaybuf' is a symbolic link"):
        new(tmp_path / "buf", backend)
    assert os.path.islink(blobs) and snapshot(str(target)) == before


def test_zarr_overwrite_unlinks_a_linked_array_folder(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "c.0.0.0").write_bytes(b"theirs")
    store(new(tmp_path / "buf"))
    os.symlink(target, tmp_path / "buf" / "data" / "reward-old")
    os.rename(tmp_path / "buf" / "meta", tmp_path / "meta-old")
    os.symlink(tmp_path / "meta-old", tmp_path / "buf" / "meta")
    store(new(tmp_path / "buf"))
    assert (target / "c.0.0.0").read_bytes() == b"theirs"
    assert os.listdir(tmp_path / "meta-old")  # the old meta folder was not emptied through the link


# ---- 3. convert never onto its own source ----------------------------------------------------


@pytest.fixture
def source(tmp_path):
    buffer = new(tmp_path / "src")
    for value in (1.0, 2.0):
        store(buffer, value=value)
    buffer.close()
    return tmp_path / "src"


def test_convert_refuses_a_link_to_its_source(tmp_path, source):
    os.symlink(source, tmp_path / "link")
    before = snapshot(str(source))
    with pytest.raises(ValueError, match="same location"):
        convert(source, tmp_path / "link", progress=False, overwrite=True)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", str(source), str(tmp_path / "link"), "--overwrite", "--quiet"])
    assert exit_info.value.code == 2
    assert snapshot(str(source)) == before


@pytest.mark.parametrize(
    ("spelling", "message"),
    [
        ("file://{src}", "same location"),
        ("{src}/", "same location"),
        ("{src}/../src", "same location"),
        ("{src}/copy", "inside the source"),
        ("{src}/..", "source .* is inside the destination"),
    ],
)
def test_convert_refuses_other_spellings_of_its_source(source, spelling, message):
    before = snapshot(str(source))
    with pytest.raises(ValueError, match=message):
        convert(source, spelling.format(src=source), progress=False, overwrite=True)
    assert snapshot(str(source)) == before
    assert len(ReplayBuffer.from_folder(source, read_only=True)) == 2


def test_convert_refuses_the_same_s3_prefix_spelled_twice(s3_server, monkeypatch):
    """Whatever the spelling of the prefix or of its endpoint (``client_kwargs['endpoint_url']``,
    a trailing ``/``, the environment's ``AWS_ENDPOINT_URL``): a convert onto itself with
    ``--overwrite`` once erased the source and copied its zeros back."""
    options = s3_server.storage_options
    url = s3_server.url(f"convert-{uuid.uuid4().hex[:8]}")
    store(new(url, storage_options=options))
    endpoint = options["endpoint_url"]
    in_client = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": endpoint}}
    del in_client["endpoint_url"]
    from_environment = {name: value for name, value in options.items() if name != "endpoint_url"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    for dst, dst_options in (
        (url + "/", options),
        (url.replace("s3://", "s3a://") + "//", options),
        (url + "/copy", options),
        (url, in_client),
        (url, {**options, "endpoint_url": endpoint + "/"}),
        (url, from_environment),
    ):
        with s3_server.record() as requests:
            with pytest.raises(ValueError, match="same location|inside the source"):
                convert(
                    url, dst, storage_options=options, dst_storage_options=dst_options, progress=False, overwrite=True
                )
        assert requests.writes() == []
    assert ReplayBuffer.from_folder(url, read_only=True, storage_options=options).data["state"][0, 0, 0] == 1.0


def test_convert_refuses_the_same_gcs_prefix_with_its_emulator_named_by_the_environment(gcs_server, monkeypatch):
    """gcsfs reads ``STORAGE_EMULATOR_HOST`` (host:port) where ``endpoint_url`` is not given: the
    same bucket and prefix, refused before any request (a convert onto itself erased the source)."""
    url = gcs_server.url(f"convert-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url.removeprefix("http://"))
    with gcs_server.record() as requests, pytest.raises(ValueError, match="same location"):
        convert(url, url, storage_options=gcs_server.storage_options, dst_storage_options={"token": "anon"})
    assert requests.requests == []


def test_convert_to_another_endpoint_or_a_sibling_is_allowed(tmp_path, source):
    summary = convert(source, tmp_path / "src-copy", progress=False)
    assert summary["episodes"] == 2


# ---- 4. object-store writes keep a bounded number of requests in flight ----------------------


def _settle_object_leases() -> None:
    """Wait until writers of earlier tests, garbage collected, have deleted their object-store
    leases (a heartbeat thread does it a moment later): their requests are not this test's."""
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("replaybuf-lease-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "an object-store lease of an earlier test was never released"
        time.sleep(0.02)


@pytest.mark.parametrize("limit", [3, MAX_IN_FLIGHT])
def test_object_store_writes_are_bounded(s3_server, monkeypatch, limit):
    monkeypatch.setattr(s3_server, "latency", 0.02)  # requests overlap, as over a real network
    monkeypatch.setattr(StoreKV, "max_in_flight", limit)
    kv = ZarrStorage(s3_server.url(f"bounded-{uuid.uuid4().hex[:8]}"), s3_server.storage_options).kv
    items = {f"k/{i:03d}": bytes([i]) for i in range(2 * limit + 8)}
    _settle_object_leases()
    with s3_server.record() as requests:
        kv.set_many(items)
        kv.delete_many(list(items))
    # obstore deletes one key per POST (S3's DeleteObjects), s3fs per DELETE
    assert requests.count("PUT") == len(items) and requests.count("POST", "DELETE") == len(items)
    assert 1 <= requests.peak_in_flight["PUT"] <= limit
    assert 1 <= max(requests.peak_in_flight["POST"], requests.peak_in_flight["DELETE"]) <= limit
    assert kv.list_prefix("k/") == []


# ---- 5. a full disk under memmap is a StorageError at create time -----------------------------

# a memmap buffer of ~4 MB: state is 4 * 64 * 4096 float32
BIG = {"state": ("float", 4096)}


@pytest.fixture
def small_tmpfs(tmp_path):
    (tmp_path / "tmpfs").mkdir()
    with tmpfs(tmp_path / "tmpfs", "1m") as mount:
        yield mount


def test_memmap_on_a_full_disk_fails_at_create_naming_the_file(small_tmpfs):
    # refused before anything is written (``check_schema``), naming the field
    with pytest.raises(StorageError, match=r"reserves [\d,]+ bytes of disk up front \(the largest, field 'state'"):
        ReplayBuffer(small_tmpfs / "buf", max_episodes=4, max_timesteps=64, fields=BIG, backend="memmap")
    # the refused create left nothing: the folder it made is gone with it
    assert not (small_tmpfs / "buf").exists() or "state.data.npy" not in os.listdir(small_tmpfs / "buf")
    buffer = ReplayBuffer(small_tmpfs / "buf", max_episodes=2, max_timesteps=4, fields=FIELDS, backend="memmap")
    store(buffer)
    assert len(buffer) == 1
    buffer.close()


def test_memmap_over_the_file_size_limit_fails_at_create(tmp_path):
    """The same check where no tmpfs can be mounted: RLIMIT_FSIZE in a child process."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from replaybuf import ReplayBuffer, StorageError
        try:
            ReplayBuffer({str(tmp_path / "buf")!r}, max_episodes=4, max_timesteps=64, fields={BIG!r}, backend="memmap")
        except StorageError as e:
            print("StorageError:", e)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert result.returncode == 0, result.stderr
    assert "StorageError:" in result.stdout and "over this process's file size limit" in result.stdout
    assert "field 'state': float32[4, 64, 4096]" in result.stdout


# ---- 6. the viewer removes its temp folder on SIGTERM ------------------------------------------


def test_viewer_removes_its_temp_folder_on_sigterm(tmp_path):
    make_plot_only_buffer(tmp_path / "buf").close()
    temp = tmp_path / "temp"
    temp.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "replaybuf", "view", str(tmp_path / "buf"), "--port", "0", "--no-browser"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(temp)},
    )
    try:
        assert "serving" in process.stdout.readline()
        assert [p.name.startswith("replaybuf-view-") for p in temp.iterdir()] == [True]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert list(temp.iterdir()) == []


def hard_link_copy(source, target) -> dict[str, bytes]:
    """A copy of the folder ``source`` made of hard links (``cp -al``): each of its files a second
    name of the same file; returns each copy's bytes."""
    held = {}
    for folder, _, names in os.walk(source):
        into = os.path.join(target, os.path.relpath(folder, source))
        os.makedirs(into, exist_ok=True)
        for name in names:
            os.link(os.path.join(folder, name), os.path.join(into, name))
            with open(os.path.join(into, name), "rb") as f:
                held[os.path.join(into, name)] = f.read()
    return held


@pytest.mark.parametrize("backend", LOCAL)
def test_a_hard_linked_backup_is_never_written_through(tmp_path, backend):
    """Files written in place (memmap arrays, data.h5, zarr meta and packed chunks, checksums)
    changed the other names of a hard-linked file: a ``cp -al`` backup of the buffer changed
    with every commit and edit, as would a user's file planted as a hard link in the folder."""
    buffer = new(str(tmp_path / "b"), backend)
    store(buffer, value=1.0)
    buffer.close()
    held = hard_link_copy(tmp_path / "b", tmp_path / "backup")
    again = ReplayBuffer.from_folder(str(tmp_path / "b"))
    store(again, value=2.0)
    again.update(0, reward=np.full(3, 9.0, np.float32))
    again.close()
    changed = []
    for path, content in held.items():
        with open(path, "rb") as f:
            if f.read() != content:
                changed.append(os.path.relpath(path, tmp_path / "backup"))
    assert changed == []
    backup = ReplayBuffer.from_folder(str(tmp_path / "backup"), read_only=True)
    assert backup.get_all_data()["reward"].tolist() == [[1.0, 1.0, 1.0]]
    now = ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True).get_all_data()["reward"]
    assert now[:, :3].tolist() == [[9.0, 9.0, 9.0], [2.0, 2.0, 2.0]]
    assert verify(str(tmp_path / "b")) == [] and verify(str(tmp_path / "backup")) == []
