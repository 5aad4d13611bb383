"""A reader process sees what a writer process commits, and never a half-written episode."""

from __future__ import annotations

import multiprocessing
import uuid

import numpy as np
import pytest
import torch

from replaybuf import ConcurrentWriteError, ReplayBuffer
from replaybuf.consistency import committed_generations, read_consistent, read_episodes_consistent, stored_bookkeeping

from ._workloads import buffer_kwargs, check_episode, episode, episode_length, write_episode, writer_loop

pytest_plugins = ["tests._servers"]

FORK = multiprocessing.get_context("fork")
READ_ROUNDS = 25


@pytest.fixture
def location(tmp_path):
    return str(tmp_path / "buffer")


def start_writer(location, kwargs, uids, progress, storage_options=None):
    stop = FORK.Event()
    writer = FORK.Process(
        target=writer_loop,
        args=(location, uids, "mixed", kwargs, str(progress)),
        kwargs={"span_bytes": 256, "storage_options": storage_options, "stop": stop},
    )
    writer.start()
    return writer, stop


def committed(progress) -> list[int]:
    return [int(line) for line in progress.read_text().split()]


def verify(got) -> list[int]:
    """Check every episode of a ConsistentEpisodes; return their uids."""
    uids = got.meta["uid"].tolist()
    for row, uid in enumerate(uids):
        check_episode(uid, int(got.lens[row]), {n: v[row] for n, v in got.data.items()})
        assert got.meta["score"][row] == uid / 4
    assert len(set(uids)) == len(uids), f"an episode appears twice: {sorted(uids)}"
    return uids


def test_refresh_sees_new_commits(location):
    kwargs = buffer_kwargs(8, circular=False)
    writer = ReplayBuffer(location, **kwargs)
    reader = ReplayBuffer.from_folder(location, read_only=True)
    assert len(reader) == 0
    write_episode(writer, 3, "steps")
    assert len(reader) == 0, "a reader's view changes only on refresh()"
    assert len(reader.refresh()) == 1 and reader.num_episodes == 1
    got = read_episodes_consistent(reader, reader.valid_episodes())
    assert verify(got) == [3]


