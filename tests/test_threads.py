"""One ReplayBuffer object shared by threads of one process: an actor thread storing while a
learner thread reads, updates priorities or closes it, or two actor threads storing.

Each test holds one thread inside a storage write (or read) of the object, at a fixed point,
until another thread's call has run or, when that call rightly waits for the object's lock, for
at most ``WAIT_S`` (what is asserted never depends on how long anything took: a waiting call
that returned early, or a call that ran inside the other's write, is what fails).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from replaybuf import BufferLockedError, ConcatReplayBuffer, ReplayBuffer
from replaybuf.analysis import get_all_data  # torch and dask, imported at collection
from replaybuf.maintenance import verify
from replaybuf.sampling import make_dataloader

T = 6
WAIT_S = 0.5


def steps(e: int, length: int = 4) -> dict[str, np.ndarray]:
    """Episode ``e``'s rows: every value names the episode and the step, whatever its slot."""
    t = np.arange(length)
    return {
        "obs": np.stack([np.full(length, e), t, e * 1000 + t], 1).astype(np.float32),
        "act": np.stack([np.full(length, e), t], 1),
    }


def make(place, max_episodes: int, circular: bool = False) -> ReplayBuffer:
    return ReplayBuffer(
        place.location,
        max_episodes=max_episodes,
        max_timesteps=T,
        fields={"obs": ("float", (3,)), "act": ("int", (2,)), "priority": ("float", (), 1.0)},
        meta_fields={"ep": "int"},
        circular=circular,
        **place.kwargs,
    )


