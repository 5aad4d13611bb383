"""An in-place edit of a buffer on an object store (moto's S3, the GCS emulator) is whole
through a SIGKILL of its writer, as on local disk (``test_edit_atomic.py``): once the next
writable open has run, every (field, episode) the call touched holds its old values or every
one its new, and ``verify`` finds nothing. A cached reader (the default on an object store)
opened between the kill and the reopen keeps no copy of the half-applied rows: after the reopen
its ``refresh()`` serves the new values."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from replaybuf import ReplayBuffer, UnfinishedEditError, verify
from replaybuf.maintenance import WriterOutpacedError, convert

from ._edit_killer import run_killed

pytest_plugins = ["tests._servers"]

EPISODES, STEPS = 4, 10
FIELDS = {"frame": ("uint8", (8, 8, 3)), "state": ("float32", (4,)), "priority": ("float32", ())}
META_FIELDS = {"score": "float"}
EDITED = np.array([0, 2, 3])


@pytest.fixture(params=["s3", "gcs"])
def server(request):
    return request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")


def make_buffer(server) -> str:
    """A buffer of EPISODES full episodes, every value 0; its URL."""
    url = server.url(f"buffers/{uuid.uuid4().hex[:12]}")
    fields = {name: {"dtype": dtype, "shape": list(shape)} for name, (dtype, shape) in FIELDS.items()}
    with ReplayBuffer(
        url, EPISODES, STEPS, fields=fields, meta_fields=META_FIELDS, storage_options=server.storage_options
    ) as buffer:
        for _ in range(EPISODES):
            buffer.store_episode(**{n: np.zeros((STEPS, *s), d) for n, (d, s) in FIELDS.items()}, score=0.0)
    return url


def kill_inside(server, url: str, spec: dict) -> None:
    """Run ``tests._edit_killer`` on ``url`` with ``spec``; it must die of its SIGKILL."""
    spec = {"location": url, "storage_options": server.storage_options, "episodes": EDITED.tolist(), **spec}
    run_killed(spec)


def read_all(buffer: ReplayBuffer) -> dict[str, np.ndarray]:
    state = {name: np.asarray(buffer.data[name][:EPISODES]) for name in FIELDS}
    state["score"] = np.asarray(buffer.meta_data["score"][:EPISODES])
    return state


@pytest.mark.parametrize("at", [1, 2, 3])
def test_an_update_killed_between_its_writes_is_whole_after_the_reopen(server, at):
    """update() of every field killed before its ``at``-th field's first write: a reader opened
    between the kill and the reopen caches nothing of it; the writable reopen rolls it forward
    whole; the reader's refresh() then serves the new values; verify is clean."""
    url = make_buffer(server)
    options = dict(storage_options=server.storage_options)
    values = {"frame": 7, "state": 1.5, "priority": 2.5, "score": 3.5}
    spec_values = {
        name: np.full((len(EDITED), STEPS, *FIELDS[name][1]), v).tolist() if name in FIELDS else [v] * len(EDITED)
        for name, v in values.items()
    }
    kill_inside(server, url, {"kind": "update", "at": at, "names": list(values), "values": spec_values})
    reader = ReplayBuffer.from_folder(url, read_only=True, **options)
    read_all(reader)
    reader.warm_cache()
    ReplayBuffer.from_folder(url, break_lock=True, **options).close()
    reader.refresh()
    after = read_all(reader)
    fresh = read_all(ReplayBuffer.from_folder(url, read_only=True, cache=False, **options))
    for name, v in values.items():
        for e in range(EPISODES):
            want = v if e in EDITED else 0
            assert (fresh[name][e] == want).all(), f"{name!r} of episode {e} after the reopen: {fresh[name][e]}"
            assert (after[name][e] == want).all(), f"the cached reader's {name!r} of episode {e} after refresh()"
    assert verify(url, **options) == []


def test_update_priorities_killed_inside_is_whole_after_the_reopen(server):
    """update_priorities() killed before its write (its record written, its slots odd): the
    reopen applies it; a cached reader's refresh() serves the new priorities."""
    url = make_buffer(server)
    options = dict(storage_options=server.storage_options)
    steps = [1, 5, 9]
    spec = {"kind": "update_priorities", "at": 1, "names": ["priority"], "steps": steps}
    kill_inside(server, url, {**spec, "priorities": [4.0, 5.0, 6.0], "priority_field": "priority"})
    reader = ReplayBuffer.from_folder(url, read_only=True, **options)
    read_all(reader)
    reader.warm_cache()
    ReplayBuffer.from_folder(url, break_lock=True, **options).close()
    reader.refresh()
    want = np.zeros((EPISODES, STEPS), np.float32)
    want[EDITED, steps] = [4.0, 5.0, 6.0]
    np.testing.assert_array_equal(read_all(reader)["priority"], want)
    np.testing.assert_array_equal(
        read_all(ReplayBuffer.from_folder(url, read_only=True, cache=False, **options))["priority"], want
    )
    assert verify(url, **options) == []


def test_convert_between_the_kill_and_the_reopen_copies_no_half_applied_edit(server, tmp_path):
    """convert of a buffer on an object store whose writer was killed mid-update, before any
    writable reopen (the killed writer's lease still counts as live until it expires): it copies
    no half-applied edit (it raises, naming the slots being edited, and publishes nothing);
    after the reopen it copies the edit whole."""
    url = make_buffer(server)
    options = dict(storage_options=server.storage_options)
    values = {"frame": 7, "state": 1.5, "score": 3.5}
    spec_values = {
        name: np.full((len(EDITED), STEPS, *FIELDS[name][1]), v).tolist() if name in FIELDS else [v] * len(EDITED)
        for name, v in values.items()
    }
    kill_inside(server, url, {"kind": "update", "at": 2, "names": list(values), "values": spec_values})
    dst = str(tmp_path / "copy")
    with pytest.raises((UnfinishedEditError, WriterOutpacedError), match=r"slots \[0, 2, 3\]"):
        convert(url, dst, storage_options=server.storage_options)
    assert not os.path.exists(dst)
    ReplayBuffer.from_folder(url, break_lock=True, **options).close()
    convert(url, dst, storage_options=server.storage_options)
    copied = read_all(ReplayBuffer.from_folder(dst, read_only=True))
    for name, v in values.items():
        for e in range(EPISODES):
            assert (copied[name][e] == (v if e in EDITED else 0)).all(), f"{name!r} of episode {e} in the copy"
    assert verify(dst) == []
