"""An in-place edit of committed episodes is crash-atomic: a writer SIGKILLed part way through
one edit call (``update``, ``update_steps``, ``data[...] = ...``, ``meta_data[...] = ...``,
``store_batch_meta_datapoint``) leaves, once the next writable open has run, every (field,
episode) pair that call touched holding its old values or every one its new values (the call is
logged before any of it is applied and rolled forward), never a mix; and ``verify`` finds
nothing.

Each edit call ``k`` writes one version, ``k + 1``, into everything it touches, so the state
after any prefix of calls is known (``simulate``) and the reopened buffer must equal the state
before the last call begun or after it.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from replaybuf import ReplayBuffer
from replaybuf.maintenance import verify

from ._backends import LOCAL_BACKENDS
from .test_crash import FORK, committed

EPISODES, STEPS = 6, 20
FIELDS = {
    "img": {"dtype": "uint8", "shape": [16, 16, 3]},  # image-sized: a shard (zarr) per episode
    "obs": {"dtype": "float32", "shape": [4], "chunks": 4},  # an episode spans several chunks
}
META_FIELDS = {"score": "float", "tag": "int"}
NAMES = [*FIELDS, *META_FIELDS]
KINDS = ["update", "update_some", "update_steps", "data_img", "data_obs", "meta_score", "meta_tag"]
SEED = 20261204


def make_buffer(place) -> None:
    """A committed buffer of EPISODES full episodes, every value version 0 (zeros)."""
    with ReplayBuffer(
        place.location,
        max_episodes=EPISODES,
        max_timesteps=STEPS,
        fields=FIELDS,
        meta_fields=META_FIELDS,
        **place.kwargs,
    ) as buffer:
        for _ in range(EPISODES):
            buffer.store_episode(
                img=np.zeros((STEPS, 16, 16, 3), np.uint8), obs=np.zeros((STEPS, 4), np.float32), score=0.0, tag=0
            )


def edit_call(k: int) -> dict:
    """Edit call ``k`` of the sequence (the same in the writer and the checker): its kind, the
    episodes it touches (3 or more), the steps of the data fields it writes."""
    rng = np.random.default_rng([SEED, k])
    kind = KINDS[k % len(KINDS)]
    episodes = np.sort(rng.choice(EPISODES, size=int(rng.integers(3, EPISODES + 1)), replace=False))
    call = {"kind": kind, "episodes": episodes}
    if kind == "update_steps":  # 2 to 4 distinct steps per episode
        steps = [np.sort(rng.choice(STEPS, size=int(rng.integers(2, 5)), replace=False)) for _ in episodes]
        call["pairs"] = (np.repeat(episodes, [len(s) for s in steps]), np.concatenate(steps))
    elif kind.startswith("data_"):
        t0 = int(rng.integers(0, STEPS - 1))
        call["steps"] = (t0, int(rng.integers(t0 + 1, STEPS + 1)))
    return call


def fields_of(call: dict) -> list[str]:
    kind = call["kind"]
    if kind == "update":
        return NAMES
    if kind == "update_some":
        return ["obs", "tag"]
    if kind == "update_steps":
        return ["img", "obs"]
    return [kind.split("_", 1)[1]]


def value(name: str, v: int):
    """Version ``v`` of field ``name`` as written."""
    return {"img": np.uint8(v % 256), "obs": np.float32(v), "score": float(v), "tag": v}[name]


def whole(name: str, v: int, episodes: np.ndarray):
    """``update``'s value of version ``v`` for ``episodes``: every step of data field ``name``
    (a scalar would write step 0 only), one value per episode of a meta field."""
    if name in FIELDS:
        return np.full((len(episodes), STEPS, *FIELDS[name]["shape"]), value(name, v))
    return value(name, v)


def apply(buffer: ReplayBuffer, k: int) -> None:
    """Writer side: perform edit call ``k`` through the API its kind names."""
    call, v = edit_call(k), k + 1
    kind, episodes = call["kind"], call["episodes"]
    if kind in ("update", "update_some"):
        buffer.update(episodes, **{name: whole(name, v, episodes) for name in fields_of(call)})
    elif kind == "update_steps":
        buffer.update_steps(*call["pairs"], img=value("img", v), obs=value("obs", v))
    elif kind.startswith("data_"):
        name, (t0, t1) = fields_of(call)[0], call["steps"]
        buffer.data[name][episodes, t0:t1] = value(name, v)
    elif kind == "meta_score":
        buffer.meta_data["score"][episodes] = value("score", v)
    else:
        buffer.store_batch_meta_datapoint(episodes, "tag", value("tag", v))


def initial_state() -> dict[str, np.ndarray]:
    return {
        "img": np.zeros((EPISODES, STEPS, 16, 16, 3), np.uint8),
        "obs": np.zeros((EPISODES, STEPS, 4), np.float32),
        "score": np.zeros(EPISODES, np.float64),
        "tag": np.zeros(EPISODES, np.int64),
    }


def simulate(state: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Checker side: ``state`` after edit call ``k`` (a copy)."""
    call, v = edit_call(k), k + 1
    state = {name: array.copy() for name, array in state.items()}
    kind, episodes = call["kind"], call["episodes"]
    for name in fields_of(call):
        if kind == "update_steps":
            state[name][call["pairs"]] = value(name, v)
        elif kind.startswith("data_"):
            t0, t1 = call["steps"]
            state[name][episodes, t0:t1] = value(name, v)
        else:
            state[name][episodes] = value(name, v)
    return state


