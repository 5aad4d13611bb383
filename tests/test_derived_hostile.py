"""The derived read paths (to_dask, get_all_data, to_xarray, stats, ConcatReplayBuffer) attacked:
buffers replaced under a planned read, and statistics of awkward values."""

from __future__ import annotations

import pickle
import shutil
from typing import Any

import fsspec
import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ReplayBuffer
from replaybuf.snapshots import SnapshotError
from replaybuf.storage import BufferReplacedError

pytest_plugins = ["tests._servers"]  # fixtures: s3_server (moto's S3 on 127.0.0.1)

FIELDS = {"x": ("float32", (3,)), "k": "int64"}
META = {"ident": "int"}


def make(location: str, first: int, overwrite: bool = False, **kwargs: Any) -> None:
    """A buffer of three episodes ``first .. first + 2``: episode ``i`` holds ``i`` at every step."""
    with ReplayBuffer(
        location, max_episodes=4, max_timesteps=10, fields=FIELDS, meta_fields=META, overwrite=overwrite, **kwargs
    ) as buffer:
        for index in range(first, first + 3):
            length = index % 10 + 2
            buffer.store_episode(x=np.full((length, 3), index, np.float32), k=np.full(length, index), ident=index)


def delete(location: str, storage_options: dict | None = None) -> None:
    if "://" in location:
        fs, path = fsspec.core.url_to_fs(location, **(storage_options or {}))
        fs.rm(path, recursive=True)
    else:
        shutil.rmtree(location)


READS = {
    "to_dask": lambda reader: reader.to_dask(["k"], [])["k"],
    "lazy get_all_data": lambda reader: reader.get_all_data(["k"], [], lazy=True)["k"],
    "to_xarray": lambda reader: reader.to_xarray(["k"], []).k.data,
}


@pytest.mark.parametrize("how", ["overwrite", "deleted and created"])
@pytest.mark.parametrize("read", list(READS))
def test_a_graph_computed_after_its_buffer_was_replaced_raises(make_location, read, how):
    """A dask graph planned on a buffer, computed after another buffer took its place: zarr on
    disk gave every row as padding (an overwrite counts generations on), and on memory:// (as on
    an object store, where no stat tells) a buffer deleted and created again gave the new
    buffer's episodes under the old plan's meta rows, e.g. ``k`` 100 in the row of ident 0."""
    location, kwargs = make_location()
    make(location, 0, **kwargs)
    reader = ReplayBuffer.from_folder(location, read_only=True)
    graph = READS[read](reader)
    if how == "deleted and created":
        delete(location)
    make(location, 100, overwrite=True, **kwargs)
    with pytest.raises(BufferReplacedError):
        graph.compute()


@pytest.mark.parametrize("exact", [False, True])
def test_reads_of_a_buffer_deleted_and_created_again_raise(make_location, exact):
    """get_all_data and stats of a reader whose buffer was deleted and created again, before its
    next refresh(): on memory:// they returned the new buffer's data (stats: its mean, 101.2)."""
    location, kwargs = make_location()
    make(location, 0, **kwargs)
    reader = ReplayBuffer.from_folder(location, read_only=True)
    delete(location)
    make(location, 100, **kwargs)
    with pytest.raises(BufferReplacedError):
        reader.get_all_data(["k"])
    with pytest.raises(BufferReplacedError):
        reader.stats(["k"], exact=exact)
    np.testing.assert_array_equal(reader.refresh().get_all_data(["k"], ["ident"])["ident"].numpy(), [100, 101, 102])