def test_episode_in_progress_is_invisible(location):
    writer = ReplayBuffer(location, **buffer_kwargs(8, circular=True, flush_every_store_step=1))
    write_episode(writer, 1, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    with writer.one_episode(uid=2):
        for t in range(5):
            writer.store(step=t)
        writer.flush()
        assert reader.refresh().valid_episodes().tolist() == [0]
    assert reader.refresh().valid_episodes().tolist() == [0, 1]


def test_refresh_pairs_lengths_with_meta_under_a_concurrent_commit(location):
    """A commit landing in the middle of refresh() must not pair one episode's length with
    another's meta fields (deterministic interleaving of the race the live tests can hit)."""
    writer = ReplayBuffer(location, **buffer_kwargs(4, circular=True))
    for uid in range(4):
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_meta, calls = reader.storage.read_meta, []

    def commit_after_first_read(name):
        value = read_meta(name)
        calls.append(name)
        if len(calls) == 1:
            write_episode(writer, 9, "whole")  # reuses slot 0
        return value

    reader.storage.read_meta = commit_after_first_read
    reader.refresh()
    for slot in reader.valid_episodes():
        uid = int(reader.meta_data["uid"][slot])
        assert reader.episode_lens[slot] == episode_length(uid), f"slot {slot}: length of another episode"


def test_consistent_read_refuses_slots_that_are_not_ints_and_a_string_of_fields(location):
    writer = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    for uid in (1, 2):
        write_episode(writer, uid, "whole")
    for slots in ([0.5], [True], ["x"], None):  # 0.5 and True were cast to slots 0 and 1 and read
        with pytest.raises(TypeError, match=r"read_episodes_consistent: slots must be episode indices \(ints\)"):
            read_episodes_consistent(writer, slots)
    with pytest.raises(TypeError, match="fields must be a sequence of field names, got the string"):
        read_episodes_consistent(writer, [0], "obs")  # its letters were taken as field names
    assert read_episodes_consistent(writer, np.array([1], np.uint8)).slots.tolist() == [1]
    for steps in ({"t0": 0.5}, {"t1": 2.5}, {"t0": "1"}, {"t0": True}):  # True was step 1
        with pytest.raises(TypeError, match=r"read_episodes_consistent: t[01] must be an int step"):
            read_episodes_consistent(writer, [0], **steps)
    with pytest.raises(TypeError, match="generations must be ints, got"):
        read_episodes_consistent(writer, [0], generations=[1.5])  # read as generation 1
    assert read_episodes_consistent(writer, []).slots.tolist() == []


def test_consistent_read_rereads_a_slot_reused_during_the_read(location):
    writer = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    for uid in (1, 2):
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_rows, calls = reader.storage.read_rows, []

    def overwrite_during_first_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        calls.append(list(episodes))
        if len(calls) == 1:
            write_episode(writer, 3, "whole")  # reuses slot 0 after its data was read
        return rows

    reader.storage.read_rows = overwrite_during_first_read
    got = read_episodes_consistent(reader, [0, 1])
    assert got.slots.tolist() == [0, 1] and got.dropped.tolist() == []
    assert verify(got) == [3, 2], "slot 0 is read again as the episode it holds now"
    storage = reader.storage
    if storage.verifies_reads(reader.fieldnames):
        # resident fields: a field read after the write found slot 0 reused (its rows are
        # checked when loaded), so the read is repeated whole; slot 1 then comes from RAM:
        # each field loaded slots 0 and 1 once, and slot 0 at most once more
        loads = [storage.array(n).resident_rows_read for n in reader.fieldnames]
        assert len(calls) > 2 and all(2 <= n <= 3 for n in loads) and 3 in loads, loads
    else:
        assert calls[-1] == [0], "only the slot that changed is read again"


def test_a_slot_read_again_narrower_keeps_no_rows_of_its_earlier_episode(location):
    """A slot re-read with a narrower read than before, then widened by another slot re-read
    after it: the first slot's rows past the narrower read are zero, not its earlier episode's."""
    writer = ReplayBuffer(location, **buffer_kwargs(3, circular=True))
    for uid in (0, 1, 2, 4, 3):  # slot 0 holds uid 4 (24 steps), slot 1 uid 3, slot 2 uid 2
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_rows, widths = reader.storage.read_rows, []
    rewrites = {1: (25, 26), 2: (27, 13)}  # after a read: slots 2 and 0 (3 and 2 steps), then 1 and 2 (15)

    def rewrite_after_each_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        if name == list(reader.schema.fields)[-1]:
            widths.append((list(map(int, episodes)), t1))
            for uid in rewrites.get(len(widths), ()):
                write_episode(writer, uid, "whole")
        return rows

    reader.storage.read_rows = rewrite_after_each_read
    got = read_episodes_consistent(reader, [0, 1, 2])
    assert widths == [([0, 1, 2], 24), ([0, 2], 3), ([2], 15)]
    assert sorted(verify(got)) == [3, 13, 26], "slot 0's rows 3..14 are uid 26's padding, not uid 4's steps"


def test_a_data_view_row_is_one_episode_as_stored_through_rewrites_and_a_drop_between_reads(location):
    """``reader.data[name][...]`` beside a writer that rewrites slots 0 and 1 after the first
    read (slot 0 24 steps -> 12) and drops slot 1 after the second: row 0 is the new episode
    (zero past it, as stored), row 1 zeros, row 2 its episode read first; never a mix."""
    writer = ReplayBuffer(location, **buffer_kwargs(3, circular=True))
    for uid in (4, 5, 6):  # 24, 23 and 22 steps
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_rows, reads = reader.storage.read_rows, []

    def rewrite_after_each_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        reads.append(list(map(int, episodes)))
        if len(reads) == 1:
            write_episode(writer, 16, "whole")  # 12 steps, into slot 0
            write_episode(writer, 13, "whole")  # 15 steps, into slot 1
        if len(reads) == 2:
            writer.drop_episodes([1])
        return rows

    reader.storage.read_rows = rewrite_after_each_read
    steps = reader.data["step"][:, 2:]
    assert reads == [[0, 1, 2], [0, 1]]
    expected = np.zeros((3, 24), np.int32)
    for row, uid in ((0, 16), (2, 6)):
        expected[row, : episode_length(uid)] = episode(uid)["step"]
    np.testing.assert_array_equal(steps, expected[:, 2:])


def test_a_slot_rewritten_during_every_read_raises_a_retryable_error(location):
    writer = ReplayBuffer(location, **buffer_kwargs(1, circular=True))
    write_episode(writer, 1, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_rows, uids = reader.storage.read_rows, iter(range(10, 100))

    def overwrite_during_every_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        write_episode(writer, next(uids), "whole")
        return rows

    reader.storage.read_rows = overwrite_during_every_read
    with pytest.raises(ConcurrentWriteError, match=r"slots \[0\] .* rewritten by a concurrent writer .* retryable"):
        read_episodes_consistent(reader, [0])
    with pytest.raises(ConcurrentWriteError):
        reader.refresh().data["obs"][0]


def test_a_read_torn_by_a_rewrite_is_a_retry(location):
    writer = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    for uid in (1, 2):
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_rows, calls = reader.storage.read_rows, []

    def torn_once(name, episodes, t0, t1, generations=None):
        calls.append(list(episodes))
        if len(calls) == 1:
            write_episode(writer, 3, "whole")  # slot 0 is rewritten while it is read
            raise RuntimeError("Zstd decompression error: invalid input data")
        return read_rows(name, episodes, t0, t1, generations)

    reader.storage.read_rows = torn_once
    got = read_episodes_consistent(reader, [0, 1])
    assert calls[0] == [0, 1] and calls[1] == [0, 1], "the torn read is read again, slot 0 as re-planned"
    assert verify(got) == [3, 2]


def test_a_read_error_without_a_rewrite_is_raised(location):
    writer = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    write_episode(writer, 1, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)

    def broken(name, episodes, t0, t1, generations=None):
        raise RuntimeError("disk on fire")

    reader.storage.read_rows = broken
    with pytest.raises(RuntimeError, match="disk on fire"):
        read_episodes_consistent(reader, [0])


def test_consistent_read_honours_a_plan(location):
    writer = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    for uid in (1, 2):
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    planned = reader.refresh()._meta["_generation"][[0, 1]].copy()
    write_episode(writer, 3, "whole")
    got = read_episodes_consistent(reader, [0, 1], generations=planned)
    assert got.slots.tolist() == [1]
    assert (committed_generations(reader, np.array([0, 1])) == planned).tolist() == [False, True]
    assert verify(read_episodes_consistent(reader, [0, 1], fields=["step"])) == [3, 2]


def test_consistent_read_bad_arguments(location):
    reader = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    with pytest.raises(ValueError, match=r"slots \[2\] out of range"):
        read_episodes_consistent(reader, [0, 2])
    with pytest.raises(ValueError, match="invalid field names \\['nope'\\]"):
        read_episodes_consistent(reader, [0], fields=["nope"])
    with pytest.raises(ValueError, match="one per slot"):
        read_episodes_consistent(reader, [0, 1], generations=[1])
    with pytest.raises(ValueError, match="1-d"):
        read_episodes_consistent(reader, [[0]])
    for t0, t1 in ((-1, None), (25, None), (3, 2), (0, 25)):
        with pytest.raises(ValueError, match=rf"t0={t0} .. t1={t1} must satisfy 0 <= t0 <= t1 <= max_timesteps \(24\)"):
            read_episodes_consistent(reader, [0], t0=t0, t1=t1)
    assert len(read_episodes_consistent(reader, [])) == 0


def test_steps_from_t0_run_to_the_longest_episode_kept_across_a_narrower_reread(location):
    """``t0`` without ``t1``: each episode's steps from ``t0``, as wide as the longest kept
    episode's from there; slot 0 re-read after a rewrite from 24 steps to 12 narrows the read."""
    writer = ReplayBuffer(location, **buffer_kwargs(2, circular=True))
    for uid in (4, 10):  # 24 and 18 steps
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    read_rows, calls = reader.storage.read_rows, []

    def rewrite_after_the_first_read(name, episodes, t0, t1, generations=None):
        rows = read_rows(name, episodes, t0, t1, generations)
        calls.append((list(map(int, episodes)), t0, t1))
        if len(calls) == 1:
            write_episode(writer, 16, "whole")  # 12 steps, into slot 0
        return rows

    reader.storage.read_rows = rewrite_after_the_first_read
    got = read_episodes_consistent(reader, [0, 1], ["step"], t0=3)
    assert calls == [([0, 1], 3, 24), ([0], 3, 18)]
    assert got.lens.tolist() == [12, 18] and got.data["step"].shape == (2, 15)
    for row, uid in enumerate((16, 10)):
        steps = episode(uid)["step"][3:]
        assert got.data["step"][row, : len(steps)].tolist() == steps.tolist()
        assert not got.data["step"][row, len(steps) :].any()


def run_reader_against_writer(location, progress, kwargs, circular, storage_options=None, rounds=READ_ROUNDS):
    """Read while a writer process commits; return (uids the reader saw, uids committed).

    The reader reads at least ``rounds`` times and until the writer committed ``target``
    episodes (a circular buffer wraps three times), so both really run at once."""
    ReplayBuffer(location, **kwargs, storage_options=storage_options).close()
    progress.write_text("")
    target = 3 * kwargs["max_episodes"] if circular else kwargs["max_episodes"]
    uids = list(range(100_000)) if circular else list(range(kwargs["max_episodes"]))
    writer, stop = start_writer(location, kwargs, uids, progress, storage_options)
    reader = ReplayBuffer.from_folder(location, read_only=True, storage_options=storage_options)
    rng = np.random.default_rng(0)
    seen, previous, done_rounds, lapped = set(), set(), 0, 0
    try:
        while done_rounds < rounds or (len(committed(progress)) < target and writer.is_alive()):
            done_rounds += 1
            slots = reader.refresh().valid_episodes()
            try:
                visible = verify(read_episodes_consistent(reader, slots))
            except ConcurrentWriteError:
                # a writer that laps the reader (a few slots, a loaded machine) may rewrite a slot
                # during each reread: the read gives up, the retryable error; it never mixes episodes
                assert circular, "a writer appending to free slots never rewrites one under the reader"
                lapped += 1
                continue
            if not circular:
                assert previous <= set(visible), "a committed episode disappeared"
                previous = set(visible)
            seen.update(visible)
            # a sampler's path: plan (slot, t) pairs, gather, then drop slots reused meanwhile
            if len(slots):
                plan = stored_bookkeeping(reader.storage, ["uid"], slots)
                lens, uid = plan["episode_lens"], plan["uid"]
                t = (rng.random(len(slots)) * np.maximum(lens, 1)).astype(np.int64)
                values = {}
                # the read names the planned generations: a storage that verifies them (the read
                # cache, on by default on S3) is then trusted by read_consistent without a re-check
                planned = plan["_generation"].copy()

                def gather(items, values=values, planned=planned):
                    values.update(
                        {n: reader.storage.gather(n, slots[items], t[items], planned[items]) for n in ("step", "frame")}  # noqa: B023
                    )
                    values["items"] = items

                kept_mask = read_consistent(reader, slots.copy(), planned, gather, whole=True)
                kept = np.flatnonzero(kept_mask)
                if len(kept):
                    keep = np.isin(values["items"], kept)
                    values = {n: values[n][keep] for n in ("step", "frame")}
                expected = (
                    {
                        n: np.stack([episode(int(u))[n][int(s)] for u, s in zip(uid[kept], t[kept])])
                        for n in ("step", "frame")
                    }
                    if len(kept)
                    else {}
                )
                for name, value in expected.items():
                    np.testing.assert_array_equal(values[name], value)
    finally:
        stop.set()
        writer.join(60)
    assert writer.exitcode == 0
    assert lapped < done_rounds, "every read beside the writer gave up"
    final = read_episodes_consistent(reader, reader.refresh().valid_episodes())
    done = committed(progress)
    expected = done if not circular else done[-kwargs["max_episodes"] :]
    assert sorted(verify(final)) == sorted(expected)
    return seen, done


@pytest.mark.slow
def test_reader_process_while_writer_appends(location, tmp_path):
    kwargs = buffer_kwargs(30, circular=False)
    seen, done = run_reader_against_writer(location, tmp_path / "progress", kwargs, circular=False)
    assert seen <= set(done)


@pytest.mark.slow
def test_reader_process_while_writer_reuses_slots(location, tmp_path):
    kwargs = buffer_kwargs(5, circular=True)
    seen, done = run_reader_against_writer(location, tmp_path / "progress", kwargs, circular=True)
    assert seen <= set(done)
    assert len(done) >= 3 * kwargs["max_episodes"], "the writer wrapped around while the reader read"


@pytest.mark.slow
def test_reader_process_while_writer_reuses_slots_on_s3(s3_server, tmp_path):
    location = s3_server.url(f"concurrent/{uuid.uuid4().hex[:12]}")
    kwargs = buffer_kwargs(3, circular=True, flush_every_store_step=0)
    # a round over moto takes ~10x one on disk: fewer rounds, the same three wraps of the buffer
    seen, done = run_reader_against_writer(
        location, tmp_path / "progress", kwargs, circular=True, storage_options=s3_server.storage_options, rounds=6
    )
    assert seen <= set(done)
    assert len(done) >= 3 * kwargs["max_episodes"]


def test_a_trajectory_batch_whose_reads_fail_under_a_rewriting_writer_drops_those_samples(location):
    """Every read of the batch fails (a writer rewrites the slot under it and the reader finds
    damage): the samples are dropped after the bounded retries, never half served, and with the
    snapshot's only episode gone the loader says so rather than return batches of no samples."""
    from replaybuf.sampling import SnapshotOverwrittenError, make_dataloader
    from replaybuf.storage import CorruptChunkError

    writer = ReplayBuffer(location, **buffer_kwargs(1, circular=True))
    write_episode(writer, 1, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    loader = make_dataloader(reader, batch_size=1, shuffle=False)
    dataset, uids = loader.dataset, iter(range(10, 100))
    read = dataset._read

    def rewritten_under_every_read(positions, *rest):
        if not len(positions):
            return read(positions, *rest)
        write_episode(writer, next(uids), "whole")
        raise CorruptChunkError("data/obs: slot 0 damaged while rewritten")

    dataset._read = rewritten_under_every_read
    with pytest.raises(SnapshotOverwrittenError, match="make a new loader"):
        list(loader)
    writer.close()


def test_a_trajectory_batch_redrawn_through_narrower_rereads_pads_each_sample_to_its_own_episode(location):
    """A writer reuses slot 0 after the batch's first read and slot 1 after its second: their
    samples are redrawn and the whole batch read again, narrower each time (24, then at most
    18 steps). Every sample is then one episode of a slot still in the snapshot, with its own
    length, meta and zeros past it. memmap: zarr's in-RAM copies would serve the snapshot."""
    from replaybuf.sampling.datasets import ReplayDatasetTrajectory

    writer = ReplayBuffer(location, **buffer_kwargs(4, circular=True), backend="memmap")
    for uid in (4, 16, 10, 3):  # 24, 12, 18 and 1 steps
        write_episode(writer, uid, "whole")
    reader = ReplayBuffer.from_folder(location, read_only=True)
    dataset = ReplayDatasetTrajectory(reader, ["step", "obs"], return_indices=True)
    reads = []

    def reusing_a_slot_after_each_read(read):
        def wrapped(name, episodes, *args, **kwargs):
            rows = read(name, episodes, *args, **kwargs)
            if name == "obs":
                reads.append(sorted(set(map(int, episodes))))
                if len(reads) <= 2:
                    write_episode(writer, 20 + len(reads), "whole")  # into slot 0, then slot 1
            return rows

        return wrapped

    for method in ("gather", "read_spans"):  # short windows gather steps, whole episodes read spans
        setattr(reader.storage, method, reusing_a_slot_after_each_read(getattr(reader.storage, method)))
    torch.manual_seed(0)
    batch = dataset.__getitems__([0, 1, 2, 3]).batch
    assert len(reads) == 3 and reads[0] == [0, 1, 2, 3] and set(reads[2]) <= {2, 3}
    assert set(batch["_index"].tolist()) <= {2, 3} and len(batch["_index"]) == 4
    assert batch["step"].shape[1] == int(batch["_lens"].max()) == 18, "padded to the longest kept sample"
    for row, uid in enumerate(batch["uid"].tolist()):
        length = int(batch["_lens"][row])
        check_episode(uid, length, {name: batch[name][row].numpy() for name in ("step", "obs")})
