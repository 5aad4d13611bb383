"""A call interrupted inside the process (a KeyboardInterrupt: Ctrl-C in a notebook) and the same
object used on: what was committed before stays intact, the interrupted call took effect whole
or not at all, the object goes on storing episodes into the right slots, and after ``close()``
the buffer reopens and verifies clean.

The interrupt is injected deterministically: at the k-th call of a storage method, or at the
n-th line executed inside replaybuf (``LineInterrupt``, where a signal's handler may run).
The SIGKILL of a writer process is tested in test_crash.py and test_writer_hostile.py.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys

import numpy as np
import pytest

import replaybuf
from replaybuf import ReplayBuffer, staging
from replaybuf.maintenance import verify

from ._backends import LOCAL_BACKENDS

MAX_TIMESTEPS = 12
# short time chunks: rows are written in place (the writing record), spans mid-episode below
FIELDS = {"obs": {"dtype": "float32", "shape": [3], "chunks": 2}, "step": {"dtype": "int32", "shape": [], "chunks": 2}}
PACKAGE = os.path.dirname(replaybuf.__file__)


def episode(uid: int, length: int = 5) -> dict[str, np.ndarray]:
    t = np.arange(length)
    return {"obs": (uid * 100 + t[:, None] + np.zeros(3)).astype(np.float32), "step": (uid * 100 + t).astype(np.int32)}


def make(place, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(
        place.location,
        max_episodes=6,
        max_timesteps=MAX_TIMESTEPS,
        fields=FIELDS,
        meta_fields={"uid": "int"},
        **place.kwargs,
        **kwargs,
    )


def stored(buffer: ReplayBuffer, slots: list[int] | None = None) -> dict[int, int]:
    """uid -> slot of every episode ``buffer`` holds (in ``slots``), each checked to be its
    episode whole."""
    out = {}
    for slot in buffer.valid_episodes().tolist() if slots is None else slots:
        uid, length = int(buffer.meta_data["uid"][slot]), int(buffer.meta_data["episode_lens"][slot])
        assert length == 5, f"uid {uid}: {length} steps stored, 5 expected"
        for name, values in episode(uid).items():
            rows = buffer.data[name][slot]
            np.testing.assert_array_equal(rows[:5], values, err_msg=f"uid {uid} field {name}")
            assert not rows[5:].any(), f"uid {uid} field {name}: data past its length"
        assert uid not in out, f"uid {uid} stored twice"
        out[uid] = slot
    return out


def reopened(place, expected: dict[int, int]) -> None:
    """The buffer reopens for writing with ``expected`` (uid -> slot) and verifies clean."""
    with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
        assert stored(again) == expected
    assert verify(place.location) == []


def interrupt_at(monkeypatch, target, name: str, k: int, after: bool = False) -> list[int]:
    """``target.name`` raises KeyboardInterrupt at its k-th call from now (``after``: once that
    call returned); returns the calls' count (a list of one int)."""
    calls, method = [0], getattr(target, name)

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k and not after:
            raise KeyboardInterrupt
        result = method(*args, **kwargs)
        if calls[0] == k:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(target, name, interrupted)
    return calls


@functools.cache
def _with_line(filename: str, lineno: int) -> bool:
    # CPython traces a ``with`` line again before calling ``__exit__``: an exception raised
    # there skips it (no signal arrives there), which would leave a lock held
    return linecache.getline(filename, lineno).lstrip().startswith("with ")


class LineInterrupt:
    """Raise KeyboardInterrupt at the n-th line executed inside replaybuf's ``files`` while the
    block runs (``fired`` says whether it came)."""

    def __init__(self, n: int, files: tuple[str, ...]):
        self.n, self.count, self.fired = n, 0, False
        self.files = tuple(os.path.join(PACKAGE, f) for f in files)

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired and not _with_line(frame.f_code.co_filename, frame.f_lineno):
            self.count += 1
            if self.count == self.n:
                self.fired = True
                raise KeyboardInterrupt
        return self._line

    def _call(self, frame, event, arg):
        return self._line if not self.fired and frame.f_code.co_filename in self.files else None

    def __enter__(self) -> LineInterrupt:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


