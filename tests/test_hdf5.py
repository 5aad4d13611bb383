"""The hdf5 backend and ReplayBufferH5PY: one data.h5, optional compression, h5py optional."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from replaybuf import BufferDamagedError, ReplayBuffer
from replaybuf.h5py_buffer import ReplayBufferH5PY
from replaybuf.storage import detect_backend

from ._backends import SKIP_MISSING, require
from ._data import FIELDS, META_FIELDS, episode
from ._h5outside import KINDS as OUTSIDE_KINDS
from ._h5outside import replace_with_outside

h5py = require("h5py")
REPO = Path(__file__).resolve().parents[1]


def test_one_file_with_gzip(tmp_path):
    buffer = ReplayBufferH5PY(
        tmp_path / "b", 4, 10, fields=FIELDS, meta_fields=META_FIELDS, h5py_compression="gzip", h5py_compression_opts=4
    )
    data = episode(6, 0)
    buffer.store_episode(**data, task_id=2)
    buffer.close()
    assert sorted(os.listdir(tmp_path / "b")) == ["data.h5", "replaybuf"]
    with h5py.File(tmp_path / "b" / "data.h5", "r") as f:
        assert f["data/state"].compression == "gzip" and f["data/state"].compression_opts == 4
        np.testing.assert_array_equal(f["data/state"][0, :6], data["state"])
        assert json.loads(f.attrs["replaybuf"])["backend"] == "hdf5"
    reopened = ReplayBufferH5PY.from_folder(tmp_path / "b", read_only=True)
    assert type(reopened) is ReplayBufferH5PY
    assert reopened.storage.describe()["arrays"]["data/state"]["compressor"] == "gzip:4"
    np.testing.assert_array_equal(reopened.data["reward"][0, :6], data["reward"])
    assert detect_backend(str(tmp_path / "b")) == "hdf5"
    assert type(ReplayBuffer.from_folder(tmp_path / "b")).__name__ == "ReplayBuffer"


def test_a_reopen_with_another_compression_keeps_the_stored_one_and_says_so(tmp_path):
    """The compression given in ``storage_options`` to a reopen was ignored without a word (the
    stored one wins): it is warned of, naming both; the same or none is not."""
    ReplayBufferH5PY(tmp_path / "b", 4, 10, fields=FIELDS, h5py_compression="gzip").close()
    for reopen in (
        lambda: ReplayBuffer(
            tmp_path / "b",
            4,
            10,
            fields=FIELDS,
            backend="hdf5",
            overwrite=False,
            storage_options={"compression": "lzf"},
        ),
        lambda: ReplayBuffer.from_folder(
            tmp_path / "b", read_only=True, storage_options={"compression": "gzip", "compression_opts": 9}
        ),
        # the seed's spelling: its from_folder refused it; taken, then ignored without a word
        lambda: ReplayBufferH5PY.from_folder(tmp_path / "b", h5py_compression="lzf"),
        lambda: ReplayBufferH5PY.from_folder(
            tmp_path / "b", read_only=True, h5py_compression="gzip", h5py_compression_opts=9
        ),
    ):
        with pytest.warns(UserWarning, match=r"created with compression='gzip', compression_opts=4; the .* ignored"):
            buffer = reopen()
        assert buffer.storage.compression() == ("gzip", 4)
        buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReplayBuffer.from_folder(tmp_path / "b", storage_options={"compression": "gzip"}).close()
        ReplayBufferH5PY.from_folder(tmp_path / "b", read_only=True).close()
        ReplayBufferH5PY.from_folder(tmp_path / "b", h5py_compression="gzip", h5py_compression_opts=4).close()
    with pytest.raises(ValueError, match="h5py_compression='lzf' and storage_options"):
        ReplayBufferH5PY.from_folder(tmp_path / "b", storage_options={"compression": "gzip"}, h5py_compression="lzf")


def test_other_buffers_open_without_loading_h5py(tmp_path):
    """Detecting the backend of a zarr or memmap buffer (or of a new location) never imports
    h5py; an hdf5 buffer is still found by its data.h5, also through a file:// URL."""
    ReplayBufferH5PY(tmp_path / "h", 4, 10, fields=FIELDS).close()
    script = textwrap.dedent(
        """
        import sys
        from replaybuf import ReplayBuffer
        from replaybuf.storage import detect_backend
        root = sys.argv[1]
        for backend in ("zarr", "memmap"):
            ReplayBuffer(f"{root}/{backend}", 2, 3, fields={"x": "float"}, backend=backend).close()
            assert detect_backend(f"{root}/{backend}") == backend
            ReplayBuffer.from_folder(f"{root}/{backend}", read_only=True)
        assert detect_backend(f"{root}/nothing") is None and detect_backend("memory://nothing") is None
        assert "h5py" not in sys.modules
        assert detect_backend(f"file://{root}/h") == detect_backend(f"{root}/h") == "hdf5"
        assert "h5py" in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_uncompressed_is_contiguous(tmp_path):
    ReplayBufferH5PY(tmp_path / "b", 4, 10, fields=FIELDS).close()
    with h5py.File(tmp_path / "b" / "data.h5", "r") as f:
        assert f["data/state"].chunks is None and f["data/state"].compression is None


@pytest.mark.parametrize(
    "options, complaint",
    [
        ({"compression": "zstd"}, "compression must be one of"),
        ({"compression": "gzip", "compression_opts": 12}, "gzip level"),
        ({"compression_opts": 3}, "gzip level"),
        ({"chunk_cache": 1}, "unknown keys"),
    ],
)
def test_bad_storage_options_are_refused_before_writing(tmp_path, options, complaint):
    with pytest.raises(ValueError, match=complaint):
        ReplayBuffer(tmp_path / "b", 4, 10, fields=FIELDS, backend="hdf5", storage_options=options)
    assert not (tmp_path / "b").exists()


def test_data_arrays_index_like_numpy(tmp_path):
    buffer = ReplayBuffer(tmp_path / "b", 6, 5, fields={"x": ("float", 2)}, backend="hdf5")
    for i in range(6):
        buffer.store_episode(x=np.arange(10, dtype=np.float32).reshape(5, 2) + 100 * i)
    array, reference = buffer.data["x"], np.asarray(buffer.data["x"][:])
    keys = [
        (slice(None, None, -1),),
        ([3, 1, 1],),
        (-1,),
        ([2, 0], [1, 3]),
        (Ellipsis, 1),
        (slice(0, 5, 2), 2, 0),
        (np.array([True, False] * 3),),
        (slice(4, 1, -1), [0, 4]),
    ]
    for key in keys:
        np.testing.assert_array_equal(array[key], reference[key], err_msg=str(key))
    array[[4, 1], 1:3] = -1.0
    reference[[4, 1], 1:3] = -1.0
    array[::-2, 0, 1] = 7.0
    reference[::-2, 0, 1] = 7.0
    np.testing.assert_array_equal(array[:], reference)
    with pytest.raises(IndexError):
        array[6]


def test_a_writer_opens_past_readers_in_the_same_process(tmp_path):
    with ReplayBuffer(tmp_path / "b", 4, 5, fields={"x": "float"}, backend="hdf5") as first:
        first.store_episode(x=np.ones(3))
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    writer = ReplayBuffer.from_folder(tmp_path / "b")
    writer.store_episode(x=np.full(2, 5.0))
    assert len(reader.refresh()) == 2
    np.testing.assert_array_equal(reader.data["x"][1, :2], [5.0, 5.0])


def test_importing_replaybuf_without_h5py_works_and_the_class_says_what_to_install(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["h5py"] = None
        import numpy as np
        import replaybuf
        from replaybuf.h5py_buffer import ReplayBufferH5PY
        b = replaybuf.ReplayBuffer({str(tmp_path / "z")!r}, 2, 3, fields={{"x": "float"}})
        b.store_episode(x=np.ones(2))
        for make in (lambda: ReplayBufferH5PY({str(tmp_path / "h")!r}, 2, 3, fields={{"x": "float"}}),
                     lambda: replaybuf.ReplayBuffer({str(tmp_path / "h")!r}, 2, 3, fields={{"x": "float"}},
                                                    backend="hdf5")):
            try:
                make()
            except ImportError as e:
                print("ImportError:", e)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("pip install 'replaybuf[h5py]'" in line for line in lines)
    assert not (tmp_path / "h").exists()


def test_an_hdf5_buffer_without_h5py_names_the_install_not_a_missing_buffer(tmp_path):
    ReplayBuffer(tmp_path / "h", 2, 3, fields={"x": "float"}, backend="hdf5").close()
    script = textwrap.dedent(f"""
        import sys
        sys.modules["h5py"] = None
        import replaybuf
        for open_ in (lambda: replaybuf.ReplayBuffer.from_folder({str(tmp_path / "h")!r}, read_only=True),
                      lambda: replaybuf.ReplayBuffer.from_folder({str(tmp_path / "empty")!r})):
            try:
                open_()
            except Exception as e:
                print(type(e).__name__, e)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    hdf5, empty = result.stdout.splitlines()
    assert hdf5.startswith("ImportError") and "pip install 'replaybuf[h5py]'" in hdf5, hdf5
    assert not empty.startswith("ImportError"), empty  # no marker file: still "no buffer here"


def pytest_without_h5py(*args: str, skip_missing: bool) -> subprocess.CompletedProcess:
    """Run pytest on ``args`` in a child where h5py does not import, SKIP_MISSING set or not."""
    # as a fresh run from a shell: a child started with this run's PYTEST_* variables took ~2x longer
    env = {k: v for k, v in os.environ.items() if k != SKIP_MISSING and not k.startswith("PYTEST_")}
    if skip_missing:
        env[SKIP_MISSING] = "1"
    script = "import sys; sys.modules['h5py'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"
    # -n 0: in this child, not in xdist workers (which would import h5py), h5py does not import;
    # --assert=plain: only outcomes are read, and rewriting every plugin's modules costs seconds
    command = [sys.executable, "-c", script, "-q", "-rs", "-p", "no:cacheprovider", "-n", "0", "--assert=plain", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_h5py_fails_the_run_and_says_how_to_install_it():
    result = pytest_without_h5py("tests/test_backends_parity.py", "-k", "test_detects_its_backend", skip_missing=False)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "the hdf5 backend's tests cannot run: h5py is not installed (pip install -e '.[test]'" in result.stderr
    assert "passed" not in result.stdout


def test_skip_missing_runs_the_rest_and_skips_what_needs_h5py():
    result = pytest_without_h5py(
        "tests/test_checksums.py",
        "tests/test_backends_parity.py",
        "tests/test_validation.py",
        "-k",
        "test_detects_its_backend or test_garbage_hdf5_config_attribute_names_the_attribute",
        skip_missing=True,
    )
    assert result.returncode == pytest.ExitCode.OK, result.stdout + result.stderr
    # zarr, memory and memmap pass; skipped: test_checksums (it imports h5py), the hdf5 case and
    # the validation test that opens an hdf5 buffer (its ImportError)
    assert "3 passed, 3 skipped" in result.stdout
    assert result.stdout.count("h5py is not installed") == 3


@pytest.mark.parametrize("compression", [None, "gzip"])
@pytest.mark.parametrize("in_ram", [True, False])
def test_gather_matches_numpy_on_every_read_path(tmp_path, monkeypatch, compression, in_ram):
    from replaybuf.storage import _hdf5

    if not in_ram:
        monkeypatch.setattr(_hdf5, "SMALL_FIELD_BYTES", 0)
    options = {"compression": compression} if compression else None
    buffer = ReplayBuffer(
        tmp_path / "b", 5, 8, fields={"x": ("float", (2, 3))}, backend="hdf5", storage_options=options
    )
    for i in range(5):
        buffer.store_episode(x=np.arange(48, dtype=np.float32).reshape(8, 2, 3) + 100 * i)
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    episodes, timesteps = np.array([4, 0, 4, 2, 0, 4]), np.array([7, 0, 7, 3, 5, 1])
    expected = np.asarray(buffer.data["x"][:])[episodes, timesteps]
    for storage in (buffer.storage, reader.storage):
        np.testing.assert_array_equal(storage.gather("x", episodes, timesteps), expected)
    assert reader.storage.gather("x", np.array([], int), np.array([], int)).shape == (0, 2, 3)


def _index(draw, st, n):
    kind = draw(st.sampled_from(["int", "slice", "list", "mask"]))
    if kind == "int":
        return draw(st.integers(-n, n - 1))
    if kind == "slice":
        return slice(
            draw(st.none() | st.integers(-n, n)),
            draw(st.none() | st.integers(-n, n)),
            draw(st.none() | st.sampled_from([1, 2, -1, -3])),
        )
    if kind == "list":
        return draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=4))
    return np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))


