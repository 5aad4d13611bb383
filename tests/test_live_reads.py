"""Every read path beside a writer process: each returned episode is one committed episode or
empty, never mixed, and no unnamed error (issue 13, section 1).

A spawned writer wraps a 4-slot circular buffer (``store()`` step by step with a step-log
flush, alternating with ``store_episode``) while this process loops ``refresh()`` and one read
path after another: whole-episode reads, and trajectory, timestep, n-step, time-window and
prioritized batches (a sample's ``step`` names its (uid, t)), on zarr and memmap also through a
second reader with the read cache (``cache='disk'``: loaders, ``get_all_data``, ``warm_cache``
and the cache files it leaves). The zarr writer keeps about one episode of frames hot, so its
compaction runs beside the readers. Episode ``uid`` holds values that are a function of ``uid``
and ``t`` (``tests/_workloads.py``), so every row is checked without asking the writer. Each
backend runs for ``REPLAYBUF_SOAK_SECONDS`` (default 2) and every path at least ``MIN_ROUNDS``
times (a DataLoader with worker processes once).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from replaybuf import ConcatReplayBuffer, ConcurrentWriteError, ReplayBuffer, StorageError, staging
from replaybuf.sampling import ReplayDatasetTimeWindow, SnapshotOverwrittenError
from replaybuf.storage import _local
from replaybuf.viewer.apps import BufferApp

from ._workloads import FIELDS, MAX_TIMESTEPS, buffer_kwargs, check_episode, episode, episode_length, writer_loop

pytest_plugins = ["tests._servers"]

SPAWN = multiprocessing.get_context("spawn")
SOAK_SECONDS = float(os.environ.get("REPLAYBUF_SOAK_SECONDS", "2"))
MIN_ROUNDS = 2
LAST_CALL_S = 30  # the longest a soak reads on for a path that has not checked an episode yet
LAST_ROUNDS = 4  # the fewest rounds it reads on for one (a round over moto on a loaded machine: ~15 s)
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
        for name, values in data.items():  # each field is computed on its own (StalePlanError if rewritten)
            check_row(int(uids[row]), int(lens[row]), {name: values[row]})
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
    try:
        batch = next(iter(loader))
    except SnapshotOverwrittenError:  # the writer reused every slot of the snapshot meanwhile
        return 0
    for row in range(len(batch["uid"])):
        length = int(batch["_lens"][row])
        check_episode(int(batch["uid"][row]), length, {n: batch[n][row].numpy()[:length] for n in FIELDS})
    return len(batch["uid"])


def check_steps(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """(uids, timesteps) of a batch of single steps, after checking that every sample's fields
    are episode uid's at step t and its meta uid's (``step`` holds uid*100 + t)."""
    uids, steps = np.divmod(batch["step"].numpy().astype(np.int64), 100)
    for i, (uid, t) in enumerate(zip(uids.tolist(), steps.tolist())):
        assert t < episode_length(uid), f"step {t} past the end of uid {uid}"
        expected = episode(uid)
        for name in FIELDS:
            if name in batch:
                np.testing.assert_array_equal(batch[name][i].numpy(), expected[name][t], err_msg=f"uid {uid} {name}")
        assert int(batch["uid"][i]) == uid and float(batch["score"][i]) == uid / 4, f"meta of another uid than {uid}"
    return uids, steps


def nothing_to_sample(error: ValueError) -> bool:
    """Whether a loader refused a snapshot with no episode to sample (all being rewritten, or
    only 1-step episodes for n-step transitions)."""
    return "empty" in str(error) or "no episode has at least" in str(error)


def first_batch(reader, **kwargs) -> dict | None:
    """The first batch of ``reader.dataloader(**kwargs)``; None when nothing is committed."""
    if len(reader) == 0:
        return None
    try:
        return next(iter(reader.dataloader(**kwargs)))
    except ValueError as error:
        assert nothing_to_sample(error), error
        return None
    except SnapshotOverwrittenError:  # the writer reused every slot of the snapshot meanwhile
        return None


def read_timesteps(reader) -> int:
    batch = first_batch(reader, batch_size=16, timestep_level=True, shuffle=True, return_indices=True)
    if batch is None:
        return 0
    _, steps = check_steps(batch)
    assert batch["_indices"][:, 1].tolist() == steps.tolist(), "_indices name other steps than the samples'"
    return len(steps)


def read_prioritized(reader) -> int:
    batch = first_batch(
        reader, batch_size=16, timestep_level=True, sampler="prioritized", priority_field="step", num_batches=1
    )
    if batch is None:
        return 0
    _, steps = check_steps(batch)
    assert batch["_indices"][:, 1].tolist() == steps.tolist(), "_indices name other steps than the samples'"
    assert (batch["_weights"] > 0).all() and (batch["_weights"] <= 1 + 1e-6).all()
    return len(steps)


def read_workers(reader) -> int:
    """Timesteps through a DataLoader with two worker processes (once per soak: they are slow to start)."""
    batch = first_batch(reader, batch_size=16, timestep_level=True, shuffle=True, num_workers=2)
    return 0 if batch is None else len(check_steps(batch)[0])


def read_n_step(reader) -> int:
    """n-step transitions: current fields at t, next_ at t + n_step_lens, seq_ from t, zero-padded."""
    n = 3
    batch = first_batch(
        reader,
        batch_size=16,
        n_steps=n,
        current_fields=("step", "obs", "frame"),
        next_fields=("step", "img"),
        sequence_fields=("step", "obs"),
        shuffle=True,
        return_indices=True,
    )
    if batch is None:
        return 0
    uids, steps = check_steps(batch)
    assert batch["_indices"][:, 1].tolist() == steps.tolist(), "_indices name other steps than the samples'"
    for i, (uid, t) in enumerate(zip(uids.tolist(), steps.tolist())):
        actual = min(n, episode_length(uid) - t - 1)
        assert actual >= 1 and int(batch["n_step_lens"][i]) == actual, f"uid {uid} t {t}"
        expected = episode(uid)
        for name in ("step", "img"):
            np.testing.assert_array_equal(batch[f"next_{name}"][i].numpy(), expected[name][t + actual])
        for name in ("step", "obs"):
            sequence = batch[f"seq_{name}"][i].numpy()
            assert len(sequence) == n and not np.any(sequence[actual:]), f"uid {uid} seq_{name} padding"
            np.testing.assert_array_equal(sequence[:actual], expected[name][t : t + actual])
    return len(uids)


def read_time_window(reader) -> int:
    """Random windows of 5 steps: one episode's consecutive steps from ``_start``, zero-padded."""
    width = 5
    if len(reader) == 0:
        return 0
    try:
        dataset = ReplayDatasetTimeWindow(reader, window_length=width, return_indices=True)
    except ValueError as error:
        assert nothing_to_sample(error), error
        return 0
    try:
        batch = next(iter(reader.dataloader(batch_size=8, dataset=dataset, shuffle=True)))
    except SnapshotOverwrittenError:  # the writer reused every slot of the snapshot meanwhile
        return 0
    uids = batch["step"][:, 0].numpy().astype(np.int64) // 100
    for i, uid in enumerate(uids.tolist()):
        start, actual, length = int(batch["_start"][i]), int(batch["_lens"][i]), episode_length(uid)
        assert actual == min(width, length) and 0 <= start <= length - actual, f"uid {uid}: window {start}+{actual}"
        assert bool(batch["_reaches_episode_end"][i]) == (start + actual >= length)
        expected = episode(uid)
        for name in FIELDS:
            window = batch[name][i].numpy()
            assert len(window) == width and not np.any(window[actual:]), f"uid {uid} {name} padding"
            np.testing.assert_array_equal(window[:actual], expected[name][start : start + actual], err_msg=name)
        assert int(batch["uid"][i]) == uid and float(batch["score"][i]) == uid / 4
    return len(uids)


