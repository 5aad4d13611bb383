"""Buffer-level attributes (issue 17): a JSON dict stored through the blob API on every backend
and object store, checked before it is written, refused on read-only buffers."""

from __future__ import annotations

import os
import pickle
import uuid

import numpy as np
import pytest

from replaybuf import BufferDamagedError, ReplayBuffer, convert, info, verify
from replaybuf.attrs import MAX_ATTRS_BYTES
from replaybuf.concat import ConcatReplayBuffer
from replaybuf.maintenance import format_info

pytest_plugins = ["tests._servers"]

FIELDS = {"state": ("float", 3)}
DATA = os.path.join(os.path.dirname(__file__), "data")


def new_buffer(location, **kwargs) -> ReplayBuffer:
    buffer = ReplayBuffer(location, max_episodes=3, max_timesteps=4, fields=FIELDS, **kwargs)
    buffer.store_episode(state=np.ones((2, 3), np.float32))
    return buffer


def stored(location, **kwargs) -> dict:
    return dict(ReplayBuffer.from_folder(location, read_only=True, **kwargs).attrs)


def test_attrs_round_trip_on_every_backend(make_location):
    location, kwargs = make_location()
    buffer = new_buffer(location, **kwargs)
    assert dict(buffer.attrs) == {}
    buffer.attrs["fps"] = 30
    buffer.attrs.update({"tasks": {"0": "pick"}, "shape": (96, 96, 3)}, robot_type=None)
    buffer.attrs["gone"] = True
    del buffer.attrs["gone"]
    expected = {"fps": 30, "tasks": {"0": "pick"}, "shape": [96, 96, 3], "robot_type": None}
    assert dict(buffer.attrs) == expected  # tuples read back as lists, as JSON has them
    buffer.close()
    assert stored(location, **kwargs) == expected
    assert verify(location) == []


@pytest.mark.parametrize("server_name", ["s3_server", "gcs_server"])
def test_attrs_on_object_storage_and_a_reader_writes_nothing(request, server_name):
    server = request.getfixturevalue(server_name)
    url = server.url(f"buffers/{uuid.uuid4().hex[:12]}")
    options = server.storage_options
    with new_buffer(url, storage_options=options) as buffer:
        buffer.attrs.update(fps=15, features={"action": {"names": ["x", "y"]}})
    with server.record() as requests:
        reader = ReplayBuffer.from_folder(url, read_only=True, storage_options=options)
        assert dict(reader.attrs) == {"fps": 15, "features": {"action": {"names": ["x", "y"]}}}
    assert requests.writes() == []


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ("fps", np.int64(30), TypeError, r"attrs\['fps'\] is a numpy.int64 .*convert numpy values with .item\(\)"),
        ("info", {"cam": [1, object()]}, TypeError, r"attrs\['info'\]\['cam'\]\[1\] is a builtins.object"),
        ("info", {"cam": {"gain": float("nan")}}, ValueError, r"attrs\['info'\]\['cam'\]\['gain'\] is nan"),
        ("info", {"cam": float("inf")}, ValueError, r"attrs\['info'\]\['cam'\] is inf: JSON has no NaN"),
        ("info", {1: "a"}, TypeError, r"attrs\['info'\] has the key 1 \(int\): JSON object keys are str"),
        ("info", b"raw", TypeError, r"attrs\['info'\] is a builtins.bytes"),
        (3, "x", TypeError, r"buffer attrs keys are str, got 3 \(int\)"),
        ("big", "x" * MAX_ATTRS_BYTES, ValueError, rf"more than the {MAX_ATTRS_BYTES} allowed"),
    ],
)
def test_refused_values_name_the_key_and_leave_attrs_as_they_were(tmp_path, key, value, error, message):
    buffer = new_buffer(tmp_path / "b")
    buffer.attrs["fps"] = 10
    with pytest.raises(error, match=message):
        buffer.attrs[key] = value
    with pytest.raises(error, match=message):  # all or nothing: the good value is not stored either
        buffer.attrs.update({"good": 1, key: value})
    assert dict(buffer.attrs) == {"fps": 10}
    buffer.close()
    assert stored(tmp_path / "b") == {"fps": 10}


def test_a_value_holding_itself_is_refused(tmp_path):
    loop: list = []
    loop.append(loop)
    with new_buffer(tmp_path / "b") as buffer, pytest.raises(ValueError, match="nests deeper than"):
        buffer.attrs["loop"] = loop


def test_read_only_buffers_refuse_every_change(tmp_path):
    with new_buffer(tmp_path / "b") as buffer:
        buffer.attrs["fps"] = 10
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    pickled = pickle.loads(pickle.dumps(new_buffer(tmp_path / "c")))  # a DataLoader worker's copy
    changes = {
        r"attrs\['fps'\] = \.\.\.": lambda attrs: attrs.__setitem__("fps", 1),
        r"del attrs\['fps'\]": lambda attrs: attrs.__delitem__("fps"),
        "attrs.update": lambda attrs: attrs.update(fps=1),
        "attrs.clear": lambda attrs: attrs.clear(),
    }
    for target, why in ((reader, "a buffer opened read-only"), (pickled, ".* a pickled copy of a writable buffer")):
        for call, change in changes.items():
            with pytest.raises(ValueError, match=f"cannot call `{call}` on {why}"):
                change(target.attrs)
    assert stored(tmp_path / "b") == {"fps": 10}
    assert dict(pickled.attrs) == {}