def test_indexing_matches_numpy_for_generated_keys(tmp_path):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    buffer = ReplayBuffer(tmp_path / "b", 4, 5, fields={"x": ("int", 3)}, backend="hdf5")
    for i in range(4):
        buffer.store_episode(x=np.arange(15).reshape(5, 3) + 100 * i)
    array, reference = buffer.data["x"], np.asarray(buffer.data["x"][:])

    @st.composite
    def keys(draw):
        depth = draw(st.integers(1, 3))
        return tuple(_index(draw, st, n) for n in reference.shape[:depth])

    @hypothesis.settings(max_examples=150, deadline=None, database=None)
    @hypothesis.given(keys())
    def check(key):
        try:
            expected = reference[key]
        except IndexError:
            with pytest.raises(IndexError):
                array[key]
            return
        np.testing.assert_array_equal(array[key], expected)

    check()


def test_a_writer_dropped_without_close_leaves_no_file_open(tmp_path, no_gc):
    """The writer mark's descriptor goes with the storage when a writer is dropped unclosed:
    no unclosed file is left for the collector to warn about (an open file object was)."""
    import warnings

    buffer = ReplayBuffer(tmp_path / "buffer", 4, 10, fields=FIELDS, meta_fields=META_FIELDS, backend="hdf5")
    buffer.store_episode(**episode(6, 0))
    mark = os.path.realpath(tmp_path / "buffer" / "replaybuf" / "hdf5-writer.lock")
    open_files = [os.path.realpath(os.path.join("/proc/self/fd", fd)) for fd in os.listdir("/proc/self/fd")]
    assert mark in open_files
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del buffer  # no collection: the buffer is freed as the reference goes
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert mark not in [os.path.realpath(os.path.join("/proc/self/fd", fd)) for fd in os.listdir("/proc/self/fd")]


