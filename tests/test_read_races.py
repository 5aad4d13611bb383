"""Every read path of a read-only reader, with a writer storing, overwriting and dropping episodes
between the reader's storage calls (in one process, at calls hypothesis chooses): each episode a
read returns is one committed episode whole (rows, length and meta of the same episode), its
padding zero, never rows of another; a slot that keeps changing is the retryable
``ConcurrentWriteError``, never a wrong answer."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaybuf import ConcurrentWriteError, ReplayBuffer
from replaybuf.analysis import get_all_data
from replaybuf.consistency import read_episodes_consistent
from replaybuf.sampling.datasets import (
    ReplayDatasetNStep,
    ReplayDatasetTimestep,
    ReplayDatasetTimeWindow,
    ReplayDatasetTrajectory,
)

from ._workloads import buffer_kwargs, check_episode, episode, episode_length, write_episode

MAX_EPISODES = 3
READS = ("read_rows", "read_spans", "gather", "preload", "read_meta", "read_meta_rows")
# writer actions: store the next episode (whole or step by step), or drop the last one stored
ACTIONS = st.lists(st.sampled_from(["whole", "steps", "drop"]), max_size=3)


class Interleaver:
    """Runs the writer's actions scheduled for the n-th read call of a reader's storage before
    that call: the reader's read paths then meet a writer between any two of their reads."""

    def __init__(self, reader: ReplayBuffer, writer: ReplayBuffer, uids: Iterator[int], schedule: dict):
        self.writer, self.uids, self.schedule, self.calls = writer, uids, schedule, 0
        for name in READS:
            setattr(reader.storage, name, self._interleaved(getattr(reader.storage, name)))

    def _interleaved(self, read: Callable) -> Callable:
        def interleaved(*args, **kwargs):
            for action in self.schedule.get(self.calls, ()):
                self.act(action)
            self.calls += 1
            return read(*args, **kwargs)

        return interleaved

    def act(self, action: str) -> None:
        if action == "drop":
            valid = self.writer.valid_episodes()
            if len(valid):
                self.writer.drop_episodes([int(valid[-1])])
        else:
            write_episode(self.writer, next(self.uids), action)


def check_rows(uids: np.ndarray, lens: np.ndarray, data: dict[str, np.ndarray], what: str, lazy: bool = False) -> None:
    """Row i of every field is episode ``uids[i]`` cut at ``lens[i]``, zero after; a row of
    length 0 is all zero. ``lazy``: a field's row may also be all padding, as a lazy array's
    block reads a slot rewritten since the arrays were planned (their meta stays as planned)."""
    for row, (uid, length) in enumerate(zip(uids.tolist(), lens.tolist())):
        if length == 0:
            assert not any(np.any(values[row]) for values in data.values()), f"{what}: row {row} of length 0 has data"
            continue
        read = {n: v[row] for n, v in data.items() if not (lazy and not np.any(v[row]))}
        check_episode(int(uid), int(length), read)


def numpy(columns: dict) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in columns.items()}


def read_consistent_episodes(reader: ReplayBuffer) -> None:
    got = read_episodes_consistent(reader, reader.refresh().valid_episodes())
    check_rows(got.meta["uid"], got.lens, got.data, "read_episodes_consistent")
    for uid, length in zip(got.meta["uid"].tolist(), got.lens.tolist()):
        assert length == episode_length(uid)


def read_all_data(reader: ReplayBuffer, **kwargs) -> None:
    got = get_all_data(reader.refresh(), **kwargs)
    if kwargs.get("lazy"):
        got = {n: v.compute() for n, v in got.items()}
    got = numpy(got)
    if got:
        fields = {n: got[n] for n in reader.schema.fields}
        check_rows(got["uid"], got["episode_lens"], fields, "get_all_data", lazy=kwargs.get("lazy", False))


def read_data_rows(reader: ReplayBuffer) -> None:
    """``data[name][slots]``, one field at a time: each field's row is one whole episode (told by
    its values) or zero, as stored."""
    slots = np.arange(reader.refresh().max_episodes)
    for name, per_step in (("step", 100), ("obs", 1000)):
        rows = np.asarray(reader.data[name][slots])
        for row in rows:
            if not np.any(row):
                continue
            uid = int(row.reshape(len(row), -1)[0, 0]) // per_step
            check_episode(uid, episode_length(uid), {name: row})


def read_timesteps(reader: ReplayBuffer) -> None:
    dataset = ReplayDatasetTimestep(reader.refresh(), return_indices=True)
    if len(dataset) == 0:
        return
    batch = numpy(dataset.__getitems__(list(range(len(dataset)))).batch)
    for i, (uid, (_, t)) in enumerate(zip(batch["uid"].tolist(), batch["_indices"].tolist())):
        expected = episode(int(uid))
        assert t < len(expected["step"]), f"uid {uid}: step {t} past its length"
        for name in reader.schema.fields:
            np.testing.assert_array_equal(batch[name][i], expected[name][t], err_msg=f"uid {uid} step {t} {name}")