@pytest.mark.parametrize("call", ["clear", "drop_episodes"])
def test_unpublishing_interrupted_between_lengths_and_generations(place, monkeypatch, call):
    """A clear or drop interrupted after clearing the lengths, before the generations (its
    second write), is finished by the next commit or close: the buffer reopened since refused
    the slots as having lost their lengths (LostLengthError), and verify reported them."""
    for k, then_store in [(1, True), (2, True), (2, False)]:
        buffer = make(place)
        for uid in range(3):
            buffer.store_episode(**episode(uid), uid=uid)
        calls = interrupt_at(monkeypatch, buffer.storage, "write_meta", k)
        with pytest.raises(KeyboardInterrupt):
            buffer.clear() if call == "clear" else buffer.drop_episodes([0, 1])
        assert calls[0] == k
        monkeypatch.undo()
        kept = stored(buffer)
        assert set(kept) == ({0, 1, 2} if k == 1 else set() if call == "clear" else {2}), f"k={k}"
        if then_store:
            buffer.store_episode(**episode(7), uid=7)
            kept = stored(buffer)
            assert 7 in kept
        buffer.close()
        reopened(place, kept)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)  # a loop over every line: memory:// is zarr's
def test_store_interrupted_anywhere_is_taken_back(place, monkeypatch):
    """``store()`` interrupted at any line of the buffer, its staging and the commit protocol
    stores its step whole or not at all (``timestep_index`` tells which): the episode then
    holds each step once, and every span of it (they reach storage mid-episode here; one was
    dropped unwritten, another half staged). Nor does the step log replay a step
    twice at the next open when its append was interrupted after writing."""
    monkeypatch.setattr(staging, "WRITE_SPAN_BYTES", 24)  # spans of 2 steps: written as they fill
    buffer = make(place, circular=True)
    buffer.store_episode(**episode(0), uid=0)
    expected = {0: 0}
    for n in range(1, 200):
        uid = n
        data = episode(uid)
        buffer.store_meta_batch(uid=np.array([uid]))
        injector = LineInterrupt(n, ("buffer.py", "staging.py", "commit.py"))
        for t in range(5):
            step = {name: values[t] for name, values in data.items()}
            try:
                with injector if t == 3 else contextlib.nullcontext():
                    buffer.store(**step)
            except KeyboardInterrupt:
                # interrupted before its step was staged, or after: never in between
                assert buffer.timestep_index in (t, t + 1), f"n={n}"
                if buffer.timestep_index == t:
                    buffer.store(**step)  # stored again, as a user does after Ctrl-C
        buffer.advance_episode()
        expected = {u: s for u, s in expected.items() if s != uid % 6} | {uid: uid % 6}
        assert stored(buffer, [uid % 6]) == {uid: uid % 6}, f"n={n}"
        assert buffer.valid_episodes().tolist() == sorted(expected.values(), key=lambda s: (s - uid - 1) % 6)
        if not injector.fired:
            break
    assert n > 20, "the store was interrupted at every line it runs"
    assert stored(buffer) == expected
    # an episode in progress whose log append was interrupted once written, stored again and
    # left unfinished: never replayed with that step twice (its log is dropped)
    data = episode(99)
    buffer.store_meta_batch(uid=np.array([99]))
    reused = buffer.episode_index  # its first span written, the episode there is gone
    buffer.store(**{name: values[0] for name, values in data.items()})
    interrupt_at(monkeypatch, buffer.storage, "append_log", 1, after=True)
    with pytest.raises(KeyboardInterrupt):
        buffer.store(**{name: values[1] for name, values in data.items()})
    monkeypatch.undo()
    for t in range(1, 3):
        buffer.store(**{name: values[t] for name, values in data.items()})
    buffer.close()
    reopened(place, {u: s for u, s in expected.items() if s != reused})


def test_commit_interrupted_leaves_no_log_behind(place, monkeypatch):
    """An ``advance_episode`` interrupted before its episode is published drops it with its step
    log, as a failed commit does: the buffer reopened holds what the object showed (the log
    left behind committed the episode at the next open, after the object had gone on without
    it), and the object's next episodes are whole."""
    for k in (1, 2, 3):
        buffer = make(place)
        buffer.store_episode(**episode(0), uid=0)
        data = episode(1)
        buffer.store_meta_batch(uid=np.array([1]))
        for t in range(5):
            buffer.store(**{name: values[t] for name, values in data.items()})
        interrupt_at(monkeypatch, buffer.storage, "write_meta", k)  # the publish's writes
        with pytest.raises(KeyboardInterrupt):
            buffer.advance_episode()
        monkeypatch.undo()
        assert buffer.timestep_index == 0
        assert stored(buffer) == {0: 0}, f"k={k}: published half way"
        buffer.close()
        reopened(place, {0: 0})