@pytest.mark.parametrize("small", [True, False])
def test_sampled_steps_of_compressed_fields_are_checked(tmp_path, monkeypatch, small):
    """lzf keeps no checksum: a step rewritten behind replaybuf's back (its checksum not resealed)
    was returned to timestep batches. Each sampled episode of a chunked field is now checked
    whole once, from the reader's copy in RAM (small fields) or from the file; an in-place
    rewrite by replaybuf after the reader loaded its copy is read again, not refused."""
    from replaybuf import CorruptChunkError
    from replaybuf.storage import _hdf5

    if not small:
        monkeypatch.setattr(_hdf5, "SMALL_FIELD_BYTES", 0)
    path = tmp_path / "b"
    with ReplayBufferH5PY(path, 3, 8, fields={"x": ("float32", (4,))}, h5py_compression="lzf") as writer:
        for i in range(3):
            writer.store_episode(x=np.full((8, 4), i, np.float32))
    reader = ReplayBufferH5PY.from_folder(path, read_only=True)
    np.testing.assert_array_equal(reader.storage.gather("x", np.array([0, 1]), np.array([2, 5]))[:, 0], [0, 1])
    writer = ReplayBufferH5PY.from_folder(path)
    writer.store_datapoint(1, 5, "x", np.full(4, 9, np.float32))  # resealed: a new entry
    writer.close()
    np.testing.assert_array_equal(reader.storage.gather("x", np.array([1]), np.array([5]))[:, 0], [9])
    reader.close()
    with h5py.File(path / "data.h5", "r+") as f:  # behind replaybuf's back: the checksum is stale
        f["data/x"][2, 6] = 7
    damaged = ReplayBufferH5PY.from_folder(path, read_only=True)
    np.testing.assert_array_equal(damaged.storage.gather("x", np.array([0]), np.array([6]))[:, 0], [0])
    with pytest.raises(CorruptChunkError, match="data/x: slot 2, timesteps 0..7"):
        damaged.storage.gather("x", np.array([0, 2]), np.array([1, 1]))
    with pytest.raises(CorruptChunkError, match="data/x: slot 2"):
        list(damaged.dataloader(batch_size=4, timestep_level=True))
    with pytest.raises(CorruptChunkError, match="data/x: slot 2"):
        damaged.storage.read_rows("x", np.array([2]), 3, 5)
    damaged.close()