def read_nsteps(reader: ReplayBuffer) -> None:
    dataset = ReplayDatasetNStep(reader.refresh(), n_steps=3, sequence_fields=["obs", "frame"], return_indices=True)
    if len(dataset) == 0:
        return
    batch = numpy(dataset.__getitems__(list(range(len(dataset)))).batch)
    for i, (uid, (_, t), n) in enumerate(zip(batch["uid"].tolist(), batch["_indices"].tolist(), batch["n_step_lens"])):
        expected = episode(int(uid))
        assert 1 <= n and t + n < len(expected["step"]), f"uid {uid}: steps {t} + {n} past its length"
        for name in reader.schema.fields:
            np.testing.assert_array_equal(batch[name][i], expected[name][t], err_msg=f"uid {uid} step {t} {name}")
            np.testing.assert_array_equal(batch[f"next_{name}"][i], expected[name][t + n], err_msg=f"uid {uid} {name}")
        for name in ("obs", "frame"):
            sequence = batch[f"seq_{name}"][i]
            np.testing.assert_array_equal(sequence[:n], expected[name][t : t + n], err_msg=f"uid {uid} seq_{name}")
            assert not np.any(sequence[n:]), f"uid {uid} seq_{name}: data past its {n} steps"


def read_windows(reader: ReplayBuffer) -> None:
    dataset = ReplayDatasetTimeWindow(reader.refresh(), window_length=5, return_indices=True)
    if len(dataset) == 0:
        return
    batch = numpy(dataset.__getitems__(list(range(len(dataset)))).batch)
    for i, (uid, start, n) in enumerate(zip(batch["uid"].tolist(), batch["_start"].tolist(), batch["_lens"].tolist())):
        expected = episode(int(uid))
        assert start + n <= len(expected["step"]), f"uid {uid}: window {start} + {n} past its length"
        for name in reader.schema.fields:
            window = batch[name][i]
            np.testing.assert_array_equal(window[:n], expected[name][start : start + n], err_msg=f"uid {uid} {name}")
            assert not np.any(window[n:]), f"uid {uid} {name}: data past its {n} steps"


def read_trajectories(reader: ReplayBuffer) -> None:
    dataset = ReplayDatasetTrajectory(reader.refresh())
    if len(dataset) == 0:
        return
    batch = numpy(dataset.__getitems__(list(range(len(dataset)))).batch)
    check_rows(batch["uid"], batch["_lens"], {n: batch[n] for n in reader.schema.fields}, "trajectories")


PATHS = {
    "read_episodes_consistent": read_consistent_episodes,
    "get_all_data": read_all_data,
    "get_all_data sync": lambda reader: read_all_data(reader, scheduler="sync"),
    "get_all_data lazy": lambda reader: read_all_data(reader, lazy=True),
    "data[...]": read_data_rows,
    "timestep batch": read_timesteps,
    "n-step batch": read_nsteps,
    "time-window batch": read_windows,
    "trajectory batch": read_trajectories,
}


@pytest.mark.parametrize("path", sorted(PATHS))
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=st.integers(1, 24),
    schedule=st.dictionaries(st.integers(0, 12), ACTIONS, max_size=4),
    storage=st.sampled_from([("zarr", 1 << 20), ("zarr", 0), ("memmap", 0), ("hdf5", 0)]),
)
def test_a_read_beside_a_writer_returns_whole_committed_episodes(tmp_path_factory, path, first, schedule, storage):
    location = str(tmp_path_factory.mktemp("races") / "buffer")
    uids = itertools.count(first)  # consecutive uids: lengths from 1 to 24 steps
    backend, hot_bytes = storage  # a zarr buffer with its hot tier, without, and the raw backends
    writer = ReplayBuffer(location, **buffer_kwargs(MAX_EPISODES, circular=True), backend=backend, hot_bytes=hot_bytes)
    for _ in range(MAX_EPISODES + 1):
        write_episode(writer, next(uids), "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    Interleaver(reader, writer, uids, schedule)
    try:
        PATHS[path](reader)
    except ConcurrentWriteError:
        pass  # a slot rewritten at every retry: the retryable error, never a wrong answer
    except ValueError as error:  # a dataset over a buffer the writer emptied, or left no long episode
        assert path.endswith("batch") and re.search("replay buffer is empty|no episode has at least", str(error)), error
    finally:
        reader.close()
        writer.close()