WARM_CHECKED: set[str] = set()  # cache files read_warm_cache checked (published files never change)


def read_warm_cache(reader) -> int:
    """``warm_cache()``, then every cached ``step`` file not checked before holds one whole
    episode, the episode the reader's bookkeeping names for its (slot, generation) when it
    still holds it, and the ``frame`` file of the same key holds that episode's frames."""
    reader.warm_cache(fields=["step", "frame"])
    root = reader.storage.root
    if not os.path.isdir(os.path.join(root, "step")):
        return 0  # nothing committed yet
    generations, uids = reader.generations, reader.meta_data["uid"][:]
    checked = 0
    for entry in os.scandir(os.path.join(root, "step")):
        if not entry.name.endswith(".rows") or entry.path in WARM_CHECKED:
            continue  # a filler's temp file, or checked
        WARM_CHECKED.add(entry.path)
        slot, generation, *_ = (int(part) for part in entry.name.removesuffix(".rows").split("-"))
        steps = np.frombuffer(pathlib.Path(entry.path).read_bytes()[:-4], np.int32)
        uid = int(steps[0]) // 100
        check_episode(uid, len(steps), {"step": steps})
        if generations[slot] == generation:
            assert uids[slot] == uid, f"cache file {entry.name} holds uid {uid}, slot {slot} holds uid {uids[slot]}"
        frames = pathlib.Path(root, "frame", entry.name)
        if frames.exists():
            rows = np.frombuffer(frames.read_bytes()[:-4], np.uint8).reshape(-1, *FIELDS["frame"]["shape"])
            np.testing.assert_array_equal(rows, episode(uid)["frame"], err_msg=f"frames of {entry.name}")
        checked += 1
    return checked