def test_unpublishing_interrupted_leaves_no_rows_past_the_next_end(place, monkeypatch):
    """Slots a clear or drop emptied before it was interrupted hold their old rows: the next,
    shorter episode of each zeroes them past its end, in this session and after a reopen (they
    stayed, and verify reported data beyond the length)."""
    # interrupted between lengths and generations, or after both (before a clear's counters,
    # before a drop zeroes the rows)
    cases = [("clear", "write_meta", 2), ("clear", "commit_state", 1)]
    cases += [("drop_episodes", "write_meta", 2), ("drop_episodes", "write_rows", 1)]
    for call, method, k in cases:
        buffer = make(place, circular=True)
        for uid in range(6):  # long episodes in every slot
            data = {name: np.concatenate([values] * 2) for name, values in episode(uid).items()}
            buffer.store_episode(**data, uid=uid)
        calls = interrupt_at(monkeypatch, buffer.storage, method, k)
        with pytest.raises(KeyboardInterrupt):
            buffer.clear() if call == "clear" else buffer.drop_episodes(list(range(6)))
        assert calls[0] == k
        monkeypatch.undo()
        buffer.store_episode(**episode(7), uid=7)  # 5 steps where 10 were
        slot = int(buffer.valid_episodes()[-1])
        assert stored(buffer, [slot]) == {7: slot}
        buffer.close()
        with ReplayBuffer.from_folder(place.location, **place.kwargs) as again:
            for uid in (8, 9):
                again.store_episode(**episode(uid), uid=uid)
            slots = again.valid_episodes()[-3:].tolist()
            assert stored(again, slots) == dict(zip((7, 8, 9), slots))
        assert verify(place.location) == [], f"{call} interrupted at {method} {k}"


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize("manager", ["one_episode", "batched_episode"])
def test_context_interrupted_at_its_commit_ends_the_episode(place, manager):
    """A block of ``one_episode`` / ``batched_episode`` interrupted as it exits, before its commit
    took the episode, leaves no episode in progress: the next block began (``batched_episode``
    raised "an episode is already in progress"), and ``store()`` would have added steps to it."""
    for n in range(1, 60):
        buffer = make(place)
        data = episode(1)
        injector = LineInterrupt(n, ("buffer.py",))
        try:
            if manager == "one_episode":
                with buffer.one_episode(uid=1):
                    for t in range(5):
                        buffer.store(**{name: values[t] for name, values in data.items()})
                    injector.__enter__()
            else:
                with buffer.batched_episode(1, uid=np.array([1])):
                    for t in range(5):
                        buffer.store_batch(**{name: values[t : t + 1] for name, values in data.items()})
                    injector.__enter__()
        except KeyboardInterrupt:
            pass
        finally:
            injector.__exit__()
        assert buffer.timestep_index == 0, f"n={n}: the episode is still in progress"
        kept = stored(buffer)
        assert kept in ({}, {1: 0}), f"n={n}"
        with buffer.batched_episode(1, uid=np.array([2])):
            for t in range(5):
                buffer.store_batch(**{name: values[t : t + 1] for name, values in episode(2).items()})
        assert stored(buffer) == {**kept, 2: len(kept)}
        buffer.close()
        if not injector.fired:
            break
    assert n > 5


