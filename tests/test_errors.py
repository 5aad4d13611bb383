"""Bad input: a clear error naming the field, what was given and what was expected, raised
before anything is written; the buffer is unchanged afterwards."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from replaybuf import BufferNotFoundError, ReplayBuffer, StorageError

from ._backends import snapshot as snapshot_of_folder
from .test_buffer import FIELDS, META, assert_same_snapshot, fill_episode, make, snapshot


@pytest.mark.parametrize(
    "fields, meta, error, pattern",
    [
        (dict(x="complex"), None, TypeError, "unknown dtype 'complex'"),
        (dict(x="str"), None, TypeError, "'x'"),
        (dict(x=("float", -1)), None, TypeError, "shape must be a positive"),
        (dict(x=("float", (2, 0))), None, TypeError, r"shape must be a positive .*got \(2, 0\)"),
        (dict(x=("float", (2,), "zero")), None, TypeError, "default must be a number"),
        (dict(x="float"), dict(x="int"), ValueError, r"must not share names; both define \['x'\]"),
        (dict(x="float"), dict(episode_lens="int"), ValueError, "reserved"),
        ({}, None, ValueError, "fields must be a non-empty dict"),
        (dict(x={"dtype": "float", "chunk": 3}), None, ValueError, "unknown spec keys"),
        (dict(x={"dtype": "float", "compressor": "lz5"}), None, ValueError, "unknown compressor 'lz5'"),
        (dict(x=["float", 2, 0, 1]), None, TypeError, "spec must be"),
    ],
)
def test_bad_schema(tmp_path, fields, meta, error, pattern):
    location = tmp_path / "b"
    with pytest.raises(error, match=pattern):
        ReplayBuffer(str(location), 2, 3, fields=fields, meta_fields=meta)
    assert not location.exists()


@pytest.mark.parametrize("arg, value", [("max_episodes", 0), ("max_timesteps", -1), ("max_episodes", 2.5)])
def test_bad_sizes(tmp_path, arg, value):
    kwargs = dict(max_episodes=2, max_timesteps=3, fields=dict(x="float"))
    kwargs[arg] = value
    with pytest.raises(ValueError, match=arg):
        ReplayBuffer(str(tmp_path / "b"), **kwargs)


def test_bad_flush_setting(tmp_path):
    with pytest.raises(ValueError, match="flush_every_store_step"):
        ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), flush_every_store_step=-1)


@pytest.mark.parametrize("flag", ["overwrite", "read_only", "circular", "fsync", "break_lock"])
def test_a_flag_given_as_a_string_is_refused_before_anything_is_erased(tmp_path, flag):
    # overwrite="false" (from a config file or the command line) is true to Python: it erased the buffer
    buffer = ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"))
    buffer.store_episode(x=np.ones(2))
    buffer.close()
    for value in ("false", None, 2):
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), **{flag: value})
    assert len(ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)) == 1
    kept = {"overwrite": np.False_, flag: 0} if flag != "overwrite" else {"overwrite": 0}
    assert len(ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), **kept)) == 1


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_location_or_storage_options_of_the_wrong_type_is_named(tmp_path, backend):
    # were Python's "a bytes-like object is required, not 'str'", dict()'s "dictionary update
    # sequence element #0 has length 1" and "'int' object is not iterable", naming neither
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend) as buffer:
        buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b")
    with pytest.raises(TypeError, match=r"the location must be a str or os.PathLike of str, got bytes b'"):
        ReplayBuffer(os.fsencode(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend)
    for options in ("gzip", 1, [("compression", "gzip")]):
        with pytest.raises(TypeError, match=r"storage_options must be a dict of options \(or None\), got "):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend, storage_options=options)
    assert snapshot_of_folder(tmp_path / "b") == before
    assert len(ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)) == 1


@pytest.mark.parametrize("backend", ["zarr", "memmap", None])
def test_storage_options_with_a_local_folder_are_named_in_a_warning(tmp_path, backend):
    # were ignored unsaid: a URL whose scheme was left out became a local folder of that name
    options = {"endpoint_url": "http://127.0.0.1:1", "key": "k"}
    expected = r"storage_options \['endpoint_url', 'key'\] were given with .*bucket.*a local folder.*ignored"
    with pytest.warns(UserWarning, match=expected):
        buffer = ReplayBuffer(
            str(tmp_path / "bucket" / "run1"), 2, 3, fields=dict(x="float"), backend=backend, storage_options=options
        )
    buffer.store_episode(x=np.ones(2))
    buffer.close()
    with pytest.warns(UserWarning, match="a local folder"):
        assert len(ReplayBuffer.from_folder(str(tmp_path / "bucket" / "run1"), storage_options=options)) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(ReplayBuffer.from_folder(str(tmp_path / "bucket" / "run1"), read_only=True, storage_options={})) == 1


def test_convert_refuses_overwrite_given_as_a_string(tmp_path):
    from replaybuf import convert

    for name in ("src", "dst"):
        with ReplayBuffer(str(tmp_path / name), 2, 3, fields=dict(x="float")) as buffer:
            buffer.store_episode(x=np.ones(2))
    with pytest.raises(TypeError, match="overwrite must be True or False, got 'false'"):
        convert(str(tmp_path / "src"), str(tmp_path / "dst"), overwrite="false")
    assert len(ReplayBuffer.from_folder(str(tmp_path / "dst"), read_only=True)) == 1


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_field_name_too_long_for_a_file_is_refused_before_the_overwrite(tmp_path, backend):
    # zarr and memmap failed creating its files only after erasing the buffer being replaced
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend) as buffer:
        buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b")
    for name in ("y" * 300, "é" * 101):
        with pytest.raises(ValueError, match=r"bytes long \(UTF-8\): a new buffer takes names of at most 200 bytes"):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields={name: "float"}, backend=backend)
        with pytest.raises(ValueError, match="at most 200 bytes"):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), meta_fields={name: "int"}, backend=backend)
    assert snapshot_of_folder(tmp_path / "b") == before
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields={"y" * 200: "float"}, backend=backend) as buffer:
        buffer.store_episode(**{"y" * 200: np.ones(2)})
    assert len(ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)) == 1


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_data_field_name_stores_namedtuple_cannot_hold_is_refused_as_the_seed_does(tmp_path, backend, monkeypatch):
    # accepted at creation, store() then failed inside collections.namedtuple on every step
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend) as buffer:
        buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b")
    for name, what in (
        ("class", "is a Python keyword"),
        ("_x", "starts with an underscore"),
        ("_mask", "starts with an underscore"),
    ):
        with pytest.raises(ValueError, match=f"field name '{name}' {what}.*namedtuple.*rename the field"):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields={name: "float"}, backend=backend)
    assert snapshot_of_folder(tmp_path / "b") == before
    # meta fields are no part of that namedtuple: accepted, as by the seed
    with ReplayBuffer(
        str(tmp_path / "m"), 2, 3, fields=dict(x="float"), meta_fields={"class": "int"}, backend=backend
    ) as buffer:
        buffer.store_episode(x=np.ones(2), **{"class": 3})
        assert buffer.get_all_data()["class"].tolist() == [3]
    # a buffer that holds such a name (written before the check) still takes store(): renamed positionally
    from replaybuf.schema import Schema

    monkeypatch.setattr(Schema, "check_names", lambda self: None)
    with ReplayBuffer(str(tmp_path / "old"), 2, 3, fields={"class": "float", "x": "int"}, backend=backend) as buffer:
        memory = buffer.store(**{"class": 1.5, "x": 2})
        buffer.advance_episode()
        assert memory._fields == ("_0", "x") and float(memory[0]) == 1.5 and int(memory.x) == 2
        assert buffer.get_all_data()["class"][0, 0] == 1.5


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_per_field_compressor_a_raw_backend_does_not_apply_is_warned_of(tmp_path, backend):
    # it was accepted, recorded in the config and never applied, without a word
    fields = {"x": {"dtype": "float", "compressor": "zstd:3"}, "y": "int"}
    meta = {"m": {"dtype": "int", "compressor": "blosc-lz4"}}
    with pytest.warns(
        UserWarning, match=rf"compressors {{'x': 'zstd:3', 'm': 'blosc-lz4'}} are not applied by the '{backend}'"
    ):
        buffer = ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=fields, meta_fields=meta, backend=backend)
    with buffer:
        buffer.store_episode(x=np.ones(2), y=np.ones(2, int), m=1)
    with ReplayBuffer(
        str(tmp_path / "b"), 2, 3, fields=fields, meta_fields=meta, overwrite=False, backend=backend
    ) as again:
        assert len(again) == 1  # the config kept matches
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReplayBuffer(str(tmp_path / "c"), 2, 3, fields={"x": {"dtype": "float", "compressor": "none"}}, backend=backend)


def test_a_compressor_level_out_of_range_is_refused_before_the_overwrite(tmp_path):
    # zstd:23 and gzip:10 failed in the codec after the old buffer was erased; blosc at every write
    from replaybuf import convert

    for name in ("b", "dst"):
        with ReplayBuffer(str(tmp_path / name), 2, 3, fields=dict(x="float")) as buffer:
            buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b"), snapshot_of_folder(tmp_path / "dst")
    for spec, levels in (("zstd:23", "-131072 to 22"), ("gzip:10", "0 to 9"), ("blosc-lz4:10", "0 to 9")):
        with pytest.raises(ValueError, match=f"field 'x': compressor '{spec}': .* takes levels {levels}, got"):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields={"x": {"dtype": "float", "compressor": spec}})
        with pytest.raises(ValueError, match=f"compressor '{spec}'"):
            convert(str(tmp_path / "b"), str(tmp_path / "dst"), compressor=spec, overwrite=True)
    assert (snapshot_of_folder(tmp_path / "b"), snapshot_of_folder(tmp_path / "dst")) == before
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields={"x": {"dtype": "float", "compressor": "zstd:-5"}}) as buffer:
        buffer.store_episode(x=np.ones(2))


# 1.6 EiB of arrays, reserved up front by memmap and uncompressed hdf5: more than any disk has free
TOO_LARGE_FOR_THE_DISK = dict(max_episodes=10**8, max_timesteps=2**20, fields={"x": ("float", 4096)})
NO_ROOM = r"reserves [\d,]+ bytes of disk up front \(the largest, field 'x': float32\[100000000, 1048576, 4096\], "


@pytest.mark.parametrize(
    "backend, settings, error, pattern",
    [
        ("zarr", dict(fields={"x": "longdouble"}), TypeError, "field 'x': dtype 'float128' has no zarr data type"),
        (
            "zarr",
            dict(fields={"x": "float"}, meta_fields={"m": "longdouble"}),
            TypeError,
            "field 'm': dtype 'float128'",
        ),
        ("memmap", TOO_LARGE_FOR_THE_DISK, StorageError, NO_ROOM),
        ("hdf5", TOO_LARGE_FOR_THE_DISK, StorageError, NO_ROOM),
    ],
)
def test_a_buffer_its_backend_cannot_create_is_refused_before_the_overwrite(
    tmp_path, backend, settings, error, pattern
):
    # each failed in the create (zarr's codec, the disk full), after the buffer being replaced was erased
    from replaybuf import convert

    if backend == "zarr" and np.dtype("longdouble").itemsize <= 8:
        pytest.skip("long double is float64 on this platform")
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend) as buffer:
        buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b")
    with pytest.raises(error, match=pattern):
        ReplayBuffer(str(tmp_path / "b"), **{"max_episodes": 2, "max_timesteps": 3, **settings}, backend=backend)
    if backend == "zarr":  # a memmap buffer of that dtype converted to zarr
        with ReplayBuffer(str(tmp_path / "src"), 2, 3, **settings, backend="memmap") as buffer:
            buffer.store_episode(x=np.ones(2))
        with pytest.raises(error, match=pattern):
            convert(str(tmp_path / "src"), str(tmp_path / "b"), backend="zarr", overwrite=True)
    assert snapshot_of_folder(tmp_path / "b") == before
    assert len(ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)) == 1


@pytest.mark.parametrize("backend", ["zarr", "memmap"])
@pytest.mark.parametrize(
    "default", [np.complex128(1), np.bytes_(b"1"), np.str_("1.5"), np.datetime64("2020-01-01")], ids=repr
)
def test_a_numpy_scalar_default_that_is_no_number_is_refused_before_the_overwrite(tmp_path, backend, default):
    # taken as a NumPy scalar: complex and bytes then failed writing the JSON config after the
    # overwrite had erased the buffer; np.str_ made a config that no longer opened
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend) as buffer:
        buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b")
    fields = dict(x="float", y=("float", (), default))
    with pytest.raises(TypeError, match=f"field 'y': default must be a number or bool, got .*{type(default).__name__}"):
        ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=fields, backend=backend)
    assert snapshot_of_folder(tmp_path / "b") == before
    assert len(ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)) == 1


def test_long_double_values_and_defaults_are_numbers(tmp_path):
    # np.longdouble's item() is no Python number: math.trunc raised a TypeError naming no field
    fields = dict(x=("uint8", (), np.longdouble(2.5)))
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=fields, meta_fields=dict(m="int")) as buffer:
        buffer.store_episode(x=np.array([np.longdouble(255.9), 1]), m=np.longdouble(-7.5))
        with pytest.raises(ValueError, match=r"field 'x': values in \[256.5, 256.5\] do not fit dtype uint8"):
            buffer.data["x"][0, 1] = np.longdouble(256.5)
        assert buffer.data["x"][0, :2].tolist() == [255, 1] and buffer.meta_data["m"][0] == -7
    assert ReplayBuffer.from_folder(str(tmp_path / "b")).schema.fields["x"].default == 2.5


@pytest.mark.parametrize("folder", ["data", "data/x"])
def test_an_overwrite_that_cannot_erase_a_folder_is_refused_before_erasing(tmp_path, folder):
    # the erase skipped the files it could not delete, then deleted the rest: zarr's root
    # document went, and with it the buffer (memmap's and hdf5's only folder holds the lease)
    backend = "zarr"
    import subprocess

    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float"), backend=backend) as buffer:
        buffer.store_episode(x=np.ones(2))
    before = snapshot_of_folder(tmp_path / "b")
    locked = tmp_path / "b" / folder
    if os.geteuid() != 0:  # root bypasses the permissions, never a read-only mount
        locked.chmod(0o555)
    elif subprocess.run(["mount", "--bind", "-o", "ro", str(locked), str(locked)], capture_output=True).returncode:
        pytest.skip("cannot mount a folder read-only here")
    try:
        with pytest.raises(PermissionError, match=f"may not delete entries in '{locked}' .*; nothing was erased"):
            ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(y="float"), backend=backend)
    finally:
        if os.geteuid() != 0:
            locked.chmod(0o755)
        else:
            subprocess.run(["umount", str(locked)], check=True)
    assert snapshot_of_folder(tmp_path / "b") == before
    assert len(ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)) == 1


def test_a_numpy_alias_of_a_dtype_creates_it(tmp_path):
    # 'longlong' is int64 of another numpy type, which zarr has no data type for: its create
    # failed after erasing the buffer being replaced
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float")) as buffer:
        buffer.store_episode(x=np.ones(2))
    with ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="longlong"), meta_fields=dict(m="Q")) as buffer:
        buffer.store_episode(x=np.ones(2, dtype=np.int64), m=1)
    reopened = ReplayBuffer.from_folder(str(tmp_path / "b"), read_only=True)
    assert reopened.dtypes["x"] == np.int64 and len(reopened) == 1


def test_numpy_dtype_names_are_accepted(tmp_path):
    buffer = ReplayBuffer(str(tmp_path / "b"), 2, 3, fields=dict(x="float16", y=("int64", 2), z="uint8"))
    assert buffer.dtypes == {"x": np.float16, "y": np.int64, "z": np.uint8}


BAD_WRITES = [
    ("store unknown field", lambda b: b.store(bogus=1.0), ValueError, r"invalid field names \['bogus'\]"),
    ("store wrong shape", lambda b: b.store(action=np.zeros(3)), ValueError, r"'action'.*\(3,\).*\(2,\)"),
    ("store string", lambda b: b.store(reward="high"), TypeError, "'reward'"),
    ("store object", lambda b: b.store(reward=object()), TypeError, "'reward'"),
    ("store NaN into int", lambda b: b.store(action=np.array([np.nan, 1.0])), ValueError, "'action'.*non-finite"),
    ("store out of range int", lambda b: b.store(action=np.array([2**40, 1])), ValueError, "'action'.*do not fit"),
    (
        "store_episode mismatched time",
        lambda b: b.store_episode(reward=np.ones(3), action=np.ones((4, 2))),
        ValueError,
        "'action' has 4 timesteps",
    ),
    ("store_episode scalar field", lambda b: b.store_episode(reward=1.0), ValueError, "'reward' needs a time"),
    ("store_episode only meta", lambda b: b.store_episode(task_id=1), ValueError, "time-varying"),
    ("store_episode too long", lambda b: b.store_episode(reward=np.ones(13)), ValueError, "max_timesteps"),
    ("store_episode bad shape", lambda b: b.store_episode(state=np.ones((3, 3, 4))), ValueError, "'state'"),
    ("store_episode bad meta", lambda b: b.store_episode(reward=np.ones(3), task_id=[1, 2]), ValueError, "'task_id'"),
    ("store_episode unknown", lambda b: b.store_episode(reward=np.ones(3), nope=1), ValueError, "nope"),
    ("one_episode unknown meta", lambda b: b.one_episode(nope=1).__enter__(), ValueError, "nope"),
    ("batched bad size", lambda b: b.batched_episode(0).__enter__(), ValueError, "batch_size"),
    (
        "batched meta wrong batch",
        lambda b: b.batched_episode(2, task_id=[1, 2, 3]).__enter__(),
        ValueError,
        "'task_id'.*batch size 3",
    ),
    (
        "store_batch mismatched",
        lambda b: b.store_batch(reward=np.ones(2), action=np.ones((3, 2))),
        ValueError,
        "'action' has batch size 3",
    ),
    ("store_batch empty", lambda b: b.store_batch(), ValueError, "no data"),
    ("store_batch batch 0", lambda b: b.store_batch(reward=np.ones(0)), ValueError, "batch size 0"),
    ("store_meta_batch batch 0", lambda b: b.store_meta_batch(task_id=np.ones(0, int)), ValueError, "batch size 0"),
    ("update empty", lambda b: b.update(), ValueError, "no data"),
    ("update bad index type", lambda b: b.update([0.5], reward=np.ones((1, 2))), TypeError, "indices"),
    ("meta datapoint unknown", lambda b: b.store_meta_datapoint(0, "nope", 1), ValueError, "nope"),
    ("store float overflow", lambda b: b.store(reward=1e300), ValueError, r"'reward'.*1e\+300.*float32"),
    ("store int beyond 64 bits", lambda b: b.store(action=[2**64, 0]), ValueError, r"'action'.*18446744073709551616"),
    # data[...] = is checked as every write is: numpy's assignment would wrap or cast NaN silently
    (
        "data[] out of range",
        lambda b: b.data["action"].__setitem__((0, 0), np.array([2**40, 1])),
        ValueError,
        "'action'.*do not fit",
    ),
    (
        "data[] NaN into int",
        lambda b: b.data["action"].__setitem__((0, 1), np.array([np.nan, 1.0])),
        ValueError,
        "'action'.*non-finite",
    ),
    (
        "data[] float overflow",
        lambda b: b.data["reward"].__setitem__(0, np.full(12, 1e39)),
        ValueError,
        "'reward'.*float32",
    ),
    ("data[] string", lambda b: b.data["reward"].__setitem__((0, 0), "high"), TypeError, "'reward'"),
    ("data[] wrong shape", lambda b: b.data["action"].__setitem__((0, 0), [1, 2, 3]), ValueError, r"'action'.*\(3,\)"),
    ("data[] out of bounds", lambda b: b.data["action"].__setitem__((9, 0), [1, 2]), IndexError, "'action'.*9"),
    # an index past int64 was numpy's bare OverflowError, naming nothing
    ("data[] index past int64", lambda b: b.data["reward"].__setitem__(2**63, 1.0), IndexError, r"data\['reward'\]"),
    ("meta_data[] index past int64", lambda b: b.meta_data["task_id"].__setitem__(2**63, 1), ValueError, "'task_id'"),
    # 2-D indices: zarr and hdf5 failed inside the write (after moving the slot's revision), memmap wrote
    (
        "update 2-D indices",
        lambda b: b.update(np.array([[0, 0]]), reward=np.ones((1, 2))),
        ValueError,
        r"update: indices must be an int or a 1-D sequence of ints, got shape \(1, 2\)",
    ),
    # a tensor on the meta device holds no values: torch's NotImplementedError came through
    ("store meta-device tensor", lambda b: b.store(reward=torch.empty((), device="meta")), TypeError, "'reward'.*meta"),
    (
        "update meta-device tensor",
        lambda b: b.update(0, task_id=torch.empty((), device="meta")),
        TypeError,
        "'task_id'.*meta",
    ),
    # tensor indices: torch's NotImplementedError (meta) and bare "unsupported ScalarType BFloat16"
    (
        "update meta-device indices",
        lambda b: b.update(torch.zeros(1, dtype=torch.long, device="meta"), reward=1.0),
        TypeError,
        "'indices'.*meta",
    ),
    (
        "update bfloat16 indices",
        lambda b: b.update(torch.zeros(1, dtype=torch.bfloat16), reward=1.0),
        TypeError,
        r"update: indices must be ints, a slice or None, got tensor\(\[0\.\], dtype=torch\.bfloat16\)",
    ),
]


@pytest.mark.parametrize("label, call, error, pattern", BAD_WRITES, ids=[w[0] for w in BAD_WRITES])
def test_bad_writes_leave_buffer_unchanged(make_location, label, call, error, pattern):
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    before = snapshot(buffer)
    with pytest.raises(error, match=pattern):
        call(buffer)
    assert buffer.timestep_index == 0
    assert_same_snapshot(before, snapshot(buffer))


def test_repeated_slots_keep_the_last_value_given_on_every_backend(make_location):
    # hdf5 raised h5py's "Indexing elements must be in increasing order" (after moving the slot's
    # revision); numpy's assignment, as memmap, zarr and the seed take it, keeps the last value
    buffer, *_ = make(make_location)
    for task in (1, 2):
        fill_episode(buffer, 3, task=task)
    buffer.update([1, 0, 1], reward=np.array([[5.0, 5, 5], [6, 6, 6], [7, 7, 7]]), task_id=[5, 6, 7])
    assert buffer.data["reward"][:2, :3].tolist() == [[6, 6, 6], [7, 7, 7]]
    buffer.meta_data["task_id"][[0, 0]] = [8, 9]
    buffer.store_batch_meta_datapoint([1, 1], "task_id", [3, 4])
    assert buffer.meta_data["task_id"][:2].tolist() == [9, 4]
    buffer.close()
    reopened = ReplayBuffer.from_folder(buffer.storage.location, read_only=True, backend=buffer.storage.backend_name)
    assert reopened.get_all_data()["task_id"].tolist() == [9, 4]


def test_meta_data_keys_of_more_dimensions_assign_as_numpy_does(make_location):
    # hdf5 failed inside the write (IndexError / "Only 1D arrays allowed"), the slot's revision moved
    buffer, *_ = make(make_location)
    for task in (1, 2):
        fill_episode(buffer, 3, task=task)
    buffer.meta_data["task_id"][True] = 4  # numpy: every slot
    assert buffer.meta_data["task_id"][:].tolist() == [4] * 6
    buffer.meta_data["task_id"][np.array([[1, 0]])] = [[5, 6]]
    assert buffer.meta_data["task_id"][:2].tolist() == [6, 5]


def test_a_float16_into_an_int_field_warns_of_no_overflow(make_location):
    # the range check compared float16 values with int32's bounds in float16: a RuntimeWarning
    # "overflow encountered in cast" on every such write, an error under -W error
    buffer, *_ = make(make_location)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer.store(action=np.array([1.5, 2], dtype=np.float16))
        buffer.advance_episode()
        buffer.meta_data["task_id"][0] = np.float16(3)
    assert buffer.data["action"][0, 0].tolist() == [1, 2] and buffer.meta_data["task_id"][0] == 3


def test_drop_episodes_of_no_slot_drops_nothing(make_location):
    # [] is float64 to numpy: refused as "slots must be ints", so dropping what a check found
    # (none) raised; non-int slots are still refused
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    before = snapshot(buffer)
    assert buffer.drop_episodes([]) == [] and buffer.drop_episodes(np.array([])) == []
    with pytest.raises(ValueError, match=r"drop_episodes: slots must be ints in \[0, 6\), got \[0\.5\]"):
        buffer.drop_episodes([0.5])
    assert_same_snapshot(before, snapshot(buffer))


def test_store_batch_wrong_size_inside_group(make_location):
    buffer, *_ = make(make_location)
    with pytest.raises(ValueError, match="batch size 3"):
        with buffer.batched_episode(2):
            buffer.store_batch(reward=torch.ones(2))
            buffer.store_batch(reward=torch.ones(3))
    assert buffer.num_episodes == 0


def test_error_messages_name_expected_values(make_location):
    buffer, *_ = make(make_location)
    with pytest.raises(ValueError) as info:
        buffer.store(state=np.zeros((3, 4)))
    message = str(info.value)
    assert "'state'" in message and "(3, 4)" in message and "(3, 4, 4)" in message
    with pytest.raises(ValueError) as info:
        buffer.store(bogus=1)
    assert all(name in str(info.value) for name in FIELDS)


def test_an_unknown_field_name_in_data_or_meta_data_names_the_fields(make_location):
    buffer, *_ = make(make_location)
    # was a bare KeyError('bogus'), naming neither where it was looked up nor what exists
    with pytest.raises(KeyError, match=r"data\['bogus'\]: no such field; the fields are \['action', "):
        buffer.data["bogus"]
    with pytest.raises(KeyError, match=r"meta_data\['bogus'\]: no such field; the fields are \[.*'task_id'"):
        buffer.meta_data["bogus"]
    assert "bogus" not in buffer.data and buffer.meta_data.get("bogus") is None  # still a Mapping's misses


def test_bad_update_indices_name_the_call(make_location):
    buffer, *_ = make(make_location)
    with pytest.raises(TypeError, match=r"^update: indices must be ints, a slice or None, got True"):
        buffer.update(True, reward=np.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"^update: episode indices \[9\] out of range - must be in \[0, "):
        buffer.update(9, reward=np.zeros((1, 2)))


def test_meta_names_in_store_are_rejected(make_location):
    buffer, *_ = make(make_location)
    with pytest.raises(ValueError, match="task_id"):
        buffer.store(task_id=1)
    assert set(META) <= buffer.meta_fieldnames


def test_bad_final_meta_of_one_episode_rolls_it_back(make_location):
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    before = snapshot(buffer)
    with pytest.raises(TypeError, match="'task_id'"):
        with buffer.one_episode(task_id=2) as final:
            buffer.store(reward=5.0)
            final["task_id"] = "two"
    assert buffer.timestep_index == 0
    assert_same_snapshot(before, snapshot(buffer))
    fill_episode(buffer, 2, task=3)  # the next episode holds only its own steps
    assert buffer.episode_lens[:2].tolist() == [3, 2]
    assert buffer.data["reward"][1, :2].tolist() == [0.0, 1.0]


def test_an_open_where_no_buffer_is_raises_buffer_not_found_and_creates_nothing(tmp_path):
    """``ReplayBuffer(path, read_only=True)`` of a missing or empty folder, or with a ``backend``
    the folder does not hold, and a writable open without a config where no buffer is, raise
    ``BufferNotFoundError`` as ``from_folder`` does (they raised a bare ``FileNotFoundError`` or
    ``ValueError``, which ``except BufferNotFoundError`` missed), naming the backend there, and
    create nothing."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for place in (tmp_path / "missing", empty):
        with pytest.raises(BufferNotFoundError, match="no replaybuf buffer found at .*nothing to open read-only"):
            ReplayBuffer(place, read_only=True)
        with pytest.raises(
            BufferNotFoundError, match="no buffer exists at .*pass max_episodes, max_timesteps and fields"
        ):
            ReplayBuffer(place, overwrite=False)
    assert not (tmp_path / "missing").exists() and list(empty.iterdir()) == []
    zarr = tmp_path / "zarr"
    ReplayBuffer(zarr, max_episodes=2, max_timesteps=3, fields={"state": "float"}).close()
    before = {p: p.read_bytes() for p in zarr.rglob("*") if p.is_file()}
    with pytest.raises(BufferNotFoundError, match="no 'memmap' buffer at .*: it holds a 'zarr' buffer"):
        ReplayBuffer(zarr, read_only=True, backend="memmap")
    # a writable reopen said "no buffer exists at ...", silent on the zarr buffer there
    with pytest.raises(BufferNotFoundError, match="no 'hdf5' buffer at .*: it holds a 'zarr' buffer; open it with"):
        ReplayBuffer(zarr, overwrite=False, backend="hdf5")
    assert {p: p.read_bytes() for p in zarr.rglob("*") if p.is_file()} == before


