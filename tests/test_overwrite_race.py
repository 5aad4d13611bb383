"""A reader never mixes two buffers' rows when another process creates a new buffer over the
one it reads (``overwrite=True``), clears it or drops episodes (memmap, uncompressed hdf5, zarr).

Generations count on across an overwrite, so a generation a reader planned never names an
episode of the new buffer; a reader whose buffer was replaced raises ``BufferReplacedError``
(retryable) instead of returning rows, and its ``refresh()`` opens the new buffer when the
config is the same. Episode ``uid`` of incarnation ``inc`` holds ``1000 * inc + uid`` in every
step (and as meta ``key``), so every row and batch is checked without asking the writer.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
import uuid

import numpy as np
import pytest

from replaybuf import BufferReplacedError, ConcurrentWriteError, ReplayBuffer
from replaybuf.sampling import SnapshotOverwrittenError

pytest_plugins = ["tests._servers"]

SPAWN = multiprocessing.get_context("spawn")
BACKENDS = ["memmap", "hdf5", "zarr"]
SLOTS, STEPS = 6, 12
FIELDS = {"obs": ("float", (2,))}
META = {"key": "int"}
INCARNATIONS = 3


def length(uid: int) -> int:
    return 1 + uid % STEPS


def episode(inc: int, uid: int) -> np.ndarray:
    """(length, 2): ``[1000 * inc + uid, t]`` at step t."""
    t = np.arange(length(uid))
    return np.stack([np.full(len(t), 1000 * inc + uid), t], 1).astype(np.float32)


def create(path, backend: str, inc: int, **config) -> ReplayBuffer:
    """Incarnation ``inc`` of the buffer at ``path`` (created over what is there), ``SLOTS`` episodes."""
    buffer = ReplayBuffer(
        str(path), config.pop("max_episodes", SLOTS), STEPS, FIELDS, META, circular=True, backend=backend, **config
    )
    for uid in range(SLOTS):
        buffer.store_episode(obs=episode(inc, uid), key=1000 * inc + uid)
    return buffer


def check_rows(obs: np.ndarray, lens: np.ndarray, keys: np.ndarray) -> set[int]:
    """Assert each row (obs (n, T, 2)) is one whole stored episode, or padding where its length
    is 0; return the incarnations the rows came from."""
    incarnations = set()
    for row, (n, key) in enumerate(zip(lens.tolist(), keys.tolist())):
        if n == 0:
            assert not obs[row].any(), f"row {row} of length 0 holds data"
            continue
        inc, uid = divmod(int(key), 1000)
        assert n == length(uid), f"row {row}: length {n}, episode {key} has {length(uid)}"
        np.testing.assert_array_equal(obs[row, :n], episode(inc, uid), err_msg=f"row {row} is not episode {key}")
        assert not obs[row, n:].any(), f"row {row}: data past its length"
        incarnations.add(inc)
    return incarnations


def read_all_paths(reader: ReplayBuffer) -> set[int]:
    """One timestep batch, one trajectory batch and ``get_all_data``, each checked and each
    wholly from one incarnation; returns the incarnations read."""
    seen = set()
    timesteps = reader.dataset(timestep_level=True)
    batch = timesteps.__getitems__(list(range(len(timesteps)))).batch
    obs, keys = batch["obs"].numpy(), batch["key"].numpy()
    assert (obs[:, 0] == keys).all(), "a timestep's meta belongs to another episode"
    assert all(t < length(int(k) % 1000) for k, t in zip(keys, obs[:, 1])), "a step past its episode's length"
    assert len(set((keys // 1000).tolist())) <= 1, f"a timestep batch mixes buffers {set((keys // 1000).tolist())}"
    seen |= set((keys // 1000).tolist())
    trajectories = reader.dataset(return_episode_lens=True)
    batch = trajectories.__getitems__(list(range(len(trajectories)))).batch
    read = check_rows(batch["obs"].numpy(), batch["_lens"].numpy(), batch["key"].numpy())
    assert len(read) <= 1, f"a trajectory batch mixes buffers {read}"
    seen |= read
    data = reader.get_all_data()
    if data:
        read = check_rows(data["obs"].numpy(), data["episode_lens"].numpy(), data["key"].numpy())
        assert len(read) <= 1, f"get_all_data mixes buffers {read}"
        seen |= read
    return seen


def overwrite_loop(path: str, backend: str, seen, done) -> None:
    """Create incarnations 1 .. INCARNATIONS over each other; within each, clear() and store
    again, then drop a slot. Before the next one, wait (bounded) until the reader read this one."""
    for inc in range(1, INCARNATIONS + 1):
        buffer = create(path, backend, inc)
        buffer.clear()
        for uid in range(SLOTS):
            buffer.store_episode(obs=episode(inc, uid), key=1000 * inc + uid)
        buffer.drop_episodes([inc % SLOTS])
        buffer.close()
        deadline = time.monotonic() + 60
        while seen.value < inc and time.monotonic() < deadline:
            time.sleep(0.005)
    done.set()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_never_mixes_buffers_while_another_process_overwrites(tmp_path, backend):
    path = str(tmp_path / "buffer")
    create(path, backend, 0).close()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    assert read_all_paths(reader) == {0}
    # the writer is forked (no second torch import) but beside an hdf5 reader: HDF5's library
    # state, this reader's open file among it, is not the child's to inherit
    context = SPAWN if backend == "hdf5" else multiprocessing.get_context("fork")
    seen, done = context.Value("i", 0), context.Event()
    writer = context.Process(target=overwrite_loop, args=(path, backend, seen, done))
    writer.start()
    read, replaced = set(), 0
    try:
        while not done.is_set():
            try:
                reader.refresh()
                got = read_all_paths(reader)
            except BufferReplacedError:
                replaced += 1
                continue
            except ValueError as error:  # a dataset of a buffer that is empty just now
                assert "empty" in str(error)
                continue
            except SnapshotOverwrittenError:  # a dataset whose episodes were all cleared meanwhile
                continue
            read |= got
            seen.value = max([seen.value, *got])
            assert writer.is_alive() or done.is_set(), "the writer died"
    finally:
        writer.join(60)
    assert writer.exitcode == 0
    assert {1, INCARNATIONS} <= read, f"the reader read incarnations {sorted(read)} only"
    reader.refresh()
    assert read_all_paths(reader) == {INCARNATIONS}
    assert int(reader.generations.min()) == 0  # the slot dropped last
    assert int(reader.generations.max()) > SLOTS * 2 * INCARNATIONS  # counted on across every overwrite


@pytest.mark.parametrize("backend", BACKENDS)
def test_generations_count_on_across_an_overwrite(tmp_path, backend):
    path = tmp_path / "buffer"
    first = create(path, backend, 1)
    first.clear()
    first.store_episode(obs=episode(1, 0), key=1000)
    assert first.generations.max() == SLOTS + 1
    first.close()
    second = create(path, backend, 2)  # overwrite=True, the default
    np.testing.assert_array_equal(second.generations, SLOTS + 1 + np.arange(1, SLOTS + 1))
    second.close()
    reopened = ReplayBuffer.from_folder(path)
    reopened.store_episode(obs=episode(2, 0), key=2000)
    assert reopened.generations.max() == 2 * SLOTS + 2
    reopened.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overwrite_of_a_buffer_it_cannot_read_counts_from_the_clock(tmp_path, backend):
    path = tmp_path / "buffer"
    create(path, backend, 1).close()
    (path / "replaybuf" / "state.json").write_text("{damaged")
    before = time.time_ns() // 1000
    buffer = create(path, backend, 2)
    assert int(buffer.generations.min()) > before  # above any generation a buffer here counted
    assert read_all_paths(buffer) == {2}
    buffer.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replaced_buffer_raises_and_refresh_opens_the_new_one(tmp_path, backend):
    path = tmp_path / "buffer"
    create(path, backend, 1).close()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    old_dataset = reader.dataset(timestep_level=True)
    create(path, backend, 2).close()  # another writer object: the reader holds no lease
    stale_batch(old_dataset, backend)
    for read in (reader.get_all_data, lambda: np.asarray(reader.data["obs"][:])):
        with pytest.raises(BufferReplacedError, match="replaced by another process") as raised:
            read()
        assert isinstance(raised.value, ConcurrentWriteError)  # retryable, as its base says
    reader.refresh()
    assert read_all_paths(reader) == {2}
    stale_batch(old_dataset, backend)  # planned in the buffer that is gone: never the new one's rows


def stale_batch(dataset, backend: str) -> None:
    """A dataset made before its buffer was replaced raises BufferReplacedError; zarr may serve
    the old buffer's episodes whole from the copies in RAM it verified, or none (one buffer, never two)."""
    try:
        batch = dataset.__getitems__([0, 1, 2]).batch
    except BufferReplacedError:
        return
    assert backend == "zarr", "a memmap or hdf5 reader checks its files at every read"
    keys = batch["key"].numpy()
    assert set((keys // 1000).tolist()) <= {1} and (batch["obs"].numpy()[:, 0] == keys).all()


@pytest.mark.parametrize("slots", [SLOTS + 2, SLOTS - 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_buffer_replaced_by_another_config_is_refused_at_every_read(tmp_path, backend, slots):
    path = tmp_path / "buffer"
    create(path, backend, 1).close()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    create(path, backend, 2, max_episodes=slots).close()
    with pytest.raises(BufferReplacedError, match="max_episodes"):
        reader.refresh()
    with pytest.raises(BufferReplacedError):
        reader.get_all_data()
    # zarr: fewer slots' meta chunks failed to decode, reported as damage (CorruptChunkError)
    with pytest.raises(BufferReplacedError):
        reader.data["obs"][:, 0]
    with pytest.raises(BufferReplacedError):
        reader.stats()
    with pytest.raises(BufferReplacedError, match="max_episodes"):
        reader.refresh()  # and stays so: the reader never reads the other buffer
    assert reader.max_episodes == SLOTS


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_snapshot_view_of_a_replaced_buffer_is_refused(tmp_path, backend):
    path = tmp_path / "buffer"
    first = create(path, backend, 1)
    first.snapshot("eval")
    first.close()
    view = ReplayBuffer.from_folder(path, snapshot="eval")
    with pytest.warns(UserWarning, match="eval"):
        create(path, backend, 2, drop_snapshots_on_overwrite=True).close()
    with pytest.raises(BufferReplacedError, match="snapshot 'eval'"):
        view.refresh()


def test_a_replaced_zarr_buffer_reads_as_replaced_before_anything_is_erased(tmp_path):
    path = tmp_path / "buffer"
    create(path, "zarr", 1).close()
    reader = ReplayBuffer.from_folder(path, read_only=True)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["replacing"] = True  # what an overwrite writes first
    (path / "zarr.json").write_text(json.dumps(root))
    assert reader.storage.replaced()
    with pytest.raises(BufferReplacedError, match="being replaced"):
        reader.refresh()


def test_a_replaced_buffer_on_s3_raises_and_refresh_opens_the_new_one(s3_server):
    """The same on an object store, behind the read cache (a reader's default there), which may
    serve the old buffer's episodes it holds, whole, until the next refresh."""
    location, options = s3_server.url(f"replaced/{uuid.uuid4().hex[:12]}"), s3_server.storage_options
    create(location, "zarr", 1, storage_options=options).close()
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=options)
    create(location, "zarr", 2, storage_options=options).close()
    try:
        data = reader.get_all_data()
    except BufferReplacedError:
        pass
    else:
        assert check_rows(data["obs"].numpy(), data["episode_lens"].numpy(), data["key"].numpy()) <= {1}
    reader.refresh()
    data = reader.get_all_data()
    assert check_rows(data["obs"].numpy(), data["episode_lens"].numpy(), data["key"].numpy()) == {2}
    assert int(reader.generations.min()) > SLOTS


def concat_rows(concat) -> set[int]:
    """The incarnations of ``get_all_data``'s rows and of one trajectory batch, each row checked whole."""
    data = concat.get_all_data()
    seen = check_rows(data["obs"].numpy(), data["episode_lens"].numpy(), data["key"].numpy())
    dataset = concat.dataset(return_episode_lens=True)
    batch = dataset.__getitems__(list(range(len(dataset)))).batch
    return seen | check_rows(batch["obs"].numpy(), batch["_lens"].numpy(), batch["key"].numpy())


def stale_member_rows(dataset, backend: str) -> None:
    """Member b's episodes (items ``SLOTS..``) from a trajectory dataset made before b was
    replaced: BufferReplacedError, or (zarr) b's old episodes whole or others redrawn, never b's new ones."""
    try:
        batch = dataset.__getitems__(list(range(SLOTS, 2 * SLOTS))).batch
    except BufferReplacedError:
        return
    assert backend == "zarr", "a memmap or hdf5 reader checks its files at every read"
    assert check_rows(batch["obs"].numpy(), batch["_lens"].numpy(), batch["key"].numpy()) <= {1, 5}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_concat_refresh_reopens_a_replaced_member_and_names_one_of_another_config(tmp_path, backend):
    from replaybuf import ConcatReplayBuffer
    from replaybuf.viewer import BufferApp
    from replaybuf.viewer.apps import EpisodeVersion

    create(tmp_path / "a", backend, 5).close()
    create(tmp_path / "b", backend, 1).close()
    concat = ConcatReplayBuffer([tmp_path / "a", tmp_path / "b"])
    old_dataset, old_storage = concat.dataset(return_episode_lens=True), concat.storage
    app = BufferApp(concat)
    app.image_fields = ["obs"]  # a video's cache key (this buffer has no image field)
    old_key = app._video_path(SLOTS, EpisodeVersion(1, 0, app._reopened), "obs")
    create(tmp_path / "b", backend, 2).close()  # overwrite=True by another writer object
    assert concat.storage.replaced()
    with pytest.raises(BufferReplacedError, match="replaced by another process"):
        concat.get_all_data()  # planned on member b's old episodes: nothing returned
    stale_member_rows(old_dataset, backend)
    assert concat_rows(concat.refresh()) == {5, 2}
    assert concat.storage is not old_storage and not concat.storage.replaced()
    stale_member_rows(old_dataset, backend)  # planned before the refresh: never the new member's rows
    assert (
        app.episodes()["num_episodes"] == 2 * SLOTS
        and app._video_path(SLOTS, EpisodeVersion(1, 0, app._reopened), "obs") != old_key
    )
    app.close()

    create(tmp_path / "b", backend, 3, max_episodes=SLOTS + 2).close()
    for _ in range(2):  # and stays so: the concatenation never reads the other buffer
        with pytest.raises(BufferReplacedError, match=r"b' was replaced .*member 1: .*max_episodes") as raised:
            concat.refresh()
        assert raised.value.location == str(tmp_path / "b")
        with pytest.raises(BufferReplacedError):
            concat.get_all_data()
    assert concat.max_episodes == 2 * SLOTS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("concat", [False, True], ids=["buffer", "concat"])
def test_datasets_planned_before_a_buffer_was_deleted_and_created_again_never_read_the_new_one(
    tmp_path, backend, concat
):
    """Deleted first, the new buffer counts generations from 1 again: the old plans' generations
    name its episodes (zarr returned their rows cut to the old episodes' lengths)."""
    from replaybuf import ConcatReplayBuffer

    path = tmp_path / "buffer"
    create(path, backend, 1).close()
    reader = ConcatReplayBuffer([path]) if concat else ReplayBuffer.from_folder(path, read_only=True)
    old = [reader.dataset(return_episode_lens=True), reader.dataset(timestep_level=True), reader.dataset(n_steps=2)]
    shutil.rmtree(path)
    again = ReplayBuffer(str(path), SLOTS, STEPS, FIELDS, META, circular=True, backend=backend)
    for uid in range(SLOTS, 2 * SLOTS):  # other lengths than incarnation 1's episodes
        again.store_episode(obs=episode(2, uid), key=2000 + uid)
    again.close()
    with pytest.raises(BufferReplacedError):
        reader.get_all_data()
    assert int(reader.refresh().generations.max()) == SLOTS  # the same generations again
    for dataset in old:
        with pytest.raises(BufferReplacedError):
            dataset.__getitems__(list(range(SLOTS)))
    assert read_all_paths(reader) == {2}
