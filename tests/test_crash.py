"""A writer process SIGKILLed at random moments never corrupts what it had committed.

After each kill the buffer is reopened for writing (which replays the step log) and checked:
every episode committed before the kill is intact, every slot's data agrees with its length
(the episode's values up to it, zeros after), the episode in progress is either dropped or kept
truncated to its logged steps, and the next writer's episodes never mix with it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from replaybuf import ReplayBuffer

from ._workloads import buffer_kwargs, check_episode, episode, episode_length, write_episode, writer_loop

FORK = multiprocessing.get_context("fork")
ROUNDS = 5
CIRCULAR_SLOTS = 6
# the core zeroes rows an unpublished episode (aborted, killed, cleared) left in a slot
STALE_TAILS_CLEARED = True


def committed(progress) -> list[int]:
    return [int(line) for line in progress.read_text().split()] if progress.exists() else []


def kill_writer_at_random(location, kwargs, first_uid, progress, rng) -> list[int]:
    """Start a writer at ``first_uid``, SIGKILL it at a random moment after it committed a
    random number of episodes; return the uids it reported committed."""
    writer = FORK.Process(
        target=writer_loop,
        args=(location, list(range(first_uid, first_uid + 10_000)), "mixed", kwargs, str(progress)),
        kwargs={"span_bytes": 256},
    )
    writer.start()
    wanted = int(rng.integers(1, 4))
    while len(committed(progress)) < wanted and writer.is_alive():
        time.sleep(0.005)
    time.sleep(float(rng.uniform(0, 0.1)))
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(30)
    assert writer.exitcode == -signal.SIGKILL, "the writer must have been killed, not have finished or failed"
    return committed(progress)


def stored_episodes(
    buffer: ReplayBuffer, full_width: bool = STALE_TAILS_CLEARED
) -> dict[int, tuple[int, dict[str, np.ndarray]]]:
    """uid -> (length, rows up to max_timesteps, or up to the length) for every slot holding an episode."""
    slots = buffer.valid_episodes()
    uids = buffer.meta_data["uid"][slots].tolist()
    assert len(set(uids)) == len(uids), f"an episode is stored twice: {sorted(uids)}"
    out = {}
    for uid, slot in zip(uids, slots.tolist()):
        length = int(buffer.episode_lens[slot])
        # past its length a slot may still hold (even torn) chunks of a killed episode until the
        # core clears them, so the random-kill test reads up to the length unless that is fixed
        end = buffer.max_timesteps if full_width else length
        out[uid] = length, {n: buffer.storage.read_rows(n, np.array([slot]), 0, end)[0] for n in buffer.schema.fields}
    return out


def check_after_kill(buffer, lengths, recovered, round_reported, circular, flush_every_store_step) -> dict[int, int]:
    """Assert the post-crash invariants; ``lengths`` maps every uid reported committed to its
    length, ``recovered`` earlier unreported finds. Return uid -> length of the episodes present."""
    episodes = stored_episodes(buffer)
    recovered = {uid: n for uid, n in recovered.items() if uid in episodes}
    last = round_reported[-1]
    unreported = sorted(set(episodes) - set(lengths) - set(recovered))
    assert set(unreported) <= {last + 1, last + 2}, f"unexpected episodes {unreported} after {last}"
    for uid, (length, rows) in episodes.items():
        may_be_truncated = flush_every_store_step > 0 and unreported and uid == unreported[-1]
        known = {**recovered, **lengths}
        if uid in known:
            assert length == known[uid], f"uid {uid}: length {length} changed from {known[uid]}"
        full = known[uid] == episode_length(uid) if uid in known else not may_be_truncated
        check_episode(uid, length, rows, full=full, zeros_after=STALE_TAILS_CLEARED)
    if len(unreported) == 2:
        assert episodes[unreported[0]][0] == episode_length(unreported[0]), "only the last episode may be cut"
    missing = sorted(set(lengths) - set(episodes))
    if circular:  # uids grow with commit order: only episodes older than every one kept may be gone
        assert not missing or missing[-1] < min(episodes), f"committed {missing} gone, kept {sorted(episodes)}"
        assert min(len(lengths), CIRCULAR_SLOTS - 2) <= len(episodes) <= CIRCULAR_SLOTS
    else:
        assert not missing, f"committed episodes {missing} were lost"
    return {uid: length for uid, (length, _) in episodes.items()}


@pytest.mark.slow
@pytest.mark.parametrize("circular", [False, True], ids=["linear", "circular"])
@pytest.mark.parametrize("flush_every_store_step", [1, 0])
def test_sigkill_at_random_moments(tmp_path, circular, flush_every_store_step):
    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(CIRCULAR_SLOTS if circular else 200, circular, flush_every_store_step)
    ReplayBuffer(location, **kwargs).close()
    rng = np.random.default_rng([int(circular), flush_every_store_step])
    lengths: dict[int, int] = {}  # reported uid -> its length, in commit order
    recovered: dict[int, int] = {}  # unreported uid found after a kill -> its length
    first_uid = 0
    for round_ in range(ROUNDS):
        round_reported = kill_writer_at_random(location, kwargs, first_uid, tmp_path / f"progress-{round_}", rng)
        assert round_reported, "the writer committed nothing before the kill"
        lengths.update((uid, episode_length(uid)) for uid in round_reported)
        with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:  # recovers the step log
            present = check_after_kill(buffer, lengths, recovered, round_reported, circular, flush_every_store_step)
            assert buffer.storage.log_names() == [], "recovery clears the step log"
        # an episode recovered or published but not reported is checked while present, and
        # may be dropped later (see test_kill_between_lengths_and_counters_keeps_the_episode)
        recovered.update((uid, n) for uid, n in present.items() if uid > round_reported[-1])
        first_uid = round_reported[-1] + 3  # uids are never reused, even for dropped episodes

    # a clean writer after the last crash: its episodes are whole and nothing mixes with the old
    final = list(range(first_uid, first_uid + 4))
    writer = FORK.Process(target=writer_loop, args=(location, final, "mixed", kwargs, str(tmp_path / "final")))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    lengths.update((uid, episode_length(uid)) for uid in final)
    with ReplayBuffer.from_folder(location, read_only=True) as buffer:
        episodes = stored_episodes(buffer)
        for uid, (length, rows) in episodes.items():
            assert length == {**recovered, **lengths}[uid]
            check_episode(uid, length, rows, full=length == episode_length(uid), zeros_after=STALE_TAILS_CLEARED)
        assert set(final) <= set(episodes)
        if not circular:
            assert set(lengths) <= set(episodes) <= set(lengths) | set(recovered)


# ---- deterministic reproductions of core issues (see the report; the patch turns them green) ----


def _short_spans(monkeypatch):
    from replaybuf import staging

    monkeypatch.setattr(staging, "WRITE_SPAN_BYTES", 256)  # slabs reach storage mid-episode


def _kill_mid_episode(location, kwargs, uid, steps):
    """Child: stage ``steps`` steps of episode ``uid`` (some reach storage), then SIGKILL itself."""
    from replaybuf import staging

    staging.WRITE_SPAN_BYTES = 256
    buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    data = episode(uid)
    with buffer.one_episode(uid=uid):
        for t in range(steps):
            buffer.store(**{n: v[t] for n, v in data.items()})
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_before_counters(location, kwargs, uid):
    """Child: store episode ``uid`` whole but die after publishing its length, before the counters."""
    buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    commit_state = buffer.storage.commit_state

    def die_at_the_counters(state):
        if state.get("total_episodes", 0) <= 1:  # an earlier, intermediate commit of the state
            return commit_state(state)
        os.kill(os.getpid(), signal.SIGKILL)

    buffer.storage.commit_state = die_at_the_counters
    write_episode(buffer, uid, "whole")


def _run_child(target, *args):
    child = FORK.Process(target=target, args=args)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL


def _assert_zero_after_lengths(buffer):
    episodes = stored_episodes(buffer, full_width=True)
    assert episodes
    for uid, (length, rows) in episodes.items():
        check_episode(uid, length, rows, full=False)


def test_aborted_episode_leaves_nothing_past_the_next_end(tmp_path, monkeypatch):
    _short_spans(monkeypatch)
    buffer = ReplayBuffer(str(tmp_path), **buffer_kwargs(4, circular=False))
    long_uid = next(u for u in range(100) if episode_length(u) == 24)
    with pytest.raises(RuntimeError), buffer.one_episode(uid=long_uid):
        for t in range(20):
            buffer.store(**{n: v[t] for n, v in episode(long_uid).items()})
        raise RuntimeError("the environment failed")
    write_episode(buffer, 3, "whole")  # 1 step, same slot
    _assert_zero_after_lengths(buffer)


@pytest.mark.parametrize("backend", ["zarr", "memmap", "hdf5"])
@pytest.mark.parametrize("flush_every_store_step", [7, 0])  # 7: the log lags the rows already written
def test_killed_episode_leaves_nothing_past_the_next_end(tmp_path, flush_every_store_step, backend):
    """Rows a killed writer left in a slot it had not published (the slots it was writing are
    recorded before: ``Storage.mark_writing``) are zeroed past the next episode's end."""
    location = str(tmp_path / "buffer")
    kwargs = {**buffer_kwargs(4, circular=False, flush_every_store_step=flush_every_store_step), "backend": backend}
    ReplayBuffer(location, **kwargs).close()
    long_uid = next(u for u in range(100) if episode_length(u) == 24)
    _run_child(_kill_mid_episode, location, kwargs, long_uid, 20)
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        for uid in (3, 7):  # 1 and 8 steps: the slot of the killed episode, then the next
            write_episode(buffer, uid, "whole")
        _assert_zero_after_lengths(buffer)


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_torn_record_of_the_slots_being_written_zeroes_every_empty_slot_when_reused(tmp_path, backend):
    """A writer killed while writing its record of the slots it writes leaves a record that
    fails its check: the next open warns, naming it, and treats every empty slot as written."""
    location = str(tmp_path / "buffer")
    kwargs = {**buffer_kwargs(4, circular=False, flush_every_store_step=7), "backend": backend}
    ReplayBuffer(location, **kwargs).close()
    long_uid = next(u for u in range(100) if episode_length(u) == 24)
    _run_child(_kill_mid_episode, location, kwargs, long_uid, 20)
    record = tmp_path / "buffer" / "replaybuf" / "writing"
    record.write_bytes(record.read_bytes()[:-1])  # torn: one byte short
    with pytest.warns(UserWarning, match="replaybuf/writing.*damaged"):
        buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    with buffer:
        for uid in (3, 7):
            write_episode(buffer, uid, "whole")
        _assert_zero_after_lengths(buffer)