def read_state(location: str) -> dict[str, np.ndarray]:
    """Every value of the buffer, read through a read-only open."""
    with ReplayBuffer.from_folder(location, read_only=True) as reader:
        assert reader.episode_lens[:EPISODES].tolist() == [STEPS] * EPISODES
        state = {name: np.asarray(reader.data[name][:EPISODES]) for name in FIELDS}
        state.update((name, np.asarray(reader.meta_data[name][:EPISODES])) for name in META_FIELDS)
    return state


def describe_torn(name: str, episode: int, found: np.ndarray, old: np.ndarray, new: np.ndarray) -> str:
    """What a pair holding neither its old nor its new values holds: for a data field, the steps
    the edit changes that hold the new values, the old ones, or neither."""
    if name in META_FIELDS:
        return f"{name!r} of episode {episode} holds {found}, neither {old} nor {new}"
    axes = tuple(range(1, found.ndim))
    is_old, is_new = (np.all(found == x, axis=axes) for x in (old, new))
    changed = ~np.all(old == new, axis=axes)
    steps = {
        "new": np.flatnonzero(changed & is_new),
        "old": np.flatnonzero(changed & ~is_new & is_old),
        "neither": np.flatnonzero(~is_new & ~is_old),
    }
    return f"{name!r} of episode {episode}: " + ", ".join(f"steps {s.tolist()} {k}" for k, s in steps.items() if len(s))


def recover_and_check(location: str, state: dict[str, np.ndarray], last: int, what: str) -> dict[str, np.ndarray]:
    """After a writer was killed with edit call ``last`` begun (every earlier one done, from
    ``state`` on): reopen writable (which finishes or rolls forward what the writer left), read
    back read-only and assert that the buffer holds the state before call ``last`` or after it,
    whole; ``verify`` finds nothing. Return the state found."""
    ReplayBuffer.from_folder(location).close()
    found = read_state(location)
    old, new = state, simulate(state, last)
    call = edit_call(last)
    touched = [(name, int(e)) for name in fields_of(call) for e in call["episodes"]]
    torn, olds, news = [], [], []
    for name in NAMES:
        for e in range(EPISODES):
            is_old = np.array_equal(found[name][e], old[name][e])
            is_new = np.array_equal(found[name][e], new[name][e])
            if (name, e) not in touched:
                assert is_old, f"{what}: {name!r} of episode {e}, untouched by call {last}, changed"
            elif not (is_old or is_new):
                torn.append(describe_torn(name, e, found[name][e], old[name][e], new[name][e]))
            elif is_old != is_new:
                (olds if is_old else news).append((name, e))
    assert not torn, f"{what}: call {last} ({call['kind']}) left pairs torn within: {torn}"
    assert not (olds and news), (
        f"{what}: call {last} ({call['kind']}, fields {fields_of(call)}, episodes {call['episodes'].tolist()}) "
        f"is half applied after the writable reopen: new values in {news}, old values in {olds}"
    )
    assert verify(location) == [], f"{what}: verify after the reopen"
    return new if news else old