PATHS = {
    "get_all_data": read_get_all_data,
    "to_dask": read_to_dask,
    "stats": read_stats,
    "data_views": read_data_views,
    "episode_frames": read_episode_frames,
    "viewer": read_viewer,
    "concat": read_concat,
    "dataloader": read_dataloader,
    "timesteps": read_timesteps,
    "n_step": read_n_step,
    "time_window": read_time_window,
    "prioritized": read_prioritized,
}
# paths that read whole episodes (the others sample batches)
WHOLE_EPISODE_PATHS = (
    "get_all_data",
    "to_dask",
    "stats",
    "data_views",
    "episode_frames",
    "viewer",
    "concat",
    "dataloader",
)
# paths read once a soak has checked an episode through them (slow to start)
ONCE = {"workers"}
# paths of a second reader opened with the read cache (cache='disk', its own cache_dir)
CACHED_PATHS = {
    "cached_get_all_data": read_get_all_data,
    "cached_trajectories": read_dataloader,
    "cached_timesteps": read_timesteps,
    "cached_n_step": read_n_step,
    "cached_time_window": read_time_window,
    "cached_warm_cache": read_warm_cache,
}


def soak(
    location: str,
    tmp_path,
    backend: str | None = None,
    storage_options: dict | None = None,
    named=ConcurrentWriteError,
    checking: tuple[str, ...] | None = None,
    rounds: int = MIN_ROUNDS,
    paths: dict | None = None,
    cached_paths: dict | None = None,
    writer_options: dict | None = None,
) -> dict:
    """Write with a spawned process and read through every path (``paths``, default ``PATHS``,
    and ``cached_paths`` through a second reader with the read cache); returns per-path counts.
    Errors of the ``named`` types are counted (the next round retries); any other fails. Paths
    ``checking`` (default: all) read on past the soak until each has checked an episode (the
    callers assert it); every path reads at least ``rounds`` times, those of ``ONCE`` until
    they checked an episode. ``writer_options`` go to the writer's open (``hot_bytes``)."""
    kwargs = buffer_kwargs(SLOTS, circular=True)
    ReplayBuffer(location, **kwargs, backend=backend, storage_options=storage_options).close()
    other = ReplayBuffer(
        tmp_path / "other", **buffer_kwargs(2, circular=False), backend=backend, storage_options=storage_options
    )
    for uid in (900, 901):
        other.store_episode(**episode(uid), uid=uid, score=uid / 4)
    other = ReplayBuffer.from_folder(tmp_path / "other", read_only=True)
    stop, pace = SPAWN.Event(), SPAWN.Event()
    writer = SPAWN.Process(
        target=writer_loop,
        args=(
            location,
            list(range(100_000)),
            "mixed",
            {**kwargs, **(writer_options or {})},
            str(tmp_path / "progress"),
        ),
        kwargs={"span_bytes": 256, "storage_options": storage_options, "stop": stop, "pace": pace},
    )
    writer.start()
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=storage_options)
    walks = {name: (path, reader) for name, path in (PATHS if paths is None else paths).items()}
    if cached_paths:
        cached = ReplayBuffer.from_folder(
            location, read_only=True, storage_options=storage_options, cache="disk", cache_dir=tmp_path / "cache"
        )
        walks.update({name: (path, cached) for name, path in cached_paths.items()})
    checking = tuple(walks) if checking is None else checking
    counts = {name: [0, 0] for name in walks}  # [rounds, episodes checked]
    retryable = 0

    def done(name: str) -> bool:
        if name in ONCE:  # until it has checked an episode, within the last call
            return counts[name][0] > 0 and (counts[name][1] > 0 or time.monotonic() >= last_call)
        return counts[name][0] >= rounds

    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "progress").exists() or not (tmp_path / "progress").read_text():
            assert writer.is_alive() and time.monotonic() < deadline, "the writer never committed"
            time.sleep(0.05)
        end = time.monotonic() + SOAK_SECONDS
        # on a loaded machine a path may keep meeting rewrites: past the soak the writer is
        # paced (it writes on, pausing between episodes) and the path reads on (at most
        # LAST_CALL_S more, and LAST_ROUNDS rounds whatever they take) until it has checked an
        # episode, which the callers assert
        last_call, paced_rounds = end + LAST_CALL_S, 0
        while (
            time.monotonic() < end
            or not all(done(name) for name in walks)
            or (
                (time.monotonic() < last_call or paced_rounds < LAST_ROUNDS)
                and min(counts[name][1] for name in checking) == 0
            )
        ):
            if time.monotonic() >= end and min(counts[name][1] for name in checking) == 0:
                pace.set()
                paced_rounds += 1
            for name, (path, source) in walks.items():
                if name in ONCE and counts[name][1]:
                    continue
                try:
                    source.refresh()
                    counts[name][1] += path(source, other) if name == "concat" else path(source)
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
    """Beside a writer whose hot tier holds about one episode of frames (the older ones are
    compacted in the background while the readers read), through the read cache too, and
    through DataLoader workers: forked, they serve the snapshot's episodes from the resident
    copies the loader loaded (elsewhere the writer has reused every slot of a 4-slot snapshot
    by the time they start, and their batches are empty: redrawn from nothing, as documented)."""
    counts = soak(
        str(tmp_path / "buffer"),
        tmp_path,
        paths={**PATHS, "workers": read_workers},
        cached_paths=CACHED_PATHS,
        writer_options={"hot_bytes": 100_000},
    )
    assert all(checked > 0 for _, checked in counts.values()), counts