def test_a_close_whose_flush_fails_still_lets_the_file_and_lease_go(tmp_path, monkeypatch):
    """A close whose final flush fails (a full disk) raises StorageError naming data.h5, and
    still closes the file and releases the writer lease: the buffer opens for writing again
    with every committed episode."""
    require("h5py")
    from replaybuf.storage import StorageError

    path = str(tmp_path / "b")
    buffer = ReplayBuffer(path, max_episodes=4, max_timesteps=10, fields=FIELDS, backend="hdf5")
    buffer.store_episode(**episode(10, seed=1))
    h5file = buffer.storage._file
    monkeypatch.setattr(buffer.storage, "_dirty", True)

    def fail() -> None:
        raise OSError(27, "File too large")

    monkeypatch.setattr(h5file, "flush", fail)
    with pytest.raises(StorageError, match="data.h5"):
        buffer.close()
    assert not h5file.id.valid
    monkeypatch.undo()
    again = ReplayBuffer.from_folder(path)
    assert len(again) == 1
    again.close()


@pytest.mark.parametrize("how", OUTSIDE_KINDS)
def test_a_dataset_stored_outside_data_h5_is_refused_naming_it_and_that_file_never_written(tmp_path, how):
    """Before: a dataset of data.h5 kept in another file (HDF5 external storage, a virtual
    dataset, an external link) was opened as the field's: a writer's store_episode wrote into
    that file, outside the buffer folder (a user's file), a reader read it; a soft link made two
    fields one dataset."""
    location = str(tmp_path / "b")
    with ReplayBuffer(location, 2, 4, fields={"x": ("float", 3), "y": ("float", 3)}, backend="hdf5") as buffer:
        buffer.store_episode(x=np.ones((3, 3), np.float32), y=np.ones((3, 3), np.float32))
    outside = tmp_path / "users"
    before = replace_with_outside(Path(location) / "data.h5", "data/y", how, outside, (2, 4, 3), 0, "/data/x")
    refusal = (
        r"data\.h5: dataset 'data/y' keeps its data in other files"
        if how in ("external storage", "virtual")
        else r"data\.h5: 'data/y' is reached through (External|Soft)Link"
    )
    with pytest.raises(BufferDamagedError, match=refusal):
        ReplayBuffer.from_folder(location, read_only=True)

    def write() -> None:
        with ReplayBuffer.from_folder(location) as buffer:
            buffer.store_episode(x=np.full((3, 3), 5, np.float32), y=np.full((3, 3), 5, np.float32))

    with pytest.raises(BufferDamagedError, match=refusal):
        write()
    assert outside.read_bytes() == before
    with h5py.File(os.path.join(location, "data.h5"), "r") as f:
        assert f["meta/episode_lens"][:].tolist() == [3, 0]  # the refused writer left it as it was