def test_views_do_not_undo_each_other_and_readers_see_new_values(tmp_path):
    buffer = new_buffer(tmp_path / "b")
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    first, second = buffer.attrs, buffer.attrs
    first["a"] = 1
    second["b"] = 2  # written over the stored attributes, not over second's stale copy
    assert dict(buffer.attrs) == {"a": 1, "b": 2} == dict(reader.attrs)
    nested = buffer.attrs["b"], buffer.attrs
    nested[1].clear()
    assert dict(buffer.attrs) == {}
    buffer.attrs["tasks"] = {"0": "pick"}
    view = buffer.attrs
    view["tasks"]["0"] = "changed"  # a copy: assign the whole value to change it
    assert view["tasks"] == {"0": "pick"} == stored(tmp_path / "b")["tasks"]
    with pytest.raises(KeyError):
        del view["missing"]
    buffer.close()


def test_overwrite_erases_attrs_and_convert_and_info_carry_them(tmp_path):
    with new_buffer(tmp_path / "b") as buffer:
        buffer.attrs.update(fps=10, robot_type="arm")
    summary = convert(tmp_path / "b", tmp_path / "copy", backend="memmap", progress=False)
    assert summary["verified"]
    assert stored(tmp_path / "copy") == {"fps": 10, "robot_type": "arm"}
    facts = info(tmp_path / "copy")
    assert facts["attrs"] == {"fps": 10, "robot_type": "arm"}
    assert "attrs      fps, robot_type" in format_info(facts)
    new_buffer(tmp_path / "b").close()  # overwrite=True: a new, empty buffer
    assert stored(tmp_path / "b") == {}


def test_damaged_attrs_object_names_it(tmp_path):
    new_buffer(tmp_path / "b").close()
    (tmp_path / "b" / "replaybuf" / "attrs.json").write_text("{not json")
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    with pytest.raises(BufferDamagedError, match=r"replaybuf/attrs.json in .*: not valid JSON"):
        dict(reader.attrs)
    assert [p for p in verify(tmp_path / "b") if "replaybuf/attrs.json" in p and "not valid JSON" in p]


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"fps": NaN}', r"attrs\['fps'\] is nan: JSON has no NaN"),
        (b'{"a": [1, -Infinity]}', r"attrs\['a'\]\[1\] is -inf"),
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "not valid JSON .*recursion"),
        (b'{"a": "' + b"x" * MAX_ATTRS_BYTES + b'"}', "over the 1,048,576-byte limit"),
    ],
    ids=["nan", "infinity", "deep", "large"],
)
def test_attrs_object_holding_what_no_write_stores_is_damaged(tmp_path, content, problem):
    """NaN and infinity were read back as floats (and then made every change fail), a deep
    nesting raised RecursionError, a 64 MiB object was read whole, and convert copied each
    as it was; each is now refused naming the object, by buffer.attrs, verify and convert
    (before it writes anything)."""
    new_buffer(tmp_path / "b").close()
    (tmp_path / "b" / "replaybuf" / "attrs.json").write_bytes(content)
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    with pytest.raises(BufferDamagedError, match=r"replaybuf/attrs.json.*" + problem):
        dict(reader.attrs)
    assert [p for p in verify(tmp_path / "b") if "replaybuf/attrs.json" in p]
    with pytest.raises(BufferDamagedError, match=r"replaybuf/attrs.json.*" + problem):
        convert(tmp_path / "b", tmp_path / "copy", progress=False)  # copied the bytes as they were
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_buffers_of_the_released_format_have_no_attrs(backend):
    assert stored(os.path.join(DATA, "format-v1", backend)) == {}


def test_concat_exposes_each_member_and_what_they_share(tmp_path):
    for name, attrs in (("a", {"fps": 10, "robot": "arm", "tasks": ["x"]}), ("b", {"fps": 10, "tasks": ["y"]})):
        with new_buffer(tmp_path / name) as buffer:
            buffer.attrs.update(attrs)
    concat = ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"])
    assert [dict(a) for a in concat.member_attrs] == [
        {"fps": 10, "robot": "arm", "tasks": ["x"]},
        {"fps": 10, "tasks": ["y"]},
    ]
    assert dict(concat.attrs) == {"fps": 10}
    with pytest.raises(TypeError):
        concat.attrs["fps"] = 1  # type: ignore[index]
    with pytest.raises(ValueError, match="opened read-only"):
        concat.member_attrs[0]["fps"] = 1