def test_a_concat_graph_computed_after_an_s3_member_was_deleted_and_created_raises(tmp_path, s3_server):
    """The same through a ConcatReplayBuffer whose member on S3 (moto) was deleted and created
    again: the graph, get_all_data and stats read the new member's episodes, e.g. ``k`` 100 in
    the row of ident 10."""
    first, second, options = str(tmp_path / "a"), s3_server.url(f"derived-{tmp_path.name}"), s3_server.storage_options
    make(first, 0)
    make(second, 10, storage_options=options)
    concat = ConcatReplayBuffer([first, second], storage_options=[{}, options])
    graph = concat.to_dask(["k"], [])["k"]
    delete(second, options)
    make(second, 100, storage_options=options)
    with pytest.raises(BufferReplacedError):
        graph.compute()
    with pytest.raises(BufferReplacedError):
        concat.get_all_data(["k"])
    with pytest.raises(BufferReplacedError):
        concat.stats(["k"])
    assert concat.refresh().get_all_data(["k"], ["ident"])["ident"].tolist() == [0, 1, 2, 100, 101, 102]


def test_members_with_different_defaults_are_refused(tmp_path):
    """A member whose field pads with another default: the concatenation padded its rows with
    buffer 0's (``get_all_data`` of [b, a] gave a's 1-step episode as [1, -1, -1], alone [1])."""
    for name, default in (("a", None), ("b", -1.0), ("c", float("nan")), ("d", float("nan"))):
        with ReplayBuffer(tmp_path / name, max_episodes=2, max_timesteps=3, fields={"x": ("float32", (), default)}):
            pass
    with pytest.raises(ValueError, match=r"buffer 1 \(.*/a'\) field 'x' has default 0, buffer 0 has -1.0"):
        ConcatReplayBuffer([tmp_path / "b", tmp_path / "a"])
    with pytest.raises(ValueError, match="field 'x' has default nan, buffer 0 has 0"):
        ConcatReplayBuffer([tmp_path / "a", tmp_path / "c"])
    assert len(ConcatReplayBuffer([tmp_path / "c", tmp_path / "d"]).buffers) == 2  # NaN pads as NaN


def test_a_concat_loader_unpickled_after_a_member_reused_a_slot_keeps_the_other_members(tmp_path):
    """A dataset over [a, b] sent to a worker (pickled: the worker preloads its resident rows)
    after b's writer reused b's slot 0: the preload's GenerationMismatchError named b's local
    slot 0, so the worker dropped a's intact episode 0 (global slot 0) and never drew it, and
    kept drawing b's reused slot (global 4) to find it reused at each batch; with a
    writer reusing slots fast, every episode of a was dropped and the loader raised
    SnapshotOverwrittenError with a's three episodes intact."""
    make(str(tmp_path / "a"), 0)
    with ReplayBuffer(
        tmp_path / "b", max_episodes=3, max_timesteps=10, fields=FIELDS, meta_fields=META, circular=True
    ) as writer:
        for index in range(10, 13):
            writer.store_episode(x=np.full((2, 3), index, np.float32), k=np.full(2, index), ident=index)
        concat = ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"])
        dataset = concat.dataset(fields=["k"])
        writer.store_episode(x=np.full((2, 3), 13, np.float32), k=np.full(2, 13), ident=13)  # into b's slot 0
    worker = pickle.loads(pickle.dumps(dataset))
    # a's slots 0..3 (3: empty), b's 4..6: b's slot 0 is global slot 4
    np.testing.assert_array_equal(worker.in_snapshot(np.arange(7)), [True, True, True, False, False, True, True])
    for position, ident in enumerate([0, 1, 2]):  # a's episodes, read as they are
        sample = worker[position]
        assert int(sample["ident"]) == ident and sample["k"].tolist() == [ident] * (ident + 2)