def test_kill_between_lengths_and_counters_keeps_the_episode(tmp_path):
    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(4, circular=False, flush_every_store_step=0)
    with ReplayBuffer(location, **kwargs) as buffer:
        write_episode(buffer, 1, "whole")
    _run_child(_kill_before_counters, location, kwargs, 2)
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        assert sorted(stored_episodes(buffer)) == [1, 2], "the published episode is readable"
        write_episode(buffer, 3, "whole")
        assert sorted(stored_episodes(buffer)) == [1, 2, 3], "the next writer does not overwrite it"
        assert buffer.num_episodes == 3


def test_clear_leaves_nothing_past_the_next_end(tmp_path):
    buffer = ReplayBuffer(str(tmp_path), **buffer_kwargs(4, circular=False))
    long_uid = next(u for u in range(100) if episode_length(u) == 24)
    write_episode(buffer, long_uid, "whole")
    buffer.clear()
    write_episode(buffer, 3, "whole")
    _assert_zero_after_lengths(buffer)


def _kill_during_reuse(location, kwargs, uid, at):
    """Child: store episode ``uid`` whole into a reused slot, SIGKILLed before the ``at``-th
    write (write_meta or write_rows) of that commit: writes 1 and 2 invalidate the slot (length,
    then generation), 3 on write its data."""
    buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    storage, writes = buffer.storage, []

    def dying(method):
        def write(*args):
            writes.append(args[0])
            if len(writes) == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return method(*args)

        return write

    storage.write_meta, storage.write_rows = dying(storage.write_meta), dying(storage.write_rows)
    write_episode(buffer, uid, "whole")