def _edit_until_killed(location: str, first: int, progress: str) -> None:
    """Child: perform edit calls ``first``, ``first + 1``, ... reporting each to ``progress``
    before it begins, until killed."""
    buffer = ReplayBuffer.from_folder(location)
    with open(progress, "a") as report:
        for k in range(first, first + 100_000):
            report.write(f"{k}\n")
            report.flush()
            apply(buffer, k)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_edits_killed_at_random_moments_are_whole_after_the_reopen(place, tmp_path, backend):
    """Random SIGKILLs of a writer looping over edit calls of every kind: after each, the
    writable reopen leaves the last call begun all applied or not at all, the earlier ones
    applied, and verify clean."""
    make_buffer(place)
    rng = np.random.default_rng([SEED, LOCAL_BACKENDS.index(backend)])
    state, first = initial_state(), 0
    for round_ in range(6):
        progress = tmp_path / f"progress-{round_}"
        writer = FORK.Process(target=_edit_until_killed, args=(place.location, first, str(progress)))
        writer.start()
        wanted = int(rng.integers(1, 2 * len(KINDS)))  # calls begun before the kill, at least
        while len(committed(progress)) < wanted and writer.is_alive():
            time.sleep(0.001)
        time.sleep(float(rng.uniform(0, 0.01)))  # where the kill lands: not what is checked
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(30)
        assert writer.exitcode == -signal.SIGKILL, "the writer must have been killed, not have finished or failed"
        begun = committed(progress)
        assert begun, "the writer began no edit before the kill"
        for k in begun[:-1]:  # done before the last one began
            state = simulate(state, k)
        state = recover_and_check(place.location, state, begun[-1], f"{backend} round {round_}")
        first = begun[-1] + 1


def _kill_in_call(location: str, kind: str, at: int) -> None:
    """Child: perform one edit call of ``kind`` (call 0's version, 1) on episodes 0, 2, 4 (and
    every step 0..3 of them for update_steps), SIGKILLed as its storage writes reach the
    ``at``-th distinct field of the call: between two writes of one call."""
    buffer = ReplayBuffer.from_folder(location)
    storage, seen = buffer.storage, []

    def dying(method):
        def write(name, *args):
            if name in NAMES and name not in seen:
                seen.append(name)
                if len(seen) == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return method(name, *args)

        return write

    for method in ("update_rows", "update_steps", "write_meta"):
        setattr(storage, method, dying(getattr(storage, method)))
    episodes = np.array([0, 2, 4])
    if kind == "update":
        buffer.update(episodes, **{name: whole(name, 1, episodes) for name in NAMES})
    else:
        buffer.update_steps(np.repeat(episodes, 4), np.tile(np.arange(4), 3), img=1, obs=1.0)
    os._exit(3)  # the call ended without reaching its ``at``-th field


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize("kind, at", [("update", 2), ("update", 3), ("update", 4), ("update_steps", 2)])
def test_an_edit_killed_between_its_writes_is_all_old_or_all_new_after_the_reopen(place, backend, kind, at):
    """A writer SIGKILLed inside one update() (or update_steps()) of several fields and episodes,
    between the writes of two of its fields: once the next writable open has run, every pair
    the call touched holds the old values or every one the new (rolled forward), verify clean."""
    make_buffer(place)
    child = FORK.Process(target=_kill_in_call, args=(place.location, kind, at))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL, (
        f"the writer must die inside the call (exit code {child.exitcode}; 3: it never wrote a {at}th field)"
    )
    episodes = np.array([0, 2, 4])
    old, new = initial_state(), initial_state()
    names = NAMES if kind == "update" else ["img", "obs"]
    for name in names:
        if kind == "update":
            new[name][episodes] = value(name, 1)
        else:
            new[name][episodes, :4] = value(name, 1)
    ReplayBuffer.from_folder(place.location).close()
    found = read_state(place.location)
    holds = {
        (name, int(e)): "new" if np.array_equal(found[name][e], new[name][e]) else "old"
        for name in names
        for e in episodes
        if np.array_equal(found[name][e], new[name][e]) or np.array_equal(found[name][e], old[name][e])
    }
    torn = sorted({(name, int(e)) for name in names for e in episodes} - set(holds))
    assert not torn, f"{backend}: {kind} killed at its field {at}: pairs torn within {torn}"
    for name in set(NAMES) - set(names):
        np.testing.assert_array_equal(found[name], old[name], err_msg=f"{name!r}, untouched, changed")
    for name in names:
        others = np.setdiff1d(np.arange(EPISODES), episodes)
        np.testing.assert_array_equal(found[name][others], old[name][others], err_msg=f"{name!r}, untouched episodes")
    assert len(set(holds.values())) == 1, (
        f"{backend}: {kind} of {names} in episodes {episodes.tolist()} killed at its field {at} is half "
        f"applied after the writable reopen: new in {sorted(k for k, s in holds.items() if s == 'new')}, "
        f"old in {sorted(k for k, s in holds.items() if s == 'old')}"
    )
    assert verify(place.location) == []
