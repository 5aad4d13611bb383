"""Tools and reads of a buffer left by a writer SIGKILLed in the middle of an in-place edit (its
edit log holding the edit, its slots at an odd ``meta/_revision``): ``convert`` and
``upgrade`` refuse to copy it (naming the unfinished edit and what finishes it) rather than
copy the edit half applied, without its log, into a buffer whose first writable open would seal
it so; the source keeps its record, and its next writable open still finishes the edit whole."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ReplayBuffer, UnfinishedEditError, verify
from replaybuf.cli import main as cli_main
from replaybuf.maintenance import WriterOutpacedError, convert, upgrade

from ._backends import LOCAL_BACKENDS
from ._edit_killer import run_killed

EPISODES, STEPS = 4, 10
FIELDS = {"frame": ("uint8", (8, 8, 3)), "state": ("float32", (4,))}
META_FIELDS = {"score": "float"}
EDITED = [0, 2, 3]
NEW = {"frame": 7, "state": 1.5, "score": 3.5}
DATA = Path(__file__).resolve().parent / "data"


def make_buffer(location: str, backend: str) -> None:
    """EPISODES full episodes, every value 0."""
    fields = {name: {"dtype": dtype, "shape": list(shape)} for name, (dtype, shape) in FIELDS.items()}
    with ReplayBuffer(location, EPISODES, STEPS, fields=fields, meta_fields=META_FIELDS, backend=backend) as buffer:
        for _ in range(EPISODES):
            buffer.store_episode(**{n: np.zeros((STEPS, *s), d) for n, (d, s) in FIELDS.items()}, score=0.0)


def kill_inside_update(location: str, values: dict, at: int = 2, steps: int = STEPS) -> None:
    """A writer SIGKILLed inside ``update(EDITED, **values)`` (``steps`` steps of each data
    field), before the first write of its ``at``-th field: the edit is half applied."""
    spec_values = {
        name: np.broadcast_to(np.asarray(v), (len(EDITED), steps) if isinstance(v, int | float) else np.shape(v))
        for name, v in values.items()
    }
    spec = {
        "location": location,
        "episodes": EDITED,
        "kind": "update",
        "at": at,
        "names": list(values),
        "values": {n: np.asarray(v).tolist() for n, v in spec_values.items()},
    }
    run_killed(spec)


def update_values() -> dict:
    """NEW for every step of every field and meta value of the EDITED episodes."""
    return {
        name: np.full((len(EDITED), STEPS, *FIELDS[name][1]), v) if name in FIELDS else np.full(len(EDITED), v)
        for name, v in NEW.items()
    }


def assert_whole_new(location: str) -> None:
    """Every edited (field, episode) holds NEW, every other one 0; verify clean."""
    with ReplayBuffer.from_folder(location, read_only=True) as reader:
        for name in NEW:
            values = reader.data[name][:EPISODES] if name in FIELDS else reader.meta_data[name][:EPISODES]
            for e in range(EPISODES):
                want = NEW[name] if e in EDITED else 0
                assert (np.asarray(values[e]) == want).all(), f"{name!r} of episode {e}: {values[e]}"
    assert verify(location) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize("to", LOCAL_BACKENDS)
def test_convert_refuses_a_buffer_with_an_unfinished_edit_and_the_source_still_finishes_it(tmp_path, backend, to):
    """convert of a buffer a writer was killed in mid-update: refused, naming the slots, the
    edit log and what finishes the edit, nothing written at the destination; the source keeps
    its record, so its next writable open applies the edit whole; then convert copies it whole.
    (It copied the half-applied edit, meta values new and rows old, with the odd revisions but
    not the edit log: the copy's first writable open sealed it half applied, verify clean.)"""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_buffer(src, backend)
    kill_inside_update(src, update_values())
    record = Path(src, "replaybuf", "edit").read_bytes() if backend != "hdf5" else None
    with pytest.raises(UnfinishedEditError, match=r"slots \[0, 2, 3\].*edit log.*verify --repair.*nothing was written"):
        convert(src, dst, backend=to)
    assert not os.path.exists(dst)
    if record is not None:
        assert Path(src, "replaybuf", "edit").read_bytes() == record, "the source's edit log must stay as it was"
    ReplayBuffer.from_folder(src).close()
    assert_whole_new(src)
    convert(src, dst, backend=to)
    assert_whole_new(dst)


def test_the_convert_command_refuses_an_unfinished_edit_naming_it(tmp_path, capsys):
    """`replaybuf convert` of such a buffer exits 1 with the refusal, not 'damaged'."""
    src = str(tmp_path / "src")
    make_buffer(src, "zarr")
    kill_inside_update(src, update_values())
    assert cli_main(["convert", src, str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "in-place edit that a writer stopped part way through" in err and "damaged" not in err


def test_convert_waits_out_a_live_writers_edit_and_copies_nothing_half_applied(tmp_path, monkeypatch):
    """A live writer (a thread of this process) part way through an edit (its first field
    written, the rest not yet): convert copies no half-applied edit, it raises
    WriterOutpacedError naming the slots being edited (it copied them half applied, as whole);
    once the writer finishes the edit, convert copies it whole."""
    import threading

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_buffer(src, "zarr")
    writer = ReplayBuffer.from_folder(src)
    storage, seen, mid, go = writer.storage, [], threading.Event(), threading.Event()
    update_rows = storage.update_rows

    def paused(name, *args):
        seen.append(name)
        if len(seen) == 2:
            mid.set()
            go.wait(30)
        return update_rows(name, *args)

    monkeypatch.setattr(storage, "update_rows", paused)
    editing = threading.Thread(target=writer.update, args=(EDITED,), kwargs=update_values())
    editing.start()
    try:
        assert mid.wait(30)
        with pytest.raises(WriterOutpacedError, match=r"slots \[0, 2, 3\] were in the middle of an in-place edit"):
            convert(src, dst)
    finally:
        go.set()
        editing.join(30)
    convert(src, dst)
    writer.close()
    assert_whole_new(dst)


@pytest.mark.parametrize("version, backend", [("format-v1", "zarr"), ("format-v3", "memmap"), ("format-v4", "hdf5")])
def test_upgrade_refuses_an_older_format_with_an_unfinished_edit(tmp_path, version, backend):
    """upgrade of an older format's buffer a writer was killed in mid-update: refused before it
    takes the lease or copies anything, naming the unfinished edit (it failed on the copy's
    verify, 'the copy failed its check'); after a writable open finishes the edit, the upgrade
    runs and keeps it whole."""
    path = tmp_path / "buffer"
    shutil.copytree(DATA / version / backend, path)
    with ReplayBuffer.from_folder(str(path), read_only=True) as reader:
        fields = {n: (f.dtype, f.shape) for n, f in reader.schema.fields.items()}
        length = int(reader.episode_lens[:3].min())
    values = {name: np.full((3, length, *shape), 1, dtype) for name, (dtype, shape) in fields.items()}
    EDITED[:] = [0, 1, 2]
    try:
        kill_inside_update(str(path), values, steps=length)
    finally:
        EDITED[:] = [0, 2, 3]
    with pytest.raises(UnfinishedEditError, match=r"upgrade: .*slots \[0, 1, 2\].*verify --repair"):
        upgrade(str(path))
    assert sorted(os.listdir(tmp_path)) == ["buffer"], "nothing beside the buffer"
    ReplayBuffer.from_folder(str(path)).close()
    upgrade(str(path))
    with ReplayBuffer.from_folder(str(path), read_only=True) as reader:
        for name in fields:
            assert (np.asarray(reader.data[name][:3, :length]) == 1).all(), name
    assert verify(str(path)) == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_whole_buffer_reads_refuse_an_unfinished_edit_until_a_writable_open_finishes_it(tmp_path, backend):
    """get_all_data, to_dask and a ConcatReplayBuffer's get_all_data of a read-only open of such
    a buffer raise UnfinishedEditError naming the slots and what finishes the edit (they returned
    the edit half applied, meta values new and rows old, as whole episodes); after the writable
    open, the reader (not refreshed yet: the revisions it loaded are read again) and its
    refresh() read it whole."""
    src = str(tmp_path / "src")
    make_buffer(src, backend)
    kill_inside_update(src, update_values())
    reader = ReplayBuffer.from_folder(src, read_only=True)
    match = r"slots \[0, 2, 3\] hold an in-place edit that a writer stopped part way through.*verify --repair"
    with pytest.raises(UnfinishedEditError, match=match):
        reader.get_all_data()
    with pytest.raises(UnfinishedEditError, match=match):
        reader.to_dask()
    with pytest.raises(UnfinishedEditError, match=r"slots \[4, 6, 7\]"):
        ConcatReplayBuffer([str(make_other(tmp_path, backend)), src]).get_all_data()
    ReplayBuffer.from_folder(src).close()
    for refreshed in (False, True):
        if refreshed:
            reader.refresh()
        data = reader.get_all_data()
        for name in NEW:
            for e in range(EPISODES):
                want = NEW[name] if e in EDITED else 0
                assert (data[name][e].numpy() == want).all(), f"{name!r} of episode {e} (refreshed: {refreshed})"
    reader.close()


def make_other(tmp_path: Path, backend: str) -> Path:
    """A second buffer of EPISODES episodes, untouched."""
    path = tmp_path / "other"
    make_buffer(str(path), backend)
    return path