@pytest.mark.parametrize("at", [2, 3, 5])
def test_kill_while_reusing_a_slot_leaves_counters_that_match_the_episodes(tmp_path, at):
    """A kill inside store_episode into a reused slot: the reopened buffer holds the other
    episodes, lists every slot up to the highest holding one (the emptied slot as padding: a
    recount to 4 hid slot 4's episode from get_all_data) and verifies clean."""
    from replaybuf.maintenance import verify

    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(5, circular=True)
    with ReplayBuffer(location, **kwargs) as buffer:
        for uid in range(5):
            write_episode(buffer, uid, "whole")
    _run_child(_kill_during_reuse, location, kwargs, 5, at)
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        assert (buffer.num_episodes, len(buffer)) == (5, 4)
        assert buffer.episode_index == 0  # the emptied slot is the next one written
        assert sorted(stored_episodes(buffer)) == [1, 2, 3, 4]
        rows = buffer.get_all_data()
        assert rows["episode_lens"][0] == 0 and rows["uid"][1:].tolist() == [1, 2, 3, 4]  # slot 0: padding
    assert verify(location) == []
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        write_episode(buffer, 6, "whole")
        assert buffer.num_episodes == len(buffer) == 5


def _create_killed_after_writes(location: str, writes: int) -> None:
    """Child: create a zarr buffer and die (no cleanup, as under SIGKILL) at its write number
    ``writes`` of metadata documents."""
    from replaybuf.storage import _kv

    done = []
    real = _kv.LocalKV._write

    def write(self, item):
        if len(done) == writes:
            os._exit(9)
        done.append(item[0])
        real(self, item)

    _kv.LocalKV._write = write
    ReplayBuffer(location, **buffer_kwargs(3, circular=False))