@pytest.mark.parametrize("copied", [True, False], ids=["checked-copies", "checked-once"])
def test_live_reads_memmap(tmp_path, monkeypatch, copied):
    """``checked-once``: no field has a private checked copy, so every per-step read checks its
    sampled episodes once in the file a writer is rewriting (``EpisodeChecksums.check_once``)."""
    if not copied:
        monkeypatch.setattr(_local, "CHECKED_COPY_BYTES", 0)
    counts = soak(str(tmp_path / "buffer"), tmp_path, backend="memmap", cached_paths=CACHED_PATHS)
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
    # one round of every path is ~8 s over moto beside the writer: one round, then as long as it
    # takes, of the whole-episode paths only (this reader has the read cache, whose batch paths
    # the zarr and memmap soaks walk)
    paths = {name: PATHS[name] for name in WHOLE_EPISODE_PATHS}
    # over moto on a loaded machine, ConcatReplayBuffer's whole-buffer read can meet a rewrite
    # in every round (each a retryable error, which soak allows): the other paths must check
    checking = tuple(name for name in paths if name != "concat")
    counts = soak(
        location, tmp_path, storage_options=s3_server.storage_options, checking=checking, rounds=1, paths=paths
    )
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


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
def test_a_refresh_finding_a_live_writer_between_a_drops_two_writes_reads_the_slot_as_empty(tmp_path, backend):
    """A drop (as a reuse) zeroes a slot's generation, then its length. A reader whose re-reads
    all fell in between (an hdf5 flush on a loaded machine) raised BufferDamagedError ("a lost
    or zeroed _generation chunk") beside a writer that was only slower than them. With the
    writer running the slot reads as empty; with no writer left, it is damage."""
    from replaybuf.storage import BufferDamagedError

    location = tmp_path / "buffer"
    writer = ReplayBuffer(location, max_episodes=3, max_timesteps=4, fields={"x": "float"}, backend=backend)
    for value in (1.0, 2.0, 3.0):
        writer.store_episode(x=np.full(2, value))
    writer.flush()
    reader = ReplayBuffer.from_folder(location, read_only=True)
    writer._commit.write_meta("_generation", np.array([1]), np.zeros(1, np.int64))  # a drop's first write
    reader.refresh()
    assert reader.valid_episodes().tolist() == [0, 2]
    assert reader.get_all_data()["x"][:, :2].tolist() == [[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]]
    writer.close()  # stopped there: the length without its generation stays
    with pytest.raises(BufferDamagedError, match=r"committed slots \[1\] have generation 0"):
        reader.refresh()


def test_a_reader_lists_an_episode_stored_after_a_dropped_one_while_the_counters_wait(tmp_path, monkeypatch):
    """A reader catches the counters it loads up with episodes published since (the writer
    batches them, ``COUNTERS_INTERVAL``): it lists the slots up to the highest holding an episode,
    as a writable open does, never hiding the episode stored after a dropped slot."""
    monkeypatch.setattr("replaybuf.commit.COUNTERS_INTERVAL", 3600.0)  # the counters wait
    writer = ReplayBuffer(tmp_path / "b", 3, 4, fields={"x": "float"}, circular=True)
    writer.store_episode(x=np.ones(2))
    writer.drop_episodes([0])
    writer.store_episode(x=np.full(3, 2.0))
    reader = ReplayBuffer.from_folder(tmp_path / "b", read_only=True)
    assert reader.listed_slots().tolist() == [0, 1] and reader.valid_episodes().tolist() == [1]
    data = reader.get_all_data()
    assert data["episode_lens"].tolist() == [0, 3]
    np.testing.assert_array_equal(data["x"][1].numpy(), np.full(3, 2.0))
    writer.close()