def test_compact_interrupted_leaves_no_slot_busy(tmp_path):
    """zarr on local disk: ``compact()`` interrupted at any line of the hot tier (between marking
    a slot busy and compacting it) leaves no slot marked busy: every later ``compact()``, and
    ``close()``, which compacts, waited for it forever."""
    frames = np.arange(4 * 32 * 32 * 4).reshape(4, 32, 32, 4) % 7  # an image field: stored hot
    fields = {"frame": ("uint8", (32, 32, 4))}
    buffer = ReplayBuffer(tmp_path / "buffer", max_episodes=2, max_timesteps=4, fields=fields, circular=True)
    tier = buffer.storage._hot
    for n in range(1, 400):
        for uid in range(2):
            buffer.store_episode(frame=(frames + uid + n).astype(np.uint8))
        assert tier is not None and any(tier.hot.values()), "episodes of an image field are stored hot"
        injector = LineInterrupt(n, ("storage/_hot.py",))
        try:
            with injector:
                buffer.compact()
        except KeyboardInterrupt:
            pass
        assert not tier.busy, f"n={n}: slots {sorted(tier.busy)} left busy"
        buffer.compact()  # what is left
        assert not any(tier.hot.values()), f"n={n}: left hot"
        if not injector.fired:
            break
    assert n > 10
    buffer.close()
    assert verify(tmp_path / "buffer") == []


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_update_interrupted_between_its_writes_reads_old_or_new_at_once(place, monkeypatch):
    """An ``update`` interrupted after any of its storage writes (the slot made odd, one
    field's rows, a meta value, its checksum) is finished before the interrupt reaches the
    caller: the object's reads right after show the episode all old or all new (they showed
    its fields part old, part new, and on zarr raised CorruptChunkError for the slot left odd),
    and its next store, a reopen and verify go on clean."""
    buffer = make(place, circular=True)
    for uid in range(2):
        buffer.store_episode(**episode(uid), uid=uid)
    cases = [("write_meta", k) for k in (1, 2, 3)] + [("update_rows", k) for k in (1, 2)]
    for method, k in cases:
        old = int(buffer.meta_data["uid"][0])
        calls = interrupt_at(monkeypatch, buffer.storage, method, k, after=True)
        with pytest.raises(KeyboardInterrupt):
            buffer.update(0, **episode(old + 10), uid=old + 10)
        monkeypatch.undo()
        assert calls[0] >= k  # and those of finishing it
        assert stored(buffer, [0]) == {old + 10: 0}, f"interrupted after {method} {k}"
    buffer.store_episode(**episode(5), uid=5)
    expected = stored(buffer)
    buffer.close()
    reopened(place, expected)


@pytest.mark.parametrize("backend", ["zarr"])  # the commit protocol is every backend's
def test_store_episode_interrupted_after_any_meta_write_agrees_with_storage(place, monkeypatch):
    """A ``store_episode`` interrupted after any of its meta writes (its length among them) is
    published or not, alike for the object and for storage; the next one takes the next slot
    and generation either way. Interrupted once its length was stored, the object took it as
    not published: a reader saw it, and the object's next episode overwrote it in that slot,
    with its generation, without unpublishing it first; or (interrupted between the counters'
    two assignments) every later commit failed with KeyError 'num_episodes'."""
    for k in range(1, 20):
        buffer = make(place, circular=True)
        buffer.store_episode(**episode(0), uid=0)
        calls = interrupt_at(monkeypatch, buffer.storage, "write_meta", k, after=True)
        with contextlib.suppress(KeyboardInterrupt):
            buffer.store_episode(**episode(1), uid=1)
        monkeypatch.undo()
        kept = stored(buffer)
        assert kept in ({0: 0}, {0: 0, 1: 1}), f"k={k}"
        with ReplayBuffer.from_folder(place.location, read_only=True, **place.kwargs) as reader:
            assert stored(reader) == kept, f"k={k}: the writer and what it stored disagree"
        buffer.store_episode(**episode(2), uid=2)
        assert stored(buffer) == {**kept, 2: len(kept)}, f"k={k}"
        generations = np.asarray(buffer.generations)[buffer.valid_episodes()]
        assert len(set(generations.tolist())) == len(generations), f"k={k}: generations {generations}"
        buffer.close()
        reopened(place, {**kept, 2: len(kept)})
        if calls[0] < k:  # not interrupted: every write was
            break
    assert k > 3


CTRL_C_DURING_A_COLLECTION = """
import gc, signal, sys, time
import replaybuf.storage.lease
assert len(gc.callbacks) == 1, gc.callbacks  # replaybuf's alone: no other callback may drop it
cycles = [[i] for i in range(300_000)]
for cycle in cycles:
    cycle.append(cycle)
del cycles, cycle
signal.signal(signal.SIGALRM, signal.default_int_handler)  # a Ctrl-C, at a known time
try:
    signal.setitimer(signal.ITIMER_REAL, 0.002)
    gc.collect()  # the timer fires in its C traversal: the next bytecode handles it
    time.sleep(1)
except KeyboardInterrupt:
    sys.exit(0)
sys.exit(3)
"""


def test_a_ctrl_c_during_a_garbage_collection_is_not_lost():
    """replaybuf's ``gc.callbacks`` entry runs no bytecode: a Python callback there was the first
    code a Ctrl-C met when it landed during a collection, and gc dropped its KeyboardInterrupt
    ("Exception ignored in"): the demo and a training loop ran on (1 in 7 Ctrl-C of the demo)."""
    import subprocess

    run = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_A_COLLECTION],
        env={**os.environ, "PYTHONPATH": os.path.dirname(PACKAGE)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and "Exception ignored" not in run.stderr, run.stderr