@pytest.mark.parametrize("writes", [0, 1, 3])
def test_a_create_killed_part_way_is_created_again_by_an_overwrite(tmp_path, writes):
    """A create killed between its metadata writes leaves nothing, or a damaged buffer that the
    next ``overwrite=True`` replaces: never a half-written folder it refuses as foreign."""
    location = str(tmp_path / "buffer")
    child = multiprocessing.get_context("fork").Process(target=_create_killed_after_writes, args=(location, writes))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    buffer = ReplayBuffer(location, **buffer_kwargs(3, circular=False), overwrite=True)
    write_episode(buffer, 1, "whole")
    buffer.close()
    reader = ReplayBuffer.from_folder(location, read_only=True)
    assert len(reader) == 1
    length = int(reader.episode_lens[0])
    check_episode(1, length, {name: np.asarray(reader.data[name][0]) for name in reader.fieldnames})


def _kill_during_unpublish(location, kwargs, how, at):
    """Child: drop slot 2 (``how="drop"``) or clear the buffer, SIGKILLed before its ``at``-th
    ``write_meta`` (1: the lengths, 2: the generations)."""
    buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    storage, writes = buffer.storage, []
    write_meta = storage.write_meta

    def dying(*args):
        writes.append(args[0])
        if len(writes) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return write_meta(*args)

    storage.write_meta = dying
    if how == "drop":
        buffer.drop_episodes([2])
    else:
        buffer.clear()


@pytest.mark.parametrize("how", ["drop", "clear"])
def test_a_drop_or_clear_killed_between_lengths_and_generations_is_a_leftover_not_lost_lengths(tmp_path, how):
    """A kill after a drop (or clear) cleared lengths but not generations leaves committed
    generations without lengths: readers take them for the killed writer's leftovers (empty
    slots) until a writable open clears them, and verify reports nothing lost."""
    from replaybuf.maintenance import verify

    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(5, circular=True)
    with ReplayBuffer(location, **kwargs) as buffer:
        for uid in range(4):
            write_episode(buffer, uid, "whole")
    _run_child(_kill_during_unpublish, location, kwargs, how, 2)
    kept = [0, 1, 3] if how == "drop" else []
    with ReplayBuffer(location, read_only=True) as reader:
        assert sorted(stored_episodes(reader)) == kept
    assert verify(location) == []
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        assert sorted(stored_episodes(buffer)) == kept
    with ReplayBuffer(location, read_only=True) as reader:  # recovered: the leftovers are gone
        assert sorted(stored_episodes(reader)) == kept


def test_a_killed_writer_excuses_only_its_own_leftovers(tmp_path):
    """A length zeroed in a slot no killed writer was unpublishing is refused even while that
    writer's leftovers (the slot it was reusing) are excused."""
    from replaybuf import LostLengthError

    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(5, circular=True)
    with ReplayBuffer(location, **kwargs) as buffer:
        for uid in range(5):
            write_episode(buffer, uid, "whole")
    _run_child(_kill_during_reuse, location, kwargs, 5, 2)  # slot 0: length cleared, generation kept
    with ReplayBuffer(location, read_only=True) as reader:
        assert sorted(stored_episodes(reader)) == [1, 2, 3, 4]
    chunk = Path(location) / "meta" / "episode_lens" / "c.0"  # int32 lengths, uncompressed
    lengths = bytearray(chunk.read_bytes())
    lengths[12:16] = bytes(4)  # slot 3
    chunk.write_bytes(bytes(lengths))
    with pytest.raises(LostLengthError, match=r"committed slots \[3\] hold length 0"):
        ReplayBuffer(location, read_only=True)
    with pytest.raises(LostLengthError, match=r"committed slots \[3\]"):
        ReplayBuffer(location, **kwargs, overwrite=False)


def _kill_at_publish(location, kwargs, uid, how):
    """Child: store episode ``uid`` (``how``: whole or step by step) into a reused slot,
    SIGKILLed once its rows and shards are written, as it publishes its generation."""
    buffer = ReplayBuffer(location, **kwargs, overwrite=False)
    write_meta = buffer.storage.write_meta

    def dying(name, episodes, values):
        if name == "_generation" and np.asarray(values).any():
            os.kill(os.getpid(), signal.SIGKILL)
        return write_meta(name, episodes, values)

    buffer.storage.write_meta = dying
    write_episode(buffer, uid, how)