def test_a_masked_array_with_masked_items_is_refused_on_every_write(make_location):
    # np.asarray kept whatever the masked items' memory held, and stored it without a word
    buffer, *_ = make(make_location)
    fill_episode(buffer, 3, task=1)
    before = snapshot(buffer)
    rewards = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    writes = {
        "store_episode": lambda: buffer.store_episode(reward=rewards, task_id=2),
        "update": lambda: buffer.update(0, reward=rewards),
        "data": lambda: buffer.data["reward"].__setitem__((0, slice(0, 3)), rewards),
        "meta": lambda: buffer.meta_data["task_id"].__setitem__(0, np.ma.masked_array(4, mask=True)),
        "store": lambda: buffer.store(reward=np.ma.masked_array(1.0, mask=True)),
        "collector": lambda: buffer.create_collector(3).append(reward=rewards),
    }
    for call, write in writes.items():
        with pytest.raises(ValueError, match=r"field '(reward|task_id)': a masked array with 1 masked value"):
            write()
        assert buffer.timestep_index == 0, call
    assert_same_snapshot(snapshot(buffer), before)
    buffer.update(0, reward=np.ma.masked_array([5.0, 6.0, 7.0], mask=False))  # nothing masked: its values
    assert buffer.data["reward"][0, :3].tolist() == [5.0, 6.0, 7.0]