@pytest.mark.parametrize(
    ("fields", "meta_fields", "clash"),
    [
        ({"x": "float32"}, {"valid": "int"}, "valid"),  # replaced the valid-step mask with its values
        ({"x": "float32"}, {"slot": "int"}, "slot"),  # replaced the slot coordinate
        ({"x": "float32"}, {"time": "int"}, "time"),  # replaced the time axis's coordinate
        ({"episode": "float32"}, {}, "episode"),  # became a coordinate: no data variable left
        ({"time": "float32"}, {}, "time"),  # xarray: "variables {'time'} are found in both ..."
        ({"x": ("float32", (2,))}, {"x_dim0": "int"}, "x_dim0"),  # a coordinate named as x's axis
    ],
)
def test_to_xarray_refuses_fields_named_as_its_coordinates_or_dims(tmp_path, fields, meta_fields, clash):
    """A field named as one of the Dataset's coordinates or dimensions replaced it silently
    (a meta field ``valid`` became the mask that ``ds.x.where(ds.valid)`` uses) or failed in
    xarray; it is refused naming the field, and the rest converts without it."""
    pytest.importorskip("xarray")
    buffer = ReplayBuffer(tmp_path / "b", max_episodes=3, max_timesteps=4, fields=fields, meta_fields=meta_fields)
    buffer.store_episode(**{n: np.ones((2, *buffer.schema.fields[n].shape), np.float32) for n in fields})
    with pytest.raises(ValueError, match=rf"to_xarray: field names \['{clash}'\] .* coordinates or dimensions"):
        buffer.to_xarray()
    others = [n for n in fields if n != clash]
    ds = buffer.to_xarray(others, [n for n in meta_fields if n != clash])
    assert ds.valid.values.tolist() == [[True, True]] and ds.slot.values.tolist() == [0]


@pytest.fixture
def snapshot_and_whole(tmp_path):
    """A writer on ``a`` (4 slots) with snapshot 's' of its 2 episodes; a whole buffer ``b``;
    a ConcatReplayBuffer of a's view at 's' and b (members at different snapshots)."""
    writer = ReplayBuffer(
        tmp_path / "a",
        max_episodes=4,
        max_timesteps=4,
        fields={"k": "int64"},
        meta_fields=META,
        circular=True,
        drop_snapshots_on_overwrite=True,
    )
    for index in range(2):
        writer.store_episode(k=np.full(2, index + 1), ident=index)
    writer.snapshot("s")
    with ReplayBuffer(tmp_path / "b", max_episodes=2, max_timesteps=4, fields={"k": "int64"}, meta_fields=META) as b:
        b.store_episode(k=np.full(2, 50), ident=50)
    concat = ConcatReplayBuffer([ReplayBuffer.from_folder(tmp_path / "a", snapshot="s"), tmp_path / "b"])
    yield writer, concat
    writer.close()


def test_a_concat_member_at_a_snapshot_never_reads_episodes_outside_it(snapshot_and_whole):
    """An episode the writer added after the snapshot (slot 2): data[...] of the concatenation
    returned it (k 9) where the view alone reads an empty slot."""
    writer, concat = snapshot_and_whole
    writer.store_episode(k=np.full(3, 9), ident=9)
    assert concat.data["k"][:, :2].tolist() == [[1, 1], [2, 2], [0, 0], [0, 0], [50, 50], [0, 0]]
    assert concat.get_all_data(["k"], ["ident"])["ident"].tolist() == [0, 1, 50]


@pytest.mark.parametrize(
    "read",
    [
        lambda concat: concat.get_all_data(["k"]),
        lambda concat: concat.to_dask(["k"], [])["k"].compute(),
        lambda concat: concat.stats(["k"], exact=True),
        lambda concat: concat.data["k"][:],
    ],
    ids=["get_all_data", "to_dask", "stats", "data"],
)
def test_a_concat_member_at_a_snapshot_raises_for_its_episodes_overwritten(snapshot_and_whole, read):
    """A snapshot episode overwritten (its snapshot dropped by the writer): the view alone raises
    SnapshotError, the concatenation read the new episode in its place (get_all_data, data[...]),
    a row of padding (to_dask) or left it out of stats."""
    writer, concat = snapshot_and_whole
    with pytest.warns(UserWarning, match=r"snapshot\(s\) \['s'\] .* dropped"):
        for _ in range(3):  # the third reuses slot 0, recorded in the snapshot
            writer.store_episode(k=np.full(3, 9), ident=9)
    with pytest.raises(SnapshotError, match=r"snapshot 's' of .*a': the recorded episode\(s\) in slot\(s\) \[0\]"):
        read(concat)