@pytest.mark.parametrize("how", ["whole", "steps"])
def test_a_writer_killed_between_its_shards_and_their_generation_leaves_nothing_torn(tmp_path, how):
    """Zarr format 7 binds each image shard to the generation its episode publishes, which a
    commit writes after the shards (steps 2, then 3). A writer killed in between leaves its
    slot empty (a whole episode: no step log), or its step log, which the next writable open
    commits with a generation its replayed shards name; either way every committed episode
    reads whole, ``verify`` finds nothing, and the slot is reused cleanly."""
    from replaybuf import verify

    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(3, circular=True, flush_every_store_step=1)
    with ReplayBuffer(location, **kwargs) as buffer:
        for uid in range(3):
            write_episode(buffer, uid, "whole")
    _run_child(_kill_at_publish, location, kwargs, 3, how)
    kept = [1, 2, 3] if how == "steps" else [1, 2]
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        episodes = stored_episodes(buffer)
        assert sorted(episodes) == kept
        for uid, (length, rows) in episodes.items():
            check_episode(uid, length, rows)
    assert verify(location) == []
    with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
        write_episode(buffer, 4, "steps")
        episodes = stored_episodes(buffer)
        assert sorted(episodes) == ([2, 3, 4] if how == "steps" else [1, 2, 4])
        for uid, (length, rows) in episodes.items():
            check_episode(uid, length, rows)
    assert verify(location) == []


def _edit_and_compact_until_killed(location, kwargs, first_uid, progress, seed):
    """Child: store episodes from ``first_uid`` on (step by step and whole, every frame leaving
    RAM at once), reporting each to ``progress``; between them rewrite a committed episode's
    frames with its own values (``store_datapoint``, ``update``: its shards rewritten in place)
    or compact the hot tier, until killed."""
    from replaybuf import staging

    staging.WRITE_SPAN_BYTES = 4096
    rng = np.random.default_rng(seed)
    buffer = ReplayBuffer(location, **kwargs, overwrite=False, hot_bytes=int(rng.choice([0, 1 << 14, 1 << 30])))
    with open(progress, "a") as report:
        for uid in range(first_uid, first_uid + 10_000):
            write_episode(buffer, uid, ("steps", "whole")[uid % 2])
            report.write(f"{uid}\n")
            report.flush()
            slot = int(rng.choice(buffer.valid_episodes()))
            stored = episode(int(buffer.meta_data["uid"][slot]))["frame"][: int(buffer.episode_lens[slot])]
            what = int(rng.integers(0, 3))
            if what == 0:
                t = int(rng.integers(0, len(stored)))
                buffer.store_datapoint(slot, t, "frame", stored[t])
            elif what == 1:
                buffer.update([slot], frame=stored[None])
            else:
                buffer.compact()


def test_sigkill_beside_edits_and_compaction_leaves_every_episode_bound_to_its_generation(tmp_path):
    """Zarr format 7: a writer killed anywhere in a commit, an in-place edit or a compaction of a
    circular buffer (hot tier off, small or large) leaves every committed episode reading back
    whole through get_all_data and a timestep loader after the next writable open (which
    commits its step log), and ``verify`` finds nothing."""
    from replaybuf import verify

    location = str(tmp_path / "buffer")
    kwargs = buffer_kwargs(4, circular=True, flush_every_store_step=1)
    ReplayBuffer(location, **kwargs).close()
    rng = np.random.default_rng(7)
    first_uid = 0
    for round_ in range(6):
        progress = tmp_path / f"progress-{round_}"
        writer = FORK.Process(
            target=_edit_and_compact_until_killed, args=(location, kwargs, first_uid, str(progress), round_)
        )
        writer.start()
        while not committed(progress) and writer.is_alive():
            time.sleep(0.002)
        time.sleep(float(rng.uniform(0, 0.15)))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        assert writer.exitcode == -signal.SIGKILL
        reported = committed(progress)
        with ReplayBuffer(location, **kwargs, overwrite=False) as buffer:
            for uid, (length, rows) in stored_episodes(buffer).items():
                check_episode(uid, length, rows, full=uid in reported)
            loader = buffer.dataloader(batch_size=8, timestep_level=True, return_indices=True, seed=round_)
            for batch in loader:
                for (slot, t), frame in zip(batch["_indices"].tolist(), batch["frame"].numpy()):
                    np.testing.assert_array_equal(frame, episode(int(buffer.meta_data["uid"][slot]))["frame"][t])
        assert verify(location) == []
        first_uid = reported[-1] + 3  # uids are never reused
