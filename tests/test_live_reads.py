"""Every read path beside a writer process: each returned episode is one committed episode or
empty, never mixed, and no unnamed error (issue 13, section 1).

A spawned writer wraps a 4-slot circular buffer (``store()`` step by step with a step-log
flush, alternating with ``store_episode``) while this process loops ``refresh()`` and one read
path after another. Episode ``uid`` holds values that are a function of ``uid`` and ``t``
(``tests/_workloads.py``), so every row is checked without asking the writer. Each backend runs
for ``REPLAYBUF_SOAK_SECONDS`` (default 2) and every path at least ``MIN_ROUNDS`` times.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ConcurrentWriteError, ReplayBuffer, StorageError, staging
from replaybuf.viewer.apps import BufferApp

from ._workloads import FIELDS, MAX_TIMESTEPS, buffer_kwargs, check_episode, episode, episode_length, writer_loop

pytest_plugins = ["tests._servers"]

SPAWN = multiprocessing.get_context("spawn")
SOAK_SECONDS = float(os.environ.get("REPLAYBUF_SOAK_SECONDS", "2"))
MIN_ROUNDS = 2
LAST_CALL_S = 30  # the longest a soak reads on for a path that has not checked an episode yet
SLOTS = 4


def check_row(uid: int, length: int, rows: dict[str, np.ndarray]) -> str:
    """'empty' for a row of zeros with length 0, else 'episode' after checking it is episode
    ``uid`` whole (zero beyond its length)."""
    if length == 0:
        for name, values in rows.items():
            assert not np.any(values), f"row of length 0 holds data in {name!r}"
        return "empty"
    check_episode(uid, length, rows)
    return "episode"


def uid_from_step(row: np.ndarray) -> tuple[int, int]:
    """(uid, length) of a ``step`` row, (-1, 0) for an empty one: step t of uid is uid*100 + t."""
    if not np.any(row) and row[0] == 0:
        return -1, 0
    uid = int(row[0]) // 100
    return uid, episode_length(uid)


# ---- the read paths: each returns how many episodes it checked -----------------------------


def read_get_all_data(reader, concat_with=None) -> int:
    source = reader if concat_with is None else ConcatReplayBuffer([reader, concat_with])
    data = source.get_all_data()
    slots = source.listed_slots()
    assert len(data["episode_lens"]) == len(slots), "one row per slot 0 .. num_episodes - 1"
    for row in range(len(slots)):
        rows = {n: data[n][row].numpy() for n in FIELDS}
        length = int(data["episode_lens"][row])
        if check_row(int(data["uid"][row]), length, rows) == "episode":
            assert float(data["score"][row]) == int(data["uid"][row]) / 4
    return len(slots)


def read_concat(reader, other) -> int:
    return read_get_all_data(reader, concat_with=other)


def read_to_dask(reader) -> int:
    arrays = reader.to_dask()
    lens, uids = arrays["episode_lens"].compute(), arrays["uid"].compute()
    data = {n: arrays[n].compute() for n in FIELDS}
    for row in range(len(lens)):
        for name, values in data.items():  # each field is computed on its own
            dropped = not np.any(values[row])  # the slot was rewritten before this compute
            check_row(int(uids[row]), 0 if dropped else int(lens[row]), {name: values[row]})
    return len(lens)


def read_stats(reader) -> int:
    try:
        stats = reader.stats(["step"])
    except ValueError as error:
        assert "no committed episodes" in str(error)
        return 0
    lens = stats.episode_lens.numpy().astype(np.int64)
    sums = stats.episode_sums["step"].numpy()
    for length, total in zip(lens, sums):
        uid, rest = divmod(int(total) - length * (length - 1) // 2, 100 * int(length))
        assert rest == 0 and episode_length(uid) == length, f"episode sum {total} over {length} steps is mixed"
    assert stats["step"].count == lens.sum()
    return len(lens)


def read_data_views(reader) -> int:
    steps = np.asarray(reader.data["step"][:])
    obs = np.asarray(reader.data["obs"][:, :, 0])
    assert obs.shape == (SLOTS, MAX_TIMESTEPS) and reader.data["obs"].shape == (SLOTS, MAX_TIMESTEPS, 3)
    for row in range(SLOTS):
        uid, length = uid_from_step(steps[row])
        check_row(uid, length, {"step": steps[row]})
        if np.any(obs[row]):
            uid, length = int(obs[row, 0]) // 1000, episode_length(int(obs[row, 0]) // 1000)
            np.testing.assert_array_equal(obs[row, :length], episode(uid)["obs"][:, 0], err_msg=f"slot {row} obs")
            assert not np.any(obs[row, length:])
    slot = int(np.random.default_rng().integers(SLOTS))
    frames = reader.data["frame"][slot]
    uid, length = uid_from_step(reader.data["step"][slot])  # another read: may be another episode
    assert frames.shape == (MAX_TIMESTEPS, 32, 32, 4) and frames.dtype == np.uint8
    return SLOTS + 1


def read_episode_frames(reader) -> int:
    checked = 0
    for slot in range(reader.num_episodes):
        try:
            frames = reader.episode_frames(slot, "frame")
        except ValueError as error:
            assert "empty (length 0) or being rewritten" in str(error)
            continue
        key = int(frames[0, 0, 0, 0])  # (uid * 17) % 256: 17 is invertible mod 256
        residue = key * pow(17, -1, 256) % 256
        matches = [
            uid
            for uid in range(residue, 100_000, 256)
            if episode_length(uid) == len(frames) and np.array_equal(frames, episode(uid)["frame"])
        ]
        assert matches, f"slot {slot}: frames of no single episode"
        checked += 1
    return checked


def read_viewer(reader) -> int:
    app = BufferApp(reader)
    try:
        listing = app.episodes()
        for length, uid in zip(listing["lengths"], listing["meta"]["uid"]):
            assert length in (0, episode_length(uid)), f"listed length {length} is not uid {uid}'s"
        for slot in range(listing["num_episodes"]):
            answer = app.episode(slot)
            rows = {n: np.asarray(answer["series"][n], dtype=FIELDS[n]["dtype"]) for n in ("obs", "step")}
            if answer["length"]:
                check_episode(answer["meta"]["uid"], answer["length"], rows)
                assert answer["meta"]["score"] == answer["meta"]["uid"] / 4
        return listing["num_episodes"]
    finally:
        app.close()


def read_dataloader(reader) -> int:
    if len(reader) == 0:
        return 0
    try:
        loader = reader.dataloader(batch_size=4, shuffle=True, return_indices=True)
    except ValueError as error:
        assert "empty" in str(error)
        return 0
    batch = next(iter(loader))
    for row in range(len(batch["uid"])):
        length = int(batch["_lens"][row])
        check_episode(int(batch["uid"][row]), length, {n: batch[n][row].numpy()[:length] for n in FIELDS})
    return len(batch["uid"])


PATHS = {
    "get_all_data": read_get_all_data,
    "to_dask": read_to_dask,
    "stats": read_stats,
    "data_views": read_data_views,
    "episode_frames": read_episode_frames,
    "viewer": read_viewer,
    "concat": read_concat,
    "dataloader": read_dataloader,
}


def soak(
    location: str,
    tmp_path,
    backend: str | None = None,
    storage_options: dict | None = None,
    named=ConcurrentWriteError,
    checking: tuple[str, ...] = tuple(PATHS),
    rounds: int = MIN_ROUNDS,
) -> dict:
    """Write with a spawned process and read through every path; returns per-path counts.
    Errors of the ``named`` types are counted (the next round retries); any other fails. Paths
    ``checking`` read on past the soak until each has checked an episode (the callers assert it);
    every path reads at least ``rounds`` times."""
    kwargs = buffer_kwargs(SLOTS, circular=True)
    ReplayBuffer(location, **kwargs, backend=backend, storage_options=storage_options).close()
    other = ReplayBuffer(
        tmp_path / "other", **buffer_kwargs(2, circular=False), backend=backend, storage_options=storage_options
    )
    for uid in (900, 901):
        other.store_episode(**episode(uid), uid=uid, score=uid / 4)
    other = ReplayBuffer.from_folder(tmp_path / "other", read_only=True)
    stop = SPAWN.Event()
    writer = SPAWN.Process(
        target=writer_loop,
        args=(location, list(range(100_000)), "mixed", kwargs, str(tmp_path / "progress")),
        kwargs={"span_bytes": 256, "storage_options": storage_options, "stop": stop},
    )
    writer.start()
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=storage_options)
    counts = {name: [0, 0] for name in PATHS}  # [rounds, episodes checked]
    retryable = 0
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "progress").exists() or not (tmp_path / "progress").read_text():
            assert writer.is_alive() and time.monotonic() < deadline, "the writer never committed"
            time.sleep(0.05)
        end = time.monotonic() + SOAK_SECONDS
        # on a loaded machine a path may keep meeting rewrites: it reads on (at most
        # LAST_CALL_S more) until it has checked an episode, which the callers assert
        last_call = end + LAST_CALL_S
        while (
            time.monotonic() < end
            or min(c[0] for c in counts.values()) < rounds
            or (time.monotonic() < last_call and min(counts[name][1] for name in checking) == 0)
        ):
            for name, path in PATHS.items():
                try:
                    reader.refresh()
                    counts[name][1] += path(reader, other) if name == "concat" else path(reader)
                except named:  # named and retryable: the next round retries
                    retryable += 1
                counts[name][0] += 1
            assert writer.is_alive(), "the writer died"
    finally:
        stop.set()
        writer.join(60)
    assert writer.exitcode == 0
    committed = len((tmp_path / "progress").read_text().split())
    assert committed > SLOTS, f"the writer wrapped the buffer only {committed} episodes in"
    if named is ConcurrentWriteError:
        assert retryable <= sum(c[0] for c in counts.values()) // 2, "most reads gave up"
    return counts


def test_live_reads_zarr(tmp_path):
    counts = soak(str(tmp_path / "buffer"), tmp_path)
    assert all(checked > 0 for _, checked in counts.values()), counts


def test_live_reads_memmap(tmp_path):
    counts = soak(str(tmp_path / "buffer"), tmp_path, backend="memmap")
    assert all(checked > 0 for _, checked in counts.values()), counts


def test_live_reads_hdf5_uncompressed(tmp_path):
    """No SWMR: an uncompressed data.h5 keeps every dataset in place, so generation-checked
    reads beside a writer process see committed episodes only."""
    counts = soak(str(tmp_path / "buffer"), tmp_path, backend="hdf5")
    assert all(checked > 0 for _, checked in counts.values()), counts


def hold_open(location: str, opened, release) -> None:
    """Child-process body: open the hdf5 buffer for writing, store one episode, wait."""
    buffer = ReplayBuffer(location, **buffer_kwargs(SLOTS, circular=True), overwrite=False)
    buffer.store_episode(**episode(5), uid=5, score=5 / 4)
    opened.set()
    release.wait(60)
    buffer.close()


def test_hdf5_compressed_refuses_a_reader_beside_a_live_writer(tmp_path):
    """No SWMR: a compressed data.h5's chunks move under a reader in another process (stale
    reads, wrong bytes), so a read-only open or refresh beside a live writer is refused by name;
    after the writer closes it opens, and a writer in the reader's own process is no obstacle."""
    location = str(tmp_path / "buffer")
    options = {"compression": "gzip"}
    writer = ReplayBuffer(location, **buffer_kwargs(SLOTS, circular=True), backend="hdf5", storage_options=options)
    assert len(ReplayBuffer.from_folder(location, read_only=True)) == 0  # same process: shares the writer's file
    writer.close()
    reader = ReplayBuffer.from_folder(location, read_only=True)
    opened, release = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=hold_open, args=(location, opened, release))
    child.start()
    try:
        assert opened.wait(60)
        message = "compressed and open for writing by another process.*without SWMR"
        with pytest.raises(StorageError, match=message):
            ReplayBuffer.from_folder(location, read_only=True)
        with pytest.raises(StorageError, match=message):
            reader.refresh()
        with pytest.raises(StorageError, match=message):
            reader.data["step"][0]
    finally:
        release.set()
        child.join(60)
    assert child.exitcode == 0
    # after the writer closed, a reader opens and reads what it committed; in a new process, as
    # HDF5 keeps serving this process the file's metadata from before the other writer changed it
    # while any object of the file is alive (the readers above): a known limit, see the README
    script = (
        "import json\nfrom replaybuf import ReplayBuffer\n"
        f"data = ReplayBuffer.from_folder({location!r}, read_only=True).get_all_data()\n"
        "print(json.dumps([data['uid'].tolist(), int(data['episode_lens'][0]), data['step'][0].tolist()]))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    uids, length, steps = json.loads(result.stdout.strip().splitlines()[-1])
    assert uids == [5] and check_row(5, length, {"step": np.asarray(steps)})


def test_live_reads_s3(s3_server, tmp_path):
    location = s3_server.url(f"live/{uuid.uuid4().hex[:12]}")
    # over moto on a loaded machine, ConcatReplayBuffer's whole-buffer read can meet a rewrite
    # in every round (each a retryable error, which soak allows): the other paths must check
    checking = tuple(name for name in PATHS if name != "concat")
    # one round of every path is ~8 s over moto beside the writer: one round, then as long as it takes
    counts = soak(location, tmp_path, storage_options=s3_server.storage_options, checking=checking, rounds=1)
    assert all(counts[name][1] > 0 for name in checking), counts


def test_get_all_data_keeps_row_i_for_slot_i_after_a_killed_writer(tmp_path, monkeypatch):
    """A writer killed while rewriting slot 1 leaves it empty inside 0 .. num_episodes - 1: its
    row is zeros with length 0 and later rows do not shift (issue 14; the seed returns rows for
    slots 0 .. num_episodes - 1)."""
    location = tmp_path / "buffer"
    monkeypatch.setattr(staging, "WRITE_SPAN_BYTES", 256)  # slabs are written at the first step
    writer = ReplayBuffer(location, **buffer_kwargs(3, circular=True))
    for uid in range(4):  # uid 3 wraps into slot 0
        writer.store_episode(**episode(uid), uid=uid, score=uid / 4)
    for t in range(20):  # a whole write span: slot 1 is invalidated and written ...
        writer.store(**{n: values[t] for n, values in episode(7).items()})
    writer.flush()  # ... and the writer "killed" here, before its episode is committed
    for reader in (ReplayBuffer.from_folder(location, read_only=True), writer):
        assert reader.num_episodes == 3 and reader.episode_lens.tolist() == [episode_length(3), 0, episode_length(2)]
        data = reader.get_all_data()
        assert data["episode_lens"].tolist() == reader.episode_lens.tolist()
        assert data["uid"].tolist() == [3, 0, 2], "row i is slot i"
        for row, uid in ((0, 3), (1, -1), (2, 2)):
            length = int(data["episode_lens"][row])
            check_row(uid, length, {n: data[n][row].numpy() for n in FIELDS})
        lazy = reader.get_all_data(lazy=True)
        for name in (*FIELDS, "uid", "episode_lens"):
            np.testing.assert_array_equal(lazy[name].compute(), data[name].numpy(), err_msg=name)
        concat = ConcatReplayBuffer([reader, reader]).get_all_data(fields=["step"], meta_fields=["uid"])
        assert concat["uid"].tolist() == [3, 0, 2, 3, 0, 2]


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_data_views_index_as_numpy_on_readers_and_writers(tmp_path, backend):
    """``data[name][key]`` keeps numpy's semantics (slices, steps, negative and repeated
    indices, masks, several index arrays) on a writer and on a read-only reader, whose reads
    go through the consistent read; an empty slot reads as zeros, writes through a reader's
    view are refused."""
    writer = ReplayBuffer(tmp_path / "b", **buffer_kwargs(5, circular=True), backend=backend)
    for uid in (1, 2, 3):
        writer.store_episode(**episode(uid), uid=uid, score=uid / 4)
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    raw = np.asarray(writer.storage.read_rows("obs", np.arange(5), 0, MAX_TIMESTEPS))
    keys = [
        np.s_[:],
        np.s_[:, :, 0],
        np.s_[1],
        np.s_[1, 2],
        np.s_[[2, 0, 2]],
        np.s_[[2, 0], [1, 3]],
        np.s_[::-1, ::-2],
        np.s_[1:3, 4:1:-1, 1:],
        np.s_[..., 1],
        np.s_[np.array([True, False, True, False, False])],
        np.s_[-1, -1],
        np.s_[:, [0, 2]],
        np.s_[:0],
        np.s_[[0], np.zeros(MAX_TIMESTEPS, bool)],
    ]
    for view in (writer.data["obs"], reader.data["obs"]):
        for key in keys:
            np.testing.assert_array_equal(view[key], raw[key], err_msg=str(key))
            assert view[key].shape == raw[key].shape
    with pytest.raises(IndexError):
        reader.data["obs"][np.array([True, False]), np.zeros(3, bool)]
    with pytest.raises(ValueError, match="read-only"):
        reader.data["obs"][0, 0] = 1.0
    writer.data["obs"][4, 0] = 7.0  # a write through the view reaches the store ...
    assert writer.storage.read_rows("obs", np.array([4]), 0, 1)[0, 0, 0] == 7.0
    assert not reader.data["obs"][4].any(), "... but slot 4 holds no episode: a reader sees zeros"


@pytest.mark.parametrize("where", ["zarr", "memmap", "memory", "s3"])
def test_in_place_edits_reach_resident_copies_and_the_writers_loaders(tmp_path, where, request):
    """An edit of committed rows reaches a reader holding the field in RAM once it refreshes, and
    the writer's own later reads and DataLoaders (workers included) at once."""
    from replaybuf.sampling import make_dataloader

    options: dict = {}
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        location, options = s3.url(f"edits-{uuid.uuid4().hex}"), {"storage_options": s3.storage_options}
    elif where == "memory":
        location = f"memory://edits-{uuid.uuid4().hex}"
    else:
        location, options = str(tmp_path / "buffer"), {"backend": where}
    writer = ReplayBuffer(location, max_episodes=4, max_timesteps=5, fields={"step": ("int", 2)}, **options)
    for uid in range(3):
        writer.store_episode(step=np.full((5, 2), uid))
    writer.flush()
    reader = ReplayBuffer.from_folder(location, read_only=True, cache=False, **options)

    def sampled(buffer, **kwargs) -> set[int]:
        loader = make_dataloader(buffer, batch_size=5, timestep_level=True, **kwargs)
        return {int(v) for batch in loader for v in batch["step"].reshape(-1)}

    assert sampled(reader) == sampled(writer) == {0, 1, 2}  # loaded into RAM where resident
    writer.update([1], step=np.full((1, 5, 2), 7))
    writer.store_datapoint(2, 4, "step", np.full(2, 8))
    assert sampled(writer) == {0, 2, 7, 8} and writer.data["step"][2, 4].tolist() == [8, 8]
    reader.refresh()
    assert sampled(reader) == {0, 2, 7, 8} and reader.data["step"][1, 0].tolist() == [7, 7]
    if where == "zarr":  # forked workers start from the writer's copy in RAM
        assert sampled(writer, num_workers=2) == {0, 2, 7, 8}
    writer.close()