def held_inside(buffer: ReplayBuffer, name: str, until: threading.Event) -> threading.Event:
    """Make the first write of data field ``name``'s rows through ``buffer`` (``write_rows``,
    or ``write_tail_rows``: zarr writes a short episode at its commit) wait, once written,
    until ``until`` is set (at most ``WAIT_S``). Returns the event set once that write is held."""
    inside = threading.Event()
    for method in ("write_rows", "write_tail_rows"):
        original: Callable[..., Any] = getattr(buffer.storage, method)

        def held(field: str, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            result = _original(field, *args, **kwargs)
            if field == name and not inside.is_set():
                inside.set()
                until.wait(WAIT_S)
            return result

        setattr(buffer.storage, method, held)
    return inside


def run(target: Callable[[], Any], errors: list) -> threading.Thread:
    def call() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def committed(location: str, backend_kwargs: dict) -> dict[int, dict[str, np.ndarray]]:
    """Every committed episode by its ``ep``, read back by a new reader, each checked whole."""
    reader = ReplayBuffer.from_folder(location, read_only=True, **backend_kwargs)
    data = reader.get_all_data()
    found: dict[int, dict[str, np.ndarray]] = {}
    for row, (length, e) in enumerate(zip(np.asarray(data["episode_lens"]), np.asarray(data["ep"]))):
        if length:
            assert int(e) not in found, f"episode {int(e)} is stored twice"
            found[int(e)] = {n: np.asarray(data[n])[row, :length] for n in ("obs", "act")}
    reader.close()
    return found


def store_from_two_threads(first: ReplayBuffer, second: ReplayBuffer) -> None:
    """Episode 1 stored through ``first`` in one thread, held inside its write of "obs" until
    episode 2, stored through ``second`` in another thread, is done; no thread may raise."""
    second_done, errors = threading.Event(), []
    inside = held_inside(first, "obs", second_done)
    one = run(lambda: first.store_episode(**steps(1), ep=1), errors)
    assert inside.wait(30)
    two = run(lambda: (second.store_episode(**steps(2), ep=2), second_done.set()), errors)
    one.join(), two.join()
    assert not errors, errors


def test_two_threads_store_whole_episodes_each_once(place):
    """Two actor threads storing whole episodes into one object: the second waits for the
    first's commit (before: both took the same slot, one episode was lost and the slot's meta
    checksum failed at the next open)."""
    buffer = make(place, 4)
    store_from_two_threads(buffer, buffer)
    buffer.close()
    found = committed(place.location, place.kwargs)
    assert sorted(found) == [1, 2]
    for e, rows in found.items():
        assert all(np.array_equal(rows[n], steps(e)[n]) for n in rows), f"episode {e} is torn"
    assert verify(place.location) == []


def test_two_opens_of_one_buffer_in_two_threads_store_each_episode_once(place):
    """Two writable objects of one buffer in one process (``from_folder`` beside the first, as
    the seed's README does: they share the writer lease) storing from two threads: the second
    waits for the first's commit (before: each object held only its own lock, so both took
    the same slot and counters, and episodes whose ``store_episode`` returned were lost)."""
    buffer = make(place, 4)
    again = ReplayBuffer.from_folder(place.location, **place.kwargs)
    store_from_two_threads(buffer, again)
    buffer.close(), again.close()
    found = committed(place.location, place.kwargs)
    assert sorted(found) == [1, 2]
    for e, rows in found.items():
        assert all(np.array_equal(rows[n], steps(e)[n]) for n in rows), f"episode {e} is torn"
    assert verify(place.location) == []


def refresh_inside_first_read(
    reader: ReplayBuffer, writer: ReplayBuffer, monkeypatch, errors: list, refreshing: Any = None
) -> threading.Event:
    """Make the first use of ``reader``'s hdf5 file (a read) commit episode 3 through ``writer``
    and refresh ``refreshing`` (default: ``reader``) from another thread, waiting for that
    refresh (at most ``WAIT_S``: it rightly waits for the read) before the read goes on.
    Returns the event set once refreshed."""
    refreshed, calls = threading.Event(), []
    cls = type(reader.storage)
    h5file = cls.h5file

    def held(storage: Any) -> Any:  # the read holds the file: another thread refreshes now
        file = h5file.fget(storage)
        if storage is reader.storage and not calls:
            calls.append(1)
            writer.store_episode(**steps(3), ep=3)
            run(lambda: ((refreshing or reader).refresh(), refreshed.set()), errors)
            refreshed.wait(WAIT_S)
        return file

    monkeypatch.setattr(cls, "h5file", property(held))
    return refreshed


def two_episodes_and_a_reader(place) -> tuple[ReplayBuffer, ReplayBuffer]:
    """A writer holding episodes 1 and 2, and a read-only object of its buffer."""
    writer = make(place, 4)
    for e in (1, 2):
        writer.store_episode(**steps(e), ep=e)
    return writer, ReplayBuffer.from_folder(place.location, read_only=True, **place.kwargs)


@pytest.mark.parametrize("backend", ["hdf5"])
def test_a_refresh_of_another_thread_waits_for_a_readers_read(place, monkeypatch):
    """A read-only hdf5 object read by one thread and refreshed by another: the refresh closes
    the file the read uses, so it waits for the read (before: h5py raised RuntimeError or
    KeyError, "identifier is not of specified type", from data[...], get_all_data and
    loader batches)."""
    writer, reader = two_episodes_and_a_reader(place)
    errors: list = []
    refreshed = refresh_inside_first_read(reader, writer, monkeypatch, errors)
    rows = np.asarray(reader.data["obs"][0:2])
    assert refreshed.wait(30)
    assert not errors, errors
    assert all(np.array_equal(rows[e - 1, :4], steps(e)["obs"]) for e in (1, 2))
    writer.close()


@pytest.mark.parametrize("backend", ["hdf5"])
@pytest.mark.parametrize("read", ["to_dask", "stats", "exact stats", "episode_frames"])
def test_a_refresh_of_another_thread_waits_for_reads_through_the_storage(place, monkeypatch, read):
    """As above for the reads that go through the storage alone: a ``to_dask`` block computed
    on dask's worker threads, ``stats()`` (sketched from the data, or ``exact``) and
    ``episode_frames`` (its bookkeeping read) each hold the reader's lock through their read
    (before: the refresh closed the file under them, and
    h5py raised KeyError or RuntimeError, "invalid identifier type")."""
    writer, reader = two_episodes_and_a_reader(place)
    errors: list = []
    refreshed = refresh_inside_first_read(reader, writer, monkeypatch, errors)
    if read == "to_dask":
        obs = reader.to_dask(["obs"])["obs"].compute(scheduler="threads")
        assert np.array_equal(obs[:, :4], np.stack([steps(e)["obs"] for e in (1, 2)]))
    elif read == "episode_frames":
        assert np.array_equal(reader.episode_frames(1, "obs"), steps(2)["obs"])
    else:
        summary = reader.stats(["obs"], exact=read == "exact stats")
        assert summary.num_episodes == 2  # as planned before the refresh
        every = np.concatenate([steps(e)["obs"] for e in (1, 2)])
        assert np.allclose(summary.fields["obs"].mean.numpy(), every.mean(axis=0))
    assert refreshed.wait(30)
    assert not errors, errors
    writer.close()


@pytest.mark.parametrize("backend", ["hdf5"])
def test_a_concat_refresh_of_another_thread_waits_for_its_read(place, monkeypatch):
    """A ConcatReplayBuffer of hdf5 readers read by one thread and refreshed by another: its
    refresh (which refreshes the members, closing their files) waits for the read (before:
    every read path, get_all_data, data[...], to_dask, stats and loaders, raised h5py's
    KeyError or RuntimeError, "invalid identifier type")."""
    writer, reader = two_episodes_and_a_reader(place)
    concat = ConcatReplayBuffer([reader])
    errors: list = []
    refreshed = refresh_inside_first_read(reader, writer, monkeypatch, errors, refreshing=concat)
    data = concat.get_all_data(fields=["obs"], meta_fields=["ep"])
    assert refreshed.wait(30)
    assert not errors, errors
    assert np.asarray(data["ep"]).tolist() == [1, 2]  # as planned before the refresh
    assert np.array_equal(np.asarray(data["obs"])[:, :4], np.stack([steps(e)["obs"] for e in (1, 2)]))
    assert len(concat) == 3
    writer.close()


@pytest.mark.parametrize("backend", ["hdf5"])
def test_get_all_data_of_an_hdf5_reader_on_a_thread_pool_scheduler_returns(place):
    """get_all_data of an hdf5 reader on a scheduler of this process's threads that is not
    dask's own (a ``ThreadPoolExecutor``: computed as dask blocks) holds the reader's lock
    through the read, so its blocks take none (a block waiting for it on a worker thread
    would wait forever)."""
    from concurrent.futures import ThreadPoolExecutor

    writer, reader = two_episodes_and_a_reader(place)
    writer.close()
    pool, found = ThreadPoolExecutor(2), []
    reading = threading.Thread(target=lambda: found.append(get_all_data(reader, scheduler=pool)), daemon=True)
    reading.start()
    reading.join(30)
    pool.shutdown(wait=False)  # a pool waiting for itself is left behind, not waited for
    assert not reading.is_alive(), "get_all_data waits for itself"
    assert np.array_equal(np.asarray(found[0]["obs"])[:, :4], np.stack([steps(e)["obs"] for e in (1, 2)]))


def test_reads_of_another_thread_never_see_a_commit_half_done(place):
    """A learner thread reading the writer object while an actor thread reuses a circular slot:
    ``data[...]`` and ``get_all_data`` return each slot's rows of one whole episode (before:
    ``data`` returned the new episode's obs beside the old one's act, or memmap and hdf5 raised
    EpisodeLengthError, as damage)."""
    buffer = make(place, 2, circular=True)
    for e in (1, 2):
        buffer.store_episode(**steps(e, 3 + e), ep=e)
    read_done, errors, seen = threading.Event(), [], []
    inside = held_inside(buffer, "obs", read_done)  # obs written, act not yet
    actor = run(lambda: buffer.store_episode(**steps(3, 5), ep=3), errors)  # into slot 0, episode 1's

    def read() -> None:
        obs, act = buffer.data["obs"][0], buffer.data["act"][0]
        data = buffer.get_all_data()
        seen.append((obs, act, data))
        read_done.set()

    assert inside.wait(30)
    learner = run(read, errors)
    actor.join(), learner.join()
    assert not errors, errors
    obs, act, data = seen[0]
    episode = int(obs[0, 0])
    length = 5 if episode == 3 else 4
    assert episode in (1, 3) and np.array_equal(obs[:length], steps(episode, length)["obs"])
    assert np.array_equal(act[:length], steps(episode, length)["act"]), f"obs of episode {episode}, act of another"
    for row, (n, e) in enumerate(zip(np.asarray(data["episode_lens"]), np.asarray(data["ep"]))):
        if n:
            assert np.array_equal(np.asarray(data["obs"])[row, :n], steps(int(e), int(n))["obs"])
            assert np.array_equal(np.asarray(data["act"])[row, :n], steps(int(e), int(n))["act"])
    buffer.close()
    assert sorted(committed(place.location, place.kwargs)) == [2, 3]


def test_update_priorities_beside_a_commit_in_another_thread(place):
    """The learner thread's ``update_priorities`` of a batch's pairs, beside the actor thread
    reusing their slot: the pairs are checked against the slot's episode and written as one
    call, the commit before or after it (before: the commit could land between the check and
    the write, which then gave the new episode the old one's priorities)."""
    buffer = make(place, 2, circular=True)
    for e in (1, 2):
        buffer.store_episode(**steps(e), ep=e)
    generations = np.asarray(buffer.generations)[[0, 0]].copy()
    stored, errors, written = threading.Event(), [], []
    inside = threading.Event()
    original = buffer.update_steps

    def held(*args: Any, **kwargs: Any) -> Any:  # the pairs checked, not yet written
        inside.set()
        stored.wait(WAIT_S)
        return original(*args, **kwargs)

    buffer.update_steps = held  # type: ignore[method-assign]
    learner = run(
        lambda: written.append(
            buffer.update_priorities(np.array([[0, 1], [0, 2]]), np.array([5.0, 6.0]), generations=generations)
        ),
        errors,
    )
    assert inside.wait(30)
    actor = run(lambda: (buffer.store_episode(**steps(3), ep=3), stored.set()), errors)  # into slot 0
    actor.join(), learner.join()
    assert not errors, errors
    assert written == [2]
    del buffer.update_steps
    buffer.close()
    assert verify(place.location) == []
    found = committed(place.location, place.kwargs)
    assert sorted(found) == [2, 3]
    assert all(np.array_equal(found[3][n], steps(3)[n]) for n in ("obs", "act"))
    reader = ReplayBuffer.from_folder(place.location, read_only=True, **place.kwargs)
    assert np.array_equal(reader.data["priority"][0, :4], np.ones(4, np.float32)), "the edit was of episode 1"


def test_close_waits_for_a_read_in_another_thread(place):
    """``close()`` from one thread while another reads the object (``get_all_data``, a loader's
    batch): the close waits for the read (before: hdf5 closed the file under it and the read
    failed inside h5py)."""
    buffer = make(place, 4)
    for e in (1, 2, 3):
        buffer.store_episode(**steps(e), ep=e)
    closed, errors, during = threading.Event(), [], []
    original = buffer.storage.read_spans
    inside = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        if not inside.is_set():
            inside.set()
            closed.wait(WAIT_S)
            during.append(closed.is_set())
        return original(*args, **kwargs)

    buffer.storage.read_spans = held  # type: ignore[method-assign]
    learner = run(buffer.get_all_data, errors)  # one consistent read, as a loader's batch is
    assert inside.wait(30)
    closer = run(lambda: (buffer.close(), closed.set()), errors)
    learner.join(), closer.join()
    assert not errors, errors
    assert during == [False], "close() returned while another thread's read was under way"
    assert sorted(committed(place.location, place.kwargs)) == [1, 2, 3]


def test_episode_in_progress_belongs_to_its_thread(place):
    """Steps stored through one object by two threads would make one episode of both: a call
    of another thread that stores into, commits or discards the episode in progress is refused
    with BufferLockedError, leaving it as it was (before: the steps were mixed, or
    store_episode discarded the other thread's steps)."""
    buffer = make(place, 4)
    begun, tried, errors, refused = threading.Event(), threading.Event(), [], []

    def actor() -> None:
        with buffer.one_episode(ep=1):
            for t in range(2):
                buffer.store(**{n: v[t] for n, v in steps(1).items()})
            begun.set()
            assert tried.wait(30)
            for t in range(2, 4):
                buffer.store(**{n: v[t] for n, v in steps(1).items()})

    def other() -> None:
        calls = {
            "store": lambda: buffer.store(**{n: v[0] for n, v in steps(2).items()}),
            "store_episode": lambda: buffer.store_episode(**steps(2), ep=2),
            "advance_episode": buffer.advance_episode,
            "clear": buffer.clear,
            "one_episode": lambda: buffer.one_episode(ep=2).__enter__(),
        }
        for name, call in calls.items():
            with pytest.raises(BufferLockedError, match="another thread has an episode in progress"):
                call()
            refused.append(name)
        tried.set()

    first = run(actor, errors)
    assert begun.wait(30)
    second = run(other, errors)
    first.join(), second.join()
    assert not errors, errors
    assert len(refused) == 5
    buffer.store_episode(**steps(2), ep=2)  # once it ended, any thread stores
    buffer.close()
    found = committed(place.location, place.kwargs)
    assert sorted(found) == [1, 2]
    assert all(np.array_equal(found[1][n], steps(1)[n]) for n in ("obs", "act"))


def test_steps_handed_from_thread_to_thread_without_a_block_make_one_episode(place):
    """An executor's threads taking turns (each step on whichever thread is free) extend the
    episode in progress, as one thread's steps would; only a whole episode stored by another
    thread meanwhile, which would discard them, is refused."""
    from concurrent.futures import ThreadPoolExecutor

    buffer = make(place, 4)
    pools = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
    rows = steps(1)
    for t in range(4):
        pools[t % 2].submit(buffer.store, **{n: v[t] for n, v in rows.items()}).result()
    with pytest.raises(BufferLockedError, match="another thread has an episode in progress"):
        pools[1].submit(buffer.store_episode, **steps(2), ep=2).result()  # pools[0] began it
    pools[1].submit(buffer.advance_episode).result()
    for pool in pools:
        pool.shutdown()
    buffer.close()
    found = committed(place.location, place.kwargs)
    assert list(found) == [0] and all(np.array_equal(found[0][n], rows[n]) for n in ("obs", "act"))


def test_forked_loader_workers_read_while_a_thread_holds_the_lock(place):
    """DataLoader workers forked while another thread of the parent writes (holding the
    object's lock) read their batches: each child makes its own lock, as the thread holding the
    parent's does not run there."""
    if place.name == "memory":
        pytest.skip("fork workers of a memory:// store are covered in test_sampling")
    buffer = make(place, 4)
    for e in (1, 2, 3):
        buffer.store_episode(**steps(e), ep=e)
    loader = make_dataloader(buffer, 3, num_workers=1, multiprocessing_context="fork", timeout=60)
    held, release, errors = threading.Event(), threading.Event(), []

    def hold() -> None:
        with buffer._lock:
            held.set()
            release.wait(120)

    holder = run(hold, errors)
    assert held.wait(30)
    try:
        batches = list(loader)
    finally:
        release.set()
        holder.join()
    assert not errors, errors
    assert sorted(np.asarray(batches[0]["ep"]).tolist()) == [1, 2, 3]


def test_a_plan_never_straddles_a_refresh_of_another_thread(place):
    """A read-only object sampled by one thread and refreshed by another: a loader's plan copies
    lengths and generations of one refresh (before: a refresh landing between the two copies
    paired a slot's old length with its new episode's generation, whose rows then came back
    with the old episode's length)."""
    writer = make(place, 2, circular=True)
    for e in (1, 2):
        writer.store_episode(**steps(e, 5), ep=e)
    reader = ReplayBuffer.from_folder(place.location, read_only=True, **place.kwargs)
    refreshed, errors = threading.Event(), []
    original = reader._committed
    calls = []

    def planning() -> Any:  # the loader's plan copied the lengths, now the generations
        caller, plan = sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name
        if not calls and (caller, plan) == ("generations", "take_snapshot"):
            calls.append(1)
            writer.store_episode(**steps(3, 2), ep=3)  # into slot 0, episode 1's
            run(lambda: (reader.refresh(), refreshed.set()), errors)
            refreshed.wait(WAIT_S)
        return original()

    reader._committed = planning  # type: ignore[method-assign]
    batches = list(make_dataloader(reader, 2))
    del reader._committed
    assert not errors, errors
    assert calls, "the plan was reached"
    for batch in batches:
        for row, (n, e) in enumerate(zip(np.asarray(batch["_lens"]), np.asarray(batch["ep"]))):
            length = {1: 5, 2: 5, 3: 2}[int(e)]
            assert n == length, f"episode {int(e)} read with {int(n)} steps, it has {length}"
            assert np.array_equal(np.asarray(batch["obs"])[row, :n], steps(int(e), length)["obs"])
    writer.close()


@pytest.mark.parametrize("timestep_level", [False, True])
def test_a_forked_loader_worker_of_the_writer_never_serves_a_slot_reused_since_the_fork(place, timestep_level):
    """A DataLoader worker forked from the writer holds the writer's bookkeeping as of the fork,
    while the writer goes on committing: it checks its reads against what is stored, so a slot
    reused after the fork is never served as its planned episode (memmap and hdf5 served the
    new episode's rows under the old one's meta values)."""
    if place.name == "memory":
        pytest.skip("a memory:// store is not shared with a forked worker")
    import multiprocessing

    buffer = make(place, 2, circular=True)
    for e in (1, 2):
        buffer.store_episode(**steps(e), ep=e)
    reused = multiprocessing.get_context("fork").Event()
    loader = make_dataloader(
        buffer,
        16,
        timestep_level=timestep_level,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=lambda _: reused.wait(60),
        timeout=60,
    )
    batches = iter(loader)  # forks the worker, which waits in worker_init_fn
    buffer.store_episode(**steps(3), ep=3)  # into episode 1's slot
    reused.set()
    batch = next(batches)
    episode, obs = np.asarray(batch["ep"]), np.asarray(batch["obs"])
    rows = obs[:, None, 0] if timestep_level else obs[:, :4, 0]  # every row names its episode
    assert len(episode) and (rows == episode[:, None]).all()  # zarr may serve episode 1 kept whole
    del batches
    buffer.close()
